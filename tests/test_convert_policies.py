"""`moepack convert --fp4/--nvfp4/--q8/--q2/--bf16`: types per role, fidelity to the source, resumability,
a full disk, bounded memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from containers import mutate_index, small_disk, source_reads_fail_at
from moepack.format_spec import quants
from moepack.format_spec.decode import decode_group
from moepack.format_spec.errors import FormatError, MoepackError
from moepack.format_spec.reader import Container
from moepack.format_spec.verify import verify_container
from moepack.format_spec.writer import ContainerWriter
from moepack.packer.convert import convert_checkpoint
from moepack.packer.fidelity import compare_with_source
from moepack.packer.synth import synth_checkpoint

# small enough that the 2-bit search stays quick
SMALL = {"n_routed_experts": 4, "num_experts_per_tok": 2}

EXPECTED = {  # policy -> (gate/up, down, dense linear, expert bits per weight)
    "fp4": ("MXFP4", "MXFP4", "Q8_0", 4.25),
    "nvfp4": ("NVFP4", "NVFP4", "Q8_0", 4.5),  # plus a 4-byte tensor scale per weight
    "q8": ("Q8_0", "Q8_0", "Q8_0", 8.5),
    "q2": ("IQ2_XXS", "Q2_K", "Q8_0", 2.25),
    "bf16": ("BF16", "BF16", "BF16", 16.0),
}


@pytest.fixture(scope="module")
def release_src(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("policies") / "src")
    synth_checkpoint(d, preset="tiny", layout="release", seed=2, progress=False, config_overrides=SMALL)
    return d


@pytest.mark.parametrize("policy", list(EXPECTED))
def test_policy_types_and_fidelity(release_src, tmp_path, policy):
    out = str(tmp_path / f"{policy}.moepack")
    summary = convert_checkpoint(release_src, out, policy=policy, progress=False, drop_mtp=policy == "q2")
    gate_up, down, dense, bpw = EXPECTED[policy]
    assert summary["expert_bits_per_weight"] == pytest.approx(bpw, rel=1e-3)
    verify_container(out)
    with Container(out) as c:
        assert c.policy["name"] == policy and c.policy["roles"]["routed_down"] == down
        t = c.tensors
        assert t["layers.2.ffn.experts.1.w1.weight"].dtype == gate_up
        assert t["layers.2.ffn.experts.1.w3.weight"].dtype == gate_up
        assert t["layers.2.ffn.experts.1.w2.weight"].dtype == down
        assert t["layers.1.attn.wq_a.weight"].dtype == dense
        assert t["layers.0.ffn.shared_experts.w1.weight"].dtype == dense
        # exact tensors keep their type; a requantized weight drops its scale
        assert t["layers.1.attn_norm.weight"].dtype == "F32" and t["layers.0.ffn.gate.tid2eid"].dtype == "I64"
        assert "layers.1.attn.wq_a.scale" not in t and "layers.2.ffn.experts.1.w1.scale" not in t
        assert any(n.startswith("mtp.") for n in t) == (policy != "q2")
    report = compare_with_source(out, release_src, progress=False)
    assert report["ok"], report["failures"][:3]
    if policy in ("fp4", "bf16"):  # FP4 -> MXFP4 and FP8/FP4 -> BF16 are lossless
        assert report["value_identical"] >= sum(1 for n in t if ".experts." in n)


# --- NVFP4's tensor scale (SPEC.md section 6.1) -----------------------------------------------------------------

SMALL_WEIGHT, UNIT_WEIGHT = "layers.1.ffn.experts.0.w1.weight", "layers.1.ffn.experts.1.w1.weight"


def _rel_rmse(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.fixture(scope="module")
def nvfp4_scaled(tmp_path_factory):
    """An f32 checkpoint whose SMALL_WEIGHT has std 1e-4 and UNIT_WEIGHT std 1, and its --nvfp4 container.
    Returns (source dir, container, the two source tensors by name)."""
    from safetensors.torch import load_file, save_file

    base = tmp_path_factory.mktemp("nvfp4-scale")
    src = str(base / "src")
    synth_checkpoint(src, preset="tiny", layout="f32", seed=4, progress=False, config_overrides=SMALL)
    weight_map = json.load(open(os.path.join(src, "model.safetensors.index.json")))["weight_map"]
    originals = {}
    for name, std in ((SMALL_WEIGHT, 1e-4), (UNIT_WEIGHT, 1.0)):
        shard = os.path.join(src, weight_map[name])
        tensors = load_file(shard)
        tensors[name] = tensors[name] * (std / tensors[name].std())
        originals[name] = tensors[name]
        save_file(tensors, shard, metadata={"format": "pt"})
    out = str(base / "nvfp4.moepack")
    convert_checkpoint(src, out, policy="nvfp4", progress=False)
    return src, out, originals


def _decoded(path: str, name: str) -> torch.Tensor:
    with Container(path) as c:
        region = c.tensors[name].region
        return decode_group(region.tensors, lambda t: c.tensor_bytes(t.name))[name]


def test_nvfp4_tensor_scale_keeps_small_weights(nvfp4_scaled):
    src, out, originals = nvfp4_scaled
    small, unit = originals[SMALL_WEIGHT], originals[UNIT_WEIGHT]
    # without a tensor scale ggml's NVFP4 has no scale small enough: every element decodes to zero
    plain = quants.dequantize_torch(quants.quantize_torch(small, "NVFP4"), "NVFP4", small.shape)
    assert not plain.any()
    small_err = _rel_rmse(_decoded(out, SMALL_WEIGHT), small)
    unit_err = _rel_rmse(_decoded(out, UNIT_WEIGHT), unit)
    assert small_err < 0.1 and unit_err < 0.1 and abs(small_err - unit_err) < 0.01, (small_err, unit_err)
    with Container(out) as c:
        nvfp4 = [t for t in c.tensors.values() if t.dtype == "NVFP4"]
        assert nvfp4
        for t in nvfp4:  # each NVFP4 weight is followed by its tensor scale, a power of two
            scale = c.tensors[t.name.replace(".weight", ".tensor_scale")]
            assert scale.region is t.region and scale.offset > t.offset and (scale.dtype, scale.shape) == ("F32", ())
            value = float(np.frombuffer(c.tensor_bytes(scale.name), np.float32)[0])
            assert np.frexp(value)[0] == 0.5
    report = compare_with_source(out, src, progress=False)
    assert report["ok"], report["failures"][:3]
    assert report["by_type"]["NVFP4"]["max_rel_rmse"] < 0.1


def test_gguf_dequantize_times_tensor_scale_is_our_decode(nvfp4_scaled):
    gguf = pytest.importorskip("gguf")
    _, out, _ = nvfp4_scaled
    with Container(out) as c:
        for name in (SMALL_WEIGHT, UNIT_WEIGHT):
            t = c.tensors[name]
            blocks = np.frombuffer(c.tensor_bytes(name), np.uint8).reshape(t.shape[0], -1)
            scale = np.frombuffer(c.tensor_bytes(name.replace(".weight", ".tensor_scale")), np.float32)[0]
            theirs = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.NVFP4) * scale
            assert np.array_equal(theirs, _decoded(out, name).numpy())


def test_export_of_nvfp4_container_applies_the_tensor_scale(nvfp4_scaled, tmp_path):
    from safetensors.torch import load_file

    from moepack.packer.export import export_container

    _, out, _ = nvfp4_scaled
    exported_dir = str(tmp_path / "export")
    export_container(out, exported_dir, dtype="f32", progress=False)
    weight_map = json.load(open(os.path.join(exported_dir, "model.safetensors.index.json")))["weight_map"]
    assert not any(n.endswith(".tensor_scale") for n in weight_map)
    for name in (SMALL_WEIGHT, UNIT_WEIGHT):
        exported = load_file(os.path.join(exported_dir, weight_map[name]))[name]
        assert torch.equal(exported, _decoded(out, name))


def _nvfp4_container(path: str, tensor_scale: tuple | None = None) -> torch.Tensor:
    """A one-expert container holding an NVFP4 weight (std 1e-2) and, if given, a (name, dtype, shape, bytes)
    tensor right after it. Returns the weight's plain NVFP4 decode."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 0.01
    blocks = quants.quantize_torch(x, "NVFP4")
    w = ContainerWriter(path)
    w.begin_region("dense", block="layers.0")
    w.add_tensor("layers.0.attn_norm.weight", "F32", [64], torch.ones(64).numpy().tobytes())
    w.end_region()
    w.begin_region("expert", block="layers.0", expert=0)
    w.add_tensor("layers.0.ffn.experts.0.w1.weight", "NVFP4", [64, 128], blocks.numpy().tobytes())
    if tensor_scale is not None:
        w.add_tensor(*tensor_scale)
    w.end_region()
    w.finish(config={"num_hidden_layers": 1}, architecture="deepseek_v4", policy={"name": "nvfp4"},
             tokenizer={}, provenance={"source": "test"})
    return quants.dequantize_torch(blocks, "NVFP4", (64, 128))


