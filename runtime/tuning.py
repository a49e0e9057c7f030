"""The benchmark-tuning cache as the runtime reads it: what `moepack bench` (tools/bench.py) measured on this
machine, kept in `$MOEPACK_CACHE_DIR/bench.json` (default `$XDG_CACHE_HOME/moepack/bench.json`, i.e.
`~/.cache/moepack/bench.json`), keyed by the host name and, for io, by the container's real path, size and mtime.

* `tuned_defaults(path)`: the best (bundle_experts, queue_depth) measured for that container, for `prefill`;
* `tuned_fused_max_tokens(hidden, inter)`: the fused FP4 kernel's crossover on this CPU, for the expert runner;
* `default_compute_dtype(device)`: `--compute-dtype auto`'s choice (measured, else the CPU's bf16 features).

Every lookup here never raises: a prefill must not fail over the cache. The measuring code lives in tools/ and
writes through `store`; the runtime imports nothing from there.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import warnings
from typing import TYPE_CHECKING

from moepack.format_spec import untrusted
from moepack.format_spec.errors import MoepackError, error_reason

if TYPE_CHECKING:
    import torch

CACHE_ENV = "MOEPACK_CACHE_DIR"
CACHE_FORMAT = "moepack-bench"
MAX_CACHE_BYTES = 16 << 20  # a machine's measurements take kilobytes
CACHE_VERSION = 1


def cache_dir() -> str:
    d = os.environ.get(CACHE_ENV)
    if d:
        return d
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "moepack")


def cache_path() -> str:
    return os.path.join(cache_dir(), "bench.json")


def machine_id() -> str:
    return socket.gethostname() or "unknown-host"


def file_key(path: str) -> str:
    """The io cache key of a container: real path, size and mtime (ns) — a rewritten file is a new key."""
    st = os.stat(path)
    return f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}"


def load_cache() -> dict:
    """The cache's content ({} when absent; a damaged file is ignored with a warning, and replaced on the next
    write)."""
    path = cache_path()
    if not os.path.lexists(path):
        return {}
    try:
        data = untrusted.load_file(path, max_bytes=MAX_CACHE_BYTES)
    except (OSError, MoepackError) as e:
        reason = e.detail if isinstance(e, untrusted.UntrustedInputError) else error_reason(e)
        warnings.warn(f"{path}: unreadable bench cache ignored ({reason})", RuntimeWarning, stacklevel=2)
        return {}
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or data.get("version") != CACHE_VERSION:
        return {}
    return data


def _machine(data: dict, create: bool = False) -> dict:
    machines = data.setdefault("machines", {}) if create else data.get("machines", {})
    if not isinstance(machines, dict):
        return {}
    m = machines.get(machine_id())
    if m is None and create:
        m = machines[machine_id()] = {}
    return m if isinstance(m, dict) else {}


def store(section: str, key: str, value: dict) -> str:
    """Record one result under this machine's `section` / `key`; written atomically. Returns the cache path."""
    path = cache_path()
    data = load_cache()
    data.update(format=CACHE_FORMAT, version=CACHE_VERSION)
    machine = _machine(data, create=True)
    machine.setdefault(section, {})[key] = value
    tmp = None
    try:
        fd, tmp = _temporary_beside(path)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None and os.path.exists(tmp):  # a full disk: no half-written temporary left beside the cache
            os.unlink(tmp)
        raise MoepackError(f"{path}: cannot write the bench cache ({e.strerror or e})") from None
    return path


def _temporary_beside(path: str) -> tuple[int, str]:
    """A new temporary file (fd, its path) in the cache's folder, made where missing: where the cache is written
    before it is renamed into place."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return tempfile.mkstemp(prefix=".bench.", dir=os.path.dirname(path))


def check_cache_writable() -> None:
    """Refuse, before a measurement that may take minutes, a bench cache that could not be written after it (a
    read-only MOEPACK_CACHE_DIR, one not ours): `store`'s message, and the way round it."""
    path = cache_path()
    try:
        fd, probe = _temporary_beside(path)
        os.close(fd)
        os.unlink(probe)  # the cache is renamed into place: the folder's write permission is what counts
    except OSError as e:
        raise MoepackError(f"{path}: cannot write the bench cache ({e.strerror or e}); pass --no-save to measure "
                           f"without keeping the result") from None


