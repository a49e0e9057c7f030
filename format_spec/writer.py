"""Writes a container in read order: regions are appended one after another, then the index, then the header.

The output goes to `<path>.partial`; `finish()` fsyncs it and renames it over `<path>`, so the final name only ever
holds a complete container and an interrupted write never damages a file that was already there.

Resuming: `checkpoint()` fsyncs the partial file and records the regions written so far in `<path>.partial.journal`
(written atomically). A writer opened with `resume=True` and the same `job` description re-reads those regions,
keeps the prefix whose checksums still match, truncates after it and carries on; `completed` names the regions
kept, which the caller skips. A deterministic caller therefore produces the same bytes as an uninterrupted run.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import xxhash
import zstandard

from .dtypes import tensor_nbytes
from .errors import MoepackError
from .layout import (
    ALIGNMENT, CODEC_ZSTD, FORMAT_MAJOR, FORMAT_MINOR, HEADER_SIZE, TENSOR_ALIGNMENT, Header, align_up,
    parse_block_name, region_name,
)

_ZEROS = bytes(ALIGNMENT)


def partial_path(path: str) -> str:
    return path + ".partial"


def journal_path(path: str) -> str:
    return path + ".partial.journal"


@dataclass
class _OpenRegion:
    name: str
    kind: str
    block: str | None
    expert: int | None
    offset: int
    used: int = 0
    hasher: "xxhash.xxh3_64" = field(default_factory=xxhash.xxh3_64)
    tensors: list = field(default_factory=list)


class ContainerWriter:
    """Append-only writer. Usage::

        w = ContainerWriter("model.moepack")
        w.begin_region("global", tensor="embed.weight"); w.add_tensor("embed.weight", "BF16", [V, H], data); w.end_region()
        w.begin_region("dense", block="layers.0"); ...; w.end_region()
        w.begin_region("expert", block="layers.0", expert=0); ...; w.end_region()
        w.finish(config=..., policy=...)
    """

    def __init__(self, path: str, on_bytes=None, job: dict | None = None, resume: bool = False):
        self.path = path
        self.tmp_path = partial_path(path)
        self.journal_path = journal_path(path)
        self.job = job or {}
        self._on_bytes = on_bytes or (lambda n: None)
        self._regions: list[dict] = []
        self._tensors: list[dict] = []
        self._names: set[str] = set()
        self._open: _OpenRegion | None = None
        self.completed: list[str] = []
        try:
            if not (resume and self._resume()):
                self._file = open(self.tmp_path, "wb", buffering=0)
                self._file.write(bytes(HEADER_SIZE))  # placeholder; the real header is written last
                self._pos = HEADER_SIZE
        except OSError as e:
            raise MoepackError(f"cannot write {self.tmp_path}: {e.strerror or e}") from None

    def _resume(self) -> bool:
        """Pick up `<path>.partial` where the journal says it was; False if there is nothing valid to resume."""
        try:
            with open(self.journal_path, encoding="utf-8") as f:
                journal = json.load(f)
        except (OSError, ValueError):
            return False
        if not isinstance(journal, dict) or journal.get("job") != self.job or not os.path.exists(self.tmp_path):
            return False
        self._file = open(self.tmp_path, "r+b", buffering=0)
        pos = HEADER_SIZE
        kept = []
        for r in journal.get("regions", []):
            if r.get("offset") != pos or not _region_matches(self._file, r):
                break
            kept.append(r)
            pos += r["length"]
        self._regions = kept
        self._tensors = [t for t in journal.get("tensors", []) if t.get("region", -1) < len(kept)]
        self._names = {t["name"] for t in self._tensors}
        self.completed = [r["name"] for r in kept]
        self._file.truncate(pos)
        self._file.seek(pos)
        self._pos = pos
        return True

    def checkpoint(self) -> None:
        """Make everything written so far durable and resumable."""
        if self._open is not None:
            raise RuntimeError("checkpoint inside a region")
        try:
            os.fsync(self._file.fileno())
            tmp = self.journal_path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"job": self.job, "regions": self._regions, "tensors": self._tensors}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.journal_path)
        except OSError as e:
            raise MoepackError(f"writing {self.journal_path} failed: {e.strerror or e}") from None

    # --- regions -------------------------------------------------------------------------------------------------
    def begin_region(self, kind: str, block: str | None = None, expert: int | None = None,
                     tensor: str | None = None) -> None:
        if self._open is not None:
            raise RuntimeError("begin_region while another region is open")
        if kind != "global":
            parse_block_name(block)
        name = region_name(kind, block, expert, tensor)
        self._open = _OpenRegion(name, kind, block if kind != "global" else None,
                                 expert if kind == "expert" else None, self._pos)

    def add_tensor(self, name: str, dtype: str, shape, data) -> None:
        """Append one tensor's bytes (any buffer) to the open region, aligned to TENSOR_ALIGNMENT."""
        region = self._open
        if region is None:
            raise RuntimeError("add_tensor outside a region")
        if name in self._names:
            raise MoepackError(f"tensor {name!r} written twice")
        view = memoryview(data).cast("B")
        expected = tensor_nbytes(dtype, list(shape))
        if view.nbytes != expected:
            raise MoepackError(f"tensor {name}: {view.nbytes} bytes given, {dtype}{list(shape)} needs {expected}")
        gap = align_up(region.used, TENSOR_ALIGNMENT) - region.used
        self._write(region, _ZEROS[:gap])
        rel = region.used
        self._write(region, view)
        self._names.add(name)
        region.tensors.append({
            "name": name, "region": len(self._regions), "offset": rel, "length": view.nbytes,
            "dtype": dtype, "shape": [int(d) for d in shape], "xxh3": xxhash.xxh3_64_hexdigest(view),
        })

    def end_region(self) -> None:
        region = self._open
        if region is None:
            raise RuntimeError("end_region without begin_region")
        length = align_up(max(region.used, 1))
        pad = length - region.used
        while pad:
            n = min(pad, ALIGNMENT)
            self._write(region, _ZEROS[:n])
            pad -= n
        self._regions.append({
            "name": region.name, "kind": region.kind, "block": region.block, "expert": region.expert,
            "offset": region.offset, "length": length, "xxh3": region.hasher.hexdigest(),
        })
        self._tensors.extend(region.tensors)
        self._open = None

    def _write(self, region: _OpenRegion, view) -> None:
        if not len(view):
            return
        try:
            written = 0
            mv = memoryview(view)
            while written < len(mv):
                written += self._file.write(mv[written:])
        except OSError as e:
            raise MoepackError(f"writing {self.tmp_path} failed: {e.strerror or e}"
                               + (" (disk full; the partial file is kept)" if e.errno == 28 else "")) from None
        region.hasher.update(view)
        region.used += len(view)
        self._pos += len(view)
        self._on_bytes(len(view))

    # --- index, header, commit -----------------------------------------------------------------------------------
    def finish(self, *, config: dict, architecture: str, policy: dict, tokenizer: dict | None = None,
               provenance: dict | None = None, extra: dict | None = None) -> str:
        if self._open is not None:
            raise RuntimeError("finish with an open region")
        index = {
            "format": "moepack",
            "format_version": [FORMAT_MAJOR, FORMAT_MINOR],
            "architecture": architecture,
            "config": config,
            "policy": policy,
            "tokenizer": tokenizer or {},
            "provenance": provenance or {},
            "extra": extra or {},
            "regions": self._regions,
            "tensors": self._tensors,
        }
        raw = json.dumps(index, separators=(",", ":"), sort_keys=True).encode()
        stored = zstandard.ZstdCompressor(level=9).compress(raw)
        index_offset = self._pos
        index_region = _OpenRegion("index", "index", None, None, index_offset)
        self._write(index_region, stored)
        self._write(index_region, _ZEROS[: align_up(len(stored)) - len(stored)])
        header = Header(FORMAT_MAJOR, FORMAT_MINOR, ALIGNMENT, self._pos, index_offset, len(stored), len(raw),
                        CODEC_ZSTD, xxhash.xxh3_64_intdigest(stored))
        try:
            self._file.seek(0)
            self._file.write(header.pack())
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self.tmp_path, self.path)
            fsync_dir(os.path.dirname(os.path.abspath(self.path)))
            if os.path.exists(self.journal_path):
                os.remove(self.journal_path)
        except OSError as e:
            raise MoepackError(f"finishing {self.path} failed: {e.strerror or e}") from None
        return self.path

    def abort(self) -> None:
        """Close without committing; the partial file stays where it is (a later run may resume from it)."""
        if not self._file.closed:
            self._file.close()

    @property
    def bytes_written(self) -> int:
        return self._pos


def _region_matches(f, region: dict) -> bool:
    """Re-read a journaled region from the partial file and compare its checksum."""
    h = xxhash.xxh3_64()
    pos, end = region["offset"], region["offset"] + region["length"]
    while pos < end:
        chunk = os.pread(f.fileno(), min(64 << 20, end - pos), pos)
        if not chunk:
            return False
        h.update(chunk)
        pos += len(chunk)
    return h.hexdigest() == region.get("xxh3")


def fsync_dir(path: str) -> None:
    """Make a rename inside `path` durable (best effort: some filesystems refuse a directory fsync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
