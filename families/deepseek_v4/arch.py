"""DeepSeek-V4's adapter: how its checkpoint's tensor names map onto the container's read order.

An adapter (format_spec/adapter.py) is a small table: name rewrites to the canonical names (here from
moepack.families.deepseek_v4.names), the pattern that finds a tensor's block and expert, the order of an expert's
tensors (gate | up | down), and which tensors are packed FP4. The converter (packer/) places tensors with it and
`moepack plan` (runtime/) sizes a config with it; the other families' adapters are in their packages
(moepack.families.adapter_for finds one).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from moepack.format_spec.adapter import Adapter

from .config import model_type as config_model_type
from .names import TRANSFORMERS_RENAMES


DEEPSEEK_V4 = Adapter(
    architecture="deepseek_v4",
    model_types=("deepseek_v4",),
    # transformers' save_pretrained writes a `model.` prefix and a few of its own names for the globals
    renames=((r"^model\.", ""),
             *((f"^{re.escape(name)}$", canonical) for name, canonical in TRANSFORMERS_RENAMES.items())),
    block_pattern=re.compile(r"^(?P<block>(?:layers|mtp)\.(?:0|[1-9][0-9]*))\.(?P<rest>.+)$"),
    expert_pattern=re.compile(r"^ffn\.experts\.(?P<expert>0|[1-9][0-9]*)\.(?P<proj>w[0-9]+)\.(?P<suffix>weight|scale)$"),
    expert_order=("w1", "w3", "w2"),
    global_order=("embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"),
    packed_fp4=re.compile(r"\.ffn\.experts\.[0-9]+\.w[0-9]+\.weight$"),
    # the router (ffn.gate.weight) is not here: policies keep it exact
    dense_linear=re.compile(r"^(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b)|attn\.(?:indexer\.)?compressor\.(?:wkv|wgate)"
                            r"|attn\.indexer\.(?:wq_b|weights_proj)|ffn\.shared_experts\.w[123]|[eh]_proj)\.weight$"),
    embedding_head=("embed.weight", "head.weight"),
    expert_projections={"w1": "routed_gate_up", "w3": "routed_gate_up", "w2": "routed_down"},
)

ADAPTERS = {a.architecture: a for a in (DEEPSEEK_V4,)}


def v4_adapter(config: Mapping) -> Adapter | None:
    """DeepSeek-V4's adapter when the config is DeepSeek-V4's, else None (moepack.families.adapter_for asks the
    other families; a config.json whose model_type is no string is refused here, naming the field)."""
    model_type = config_model_type(config)
    return next((a for a in ADAPTERS.values() if model_type in a.model_types), None)
