"""Model families: each architecture in its own package behind one small protocol (families/base.py).

`family_for(config)` picks the family of a config.json by its `architectures` (else its `model_type`); an unknown
one is refused in one line naming what is supported. The table below names each family's package without
importing it, so looking a family up costs no torch import. Every family here implements base.RegisteredFamily:
what runs a container asks its family (`check_container`), not which one it is.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import pkgutil
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moepack.format_spec.adapter import Adapter
from moepack.format_spec.errors import MoepackError

from .base import ModelFamily, RegisteredFamily, family_kv_format


class UnknownFamilyError(MoepackError):
    """A config.json of an architecture no family here implements."""


_SHOW = reprlib.Repr()  # a hostile value named in an error, shortened (as the families' config readers do)
_SHOW.maxstring = _SHOW.maxother = 40
_SHOW.maxlist = _SHOW.maxtuple = _SHOW.maxdict = 6


@dataclass(frozen=True)
class _Entry:
    """A family as its package's family.json names it: looked up without importing the package (which may import
    torch), imported when chosen."""

    name: str
    architectures: tuple[str, ...]  # config.json `architectures` it accepts
    model_types: tuple[str, ...]  # config.json `model_type` it accepts (a container's architecture)
    gguf_architectures: tuple[str, ...]  # llama.cpp's names of it (a GGUF's general.architecture)
    module: str  # the package whose FAMILY is the family
    default: bool = False  # the family a command takes when none is named (`synth --family`); one has it
    synth_presets: tuple[str, ...] = ()  # `moepack synth`'s presets of it (its synth module's PRESETS)
    synth_release_layout: str = ""  # what `synth --layout release` writes of it, in words

    @property
    def family(self) -> RegisteredFamily:
        family = importlib.import_module(self.module).FAMILY
        if (family.name, family.architectures, family.model_types, family.gguf_architectures) != (
                self.name, self.architectures, self.model_types, self.gguf_architectures):
            raise MoepackError(f"{self.module}: its FAMILY is not what its family.json says")
        return family


@functools.cache
def _families() -> tuple[_Entry, ...]:
    """Every family: each package in this one with a family.json, in the packages' order."""
    entries = []
    for m in pkgutil.iter_modules(__path__):
        path = os.path.join(m.module_finder.path, m.name, "family.json")
        if m.ispkg and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
            entries.append(_Entry(d["name"], tuple(d["architectures"]), tuple(d["model_types"]),
                                  tuple(d["gguf_architectures"]), f"{__name__}.{m.name}", d.get("default", False),
                                  tuple(d.get("synth_presets", ())), d.get("synth_release_layout", "")))
    if sum(e.default for e in entries) != 1:
        raise MoepackError(f"{__name__}: exactly one family.json must say \"default\": true")
    return tuple(entries)


def family_entries() -> tuple[_Entry, ...]:
    """Every family as its family.json describes it (name, architectures, synth presets, ...), nothing imported."""
    return _families()


def __getattr__(name: str):
    if name == "FAMILY_NAMES":  # what `--family` takes
        return tuple(f.name for f in _families())
    if name == "GGUF_ARCHITECTURES":  # the GGUF architectures (llama.cpp's names) the families read
        return tuple(sorted(a for f in _families() for a in f.gguf_architectures))
    if name == "DEFAULT_FAMILY":  # the family a command takes when none is named
        return next(f.name for f in _families() if f.default)
    if name == "SYNTH_PRESETS":  # what `synth --preset` takes: every family's presets, each once
        return tuple(dict.fromkeys(p for f in _families() for p in f.synth_presets))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _entry_named(name: str) -> _Entry:
    entry = next((e for e in _families() if e.name == name), None)
    if entry is None:
        raise UnknownFamilyError(f"unknown model family {name!r} (supported: "
                                 f"{', '.join(f.name for f in _families())})")
    return entry


def family_named(name: str) -> ModelFamily:
    """The family `name` (as `--family` spells it)."""
    return _entry_named(name).family


def family_synth(name: str):
    """The synthetic-checkpoint module of the family `name` (its package's synth.py; families/synthetic.py says
    what it holds)."""
    return importlib.import_module(f"{_entry_named(name).module}.synth")


def _entry_of(config: Mapping[str, Any]) -> tuple[_Entry | None, list[str], Any]:
    """(the entry whose `architectures` or `model_type` the config names, or None; its architectures; its
    model_type)."""
    config = config if isinstance(config, Mapping) else {}
    architectures = config.get("architectures")
    names = [a for a in architectures if isinstance(a, str)] if isinstance(architectures, list) else []
    model_type = config.get("model_type")
    entry = next((e for e in _families() if any(a in e.architectures for a in names) or model_type in e.model_types),
                 None)
    return entry, names, model_type


