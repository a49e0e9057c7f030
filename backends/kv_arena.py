"""What every family's decode KV arena on a device shares (each family's `device_kv.py`): each decoding sequence's
state lives in a slot of preallocated device tensors, so that a layer's attention for every row of a step is one
fixed-shape piece (a CUDA graph per layer, rows, bucket and generation) rather than per-row ops whose shapes grow a
token at a time.

`SlotArena` keeps the slots: a sequence takes one when it starts (`take_slot`) and gives it back when its states
are dropped (`ArenaSlot`, `release`); with none free the slots double (the family's `grow_slots`, which moves its
tensors and so makes its graphs stale: the family bumps its generation, `next_generation`). A step's rows give
their slots and positions as one small device tensor sent once a step (`step_rows`); a layer's attention for them
runs as one piece (`run_attention`), and each (layer, rows) keeps one live graph: a new bucket or generation
retires the graphs it makes stale (`graph_key`). A bucket is a power of two (`bucket_for`): one graph serves many
tokens.

What an arena holds of the device (`allocated_bytes`) is bounded, from the config, by its family's `arena_bytes`
for the sequences decoding together (`slots_for`: their slots); the memory checks count what it may still take
(`growth`).
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from .device_copier import to_device_async

# the arenas' tensors' generations, never reused (a captured graph reads the tensors of its generation: tensors made
# anew, by a grown arena or one made after another was given back, must not replay the graphs of those before)
_generations = itertools.count(1)


def next_generation() -> int:
    """A generation no arena's tensors had before (`graph_key`'s)."""
    return next(_generations)


def bucket_for(count: int, least: int) -> int:
    """The least power of two that is at least `count` and `least`."""
    return max(least, 1 << max(count - 1, 0).bit_length())


def slots_for(sequences: int, slots: int = 1) -> int:
    """The slots an arena of `slots` has once `sequences` decode together in it (take_slot doubles them while none
    is free)."""
    return max(slots, bucket_for(sequences, 1))


def growth(most: int, arena: SlotArena | None) -> int:
    """What an arena may still take of the device: `most` (its family's arena_bytes for its sequences) less what
    it holds now (None: not made yet)."""
    return max(0, most - (arena.allocated_bytes() if arena is not None else 0))


def grown(t: Tensor, dim: int, size: int, fill: float = 0.0) -> Tensor:
    """t with dimension `dim` grown to `size`, the new part `fill` (finite where read masked: a NaN times a
    masked weight is still NaN)."""
    shape = list(t.shape)
    shape[dim] = size
    out = torch.full(shape, fill, dtype=t.dtype, device=t.device)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


class ArenaSlot:
    """A sequence's slot in the arena: given back (SlotArena.release) when the last of its layers' states is
    dropped."""

    def __init__(self, arena: SlotArena, index: int):
        self.index = index
        weakref.finalize(self, arena.release, index)


class SlotArena:
    """The slots of a family's arena on `device` (module docstring); the family's arena says how its tensors grow
    (`grow_slots`). Its states give `slot` (an ArenaSlot) and `seen_tokens` (the row's position this step)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.slots = 1
        self._free = [0]
        self._step: tuple[tuple, Tensor] | None = None  # (the rows' (slot, position) pairs, them on the device)
        self._keys: dict[tuple[int, int], tuple] = {}  # (layer, rows) -> its attention's last graph key

    def grow_slots(self, slots: int) -> None:
        """Every tensor's slots grown to `slots` (the family's arena)."""
        raise NotImplementedError

    def held_tensors(self) -> Iterable[Tensor]:
        """Every device tensor the arena holds now, each once (the family's arena)."""
        raise NotImplementedError

    def allocated_bytes(self) -> int:
        """The device bytes its tensors hold now."""
        return sum(t.nbytes for t in self.held_tensors())

    def release(self, index: int) -> None:
        """Slot `index`'s sequence is gone (its ArenaSlot's finalizer: any thread, at any allocation): free."""
        self._free.append(index)

    def take_slot(self) -> ArenaSlot:
        """A free slot, the slots doubled where none is."""
        if not self._free:
            self.grow_slots(2 * self.slots)
            self._free.extend(range(2 * self.slots - 1, self.slots - 1, -1))
            self.slots *= 2
        return ArenaSlot(self, self._free.pop())

    def step_rows(self, states: Sequence) -> Tensor:
        """The rows' (slots, positions) [2, B] on the device, sent once per step (every layer's rows are the same
        sequences at the same positions)."""
        key = tuple((s.slot.index, s.seen_tokens) for s in states)
        if self._step is None or self._step[0] != key:
            self._step = key, to_device_async(torch.tensor(list(zip(*key)), dtype=torch.int64), self.device)
        return self._step[1]

    def run_attention(self, graphs, layer: int, states: Sequence, bucket: int, generation: int, attention,
                      hidden: Tensor):
        """attention(bucket, hidden, rows) of every row of the step (`states`, each a row's state of `layer`;
        rows: their slots and positions on the device) as one piece through `graphs`
        (device_decode.StepGraphs: a CUDA graph per layer, rows, bucket and generation; a transient one, its
        [rows, bucket] intermediates in the memory every layer's share: its result is used before the next layer's
        attention), the rows' states counted after it: its result."""
        key = self.graph_key(graphs, layer, len(states), bucket, generation)
        out = graphs.run(key, functools.partial(attention, bucket), hidden, self.step_rows(states), transient=True)
        for s in states:
            s.seen_tokens += 1
        return out

    def graph_key(self, graphs, layer: int, rows: int, bucket: int, generation: int) -> tuple:
        """The graph key of layer `layer`'s attention for `rows` rows over `bucket` at the layer's tensors'
        `generation`, the graphs it makes stale forgotten by `graphs` (device_decode.StepGraphs): one live graph
        per layer and rows (a new bucket retires the last one); a new generation every other rows' too (they read
        the tensors before: never replayed again), and a smaller bucket those of a larger (a long sequence gone:
        each holds its [rows, bucket] intermediates on the device)."""
        key = ("arena attention", layer, rows, bucket, generation)
        if self._keys.get((layer, rows)) != key:
            for at, old in list(self._keys.items()):
                if at[0] == layer and (at[1] == rows or old[4] != generation or old[3] > bucket):
                    graphs.forget(self._keys.pop(at))
            self._keys[(layer, rows)] = key
        return key
