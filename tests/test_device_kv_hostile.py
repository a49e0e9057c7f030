"""The device KV arena (families/deepseek_v4/device_kv.py) under a server's traffic and hostile states, on a CPU
along a CUDA device's branches: sequences joining and leaving in any order, a slot reused after a sequence whose
KV was not finite, states handed on mid-decode and continued, damaged states refused in one line before any
memory is taken, and the arena's memory following its sequences (given back once none is left)."""

from __future__ import annotations

import gc
import random
import threading

import pytest
import torch

from moepack.families.deepseek_v4 import device_kv, model
from moepack.format_spec.errors import MoepackError
from moepack.packer.convert import convert_checkpoint
from gpu_branches import HostSyncs
from test_device_decode import _StaticBuffers, _all_experts, _relative, generator  # noqa: F401
from test_device_kv import _prefilled, _same_states, containers, device_branches, states_kept  # noqa: F401
from v4_models import CONFIGS, saved_model

S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def _arena(seq) -> device_kv.KVArena:
    return seq.kv[0].arena


def _entry_capacity(arena) -> int:
    """The most entries a layer's pool holds (every slot's pages)."""
    return max(c.entries.pages.rows.shape[0] * device_kv.ENTRY_PAGE for L in arena.layers
               for c in L.compressors.values())


def _greedy_alone(d, seq, token: int, steps: int) -> list:
    """`seq` stepped alone `steps` times from `token`, greedily: each step's logits."""
    out = []
    for _ in range(steps):
        out.append(d.step_batch([seq], [token])[0])
        token = int(out[-1].argmax())
    return out


def _graphed(d, monkeypatch, captured=_StaticBuffers) -> None:
    """Every expert of the decoder pooled, a step's pieces as CUDA graphs (`captured`: static buffers, each piece
    run twice at its capture)."""
    from moepack.runtime import device_decode

    d.seed(_all_experts(d))
    monkeypatch.setattr(device_decode, "CapturedCall", captured)
    d.pool.graphs.enabled = True


def _poisoned(states: list) -> list:
    """Every tensor of `states` NaN (a hostile KV, or a sequence whose activations overflowed)."""
    for s in states:
        for t in s.tensors().values():
            t.fill_(float("nan"))
    return states


def test_a_slot_left_by_a_non_finite_sequence_serves_the_next_as_if_new(containers, generator, device_branches):
    """A sequence whose KV is NaN fails its step and leaves while another goes on; the next one takes its slot:
    the rows it reads masked (its window's unwritten rows, its entries past its count, its window's unfilled
    buffer) must not be the last one's, or its logits are NaN (a NaN key times a zero weight is NaN)."""
    runs = {}
    for path in ("per-row", "arena"):
        with states_kept(path), generator(containers["A16"]) as g:
            d = g.decoder
            (bystander, _), (bad, _) = _prefilled(g, lengths=(9, 70))
            bystander = d.start(bystander)
            poisoned = d.start(_poisoned(bad))
            with pytest.raises(MoepackError, match="^layer 0: .*not finite"):
                d.step_batch([poisoned], [4])
            slot = poisoned.kv[0].slot.index if path == "arena" else None
            del poisoned
            gc.collect()
            (states, first), = _prefilled(g, lengths=(5,))
            seq = d.start(states)
            if path == "arena":
                assert seq.kv[0].slot.index == slot and _arena(seq).slots == 2  # the poisoned sequence's slot
            runs[path] = _greedy_alone(d, seq, first, 6)
    for a, b in zip(runs["arena"], runs["per-row"]):
        assert bool(torch.isfinite(a).all()) and _relative(a, b) < 1e-5


@pytest.mark.parametrize("damage", ["huge count", "no overlap", "overlap shape", "gate rows", "entry width",
                                    "window dtype"])
