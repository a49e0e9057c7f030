"""Shared plumbing of the ggml block codecs: type table, input checks, and the chunked driver.

Every codec works on a 2-D view ``(n_blocks, block_elems)`` of float32 values (or ``(n_blocks, block_bytes)``
of uint8) and is written as a handful of whole-chunk torch operations. The driver feeds it chunks sized to
stay in the CPU's L2 cache, or on a GPU large chunks that bound the temporary memory. Nothing here loops over
blocks in Python.

Threads (CPU): each chunk's ops run on torch's intra-op thread pool, with a guard that falls back to one
thread while that is faster (another process holding a core stalls every OpenMP barrier); see run_chunks.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from contextlib import contextmanager

import numpy as np
import torch

from .dtypes import STORAGE_TYPES
from .errors import MoepackError

QTYPES = ("Q8_0", "MXFP4", "NVFP4", "Q2_K", "IQ2_XXS")

# Elements per chunk handed to a codec on the CPU: 2^17 float32 = 512 KiB, so a codec's few same-sized
# temporaries stay in L2. The search-based codecs (Q2_K, IQ2_XXS) make bigger temporaries per element and
# pick their own (smaller) chunk.
CPU_CHUNK_ELEMS = 1 << 17
GPU_CHUNK_FACTOR = 64

_FLOAT_TORCH = (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                torch.float8_e4m3fn, torch.float8_e5m2)


def block_layout(qtype: str) -> tuple[int, int]:
    """(elements per block, bytes per block) of a quantization type; MoepackError for an unknown name."""
    if qtype not in QTYPES:
        raise MoepackError(f"unknown quantization type {qtype!r} (expected one of {', '.join(QTYPES)})")
    t = STORAGE_TYPES[qtype]
    return t.block_elems, t.block_bytes


def quantized_nbytes(qtype: str, shape) -> int:
    be, bb = block_layout(qtype)
    shape = check_shape(qtype, shape)
    n = 1
    for d in shape:
        n *= d
    return n // be * bb


def check_shape(qtype: str, shape) -> tuple[int, ...]:
    be, _ = block_layout(qtype)
    try:
        shape = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise MoepackError(f"bad shape {shape!r} (expected a sequence of integers)") from None
    if not shape or any(d < 0 for d in shape):
        raise MoepackError(f"bad shape {list(shape)} for {qtype} (need at least one non-negative dimension)")
    if shape[-1] % be:
        raise MoepackError(
            f"can't store shape {list(shape)} as {qtype}: last dimension {shape[-1]} is not a multiple of "
            f"its block of {be}")
    return shape


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


def check_finite(amax: torch.Tensor) -> None:
    """amax: per-block max |x| (NaN and inf propagate into it and into its max), so this costs a reduction
    over 1/block of the elements."""
    if amax.numel() and not math.isfinite(float(amax.max())):
        raise MoepackError("can't quantize a tensor holding inf or NaN")


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


def run_chunks(fn, n_rows: int, step: int, device: torch.device) -> None:
    """Call fn(start, stop) for consecutive row ranges of `step` rows covering 0..n_rows.

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


_ON_DEVICE: dict = {}


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A constant table on `device`, copied there once (CPU tables are used as they are)."""
    if device.type == "cpu":
        return t
    key = (id(t), str(device))
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = t.to(device)
    return _ON_DEVICE[key]
