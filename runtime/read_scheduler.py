"""The read scheduler: what the prefill reads, and when. The first of the streaming pipeline's three stages
(read scheduler -> device copier -> expert runner; docs/architecture.md).

Per layer, the dense region (attention, norms, router, shared expert, mHC) is read one layer ahead. The routed
experts are read in expert-ID order, in bundles of up to `bundle_experts` consecutive experts (one aligned read
each, cut at stripe boundaries), `queue_depth` reads in flight into a fixed pool of buffers that holds up to a
layer's expert section within READ_POOL_MEMORY_FRACTION of the memory. Which experts a layer reads:
- "all": every expert, known before any compute, so queued up to READ_AHEAD_LAYERS layers ahead (long prompts:
  with N tokens picking k of E experts almost every expert is used, and the disk never waits for the router);
- "hash": hash-routed layers know their experts from the token ids, read as soon as the layer's dense weights are;
- "routed": only the experts the router chose, once it ran (short prompts).
`expert_selection="auto"` chooses per layer. Expert-parallel ranks read only the experts they own.

Every region's checksum is checked before its bytes are used: by the reader threads as the bytes land where the
compute does not need the cores (a GPU prefill), else by the consumer just before it decodes them (RegionChecker).
"""

from __future__ import annotations

import statistics
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch
import xxhash

from moepack.families.base import MoeShape
from moepack.format_spec.decode import companion_names
from moepack.format_spec.errors import FormatError, MoepackError
from moepack.format_spec.reader import Block, Container, ReadSpan, Region

from .distributed import balanced_ranges
from .io import HostBuffer, ReadPipeline, RegionReader, available_memory_bytes
from .resident import ResidentBytes, ResidentPipe

EXPERT_SELECTIONS = ("auto", "all", "routed")
EXPERT_OWNERSHIPS = ("contiguous", "balanced")
EXPERT_BUFFERS_PER_READ = 2
# ... and up to a whole layer's expert section: while a layer's attention runs, the disk reads the next layer's
# experts into the pool instead of stopping once Q reads are ready (N = 256, medium model: streamed 1.40 -> 1.21 s,
# as fast as from the page cache), within this fraction of the available memory
READ_POOL_MEMORY_FRACTION = 0.125
READ_AHEAD_LAYERS = 2  # expert reads known in advance are queued this many layers beyond the current one
# auto reads a whole layer when at most this fraction of its experts is expected to go unused
ALL_EXPERTS_UNUSED_FRACTION = 0.05


@dataclass
class LayerStats:
    layer: int
    selection: str  # "all", "hash" or "routed"
    experts_read: int
    experts_used: int
    tokens_per_expert_min: int
    tokens_per_expert_median: float
    tokens_per_expert_max: int
    unused_experts: int
    bytes_read: int
    bytes_skipped: int
    owned_experts: tuple[int, int] | None = None  # expert-parallel: this rank's [first, last + 1) in this layer
    tokens_computed: int = 0  # token-expert pairs this process computed in this layer (its load)


def expected_unused_fraction(n_tokens: int, top_k: int, n_experts: int) -> float:
    """Fraction of a layer's experts that no token picks, if picks were uniform: (1 - k/E)^N."""
    return (1.0 - top_k / n_experts) ** n_tokens if n_experts else 0.0