def test_a_damaged_state_is_refused_in_one_line_before_any_memory_is_taken(containers, generator, device_branches,
                                                                            damage):
    """A state that is not a prefill's of this model: one MoepackError naming its layer, the arena as it was (no
    slot kept, no capacity grown: a count of 2**40 entries allocates nothing)."""
    with generator(containers["A16"]) as g:
        d = g.decoder
        (ok, _), = _prefilled(g, lengths=(5,))
        keep = d.start(ok)  # the arena made, one slot in use
        arena = _arena(keep)
        (states, _), = _prefilled(g, lengths=(17,))
        layer = next(i for i, s in enumerate(states) if s.layer_type == model.CSA)
        part = states[layer].compressor
        if damage == "huge count":
            part.entry_count = 2 ** 40
        elif damage == "no overlap":
            part.overlap_kv = part.overlap_gate = None
        elif damage == "overlap shape":
            part.overlap_kv = part.overlap_kv[:-1]
        elif damage == "gate rows":
            part.buffer_gate = part.buffer_gate[:-1]
        elif damage == "entry width":
            part.compressed_kv = part.compressed_kv[:, :-1]
        else:
            states[layer].window_kv = states[layer].window_kv.to(torch.complex64)
        before = arena.slots, _entry_capacity(arena), [L.generation for L in arena.layers], list(arena._free)
        with pytest.raises(MoepackError, match=f"^layer {layer}: ") as info:
            d.start(states)
        assert "\n" not in str(info.value)
        gc.collect()
        assert (arena.slots, _entry_capacity(arena), [L.generation for L in arena.layers], list(arena._free)) == before


# 1 token; a multiple of CSA's rate (4); index_topk (6) entries exactly; more than the first bucket (16) holds;
# more than a page of HCA's (rate 16) entries
SCHEDULE_PROMPTS = (1, 8, 24, 5, 70, 17, 300)


def _scheduled(g, seed: int, steps: int = 14) -> dict:
    """A server's traffic, drawn from `seed`: each step some sequences join (a new prompt, or the states another
    hands on mid-decode), some leave, the rest step together in a shuffled order, each fed drawn tokens (not its
    greedy ones: a near tie may go either way). Every sequence's logits per step, by its name, and the states the
    live ones hand on at the end."""
    d, rng = g.decoder, random.Random(seed)
    prefilled = dict(zip(SCHEDULE_PROMPTS, _prefilled(g, SCHEDULE_PROMPTS)))
    live, out, names = {}, {}, iter(range(1000))
    for step in range(steps):
        if not live or rng.random() < 0.5:
            if live and rng.random() < 0.4:  # a fork: the KV a live sequence hands on, continued by a new one
                parent = rng.choice(sorted(live))
                live[f"{next(names)}<{parent}"] = d.start(live[parent].states)
            else:
                n = rng.choice(SCHEDULE_PROMPTS)
                live[f"{next(names)}:{n}"] = d.start(prefilled[n][0])
        if len(live) > 1 and rng.random() < 0.4:
            del live[rng.choice(sorted(live))]
            gc.collect()  # (its slot given back now, as it is where nothing holds a cycle)
        rows = rng.sample(sorted(live), rng.randint(1, len(live)))  # a different subset, in any order
        logits = d.step_batch([live[name] for name in rows], [rng.randrange(3, g.cfg.vocab_size) for _ in rows])
        for name, row in zip(rows, logits):
            out.setdefault(name, []).append(row)
    return out, {name: seq.states for name, seq in live.items()}


class _Waits(_StaticBuffers):
    """_StaticBuffers recording what in a piece would wait for the host on CUDA (its capture would fail)."""
    seen: list = []

    def __init__(self, fn, inputs, pool=None):
        with HostSyncs() as mode:
            super().__init__(fn, inputs)
        _Waits.seen += mode.seen


