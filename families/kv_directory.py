"""The KV directory (format_spec/KV.md is normative) of any model family: what a prefill leaves for a decode engine.

One directory per prefill: `manifest.json` plus one safetensors file per layer, each written the moment that layer's
prefill ends, so a consumer can pull layer 0 while later layers still compute. This module is the container part,
the same for every family: the manifest (format, version, the model's identity, the tokens, the storage dtype, one
entry per layer with its file's size and xxh3), the atomic writes (temporary name, fsync, rename; a KV replaced only
once its successor is complete), the checks a reader performs, and the storage of a row-major tensor in a KV dtype.
What a layer file holds is the family's: its `KVFormat` (families/base.py) says how one layer's state becomes
tensors and back, and which shape facts of its config (the manifest's `geometry`) the tensors depend on:

    KVWriter(kv_dir, kv_format, identity_of_container(c), token_ids)     the manifest: no layer complete yet
    writer.write_layer(layer, state) ... writer.finish(next_token, logits)
    read_kv(kv_dir, kv_format, expect_identity=...)                      every check of KV.md section 7

`kv_format` may also be a function of the manifest's `identity.architecture` returning the format (a reader that
does not know the family beforehand: `moepack kv inspect`). Each family's format is in its package
(families/<family>/kv.py), which may also give these names bound to its format.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import numpy as np
import torch
import xxhash
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from moepack.format_spec import untrusted
from moepack.format_spec.dtypes import STORAGE_TYPES
from moepack.format_spec.errors import FormatError, MoepackError, error_reason, is_disk_full
from moepack.format_spec.files import check_free_space, exclusive_lock, release_lock
from moepack.format_spec.writer import fsync_dir, fsync_file, replace_directory, write_file_atomically

if TYPE_CHECKING:
    from .base import KVFormat

KV_FORMAT = "moepack-kv"
KV_MAJOR = 1
KV_MINOR = 0
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 256 << 20  # a manifest holds the prompt's ids: a million tokens take under 8 MiB
LOGITS_NAME = "logits.safetensors"

# Storage choices of the attended-over KV a family stores in the manifest's dtype (its working state is F32).
KV_DTYPES = ("F32", "BF16", "F8_E4M3")
TORCH_DTYPES = {n: STORAGE_TYPES[n].torch_dtype for n in KV_DTYPES}
DTYPE_BYTES = {n: STORAGE_TYPES[n].block_bytes for n in KV_DTYPES}
_F8_MAX = 448.0  # largest finite float8 e4m3fn


def check_dtype(dtype: str) -> str:
    if dtype not in KV_DTYPES:
        raise MoepackError(f"unknown KV dtype {dtype!r} (choose one of {', '.join(KV_DTYPES)})")
    return dtype


def row_bytes(width: int, dtype: str) -> int:
    """Bytes of one stored KV row: the values, plus its F32 scale for F8_E4M3."""
    return width * DTYPE_BYTES[dtype] + (4 if dtype == "F8_E4M3" else 0)


def encode_rows(t: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """A KV tensor in its storage dtype: {"": data} plus {".scale": per-row (last axis) F32 scale} for F8_E4M3."""
    t = t.detach().to("cpu", torch.float32)
    if dtype == "F32":
        return {"": t.contiguous()}
    if dtype == "BF16":
        return {"": t.to(torch.bfloat16).contiguous()}
    scale = (t.abs().amax(dim=-1, keepdim=True) / _F8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return {"": (t / scale).clamp(-_F8_MAX, _F8_MAX).to(torch.float8_e4m3fn).contiguous(), ".scale": scale}


def store_rows(tensors: dict, name: str, t: torch.Tensor, dtype: str) -> None:
    """Into `tensors` (a layer file's, name -> tensor): `t` as `name` in its storage dtype (encode_rows)."""
    for suffix, part in encode_rows(t, dtype).items():
        tensors[name + suffix] = part


def decode_rows(tensors: Mapping[str, torch.Tensor], name: str, dtype: str) -> torch.Tensor:
    """encode_rows' tensor `name` back as float32."""
    t = tensors[name]
    if dtype == "F8_E4M3":
        return t.float() * tensors[name + ".scale"]
    return t.float()


def expect_rows(expected: dict, name: str, shape: tuple[int, ...], dtype: str) -> None:
    """Into `expected` (name -> (shape, torch dtype)): the stored form of a tensor `encode_rows` wrote in `dtype`."""
    expected[name] = (tuple(shape), TORCH_DTYPES[dtype])
    if dtype == "F8_E4M3":
        expected[name + ".scale"] = ((*shape[:-1], 1), torch.float32)


def check_tensors(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, tuple], kind: str) -> None:
    """A layer file's tensors are exactly `expected` (name -> (shape, torch dtype)); else FormatError naming the
    first difference (`kind`: what the layer is, for the message)."""
    if set(tensors) != set(expected):
        extra, missing = sorted(set(tensors) - set(expected)), sorted(set(expected) - set(tensors))
        raise FormatError(f"tensors do not match the layer's kind ({kind}): "
                          f"{'missing ' + ', '.join(missing) if missing else ''}{'; ' if missing and extra else ''}"
                          f"{'unexpected ' + ', '.join(extra) if extra else ''}")
    for name, (shape, tdtype) in expected.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(shape) or t.dtype != tdtype:
            raise FormatError(f"{name} is {t.dtype} {list(t.shape)}, expected {tdtype} {list(shape)}")


