"""Qwen3-MoE's synthetic checkpoints (`moepack synth --family qwen3-moe`; families/synthetic.py's protocol,
packer/synth.py writes them), as Qwen ships one: config.json, safetensors under transformers' names (tensors.py's
schema), a byte-level tokenizer with Qwen's special tokens and a ChatML chat_template in its tokenizer_config.

Layouts: ``release`` (the `-FP8` releases: F8_E4M3 linears + BF16 `weight_scale_inv` per 128x128 block), ``bf16``,
``f32``.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from moepack.format_spec.errors import MoepackError
from moepack.format_spec.source_formats import FP8_BLOCK, fp8_block_quantize

from ..base import ROLE_EMBED, ROLE_NORM, TensorSpec
from ..synthetic import SynthCheckpoint, byte_level_tokenizer, layout_config, tensor_generator
from .config import Qwen3MoeConfig
from .tensors import release_tensors, tensor_specs

LAYOUTS = ("release", "bf16", "f32")
TAKES_TOKENIZER = False  # it writes its own byte-level tokenizer
RANDOM_EXPERT_CODES = False

# Qwen3-30B-A3B's proportions, shrunk: GQA (two query heads per KV head), head_dim 64, every layer routed, top-k
# renormalised; the dims multiples of 128 and 256 (FP8 blocks, ggml super-blocks).
_PRESET_DIMS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
                 num_experts_per_tok=2),
    "small": dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                  num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=32,
                  num_experts_per_tok=4),
    # Qwen3-30B-A3B's layer at its own width (hidden 2048, 32 query heads over 4 KV heads of 128, experts of 768,
    # top-8), 6 layers of 64 experts: ~2 GB in the release layout, benchmarks/decode.py --family qwen3-moe's
    "medium": dict(vocab_size=8192, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                   num_hidden_layers=6, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=64,
                   num_experts_per_tok=8),
}
PRESETS = tuple(_PRESET_DIMS)
# config.json's quantization_config of Qwen's `-FP8` releases (the `release` layout here)
RELEASE_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                               "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # Qwen's: ids 0-2 here
# ChatML, as Qwen3's tokenizer_config carries it (without its tool and thinking parts)
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def preset_config(preset: str) -> dict:
    """The config.json (transformers' Qwen3MoeConfig field names, as the releases spell them) of a preset."""
    if preset not in _PRESET_DIMS:
        raise MoepackError(f"unknown qwen3-moe preset {preset!r} (choose one of {', '.join(PRESETS)})")
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": None,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu", "initializer_range": 0.02,
        "max_position_embeddings": 32768, "norm_topk_prob": True, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "rope_scaling": None, "router_aux_loss_coef": 0.001, "sliding_window": None, "use_sliding_window": False,
        "tie_word_embeddings": False, "use_cache": True, **_PRESET_DIMS[preset],
    }
    return dict(sorted(config.items()))


def tokenizer_json() -> dict:
    """The byte-level tokenizer: ids 0-2 Qwen's special tokens, 3-258 the 256 bytes; no BOS (as Qwen's)."""
    return byte_level_tokenizer(SPECIAL_TOKENS, bos_token=None)


def _stored(spec: TensorSpec, layout: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """What `layout` stores for `spec`: a release's tensors (the `release` layout's FP8 linears with their BF16
    `weight_scale_inv`, as tensors.py reads them), or the one float tensor of `bf16` / `f32`."""
    if layout == "f32":
        return [(spec.name, "F32", spec.shape)]
    return release_tensors(spec, fp8=layout == "release")


def _encoded(spec: TensorSpec, layout: str, seed: int) -> dict[str, torch.Tensor]:
    """A tensor drawn from its own generator (unit-variance linears, unit-RMS embedding rows, norms near one) and
    stored in `layout`; FP8 through format_spec's block quantizer, its power-of-two scales exact in BF16."""
    value = torch.randn(spec.shape, generator=tensor_generator(seed, spec.name))
    if spec.role == ROLE_NORM:
        value.mul_(0.05).add_(1.0)
    elif spec.role != ROLE_EMBED:
        value.mul_(1.0 / math.sqrt(spec.shape[-1]))
    parts = _stored(spec, layout)
    if len(parts) == 2:  # an FP8 weight and its block scales
        weight, scale = fp8_block_quantize(value)
        return {parts[0][0]: weight, parts[1][0]: scale.float().to(torch.bfloat16)}
    return {spec.name: value.to(torch.float32 if layout == "f32" else torch.bfloat16)}


def checkpoint(preset: str, layout: str, seed: int, config_overrides: dict | None = None,
               tokenizer: str | os.PathLike | None = None, random_expert_codes: bool = False) -> SynthCheckpoint:
    """A preset's checkpoint in `layout` (`config_overrides` replace preset fields); `tokenizer` and
    `random_expert_codes` are not taken (TAKES_TOKENIZER, RANDOM_EXPERT_CODES: the writer refuses them first)."""
    config = layout_config({**preset_config(preset), **(config_overrides or {})}, layout, RELEASE_QUANTIZATION_CONFIG)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": config["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE}
    return SynthCheckpoint(config, tensor_specs(Qwen3MoeConfig.from_hf(config)),
                           lambda spec: _stored(spec, layout), lambda spec: _encoded(spec, layout, seed),
                           {"tokenizer.json": tokenizer_json(), "tokenizer_config.json": tokenizer_config})
