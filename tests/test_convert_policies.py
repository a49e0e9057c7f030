"""`moepack convert --fp4/--nvfp4/--q8/--q2/--bf16`: types per role, fidelity to the source, resumability,
a full disk, bounded memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from containers import source_reads_fail_at
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.reader import Container
from moepack.format_spec.verify import verify_container
from moepack.packer.convert import convert_checkpoint
from moepack.packer.fidelity import compare_with_source
from moepack.packer.synth import synth_checkpoint

# small enough that the 2-bit search stays quick
SMALL = {"n_routed_experts": 4, "num_experts_per_tok": 2}

EXPECTED = {  # policy -> (gate/up, down, dense linear, expert bits per weight)
    "fp4": ("MXFP4", "MXFP4", "Q8_0", 4.25),
    "nvfp4": ("NVFP4", "NVFP4", "Q8_0", 4.5),
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
    assert summary["expert_bits_per_weight"] == pytest.approx(bpw)
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


def test_verify_source_catches_a_different_checkpoint(release_src, tmp_path):
    other = str(tmp_path / "other")
    synth_checkpoint(other, preset="tiny", layout="release", seed=9, progress=False, config_overrides=SMALL)
    out = str(tmp_path / "fp4.moepack")
    convert_checkpoint(release_src, out, policy="fp4", progress=False)
    report = compare_with_source(out, other, progress=False)
    assert not report["ok"]
    problems = " ".join(f["problem"] for f in report["failures"])
    assert "bytes differ" in problems and "should be lossless" in problems and "exceeds its threshold" in problems


def test_quantized_prefill_matches_transformers_on_the_export(release_src, tmp_path):
    transformers = pytest.importorskip("transformers")
    from moepack.packer.export import export_container
    from moepack.runtime.engine import PrefillOptions, prefill

    out = str(tmp_path / "fp4.moepack")
    convert_checkpoint(release_src, out, policy="fp4", progress=False)
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


def _mount_tmpfs(path: str, size: str) -> bool:
    os.makedirs(path, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                          capture_output=True).returncode == 0


def test_disk_full_is_one_line_and_keeps_the_partial(release_src, tmp_path):
    small = str(tmp_path / "small-disk")
    if not _mount_tmpfs(small, "2M"):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        out = os.path.join(small, "full.moepack")
        with pytest.raises(MoepackError, match="disk full") as info:
            convert_checkpoint(release_src, out, policy="keep", progress=False)
        assert "\n" not in str(info.value)
        assert not os.path.exists(out) and os.path.exists(out + ".partial")
        # room again: the rerun resumes from the journal and finishes
        subprocess.run(["mount", "-o", "remount,size=64M", small], check=True)
        summary = convert_checkpoint(release_src, out, policy="keep", progress=False)
        assert summary["resumed_regions"] > 0
        verify_container(out)
    finally:
        subprocess.run(["umount", "-l", small])


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