def layer_file_bytes(layer: int, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str], dtype: str
                     ) -> bytes:
    """The safetensors bytes of one layer file: the family's tensors, and its `__metadata__` after the format's."""
    meta = {"format": KV_FORMAT, "format_version": f"{KV_MAJOR}.{KV_MINOR}", "layer": str(layer), **metadata,
            "dtype": dtype}
    return _st_save(dict(tensors), metadata=meta)


# ---------------------------------------------------------------------------------------------------------------
# Identity and prompt
# ---------------------------------------------------------------------------------------------------------------


def _json_value(value):
    """`value` as JSON reads it back (integer keys become strings, tuples lists)."""
    return json.loads(json.dumps(value))


def canonical_json(value) -> bytes:
    return json.dumps(_json_value(value), sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def config_xxh3(config: Mapping) -> str:
    return xxhash.xxh3_64_hexdigest(canonical_json(config))


def token_ids_xxh3(token_ids: Iterable[int]) -> str:
    """xxh3 of the ids as little-endian int64."""
    return xxhash.xxh3_64_hexdigest(np.asarray(list(token_ids), dtype="<i8").tobytes())


def make_identity(architecture: str, config: Mapping, container_index_xxh3: int | str | None = None) -> dict:
    """The model identity a KV records: the container's index hash (`Container.header.index_xxh3`, an int, or
    its 16-digit hex; None for weights that did not come from a container), architecture and config."""
    if isinstance(container_index_xxh3, int):
        container_index_xxh3 = f"{container_index_xxh3:016x}"
    return {"architecture": architecture, "container_index_xxh3": container_index_xxh3,
            "config_xxh3": config_xxh3(config), "config": _json_value(dict(config))}


def identity_of_container(container) -> dict:
    """Identity of an open `format_spec.reader.Container`."""
    return make_identity(container.architecture, container.config, container.header.index_xxh3)


def _identity_mismatch(recorded: Mapping, expected: Mapping) -> str | None:
    if expected.get("architecture") != recorded.get("architecture"):
        return f"architecture {recorded.get('architecture')!r}, expected {expected.get('architecture')!r}"
    want = expected.get("config_xxh3") or config_xxh3(expected["config"])
    if recorded.get("config_xxh3") != want:
        return f"config xxh3 {recorded.get('config_xxh3')}, expected {want}"
    ours, theirs = recorded.get("container_index_xxh3"), expected.get("container_index_xxh3")
    if ours and theirs and ours != theirs:  # (the same config: other weights, or another conversion of them)
        return (f"container index xxh3 {ours}, expected {theirs} (a model of the same config: other weights, or "
                "another conversion of them, whose KV may differ)")
    return None


def _ids(token_ids) -> list[int]:
    """Token ids (a tensor or any iterable of ints) as a list of ints."""
    return [int(t) for t in (token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids)]


def _prompt_mismatch(recorded: list[int], expected: list[int]) -> str:
    first = next((i for i, (a, b) in enumerate(zip(recorded, expected)) if a != b), min(len(recorded), len(expected)))
    return (f"the KV holds {len(recorded)} tokens (xxh3 {token_ids_xxh3(recorded)}), the prompt has {len(expected)} "
            f"(xxh3 {token_ids_xxh3(expected)}); they differ from position {first}")


# ---------------------------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------------------------


def layer_file_name(layer: int) -> str:
    return f"layer-{layer:04d}.safetensors"


# The files a KV directory holds (KV.md section 2); anything else in one is the user's, kept when it is replaced.
KV_FILE = re.compile(r"(manifest\.json|logits\.safetensors|layer-[0-9]{4,}\.safetensors)(\.partial)?")


def replacement_paths(kv_dir: str) -> tuple[str, str]:
    """Where a KV replacing the one in `kv_dir` is written (beside it, hidden), and where the old one waits while
    the two are swapped without an atomic exchange."""
    parent, name = os.path.split(os.path.realpath(kv_dir))
    return os.path.join(parent, f".{name}.kv-new"), os.path.join(parent, f".{name}.kv-old")


def kv_lock_path(kv_dir: str) -> str:
    """The lock file a KV's writer holds (beside it, hidden; removed as the writer lets go)."""
    parent, name = os.path.split(os.path.realpath(kv_dir))
    return os.path.join(parent, f".{name}.kv-lock")


def clean_interrupted_replacement(kv_dir: str) -> None:
    """What a replacement of `kv_dir`'s KV left when it was killed: its new directory (unfinished, or the old KV
    after the exchange) is removed; an old KV moved aside by the fallback's two renames goes back to `kv_dir`
    (killed between them) or is removed (killed after them)."""
    target = os.path.realpath(kv_dir)
    new, old = replacement_paths(target)
    try:
        if os.path.isdir(old) and not os.path.islink(old):
            if os.path.lexists(target):
                shutil.rmtree(old)
            else:
                os.rename(old, target)
        if os.path.isdir(new) and not os.path.islink(new):
            shutil.rmtree(new)
    except OSError as e:
        raise MoepackError(f"{kv_dir}: cannot clean up an interrupted replacement of its KV ({error_reason(e)})") \
            from None


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _carry_over(old_dir: str, new_dir: str) -> None:
    """The user's own entries of a KV directory (not KV files) into its replacement, hard-linked where possible:
    the old directory keeps them until it is swapped out."""
    for name in os.listdir(old_dir):
        if KV_FILE.fullmatch(name) or os.path.lexists(os.path.join(new_dir, name)):
            continue
        src, dst = os.path.join(old_dir, name), os.path.join(new_dir, name)
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
        elif os.path.isdir(src):
            shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(src, dst)


def ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0..2, 5"."""
    out, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}..{n}")
            start = None
    return ", ".join(out)


