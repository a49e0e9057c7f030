"""DeepSeek-V4 as llama.cpp's `deepseek4` architecture: what llama.cpp's own converter (conversion/deepseek.py,
DeepseekV4Model) writes for the release checkpoint, as the family's GGUF protocol (families/base.py) gives it to
the packer's writer and reader (packer/gguf_export.py, packer/gguf_source.py), which move the bytes.

* tensors (`gguf_tensors`): names.py's GGUF column (`blk.L.attn_q_a.weight`, `output_hc_fn.weight`, ...), in the
  container's order, a layer's routed experts stacked into `ffn_{gate,down,up}_exps` [n_experts, out, in] (w1, w2,
  w3) where its first expert lies; the MTP layers are not written (the converter skips them), nor the router bias
  of a hash layer (llama.cpp routes those by tid2eid).
* keys (`gguf_model`): the base TextModel keys and DeepseekV4Model.set_gguf_parameters' (`DEEPSEEK4_KEYS` lists the
  ones llama.cpp's loader requires), from the config in either spelling (config.py); general.file_type is the
  converter's MXFP4_MOE whatever the experts' type. The tokenizer's pre-tokenizer is `joyai-llm` as the converter
  names it; a tokenizer without a chat template gets DeepSeek-V4's format as chat.py renders it.
* `config_from_gguf`: a transformers-spelled config.json rebuilt from the `deepseek4.*` keys (the keys' inverse; a
  layer's kind from its compress ratio and whether it has indexer tensors).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from moepack.format_spec.errors import MoepackError

from ..base import GGUF_QUANT_VERSION, GGUFModel, GGUFTensor
from . import names as v4names
from .config import DEFAULTS, ModelConfig

ARCH = "deepseek4"
# What llama.cpp's converter names the DeepSeek-V4 tokenizer's pre-tokenizer (it recognises the release's tokenizer
# by a hash of its output as "joyai-llm"; src/llama-vocab.cpp gives that the same regexes as "deepseek-v3").
TOKENIZER_PRE = "joyai-llm"
# Those regexes, the ones the DeepSeek-V3 / V4 tokenizer.json lists as three Split steps before its ByteLevel step
_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)
PRE_TOKENIZERS = {"deepseek-v3": _SPLITS, TOKENIZER_PRE: _SPLITS}
FILE_TYPE_MXFP4_MOE = 38  # LlamaFileType.MOSTLY_MXFP4_MOE, what the converter sets for DeepSeek-V4
GATING_FUNC = {"softmax": 1, "sigmoid": 2, "sqrtsoftplus": 4}  # ExpertGatingFuncType
SCORING = {v: k for k, v in GATING_FUNC.items()}

# The keys llama.cpp's deepseek4 loader reads with get_key (a missing one fails the load), besides the generic
# ones every model needs (block_count, context_length, embedding_length, attention.head_count).
DEEPSEEK4_KEYS = tuple(k.format(arch=ARCH) for k in (
    "{arch}.block_count", "{arch}.context_length", "{arch}.embedding_length", "{arch}.attention.head_count",
    "{arch}.attention.layer_norm_rms_epsilon", "{arch}.attention.q_lora_rank", "{arch}.attention.sliding_window",
    "{arch}.expert_feed_forward_length", "{arch}.expert_shared_count", "{arch}.expert_weights_scale",
    "{arch}.expert_weights_norm", "{arch}.swiglu_clamp_exp", "{arch}.attention.indexer.head_count",
    "{arch}.attention.indexer.key_length", "{arch}.attention.indexer.top_k", "{arch}.attention.output_group_count",
    "{arch}.attention.output_lora_rank", "{arch}.attention.compress_rope_freq_base",
    "{arch}.hyper_connection.count", "{arch}.hyper_connection.sinkhorn_iterations",
    "{arch}.hyper_connection.epsilon", "{arch}.hash_layer_count", "{arch}.attention.compress_ratios",
    "{arch}.expert_gating_func", "{arch}.expert_count", "{arch}.expert_used_count",
))

_EXPERT = re.compile(r"layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
_LAYER = re.compile(r"layers\.(\d+)\.")


def gguf_model(config: Mapping[str, Any]) -> GGUFModel:
    from .chat import chat_template

    return GGUFModel(ARCH, tuple(metadata(config, ModelConfig.from_hf(config))), TOKENIZER_PRE, chat_template)


def gguf_tensors(config: Mapping[str, Any], names: Sequence[str] | None) -> list[GGUFTensor]:
    """The GGUF's tensors in the order of `names` (a container's; None: the schema's, as tensors.py lists them)."""
    from moepack.format_spec.decode import is_companion  # (torch: imported when a GGUF is written or read)

    cfg = ModelConfig.from_hf(config)
    if names is None:
        from .tensors import v4_tensor_specs

        names = [spec.name for spec in v4_tensor_specs(config, mtp=False)]
    out: list[GGUFTensor] = []
    done_experts: set[tuple[int, str]] = set()
    present = set(names)
    for name in names:
        if is_companion(name, present):
            continue
        m = _EXPERT.match(name)
        if m:
            layer, matrix = int(m.group(1)), m.group(3)
            if (layer, matrix) not in done_experts:
                done_experts.add((layer, matrix))
                experts = [f"layers.{layer}.ffn.experts.{e}.{matrix}.weight" for e in range(cfg.n_routed_experts)]
                out.append(GGUFTensor(v4names.to_gguf(experts[0]), tuple(experts), stacked=True))
            continue
        canon = v4names.canonical(name)
        if canon is None:
            raise MoepackError(f"tensor {name} has no GGUF name (not a DeepSeek-V4 tensor moepack knows)")
        if canon.startswith("mtp."):
            continue  # llama.cpp's converter skips the MTP layers
        lm = _LAYER.match(canon)
        if lm and canon.endswith(".ffn.gate.bias") and cfg.hash_layers[int(lm.group(1))]:
            continue  # a hash layer's router bias is unused (the converter drops it)
        gguf_name = v4names.to_gguf(canon)
        if gguf_name is None:
            raise MoepackError(f"tensor {name} has no GGUF name")
        out.append(GGUFTensor(gguf_name, (name,)))
        if canon == "embed.weight" and cfg.tie_word_embeddings and "head.weight" not in present:
            # llama.cpp's deepseek4 loads its own output.weight: a tied model's head is the embedding's copy
            out.append(GGUFTensor(v4names.to_gguf("head.weight"), (name,)))
    return out


