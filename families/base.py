"""The boundary between a model family and what runs it (issue 39).

A family is one architecture (Qwen3-MoE; DeepSeek-V4 once it moves here from moepack.v4): what its config says,
which tensors a config implies under which names, and the short torch functions of its forward. What runs a model
(the engine, the read scheduler, the expert backends, decode) is to hold no family's names: it asks the family.
The protocol is deliberately small, so a third family (gpt-oss, DeepSeek-V3) is one package, not twenty edits.

Nothing here imports torch at module level: the registry (moepack.families.family_for) is read by commands
that never compute.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import Tensor

    from moepack.format_spec.adapter import Adapter

# A tensor's role says how a runtime treats it (where it is read, whether a policy may quantize it).
ROLE_EMBED = "embed"
ROLE_HEAD = "head"
ROLE_NORM = "norm"
ROLE_ATTENTION = "attention"  # the attention's linears
ROLE_ROUTER = "router"
ROLE_DENSE_FFN = "dense_ffn"  # a layer's FFN that is not routed experts (a shared expert, a dense MLP)
ROLE_EXPERT = "expert"  # one routed expert's matrix: streamed
ROLES = (ROLE_EMBED, ROLE_HEAD, ROLE_NORM, ROLE_ATTENTION, ROLE_ROUTER, ROLE_DENSE_FFN, ROLE_EXPERT)


@dataclass(frozen=True)
class MoeShape:
    """The facts about a family's config that what runs it needs, whatever the family: how many layers and
    experts, how many chosen per token, which layers choose by token id (hash layers) and which have no experts,
    and the FFN's shape (a routed expert is gate/up [expert_intermediate, hidden], down [hidden, expert_intermediate])."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    num_experts: int
    top_k: int
    expert_intermediate: int
    moe_layers: tuple[int, ...]  # layers with routed experts, ascending
    hash_layers: tuple[int, ...] = ()  # layers whose experts come from the token ids (DeepSeek-V4's tid2eid)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """Layers whose FFN is one dense MLP: nothing to stream."""
        return tuple(layer for layer in range(self.num_layers) if layer not in self.moe_layers)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor a config implies. `name` is the transformers (and Hugging Face release) name, the family's
    canonical one; `gguf` is llama.cpp's name for it (a routed expert's: the layer's stacked `*_exps` tensor, which
    holds every expert's matrix; None where llama.cpp's architecture has no such tensor). `layer` / `expert` place
    it (None for the globals / for everything but a routed expert)."""

    name: str
    shape: tuple[int, ...]
    role: str
    gguf: str | None
    layer: int | None = None
    expert: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


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


@dataclass(frozen=True)
class GGUFModel:
    """What a family's model is in llama.cpp: its GGUF architecture, the hyperparameter keys (key, kind, value;
    kind a gguf-py writer's add_<kind>: uint32, float32, bool, string, array) and the tokenizer's pre-tokenizer
    name (with its regexes, which a GGUF does not carry). The tensors' names are the TensorSpecs' `gguf`."""

    architecture: str
    keys: tuple[tuple[str, str, Any], ...]
    tokenizer_pre: str
    tokenizer_splits: tuple[str, ...] = ()  # that pre-tokenizer's regexes before the byte-level step (GGUF import)


@dataclass
class Routing:
    """The router's choice for N tokens: `experts` [N, k] expert ids, `weights` [N, k] their combine weights."""

    experts: Tensor
    weights: Tensor


