"""Q8_0: 32 elements -> 34 bytes (f16 scale d, then 32 x int8), ggml's block_q8_0.

Quantization is ggml's quantize_row_q8_0_ref bit for bit: d = max|x| / 127 and id = 1/d in float32,
q = round-half-away-from-zero(x * id), d stored as f16 (round to nearest even). A block whose id overflows
(max|x| below ~2^-121) gets q = 0, as numpy's cast of NaN/inf gives in gguf-py.
"""

from __future__ import annotations

import torch

from .quant_common import check_finite, f16_bits_to_f32, scalar

BLOCK = 32
BYTES = 34

# round half away from zero as trunc(q + copysign(H, q)), H the float just below 0.5: exact for |q| < 2^22.
# With 0.5 itself, 0.49999997 + 0.5 would round up to 1.0 before the truncation.
HALF_DOWN = 0.5 - 2.0 ** -25


def quantize_chunk(x: torch.Tensor, out: torch.Tensor) -> None:
    """x: float32 (nb, 32); out: uint8 (nb, 34) view to fill."""
    nb = x.shape[0]
    a = x.abs()
    d = a.amax(1)
    check_finite(d)
    d = torch.div(d, scalar(127.0, d))
    inv = torch.reciprocal(d).nan_to_num_(nan=0.0, posinf=0.0)  # d == 0 -> 0, overflowing 1/d -> 0
    # |x| * id + H, truncated, with x's sign: fl(|x| * id) = |fl(x * id)|, so this is ggml's roundf(x * id)
    q = a.view(nb, 2, 16).mul_(inv.view(nb, 1, 1)).view(nb, 32).add_(HALF_DOWN)
    torch.copysign(q, x, out=q)
    out.view(torch.int8)[:, 2:].copy_(q)  # float -> int8 truncates toward zero
    out.view(torch.float16)[:, 0].copy_(d)


def dequantize_chunk(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """blocks: uint8 (nb, 34); out: float32 (nb, 32)."""
    nb = blocks.shape[0]
    d = f16_bits_to_f32(blocks[:, :2])
    out.copy_(blocks[:, 2:].view(torch.int8))
    out.view(nb, 2, 16).mul_(d.view(nb, 1, 1))
