"""Qwen3-MoE's decode KV on a CUDA device in fixed places, so that a layer's attention for every row of a step is
one fixed-shape piece (a CUDA graph per layer, rows, key bucket and generation), not per-row ops over keys that
grow a token at a time (model.LayerKV continued in place, the CPU's).

A `KVArena` holds, per layer, every decoding sequence's keys and values (after k_norm and RoPE) in slots of
preallocated tensors, [slots, capacity, kv_heads, head_dim] each, zeros where nothing was written (a masked
position is read: a NaN there times its zero weight would be NaN). A step's rows give their slots and positions as
one small device tensor (backends/kv_arena.py's `step_rows`, sent once a step); everything else follows on the
device: the norm, projections and RoPE of every row, its key and value written at row `position` of its slot, its
queries over the bucket's prefix of its slot (`key_bucket`: a power of two at least the rows' longest length + 1,
so that one graph serves many tokens), the positions past its own masked.

A sequence takes a slot when it starts (`admit`, its prefill state checked and written in) and gives it back when
its states are dropped; the arena grows by doubling (slots, or every layer's capacity), a layer's tensors at a
time, which makes its graphs stale (`generation`); it is never made smaller (`arena_bytes` bounds what it holds).
`ArenaKV.state()` hands the state on as a prefill would (LayerKV).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from moepack.backends.kv_arena import ArenaSlot, SlotArena, bucket_for, grown, next_generation, slots_for

from .config import Qwen3MoeConfig
from .kv import QWEN3_MOE_KV
from .model import LayerKV, attention_inputs, rms_norm, visible_keys

KEY_BUCKET_MIN = 16  # the fewest positions a bucket holds (a new graph per bucket: few while a prompt is short)


def on_cuda(device: torch.device) -> bool:
    """Whether the decode keeps its KV in the arena (the one test of it: a test on a CPU forces it here)."""
    return device.type == "cuda"


def key_bucket(tokens: int) -> int:
    """The positions a step's attention reads for rows of at most `tokens` keys (their own included)."""
    return bucket_for(tokens, KEY_BUCKET_MIN)


def arena_bytes(c: Qwen3MoeConfig, lengths: Sequence[int], dtype: torch.dtype, arena: KVArena | None = None) -> int:
    """The most a KVArena in `dtype` holds for sequences decoding together of at most `lengths` tokens each (prompt
    and new tokens), from the config: their slots (doubled from `arena`'s, or a new arena's one) of every layer's
    keys and values, each slot as many positions as the longest one's bucket (at least `arena`'s capacity); plus
    one layer's, which a growth holds beside their new ones while it copies them."""
    slots = slots_for(len(lengths), arena.slots if arena is not None else 1)
    capacity = max(key_bucket(max(lengths, default=0)), arena.capacity if arena is not None else KEY_BUCKET_MIN)
    layer = 2 * slots * capacity * c.num_kv_heads * c.head_dim * dtype.itemsize
    return (c.num_layers + 1) * layer


def attention_rows(c: Qwen3MoeConfig, q: Tensor, keys: Tensor, values: Tensor, positions: Tensor) -> Tensor:
    """model.attention_over of one query per row, each over its own keys: q [heads, B, D] at `positions` [B],
    keys and values [B, T, kv_heads, D] (each row's, the positions past its own masked): [B, heads * D]."""
    rows, group = q.shape[1], c.num_heads // c.num_kv_heads  # query heads per KV head (GQA)
    q = q.transpose(0, 1).reshape(rows, c.num_kv_heads, group, c.head_dim)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, kv_heads, T, D]
    scores = (q @ keys.transpose(-1, -2)) * c.head_dim ** -0.5  # [B, kv_heads, group, T]
    visible = visible_keys(c, keys.shape[2], positions)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (probs @ values).reshape(rows, c.num_heads * c.head_dim)


class ArenaKV:
    """One layer's decode state of one sequence in the arena (what token_states gives on a CUDA device)."""

    def __init__(self, arena: KVArena, layer: int, slot: ArenaSlot, seen_tokens: int):
        self.arena, self.layer, self.slot, self.seen_tokens = arena, layer, slot, seen_tokens

    @property
    def length(self) -> int:  # (LayerKV's: the family's seen_tokens reads it)
        return self.seen_tokens

    def state(self) -> LayerKV:
        """The state as a prefill hands it on: the keys and values so far, [kv_heads, T, head_dim] each."""
        if not self.seen_tokens:
            return LayerKV()
        return LayerKV(*(t[self.slot.index, :self.seen_tokens].transpose(0, 1).clone(
            memory_format=torch.contiguous_format) for t in self.arena.tensors(self.layer)))


