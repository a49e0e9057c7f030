"""Qwen3-MoE's arithmetic for the token-major decode (families.base.LayerDecode): the forward's functions (model.py)
split where the Decoder (runtime/decode.py) fetches the routed experts. A sequence's state of a layer is its LayerKV,
continued in place, every row's attention over its own keys, as a prefill of one token would; on a CUDA device its
ArenaKV (device_kv.py: every row's attention one fixed-shape piece over slots of the decoder's arena). No compiled
one-token path: the Decoder runs these functions in torch, and on a CPU the routed experts in its token kernel (their
SwiGLU unclamped: expert_limit inf)."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from moepack.backends.kv_arena import growth
from moepack.backends.ops import matmul

from ..base import Routing
from . import device_kv
from .device_kv import ArenaKV, KVArena
from .model import LayerKV, attention_inputs, attention_over, head, rms_norm
from .prefill import Qwen3MoePrefill
from .tensors import FINAL_NORM


class Qwen3MoeDecode(Qwen3MoePrefill):
    """LayerDecode for one Qwen3-MoE config in one compute dtype (the prefill's names and expert FFN)."""

    _arena: KVArena | None = None  # the sequences' states on a CUDA device (token_states)

    def global_dtype(self, name: str, stored_dtype: str, compiled: bool) -> torch.dtype:
        return self.dtype

    def hash_table(self, layer: int, w: Mapping[str, Tensor]) -> None:
        return None  # every layer routes by its router

    def token_state(self, layer: int, state: LayerKV, w: Mapping[str, Tensor], device) -> LayerKV:
        return state  # continued in place

    def token_states(self, states: Sequence[LayerKV], dense: Sequence[Mapping[str, Tensor]], device
                     ) -> list[LayerKV | ArenaKV]:
        # on a CUDA device, in the decoder's arena (device_kv.py): a layer's attention one piece for every row
        device = torch.device(device)
        if not device_kv.on_cuda(device):
            return [self.token_state(layer, s, w, device) for layer, (s, w) in enumerate(zip(states, dense))]
        if self._arena is None:
            self._arena = KVArena(self.config, device, self.dtype)
        return self._arena.admit(states)

    def device_kv_growth(self, lengths: Sequence[int], device) -> int:
        # what the arena token_states keeps on a CUDA device may still take for these sequences
        if not device_kv.on_cuda(torch.device(device)):
            return 0
        return growth(device_kv.arena_bytes(self.config, lengths, self.dtype, self._arena), self._arena)

    def layer_state(self, token_state: LayerKV | ArenaKV) -> LayerKV:
        return token_state.state() if isinstance(token_state, ArenaKV) else token_state

    def attend(self, layer: int, w: Mapping[str, Tensor], hidden: Tensor, states: Sequence[LayerKV], graphs
               ) -> tuple[Tensor, ...]:
        # what needs only the rows (the norm, projections, RoPE) on every row at once (one fixed-shape piece), the
        # attention over each row's keys row by row (in the arena: all in one piece); o_proj and the router run in
        # route_attended
        if states and isinstance(states[0], ArenaKV):
            return states[0].arena.attend(layer, w, hidden, states, graphs)
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
        residual = hidden + matmul(heads, w["self_attn.o_proj.weight"])
        return residual, self.route(layer, w, residual, token_ids)

    def head(self, w_globals: Mapping[str, Tensor], hidden: Tensor) -> Tensor:
        return head(self.config, {"norm": w_globals[FINAL_NORM], "head": w_globals[self.names.head]}, hidden)

    def token_layers(self, dense) -> None:
        return None
