"""Reading a container's regions for the prefill: O_DIRECT into a fixed pool of aligned buffers, Q reads in flight.

The pool is allocated once (page-aligned host memory, pinned when the consumer is a CUDA device) and recycled:
a read takes a free buffer, the consumer hands it back when it has used the bytes, so the pipeline never allocates
per read and never holds more than `depth` requests' worth of weights. Where O_DIRECT is refused (some
filesystems), reads fall back to the page cache with a warning. `mode="mmap"` maps the file instead: the right
choice when the container fits in free RAM (the page cache then serves every later prefill at memory speed).
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from moepack.format_spec.errors import MoepackError
from moepack.format_spec.layout import ALIGNMENT

IO_MODES = ("auto", "direct", "buffered", "mmap")


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be used without swapping)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def choose_io_mode(mode: str, file_size: int) -> str:
    """auto: page-cache streaming (mmap) when the container fits comfortably in free RAM, O_DIRECT otherwise."""
    if mode not in IO_MODES:
        raise MoepackError(f"unknown io mode {mode!r} (choose from {', '.join(IO_MODES)})")
    if mode != "auto":
        return mode
    return "mmap" if file_size < 0.7 * available_memory_bytes() else "direct"


class HostBuffer:
    """A page-aligned host buffer; pinned (page-locked) when it feeds a CUDA device."""

    def __init__(self, nbytes: int, pinned: bool):
        self.nbytes = nbytes
        if pinned:
            # cudaHostAlloc memory; over-allocate so an aligned start can be sliced out of it
            raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, pin_memory=True)
            start = (-raw.data_ptr()) % ALIGNMENT
            self.tensor = raw[start:start + nbytes]
            self._keep = raw
        else:
            self._keep = mmap.mmap(-1, max(nbytes, ALIGNMENT))  # anonymous maps are page-aligned
            self.tensor = torch.frombuffer(self._keep, dtype=torch.uint8)[:nbytes]
        self.view = memoryview(self.tensor.numpy())


@dataclass
class IOStats:
    bytes_read: int = 0
    requests: int = 0
    busy_seconds: float = 0.0  # time during which at least one read was in flight
    _in_flight: int = 0
    _busy_since: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = time.perf_counter()
            self._in_flight += 1

    def end(self, nbytes: int) -> None:
        with self._lock:
            self._in_flight -= 1
            self.bytes_read += nbytes
            self.requests += 1
            if self._in_flight == 0:
                self.busy_seconds += time.perf_counter() - self._busy_since


class RegionReader:
    """Reads aligned byte ranges of one container file."""

    def __init__(self, path: str, mode: str = "auto"):
        self.path = path
        size = os.path.getsize(path)
        self.mode = choose_io_mode(mode, size)
        self.warning: str | None = None
        self.stats = IOStats()
        self._map = None
        flags = os.O_RDONLY
        if self.mode == "direct":
            try:
                self._fd = os.open(path, flags | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise MoepackError(f"{path}: cannot open ({e.strerror})") from None
                self._fall_back(f"O_DIRECT refused by the filesystem ({e.strerror})")
                self._fd = os.open(path, flags)
        else:
            self._fd = os.open(path, flags)
        if self.mode == "mmap":
            self._map = mmap.mmap(self._fd, 0, prot=mmap.PROT_READ)

    def _fall_back(self, why: str) -> None:
        self.mode = "buffered"
        self.warning = f"{self.path}: {why}; reading through the page cache instead"
        warnings.warn(self.warning, RuntimeWarning, stacklevel=3)

    def read_into(self, buffer: HostBuffer, offset: int, length: int) -> memoryview:
        """Read [offset, offset+length) into the start of `buffer`; returns the filled view."""
        if length > buffer.nbytes:
            raise ValueError(f"read of {length} bytes into a {buffer.nbytes}-byte buffer")
        self.stats.begin()
        try:
            if self._map is not None:
                with memoryview(self._map) as mapped:  # one copy, page cache -> buffer (a slice would copy twice)
                    buffer.view[:length] = mapped[offset:offset + length]
                return buffer.view[:length]
            done = 0
            while done < length:
                try:
                    n = os.preadv(self._fd, [buffer.view[done:length]], offset + done)
                except OSError as e:
                    if e.errno == errno.EINVAL and self.mode == "direct":
                        os.close(self._fd)
                        self._fd = os.open(self.path, os.O_RDONLY)
                        self._fall_back(f"O_DIRECT read refused ({e.strerror})")
                        continue
                    raise MoepackError(f"{self.path}: read failed at {offset + done}: {e.strerror}") from None
                if n == 0:
                    raise MoepackError(f"{self.path}: unexpected end of file at {offset + done} (truncated?)")
                done += n
            return buffer.view[:length]
        finally:
            self.stats.end(length)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class ReadPipeline:
    """Keeps up to `depth` reads in flight, each into its own buffer from a fixed pool.

    `submit(offset, length)` returns a Future of (buffer, view); the consumer calls `release(buffer)` when done and
    consumes futures in the order it submitted them. A worker takes a free buffer *before* it takes the next
    request, so buffers go to requests strictly in submission order: the oldest request the consumer waits for
    always gets the next buffer released (handing buffers to whichever request a thread happens to pick up first
    can leave the pool held by later, unconsumed reads: a deadlock). Submissions beyond the pool wait, which is
    what bounds memory.
    """

    def __init__(self, reader: RegionReader, buffer_bytes: int, depth: int, pinned: bool = False):
        if depth < 1:
            raise MoepackError("queue depth must be at least 1")
        self.reader = reader
        self.buffer_bytes = buffer_bytes
        self._free: queue.Queue[HostBuffer | None] = queue.Queue()
        for _ in range(depth):
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
            future, offset, length, after = item
            if not future.set_running_or_notify_cancel():
                self._free.put(buf)
                continue
            try:
                view = self.reader.read_into(buf, offset, length)
                if after is not None:
                    after(view)  # e.g. checksums: runs here, beside the consumer's compute
                future.set_result((buf, view))
            except BaseException as e:
                self._free.put(buf)
                future.set_exception(e)

    def submit(self, offset: int, length: int, after=None) -> Future:
        """Queue a read; `after(view)` runs on the worker once the bytes are in (its exception fails the read)."""
        future: Future = Future()
        self._requests.put((future, offset, length, after))
        return future

    def release(self, buffer: HostBuffer) -> None:
        self._free.put(buffer)

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
