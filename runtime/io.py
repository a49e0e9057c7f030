"""Reading a container's regions for the prefill: O_DIRECT into a fixed pool of aligned buffers, Q reads in flight.

The pool is allocated once (page-aligned host memory, pinned when the consumer is a CUDA device) and recycled:
a read takes a free buffer, the consumer hands it back when it has used the bytes, so the pipeline never allocates
per read and never holds more than `depth` requests' worth of weights. Where O_DIRECT is refused (some
filesystems), reads fall back to the page cache with a warning. `mode="mmap"` maps the file instead: the right
choice when the container fits in free RAM (the page cache then serves every later prefill at memory speed).

A multi-part container (one part file per SSD) gets one file descriptor per part; reads name their part, and reads of
different parts in flight at once proceed side by side, so the devices' bandwidths add up.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import math
import mmap
import os
import queue
import resource
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from moepack.format_spec.errors import MoepackError, error_reason
from moepack.format_spec.layout import ALIGNMENT

from .limits import MAX_QUEUE_DEPTH

# "host": the prefill's weights held in host RAM once per process (runtime/resident.py); what a reader still reads
# itself (decode's missed experts) goes through the page cache
IO_MODES = ("auto", "direct", "buffered", "mmap", "host")
HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages)
# madvise: fault a range's pages in (Linux 5.14+; Python's mmap module has no name for it before 3.13)
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
# libc's madvise through ctypes releases the GIL for the call; mmap.madvise holds it while a cold populate waits for
# the disk, which stops the compute thread's Python for that long
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int
if hasattr(_libc, "mallopt"):  # glibc
    _libc.mallopt.argtypes, _libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int


def meminfo_available_bytes(meminfo: str = "/proc/meminfo") -> int:
    """MemAvailable from /proc/meminfo (what can be used without swapping); 0 where unknown."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


_NO_LIMIT = 1 << 62  # cgroup v1 writes "unlimited" as a page-rounded 2**63 - 1


def _cgroup_mounts(mountinfo: str) -> dict[str, str]:
    """{"v2": mount point of the cgroup2 hierarchy, and per v1 controller (memory, cpu, ...) its mount point}."""
    mounts: dict[str, str] = {}
    try:
        with open(mountinfo) as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rest = left.split(), right.split()
                if len(fields) < 5 or len(rest) < 3:
                    continue
                if rest[0] == "cgroup2":
                    mounts.setdefault("v2", fields[4])
                elif rest[0] == "cgroup":
                    for controller in rest[2].split(","):
                        mounts.setdefault(controller, fields[4])
    except OSError:
        pass
    return mounts


