"""The device copier: the bytes a read delivered, as a tensor on the compute device. The second of the streaming
pipeline's three stages (read scheduler -> device copier -> expert runner; docs/architecture.md).

On a CPU it is a no-op: the bytes are used where they are (in the read pool's buffer, or in place in the page
cache). On CUDA the read pool's buffers are pinned host memory and form the ring the copies go out of: each copy
is queued on a copy stream of its own, and the compute stream waits for it through an event, so neither the
copy nor the kernels that use its bytes wait for the host. The host waits only when a buffer goes back to the
pool (the next read may overwrite it): on that buffer's last copy, long finished by then, as the buffer is given
back after the compute that used its bytes was queued.
"""

from __future__ import annotations

import threading
import warnings

import torch


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` without the host waiting for the device (a pageable or blocking copy waits
    for every kernel queued before it): from pinned memory, which torch's host allocator keeps until the copy is
    done."""
    return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)


class DeviceCopier:
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._copied: dict[int, object] = {}  # id(pooled buffer) -> the event of the last copy out of it
        self._lock = threading.Lock()

    @staticmethod
    def host_bytes(buffer, view: memoryview) -> torch.Tensor:
        """The bytes a read delivered (`view`: in `buffer`, or in place in the page cache) as a host uint8 tensor."""
        if getattr(buffer, "resident", False):  # held once per process (runtime/resident.py): used where they are
            return buffer.tensor.cpu()
        if view.readonly:  # a zero-copy read: the mapped page cache itself, never written to
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch warns that the memory is read-only
                return torch.frombuffer(view, dtype=torch.uint8)
        return buffer.tensor[:len(view)]

    def to_device(self, buffer, view: memoryview, pooled: bool = True) -> torch.Tensor:
        """The bytes a read delivered as a uint8 tensor on the compute device. `pooled`: `buffer` goes back to a
        read pool through `release` (else it is torch's own pinned memory, which torch's host allocator does not
        reuse before the copies out of it are done)."""
        resident = getattr(buffer, "resident", False)
        if resident:
            if buffer.tensor.device == self.device or self.stream is None:
                return buffer.tensor  # on the device already (or a CPU prefill)
            pooled = False  # pinned memory that is never written again: no event to wait for before reuse
        host = self.host_bytes(buffer, view)
        if self.stream is None:
            return host
        if view is not None and view.readonly:  # the page cache (not pinned): copied on the compute stream, at once
            return host.to(self.device)
        compute_stream = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            dev = host.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        # `dev` was allocated on the copy stream and is used on the compute stream: without this, freeing it
        # would let the next copy reuse its memory while compute kernels queued on it still read it
        dev.record_stream(compute_stream)
        compute_stream.wait_event(done)
        if pooled:
            with self._lock:
                self._copied[id(buffer)] = done
        elif resident:  # its pages are unregistered only once this copy is done (runtime/resident.py)
            buffer.copy_queued(done)
        return dev

    def release(self, buffer, give_back) -> None:
        """give_back(buffer) once every copy out of it is done."""
        with self._lock:
            done = self._copied.pop(id(buffer), None)
        if done is not None:
            done.synchronize()
        give_back(buffer)
