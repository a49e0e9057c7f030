"""IQ2_XXS: 256 elements -> 66 bytes (2.0625 bits per weight), ggml's block_iq2_xxs.

Layout: f16 d, then for each group of 32 two little-endian uint32: the first holds four 8-bit indices into
the 256-point grid (one per 8 elements), the second four 7-bit sign fields (bits 7k..7k+6) and a 4-bit scale
ls (bits 28..31). Element i of sub-group k decodes as
    d * (0.5 + ls) * 0.25 * grid[index_k][i] * (-1 if bit i of ksigns[sign_k] else +1),
where grid values are 8, 25 or 43 (points of the E8 lattice, shifted) and ksigns[s] = s with an eighth
sign bit making the number of minus signs even.

The quantizer follows the idea of ggml's quantize_row_iq2_xxs_impl (ggml-quants.c): pick the signs from the
data (flipping the least important element when a sub-group has an odd number of negatives), then search a
per-group scale and the grid points, then code the group scales in 4 bits against a super-block f16 scale.
It differs in what it optimises, vectorised for all groups at once: it scores every one of the 256 grid
points exactly (two matmuls give, per sub-group, the weighted <x, g> and <w, g^2> for all points, so the
squared error at any scale S is S^2 <w, g^2> - 2 S <w x, g> + <w, x^2>) against the grid's real values
8/25/43 (ggml rounds to the ideal 1:3:5 lattice and repairs off-grid points through a neighbour table);
it judges 9 candidate scales per group by that error, refits the best by least squares for its points;
chooses the super-block scale among 9 candidates with each group's 4-bit code picked by its exact quadratic
error; and re-picks the grid points for the final coded scales (ggml keeps the points chosen before the scale
was rounded). Without an importance vector the error is plain squared error; ggml's own quantizer refuses to
run without an importance matrix.
"""

from __future__ import annotations

import numpy as np
import torch

from .quant_common import F16_MAX, check_finite, f16_scales, on_device

QK = 256
BYTES = 66

# The iq2xxs grid: 256 points of 8 coordinates, each 0x08, 0x19 or 0x2b (8, 25, 43). Stored as in gguf-py's
# quants.py: per point two bytes (hex) holding eight 2-bit fields, coordinate i in bits 2i..2i+1 of the
# little-endian 16-bit value, with 0 -> 8, 1 -> 25, 2 -> 43. (Data table of ggml-common.h's iq2xxs_grid.)
GRID_MAP = (0x08, 0x19, 0x2B)
GRID_HEX = (
    "00000200050008000a00110014002000220028002a0041004400500058006100"
    "6400800082008a00a20001010401100115014001840198010002020222028202"
    "010404041004210424044004420448046004810484049004a404000502050805"
    "200546056905800591050906100640068406a406000805080808140828084108"
    "440850085208880804094009020a140a01100410101021104010601084109010"
    "951000110811201150115a118011241245120014081420142514491480141815"
    "6215001616160118041810184018811800190519a019511a002002200a204420"
    "6120802082202921482100220222012404241024402456240025412564259026"
    "082820289428442a014004401040184021402440404048405640604081408440"
    "9040004120416141804185410142104248425642684200440844204480449944"
    "124524450046014804481048404845480049584961498249454a904a00500850"
    "1150195020508050885004514251a4519152905492540a550156545600581158"
    "195864584059085a046010604060686000615561186260620064056410651265"
    "84654268008002800a8041808280048118814081118201840484108415844084"
    "608400854685948509864086608602880489118a0490109024904090a1901691"
    "8091459200942294449451958198209902a050a085a009a100a218a450a804a9"
)


def _grid() -> np.ndarray:
    words = np.frombuffer(bytes.fromhex(GRID_HEX), dtype="<u2").astype(np.int64)
    fields = (words[:, None] >> (2 * np.arange(8))[None, :]) & 3
    return np.array(GRID_MAP, dtype=np.float32)[fields]  # (256, 8)


def _ksigns() -> np.ndarray:
    # ksigns_iq2xs: the 7 stored sign bits plus an 8th that makes the count of set bits even
    s = np.arange(128)
    parity = np.array([bin(v).count("1") & 1 for v in s])
    return (s | (parity << 7)).astype(np.uint8)


GRID = torch.from_numpy(_grid())  # (256, 8) float32
KSIGNS = torch.from_numpy(_ksigns())  # (128,) uint8
KMASK = tuple(1 << i for i in range(8))


def _signed_grid() -> torch.Tensor:
    # (256 * 128, 8): grid point g with sign field s at row g * 128 + s, signs applied
    bits = ((KSIGNS.long().view(128, 1) >> torch.arange(8).view(1, 8)) & 1).float()
    sign = 1.0 - 2.0 * bits  # (128, 8)
    return (GRID.view(256, 1, 8) * sign.view(1, 128, 8)).reshape(256 * 128, 8).contiguous()


SIGNED_GRID = _signed_grid()
SIGNED_GRID_I64 = SIGNED_GRID.view(torch.int64)  # (32768, 4)


