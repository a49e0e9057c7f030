"""Expert backends: how a layer's routed experts are computed, behind one interface (`ExpertBackend`).

Two implement it:
- `expert_runner.ExpertRunner` ("per-expert"): each expert decoded and multiplied on its own, on work-stealing
  CPU threads, with the compiled FP4 table decoder and fused kernel. What a CPU runs best: an expert's few dozen
  tokens split badly across cores, and its decoded matrix stays in cache.
- `GroupedExperts` ("grouped", below): what a GPU runs best. The (token, expert) pairs are permuted once per layer
  into one [P, H] matrix sorted by expert; each read (a bundle of consecutive experts) is decoded on the device in
  a few launches for all its experts at once (format_spec.decode.decode_stacked: their bytes side by side,
  dequantized as one tensor, whatever the storage type), then gate and up run as one grouped GEMM over the
  bundle's experts, the activation on all their rows, the down projection as a second grouped GEMM; the outputs
  are combined once per layer. No Python loop over experts; reads still overlap compute, as each bundle is
  computed as it lands.

A backend knows nothing of a model family: the caller names each expert's tensors (`ExpertNaming`) and gives the
activation between the two GEMMs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from moepack.backends.device_copier import to_device_async
from moepack.backends.expert_naming import ExpertNaming
from moepack.format_spec.decode import decode_stacked, entry_bytes
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.reader import Block, Region

EXPERT_BACKENDS = ("auto", "grouped", "per-expert")


class ExpertBackend(Protocol):
    """What the engine needs of an expert backend."""

    threads: int  # the threads its experts run on (the stats; the memory estimate)
    decoded_at_once: int  # experts decoded at the same time, at most (the memory estimate)
    fused_tokens: int
    fused_tokens_source: str
    keep_expert: Callable | None  # keep_expert(block, region, view, base): each expert's checked bytes as used

    def run_layer(self, block: Block, reads: list, routing, beside: Sequence[tuple] = ()
                  ) -> tuple[torch.Tensor, list]:
        """The layer's routed experts on routing's tokens, combined ([N, H] float32), and the results of the
        `beside` tasks, or None each where the caller is to run them itself."""
        ...

    def close(self) -> None: ...


def resolve_expert_backend(name: str, device: torch.device) -> str:
    """The backend `--expert-backend` names; "auto": grouped on a GPU, per-expert on a CPU."""
    if name not in EXPERT_BACKENDS:
        raise MoepackError(f"unknown expert backend {name!r} (choose from {', '.join(EXPERT_BACKENDS)})")
    if name == "auto":
        return "per-expert" if device.type == "cpu" else "grouped"
    return name


# torch's grouped GEMM: the public name (torch >= 2.9), else the private one it grew from (SM90, bf16)
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
# CUDA's kernel prepares its groups in one thread block of that many threads: torch refuses 1024 groups or more
# (aten/src/ATen/native/cuda/GroupMM.cu, "Can't process more than 1024 groups")
MAX_GROUPS = 1023
_TMA_BYTES = 16  # CUDA's kernel loads and stores by TMA: base addresses and row strides in multiples of 16 bytes


@functools.lru_cache(maxsize=None)
def _compute_capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def grouped_mm_refusal(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor | None = None,
                       as_cuda: bool | None = None) -> str | None:
    """Why torch's grouped GEMM would not take a [rows, K] @ b [G, K, N] (b transposed from [G, N, K]) with
    `offsets` (int32 group ends) here, or None where it does. `as_cuda` (default: a is on a GPU): CUDA's own
    checks, also on CPU tensors (a test), where the only kernel that runs without waiting for the host is
    CUTLASS's, on sm_90 / sm_100, in bf16 (any other arch or dtype goes to a loop that copies the offsets to the
    host): torch's _grouped_mm_cuda (GroupedBlas.cpp), _grouped_mm_validate_inputs and
    check_valid_strides_and_return_transposed (GroupedMMUtils.h), GroupMM.cu."""
    cuda = a.device.type == "cuda" if as_cuda is None else as_cuda
    if _GROUPED_MM is None:
        return "this torch has no grouped GEMM"
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[1]:
        return f"shapes {list(a.shape)} @ {list(b.shape)} are not [rows, K] @ [G, K, N]"
    if b.dtype != a.dtype or a.dtype not in ((torch.bfloat16,) if cuda else
                                             (torch.bfloat16, torch.float16, torch.float32)):
        return f"dtypes {a.dtype} @ {b.dtype}"
    if a.device.type == "cuda" and _compute_capability(a.device.index)[0] not in (9, 10):
        return "CUDA's grouped kernel needs sm_90 or sm_100"
    if cuda and b.shape[0] > MAX_GROUPS:
        return f"{b.shape[0]} groups (CUDA's kernel takes at most {MAX_GROUPS})"
    if a.shape[0] == 0:
        return "no rows"
    for name, t in (("a", a), ("b", b)):
        if cuda and t.data_ptr() % _TMA_BYTES:
            return f"{name}'s data is not {_TMA_BYTES}-byte aligned"
        # one of the last two dimensions dense, the other's stride a multiple of 16 bytes
        rows_stride, cols_stride = t.stride()[-2:]
        leading = cols_stride if rows_stride == 1 and cols_stride >= max(1, t.shape[-2]) else \
            rows_stride if cols_stride == 1 and rows_stride >= max(1, t.shape[-1]) else None
        if leading is None or leading * t.element_size() % _TMA_BYTES:
            return f"{name}'s strides {list(t.stride())} (sizes {list(t.shape)})"
    if any(d * a.element_size() % _TMA_BYTES for d in (a.shape[1], b.shape[2])):
        return f"K = {a.shape[1]} or N = {b.shape[2]} is not a multiple of {_TMA_BYTES} bytes"
    if offsets is not None and (offsets.dtype != torch.int32 or offsets.dim() != 1
                                or offsets.shape[0] != b.shape[0] or offsets.device != a.device):
        return f"offsets {offsets.dtype} {list(offsets.shape)} on {offsets.device} for {b.shape[0]} groups"
    return None


def grouped_mm_usable(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor | None = None) -> bool:
    """Whether torch's grouped GEMM takes a [rows, K] @ b [G, K, N] here (grouped_mm_refusal: on CUDA, without a
    host synchronisation)."""
    return grouped_mm_refusal(a, b, offsets) is None


def group_offsets(counts: list[int], device: torch.device) -> torch.Tensor:
    """The groups' end rows as the grouped GEMM takes them (int32 on the device), copied without making the host
    wait for the device (a pageable copy would wait for every kernel queued before it)."""
    return to_device_async(torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32), device)


def grouped_matmul(a: torch.Tensor, b: torch.Tensor, counts: list[int] | None, offsets: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Rows a[offset_g : offset_g + counts[g]] @ b[g] for each group g, as one [rows, N] tensor: torch's grouped
    GEMM where it takes these operands (`offsets`: group_offsets(counts), made here if not given), else one
    matmul per group (float32 on a GPU). `counts` None: only `offsets` (on the device, never read by the host),
    for operands grouped_mm_usable takes."""
    refusal = grouped_mm_refusal(a, b, offsets)
    if counts is None and refusal is not None:
        raise ValueError(f"grouped_matmul without counts needs operands torch's grouped GEMM takes: {refusal}")
    if refusal is None:
        return _GROUPED_MM(a, b, offs=group_offsets(counts, a.device) if offsets is None else offsets)
    out = torch.empty(a.shape[0], b.shape[2], dtype=a.dtype, device=a.device)
    first = 0
    for g, n in enumerate(counts):
        torch.mm(a[first:first + n], b[g], out=out[first:first + n])
        first += n
    return out


