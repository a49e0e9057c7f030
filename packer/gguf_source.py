"""A llama.cpp GGUF of a family's architecture (DeepSeek-V4's `deepseek4`, Qwen3-MoE's `qwen3moe`; one file, or
`NAME-00001-of-0000N.gguf` splits) as a source of the converter.

It offers what CheckpointDir offers (config, tensors by canonical name, pread of their bytes, tokenizer files), so
`moepack convert MODEL.gguf` runs the same region pipeline as a Hugging Face checkpoint and `verify --source
MODEL.gguf` the same comparison:

* tensors: GGUF names to the family's canonical names (ModelFamily.gguf_tensors of its schema); a layer's stacked
  routed experts (`blk.L.ffn_{gate,up,down}_exps` [E, out, in]) become E tensors each, slices of the stacked bytes. A
  ggml type a container stores (F32, F16, BF16, Q8_0, MXFP4, NVFP4, Q2_K, IQ2_XXS, the integer types) is handed over
  byte for byte; any other (Q4_K, Q6_K, ...) is dequantized by gguf-py and handed over as F32 (`--keep` refuses those:
  their blocks cannot be kept).
* config: a transformers-spelled config.json the family rebuilds from its architecture's keys
  (ModelFamily.config_from_gguf, the exporter's inverse), with the tokenizer's bos / eos ids.
* tokenizer: tokenizer.json (byte-level BPE: tokens, merges, added tokens by token type, the regexes of the
  pre-tokenizer a family names: RegisteredFamily.gguf_pre_tokenizers) and tokenizer_config.json (bos / eos,
  add_bos_token, chat template).

Every problem (not a GGUF, another architecture, a missing or extra split, a tensor past the end of its file, an
unknown tensor) is one MoepackError line naming the file.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import struct
from typing import NamedTuple

import numpy as np

from moepack.families import FAMILY_NAMES, GGUF_ARCHITECTURES, family_named, family_of_gguf
from moepack.format_spec.dtypes import STORAGE_TYPES, tensor_nbytes
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.files import open_regular
from moepack.format_spec.generation_config import GENERATION_CONFIG, from_gguf_sampling

from .source import LocalSource, OpenFiles, SourceTensor

GGUF_MAGIC = b"GGUF"
_SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5


def is_gguf(src: str) -> bool:
    """A path to a GGUF file (by its magic, so a misnamed file is still recognised)."""
    if not os.path.isfile(src):
        return src.endswith(".gguf") and bool(_SPLIT.match(os.path.basename(src)))  # a missing split is an error
    try:
        with open(src, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def split_files(path: str) -> list[str]:
    """The files of a GGUF: itself, or every `-0000i-of-0000N.gguf` split of its name (each must exist)."""
    m = _SPLIT.match(path)
    if not m:
        return [path]
    count = int(m.group("count"))
    if not 1 <= int(m.group("no")) <= count:
        raise MoepackError(f"{os.path.basename(path)}: split number {int(m.group('no'))} of {count}")
    files = [f"{m.group('prefix')}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise MoepackError(f"missing GGUF split {os.path.basename(missing[0])} ({len(missing)} of {count} missing)")
    return files


GGUF_EXTRA = "pip install 'moepack[gguf]'"  # gguf-py, an optional dependency: only GGUF import and export need it


def gguf_py(what: str = "reading a GGUF"):
    """gguf-py's module, or one line saying how to install it (`what` needs it)."""
    try:
        import gguf
    except ImportError:
        raise MoepackError(f"{what} needs gguf-py: {GGUF_EXTRA}") from None
    return gguf


# GGUF value types (gguf-py's GGUFValueType): the fixed ones as struct formats, and the two of variable length
_FIXED_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_FIXED_SIZES = {kind: struct.calcsize(fmt) for kind, fmt in _FIXED_FORMATS.items()}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
READ_VERSIONS = (2, 3)  # gguf-py's READER_SUPPORTED_VERSIONS
DEFAULT_ALIGNMENT = 32
MAX_TENSOR_DIMS = 8  # ggml has 4
MAX_ARRAY_NESTING = 4
MAX_ARRAY_ITEMS = 1 << 24  # a vocabulary is ~10^5 tokens; more is a damaged or hostile count, not metadata
UNDECODABLE = object()  # a string value that is not UTF-8 (gguf-py raises reading it): the key is absent


