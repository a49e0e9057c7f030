"""Architecture adapters: how a checkpoint's tensor names map onto the container's read order.

An adapter is a small table: name rewrites to the canonical names (for DeepSeek-V4 from moepack.v4.names), the
pattern that finds a tensor's block and expert, the order of an expert's tensors (gate | up | down), and which
tensors are packed FP4. The converter (packer/) places tensors with it and `moepack plan` (runtime/) sizes a
config with it. Qwen3-MoE / Mixtral / DeepSeek-V3 adapters are new rows of the same shape.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from moepack.format_spec.errors import MoepackError

from .config import model_type as config_model_type
from .names import TRANSFORMERS_RENAMES


@dataclass(frozen=True)
class Adapter:
    architecture: str
    model_types: tuple[str, ...]
    renames: tuple[tuple[str, str], ...]  # regex -> replacement, applied in order
    block_pattern: re.Pattern  # groups: block ("layers.N" / "mtp.N"), rest
    expert_pattern: re.Pattern  # on the rest; groups: expert id, projection, suffix
    expert_order: tuple[str, ...]  # projection names in stored order: gate, up, down
    global_order: tuple[str, ...]  # globals first in this order (read order: embedding first), then the rest sorted
    packed_fp4: re.Pattern  # I8 tensors matching this hold two e2m1 codes per byte
    dense_linear: re.Pattern  # the linears other than routed experts (attention, shared expert, indexer, ...)
    embedding_head: tuple[str, ...]
    expert_projections: dict  # expert projection name -> policy role

    def canonical(self, name: str) -> str:
        for pattern, repl in self.renames:
            name = re.sub(pattern, repl, name)
        return name

    def place(self, name: str) -> tuple[str, str | None, int | None]:
        """Canonical name -> (region kind, block, expert)."""
        m = self.block_pattern.match(name)
        if not m:
            return "global", None, None
        e = self.expert_pattern.match(m.group("rest"))
        if e:
            return "expert", m.group("block"), int(e.group("expert"))
        return "dense", m.group("block"), None

    def role(self, name: str, shape) -> str:
        """The tensor's precision-policy role (format_spec/policies.py): which storage type a policy gives it."""
        if name.endswith(".scale") or len(shape) < 2:
            return "exact"
        if name in self.embedding_head:
            return "embedding_head"
        m = self.block_pattern.match(name)
        if m:
            e = self.expert_pattern.match(m.group("rest"))
            if e:
                return self.expert_projections.get(e.group("proj"), "exact")
            if self.dense_linear.search(m.group("rest")):
                return "dense_linear"
        return "exact"

    def expert_sort_key(self, name: str):
        e = self.expert_pattern.match(self.block_pattern.match(name).group("rest"))
        proj = e.group("proj")
        return (self.expert_order.index(proj) if proj in self.expert_order else len(self.expert_order), proj,
                e.group("suffix") != "weight", e.group("suffix"))

    def global_sort_key(self, name: str):
        return (self.global_order.index(name) if name in self.global_order else len(self.global_order), name)


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


def adapter_for(config: Mapping) -> Adapter:
    model_type = config_model_type(config)
    for a in ADAPTERS.values():
        if model_type in a.model_types:
            return a
    raise MoepackError(f"unsupported architecture: model_type {model_type!r} (supported: "
                       f"{', '.join(t for a in ADAPTERS.values() for t in a.model_types)})")