class KVArena(SlotArena):
    """Every decoding sequence's keys and values of every layer in slots on `device`, in `dtype` (the module's
    docstring; the slots, the step's rows and the graph keys backends/kv_arena.py's)."""

    def __init__(self, config: Qwen3MoeConfig, device: torch.device, dtype: torch.dtype):
        super().__init__(device)
        self.config, self.dtype = config, dtype
        self.capacity = KEY_BUCKET_MIN
        shape = (1, self.capacity, config.num_kv_heads, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.generation = next_generation()  # a new one when the tensors move (the captured graphs read the old)

    def tensors(self, layer: int) -> tuple[Tensor, Tensor]:
        return self.keys[layer], self.values[layer]

    def held_tensors(self) -> Iterable[Tensor]:
        return (*self.keys, *self.values)

    def _grow(self, dim: int, size: int) -> None:
        for layer in range(len(self.keys)):  # one layer's at a time: the old tensors beside the new are one layer's
            self.keys[layer] = grown(self.keys[layer], dim, size)
            self.values[layer] = grown(self.values[layer], dim, size)
        self.generation = next_generation()

    def grow_slots(self, slots: int) -> None:
        self._grow(0, slots)

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` positions in every slot (doubling: a long decode grows it a few times)."""
        if tokens > self.capacity:
            self.capacity = max(2 * self.capacity, key_bucket(tokens))
            self._grow(1, self.capacity)

    def admit(self, states: Sequence[LayerKV]) -> list[ArenaKV]:
        """A sequence after a prefill's `states` (one per layer, all after the same tokens) in a free slot: its
        layers' ArenaKV. A state that is not a prefill's of this model is refused in one line, naming its layer."""
        c = self.config
        geometry = {"num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim}
        for layer, state in enumerate(states):
            if state.keys is not None or state.values is not None:  # (none: no token yet)
                QWEN3_MOE_KV.check_state(geometry, layer, state)
        seen = states[0].length
        slot = self.take_slot()
        self.reserve(seen + 1)
        for layer, state in enumerate(states):
            for t, part in zip(self.tensors(layer), (state.keys, state.values)):
                if seen:
                    t[slot.index, :seen] = part.transpose(0, 1).to(device=self.device, dtype=self.dtype)
                t[slot.index, seen:] = 0  # a former sequence's keys: finite, but not this one's
        return [ArenaKV(self, layer, slot, seen) for layer in range(len(states))]

    def attend(self, layer: int, w: Mapping[str, Tensor], hidden: Tensor, states: Sequence[ArenaKV], graphs
               ) -> tuple[Tensor, Tensor]:
        """Qwen3MoeDecode.attend over the arena: one fixed-shape piece for every row (a CUDA graph per layer,
        rows, key bucket and generation), the states counted after it: (hidden, the heads' output [B, heads * D])."""
        bucket = key_bucket(max(s.seen_tokens for s in states) + 1)  # each row's keys, its own included
        self.reserve(bucket)
        return hidden, self.run_attention(graphs, layer, states, bucket, self.generation,
                                          functools.partial(self._attention, layer, w), hidden)

    def _attention(self, layer: int, w: Mapping[str, Tensor], bucket: int, hidden: Tensor, rows: Tensor) -> Tensor:
        """The attention of every row (hidden [B, H], rows [2, B] their slots and positions) before o_proj, its key
        and value written into its slot, asking the host nothing: [B, heads * D]."""
        c = self.config
        slots, positions = rows[0], rows[1]
        q, k, v = attention_inputs(c, w, rms_norm(hidden, w["input_layernorm.weight"], c.rms_norm_eps), positions)
        keys, values = self.tensors(layer)
        keys[slots, positions] = k.transpose(0, 1).to(keys.dtype)
        values[slots, positions] = v.transpose(0, 1).to(values.dtype)
        return attention_rows(c, q, keys[:, :bucket].index_select(0, slots),
                              values[:, :bucket].index_select(0, slots), positions)
