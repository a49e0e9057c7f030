"""DeepSeek-V4's compiled Lightning Indexer (families/deepseek_v4/indexer_native.py, indexer.c beside it): one
decoded token's scores against model's torch path, in both loops of the token matmul library it runs on; its
products are that library's row dots, to the bit, whatever the thread count."""

from __future__ import annotations

import os

import pytest
import torch

from moepack import native
from moepack.backends import token_kernels
from moepack.families.deepseek_v4 import indexer_native, model
from test_token_kernels import loop  # noqa: F401 (the fixture: each test in the token matmul's two loops)


@pytest.fixture(autouse=True, scope="module")
def _loaded_first():
    """The kernel loaded before a test picks a loop: its self-check runs both loops and leaves the vector one on."""
    indexer_native.indexer_kernel()


def _indexer():
    indexer = indexer_native.indexer_kernel()
    if indexer is None:
        pytest.skip("no C compiler (or MOEPACK_NATIVE=0): decode keeps torch")
    return indexer


def test_the_compiled_indexer_is_used_where_a_compiler_is():
    usable = bool(native.c_compiler()) and os.environ.get(native.NATIVE_ENV, "1") != "0"
    assert (indexer_native.indexer_kernel() is not None) == usable, native.native_builds().get(
        indexer_native.LIBRARY)
    if usable:
        assert native.native_builds()[indexer_native.LIBRARY]["compiled"]


@pytest.mark.parametrize("low", [torch.float32, torch.bfloat16])
def test_one_tokens_indexer_scores_equal_the_torch_path(loop, low):
    """The relu-weighted scores of one query (RoPE on each head's last channels) against model's bfloat16 /
    float32 matmul of the rotated query and the keys."""
    indexer = _indexer()
    gen = torch.Generator().manual_seed(0)
    heads, dim, rope = 6, 72, 16
    q = torch.randn(heads, dim, generator=gen) * 2
    angles = torch.rand(1, rope // 2, generator=gen) * 6
    rotation = torch.polar(torch.full_like(angles, 1.3), angles)
    keys, head_weights = torch.randn(30, dim, generator=gen).to(low).float(), torch.randn(heads, generator=gen)
    scores = indexer.scores(q, rotation, keys, head_weights, low == torch.bfloat16, threads=2)
    reference = model.low_matmul(model.apply_rope(q[None], rotation), keys.T, low).float().relu_()
    reference = (head_weights[None, :, None] * reference).sum(1)[0]
    step = 1e-5 if low == torch.float32 else 2e-2
    assert scores.shape == (30,)
    assert torch.allclose(scores, reference, rtol=step, atol=step * float(reference.abs().max()))
    assert indexer.scores(q, rotation, keys[:0], head_weights, False).shape == (0,)  # no entries yet


@pytest.mark.parametrize("round_bf16", [False, True])
def test_the_products_are_the_token_matmuls_row_dots_to_the_bit(loop, round_bf16):
    """Without RoPE channels the scores are the token matmul's own q . k (its `linear`, rounded to bfloat16 where
    asked) summed over the heads in order in float32: the same bits, for any split of the keys over threads."""
    indexer, kernels = _indexer(), loop
    gen = torch.Generator().manual_seed(1)
    heads, dim = 5, 40  # a dimension off the vector width
    q, keys = torch.randn(heads, dim, generator=gen), torch.randn(77, dim, generator=gen)
    if round_bf16:  # the kernel rounds the query and expects rounded keys
        q, keys = q.bfloat16().float(), keys.bfloat16().float()
    head_weights = torch.randn(heads, generator=gen)
    no_rope = torch.ones(0, dtype=torch.complex64)
    products = kernels.linear(keys, token_kernels.float_matrix(q), False, threads=1, round_output=round_bf16)
    want = torch.zeros(keys.shape[0])
    for h in range(heads):
        want = want + head_weights[h] * products[:, h].relu()
    for threads in (1, 2, 3):
        got = indexer.scores(q, no_rope, keys, head_weights, round_bf16, threads=threads)
        assert torch.equal(got, want), (threads, (got - want).abs().max())


def test_wrong_shapes_are_refused():
    indexer = _indexer()
    q, rotation = torch.randn(4, 32), torch.polar(torch.ones(4), torch.zeros(4))
    with pytest.raises(ValueError, match="indexer query"):
        indexer.scores(q, rotation, torch.randn(3, 31), torch.randn(4), False)
    with pytest.raises(ValueError, match="indexer query"):
        indexer.scores(q, rotation, torch.randn(3, 32), torch.randn(5), False)
