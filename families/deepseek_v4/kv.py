"""DeepSeek-V4's KV state and its layer files in the KV hand-off directory (format_spec/KV.md is normative).

The directory's container part (manifest, identity, tokens, checksums, atomic writes, the reader's checks) is every
family's, in moepack.families.kv_directory; this module is DeepSeek-V4's part of it and its names for the whole:

* the per-layer state containers `LayerKVState` / `CompressorState` (the runtime produces and consumes them),
* `DEEPSEEK_V4_KV`, the family's KVFormat (families/base.py): a layer's sliding window, compressor and indexer
  states as the tensors of KV.md section 4, and back,
* `KVWriter` / `BackgroundKVWriter`, `read_kv` / `KVDirectory` / `inspect_kv`: the directory's writer and reader
  with this format (kv_directory's, the format given),
* `kv_geometry` / `kv_bytes_per_token` / `kv_bytes` (the size arithmetic of docs/kv.md).

The KV is DeepSeek-V4 model state, so it lives with the model (moepack.families.deepseek_v4), not the container;
moepack.families.deepseek_v4.config reads its geometry from a config. Nothing here imports the runtime; torch and
safetensors are needed for the state tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from moepack.format_spec.errors import FormatError, MoepackError
from moepack.format_spec.files import check_free_space
from moepack.format_spec.writer import write_file_atomically

from .. import kv_directory as kvd
# the directory's names, as this module always gave them (its callers', its tests')
from ..kv_directory import (KV_DTYPES, KV_FORMAT, KV_MAJOR, KV_MINOR, LOGITS_NAME, MANIFEST_NAME,  # noqa: F401
                            MAX_MANIFEST_BYTES, TORCH_DTYPES as _TORCH_DTYPES, BackgroundKVWriter, KVCache,
                            check_dtype as _check_dtype, clean_interrupted_replacement, config_xxh3,
                            decode_rows as _decode, identity_of_container, layer_file_bytes,
                            layer_file_name, make_identity, replacement_paths, row_bytes as _row_bytes,
                            token_ids_xxh3)
from . import config as v4config
from .config import CSA, HCA, SLIDING, ConfigError

COMPRESSORS = {SLIDING: (), HCA: ("compressor",), CSA: ("compressor", "indexer")}


# ---------------------------------------------------------------------------------------------------------------
# State containers
# ---------------------------------------------------------------------------------------------------------------


def _move(t: torch.Tensor | None, device, dtype) -> torch.Tensor | None:
    if t is None:
        return None
    return t.to(device=device if device is not None else t.device, dtype=dtype if dtype is not None else t.dtype)


@dataclass
class CompressorState:
    """One compressor's decode state after a prefill of N tokens; mirrors what transformers' DeepseekV4HCACache /
    DeepseekV4CSACache hold under one name ("compressor" or "indexer"). d = head_dim (attention compressor) or
    index_head_dim (indexer); width = d for HCA, 2d for CSA (two series Ca | Cb, see
    families.deepseek_v4.model.compress)."""

    compressed_kv: torch.Tensor  # [entry_count, d] emitted entries: gated window sums, RMS-normed, RoPE'd at i*rate
    buffer_kv: torch.Tensor  # [N - entry_count*rate, width] raw wkv projections of the tokens after the last window
    buffer_gate: torch.Tensor  # [N - entry_count*rate, width] raw wgate projections of the same tokens (no ape)
    entry_count: int  # entries emitted; the next window starts at position entry_count*rate
    overlap_kv: torch.Tensor | None = None  # CSA: [rate, d] the last full window's first series (Ca); None if none
    overlap_gate: torch.Tensor | None = None  # CSA: [rate, d] its gate, ape INCLUDED (transformers stores it so)

    def to(self, device=None, dtype=None) -> "CompressorState":
        return CompressorState(_move(self.compressed_kv, device, dtype), _move(self.buffer_kv, device, dtype),
                               _move(self.buffer_gate, device, dtype), self.entry_count,
                               _move(self.overlap_kv, device, dtype), _move(self.overlap_gate, device, dtype))

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"compressed_kv": self.compressed_kv, "buffer_kv": self.buffer_kv, "buffer_gate": self.buffer_gate}
        if self.overlap_kv is not None:
            out["overlap_kv"], out["overlap_gate"] = self.overlap_kv, self.overlap_gate
        return out


@dataclass
class LayerKVState:
    """What a decode continuation needs from one layer after prefilling N tokens (mirrors transformers' per-layer
    cache: DynamicSlidingWindowLayer for sliding-only layers, DeepseekV4HCACache / DeepseekV4CSACache otherwise)."""

    layer_type: str
    seen_tokens: int  # N (cache.cumulative_length)
    window_kv: torch.Tensor  # [min(N, window-1), head_dim] the shared K=V (kv_norm + RoPE) of the last window-1 tokens
    compressor: CompressorState | None = None  # CSA and HCA: the attention's compressed KV
    indexer: CompressorState | None = None  # CSA only: the Lightning Indexer's compressed keys

    def to(self, device=None, dtype=None) -> "LayerKVState":
        """A copy on `device` (and float `dtype`): e.g. `state.to("cpu")` to take a layer off the GPU."""
        return LayerKVState(self.layer_type, self.seen_tokens, _move(self.window_kv, device, dtype),
                            self.compressor.to(device, dtype) if self.compressor is not None else None,
                            self.indexer.to(device, dtype) if self.indexer is not None else None)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor under its KV.md name (`window_kv`, `compressor.buffer_kv`, ...)."""
        out = {"window_kv": self.window_kv}
        for name in COMPRESSORS.get(self.layer_type, ()):
            part = getattr(self, name)
            if part is not None:
                out.update({f"{name}.{k}": v for k, v in part.tensors().items()})
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


