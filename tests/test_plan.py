"""moepack plan: the design note's (docs/plan.md) break-even numbers for DeepSeek-V4-Flash, derived from its
config.json, and the sizes of a config agreeing with the container `convert` writes."""

from __future__ import annotations

import json
import math
import os
import re

import pytest

from containers import tiny_keep_container
from click.testing import CliRunner

from moepack.cli.main import cli
from moepack.format_spec.reader import Container
from moepack.tools import plan as P

HERE = os.path.dirname(os.path.abspath(__file__))
V4_CONFIG = os.path.join(HERE, "data", "deepseek-v4-flash.config.json")  # the release's config.json


@pytest.fixture(scope="module")
def v4_config() -> dict:
    return P.load_config(V4_CONFIG)


@pytest.fixture(scope="module")
def v4(v4_config):
    """The config's own figures, and the note's rounding of them (13B active -> 26 GFLOP, 147 GB, 79.6 GB)."""
    fl = P.flops_per_token(v4_config)
    fp4 = P.sizes_from_config(v4_config, "keep")
    q2 = P.sizes_from_config(v4_config, "q2", expert_bpw=2.3)  # the note's q2 mix placeholder, ~2.3 bits/weight
    return {
        "flops": fl, "fp4": fp4, "q2": q2,
        # the note rounds the active parameters to 13B and doubles them; the routed share likewise
        "seed_flops": {"total": 2 * round(fl["active_params"] / 1e9) * 1e9, "routed": round(fl["routed"] / 1e9) * 1e9},
        "seed_W": {"fp4": _sig(fp4.routed_bytes, 3), "q2": _sig(q2.routed_bytes, 3)},
    }


def _sig(x: float, digits: int) -> float:
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


def within_rounding(ours: float, printed: str) -> bool:
    """Does `ours` print as the note's figure? '28.4' -> within 0.05; '3,850' -> within 5; '2,300' -> within 50
    (trailing zeros of an integer are not significant)."""
    text = printed.replace(",", "")
    if "." in text:
        unit = 10 ** -len(text.split(".")[1])
    else:
        stripped = text.rstrip("0")
        unit = 10 ** (len(text) - len(stripped)) if stripped else 1
    return abs(ours - float(text)) <= unit / 2 + 1e-9


def _plan(v4_config, sizes, tflops, flops=None, ssd=14.0, gpus=1, ssds=1, contexts=(8192,), **kw):
    return P.make_plan(sizes, v4_config, ssd_gbps=P.Measured(ssd, "given"), tflops=P.Measured(tflops, "given"),
                       gpus=gpus, ssds=ssds, contexts=contexts, flops=flops, **kw)


# --- the config's own figures -------------------------------------------------------------------------------------

def test_flops_per_token_come_out_of_the_config(v4):
    fl = v4["flops"]
    # "総計算 26 GFLOPs（活性 13B × 2）、うち routed 分 13 GFLOPs"
    assert round(fl["active_params"] / 1e9) == 13 and round(fl["active_params_with_head"] / 1e9) == 13
    assert v4["seed_flops"] == {"total": 26e9, "routed": 13e9}
    assert abs(fl["total"] / 26e9 - 1) < 0.03
    assert fl["routed"] == 6 * 43 * 2 * 3 * 4096 * 2048  # top-6 experts of 25.17M params in 43 layers
    assert fl["parts"]["shared_experts"] == 43 * 2 * 3 * 4096 * 2048
    assert fl["total"] == sum(fl["parts"].values())
    assert fl["head"] == 2 * (129280 * 4096 + 4 * 4 * 4096)


