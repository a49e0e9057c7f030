"""Synthetic checkpoints: every tensor a family's release holds, at sizes a test or a demo can afford.

No network exists where moepack is tested, so tests and demos build their own models. What a family's checkpoint
of a preset holds (config, tensors, their layout and values, tokenizer) is its package's synth module
(moepack.families.synthetic says what one holds; moepack.families.family_synth finds it); `synth_checkpoint` writes
it as a Hugging Face-style directory: config.json, generation_config.json, the tokenizer, sharded safetensors and
their index.

Writing streams: shard headers are known up front (shapes and dtypes follow from the config), so each tensor is
drawn, encoded and written on its own and memory holds one tensor at a time. Every file goes into a temporary
folder inside the output and is fsynced; only the complete set is renamed over an earlier run's, so a failed or
killed run leaves none of its files and the earlier checkpoint as it was.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import torch

from moepack import families
from moepack.format_spec.decode import TORCH_DTYPES
from moepack.format_spec.errors import MoepackError, is_disk_full
from moepack.format_spec.files import check_free_space, remove_stale_temporaries, temporary_prefix
from moepack.format_spec.writer import fsync_dir, write_file_atomically

from .sharding import greedy_shards
from .source import INDEX_FILE

DEFAULT_FAMILY = families.DEFAULT_FAMILY

# The default family's presets, release quantization_config and byte-level tokenizer, under the names `moepack plan`
# and the tests take them by (another family's: moepack.families.family_synth(name)).
_DEFAULT_SYNTH = families.family_synth(DEFAULT_FAMILY)
PRESETS = _DEFAULT_SYNTH.PRESETS
RELEASE_QUANTIZATION_CONFIG = _DEFAULT_SYNTH.RELEASE_QUANTIZATION_CONFIG
TOKENIZER_VOCAB_SIZE = _DEFAULT_SYNTH.TOKENIZER_VOCAB_SIZE
preset_config = _DEFAULT_SYNTH.preset_config
tokenizer_json = _DEFAULT_SYNTH.tokenizer_json

_TORCH_DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class _Part(NamedTuple):
    """One tensor as a layout writes it to a safetensors file (a weight, or the scale beside it)."""

    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]

    @property
    def element_bytes(self) -> int:
        return TORCH_DTYPES[self.dtype].itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.element_bytes


# ---------------------------------------------------------------------------------------------------------
# Streaming safetensors writer
# ---------------------------------------------------------------------------------------------------------


class _ShardWriter:
    """Writes one safetensors file whose tensors are all known up front, one tensor at a time.

    The format puts the header first; here every name, dtype and shape is known before any value is drawn, so
    the header goes out at once and tensors follow in header order, each written as soon as it exists.
    """

    def __init__(self, path: Path, tensors: list[_Part]):
        self.path = path
        self.expected = tensors
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for t in tensors:
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        header_bytes = json.dumps(header, separators=(",", ":")).encode()
        header_bytes += b" " * (-(8 + len(header_bytes)) % 8)  # tensor data starts 8-byte aligned
        self.partial = path.with_name(path.name + ".partial")
        self.file: BinaryIO = open(self.partial, "wb")
        self.file.write(struct.pack("<Q", len(header_bytes)))
        self.file.write(header_bytes)
        self.written = 0

    def __enter__(self) -> "_ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Complete: fsynced and renamed to its name. Not (a full disk, an interrupted run): removed."""
        complete = False
        try:
            if exc_type is None:
                if self.written != len(self.expected):
                    raise AssertionError(f"{self.path.name}: {len(self.expected) - self.written} tensors never written")
                self.file.flush()
                os.fsync(self.file.fileno())
                complete = True
        finally:
            try:
                self.file.close()
            finally:
                if complete:
                    os.replace(self.partial, self.path)
                else:
                    self.partial.unlink(missing_ok=True)

    def write(self, name: str, tensor: torch.Tensor) -> int:
        expected = self.expected[self.written]
        actual = (name, _TORCH_DTYPE_NAMES.get(tensor.dtype), tuple(tensor.shape))
        if actual != (expected.name, expected.dtype, expected.shape):
            raise AssertionError(f"{self.path.name}: wrote {actual}, header says {expected}")
        self.file.write(memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy()))
        self.written += 1
        return expected.nbytes


