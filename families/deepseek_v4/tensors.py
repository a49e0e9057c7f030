"""The tensors a DeepSeek-V4 checkpoint of a config holds: names (moepack's canonical names,
moepack.families.deepseek_v4.names), logical shapes, how the release stores each one (role) and what it is (kind).

`v4_tensor_specs(config)` lists them in streaming order; `stored_tensors(spec, layout)` says what one becomes in
a layout's safetensors files (the release's FP8 / FP4 weights with their `.scale`, or plain BF16 / F32). The
synthetic-checkpoint writer (packer/synth.py), the converter, the engine's model check and `moepack plan` all
size and name tensors from here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from moepack.format_spec.errors import MoepackError
from moepack.format_spec.source_blocks import FP4_GROUP, fp8_block_scale_shape

from .config import CSA, HCA, ModelConfig, compress_rates_by_type, mtp_layer_types

# What a tensor is for storage purposes: how the release encodes it.
ROLE_DENSE_LINEAR = "dense_linear"  # FP8 e4m3 + 128x128 E8M0 block scales in the release
ROLE_BF16_LINEAR = "bf16_linear"  # linears the release leaves in BF16: router, compressors, indexer weights_proj
ROLE_EXPERT = "expert"  # routed experts: packed FP4 e2m1 + one E8M0 scale per 32 inputs in the release
ROLE_EMBEDDING = "embedding"  # embed.weight and head.weight: BF16 in the release
ROLE_EXACT = "exact"  # norms, mHC, sinks, ape, router bias (F32) and tid2eid (I64): never rounded
ROLES = (ROLE_DENSE_LINEAR, ROLE_BF16_LINEAR, ROLE_EXPERT, ROLE_EMBEDDING, ROLE_EXACT)

LAYOUTS = ("release", "bf16", "f32")

DTYPE_BYTES = {"F32": 4, "BF16": 2, "I64": 8, "I8": 1, "F8_E4M3": 1, "F8_E8M0": 1}


@dataclass(frozen=True)
class TensorSpec:
    """One logical tensor of a DeepSeek-V4 checkpoint.

    `shape` is the logical shape ([out, in] for linears, whatever the encoding). `role` says how the release
    stores it (ROLE_*); `kind` says what it is, which decides how `synth_checkpoint` draws it: 'linear',
    'embedding', 'norm', 'hc_fn', 'hc_base', 'hc_scale', 'attn_sink', 'ape', 'router_bias' or 'tid2eid'.
    """

    name: str
    shape: tuple[int, ...]
    role: str
    kind: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def release_dtype(self) -> str:
        """safetensors dtype of this tensor (its `.weight` part) in the release."""
        if self.role == ROLE_DENSE_LINEAR:
            return "F8_E4M3"
        if self.role == ROLE_EXPERT:
            return "I8"
        if self.role in (ROLE_BF16_LINEAR, ROLE_EMBEDDING):
            return "BF16"
        return "I64" if self.kind == "tid2eid" else "F32"

    @property
    def block(self) -> str:
        """The unit a streaming reader loads together: 'embed', 'layers.L', 'mtp.M' or 'head' (final norm,
        mHC head and output head)."""
        parts = self.name.split(".")
        if parts[0] in ("layers", "mtp"):
            return f"{parts[0]}.{parts[1]}"
        return "embed" if parts[0] == "embed" else "head"


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a layout writes it to a safetensors file (a weight, or the scale beside it)."""

    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