def test_sizes_come_out_of_the_policies(v4_config, v4):
    fp4, q2 = v4["fp4"], v4["q2"]
    assert fp4.expert_params == 3 * 4096 * 2048  # "routed expert 1 個 25.17M パラメータ"
    # the note's size table: expert / one layer (x256) / 43 layers
    for sizes, expert, layer, total in ((fp4, "13.4", "3.42", "147"), (q2, "7.2", "1.85", "79.6")):
        assert within_rounding(sizes.max_expert_bytes / 1e6, expert)
        assert within_rounding(sizes.layers[5].experts_bytes / 1e9, layer)
        assert within_rounding(sizes.routed_bytes / 1e9, total)
    q8 = P.sizes_from_config(v4_config, "q8")
    assert within_rounding(q8.max_expert_bytes / 1e6, "26.7") and within_rounding(q8.routed_bytes / 1e9, "294")
    assert P.sizes_from_config(v4_config, "fp4").routed_bytes == fp4.routed_bytes  # MXFP4 = release FP4 bytes
    # moepack's real q2 mix is 2.25 bits/weight (IQ2_XXS gate/up, Q2_K down): a little under the note's 2.3
    real_q2 = P.sizes_from_config(v4_config, "q2")
    assert real_q2.expert_bpw == 2.25 and within_rounding(real_q2.routed_bytes / 1e9, "77.9")
    # non-routed ~7-9 GB ("約 7.1GB"): FP8 dense + BF16 embedding/head under keep, Q8_0 under fp4
    assert 6.5e9 < P.sizes_from_config(v4_config, "fp4").non_routed_bytes < 9e9


def test_t_ssd(v4_config, v4):
    # "T_SSD = W ÷ BW → q2 で約 5.7 秒、FP4 系で約 10.5 秒"
    for key, printed in (("q2", "5.7"), ("fp4", "10.5")):
        p = _plan(v4_config, v4[key], 100, stream="experts")
        assert within_rounding(p["t_ssd_s"], printed)
        assert p["W_bytes"] == v4[key].routed_bytes and p["resident_bytes"] == v4[key].non_routed_bytes


def test_decode_estimate(v4_config, v4):
    """The design note's decode figures for q2 with no expert cache: about 1.86 GB of routed experts read per token
    and about 7.5 tokens/s at 14 GB/s. Our q2 (IQ2_XXS gate/up + Q2_K down, as converted) reads 1.83 GB."""
    q2 = P.sizes_from_config(v4_config, "q2")
    d = _plan(v4_config, q2, 100)["decode"]
    per_layer = sum(layer.experts_bytes / layer.n_experts for layer in q2.layers)
    assert d["routed_bytes_per_token"] == int(per_layer * 6)  # top-6 of every layer
    assert 1.80e9 <= d["routed_bytes_per_token"] <= 1.90e9
    assert d["bound"] == "ssd" and 7.3 <= d["tokens_per_s_no_cache"] <= 7.8
    assert d["tokens_per_s_no_cache"] == pytest.approx(14e9 / d["routed_bytes_per_token"])
    slow = _plan(v4_config, q2, 1e-6)["decode"]  # a compute rate so low that it binds
    assert slow["bound"] == "compute" and slow["tokens_per_s_no_cache"] < d["tokens_per_s_no_cache"]


# --- the note's tables --------------------------------------------------------------------------------------------

N_STAR = {  # F: (q2 optimistic, q2 conservative, FP4 optimistic, FP4 conservative), in thousands of tokens
    50: ("11", "22", "20", "40"), 100: ("22", "44", "40", "81"), 200: ("44", "87", "81", "162")}


