"""moepack: a streaming container for huge Mixture-of-Experts checkpoints and a layer-major prefill runtime.

The package's code lives in the design card's folders, mapped into this namespace:
``moepack.format_spec`` (the container format: spec, reader, writer, validator, codecs),
``moepack.packer`` (checkpoint -> container), ``moepack.runtime`` (prefill), ``moepack.cli``.
"""

__version__ = "0.1.0"

import os

# OpenMP threads that finish a parallel op spin before they sleep (libgomp: 300,000 spins). On a machine whose
# cores all compute, a spinning thread takes its core from the expert threads that start right after the
# attention's ops: N = 256 prefill on 2 cores, best of 3 in 6 processes each, 0.86-0.99 s -> 0.74-0.83 s with
# 10,000 spins (N = 1024: within the noise). libgomp reads this once, when torch loads it: set before that, and
# never over the user's own setting.
OMP_SPINCOUNT = "10000"
OMP_SPINCOUNT_SET_HERE = not any(k in os.environ for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"))
if OMP_SPINCOUNT_SET_HERE:
    os.environ["GOMP_SPINCOUNT"] = OMP_SPINCOUNT

from moepack.format_spec.errors import MoepackError  # noqa: E402


def __getattr__(name):
    # The codecs pull in torch; import them on first use so `moepack --help` stays fast.
    if name in ("quantize", "dequantize"):
        from moepack.format_spec import quants

        return getattr(quants, name)
    raise AttributeError(f"module 'moepack' has no attribute {name!r}")


__all__ = ["MoepackError", "quantize", "dequantize", "__version__"]