@pytest.mark.parametrize("seed, dtype", [(1, "float32"), (2, "float32"), (3, "float32"), (4, "bfloat16")])
def test_sequences_joining_leaving_and_forking_in_any_order_step_as_alone(containers, generator, device_branches,
                                                                         monkeypatch, seed, dtype):
    """Drawn schedules of joins, leaves, forks from handed-on states and row subsets, the arena's pieces as CUDA
    graphs (static buffers, each run twice at its capture): every sequence's logits those of the per-row states
    (model.TokenKV) under the same schedule, across slot reuse at the same positions, buckets that shrink when a
    long sequence leaves, slots that double mid-traffic, pools made small; no piece waiting for the host."""
    runs = {}
    for path in ("per-row", "arena"):
        with states_kept(path), generator(containers["A16"], compute_dtype=dtype, decoded_experts=True,
                                          expert_pool=True) as g:
            d = g.decoder
            if path == "arena":
                monkeypatch.setattr(_Waits, "seen", [])
                _graphed(d, monkeypatch, _Waits)
            else:
                d.seed(_all_experts(d))
            runs[path] = _scheduled(g, seed)
            assert path == "per-row" or (d.pool.graphs.replays and _Waits.seen == [])
    (got, got_states), (want, want_states) = runs["arena"], runs["per-row"]
    assert got.keys() == want.keys() and got_states.keys() == want_states.keys()
    for name in want:
        assert len(got[name]) == len(want[name])
        for a, b in zip(got[name], want[name]):  # (bf16: the products' rounding)
            assert _relative(a, b) < (1e-5 if dtype == "float32" else 2e-2), name
    if dtype == "float32":
        for name in want_states:
            _same_states(got_states[name], want_states[name], atol=1e-5)


def test_the_arena_is_given_back_when_its_last_sequence_leaves(containers, generator, device_branches):
    """A long prompt grows every slot's entries, more sequences the slots; while one sequence is left nothing
    moves, once none is the tensors are dropped, and the next sequence gets an arena of its own size, decoding as
    the per-row states do."""
    runs = {}
    for path in ("per-row", "arena"):
        with states_kept(path), generator(containers["A16"]) as g:
            d = g.decoder
            prefilled = _prefilled(g, lengths=(300, 5, 17))
            seqs = [d.start(states) for states, _ in prefilled]
            for _ in range(2):
                d.step_batch(seqs, [f for _, f in prefilled])
            if path == "arena":
                arena = _arena(seqs[0])
                assert arena.slots == 4 and _entry_capacity(arena) >= 300 // 4 + 1
                kept = seqs.pop(1)
                del seqs[:]
                gc.collect()
                assert arena.layers is not None and arena.slots == 4  # one sequence left: kept
                del kept
                gc.collect()
                assert arena.layers is None and arena.slots == 0  # none left: given back
            else:
                del seqs[:]
            (states, first), = _prefilled(g, lengths=(17,))
            seq = d.start(states)
            if path == "arena":
                assert _arena(seq) is arena and arena.slots == 1 and _entry_capacity(arena) == 2 * device_kv.ENTRY_PAGE
            runs[path] = _greedy_alone(d, seq, first, 6)
    for a, b in zip(runs["arena"], runs["per-row"]):
        assert _relative(a, b) < 1e-5


def test_graphs_of_moved_tensors_are_retired_whatever_their_rows(containers, generator, device_branches,
                                                                  monkeypatch):
    """Three rows, then two (one left), then four of five (the slots double: every layer's tensors move): no graph of
    the tensors before is kept, whichever rows it was captured for (each holds its own memory on a device)."""
    with generator(containers["A16"], decoded_experts=True, expert_pool=True) as g:
        d = g.decoder
        _graphed(d, monkeypatch)
        prefilled = _prefilled(g, lengths=(5, 17, 9, 12, 3, 6))
        seqs = [d.start(states) for states, _ in prefilled[:3]]
        for rows in (3, 2):
            seqs = seqs[:rows]
            gc.collect()
            d.step_batch(seqs, [4] * rows)
        seqs += [d.start(states) for states, _ in prefilled[3:]]
        arena = _arena(seqs[0])
        assert arena.slots == 8
        d.step_batch(seqs[:4], [4] * 4)
        keys = [k for k in d.pool.graphs._captured if k[0] == "arena attention"]
        assert sorted((k[1], k[2]) for k in keys) == [(layer, 4) for layer in range(len(d.blocks))]
        assert all(k[-1] == arena.layers[k[1]].generation for k in keys)


