"""DeepSeek-V4's config.json: the one reader of it in moepack.

A config.json comes spelled two ways: the release's (legacy keys: `compress_ratios`, `compress_rate_csa/hca`,
`num_hash_layers`, `qk_rope_head_dim`, a flat `rope_scaling`) and transformers' `DeepseekV4Config` (`layer_types`,
`compress_rates`, `mlp_layer_types`, `partial_rotary_factor`, `rope_parameters` keyed main / compress). Both are read
as transformers reads them, with its defaults for missing keys (`DEFAULTS`). Every field read is checked for type
and range: a bad one raises ConfigError (a MoepackError), one line naming the field.

* `ModelConfig.from_hf(config)`: the model as the runtime computes it; `RopeConfig`: one of its two ropes.
* `kv_geometry(config)`: the few facts the KV format depends on (moepack.families.deepseek_v4.kv), read by the same
  code.
* `compress_rates_by_type`, `mtp_layer_types`: what the tensor schema (moepack.families.deepseek_v4.tensors) needs
  beyond ModelConfig.
* `unsupported(config)`: what this runtime would compute differently from transformers; `model_type`,
  `quant_method`: the two other fields the converter and `moepack plan` read; `quantization_problem`: a
  quantization_config the converter cannot read.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moepack.format_spec.errors import MoepackError

from ..base import MAX_ROUTED_EXPERTS
from ..rope import default_inv_freq, whole_float_as_int, yarn_attention_factor, yarn_inv_freq

if TYPE_CHECKING:
    from torch import Tensor

MODEL_TYPE = "deepseek_v4"

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"  # compressed every `rate` tokens (overlapping windows) + Lightning Indexer top-k
HCA = "heavily_compressed_attention"  # compressed every `rate` tokens, attended densely
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"  # experts chosen by tid2eid[token id] / by the router's top-k
MLP_LAYER_TYPES = (HASH_MOE, MOE)
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
ROPE_TYPES = ("default", "linear", "yarn")  # transformers' other kinds scale by length or are per-model

LEGACY_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}  # transformers' reading of a legacy `compress_ratios` list
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
DEFAULT_NUM_HASH_LAYERS = 3
DEFAULT_PARTIAL_ROTARY_FACTOR = 64 / 512  # qk_rope_head_dim / head_dim of V4-Flash
# transformers defaults to 1 MTP layer; moepack has always counted none unless the config says (the runtime never
# runs them, and sizes / synthetic checkpoints of a config without the key stay as they were).
DEFAULT_MTP_LAYERS = 0
MAX_LAYERS = 1 << 12  # far beyond any model (61): bounds the per-layer lists a hostile config can make a reader build
INT_MAX = (1 << 63) - 1  # JSON integers beyond int64 are no sizes (and overflow float arithmetic)
MAX_FLOAT = 1e38  # the runtime computes in float32 (largest 3.4e38): a larger value would overflow there
MAX_SINKHORN_ITERS = 1000  # V4 uses 20; a count is work per token per layer, and no size check bounds it

# transformers' DeepseekV4Config defaults, for keys a config.json leaves out.
DEFAULTS = dict(
    vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43, num_attention_heads=64,
    head_dim=512, q_lora_rank=1024, num_experts_per_tok=6, n_routed_experts=256, scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5, max_position_embeddings=1048576, rope_theta=10000.0, compress_rope_theta=160000.0,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0, sliding_window=128, o_groups=8,
    o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 40
_SHOW.maxlist = _SHOW.maxtuple = _SHOW.maxdict = 6
_SHOW.maxlevel = 2  # a deeply nested value must not make the message (or repr's recursion) deep


class ConfigError(MoepackError):
    """A config.json this model cannot be read from. `detail` is the message without its 'config.json: '."""

    def __init__(self, detail: str):
        super().__init__(f"config.json: {detail}")
        self.detail = detail


def _fail(field: str, what: str, value) -> None:
    raise ConfigError(f"{field} must be {what}, not {_SHOW.repr(value)}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -INT_MAX <= v <= INT_MAX


def _is_number(v) -> bool:
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


def _is_list(v) -> bool:
    return isinstance(v, Sequence) and not isinstance(v, (str, bytes))


class _Fields:
    """Typed, range-checked reads of one config mapping (DEFAULTS where a key is absent; a key present with a
    null value is not absent: transformers refuses it too)."""

    def __init__(self, config):
        if not isinstance(config, Mapping):
            raise ConfigError(f"not a JSON object but {type(config).__name__}")
        self.c = config

    def value(self, name: str):
        return self.c[name] if name in self.c else DEFAULTS[name]

    def int(self, name: str, minimum: int = 1, maximum: int | None = None) -> int:
        v = self.value(name)
        if not _is_int(v) or not minimum <= v <= (INT_MAX if maximum is None else maximum):
            what = "a non-negative integer" if minimum == 0 else "a positive integer"
            _fail(name, what if maximum is None else f"{what} at most {maximum}", v)
        return v

    def positive(self, name: str):
        """A finite number in (0, MAX_FLOAT], returned as given (an int stays an int: nothing numeric changes)."""
        v = self.value(name)
        if not _is_number(v) or not 0 < v <= MAX_FLOAT:
            _fail(name, f"a positive number at most {MAX_FLOAT:g}", v)
        return v

    def choice(self, name: str, options: tuple[str, ...]) -> str:
        v = self.value(name)
        if not isinstance(v, str) or v not in options:
            _fail(name, f"one of {', '.join(options)}", v)
        return v

    def boolean(self, name: str) -> bool:
        v = self.value(name)
        if not isinstance(v, bool):
            _fail(name, "true or false", v)
        return v

    def optional_int(self, name: str, minimum: int = 1) -> int | None:
        v = self.c.get(name)
        if v is not None and (not _is_int(v) or v < minimum):
            _fail(name, "a positive integer or null" if minimum == 1 else "a non-negative integer or null", v)
        return v


# ---------------------------------------------------------------------------------------------------------------
# Layer schedule: attention kinds, compress rates, MoE kinds
# ---------------------------------------------------------------------------------------------------------------


def _num_layers(f: _Fields) -> int:
    return f.int("num_hidden_layers", 1, MAX_LAYERS)


def _compress_rates(f: _Fields) -> dict[str, int]:
    """{CSA: rate, HCA: rate}: `compress_rates` over the defaults, the legacy scalars over both."""
    rates = dict(DEFAULT_COMPRESS_RATES)
    given = f.c.get("compress_rates")
    if given is not None:
        if not isinstance(given, Mapping):
            _fail("compress_rates", f"an object keyed {CSA} / {HCA}", given)
        for kind, rate in given.items():
            if kind not in (CSA, HCA):
                _fail("compress_rates", f"keyed {CSA} / {HCA}", kind)
            if not _is_int(rate) or rate < 1:
                _fail(f"compress_rates.{kind}", "a positive integer", rate)
            rates[kind] = rate
    for kind, legacy in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
        rate = f.optional_int(legacy)
        if rate is not None:
            rates[kind] = rate
    return rates


def _attention_types(f: _Fields, n: int) -> list[str]:
    """Every listed attention kind: the n layers', then any the MTP layers have (as the release's compress_ratios
    lists them). With neither layer_types nor compress_ratios: transformers' schedule, 2 HCA, then CSA / HCA."""
    field, types = "layer_types", f.c.get("layer_types")
    if types is None and f.c.get("compress_ratios") is not None:
        field, ratios = "compress_ratios", f.c["compress_ratios"]
        if not _is_list(ratios) or len(ratios) > 2 * MAX_LAYERS:
            _fail(field, "a list of 0, 4 or 128 per layer", ratios)
        for i, r in enumerate(ratios):
            if not _is_int(r) or r not in LEGACY_RATIO_TO_TYPE:
                _fail(f"{field}[{i}]", "0, 4 or 128 (sliding, CSA, HCA)", r)
        types = [LEGACY_RATIO_TO_TYPE[r] for r in ratios]
    elif types is None:
        return [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    elif not _is_list(types) or len(types) > 2 * MAX_LAYERS:
        _fail(field, "a list of layer kinds", types)
    else:
        for i, t in enumerate(types):
            if not isinstance(t, str) or t not in LAYER_TYPES:
                _fail(f"{field}[{i}]", f"one of {', '.join(LAYER_TYPES)}", t)
    if len(types) < n:
        raise ConfigError(f"{field} lists {len(types)} layers, num_hidden_layers is {n}")
    return list(types)


def _hash_layers(f: _Fields, n: int) -> tuple[bool, ...]:
    types = f.c.get("mlp_layer_types")
    if types is None:
        n_hash = f.optional_int("num_hash_layers", 0)
        n_hash = DEFAULT_NUM_HASH_LAYERS if n_hash is None else n_hash
        return tuple(i < n_hash for i in range(n))
    if not _is_list(types) or len(types) > 2 * MAX_LAYERS:
        _fail("mlp_layer_types", f"a list of {HASH_MOE} / {MOE}", types)
    for i, t in enumerate(types):
        if not isinstance(t, str) or t not in MLP_LAYER_TYPES:
            _fail(f"mlp_layer_types[{i}]", f"{HASH_MOE} or {MOE}", t)
    if len(types) < n:
        raise ConfigError(f"mlp_layer_types lists {len(types)} layers, num_hidden_layers is {n}")
    return tuple(t == HASH_MOE for t in types[:n])


def compress_rates_by_type(config: Mapping) -> dict[str, int]:
    """{CSA: tokens per compressed entry, HCA: ...} as the config sets them."""
    return _compress_rates(_Fields(config))


def mtp_layer_types(config: Mapping) -> tuple[str, ...]:
    """The attention kind of each multi-token-prediction layer (`num_nextn_predict_layers`, DEFAULT_MTP_LAYERS if
    absent): listed after the main layers' kinds (the release's compress_ratios does so), else the last layer's."""
    f = _Fields(config)
    n = _num_layers(f)
    n_mtp = f.c.get("num_nextn_predict_layers")
    if n_mtp is None:
        n_mtp = DEFAULT_MTP_LAYERS
    elif not _is_int(n_mtp) or not 0 <= n_mtp <= MAX_LAYERS:
        _fail("num_nextn_predict_layers", "a non-negative integer", n_mtp)
    types = _attention_types(f, n)
    extra = types[n:]
    return tuple(extra[i] if i < len(extra) else types[n - 1] for i in range(n_mtp))


def kv_geometry(config: Mapping) -> dict:
    """The shape facts the KV format depends on: num_layers, per-layer type and compress rate (0 for sliding),
    sliding_window, head_dim, index_head_dim. Reads (and checks) only those fields."""
    f = _Fields(config)
    n = _num_layers(f)
    rates = _compress_rates(f)
    types = _attention_types(f, n)[:n]
    return {"num_layers": n, "layer_types": types, "compress_rates": [rates.get(t, 0) for t in types],
            "sliding_window": f.int("sliding_window"), "head_dim": f.int("head_dim"),
            "index_head_dim": f.int("index_head_dim")}


# ---------------------------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RopeConfig:
    """Interleaved RoPE on the trailing `dim` channels of a head (pairs (2i, 2i+1) rotate together)."""

    dim: int
    theta: float
    scaling: str = "default"  # "default", "linear" or "yarn"
    factor: float = 1.0  # linear and yarn only
    original_max_position_embeddings: int = 0  # yarn only
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0  # multiplies cos and sin (V4 pins it to 1 for its YaRN rope)

    def inv_freq(self) -> Tensor:
        """[dim/2] float32 frequencies, computed the way transformers computes them."""
        if self.scaling == "default":
            return default_inv_freq(self.dim, self.theta)
        if self.scaling == "linear":  # positions divided by factor, i.e. every frequency
            return default_inv_freq(self.dim, self.theta) / self.factor
        return yarn_inv_freq(self.dim, self.theta, self.factor, self.original_max_position_embeddings,
                             self.beta_fast, self.beta_slow)


def _partial_rotary_factor(f: _Fields, head_dim: int) -> float:
    partial = f.c.get("partial_rotary_factor")
    if partial is None:
        rope_dims = f.optional_int("qk_rope_head_dim")
        if rope_dims is not None and rope_dims > head_dim:
            _fail("qk_rope_head_dim", f"at most head_dim ({head_dim})", rope_dims)
        return rope_dims / head_dim if rope_dims else DEFAULT_PARTIAL_ROTARY_FACTOR
    if not _is_number(partial) or not 0 < partial <= 1:
        _fail("partial_rotary_factor", "a number in (0, 1]", partial)
    return partial


def _rope_params(f: _Fields, partial: float) -> tuple[tuple[str, Mapping], tuple[str, Mapping]]:
    """((where, params) for the "main" rope, the same for "compress"), as transformers builds them
    (PreTrainedConfig's convert_rope_params_to_dict, then DeepseekV4Config.__post_init__); `where` names the params'
    origin for messages."""
    c = f.c
    # transformers takes a non-empty rope_scaling over rope_parameters
    source = "rope_scaling" if c.get("rope_scaling") else "rope_parameters"
    rp = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if not isinstance(rp, Mapping):
        _fail(source, "an object", rp)
    main_theta, compress_theta = f.positive("rope_theta"), f.positive("compress_rope_theta")
    if isinstance(rp.get("main"), Mapping) and isinstance(rp.get("compress"), Mapping):
        # a nested dict without rope_theta has the top-level one (the compressed rope's too: compress_rope_theta
        # fills only the flat form)
        nested = [(f"{source}.{kind}", {"rope_theta": main_theta, **rp[kind]}) for kind in ("main", "compress")]
        if c.get("partial_rotary_factor") is None:
            for where, params in nested:
                if "partial_rotary_factor" not in params:
                    # transformers rotates the whole head there, or qk_rope_head_dim's share once a scaled rope
                    # or a save has filled it in: no one model to compute
                    raise ConfigError(f"{where}.partial_rotary_factor must be given where partial_rotary_factor "
                                      "is not (transformers reads its absence as the whole head or as the default "
                                      "share, by path)")
        else:
            nested = [(where, {"partial_rotary_factor": partial, **params}) for where, params in nested]
        return nested[0], nested[1]
    # A flat dict describes the compress rope's scaling (YaRN); sliding-only layers always use plain RoPE.
    scaling = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    main = {"rope_type": "default", "rope_theta": main_theta, "partial_rotary_factor": partial}
    compress = {**scaling, "rope_theta": compress_theta, "partial_rotary_factor": partial}
    compress.setdefault("rope_type", compress.get("type", "default"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)  # the V4 reference does not scale cos/sin by YaRN's mscale
    return (source, main), (source, compress)


def _rope_config(where: str, p: Mapping, head_dim: int, partial: float, max_positions: int) -> RopeConfig:
    def number(key: str, optional: bool = True, minimum: float = 0.0, open_min: bool = True):
        v = p.get(key)
        if v is None and optional:
            return None
        if not _is_number(v) or v < minimum or (open_min and v == minimum):
            bound = "a positive number" if open_min and minimum == 0 else f"a number >= {minimum}"
            _fail(f"{where}.{key}", bound if not optional else f"{bound} or null", v)
        return v

    share = p.get("partial_rotary_factor", partial)
    if not _is_number(share) or not 0 < share <= 1:
        _fail(f"{where}.partial_rotary_factor", "a number in (0, 1]", share)
    dim = int(head_dim * share)
    if dim < 2 or dim % 2:
        # interleaved RoPE turns channel pairs: an odd count leaves one without a partner, none leaves x[..., -0:],
        # the whole head (transformers' model fails on both)
        _fail(f"{where}.partial_rotary_factor", f"a share of head_dim ({head_dim}) giving an even number of RoPE "
                                                f"dimensions, at least 2 (it gives {dim})", share)
    kind = p.get("rope_type", p.get("type", "default"))
    if not isinstance(kind, str) or kind not in ROPE_TYPES:
        _fail(f"{where}.rope_type", f"one of {', '.join(ROPE_TYPES)}", kind)
    theta = number("rope_theta", optional=False)
    if kind == "default":
        return RopeConfig(dim=dim, theta=float(theta))
    if kind == "linear":
        return RopeConfig(dim=dim, theta=float(theta), scaling="linear",
                          factor=float(number("factor", optional=False)))
    # transformers fills a missing one with max_position_embeddings, and computes with a whole float as its int
    original = whole_float_as_int(p.get("original_max_position_embeddings", max_positions))
    if not _is_int(original) or original < 1:
        _fail(f"{where}.original_max_position_embeddings", "a positive integer", original)
    factor = number("factor", minimum=0, open_min=False) or max_positions / original
    attention_factor = number("attention_factor")
    m, m_all = number("mscale", minimum=0, open_min=False), number("mscale_all_dim", minimum=0, open_min=False)
    beta_fast = number("beta_fast", minimum=0, open_min=False)
    beta_slow = number("beta_slow", minimum=0, open_min=False)
    if attention_factor is None:
        attention_factor = yarn_attention_factor(factor, m, m_all)
    return RopeConfig(dim=dim, theta=float(theta), scaling="yarn", factor=float(factor),
                      original_max_position_embeddings=original, beta_fast=float(beta_fast or 32),
                      beta_slow=float(beta_slow or 1), attention_factor=float(attention_factor))


# ---------------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]  # per layer: SLIDING, CSA or HCA
    compress_rates: tuple[int, ...]  # per layer: tokens per compressed entry (0 for SLIDING)
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str  # router score: "sqrtsoftplus", "sigmoid" or "softmax"
    routed_scaling_factor: float
    swiglu_limit: float
    hash_layers: tuple[bool, ...]  # per layer: experts chosen by tid2eid[token id] instead of top-k
    main_rope: RopeConfig  # q/kv of sliding-only layers
    compress_rope: RopeConfig  # q/kv of CSA/HCA layers, their compressors and the indexer
    tie_word_embeddings: bool = False  # the LM head is the embedding table (no head.weight is stored)

    @classmethod
    def from_hf(cls, config: Mapping) -> "ModelConfig":
        """From a config.json in either spelling (release legacy keys or transformers' DeepseekV4Config);
        ConfigError naming the first bad field."""
        f = _Fields(config)
        geometry = kv_geometry(config)
        n = geometry["num_layers"]
        heads, head_dim = f.int("num_attention_heads"), geometry["head_dim"]
        o_groups, experts = f.int("o_groups"), f.int("n_routed_experts")
        blocks = n + len(mtp_layer_types(config))
        if experts * blocks > MAX_ROUTED_EXPERTS:
            _fail("n_routed_experts", f"at most {MAX_ROUTED_EXPERTS // blocks} in {blocks} layers (MTP included): "
                                      f"{MAX_ROUTED_EXPERTS} routed experts in all", experts)
        if heads % o_groups:
            _fail("o_groups", f"a divisor of num_attention_heads ({heads})", o_groups)
        top_k = f.int("num_experts_per_tok", 1, experts)
        partial = _partial_rotary_factor(f, head_dim)
        max_positions = f.int("max_position_embeddings")
        (main_at, main_params), (compress_at, compress_params) = _rope_params(f, partial)
        compress_rope = _rope_config(compress_at, compress_params, head_dim, partial, max_positions)
        if CSA in geometry["layer_types"] and geometry["index_head_dim"] < compress_rope.dim:
            # the Lightning Indexer rotates the last rope-dim channels of its heads: narrower heads have none to
            # rotate (transformers' model fails on them too), so no computation is defined
            _fail("index_head_dim", f"at least the RoPE dimensions ({compress_rope.dim}, qk_rope_head_dim) in a "
                                    f"model with {CSA} layers, whose indexer rotates that many channels",
                  geometry["index_head_dim"])
        return cls(
            vocab_size=f.int("vocab_size"), hidden_size=f.int("hidden_size"), num_layers=n,
            num_heads=heads, head_dim=head_dim, q_lora_rank=f.int("q_lora_rank"),
            o_groups=o_groups, o_lora_rank=f.int("o_lora_rank"), sliding_window=geometry["sliding_window"],
            layer_types=tuple(geometry["layer_types"]), compress_rates=tuple(geometry["compress_rates"]),
            index_n_heads=f.int("index_n_heads"), index_head_dim=geometry["index_head_dim"],
            index_topk=f.int("index_topk", 0), hc_mult=f.int("hc_mult"),
            hc_sinkhorn_iters=f.int("hc_sinkhorn_iters", 1, MAX_SINKHORN_ITERS),
            hc_eps=f.positive("hc_eps"), rms_norm_eps=f.positive("rms_norm_eps"), n_routed_experts=experts,
            num_experts_per_tok=top_k, moe_intermediate_size=f.int("moe_intermediate_size"),
            scoring_func=f.choice("scoring_func", SCORING_FUNCS),
            routed_scaling_factor=f.positive("routed_scaling_factor"), swiglu_limit=f.positive("swiglu_limit"),
            hash_layers=_hash_layers(f, n),
            main_rope=_rope_config(main_at, main_params, head_dim, partial, max_positions),
            compress_rope=compress_rope,
            tie_word_embeddings=f.boolean("tie_word_embeddings"),
        )

    @property
    def head_weight(self) -> str:
        """The name of the LM head's matrix: the embedding's where the two are tied."""
        return "embed.weight" if self.tie_word_embeddings else "head.weight"


def model_type(config: Mapping) -> str | None:
    """The config's model_type (any string or none; the caller decides which it supports)."""
    value = _Fields(config).c.get("model_type")
    if value is not None and not isinstance(value, str):
        _fail("model_type", "a string", value)
    return value


def quant_method(config: Mapping) -> str | None:
    """quantization_config.quant_method ("fp8" for the release's FP8 dense linears + FP4 experts), or None."""
    q = _Fields(config).c.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, Mapping):
        _fail("quantization_config", "an object or null", q)
    method = q.get("quant_method")
    if method is not None and not isinstance(method, str):
        _fail("quantization_config.quant_method", "a string", method)
    return method


def quantization_problem(config: Mapping) -> str | None:
    """What in quantization_config the converter cannot read, or None: a method other than the release's fp8, or
    its fp8 in other blocks than 128x128 or another format than e4m3 (the scales would not fit the weights)."""
    from moepack.format_spec.source_formats import FP8_BLOCK

    method = quant_method(config)
    if method is None:
        return None
    if method != "fp8":
        return (f"quantization_config.quant_method {method[:40]!r}: only the release's fp8 (FP8 e4m3 in "
                f"{FP8_BLOCK}x{FP8_BLOCK} blocks, FP4 experts) is read")
    q = config["quantization_config"]
    block, fmt = q.get("weight_block_size", [FP8_BLOCK, FP8_BLOCK]), q.get("fmt", "e4m3")
    if block != [FP8_BLOCK, FP8_BLOCK] or fmt != "e4m3":
        return (f"quantization_config weight_block_size {reprlib.repr(block)} fmt {reprlib.repr(fmt)}: only e4m3 "
                f"in [{FP8_BLOCK}, {FP8_BLOCK}] blocks (the release's) is read")
    return None


def unsupported(config: Mapping) -> str | None:
    """What in a transformers config this model would compute differently from transformers' (so a prefill must
    refuse it rather than return other logits), or None. Sizes and FLOPs do not depend on it (plan accepts it)."""
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' ACT2FN: both are x * sigmoid(x)
        return f"hidden_act {act!r}: this runtime computes SiLU-gated experts"
    if config.get("mlp_bias"):
        return "mlp_bias is set: this runtime's experts and shared expert have no biases"
    return None
