"""Weighted ReLU head sum, fused: scores[c, t] = sum_h w[c, h] * relu(q[c, h] . k[t]) as one Triton kernel that
keeps the [queries, heads, keys] products on the chip (torch's way writes them to memory a block at a time and reads
them back for the heads' sum: at 64 heads that traffic, not the arithmetic, is its time).

The kernel tiles (queries, keys); each tile loops over the heads: a [BLOCK_C, D] x [D, BLOCK_T] dot with float32
sums, the ReLU, times the head's weight, added into a float32 tile. Optional per-query visible counts write -inf past
each count and skip key tiles wholly past the tile's largest count. Keys shared by every query ([T, D]) only.
An FP8 e4m3 variant (`weighted_relu_head_sum_fp8`: q per (query, head) row and keys per row quantised with a scale
each, folded out of the dot: relu(s x) = s relu(x) for s > 0) is there for measurement; the selector never picks it.
On sm_90 its dot's sums over D are the FP8 tensor core's own, narrower than float32 (Triton's default
max_num_imprecise_acc: no promotion within a dot; far below the codes' 3-bit rounding), the heads' sum float32.

`weighted_relu_scores` chooses, per shape class, between the kernel and torch's scores (the caller's function,
kept as the fallback): torch's wherever Triton is absent, the tensors are not on CUDA or the work is under
MIN_FUSED_WORK; on CUDA the first call of a shape class runs both, checks the kernel against torch's
(SCORE_TOLERANCE of torch's largest score), times both and keeps the faster; a kernel that fails to compile or
launch gives torch's with one warning (kernel_choice.py's choice). DECISIONS records every choice with its timings
(benchmarks print it). MOEPACK_FUSED_SCORES=0 forces torch's, =1 the kernel (still torch's if it raises).
TRITON_INTERPRET=1 runs the kernel on CPU tensors (Triton's interpreter: the tests).
Triton is imported only when the kernel may run (never on a CPU path)."""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor

from .kernel_choice import KernelChoice, interpreting, power_of_two_above, relative_error, short_bench
from .kernel_choice import triton_modules as _triton

FORCE_ENV = "MOEPACK_FUSED_SCORES"
# the kernel's scores against torch's, at most this fraction of torch's largest |score| apart: torch's round each
# product and the sum to bf16 (2^-9 relative each), the kernel keeps float32; a wrong kernel is off by O(1)
SCORE_TOLERANCE = 2e-2
_CHOICE = KernelChoice("fused scores", "torch's scores", FORCE_ENV, SCORE_TOLERANCE)
# queries x keys x heads below which torch's is kept without a trial: the kernel's tiles would be mostly empty
# (a decode row's one query) or its compile and trial would cost more than the scores (a tiny model's)
MIN_FUSED_WORK = 1 << 20
# shape class -> {"chosen": "fused" | "torch", "fused_s", "torch_s", "error", "reason"}
DECISIONS: dict[str, dict] = {}
FP8_MAX = 448.0  # e4m3's largest finite value
# tl.dot's least K (the head dimension here) on a GPU: 32 bytes of an operand's row (16 bf16 or fp16 values, 32 FP8
# ones); the GPU's compile refuses less, where Triton's interpreter runs it
MIN_DOT_BYTES = 32
# the longest such row every tile of _GPU_TILES keeps in sm_90's 227 KiB of shared memory (a keys tile and the
# pipelined query tiles: 128 KiB at most at 256 bytes, the release's 128 bf16 values; at 512 bytes the 128 x 128
# tile takes 256 KiB, at 1024 bytes every tile is over): longer rows are torch's
MAX_DOT_BYTES = 256


def fused_applies(q: Tensor, keys: Tensor, head_weights: Tensor, fp8: bool = False) -> bool:
    """Whether the kernel can compute these scores (`fp8`: the FP8 variant's, from these operands quantised):
    Triton present, CUDA tensors (or CPU ones under Triton's interpreter) and operands_apply."""
    on_device = q.is_cuda or (interpreting() and q.device.type == "cpu")
    return on_device and operands_apply(q, keys, head_weights, fp8) and _triton() is not None


def operands_apply(q: Tensor, keys: Tensor, head_weights: Tensor, fp8: bool = False) -> bool:
    """Whether the kernel takes these operands (fused_applies less the device and Triton): bf16 or fp16 q and keys,
    keys shared by every query, a power-of-two head dimension of MIN_DOT_BYTES to MAX_DOT_BYTES of the dot's
    operands (16 to 128 bf16 values; 32 to 256 where `fp8` quantises them to one byte each), fewer than 2^31
    elements in every operand and the scores (the kernel's int32 offsets)."""
    head_dim = q.shape[-1]
    dot_bytes = head_dim * (1 if fp8 else q.element_size())
    return (q.dim() == 3 and keys.dim() == 2 and keys.shape[-1] == head_dim and head_weights.shape == q.shape[:2]
            and q.dtype in (torch.bfloat16, torch.float16) and keys.dtype == q.dtype
            and MIN_DOT_BYTES <= dot_bytes <= MAX_DOT_BYTES and head_dim & (head_dim - 1) == 0
            and max(q.numel(), keys.numel(), q.shape[0] * keys.shape[0]) < 2**31)


