"""The one loader of moepack's compiled CPU kernels: C files in this folder (and a model family's own, in its package:
read_source takes their path), built once per machine into a cache.

Each library is one .c file plus the headers of this folder it includes with ``#include "..."``. The first process that
asks for it compiles it with the system C compiler into the cache directory (``$MOEPACK_CACHE_DIR/native``, default
``$XDG_CACHE_HOME/moepack/native``, i.e. ``~/.cache/moepack/native``), under a name holding a hash of everything the
build depends on: the source and every header it includes, the compiler (path and ``--version``), the flags, and the CPU
(``-march=native`` targets it). Later processes find the file and load it without compiling. A library is written to a
unique temporary file in that directory and renamed into place (``os.replace``), so processes building at once never see
a partial one and leave one file. Where the cache can't be written (a read-only home), a process builds into a temporary
directory of its own, as before the cache; nothing fails because of the cache.

``MOEPACK_NATIVE=0`` never compiles nor loads anything; neither does a machine without a C compiler: callers then run
their torch kernels, which give the same results (each caller checks its library against them when it loads).

Standard library only: this package sits below format_spec and runtime, which import it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
import time

NATIVE_ENV = "MOEPACK_NATIVE"  # "0": never compile; every caller uses its torch kernel
CACHE_ENV = "MOEPACK_CACHE_DIR"  # the cache root, shared with `moepack bench` (runtime/tuning.py)
SOURCE_DIR = os.path.dirname(os.path.abspath(__file__))

# -ffp-contract=off: no fused multiply-adds, so every float operation rounds exactly as the C source says (the
# byte-exactness with ggml depends on it); no -ffast-math for the same reason. -march=native is tried first (the key
# holds the CPU's identity, so a library built for another CPU is never loaded), then without it.
CFLAGS = ("-O3", "-ffp-contract=off", "-fPIC", "-shared", "-Wall", "-Werror")
ARCH_FLAGS = (("-march=native",), ())
_KEY_FORMAT = "moepack-native-1"  # bump when the key's ingredients or the file layout change
_TMP_SUFFIX = ".tmp"

# name -> {"library": ctypes.CDLL | None, "source": digest of the source asked for, and what native_builds reports}
_native: dict[str, dict] = {}
_native_lock = threading.Lock()
_identity_lock = threading.Lock()
_compilers: dict[str, tuple[str, str]] = {}
_cpu: list[str] = []


def read_source(filename: str) -> str:
    """The text of a C file: one of this folder's by its name (e.g. "q8_0_quantize.c"), or a caller's own by its
    path (a model family keeps its operations' kernels in its package and builds them through this cache; they may
    include this folder's headers)."""
    path = filename if os.path.dirname(filename) else os.path.join(SOURCE_DIR, filename)
    with open(path, encoding="utf-8") as f:
        return f.read()


def sources() -> list[str]:
    """This folder's C files, one per library."""
    return sorted(n for n in os.listdir(SOURCE_DIR) if n.endswith(".c"))


def c_compiler() -> str | None:
    """The C compiler to build with: $CC, else the first of cc, gcc, clang on the PATH; None without one."""
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def cache_dir() -> str:
    """Where compiled libraries are kept (whether or not it exists or can be written)."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "moepack")
    return os.path.join(root, "native")


# ------------------------------------------------------------------------------------------------ the key

_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)


def _headers(source: str, include_dir: str) -> list[tuple[str, bytes | None]]:
    """(name, contents or None when missing) of every header the source includes with quotes, transitively."""
    found: dict[str, bytes | None] = {}
    pending = [source.encode()]
    while pending:
        for name in _INCLUDE.findall(pending.pop()):
            name = name.decode(errors="replace")
            if name in found:
                continue
            try:
                with open(os.path.join(include_dir, name), "rb") as f:
                    found[name] = f.read()
            except OSError:
                found[name] = None
                continue
            pending.append(found[name])
    return sorted(found.items())


def _compiler_identity(cc: str) -> tuple[str, str]:
    """(resolved path, `--version` output) of the compiler, asked once per process."""
    path = shutil.which(cc) or cc
    path = os.path.realpath(path)
    with _identity_lock:
        if path not in _compilers:
            try:
                done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
                version = done.stdout + done.stderr
            except (OSError, subprocess.SubprocessError) as e:
                version = f"unknown: {e}"
            _compilers[path] = (path, version)
        return _compilers[path]


_CPU_FIELDS = {"vendor_id", "cpu family", "model", "model name", "stepping", "flags",  # x86
               "Features", "CPU implementer", "CPU architecture", "CPU variant", "CPU part",  # Arm
               "cpu", "isa", "uarch"}  # POWER, RISC-V


def cpu_identity() -> str:
    """What -march=native targets: the machine, and the first CPU's model and feature flags from /proc/cpuinfo."""
    with _identity_lock:
        if not _cpu:
            lines = [platform.machine()]
            try:
                with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                    for line in f:
                        if not line.strip():
                            if len(lines) > 1:
                                break  # the first processor's block is enough
                            continue
                        key, _, value = line.partition(":")
                        if key.strip() in _CPU_FIELDS:
                            lines.append(f"{key.strip()}: {value.strip()}")
            except OSError:  # not Linux
                lines.append(platform.processor())
            _cpu.append("\n".join(lines))
        return _cpu[0]


def build_key(source: str, cc: str, flags, include_dir: str = SOURCE_DIR) -> str:
    """The hash naming a library built from `source` (and the headers it includes from include_dir) by `cc` with
    `flags` on this CPU: any change to one of them gives another name."""
    h = hashlib.sha256()

    def part(data: bytes) -> None:
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)

    part(_KEY_FORMAT.encode())
    part(source.encode())
    for name, data in _headers(source, include_dir):
        part(name.encode())
        part(b"\0missing" if data is None else data)
    for text in (*_compiler_identity(cc), "\0".join(flags), cpu_identity()):
        part(text.encode())
    return h.hexdigest()[:24]


