"""Shared plumbing of the ggml block codecs: type table, input checks, and the chunked driver.

Every codec works on a 2-D view ``(n_blocks, block_elems)`` of float32 values (or ``(n_blocks, block_bytes)``
of uint8) and is written as a handful of whole-chunk torch operations. The driver feeds it chunks sized to
stay in the CPU's L2 cache, or on a GPU large chunks that bound the temporary memory. Nothing here loops over
blocks in Python.

Threads (CPU): each chunk's ops run on torch's intra-op thread pool, with a guard that falls back to one
thread while that is faster (another process holding a core stalls every OpenMP barrier); see run_chunks.

Compiled kernels (CPU): a codec may also ship a small C kernel (one pass per block, where torch needs one pass per
op), built once per process by native_library with the system C compiler and called through ctypes, which
releases the GIL, so run_chunks spreads its chunks over Python threads. Without a compiler (or with
MOEPACK_NATIVE=0) the codec's torch kernel runs instead and gives the same bytes.
"""

from __future__ import annotations

import ctypes
import math
import os
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
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


NONFINITE_INPUT = "can't quantize a tensor holding inf or NaN"


def check_finite(amax: torch.Tensor) -> None:
    """amax: per-block max |x| (NaN and inf propagate into it and into its max), so this costs a reduction
    over 1/block of the elements."""
    if amax.numel() and not math.isfinite(float(amax.max())):
        raise MoepackError(NONFINITE_INPUT)


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


# ------------------------------------------------------------------------------------------- compiled kernels

# What the compiled quantizers share: 32-element blocks, handled GROUP at a time, and each block's largest |x| as
# float bits (sign cleared), compared as integers, which orders finite floats like their magnitudes
C_BLOCK_PRELUDE = r"""
#include <stdint.h>
#include <string.h>

#define QK 32
#define GROUP 16

static inline void block_amax_bits(const float *restrict x, uint32_t *restrict amax_bits, int64_t n) {
    for (int64_t b = 0; b < n; b++) {
        uint32_t m = 0;
        for (int j = 0; j < QK; j++) {
            uint32_t bits;
            memcpy(&bits, x + b * QK + j, 4);
            bits &= 0x7fffffffu;
            m = bits > m ? bits : m;
        }
        amax_bits[b] = m;
    }
}
"""

NATIVE_ENV = "MOEPACK_NATIVE"  # "0": never compile; every codec uses its torch kernel
# -ffp-contract=off: no fused multiply-adds, so every float operation rounds exactly as the C source says (the
# byte-exactness with ggml depends on it); no -ffast-math for the same reason. -march=native is tried first (the
# library lives only as long as this process, on this machine).
_CFLAGS = ("-O3", "-ffp-contract=off", "-fPIC", "-shared")
_ARCH_FLAGS = (("-march=native",), ())

# name -> {"library": ctypes.CDLL | None, "compiler", "seconds" (compile wall time), "reason" (when None)}
_native: dict[str, dict] = {}
_native_lock = threading.Lock()


def _c_compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _build(name: str, source: str) -> dict:
    if os.environ.get(NATIVE_ENV, "1") == "0":
        return {"library": None, "reason": f"disabled by {NATIVE_ENV}=0"}
    cc = _c_compiler()
    if cc is None:
        return {"library": None, "reason": "no C compiler found ($CC, cc, gcc, clang)"}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="moepack-native-") as tmp:
        src, lib = os.path.join(tmp, f"{name}.c"), os.path.join(tmp, f"{name}.so")
        with open(src, "w") as f:
            f.write(source)
        error = ""
        for arch in _ARCH_FLAGS:
            try:
                done = subprocess.run([cc, *_CFLAGS, *arch, "-o", lib, src], capture_output=True, text=True,
                                      timeout=120)
            except (OSError, subprocess.SubprocessError) as e:
                error = str(e)
                continue
            if done.returncode != 0:
                lines = done.stderr.strip().splitlines() or ["failed"]
                error = next((line for line in lines if "error" in line), lines[-1])
                continue
            try:  # loaded before the directory goes: the mapping outlives the file
                library = ctypes.CDLL(lib)
            except OSError as e:  # e.g. a temporary directory mounted noexec
                return {"library": None, "compiler": cc, "reason": f"can't load the compiled library: {e}"}
            return {"library": library, "compiler": cc, "flags": [*_CFLAGS, *arch],
                    "seconds": round(time.perf_counter() - start, 3)}
    return {"library": None, "compiler": cc, "reason": f"{cc} failed: {error}"}


def native_library(name: str, source: str) -> ctypes.CDLL | None:
    """The C `source` compiled by the system C compiler into a shared library and loaded, once per process
    (~0.1 s); None when there is no compiler, it fails, or MOEPACK_NATIVE=0 (the caller then uses torch)."""
    with _native_lock:
        if name not in _native:
            _native[name] = _build(name, source)
        return _native[name]["library"]


def c_function(lib: ctypes.CDLL, symbol: str, argtypes: tuple, restype=ctypes.c_int):
    """`lib`'s C function `symbol` with its signature declared (undeclared, ctypes would pass every argument as
    an int and read an int back)."""
    fn = getattr(lib, symbol)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def _disable_native(name: str, reason: str) -> None:
    """Stop using a compiled kernel (its self-check against the torch kernel failed)."""
    with _native_lock:
        _native[name] = {**_native.get(name, {}), "library": None, "reason": reason}


def compiled_quantizer(name: str, source: str, symbol: str, reference, probe: torch.Tensor, block_bytes: int):
    """A codec's compiled quantizer: the C function `int symbol(const float *x, uint8_t *out, int64_t n_blocks)`
    of `source` (returning non-zero when x holds inf or NaN), wrapped as a chunk kernel like the codec's torch one,
    `reference(x, out)`, and used only if it writes reference's bytes for the `probe` blocks (float32
    (n, block_elems)). None when it can't be built, or (with a warning) when it disagrees."""
    lib = native_library(name, source)
    if lib is None:
        return None
    fn = c_function(lib, symbol, (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64))

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
        _disable_native(name, reason)
        warnings.warn(f"moepack: not using the compiled {name} kernel: {reason}", RuntimeWarning, stacklevel=2)
        return None
    return kernel


class LazyKernel:
    """Calling it gives the kernel `build()` returns (or None), built on the first call only (thread-safe)."""

    def __init__(self, build):
        self._build = build
        self._lock = threading.Lock()
        self._kernel: list = []  # [] until built, then [kernel or None]

    def __call__(self):
        with self._lock:
            if not self._kernel:
                self._kernel.append(self._build())
            return self._kernel[0]


def native_builds() -> dict[str, dict]:
    """name -> how its compiled kernel was built: compiled (bool), compiler, flags, seconds, or the reason not."""
    with _native_lock:
        return {n: {"compiled": b["library"] is not None, **{k: v for k, v in b.items() if k != "library"}}
                for n, b in _native.items()}


_ON_DEVICE: dict = {}


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A constant table on `device`, copied there once (CPU tables are used as they are)."""
    if device.type == "cpu":
        return t
    key = (id(t), str(device))
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = t.to(device)
    return _ON_DEVICE[key]