@pytest.mark.parametrize("tflops", sorted(N_STAR))
def test_n_star_table(v4_config, v4, tflops):
    printed = N_STAR[tflops]
    got = []
    for key in ("q2", "fp4"):
        seed = P.make_plan(v4["q2" if key == "q2" else "fp4"], v4_config, ssd_gbps=P.Measured(14, "given"),
                           tflops=P.Measured(tflops, "given"), stream="experts", contexts=[1024],
                           flops=v4["seed_flops"])
        # the same with W rounded as the note prints it
        w = v4["seed_W"][key]
        ns = {k: tflops * 1e12 * w / (v4["seed_flops"][f] * 14e9) for k, f in (("o", "total"), ("c", "routed"))}
        got += [ns["o"], ns["c"]]
        # the plan's own N*, from the unrounded W, agrees to the note's rounding of W
        assert abs(seed["n_star"]["optimistic"] / ns["o"] - 1) < 0.003
        assert abs(seed["n_star"]["conservative"] / ns["c"] - 1) < 0.003
        # and from the config's unrounded FLOPs, within 3%
        raw = P.make_plan(v4[key], v4_config, ssd_gbps=P.Measured(14, "given"), tflops=P.Measured(tflops, "given"),
                          stream="experts", contexts=[1024])
        assert abs(raw["n_star"]["optimistic"] / ns["o"] - 1) < 0.03
        assert abs(raw["n_star"]["conservative"] / ns["c"] - 1) < 0.005
        assert raw["n_star"]["conservative"] == pytest.approx(2 * raw["n_star"]["optimistic"] * raw["flops"]["total"]
                                                              / (2 * raw["flops"]["routed"]))
    for value, text in zip(got, printed):
        assert within_rounding(value / 1000, text), (tflops, value, text)


THROUGHPUT = [  # F = 100 TFLOPS, FP4 147 GB, 14 GB/s: N, bound, seconds, tokens/s
    (8192, "ssd", "10.5", "780"), (16384, "ssd", "10.5", "1,560"), (32768, "ssd", "10.5", "3,120"),
    (65536, "compute", "17", "3,850"), (131072, "compute", "34", "3,850")]


def test_throughput_table(v4_config, v4):
    contexts = [row[0] for row in THROUGHPUT]
    seed = _plan(v4_config, v4["fp4"], 100, flops=v4["seed_flops"], contexts=contexts, stream="experts")
    raw = _plan(v4_config, v4["fp4"], 100, contexts=contexts, stream="experts")
    for (n, bound, seconds, tps), r, q in zip(THROUGHPUT, seed["rows"], raw["rows"]):
        assert r["tokens"] == n and r["bottleneck"] == bound and q["bottleneck"] == bound
        assert within_rounding(r["seconds"], seconds) and within_rounding(r["tokens_per_s"], tps), (n, r)
        assert abs(q["tokens_per_s"] / float(tps.replace(",", "")) - 1) < 0.03
    # the granularity table: a 16-expert FP4 bundle (214 MB) reads in 15.3 ms; its compute takes 6.2 ms at 32K
    # (the read shows) and 24.7 ms at 128K (the read hides)
    bundled = _plan(v4_config, v4["fp4"], 100, flops=v4["seed_flops"], contexts=[32768, 131072], stream="experts",
                    bundle_experts=16)
    r32, r128 = bundled["rows"]
    assert within_rounding(16 * v4["fp4"].max_expert_bytes / 1e6, "214")
    assert within_rounding(r32["bundle_read_s"] * 1e3, "15.3") and within_rounding(r128["bundle_read_s"] * 1e3, "15.3")
    assert within_rounding(r32["bundle_compute_s"] * 1e3, "6.2") and within_rounding(r128["bundle_compute_s"] * 1e3,
                                                                                      "24.7")


def test_attention_term_matches_the_note(v4_config, v4):
    # "二次項は線形項に対して N=32K で数%、64K で 1 割強、128K で 2 割強"
    share = {n: P.attention_flops_per_token(v4_config, n)["growing"] / v4["flops"]["total"]
             for n in (32768, 65536, 131072)}
    assert 0.02 < share[32768] < 0.09 and 0.10 < share[65536] < 0.17 and 0.20 < share[131072] < 0.30
    p = _plan(v4_config, v4["fp4"], 100, contexts=[131072], stream="experts", with_attention=True)
    assert p["rows"][0]["seconds"] == pytest.approx(p["rows"][0]["t_compute_with_attention_s"])
    assert p["rows"][0]["seconds"] > 1.2 * p["rows"][0]["t_compute_s"]