# ---------------------------------------------------------------------------------------------------------------
# Writer
# ---------------------------------------------------------------------------------------------------------------


class KVWriter:
    """Writes one KV directory of `kv_format`'s family. `write_layer` may be called from any thread, in any layer
    order, once per layer; the manifest is only touched under a lock. Usage::

        w = KVWriter(kv_dir, kv_format, identity_of_container(c), token_ids)   the manifest: no layer complete yet
        for layer: w.write_layer(layer, state)                                   file, then manifest marks it complete
        w.finish(next_token=..., logits=last_logits)                             "complete": true

    For a continuation (`--continue-from`), `token_ids` is the whole prompt the KV now covers (old + new tokens)
    and `start_token` the number of tokens the KV continued from.

    `sync=True` (default) fsyncs every file as it is written (KV.md section 8): a layer the manifest marks complete
    survives a crash. `sync=False` only renames (readers on the running system still never see a partial file) and
    fsyncs everything once, in `finish()`: per layer that saves the fsync latency (~15 ms of ~20 ms per layer on
    the test machine).

    A directory that already holds a KV (`overwrite`, or a continuation written where it was read from) keeps it
    until the new one is complete: the new KV is written beside it (`replacement_paths`) and swapped in by
    `finish()` (`format_spec.writer.replace_directory`); a failed write, or `abandon()`, removes the new one and
    leaves the old one as it was. A stale new directory of a killed run is removed first."""

    def __init__(self, kv_dir: str, kv_format: KVFormat, identity: Mapping, token_ids, dtype: str = "F32",
                 start_token: int = 0, overwrite: bool = False, sync: bool = True, extra: Mapping | None = None):
        self.kv_dir = str(kv_dir)
        self.kv_format = kv_format
        self.dtype = check_dtype(dtype)
        self.sync = sync
        if "config" not in identity or "architecture" not in identity:
            raise MoepackError("KV identity needs at least 'architecture' and 'config'")
        identity = dict(identity)
        identity.setdefault("container_index_xxh3", None)
        identity["config_xxh3"] = config_xxh3(identity["config"])
        self.geometry = kv_format.geometry(identity["config"])
        ids = _ids(token_ids)
        if not ids:
            raise MoepackError("KV of an empty prompt")
        if not 0 <= start_token < len(ids):
            raise MoepackError(f"start_token {start_token} outside the prompt of {len(ids)} tokens")
        self.n_tokens = len(ids)
        self._hold, self._hold_path = None, kv_lock_path(self.kv_dir)
        self._extra = extra
        try:
            self._open(kv_format, identity, ids, start_token, overwrite)
        except BaseException:
            self._let_go()
            raise

    def _open(self, kv_format: KVFormat, identity: dict, ids: list[int], start_token: int, overwrite: bool) -> None:
        # one writer of a KV at a time: a second one's clean-up would take the first one's new directory for a
        # killed run's, and both would then write into one (a damaged KV, its writer exiting 0)
        os.makedirs(os.path.dirname(self._hold_path), exist_ok=True)
        self._hold = exclusive_lock(self._hold_path, f"another process is writing the KV in {self.kv_dir}: wait "
                                                     "for it to finish, or write elsewhere")
        clean_interrupted_replacement(self.kv_dir)
        self.replacing = os.path.lexists(os.path.join(self.kv_dir, MANIFEST_NAME))
        if self.replacing and not overwrite:
            raise MoepackError(f"{self.kv_dir} already holds a KV ({MANIFEST_NAME}); choose another directory")
        self._finished = False
        need = kv_format.kv_bytes(identity["config"], len(ids), self.dtype)
        if self.replacing:  # all of the new KV beside the old one
            self.write_dir = replacement_paths(self.kv_dir)[0]
            if os.path.ismount(os.path.realpath(self.kv_dir)):
                raise MoepackError(f"{self.kv_dir} is a mount point: a KV is replaced by renaming its directory, "
                                   "which a mount point cannot be; write the KV to a directory inside it")
            self._check_free_space({os.path.dirname(self.write_dir): need},
                                   f"{self.kv_dir}'s new KV beside the old one")
        else:  # a layer's file replaces a stale one of the same name: that room comes back
            self.write_dir = self.kv_dir
            layer_files = (os.path.join(self.kv_dir, layer_file_name(i)) for i in range(self.geometry["num_layers"]))
            need -= sum(os.path.getsize(p) for p in layer_files if os.path.isfile(p))
            self._check_free_space({self.kv_dir: need}, f"the KV in {self.kv_dir}")
        try:
            if self.replacing:
                os.mkdir(self.write_dir, os.stat(self.kv_dir).st_mode & 0o7777)
            else:
                os.makedirs(self.kv_dir, exist_ok=True)
        except OSError as e:
            raise MoepackError(f"{self.write_dir}: cannot create the KV directory ({e.strerror or e})") from None
        self._lock = threading.Lock()
        self._claimed: set[int] = set()  # layers whose write has started
        self.manifest: dict[str, Any] = {
            "format": KV_FORMAT,
            "format_version": [KV_MAJOR, KV_MINOR],
            "identity": identity,
            "geometry": self.geometry,
            "tokens": {"count": len(ids), "start": start_token, "ids_xxh3": token_ids_xxh3(ids), "ids": ids},
            "dtype": self.dtype,
            "layers": [{"layer": i, "file": layer_file_name(i), "complete": False}
                       for i in range(self.geometry["num_layers"])],
            "complete": False,
            "result": None,
            "extra": dict(self._extra or {}),
        }
        self._ids_json = json.dumps(ids, separators=(",", ":"))  # the large part, serialised once
        self._write_manifest()

    # (two seams: a family's module may route them through its own names, where its tests replace them)
    def _check_free_space(self, needs: dict, what: str) -> None:
        check_free_space(needs, what)

    def _write_file(self, path: str, data: bytes, sync: bool) -> None:
        write_file_atomically(path, data, sync)

    def _failed(self, e: OSError, what: str) -> MoepackError:
        """The one-line error of a write that failed; a replacement is abandoned, the old KV untouched."""
        full = " (disk full)" if is_disk_full(e) else ""
        if self.replacing:
            self.abandon()
            return MoepackError(f"{self.kv_dir}: cannot write the new KV's {what} ({error_reason(e)}){full}; the KV "
                                "there is unchanged")
        return MoepackError(f"{os.path.join(self.kv_dir, what)}: cannot write ({error_reason(e)}){full}")

    def _write(self, name: str, data: bytes, sync: bool) -> None:
        """`data` as the file `name` (temporary name, fsync, rename, fsync the directory; without `sync` renamed)."""
        try:
            self._write_file(os.path.join(self.write_dir, name), data, sync)
        except OSError as e:
            raise self._failed(e, name) from None
        if sync:
            fsync_dir(self.write_dir)

    def _write_manifest(self, durable: bool = False) -> None:
        m = dict(self.manifest, tokens=dict(self.manifest["tokens"], ids="@IDS@"))
        text = json.dumps(m, indent=1).replace('"@IDS@"', self._ids_json, 1)
        self._write(MANIFEST_NAME, text.encode(), self.sync or durable)

    def write_layer(self, layer: int, state) -> dict:
        """Write `layer-NNNN.safetensors` (temp name, fsync, rename), then rewrite the manifest marking the layer
        complete. Returns the layer's manifest entry."""
        g, fmt = self.geometry, self.kv_format
        if not 0 <= layer < g["num_layers"]:
            raise MoepackError(f"layer {layer} outside 0..{g['num_layers'] - 1}")
        fmt.check_state(g, layer, state)
        seen = fmt.seen_tokens(state)
        if seen != self.n_tokens:
            raise MoepackError(f"layer {layer}: state covers {seen} tokens, the KV's prompt has {self.n_tokens}")
        with self._lock:
            if layer in self._claimed:
                raise MoepackError(f"layer {layer} written twice")
            self._claimed.add(layer)
        tensors, metadata, summary = fmt.layer_tensors(g, layer, state, self.dtype)
        data = layer_file_bytes(layer, tensors, metadata, self.dtype)
        self._write(layer_file_name(layer), data, self.sync)
        entry = {"layer": layer, "file": layer_file_name(layer), "complete": True, **summary,
                 "bytes": len(data), "xxh3": xxhash.xxh3_64_hexdigest(data)}
        with self._lock:
            self.manifest["layers"][layer] = entry
            self._write_manifest()
        return entry

    def finish(self, next_token: int | None = None, logits: torch.Tensor | None = None) -> dict:
        """Mark the KV complete once every layer is written; record the prefill's result (the greedy next token,
        and optionally the last position's logits [vocab] in `logits.safetensors`, F32). A replacement is then
        swapped in for the old KV."""
        with self._lock:
            missing = [e["layer"] for e in self.manifest["layers"] if not e["complete"]]
            if missing:
                raise MoepackError(f"{self.kv_dir}: cannot finish, layers {ranges(missing)} not written")
            result: dict[str, Any] = {"next_token": None if next_token is None else int(next_token), "logits": None}
            if logits is not None:
                data = _st_save({"logits": logits.detach().to("cpu", torch.float32).reshape(-1).contiguous()},
                                metadata={"format": KV_FORMAT})
                self._write(LOGITS_NAME, data, True)
                result["logits"] = {"file": LOGITS_NAME, "bytes": len(data), "xxh3": xxhash.xxh3_64_hexdigest(data)}
            if not self.sync:  # layers were not fsynced as written: make the finished KV durable now
                for e in self.manifest["layers"]:
                    try:
                        fsync_file(os.path.join(self.write_dir, e["file"]))
                    except OSError as err:
                        raise self._failed(err, e["file"]) from None
                fsync_dir(self.write_dir)
            self.manifest["result"] = result
            self.manifest["complete"] = True
            self._write_manifest(durable=True)
            if self.replacing:
                self._swap_in()
            self._finished = True
        self._let_go()
        return self.manifest

    def _let_go(self) -> None:
        release_lock(self._hold, self._hold_path)
        self._hold = None

    def _swap_in(self) -> None:
        target = os.path.realpath(self.kv_dir)
        try:
            _carry_over(target, self.write_dir)
            replace_directory(self.write_dir, target, replacement_paths(target)[1])
        except OSError as e:
            self.abandon()
            raise MoepackError(f"{self.kv_dir}: cannot put the new KV in place of the old one ({error_reason(e)}); "
                               "the KV there is unchanged") from None

    def abandon(self) -> None:
        """Give up an unfinished KV: a replacement's new directory is removed (the old KV stays as it was); a KV
        written straight into its directory keeps its complete layers (the manifest says which)."""
        if self.replacing and not self._finished:
            shutil.rmtree(self.write_dir, ignore_errors=True)
        self._let_go()