@runtime_checkable
class ModelFamily(Protocol):
    """What a family implements. `config` is the family's own parsed config (from `parse_config`); a layer's
    weights are a dict from the tensor's name inside its layer (the family's choice) to the float tensor; a routed
    expert's weights are {"gate", "up", "down"} -> tensor, as ExpertNaming.names lists them."""

    name: str  # what `--family` and error messages call it, e.g. "qwen3-moe"
    architectures: tuple[str, ...]  # config.json `architectures` it accepts
    model_types: tuple[str, ...]  # config.json `model_type` it accepts
    expert_naming: ExpertNaming
    adapter: Adapter  # its checkpoint's names onto the container's read order (what `moepack convert` writes)

    def parse_config(self, raw: Mapping[str, Any]) -> Any:
        """The config.json as this family reads it; a bad field is a one-line MoepackError naming it."""
        ...

    def shape(self, config: Any) -> MoeShape:
        ...

    def tensor_specs(self, config: Any) -> list[TensorSpec]:
        """Every tensor the config implies, with its shape: what a loader checks a checkpoint against."""
        ...

    def source_tensors(self, raw: Mapping[str, Any]) -> list[tuple[str, list[tuple[str, str, tuple[int, ...]]]]]:
        """Per tensor of the schema (its name), what a release checkpoint of this config.json stores for it:
        [(name, safetensors dtype, shape)] (a quantized release's weight and its scales): `moepack plan` sizes a
        conversion from the config alone with it."""
        ...

    def attention_flops(self, config: Any, n_tokens: int) -> dict[str, float]:
        """The attention's FLOPs per token of an n_tokens prefill, over the layers (scores and weighted sum):
        {"window": bounded by a window, "growing": growing with N, "total"}."""
        ...

    def kv_bytes(self, config: Any, n_tokens: int, element_bytes: int) -> int:
        """One layer's KV after n_tokens (the largest layer's), at element_bytes per value."""
        ...

    def gguf_model(self, config: Any) -> GGUFModel:
        """The model as llama.cpp's architecture for this family; a config it would compute differently is a
        one-line MoepackError naming why."""
        ...

    def config_from_gguf(self, keys: Mapping[str, Any], vocab_size: int, tied: bool) -> dict:
        """The config.json of a GGUF of the family's llama.cpp architecture: its keys (without the architecture's
        prefix), the embedding's rows, whether the head is the embedding (no `output.weight`)."""
        ...

    def new_kv(self, config: Any) -> Any:
        """An empty KV state: a prefill fills it, a later token continues it."""
        ...

    def embed(self, config: Any, globals_: Mapping[str, Tensor], ids: Tensor) -> Tensor:
        ...

    def before_experts(self, config: Any, layer: int, weights: Mapping[str, Tensor], hidden: Tensor, kv: Any
                       ) -> tuple[Tensor, Tensor, Routing | None]:
        """A layer's work up to the routed experts: returns (residual, the experts' input, the routing; None for a
        layer without routed experts, whose FFN `after_experts` computes)."""
        ...

    def expert_ffn(self, config: Any, expert: Mapping[str, Tensor], x: Tensor) -> Tensor:
        """One routed expert's output on rows x: its activation is the family's (plain SwiGLU in Qwen3-MoE, a
        clamped one in DeepSeek-V4), so an expert backend computes whatever family it is given."""
        ...

    def after_experts(self, config: Any, layer: int, weights: Mapping[str, Tensor], residual: Tensor,
                      ffn_input: Tensor, expert_out: Tensor | None) -> Tensor:
        """The layer's output hidden state from the combined experts' output (or its own dense FFN)."""
        ...

    def head(self, config: Any, globals_: Mapping[str, Tensor], hidden: Tensor) -> Tensor:
        """Final norm and LM head: logits [N, vocab] float32."""
        ...

    def chat_template(self, tokenizer_config: Mapping[str, Any]) -> str | None:
        """The chat template a checkpoint's tokenizer_config carries, or None."""
        ...


def chat_template_from_tokenizer_config(tokenizer_config: Mapping[str, Any]) -> str | None:
    """tokenizer_config.json's `chat_template`: a Jinja string, or (transformers' older form) a list of
    {"name", "template"} whose "default" entry is the chat template. None when it has none."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, Sequence):
        for entry in template:
            if isinstance(entry, Mapping) and entry.get("name") == "default" and isinstance(entry.get("template"), str):
                return entry["template"]
    return None


# ------------------------------------------------------------------------------------------------------------------
# Running a family's container: decode, generation, serving (h-famdecode)
#
# What runs a family over a container (runtime/decode.py, runtime/generate.py) needs two things ModelFamily leaves
# open: the weights under the family's own keys (ContainerWeights: the container's tensors, decoded, by their
# stored names -> what embed / before_experts / after_experts / head take), and a KV state it can hand from the
# prefill to the decode: a family's KV state (new_kv) holds `layers`, a list of one state per layer, each with
# `seen_tokens`. A prefill hands on that state or its list of layers; a decode continues it in place.


@runtime_checkable
class ContainerWeights(Protocol):
    """A family's weights from a container's tensors (`named`: stored name -> float tensor, scales folded in)."""

    def layer_weights(self, config: Any, layer: int, named: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Layer `layer`'s non-expert weights, by the names before_experts / after_experts read."""
        ...

    def global_weights(self, config: Any, named: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The globals embed / head read (a tied head: the embedding)."""
        ...


def family_kv_state(family: ModelFamily, config: Any, states: Any) -> Any:
    """The family's KV state from what a prefill hands on: the state itself (it has `layers`), or its list of
    per-layer states (wrapped in a new_kv state)."""
    if hasattr(states, "layers"):
        return states
    kv = family.new_kv(config)
    kv.layers[:] = list(states)
    return kv


def generation_kv_bytes(family: ModelFamily, config: Any, n_tokens: int, element_bytes: int) -> int:
    """Every layer's KV after n_tokens (kv_bytes is the largest layer's: an upper bound)."""
    return family.shape(config).num_layers * family.kv_bytes(config, n_tokens, element_bytes)