def test_vram_budget_table(v4_config, v4):
    # 128K prefill, FP4, 16-expert bundles double-buffered: 0.35 + 0.43 + 4.3 + 0.1 GB = "約 5.2GB"
    v = P.vram_budget(v4["fp4"], 131072, v4_config, stream="all", bundle_experts=16, queue_depth=2)
    dense, buffers, activations, kv = (row["bytes"] / 1e9 for row in v["rows"])
    assert within_rounding(dense, "0.35") and within_rounding(buffers, "0.43")
    assert within_rounding(activations, "4.3") and within_rounding(kv, "0.1")
    assert within_rounding(v["total_bytes"] / 1e9, "5.2")
    assert 4096 * 4 * 2 == v["rows"][2]["bytes"] // 131072  # "32KB/トークン"
    # non-routed resident instead (~7 GB + 4.3 GB of activations: "16GB にぎりぎり収まる")
    fp4_policy = P.sizes_from_config(v4_config, "fp4")
    resident = P.vram_budget(fp4_policy, 131072, v4_config, stream="experts", bundle_experts=16, queue_depth=2)
    assert resident["total_bytes"] < 16 * 2 ** 30
    p = _plan(v4_config, v4["fp4"], 100, contexts=[32768, 131072], stream="all", vram_gib=6, bundle_experts=16,
              queue_depth=2)
    assert p["vram_verdict"]["fits_up_to_tokens"] == 131072
    p = _plan(v4_config, v4["fp4"], 100, contexts=[32768, 131072], stream="all", vram_gib=4, bundle_experts=16,
              queue_depth=2)
    assert p["vram_verdict"]["fits_up_to_tokens"] == 32768 and p["vram_verdict"]["headroom_bytes_at_max"] < 0


# --- Appendix A: RTX 5060 Ti 16GB x2 ------------------------------------------------------------------------------

APPENDIX_N_STAR = {30: ("12", "24", "12", "1,150", "2,300"), 55: ("22", "44", "22", "2,100", "4,230"),
                   110: ("44", "89", "44", "4,230", "8,460")}
APPENDIX_TIMES = {  # N: (1 GPU + 1 SSD, 2 GPUs + 1 SSD, 2 GPUs + 2 SSDs) as (seconds, tokens/s), 30 TFLOPS each
    32768: (("28.4", "1,150"), ("14.2", "2,300"), ("14.2", "2,300")),
    65536: (("56.8", "1,150"), ("28.4", "2,300"), ("28.4", "2,300")),
    131072: (("113.6", "1,150"), ("56.8", "2,300"), ("56.8", "2,300"))}
SETUPS = ((1, 1), (2, 1), (2, 2))


@pytest.mark.parametrize("tflops", sorted(APPENDIX_N_STAR))
def test_appendix_n_star(v4_config, v4, tflops):
    printed = APPENDIX_N_STAR[tflops]
    for (gpus, ssds), text in zip(SETUPS, printed[:3]):
        p = _plan(v4_config, v4["fp4"], tflops, flops=v4["seed_flops"], gpus=gpus, ssds=ssds, stream="experts",
                  contexts=[1 << 20])
        assert within_rounding(p["n_star"]["optimistic"] / 1000, text), (tflops, gpus, ssds, p["n_star"])
        # the compute-bound ceiling (a long prompt): 1 GPU / 2 GPUs
        if (gpus, ssds) != (2, 2):
            assert within_rounding(p["rows"][0]["tokens_per_s"], printed[3 + gpus - 1])


