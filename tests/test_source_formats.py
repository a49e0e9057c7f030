"""The release's weight encodings: FP8 e4m3 with 128x128 E8M0 block scales, packed FP4 e2m1 with per-32 scales."""

import os

import pytest
import torch

from moepack import native
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.source_formats import (
    E2M1_VALUES,
    fp4_dequantize,
    fp4_quantize,
    fp4_unpack_codes,
    fp8_block_dequantize,
    fp8_block_quantize,
)


def _e8m0(exponent: int) -> torch.Tensor:
    return torch.tensor([exponent + 127], dtype=torch.uint8).view(torch.float8_e8m0fnu)


def _varied_magnitudes(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Gaussian values whose scale differs by orders of magnitude between 128x128 blocks and 32-groups."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    row_scale = torch.exp2(torch.randint(-12, 8, (rows, 1), generator=g).float())
    col_scale = torch.exp2(torch.randint(-6, 6, (1, cols), generator=g).float())
    return w * row_scale * col_scale


# ------------------------------------------------------------------------------------------------- FP8


def test_fp8_dtypes_and_scale_shape():
    weight, scale = fp8_block_quantize(torch.randn(300, 520))
    assert weight.dtype == torch.float8_e4m3fn and weight.shape == (300, 520)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (3, 5)  # edge blocks count as whole blocks


def test_fp8_scale_is_the_smallest_power_of_two_that_fits():
    w = _varied_magnitudes(256, 384)
    _, scale = fp8_block_quantize(w)
    amax = w.view(2, 128, 3, 128).abs().amax(dim=(1, 3)).double()
    expected = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    assert torch.equal(scale.double(), expected)
    assert (amax / scale.double() <= 448).all() and (amax / scale.double() > 224).all()


def test_fp8_scale_exact_at_powers_of_two():
    # amax / 448 exactly 2^k must give scale 2^k, not 2^(k+1); one ulp above must give 2^(k+1).
    w = torch.zeros(128, 256)
    w[0, 0] = 448 * 2.0**-3
    w[0, 128] = torch.nextafter(torch.tensor(448 * 2.0**-3), torch.tensor(1e9)).item()
    _, scale = fp8_block_quantize(w)
    assert scale.float().tolist() == [[2.0**-3, 2.0**-2]]


def test_fp8_round_trip_error_bound():
    w = _varied_magnitudes(300, 200, seed=1)
    weight, scale = fp8_block_quantize(w)
    decoded = fp8_block_dequantize(weight, scale)
    assert decoded.dtype == torch.float32 and decoded.shape == w.shape
    element_scale = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :200]
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 relative; below 2^-6 the subnormal step is 2^-9 (x scale).
    bound = w.abs() * 2.0**-4 + element_scale * 2.0**-10
    assert ((decoded - w).abs() <= bound).all()


def test_fp8_exact_for_values_on_the_grid():
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 256, (256, 256), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    on_grid = codes.float().nan_to_num(0.0)
    on_grid[::128, ::128] = 448.0  # each block reaches the type's max, so its scale is 2^0 before shifting
    block_shift = torch.tensor([[-20.0, 3.0], [0.0, 11.0]])
    w = on_grid * torch.exp2(block_shift).repeat_interleave(128, 0).repeat_interleave(128, 1)
    weight, scale = fp8_block_quantize(w)
    assert torch.equal(scale.float(), torch.exp2(block_shift))
    assert torch.equal(fp8_block_dequantize(weight, scale), w)


def test_fp8_edge_blocks_take_their_own_scale():
    w = torch.full((130, 257), 1e-3)
    w[:128, :128] = 1000.0
    weight, scale = fp8_block_quantize(w)
    assert scale.shape == (2, 3)
    assert scale[0, 0].float() == 4.0  # 1000 / 448 -> 2^2
    assert (scale.float().flatten()[1:] == 2.0**-18).all()  # 1e-3 / 448 -> 2^-18 for every edge block
    decoded = fp8_block_dequantize(weight, scale)
    assert torch.allclose(decoded, w, rtol=2**-4)


