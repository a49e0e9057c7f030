"""A model's dense operations, each choosing its backend: the compiled token kernels (backends/token_kernels.py) for
a few rows on a CPU (a decoded token), torch otherwise (torch.compile'd on a CUDA device where a family asks:
DeviceCompiled). A model family calls these, not token_kernels: which kernel
runs where, and the roundings each path keeps equal, live here once. Nothing here names a family.

Roundings: a bfloat16 weight takes its input rounded to bfloat16, products summed in float32, the result rounded to
bfloat16, on either path; the kernel adds the same products in another order than torch."""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from moepack.backends import token_kernels


COMPILE_ENV = "MOEPACK_COMPILE"  # "0": no torch.compile on a CUDA device (its callers run their torch ops)


def compiling_on(device: torch.device) -> bool:
    """Whether DeviceCompiled functions run compiled on `device` (a CUDA device, unless MOEPACK_COMPILE=0)."""
    return device.type == "cuda" and os.environ.get(COMPILE_ENV, "1") != "0"


class DeviceCompiled:
    """fn (of tensors on one device, the first argument's) compiled by torch.compile where `compiling_on` its
    device: many small ops (a loop of tiny reductions) fused into a few kernels, one compile for every leading size
    (a step's rows, a prefill's chunk); fn itself elsewhere, or after its compile failed (one warning line). Its
    first call on a shape compiles: a caller that captures CUDA graphs runs it once before its capture."""

    def __init__(self, fn: Callable):
        self.fn, self._compiled, self.failed = fn, None, False

    def __call__(self, *args):
        if self.failed or not compiling_on(args[0].device):
            return self.fn(*args)
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, dynamic=True, fullgraph=False)
        try:
            return self._compiled(*args)
        except Exception as e:  # a machine where inductor cannot build (no compiler, no Triton): the torch ops
            self.failed = True
            warnings.warn(f"torch.compile of {self.fn.__name__} failed ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); it runs uncompiled", RuntimeWarning,
                          stacklevel=2)
            return self.fn(*args)


def kernels_for(rows: int, x: Tensor, w: Tensor):
    """The compiled token matmul where x is a few `rows` (a decoded token, a decode step's rows: small_rows), both
    are on a CPU and w is a contiguous float32 / bfloat16 matrix; else None. torch's one-row GEMV reads bf16 weights
    at half the memory's pace; the kernel does the same products and float32 sums, added in another order."""
    if rows <= token_kernels.small_rows() and x.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16) \
            and w.dim() == 2 and w.is_contiguous():
        return token_kernels.token_kernels()
    return None


def rows(x: Tensor) -> int:
    return x.numel() // max(x.shape[-1], 1)


def fused_norm_on(device: torch.device) -> bool:
    """Whether `fused_rms_norm` runs on `device`: CUDA, where torch's rms_norm is one kernel (_fused_rms_norm); on a
    CPU it is torch's composite of the same steps, so the families keep their own arithmetic there."""
    return device.type == "cuda"


def fused_rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor | None:
    """x times the inverse root of its mean square over the last dimension (+ eps), times `weight` if any, in one
    kernel where `fused_norm_on` x's device and the weight has x's dtype; else None (the caller's own steps: about
    seven launches, and a decode step runs several norms a layer, each a node of its CUDA graph)."""
    if not fused_norm_on(x.device) or (weight is not None and weight.dtype != x.dtype):
        return None
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def matmul(x: Tensor, w: Tensor) -> Tensor:
    """F.linear(x, w) (same dtypes), through the token matmul for a few rows of x on a CPU."""
    kernels = kernels_for(rows(x), x, w) if x.dtype == w.dtype else None
    if kernels is None:
        return F.linear(x, w)
    y = kernels.linear(x.reshape(-1, x.shape[-1]), token_kernels.float_matrix(w), w.dtype == torch.bfloat16)
    return y.to(w.dtype).reshape(*x.shape[:-1], w.shape[0])


