"""Shared plumbing of the ggml block codecs: input checks, and the chunked driver.

Every codec works on a 2-D view ``(n_blocks, block_elems)`` of float32 values (or ``(n_blocks, block_bytes)``
of uint8) and is written as a handful of whole-chunk torch operations. The driver feeds it chunks sized to
stay in the CPU's L2 cache, or on a GPU large chunks that bound the temporary memory. Nothing here loops over
blocks in Python.

Threads (CPU): each chunk's ops run on torch's intra-op thread pool, with a guard that falls back to one
thread while that is faster (another process holding a core stalls every OpenMP barrier); see run_chunks.

Compiled kernels (CPU): a codec may also ship a small C kernel (one pass per block, where torch needs one pass per
op): a C file of moepack.native, built by its loader with the system C compiler once per machine (kept in a cache)
and called through ctypes, which releases the GIL, so run_chunks spreads its chunks over Python threads. Without a
compiler (or with MOEPACK_NATIVE=0) the codec's torch kernel runs instead and gives the same bytes.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import torch

from moepack import native

from .errors import MoepackError

# Elements per chunk handed to a codec on the CPU: 2^17 float32 = 512 KiB, so a codec's few same-sized
# temporaries stay in L2. The search-based codecs (Q2_K, IQ2_XXS) make bigger temporaries per element and
# pick their own (smaller) chunk.
CPU_CHUNK_ELEMS = 1 << 17
GPU_CHUNK_FACTOR = 64

_FLOAT_TORCH = (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                torch.float8_e4m3fn, torch.float8_e5m2)


def as_float_tensor(x, what: str = "input") -> torch.Tensor:
    """A torch view (no copy where possible) of a float numpy array or torch tensor, any float dtype."""
    if isinstance(x, torch.Tensor):
        if x.dtype not in _FLOAT_TORCH:
            raise MoepackError(f"{what} must be a float tensor, got {x.dtype}")
        return x.detach()
    if isinstance(x, np.ndarray):
        if x.dtype.kind != "f":
            raise MoepackError(f"{what} must be a float array, got {x.dtype}")
        if x.dtype.itemsize > 8 or not x.dtype.isnative:
            x = x.astype(np.float32 if x.dtype.itemsize > 8 else x.dtype.newbyteorder("="))
        return _from_numpy(np.ascontiguousarray(x))
    raise MoepackError(f"{what} must be a numpy array or a torch tensor, got {type(x).__name__}")


def as_uint8_tensor(blocks, what: str = "blocks") -> torch.Tensor:
    """A flat uint8 torch view of quantized bytes: numpy array, torch tensor, bytes-like."""
    if isinstance(blocks, torch.Tensor):
        if blocks.dtype not in (torch.uint8, torch.int8):
            raise MoepackError(f"{what} must hold uint8 bytes, got {blocks.dtype}")
        return blocks.detach().contiguous().view(torch.uint8).reshape(-1)
    if isinstance(blocks, np.ndarray):
        if blocks.dtype not in (np.uint8, np.int8):
            raise MoepackError(f"{what} must hold uint8 bytes, got {blocks.dtype}")
        return _from_numpy(np.ascontiguousarray(blocks).view(np.uint8).reshape(-1))
    try:
        mv = memoryview(blocks).cast("B")
    except TypeError:
        raise MoepackError(f"{what} must be a uint8 array, tensor or bytes-like, got {type(blocks).__name__}") from None
    if not mv.nbytes:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # read-only buffers (bytes, mmap) are only ever read here
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mv, dtype=torch.uint8)


def _from_numpy(a: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only array (np.memmap, frombuffer) is only ever read here
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def chunk_rows(n_rows: int, row_elems: int, device: torch.device, cpu_elems: int = CPU_CHUNK_ELEMS) -> int:
    """Rows per chunk: cpu_elems elements on the CPU (a codec's choice, sized for L2), 64x that on a GPU."""
    target = cpu_elems if device.type == "cpu" else cpu_elems * GPU_CHUNK_FACTOR
    return max(1, min(n_rows, target // row_elems))


def empty_uint8(shape, device: torch.device) -> torch.Tensor:
    # On the CPU allocate through numpy: it asks the kernel for transparent huge pages on big arrays, which
    # saves most of the page faults of first touching a freshly allocated output (~15% of Q8_0's time).
    if device.type == "cpu":
        return torch.from_numpy(np.empty(shape, dtype=np.uint8))
    return torch.empty(shape, dtype=torch.uint8, device=device)


def empty_float32(shape, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.from_numpy(np.empty(shape, dtype=np.float32))
    return torch.empty(shape, dtype=torch.float32, device=device)


NONFINITE_INPUT = "can't quantize a tensor holding inf or NaN"


def check_finite(amax: torch.Tensor) -> None:
    """amax: per-block max |x| (NaN and inf propagate into it and into its max), so this costs a reduction
    over 1/block of the elements."""
    if amax.numel() and not math.isfinite(float(amax.max())):
        raise MoepackError(NONFINITE_INPUT)


F16_MAX = 65504.0


def f16_scales(d: torch.Tensor, beyond: torch.Tensor) -> torch.Tensor:
    """Super-block scales d (float32, (nsb, candidates)) as their f16 holds them, back in float32: at most the f16
    maximum (the quantizer then re-picks its codes against it: every value the type reaches is held, to its
    quantization error), but an infinity for every scale of a block marked `beyond` ((nsb, 1): values past what
    the largest f16 scale decodes). Such a block keeps a non-finite scale, as ggml's f16 conversion and Q8_0 give,
    which convert refuses by name (decode.first_non_finite reads it), never a clamped value."""
    return torch.where(beyond, torch.full_like(d, float("inf")), d.clamp(max=F16_MAX)).half().float()


def f16_bits_to_f32(lo_hi: torch.Tensor) -> torch.Tensor:
    """(..., 2) uint8 little-endian IEEE half -> float32 (...)."""
    return lo_hi.contiguous().view(torch.float16).squeeze(-1).float()


def f32_to_f16_rne(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float16, round to nearest even (what ggml's GGML_FP32_TO_FP16 and numpy do)."""
    return x.to(torch.float16)


def scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    """A 0-dim float32 tensor on like's device. Dividing by a tensor (not a Python number) keeps CUDA from
    turning a/b into a*(1/b), so the quotient is the correctly rounded one ggml computes."""
    return torch.tensor(value, dtype=torch.float32, device=like.device)


# ------------------------------------------------------------------------------------------- threading

_threads_lock = threading.Lock()
_single_depth = 0
_saved_threads = 1


@contextmanager
def _single_threaded():
    """torch intra-op threads = 1 for the block (re-entrant across threads; the caller's count is restored
    when the last user leaves)."""
    global _single_depth, _saved_threads
    with _threads_lock:
        if _single_depth == 0:
            _saved_threads = torch.get_num_threads()
            if _saved_threads > 1:
                torch.set_num_threads(1)
        _single_depth += 1
    try:
        yield
    finally:
        with _threads_lock:
            _single_depth -= 1
            if _single_depth == 0 and _saved_threads > 1:
                torch.set_num_threads(_saved_threads)


# After multi-threaded chunks stalled, stay single-threaded this long (seconds, all calls), doubling while it
# keeps happening.
_single_until = 0.0
_backoff = 0.25


def run_chunks(fn, n_rows: int, step: int, device: torch.device, gil_free: bool = False) -> None:
    """Call fn(start, stop) for consecutive row ranges of `step` rows covering 0..n_rows.

    `gil_free` (a compiled kernel called through ctypes): the chunks go to a pool of torch.get_num_threads()
    Python threads, each taking the next chunk when it is done, so a core held by another process only means
    that its thread takes fewer chunks.

    On the CPU a chunk's ops run on torch's intra-op thread pool unless that doesn't pay: the first two chunks
    of a call run single-threaded (warm-up, then the reference time per row); every later multi-threaded
    chunk is timed, and two in a row slower than 1.5x the reference plus 2 ms (a stalled barrier costs a
    scheduler time slice) switch all calls to one thread for a back-off period (0.25 s, doubling up to 4 s
    while it recurs). A codec issues 10-40 ops per chunk, each an OpenMP
    parallel region whose barrier stalls for a scheduler time slice whenever another process holds one of the
    cores: measured on this 2-core machine with one busy neighbour, Q8_0 fell from ~850 to ~5-40 Mel/s with
    torch's threads, but only to ~200 single-threaded. (Python threads don't help: torch 2.13 holds the GIL
    inside its ops, so two Python threads running ops take as long as one.)
    """
    global _single_until, _backoff
    starts = range(0, n_rows, step)
    if gil_free and len(starts) > 1 and torch.get_num_threads() > 1:
        # list() re-raises the first chunk's exception here
        list(_chunk_pool().map(lambda s: fn(s, min(s + step, n_rows)), starts))
        return
    if device.type != "cpu" or len(starts) < 4 or torch.get_num_threads() <= 1:
        for s in starts:
            fn(s, min(s + step, n_rows))
        return
    ref = None
    stalls = 0
    for k, s in enumerate(starts):
        e = min(s + step, n_rows)
        single = k < 2 or time.monotonic() < _single_until
        t0 = time.perf_counter()
        if single:
            with _single_threaded():
                fn(s, e)
        else:
            fn(s, e)
        dt = time.perf_counter() - t0
        if k == 0:
            continue  # warm-up (allocations, tables)
        if single:
            ref = dt / (e - s) if ref is None else min(ref, dt / (e - s))
            continue
        # a stalled barrier costs a scheduler time slice (milliseconds): far slower than one thread, not just
        # a bit (chunk-to-chunk noise, page faults of a fresh output)
        if dt > 1.5 * ref * (e - s) + 0.002:
            stalls += 1
            if stalls >= 2:
                _single_until = time.monotonic() + _backoff
                _backoff = min(_backoff * 2.0, 4.0)
                stalls = 0
        else:
            stalls = 0
            _backoff = max(_backoff * 0.5, 0.25)


_pool: tuple[tuple[int, int], ThreadPoolExecutor] | None = None  # ((process id, workers), pool)
_pool_lock = threading.Lock()


def _chunk_pool() -> ThreadPoolExecutor:
    """The worker threads of run_chunks(gil_free=True): torch.get_num_threads() of them, re-made when that
    changes (e.g. after `convert --workers`) and in a forked child (which has none of its parent's threads)."""
    global _pool
    key = (os.getpid(), torch.get_num_threads())
    with _pool_lock:
        if _pool is None or _pool[0] != key:
            if _pool is not None and _pool[0][0] == key[0]:
                _pool[1].shutdown(wait=False)
            _pool = (key, ThreadPoolExecutor(key[1], thread_name_prefix="moepack-quant"))
        return _pool[1]


# ------------------------------------------------------------------------------------------- the driver
# What quants.quantize_torch / dequantize_torch run for a codec class of codecs.py (its block layout, chunk kernels
# and chunk sizes); the class is passed in, as this module sits below codecs.py.

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


def quantize_blocks(codec, x, importance=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x quantized by `codec` on x's device: uint8 tensor [..., n/block_elems*block_bytes] (into `out` if given)."""
    be, bb, qtype = codec.block_elems, codec.block_bytes, codec.name
    xt = as_float_tensor(x, "input")
    shape = codec.check_shape(xt.shape)
    kernel, cpu_elems, weighted = codec.quantize_chunk, codec.quantize_elems, codec.weighted
    native = None
    if xt.device.type == "cpu" and codec.native_quantizer is not None:
        native = codec.native_quantizer()
        if native is not None:
            kernel, cpu_elems = native, codec.native_elems
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


def dequantize_blocks(codec, blocks, shape, dtype: torch.dtype = torch.float32,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """`codec`'s blocks -> values of logical `shape` on the bytes' device (into `out` if given)."""
    be, bb, qtype = codec.block_elems, codec.block_bytes, codec.name
    shape = codec.check_shape(shape)
    raw = as_uint8_tensor(blocks)
    need = codec.quantized_nbytes(shape)
    if raw.numel() != need:
        raise MoepackError(f"{qtype}{list(shape)} needs {need} bytes, got {raw.numel()}")
    kernel, cpu_elems = codec.dequantize_chunk, codec.dequantize_elems
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


# ------------------------------------------------------------------------------------------- compiled kernels

# The C sources and their loader live in moepack.native (native/*.c, native/loader.py).


def compiled_quantizer(name: str, source: str, symbol: str, reference, probe: torch.Tensor, block_bytes: int):
    """A codec's compiled quantizer: the C function `int symbol(const float *x, uint8_t *out, int64_t n_blocks)`
    of `source` (returning non-zero when x holds inf or NaN), wrapped as a chunk kernel like the codec's torch one,
    `reference(x, out)`, and used only if it writes reference's bytes for the `probe` blocks (float32
    (n, block_elems)). None when it can't be built, or (with a warning) when it disagrees."""
    lib = native.native_library(name, source)
    if lib is None:
        return None
    fn = native.c_function(lib, symbol, (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64))

    def kernel(x: torch.Tensor, out: torch.Tensor) -> None:
        x = x.contiguous()  # a view of a strided input (the torch kernels take any strides)
        if fn(x.data_ptr(), out.data_ptr(), x.shape[0]):
            raise MoepackError(NONFINITE_INPUT)

    want = torch.empty(probe.shape[0], block_bytes, dtype=torch.uint8)
    got = torch.empty_like(want)
    reference(probe, want)
    kernel(probe, got)
    if not torch.equal(got, want):
        reason = "its bytes differ from the torch kernel's on the self-check blocks"
        native.disable(name, reason)
        warnings.warn(f"moepack: not using the compiled {name} kernel: {reason}", RuntimeWarning, stacklevel=2)
        return None
    return kernel


_ON_DEVICE: dict = {}


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A constant table on `device`, copied there once (CPU tables are used as they are)."""
    if device.type == "cpu":
        return t
    key = (id(t), str(device))
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = t.to(device)
    return _ON_DEVICE[key]