def test_container_without_tensor_scales_still_opens(tmp_path):
    # as the converter wrote NVFP4 before tensor scales: the weight decodes to its blocks' values
    path = str(tmp_path / "old.moepack")
    plain = _nvfp4_container(path)
    with Container(path) as c:
        assert list(c.tensors) == ["layers.0.attn_norm.weight", "layers.0.ffn.experts.0.w1.weight"]
    assert torch.equal(_decoded(path, "layers.0.ffn.experts.0.w1.weight"), plain)


def test_tensor_scale_multiplies_its_weight(tmp_path):
    path = str(tmp_path / "scaled.moepack")
    name = "layers.0.ffn.experts.0.w1.tensor_scale"
    plain = _nvfp4_container(path, (name, "F32", [], np.float32(2.0 ** -20).tobytes()))
    with Container(path) as c:
        values = decode_group(c.tensors[name].region.tensors, lambda t: c.tensor_bytes(t.name))
    assert list(values) == ["layers.0.ffn.experts.0.w1.weight"]  # the scale is folded into its weight
    assert torch.equal(values["layers.0.ffn.experts.0.w1.weight"], plain * 2.0 ** -20)


@pytest.mark.parametrize("label, tensor, message", [
    ("not F32", ("layers.0.ffn.experts.0.w1.tensor_scale", "F16", [], bytes(2)), "an F32 scalar"),
    ("not a scalar", ("layers.0.ffn.experts.0.w1.tensor_scale", "F32", [1], bytes(4)), "an F32 scalar"),
    ("no weight", ("layers.0.ffn.experts.0.w3.tensor_scale", "F32", [], bytes(4)), "after its weight"),
])
def test_reader_rejects_a_bad_tensor_scale(tmp_path, label, tensor, message):
    path = str(tmp_path / "bad.moepack")
    _nvfp4_container(path, tensor)
    with pytest.raises(FormatError, match=message):
        Container(path)


