"""Container -> one GGUF file of llama.cpp's architecture for the container's model (`moepack export FILE --format
gguf -o X.gguf`): DeepSeek-V4's `deepseek4`, Qwen3-MoE's `qwen3moe`, each as llama.cpp's own converter makes it.

The family names the tensors and the keys (ModelFamily.gguf_tensors, gguf_model: families/<family>/gguf.py); this
module moves the bytes:

* types, as llama.cpp's converter chooses them: an F8_E4M3 weight with its E8M0 block scales is dequantized and
  quantized to Q8_0 (moepack's Q8_0 is byte-identical to ggml's); F32 stays F32; a 2-D BF16 stays BF16, a 1-D one
  becomes F32; an integer table (I64) becomes I32; routed experts are repacked losslessly from the release's FP4 to
  MXFP4 and stacked per layer and matrix [n_experts, out, in]. Weights a container already holds in a ggml block
  type (Q8_0, MXFP4, Q2_K, IQ2_XXS: the `--fp4` policy's Q8_0 + MXFP4 are exactly llama.cpp's) are copied byte for
  byte, float experts (F32, BF16, F16) stacked in their own type; any other stored type (NVFP4, a weight with a
  tensor scale) is decoded and written as Q8_0.
* metadata: the family's keys (general.file_type after the routed experts' type where the family does not fix
  it), and the tokenizer (gpt2 BPE with the family's pre-tokenizer name, tokens padded to vocab_size with
  `[PAD{i}]`, merges and special ids via gguf-py's SpecialVocab); the chat template is the tokenizer's own if it has
  one, else the family's (DeepSeek-V4's format as its chat encoder renders it).

Written to a temporary name next to the output, fsynced, then renamed: a failure (a full disk) leaves no file behind
and raises one MoepackError line. Needs gguf-py (`pip install 'moepack[gguf]'`).

A container without a tokenizer (run by token ids) gets llama.cpp's vocabulary type `none`, whose size llama.cpp
takes from `{arch}.vocab_size` (without that key it has no tokens and refuses `token_embd.weight`), and the token
list padded as the converter pads ids a tokenizer lacks (`[PAD{i}]`, UNUSED) for readers that count it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

from moepack.families import check_container
from moepack.families.base import GGUF_QUANT_VERSION
from moepack.format_spec import untrusted
from moepack.format_spec.decode import decode_float, decode_tensor, scale_name, tensor_scale_name
from moepack.format_spec.decode import tensor_scale_value
from moepack.format_spec.errors import MoepackError, error_reason, is_disk_full
from moepack.format_spec.files import (check_free_space, plain_file_mode, refuse_replacing_a_special_file,
                                       remove_stale_temporaries, short_write_reason, temporary_prefix)
from moepack.format_spec.generation_config import GENERATION_CONFIG, gguf_sampling_keys
from moepack.format_spec.quants import fp4_to_mxfp4, quantize
from moepack.format_spec.reader import Container
from moepack.format_spec.writer import fsync_dir, fsync_file

from .export import EXPORT_TEMPORARIES
from .gguf_source import gguf_py
from .progress import progress_bar
from .sharding import greedy_shards

_BLOCK_TYPES = ("Q8_0", "MXFP4", "Q2_K", "IQ2_XXS")  # stored in ggml's own block layout: copied as they are
_FLOAT_TYPES = ("F32", "BF16", "F16")


@dataclass
class _Job:
    name: str  # GGUF name
    qtype: str  # ggml type name (gguf.GGMLQuantizationType member)
    shape: tuple[int, ...]  # logical numpy shape (ggml ne is its reverse)
    produce: Callable[[], np.ndarray]  # the tensor's bytes, uint8 (or a numpy array of the right nbytes)
    source_bytes: int  # stored bytes consumed (progress)
    nbytes: int = 0  # its size in the GGUF (set by export_gguf, which has gguf-py's block table)
    requantized: str | None = None  # the stored type decoded and encoded again as `qtype`, where it is


def _ggml_nbytes(gguf, qtype: str, shape) -> int:
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    n = int(np.prod(shape)) if shape else 1
    if shape[-1] % block:
        raise MoepackError(f"a row of {shape[-1]} values is not whole {qtype} blocks of {block}")
    return n // block * size


def _raw(c: Container, name: str) -> np.ndarray:
    return np.frombuffer(bytearray(c.tensor_bytes(name)), dtype=np.uint8)


def _float32(c: Container, name: str) -> torch.Tensor:
    """A weight's float32 values, with its block scales and tensor scale applied."""
    t = c.tensors[name]
    s_name, ts_name = scale_name(name), tensor_scale_name(name)
    scale = None
    if s_name in c.tensors:
        s = c.tensors[s_name]
        scale = decode_tensor(s.dtype, s.shape, c.tensor_bytes(s_name))
    ts = tensor_scale_value(c.tensor_bytes(ts_name), ts_name) if ts_name in c.tensors else None
    return decode_float(t.dtype, t.shape, c.tensor_bytes(name), scale, torch.float32, ts).float()