class GGUFTensorInfo(NamedTuple):
    name: str
    ggml_type: int
    dims: tuple[int, ...]  # ggml's order (ne): the row length first
    data_offset: int  # from the start of the file
    n_bytes: int


class GGUFHeader:
    """A GGUF's key/values (`fields`: key -> Python value) and tensor infos (`tensors`), read in one pass that
    trusts no count or length: each is bounded by the bytes left in the file before anything is read or looped
    over, so a header that outruns its file is refused at once. gguf-py's GGUFReader reads the same, but builds a
    numpy view per string (a 129K-token vocabulary takes it seconds to tens of seconds); its type table names and
    sizes the tensors."""

    def __init__(self, path: str, gguf):
        self.name = os.path.basename(path)
        self.fields: dict[str, object] = {}
        self.tensors: list[GGUFTensorInfo] = []
        self.order, self.pos = "<", 0
        with os.fdopen(open_regular(path), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            magic = f.read(4)
            if magic != GGUF_MAGIC:
                raise MoepackError(f"{self.name}: not a GGUF file (magic {magic!r})")
            if size < 24:
                self.fail("truncated header")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                self.data = data
                try:
                    self._read(gguf)
                finally:
                    self.data = None  # no view left on the map as it closes

    def fail(self, what: str):
        raise MoepackError(f"{self.name}: damaged GGUF: {what}")

    def need(self, n: int, what: str) -> None:
        left = len(self.data) - self.pos
        if n > left:
            self.fail(f"{what} needs {n} bytes, the file has {left} left")

    def number(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(self.order + fmt, self.data, self.pos)
        self.pos += size
        return value

    def raw_string(self, what: str) -> bytes:
        n = self.number("Q", what)
        self.need(n, f"{what} (a string of {n} bytes)")
        self.pos += n
        return bytes(self.data[self.pos - n:self.pos])

    def text(self, what: str) -> str:
        """A key or a tensor name: UTF-8, or the file is refused (as gguf-py refuses it)."""
        raw = self.raw_string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not UTF-8 ({raw[:40]!r})")

    def value(self, kind: int, what: str, nesting: int = 0):
        if kind in _FIXED_FORMATS:
            return self.number(_FIXED_FORMATS[kind], what)
        if kind == _STRING:
            try:
                return self.raw_string(what).decode("utf-8")
            except UnicodeDecodeError:
                return UNDECODABLE
        if kind != _ARRAY:
            self.fail(f"{what}: unknown value type {kind}")
        item = self.number("I", what)
        count = self.number("Q", what)
        least = _FIXED_SIZES.get(item, 8 if item == _STRING else 12)  # a string: its length; an array: 12
        self.need(count * least, f"{what} (an array of {count})")
        if count > MAX_ARRAY_ITEMS:
            self.fail(f"{what}: an array of {count} items (moepack reads at most {MAX_ARRAY_ITEMS})")
        if item in _FIXED_FORMATS:  # at once: a 129K-entry array is one call
            values = np.frombuffer(self.data, np.dtype(self.order + _FIXED_FORMATS[item]), count, self.pos)
            self.pos += count * least
            return values.tolist()
        if item == _STRING:  # a vocabulary: one tight loop (each item takes at least its 8-byte length)
            return self._strings(count, what)
        if item != _ARRAY or nesting >= MAX_ARRAY_NESTING:
            self.fail(f"{what}: an array of value type {item}")
        values = [self.value(item, what, nesting + 1) for _ in range(count)]  # each item takes `least` bytes
        return UNDECODABLE if any(v is UNDECODABLE for v in values) else values

    def _strings(self, count: int, what: str):
        data, pos, length, end = self.data, self.pos, struct.Struct(self.order + "Q"), len(self.data)
        raw = []
        for _ in range(count):
            if pos + 8 > end:
                self.pos = pos
                self.need(8, what)
            (n,) = length.unpack_from(data, pos)
            pos += 8
            if n > end - pos:
                self.pos = pos
                self.need(n, f"{what} (a string of {n} bytes)")
            raw.append(data[pos:pos + n])
            pos += n
        self.pos = pos
        try:
            return [b.decode("utf-8") for b in raw]
        except UnicodeDecodeError:
            return UNDECODABLE

    def _read(self, gguf) -> None:
        self.pos = 4
        version = self.number("I", "the version")
        if version & 0xFFFF == 0:  # written for the other byte order (gguf-py reads it)
            self.order, version = ">", int.from_bytes(version.to_bytes(4, "little"), "big")
        if version not in READ_VERSIONS:
            self.fail(f"version {version} (moepack reads GGUF versions {', '.join(map(str, READ_VERSIONS))})")
        tensors, kvs = self.number("Q", "the tensor count"), self.number("Q", "the key/value count")
        self.need(kvs * 13, f"a key/value count of {kvs}")  # the least a key/value takes: 8 + 4 + 1 bytes
        kinds = {}
        for i in range(kvs):
            key = self.text(f"key/value #{i}'s key")
            if key in kinds:
                self.fail(f"key {key} appears twice")
            kinds[key] = self.number("I", key)
            value = self.value(kinds[key], key)
            if value is not UNDECODABLE:  # else absent: the checks that read the key name it
                self.fields[key] = value
        self.need(tensors * 24, f"a tensor count of {tensors}")  # name length, dims, type, offset
        infos = []
        for i in range(tensors):
            name = self.text(f"tensor #{i}'s name")
            what = name[:80]
            dims = self.number("I", what)
            if dims > MAX_TENSOR_DIMS:
                self.fail(f"tensor {what} has {dims} dimensions")
            self.need(dims * 8 + 12, what)
            shape = struct.unpack_from(f"{self.order}{dims}Q", self.data, self.pos)
            self.pos += dims * 8
            infos.append((name, shape, self.number("I", what), self.number("Q", what)))
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if "general.alignment" in self.fields and (kinds["general.alignment"] != _UINT32 or alignment <= 0
                                                   or alignment & (alignment - 1)):
            self.fail(f"general.alignment {alignment!r} is not a power of two (a uint32)")
        start = -(-self.pos // alignment) * alignment
        names = set()
        expected = 0  # where this tensor's data must begin: llama.cpp lays them out (and reads them) back to back
        for name, shape, ggml_type, offset in infos:
            if name in names:
                self.fail(f"tensor {name[:80]} appears twice")
            names.add(name)
            sizes = gguf.GGML_QUANT_SIZES.get(_ggml_type(gguf, ggml_type))
            if sizes is None:
                self.fail(f"tensor {name[:80]} has an unknown ggml type {ggml_type}")
            block, type_size = sizes
            if shape and shape[0] % block:
                self.fail(f"tensor {name[:80]}'s rows of {shape[0]} are not whole {_ggml_type(gguf, ggml_type).name} "
                          f"blocks of {block}")
            n_bytes = math.prod(shape) * type_size // block
            if offset != expected:
                self.fail(f"tensor {name[:80]}'s data is at offset {offset}, expected {expected} (where the tensors "
                          f"before it end, each padded to {alignment} bytes), as llama.cpp requires")
            expected += -(-n_bytes // alignment) * alignment
            self.tensors.append(GGUFTensorInfo(name, ggml_type, shape, start + offset, n_bytes))


def _ggml_type(gguf, value: int):
    try:
        return gguf.GGMLQuantizationType(value)
    except ValueError:
        return None


def _reader(gguf, path: str) -> GGUFHeader:
    try:
        return GGUFHeader(path, gguf)
    except OSError as e:
        raise MoepackError(f"{os.path.basename(path)}: cannot read ({e.strerror})") from None


def _value(reader: GGUFHeader, key: str, default=None):
    return reader.fields.get(key, default)


class GGUFSource(LocalSource):
    """A family's GGUF, read as a checkpoint: `config`, `tensors` {canonical name: SourceTensor}, `read(t)`,
    `side_files()`, `file_sizes()`, `provenance`, `close()`."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.files = split_files(self.path)
        self._files = OpenFiles()
        self._foreign: dict[str, tuple[str, int]] = {}  # name -> (ggml type, its bytes in the file)
        self._gguf = gguf_py()
        readers = [_reader(self._gguf, f) for f in self.files]
        first = readers[0]
        self.meta = {k: _value(first, k) for k in first.fields}
        arch = self.meta.get("general.architecture")
        self.family = family_of_gguf(arch)
        if self.family is None:
            raise MoepackError(f"{os.path.basename(self.files[0])}: architecture {arch!r}, moepack converts "
                               f"{', '.join(repr(a) for a in GGUF_ARCHITECTURES)} GGUFs")
        self._check_splits(readers)
        gguf_tensors: dict[str, tuple[str, object]] = {}
        for file, reader in zip(self.files, readers):
            size = os.path.getsize(file)
            for t in reader.tensors:
                if t.name in gguf_tensors:
                    raise MoepackError(f"tensor {t.name} appears in {os.path.basename(gguf_tensors[t.name][0])} "
                                       f"and {os.path.basename(file)}")
                if t.data_offset + t.n_bytes > size:
                    raise MoepackError(f"{os.path.basename(file)}: truncated (tensor {t.name} ends at "
                                       f"{t.data_offset + t.n_bytes}, the file has {size} bytes)")
                gguf_tensors[t.name] = (file, t)
        self.config = self._family_config(arch, gguf_tensors)
        self.tensors = self._family_tensors(gguf_tensors)
        self.provenance = {"source": self.files[0], "format": "gguf", "revision": None,
                           "files": {os.path.basename(f): {"size": os.path.getsize(f), "sha256": None}
                                     for f in self.files}}

    # -- structure -------------------------------------------------------------------------------------------

    def _check_splits(self, readers) -> None:
        count = len(self.files)
        for i, (file, reader) in enumerate(zip(self.files, readers)):
            declared = _value(reader, "split.count")
            if count > 1 or declared is not None:
                if declared != count or _value(reader, "split.no") != i:
                    raise MoepackError(f"{os.path.basename(file)}: split {_value(reader, 'split.no')} of "
                                       f"{declared} in its header, expected {i} of {count}")

    def _type_and_shape(self, t) -> tuple[str, tuple[int, ...]]:
        """A gguf-py tensor's ggml type name and row-major shape (ggml's ne reversed)."""
        return self._gguf.GGMLQuantizationType(t.ggml_type).name, tuple(reversed(t.dims))

    def _unstacked(self, gname: str, names: list[str], qtype: str, shape: tuple, file: str, t
                   ) -> dict[str, SourceTensor]:
        """A layer's stacked routed experts [E, out, in] as E tensors `names` (in expert-ID order), slices of it."""
        if len(shape) != 3 or shape[0] != len(names):
            raise MoepackError(f"{gname}: stacked experts must be 3-D of {len(names)} experts, got shape "
                               f"{list(shape)}")
        per_expert = t.n_bytes // shape[0]
        return {name: self._tensor(name, qtype, shape[1:], file, t.data_offset + e * per_expert, per_expert)
                for e, name in enumerate(names)}

    def _family_tensors(self, gguf_tensors) -> dict[str, SourceTensor]:
        """A family's GGUF tensors under the names of its schema (ModelFamily.gguf_tensors), the stacked experts
        unstacked."""
        family = self.family
        plain, stacked = {}, {}
        for t in family.gguf_tensors(self.config, None):
            if t.stacked:
                stacked[t.name] = list(t.sources)  # in expert-ID order
            else:
                plain[t.name] = t.sources[0]
        out: dict[str, SourceTensor] = {}
        for gname, (file, t) in gguf_tensors.items():
            qtype, shape = self._type_and_shape(t)
            if gname in stacked:
                out.update(self._unstacked(gname, stacked[gname], qtype, shape, file, t))
            elif gname in plain:
                out[plain[gname]] = self._tensor(plain[gname], qtype, shape, file, t.data_offset,
                                                 t.n_bytes)
            else:
                raise MoepackError(f"{os.path.basename(file)}: tensor {gname} is not one a {family.name} model of "
                                   "its keys has")
        return out

    def _tensor(self, name, qtype, shape, file, offset, nbytes) -> SourceTensor:
        if qtype in STORAGE_TYPES:
            if tensor_nbytes(qtype, shape) != nbytes:
                raise MoepackError(f"{name}: {qtype}{list(shape)} needs {tensor_nbytes(qtype, shape)} bytes, the "
                                   f"GGUF gives {nbytes}")
            return SourceTensor(name, qtype, tuple(shape), file, offset, nbytes, storage=qtype)
        # a ggml type a container does not hold: read as float32 through gguf-py's dequantizer
        self._foreign[name] = (qtype, nbytes)
        return SourceTensor(name, "F32", tuple(shape), file, offset, tensor_nbytes("F32", shape), storage="F32")

    def foreign_types(self) -> dict[str, str]:
        """{canonical name: ggml type} of the tensors a container cannot keep as they are."""
        return {name: qtype for name, (qtype, _) in self._foreign.items()}

    # -- bytes -------------------------------------------------------------------------------------------------

    def read(self, t: SourceTensor) -> bytes:
        foreign = self._foreign.get(t.name)
        data = self._files.read(t.file, t.offset, foreign[1] if foreign else t.length, t.name)
        if foreign is None:
            return data
        qtype = foreign[0]
        try:
            values = self._gguf.quants.dequantize(np.frombuffer(data, dtype=np.uint8),
                                                  self._gguf.GGMLQuantizationType[qtype])
        except NotImplementedError:
            raise MoepackError(f"{t.name}: gguf-py cannot dequantize ggml type {qtype}") from None
        return np.ascontiguousarray(values, dtype=np.float32).reshape(t.shape).tobytes()

    def file_sizes(self) -> dict[str, int]:
        return {os.path.basename(f): os.path.getsize(f) for f in self.files}

    def close(self) -> None:
        self._files.close()

    # -- config ------------------------------------------------------------------------------------------------

    def _family_config(self, arch: str, gguf_tensors) -> dict:
        """A family's config.json from its GGUF keys (the family's inverse of its gguf_model)."""
        embd = gguf_tensors.get("token_embd.weight")
        if embd is None:
            raise MoepackError(f"{os.path.basename(self.files[0])}: no token_embd.weight")
        keys = {k[len(arch) + 1:]: v for k, v in self.meta.items() if k.startswith(arch + ".")}
        name = os.path.basename(self.files[0])
        try:
            config = self.family.config_from_gguf(keys, embd[1].dims[1], "output.weight" not in gguf_tensors,
                                                  tuple(gguf_tensors))
            self.family.parse_config(config)  # every value in range, named as config.json's field
            return {**config, **self._special_ids()}
        except MoepackError as e:
            raise MoepackError(f"{name}: {e}") from None
        except (TypeError, ValueError) as e:  # a key of another type (a string for a count)
            raise MoepackError(f"{name}: a {self.family.name} key of the wrong type ({e})") from None
        except ArithmeticError as e:  # a key whose value the arithmetic cannot take (a zero it divides by)
            raise MoepackError(f"{name}: a {self.family.name} key out of range ({e})") from None

    def _special_ids(self) -> dict[str, int]:
        """bos_token_id / eos_token_id of the tokenizer's keys (where the GGUF names them)."""
        return {key: int(self.meta[f"tokenizer.ggml.{name}_token_id"])
                for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"))
                if self.meta.get(f"tokenizer.ggml.{name}_token_id") is not None}

    # -- tokenizer ---------------------------------------------------------------------------------------------

    def side_files(self) -> dict[str, dict]:
        """tokenizer.json and tokenizer_config.json rebuilt from the GGUF's tokenizer keys (none if it has none),
        and generation_config.json from its recommended sampling (general.sampling.*), where it has some."""
        sampling = from_gguf_sampling(self.meta)
        files = {GENERATION_CONFIG: {"encoding": "utf-8", "data": json.dumps(sampling)}} if sampling else {}
        return {**self._tokenizer_files(), **files}

    def _tokenizer_files(self) -> dict[str, dict]:
        tokens = self.meta.get("tokenizer.ggml.tokens")
        model = self.meta.get("tokenizer.ggml.model")
        if model == "none" or (model is None and not tokens):  # run by token ids
            return {}
        if model != "gpt2" or not tokens:
            raise MoepackError(f"tokenizer.ggml.model {model!r} with {len(tokens or [])} tokens: moepack rebuilds "
                               "byte-level BPE (gpt2) tokenizers, or none")
        types = self.meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
        merges = self.meta.get("tokenizer.ggml.merges") or []
        splits = pre_tokenizer_splits(self.family, self.meta.get("tokenizer.ggml.pre"))
        tokenizer = byte_level_bpe_json(tokens, types, merges, splits,
                                        self.meta.get("tokenizer.ggml.bos_token_id"),
                                        bool(self.meta.get("tokenizer.ggml.add_bos_token", False)))
        config = {"tokenizer_class": "PreTrainedTokenizerFast",
                  "add_bos_token": bool(self.meta.get("tokenizer.ggml.add_bos_token", False)),
                  "add_eos_token": bool(self.meta.get("tokenizer.ggml.add_eos_token", False))}
        for name in ("bos", "eos", "padding", "unknown"):
            token_id = self.meta.get(f"tokenizer.ggml.{name}_token_id")
            if token_id is not None and 0 <= int(token_id) < len(tokens):
                config[{"padding": "pad_token", "unknown": "unk_token"}.get(name, f"{name}_token")] = tokens[int(token_id)]
        template = self.meta.get("tokenizer.chat_template")
        if isinstance(template, str):
            config["chat_template"] = template
        return {name: {"encoding": "utf-8", "data": json.dumps(obj, ensure_ascii=False)}
                for name, obj in (("tokenizer.json", tokenizer), ("tokenizer_config.json", config))}


def pre_tokenizer_splits(family, pre: str | None) -> tuple[str, ...]:
    """The regexes of llama.cpp's pre-tokenizer `pre` before the byte-level step, as a family names them (the GGUF's
    own family first; none: GPT-2's own regex)."""
    for f in (family, *(family_named(name) for name in FAMILY_NAMES)):
        if pre in f.gguf_pre_tokenizers:
            return tuple(f.gguf_pre_tokenizers[pre])
    return ()


def byte_level_bpe_json(tokens: list[str], types: list[int], merges: list[str], splits: tuple[str, ...],
                        bos_id: int | None, add_bos: bool) -> dict:
    """A tokenizers-library tokenizer.json for a GGUF's byte-level BPE vocabulary. Padding entries (UNUSED) are
    left out, CONTROL tokens are special added tokens, USER_DEFINED ones plain added tokens. `splits`: the
    pre-tokenizer's regexes before the byte-level step (none: GPT-2's own regex)."""
    vocab, added = {}, []
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind == TOKEN_UNUSED:
            continue
        vocab[text] = i
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
            added.append({"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": kind != TOKEN_CONTROL, "special": kind == TOKEN_CONTROL})
    steps = [{"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False} for r in splits]
    steps.append({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": not splits})
    post = None
    if add_bos and bos_id is not None and 0 <= int(bos_id) < len(tokens):
        bos = {"SpecialToken": {"id": tokens[int(bos_id)], "type_id": 0}}
        post = {"type": "TemplateProcessing",
                "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {tokens[int(bos_id)]: {"id": tokens[int(bos_id)], "ids": [int(bos_id)],
                                                         "tokens": [tokens[int(bos_id)]]}}}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": steps}, "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": list(merges)},
    }


__all__ = ["GGUFSource", "is_gguf", "split_files", "byte_level_bpe_json"]
