"""One table of DeepSeek-V4 tensor names: moepack's canonical names and what the same tensor is called elsewhere.

Columns (`TensorName`):

* ``name``: moepack's canonical name, what a container stores and the schema (moepack.families.deepseek_v4.tensors)
  lists: the release's names without a `model.` prefix, except the attention's KV norm, which moepack (like
  transformers' save_pretrained) calls `attn.norm.weight`; the release's own spelling is ``release`` where it differs
  (`attn.kv_norm.weight`), and a container may hold either (`stored_names`).
* ``transformers``: what transformers' save_pretrained writes for DeepseekV4ForCausalLM (and its loader maps):
  `model.` + the canonical name, except the embedding, the mHC head and the LM head. transformers does not
  instantiate the MTP layers; their names here follow the same prefix rule.
* ``module``: the parameter's name inside transformers' model (`named_parameters()`); routed experts are fused
  there (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first; `mlp.experts.down_proj` [E, H, I]).
* ``gguf``: llama.cpp's name in a GGUF of the `deepseek4` architecture (gguf-py constants and
  conversion/deepseek.py); routed experts are merged per layer (`blk.L.ffn_gate_exps.weight` [E, I, H]); llama.cpp
  does not convert the MTP layers (None).

Placeholders: {L} a layer number, {M} an MTP layer number, {E} an expert id. Scale companions (`.scale`) are
named after their weight and are not listed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from ..base import ExpertNaming


@dataclass(frozen=True)
class TensorName:
    name: str
    transformers: str
    module: str | None
    gguf: str | None
    release: str | None = None  # the release's own spelling, where it is not `name`


# Per block: (rest of the canonical name, rest of the module name, GGUF rest or None). A block is `layers.{L}`
# (transformers `model.layers.{L}`, GGUF `blk.{L}`) or the block inside `mtp.{M}`.
_BLOCK = (
    ("attn_norm.weight", "input_layernorm.weight", "attn_norm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight", "ffn_norm.weight"),
    ("hc_attn_fn", "attn_hc.fn", "hc_attn_fn.weight"),
    ("hc_attn_base", "attn_hc.base", "hc_attn_base.weight"),
    ("hc_attn_scale", "attn_hc.scale", "hc_attn_scale.weight"),
    ("hc_ffn_fn", "ffn_hc.fn", "hc_ffn_fn.weight"),
    ("hc_ffn_base", "ffn_hc.base", "hc_ffn_base.weight"),
    ("hc_ffn_scale", "ffn_hc.scale", "hc_ffn_scale.weight"),
    ("attn.wq_a.weight", "self_attn.q_a_proj.weight", "attn_q_a.weight"),
    ("attn.q_norm.weight", "self_attn.q_a_norm.weight", "attn_q_a_norm.weight"),
    ("attn.wq_b.weight", "self_attn.q_b_proj.weight", "attn_q_b.weight"),
    ("attn.wkv.weight", "self_attn.kv_proj.weight", "attn_kv.weight"),
    ("attn.norm.weight", "self_attn.kv_norm.weight", "attn_kv_a_norm.weight"),
    ("attn.wo_a.weight", "self_attn.o_a_proj.weight", "attn_output_a.weight"),
    ("attn.wo_b.weight", "self_attn.o_b_proj.weight", "attn_output_b.weight"),
    ("attn.attn_sink", "self_attn.sinks", "attn_sinks.weight"),
    ("attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight", "attn_compressor_kv.weight"),
    ("attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight", "attn_compressor_gate.weight"),
    ("attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight", "attn_compressor_norm.weight"),
    ("attn.compressor.ape", "self_attn.compressor.position_bias", "attn_compressor_ape.weight"),
    ("attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight", "indexer.attn_q_b.weight"),
    ("attn.indexer.weights_proj.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight",
     "indexer.proj.weight"),
    ("attn.indexer.compressor.wkv.weight", "self_attn.compressor.indexer.kv_proj.weight",
     "indexer_compressor_kv.weight"),
    ("attn.indexer.compressor.wgate.weight", "self_attn.compressor.indexer.gate_proj.weight",
     "indexer_compressor_gate.weight"),
    ("attn.indexer.compressor.norm.weight", "self_attn.compressor.indexer.kv_norm.weight",
     "indexer_compressor_norm.weight"),
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias", "indexer_compressor_ape.weight"),
    ("ffn.gate.weight", "mlp.gate.weight", "ffn_gate_inp.weight"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias", "exp_probs_b.bias"),
    ("ffn.gate.tid2eid", "mlp.gate.tid2eid", "ffn_gate_tid2eid.weight"),
    ("ffn.experts.{E}.w1.weight", "mlp.experts.gate_up_proj", "ffn_gate_exps.weight"),
    ("ffn.experts.{E}.w3.weight", "mlp.experts.gate_up_proj", "ffn_up_exps.weight"),
    ("ffn.experts.{E}.w2.weight", "mlp.experts.down_proj", "ffn_down_exps.weight"),
    ("ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight", "ffn_gate_shexp.weight"),
    ("ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight", "ffn_up_shexp.weight"),
    ("ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight", "ffn_down_shexp.weight"),
)
_RELEASE_SPELLING = {"attn.norm.weight": "attn.kv_norm.weight"}  # block rest: the release's own name
# An MTP layer's own tensors besides its block (the reference's e_proj / h_proj / enorm / hnorm, final norm, mHC
# head). transformers has no module for them, llama.cpp no GGUF name.
_MTP_ONLY = ("enorm.weight", "hnorm.weight", "e_proj.weight", "h_proj.weight", "norm.weight",
             "hc_head_fn", "hc_head_base", "hc_head_scale")


def _table() -> tuple[TensorName, ...]:
    rows = [
        TensorName("embed.weight", "model.embed_tokens.weight", "model.embed_tokens.weight", "token_embd.weight"),
        TensorName("norm.weight", "model.norm.weight", "model.norm.weight", "output_norm.weight"),
        TensorName("hc_head_fn", "model.hc_head.hc_fn", "model.hc_head.hc_fn", "output_hc_fn.weight"),
        TensorName("hc_head_base", "model.hc_head.hc_base", "model.hc_head.hc_base", "output_hc_base.weight"),
        TensorName("hc_head_scale", "model.hc_head.hc_scale", "model.hc_head.hc_scale", "output_hc_scale.weight"),
        TensorName("head.weight", "head.weight", "lm_head.weight", "output.weight"),
    ]
    for rest, module, gguf in _BLOCK:
        release = _RELEASE_SPELLING.get(rest)
        rows.append(TensorName(f"layers.{{L}}.{rest}", f"model.layers.{{L}}.{rest}", f"model.layers.{{L}}.{module}",
                               f"blk.{{L}}.{gguf}", release and f"layers.{{L}}.{release}"))
        rows.append(TensorName(f"mtp.{{M}}.{rest}", f"model.mtp.{{M}}.{rest}", None, None,
                               release and f"mtp.{{M}}.{release}"))
    rows += [TensorName(f"mtp.{{M}}.{rest}", f"model.mtp.{{M}}.{rest}", None, None) for rest in _MTP_ONLY]
    return tuple(rows)


TABLE = _table()


def _renames() -> dict[str, str]:
    """transformers' name, `model.` prefix dropped -> canonical, where the two differ (the globals; every block
    tensor is `model.` + its canonical name)."""
    out = {"lm_head.weight": "head.weight"}  # transformers' module name for the head: the converter always took it
    for row in TABLE:
        short = row.transformers.removeprefix("model.")
        if "{" not in row.name and short != row.name:
            out[short] = row.name
    return out


TRANSFORMERS_RENAMES = _renames()

_FIELD = {"L": r"(?P<L>0|[1-9][0-9]*)", "M": r"(?P<M>0|[1-9][0-9]*)", "E": r"(?P<E>0|[1-9][0-9]*)"}


def _regex(pattern: str) -> re.Pattern:
    parts = re.split(r"\{([LME])\}", pattern)
    return re.compile("".join(re.escape(p) if i % 2 == 0 else _FIELD[p] for i, p in enumerate(parts)) + "$")


@lru_cache(maxsize=None)
def _index(column: str) -> tuple[tuple[re.Pattern, TensorName], ...]:
    return tuple((_regex(getattr(row, column)), row) for row in TABLE if getattr(row, column) is not None)


def lookup(name: str, column: str = "name") -> tuple[TensorName, dict[str, str]] | None:
    """(the row whose `column` pattern matches `name`, the placeholder values), or None."""
    for pattern, row in _index(column):
        m = pattern.match(name)
        if m:
            return row, m.groupdict()
    return None


def _convert(name: str, source: str, target: str) -> str | None:
    found = lookup(name, source)
    if found is None:
        return None
    row, fields = found
    pattern = getattr(row, target)
    return None if pattern is None else pattern.format(**fields)


def canonical(name: str) -> str | None:
    """moepack's name of a tensor given in any listed spelling (canonical, release, transformers), or None."""
    if lookup(name) is not None:
        return name
    release = _convert(name, "release", "name")
    if release is not None:
        return release
    converted = from_transformers(name)
    return converted if lookup(converted) is not None else None


