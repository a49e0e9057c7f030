"""Full integrity check: read every byte of a container (every part file of a multi-part one) with large sequential
reads and check every checksum (each region, each tensor) and every padding byte. Opening the container already
checked the structure and the part files' headers."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np
import xxhash

from .decode import first_non_finite
from .dtypes import STORAGE_TYPES
from .errors import FormatError
from .layout import HEADER_SIZE
from .reader import Container, Region

READ_CHUNK = 64 << 20


@dataclass
class VerifyReport:
    path: str
    regions: int
    tensors: int
    bytes_read: int
    seconds: float
    parts: int = 1

    def as_dict(self) -> dict:
        return {"ok": True, "path": self.path, "regions": self.regions, "tensors": self.tensors, "parts": self.parts,
                "bytes_read": self.bytes_read, "seconds": round(self.seconds, 3),
                "gb_per_s": round(self.bytes_read / max(self.seconds, 1e-9) / 1e9, 3)}


def _check_region(c: Container, region: Region, on_bytes) -> None:
    """Stream one region: its hash, its tensors' hashes, zero bytes wherever no tensor lies, and no NaN or infinity
    in a float tensor (decode.first_non_finite: by the bits, as they stream past)."""
    region_hash = xxhash.xxh3_64()
    # Covered byte ranges, in order; everything between them must be zero.
    spans = [(t.offset, t.offset + t.length, t) for t in region.tensors]
    hashers = {t.name: xxhash.xxh3_64() for t in region.tensors}
    cut_blocks = {}  # tensor name -> the bytes of its block cut by the last chunk's end, judged with the next chunk
    pos = 0
    while pos < region.length:
        n = min(READ_CHUNK, region.length - pos)
        chunk = memoryview(c.pread(region.offset + pos, n, region.part))
        region_hash.update(chunk)
        cursor = pos  # bytes before `cursor` in this chunk are accounted for
        for start, end, t in spans:
            if end <= pos or start >= pos + n:
                continue
            _check_zero(c, region, chunk, pos, cursor, start)
            piece = chunk[max(start, pos) - pos:min(end, pos + n) - pos]
            hashers[t.name].update(piece)
            bad = _first_non_finite_in_whole_blocks(t, piece, max(start, pos) - start, cut_blocks)
            if bad is not None:
                raise FormatError(f"tensor {t.name} (region {c.describe(region)}): not finite (NaN or infinity) at "
                                  f"flat index {bad}")
            cursor = max(cursor, end)
        _check_zero(c, region, chunk, pos, cursor, pos + n)
        on_bytes(n)
        pos += n
    if region_hash.hexdigest() != region.xxh3:
        raise FormatError(f"region {c.describe(region)}: checksum mismatch (expected {region.xxh3}, "
                          f"got {region_hash.hexdigest()}): the region is damaged")
    for t in region.tensors:
        if hashers[t.name].hexdigest() != t.xxh3:
            raise FormatError(f"tensor {t.name} (region {c.describe(region)}): checksum mismatch")


def _first_non_finite_in_whole_blocks(t, piece: memoryview, at: int, cut_blocks: dict) -> int | None:
    """decode.first_non_finite of the piece of tensor `t` `at` bytes in, on whole blocks (an MXFP4 block's values
    are judged from all its bytes): a block cut by a chunk's end is kept in `cut_blocks` and judged once the next
    chunk completes it."""
    size = STORAGE_TYPES[t.dtype].block_bytes
    held = cut_blocks.pop(t.name, b"")
    bad = None
    if held:
        need = min(size - len(held), len(piece))
        completed, piece = held + bytes(piece[:need]), piece[need:]
        at += need
        if len(completed) < size:
            cut_blocks[t.name] = completed
            return None
        bad = first_non_finite(t.dtype, completed, at - size)
    cut = (at + len(piece)) % size if at + len(piece) < t.length else 0
    if cut:
        cut_blocks[t.name], piece = bytes(piece[len(piece) - cut:]), piece[:len(piece) - cut]
    return bad if bad is not None else first_non_finite(t.dtype, piece, at)


def _check_zero(c: Container, region: Region, chunk: memoryview, chunk_pos: int, start: int, end: int) -> None:
    lo, hi = max(start, chunk_pos), min(end, chunk_pos + len(chunk))
    if lo < hi and np.frombuffer(chunk[lo - chunk_pos:hi - chunk_pos], dtype=np.uint8).any():
        raise FormatError(f"region {c.describe(region)}: padding at +{lo}..+{hi} is not zero: the region is damaged")


def verify_container(path: str, on_bytes=None) -> VerifyReport:
    """Raises FormatError naming the first damaged region or tensor; returns a report when all is well."""
    on_bytes = on_bytes or (lambda n: None)
    start = time.perf_counter()
    with Container(path) as c:
        for part in range(c.part_count):
            try:
                os.posix_fadvise(c.fileno(part), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except (AttributeError, OSError):
                pass
        on_bytes(HEADER_SIZE * c.part_count)  # headers and index were read and checked by opening
        for region in c.regions:
            _check_region(c, region, on_bytes)
        on_bytes(c.file_size - c.header.index_offset)
        return VerifyReport(path, len(c.regions), len(c.tensors), c.data_bytes, time.perf_counter() - start,
                            c.part_count)
