"""A container's bytes held once per process, for prefills that should not read the disk again: in host RAM
(`--io host`: pinned where a CUDA device takes them, so every layer goes to the device by DMA with no copy out of
the page cache) or in the compute device's memory (`--device-resident`: the prefill is pure compute).

Loading reads every region once (in file order) and checks its xxh3 as it goes; from then on the bytes are this
process's own memory, never written, so the prefills that use them check nothing again. A server (or a
Generator) that prefills many prompts pays the load once: `resident_bytes` keeps one copy per container file and
place for the life of the process (`release_resident` drops them).

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
    the device). Never goes back to a pool."""

    tensor: torch.Tensor
    view: memoryview | None
    resident = True


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
        started = time.perf_counter()
        try:
            self.parts = [_pinned_host(size) if pinned else torch.empty(size, dtype=torch.uint8,
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
        return ResidentSlice(tensor, view)


def _pinned_host(size: int) -> torch.Tensor:
    """`size` bytes of page-locked host memory, exactly: pages of their own registered with CUDA (torch's pinned
    allocator would round a 10 GB container up to 16 GiB, and keep it cached after use), unregistered when the
    tensor goes."""
    pages = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(pages, dtype=torch.uint8)[:size]
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(tensor.data_ptr(), max(size, 1), 0)
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister failed (CUDA error {int(error)})")
    weakref.finalize(tensor, cudart.cudaHostUnregister, tensor.data_ptr())
    return tensor


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
            del _HELD[old]  # an earlier version of the same file
        held = _HELD[key] = ResidentBytes(container, place, device, verify, progress)
        return held, True


def release_resident() -> None:
    """Drop every container held (their memory goes back once no prefill uses it)."""
    with _HELD_LOCK:
        _HELD.clear()


class ResidentPipe:
    """The read pipe's interface (runtime/io.py ReadPipeline) over resident bytes: each read is done at once."""

    def __init__(self, held: ResidentBytes, buffer_bytes: int):
        self.held = held
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
