"""NaN and infinity: `convert` refuses them in any weight under every policy (naming the tensor and the first bad
index), `verify` finds them in a container's float tensors, and the forward stops at the first layer whose output is
not finite, naming it."""

from __future__ import annotations

import glob
import json
import os
import re

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

from moepack.cli.main import cli
from moepack.format_spec import quants
from moepack.format_spec.codecs import REGISTRY
from moepack.format_spec.decode import checks_finiteness, decode_tensor, first_non_finite
from moepack.format_spec.errors import FormatError, MoepackError
from moepack.format_spec.verify import verify_container
from moepack.format_spec.writer import ContainerWriter
from moepack.packer import convert as convert_module
from moepack.packer.convert import convert_checkpoint
from moepack.packer.synth import synth_checkpoint
from moepack.runtime.engine import PrefillOptions, prefill


@pytest.mark.parametrize("dtype,torch_dtype", [("F32", torch.float32), ("BF16", torch.bfloat16),
                                               ("F16", torch.float16), ("F64", torch.float64)])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_plain_floats_by_their_bits(dtype, torch_dtype, value):
    x = torch.randn(300).to(torch_dtype) * 1000
    assert first_non_finite(dtype, x.view(torch.uint8).numpy()) is None
    x[123] = value
    raw = x.view(torch.uint8).numpy()
    assert first_non_finite(dtype, raw) == 123
    size = x.element_size()
    piece = raw[64 * size:]  # a piece that starts 64 values in: indices stay the tensor's
    assert first_non_finite(dtype, piece, 64 * size) == 123
    with pytest.raises(ValueError):  # a piece must start on a whole value
        first_non_finite(dtype, raw[1:], 1)


def test_fp8_and_e8m0():
    e4m3 = torch.randn(100).to(torch.float8_e4m3fn)
    assert first_non_finite("F8_E4M3", e4m3.view(torch.uint8).numpy()) is None  # its largest value 448 is fine
    raw = e4m3.view(torch.uint8).clone()
    raw[40] = 0xFF  # -NaN
    assert first_non_finite("F8_E4M3", raw.numpy()) == 40
    e5m2 = torch.tensor([1.0, float("inf"), 2.0]).to(torch.float8_e5m2)
    assert first_non_finite("F8_E5M2", e5m2.view(torch.uint8).numpy()) == 1
    scales = np.array([120, 127, 254, 255, 3], dtype=np.uint8)
    assert first_non_finite("F8_E8M0", scales) == 3
    assert first_non_finite("FP4_E2M1", np.full(64, 0xFF, dtype=np.uint8)) is None  # codes are always finite


