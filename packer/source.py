"""A Hugging Face checkpoint directory as a source of raw tensor bytes.

Reads the safetensors headers itself (8-byte length + JSON) and fetches each tensor's bytes with pread, so tensors
come through bit-exact in whatever dtype the source stores (FP8, E8M0, packed FP4 as I8, ...) and only the tensors
being packed are ever in memory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import threading
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from moepack.families.base import chat_template_from_tokenizer_config
from moepack.format_spec import untrusted
from moepack.format_spec.dtypes import FROM_SAFETENSORS, tensor_nbytes
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.files import open_regular
from moepack.format_spec.reader import tokenizer_file_bytes

# Files worth carrying into the container beside the weights (small, text).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")
_MAX_HEADER = 100 << 20
MAX_SMALL_JSON_BYTES = 64 << 20  # config.json, an index of shards: kilobytes to a few megabytes


def eos_problem(value, vocab_size: int | None) -> str | None:
    """Why an `eos_token_id` (config.json's, generation_config.json's) is not one a generation can stop at: not a
    token id or a list of them (a string, a boolean), or an id past the model's embedding; None when it is."""
    ids = value if isinstance(value, list) else [value]
    if value is None or (isinstance(value, list) and not value):
        return None
    for i in ids:
        if type(i) is not int or i < 0:
            return f"eos_token_id: expected a token id or a list of them, got {json.dumps(value)[:80]}"
        if isinstance(vocab_size, int) and i >= vocab_size:
            return f"eos_token_id {i} is past the model's embedding of {vocab_size} rows (config.json vocab_size)"
    return None


def check_side_files(files: dict[str, dict], where: str, vocab_size: int | None = None,
                     config: dict | None = None) -> None:
    """The tokenizer and generation files a conversion carries into the container, refused before any work where
    they are damaged (the container would be converted for hours, then refuse every text prompt): tokenizer.json
    must load in the tokenizers library, with no token id past the model's embedding (`vocab_size` rows), every
    other .json file must be a JSON object; the end-of-sequence ids of `config` (config.json) and
    generation_config.json token ids of the model (a generation would never stop at one that is not)."""
    problem = eos_problem((config or {}).get("eos_token_id"), vocab_size)
    if problem:
        raise MoepackError(f"{where}: config.json: {problem}")
    for name, entry in files.items():
        data = tokenizer_file_bytes(entry)
        what = f"{where}: {name}"
        if name == "tokenizer.json":
            last = max(untrusted.load_tokenizer(data, what).get_vocab(with_added_tokens=True).values(), default=-1)
            if isinstance(vocab_size, int) and last >= vocab_size:
                raise MoepackError(f"{what}: token id {last} is past the model's embedding of {vocab_size} rows "
                                   "(config.json vocab_size): a prompt holding it could not be run")
        elif name.endswith(".json"):
            value = untrusted.loads(data, what)
            if not isinstance(value, dict):
                raise MoepackError(f"{what}: expected a JSON object")
            problem = eos_problem(value.get("eos_token_id"), vocab_size) if name == "generation_config.json" else None
            if problem:
                raise MoepackError(f"{what}: {problem}")
            if name == "tokenizer_config.json" and files.get("chat_template.jinja", {}).get("encoding") != "utf-8":
                try:  # (a chat_template.jinja beside it is the template transformers takes)
                    chat_template_from_tokenizer_config(value)
                except MoepackError as e:  # the model runs; its chat requests would be refused
                    warnings.warn(f"{where}: {e}: chat requests will be refused", stacklevel=2)
        elif name == "chat_template.jinja" and entry["encoding"] != "utf-8":
            warnings.warn(f"{what}: not UTF-8 text: chat requests will be refused", stacklevel=2)


@dataclass(frozen=True)
class SourceTensor:
    name: str  # as written in the source file
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    file: str
    offset: int  # absolute, in the file
    length: int
    storage: str | None = None  # the storage type, where the source names it itself (GGUF); else from `dtype`


