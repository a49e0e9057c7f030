"""The stored FP4 experts' kernel (backends/stored_gemv.py) under Triton's interpreter on the CPU: each pair's
W x from a slot's bytes against format_spec's decode and a matmul at odd sizes (slots chosen twice, subnormal and
NaN scales); a stored pool's routed work through it (runtime/device_decode.py); the selection with fakes (the
faster kept, torch's where the kernel raises, is wrong, does not apply or is forced off); the compile for sm_90.
Skipped where Triton is not installed (the project's CI)."""

from __future__ import annotations

import warnings

import pytest
import torch

from triton_interpreter import compiled_for_hopper, import_for_the_interpreter, interpreting

import_for_the_interpreter()

from moepack.backends import kernel_choice, stored_gemv  # noqa: E402
from fp4_slots import decoded_matmul, routed_inputs, stored_pool, stored_slots  # noqa: E402


@pytest.fixture
def interpreted(monkeypatch):
    interpreting(monkeypatch, stored_gemv)
    return monkeypatch


@pytest.mark.parametrize("n_out, n_in", [(37, 96), (5, 32), (70, 160)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_equals_the_decoded_matmul(interpreted, n_out, n_in, x_dtype):
    stack, (m,) = stored_slots([(n_out, n_in)], slots=4, seed=n_out)
    slots = torch.tensor([2, 0, 2, 3, 1, 0, 3])  # pairs sharing a slot, in no order
    x = torch.randn(len(slots), n_in, generator=torch.Generator().manual_seed(1)).to(x_dtype)
    want = decoded_matmul(stack, slots, x, m)
    got = stored_gemv.fp4_pairs_matmul(stack, slots, x, m)
    assert got.shape == (len(slots), n_out) and got.dtype == torch.float32
    # float32 sums of exact products: float32 rounding of the largest sum
    assert kernel_choice.relative_error(got.double(), want) < 1e-6
    rounded = stored_gemv.fp4_pairs_matmul(stack, slots, x, m, torch.bfloat16)
    # the float32 sums to bf16: within one bf16 step (the interpreter truncates; a GPU rounds to nearest, equal to
    # torch's rounding: test_stored_gemv_cuda.py)
    assert rounded.dtype == torch.bfloat16 and ((rounded.float() - got).abs() <= got.abs() * 2**-7).all()


def test_e8m0_scales_read_as_torch_reads_them(interpreted):
    """Byte 0 is 2^-127 (a subnormal float32), 255 NaN: a row with a NaN scale is NaN, as torch's decode makes it."""
    stack, (m,) = stored_slots([(6, 64)], slots=2, seed=3)
    scales = stack[:, m.scales_at:m.scales_at + m.scales_bytes].view(2, 6, 2)
    scales[0, 1, :] = 0
    scales[1, 4, 1] = 255
    slots = torch.tensor([0, 1])
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2)) * 1e30  # the subnormal scale's sums visible
    got = stored_gemv.fp4_pairs_matmul(stack, slots, x, m)
    want = decoded_matmul(stack, slots, x, m)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().sum() == 1 and got[1, 4].isnan()
    assert got[0, 1] != 0 and kernel_choice.relative_error(got[0, 1:2].double(), want[0, 1:2]) < 1e-6
    assert kernel_choice.relative_error(got.nan_to_num().double(), want.nan_to_num()) < 1e-6


def test_a_stored_pool_routes_through_the_kernel_as_through_torchs_decode(interpreted):
    pool = stored_pool(hidden=64, inter=96, experts=5)
    assert list(pool.fp4_layouts[0]) == ["gate", "up", "down"]
    x, chosen, weights = routed_inputs(rows=3, hidden=64, experts=5, top_k=2)
    chosen[1] = chosen[0]  # two rows on the same experts
    interpreted.setenv(stored_gemv.FORCE_ENV, "0")
    want = pool._routed(0, x, chosen, weights)
    assert stored_gemv.DECISIONS == {}
    interpreted.setenv(stored_gemv.FORCE_ENV, "1")
    forced = pool._routed(0, x, chosen, weights)
    (key, decision), = stored_gemv.DECISIONS.items()
    assert key == "cpu bfloat16 pairs<=8 96x64 96x64 64x96 forced" and decision["chosen"] == "fused"
    # the same weights, float32 sums in other orders; bf16 rounding of gate, up and each term in both
    assert 0 < kernel_choice.relative_error(forced, want) < 1e-2
    interpreted.delenv(stored_gemv.FORCE_ENV)
    chosen_result = pool._routed(0, x, chosen, weights)
    decision = stored_gemv.DECISIONS["cpu bfloat16 pairs<=8 96x64 96x64 64x96"]
    assert decision["reason"] == "faster" and decision["error"] < stored_gemv.PAIRS_TOLERANCE
    assert decision["chosen"] == ("fused" if decision["fused_s"] < decision["torch_s"] else "torch")
    assert torch.equal(chosen_result, forced if decision["chosen"] == "fused" else want)


class Fakes:
    """Two computations of one result for pairs_result, counting their calls; the kernel's may be wrong or raise."""

    def __init__(self, kernel_result=None, error: Exception | None = None):
        self.want = torch.arange(12.0).view(3, 4)
        self.kernel_result = self.want + 1e-4 if kernel_result is None else kernel_result
        self.error, self.calls = error, []

    def kernel(self):
        self.calls.append("kernel")
        if self.error is not None:
            raise self.error
        return self.kernel_result

    def reference(self):
        self.calls.append("torch")
        return self.want

    def result(self):
        stack, x = torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(3, 32)
        return stored_gemv.pairs_result(stack, x, [stored_gemv.Fp4Matrix(4, 32, 0, 16)], self.kernel, self.reference)