def test_reader_rejects_a_tensor_scale_outside_its_weights_region(tmp_path):
    good = str(tmp_path / "good.moepack")
    _nvfp4_container(good, ("layers.0.ffn.experts.0.w1.tensor_scale", "F32", [], np.float32(1.0).tobytes()))

    def move_to_dense_region(index):
        entry = next(t for t in index["tensors"] if t["name"].endswith(".tensor_scale"))
        entry["region"], entry["offset"] = 0, 256  # after the norm weight there, in bounds

    bad = str(tmp_path / "moved.moepack")
    mutate_index(good, bad, move_to_dense_region)
    with pytest.raises(FormatError, match="after its weight, in the weight's region"):
        Container(bad)


@pytest.mark.parametrize("value", [3.0, -0.5, 0.0, float("inf"), float("nan"), 2.0 ** -127])
def test_decode_rejects_a_tensor_scale_that_is_not_a_normal_power_of_two(tmp_path, value):
    path = str(tmp_path / "value.moepack")
    name = "layers.0.ffn.experts.0.w1.tensor_scale"
    _nvfp4_container(path, (name, "F32", [], np.float32(value).tobytes()))
    with pytest.raises(FormatError, match=f"{name}: a tensor scale must be a power of two"):
        _decoded(path, "layers.0.ffn.experts.0.w1.weight")


def test_verify_source_catches_a_different_checkpoint(release_src, tmp_path):
    other = str(tmp_path / "other")
    synth_checkpoint(other, preset="tiny", layout="release", seed=9, progress=False, config_overrides=SMALL)
    out = str(tmp_path / "fp4.moepack")
    convert_checkpoint(release_src, out, policy="fp4", progress=False)
    report = compare_with_source(out, other, progress=False)
    assert not report["ok"]
    problems = " ".join(f["problem"] for f in report["failures"])
    assert "bytes differ" in problems and "should be lossless" in problems and "exceeds its threshold" in problems