def read_safetensors_header(path: str) -> dict[str, SourceTensor]:
    """Parse one safetensors file's header strictly: every tensor inside the file, sized as its dtype says."""
    name = os.path.basename(path)
    try:
        with os.fdopen(open_regular(path, missing=f"missing shard {name}"), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) != 8:
                raise MoepackError(f"{name}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", head)
            if not 2 <= n <= min(_MAX_HEADER, size - 8):  # bounded by the file's size before anything is read
                raise MoepackError(f"{name}: bad safetensors header length {n} (file is {size} bytes)")
            raw = f.read(n)
    except OSError as e:
        raise MoepackError(f"{name}: cannot read ({e.strerror or e})") from None
    try:
        header = untrusted.loads(raw, f"{name}: safetensors header", max_bytes=_MAX_HEADER)
    except untrusted.UntrustedInputError as e:
        raise MoepackError(f"{name}: safetensors header is not valid JSON ({e.detail})") from None
    if not isinstance(header, dict):
        raise MoepackError(f"{name}: safetensors header is not an object")
    data_start = 8 + n
    tensors = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise MoepackError(f"{name}: malformed header entry for {key}") from None
        if not (isinstance(dtype, str) and isinstance(info["shape"], list) and isinstance(info["data_offsets"], list)):
            raise MoepackError(f"{name}: malformed header entry for {key} (dtype a text, shape and data_offsets "
                               f"lists)")
        if dtype not in FROM_SAFETENSORS:
            raise MoepackError(f"{name}: tensor {key} has unsupported dtype {dtype}")
        try:
            need = tensor_nbytes(FROM_SAFETENSORS[dtype], shape)
        except MoepackError as e:
            raise MoepackError(f"{name}: tensor {key}: {e}") from None
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end and end - begin == need):
            raise MoepackError(f"{name}: tensor {key} has data offsets {begin}..{end}, {dtype}{list(shape)} "
                               f"needs {need} bytes")
        if data_start + end > size:
            raise MoepackError(f"{name}: truncated (tensor {key} ends at {data_start + end}, file has {size} bytes)")
        tensors[key] = SourceTensor(key, dtype, shape, path, data_start + begin, need)
    _check_tiling(name, tensors, data_start, size)
    return tensors


def _check_tiling(name: str, tensors: dict[str, SourceTensor], data_start: int, size: int) -> None:
    """The tensors' bytes follow one another from the end of the header to the end of the file, as the safetensors
    library requires (and so transformers): no two share bytes, no bytes lie between or after them."""
    at = data_start
    for t in sorted(tensors.values(), key=lambda t: (t.offset, t.length)):
        if t.offset != at:
            problem = "overlaps the tensor before it" if t.offset < at else f"leaves {t.offset - at} bytes before it"
            raise MoepackError(f"{name}: tensor {t.name}'s data (at {t.offset - data_start}) {problem}: the "
                               f"safetensors library refuses such a file")
        at += t.length
    if at != size:
        raise MoepackError(f"{name}: {size - at} bytes after the last tensor's data: the safetensors library refuses "
                           f"such a file")


class OpenFiles:
    """A source's files, each opened once and read with pread (a short read is a truncated file, one line)."""

    def __init__(self):
        self._fds: dict[str, int] = {}

    def read(self, path: str, offset: int, length: int, what: str) -> bytes:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = open_regular(path)
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise MoepackError(f"{os.path.basename(path)}: short read for {what} (file truncated?)")
        return data

    def close(self, path: str | None = None) -> None:
        """Close every file, or only `path`."""
        for p in [path] if path is not None else list(self._fds):
            fd = self._fds.pop(p, None)
            if fd is not None:
                os.close(fd)


def check_weight_map(weight_map: dict, tensors: dict[str, SourceTensor], where: str = "") -> None:
    """Every tensor the index lists is in the shard it names."""
    for key, shard in weight_map.items():
        t = tensors.get(key)
        if t is None or os.path.basename(t.file) != shard:
            raise MoepackError(f"{where}tensor {key} is listed in the index under {shard} but is not in that shard")


class LocalSource:
    """What the converter asks of a source whose files are all on disk: nothing to fetch, nothing to release."""

    def fetch(self, order: list[str]) -> None:
        """Make these files (by base name) readable, in this order: already so."""

    def release(self, name: str) -> None:
        """The conversion is done with this file (and durable): a local source keeps it."""

    def download_need(self) -> dict[str, int]:
        """{directory: bytes} still to download: none."""
        return {}


INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def index_weight_map(index, where: str) -> tuple[dict[str, str], list[str]]:
    """(weight_map, the shard names it lists, sorted) of a parsed model.safetensors.index.json: a non-empty object
    of tensor names to file names in the checkpoint's own directory; MoepackError otherwise."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise MoepackError(f"{where}{INDEX_FILE} has no weight_map")
    strange = [v for v in weight_map.values() if not isinstance(v, str)]
    if strange:
        raise MoepackError(f"{where}{INDEX_FILE}: weight_map lists {strange[0]!r} as a shard (a file name is a string)")
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if "/" in shard or "\\" in shard or shard in ("", ".", ".."):
            raise MoepackError(f"{where}{INDEX_FILE} lists shard {shard!r} outside the checkpoint directory")
    return weight_map, shards


def weight_files(names: Iterable[str], index_shards: Callable[[], list[str]]) -> list[str]:
    """The safetensors files a checkpoint's weights are read from, given the file names at its top level, chosen as
    transformers' from_pretrained chooses: model.safetensors alone where there is one, even beside an index (a
    sharded save_pretrained over a single-file checkpoint leaves the old file, and transformers loads that), else
    the shards `index_shards()` reads from the index, else every *.safetensors there (transformers would refuse)."""
    names = set(names)
    if SINGLE_FILE in names:
        return [SINGLE_FILE]
    if INDEX_FILE in names:
        return index_shards()
    return sorted(n for n in names if n.endswith(".safetensors"))


_NUMBERED_SHARD = re.compile(r"(.*)-(\d+)-of-(\d+)\.safetensors")


def missing_numbered_shards(names: list[str]) -> list[str]:
    """The shards that `names` (without an index to list them) lacks by their own numbering, NAME-00002-of-00004:
    every number 1..total of each such series. A shard missing from a folder of numbered shards left the converter
    to say only that a layer lacks experts."""
    series: dict[tuple[str, str], set[int]] = {}
    for name in names:
        m = _NUMBERED_SHARD.fullmatch(name)
        if m:
            series.setdefault((m[1], m[3]), set()).add(int(m[2]))
    missing = []
    for (prefix, total), have in sorted(series.items()):
        width = len(total)
        missing += [f"{prefix}-{k:0{width}d}-of-{total}.safetensors" for k in range(1, int(total) + 1) if k not in have]
    return missing


def missing_shards_text(missing: list[str]) -> str:
    more = f" and {len(missing) - 1} more are" if len(missing) > 1 else " is"
    return f"shard {missing[0]}{more} missing"


class CheckpointDir(LocalSource):
    """A local HF checkpoint: config.json, shards (+ model.safetensors.index.json when sharded), tokenizer files."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.isdir(path):
            raise MoepackError(f"{path}: not a directory")
        self.config = self._read_json("config.json", required=True)
        weight_map = None

        def index_shards() -> list[str]:
            nonlocal weight_map
            weight_map, listed = index_weight_map(self._read_json(INDEX_FILE, required=True), "")
            return listed

        shards = weight_files(os.listdir(path), index_shards)
        if weight_map is None:
            if not shards:
                raise MoepackError(f"{path}: no *.safetensors files and no {INDEX_FILE}")
            gaps = missing_numbered_shards(shards)
            if gaps:
                raise MoepackError(f"{path}: {missing_shards_text(gaps)} (a partial copy or download?); there is no "
                                   f"{INDEX_FILE} to say more")
        self.shards = shards
        self.tensors: dict[str, SourceTensor] = {}
        for shard in shards:
            for key, t in read_safetensors_header(os.path.join(path, shard)).items():
                if key in self.tensors:
                    raise MoepackError(f"tensor {key} appears in both {os.path.basename(self.tensors[key].file)} "
                                       f"and {shard}")
                self.tensors[key] = t
        if weight_map is not None:
            check_weight_map(weight_map, self.tensors)
        self._files = OpenFiles()

    def _read_json(self, name: str, required: bool):
        p = os.path.join(self.path, name)
        if not os.path.exists(p):
            if required:
                raise MoepackError(f"{self.path}: missing {name}")
            return None
        return untrusted.load_file(p, max_bytes=MAX_SMALL_JSON_BYTES)

    def read(self, t: SourceTensor) -> bytes:
        return self._files.read(t.file, t.offset, t.length, t.name)

    def side_files(self) -> dict[str, dict]:
        """Tokenizer and generation files, as {name: {"encoding": "utf-8"|"base64", "data": str}}."""
        import base64

        out = {}
        for name in TOKENIZER_FILES:
            p = os.path.join(self.path, name)
            if not os.path.lexists(p):
                continue
            # one there that is not a file (or a link to nothing) is refused by the read: skipped, it had left the
            # container without its tokenizer, silently
            data = untrusted.read_bounded(p, MAX_SMALL_JSON_BYTES)
            if len(data) > MAX_SMALL_JSON_BYTES:
                raise MoepackError(f"{p}: more than {MAX_SMALL_JSON_BYTES} bytes (the limit of a tokenizer file)")
            try:
                out[name] = {"encoding": "utf-8", "data": data.decode("utf-8")}
            except UnicodeDecodeError:
                out[name] = {"encoding": "base64", "data": base64.b64encode(data).decode()}
        return out

    def file_sizes(self) -> dict[str, int]:
        return {s: os.path.getsize(os.path.join(self.path, s)) for s in self.shards}

    def foreign_types(self) -> dict[str, str]:
        """Tensors whose type a container cannot hold: none (every safetensors dtype here is a storage type)."""
        return {}

    def close(self) -> None:
        self._files.close()