def _q8_0(x: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(quantize(x.contiguous(), "Q8_0")).reshape(-1)


def _f32(x: torch.Tensor) -> np.ndarray:
    return x.contiguous().numpy().reshape(-1).view(np.uint8)


def _requantized(shape) -> tuple[str, Callable[[torch.Tensor], np.ndarray]]:
    """The GGUF type and encoder of a weight llama.cpp cannot take as stored: Q8_0 (the converter's), or F32 where
    its rows are not whole Q8_0 blocks of 32 (a width not a multiple of 32)."""
    return ("F32", _f32) if shape[-1] % 32 else ("Q8_0", _q8_0)


def _source_bytes(c: Container, name: str) -> int:
    return sum(c.tensors[n].length for n in (name, scale_name(name), tensor_scale_name(name)) if n in c.tensors)


def _plain_job(c: Container, name: str, gguf_name: str) -> _Job:
    t = c.tensors[name]
    shape = tuple(t.shape)
    dt = t.dtype
    has_ts = tensor_scale_name(name) in c.tensors
    nbytes = _source_bytes(c, name)
    if dt in ("I64", "I32", "I16", "I8"):  # the hash table: I32 in llama.cpp
        return _Job(gguf_name, "I32", shape,
                    lambda: c.read_tensor(name).to(torch.int32).numpy().reshape(-1).view(np.uint8), nbytes)
    if len(shape) <= 1 or gguf_name.endswith("_norm.weight"):  # the converter: 1-D tensors and norms are F32
        if dt == "F32" and not has_ts:
            return _Job(gguf_name, "F32", shape, lambda: _raw(c, name), nbytes)
        return _Job(gguf_name, "F32", shape, lambda: _f32(_float32(c, name)), nbytes)
    if dt in _FLOAT_TYPES and not has_ts:  # kept as the source holds them
        return _Job(gguf_name, dt, shape, lambda: _raw(c, name), nbytes)
    if dt in _BLOCK_TYPES and not has_ts:  # already llama.cpp's blocks
        return _Job(gguf_name, dt, shape, lambda: _raw(c, name), nbytes)
    # FP8 + block scales (the converter's dequant_model + tensor_force_quant), or anything else moepack decodes
    qtype, encode = _requantized(shape)
    return _Job(gguf_name, qtype, shape, lambda: encode(_float32(c, name)), nbytes,
                requantized=_stored_as({dt}, has_ts))


def _stacked_experts_job(c: Container, names: list[str], gguf_name: str) -> _Job:
    """One layer's routed experts' matrix `names` (in expert-ID order) stacked as llama.cpp's [n_experts, out, in]."""
    n_experts = len(names)
    missing = [n for n in names if n not in c.tensors]
    if missing:
        raise MoepackError(f"container lacks routed expert {missing[0]}")
    entries = [c.tensors[n] for n in names]
    shape = tuple(entries[0].shape)
    if any(tuple(e.shape) != shape for e in entries) or len(shape) != 2:
        raise MoepackError(f"routed experts of {gguf_name} differ in shape or are not 2-D")
    dtypes = {e.dtype for e in entries}
    has_ts = any(tensor_scale_name(n) in c.tensors for n in names)
    nbytes = sum(_source_bytes(c, n) for n in names)
    if dtypes == {"FP4_E2M1"} and not has_ts and all(scale_name(n) in c.tensors for n in names):
        def produce():  # release FP4 + E8M0 -> MXFP4, lossless (the converter's repack_mxfp4_blocks)
            out = []
            for n in names:
                s = c.tensors[scale_name(n)]
                packed = _raw(c, n).reshape(shape[0], -1)
                out.append(fp4_to_mxfp4(packed, _raw(c, s.name).reshape(tuple(s.shape))).reshape(-1))
            return np.concatenate(out)
        return _Job(gguf_name, "MXFP4", (n_experts,) + shape, produce, nbytes)
    if len(dtypes) == 1 and next(iter(dtypes)) in _BLOCK_TYPES + _FLOAT_TYPES and not has_ts:
        qtype = next(iter(dtypes))  # ggml blocks, or float experts kept in their precision (as other weights are)
        return _Job(gguf_name, qtype, (n_experts,) + shape, lambda: np.concatenate([_raw(c, n) for n in names]),
                    nbytes)
    qtype, encode = _requantized(shape)
    return _Job(gguf_name, qtype, (n_experts,) + shape,
                lambda: np.concatenate([encode(_float32(c, n)) for n in names]), nbytes,
                requantized=_stored_as(dtypes, has_ts))


def _stored_as(dtypes: set[str], has_tensor_scale: bool) -> str:
    """How a re-encoded job's weights were stored, as the export's `requantized` counts and its warning name it."""
    return "/".join(sorted(dtypes)) + (" with a tensor scale" if has_tensor_scale else "")


# general.file_type (gguf-py's LlamaFileType member) after the routed experts' GGUF type
_FILE_TYPE = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0",
              "MXFP4": "MOSTLY_MXFP4_MOE", "Q2_K": "MOSTLY_Q2_K", "IQ2_XXS": "MOSTLY_IQ2_XXS"}


