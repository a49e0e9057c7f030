"""A container's bytes held once per process, for prefills that should not read the disk again: in host RAM
(`--io host`: pinned where a CUDA device takes them, so every layer goes to the device by DMA with no copy out of
the page cache) or in the compute device's memory (`--device-resident`: the prefill is pure compute).

Loading reads every region once (in file order) and checks its xxh3 as it goes; from then on the bytes are this
process's own memory, never written, so the prefills that use them check nothing again. A server (or a
Generator) that prefills many prompts pays the load once: `resident_bytes` keeps one copy per container file and
place for the life of the process (`release_resident` drops them). Dropping is safe while prefills still use the
bytes: each pass holds them (`ResidentBytes.acquire`) and each device copy out of the pinned memory leaves its event
(`copy_queued`); the pinned pages are unregistered only once no pass holds them and every such copy is done (an
asynchronous copy out of unregistered pages is undefined). A pass that starts after the drop loads them again.

The read scheduler swaps its read pipes for `ResidentPipe`s: a read is then a slice of these bytes (a
`ResidentSlice`, in place of a pool buffer), handed out at once. The device copier copies a host slice to the device
on its copy stream and uses a device slice as it is.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import weakref
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import xxhash
from tqdm import tqdm

from moepack.format_spec.errors import FormatError, MoepackError, error_reason
from moepack.format_spec.reader import Container, Region

from .io import available_memory_bytes

PLACES = ("host", "device")
# what may be held at most: the rest of the memory is the prefill's working set (it is checked after the load)
MEMORY_FRACTION = 0.9
_STAGING_BYTES = 64 << 20  # the device load's pinned staging buffer, reused region to region


@dataclass
class ResidentSlice:
    """A read served from resident bytes: `tensor` the bytes (host or device), `view` the host bytes (None on
    the device), `owner` the ResidentBytes they are a slice of. Never goes back to a pool."""

    tensor: torch.Tensor
    view: memoryview | None
    owner: "ResidentBytes"
    resident = True

    def copy_queued(self, event) -> None:
        """A device copy out of these bytes was queued; `event` (a CUDA event) is done when it is."""
        self.owner.copy_queued(event)


class ResidentBytes:
    """Every region of `container`'s files, loaded once into `place` (host RAM, pinned for a CUDA `device`; or the
    device's memory)."""

    def __init__(self, container: Container, place: str, device: torch.device, verify: bool = True,
                 progress: bool = False):
        if place not in PLACES:
            raise MoepackError(f"unknown resident place {place!r} (choose from {', '.join(PLACES)})")
        self.place, self.device = place, device
        self.path = container.path
        sizes = [os.path.getsize(p) for p in container.part_paths]
        self.nbytes = sum(sizes)
        self.verified = verify
        self.on_device = on_device = place == "device" and device.type == "cuda"
        pinned = device.type == "cuda" and not on_device
        _check_room(self.nbytes, place, device, container.path)
        self._users: Counter = Counter()  # thread id -> passes of that thread using the bytes now
        self._state = threading.Lock()
        # events of device copies out of the pinned pages not yet known to be done (the unregistering waits on them)
        self._copies: list = []
        self._unpins: list[weakref.finalize] = []  # each pinned part's unregistering (run once)
        self.released = False  # dropped by release_resident: no new pass takes them
        self.unpinned = threading.Event()  # released, and the pinned pages (if any) unregistered
        started = time.perf_counter()
        try:
            self.parts = [self._pinned(size) if pinned else torch.empty(size, dtype=torch.uint8,
                                                                        device=device if on_device else "cpu")
                          for size in sizes]
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            where = "device" if on_device else ("page-locked host" if pinned else "host")
            raise MoepackError(f"cannot hold {container.path}'s {self.nbytes / 2**30:.1f} GiB in {where} memory "
                               f"({error_reason(e)[:160]}): use --io direct") from None
        self._host_views = None if on_device else [memoryview(p.numpy()) for p in self.parts]
        regions = sorted(container.regions, key=lambda r: (r.part, r.offset))
        self._load(container, regions, verify, on_device, progress)
        self.load_seconds = time.perf_counter() - started

    def _load(self, container: Container, regions: list[Region], verify: bool, on_device: bool,
              progress: bool) -> None:
        staging = None
        with tqdm(total=sum(r.length for r in regions), unit="B", unit_scale=True, disable=not progress,
                  desc=f"holding the weights in {self.place} memory", leave=False) as bar:
            for r in regions:
                if on_device:
                    if staging is None or staging.numel() < r.length:
                        staging = torch.empty(max(r.length, _STAGING_BYTES), dtype=torch.uint8, pin_memory=True)
                    view = memoryview(staging.numpy())[:r.length]
                else:
                    view = self._host_views[r.part][r.offset:r.end]
                container.pread_into(view, r.offset, r.part)
                if verify and xxhash.xxh3_64_hexdigest(view) != r.xxh3:
                    raise FormatError(f"region {container.describe(r)}: checksum mismatch while loading: the "
                                      f"container is damaged (run `moepack verify`)")
                if on_device:  # synchronous: the staging buffer is reused by the next region
                    self.parts[r.part][r.offset:r.end].copy_(staging[:r.length])
                bar.update(r.length)

    def slice(self, part: int, offset: int, length: int) -> ResidentSlice:
        tensor = self.parts[part][offset:offset + length]
        view = self._host_views[part][offset:offset + length] if self._host_views is not None else None
        return ResidentSlice(tensor, view, self)

    # --- who uses the bytes, and their release --------------------------------------------------------------------
    def _pinned(self, size: int) -> torch.Tensor:
        tensor, unpin = _pinned_host(size, self._copies)
        self._unpins.append(unpin)
        return tensor

    def acquire(self) -> bool:
        """A pass starts using the bytes; False (and not taken) once they were released."""
        with self._state:
            if self.released:
                return False
            self._users[threading.get_ident()] += 1
            return True

    def done_using(self) -> None:
        """The pass that acquired the bytes on this thread is over (its copies may still be in flight); the last
        one after a release unpins them."""
        with self._state:
            me = threading.get_ident()
            self._users[me] -= 1
            if self._users[me] <= 0:
                del self._users[me]
            last = self.released and not self._users
        if last:
            self._unpin()

    def copy_queued(self, event) -> None:
        if not self._unpins:
            return  # nothing pinned: nothing to wait for
        with self._state:
            self._copies[:] = [e for e in self._copies if not e.query()]  # the done ones dropped
            self._copies.append(event)

    def release(self, wait: bool = True) -> None:
        """No new pass takes the bytes; the pinned pages are unregistered once the passes using them are over and
        every copy out of them is done: by the last of those passes as it ends, waited for here where `wait` (and
        this thread runs none of them: it would wait for itself)."""
        with self._state:
            self.released = True
            in_use, mine = bool(self._users), threading.get_ident() in self._users
        if not in_use:
            self._unpin()
        elif wait and not mine:
            self.unpinned.wait()

    def _unpin(self) -> None:
        try:
            for unpin in self._unpins:
                unpin()  # a weakref.finalize: runs once, waiting for the copies first
        finally:  # set even where a copy's event raised (a failed device): a waiting release must not hang
            self.unpinned.set()


