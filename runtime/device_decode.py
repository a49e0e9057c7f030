"""A device pool of decoded routed experts, and a decode layer's routed work over it without a host round trip.

Where the expert cache keeps decoded experts (a GPU by default), the Decoder keeps them here rather than as three
tensors each: every cached expert is a slot of two preallocated stacks, gate and up side by side `gate_up [slots,
2I, H]` and `down [slots, H, I]` (the expert dtype), and a device table `slot_of [layers, experts]` (-1: not
pooled) says where each (layer, expert) is. A layer's routed work for B rows is then a fixed sequence of device
ops: the router's top-k ids (on the device) look their slots up, the (row, choice) pairs are sorted by slot, one
grouped GEMM over the whole pool (empty groups for the slots nobody chose; in runs of slots where the pool has
more than CUDA's kernel takes groups, MAX_GROUPS) gives gate and up, the clamped SwiGLU, a second grouped GEMM gives
down, and each row's terms are summed in ascending expert id with their routing weights
(ExpertGroups.combine's order). Nothing in it asks the host anything, so where CUDA is present it is captured once
per (layer, B) in a CUDA graph and replayed (eager where capture fails, and on a CPU): `StepGraphs`, which the
Decoder also uses for the rest of a layer's fixed-shape work (the attention's mHC entry; for a layer whose experts
are all pooled, its whole FFN with the routed work inside). The attention over each row's KV runs row by row where
that KV grows a row a token; a family that keeps it in a device arena (backends/kv_arena.py) runs it as one piece
too.

The host knows which layers hold all their experts (`complete`): those run without looking at the choice. A layer
that does not costs one synchronisation (the Decoder reads the chosen ids, reads the misses through its reader
and decodes them into slots). The slots are the cache's entries: ExpertCache keeps the accounting, the
least-recently-used order and the admission (its budget, hits, misses, evictions, refusals), and tells the pool
what it drops (`dropped`) or when its budget changes (`budget_changed`: the stacks are reallocated smaller or
larger, so the device memory follows the budget). A miss the cache refuses goes into a scratch slot (`put_scratch`)
for the layer in progress: slots held apart from the entries' budget (the cache's `reserved`), reused by every
layer, grown from the budget as a layer needs, so that the layer still runs as one pooled call and the cache keeps
what it holds. A slot whose expert is evicted while the layer being computed still uses it (`pinned`) is reused only
after that layer, as the scratch slots are.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields

import torch

from moepack.backends import grouped_experts, stored_gemv
from moepack.backends.device_copier import to_device_async
from moepack.backends.grouped_experts import grouped_matmul, grouped_mm_usable

from moepack.format_spec.decode import decode_side_by_side, decode_tensor, scale_name, tensor_scale_name

from .expert_decode import ExpertWeights


def pool_usable(dtype: torch.dtype, device: torch.device, inter: int, hidden: int) -> bool:
    """Whether torch's grouped GEMM takes the pool's operands here, laid out as the pool lays them (bf16 on CUDA's
    sm_90 / sm_100; any float dtype on a CPU; rows 16-byte aligned): the pool computes only through it (its offsets
    stay on the device)."""
    gate_up = torch.empty(1, 2 * inter, hidden, dtype=dtype, device=device)
    down = torch.empty(1, hidden, inter, dtype=dtype, device=device)
    rows = [torch.empty(1, k, dtype=dtype, device=device) for k in (hidden, inter)]  # the pairs, the hidden
    return grouped_mm_usable(rows[0], gate_up.transpose(1, 2)) and grouped_mm_usable(rows[1], down.transpose(1, 2))


class CapturedCall:
    """fn(*inputs) captured in a CUDA graph over static copies of `inputs`: each call copies its arguments into
    them and replays the graph; the result is the graph's own output buffer (valid until the next call). `pool`: a
    graph memory pool shared with other captures (torch.cuda.graph_pool_handle()), else the graph's own."""

    def __init__(self, fn: Callable, inputs: tuple[torch.Tensor, ...], pool=None):
        self.inputs = tuple(t.clone() for t in inputs)
        # on the inputs' device, not the current one (a pool on cuda:1 while cuda:0 is current)
        with torch.cuda.device(self.inputs[0].device if self.inputs else None):
            self._capture(fn, pool)

    def _capture(self, fn: Callable, pool) -> None:
        stream = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(stream)
        with torch.cuda.stream(side):  # a warm-up outside the capture: lazy initialisation, workspace
            fn(*self.inputs)
        stream.wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: what other threads do meanwhile (the reader's copies, another generation's host
            # waits) neither breaks this capture nor fails there
            with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
                self.output = fn(*self.inputs)
        finally:
            # a capture that failed at its end (an op that waits for the host invalidates it) raises from
            # torch.cuda.graph's exit before it sets the stream back: the eager run goes on the caller's stream
            torch.cuda.set_stream(stream)

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        for static, arg in zip(self.inputs, args):
            static.copy_(arg)
        self.graph.replay()
        return self.output


class StepGraphs:
    """Fixed-shape pieces of a decode step on `device`, each captured once per key in a CUDA graph and replayed;
    run eagerly where they are off (a CPU) or their capture failed. A piece must not change anything but its
    outputs (its capture runs it twice). An input that is another piece's output buffer (the attention's heads
    the FFN reads, a layer's output the next layer reads) is read in place, not copied at each replay; should that
    input ever be another tensor (its producer captured again for a new bucket, or run eagerly), it is copied into
    the buffer the piece reads (kept alive by the piece), not captured again (nor every piece after it).

    A `transient` piece (a layer's attention, its routed work) is one whose outputs are used before the next
    transient piece runs: those pieces share one graph memory pool, so that their intermediates (a step's gathered
    keys and values over a long bucket, a stored pool's decoded experts) take the largest one's memory, not one
    for every layer and B. (A graph captured into the pool after another may put its outputs where the other's
    intermediates were; the other's next replay writes over them, which is harmless only once they are used.) A
    transient piece reads no other transient piece's output in place: it copies it, since its own intermediates
    may lie there."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled, self.device = enabled, device
        self._captured: dict[tuple, _Piece | None] = {}
        self._outputs: dict[int, tuple[weakref.ref, bool]] = {}  # id -> (a piece's output buffer, transient)
        self._transient_pool = None  # the transient pieces' graph memory pool (made at their first capture)
        self.replays = 0

    def values(self, values: list[int]) -> torch.Tensor:
        """Host integers (each row's position, say) as an int64 tensor on the device, the host not waiting."""
        return to_device_async(torch.tensor(values, dtype=torch.int64), self.device)

    def run(self, key: tuple, fn: Callable, *inputs: torch.Tensor, transient: bool = False):
        """fn(*inputs), from the graph captured for `key` (its outputs are that graph's buffers: valid until its
        next replay; a `transient` piece's until the next transient piece runs)."""
        if not self.enabled:
            return fn(*inputs)
        piece = self._captured.get(key, False)
        if piece:
            for i, buffer in piece.shared:
                if inputs[i] is not buffer:  # (its producer captured again, or run eagerly): copied where it reads
                    buffer.copy_(inputs[i])
        if piece is False:
            piece = self._captured[key] = self._capture(fn, inputs, transient)
        if piece is None:
            return fn(*inputs)
        self.replays += 1
        return piece.call(*(inputs[i] for i in piece.copied))

    def _capture(self, fn: Callable, inputs: tuple[torch.Tensor, ...], transient: bool) -> _Piece | None:
        """fn captured over static copies of the inputs that are not output buffers of earlier pieces (for a
        transient piece, not of earlier non-transient ones); None where it cannot be (an op that cannot be captured
        here: eager from now on)."""
        read_in_place = [self._is_output(t, transient) for t in inputs]
        shared = tuple((i, t) for i, t in enumerate(inputs) if read_in_place[i])
        copied = tuple(i for i, in_place in enumerate(read_in_place) if not in_place)

        @functools.wraps(fn)  # (fn's name: what the piece is)
        def bound(*statics: torch.Tensor):
            args = dict(shared)  # (not the first call's copied inputs: the statics stand for them)
            args.update(zip(copied, statics))
            return fn(*(args[i] for i in range(len(read_in_place))))
        if transient and self._transient_pool is None:  # (no CUDA: a test's stand-in for the captures)
            self._transient_pool = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else object()
        try:
            call = CapturedCall(bound, tuple(inputs[i] for i in copied), self._transient_pool if transient else None)
        except Exception:
            return None
        for t in call.output if isinstance(call.output, tuple) else (call.output,):
            self._outputs[id(t)] = (weakref.ref(t), transient)
        return _Piece(call, shared, copied)

    def _is_output(self, t: torch.Tensor, transient: bool) -> bool:
        """Whether `t` is a piece's output buffer that a piece (`transient` or not) may read in place."""
        ref, from_transient = self._outputs.get(id(t), (None, False))
        return ref is not None and ref() is t and not (transient and from_transient)

    def forget(self, key: tuple) -> None:
        """The graph captured for `key` dropped (its memory given back): what it read moved, or it is not needed."""
        self._captured.pop(key, None)

    def clear(self) -> None:
        self._captured.clear()
        self._outputs.clear()
        self._transient_pool = None  # (its memory goes with the last graph captured into it)


@dataclass
class _Piece:
    """A captured piece: its call, the inputs it reads in place (index, the buffer) and those it copies."""
    call: CapturedCall
    shared: tuple[tuple[int, torch.Tensor], ...]
    copied: tuple[int, ...]


class RoutingPieces:
    """A layer's router and its finish as two fixed-shape pieces of a step (StepGraphs), for a layer whose routed
    work runs between them (its experts not all pooled, or a pool that runs no layer's FFN whole): the
    family's `route_attended` (the attention's output, the router) gives the hidden rows and its Routing, whose
    tensors are the piece's outputs (a piece returns tensors; the Routing, a family's dataclass, is made again
    around them from the one its capture made); `finish(layer, w, hidden, routing, routed)` gives the rows and
    whether they are finite."""

    def __init__(self, arithmetic, finish: Callable):
        self.arithmetic, self._finish = arithmetic, finish
        # (layer, rows) -> (the names of its tensor fields, a Routing its piece made, those fields None)
        self._routings: dict[tuple[int, int], tuple[list[str], object]] = {}

    def route(self, graphs: StepGraphs, layer: int, w, ids: torch.Tensor, attended: tuple[torch.Tensor, ...]):
        """(the hidden rows, the Routing) of the layer's router, a piece per (layer, rows)."""
        key = (layer, ids.shape[0])

        def route(ids: torch.Tensor, *attended: torch.Tensor) -> tuple[torch.Tensor, ...]:
            hidden, routing = self.arithmetic.route_attended(layer, w, attended, ids)
            names = _tensor_fields(routing)
            tensors = tuple(getattr(routing, name) for name in names)
            # kept without its tensors (a graph's outputs would keep the graph's memory once it is dropped)
            self._routings[key] = names, copy.copy(routing)
            for name in names:
                setattr(self._routings[key][1], name, None)
            return (hidden, *tensors)
        hidden, *tensors = graphs.run(("route", *key), route, ids, *attended)
        return hidden, self._rebuilt(key, tensors)

    def finish(self, graphs: StepGraphs, layer: int, w, hidden: torch.Tensor, routing, routed: torch.Tensor):
        """(the hidden rows, whether they are finite) of the layer's finish, a piece per (layer, rows)."""
        key = (layer, hidden.shape[0])

        def finish(hidden: torch.Tensor, routed: torch.Tensor, *tensors: torch.Tensor):
            return self._finish(layer, w, hidden, self._rebuilt(key, tensors), routed)
        names, _ = self._routings[key]
        return graphs.run(("finish", *key), finish, hidden, routed, *(getattr(routing, name) for name in names))

    def _rebuilt(self, key: tuple[int, int], tensors) -> object:
        names, routing = self._routings[key]
        routing = copy.copy(routing)
        for name, t in zip(names, tensors):
            setattr(routing, name, t)
        return routing


def _tensor_fields(routing) -> list[str]:
    """The fields of a Routing (a dataclass) that hold tensors, in their order."""
    return [f.name for f in fields(routing) if isinstance(getattr(routing, f.name), torch.Tensor)]


class ExpertPool:
    """The routed experts of every layer in device slots (module docstring), each slot holding one expert's
    decoded weights: gate and up side by side `gate_up [slots, 2I, H]` and `down [slots, H, I]` (the expert dtype).
    `cache` is the ExpertCache whose entries the slots are (its `store` is this pool); `slot_bytes` what one
    expert takes in its budget. The stacks are allocated at the first expert kept, as many slots as the budget
    holds then (at most every routed expert). StoredExpertPool keeps the experts' stored bytes instead."""

    form = "decoded"  # what a slot holds
    whole_ffn = True  # a layer whose experts are all pooled runs its whole FFN as one piece (the routed work in it)

    def __init__(self, cache, layers: int, experts: int, inter: int, hidden: int, dtype: torch.dtype,
                 device: torch.device, activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 graphs: bool | None = None, *, routed_experts: int | None = None):
        self.cache, self.layers, self.experts = cache, layers, experts
        # the routed experts of all layers, the most slots ever used (a layer without routed experts takes none)
        self.routed_experts = layers * experts if routed_experts is None else routed_experts
        self.inter, self.hidden, self.dtype, self.device = inter, hidden, dtype, device
        self.activation = activation  # the family's, between the two matmuls: act(gate x) * (up x)
        self.decoded_bytes = 3 * inter * hidden * dtype.itemsize  # one expert's three matrices, decoded
        self.slot_bytes = self.decoded_bytes
        # the step's fixed-shape pieces in CUDA graphs (these stacks' routed work, and the Decoder's)
        self.graphs = StepGraphs(device.type == "cuda" if graphs is None else graphs and device.type == "cuda",
                                 device)
        self.capacity = 0
        self.stacks: list[torch.Tensor] = []
        self.slot_of = torch.full((layers, experts), -1, dtype=torch.int64, device=device)
        self._slots: dict[tuple[int, int], int] = {}  # the table's host mirror
        self._pooled = [0] * layers  # experts pooled per layer
        self._free: list[int] = []
        self._pinned: set[tuple[int, int]] = set()
        self._deferred: list[int] = []  # slots of pinned experts evicted: free after the layer
        # slots held apart from the cache's (its `reserved`) for the misses it refuses, reused by every layer; the
        # layer in progress's refused misses in them (the first of them, in order)
        self._scratch: list[int] = []
        self._in_scratch: dict[tuple[int, int], int] = {}
        self.scratch_runs = 0  # experts run from a scratch slot (misses the cache refused, entries kept elsewhere)
        self.syncs = 0  # host synchronisations the routed work needed (a layer not complete, once a step)
        self.calls = 0  # layers' routed work run over the pool (counted by the caller)

    @property
    def gate_up(self) -> torch.Tensor | None:
        return self.stacks[0] if self.stacks else None

    @property
    def down(self) -> torch.Tensor | None:
        return self.stacks[1] if self.stacks else None

    def _slot_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """What a slot holds: one (shape, dtype) per stack."""
        return [((2 * self.inter, self.hidden), self.dtype), ((self.hidden, self.inter), self.dtype)]

    # --- slots -----------------------------------------------------------------------------------------------
    def complete(self, layer: int) -> bool:
        """Whether every expert of `layer` is pooled: its routed work needs nothing from the host."""
        return self._pooled[layer] == self.experts

    def holds(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self._slots

    def slot(self, layer: int, expert: int) -> int | None:
        return self._slots.get((layer, expert))

    @property
    def reserved_bytes(self) -> int:
        """The device memory the stacks take (all their slots, used or not)."""
        return self.capacity * self.slot_bytes

    @property
    def scratch_bytes(self) -> int:
        """Of the cache's budget, what the scratch slots take (its `reserved`: not the entries')."""
        return len(self._scratch) * self.slot_bytes

    def _new_stacks(self, capacity: int) -> list[torch.Tensor]:
        return [torch.empty(capacity, *shape, dtype=dtype, device=self.device) for shape, dtype in self._slot_shapes()]

    def _allocate(self, capacity: int) -> None:
        self.stacks = self._new_stacks(capacity)  # (first: where it fails, the pool still has no capacity)
        self.capacity = capacity
        self._slot_ids = torch.arange(capacity, device=self.device)
        self._free = list(range(capacity - 1, -1, -1))  # popped from the end: slot 0 first
        self.graphs.clear()  # the graphs read the old stacks

    def _stacks_ready(self) -> bool:
        """Whether there are stacks: allocated at the first expert kept, as many slots as the budget holds then."""
        if not self.stacks:
            capacity = min(self.cache.budget // self.slot_bytes, self.routed_experts)
            if capacity <= 0:
                return False
            self._allocate(capacity)
        return True

    def _free_slot(self) -> int | None:
        """A free slot, the cache's least recently used evicted for it where none is; None where none can be."""
        if not self._stacks_ready():
            return None
        while not self._free and len(self.cache):
            self.cache.evict_oldest()  # its slot comes back through dropped()
        return self._free.pop() if self._free else None

    def put(self, layer: int, expert: int, content):
        """Copy an expert (its decoded weights, ExpertWeights: `_slot_content`) into a slot; the cache's entry for
        it (views of the slot), or None where it cannot be pooled (no room, or content the pool does not take)."""
        if (layer, expert) in self._slots:
            return None
        parts = self._slot_content(layer, content)
        slot = self._free_slot() if parts is not None else None
        if slot is None:
            return None
        self._fill(layer, expert, slot, parts)
        self._slots[(layer, expert)] = slot
        self._pooled[layer] += 1
        return self.entry(layer, slot)

    def put_scratch(self, layer: int, expert: int, content):
        """Copy an expert not in a slot (a miss the cache's admission refused, or an entry it keeps outside the
        slots) into a scratch slot for the layer in progress (inside `pinned`, which frees it for the next layer), so
        that the layer still runs as one pooled call and the cache keeps what it holds: views of the slot (`entry`),
        or None where no scratch slot can be had (the layer then runs expert by expert), the pool does not take the
        content or the expert is in a slot already."""
        parts = self._slot_content(layer, content)
        slot = self._scratch_slot() if parts is not None and not self.in_slots(layer, expert) else None
        if slot is None:
            return None
        self._fill(layer, expert, slot, parts)
        self._in_scratch[(layer, expert)] = slot
        self.scratch_runs += 1
        return self.entry(layer, slot)

    def _scratch_slot(self) -> int | None:
        """The layer's next scratch slot. Where all are in use, one more is taken from the budget, so that the
        scratch grows to the most refused misses one layer has had (at most its distinct experts at the largest
        batch seen): a free slot, else the cache's least recently used entry's (not one the layer uses: that slot
        is not free before the layer ends). None where none can be had."""
        if len(self._in_scratch) < len(self._scratch):
            return self._scratch[len(self._in_scratch)]
        if not self._stacks_ready():
            return None
        if not self._free and self.cache.oldest() not in (None, *self._pinned):
            self.cache.evict_oldest()  # its slot comes back through dropped()
        if not self._free:
            return None
        slot = self._free.pop()
        self._scratch.append(slot)
        return slot

    def in_slots(self, layer: int, expert: int) -> bool:
        """Whether the expert is in a slot for the layer in progress: kept, or in a scratch slot."""
        return (layer, expert) in self._slots or (layer, expert) in self._in_scratch

    def _fill(self, layer: int, expert: int, slot: int, parts: list[torch.Tensor]) -> None:
        """`parts` (_slot_content's) copied into `slot`, the table pointing the expert there."""
        for target, part in zip(self._slot_parts(slot, parts), parts):
            target.copy_(part)
        self.slot_of[layer, expert] = slot

    def _slot_content(self, layer: int, weights: ExpertWeights) -> list[torch.Tensor] | None:
        """What goes into a slot's parts (`_slot_parts`), or None where the weights are not pooled (the fused CPU
        kernel's, kept packed)."""
        if weights.kernel is not None:
            return None
        gate, up, down = weights.w1, weights.w3, weights.w2
        if weights.input_order is not None:  # MXFP4's pair order undone: the pool's inputs come in column order
            gate, up = (_columns_in_order(w, weights.input_order) for w in (gate, up))
        if weights.hidden_order is not None:
            down = _columns_in_order(down, weights.hidden_order)
        return [gate, up, down]

    def _slot_parts(self, slot: int, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Where each of `parts` (_slot_content's) goes in the slot."""
        inter = self.inter
        return [self.gate_up[slot, :inter], self.gate_up[slot, inter:], self.down[slot]]

    def entry(self, layer: int, slot: int):
        """The cache's entry for the expert of `layer` in `slot`: views of the slot."""
        return self.weights(slot)

    def weights(self, slot: int) -> ExpertWeights:
        return ExpertWeights(self.gate_up[slot, :self.inter], self.gate_up[slot, self.inter:], self.down[slot])

    def dropped(self, key: tuple[int, int]) -> None:
        """The cache dropped `key` (evicted, or dropped by the seed): its slot is free (after the layer in
        progress, where that layer uses it)."""
        slot = self._slots.pop(key, None)
        if slot is None:
            return
        self.slot_of[key] = -1
        self._pooled[key[0]] -= 1
        (self._deferred if key in self._pinned else self._free).append(slot)

    def budget_changed(self, budget: int) -> None:
        """The cache's budget changed (its entries already fit it): the stacks are reallocated to it, so that the
        device memory follows the budget, smaller or larger (a budget shrunk for a long sequence's KV grows back
        once that KV is freed). The scratch keeps its slots, at most half the new ones (the cache's room is not
        left to it: it grows again where a layer needs more). Where the device has no room for any stacks, not even
        the old ones again, the pool empties (`_empty`): its experts are read again as misses."""
        capacity = min(budget // self.slot_bytes, self.routed_experts)
        if not self.stacks or capacity == self.capacity:
            return
        scratch, kept = min(len(self._scratch), capacity // 2), list(self._slots)
        try:
            if capacity > self.capacity:
                self._grow(capacity)
            else:
                self._shrink(capacity)
        except torch.OutOfMemoryError:  # no stacks could be had at all, not even the old ones again
            self._empty(kept)
            return
        if self.capacity:  # the scratch's first slots again (none in use between layers)
            self._free.extend(self._scratch[scratch:])
            del self._scratch[scratch:]

    def _shrink(self, capacity: int) -> None:
        """The stacks reallocated smaller, the kept experts moved to the first slots, the scratch's after them. The
        kept experts wait on the host meanwhile (the budget shrinks where the device lacks room: old and new stacks
        side by side might not fit)."""
        kept = list(self._slots.items())
        index = torch.tensor([slot for _, slot in kept], dtype=torch.long, device=self.device)
        saved = [stack.index_select(0, index).cpu() for stack in self.stacks]
        scratch = len(self._scratch)
        self._drop_views()
        self.release()
        if capacity <= 0:
            return
        self._allocate(capacity)
        for stack, old in zip(self.stacks, saved):
            stack[:len(kept)].copy_(old)
        for new, (key, _) in enumerate(kept):
            self.slot_of[key] = new
            self._slots[key] = new
            self._pooled[key[0]] += 1
        self._scratch = list(range(len(kept), min(len(kept) + scratch, capacity)))
        self._free = [s for s in self._free if s >= len(kept) + len(self._scratch)]
        self._views_back()

    def _grow(self, capacity: int) -> None:
        """The stacks reallocated larger, every slot copied to the same place in the new ones (the table stays):
        side by side on the device, else through the host (the old stacks freed first), else (no room for the new
        ones even so) the old capacity again."""
        old, old_capacity = self.stacks, self.capacity
        try:
            stacks = self._new_stacks(capacity)
        except torch.OutOfMemoryError:
            old = [stack.cpu() for stack in old]
            self._drop_views()
            self.stacks = []
            self.graphs.clear()  # (the captures read the old stacks)
            try:
                stacks = self._new_stacks(capacity)
            except torch.OutOfMemoryError:
                stacks, capacity = self._new_stacks(old_capacity), old_capacity
        for stack, before in zip(stacks, old):
            stack[:old_capacity].copy_(before)
        self.stacks, self.capacity = stacks, capacity
        self._slot_ids = torch.arange(capacity, device=self.device)
        self._free = list(range(capacity - 1, old_capacity - 1, -1)) + self._free  # the old free ones first
        self.graphs.clear()
        self._views_back()

    def _empty(self, kept: list[tuple[int, int]]) -> None:
        """The pool without stacks and its experts (`kept`) out of the cache: read again as misses."""
        self.release()
        for key in kept:
            self.cache.drop(key)

    def _drop_views(self) -> None:
        """The cache's entries (views of the stacks) let go, so that the old stacks can be freed."""
        for key in self._slots:
            self.cache.replace(key, None)

    def _views_back(self) -> None:
        """The cache's entries views of the stacks now."""
        for key, slot in self._slots.items():
            self.cache.replace(key, self.entry(key[0], slot))

    @contextlib.contextmanager
    def pinned(self, layer: int, experts: Iterable[int]):
        """While the block runs, a slot of these experts is not reused even if the cache evicts them; the scratch
        slots the block took (put_scratch) are freed for the next layer when it ends."""
        self._pinned = {(layer, e) for e in experts}
        try:
            yield
        finally:
            self._pinned = set()
            self._free.extend(self._deferred)
            self._deferred.clear()
            for key in self._in_scratch:
                self.slot_of[key] = -1
            self._in_scratch.clear()

    # --- a layer's routed work ---------------------------------------------------------------------------------
    def routed(self, layer: int, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
               graphed: bool = True) -> torch.Tensor:
        """The routed experts of B rows summed ([B, H] float32): x [B, H] (the FFN input), experts [B, k] the
        chosen ids and weights [B, k] their routing weights, all on the device; every chosen expert must be
        pooled. A CUDA graph per (layer, B) where `graphed` (not inside another capture) and the graphs are on: a
        transient piece (StepGraphs), its output used by the layer's finish at once."""
        x = x.to(self.dtype)
        if not graphed:
            return self._routed(layer, x, experts, weights)
        return self.graphs.run(("routed", layer, x.shape[0]), functools.partial(self._routed, layer), x, experts,
                               weights, transient=True)

    def _routed(self, layer: int, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        experts, by_id = experts.sort(dim=1)  # each row's terms summed in ascending expert id
        slots = self.slot_of[layer].index_select(0, experts.reshape(-1))  # [P] pairs, row-major
        terms = self._terms(layer, x, slots, experts.shape[1])  # [P, H]
        # each row's terms times their routing weights, summed in choice order (ExpertGroups.combine's)
        terms, weights = terms.view(*experts.shape, -1), weights.gather(1, by_id)
        acc = torch.zeros(x.shape[0], terms.shape[2], dtype=torch.float32, device=terms.device)
        for j in range(experts.shape[1]):
            acc.addcmul_(terms[:, j].float(), weights[:, j, None].float())
        return acc

    def _terms(self, layer: int, x: torch.Tensor, slots: torch.Tensor, top_k: int) -> torch.Tensor:
        """Each (row, choice) pair's expert output [P, H] (row-major: pair p is row p // top_k), `slots` [P] the
        pairs' slots: one grouped GEMM over the whole pool for gate and up, one for down."""
        order = torch.argsort(slots, stable=True)
        sorted_slots = slots.index_select(0, order)
        ends = torch.searchsorted(sorted_slots, self._slot_ids, right=True).to(torch.int32)
        pairs = x.index_select(0, order // top_k)  # [P, H] sorted by slot
        both = self._pool_matmul(pairs, self.gate_up, ends, sorted_slots)
        hidden = self.activation(both[:, :self.inter], both[:, self.inter:])
        out = self._pool_matmul(hidden, self.down, ends, sorted_slots)
        positions = torch.arange(order.numel(), device=order.device)
        back = torch.empty_like(order).scatter_(0, order, positions)  # order's inverse
        return out.index_select(0, back)

    def _pool_matmul(self, a: torch.Tensor, stack: torch.Tensor, ends: torch.Tensor, slots: torch.Tensor
                     ) -> torch.Tensor:
        """Each row of `a` (sorted by slot: `slots` each row's, `ends` every slot's end row, on the device) times
        its slot's matrix of `stack` [capacity, N, K]: one grouped GEMM over the whole pool, or where it has more
        slots than CUDA's kernel takes groups, one per run of slots, each over every row (its first group, the
        slot before the run, takes the rows of the runs before: computed and dropped), the rows picked by their
        slot on the device."""
        b = stack.transpose(1, 2)
        limit = grouped_experts.MAX_GROUPS
        if self.capacity <= limit:
            return grouped_matmul(a, b, None, ends)
        out = None
        for first in range(0, self.capacity, limit - 1):
            stop = min(first + limit - 1, self.capacity)
            lead = max(first - 1, 0)
            part = grouped_matmul(a, b[lead:stop], None, ends[lead:stop])
            # rows past the run's last end are not written by the kernel: only the run's own rows are taken
            out = part if out is None else torch.where(((slots >= first) & (slots < stop))[:, None], part, out)
        return out

    def release(self) -> None:
        """The stacks freed (the table and its host mirror emptied; the caller empties the cache)."""
        self.stacks = []
        self.slot_of.fill_(-1)
        self.capacity, self._free = 0, []
        self._slots.clear()
        self._scratch, self._in_scratch = [], {}
        self._pooled = [0] * self.layers
        self.graphs.clear()


@dataclass(frozen=True)
class _StoredMatrix:
    """Where one of an expert's matrices lies in its region's bytes, the same in every expert of a layer: its
    storage type, shape and byte span, its block scale's (type, shape, span) and its tensor scale's span, if any."""
    dtype: str
    shape: tuple[int, ...]
    span: tuple[int, int]
    scale: tuple[str, tuple[int, ...], tuple[int, int]] | None
    tensor_scale: tuple[int, int] | None

    def decode(self, stack: torch.Tensor, slots: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The matrix of each slot in `slots` (a device tensor) from the slots' bytes `stack` [capacity, bytes]:
        [len(slots), *shape], decoded side by side, nothing asked of the host."""
        def gathered(span):
            return stack[:, span[0]:span[1]].index_select(0, slots)
        scale = None
        if self.scale is not None:
            dtype, shape, span = self.scale
            scale = decode_tensor(dtype, (len(slots), *shape), gathered(span).reshape(-1))
        # (the bytes were checked as they were read; a GPU's decode never reads a tensor scale back to check it)
        factors = gathered(self.tensor_scale).view(torch.float32).reshape(-1) if self.tensor_scale else None
        return decode_side_by_side(self.dtype, self.shape, gathered(self.span), scale, factors, out_dtype)

    def fp4(self) -> stored_gemv.Fp4Matrix | None:
        """Where the stored FP4 kernel reads this matrix (FP4_E2M1, E8M0 scales, no tensor scale), else None."""
        return stored_gemv.fp4_matrix(self.dtype, self.shape, self.span, self.scale, self.tensor_scale)


def stored_layout(region, names: dict[str, str]) -> dict[str, _StoredMatrix] | None:
    """{"gate" | "up" | "down": where that matrix lies in `region`'s bytes} (names: the family's, ExpertNaming's);
    None where a matrix is missing, not 2-D or has companions the pool does not decode."""
    by_name = {t.name: t for t in region.tensors}
    layout = {}
    for role, name in names.items():
        t = by_name.get(name)
        if t is None or len(t.shape) != 2:
            return None
        def span(entry):
            return entry.file_offset - region.offset, entry.file_offset - region.offset + entry.length
        s, ts = by_name.get(scale_name(name)), by_name.get(tensor_scale_name(name))
        if ts is not None and (ts.dtype != "F32" or tuple(ts.shape) != ()):
            return None
        layout[role] = _StoredMatrix(t.dtype, tuple(t.shape), span(t),
                                     (s.dtype, tuple(s.shape), span(s)) if s is not None else None,
                                     span(ts) if ts is not None else None)
    return layout


class StoredExpertPool(ExpertPool):
    """The pool's slots holding the experts' stored bytes (FP4, a ggml block type...) rather than their decoded
    weights: 3.8x as many FP4 experts in the same device memory, where the decoded ones do not all fit (the full
    model's routed experts decoded to bf16 take 4x a GPU's memory). Hits and misses are as the decoded pool's, a
    miss one copy of its bytes into a slot. A layer's routed work gathers each (row, choice) pair's bytes by slot,
    decodes them side by side (`STORED_DECODE_BYTES` of weights at a time) and runs batched matmuls (FP4 with E8M0
    scales: or the stored FP4 kernel reads them, where its selection chose it: stored_gemv.py): no host round trip;
    a transient piece between the router's and the finish's (its decoded weights, hundreds of MB a layer at the
    release's size, in the memory the transient pieces share, not held per layer and B by a graph's own).
    `layouts[layer]`: where each matrix lies in that layer's expert regions (stored_layout); `lengths[layer]` its
    longest region; a slot the longest of all."""

    form = "stored"
    whole_ffn = False  # (its routed work a transient piece between the router's and the finish's)

    def __init__(self, cache, layouts: list, lengths: list[int], experts: int, inter: int, hidden: int,
                 dtype: torch.dtype, device: torch.device, activation, graphs: bool | None = None, *,
                 routed_experts: int | None = None):
        super().__init__(cache, len(layouts), experts, inter, hidden, dtype, device, activation, graphs,
                         routed_experts=routed_experts)
        self.layouts = layouts
        self.slot_bytes = -(-max(lengths) // SLOT_ALIGN) * SLOT_ALIGN
        self.lengths = lengths  # each layer's longest region: a cache entry's bytes
        self.chunk_pairs = max(1, STORED_DECODE_BYTES // self.decoded_bytes)
        # per layer, where the stored FP4 kernel reads its three matrices (None: not all FP4 with E8M0 scales)
        self.fp4_layouts = [_fp4_layout(layout) for layout in layouts]

    def _slot_shapes(self):
        return [((self.slot_bytes,), torch.uint8)]

    def _slot_content(self, layer: int, raw: torch.Tensor) -> list[torch.Tensor] | None:
        return [raw]

    def _slot_parts(self, slot: int, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self.stacks[0][slot, :parts[0].numel()]]

    def entry(self, layer: int, slot: int) -> torch.Tensor:
        return self.stacks[0][slot, :self.lengths[layer]]

    def _terms(self, layer: int, x: torch.Tensor, slots: torch.Tensor, top_k: int) -> torch.Tensor:
        pairs = x[:, None, :].expand(-1, top_k, -1).reshape(-1, x.shape[1])  # [P, H]: pair p is row p // top_k
        fp4 = self.fp4_layouts[layer]
        if fp4 is None:
            return self._decoded_terms(layer, slots, pairs)
        # the stored FP4 kernel or torch's decode, as the selection chose for this shape class (stored_gemv.py)
        return stored_gemv.pairs_result(self.stacks[0], pairs, [fp4[role] for role in _ROLES],
                                        lambda: self._fp4_terms(fp4, slots, pairs),
                                        lambda: self._decoded_terms(layer, slots, pairs))

    def holds_more(self, budget: int) -> bool:
        """Whether, at `budget`, this pool is the better form: the budget does not hold every routed expert
        decoded, and a slot of stored bytes is at most three quarters of a decoded one (a third more experts or
        more: Q8_0 1.9x, FP8 2x, FP4 3.8x; a hit decodes, but a miss reads the disk)."""
        return budget < self.routed_experts * self.decoded_bytes and 4 * self.slot_bytes <= 3 * self.decoded_bytes

    def _decoded_terms(self, layer: int, slots: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        """Each pair's expert output [P, H] (the expert dtype): its matrices decoded side by side (a chunk of pairs
        at a time) and batched matmuls."""
        terms = torch.empty(pairs.shape, dtype=self.dtype, device=pairs.device)
        stack, layout = self.stacks[0], self.layouts[layer]
        for first in range(0, slots.numel(), self.chunk_pairs):
            part = slice(first, first + self.chunk_pairs)
            w = {role: m.decode(stack, slots[part], self.dtype) for role, m in layout.items()}
            xs = pairs[part, None, :]  # [c, 1, H]
            hidden = self.activation(torch.bmm(xs, w["gate"].transpose(1, 2)), torch.bmm(xs, w["up"].transpose(1, 2)))
            terms[part] = torch.bmm(hidden, w["down"].transpose(1, 2))[:, 0]
        return terms

    def _fp4_terms(self, fp4: dict[str, stored_gemv.Fp4Matrix], slots: torch.Tensor, pairs: torch.Tensor
                   ) -> torch.Tensor:
        """_decoded_terms by the stored FP4 kernel, from the slots' bytes ([P, H] float32): gate and up rounded to
        the expert dtype before the activation, as torch's bmm gives them (by torch: to nearest, as a GPU's kernel
        would, where Triton's interpreter truncates)."""
        stack = self.stacks[0]
        gate, up = (stored_gemv.fp4_pairs_matmul(stack, slots, pairs, fp4[role]).to(self.dtype)
                    for role in ("gate", "up"))
        return stored_gemv.fp4_pairs_matmul(stack, slots, self.activation(gate, up), fp4["down"])


_ROLES = ("gate", "up", "down")


def _fp4_layout(layout: dict) -> dict | None:
    """{role: stored_gemv.Fp4Matrix} of a layer's stored layout, or None where a matrix is not one the stored FP4
    kernel reads."""
    matrices = {role: layout[role].fp4() for role in _ROLES if role in layout}
    return matrices if len(matrices) == len(_ROLES) and None not in matrices.values() else None


# decoded weights a stored pool's layer holds at once (a chunk of its pairs): with the decode's own transients (the
# gathered bytes, FP4's int64 indices) about half a GiB, inside the memory checks' HEADROOM_BYTES
STORED_DECODE_BYTES = 256 << 20


def _columns_in_order(w: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """w whose column j holds logical column order[j], with its columns put in logical order."""
    out = torch.empty_like(w)
    out[:, order.to(w.device)] = w
    return out


def container_pool(cache, blocks, naming, activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   dtype: torch.dtype, device: torch.device, graphs: bool | None = None, stored: bool = False
                   ) -> ExpertPool | None:
    """The pool for a container's routed experts (`naming`: the family's ExpertNaming, by layer; `activation` its
    act(gate x) * (up x)), keeping them decoded (or their stored bytes: `stored`), or None where they do not stack
    (experts of other shapes, layers with other counts; stored: a layer whose experts lie differently in their
    regions) or, decoded, torch's grouped GEMM does not take them here."""
    # (layers without routed experts, e.g. a family's dense-MLP layers, take no slots)
    shapes, counts = set(), {len(b.experts) for b in blocks if b.experts}
    layouts: list[dict | None] = []
    for layer, block in enumerate(blocks):
        placed = set()
        for region in block.experts:
            shape_of = {t.name: tuple(t.shape) for t in region.tensors}
            names = naming.names(layer, region.expert)
            shapes.add(tuple(shape_of.get(names[m]) for m in _ROLES))
            if stored:
                layout = stored_layout(region, names)
                placed.add(tuple(layout.values()) if layout is not None else None)
        if stored and (None in placed or len(placed) > 1):
            return None
        layouts.append(dict(zip(_ROLES, placed.pop())) if placed else {})
    if len(shapes) != 1 or len(counts) != 1:
        return None
    gate, up, down = shapes.pop()
    if gate is None or len(gate) != 2 or up != gate or down != gate[::-1]:
        return None
    inter, hidden = gate
    routed = sum(len(b.experts) for b in blocks)
    if stored:
        lengths = [max((r.length for r in b.experts), default=0) for b in blocks]
        return StoredExpertPool(cache, layouts, lengths, counts.pop(), inter, hidden, dtype, device, activation,
                                graphs, routed_experts=routed)
    if not pool_usable(dtype, device, inter, hidden):
        return None
    return ExpertPool(cache, len(blocks), counts.pop(), inter, hidden, dtype, device, activation, graphs,
                      routed_experts=routed)


SLOT_ALIGN = 64  # a stored slot's length rounds up to this: every slot's bytes start aligned for any dtype's view