class StreamedCheckpoint(CheckpointDir):
    """A hub checkpoint converted while its shards download (packer.hub.open_source(stream=True)).

    Its tensors (name, dtype, shape, size) come from the hub's safetensors metadata before any shard is here;
    `fetch(order)` starts the download in the order the conversion reads the shards; a read waits for its shard,
    whose own header is then read and must agree with the metadata. `release(shard)` says the shard is converted
    and durable: with a scratch folder (--no-keep-source) it is deleted then, and the folder when the source closes.
    `peak_kept_bytes`: the most shard bytes this source held on disk at once."""

    def __init__(self, path: str, tensors: dict[str, SourceTensor], sizes: dict[str, int], start_feed,
                 scratch: str | None = None, ahead: int | None = None):
        self.path = path
        self.config = self._read_json("config.json", required=True)
        self.tensors = tensors
        self.shards = sorted(sizes)
        self._sizes = sizes
        self._listed: dict[str, dict[str, SourceTensor]] = {s: {} for s in self.shards}  # shard -> its tensors
        for key, t in tensors.items():
            self._listed[os.path.basename(t.file)][key] = t
        self._start_feed = start_feed  # (order, ahead) -> a hub.ShardFeed
        self._feed = None
        self._ahead = ahead
        self.scratch = scratch
        self._headers: dict[str, dict[str, SourceTensor]] = {}
        self._released: set[str] = set()
        self._files = OpenFiles()
        self._lock = threading.Lock()
        self.kept_bytes = self.peak_kept_bytes = 0

    def fetch(self, order: list[str]) -> None:
        """Download these shards, in this order (the ones a resumed conversion still needs)."""
        self._feed = self._start_feed(list(order), self._ahead)

    def download_need(self) -> dict[str, int]:
        """{directory: bytes} the download will put on disk at most at once."""
        sizes = sorted((self._sizes[s] for s in self.shards if s not in self._headers), reverse=True)
        if self.scratch is None:
            return {self.path: sum(sizes)}
        return {self.scratch: sum(sizes[:self._ahead + 2])}  # one read, one waiting, `ahead` downloading

    def read(self, t: SourceTensor) -> bytes:
        here = self._arrived(os.path.basename(t.file))[t.name]
        return self._files.read(here.file, here.offset, here.length, t.name)

    def _arrived(self, shard: str) -> dict[str, SourceTensor]:
        with self._lock:
            header = self._headers.get(shard)
        if header is not None:
            return header
        if self._feed is None:
            raise MoepackError(f"{shard} read before the download started (fetch was not called)")
        header = read_safetensors_header(self._feed.wait(shard))
        expected = self._listed[shard]
        for key in sorted(set(expected) | set(header)):
            want, got = expected.get(key), header.get(key)
            if want is None or got is None or (want.dtype, want.shape, want.length) != (got.dtype, got.shape,
                                                                                     got.length):
                raise MoepackError(f"{shard}: tensor {key} is not what the hub's metadata said (the file changed "
                                   f"on the hub during the download?)")
        with self._lock:
            self._headers[shard] = header
            self.kept_bytes += self._sizes[shard]
            self.peak_kept_bytes = max(self.peak_kept_bytes, self.kept_bytes)
        return header

    def release(self, shard: str) -> None:
        if self.scratch is None or shard in self._released or shard not in self._headers:
            return
        path = os.path.join(self.path, shard)
        blob = os.path.realpath(path)  # huggingface_hub's cache: snapshots/<sha>/<name> links to blobs/<sha256>
        self._files.close(path)
        for p in {path, blob}:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        with self._lock:
            self._released.add(shard)
            self.kept_bytes -= self._sizes[shard]

    def file_sizes(self) -> dict[str, int]:
        return dict(self._sizes)

    def close(self) -> None:
        super().close()
        if self._feed is not None:
            self._feed.close(wait=False)
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def keep_refusal(source) -> str | None:
    """Why `--keep` cannot convert this source (a tensor in a type a container cannot hold), or None."""
    foreign = source.foreign_types()
    if not foreign:
        return None
    name = next(iter(foreign))
    kinds = ", ".join(sorted(set(foreign.values())))
    return (f"{len(foreign)} tensors ({name} first) are ggml {kinds}, which a container cannot keep as they are: "
            f"convert with a policy (--q8, --fp4, --bf16, ...) to requantize them")
