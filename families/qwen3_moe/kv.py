"""Qwen3-MoE's layer files in a KV directory (format_spec/KV.md section 9; the directory itself is every family's,
families/kv_directory.py): a layer's state is its LayerKV, the keys (after k_norm and RoPE) and values of every
token so far, [kv_heads, N, head_dim] each, stored as the tensors `keys` and `values` in the manifest's dtype."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from moepack.format_spec.errors import FormatError, MoepackError

from .. import kv_directory as kvd
from .config import Qwen3MoeConfig
from .model import LayerKV

_TENSORS = ("keys", "values")


class Qwen3MoeKVFormat:
    """families.base.KVFormat for Qwen3-MoE."""

    entry_fields = ("seen_tokens",)

    def geometry(self, config: Mapping[str, Any]) -> dict:
        try:
            c = Qwen3MoeConfig.from_hf(config)
        except MoepackError as e:  # a damaged or hostile config: the KV's own error type
            raise FormatError(f"config: {e}") from None
        return {"num_layers": c.num_layers, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim}

    def kv_bytes(self, config: Mapping[str, Any], n_tokens: int, dtype: str) -> int:
        g = self.geometry(config)
        return g["num_layers"] * len(_TENSORS) * g["num_kv_heads"] * n_tokens * kvd.row_bytes(g["head_dim"], dtype)

    def layer_kind(self, geometry: Mapping[str, Any], layer: int) -> str:
        return "attention"

    def seen_tokens(self, state: LayerKV) -> int:
        return state.length

    def check_state(self, geometry: Mapping[str, Any], layer: int, state: LayerKV) -> None:
        want = (geometry["num_kv_heads"], state.length, geometry["head_dim"])
        for name in _TENSORS:
            t = getattr(state, name)
            if t is None or tuple(t.shape) != want:
                raise MoepackError(f"layer {layer}: {name} {None if t is None else list(t.shape)}, the config "
                                   f"implies {list(want)}")

    def layer_tensors(self, geometry: Mapping[str, Any], layer: int, state: LayerKV, dtype: str):
        tensors = {}
        for name in _TENSORS:
            kvd.store_rows(tensors, name, getattr(state, name), dtype)
        return tensors, {"seen_tokens": str(state.length)}, {"seen_tokens": state.length}

    def entry_valid(self, geometry: Mapping[str, Any], layer: int, entry: Mapping[str, Any]) -> bool:
        return True  # its one field, seen_tokens, is the directory's

    def layer_state(self, geometry: Mapping[str, Any], layer: int, entry: Mapping[str, Any],
                    tensors: Mapping[str, torch.Tensor], dtype: str) -> LayerKV:
        expected: dict[str, tuple] = {}
        for name in _TENSORS:
            kvd.expect_rows(expected, name, (geometry["num_kv_heads"], entry["seen_tokens"], geometry["head_dim"]),
                            dtype)
        kvd.check_tensors(tensors, expected, self.layer_kind(geometry, layer))
        return LayerKV(*(kvd.decode_rows(tensors, name, dtype) for name in _TENSORS))

    def on_host(self, state: LayerKV) -> LayerKV:
        return self.moved(state, "cpu", None) if state.keys.device.type != "cpu" else state

    def moved(self, state: LayerKV, device, dtype) -> LayerKV:
        return LayerKV(*(getattr(state, name).to(device=device, dtype=dtype or getattr(state, name).dtype)
                         for name in _TENSORS))


QWEN3_MOE_KV = Qwen3MoeKVFormat()
