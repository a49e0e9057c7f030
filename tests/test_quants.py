"""moepack's ggml block codecs: API, error bounds, torch/numpy agreement, the lossless FP4 <-> MXFP4 repack,
bad inputs, and the precision policies. (Byte compatibility with gguf-py: test_quant_gguf_compat.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moepack
from moepack import native
from moepack import MoepackError
from moepack.format_spec import codecs, policies, quant_q8_0, quants
from moepack.format_spec.quants import fp4_to_mxfp4, mxfp4_to_fp4

QTYPES = list(quants.QTYPES)


def _data():
    rng = np.random.default_rng(1234)
    return {"gauss": rng.standard_normal((32, 4096)).astype(np.float32),
            "t3": rng.standard_t(3, (32, 4096)).astype(np.float32)}


DATA = _data()


def _rel_rmse(y, x, w=None):
    w = 1.0 if w is None else w
    return float(np.sqrt((w * (y - x) ** 2).sum() / (w * x ** 2).sum()))


# Relative RMSE on DATA (seed 1234, 32 x 4096): the documented figures (docs/quantization.md), and ggml's own
# reference quantizer on the same arrays (quantize_row_q2_K_ref; quantize_iq2_xxs with an all-ones importance,
# as ggml refuses IQ2_XXS without one), measured by building ggml-quants.c from ggml-org/ggml.
DOCUMENTED = {
    ("gauss", "Q8_0"): 0.00533, ("gauss", "MXFP4"): 0.11468, ("gauss", "NVFP4"): 0.09476,
    ("gauss", "Q2_K"): 0.2646, ("gauss", "IQ2_XXS"): 0.3272,
    ("t3", "Q8_0"): 0.00827, ("t3", "MXFP4"): 0.14316, ("t3", "NVFP4"): 0.09136,
    ("t3", "Q2_K"): 0.2948, ("t3", "IQ2_XXS"): 0.4081,
}
GGML_REFERENCE = {("gauss", "Q2_K"): 0.29649, ("gauss", "IQ2_XXS"): 0.34353,
                  ("t3", "Q2_K"): 0.35190, ("t3", "IQ2_XXS"): 0.48203}


@pytest.fixture(scope="module")
def quantized():
    return {(d, t): quants.quantize(x, t) for d, x in DATA.items() for t in QTYPES}


@pytest.mark.parametrize("dist", list(DATA))
@pytest.mark.parametrize("qtype", QTYPES)
def test_error_bounds(quantized, dist, qtype):
    x = DATA[dist]
    q = quantized[(dist, qtype)]
    be, bb = quants.block_layout(qtype)
    assert q.shape == (32, 4096 // be * bb) and q.dtype == np.uint8
    err = _rel_rmse(quants.dequantize(q, qtype, x.shape), x)
    assert err <= DOCUMENTED[(dist, qtype)] * 1.01, err
    if (dist, qtype) in GGML_REFERENCE:
        assert err < GGML_REFERENCE[(dist, qtype)], err


@pytest.mark.parametrize("qtype", ["Q2_K", "IQ2_XXS"])
def test_importance_weighting_lowers_weighted_error(qtype):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 2048)).astype(np.float32)
    imp = np.exp(rng.standard_normal(2048) * 1.5).astype(np.float32)
    plain = quants.dequantize(quants.quantize(x, qtype), qtype, x.shape)
    weighted = quants.dequantize(quants.quantize(x, qtype, importance=imp), qtype, x.shape)
    assert _rel_rmse(weighted, x, imp) < 0.93 * _rel_rmse(plain, x, imp)
    # uniform importance is the plain path
    uni = quants.quantize(x, qtype, importance=np.full(2048, 3.0, np.float32))
    assert np.array_equal(uni, quants.quantize(x, qtype))


def test_importance_ignored_by_round_to_nearest_types():
    x = DATA["gauss"][:2]
    imp = np.linspace(0.1, 5, 4096).astype(np.float32)
    for t in ("Q8_0", "MXFP4", "NVFP4"):
        assert np.array_equal(quants.quantize(x, t, importance=imp), quants.quantize(x, t))


def test_nvfp4_tensor_prescale():
    x = (DATA["gauss"][:8] * 0.005).astype(np.float32)
    k = quants.nvfp4_tensor_exponent(x)
    # the largest block's scale lands at the top of what ggml's UE4M3 keeps exactly (it codes >= 2^8 as 448)
    assert np.abs(x * 2.0 ** k).max() / 6 <= 240 < np.abs(x * 2.0 ** (k + 1)).max() / 6
    plain = quants.dequantize(quants.quantize(x, "NVFP4"), "NVFP4", x.shape)
    scaled = quants.dequantize(quants.quantize(x * np.float32(2.0 ** k), "NVFP4"), "NVFP4", x.shape) * 2.0 ** -k
    assert _rel_rmse(scaled, x) < 0.1 < 0.13 < _rel_rmse(plain, x)
    assert quants.nvfp4_tensor_exponent(np.zeros((2, 64), np.float32)) == 0


@pytest.mark.parametrize("std", [1e3, 1.0, 0.02, 1e-4, 1e-8])
def test_nvfp4_prescale_gives_the_same_accuracy_at_any_magnitude(std):
    x = DATA["gauss"][:8] * np.float32(std)
    values, e = quants.nvfp4_prescale(x)
    assert values.dtype == torch.float32 and torch.equal(values, torch.from_numpy(x) * 2.0 ** -e)
    y = quants.dequantize(quants.quantize(values, "NVFP4"), "NVFP4", x.shape) * np.float32(2.0 ** e)
    assert _rel_rmse(y, x) <= DOCUMENTED[("gauss", "NVFP4")] * 1.01


def test_nvfp4_prescale_keeps_the_tensor_scale_a_normal_float32():
    # a tensor far below float32's normal range would need 2^e < 2^-126: e stops there
    x = np.full((1, 64), 1e-40, np.float32)
    values, e = quants.nvfp4_prescale(x)
    assert e == -126 and float(values.max()) == pytest.approx(1e-40 * 2.0 ** 126, rel=1e-3)
    assert quants.nvfp4_prescale(np.zeros((1, 64), np.float32))[1] == 0


def test_top_level_reexport():
    x = DATA["gauss"][:1]
    assert np.array_equal(moepack.quantize(x, "Q8_0"), quants.quantize(x, "Q8_0"))
    assert moepack.dequantize is quants.dequantize


@pytest.mark.parametrize("qtype", QTYPES)
def test_torch_and_numpy_agree(qtype):
    x = DATA["t3"][:4]
    q_np = quants.quantize(x, qtype)
    q_t = quants.quantize_torch(torch.from_numpy(x), qtype)
    assert isinstance(q_t, torch.Tensor) and q_t.dtype == torch.uint8
    assert np.array_equal(q_t.numpy(), q_np)
    y_np = quants.dequantize(q_np, qtype, x.shape)
    y_t = quants.dequantize_torch(q_t, qtype, x.shape)
    assert y_t.dtype == torch.float32 and tuple(y_t.shape) == x.shape
    assert np.array_equal(y_t.numpy(), y_np)
    # bytes-like input and a bf16 output
    assert np.array_equal(quants.dequantize(q_np.tobytes(), qtype, x.shape), y_np)
    y_bf = quants.dequantize_torch(q_t, qtype, x.shape, dtype=torch.bfloat16)
    assert y_bf.dtype == torch.bfloat16 and torch.equal(y_bf, y_t.to(torch.bfloat16))


def test_out_buffers():
    x = torch.from_numpy(DATA["t3"][:4].copy())
    for qtype in QTYPES:
        q = quants.quantize_torch(x, qtype)
        qb = torch.empty(q.numel(), dtype=torch.uint8)
        assert quants.quantize_torch(x, qtype, out=qb).data_ptr() == qb.data_ptr()
        assert torch.equal(qb.view(q.shape), q)
        buf = torch.full((4 * 4096,), 7.0)
        y = quants.dequantize_torch(q, qtype, x.shape, out=buf)
        assert y.data_ptr() == buf.data_ptr() and tuple(y.shape) == tuple(x.shape)
        assert torch.equal(y, quants.dequantize_torch(q, qtype, x.shape))
    q = quants.quantize_torch(x, "Q8_0")
    for bad in (torch.empty(4 * 4096 - 1), torch.empty(4 * 4096, dtype=torch.float16),
                torch.empty(8, 4096)[::2], np.empty(4 * 4096, np.float32)):
        with pytest.raises(MoepackError):
            quants.dequantize_torch(q, "Q8_0", x.shape, out=bad)
    with pytest.raises(MoepackError):
        quants.quantize_torch(x, "Q8_0", out=torch.empty(5, dtype=torch.uint8))


@pytest.mark.parametrize("qtype", QTYPES)
def test_input_dtypes_and_shapes(qtype):
    x = torch.from_numpy(DATA["gauss"][:6, :1024].copy())
    xb = x.to(torch.bfloat16)
    assert torch.equal(quants.quantize_torch(xb, qtype), quants.quantize_torch(xb.float(), qtype))
    assert np.array_equal(quants.quantize(x.double().numpy(), qtype), quants.quantize(x.numpy(), qtype))
    # leading dims are kept; a non-contiguous view quantizes like its copy
    x3 = x.reshape(2, 3, 1024)
    q3 = quants.quantize(x3, qtype)
    assert q3.shape[:2] == (2, 3)
    assert np.array_equal(q3.reshape(6, -1), quants.quantize(x, qtype))
    xt = torch.from_numpy(DATA["gauss"][:, :192].reshape(1024, 6).copy()).t()
    assert np.array_equal(quants.quantize(xt, qtype), quants.quantize(xt.contiguous(), qtype))
    # empty tensors
    be, _ = quants.block_layout(qtype)
    e = quants.quantize(np.zeros((0, be), np.float32), qtype)
    assert e.shape == (0, quants.block_layout(qtype)[1])
    assert quants.dequantize(e, qtype, (0, be)).shape == (0, be)


@pytest.mark.parametrize("qtype", QTYPES)
def test_zero_and_constant_tensors(qtype):
    be, _ = quants.block_layout(qtype)
    z = np.zeros((2, 2 * be), np.float32)
    assert np.array_equal(quants.dequantize(quants.quantize(z, qtype), qtype, z.shape), z)
    c = np.full((2, 2 * be), -0.75, np.float32)
    y = quants.dequantize(quants.quantize(c, qtype), qtype, c.shape)
    assert np.abs(y - c).max() <= 0.05 * 0.75


def test_chunk_boundaries_do_not_matter():
    # a tensor spanning many chunks quantizes like its rows quantized one by one
    rng = np.random.default_rng(8)
    for qtype in QTYPES:
        x = rng.standard_normal((70, 2048 if qtype in ("Q2_K", "IQ2_XXS") else 8192)).astype(np.float32)
        whole = quants.quantize(x, qtype)
        parts = np.concatenate([quants.quantize(x[i:i + 23], qtype) for i in range(0, 70, 23)])
        assert np.array_equal(whole, parts), qtype


def test_small_chunks_and_thread_modes(monkeypatch):
    # many chunks exercise the driver's single-/multi-threaded probing (of the torch kernels); results and
    # torch's thread count must not depend on it
    for t in QTYPES:
        monkeypatch.setattr(codecs.REGISTRY[t], "native_quantizer", None)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((16, 4096)).astype(np.float32)
    ref = {t: quants.quantize(x, t) for t in ("Q8_0", "MXFP4", "Q2_K")}
    deq = {t: quants.dequantize(ref[t], t, x.shape) for t in ref}
    threads = torch.get_num_threads()
    for t in ref:
        monkeypatch.setattr(codecs.REGISTRY[t], "quantize_elems", 1024)
        monkeypatch.setattr(codecs.REGISTRY[t], "dequantize_elems", 1024)
        assert np.array_equal(quants.quantize(x, t), ref[t])
        assert np.array_equal(quants.dequantize(ref[t], t, x.shape), deq[t])
        assert torch.get_num_threads() == threads
    torch.set_num_threads(1)
    try:
        assert np.array_equal(quants.quantize(x, "Q8_0"), ref["Q8_0"])
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------- compiled kernels

def _compiled(qtype: str) -> None:
    if codecs.REGISTRY[qtype].native_quantizer() is None:
        pytest.skip(f"no compiled {qtype} kernel here: {quants.native_kernels()[qtype].get('reason')}")


@pytest.mark.parametrize("qtype", ["Q8_0", "MXFP4"])
def test_compiled_kernel_over_many_chunks_and_threads_matches_the_torch_kernel(monkeypatch, qtype):
    # chunks of 1024 elements on the thread pool, against the torch kernel: the same bytes, threads restored
    _compiled(qtype)
    codec = codecs.REGISTRY[qtype]
    x = np.random.default_rng(13).standard_normal((16, 4096)).astype(np.float32)
    with monkeypatch.context() as m:
        m.setattr(codec, "native_quantizer", None)
        ref = quants.quantize(x, qtype)
    monkeypatch.setattr(codec, "native_elems", 1024)
    threads = torch.get_num_threads()
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        try:
            assert np.array_equal(quants.quantize(x, qtype), ref)
            assert torch.get_num_threads() == n
            # bfloat16 and strided inputs go through the same kernel
            assert np.array_equal(quants.quantize(torch.from_numpy(x).bfloat16(), qtype),
                                  quants.quantize(torch.from_numpy(x).bfloat16().float(), qtype))
            wide = np.concatenate([x.reshape(-1, 32), np.ones_like(x.reshape(-1, 32))], 1)
            assert np.array_equal(quants.quantize(torch.from_numpy(wide)[:, :32], qtype).reshape(ref.shape), ref)
        finally:
            torch.set_num_threads(threads)
    bad = x.copy()
    bad[9, 4000] = np.inf
    with pytest.raises(MoepackError, match="inf or NaN"):
        quants.quantize(bad, qtype)


def test_compiled_kernel_reports_its_build():
    _compiled("Q8_0")
    build = quants.native_kernels()["Q8_0"]
    assert build["compiled"] and build["seconds"] < 60 and "-ffp-contract=off" in build["flags"]


def test_no_compiler_or_a_failing_one_means_no_compiled_kernel(monkeypatch):
    monkeypatch.setenv("MOEPACK_NATIVE", "0")
    assert native.build("t", "int f(void) { return 0; }")["library"] is None
    monkeypatch.delenv("MOEPACK_NATIVE")
    monkeypatch.setattr(native.loader.shutil, "which", lambda name: None)
    build = native.build("t", "int f(void) { return 0; }")
    assert build["library"] is None and "no C compiler" in build["reason"]
    monkeypatch.undo()
    if native.c_compiler() is None:
        pytest.skip("no C compiler here")
    build = native.build("t", "this is not C")
    assert build["library"] is None and "failed" in build["reason"]


def test_compiled_kernel_that_disagrees_with_torch_is_not_used(monkeypatch):
    _compiled("Q8_0")
    monkeypatch.setattr(native.loader, "_native", {})
    # rounding with 0.5 itself sends 0.49999997 to 1: the self-check must catch it
    broken = quant_q8_0._C_SOURCE.replace("#define HALF_DOWN 0.49999997f", "#define HALF_DOWN 0.5f")
    assert broken != quant_q8_0._C_SOURCE
    monkeypatch.setattr(quant_q8_0, "_C_SOURCE", broken)
    with pytest.warns(RuntimeWarning, match="not using the compiled Q8_0 kernel"):
        assert quant_q8_0._load_native() is None
    assert quants.native_kernels()["Q8_0"]["compiled"] is False


# ------------------------------------------------------------------------------------------ FP4 -> MXFP4

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _release_fp4_values(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The release's decoding, written independently: code 2i low nibble, 2i+1 high; value e2m1 * 2^(e-127)."""
    p = packed.view(np.uint8)
    codes = np.stack([p & 15, p >> 4], -1).reshape(*p.shape[:-1], -1)
    exp = np.repeat(scale.astype(np.float64) - 127.0, 32, axis=-1)
    with np.errstate(over="ignore"):  # 6 * 2^127 is inf in float32, as in ggml
        return (E2M1[codes] * np.exp2(exp)).astype(np.float32)