# ---------------------------------------------------------------------------------------------------------------
# Geometry and size arithmetic
# ---------------------------------------------------------------------------------------------------------------


def kv_geometry(config: Mapping) -> dict:
    """The shape facts of a DeepSeek-V4 config.json that the KV format depends on (moepack.families.deepseek_v4.config
    reads them, legacy keys included): num_layers, per-layer type and compress rate (0 for sliding), sliding_window,
    head_dim, index_head_dim. FormatError, naming the field, for a config they can't be read from."""
    try:
        return v4config.kv_geometry(config)
    except ConfigError as e:  # a damaged or hostile config: the KV's own error type
        raise FormatError(f"config: {e.detail}") from None


def kv_bytes_per_token(config: Mapping, dtype: str = "F32") -> dict:
    """Tensor bytes of a KV per layer type: `bytes_per_token` (what grows with the prompt: compressed entries, one
    per `rate` tokens, each head_dim values, plus the indexer's index_head_dim for CSA) and `fixed_bytes` (the
    sliding-window tail of window-1 rows every layer keeps, independent of N; the compressors' F32 working state,
    at most rate-1 buffered rows plus the CSA overlap, is bounded too and counted in `working_state_max_bytes`).
    Totals over the config's layers are under "total"."""
    dtype = _check_dtype(dtype)
    g = kv_geometry(config)
    d, di, window = g["head_dim"], g["index_head_dim"], g["sliding_window"]
    per_type: dict[str, dict] = {}
    for kind, rate in zip(g["layer_types"], g["compress_rates"]):
        if kind in per_type:
            per_type[kind]["layers"] += 1
            continue
        entry = {"layers": 1, "rate": rate, "fixed_bytes": (window - 1) * _row_bytes(d, dtype),
                 "bytes_per_token": 0.0, "working_state_max_bytes": 0}
        if kind == HCA:
            entry["bytes_per_token"] = _row_bytes(d, dtype) / rate
            entry["working_state_max_bytes"] = (rate - 1) * d * 2 * 4
        elif kind == CSA:
            entry["bytes_per_token"] = (_row_bytes(d, dtype) + _row_bytes(di, dtype)) / rate
            entry["working_state_max_bytes"] = ((rate - 1) * 2 * (d + di) * 2 + rate * (d + di) * 2) * 4
        per_type[kind] = entry
    total = {key: sum(e["layers"] * e[key] for e in per_type.values())
             for key in ("fixed_bytes", "bytes_per_token", "working_state_max_bytes")}
    return {"dtype": dtype, "per_layer_type": per_type, "total": total}


