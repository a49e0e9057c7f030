"""Byte layout of a moepack container, version 1: the header, the part header, the index schema, the region naming
rules and the striping rule of multi-part containers.

SPEC.md beside this file is the normative description; this module is its executable form. Only
format_spec/ knows byte offsets: the packer writes through writer.py, the runtime reads through reader.py.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import xxhash

from .errors import FormatError

MAGIC = b"MOEPACK\x00"
PART_MAGIC = b"MOEPART\x00"  # parts 1..P-1 of a multi-part container (SPEC.md section 9)
FORMAT_MAJOR = 1
FORMAT_MINOR = 0  # what a single-file container says: its bytes are exactly those of a 1.0 writer
FORMAT_MINOR_PARTS = 1  # the first minor with part files
BYTE_ORDER_MARK = 0x01020304  # reads back as this value only when both sides agree on little-endian
ALIGNMENT = 4096  # every region starts on, and is padded to, this boundary: O_DIRECT reads land in place
HEADER_SIZE = 4096
TENSOR_ALIGNMENT = 64  # tensors inside a region start on this boundary (vector loads, frombuffer views)
CODEC_ZSTD = 1
INDEX_CODECS = {CODEC_ZSTD: "zstd"}

# Largest index we'll decompress: caps the allocation an index length field can ask for.
MAX_INDEX_RAW_BYTES = 1 << 30

# magic, major, minor, byte-order mark, alignment, header size, file size, index offset, index length,
# index raw length, index codec, reserved, index xxh3
_HEADER_FIELDS = struct.Struct("<8sHHIIIQQQQIIQ")
_HEADER_HASH = struct.Struct("<Q")
HEADER_HASHED_BYTES = _HEADER_FIELDS.size  # the header's own xxh3 covers every field before it
HEADER_USED_BYTES = HEADER_HASHED_BYTES + _HEADER_HASH.size

# part magic, major, minor, byte-order mark, alignment, header size, file size, part number, part count,
# container index xxh3
_PART_HEADER_FIELDS = struct.Struct("<8sHHIIIQIIQ")
PART_HEADER_HASHED_BYTES = _PART_HEADER_FIELDS.size
PART_HEADER_USED_BYTES = PART_HEADER_HASHED_BYTES + _HEADER_HASH.size

MAX_PARTS = 256  # caps the file descriptors an index can make a reader open
DEFAULT_STRIPE_EXPERTS = 4  # the runtime's default bundle: one bundle per stripe, consecutive bundles on other parts

REGION_KINDS = ("global", "dense", "expert")
_BLOCK_NAME = re.compile(r"^(layers|mtp)\.(0|[1-9][0-9]{0,5})$")


# SPEC.md section 6.1: `P.tensor_scale`, an F32 scalar stored after `P.weight` in its region, multiplies it
TENSOR_SCALE_SUFFIX = ".tensor_scale"
# names of the tensors that scale a weight rather than being one (parameter counts leave them out)
SCALE_SUFFIXES = (".scale", TENSOR_SCALE_SUFFIX)


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


def xxh3_hex(data) -> str:
    return xxhash.xxh3_64_hexdigest(data)


@dataclass(frozen=True)
class Header:
    major: int
    minor: int
    alignment: int
    file_size: int
    index_offset: int
    index_length: int
    index_raw_length: int
    index_codec: int
    index_xxh3: int

    def pack(self) -> bytes:
        fields = _HEADER_FIELDS.pack(
            MAGIC, self.major, self.minor, BYTE_ORDER_MARK, self.alignment, HEADER_SIZE, self.file_size,
            self.index_offset, self.index_length, self.index_raw_length, self.index_codec, 0, self.index_xxh3,
        )
        own_hash = _HEADER_HASH.pack(xxhash.xxh3_64_intdigest(fields))
        return (fields + own_hash).ljust(HEADER_SIZE, b"\x00")

    @classmethod
    def unpack(cls, raw: bytes, actual_file_size: int) -> "Header":
        """Parse and check the header against the file it came from. Raises FormatError naming the bad field."""
        if len(raw) < HEADER_USED_BYTES or raw[:8] != MAGIC:
            if raw[:8] == PART_MAGIC and len(raw) >= PART_HEADER_USED_BYTES:
                part, count = _PART_HEADER_FIELDS.unpack_from(raw)[7:9]
                if not 1 <= part < count <= MAX_PARTS:
                    raise FormatError(f"a moepack part file whose header is damaged (it says part {part} of {count})")
                raise FormatError(f"this is part file {part} of {count} of a multi-part container, not its main file "
                                  f"(open the file without the .part{part} suffix)")
            if len(raw) >= 4 and raw[:4] == b"GGUF":
                raise FormatError("this is a GGUF file, not a moepack container")
            if raw[:8] in (MAGIC, PART_MAGIC):
                raise FormatError(f"truncated inside its header ({len(raw)} of {HEADER_SIZE} bytes)")
            raise FormatError("not a moepack container (bad magic)")
        if len(raw) < HEADER_SIZE:
            raise FormatError(f"file is truncated inside the header ({len(raw)} of {HEADER_SIZE} bytes)")
        (_, major, minor, bom, alignment, header_size, file_size, index_offset, index_length, index_raw_length,
         index_codec, reserved, index_xxh3) = _HEADER_FIELDS.unpack_from(raw)
        if bom != BYTE_ORDER_MARK:
            raise FormatError(f"header byte-order mark is {bom:#010x}, expected {BYTE_ORDER_MARK:#010x} (little-endian)")
        if major != FORMAT_MAJOR:
            raise FormatError(
                f"container format version {major}.{minor} is not supported: this moepack reads major version "
                f"{FORMAT_MAJOR} (upgrade moepack, or re-convert the checkpoint)"
            )
        (stored_hash,) = _HEADER_HASH.unpack_from(raw, HEADER_HASHED_BYTES)
        if xxhash.xxh3_64_intdigest(raw[:HEADER_HASHED_BYTES]) != stored_hash:
            raise FormatError("header checksum mismatch: the header is damaged")
        if any(raw[HEADER_USED_BYTES:HEADER_SIZE]):
            raise FormatError("header padding is not zero: the header is damaged")
        if alignment != ALIGNMENT or header_size != HEADER_SIZE or reserved != 0:
            raise FormatError(
                f"unsupported header geometry (alignment {alignment}, header size {header_size}, reserved {reserved})"
            )
        if file_size != actual_file_size:
            what = "truncated" if actual_file_size < file_size else "longer than recorded"
            raise FormatError(f"file is {what}: {actual_file_size} bytes on disk, header records {file_size}")
        if index_codec not in INDEX_CODECS:
            raise FormatError(f"unknown index codec {index_codec}")
        if index_offset % alignment or index_offset < HEADER_SIZE:
            raise FormatError(f"index offset {index_offset} is not an aligned position after the header")
        if index_length == 0 or index_offset + align_up(index_length, alignment) != file_size:
            raise FormatError(
                f"index [{index_offset}, +{index_length}) does not end the file (file size {file_size})"
            )
        if not 0 < index_raw_length <= MAX_INDEX_RAW_BYTES:
            raise FormatError(f"index raw length {index_raw_length} is out of range")
        return cls(major, minor, alignment, file_size, index_offset, index_length, index_raw_length, index_codec,
                   index_xxh3)


@dataclass(frozen=True)
class PartHeader:
    """The 4096-byte header of part file 1..P-1: which container (by its index xxh3) and which part it is."""

    part: int
    part_count: int
    file_size: int
    container_index_xxh3: int

    def pack(self) -> bytes:
        fields = _PART_HEADER_FIELDS.pack(
            PART_MAGIC, FORMAT_MAJOR, FORMAT_MINOR_PARTS, BYTE_ORDER_MARK, ALIGNMENT, HEADER_SIZE, self.file_size,
            self.part, self.part_count, self.container_index_xxh3,
        )
        own_hash = _HEADER_HASH.pack(xxhash.xxh3_64_intdigest(fields))
        return (fields + own_hash).ljust(HEADER_SIZE, b"\x00")

    @classmethod
    def unpack(cls, raw: bytes, actual_file_size: int, path: str, part: int, part_count: int,
               index_xxh3: int, main_path: str) -> "PartHeader":
        """Parse part `part`'s header and check it belongs to the container whose index hashes to `index_xxh3`.
        Raises FormatError naming the part file."""
        what = f"{path} (part {part} of {part_count})"
        if len(raw) < HEADER_SIZE:
            raise FormatError(f"{what}: part file is truncated inside its header ({len(raw)} of {HEADER_SIZE} bytes)")
        if raw[:8] != PART_MAGIC:
            raise FormatError(f"{what}: not a moepack part file (bad magic)")
        (_, major, minor, bom, alignment, header_size, file_size, got_part, got_count,
         got_index) = _PART_HEADER_FIELDS.unpack_from(raw)
        (stored_hash,) = _HEADER_HASH.unpack_from(raw, PART_HEADER_HASHED_BYTES)
        if xxhash.xxh3_64_intdigest(raw[:PART_HEADER_HASHED_BYTES]) != stored_hash:
            raise FormatError(f"{what}: part header checksum mismatch: the part header is damaged")
        if any(raw[PART_HEADER_USED_BYTES:HEADER_SIZE]):
            raise FormatError(f"{what}: part header padding is not zero: the part header is damaged")
        if (bom, alignment, header_size, major) != (BYTE_ORDER_MARK, ALIGNMENT, HEADER_SIZE, FORMAT_MAJOR):
            raise FormatError(f"{what}: unsupported part header (version {major}.{minor}, byte-order mark "
                              f"{bom:#010x}, alignment {alignment}, header size {header_size})")
        if got_index != index_xxh3:
            raise FormatError(f"{what}: belongs to another container or another conversion (its container index "
                              f"xxh3 is {got_index:016x}, {main_path}'s is {index_xxh3:016x})")
        if (got_part, got_count) != (part, part_count):
            raise FormatError(f"{what}: the file is part {got_part} of {got_count} (renamed?)")
        if file_size != actual_file_size:
            how = "truncated" if actual_file_size < file_size else "longer than recorded"
            raise FormatError(f"{what}: part file is {how}: {actual_file_size} bytes on disk, its header records "
                              f"{file_size}")
        return cls(got_part, got_count, file_size, got_index)


def part_path(path: str, part: int) -> str:
    """Where part `part` of the container at `path` lives: the main file itself, or `<path>.part<k>` beside it
    (which may be a symlink to another device)."""
    return path if part == 0 else f"{path}.part{part}"


def region_part(kind: str, block: str | None, expert: int | None, part_count: int, stripe_experts: int) -> int:
    """The striping rule: experts [k*S, (k+1)*S) of every `layers.N` block live in part k % P; everything else
    (globals, dense regions, mtp blocks, which prefill reads once or never) in part 0."""
    if part_count <= 1 or kind != "expert" or not isinstance(block, str) or not block.startswith("layers."):
        return 0
    return (expert // stripe_experts) % part_count


def region_name(kind: str, block: str | None = None, expert: int | None = None, tensor: str | None = None) -> str:
    """Canonical region names: `global.<tensor>`, `<block>.dense`, `<block>.experts.<E>`."""
    if kind == "global":
        return f"global.{tensor}"
    if kind == "dense":
        return f"{block}.dense"
    return f"{block}.experts.{expert}"


def parse_block_name(block: str) -> tuple[str, int]:
    """'layers.3' -> ('layers', 3); 'mtp.0' -> ('mtp', 0)."""
    m = _BLOCK_NAME.match(block) if isinstance(block, str) else None
    if not m:
        raise FormatError(f"bad block name {block!r} (expected 'layers.N' or 'mtp.N')")
    return m.group(1), int(m.group(2))


def layer_count_problem(config: dict, layer_blocks: int) -> str | None:
    """Why a config and a container's `layers.N` blocks disagree on the number of layers (None: they agree, or
    the config does not say). The reader refuses such a container; the writer and the converter refuse to make one."""
    n_layers = config.get("num_hidden_layers")
    if isinstance(n_layers, int) and n_layers != layer_blocks:
        return f"config has {n_layers} layers but the container holds {layer_blocks}"
    return None
