"""FP4 experts' matmuls straight from their stored bytes: for P (row, choice) pairs of a decode step,
y[p, n] = sum_k W_p[n, k] x[p, k], W_p the FP4_E2M1 matrix [N, K] of slot `slots[p]` of a stored pool's byte stack
(uint8 [slots, slot bytes]): its codes [N, K/2] (element 2i in a byte's low nibble, 2i+1 in its high one) and its
E8M0 scales [N, K/32] (2^(byte - 127) per 32 inputs) at their offsets in the slot. One Triton kernel reads each
pair's bytes once, decodes them in registers and sums in float32: a batched GEMV, memory-bound, where torch's way
(decode every pair's matrix to bf16, then bmm) writes and reads back four times the stored bytes and more.

Tiles: a program per (pair, BLOCK_N outputs), looping over K a BLOCK_K at a time; each 32 inputs' products summed
before their scale multiplies them (a power of two: exact but for overflow). The autotuner picks the tile per
(N, K, pairs rounded up to a power of two) on a GPU; the interpreter (TRITON_INTERPRET=1, CPU tensors: the tests)
runs one small tile.

`pairs_result` chooses, per shape class, between the kernel and the caller's torch computation (kernel_choice.py:
checked against torch's within PAIRS_TOLERANCE, timed, the faster kept; MOEPACK_STORED_GEMV=0/1 forces; any
exception gives torch's with one warning); DECISIONS records the choices."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from . import kernel_choice
from .kernel_choice import KernelChoice, interpreting, power_of_two_above, short_bench

FORCE_ENV = "MOEPACK_STORED_GEMV"
# the kernel's terms against torch's, as a fraction of torch's largest |term|: both multiply the same exact weights
# (e2m1 values times powers of two); they differ in float32 summation order and in where bf16 rounds (both round
# gate and up to bf16 before the activation, 2^-9 relative each, perhaps on either side of a rounding boundary;
# torch's bmm rounds each term too, the kernel keeps it float32): a few bf16 steps of the largest term at most; a
# wrong kernel (a nibble swapped, a scale misplaced) is off by O(1)
PAIRS_TOLERANCE = 2e-2
# shape class -> {"chosen": "fused" | "torch", "fused_s", "torch_s", "error", "reason"}
DECISIONS: dict[str, dict] = {}
_CHOICE = KernelChoice("the stored FP4 kernel", "torch's decode and matmuls", FORCE_ENV, PAIRS_TOLERANCE)
FP4_GROUP = 32  # inputs per E8M0 scale


@dataclass(frozen=True)
class Fp4Matrix:
    """Where an FP4_E2M1 matrix [out_features, in_features] with its E8M0 scales [out, in / 32] lies in each slot's
    bytes: the codes from `codes_at`, the scales from `scales_at`."""
    out_features: int
    in_features: int
    codes_at: int
    scales_at: int

    @property
    def codes_bytes(self) -> int:
        return self.out_features * self.in_features // 2

    @property
    def scales_bytes(self) -> int:
        return self.out_features * self.in_features // FP4_GROUP


def fp4_matrix(dtype: str, shape: tuple[int, ...], span: tuple[int, int], scale, tensor_scale) -> Fp4Matrix | None:
    """The Fp4Matrix of a stored matrix (its storage type, shape, byte span, block scale (type, shape, span) or
    None, tensor scale span or None), or None where the kernel does not read it: not FP4_E2M1 with E8M0 scales
    [N, K/32] and no tensor scale."""
    if dtype != "FP4_E2M1" or scale is None or tensor_scale is not None or len(shape) != 2:
        return None
    (n, k), (scale_dtype, scale_shape, scale_span) = shape, scale
    if k % FP4_GROUP or scale_dtype != "F8_E8M0" or tuple(scale_shape) != (n, k // FP4_GROUP):
        return None
    matrix = Fp4Matrix(n, k, span[0], scale_span[0])
    if span[1] - span[0] != matrix.codes_bytes or scale_span[1] - scale_span[0] != matrix.scales_bytes:
        return None
    return matrix


def kernel_applies(stack: Tensor, x: Tensor) -> bool:
    """Whether the kernel can run here: Triton present, CUDA tensors (or CPU ones under the interpreter), x bf16
    or float32."""
    on_device = stack.is_cuda or (interpreting() and stack.device.type == "cpu")
    return (on_device and stack.dtype == torch.uint8 and stack.dim() == 2 and x.dim() == 2
            and x.dtype in (torch.bfloat16, torch.float32) and kernel_choice.triton_modules() is not None)


def _kernel_source(tl):
    def fp4_pairs_gemv_kernel(stack_ptr, slots_ptr, x_ptr, out_ptr, n_out, slot_stride, codes_at, scales_at, stride_x,
                              stride_out, pairs_class, N_IN: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr):
        pair = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n_out
        slot_base = stack_ptr + tl.load(slots_ptr + pair).to(tl.int64) * slot_stride
        codes_rows = slot_base + codes_at + rows[:, None] * (N_IN // 2)
        scales_rows = slot_base + scales_at + rows[:, None] * (N_IN // 32)
        x_row = x_ptr + pair.to(tl.int64) * stride_x
        tile_bytes = tl.arange(0, BLOCK_K // 2)
        tile_inputs = tl.arange(0, BLOCK_K)
        tile_groups = tl.arange(0, BLOCK_K // 32)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for first in range(0, N_IN, BLOCK_K):
            byte = first // 2 + tile_bytes
            packed = tl.load(codes_rows + byte[None, :], mask=row_ok[:, None] & (byte < N_IN // 2)[None, :], other=0)
            packed = packed.to(tl.int32)
            # inputs 2i (the low nibble) and 2i + 1 (the high one) side by side: [BLOCK_N, BLOCK_K] in input order
            codes = tl.reshape(tl.join(packed & 15, packed >> 4), (BLOCK_N, BLOCK_K))
            # e2m1 code (sign << 3 | magnitude index m) -> m / 2 below 4, m - 2 for 4 and 5, 2m - 8 for 6 and 7
            m = (codes & 7).to(tl.float32)
            magnitude = tl.where(m < 4, m * 0.5, tl.where(m < 6, m - 2.0, m * 2.0 - 8.0))
            w = tl.where(codes >= 8, -magnitude, magnitude)
            inputs = first + tile_inputs
            x = tl.load(x_row + inputs, mask=inputs < N_IN, other=0.0).to(tl.float32)
            group_sums = tl.sum(tl.reshape(w * x[None, :], (BLOCK_N, BLOCK_K // 32, 32)), axis=2)
            group = first // 32 + tile_groups
            scale_bytes = tl.load(scales_rows + group[None, :], mask=row_ok[:, None] & (group < N_IN // 32)[None, :],
                                  other=127).to(tl.int32)  # (2^0 past the end, times sums of zeros)
            # E8M0 byte -> 2^(byte - 127) as torch's float8_e8m0fnu reads it: 0 is 2^-127 (a subnormal), 255 NaN
            bits = tl.where(scale_bytes == 0, 0x00400000, tl.where(scale_bytes == 255, 0x7FC00000, scale_bytes << 23))
            acc += tl.sum(group_sums * bits.to(tl.float32, bitcast=True), axis=1)
        tl.store(out_ptr + pair.to(tl.int64) * stride_out + rows, acc.to(out_ptr.dtype.element_ty), mask=row_ok)
    return fp4_pairs_gemv_kernel


# tiles tried on a GPU (BLOCK_N, BLOCK_K, warps, stages): few outputs a program, for enough programs at one pair
# (N = 2048 outputs in 16s: 128 programs a pair); the interpreter runs one small tile
_GPU_TILES = ((16, 256, 4, 3), (32, 256, 4, 3), (16, 512, 4, 3), (32, 512, 8, 3), (64, 128, 4, 3), (8, 512, 2, 4))
_INTERPRETER_TILE = (8, 64)


@functools.cache
def _kernel(interpret: bool):
    """The jitted kernel (autotuned over _GPU_TILES on a GPU), made at first use."""
    triton, tl = kernel_choice.triton_modules()
    jitted = triton.jit(_kernel_source(tl), do_not_specialize=["pairs_class"])
    if interpret:
        return jitted
    configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
               for n, k, warps, stages in _GPU_TILES]
    return triton.autotune(configs, key=["n_out", "N_IN", "pairs_class"], do_bench=short_bench)(jitted)


def fp4_pairs_matmul(stack: Tensor, slots: Tensor, x: Tensor, matrix: Fp4Matrix,
                     out_dtype: torch.dtype = torch.float32) -> Tensor:
    """y [P, N] (`out_dtype`: float32 or bf16) with y[p] = W_{slots[p]} x[p]: `stack` uint8 [slots, slot bytes]
    (each slot's matrix where `matrix` says), `slots` [P] integers, x [P, K] bf16 or float32, all on CUDA (or the
    CPU under the interpreter); float32 sums. Raises where the kernel cannot run (kernel_applies)."""
    pairs, n_in = x.shape
    if not kernel_applies(stack, x) or n_in != matrix.in_features or slots.shape != (pairs,):
        raise ValueError(f"no stored FP4 kernel for x {tuple(x.shape)} {x.dtype} on {x.device}, slots "
                         f"{tuple(slots.shape)}, a [{matrix.out_features}, {matrix.in_features}] matrix, or Triton "
                         "is not installed")
    interpret = interpreting()
    out, arguments, constexprs = kernel_arguments(stack, slots, x, matrix, out_dtype)
    if pairs == 0:
        return out
    tiles = dict(zip(("BLOCK_N", "BLOCK_K"), _INTERPRETER_TILE)) if interpret else {}

    def grid(meta):
        return (pairs, -(-matrix.out_features // meta["BLOCK_N"]))
    _kernel(interpret)[grid](*arguments, **constexprs, **tiles)
    return out


def kernel_arguments(stack: Tensor, slots: Tensor, x: Tensor, matrix: Fp4Matrix, out_dtype: torch.dtype
                     ) -> tuple[Tensor, tuple, dict]:
    """(out, the kernel's arguments, its constexprs but the tiles) for these operands, as fp4_pairs_matmul passes
    them: what benchmarks/triton_aot.py compiles for sm_90 (with CPU tensors: Triton specialises on their dtypes,
    their pointers' and integers' divisibility by 16 and integers equal to 1)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape[0], matrix.out_features, dtype=out_dtype, device=x.device)
    arguments = (stack, slots.to(torch.int64), x, out, matrix.out_features, stack.stride(0), matrix.codes_at,
                 matrix.scales_at, x.stride(0), out.stride(0), power_of_two_above(x.shape[0]))
    return out, arguments, dict(N_IN=x.shape[1])


def shape_class(stack: Tensor, x: Tensor, matrices: list[Fp4Matrix]) -> str:
    """What a decision is kept for: the device, x's dtype, the pairs rounded up to a power of two and the
    matrices' shapes."""
    shapes = " ".join(f"{m.out_features}x{m.in_features}" for m in matrices)
    return f"{stack.device} {str(x.dtype).removeprefix('torch.')} pairs<={power_of_two_above(x.shape[0])} {shapes}"


def pairs_result(stack: Tensor, x: Tensor, matrices: list[Fp4Matrix], kernel: Callable[[], Tensor],
                 reference: Callable[[], Tensor]) -> Tensor:
    """kernel() (the caller's computation over `matrices` through fp4_pairs_matmul, x its pairs' inputs) or
    reference() (torch's), as their shape class's decision says (made at its first call: module doc); torch's where
    the kernel does not apply or MOEPACK_STORED_GEMV=0."""
    if _CHOICE.forced() == "0" or not kernel_applies(stack, x):
        return reference()
    return _CHOICE.result(DECISIONS, shape_class(stack, x, matrices), stack.device, kernel, reference)
