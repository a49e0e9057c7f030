"""The boundary between a model family and what runs it (issue 39).

A family is one architecture (Qwen3-MoE, families/qwen3_moe; DeepSeek-V4, families/deepseek_v4): what its config
says, which tensors a config implies under which names, and the short torch functions of its forward. What runs a
model (the engine, the read scheduler, the expert backends, decode) is to hold no family's names: it asks the family.
The protocol is deliberately small, so a third family (gpt-oss, DeepSeek-V3) is one package, not twenty edits.

Nothing here imports torch at module level: the registry (moepack.families.family_for) is read by commands
that never compute.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from moepack.backends.expert_naming import ExpertNaming
from moepack.format_spec.errors import MoepackError

if TYPE_CHECKING:
    from torch import Tensor

    from moepack.format_spec.adapter import Adapter

# Every layer's routed experts together, MTP layers included (the largest releases hold about 25,000): `plan`, `convert`
# and the checks list each expert's tensors, so a config past it (2^31 experts in 4 layers) had run for hours.
MAX_ROUTED_EXPERTS = 1 << 17

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


GGUF_QUANT_VERSION = 2  # general.quantization_version of ggml's current block layouts


@dataclass(frozen=True)
class GGUFModel:
    """What a family's model is in llama.cpp: its GGUF architecture, the hyperparameter keys (key, kind, value;
    kind a gguf-py writer's add_<kind>: uint32, float32, bool, string, array) in the order they are written, and the
    tokenizer's pre-tokenizer name. Keys without `general.file_type` get it (after the routed experts' GGUF type)
    and `general.quantization_version` appended by the writer; a family that fixes them lists both.
    `chat_template`: the template written for a tokenizer that carries none (None: none written)."""

    architecture: str
    keys: tuple[tuple[str, str, Any], ...]
    tokenizer_pre: str
    chat_template: Callable[[], str] | None = None


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a family's GGUF: llama.cpp's `name` and the container tensors it is made of, one, or (stacked)
    a layer's routed experts' matrix in expert-ID order, stacked [n_experts, out, in]. The family names them; the
    packer moves the bytes (its types, quantization, stacking)."""

    name: str
    sources: tuple[str, ...]
    stacked: bool = False


def schema_gguf_tensors(family: ModelFamily, config: Any, architecture: str) -> list[GGUFTensor]:
    """The GGUF tensors (of llama.cpp's `architecture`) of a family's parsed config from its schema
    (TensorSpec.gguf), in the schema's order: a layer's routed experts stacked per matrix (the family's
    ExpertNaming) where expert 0 lies."""
    out = []
    n_experts = family.shape(config).num_experts
    for spec in family.tensor_specs(config):
        if spec.gguf is None:
            raise MoepackError(f"tensor {spec.name} has no name in llama.cpp's {architecture}")
        if spec.role != ROLE_EXPERT:
            out.append(GGUFTensor(spec.gguf, (spec.name,)))
        elif spec.expert == 0:
            matrix = next(m for m, n in family.expert_naming.names(spec.layer, 0).items() if n == spec.name)
            out.append(GGUFTensor(spec.gguf, tuple(family.expert_naming.names(spec.layer, e)[matrix]
                                                   for e in range(n_experts)), stacked=True))
    return out


class ExpertTokens(NamedTuple):
    token_index: Tensor  # [n] LongTensor, ascending
    weight: Tensor  # [n] routing weights