def test_fp4_to_mxfp4_is_lossless_bit_identity():
    rng = np.random.default_rng(21)
    packed = rng.integers(-128, 128, (12, 3, 256), dtype=np.int8)  # [..., in/2], in = 512
    scale = rng.integers(0, 255, (12, 3, 16), dtype=np.uint8)  # one E8M0 per 32 inputs; 255 (NaN) excluded
    scale[0, 0, :4] = [0, 1, 127, 254]
    blocks = fp4_to_mxfp4(packed, scale)
    assert blocks.dtype == np.uint8 and blocks.shape == (12, 3, 16 * 17)
    # same exponents, same codes: the round trip is the identity on the bytes
    p2, s2 = mxfp4_to_fp4(blocks)
    assert np.array_equal(p2.view(np.int8), packed) and np.array_equal(s2, scale)
    p3, s3 = mxfp4_to_fp4(blocks.reshape(-1), shape=(12, 3, 512))
    assert np.array_equal(p3, p2) and np.array_equal(s3, s2)
    # and the decoded values are the release's codes[i] * 2^(e-127), exactly (with -0 read as +0)
    ours = quants.dequantize(blocks, "MXFP4", (12, 3, 512))
    assert np.array_equal(ours, _release_fp4_values(packed, scale))
    # MXFP4 blocks from our own quantizer go round the other way too
    q = quants.quantize(DATA["gauss"][:4], "MXFP4")
    assert np.array_equal(fp4_to_mxfp4(*mxfp4_to_fp4(q)), q)


