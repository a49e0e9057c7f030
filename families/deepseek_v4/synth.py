"""DeepSeek-V4's synthetic checkpoints (`moepack synth`; families/synthetic.py's protocol, packer/synth.py writes
them): every tensor the real release holds, at sizes a test or a demo can afford.

What a checkpoint of a config holds is tensors.py's schema (`v4_tensor_specs`, canonical names, no `model.`
prefix), in one of three layouts:

* ``release``: what deepseek-ai ships. Dense linears FP8 e4m3 + `.scale` (E8M0, 128x128 blocks); routed experts
  packed FP4 e2m1 as I8 [out, in/2] + `.scale` (E8M0, one per 32 inputs); router, compressor and indexer
  `weights_proj` linears BF16; embed/head BF16; norms, mHC, sinks, ape, router bias F32; tid2eid I64.
* ``bf16``: every float tensor BF16 except the ones transformers keeps in F32 (role "exact").
* ``f32``: every float tensor F32.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
import torch

from moepack.format_spec.errors import MoepackError
from moepack.format_spec.source_formats import FP8_BLOCK, fp4_quantize, fp8_block_quantize

from ..synthetic import SynthCheckpoint, byte_level_tokenizer, layout_config, read_tokenizer, tensor_generator
from . import chat
from . import tensors as _tensors
from .config import CSA, HCA, SLIDING, ModelConfig
from .tensors import ROLE_DENSE_LINEAR, ROLE_EXPERT, TensorSpec, stored_tensors, v4_tensor_specs

PRESETS = ("tiny", "small", "medium")
LAYOUTS = _tensors.LAYOUTS  # the layouts stored_tensors stores
TAKES_TOKENIZER = True  # `synth --tokenizer`: the release's tokenizer, say
RANDOM_EXPERT_CODES = True

# The release's config.json quantization block (as in tests/data/deepseek-v4-flash.config.json).
RELEASE_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "expert_dtype": "fp4",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
}


# ---------------------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------------------

# Sizes chosen so every linear's input dim is a multiple of 256 and its output dim a multiple of 32 where the
# architecture allows (ggml's 256-element super-blocks and FP8's 128x128 blocks all apply, and hidden >= 256
# tiles FP8 blocks for real), and compress rates small enough that a short prompt closes several windows.
_PRESET_DIMS: dict[str, dict[str, Any]] = {
    # ~12M parameters, a few MB in the release layout: every layer kind once, tests load it in a second.
    "tiny": dict(
        vocab_size=512,
        hidden_size=256,
        moe_intermediate_size=256,
        layer_types=[SLIDING, CSA, HCA, SLIDING],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        num_attention_heads=4,
        head_dim=128,
        q_lora_rank=256,
        o_groups=2,
        o_lora_rank=128,
        index_n_heads=8,
        index_head_dim=32,
        index_topk=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        compress_rates={CSA: 4, HCA: 8},
        sliding_window=16,
    ),
    # ~110M parameters, ~60 MB in the release layout.
    "small": dict(
        vocab_size=1024,
        hidden_size=512,
        moe_intermediate_size=256,
        layer_types=[SLIDING, SLIDING, CSA, HCA, CSA, SLIDING],
        mlp_layer_types=["hash_moe", "hash_moe", "hash_moe", "moe", "moe", "moe"],
        num_attention_heads=8,
        head_dim=128,
        q_lora_rank=256,
        o_groups=4,
        o_lora_rank=128,
        index_n_heads=16,
        index_head_dim=64,
        index_topk=8,
        n_routed_experts=32,
        num_experts_per_tok=4,
        compress_rates={CSA: 4, HCA: 16},
        sliding_window=32,
    ),
    # ~4.4B parameters: ~2.4 GB in the release layout, ~9 GB in bf16 (transformers still holds it in 24 GB).
    "medium": dict(
        vocab_size=8192,
        hidden_size=1024,
        moe_intermediate_size=1024,
        layer_types=[SLIDING, SLIDING] + [CSA, HCA] * 8 + [CSA, SLIDING],
        mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 17,
        num_attention_heads=8,
        head_dim=256,
        q_lora_rank=512,
        o_groups=4,
        o_lora_rank=256,
        index_n_heads=16,
        index_head_dim=64,
        index_topk=16,
        n_routed_experts=64,
        num_experts_per_tok=6,
        compress_rates={CSA: 4, HCA: 32},
        sliding_window=64,
    ),
}


def preset_config(preset: str) -> dict:
    """The config.json (transformers DeepseekV4Config field names) of a preset, without quantization_config."""
    if preset not in _PRESET_DIMS:
        raise MoepackError(f"unknown preset {preset!r} (choose one of {', '.join(PRESETS)})")
    dims = json.loads(json.dumps(_PRESET_DIMS[preset]))  # a deep copy callers may edit
    partial_rotary_factor = 0.125  # as V4-Flash: 64 rope dims of a 512 head
    config = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": None,
        "compress_rope_theta": 160000.0,
        "hc_eps": 1e-06,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_position_embeddings": 1048576,
        "mlp_bias": False,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_hidden_layers": len(dims["layer_types"]),
        "num_key_value_heads": 1,
        "num_nextn_predict_layers": 1,
        "partial_rotary_factor": partial_rotary_factor,
        "qk_rope_head_dim": int(dims["head_dim"] * partial_rotary_factor),
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "rope_parameters": {
            "main": {"partial_rotary_factor": partial_rotary_factor, "rope_theta": 10000.0, "rope_type": "default"},
            "compress": {
                "attention_factor": 1.0,
                "beta_fast": 32,
                "beta_slow": 1,
                "factor": 16,
                "original_max_position_embeddings": 65536,
                "partial_rotary_factor": partial_rotary_factor,
                "rope_theta": 160000.0,
                "rope_type": "yarn",
                "type": "yarn",
            },
        },
        "routed_scaling_factor": 1.5,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "scoring_func": "sqrtsoftplus",
        "swiglu_limit": 10.0,
        "tie_word_embeddings": False,
        "use_cache": True,
    }
    config.update(dims)
    return dict(sorted(config.items()))


# ---------------------------------------------------------------------------------------------------------
# Drawing and encoding one tensor
# ---------------------------------------------------------------------------------------------------------


def draw_tensor(spec: TensorSpec, config: dict, seed: int) -> torch.Tensor:
    """The float32 (int64 for tid2eid) value of `spec` in the synthetic model of this seed, before encoding."""
    generator = tensor_generator(seed, spec.name)
    if spec.kind == "tid2eid":
        # Each token routes to top_k distinct experts: the first top_k of a random permutation per row.
        vocab, top_k = spec.shape
        noise = torch.rand(vocab, ModelConfig.from_hf(config).n_routed_experts, generator=generator)
        return noise.argsort(dim=1, stable=True)[:, :top_k].contiguous()
    values = torch.randn(spec.shape, generator=generator)
    if spec.kind in ("linear", "hc_fn"):
        # As an initialised model: unit-variance inputs give unit-variance outputs.
        return values.mul_(1.0 / math.sqrt(spec.shape[-1]))
    if spec.kind == "embedding":
        return values  # rows of unit RMS, as the RMSNorms downstream expect
    if spec.kind in ("norm", "hc_scale"):
        return values.mul_(0.05).add_(1.0)  # near one, but not exactly: a mis-mapped norm shows
    spread = {"hc_base": 0.1, "attn_sink": 0.5, "ape": 0.2, "router_bias": 0.02}
    return values.mul_(spread[spec.kind])


def encode_tensor(spec: TensorSpec, value: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    """`value` (from draw_tensor) as the tensors `stored_tensors(spec, layout)` lists, by name."""
    parts = stored_tensors(spec, layout)
    if spec.kind == "tid2eid":
        return {spec.name: value}
    if layout == "release" and spec.role == ROLE_DENSE_LINEAR:
        weight, scale = fp8_block_quantize(value)
        return {parts[0].name: weight, parts[1].name: scale}
    if layout == "release" and spec.role == ROLE_EXPERT:
        packed, scale = fp4_quantize(value)
        return {parts[0].name: packed, parts[1].name: scale}
    dtype = torch.float32 if parts[0].dtype == "F32" else torch.bfloat16
    return {spec.name: value.to(dtype)}


# the RMS of an e2m1 code drawn uniformly from the 16: sqrt(mean of 0, .25, 1, 2.25, 4, 9, 16, 36) over both signs
_E2M1_UNIFORM_RMS = math.sqrt(68.5 / 8)


def random_fp4_expert(spec: TensorSpec, layout: str, seed: int) -> dict[str, torch.Tensor]:
    """A routed expert's matrix as the release stores it, its packed codes random bytes and every scale the one
    power of two that gives its outputs about unit variance (as draw_tensor's linears): no float is drawn."""
    out_features, in_features = spec.shape
    parts = stored_tensors(spec, layout)
    rng = np.random.default_rng(tensor_generator(seed, spec.name).initial_seed())  # numpy's bytes: 3x torch's
    packed = torch.from_numpy(rng.integers(0, 256, (out_features, in_features // 2), dtype=np.uint8)).view(torch.int8)
    exponent = round(math.log2(1.0 / (_E2M1_UNIFORM_RMS * math.sqrt(in_features))))
    scale = torch.full((out_features, in_features // 32), exponent + 127, dtype=torch.uint8)
    return {parts[0].name: packed, parts[1].name: scale.view(torch.float8_e8m0fnu)}


# ---------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
_SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)  # ids 0, 1, 2, as bos/eos in the release config
# the rest of the chat encoding's markup (chat.py), one token each as in the release's tokenizer: ids 259-262
_MARKUP_TOKENS = tuple(t for t in chat.SPECIAL_TOKENS if t not in _SPECIAL_TOKENS)
TOKENIZER_VOCAB_SIZE = len(_SPECIAL_TOKENS) + 256 + len(_MARKUP_TOKENS)


def tokenizer_json() -> dict:
    """The tiny byte-level tokenizer: ids 0-2 the release's special tokens, 3-258 the 256 bytes, 259-262 the chat's
    role and thinking tags; BOS in front."""
    return byte_level_tokenizer(_SPECIAL_TOKENS, BOS_TOKEN, _MARKUP_TOKENS)


def _tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
    }


# A tokenizer of one's own (`synth --tokenizer`), e.g. the release's: embedded byte for byte instead of the one above.
VOCAB_MULTIPLE = 128  # the release pads its tokenizer to 129,280 = 1010 x 128 entries, and vocab_size is that


def _fit_config_to_tokenizer(config: dict, tokenizer: dict, vocab_overridden: bool) -> None:
    """Raise vocab_size to the tokenizer's entries, rounded up to VOCAB_MULTIPLE; take its BOS/EOS ids."""
    need = tokenizer["vocab"]
    if config["vocab_size"] < need:
        if vocab_overridden:
            raise MoepackError(f"vocab_size {config['vocab_size']} is smaller than the tokenizer's {need} entries")
        config["vocab_size"] = -(-need // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    for key in ("bos_token_id", "eos_token_id"):
        if tokenizer[key] is not None:
            config[key] = tokenizer[key]


# ---------------------------------------------------------------------------------------------------------
# The checkpoint
# ---------------------------------------------------------------------------------------------------------


def checkpoint(preset: str, layout: str, seed: int, config_overrides: dict | None = None,
               tokenizer: str | os.PathLike | None = None, random_expert_codes: bool = False) -> SynthCheckpoint:
    """A preset's checkpoint in `layout`: `config_overrides` replace preset fields (keep layer_types /
    mlp_layer_types consistent); `tokenizer` (read_tokenizer) is embedded instead of tokenizer_json's, vocab_size
    raised to its entries rounded up to VOCAB_MULTIPLE (the release tokenizer's 129,280 stays 129,280: embed, head
    and tid2eid grow to it) and bos/eos ids taken from its tokenizer_config.json; `random_expert_codes` (release
    layout): the routed experts drawn by random_fp4_expert."""
    config = {**preset_config(preset), **(config_overrides or {})}
    own_tokenizer = read_tokenizer(tokenizer) if tokenizer is not None else None
    if own_tokenizer is not None:
        _fit_config_to_tokenizer(config, own_tokenizer, "vocab_size" in (config_overrides or {}))
    layout_config(config, layout, RELEASE_QUANTIZATION_CONFIG)
    specs = v4_tensor_specs(config)
    if own_tokenizer is None and TOKENIZER_VOCAB_SIZE > ModelConfig.from_hf(config).vocab_size:
        raise AssertionError("preset vocab smaller than the tokenizer's")

    def stored(spec: TensorSpec) -> list[tuple[str, str, tuple[int, ...]]]:
        return [(t.name, t.dtype, t.shape) for t in stored_tensors(spec, layout)]

    def encode(spec: TensorSpec) -> dict[str, torch.Tensor]:
        if random_expert_codes and layout == "release" and spec.role == ROLE_EXPERT:
            return random_fp4_expert(spec, layout, seed)
        return encode_tensor(spec, draw_tensor(spec, config, seed), layout)

    tokenizer_files = (own_tokenizer["files"] if own_tokenizer is not None else
                       {"tokenizer.json": tokenizer_json(), "tokenizer_config.json": _tokenizer_config()})
    return SynthCheckpoint(config, specs, stored, encode, tokenizer_files)