@dataclass
class ExpertGroups:
    """A layer's (token, expert) pairs sorted by expert, then token: the experts' inputs are gathered with one
    index_select, expert e's pairs are rows spans[e], and each token's top_k rows are summed back with their
    routing weights (combine)."""

    token_index: Tensor  # [P] LongTensor
    weight: Tensor  # [P] routing weights
    spans: dict[int, tuple[int, int]]  # expert id -> its rows [start, stop), in ascending expert id
    token_rows: Tensor  # [N, top_k] each token's pair rows, ascending (= ascending expert id)

    def gather(self, x: Tensor) -> Tensor:
        """x [N, H] -> [P, H], each pair's token row."""
        import torch

        return torch.index_select(x, 0, self.token_index)

    def combine(self, outputs: Tensor, n_tokens: int) -> Tensor:
        """[P, H] expert outputs (rows of pairs whose expert did not run must be zero) -> the weighted sum per
        token [N, H] float32, each token's terms added in ascending expert id: one [N, H] gather per top-k slot,
        never a [P, H] temporary (at N = 2048 one of 50 MB, fresh pages every layer: 17 ms against 2.4 ms)."""
        import torch

        acc = torch.zeros(n_tokens, outputs.shape[1], dtype=torch.float32, device=outputs.device)
        for rows in self.token_rows.T:
            acc.addcmul_(outputs.index_select(0, rows).float(), self.weight[rows, None].float())
        return acc


