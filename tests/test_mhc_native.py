"""The compiled mHC weights (families/deepseek_v4/mhc_native.py) against the torch path they replace on a CPU."""

import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from moepack import native
from moepack.families.deepseek_v4 import mhc_native, model


def _inputs(tokens: int, hc: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, (2 + hc) * hc, generator=gen) * 4, torch.rand(3, generator=gen) + 0.5,
            torch.randn((2 + hc) * hc, generator=gen))


def test_the_compiled_kernel_is_used_where_a_compiler_is():
    usable = bool(native.c_compiler()) and os.environ.get(native.NATIVE_ENV, "1") != "0"
    assert (mhc_native.kernel(model.hc_mix_weights) is not None) == usable, native.native_builds().get("moepack_mhc")


@pytest.mark.parametrize("tokens,hc,iters", [(1, 4, 20), (17, 4, 20), (256, 4, 20), (33, 3, 7), (5, 2, 1),
                                             (40, 8, 3), (16, 4, 0)])
def test_compiled_mhc_weights_match_torch(tokens, hc, iters):
    """Partial and whole groups of 16 tokens, hc from 2 to the kernel's largest, one Sinkhorn round or none."""
    if mhc_native.kernel(model.hc_mix_weights) is None:
        pytest.skip("no C compiler: the torch path is the only one")
    args = (*_inputs(tokens, hc), hc, iters, 1e-6)
    got, want = mhc_native.hc_mix_weights(*args, model.hc_mix_weights), model.hc_mix_weights(*args)
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.allclose(g, w, rtol=2e-6, atol=1e-7), (g - w).abs().max()
    comb = got[2]
    if iters >= 1:  # doubly stochastic up to eps: columns sum to 1 after the last pass
        assert torch.allclose(comb.sum(-2), torch.ones(tokens, hc), atol=1e-4)


def test_torch_path_where_the_kernel_does_not_apply():
    mixes, scale, base = _inputs(8, mhc_native.HC_MAX + 1)
    assert mhc_native.hc_mix_weights(mixes, scale, base, mhc_native.HC_MAX + 1, 3, 1e-6, model.hc_mix_weights) is None
    mixes, scale, base = _inputs(8, 4)
    assert mhc_native.hc_mix_weights(mixes.double(), scale.double(), base.double(), 4, 3, 1e-6,
                                     model.hc_mix_weights) is None


def test_a_kernel_that_disagrees_is_not_used(monkeypatch):
    if native.native_library("moepack_mhc", mhc_native._SOURCE) is None:
        pytest.skip("no C compiler")
    real = model.hc_mix_weights
    monkeypatch.setattr(model, "hc_mix_weights", lambda *a: tuple(t + 1e-3 for t in real(*a)))
    monkeypatch.setitem(native.loader._native, "moepack_mhc", dict(native.loader._native["moepack_mhc"]))
    with pytest.warns(RuntimeWarning, match="mHC kernel disagrees"):
        assert mhc_native._load(model.hc_mix_weights) is None
    assert not native.native_builds()["moepack_mhc"]["compiled"]  # reported as not in use


def test_inputs_the_kernel_cannot_take_go_to_torch():
    """Wrong widths, a short scale or base, hc_mult 0: None (the torch path raises or handles them), never a read
    out of bounds."""
    mixes, scale, base = _inputs(8, 4)
    for args in ((mixes[:, :-1], scale, base, 4), (mixes, scale[:2], base, 4), (mixes, scale, base[:-1], 4),
                 (mixes[:, :0], scale, base[:0], 0), (mixes[0], scale, base, 4)):
        assert mhc_native.hc_mix_weights(*args, 3, 1e-6, model.hc_mix_weights) is None
    torch.set_default_dtype(torch.float64)
    try:  # the outputs are float32 whatever the default dtype
        got = mhc_native.hc_mix_weights(mixes, scale, base, 4, 3, 1e-6, model.hc_mix_weights)
    finally:
        torch.set_default_dtype(torch.float32)
    if got is not None:
        assert all(t.dtype == torch.float32 for t in got)
        assert torch.allclose(got[2], model.hc_mix_weights(mixes, scale, base, 4, 3, 1e-6)[2], atol=1e-6)