def open_writer(kv_dir: str, kv_format: KVFormat, identity: Mapping, token_ids, **options) -> KVWriter:
    """A KVWriter of `kv_format`'s directory (options: KVWriter's): the format's own `writer` where it has one (a
    subclass routing the writer's file system calls through its own module), else KVWriter."""
    own = getattr(kv_format, "writer", None)
    if own is not None:
        return own(kv_dir, identity, token_ids, **options)
    return KVWriter(kv_dir, kv_format, identity, token_ids, **options)


def copied_states(kv_format: KVFormat, config: Mapping, states) -> list:
    """Each layer's state copied through the format's own float32 tensors, on the CPU: a decode that continues a
    state in place leaves the copy as it was."""
    return host_copy(kv_format, config, states)[0]


def host_copy(kv_format: KVFormat, config: Mapping, states) -> tuple[list, int]:
    """copied_states, and the bytes of the copy's tensors (what holding it costs the host)."""
    geometry, copies, nbytes = kv_format.geometry(config), [], 0
    for layer, state in enumerate(states):
        tensors, _, entry = kv_format.layer_tensors(geometry, layer, state, "F32")
        own = {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}
        nbytes += sum(t.numel() * t.element_size() for t in own.values())
        copies.append(kv_format.layer_state(geometry, layer, {"seen_tokens": kv_format.seen_tokens(state), **entry},
                                            own, "F32"))
    return copies, nbytes