def kv_bytes(config: Mapping, n_tokens: int, dtype: str = "F32") -> int:
    """Exact tensor bytes (safetensors headers excluded) of the KV of an n_tokens prefill."""
    _check_dtype(dtype)
    g = kv_geometry(config)
    total = 0
    for kind, rate in zip(g["layer_types"], g["compress_rates"]):
        total += min(n_tokens, g["sliding_window"] - 1) * _row_bytes(g["head_dim"], dtype)
        for name in COMPRESSORS[kind]:
            d = g["head_dim"] if name == "compressor" else g["index_head_dim"]
            width = 2 * d if kind == CSA else d
            entries = n_tokens // rate
            total += entries * _row_bytes(d, dtype) + (n_tokens - entries * rate) * width * 2 * 4
            if kind == CSA and entries:
                total += rate * d * 2 * 4
    return total


# ---------------------------------------------------------------------------------------------------------------
# The layer file (KV.md section 4): DeepSeek-V4's KVFormat
# ---------------------------------------------------------------------------------------------------------------


_KV_TENSORS = ("window_kv", "compressor.compressed_kv", "indexer.compressed_kv")  # stored in the KV dtype


def _layer_parts(state, dtype: str) -> tuple[dict, dict, dict]:
    """(tensors, the file's own metadata, the manifest entry's fields) of one layer's state."""
    tensors: dict[str, torch.Tensor] = {}
    for name, t in state.tensors().items():
        if name in _KV_TENSORS:
            kvd.store_rows(tensors, name, t, dtype)
        else:
            tensors[name] = t.detach().to("cpu", torch.float32).contiguous()
    meta = {"layer_type": state.layer_type, "seen_tokens": str(state.seen_tokens)}
    entries = {}
    for name in COMPRESSORS.get(state.layer_type, ()):
        part = getattr(state, name)
        if part is not None:
            meta[f"{name}.entry_count"] = str(part.entry_count)
            entries[name] = part.entry_count
    return tensors, meta, {"layer_type": state.layer_type, "seen_tokens": state.seen_tokens, "entries": entries}


def encode_layer(layer: int, state, dtype: str = "F32") -> bytes:
    """The safetensors bytes of one layer file (KV.md section 4)."""
    _check_dtype(dtype)
    tensors, meta, _ = _layer_parts(state, dtype)
    return layer_file_bytes(layer, tensors, meta, dtype)


class DeepseekV4KVFormat:
    """families.base.KVFormat for DeepSeek-V4: a layer's state is a LayerKVState."""

    entry_fields = ("layer_type", "seen_tokens", "entries")

    def geometry(self, config: Mapping) -> dict:
        return kv_geometry(config)

    def kv_bytes(self, config: Mapping, n_tokens: int, dtype: str) -> int:
        return kv_bytes(config, n_tokens, dtype)

    def layer_kind(self, geometry: Mapping, layer: int) -> str:
        return geometry["layer_types"][layer]

    def seen_tokens(self, state: LayerKVState) -> int:
        return state.seen_tokens

    def check_state(self, geometry: Mapping, layer: int, state: LayerKVState) -> None:
        if state.layer_type != geometry["layer_types"][layer]:
            raise MoepackError(f"layer {layer}: state of a {state.layer_type} layer, the config says "
                               f"{geometry['layer_types'][layer]}")

    def layer_tensors(self, geometry: Mapping, layer: int, state: LayerKVState, dtype: str):
        return _layer_parts(state, dtype)

    def entry_valid(self, geometry: Mapping, layer: int, entry: Mapping) -> bool:
        kind, entries = geometry["layer_types"][layer], entry.get("entries")
        return entry.get("layer_type") == kind and isinstance(entries, dict) \
            and sorted(entries) == sorted(COMPRESSORS[kind]) and all(kvd.is_count(v) for v in entries.values())

    def layer_state(self, geometry: Mapping, layer: int, entry: Mapping, tensors: Mapping[str, torch.Tensor],
                    dtype: str) -> LayerKVState:
        g, e = geometry, entry
        kind, rate, n = e["layer_type"], g["compress_rates"][layer], e["seen_tokens"]
        expected: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        kvd.expect_rows(expected, "window_kv", (min(n, g["sliding_window"] - 1), g["head_dim"]), dtype)
        for name in COMPRESSORS[kind]:
            d = g["head_dim"] if name == "compressor" else g["index_head_dim"]
            width = 2 * d if kind == CSA else d
            count = e["entries"][name]
            if count * rate > n or n - count * rate >= rate:
                raise FormatError(f"{name} entry_count {count} does not fit {n} tokens at rate {rate}")
            kvd.expect_rows(expected, f"{name}.compressed_kv", (count, d), dtype)
            expected[f"{name}.buffer_kv"] = expected[f"{name}.buffer_gate"] = ((n - count * rate, width),
                                                                               torch.float32)
            if kind == CSA and count:
                expected[f"{name}.overlap_kv"] = expected[f"{name}.overlap_gate"] = ((rate, d), torch.float32)
        kvd.check_tensors(tensors, expected, kind)

        def part(name: str) -> CompressorState:
            return CompressorState(
                compressed_kv=_decode(tensors, f"{name}.compressed_kv", dtype),
                buffer_kv=tensors[f"{name}.buffer_kv"], buffer_gate=tensors[f"{name}.buffer_gate"],
                entry_count=e["entries"][name], overlap_kv=tensors.get(f"{name}.overlap_kv"),
                overlap_gate=tensors.get(f"{name}.overlap_gate"))

        return LayerKVState(kind, n, _decode(tensors, "window_kv", dtype),
                            compressor=part("compressor") if kind != SLIDING else None,
                            indexer=part("indexer") if kind == CSA else None)

    def on_host(self, state: LayerKVState) -> LayerKVState:
        return state.to("cpu") if state.window_kv.device.type != "cpu" else state

    def moved(self, state: LayerKVState, device, dtype) -> LayerKVState:
        return state.to(device, dtype)