def test_appendix_times(v4_config, v4):
    for i, (gpus, ssds) in enumerate(SETUPS):
        p = _plan(v4_config, v4["fp4"], 30, flops=v4["seed_flops"], gpus=gpus, ssds=ssds, stream="experts",
                  contexts=sorted(APPENDIX_TIMES))
        for r in p["rows"]:
            seconds, tps = APPENDIX_TIMES[r["tokens"]][i]
            assert r["bottleneck"] == "compute"
            assert within_rounding(r["seconds"], seconds) and within_rounding(r["tokens_per_s"], tps), (gpus, ssds, r)
    # two GPUs are never slower: at N <= 12K both wait 10.5 s for the one SSD
    one = _plan(v4_config, v4["fp4"], 30, flops=v4["seed_flops"], stream="experts", contexts=[4096, 12000])
    two = _plan(v4_config, v4["fp4"], 30, flops=v4["seed_flops"], gpus=2, stream="experts", contexts=[4096, 12000])
    for a, b in zip(one["rows"], two["rows"]):
        assert b["seconds"] <= a["seconds"] and within_rounding(a["seconds"], "10.5")
    # SSD x2 carries 56 GB/s of host RAM traffic ("書き込み 28GB/s + 読み出し 28GB/s ≈ 56GB/s")
    p = _plan(v4_config, v4["fp4"], 30, flops=v4["seed_flops"], gpus=2, ssds=2, stream="experts", contexts=[32768],
              mem_gbps=P.Measured(60, "given"))
    assert p["host_memory"]["traffic_gbps"] == pytest.approx(56)
    assert p["rows"][0]["stages_s"]["host_memory"] == pytest.approx(p["W_bytes"] / 60e9)


# --- sizes from a config agree with the container convert writes ---------------------------------------------------

def test_config_sizes_equal_the_converted_container(tiny_keep):
    path, config = tiny_keep
    from_config = P.sizes_from_config(config, "keep")
    with Container(path) as c:
        from_file = P.sizes_from_container(c)
    assert from_config.layers == from_file.layers
    assert from_config.global_bytes == from_file.global_bytes and from_config.mtp_bytes == from_file.mtp_bytes
    assert from_config.expert_params == from_file.expert_params
    assert from_config.file_bytes <= from_file.file_bytes < from_config.file_bytes + (1 << 20)  # + the index
    assert from_config.expert_bpw == from_file.expert_bpw == 4.25


@pytest.fixture(scope="module")
def tiny_keep(tmp_path_factory):
    path = tiny_keep_container(tmp_path_factory)
    with open(os.path.join(os.path.dirname(path), "src", "config.json")) as f:
        config = json.load(f)
    return path, config


@pytest.mark.parametrize("policy", ["fp4", "nvfp4"])  # nvfp4: each weight carries its tensor scale
def test_config_sizes_equal_a_quantized_conversion(tiny_keep, tmp_path, policy):
    from moepack.packer.convert import convert_checkpoint

    path, config = tiny_keep
    out = str(tmp_path / f"{policy}.moepack")
    convert_checkpoint(os.path.join(os.path.dirname(path), "src"), out, policy=policy, progress=False)
    with Container(out) as c:
        from_file = P.sizes_from_container(c)
    from_config = P.sizes_from_config(config, policy)
    assert from_config.layers == from_file.layers
    assert from_config.expert_params == from_file.expert_params  # tensor scales are not parameters


# --- helpers ------------------------------------------------------------------------------------------------------