def computed_in(dtype: str, continued: "KVCache | None" = None) -> dict:
    """A KV's manifest `extra`: the compute dtypes its tokens were computed in (this run's, and those of the KV it
    continues). A continuation in another dtype than its KV's is told (kv_dtype_warning)."""
    return {"compute_dtypes": sorted({dtype, *(_computed_dtypes(continued) if continued is not None else [])})}


def _computed_dtypes(kv: "KVCache") -> list:
    """The compute dtypes a KV's manifest records (none where an older writer recorded none)."""
    recorded = kv.manifest.get("extra", {}).get("compute_dtypes")
    return recorded if isinstance(recorded, list) else []


def kv_dtype_warning(continued: "KVCache", dtype: str) -> None:
    """A warning where a KV computed in other dtypes is continued in `dtype`: the logits are then neither run's
    (a bfloat16 KV continued in float32 differs from a float32 prefill of the whole by about 3e-2, not 2e-6)."""
    import warnings

    before = _computed_dtypes(continued)
    if before and set(before) != {dtype}:
        warnings.warn(f"{continued.path}: the KV was computed in {', '.join(map(str, before))}; this run computes in "
                      f"{dtype} (--compute-dtype): its logits are not a {dtype} prefill's of the whole", stacklevel=2)


def model_device_and_dtype(model, device=None, dtype=None) -> tuple[torch.device, torch.dtype]:
    """Where a transformers cache for `model` keeps its tensors: `device` / `dtype` where given, else its
    parameters' (CPU, float32 for a model without any)."""
    param = next(model.parameters(), None)
    device = device if device is not None else (param.device if param is not None else torch.device("cpu"))
    return device, dtype if dtype is not None else (param.dtype if param is not None else torch.float32)


def write_kv_states(writer: KVWriter, states, next_token: int | None, logits: torch.Tensor | None) -> None:
    """Every layer's state (in order) through `writer`, then its finish; on any failure the writer is abandoned (a
    KV being replaced stays as it was) and the error raised."""
    try:
        for layer, state in enumerate(states):
            writer.write_layer(layer, state)
        writer.finish(next_token, logits)
    except BaseException:
        writer.abandon()
        raise


