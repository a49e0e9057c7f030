"""A GPU's bf16 prefill, run on a CPU along the CUDA branches (tests/gpu_branches.py): the attention and the
Lightning Indexer do no float32 work over every head and compressed entry, make the host wait for nothing, and
give the float32 reference's entries and logits within bf16's tolerance."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moepack.families.deepseek_v4 import model
from moepack.families.deepseek_v4.config import CSA
from moepack.format_spec.reader import Container
from moepack.runtime.engine import PrefillOptions, model_config, prefill

from containers import tiny_keep_container
from gpu_branches import audited_prefill, cuda_branches


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_keep_container(tmp_path_factory)


def _ids(n: int) -> list[int]:
    return [3 + (7 * i) % 500 for i in range(n)]


def test_a_gpu_bf16_prefill_does_no_float32_work_over_heads_and_entries(tiny, monkeypatch):
    """Per layer, N = 256 and 512 (one query chunk: C = N): the float32 matmuls (mHC mixes, router) grow as N,
    not as N x T; no float32 tensor in the indexer is C x heads x T (T = N / rate entries), its bf16 products
    come in key blocks (INDEXER_BLOCK_BYTES, made small here), and neither the attention nor the indexer has an
    op that would make the host wait for the device."""
    cfg = model_config(Container(tiny))
    monkeypatch.setattr(model, "INDEXER_BLOCK_BYTES", 4096)
    rate, heads = cfg.compress_rates[cfg.layer_types.index(CSA)], cfg.index_n_heads
    float32_per_token = {}
    for n in (256, 512):
        _, audit = audited_prefill(tiny, _ids(n))
        parts = {key: p for key, p in audit.parts.items() if key[0] is not None}
        indexers = [p for (_, part), p in parts.items() if part == "indexer"]
        assert len(indexers) == cfg.layer_types.count(CSA)
        for p in indexers:
            assert p.largest_float32[0] < n * heads * (n // rate) * 4, p.largest_float32
            assert p.flops(torch.float32) == 0 and p.flops(torch.bfloat16) > 0
        for (layer, part), p in parts.items():
            if part in ("attention", "indexer"):
                assert p.syncs == [], (layer, part, p.syncs)
        float32_per_token[n] = sum(p.flops(torch.float32) for p in parts.values()) / n
    assert float32_per_token[512] == pytest.approx(float32_per_token[256], rel=1e-9)


def _indexer_inputs(cfg, n_queries: int, n_entries: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    heads, dim = cfg.index_n_heads, cfg.index_head_dim
    q = torch.randn(n_queries, heads * dim, generator=gen)
    head_weights = torch.randn(n_queries, heads, generator=gen)
    keys = torch.randn(n_entries, dim, generator=gen)
    complete = torch.arange(n_entries - n_queries, n_entries) + 1  # the last queries of a prompt
    rotation = model.rope_rotation(cfg.compress_rope, 4 * (n_entries - n_queries), n_queries)
    return (q, head_weights), keys, complete, rotation


@pytest.mark.parametrize("score_bytes, block_bytes", [(1 << 30, 1 << 30), (40_000, 300_000)],
                         ids=["one-block", "rows-and-blocks"])
def test_the_device_indexer_gives_the_float32_scores_and_entries_within_bf16(tiny, monkeypatch, score_bytes,
                                                                             block_bytes):
    """The release's indexer width (64 heads of 128) over 600 entries: the device path's scores (bf16 products,
    ReLU and head sum; in query rows and key blocks where the byte bounds make them) within bf16's rounding of the
    float32 reference's, and the same top-k entries but for near-ties (tests/v4_models.py: a tie is the top-k's
    to break)."""
    cfg = dataclasses.replace(model_config(Container(tiny)), index_n_heads=64, index_head_dim=128, index_topk=64)
    monkeypatch.setattr(model, "INDEXER_SCORE_BYTES", score_bytes)
    monkeypatch.setattr(model, "INDEXER_BLOCK_BYTES", block_bytes)
    projected, keys, complete, rotation = _indexer_inputs(cfg, 48, 600, seed=3)
    x = q_lora = torch.zeros(48, 1)  # (the projections are given)
    exact = {"attn.indexer.wq_b.weight": torch.zeros(1, dtype=torch.float32)}
    low = {"attn.indexer.wq_b.weight": torch.zeros(1, dtype=torch.bfloat16)}
    want = model.indexer_scores(cfg, exact, x, q_lora, rotation, keys, complete, projected)
    with cuda_branches():
        got = model.indexer_scores(cfg, low, x, q_lora, rotation, keys, complete, projected)
        picked = model.indexer_topk(cfg, low, x, q_lora, rotation, keys, complete, projected)
    visible = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), visible) and got.dtype == torch.float32
    scale = want[visible].abs().max()
    error = (got - want)[visible].abs().max()
    assert error <= 2e-2 * scale, (error, scale)
    # per query: the entries clearly above the reference's k-th score (by more than twice the row's error) are
    # picked, those clearly below are not; what lies between is a near-tie, the top-k's to break
    k = cfg.index_topk
    threshold = want.topk(k, dim=-1).values[:, -1:]
    margin = 2 * (got - want).masked_fill(~visible, 0).abs().amax(-1, keepdim=True)
    chosen = torch.zeros_like(visible).scatter_(1, picked.clamp(min=0), picked >= 0)
    above, below = want > threshold + margin, want < threshold - margin
    assert not (above & ~chosen).any() and not (below & chosen).any()
    assert above.sum() >= k * 48 // 2  # most of the choice is clear: not vacuous

def test_the_gpu_branch_bf16_prefill_gives_the_float32_logits_within_bf16(tiny, monkeypatch):
    """The whole prefill (CSA with the indexer choosing among 64 entries, HCA, sliding, hash layers; several query
    chunks and key blocks) along the CUDA branches in bf16 with the grouped experts, against the CPU's float32
    per-expert reference."""
    ids = _ids(256)
    want = prefill(tiny, ids, PrefillOptions(expert_selection="all"))
    monkeypatch.setattr(model, "GPU_QUERY_CHUNK", 96)
    monkeypatch.setattr(model, "INDEXER_BLOCK_BYTES", 20_000)
    monkeypatch.setattr(model, "INDEXER_SCORE_BYTES", 4_000)
    with cuda_branches():
        got = prefill(tiny, ids, PrefillOptions(compute_dtype="bfloat16", expert_dtype="bfloat16",
                                                expert_backend="grouped", expert_selection="all"))
    scale = want.logits.abs().max().item()
    error = (got.logits - want.logits).abs().max().item()
    assert error <= 0.05 * scale
    assert got.stats["expert_backend"] == "grouped"
    best = want.logits.topk(2).values
    if best[0] - best[1] > 2 * error:  # the greedy token where no rounding could change it
        assert got.next_token == want.next_token


def test_the_gpu_prefill_benchmarks_indexer_pass_runs_on_either_branch(tiny):
    """benchmarks/gpu_prefill.py's indexer-only pass (its cells' indexer share): timed along the CPU's and the
    CUDA branches; none for a model without a CSA layer."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu_prefill.py")
    spec = importlib.util.spec_from_file_location("gpu_prefill_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cfg = model_config(Container(tiny))
    calls = []
    real = model.indexer_scores

    def counted(*args, **kwargs):
        calls.append(args[2].shape[0])
        return real(*args, **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model, "indexer_scores", counted)
        assert bench.indexer_seconds(cfg, 300, torch.device("cpu")) > 0
        with cuda_branches():
            assert bench.indexer_seconds(cfg, 300, torch.device("cpu")) > 0
    # CPU chunks of 128 queries, then one chunk of 300 on the device path; each pass twice (an untimed one first)
    assert calls == [128, 128, 44] * 2 + [300] * 2
    no_csa = dataclasses.replace(cfg, layer_types=tuple(t for t in cfg.layer_types if t != CSA))
    assert bench.indexer_seconds(no_csa, 300, torch.device("cpu")) is None


def test_the_memory_estimate_counts_the_indexer_the_device_path_makes():
    """The release at 64K and 128K: on a CUDA device with bf16 products the estimate's indexer is the device path's
    bounded blocks (128K needs no more for it than 64K), on a CPU or in float32 the reference's [C, heads, T]
    products and their float32 copy (16 GiB at 128K with a 1024-query chunk)."""
    import json
    import os

    from moepack.families.deepseek_v4.config import ModelConfig

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "deepseek-v4-flash.config.json")
    with open(path, encoding="utf-8") as f:
        cfg = ModelConfig.from_hf(json.load(f))
    cuda, chunk = torch.device("cuda"), model.GPU_QUERY_CHUNK
    bound = model.INDEXER_SCORE_BYTES + 2 * model.INDEXER_BLOCK_BYTES
    for n in (65536, 131072):
        entries = n // cfg.compress_rates[cfg.layer_types.index(CSA)]
        reference = chunk * cfg.index_n_heads * entries * 8
        on_device = model.DeepseekV4Prefill(cfg, torch.bfloat16).working_set(n, chunk, cuda)["attention_chunk"]
        for dtype, device in ((torch.bfloat16, None), (torch.bfloat16, torch.device("cpu")), (torch.float32, cuda)):
            elsewhere = model.DeepseekV4Prefill(cfg, dtype).working_set(n, chunk, device)["attention_chunk"]
            # (and float32 products gather the CSA entries, [chunk, index_topk, head_dim] and a copy, in 4 bytes)
            gathered = chunk * cfg.index_topk * cfg.head_dim * 2 * (dtype.itemsize - 2)
            assert elsewhere - on_device == reference - bound + gathered
    assert reference == 16 << 30


