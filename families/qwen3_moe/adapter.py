"""Qwen3-MoE's checkpoint names onto the container's read order (format_spec.adapter.Adapter): the stored names
are transformers' (the releases'), an `-FP8` release's `P.weight_scale_inv` stored as the container's `P.scale`
companion; a block is `model.layers.N`, a routed expert `mlp.experts.E.{gate,up,down}_proj`."""

from __future__ import annotations

import re

from moepack.format_spec.adapter import Adapter

from .config import MODEL_TYPE
from .tensors import DENSE_MLP, EMBED, EXPERT_NAMING, FINAL_NORM, FP8_SCALE_SUFFIX, HEAD

_EXPERT_MATRICES = {m: getattr(EXPERT_NAMING, m).removesuffix(".weight") for m in ("gate", "up", "down")}
_DENSE_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  *(name.removesuffix(".weight") for name in DENSE_MLP.values()))

QWEN3_MOE = Adapter(
    architecture=MODEL_TYPE,
    model_types=(MODEL_TYPE,),
    renames=((rf"\.weight{re.escape(FP8_SCALE_SUFFIX)}$", ".scale"),),
    block_pattern=re.compile(r"^model\.(?P<block>layers\.(?:0|[1-9][0-9]*))\.(?P<rest>.+)$"),
    expert_pattern=re.compile(r"^mlp\.experts\.(?P<expert>0|[1-9][0-9]*)\.(?P<proj>"
                              + "|".join(_EXPERT_MATRICES.values()) + r")\.(?P<suffix>weight|scale)$"),
    expert_order=tuple(_EXPERT_MATRICES[m] for m in ("gate", "up", "down")),
    global_order=(EMBED, HEAD, FINAL_NORM),
    packed_fp4=re.compile(r"(?!)"),  # no release of this family packs FP4
    # the router (ROUTER) is not a dense linear: every policy keeps it exact
    dense_linear=re.compile(r"^(?:" + "|".join(map(re.escape, _DENSE_LINEARS)) + r")\.weight$"),
    embedding_head=(EMBED, HEAD),
    expert_projections={_EXPERT_MATRICES["gate"]: "routed_gate_up", _EXPERT_MATRICES["up"]: "routed_gate_up",
                        _EXPERT_MATRICES["down"]: "routed_down"},
)
