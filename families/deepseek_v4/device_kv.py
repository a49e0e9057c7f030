"""DeepSeek-V4's decode KV on a CUDA device in fixed places, so that a layer's attention for every row of a step is
one fixed-shape piece (a CUDA graph per layer, rows and entry bucket), not per-row ops whose shapes grow a token at
a time (model.TokenKV, the CPU's).

A `KVArena` holds, per layer, every decoding sequence's state in slots of preallocated tensors:
- the sliding window as a ring of `sliding_window` rows (a token's key at position p goes to row p % window: the
  ring holds exactly the keys a token attends to, the rows not yet written masked);
- each compressor's current window as a ring of `rate` rows (raw projections, the token at p in row p % rate),
  CSA's overlap (a window's first series, ape included) in two parities by entry: window e writes parity e % 2 at
  each of its tokens (complete at its last) and its close reads parity (e + 1) % 2, window e - 1's, so a piece run
  twice, as a capture runs it, computes the same; and its entries in pages of ENTRY_PAGE rows (with their copy in
  the products' dtype) from a pool every slot takes from, each slot's pages in its row of a device page table: a
  sequence holds about its own entries, not every slot the longest sequence's.

A step's rows give their slots and positions as one small device tensor; everything else follows on the device.
Every row's compressor window is pooled every step (compress's arithmetic, close_windows' order) and its entry
written at index position // rate, which counts only once the window is full (the masks read the count from the
positions): no host decision per row. The entries a row attends to are the bucket's prefix (`entry_bucket`: a
power of two at least the rows' largest count, so that a graph serves many tokens), masked past its count; a CSA
layer whose bucket exceeds index_topk picks them with the Lightning Indexer over the same prefix (its scores
-inf past the count), as model.attention_token does once a sequence has more than index_topk entries (with fewer,
the picks past the count are masked: every complete entry, as there).

A sequence takes a slot when it starts (`admit`: its prefill state checked first, refused in one line before any
memory is taken; then written in, the slot's rows and pages it does not fill zero, so that a masked read never
meets the last sequence's values) and gives it back when its states are dropped (its pages at the next step);
the arena grows by doubling (slots, a layer's page pool or page table), which makes its graphs stale
(`generation`); a page pool at most a quarter in use is made anew at twice that, and the arena is dropped whole
when its last sequence leaves (`arena_bytes` bounds what it holds). `ArenaKV.state()` hands the state on as a
prefill would (LayerKVState).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from moepack.backends.device_copier import to_device_async
from moepack.backends.kv_arena import ArenaSlot, SlotArena, bucket_for, grown, next_generation, slots_for
from moepack.format_spec.errors import MoepackError

from . import model
from .config import CSA, SLIDING, ModelConfig
from .kv import CompressorState, LayerKVState

ENTRY_BUCKET_MIN = 16  # the fewest entries a bucket holds (a new graph per bucket: few while a prompt is short)
ENTRY_PAGE = ENTRY_BUCKET_MIN  # entries per page of a layer's entry pool (a bucket is a whole number of pages)


def entry_bucket(count: int) -> int:
    """The entries a step's attention reads for rows of at most `count` complete entries."""
    return bucket_for(count, ENTRY_BUCKET_MIN)


