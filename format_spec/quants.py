"""ggml block codecs: Q8_0, MXFP4, NVFP4, Q2_K, IQ2_XXS (byte layouts of ggml-common.h), vectorised in torch.

The types are the codec classes of codecs.py that declare a quantizer (QTYPES): each class holds its chunk
kernels, their chunk sizes and its compiled CPU kernel, and runs them through quant_common's chunked driver; this
module is the API by type name.

Public API (also re-exported as ``moepack.quantize`` / ``moepack.dequantize``)::

    quantize(x, qtype, *, importance=None) -> numpy uint8 [..., n/block_elems*block_bytes]
    dequantize(blocks, qtype, shape) -> numpy float32 of `shape`
    quantize_torch(x, qtype, *, importance=None, out=None) -> torch uint8 on x's device
    dequantize_torch(blocks, qtype, shape, *, dtype=torch.float32, out=None) -> torch tensor on blocks' device
    fp4_to_mxfp4(packed, scale_e8m0) / mxfp4_to_fp4(blocks, shape=None)   lossless release-FP4 <-> MXFP4
    block_layout(qtype) -> (block_elems, block_bytes);  quantized_nbytes(qtype, shape)
    nvfp4_tensor_exponent(x) -> int k: the power-of-two prescale NVFP4 needs for small-magnitude weights
    nvfp4_prescale(x) -> (x * 2^-e, e): the prescaled values and the tensor scale 2^e a container stores
    native_kernels() -> how this process got its compiled CPU kernels (compiled, or loaded from the cache)

``x`` is any float numpy array or torch tensor (float32/16/64, bfloat16, float8) whose last dimension is a
multiple of the type's block; the result holds its blocks row-major, exactly as ggml stores the tensor
(gguf-py's ``quants.quantize`` returns the same shape and, for Q8_0 and MXFP4, the same bytes).
``importance`` (Q2_K and IQ2_XXS only; the round-to-nearest types ignore it) is a non-negative weight per
input channel, shape [x.shape[-1]] (e.g. the mean squared activation of that channel): the quantizer then
minimises sum(importance * error^2) instead of the plain squared error.

Every codec processes cache-sized chunks of blocks with whole-chunk torch operations (multi-threaded by
torch's intra-op pool; on a CUDA tensor the same ops run on the GPU); no Python loop runs over blocks. On the CPU,
Q8_0 and MXFP4 run a small C kernel instead when a C compiler is there (built once per machine into a cache, the
same bytes; see ``native_kernels()``).
"""

from __future__ import annotations

import numpy as np
import torch

from .codecs import QTYPES, block_codec, block_layout, quantized_nbytes
from moepack.native import native_builds
from .quant_fp4 import NVFP4_TOP_SCALE, fp4_to_mxfp4, mxfp4_to_fp4, nvfp4_prescale, nvfp4_tensor_exponent

__all__ = ["QTYPES", "quantize", "dequantize", "quantize_torch", "dequantize_torch", "fp4_to_mxfp4",
           "mxfp4_to_fp4", "block_layout", "quantized_nbytes", "nvfp4_tensor_exponent", "nvfp4_prescale",
           "native_kernels", "NVFP4_TOP_SCALE"]


def quantize_torch(x, qtype: str, *, importance=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize to ggml blocks on x's device: uint8 tensor [..., n/block_elems*block_bytes]. `out`, a contiguous
    uint8 tensor of that many bytes on the same device, is filled instead of allocating."""
    return block_codec(qtype).quantize(x, importance=importance, out=out)


def quantize(x, qtype: str, *, importance=None) -> np.ndarray:
    """Quantize a float array/tensor to ggml blocks: numpy uint8 [..., n/block_elems*block_bytes]."""
    out = quantize_torch(x, qtype, importance=importance)
    return out.cpu().numpy() if out.device.type != "cpu" else out.numpy()


def dequantize_torch(blocks, qtype: str, shape, *, dtype: torch.dtype = torch.float32,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """ggml blocks -> values of logical `shape`, on the device the bytes are on (CPU or CUDA). `out`, a contiguous
    float32 tensor of prod(shape) elements on that device, is filled instead of allocating (a runtime that reuses
    one buffer per weight shape skips the page faults of a fresh output, ~half the time at this size);
    `dtype` other than float32 converts the result (then a new tensor)."""
    return block_codec(qtype).dequantize(blocks, shape, dtype=dtype, out=out)


def native_kernels() -> dict[str, dict]:
    """The compiled CPU kernels (moepack.native) this process has asked for so far: name -> compiled (usable),
    cached (loaded from the cache, not compiled), path, compiler, flags, seconds (to compile or load), or the
    reason it isn't used."""
    return native_builds()


def dequantize(blocks, qtype: str, shape) -> np.ndarray:
    """ggml blocks (numpy/torch uint8 or bytes-like) -> numpy float32 array of `shape`."""
    out = dequantize_torch(blocks, qtype, shape)
    return out.cpu().numpy() if out.device.type != "cpu" else out.numpy()