@dataclass
class Routing:
    """The router's choice for N tokens: `experts` [N, k] expert ids, `weights` [N, k] their combine weights;
    `x` [N, H] the rows the experts multiply (an expert backend's input; None where only the choice is asked).
    A layer without routed experts routes nothing: `experts` and `weights` None, `x` its FFN's input.
    `prompt_ends`: in a pass of several prompts (their rows concatenated), where each prompt's rows end; an
    expert backend whose kernel depends on an expert's token count counts each prompt's own (None: one prompt)."""

    experts: Tensor | None
    weights: Tensor | None
    x: Tensor | None = None
    prompt_ends: list[int] | None = field(default=None, init=False)
    _groups: ExpertGroups | None = field(default=None, init=False, repr=False)
    _by_expert: dict[int, ExpertTokens] | None = field(default=None, init=False, repr=False)

    def groups(self) -> ExpertGroups:
        """The pairs sorted by expert (once per layer); an expert backend runs the experts in this order as their
        bytes arrive."""
        if self._groups is None:
            import torch

            top_k = self.experts.shape[1]
            flat = self.experts.reshape(-1)
            order = torch.argsort(flat, stable=True)  # stable: tokens stay ascending within an expert
            ids, counts = torch.unique_consecutive(flat[order], return_counts=True)
            stops = counts.cumsum(0).tolist()
            spans = {int(e): (stop - n, stop) for e, n, stop in zip(ids.tolist(), counts.tolist(), stops)}
            row_of_pair = torch.empty_like(order)
            row_of_pair[order] = torch.arange(order.numel(), device=order.device)
            token_rows = row_of_pair.view(-1, top_k).sort(dim=1).values
            self._groups = ExpertGroups(order // top_k, self.weights.reshape(-1)[order], spans, token_rows)
        return self._groups

    def tokens_by_expert(self) -> dict[int, ExpertTokens]:
        """{expert id: (token indices, weights)} for every expert some token chose, in ascending expert id."""
        if self._by_expert is None:
            g = self.groups()
            self._by_expert = {e: ExpertTokens(g.token_index[a:b], g.weight[a:b]) for e, (a, b) in g.spans.items()}
        return self._by_expert


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
    head_tensor: str  # the LM head's container name, stored where config.json does not tie it to the embedding
    integer_tensors: tuple[str, ...]  # name endings of the tensors read as integers (a hash routing table), not floats

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

    def gguf_model(self, config: Mapping[str, Any]) -> GGUFModel:
        """The model of a config.json as llama.cpp's architecture for this family; a config it would compute
        differently is a one-line MoepackError naming why."""
        ...

    def gguf_tensors(self, config: Mapping[str, Any], names: Sequence[str] | None) -> list[GGUFTensor]:
        """The tensors of the GGUF of a config.json's model, in the order they are written, from a container
        holding tensors `names` (in its order, scale companions included); None: the tensors of the family's
        schema (what a GGUF's tensors are read back as). A tensor it cannot name is a one-line MoepackError."""
        ...

    def config_from_gguf(self, keys: Mapping[str, Any], vocab_size: int, tied: bool,
                         tensors: Collection[str] = ()) -> dict:
        """The config.json of a GGUF of the family's llama.cpp architecture: its keys (without the architecture's
        prefix), the embedding's rows, whether the head is the embedding (no `output.weight`), the GGUF's tensor
        names."""
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

    def layer_prefill(self, config: Any, compute_dtype: Any) -> LayerPrefill:
        """The layer-major prefill's arithmetic for `config` (LayerPrefill, below), its matrices in
        `compute_dtype` (a torch dtype)."""
        ...


def chat_template_from_tokenizer_config(tokenizer_config: Mapping[str, Any]) -> str | None:
    """tokenizer_config.json's `chat_template`: a Jinja string, or (transformers' older forms) a list of
    {"name", "template"} or a {name: template} object, whose "default" entry is the chat template. None when it
    has none; a MoepackError naming what is there when it is none of these (transformers refuses it too)."""
    template = tokenizer_config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    named = None
    if isinstance(template, list) and all(isinstance(e, Mapping) and "name" in e for e in template):
        named = {e["name"]: e.get("template") for e in template}
    elif isinstance(template, Mapping):
        named = template
    if named is not None and isinstance(named.get("default"), str):
        return named["default"]
    what = "named templates without a 'default' one" if named is not None else \
        f"expected a Jinja text or named templates, got {type(template).__name__}"
    raise MoepackError(f"tokenizer_config.json chat_template: {what}")


# ---------------------------------------------------------------------------------------------------------------
# The layer-major prefill's protocol (runtime/engine.py StreamingPrefill; issue 39). A family's
# `layer_prefill(config, compute_dtype)` gives one LayerPrefill: the engine reads, decodes and streams, the
# LayerPrefill computes. A layer's state (its KV) is whatever the family keeps; the engine only hands it back.
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillNames:
    """The container's names the engine reads outside the layers."""

    embedding: str  # the embedding matrix [vocab, H]: only the prompt's rows are decoded
    head: str  # the LM head's matrix [vocab, H] (the embedding's name where tied), applied a slice of rows at a time
    head_globals: tuple[str, ...]  # the head's other weights (final norm, ...), decoded whole: head_input's
    tied: bool  # the head is the embedding (its bytes, read for the prompt's rows, serve the head too)


@runtime_checkable
class LayerPrefill(Protocol):
    """One prefill's arithmetic, layer by layer, for the engine (runtime/engine.py). The engine holds a layer's
    dense weights `w` (decoded, keyed by name after `layer_prefix(layer)`), the hidden rows of every prompt of the
    pass, and per prompt and layer the state `attention` returned; it calls, per layer:

        hidden, state = attention(layer, w, hidden[a:b], positions, past, ...)   per prompt's rows [a, b)
        routing = route(layer, w, hidden, token_ids)                               every row at once
        routed = the expert backend on routing (a layer in shape.moe_layers), beside = beside_experts(...)
        hidden = finish(layer, w, hidden, routing, routed, beside, into)

    then head_input on the last rows, multiplied by the head matrix."""

    config: Any  # the family's parsed config
    shape: MoeShape
    names: PrefillNames
    expert_naming: ExpertNaming  # a routed expert's matrices by their names in the container
    # the per-expert backend's expert (x, gate, up, down) -> rows; None: that backend's own compiled kernels,
    # which compute DeepSeek-V4's experts (runtime/expert_decode.py), the family then giving their arithmetic:
    expert_ffn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor] | None
    # (x, gate, up, down, hidden_order) -> rows on decoded matrices; None where expert_ffn is given
    expert_forward: Callable[..., Tensor] | None
    # the clamp of the SwiGLU the compiled expert kernels compute (the fused FP4 prefill kernel, the decode's token
    # kernel); None: those kernels do not compute this family's experts
    expert_limit: float | None

    def layer_prefix(self, layer: int) -> str:
        """What the container's names of layer `layer`'s dense weights start with (stripped from `w`'s keys)."""
        ...

    def in_compute_dtype(self, name: str, ndim: int) -> bool:
        """Whether dense weight `name` (inside its layer) is decoded in the compute dtype (else float32)."""
        ...

    def hidden_from_embeddings(self, rows: Tensor) -> Tensor:
        """The first layer's input from the prompt's embedding rows [N, H] float32."""
        ...

    def hash_table(self, layer: int, w: Mapping[str, Tensor]) -> Tensor:
        """A hash layer's (shape.hash_layers) token id -> experts table [vocab, top_k]: its reads start before
        its attention."""
        ...

    def seen_tokens(self, state: Any) -> int:
        """The tokens a layer's state covers: a continued prompt's next position."""
        ...

    def attention(self, layer: int, w: Mapping[str, Tensor], hidden: Tensor, positions: Tensor, past: Any,
                  query_chunk: int | None, into: Tensor | None, between_chunks: Callable[[], None] | None
                  ) -> tuple[Tensor, Any]:
        """One prompt's rows through the layer's attention (with its residual) at `positions` (arange(P, P + n),
        P = seen_tokens(past), 0 without a past): (the new rows, written into `into` where given; the layer's
        state covering the P + n tokens). `past` is not changed. `between_chunks()` runs between query chunks."""
        ...

    def route(self, layer: int, w: Mapping[str, Tensor], hidden: Tensor, token_ids: Tensor) -> Routing:
        """Every row's FFN input (`x`) and, in a layer of shape.moe_layers, its router's choice."""
        ...

    def beside_experts(self, layer: int, w: Mapping[str, Tensor], routing: Routing) -> tuple | None:
        """(fn, args): the layer's work that needs only the routing (a shared expert), run beside the routed
        experts, its result finish's `beside`; None: none."""
        ...

    def finish(self, layer: int, w: Mapping[str, Tensor], hidden: Tensor, routing: Routing, routed: Tensor | None,
               beside: Any, into: Tensor | None) -> Tensor:
        """The layer's output rows from the routed experts' combined output [N, H] float32 (None in a layer
        without routed experts) and beside_experts' result (None where it did not run: finish computes it);
        written into `into` where given."""
        ...

    def head_input(self, w_globals: Mapping[str, Tensor], hidden: Tensor, rows: Tensor) -> Tensor:
        """The LM head's input [len(rows), H] of the positions `rows` (names.head_globals in `w_globals`)."""
        ...

    def expert_activation(self, gate: Tensor, up: Tensor) -> Tensor:
        """Between a routed expert's two GEMMs (the grouped backend): act(gate x) * (up x)."""
        ...

    def preferred_query_chunk(self, device: Any) -> int:
        """Queries per attention chunk this device runs best (what the memory estimate assumes)."""
        ...

    def working_set(self, n_tokens: int, query_chunk: int, device: Any = None) -> dict[str, int]:
        """Bytes of a prefill of n_tokens on `device` (None: its reference arithmetic) besides the weights and the
        routed experts' rows, by component: {"activations", "kv", "attention_chunk"} (generous: it decides whether
        to refuse a prompt)."""
        ...

    def close(self) -> None:
        """Drop what was kept for this prompt (tables of its positions)."""
        ...


