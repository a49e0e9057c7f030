"""DeepSeek-V4 as a registered model family (moepack.families' table): the ModelFamily protocol over this package's
config, tensor schema, adapter, prefill and chat encoding. What needs torch is imported when first used, so a
look-up of the family imports none."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from moepack.format_spec.adapter import Adapter
from moepack.format_spec.errors import MoepackError

from ..base import (ROLE_ATTENTION, ROLE_DENSE_FFN, ROLE_EMBED, ROLE_EXPERT, ROLE_HEAD, ROLE_NORM, ROLE_ROUTER,
                    ExpertNaming, GGUFModel, GGUFTensor, MoeShape, TensorSpec, flops_summary, sum_entries)
from . import gguf, names
from .names import EXPERT_NAMING
from .arch import DEEPSEEK_V4
from .config import CSA, HCA, MODEL_TYPE, ConfigError, ModelConfig, quantization_problem, unsupported

ARCHITECTURE = "DeepseekV4ForCausalLM"
GGUF_ARCHITECTURE = "deepseek4"  # llama.cpp's
SHORT_TYPES = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
               "heavily_compressed_attention": "hca"}


def _role(name: str) -> str:
    """A canonical tensor name's role (families.base ROLE_*)."""
    if name in ("embed.weight",):
        return ROLE_EMBED
    if name in ("head.weight",) or name.startswith("hc_head"):
        return ROLE_HEAD
    rest = name.split(".", 2)[2] if name.startswith("layers.") else name
    if rest.startswith("ffn.experts."):
        return ROLE_EXPERT
    if rest.startswith("ffn.gate."):
        return ROLE_ROUTER
    if rest.startswith("ffn.shared_experts."):
        return ROLE_DENSE_FFN
    if "norm" in rest.split(".")[-2:][0] or rest.endswith("norm.weight"):
        return ROLE_NORM
    return ROLE_ATTENTION


