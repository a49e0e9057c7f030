"""Opens a container, validates everything that is cheap to validate, and gives the runtime its read plan.

Opening always checks: the header (magic, version, byte order, geometry, its own checksum, the recorded file size
against the real one), the index (checksum, size, JSON schema), that the regions tile the file exactly in read order
with aligned offsets, and that every tensor lies inside its region with exactly the byte length its type and shape
need. A multi-part container (SPEC.md section 9) also has every part file opened and its header, identity and size
checked, and each part's regions tile that part. `verify()` additionally reads every byte and checks every checksum
and every padding byte.
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass, field

import xxhash
import zstandard

from .dtypes import STORAGE_TYPES, tensor_nbytes
from .errors import FormatError
from . import untrusted
from .files import open_regular
from .layout import (
    TENSOR_SCALE_SUFFIX, ALIGNMENT, FORMAT_MINOR_PARTS, HEADER_SIZE, MAX_PARTS, REGION_KINDS, TENSOR_ALIGNMENT, Header, PartHeader,
    layer_count_problem, parse_block_name, part_path, region_name, region_part,
)


@dataclass
class Region:
    index: int
    name: str
    kind: str
    block: str | None
    expert: int | None
    offset: int
    length: int
    xxh3: str
    tensors: list["TensorEntry"] = field(default_factory=list)
    part: int = 0  # the part file holding it; `offset` is inside that file

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class ReadSpan:
    """One contiguous, aligned read: [offset, offset + length) of part file `part`."""

    part: int
    offset: int
    length: int


@dataclass
class TensorEntry:
    name: str
    region: Region
    offset: int  # inside the region
    length: int
    dtype: str
    shape: tuple[int, ...]
    xxh3: str

    @property
    def file_offset(self) -> int:
        return self.region.offset + self.offset

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class Block:
    """One transformer block (`layers.N`, or `mtp.N`): its dense region and its experts in ID order."""

    name: str
    section: str
    number: int
    dense: Region
    experts: list[Region]

    def expert_read(self, first: int, count: int) -> ReadSpan:
        """The one read that fetches experts first..first+count-1. They must lie in one part file, back to back
        (always so in a single-file container; in a multi-part one, within a stripe: see `split_runs`)."""
        if count < 1 or first < 0 or first + count > len(self.experts):
            raise IndexError(f"{self.name}: experts {first}..{first + count - 1} out of 0..{len(self.experts) - 1}")
        run = self.experts[first:first + count]
        for prev, cur in zip(run, run[1:]):
            if cur.part != prev.part or cur.offset != prev.end:
                raise FormatError(f"{self.name}: experts {first}..{first + count - 1} are not one read (expert "
                                  f"{cur.expert} is in part {cur.part}, not right after expert {prev.expert} in part "
                                  f"{prev.part}): split the run with Block.split_runs")
        return ReadSpan(run[0].part, run[0].offset, run[-1].end - run[0].offset)

    def expert_span(self, first: int, count: int) -> tuple[int, int]:
        """(offset, length) in the main file of experts first..first+count-1: one contiguous, aligned read. Refuses
        experts stored in another part file (use `expert_read`, which names the part)."""
        span = self.expert_read(first, count)
        if span.part != 0:
            raise FormatError(f"{self.name}: experts {first}..{first + count - 1} are in part file {span.part}, not "
                              f"the main file: use Block.expert_read")
        return span.offset, span.length

    def split_runs(self, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Cut (first, count) runs of experts wherever the next expert is not stored right after the previous one
        (a stripe boundary: another part file), so each piece is one `expert_read`."""
        pieces: list[tuple[int, int]] = []
        for first, count in runs:
            start = first
            for e in range(first + 1, first + count):
                prev, cur = self.experts[e - 1], self.experts[e]
                if cur.part != prev.part or cur.offset != prev.end:
                    pieces.append((start, e - start))
                    start = e
            pieces.append((start, first + count - start))
        return pieces

    @property
    def experts_span(self) -> tuple[int, int]:
        return self.expert_span(0, len(self.experts)) if self.experts else (self.dense.end, 0)


def _fail(msg: str):
    raise FormatError(msg)


TOKENIZER_ENCODINGS = ("utf-8", "base64")


