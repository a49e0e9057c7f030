"""The mHC weights of a sublayer (model.hc_mix_weights) compiled: one C call instead of about 140 small torch ops.

Per token the hyper-connection turns hc*(2 + hc) mixes into `pre`, `post` and the hc x hc `comb`, and comb takes
hc_sinkhorn_iters rounds of Sinkhorn-Knopp (20 in DeepSeek-V4): every round divides each row, then each column, by
its sum. In torch that is ~140 ops on [N, 4, 4] tensors per sublayer, each a few microseconds of dispatch for a few
thousand numbers: 0.55 ms per sublayer at N = 256, twice per layer, on the prefill's critical path. The C kernel
keeps 16 tokens side by side (each step one vector op) and takes 0.03 ms.

The same formulas as the torch path (sigmoid as 1 / (1 + exp(-x)), softmax with the row maximum subtracted, each
Sinkhorn pass dividing by its sums plus eps), so the results agree to float32 rounding (torch's vectorised exp
and reductions differ in the last bits); the library is used only after it agrees with the torch path on random
mixes at load (native/mhc.c: built once per machine into a cache, skipped with MOEPACK_NATIVE=0). CPU float32 only;
anything else stays in torch.
"""

from __future__ import annotations

import ctypes
import threading
import warnings

import torch

from moepack.native import c_function, disable, native_library, read_source

_SOURCE = read_source("mhc.c")
HC_MAX = 8  # the kernel's largest hc_mult (DeepSeek-V4: 4)


def _load(reference):
    """The compiled kernel where it builds and agrees with `reference` (model.hc_mix_weights, the torch path),
    else None."""
    lib = native_library("moepack_mhc", _SOURCE)
    if lib is None:
        return None
    p = ctypes.c_void_p
    fn = c_function(lib, "hc_mix_weights", (p, ctypes.c_int64, ctypes.c_int, p, p, ctypes.c_int, ctypes.c_float,
                                             p, p, p))
    gen = torch.Generator().manual_seed(0)
    for hc, tokens, iters in ((4, 37, 20), (3, 5, 1), (1, 16, 0)):  # a partial lane group, one round, hc = 1
        mixes = torch.randn(tokens, (2 + hc) * hc, generator=gen) * 3
        scale, base = torch.rand(3, generator=gen) + 0.5, torch.randn((2 + hc) * hc, generator=gen)
        want = reference(mixes, scale, base, hc, iters, 1e-6)
        got = _call(fn, mixes, scale, base, hc, iters, 1e-6)
        if not all(torch.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want)):
            reason = "its results differ from the torch path's on the self-check mixes"
            disable("moepack_mhc", reason)
            warnings.warn(f"moepack: the compiled mHC kernel disagrees with torch ({reason}); not using it",
                          RuntimeWarning)
            return None
    return fn


def _call(fn, mixes, scale, base, hc: int, iters: int, eps: float):
    n = mixes.shape[0]
    pre, post = torch.empty(n, hc, dtype=torch.float32), torch.empty(n, hc, dtype=torch.float32)
    comb = torch.empty(n, hc, hc, dtype=torch.float32)
    if fn(mixes.data_ptr(), n, hc, scale.data_ptr(), base.data_ptr(), iters, eps, pre.data_ptr(), post.data_ptr(),
          comb.data_ptr()):
        raise ValueError(f"hc_mult {hc} is outside the compiled mHC kernel's 1..{HC_MAX}")
    return pre, post, comb


_built: list = []  # [] until the first call, then [kernel or None]
_built_lock = threading.Lock()


def _kernel(reference):
    """The compiled kernel, built and checked against `reference` on the first call (the torch path is passed
    in, not imported: model imports this module)."""
    with _built_lock:
        if not _built:
            _built.append(_load(reference))
        return _built[0]


def hc_mix_weights(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
                   eps: float, reference) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`reference` (model.hc_mix_weights) by the compiled kernel, or None where it does not apply (anything but
    CPU float32 mixes [N, (2 + hc) * hc] with scale [3] and base [(2 + hc) * hc], hc_mult outside 1..HC_MAX, no
    compiler): the caller then runs the torch path, which also names what is wrong with its inputs."""
    width = (2 + hc) * hc
    if (not 1 <= hc <= HC_MAX or mixes.dim() != 2 or mixes.shape[1] != width or scale.numel() != 3
            or base.numel() != width or any(t.device.type != "cpu" or t.dtype != torch.float32
                                            for t in (mixes, scale, base))):
        return None
    fn = _kernel(reference)
    if fn is None:
        return None
    return _call(fn, mixes.contiguous(), scale.contiguous(), base.contiguous(), hc, iters, eps)