class DeepseekV4Family:
    """The ModelFamily protocol for DeepSeek-V4 (V4-Flash, V4-Pro: the release's and transformers' layouts, one
    adapter for both). The protocol's generic forward functions are not implemented here; its prefill and decode
    are layer_prefill's and layer_decode's."""

    name = "deepseek-v4"
    head_tensor = "head.weight"
    integer_tensors = (".ffn.gate.tid2eid",)  # the hash layers' token -> experts table
    architectures = (ARCHITECTURE,)
    model_types = (MODEL_TYPE,)
    expert_naming: ExpertNaming = EXPERT_NAMING
    adapter: Adapter = DEEPSEEK_V4
    gguf_architectures = (GGUF_ARCHITECTURE,)
    gguf_pre_tokenizers = gguf.PRE_TOKENIZERS
    kv_label = "KV + indexer KV"  # a CSA layer's compressed entries keep the Lightning Indexer's keys beside them

    @property
    def chat_encoding(self):
        """Its chat encoder (chat.py): DeepSeek-V4's markup is rendered in code, never from message text."""
        from . import chat

        return chat

    @property
    def kv_format(self):
        """Its layer files in a KV directory (families/base.py KVFormat; kv.py, format_spec/KV.md)."""
        from .kv import DEEPSEEK_V4_KV

        return DEEPSEEK_V4_KV

    def transformers_cache(self, kv, model, device=None, dtype=None):
        """transformers' DeepseekV4 cache for `model` filled from a read KV directory of this family
        (transformers_cache.py; moepack.kv.load_transformers_cache asks it)."""
        from .transformers_cache import load_transformers_cache

        return load_transformers_cache(kv, model, device, dtype)

    def adapter_for(self, config: Mapping[str, Any]) -> Adapter:
        return self.adapter

    def parse_config(self, raw: Mapping[str, Any]) -> ModelConfig:
        return ModelConfig.from_hf(raw)

    def shape(self, config: ModelConfig) -> MoeShape:
        return MoeShape(num_layers=config.num_layers, hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                        num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
                        expert_intermediate=config.moe_intermediate_size, moe_layers=tuple(range(config.num_layers)),
                        hash_layers=tuple(i for i, hashed in enumerate(config.hash_layers) if hashed))

    def tensor_specs(self, config: Mapping[str, Any]) -> list[TensorSpec]:
        """The main model's tensors (no MTP layers) of a config.json (V4's schema reads the raw config)."""
        from .tensors import v4_tensor_specs

        out = []
        for spec in v4_tensor_specs(config, mtp=False):
            parts = spec.name.split(".")
            layer = int(parts[1]) if parts[0] == "layers" else None
            expert = int(parts[4]) if parts[2:4] == ["ffn", "experts"] else None
            out.append(TensorSpec(spec.name, tuple(spec.shape), _role(spec.name), names.to_gguf(spec.name),
                                  layer, expert))
        return out

    def source_tensors(self, raw: Mapping[str, Any], layout: str | None = None):
        """What a checkpoint of this config.json stores per tensor: [(name, [(stored name, safetensors dtype,
        shape)])], in the release's layout (FP8 + FP4, the default where the config has the release's
        quantization_config) or bf16's."""
        from .config import quant_method
        from .tensors import stored_tensors, v4_tensor_specs

        layout = layout or ("release" if quant_method(raw) == "fp8" else "bf16")
        return [(spec.name, [(st.name, st.dtype, tuple(st.shape)) for st in stored_tensors(spec, layout)])
                for spec in v4_tensor_specs(raw)]

    def attention_kinds(self, config: ModelConfig) -> list[str]:
        """Per layer, its attention: sliding, csa or hca."""
        return [SHORT_TYPES.get(t, t) for t in config.layer_types]

    def residual_streams(self, config: ModelConfig) -> int:
        return config.hc_mult

    def flops_per_token(self, raw: Mapping[str, Any]) -> dict:
        cfg = ModelConfig.from_hf(raw)
        from .tensors import v4_tensor_specs

        top_k = cfg.num_experts_per_tok
        parts = {p: 0 for p in FLOP_PARTS}
        # a head tied to the embedding is not stored but still multiplies
        head = 2 * cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings else 0
        for spec in v4_tensor_specs(raw):
            if len(spec.shape) != 2 or spec.kind not in ("linear", "hc_fn"):
                continue
            kind, block, expert = self.adapter.place(spec.name)
            n = math.prod(spec.shape)
            if kind == "global":
                head += 2 * n  # head.weight, hc_head_fn
                continue
            if not block.startswith("layers."):
                continue
            if kind == "expert":
                if expert == 0:
                    parts["routed_experts"] += 2 * n * top_k
                continue
            parts[_flop_part(spec.name.split(".", 2)[2])] += 2 * n
        return flops_summary(parts, head)

    def attention_flops(self, config: ModelConfig, n_tokens: int) -> dict[str, float]:
        # QK scores and the weighted sum, 4 x heads x head_dim per key, plus the Lightning Indexer's scores
        n = max(int(n_tokens), 1)
        per_key = 4 * config.num_heads * config.head_dim
        window = growing = 0.0
        # keys visible to the query at position t (0-based), averaged over t in [0, n)
        w = config.sliding_window
        avg_window = (min(n, w) * (min(n, w) + 1) / 2 + max(n - w, 0) * w) / n
        for kind, rate in zip(config.layer_types, config.compress_rates):
            window += per_key * avg_window
            if kind == HCA:
                growing += per_key * _avg_entries(n, rate)
            elif kind == CSA:
                window += per_key * _avg_entries(n, rate, cap=config.index_topk)
                growing += 2 * config.index_n_heads * config.index_head_dim * _avg_entries(n, rate)
        return {"window": window, "growing": growing, "total": window + growing}

    def kv_bytes(self, config: ModelConfig, n_tokens: int, element_bytes: int) -> int:
        """The largest layer's KV after n_tokens: the sliding window tail plus the compressed entries (CSA: and
        the indexer's keys), as format_spec/KV.md stores them."""
        b, best = element_bytes, 0
        for kind, rate in zip(config.layer_types, config.compress_rates):
            size = min(n_tokens, config.sliding_window - 1) * config.head_dim * b
            if kind in (CSA, HCA):
                size += (n_tokens // rate) * config.head_dim * b
            if kind == CSA:
                size += (n_tokens // rate) * config.index_head_dim * b
            best = max(best, size)
        return best

    def gguf_model(self, config: Mapping[str, Any]) -> GGUFModel:
        return gguf.gguf_model(config)

    def gguf_tensors(self, config: Mapping[str, Any], names: Sequence[str] | None) -> list[GGUFTensor]:
        return gguf.gguf_tensors(config, names)

    def config_from_gguf(self, keys: Mapping[str, Any], vocab_size: int, tied: bool,
                         tensors: Collection[str] = ()) -> dict:
        return gguf.config_from_gguf(keys, vocab_size, tied, tensors)

    # ModelFamily's forward functions: DeepSeek-V4's forward is model.py's (mHC residual streams, compressed KV),
    # run by its layer_prefill and layer_decode (decode.py), not one step at a time here
    def _no_generic_forward(self, *_args):
        raise MoepackError("DeepSeek-V4 runs through its LayerPrefill and LayerDecode, not ModelFamily's "
                           "forward functions")

    new_kv = embed = before_experts = expert_ffn = after_experts = head = _no_generic_forward

    def chat_template(self, tokenizer_config: Mapping[str, Any]) -> str | None:
        """DeepSeek-V4 encodes its chat in code (chat.py), not by its tokenizer's template: its Jinja rendering."""
        from .chat import chat_template

        return chat_template()

    def layer_prefill(self, config: ModelConfig, compute_dtype):
        from .model import DeepseekV4Prefill

        return DeepseekV4Prefill(config, compute_dtype)

    def layer_decode(self, config: ModelConfig, compute_dtype):
        """The token-major decode's arithmetic (families.base.LayerDecode; decode.py)."""
        from .decode import DeepseekV4Decode

        # (the compute dtype is per matrix, in_compute_dtype's: the low-precision matrices', the arena's products')
        return DeepseekV4Decode(config, compute_dtype)

    def check_container(self, container, computable: bool = True) -> ModelConfig:
        """The model a container holds, as this runtime will compute it, checked before anything is read: a
        DeepSeek-V4 config (that this runtime computes as transformers does, unless `computable` is False), and
        every tensor that model uses in the container with the shape the config gives it (else compute would fail
        half-way or, for an optional one such as the router's bias, silently differ)."""
        from moepack.families import value_type_problem

        c = container  # (its architecture is this family's: moepack.families.container_family chose it)
        try:
            cfg = ModelConfig.from_hf(c.config)
        except ConfigError as e:
            raise MoepackError(f"{c.path}: the config in the index is not a usable DeepSeek-V4 config "
                               f"({e.detail})") from None
        problem = unsupported(c.config)
        if problem and computable:
            raise MoepackError(f"{c.path}: {problem}")
        if len(c.layers) != cfg.num_layers or any(len(b.experts) != cfg.n_routed_experts for b in c.layers):
            raise MoepackError(f"{c.path}: the container's layers/experts do not match its config "
                               f"({cfg.num_layers} layers of {cfg.n_routed_experts} experts)")
        problem = (_tensor_problem(c.config, {n: t.shape for n, t in c.tensors.items()})
                   or value_type_problem(self, {n: t.dtype for n, t in c.tensors.items()}))
        if problem:
            raise MoepackError(f"{c.path}: {problem}")
        return cfg

    def checkpoint_problem(self, config, experts_per_layer, shapes) -> str | None:
        """A config.json V4's reader refuses or this runtime would compute differently from transformers (as
        Qwen3-MoE's reader refuses it), a layer with another expert count than its n_routed_experts, or a tensor a
        prefill runs missing or of another shape than the config says (verify would refuse the container)."""
        try:
            experts = ModelConfig.from_hf(config).n_routed_experts
        except ConfigError as e:
            return f"config.json is not a usable DeepSeek-V4 config ({e.detail})"
        problem = unsupported(config) or quantization_problem(config)
        if problem:
            return f"config.json {problem}"
        wrong = next(((layer, n) for layer, n in experts_per_layer.items() if n and n != experts), None)
        if wrong:
            return f"layers.{wrong[0]} holds {wrong[1]} experts, the config's n_routed_experts is {experts}"
        return _tensor_problem(config, shapes)

    def refusal(self, config: Mapping[str, Any]) -> str | None:
        """What in a config.json this runtime would compute differently from transformers (a prefill refuses
        it; `moepack verify` reports it), or None."""
        return unsupported(config)


def _tensor_problem(config: Mapping[str, Any], shapes: Mapping[str, Sequence[int]]) -> str | None:
    """The first tensor a prefill runs that `shapes` (name -> shape) lacks or holds in another shape than the config
    says, or None: what verify refuses in a container, the converter in a checkpoint before it writes."""
    from .tensors import v4_tensor_specs

    for spec in v4_tensor_specs(config, mtp=False):  # the MTP layers are never run
        # a name it may be held under (the KV norm: `attn.norm`, or the release's `attn.kv_norm`)
        shape = next((shapes[n] for n in names.stored_names(spec.name) if n in shapes), None)
        if shape is None:
            return f"tensor {spec.name} is missing"
        if tuple(shape) != tuple(spec.shape):
            return f"tensor {spec.name} is {list(shape)} but the config says {list(spec.shape)}"
    return None


FLOP_PARTS = ("attention_projections", "compressors", "indexer", "router", "mhc", "shared_experts",
              "routed_experts")


def _flop_part(rest: str) -> str:
    """The part of flops_per_token a layer's linear (its name inside the layer) counts in."""
    if rest.startswith("hc_"):
        return "mhc"
    if rest.startswith("ffn.shared_experts."):
        return "shared_experts"
    if rest.startswith("ffn.gate"):
        return "router"
    if rest.startswith("attn.indexer."):
        return "indexer"
    if rest.startswith("attn.compressor."):
        return "compressors"
    return "attention_projections"


def _avg_entries(n: int, rate: int, cap: int | None = None) -> float:
    """Average over queries t in [0, n) of the complete compressed entries (t+1)//rate, optionally capped."""
    return sum_entries(n, rate, cap) / n if rate > 0 else 0.0


FAMILY = DeepseekV4Family()
