"""Qwen3-MoE as llama.cpp's `qwen3moe` architecture: the hyperparameter keys its loader reads (the names of
gguf-py's Keys, as llama.cpp's convert_hf_to_gguf.py Qwen3MoeModel writes them) and what it cannot express.
The tensors' GGUF names are in tensors.py (TensorSpec.gguf)."""

from __future__ import annotations

from moepack.format_spec.errors import MoepackError

from ..base import GGUFModel
from .config import Qwen3MoeConfig

GGUF_ARCH = "qwen3moe"
TOKENIZER_PRE = "qwen2"  # what llama.cpp's converter names Qwen's BPE pre-tokenizer


def gguf_model(c: Qwen3MoeConfig) -> GGUFModel:
    dense = [layer for layer in range(c.num_layers) if not c.is_moe_layer(layer)]
    if dense:
        raise MoepackError(f"llama.cpp's {GGUF_ARCH} has routed experts in every layer; layers {dense[:8]} hold a "
                           "dense MLP (mlp_only_layers / decoder_sparse_step)")
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
    )
    return GGUFModel(GGUF_ARCH, keys, TOKENIZER_PRE)
