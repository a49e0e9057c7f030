"""`moepack generate`: the streamed layer-major prefill of a prompt, then token-major decode (runtime/decode.py)
with the routed experts through an expert cache, on one container opened once.

    result = generate("model.moepack", prompt_ids, GenerateOptions(max_new_tokens=64))
    result.generated_ids, result.text, result.finish_reason, result.stats["prefill"], result.stats["decode"]

`continue_from`: a KV directory `moepack prefill --kv-out` wrote for this container; the prompt ids (possibly
none) continue it.
"""

from __future__ import annotations

import math
import os
import resource
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from moepack.families import check_container
from moepack.families import kv_directory as kvd
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.reader import Container

from .decode import Decoder
from .engine import (EXPERT_DTYPES, GenerationCancelled, PrefillOptions, StreamingPrefill, compute_device,
                     container_kv_format, joined_prompt_logprobs, prompt_ids, resolve_compute_dtype)
from .memory import GIB, cache_room, check_device_memory, check_memory, default_cache_bytes, device_kv, others_kv
from .read_scheduler import prefill_reader
from .sampling import IncrementalDetokenizer, Sampler, StopMatcher, TokenLogprob, check_alternatives, is_int


@dataclass
class GenerateOptions:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # the expert cache's budget; 0: every selected expert read for every token; None: default_cache_bytes, fitted
    # to each generation (never refused where 0 runs)
    cache_gib: float | None = None
    stop_at_eos: bool = True
    prefill: PrefillOptions = field(default_factory=PrefillOptions)
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from each token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per time a token was generated
    logit_bias: dict[int, float] | None = None  # added to the logits of these token ids
    logprobs: int | None = None  # each token's log-probability and this many alternatives (GenerateResult.logprobs)
    constraint: object | None = None  # the allowed next tokens (serve/grammar.py), one generation's own state
    min_new_tokens: int = 0  # the end of sentence held back until this many tokens were generated
    repetition_penalty: float = 1.0  # transformers' / vLLM's: every token the sequence holds made less likely
    min_p: float = 0.0  # tokens less likely than min_p x the likeliest's probability left out
    # the prompt's own tokens' log-probabilities, each with this many alternatives (GenerateResult.prompt_logprobs)
    prompt_logprobs: int | None = None
    prompt_logprob_ranks: bool = False  # and each one's rank (vLLM's prompt_logprobs: the head runs over them twice)
    # tokens that end the generation as the end of sentence does (vLLM's stop_token_ids), stop_at_eos or not
    stop_token_ids: tuple[int, ...] = ()
    # the stop string (or a stop_token_ids token's text) that ended the answer kept at its end (vLLM's
    # include_stop_str_in_output)
    include_stop: bool = False
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: only these ids can be chosen
    # vLLM's bad_words as token sequences (sampling.bad_word_ids): none completed in the generated tokens
    bad_words: tuple[tuple[int, ...], ...] = ()
    # a BatchScheduler's prompt cache may give the prompt's start and keep its states (llama-server's cache_prompt)
    cache_prompt: bool = True
    # and keeps the state after this many of the prompt's tokens too (the part a chat's next turn renders again)
    snapshot_at: int | None = None

    def sampler(self, eos_ids: tuple[int, ...] = ()) -> Sampler:
        return Sampler(self.temperature, self.top_p, self.top_k, self.seed, presence_penalty=self.presence_penalty,
                       frequency_penalty=self.frequency_penalty, logit_bias=self.logit_bias,
                       logprobs=self.logprobs, constraint=self.constraint, held_back=eos_ids,
                       held_for=self.min_new_tokens, repetition_penalty=self.repetition_penalty, min_p=self.min_p,
                       allowed=self.allowed_token_ids, bad_words=self.bad_words)


@dataclass
class GenerateResult:
    generated_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" (end of sentence or a stop string) or "length"
    stats: dict
    logprobs: list[TokenLogprob] | None = None  # per generated token, given options.logprobs
    # per prompt token, given options.prompt_logprobs: None for the first (nothing before it; a continued KV's
    # logits give it one)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    stop_string: str | None = None  # the stop string that ended it (finish_reason "stop"; None: another end)


