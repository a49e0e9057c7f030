"""Layer-major prefill with the routed experts streamed from the container.

For each layer L: the dense region (attention, norms, router, shared expert, mHC) was prefetched while layer L-1
computed; all N tokens run through the attention; the layer's experts are read in expert-ID order, in bundles of K
consecutive experts (one aligned read each, Q reads in flight into a fixed pool of buffers that holds a layer's
experts, within an eighth of the memory; in huge pages, io.HostBuffer), and each bundle is
computed as it arrives: the (token, expert) pairs are sorted by expert once per layer, gathered with one
index_select, multiplied expert by expert into one float32 buffer of rows, and each token's top-k rows summed back
with their routing weights. Every region the prefill needs is read exactly once. The embedding's rows are decoded
for the prompt's tokens only; the LM head is read during the last layer and applied a slice at a time.

Which experts are read: long prompts read every expert of the layer (no waiting for the router: with N tokens
choosing k of E experts almost every expert is used); those reads are queued READ_AHEAD_LAYERS layers ahead, in
layer order, so the disk goes straight on into the next layers while the experts and the next attention compute (the
spare buffers take what it reads meanwhile). Hash-routed layers know their experts from the token ids, before any
compute; short prompts read only the experts the router chose. The choice is made per layer
(`expert_selection="auto"`) and reported.

CPU specifics. With several threads, the experts of a layer run side by side on a pool of threads, one core each
(torch's intra-op threads set to 1 inside them): an expert's matmuls on a few dozen tokens split badly across cores,
and every small op between them would pay an OpenMP barrier, which any other busy core stalls. The threads take the
layer's work list themselves, in read order; the shared expert and the next layer's dense decode run beside the
routed experts. Each expert thread decodes FP4 with its own ExpertDecoder (AVX-512/SSSE3 lookup, expert_decode.py;
bf16 experts on up to FUSED_MAX_TOKENS tokens run the fused FP4 kernel instead, AVX512-BF16). Each region's
checksum is computed by the thread about to decode it, not by a reader thread beside the attention. glibc is asked
to keep freed activations for the next layer (io.keep_freed_memory). With `io_mode="mmap"` the reads are
zero-copy: the experts decode straight from the mapped page cache. `compute_dtype="bfloat16"` keeps the attention's
projections and the shared expert in bf16 (decoded straight to bf16 from FP8); residual streams, norms, mHC, router
and softmax stay float32. The float32 default is the path that matches the reference to 1e-3.
"""

from __future__ import annotations

import os
import resource
import statistics
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import xxhash

from moepack.format_spec.decode import companion_names, decode_group, decode_group_row_slices, decode_group_rows
from moepack.format_spec.errors import FormatError, MoepackError
from moepack.format_spec.reader import SCALE_SUFFIXES, Block, Container, ReadSpan, Region
from moepack.format_spec.source_formats import fp8_decoder_compiled

from . import model as v4
from .bench import tuned_fused_max_tokens
from .distributed import balanced_ranges
from .expert_decode import ExpertDecoder, ExpertWeights, default_fused_tokens, fused_max_tokens
from .io import (HostBuffer, ReadPipeline, RegionReader, available_memory_bytes, cpu_steal_seconds,
                 keep_freed_memory, release_freed_memory)

EXPERT_SELECTIONS = ("auto", "all", "routed")
EXPERT_OWNERSHIPS = ("contiguous", "balanced")
EXPERT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EXPERT_BUFFERS_PER_READ = 2
# ... and up to a whole layer's expert section: while a layer's attention runs, the disk reads the next layer's
# experts into the pool instead of stopping once Q reads are ready (N = 256, medium model: streamed 1.40 -> 1.21 s,
# as fast as from the page cache), within this fraction of the available memory
READ_POOL_MEMORY_FRACTION = 0.125
READ_AHEAD_LAYERS = 2  # expert reads known in advance are queued this many layers beyond the current one
# auto reads a whole layer when at most this fraction of its experts is expected to go unused
ALL_EXPERTS_UNUSED_FRACTION = 0.05
# the LM head is decoded and applied this many float32 bytes of rows at a time, never whole (DeepSeek-V4-Flash's
# bf16 head [129280, 4096] would be 2 GiB decoded)
HEAD_CHUNK_BYTES = 16 << 20
HEAD_GLOBALS = ("hc_head_fn", "hc_head_base", "hc_head_scale", "norm.weight")  # and the LM head's matrix


@dataclass
class PrefillOptions:
    device: str = "cpu"
    bundle_experts: int = 4
    queue_depth: int = 4
    io_mode: str = "auto"
    query_chunk: int | None = 512
    expert_selection: str = "auto"
    verify_reads: bool = True  # xxh3 of every region read, checked before its bytes are used
    # The layers' matrices: float32 (the exact reference path) or bfloat16 (the attention's projections and the
    # shared expert, model.LOW_PRECISION_PREFIXES; their inputs are rounded to bf16, the residual streams, norms,
    # mHC and router stay float32). bf16 matmuls are 2-4x faster on CPUs with AVX512-BF16/AMX and on GPUs.
    compute_dtype: str = "float32"
    # The routed experts' matmuls: float32 or bfloat16; None: as compute_dtype.
    expert_dtype: str | None = None
    # Expert-parallel runs: each rank owns a contiguous expert range per layer, of equal size ("contiguous") or of
    # equal routed load measured on this prompt ("balanced": the layer's reads then start once its router ran).
    expert_ownership: str = "contiguous"
    # bf16 FP4 experts on up to this many tokens run the fused kernel (CPUs with AVX512-BF16); None: the crossover
    # `moepack bench compute --expert-dtype bfloat16` measured on this CPU, else expert_decode.FUSED_MAX_TOKENS.
    fused_max_tokens: int | None = None


@dataclass
class LayerStats:
    layer: int
    selection: str  # "all", "hash" or "routed"
    experts_read: int
    experts_used: int
    tokens_per_expert_min: int
    tokens_per_expert_median: float
    tokens_per_expert_max: int
    unused_experts: int
    bytes_read: int
    bytes_skipped: int
    owned_experts: tuple[int, int] | None = None  # expert-parallel: this rank's [first, last + 1) in this layer
    tokens_computed: int = 0  # token-expert pairs this process computed in this layer (its load)


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [vocab] float32, last position
    next_token: int
    stats: dict
    layers: list[LayerStats] = field(default_factory=list)


