"""Mutations of fuzz inputs: blind byte-level ones, and structure-aware ones that decode a part (the container's
header or zstd-JSON index, a KV manifest, a safetensors layer file), change it, and re-encode it with every
checksum and length that guards it recomputed, so the change reaches the validation behind those guards.

Container mutations: bit flips, byte sets, truncation, extension, insertion/deletion, splices with another input;
a header field set to an interesting value (header checksum recomputed, file resized to match when it is
file_size); the index decoded, its JSON mutated (numbers huge / negative / float / strings, keys dropped or
duplicated, entries swapped, copied from a sibling or another container) and re-encoded with a correct index
xxh3 (optionally with tensor lengths made to agree with their new shapes, zstd frames without a content size,
a wrong raw length, trailing bytes); tensor bytes replaced with the tensor and region xxh3 recomputed (so decoders
see hostile data behind valid checksums); a region grown or shrunk by one page with the tiling kept.

KV mutations: the manifest's JSON mutated the same way, then (each by chance) its config_xxh3, token count and
ids_xxh3, geometry and the layer files' bytes/xxh3 recomputed; a layer file's safetensors header mutated (and by
chance made self-consistent again: offsets and data sized to the new shapes and dtypes); raw bytes of one file
(with its manifest hash fixed by chance); files deleted, duplicated, swapped or taken from another KV.

Checkpoint mutations (a Hugging Face directory): a shard's safetensors header (its JSON as above; one tensor's
dtype, shape or data_offsets edited; the length field nudged), a shard cut inside a tensor's data, config.json's
and the tokenizer files' JSON mutated, the index's weight_map pointing a tensor to another or a missing shard, raw
bytes, files deleted, swapped or added. GGUF mutations: a structural number (version, tensor and key counts, a
key's value type, a string or array length, an array's item type, a scalar value, a tensor's dimension count,
dimensions, ggml type or data offset) set to an interesting value in place, raw bytes and truncation, split files
deleted, swapped, duplicated or added.
"""

from __future__ import annotations

import copy
import json
import random
import re
import struct

import xxhash
import zstandard

from corpus import BUNDLE_MAGIC, MAIN_MEMBER, pack_bundle, unpack_bundle

from moepack.families.deepseek_v4.config import LAYER_TYPES
from moepack.families.deepseek_v4.kv import KV_DTYPES, MANIFEST_NAME, config_xxh3, kv_geometry, token_ids_xxh3
from moepack.format_spec.dtypes import STORAGE_TYPES, tensor_nbytes
from moepack.format_spec.layout import (
    _HEADER_FIELDS, _PART_HEADER_FIELDS, ALIGNMENT, HEADER_HASHED_BYTES, HEADER_SIZE, PART_HEADER_HASHED_BYTES,
    align_up,
)

INTERESTING_INTS = [0, 1, -1, 2, 3, 7, 63, 64, 65, 255, 256, 4095, 4096, 4097, 65535, 2**31 - 1, 2**31, 2**32 - 1,
                    2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -2**63, 10**30, -10**30]
INTERESTING_FLOATS = [0.0, -0.0, 0.5, 1.5, 4096.0, 1e308, -1e308, 2.0**64]
INTERESTING_STRINGS = ["", "x", "0", "-1", "1e3", "global.", "global.x", "layers.0", "layers.99", "layers.01",
                       "layers.-1", "mtp.0", "mtp.1", "global", "dense", "expert", "moepack", "moepack-kv",
                       "0123456789abcdef", "0123456789ABCDEF", "../../etc/passwd", "\u0000", "\udcff", "é" * 3,
                       "a" * 300, "layer-0000.safetensors", "logits.safetensors", "manifest.json", *STORAGE_TYPES,
                       *LAYER_TYPES, *KV_DTYPES]
# Number literals and structures json.loads accepts but a Python value can't express through json.dumps, or that
# are costly to parse: written verbatim into the JSON text.
RAW_LITERALS = ["NaN", "Infinity", "-Infinity", "1e999", "-0", "1" + "0" * 5000, "1" * 4301, "1.0e-400",
                "123456789012345678901234567890.5", "3.0", "1e2",
                *("[" * depth + "]" * depth for depth in (900, 980, 3000)),  # near and past the recursion limit
                *('{"a":' * depth + "0" + "}" * depth for depth in (900, 980, 3000))]
WHOLE_TEXTS = [b"", b"[]", b"{}", b"null", b"1", b'"x"', b"\xff\xfe\xfd", b"{" * 100000, b"[" * 100000,
               b'{"format": "moepack"}', b'{"format": "moepack-kv", "format_version": [1, 0]}', b"\x00" * 64]

# A source input (checkpoint directory, GGUF) is converted whole: beyond this a mutant is not tried (an input must
# take well under a second).
MAX_INPUT_BYTES = {"checkpoint": 8 << 20, "gguf": 8 << 20}
_MAX_SOURCE_TENSOR_BYTES = 1 << 20
_DUP = "\u0000dup\u0000"  # a dict key starting with this is written as the key after it: a duplicate key
_FILE_SIZE_FIELD = 6  # in both header layouts
_PART_INDEX_XXH3_FIELD = 9
_SAFETENSORS_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                            "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