def check_finite(hidden: Tensor, layer: int) -> Tensor:
    """`hidden` (a layer's output), unless it holds a NaN or an infinity: then a one-line error naming the layer (the
    first one, as every layer is checked). One sum decides (any NaN or infinity makes it so; 9 ms for
    [4096, 4, 4096] where isfinite().all() takes 370); only a sum that overflowed finite values looks further."""
    import torch

    if not bool(torch.isfinite(hidden.sum())) and not bool(torch.isfinite(hidden).all()):
        raise not_finite(layer)
    return hidden


def not_finite(layer: int) -> MoepackError:
    """check_finite's error for `layer` (for a caller that checked the rows itself)."""
    return MoepackError(f"layer {layer}: its output is not finite (NaN or infinity): a weight, or the KV "
                        "continued, holds such values (moepack verify checks the container's)")


# ---------------------------------------------------------------------------------------------------------------
# A family's KV directory (format_spec/KV.md). The directory's container part (manifest, identity, tokens,
# storage dtype, checksums, atomic writes, the reader's checks) is families/kv_directory.py's, the same for every
# family; what one layer's file holds is the family's KVFormat. A family that writes KV directories has
# `kv_format` (family_kv_format gives it, or None).
# ---------------------------------------------------------------------------------------------------------------


@runtime_checkable
class KVFormat(Protocol):
    """How one layer's KV state (what the family's prefill hands on) is stored in a KV directory's layer file and
    read back. `geometry` is the manifest's: the shape facts of the config the tensors depend on (`num_layers`
    at least); `dtype` the manifest's storage dtype (F32, BF16, F8_E4M3: kv_directory.encode_rows) of the
    attended-over tensors."""

    entry_fields: tuple[str, ...]  # the fields a complete layer's manifest entry records before bytes and xxh3

    def geometry(self, config: Mapping[str, Any]) -> dict:
        """From a config.json; a FormatError (one line, naming the field) for one it cannot be read from."""
        ...

    def kv_bytes(self, config: Mapping[str, Any], n_tokens: int, dtype: str) -> int:
        """The tensor bytes of a KV of n_tokens (the writer's free-space check)."""
        ...

    def layer_kind(self, geometry: Mapping[str, Any], layer: int) -> str:
        """What layer `layer` is (`moepack kv inspect` groups by it)."""
        ...

    def seen_tokens(self, state: Any) -> int:
        ...

    def check_state(self, geometry: Mapping[str, Any], layer: int, state: Any) -> None:
        """A state that is not one of layer `layer` is a MoepackError (before anything is written)."""
        ...

    def layer_tensors(self, geometry: Mapping[str, Any], layer: int, state: Any, dtype: str
                      ) -> tuple[dict[str, Tensor], dict[str, str], dict[str, Any]]:
        """(the tensors stored, the file's own `__metadata__` entries, the manifest entry's fields (entry_fields))."""
        ...

    def entry_valid(self, geometry: Mapping[str, Any], layer: int, entry: Mapping[str, Any]) -> bool:
        """Whether a complete manifest entry's family fields are consistent with the geometry."""
        ...

    def layer_state(self, geometry: Mapping[str, Any], layer: int, entry: Mapping[str, Any],
                    tensors: Mapping[str, Tensor], dtype: str) -> Any:
        """The layer's state from its file's tensors (exactly the ones layer_tensors stores for the entry, else a
        FormatError naming the difference: kv_directory.check_tensors), float32 on the CPU."""
        ...

    def on_host(self, state: Any) -> Any:
        """The state in host memory (a copy where it is on a device): what a KV writer's queue holds."""
        ...

    def moved(self, state: Any, device: Any, dtype: Any) -> Any:
        """The state on `device` in float `dtype` (a reader's choice)."""
        ...