class GroupedExperts:
    """The grouped expert backend (module docstring). `activation(gate, up)` runs between the two GEMMs."""

    threads = 1
    fused_tokens, fused_tokens_source = 0, "not used by the grouped backend"

    def __init__(self, naming: ExpertNaming, activation: Callable, device: torch.device, expert_dtype: torch.dtype,
                 checker, copier, release: Callable, compute, bundle_experts: int):
        self.naming, self.activation = naming, activation
        self.device, self.expert_dtype = device, expert_dtype
        self.checker, self.copier, self.release, self.compute = checker, copier, release, compute
        self.decoded_at_once = bundle_experts
        self.keep_expert: Callable | None = None

    def run_layer(self, block: Block, reads: list, routing, beside: Sequence[tuple] = ()
                  ) -> tuple[torch.Tensor, list]:
        with self.compute:
            groups = routing.groups()
            x = groups.gather(routing.x.to(self.expert_dtype))  # [P, H]: each pair's row, sorted by expert
            # rows of experts this process does not compute (another rank's) stay zero for the combine
            y = torch.zeros_like(x)
        failure = None
        for first_expert, count, future in reads:  # in read order, each computed as it lands
            buffer = None
            try:
                buffer, view = future.result()  # a read that failed gave its buffer back itself
                if failure is None:
                    self._bundle(block, block.experts[first_expert:first_expert + count], buffer, view, groups, x, y)
            except BaseException as e:  # every read is still awaited and its buffer given back
                failure = failure or e
            finally:
                if buffer is not None:
                    self.copier.release(buffer, self.release)
        if failure is not None:
            raise failure
        with self.compute:
            return groups.combine(y, routing.x.shape[0]), [None] * len(beside)

    def _bundle(self, block: Block, regions: list[Region], buffer, view: memoryview, groups, x: torch.Tensor,
                y: torch.Tensor) -> None:
        """y's rows of the chosen experts among `regions` (one read's bytes), computed together."""
        base = regions[0].offset
        chosen = [r for r in regions if r.expert in groups.spans]
        with self.compute:
            unchosen = [r for r in regions if r.expert not in groups.spans]
            if unchosen and not self.checker.on_read:
                self.checker.check(unchosen, view, base)  # every byte read is checked, used or not
            if not chosen:
                return
            self.checker.before_use(chosen, view, base)
            if self.keep_expert is not None:
                for r in chosen:
                    self.keep_expert(block, r, view, base)
            raw = self.copier.to_device(buffer, view)
            spans = [groups.spans[r.expert] for r in chosen]
            first, stop = spans[0][0], spans[-1][1]
            counts = [b - a for a, b in spans]
            if sum(counts) != stop - first:  # a read is consecutive experts, and the pairs are sorted by expert
                raise RuntimeError(f"the experts of one read do not own consecutive rows: {spans[:4]}")
            n = self.naming
            w = decode_stacked([(n.prefix(block.number, r.expert), r.tensors) for r in chosen],
                               entry_bytes(raw, base),
                               (n.gate, n.up, n.down), self.expert_dtype)
            inner = w[n.gate].shape[1]
            gate_up = torch.cat([w.pop(n.gate), w.pop(n.up)], dim=1)  # [G, 2I, H]: both in one GEMM
            offsets = group_offsets(counts, x.device)  # once for both GEMMs
            both = grouped_matmul(x[first:stop], gate_up.transpose(1, 2), counts, offsets)
            del gate_up
            hidden = self.activation(both[:, :inner], both[:, inner:])
            y[first:stop] = grouped_matmul(hidden, w[n.down].transpose(1, 2), counts, offsets)

    def gemm_kernel(self) -> str:
        """Which GEMM runs here (the stats): torch's grouped GEMM, or one matmul per expert."""
        probe = torch.empty(1, 16, dtype=self.expert_dtype, device=self.device)
        return "torch grouped_mm" if grouped_mm_usable(probe, probe.new_empty(1, 16, 16)) else "a matmul per expert"

    def close(self) -> None:
        pass
