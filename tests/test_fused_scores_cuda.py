"""The fused weighted-ReLU head sum (backends/fused_scores.py) compiled and run on a CUDA device: its scores against
the float32 reference and torch's blocks at odd sizes, -inf exactly past each count, and the selection's record.
Skipped without a CUDA device or Triton (test_fused_scores.py runs the same kernel under the interpreter)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1: the interpreter's tests are test_fused_scores.py", allow_module_level=True)
pytest.importorskip("triton")

from moepack.backends import fused_scores  # noqa: E402
from moepack.families.deepseek_v4.model import _bf16_index_scores  # noqa: E402


def operands(n_queries: int, heads: int, head_dim: int, entries: int):
    g = torch.Generator(device="cuda").manual_seed(n_queries + entries)
    q = torch.randn(n_queries, heads, head_dim, device="cuda", generator=g).bfloat16()
    keys = torch.randn(entries, head_dim, device="cuda", generator=g).bfloat16()
    weights = (torch.randn(n_queries, heads, device="cuda", generator=g) * (heads * head_dim) ** -0.5).bfloat16()
    return q, keys, weights


def float32_scores(q, keys, weights):
    products = torch.einsum("chd,td->cht", q.float(), keys.float()).relu()
    return (weights.float()[:, :, None] * products).sum(1)


@pytest.mark.parametrize("n_queries, heads, entries", [(300, 64, 1999), (77, 16, 515)])
def test_cuda_fused_scores_equal_float32_and_torch(monkeypatch, n_queries, heads, entries):
    q, keys, weights = operands(n_queries, heads, 128, entries)
    got = fused_scores.weighted_relu_head_sum(q, keys, weights)
    assert fused_scores.relative_error(got, float32_scores(q, keys, weights)) < 1e-4  # float32 sums, other orders
    monkeypatch.setenv(fused_scores.FORCE_ENV, "0")
    assert fused_scores.relative_error(got, _bf16_index_scores(q, keys, weights)) < 1e-2
    counts = torch.randint(0, entries + 40, (n_queries,), device="cuda")
    counts[: n_queries // 2] = torch.randint(0, 100, (n_queries // 2,), device="cuda")  # whole key tiles skipped
    masked = fused_scores.weighted_relu_head_sum(q, keys, weights, counts)
    hidden = torch.arange(entries, device="cuda")[None, :] >= counts[:, None]
    assert torch.equal(torch.isneginf(masked), hidden)
    assert fused_scores.relative_error(masked, got.masked_fill(hidden, float("-inf"))) < 1e-6


def test_cuda_selection_records_its_choice(monkeypatch):
    monkeypatch.setattr(fused_scores, "DECISIONS", {})
    monkeypatch.delenv(fused_scores.FORCE_ENV, raising=False)
    q, keys, weights = operands(1024, 64, 128, 4000)
    scores = _bf16_index_scores(q, keys, weights)
    decision = fused_scores.DECISIONS[fused_scores.shape_class(q, keys)]
    print("selection", decision)
    assert decision["reason"] == "faster" and decision["error"] < 1e-2, decision
    assert fused_scores.relative_error(scores[:64], float32_scores(q[:64], keys, weights[:64])) < 1e-2
