"""The mHC weights of a sublayer (model.hc_mix_weights) compiled: one C call instead of about 140 small torch ops.

Per token the hyper-connection turns hc*(2 + hc) mixes into `pre`, `post` and the hc x hc `comb`, and comb takes
hc_sinkhorn_iters rounds of Sinkhorn-Knopp (20 in DeepSeek-V4): every round divides each row, then each column, by
its sum. In torch that is ~140 ops on [N, 4, 4] tensors per sublayer, each a few microseconds of dispatch for a few
thousand numbers: 0.55 ms per sublayer at N = 256, twice per layer, on the prefill's critical path. The C kernel
keeps 16 tokens side by side (each step one vector op) and takes 0.03 ms.

The same formulas as the torch path (sigmoid as 1 / (1 + exp(-x)), softmax with the row maximum subtracted, each
Sinkhorn pass dividing by its sums plus eps), so the results agree to float32 rounding (torch's vectorised exp
and reductions differ in the last bits); the library is used only after it agrees with the torch path on random
mixes at load (mhc.c beside this file: built once per machine into native/'s cache, skipped with
MOEPACK_NATIVE=0). CPU float32 only; anything else stays in torch.

A decoded token's whole mHC entry (the mixes, their weights, the collapse and the sublayer's RMS norm:
`token_pre`) and exit (`token_post`) are one call each too: for one token each torch op is mostly dispatch.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings

import torch

from moepack.native import c_function, disable, native_library, read_source

_SOURCE = read_source(os.path.join(os.path.dirname(os.path.abspath(__file__)), "mhc.c"))
HC_MAX = 8  # the kernel's largest hc_mult (DeepSeek-V4: 4)


class _Library:
    def __init__(self, lib):
        p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        self.mix_weights = c_function(lib, "hc_mix_weights", (p, i64, ctypes.c_int, p, p, ctypes.c_int, f32, p, p,
                                                              p))
        self.token_pre = c_function(lib, "hc_token_pre", (p, ctypes.c_int, i64, p, p, p, ctypes.c_int, f32, f32, p,
                                                          p, p, p))
        self.token_post = c_function(lib, "hc_token_post", (p, p, p, p, ctypes.c_int, i64, p))
        self.token_pre_mixed = c_function(lib, "hc_token_pre_mixed", (p, ctypes.c_int, i64, p, p, p, ctypes.c_int,
                                                                      f32, f32, p, p, p, p))
        # the same for a batched step's rows (token_layer.TokenLayers' *_rows calls)
        self.rows_pre_mixed = c_function(lib, "hc_rows_pre_mixed", (p, i64, ctypes.c_int, i64, p, p, p, ctypes.c_int,
                                                                    f32, f32, p, p, p, p))
        self.rows_post = c_function(lib, "hc_rows_post", (p, p, p, p, i64, ctypes.c_int, i64, p))


def _reference_token_pre(streams, fn, scale, base, hc, iters, hc_eps, norm_eps, norm_weight, mix_weights):
    """model.hc_pre + rms_norm for one token, in float64 (the self-check's reference)."""
    flat = streams.double().reshape(1, -1)
    mixes = (flat @ fn.double().T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    pre, post, comb = mix_weights(mixes.float(), scale, base, hc, iters, hc_eps)
    x = pre.double() @ streams.double()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps) * norm_weight.double()
    return x, post, comb


def _load(reference):
    """The compiled kernels where they build and agree with `reference` (model.hc_mix_weights, the torch path),
    else None."""
    lib = native_library("moepack_mhc", _SOURCE)
    if lib is None:
        return None
    kernels = _Library(lib)
    gen = torch.Generator().manual_seed(0)
    reason = None
    for hc, tokens, iters in ((4, 37, 20), (3, 5, 1), (1, 16, 0)):  # a partial lane group, one round, hc = 1
        mixes = torch.randn(tokens, (2 + hc) * hc, generator=gen) * 3
        scale, base = torch.rand(3, generator=gen) + 0.5, torch.randn((2 + hc) * hc, generator=gen)
        want = reference(mixes, scale, base, hc, iters, 1e-6)
        got = _call(kernels.mix_weights, mixes, scale, base, hc, iters, 1e-6)
        if not all(torch.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want)):
            reason = "its results differ from the torch path's on the self-check mixes"
        hidden = 67  # not a multiple of the kernel's lanes
        streams = torch.randn(hc, hidden, generator=gen)
        fn = torch.randn((2 + hc) * hc, hc * hidden, generator=gen) * 0.1
        norm_weight = torch.rand(hidden, generator=gen) + 0.5
        args = (streams, fn, scale, base, hc, iters, 1e-6, 1e-6, norm_weight)
        got, want = _token_pre(kernels, *args), _reference_token_pre(*args, reference)
        if not all(torch.allclose(g.double(), w.double(), rtol=1e-4, atol=1e-5) for g, w in zip(got, want)):
            reason = "its one-token mHC entry differs from the torch path's"
        out, post, comb = torch.randn(hidden, generator=gen), want[1].reshape(-1), want[2].reshape(hc, hc)
        expect = comb.double().T @ streams.double() + post.double()[:, None] * out.double()
        if not torch.allclose(_token_post(kernels, streams, out, post, comb).double(), expect, rtol=1e-5,
                              atol=1e-5):
            reason = "its one-token mHC exit differs from the torch path's"
    if reason is not None:
        disable("moepack_mhc", reason)
        warnings.warn(f"moepack: the compiled mHC kernel disagrees with torch ({reason}); not using it",
                      RuntimeWarning)
        return None
    return kernels


