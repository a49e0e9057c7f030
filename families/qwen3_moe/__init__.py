"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-480B-A35B): transformers' Qwen3MoeForCausalLM as a
model family. config.py reads its config.json, tensors.py names its tensors (transformers, GGUF) and loads a
checkpoint through that schema, model.py is the forward."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from moepack.format_spec.adapter import Adapter
from moepack.format_spec.errors import MoepackError

from ..base import (ExpertNaming, GGUFModel, GGUFTensor, MoeShape, TensorSpec,
                    chat_template_from_tokenizer_config, role_flops_per_token, schema_gguf_tensors)
from .adapter import QWEN3_MOE
from .gguf import GGUF_ARCH, PRE_TOKENIZERS, config_from_gguf, gguf_model
from .config import ARCHITECTURE, MODEL_TYPE, Qwen3MoeConfig
from .tensors import EXPERT_NAMING, HEAD, fp8_block, release_tensors, tensor_specs


class Qwen3MoeFamily:
    """The ModelFamily protocol for Qwen3-MoE (the forward functions imported when first used: torch)."""

    name = "qwen3-moe"
    head_tensor = HEAD
    integer_tensors = ()
    architectures = (ARCHITECTURE,)
    model_types = (MODEL_TYPE,)
    expert_naming: ExpertNaming = EXPERT_NAMING
    adapter: Adapter = QWEN3_MOE
    gguf_architectures = (GGUF_ARCH,)
    gguf_pre_tokenizers = PRE_TOKENIZERS
    chat_encoding = None  # its tokenizer_config's chat template
    kv_label = "KV"  # keys and values of every head

    def adapter_for(self, config: Mapping[str, Any]) -> Adapter:
        return self.adapter

    def parse_config(self, raw: Mapping[str, Any]) -> Qwen3MoeConfig:
        return Qwen3MoeConfig.from_hf(raw)

    def shape(self, config: Qwen3MoeConfig) -> MoeShape:
        return config.shape()

    def tensor_specs(self, config: Qwen3MoeConfig) -> list[TensorSpec]:
        return tensor_specs(config)

    def source_tensors(self, raw: Mapping[str, Any], layout: str | None = None
                       ) -> list[tuple[str, list[tuple[str, str, tuple[int, ...]]]]]:
        # `layout` is DeepSeek-V4's choice of release layout: a Qwen3-MoE config says its own (bf16 or -FP8)
        config, fp8 = Qwen3MoeConfig.from_hf(raw), fp8_block(raw) is not None
        return [(spec.name, release_tensors(spec, fp8)) for spec in tensor_specs(config)]

    def attention_kinds(self, config: Qwen3MoeConfig) -> list[str]:
        return ["full"] * config.num_layers

    def residual_streams(self, config: Qwen3MoeConfig) -> int:
        return 1

    def flops_per_token(self, config: Mapping[str, Any]) -> dict:
        return role_flops_per_token(self, config)

    def attention_flops(self, config: Qwen3MoeConfig, n_tokens: int) -> dict[str, float]:
        # causal attention: query t sees t + 1 keys, (N + 1) / 2 on average, in every layer; a sliding window W
        # bounds them at W (the KV still holds every key: the full attention's KV)
        per_key = 4 * config.num_heads * config.head_dim
        w = config.sliding_window
        if w is None or n_tokens <= w:
            growing = config.num_layers * per_key * (n_tokens + 1) / 2
            return {"window": 0.0, "growing": growing, "total": growing}
        window = config.num_layers * per_key * (w * (w + 1) / 2 + (n_tokens - w) * w) / n_tokens
        return {"window": window, "growing": 0.0, "total": window}

    def kv_bytes(self, config: Qwen3MoeConfig, n_tokens: int, element_bytes: int) -> int:
        return 2 * n_tokens * config.num_kv_heads * config.head_dim * element_bytes

    def gguf_model(self, config: Mapping[str, Any]) -> GGUFModel:
        return gguf_model(Qwen3MoeConfig.from_hf(config))

    def gguf_tensors(self, config: Mapping[str, Any], names: Sequence[str] | None) -> list[GGUFTensor]:
        # the schema's tensors and order, whatever the container's; what llama.cpp cannot run refused first
        parsed = Qwen3MoeConfig.from_hf(config)
        return schema_gguf_tensors(self, parsed, gguf_model(parsed).architecture)

    def config_from_gguf(self, keys: Mapping[str, Any], vocab_size: int, tied: bool,
                         tensors: Collection[str] = ()) -> dict:
        return config_from_gguf(keys, vocab_size, tied)

    def new_kv(self, config: Qwen3MoeConfig):
        from .model import KVState

        return KVState.empty(config)

    def embed(self, config, globals_, ids):
        from .model import embed

        return embed(globals_, ids)

    def before_experts(self, config, layer, weights, hidden, kv):
        from .model import before_experts

        return before_experts(config, layer, weights, hidden, kv.layers[layer])

    def expert_ffn(self, config, expert, x):
        from .model import swiglu_ffn

        return swiglu_ffn(expert, x)

    def after_experts(self, config, layer, weights, residual, ffn_input, expert_out):
        from .model import after_experts

        return after_experts(config, layer, weights, residual, ffn_input, expert_out)

    def head(self, config, globals_, hidden):
        from .model import head

        return head(config, globals_, hidden)

    def transformers_cache(self, kv, model, device=None, dtype=None):
        """transformers' Qwen3-MoE cache for `model` filled from a read KV directory of this family
        (transformers_cache.py; moepack.kv.load_transformers_cache asks it)."""
        from .transformers_cache import load_transformers_cache

        return load_transformers_cache(kv, model, device, dtype)

    def chat_template(self, tokenizer_config: Mapping[str, Any]) -> str | None:
        return chat_template_from_tokenizer_config(tokenizer_config)

    def check_container(self, container, computable: bool = True) -> Qwen3MoeConfig:
        from moepack.families import container_schema_problem

        problem = container_schema_problem(self, container)
        if problem:
            raise MoepackError(f"{container.path}: {problem}")
        return self.parse_config(container.config)

    def checkpoint_problem(self, config, experts_per_layer, shapes) -> str | None:
        """A quantization other than the -FP8 releases' (the converter reads FP8 weights by their rule: e4m3,
        128x128 blocks), else the schema's refusals (families.schema_problem)."""
        from moepack.families import schema_problem

        try:
            fp8_block(config)
        except MoepackError as e:
            return str(e)
        return schema_problem(self, config, experts_per_layer, shapes)

    def refusal(self, config: Mapping[str, Any]) -> str | None:
        return None  # parse_config refuses what this runtime would compute otherwise

    def layer_prefill(self, config: Qwen3MoeConfig, compute_dtype):
        from .prefill import Qwen3MoePrefill

        return Qwen3MoePrefill(config, compute_dtype)

    @property
    def kv_format(self):
        """Its layer files in a KV directory (families/base.py KVFormat; kv.py)."""
        from .kv import QWEN3_MOE_KV

        return QWEN3_MOE_KV

    def layer_decode(self, config: Qwen3MoeConfig, compute_dtype):
        """The token-major decode's arithmetic (families.base.LayerDecode)."""
        from .decode import Qwen3MoeDecode

        return Qwen3MoeDecode(config, compute_dtype)


FAMILY = Qwen3MoeFamily()