def _pinned_host(size: int, copies: list) -> tuple[torch.Tensor, weakref.finalize]:
    """`size` bytes of page-locked host memory, exactly: pages of their own registered with CUDA (torch's pinned
    allocator would round a 10 GB container up to 16 GiB, and keep it cached after use), and the unregistering
    (once `copies`, the events of the copies out of them, are done), run when called or when the tensor goes."""
    pages = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(pages, dtype=torch.uint8)[:size]
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(tensor.data_ptr(), max(size, 1), 0)
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister failed (CUDA error {int(error)})")
    return tensor, weakref.finalize(tensor, _unregister, cudart, tensor.data_ptr(), copies)


def _unregister(cudart, pointer: int, copies: list) -> None:
    for event in list(copies):
        event.synchronize()
    cudart.cudaHostUnregister(pointer)


def _check_room(nbytes: int, place: str, device: torch.device, path: str) -> None:
    """Refuse in one line, before allocating, where the memory is not there."""
    free = free_bytes(place, device)
    if place == "device" and device.type == "cuda":
        flag, where = "--device-resident", f"free memory on {device}"
    else:
        flag, where = ("--io host" if place == "host" else "--device-resident"), "available host memory"
    if free and nbytes > MEMORY_FRACTION * free:
        raise MoepackError(f"{flag}: {path} is {nbytes / 2**30:.1f} GiB but only {free / 2**30:.1f} GiB of {where} "
                           f"is there (at most {MEMORY_FRACTION:.0%} of it is used): use --io direct")


