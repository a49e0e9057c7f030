"""Model families: each architecture in its own package behind one small protocol (families/base.py).

`family_for(config)` picks the family of a config.json by its `architectures` (else its `model_type`); an unknown
one is refused in one line naming what is supported. The table below names each family's package without
importing it, so looking a family up costs no torch import.

DeepSeek-V4 still lives in moepack.v4 and the runtime (issue 39 moves it here next); the runtime does not yet run
the families of this package.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moepack.format_spec.errors import MoepackError

from .base import ModelFamily


class UnknownFamilyError(MoepackError):
    """A config.json of an architecture no family here implements."""


@dataclass(frozen=True)
class _Entry:
    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    module: str  # the package whose FAMILY is the family


_FAMILIES = (
    _Entry("qwen3-moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), "moepack.families.qwen3_moe"),
)
FAMILY_NAMES = tuple(e.name for e in _FAMILIES)


def _load(entry: _Entry) -> ModelFamily:
    return importlib.import_module(entry.module).FAMILY


def family_named(name: str) -> ModelFamily:
    """The family `name` (as `--family` spells it)."""
    for entry in _FAMILIES:
        if entry.name == name:
            return _load(entry)
    raise UnknownFamilyError(f"unknown model family {name!r} (supported: {', '.join(FAMILY_NAMES)})")


def family_for(config: Mapping[str, Any]) -> ModelFamily:
    """The family of a config.json: one whose `architectures` or `model_type` it names."""
    config = config if isinstance(config, Mapping) else {}
    architectures = config.get("architectures")
    names = [a for a in architectures if isinstance(a, str)] if isinstance(architectures, list) else []
    model_type = config.get("model_type")
    for entry in _FAMILIES:
        if any(a in entry.architectures for a in names) or model_type in entry.model_types:
            return _load(entry)
    what = (f"architectures {names}" if names else f"model_type {model_type!r}" if isinstance(model_type, str)
            else "no architectures or model_type")
    supported = "; ".join(f"{e.name} ({', '.join(e.architectures + e.model_types)})" for e in _FAMILIES)
    raise UnknownFamilyError(f"config.json: {what[:200]} is no model family moepack.families knows (supported: "
                             f"{supported}; DeepSeek-V4 runs through moepack.v4)")