def widened_matmul(x: Tensor, w: Tensor) -> Tensor:
    """float32 x @ w.T for a bfloat16 / float16 w, its values widened to float32 exactly: the products and sums of a
    float32 copy of w (nothing rounded), reading half the bytes where the token matmul takes x (decode's head,
    kept as stored)."""
    kernels = kernels_for(rows(x), x, w) if w.dtype == torch.bfloat16 else None
    if kernels is None:
        return F.linear(x, w.float())
    y = kernels.linear(x.reshape(-1, x.shape[-1]), token_kernels.float_matrix(w), False)
    return y.reshape(*x.shape[:-1], w.shape[0])


def widened_rows(x: Tensor, w: Tensor) -> Tensor | None:
    """float32 x [B, in] @ w.T in one compiled call however many rows B (w read once for all of them), each row's
    products and sums those of widened_matmul on that row alone; None where the kernel does not take x and w."""
    kernels = kernels_for(1, x, w) if x.dtype == torch.float32 else None
    return None if kernels is None else kernels.linear(x, token_kernels.float_matrix(w), False)


def linear(x: Tensor, w: Tensor) -> Tensor:
    """x @ w.T computed in w's dtype, the result in x's: a bfloat16 weight takes its input rounded to bfloat16
    (products summed in float32, the result rounded to bfloat16); float32 weights give exactly F.linear."""
    if x.dtype == w.dtype:
        return matmul(x, w)
    kernels = kernels_for(rows(x), x, w) if x.dtype == torch.float32 and w.dtype == torch.bfloat16 else None
    if kernels is not None:  # the same roundings inside the kernel: no conversions on either side of it
        y = kernels.linear(x.reshape(-1, x.shape[-1]), token_kernels.float_matrix(w), True, round_output=True)
        return y.reshape(*x.shape[:-1], w.shape[0])
    return matmul(x.to(w.dtype), w).to(x.dtype)


# the weights' ids -> (weak references to them, their LinearPlan or None): a plan serves only the very tensors it
# was made for (an id of a freed tensor may come back), and does not keep them alive
_LINEAR_PLANS: dict[tuple[int, ...], tuple] = {}
_MAX_LINEAR_PLANS = 4096


def linear_plan(weights: list[Tensor]):
    """The weights as one token_kernels.LinearPlan (made once per list of weights), or None where the kernel does
    not take one of them (not a contiguous 2-D CPU float32 / bfloat16 tensor, another column count)."""
    key = tuple(map(id, weights))
    known = _LINEAR_PLANS.get(key)
    if known is not None and all(ref() is w for ref, w in zip(known[0], weights)):
        return known[1]
    usable = all(w.dtype in (torch.float32, torch.bfloat16) and w.dim() == 2 and w.is_contiguous()
                 and w.device.type == "cpu" and w.shape[1] == weights[0].shape[1] for w in weights)
    rounded = token_kernels.ROUND_INPUT | token_kernels.ROUND_OUTPUT
    plan = token_kernels.LinearPlan([token_kernels.float_matrix(w) for w in weights],
                                    [rounded if w.dtype == torch.bfloat16 else 0 for w in weights]) if usable else None
    if len(_LINEAR_PLANS) >= _MAX_LINEAR_PLANS:
        _LINEAR_PLANS.clear()
    _LINEAR_PLANS[key] = (tuple(weakref.ref(w) for w in weights), plan)
    return plan


def linears(x: Tensor, weights: list[Tensor]) -> list[Tensor]:
    """[linear(x, w) for w in weights]: for one float32 row on a CPU (a decoded token), one compiled call for all
    of them where the token kernel takes every w (the same roundings as `linear`'s)."""
    kernels = kernels_for(1, x, weights[0]) if x.dtype == torch.float32 and rows(x) == 1 else None
    plan = linear_plan(weights) if kernels is not None else None
    if plan is not None:
        outs = kernels.linear_many(x, plan)
        return outs if x.dim() == 2 else [out.reshape(*x.shape[:-1], out.shape[-1]) for out in outs]
    return [linear(x, w) for w in weights]