def family_kv_format(family: Any) -> KVFormat | None:
    """A family's KVFormat, or None where it writes no KV directories."""
    return getattr(family, "kv_format", None)


# ---------------------------------------------------------------------------------------------------------------
# Registered families: what the commands ask a family beside ModelFamily, so that nothing outside
# families/ tells the families apart by name. Every family in moepack.families' table implements RegisteredFamily.
# ---------------------------------------------------------------------------------------------------------------


@runtime_checkable
class RegisteredFamily(ModelFamily, Protocol):
    """ModelFamily plus the questions the converter, `moepack plan`, `verify` and the runtime ask a family."""

    gguf_architectures: tuple[str, ...]  # llama.cpp's names of it (a GGUF's general.architecture)
    # llama.cpp's pre-tokenizers (tokenizer.ggml.pre) of its tokenizers -> their regexes before the byte-level step
    # (a GGUF does not carry them; its import rebuilds tokenizer.json with them)
    gguf_pre_tokenizers: Mapping[str, tuple[str, ...]]

    # the family's own chat encoder (a module with check_reasoning_effort, encode_message_segments, THINK_END: a
    # chat rendered in code, its markup kept apart from the message text), or None: the chat template its
    # tokenizer_config carries (serve/chat_template.py renders it)
    chat_encoding: Any

    def adapter_for(self, config: Mapping[str, Any]) -> Adapter:
        """The container layout of a checkpoint of this config.json (its release's or transformers' names)."""
        ...

    def attention_kinds(self, config: Any) -> list[str]:
        """Per layer, its attention's kind as `moepack plan` prints it ("full", "sliding", ...)."""
        ...

    # what one layer's KV holds, as `moepack plan`'s memory budget names it ("KV", "KV + indexer KV")
    kv_label: str

    def residual_streams(self, config: Any) -> int:
        """How many residual streams the hidden state carries (1 for a plain residual)."""
        ...

    def check_container(self, container: Any, computable: bool = True) -> Any:
        """The parsed config of an open container's model, checked before anything is read: its config as the
        family reads it, its layers and every tensor its config implies with its shape; a one-line MoepackError
        naming the container otherwise (with `computable`, also a config this runtime would compute otherwise
        than the reference)."""
        ...

    def flops_per_token(self, config: Mapping[str, Any]) -> dict:
        """Matmul FLOPs (2 per multiply-add) one prompt token costs in the layers of a config.json's model, by
        part (flops_summary's dict: `moepack plan`'s); the LM head (and what precedes it) apart."""
        ...

    def checkpoint_problem(self, config: Mapping[str, Any], experts_per_layer: Mapping[int, int],
                           shapes: Mapping[str, list[int]]) -> str | None:
        """Why a checkpoint of this config.json would make a container `verify` and `prefill` refuse, found before
        the converter writes anything (schema_problem's arguments, its names the container's), or None."""
        ...

    def refusal(self, config: Mapping[str, Any]) -> str | None:
        """Why a prefill would refuse a model of this config.json though its sizes are sound, or None."""
        ...