def test_verify_source_catches_the_same_weights_under_another_config(release_src, tmp_path):
    """The same tensors, another config.json (routed_scaling_factor: another model computed from them): verify
    --source names the key; the config it was converted from passes."""
    import shutil

    from moepack.packer.fidelity import raise_on_failures

    out = str(tmp_path / "keep.moepack")
    convert_checkpoint(release_src, out, policy="keep", progress=False)
    assert compare_with_source(out, release_src, progress=False)["ok"]
    other = shutil.copytree(release_src, str(tmp_path / "other"))
    config = json.load(open(os.path.join(other, "config.json")))
    config["routed_scaling_factor"] = 7.0
    json.dump(config, open(os.path.join(other, "config.json"), "w"))
    report = compare_with_source(out, other, progress=False)
    assert not report["ok"] and report["failures"][0]["tensor"] == "config.json"
    with pytest.raises(MoepackError, match=r"^config.json: differs from the source's: routed_scaling_factor is 7.0 "
                                           r"there, [0-9.]+ here$"):
        raise_on_failures(report)


@pytest.mark.parametrize("policy", ["fp4", "nvfp4", "q8", "q2", "bf16"])  # nvfp4: both apply the tensor scales
def test_quantized_prefill_matches_transformers_on_the_export(release_src, tmp_path, policy):
    transformers = pytest.importorskip("transformers")
    from moepack.packer.export import export_container
    from moepack.runtime.engine import PrefillOptions, prefill

    out = str(tmp_path / f"{policy}.moepack")
    convert_checkpoint(release_src, out, policy=policy, progress=False)
    exported = str(tmp_path / "export")
    export_container(out, exported, dtype="f32", progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    ids = torch.randint(3, 500, (45,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids[None]).logits[0, -1]
    got = prefill(out, ids, PrefillOptions()).logits
    assert (got - ref).abs().max() <= 1e-3 * ref.abs().max()


def test_resume_after_interruption_gives_identical_bytes(release_src, tmp_path):
    whole = str(tmp_path / "whole.moepack")
    convert_checkpoint(release_src, whole, policy="q8", progress=False)
    out = str(tmp_path / "resumed.moepack")
    with source_reads_fail_at(120, KeyboardInterrupt()), pytest.raises(KeyboardInterrupt):
        convert_checkpoint(release_src, out, policy="q8", progress=False)
    # a different policy must not pick up the other job's partial output
    assert convert_checkpoint(release_src, str(tmp_path / "other.moepack"), policy="fp4",
                              progress=False)["resumed_regions"] == 0
    summary = convert_checkpoint(release_src, out, policy="q8", progress=False)
    assert summary["resumed_regions"] > 0
    assert open(out, "rb").read() == open(whole, "rb").read()


def test_thread_count_does_not_change_the_bytes(release_src, tmp_path):
    a, b = str(tmp_path / "a.moepack"), str(tmp_path / "b.moepack")
    threads = torch.get_num_threads()
    try:
        convert_checkpoint(release_src, a, policy="nvfp4", progress=False, workers=1)
        convert_checkpoint(release_src, b, policy="nvfp4", progress=False, workers=2)
    finally:
        torch.set_num_threads(threads)
    assert open(a, "rb").read() == open(b, "rb").read()


def test_disk_full_is_one_line_and_keeps_the_partial(release_src, tmp_path, monkeypatch):
    with small_disk(tmp_path / "small-disk", "2M") as small:
        out = os.path.join(small, "full.moepack")
        # the check before any work sees the disk is too small: one line, nothing written
        with pytest.raises(MoepackError, match=r"^not enough free space for converting .* on .*small-disk: it needs "
                                               r"about [0-9.]+ MiB \(a margin included\), [0-9.]+ MiB is free$"):
            convert_checkpoint(release_src, out, policy="keep", progress=False)
        assert os.listdir(small) == []
        # the disk fills during the conversion (another writer, after the check): one line, the partial stays
        import moepack.packer.convert as C

        monkeypatch.setattr(C, "check_free_space", lambda needs, what: {d: {} for d in needs})
        with pytest.raises(MoepackError, match="disk full") as info:
            convert_checkpoint(release_src, out, policy="keep", progress=False)
        assert "\n" not in str(info.value)
        assert not os.path.exists(out) and os.path.exists(out + ".partial")
        # room again: the rerun resumes from the journal and finishes
        subprocess.run(["mount", "-o", "remount,size=64M", small], check=True)
        monkeypatch.undo()
        summary = convert_checkpoint(release_src, out, policy="keep", progress=False)
        assert summary["resumed_regions"] > 0
        verify_container(out)


PEAK_RSS = r"""
import json, resource, sys
from moepack.packer.convert import convert_checkpoint
import moepack.format_spec.quants, torch  # imported before the baseline
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
convert_checkpoint(sys.argv[1], sys.argv[2], policy=sys.argv[3], progress=False)
print(json.dumps({"base": base * 1024, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def test_memory_does_not_grow_with_the_number_of_layers(tmp_path):
    """Peak RSS of a conversion is bounded by a few regions, not the model: 4 and 24 layers of the same shape
    convert within the same bound, and that bound is a small multiple of the largest region."""
    peaks = {}
    for layers in (4, 24):
        src = str(tmp_path / f"src{layers}")
        overrides = {"num_hidden_layers": layers, "layer_types": ["sliding_attention"] * layers,
                     "mlp_layer_types": ["hash_moe"] + ["moe"] * (layers - 1), "num_nextn_predict_layers": 0}
        synth_checkpoint(src, preset="tiny", layout="release", seed=0, progress=False, config_overrides=overrides)
        p = subprocess.run([sys.executable, "-c", PEAK_RSS, src, str(tmp_path / f"m{layers}.moepack"), "fp4"],
                           capture_output=True, text=True, check=True)
        peaks[layers] = json.loads(p.stdout)
        size = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
        peaks[layers]["source_bytes"] = size
    with Container(str(tmp_path / "m24.moepack")) as c:
        largest_region = max(r.length for r in c.regions)
    growth = {n: v["peak"] - v["base"] for n, v in peaks.items()}
    assert peaks[24]["source_bytes"] > 4 * peaks[4]["source_bytes"] * 0.8
    # 6x the model, but the same working set
    assert growth[24] <= growth[4] + (16 << 20), growth
    assert growth[24] <= 64 * largest_region + (96 << 20), (growth, largest_region)


def test_fp8_embedding_and_head_with_their_scales_in_other_regions(release_src, tmp_path):
    """A source whose embedding and LM head are FP8 with 128x128 block scales. Each global tensor is a region of
    its own, so a global weight's `.scale` lies in another region: prefill (rows of the embedding, slices of the
    head) and export both find and apply it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from moepack.format_spec.source_formats import fp8_block_dequantize, fp8_block_quantize
    from moepack.packer.export import export_container
    from moepack.runtime.engine import PrefillOptions, prefill

    transformers = pytest.importorskip("transformers")
    src = str(tmp_path / "src")
    shutil.copytree(release_src, src)
    index_path = os.path.join(src, "model.safetensors.index.json")
    index = json.load(open(index_path))
    decoded = {}
    for name in ("embed.weight", "head.weight"):
        shard = os.path.join(src, index["weight_map"][name])
        tensors = load_file(shard)
        tensors[name], tensors[name.replace(".weight", ".scale")] = fp8_block_quantize(tensors[name].float())
        decoded[name] = fp8_block_dequantize(*[tensors[n] for n in (name, name.replace(".weight", ".scale"))])
        save_file(tensors, shard, metadata={"format": "pt"})
        index["weight_map"][name.replace(".weight", ".scale")] = index["weight_map"][name]
    json.dump(index, open(index_path, "w"))
    out = str(tmp_path / "fp8-globals.moepack")
    convert_checkpoint(src, out, policy="keep", progress=False)
    with Container(out) as c:
        assert c.tensors["head.weight"].dtype == "F8_E4M3"
        assert c.tensors["head.scale"].region.offset != c.tensors["head.weight"].region.offset
    exported = str(tmp_path / "export")
    export_container(out, exported, dtype="f32", progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    assert torch.equal(model.get_output_embeddings().weight.detach(), decoded["head.weight"])
    assert torch.equal(model.get_input_embeddings().weight.detach(), decoded["embed.weight"])
    ids = torch.randint(3, 500, (45,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids[None]).logits[0, -1]
    got = prefill(out, ids, PrefillOptions()).logits
    assert (got - ref).abs().max() <= 1e-3 * ref.abs().max()
