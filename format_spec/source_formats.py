"""The weight encodings DeepSeek-V4's released checkpoint uses, with encoders and decoders.

* FP8 e4m3 with E8M0 scales over 128x128 blocks: the non-expert ("dense") linears. A weight tensor
  `name.weight` (F8_E4M3 [out, in]) comes with `name.scale` (F8_E8M0 [ceil(out/128), ceil(in/128)]);
  the real value is weight * scale of its block.
* Packed FP4 e2m1 with one E8M0 scale per 32 inputs: the routed experts. `name.weight` is I8 [out, in/2]
  (element 2i in the low nibble, 2i+1 in the high nibble) and `name.scale` F8_E8M0 [out, in/32].

E8M0 is a bare exponent byte e meaning 2^(e-127); 0xFF is NaN. Scales follow DeepSeek's "ue8m0" rule: the
smallest power of two that brings a block's absolute maximum inside the element type's range
(2^ceil(log2(amax / max))). Everything here is vectorised torch, so encoding a whole layer costs a few
tensor passes, never a Python loop over blocks.
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from moepack import native

from .errors import MoepackError
from .source_blocks import FP4_GROUP, FP8_BLOCK, fp8_block_scale_shape  # noqa: F401  (also from here)

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0

# E8M0 can encode 2^-127 .. 2^127 (byte 0 .. 254; 255 is NaN).
_E8M0_MIN_EXP = -127
_E8M0_MAX_EXP = 127

# The 16 e2m1 values, indexed by code = sign << 3 | magnitude index.
_E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E2M1_VALUES = torch.tensor(_E2M1_MAGNITUDES + [-m for m in _E2M1_MAGNITUDES], dtype=torch.float32)


def _ue8m0_exponent(amax: torch.Tensor, type_max: float) -> torch.Tensor:
    """Integer exponent e (int32) with 2^e = 2^ceil(log2(amax / type_max)), clamped to what E8M0 holds.

    Uses frexp rather than log2 so the ceiling is exact: ratio = m * 2^k with m in [0.5, 1), and
    ceil(log2(ratio)) is k - 1 when m is exactly 0.5 (ratio a power of two) and k otherwise. A float log2 can
    round a "just above a power of two" ratio down to the integer and pick a scale one step too small.
    An all-zero block gets scale 1 (exponent 0): its codes are all zero, so any finite scale decodes it, and
    log2(0) would be -inf. (DeepSeek's activation kernels floor amax at 1e-4 instead; for weights that would
    coarsen every tiny-valued block, so zero is special-cased alone.)
    """
    if not torch.isfinite(amax).all():
        raise MoepackError("can't quantize a weight holding inf or NaN")
    ratio = amax.float() / type_max
    mantissa, exponent = torch.frexp(ratio)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    exponent = torch.where(amax == 0, torch.zeros_like(exponent), exponent)
    return exponent.clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP)


def _exponent_to_e8m0(exponent: torch.Tensor) -> torch.Tensor:
    # Build the byte by hand: exact, and independent of how torch rounds a float cast to e8m0.
    return (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype != torch.float8_e8m0fnu:
        raise MoepackError(f"scale must be float8_e8m0fnu, got {scale.dtype}")
    return scale.view(torch.uint8)


def _e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    _e8m0_bytes(scale)
    return scale.float()


# ---------------------------------------------------------------------------------------------------------
# FP8 e4m3 with 128x128 E8M0 block scales
# ---------------------------------------------------------------------------------------------------------


def _pad_to_blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    rows, cols = w.shape
    pad_rows, pad_cols = (-rows) % block, (-cols) % block
    if pad_rows or pad_cols:
        # Zero padding never raises a block's amax, so edge blocks get the scale of their real elements.
        w = torch.nn.functional.pad(w, (0, pad_cols, 0, pad_rows))
    return w


def fp8_block_quantize(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode a 2-D float weight as (float8_e4m3fn [out, in], float8_e8m0fnu [ceil(out/block), ceil(in/block)])."""
    if w.ndim != 2:
        raise MoepackError(f"FP8 block quantization needs a 2-D weight, got shape {list(w.shape)}")
    if not w.is_floating_point():
        raise MoepackError(f"FP8 block quantization needs a float weight, got {w.dtype}")
    rows, cols = w.shape
    block_rows, block_cols = fp8_block_scale_shape(rows, cols, block)
    blocks = _pad_to_blocks(w.float(), block).view(block_rows, block, block_cols, block)
    amax = blocks.abs().amax(dim=(1, 3))
    exponent = _ue8m0_exponent(amax, FP8_E4M3_MAX)
    inv_scale = torch.ldexp(torch.ones_like(amax), -exponent)
    scaled = (blocks * inv_scale[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    weight = scaled.view(block_rows * block, block_cols * block)[:rows, :cols].to(torch.float8_e4m3fn)
    return weight.contiguous(), _exponent_to_e8m0(exponent)


def _check_scale_shape(weight: torch.Tensor, scale: torch.Tensor, block: int) -> None:
    expected = fp8_block_scale_shape(*weight.shape, block)
    if tuple(scale.shape) != expected:
        raise MoepackError(f"FP8 scale shape {list(scale.shape)} does not match weight {list(weight.shape)} "
                           f"in {block}x{block} blocks (expected {list(expected)})")


def fp8_block_dequantize(weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK,
                         dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode an FP8 weight and its block scales to `dtype` (float32 or bfloat16) [out, in]. bfloat16 gives the
    float32 values rounded, as .to(torch.bfloat16) would (they are exact unless the scale pushes them out of range).
    `out`: a contiguous tensor of the weight's shape and `dtype` to decode into (the result is then `out`)."""
    if weight.ndim != 2:
        raise MoepackError(f"FP8 weight must be 2-D, got shape {list(weight.shape)}")
    rows, cols = weight.shape
    _check_scale_shape(weight, scale, block)
    scale_bytes = _e8m0_bytes(scale)
    kernels = _fp8_native() if weight.device.type == "cpu" else None
    if kernels is not None and dtype == torch.float32:  # an E8M0 scale is a float32: one product per weight
        return _fp8_float_scaled(kernels, weight, _e8m0_to_float(scale), block, dtype, out)
    # one lookup per element: (scale byte << 8 | weight byte) -> the scaled value (torch's FP8 -> float conversion
    # is scalar on CPUs; the 256 KiB table stays in cache)
    table = _fp8_scaled_table(weight.device, dtype)
    if kernels is not None and dtype.itemsize == 2:  # 16-bit tables are compiled; others: torch
        out = _output(out, weight, dtype)
        codes, scales = weight.view(torch.uint8).contiguous(), scale_bytes.contiguous()  # alive through the call
        kernels.lookup16(codes.data_ptr(), scales.data_ptr(), rows, cols, block, scale.shape[1], table.data_ptr(),
                         out.data_ptr())
        return out
    values = _fp8_lookup_torch(weight, scale_bytes, block, table)
    return values if out is None else _output(out, weight, dtype).copy_(values)


FLOAT_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)



def fp8_float_block_dequantize(weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK,
                               dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_block_dequantize under float block scales, as other releases store them (Qwen3's `-FP8`:
    `weight_scale_inv`, BF16 or F32, not a power of two): each value times its block's scale in float32 (then
    rounded to `dtype`). `out` as for fp8_block_dequantize."""
    if weight.ndim != 2 or scale.dtype not in FLOAT_SCALE_DTYPES:
        raise MoepackError(f"FP8 float block scales must be float32, bfloat16 or float16 beside a 2-D weight, got "
                           f"{scale.dtype} beside shape {list(weight.shape)}")
    kernels = _fp8_native() if weight.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) else None
    if kernels is not None:
        _check_scale_shape(weight, scale, block)
        return _fp8_float_scaled(kernels, weight, scale.float(), block, dtype, out)
    # 2^0, made where the weight is (a host tensor copied to a GPU would make the host wait at every decode)
    unit = torch.full(tuple(scale.shape), 127, dtype=torch.uint8, device=weight.device).view(torch.float8_e8m0fnu)
    values = fp8_block_dequantize(weight, unit, block)  # (it checks the scales' shape)
    cols = weight.shape[1]
    per_column = scale.float().repeat_interleave(block, dim=1)[:, :cols]
    full = weight.shape[0] // block  # every whole block row at once (a launch per block row: many for stacked experts)
    values[:full * block].view(full, block, cols).mul_(per_column[:full, None, :])
    values[full * block:].mul_(per_column[full:])
    values = values if dtype == torch.float32 else values.to(dtype)
    return values if out is None else _output(out, weight, dtype).copy_(values)


def _fp8_lookup_torch(weight: torch.Tensor, scale_bytes: torch.Tensor, block: int, table: torch.Tensor) -> torch.Tensor:
    rows, cols = weight.shape
    index = weight.view(torch.uint8).to(torch.int32)
    scale_per_column = (scale_bytes.to(torch.int32) << 8).repeat_interleave(block, dim=1)[:, :cols]
    full = rows // block
    index[: full * block].view(full, block, cols).add_(scale_per_column[:full, None, :])
    index[full * block:].add_(scale_per_column[full:])
    return torch.index_select(table, 0, index.view(-1)).view(rows, cols)


_FP8_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _fp8_scaled_table(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[65536] `dtype`: e4m3 byte (index & 255) times E8M0 scale byte (index >> 8), as float32 arithmetic gives it
    (then rounded to `dtype`)."""
    if (device, dtype) not in _FP8_TABLES:
        codes = torch.arange(256, dtype=torch.uint8)
        scales = _e8m0_to_float(codes.view(torch.float8_e8m0fnu))
        values = codes.view(torch.float8_e4m3fn).float()[None, :] * scales[:, None]
        _FP8_TABLES[device, dtype] = values.reshape(-1).to(dtype).to(device)
    return _FP8_TABLES[device, dtype]


# The same decode as compiled loops (native/fp8_decode.c): one pass, no index tensor. `lookup16`: the lookup into a
# 16-bit table (bfloat16: 32 weights per step where the CPU has AVX-512 BW); `float_scaled`: one float32 product per
# weight under float32 block scales, float32 or bfloat16 out (16 weights per step with AVX-512, no table).
_FP8_NATIVE_SOURCE = native.read_source("fp8_decode.c")


class Fp8Kernels(NamedTuple):
    lookup16: Callable
    float_scaled: Callable


def _output(out: torch.Tensor | None, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where a compiled decode of `weight` writes: `out` (checked: a kernel writes through its pointer), else a
    new tensor."""
    if out is None:
        return torch.empty(weight.shape, dtype=dtype)
    if out.shape != weight.shape or out.dtype != dtype or not out.is_contiguous() or out.device.type != "cpu":
        raise MoepackError(f"FP8 decode: out must be a contiguous CPU {dtype} tensor of shape {list(weight.shape)}, "
                           f"got {out.dtype} {list(out.shape)} on {out.device}")
    return out


def _fp8_float_scaled(kernels: Fp8Kernels, weight: torch.Tensor, scale: torch.Tensor, block: int,
                      dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.float_scaled on a CPU weight [rows, cols] and its float32 block scales (shape checked by the
    caller): float32 or bfloat16 [rows, cols], in `out` if given."""
    rows, cols = weight.shape
    out = _output(out, weight, dtype)
    codes, scales = weight.view(torch.uint8).contiguous(), scale.contiguous()  # alive through the call
    unit = _fp8_scaled_table(torch.device("cpu"))[127 << 8:128 << 8]  # the codes' values (scale byte 127: 2^0)
    kernels.float_scaled(codes.data_ptr(), scales.data_ptr(), rows, cols, block, scale.shape[1], unit.data_ptr(),
                         dtype.itemsize, out.data_ptr())
    return out


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (infinities and signed zeros too), any NaN equal to any NaN (its payload is the conversion's
    own)."""
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    nan = a.isnan()
    return (torch.equal(nan, b.isnan())
            and torch.equal(a.masked_fill(nan, 0).view(bits), b.masked_fill(nan, 0).view(bits)))


def _load_fp8_native() -> Fp8Kernels | None:
    """The compiled FP8 decoders, or None without a compiler or when they disagree with torch's arithmetic."""
    lib = native.native_library("moepack_fp8_decode", _FP8_NATIVE_SOURCE)
    if lib is None:
        return None
    wide = ("fp8_block_decode16_avx512" if native.c_function(lib, "fp8_avx512_supported", ())()
            else "fp8_block_decode16")
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    kernels = Fp8Kernels(
        native.c_function(lib, wide, (p, p, i64, i64, i64, i64, p, p), restype=None),
        native.c_function(lib, "fp8_float_block_decode", (p, p, i64, i64, i64, i64, p, i64, p), restype=None))
    # self-check: random weight bytes under random scale bytes, in blocks of 64 (whole 32-wide AVX-512 steps) and
    # of 48 (a step and a scalar tail, steps starting off a multiple of 32), with partial blocks at the edges; float
    # scales of every magnitude (over 2^119 too: the vector loop's other product)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randint(0, 256, (300, 200), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    for block in (64, 48):
        scale = torch.randint(0, 256, fp8_block_scale_shape(300, 200, block), dtype=torch.uint8, generator=gen)
        floats = _e8m0_to_float(scale.view(torch.float8_e8m0fnu)) * torch.rand(scale.shape, generator=gen)
        table = _fp8_scaled_table(torch.device("cpu"), torch.bfloat16)
        looked_up = torch.empty(300, 200, dtype=torch.bfloat16)
        kernels.lookup16(weight.view(torch.uint8).data_ptr(), scale.data_ptr(), 300, 200, block, scale.shape[1],
                         table.data_ptr(), looked_up.data_ptr())
        if not _same_values(looked_up, _fp8_lookup_torch(weight, scale, block, table)):
            warnings.warn("moepack: the compiled FP8 decoder disagrees with torch; using torch")
            return None
        products = weight.float() * floats.repeat_interleave(block, 0).repeat_interleave(block, 1)[:300, :200]
        for dtype in (torch.bfloat16, torch.float32):
            if not _same_values(_fp8_float_scaled(kernels, weight, floats, block, dtype), products.to(dtype)):
                warnings.warn("moepack: the compiled FP8 decoder disagrees with torch; using torch")
                return None
    return kernels


_fp8_native = native.LazyKernel(_load_fp8_native)


def fp8_decoder_compiled() -> bool:
    """Whether FP8 decodes on a CPU take the compiled loop (no index tensor) rather than torch's ops."""
    return bool(_fp8_native())


# ---------------------------------------------------------------------------------------------------------
# Packed FP4 e2m1 with one E8M0 scale per 32 inputs
# ---------------------------------------------------------------------------------------------------------


def _e2m1_magnitude_codes(magnitude: torch.Tensor) -> torch.Tensor:
    """Code (0..7, int32) of the e2m1 magnitude nearest to each float32 `magnitude` in [0, 6], ties to even.

    Works on the float's bits rather than searching the grid: it is a handful of int32 passes, which matters
    when a synthetic checkpoint encodes billions of expert weights. At or above 1, e2m1 is a float with one
    mantissa bit, so rounding the float32 mantissa to one bit (round-to-nearest-even: add 0x1FFFFF plus the
    kept bit) leaves exponent and mantissa bit in bits 31..22, and code = (biased_exp << 1 | m) - 252
    (1.0 = 127 << 1 -> code 2). Below 1, e2m1 is subnormal in steps of 0.5: code = round_half_even(2 * m).
    """
    bits = magnitude.view(torch.int32)
    kept_bit = (bits >> 22) & 1
    normal_code = ((bits + kept_bit + 0x1FFFFF) >> 22) - 252
    subnormal_code = torch.round(magnitude * 2).to(torch.int32)
    return torch.where(magnitude < 1.0, subnormal_code, normal_code)


def fp4_quantize(w: torch.Tensor, group: int = FP4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode a float weight [..., in] as (int8 [..., in/2] packed e2m1, float8_e8m0fnu [..., in/group])."""
    if w.ndim < 1 or not w.is_floating_point():
        raise MoepackError(f"FP4 quantization needs a float weight, got {w.dtype} of shape {list(w.shape)}")
    inputs = w.shape[-1]
    if inputs % group:
        raise MoepackError(
            f"FP4 quantization needs the last dimension ({inputs}) to be a multiple of its group of {group}"
        )
    groups = w.float().reshape(*w.shape[:-1], inputs // group, group)
    amax = groups.abs().amax(dim=-1)
    exponent = _ue8m0_exponent(amax, FP4_E2M1_MAX)
    scaled = groups * torch.ldexp(torch.ones_like(amax), -exponent)[..., None]
    magnitude_code = _e2m1_magnitude_codes(scaled.abs().clamp_(max=FP4_E2M1_MAX))
    # Zeros stay +0 (code 0) whatever their sign, so every zero has one encoding.
    negative = (scaled < 0) & (magnitude_code > 0)
    codes = (magnitude_code | (negative.to(torch.int32) << 3)).to(torch.uint8)
    codes = codes.reshape(*w.shape[:-1], inputs)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # element 2i low nibble, 2i+1 high nibble
    return packed.view(torch.int8).contiguous(), _exponent_to_e8m0(exponent)


def fp4_unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """The e2m1 codes (uint8, 0..15) of a packed tensor, [..., in/2] -> [..., in]."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise MoepackError(f"packed FP4 must be int8 or uint8, got {packed.dtype}")
    as_bytes = packed.view(torch.uint8)
    low, high = as_bytes & 0x0F, as_bytes >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def byte_pair_table(dtype: torch.dtype) -> torch.Tensor:
    """For every byte b: the two e2m1 values (low nibble, high nibble) in `dtype`, packed into one integer whose
    bytes are those two values, so decoding is one gather per byte (a table lookup, no per-nibble arithmetic)."""
    pairs = torch.stack([E2M1_VALUES.repeat(16), E2M1_VALUES.repeat_interleave(16)], dim=1).to(dtype)
    return pairs.contiguous().view(torch.int64 if dtype.itemsize == 4 else torch.int32).reshape(256)


_PAIR_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
FP4_INDEX_CHUNK = 1 << 26  # stored bytes per lookup (512 MiB of int64 indices)


def fp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, group: int = FP4_GROUP,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode packed e2m1 [..., in/2] with E8M0 scales [..., in/group] to `dtype` [..., in] (float32 or bfloat16;
    both are exact: e2m1 values times powers of two)."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise MoepackError(f"packed FP4 must be int8 or uint8, got {packed.dtype}")
    inputs = packed.shape[-1] * 2
    expected = (*packed.shape[:-1], inputs // group)
    if inputs % group or tuple(scale.shape) != expected:
        raise MoepackError(
            f"FP4 scale shape {list(scale.shape)} does not match packed weight {list(packed.shape)} "
            f"({inputs} inputs in groups of {group}: expected {list(expected)})"
        )
    key = (dtype, packed.device)
    table = _PAIR_TABLES.get(key)
    if table is None:
        table = _PAIR_TABLES[key] = byte_pair_table(dtype).to(packed.device)
    codes = packed.reshape(-1).view(torch.uint8)
    # the int64 indices a chunk at a time, not 8 bytes per stored byte (a GPU decodes many experts at once)
    pairs = torch.empty(codes.numel(), dtype=table.dtype, device=codes.device)
    for first in range(0, codes.numel(), FP4_INDEX_CHUNK):
        chunk = slice(first, first + FP4_INDEX_CHUNK)
        torch.take(table, codes[chunk].to(torch.int64), out=pairs[chunk])
    values = pairs.view(dtype).view(*expected, group)
    values.mul_(_e8m0_to_float(scale).to(dtype)[..., None])
    return values.view(*packed.shape[:-1], inputs)
