"""A checkpoint's tensor names onto the container's read order: the table each model family fills in.

An adapter says which tensors are globals, which are a layer's dense weights and which one routed expert's (each
expert one region, in expert-ID order), how a checkpoint's names become the names stored (renames, in order), the
order of an expert's matrices (gate | up | down), which tensors are packed FP4, and which precision-policy role
(format_spec/policies.py) each tensor has. The converter places tensors with it and `moepack plan` sizes a config
with it; `moepack.families.adapter_for(config)` finds a config's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


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
