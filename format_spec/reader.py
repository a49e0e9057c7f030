"""Opens a container, validates everything that is cheap to validate, and gives the runtime its read plan.

Opening always checks: the header (magic, version, byte order, geometry, its own checksum, the recorded file size
against the real one), the index (checksum, size, JSON schema), that the regions tile the file exactly in read order
with aligned offsets, and that every tensor lies inside its region with exactly the byte length its type and shape
need. `verify()` additionally reads every byte and checks every checksum and every padding byte.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import xxhash
import zstandard

from .dtypes import STORAGE_TYPES, tensor_nbytes
from .errors import FormatError
from .layout import (
    ALIGNMENT, HEADER_SIZE, REGION_KINDS, TENSOR_ALIGNMENT, Header, parse_block_name, region_name,
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

    @property
    def end(self) -> int:
        return self.offset + self.length


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

    def expert_span(self, first: int, count: int) -> tuple[int, int]:
        """(file offset, length) of experts first..first+count-1: one contiguous, aligned read."""
        if count < 1 or first < 0 or first + count > len(self.experts):
            raise IndexError(f"{self.name}: experts {first}..{first + count - 1} out of 0..{len(self.experts) - 1}")
        start = self.experts[first].offset
        return start, self.experts[first + count - 1].end - start

    @property
    def experts_span(self) -> tuple[int, int]:
        return self.expert_span(0, len(self.experts)) if self.experts else (self.dense.end, 0)


def _fail(msg: str):
    raise FormatError(msg)


def _check_hex(value, what: str) -> str:
    if not (isinstance(value, str) and len(value) == 16 and all(c in "0123456789abcdef" for c in value)):
        _fail(f"{what}: xxh3 must be 16 lowercase hex digits")
    return value


def _check_int(value, what: str, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        _fail(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


class Container:
    """A validated, open container. Cheap to open (reads the header and the index only)."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise FormatError(f"{path}: no such file") from None
        except OSError as e:
            raise FormatError(f"{path}: cannot open ({e.strerror})") from None
        try:
            self._load()
        except BaseException:
            os.close(self._fd)
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
            raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=h.index_raw_length)
        except zstandard.ZstdError as e:
            raise FormatError(f"index does not decompress: {e}") from None
        if len(raw) != h.index_raw_length:
            _fail(f"index decompresses to {len(raw)} bytes, header records {h.index_raw_length}")
        try:
            index = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FormatError(f"index is not valid JSON: {e}") from None
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
        self.regions = self._validate_regions(index["regions"])
        self.blocks = self._group_blocks()
        self.tensors = self._validate_tensors(index["tensors"])
        n_layers = self.config.get("num_hidden_layers")
        n_blocks = sum(1 for b in self.blocks if b.section == "layers")
        if isinstance(n_layers, int) and n_layers != n_blocks:
            _fail(f"config has {n_layers} layers but the container holds {n_blocks}")

    def _validate_regions(self, entries: list) -> list[Region]:
        regions: list[Region] = []
        names: set[str] = set()
        expected_offset = HEADER_SIZE
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
            offset = _check_int(e.get("offset"), f"{what} offset")
            length = _check_int(e.get("length"), f"{what} length", 1)
            if offset % ALIGNMENT or length % ALIGNMENT:
                _fail(f"{what}: offset {offset} / length {length} not aligned to {ALIGNMENT}")
            if offset != expected_offset:
                how = "overlaps the previous region" if offset < expected_offset else "leaves a gap after the previous region"
                _fail(f"{what}: starts at {offset}, {how} (which ends at {expected_offset})")
            if offset + length > self.header.index_offset:
                _fail(f"{what}: [{offset}, {offset + length}) runs past the end of the data section "
                      f"({self.header.index_offset})")
            expected_offset = offset + length
            regions.append(Region(i, name, kind, block, expert, offset, length, _check_hex(e.get("xxh3"), what)))
        if expected_offset != self.header.index_offset:
            _fail(f"regions end at {expected_offset} but the index starts at {self.header.index_offset}")
        return regions

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
        return tensors

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
        return self.header.index_offset - HEADER_SIZE

    # --- reading -------------------------------------------------------------------------------------------------
    def pread(self, offset: int, length: int) -> bytes:
        data = os.pread(self._fd, length, offset)
        if len(data) != length:
            raise FormatError(f"{self.path}: short read at {offset} (+{length}): the file is truncated")
        return data

    def tensor_bytes(self, name: str) -> bytes:
        t = self.tensor_entry(name)
        return self.pread(t.file_offset, t.length)

    def tensor_entry(self, name: str) -> TensorEntry:
        try:
            return self.tensors[name]
        except KeyError:
            raise FormatError(f"{self.path}: no tensor named {name!r}") from None

    def read_tensor(self, name: str, check: bool = True):
        """The tensor as torch (plain types in their own dtype; block types dequantized to float32)."""
        t = self.tensor_entry(name)
        data = self.tensor_bytes(name)
        if check and xxhash.xxh3_64_hexdigest(data) != t.xxh3:
            raise FormatError(f"tensor {name}: checksum mismatch (region {t.region.name} is damaged)")
        from .decode import decode_tensor

        return decode_tensor(t.dtype, t.shape, data)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def fileno(self) -> int:
        return self._fd

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_container(path: str) -> Container:
    return Container(path)
