"""DeepSeek-V4's arithmetic for the token-major decode (families.base.LayerDecode): model.py's one-token functions
split where the Decoder (runtime/decode.py) fetches the routed experts, and its compiled one-token path
(token_layer.TokenLayers, the head through the token matmul) offered beside them. A sequence's state of a layer is a
model.TokenKV (the KV grown one token at a time); on a CUDA device its device_kv.ArenaKV (every row's attention one
fixed-shape piece over slots of the decoder's arena). The residual is hc_mult streams [B, hc, H] float32."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from moepack.backends import ops
from moepack.backends.kv_arena import growth

from ..base import Routing
from . import device_kv, model
from .device_kv import ArenaKV, KVArena
from .kv import LayerKVState
from .token_layer import TokenLayers


class DeepseekV4Decode(model.DeepseekV4Prefill):
    """LayerDecode for one DeepSeek-V4 config (the prefill's names, dtypes and expert naming)."""

    _arena: KVArena | None = None  # the sequences' states on a CUDA device (token_states)

    def global_dtype(self, name: str, stored_dtype: str, compiled: bool) -> torch.dtype:
        # the LM head (the largest matrix a token reads: 1 GB for V4-Flash in bf16) kept bf16 where it is stored
        # so and the token matmul widens it exactly in its loop (model.widened_matmul): the float32 products of a
        # float32 copy, from half the bytes
        return torch.bfloat16 if compiled and name == self.config.head_weight and stored_dtype == "BF16" \
            else torch.float32

    def hash_table(self, layer: int, w: Mapping[str, Tensor]) -> Tensor | None:
        return super().hash_table(layer, w) if self.config.hash_layers[layer] else None

    def token_state(self, layer: int, state: LayerKVState, w: Mapping[str, Tensor], device) -> model.TokenKV:
        return model.TokenKV(self.config, layer, state.to(device), w["attn.wq_b.weight"].dtype)

    def token_states(self, states: Sequence[LayerKVState], dense: Sequence[Mapping[str, Tensor]], device
                     ) -> list[model.TokenKV | ArenaKV]:
        # on a CUDA device, in the decoder's arena (device_kv.py): a layer's attention one piece for every row
        device = torch.device(device)
        if not model.on_cuda(device):
            return [self.token_state(layer, s, w, device) for layer, (s, w) in enumerate(zip(states, dense))]
        if self._arena is None:
            self._arena = KVArena(self.config, device, [w["attn.wq_b.weight"].dtype for w in dense])
        return self._arena.admit(states)

    def device_kv_growth(self, lengths: Sequence[int], device) -> int:
        # what the arena token_states keeps on a CUDA device may still take for these sequences
        if not model.on_cuda(torch.device(device)):
            return 0
        return growth(device_kv.arena_bytes(self.config, lengths, self.dtype, self._arena), self._arena)

    def layer_state(self, token_state: model.TokenKV) -> LayerKVState:
        return token_state.state()

    def attend(self, layer: int, w: Mapping[str, Tensor], hidden: Tensor, states: Sequence[model.TokenKV], graphs
               ) -> tuple[Tensor, ...]:
        # attention_token_sublayer: its mHC and what needs only the rows on every row at once (one fixed-shape
        # piece), the attention over each row's state row by row (in the arena: all in one piece); its output
        # projection runs in route_attended
        if states and isinstance(states[0], ArenaKV):
            return states[0].arena.attend(layer, w, hidden, states, graphs)
        cfg = self.config
        rotations = [model.token_attention_rotation(cfg, layer, state, hidden.device) for state in states]
        rotation = rotations[0] if len(rotations) == 1 else torch.cat(rotations)
        x, post, comb, *inputs = graphs.run(("attention entry", layer, hidden.shape[0]),
                                            functools.partial(self._attention_entry, layer, w), hidden, rotation)
        heads = torch.cat([model.token_attention_core(cfg, layer, w, x[b:b + 1], rotation[b:b + 1],
                                                      tuple(t[b:b + 1] for t in inputs), state)
                           for b, state in enumerate(states)])
        return hidden, heads, rotation, post, comb

    def _attention_entry(self, layer: int, w: Mapping[str, Tensor], hidden: Tensor, rotation: Tensor
                         ) -> tuple[Tensor, ...]:
        x, post, comb = model.attention_entry(self.config, w, hidden)
        return (x, post, comb, *model.token_attention_inputs(self.config, layer, w, x, rotation))

    def route_attended(self, layer: int, w: Mapping[str, Tensor], attended: tuple[Tensor, ...], token_ids: Tensor
                       ) -> tuple[Tensor, Routing]:
        hidden, heads, rotation, post, comb = attended
        streams = model.hc_post(hidden, model.token_attention_output(self.config, w, heads, rotation), post, comb)
        return streams, model.moe_route(self.config, layer, w, streams, token_ids)

    def head(self, w_globals: Mapping[str, Tensor], hidden: Tensor) -> Tensor:
        return model.head(self.config, hidden, w_globals, slice(None))

    # --- the compiled one-token path ---------------------------------------------------------------------------
    def token_layers(self, dense: Sequence[Mapping[str, Tensor]]) -> TokenLayers | None:
        return TokenLayers.make(self.config, list(dense))

    def token_head(self, w_globals: Mapping[str, Tensor], output: Tensor) -> Tensor:
        return model.head(self.config, output, w_globals, -1)

    def token_head_rows(self, w_globals: Mapping[str, Tensor], rows_output: Tensor) -> Tensor:
        """model.head of each row's streams [B, hc, H] -> [B, vocab] float32: the LM head (the largest matrix)
        read once for every row, each row's products and sums those of its head alone (the token matmul's)."""
        cfg = self.config
        weight = w_globals[cfg.head_weight]
        x = torch.cat([model.head_input(cfg, rows_output[row:row + 1], w_globals, -1)
                       for row in range(rows_output.shape[0])])
        logits = ops.widened_rows(x, weight)
        if logits is None:  # as model.head would
            return torch.stack([model.head(cfg, rows_output[row:row + 1], w_globals, -1).float().cpu()
                                for row in range(rows_output.shape[0])])
        return logits
