"""The expert runner: a layer's routed experts computed as their reads arrive. The last of the streaming
pipeline's three stages (read scheduler -> device copier -> expert runner; docs/architecture.md).

The (token, expert) pairs are sorted by expert once per layer, gathered with one index_select, multiplied expert
by expert into one float32 buffer of rows, and each token's top-k rows summed back with their routing weights
(families.base.ExpertGroups). On a CPU with several threads the experts of a layer run side by side on a pool of
threads, one core each (torch's intra-op threads set to 1 inside them): an expert's matmuls on a few dozen tokens split
badly across cores, and every small op between them would pay an OpenMP barrier, which any other busy core
stalls. The threads take the layer's work list themselves, in read order (work stealing); other work of the
layer (the shared expert, the next layer's dense decode) runs beside the routed experts on the same threads.
Each expert thread decodes FP4 with its own ExpertDecoder (AVX-512/SSSE3 lookup, expert_decode.py; bf16 experts
on up to a measured number of tokens run the fused FP4 kernel instead, AVX512-BF16).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from moepack.backends import token_kernels
from moepack.backends.expert_naming import ExpertNaming
from moepack.families.base import ExpertGroups, Routing
from moepack.format_spec.codecs import codec
from moepack.format_spec.decode import decode_group, entry_bytes, scale_name
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.reader import Block, Region

from .expert_decode import ExpertDecoder, ExpertWeights, default_fused_tokens, fused_max_tokens
from .tuning import tuned_fused_max_tokens


@functools.lru_cache(maxsize=4)
def rows_prompt(prompt_ends: tuple[int, ...], rows: int, device: torch.device) -> torch.Tensor:
    """Each of a grouped pass's `rows` rows' prompt (its index in `prompt_ends`) on `device`, made once per pass,
    not once per layer (on a GPU: no host-to-device copy per layer). Never written to."""
    return torch.searchsorted(torch.tensor(prompt_ends, device=device), torch.arange(rows, device=device), right=True)


class BusyTimer:
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


class OrderedSum:
    """combined[token] += weight x output, for each expert's output rows as it comes, added in ascending expert id:
    every token's terms in the order ExpertGroups.combine adds them, whichever thread finishes an expert first
    (the sums do not depend on threads, bundles or reads). An output waits here only until every smaller
    expert id of `order` (the experts this process computes) is in."""

    def __init__(self, combined: torch.Tensor, groups: ExpertGroups, order: list[int]):
        self.combined, self.groups = combined, groups
        self._order, self._next = order, 0
        self._waiting: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def add(self, expert: int, out: torch.Tensor) -> None:
        with self._lock:
            self._waiting[expert] = out
            while self._next < len(self._order) and self._order[self._next] in self._waiting:
                e = self._order[self._next]
                a, b = self.groups.spans[e]
                rows = self._waiting.pop(e)
                self.combined.index_add_(0, self.groups.token_index[a:b], rows * self.groups.weight[a:b, None])
                self._next += 1

    def check_complete(self) -> None:
        if self._next != len(self._order):
            raise RuntimeError(f"experts {self._order[self._next:][:8]} were never added")


# A family's expert (one its expert_ffn computes) on up to this many tokens runs in the token kernel straight from
# its stored bytes on a CPU, not decoded to float (ExpertRunner._kernel_layout): an FP8 expert of 2048 x 768 took
# 1.2 / 3.0 / 4.2 ms on 1 / 8 / 16 tokens there against 6.4 / 7.6 / 7.1 decoded and multiplied (even at 32). A
# prompt of a few dozen tokens sends most experts a handful.
KERNEL_MAX_TOKENS = 16

# the stored scales the token kernel takes beside a weight kind (E8M0 bytes; an FP8 weight's as float32 too)
_KERNEL_SCALES = {"FP4_E2M1": ("F8_E8M0",), "F8_E4M3": ("F8_E8M0", "F32", "BF16", "F16")}


def kernel_layout(region: Region, names: Mapping[str, str]) -> list[tuple] | None:
    """An expert's three matrices (`names`: its gate / up / down weights', ExpertNaming.names) as the compiled token
    kernel reads them, relative to its region's first byte: (kind, data slice, rows, cols, scale or None) each, the
    scale (its slice, stored dtype, shape) of FP4_E2M1 (E8M0 per 32) and F8_E4M3 (E8M0 or float per 128 x 128
    block); None where a matrix is stored in a kind it lacks."""
    by_name = {t.name: t for t in region.tensors}

    def span(t):
        return slice(t.file_offset - region.offset, t.file_offset - region.offset + t.length)
    layout = []
    for m in ("gate", "up", "down"):  # the token kernel's order
        w = by_name.get(names[m])
        if w is None or w.dtype not in token_kernels.KINDS or len(w.shape) != 2:
            return None
        scale = by_name.get(scale_name(w.name))
        scale_kinds = _KERNEL_SCALES.get(w.dtype)
        if scale_kinds is not None and (scale is None or scale.dtype not in scale_kinds or (
                w.dtype == "F8_E4M3" and tuple(scale.shape) != token_kernels.fp8_scale_blocks(*w.shape))):
            return None
        layout.append((w.dtype, span(w), *w.shape,
                       (span(scale), scale.dtype, tuple(scale.shape)) if scale_kinds else None))
    return layout


def stored_matrix(raw: torch.Tensor, kind: str, data: slice, rows: int, cols: int, scale: tuple | None,
                  table: torch.Tensor | None) -> token_kernels.Matrix:
    """One matrix of an expert's stored bytes `raw` (a kernel_layout entry) as the token kernel reads it; an FP8
    weight's block scales decoded to the float32 the kernel multiplies by (held by the Matrix)."""
    if kind != "F8_E4M3":
        return token_kernels.stored_matrix(kind, raw[data], rows, cols, raw[scale[0]] if scale else None, table)
    where, dtype, shape = scale
    scales = token_kernels.fp8_block_scales(codec(dtype).decode(raw[where], shape))
    matrix = token_kernels.stored_matrix(kind, raw[data], rows, cols, scales)
    matrix.keep = scales
    return matrix