def test_fp8_zero_blocks():
    w = torch.randn(256, 256)
    w[128:, :128] = 0.0
    weight, scale = fp8_block_quantize(w)
    assert scale[1, 0].float() == 1.0  # any finite scale decodes zeros; 1 is the neutral one
    assert torch.isfinite(scale.float()).all()
    decoded = fp8_block_dequantize(weight, scale)
    assert (decoded[128:, :128] == 0).all()
    assert torch.allclose(decoded[:128], w[:128], rtol=2**-4, atol=1e-4)


def test_fp8_rejects_bad_input():
    with pytest.raises(MoepackError):
        fp8_block_quantize(torch.randn(128))
    with pytest.raises(MoepackError):
        fp8_block_quantize(torch.tensor([[1.0, float("nan")]]))
    weight, scale = fp8_block_quantize(torch.randn(256, 256))
    with pytest.raises(MoepackError):
        fp8_block_dequantize(weight, scale[:1])
    with pytest.raises(MoepackError):
        fp8_block_dequantize(weight, scale.float())


# ------------------------------------------------------------------------------------------------- FP4


def test_e2m1_table():
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert E2M1_VALUES.dtype == torch.float32 and E2M1_VALUES.shape == (16,)
    assert E2M1_VALUES[:8].tolist() == magnitudes
    assert E2M1_VALUES[8:].tolist() == [-m for m in magnitudes]  # code = sign << 3 | magnitude index


def test_fp4_dtypes_and_shapes():
    packed, scale = fp4_quantize(torch.randn(48, 256))
    assert packed.dtype == torch.int8 and packed.shape == (48, 128)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (48, 8)
    assert fp4_dequantize(packed, scale).shape == (48, 256)


def test_fp4_nibble_order_low_nibble_first():
    # Element 0 = 1.0 (code 0x2) in the low nibble, element 1 = -1.5 (code 0x8 | 0x3) in the high one.
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0xB2
    decoded = fp4_dequantize(packed.view(torch.int8), _e8m0(0).expand(1, 1).contiguous())
    assert decoded[0, :3].tolist() == [1.0, -1.5, 0.0]
    assert fp4_unpack_codes(packed.view(torch.int8))[0, :2].tolist() == [0x2, 0xB]

    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 2] = 1.0, -1.5, 6.0
    encoded, scale = fp4_quantize(w)
    assert scale.float().item() == 1.0
    assert encoded.view(torch.uint8)[0, :2].tolist() == [0xB2, 0x07]


def test_fp4_exact_for_values_on_the_grid():
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (64, 256), generator=g)
    on_grid = E2M1_VALUES[codes]
    on_grid[:, ::32] = 6.0  # every group reaches the max, so its scale is exactly the shift below
    shift = torch.randint(-30, 30, (64, 8), generator=g).float()
    w = on_grid * torch.exp2(shift).repeat_interleave(32, 1)
    packed, scale = fp4_quantize(w)
    assert torch.equal(scale.float(), torch.exp2(shift))
    assert torch.equal(fp4_dequantize(packed, scale), w)