@pytest.mark.parametrize("hc,hidden,iters", [(4, 64, 20), (3, 67, 7), (1, 16, 1)])
def test_one_tokens_mhc_entry_and_exit_match_torch(hc, hidden, iters):
    """model.hc_pre_norm / hc_post of one token (one compiled call each) against hc_pre + rms_norm and the bmm path
    on a batch of two tokens (which never takes the one-token call)."""
    if mhc_native.kernel(model.hc_mix_weights) is None:
        pytest.skip("no C compiler: the torch path is the only one")
    gen = torch.Generator().manual_seed(hc)
    cfg = SimpleNamespace(hc_mult=hc, hc_sinkhorn_iters=iters, hc_eps=1e-6, rms_norm_eps=1e-6)  # what it reads
    streams = torch.randn(2, hc, hidden, generator=gen)
    fn = torch.randn((2 + hc) * hc, hc * hidden, generator=gen) * 0.1
    scale, base = torch.rand(3, generator=gen) + 0.5, torch.randn((2 + hc) * hc, generator=gen)
    norm_weight = torch.rand(hidden, generator=gen) + 0.5
    one = model.hc_pre_norm(cfg, fn, base, scale, streams[:1], norm_weight)
    batch = model.hc_pre_norm(cfg, fn, base, scale, streams, norm_weight)
    assert mhc_native.token_pre(streams[:1], fn, scale, base, hc, iters, 1e-6, 1e-6, norm_weight,
                                model.hc_mix_weights) is not None  # the compiled call is the one tested
    for got, want in zip(one, batch):
        assert got.shape == want[:1].shape and torch.allclose(got, want[:1], rtol=1e-4, atol=1e-5), (got - want[:1])
    out = torch.randn(2, hidden, generator=gen)
    got, want = model.hc_post(streams[:1], out[:1], one[1], one[2]), model.hc_post(streams, out, batch[1], batch[2])
    assert torch.allclose(got, want[:1], rtol=1e-4, atol=1e-5)


def _inductor_builds_here() -> bool:
    """Whether torch.compile's CPU backend finds its C++ compiler on this machine (the test below compiles there)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        return bool(get_cpp_compiler())
    except ImportError:
        return shutil.which("g++") is not None
    except Exception:  # (inductor's InvalidCxxCompiler: none found)
        return False


@pytest.mark.skipif(not _inductor_builds_here(), reason="no C++ compiler for torch.compile's CPU backend")
def test_on_a_cuda_device_the_mix_weights_are_one_compile_for_every_row_count(monkeypatch):
    """model.device_mix_weights (ops.DeviceCompiled, what hc_pre calls on a CUDA device) compiled by torch.compile,
    run on a CPU here (inductor's C++ backend standing for its Triton one): the torch path's values for 1, 5, 64
    and 7 rows, from two graphs (one row, and any other count: no compile per count)."""
    from torch._dynamo.utils import counters

    from moepack.backends import ops

    monkeypatch.setattr(ops, "compiling_on", lambda device: True)
    compiled = ops.DeviceCompiled(model.hc_mix_weights)
    counters.clear()
    for tokens in (1, 5, 64, 7):
        args = (*_inputs(tokens, 4, seed=tokens), 4, 20, 1e-6)
        for g, w in zip(compiled(*args), model.hc_mix_weights(*args)):
            assert g.shape == w.shape and torch.allclose(g, w, rtol=1e-5, atol=1e-6), (g - w).abs().max()
    assert not compiled.failed and counters["stats"]["unique_graphs"] == 2


def test_a_compile_that_fails_warns_once_and_runs_the_torch_ops(monkeypatch):
    from moepack.backends import ops

    def broken(fn, **options):
        def run(*args):
            raise RuntimeError("no compiler here\nsecond line")
        return run
    monkeypatch.setattr(ops, "compiling_on", lambda device: True)
    monkeypatch.setattr(torch, "compile", broken)
    compiled = ops.DeviceCompiled(model.hc_mix_weights)
    args = (*_inputs(3, 4), 4, 20, 1e-6)
    with pytest.warns(RuntimeWarning, match=r"^torch.compile of hc_mix_weights failed \(RuntimeError: no "
                                            r"compiler here\); it runs uncompiled$"):
        got = compiled(*args)
    assert compiled.failed
    for g, w in zip(got, model.hc_mix_weights(*args)):
        assert torch.equal(g, w)
    assert all(torch.equal(g, w) for g, w in zip(compiled(*args), model.hc_mix_weights(*args)))  # (no warning again)


def test_compile_is_for_cuda_devices_and_can_be_turned_off(monkeypatch):
    from moepack.backends import ops

    assert not ops.compiling_on(torch.device("cpu"))
    assert ops.compiling_on(torch.device("cuda"))
    monkeypatch.setenv(ops.COMPILE_ENV, "0")
    assert not ops.compiling_on(torch.device("cuda"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_the_mix_weights_compile_on_the_device():
    """model.device_mix_weights on CUDA tensors: compiled (inductor, Triton), the torch ops' values."""
    from torch._dynamo.utils import counters

    counters.clear()
    for tokens in (1, 8, 1000):
        args = (*(t.cuda() for t in _inputs(tokens, 4, seed=tokens)), 4, 20, 1e-6)
        for g, w in zip(model.device_mix_weights(*args), model.hc_mix_weights(*args)):
            assert torch.allclose(g, w, rtol=1e-5, atol=1e-6), (g - w).abs().max()
    assert not model.device_mix_weights.failed and counters["stats"]["unique_graphs"] >= 1