def _block_specs(prefix: str, cfg: ModelConfig, rates: Mapping[str, int], attention_type: str,
                 hashed: bool) -> list[TensorSpec]:
    """The tensors of one transformer block (a layer, or the block inside an MTP layer)."""
    hidden, heads, head_dim, q_rank = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
    o_groups, o_rank = cfg.o_groups, cfg.o_lora_rank
    experts, top_k, inter = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    hc = cfg.hc_mult
    hc_mixes = (2 + hc) * hc  # pre (hc) + post (hc) + comb (hc * hc)

    def linear(name: str, out_features: int, in_features: int, role: str = ROLE_DENSE_LINEAR) -> TensorSpec:
        return TensorSpec(f"{prefix}.{name}.weight", (out_features, in_features), role, "linear")

    def exact(name: str, shape: tuple[int, ...], kind: str) -> TensorSpec:
        return TensorSpec(f"{prefix}.{name}", shape, ROLE_EXACT, kind)

    specs = [exact("attn_norm.weight", (hidden,), "norm")]
    for site in ("attn", "ffn"):
        specs += [
            exact(f"hc_{site}_fn", (hc_mixes, hc * hidden), "hc_fn"),
            exact(f"hc_{site}_base", (hc_mixes,), "hc_base"),
            exact(f"hc_{site}_scale", (3,), "hc_scale"),
        ]

    # Attention: low-rank query, one shared KV head, grouped low-rank output, per-head sinks.
    specs += [
        linear("attn.wq_a", q_rank, hidden),
        exact("attn.q_norm.weight", (q_rank,), "norm"),
        linear("attn.wq_b", heads * head_dim, q_rank),
        linear("attn.wkv", head_dim, hidden),
        exact("attn.norm.weight", (head_dim,), "norm"),  # the KV norm (the release's attn.kv_norm, names.py)
        linear("attn.wo_a", o_groups * o_rank, heads * head_dim // o_groups),
        linear("attn.wo_b", hidden, o_groups * o_rank),
        exact("attn.attn_sink", (heads,), "attn_sink"),
    ]
    if attention_type in (CSA, HCA):
        # CSA keeps two overlapping series per token (2 * head_dim); HCA one.
        series = 2 if attention_type == CSA else 1
        specs += _compressor_specs("attn.compressor", prefix, hidden, head_dim, series, rates[attention_type])
    if attention_type == CSA:
        index_heads, index_dim = cfg.index_n_heads, cfg.index_head_dim
        specs += [
            linear("attn.indexer.wq_b", index_heads * index_dim, q_rank),
            linear("attn.indexer.weights_proj", index_heads, hidden, ROLE_BF16_LINEAR),
        ]
        specs += _compressor_specs("attn.indexer.compressor", prefix, hidden, index_dim, 2, rates[CSA])

    specs.append(exact("ffn_norm.weight", (hidden,), "norm"))
    specs.append(linear("ffn.gate", experts, hidden, ROLE_BF16_LINEAR))
    if hashed:
        specs.append(exact("ffn.gate.tid2eid", (cfg.vocab_size, top_k), "tid2eid"))
    else:
        specs.append(exact("ffn.gate.bias", (experts,), "router_bias"))
    for e in range(experts):
        specs += [
            linear(f"ffn.experts.{e}.w1", inter, hidden, ROLE_EXPERT),
            linear(f"ffn.experts.{e}.w2", hidden, inter, ROLE_EXPERT),
            linear(f"ffn.experts.{e}.w3", inter, hidden, ROLE_EXPERT),
        ]
    specs += [  # transformers' shared expert is moe_intermediate_size wide whatever n_shared_experts says
        linear("ffn.shared_experts.w1", inter, hidden),
        linear("ffn.shared_experts.w2", hidden, inter),
        linear("ffn.shared_experts.w3", inter, hidden),
    ]
    return specs


def _compressor_specs(name: str, prefix: str, hidden: int, dim: int, series: int, rate: int) -> list[TensorSpec]:
    return [
        TensorSpec(f"{prefix}.{name}.wkv.weight", (series * dim, hidden), ROLE_BF16_LINEAR, "linear"),
        TensorSpec(f"{prefix}.{name}.wgate.weight", (series * dim, hidden), ROLE_BF16_LINEAR, "linear"),
        TensorSpec(f"{prefix}.{name}.norm.weight", (dim,), ROLE_EXACT, "norm"),
        TensorSpec(f"{prefix}.{name}.ape", (rate, series * dim), ROLE_EXACT, "ape"),
    ]


def _hc_head_specs(prefix: str, cfg: ModelConfig) -> list[TensorSpec]:
    hidden, hc = cfg.hidden_size, cfg.hc_mult
    return [
        TensorSpec(f"{prefix}hc_head_fn", (hc, hc * hidden), ROLE_EXACT, "hc_fn"),
        TensorSpec(f"{prefix}hc_head_base", (hc,), ROLE_EXACT, "hc_base"),
        TensorSpec(f"{prefix}hc_head_scale", (1,), ROLE_EXACT, "hc_scale"),
    ]


def v4_tensor_specs(config: Mapping, mtp: bool = True) -> list[TensorSpec]:
    """Every tensor a DeepSeek-V4 checkpoint of this config.json holds, in streaming order: embed, layers 0..N-1,
    the final norm / mHC head / output head, then the MTP layers (none with `mtp=False`: what the runtime uses).
    ConfigError (moepack.families.deepseek_v4.config) for a config it cannot be read from."""
    cfg = ModelConfig.from_hf(config)
    rates = compress_rates_by_type(config)
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    specs = [TensorSpec("embed.weight", (vocab, hidden), ROLE_EMBEDDING, "embedding")]
    for layer in range(cfg.num_layers):
        specs += _block_specs(f"layers.{layer}", cfg, rates, cfg.layer_types[layer], cfg.hash_layers[layer])
    specs.append(TensorSpec("norm.weight", (hidden,), ROLE_EXACT, "norm"))
    specs += _hc_head_specs("", cfg)
    if not cfg.tie_word_embeddings:  # tied: the embedding is the head, none is stored
        specs.append(TensorSpec("head.weight", (vocab, hidden), ROLE_EMBEDDING, "linear"))
    for m, attention_type in enumerate(mtp_layer_types(config) if mtp else ()):
        prefix = f"mtp.{m}"
        # An MTP layer: project the next token's embedding and the main model's hidden state, mix them
        # through one block (a routed, not hashed, MoE as in the reference), collapse its own mHC streams.
        specs += [
            TensorSpec(f"{prefix}.enorm.weight", (hidden,), ROLE_EXACT, "norm"),
            TensorSpec(f"{prefix}.hnorm.weight", (hidden,), ROLE_EXACT, "norm"),
            TensorSpec(f"{prefix}.e_proj.weight", (hidden, hidden), ROLE_DENSE_LINEAR, "linear"),
            TensorSpec(f"{prefix}.h_proj.weight", (hidden, hidden), ROLE_DENSE_LINEAR, "linear"),
        ]
        specs += _block_specs(prefix, cfg, rates, attention_type, hashed=False)
        specs.append(TensorSpec(f"{prefix}.norm.weight", (hidden,), ROLE_EXACT, "norm"))
        specs += _hc_head_specs(f"{prefix}.", cfg)
    return specs


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise MoepackError(f"unknown layout {layout!r} (choose one of {', '.join(LAYOUTS)})")


def stored_tensors(spec: TensorSpec, layout: str) -> list[StoredTensor]:
    """The tensors `spec` becomes in a layout's safetensors files: the weight, plus its `.scale` when the
    release quantizes it."""
    check_layout(layout)
    if spec.kind == "tid2eid":
        return [StoredTensor(spec.name, "I64", spec.shape)]
    if layout == "f32":
        return [StoredTensor(spec.name, "F32", spec.shape)]
    if layout == "bf16":
        return [StoredTensor(spec.name, "F32" if spec.role == ROLE_EXACT else "BF16", spec.shape)]
    scale_name = spec.name.removesuffix(".weight") + ".scale"
    if spec.role == ROLE_DENSE_LINEAR:
        out_features, in_features = spec.shape
        return [
            StoredTensor(spec.name, "F8_E4M3", spec.shape),
            StoredTensor(scale_name, "F8_E8M0", fp8_block_scale_shape(out_features, in_features)),
        ]
    if spec.role == ROLE_EXPERT:
        *lead, in_features = spec.shape
        return [
            StoredTensor(spec.name, "I8", (*lead, in_features // 2)),
            StoredTensor(scale_name, "F8_E8M0", (*lead, in_features // FP4_GROUP)),
        ]
    return [StoredTensor(spec.name, spec.release_dtype, spec.shape)]
