"""Qwen3-MoE's config.json, read as transformers' Qwen3MoeConfig reads it (its defaults for missing keys), with
every field checked: an absurd or unsupported value is one line naming the field.

Two spellings occur: the releases' (`num_experts`, `rope_theta`, `rope_scaling`) and what transformers 5 writes
(`num_local_experts`, `rope_parameters` {rope_type, rope_theta}). Features this family does not compute
(attention biases, a RoPE other than the default, linear or YaRN, an activation other than SiLU) are refused
rather than computed differently from the reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moepack.format_spec.untrusted import UntrustedInputError, finite_float, int_in_range

from ..base import MAX_ROUTED_EXPERTS, MoeShape
from ..rope import RopeScaling, whole_float_as_int, yarn_attention_factor

MODEL_TYPE = "qwen3_moe"
ARCHITECTURE = "Qwen3MoeForCausalLM"

# transformers' Qwen3MoeConfig defaults (Qwen3-30B-A3B), for keys a config.json leaves out.
DEFAULTS = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                num_attention_heads=32, num_key_value_heads=4, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_theta=10000.0, decoder_sparse_step=1, moe_intermediate_size=768, num_experts_per_tok=8,
                num_experts=128, norm_topk_prob=False, hidden_act="silu", attention_bias=False,
                use_sliding_window=False, max_position_embeddings=32768)

SILU_NAMES = ("silu", "swish")  # transformers' ACT2FN names of x * sigmoid(x)
SLIDING_WINDOW_DEFAULT = 4096  # transformers' sliding_window where use_sliding_window is true and it is absent
MAX_DIM = 1 << 20  # a hidden size, head count or FFN width beyond any model: bounds what a hostile config builds
MAX_LAYERS = 1 << 12
MAX_EXPERTS = 1 << 16
MAX_VOCAB = 1 << 24


def _field(raw: Mapping[str, Any], key: str) -> Any:
    return raw[key] if key in raw and raw[key] is not None else DEFAULTS[key]


def _int(raw: Mapping[str, Any], key: str, lo: int, hi: int, value: Any = None) -> int:
    return int_in_range(_field(raw, key) if value is None else value, f"config.json {key}", lo, hi)


def _bool(raw: Mapping[str, Any], key: str) -> bool:
    value = _field(raw, key)
    if not isinstance(value, bool):
        raise UntrustedInputError(f"config.json {key}: expected true or false, got {type(value).__name__}")
    return value


ROPE_KINDS = ("default", "linear", "yarn")


def _rope(raw: Mapping[str, Any], max_positions: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, its scaling or None) from rope_parameters {rope_type, rope_theta, ...} (transformers 5) or
    rope_theta + rope_scaling (the releases), read as transformers reads them: the default RoPE, linear, or YaRN
    (original_max_position_embeddings defaulting to max_position_embeddings, attention_factor to YaRN's mscale)."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    if params is not None and not isinstance(params, Mapping):
        raise UntrustedInputError("config.json rope_parameters: expected an object")
    if scaling is not None and not isinstance(scaling, Mapping):
        raise UntrustedInputError("config.json rope_scaling: expected an object")
    if params and scaling:  # (transformers takes rope_scaling as another name of rope_parameters: both must agree)
        chosen = _rope_block(raw, "rope_parameters", params, max_positions)
        if _rope_block(raw, "rope_scaling", scaling, max_positions) != chosen:
            raise UntrustedInputError("config.json rope_parameters and rope_scaling disagree: keep one")
        return chosen
    if params:
        return _rope_block(raw, "rope_parameters", params, max_positions)
    return _rope_block(raw, "rope_scaling", scaling or {}, max_positions)


def _rope_block(raw: Mapping[str, Any], key: str, block: Mapping[str, Any], max_positions: int
                ) -> tuple[float, RopeScaling | None]:
    """_rope's reading of one block (`key` in config.json)."""
    theta = finite_float(block.get("rope_theta", raw.get("rope_theta", DEFAULTS["rope_theta"])),
                         "config.json rope_theta", lo=1.0, hi=1e12)
    kind = block.get("rope_type", block.get("type", "default"))
    if kind not in ROPE_KINDS:
        raise UntrustedInputError(f"config.json {key}: RoPE type {str(kind)[:40]!r} is not supported "
                                  f"(qwen3-moe computes {', '.join(ROPE_KINDS)})")
    if kind == "default":
        return theta, None

    def number(name: str, default: float | None = None) -> float:
        value = block.get(name)
        if value is None and default is not None:
            return default
        return finite_float(value, f"config.json {key}.{name}", lo=0.0, hi=1e12, lo_open=True)

    # transformers' scaled RoPEs rotate head_dim * partial_rotary_factor channels, which its Qwen3-MoE attention
    # cannot apply (a shape error); its default RoPE ignores the field
    partial = block.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial is not None and partial != 1:
        raise UntrustedInputError(f"config.json {key}.partial_rotary_factor: {str(partial)[:20]} is not supported "
                                  f"with a {kind} RoPE (qwen3-moe rotates every channel of a head)")
    factor = number("factor")
    if kind == "linear":
        return theta, RopeScaling("linear", factor)
    original = whole_float_as_int(block.get("original_max_position_embeddings") or max_positions)
    original = int_in_range(original, f"config.json {key}.original_max_position_embeddings", 1, 1 << 31)
    truncate = block.get("truncate", True)
    if not isinstance(truncate, bool):
        raise UntrustedInputError(f"config.json {key}.truncate: expected true or false")
    mscale = block.get("mscale") and number("mscale")
    mscale_all_dim = block.get("mscale_all_dim") and number("mscale_all_dim")
    attention = number("attention_factor", yarn_attention_factor(factor, mscale, mscale_all_dim))
    # a beta of 0 or null is transformers' default too (its `get("beta_fast") or 32`)
    beta_fast, beta_slow = (number(name) if block.get(name) else default for name, default in
                            (("beta_fast", 32.0), ("beta_slow", 1.0)))
    return theta, RopeScaling("yarn", factor, original, beta_fast, beta_slow,
                              truncate, attention)


