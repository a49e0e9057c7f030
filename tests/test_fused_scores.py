"""The fused weighted-ReLU head sum (backends/fused_scores.py) under Triton's interpreter on the CPU: its scores
against torch's (the Lightning Indexer's _bf16_index_scores) and the float32 reference, -inf exactly past each
query's count, the FP8 variant within its tolerance, and the selection: torch's where the kernel does not apply,
raises or is wrong, the faster of the two otherwise. Skipped where Triton is not installed (the project's CI)."""

from __future__ import annotations

import warnings

import pytest
import torch

from triton_interpreter import compiled_for_hopper, import_for_the_interpreter, interpreting

import_for_the_interpreter()

from moepack.backends import fused_scores  # noqa: E402
from moepack.families.deepseek_v4.model import _bf16_index_scores  # noqa: E402


@pytest.fixture
def interpreted(monkeypatch):
    interpreting(monkeypatch, fused_scores)
    monkeypatch.setattr(fused_scores, "MIN_FUSED_WORK", 0)  # (the interpreter's shapes are tiny)
    return monkeypatch


def operands(n_queries: int, heads: int, head_dim: int, entries: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_queries, heads, head_dim, generator=g).bfloat16()
    keys = torch.randn(entries, head_dim, generator=g).bfloat16()
    weights = (torch.randn(n_queries, heads, generator=g) * (heads * head_dim) ** -0.5).bfloat16()
    return q, keys, weights


def float32_scores(q, keys, weights):
    products = torch.einsum("chd,td->cht", q.float(), keys.float()).relu()
    return (weights.float()[:, :, None] * products).sum(1)


def torch_scores(q, keys, weights, monkeypatch):
    with monkeypatch.context() as m:
        m.setenv(fused_scores.FORCE_ENV, "0")
        return _bf16_index_scores(q, keys, weights)


@pytest.mark.parametrize("n_queries, heads, head_dim, entries", [(37, 4, 32, 71), (19, 16, 64, 45), (5, 7, 16, 33)])
def test_fused_scores_equal_torch_and_float32(interpreted, n_queries, heads, head_dim, entries):
    q, keys, weights = operands(n_queries, heads, head_dim, entries)
    got = fused_scores.weighted_relu_head_sum(q, keys, weights)
    assert got.shape == (n_queries, entries) and got.dtype == torch.float32
    # float32 sums of exact bf16 products: the float32 reference's to float32 rounding
    assert fused_scores.relative_error(got, float32_scores(q, keys, weights)) < 1e-5
    # torch's rounds each product and the heads' sum to bf16
    want = torch_scores(q, keys, weights, interpreted)
    assert 0 < fused_scores.relative_error(got, want) < 1e-2


def test_minus_inf_exactly_past_each_count(interpreted):
    q, keys, weights = operands(40, 5, 32, 100, seed=1)
    # 0, a few, past the end; rows 32.. (the second query tile) see at most 20: key tiles from 32 on are skipped
    counts = torch.tensor([0, 1, 100, 130] + [7 * i % 90 for i in range(28)] + [20, 3, 0, 19, 1, 20, 2, 11])
    got = fused_scores.weighted_relu_head_sum(q, keys, weights, counts)
    hidden = torch.arange(100)[None, :] >= counts[:, None]
    assert torch.equal(torch.isneginf(got), hidden)
    want = float32_scores(q, keys, weights).masked_fill(hidden, float("-inf"))
    assert fused_scores.relative_error(got, want) < 1e-5


def test_fp8_scores_within_their_tolerance(interpreted):
    q, keys, weights = operands(21, 8, 128, 50, seed=2)
    want = float32_scores(q, keys, weights)
    got = fused_scores.weighted_relu_head_sum_fp8(q, keys, weights)
    # e4m3 keeps 3 mantissa bits: measured 3-4 % of the largest score on such data, bf16's is 0.3 %
    assert 1e-3 < fused_scores.relative_error(got, want) < 0.06
    counts = torch.arange(21) * 3
    masked = fused_scores.weighted_relu_head_sum_fp8(q, keys, weights, counts)
    assert torch.equal(torch.isneginf(masked), torch.arange(50)[None, :] >= counts[:, None])


