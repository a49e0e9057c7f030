"""Byte compatibility of moepack's ggml block codecs with gguf-py (the reference implementation of the layouts).

* Q8_0 and MXFP4: our quantize output is byte-identical to gguf-py's quants.quantize (which is ggml's
  quantize_row_*_ref, bit for bit) on random and edge inputs, with both kernels of each (the compiled C one, where
  a C compiler is there, and the torch one).
* Every type: gguf-py's quants.dequantize of our bytes, and of arbitrary random bytes, equals ours exactly.
* NVFP4: our quantize equals ggml's reference algorithm (scale via ggml_fp32_to_ue4m3, nearest kvalue with
  ties to the lower index) written out in numpy on top of gguf-py's UE4M3 helpers.
"""

from __future__ import annotations

import platform
import warnings

import numpy as np
import pytest
import torch

from moepack.format_spec import codecs, quants

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GT  # noqa: E402

X86 = platform.machine().lower() in ("x86_64", "amd64")

# (qtype, kernel): Q8_0 and MXFP4 have a compiled C kernel besides their torch one
KERNELS = [("Q8_0", "compiled"), ("Q8_0", "torch"), ("MXFP4", "compiled"), ("MXFP4", "torch")]


def _use(qtype: str, kernel: str, monkeypatch) -> None:
    if kernel == "torch":
        monkeypatch.setattr(codecs.REGISTRY[qtype], "native_quantizer", None)
    elif codecs.REGISTRY[qtype].native_quantizer() is None:
        pytest.skip(f"no compiled {qtype} kernel here (no C compiler)")


def _gguf_quantize(x, t):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with np.errstate(all="ignore"):
            return gguf.quants.quantize(x, GT[t])


def _gguf_dequantize(q, t):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with np.errstate(all="ignore"):
            return gguf.quants.dequantize(q, GT[t])


def _f32(v):
    return np.asarray(v, dtype=np.float32)


def _edge_blocks() -> np.ndarray:
    """(n, 32) float32 blocks hitting the corner cases of Q8_0 and MXFP4 rounding and scaling."""
    rng = np.random.default_rng(7)
    rows = []
    rows.append(np.zeros(32))
    rows.append(-np.zeros(32))  # -0.0 everywhere
    for c in (1.0, -1.0, 0.5, 3.0, -7.0, 1e-3, 6.0, 12.0):
        rows.append(np.full(32, c))  # constant rows
    for s in (1e-30, 1e-36, 1e30, 1e37, 1e38):
        rows.append(rng.standard_normal(32) * s)  # tiny and huge scales
    rows.append(np.r_[3.0e38, -3.3e38, rng.standard_normal(30) * 1e38])  # near FLT_MAX
    z = np.zeros(32)
    z[5] = 1e-20
    rows.append(z)  # a single nonzero element
    # Q8_0 ties: amax 127 makes id exactly 1, so q = x; k + 0.5 must round away from zero
    ties = np.arange(-15.5, 16.0, 1.0)
    rows.append(np.r_[127.0, ties[:31]])
    rows.append(np.r_[-127.0, (ties[:31] * 4.0)])
    rows.append(np.r_[127.0, np.full(31, 0.49999997), ][:32])
    rows.append(np.r_[127.0, np.linspace(-126.5, 126.5, 31)])
    # FP4: exact e2m1 values, every midpoint, and the clamp region (t in [12, 16)), at several scales
    mags = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    for k in (-20, -3, 0, 1, 7, 40):
        sc = 2.0 ** k
        rows.append(np.r_[7.9, mags, -mags[1:], mids, -mids, 6.5, -7.0, 7.5, -6.25, 6.0][:32] * sc)
        rows.append(np.r_[6.0, mids, -mids, mags[1:], -mags[1:5]][:32] * sc)
        rows.append(np.r_[4.0, mags * 0.5, -mids * 0.5, mids * 0.5, -mags[:3] * 0.5][:32] * sc)
    # block maxima just below / at / just above powers of two (MXFP4 exponent via log2)
    for p in (-100, -10, -1, 0, 1, 2, 3, 20, 100, 126):
        base = np.float32(2.0 ** p)
        for amax in (np.nextafter(base, np.float32(0)), base, np.nextafter(base, np.float32(np.inf)),
                     np.float32(base * np.float32(1.5)), np.nextafter(np.float32(base * 2), np.float32(0))):
            r = rng.uniform(-1, 1, 32) * float(amax) * 0.9
            r[3] = -amax
            rows.append(r)
    # subnormal elements inside normal blocks, and signs next to zero
    r = rng.standard_normal(32)
    r[:8] = [1e-45, -1e-45, 1e-40, -3e-39, 1e-39, -0.0, 0.0, 5e-44]
    rows.append(r)
    rows.append(np.r_[1.0, rng.uniform(-0.13, 0.13, 31)])
    out = np.zeros((len(rows), 32))
    for i, r in enumerate(rows):
        r = np.asarray(r, dtype=np.float64)[:32]
        out[i, : r.size] = r  # short rows padded with zeros
    return out.astype(np.float32)