# scale candidates: the largest grid value 43 * S placed at these fractions of the group's max |x|
_CAND = torch.linspace(0.6, 1.05, 6)
_DCAND = torch.tensor([1.0, 0.985, 0.97, 0.955, 0.94, 0.925, 0.91, 0.895, 0.88])
# the bit positions of a group's words: its four grid bytes, its four 7-bit sign fields (on a GPU through on_device)
_BYTE_SHIFTS = torch.tensor([0, 8, 16, 24])
_SIGN_SHIFTS = torch.tensor([0, 7, 14, 21])
_SIGN_SHIFTS_I32 = _SIGN_SHIFTS.to(torch.int32)


def _scores(S, A, B2, n_sub, out=None):
    """S*A_k - 2*B_k for every sub-group and grid point (the squared error at group scale S, less |x|^2, over S).
    S: (G,); A: (256,) or (G*n_sub, 256); B2 = -2B: (G*n_sub, 256)."""
    Ss = S.repeat_interleave(n_sub).unsqueeze(1)
    return torch.addcmul(B2, Ss, A if A.dim() == 2 else A.unsqueeze(0), out=out)


def _assign(S, A, B2, n_sub, out=None):
    """Best grid point per sub-group for group scales S."""
    return _scores(S, A, B2, n_sub, out).min(1)[1]


def _refit(idx, A, B, C, G, n_sub):
    """Least-squares group scale for the chosen points and its error: S = sum B / sum A, err = C - (sum B)^2/sum A."""
    a = A[idx] if A.dim() == 1 else A.gather(1, idx.unsqueeze(1)).squeeze(1)
    b = B.gather(1, idx.unsqueeze(1)).squeeze(1)
    sa = a.view(G, n_sub).sum(1)
    sb = b.view(G, n_sub).sum(1)
    ok = sa > 0
    S = torch.where(ok, sb / torch.where(ok, sa, torch.ones_like(sa)), torch.zeros_like(sa)).clamp_(min=0.0)
    err = C - 2 * S * sb + S * S * sa
    return S, err, sa, sb


