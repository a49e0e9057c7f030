"""Where a routed expert's matrices are in a container, as a model family names them: what the expert backends read
an expert by (they know no model's names) and what a family spells once. No torch here: the family registry
imports it through families/base.py without computing anything."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertNaming:
    """Where one routed expert's three matrices are: `prefix(layer, expert)` + gate / up / down, each [out, in]
    (gate and up [I, H], down [H, I]). The only place a family spells its experts' names; everything else asks it."""

    prefix: Callable[[int, int], str]
    gate: str
    up: str
    down: str

    def names(self, layer: int, expert: int) -> dict[str, str]:
        """{"gate": name, "up": name, "down": name} of expert `expert` of layer `layer`."""
        p = self.prefix(layer, expert)
        return {"gate": p + self.gate, "up": p + self.up, "down": p + self.down}