def _rope_problem(config: Mapping[str, Any], cfg: ModelConfig) -> str | None:
    """What of the config's two RoPEs the GGUF keys cannot say (one rotated channel count, the sliding layers'
    RoPE without scaling, the compressed layers' YaRN with cos and sin unscaled, as the release has them), or None:
    llama.cpp, and a GGUF read back, would compute another model."""
    main, compress = cfg.main_rope, cfg.compress_rope
    if main.scaling != "default":
        return "the main (sliding-window) RoPE is scaled (rope_parameters.main): only the compressed layers' may be"
    if compress.scaling == "linear":
        return "the compressed layers' RoPE is linear-scaled (rope_parameters.compress): the GGUF keys say YaRN only"
    if compress.scaling == "yarn" and compress.attention_factor != 1.0:
        return (f"the compressed layers' YaRN scales cos and sin by {compress.attention_factor:.6g} (its "
                "attention_factor, or mscale's default): the release's is 1")
    if len({main.dim, compress.dim, _rope_dim(config, cfg)}) > 1:
        return (f"the main and compressed RoPEs rotate {main.dim} and {compress.dim} channels of a head: a GGUF says "
                "one count")
    return None


def _rope_dim(config: Mapping[str, Any], cfg: ModelConfig) -> int:
    if isinstance(config.get("qk_rope_head_dim"), int):
        return config["qk_rope_head_dim"]
    return cfg.main_rope.dim


# Fields of a config.json that DeepSeek-V4 (transformers' and moepack's) does not read: one KV head, one shared
# expert of moe_intermediate_size, the chosen experts' weights always renormalised. The GGUF says what the tensors
# and the arithmetic are (the release's values), not another value a config may carry, which llama.cpp would read
# as other tensor shapes or other routing.
COMPUTED = {"num_key_value_heads": 1, "n_shared_experts": 1, "norm_topk_prob": True}