def decode_expert(decoder: ExpertDecoder, naming: ExpertNaming, layer: int, region: Region, raw: torch.Tensor,
                  base: int, *, compiled: bool, tokens: int | None = None) -> ExpertWeights:
    """The expert of `region` (layer `layer`, its bytes in `raw` from file offset `base`) in the decoder's dtype,
    for `tokens` tokens: by the decoder's compiled FP4 paths where `compiled` (experts without a family's
    expert_ffn: the fused kernel's activation is the family's expert_forward) and the layout allows, else by the
    generic decode, on a CPU into the decoder's buffers (fresh pages for every expert would each fault in). Views of
    `raw` or of the decoder's buffers: valid until its next decode."""
    prefix, names = naming.prefix(layer, region.expert), naming.names(layer, region.expert)
    layout = ExpertDecoder.layout(region, names) if compiled else None
    if layout is not None:
        return decoder.decode(region, layout, raw, base, names, tokens=tokens)
    out_for = decoder.buffer_for(prefix) if decoder.device.type == "cpu" else None
    w = decode_regions([region], raw, base, prefix, decoder.dtype, own=False, out_for=out_for)
    return ExpertWeights(w[naming.gate], w[naming.up], w[naming.down])


def decode_regions(regions: list[Region], raw: torch.Tensor, base: int, strip: str,
                   dtype: torch.dtype = torch.float32, own: bool = True, dtype_of=None,
                   out_for=None) -> dict[str, torch.Tensor]:
    """Float weights in `dtype` (or `dtype_of(entry)`; integers as they are) of the tensors of `regions`, from
    bytes at `base`, named without the prefix `strip`.

    A tensor stored in the requested dtype decodes to a view of `raw`; `own` copies such views, for weights that
    outlive the pooled buffer the bytes arrived in (experts are used before their buffer goes back). On a GPU too:
    a small float32 norm kept as a view would hold the layer's whole region of bytes."""
    out = {}
    for r in regions:
        values = decode_group(r.tensors, entry_bytes(raw, base), dtype, dtype_of=dtype_of, out_for=out_for)
        for name, value in values.items():
            if own and value.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr():
                value = value.clone()
            out[name[len(strip):]] = value
    return out


def decode_dense(block: Block, raw: torch.Tensor, compute_dtype: torch.dtype, prefix: str | None = None, *,
                 in_compute_dtype: Callable[[str, int], bool]) -> dict[str, torch.Tensor]:
    """A layer's dense weights from its region's bytes `raw` (on the compute device), named without `prefix`
    (default: the block's name): those `in_compute_dtype(name, ndim)` chooses (the family's, LayerPrefill /
    LayerDecode.in_compute_dtype) straight into `compute_dtype`, everything else float32."""
    prefix = block.name + "." if prefix is None else prefix

    def dtype_of(t) -> torch.dtype:
        return compute_dtype if in_compute_dtype(t.name[len(prefix):], len(t.shape)) else torch.float32
    return decode_regions([block.dense], raw, block.dense.offset, prefix, dtype_of=dtype_of)