def low_matmul(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """a @ b with both in `dtype` (bfloat16: products in bf16, float32 sums, the result rounded to bf16). For a few
    queries (a's first dimension) on a CPU the bf16 product runs in float32 and is rounded after: the same products
    (bf16 x bf16 is exact in float32), while oneDNN builds a kernel for each new bf16 shape (~0.7 ms) and decode's
    key count grows by one every token."""
    a, b = a.to(dtype), b.to(dtype)
    if dtype == torch.bfloat16 and a.device.type == "cpu" and a.shape[0] <= token_kernels.SMALL_ROWS:
        return torch.matmul(a.float(), b.float()).to(dtype)
    return torch.matmul(a, b)


def grouped_projection(o: Tensor, wo_a: Tensor, wo_b: Tensor, groups: int, rank: int) -> Tensor:
    """o [C, ...] -> [C, out]: o's last dimensions split into `groups` equal groups, each projected on its own to
    `rank` (wo_a [groups * rank, in / groups] holds the groups' matrices stacked), then wo_b mixes all groups."""
    kernels = kernels_for(o.shape[0], o, wo_a)
    if kernels is not None and o.shape[0] == 1 and o.dtype == torch.float32 and wo_a.dtype == wo_b.dtype:
        # one token: the roundings to the weights' dtype inside the kernels, no conversions between them
        low = wo_a.dtype == torch.bfloat16
        low_rank = kernels.grouped(o.reshape(groups, -1), token_kernels.float_matrix(wo_a), low, round_output=low)
        return linear(low_rank.reshape(1, -1), wo_b)
    if kernels is not None:  # a decoded token's groups in one compiled call
        low_rank = torch.stack([kernels.grouped(row.reshape(groups, -1), token_kernels.float_matrix(wo_a),
                                                wo_a.dtype == torch.bfloat16).to(wo_a.dtype) for row in o])
        return matmul(low_rank.flatten(1).to(wo_b.dtype), wo_b).to(o.dtype)
    grouped = o.reshape(o.shape[0], groups, -1).transpose(0, 1)  # [G, C, in/G]
    per_group = wo_a.view(groups, rank, -1)  # [G, R, in/G]
    # low_rank [C, G, R] goes straight into wo_b's dtype (the values a float32 round trip would give)
    low_rank = torch.bmm(grouped.to(per_group.dtype), per_group.transpose(1, 2)).transpose(0, 1)
    return matmul(low_rank.flatten(1).to(wo_b.dtype), wo_b).to(o.dtype)


def clamped_swiglu(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    """silu(gate) * up, the gate clamped from above and the up projection on both sides at `limit`."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def swiglu_ffn(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, limit: float,
               hidden_order: Tensor | None = None) -> Tensor:
    """Clamped SwiGLU: x [n, H], w1 (gate) / w3 (up) [I, H], w2 (down) [H, I] -> [n, H], clamped at `limit`
    (clamped_swiglu). `hidden_order`: w2's columns are stored permuted (w2[:, hidden_order]), so the hidden
    activation is permuted the same way. One float32 token on a CPU: the three linears and the SwiGLU between them
    in one compiled call, rounded as the linears round."""
    matrices = (w1, w3, w2)
    kernels = kernels_for(rows(x), x, w1) if rows(x) == 1 and x.dtype == torch.float32 else None
    if kernels is not None and hidden_order is None and all(w.dtype == w1.dtype and w.is_contiguous()
                                                            for w in matrices):
        low = w1.dtype == torch.bfloat16
        out = kernels.moe(x.reshape(-1), [tuple(token_kernels.float_matrix(w) for w in matrices)],
                          torch.ones(1), limit, low, round_output=low)
        return out.reshape(x.shape)
    hidden = clamped_swiglu(*linears(x, [w1, w3]), limit)
    return linear(hidden if hidden_order is None else hidden[:, hidden_order], w2)
