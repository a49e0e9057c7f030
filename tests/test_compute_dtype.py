"""`--compute-dtype auto`: the default dtype of the layers' matmuls chosen per CPU (measured by `moepack bench
compute`, else from the CPU's bf16 features), reported with its reason, overridden by naming a dtype; and the
logits of each choice against float32."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from moepack.cli.main import cli
from moepack.packer.convert import convert_checkpoint
from moepack.packer.synth import synth_checkpoint
from moepack.runtime import tuning
from moepack.runtime.engine import PrefillOptions, prefill, resolve_compute_dtype
from moepack.tools import bench

CPU = torch.device("cpu")


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path / "cache"))


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx512f avx512_bf16 amx_tile\n\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")
    assert tuning.cpu_flags(str(x86)) == {"fpu", "avx512f", "avx512_bf16", "amx_tile"}
    assert "bf16" in tuning.cpu_flags(str(arm))
    assert tuning.cpu_flags(str(tmp_path / "missing")) == set()


@pytest.mark.parametrize("flags,want", [({"avx512f", "avx512_bf16"}, "bfloat16"), ({"amx_bf16"}, "bfloat16"),
                                        ({"asimd", "bf16"}, "bfloat16"), ({"avx2", "avx512f"}, "float32"),
                                        (set(), "float32")])
def test_before_any_measurement_native_bf16_decides(empty_cache, monkeypatch, flags, want):
    monkeypatch.setattr(tuning, "cpu_flags", lambda: flags)
    dtype, why = tuning.default_compute_dtype(CPU)
    assert dtype == want and why.startswith("native bf16") == (want == "bfloat16")
    assert tuning.default_compute_dtype(torch.device("cuda")) [0] == "float32"


def test_a_measurement_for_this_cpu_overrides_its_flags(empty_cache, monkeypatch):
    monkeypatch.setattr(tuning, "cpu_flags", lambda: {"avx512_bf16"})
    slow_bf16 = {"choice": "float32", "float32_gflops": 100.0, "bfloat16_gflops": 90.0}
    tuning.store("compute_dtype", "another CPU model", {**slow_bf16, "choice": "bfloat16"})
    assert tuning.default_compute_dtype(CPU)[0] == "bfloat16"  # another CPU's measurement does not count
    tuning.store("compute_dtype", tuning.cpu_model(), slow_bf16)
    dtype, why = tuning.default_compute_dtype(CPU)
    assert dtype == "float32" and "bench compute" in why and "0.90x" in why


def test_the_measurement_times_both_dtypes_and_chooses_by_them():
    got = bench.measure_compute_dtype(256, 128, repeat=1)
    assert got["float32_gflops"] > 0 and got["bfloat16_gflops"] > 0
    wins = got["bfloat16_gflops"] >= bench.BF16_WINS_BY * got["float32_gflops"]
    assert got["choice"] == ("bfloat16" if wins else "float32")


def test_bench_compute_records_the_choice_auto_then_takes(empty_cache, monkeypatch):
    result = bench.bench_compute(tokens=(8,), hidden=64, intermediate=64, experts=1, repeat=1)
    choice = result["compute_dtype"]["choice"]
    monkeypatch.setattr(tuning, "cpu_flags", lambda: set())  # the flags would say float32
    options, source = resolve_compute_dtype(PrefillOptions(compute_dtype="auto"), CPU)
    assert options.compute_dtype == choice and source.startswith("auto: moepack bench compute")
    assert resolve_compute_dtype(PrefillOptions(compute_dtype="float32"), CPU) == (
        PrefillOptions(compute_dtype="float32"), "given")


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    base = tmp_path_factory.mktemp("compute_dtype")
    synth_checkpoint(str(base / "src"), preset="tiny", layout="release", progress=False)
    out = str(base / "tiny.moepack")
    convert_checkpoint(str(base / "src"), out, progress=False)
    return out


@pytest.mark.parametrize("flags,want", [({"avx512_bf16"}, "bfloat16"), (set(), "float32")])
def test_the_commands_default_to_auto_and_say_why(container, empty_cache, monkeypatch, tmp_path, flags, want):
    monkeypatch.setattr(tuning, "cpu_flags", lambda: flags)
    ids = tmp_path / "ids.json"
    ids.write_text("[5, 6, 7, 8]")
    runner = CliRunner()
    r = runner.invoke(cli, ["prefill", container, "--token-ids", str(ids), "--json"])
    assert r.exit_code == 0, r.output
    stats = json.loads(r.output)  # prefill's stats are the object's own keys
    assert stats["compute_dtype"] == want and stats["compute_dtype_source"].startswith("auto: ")
    r = runner.invoke(cli, ["generate", container, "--token-ids", str(ids), "--max-new-tokens", "2", "--json"])
    assert r.exit_code == 0, r.output
    prefill_stats = json.loads(r.output)["stats"]["prefill"]
    assert prefill_stats["compute_dtype"] == want and prefill_stats["compute_dtype_source"].startswith("auto: ")
    r = runner.invoke(cli, ["prefill", container, "--token-ids", str(ids), "--compute-dtype", "float32", "--json"])
    stats = json.loads(r.output)
    assert (stats["compute_dtype"], stats["compute_dtype_source"]) == ("float32", "given")


def test_each_choice_against_float32(container):
    """bfloat16's logits stay within a few hundredths of the logit scale of float32's; float32 is itself."""
    ids = torch.randint(0, 500, (200,), generator=torch.Generator().manual_seed(3))
    reference = prefill(container, ids, PrefillOptions(compute_dtype="float32")).logits
    low = prefill(container, ids, PrefillOptions(compute_dtype="bfloat16")).logits
    error = float((low - reference).abs().max() / reference.abs().max())
    assert 0 < error < 5e-2