def test_parse_tokens_and_ranges():
    assert P.parse_tokens("8K") == 8192 and P.parse_tokens("128k") == 131072 and P.parse_tokens("3000") == 3000
    assert P.parse_tokens("1M") == 1 << 20 and P.fmt_tokens(131072) == "128K" and P.fmt_tokens(3000) == "3000"
    with pytest.raises(P.MoepackError):
        P.parse_tokens("lots")
    assert P._ranges([0, 1, 2, 5, 7, 9, 11]) == "0-2,5-11/2" and P._ranges([4, 6]) == "4,6"
    for n in (1, 3, 4, 5, 17, 100):
        for rate in (4, 8):
            for cap in (None, 2, 3):
                assert P.sum_entries(n, rate, cap) == sum(min(cap or 10 ** 9, (t + 1) // rate) for t in range(n))


def test_measured_curve_break_even(v4_config, v4):
    flat = P.ComputeCurve([(1, 50e12), (10_000, 50e12)])
    curve = P.make_plan(v4["fp4"], v4_config, ssd_gbps=P.Measured(14, "m"), compute_curve=flat, contexts=[8192],
                        stream="experts")
    const = _plan(v4_config, v4["fp4"], 50, stream="experts")
    assert curve["n_star"]["optimistic"] == pytest.approx(const["n_star"]["optimistic"], rel=1e-6)
    rising = P.ComputeCurve([(1, 1e12), (100, 10e12), (1000, 100e12)])
    assert rising(10) == pytest.approx(10 ** 12.5) and rising(0.5) == 1e12 and rising(5000) == 100e12
    p = P.make_plan(v4["fp4"], v4_config, ssd_gbps=P.Measured(14, "m"), compute_curve=rising, contexts=[8192],
                    stream="experts")
    n = p["n_star"]["optimistic"]
    assert v4["flops"]["total"] * n / rising(n * 6 / 256) == pytest.approx(p["t_ssd_s"], rel=1e-6)


# --- the CLI ------------------------------------------------------------------------------------------------------


def test_cli_plan_json(v4_config, tmp_path, monkeypatch):
    monkeypatch.setenv("MOEPACK_CACHE_DIR", str(tmp_path / "cache"))
    r = CliRunner().invoke(cli, ["plan", V4_CONFIG, "--ssd-gbps", "14", "--tflops", "100", "--stream", "experts",
                                 "--context", "8K,32K", "--context", "128K", "--vram-gib", "16", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["ok"] and [row["tokens"] for row in out["rows"]] == [8192, 32768, 131072]
    assert within_rounding(out["t_ssd_s"], "10.5") and out["settings"]["ssd_source"] == "given"
    assert out["vram_verdict"]["fits_up_to_tokens"] == 131072
    r = CliRunner().invoke(cli, ["plan", V4_CONFIG, "--policy", "q2", "--expert-bpw", "2.3", "--ssd-gbps", "14",
                                 "--tflops", "50", "--stream", "experts"])
    assert r.exit_code == 0, r.output
    assert "T_SSD = W / BW = 5.69 s" in r.output and "N* = F x W" in r.output


def test_cli_plan_defaults_are_labelled(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEPACK_CACHE_DIR", str(tmp_path / "empty-cache"))
    r = CliRunner().invoke(cli, ["plan", "small", "--context", "2K", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)["settings"]
    assert s["ssd_source"].startswith("assumed") and s["compute_source"].startswith("assumed")
    assert (s["bundle_experts"], s["queue_depth"]) == (16, 2)


def test_cli_plan_errors(tiny_keep, tmp_path, monkeypatch):
    monkeypatch.setenv("MOEPACK_CACHE_DIR", str(tmp_path / "cache"))
    runner = CliRunner()
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(64))
    for args, message in ((["plan", str(tmp_path / "nope.json")], "no such file"),
                          (["plan", str(gguf)], f"is a GGUF file: plan a container, or its checkpoint's config.json; "
                                                f"convert it first, e.g. `moepack convert {gguf} --fp4`"),
                          (["plan", tiny_keep[0], "--policy", "q2"], "--policy is for a config"),
                          (["plan", "tiny", "--context", "soon"], "bad context length")):
        r = runner.invoke(cli, args)
        assert r.exit_code == 1, r.output
        lines = [line for line in r.output.splitlines() if line.strip()]
        assert lines == [f"moepack: error: {lines[0][len('moepack: error: '):]}"] and message in lines[0]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = runner.invoke(cli, ["plan", str(bad), "--json"])
    assert r.exit_code == 1 and json.loads(r.output.splitlines()[0])["ok"] is False


def test_cli_plan_plot(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("MOEPACK_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "plan.png"
    r = CliRunner().invoke(cli, ["plan", V4_CONFIG, "--ssd-gbps", "14", "--tflops", "100", "--stream", "experts",
                                 "--plot", str(out)])
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


QWEN3_235B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
              "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94,
              "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
              "num_experts_per_tok": 8, "vocab_size": 151936, "norm_topk_prob": True, "tie_word_embeddings": False,
              "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}


def test_the_family_says_its_residual_streams_and_what_its_kv_holds(tmp_path):
    """The plan takes every model-side fact from the family: DeepSeek-V4's 4 mHC streams and its CSA layers'
    indexer keys beside the KV; Qwen3-MoE's one residual and plain keys and values."""
    qwen = tmp_path / "config.json"
    qwen.write_text(json.dumps(QWEN3_235B))
    for config, streams, kv in ((V4_CONFIG, 4, "one layer's KV + indexer KV (F32"), (str(qwen), 1, "one layer's KV (F32")):
        r = CliRunner().invoke(cli, ["plan", config, "--context", "8K", "--json"])
        assert r.exit_code == 0, r.output
        p = json.loads(r.output)
        assert p["model"]["residual_streams"] == streams and "hc_mult" not in p["model"]
        rows = {row["item"].split(")")[0] + ")": row["bytes"] for row in p["vram"][-1]["rows"]}
        assert rows[f"layer-boundary activations (8K x {streams} x 4096 x 2 B)"] == 8192 * streams * 4096 * 2
        assert [item for item in (row["item"] for row in p["vram"][-1]["rows"]) if item.startswith(kv)]


def test_a_model_with_no_routed_experts_is_named_not_a_flops_error(tmp_path):
    """A Qwen3-MoE whose every layer is a dense MLP (mlp_only_layers) streams nothing: the plan says so in one
    line, not that its FLOPs are not positive."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**QWEN3_235B, "num_hidden_layers": 2, "mlp_only_layers": [0, 1]}))
    r = CliRunner().invoke(cli, ["plan", str(config), "--context", "8K", "--json"])
    assert r.exit_code == 1, r.output
    assert json.loads(r.stdout)["error"] == ("this model has no routed experts (every layer a dense MLP): nothing of "
                                             "it is streamed from disk, so there is no break-even to plan")


def test_a_checkpoint_directory_is_sized_by_its_headers(tmp_path, monkeypatch):
    """A checkpoint directory is sized as it stores its weights (an F32 one at 32 bits, not at the 16 its config
    implies) and only with the blocks it holds (no MTP where it has none): `plan DIR` agrees with what `convert
    --keep` then writes."""
    from moepack.packer.convert import convert_checkpoint
    from moepack.packer.source import CheckpointDir
    from moepack.packer.synth import synth_checkpoint

    monkeypatch.setenv("MOEPACK_CACHE_DIR", str(tmp_path / "cache"))
    src, out = str(tmp_path / "src"), str(tmp_path / "f32.moepack")
    synth_checkpoint(src, preset="tiny", layout="f32", seed=3, progress=False)
    r = CliRunner().invoke(cli, ["plan", src, "--ssd-gbps", "14", "--tflops", "100", "--context", "1K", "--json"])
    assert r.exit_code == 0, r.output
    planned = json.loads(r.output)["model"]
    convert_checkpoint(src, out, policy="keep", progress=False)
    with Container(out) as c:
        written = P.sizes_from_container(c)
    assert planned["source"] == "checkpoint" and planned["mtp_bytes"] == written.mtp_bytes > 0
    assert planned["file_bytes"] <= written.file_bytes < planned["file_bytes"] + (1 << 20)  # + the index
    config = json.load(open(os.path.join(src, "config.json")))
    assert P.sizes_from_config(config, "keep").file_bytes < 0.7 * written.file_bytes  # the config alone: 16 bits

    source = CheckpointDir(src)
    stored = {name: (t.dtype, t.shape) for name, t in source.tensors.items() if not name.startswith("mtp.")}
    source.close()
    without_mtp = P.sizes_from_config(config, "keep", stored=stored)
    assert without_mtp.mtp_bytes == 0 and without_mtp.file_bytes == planned["file_bytes"] - written.mtp_bytes
    # a partial download: an expert of one layer missing (not the last: its id cannot be counted up to) is no
    # smaller model, but one convert refuses
    partial = {name: v for name, v in stored.items() if not name.startswith("layers.1.ffn.experts.1.")}
    with pytest.raises(P.MoepackError, match=r"^the checkpoint holds (\d+) of layers\.1's (\d+) routed experts "
                                             r"\(1 layers short\)$") as refused:
        P.sizes_from_config(config, "keep", stored=partial)
    held, named = map(int, re.match(r"\D+(\d+)\D+1's (\d+)", str(refused.value)).groups())
    assert held == named - 1, refused.value


def test_a_checkpoint_directory_missing_a_layer_is_sized_by_its_config(tmp_path):
    """A checkpoint whose headers hold none of a layer the config names (a truncated or hand-trimmed one) is sized
    by its config.json, with a note saying why, not a KeyError."""
    import shutil

    from safetensors.numpy import save_file
    import numpy as np

    shutil.copy(V4_CONFIG, tmp_path / "config.json")
    save_file({"embed.weight": np.zeros((4, 4), np.float32)}, str(tmp_path / "model.safetensors"))
    config = P.load_config(V4_CONFIG)
    with pytest.raises(P.MoepackError, match=r"^the checkpoint holds no tensor of layers\.0 \("):
        P.sizes_from_config(config, stored={"embed.weight": ("F32", (4, 4))})
    r = CliRunner().invoke(cli, ["plan", str(tmp_path), "--ssd-gbps", "14", "--tflops", "100", "--context", "1K",
                                 "--json"])
    assert r.exit_code == 0, r.output
    planned = json.loads(r.output)["model"]
    assert planned["source"] == "config" and planned["file_bytes"] == P.sizes_from_config(config).file_bytes
    assert planned["notes"][0].startswith("sized from config.json alone: the weights do not match it (the "
                                          "checkpoint holds no tensor of layers.0"), planned["notes"]


def test_planning_a_config_loads_no_torch():
    """`plan` is a calculator: sizing a config (the release's tensor schema, its FP8 / FP4 blocks) and taking bench's
    measurements import no torch (seconds of start-up), as tools/measured.py says."""
    import subprocess
    import sys

    code = ("import sys; from click.testing import CliRunner; from moepack.cli.main import cli\n"
            f"r = CliRunner().invoke(cli, ['plan', {V4_CONFIG!r}, '--ssd-gbps', '14', '--tflops', '100', '--json'])\n"
            "print(r.exit_code, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["0", "False"], done.stdout + done.stderr


@pytest.mark.parametrize("family, experts_key", [("deepseek_v4", "n_routed_experts"), ("qwen3_moe", "num_experts")])
def test_a_config_of_absurdly_many_routed_experts_is_refused_at_once(tmp_path, family, experts_key):
    """plan (and convert, and the checks) list every routed expert's tensors: 2^31 experts in 4 layers had run for
    hours, and Qwen3-MoE's own bounds (4096 layers of 65536 experts) allowed as many."""
    import importlib
    import time

    from moepack.families.base import MAX_ROUTED_EXPERTS

    config = importlib.import_module(f"moepack.families.{family}.synth").preset_config("tiny")
    for experts in (1 << 31, MAX_ROUTED_EXPERTS // config["num_hidden_layers"] + 1):
        path = tmp_path / "config.json"
        path.write_text(json.dumps({**config, experts_key: experts}))
        started = time.perf_counter()
        r = CliRunner().invoke(cli, ["plan", str(path)])
        assert r.exit_code == 1 and f"config.json{':' * (family == 'deepseek_v4')} {experts_key}" in r.output, r.output
        assert time.perf_counter() - started < 5
    assert f"{MAX_ROUTED_EXPERTS} routed experts in all" in r.output, r.output  # (2^31: past Qwen3's own bound)