def cached(section: str) -> dict:
    """This machine's results of one section ({} when none)."""
    value = _machine(load_cache()).get(section, {})
    return value if isinstance(value, dict) else {}


def tuned_defaults(path: str) -> tuple[int, int] | None:
    """(bundle_experts, queue_depth) that `moepack bench io` found best for this container on this machine, or
    None (never measured, the file changed since, or no readable cache). Never raises: a prefill must not fail
    over the cache."""
    try:
        entry = cached("io").get(file_key(path))
        best = entry["best"] if isinstance(entry, dict) else None
        if not best:
            return None
        bundle, depth = int(best["bundle_experts"]), int(best["queue_depth"])
        return (bundle, depth) if bundle >= 1 and depth >= 1 else None
    except Exception:  # noqa: BLE001 - any cache problem means "not measured"
        return None


def tuned_fused_max_tokens(hidden: int, inter: int) -> int | None:
    """Up to how many tokens per expert the fused FP4 kernel is faster on this CPU, as `moepack bench compute
    --expert-dtype bfloat16` measured it for experts of this hidden size (the same intermediate size first, then
    the latest), or None when no such run was made here on this CPU model. The crossover moves with the hidden
    size, the width of the input rows the kernel keeps in L2 (this Zen 5: 512+ tokens for 1024 x 1024 experts, 96
    for V4-Flash's 4096 x 2048), so a run of another hidden size does not count. Never raises: a prefill must not
    fail over the cache."""
    try:
        cpu = cpu_model()
        runs = [r for r in cached("compute").values()
                if isinstance(r, dict) and isinstance(r.get("fused"), dict) and r.get("device_name") == cpu
                and r.get("device", "").split(":")[0] == "cpu" and r.get("hidden") == hidden]
        if not runs:
            return None
        pick = max(runs, key=lambda r: (r.get("intermediate") == inter, r.get("measured_at", "")))
        value = pick["fused"]["max_tokens"]
        return value if isinstance(value, int) and value >= 0 else None
    except Exception:  # noqa: BLE001 - any cache problem means "not measured"
        return None


# CPU features that give native bf16 dot products: x86's AVX512-BF16 and AMX, aarch64's BF16
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def _cpuinfo_field(keys: tuple[str, ...], cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The value of the first `cpuinfo` line whose key is one of `keys`; None where the file does not say."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in keys:
                    return value
    except OSError:
        pass
    return None


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (x86 "flags", aarch64 "Features"); empty where the file does not say."""
    value = _cpuinfo_field(("flags", "Features"), cpuinfo)
    return set(value.split()) if value is not None else set()


def default_compute_dtype(device: torch.device) -> tuple[str, str]:
    """(dtype, why) for `--compute-dtype auto`: on a CPU, what `moepack bench compute` measured for this CPU model
    (bfloat16 where its GEMM is BF16_WINS_BY faster), else bfloat16 where the CPU has native bf16 dot products
    (NATIVE_BF16_FLAGS), else float32. Other devices: float32 (not measured there yet). Never raises."""
    if device.type != "cpu":
        return "float32", f"{device.type}: float32 until measured there"
    try:
        cpu = cpu_model()
        entry = cached("compute_dtype").get(cpu)
        if isinstance(entry, dict) and entry.get("choice") in ("float32", "bfloat16"):
            ratio = entry["bfloat16_gflops"] / entry["float32_gflops"]
            return entry["choice"], f"moepack bench compute: bfloat16 GEMM {ratio:.2f}x float32 on this CPU"
    except Exception:  # noqa: BLE001 - any cache problem means "not measured"
        pass
    native = sorted(cpu_flags() & set(NATIVE_BF16_FLAGS))
    if native:
        return "bfloat16", f"native bf16 dot products ({', '.join(native)})"
    return "float32", "no native bf16 dot products on this CPU"


def cpu_model() -> str:
    value = _cpuinfo_field(("model name",))
    if value is not None:
        return value.strip()
    import platform

    return platform.processor() or platform.machine()
