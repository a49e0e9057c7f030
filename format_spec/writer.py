"""Writes a container in read order: regions are appended one after another, then the index, then the header.

The output goes to `<path>.partial`; `finish()` fsyncs it and renames it over `<path>`, so the final name only ever
holds a complete container and an interrupted write never damages a file that was already there.

Several part files (`parts=P`, SPEC.md section 9): each expert region goes to the part the striping rule names and
is appended there, so every part file is written in read order too. Part k is written as `<path>.part<k>.partial`
(in `part_dirs[k]` when given, with a symlink at `<path>.part<k>`); at `finish()` every part is completed and
fsynced, the parts are renamed into place, and the main file last: a main file under its final name always has all
its parts beside it.

Resuming: `checkpoint()` fsyncs the partial files and records the regions written so far in
`<path>.partial.journal` (written atomically). A writer opened with `resume=True` and the same `job` description (and
the same parts) re-reads those regions, keeps the prefix whose checksums still match, truncates every partial file
after it and carries on; `completed` names the regions kept, which the caller skips. A deterministic caller therefore
produces the same bytes as an uninterrupted run.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import sys
from dataclasses import dataclass, field

import xxhash
import zstandard

from . import untrusted
from .dtypes import tensor_nbytes
from .errors import MoepackError, is_disk_full
from .files import exclusive_lock, refuse_replacing_a_special_file, release_lock
from .layout import (
    ALIGNMENT, CODEC_ZSTD, DEFAULT_STRIPE_EXPERTS, FORMAT_MAJOR, FORMAT_MINOR, FORMAT_MINOR_PARTS, HEADER_SIZE,
    MAX_PARTS, TENSOR_ALIGNMENT, Header, PartHeader, align_up, layer_count_problem, parse_block_name, part_path,
    region_name, region_part,
)
from .reader import validate_tokenizer_files

_ZEROS = bytes(ALIGNMENT)
MAX_JOURNAL_BYTES = 1 << 30  # a region and its tensors take about 1 KiB: far more than any model's


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
    part: int = 0
    used: int = 0
    hasher: "xxhash.xxh3_64" = field(default_factory=xxhash.xxh3_64)
    tensors: list = field(default_factory=list)


@dataclass
class _PartOutput:
    """One output file: where it is written, where it lands, and (for a part placed elsewhere) the link to it."""

    final_path: str
    link_path: str | None  # `<path>.part<k>` pointing at final_path on another device
    file: object = None
    pos: int = HEADER_SIZE

    @property
    def tmp_path(self) -> str:
        return partial_path(self.final_path)


class ContainerWriter:
    """Append-only writer. Usage::

        w = ContainerWriter("model.moepack")
        w.begin_region("global", tensor="embed.weight"); w.add_tensor("embed.weight", "BF16", [V, H], data); w.end_region()
        w.begin_region("dense", block="layers.0"); ...; w.end_region()
        w.begin_region("expert", block="layers.0", expert=0); ...; w.end_region()
        w.finish(config=..., policy=...)
    """

    def __init__(self, path: str, on_bytes=None, job: dict | None = None, resume: bool = False, parts: int = 1,
                 stripe_experts: int = DEFAULT_STRIPE_EXPERTS, part_dirs: dict[int, str] | None = None):
        self.path = path
        self.tmp_path = partial_path(path)
        self.journal_path = journal_path(path)
        self.parts = parts
        self.stripe_experts = stripe_experts
        self._outputs = _plan_outputs(path, parts, stripe_experts, part_dirs or {})
        self.job = job or {}
        if parts > 1:  # a journal of another part layout (or placement) must not be resumed
            self.job = {**self.job, "parts": parts, "stripe_experts": stripe_experts,
                        "part_paths": [o.final_path for o in self._outputs]}
        self._on_bytes = on_bytes or (lambda n: None)
        self._regions: list[dict] = []
        self._tensors: list[dict] = []
        self._names: set[str] = set()
        self._open: _OpenRegion | None = None
        self.completed: list[str] = []
        self._lock = _hold_partial(self.tmp_path, path)
        try:
            if not (resume and self._resume()):
                for out in self._outputs:
                    out.file = open(out.tmp_path, "wb", buffering=0)
                    out.file.write(bytes(HEADER_SIZE))  # placeholder; the real header is written last
                    out.pos = HEADER_SIZE
        except OSError as e:
            self.abort()
            raise MoepackError(f"cannot write {e.filename or self.tmp_path}: {e.strerror or e}") from None
        except BaseException:  # (a damaged journal's entries, Ctrl-C while re-hashing: the lock let go too)
            self.abort()
            raise

    def _resume(self) -> bool:
        """Pick up the partial files where the journal says they were; False if there is nothing valid to resume."""
        try:  # a journal that is damaged (or not a file) means starting over, never a traceback
            journal = untrusted.load_file(self.journal_path, max_bytes=MAX_JOURNAL_BYTES)
        except (OSError, MoepackError):
            return False
        if not isinstance(journal, dict) or journal.get("job") != self.job or \
                not all(os.path.exists(out.tmp_path) for out in self._outputs):
            return False
        for out in self._outputs:
            out.file = open(out.tmp_path, "r+b", buffering=0)
            out.pos = HEADER_SIZE
        kept = []
        for r in journal.get("regions", []):
            part = r.get("part", 0) if isinstance(r, dict) else -1
            if not (isinstance(part, int) and 0 <= part < self.parts):
                break
            out = self._outputs[part]
            if r.get("offset") != out.pos or not _region_matches(out.file, r):
                break
            kept.append(r)
            out.pos += r["length"]
        self._regions = kept
        self._tensors = [t for t in journal.get("tensors", []) if t.get("region", -1) < len(kept)]
        self._names = {t["name"] for t in self._tensors}
        self.completed = [r["name"] for r in kept]
        for out in self._outputs:
            out.file.truncate(out.pos)
            out.file.seek(out.pos)
        return True

    def checkpoint(self) -> None:
        """Make everything written so far durable and resumable."""
        if self._open is not None:
            raise RuntimeError("checkpoint inside a region")
        try:
            for out in self._outputs:
                os.fsync(out.file.fileno())
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
        part = region_part(kind, block, expert, self.parts, self.stripe_experts)
        self._open = _OpenRegion(name, kind, block if kind != "global" else None,
                                 expert if kind == "expert" else None, self._outputs[part].pos, part)

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
        entry = {"name": region.name, "kind": region.kind, "block": region.block, "expert": region.expert,
                 "offset": region.offset, "length": length, "xxh3": region.hasher.hexdigest()}
        if region.part:
            entry["part"] = region.part  # absent means part 0: single-file indexes stay as they were
        self._regions.append(entry)
        self._tensors.extend(region.tensors)
        self._open = None

    def _write(self, region: _OpenRegion, view) -> None:
        if not len(view):
            return
        out = self._outputs[region.part]
        try:
            written = 0
            mv = memoryview(view)
            while written < len(mv):
                written += out.file.write(mv[written:])
        except OSError as e:
            raise MoepackError(f"writing {out.tmp_path} failed: {e.strerror or e}"
                               + (" (disk full; the partial file is kept)" if is_disk_full(e) else "")) from None
        region.hasher.update(view)
        region.used += len(view)
        out.pos += len(view)
        self._on_bytes(len(view))

    # --- index, header, commit -----------------------------------------------------------------------------------
    def finish(self, *, config: dict, architecture: str, policy: dict, tokenizer: dict | None = None,
               provenance: dict | None = None, extra: dict | None = None) -> str:
        if self._open is not None:
            raise RuntimeError("finish with an open region")
        # a container its own reader would refuse never gets the final name
        problem = layer_count_problem(config, sum(1 for r in self._regions if r["kind"] == "dense"
                                                  and parse_block_name(r["block"])[0] == "layers"))
        if problem:
            raise MoepackError(f"{self.path}: {problem}")
        validate_tokenizer_files(tokenizer or {})  # (the reader checks them at every open)
        minor = FORMAT_MINOR_PARTS if self.parts > 1 else FORMAT_MINOR
        index = {
            "format": "moepack",
            "format_version": [FORMAT_MAJOR, minor],
            "architecture": architecture,
            "config": config,
            "policy": policy,
            "tokenizer": tokenizer or {},
            "provenance": provenance or {},
            "extra": extra or {},
            "regions": self._regions,
            "tensors": self._tensors,
        }
        if self.parts > 1:
            index["parts"] = {"count": self.parts, "stripe_experts": self.stripe_experts}
        raw = json.dumps(index, separators=(",", ":"), sort_keys=True).encode()
        stored = zstandard.ZstdCompressor(level=9).compress(raw)
        main = self._outputs[0]
        index_offset = main.pos
        index_region = _OpenRegion("index", "index", None, None, index_offset)
        self._write(index_region, stored)
        self._write(index_region, _ZEROS[: align_up(len(stored)) - len(stored)])
        index_xxh3 = xxhash.xxh3_64_intdigest(stored)
        header = Header(FORMAT_MAJOR, minor, ALIGNMENT, main.pos, index_offset, len(stored), len(raw),
                        CODEC_ZSTD, index_xxh3)
        try:
            for k, out in enumerate(self._outputs):
                head = header.pack() if k == 0 else PartHeader(k, self.parts, out.pos, index_xxh3).pack()
                out.file.seek(0)
                out.file.write(head)
                os.fsync(out.file.fileno())
                out.file.close()
            for out in self._outputs[1:] + self._outputs[:1]:  # the main file last: it names a complete set
                os.replace(out.tmp_path, out.final_path)
                if out.link_path:
                    _link(out.final_path, out.link_path)
            for d in sorted({os.path.dirname(os.path.abspath(p)) for out in self._outputs
                             for p in (out.final_path, out.link_path) if p}):
                fsync_dir(d)
            if os.path.exists(self.journal_path):
                os.remove(self.journal_path)
        except OSError as e:
            raise MoepackError(f"finishing {self.path} failed: {e.strerror or e}") from None
        self._release()
        return self.path

    def abort(self) -> None:
        """Close without committing; the partial files stay where they are (a later run may resume from them)."""
        for out in self._outputs:
            if out.file is not None and not out.file.closed:
                out.file.close()
        self._release()

    def _release(self) -> None:
        release_lock(self._lock)
        self._lock = None

    @property
    def bytes_written(self) -> int:
        return sum(out.pos for out in self._outputs)


def _hold_partial(tmp_path: str, path: str) -> int:
    """An exclusive lock on the main partial file, held until the writer finishes or aborts: a second writer of the
    same path would write into the first one's file, and one of them would then finish with the other's model under
    its name."""
    return exclusive_lock(tmp_path, f"another process is writing {path} (its {os.path.basename(tmp_path)} is "
                                    "locked): wait for it to finish, or write elsewhere")


def _plan_outputs(path: str, parts: int, stripe_experts: int, part_dirs: dict[int, str]) -> list[_PartOutput]:
    if not 1 <= parts <= MAX_PARTS:
        raise MoepackError(f"--parts must be between 1 and {MAX_PARTS}, got {parts}")
    if stripe_experts < 1:
        raise MoepackError(f"--stripe-experts must be at least 1, got {stripe_experts}")
    outputs = [_PartOutput(path, None)]
    for k, directory in part_dirs.items():
        if not 1 <= k < parts:
            raise MoepackError(f"--part-dir {k}=...: part {k} does not exist (parts are 1..{parts - 1}; part 0 is "
                               f"the main file)")
        if not os.path.isdir(directory):
            raise MoepackError(f"--part-dir {k}={directory}: no such directory")
    for k in range(1, parts):
        link = part_path(path, k)
        directory = part_dirs.get(k)
        if directory is None or os.path.realpath(directory) == os.path.realpath(os.path.dirname(os.path.abspath(path))):
            outputs.append(_PartOutput(link, None))
        else:
            outputs.append(_PartOutput(os.path.join(os.path.abspath(directory), os.path.basename(link)), link))
    for output in outputs:  # (the API's callers too: the CLI refuses these before any work)
        refuse_replacing_a_special_file(output.final_path)
    return outputs


def _link(target: str, link: str) -> None:
    """Point `link` at `target`, replacing whatever was there in one step."""
    tmp = link + ".link-tmp"
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(os.path.abspath(target), tmp)
    os.replace(tmp, link)


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


def write_file_atomically(path: str, data: bytes, sync: bool = True) -> None:
    """`data` to `path.partial`, fsynced (unless `sync` is False), renamed over `path`: a file of that name is always
    whole. On failure the partial file is removed (on a full disk it holds the space) and the OSError raised."""
    partial = path + ".partial"
    try:
        with open(partial, "wb") as f:
            f.write(data)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        try:
            os.unlink(partial)
        except OSError:
            pass
        raise


def fsync_file(path: str) -> None:
    """Make a written file's bytes durable (errors are raised: unsynced data may be lost)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # renameat2's flag (linux/fs.h)