def test_the_gpu_prefill_benchmark_runs_to_its_end_at_tiny_widths(tmp_path, monkeypatch, capsys):
    """benchmarks/gpu_prefill.py --dims tiny (the release's layer kinds at the tiny preset's widths) on a CPU, to
    its report: every place a row with its numbers, and the host place's wall over its bound, which needs the
    pinned H2D rate a CPU has not (given here, as a GPU measures it)."""
    import importlib.util
    import json
    import os
    import sys

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu_prefill.py")
    spec = importlib.util.spec_from_file_location("gpu_prefill_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "pinned_h2d_gbps", lambda device: 10.0)
    monkeypatch.setattr(bench, "dense_bf16_tflops", lambda device: 1.0)  # (seconds of bf16 on a CPU)
    monkeypatch.setattr(sys, "argv", ["gpu_prefill.py", "--device", "cpu", "--dims", "tiny", "--experts", "8",
                                      "--tokens", "64", "--workdir", str(tmp_path), "--json"])
    bench.main()
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["hidden"] == 256 and report["model"]["experts"] == 8 and report["model"]["csa_layers"] == 1
    rows = {r["place"]: r for r in report["rows"]}
    assert list(rows) == list(bench.PLACES)
    for row in rows.values():
        assert "error" not in row and row["tokens_per_s"] > 0 and row["effective_tflops"] > 0
    assert rows["disk"]["overlap"] > 0 and rows["device"]["load_s"] >= 0
    bound = max(report["model"]["container_bytes"] / 10e9, rows["device"]["seconds"])
    assert rows["host"]["host_wall_over_bound"] == round(rows["host"]["seconds"] / bound, 3)