def family_export(gguf, c: Container) -> tuple[str, list[_Job], list[tuple], str, int, Callable | None]:
    """(architecture, tensors, model keys, pre-tokenizer, vocab size, fallback chat template) of the container's
    model, as its family (moepack.families) names them."""
    family, _ = check_container(c, computable=False)  # its tensors those its config implies, as the family names them
    jobs = [_stacked_experts_job(c, list(t.sources), t.name) if t.stacked else _plain_job(c, t.sources[0], t.name)
            for t in family.gguf_tensors(c.config, list(c.tensors))]
    model = family.gguf_model(c.config)
    keys = list(model.keys)
    if not any(key == "general.file_type" for key, _, _ in keys):  # the family leaves it to the experts' type
        experts = next((j.qtype for j in jobs if len(j.shape) == 3), "F32")
        file_type = int(gguf.LlamaFileType[_FILE_TYPE.get(experts, "MOSTLY_Q8_0")])
        keys += [("general.file_type", "uint32", file_type),
                 ("general.quantization_version", "uint32", GGUF_QUANT_VERSION)]
    vocab_size = family.shape(family.parse_config(c.config)).vocab_size
    return model.architecture, jobs, keys, model.tokenizer_pre, vocab_size, model.chat_template


def _looks_special(text: str) -> bool:  # the converter's does_token_look_special
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
            or (text.startswith("<unused") and text.endswith(">")))