def test_selection_keeps_the_faster_and_records_it(interpreted):
    q, keys, weights = operands(9, 4, 16, 40, seed=3)
    got = _bf16_index_scores(q, keys, weights)
    (key, decision), = fused_scores.DECISIONS.items()
    assert key == fused_scores.shape_class(q, keys) and "heads=4" in key and "T<=64" in key
    assert decision["fused_s"] > 0 and decision["torch_s"] > 0 and decision["error"] < 1e-2
    assert decision["chosen"] == ("fused" if decision["fused_s"] < decision["torch_s"] else "torch")
    assert fused_scores.relative_error(got, float32_scores(q, keys, weights)) < 1e-2
    # a later call of the class follows the decision without timing again
    calls = []
    fused_scores.weighted_relu_scores(q, keys[:35], weights, lambda: calls.append(1) or torch.zeros(9, 35))
    assert calls == ([1] if decision["chosen"] == "torch" else [])
    assert len(fused_scores.DECISIONS) == 1


def test_selection_falls_back_when_the_kernel_raises(interpreted):
    q, keys, weights = operands(9, 4, 16, 40, seed=4)

    def broken(*args):
        raise RuntimeError("no kernel image is available\nsecond line")
    interpreted.setattr(fused_scores, "_launch", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _bf16_index_scores(q, keys, weights)
    assert torch.equal(got, torch_scores(q, keys, weights, interpreted))
    assert [str(w.message).count("\n") for w in caught] == [0]
    assert "RuntimeError: no kernel image is available" in str(caught[0].message)
    decision = fused_scores.DECISIONS[fused_scores.shape_class(q, keys)]
    assert decision["chosen"] == "torch" and decision["reason"].startswith("RuntimeError")
    # forced, it still gives torch's when the kernel raises
    interpreted.setenv(fused_scores.FORCE_ENV, "1")
    with pytest.warns(RuntimeWarning, match="torch's scores used"):
        assert torch.equal(_bf16_index_scores(q, keys, weights), got)


def test_selection_refuses_a_wrong_kernel(interpreted):
    q, keys, weights = operands(9, 4, 16, 40, seed=5)
    interpreted.setattr(fused_scores, "_launch", lambda q, keys, w, counts, scales: torch.zeros(9, 40))
    with pytest.warns(RuntimeWarning, match="off torch's"):
        got = _bf16_index_scores(q, keys, weights)
    assert torch.equal(got, torch_scores(q, keys, weights, interpreted))
    assert fused_scores.DECISIONS[fused_scores.shape_class(q, keys)]["chosen"] == "torch"


def test_forcing_either_path(interpreted):
    q, keys, weights = operands(9, 4, 16, 40, seed=6)
    sentinel = torch.full((9, 40), 7.0)
    interpreted.setenv(fused_scores.FORCE_ENV, "0")
    assert fused_scores.weighted_relu_scores(q, keys, weights, lambda: sentinel) is sentinel
    assert fused_scores.DECISIONS == {}
    interpreted.setenv(fused_scores.FORCE_ENV, "1")
    got = fused_scores.weighted_relu_scores(q, keys, weights, lambda: pytest.fail("torch's ran"))
    assert fused_scores.relative_error(got, float32_scores(q, keys, weights)) < 1e-5
    assert list(fused_scores.DECISIONS.values()) == [{"chosen": "fused", "reason": "forced"}]


def test_torch_where_the_kernel_does_not_apply(interpreted):
    q, keys, weights = operands(9, 4, 16, 40, seed=7)
    sentinel = torch.full((9, 40), 7.0)
    interpreted.delenv("TRITON_INTERPRET")  # CPU tensors, no interpreter: not CUDA
    assert not fused_scores.fused_applies(q, keys, weights)
    assert fused_scores.weighted_relu_scores(q, keys, weights, lambda: sentinel) is sentinel
    interpreted.setenv("TRITON_INTERPRET", "1")
    per_query_keys = keys.expand(9, 40, 16)
    assert fused_scores.weighted_relu_scores(q, per_query_keys, weights, lambda: sentinel) is sentinel
    assert fused_scores.weighted_relu_scores(q.float(), keys.float(), weights, lambda: sentinel) is sentinel
    interpreted.setattr(fused_scores, "MIN_FUSED_WORK", 9 * 40 * 4 + 1)  # too little work to try
    assert fused_scores.weighted_relu_scores(q, keys, weights, lambda: sentinel) is sentinel
    interpreted.setattr(fused_scores, "_triton", lambda: None)  # Triton absent
    assert fused_scores.weighted_relu_scores(q, keys, weights, lambda: sentinel) is sentinel
    assert fused_scores.DECISIONS == {}
    with pytest.raises(ValueError, match="no fused scores"):
        fused_scores.weighted_relu_head_sum(q, keys, weights)



def test_fp8_refused_under_the_dots_32_bytes(interpreted):
    """tl.dot's least K on a GPU is 32 bytes of an operand's row: a head dimension of 16 is 16 bf16 values but
    only 16 FP8 ones, which the GPU's compile refuses (the interpreter runs it): the FP8 variant refuses it here,
    the bf16 kernel takes it."""
    q, keys, weights = operands(5, 3, 16, 9, seed=8)
    assert fused_scores.fused_applies(q, keys, weights) and not fused_scores.fused_applies(q, keys, weights, fp8=True)
    with pytest.raises(ValueError, match="no fused FP8 scores for q \\(5, 3, 16\\)"):
        fused_scores.weighted_relu_head_sum_fp8(q, keys, weights)
    q, keys, weights = operands(5, 3, 32, 9, seed=8)
    got = fused_scores.weighted_relu_head_sum_fp8(q, keys, weights)
    assert fused_scores.relative_error(got, float32_scores(q, keys, weights)) < 0.06


def test_head_rows_over_what_every_tile_fits_are_torchs(interpreted):
    """A head dimension over MAX_DOT_BYTES of the dot's operands (256 bf16 values: the 128 x 128 tile's 256 KiB of
    shared memory are over sm_90's 227 KiB, at 512 every tile is) is torch's, where the interpreter would run it;
    FP8 codes take twice as many values."""
    q, keys, weights = operands(5, 3, 256, 9, seed=9)
    sentinel = torch.full((5, 9), 7.0)
    assert not fused_scores.fused_applies(q, keys, weights) and fused_scores.fused_applies(q, keys, weights, fp8=True)
    assert fused_scores.weighted_relu_scores(q, keys, weights, lambda: sentinel) is sentinel
    with pytest.raises(ValueError, match="no fused scores for q \\(5, 3, 256\\)"):
        fused_scores.weighted_relu_head_sum(q, keys, weights)
    q, keys, weights = operands(5, 3, 512, 9, seed=9)
    assert not fused_scores.fused_applies(q, keys, weights, fp8=True)
    assert fused_scores.DECISIONS == {}


def test_kernel_compiles_for_hopper():
    """The GPU's compile for sm_90 (H100 / H200) without a GPU (benchmarks/triton_aot.py): the kernel the runtime
    launches, at every autotune config and the release's cases (bf16 and fp16, with counts, FP8 with and without
    them), through ptxas, tensor-core (wgmma) dots, within the chip's shared memory, no register spills."""
    rows = compiled_for_hopper("fused_scores")
    assert len(rows) == 5 * len(fused_scores._GPU_TILES)
    assert all(row["compiled"] and row["dot"] == "wgmma" and row["spill_bytes"] == 0 for row in rows), rows