def _cgroup_folders(proc: str, controller: str) -> list[tuple[bool, str]]:
    """(v2?, folder) of this process's cgroup and of every ancestor up to the hierarchy's root, in the v2 hierarchy
    and in v1's `controller` hierarchy (a parent's limit binds its children too)."""
    mounts = _cgroup_mounts(os.path.join(proc, "mountinfo"))
    try:
        with open(os.path.join(proc, "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    folders = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "" and "v2" in mounts:
            v2, root = True, mounts["v2"]
        elif controller in controllers.split(",") and controller in mounts:
            v2, root = False, mounts[controller]
        else:
            continue
        rel = path.strip("/")
        while True:
            folders.append((v2, os.path.join(root, rel)))
            if not rel:
                break
            rel = os.path.dirname(rel)
    return folders


def _read_limit(path: str) -> int | None:
    try:
        with open(path) as f:
            return _limit(f.read().strip())
    except OSError:
        return None


def _limit(text: str) -> int | None:
    """A cgroup file's number; None for "max", junk, or a value that means none (v1's -1 or 2**63 - 1)."""
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 < value < _NO_LIMIT else None


def cgroup_memory_limit(proc: str = "/proc/self") -> int | None:
    """The tightest memory limit on this process's cgroups, page cache included: v1 `memory.limit_in_bytes` and
    v2 `memory.max` of its cgroup and of every ancestor up to the hierarchy's root; None when there is none."""
    limits = [_read_limit(os.path.join(folder, "memory.max" if v2 else "memory.limit_in_bytes"))
              for v2, folder in _cgroup_folders(proc, "memory")]
    return min((x for x in limits if x is not None), default=None)


def cgroup_cpu_limit(proc: str = "/proc/self") -> float | None:
    """The tightest CPU quota on this process's cgroups, in CPUs (quota / period): v2 `cpu.max` and v1
    `cpu.cfs_quota_us` / `cpu.cfs_period_us` of its cgroup and every ancestor; None when there is none."""
    limits = []
    for v2, folder in _cgroup_folders(proc, "cpu"):
        if v2:
            try:
                with open(os.path.join(folder, "cpu.max")) as f:
                    quota, period = (f.read().split() + ["", ""])[:2]
            except OSError:
                continue
            quota, period = _limit(quota), _limit(period)
        else:  # v1: a quota of -1 is none
            quota, period = (_read_limit(os.path.join(folder, f"cpu.cfs_{name}_us")) for name in ("quota", "period"))
        if quota and period:
            limits.append(quota / period)
    return min(limits, default=None)


def usable_cpus() -> int:
    """The CPUs this process may keep busy at once: those its affinity allows, at most its cgroups' CPU quota
    (rounded up). A thread beyond them only takes turns, and one that spins waiting for work (OpenMP's, the token
    kernel's) then holds a CPU that the work needs."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_limit()
    return max(1, min(cpus, math.ceil(quota)) if quota else cpus)


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op thread count n (process-wide) for this block, then the count before."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def memory_limit_bytes() -> int | None:
    """The limits on this process's memory that count what it holds already: its cgroups' memory limit (page cache
    included; v1 and v2, ancestors too) and its address-space limit (RLIMIT_AS); None where there is none."""
    cgroup = cgroup_memory_limit()
    candidates = [cgroup] if cgroup else []
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft not in (resource.RLIM_INFINITY, -1) and soft > 0:
        candidates.append(soft)
    return min(candidates) if candidates else None


def available_memory_bytes() -> int:
    """The memory this process may use: the smallest of MemAvailable and memory_limit_bytes (its cgroups' memory
    limit, RLIMIT_AS); 0 where none is known."""
    candidates = [v for v in (meminfo_available_bytes(), memory_limit_bytes()) if v]
    return min(candidates) if candidates else 0


def cpu_steal_seconds() -> float | None:
    """CPU time the hypervisor took from this virtual machine's CPUs while they had work to run, summed over the
    CPUs since boot (/proc/stat's "steal"; 0 on bare metal); None where the kernel does not say. On a shared cloud
    VM it is what a run lost to other tenants or to the host's own work."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MALLOC_MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit: blocks below it come from the heap, reused when freed
MALLOC_KEEP_FREED = 1 << 30  # freed heap memory kept for reuse, up to this much
# ... only where the process may use at least this much: under a tighter limit (a cgroup, RLIMIT_AS, a small machine)
# the kept memory is what runs it out (N = 8192 under a 1.64 GiB cgroup: killed keeping it, 1.53 GiB without)
KEEP_FREED_MIN_AVAILABLE = 4 * MALLOC_KEEP_FREED
# MOEPACK_KEEP_FREED_MEMORY=0 leaves the allocator alone
KEEP_FREED_MEMORY_ENV = "MOEPACK_KEEP_FREED_MEMORY"
_malloc_tuned: bool | None = None


def _malloc_is_the_users() -> bool:
    """Whether the process's malloc is configured by its user (glibc's variables and tunables) or is not glibc's
    (an allocator preloaded): theirs to keep."""
    env = os.environ
    return (env.get(KEEP_FREED_MEMORY_ENV, "1") == "0" or any(k.startswith("MALLOC_") for k in env)
            or "malloc" in env.get("GLIBC_TUNABLES", "")
            or any(a in env.get("LD_PRELOAD", "") for a in ("jemalloc", "tcmalloc", "mimalloc")))


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for the next allocation instead of giving it back to the kernel, for
    the whole process (once; False where the C library is not glibc, or the allocator is the user's: see
    _malloc_is_the_users). `release_freed_memory` gives what is kept back when a prefill ends.

    A CPU prefill allocates and frees the same activation-sized tensors layer after layer. By default glibc maps
    every block over 128 KiB-32 MiB (its threshold adapts) on its own and trims the heap top as soon as 128 KiB are
    free, so each layer faults its activations in again, page by page: 65,000-100,000 page faults per prefill of
    256 tokens on the medium model, 0.05-0.1 s of system time. Not where the process may use less than
    KEEP_FREED_MIN_AVAILABLE (available_memory_bytes: cgroup limits included)."""
    global _malloc_tuned
    if _malloc_tuned is None:
        mallopt = getattr(_libc, "mallopt", None)  # musl and others: none
        available = available_memory_bytes()
        if mallopt is None or _malloc_is_the_users() or 0 < available < KEEP_FREED_MIN_AVAILABLE:
            _malloc_tuned = False
        else:
            _malloc_tuned = all([mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD),
                                 mallopt(_M_TRIM_THRESHOLD, MALLOC_KEEP_FREED),
                                 mallopt(_M_TOP_PAD, 64 << 20)])
    return _malloc_tuned


def release_freed_memory() -> None:
    """Give the freed memory keep_freed_memory kept back to the kernel (glibc's malloc_trim)."""
    if _malloc_tuned:
        _libc.malloc_trim(ctypes.c_size_t(0))


def choose_io_mode(mode: str, file_size: int) -> str:
    """auto: page-cache streaming (mmap) when the container fits comfortably in the memory this process may use
    (available_memory_bytes: RAM, its cgroup's limit, its address-space limit), O_DIRECT otherwise."""
    if mode not in IO_MODES:
        raise MoepackError(f"unknown io mode {mode!r} (choose from {', '.join(IO_MODES)})")
    if mode == "host":
        return "buffered"
    if mode != "auto":
        return mode
    return "mmap" if file_size < 0.7 * available_memory_bytes() else "direct"


class HostBuffer:
    """A page-aligned host buffer; pinned (page-locked) when it feeds a CUDA device."""

    def __init__(self, nbytes: int, pinned: bool):
        self.nbytes = nbytes
        if pinned:
            # cudaHostAlloc memory (torch rounds each block up to a power of two and keeps it cached for the next
            # allocation); over-allocate so an aligned start can be sliced out of it
            try:
                raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as e:
                raise MoepackError(f"cannot page-lock {nbytes / 2**20:.0f} MiB of host memory for the GPU's reads "
                                   f"({error_reason(e)[:160]})") from None
            start = (-raw.data_ptr()) % ALIGNMENT
            self.tensor = raw[start:start + nbytes]
            self._keep = raw
        else:
            # Private anonymous memory (a shared map is shmem, which gets no transparent huge pages), started on a
            # huge-page boundary: an O_DIRECT read into huge pages pins a few pages instead of one per 4 KiB, and
            # that pinning is the reader's CPU time (on a 2-core machine, time taken from the compute)
            self._keep = mmap.mmap(-1, max(nbytes, ALIGNMENT) + HUGE_PAGE,
                                   flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                try:
                    self._keep.madvise(mmap.MADV_HUGEPAGE)
                except OSError:
                    pass
            whole = torch.frombuffer(self._keep, dtype=torch.uint8)
            start = (-whole.data_ptr()) % HUGE_PAGE
            self.tensor = whole[start:start + nbytes]
        self.view = memoryview(self.tensor.numpy())

    @classmethod
    def over(cls, tensor: torch.Tensor) -> "HostBuffer":
        """A buffer over memory the caller holds (a page-aligned host uint8 tensor), for a reader to fill in place."""
        buffer = cls.__new__(cls)
        buffer.nbytes, buffer.tensor, buffer._keep = tensor.numel(), tensor, None
        buffer.view = memoryview(tensor.numpy())
        return buffer


@dataclass
class IOStats:
    bytes_read: int = 0
    requests: int = 0
    busy_seconds: float = 0.0  # time during which at least one read was in flight
    bytes_by_part: list[int] = field(default_factory=lambda: [0])  # bytes_read, split by part file
    _in_flight: int = 0
    _busy_since: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = time.perf_counter()
            self._in_flight += 1

    def end(self, nbytes: int, part: int = 0) -> None:
        with self._lock:
            self._in_flight -= 1
            self.bytes_read += nbytes
            self.bytes_by_part[part] += nbytes
            self.requests += 1
            if self._in_flight == 0:
                self.busy_seconds += time.perf_counter() - self._busy_since


class RegionReader:
    """Reads aligned byte ranges of a container's files: `paths` is the main file, or the main file and its part
    files in part order (`Container.part_paths`). Each file gets its own descriptor, O_DIRECT where it can."""

    def __init__(self, paths: str | Sequence[str], mode: str = "auto", zero_copy: bool = False):
        """`zero_copy` (mmap mode): reads return views of the mapped page cache instead of copying into the buffer;
        for a consumer on the CPU, which reads the bytes where they lie."""
        self.paths = [paths] if isinstance(paths, str) else list(paths)
        self.zero_copy = zero_copy
        self.path = self.paths[0]
        try:
            total = sum(os.path.getsize(p) for p in self.paths)
        except OSError as e:
            raise MoepackError(f"{e.filename}: cannot open ({e.strerror})") from None
        self.mode = choose_io_mode(mode, total)
        self._want_direct = self.mode == "direct"  # stays so when one part falls back: the others keep O_DIRECT
        self.warning: str | None = None
        self.stats = IOStats(bytes_by_part=[0] * len(self.paths))
        self._fds: list[int] = []
        self._direct: list[bool] = []  # per part: opened with O_DIRECT (a refusal falls back for that part only)
        self._maps: list[mmap.mmap | None] = []
        self._map_addresses: list[int] = []
        self._map_views: list[memoryview | None] = []
        self._retired: list[int] = []
        self._reopen_lock = threading.Lock()
        self._populate_works = True
        try:
            for path in self.paths:
                self._open(path)
        except BaseException:
            self.close()
            raise

    def _open(self, path: str) -> None:
        direct = self._want_direct
        fd = -1
        try:
            if direct:
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self._fall_back(path, f"O_DIRECT refused by the filesystem ({e.strerror})")
                    direct = False
            if fd < 0:
                fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise MoepackError(f"{path}: cannot open ({e.strerror})") from None
        self._fds.append(fd)
        self._direct.append(direct)
        mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ) if self.mode == "mmap" else None
        self._maps.append(mapped)
        self._map_views.append(memoryview(mapped) if mapped is not None else None)
        # the mapping's address (numpy reads it from a read-only buffer, which ctypes can't)
        self._map_addresses.append(np.frombuffer(mapped, dtype=np.uint8).ctypes.data if mapped is not None else 0)

    def _fall_back(self, path: str, why: str) -> None:
        message = f"{path}: {why}; reading through the page cache instead"
        self.mode = "buffered"
        self.warning = self.warning or message
        warnings.warn(message, RuntimeWarning, stacklevel=4)

    def read_into(self, buffer: HostBuffer, offset: int, length: int, part: int = 0,
                  zero_copy: bool | None = None) -> memoryview:
        """Read [offset, offset+length) of part file `part` into the start of `buffer`; returns the filled view.
        `zero_copy`: this read's (None: the reader's), for a reader shared by consumers that differ."""
        if length > buffer.nbytes:
            raise ValueError(f"read of {length} bytes into a {buffer.nbytes}-byte buffer")
        self.stats.begin()
        try:
            mapped = self._maps[part]
            if mapped is not None:
                if offset < 0 or offset + length > len(mapped):
                    raise MoepackError(f"{self.paths[part]}: unexpected end of file at {len(mapped)} (truncated?)")
                self._check_still_mapped(part, offset + length)
                if self.zero_copy if zero_copy is None else zero_copy:
                    self._populate(part, offset, length)
                    return self._map_views[part][offset:offset + length]
                # one copy, page cache -> buffer, by a ctypes call: it releases the GIL, so the compute thread's
                # Python keeps running while gigabytes are copied (a memoryview assignment would hold it)
                ctypes.memmove(buffer.tensor.data_ptr(), self._map_addresses[part] + offset, length)
                return buffer.view[:length]
            done = 0
            path = self.paths[part]
            while done < length:
                try:
                    n = os.preadv(self._fds[part], [buffer.view[done:length]], offset + done)
                except OSError as e:
                    if e.errno == errno.EINVAL and self._direct[part]:
                        self._reopen_buffered(part, f"O_DIRECT read refused ({e.strerror})")
                        continue
                    raise MoepackError(f"{path}: read failed at {offset + done}: {e.strerror}") from None
                if n == 0:
                    raise MoepackError(f"{path}: unexpected end of file at {offset + done} (truncated?)")
                done += n
            return buffer.view[:length]
        finally:
            self.stats.end(length, part)

    def _check_still_mapped(self, part: int, end: int) -> None:
        """A mapped file cut short since it was mapped (overwritten in place, e.g. by `cp`): touching a page past its
        new end is a SIGBUS that kills the process, so the read is refused while the file still holds it."""
        size = os.fstat(self._fds[part]).st_size
        if size < end:
            raise MoepackError(f"{self.paths[part]}: the file shrank to {size} bytes while being read "
                               f"(overwritten in place?); a read up to {end} failed")

    def _populate(self, part: int, offset: int, length: int) -> None:
        """Map the pages of a zero-copy read into this process now, on the reader thread: the read the copy used to
        do. Without it every 64 KiB the consumer touches first costs it a page fault (~0.15 ms per 1.6 MB expert on
        the compute threads, where MADV_WILLNEED only brings the pages into the page cache)."""
        if length <= 0:
            return
        start = offset - offset % mmap.PAGESIZE
        length = offset + length - start
        address = self._map_addresses[part] + start
        if self._populate_works:
            if _libc.madvise(address, length, MADV_POPULATE_READ) == 0:
                return
            if ctypes.get_errno() == errno.EINVAL:
                self._populate_works = False  # kernels before 5.14: the page-cache hint only
        _libc.madvise(address, length, mmap.MADV_WILLNEED)  # a hint: its failure costs speed, never bytes

    def _reopen_buffered(self, part: int, why: str) -> None:
        with self._reopen_lock:  # several reader threads may meet the refusal at once: reopen once
            if not self._direct[part]:
                return
            # the O_DIRECT descriptor stays open until close(): another thread may be inside a read on it
            self._retired.append(self._fds[part])
            self._fds[part] = os.open(self.paths[part], os.O_RDONLY)
            self._direct[part] = False
        self._fall_back(self.paths[part], why)

    def close(self) -> None:
        for v, m in zip(self._map_views, self._maps):
            try:
                if v is not None:
                    v.release()
                if m is not None:
                    m.close()
            except BufferError:  # a zero-copy view still alive somewhere: unmapped when the last one goes
                pass
        for fd in self._fds + self._retired:
            os.close(fd)
        self._maps, self._map_views, self._map_addresses = [], [], []
        self._fds, self._direct, self._retired = [], [], []


class ReadPipeline:
    """Keeps up to `depth` reads in flight, into buffers from a fixed pool of `buffers` (default `depth`).

    `submit(offset, length)` returns a Future of (buffer, view); the consumer calls `release(buffer)` when done and
    consumes futures in the order it submitted them. A worker takes a free buffer *before* it takes the next
    request, so buffers go to requests strictly in submission order: the oldest request the consumer waits for
    always gets the next buffer released (handing buffers to whichever request a thread happens to pick up first
    can leave the pool held by later, unconsumed reads: a deadlock). Submissions beyond the pool wait, which is
    what bounds memory. More buffers than reads in flight let the disk run ahead of a consumer that is busy with
    something else for a while (the prefill's attention), without more requests queued at the device.
    """

    def __init__(self, reader: RegionReader, buffer_bytes: int, depth: int, pinned: bool = False,
                 buffers: int | None = None, zero_copy: bool | None = None):
        """`zero_copy`: whether its reads may be views of the mapped page cache (None: the reader's choice)."""
        if not 1 <= depth <= MAX_QUEUE_DEPTH:
            raise MoepackError(f"queue depth {depth}: reads in flight must be 1 to {MAX_QUEUE_DEPTH} (each holds a "
                               "buffer and a thread)")
        self.reader = reader
        self.zero_copy = zero_copy
        self.buffer_bytes = buffer_bytes
        self.buffers = max(depth, buffers or depth)
        # the buffers handed to the consumer and not released yet, and the reads not yet done: what end_pass
        # reclaims of a pass that ended before consuming all its reads (cancelled, failed)
        self._lent: dict[int, HostBuffer] = {}
        self._lent_lock = threading.Lock()
        self._unfinished: list[Future] = []
        self._free: queue.Queue[HostBuffer | None] = queue.Queue()
        for _ in range(self.buffers):
            self._free.put(HostBuffer(buffer_bytes, pinned))
        self._requests: queue.Queue[tuple | None] = queue.Queue()
        self._threads = [threading.Thread(target=self._work, name=f"moepack-read-{i}", daemon=True)
                         for i in range(depth)]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while True:
            buf = self._free.get()
            if buf is None:
                return
            item = self._requests.get()
            if item is None:
                self._free.put(buf)
                return
            future, offset, length, after, part = item
            if not future.set_running_or_notify_cancel():
                self._free.put(buf)
                continue
            try:
                copy = {} if self.zero_copy is None else {"zero_copy": self.zero_copy}  # (else the reader's own)
                view = self.reader.read_into(buf, offset, length, part, **copy)
                if after is not None:
                    after(view)  # e.g. checksums: runs here, beside the consumer's compute
                with self._lent_lock:
                    self._lent[id(buf)] = buf
                future.set_result((buf, view))
            except BaseException as e:
                self._free.put(buf)
                future.set_exception(e)

    def submit(self, offset: int, length: int, after=None, part: int = 0) -> Future:
        """Queue a read of part file `part`; `after(view)` runs on the worker once the bytes are in (its exception
        fails the read)."""
        future: Future = Future()
        if len(self._unfinished) > 2 * self.buffers:  # (a done read needs nothing more of end_pass than its buffer)
            self._unfinished = [f for f in self._unfinished if not f.done()]
        self._unfinished.append(future)
        self._requests.put((future, offset, length, after, part))
        return future

    def release(self, buffer: HostBuffer) -> None:
        """Give a read's buffer back (once: a buffer end_pass reclaimed already is not given back twice)."""
        with self._lent_lock:
            if self._lent.pop(id(buffer), None) is None:
                return
        self._free.put(buffer)

    @property
    def buffers_lent(self) -> int:
        """Buffers handed to the consumer and not released yet."""
        with self._lent_lock:
            return len(self._lent)

    def end_pass(self, give_back=None) -> int:
        """A pass over the reads ended, however (its consumer may have left reads unconsumed: cancelled, failed):
        reads not started are cancelled, those in flight awaited, and every buffer still lent given back, through
        `give_back(buffer, release)` where given (the device copier: after the copies out of it). The pool is then
        whole for the next pass. Returns how many buffers came back so."""
        unfinished, self._unfinished = self._unfinished, []
        for future in unfinished:
            if not future.cancel():  # (a cancelled read's worker puts its buffer back itself)
                future.exception()  # in flight: wait; a failed read gave its buffer back
        with self._lent_lock:
            left = list(self._lent.values())
        for buffer in left:
            if give_back is not None:
                give_back(buffer, self.release)
            else:
                self.release(buffer)
        return len(left)

    def close(self) -> None:
        """Cancel what has not started, stop the workers (a worker may be waiting for a buffer or a request)."""
        while True:
            try:
                item = self._requests.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self._threads:
            self._requests.put(None)
            self._free.put(None)
        for t in self._threads:
            t.join(timeout=30)