class _Timer:
    """Accumulates the seconds during which at least one thread is inside a `with timer:` block."""

    def __init__(self):
        self.seconds = 0.0
        self._inside = 0
        self._since = 0.0
        self._lock = threading.Lock()

    def __enter__(self):
        with self._lock:
            if not self._inside:
                self._since = time.perf_counter()
            self._inside += 1

    def __exit__(self, *exc):
        with self._lock:
            self._inside -= 1
            if not self._inside:
                self.seconds += time.perf_counter() - self._since


def expected_unused_fraction(n_tokens: int, top_k: int, n_experts: int) -> float:
    """Fraction of a layer's experts that no token picks, if picks were uniform: (1 - k/E)^N."""
    return (1.0 - top_k / n_experts) ** n_tokens if n_experts else 0.0


def read_pool_buffers(section_reads: int, buffer_bytes: int, depth: int, available: int, pinned: bool = False,
                      sharers: int = 1) -> int:
    """Buffers of the expert read pool: one per read of the largest layer's expert section (`section_reads`) and at
    least EXPERT_BUFFERS_PER_READ per read in flight, within READ_POOL_MEMORY_FRACTION of `available` host memory
    (0: unknown) split between the `sharers` processes of one host (expert-parallel ranks, each reading its share of
    a section), never fewer than `depth`. Pinned pools (CUDA) stay at EXPERT_BUFFERS_PER_READ per read in flight:
    page-locked memory is taken from the whole system and slow to allocate, and a GPU's attention leaves the disk
    little time to fill more."""
    want = EXPERT_BUFFERS_PER_READ * depth
    if not pinned:
        want = max(want, -(-section_reads // max(sharers, 1)))
    if available:
        share = int(available * READ_POOL_MEMORY_FRACTION) // max(sharers, 1)
        want = min(want, share // max(buffer_bytes, 1))
    return max(depth, want)


def estimate_working_set(cfg: "v4.ModelConfig", n_tokens: int, query_chunk: int | None, dense_bytes: int,
                         bundle_bytes: int, pool_buffers: int, expert_params: int,
                         expert_threads: int = 1, globals_bytes: int = 0, decode_scratch_bytes: int = 0
                         ) -> dict[str, int]:
    """Bytes a prefill of n_tokens needs at its peak (float32 compute), by component. Deliberately generous:
    it decides whether to refuse a prompt before any work is done."""
    f32 = 4
    chunk = min(query_chunk or n_tokens, n_tokens)
    hc, hidden = cfg.hc_mult, cfg.hidden_size
    # residual streams (in and out of a sublayer), mHC collapse, FFN input, routed accumulator, projections
    activations = n_tokens * hidden * f32 * (3 * hc + 8)
    # the layer's K=V, compressor projections (2 series) and indexer keys, for every token
    kv = n_tokens * f32 * (cfg.head_dim * 5 + cfg.index_head_dim * 4)
    csa = max([r for r, t in zip(cfg.compress_rates, cfg.layer_types) if t == v4.CSA] or [0])
    hca = max([r for r, t in zip(cfg.compress_rates, cfg.layer_types) if t == v4.HCA] or [0])
    keys = cfg.sliding_window + cfg.index_topk + (n_tokens // hca if hca else 0)
    attention = chunk * cfg.num_heads * (keys + cfg.head_dim) * f32 * 3
    indexer = chunk * cfg.index_n_heads * (n_tokens // csa if csa else 0) * f32 * 2
    # the (token, expert) pairs sorted by expert: their inputs and outputs (compute dtype) and the weighted
    # float32 outputs combine adds back
    activations += n_tokens * cfg.num_experts_per_tok * hidden * (2 * f32 + f32)
    # the read pool, and each expert thread's decoded weights
    # `globals_bytes`: the LM head's bytes, read during the last layer, and a decoded slice of it;
    # `decode_scratch_bytes`: what decoding the largest dense matrix needs besides its bytes and its output
    weights = (dense_bytes * 5 + bundle_bytes * (pool_buffers + 2) + expert_params * f32 * 2 * expert_threads
               + globals_bytes + decode_scratch_bytes)
    parts = {"activations": activations, "kv": kv, "attention_chunk": attention + indexer, "weights": weights}
    parts["total"] = sum(parts.values())
    return parts


def _entry_bytes(raw: torch.Tensor, base: int) -> Callable:
    """read(entry) for decode_group: the entry's stored bytes within `raw`, the bytes from file offset `base`."""
    return lambda t: raw[t.file_offset - base: t.file_offset - base + t.length]


def bundle_runs(expert_ids: list[int], bundle: int) -> list[tuple[int, int]]:
    """Group sorted expert ids into (first, count) runs of consecutive ids, each at most `bundle` long."""
    runs: list[tuple[int, int]] = []
    for e in expert_ids:
        if runs and runs[-1][0] + runs[-1][1] == e and runs[-1][1] < bundle:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((e, 1))
    return runs


def tokens_per_expert(by_expert: dict, n_experts: int) -> list[int]:
    """How many tokens the router sent to each expert 0..n_experts-1 (`by_expert`: Routing.tokens_by_expert())."""
    return [len(by_expert[e].token_index) if e in by_expert else 0 for e in range(n_experts)]


def expert_reads(block: Block, expert_ids: list[int], bundle: int) -> list[tuple[int, int, ReadSpan]]:
    """(first, count, read) for sorted `expert_ids` of `block`: runs of at most `bundle` consecutive experts, cut
    at stripe boundaries so each is one read of one part file. They stay in expert-ID order (the compute order);
    in a multi-part container consecutive stripes lie in different part files, so consecutive reads in flight go
    to different devices."""
    return [(first, count, block.expert_read(first, count))
            for first, count in block.split_runs(bundle_runs(expert_ids, bundle))]


def model_config(container: Container, computable: bool = True) -> v4.ModelConfig:
    """The model a container holds, as this runtime will compute it, checked before anything is read: a
    DeepSeek-V4 config (that this runtime computes as transformers does, unless `computable` is False), and every
    tensor that model uses in the container with the shape the config gives it (else compute would fail half-way
    or, for an optional one such as the router's bias, silently differ). `moepack verify` runs it too."""
    from moepack.packer.synth import v4_tensor_specs

    c = container
    if c.architecture != "deepseek_v4":
        raise MoepackError(f"{c.path} holds a {c.architecture!r} model; this runtime prefills "
                           f"DeepSeek-V4 (deepseek_v4) containers")
    try:
        cfg = v4.ModelConfig.from_hf(c.config)
    except (KeyError, TypeError, ValueError) as e:
        raise MoepackError(f"{c.path}: the config in the index is not a usable DeepSeek-V4 config ({e})") from None
    problem = v4.unsupported(c.config)
    if problem and computable:
        raise MoepackError(f"{c.path}: {problem}")
    if len(c.layers) != cfg.num_layers or any(len(b.experts) != cfg.n_routed_experts for b in c.layers):
        raise MoepackError(f"{c.path}: the container's layers/experts do not match its config "
                           f"({cfg.num_layers} layers of {cfg.n_routed_experts} experts)")
    # the config as this runtime reads it (defaults, legacy keys), so both name the same layer kinds
    rates = {kind: rate for kind, rate in zip(cfg.layer_types, cfg.compress_rates) if kind != v4.SLIDING}
    model = {**c.config, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
             "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads, "head_dim": cfg.head_dim,
             "q_lora_rank": cfg.q_lora_rank, "o_groups": cfg.o_groups, "o_lora_rank": cfg.o_lora_rank,
             "n_routed_experts": cfg.n_routed_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
             "moe_intermediate_size": cfg.moe_intermediate_size, "hc_mult": cfg.hc_mult,
             "index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim,
             "layer_types": list(cfg.layer_types), "compress_rates": rates, "num_nextn_predict_layers": 0,
             "mlp_layer_types": ["hash_moe" if h else "moe" for h in cfg.hash_layers],
             "tie_word_embeddings": cfg.tie_word_embeddings}
    for spec in v4_tensor_specs(model):
        t = c.tensors.get(spec.name)
        if t is None:  # the KV norm: transformers' `attn.norm`, the release's `attn.kv_norm` (model._kv_norm_weight)
            t = c.tensors.get(spec.name.replace(".attn.norm.", ".attn.kv_norm."))
        if t is None:
            raise MoepackError(f"{c.path}: tensor {spec.name} is missing")
        if tuple(t.shape) != tuple(spec.shape):
            raise MoepackError(f"{c.path}: tensor {spec.name} is {list(t.shape)} but the config says "
                               f"{list(spec.shape)}")
    return cfg


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


def cuda_free_bytes(device: torch.device) -> int:
    """What this process may still allocate on `device`: the device's free memory within the process's cap
    (torch.cuda.set_per_process_memory_fraction, a budget smaller than the device), plus the blocks torch has
    cached but not handed out."""
    free, total = torch.cuda.mem_get_info(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.6
    budget = int((fraction(device) if fraction else 1.0) * total)
    reserved = torch.cuda.memory_reserved(device)
    return min(free, max(budget - reserved, 0)) + reserved - torch.cuda.memory_allocated(device)


class StreamingPrefill:
    """One prefill over one container. Use `run(token_ids)`."""

    def __init__(self, container: Container, options: PrefillOptions,
                 on_layer_kv: Callable[[int, "v4.LayerKVState"], None] | None = None, dist=None):
        if options.expert_selection not in EXPERT_SELECTIONS:
            raise MoepackError(f"unknown expert selection {options.expert_selection!r}")
        if options.expert_ownership not in EXPERT_OWNERSHIPS:
            raise MoepackError(f"unknown expert ownership {options.expert_ownership!r} "
                               f"(choose from {', '.join(EXPERT_OWNERSHIPS)})")
        if options.bundle_experts < 1:
            raise MoepackError("--bundle-experts must be at least 1")
        self.c = container
        self.opt = options
        self.device = compute_device(options.device)
        # CPU: activations reused layer to layer, not faulted in again
        self.malloc_keeps_freed = self.device.type == "cpu" and keep_freed_memory()
        self.cfg = model_config(container)
        for what, value in (("compute", options.compute_dtype), ("expert", options.expert_dtype)):
            if value is not None and value not in EXPERT_DTYPES:
                raise MoepackError(f"unknown {what} dtype {value!r} (choose from {', '.join(EXPERT_DTYPES)})")
        self.compute_dtype = EXPERT_DTYPES[options.compute_dtype]
        self.expert_dtype = EXPERT_DTYPES[options.expert_dtype or options.compute_dtype]
        # CPU with several threads: the experts of a layer run side by side, each on one core (its matmuls and
        # decode single-threaded). An expert's matmuls on a few dozen tokens are too small to split across cores
        # well, and the small ops between them would each pay an OpenMP barrier.
        self.expert_threads = torch.get_num_threads() if self.device.type == "cpu" else 1
        self._expert_pool = (ThreadPoolExecutor(self.expert_threads, "moepack-expert")
                             if self.expert_threads > 1 else None)
        self.fused_tokens, self.fused_tokens_source = self._fused_tokens(options.fused_max_tokens)
        self._globals_pool: ThreadPoolExecutor | None = None  # reads the LM head during the last layer
        self._globals_checked: set[int] = set()  # indexes of this pass's global regions already checked
        self._local = threading.local()  # each expert thread's own decoder (its buffers are reused expert to expert)
        self._decoders: list[ExpertDecoder] = []
        self._decoders_lock = threading.Lock()
        self.on_layer_kv = on_layer_kv
        self.dist = dist  # runtime.distributed.DistContext for expert-parallel runs, else None
        self.balanced = dist is not None and options.expert_ownership == "balanced"
        self._ownership: dict[int, range] = {}  # layer -> this rank's experts, where balanced by load
        # one descriptor per part file; on a CPU, page-cache reads are used in place (no copy into the pool)
        self.reader = RegionReader(container.part_paths, options.io_mode, zero_copy=self.device.type == "cpu")
        pinned = self.device.type == "cuda"
        layers = container.layers
        max_expert = max((r.length for b in layers for r in b.experts), default=4096)
        max_dense = max(b.dense.length for b in layers)
        # Q reads in flight and twice as many buffers: while the compute is busy elsewhere (the attention) the disk
        # keeps reading into the spare ones instead of stopping after Q bundles
        buffer_bytes = max_expert * options.bundle_experts
        section_reads = max((len(expert_reads(b, list(range(len(b.experts))), options.bundle_experts))
                             for b in layers), default=0)
        pool = read_pool_buffers(section_reads, buffer_bytes, options.queue_depth, available_memory_bytes(), pinned,
                                 dist.world_size if dist is not None else 1)
        self.experts_pipe = ReadPipeline(self.reader, buffer_bytes, options.queue_depth, pinned, buffers=pool)
        self.dense_pipe = ReadPipeline(self.reader, max_dense, 2, pinned)  # current + the next layer's prefetch
        self.compute = _Timer()
        # Where each region's checksum is computed: on a CPU the cores are the compute, and a reader thread hashing
        # as bytes land (while the attention runs on every core) stalls the compute's OpenMP barriers (N = 512:
        # +0.1-0.3 s); there the consumer checks each region just before decoding it. A GPU prefill leaves the
        # reader threads' cores idle: they check as the bytes arrive.
        self._check_on_read = self.device.type == "cuda"
        if self.device.type == "cuda":
            self.copy_stream = torch.cuda.Stream(self.device)

    # --- bytes -> tensors ----------------------------------------------------------------------------------------
    def _check(self, regions: list[Region], view: memoryview, base: int) -> None:
        if not self.opt.verify_reads:
            return
        for r in regions:
            got = xxhash.xxh3_64_hexdigest(view[r.offset - base: r.end - base])
            if got != r.xxh3:
                raise FormatError(f"region {self.c.describe(r)}: checksum mismatch while streaming: the container "
                                  f"is damaged (run `moepack verify`)")

    @staticmethod
    def _host_bytes(buffer, view: memoryview) -> torch.Tensor:
        """The bytes a read delivered (`view`: in `buffer`, or in place in the page cache) as a host uint8 tensor."""
        if view.readonly:  # a zero-copy read: the mapped page cache itself, never written to
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch warns that the memory is read-only
                return torch.frombuffer(view, dtype=torch.uint8)
        return buffer.tensor[:len(view)]

    def _to_device(self, buffer, view: memoryview) -> torch.Tensor:
        """The bytes a read delivered as a uint8 tensor on the compute device."""
        host = self._host_bytes(buffer, view)
        if view.readonly or self.device.type != "cuda":
            return host
        compute_stream = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.copy_stream):
            dev = host.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        # `dev` was allocated on the copy stream and is used on the compute stream: without this, freeing it
        # would let the next copy reuse its memory while compute kernels queued on it still read it
        dev.record_stream(compute_stream)
        compute_stream.wait_event(done)
        done.synchronize()  # the host buffer goes back to the pool only once its bytes have left it
        return dev

    def _decode(self, regions: list[Region], raw: torch.Tensor, base: int, strip: str,
                dtype: torch.dtype = torch.float32, own: bool = True, dtype_of=None) -> dict[str, torch.Tensor]:
        """Float weights in `dtype` (or `dtype_of(entry)`; integers as they are) of the tensors of `regions`, from
        bytes at `base`.

        A tensor stored in the requested dtype decodes to a view of `raw`; `own` copies such views, for weights
        that outlive the pooled buffer the bytes arrived in (experts are used before their buffer goes back). On a
        GPU too: a small float32 norm kept as a view would hold the layer's whole region of bytes."""
        out = {}
        for r in regions:
            values = decode_group(r.tensors, _entry_bytes(raw, base), dtype, dtype_of=dtype_of)
            for name, value in values.items():
                if own and value.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr():
                    value = value.clone()
                out[name[len(strip):]] = value
        return out

    def _expert_output(self, block: Block, region: Region, raw: torch.Tensor, base: int,
                       x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (float32 rows) = the expert of `region` applied to its tokens `x`: FP4 experts through the table
        decoder (the fused kernel writes `out` itself), anything else through the generic decode."""
        prefix = f"{block.name}.ffn.experts.{region.expert}."
        layout = ExpertDecoder.layout(region, prefix)
        if layout is None:
            w = self._decode([region], raw, base, prefix, self.expert_dtype, own=False)
            return ExpertWeights(w["w1.weight"], w["w3.weight"], w["w2.weight"]).apply(self.cfg, x, out)
        return self._decoder().decode(region, layout, raw, base, prefix, tokens=len(x)).apply(self.cfg, x, out)

    def _fused_tokens(self, given: int | None) -> tuple[int, str]:
        """(experts on up to how many tokens run the fused FP4 kernel, where that figure comes from)."""
        if given is not None and given < 0:
            raise MoepackError(f"fused_max_tokens must be >= 0, got {given}")
        if not fused_max_tokens(self.expert_dtype, self.device):
            return 0, "not available"
        if given is not None:
            return given, "given"
        measured = tuned_fused_max_tokens(self.cfg.hidden_size, self.cfg.moe_intermediate_size)
        if measured is None:
            return default_fused_tokens(self.cfg.hidden_size), "default"
        return measured, "bench compute"

    def _decoder(self) -> ExpertDecoder:
        decoder = getattr(self._local, "decoder", None)
        if decoder is None:  # one per thread; an expert thread decodes on its own core only
            decoder = ExpertDecoder(self.expert_dtype, self.device, threads=1 if self._expert_pool else None,
                                    fused_tokens=self.fused_tokens)
            self._local.decoder = decoder
            with self._decoders_lock:
                self._decoders.append(decoder)
        return decoder

    def _run_experts(self, block: Block, reads: list, groups: "v4.ExpertGroups", inputs: torch.Tensor,
                     outputs: torch.Tensor) -> None:
        """outputs[span of e] = expert e on inputs[span of e], for every expert of `reads` some token chose, as the
        reads arrive: here, or on the expert threads where there are some. Each read's buffer goes back to the pool
        once its experts are done.

        The work is one list, in read order: each chosen expert, then (consumer-side checks) one checksum of the
        experts read with the rest but chosen by no token. Each expert thread takes the next item itself, waiting
        for its read where it has not arrived, rather than the main thread handing every expert to the pool as its
        read arrives (N = 256 on 2 threads: 65 us per expert lost waking a thread and taking the GIL back, 8 % of
        the experts' time)."""
        work, left = [], []
        for number, (first_expert, count, future) in enumerate(reads):
            read = block.experts[first_expert:first_expert + count]
            items = [("expert", r) for r in read if r.expert in groups.spans]
            unchosen = [] if self._check_on_read else [r for r in read if r.expert not in groups.spans]
            if unchosen:
                items.append(("check", unchosen))
            work += [(number, kind, what) for kind, what in items] or [(number, None, None)]  # one: its release
            left.append(len(items) or 1)
        arrived: dict[int, list] = {}  # read number -> [buffer, view, raw tensor or None until an expert needs it]
        lock = threading.Lock()
        cursor, failed = [0], []

        def take():
            with lock:
                if cursor[0] == len(work):
                    return None
                cursor[0] += 1
                return work[cursor[0] - 1]

        def drain() -> None:
            """Take items until none is left. After a failure (anywhere) the items are still taken, their reads
            awaited and their buffers released, without computing: a thread waiting for a later read must get its
            buffer, and the failure is raised once every thread is done."""
            while (item := take()) is not None:
                number, kind, what = item
                first_expert, _, future = reads[number]
                got = None
                try:
                    with lock:
                        got = arrived.get(number)
                    if got is None:
                        buffer, view = future.result()  # in read order: a read's buffer is never waited on
                        with lock:
                            got = arrived.setdefault(number, [buffer, view, None])
                    if kind is not None and not failed:
                        buffer, view, raw = got
                        base = block.experts[first_expert].offset
                        if kind == "check":
                            with self.compute:
                                self._check(what, view, base)
                        else:
                            if raw is None:  # the bytes as a tensor on the compute device, once per read
                                raw = self._to_device(buffer, view)
                                with lock:
                                    got[2] = raw if got[2] is None else got[2]
                            with self.compute:
                                self._expert_task(block, what, raw, base, inputs, outputs, groups, view)
                except BaseException as e:  # a failed read's buffer went back to the pool with its failure
                    with lock:
                        failed.append(e)
                finally:
                    with lock:
                        left[number] -= 1
                        release = arrived.pop(number, None) if not left[number] else None
                    if release is not None:
                        self.experts_pipe.release(release[0])

        if self._expert_pool is None:
            drain()
        else:  # each item times its own compute, apart from waiting for its read
            loops = [self._expert_pool.submit(self._on_one_core, drain, timed=False)
                     for _ in range(self.expert_threads)]
            for loop in loops:  # nothing may still use a buffer or the outputs once this returns
                loop.result()
        if failed:
            raise failed[0]

    def _expert_task(self, block: Block, region: Region, raw: torch.Tensor, base: int, inputs: torch.Tensor,
                     outputs: torch.Tensor, groups: "v4.ExpertGroups", view: memoryview) -> None:
        if not self._check_on_read:  # the bytes are about to be decoded: checked, they are in cache for it
            self._check([region], view, base)
        a, b = groups.spans[region.expert]
        self._expert_output(block, region, raw, base, inputs[a:b], outputs[a:b])

    def _on_one_core(self, fn, *args, timed: bool = True):
        """fn(*args) on an expert thread: single-threaded torch ops, counted as compute (unless `timed` is False:
        fn times its own compute, apart from waiting for a read)."""
        torch.set_num_threads(1)  # this work on this core; the other threads run other experts
        if not timed:
            return fn(*args)
        with self.compute:
            return fn(*args)

    def _read_globals(self, names, held: list | None = None, for_device: bool = True
                      ) -> list[tuple[Region, HostBuffer, memoryview]]:
        """The bytes of the regions of the named tensors and their scales, read once each (no pool); checked here
        where reader threads check (CUDA), else by the consumer. Regions already `held` (fetched before) are
        not read again but returned with the rest. Into pinned memory on CUDA unless `for_device` is False (the
        bytes are decoded on the host)."""
        fetched = list(held or [])
        have = {r.index for r, _, _ in fetched}
        for r in self._global_regions(names):
            if r.index in have:
                continue
            buf = HostBuffer(r.length, pinned=for_device and self.device.type == "cuda")
            view = self.reader.read_into(buf, r.offset, r.length, r.part)
            if self._check_on_read:
                self._check([r], view, r.offset)
            fetched.append((r, buf, view))
        return fetched

    def _global_tensors(self, fetched: list[tuple[Region, HostBuffer, memoryview]], on_device: bool
                        ) -> tuple[dict, Callable]:
        """The entries of fetched global regions (checked) by name, and read(entry) -> its bytes, on the compute
        device or (`on_device` False) on the host."""
        by_name, reads = {}, {}
        for r, buf, view in fetched:
            if not self._check_on_read and r.index not in self._globals_checked:
                self._check([r], view, r.offset)
                self._globals_checked.add(r.index)  # a tied embedding serves again as the head
            read = _entry_bytes(self._to_device(buf, view) if on_device else self._host_bytes(buf, view), r.offset)
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
        (on the host: a vocabulary-sized table never goes to the device)."""
        with self.compute:
            by_name, read = self._global_tensors(fetched, on_device=False)
            return decode_group_rows(self._global_group(by_name, "embed.weight"), read, "embed.weight",
                                     token_ids.cpu()).to(self.device)

    def _head_logits(self, fetched: list[tuple[Region, HostBuffer, memoryview]], streams: torch.Tensor
                     ) -> torch.Tensor:
        """The last position's logits [vocab] float32 (on the host). The LM head is decoded and applied
        HEAD_CHUNK_BYTES of rows at a time."""
        with self.compute:
            by_name, read = self._global_tensors(fetched, on_device=True)
            weights = decode_group([t for n in HEAD_GLOBALS for t in self._global_group(by_name, n)], read)
            name = self.cfg.head_weight
            head = self._global_group(by_name, name)
            x = v4.head_input(self.cfg, streams, weights, -1)
            slices = decode_group_row_slices(head, read, name, HEAD_CHUNK_BYTES // (4 * head[0].shape[1]))
            return torch.cat([F.linear(x, rows).float() for rows in slices], dim=-1)[0].cpu()

    def _submit_dense(self, block: Block) -> Future:
        check = (lambda view: self._check([block.dense], view, block.dense.offset)) if self._check_on_read else None
        return self.dense_pipe.submit(block.dense.offset, block.dense.length, check, part=block.dense.part)

    def _dense_weights(self, block: Block, future: Future) -> dict[str, torch.Tensor]:
        buffer, view = future.result()
        try:
            with self.compute:
                if not self._check_on_read:
                    self._check([block.dense], view, block.dense.offset)
                prefix = block.name + "."

                def dtype_of(t) -> torch.dtype:  # the low-precision matrices decode straight into compute_dtype
                    low = v4.is_low_precision_matrix(t.name[len(prefix):], len(t.shape))
                    return self.compute_dtype if low else torch.float32
                return self._decode([block.dense], self._to_device(buffer, view), block.dense.offset,
                                    prefix, dtype_of=dtype_of)
        finally:
            self.dense_pipe.release(buffer)

    def _owned(self, layer: int, n_experts: int) -> range:
        """The experts of `layer` this process computes: all of them, or its rank's contiguous range."""
        if not self.dist:
            return range(n_experts)
        owned = self._ownership.get(layer)  # may be an empty range: more ranks than loaded experts
        return owned if owned is not None else self.dist.owned(n_experts)

    def _balance(self, layer: int, loads: list[int]) -> None:
        """Balanced ownership: split `layer`'s experts into contiguous ranges of equal routed load (tokens per
        expert). Every rank computes the same routing, so every rank arrives at the same split."""
        self._ownership[layer] = balanced_ranges(loads, self.dist.world_size)[self.dist.rank]

    def _submit_experts(self, block: Block, layer: int, expert_ids) -> list[tuple[int, int, Future]]:
        reads = []
        owned = self._owned(layer, len(block.experts))
        expert_ids = [e for e in expert_ids if e in owned]
        for first, count, span in expert_reads(block, expert_ids, self.opt.bundle_experts):
            regions = block.experts[first:first + count]
            check = (lambda view, regions=regions: self._check(regions, view, regions[0].offset)) \
                if self._check_on_read else None
            reads.append((first, count, self.experts_pipe.submit(span.offset, span.length, check, part=span.part)))
        return reads

    # --- the prefill ---------------------------------------------------------------------------------------------
    def run(self, token_ids: torch.Tensor, past: list | None = None, chunk_tokens: int | None = None) -> PrefillResult:
        """Prefill `token_ids`; with `past` (one LayerKVState per layer, e.g. `read_kv(...).layers`) the tokens
        continue that state at positions P.., P = past[0].seen_tokens (the list's entries are released as used).

        `chunk_tokens` runs the usual chunked prefill instead (chunk-major: every chunk through every layer, each
        chunk continuing the previous one's state): the same logits, but the model is read ceil(N / C) times. It
        exists to measure what layer-major order saves."""
        cfg = self.cfg
        n_tokens = int(token_ids.numel())
        if n_tokens < 1:
            raise MoepackError("empty prompt")
        if int(token_ids.max()) >= cfg.vocab_size or int(token_ids.min()) < 0:
            raise MoepackError(f"token id out of range 0..{cfg.vocab_size - 1}")
        if chunk_tokens is not None and chunk_tokens < 1:
            raise MoepackError("--chunk-tokens must be at least 1")
        past_tokens = past[0].seen_tokens if past else 0
        self._check_memory(past_tokens + n_tokens)
        start, steal_before = time.perf_counter(), cpu_steal_seconds()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        chunks = token_ids.split(chunk_tokens) if chunk_tokens else [token_ids]
        all_stats: list[LayerStats] = []
        states = past
        for i, chunk in enumerate(chunks):
            final = i == len(chunks) - 1
            logits, layer_stats, states = self._forward(chunk.to(self.device), states, emit_kv=final,
                                                        keep_states=not final)
            all_stats.extend(layer_stats)
        wall, steal_after = time.perf_counter() - start, cpu_steal_seconds()
        stats = self._stats(n_tokens, wall, all_stats)
        # a VM's time lost to its host, machine-wide: on the VM of docs/benchmarks.md (session 10) streamed runs
        # lost 0.15-0.6 s of it and resident runs none; it explains a run slower than its parts measured alone
        stats["steal_s"] = (round(steal_after - steal_before, 3)
                            if steal_before is not None and steal_after is not None else None)
        stats["order"] = "chunk" if chunk_tokens else "layer"
        stats["passes_over_model"] = len(chunks)
        return PrefillResult(logits, int(torch.argmax(logits)), stats, all_stats)

    def _forward(self, token_ids: torch.Tensor, past: list | None, emit_kv: bool, keep_states: bool):
        """One pass of `token_ids` through every layer (reading each region once). Returns the last position's
        logits, per-layer stats and (keep_states) the new per-layer states."""
        cfg, layers = self.cfg, self.c.layers
        n_tokens = int(token_ids.numel())
        first_position = past[0].seen_tokens if past else 0
        positions = torch.arange(first_position, first_position + n_tokens, device=self.device)
        # the embedding's bytes first: the first the compute needs (queued behind the expert reads, they would make
        # the compute wait for the disk before it could start; read first, they cost the disk a few milliseconds).
        # Decoded once the first layer's reads are queued, so the disk is not idle meanwhile.
        # only the prompt's rows are decoded, on the host: a vocabulary-sized table is not pinned for them unless it
        # is also the head (tied), which goes to the device
        self._globals_checked = set()
        embed_bytes = self._read_globals(["embed.weight"], for_device=cfg.tie_word_embeddings)
        pending_dense = self._submit_dense(layers[0])
        # Expert reads that do not depend on their layer's router (every expert of the layer) are queued up to
        # READ_AHEAD_LAYERS layers ahead: the pool's buffers, not the queue, bound what is read ahead, and the disk
        # never waits for a layer to start. The queue stays in layer order (the order the reads are consumed in: a
        # buffer given to a later layer's read before an earlier one's could never come back), so it stops at the
        # first layer whose reads are known only from its token ids or its router; `ahead` is that layer.
        queued: dict[int, list] = {}
        ahead = self._queue_from(queued, 0, n_tokens, READ_AHEAD_LAYERS + 1)
        streams = v4.residual_streams(cfg, self._embeddings(embed_bytes, token_ids))
        # a head tied to the embedding uses the bytes just read: read once per prompt, like every region
        held_for_head = embed_bytes if cfg.tie_word_embeddings else None
        head_globals = (*HEAD_GLOBALS, cfg.head_weight)
        del embed_bytes
        head_bytes: Future | None = None  # read during the last layer, beside its experts
        routed_rows: torch.Tensor | None = None  # the routed experts' output rows, reused layer to layer
        spare: torch.Tensor | None = None  # the streams' second buffer
        layer_stats: list[LayerStats] = []
        states = [] if keep_states else None
        next_dense: Future | None = None  # this layer's dense weights, decoded on an expert thread
        for number, block in enumerate(layers):
            w = next_dense.result() if next_dense is not None else self._dense_weights(block, pending_dense)
            n_experts = len(block.experts)
            selection = self._selection(number, n_tokens, n_experts)
            ahead = self._queue_from(queued, ahead, n_tokens, number + 1 + READ_AHEAD_LAYERS)  # top up
            reads = queued.pop(number, None)
            if number == ahead and selection == "hash":  # the token ids are the routing: known before any compute
                chosen = w["ffn.gate.tid2eid"][token_ids].reshape(-1)
                if self.balanced:
                    self._balance(number, torch.bincount(chosen, minlength=n_experts).tolist())
                reads = self._submit_experts(block, number, torch.unique(chosen).tolist())
                ahead = self._queue_from(queued, number + 1, n_tokens, number + 1 + READ_AHEAD_LAYERS)
            if number + 1 < len(layers):
                pending_dense = self._submit_dense(layers[number + 1])
            with self.compute:
                layer_past = past[number].to(self.device) if past else None
                # the streams alternate between two buffers: [N, hc, H] is over glibc's 32 MiB mmap threshold from
                # N = 2048 (V4-Flash: N = 512), where each fresh allocation would fault in every page again
                spare = torch.empty_like(streams) if spare is None else spare
                new_streams, kv_state = v4.attention_sublayer(cfg, number, w, streams, positions,
                                                              self.opt.query_chunk, layer_past, into=spare)
                streams, spare = new_streams, streams
                routing = v4.moe_route(cfg, number, w, streams, token_ids)
                by_expert = routing.tokens_by_expert()
            if emit_kv and self.on_layer_kv is not None:
                self.on_layer_kv(number, kv_state)  # the layer's KV is final: it leaves the device now
            if keep_states:
                states.append(kv_state)
            del kv_state
            if past:
                past[number] = layer_past = None  # the old state is folded into the new one
            if reads is None:
                if self.balanced:
                    self._balance(number, tokens_per_expert(by_expert, n_experts))
                wanted = range(n_experts) if selection == "all" else sorted(by_expert)
                reads = self._submit_experts(block, number, list(wanted))
                ahead = self._queue_from(queued, number + 1, n_tokens, number + 1 + READ_AHEAD_LAYERS)
            if number == len(layers) - 1:  # after the layer's expert reads: the head is needed last
                head_bytes = self._globals_reader().submit(self._read_globals, head_globals, held_for_head)
            with self.compute:
                groups = routing.groups()
                # every pair's token, sorted by expert (converted first: the [P, H] copy is made once, small)
                inputs = groups.gather(routing.x.to(self.expert_dtype))
                # float32: the fused kernel's sums as they are. One buffer for every layer (P = N x top_k rows
                # each time; from N = 1366 it is over glibc's 32 MiB mmap threshold, and fresh pages every layer
                # cost more than the routed experts' combine). Each row is written by its expert, except rows of
                # experts another rank owns: those stay zero
                if routed_rows is None or routed_rows.shape != inputs.shape:
                    routed_rows = torch.zeros(inputs.shape, dtype=torch.float32, device=inputs.device)
                elif self.dist:
                    routed_rows.zero_()  # which experts are this rank's changes from layer to layer
                outputs = routed_rows
            # on the expert threads the shared expert runs first, beside the routed ones (and while they wait for
            # the disk); elsewhere it runs in moe_finish
            threads = torch.get_num_threads()
            shared = next_dense = None
            if self._expert_pool is not None:
                shared = self._expert_pool.submit(self._on_one_core, v4.shared_expert, cfg, w, routing)
                # ... and so does the next layer's dense decode (its read began before this layer's attention),
                # instead of alone later with one core idle. It is waited for, like every expert-thread task,
                # before this thread sets its own thread count back (torch.set_num_threads also sets MKL's, for
                # the whole process)
                if number + 1 < len(layers):
                    next_dense = self._expert_pool.submit(self._on_one_core, self._dense_weights,
                                                          layers[number + 1], pending_dense, timed=False)
            try:
                self._run_experts(block, reads, groups, inputs, outputs)
            finally:
                for task in (shared, next_dense):
                    if task is not None:
                        task.exception()  # done in every case before the layer's tensors go
                if shared is not None:
                    torch.set_num_threads(threads)  # after the last expert-thread task: it set one thread
            shared = shared.result() if shared is not None else None
            del inputs
            with self.compute:
                routed = groups.combine(outputs, n_tokens)
            if self.dist:  # combine: every rank adds its experts' share
                routed = self.dist.all_reduce_sum(routed, f"combining layer {number}'s experts")
            with self.compute:
                streams, spare = v4.moe_finish(cfg, number, w, streams, routing, routed, shared, into=spare), streams
            layer_stats.append(self._layer_stats(number, block, selection, reads, by_expert, n_experts))
        logits = self._head_logits(head_bytes.result() if head_bytes is not None else
                                   self._read_globals(head_globals, held_for_head), streams)
        return logits, layer_stats, states

    def _head_bytes(self) -> int:
        return sum(r.length for r in self._global_regions((*HEAD_GLOBALS, self.cfg.head_weight)))

    def _global_regions(self, names) -> list[Region]:
        """The regions of the named tensors and of their scale companions, each once."""
        wanted = [n for name in names for n in (name, *companion_names(name))]
        return list({r.index: r for r in (self.c.tensors[n].region for n in wanted if n in self.c.tensors)}.values())

    def _globals_reader(self) -> ThreadPoolExecutor:
        if self._globals_pool is None:
            self._globals_pool = ThreadPoolExecutor(1, "moepack-globals")
        return self._globals_pool

    def _check_memory(self, n_tokens: int) -> None:
        """Refuse a prompt whose working set cannot fit, before reading or computing anything."""
        layers = self.c.layers
        expert_params = max((sum(t.numel for t in r.tensors if not t.name.endswith(SCALE_SUFFIXES))
                             for b in layers for r in b.experts), default=0)
        if self.device.type == "cuda":
            in_memory = self.opt.queue_depth  # the pool is pinned host memory; the device holds the reads in flight
        elif self.reader.zero_copy and self.reader.mode == "mmap":
            in_memory = 0  # reads are views of the page cache: the pool's buffers are never written
        else:
            in_memory = self.experts_pipe.buffers
        # FP8 decoded by torch's ops (on a GPU; on a CPU without the compiled decoder): an int32 index per weight
        torch_fp8 = self.device.type == "cuda" or not fp8_decoder_compiled()
        fp8_weights = max((t.numel for b in layers for t in b.dense.tensors if t.dtype == "F8_E4M3"),
                          default=0) if torch_fp8 else 0
        need = estimate_working_set(self.cfg, n_tokens, self.opt.query_chunk, max(b.dense.length for b in layers),
                                    self.experts_pipe.buffer_bytes, in_memory, expert_params, self.expert_threads,
                                    self._head_bytes() + HEAD_CHUNK_BYTES, decode_scratch_bytes=4 * fp8_weights)
        if self.device.type == "cuda":
            free, where = cuda_free_bytes(self.device), "free device memory"
        else:
            free = available_memory_bytes()
            where = "available host memory"
        if free and need["total"] > free:
            detail = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in need.items() if k != "total")
            raise MoepackError(f"a prompt of {n_tokens} tokens needs about {need['total'] / 2**30:.1f} GiB "
                               f"({detail}) but only {free / 2**30:.1f} GiB of {where} is there: shorten the "
                               f"prompt or lower --query-chunk")

    def _queue_from(self, queued: dict[int, list], first: int, n_tokens: int, until: int) -> int:
        """Queue the reads of layers first, first + 1, ... (before `until`) while each reads its whole section;
        returns the first layer not queued."""
        layer = first
        while layer < min(until, len(self.c.layers)) and self._reads_whole_section(layer, n_tokens):
            queued[layer] = self._submit_experts(self.c.layers[layer], layer,
                                                 list(range(len(self.c.layers[layer].experts))))
            layer += 1
        return layer

    def _reads_whole_section(self, layer: int, n_tokens: int) -> bool:
        """Whether `layer`'s expert reads are known before its router runs: every expert of it is read (balanced
        ownership waits for the router to split the section)."""
        return self._selection(layer, n_tokens, len(self.c.layers[layer].experts)) == "all" and not self.balanced

    def _selection(self, layer: int, n_tokens: int, n_experts: int) -> str:
        if self.cfg.hash_layers[layer] and self.opt.expert_selection != "all":
            return "hash"
        if self.opt.expert_selection == "all":
            return "all"
        if self.opt.expert_selection == "routed":
            return "routed"
        unused = expected_unused_fraction(n_tokens, self.cfg.num_experts_per_tok, n_experts)
        return "all" if unused <= ALL_EXPERTS_UNUSED_FRACTION else "routed"

    def _layer_stats(self, number, block, selection, reads, by_expert, n_experts) -> LayerStats:
        counts = tokens_per_expert(by_expert, n_experts)
        read_bytes = sum(block.expert_read(first, count).length for first, count, _ in reads)
        owned = self._owned(number, n_experts)
        section = sum(block.experts[e].length for e in owned)
        return LayerStats(number, selection, sum(count for _, count, _ in reads), len(by_expert),
                          min(counts, default=0), statistics.median(counts) if counts else 0,
                          max(counts, default=0), counts.count(0), read_bytes + block.dense.length,
                          section - read_bytes, (owned.start, owned.stop) if self.dist else None,
                          sum(counts[e] for e in owned))

    def _stats(self, n_tokens: int, wall: float, layers: list[LayerStats]) -> dict:
        io = self.reader.stats
        busiest = max(io.busy_seconds, self.compute.seconds, 1e-9)
        stats = {
            "tokens": n_tokens,
            "seconds": round(wall, 4),
            "tokens_per_s": round(n_tokens / wall, 2),
            "bytes_read": io.bytes_read,
            "bytes_read_per_part": list(io.bytes_by_part),  # [main file, part 1, ...]
            "read_requests": io.requests,
            "io_mode": self.reader.mode,
            "io_busy_s": round(io.busy_seconds, 4),
            "compute_busy_s": round(self.compute.seconds, 4),
            "overlap": round(wall / busiest, 3),
            "bytes_skipped": sum(s.bytes_skipped for s in layers),
            "bundle_experts": self.opt.bundle_experts,
            "compute_dtype": self.opt.compute_dtype,
            "expert_dtype": str(self.expert_dtype).removeprefix("torch."),
            "expert_threads": self.expert_threads,
            # experts on up to this many tokens ran the fused FP4 matmul (the weights never decoded to memory)
            "fused_expert_max_tokens": self.fused_tokens,
            "fused_expert_max_tokens_source": self.fused_tokens_source,
            "queue_depth": self.opt.queue_depth,
            "read_pool_bytes": self.experts_pipe.buffers * self.experts_pipe.buffer_bytes,
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
        if self.reader.warning:
            stats["io_warning"] = self.reader.warning
        return stats

    def close(self) -> None:
        if self._globals_pool is not None:
            self._globals_pool.shutdown()  # its read finishes before the reader closes
        v4.rope_rotation.cache_clear()  # this prompt's rotation tables (on a GPU, device memory)
        self.experts_pipe.close()
        self.dense_pipe.close()
        self.reader.close()
        if self._expert_pool is not None:
            self._expert_pool.shutdown()
        for decoder in self._decoders:
            decoder.close()
        if self.malloc_keeps_freed:
            release_freed_memory()


def prefill(path: str, token_ids, options: PrefillOptions | None = None, on_layer_kv=None,
            kv_out: str | None = None, continue_from: str | None = None, kv_dtype: str = "F32",
            kv_sync: bool = True, chunk_tokens: int | None = None, expert_parallel: bool = False,
            dist_timeout_s: float = 120.0) -> PrefillResult:
    """Open `path`, run one prefill of `token_ids` (a sequence of ints or a LongTensor), close.

    `kv_out`: write the KV (format_spec/KV.md) there, layer by layer from a writer thread. `continue_from`: a KV
    directory made with this container; `token_ids` are the tokens that follow its prompt (the KV written to
    `kv_out`, which may be the same directory, covers both). `expert_parallel`: this process is one rank of a
    torchrun job (runtime/distributed.py); `{rank}` in `path` picks each rank's own copy of the container."""
    options = options or PrefillOptions()
    try:
        token_ids = torch.as_tensor(token_ids)
    except (OverflowError, RuntimeError, TypeError, ValueError) as e:  # 2**64, ragged lists, strings
        raise MoepackError(f"token ids must be integers within 64 bits ({e})") from None
    not_integers = token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype == torch.bool
    if token_ids.numel() and not_integers:
        raise MoepackError(f"token ids must be integers, not {token_ids.dtype}")
    token_ids = token_ids.to(torch.long).reshape(-1)
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
                               chunk_tokens, dist)
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


def _prefill_open(path, token_ids, options, on_layer_kv, kv_out, continue_from, kv_dtype, kv_sync, chunk_tokens,
                  dist) -> PrefillResult:
    from moepack.format_spec import kv as kvf

    with Container(path) as c:
        identity = kvf.identity_of_container(c)
        past, all_ids, start = None, token_ids.tolist(), 0
        if continue_from is not None:
            kv = kvf.read_kv(continue_from, expect_identity=identity)  # whole KV in memory before any write
            past, start, all_ids = kv.layers, kv.seen_tokens, kv.token_ids + token_ids.tolist()
        hooks = [on_layer_kv] if on_layer_kv is not None else []

        def on_kv(layer, state):
            for hook in hooks:
                hook(layer, state)

        engine = StreamingPrefill(c, options, on_kv if hooks or kv_out is not None else None, dist)
        writer = None
        try:
            if kv_out is not None:
                in_place = continue_from is not None and os.path.realpath(kv_out) == os.path.realpath(continue_from)
                writer = kvf.BackgroundKVWriter(kvf.KVWriter(kv_out, identity, all_ids, dtype=kv_dtype,
                                                             start_token=start, overwrite=in_place, sync=kv_sync))
                hooks.insert(0, writer)
            try:
                result = engine.run(token_ids, past, chunk_tokens=chunk_tokens)
            except BaseException:
                if writer is not None:  # keep the layers written so far (the manifest says which); report the
                    try:            # prefill's error, not a follow-up write error
                        writer.close()
                    except MoepackError:
                        pass
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