def _kernel_source(tl):
    def weighted_relu_head_sum_kernel(
            q_ptr, k_ptr, w_ptr, counts_ptr, key_scales_ptr, out_ptr, n_queries, n_keys, queries_class, keys_class,
            stride_qc, stride_qh, stride_kt, stride_wc, stride_wh, stride_oc,
            HEADS: tl.constexpr, D: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
            HAS_COUNTS: tl.constexpr, HAS_KEY_SCALES: tl.constexpr, WIDEN: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        first_key = tl.program_id(1) * BLOCK_T
        cols = first_key + tl.arange(0, BLOCK_T)
        dims = tl.arange(0, D)
        row_ok = rows < n_queries
        col_ok = cols < n_keys
        seen = n_keys
        if HAS_COUNTS:
            counts = tl.load(counts_ptr + rows, mask=row_ok, other=0)
            seen = tl.max(counts, axis=0)
        acc = tl.zeros((BLOCK_C, BLOCK_T), dtype=tl.float32)
        if first_key < seen:  # (else every query of the tile sees none of these keys)
            keys = tl.load(k_ptr + cols[None, :] * stride_kt + dims[:, None], mask=col_ok[None, :], other=0.0)
            if WIDEN:
                keys = keys.to(tl.float32)
            for h in range(0, HEADS):
                q = tl.load(q_ptr + rows[:, None] * stride_qc + h * stride_qh + dims[None, :],
                            mask=row_ok[:, None], other=0.0)
                if WIDEN:
                    q = q.to(tl.float32)
                w = tl.load(w_ptr + rows * stride_wc + h * stride_wh, mask=row_ok, other=0.0).to(tl.float32)
                if WIDEN:
                    products = tl.dot(q, keys, input_precision="ieee", out_dtype=tl.float32)
                else:
                    products = tl.dot(q, keys, out_dtype=tl.float32)
                acc += tl.maximum(products, 0.0) * w[:, None]
        if HAS_KEY_SCALES:
            acc = acc * tl.load(key_scales_ptr + cols, mask=col_ok, other=0.0)[None, :]
        if HAS_COUNTS:
            acc = tl.where(cols[None, :] < counts[:, None], acc, float("-inf"))
        tl.store(out_ptr + rows[:, None] * stride_oc + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])
    return weighted_relu_head_sum_kernel


# WIDEN (the interpreter's bf16 dot only: numpy's reads bf16's bits as integers) widens q and keys to float32 first,
# exact products of bf16 values as the GPU's bf16 dot's are
# tile sizes tried on a GPU (the first run of each shape class picks one: queries_class and keys_class, unused by
# the kernel, are shape_class's powers of two, the autotuner's key); the interpreter runs one small tile
_GPU_TILES = ((64, 128, 4, 3), (128, 128, 8, 3), (64, 256, 8, 3), (128, 64, 4, 3), (64, 64, 4, 4))
_INTERPRETER_TILE = (16, 32)


@functools.cache
def _kernel(interpret: bool):
    """The jitted kernel (autotuned over _GPU_TILES on a GPU), made at first use: whether it is interpreted is
    Triton's reading of TRITON_INTERPRET when it is decorated."""
    triton, tl = _triton()
    jitted = triton.jit(_kernel_source(tl), do_not_specialize=["n_queries", "n_keys", "queries_class", "keys_class"])
    if interpret:
        return jitted
    configs = [triton.Config({"BLOCK_C": c, "BLOCK_T": t}, num_warps=warps, num_stages=stages)
               for c, t, warps, stages in _GPU_TILES]
    return triton.autotune(configs, key=["queries_class", "keys_class", "HEADS", "D", "HAS_COUNTS", "HAS_KEY_SCALES"],
                           do_bench=short_bench)(jitted)


def kernel_arguments(q: Tensor, keys: Tensor, head_weights: Tensor, counts: Tensor | None, key_scales: Tensor | None,
                     interpret: bool) -> tuple[Tensor, tuple, dict]:
    """(out, the kernel's arguments, its constexprs but the tiles) for these operands, as _launch passes them:
    what benchmarks/triton_aot.py compiles for sm_90 (with CPU tensors: Triton specialises on their dtypes, their
    pointers' and integers' divisibility by 16 and integers equal to 1)."""
    n_queries, heads, head_dim = q.shape
    n_keys = keys.shape[0]
    q = q if q.stride(-1) == 1 else q.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    out = torch.empty(n_queries, n_keys, dtype=torch.float32, device=q.device)
    if counts is not None:
        counts = counts.to(device=q.device, dtype=torch.int32).contiguous()
    arguments = (q, keys, head_weights, counts if counts is not None else out,
                 key_scales if key_scales is not None else out, out, n_queries, n_keys, power_of_two_above(n_queries),
                 power_of_two_above(n_keys), q.stride(0), q.stride(1), keys.stride(0), head_weights.stride(0),
                 head_weights.stride(1), out.stride(0))
    constexprs = dict(HEADS=heads, D=head_dim, HAS_COUNTS=counts is not None, HAS_KEY_SCALES=key_scales is not None,
                      WIDEN=interpret and q.dtype == torch.bfloat16)
    return out, arguments, constexprs