class ExpertRunner:
    """Runs each layer's routed experts (`run_layer`) and, beside them, other work of the layer on the same
    threads. `release(buffer)` gives a read's buffer back once its experts are done. `naming` (the family's)
    says where an expert's matrices are; `expert_ffn(x, gate, up, down)` computes one
    (a family's); without it the compiled kernels of expert_decode.py do (FP4 decoded by table or fused, clamped
    SwiGLU)."""

    def __init__(self, cfg, device: torch.device, expert_dtype: torch.dtype, checker, copier,
                 release: Callable, compute: BusyTimer, fused_max_tokens_given: int | None = None,
                 *, naming: ExpertNaming, expert_ffn: Callable | None = None,
                 expert_forward: Callable | None = None, expert_limit: float | None = None):
        self.cfg, self.device, self.expert_dtype = cfg, device, expert_dtype
        self.naming, self.expert_ffn = naming, expert_ffn
        # without expert_ffn, the family's arithmetic of the compiled decoders' experts: expert_forward(x, gate, up,
        # down, hidden_order) on decoded matrices, expert_limit the clamp the fused FP4 kernel's SwiGLU takes
        self.expert_forward, self.expert_limit = expert_forward, expert_limit
        # few-token experts through the token kernel: on a CPU, for a family whose own torch FFN computes its
        # experts (expert_ffn) and whose clamp the kernel knows (expert_limit); the others keep the compiled decoders'
        # arithmetic, or decode + torch's, which their CPU fingerprints pin (benchmarks/logits_fingerprint.py)
        self._kernel_route = device.type == "cpu" and expert_ffn is not None and expert_limit is not None
        self._kernel_layouts: dict[tuple[str, int], list | None] = {}
        self._kernel_flag = token_kernels.ROUND_INPUT if expert_dtype == torch.bfloat16 else 0
        self._tables: dict[str, torch.Tensor] = {}
        self.checker, self.copier, self.release, self.compute = checker, copier, release, compute
        self.threads = torch.get_num_threads() if device.type == "cpu" else 1
        self.decoded_at_once = self.threads  # one expert per thread
        self._pool = ThreadPoolExecutor(self.threads, "moepack-expert") if self.threads > 1 else None
        self.fused_tokens, self.fused_tokens_source = self._fused_tokens(fused_max_tokens_given)
        self._local = threading.local()  # each expert thread's own decoder (its buffers are reused expert to expert)
        self._decoders: list[ExpertDecoder] = []
        self._decoders_lock = threading.Lock()
        # keep_expert(block, region, view, base): each expert's checked bytes as it is used (decode's cache takes
        # the prompt's experts from the prefill's reads instead of reading them again); called on expert threads
        self.keep_expert: Callable | None = None

    @property
    def side_by_side(self) -> bool:
        """Whether other work of a layer runs beside its experts (there are expert threads)."""
        return self._pool is not None

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
            decoder = ExpertDecoder(self.expert_dtype, self.device, threads=1 if self._pool else None,
                                    fused_tokens=self.fused_tokens)
            self._local.decoder = decoder
            with self._decoders_lock:
                self._decoders.append(decoder)
        return decoder

    def on_one_core(self, fn, *args, timed: bool = True):
        """fn(*args) on an expert thread: single-threaded torch ops, counted as compute (unless `timed` is False:
        fn times its own compute, apart from waiting for a read)."""
        torch.set_num_threads(1)  # this work on this core; the other threads run other experts
        if not timed:
            return fn(*args)
        with self.compute:
            return fn(*args)

    # --- one layer -----------------------------------------------------------------------------------------------
    def run_layer(self, block: Block, reads: list, routing: Routing, beside: list[tuple] = ()
                  ) -> tuple[torch.Tensor, list]:
        """The layer's routed experts on `routing`'s tokens, combined: [N, H] float32, and the results of the
        `beside` tasks ((fn, args, timed) each), run on the expert threads beside the experts (and while they
        wait for the disk); None each where there are no expert threads (the caller runs them itself)."""
        with self.compute:
            groups = routing.groups()
            # each expert gathers its own tokens' rows from this (no [N x top_k, H] copy of every pair: at
            # N = 8192 that and the pairs' outputs were 290 MiB)
            inputs = routing.x.to(self.expert_dtype)
            combined = torch.zeros(routing.x.shape, dtype=torch.float32, device=routing.x.device)
            # several prompts: each row's prompt (its index in prompt_ends), once for the layer's experts
            row_prompt = None if routing.prompt_ends is None else rows_prompt(
                tuple(routing.prompt_ends), len(routing.x), groups.token_index.device)
        threads = torch.get_num_threads()
        tasks = [self._pool.submit(self.on_one_core, fn, *args, timed=timed) for fn, args, timed in beside] \
            if self._pool is not None else []
        try:
            self._run_experts(block, reads, groups, inputs, combined, row_prompt)
        finally:
            for task in tasks:
                task.exception()  # done in every case before the layer's tensors go
            if tasks:  # after the last expert-thread task: torch.set_num_threads set one thread, process-wide
                torch.set_num_threads(threads)
        results = [task.result() for task in tasks] if tasks else [None] * len(beside)
        return combined, results

    def _run_experts(self, block: Block, reads: list, groups: ExpertGroups, inputs: torch.Tensor,
                     combined: torch.Tensor, row_prompt: torch.Tensor | None = None) -> None:
        """combined [N, H] += each chosen expert of `reads` on its tokens' rows of inputs, times their weights, as
        the reads arrive: here, or on the expert threads where there are some (OrderedSum: added in ascending
        expert id, whatever thread finishes first). Each read's buffer goes back to the pool once its experts are
        done.

        The work is one list, in read order: each chosen expert, then (consumer-side checks) one checksum of the
        experts read with the rest but chosen by no token. Each expert thread takes the next item itself, waiting
        for its read where it has not arrived, rather than the main thread handing every expert to the pool as its
        read arrives (N = 256 on 2 threads: 65 us per expert lost waking a thread and taking the GIL back, 8 % of
        the experts' time)."""
        work, left = [], []
        for number, (first_expert, count, future) in enumerate(reads):
            read = block.experts[first_expert:first_expert + count]
            items = [("expert", r) for r in read if r.expert in groups.spans]
            unchosen = [] if self.checker.on_read else [r for r in read if r.expert not in groups.spans]
            if unchosen:
                items.append(("check", unchosen))
            work += [(number, kind, what) for kind, what in items] or [(number, None, None)]  # one: its release
            left.append(len(items) or 1)
        summed = OrderedSum(combined, groups, sorted(what.expert for _, kind, what in work if kind == "expert"))
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
                                self.checker.check(what, view, base)
                        else:
                            if raw is None:  # the bytes as a tensor on the compute device, once per read
                                raw = self.copier.to_device(buffer, view)
                                with lock:
                                    got[2] = raw if got[2] is None else got[2]
                            with self.compute:
                                summed.add(what.expert, self._expert(block, what, raw, base, inputs, groups, view,
                                                                      row_prompt))
                except BaseException as e:  # a failed read's buffer went back to the pool with its failure
                    with lock:
                        failed.append(e)
                finally:
                    with lock:
                        left[number] -= 1
                        release = arrived.pop(number, None) if not left[number] else None
                    if release is not None:
                        self.copier.release(release[0], self.release)

        if self._pool is None:
            drain()
        else:  # each item times its own compute, apart from waiting for its read
            loops = [self._pool.submit(self.on_one_core, drain, timed=False) for _ in range(self.threads)]
            for loop in loops:  # nothing may still use a buffer or the outputs once this returns
                loop.result()
        if failed:
            raise failed[0]
        summed.check_complete()

    def _expert(self, block: Block, region: Region, raw: torch.Tensor, base: int, inputs: torch.Tensor,
                groups: ExpertGroups, view: memoryview, row_prompt: torch.Tensor | None = None) -> torch.Tensor:
        """The expert's float32 output rows for its tokens (in the order of groups.token_index's span).
        `row_prompt`: in a pass of several prompts, each input row's prompt (run_layer's; None: one prompt)."""
        self.checker.before_use([region], view, base)  # about to be decoded: checked, the bytes are in cache for it
        if self.keep_expert is not None:
            self.keep_expert(block, region, view, base)
        a, b = groups.spans[region.expert]
        rows = groups.token_index[a:b]
        x = inputs.index_select(0, rows)
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        if row_prompt is None:
            self.expert_output(block, region, raw, base, x, out, token_kernel=True)
            return out
        # several prompts: each prompt's rows on the kernel its own token count chooses (the fused one for few),
        # the kernel it gets prefilled alone: a prompt's result does not depend on the others' rows
        prompt = row_prompt[rows]
        own = torch.bincount(prompt)[prompt]  # each row's prompt's tokens here
        few = own <= self._few_tokens(block, region)
        for picked in (few, ~few):
            if bool(picked.all()):
                self.expert_output(block, region, raw, base, x, out, tokens=int(own.max()), token_kernel=True)
            elif bool(picked.any()):
                part = torch.empty((int(picked.sum()), x.shape[1]), dtype=torch.float32, device=x.device)
                out[picked] = self.expert_output(block, region, raw, base, x[picked], part,
                                                 tokens=int(own[picked].max()), token_kernel=True)
        return out

    def expert_output(self, block: Block, region: Region, raw: torch.Tensor, base: int, x: torch.Tensor,
                      out: torch.Tensor, tokens: int | None = None, token_kernel: bool = False) -> torch.Tensor:
        """out (float32 rows) = the expert of `region` (its bytes in `raw`, from file offset `base`) applied to its
        tokens `x`: FP4 experts through the table decoder (the fused kernel writes `out` itself), anything else
        through the generic decode; a family's expert_ffn where it has one. `tokens`: the count that chooses the
        kernel (default len(x); in a grouped pass the most any one prompt sends it). `token_kernel` (a prefill's,
        on an expert thread): on up to KERNEL_MAX_TOKENS a family's expert (its expert_ffn's) runs in the token
        kernel from its bytes (_kernel_layout); a decode's experts one by one keep the family's torch FFN, as its
        cached decoded experts do."""
        tokens = len(x) if tokens is None else tokens
        layout = self._kernel_layout(block, region) if token_kernel and tokens <= KERNEL_MAX_TOKENS else None
        if layout is not None:
            stored = raw[region.offset - base: region.end - base]
            expert = tuple(stored_matrix(stored, *matrix, self.kernel_table(matrix[0])) for matrix in layout)
            rows = list(range(len(x)))
            return out.copy_(token_kernels.token_kernels().moe_rows(
                x, [expert], [rows], [[1.0] * len(rows)], self.expert_limit, [self._kernel_flag], threads=1))
        weights = self.expert_weights(block, region, raw, base, tokens=tokens)
        return self.apply(weights, x, out)

    def _kernel_layout(self, block: Block, region: Region) -> list[tuple] | None:
        """The expert's kernel_layout where the token kernel may run it on few tokens (`_kernel_route`, a kind the
        kernel takes, the kernel built here); else None."""
        key = (block.name, region.expert)
        if key not in self._kernel_layouts:
            usable = self._kernel_route and token_kernels.token_kernels() is not None
            names = self.naming.names(block.number, region.expert)
            self._kernel_layouts[key] = kernel_layout(region, names) if usable else None
        return self._kernel_layouts[key]

    def _few_tokens(self, block: Block, region: Region) -> int:
        """Up to how many tokens the expert runs on its few-token kernel (token kernel, or fused FP4)."""
        return KERNEL_MAX_TOKENS if self._kernel_layout(block, region) is not None else self.fused_tokens

    def kernel_table(self, kind: str) -> torch.Tensor | None:
        """The token kernel's value table of an FP4 kind (None for others), made once per runner."""
        if kind not in ("FP4_E2M1", "MXFP4"):
            return None
        table = self._tables.get(kind)
        if table is None:  # (expert threads at once: one table kept, and that one handed to each)
            table = self._tables.setdefault(kind, token_kernels.value_table(kind))
        return table

    def apply(self, weights: ExpertWeights, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The expert on x by this runner's arithmetic: the family's expert_ffn (its decoded matrices), else
        weights.apply (the family's expert_forward, expert_limit)."""
        if self.expert_ffn is not None:
            y = self.expert_ffn(x, weights.w1, weights.w3, weights.w2)
            return y if out is None else out.copy_(y)
        return weights.apply(x, out, forward=self.expert_forward, limit=self.expert_limit)

    def expert_weights(self, block: Block, region: Region, raw: torch.Tensor, base: int,
                       tokens: int | None = None) -> ExpertWeights:
        """The expert of `region` decoded from its bytes, for `tokens` tokens (the fused kernel keeps FP4 packed for
        few). They may be views of `raw` or of this thread's decoder's buffers: valid until its next decode."""
        return decode_expert(self._decoder(), self.naming, block.number, region, raw, base,
                             compiled=self.expert_ffn is None, tokens=tokens)

    def owned_weights(self, block: Block, region: Region, raw: torch.Tensor, base: int) -> ExpertWeights:
        """expert_weights as dense matrices of their own, which outlive the bytes and the next decode (a cache of
        decoded experts)."""
        w = self.expert_weights(block, region, raw, base)
        return dataclasses.replace(w, w1=w.w1.clone(), w3=w.w3.clone(), w2=w.w2.clone())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        for decoder in self._decoders:
            decoder.close()