def to_transformers(name: str) -> str | None:
    """The name save_pretrained writes for canonical `name` (None: not a listed tensor)."""
    return _convert(name, "name", "transformers")


def from_transformers(name: str) -> str:
    """The canonical name of a tensor named as transformers' save_pretrained names it: the `model.` prefix
    dropped, then TRANSFORMERS_RENAMES. Names the table does not list are otherwise kept (the converter stores
    them as they come)."""
    name = name.removeprefix("model.")
    return TRANSFORMERS_RENAMES.get(name, name)


def to_gguf(name: str) -> str | None:
    """llama.cpp's GGUF name (architecture deepseek4) of canonical `name`: a routed expert's is its layer's merged
    tensor; None for what llama.cpp does not convert (MTP layers)."""
    return _convert(name, "name", "gguf")


def from_gguf(name: str) -> str | None:
    """moepack's canonical name of a GGUF tensor of llama.cpp's deepseek4, None for names it does not have (routed
    experts are stacked in a GGUF: their rows hold an expert placeholder and are not matched here)."""
    found = lookup(name, "gguf")
    if found is None or "{E}" in found[0].name:
        return None
    row, fields = found
    return row.name.format(**fields)


def to_module(name: str) -> str | None:
    """The parameter (or buffer) of transformers' DeepseekV4ForCausalLM holding canonical `name` (routed experts:
    the fused tensor); None for the MTP layers."""
    return _convert(name, "name", "module")


def stored_names(name: str) -> tuple[str, ...]:
    """The names a container may hold canonical `name` under: itself, then the release's spelling if it differs
    (a container keeps a source's names: the release's `attn.kv_norm`, transformers' `attn.norm`)."""
    release = _convert(name, "name", "release")
    return (name,) if release is None or release == name else (name, release)


# a routed expert's matrices by layer, gate w1 and up w3 [I, H], down w2 [H, I]
EXPERT_NAMING = ExpertNaming(prefix=lambda layer, expert: f"layers.{layer}.ffn.experts.{expert}.",
                             gate="w1.weight", up="w3.weight", down="w2.weight")