def eos_ids(config: dict) -> set[int]:
    eos = config.get("eos_token_id") if isinstance(config, dict) else None
    if isinstance(eos, list):
        return {i for i in eos if isinstance(i, int)}
    return {eos} if isinstance(eos, int) else set()


def model_eos_ids(container: Container) -> set[int]:
    """A model's end-of-sequence ids: its config's and its generation_config.json's (transformers' generate stops
    at the latter), where the container carries one."""
    # (a damaged optional file: the config's ids stand)
    return eos_ids(container.config) | eos_ids(container.tokenizer_json("generation_config.json"))


class Generator:
    """One container opened once for any number of generations: its non-routed weights stay resident (the
    prefill and the decode both use them) and its expert cache persists from one generation to the next (what
    `moepack serve` keeps). generate() runs one generation at a time; runtime/batching.py's BatchScheduler decodes
    several together over one Generator (its worker thread then alone uses the decoder).

        with Generator("model.moepack", cache_gib=4) as g:
            g.generate(prompt_ids, GenerateOptions(max_new_tokens=64))

    `cache_gib` None: the default budget (default_cache_bytes), lowered for a generation whose KV needs its room
    (the least recently used experts go) and raised again after, up to that default."""

    def __init__(self, path: str, cache_gib: float | None = None, prefill: PrefillOptions | None = None):
        if cache_gib is not None and cache_gib < 0:
            raise MoepackError("--cache-gib must be >= 0")
        self.path = path
        self.prefill_options = prefill or PrefillOptions()
        self.c = Container(path)
        try:
            self.family, self.cfg = check_container(self.c)
            self.eos_ids = model_eos_ids(self.c)
            p = self.prefill_options
            self.device = compute_device(p.device)
            self.default_budget = default_cache_bytes(self.c, self.device) if cache_gib is None else None
            self.cache_bytes = int(cache_gib * GIB) if cache_gib is not None else self.default_budget
            # on a GPU the cache lives on the device: the host holds none of it
            self.host_cache_bytes = self.cache_bytes if self.device.type == "cpu" else 0
            check_memory(self.c, 1, self.host_cache_bytes)
            if self.device.type == "cuda":
                check_device_memory(self.c, self.device, self.cache_bytes)
            # resolved once: the prefill and the decoder's resident weights must agree
            p, self.compute_dtype_source = resolve_compute_dtype(p, self.device)
            self.prefill_options = p
            # one reader for the prefill's reads and the decode's misses: one io mode chosen, one set of descriptors
            self.reader = prefill_reader(self.c, p.io_mode, self.device)
            self.decoder = Decoder(self.c, self.cfg, self.device, self.cache_bytes,
                                   compute_dtype=EXPERT_DTYPES[p.compute_dtype],
                                   expert_dtype=EXPERT_DTYPES[p.expert_dtype or p.compute_dtype],
                                   io_mode=p.io_mode, verify_reads=p.verify_reads, family=self.family,
                                   reader=self.reader)
            self._engine: StreamingPrefill | None = None  # opened by the first prefill, then kept
            # host copies of states a BatchScheduler keeps (runtime/prompt_cache.py): the memory checks count them
            self.prompt_cache = None
            self._engine_options: PrefillOptions | None = None  # the prefill_options it was opened with
        except BaseException:
            if getattr(self, "reader", None) is not None:
                self.reader.close()
            self.c.close()
            raise

    def _check_memory(self, n_tokens: int, others: Sequence[int] = (), host_copies: Sequence[int] = (),
                      freeable: int = 0) -> int:
        """check_memory for a generation of n_tokens (beside sequences of `others` tokens each, prompt and new
        tokens, decoding or prefilling: their KV counted whole, as if none of it were allocated yet; and copies of
        KVs of `host_copies` tokens each, kept in host memory); on a GPU also the device's room for the KV (with
        what the decode's arena may still grow by for all of them: device_kv) and the rest of the cache's budget.
        `freeable`: bytes of the prompt cache's that would be given back first (held, not needed). Returns the host
        bound."""
        host_kv = others_kv(self.c, [*others, *host_copies]) + self._prompt_cache_bytes() - freeable
        if self.device.type == "cpu":
            others = [*others, *host_copies]
        if self.default_budget is not None:
            self._fit_default_cache(n_tokens, others)
        if self.device.type == "cuda":
            kv = device_kv(self.c, self.device, n_tokens, others, self.decoder.arithmetic)
            check_device_memory(self.c, self.device, max(0, self.cache_bytes - self._device_cache_held()), kv,
                                resident=False)
        return check_memory(self.c, n_tokens, self.host_cache_bytes, self._held(), host_kv)

    def _device_cache_held(self) -> int:
        """What the cache holds already of the device's memory: its entries, or the expert pool's stacks, which
        take their whole capacity at the first expert kept (cuda_free_bytes no longer counts them)."""
        pool = self.decoder.pool
        return max(self.decoder.cache.bytes, pool.reserved_bytes if pool is not None else 0)

    def _held(self) -> int:
        """What this process holds already of a generation's host memory: the resident weights, the cache and the
        prompt cache's copies."""
        return (self.decoder.host_resident_bytes + (self.decoder.cache.bytes if self.device.type == "cpu" else 0)
                + self._prompt_cache_bytes())

    def _prompt_cache_bytes(self) -> int:
        return self.prompt_cache.nbytes if self.prompt_cache is not None else 0

    def _fit_default_cache(self, n_tokens: int, others: Sequence[int] = ()) -> None:
        """The default budget for a generation of n_tokens: what the checks leave beside its KV and that of
        `others` (clamped at 0), at most default_cache_bytes."""
        held = self._device_cache_held() if self.device.type == "cuda" else self._held()
        self.cache_bytes = cache_room(self.c, self.device, n_tokens, others, held, self.default_budget,
                                      self.decoder.arithmetic, self._prompt_cache_bytes())
        self.host_cache_bytes = self.cache_bytes if self.device.type == "cpu" else 0
        self.decoder.cache.resize(self.cache_bytes)

    def __enter__(self) -> "Generator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        self.decoder.close()
        self.reader.close()
        self.c.close()

    def _prefill(self, token_ids: torch.Tensor, continue_from: str | None, max_new: int,
                 should_stop: Callable[[], bool] | None = None, prompt_copy: bool = False,
                 scored: int | None = None, ranked: bool = False) -> "_Prefilled":
        """The prompt's prefill, after `continue_from`'s KV where given. `prompt_copy`: a copy of the prompt's KV will
        be kept beside the generation's (generate's KV cut at a stop string): the memory check counts it.
        `scored` k: the prompt's log-probabilities too (_Prefilled.prompt_logprobs), `ranked` with their ranks."""
        kv_format = self.kv_format() if continue_from is not None else None
        engine = self.prefill_engine()
        try:
            if continue_from is not None:
                kv = kvd.read_kv(continue_from, kv_format, expect_identity=kvd.identity_of_container(self.c))
                kvd.kv_dtype_warning(kv, self.prefill_options.compute_dtype)
                states, past = kv.layers, kv.seen_tokens
                all_ids = kv.token_ids + token_ids.tolist()
                prompt = past + len(token_ids)
                bound = self._check_memory(prompt + max_new, host_copies=[prompt] if prompt_copy else [])
                scores = [] if scored is not None else None
                if len(token_ids):
                    done = engine.run(token_ids.to(engine.device), states, keep_kv=True, should_stop=should_stop,
                                      prompt_logprobs=scored, ranked=ranked)
                    logits, states, stats, counts = done.logits, done.states, done.stats, done.tokens_per_expert
                    if scored is not None:
                        scores = joined_prompt_logprobs(kv.logits, token_ids, scored, done.prompt_logprobs, ranked)
                elif kv.logits is not None:
                    logits, stats, counts = kv.logits, {"tokens": 0}, None
                else:
                    raise MoepackError(f"{continue_from}: the KV holds no logits to continue from: give a prompt")
                stats = {**stats, "continued_from": continue_from, "past_tokens": past}
                return _Prefilled(logits, states, stats, counts, all_ids, past, bound, kv, scores)
            if not len(token_ids):
                raise MoepackError("empty prompt")
            bound = self._check_memory(len(token_ids) + max_new, host_copies=[len(token_ids)] if prompt_copy else [])
            done = engine.run(token_ids.to(engine.device), keep_kv=True, should_stop=should_stop,
                              prompt_logprobs=scored, ranked=ranked)
            scores = None if scored is None else joined_prompt_logprobs(None, token_ids, scored, done.prompt_logprobs,
                                                                        ranked)
            return _Prefilled(done.logits, done.states, done.stats, done.tokens_per_expert, token_ids.tolist(), 0,
                              bound, None, scores)
        finally:
            engine.after_prompt()

    def prefill_engine(self) -> StreamingPrefill:
        """The prefill of this Generator's sequences (each one or more runs of its prompt's chunks), opened once and
        kept: its read pools, threads and buffers serve every generation (each pass gives back what it read, however
        it ended: StreamingPrefill._pass). It runs through the decoder's resident dense weights (only the experts
        are read), and a prompt's experts go from its reads into the expert cache while there is room (seeding
        need not read them again). Its callers call its after_prompt() once a sequence's prefill is through, not
        its close() (one closed anyway is opened again here)."""
        self.decoder.prefill_starts()
        if self._engine is not None and self._engine_options is not self.prefill_options:
            self._engine.close()  # prefill_options replaced since it opened (a caller's on_layer, say): opened again
        if self._engine is None or self._engine.closed:
            self._engine_options = self.prefill_options
            # (not where the cache keeps decoded experts on a GPU: they would take the device memory the prefill
            # counted on having, and decoding them would stall its stream; the seed reads them after it)
            keep = None if self.decoder.decoded else self.decoder.keep_from_prefill
            self._engine = StreamingPrefill(self.c, self.prefill_options, resident_dense=self.decoder.dense,
                                            keep_expert=keep, reader=self.reader)
        return self._engine

    def generate(self, token_ids, options: GenerateOptions | None = None, continue_from: str | None = None,
                 detokenize: Callable[[list[int]], str] | None = None, on_text: Callable[[str], None] | None = None,
                 kv_out: str | None = None, cancelled: Callable[[], bool] | None = None,
                 kv_overwrite: bool = False, kv_dtype: str = "F32",
                 on_token: Callable[[int, TokenLogprob | None], None] | None = None,
                 on_prompt_logprobs: Callable[[list], None] | None = None) -> GenerateResult:
        """Prefill `token_ids` (after `continue_from`'s KV, if given), then decode up to max_new_tokens.
        `detokenize` (ids -> text) gives `text`, lets `--stop` strings end the generation, and `on_text` the text
        as it comes (never a split UTF-8 character, never the start of a stop string that may yet complete).
        `kv_out`: the KV after the generation (the prompt and every generated token, the last one fed too; its
        result, the greedy token after them) is written there, its entries stored as `kv_dtype` (a KV already there
        is refused unless `kv_overwrite`). `cancelled()` true ends the generation (finish_reason "cancelled"):
        asked between the prefill's layers (the first time once every check has passed) and between decoded tokens.
        `on_token(id, logprob)`: each token as it is chosen, before its text goes to on_text (logprob given
        options.logprobs, else None); `on_prompt_logprobs(entries)` before the first (GenerateResult.prompt_logprobs,
        given options.prompt_logprobs)."""
        out = SequenceOutput(options or GenerateOptions(), self.eos_ids, detokenize, on_text, on_token,
                             on_prompt_logprobs)
        kv_format = self.kv_format() if kv_out is not None else None  # refused before any work
        # a stop string's tokens are not shown: the KV then holds the prompt and the shown tokens only, continued
        # from a copy of the prompt's state (a decode may continue a state in place)
        prompt_copy = kv_out is not None and bool(out.stopper.stop)
        token_ids = prompt_ids(token_ids)
        try:
            logits, states, prefill_stats, counts, all_ids, past, bound, continued, out.prompt_logprobs = self._prefill(
                token_ids, continue_from, out.max_new_tokens, cancelled, prompt_copy, out.prompt_logprobs_k,
                out.prompt_ranked)
            out.sampler.saw(all_ids)
        except GenerationCancelled as e:  # the engine's pass gave back what it had read: it serves the next
            return cancelled_in_prefill(e, detokenize)
        prefill_stats = self.prefill_stats(prefill_stats)
        decoder = self.decoder
        prompt = (kvd.copied_states(kv_format, self.c.config, states), logits) if prompt_copy else None
        decoder.begin(states)
        del states
        while not out.take(logits):
            if cancelled is not None and cancelled():
                out.cancel()
                break
            if counts:  # once the first token is out: warming the cache does not delay it
                decoder.seed(counts)
                counts = None
            logits = decoder.step(out.last)
        decode_stats = {**decoder.stats_dict(), "memory_bound_bytes": bound, "peak_rss_bytes": peak_rss_bytes()}
        result = out.result({"prefill": prefill_stats, "decode": decode_stats})
        if kv_out is not None:
            in_place = continue_from is not None and os.path.realpath(kv_out) == os.path.realpath(continue_from)
            ids, states, logits = self._kv_after(out, prompt)
            writer = kvd.open_writer(kv_out, kv_format, kvd.identity_of_container(self.c), all_ids + ids,
                                     dtype=kv_dtype, start_token=past, overwrite=in_place or kv_overwrite,
                                     extra=kvd.computed_in(self.prefill_options.compute_dtype, continued))
            kvd.write_kv_states(writer, states, int(torch.argmax(logits)), logits)
            result.stats["kv_out"] = {"generated_tokens": len(ids), "dropped_tokens": len(out.generated) - len(ids)}
        return result

    def _kv_after(self, out: "SequenceOutput", prompt: tuple | None) -> tuple[list[int], list, torch.Tensor]:
        """(the generated ids the KV holds, its states, the logits after them). Every token whose text was shown,
        the last one fed too, so that a continuation (a next turn's prompt, or none) goes on after it as after a
        prefill's prompt; the KV's result is the greedy token after all of it. Tokens a stop string hid (its own,
        and any after the last whole token before it) are not in it: the shown ones are prefilled again after the
        prompt's state (`prompt`: a copy of it and its logits)."""
        shown = out.shown_tokens()
        if prompt is None or shown == len(out.generated):
            logits = self.decoder.step(out.last)  # (before its states are taken: they then hold the last token)
            return out.generated, self.decoder.states, logits
        states, logits = prompt
        if shown:
            engine = self.prefill_engine()
            try:
                done = engine.run(torch.tensor(out.generated[:shown]).to(engine.device), states, keep_kv=True)
            finally:
                engine.after_prompt()
            states, logits = done.states, done.logits
        return out.generated[:shown], states, logits

    def kv_format(self):
        """The KV directory format of this container's model (--continue-from, --kv-out)."""
        return container_kv_format(self.c)

    def prefill_stats(self, stats: dict) -> dict:
        """A prefill's stats with the compute dtype it ran in and where that came from."""
        return {**stats, "compute_dtype": self.prefill_options.compute_dtype,
                "compute_dtype_source": self.compute_dtype_source}


