"""An independent check of the release format: transformers' own dequantization of DeepSeek-V4's FP8 (e4m3, E8M0
128 x 128 block scales) and packed FP4 (e2m1, two per byte low nibble first, an E8M0 scale per 32 inputs) -- the
code that loads the real checkpoint into DeepseekV4ForCausalLM -- against moepack's decoders, bit for bit, on every
quantized tensor of a synthetic release checkpoint."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from safetensors import safe_open

from moepack.format_spec.decode import decode_float
from moepack.format_spec.dtypes import FROM_SAFETENSORS
from moepack.packer.synth import synth_checkpoint

fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("release") / "src")
    synth_checkpoint(out, preset="tiny", layout="release", progress=False)
    tensors = {}
    for path in sorted(glob.glob(os.path.join(out, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                tensors[name] = (f.get_slice(name).get_dtype(), f.get_tensor(name))
    return tensors


def test_fp8_and_fp4_weights_dequantize_alike_in_transformers_and_moepack(release):
    transformers_dequant = fp8.Fp8Dequantize(hf_quantizer=None)._dequantize_one
    checked = {"F8_E4M3": 0, "FP4_E2M1": 0}
    for name, (st_dtype, weight) in release.items():
        if not name.endswith(".weight") or name[:-len(".weight")] + ".scale" not in release:
            continue
        scale = release[name[:-len(".weight")] + ".scale"][1]
        ours_dtype = "FP4_E2M1" if st_dtype == "I8" else FROM_SAFETENSORS[st_dtype]
        shape = list(weight.shape) if ours_dtype != "FP4_E2M1" else [weight.shape[0], weight.shape[1] * 2]
        theirs = transformers_dequant(weight, scale, output_dtype=torch.float32)
        ours = decode_float(ours_dtype, shape, weight.contiguous().view(torch.uint8).reshape(-1), scale)
        assert theirs.shape == ours.shape and torch.equal(theirs, ours), name
        checked[ours_dtype] += 1
    assert checked["F8_E4M3"] >= 10 and checked["FP4_E2M1"] >= 30, checked  # both encodings, every such tensor
