"""Qwen3-MoE as llama.cpp's `qwen3moe` architecture: the hyperparameter keys its loader reads (the names of
gguf-py's Keys, as llama.cpp's convert_hf_to_gguf.py Qwen3MoeModel writes them) and what it cannot express.
The tensors' GGUF names are in tensors.py (TensorSpec.gguf)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from moepack.format_spec.errors import MoepackError

from ..base import GGUFModel
from ..rope import yarn_attention_factor
from .config import ARCHITECTURE, MODEL_TYPE, Qwen3MoeConfig

GGUF_ARCH = "qwen3moe"
TOKENIZER_PRE = "qwen2"  # what llama.cpp's converter names Qwen's BPE pre-tokenizer
# ... and its regex, as Qwen's tokenizer.json splits before the byte-level step (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2)
TOKENIZER_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {TOKENIZER_PRE: (TOKENIZER_SPLIT,)}


def gguf_model(c: Qwen3MoeConfig) -> GGUFModel:
    dense = [layer for layer in range(c.num_layers) if not c.is_moe_layer(layer)]
    if dense:
        raise MoepackError(f"llama.cpp's {GGUF_ARCH} has routed experts in every layer; layers {dense[:8]} hold a "
                           "dense MLP (mlp_only_layers / decoder_sparse_step)")
    if c.sliding_window is not None:
        raise MoepackError(f"llama.cpp's {GGUF_ARCH} attends every earlier token; this config's attention has a "
                           f"sliding window of {c.sliding_window} (use_sliding_window)")
    if not c.norm_topk_prob:
        raise MoepackError(f"llama.cpp's {GGUF_ARCH} renormalises the top-k routing weights; this config's "
                           "norm_topk_prob is false")
    a = GGUF_ARCH
    keys = (
        (f"{a}.block_count", "uint32", c.num_layers),
        (f"{a}.context_length", "uint32", c.max_position_embeddings),
        (f"{a}.embedding_length", "uint32", c.hidden_size),
        (f"{a}.feed_forward_length", "uint32", c.intermediate_size),
        (f"{a}.attention.head_count", "uint32", c.num_heads),
        (f"{a}.attention.head_count_kv", "uint32", c.num_kv_heads),
        (f"{a}.attention.key_length", "uint32", c.head_dim),
        (f"{a}.attention.value_length", "uint32", c.head_dim),
        (f"{a}.rope.freq_base", "float32", float(c.rope_theta)),
        (f"{a}.attention.layer_norm_rms_epsilon", "float32", float(c.rms_norm_eps)),
        (f"{a}.expert_count", "uint32", c.num_experts),
        (f"{a}.expert_used_count", "uint32", c.top_k),
        (f"{a}.expert_feed_forward_length", "uint32", c.moe_intermediate_size),
    ) + _rope_scaling_keys(c)
    return GGUFModel(GGUF_ARCH, keys, TOKENIZER_PRE)


def _rope_scaling_keys(c: Qwen3MoeConfig) -> tuple:
    """llama.cpp's rope.scaling keys of the config's linear or YaRN RoPE (as convert_hf_to_gguf.py writes them); a
    YaRN whose cos/sin scale or untruncated ramp llama.cpp would compute otherwise is one line."""
    s, a = c.rope_scaling, GGUF_ARCH
    if s is None:
        return ()
    keys = ((f"{a}.rope.scaling.type", "string", s.kind), (f"{a}.rope.scaling.factor", "float32", float(s.factor)))
    if s.kind == "linear":
        return keys
    if not s.truncate or s.attention_factor != yarn_attention_factor(s.factor):
        raise MoepackError("llama.cpp's YaRN scales cos and sin by its own mscale over a truncated ramp; this "
                           "config's rope_scaling sets attention_factor / mscale or truncate false")
    return keys + ((f"{a}.rope.scaling.original_context_length", "uint32", s.original_max_position_embeddings),
                   (f"{a}.rope.scaling.yarn_beta_fast", "float32", s.beta_fast),
                   (f"{a}.rope.scaling.yarn_beta_slow", "float32", s.beta_slow))


def _rope_scaling_config(key) -> dict:
    """gguf rope.scaling keys back to config.json's rope_scaling ({} for none); a kind not computed here is one
    line."""
    kind = key("rope.scaling.type", "none")
    if kind == "none":
        return {}
    if kind not in ("linear", "yarn"):
        raise MoepackError(f"{GGUF_ARCH}.rope.scaling.type {str(kind)[:40]!r} is not supported (qwen3-moe computes "
                           "none, linear and yarn)")
    scaling = {"rope_type": kind, "factor": float(key("rope.scaling.factor"))}
    if kind == "yarn":
        scaling.update(original_max_position_embeddings=int(key("rope.scaling.original_context_length")),
                       beta_fast=float(key("rope.scaling.yarn_beta_fast", 32.0)),
                       beta_slow=float(key("rope.scaling.yarn_beta_slow", 1.0)))
    return {"rope_scaling": scaling}


def config_from_gguf(keys: Mapping[str, Any], vocab_size: int, tied: bool) -> dict:
    """The config.json (transformers' spelling) of a `qwen3moe` GGUF's keys (`keys`: without the `qwen3moe.`
    prefix): gguf_model's inverse. A key llama.cpp requires that is absent is one line naming it."""
    def key(name: str, default: Any = None) -> Any:
        value = keys.get(name, default)
        if value is None:
            raise MoepackError(f"no {GGUF_ARCH}.{name} key")
        return value

    def decimal(name: str, default: float | None = None) -> float:
        # a float32 key as the shortest decimal it rounds from (1e-06, not 9.99e-07)
        return float(str(np.float32(key(name, default))))

    heads = int(key("attention.head_count"))
    # llama.cpp's converter writes key_length only from a config.json head_dim; its loader then takes
    # embedding_length / head_count, as transformers does where head_dim is left out (and rope.freq_base 10000)
    head_dim = int(key("attention.key_length", int(key("embedding_length")) // max(heads, 1)))
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "vocab_size": vocab_size,
        "hidden_size": int(key("embedding_length")), "num_hidden_layers": int(key("block_count")),
        "intermediate_size": int(key("feed_forward_length")), "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim, "rope_theta": decimal("rope.freq_base", 10000.0),
        "rms_norm_eps": decimal("attention.layer_norm_rms_epsilon"),
        "num_experts": int(key("expert_count")), "num_experts_per_tok": int(key("expert_used_count")),
        "moe_intermediate_size": int(key("expert_feed_forward_length")), "norm_topk_prob": True,
        "max_position_embeddings": int(key("context_length")), "tie_word_embeddings": tied,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu", **_rope_scaling_config(key),
    }