# ------------------------------------------------------------------------------------------------ building


def _writable(directory: str) -> str | None:
    """Why libraries can't be written into `directory` (None: they can). Sweeps out the temporary files of builds
    killed over an hour ago."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".probe-", suffix=_TMP_SUFFIX)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"{directory}: {e.strerror or e}"
    now = time.time()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        entries = []
    for entry in entries:
        if entry.name.startswith(".") and entry.name.endswith(_TMP_SUFFIX):
            try:
                if now - entry.stat().st_mtime > 3600:
                    os.unlink(entry.path)
            except OSError:  # another process's sweep took it
                pass
    return None


def _compile(cc: str, flags, src: str, include_dir: str, final: str) -> str:
    """Compile src into `final` through a unique temporary file beside it, renamed into place. '' or the error."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(final), prefix=f".{os.path.basename(final)}.", suffix=_TMP_SUFFIX)
    os.close(fd)
    try:
        try:
            done = subprocess.run([cc, *flags, "-I", include_dir, "-o", tmp, src], capture_output=True, text=True,
                                  timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            return str(e) or type(e).__name__
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or ["failed"]
            return next((line for line in lines if "error" in line), lines[-1])
        os.chmod(tmp, 0o755)
        os.replace(tmp, final)  # atomic: another process sees no file or a whole one
        return ""
    finally:
        try:
            os.unlink(tmp)
        except OSError:  # renamed into place
            pass


def build(name: str, source: str, include_dir: str = SOURCE_DIR) -> dict:
    """Load `source`'s library from the cache, else compile it there, and load it: {"library": ctypes.CDLL or None,
    "compiler", "flags", "cached" (loaded without compiling), "path", "seconds" (wall time of this call), or
    "reason" (why there is no library)}. Does not consult or change native_builds()."""
    if os.environ.get(NATIVE_ENV, "1") == "0":
        return {"library": None, "reason": f"disabled by {NATIVE_ENV}=0"}
    cc = c_compiler()
    if cc is None:
        return {"library": None, "reason": "no C compiler found ($CC, cc, gcc, clang)"}
    start = time.perf_counter()
    variants = [((*CFLAGS, *arch), build_key(source, cc, (*CFLAGS, *arch), include_dir)) for arch in ARCH_FLAGS]
    cache = cache_dir()
    for flags, key in variants:  # built before (only the fallback there: -march=native failed then)
        path = os.path.join(cache, f"{name}-{key}.so")
        if os.path.exists(path):
            try:
                library = ctypes.CDLL(path)
            except OSError:  # damaged, or the cache is on a noexec mount: built again below
                break
            return {"library": library, "compiler": cc, "flags": list(flags), "cached": True, "path": path,
                    "seconds": round(time.perf_counter() - start, 3)}
    cache_error = _writable(cache)
    error = ""
    with tempfile.TemporaryDirectory(prefix="moepack-native-") as tmp:
        src = os.path.join(tmp, f"{name}.c")
        with open(src, "w", encoding="utf-8") as f:
            f.write(source)
        for flags, key in variants:
            # into the cache; where it can't be written or loaded from, into this process's temporary directory
            # (the loaded library's mapping outlives the file)
            fault = ""  # the cache's, where these flags fail there and build here
            for directory in ([] if cache_error else [cache]) + [tmp]:
                path = os.path.join(directory, f"{name}-{key}.so")
                try:
                    error = _compile(cc, flags, src, include_dir, path)
                except OSError as e:  # the cache went away or turned read-only
                    cache_error = f"{cache}: {e.strerror or e}"
                    continue
                if error:  # a full disk in the cache, or the source or flags (then the same here: the next flags)
                    if directory == cache:
                        fault = f"building in {cache} failed: {error}"
                    continue
                cache_error = cache_error or fault
                try:
                    library = ctypes.CDLL(path)
                except OSError as e:  # e.g. mounted noexec
                    error = f"can't load the compiled library: {e}"
                    if directory == cache:
                        cache_error = f"can't load {path}: {e}"
                    continue
                built = {"library": library, "compiler": cc, "flags": list(flags), "cached": False,
                         "path": path if directory == cache else None,
                         "seconds": round(time.perf_counter() - start, 3)}
                if cache_error:
                    built["cache_error"] = cache_error
                return built
    if error.startswith("can't load"):
        return {"library": None, "compiler": cc, "reason": error}
    return {"library": None, "compiler": cc, "reason": f"{cc} failed: {error}"}


# ------------------------------------------------------------------------------------------------ per process


def native_library(name: str, source: str, include_dir: str = SOURCE_DIR) -> ctypes.CDLL | None:
    """The library `name` built from `source` (the text of one of this folder's C files, read_source), loaded once
    per process: from the cache when it was built before on this machine, else compiled into it (~0.1-1 s). None
    without a compiler, when it fails, with MOEPACK_NATIVE=0, or after disable(name) (the caller then uses torch)."""
    if os.environ.get(NATIVE_ENV, "1") == "0":
        with _native_lock:
            _native.setdefault(name, {"library": None, "reason": f"disabled by {NATIVE_ENV}=0"})
        return None
    digest = hashlib.sha256(f"{include_dir}\0{source}".encode()).hexdigest()
    with _native_lock:
        entry = _native.get(name)
        if entry is None or entry.get("source") != digest:  # another source text under the name: its own library
            entry = _native[name] = {**build(name, source, include_dir), "source": digest}
        return entry["library"]


def disable(name: str, reason: str) -> None:
    """Stop using a library (e.g. its self-check against the torch kernel failed); native_builds() says why."""
    with _native_lock:
        _native[name] = {**_native.get(name, {}), "library": None, "reason": reason}


def native_builds() -> dict[str, dict]:
    """name -> how its library came to this process: compiled (usable), cached (loaded from the cache, not
    compiled), path (in the cache; None when built in a temporary directory), compiler, flags, seconds (wall time
    of compiling or loading), or the reason it isn't used."""
    with _native_lock:
        return {n: {"compiled": b["library"] is not None,
                    **{k: v for k, v in b.items() if k not in ("library", "source")}}
                for n, b in _native.items()}


def c_function(lib: ctypes.CDLL, symbol: str, argtypes: tuple, restype=ctypes.c_int):
    """`lib`'s C function `symbol` with its signature declared (undeclared, ctypes would pass every argument as
    an int and read an int back)."""
    fn = getattr(lib, symbol)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


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