def test_fp4_to_mxfp4_torch_and_e8m0_dtype():
    rng = np.random.default_rng(4)
    packed = torch.from_numpy(rng.integers(-128, 128, (5, 64), dtype=np.int8))
    scale = torch.from_numpy(rng.integers(100, 150, (5, 4), dtype=np.uint8))
    b = fp4_to_mxfp4(packed, scale.view(torch.float8_e8m0fnu))
    assert isinstance(b, torch.Tensor) and b.dtype == torch.uint8 and tuple(b.shape) == (5, 68)
    assert np.array_equal(b.numpy(), fp4_to_mxfp4(packed.numpy(), scale.numpy()))
    p, s = mxfp4_to_fp4(b)
    assert torch.equal(p.view(torch.int8), packed) and torch.equal(s, scale)


def test_fp4_repack_matches_source_formats_decoder():
    sf = pytest.importorskip("moepack.format_spec.source_formats")
    if not hasattr(sf, "fp4_dequantize"):
        pytest.skip("source_formats.fp4_dequantize not available")
    rng = np.random.default_rng(6)
    packed = torch.from_numpy(rng.integers(-128, 128, (4, 128), dtype=np.int8))
    scale = torch.from_numpy(rng.integers(90, 160, (4, 8), dtype=np.uint8)).view(torch.float8_e8m0fnu)
    ref = sf.fp4_dequantize(packed, scale).float()
    ours = quants.dequantize_torch(fp4_to_mxfp4(packed, scale), "MXFP4", (4, 256))
    assert torch.equal(ours, ref)


