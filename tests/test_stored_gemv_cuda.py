"""The stored FP4 experts' kernel (backends/stored_gemv.py) compiled and run on a CUDA device: each pair's W x from
a slot's bytes against format_spec's decode at odd and release sizes, its bf16 output torch's rounding of its
float32 one, and a stored pool at the release's sizes (hidden 4096, expert inter 2048, top-6; B = 1 and 8) routing
through the selection, whose record (both timings) it prints. Skipped without a CUDA device or Triton
(test_stored_gemv.py runs the same kernel under the interpreter)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1: the interpreter's tests are test_stored_gemv.py", allow_module_level=True)
pytest.importorskip("triton")

from moepack.backends import kernel_choice, stored_gemv  # noqa: E402
from fp4_slots import decoded_matmul, routed_inputs, stored_pool, stored_slots  # noqa: E402


@pytest.mark.parametrize("n_out, n_in, pairs", [(37, 96, 7), (2048, 4096, 6), (4096, 2048, 48)])
def test_cuda_kernel_equals_the_decoded_matmul(n_out, n_in, pairs):
    stack, (m,) = stored_slots([(n_out, n_in)], slots=5, seed=n_out, device="cuda")
    slots = torch.arange(pairs, device="cuda") * 3 % 5  # slots chosen several times
    x = torch.randn(pairs, n_in, device="cuda").bfloat16()
    want = decoded_matmul(stack, slots, x, m)
    got = stored_gemv.fp4_pairs_matmul(stack, slots, x, m)
    assert kernel_choice.relative_error(got.double(), want) < 1e-5  # float32 sums, in other orders
    assert torch.equal(stored_gemv.fp4_pairs_matmul(stack, slots, x, m, torch.bfloat16), got.bfloat16())


@pytest.mark.parametrize("rows", [1, 8])
def test_cuda_stored_pool_at_the_release_sizes_records_its_choice(monkeypatch, rows):
    monkeypatch.setattr(stored_gemv, "DECISIONS", {})
    monkeypatch.delenv(stored_gemv.FORCE_ENV, raising=False)
    pool = stored_pool(hidden=4096, inter=2048, experts=16, device="cuda")
    x, chosen, weights = routed_inputs(rows, 4096, experts=16, top_k=6, device="cuda")
    got = pool._routed(0, x, chosen, weights)
    (key, decision), = stored_gemv.DECISIONS.items()
    print("selection", key, decision)
    assert decision["reason"] == "faster" and decision["error"] < stored_gemv.PAIRS_TOLERANCE, decision
    monkeypatch.setenv(stored_gemv.FORCE_ENV, "0")
    assert kernel_choice.relative_error(got, pool._routed(0, x, chosen, weights)) < stored_gemv.PAIRS_TOLERANCE
