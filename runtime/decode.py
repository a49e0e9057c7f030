"""Token-major decode over a container, after a layer-major prefill: the rest of `moepack generate`.

The arithmetic is the model family's (families.base.LayerDecode, from the family's `layer_decode`); this module
holds no family's names. Decode streams experts badly (one token amortises each read), so the routed experts come
through an ExpertCache with a byte budget; everything else (attention, norms, router, the family's dense FFN parts,
embedding, head) is read once and stays resident, decoded, on the compute device. Per token and layer: a hash-routed
layer (LayerDecode.hash_table) knows its experts from the token id, so their reads are issued before the layer's
attention; a learned layer's once its router ran. A miss is one aligned read of that expert's region through the
prefill's reader (O_DIRECT where the container does not fit in memory), the reads of a layer issued together.

Where the family offers a compiled one-token path (LayerDecode.token_layers, a families.base.TokenPath) and a CPU's
kernels take its weights, every layer runs as a few compiled calls over fixed buffers: the chosen experts in one
call of the compiled token kernel (backends/token_kernels.py), which reads each matrix from its stored bytes (F32,
BF16, F16, FP4 E2M1, MXFP4, Q8_0, FP8 E4M3) and splits the rows over every thread, while the few torch ops of a
token run on one thread (waking OpenMP's others for each op cost more than the op). Elsewhere (a GPU, another stored
kind, a family without one) the family's functions run each layer (attend, route_attended, finish; the head) and
each expert is computed as its bytes arrive by the prefill's expert runner (the family's expert_ffn and
expert_naming), except that on a CPU every row's routed experts still go to the token kernel in one call where it
takes their stored kind and computes the family's experts (its expert_limit), the step's torch ops then on one thread
too (a family's torch experts, where the kernel lacks their kind, on every thread). Each
sequence keeps one token state per layer (LayerDecode.token_state: the KV grown one token at a time, or continued in
place); `states` gives them back as a prefill hands them on. Several sequences step together (`step_batch`): every
resident weight read once per step and the union of the rows' experts fetched once, each run once on the rows that
chose it; on the compiled path each row's logits are those of its sequence stepped alone, to the bit; on the
family's functions (a GPU, a stored kind the kernels lack, a family without them) within float32 rounding (a
matmul over B rows may sum in another order than over one; on a CPU the step's matmuls take the token kernel for
every row, each row's sums its own): a greedy token differs only at so close a tie.

The cache holds experts as stored (their container bytes) on a CPU, decoded to the expert dtype on a GPU (a hit
is then three matmuls, not a chain of decoding kernels), least recently used evicted first; once full, a miss
evicts only entries used less of late (ExpertCache.admits), else it is used in place as with no cache. It starts
warm with the experts the prompt sent the most tokens to, most used first, until the budget is full: the prefill hands
each expert it uses to the cache while there is room (`keep_from_prefill`), and `seed` keeps the most used of
those and reads only the rest.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from moepack.backends import token_kernels
from moepack.backends.device_copier import DeviceCopier, to_device_async
from moepack.families.base import LayerDecode, not_finite
from moepack.format_spec.decode import decode_group, decode_group_rows, entry_bytes
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.reader import Container

from .device_decode import RoutingPieces, StepGraphs, container_pool
from .expert_decode import ExpertWeights, expert_weight_count
from .expert_runner import BusyTimer, ExpertRunner, decode_dense, kernel_layout, stored_matrix
from .io import HostBuffer, ReadPipeline, RegionReader, release_freed_memory, torch_threads
from .read_scheduler import RegionChecker, global_regions


# faulted in by the mapping call itself where the kernel can (one call, not a fault per page: 2.2 against 1.6 GB/s
# for a copy into fresh pages here)
_OWN_PAGES = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


def own_pages(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor on pages of its own (an anonymous mapping, unmapped when the tensor goes), for
    what the cache takes in bulk (the prompt's experts during the prefill, the seed's reads): in malloc's heap,
    where the prefill has glibc keep its freed activations, they would land beside those and pin them (a generation
    peaked 0.7 GB over the memory bound)."""
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1), flags=_OWN_PAGES), dtype=torch.uint8)[:nbytes]