def test_fp4_repack_bad_shapes():
    with pytest.raises(MoepackError):
        fp4_to_mxfp4(np.zeros((2, 24), np.int8), np.zeros((2, 1), np.uint8))
    with pytest.raises(MoepackError):
        fp4_to_mxfp4(np.zeros((2, 32), np.int8), np.zeros((2, 3), np.uint8))
    with pytest.raises(MoepackError):
        fp4_to_mxfp4(np.zeros((2, 32), np.float32), np.zeros((2, 2), np.uint8))
    with pytest.raises(MoepackError):
        mxfp4_to_fp4(np.zeros((2, 20), np.uint8))
    with pytest.raises(MoepackError):
        mxfp4_to_fp4(np.zeros(34, np.uint8), shape=(2, 64))


# ------------------------------------------------------------------------------------------- bad inputs

def test_bad_inputs_raise_moepack_error():
    x = np.zeros((2, 64), np.float32)
    with pytest.raises(MoepackError, match="unknown quantization type"):
        quants.quantize(x, "Q4_0")
    with pytest.raises(MoepackError, match="multiple"):
        quants.quantize(np.zeros((2, 48), np.float32), "Q8_0")
    with pytest.raises(MoepackError, match="multiple"):
        quants.quantize(np.zeros((2, 32), np.float32), "NVFP4")
    with pytest.raises(MoepackError, match="multiple"):
        quants.quantize(np.zeros((2, 128), np.float32), "Q2_K")
    with pytest.raises(MoepackError):
        quants.quantize(np.zeros((2, 64), np.int32), "Q8_0")
    with pytest.raises(MoepackError):
        quants.quantize([1.0] * 32, "Q8_0")
    with pytest.raises(MoepackError):
        quants.quantize(np.float32(1.0), "Q8_0")
    for t in QTYPES:
        be, _ = quants.block_layout(t)
        bad = np.zeros((2, be), np.float32)
        bad[1, 3] = np.nan
        with pytest.raises(MoepackError, match="inf or NaN"):
            quants.quantize(bad, t)
        bad[1, 3] = np.inf
        with pytest.raises(MoepackError, match="inf or NaN"):
            quants.quantize(bad, t)
    q = quants.quantize(x, "Q8_0")
    with pytest.raises(MoepackError, match="needs 136 bytes"):
        quants.dequantize(q[:, :-1], "Q8_0", (2, 64))
    with pytest.raises(MoepackError):
        quants.dequantize(q, "Q8_0", (2, 96))
    with pytest.raises(MoepackError):
        quants.dequantize(q, "Q8_0", (2, 60))
    with pytest.raises(MoepackError):
        quants.dequantize(q.astype(np.float32), "Q8_0", (2, 64))
    with pytest.raises(MoepackError):
        quants.dequantize(q, "IQ1_S", (2, 64))
    y = np.zeros((2, 256), np.float32)
    with pytest.raises(MoepackError, match="importance"):
        quants.quantize(y, "Q2_K", importance=np.ones(128, np.float32))
    with pytest.raises(MoepackError, match="non-negative"):
        quants.quantize(y, "IQ2_XXS", importance=-np.ones(256, np.float32))


