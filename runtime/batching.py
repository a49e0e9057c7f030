"""Continuous batching over one Generator: up to `max_batch` sequences decode together, each step feeding every
decoding sequence its last token through `Decoder.step_batch`; a sequence joins and leaves at step boundaries.

    with Generator("model.moepack") as g, BatchScheduler(g, max_batch=8) as batch:
        futures = [batch.submit(ids, GenerateOptions(max_new_tokens=64)) for ids in prompts]
        results = [f.result() for f in futures]  # GenerateResult each, as Generator.generate gives it

One worker thread owns the generator's decoder. Each turn of its loop:
1. every waiting newcomer is admitted (first come, first served) while fewer than max_batch sequences decode or
   prefill: its memory check counts the KV of the sequences decoding and prefilling beside it (a refusal fails
   its future alone);
2. ONE prefill pass for all the prompts being prefilled together (StreamingPrefill.run_many: each layer's
   weights and every routed expert read once for all of them, the attention per prompt): `prefill_chunk` tokens
   in all (half to the earliest prompt, then the prompts that can end in the pass, then the earliest), each chunk
   continuing its prompt's previous states as a continued KV does (the whole rest of every prompt when nothing
   decodes, as more passes over the model would only cost).
   The decoding ones wait one pass, never a whole long prompt nor one prefill per newcomer. A group whose working
   set does not fit runs without its last prompts (they wait for a later pass); a prompt that does not fit alone
   fails alone. A sequence whose prompt is done takes its first token from the pass's logits and decodes from the
   next step;
3. one decode step of every decoding sequence: each takes its row of the logits (SequenceOutput: its own sampler,
   seed, penalties, constraint, stop strings, text, logprobs) and leaves when over or when its `cancelled()` says
   so, its future then given its GenerateResult.

Stopped during a pass (`cancelled()`, or the scheduler closed), a prompt leaves with a cancelled result once the
pass ends (the pass stops before its next layer only once every prompt in it asked to). Every sequence's greedy
tokens are those it decodes alone (Generator.generate): the step's rows are independent (Decoder.step_batch), a
chunked prompt continues its states, and a prompt prefilled beside others gets its solo logits and states to
float32 rounding (run_many: only the experts' matmuls see the other prompts' rows, each prompt's on the kernel its
own count picks). Not so for a CHUNKED prompt in bfloat16 (`--compute-dtype auto` on a CPU with AVX512-BF16): a
chunk boundary moves DeepSeek-V4's attention query chunks (its bf16 products then sum their keys in other blocks),
may leave Qwen3-MoE a chunk of fewer than 16 queries (its scores then rounded to bf16, not kept float32 by the
fused attention) and lowers an expert's token count (the fused FP4 kernel, or the token kernel, for few; rounding
otherwise): its logits may differ from its solo run's by about 1e-2; and in bf16 a grouped prompt's
float32-rounding difference can cross a bf16 rounding later and so tip a near tie. Only the expert cache is
shared: a sequence's decode stats count the cache's hits and the bytes read over the steps it took part in, all
rows; its prefill stats are its own tokens, the seconds of the passes it was in, and their `group_prompts` /
`group_tokens` (the pass's bytes read are the group's). The cache is seeded with a prompt's experts only when its
sequence is about to decode alone.

Shared prefills: a newcomer whose prompt is the very prompt of a sequence prefilling (a request's n choices,
identical requests at once) follows that prefill instead of running its own: once the prompt is through, each
follower continues a copy of its states (as a prompt cache hit does) from the same logits, its prefill stats the
leader's with `shared_tokens` (the counter `shared_tokens` sums them). A follower takes a batch slot and its KV is
counted by the memory checks from its admission; one stopped while it waits leaves at once; a leader stopped hands
its prefill, as far as it got, to its first follower still there; a failed prefill fails its followers too.
prompt_logprobs and cache_prompt false prefill their own.

With a prompt cache (`prompt_cache_bytes`, runtime/prompt_cache.py): a newcomer whose ids start with a kept
snapshot's continues a copy of the longest one (admitted with its `states` and `prefilled` as if a chunk had run;
the whole prompt there: it decodes at once, its first token from the snapshot's logits); a snapshot is kept where a
prompt's prefill ends, where a sequence ends (the tokens it was fed) and where the options' `snapshot_at` says (the
prompt's chunking stops there once). prompt_logprobs prefill the whole prompt; `cache_prompt` False keeps a sequence
out of it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import torch

from moepack.families import kv_directory as kvd
from moepack.format_spec.errors import MoepackError

from .decode import DecodeSequence
from .engine import GenerationCancelled, StreamingPrefill, check_prompt_ids, joined_prompt_logprobs, prompt_ids
from .limits import DEFAULT_MAX_BATCH, DEFAULT_PREFILL_CHUNK, MAX_BATCH
from .prompt_cache import PromptCache
from .generate import (GenerateOptions, GenerateResult, Generator, SequenceOutput, cancelled_in_prefill,
                       peak_rss_bytes)
from .sampling import TokenLogprob, greedy_choices



@dataclass(eq=False)  # one is its own identity (list.remove, `in`): its fields hold tensors
class _Sequence:
    """One submitted generation: its prompt, its output, its future, and its prefill's or decode's state."""
    ids: torch.Tensor
    out: SequenceOutput
    future: Future
    cancelled: Callable[[], bool] | None
    detokenize: Callable[[list[int]], str] | None
    reserved_tokens: int = 0  # its prompt + max_new_tokens: the KV its memory check counted
    bound: int = 0  # that check's host memory bound
    prefilled: int = 0  # prompt tokens through the prefill so far
    states: list | None = None  # the KV after them
    counts: list[list[int]] | None = None  # tokens per expert of each layer over the prompt so far
    last_logits: torch.Tensor | None = None  # after its last chunk, where the next chunk's first token is scored
    prefill_stats: dict = field(default_factory=dict)
    decoding: DecodeSequence | None = None
    steps: int = 0  # decode steps it took part in
    step_s: float = 0.0  # their time
    rows: int = 0  # the sequences in them, summed (its mean batch: rows / steps)
    counters: tuple[int, int, int] = (0, 0, 0)  # the cache's hits, misses and the decoder's bytes read at its join
    error: BaseException | None = None  # what its `cancelled` raised: it fails with it
    cached: bool = True  # it may continue, and leave, the prompt cache's snapshots (a request's cache_prompt)
    snapshot_at: int = 0  # a prompt position whose state the prompt cache keeps too: its prefill stops there once
    shares: bool = True  # it may share its prefill with a sequence of the same prompt (a request's cache_prompt)
    # admitted sequences of the same prompt waiting for this one's prefill (n choices, identical requests): each
    # then continues a copy of its states, none prefills the prompt again
    followers: list["_Sequence"] = field(default_factory=list)

    def settle(self, result: GenerateResult | None = None, error: BaseException | None = None) -> None:
        """Its future given `error` (or `result`), unless its caller cancelled the future (Future.cancel)."""
        try:
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)
        except InvalidStateError:  # cancelled by its caller meanwhile (nobody waits for it), or already given
            pass


def _settle_cancelled(s: _Sequence, layers_done: int) -> None:
    """s leaves with a cancelled result (or the error its `cancelled` raised), after `layers_done` of a pass."""
    s.settle(cancelled_in_prefill(GenerationCancelled(layers_done), s.detokenize), s.error)


def _chunk_stats(total: dict, chunk: dict) -> dict:
    """The prefill stats of a prompt run in chunks: the last chunk's, with the tokens and seconds of all."""
    tokens, seconds = total.get("tokens", 0) + chunk["tokens"], total.get("seconds", 0.0) + chunk["seconds"]
    return {**chunk, "tokens": tokens, "seconds": round(seconds, 4), "chunks": total.get("chunks", 0) + 1,
            "tokens_per_s": round(tokens / seconds, 2) if seconds else None,
            "cached_tokens": total.get("cached_tokens", 0)}