class BackgroundKVWriter:
    """A KVWriter fed by the prefill: `submit(layer, state)` (the engine's `on_layer_kv`) takes the state off the
    compute device and queues it; one writer thread writes layers in order while later layers compute. A write
    error is re-raised by the next `submit`, by `finish` or by `close`. At most `max_pending` layers wait in
    memory (the prefill blocks beyond that, so a slow disk cannot grow memory without bound)."""

    def __init__(self, writer: KVWriter, max_pending: int = 4):
        self.writer = writer
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self.write_seconds = 0.0  # time the writer thread spent writing
        self.submit_seconds = 0.0  # time submit() took on the caller's (compute) thread
        self._thread = threading.Thread(target=self._run, name="moepack-kv-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is not None:
                continue  # drain after a failure
            try:
                t0 = time.perf_counter()
                self.writer.write_layer(*item)
                self.write_seconds += time.perf_counter() - t0
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                self._error = e

    def _raise(self) -> None:
        if self._error is not None:
            e = self._error
            if isinstance(e, MoepackError):
                raise e
            raise MoepackError(f"writing the KV to {self.writer.kv_dir} failed: {e}") from e

    def submit(self, layer: int, state) -> None:
        t0 = time.perf_counter()
        self._raise()
        # synchronous copy: the device memory can go as soon as this returns
        self._queue.put((layer, self.writer.kv_format.on_host(state)))
        self.submit_seconds += time.perf_counter() - t0

    __call__ = submit  # usable directly as on_layer_kv

    def close(self) -> None:
        """Wait for the queued layers to be written."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._raise()

    def finish(self, next_token: int | None = None, logits: torch.Tensor | None = None) -> dict:
        self.close()
        return self.writer.finish(next_token, logits)

    def abandon(self) -> None:
        """After the prefill failed: the queued layers written (their error not raised: the prefill's is the one to
        report), then `KVWriter.abandon`."""
        try:
            self.close()
        except MoepackError:
            pass
        finally:
            self.writer.abandon()


# ---------------------------------------------------------------------------------------------------------------
# Reader
# ---------------------------------------------------------------------------------------------------------------


def is_count(v, minimum: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _is_hex(v) -> bool:
    return isinstance(v, str) and len(v) == 16 and all(c in "0123456789abcdef" for c in v)


@dataclass
class KVCache:
    """A validated, loaded KV directory."""

    path: str
    manifest: dict
    identity: dict
    geometry: dict
    token_ids: list[int]
    start_token: int
    dtype: str
    layers: list
    complete: bool
    next_token: int | None = None
    logits: torch.Tensor | None = None
    bytes: int = 0
    files: dict = field(default_factory=dict)

    @property
    def seen_tokens(self) -> int:
        return len(self.token_ids)

    def new_tokens(self, token_ids) -> list[int]:
        """For a prompt that continues this KV's: the tokens after the KV's (FormatError if the KV's tokens are not
        a strict prefix of `token_ids`)."""
        ids = _ids(token_ids)
        if len(ids) <= len(self.token_ids) or ids[:len(self.token_ids)] != self.token_ids:
            raise FormatError(f"{self.path}: prompt mismatch: the prompt does not continue the KV's: "
                              f"{_prompt_mismatch(self.token_ids, ids)}")
        return ids[len(self.token_ids):]


class KVDirectory:
    """A KV directory opened for reading: the manifest is validated on open (and on `refresh()`); layers are
    loaded and checked one at a time with `layer(i)`, so a consumer can pull layer i as soon as
    `layer_complete(i)` while the prefill still writes later ones. `kv_format`: the family's KVFormat, or a function
    of the manifest's architecture giving it (raising a MoepackError for one it has none for). `expect_identity`:
    checked as soon as the manifest's identity is read, so another model's KV (another family's too) is named as
    such, not by what its config lacks for this family's format."""

    def __init__(self, kv_dir: str, kv_format, expect_identity: Mapping | None = None):
        self.path = str(kv_dir)
        self._format_choice = kv_format
        self._expect_identity = expect_identity
        self.refresh()

    def _fail(self, msg: str):
        raise FormatError(f"{self.path}: {msg}")

    def _manifest_limit(self) -> int:  # (a seam, as KVWriter's)
        return MAX_MANIFEST_BYTES

    def refresh(self) -> None:
        path, limit = os.path.join(self.path, MANIFEST_NAME), self._manifest_limit()
        if not os.path.isdir(self.path):
            self._fail("no such KV directory")
        try:  # a regular file only (a symlink to /dev/zero, a FIFO: refused, not read), at most its bound
            raw = untrusted.read_bounded(path, limit,
                                         missing=f"{self.path}: no {MANIFEST_NAME}: not a moepack KV directory")
        except OSError as e:
            self._fail(f"cannot read {MANIFEST_NAME} ({e.strerror or e})")
        if len(raw) > limit:
            self._fail(f"{MANIFEST_NAME} is larger than {limit} bytes (the limit)")
        try:
            m = untrusted.loads(raw, MANIFEST_NAME, max_bytes=limit)
        except untrusted.UntrustedInputError as e:  # bad UTF-8 or JSON, a too long number, too deep nesting
            self._fail(f"{MANIFEST_NAME} is not valid JSON ({e.detail})")
        self.manifest = self._validate(m)

    def _resolve_format(self, architecture: str) -> KVFormat:
        choice = self._format_choice
        if callable(choice) and not hasattr(choice, "geometry"):
            try:
                return choice(architecture)
            except MoepackError as e:
                self._fail(f"{MANIFEST_NAME}: {e}")
        return choice

    def _validate(self, m) -> dict:
        fail = self._fail
        if not isinstance(m, dict) or m.get("format") != KV_FORMAT:
            fail(f"{MANIFEST_NAME}: not a moepack KV manifest (format must be {KV_FORMAT!r})")
        version = m.get("format_version")
        if not (isinstance(version, list) and len(version) == 2 and all(is_count(v) for v in version)):
            fail(f"{MANIFEST_NAME}: format_version must be [major, minor]")
        if version[0] != KV_MAJOR:
            fail(f"KV format version {version[0]}.{version[1]} is not supported (this reader knows {KV_MAJOR}.x)")
        for key, kind in (("identity", dict), ("geometry", dict), ("tokens", dict), ("dtype", str),
                          ("layers", list), ("complete", bool), ("extra", dict)):
            if not isinstance(m.get(key), kind):
                fail(f"{MANIFEST_NAME}: '{key}' missing or not a {kind.__name__}")
        ident = m["identity"]
        if not isinstance(ident.get("architecture"), str) or not isinstance(ident.get("config"), dict) \
                or not _is_hex(ident.get("config_xxh3")) \
                or not (ident.get("container_index_xxh3") is None or _is_hex(ident.get("container_index_xxh3"))):
            fail(f"{MANIFEST_NAME}: identity needs architecture, config, config_xxh3 (and container_index_xxh3 hex "
                 f"or null)")
        if config_xxh3(ident["config"]) != ident["config_xxh3"]:
            fail(f"{MANIFEST_NAME}: identity config does not match its config_xxh3")
        if self._expect_identity is not None:
            self.check_identity(self._expect_identity, ident)
        self.kv_format = fmt = self._resolve_format(ident["architecture"])
        try:
            geometry = fmt.geometry(ident["config"])
        except FormatError as e:
            fail(str(e))
        if canonical_json(m["geometry"]) != canonical_json(geometry):  # 3.0 == 3 in Python, not in the format
            fail(f"{MANIFEST_NAME}: geometry does not follow from the recorded config")
        if m["dtype"] not in KV_DTYPES:
            fail(f"{MANIFEST_NAME}: unknown dtype {m['dtype']!r}")
        tok = m["tokens"]
        ids = tok.get("ids")
        if not (isinstance(ids, list) and ids and all(is_count(t) and t < 1 << 63 for t in ids)) \
                or not is_count(tok.get("count")) or tok["count"] != len(ids) \
                or not is_count(tok.get("start")) or tok["start"] >= len(ids):
            fail(f"{MANIFEST_NAME}: tokens need ids (non-empty list of int64 ids), count = len(ids), start < count")
        if tok.get("ids_xxh3") != token_ids_xxh3(ids):
            fail(f"{MANIFEST_NAME}: token ids do not match their ids_xxh3")
        layers = m["layers"]
        if len(layers) != geometry["num_layers"]:
            fail(f"{MANIFEST_NAME}: {len(layers)} layer entries for a {geometry['num_layers']}-layer model")
        for i, e in enumerate(layers):
            if not isinstance(e, dict) or not is_count(e.get("layer")) or e["layer"] != i \
                    or e.get("file") != layer_file_name(i) \
                    or not isinstance(e.get("complete"), bool):
                fail(f"{MANIFEST_NAME}: layer entry {i} malformed")
            if not e["complete"]:
                continue
            if not is_count(e.get("seen_tokens")) or e["seen_tokens"] != len(ids) \
                    or not is_count(e.get("bytes"), 1) or not _is_hex(e.get("xxh3")) \
                    or not fmt.entry_valid(geometry, i, e):
                fail(f"{MANIFEST_NAME}: layer entry {i} malformed (complete layers record "
                     f"{', '.join(fmt.entry_fields)}, bytes, xxh3)")
        if m["complete"] and not all(e["complete"] for e in layers):
            fail(f"{MANIFEST_NAME}: marked complete with incomplete layers")
        result = m.get("result")
        if result is not None and not (isinstance(result, dict) and
                                       (result.get("next_token") is None or is_count(result.get("next_token")))):
            fail(f"{MANIFEST_NAME}: result malformed")
        return m

    # --- properties --------------------------------------------------------------------------------------------
    @property
    def identity(self) -> dict:
        return self.manifest["identity"]

    @property
    def geometry(self) -> dict:
        return self.manifest["geometry"]

    @property
    def token_ids(self) -> list[int]:
        return self.manifest["tokens"]["ids"]

    @property
    def num_layers(self) -> int:
        return self.geometry["num_layers"]

    def layer_complete(self, layer: int) -> bool:
        return self.manifest["layers"][layer]["complete"]

    def incomplete_layers(self) -> list[int]:
        return [e["layer"] for e in self.manifest["layers"] if not e["complete"]]

    def check_identity(self, expected: Mapping, recorded: Mapping | None = None) -> None:
        problem = _identity_mismatch(self.identity if recorded is None else recorded, expected)
        if problem:
            self._fail(f"KV from another model: {problem}")

    def check_prompt(self, expected) -> None:
        ids = _ids(expected)
        if ids != self.token_ids:
            self._fail(f"prompt mismatch: {_prompt_mismatch(self.token_ids, ids)}")

    # --- layers ------------------------------------------------------------------------------------------------
    def _read_checked(self, name: str, size: int, digest: str, what: str) -> bytes:
        path = os.path.join(self.path, name)
        try:  # a regular file only (a FIFO in its place would block the read forever), sized by the file too
            data = untrusted.read_bounded(path, size, missing=f"{what}: file {name} is missing")
        except FormatError as e:
            self._fail(str(e))
        except OSError as e:
            self._fail(f"{what}: cannot read {name} ({e.strerror or e})")
        if len(data) != size:
            real = os.path.getsize(path)
            if real < size:
                self._fail(f"{what}: file {name} is truncated ({real} of {size} bytes)")
            self._fail(f"{what}: file {name} has {real} bytes, the manifest records {size}")
        if xxhash.xxh3_64_hexdigest(data) != digest:
            self._fail(f"{what}: file {name} is damaged (xxh3 mismatch)")
        return data

    def layer(self, layer: int, device="cpu", dtype: torch.dtype = torch.float32):
        """Load, check and decode one complete layer (FormatError if it is not complete yet): the family's state."""
        if not 0 <= layer < self.num_layers:
            self._fail(f"layer {layer} outside 0..{self.num_layers - 1}")
        e = self.manifest["layers"][layer]
        if not e["complete"]:
            self._fail(f"layer {layer} is not complete (prefill still running, or interrupted)")
        data = self._read_checked(e["file"], e["bytes"], e["xxh3"], f"layer {layer}")
        what = f"layer {layer} ({e['file']})"
        try:
            tensors = _st_load(data)
        except Exception as err:  # noqa: BLE001 - any parse failure is a damaged file
            self._fail(f"{what}: not a readable safetensors file ({err})")
        for name, t in tensors.items():  # (a prefill's states are finite: a decode would carry it to every token)
            if t.is_floating_point() and not bool(torch.isfinite(t.float()).all()):
                self._fail(f"{what}: {name} holds a NaN or an infinity")
        try:
            state = self.kv_format.layer_state(self.geometry, layer, e, tensors, self.manifest["dtype"])
        except FormatError as err:
            self._fail(f"{what}: {err}")
        return self.kv_format.moved(state, device, dtype)

    def result(self) -> tuple[int | None, torch.Tensor | None]:
        """(next_token, last-position logits or None) recorded by finish()."""
        r = self.manifest.get("result") or {}
        logits = None
        if r.get("logits"):
            info = r["logits"]
            if not (isinstance(info, dict) and info.get("file") == LOGITS_NAME and is_count(info.get("bytes"), 1)
                    and _is_hex(info.get("xxh3"))):
                self._fail(f"{MANIFEST_NAME}: result.logits malformed")
            data = self._read_checked(LOGITS_NAME, info["bytes"], info["xxh3"], "logits")
            try:
                logits = _st_load(data)["logits"]
            except Exception as err:  # noqa: BLE001
                self._fail(f"logits: not a readable safetensors file ({err})")
        return r.get("next_token"), logits


def read_kv(kv_dir: str, kv_format, expect_identity: Mapping | None = None, expect_prompt=None,
            prompt_prefix_of=None, device="cpu", dtype: torch.dtype = torch.float32,
            directory: Callable[..., KVDirectory] = KVDirectory) -> KVCache:
    """Load and validate a complete KV directory: manifest schema, every layer complete, every file present with the
    recorded size and xxh3, tensors as the family's format requires; then identity (`expect_identity`, e.g.
    `identity_of_container(c)`) and prompt (`expect_prompt`: the exact token ids; or `prompt_prefix_of`: a longer
    prompt the KV's tokens must begin). FormatError, one line, naming the problem."""
    d = directory(kv_dir, kv_format, expect_identity)
    if expect_prompt is not None:
        d.check_prompt(expect_prompt)
    missing = d.incomplete_layers()
    if missing:
        d._fail(f"KV incomplete: layers {ranges(missing)} of {d.num_layers} not written "
                f"(prefill still running, or interrupted)")
    layers = [d.layer(i, device, dtype) for i in range(d.num_layers)]
    next_token, logits = d.result()
    m = d.manifest
    kv = KVCache(path=d.path, manifest=m, identity=d.identity, geometry=d.geometry, token_ids=list(d.token_ids),
                 start_token=m["tokens"]["start"], dtype=m["dtype"], layers=layers, complete=m["complete"],
                 next_token=next_token, logits=logits, bytes=sum(e["bytes"] for e in m["layers"]))
    if prompt_prefix_of is not None:
        kv.new_tokens(prompt_prefix_of)
    return kv


def inspect_kv(kv_dir: str, kv_format, expect_identity: Mapping | None = None, expect_prompt=None,
               verify: bool = True, directory: Callable[..., KVDirectory] = KVDirectory) -> dict:
    """What `moepack kv inspect` prints. Layers, tokens, bytes, completeness. With `verify`, every complete layer's
    file is read and checked (size, xxh3, tensors): a missing, truncated or damaged file raises FormatError.
    Incomplete layers are reported, not an error (the prefill may still be writing)."""
    d = directory(kv_dir, kv_format, expect_identity)
    if expect_prompt is not None:
        d.check_prompt(expect_prompt)
    m = d.manifest
    layers = []
    for e in m["layers"]:
        row = {"layer": e["layer"], "type": d.kv_format.layer_kind(d.geometry, e["layer"]), "complete": e["complete"]}
        if e["complete"]:
            if verify:
                d.layer(e["layer"])
            row.update(tokens=e["seen_tokens"], entries=e.get("entries", {}), bytes=e["bytes"])
        layers.append(row)
    if verify:
        d.result()
    by_type: dict[str, dict] = {}
    for row in layers:
        t = by_type.setdefault(row["type"], {"layers": 0, "bytes": 0})
        t["layers"] += 1
        t["bytes"] += row.get("bytes", 0)
    ident = m["identity"]
    result = m.get("result") or {}
    complete_bytes = sum(row.get("bytes", 0) for row in layers)  # complete layers only: others' entries are unchecked
    return {
        "path": d.path,
        "format_version": f"{m['format_version'][0]}.{m['format_version'][1]}",
        "complete": m["complete"],
        "layers_complete": sum(e["complete"] for e in m["layers"]),
        "num_layers": d.num_layers,
        "incomplete_layers": ranges(d.incomplete_layers()),
        "architecture": ident["architecture"],
        "container_index_xxh3": ident.get("container_index_xxh3"),
        "config_xxh3": ident["config_xxh3"],
        "tokens": m["tokens"]["count"],
        "start_token": m["tokens"]["start"],
        "token_ids_xxh3": m["tokens"]["ids_xxh3"],
        "dtype": m["dtype"],
        "bytes": complete_bytes,
        "bytes_per_token": round(complete_bytes / m["tokens"]["count"], 1),
        "by_type": by_type,
        "next_token": result.get("next_token"),
        "verified": verify,
        "layers": layers,
    }