@pytest.mark.parametrize("kernel_s, torch_s, chosen", [(1.0, 2.0, "fused"), (2.0, 1.0, "torch")])
def test_the_selection_keeps_the_faster(interpreted, kernel_s, torch_s, chosen):
    fakes = Fakes()
    timings = {"kernel": kernel_s, "reference": torch_s}
    interpreted.setattr(kernel_choice, "seconds", lambda fn, device: timings[fn.__name__])
    got = fakes.result()
    (key, decision), = stored_gemv.DECISIONS.items()
    assert key == "cpu float32 pairs<=4 4x32"
    assert decision == {"chosen": chosen, "reason": "faster", "fused_s": kernel_s, "torch_s": torch_s,
                        "error": pytest.approx(1e-4 / 11, rel=0.01)}
    assert got is (fakes.kernel_result if chosen == "fused" else fakes.want)
    fakes.calls.clear()
    assert fakes.result() is got and fakes.calls == ["kernel" if chosen == "fused" else "torch"]


def test_the_selection_falls_back_when_the_kernel_raises(interpreted):
    fakes = Fakes(error=RuntimeError("out of resources: shared memory\nsecond line"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fakes.result() is fakes.want
    assert [str(w.message).count("\n") for w in caught] == [0]
    assert "RuntimeError: out of resources" in str(caught[0].message)
    assert stored_gemv.DECISIONS["cpu float32 pairs<=4 4x32"]["chosen"] == "torch"
    fakes.calls.clear()
    assert fakes.result() is fakes.want and fakes.calls == ["torch"]  # decided: no second try
    interpreted.setenv(stored_gemv.FORCE_ENV, "1")  # forced, still torch's where it raises
    with pytest.warns(RuntimeWarning, match="torch's decode and matmuls used"):
        assert fakes.result() is fakes.want


def test_the_selection_refuses_a_wrong_kernel(interpreted):
    fakes = Fakes(kernel_result=torch.arange(12.0).view(3, 4).flip(1))
    with pytest.warns(RuntimeWarning, match="off torch's"):
        assert fakes.result() is fakes.want
    decision = stored_gemv.DECISIONS["cpu float32 pairs<=4 4x32"]
    assert decision["chosen"] == "torch" and decision["error"] > stored_gemv.PAIRS_TOLERANCE


def test_forcing_either_path(interpreted):
    fakes = Fakes(kernel_result=torch.zeros(3, 4))  # (wrong: forced, it is not checked)
    interpreted.setenv(stored_gemv.FORCE_ENV, "0")
    assert fakes.result() is fakes.want and fakes.calls == ["torch"] and stored_gemv.DECISIONS == {}
    interpreted.setenv(stored_gemv.FORCE_ENV, "1")
    assert fakes.result() is fakes.kernel_result and fakes.calls == ["torch", "kernel"]
    assert list(stored_gemv.DECISIONS.values()) == [{"chosen": "fused", "reason": "forced"}]


def test_torch_where_the_kernel_does_not_apply(interpreted):
    fakes = Fakes()
    interpreted.delenv("TRITON_INTERPRET")  # CPU tensors, no interpreter: not CUDA
    assert fakes.result() is fakes.want
    interpreted.setenv("TRITON_INTERPRET", "1")
    interpreted.setattr(kernel_choice, "triton_modules", lambda: None)  # Triton absent
    assert fakes.result() is fakes.want and fakes.calls == ["torch", "torch"] and stored_gemv.DECISIONS == {}
    with pytest.raises(ValueError, match="no stored FP4 kernel"):
        stored_gemv.fp4_pairs_matmul(torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(3, dtype=torch.int64),
                                     torch.zeros(3, 32), stored_gemv.Fp4Matrix(4, 32, 0, 16))


def test_only_fp4_with_e8m0_scales_and_no_tensor_scale_is_read_by_the_kernel():
    scale = ("F8_E8M0", (4, 2), (32, 40))
    assert stored_gemv.fp4_matrix("FP4_E2M1", (4, 64), (0, 128), scale, None) == stored_gemv.Fp4Matrix(4, 64, 0, 32)
    assert stored_gemv.fp4_matrix("FP4_E2M1", (4, 64), (0, 128), scale, (40, 44)) is None  # a tensor scale
    assert stored_gemv.fp4_matrix("NVFP4", (4, 64), (0, 128), scale, None) is None
    assert stored_gemv.fp4_matrix("FP4_E2M1", (4, 64), (0, 128), ("F8_E4M3", (4, 2), (32, 40)), None) is None
    assert stored_gemv.fp4_matrix("FP4_E2M1", (4, 64), (0, 128), ("F8_E8M0", (4, 1), (32, 36)), None) is None
    assert stored_gemv.fp4_matrix("FP4_E2M1", (4, 64), (0, 127), scale, None) is None  # a span of other bytes
    assert stored_gemv.fp4_matrix("FP4_E2M1", (4, 64), (0, 128), None, None) is None


def test_kernel_compiles_for_hopper():
    """The GPU's compile for sm_90 (H100 / H200) without a GPU (benchmarks/triton_aot.py): the kernel the runtime
    launches, at every autotune config, for the release's gate / up and down matrices with bf16 inputs, through
    ptxas, within the chip's shared memory, no register spills."""
    rows = compiled_for_hopper("stored_gemv")
    assert len(rows) == 2 * len(stored_gemv._GPU_TILES)
    assert all(row["compiled"] and row["spill_bytes"] == 0 for row in rows), rows