def flops_summary(parts: dict[str, int], head: int) -> dict:
    """flops_per_token's dict from the FLOPs of the layers' parts and the head's."""
    total = sum(parts.values())
    return {"total": total, "routed": parts["routed_experts"], "head": head, "parts": parts,
            "active_params": total // 2, "active_params_with_head": (total + head) // 2}


ROLE_FLOP_PARTS = {ROLE_ATTENTION: "attention_projections", ROLE_ROUTER: "router", ROLE_DENSE_FFN: "dense_ffn"}


def role_flops_per_token(family: ModelFamily, config: Mapping[str, Any]) -> dict:
    """flops_per_token of a family's model from its tensor schema's roles: every layer's linears (a routed
    expert's top-k times), the LM head once per position whose logits are computed."""
    parsed = family.parse_config(config)
    shape = family.shape(parsed)
    parts = dict.fromkeys((*ROLE_FLOP_PARTS.values(), "routed_experts"), 0)
    head = 2 * shape.vocab_size * shape.hidden_size  # tied to the embedding or not, it multiplies
    for spec in family.tensor_specs(parsed):
        if len(spec.shape) != 2 or spec.layer is None or spec.role == ROLE_EMBED:
            continue
        if spec.role == ROLE_EXPERT:
            parts["routed_experts"] += 2 * spec.numel * shape.top_k if spec.expert == 0 else 0
        else:
            parts[ROLE_FLOP_PARTS[spec.role]] += 2 * spec.numel
    return flops_summary(parts, head)


def sum_entries(n: int, rate: int, cap: int | None = None) -> int:
    """sum over t in [0, n) of min(cap, (t+1)//rate), in closed form: the complete entries of a KV compressed
    every `rate` tokens that queries 0..n-1 see (capped at `cap` chosen ones)."""
    # positions p = t+1 in [1, n]; floor(p / rate) = e for p in [e*rate, (e+1)*rate)
    def plain(m: int) -> int:  # sum_{p=1..m} floor(p / rate)
        q, r = divmod(m, rate)
        return rate * q * (q - 1) // 2 + q * (r + 1)

    if cap is None:
        return plain(n)
    limit = cap * rate  # from p >= limit on, floor(p/rate) >= cap
    if n < limit:
        return plain(n)
    return plain(limit - 1) + cap * (n - limit + 1)


# ---------------------------------------------------------------------------------------------------------------
# The token-major decode's protocol (runtime/decode.py Decoder; issue 39). A family's
# `layer_decode(config, compute_dtype)` gives one LayerDecode, the decode's analogue of LayerPrefill (and a
# superset of it: its names, layer prefix, dtypes, embedding, hash tables, expert FFN and activation are the
# prefill's; each family's decode subclasses its prefill). The Decoder reads, caches and streams; the LayerDecode
# computes B rows of one step, one per sequence, each row over its own sequence's per-layer token state:
#
#     hidden = hidden_from_embeddings(embedding rows)
#     per layer:  attended = attend(layer, w, hidden, the rows' token states, graphs)
#                 hidden, routing = route_attended(layer, w, attended, token_ids)
#                 routed = the routed experts of `routing` (the expert runner, the pool, the token kernel)
#                 hidden = finish(layer, w, hidden, routing, routed, None, None)
#     logits = head(globals, hidden)
#
# A family may offer a compiled one-token path besides (token_layers / token_head / token_head_rows, DeepSeek-V4's
# families/deepseek_v4/token_layer.py); the Decoder uses it where it is offered and its kernels take the weights.
# ---------------------------------------------------------------------------------------------------------------


@runtime_checkable
class TokenPath(Protocol):
    """A family's compiled one-token path over fixed buffers (one row, or B rows in batched calls): the Decoder
    drives it layer by layer, the routed experts given as the token kernel's matrices (`flag`: its rounding)."""

    output: Tensor  # the last layer's output (one token)
    rows_output: Tensor  # the last layer's output (B rows)

    def begin(self, embedding: Tensor) -> None: ...

    def attention(self, layer: int, state: Any) -> None: ...

    def route(self, layer: int, hash_ids: list[int] | None) -> dict[int, float]:
        """The token's routed experts: expert id -> routing weight, ascending id."""
        ...

    def finish(self, layer: int, experts: list | None, flag: int) -> None: ...

    def begin_rows(self, embeddings: Tensor) -> None: ...

    def attention_rows(self, layer: int, states: list) -> None: ...

    def route_rows(self, layer: int, hash_ids: list[list[int]] | None) -> list[dict[int, float]]: ...

    def finish_rows(self, layer: int, experts: dict, choices: list[dict[int, float]], flag: int) -> None: ...


@runtime_checkable
class LayerDecode(LayerPrefill, Protocol):
    """One decode's arithmetic for the Decoder (runtime/decode.py), over a family's config and compute dtype: a
    LayerPrefill (its config, shape, names, expert naming and FFN, layer prefix and dtypes are the decode's too)
    plus the members below. What the Decoder holds: each layer's dense weights `w` (decode_dense: keyed by name
    after layer_prefix, in the compute dtype where in_compute_dtype says so), the head's weights by their stored
    names (names.head_globals and names.head, in global_dtype), the embedding's stored bytes (rows decoded per
    step), and per sequence one token state per layer (token_state)."""

    def global_dtype(self, name: str, stored_dtype: str, compiled: bool) -> Any:
        """The torch dtype the head's weight `name` (stored as `stored_dtype`) is decoded to; `compiled`: the
        compiled token path runs the head."""
        ...

    def hidden_from_embeddings(self, rows: Tensor) -> Tensor:
        """The first layer's input from the step's embedding rows [B, H] float32 (on the compute device)."""
        ...

    def hash_table(self, layer: int, w: Mapping[str, Tensor]) -> Tensor | None:
        """A hash layer's token id -> experts table [vocab, top_k] (its reads start before its attention); None
        for a layer its router routes."""
        ...

    def token_state(self, layer: int, state: Any, w: Mapping[str, Tensor], device: Any) -> Any:
        """A sequence's state of layer `layer` for decoding, from the prefill's (continued from here on)."""
        ...

    # optional: token_states(states, dense, device) -> every layer's token state of one sequence at once (a family
    # that keeps a sequence's layers together, e.g. in slots of device tensors); token_state per layer otherwise
    # optional, with token_states' device tensors: device_kv_growth(lengths, device) -> the device bytes they may
    # still take for sequences decoding together of at most `lengths` tokens each (prompt and new tokens): the most
    # they hold for them, a growth's copies included, less what they hold now (0 where `device` keeps none); the
    # memory checks count only the prefills' states otherwise

    def seen_tokens(self, state: Any) -> int:
        """The tokens a layer's state (a prefill's or a token state) covers."""
        ...

    def layer_state(self, token_state: Any) -> Any:
        """The layer's state as a prefill hands it on (what a KV file stores), after the tokens so far."""
        ...

    def attend(self, layer: int, w: Mapping[str, Tensor], hidden: Tensor, states: Sequence[Any], graphs: Any
               ) -> tuple[Tensor, ...]:
        """The layer's attention of B rows, row b over states[b] (grown by its token): tensors for route_attended.
        `graphs.run(key, fn, *tensors)` runs a fixed-shape piece (as a CUDA graph where it can)."""
        ...

    def route_attended(self, layer: int, w: Mapping[str, Tensor], attended: tuple[Tensor, ...], token_ids: Tensor
                       ) -> tuple[Tensor, Routing]:
        """(the rows' hidden state after the attention, the routing: `x` the experts' input; experts None in a
        layer without routed experts). Fixed-shape: a pooled layer runs it inside a CUDA graph."""
        ...

    def finish(self, layer: int, w: Mapping[str, Tensor], hidden: Tensor, routing: Routing, routed: Tensor | None,
               beside: Any = None, into: Tensor | None = None, checked: bool = True) -> Tensor:
        """The layer's output rows from the routed experts' combined output [B, H] float32 (None in a layer
        without routed experts); `checked`: a row not finite stops the step, named (else the caller checks)."""
        ...

    def head(self, w_globals: Mapping[str, Tensor], hidden: Tensor) -> Tensor:
        """Logits [B, vocab] of every row."""
        ...

    def expert_activation(self, gate: Tensor, up: Tensor) -> Tensor:
        """Between a routed expert's two GEMMs (the device pool): act(gate x) * (up x)."""
        ...

    # --- optional: a compiled one-token path (None / never called where the family has none) ---------------------
    def token_layers(self, dense: Sequence[Mapping[str, Tensor]]) -> TokenPath | None:
        """The compiled path over these dense weights, or None where its kernels do not take them."""
        ...

    def token_head(self, w_globals: Mapping[str, Tensor], output: Tensor) -> Tensor:
        """Logits [vocab] of TokenPath.output."""
        ...

    def token_head_rows(self, w_globals: Mapping[str, Tensor], rows_output: Tensor) -> Tensor:
        """Logits [B, vocab] float32 of TokenPath.rows_output."""
        ...