def vocab(files: dict[str, bytes], vocab_size: int) -> tuple[list[str], list[int]]:
    """Tokens and token types as the converter's get_vocab_base makes them (ids missing below vocab_size become
    `[PAD{i}]`, UNUSED; added tokens CONTROL if special or special-looking, else USER_DEFINED)."""
    if "tokenizer.json" in files:
        tok = untrusted.load_tokenizer(files["tokenizer.json"], "the container's tokenizer.json")
        reverse = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
        added = tok.get_added_tokens_decoder()
    else:  # no tokenizer: every id padding
        reverse, added = {}, {}
    if reverse and max(reverse) >= vocab_size:
        raise MoepackError(f"tokenizer has token id {max(reverse)}, beyond vocab_size {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(5)  # UNUSED
            continue
        text = reverse[i]
        if i in added:
            if added[i].special or _looks_special(text):
                types.append(3)  # CONTROL
            else:
                text = text.replace("\u2581", " ")
                types.append(4)  # USER_DEFINED
        else:
            types.append(1)  # NORMAL
        tokens.append(text)
    return tokens, types


def merges(files: dict[str, bytes]) -> list[str]:
    """tokenizer.json's BPE merges as GGUF stores them: "left right" (a pair list is joined with a space)."""
    tokenizer = untrusted.loads(files["tokenizer.json"], "the container's tokenizer.json")
    model = (tokenizer.get("model") if isinstance(tokenizer, dict) else None) or {}
    return [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]


def _writer_class(gguf):
    class Writer(gguf.GGUFWriter):
        """gguf-py's writer, able to write an empty typed array (gguf-py 0.19 refuses one; the format allows it)."""

        def _pack_val(self, val, vtype, add_vtype, sub_type=None):
            if vtype == gguf.GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
                return ((self._pack("I", vtype) if add_vtype else b"") + self._pack("I", sub_type)
                        + self._pack("Q", 0))
            return super()._pack_val(val, vtype, add_vtype, sub_type)

    return Writer


def _add_tokenizer(gguf, writer, files: dict[str, bytes], config: dict, vocab_size: int, tmp_dir: str, pre: str,
                   fallback_template: Callable[[], str] | None) -> None:
    tokens, types = vocab(files, vocab_size)
    if "tokenizer.json" not in files:  # a container run by token ids: llama.cpp's vocabulary type "none", sized by
        writer.add_string("tokenizer.ggml.model", "none")  # {arch}.vocab_size (llama.cpp's own saver writes it)
        writer.add_vocab_size(vocab_size)
        writer.add_array("tokenizer.ggml.tokens", tokens)
        writer.add_array("tokenizer.ggml.token_type", types)
        return
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", pre)
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", types)
    # llama.cpp refuses a gpt2 vocabulary without a merges key, even an empty one (a byte-level toy tokenizer)
    writer.add_key_value("tokenizer.ggml.merges", merges(files), gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)
    for name, data in files.items():  # gguf-py's SpecialVocab json.loads them: a damaged one had been a traceback
        if name.endswith(".json") and not isinstance(untrusted.loads(data, f"the container's {name}"), dict):
            raise MoepackError(f"the container's {name}: not a JSON object")
    tok_dir = tempfile.mkdtemp(prefix=temporary_prefix("export-tokenizer"), dir=tmp_dir)
    try:
        # config.json too: SpecialVocab takes bos/eos ids from it when the tokenizer files do not name them (without
        # them llama.cpp falls back to its own defaults, id 11 for a BPE vocabulary's BOS)
        for name, data in {**files, "config.json": json.dumps(config).encode()}.items():
            with open(os.path.join(tok_dir, name), "wb") as f:
                f.write(data)
        # (gguf-py warns on stderr that it cannot read the release's pair template, which llama.cpp never uses: the
        # BOS it adds is read from the single one; no line of ours to show for it)
        quiet = logging.getLogger("gguf")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            special = gguf.SpecialVocab(tok_dir, load_merges=False, n_vocab=len(tokens))
        finally:
            quiet.setLevel(level)
        if special.chat_template is None and fallback_template is not None:  # (DeepSeek-V4's release ships none:
            special.chat_template = fallback_template()  # its format as moepack encodes it)
        special.add_to_gguf(writer, quiet=True)
    finally:
        shutil.rmtree(tok_dir, ignore_errors=True)


def parse_size(text: str) -> int:
    """A size as `--split-max-size` takes it, as llama.cpp's gguf-split does: bytes, or a number with K, M, G or T
    (powers of 1000)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", str(text), re.IGNORECASE)
    if not m:
        raise MoepackError(f"size {text!r}: expected bytes or a number with K, M, G or T (e.g. 50G)")
    size = int(float(m.group(1)) * 1000 ** " KMGT".index(m.group(2).upper() or " "))
    if size < 1:
        raise MoepackError(f"size {text!r} must be at least one byte")
    return size


def split_name(out_file: str, number: int, count: int) -> str:
    """llama.cpp's name of split `number` (1-based) of `count`: OUT-0000i-of-0000N.gguf."""
    stem = out_file[: -len(".gguf")] if out_file.endswith(".gguf") else out_file
    return f"{stem}-{number:05d}-of-{count:05d}.gguf"


def _shard(jobs: list[_Job], max_bytes: int | None) -> list[list[_Job]]:
    """Tensors in order, a new file whenever the next would pass max_bytes (a bigger tensor gets a file alone)."""
    if max_bytes is None:
        return [jobs]
    return greedy_shards(jobs, lambda j: j.nbytes, max_bytes)


def export_gguf(path: str, out_file: str, progress: bool = True, split_max_size: int | None = None,
                force: bool = False) -> dict:
    """Write container `path` as GGUF file `out_file` (must not exist, unless `force`); with `split_max_size`
    (bytes of tensor data per file) as llama.cpp's splits OUT-00001-of-0000N.gguf (split.no / split.count /
    split.tensors.count in each, the model's keys in the first). Every file is written under a temporary name and renamed once all are
    complete. Returns a summary dict."""
    gguf = gguf_py("GGUF export")
    start = time.perf_counter()
    out_file = os.fspath(out_file)
    parent = os.path.dirname(os.path.abspath(out_file))
    if not os.path.isdir(parent):
        raise MoepackError(f"output's parent directory {parent} does not exist")
    with Container(path) as c:
        arch, jobs, kv, pre, vocab_size, fallback_template = family_export(gguf, c)
        jobs = [replace(j, nbytes=_ggml_nbytes(gguf, j.qtype, j.shape)) for j in jobs]
        requantized = _requantized_types(jobs)
        files = c.tokenizer_files()
        shards = _shard(jobs, split_max_size)
        outputs = [out_file] if split_max_size is None else [split_name(out_file, i + 1, len(shards))
                                                             for i in range(len(shards))]
        for name in outputs:
            refuse_replacing_a_special_file(name)
            if os.path.isdir(name) or os.path.exists(name) and not force:
                raise MoepackError(f"{name} exists")
        remove_stale_temporaries(parent, EXPORT_TEMPORARIES)  # what a killed export left: its space counts
        check_free_space({parent: sum(j.nbytes for j in jobs)}, f"exporting {out_file}")
        tmps: list[str] = []
        writer = None
        bar = progress_bar(sum(j.source_bytes for j in jobs), "export gguf", progress)
        try:
            for number, shard in enumerate(shards):
                fd, tmp = tempfile.mkstemp(prefix=temporary_prefix("export"), suffix=".gguf.tmp", dir=parent)
                os.fchmod(fd, plain_file_mode())  # a plain file's mode, not mkstemp's 0600
                os.close(fd)
                tmps.append(tmp)
                writer = _writer_class(gguf)(tmp, arch)
                if number == 0:
                    writer.add_string("general.type", "model")
                    writer.add_string("general.name", os.path.splitext(os.path.basename(path))[0])
                    for key, kind, value in kv + gguf_sampling_keys(c.tokenizer_json(GENERATION_CONFIG)):
                        getattr(writer, f"add_{kind}")(key, value)
                    _add_tokenizer(gguf, writer, files, c.config, vocab_size, parent, pre, fallback_template)
                if split_max_size is not None:
                    writer.add_uint16("split.no", number)
                    writer.add_uint16("split.count", len(shards))
                    writer.add_int32("split.tensors.count", len(jobs))
                _write_tensors(gguf, writer, shard, bar)
                writer = None
            bar.close()
            for tmp, name in zip(tmps, outputs):
                fsync_file(tmp)
                os.replace(tmp, name)
            fsync_dir(parent)
        except OSError as e:  # a full disk, a vanished folder: one line, nothing left behind
            cause = None if e.errno is not None else next(filter(None, map(short_write_reason, tmps)), None)
            _discard(writer, tmps)
            full = " (disk full)" if is_disk_full(e) else ""
            raise MoepackError(f"writing {out_file} failed: {cause or error_reason(e) + full}") from None
        except BaseException:
            _discard(writer, tmps)
            raise
    total = sum(j.nbytes for j in jobs)
    return {"output": outputs[0], "files": outputs, "format": "gguf", "architecture": arch, "tensors": len(jobs),
            "requantized": requantized,
            "bytes": total, "seconds": round(time.perf_counter() - start, 3)}


def _write_tensors(gguf, writer, jobs: list[_Job], bar) -> None:
    """Header, keys, tensor infos, then each tensor's bytes as it is produced (one tensor in memory at a time)."""
    for j in jobs:
        writer.add_tensor_info(j.name, j.shape, np.dtype(np.float32), j.nbytes,
                               raw_dtype=gguf.GGMLQuantizationType[j.qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for j in jobs:
        data = np.ascontiguousarray(j.produce()).reshape(-1).view(np.uint8)
        if data.nbytes != j.nbytes:
            raise MoepackError(f"{j.name}: produced {data.nbytes} bytes, expected {j.nbytes}")
        writer.write_tensor_data(data)
        bar.update(j.source_bytes)
    writer.close()


_CONVERTER_REQUANTIZES = ("F8_E4M3",)  # what llama.cpp's own converter decodes and writes as Q8_0 too


def _requantized_types(jobs: list[_Job]) -> dict[str, int]:
    """{stored type: tensors} of those decoded and encoded again; a warning where that is a second lossy step
    llama.cpp's own converter would not take (NVFP4, a tensor scale: the `--nvfp4` policy's)."""
    counts = dict(Counter(j.requantized for j in jobs if j.requantized is not None))
    again = sorted(t for t in counts if t not in _CONVERTER_REQUANTIZES)
    if again:
        warnings.warn(f"{sum(counts[t] for t in again)} tensors stored as {', '.join(again)} are decoded and written "
                      "again as Q8_0, a second lossy step (llama.cpp has no such type): export a container of "
                      "another policy (--fp4, --q8, --keep) to have them copied as they are", stacklevel=3)
    return counts


def _discard(writer, tmps: list[str]) -> None:
    if writer is not None:
        try:
            writer.close()
        except OSError:
            pass
    for tmp in tmps:
        try:
            os.unlink(tmp)
        except OSError:
            pass


__all__ = ["export_gguf", "parse_size", "split_name", "vocab"]