def metadata(config: Mapping[str, Any], cfg: ModelConfig) -> list[tuple[str, str, object]]:
    """(key, kind, value) for every model key, kind one of uint32 / float32 / bool / string / array."""
    a = ARCH
    n_hash = sum(cfg.hash_layers)
    if any(cfg.hash_layers[n_hash:]):
        raise MoepackError("llama.cpp needs the hash-routed layers to be the first ones (hash_layer_count)")
    problem = _rope_problem(config, cfg)
    if problem:
        raise MoepackError(f"llama.cpp's deepseek4 cannot hold this config's RoPE: {problem}")
    n = cfg.num_layers
    kv: list[tuple[str, str, object]] = [
        (f"{a}.block_count", "uint32", n),
        (f"{a}.context_length", "uint32", config.get("max_position_embeddings", DEFAULTS["max_position_embeddings"])),
        (f"{a}.embedding_length", "uint32", cfg.hidden_size),
    ]
    if isinstance(config.get("intermediate_size"), int):
        kv.append((f"{a}.feed_forward_length", "uint32", config["intermediate_size"]))
    kv.append((f"{a}.attention.head_count", "uint32", cfg.num_heads))
    if isinstance(config.get("num_key_value_heads"), int):
        kv.append((f"{a}.attention.head_count_kv", "uint32", COMPUTED["num_key_value_heads"]))
    rope = cfg.compress_rope
    if rope.scaling == "yarn":  # the release's rope_scaling: the compressed layers' YaRN (llama.cpp applies it there)
        kv += [(f"{a}.rope.scaling.type", "string", "yarn"),
               (f"{a}.rope.scaling.factor", "float32", float(rope.factor)),
               (f"{a}.rope.scaling.original_context_length", "uint32", int(rope.original_max_position_embeddings)),
               (f"{a}.rope.scaling.yarn_beta_fast", "float32", float(rope.beta_fast)),
               (f"{a}.rope.scaling.yarn_beta_slow", "float32", float(rope.beta_slow))]
    kv += [
        (f"{a}.rope.freq_base", "float32", float(cfg.main_rope.theta)),
        (f"{a}.attention.layer_norm_rms_epsilon", "float32", float(cfg.rms_norm_eps)),
        (f"{a}.expert_count", "uint32", cfg.n_routed_experts),
        (f"{a}.expert_used_count", "uint32", cfg.num_experts_per_tok),
        (f"{a}.expert_gating_func", "uint32", GATING_FUNC[cfg.scoring_func]),
        (f"{a}.attention.key_length", "uint32", cfg.head_dim),
        (f"{a}.attention.value_length", "uint32", cfg.head_dim),
        ("general.file_type", "uint32", FILE_TYPE_MXFP4_MOE),
        # DeepseekV4Model.set_gguf_parameters
        (f"{a}.rope.dimension_count", "uint32", _rope_dim(config, cfg)),
        (f"{a}.attention.q_lora_rank", "uint32", cfg.q_lora_rank),
        (f"{a}.attention.sliding_window", "uint32", cfg.sliding_window),
        (f"{a}.expert_feed_forward_length", "uint32", cfg.moe_intermediate_size),
        (f"{a}.expert_shared_count", "uint32", COMPUTED["n_shared_experts"]),
        (f"{a}.expert_weights_scale", "float32", float(cfg.routed_scaling_factor)),
        (f"{a}.expert_weights_norm", "bool", COMPUTED["norm_topk_prob"]),
        (f"{a}.swiglu_clamp_exp", "array", [float(cfg.swiglu_limit)] * n),
        (f"{a}.swiglu_clamp_shexp", "array", [float(cfg.swiglu_limit)] * n),
        (f"{a}.attention.indexer.head_count", "uint32", cfg.index_n_heads),
        (f"{a}.attention.indexer.key_length", "uint32", cfg.index_head_dim),
        (f"{a}.attention.indexer.top_k", "uint32", cfg.index_topk),
        (f"{a}.attention.output_group_count", "uint32", cfg.o_groups),
        (f"{a}.attention.output_lora_rank", "uint32", cfg.o_lora_rank),
        (f"{a}.attention.compress_ratios", "array", [int(r) for r in cfg.compress_rates]),
        (f"{a}.attention.compress_rope_freq_base", "float32", float(cfg.compress_rope.theta)),
        (f"{a}.hyper_connection.count", "uint32", cfg.hc_mult),
        (f"{a}.hyper_connection.sinkhorn_iterations", "uint32", cfg.hc_sinkhorn_iters),
        (f"{a}.hyper_connection.epsilon", "float32", float(cfg.hc_eps)),
        (f"{a}.hash_layer_count", "uint32", n_hash),
        (f"{a}.embedding_length_out", "uint32", cfg.hidden_size * cfg.hc_mult),
        ("general.quantization_version", "uint32", GGUF_QUANT_VERSION),
    ]
    return kv


