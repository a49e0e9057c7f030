"""ggml block codecs: Q8_0, MXFP4, NVFP4, Q2_K, IQ2_XXS (byte layouts of ggml-common.h), vectorised in torch.

Public API (also re-exported as ``moepack.quantize`` / ``moepack.dequantize``)::

    quantize(x, qtype, *, importance=None) -> numpy uint8 [..., n/block_elems*block_bytes]
    dequantize(blocks, qtype, shape) -> numpy float32 of `shape`
    quantize_torch(x, qtype, *, importance=None, out=None) -> torch uint8 on x's device
    dequantize_torch(blocks, qtype, shape, *, dtype=torch.float32, out=None) -> torch tensor on blocks' device
    fp4_to_mxfp4(packed, scale_e8m0) / mxfp4_to_fp4(blocks, shape=None)   lossless release-FP4 <-> MXFP4
    block_layout(qtype) -> (block_elems, block_bytes);  quantized_nbytes(qtype, shape)
    nvfp4_tensor_exponent(x) -> int k: the power-of-two prescale NVFP4 needs for small-magnitude weights
    nvfp4_prescale(x) -> (x * 2^-e, e): the prescaled values and the tensor scale 2^e a container stores
    native_kernels() -> how the compiled CPU kernels (Q8_0, MXFP4) were built in this process

``x`` is any float numpy array or torch tensor (float32/16/64, bfloat16, float8) whose last dimension is a
multiple of the type's block; the result holds its blocks row-major, exactly as ggml stores the tensor
(gguf-py's ``quants.quantize`` returns the same shape and, for Q8_0 and MXFP4, the same bytes).
``importance`` (Q2_K and IQ2_XXS only; the round-to-nearest types ignore it) is a non-negative weight per
input channel, shape [x.shape[-1]] (e.g. the mean squared activation of that channel): the quantizer then
minimises sum(importance * error^2) instead of the plain squared error.

Every codec processes cache-sized chunks of blocks with whole-chunk torch operations (multi-threaded by
torch's intra-op pool; on a CUDA tensor the same ops run on the GPU); no Python loop runs over blocks. On the CPU,
Q8_0 and MXFP4 run a small C kernel instead when a C compiler is there (built once per process, the same bytes;
see ``native_kernels()``).
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import MoepackError
from .quant_common import (NONFINITE_INPUT, QTYPES, as_float_tensor, as_uint8_tensor, block_layout, check_shape,
                           chunk_rows, empty_float32, empty_uint8, native_builds, quantized_nbytes, run_chunks)
from . import quant_fp4, quant_iq2_xxs, quant_q2_k, quant_q8_0
from .quant_fp4 import fp4_to_mxfp4, mxfp4_to_fp4

__all__ = ["QTYPES", "quantize", "dequantize", "quantize_torch", "dequantize_torch", "fp4_to_mxfp4",
           "mxfp4_to_fp4", "block_layout", "quantized_nbytes", "nvfp4_tensor_exponent", "nvfp4_prescale",
           "native_kernels"]

# qtype -> (chunk kernel, CPU elements per chunk, takes importance). Chunk sizes measured on the 2-core dev
# machine: big enough that the ~10-40 torch ops per chunk amortise their per-op (OpenMP) overhead, small enough
# that a chunk's temporaries stay within a few MiB of cache.
_QUANTIZERS = {
    "Q8_0": (quant_q8_0.quantize_chunk, 1 << 18, False),
    "MXFP4": (quant_fp4.mxfp4_quantize_chunk, 1 << 18, False),
    "NVFP4": (quant_fp4.nvfp4_quantize_chunk, 1 << 18, False),
    "Q2_K": (quant_q2_k.quantize_chunk, 1 << 16, True),
    "IQ2_XXS": (quant_iq2_xxs.quantize_chunk, 1 << 13, True),
}
# qtype -> (loader of its compiled CPU kernel, giving None when there is none, elements per chunk). The kernel
# makes one pass per block, so chunks need not fit in L2: they are sized for load balance across the threads.
_NATIVE_QUANTIZERS = {
    "Q8_0": (quant_q8_0.native_quantize_chunk, 1 << 20),
    "MXFP4": (quant_fp4.native_mxfp4_quantize_chunk, 1 << 20),
}
_DEQUANTIZERS = {
    "Q8_0": (quant_q8_0.dequantize_chunk, 1 << 19),
    "MXFP4": (quant_fp4.mxfp4_dequantize_chunk, 1 << 18),
    "NVFP4": (quant_fp4.nvfp4_dequantize_chunk, 1 << 18),
    "Q2_K": (quant_q2_k.dequantize_chunk, 1 << 16),
    "IQ2_XXS": (quant_iq2_xxs.dequantize_chunk, 1 << 16),
}


def _importance_blocks(importance, row: int, block: int, device: torch.device) -> torch.Tensor:
    w = as_float_tensor(importance, "importance").to(device=device, dtype=torch.float32).reshape(-1)
    if w.numel() != row:
        raise MoepackError(f"importance has {w.numel()} values; expected one per input channel ({row})")
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise MoepackError("importance must be finite and non-negative")
    if not bool((w > 0).any()):
        w = torch.ones_like(w)
    # a chunk's weights are rows of this table, picked by block index modulo blocks-per-row
    return (w / w.mean()).reshape(row // block, block).contiguous()


def _out_buffer(out, numel: int, dtype: torch.dtype, device: torch.device, what: str) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise MoepackError(f"out must be a torch tensor, got {type(out).__name__}")
    if out.dtype != dtype or out.device != device or out.numel() != numel or not out.is_contiguous():
        raise MoepackError(f"out must be a contiguous {dtype} tensor of {numel} elements on {device} for {what}, "
                           f"got {out.dtype} {list(out.shape)} on {out.device}")
    return out


def quantize_torch(x, qtype: str, *, importance=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize to ggml blocks on x's device: uint8 tensor [..., n/block_elems*block_bytes]. `out`, a contiguous
    uint8 tensor of that many bytes on the same device, is filled instead of allocating."""
    be, bb = block_layout(qtype)
    xt = as_float_tensor(x, "input")
    shape = check_shape(qtype, xt.shape)
    kernel, cpu_elems, weighted = _QUANTIZERS[qtype]
    native = None
    if xt.device.type == "cpu" and qtype in _NATIVE_QUANTIZERS:
        load, native_elems = _NATIVE_QUANTIZERS[qtype]
        native = load()
        if native is not None:
            kernel, cpu_elems = native, native_elems
    xb = xt.reshape(-1, be)
    nb = xb.shape[0]
    if out is None:
        out = empty_uint8((nb, bb), xt.device)
    else:
        out = _out_buffer(out, nb * bb, torch.uint8, xt.device, f"{qtype}{list(shape)}").view(nb, bb)
    wtab = None
    if importance is not None and weighted:
        wtab = _importance_blocks(importance, shape[-1], be, xt.device)
    step = chunk_rows(nb, be, xt.device, cpu_elems)

    def chunk(s, e):
        xc = xb[s:e]
        if xc.dtype != torch.float32:
            xc = xc.float()
        if not weighted:
            kernel(xc, out[s:e])
            return
        w = None
        if wtab is not None:
            w = wtab[torch.arange(s, e, device=xt.device) % wtab.shape[0]]
        kernel(xc, out[s:e], w)

    run_chunks(chunk, nb, step, xt.device, gil_free=native is not None)
    return out.reshape(shape[:-1] + (shape[-1] // be * bb,))


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
    be, bb = block_layout(qtype)
    shape = check_shape(qtype, shape)
    raw = as_uint8_tensor(blocks)
    need = quantized_nbytes(qtype, shape)
    if raw.numel() != need:
        raise MoepackError(f"{qtype}{list(shape)} needs {need} bytes, got {raw.numel()}")
    kernel, cpu_elems = _DEQUANTIZERS[qtype]
    bl = raw.view(-1, bb)
    nb = bl.shape[0]
    if out is None:
        out = empty_float32((nb, be), raw.device)
    else:
        out = _out_buffer(out, nb * be, torch.float32, raw.device, f"{qtype}{list(shape)}").view(nb, be)
    step = chunk_rows(nb, be, raw.device, cpu_elems)
    run_chunks(lambda s, e: kernel(bl[s:e], out[s:e]), nb, step, raw.device)
    out = out.view(shape)
    return out if dtype == torch.float32 else out.to(dtype)


# The largest NVFP4 sub-block scale ggml keeps as computed: ggml_fp32_to_ue4m3 turns every scale that rounds to
# 2^8 or more into its saturation code 448 (0x7E), so 240 = 1.875 * 2^7 is the top of its exact range.
NVFP4_TOP_SCALE = 240.0


def nvfp4_tensor_exponent(x) -> int:
    """Power-of-two prescale k for NVFP4 (ggml's layout has no per-tensor scale, unlike NVIDIA's): quantizing
    x * 2^k puts the tensor's largest 16-element block at the top of the UE4M3 scales ggml codes exactly (240),
    so small blocks keep normal (3-bit mantissa) scales. Weights of std ~0.005 lose ~30% accuracy without it, and
    blocks below ~2^-10 * 6 decode to zero. Whoever applies it must store 2^-k (an exact power of two) with the
    tensor and multiply it back in: nvfp4_prescale does both halves for a container. 0 for an all-zero tensor."""
    xt = as_float_tensor(x, "input")
    amax = float(xt.abs().max()) if xt.numel() else 0.0
    if not np.isfinite(amax):
        raise MoepackError(NONFINITE_INPUT)
    if amax == 0.0:
        return 0
    # largest k with amax * 2^k / 6 <= NVFP4_TOP_SCALE
    k = int(np.floor(np.log2(NVFP4_TOP_SCALE * 6.0 / amax)))
    while amax * 2.0 ** k / 6.0 > NVFP4_TOP_SCALE:
        k -= 1
    return k


def nvfp4_prescale(x) -> tuple[torch.Tensor, int]:
    """(x * 2^-e as float32 on x's device, e): the values to quantize to NVFP4 and the exponent of the tensor
    scale 2^e stored beside the blocks (SPEC.md section 6.1), so that dequantize(blocks) * 2^e approximates x
    at any magnitude. e = -nvfp4_tensor_exponent(x), kept where 2^e is a normal float32 (-126 <= e <= 127)."""
    xt = as_float_tensor(x, "input").float()
    e = min(max(-nvfp4_tensor_exponent(xt), -126), 127)
    return (xt * 2.0 ** -e if e else xt), e


def native_kernels() -> dict[str, dict]:
    """The compiled CPU kernels built so far in this process: name -> compiled (bool), compiler, flags,
    seconds (compile wall time), or the reason it isn't used."""
    return native_builds()


def dequantize(blocks, qtype: str, shape) -> np.ndarray:
    """ggml blocks (numpy/torch uint8 or bytes-like) -> numpy float32 array of `shape`."""
    out = dequantize_torch(blocks, qtype, shape)
    return out.cpu().numpy() if out.device.type != "cpu" else out.numpy()