def _sliding_window(raw: Mapping[str, Any]) -> int | None:
    """The attention's window as transformers' Qwen3MoeConfig reads it: with use_sliding_window true, sliding_window
    (absent: its default 4096; null: none, full attention); without it, none (a sliding_window alone is dropped)."""
    if not _bool(raw, "use_sliding_window"):
        return None
    window = raw.get("sliding_window", SLIDING_WINDOW_DEFAULT)
    # (from 2: at a window of 1 transformers' own decode cache keeps every key, its generation unlike its forward)
    return None if window is None else int_in_range(window, "config.json sliding_window", 2, 1 << 31)


@dataclass(frozen=True)
class Qwen3MoeConfig:
    """Qwen3-MoE as the forward computes it."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # a dense-MLP layer's width
    moe_intermediate_size: int  # one routed expert's width
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope_scaling: RopeScaling | None = None  # linear or YaRN; None: the default RoPE
    sliding_window: int | None = None  # a query attends the keys less than this many positions back; None: all

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> Qwen3MoeConfig:
        if not isinstance(raw, Mapping):
            raise UntrustedInputError(f"config.json: expected a JSON object, got {type(raw).__name__}")
        for key, wanted in (("hidden_act", SILU_NAMES), ("attention_bias", (False,))):
            if _field(raw, key) not in wanted:
                raise UntrustedInputError(f"config.json {key}: {str(_field(raw, key))[:40]!r} is not supported "
                                          f"(qwen3-moe computes {' or '.join(map(repr, wanted))} only)")
        hidden = _int(raw, "hidden_size", 1, MAX_DIM)
        heads = _int(raw, "num_attention_heads", 1, MAX_DIM)
        kv_heads = _int(raw, "num_key_value_heads", 1, heads)
        if heads % kv_heads:
            raise UntrustedInputError(f"config.json num_key_value_heads: {kv_heads} does not divide "
                                      f"num_attention_heads {heads}")
        head_dim = raw.get("head_dim")
        if head_dim is None:  # transformers' getattr fallback: the floor, whether or not the heads divide hidden
            head_dim = hidden // heads
        head_dim = int_in_range(head_dim, "config.json head_dim", 2, MAX_DIM)
        if head_dim % 2:
            raise UntrustedInputError(f"config.json head_dim: RoPE needs an even head_dim, got {head_dim}")
        layers = _int(raw, "num_hidden_layers", 1, MAX_LAYERS)
        # transformers 5 writes num_experts as num_local_experts (its attribute_map)
        experts_key = "num_local_experts" if raw.get("num_local_experts") is not None else "num_experts"
        experts = int_in_range(raw.get(experts_key, DEFAULTS["num_experts"]), f"config.json {experts_key}", 1,
                               MAX_EXPERTS)
        if experts * layers > MAX_ROUTED_EXPERTS:
            raise UntrustedInputError(f"config.json {experts_key}: at most {MAX_ROUTED_EXPERTS // layers} in "
                                      f"{layers} layers ({MAX_ROUTED_EXPERTS} routed experts in all), got {experts}")
        top_k = _int(raw, "num_experts_per_tok", 1, experts)
        only = raw.get("mlp_only_layers") or []
        if not isinstance(only, list) or len(only) > MAX_LAYERS:
            raise UntrustedInputError(f"config.json mlp_only_layers: expected a list of at most {MAX_LAYERS} layer "
                                      "indices")
        # an index past the layers names no layer: transformers' `layer_idx not in mlp_only_layers` passes it by
        only = tuple(sorted({i for i in (int_in_range(i, "config.json mlp_only_layers[]", -MAX_LAYERS, MAX_LAYERS)
                                         for i in only) if 0 <= i < layers}))
        max_positions = _int(raw, "max_position_embeddings", 1, 1 << 31)
        rope_theta, rope_scaling = _rope(raw, max_positions)
        return cls(
            vocab_size=_int(raw, "vocab_size", 1, MAX_VOCAB), hidden_size=hidden, num_layers=layers,
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            intermediate_size=_int(raw, "intermediate_size", 1, MAX_DIM),
            moe_intermediate_size=_int(raw, "moe_intermediate_size", 1, MAX_DIM),
            num_experts=experts, top_k=top_k, norm_topk_prob=_bool(raw, "norm_topk_prob"),
            decoder_sparse_step=_int(raw, "decoder_sparse_step", 1, MAX_LAYERS), mlp_only_layers=only,
            rope_theta=rope_theta, rope_scaling=rope_scaling,
            rms_norm_eps=finite_float(_field(raw, "rms_norm_eps"), "config.json rms_norm_eps", lo=0.0, hi=1.0,
                                      lo_open=True),
            tie_word_embeddings=_bool(raw, "tie_word_embeddings"),
            max_position_embeddings=max_positions, sliding_window=_sliding_window(raw),
        )

    def is_moe_layer(self, layer: int) -> bool:
        """transformers' rule: routed experts unless the layer is in mlp_only_layers or off the sparse step."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer in range(self.num_layers) if self.is_moe_layer(layer))

    def shape(self) -> MoeShape:
        return MoeShape(num_layers=self.num_layers, hidden_size=self.hidden_size, vocab_size=self.vocab_size,
                        num_experts=self.num_experts, top_k=self.top_k,
                        expert_intermediate=self.moe_intermediate_size, moe_layers=self.moe_layers)