def quantize_chunk(x: torch.Tensor, out: torch.Tensor, weights: torch.Tensor | None = None) -> None:
    """x: float32 (nsb, 256); out: uint8 (nsb, 66); weights: optional (nsb, 256) importance."""
    nsb = x.shape[0]
    dev = x.device
    block_amax = x.abs().amax(1, keepdim=True)
    check_finite(block_amax)
    G = nsb * 8  # groups of 32
    n_sub = 4
    xs = x.reshape(G * n_sub, 8)
    ws = None if weights is None else weights.reshape(G * n_sub, 8)
    grid = on_device(GRID, dev)

    # signs: the stored pattern must have an even number of minus signs; for an odd sub-group flip the
    # element that costs least to get wrong (smallest w*x^2), whose target then becomes -|x|.
    neg = xs < 0
    odd = (neg.sum(1) & 1).bool()
    cost = xs * xs if ws is None else ws * xs * xs
    flip = torch.zeros_like(neg)
    flip.scatter_(1, cost.argmin(1, keepdim=True), odd.unsqueeze(1))
    neg ^= flip
    xa = xs.abs()
    xa = torch.where(flip, -xa, xa)
    sign_field = (neg[:, :7].to(torch.int64) << torch.arange(7, device=dev)).sum(1)

    # per sub-group statistics against all 256 points: B_k = sum w x g_k, A_k = sum w g_k^2, C = sum w x^2
    wx = xa if ws is None else ws * xa
    B = wx @ grid.t()  # (G*4, 256)
    A = (grid * grid).sum(1) if ws is None else ws @ (grid * grid).t()
    C = (wx * xa).sum(1).view(G, n_sub).sum(1)
    B2 = B * -2.0
    buf = torch.empty_like(B2)

    amax = xa.view(G, 32).amax(1)
    amean = xa.view(G, 32).mean(1).clamp_(min=0.0)
    # candidate scales, judged by their error with the best points for each (no index needed: amin): the
    # largest grid value 43*S at fractions of the group's max |x|, and, for flat groups (where the max says
    # little), the grid values 8 / 14 / 25 at its mean |x|
    best_S = torch.zeros(G, device=dev)
    best_err = C.clone()  # S = 0
    cands = [amax * (f / 43.0) for f in _CAND.tolist()] + [amean / g for g in (8.0, 14.0, 25.0)]
    for S in cands:
        err = C + S * _scores(S, A, B2, n_sub, buf).amin(1).view(G, n_sub).sum(1)
        better = err < best_err
        best_S = torch.where(better, S, best_S)
        best_err = torch.where(better, err, best_err)
    # one Lloyd step: the points for the best scale, then the least-squares scale for those points
    idx = _assign(best_S, A, B2, n_sub, buf)
    S, _, _, _ = _refit(idx, A, B, C, G, n_sub)
    idx = _assign(S, A, B2, n_sub, buf)
    _, _, sa, sb = _refit(idx, A, B, C, G, n_sub)

    # super-block scale d (f16) and 4-bit codes: group scale = d/8 * (2l + 1), l in 0..15
    S8 = S.view(nsb, 8)
    sa8, sb8 = sa.view(nsb, 8, 1), sb.view(nsb, 8, 1)
    d = S8.amax(1, keepdim=True) * (8.0 / 31.0) / on_device(_DCAND, dev).view(1, -1)
    # (nsb, nd) candidates, as stored; infinite for a block beyond the largest value any d decodes (d * 15.5/4 * 43)
    d = f16_scales(d, block_amax > F16_MAX * 15.5 / 4 * 43)

    def codes_for(d):
        # d: (nsb, nd) -> best l (nsb, 8, nd) by the quadratic error and its total
        unit = d.unsqueeze(1) / 8.0  # (nsb, 1, nd)
        safe = torch.where(unit > 0, unit, torch.ones_like(unit))
        l0 = torch.floor((S8.unsqueeze(2) / safe - 1.0) * 0.5).clamp_(0, 15)
        best_l = best_e = None
        for off in (0.0, 1.0):
            l = (l0 + off).clamp_(max=15)
            Sq = unit * (2 * l + 1)
            e = Sq * Sq * sa8 - 2 * Sq * sb8
            if best_e is None:
                best_l, best_e = l, e
            else:
                better = e < best_e
                best_l = torch.where(better, l, best_l)
                best_e = torch.where(better, e, best_e)
        return best_l, best_e

    l, e = codes_for(d)
    k = e.sum(1).argmin(1, keepdim=True)  # (nsb, 1)
    d = d.gather(1, k)
    l = l.gather(2, k.unsqueeze(1).expand(nsb, 8, 1)).squeeze(2)
    Sq = (d / 8.0 * (2 * l + 1)).reshape(G)
    idx = _assign(Sq, A, B2, n_sub, buf)
    # with the final points, re-choose each group's code (d fixed) and the points once more
    _, _, sa, sb = _refit(idx, A, B, C, G, n_sub)
    sa8, sb8 = sa.view(nsb, 8, 1), sb.view(nsb, 8, 1)
    S8 = torch.where(sa > 0, sb / torch.where(sa > 0, sa, torch.ones_like(sa)), torch.zeros_like(sa)).view(nsb, 8)
    l, _ = codes_for(d)
    l = l.squeeze(2)
    Sq = (d / 8.0 * (2 * l + 1)).reshape(G)
    idx = _assign(Sq, A, B2, n_sub, buf)

    # pack: per group words (idx0 | idx1<<8 | idx2<<16 | idx3<<24, s0 | s1<<7 | s2<<14 | s3<<21 | l<<28)
    idx4 = idx.view(G, n_sub)
    sg4 = sign_field.view(G, n_sub)
    w0 = (idx4 << on_device(_BYTE_SHIFTS, dev)).sum(1)
    w1 = (sg4 << on_device(_SIGN_SHIFTS, dev)).sum(1) | (l.reshape(G).to(torch.int64) << 28)
    words = torch.stack((w0, w1), 1)  # (G, 2) int64 holding uint32 values
    le = (words.unsqueeze(2) >> on_device(_BYTE_SHIFTS, dev)) & 255
    out[:, 2:].copy_(le.to(torch.uint8).view(nsb, 64))
    out[:, :2].copy_(d.half().view(torch.uint8).view(nsb, 2))


def dequantize_chunk(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """blocks: uint8 (nsb, 66); out: float32 (nsb, 256). Same products as ggml: d*(0.5+ls)*0.25 * (±grid)."""
    nsb = blocks.shape[0]
    dev = blocks.device
    d = blocks[:, :2].contiguous().view(torch.float16).float()  # (nsb, 1)
    # a copy: for one block, .contiguous() would keep the 2-byte offset and the 66-byte row stride int32 cannot view
    words = blocks[:, 2:].clone(memory_format=torch.contiguous_format).view(torch.int32).view(nsb, 8, 2)
    w1 = words[:, :, 1]
    ls = ((w1 >> 28) & 15).float()
    db = (d * (ls + 0.5)) * 0.25  # (nsb, 8)
    gidx = blocks[:, 2:].reshape(nsb, 8, 8)[:, :, :4].long()  # grid index bytes of each group
    sidx = (w1.unsqueeze(2) >> on_device(_SIGN_SHIFTS_I32, dev)) & 127
    rows = (gidx * 128 + sidx.long()).reshape(-1)
    # rows of 8 floats gathered as rows of 4 int64 (same bytes): torch's float index_select is ~6x slower here
    vals = torch.index_select(on_device(SIGNED_GRID_I64, dev), 0, rows).view(torch.float32)  # (nsb*32, 8)
    o = out.view(nsb, 8, 32)
    o.copy_(vals.view(nsb, 8, 32))
    o.mul_(db.unsqueeze(2))
