"""The mHC weights of a sublayer (model.hc_mix_weights) compiled: one C call instead of about 140 small torch ops.

Per token the hyper-connection turns hc*(2 + hc) mixes into `pre`, `post` and the hc x hc `comb`, and comb takes
hc_sinkhorn_iters rounds of Sinkhorn-Knopp (20 in DeepSeek-V4): every round divides each row, then each column, by
its sum. In torch that is ~140 ops on [N, 4, 4] tensors per sublayer, each a few microseconds of dispatch for a few
thousand numbers: 0.55 ms per sublayer at N = 256, twice per layer, on the prefill's critical path. The C kernel
keeps 16 tokens side by side (each step one vector op) and takes 0.03 ms.

The same formulas as the torch path (sigmoid as 1 / (1 + exp(-x)), softmax with the row maximum subtracted, each
Sinkhorn pass dividing by its sums plus eps), so the results agree to float32 rounding (torch's vectorised exp
and reductions differ in the last bits); the library is used only after it agrees with the torch path on random
mixes at load (format_spec.quant_common.native_library: built once per
process, skipped with MOEPACK_NATIVE=0). CPU float32 only; anything else stays in torch.
"""

from __future__ import annotations

import ctypes
import warnings

import torch

from moepack.format_spec import quant_common

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#define LANES 16
#define HC_MAX 8

/* One Sinkhorn pass: each of the hc lines of c (rows: line stride hc, step 1; columns: line stride 1, step hc)
   divided by its sum plus eps, for LANES tokens at once. */
static inline void normalize_lines(float c[][LANES], int hc, int line_stride, int step, float eps) {
    float sum[LANES];
    for (int a = 0; a < hc; a++) {
        for (int l = 0; l < LANES; l++) sum[l] = 0.0f;
        for (int b = 0; b < hc; b++)
            for (int l = 0; l < LANES; l++) sum[l] += c[a * line_stride + b * step][l];
        for (int b = 0; b < hc; b++)
            for (int l = 0; l < LANES; l++) c[a * line_stride + b * step][l] /= sum[l] + eps;
    }
}

/* mixes [n, (2 + hc) * hc] -> pre [n, hc], post [n, hc], comb [n, hc, hc]; scale [3], base [(2 + hc) * hc].
   The tokens go LANES at a time, each value of the LANES tokens side by side, so every step is one vector op. */
int hc_mix_weights(const float *mixes, int64_t n, int hc, const float *scale, const float *base, int iters,
                   float eps, float *pre, float *post, float *comb)
{
    if (hc < 1 || hc > HC_MAX) return 1;
    const int width = (2 + hc) * hc;
    for (int64_t t0 = 0; t0 < n; t0 += LANES) {
        const int lanes = n - t0 < LANES ? (int)(n - t0) : LANES;
        float c[HC_MAX * HC_MAX][LANES], top[LANES], sum[LANES];
        for (int j = 0; j < hc; j++)
            for (int l = 0; l < lanes; l++) {
                const float *m = mixes + (t0 + l) * width;
                pre[(t0 + l) * hc + j] = 1.0f / (1.0f + expf(-(m[j] * scale[0] + base[j]))) + eps;
                post[(t0 + l) * hc + j] = 2.0f * (1.0f / (1.0f + expf(-(m[hc + j] * scale[1] + base[hc + j]))));
            }
        for (int i = 0; i < hc * hc; i++)
            for (int l = 0; l < LANES; l++)
                c[i][l] = l < lanes ? mixes[(t0 + l) * width + 2 * hc + i] * scale[2] + base[2 * hc + i] : 0.0f;
        for (int r = 0; r < hc; r++) {  /* softmax of each row, plus eps */
            for (int l = 0; l < LANES; l++) { top[l] = c[r * hc][l]; sum[l] = 0.0f; }
            for (int k = 1; k < hc; k++)
                for (int l = 0; l < LANES; l++) top[l] = fmaxf(top[l], c[r * hc + k][l]);
            for (int k = 0; k < hc; k++)
                for (int l = 0; l < LANES; l++) sum[l] += (c[r * hc + k][l] = expf(c[r * hc + k][l] - top[l]));
            for (int k = 0; k < hc; k++)
                for (int l = 0; l < LANES; l++) c[r * hc + k][l] = c[r * hc + k][l] / sum[l] + eps;
        }
        for (int round = 0; round < (iters > 1 ? iters : 1); round++) {  /* as torch: at least one column pass */
            if (round)  /* the first round's rows are the softmax's */
                normalize_lines(c, hc, hc, 1, eps);
            normalize_lines(c, hc, 1, hc, eps);
        }
        for (int i = 0; i < hc * hc; i++)
            for (int l = 0; l < lanes; l++) comb[(t0 + l) * hc * hc + i] = c[i][l];
    }
    return 0;
}
"""
HC_MAX = 8  # the kernel's largest hc_mult (DeepSeek-V4: 4)


def _load():
    """The compiled kernel where it builds and agrees with the torch path, else None."""
    from . import model

    lib = quant_common.native_library("moepack_mhc", _SOURCE)
    if lib is None:
        return None
    p = ctypes.c_void_p
    fn = quant_common.c_function(lib, "hc_mix_weights", (p, ctypes.c_int64, ctypes.c_int, p, p, ctypes.c_int,
                                                           ctypes.c_float, p, p, p))
    gen = torch.Generator().manual_seed(0)
    for hc, tokens, iters in ((4, 37, 20), (3, 5, 1), (1, 16, 0)):  # a partial lane group, one round, hc = 1
        mixes = torch.randn(tokens, (2 + hc) * hc, generator=gen) * 3
        scale, base = torch.rand(3, generator=gen) + 0.5, torch.randn((2 + hc) * hc, generator=gen)
        want = model.hc_mix_weights(mixes, scale, base, hc, iters, 1e-6)
        got = _call(fn, mixes, scale, base, hc, iters, 1e-6)
        if not all(torch.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want)):
            reason = "its results differ from the torch path's on the self-check mixes"
            quant_common._disable_native("moepack_mhc", reason)
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


_kernel = quant_common.LazyKernel(_load)


def hc_mix_weights(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """model.hc_mix_weights by the compiled kernel, or None where it does not apply (anything but CPU float32
    mixes [N, (2 + hc) * hc] with scale [3] and base [(2 + hc) * hc], hc_mult outside 1..HC_MAX, no compiler):
    the caller then runs the torch path, which also names what is wrong with its inputs."""
    width = (2 + hc) * hc
    if (not 1 <= hc <= HC_MAX or mixes.dim() != 2 or mixes.shape[1] != width or scale.numel() != 3
            or base.numel() != width or any(t.device.type != "cpu" or t.dtype != torch.float32
                                            for t in (mixes, scale, base))):
        return None
    fn = _kernel()
    if fn is None:
        return None
    return _call(fn, mixes.contiguous(), scale.contiguous(), base.contiguous(), hc, iters, eps)