class Raw:
    """A piece of JSON text inserted verbatim."""

    def __init__(self, text: str):
        self.text = text


def dumps(value) -> bytes:
    """json.dumps that also writes Raw text and duplicate keys."""
    raws: list[str] = []

    def default(o):
        if isinstance(o, Raw):
            raws.append(o.text)
            return f"\u0000raw{len(raws) - 1}\u0000"
        raise TypeError(type(o).__name__)

    text = json.dumps(value, default=default)
    text = re.sub(r'"\\u0000raw(\d+)\\u0000"', lambda m: raws[int(m.group(1))], text)
    return text.replace('"\\u0000dup\\u0000', '"').encode()


def _mask(value: int, width: int) -> int:
    return value % (1 << (8 * width))


def _field_widths(layout: struct.Struct) -> list[int]:
    """Byte width of each field of a header layout ('<8sHHI...': 8, 2, 2, 4, ...)."""
    return [int(count or 1) if code == "s" else struct.calcsize("<" + code)
            for count, code in re.findall(r"(\d*)([a-zA-Z])", layout.format.lstrip("<"))]


class Mutator:
    """`donor(target)` gives another corpus input of that target (for splices)."""

    def __init__(self, rng: random.Random, donor):
        self.rng = rng
        self.donor = donor

    def mutate(self, target: str, data: bytes) -> bytes:
        mutate = {"container": self._mutate_container, "kv": self._mutate_kv, "checkpoint": self._mutate_checkpoint,
                  "gguf": self._mutate_gguf}[target]
        for _ in range(8):  # a structure-aware mutation that finds no structure to work on falls through
            try:
                out = mutate(data)
            except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError, OverflowError,
                    struct.error, zstandard.ZstdError):
                out = None  # the input has no such structure (anymore): try another mutation
            if out is not None and out != data and len(out) <= MAX_INPUT_BYTES.get(target, len(out)):
                return out
        return self.raw(data, self.donor(target))

    # --- bytes -------------------------------------------------------------------------------------------------
    def raw(self, data: bytes, splice_with: bytes | None = None) -> bytes:
        """Blind byte edits; `splice_with` is the input a splice takes its other part from."""
        r = self.rng
        buf = bytearray(data)
        for _ in range(r.choice([1, 1, 1, 2, 3, 8])):
            op = r.randrange(7)
            pos = self._position(len(buf))
            if op == 0 and buf:
                buf[pos] ^= 1 << r.randrange(8)
            elif op == 1 and buf:
                buf[pos] = r.choice([0, 1, 0x7F, 0x80, 0xFF, r.randrange(256)])
            elif op == 2 and buf:
                del buf[r.choice([pos, pos - pos % ALIGNMENT, max(pos - pos % ALIGNMENT - 1, 0)]):]
            elif op == 3:
                buf += bytes(r.choice([1, 7, 64, 4096])) if r.random() < 0.5 else r.randbytes(r.randrange(1, 5000))
            elif op == 4:
                buf[pos:pos] = r.randbytes(r.choice([1, 4, 8, 4096]))
            elif op == 5 and buf:
                del buf[pos:pos + r.choice([1, 4, 8, 4096])]
            elif op == 6 and splice_with and buf:
                cut = r.choice([r.randrange(len(buf)), HEADER_SIZE, min(len(buf), len(splice_with)) // 2])
                buf = buf[:cut] + splice_with[cut:] if r.random() < 0.7 else bytearray(splice_with[:cut]) + buf[cut:]
        return bytes(buf)

    def _position(self, size: int) -> int:
        """Anywhere, but often in the first page (the header) or the last ones (the index)."""
        if size == 0:
            return 0
        where = self.rng.random()
        if where < 0.3:
            return self.rng.randrange(min(size, 128))
        if where < 0.55:
            return self.rng.randrange(max(size - 2 * ALIGNMENT, 0), size)
        return self.rng.randrange(size)

    # --- JSON --------------------------------------------------------------------------------------------------
    def interesting(self, like=None):
        r = self.rng
        kind = r.randrange(9)
        if kind == 0 and isinstance(like, str):  # a near name: another companion suffix, one character off
            stem = like.rsplit(".", 1)[0]
            return r.choice([stem + ".scale", stem + ".tensor_scale", stem + ".weight", like[:-1], like + "0",
                             like.upper(), like + like])
        if kind == 0 and isinstance(like, int) and not isinstance(like, bool):
            return r.choice([like + 1, like - 1, like + 64, like - 64, like + ALIGNMENT, like - ALIGNMENT, -like,
                             like * 2, like << 32, like // 2, float(like), str(like)])
        if kind <= 2:
            return r.choice(INTERESTING_INTS)
        if kind == 3:
            return r.choice(INTERESTING_FLOATS)
        if kind == 4:
            return r.choice(INTERESTING_STRINGS)
        if kind == 5:
            return r.choice([None, True, False, [], {}, [0], {"": 0}, [like], {"x": like}])
        if kind == 6:
            return Raw(r.choice(RAW_LITERALS))
        if kind == 7 and isinstance(like, list):
            return [self.interesting(x) for x in like] if like and r.random() < 0.3 else like + [r.choice(
                INTERESTING_INTS)]
        return r.choice(INTERESTING_INTS + INTERESTING_STRINGS)

    def mutate_json(self, doc, hot: list[tuple], donor_doc=None, rounds: int | None = None):
        """A mutated deep copy of `doc`; `hot` paths (prefixes) get most of the mutations."""
        doc = copy.deepcopy(doc)
        for _ in range(rounds or self.rng.choice([1, 1, 1, 2, 3, 4])):
            doc = self._mutate_json_once(doc, hot, donor_doc)
        return doc

    def _mutate_json_once(self, doc, hot, donor_doc):
        r = self.rng
        paths = list(_json_paths(doc))
        if not paths:
            return self.interesting(doc)
        hot_paths = [p for p in paths if any(p[:len(h)] == h and len(p) > len(h) for h in hot)]
        path = r.choice(hot_paths if hot_paths and r.random() < 0.8 else paths)
        parent = _get(doc, path[:-1])
        key, value = path[-1], _get(doc, path)
        op = r.randrange(9)
        if op == 8:
            return self._graft(doc, path, donor_doc)
        if op <= 2:
            parent[key] = self.interesting(value)
        elif op == 3:  # drop it
            del parent[key]
        elif op == 4:  # duplicate: a list item, or a dict key written twice
            if isinstance(parent, list):
                parent.insert(r.randrange(len(parent) + 1), copy.deepcopy(value))
            else:
                parent[_DUP + str(key)] = self.interesting(value)
        elif op == 5:  # swap with a sibling, or with the same key of a sibling entry
            grand = _get(doc, path[:-2]) if len(path) >= 2 else None
            if isinstance(parent, list) and len(parent) > 1:
                other = r.randrange(len(parent))
                parent[key], parent[other] = parent[other], parent[key]
            elif isinstance(grand, list) and len(grand) > 1:
                sibling = r.choice(grand)
                if isinstance(sibling, dict) and key in sibling:
                    parent[key], sibling[key] = sibling[key], parent[key]
        elif op == 6:  # copy from a sibling entry, or from the same place in another document
            grand = _get(doc, path[:-2]) if len(path) >= 2 else None
            source = donor_doc if donor_doc is not None and r.random() < 0.5 else None
            if source is not None:
                try:
                    parent[key] = copy.deepcopy(_get(source, path))
                except (KeyError, IndexError, TypeError):
                    parent[key] = copy.deepcopy(r.choice(list(_json_paths_values(source))))
            elif isinstance(grand, list) and grand:
                sibling = r.choice(grand)
                if isinstance(sibling, dict) and key in sibling:
                    parent[key] = copy.deepcopy(sibling[key])
        else:  # wrap or unwrap
            if isinstance(value, (list, dict)) and value and r.random() < 0.5:
                parent[key] = copy.deepcopy(r.choice(list(value.values()) if isinstance(value, dict) else value))
            else:
                parent[key] = [value] if r.random() < 0.5 else {"value": value}
        return doc

    def _graft(self, doc, path, donor_doc):
        """Give an object a key it lacks, taken from a sibling object of its list or from the same object in the
        other document (a complete layer's `bytes` on an incomplete one, say), its value kept or made odd."""
        r = self.rng
        target_path = path if isinstance(_get(doc, path), dict) else path[:-1]
        target = _get(doc, target_path)
        sources = []
        if len(target_path) >= 1 and isinstance(_get(doc, target_path[:-1]), list):
            sources += [s for s in _get(doc, target_path[:-1]) if isinstance(s, dict) and s is not target]
        try:
            sources.append(_get(donor_doc, target_path))
        except (KeyError, IndexError, TypeError):
            pass
        sources = [s for s in sources if isinstance(s, dict) and s]
        if not isinstance(target, dict) or not sources:
            return doc
        source = r.choice(sources)
        missing = [k for k in source if k not in target]
        key = r.choice(missing or list(source))
        target[key] = copy.deepcopy(source[key]) if r.random() < 0.5 else self.interesting(source[key])
        return doc

    # --- containers --------------------------------------------------------------------------------------------
    def _mutate_container(self, data: bytes) -> bytes | None:
        if data.startswith(BUNDLE_MAGIC):
            return self._mutate_multipart(data)
        r = self.rng
        choice = r.random()
        if choice < 0.25:
            return self.raw(data, self.donor("container"))
        if choice < 0.40:
            return self.header_field(data)
        parts = parse_container(data)
        if parts is None:
            return None
        body, index = parts
        if choice < 0.75:
            donor = parse_container(self.donor("container") or b"")
            index = self.mutate_json(index, [("regions",), ("tensors",), ("format_version",), ("config",)],
                                     donor[1] if donor else None)
            if r.random() < 0.3:
                _fix_tensor_lengths(index)
            return self.assemble(body, index)
        if choice < 0.85:
            return self.tensor_bytes_rehashed(body, index)
        if choice < 0.90:
            return self.region_resized(body, index)
        if choice < 0.95:  # another container's index over these regions, or this index over another's
            donor = parse_container(self.donor("container") or b"")
            if donor is None:
                return None
            return self.assemble(body, donor[1]) if r.random() < 0.5 else self.assemble(donor[0], index)
        return self.assemble(body, None, text=r.choice(WHOLE_TEXTS))

    def _mutate_multipart(self, data: bytes) -> bytes | None:
        """The main file mutated as a container (part headers then, by chance, retagged with its new index xxh3 so
        they still claim to belong to it), a part header field or a part's bytes, or the files shuffled."""
        r = self.rng
        files = unpack_bundle(data)
        parts = [name for name in files if name != MAIN_MEMBER]
        choice = r.random()
        if choice < 0.05:
            return self.raw(data)
        if choice < 0.65 and MAIN_MEMBER in files:
            files[MAIN_MEMBER] = self._mutate_container(files[MAIN_MEMBER])
            if r.random() < 0.8:
                _retag_parts(files)
        elif choice < 0.9 and parts:
            name = r.choice(parts)
            files[name] = self.header_field(files[name], _PART_HEADER_FIELDS) if r.random() < 0.5 else \
                self.raw(files[name])
        else:
            self.shuffle_files(files, "container")
        return pack_bundle(files)

    def header_field(self, data: bytes, layout: struct.Struct = _HEADER_FIELDS) -> bytes | None:
        """One field of the container header (or of a part header) set to an interesting value."""
        if len(data) < layout.size + 8:
            return None
        r = self.rng
        fields = list(layout.unpack_from(data))
        i = r.randrange(1, len(fields))
        width = _field_widths(layout)[i]
        candidates = INTERESTING_INTS + [len(data), len(data) + 1, len(data) - 1, len(data) - ALIGNMENT,
                                         len(data) + ALIGNMENT, fields[i] + 1, fields[i] - 1, fields[i] * 2,
                                         fields[i] + ALIGNMENT, fields[i] - ALIGNMENT, 1 << 30, (1 << 30) + 1,
                                         r.choice(fields[1:])]
        fields[i] = _mask(r.choice(candidates), width)
        out = bytearray(data)
        out[:layout.size] = layout.pack(*fields)
        if r.random() < 0.9:
            _rehash_header(out, layout.size)
        if i == _FILE_SIZE_FIELD and r.random() < 0.5 and fields[i] <= len(data) + (16 << 20):
            out = out[:fields[i]] + bytes(max(fields[i] - len(out), 0))
        return bytes(out)

    def assemble(self, body: bytes, index, text: bytes | None = None) -> bytes:
        """A container of `body` (header page + regions) and this index, with consistent header fields and index
        checksum; by chance a zstd frame without content size or with a checksum, a wrong raw length, or bytes
        after the frame."""
        r = self.rng
        text = dumps(index) if text is None else text
        compressor = zstandard.ZstdCompressor(level=1, write_content_size=r.random() < 0.8,
                                              write_checksum=r.random() < 0.1)
        stored = compressor.compress(text)
        if r.random() < 0.03:
            stored += r.choice([b"\x00", r.randbytes(16), compressor.compress(b"{}")])
        raw_length = len(text)
        if r.random() < 0.05:
            raw_length = _mask(r.choice([raw_length + 1, raw_length - 1, 0, 1 << 30, (1 << 30) + 1, 2**64 - 1]), 8)
        body = body[:align_up(max(len(body), HEADER_SIZE))].ljust(align_up(max(len(body), HEADER_SIZE)), b"\0")
        index_offset = len(body)
        total = index_offset + align_up(len(stored))
        fields = list(_HEADER_FIELDS.unpack_from(body)) if body[:8] == b"MOEPACK\0" else None
        if fields is None:
            return None
        fields[6:10] = [total, index_offset, len(stored), raw_length]
        fields[12] = xxhash.xxh3_64_intdigest(stored)
        out = bytearray(body + stored + bytes(total - index_offset - len(stored)))
        out[:HEADER_HASHED_BYTES] = _HEADER_FIELDS.pack(*fields)
        _rehash_header(out)
        return bytes(out)

    def tensor_bytes_rehashed(self, body: bytes, index) -> bytes | None:
        """Hostile bytes in one tensor (or in a region's padding) behind correct tensor and region checksums."""
        r = self.rng
        regions, tensors = index.get("regions"), index.get("tensors")
        if not (isinstance(regions, list) and isinstance(tensors, list) and tensors):
            return None
        t = r.choice(tensors)
        region = regions[t["region"]]
        start = region["offset"] + t["offset"]
        end = start + t["length"]
        if not (HEADER_SIZE <= start <= end <= len(body)):
            return None
        out = bytearray(body)
        if r.random() < 0.15:  # dirty padding: a byte after the tensor, inside the region
            pad = r.randrange(end, region["offset"] + region["length"]) if end < region["offset"] + region["length"] \
                else None
            if pad is None:
                return None
            out[pad] = r.randrange(1, 256)
        else:
            pattern = r.choice([b"\xff", b"\x00", b"\x80", b"\x7f", b"\x00\x7c", b"\x00\xfc", b"\x00\x00\xc0\x7f",
                                b"\x00\x00\x80\x7f", r.randbytes(7)])
            if r.random() < 0.5:
                out[start:end] = (pattern * (t["length"] // len(pattern) + 1))[:t["length"]]
            elif end > start:
                for _ in range(r.randrange(1, 9)):
                    out[r.randrange(start, end)] = r.randrange(256)
            t["xxh3"] = xxhash.xxh3_64_hexdigest(bytes(out[start:end]))
        region["xxh3"] = xxhash.xxh3_64_hexdigest(bytes(out[region["offset"]:region["offset"] + region["length"]]))
        return self.assemble(bytes(out), index)

    def region_resized(self, body: bytes, index) -> bytes | None:
        """One region a page longer or shorter, later regions moved so the tiling stays exact."""
        regions = index.get("regions")
        if not (isinstance(regions, list) and regions):
            return None
        i = self.rng.randrange(len(regions))
        end = regions[i]["offset"] + regions[i]["length"]
        grow = self.rng.random() < 0.5 or regions[i]["length"] <= ALIGNMENT
        body = body[:end] + bytes(ALIGNMENT) + body[end:] if grow else body[:end - ALIGNMENT] + body[end:]
        delta = ALIGNMENT if grow else -ALIGNMENT
        regions[i]["length"] += delta
        for later in regions[i + 1:]:
            later["offset"] += delta
        if self.rng.random() < 0.7:
            start = regions[i]["offset"]
            regions[i]["xxh3"] = xxhash.xxh3_64_hexdigest(body[start:start + regions[i]["length"]])
        return self.assemble(body, index)

    # --- KV directories ----------------------------------------------------------------------------------------
    def _mutate_kv(self, data: bytes) -> bytes | None:
        r = self.rng
        files = unpack_bundle(data)
        choice = r.random()
        if choice < 0.1 or not files:
            return self.raw(data, self.donor("kv"))
        if choice < 0.5:
            manifest = json.loads(files[MANIFEST_NAME])
            if r.random() < 0.3:
                _toggle_a_layer(manifest, r)
            donor = unpack_bundle(self.donor("kv") or b"").get(MANIFEST_NAME)
            manifest = self.mutate_json(
                manifest, [("layers",), ("tokens",), ("identity", "config"), ("identity",), ("geometry",),
                           ("result",), ("format_version",), ("dtype",), ("complete",)],
                json.loads(donor) if donor else None)
            files[MANIFEST_NAME] = self.fix_manifest(manifest, files)
        elif choice < 0.7:
            name = r.choice([n for n in files if n.endswith(".safetensors")])
            files[name] = self.safetensors_mutated(files[name])
            if r.random() < 0.8:
                files[MANIFEST_NAME] = _rehash_layer_files(json.loads(files[MANIFEST_NAME]), files)
        elif choice < 0.9:
            name = r.choice(list(files))
            files[name] = self.raw(files[name], unpack_bundle(self.donor("kv") or b"").get(name))
            if name != MANIFEST_NAME and r.random() < 0.5:
                files[MANIFEST_NAME] = _rehash_layer_files(json.loads(files[MANIFEST_NAME]), files)
        else:
            self.shuffle_files(files, "kv")
        return pack_bundle(files)

    def fix_manifest(self, manifest, files: dict[str, bytes]) -> bytes:
        """Recompute, each by chance, what guards the manifest's deeper checks."""
        r = self.rng
        fixes = [_fix_config_hash, _fix_token_hash, _fix_geometry]
        for fix in fixes:
            if r.random() < 0.5:
                try:
                    fix(manifest)
                except Exception:  # noqa: BLE001 - a fix-up that can't apply to this mutant is skipped
                    pass
        if r.random() < 0.6:
            return _rehash_layer_files(manifest, files)
        return dumps(manifest)

    def safetensors_mutated(self, data: bytes, max_tensor_bytes: int = 16 << 20, edit_entry: bool = False) -> bytes:
        """The header's JSON mutated (or, with `edit_entry`, often one tensor's dtype, shape or data_offsets), by
        chance made consistent again; by chance a wrong header length."""
        r = self.rng
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        body = data[8 + n:]
        names = [k for k in header if k != "__metadata__"]
        if edit_entry and names and r.random() < 0.6:
            self._edit_tensor_entry(header[r.choice(names)], body)
        else:
            header = self.mutate_json(header, [(k,) for k in names] + [("__metadata__",)])
        if r.random() < 0.3 and names:  # a tensor renamed to another one's name, or to a stray one
            old = r.choice(names)
            if old in header:
                header[r.choice(names + ["extra", "compressor.overlap_kv", "window_kv.scale", old + ".scale"])] = \
                    header.pop(old)
        if r.random() < 0.6:
            header, body = _consistent_safetensors(header, body, max_tensor_bytes)
        text = dumps(header)
        length = len(text)
        if r.random() < 0.05:
            length = r.choice([0, length + 1, length - 1, length + 8, length - 8, 2**63, 2**64 - 1, 100 << 20])
        return _mask(length, 8).to_bytes(8, "little") + text + body

    def _edit_tensor_entry(self, info: dict, body: bytes) -> None:
        r = self.rng
        field = r.choice(["dtype", "shape", "data_offsets"])
        if field == "dtype":
            info["dtype"] = r.choice([*_SAFETENSORS_DTYPE_BYTES, "F8_E8M0", "F4", "I4", "Q4_0", "f32", ""])
        elif field == "shape" and isinstance(info.get("shape"), list):
            shape = info["shape"]
            op = r.randrange(5)
            if op == 0 and shape:
                shape[r.randrange(len(shape))] = r.choice([0, 1, -1, 2**31, 2**32 + 1, 2**63 - 1, 2**64])
            elif op == 1 and shape:
                i = r.randrange(len(shape))
                shape[i] += r.choice([1, -1])
            elif op == 2:
                shape.append(r.choice([1, 2]))
            elif op == 3 and shape:
                shape.pop()
            else:
                shape.reverse()
        elif isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2:
            begin, end = info["data_offsets"]
            info["data_offsets"] = r.choice([
                [begin, end + 1], [begin + 1, end], [begin - 1, end - 1], [end, begin], [0, end - begin],
                [begin, len(body) + 1], [len(body), len(body) + end - begin], [begin + ALIGNMENT, end + ALIGNMENT],
                [-1, end], [begin, 2**64]])

    # --- checkpoint directories and GGUF files -------------------------------------------------------------------
    def _mutate_checkpoint(self, data: bytes) -> bytes | None:
        r = self.rng
        files = unpack_bundle(data)
        if not files or r.random() < 0.05:
            return self.raw(data, self.donor("checkpoint"))
        shards = [n for n in files if n.endswith(".safetensors")]
        choice = r.random()
        if choice < 0.35 and shards:
            name = r.choice(shards)
            if r.random() < 0.8:
                files[name] = self.safetensors_mutated(files[name], _MAX_SOURCE_TENSOR_BYTES, edit_entry=True)
            else:  # cut inside (or just after) a tensor's bytes
                n = int.from_bytes(files[name][:8], "little")
                header = json.loads(files[name][8:8 + n])
                ends = [8 + n + info["data_offsets"][1] for k, info in header.items() if k != "__metadata__"]
                files[name] = files[name][:max(r.choice(ends) - r.choice([1, 2, 64, 4096]), 0)]
        elif choice < 0.55 and "config.json" in files:
            donor = unpack_bundle(self.donor("checkpoint") or b"").get("config.json")
            files["config.json"] = dumps(self.mutate_json(json.loads(files["config.json"]), [()],
                                                          json.loads(donor) if donor else None))
        elif choice < 0.65 and INDEX_FILE in files:
            index = json.loads(files[INDEX_FILE])
            if r.random() < 0.5 and isinstance(index.get("weight_map"), dict) and index["weight_map"]:
                key = r.choice(list(index["weight_map"]))
                index["weight_map"][key] = r.choice(shards + ["model-00009-of-00004.safetensors", "missing.safetensors",
                                                              "../model.safetensors", "config.json", ""])
            else:
                index = self.mutate_json(index, [("weight_map",), ("metadata",)])
            files[INDEX_FILE] = dumps(index)
        elif choice < 0.72:
            side = [n for n in files if n.endswith((".json", ".jinja")) and n not in ("config.json", INDEX_FILE)]
            if not side:
                return None
            name = r.choice(side)
            files[name] = dumps(self.mutate_json(json.loads(files[name]), [()])) if r.random() < 0.7 else \
                self.raw(files[name])
        elif choice < 0.9:
            name = r.choice(list(files))
            files[name] = self.raw(files[name], unpack_bundle(self.donor("checkpoint") or b"").get(name))
        else:
            self.shuffle_files(files, "checkpoint")
        return pack_bundle(files)

    def _mutate_gguf(self, data: bytes) -> bytes | None:
        r = self.rng
        files = unpack_bundle(data)
        if not files:
            return self.raw(data, self.donor("gguf"))
        choice = r.random()
        name = r.choice(list(files))
        if choice < 0.6:
            files[name] = self.gguf_field(files[name])
        elif choice < 0.9:
            files[name] = self.raw(files[name], unpack_bundle(self.donor("gguf") or b"").get(name))
        else:
            self.shuffle_files(files, "gguf")
        return pack_bundle(files)

    def gguf_field(self, data: bytes) -> bytes:
        """One structural number of a GGUF (found by walking its header) set to an interesting value, in place."""
        r = self.rng
        fields = gguf_fields(data)
        if not fields:
            return None
        roles = sorted({role for _, _, role in fields})
        keeping = [role for role in roles if role in _GGUF_KEEPS_THE_WALK]
        # every role as likely, however many values of it there are; mostly one the reader gets past, so the change
        # reaches what comes after it (a length or a count changed ends most walks there)
        role = r.choice(keeping if keeping and r.random() < 0.75 else roles)
        pos, width, _ = r.choice([f for f in fields if f[2] == role])
        current = int.from_bytes(data[pos:pos + width], "little")
        candidates = INTERESTING_INTS + [current + 1, current - 1, current * 2, current + 32, current - 32,
                                         current << 16, len(data), len(data) - current]
        if role in ("value type", "array item type"):
            candidates += list(range(14)) * 3
        elif role == "ggml type":
            candidates += list(range(42)) * 2
        out = bytearray(data)
        out[pos:pos + width] = _mask(r.choice(candidates), width).to_bytes(width, "little")
        return bytes(out)

    def shuffle_files(self, files: dict[str, bytes], target: str) -> None:
        r = self.rng
        names = list(files)
        op = r.randrange(5)
        if op == 0:
            del files[r.choice(names)]
        elif op == 1 and len(names) > 1:
            a, b = r.sample(names, 2)
            files[a], files[b] = files[b], files[a]
        elif op == 2:
            files[r.choice(names)] = files[r.choice(names)]
        elif op == 3:
            files[r.choice(_STRAY_FILES[target])] = r.randbytes(r.randrange(64))
        else:
            donor = unpack_bundle(self.donor(target) or b"")
            if donor:
                name = r.choice(list(donor))
                files[name] = donor[name]


# --- helpers ----------------------------------------------------------------------------------------------------
INDEX_FILE = "model.safetensors.index.json"
# Files a shuffle adds (random bytes): names each reader might pick up.
_STRAY_FILES = {
    "container": ["part1", "part2", "part9", "junk"],
    "kv": ["layer-0009.safetensors", "layer-0000.safetensors.partial", "junk", "logits.safetensors", "part1"],
    "checkpoint": ["model.safetensors", "model-00009-of-00004.safetensors", "model-00001-of-00009.safetensors",
                   INDEX_FILE, "config.json", "tokenizer.json", "chat_template.jinja", "generation_config.json",
                   "junk.safetensors"],
    "gguf": ["model-00003-of-00002.gguf", "model-00001-of-00002.gguf", "model.gguf", "junk"],
}
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_KEEPS_THE_WALK = ("value", "dimension", "ggml type", "tensor offset")
_GGUF_ITEMS_NAMED = 4  # an array's first items are offered as values (a vocabulary has 100 000)


def gguf_fields(data: bytes) -> list[tuple[int, int, str]]:
    """(position, width, role) of every structural number of a little-endian GGUF's header, walked as far as it
    parses: version, counts, key lengths and value types, scalar values, string and array lengths, array item types,
    tensor names' lengths, dimension counts, dimensions, ggml types and data offsets."""
    out: list[tuple[int, int, str]] = []
    if data[:4] != b"GGUF" or len(data) < 24:
        return out
    out += [(4, 4, "version"), (8, 8, "tensor count"), (16, 8, "key count")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def u(fmt: str, role: str | None):
        nonlocal pos
        (value,) = struct.unpack_from(fmt, data, pos)
        if role:
            out.append((pos, struct.calcsize(fmt), role))
        pos += struct.calcsize(fmt)
        return value

    def string(role: str) -> None:
        nonlocal pos
        length = u("<Q", role)  # (read before pos is added to: u moves it past the length)
        pos += length
        if pos > len(data):
            raise struct.error("past the end")

    try:
        for _ in range(min(n_kv, 10_000)):
            string("key length")
            kind = u("<I", "value type")
            if kind == _GGUF_STRING:
                string("string length")
            elif kind == _GGUF_ARRAY:
                item, count = u("<I", "array item type"), u("<Q", "array length")
                for i in range(count):
                    named = i < _GGUF_ITEMS_NAMED
                    if item == _GGUF_STRING:
                        string("string length" if named else None)
                    else:
                        width = _GGUF_SCALAR_BYTES[item]
                        if named:
                            out.append((pos, width, "value"))
                        pos += width * (count - i if not named else 1)
                        if not named:
                            break
            else:
                width = _GGUF_SCALAR_BYTES[kind]
                out.append((pos, width, "value"))
                pos += width
        for _ in range(min(n_tensors, 100_000)):
            string("tensor name length")
            for _ in range(u("<I", "dimension count")):
                u("<Q", "dimension")
            u("<I", "ggml type")
            u("<Q", "tensor offset")
    except (struct.error, KeyError):
        pass  # a header damaged before: its fields up to the damage
    return out

def _json_paths(value, prefix=()):
    """Every position inside a JSON value (long lists sampled at a few indices)."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        picks = range(len(value)) if len(value) <= 8 else sorted({0, 1, len(value) - 1, *range(0, len(value),
                                                                                                   len(value) // 6)})
        items = [(i, value[i]) for i in picks]
    else:
        return
    for key, child in items:
        yield prefix + (key,)
        yield from _json_paths(child, prefix + (key,))


def _json_paths_values(value):
    for path in _json_paths(value):
        yield _get(value, path)


def _get(doc, path):
    for key in path:
        doc = doc[key]
    return doc


def parse_container(data: bytes):
    """(header page + regions, index dict) of a container whose header and index still parse; None otherwise."""
    if len(data) < HEADER_SIZE or data[:8] != b"MOEPACK\0":
        return None
    fields = _HEADER_FIELDS.unpack_from(data)
    index_offset, index_length = fields[7], fields[8]
    if not HEADER_SIZE <= index_offset <= len(data) or index_offset + index_length > len(data):
        return None
    try:
        raw = zstandard.ZstdDecompressor().decompress(data[index_offset:index_offset + index_length],
                                                      max_output_size=64 << 20)
        index = json.loads(raw)
    except (zstandard.ZstdError, ValueError, RecursionError):
        return None
    return (data[:index_offset], index) if isinstance(index, dict) else None


def _rehash_header(buf: bytearray, hashed_bytes: int = HEADER_HASHED_BYTES) -> None:
    struct.pack_into("<Q", buf, hashed_bytes, xxhash.xxh3_64_intdigest(bytes(buf[:hashed_bytes])))


def _retag_parts(files: dict[str, bytes]) -> None:
    """Every part header names the main file's (new) index xxh3 again, its own checksum recomputed."""
    main = files.get(MAIN_MEMBER, b"")
    if len(main) < HEADER_HASHED_BYTES:
        return
    index_xxh3 = _HEADER_FIELDS.unpack_from(main)[12]
    for name, data in files.items():
        if name != MAIN_MEMBER and len(data) >= PART_HEADER_HASHED_BYTES + 8:
            fields = list(_PART_HEADER_FIELDS.unpack_from(data))
            fields[_PART_INDEX_XXH3_FIELD] = index_xxh3
            out = bytearray(data)
            out[:PART_HEADER_HASHED_BYTES] = _PART_HEADER_FIELDS.pack(*fields)
            _rehash_header(out, PART_HEADER_HASHED_BYTES)
            files[name] = bytes(out)


def _fix_tensor_lengths(index) -> None:
    for t in index.get("tensors") or []:
        try:
            t["length"] = tensor_nbytes(t["dtype"], t["shape"])
        except Exception:  # noqa: BLE001 - a tensor whose dtype/shape can't be sized keeps its length
            pass


def _fix_config_hash(m) -> None:
    m["identity"]["config_xxh3"] = config_xxh3(m["identity"]["config"])


def _fix_token_hash(m) -> None:
    ids = m["tokens"]["ids"]
    m["tokens"]["count"] = len(ids)
    m["tokens"]["ids_xxh3"] = token_ids_xxh3(ids)


def _fix_geometry(m) -> None:
    m["geometry"] = kv_geometry(m["identity"]["config"])


def _toggle_a_layer(manifest, rng) -> None:
    """A KV caught mid-prefill: one layer entry marked incomplete (keeping what it recorded) or complete (recording
    nothing), and the manifest's `complete` following."""
    entry = rng.choice(manifest["layers"])
    entry["complete"] = not entry["complete"]
    manifest["complete"] = all(e.get("complete") for e in manifest["layers"])


def _rehash_layer_files(manifest, files: dict[str, bytes]) -> bytes:
    """The manifest with every layer entry's (and the logits') bytes/xxh3 matching the files as they are now."""
    entries = list(manifest.get("layers") or []) if isinstance(manifest, dict) else []
    result = manifest.get("result") if isinstance(manifest, dict) else None
    if isinstance(result, dict) and isinstance(result.get("logits"), dict):
        entries.append(result["logits"])
    for e in entries:  # (a layer entry records its file's size and hash once the layer is complete)
        if isinstance(e, dict) and e.get("complete", True) is True and isinstance(e.get("file"), str) \
                and e["file"] in files:
            e["bytes"] = len(files[e["file"]])
            e["xxh3"] = xxhash.xxh3_64_hexdigest(files[e["file"]])
    return dumps(manifest)


def _consistent_safetensors(header: dict, body: bytes, max_tensor_bytes: int = 16 << 20) -> tuple[dict, bytes]:
    """Make a mutated safetensors header valid again: data offsets laid out back to back for each tensor's dtype
    and shape (keeping the old bytes where they fit), so the file parses and the reader's own checks decide."""
    out = bytearray()
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        size = _SAFETENSORS_DTYPE_BYTES.get(info.get("dtype"), 4)
        shape = info.get("shape")
        if not (isinstance(shape, list) and all(isinstance(d, int) and 0 <= d < 1 << 16 for d in shape)):
            continue
        count = 1
        for d in shape:
            count *= d
        nbytes = count * size
        if nbytes > max_tensor_bytes:
            continue
        old = info.get("data_offsets")
        start = old[0] if isinstance(old, list) and len(old) == 2 and isinstance(old[0], int) else 0
        chunk = body[start:start + nbytes] if 0 <= start else b""
        info["data_offsets"] = [len(out), len(out) + nbytes]
        out += chunk.ljust(nbytes, b"\0")
    return header, bytes(out)