def _launch(q: Tensor, keys: Tensor, head_weights: Tensor, counts: Tensor | None,
            key_scales: Tensor | None) -> Tensor:
    interpret = interpreting()
    out, arguments, constexprs = kernel_arguments(q, keys, head_weights, counts, key_scales, interpret)
    if out.numel() == 0:
        return out
    n_queries, n_keys = out.shape
    tiles = dict(zip(("BLOCK_C", "BLOCK_T"), _INTERPRETER_TILE)) if interpret else {}

    def grid(meta):
        return (-(-n_queries // meta["BLOCK_C"]), -(-n_keys // meta["BLOCK_T"]))
    _kernel(interpret)[grid](*arguments, **constexprs, **tiles)
    return out


def weighted_relu_head_sum(q: Tensor, keys: Tensor, head_weights: Tensor, counts: Tensor | None = None) -> Tensor:
    """The kernel's scores [C, T] float32 from q [C, heads, D], keys [T, D] (bf16 or fp16, on CUDA or under the
    interpreter) and head_weights [C, heads]: sum_h w[c, h] * relu(q[c, h] . keys[t]), the products' sums in
    float32; with counts [C], -inf at every t >= counts[c]. Raises where it cannot run (see fused_applies)."""
    if not fused_applies(q, keys, head_weights):
        raise ValueError(f"no fused scores for q {tuple(q.shape)} {q.dtype} on {q.device}, keys {tuple(keys.shape)}"
                         f" {keys.dtype}, head weights {tuple(head_weights.shape)}, or Triton is not installed")
    return _launch(q, keys, head_weights, counts, None)


def quantize_rows_e4m3(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., D] -> (codes float8_e4m3fn [..., D], scales float32 [...]): each row over its largest |value|, as
    DeepSeek's indexer quantises its queries and keys (x ~ codes * scale)."""
    scales = x.float().abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    return (x.float() / scales.unsqueeze(-1)).to(torch.float8_e4m3fn), scales


def weighted_relu_head_sum_fp8(q: Tensor, keys: Tensor, head_weights: Tensor, counts: Tensor | None = None
                               ) -> Tensor:
    """weighted_relu_head_sum with q and keys quantised to FP8 e4m3, a scale per (query, head) row and per key:
    the query's scale goes into its head weight, the key's multiplies the heads' sum (both positive, through the
    ReLU). Needs an FP8 tensor core (sm_89 on) or the interpreter, and a head dimension of 32 to 256 (MIN_DOT_BYTES
    to MAX_DOT_BYTES of FP8 codes). Not chosen by weighted_relu_scores."""
    if not fused_applies(q, keys, head_weights, fp8=True):
        raise ValueError(f"no fused FP8 scores for q {tuple(q.shape)} {q.dtype} on {q.device}, keys "
                         f"{tuple(keys.shape)} {keys.dtype}, head weights {tuple(head_weights.shape)} (see "
                         "fused_applies), or Triton is not installed")
    q_codes, key_codes, weights, key_scales = fp8_operands(q, keys, head_weights)
    return _launch(q_codes, key_codes, weights, counts, key_scales)


def fp8_operands(q: Tensor, keys: Tensor, head_weights: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q's codes, the keys' codes, the head weights times q's scales (float32), the keys' scales): the FP8
    variant's operands of the kernel."""
    q_codes, q_scales = quantize_rows_e4m3(q)
    key_codes, key_scales = quantize_rows_e4m3(keys)
    return q_codes, key_codes, head_weights.float() * q_scales, key_scales


def shape_class(q: Tensor, keys: Tensor) -> str:
    """What a decision is kept for: the device, dtype, heads and head dimension, and the queries and keys each
    rounded up to a power of two (a prompt's chunks see ever more keys: a few classes, not one per chunk)."""
    n_queries, heads, head_dim = q.shape
    return f"{q.device} {str(q.dtype).removeprefix('torch.')} heads={heads} D={head_dim} " \
           f"C<={power_of_two_above(n_queries)} T<={power_of_two_above(keys.shape[0])}"


def weighted_relu_scores(q: Tensor, keys: Tensor, head_weights: Tensor, torch_scores: Callable[[], Tensor]
                         ) -> Tensor:
    """sum_h head_weights[c, h] * relu(q[c, h] . keys[t]) [C, T] float32, from the fused kernel or from
    `torch_scores()` (the caller's torch computation of the same scores, the fallback), as this shape class's
    decision says (made at its first call, see the module's doc). Where the kernel does not apply, or below
    MIN_FUSED_WORK unless forced, torch's."""
    forced = _CHOICE.forced()
    if forced == "0" or not fused_applies(q, keys, head_weights) \
            or (forced != "1" and q.shape[0] * keys.shape[0] * q.shape[1] < MIN_FUSED_WORK):
        return torch_scores()
    return _CHOICE.result(DECISIONS, shape_class(q, keys), q.device,
                          lambda: weighted_relu_head_sum(q, keys, head_weights), torch_scores)