DEEPSEEK_V4_KV = DeepseekV4KVFormat()


# ---------------------------------------------------------------------------------------------------------------
# The directory with this format (kv_directory's writer and reader)
# ---------------------------------------------------------------------------------------------------------------


class KVWriter(kvd.KVWriter):
    """kv_directory.KVWriter of DeepSeek-V4 layer states::

        w = KVWriter(kv_dir, identity_of_container(c), token_ids)        # the manifest: no layer complete yet
        for layer: w.write_layer(layer, state)                            # file, then manifest marks it complete
        w.finish(next_token=..., logits=last_logits)                      # "complete": true
    """

    def __init__(self, kv_dir: str, identity: Mapping, token_ids, dtype: str = "F32", start_token: int = 0,
                 overwrite: bool = False, sync: bool = True, extra: Mapping | None = None):
        super().__init__(kv_dir, DEEPSEEK_V4_KV, identity, token_ids, dtype, start_token, overwrite, sync, extra)

    # this module's names (tests of a full disk replace them here)
    def _check_free_space(self, needs: dict, what: str) -> None:
        check_free_space(needs, what)

    def _write_file(self, path: str, data: bytes, sync: bool) -> None:
        write_file_atomically(path, data, sync)


DeepseekV4KVFormat.writer = KVWriter  # (kv_directory.open_writer)


class KVDirectory(kvd.KVDirectory):
    """kv_directory.KVDirectory of a DeepSeek-V4 KV (its layers LayerKVState)."""

    def __init__(self, kv_dir: str, kv_format=DEEPSEEK_V4_KV, expect_identity: Mapping | None = None):
        super().__init__(kv_dir, kv_format, expect_identity)

    def _manifest_limit(self) -> int:  # this module's name (a test of an oversized manifest lowers it here)
        return MAX_MANIFEST_BYTES


def read_kv(kv_dir: str, expect_identity: Mapping | None = None, expect_prompt=None, prompt_prefix_of=None,
            device="cpu", dtype: torch.dtype = torch.float32) -> KVCache:
    """kv_directory.read_kv of a DeepSeek-V4 KV: one LayerKVState per layer."""
    return kvd.read_kv(kv_dir, DEEPSEEK_V4_KV, expect_identity, expect_prompt, prompt_prefix_of, device, dtype,
                       directory=KVDirectory)


def inspect_kv(kv_dir: str, expect_identity: Mapping | None = None, expect_prompt=None, verify: bool = True) -> dict:
    """kv_directory.inspect_kv of a DeepSeek-V4 KV (what `moepack kv inspect` prints)."""
    return kvd.inspect_kv(kv_dir, DEEPSEEK_V4_KV, expect_identity, expect_prompt, verify, directory=KVDirectory)