def _outside(hc: int) -> ValueError:
    """What a call refused for its hc_mult raises."""
    return ValueError(f"hc_mult {hc} is outside the compiled mHC kernel's 1..{HC_MAX}")


def _token_pre(kernels, streams, fn, scale, base, hc: int, iters: int, hc_eps: float, norm_eps: float,
               norm_weight):
    hidden = streams.shape[-1]
    x = torch.empty(1, hidden, dtype=torch.float32)
    post, comb = torch.empty(1, hc, dtype=torch.float32), torch.empty(1, hc, hc, dtype=torch.float32)
    if kernels.token_pre(streams.data_ptr(), hc, hidden, fn.data_ptr(), scale.data_ptr(), base.data_ptr(), iters,
                         hc_eps, norm_eps, norm_weight.data_ptr(), x.data_ptr(), post.data_ptr(), comb.data_ptr()):
        raise _outside(hc)
    return x, post, comb


def _token_post(kernels, streams, out, post, comb):
    hc, hidden = streams.shape[-2], streams.shape[-1]
    into = torch.empty(1, hc, hidden, dtype=torch.float32)
    if kernels.token_post(streams.data_ptr(), out.data_ptr(), post.data_ptr(), comb.data_ptr(), hc, hidden,
                          into.data_ptr()) == 1:  # 2: not finite, model.check_finite names the layer
        raise _outside(hc)
    return into


def _call(fn, mixes, scale, base, hc: int, iters: int, eps: float):
    n = mixes.shape[0]
    pre, post = torch.empty(n, hc, dtype=torch.float32), torch.empty(n, hc, dtype=torch.float32)
    comb = torch.empty(n, hc, hc, dtype=torch.float32)
    if fn(mixes.data_ptr(), n, hc, scale.data_ptr(), base.data_ptr(), iters, eps, pre.data_ptr(), post.data_ptr(),
          comb.data_ptr()):
        raise _outside(hc)
    return pre, post, comb


_built: list = []  # [] until the first call, then [kernel or None]
_built_lock = threading.Lock()


def kernel(reference):
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
    fn = kernel(reference)
    if fn is None:
        return None
    return _call(fn.mix_weights, mixes.contiguous(), scale.contiguous(), base.contiguous(), hc, iters, eps)


def _float_cpu(*tensors) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def token_weights_fit(fn, scale, base, norm_weight, hc: int) -> bool:
    """Whether a sublayer's mHC weights are what the one-token calls take (CPU float32 contiguous, fn
    [(2 + hc) * hc, hc * H], norm_weight [H], hc_mult in 1..HC_MAX); families/deepseek_v4/token_layer.py checks once."""
    width = (2 + hc) * hc
    return (norm_weight is not None and norm_weight.dim() == 1 and 1 <= hc <= HC_MAX
            and fn.shape == (width, hc * norm_weight.shape[0]) and scale.numel() == 3 and base.numel() == width
            and _float_cpu(fn, scale, base, norm_weight))


def token_pre(streams, fn, scale, base, hc: int, iters: int, hc_eps: float, norm_eps: float, norm_weight,
              reference):
    """model.hc_pre followed by the sublayer's rms_norm for one token, streams [1, hc, H] -> (x [1, H], post
    [1, hc], comb [1, hc, hc]) in one call; None where it does not apply (not one token, not CPU float32
    contiguous tensors of the expected shapes, hc outside 1..HC_MAX, no compiler)."""
    if (streams.dim() != 3 or streams.shape[:2] != (1, hc) or not token_weights_fit(fn, scale, base, norm_weight, hc)
            or norm_weight.shape != (streams.shape[2],) or not _float_cpu(streams)):
        return None
    kernels = kernel(reference)
    return None if kernels is None else _token_pre(kernels, streams, fn, scale, base, hc, iters, hc_eps, norm_eps,
                                                   norm_weight)


def token_post(streams, out, post, comb, reference):
    """model.hc_post for one token (streams [1, hc, H], out [1, H]) in one call; None where it does not apply."""
    hc = streams.shape[1] if streams.dim() == 3 else 0
    if (streams.shape[0] != 1 or not 1 <= hc <= HC_MAX or out.numel() != streams.shape[2]
            or post.numel() != hc or comb.numel() != hc * hc or not _float_cpu(streams, out, post, comb)):
        return None
    kernels = kernel(reference)
    return None if kernels is None else _token_post(kernels, streams, out, post, comb)