@pytest.mark.parametrize("after", [3, 4, 5, 16])
def test_a_sequence_continued_from_handed_on_states_goes_on_as_the_original(containers, generator, device_branches,
                                                                           after):
    """`states` handed on after a 17-token prompt and `after` steps (the KV of `generate --kv-out`, of serve's
    prefix cache: a window just closed, mid-window, the sliding window's wrap) and a new sequence started from
    them: it steps as the original does, to the bit."""
    with generator(containers["A16"]) as g:
        d = g.decoder
        (states, first), = _prefilled(g, lengths=(17,))
        seq = d.start(states)
        token = first
        for _ in range(after):
            token = int(d.step_batch([seq], [token])[0].argmax())
        twin = d.start(seq.states)
        for _ in range(8):
            a, b = d.step_batch([seq, twin], [token, token])
            assert torch.equal(a, b)
            token = int(a.argmax())
        _same_states(seq.states, twin.states, atol=0)


@pytest.fixture(scope="module")
def sliding_only(tmp_path_factory):
    base = tmp_path_factory.mktemp("sliding-only")
    config = dict(CONFIGS["B"], layer_types=[S] * 4)
    saved_model(config, 7, str(base / "src"))
    convert_checkpoint(str(base / "src"), str(base / "S.moepack"), progress=False)
    return str(base / "S.moepack")


def test_a_model_of_sliding_layers_only_steps_in_the_arena_as_per_row(sliding_only, generator, device_branches):
    runs = {}
    for path in ("per-row", "arena"):
        with states_kept(path), generator(sliding_only) as g:
            d = g.decoder
            prefilled = _prefilled(g, lengths=(1, 7, 8, 20))
            seqs = [d.start(states) for states, _ in prefilled]
            tokens, out = [f for _, f in prefilled], []
            for _ in range(10):
                out.append(d.step_batch(seqs, tokens))
                tokens = out[-1].argmax(-1).tolist()
            runs[path] = out, [s.states for s in seqs]
    for a, b in zip(runs["arena"][0], runs["per-row"][0]):
        assert max(_relative(a[r], b[r]) for r in range(4)) < 1e-5
    for a, b in zip(runs["arena"][1], runs["per-row"][1]):
        _same_states(a, b, atol=1e-5)


def _device_bytes(arena) -> int:
    """The bytes of every tensor the arena's layers hold (each storage once)."""
    seen, total, todo = set(), 0, list(arena.layers)
    while todo:
        obj = todo.pop()
        for value in (obj.values() if isinstance(obj, dict) else vars(obj).values()):
            if isinstance(value, torch.Tensor):
                if value.untyped_storage().data_ptr() not in seen:
                    seen.add(value.untyped_storage().data_ptr())
                    total += value.untyped_storage().nbytes()
            elif isinstance(value, dict) or hasattr(value, "__dict__") and not isinstance(value, type):
                todo.append(value)
    return total


