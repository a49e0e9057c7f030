"""NaN and infinity: `convert` refuses them in any weight under every policy (naming the tensor and the first bad
index), `verify` finds them in a container's float tensors, and the forward stops at the first layer whose output is
not finite, naming it."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

from moepack.cli.main import cli
from moepack.format_spec.decode import first_non_finite
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
    blocks[:, 1:] = 0xFF  # codes of every value: finite
    blocks[7, 0] = 0xFF  # block 7's E8M0 scale: NaN
    raw = blocks.reshape(-1)
    assert first_non_finite("MXFP4", raw) == 7 * 32
    for cut in (5, 17, 40, 119):  # pieces starting mid-block
        assert first_non_finite("MXFP4", raw[cut:], cut) == 7 * 32
    assert first_non_finite("MXFP4", raw[120:], 120) is None
    q8 = np.zeros((6, 34), dtype=np.uint8)
    q8[:, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    q8[:, 2:] = 0x80  # -128: finite
    q8[4, :2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
    assert first_non_finite("Q8_0", q8.reshape(-1)) == 4 * 32
    assert first_non_finite("Q8_0", q8.reshape(-1)[35:], 35) == 4 * 32


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


@pytest.mark.parametrize("policy, value", [("q8", 1e30), ("q2", 3e38)])
def test_convert_refuses_finite_values_the_policys_type_cannot_hold(tmp_path, policy, value):
    """(Found by fuzzing convert.) A finite weight beyond what a type's f16 block scales reach (Q8_0; Q2_K, which
    clamps, up to a NaN) was stored as an infinity or a NaN: convert succeeded, and verify refused what it wrote."""
    name = "layers.0.ffn.experts.1.w2.weight"
    src = _poisoned_checkpoint(tmp_path, name, 5, value=value, layout="f32")
    out = str(tmp_path / "out.moepack")
    with pytest.raises(MoepackError, match=rf"^{name}: \w+ cannot hold its values \(the largest magnitude"):
        convert_checkpoint(src, out, policy=policy, progress=False)
    assert not os.path.exists(out)


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
