"""The e2m1 (FP4) block types of ggml, and the lossless repack of the release's packed FP4 into MXFP4.

MXFP4 (ggml block_mxfp4): 32 elements -> 17 bytes: one E8M0 exponent byte e, then 16 bytes; byte j holds
element j in its low nibble and element j+16 in its high nibble. ggml decodes element i as
kvalues[code] * e8m0_to_fp32_half(e), with kvalues = 2 x e2m1 = (0 1 2 3 4 6 8 12, then the negatives) and
e8m0_to_fp32_half(e) = 2^(e-128); the product is e2m1(code) * 2^(e-127), the OCP MX value. So the exponent
byte of an MXFP4 block *is* the E8M0 scale byte of the OCP/DeepSeek layout, with no constant factor
(e = 0 gives 2^-127 via ggml's subnormal table; e = 255, NaN in OCP, decodes as 2^128 x e2m1 in ggml).

NVFP4 (ggml block_nvfp4): 64 elements -> 36 bytes: four UE4M3 scale bytes, one per 16 elements, then 32 bytes;
sub-block s owns bytes 8s..8s+7, byte j holding its element j (low nibble) and j+8 (high nibble).

Quantizers follow ggml's quantize_row_mxfp4_ref / quantize_row_nvfp4_ref: the scale from the block's max |x|,
then each element to the nearest representable value, a tie going to the smaller magnitude (ggml scans the
candidates in order and keeps the first minimum). For MXFP4 the element/scale ratio is exact (a power of two),
so the codes are ggml's bit for bit; for NVFP4 it is a correctly rounded division, which can only differ from
ggml's exact comparison when an element sits within a rounding error of a decision boundary (both codes are
then equally good). MXFP4 also has a C kernel doing the same computation in one pass per block
(native/mxfp4_quantize.c, compiled once per machine into a cache when a C compiler is there, checked against the
torch kernel when it loads; see quant_common).
"""

from __future__ import annotations

import numpy as np
import torch

from moepack import native

from .errors import MoepackError
from .quant_common import NONFINITE_INPUT, as_float_tensor, check_finite, compiled_quantizer, on_device, scalar
from .source_formats import byte_pair_table

MX_BLOCK, MX_BYTES = 32, 17
NV_BLOCK, NV_BYTES, NV_SUB = 64, 36, 16

# Codes from t = |x| / d (d = ggml's halved scale, so t is in units of the doubled kvalues 0 1 2 3 4 6 8 12).
# The decision boundaries (midpoints, a tie going to the smaller magnitude) are 0.5 1.5 2.5 3.5 5 7 10: all
# halves of integers, so with n = ceil(2t) (exact: 2t is exact) the code is the count of 2*boundary < n,
# i.e. min(n >> 1, 4) + [n > 10] + [n > 14] + [n > 20], all in uint8 arithmetic (torch's comparison ops,
# which write bool, run at a fifth of the speed of byte arithmetic).


def _e8m0_half_table() -> torch.Tensor:
    # ggml_e8m0_to_fp32_half: 2^(e-128); e < 2 as the subnormals 2^-128, 2^-127.
    e = np.arange(256, dtype=np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32)
    return torch.from_numpy(bits.view(np.float32).copy())