def test_block_scales_found_by_position_in_any_piece():
    blocks = np.zeros((10, 17), dtype=np.uint8)
    blocks[:, 0] = 127
    blocks[:, 1:] = 0xFF  # codes of e2m1 -6: finite times 2^0
    blocks[7, 0] = 0xFF  # block 7's exponent: OCP's NaN, -6 x 2^128 in ggml: an infinity
    raw = blocks.reshape(-1)
    assert first_non_finite("MXFP4", raw) == 7 * 32
    for cut in (5, 17, 40, 119):  # pieces starting before block 7 (an MXFP4 block is judged whole)
        assert first_non_finite("MXFP4", raw[cut:], cut) == 7 * 32
    assert first_non_finite("MXFP4", raw[120:], 120) is None
    q8 = np.zeros((6, 34), dtype=np.uint8)
    q8[:, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    q8[:, 2:] = 0x80  # -128: finite
    q8[4, :2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
    assert first_non_finite("Q8_0", q8.reshape(-1)) == 4 * 32
    assert first_non_finite("Q8_0", q8.reshape(-1)[35:], 35) == 4 * 32


# Where ggml's layouts (ggml-common.h) keep each block type's scales: type -> [(byte of the block, width)], f16 where
# the width is 2, MXFP4's exponent byte where it is 1 (its codes follow). Written out here, not read from decode.py.
SCALE_FIELDS = {"Q8_0": [(0, 2)], "MXFP4": [(0, 1)], "Q2_K": [(80, 2), (82, 2)], "IQ2_XXS": [(0, 2)]}
F16_NON_FINITE = (0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFFFF)  # +-inf, NaNs
# types none of whose bit patterns decodes to a NaN or an infinity (NVFP4: ggml's UE4M3 has no NaN)
ALWAYS_FINITE = ("I64", "I32", "I16", "I8", "U8", "BOOL", "FP4_E2M1", "NVFP4")


def _finite_f16_bits(rng, n: int) -> np.ndarray:
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    return np.where((bits & 0x7C00) == 0x7C00, bits & ~np.uint16(0x0400), bits).astype("<u2")


def _blocks_with_one_bad_scale(dtype: str, rng, n_blocks: int, bad: int) -> np.ndarray:
    """n_blocks random blocks of a ggml type, every scale finite but one of block `bad`'s (a random field)."""
    size = REGISTRY[dtype].block_bytes
    blocks = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for at, width in SCALE_FIELDS[dtype]:
        if width == 2:
            blocks[:, at:at + 2] = _finite_f16_bits(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
        else:  # MXFP4's exponent, any; codes of magnitude 0 or 1 (e2m1 0, 0.5) where 2^(e-127) is 2^126 or more
            blocks[:, at] = rng.integers(0, 256, n_blocks)
            blocks[blocks[:, at] >= 253, at + 1:] &= 0x99
    at, width = SCALE_FIELDS[dtype][rng.integers(len(SCALE_FIELDS[dtype]))]
    if width == 2:
        blocks[bad, at:at + 2] = np.array([rng.choice(F16_NON_FINITE)], "<u2").view(np.uint8)
    else:  # an exponent of 2^126 .. 2^128 (OCP's NaN) times a code of e2m1 6: past float32
        blocks[bad, at] = rng.integers(253, 256)
        blocks[bad, at + 1 + rng.integers(16)] |= 0x77
    return blocks.reshape(-1)


def _pieces(raw: np.ndarray, rng, step: int = 1, also=()):
    """raw cut at random places (multiples of `step`) and at `also` into consecutive pieces: (piece, its start)."""
    cuts = np.unique(np.r_[rng.integers(1, len(raw) // step, 5) * step, also]).astype(int)
    return [(raw[a:b], a) for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(raw)])]


@pytest.mark.parametrize("dtype", list(REGISTRY))
def test_every_storage_type_is_judged_by_its_bits_as_decoding_judges_it(dtype):
    """For every stored type, first_non_finite (the bits) names the index decoding and torch.isfinite find: the
    first non-finite value, for a block type the first value of its block; in the whole tensor and over any cut
    into pieces (as verify streams them, cutting through blocks and 2-byte scales). Types whose every bit pattern
    is finite are judged so (convert then never decodes them to look)."""
    assert checks_finiteness(dtype), f"{dtype}: first_non_finite has no rule for it"
    codec = REGISTRY[dtype]
    rng = np.random.default_rng(sum(map(ord, dtype)))
    n_blocks = 40
    shape = (n_blocks * codec.block_elems,)
    if dtype in ALWAYS_FINITE:  # random blocks, a block's first byte (NVFP4: a UE4M3 scale) taking every value
        raw = rng.integers(0, 256, (256, codec.block_bytes), dtype=np.uint8)
        raw[:, 0] = np.arange(256)
        raw = raw.reshape(-1)
        assert bool(torch.isfinite(decode_tensor(dtype, (256 * codec.block_elems,), raw).float()).all())
        assert first_non_finite(dtype, raw) is None
        return
    bad = int(rng.integers(n_blocks))
    if dtype in SCALE_FIELDS:
        raw = _blocks_with_one_bad_scale(dtype, rng, n_blocks, bad)
        step = codec.block_bytes if dtype == "MXFP4" else 1  # MXFP4: pieces of whole blocks, as verify passes them
    else:  # a plain float type: random finite values, one NaN or infinity (exponent bits all ones)
        step = codec.block_bytes
        decoded = decode_tensor(dtype, shape, rng.integers(0, 256, n_blocks * step, dtype=np.uint8))
        decoded = torch.where(torch.isfinite(decoded.float()), decoded, torch.zeros_like(decoded))
        inf = torch.tensor(float("inf")).to(decoded.dtype)
        decoded[bad] = -inf if bad % 2 and torch.isinf(inf.float()) else float("nan")  # (FP8 e4m3, E8M0: no inf)
        raw = decoded.view(torch.uint8).numpy().copy()
    values = decode_tensor(dtype, shape, raw).float()
    first_by_decoding = int(torch.nonzero(~torch.isfinite(values))[0, 0])
    expected = first_by_decoding // codec.block_elems * codec.block_elems
    assert expected == bad * codec.block_elems
    assert first_non_finite(dtype, raw) == expected
    # cuts through every scale field of the bad block too (between an f16's low and high bytes)
    through = [bad * codec.block_bytes + at + 1 for at, width in SCALE_FIELDS.get(dtype, ()) if width == 2]
    for _ in range(5):
        found = [first_non_finite(dtype, piece, start) for piece, start in _pieces(raw, rng, step, through)]
        assert min(i for i in found if i is not None) == expected
    size = codec.block_bytes  # the bad block replaced by a finite one: both find nothing
    raw[bad * size:(bad + 1) * size] = raw[:size] if bad else raw[-size:]
    assert bool(torch.isfinite(decode_tensor(dtype, shape, raw).float()).all())
    assert first_non_finite(dtype, raw) is None


def _poisoned_checkpoint(tmp_path, name: str, index: int, byte: int | None = None, value: float = float("nan"),
                         layout: str = "release"):
    """The tiny checkpoint (release layout) with one element of tensor `name` made NaN / inf (or one byte set)."""
    src = str(tmp_path / "src")
    synth_checkpoint(src, preset="tiny", layout=layout, progress=False)
    for path in glob.glob(os.path.join(src, "*.safetensors")):
        with safe_open(path, "pt") as f:
            if name not in f.keys():
                continue
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            metadata = f.metadata()
        flat = tensors[name].view(-1)
        if byte is None:
            flat[index] = value
        else:
            flat.view(torch.uint8)[index] = byte
        save_file(tensors, path, metadata=metadata)
        return src
    raise AssertionError(f"{name} not in the checkpoint")


@pytest.mark.parametrize("policy", ["keep", "bf16", "fp4", "q8"])
def test_convert_refuses_a_nan_weight_naming_it_under_every_policy(tmp_path, policy):
    src = _poisoned_checkpoint(tmp_path, "layers.0.attn_norm.weight", 77)
    out = str(tmp_path / "out.moepack")
    r = CliRunner().invoke(cli, ["convert", src, "-o", out, f"--{policy}" if policy != "keep" else "--keep",
                                 "--json"])
    assert r.exit_code == 1, r.output
    error = json.loads(r.output.splitlines()[0])["error"]
    assert error.startswith("layers.0.attn_norm.weight: not finite") and "[77]" in error
    assert not os.path.exists(out)


@pytest.mark.parametrize("name,index,byte", [("layers.1.attn.wq_a.weight", 256 * 3 + 5, 0x7F),  # FP8 NaN
                                             ("layers.0.ffn.experts.2.w3.scale", 9, 0xFF)])  # an E8M0 scale
def test_convert_refuses_nan_bytes_of_the_release_encodings(tmp_path, name, index, byte):
    src = _poisoned_checkpoint(tmp_path, name, index, byte=byte)
    with pytest.raises(MoepackError, match=rf"^{name}: not finite .* \(flat {index}\)"):
        convert_checkpoint(src, str(tmp_path / "out.moepack"), policy="fp4", progress=False)


@pytest.mark.parametrize("policy", ["keep", "fp4", "q8", "bf16"])
@pytest.mark.parametrize("name,index,rows,cols", [("layers.0.ffn.experts.2.w3.scale", 9, (1, 2), (32, 64)),  # FP4
                                                   ("layers.1.attn.wq_a.scale", 0, (0, 128), (0, 128))])  # FP8
def test_convert_refuses_a_weight_its_finite_scale_carries_past_float32(tmp_path, policy, name, index, rows, cols):
    """An E8M0 scale of 2^127 (byte 254) is finite, and so is every FP4 / FP8 value, but their products pass
    float32: --keep stored them, --fp4 stored FP4 experts as MXFP4 blocks decoding to infinities (verify passed
    both), --q8 refused without naming the tensor, --bf16 blamed the policy. Now the source is refused by name."""
    src = _poisoned_checkpoint(tmp_path, name, index, byte=254)  # its group of 32 / block of 128 x 128
    weight = name.replace(".scale", ".weight").replace(".", r"\.")
    with pytest.raises(MoepackError, match=rf"^{weight}: not finite \(NaN or infinity\) at index \[(\d+), (\d+)\] "
                                           r"\(flat \d+\) of the source: the checkpoint is damaged$") as error:
        convert_checkpoint(src, str(tmp_path / "out.moepack"), policy=policy, progress=False)
    row, col = (int(v) for v in re.search(r"index \[(\d+), (\d+)\]", str(error.value)).groups())
    assert rows[0] <= row < rows[1] and cols[0] <= col < cols[1]


@pytest.mark.parametrize("policy, value, name", [("q8", 1e30, "layers.0.ffn.experts.1.w2.weight"),
                                                 ("q2", 3e38, "layers.0.ffn.experts.1.w2.weight"),
                                                 ("q2", 1e7, "layers.0.ffn.experts.1.w2.weight"),  # Q2_K
                                                 ("q2", -2e7, "layers.0.ffn.experts.1.w1.weight"),  # IQ2_XXS
                                                 ("nvfp4", 3.4e38, "layers.0.ffn.experts.1.w2.weight")])
def test_convert_refuses_finite_values_the_policys_type_cannot_hold(tmp_path, policy, value, name):
    """(Found by fuzzing convert.) A finite weight beyond what a type's f16 block scales reach (Q8_0) was stored as
    an infinity or a NaN: convert succeeded, and verify refused what it wrote. Q2_K and IQ2_XXS clamped their scales
    at the f16 maximum: 1e7 was stored as 2.9e6 (Q2_K), -2e7 as -1.1e7 (IQ2_XXS), silently. NVFP4's blocks are
    finite, but 3.4e38 rounded up a little decodes times its tensor scale 2^118 to an infinity: it was stored."""
    src = _poisoned_checkpoint(tmp_path, name, 5, value=value, layout="f32")
    out = str(tmp_path / "out.moepack")
    with pytest.raises(MoepackError, match=rf"^{name}: \w+ cannot hold its values \(the largest magnitude"):
        convert_checkpoint(src, out, policy=policy, progress=False)
    assert not os.path.exists(out)


@pytest.mark.parametrize("qtype, beyond, within", [("Q2_K", (3e6, -1e6, 1e20, 3e38), (2.5e6, -9e5)),
                                                   ("IQ2_XXS", (1.1e7, -1.1e7, 1e20, 3e38), (9e6, -9e6))])
def test_a_q2_block_beyond_its_f16_scales_keeps_a_non_finite_scale(qtype, beyond, within):
    """Q2_K (d * 15 * 3 above, -dmin * 15 below) and IQ2_XXS (d * 15.5/4 * 43) decode nothing beyond their largest
    f16 scales: a block holding such a value gets an infinite scale, as ggml's f16 conversion (and our Q8_0) gives,
    so that convert refuses it by name; they clamped it (1e20 decoded as 2.9e6) or, at 3e38, gave a NaN (Q2_K) or
    finite garbage (IQ2_XXS). Within their range the values are stored finite."""
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    for value in beyond + within:
        y = x.copy()
        y[1, 7] = value
        q = quants.quantize(y, qtype)
        decoded = quants.dequantize(q, qtype, y.shape)
        if value in within:
            assert first_non_finite(qtype, q.reshape(-1)) is None and np.isfinite(decoded).all()
        else:
            assert first_non_finite(qtype, q.reshape(-1)) == 256, value
            assert not np.isfinite(decoded[1]).any() and np.isfinite(decoded[[0, 2]]).all()


def test_convert_judges_every_quantized_type_by_its_bits(monkeypatch):
    """_holds_an_infinity reads the stored bits of every type a policy quantizes to (NVFP4, Q2_K and IQ2_XXS were
    decoded whole: ~4 % of a --q2 conversion)."""
    def no_decode(*args, **kwargs):
        raise AssertionError("decoded")
    monkeypatch.setattr(convert_module, "decode_float", no_decode)
    x = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
    for qtype in quants.QTYPES:
        blocks = quants.quantize(x, qtype).reshape(-1)
        assert not convert_module._holds_an_infinity(qtype, x.shape, memoryview(blocks))
    y = x.copy()
    y[2, 3] = 1e9
    assert convert_module._holds_an_infinity("Q2_K", y.shape, memoryview(quants.quantize(y, "Q2_K").reshape(-1)))


@pytest.fixture
def nan_container(tmp_path, monkeypatch):
    """A container whose layer-1 attention norm holds an infinity, as a converter without the check wrote it."""
    src = _poisoned_checkpoint(tmp_path, "layers.1.attn_norm.weight", 3, value=float("inf"))
    out = str(tmp_path / "poisoned.moepack")
    with monkeypatch.context() as m:
        m.setattr(convert_module, "first_non_finite", lambda *a, **k: None)
        convert_checkpoint(src, out, progress=False)
    return out


def test_verify_finds_the_non_finite_tensor(nan_container):
    with pytest.raises(FormatError, match=r"tensor layers\.1\.attn_norm\.weight .*not finite .* flat index 3$"):
        verify_container(nan_container)
    r = CliRunner().invoke(cli, ["verify", nan_container])
    assert r.exit_code == 1 and "layers.1.attn_norm.weight" in r.output


def test_prefill_and_generate_stop_at_the_first_layer_that_is_not_finite(nan_container):
    with pytest.raises(MoepackError, match=r"^layer 1: its output is not finite"):
        prefill(nan_container, torch.arange(3, 20), PrefillOptions())
    r = CliRunner().invoke(cli, ["generate", nan_container, "--prompt", "hello", "--max-new-tokens", "3"])
    assert r.exit_code == 1 and "layer 1: its output is not finite" in r.output


def _one_tensor_container(path: str, dtype: str, shape, raw: bytes) -> str:
    w = ContainerWriter(path)
    w.begin_region("global", tensor="embed.weight")
    w.add_tensor("embed.weight", dtype, shape, raw)
    w.end_region()
    w.finish(config={"model_type": "deepseek_v4", "num_hidden_layers": 0}, architecture="deepseek_v4",
             policy={"name": "keep"}, tokenizer={}, provenance={"source": "test"})
    return path


@pytest.mark.parametrize("dtype", ["MXFP4", "Q2_K", "IQ2_XXS", "Q8_0"])
def test_verify_finds_a_bad_block_cut_by_its_reads(tmp_path, monkeypatch, dtype):
    """verify reads a container in chunks that cut blocks anywhere: a block's values are judged whole (an MXFP4
    block with exponent 254, 2^127, and a code of e2m1 2 decodes to an infinity; with codes up to 1.5 it does not:
    verify had passed both)."""
    rng = np.random.default_rng(3)
    codec, n_blocks, bad = REGISTRY[dtype], 30, 17
    if dtype == "MXFP4":
        blocks = rng.integers(0, 256, (n_blocks, 17), dtype=np.uint8)
        blocks[:, 0] = rng.integers(100, 253, n_blocks)
        blocks[bad, 0], blocks[bad, 1:] = 254, 0x33  # e2m1 1.5 x 2^127 is finite
        blocks[bad, 9] = 0x34  # 2 x 2^127 is not
        raw = blocks.reshape(-1)
    else:
        raw = _blocks_with_one_bad_scale(dtype, rng, n_blocks, bad)
    shape = [n_blocks * codec.block_elems]
    assert first_non_finite(dtype, raw) == bad * codec.block_elems
    path = _one_tensor_container(str(tmp_path / f"{dtype}.moepack"), dtype, shape, raw.tobytes())
    for chunk in (5, 64, 100, 1000, 1 << 20):
        monkeypatch.setattr("moepack.format_spec.verify.READ_CHUNK", chunk)
        with pytest.raises(FormatError, match=rf"not finite .* at flat index {bad * codec.block_elems}$"):
            verify_container(path)
    if dtype == "MXFP4":
        raw[bad * 17 + 9] = 0x33
        finite = _one_tensor_container(str(tmp_path / "finite.moepack"), dtype, shape, raw.tobytes())
        assert verify_container(finite).tensors == 1
        assert bool(torch.isfinite(decode_tensor(dtype, shape, raw)).all())


def test_a_container_without_such_values_verifies(tmp_path):
    """Random bytes stored as integers, and FP4 codes of every value, are never taken for NaN."""
    path = str(tmp_path / "ints.moepack")
    w = ContainerWriter(path)
    w.begin_region("global", tensor="embed.weight")
    w.add_tensor("embed.weight", "U8", [256], bytes(range(256)))
    w.end_region()
    w.finish(config={"model_type": "deepseek_v4", "num_hidden_layers": 0}, architecture="deepseek_v4",
             policy={"name": "keep"}, tokenizer={}, provenance={"source": "test"})
    assert verify_container(path).tensors == 1