def test_fp4_rounds_to_nearest_ties_to_even():
    w = torch.zeros(1, 32)
    w[0, 0] = 6.0  # pins the group's scale to 1
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    w[0, 1 : 1 + len(ties)] = torch.tensor(ties)
    w[0, 8:11] = torch.tensor([0.26, 2.51, -5.01])
    packed, scale = fp4_quantize(w)
    decoded = fp4_dequantize(packed, scale)[0]
    assert decoded[1:8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # each tie goes to the even code
    assert decoded[8:11].tolist() == [0.5, 3.0, -6.0]


def test_fp4_round_trip_error_bound():
    w = _varied_magnitudes(64, 512, seed=4)
    packed, scale = fp4_quantize(w)
    decoded = fp4_dequantize(packed, scale)
    element_scale = scale.float().repeat_interleave(32, 1)
    in_grid_units = w.abs() / element_scale
    assert (in_grid_units <= 6).all()
    # Half the spacing of the grid interval the value lies in: 0.25 below 2, 0.5 below 4, 1 up to 6.
    half_gap = torch.where(in_grid_units <= 2, 0.25, torch.where(in_grid_units <= 4, 0.5, 1.0))
    assert ((decoded - w).abs() <= half_gap * element_scale).all()
    assert (decoded - w).norm() / w.norm() < 0.15


def test_fp4_scale_rule():
    w = _varied_magnitudes(16, 256, seed=5)
    _, scale = fp4_quantize(w)
    amax = w.view(16, 8, 32).abs().amax(dim=-1).double()
    assert torch.equal(scale.double(), torch.exp2(torch.ceil(torch.log2(amax / 6))))


def test_fp4_zero_groups_and_signed_zero():
    w = torch.randn(2, 64)
    w[1, 32:] = 0.0
    w[0, 5] = -1e-30  # rounds to zero: stored as +0
    packed, scale = fp4_quantize(w)
    assert scale[1, 1].float() == 1.0 and torch.isfinite(scale.float()).all()
    assert (fp4_unpack_codes(packed)[1, 32:] == 0).all()
    assert fp4_unpack_codes(packed)[0, 5] == 0
    assert (fp4_dequantize(packed, scale)[1, 32:] == 0).all()


def test_fp4_leading_dimensions():
    w = torch.randn(3, 4, 64)
    packed, scale = fp4_quantize(w)
    assert packed.shape == (3, 4, 32) and scale.shape == (3, 4, 2)
    flat_packed, flat_scale = fp4_quantize(w.reshape(12, 64))
    assert torch.equal(packed.reshape(12, 32), flat_packed)
    assert torch.equal(fp4_dequantize(packed, scale).reshape(12, 64), fp4_dequantize(flat_packed, flat_scale))


def test_fp4_rejects_bad_input():
    with pytest.raises(MoepackError):
        fp4_quantize(torch.randn(4, 48))
    packed, scale = fp4_quantize(torch.randn(4, 64))
    with pytest.raises(MoepackError):
        fp4_dequantize(packed, scale[:, :1])
    with pytest.raises(MoepackError):
        fp4_dequantize(packed.float(), scale)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
def test_fp8_decode_is_the_scaled_value_table_for_every_byte(monkeypatch, compiled):
    """Every e4m3 byte under every E8M0 scale byte, in edge (partial) blocks too: float32 gives torch's own
    e4m3 value times the scale, bfloat16 gives exactly those values rounded, compiled or not."""
    from moepack.format_spec import source_formats

    if not compiled:
        monkeypatch.setattr(source_formats, "_fp8_native", lambda: None)
    elif native.native_library("moepack_fp8_decode", source_formats._FP8_NATIVE_SOURCE) is None:
        pytest.skip("no C compiler here")
    else:  # built: it passed its load-time check, and on an AVX-512 CPU the bf16 decode is the vpermi2w one
        assert source_formats._fp8_native() is not None
        flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
        wide = "avx512bw" in flags and "avx512f" in flags
        assert (source_formats._fp8_native().lookup16.__name__ == "fp8_block_decode16_avx512") == wide
    g = torch.Generator().manual_seed(5)
    weight = torch.randint(0, 256, (300, 260), generator=g, dtype=torch.uint8)
    weight[:256, :256] = torch.arange(256, dtype=torch.uint8)[None, :]  # every byte in every row
    scale = torch.randint(0, 256, (3, 3), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    f32 = fp8_block_dequantize(weight.view(torch.float8_e4m3fn), scale)
    bf16 = fp8_block_dequantize(weight.view(torch.float8_e4m3fn), scale, dtype=torch.bfloat16)
    codes = weight.view(torch.float8_e4m3fn).float()
    element_scale = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :260]
    want = codes * element_scale
    assert torch.equal(f32.isnan(), want.isnan()) and torch.equal(f32.nan_to_num(), want.nan_to_num())
    assert bf16.dtype == torch.bfloat16
    assert torch.equal(bf16.view(torch.int16), f32.to(torch.bfloat16).view(torch.int16))
    wide = torch.zeros(300, 400, dtype=torch.uint8)
    wide[:, :260] = weight
    strided = wide[:, :260].view(torch.float8_e4m3fn)  # not contiguous: decoded from a copy that stays alive
    assert not strided.is_contiguous()
    assert torch.equal(fp8_block_dequantize(strided, scale).nan_to_num(), f32.nan_to_num())


@pytest.mark.parametrize("build", ["native", "generic", "torch"])
def test_fp8_under_float_scales_is_one_float32_product_per_weight(monkeypatch, tmp_path, build):
    """Qwen3's `-FP8` layout (float block scales, BF16 in its files): every e4m3 byte times its block's scale,
    as torch multiplies in float32, in edge (partial) blocks too and under scales of every magnitude (subnormal;
    over 2^119, where the vector loop takes its other product; products that overflow), then rounded to bfloat16
    as torch rounds; from the compiled loop's vector build (-march=native) and its plain C build alike."""
    from moepack.format_spec import source_formats

    if build == "torch":
        monkeypatch.setattr(source_formats, "_fp8_native", lambda: None)
    else:
        if native.c_compiler() is None or os.environ.get(native.NATIVE_ENV, "1") == "0":
            pytest.skip("no compiled kernels here")
        if build == "generic":
            monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
            monkeypatch.setattr(native.loader, "ARCH_FLAGS", ((),))
            monkeypatch.setattr(native.loader, "_native", {})
        kernels = source_formats._load_fp8_native()  # (None where it failed its load-time check)
        assert kernels is not None
        assert "-march=native" in native.native_builds()["moepack_fp8_decode"]["flags"] or build == "generic"
        monkeypatch.setattr(source_formats, "_fp8_native", lambda: kernels)
    g = torch.Generator().manual_seed(6)
    weight = torch.randint(0, 256, (300, 260), generator=g, dtype=torch.uint8)
    weight[:256, :256] = torch.arange(256, dtype=torch.uint8)[None, :]  # every byte in every row
    codes = weight.view(torch.float8_e4m3fn)
    scale = torch.tensor([[2.0 ** -140, 0.7 * 2.0 ** -127, 1e-3], [0.37, -2.5, 3e4],
                          [1.3 * 2.0 ** 120, 1.9 * 2.0 ** 127, -1.5 * 2.0 ** 119]])
    for given in (scale, scale.to(torch.bfloat16)):
        want = codes.float() * given.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :260]
        f32 = source_formats.fp8_float_block_dequantize(codes, given)
        bf16 = source_formats.fp8_float_block_dequantize(codes, given, dtype=torch.bfloat16)
        assert f32.dtype == torch.float32 and bf16.dtype == torch.bfloat16
        assert want.isinf().any() and want.isnan().any() and (want.abs() < 2.0 ** -126).logical_and(want != 0).any()
        assert source_formats._same_values(f32, want)
        assert source_formats._same_values(bf16, want.to(torch.bfloat16))
    with pytest.raises(MoepackError, match="does not match"):
        source_formats.fp8_float_block_dequantize(codes, scale[:2])


def test_fp8_compiled_decoder_is_off_without_native(monkeypatch):
    from moepack.format_spec import source_formats

    monkeypatch.setenv(native.NATIVE_ENV, "0")
    monkeypatch.setattr(native.loader, "_native", {})
    assert source_formats._load_fp8_native() is None
