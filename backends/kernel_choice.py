"""Choosing, per shape class, between a Triton kernel and torch's computation of the same result (the fallback):
the first call of a class runs both, accepts the kernel only where it agrees with torch's within the caller's
tolerance, times both and keeps the faster; a kernel that raises gives torch's result with one warning. A forced
choice (the caller's environment variable at 1) takes the kernel unchecked and untimed, still torch's where it
raises. Each decision is recorded in the caller's DECISIONS dict (benchmarks print it). Shared by
fused_scores.py (the indexer's scores) and stored_gemv.py (the stored pool's FP4 experts).
Triton is imported only when a kernel may run (never on a CPU path)."""

from __future__ import annotations

import functools
import os
import time
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

TIMED_REPS = 3


def interpreting() -> bool:
    """Whether kernels run in Triton's interpreter (TRITON_INTERPRET=1: CPU tensors, the tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def triton_modules():
    """(triton, triton.language), or None where Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return triton, tl


def power_of_two_above(n: int) -> int:
    """The least power of two >= n."""
    return 1 << max(n - 1, 0).bit_length()


def short_bench(kernel_call, quantiles):
    """The autotuner's timing of one config (Triton's default, 25 + 100 ms a config, would be most of a step)."""
    from triton.testing import do_bench
    return do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


def seconds(fn: Callable[[], Tensor], device: torch.device) -> float:
    """The best of TIMED_REPS calls: CUDA events on a GPU, the wall clock elsewhere."""
    best = float("inf")
    for _ in range(TIMED_REPS):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - began)
    return best


def relative_error(got: Tensor, want: Tensor) -> float:
    """max |got - want| over max |want| where want is finite; inf where the two disagree on which are -inf."""
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)):
        return float("inf")
    if not finite.any():
        return 0.0
    scale = want[finite].abs().max().clamp_min(1e-30)
    return float((got[finite] - want[finite]).abs().max() / scale)


class KernelChoice:
    """One kernel's choice against torch's: `what` names it in warnings, `fallback` torch's result, `force_env` the
    variable that forces it (0: torch's, 1: the kernel), `tolerance` the largest relative_error accepted."""

    def __init__(self, what: str, fallback: str, force_env: str, tolerance: float):
        self.what, self.fallback, self.force_env, self.tolerance = what, fallback, force_env, tolerance

    def forced(self) -> str:
        """The forcing variable's value ("0", "1" or "")."""
        return os.environ.get(self.force_env, "")

    def result(self, decisions: dict, key: str, device: torch.device, kernel: Callable[[], Tensor],
               reference: Callable[[], Tensor]) -> Tensor:
        """kernel() or reference() for shape class `key`, as its decision in `decisions` says (made here at the
        class's first call; forced by the variable at 1)."""
        if self.forced() == "1":  # the kernel unchecked and untimed (until it raises)
            key += " forced"
            decision = decisions.setdefault(key, {"chosen": "fused", "reason": "forced"})
        else:
            decision = decisions.get(key)
            if decision is None and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return reference()  # (a CUDA graph's capture cannot wait for timings: its warm-up run decides)
            if decision is None:
                return self._decide(decisions, key, device, kernel, reference)
        if decision["chosen"] != "fused":
            return reference()
        try:
            return kernel()
        except Exception as e:  # a later call's launch failing (out of memory, say): torch's from then on
            self._fell_back(decisions, key, e)
            return reference()

    def _fell_back(self, decisions: dict, key: str, error: Exception) -> None:
        first = (str(error).strip().splitlines() or [""])[0][:160]
        warnings.warn(f"{self.what} failed for {key} ({type(error).__name__}: {first}); {self.fallback} used",
                      RuntimeWarning, stacklevel=4)
        decisions[key] = {"chosen": "torch", "reason": f"{type(error).__name__}: {first}"}

    def _decide(self, decisions: dict, key: str, device: torch.device, kernel: Callable[[], Tensor],
                reference: Callable[[], Tensor]) -> Tensor:
        """The first call of a shape class: both paths, the kernel checked against torch's and both timed; the
        decision recorded, the checked result returned."""
        want = reference()
        try:
            got = kernel()
            error = relative_error(got, want)
            fused_s = seconds(kernel, device)
        except Exception as e:  # Triton's compile and launch errors are of many types: any of them means torch's
            self._fell_back(decisions, key, e)
            return want
        torch_s = seconds(reference, device)
        decision = {"fused_s": fused_s, "torch_s": torch_s, "error": error}
        if error > self.tolerance:
            warnings.warn(f"{self.what} for {key}: {error:.3g} of the largest value off torch's "
                          f"(over {self.tolerance}); {self.fallback} used", RuntimeWarning, stacklevel=4)
            decisions[key] = {"chosen": "torch", "reason": f"{self.what} off torch's", **decision}
            return want
        chosen = "fused" if fused_s < torch_s else "torch"
        decisions[key] = {"chosen": chosen, "reason": "faster", **decision}
        return got if chosen == "fused" else want