class _Prefilled(NamedTuple):
    """What a generation's prefill leaves (Generator._prefill)."""

    logits: torch.Tensor  # after the prompt's last token
    states: list  # each layer's KV
    stats: dict  # the prefill's
    tokens_per_expert: Any  # what seeds the expert cache (None: nothing to seed)
    all_ids: list[int]  # the sequence's ids so far: a continued KV's, then the prompt's
    past: int  # tokens the continued KV held (0: none continued)
    memory_bound: int  # bytes the memory check counted on
    continued: Any  # the KV read (kv.py's), or None
    prompt_logprobs: list | None  # the prompt's (GenerateResult.prompt_logprobs), where asked for


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cancelled_in_prefill(e: GenerationCancelled, detokenize) -> GenerateResult:
    """The result of a generation stopped during its prefill (no token)."""
    return GenerateResult([], "" if detokenize is not None else None, "cancelled",
                          {"prefill": {"cancelled_after_layers": e.layers_done}, "decode": {}})


class SequenceOutput:
    """What one sequence does with each next position's logits, wherever they come from (Generator.generate's
    decode, or a step of runtime/batching.py's scheduler): sample its token with its own Sampler (seed, penalties,
    constraint), record it (and its logprobs), hand it to `on_token`, give its safe text to `on_text` and decide
    whether the sequence is over (end of sentence, a stop string, max_new_tokens). The options are checked when it is
    made, before any work. Its prefill sets `prompt_logprobs` (given options.prompt_logprobs), handed to
    `on_prompt_logprobs` before the first token."""

    def __init__(self, options: GenerateOptions, eos_ids: set[int],
                 detokenize: Callable[[list[int]], str] | None = None,
                 on_text: Callable[[str], None] | None = None,
                 on_token: Callable[[int, TokenLogprob | None], None] | None = None,
                 on_prompt_logprobs: Callable[[list], None] | None = None):
        if options.max_new_tokens < 1:
            raise MoepackError("--max-new-tokens must be at least 1")
        if not all(is_int(t) and t >= 0 for t in options.stop_token_ids):
            raise MoepackError(f"stop_token_ids must be token ids (integers >= 0), got {options.stop_token_ids!r}")
        if options.stop and detokenize is None:
            raise MoepackError("--stop needs the container's tokenizer (the prompt was given as token ids)")
        self.max_new_tokens, self.min_new_tokens = options.max_new_tokens, options.min_new_tokens
        ends = set(options.stop_token_ids) | (set(eos_ids) if options.stop_at_eos else set())
        # (a minimum length holds back every token that would end it, as vLLM's min_tokens)
        self.sampler = options.sampler(tuple(sorted(set(eos_ids) | set(options.stop_token_ids))))
        self.stopper = StopMatcher(list(options.stop), ends, options.include_stop)
        # include_stop keeps the text of a stop token the caller named, as vLLM's include_stop_str_in_output
        # detokenizes the token that stopped it (the end of sentence's own text is never part of the answer)
        self.shown_stop_ids = set(options.stop_token_ids) - set(eos_ids) if options.include_stop else set()
        self.detokenize, self.on_text, self.on_token = detokenize, on_text, on_token
        self.on_prompt_logprobs = on_prompt_logprobs
        self.pieces = IncrementalDetokenizer(detokenize) if detokenize is not None else None
        self.generated: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if options.logprobs is not None else None
        check_alternatives("prompt_logprobs", options.prompt_logprobs)
        self.prompt_logprobs_k = options.prompt_logprobs  # (its prefill's to compute: GenerateResult.prompt_logprobs)
        self.prompt_ranked = options.prompt_logprob_ranks
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.so_far = ""  # the text of every token so far
        self.cancelled = False

    @property
    def last(self) -> int:
        """The token chosen last: what the next step feeds."""
        return self.generated[-1]

    def take(self, logits: torch.Tensor, chosen: int | None = None) -> bool:
        """The next token chosen from `logits` ([vocab]; `chosen`: it, found with a batch's other rows where the
        sampler is plain_greedy) and given out; True once the sequence is over."""
        sampler = self.sampler
        if not self.generated and self.prompt_logprobs is not None and self.on_prompt_logprobs is not None:
            self.on_prompt_logprobs(self.prompt_logprobs)
        token = sampler.next_token(logits, chosen)
        self.generated.append(token)
        if self.logprobs is not None:
            self.logprobs.append(sampler.last_logprobs)
        if self.on_token is not None:
            self.on_token(token, sampler.last_logprobs)
        shown = ""
        if self.pieces is not None and token in self.stopper.eos_ids:
            # the end: the text held back for a character (a U+FFFD, or bytes that never complete) comes out first,
            # stop strings checked; the eos token's own text never does (fed with it, that held text went too), a
            # named stop token's where include_stop
            kept = self.pieces.add(token) if token in self.shown_stop_ids else ""
            self.so_far += kept + self.pieces.flush()
            shown = self.stopper.flush(self.so_far)
        elif self.pieces is not None:
            self.so_far += self.pieces.add(token)
        # (a stop string counts once min_new_tokens tokens came before, as vLLM's min_tokens has it and as the end of
        # sentence is held back: the first min_new_tokens tokens' text is passed over)
        shown += self.stopper.feed(token, self.so_far, armed=len(self.generated) > self.min_new_tokens)
        if shown and self.on_text is not None:
            self.on_text(shown)
        return bool(self.stopper.finish_reason) or len(self.generated) == self.max_new_tokens

    def shown_tokens(self) -> int:
        """How many of the generated tokens had their text shown whole: all of them, unless a stop string hid its
        own (or text held back for one is not given out, cancelled): then the longest run whose text begins the
        shown text."""
        stopper, generated = self.stopper, self.generated
        if self.detokenize is None or not (stopper.stop_string is not None or self.cancelled and stopper.stop):
            return len(generated)
        shown = stopper.text
        # (a token holds at least one character, or part of one: the hidden text bounds how far back to look;
        # none found there, as a detokenizer whose prefixes are not the text's would give, keeps them all)
        back = len(self.so_far) - len(shown) + 8
        return next((n for n in range(len(generated), max(len(generated) - back, 0) - 1, -1)
                     if shown.startswith(self.detokenize(generated[:n]))), len(generated))

    def cancel(self) -> None:
        """The caller stopped it (finish_reason "cancelled"): its held-back text is not given out."""
        self.cancelled = True

    def result(self, stats: dict) -> GenerateResult:
        """The generation's result (the text held back for a stop string that did not complete given out first)."""
        stopper = self.stopper
        if self.pieces is not None and not stopper.finish_reason and not self.cancelled:
            shown = stopper.flush(self.so_far + self.pieces.flush())
            if shown and self.on_text is not None:
                self.on_text(shown)
        finish = "cancelled" if self.cancelled else stopper.finish_reason or "length"
        return GenerateResult(self.generated, stopper.text if self.detokenize is not None else None, finish,
                              {**stats, "sampling_seed": self.sampler.seed}, self.logprobs, self.prompt_logprobs,
                              stopper.stop_string if finish == "stop" else None)


def generate(path: str, token_ids, options: GenerateOptions | None = None, continue_from: str | None = None,
             detokenize: Callable[[list[int]], str] | None = None,
             on_text: Callable[[str], None] | None = None, kv_out: str | None = None,
             kv_overwrite: bool = False, kv_dtype: str = "F32") -> GenerateResult:
    """One generation on `path` (Generator.generate, the container opened for it alone)."""
    options = options or GenerateOptions()
    with Generator(path, options.cache_gib, options.prefill) as g:
        return g.generate(token_ids, options, continue_from, detokenize, on_text, kv_out, kv_overwrite=kv_overwrite,
                          kv_dtype=kv_dtype)


def default_cache_gib(path: str, device: str = "cpu") -> float:
    """default_cache_bytes of the container at `path`, in GiB (rounded down: never more than fits)."""
    with Container(path) as c:
        return math.floor(default_cache_bytes(c, compute_device(device)) / GIB * 1000) / 1000
