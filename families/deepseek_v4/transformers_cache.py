"""transformers' DeepseekV4 decode cache filled from a moepack KV directory of this family (moepack.kv's
`load_transformers_cache` dispatches here through the family, `DeepseekV4Family.transformers_cache`).

The Cache transformers' DeepseekV4 model keeps while it decodes (`DynamicCache(config=model.config)`: a
DynamicSlidingWindowLayer per sliding-only layer, DeepseekV4HCACache / DeepseekV4CSACache per compressed one) gets
each layer's state from the KV a moepack prefill wrote, so decoding continues where the prefill stopped.
transformers is imported on first use only.
"""

from __future__ import annotations

import torch

from moepack.format_spec.errors import FormatError

from ..kv_directory import model_device_and_dtype
from .kv import COMPRESSORS, CSA, SLIDING, KVCache, kv_geometry


def _model_config_dict(model) -> dict:
    config = getattr(model, "config", model)
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def _check_geometry(kv: KVCache, model) -> None:
    """The KV must have been made for a model of the same shape as `model` (layer kinds, rates, window, dims)."""
    ours = kv_geometry(_model_config_dict(model))
    for key in ("num_layers", "layer_types", "compress_rates", "sliding_window", "head_dim", "index_head_dim"):
        if ours[key] != kv.geometry[key]:
            raise FormatError(f"{kv.path}: KV from another model: {key} is {kv.geometry[key]} in the KV, "
                              f"{ours[key]} in the transformers model")


def load_transformers_cache(kv: KVCache, model, device=None, dtype=None):
    """A `transformers.DynamicCache` for `model` (a DeepseekV4ForCausalLM / DeepseekV4Model) holding the state of
    `kv` (a KV directory of this family, read and validated): per layer the sliding-window K=V tail and cumulative
    length, and for CSA/HCA layers every compressor's emitted entries, window buffer (kv and gate), entry count and
    CSA overlap. Tensors go to the model's device and dtype unless given. The KV's shape is checked against
    `model.config`."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    _check_geometry(kv, model)
    device, dtype = model_device_and_dtype(model, device, dtype)

    def moved(t: torch.Tensor) -> torch.Tensor:  # on the model's device and dtype, with a batch dimension of 1
        return t.to(device=device, dtype=dtype)[None]

    cache = DynamicCache(config=model.config)
    if len(cache.layers) != len(kv.layers):
        raise FormatError(f"{kv.path}: {len(kv.layers)} layers in the KV, the model's cache has {len(cache.layers)}")
    for number, (state, layer) in enumerate(zip(kv.layers, cache.layers)):
        kind = getattr(type(layer), "_layer_type", None)
        if kind is None and isinstance(layer, DynamicSlidingWindowLayer):
            kind = SLIDING
        if kind != state.layer_type or not isinstance(layer, DynamicSlidingWindowLayer):
            raise FormatError(f"{kv.path}: layer {number} is {state.layer_type} in the KV, the model's cache layer "
                              f"is {type(layer).__name__}")
        window = moved(state.window_kv)[None]  # [batch 1, 1 KV head, W, head_dim]
        layer.lazy_initialization(window, window)
        layer.keys = window
        layer.values = window  # shared K=V, as DeepseekV4HCACache.update keeps it
        layer.cumulative_length = state.seen_tokens
        for name in COMPRESSORS[state.layer_type]:
            part = getattr(state, name)
            layer.compressed_kv[name] = moved(part.compressed_kv)
            layer.buffer_kv[name] = moved(part.buffer_kv)
            layer.buffer_gate[name] = moved(part.buffer_gate)
            layer.entry_count[name] = part.entry_count
            if state.layer_type == CSA:
                overlap = part.overlap_kv is not None
                layer.overlap_kv[name] = moved(part.overlap_kv) if overlap else None
                layer.overlap_gate[name] = moved(part.overlap_gate) if overlap else None
    return cache