def _ue4m3_half_table() -> torch.Tensor:
    # ggml_ue4m3_to_fp32 (already halved for the doubled kvalues): 0 and 0x7F decode to 0.
    x = np.arange(256)
    exp = (x >> 3) & 0xF
    man = (x & 7).astype(np.float64)
    raw = np.where(exp == 0, man * 2.0 ** -9, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    raw = np.where((x == 0) | (x == 0x7F), 0.0, raw * 0.5)
    return torch.from_numpy(raw.astype(np.float32))


E8M0_HALF = _e8m0_half_table()
UE4M3_HALF = _ue4m3_half_table()


# int64 [256]: byte b's two e2m1 values (b & 15, b >> 4), doubled as ggml's kvalues are, as float32s packed into one
# integer: a byte decodes in one gather
E2M1_PAIRS_DOUBLED = (byte_pair_table(torch.float32).view(torch.float32) * 2.0).view(torch.int64)


def _codes(t2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """t2 = 2|x|/d (float32, overwritten), x the signed values -> e2m1 codes (uint8): the magnitude index, plus
    8 for a negative element with a nonzero magnitude (ggml never picks -0)."""
    n = t2.ceil_().to(torch.uint8)  # 0 .. 32
    h = n >> 1
    code = h.clamp_max(4)
    code += n.clamp(10, 11)
    code += n.clamp(14, 15)
    code += n.clamp(20, 21)
    code -= 44
    # the float's top byte (little-endian) carries its sign bit: 0x80 -> 8 for a negative (or -0.0) element
    sign = (x.view(torch.uint8).view(*x.shape, 4)[..., 3] >> 4) & 8
    sign &= h.clamp_max_(1) << 3  # ... with a nonzero code (n >= 2)
    code |= sign
    return code


# --------------------------------------------------------------------------------------------------- MXFP4

def mxfp4_exponent(amax: torch.Tensor) -> torch.Tensor:
    """ggml's exponent byte for a block max: floor(log2(amax)) - 2 + 127, as uint8 arithmetic (wrapping like the
    C cast does for the blocks below 2^-125), 0 for an all-zero block. log2 is taken in float64 and rounded to
    float32, which reproduces a correctly rounded log2f (numpy's and glibc's) also for maxima just below a
    power of two, where a float32 log2 rounds up to the integer."""
    lg = torch.floor(torch.log2(amax.double()).float())
    e = torch.where(amax > 0, lg + 125.0, torch.zeros_like(lg)).to(torch.int32)
    return e & 255


def mxfp4_quantize_chunk(x: torch.Tensor, out: torch.Tensor) -> None:
    """x: float32 (nb, 32); out: uint8 (nb, 17)."""
    nb = x.shape[0]
    a = x.abs()
    amax = a.amax(1)
    check_finite(amax)
    e = mxfp4_exponent(amax)
    # t2 = 2|x| / d exactly: d = 2^(e-128), so 2/d = 2^(129-e), a float32 for 2 <= e <= 255 (biased exponent
    # 256 - e; e = 255 gives 2^-126). e = 0, 1 would need 2^129, 2^128: use 2^127 and scale t2 afterwards.
    inv_bits = (256 - e).clamp_(max=254) << 23
    t2 = torch.mul(a.view(nb, 2, 16), inv_bits.view(torch.float32).view(nb, 1, 1), out=a.view(nb, 2, 16)).view(nb, 32)
    low = (e < 2) & (amax > 0)
    if bool(low.any()):
        t2[low] *= (2.0 ** (2 - e[low].float())).view(-1, 1)
    code = _codes(t2, x)
    out[:, 0].copy_(e)
    torch.bitwise_or(code[:, :16], code[:, 16:] << 4, out=out[:, 1:])


# mxfp4_quantize_chunk in C (native/mxfp4_quantize.c): 16 blocks at a time, so that the compiler vectorises each step.
_MXFP4_C_SOURCE = native.read_source("mxfp4_quantize.c")


def _mxfp4_self_check_blocks() -> torch.Tensor:
    """Blocks where MXFP4's exponent and codes are delicate: every scale from subnormal to huge, maxima just
    below, at and above powers of two, the e2m1 values and every midpoint between them, zeros of both signs."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(2, MX_BLOCK, generator=g) * 2.0 ** k for k in range(-140, 128, 7)]
    near = torch.tensor([-4097, -4096, -64, -45, -44, -43, -1, 0, 1])
    bits = ((torch.arange(-126, 128) + 127) << 23)[:, None] + near[None, :]
    amax = bits[(bits > 0) & (bits < 0x7F800000)].to(torch.int32).view(torch.float32)
    rows.append(torch.cat([amax[:, None], amax[:, None] * torch.linspace(-0.99, 0.99, MX_BLOCK - 1)], 1))
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    grid = torch.cat([torch.tensor([6.0]), mags, -mags[1:], mids, -mids, torch.tensor([-0.0, 5.9])])  # 32
    rows.append(torch.stack([grid * 2.0 ** k for k in (-130, -126, -20, 0, 7, 100)]))
    return torch.cat(rows).float().contiguous()


def _load_native_mxfp4():
    return compiled_quantizer("MXFP4", _MXFP4_C_SOURCE, "mxfp4_quantize", mxfp4_quantize_chunk,
                              _mxfp4_self_check_blocks(), MX_BYTES)


# The C kernel as a chunk kernel like mxfp4_quantize_chunk, or None; built on first use.
native_mxfp4_quantize_chunk = native.LazyKernel(_load_native_mxfp4)


def _e2m1_f16_bits(q16: torch.Tensor, hi: bool) -> torch.Tensor:
    """Nibbles of q16 (bytes widened to int16) -> int16 bit patterns of IEEE halves equal to e2m1(code) * 2^-14
    exactly: the nibble is shifted to bits 12..15 and arithmetically back by 3, leaving its sign on bit 15
    and its 3-bit magnitude (2 exponent bits, 1 mantissa bit) on the half's low exponent bits and top mantissa
    bit (so e2m1's subnormal 0.5 becomes the half subnormal 2^-15)."""
    return ((q16 << (8 if hi else 12)) >> 3) & -29184  # 0x8E00 as int16


def mxfp4_dequantize_chunk(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """blocks: uint8 (nb, 17); out: float32 (nb, 32). ggml's kvalues[code] * 2^(e-128) in ggml's own order, so bit
    for bit for every exponent (2^(e-127) itself overflows at e = 255): nothing asks the host which path to take,
    which would stall a GPU once per chunk."""
    nb = blocks.shape[0]
    # one gather: each byte's two doubled values, elements j and j+16 of the block
    pairs = torch.take(on_device(E2M1_PAIRS_DOUBLED, blocks.device), blocks[:, 1:].reshape(-1).long())
    out.view(nb, 2, 16).copy_(pairs.view(torch.float32).view(nb, 16, 2).transpose(1, 2))
    out.mul_(on_device(E8M0_HALF, blocks.device)[blocks[:, 0].long()].view(nb, 1))  # 2^(e-128)


# --------------------------------------------------------------------------------------------------- NVFP4

def fp32_to_ue4m3(x: torch.Tensor) -> torch.Tensor:
    """ggml_fp32_to_ue4m3, vectorised: float32 -> UE4M3 byte (int32). 0 for x <= 0 or NaN; x clamped to 448;
    normals keep 3 mantissa bits rounded half up (a carry may bump the exponent), saturating at 0x7E;
    below 2^-6 the subnormal code int(x * 512 + 0.5) clamped to 0..7."""
    x = torch.where(x > 0, x, torch.zeros_like(x)).clamp_max_(448.0)
    bits = x.view(torch.int32)
    exp0 = ((bits >> 23) & 0xFF) - 120  # fp32 exponent + 7
    man = ((bits >> 20) & 7) + ((bits >> 19) & 1)
    carry = (man > 7).to(torch.int32)
    exp = exp0 + carry
    man = man * (1 - carry)
    normal = torch.where(exp >= 15, torch.full_like(exp, 0x7E), (exp << 3) | man)
    sub = (x * 512.0 + 0.5).to(torch.int32).clamp_(0, 7)
    ue = torch.where(exp0 <= 0, sub, normal)
    return torch.where(x > 0, ue, torch.zeros_like(ue))


def nvfp4_quantize_chunk(x: torch.Tensor, out: torch.Tensor) -> None:
    """x: float32 (nb, 64); out: uint8 (nb, 36)."""
    nb = x.shape[0]
    xs = x.view(nb * 4, NV_SUB)
    a = xs.abs()
    amax = a.amax(1)
    check_finite(amax)
    ue = fp32_to_ue4m3(torch.div(amax, scalar(6.0, amax)))
    d = on_device(UE4M3_HALF, x.device)[ue.long()]
    # a zero scale (ue 0) decodes every code to 0: divide by inf so all codes are 0
    d = torch.where(d > 0, d * 0.5, torch.full_like(d, float("inf")))  # t2 = |x| / (d/2) = 2|x|/d
    # a scale saturated at 448 leaves elements far beyond the top value 6*d: clamp before the uint8 cast
    t2 = a.div_(d.view(-1, 1)).clamp_max_(32.0)
    code = _codes(t2, xs)
    out[:, :4].copy_(ue.view(nb, 4))
    code = code.view(nb, 4, NV_SUB)
    torch.bitwise_or(code[..., :8], code[..., 8:] << 4, out=out[:, 4:].view(nb, 4, 8))


def nvfp4_dequantize_chunk(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """blocks: uint8 (nb, 36); out: float32 (nb, 64). Equal to ggml's kvalues[code] * ue4m3_half(s)."""
    nb = blocks.shape[0]
    q16 = blocks[:, 4:].to(torch.int16).view(nb * 4, 8)
    o = out.view(nb * 4, NV_SUB)
    o[:, :8].copy_(_e2m1_f16_bits(q16, False).view(torch.float16))
    o[:, 8:].copy_(_e2m1_f16_bits(q16, True).view(torch.float16))
    # e2m1 * 2^-14 * (2^15 * ue4m3_half) = kvalue * ue4m3_half; ue4m3_half <= 224, so no overflow.
    scale = on_device(UE4M3_HALF, blocks.device)[blocks[:, :4].reshape(-1).long()] * 32768.0
    o.mul_(scale.view(-1, 1))


# ------------------------------------------------------------------------------- release FP4 <-> MXFP4

def _as_torch_bytes(x, what: str) -> tuple[torch.Tensor, bool]:
    if isinstance(x, torch.Tensor):
        if x.dtype not in (torch.uint8, torch.int8, torch.float8_e8m0fnu):
            raise MoepackError(f"{what} must be uint8/int8 (or float8_e8m0fnu for scales), got {x.dtype}")
        return x.detach().contiguous().view(torch.uint8), True
    if isinstance(x, np.ndarray):
        if x.dtype not in (np.uint8, np.int8):
            raise MoepackError(f"{what} must be uint8/int8, got {x.dtype}")
        return torch.from_numpy(np.ascontiguousarray(x).view(np.uint8)), False
    raise MoepackError(f"{what} must be a numpy array or a torch tensor, got {type(x).__name__}")


def fp4_to_mxfp4(packed, scale_e8m0):
    """Lossless repack of the release's routed-expert FP4 into ggml MXFP4 blocks.

    packed: int8/uint8 [..., in/2], element 2i in the low nibble of byte i and 2i+1 in the high nibble;
    scale_e8m0: uint8 or float8_e8m0fnu [..., in/32], one E8M0 byte per 32 inputs. Returns uint8
    [..., in/32 * 17] (numpy in -> numpy out, torch in -> torch out on the same device): the same 4-bit
    codes and the same exponent bytes, only the nibbles reordered, so dequantize(result, "MXFP4") equals
    e2m1(code) * 2^(e-127) exactly (a -0 code decodes as +0.0).
    """
    p, is_torch = _as_torch_bytes(packed, "packed FP4")
    s, _ = _as_torch_bytes(scale_e8m0, "E8M0 scale")
    if p.dim() == 0 or p.shape[-1] % 16:
        raise MoepackError(f"packed FP4 last dimension {p.shape[-1] if p.dim() else None} is not a multiple of 16")
    lead = tuple(p.shape[:-1])
    nblk = p.shape[-1] // 16
    if tuple(s.shape) != lead + (nblk,):
        raise MoepackError(f"E8M0 scale shape {list(s.shape)} doesn't match packed FP4 {list(p.shape)} "
                           f"(expected {list(lead + (nblk,))})")
    if s.device != p.device:
        s = s.to(p.device)
    pb = p.reshape(-1, 16)
    nb = pb.shape[0]
    # element order 0..31 within the block: codes[:, 2i] = low nibble of byte i, codes[:, 2i+1] = high nibble
    codes = torch.stack((pb & 0x0F, pb >> 4), dim=2).reshape(nb, 32)
    out = torch.empty((nb, MX_BYTES), dtype=torch.uint8, device=p.device)
    out[:, 0] = s.reshape(-1)
    torch.bitwise_or(codes[:, :16], codes[:, 16:] << 4, out=out[:, 1:])
    out = out.reshape(lead + (nblk * MX_BYTES,))
    return out if is_torch else out.numpy()


def mxfp4_to_fp4(blocks, shape=None):
    """Inverse of fp4_to_mxfp4: MXFP4 blocks uint8 [..., n*17] -> (packed uint8 [..., n*16] with element 2i in
    the low nibble, E8M0 scale uint8 [..., n]). With shape (the logical [..., in]) the bytes may be flat."""
    b, is_torch = _as_torch_bytes(blocks, "MXFP4 blocks")
    if shape is not None:
        shape = tuple(int(v) for v in shape)
        if not shape or shape[-1] % MX_BLOCK:
            raise MoepackError(f"can't store shape {list(shape)} as MXFP4 (last dimension must be a multiple of 32)")
        need = int(np.prod(shape)) // MX_BLOCK * MX_BYTES
        if b.numel() != need:
            raise MoepackError(f"MXFP4{list(shape)} needs {need} bytes, got {b.numel()}")
        b = b.reshape(shape[:-1] + (shape[-1] // MX_BLOCK * MX_BYTES,))
    if b.dim() == 0 or b.shape[-1] % MX_BYTES:
        raise MoepackError(f"MXFP4 row of {b.shape[-1] if b.dim() else 0} bytes is not a whole number of 17-byte blocks")
    lead = tuple(b.shape[:-1])
    nblk = b.shape[-1] // MX_BYTES
    bb = b.reshape(-1, MX_BYTES)
    qs = bb[:, 1:]
    codes = torch.cat((qs & 0x0F, qs >> 4), dim=1)  # element order 0..31
    pairs = codes.view(-1, 16, 2)
    packed = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(lead + (nblk * 16,))
    scale = bb[:, 0].reshape(lead + (nblk,)).clone()
    if is_torch:
        return packed, scale
    return packed.numpy(), scale.numpy()


# The largest NVFP4 sub-block scale ggml keeps as computed: ggml_fp32_to_ue4m3 turns every scale that rounds to
# 2^8 or more into its saturation code 448 (0x7E), so 240 = 1.875 * 2^7 is the top of its exact range.
NVFP4_TOP_SCALE = 240.0


def nvfp4_tensor_exponent(x) -> int:
    """Power-of-two prescale k for NVFP4 (ggml's layout has no per-tensor scale, unlike NVIDIA's): quantizing
    x * 2^k puts the tensor's largest 16-element block at the top of the UE4M3 scales ggml codes exactly (240),
    so small blocks keep normal (3-bit mantissa) scales. Weights of std ~0.005 lose ~30% accuracy without it, and
    blocks below ~2^-10 * 6 decode to zero. Whoever applies it must store 2^-k (an exact power of two) with the
    tensor and multiply it back in: nvfp4_prescale does both halves for a container. 0 for an all-zero tensor."""
    xt = as_float_tensor(x, "input")
    amax = float(xt.abs().max()) if xt.numel() else 0.0
    if not np.isfinite(amax):
        raise MoepackError(NONFINITE_INPUT)
    if amax == 0.0:
        return 0
    # largest k with amax * 2^k / 6 <= NVFP4_TOP_SCALE
    k = int(np.floor(np.log2(NVFP4_TOP_SCALE * 6.0 / amax)))
    while amax * 2.0 ** k / 6.0 > NVFP4_TOP_SCALE:
        k -= 1
    return k


def nvfp4_prescale(x) -> tuple[torch.Tensor, int]:
    """(x * 2^-e as float32 on x's device, e): the values to quantize to NVFP4 and the exponent of the tensor
    scale 2^e stored beside the blocks (SPEC.md section 6.1), so that dequantize(blocks) * 2^e approximates x
    at any magnitude. e = -nvfp4_tensor_exponent(x), kept where 2^e is a normal float32 (-126 <= e <= 127)."""
    xt = as_float_tensor(x, "input").float()
    e = min(max(-nvfp4_tensor_exponent(xt), -126), 127)
    return (xt * 2.0 ** -e if e else xt), e
