"""The families' RMS norms on CUDA are torch's fused kernel (backends/ops.fused_rms_norm: one launch, where their
own steps are about seven), with their own arithmetic's values; on a CPU their own steps run, unchanged."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from moepack.backends import ops
from moepack.families.deepseek_v4 import model as deepseek
from moepack.families.qwen3_moe import model as qwen


class _Calls(TorchFunctionMode):
    """The names of the torch functions called under it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", ""))
        return func(*args, **(kwargs or {}))


def _norms(dtype, device="cpu"):
    """(name, norm(x), x, its float32 value) for each family's norm with a weight of x's dtype, and DeepSeek-V4's
    without one."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 3, 96, generator=g) * 4).to(dtype).to(device)
    w = (torch.rand(96, generator=g) + 0.5).to(dtype).to(device)

    def exact(t, weight):
        t = t.double()
        out = t * torch.rsqrt(t.square().mean(-1, keepdim=True) + 1e-6)
        return (out if weight is None else out * weight.double()).float().cpu()
    return [("deepseek_v4", lambda t: deepseek.rms_norm(t, w, 1e-6), x, exact(x, w)),
            ("deepseek_v4 without a weight", lambda t: deepseek.rms_norm(t, None, 1e-6), x, exact(x, None)),
            ("qwen3_moe", lambda t: qwen.rms_norm(t, w, 1e-6), x, exact(x, w))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_each_familys_norm_is_torchs_fused_one_with_the_same_values(monkeypatch, dtype):
    for name, norm, x, _ in _norms(dtype):
        with _Calls() as calls:
            own = norm(x)
        assert "rms_norm" not in calls.names, name  # a CPU: the family's own steps
        monkeypatch.setattr(ops, "fused_norm_on", lambda device: True)
        with _Calls() as calls:
            fused = norm(x)
        monkeypatch.undo()
        assert "rms_norm" in calls.names, name
        assert fused.dtype == own.dtype and fused.shape == own.shape
        # float32: the same sums in another order; bfloat16: the fused kernel rounds once where the steps round
        # after each (within a unit in the last place or two of bfloat16)
        tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(fused, own, **tolerance, msg=name)


def test_a_weight_of_another_dtype_keeps_the_familys_steps(monkeypatch):
    """DeepSeek-V4's norm with a float32 weight on bf16 rows promotes to float32, which the fused kernel would not."""
    monkeypatch.setattr(ops, "fused_norm_on", lambda device: True)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with _Calls() as calls:
        out = deepseek.rms_norm(x, torch.ones(64), 1e-6)
    assert "rms_norm" not in calls.names and out.dtype == torch.float32


def test_the_fused_kernel_is_for_cuda_devices():
    assert ops.fused_norm_on(torch.device("cuda", 0)) and not ops.fused_norm_on(torch.device("cpu"))
    assert ops.fused_rms_norm(torch.ones(2, 8), None, 1e-6) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_the_fused_norm_equals_the_exact_norm(dtype):
    for name, norm, x, exact in _norms(dtype, "cuda"):
        out = norm(x)
        assert out.is_cuda and out.dtype == dtype, name
        tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(out.float().cpu(), exact, **tolerance, msg=name)