def config_from_gguf(keys: Mapping[str, Any], vocab_size: int, tied: bool, tensors: Collection[str] = ()) -> dict:
    """The config.json of a `deepseek4` GGUF's keys (`keys`: without the `deepseek4.` prefix; `tensors`: its
    tensor names, which say a compressed layer's kind). `tied`: the GGUF has no output.weight, the head is the
    embedding (moepack's export of a tied model writes the embedding's copy, as llama.cpp's deepseek4 loads one)."""
    def k(name: str, default=None, required: bool = True):
        value = keys.get(name, default)
        if value is None and required:
            raise MoepackError(f"no {ARCH}.{name} key")
        return value

    n = int(k("block_count"))
    head_dim = int(k("attention.key_length"))
    if head_dim <= 0:  # (the RoPE's share of it is divided by it)
        raise MoepackError(f"{ARCH}.attention.key_length {head_dim}: a head has at least one channel")
    rope_dim = int(k("rope.dimension_count", head_dim))
    ratios = list(k("attention.compress_ratios"))
    if len(ratios) < n:
        raise MoepackError(f"{ARCH}.attention.compress_ratios lists {len(ratios)} layers, block_count is {n}")
    kinds, rates = [], {}
    for layer, ratio in enumerate(ratios[:n]):
        kind = ("sliding_attention" if ratio == 0 else "compressed_sparse_attention"
                if f"blk.{layer}.indexer.proj.weight" in tensors else "heavily_compressed_attention")
        if ratio and rates.setdefault(kind, int(ratio)) != ratio:
            raise MoepackError(f"{ARCH}.attention.compress_ratios: {kind} layers with ratios {rates[kind]} and "
                               f"{ratio}; moepack's DeepSeek-V4 has one ratio per kind")
        kinds.append(kind)
    gating = int(k("expert_gating_func"))
    if gating not in SCORING:
        raise MoepackError(f"{ARCH}.expert_gating_func {gating} is none of {sorted(SCORING)}")
    clamp = k("swiglu_clamp_exp", [10.0], required=False)
    clamp = clamp if isinstance(clamp, list) else [clamp]
    if len(set(clamp)) > 1:
        raise MoepackError(f"{ARCH}.swiglu_clamp_exp differs between layers; moepack's DeepSeek-V4 has one limit")
    n_hash = int(k("hash_layer_count", 0, required=False))
    partial = rope_dim / head_dim
    compress = {"rope_type": "default", "rope_theta": float(k("attention.compress_rope_freq_base")),
                "partial_rotary_factor": partial}
    if k("rope.scaling.type", required=False) == "yarn":
        compress.update(rope_type="yarn", factor=float(k("rope.scaling.factor")),
                        original_max_position_embeddings=int(k("rope.scaling.original_context_length")),
                        beta_fast=float(k("rope.scaling.yarn_beta_fast", 32.0, required=False)),
                        beta_slow=float(k("rope.scaling.yarn_beta_slow", 1.0, required=False)),
                        # the V4 reference does not scale cos/sin (config.py)
                        attention_factor=1.0)
    config = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": vocab_size, "hidden_size": int(k("embedding_length")), "num_hidden_layers": n,
        "num_attention_heads": int(k("attention.head_count")),
        "num_key_value_heads": int(k("attention.head_count_kv", 1, required=False)),
        "head_dim": head_dim, "qk_rope_head_dim": rope_dim, "partial_rotary_factor": partial,
        "q_lora_rank": int(k("attention.q_lora_rank")), "o_lora_rank": int(k("attention.output_lora_rank")),
        "o_groups": int(k("attention.output_group_count")), "sliding_window": int(k("attention.sliding_window")),
        "moe_intermediate_size": int(k("expert_feed_forward_length")),
        "n_routed_experts": int(k("expert_count")), "num_experts_per_tok": int(k("expert_used_count")),
        "n_shared_experts": int(k("expert_shared_count", 1, required=False)),
        "routed_scaling_factor": float(k("expert_weights_scale")),
        "norm_topk_prob": bool(k("expert_weights_norm", True, required=False)),
        "scoring_func": SCORING[gating], "swiglu_limit": float(clamp[0]),
        "index_n_heads": int(k("attention.indexer.head_count")),
        "index_head_dim": int(k("attention.indexer.key_length")),
        "index_topk": int(k("attention.indexer.top_k")),
        "layer_types": kinds, "compress_rates": rates,
        "mlp_layer_types": ["hash_moe" if i < n_hash else "moe" for i in range(n)],
        "hc_mult": int(k("hyper_connection.count")),
        "hc_sinkhorn_iters": int(k("hyper_connection.sinkhorn_iterations")),
        "hc_eps": float(k("hyper_connection.epsilon")),
        "rms_norm_eps": float(k("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(k("context_length")),
        "rope_theta": float(k("rope.freq_base")), "compress_rope_theta": compress["rope_theta"],
        "rope_parameters": {"main": {"rope_type": "default", "rope_theta": float(k("rope.freq_base")),
                                     "partial_rotary_factor": partial}, "compress": compress},
        "num_nextn_predict_layers": 0, "tie_word_embeddings": tied,
    }
    if k("feed_forward_length", required=False) is not None:
        config["intermediate_size"] = int(k("feed_forward_length"))
    return config