class ExpertCache:
    """Routed experts, (layer, expert) -> their stored bytes (a uint8 tensor) or their decoded weights, within
    `budget` bytes; least recently used evicted first. Budget 0: nothing is kept.

    A miss is taken in only where `admits` says so: while there is room, or where the expert was used more of late
    than every entry it would evict (TinyLFU's admission: `_uses` counts each key's lookups, all halved after ten
    lookups per entry, 640 at least). A decode visits the layers in a cycle, so a cache smaller than one token's
    experts that took in every miss would evict each before its next use: no hit, and a copy per miss (a 0.1 GiB
    cache decoded 3.4x slower than none); it now keeps what it holds and the miss is used in place, as with no
    cache."""

    ADMIT_MARGIN = 1  # uses by which a newcomer must lead each entry it evicts (a lead of one is routing's noise)

    def __init__(self, budget: int):
        if budget < 0:
            raise MoepackError("--cache-gib must be >= 0")
        self.budget = budget
        self.bytes = 0
        self._entries: OrderedDict[tuple[int, int], torch.Tensor | ExpertWeights] = OrderedDict()
        self._sizes: dict[tuple[int, int], int] = {}
        self._uses: dict[tuple[int, int], int] = {}
        self._lookups = 0
        self.hits = self.misses = 0
        # misses taken in, entries evicted, misses that fit but were not kept (used in place, or a pool's scratch)
        self.admitted = self.evicted = self.refused = 0
        # where the entries live elsewhere (device_decode.ExpertPool's slots): told of each entry dropped and of a
        # new budget, asked what of the budget it holds apart from the entries (`reserved`)
        self.store = None

    def get(self, key: tuple[int, int]) -> torch.Tensor | ExpertWeights | None:
        self._count_use(key)
        raw = self._entries.get(key)
        if raw is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return raw

    def _count_use(self, key: tuple[int, int]) -> None:
        self._uses[key] = self._uses.get(key, 0) + 1
        self._lookups += 1
        if self._lookups >= 10 * max(len(self._entries), 64):  # the counts follow the recent routing
            self._uses = {k: n // 2 for k, n in self._uses.items() if n > 1}
            self._lookups = 0

    @property
    def reserved(self) -> int:
        """Of the budget, what its store holds apart from the entries (the pool's scratch slots)."""
        return self.store.scratch_bytes if self.store is not None else 0

    @property
    def entry_budget(self) -> int:
        """What the entries may take: the budget less what its store holds apart (`reserved`)."""
        return max(self.budget - self.reserved, 0)

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.entry_budget

    def admits(self, key: tuple[int, int], nbytes: int) -> bool:
        """Whether a miss of `key` (`nbytes`) is worth keeping: it fits in the room left, or it was used more of
        late (by ADMIT_MARGIN) than each least recently used entry it would evict. Counts the refusal of one that
        fits the budget."""
        if not self.fits(nbytes) or key in self._entries:
            return False
        room, wanted = self.entry_budget - self.bytes, self._uses.get(key, 0) - self.ADMIT_MARGIN
        for old in self._entries:
            if room >= nbytes:
                break
            if self._uses.get(old, 0) >= wanted:
                self.refused += 1
                return False
            room += self._sizes[old]
        return True

    def put(self, key: tuple[int, int], entry: torch.Tensor | ExpertWeights, nbytes: int | None = None) -> None:
        """Keep `entry` (`nbytes` of memory; default: a byte tensor's length), evicting the least recently used."""
        size = entry.numel() if nbytes is None else nbytes
        if not self.fits(size) or key in self._entries:
            return
        self._evict_to(self.entry_budget - size)
        self._entries[key] = entry
        self._sizes[key] = size
        self.bytes += size
        self.admitted += 1

    def resize(self, budget: int) -> None:
        """A new budget; the least recently used go until the entries fit it."""
        self.budget = budget
        self._evict_to(self.entry_budget)
        if self.store is not None:
            self.store.budget_changed(budget)

    def _evict_to(self, nbytes: int) -> None:
        """Evict the least recently used until the entries take at most nbytes."""
        while self.bytes > nbytes:
            self.evict_oldest()

    def oldest(self) -> tuple[int, int] | None:
        """The least recently used entry's key (None: no entry)."""
        return next(iter(self._entries), None)

    def evict_oldest(self) -> None:
        """Evict the least recently used entry."""
        old, _ = self._entries.popitem(last=False)
        self.bytes -= self._sizes.pop(old)
        self.evicted += 1
        if self.store is not None:
            self.store.dropped(old)

    def replace(self, key: tuple[int, int], entry) -> None:
        """The same entry kept elsewhere (its store moved it): its size, place in the order and counts unchanged."""
        self._entries[key] = entry

    def has_room(self, nbytes: int) -> bool:
        """Whether nbytes more fit without evicting anything."""
        return self.bytes + nbytes <= self.entry_budget

    def drop(self, key: tuple[int, int]) -> None:
        if key in self._entries:  # (an entry its store let go of, None for now, too)
            del self._entries[key]
            self.bytes -= self._sizes.pop(key)
            if self.store is not None:
                self.store.dropped(key)

    def touch(self, key: tuple[int, int]) -> None:
        """Make an entry the most recently used (not counted as a hit)."""
        self._entries.move_to_end(key)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def hit_rate(self) -> float | None:
        looked_up = self.hits + self.misses
        return self.hits / looked_up if looked_up else None


def token_choice(routing, row: int = 0) -> dict[int, float]:
    """One token's routed experts (row `row` of the routing): expert id -> its routing weight, in ascending id (a
    hash layer may pick an expert twice: its weights add up)."""
    return token_kernels.merged_choice(routing.experts[row].tolist(), routing.weights[row].tolist())


class DecodeSequence:
    """One sequence's own part of a decode: its layers' token states (the family's LayerDecode.token_state: the KV
    grown one token at a time, or continued in place). The resident weights and the expert cache are the Decoder's,
    shared by every sequence (Decoder.start makes one, Decoder.step_batch steps several together)."""

    def __init__(self, kv: list, arithmetic: LayerDecode):
        self.kv, self._arithmetic = kv, arithmetic

    @property
    def seen_tokens(self) -> int:
        return self._arithmetic.seen_tokens(self.kv[0])

    @property
    def states(self) -> list:
        """Each layer's KV state after the tokens so far, as a prefill hands it on."""
        return [self._arithmetic.layer_state(kv) for kv in self.kv]


@dataclass
class DecodeStats:
    tokens: int = 0
    seconds: float = 0.0
    bytes_read: int = 0  # routed experts read on a miss (the cache's seed is counted apart)
    disk_wait_s: float = 0.0  # time the compute waited for a miss's bytes
    seed_bytes: int = 0  # read by seed
    seed_s: float = 0.0
    prefill_kept_bytes: int = 0  # the prompt's experts taken into the cache from the prefill's reads
    resident_s: float = 0.0  # reading and decoding the non-routed weights
    kernel_layers: int = 0  # layers whose routed experts ran in one call of the compiled token kernel
    steps: int = 0  # decode steps (a step_batch of B sequences is one step of B tokens)


class Decoder:
    """Decodes tokens over one container: the resident weights and the expert cache are loaded once and serve every
    sequence. `begin(states)` starts the current sequence after `states` (the family's KV state of each layer, all
    after the same tokens); `step(token_id)` feeds it one token and returns the next position's logits ([vocab]
    float32, on the host). Several sequences: `start(states)` gives each its DecodeSequence, and
    `step_batch(sequences, token_ids)` feeds each its token in one step ([B, vocab] logits)."""

    def __init__(self, container: Container, cfg, device: torch.device, cache_bytes: int,
                 compute_dtype: torch.dtype = torch.float32, expert_dtype: torch.dtype = torch.float32,
                 io_mode: str = "auto", verify_reads: bool = True, queue_depth: int = 8,
                 decoded_experts: bool | None = None, expert_pool: bool | None = None, *, family,
                 reader: RegionReader | None = None, pool_form: str | None = None):
        """`decoded_experts` (default: on a GPU, unless the pool keeps stored bytes) has the cache keep experts
        decoded to the expert dtype, so that a hit is three matmuls (their memory, not their stored bytes, is
        counted against the budget); otherwise it keeps their stored bytes, which a CPU's compiled kernels read
        directly. `expert_pool` (default: on a GPU) keeps the cached experts in device slots, a layer's routed work
        over them with no host round trip where the layer's experts are all there: `pool_form` "decoded"
        (device_decode.ExpertPool: one grouped GEMM over the decoded weights, captured in a CUDA graph) or
        "stored" (StoredExpertPool: their stored bytes, decoded side by side at each step: several times as many
        experts in the same memory); default (or MOEPACK_EXPERT_POOL): decoded where the budget holds every routed
        expert decoded or decoded_experts asks for it, stored where that holds more experts than decoded would.

        `family` (a moepack.families ModelFamily, `cfg` its parsed config): the container is that family's, its
        arithmetic the family's `layer_decode` (families.base.LayerDecode). `reader`: the container's reader its
        owner shares with the prefill (a Generator's: one io mode, one set of descriptors for both; its misses are
        then copied out of the page cache, never used in place), else one of its own."""
        self.c, self.cfg, self.device, self.family = container, cfg, device, family
        self.arithmetic: LayerDecode = family.layer_decode(cfg, compute_dtype)
        # a family whose own expert_ffn runs its experts runs its torch functions on every thread
        self.torch_experts = self.arithmetic.expert_ffn is not None
        self.decoded = device.type != "cpu" if decoded_experts is None else decoded_experts
        self.compute_dtype = compute_dtype
        self.current: DecodeSequence | None = None  # the sequence begin() started, which step() feeds
        self.stats = DecodeStats()
        self.cache = ExpertCache(cache_bytes)
        self._cache_counts = self._cache_counters()  # when this sequence began
        # a miss's bytes are checked by the reader thread as they land (beside this thread's compute)
        self.checker = RegionChecker(container, verify_reads, on_read=True)
        self._owns_reader = reader is None
        self.reader = reader if reader is not None else RegionReader(container.part_paths, io_mode, zero_copy=False)
        self.copier = DeviceCopier(device)
        self.blocks = container.layers  # (Container.layers makes its list on each call)
        largest = max((r.length for b in self.blocks for r in b.experts), default=4096)
        self.pipe = ReadPipeline(self.reader, largest, queue_depth, device.type == "cuda",
                                 buffers=2 * queue_depth, zero_copy=False)
        self.compute = BusyTimer()
        self._layer_of = {block.name: layer for layer, block in enumerate(self.blocks)}
        self._keep_lock = threading.Lock()
        self._from_prefill: set[tuple[int, int]] = set()  # kept by keep_from_prefill since the last seed
        self._layouts: dict[tuple[int, int], list | None] = {}
        self._matrices: dict[tuple[int, int], tuple] = {}  # (layer, expert) -> (weakref to its bytes, Matrices)
        self._step_uses: list[tuple[int, torch.Tensor]] = []  # complete layers' choices, counted after the step
        # each layer beside the pool, (layer, whether its output is finite: a device flag), checked after the step
        self._step_finite: list[tuple[int, torch.Tensor]] = []
        self._load(expert_dtype, expert_pool, pool_form, decoded_experts)

    def _load(self, expert_dtype: torch.dtype, expert_pool: bool | None, pool_form: str | None,
              decoded_experts: bool | None) -> None:
        """The resident weights, the expert runner, and (where they apply) the family's compiled layers and the
        device's expert pool."""
        arithmetic, device, container = self.arithmetic, self.device, self.c
        names = arithmetic.names
        self.experts = ExpertRunner(self.cfg, device, expert_dtype, self.checker, self.copier, self.pipe.release,
                                    self.compute, naming=arithmetic.expert_naming,
                                    expert_ffn=arithmetic.expert_ffn,
                                    expert_forward=arithmetic.expert_forward, expert_limit=arithmetic.expert_limit)
        start = time.perf_counter()
        self.dense = [decode_dense(b, self._read_region(b.dense).to(device), self.compute_dtype,
                                   arithmetic.layer_prefix(layer),
                                   in_compute_dtype=arithmetic.in_compute_dtype)
                      for layer, b in enumerate(self.blocks)]
        self.embed_entries, self.embed_read = self._read_globals([names.embedding], on_device=False)
        self.pool = self._expert_pool(expert_pool, pool_form, decoded_experts)
        self.cache.store = self.pool
        # a token's routed experts in one compiled call (CPU), read from their stored bytes, where that kernel
        # computes the family's experts (and no pool runs them)
        self.kernels = token_kernels.token_kernels() if device.type == "cpu" and not self.decoded \
            and self.pool is None and arithmetic.expert_limit is not None else None
        entries, read = self._read_globals([*names.head_globals, names.head], on_device=True)
        self.head_weights = decode_group(entries, read, dtype_of=lambda t: arithmetic.global_dtype(
            t.name, t.dtype, self.kernels is not None))
        self.stats.resident_s = time.perf_counter() - start
        # what the resident weights hold of the host's memory (a kept integer tensor may be a view of its region's
        # bytes: storages counted once); on a GPU they live on the device
        self.host_resident_bytes = 0
        if device.type == "cpu":
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for weights in [*self.dense, self.head_weights] for t in weights.values()}
            self.host_resident_bytes = sum(storages.values()) + sum(
                r.length for r in global_regions(container, [names.embedding]))
        self._routed_flag = token_kernels.ROUND_INPUT if self.experts.expert_dtype == torch.bfloat16 else 0
        # every layer in compiled calls over fixed buffers where the family offers them, and the kernels take its
        # weights and every expert
        self.layers = arithmetic.token_layers(self.dense) if self.kernels is not None and all(
            self._kernel_layout(layer, e) for layer, block in enumerate(self.blocks)
            for e in range(len(block.experts))) else None
        self._eager = StepGraphs(False, device)  # (no pool: the pieces run as plain calls)
        self._pieces = RoutingPieces(arithmetic, self._pooled_finish)

    def _expert_pool(self, expert_pool: bool | None, form: str | None, decoded_experts: bool | None):
        """The device pool of cached experts (Decoder's docstring), None where there is none (off, or the experts do
        not stack there: the cache as before); `self.decoded` follows the pool's form."""
        if not (self.device.type == "cuda" if expert_pool is None else expert_pool):
            return None
        form = form or os.environ.get("MOEPACK_EXPERT_POOL") or None
        if form not in (None, "decoded", "stored"):
            raise MoepackError(f"the expert pool keeps its experts 'decoded' or 'stored', not {form!r}")
        if decoded_experts is not None and form is not None and (form == "decoded") != decoded_experts:
            raise ValueError(f"a {form} expert pool with decoded_experts={decoded_experts}")
        arithmetic = self.arithmetic
        pool_of = functools.partial(container_pool, self.cache, self.blocks, arithmetic.expert_naming,
                                    arithmetic.expert_activation, self.experts.expert_dtype, self.device)
        if form is None and decoded_experts is None:  # stored where that form holds more at this budget
            stored = pool_of(stored=True)  # (None where its experts lie differently from layer to layer)
            pool = stored if stored is not None and stored.holds_more(self.cache.budget) else pool_of()
        else:
            pool = pool_of(stored=form == "stored" if form is not None else not decoded_experts)
        if pool is not None:
            self.decoded = pool.form == "decoded"
        return pool

    def start(self, states) -> DecodeSequence:
        """A sequence after `states` (one per layer, all after the same tokens, or a KV state holding them as
        `layers`), for step_batch."""
        states = list(states.layers if hasattr(states, "layers") else states)
        arithmetic = self.arithmetic
        if len(states) != len(self.blocks) or len({arithmetic.seen_tokens(s) for s in states}) != 1:
            raise MoepackError("decode needs one KV state per layer, all after the same tokens")
        together = getattr(arithmetic, "token_states", None)  # (a family may keep a sequence's layers together)
        kv = together(states, self.dense, self.device) if together is not None else [
            arithmetic.token_state(layer, s, self.dense[layer], self.device) for layer, s in enumerate(states)]
        return DecodeSequence(kv, arithmetic)

    def begin(self, states: list) -> None:
        """Start the current sequence after `states` (the last one's dropped first: a device arena's slot and pages
        given back before the next takes its own, as the memory checks count); the stats count from here."""
        self.current = None
        self.current = self.start(states)
        kept = sum(self._entry_bytes(layer, e) for layer, e in self._from_prefill)
        self.stats = DecodeStats(resident_s=self.stats.resident_s, prefill_kept_bytes=kept)
        self._cache_counts = self._cache_counters()

    def _cache_counters(self) -> tuple[int, int, int, int]:
        return self.cache.hits, self.cache.misses, self.cache.admitted, self.cache.evicted

    @property
    def states(self) -> list:
        """Each layer's KV state of the current sequence after the tokens so far."""
        return self.current.states

    # --- resident weights ----------------------------------------------------------------------------------------
    def _read_region(self, region) -> torch.Tensor:
        """A region's bytes, checked, as a host uint8 tensor of its own, read in place by the reader the misses
        (and a Generator's prefill) read through."""
        raw = own_pages(region.length)
        view = self.reader.read_into(HostBuffer.over(raw), region.offset, region.length, region.part, zero_copy=False)
        self.checker.check([region], view, region.offset)
        return raw

    def _read_globals(self, names, on_device: bool) -> tuple[list, Callable]:
        """The entries of the named tensors' regions (with their scales) and read(entry) -> its bytes."""
        entries, reads = [], {}
        for r in global_regions(self.c, names):
            raw = self._read_region(r)
            read = entry_bytes(raw.to(self.device) if on_device else raw, r.offset)
            for t in r.tensors:
                entries.append(t)
                reads[t.name] = read
        return entries, lambda t: reads[t.name](t)

    # --- the cache -------------------------------------------------------------------------------------------------
    def prefill_starts(self) -> None:
        """A sequence's prefill begins: what keep_from_prefill takes is counted from here."""
        self._from_prefill.clear()

    def keep_from_prefill(self, block, region, view: memoryview, base: int) -> None:
        """A prompt's expert as the prefill uses it (its bytes checked), copied into the cache while it has room
        (StreamingPrefill's keep_expert; called from the prefill's expert threads). `seed` then keeps those the
        prompt used most and reads only what is missing."""
        layer = self._layer_of[block.name]
        size = self._entry_bytes(layer, region.expert)
        with self._keep_lock:
            if (layer, region.expert) in self.cache or not self.cache.has_room(size):
                return
            start = region.offset - base
            raw = own_pages(region.length)
            raw.numpy()[:] = np.frombuffer(view, dtype=np.uint8)[start:start + region.length]
            self.cache.put((layer, region.expert), self._entry(layer, region.expert, raw), size)
            self._from_prefill.add((layer, region.expert))

    def seed(self, tokens_per_expert: list[list[int]]) -> None:
        """Warm the cache with the experts the prompt sent the most tokens to (per layer counts), most used
        first, until the budget is full: those the prefill's reads left in the cache stay (the rest of them go),
        the others are read; the most used end as the most recently used."""
        start = time.perf_counter()
        ranked = sorted(((n, layer, e) for layer, counts in enumerate(tokens_per_expert)
                         for e, n in enumerate(counts) if n), reverse=True)
        room, wanted = self.cache.entry_budget, []
        for _, layer, e in ranked:
            length = self._entry_bytes(layer, e)
            if length <= room:
                wanted.append((layer, e))
                room -= length
        for key in self._from_prefill - set(wanted):  # kept while there was room, used less than others
            self.cache.drop(key)
        self._from_prefill.clear()
        for key in wanted:
            if key not in self.cache:
                region = self.blocks[key[0]].experts[key[1]]
                self.cache.put(key, self._entry(*key, self._read_region(region)), self._entry_bytes(*key))
                self.stats.seed_bytes += region.length
        for key in reversed(wanted):
            if key in self.cache:
                self.cache.touch(key)
        self.stats.seed_s = time.perf_counter() - start

    def _fetch(self, layer: int, experts: list[int]) -> dict[int, Future | torch.Tensor]:
        """Each expert's bytes: from the cache, or a read issued now (all of a layer's misses together)."""
        block = self.blocks[layer]
        got: dict[int, Future | torch.Tensor] = {}
        for e in sorted(set(experts)):
            raw = self.cache.get((layer, e))
            if raw is None:
                region = block.experts[e]
                span = block.expert_read(e, 1)
                got[e] = self.pipe.submit(span.offset, span.length, self.checker.after_read([region]), span.part)
                self.stats.bytes_read += region.length
            else:
                got[e] = raw
        return got

    def _expert_bytes(self, layer: int, e: int, got, held: list, copy_refused: bool = False
                      ) -> torch.Tensor | ExpertWeights:
        """Expert e on the compute device: a cache hit (its stored bytes, or its weights where the cache keeps them
        decoded), or its read (awaited; checked as it landed). A read the cache keeps (what ExpertCache.admits
        takes) is copied out of its pooled buffer, which goes back at once; one it cannot keep is used in place (its
        stored bytes), its buffer appended to `held` for the caller to give back once the expert has run, or
        (`copy_refused`: for the pool's scratch) copied out as a kept read is (_device_copy)."""
        item = got[e]
        if isinstance(item, ExpertWeights):
            return item
        if isinstance(item, torch.Tensor):
            return item if item.device == self.device else item.to(self.device)
        region = self.blocks[layer].experts[e]
        t0 = time.perf_counter()
        buffer, view = item.result()
        self.stats.disk_wait_s += time.perf_counter() - t0
        raw = self.copier.host_bytes(buffer, view)[:region.length]
        size = self._entry_bytes(layer, e)
        if not self.cache.admits((layer, e), size):
            if copy_refused:
                return self._device_copy(layer, e, buffer, view)
            if len(self._pool_buffers(held)) + 1 < self.pipe.buffers:
                held.append(buffer)  # no copy of bytes nothing keeps
                return raw.to(self.device)
            # the pool's last buffer: a copy, and the buffer back, for the step's next read (more misses in a step
            # than buffers, a top-k or a batch's union past them: holding it would leave that read none, for ever)
            try:
                return raw.clone() if self.device.type == "cpu" else raw.to(self.device)
            finally:
                self.pipe.release(buffer)
        try:
            # on a GPU copied on the copier's stream (the compute waits for that copy, the host for nothing; the
            # buffer goes back once the copy is done); on a CPU the stored bytes kept outlive the pooled buffer
            # (malloc's: a cache smaller than the experts in use evicts and takes one of the same size per miss,
            # and malloc hands the evicted one's memory back; fresh pages would fault in), the decoded are copies
            raw = self.copier.to_device(buffer, view)[:region.length]
            entry = self._entry(layer, e, raw.clone() if self.device.type == "cpu" and not self.decoded else raw)
        finally:
            self.copier.release(buffer, self.pipe.release)
        self.cache.put((layer, e), entry, size)
        return entry

    def _device_copy(self, layer: int, e: int, buffer, view: memoryview) -> torch.Tensor:
        """Expert e's read bytes on the device, of their own, copied as a kept read's are (the host waits for
        nothing; the buffer goes back at once)."""
        try:
            raw = self.copier.to_device(buffer, view)[:self.blocks[layer].experts[e].length]
            return raw.clone() if self.device.type == "cpu" else raw
        finally:
            self.copier.release(buffer, self.pipe.release)

    def _entry(self, layer: int, e: int, raw: torch.Tensor) -> torch.Tensor | ExpertWeights:
        """What the cache keeps of expert e's bytes `raw`: its weights decoded on the compute device (`decoded`),
        else its bytes there; with a pool, views of the slot they are copied into (where one is free). On a CPU
        that is `raw` itself, which must therefore be bytes of its own (never a view of a pooled buffer)."""
        raw = raw.to(self.device)
        region = self.blocks[layer].experts[e]
        if self.pool is not None:  # into a slot of the pool (a copy of the bytes, or of the decoder's buffers)
            pooled = self.pool.put(layer, e, self._pool_content(layer, e, raw))
            if pooled is not None:
                return pooled
        if not self.decoded:
            return raw
        return self.experts.owned_weights(self.blocks[layer], region, raw, region.offset)

    def _pool_content(self, layer: int, e: int, expert: torch.Tensor | ExpertWeights
                      ) -> torch.Tensor | ExpertWeights:
        """What the pool copies into a slot of expert e (its bytes `expert` on the device, or its weights): the
        weights decoded (views of the decoder's buffers) where the pool keeps them so, else the bytes."""
        if not self.decoded or isinstance(expert, ExpertWeights):
            return expert
        region = self.blocks[layer].experts[e]
        return self.experts.expert_weights(self.blocks[layer], region, expert, region.offset)

    def _entry_bytes(self, layer: int, e: int) -> int:
        """The memory expert e takes in the cache: a pool's slot, else its stored bytes, or (decoded) its three
        matrices."""
        if self.pool is not None:
            return self.pool.slot_bytes
        region = self.blocks[layer].experts[e]
        if not self.decoded:
            return region.length
        return expert_weight_count(region) * self.experts.expert_dtype.itemsize

    @staticmethod
    def _pool_buffers(held: list) -> list:
        """The pooled buffers in `held` (the tensors beside them are only kept alive)."""
        return [item for item in held if not isinstance(item, torch.Tensor)]

    def _give_back(self, held: list) -> None:
        """Give back the pooled buffers in `held` and clear it."""
        for item in self._pool_buffers(held):
            self.pipe.release(item)
        held.clear()

    # --- the routed experts of a token in one compiled call ----------------------------------------------------------
    def _kernel_layout(self, layer: int, e: int) -> list[tuple] | None:
        """Expert e's kernel_layout (expert_runner.py), kept per expert."""
        key = (layer, e)
        if key not in self._layouts:
            self._layouts[key] = kernel_layout(self.blocks[layer].experts[e],
                                               self.arithmetic.expert_naming.names(layer, e))
        return self._layouts[key]

    def _kernel_experts(self, layer: int, chosen: dict[int, float], got, held: list) -> list[tuple] | None:
        """The chosen experts' matrices as the compiled token kernel reads them from their stored bytes (a cache hit
        gives the same descriptors as last time), once every chosen expert's bytes are here; None where the kernel
        does not run them (not a CPU, a kind it lacks). `held` takes the pooled buffers to give back after the
        call, and the bytes the descriptors point into (kept alive until then)."""
        if self.kernels is None:
            return None
        layouts = [self._kernel_layout(layer, e) for e in chosen]
        if not all(layouts):
            return None
        # awaited in the order they were read (_fetch's): the pool hands its buffers to reads in that order
        stored = {e: self._expert_bytes(layer, e, got, held) for e in sorted(got)}  # (also those read, not chosen)
        experts = []
        for e, layout in zip(chosen, layouts):
            raw = stored[e]
            held.append(raw)
            known = self._matrices.get((layer, e))  # a cache hit gives the same bytes as last time
            if known is None or known[0]() is not raw:
                known = (weakref.ref(raw), tuple(stored_matrix(raw, *matrix, self.experts.kernel_table(matrix[0]))
                                                 for matrix in layout))
                self._matrices[(layer, e)] = known
            experts.append(known[1])
        self.stats.kernel_layers += 1
        return experts

    # --- one token ---------------------------------------------------------------------------------------------
    def step(self, token_id: int) -> torch.Tensor:
        """The current sequence (begin) fed one token: the next position's logits [vocab]."""
        return self.step_batch([self.current], [token_id])[0]

    def step_batch(self, sequences: list[DecodeSequence], token_ids: list[int]) -> torch.Tensor:
        """Each sequence fed its token in one step: the next positions' logits [B, vocab] (float32, on the host),
        row b that of sequences[b]. Each row's result is that of the sequence stepped alone (module docstring: to
        the bit on the compiled path, within float32 rounding on the family's functions)."""
        if len(sequences) != len(token_ids) or not sequences:
            raise ValueError(f"{len(token_ids)} tokens for {len(sequences)} sequences")
        if len({id(s) for s in sequences}) != len(sequences):
            raise ValueError("a sequence appears twice in one step")
        if self.device.type != "cpu" or (self.torch_experts and self.kernels is None):
            return self._steps(sequences, token_ids)  # (a family's torch experts use every thread)
        # one token's torch ops are small: on one thread, without waking OpenMP's others for each (nor running
        # them beside the kernel's workers, which spin a while after each call: two pools on the same CPUs each
        # wait for the other's descheduled threads); the compiled token kernels keep every thread, and take the
        # family's matmuls of every row of the step (backends/ops.py), and a family's torch experts get every
        # thread back (_routed_one_by_one)
        with token_kernels.using_threads(torch.get_num_threads()), token_kernels.step_rows(len(sequences)), \
                torch_threads(1):
            return self._steps(sequences, token_ids)

    def _steps(self, sequences: list[DecodeSequence], token_ids: list[int]) -> torch.Tensor:
        start = time.perf_counter()
        if self.layers is None:  # the family's functions, every row of the step at once
            logits = self._general_step(sequences, token_ids)
        elif len(sequences) > 1:
            logits = self._compiled_rows(sequences, token_ids)
        else:  # one token: the one-token calls cost less
            logits = self._step(sequences[0], token_ids[0])[None]
        self.stats.steps += 1
        self.stats.tokens += len(sequences)
        self.stats.seconds += time.perf_counter() - start
        return logits

    # --- the family's compiled one-token path (families.base.TokenPath) -------------------------------------------
    def _embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding's rows of `ids` [B] (float32, on the host): only those rows decoded."""
        return decode_group_rows(self.embed_entries, self.embed_read, self.arithmetic.names.embedding, ids)

    def _step(self, seq: DecodeSequence, token_id: int) -> torch.Tensor:
        """One sequence's token by the compiled path's one-token calls (a CPU)."""
        streams = self._compiled_layers(seq, token_id, self._embedding_rows(torch.tensor([token_id])))
        with self.compute:
            return self.arithmetic.token_head(self.head_weights, streams).float().cpu()

    def _hash_fetch(self, layer: int, w, token_id: int) -> tuple[dict | None, list[int] | None]:
        """A hash layer's experts (the token id is the routing): read before its attention runs."""
        table = self.arithmetic.hash_table(layer, w)
        if table is None:
            return None, None
        hash_ids = table[token_id].tolist()
        return self._fetch(layer, hash_ids), hash_ids

    def _compiled_layers(self, seq: DecodeSequence, token_id: int, embedding: torch.Tensor) -> torch.Tensor:
        """Every layer by the compiled path's calls (a CPU): its output after the last."""
        layers = self.layers
        layers.begin(embedding)
        for layer, w in enumerate(self.dense):
            got, hash_ids = self._hash_fetch(layer, w, token_id)
            with self.compute:
                layers.attention(layer, seq.kv[layer])
                chosen = layers.route(layer, hash_ids)
            self._run_kernel_experts(layer, chosen, got,
                                     lambda experts: layers.finish(layer, experts, self._routed_flag))
        return layers.output

    def _run_kernel_experts(self, layer: int, chosen: dict[int, float], got, finish: Callable[[list | None], object]):
        """finish(the chosen experts' Matrices, in `chosen`'s order; None where the kernel does not run them) once
        their bytes are here (`got`: their fetch, None: fetched now), its result returned; the pooled buffers
        given back after."""
        if got is None:
            got = self._fetch(layer, list(chosen))
        held = []
        try:
            experts = self._kernel_experts(layer, chosen, got, held)
            with self.compute:
                return finish(experts)
        finally:
            self._give_back(held)

    def _compiled_rows(self, sequences: list[DecodeSequence], token_ids: list[int]) -> torch.Tensor:
        """Each sequence's token as one row of the compiled path's batched calls (a CPU): every dense weight read
        once for all rows, the union of the rows' experts fetched once and each run once on the rows that chose it.
        The logits [B, vocab], each row that of its sequence stepped alone (the same arithmetic per row)."""
        layers = self.layers
        ids = torch.tensor(token_ids)
        layers.begin_rows(self._embedding_rows(ids))
        for layer, w in enumerate(self.dense):
            table = self.arithmetic.hash_table(layer, w)
            hash_ids = table[ids].tolist() if table is not None else None
            got = self._fetch(layer, [e for row in hash_ids for e in row]) if hash_ids is not None else None
            with self.compute:
                layers.attention_rows(layer, [seq.kv[layer] for seq in sequences])
                choices = layers.route_rows(layer, hash_ids)
            chosen = dict.fromkeys(sorted({e for choice in choices for e in choice}))
            self._run_kernel_experts(layer, chosen, got, lambda experts: layers.finish_rows(
                layer, dict(zip(chosen, experts)), choices, self._routed_flag))
        with self.compute:
            return self.arithmetic.token_head_rows(self.head_weights, layers.rows_output)

    def _general_step(self, sequences: list[DecodeSequence], token_ids: list[int]) -> torch.Tensor:
        """One step of every row by the family's functions (_layers): the logits [B, vocab] on the host."""
        self._step_uses, self._step_finite = [], []  # (a step that failed left its own)
        ids = torch.tensor(token_ids)
        rows = self._embedding_rows(ids)
        streams = self._layers(sequences, to_device_async(ids, self.device), to_device_async(rows, self.device))
        graphs = self._graphs()
        with self.compute:
            logits = graphs.run(("head", len(sequences)), self._head, streams)
            pooled = self._pooled_to_host()  # queued before the logits' copy: on the host once it returns
            # the step's one synchronisation: the logits on the host, where the sampler, the stop strings and
            # the stream to the client need the next token
            host = logits.cpu()
        if host is logits and graphs.enabled:  # (a CPU's .cpu() is the tensor: a graph's buffer must not escape)
            host = host.clone()
        self._settle_pooled(pooled)
        return host

    def _layers(self, sequences: list[DecodeSequence], ids: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        """Every layer by the family's functions (LayerDecode: a GPU, the native code off, weights the kernels do
        not take, a family without a compiled path) for the rows of one step (`ids` [B] their tokens, on the
        device): the hidden rows after the last. The family's attention runs each row over its sequence's own
        state; the routed experts once each on every row that chose them. With the pool, a layer's fixed-shape
        work (the family's pieces its `graphs` runs; the whole FFN where every expert is pooled and the pool runs it
        whole, else the router and the finish around the routed work: RoutingPieces) runs as a CUDA graph per
        (layer, B) where CUDA is (StepGraphs), asking the host nothing where the layer's experts are all pooled."""
        arithmetic, pool, rows = self.arithmetic, self.pool, len(sequences)
        graphs = self._graphs()
        hidden = arithmetic.hidden_from_embeddings(embedding)
        for layer, w in enumerate(self.dense):
            got, table = None, arithmetic.hash_table(layer, w)
            if table is not None and pool is None:  # the token ids are the routing: read before attention
                got = self._fetch(layer, table[ids].flatten().tolist())
            with self.compute:
                attended = arithmetic.attend(layer, w, hidden, [seq.kv[layer] for seq in sequences], graphs)
            if pool is not None and pool.complete(layer) and pool.whole_ffn:
                with self.compute:
                    hidden, experts, finite = graphs.run(("ffn", layer, rows), functools.partial(
                        self._pooled_ffn, layer, w), ids, *attended)
                self._pooled_call(layer, experts)
                self._step_finite.append((layer, finite))
                continue
            if pool is not None and not self.blocks[layer].experts:  # no routed experts: its FFN one graph too
                with self.compute:
                    hidden, finite = graphs.run(("ffn", layer, rows), functools.partial(
                        self._dense_ffn, layer, w), ids, *attended)
                self._step_finite.append((layer, finite))
                continue
            if pool is not None:  # the router and the finish each a piece, the routed work between them
                with self.compute:
                    hidden, routing = self._pieces.route(graphs, layer, w, ids, attended)
                routed = self._routed_from_pool(layer, routing)
                with self.compute:
                    hidden, finite = self._pieces.finish(graphs, layer, w, hidden, routing, routed)
                self._step_finite.append((layer, finite))
                continue
            with self.compute:
                hidden, routing = arithmetic.route_attended(layer, w, attended, ids)
            if routing.experts is None:  # a layer without routed experts
                with self.compute:
                    hidden = arithmetic.finish(layer, w, hidden, routing, None)
                continue
            if got is None:
                got = self._fetch(layer, routing.experts.flatten().tolist())
            routed = self._routed_by_kernel(layer, routing, got)
            if routed is None:
                routed = self._routed_one_by_one(layer, routing, got)
            with self.compute:
                hidden = arithmetic.finish(layer, w, hidden, routing, routed)
        return hidden

    def _graphs(self) -> StepGraphs:
        """Where the step's fixed-shape pieces run: the pool's CUDA graphs, or eagerly (no pool)."""
        return self.pool.graphs if self.pool is not None else self._eager

    def _head(self, streams: torch.Tensor) -> torch.Tensor:
        """The rows' logits [B, vocab] float32 on the device (a fixed-shape piece)."""
        return self.arithmetic.head(self.head_weights, streams).float()

    def _pooled_ffn(self, layer: int, w, ids: torch.Tensor, *attended: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer whose experts are all pooled, after its attention: the family's route_attended, the routed
        experts over the pool, its finish; (the hidden rows, the chosen experts, whether the rows are finite), all
        on the device (one CUDA graph)."""
        hidden, routing = self.arithmetic.route_attended(layer, w, attended, ids)
        routed = self.pool.routed(layer, routing.x, routing.experts, routing.weights, graphed=False)
        hidden, finite = self._pooled_finish(layer, w, hidden, routing, routed)
        return hidden, routing.experts, finite

    def _dense_ffn(self, layer: int, w, ids: torch.Tensor, *attended: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer without routed experts beside the pool, after its attention: (the hidden rows, whether they are
        finite), on the device (one CUDA graph)."""
        hidden, routing = self.arithmetic.route_attended(layer, w, attended, ids)
        return self._pooled_finish(layer, w, hidden, routing, None)

    def _pooled_finish(self, layer: int, w, hidden: torch.Tensor, routing, routed: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The family's finish for a layer beside the pool: the rows, and whether they are finite as a device flag
        (checked after the step, _settle_pooled: no synchronisation per layer)."""
        hidden = self.arithmetic.finish(layer, w, hidden, routing, routed, checked=False)
        return hidden, torch.isfinite(hidden).all()

    def _pooled_call(self, layer: int, experts: torch.Tensor) -> None:
        """A complete layer's routed work run over the pool: counted, its choices (on the device) counted as the
        cache's uses after the step (_settle_pooled)."""
        self.pool.calls += 1
        self._step_uses.append((layer, experts))

    def _routed_from_pool(self, layer: int, routing) -> torch.Tensor:
        """The rows' routed experts summed ([B, H] float32) over the pool: for a layer not all of whose experts
        are pooled, the choices read once (one synchronisation) and the misses read through the reader into
        slots first: the cache's where its admission takes them (ExpertCache.admits: the least recently used
        evicted), else the pool's scratch slots for this layer, so that a pool smaller than a step's experts keeps
        what it holds rather than evicting each expert before its next use (or the experts run one by one where
        one could not be had)."""
        pool = self.pool
        if pool.complete(layer):  # (a pool that runs no FFN whole: nothing to ask)
            self._pooled_call(layer, routing.experts)
            with self.compute:
                return pool.routed(layer, routing.x, routing.experts, routing.weights)
        pool.syncs += 1
        chosen = sorted(set(routing.experts.flatten().tolist()))
        got = self._fetch(layer, chosen)
        held = []
        try:
            with pool.pinned(layer, chosen):
                for e in chosen:
                    got[e] = self._expert_bytes(layer, e, got, held, copy_refused=True)
                    if not pool.in_slots(layer, e):  # a miss the cache refused, or an entry it keeps elsewhere
                        scratch = pool.put_scratch(layer, e, self._pool_content(layer, e, got[e]))
                        got[e] = got[e] if scratch is None else scratch
                if all(pool.in_slots(layer, e) for e in chosen):
                    pool.calls += 1
                    with self.compute:
                        return pool.routed(layer, routing.x, routing.experts, routing.weights)
                return self._routed_one_by_one(layer, routing, got)
        finally:
            self._give_back(held)

    def _pooled_to_host(self) -> torch.Tensor | None:
        """The finite flags of the step's layers beside the pool, then the complete layers' choices, in one tensor
        copied to the host without the host waiting (into pinned memory, non-blocking): there once a later
        blocking copy (the logits') returns. None where no layer ran beside the pool."""
        flags = [finite for _, finite in self._step_finite]
        if not flags:
            return None
        flat = torch.cat([torch.stack(flags).long(), *(experts.flatten() for _, experts in self._step_uses)])
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=self.device.type == "cuda")
        return host.copy_(flat, non_blocking=True)

    def _settle_pooled(self, pooled: torch.Tensor | None) -> None:
        """After a step's logits reached the host, with `pooled` (_pooled_to_host's, there too): each layer
        beside the pool checked finite (the first that is not named), and the complete layers' choices counted
        as the cache's hits (each expert once per layer and step, as a lookup counts them) and made the most
        recently used."""
        finite, self._step_finite = self._step_finite, []
        uses, self._step_uses = self._step_uses, []
        if pooled is None:
            return
        values = pooled.tolist()
        flags, chosen = values[:len(finite)], values[len(finite):]
        if not all(flags):
            raise not_finite(finite[flags.index(0)][0])
        for layer, experts in uses:
            picked, chosen = chosen[:experts.numel()], chosen[experts.numel():]
            for e in sorted(set(picked)):
                self.cache.get((layer, e))

    def _routed_by_kernel(self, layer: int, routing, got) -> torch.Tensor | None:
        """The rows' routed experts summed ([B, H] float32) by one call of the compiled token kernel, each row's
        to the bit what it gives that row alone (moe_rows: each expert read once for the rows that chose it, each
        row's experts added in ascending id, as `moe` adds one token's); None where the kernel does not run (not a
        CPU, a kind it lacks): the caller runs the experts one by one."""
        choices = [token_choice(routing, row) for row in range(routing.x.shape[0])]
        union = dict.fromkeys(sorted(set().union(*choices)), 0.0)  # ascending, as each row's
        limit, flag = self.arithmetic.expert_limit, self._routed_flag

        def run(experts):
            if experts is None:
                return None
            if len(choices) == 1:
                return self.kernels.moe(routing.x[0], experts, torch.tensor(list(choices[0].values())), limit,
                                        False, flags=[flag] * len(experts))[None]
            rows = [[row for row, chosen in enumerate(choices) if e in chosen] for e in union]
            weights = [[choices[row][e] for row in picked] for e, picked in zip(union, rows)]
            return self.kernels.moe_rows(routing.x, experts, rows, weights, limit, [flag] * len(experts))
        return self._run_kernel_experts(layer, union, got, run)

    def _routed_one_by_one(self, layer: int, routing, got) -> torch.Tensor:
        """The rows' routed experts summed ([B, H] float32) by the prefill's expert runner, each expert once on
        every row that chose it, as its bytes arrive."""
        with self._torch_experts_threads():
            return self._experts_one_by_one(layer, routing, got)

    def _torch_experts_threads(self):
        """Where a family's torch functions run its experts on a CPU: torch on every thread the step's kernels use,
        for this block (step_batch keeps torch on one thread for the rest of a step)."""
        if not self.torch_experts or self.device.type != "cpu":
            return contextlib.nullcontext()
        return torch_threads(token_kernels.current_threads())

    def _experts_one_by_one(self, layer: int, routing, got) -> torch.Tensor:
        block, groups = self.blocks[layer], routing.groups()
        with self.compute:
            inputs = groups.gather(routing.x.to(self.experts.expert_dtype))
            outputs = torch.zeros(inputs.shape, dtype=torch.float32, device=inputs.device)
        held = []
        try:
            for e, (a, b) in groups.spans.items():
                expert = self._expert_bytes(layer, e, got, held)
                with self.compute:
                    if isinstance(expert, ExpertWeights):
                        self.experts.apply(expert, inputs[a:b], outputs[a:b])
                    else:
                        region = block.experts[e]
                        self.experts.expert_output(block, region, expert, region.offset, inputs[a:b], outputs[a:b])
                self._give_back(held)
            for e in got.keys() - groups.spans.keys():  # read but not chosen (hash layers choose exactly these)
                self._expert_bytes(layer, e, got, held)
        finally:
            self._give_back(held)
        return groups.combine(outputs, routing.x.shape[0])

    def stats_dict(self) -> dict:
        s = self.stats
        hits, misses, admitted, evicted = (now - then for now, then in zip(self._cache_counters(),
                                                                            self._cache_counts))
        return {"tokens": s.tokens, "steps": s.steps, "seconds": round(s.seconds, 4),
                "tokens_per_s": round(s.tokens / s.seconds, 2) if s.seconds else None,
                "expert_cache_hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
                "bytes_read": s.bytes_read,
                "bytes_read_per_token": round(s.bytes_read / s.tokens) if s.tokens else None,
                "disk_wait_s": round(s.disk_wait_s, 4), "cache_bytes": self.cache.bytes,
                "cache_budget_bytes": self.cache.budget, "cache_experts": len(self.cache),
                "expert_pool": self.pool.form if self.pool is not None else None,
                "cache_admitted": admitted, "cache_evicted": evicted,
                "cache_seed_bytes": s.seed_bytes, "cache_seed_s": round(s.seed_s, 4),
                "cache_from_prefill_bytes": s.prefill_kept_bytes,
                "resident_load_s": round(s.resident_s, 4), "compute_busy_s": round(self.compute.seconds, 4),
                "kernel_layers": s.kernel_layers}

    def close(self) -> None:
        self.pipe.close()
        if self._owns_reader:
            self.reader.close()
        self.experts.close()
        self.cache = ExpertCache(0)
        if self.pool is not None:
            self.pool.release()
        self._matrices.clear()
        release_freed_memory()  # the misses' copies malloc kept (the prefill had it keep freed memory)
