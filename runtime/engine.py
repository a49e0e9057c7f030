"""Layer-major prefill with the routed experts streamed from the container: `prefill()` and StreamingPrefill,
the orchestrator that walks the layers over the streaming pipeline's stages (docs/architecture.md):

    ReadScheduler (read_scheduler.py)  what is read when: the dense region a layer ahead, expert bundles in
                                       expert-ID order, every expert / the hash layer's / the routed ones
    DeviceCopier (device_copier.py)    the bytes onto the compute device (a copy stream on CUDA; a no-op on a CPU)
    expert backend                     ExpertRunner (expert_runner.py): decode + matmul per expert as its bytes
                                       arrive, on work-stealing threads; GroupedExperts (grouped_experts.py)

The arithmetic is the model family's (families.base.LayerPrefill: `layer_prefill(container)` gives the family's,
e.g. families/deepseek_v4/model.py DeepseekV4Prefill); this module holds no family's names. For each layer
L: the dense region was prefetched while layer L-1 computed; all N tokens run through the family's attention (each
prompt of a grouped pass on its own rows and past); the family's router picks the experts; the layer's expert
reads (queued ahead where they did not depend on the router) are computed as they arrive, the family's work beside
them (DeepSeek-V4's shared expert) and the next layer's dense decode beside them; the family's `finish` adds the
result to the hidden rows. A layer without routed experts (a dense MLP) reads none. Every region the prefill
needs is read exactly once. The embedding's rows are decoded for the prompt's tokens only; the LM head is read
during the last layer and applied a slice at a time.

CPU specifics: glibc is asked to keep freed activations for the next layer (io.keep_freed_memory). With
`io_mode="mmap"` the reads are zero-copy: the experts decode straight from the mapped page cache.
`compute_dtype="bfloat16"` keeps the matrices the family names (LayerPrefill.in_compute_dtype; DeepSeek-V4: the
attention's projections and the shared expert) in bf16 (decoded straight to bf16 from FP8); the rest stays
float32 (DeepSeek-V4: residual streams, norms, mHC, router and softmax). The float32 default is the path that
matches the reference to 1e-3.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import resource
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from moepack.backends.device_copier import DeviceCopier
from moepack.backends.grouped_experts import GroupedExperts, resolve_expert_backend
from moepack.families import check_container, kv_format_for
from moepack.families.base import LayerPrefill
from moepack.format_spec.decode import (companion_names, decode_group, decode_group_row_slices, decode_group_rows,
                                        entry_bytes)
from moepack.format_spec.errors import FormatError, MoepackError
from moepack.format_spec.layout import xxh3_hex
from moepack.format_spec.reader import Block, Container, Region

from .expert_decode import COMPUTE_DTYPES as EXPERT_DTYPES
from .expert_runner import BusyTimer, ExpertRunner, decode_dense
from .io import HostBuffer, RegionReader, cpu_steal_seconds, keep_freed_memory, release_freed_memory
from .limits import MAX_BUNDLE_EXPERTS
from .memory import check_prefill_memory
from .read_scheduler import EXPERT_OWNERSHIPS, EXPERT_SELECTIONS, LayerStats, ReadScheduler, tokens_per_expert
from .resident import place_that_fits, resident_bytes
from .sampling import MAX_TOP_LOGPROBS, NextTokenScores, TokenLogprob
from .tuning import default_compute_dtype

# the LM head is decoded and applied this many float32 bytes of rows at a time, never whole (DeepSeek-V4-Flash's
# bf16 head [129280, 4096] would be 2 GiB decoded)
HEAD_CHUNK_BYTES = 16 << 20
# a prompt's log-probabilities take the head's logits over every position this many float32 bytes at a time
SCORE_CHUNK_BYTES = 16 << 20
# a scored position's running logsumexp, next token's logit, top k (at most MAX_TOP_LOGPROBS) values and ids, rank
SCORE_BYTES_PER_POSITION = 16 + 12 * MAX_TOP_LOGPROBS


class GenerationCancelled(MoepackError):
    """The caller's `should_stop` said stop (its client left, its deadline passed): the prefill ended between two
    layers, after `layers_done` of them; StreamingPrefill.close() still returns its pools and buffers."""

    def __init__(self, layers_done: int):
        super().__init__(f"cancelled after {layers_done} layers of the prefill")
        self.layers_done = layers_done


def stop_check(should_stop: Callable[[], bool] | None, layers_done: int) -> Callable[[], None] | None:
    """A check that raises GenerationCancelled(layers_done) once `should_stop()` is true (None without one)."""
    if should_stop is None:
        return None

    def check() -> None:
        if should_stop():
            raise GenerationCancelled(layers_done)
    return check


@dataclass
class PrefillOptions:
    device: str = "cpu"
    bundle_experts: int = 4
    queue_depth: int = 4
    io_mode: str = "auto"
    # queries per attention chunk at most (a memory bound); None: the device's own (model.preferred_query_chunk)
    query_chunk: int | None = None
    expert_selection: str = "auto"
    verify_reads: bool = True  # xxh3 of every region read, checked before its bytes are used
    # The layers' matrices: float32 (the exact reference path) or bfloat16 (the attention's projections and the
    # shared expert, model.LOW_PRECISION_PREFIXES; their inputs are rounded to bf16, the residual streams, norms,
    # mHC and router stay float32). bf16 matmuls are 2-4x faster on CPUs with AVX512-BF16/AMX and on GPUs.
    # "auto": this machine's choice (resolve_compute_dtype; the commands' default).
    compute_dtype: str = "float32"
    # The routed experts' matmuls: float32 or bfloat16; None: as compute_dtype.
    expert_dtype: str | None = None
    # Expert-parallel runs: each rank owns a contiguous expert range per layer, of equal size ("contiguous") or of
    # equal routed load measured on this prompt ("balanced": the layer's reads then start once its router ran).
    expert_ownership: str = "contiguous"
    # bf16 FP4 experts on up to this many tokens run the fused kernel (CPUs with AVX512-BF16); None: the crossover
    # `moepack bench compute --expert-dtype bfloat16` measured on this CPU, else expert_decode.FUSED_MAX_TOKENS.
    fused_max_tokens: int | None = None
    # How the routed experts are computed (grouped_experts.py): "grouped" (each read's experts decoded together
    # and run as grouped GEMMs), "per-expert" (expert_runner.py: one at a time on CPU threads), or "auto" (grouped
    # on a GPU, per-expert on a CPU).
    expert_backend: str = "auto"
    # The weights held in the compute device's memory once per process (runtime/resident.py): no read, no copy.
    # io_mode="host" holds them in host RAM instead (pinned for a GPU).
    device_resident: bool = False
    # a progress bar while the weights are first loaded into memory (device_resident / io_mode "host")
    load_progress: bool = False
    # Called as each layer ends: on_layer(layer, number of layers, bytes the layer read) (a progress bar).
    on_layer: Callable[[int, int, int], None] | None = field(default=None, repr=False, compare=False)


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [vocab] float32, last position
    next_token: int
    stats: dict
    layers: list[LayerStats] = field(default_factory=list)
    # each layer's KV state after the prompt (run(keep_kv=True)), as the family keeps it (DeepSeek-V4: LayerKVState)
    states: list | None = None
    tokens_per_expert: list[list[int]] | None = None  # per layer, how many tokens the router sent to each expert
    # given run's prompt_logprobs k: each prompt token's log-probability after the first (len(ids) - 1 entries; the
    # first's needs the logits before it, a past's: joined_prompt_logprobs), each with its k likeliest tokens
    prompt_logprobs: list[TokenLogprob] | None = None


def joined_prompt_logprobs(before: torch.Tensor | None, ids: torch.Tensor, k: int,
                           rest: list[TokenLogprob], ranked: bool = False) -> list[TokenLogprob | None]:
    """A prompt's (or a chunk's) log-probabilities whole: its first token's from the logits [vocab] before it (a
    continued KV's, an earlier chunk's; None where nothing is before it: no entry, OpenAI's null; its rank where
    `ranked`), then `rest` (PrefillResult.prompt_logprobs)."""
    first = None if before is None else TokenLogprob.of(int(ids[0]), before.to("cpu", torch.float64), k, ranked)
    return [first, *rest]


def model_config(container: Container, computable: bool = True):
    """The model a container holds, as this runtime will compute it (its family's parsed config), checked before
    anything is read: its config as its family reads it (one this runtime computes as the reference does, unless
    `computable` is False), and every tensor that model uses in the container with the shape the config gives it
    (else compute would fail half-way or, for an optional one such as the router's bias, silently differ). `moepack
    verify` runs it too."""
    return check_container(container, computable)[1]


def layer_prefill(container: Container, compute_dtype: torch.dtype) -> LayerPrefill:
    """The arithmetic of the model a container holds (families.base.LayerPrefill), its config and tensors checked
    before anything is read (its family's check_container)."""
    family, config = check_container(container)
    return family.layer_prefill(config, compute_dtype)


def compute_device(name: str) -> torch.device:
    """The device `--device` names, checked; a CUDA device always with its index ("cuda" is the current one), as
    some torch.cuda calls refuse a device without one."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise MoepackError(f"unknown device {name!r} (cpu, cuda or cuda:N)")
    if device.type == "cpu":
        return device
    if not torch.cuda.is_available():
        raise MoepackError("--device cuda asked for, but torch sees no CUDA device")
    if (device.index or 0) >= torch.cuda.device_count():
        raise MoepackError(f"--device {name}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def held_for_serving(path: str, options: PrefillOptions) -> PrefillOptions:
    """A server's prefill options: where nothing was asked of the reads (io "auto", not device-resident), the weights
    held once for the process on a GPU, on the device where they fit its budget, else pinned in host RAM where they
    fit there (resident.place_that_fits); as given otherwise, and on a CPU (the page cache serves it)."""
    if options.io_mode != "auto" or options.device_resident:
        return options
    device = compute_device(options.device)
    with Container(path) as c:
        place = place_that_fits(c.part_paths, device)
    if place == "device":
        return replace(options, device_resident=True)
    return replace(options, io_mode="host") if place == "host" else options


def resolve_compute_dtype(options: PrefillOptions, device: torch.device) -> tuple[PrefillOptions, str]:
    """`options` with compute_dtype "auto" made this machine's choice (runtime.tuning.default_compute_dtype: what
    `moepack bench compute` measured on this CPU, else bfloat16 where it has native bf16 dot products), and where
    the dtype came from ("given" where it was named)."""
    if options.compute_dtype != "auto":
        return options, "given"
    name, why = default_compute_dtype(device)
    return replace(options, compute_dtype=name), f"auto: {why}"


@contextlib.contextmanager
def float32_matmuls_on_tensor_cores(device: torch.device, compute_dtype: torch.dtype):
    """On a GPU with bfloat16 compute, the float32 matmuls that stay (mHC mixes, router, indexer sums) run as TF32
    on the tensor cores, not on the CUDA cores at a tenth of the rate: their inputs carry bf16 rounding already.
    A CPU, or float32 compute (the exact path), is left as it is."""
    if device.type != "cuda" or compute_dtype != torch.bfloat16:
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def prompt_ids(token_ids) -> torch.Tensor:
    """One prompt's token ids, as the API takes them (a sequence or iterable of ints, an integer tensor or array,
    one row of them: [1, N] as a tokenizer's return_tensors gives), as a 1-D LongTensor (possibly empty). What is
    not that is a MoepackError, never rounded (floats), run as one prompt (several rows) or a traceback."""
    if isinstance(token_ids, (str, bytes)):
        raise MoepackError("token ids must be integers, not text (tokenize the prompt first)")
    if isinstance(token_ids, Iterator):  # a generator: torch takes no iterator
        token_ids = list(token_ids)
    try:
        ids = torch.as_tensor(token_ids)
    except (OverflowError, RuntimeError, TypeError, ValueError) as e:  # 2**64, ragged lists, None
        raise MoepackError(f"token ids must be integers within 64 bits ({e})") from None
    if ids.numel() and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):
        raise MoepackError(f"token ids must be integers, not {ids.dtype}")
    if any(size != 1 for size in ids.shape[:-1]):
        raise MoepackError(f"token ids of shape {list(ids.shape)}: one prompt at a time ([N] or [1, N])")
    return ids.to(torch.long).reshape(-1)


def check_prompt_ids(token_ids: torch.Tensor, vocab_size: int) -> int:
    """A prompt's token count, once its ids are checked (MoepackError: empty, or an id outside the vocabulary)."""
    n_tokens = int(token_ids.numel())
    if n_tokens < 1:
        raise MoepackError("empty prompt")
    if int(token_ids.max()) >= vocab_size or int(token_ids.min()) < 0:
        raise MoepackError(f"token id out of range 0..{vocab_size - 1}")
    return n_tokens


class StreamingPrefill:
    """One prefill over one container: walks the layers, all N tokens through each, over the pipeline's stages
    (ReadScheduler -> DeviceCopier -> ExpertRunner). Use `run(token_ids)`."""

    def __init__(self, container: Container, options: PrefillOptions,
                 on_layer_kv: Callable[[int, object], None] | None = None, dist=None,
                 resident_dense: list[dict] | None = None, keep_expert: Callable | None = None,
                 reader: RegionReader | None = None):
        """`reader`: the container's reader, shared with its owner (a Generator's decoder reads through it too;
        read_scheduler.prefill_reader), else the prefill opens its own."""
        if options.expert_ownership not in EXPERT_OWNERSHIPS:
            raise MoepackError(f"unknown expert ownership {options.expert_ownership!r} "
                               f"(choose from {', '.join(EXPERT_OWNERSHIPS)})")
        if options.expert_selection not in EXPERT_SELECTIONS:
            raise MoepackError(f"unknown expert selection {options.expert_selection!r}")
        if not 1 <= options.bundle_experts <= MAX_BUNDLE_EXPERTS:
            raise MoepackError(f"--bundle-experts must be 1 to {MAX_BUNDLE_EXPERTS}, got {options.bundle_experts}")
        self.c = container
        self.device = compute_device(options.device)
        options, self.compute_dtype_source = resolve_compute_dtype(options, self.device)
        self.opt = options
        # CPU: activations reused layer to layer, not faulted in again
        self.malloc_keeps_freed = self.device.type == "cpu" and keep_freed_memory()
        for what, value in (("compute", options.compute_dtype), ("expert", options.expert_dtype)):
            if value is not None and value not in EXPERT_DTYPES:
                raise MoepackError(f"unknown {what} dtype {value!r} (choose from {', '.join(EXPERT_DTYPES)})")
        self.compute_dtype = EXPERT_DTYPES[options.compute_dtype]
        self.expert_dtype = EXPERT_DTYPES[options.expert_dtype or options.compute_dtype]
        # the model's arithmetic, its family's (checked before anything is read)
        self.family = layer_prefill(container, self.compute_dtype)
        self.cfg = self.family.config
        self.on_layer_kv = on_layer_kv
        # every layer's dense weights already decoded on the device (a server keeps them): none is read again
        self.resident_dense = resident_dense
        self.dist = dist  # runtime.distributed.DistContext for expert-parallel runs, else None
        self.compute = BusyTimer()
        self.resident, self.resident_load_s = None, 0.0
        if options.device_resident or options.io_mode == "host":
            self._hold_weights()
        self.reads = ReadScheduler(container, self.family.shape, bundle_experts=options.bundle_experts,
                                   queue_depth=options.queue_depth, io_mode=options.io_mode,
                                   expert_selection=options.expert_selection, verify_reads=options.verify_reads,
                                   device=self.device, dist=dist,
                                   balanced=dist is not None and options.expert_ownership == "balanced",
                                   resident=self.resident, reader=reader)
        self.copier = DeviceCopier(self.device)
        self.expert_backend = resolve_expert_backend(options.expert_backend, self.device)
        naming = self.family.expert_naming
        if self.expert_backend == "grouped":
            self.experts = GroupedExperts(naming, self.family.expert_activation, self.device, self.expert_dtype,
                                          self.reads.checker, self.copier, self.reads.experts_pipe.release,
                                          self.compute, options.bundle_experts)
        else:
            self.experts = ExpertRunner(self.cfg, self.device, self.expert_dtype, self.reads.checker, self.copier,
                                        self.reads.experts_pipe.release, self.compute, options.fused_max_tokens,
                                        naming=naming, expert_ffn=self.family.expert_ffn,
                                        expert_forward=self.family.expert_forward,
                                        expert_limit=self.family.expert_limit)
        self.experts.keep_expert = keep_expert  # (ExpertRunner.keep_expert: decode's cache takes the bytes)
        self.closed = False
        self._pass_base = PassCounters.of(self)

    # --- the prefill ---------------------------------------------------------------------------------------------
    def run(self, token_ids: torch.Tensor, past: list | None = None, chunk_tokens: int | None = None,
            keep_kv: bool = False, should_stop: Callable[[], bool] | None = None,
            prompt_logprobs: int | None = None, ranked: bool = False) -> PrefillResult:
        """Prefill `token_ids`; with `past` (one state per layer as the family keeps it, e.g. DeepSeek-V4's
        `read_kv(...).layers`, or an earlier run's `states`) the tokens continue that state at positions P.., P the
        tokens it covers (LayerPrefill.seen_tokens; the list's entries are released as used).

        `chunk_tokens` runs the usual chunked prefill instead (chunk-major: every chunk through every layer, each
        chunk continuing the previous one's state): the same logits, but the model is read ceil(N / C) times. It
        exists to measure what layer-major order saves. `keep_kv`: the result holds every layer's state after the
        prompt (what a decode goes on from). `should_stop()` is asked before each layer (the first time once every
        check has passed) and between a layer's query chunks; true raises GenerationCancelled. `prompt_logprobs` k:
        the result's prompt_logprobs (the LM head then runs over every position, not the last alone); `ranked`:
        with each token's rank (vLLM's; the head runs over them twice)."""
        n_tokens = check_prompt_ids(token_ids, self.family.shape.vocab_size)
        if chunk_tokens is not None and chunk_tokens < 1:
            raise MoepackError("--chunk-tokens must be at least 1")
        past_tokens = self.family.seen_tokens(past[0]) if past else 0
        self.check_memory(past_tokens + n_tokens, n_tokens if prompt_logprobs is not None else 0)
        start, steal_before = self._pass_starts()
        chunks = token_ids.split(chunk_tokens) if chunk_tokens else [token_ids]
        all_stats: list[LayerStats] = []
        states, logits, scores = past, None, None
        with float32_matmuls_on_tensor_cores(self.device, self.compute_dtype), self._pass():
            for i, chunk in enumerate(chunks):
                final = i == len(chunks) - 1
                before = logits
                logits, layer_stats, (states,), (counts,), (chunk_scores,) = self._forward(
                    chunk.to(self.device), [states], emit_kv=final, keep_states=keep_kv or not final,
                    should_stop=should_stop, scored=[prompt_logprobs], ranked=ranked)
                all_stats.extend(layer_stats)
                if chunk_scores is not None:  # a later chunk's first token: from the logits the one before left
                    scores = chunk_scores if scores is None else [
                        *scores, *joined_prompt_logprobs(before[0], chunk, prompt_logprobs, chunk_scores, ranked)]
        stats = self._pass_stats(n_tokens, start, steal_before, all_stats)
        stats["order"] = "chunk" if chunk_tokens else "layer"
        stats["passes_over_model"] = len(chunks)
        return PrefillResult(logits[0], int(torch.argmax(logits[0])), stats, all_stats, states if keep_kv else None,
                             counts, scores)

    def run_many(self, prompts: list[torch.Tensor], pasts: list[list | None] | None = None, keep_kv: bool = True,
                 should_stop: Callable[[], bool] | None = None,
                 prompt_logprobs: list[int | None] | None = None, ranked: bool = False) -> list[PrefillResult]:
        """Prefill several prompts in ONE layer-major pass: their tokens concatenated, each layer's dense weights and
        every routed expert read (and decoded) once for all of them. The attention runs per prompt on its own rows,
        at its own positions, continuing its own `pasts` entry (one state per layer, as run's `past`, or
        None); the rest of a layer (DeepSeek-V4: mHC, the router, the routed and shared experts) on all rows at once.

        Result i is what run(prompts[i], pasts[i], keep_kv=keep_kv) gives, to float32 rounding (an expert's matmul
        sees the other prompts' rows too): prompt i's own last-position logits, states and tokens per expert. Its
        stats are the pass's (seconds, bytes read, layers: shared by all) with its own `tokens`, and
        `group_prompts` / `group_tokens` saying what it shared the pass with. `should_stop()` as in run: it stops
        the whole pass. The memory check counts every prompt's tokens (and past tokens) together.
        `prompt_logprobs`: one k (or None) per prompt, as run's; `ranked` as run's, for every scored prompt.

        Only the plain layer-order pass has a grouped form: run's `chunk_tokens` order exists to measure one
        prompt's passes over the model, and the refusals below name the other two."""
        if self.dist is not None:
            # every rank must run the same prompts through each collective: the group would be a protocol of its own
            raise MoepackError("an expert-parallel prefill runs one prompt at a time")
        if self.on_layer_kv is not None:
            # the KV handed out as each layer ends (kv_out) is one sequence's, written to one directory
            raise MoepackError("a prefill that hands out its KV layer by layer (kv_out) runs one prompt at a time")
        if not prompts:
            raise MoepackError("no prompt to prefill")
        pasts = list(pasts) if pasts is not None else [None] * len(prompts)
        if len(pasts) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(pasts)} past states")
        scored = [None] * len(prompts) if prompt_logprobs is None else list(prompt_logprobs)
        if len(scored) != len(prompts):  # (zipped with the prompts below: a short list had failed after the pass)
            raise ValueError(f"{len(prompts)} prompts but {len(scored)} prompt_logprobs")
        lengths = [check_prompt_ids(ids, self.family.shape.vocab_size) for ids in prompts]
        self.check_memory(sum(lengths) + sum(self.family.seen_tokens(past[0]) for past in pasts if past),
                          sum(n for n, k in zip(lengths, scored) if k is not None))
        start, steal_before = self._pass_starts()
        with float32_matmuls_on_tensor_cores(self.device, self.compute_dtype), self._pass():
            logits, layer_stats, states, counts, scores = self._forward(
                torch.cat([ids.reshape(-1) for ids in prompts]).to(self.device), pasts, emit_kv=False,
                keep_states=keep_kv, should_stop=should_stop, lengths=lengths, scored=scored, ranked=ranked)
        stats = self._pass_stats(sum(lengths), start, steal_before, layer_stats)
        stats.update(order="layer", passes_over_model=1, group_prompts=len(prompts), group_tokens=sum(lengths))
        return [PrefillResult(logits[i], int(torch.argmax(logits[i])),
                              {**stats, "tokens": n, "tokens_per_s": round(n / stats["seconds"], 2)
                               if stats["seconds"] else None},
                              layer_stats, states[i] if keep_kv else None, counts[i], scores[i])
                for i, n in enumerate(lengths)]

    def _pass_starts(self) -> tuple[float, float | None]:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._pass_base = PassCounters.of(self)  # the pass's stats count from here: the engine serves many passes
        return time.perf_counter(), cpu_steal_seconds()

    @contextlib.contextmanager
    def _pass(self):
        """One pass over the layers; however it ends (done, cancelled, failed), what it left of its reads is
        cancelled or awaited and their buffers go back (ReadScheduler.end_pass): the engine's pools and threads
        serve the next pass as they were."""
        held = self._resident_for_pass()
        try:
            yield
        finally:
            try:
                self.reads.end_pass(self.copier.release)
            finally:
                if held is not None:
                    held.done_using()

    def _hold_weights(self) -> None:
        """The container's bytes held once per process (runtime/resident.py), loaded here on the process's first
        use."""
        opt = self.opt
        self.resident, loaded = resident_bytes(self.c, "device" if opt.device_resident else "host", self.device,
                                               opt.verify_reads, opt.load_progress)
        self.resident_load_s = self.resident.load_seconds if loaded else 0.0

    def _resident_for_pass(self):
        """The held bytes, taken for one pass (none where the prefill reads the disk); held again where they were
        released since the last pass (resident.release_resident): the released copy let go of first, so the two
        need not fit at once."""
        while self.resident is not None and not self.resident.acquire():
            self.resident = None
            self.reads.use_resident(None)
            self._hold_weights()
            self.reads.use_resident(self.resident)
        return self.resident

    def after_prompt(self) -> None:
        """Between prompts of an engine that stays open (a Generator's): drop what was kept for the prompts just
        prefilled (the family's tables of their positions) and give the freed memory back to the system, as
        close() does, while the pools and threads stay for the next."""
        self.family.close()
        if self.malloc_keeps_freed:
            release_freed_memory()

    def _pass_stats(self, n_tokens: int, start: float, steal_before: float | None, layers: list[LayerStats]) -> dict:
        wall, steal_after = time.perf_counter() - start, cpu_steal_seconds()
        stats = self._stats(n_tokens, wall, layers)
        # a VM's time lost to its host, machine-wide: on a VM, streamed runs were measured losing 0.15-0.6 s of
        # it and resident runs none (docs/benchmarks.md); it explains a run slower than its parts measured alone
        stats["steal_s"] = (round(steal_after - steal_before, 3)
                            if steal_before is not None and steal_after is not None else None)
        return stats

    def _forward(self, token_ids: torch.Tensor, pasts: list[list | None], emit_kv: bool, keep_states: bool,
                 should_stop: Callable[[], bool] | None = None, lengths: list[int] | None = None,
                 scored: list[int | None] | None = None, ranked: bool = False):
        """One pass of `token_ids` through every layer (reading each region once): one prompt, or the prompts of
        `lengths` tokens each, concatenated (run_many), `pasts` one entry per prompt. Returns each prompt's last
        position's logits [prompts, vocab], per-layer stats (all prompts), and per prompt (keep_states) its new
        per-layer states, the tokens its router sent to each expert of each layer and, where `scored` gives it a k,
        its tokens' log-probabilities after the first (PrefillResult.prompt_logprobs, ranked where `ranked`; else
        None). The arithmetic is the family's (self.family, families.base.LayerPrefill); the reads, the experts and
        the order are this one's."""
        family, blocks, names = self.family, self.c.layers, self.family.names
        moe_layers = set(family.shape.moe_layers)
        n_tokens = int(token_ids.numel())
        lengths = lengths or [n_tokens]
        ends = list(itertools.accumulate(lengths))
        spans = [(end - n, end) for n, end in zip(lengths, ends)]  # each prompt's rows
        positions = [torch.arange(first, first + n, device=self.device)
                     for first, n in zip((family.seen_tokens(past[0]) if past else 0 for past in pasts), lengths)]
        # The embedding's bytes first: the first the compute needs (queued behind the expert reads, they would make
        # the compute wait for the disk before it could start; read first, they cost the disk a few milliseconds).
        # Only the prompt's rows are decoded, on the host, once the first layer's reads are queued: a
        # vocabulary-sized table is not pinned for them unless it is also the head (tied), which goes to the device
        embed_bytes = self.reads.read_globals([names.embedding], for_device=names.tied)
        resident = self.resident_dense
        pending_dense = self.reads.submit_dense(blocks[0]) if resident is None else None
        self.reads.begin(n_tokens)
        hidden = family.hidden_from_embeddings(self._embeddings(embed_bytes, token_ids))
        # a head tied to the embedding uses the bytes just read: read once per prompt, like every region
        held_for_head = embed_bytes if names.tied else None
        del embed_bytes
        head_names = (*names.head_globals, names.head)
        head_bytes: Future | None = None  # read during the last layer, beside its experts
        spare: torch.Tensor | None = None  # the hidden rows' second buffer
        layer_stats: list[LayerStats] = []
        counts: list[list[list[int]]] = [[] for _ in spans]  # per prompt, per layer, tokens per expert
        states = [[] for _ in spans] if keep_states else [None] * len(spans)
        next_w = None  # this layer's dense weights, decoded beside the previous layer's experts
        for number, block in enumerate(blocks):
            # between layers (and between a layer's query chunks) only reads queued ahead are in flight: close()
            # cancels them or waits them out
            between = stop_check(should_stop, number)
            if between is not None:
                between()
            if resident is not None:
                w = resident[number]
            else:
                w = next_w if next_w is not None else self._dense_weights(block, pending_dense)
            # a hash layer's experts come from the token ids: read before its attention
            reads = self.reads.reads_before_router(number, token_ids, lambda: family.hash_table(number, w))
            if number + 1 < len(blocks) and resident is None:
                pending_dense = self.reads.submit_dense(blocks[number + 1])
            with self.compute:
                # the hidden rows alternate between two buffers: DeepSeek-V4's [N, hc, H] is over glibc's 32 MiB
                # mmap threshold from N = 2048 (V4-Flash: N = 512), where each fresh allocation would fault in every
                # page again
                spare = torch.empty_like(hidden) if spare is None else spare
                # each prompt attends on its own rows (its positions, its past); their new rows fill `spare`
                kv_states = []
                for (a, b), past, prompt_positions in zip(spans, pasts, positions):
                    kv_states.append(family.attention(number, w, hidden[a:b], prompt_positions,
                                                      past[number] if past else None, self.opt.query_chunk,
                                                      spare[a:b], between)[1])
                    if past:
                        past[number] = None  # the old state is folded into the new one
                hidden, spare = spare, hidden
                routing = family.route(number, w, hidden, token_ids)
                if len(ends) > 1:  # the experts' kernels are chosen by each prompt's own tokens (ExpertRunner)
                    routing.prompt_ends = ends
                by_expert = routing.tokens_by_expert() if number in moe_layers else {}
            if emit_kv and self.on_layer_kv is not None:  # (one prompt: run_many refuses on_layer_kv)
                self.on_layer_kv(number, kv_states[0])  # the layer's KV is final: it leaves the device now
            if keep_states:
                for prompt_states, kv_state in zip(states, kv_states):
                    prompt_states.append(kv_state)
            del kv_states
            if reads is None:
                reads = self.reads.reads_after_router(number, by_expert)
            if number == len(blocks) - 1:  # after the layer's expert reads: the head is needed last
                head_bytes = self.reads.read_globals_later(head_names, held_for_head)
            routed, beside_out, next_w = self._experts(number, block, w, reads, routing, moe_layers, pending_dense)
            with self.compute:
                hidden, spare = family.finish(number, w, hidden, routing, routed, beside_out, spare), hidden
            layer_stats.append(self.reads.layer_stats(number, reads, by_expert, dense_read=resident is None))
            if self.opt.on_layer is not None:
                self.opt.on_layer(number, len(blocks), layer_stats[-1].bytes_read)
            if len(spans) == 1:
                counts[0].append(tokens_per_expert(by_expert, len(block.experts)))
            else:
                for prompt_counts, (a, b) in zip(counts, spans):
                    prompt_counts.append(torch.bincount(routing.experts[a:b].reshape(-1),
                                                        minlength=len(block.experts)).tolist()
                                         if number in moe_layers else [])
        # each scored prompt's positions but its last, and the token after each (a one-token prompt: none)
        scorers = [None if k is None else
                   (torch.arange(a, b - 1, device=self.device), NextTokenScores(token_ids[a + 1:b], k, ranked))
                   for k, (a, b) in zip(scored or [None] * len(spans), spans)]
        logits = self._head_logits(head_bytes.result() if head_bytes is not None else
                                   self.reads.read_globals(head_names, held_for_head), hidden,
                                   torch.tensor(ends, device=self.device) - 1, [s for s in scorers if s is not None])
        scores = [None if scorer is None else scorer[1].entries() for scorer in scorers]
        return logits, layer_stats, states, counts, scores

    def _experts(self, number: int, block: Block, w: dict, reads: list, routing, moe_layers: set,
                 pending_dense: Future | None) -> tuple[torch.Tensor | None, object, dict | None]:
        """The layer's routed experts by the expert backend (None in a layer without them), the family's work
        beside them (its result, or None where the backend has no threads for it: finish runs it), and the next
        layer's dense weights where they were decoded beside the experts (else None)."""
        if number not in moe_layers:
            return None, None, None
        # beside the routed experts (and while they wait for the disk): the family's (a shared expert), and the next
        # layer's dense decode (its read began before this layer's attention) instead of alone later with a core
        # idle. Without expert threads the backend hands them back undone.
        beside, family_work = [], self.family.beside_experts(number, w, routing)
        if family_work is not None:
            beside.append((*family_work, True))
        decode_next = number + 1 < len(self.c.layers) and self.resident_dense is None
        if decode_next:
            beside.append((self._dense_weights, (self.c.layers[number + 1], pending_dense), False))
        routed, results = self.experts.run_layer(block, reads, routing, beside)
        if self.dist:  # combine: every rank adds its experts' share
            routed = self.dist.all_reduce_sum(routed, f"combining layer {number}'s experts")
        family_out = results[0] if family_work is not None else None
        return routed, family_out, results[-1] if decode_next else None

    # --- weights -------------------------------------------------------------------------------------------------
    def _dense_weights(self, block: Block, future: Future) -> dict[str, torch.Tensor]:
        """A layer's dense weights, decoded on the compute device (expert_runner.decode_dense)."""
        buffer, view = future.result()
        try:
            with self.compute:
                self.reads.checker.before_use([block.dense], view, block.dense.offset)
                return decode_dense(block, self.copier.to_device(buffer, view), self.compute_dtype,
                                    self.family.layer_prefix(block.number),
                                    in_compute_dtype=self.family.in_compute_dtype)
        finally:
            self.copier.release(buffer, self.reads.dense_pipe.release)

    def _global_tensors(self, fetched: list[tuple[Region, HostBuffer, memoryview]], on_device: bool
                        ) -> tuple[dict, Callable]:
        """The entries of fetched global regions (checked) by name, and read(entry) -> its bytes, on the compute
        device or (`on_device` False) on the host."""
        by_name, reads = {}, {}
        for r, buf, view in fetched:
            self.reads.checker.global_before_use(r, view)
            raw = self.copier.to_device(buf, view, pooled=False) if on_device else self.copier.host_bytes(buf, view)
            read = entry_bytes(raw, r.offset)
            for t in r.tensors:
                by_name[t.name], reads[t.name] = t, read
        return by_name, lambda t: reads[t.name](t)

    def _global_group(self, by_name: dict, name: str) -> list:
        """The entry `name` with its scale companions."""
        if name not in by_name:
            raise FormatError(f"{self.c.path}: the container has no {name}")
        return [by_name[n] for n in (name, *companion_names(name)) if n in by_name]

    def _embeddings(self, fetched: list[tuple[Region, HostBuffer, memoryview]], token_ids: torch.Tensor
                    ) -> torch.Tensor:
        """The prompt's rows of the embedding [N, H] float32 on the compute device: only those rows are decoded
        (on the host: a vocabulary-sized table never goes to the device, unless it is held there already)."""
        on_device = self.resident is not None and self.resident.on_device
        with self.compute:
            by_name, read = self._global_tensors(fetched, on_device=on_device)
            name = self.family.names.embedding
            return decode_group_rows(self._global_group(by_name, name), read, name,
                                     token_ids if on_device else token_ids.cpu()).to(self.device)

    def _head_logits(self, fetched: list[tuple[Region, HostBuffer, memoryview]], hidden: torch.Tensor,
                     rows: torch.Tensor, scorers: list[tuple[torch.Tensor, NextTokenScores]] = ()) -> torch.Tensor:
        """The logits [len(rows), vocab] float32 of the positions `rows` (on the host). The LM head is decoded and
        applied HEAD_CHUNK_BYTES of rows at a time. Each (positions, scorer) of `scorers` is given those positions'
        logits too, each slice of the head once for all of them (once more for the ranked ones), at most
        SCORE_CHUNK_BYTES of logits at a time."""
        with self.compute:
            by_name, read = self._global_tensors(fetched, on_device=True)
            names = self.family.names
            weights = decode_group([t for n in names.head_globals for t in self._global_group(by_name, n)], read)
            head = self._global_group(by_name, names.head)
            x = self.family.head_input(weights, hidden, rows)
            scored = [(self.family.head_input(weights, hidden, positions), scorer) for positions, scorer in scorers]
            out, first_id = [], 0
            rows_per_slice = HEAD_CHUNK_BYTES // (4 * head[0].shape[1])
            for head_rows in decode_group_row_slices(head, read, names.head, rows_per_slice):
                out.append(F.linear(x.to(head_rows.dtype), head_rows).float())
                for part, inputs, scorer in _score_parts(scored, len(head_rows)):
                    scorer.add(part, F.linear(inputs.to(head_rows.dtype), head_rows).float(), first_id)
                first_id += len(head_rows)
            ranked = [(inputs, scorer) for inputs, scorer in scored if scorer.ranks is not None]
            if ranked:  # each next token's logit known: its rank counted over the slices again (the same arithmetic)
                for head_rows in decode_group_row_slices(head, read, names.head, rows_per_slice):
                    for part, inputs, scorer in _score_parts(ranked, len(head_rows)):
                        scorer.count(part, F.linear(inputs.to(head_rows.dtype), head_rows).float())
            return torch.cat(out, dim=-1).cpu()

    # --- before and after ----------------------------------------------------------------------------------------
    def check_memory(self, n_tokens: int, scored_tokens: int = 0, freeable_bytes: int = 0) -> None:
        """Refuse a prompt (or prompts prefilled together: n_tokens is all of theirs) whose working set cannot fit,
        before reading or computing anything (memory.check_prefill_memory, with this prefill's pool and threads).
        `scored_tokens`: the positions whose prompt_logprobs are asked for (the head's input and a running score
        each, and a slice of their logits). `freeable_bytes`: host memory the caller would give back first."""
        scoring = (SCORE_CHUNK_BYTES + scored_tokens * (4 * self.family.shape.hidden_size + SCORE_BYTES_PER_POSITION)
                   if scored_tokens else 0)
        check_prefill_memory(self.c, self.family, self.device, n_tokens, query_chunk=self.opt.query_chunk,
                             bundle_bytes=self.reads.experts_pipe.buffer_bytes,
                             pool_buffers=self.reads.pool_buffers_in_memory(self.device),
                             expert_threads=self.experts.threads, decoded_experts=self.experts.decoded_at_once,
                             grouped=self.expert_backend == "grouped", head_chunk_bytes=HEAD_CHUNK_BYTES,
                             scoring_bytes=scoring, freeable_bytes=freeable_bytes)

    def _stats(self, n_tokens: int, wall: float, layers: list[LayerStats]) -> dict:
        reader, pipe = self.reads.reader, self.reads.experts_pipe
        io = PassCounters.of(self).since(self._pass_base)  # this pass's
        busiest = max(io.busy_seconds, io.compute_seconds, 1e-9)
        stats = {
            "tokens": n_tokens,
            "seconds": round(wall, 4),
            "tokens_per_s": round(n_tokens / wall, 2),
            "bytes_read": io.bytes_read,
            "bytes_read_per_part": list(io.bytes_by_part),  # [main file, part 1, ...]
            "read_requests": io.requests,
            "io_mode": reader.mode if self.resident is None else f"resident in {self.resident.place} memory",
            # the first prefill of a process over resident weights loads them (here, before the prefill's clock)
            "resident_load_s": round(self.resident_load_s, 3),
            "resident_bytes": self.resident.nbytes if self.resident is not None else 0,
            "io_busy_s": round(io.busy_seconds, 4),
            "compute_busy_s": round(io.compute_seconds, 4),
            "overlap": round(wall / busiest, 3),
            "bytes_skipped": sum(s.bytes_skipped for s in layers),
            "bundle_experts": self.opt.bundle_experts,
            "compute_dtype": self.opt.compute_dtype,
            "compute_dtype_source": self.compute_dtype_source,
            "expert_dtype": str(self.expert_dtype).removeprefix("torch."),
            "expert_backend": self.expert_backend,
            "expert_gemm": self.experts.gemm_kernel() if self.expert_backend == "grouped" else None,
            "expert_threads": self.experts.threads,
            # experts on up to this many tokens ran the fused FP4 matmul (the weights never decoded to memory)
            "fused_expert_max_tokens": self.experts.fused_tokens,
            "fused_expert_max_tokens_source": self.experts.fused_tokens_source,
            "queue_depth": self.opt.queue_depth,
            "read_pool_bytes": pipe.buffers * pipe.buffer_bytes,
            "malloc_keeps_freed": self.malloc_keeps_freed,
            "device": str(self.device),
            "threads": torch.get_num_threads(),
            "omp_spincount": os.environ.get("GOMP_SPINCOUNT"),  # what libgomp was loaded with (moepack/__init__.py)
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            # None on a CPU, where the host's peak (peak_rss_bytes) is the device's
            "peak_device_bytes": (torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda"
                                  else None),
            # what torch's allocator held from the device at its peak (tensors plus its cache and fragmentation):
            # what a device budget must cover
            "peak_device_reserved_bytes": (torch.cuda.max_memory_reserved(self.device)
                                           if self.device.type == "cuda" else None),
        }
        if self.dist:
            stats.update(rank=self.dist.rank, world_size=self.dist.world_size, backend=self.dist.backend,
                         comm_s=round(self.dist.comm_seconds, 4))
        if reader.warning:
            stats["io_warning"] = reader.warning
        return stats

    def close(self) -> None:
        self.closed = True
        self.family.close()
        self.reads.close()
        self.experts.close()
        if self.malloc_keeps_freed:
            release_freed_memory()


def _score_parts(scored: list, slice_rows: int):
    """(positions, their head inputs, scorer) of each (inputs, scorer) in `scored`, as many positions at a time as
    have their logits over a head slice of `slice_rows` vocabulary ids within SCORE_CHUNK_BYTES."""
    step = max(1, SCORE_CHUNK_BYTES // (4 * slice_rows))
    for inputs, scorer in scored:
        for start in range(0, len(inputs), step):
            yield slice(start, start + step), inputs[start:start + step], scorer


@dataclass
class PassCounters:
    """An engine's cumulative read and compute counters at one moment: a pass's stats are the difference."""
    bytes_read: int
    requests: int
    busy_seconds: float
    bytes_by_part: list[int]
    compute_seconds: float

    @classmethod
    def of(cls, engine: StreamingPrefill) -> "PassCounters":
        io = engine.reads.reader.stats
        return cls(io.bytes_read, io.requests, io.busy_seconds, list(io.bytes_by_part), engine.compute.seconds)

    def since(self, before: "PassCounters") -> "PassCounters":
        return PassCounters(self.bytes_read - before.bytes_read, self.requests - before.requests,
                            self.busy_seconds - before.busy_seconds,
                            [a - b for a, b in zip(self.bytes_by_part, before.bytes_by_part)],
                            self.compute_seconds - before.compute_seconds)


def prefill(path: str, token_ids, options: PrefillOptions | None = None, on_layer_kv=None,
            kv_out: str | None = None, continue_from: str | None = None, kv_dtype: str = "F32",
            kv_sync: bool = True, chunk_tokens: int | None = None, expert_parallel: bool = False,
            dist_timeout_s: float = 120.0, kv_overwrite: bool = False) -> PrefillResult:
    """Open `path`, run one prefill of `token_ids` (a sequence of ints or a LongTensor), close.

    `kv_out`: write the KV (format_spec/KV.md) there, layer by layer from a writer thread (a KV already there is
    refused unless `kv_overwrite`: the new one is then written beside it and swapped in once complete).
    `continue_from`: a KV directory made with this container; `token_ids` are the tokens that follow its prompt (the
    KV written to `kv_out`, which may be the same directory, covers both). `expert_parallel`: this process is one rank
    of a torchrun job (runtime/distributed.py); `{rank}` in `path` picks each rank's own copy of the container."""
    options = options or PrefillOptions()
    token_ids = prompt_ids(token_ids)
    if token_ids.numel() < 1:
        raise MoepackError("empty prompt")
    dist = None
    if expert_parallel:
        from .distributed import init_from_env

        compute_device(options.device)  # a device this machine lacks is named as such, not as a failed join
        dist = init_from_env(options.device, dist_timeout_s)
        path = path.replace("{rank}", str(dist.rank))  # --container-per-rank: each rank its own copy
        if dist.rank != 0:
            kv_out = None  # rank 0 writes the KV; every rank holds the same state
    try:
        result = _prefill_open(path, token_ids, options, on_layer_kv, kv_out, continue_from, kv_dtype, kv_sync,
                               chunk_tokens, dist, kv_overwrite)
        if dist:
            # per layer too: which experts each rank owned, and its load
            ranks = dist.gather({**result.stats, "layers": [vars(s) for s in result.layers]})
            if dist.rank == 0:
                result.stats["ranks"] = ranks
                result.stats["bytes_read_all_ranks"] = sum(r["bytes_read"] for r in ranks)
        return result
    finally:
        if dist:
            dist.close()


def container_kv_format(container: Container):
    """families.kv_format_for of the container's model, a refusal naming the container."""
    try:
        return kv_format_for(container.architecture)
    except MoepackError as e:
        raise MoepackError(f"{container.path}: {e}") from None


def _prefill_open(path, token_ids, options, on_layer_kv, kv_out, continue_from, kv_dtype, kv_sync, chunk_tokens,
                  dist, kv_overwrite=False) -> PrefillResult:
    from moepack.families import kv_directory as kvd

    with Container(path) as c:
        kv_format = container_kv_format(c) if kv_out is not None or continue_from is not None else None
        identity = kvd.identity_of_container(c)
        past, all_ids, start = None, token_ids.tolist(), 0
        kv = None
        if continue_from is not None:
            kv = kvd.read_kv(continue_from, kv_format, expect_identity=identity)  # whole KV before any write
            past, start, all_ids = kv.layers, kv.seen_tokens, kv.token_ids + token_ids.tolist()
        hooks = [on_layer_kv] if on_layer_kv is not None else []

        def on_kv(layer, state):
            for hook in hooks:
                hook(layer, state)

        engine = StreamingPrefill(c, options, on_kv if hooks or kv_out is not None else None, dist)
        if kv is not None:
            kvd.kv_dtype_warning(kv, engine.opt.compute_dtype)
        writer = None
        try:
            if dist is not None:
                opt = engine.opt  # as resolved on this rank ("auto" is each machine's own)
                prompt_hash = xxh3_hex(torch.tensor(all_ids).numpy().tobytes())
                dist.check_same_job({"container": f"index xxh3 {identity['container_index_xxh3']}",
                                     "prompt": f"{len(all_ids)} tokens, xxh3 {prompt_hash}",
                                     "past tokens": start, "options": (
                                         opt.compute_dtype, opt.expert_dtype or opt.compute_dtype,
                                         opt.expert_selection, opt.expert_ownership, chunk_tokens)})
            if kv_out is not None:
                in_place = continue_from is not None and os.path.realpath(kv_out) == os.path.realpath(continue_from)
                writer = kvd.BackgroundKVWriter(kvd.open_writer(
                    kv_out, kv_format, identity, all_ids, dtype=kv_dtype, start_token=start,
                    overwrite=in_place or kv_overwrite, sync=kv_sync,
                    extra=kvd.computed_in(engine.opt.compute_dtype, kv)))
                hooks.insert(0, writer)
            try:
                result = engine.run(token_ids, past, chunk_tokens=chunk_tokens)
            except BaseException:
                if writer is not None:  # a KV written in place keeps the layers written so far (the manifest says
                    writer.abandon()    # which), a replacement goes (the old KV stays); the prefill's error is raised
                raise
            if writer is not None:
                t0 = time.perf_counter()
                writer.finish(result.next_token, result.logits)
                result.stats.update(kv_out=kv_out, kv_bytes=sum(e["bytes"] for e in writer.writer.manifest["layers"]),
                                    kv_write_busy_s=round(writer.write_seconds, 4),
                                    kv_handoff_s=round(writer.submit_seconds, 4),
                                    kv_finish_wait_s=round(time.perf_counter() - t0, 4))
            if continue_from is not None:
                result.stats.update(continued_from=continue_from, past_tokens=start)
            return result
        finally:
            engine.close()