def exchange_paths(a: str, b: str) -> bool:
    """Swap two existing paths in one atomic step (Linux's renameat2 with RENAME_EXCHANGE). False where the kernel,
    the C library or the filesystem lacks it, so the caller falls back; any other failure is raised as OSError."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a C library without the wrapper (glibc before 2.28)
        return False
    renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), a, None, b)


def replace_directory(new: str, target: str, backup: str) -> None:
    """Put the complete directory `new` (beside `target`, on its filesystem, its files fsynced) at `target`, then
    remove the old one. Where the kernel exchanges two paths, `target` is at every moment the whole old directory
    or the whole new one (after the exchange the old one sits at `new` until removed). Elsewhere, two renames:
    `target` -> `backup`, `new` -> `target`; between them `target` is missing and `backup` holds the old directory
    (a later run puts it back). The old directory is removed last: whoever finds it left over may remove it."""
    fsync_dir(new)
    parent = os.path.dirname(target) or "."
    if exchange_paths(new, target):
        fsync_dir(parent)
        shutil.rmtree(new, ignore_errors=True)  # the old directory, now under the new one's name
        return
    os.rename(target, backup)
    try:
        os.rename(new, target)
    except OSError:
        os.rename(backup, target)
        raise
    fsync_dir(parent)
    shutil.rmtree(backup, ignore_errors=True)