def test_the_arena_holds_about_its_sequences_kv_not_every_slot_the_longests(containers, generator, device_branches):
    """One long prompt (300 tokens: 75 CSA entries) beside seven short ones, as `serve --max-batch 8` meets them:
    the arena's entries take about what the sequences' own do (pages of them), not eight slots of the longest's
    capacity (what the memory checks, which count each sequence's KV, would not foresee: a GPU out of memory in
    the middle of a step). Ring and buffers are per slot (a window and a compressor window each)."""
    with generator(containers["A16"]) as g:
        d = g.decoder
        prefilled = _prefilled(g, lengths=(300,) + (5,) * 7)
        seqs = [d.start(states) for states, _ in prefilled]
        d.step_batch(seqs, [f for _, f in prefilled])
        arena, cfg = _arena(seqs[0]), g.cfg
        per_slot = entries = 0
        for layer, kind in enumerate(cfg.layer_types):
            per_slot += cfg.sliding_window * cfg.head_dim
            for name, *_ in model.TOKEN_COMPRESSORS[kind]:
                rate, dim = cfg.compress_rates[layer], cfg.head_dim if name == "compressor" else cfg.index_head_dim
                width = 2 * dim if kind == model.CSA else dim
                per_slot += 2 * rate * width + (4 * rate * dim if kind == model.CSA else 0)
                # each sequence's entries so far and the one it writes, in whole pages of 16
                entries += sum(-(-(s.seen_tokens // rate + 1) // 16) * 16 for s in seqs) * dim
        assert _device_bytes(arena) <= 4 * (per_slot * arena.slots + 2 * entries) + 64 * 1024


def test_a_sequence_after_no_token_steps_as_per_row(containers, generator, device_branches):
    """States of 0 tokens (no window, no entry, nothing buffered): the first steps as the per-row states'."""
    runs = {}
    for path in ("per-row", "arena"):
        with states_kept(path), generator(containers["A16"]) as g:
            d = g.decoder
            (states, _), = _prefilled(g, lengths=(1,))
            empty = []
            for s in states:
                parts = {name: type(getattr(s, name))(getattr(s, name).compressed_kv[:0], getattr(s, name).buffer_kv[:0],
                                                      getattr(s, name).buffer_gate[:0], 0)
                         for name in ("compressor", "indexer") if getattr(s, name) is not None}
                empty.append(type(s)(s.layer_type, 0, s.window_kv[:0], **parts))
            seq = d.start(empty)
            runs[path] = _greedy_alone(d, seq, 5, 20), seq.states
    for a, b in zip(runs["arena"][0], runs["per-row"][0]):
        assert _relative(a, b) < 1e-5
    _same_states(runs["arena"][1], runs["per-row"][1], atol=1e-5)


def test_a_slot_taken_again_at_the_same_position_steps_as_its_first_sequence(containers, generator, device_branches):
    """A sequence leaves after one step while another goes on; another from the same prompt takes its slot at the
    same position (the step's rows, cached by (slot, position), the same): its step is the first one's, to the
    bit."""
    with generator(containers["A16"]) as g:
        d = g.decoder
        (other, _), (states, first) = _prefilled(g, lengths=(9, 70))
        other = d.start(other)
        seq = d.start(states)
        slot = seq.kv[0].slot.index
        want = d.step_batch([seq], [first])
        del seq
        gc.collect()
        again = d.start(states)
        assert again.kv[0].slot.index == slot
        assert torch.equal(d.step_batch([again], [first]), want)


def test_the_last_sequence_dropped_on_another_thread_or_inside_an_admit(containers, generator, device_branches):
    """A sequence's slot is given back by a finalizer, in whatever thread drops it last (a server's request
    thread): the arena given back there too. One dropped while an admit holds the arena (a finalizer run by an
    allocation inside it) only marks its slot: that admit, or the next, gives the idle arena back itself."""
    with generator(containers["A16"]) as g:
        d = g.decoder
        (long, _), (short, _) = _prefilled(g, lengths=(300, 5))
        held = [d.start(long)]
        arena = _arena(held[0])
        dropper = threading.Thread(target=lambda: (held.clear(), gc.collect()))
        dropper.start()
        dropper.join()
        assert arena.layers is None
        held.append(d.start(long))
        assert _entry_capacity(arena) > 2 * device_kv.ENTRY_PAGE
        with arena._lock:  # as inside an admit
            held.clear()
            gc.collect()
        assert arena.layers is not None and arena._dead == [0]
        seq = d.start(short)
        assert arena.slots == 1 and _entry_capacity(arena) == 2 * device_kv.ENTRY_PAGE
        assert seq.kv[0].slot.index == 0


def _left_by_a_long_one(g, long: int) -> tuple:
    """A `long`-token prompt and a 17-token one step once together, then the long one leaves: (the short one, its
    next token, the layers' pools before it left; None per-row)."""
    d = g.decoder
    (long, long_first), (short, first) = _prefilled(g, lengths=(long, 17))
    seqs = [d.start(long), d.start(short)]
    tokens = d.step_batch(seqs, [long_first, first]).argmax(-1).tolist()
    seq = seqs.pop()
    pools = _pools(_arena(seq)) if isinstance(seq.kv[0], device_kv.ArenaKV) else None
    del seqs[:]
    gc.collect()
    return seq, tokens[1], pools


def _pools(arena) -> list[tuple[int, int]]:
    """Each layer's page pools: (pages, pages in use, the zero page with them)."""
    return [(c.entries.pages.rows.shape[0], 1 + sum(map(len, c.entries.owned)))
            for L in arena.layers for c in L.compressors.values()]


def test_a_pool_mostly_free_once_a_long_sequence_leaves_is_made_small(containers, generator, device_branches,
                                                                      monkeypatch):
    """A 600-token prompt decodes beside a short one, then leaves (a server never idle): a layer's page pool
    grown for it, now mostly free, is made anew (the pages in use copied) at most four times what is in use; the
    short one decodes on as the per-row states do, its pieces as CUDA graphs (those of the old pools retired)."""
    runs = {}
    for path in ("per-row", "arena"):
        with states_kept(path), generator(containers["A16"], decoded_experts=True, expert_pool=True) as g:
            d = g.decoder
            if path == "arena":
                _graphed(d, monkeypatch)
            seq, token, grown = _left_by_a_long_one(g, 600)
            runs[path] = _greedy_alone(d, seq, token, 6)
            if path == "arena":
                arena = _arena(seq)
                assert all(size <= 4 * used for size, used in _pools(arena))
                assert sum(size for size, _ in _pools(arena)) < sum(size for size, _ in grown) / 2
                keys = [k for k in d.pool.graphs._captured if k[0] == "arena attention"]
                assert all(k[-1] == arena.layers[k[1]].generation for k in keys)  # (B = 2's of a pool moved gone)
    for a, b in zip(runs["arena"], runs["per-row"]):
        assert _relative(a, b) < 1e-5


def test_graphs_of_a_larger_bucket_are_retired_when_the_rows_change(containers, generator, device_branches,
                                                                   monkeypatch):
    """A long sequence beside a short one (two rows, a large bucket) leaves: the short one's steps (one row, the
    least bucket) retire the two rows' graphs of the large bucket (on a device each holds its [rows, bucket]
    intermediates: gigabytes at a long context), not only the one row's."""
    with generator(containers["A16"], decoded_experts=True, expert_pool=True) as g:
        d = g.decoder
        _graphed(d, monkeypatch)
        seq, token, _ = _left_by_a_long_one(g, 300)
        _greedy_alone(d, seq, token, 2)
        keys = [k for k in d.pool.graphs._captured if k[0] == "arena attention"]
        assert {k[3] for k in keys} <= {0, device_kv.ENTRY_BUCKET_MIN}, keys


def test_continuous_batching_over_the_arena_gives_each_sequence_its_tokens_alone(containers, generator,
                                                                                device_branches):
    """`serve --max-batch 3`'s scheduler over the arena: five greedy generations (1 to 70 prompt tokens, chunked
    prefills, joining and leaving between steps) get the tokens the per-row states give each alone; once all are
    over, no slot is left held (the arena given back)."""
    from moepack.runtime.batching import BatchScheduler
    from moepack.runtime.generate import GenerateOptions

    lengths, new = (1, 70, 8, 24, 17), (9, 5, 12, 7, 10)
    with states_kept("per-row"), generator(containers["A16"]) as g:
        prompts = [torch.randint(3, g.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                   for n in lengths]
        alone = [g.generate(ids, GenerateOptions(max_new_tokens=m, stop_at_eos=False)).generated_ids
                 for ids, m in zip(prompts, new)]
    with generator(containers["A16"]) as g:
        scheduler = BatchScheduler(g, max_batch=3, prefill_chunk=16)
        try:
            futures = [scheduler.submit(ids, GenerateOptions(max_new_tokens=m, stop_at_eos=False))
                       for ids, m in zip(prompts, new)]
            got = [f.result(120).generated_ids for f in futures]
        finally:
            scheduler.close()
        arena = g.decoder.arithmetic._arena
        gc.collect()
        assert arena is not None and arena.layers is None
    assert got == alone