def _add_counts(total: list[list[int]] | None, more: list[list[int]] | None) -> list[list[int]] | None:
    if total is None or more is None:
        return more if total is None else total
    return [[a + b for a, b in zip(x, y)] for x, y in zip(total, more)]


class BatchScheduler:
    """Continuous batching of a Generator's generations (the module's docstring): `submit` from any thread, each
    generation's GenerateResult through its future. While it runs, its worker thread alone uses the generator's
    decoder: call the generator's own generate() only once it is closed."""

    def __init__(self, generator: Generator, max_batch: int = DEFAULT_MAX_BATCH,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, on_step: Callable[[int], None] | None = None,
                 prompt_cache_bytes: int = 0):
        """`prefill_chunk` 0: a prompt's prefill runs whole. `on_step(batch size)`: after each decode step.
        `prompt_cache_bytes`: the prompt cache's budget (runtime/prompt_cache.py; 0: none)."""
        if not 1 <= max_batch <= MAX_BATCH:
            raise MoepackError(f"--max-batch must be 1 to {MAX_BATCH}, got {max_batch}")
        if prefill_chunk < 0:
            raise MoepackError(f"--prefill-chunk must be >= 0 (0: a prompt's prefill in one run), got {prefill_chunk}")
        self.generator, self.max_batch, self.prefill_chunk, self.on_step = generator, max_batch, prefill_chunk, on_step
        self.prompt_cache: PromptCache | None = None
        if prompt_cache_bytes:
            self.prompt_cache = PromptCache(generator.kv_format(), generator.c.config, prompt_cache_bytes)
            generator.prompt_cache = self.prompt_cache  # (its memory checks count what the cache holds)
        self._cv = threading.Condition()
        self._waiting: deque[_Sequence] = deque()  # submitted, not yet admitted (under _cv)
        self._closed = False
        # the worker's own from here on: admitted sequences whose prompt is not through yet (in arrival order), the
        # prefill engine their passes share (open while any is there), and the sequences decoding
        self._prefilling: list[_Sequence] = []
        self._engine: StreamingPrefill | None = None
        self._active: list[_Sequence] = []
        self.shared_tokens = 0  # prompt tokens sequences took from another's prefill of the same prompt (followers)
        # the worker's own: every admitted sequence whose future is not yet settled, wherever it is between its lists
        self._admitted: set[_Sequence] = set()
        self._thread = threading.Thread(target=self._run, name="moepack-batch", daemon=True)
        self._thread.start()

    def __enter__(self) -> "BatchScheduler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def decoding(self) -> int:
        """Sequences decoding now."""
        return len(self._active)

    def submit(self, token_ids, options: GenerateOptions | None = None,
               detokenize: Callable[[list[int]], str] | None = None, on_text: Callable[[str], None] | None = None,
               on_token: Callable[[int, TokenLogprob | None], None] | None = None,
               cancelled: Callable[[], bool] | None = None,
               on_prompt_logprobs: Callable[[list], None] | None = None) -> Future:
        """Queue one generation of `token_ids` (Generator.generate's arguments, on the worker thread: on_text,
        on_token, on_prompt_logprobs and cancelled are called there); its future's result is its GenerateResult.
        Bad options raise here (MoepackError), as do an empty prompt and an id outside the vocabulary; a generation
        the memory check refuses, or that fails, raises from its future. Its future cancelled (Future.cancel) stops
        it as `cancelled()` would. Its prefill stats' `cached_tokens`: the prompt tokens it took from the prompt
        cache (options.cache_prompt False: it neither takes nor leaves an entry)."""
        return self.submit_together([dict(token_ids=token_ids, options=options, detokenize=detokenize,
                                          on_text=on_text, on_token=on_token, cancelled=cancelled,
                                          on_prompt_logprobs=on_prompt_logprobs)])[0]

    def submit_together(self, calls: list[dict]) -> list[Future]:
        """Several generations queued at once, each call a dict of submit's arguments: the worker admits them in
        one turn where the batch has room (a request's n choices: their prompt then prefilled once, the shared
        prefill). Bad options or ids in any raise here, and none is queued."""
        sequences = [self._sequence(**call) for call in calls]
        with self._cv:
            if self._closed:
                raise MoepackError("the batch scheduler is closed")
            self._waiting.extend(sequences)
            self._cv.notify()
        return [s.future for s in sequences]

    def _sequence(self, token_ids, options: GenerateOptions | None = None,
                  detokenize: Callable[[list[int]], str] | None = None, on_text: Callable[[str], None] | None = None,
                  on_token: Callable[[int, TokenLogprob | None], None] | None = None,
                  cancelled: Callable[[], bool] | None = None,
                  on_prompt_logprobs: Callable[[list], None] | None = None) -> _Sequence:
        out = SequenceOutput(options or GenerateOptions(), self.generator.eos_ids, detokenize, on_text, on_token,
                             on_prompt_logprobs)
        ids = prompt_ids(token_ids)
        check_prompt_ids(ids, self.generator.cfg.vocab_size)  # here: in a grouped pass it would fail the others
        out.sampler.saw(ids.tolist())
        options = options or GenerateOptions()
        cached = self.prompt_cache is not None and options.cache_prompt
        at = options.snapshot_at or 0
        at = at if cached and self.prompt_cache.min_tokens <= at < len(ids) else 0
        return _Sequence(ids, out, Future(), cancelled, detokenize, cached=cached, snapshot_at=at,
                         shares=options.cache_prompt and options.prompt_logprobs is None)

    def generate(self, token_ids, options: GenerateOptions | None = None,
                 detokenize: Callable[[list[int]], str] | None = None, on_text: Callable[[str], None] | None = None,
                 cancelled: Callable[[], bool] | None = None,
                 on_token: Callable[[int, TokenLogprob | None], None] | None = None,
                 on_prompt_logprobs: Callable[[list], None] | None = None) -> GenerateResult:
        """One generation through the batch (Generator.generate's shape, without a KV in or out): waits for it."""
        return self.submit(token_ids, options, detokenize, on_text, on_token, cancelled, on_prompt_logprobs).result()

    def close(self) -> None:
        """Stop: a prefill running stops before its next layer, a step's sequences after it; what has not finished
        ends cancelled (finish_reason "cancelled") where a pass or a step saw the close, else fails with a
        MoepackError (waiting, or between turns)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()
        if self.prompt_cache is not None and self.generator.prompt_cache is self.prompt_cache:
            self.prompt_cache.clear()
            self.generator.prompt_cache = None

    # --- the worker --------------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._closed or self._waiting or self._active or self._prefilling):
                        self._cv.wait()
                    if self._closed:
                        break
                    # those their callers gave up on while waiting (Future.cancel) take no slot: never run
                    self._waiting = deque(s for s in self._waiting if not s.future.cancelled())
                    room = self.max_batch - len(self._active) - len(self._admitted_prefills())
                    newcomers = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
                self._admitted = {s for s in self._admitted if not s.future.done()} | set(newcomers)
                try:
                    for s in newcomers:
                        self._admit(s)
                    if self._prefilling:
                        self._prefill_turn()
                    if self._active:
                        self._step()
                except Exception as e:  # what no path above caught (a fault of the scheduler's own): see _fail_all
                    self._fail_all(e)
        finally:
            with self._cv:
                self._closed = True
                left = [*self._waiting, *self._admitted]
                self._waiting.clear()
            self._release_engine()
            for s in left:
                s.settle(error=MoepackError("the batch scheduler stopped before this generation ended"))
            self._active, self._prefilling = [], []

    def _fail_all(self, e: Exception) -> None:
        """Every admitted sequence fails with `e` (those prefilling, following, decoding, and any between its lists
        when `e` was raised: none is left waiting for an answer), the engine is let go of, and the worker goes on
        with the sequences still waiting: a fault there must not stop the scheduler, and every later request
        with it."""
        failed, self._admitted = self._admitted, set()
        self._active, self._prefilling = [], []
        for s in failed:
            s.followers = []
            s.settle(error=e)
        try:
            self._release_engine()
        except Exception:  # (its pools go with it: the next prefill opens the generator's engine again)
            self._engine = None

    def _stop_asked(self, s: _Sequence) -> bool:
        """The scheduler closed, its future cancelled, or its `cancelled()` true; one that raises stops it too (it
        then fails with that error, alone)."""
        if self._closed or s.error is not None or s.future.cancelled():
            return True
        try:
            return s.cancelled is not None and bool(s.cancelled())
        except Exception as e:
            s.error = e
            return True

    def _admit(self, s: _Sequence) -> None:
        """The newcomer's memory check (beside the KV of the sequences decoding and prefilling) and its place among
        those prefilling, after the prompt cache's longest entry its prompt starts with (or, its whole prompt
        there, among those decoding at once); a refusal fails its future alone."""
        if s.future.cancelled():  # its caller gave up on it while it waited: nothing to check nor run
            return
        g = self.generator
        s.reserved_tokens = len(s.ids) + s.out.max_new_tokens
        others = [a.reserved_tokens for a in (*self._active, *self._admitted_prefills())]
        reuses = self.prompt_cache is not None and s.cached and s.out.prompt_logprobs_k is None
        if reuses:  # (the entry it would continue is in use: a refusal evicts the others first)
            self.prompt_cache.keep_for(s.ids.tolist())
        try:
            s.bound = self._evicting_if_refused(
                lambda freeable: g._check_memory(s.reserved_tokens, others, freeable=freeable))
        except BaseException as e:
            s.settle(error=e)
            return
        leader = self._same_prompt_prefilling(s)
        if leader is not None:  # (before the cache: its prefill is under way, a cache entry would be copied)
            leader.followers.append(s)
            return
        try:  # (prompt_logprobs score every prompt position: the head must run over all of them)
            reuse = self.prompt_cache.lookup(s.ids.tolist()) if reuses else None
        except BaseException as e:  # its copy (memory): it fails alone
            s.settle(error=e)
            return
        if reuse is None:
            self._prefilling.append(s)
            return
        s.states, s.prefilled, s.counts = reuse.states, reuse.tokens, reuse.counts
        s.prefill_stats = {"tokens": 0, "seconds": 0.0, "cached_tokens": reuse.tokens}
        if s.prefilled < len(s.ids):
            self._prefilling.append(s)
        else:  # (its first token from the entry's logits; the cache seeded as for a prompt decoding beside others)
            self._start_decoding(s, reuse.logits, seed=False)

    def _admitted_prefills(self) -> list[_Sequence]:
        """The sequences prefilling and those waiting for one of them to end its prefill (its followers)."""
        return [a for s in self._prefilling for a in (s, *s.followers)]

    def _same_prompt_prefilling(self, s: _Sequence) -> _Sequence | None:
        """A sequence prefilling s's very prompt whose states s may continue a copy of (n choices of one prompt,
        or identical requests at once), None if none: its prefill is then computed once, not once each. Not with
        prompt_logprobs (a scored prompt's chunks go their own way) nor cache_prompt false (its own prefill)."""
        if not s.shares:
            return None
        for other in self._prefilling:
            if other.shares and len(other.ids) == len(s.ids) and torch.equal(other.ids, s.ids):
                return other
        return None

    def _handed_over(self, s: _Sequence) -> _Sequence | None:
        """s (prefilling) stops: its first follower not stopped takes its place, its states and progress (and the
        other followers not stopped), so their prefill goes on; the stopped ones stay s's followers (they leave
        cancelled with it). None: none was left."""
        followers, s.followers = s.followers, []
        heir = None
        for f in followers:
            if self._stop_asked(f):
                s.followers.append(f)
            elif heir is None:
                heir = f
            else:
                heir.followers.append(f)
        if heir is None:
            return None
        heir.states, heir.prefilled, heir.counts = s.states, s.prefilled, s.counts
        heir.prefill_stats, heir.last_logits, heir.snapshot_at = s.prefill_stats, s.last_logits, s.snapshot_at
        self._prefilling[self._prefilling.index(s)] = heir
        return heir

    def _followers_start(self, s: _Sequence, logits: torch.Tensor) -> list[tuple[_Sequence, torch.Tensor]]:
        """s's prompt is through: each of its followers takes a copy of its states (as a prompt cache hit does)
        and the logits after the prompt, with s's prefill stats (its pass's seconds; `shared_tokens` the prompt
        tokens s prefilled for it, `cached_tokens` those s took from the prompt cache). One whose copy fails
        (memory) fails alone."""
        started = []
        followers, s.followers = s.followers, []
        for f in followers:
            try:  # (the logits' copy too: one escaping would end the worker, leaving s and the rest unanswered)
                f.states = kvd.copied_states(self.generator.kv_format(), self.generator.c.config, s.states)
                own_logits = logits.clone()
            except BaseException as e:
                f.settle(error=e)
                continue
            f.prefilled = len(f.ids)
            f.counts = None if s.counts is None else [list(c) for c in s.counts]
            shared = len(f.ids) - s.prefill_stats.get("cached_tokens", 0)
            f.prefill_stats = {**s.prefill_stats, "shared_tokens": shared}
            self.shared_tokens += shared
            started.append((f, own_logits))
        return started

    def _evicting_if_refused(self, check: Callable[[int], int | None]) -> int | None:
        """check(freeable) (a memory check, counting `freeable` bytes of the prompt cache as given back), run
        again after each prompt cache entry evicted (least recently used first) while it refuses: what fits
        without the cache never fails for it, what fits beside some of it leaves those, and what is refused even
        without it (a request past the memory) evicts nothing."""
        cache = self.prompt_cache
        try:
            return check(0)
        except MoepackError:
            if cache is None or not len(cache):
                raise
            check(cache.nbytes)  # (refused however much is evicted: raises, the cache kept)
        while True:
            cache.evict_oldest()
            try:
                return check(0)
            except MoepackError:
                if not len(cache):
                    raise

    def _fail(self, s: _Sequence, e: BaseException) -> None:
        """s fails with `e`, and so do the sequences waiting for its prefill (theirs would fail alike)."""
        if s in self._prefilling:
            self._prefilling.remove(s)
        for f in (s, *s.followers):
            f.settle(error=e)
        s.followers = []

    def _release_engine(self) -> None:
        """No prompt prefilling (or its pass stopped or failed): the generator's prefill engine let go of, its pools
        and threads kept for the next group (each pass gave back what it read, however it ended), what was kept
        for these prompts dropped."""
        if self._engine is not None:
            self._engine.after_prompt()
            self._engine = None

    def _cancel_in_prefill(self, s: _Sequence, layers_done: int, hand_over: bool = True) -> _Sequence | None:
        """s leaves cancelled. Its states whole (`hand_over`), a follower not stopped takes its place in the
        prefill (_handed_over, returned); else its followers leave cancelled too."""
        heir = self._handed_over(s) if hand_over else None
        if heir is None:
            self._prefilling.remove(s)
        for f in (s, *s.followers):
            _settle_cancelled(f, layers_done)
        s.followers = []
        return heir

    def _group(self) -> tuple[list[_Sequence], list[int]]:
        """This turn's prefill group and each one's tokens: PREFILL_CHUNK tokens in all while others decode (none:
        every prompt's rest); half of it to the earliest prompt, then to every prompt whose rest fits in what is
        left, in arrival order, then the rest of it first come first served.

        A budget for the whole group, not per prompt: a pass costs about its reads and decodes of the routed
        experts, which grow slowly with its tokens, so the decoding sequences wait about one pass a turn however
        many prompts share it; per prompt, 16 newcomers could make one pass of 16 x prefill_chunk tokens and freeze
        them for that long. The prompts that can end in this pass before the rest: a short question that arrives
        behind a long document gets its first token after one pass, not after every chunk of the document; the
        earliest prompt's half keeps a stream of short ones from starving it."""
        budget = self.prefill_chunk if self._active and self.prefill_chunk else None
        # (a prompt with a snapshot ahead goes up to it: the prompt cache copies the state there)
        rests = [(s.snapshot_at if s.prefilled < s.snapshot_at else len(s.ids)) - s.prefilled for s in self._prefilling]
        if budget is None:
            return list(self._prefilling), rests
        sizes = [0] * len(rests)
        sizes[0] = min(rests[0], max(budget // 2, 1))  # the earliest always half: later short ones cannot starve it
        budget -= sizes[0]
        for i, rest in enumerate(rests):
            if 0 < rest - sizes[i] <= budget:
                sizes[i], budget = rest, budget - (rest - sizes[i])
        for i, rest in enumerate(rests):
            take = min(rest - sizes[i], budget)
            sizes[i], budget = sizes[i] + take, budget - take
        group = [(s, n) for s, n in zip(self._prefilling, sizes) if n > 0]
        return [s for s, _ in group], [n for _, n in group]

    def _prefill_turn(self) -> None:
        """One grouped prefill pass (StreamingPrefill.run_many) of the prompts prefilling: each of its chunk (the
        _group), continuing its states; those whose prompt is done then take their first token and decode."""
        for s in self._prefilling:  # followers stopped while they wait: gone at once
            for f in [f for f in s.followers if self._stop_asked(f)]:
                s.followers.remove(f)
                _settle_cancelled(f, 0)
        for s in [s for s in self._prefilling if self._stop_asked(s)]:  # stopped before the pass: no work for them
            self._cancel_in_prefill(s, 0)
        if not self._prefilling:
            self._release_engine()
            return
        try:
            if self._engine is None:
                self._engine = self.generator.prefill_engine()
        except BaseException as e:
            for s in list(self._prefilling):
                self._fail(s, e)
            return
        group, sizes = self._group()
        while True:  # the group's working set must fit: the last to join waits for a later turn, one alone fails
            try:
                self._evicting_if_refused(lambda freeable: self._engine.check_memory(
                    sum(s.prefilled + n for s, n in zip(group, sizes)),
                    sum(n for s, n in zip(group, sizes) if s.out.prompt_logprobs_k is not None),
                    freeable_bytes=freeable))
                break
            except MoepackError as e:
                if len(group) == 1:
                    self._fail(group[0], e)
                    if not self._prefilling:
                        self._release_engine()
                    return
                group.pop()
                sizes.pop()
        try:
            done = self._engine.run_many(
                [s.ids[s.prefilled:s.prefilled + n].to(self._engine.device) for s, n in zip(group, sizes)],
                [s.states for s in group], keep_kv=True, prompt_logprobs=[s.out.prompt_logprobs_k for s in group],
                ranked=any(s.out.prompt_ranked for s in group),  # (ranks for all: those not asking leave them)
                # the pass stops (before its next layer) once every prompt in it is stopped; one of several
                # stopped goes on to the pass's end (its rows are the others' weight reads' passengers) and then
                # leaves with a cancelled result
                should_stop=lambda: all(self._stop_asked(a) for s in group for a in (s, *s.followers)))
        except GenerationCancelled as e:  # the pass gave back what it had read (its states are not whole)
            self._release_engine()
            for s in group:
                self._cancel_in_prefill(s, e.layers_done, hand_over=False)
            return
        except BaseException as e:  # the pass is shared (a read or compute error): every prompt in it fails
            self._release_engine()
            for s in group:
                self._fail(s, e)
            return
        finished = []
        for s, n, result in zip(group, sizes, done):
            s.states, s.prefilled = result.states, s.prefilled + n
            s.counts = _add_counts(s.counts, result.tokens_per_expert)
            s.prefill_stats = _chunk_stats(s.prefill_stats, result.stats)
            if result.prompt_logprobs is not None:  # the chunk's first token scored after the chunk before
                chunk = s.ids[s.prefilled - n:s.prefilled]
                s.out.prompt_logprobs = [*(s.out.prompt_logprobs or []), *joined_prompt_logprobs(
                    s.last_logits, chunk, s.out.prompt_logprobs_k, result.prompt_logprobs, s.out.prompt_ranked)]
                s.last_logits = result.logits
            if s.prefilled == s.snapshot_at:
                self._keep(s, s.ids[:s.prefilled].tolist(), s.states, result.logits)
            if self._stop_asked(s) and (s := self._cancel_in_prefill(s, len(self.generator.c.layers))) is None:
                continue  # (else a follower of its goes on in its place)
            if s.prefilled == len(s.ids):
                self._prefilling.remove(s)
                self._keep(s, s.ids.tolist(), s.states, result.logits)
                finished += [(s, result.logits), *self._followers_start(s, result.logits)]
        if not self._prefilling:
            self._release_engine()
        with self._cv:
            # the cache seeded with one prompt's experts evicts the others' (those of the sequences decoding, of the
            # prompts prefilling or waiting): only a sequence about to decode alone seeds it
            alone = len(finished) == 1 and not (self._active or self._prefilling or self._waiting)
        for s, logits in finished:
            self._start_decoding(s, logits, seed=alone)

    def _start_decoding(self, s: _Sequence, logits: torch.Tensor, seed: bool) -> None:
        """A prompt prefilled: its first token chosen from the prefill's `logits`, then its place in the batch."""
        g = self.generator
        s.prefill_stats = g.prefill_stats({"cached_tokens": 0, **s.prefill_stats})
        try:
            s.decoding = g.decoder.start(s.states)
            s.states = None
            s.counters = self._counters()  # before its first token: one that ends there read nothing in a step
            if self._over(s, logits):
                self._finish(s, logits)
                return
            if seed and s.counts:  # once its first token is out (its reads may fail: it fails alone)
                g.decoder.seed(s.counts)
        except BaseException as e:
            self._fail(s, e)
            return
        self._active.append(s)

    def _counters(self) -> tuple[int, int, int]:
        decoder = self.generator.decoder
        return decoder.cache.hits, decoder.cache.misses, decoder.stats.bytes_read

    def _step(self) -> None:
        """One decode step of every decoding sequence; those over (or stopped) leave with their results."""
        batch = self._active
        start = time.perf_counter()
        try:
            logits = self.generator.decoder.step_batch([s.decoding for s in batch], [s.out.last for s in batch])
        except BaseException as e:  # the step is shared: every sequence in it fails
            self._active = []
            for s in batch:
                self._fail(s, e)
            return
        seconds = time.perf_counter() - start
        if self.on_step is not None:
            self.on_step(len(batch))
        # the plain greedy rows' tokens found together where the logits are (one copy to the host for all of them,
        # not each row's whole logits)
        plain = [row for row, s in enumerate(batch) if s.out.sampler.plain_greedy]
        rows = logits if len(plain) == len(batch) else logits[plain]
        chosen = dict(zip(plain, greedy_choices(rows))) if plain else {}
        staying = []
        for row, s in enumerate(batch):
            s.steps, s.step_s, s.rows = s.steps + 1, s.step_s + seconds, s.rows + len(batch)
            try:
                if self._over(s, logits[row], chosen.get(row)):
                    self._finish(s, logits[row])
                else:
                    staying.append(s)
            except BaseException as e:  # its own callbacks or constraint: the others go on
                self._fail(s, e)
        self._active = staying

    def _over(self, s: _Sequence, logits: torch.Tensor, chosen: int | None = None) -> bool:
        """Its next token taken from `logits` (`chosen`: SequenceOutput.take's); True once it is over, or stopped
        (as Generator.generate: asked after each token that does not end it)."""
        if s.out.take(logits, chosen):
            return True
        if self._stop_asked(s):
            if s.error is not None:
                raise s.error
            s.out.cancel()
            return True
        return False

    def _keep(self, s: _Sequence, ids: list[int], states: list, logits: torch.Tensor) -> None:
        """A snapshot of `states` (after `ids`; `logits` after them) into the prompt cache, where there is one and
        `s` may leave one. One that cannot be copied (memory) is not kept: the sequence goes on (the cache only
        saves work; its failure must not cost an answer, nor the worker)."""
        if self.prompt_cache is None or not s.cached:
            return
        try:
            self.prompt_cache.store(ids, states, logits, s.counts)
        except Exception:  # (torch's out of memory is a RuntimeError)
            pass

    def _finish(self, s: _Sequence, logits: torch.Tensor) -> None:
        """Its result: the decode stats of the steps it took part in; the states after every token it was fed (the
        prompt and all it generated but the last, which `logits` chose) into the prompt cache, for a next turn that
        sends them again."""
        self._keep(s, [*s.ids.tolist(), *s.out.generated[:-1]], s.decoding.states, logits)
        hits, misses, read = (now - then for now, then in zip(self._counters(), s.counters))
        decoder = self.generator.decoder
        decode = {"tokens": s.steps, "steps": s.steps, "seconds": round(s.step_s, 4),
                  "tokens_per_s": round(s.steps / s.step_s, 2) if s.step_s else None,
                  "mean_batch": round(s.rows / s.steps, 2) if s.steps else None,
                  "expert_cache_hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
                  "bytes_read": read, "cache_bytes": decoder.cache.bytes, "cache_budget_bytes": decoder.cache.budget,
                  "memory_bound_bytes": s.bound, "peak_rss_bytes": peak_rss_bytes()}
        s.decoding = None
        s.settle(s.out.result({"prefill": s.prefill_stats, "decode": decode}))