def find_family(config: Mapping[str, Any]) -> ModelFamily | None:
    """The family of a config.json, or None when it is no family's here."""
    entry = _entry_of(config)[0]
    return entry.family if entry is not None else None


def family_for(config: Mapping[str, Any]) -> ModelFamily:
    """The family of a config.json: one whose `architectures` or `model_type` it names."""
    entry, names, model_type = _entry_of(config)
    if entry is not None:
        return entry.family
    what = (f"architectures {names}" if names else f"model_type {model_type!r}" if isinstance(model_type, str)
            else "no architectures or model_type")
    supported = "; ".join(f"{e.name} ({', '.join(e.architectures + e.model_types)})" for e in _families())
    raise UnknownFamilyError(f"config.json: {what[:200]} is no model family moepack.families knows (supported: "
                             f"{supported})")


def _family_where(matches) -> ModelFamily | None:
    entry = next((e for e in _families() if matches(e)), None)
    return entry.family if entry is not None else None


def family_of_architecture(architecture: str) -> ModelFamily | None:
    """The family whose adapter writes a container's `architecture` (its model_type), or None (no family's)."""
    return _family_where(lambda e: architecture in e.model_types)


def kv_format_for(architecture: str):
    """The KV directory format (base.KVFormat) of a model `architecture` (a container's, or a KV manifest's): its
    family's; a model of no family, or a family without one, is refused in one line."""
    family = family_of_architecture(architecture)
    if family is None:
        raise MoepackError(f"its model ({architecture!r}) is of no model family moepack knows "
                           f"(supported: {', '.join(e.name for e in _families())})")
    kv_format = family_kv_format(family)
    if kv_format is None:
        raise MoepackError(f"a {family.name} model has no KV directory format (--kv-out, --continue-from)")
    return kv_format


def family_of_gguf(architecture: Any) -> ModelFamily | None:
    """The family whose llama.cpp architecture a GGUF's general.architecture names, or None."""
    return _family_where(lambda e: architecture in e.gguf_architectures)


def adapter_for(config: Mapping[str, Any]) -> Adapter:
    """The container layout (format_spec.adapter.Adapter) of a config.json's model: its family's; any other
    architecture (or a model_type that is no string) is refused in one line naming what is supported."""
    model_type = config.get("model_type") if isinstance(config, Mapping) else None
    if model_type is not None and not isinstance(model_type, str):
        raise MoepackError(f"config.json: model_type must be a string, not {_SHOW.repr(model_type)}")
    family = find_family(config)
    if family is None or (model_type is not None and model_type not in family.model_types):  # a contradiction
        supported = sorted(t for e in _families() for t in e.model_types)
        raise MoepackError(f"unsupported architecture: model_type {model_type!r} (supported: "
                           f"{', '.join(supported)})")
    return family.adapter_for(config)


def container_family(container) -> RegisteredFamily:
    """The family of an open container's model; another architecture is refused in one line."""
    family = family_of_architecture(container.architecture)
    if family is None:
        supported = ", ".join(f"{e.name} ({', '.join(e.model_types)})" for e in _families())
        raise MoepackError(f"{container.path} holds a {container.architecture!r} model; this runtime computes "
                           f"{supported} containers here")
    return family


def check_container(container, computable: bool = True) -> tuple[RegisteredFamily, Any]:
    """(the family of an open container's model, its parsed config), checked before anything is read (the family's
    check_container): a one-line MoepackError naming the container otherwise."""
    family = container_family(container)
    return family, family.check_container(container, computable)


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


_INTEGER_TYPES = frozenset({"I64", "I32", "I16", "I8", "U8", "BOOL"})


def value_type_problem(family: ModelFamily, types: Mapping[str, str]) -> str | None:
    """The first tensor (`types`: name -> storage type) stored in a type of other values than the model reads from
    it, or None: an integer type for a weight (its bits read as numbers, a norm of billions, or a matmul of int16
    and float refused half-way), a float type for a table the family reads as integers (its integer_tensors)."""
    for name, type_name in types.items():
        wants_integers = name.endswith(family.integer_tensors)
        if wants_integers != (type_name in _INTEGER_TYPES):
            return (f"tensor {name} is stored as {type_name}, not a{'n integer' if wants_integers else ' float'} "
                    f"type as the model reads it")
    return None


def container_schema_problem(family: ModelFamily, container) -> str | None:
    """schema_problem of what an open container holds, for `family` (a family's check_container asks it)."""
    from moepack.format_spec.layout import SCALE_SUFFIXES

    experts = {b.number: len(b.experts) for b in container.layers}
    shapes = {n: list(t.shape) for n, t in container.tensors.items() if not n.endswith(SCALE_SUFFIXES)}
    return (schema_problem(family, container.config, experts, shapes)
            or value_type_problem(family, {n: t.dtype for n, t in container.tensors.items()}))
