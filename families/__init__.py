"""Model families: each architecture in its own package behind one small protocol (families/base.py).

`family_for(config)` picks the family of a config.json by its `architectures` (else its `model_type`); an unknown
one is refused in one line naming what is supported. The table below names each family's package without
importing it, so looking a family up costs no torch import.

DeepSeek-V4's package (families/deepseek_v4) is not yet in the table: a caller that finds no family treats the
model as DeepSeek-V4's, and `adapter_for(config)` asks that package for its adapter, so it gives the container
layout of any config the converter takes.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moepack.format_spec.adapter import Adapter
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
    gguf_architectures: tuple[str, ...] = ()  # llama.cpp's name of it (a GGUF's general.architecture)


_FAMILIES = (
    _Entry("qwen3-moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), "moepack.families.qwen3_moe", ("qwen3moe",)),
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


def _entry_of(config: Mapping[str, Any]) -> tuple[_Entry | None, list[str], Any]:
    """(the entry whose `architectures` or `model_type` the config names, or None; its architectures; its
    model_type)."""
    config = config if isinstance(config, Mapping) else {}
    architectures = config.get("architectures")
    names = [a for a in architectures if isinstance(a, str)] if isinstance(architectures, list) else []
    model_type = config.get("model_type")
    entry = next((e for e in _FAMILIES if any(a in e.architectures for a in names) or model_type in e.model_types),
                 None)
    return entry, names, model_type


def find_family(config: Mapping[str, Any]) -> ModelFamily | None:
    """The family of a config.json, or None when it is no family's here (DeepSeek-V4's, or unknown)."""
    entry, _, _ = _entry_of(config)
    return _load(entry) if entry is not None else None


def family_for(config: Mapping[str, Any]) -> ModelFamily:
    """The family of a config.json: one whose `architectures` or `model_type` it names."""
    entry, names, model_type = _entry_of(config)
    if entry is not None:
        return _load(entry)
    what = (f"architectures {names}" if names else f"model_type {model_type!r}" if isinstance(model_type, str)
            else "no architectures or model_type")
    supported = "; ".join(f"{e.name} ({', '.join(e.architectures + e.model_types)})" for e in _FAMILIES)
    raise UnknownFamilyError(f"config.json: {what[:200]} is no model family moepack.families knows (supported: "
                             f"{supported}; DeepSeek-V4 runs through moepack.families.deepseek_v4)")


def _family_where(matches) -> ModelFamily | None:
    entry = next((e for e in _FAMILIES if matches(e)), None)
    return _load(entry) if entry is not None else None


def family_of_architecture(architecture: str) -> ModelFamily | None:
    """The family whose adapter writes a container's `architecture` (its model_type), or None (DeepSeek-V4's)."""
    return _family_where(lambda e: architecture in e.model_types)


def family_of_gguf(architecture: Any) -> ModelFamily | None:
    """The family whose llama.cpp architecture a GGUF's general.architecture names, or None."""
    return _family_where(lambda e: architecture in e.gguf_architectures)


GGUF_ARCHITECTURES = tuple(a for e in _FAMILIES for a in e.gguf_architectures)


def adapter_for(config: Mapping[str, Any]) -> Adapter:
    """The container layout (format_spec.adapter.Adapter) of a config.json's model: its family's, or DeepSeek-V4's;
    any other architecture is refused in one line naming what is supported."""
    family = find_family(config)
    if family is not None:
        return family.adapter
    from moepack.families.deepseek_v4.arch import ADAPTERS, v4_adapter  # DeepSeek-V4: not in the table yet

    adapter = v4_adapter(config)
    if adapter is None:
        supported = [t for a in ADAPTERS.values() for t in a.model_types] + [t for e in _FAMILIES
                                                                              for t in e.model_types]
        raise MoepackError(f"unsupported architecture: model_type {config.get('model_type')!r} (supported: "
                           f"{', '.join(supported)})")
    return adapter


def schema_problem(family: ModelFamily, config: Mapping[str, Any], experts_per_layer: Mapping[int, int],
                   shapes: Mapping[str, list[int]]) -> str | None:
    """Why a model's layers and tensors are not what its config.json implies for `family`, or None: the config
    read by the family, each layer holding the config's expert count (none in a dense-MLP layer), every tensor the
    config implies present with its shape (`shapes`: name -> logical shape, a weight's scale companions left out)
    and no other. The converter asks it of a checkpoint before writing, `moepack verify` of a container."""
    try:
        parsed = family.parse_config(config)
    except MoepackError as e:
        return f"config.json is not a usable {family.name} config ({e})"
    shape = family.shape(parsed)
    if len(experts_per_layer) != shape.num_layers:
        return f"{len(experts_per_layer)} layers, the config implies {shape.num_layers}"
    for layer in range(shape.num_layers):
        want = shape.num_experts if layer in shape.moe_layers else 0
        if experts_per_layer.get(layer, 0) != want:
            return f"layers.{layer} holds {experts_per_layer.get(layer, 0)} experts, the config implies {want}"
    expected = {spec.name: list(spec.shape) for spec in family.tensor_specs(parsed)}
    for name, want in expected.items():
        if name not in shapes:
            return f"tensor {name} is missing (the config implies {want})"
        if list(shapes[name]) != want:
            return f"tensor {name} has shape {list(shapes[name])}, the config implies {want}"
    extra = sorted(set(shapes) - set(expected))
    if extra:
        return (f"tensor {extra[0]} is not one a {family.name} config implies"
                + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    return None


def container_problem(container) -> tuple[ModelFamily | None, str | None]:
    """(the family of an open container's model, or None for DeepSeek-V4's; schema_problem of what it holds)."""
    from moepack.format_spec.layout import SCALE_SUFFIXES

    family = family_of_architecture(container.architecture)
    if family is None:
        return None, None
    experts = {b.number: len(b.experts) for b in container.layers}
    shapes = {n: list(t.shape) for n, t in container.tensors.items() if not n.endswith(SCALE_SUFFIXES)}
    return family, schema_problem(family, container.config, experts, shapes)