def validate_tokenizer_files(files: dict) -> None:
    """The index's embedded tokenizer files (SPEC: file name -> {"encoding": "utf-8" | "base64", "data": string}):
    each a plain file name whose bytes decode, so what reads them (the tokenizer, the exports) meets no other form."""
    for name, entry in files.items():
        if name in ("", ".", "..") or os.path.basename(name) != name:
            _fail(f"index tokenizer file name {name!r} is not a plain file name")
        if not (isinstance(entry, dict) and entry.get("encoding") in TOKENIZER_ENCODINGS
                and isinstance(entry.get("data"), str)):
            _fail(f"index tokenizer file {name!r} is not an object of an encoding ('utf-8' or 'base64') and a data "
                  f"string")
        if entry["encoding"] == "base64":
            try:
                base64.b64decode(entry["data"], validate=True)
            except (binascii.Error, ValueError) as e:
                _fail(f"index tokenizer file {name!r}: its data is not base64 ({e})")


def tokenizer_file_bytes(entry: dict) -> bytes:
    """An index tokenizer entry's bytes (validate_tokenizer_files checked its form)."""
    return entry["data"].encode() if entry["encoding"] == "utf-8" else base64.b64decode(entry["data"])


def _decompress_index(stored: bytes, raw_length: int) -> bytes:
    """The index frame's output, at most raw_length + 1 bytes, read in steps: memory follows what the frame really
    produces, never a size the header or the frame merely claims."""
    out = bytearray()
    with zstandard.ZstdDecompressor().stream_reader(stored) as reader:
        while len(out) <= raw_length:
            chunk = reader.read(min(1 << 20, raw_length + 1 - len(out)))
            if not chunk:
                break
            out += chunk
    return bytes(out)


def _check_hex(value, what: str) -> str:
    if not (isinstance(value, str) and len(value) == 16 and all(c in "0123456789abcdef" for c in value)):
        _fail(f"{what}: xxh3 must be 16 lowercase hex digits")
    return value


