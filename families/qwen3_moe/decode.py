"""Qwen3-MoE's arithmetic for the token-major decode (families.base.LayerDecode): the forward's functions (model.py)
split where the Decoder (runtime/decode.py) fetches the routed experts. A sequence's state of a layer is its LayerKV,
continued in place; every row runs its attention and router alone, as a prefill of one token would; no compiled
path (the Decoder runs these functions in torch)."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from ..base import Routing
from .model import LayerKV, attention_inputs, attention_over, head, rms_norm
from .prefill import Qwen3MoePrefill
from .tensors import FINAL_NORM


class Qwen3MoeDecode(Qwen3MoePrefill):
    """LayerDecode for one Qwen3-MoE config in one compute dtype (the prefill's names and expert FFN)."""

    def global_dtype(self, name: str, stored_dtype: str, compiled: bool) -> torch.dtype:
        return self.dtype

    def hash_table(self, layer: int, w: Mapping[str, Tensor]) -> None:
        return None  # every layer routes by its router

    def token_state(self, layer: int, state: LayerKV, w: Mapping[str, Tensor], device) -> LayerKV:
        return state  # continued in place

    def layer_state(self, token_state: LayerKV) -> LayerKV:
        return token_state

    def attend(self, layer: int, w: Mapping[str, Tensor], hidden: Tensor, states: Sequence[LayerKV], graphs
               ) -> tuple[Tensor, ...]:
        # what needs only the rows (the norm, projections, RoPE) on every row at once (one fixed-shape piece), the
        # attention over each row's keys row by row; o_proj and the router run in route_attended
        c = self.config
        positions = graphs.values([state.length for state in states])
        q, k, v = graphs.run(("attention inputs", layer, hidden.shape[0]),
                             functools.partial(self._attention_inputs, w), hidden, positions)
        heads = torch.cat([attention_over(c, q[:, b:b + 1], *state.append(k[:, b:b + 1], v[:, b:b + 1]),
                                          positions[b:b + 1]) for b, state in enumerate(states)])
        return hidden, heads

    def _attention_inputs(self, w: Mapping[str, Tensor], hidden: Tensor, positions: Tensor
                          ) -> tuple[Tensor, Tensor, Tensor]:
        c = self.config
        return attention_inputs(c, w, rms_norm(hidden, w["input_layernorm.weight"], c.rms_norm_eps), positions)

    def route_attended(self, layer: int, w: Mapping[str, Tensor], attended: tuple[Tensor, ...], token_ids: Tensor
                       ) -> tuple[Tensor, Routing]:
        hidden, heads = attended
        residual = hidden + heads @ w["self_attn.o_proj.weight"].T
        return residual, self.route(layer, w, residual, token_ids)

    def head(self, w_globals: Mapping[str, Tensor], hidden: Tensor) -> Tensor:
        return head(self.config, {"norm": w_globals[FINAL_NORM], "head": w_globals[self.names.head]}, hidden)

    def token_layers(self, dense) -> None:
        return None