def _random_inputs():
    rng = np.random.default_rng(11)
    return {
        "gauss": rng.standard_normal((8, 4096)).astype(np.float32),
        "gauss_small": (rng.standard_normal((8, 2048)) * 0.02).astype(np.float32),
        "student_t3": rng.standard_t(3, (8, 2048)).astype(np.float32),
        "uniform_3d": rng.uniform(-5, 5, (2, 3, 1024)).astype(np.float32),
        "sparse": (rng.standard_normal((4, 1024)) * (rng.random((4, 1024)) < 0.1)).astype(np.float32),
        "zeros": np.zeros((2, 512), np.float32),
    }


@pytest.mark.parametrize("qtype, kernel", KERNELS)
@pytest.mark.parametrize("name", list(_random_inputs()))
def test_quantize_bytes_match_gguf_random(qtype, kernel, name, monkeypatch):
    _use(qtype, kernel, monkeypatch)
    x = _random_inputs()[name]
    ours = quants.quantize(x, qtype)
    ref = _gguf_quantize(x, qtype)
    assert ours.shape == ref.shape and ours.dtype == np.uint8
    assert np.array_equal(ours, ref)


@pytest.mark.parametrize("qtype, kernel", KERNELS)
def test_quantize_bytes_match_gguf_edges(qtype, kernel, monkeypatch):
    _use(qtype, kernel, monkeypatch)
    x = _edge_blocks()
    assert np.isfinite(x).all()
    assert np.array_equal(quants.quantize(x, qtype), _gguf_quantize(x, qtype))
    # the same blocks laid out as rows of 256 (several blocks per row)
    n = x.shape[0] // 8 * 8
    y = x[:n].reshape(-1, 256)
    assert np.array_equal(quants.quantize(y, qtype), _gguf_quantize(y, qtype))


@pytest.mark.skipif(not X86, reason="gguf-py's result here comes from a C float->int cast that differs by CPU")
@pytest.mark.parametrize("qtype, kernel", KERNELS)
def test_quantize_bytes_match_gguf_below_float_range(qtype, kernel, monkeypatch):
    # block maxima below 2^-121: Q8_0's 1/d overflows (gguf-py casts NaN -> 0), MXFP4's exponent wraps mod 256
    _use(qtype, kernel, monkeypatch)
    rng = np.random.default_rng(3)
    x = np.stack([rng.standard_normal(32) * s for s in (1e-37, 5e-38, 1e-38, 2e-39, 1e-41, 1e-44)])
    x = x.astype(np.float32)
    assert np.array_equal(quants.quantize(x, qtype), _gguf_quantize(x, qtype))


