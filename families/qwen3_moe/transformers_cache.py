"""transformers' Qwen3-MoE decode cache filled from a moepack KV directory of this family (moepack.kv's
`load_transformers_cache` dispatches here through the family, `Qwen3MoeFamily.transformers_cache`): each layer's
keys (after k_norm and RoPE, as transformers caches them) and values, so decoding continues where the prefill
stopped. transformers is imported on first use only."""

from __future__ import annotations

from moepack.format_spec.errors import FormatError

from ..kv_directory import KVCache, model_device_and_dtype


def load_transformers_cache(kv: KVCache, model, device=None, dtype=None):
    """A `transformers.DynamicCache` for `model` (a Qwen3MoeForCausalLM / Qwen3MoeModel) holding `kv`'s keys and
    values, [1, kv_heads, N, head_dim] a layer, on the model's device and dtype unless given; a KV of another shape
    than `model.config`'s is a FormatError naming what differs."""
    from transformers import DynamicCache

    config = model.config
    ours = {"num_layers": config.num_hidden_layers, "num_kv_heads": config.num_key_value_heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads}
    for key, value in ours.items():
        if kv.geometry[key] != value:
            raise FormatError(f"{kv.path}: KV from another model: {key} is {kv.geometry[key]} in the KV, {value} in "
                              "the transformers model")
    device, dtype = model_device_and_dtype(model, device, dtype)
    cache = DynamicCache(config=config)
    for layer, state in enumerate(kv.layers):
        cache.update(state.keys.to(device=device, dtype=dtype)[None], state.values.to(device=device, dtype=dtype)[None],
                     layer)
    return cache