# --------------------------------------------------------------------------------------------- policies

def test_policies_table():
    assert set(policies.POLICY_NAMES) == {"fp4", "nvfp4", "q8", "q2", "bf16", "keep"}
    p = policies.policy("q2")
    assert p["name"] == "q2" and p["roles"]["routed_gate_up"] == "IQ2_XXS" and p["roles"]["routed_down"] == "Q2_K"
    assert abs(p["expert_bpw"] - (2 * 66 * 8 / 256 + 84 * 8 / 256) / 3) < 1e-9
    for name in policies.POLICY_NAMES:
        q = policies.policy(name)
        assert set(q["roles"]) == set(policies.ROLES) and q["roles"]["exact"] is None
        for t in q["roles"].values():
            assert t is None or t in ("BF16",) + tuple(quants.QTYPES)
        import json
        json.dumps(q)
    with pytest.raises(MoepackError):
        policies.policy("q3")


def test_target_type():
    tt = policies.target_type
    assert tt("fp4", "routed_gate_up", "FP4_E2M1") == "MXFP4"
    assert tt("fp4", "dense_linear", "F8_E4M3") == "Q8_0"
    assert tt("fp4", "exact", "F32") is None
    assert tt("nvfp4", "routed_down", "FP4_E2M1") == "NVFP4"
    assert tt("q8", "routed_down", "BF16") == "Q8_0"
    assert tt("q2", "routed_gate_up", "FP4_E2M1") == "IQ2_XXS"
    assert tt("q2", "routed_down", "FP4_E2M1") == "Q2_K"
    assert tt("q2", "embedding_head", "BF16") == "Q8_0"
    assert tt("keep", "routed_down", "FP4_E2M1") is None
    assert tt("bf16", "dense_linear", "F8_E4M3") == "BF16"
    assert tt("bf16", "routed_down", "FP4_E2M1") == "BF16"
    assert tt("bf16", "dense_linear", "F32") is None  # no lossy narrowing under bf16
    assert tt("q8", "dense_linear", "Q8_0") is None  # already the target
    # shapes the target's block doesn't divide: Q8_0 if it fits, else keep; 1-D never block-quantized
    assert tt("q2", "routed_down", "BF16", shape=(7168, 2048 + 32)) == "Q8_0"
    assert tt("q2", "routed_down", "BF16", shape=(7168, 2048)) == "Q2_K"
    assert tt("fp4", "dense_linear", "BF16", shape=(100, 17)) is None
    assert tt("fp4", "dense_linear", "BF16", shape=(4096,)) is None
    for bad in (("nope", "exact", "F32"), ("fp4", "router", "F32"), ("fp4", "exact", "F7")):
        with pytest.raises(MoepackError):
            tt(*bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("qtype", QTYPES)
def test_cuda_matches_cpu(qtype):
    x = torch.from_numpy(DATA["t3"][:8])
    q_cpu = quants.quantize_torch(x, qtype)
    q_gpu = quants.quantize_torch(x.cuda(), qtype)
    assert q_gpu.device.type == "cuda"
    y_gpu = quants.dequantize_torch(q_cpu.cuda(), qtype, x.shape)
    assert y_gpu.device.type == "cuda"
    assert torch.equal(y_gpu.cpu(), quants.dequantize_torch(q_cpu, qtype, x.shape))
    if qtype in ("Q8_0", "MXFP4", "NVFP4"):
        assert torch.equal(q_gpu.cpu(), q_cpu)
    else:  # searches may break near-ties differently on another device; quality is what must hold
        e_gpu = _rel_rmse(quants.dequantize(q_gpu.cpu(), qtype, x.shape), x.numpy())
        e_cpu = _rel_rmse(quants.dequantize(q_cpu, qtype, x.shape), x.numpy())
        assert e_gpu <= e_cpu * 1.01


@pytest.mark.parametrize("qtype", ["Q8_0", "MXFP4", "NVFP4", "Q2_K", "IQ2_XXS"])
def test_a_device_dequantization_copies_its_constants_there_once(qtype):
    """ggml blocks decoded on a GPU (the meta device stands in, whose values the host cannot read: nothing asks
    for them, as MXFP4's did for its exponents): the tables and shift constants go there on the first call, not on
    every call."""
    from host_copies import HostToDevice

    codec = codecs.block_codec(qtype)
    blocks = torch.zeros(2 * 256 // codec.block_elems * codec.block_bytes, dtype=torch.uint8, device="meta")
    quants.dequantize_torch(blocks, qtype, (2, 256))
    with HostToDevice() as later:
        values = quants.dequantize_torch(blocks, qtype, (2, 256))
    assert values.shape == (2, 256) and values.device.type == "meta" and later.copies == []