def read_pool_buffers(section_reads: int, buffer_bytes: int, depth: int, available: int, pinned: bool = False,
                      sharers: int = 1) -> int:
    """Buffers of the expert read pool: one per read of the largest layer's expert section (`section_reads`) and at
    least EXPERT_BUFFERS_PER_READ per read in flight, within READ_POOL_MEMORY_FRACTION of `available` host memory
    (0: unknown) split between the `sharers` processes of one host (expert-parallel ranks, each reading its share of
    a section), never fewer than `depth`. Pinned pools (CUDA) stay at EXPERT_BUFFERS_PER_READ per read in flight:
    page-locked memory is taken from the whole system and slow to allocate, and a GPU's attention leaves the disk
    little time to fill more."""
    want = EXPERT_BUFFERS_PER_READ * depth
    if not pinned:
        want = max(want, -(-section_reads // max(sharers, 1)))
    if available:
        share = int(available * READ_POOL_MEMORY_FRACTION) // max(sharers, 1)
        want = min(want, share // max(buffer_bytes, 1))
    return max(depth, want)


def bundle_runs(expert_ids: list[int], bundle: int) -> list[tuple[int, int]]:
    """Group sorted expert ids into (first, count) runs of consecutive ids, each at most `bundle` long."""
    runs: list[tuple[int, int]] = []
    for e in expert_ids:
        if runs and runs[-1][0] + runs[-1][1] == e and runs[-1][1] < bundle:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((e, 1))
    return runs


def tokens_per_expert(by_expert: dict, n_experts: int) -> list[int]:
    """How many tokens the router sent to each expert 0..n_experts-1 (`by_expert`: Routing.tokens_by_expert())."""
    return [len(by_expert[e].token_index) if e in by_expert else 0 for e in range(n_experts)]


def expert_reads(block: Block, expert_ids: list[int], bundle: int) -> list[tuple[int, int, ReadSpan]]:
    """(first, count, read) for sorted `expert_ids` of `block`: runs of at most `bundle` consecutive experts, cut
    at stripe boundaries so each is one read of one part file. They stay in expert-ID order (the compute order);
    in a multi-part container consecutive stripes lie in different part files, so consecutive reads in flight go
    to different devices."""
    return [(first, count, block.expert_read(first, count))
            for first, count in block.split_runs(bundle_runs(expert_ids, bundle))]


def prefill_reader(container: Container, io_mode: str, device: torch.device) -> RegionReader:
    """The container's reader as the prefill reads: one descriptor per part file, O_DIRECT or the page cache by
    `io_mode` (io.choose_io_mode); on a CPU, page-cache reads used in place (no copy into the pool)."""
    return RegionReader(container.part_paths, io_mode, zero_copy=device.type == "cpu")


def global_regions(container: Container, names) -> list[Region]:
    """The regions of the named tensors and of their scale companions, each once."""
    wanted = [n for name in names for n in (name, *companion_names(name))]
    return list({r.index: r for r in (container.tensors[n].region for n in wanted if n in container.tensors)}.values())


class RegionChecker:
    """Checks regions' xxh3 before their bytes are used (unless `verify` is off). `on_read`: the reader threads
    check as the bytes land; otherwise the consumer calls `check` just before decoding (then the bytes are in the
    CPU's cache for it, and no reader thread hashing beside the attention stalls its OpenMP barriers)."""

    def __init__(self, container: Container, verify: bool, on_read: bool):
        self.container = container
        self.verify = verify
        self.on_read = on_read
        self._checked_globals: set[int] = set()  # this pass's global regions the consumer checked already

    def check(self, regions: list[Region], view: memoryview, base: int) -> None:
        if not self.verify:
            return
        for r in regions:
            got = xxhash.xxh3_64_hexdigest(view[r.offset - base: r.end - base])
            if got != r.xxh3:
                raise FormatError(f"region {self.container.describe(r)}: checksum mismatch while streaming: the "
                                  f"container is damaged (run `moepack verify`)")

    def after_read(self, regions: list[Region]):
        """What a reader thread runs on a read's bytes: their check where reads are checked as they land."""
        if not self.on_read:
            return None
        return lambda view: self.check(regions, view, regions[0].offset)

    def before_use(self, regions: list[Region], view: memoryview, base: int) -> None:
        """The consumer's check, where reads are not checked as they land."""
        if not self.on_read:
            self.check(regions, view, base)

    def begin_pass(self) -> None:
        self._checked_globals = set()

    def global_before_use(self, region: Region, view: memoryview) -> None:
        """A global region, checked once per pass (a tied embedding serves again as the LM head)."""
        if not self.on_read and region.index not in self._checked_globals:
            self.check([region], view, region.offset)
            self._checked_globals.add(region.index)


class ReadScheduler:
    """Issues every read of a prefill pass in the order the compute consumes them. `begin(n_tokens)` starts a pass;
    per layer, `reads_before_router` (reads known from the token ids or queued ahead) or else `reads_after_router`
    gives the layer's expert reads as (first expert, count, Future of (buffer, view)); `submit_dense` queues a
    dense region. Buffers go back with `release_expert` / `release_dense` (through the device copier, which
    knows when their bytes have left)."""

    def __init__(self, container: Container, shape: MoeShape, *, bundle_experts: int, queue_depth: int, io_mode: str,
                 expert_selection: str, verify_reads: bool, device: torch.device, dist=None,
                 balanced: bool = False, resident: ResidentBytes | None = None, reader: RegionReader | None = None):
        """`shape`: the model's layers, experts, top-k and hash layers (families.base.MoeShape). `resident`: the
        container's bytes held in memory (runtime/resident.py, checked as they were loaded): every read is a slice
        of them, nothing is read from the disk or checked again. `reader`: the container's reader where its owner
        shares it (a Generator's, with its decoder: one io mode, one set of descriptors; opened with
        `prefill_reader`), else one of its own."""
        if expert_selection not in EXPERT_SELECTIONS:
            raise MoepackError(f"unknown expert selection {expert_selection!r}")
        if bundle_experts < 1:
            raise MoepackError("--bundle-experts must be at least 1")
        self.c, self.shape = container, shape
        self._hash_layers = set(shape.hash_layers)
        self.bundle_experts, self.queue_depth, self.expert_selection = bundle_experts, queue_depth, expert_selection
        self.dist = dist  # runtime.distributed.DistContext for expert-parallel runs, else None
        self.balanced = balanced
        self._ownership: dict[int, range] = {}  # layer -> this rank's experts, where balanced by load
        pinned = device.type == "cuda"
        # a GPU prefill leaves the reader threads' cores idle: they check as the bytes arrive
        self.checker = RegionChecker(container, verify_reads and resident is None, on_read=device.type == "cuda")
        self.resident = resident
        self._owns_reader = reader is None
        self.reader = reader if reader is not None else prefill_reader(container, io_mode, device)
        self._pinned_globals = pinned
        layers = container.layers
        max_expert = max((r.length for b in layers for r in b.experts), default=4096)
        max_dense = max(b.dense.length for b in layers)
        # Q reads in flight and twice as many buffers: while the compute is busy elsewhere (the attention) the disk
        # keeps reading into the spare ones instead of stopping after Q bundles
        buffer_bytes = max_expert * bundle_experts
        section_reads = max((len(expert_reads(b, list(range(len(b.experts))), bundle_experts)) for b in layers),
                            default=0)
        pool = read_pool_buffers(section_reads, buffer_bytes, queue_depth, available_memory_bytes(), pinned,
                                 dist.world_size if dist is not None else 1)
        if resident is not None:
            self.experts_pipe, self.dense_pipe = ResidentPipe(resident, buffer_bytes), ResidentPipe(resident, max_dense)
        else:
            self.experts_pipe = ReadPipeline(self.reader, buffer_bytes, queue_depth, pinned, buffers=pool)
            # opened at the first dense read: a prefill over dense weights held resident (a Generator's) reads none,
            # and its engine is kept between generations (pinned on a GPU)
            self.dense_pipe: ReadPipeline | ResidentPipe | None = None
        self._dense_buffer = (max_dense, pinned)
        self._globals_pool: ThreadPoolExecutor | None = None  # reads the LM head during the last layer
        self._globals_later: Future | None = None  # its read of this pass
        self._queued: dict[int, list] = {}
        self._ahead = 0  # the first layer whose reads are not queued yet
        self._n_tokens = 0

    # --- which experts ---------------------------------------------------------------------------------------
    def selection(self, layer: int, n_tokens: int) -> str:
        n_experts = len(self.c.layers[layer].experts)
        if layer in self._hash_layers and self.expert_selection != "all":
            return "hash"
        if self.expert_selection == "all":
            return "all"
        if self.expert_selection == "routed":
            return "routed"
        unused = expected_unused_fraction(n_tokens, self.shape.top_k, n_experts)
        return "all" if unused <= ALL_EXPERTS_UNUSED_FRACTION else "routed"

    def owned(self, layer: int, n_experts: int) -> range:
        """The experts of `layer` this process computes: all of them, or its rank's contiguous range."""
        if not self.dist:
            return range(n_experts)
        owned = self._ownership.get(layer)  # may be an empty range: more ranks than loaded experts
        return owned if owned is not None else self.dist.owned(n_experts)

    def _balance(self, layer: int, loads: list[int]) -> None:
        """Balanced ownership: split `layer`'s experts into contiguous ranges of equal routed load (tokens per
        expert). Every rank computes the same routing, so every rank arrives at the same split."""
        self._ownership[layer] = balanced_ranges(loads, self.dist.world_size)[self.dist.rank]

    # --- a pass over the layers --------------------------------------------------------------------------------
    def begin(self, n_tokens: int) -> None:
        """Start a pass of `n_tokens`: queue the expert reads of the first layers that read their whole section.

        They are queued up to READ_AHEAD_LAYERS layers ahead: the pool's buffers, not the queue, bound what is read
        ahead, and the disk never waits for a layer to start. The queue stays in layer order (the order the reads
        are consumed in: a buffer given to a later layer's read before an earlier one's could never come back), so
        it stops at the first layer whose reads are known only from its token ids or its router."""
        self._queued, self._n_tokens = {}, n_tokens
        self.checker.begin_pass()
        self._ahead = self._queue_from(0, READ_AHEAD_LAYERS + 1)

    def end_pass(self, give_back=None) -> int:
        """The pass ended, however: whatever it left unconsumed (reads queued ahead, a layer's reads or the next
        dense region when it stopped between layers or failed) is cancelled or awaited and its buffers go back
        (`give_back(buffer, release)`: the device copier's), so the same pools serve the next pass. Returns how many
        buffers came back so."""
        self._queued = {}
        # the LM head's read of a pass that failed in its last layer ends within that pass (its bytes count in its
        # stats, not the next pass's)
        if self._globals_later is not None:
            wait([self._globals_later])
            self._globals_later = None
        return self.experts_pipe.end_pass(give_back) + (self.dense_pipe.end_pass(give_back)
                                                         if self.dense_pipe is not None else 0)

    def reads_before_router(self, layer: int, token_ids: torch.Tensor, hash_table) -> list | None:
        """The layer's expert reads where they are known before its router runs (queued ahead, or a hash layer's
        from the token ids, `hash_table()` giving its token id -> experts table), else None."""
        self._ahead = self._queue_from(self._ahead, layer + 1 + READ_AHEAD_LAYERS)  # top up
        reads = self._queued.pop(layer, None)
        if layer == self._ahead and self.selection(layer, self._n_tokens) == "hash":
            chosen = hash_table()[token_ids].reshape(-1)
            block = self.c.layers[layer]
            if self.balanced:
                self._balance(layer, torch.bincount(chosen, minlength=len(block.experts)).tolist())
            reads = self._submit_experts(block, layer, torch.unique(chosen).tolist())
            self._ahead = self._queue_from(layer + 1, layer + 1 + READ_AHEAD_LAYERS)
        return reads

    def reads_after_router(self, layer: int, by_expert: dict) -> list:
        """The layer's expert reads once its router chose (`by_expert`: Routing.tokens_by_expert())."""
        block = self.c.layers[layer]
        n_experts = len(block.experts)
        if self.balanced:
            self._balance(layer, tokens_per_expert(by_expert, n_experts))
        wanted = range(n_experts) if self.selection(layer, self._n_tokens) == "all" else sorted(by_expert)
        reads = self._submit_experts(block, layer, list(wanted))
        self._ahead = self._queue_from(layer + 1, layer + 1 + READ_AHEAD_LAYERS)
        return reads

    def _queue_from(self, first: int, until: int) -> int:
        """Queue the reads of layers first, first + 1, ... (before `until`) while each reads its whole section;
        returns the first layer not queued."""
        layer = first
        while layer < min(until, len(self.c.layers)) and self._reads_whole_section(layer):
            self._queued[layer] = self._submit_experts(self.c.layers[layer], layer,
                                                       list(range(len(self.c.layers[layer].experts))))
            layer += 1
        return layer

    def _reads_whole_section(self, layer: int) -> bool:
        """Whether `layer`'s expert reads are known before its router runs: every expert of it is read (balanced
        ownership waits for the router to split the section)."""
        return self.selection(layer, self._n_tokens) == "all" and not self.balanced

    def _submit_experts(self, block: Block, layer: int, expert_ids) -> list[tuple[int, int, Future]]:
        owned = self.owned(layer, len(block.experts))
        expert_ids = [e for e in expert_ids if e in owned]
        return [(first, count, self.experts_pipe.submit(span.offset, span.length,
                                                        self.checker.after_read(block.experts[first:first + count]),
                                                        part=span.part))
                for first, count, span in expert_reads(block, expert_ids, self.bundle_experts)]

    def submit_dense(self, block: Block) -> Future:
        if self.dense_pipe is None:
            max_dense, pinned = self._dense_buffer
            self.dense_pipe = ReadPipeline(self.reader, max_dense, 2, pinned)  # current + the next layer's prefetch
        return self.dense_pipe.submit(block.dense.offset, block.dense.length, self.checker.after_read([block.dense]),
                                      part=block.dense.part)

    def use_resident(self, held: ResidentBytes | None) -> None:
        """Serve the reads out of `held` from now on: the bytes loaded again after the ones before were released
        (None: let go of the released ones while their new copy loads)."""
        self.resident = self.experts_pipe.held = self.dense_pipe.held = held

    # --- globals: the embedding, the LM head and its norms -------------------------------------------------------
    def read_globals(self, names, held: list | None = None, for_device: bool = True
                     ) -> list[tuple[Region, HostBuffer, memoryview]]:
        """The bytes of the regions of the named tensors and their scales, read once each (no pool). Regions
        already `held` (fetched before) are not read again but returned with the rest. Into pinned memory on CUDA
        unless `for_device` is False (the bytes are decoded on the host)."""
        fetched = list(held or [])
        have = {r.index for r, _, _ in fetched}
        for r in global_regions(self.c, names):
            if r.index in have:
                continue
            if self.resident is not None:
                piece = self.resident.slice(r.part, r.offset, r.length)
                fetched.append((r, piece, piece.view))
                continue
            buf = HostBuffer(r.length, pinned=for_device and self._pinned_globals)
            view = self.reader.read_into(buf, r.offset, r.length, r.part)
            if self.checker.on_read:
                self.checker.check([r], view, r.offset)
            fetched.append((r, buf, view))
        return fetched

    def read_globals_later(self, names, held: list | None = None) -> Future:
        """read_globals on a thread of its own (the LM head, read beside the last layer's experts)."""
        if self._globals_pool is None:
            self._globals_pool = ThreadPoolExecutor(1, "moepack-globals")
        self._globals_later = self._globals_pool.submit(self.read_globals, names, held)
        return self._globals_later

    # --- what was read -----------------------------------------------------------------------------------------
    def layer_stats(self, layer: int, reads: list, by_expert: dict, dense_read: bool = True) -> LayerStats:
        block = self.c.layers[layer]
        n_experts = len(block.experts)
        counts = tokens_per_expert(by_expert, n_experts)
        read_bytes = sum(block.expert_read(first, count).length for first, count, _ in reads)
        owned = self.owned(layer, n_experts)
        section = sum(block.experts[e].length for e in owned)
        return LayerStats(layer, self.selection(layer, self._n_tokens), sum(count for _, count, _ in reads),
                          len(by_expert), min(counts, default=0), statistics.median(counts) if counts else 0,
                          max(counts, default=0), counts.count(0),
                          read_bytes + (block.dense.length if dense_read else 0),
                          section - read_bytes, (owned.start, owned.stop) if self.dist else None,
                          sum(counts[e] for e in owned))

    def pool_buffers_in_memory(self, device: torch.device) -> int:
        """How many of the expert pool's buffers hold bytes in host memory at once."""
        if self.resident is not None:
            return 0  # no pool: the resident bytes are already in memory (and counted there)
        if device.type == "cuda":
            return self.queue_depth  # pinned host memory; the device holds the reads in flight
        if self.reader.zero_copy and self.reader.mode == "mmap":
            return 0  # reads are views of the page cache: the pool's buffers are never written
        return self.experts_pipe.buffers

    def close(self) -> None:
        if self._globals_pool is not None:
            self._globals_pool.shutdown()  # its read finishes before the reader closes
        self.experts_pipe.close()
        if self.dense_pipe is not None:
            self.dense_pipe.close()
        if self._owns_reader:
            self.reader.close()