def free_bytes(place: str, device: torch.device) -> int:
    """What `place` has free for held weights: the device's free memory, or the memory this process may use."""
    if place == "device" and device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_memory_bytes()


def place_that_fits(paths: list[str], device: torch.device, share: float = 0.5) -> str | None:
    """Where a server holds the weights once for its life (docs/guide.md): on a GPU, "device" where the files take
    at most `share` of its free memory (the rest is the prefills' and the expert cache's), else "host" where they
    take at most `share` of the memory this process may use; None on a CPU (the page cache serves it) or where
    neither fits (they stream)."""
    if device.type != "cuda":
        return None
    size = sum(os.path.getsize(p) for p in paths)
    for place in PLACES[::-1]:  # the device first
        if size <= share * free_bytes(place, device):
            return place
    return None


_HELD: dict[tuple, ResidentBytes] = {}
_HELD_LOCK = threading.Lock()


def resident_bytes(container: Container, place: str, device: torch.device, verify: bool = True,
                   progress: bool = False) -> tuple[ResidentBytes, bool]:
    """The container's bytes in `place`, loaded on first use in this process; (bytes, whether this call loaded
    them). A file changed since (its size or modification time) is loaded again."""
    stats = [os.stat(p) for p in container.part_paths]
    key = (os.path.realpath(container.path), tuple((s.st_size, s.st_mtime_ns, s.st_ino) for s in stats), place,
           str(device))
    with _HELD_LOCK:
        held = _HELD.get(key)
        if held is not None and (held.verified or not verify):  # bytes loaded unchecked serve no checked prefill
            return held, False
        for old in [k for k in _HELD if k[0] == key[0] and k[2:] == key[2:]]:
            _HELD.pop(old).release(wait=False)  # an earlier version of the same file: unpinned after its passes
        held = _HELD[key] = ResidentBytes(container, place, device, verify, progress)
        return held, True


def release_resident(wait: bool = True) -> None:
    """Drop every container held. Their pinned pages are unregistered once the passes using them are over and the
    copies out of them done (ResidentBytes.release: waited for here unless `wait` is False) and their memory goes
    back once nothing refers to it; an engine that prefills again loads them again."""
    with _HELD_LOCK:
        held = list(_HELD.values())
        _HELD.clear()
    for h in held:  # outside the lock: a pass that loads another container meanwhile is not blocked
        h.release(wait)


class ResidentPipe:
    """The read pipe's interface (runtime/io.py ReadPipeline) over resident bytes: each read is done at once."""

    def __init__(self, held: ResidentBytes, buffer_bytes: int):
        self.held = held  # replaced where the bytes were released and loaded again (ReadScheduler.use_resident)
        self.buffer_bytes, self.buffers = buffer_bytes, 0  # no pool: nothing is copied into a buffer

    def submit(self, offset: int, length: int, after=None, part: int = 0) -> Future:
        future: Future = Future()
        piece = self.held.slice(part, offset, length)
        future.set_result((piece, piece.view))
        return future

    def release(self, buffer) -> None:
        pass

    buffers_lent = 0

    def end_pass(self, give_back=None) -> int:
        return 0  # nothing is lent: every read is a slice of the held bytes

    def close(self) -> None:
        pass