def arena_bytes(cfg: ModelConfig, lengths: Sequence[int], low: torch.dtype, arena: KVArena | None = None) -> int:
    """The most a KVArena whose products are in `low` holds for sequences decoding together of at most `lengths`
    tokens each (prompt and new tokens), from the config: their slots (doubled from `arena`'s, or a new arena's
    one) of every layer's window ring and compressor rings; each compressor's page pool at most twice the pages
    they use (a pool grows to at most twice what is in use then, and is made anew at twice that) and its page
    table twice the widest bucket's pages (at least `arena`'s); plus one layer's tensors, which a growth holds
    beside their new ones while it copies them."""
    live = arena.layers if arena is not None else None
    slots = slots_for(len(lengths), arena.slots if live else 1)
    f32, copy = 4, 0 if low == torch.float32 else low.itemsize  # (entries and window: float32 and their copy)
    longest = max(lengths, default=0)
    sizes = []
    for layer, kind in enumerate(cfg.layer_types):
        size = slots * cfg.sliding_window * cfg.head_dim * (f32 + copy)
        for name, *_ in model.TOKEN_COMPRESSORS[kind]:
            rate, d = cfg.compress_rates[layer], cfg.head_dim if name == "compressor" else cfg.index_head_dim
            # its window's kv and gate (CSA: twice as wide, and its overlap's two parities of each)
            size += slots * f32 * (2 * rate * 2 * d + 2 * 2 * rate * d if kind == CSA else 2 * rate * d)
            entries = live[layer].compressors[name].entries if live else None
            # a row writes entry position // rate, and reserves one past it
            in_use = sum(-(-(n // rate + 1) // ENTRY_PAGE) for n in lengths)
            pages = max(2, 2 * in_use, entries.pages.rows.shape[0] if entries else 0)
            widest = 2 * entry_bucket(longest // rate + 1) // ENTRY_PAGE
            columns = max(widest, entries.table.shape[1] if entries else 1)
            size += pages * ENTRY_PAGE * d * (f32 + copy) + slots * columns * 8
        sizes.append(size)
    return sum(sizes) + max(sizes, default=0)


def check_state(cfg: ModelConfig, layer: int, state: LayerKVState) -> None:
    """Refuses, in one line naming the layer, a state that is not a prefill's of this model (its kind, counts,
    shapes, float tensors): before the arena takes any memory or slot for it."""
    kind, seen = cfg.layer_types[layer], state.seen_tokens
    if state.layer_type != kind:
        raise MoepackError(f"layer {layer}: past state of a {state.layer_type} layer, the model has {kind}")
    if not isinstance(seen, int) or seen < 0:
        raise MoepackError(f"layer {layer}: its state's token count {seen!r} is not a count")

    def rows(t: Tensor | None, what: str, shape: tuple[int, int]) -> None:
        if not isinstance(t, Tensor) or not t.is_floating_point() or tuple(t.shape) != shape:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else "missing"
            raise MoepackError(f"layer {layer}: its {what} state is {got} after {seen} tokens, not {shape} floats")

    rows(state.window_kv, "window", (min(seen, cfg.sliding_window - 1), cfg.head_dim))
    for name, *_ in model.TOKEN_COMPRESSORS[kind]:
        part, rate = getattr(state, name), cfg.compress_rates[layer]
        if part is None:
            raise MoepackError(f"layer {layer}: a {kind} layer's state lacks its {name}")
        d = cfg.head_dim if name == "compressor" else cfg.index_head_dim
        width = 2 * d if kind == CSA else d
        if part.entry_count != seen // rate:
            raise MoepackError(f"layer {layer}: its {name} state counts {part.entry_count!r} entries after {seen} "
                               f"tokens at rate {rate}: not a prefill's")
        rows(part.compressed_kv, f"{name} entries", (seen // rate, d))
        for what, t in (("buffer_kv", part.buffer_kv), ("buffer_gate", part.buffer_gate)):
            rows(t, f"{name} {what}", (seen % rate, width))
        if kind == CSA and seen // rate:
            for what, t in (("overlap_kv", part.overlap_kv), ("overlap_gate", part.overlap_gate)):
                rows(t, f"{name} {what}", (rate, d))


class _Rows:
    """A float32 tensor [slots, rows, width] and its copy in the products' dtype (the same tensor in float32)."""

    def __init__(self, slots: int, rows: int, width: int, low: torch.dtype, device: torch.device):
        self.rows = torch.zeros(slots, rows, width, dtype=torch.float32, device=device)
        self.low = self.rows if low == torch.float32 else self.rows.to(low)

    def write(self, slots: Tensor, index: Tensor, values: Tensor) -> None:
        """values [B, width] into row index[b] of slot slots[b]."""
        self.rows[slots, index] = values
        if self.low is not self.rows:
            self.low[slots, index] = values.to(self.low.dtype)

    def load(self, slot: int, index: Tensor, values: Tensor) -> None:
        """A state's rows [n, width] into slot `slot` at the rows `index` names, the slot's other rows zero."""
        index = index.to(self.rows.device)
        self.rows[slot].zero_()
        self.rows[slot].index_copy_(0, index, values.float())
        if self.low is not self.rows:
            self.low[slot].zero_()
            self.low[slot].index_copy_(0, index, values.to(self.low.dtype))

    def zero(self, index: Tensor) -> None:
        """The slots `index` names zero."""
        self.rows.index_fill_(0, index, 0.0)
        if self.low is not self.rows:
            self.low.index_fill_(0, index, 0.0)

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.rows,) if self.low is self.rows else (self.rows, self.low)

    def grow(self, dim: int, size: int) -> None:
        same = self.low is self.rows
        self.rows = grown(self.rows, dim, size)
        self.low = self.rows if same else grown(self.low, dim, size)


class _Entries:
    """One compressor's entries of every slot, in pages of ENTRY_PAGE rows from a pool the slots share (a slot holds
    the pages its own entries need, not the longest sequence's), and each slot's page table [slots, pages] on the
    device. Page 0 stays zero: a table points there past a slot's pages (rows read masked, finite). A page given
    back is zeroed (its last owner's rows may not be finite), one op for all of a slot's."""

    def __init__(self, slots: int, d: int, low: torch.dtype, device: torch.device):
        self.pages = _Rows(2, ENTRY_PAGE, d, low, device)
        self.free = [1]
        self.owned: list[list[int]] = [[] for _ in range(slots)]  # the table's host mirror
        self.table = torch.zeros(slots, 1, dtype=torch.int64, device=device)
        self._changed: dict[tuple[int, int], int] = {}  # (slot, column) -> page: not yet in the device's table

    def tensors(self) -> tuple[Tensor, ...]:
        return (*self.pages.tensors(), self.table)

    def grow_slots(self, slots: int) -> None:
        self.owned += [[] for _ in range(slots - len(self.owned))]
        self.table = grown(self.table, 0, slots)

    def widen(self, entries: int) -> bool:
        """A table `entries` wide (a step's bucket); whether it moved (the graphs reading the old are stale)."""
        pages = -(-entries // ENTRY_PAGE)
        if pages <= self.table.shape[1]:
            return False
        self.table = grown(self.table, 1, max(pages, 2 * self.table.shape[1]))
        return True

    def reserve(self, slot: int, entries: int) -> bool:
        """Pages for `entries` entries in `slot` (free pages are zero); whether a tensor moved (a new pool or
        table)."""
        owned = self.owned[slot]
        moved, missing = self.widen(entries), -(-entries // ENTRY_PAGE) - len(owned)
        if missing <= 0:
            return moved
        if len(self.free) < missing:  # at least twice the pool
            size = self.pages.rows.shape[0]
            larger = max(2 * size, size + missing)
            self.pages.grow(0, larger)
            self.free[:0] = range(larger - 1, size - 1, -1)
            moved = True
        for page in (self.free.pop() for _ in range(missing)):
            self._changed[slot, len(owned)] = page
            owned.append(page)
        return moved

    def release(self, slot: int) -> None:
        """The slot's pages back to the pool, zeroed (the next owner reads their unwritten rows masked: its last
        owner's may not be finite)."""
        owned = self.owned[slot]
        if owned:
            pages = to_device_async(torch.tensor(owned, dtype=torch.int64), self.table.device)
            self.pages.zero(pages)
        self.free.extend(owned)
        self._changed.update(((slot, column), 0) for column in range(len(owned)))
        self.owned[slot] = []

    def compact(self) -> bool:
        """A pool at most a quarter in use (a long sequence gone, others going on) made anew at twice what is in
        use, the pages in use copied to its front and the table rewritten; whether it moved."""
        size, in_use = self.pages.rows.shape[0], [page for pages in self.owned for page in pages]
        if 4 * (1 + len(in_use)) > size:
            return False
        device, old = self.table.device, self.pages
        self.pages = _Rows(2 * (1 + len(in_use)), ENTRY_PAGE, old.rows.shape[-1], old.low.dtype, device)
        if in_use:
            before = to_device_async(torch.tensor(in_use, dtype=torch.int64), device)
            after = torch.arange(1, 1 + len(in_use), device=device)
            self.pages.rows[after] = old.rows[before]
            if self.pages.low is not self.pages.rows:
                self.pages.low[after] = old.low[before]
        renumbered = iter(range(1, 1 + len(in_use)))
        self.owned = [[next(renumbered) for _ in pages] for pages in self.owned]
        self.free = list(range(self.pages.rows.shape[0] - 1, len(in_use), -1))
        self.table = torch.zeros(len(self.owned), max(1, *map(len, self.owned)), dtype=torch.int64, device=device)
        self._changed = {(slot, column): page for slot, pages in enumerate(self.owned)
                         for column, page in enumerate(pages)}
        return True

    def send_table(self) -> None:
        """The table's changes written into the device's (in place: the graphs read it there), the host not
        waiting."""
        if self._changed:
            changes = torch.tensor([(*at, page) for at, page in self._changed.items()], dtype=torch.int64)
            changes = to_device_async(changes.T.contiguous(), self.table.device)
            self.table[changes[0], changes[1]] = changes[2]
            self._changed = {}

    def _rows_of(self, slot: int, count: int) -> Tensor:
        """The pool's flat row ids [count] of the slot's first `count` entries (on the device)."""
        pages = torch.tensor(self.owned[slot][:-(-count // ENTRY_PAGE)], dtype=torch.int64)
        flat = (pages[:, None] * ENTRY_PAGE + torch.arange(ENTRY_PAGE)).flatten()[:count]
        return flat.to(self.pages.rows.device)

    def load(self, slot: int, values: Tensor) -> None:
        """A state's entries [n, d] into the slot (its pages taken: reserve)."""
        flat = self._rows_of(slot, values.shape[0])
        self.pages.rows.view(-1, self.pages.rows.shape[-1]).index_copy_(0, flat, values.float())
        if self.pages.low is not self.pages.rows:
            self.pages.low.view(-1, self.pages.low.shape[-1]).index_copy_(0, flat, values.to(self.pages.low.dtype))

    def state(self, slot: int, count: int) -> Tensor:
        """The slot's first `count` entries [count, d] float32 (a copy)."""
        return self.pages.rows.view(-1, self.pages.rows.shape[-1]).index_select(0, self._rows_of(slot, count))

    def write(self, slots: Tensor, index: Tensor, values: Tensor) -> None:
        """values [B, d] as entry index[b] of slot slots[b] (inside a step's piece: the device's table)."""
        page = self.table[slots, index // ENTRY_PAGE]
        self.pages.write(page, index % ENTRY_PAGE, values)

    def prefix(self, slots: Tensor, bucket: int) -> Tensor:
        """Each row's first `bucket` entries [B, bucket, d] in the products' dtype (past its pages page 0's)."""
        pages = self.table.index_select(0, slots)[:, :bucket // ENTRY_PAGE]
        return self.pages.low[pages].flatten(1, 2)

    def gather(self, slots: Tensor, picked: Tensor) -> Tensor:
        """Row b's entries picked[b] [B, k, d] in the products' dtype."""
        return self.pages.low[self.table[slots[:, None], picked // ENTRY_PAGE], picked % ENTRY_PAGE]


class _Compressor:
    """One compressor of one layer, every slot's: its window's ring, CSA's overlap parities, its entries."""

    def __init__(self, cfg: ModelConfig, layer: int, name: str, slots: int, low: torch.dtype, device: torch.device):
        kind = cfg.layer_types[layer]
        self.rate, self.overlapping = cfg.compress_rates[layer], kind == CSA
        self.d = cfg.head_dim if name == "compressor" else cfg.index_head_dim
        width = 2 * self.d if self.overlapping else self.d
        self.buffer_kv = torch.zeros(slots, self.rate, width, device=device)
        self.buffer_gate = torch.zeros_like(self.buffer_kv)
        if self.overlapping:
            self.overlap_kv = torch.zeros(slots, 2, self.rate, self.d, device=device)
            self.overlap_gate = torch.zeros_like(self.overlap_kv)
        self.entries = _Entries(slots, self.d, low, device)

    def tensors(self) -> tuple[Tensor, ...]:
        overlap = (self.overlap_kv, self.overlap_gate) if self.overlapping else ()
        return (self.buffer_kv, self.buffer_gate, *overlap, *self.entries.tensors())

    def grow_slots(self, slots: int) -> None:
        self.buffer_kv, self.buffer_gate = (grown(t, 0, slots) for t in (self.buffer_kv, self.buffer_gate))
        if self.overlapping:
            self.overlap_kv, self.overlap_gate = (grown(t, 0, slots) for t in (self.overlap_kv, self.overlap_gate))
        self.entries.grow_slots(slots)

    def load(self, slot: int, state: CompressorState, seen: int) -> None:
        """A prefill's compressor state (check_state's) into `slot`, what it does not fill zero (finite where read
        masked: the rows of the slot's last sequence may not be)."""
        count, buffered = state.entry_count, seen % self.rate
        overlap = (self.overlap_kv, self.overlap_gate) if self.overlapping else ()
        for t in (self.buffer_kv, self.buffer_gate, *overlap):
            t[slot].zero_()
        self.entries.load(slot, state.compressed_kv)
        self.buffer_kv[slot, :buffered] = state.buffer_kv.float()
        self.buffer_gate[slot, :buffered] = state.buffer_gate.float()
        if self.overlapping:
            if count:  # entry count - 1 wrote it: the next entry reads its parity
                self.overlap_kv[slot, (count - 1) % 2] = state.overlap_kv.float()
                self.overlap_gate[slot, (count - 1) % 2] = state.overlap_gate.float()
            else:  # no window before the first: zero slots of gate -inf (model._overlap's)
                self.overlap_gate[slot, 1] = float("-inf")

    def state(self, slot: int, seen: int) -> CompressorState:
        count, buffered = seen // self.rate, seen % self.rate
        overlap = (self.overlap_kv[slot, (count - 1) % 2].clone(), self.overlap_gate[slot, (count - 1) % 2].clone()) \
            if self.overlapping and count else (None, None)
        return CompressorState(self.entries.state(slot, count), self.buffer_kv[slot, :buffered].clone(),
                               self.buffer_gate[slot, :buffered].clone(), count, *overlap)

    def add(self, slots: Tensor, positions: Tensor, kv: Tensor, gate: Tensor, ape: Tensor, norm: Tensor,
            rope, eps: float) -> None:
        """Each row's projections [B, width] into its window, and its window pooled into entry position // rate
        (counted only once the window is full): model.close_windows' arithmetic, every row every step."""
        rate = self.rate
        self.buffer_kv[slots, positions % rate] = kv.float()
        self.buffer_gate[slots, positions % rate] = gate.float()
        entry = positions // rate
        windows_kv = self.buffer_kv.index_select(0, slots)  # [B, rate, width]
        windows_gate = self.buffer_gate.index_select(0, slots) + ape
        if self.overlapping:  # the window's first series is the next entry's overlap (complete once it closes)
            previous = (self.overlap_kv[slots, (entry + 1) % 2], self.overlap_gate[slots, (entry + 1) % 2])
            self.overlap_kv[slots, entry % 2] = windows_kv[..., :self.d]
            self.overlap_gate[slots, entry % 2] = windows_gate[..., :self.d]
            windows_kv, windows_gate = model.after_previous(windows_kv, windows_gate, *previous)
        pooled = model.pooled_windows(windows_kv, windows_gate, norm, eps)
        self.entries.write(slots, entry, model.apply_rope(pooled, model.rows_rotation(rope, entry * rate)))


class _Layer:
    """One layer's slots: its window ring and its compressors."""

    def __init__(self, cfg: ModelConfig, layer: int, slots: int, low: torch.dtype, device: torch.device):
        self.kind, self.low = cfg.layer_types[layer], low
        self.window = _Rows(slots, cfg.sliding_window, cfg.head_dim, low, device)
        self.compressors = {name: _Compressor(cfg, layer, name, slots, low, device)
                            for name, *_ in model.TOKEN_COMPRESSORS[self.kind]}
        self.generation = next_generation()  # a new one when its tensors move (its captured graphs read the old)

    def grow_slots(self, slots: int) -> None:
        self.window.grow(0, slots)
        for c in self.compressors.values():
            c.grow_slots(slots)
        self.generation = next_generation()

    def reserve_entries(self, needs: Sequence[tuple[int, int]], bucket: int = 0) -> None:
        """Room for needs' (slot, entries) and tables `bucket` entries wide, on the device before the step's piece
        (a pool or table that moved: a new generation)."""
        moved = False
        for c in self.compressors.values():
            moved |= c.entries.widen(bucket)
            for slot, entries in needs:
                moved |= c.entries.reserve(slot, entries)
            c.entries.send_table()
        if moved:
            self.generation = next_generation()

    def release(self, slot: int) -> None:
        """The slot's pages back to the pools, a pool then mostly free made small (a new generation)."""
        moved = False
        for c in self.compressors.values():
            c.entries.release(slot)
            moved |= c.entries.compact()
        if moved:
            self.generation = next_generation()


class ArenaKV:
    """One layer's decode state of one sequence in the arena (what token_states gives on a CUDA device)."""

    def __init__(self, arena: KVArena, layer: int, slot: ArenaSlot, layer_type: str, seen_tokens: int):
        self.arena, self.layer, self.slot = arena, layer, slot
        self.layer_type, self.seen_tokens = layer_type, seen_tokens

    def state(self) -> LayerKVState:
        """The state as a prefill hands it on (model.TokenKV.state's): the window's last window - 1 keys in order,
        each compressor's entries, buffered tokens and overlap."""
        L, slot, seen = self.arena.layers[self.layer], self.slot.index, self.seen_tokens
        ring = L.window.rows.shape[1]
        kept = torch.arange(max(0, seen - ring + 1), seen) % ring
        window = L.window.rows[slot].index_select(0, kept.to(L.window.rows.device))
        parts = {name: c.state(slot, seen) for name, c in L.compressors.items()}
        return LayerKVState(self.layer_type, seen, window, parts.get("compressor"), parts.get("indexer"))


class KVArena(SlotArena):
    """Every decoding sequence's KV of every layer in slots on `device` (the module's docstring; the slots, the
    step's rows and the graph keys backends/kv_arena.py's). Its tensors are made at the first sequence and given
    back when the last one leaves (`layers` None): a long prompt's capacity is not kept by a server once it is
    idle."""

    def __init__(self, cfg: ModelConfig, device: torch.device, low: Sequence[torch.dtype]):
        super().__init__(device)
        self.cfg, self.low = cfg, list(low)
        self.layers: list[_Layer] | None = None
        self.slots, self._free = 0, []  # (slots to take: their pages given back)
        self._dead: list[int] = []  # slots whose sequence is gone, their pages not yet given back (_reclaim)
        # admit, and the release of the last slot (a finalizer: any thread, at any allocation), one at a time
        self._lock = threading.Lock()

    def grow_slots(self, slots: int) -> None:
        for L in self.layers:
            L.grow_slots(slots)

    def held_tensors(self) -> Iterable[Tensor]:
        for L in self.layers or ():
            yield from L.window.tensors()
            for c in L.compressors.values():
                yield from c.tensors()

    def admit(self, states: Sequence[LayerKVState]) -> list[ArenaKV]:
        """A sequence after a prefill's `states` (one per layer, on any device: copied to this one once checked) in
        a free slot: its layers' ArenaKV. A state that is not a prefill's of this model is refused in one line, the
        arena untouched."""
        for layer, state in enumerate(states):
            check_state(self.cfg, layer, state)
        with self._lock:
            self._give_back_if_idle()
            self._reclaim()
            if self.layers is None:
                self.layers = [_Layer(self.cfg, layer, 1, dtype, self.device) for layer, dtype in enumerate(self.low)]
                self.slots, self._free = 1, [0]
            slot = self.take_slot()
            out = []
            for layer, (L, state) in enumerate(zip(self.layers, states)):
                state = state.to(self.device)
                seen, window, ring = state.seen_tokens, state.window_kv, self.cfg.sliding_window
                L.window.load(slot.index, torch.arange(seen - window.shape[0], seen) % ring, window)
                L.reserve_entries([(slot.index, seen // self.cfg.compress_rates[layer] + 1)] if L.compressors else [])
                for name, c in L.compressors.items():
                    c.load(slot.index, getattr(state, name), seen)
                out.append(ArenaKV(self, layer, slot, L.kind, seen))
        return out

    def release(self, index: int) -> None:
        """A slot's sequence is gone (its ArenaSlot's finalizer): its pages given back at the next step or admit
        (_reclaim: a finalizer runs in any thread, at any allocation), the whole arena now where it was the last.
        Not while an admit runs (it gives an idle arena back itself): a finalizer may run inside it."""
        self._dead.append(index)
        if self._lock.acquire(blocking=False):
            try:
                self._give_back_if_idle()
            finally:
                self._lock.release()

    def _give_back_if_idle(self) -> None:
        """No sequence left: the tensors dropped (the next admit makes them anew, at its own size)."""
        if self.layers is not None and len(self._free) + len(self._dead) == self.slots:
            self.layers, self.slots, self._free, self._dead = None, 0, [], []

    def _reclaim(self) -> None:
        """The pages of the slots whose sequences are gone back to their pools, the slots free (the arena's own
        thread: between steps, or before a step's first piece)."""
        while self._dead:
            slot = self._dead.pop()
            for L in self.layers:
                L.release(slot)
            self._free.append(slot)

    def attend(self, layer: int, w: Mapping[str, Tensor], hidden: Tensor, states: Sequence[ArenaKV], graphs
               ) -> tuple[Tensor, ...]:
        """DeepseekV4Decode.attend over the arena: one fixed-shape piece for every row (a CUDA graph per layer,
        rows, entry bucket and generation), the states counted after it."""
        if self._dead:
            self._reclaim()
        cfg, L = self.cfg, self.layers[layer]
        bucket = 0
        if L.kind != SLIDING:
            rate = cfg.compress_rates[layer]
            bucket = entry_bucket(max((s.seen_tokens + 1) // rate for s in states))
            # the bucket's prefix is read, and each row writes entry position // rate
            L.reserve_entries([(s.slot.index, s.seen_tokens // rate + 1) for s in states], bucket)
        heads, rotation, post, comb = self.run_attention(graphs, layer, states, bucket, L.generation,
                                                         functools.partial(self._attention, layer, w), hidden)
        return hidden, heads, rotation, post, comb

    def _attention(self, layer: int, w: Mapping[str, Tensor], bucket: int, hidden: Tensor, rows: Tensor
                   ) -> tuple[Tensor, ...]:
        """model.attention_token of every row (hidden [B, hc, H], rows [2, B] their slots and positions), asking
        the host nothing: (the output heads [B, heads, D] rotated, the rotations, the mHC post and comb)."""
        cfg, L = self.cfg, self.layers[layer]
        slots, positions = rows[0], rows[1]
        kind, eps = L.kind, cfg.rms_norm_eps
        rotation = model.rows_rotation(cfg.main_rope if kind == SLIDING else cfg.compress_rope, positions)
        x, post, comb = model.attention_entry(cfg, w, hidden)
        inputs = model.token_attention_inputs(cfg, layer, w, x, rotation)
        names = model.projection_names(kind)
        projected, (q_lora, key, q, *index_query) = inputs[:len(names)], inputs[len(names):]
        ring = cfg.sliding_window
        L.window.write(slots, positions % ring, key)
        window = L.window.low.index_select(0, slots)  # [B, window, D]
        parts = [(window, model.logit_bias(torch.arange(ring, device=positions.device)[None] <= positions[:, None]))]
        for name, at, ape, norm in model.TOKEN_COMPRESSORS[kind]:
            L.compressors[name].add(slots, positions, projected[at], projected[at + 1], w[ape], w[norm],
                                    cfg.compress_rope, eps)
        if kind != SLIDING:
            entries = L.compressors["compressor"].entries
            complete = (positions + 1) // cfg.compress_rates[layer]
            if kind == CSA and bucket > cfg.index_topk:
                index_keys = L.compressors["indexer"].entries.prefix(slots, bucket)
                picked = model.indexer_topk(cfg, w, x, q_lora, rotation, index_keys, complete,
                                            (index_query[0], projected[names.index(model.INDEXER_HEAD_WEIGHTS)]))
                parts.append((entries.gather(slots, picked.clamp(min=0)), model.logit_bias(picked >= 0)))
            else:
                visible = torch.arange(bucket, device=positions.device)[None] < complete[:, None]
                parts.append((entries.prefix(slots, bucket), model.logit_bias(visible)))
        heads = model.attend_key_sets(q, parts, w["attn.attn_sink"], cfg.head_dim ** -0.5, L.low)
        return heads, rotation, post, comb