# ---------------------------------------------------------------------------------------------------------
# The checkpoint
# ---------------------------------------------------------------------------------------------------------


def _write_checkpoint_files(out: Path, checkpoint, parts_of, shards: list, shard_names: list[str],
                            total_tensor_bytes: int, label: str, progress: bool) -> None:
    """The checkpoint's metadata files, shards and (last: a directory without it is no checkpoint) its index."""
    config = checkpoint.config
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"], "do_sample": False},
    )
    for name in _TOKENIZER_FILES:
        content = checkpoint.tokenizer_files.get(name)
        if isinstance(content, bytes):
            write_file_atomically(str(out / name), content)
        elif content is not None:
            _write_json(out / name, content)

    from .progress import progress_bar

    weight_map: dict[str, str] = {}
    with progress_bar(total_tensor_bytes, label, progress) as bar:
        for shard_name, shard_specs in zip(shard_names, shards):
            # Widest elements first (as safetensors' own writer orders them), so every tensor stays aligned to its
            # element size in the file; the sort is stable, so streaming order holds within each width. A drawn
            # tensor's parts (a weight and its scale) wait in `encoded` until their turn.
            parts = sorted(((part, spec) for spec in shard_specs for part in parts_of(spec)),
                           key=lambda item: -item[0].element_bytes)
            encoded: dict[str, torch.Tensor] = {}
            with _ShardWriter(out / shard_name, [part for part, _ in parts]) as writer:
                for part, spec in parts:
                    if part.name not in encoded:
                        encoded.update(checkpoint.encode(spec))
                    bar.update(writer.write(part.name, encoded.pop(part.name)))
                    weight_map[part.name] = shard_name
    index = {"metadata": {"total_size": total_tensor_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / INDEX_FILE, index)


def _write_json(path: Path, obj: Any) -> None:
    write_file_atomically(str(path), (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))


def _prepare_output(out: Path, total_tensor_bytes: int, overwrite: bool, shard_bytes: int | None) -> int:
    """The output directory made ready (room for the new files checked: an earlier run's stay until they are
    complete); returns the shard size (None: at least 3 shards, at most 1 GiB each)."""
    if out.exists() and not out.is_dir():
        raise MoepackError(f"{out} exists and is not a directory")
    stale = sorted(out.glob("model*.safetensors*")) if out.exists() else []
    if stale and not overwrite:
        raise MoepackError(f"{out} already holds a checkpoint ({stale[0].name}); pass --force (overwrite=True) to "
                           "replace it")
    if out.is_dir():
        remove_stale_temporaries(str(out), (_STAGING,))  # what a killed run left: its space counts
    check_free_space({str(out): total_tensor_bytes}, f"synthesizing {out}")
    out.mkdir(parents=True, exist_ok=True)
    if shard_bytes is None:
        shard_bytes = min(1 << 30, -(-total_tensor_bytes // 3))
    if shard_bytes <= 0:
        raise MoepackError(f"shard_bytes must be positive, got {shard_bytes}")
    return shard_bytes


def _shard_names(count: int) -> list[str]:
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


_STAGING = "synth"


def _write_or_leave_nothing(out: Path, files: list[str], write) -> None:
    """write(folder) into a temporary folder inside `out`, then its `files` renamed into `out`: a full disk, an
    interrupt or a kill before that leaves what `out` held as it was (an earlier run's checkpoint that --force
    replaces included) and none of this run's files. An OSError (a full disk, a vanished folder) is one line."""
    staging = Path(tempfile.mkdtemp(prefix=temporary_prefix(_STAGING), dir=out))
    try:
        write(staging)
        fsync_dir(str(staging))
        _move_into_place(staging, out, files)
    except OSError as e:
        where = out if e.filename is None or str(e.filename).startswith(str(staging)) else e.filename
        full = " (disk full)" if is_disk_full(e) else ""
        raise MoepackError(f"writing {where} failed: {e.strerror or e}{full}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    fsync_dir(str(out))


def _move_into_place(staging: Path, out: Path, files: list[str]) -> None:
    """The complete new checkpoint's files renamed over the earlier run's; that run's shards (another sharding)
    and tokenizer files (another tokenizer) the new one lacks removed. The index goes first and comes back last: a
    run killed among the renames leaves a folder no reader takes for a checkpoint."""
    (out / INDEX_FILE).unlink(missing_ok=True)
    for name in files:
        if name != INDEX_FILE:
            os.replace(staging / name, out / name)
    for stale in [*out.glob("model*.safetensors*"), *(out / name for name in _TOKENIZER_FILES)]:
        if stale.name not in files:
            stale.unlink(missing_ok=True)
    os.replace(staging / INDEX_FILE, out / INDEX_FILE)


def _family_synth(family: str, tokenizer, random_expert_codes: bool):
    """The synth module of `family`, which must take the options asked for."""
    names = families.FAMILY_NAMES
    if family not in names:
        raise MoepackError(f"unknown model family {family!r} (choose one of {', '.join(names)})")
    synth = families.family_synth(family)
    if (tokenizer is not None and not synth.TAKES_TOKENIZER
            or random_expert_codes and not synth.RANDOM_EXPERT_CODES):
        takers = [name for name in names
                  if (other := families.family_synth(name)).TAKES_TOKENIZER and other.RANDOM_EXPERT_CODES]
        raise MoepackError(f"--tokenizer and random expert codes are for {', '.join(takers)} only, not {family} (it "
                           "writes its own byte-level tokenizer)")
    return synth


def synth_checkpoint(
    out_dir: str | os.PathLike,
    preset: str = "tiny",
    layout: str = "release",
    seed: int = 0,
    shard_bytes: int | None = None,
    progress: bool = True,
    overwrite: bool = False,
    config_overrides: dict | None = None,
    tokenizer: str | os.PathLike | None = None,
    random_expert_codes: bool = False,
    family: str = DEFAULT_FAMILY,
) -> dict:
    """Write a synthetic checkpoint directory of `family` (config, sharded safetensors + index, tokenizer,
    generation config). shard_bytes=None: at least 3 shards, at most 1 GiB each. `config_overrides` replace
    preset fields (e.g. more layers for a streaming-memory test). `tokenizer` (a family whose synth module
    TAKES_TOKENIZER): a tokenizer.json, or a directory holding tokenizer.json (+ tokenizer_config.json), embedded
    byte for byte instead of the tiny byte-level tokenizer (families.synthetic.read_tokenizer); vocab_size grows
    to fit it. `random_expert_codes` (release layout, a family whose synth module has RANDOM_EXPERT_CODES): the
    routed experts' codes drawn as random bytes (a release-sized model's 10 GB of expert floats take minutes to
    draw and quantize). Returns a summary: dir, preset, layout, family (unless the default one), files, bytes
    (all files written), params (logical, MTP included), seconds."""
    synth = _family_synth(family, tokenizer, random_expert_codes)
    if layout not in synth.LAYOUTS:
        raise MoepackError(f"unknown layout {layout!r} (choose one of {', '.join(synth.LAYOUTS)})")
    started = time.perf_counter()
    checkpoint = synth.checkpoint(preset, layout, seed, config_overrides, tokenizer, random_expert_codes)

    def parts_of(spec) -> list[_Part]:
        return [_Part(*part) for part in checkpoint.stored(spec)]

    out = Path(out_dir)
    total_tensor_bytes = sum(part.nbytes for spec in checkpoint.specs for part in parts_of(spec))
    shard_bytes = _prepare_output(out, total_tensor_bytes, overwrite, shard_bytes)
    # greedy, in streaming order: a weight and its scale share a shard; a tensor over shard_bytes gets its own
    shards = greedy_shards(checkpoint.specs, lambda spec: sum(part.nbytes for part in parts_of(spec)), shard_bytes)
    shard_names = _shard_names(len(shards))
    metadata = ["config.json", "generation_config.json", *checkpoint.tokenizer_files]
    files = sorted([*metadata, *shard_names, INDEX_FILE])
    named = {} if family == DEFAULT_FAMILY else {"family": family}  # the default one's summary names none
    label = " ".join(["synth", *named.values(), preset])
    _write_or_leave_nothing(out, files, lambda folder: _write_checkpoint_files(
        folder, checkpoint, parts_of, shards, shard_names, total_tensor_bytes, label, progress))

    return {
        "dir": str(out),
        "preset": preset,
        "layout": layout,
        **named,
        "files": files,
        "bytes": sum((out / f).stat().st_size for f in files),
        "params": sum(s.numel for s in checkpoint.specs),
        "seconds": round(time.perf_counter() - started, 3),
    }
