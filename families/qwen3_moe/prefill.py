"""Qwen3-MoE's arithmetic for the layer-major prefill engine (families.base.LayerPrefill): the forward's functions
(model.py) split where the engine streams the routed experts. Everything computes in one dtype, the compute dtype
(float32: transformers' float32 model; bfloat16: its bf16 one), as transformers does for a model loaded in it."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from moepack.format_spec.errors import MoepackError

from ..base import MoeShape, PrefillNames, Routing, check_finite
from .config import Qwen3MoeConfig
from .model import FUSED_MIN_QUERIES, LayerKV, after_experts, attention, rms_norm, route, swiglu_ffn
from .tensors import EMBED, EXPERT_NAMING, FINAL_NORM, HEAD, layer_prefix

F32 = 4  # bytes the memory estimate counts per value (generous for a bf16 prefill)
# queries per attention chunk where --query-chunk does not bound it: a chunk's scores are [heads, chunk, keys]
QUERY_CHUNK = 1024


class Qwen3MoePrefill:
    """LayerPrefill for one Qwen3-MoE config. A layer's state is its LayerKV (keys and values so far)."""

    expert_naming = EXPERT_NAMING
    expert_forward = None  # its experts run as expert_ffn (the prefill's, and decode's off the token kernel)
    expert_limit = float("inf")  # the token kernel's SwiGLU computes its experts unclamped (decode on a CPU)

    def __init__(self, config: Qwen3MoeConfig, compute_dtype: torch.dtype):
        self.config, self.dtype = config, compute_dtype
        self.shape: MoeShape = config.shape()
        self.names = PrefillNames(embedding=EMBED, head=EMBED if config.tie_word_embeddings else HEAD,
                                  head_globals=(FINAL_NORM,), tied=config.tie_word_embeddings)

    def layer_prefix(self, layer: int) -> str:
        return layer_prefix(layer)

    def in_compute_dtype(self, name: str, ndim: int) -> bool:
        return True  # norms and router too: transformers' model holds every weight in its one dtype

    def hidden_from_embeddings(self, rows: Tensor) -> Tensor:
        return rows.to(self.dtype)

    def hash_table(self, layer: int, w: Mapping[str, Tensor]) -> Tensor:
        raise MoepackError("qwen3-moe routes every layer by its router: it has no hash layers")

    def seen_tokens(self, state: LayerKV) -> int:
        return state.length

    def attention(self, layer: int, w: Mapping[str, Tensor], hidden: Tensor, positions: Tensor, past: LayerKV | None,
                  query_chunk: int | None, into: Tensor | None, between_chunks: Callable[[], None] | None
                  ) -> tuple[Tensor, LayerKV]:
        # (the positions follow from the past's length: arange(P, P + n))
        kv = LayerKV() if past is None else LayerKV(_on(past.keys, hidden), _on(past.values, hidden))
        c = self.config
        x = rms_norm(hidden, w["input_layernorm.weight"], c.rms_norm_eps)
        out = hidden + attention(c, w, x, kv, query_chunk or self.preferred_query_chunk(hidden.device),
                                 between_chunks)
        return (into.copy_(out) if into is not None else out), kv

    def route(self, layer: int, w: Mapping[str, Tensor], hidden: Tensor, token_ids: Tensor) -> Routing:
        c = self.config
        ffn_input = rms_norm(hidden, w["post_attention_layernorm.weight"], c.rms_norm_eps)
        routing = route(c, w, ffn_input) if c.is_moe_layer(layer) else Routing(experts=None, weights=None)
        routing.x = ffn_input
        return routing

    def beside_experts(self, layer: int, w: Mapping[str, Tensor], routing: Routing) -> None:
        return None  # no shared expert

    def finish(self, layer: int, w: Mapping[str, Tensor], hidden: Tensor, routing: Routing, routed: Tensor | None,
               beside=None, into: Tensor | None = None, checked: bool = True) -> Tensor:
        # checked False: the caller checks (a decode's pooled layer, after the step: a check here would make the
        # host wait)
        out = after_experts(self.config, layer, w, hidden, routing.x,
                            routed.to(hidden.dtype) if routed is not None else None)
        out = check_finite(out, layer) if checked else out
        return into.copy_(out) if into is not None else out

    def head_input(self, w_globals: Mapping[str, Tensor], hidden: Tensor, rows: Tensor) -> Tensor:
        return rms_norm(hidden[rows], w_globals[FINAL_NORM].to(hidden.dtype), self.config.rms_norm_eps)

    @staticmethod
    def expert_ffn(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
        return swiglu_ffn({"gate": gate, "up": up, "down": down}, x)

    @staticmethod
    def expert_activation(gate: Tensor, up: Tensor) -> Tensor:
        return F.silu(gate) * up

    def preferred_query_chunk(self, device) -> int:
        return QUERY_CHUNK

    def working_set(self, n_tokens: int, query_chunk: int, device: torch.device | None = None) -> dict[str, int]:
        c = self.config
        kv_row = 2 * c.num_kv_heads * c.head_dim * F32
        return {
            # hidden rows in and out, the FFN input, q / k / v and the attention's output, the dense MLP's
            "activations": n_tokens * F32 * (8 * c.hidden_size + 2 * c.num_heads * c.head_dim
                                             + 3 * c.intermediate_size),
            "kv": n_tokens * kv_row * c.num_layers,  # every layer's keys and values stay for the tokens after
            "attention_chunk": _attention_bytes(c, n_tokens, query_chunk, device),
        }

    def close(self) -> None:
        pass


FUSED_THREAD_BYTES = 4 << 20  # what torch's fused CPU attention keeps per thread (its blocks: 1.3-1.8 MB measured)


def _attention_bytes(c: Qwen3MoeConfig, n_tokens: int, query_chunk: int, device: torch.device | None) -> int:
    """The most one attention chunk of a prefill of n_tokens holds (model.attention_over). Torch's fused attention
    on a CPU (a chunk of FUSED_MIN_QUERIES queries or more) keeps the chunk's mask ([chunk, T], bool and float) and
    each thread's blocks, never the scores; elsewhere (a GPU's masked chunks take the grouped matmuls) and in the
    grouped matmuls (a chunk of fewer queries, the last one included) the scores, their softmax and the output
    ([heads, chunk, T] each; a GQA group's queries read their KV head's keys in place)."""
    def scores(rows: int) -> int:
        return 3 * c.num_heads * rows * n_tokens * F32

    if device is None or device.type != "cpu" or query_chunk < FUSED_MIN_QUERIES:
        return scores(query_chunk)
    fused = 12 * query_chunk * n_tokens + FUSED_THREAD_BYTES * torch.get_num_threads()  # (107 MB of 209 at 16K)
    return max(fused, scores(FUSED_MIN_QUERIES - 1))


def _on(t: Tensor | None, like: Tensor) -> Tensor | None:
    return None if t is None else t.to(device=like.device, dtype=like.dtype)
