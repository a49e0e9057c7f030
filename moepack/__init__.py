"""moepack: a streaming container for huge Mixture-of-Experts checkpoints and a layer-major prefill runtime.

The package's code lives in the design card's folders, mapped into this namespace:
``moepack.format_spec`` (the container format: spec, reader, writer, validator, codecs),
``moepack.packer`` (checkpoint -> container), ``moepack.runtime`` (prefill), ``moepack.cli``.
"""

__version__ = "0.1.0"

from moepack.format_spec.errors import MoepackError  # noqa: E402


def __getattr__(name):
    # The codecs pull in torch; import them on first use so `moepack --help` stays fast.
    if name in ("quantize", "dequantize"):
        from moepack.format_spec import quants

        return getattr(quants, name)
    raise AttributeError(f"module 'moepack' has no attribute {name!r}")


__all__ = ["MoepackError", "quantize", "dequantize", "__version__"]