@pytest.mark.parametrize("kernel", ["compiled", "torch"])
def test_q8_0_rounding_of_every_product_near_a_half_matches_gguf(kernel, monkeypatch):
    # amax 127 makes id exactly 1, so q = x: every float within 64 ulps of each k + 0.5 (k < 127), both signs,
    # over several chunks (the compiled kernel's thread pool)
    _use("Q8_0", kernel, monkeypatch)
    halves = np.arange(0, 127, dtype=np.float32) + np.float32(0.5)
    near = (halves.view(np.int32)[:, None] + np.arange(-64, 65, dtype=np.int32)[None, :]).view(np.float32)
    near = np.concatenate([near.reshape(-1), -near.reshape(-1)])
    near = np.resize(near, (near.size // 31 + 1) * 31).reshape(-1, 31)
    x = np.concatenate([np.full((near.shape[0], 1), 127.0, np.float32), near], 1)
    x = np.tile(x, (40, 1)).reshape(-1, 256)  # ~1.3M elements: more than one compiled-kernel chunk
    assert np.array_equal(quants.quantize(x, "Q8_0"), _gguf_quantize(x, "Q8_0"))


@pytest.mark.parametrize("kernel", ["compiled", "torch"])
def test_mxfp4_block_maxima_near_powers_of_two_match_gguf(kernel, monkeypatch):
    # ggml's exponent is floor(log2f(amax)): a maximum a few ulps below 2^n may round up to n. Every float within
    # 64 ulps of every power of two from 2^-120 (below that, gguf-py's cast of a negative exponent differs by CPU)
    _use("MXFP4", kernel, monkeypatch)
    bits = ((np.arange(-120, 128)[:, None] + 127) << 23) + np.arange(-64, 65)[None, :]
    amax = bits[bits < 0x7F800000].astype(np.uint32).view(np.float32)
    x = amax[:, None] * np.linspace(-1.0, 1.0, 32, dtype=np.float32)[None, :]  # ends: -amax, amax
    assert np.array_equal(quants.quantize(x, "MXFP4"), _gguf_quantize(x, "MXFP4"))


def test_mxfp4_exponent_rounding_matches_float32_log2():
    # every float within 64 ulps of every power of two: floor(log2f(amax)) as numpy computes it
    bits = ((np.arange(-126, 128)[:, None] + 127) << 23) + np.arange(-64, 65)[None, :]
    bits = bits[(bits > 0) & (bits < 0x7F800000)].astype(np.uint32)
    amax = bits.view(np.float32)
    with np.errstate(all="ignore"):
        ref = (np.floor(np.log2(amax)) - 2 + 127).astype(np.int64) & 255
    from moepack.format_spec.quant_fp4 import mxfp4_exponent

    ours = mxfp4_exponent(torch.from_numpy(amax)).numpy()
    assert np.array_equal(ours, ref)


ALL = list(quants.QTYPES)


@pytest.mark.parametrize("qtype", ALL)
def test_gguf_dequantizes_our_bytes_like_us(qtype):
    xs = dict(_random_inputs())
    edge = _edge_blocks()
    n = edge.shape[0] // 8 * 8
    xs["edges"] = edge[:n].reshape(-1, 256)
    if qtype in ("Q2_K", "IQ2_XXS"):
        xs = {k: v for k, v in xs.items() if k in ("gauss_small", "student_t3", "edges", "zeros", "sparse")}
    for name, x in xs.items():
        q = quants.quantize(x, qtype)
        ours = quants.dequantize(q, qtype, x.shape)
        ref = _gguf_dequantize(q, qtype)
        assert ours.dtype == np.float32 and ours.shape == x.shape
        np.testing.assert_array_equal(ours, ref, err_msg=f"{qtype} {name}")


@pytest.mark.parametrize("qtype", ALL)
def test_dequantize_arbitrary_bytes_like_gguf(qtype):
    # random blocks reach every code, sign pattern, grid point and scale byte (f16 inf/NaN scales included)
    be, bb = quants.block_layout(qtype)
    rng = np.random.default_rng(5)
    q = rng.integers(0, 256, (64, 4 * bb), dtype=np.uint8)
    ours = quants.dequantize(q, qtype, (64, 4 * be))
    ref = _gguf_dequantize(q, qtype)
    np.testing.assert_array_equal(ours, ref)


def test_mxfp4_dequantizes_every_exponent_like_gguf():
    # one block per scale byte, the huge ones (2^(e-127) overflows at 255) and the subnormal ones included
    rng = np.random.default_rng(6)
    blocks = np.concatenate([np.arange(256, dtype=np.uint8)[:, None],
                             rng.integers(0, 256, (256, 16), dtype=np.uint8)], 1)
    np.testing.assert_array_equal(quants.dequantize(blocks, "MXFP4", (256, 32)), _gguf_dequantize(blocks, "MXFP4"))


def _nvfp4_ggml_reference(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_nvfp4_ref in numpy: UE4M3 scale of amax/6, nearest kvalue (first index on ties)."""
    from gguf.quants import NVFP4

    sub = x.reshape(-1, 16).astype(np.float32)
    amax = np.abs(sub).max(1)
    ue = NVFP4.fp32_to_ue4m3(amax / np.float32(6.0)).astype(np.uint8)
    d = NVFP4.ue4m3_to_fp32(ue).astype(np.float32)
    kv = np.array(NVFP4.kvalues, dtype=np.float32)
    err = np.abs(d[:, None, None] * kv[None, None, :] - sub[:, :, None])
    codes = err.argmin(-1).astype(np.uint8)
    qs = codes[:, :8] | (codes[:, 8:] << 4)
    nb = sub.shape[0] // 4
    return np.concatenate([ue.reshape(nb, 4), qs.reshape(nb, 32)], 1).reshape(*x.shape[:-1], -1)


def test_nvfp4_quantize_matches_ggml_algorithm():
    rng = np.random.default_rng(9)
    for x in (rng.standard_normal((4, 1024)).astype(np.float32),
              rng.standard_t(3, (4, 1024)).astype(np.float32),
              (rng.standard_normal((4, 1024)) * 1e-3).astype(np.float32),
              (rng.standard_normal((4, 1024)) * 1e4).astype(np.float32)):
        assert np.array_equal(quants.quantize(x, "NVFP4"), _nvfp4_ggml_reference(x))


def test_fp4_repack_decodes_like_gguf():
    from moepack.format_spec.quants import fp4_to_mxfp4

    rng = np.random.default_rng(2)
    packed = rng.integers(-128, 128, (6, 64), dtype=np.int8)
    scale = rng.integers(0, 255, (6, 4), dtype=np.uint8)
    blocks = fp4_to_mxfp4(packed, scale)
    np.testing.assert_array_equal(quants.dequantize(blocks, "MXFP4", (6, 128)), _gguf_dequantize(blocks, "MXFP4"))