def _check_int(value, what: str, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        _fail(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_tensor_scales(tensors: dict) -> None:
    for t in tensors.values():
        if not t.name.endswith(TENSOR_SCALE_SUFFIX):
            continue
        weight = tensors.get(t.name[: -len(TENSOR_SCALE_SUFFIX)] + ".weight")
        if weight is None or weight.region is not t.region or weight.offset > t.offset:
            _fail(f"tensor {t.name}: a tensor scale must come after its weight, in the weight's region")
        if t.dtype != "F32" or t.shape != ():
            _fail(f"tensor {t.name}: a tensor scale must be an F32 scalar (shape []), got {t.dtype}{list(t.shape)}")


class Container:
    """A validated, open container: its main file and, for a multi-part container, its part files. Cheap to open
    (reads the headers and the index only)."""

    def __init__(self, path: str):
        self.path = path
        self.part_count = 1
        self.stripe_experts: int | None = None
        self.part_paths = [path]  # part k's path; part 0 is the main file
        self.part_sizes: list[int] = []
        self._fd = _open_file(path, f"{path}: no such file")
        self._fds = [self._fd]
        try:
            self._load()
        except BaseException:
            self.close()
            raise

    # --- opening and validation ----------------------------------------------------------------------------------
    def _load(self) -> None:
        size = os.fstat(self._fd).st_size
        self.file_size = size
        self.header = Header.unpack(os.pread(self._fd, HEADER_SIZE, 0), size)
        h = self.header
        stored = os.pread(self._fd, h.index_length, h.index_offset)
        if len(stored) != h.index_length:
            _fail("index is truncated")
        if xxhash.xxh3_64_intdigest(stored) != h.index_xxh3:
            _fail("index checksum mismatch: the index is damaged")
        if any(os.pread(self._fd, h.file_size - h.index_offset - h.index_length, h.index_offset + h.index_length)):
            _fail("index padding is not zero")
        try:
            raw = _decompress_index(stored, h.index_raw_length)
        except zstandard.ZstdError as e:
            raise FormatError(f"index does not decompress: {e}") from None
        if len(raw) != h.index_raw_length:
            _fail(f"index decompresses to {len(raw)} bytes, header records {h.index_raw_length}")
        try:  # the header's recorded length bounds its size; depth, numbers and text are bounded here
            index = untrusted.loads(raw, "index", max_bytes=len(raw))
        except untrusted.UntrustedInputError as e:
            raise FormatError(f"index is not valid JSON: {e.detail}") from None
        self.index = index
        self._validate_index(index)

    def _validate_index(self, index) -> None:
        if not isinstance(index, dict):
            _fail("index must be a JSON object")
        if index.get("format") != "moepack":
            _fail("index 'format' is not 'moepack'")
        version = index.get("format_version")
        if version != [self.header.major, self.header.minor]:
            _fail(f"index format_version {version!r} disagrees with the header's "
                  f"{self.header.major}.{self.header.minor}")
        for key, typ in (("architecture", str), ("config", dict), ("policy", dict), ("tokenizer", dict),
                         ("provenance", dict), ("extra", dict), ("regions", list), ("tensors", list)):
            if not isinstance(index.get(key), typ):
                _fail(f"index field {key!r} is missing or not a {typ.__name__}")
        self.config: dict = index["config"]
        self.architecture: str = index["architecture"]
        self.policy: dict = index["policy"]
        validate_tokenizer_files(index["tokenizer"])
        self._validate_parts(index.get("parts"))
        self.regions = self._validate_regions(index["regions"])
        self._open_parts()
        self.blocks = self._group_blocks()
        self.tensors = self._validate_tensors(index["tensors"])
        problem = layer_count_problem(self.config, sum(1 for b in self.blocks if b.section == "layers"))
        if problem:
            _fail(problem)

    def _validate_parts(self, parts) -> None:
        """The optional `parts` key (format 1.1): how many part files and the stripe of the striping rule."""
        if parts is None:
            return
        if not isinstance(parts, dict):
            _fail("index field 'parts' must be an object")
        if self.header.minor < FORMAT_MINOR_PARTS:
            _fail(f"index has 'parts' but the header says format {self.header.major}.{self.header.minor} "
                  f"(part files need {self.header.major}.{FORMAT_MINOR_PARTS})")
        count = _check_int(parts.get("count"), "parts count", 2)
        if count > MAX_PARTS:
            _fail(f"parts count {count} is above the limit of {MAX_PARTS}")
        self.part_count = count
        self.stripe_experts = _check_int(parts.get("stripe_experts"), "parts stripe_experts", 1)
        self.part_paths = [part_path(self.path, k) for k in range(count)]

    def _validate_regions(self, entries: list) -> list[Region]:
        regions: list[Region] = []
        names: set[str] = set()
        part_ends = [HEADER_SIZE] * self.part_count  # where each part's next region must start
        for i, e in enumerate(entries):
            if not isinstance(e, dict):
                _fail(f"region #{i} is not an object")
            name = e.get("name")
            if not isinstance(name, str):
                _fail(f"region #{i}: name must be a string")
            what = f"region #{i} ({name!r})"
            kind = e.get("kind")
            if not isinstance(kind, str) or kind not in REGION_KINDS:
                _fail(f"{what}: unknown kind {kind!r}")
            block, expert = e.get("block"), e.get("expert")
            if kind == "global":
                if block is not None or expert is not None or not isinstance(name, str) or not name.startswith("global."):
                    _fail(f"{what}: a global region has no block/expert and is named 'global.<tensor>'")
            else:
                parse_block_name(block)
                if kind == "expert":
                    _check_int(expert, f"{what} expert")
                elif expert is not None:
                    _fail(f"{what}: a dense region has no expert number")
                if name != region_name(kind, block, expert):
                    _fail(f"{what}: name should be {region_name(kind, block, expert)!r}")
            if name in names:
                _fail(f"{what}: duplicate region name")
            names.add(name)
            part = _check_int(e.get("part", 0), f"{what} part")
            if part >= self.part_count:
                _fail(f"{what}: part {part} does not exist (the container has {self.part_count} part file(s))")
            rule = region_part(kind, block, expert, self.part_count, self.stripe_experts or 1)
            if part != rule:
                _fail(f"{what}: stored in part {part}, but the striping rule puts it in part {rule}")
            in_part = f" of part {part}" if part else ""
            offset = _check_int(e.get("offset"), f"{what} offset")
            length = _check_int(e.get("length"), f"{what} length", 1)
            if offset % ALIGNMENT or length % ALIGNMENT:
                _fail(f"{what}: offset {offset} / length {length} not aligned to {ALIGNMENT}")
            expected_offset = part_ends[part]
            if offset != expected_offset:
                how = "overlaps the previous region" if offset < expected_offset else "leaves a gap after the previous region"
                _fail(f"{what}: starts at {offset}{in_part}, {how} (which ends at {expected_offset})")
            if part == 0 and offset + length > self.header.index_offset:
                _fail(f"{what}: [{offset}, {offset + length}) runs past the end of the data section "
                      f"({self.header.index_offset})")
            part_ends[part] = offset + length
            regions.append(Region(i, name, kind, block, expert, offset, length, _check_hex(e.get("xxh3"), what),
                                  part=part))
        if part_ends[0] != self.header.index_offset:
            _fail(f"regions end at {part_ends[0]} but the index starts at {self.header.index_offset}")
        self.part_sizes = [self.file_size] + part_ends[1:]  # a part file is its header and its regions, tiled
        return regions

    def _open_parts(self) -> None:
        """Open part files 1..P-1 and check each one's header (which container, which part) and size."""
        for k in range(1, self.part_count):
            path = self.part_paths[k]
            fd = _open_file(path, f"{path}: part {k} of {self.part_count} of {self.path} is missing")
            self._fds.append(fd)
            size = os.fstat(fd).st_size
            PartHeader.unpack(os.pread(fd, HEADER_SIZE, 0), size, path, k, self.part_count, self.header.index_xxh3,
                              self.path)
            if size != self.part_sizes[k]:
                _fail(f"{path} (part {k} of {self.part_count}): {size} bytes, but its regions in the index end at "
                      f"{self.part_sizes[k]}")

    def _group_blocks(self) -> list[Block]:
        blocks: list[Block] = []
        seen_block = False
        for r in self.regions:
            if r.kind == "global":
                if seen_block:
                    _fail(f"region {r.name}: global regions must come before every layer")
                continue
            seen_block = True
            if r.kind == "dense":
                if any(b.name == r.block for b in blocks):
                    _fail(f"region {r.name}: block {r.block} appears twice")
                section, number = parse_block_name(r.block)
                blocks.append(Block(r.block, section, number, r, []))
                continue
            current = blocks[-1] if blocks else None
            if current is None or current.name != r.block:
                _fail(f"region {r.name}: experts must follow their block's dense region")
            if r.expert != len(current.experts):
                _fail(f"region {r.name}: experts must be stored in ID order (expected expert {len(current.experts)})")
            current.experts.append(r)
        for section in ("layers", "mtp"):
            numbers = [b.number for b in blocks if b.section == section]
            if numbers != list(range(len(numbers))):
                _fail(f"{section} blocks must be numbered 0..{len(numbers) - 1} in order, found {numbers}")
        sections = [b.section for b in blocks]
        if sections != sorted(sections, key=lambda s: s == "mtp"):
            _fail("mtp blocks must come after every layer")
        return blocks

    def _validate_tensors(self, entries: list) -> dict[str, TensorEntry]:
        tensors: dict[str, TensorEntry] = {}
        for i, e in enumerate(entries):
            if not isinstance(e, dict):
                _fail(f"tensor #{i} is not an object")
            name = e.get("name")
            if not isinstance(name, str) or not name:
                _fail(f"tensor #{i}: missing name")
            what = f"tensor {name}"
            if name in tensors:
                _fail(f"{what}: listed twice")
            ri = e.get("region")
            if not isinstance(ri, int) or isinstance(ri, bool) or not 0 <= ri < len(self.regions):
                _fail(f"{what}: region {ri!r} does not exist")
            region = self.regions[ri]
            dtype = e.get("dtype")
            if not isinstance(dtype, str) or dtype not in STORAGE_TYPES:
                _fail(f"{what}: unknown storage type {dtype!r}")
            shape = e.get("shape")
            if not isinstance(shape, list) or len(shape) > 8:
                _fail(f"{what}: shape must be a list of at most 8 dimensions")
            offset = _check_int(e.get("offset"), f"{what} offset")
            length = _check_int(e.get("length"), f"{what} length")
            try:
                need = tensor_nbytes(dtype, shape)
            except FormatError as err:
                raise FormatError(f"{what}: {err}") from None
            if length != need:
                _fail(f"{what}: {length} bytes recorded, but {dtype}{shape} needs exactly {need}")
            if offset % TENSOR_ALIGNMENT:
                _fail(f"{what}: offset {offset} inside its region is not aligned to {TENSOR_ALIGNMENT}")
            if offset + length > region.length:
                _fail(f"{what}: [{offset}, {offset + length}) runs past the end of region {region.name} "
                      f"({region.length} bytes)")
            t = TensorEntry(name, region, offset, length, dtype, tuple(shape), _check_hex(e.get("xxh3"), what))
            tensors[name] = t
            region.tensors.append(t)
        for region in self.regions:
            region.tensors.sort(key=lambda t: t.offset)
            end = 0
            for t in region.tensors:
                if t.offset < end:
                    _fail(f"tensor {t.name} overlaps the previous tensor in region {region.name}")
                end = t.offset + t.length
        _check_tensor_scales(tensors)
        return tensors

    # --- the embedded tokenizer files -----------------------------------------------------------------------------
    def tokenizer_text(self, name: str) -> str | None:
        """An embedded tokenizer file's text (tokenizer_config.json, generation_config.json, ...), or None where the
        container has none (or holds it as bytes)."""
        entry = (self.index.get("tokenizer") or {}).get(name)
        return entry["data"] if isinstance(entry, dict) and entry.get("encoding") == "utf-8" else None

    def tokenizer_files(self) -> dict[str, bytes]:
        """Every embedded tokenizer file's bytes, by its (plain) file name."""
        return {name: tokenizer_file_bytes(entry) for name, entry in self.index["tokenizer"].items()}

    def tokenizer_json(self, name: str) -> dict:
        """An embedded optional JSON file of the tokenizer's as a dict: {} where it is absent or damaged."""
        text = self.tokenizer_text(name)
        if text is None:
            return {}
        try:
            value = untrusted.loads(text, name)
        except untrusted.UntrustedInputError:
            return {}
        return value if isinstance(value, dict) else {}

    # --- navigation ----------------------------------------------------------------------------------------------
    @property
    def layers(self) -> list[Block]:
        return [b for b in self.blocks if b.section == "layers"]

    def layer(self, number: int) -> Block:
        layers = self.layers
        if not 0 <= number < len(layers):
            raise IndexError(f"layer {number} out of range 0..{len(layers) - 1}")
        return layers[number]

    @property
    def global_regions(self) -> list[Region]:
        return [r for r in self.regions if r.kind == "global"]

    @property
    def data_bytes(self) -> int:
        """Bytes of all regions, in every part file."""
        return self.header.index_offset - HEADER_SIZE + sum(size - HEADER_SIZE for size in self.part_sizes[1:])

    @property
    def total_bytes(self) -> int:
        """Size of the main file and every part file together."""
        return sum(self.part_sizes)

    def parts_summary(self) -> list[dict]:
        """Per file of the container (the main file first): its path, size, regions and expert bytes."""
        return [{"part": k, "path": self.part_paths[k], "bytes": self.part_sizes[k],
                 "regions": sum(1 for r in self.regions if r.part == k),
                 "expert_bytes": sum(r.length for r in self.regions if r.part == k and r.kind == "expert")}
                for k in range(self.part_count)]

    def describe(self, region: Region) -> str:
        """The region's name, and for a region outside the main file the part file holding it (for messages)."""
        return region.name if region.part == 0 else f"{region.name} (in {self.part_paths[region.part]})"

    # --- reading -------------------------------------------------------------------------------------------------
    def pread(self, offset: int, length: int, part: int = 0) -> bytes:
        """Bytes [offset, offset + length) of the main file, or of part file `part`."""
        data = os.pread(self._fds[part], length, offset)
        if len(data) != length:
            raise FormatError(f"{self.part_paths[part]}: short read at {offset} (+{length}): the file is truncated")
        return data

    def pread_into(self, out: memoryview, offset: int, part: int = 0) -> None:
        """Fill `out` (a writable buffer) with the bytes from `offset` of the main file or of part file `part`."""
        done = 0
        while done < len(out):
            n = os.preadv(self._fds[part], [out[done:]], offset + done)
            if n == 0:
                raise FormatError(f"{self.part_paths[part]}: short read at {offset + done}: the file is truncated")
            done += n

    def tensor_bytes(self, name: str, check: bool = True) -> bytes:
        """The tensor's stored bytes; FormatError where they fail its checksum (`check`), so that no copy of a
        damaged tensor (an export) goes out as if whole."""
        t = self.tensor_entry(name)
        data = self.pread(t.file_offset, t.length, t.region.part)
        if check and xxhash.xxh3_64_hexdigest(data) != t.xxh3:
            raise FormatError(f"tensor {name}: checksum mismatch (region {t.region.name} is damaged)")
        return data

    def tensor_entry(self, name: str) -> TensorEntry:
        try:
            return self.tensors[name]
        except KeyError:
            raise FormatError(f"{self.path}: no tensor named {name!r}") from None

    def read_tensor(self, name: str, check: bool = True):
        """The tensor as torch (plain types in their own dtype; block types dequantized to float32)."""
        t = self.tensor_entry(name)
        data = self.tensor_bytes(name, check)
        from .decode import decode_tensor

        return decode_tensor(t.dtype, t.shape, data)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        self._fd = -1

    def fileno(self, part: int = 0) -> int:
        return self._fds[part]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_container(path: str) -> Container:
    return Container(path)


def _open_file(path: str, missing: str) -> int:
    return open_regular(path, missing)
