"""Decode steps of several sequences over model.py's functions (the path off the CPU's compiled layers), and the
device expert pool (runtime/device_decode.py): each row equals its sequence stepped alone, the pool equals the
per-expert path, with and without misses, and asks the host nothing where every expert is pooled."""

from __future__ import annotations

import functools

import pytest
import torch

from moepack.families.deepseek_v4.token_layer import TokenLayers
from moepack.packer.convert import convert_checkpoint
from moepack.runtime import generate as generate_module
from moepack.runtime.decode import Decoder
from moepack.runtime.engine import PrefillOptions
from moepack.runtime.generate import Generator
from containers import tiny_keep_container, tiny_policy_containers
from gpu_branches import HostSyncs
from v4_models import CONFIGS, saved_model

PROMPTS = (5, 17, 33)  # different lengths: each sequence's KV its own


@pytest.fixture(scope="module")
def containers(tmp_path_factory):
    """A (5 layers, 2 hash layers, 8 experts top-2) and B (16 experts top-4, one hash layer), float32 experts; and
    the tiny synthetic model in the release layout, its FP4 experts kept, and converted to MXFP4."""
    base = tmp_path_factory.mktemp("device-decode")
    out = {}
    for i, name in enumerate(("A", "B")):
        saved_model(CONFIGS[name], 300 + i, str(base / name))
        out[name] = str(base / f"{name}.moepack")
        convert_checkpoint(str(base / name), out[name], progress=False)
    out["tiny-fp4"] = tiny_keep_container(tmp_path_factory)
    out["tiny-mxfp4"] = tiny_policy_containers(base / "mxfp4", ["fp4"], seed=3)["fp4"]  # (pair-ordered columns)
    return out


@pytest.fixture
def generator(monkeypatch):
    """generator(container, compute_dtype=, cache_gib=, **Decoder keywords): a Generator whose decoder runs
    model.py's functions (TokenLayers off), built with those keywords."""
    monkeypatch.setattr(TokenLayers, "make", classmethod(lambda cls, *a: None))

    def make(container, compute_dtype="float32", cache_gib=1.0, device="cpu", **decoder):
        monkeypatch.setattr(generate_module, "Decoder", functools.partial(Decoder, **decoder))
        g = Generator(container, cache_gib=cache_gib,
                      prefill=PrefillOptions(compute_dtype=compute_dtype, device=device))
        assert g.decoder.layers is None
        return g
    return make


def _prompt(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _prefilled(g: Generator, lengths=PROMPTS) -> list[tuple[torch.Tensor, list, int]]:
    """(prompt, KV states, first greedy token) for a prompt of each length."""
    out = []
    for n in lengths:
        ids = _prompt(n, g.cfg.vocab_size, seed=n)
        logits, states, *_ = g._prefill(ids, None, 8)
        out.append((ids, states, int(logits.argmax())))
    return out


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _batched_against_solo(g: Generator, steps: int, tol: float) -> list[list[int]]:
    """Greedy steps of every prompt together and of each alone: the same tokens, logits within `tol` (relative).
    The tokens of each row."""
    d = g.decoder
    prefilled = _prefilled(g)
    together = [d.start(states) for _, states, _ in prefilled]
    alone = [d.start(states) for _, states, _ in prefilled]
    tokens = [[first] for *_, first in prefilled]
    for _ in range(steps):
        batch = d.step_batch(together, [t[-1] for t in tokens])
        assert batch.shape == (len(prefilled), g.cfg.vocab_size) and batch.dtype == torch.float32
        for b, seq in enumerate(alone):
            solo = d.step_batch([seq], [tokens[b][-1]])[0]
            assert _relative(batch[b], solo) < tol
            assert int(batch[b].argmax()) == int(solo.argmax())
            tokens[b].append(int(solo.argmax()))
    return tokens


@pytest.mark.parametrize("name", ["A", "B"])
def test_a_batched_step_equals_each_sequence_stepped_alone(containers, generator, name):
    """B = 3 prompts of different lengths (hash layers among the layers) stepped together: each row's greedy
    tokens and logits (to float32 rounding) are its sequence's stepped alone (B = 1), and B = 1's logits are the
    prefill's over the prompt with the token appended."""
    with generator(containers[name]) as g:
        d = g.decoder
        tokens = _batched_against_solo(g, steps=4, tol=1e-5)
        assert d.stats.steps == 4 * (1 + len(PROMPTS))
        ids, states, first = _prefilled(g, lengths=(17,))[0]
        stepped = d.step_batch([d.start(states)], [first])[0]
        whole = g._prefill(torch.cat([ids, torch.tensor([first])]), None, 8)[0]
        assert _relative(stepped, whole) < 1e-4 and int(stepped.argmax()) == int(whole.argmax())
    assert all(len(t) == 5 for t in tokens)


def test_a_batched_bfloat16_step_equals_each_sequence_stepped_alone(containers, generator):
    with generator(containers["A"], compute_dtype="bfloat16") as g:
        assert g.decoder.dense[0]["attn.wq_b.weight"].dtype == torch.bfloat16
        _batched_against_solo(g, steps=3, tol=2e-2)


def test_a_batched_step_of_decoded_experts_equals_each_alone(containers, generator):
    """The per-expert path over a cache of decoded experts (a GPU's, without the pool), rows together and alone."""
    with generator(containers["B"], decoded_experts=True, expert_pool=False) as g:
        assert g.decoder.pool is None
        _batched_against_solo(g, steps=3, tol=1e-5)


def test_a_step_names_two_rows_of_one_sequence_or_unequal_counts(containers, generator):
    with generator(containers["A"]) as g:
        d = g.decoder
        (_, states, first), = _prefilled(g, lengths=(5,))
        seq = d.start(states)
        with pytest.raises(ValueError):
            d.step_batch([seq, seq], [first, first])
        with pytest.raises(ValueError):
            d.step_batch([seq], [first, first])


# --- the expert pool ---------------------------------------------------------------------------------------------

def _all_experts(d: Decoder) -> list[list[int]]:
    return [[1] * len(block.experts) for block in d.blocks]


def _routed_bytes(d: Decoder) -> int:
    return sum(d._entry_bytes(layer, e) for layer, b in enumerate(d.blocks) for e in range(len(b.experts)))


def _greedy_rows(g: Generator, steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy steps of every prompt together: each row's tokens, and each step's logits."""
    d = g.decoder
    prefilled = _prefilled(g)
    seqs = [d.start(states) for _, states, _ in prefilled]
    tokens, seen = [[first] for *_, first in prefilled], []
    for _ in range(steps):
        logits = d.step_batch(seqs, [t[-1] for t in tokens])
        seen.append(logits)
        for b, row in enumerate(logits):
            tokens[b].append(int(row.argmax()))
    return tokens, seen


def _assert_table_consistent(d: Decoder) -> None:
    """The pool's device table, its host mirror and the cache agree (between steps: no scratch slot in use, the
    scratch's part of the budget held apart from the entries'); each slot holds its expert's weights."""
    pool, cache = d.pool, d.cache
    table = pool.slot_of.cpu()
    pooled = {(layer, e): int(table[layer, e]) for layer, e in zip(*torch.nonzero(table >= 0, as_tuple=True))}
    pooled = {(int(layer), int(e)): s for (layer, e), s in pooled.items()}
    assert pooled == pool._slots and not pool._in_scratch
    assert set(pooled) == set(cache._entries)  # every entry a slot, every slot an entry
    assert len(set(pooled.values())) == len(pooled)  # no slot twice
    assert sorted([*pooled.values(), *pool._free, *pool._scratch]) == list(range(pool.capacity))
    assert cache.reserved == len(pool._scratch) * pool.slot_bytes
    assert cache.bytes == len(pooled) * pool.slot_bytes <= cache.budget - cache.reserved
    for layer in range(len(d.blocks)):
        assert pool.complete(layer) == (sum(1 for key in pooled if key[0] == layer) == len(d.blocks[layer].experts))
    for (layer, e), slot in list(pooled.items())[:6]:  # the slot's weights are the expert's, decoded afresh
        region = d.blocks[layer].experts[e]
        w = d.experts.expert_weights(d.blocks[layer], region, d._read_region(region), region.offset)
        if w.input_order is None and w.hidden_order is None:
            assert torch.equal(pool.gate_up[slot], torch.cat([w.w1, w.w3]))
            assert torch.equal(pool.down[slot], w.w2)
        else:  # MXFP4's pair-ordered columns, put in order in the slot: the same expert
            x = torch.randn(3, pool.hidden, generator=torch.Generator().manual_seed(slot)).to(pool.dtype)
            expert = {"forward": d.experts.expert_forward, "limit": d.experts.expert_limit}
            assert torch.allclose(pool.weights(slot).apply(x, **expert), w.apply(x, **expert), rtol=1e-5, atol=1e-6)
        assert cache._entries[(layer, e)].w1.data_ptr() == pool.gate_up[slot].data_ptr()


@pytest.mark.parametrize("name", ["A", "B", "tiny-fp4", "tiny-mxfp4"])
def test_a_complete_pool_steps_like_the_per_expert_path_without_asking_the_host(containers, generator, name):
    """Every expert pooled: the same greedy tokens as the per-expert path over the same decoded experts, logits to
    float32 rounding, no synchronisation of the routed work (the host never looked at a choice), each layer's
    choices still counted as hits."""
    results, hits = {}, {}
    for pooled in (False, True):
        with generator(containers[name], decoded_experts=True, expert_pool=pooled) as g:
            d = g.decoder
            d.seed(_all_experts(d))
            if pooled:
                assert d.pool is not None and all(d.pool.complete(layer) for layer in range(len(d.blocks)))
            results[pooled] = _greedy_rows(g, steps=4)
            hits[pooled] = d.cache.hits
            assert d.cache.misses == 0 and d.stats.bytes_read == 0
            if pooled:
                assert d.pool.syncs == 0 and d.pool.calls == 4 * len(d.blocks)
                _assert_table_consistent(d)
    assert results[True][0] == results[False][0]
    assert hits[True] == hits[False] > 0  # each step's distinct (layer, expert) counted once, as a lookup counts
    for a, b in zip(results[True][1], results[False][1]):
        assert _relative(a, b) < 1e-5


@pytest.mark.parametrize("name", ["A", "B"])
def test_a_pool_too_small_for_every_expert_evicts_and_steps_like_the_per_expert_path(containers, generator, name):
    """A pool for 40 % of the experts: misses read and decoded into free slots (the least recently used evicted),
    one synchronisation per layer and step at most, the cache's counts truthful, the table consistent; the same
    greedy tokens as the per-expert path."""
    results = {}
    for pooled in (False, True):
        with generator(containers[name], decoded_experts=True, expert_pool=pooled, cache_gib=0.0) as g:
            d = g.decoder
            d.cache.resize(int(0.4 * _routed_bytes(d)))
            if pooled:
                d.cache.store = d.pool
            results[pooled] = _greedy_rows(g, steps=5)
            if pooled:
                cache, pool = d.cache, d.pool
                assert pool.capacity == cache.budget // pool.slot_bytes
                assert cache.misses > 0 and cache.hits > 0 and cache.evicted > 0 and cache.admitted > 0
                layer_steps = 5 * len(d.blocks)
                assert 0 < pool.syncs <= layer_steps
                assert pool.calls == layer_steps  # every miss decoded into a slot: no layer ran expert by expert
                stats = d.stats_dict()
                assert stats["cache_experts"] == len(pool._slots) and stats["cache_bytes"] == cache.bytes
                assert stats["bytes_read"] > 0
                _assert_table_consistent(d)
                # a smaller budget: the stacks shrink, the kept experts move, the table follows
                cache.resize(cache.budget // 2)
                assert pool.capacity == cache.budget // pool.slot_bytes
                _assert_table_consistent(d)
                results["shrunk"] = _greedy_rows(g, steps=5)
                _assert_table_consistent(d)
                cache.resize(0)  # no pool left: every layer reads its experts and runs them one by one
                assert pool.capacity == 0 and pool.gate_up is None and not len(cache)
                assert bool((pool.slot_of < 0).all())
                calls = pool.calls
                results["none"] = _greedy_rows(g, steps=2)
                assert pool.calls == calls  # (none since)
    assert results[True][0] == results[False][0] == results["shrunk"][0]
    assert [row[:3] for row in results[False][0]] == results["none"][0]
    for a, b in zip(results[True][1], results[False][1]):
        assert _relative(a, b) < 1e-5


def test_a_pool_in_bfloat16_steps_like_the_per_expert_path(containers, generator):
    results = {}
    for pooled in (False, True):
        with generator(containers["A"], compute_dtype="bfloat16", decoded_experts=True, expert_pool=pooled) as g:
            d = g.decoder
            assert d.experts.expert_dtype == torch.bfloat16
            d.seed(_all_experts(d))
            results[pooled] = _greedy_rows(g, steps=3)
            assert not pooled or d.pool.syncs == 0
    assert results[True][0] == results[False][0]
    for a, b in zip(results[True][1], results[False][1]):
        assert _relative(a, b) < 2e-2


def test_a_pooled_layer_whose_output_is_not_finite_is_named_after_the_step(containers, generator):
    """The pool's layers are checked finite after the step's logits (no synchronisation per layer): the first
    layer that is not finite is named, as model.check_finite names it."""
    from moepack.format_spec.errors import MoepackError

    with generator(containers["A"], decoded_experts=True, expert_pool=True) as g:
        d = g.decoder
        d.seed(_all_experts(d))
        (_, states, first), = _prefilled(g, lengths=(9,))
        for e in range(len(d.blocks[2].experts)):
            d.pool.gate_up[d.pool.slot(2, e)] = float("nan")
        with pytest.raises(MoepackError, match="^layer 2: its output is not finite"):
            d.step_batch([d.start(states)], [first])


class _StaticBuffers:
    """device_decode.CapturedCall's contract on a CPU: the inputs copied into static tensors, the piece run twice
    at capture, its outputs static tensors overwritten at each call (what a replayed graph does); `pool` kept."""

    def __init__(self, fn, inputs, pool=None):
        self.fn, self.inputs, self.pool = fn, tuple(t.clone() for t in inputs), pool
        fn(*self.inputs)
        out = fn(*self.inputs)
        self.output = tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()

    def __call__(self, *args):
        for static, arg in zip(self.inputs, args):
            static.copy_(arg)
        out = self.fn(*self.inputs)
        for static, new in zip(*((self.output, out) if isinstance(out, tuple) else ((self.output,), (out,)))):
            static.copy_(new)
        return self.output


@pytest.mark.parametrize("fraction", [1.0, 0.4], ids=["complete", "misses"])
def test_the_step_through_static_buffers_as_cuda_graphs_replay_them_equals_eager(containers, generator, monkeypatch,
                                                                                  fraction):
    """The Decoder's use of StepGraphs on a CPU, each piece behind static inputs and outputs as a CUDA graph
    keeps them: every output is used before its piece runs again, so the tokens and logits are the eager ones.
    Every expert pooled: two pieces a layer (the attention's entry, the FFN); with misses, a layer not complete
    runs four (the attention's entry, the router, the routed work, the finish); the head one a step."""
    from moepack.runtime import device_decode

    results = {}
    for graphs in (False, True):
        with generator(containers["A"], decoded_experts=True, expert_pool=True) as g:
            d = g.decoder
            d.cache.resize(int(fraction * _routed_bytes(d)))
            d.seed(_all_experts(d))
            kinds = []
            if graphs:
                monkeypatch.setattr(device_decode, "CapturedCall", _StaticBuffers)
                d.pool.graphs.enabled = True
                run = d.pool.graphs.run
                monkeypatch.setattr(d.pool.graphs, "run",
                                    lambda key, *a, **k: kinds.append(key[0]) or run(key, *a, **k))
            results[graphs] = _greedy_rows(g, steps=4)
            assert (d.pool.syncs == 0) == (fraction == 1.0)
            if not graphs:
                assert d.pool.graphs.replays == 0
                continue
            layers = "".join("F" if k == "ffn" else "R" if k == "route" else "" for k in kinds)  # each layer's
            assert len(layers) == 4 * len(d.blocks) and ("R" in layers) == (fraction < 1)
            assert d.pool.graphs.replays == len(kinds) == 2 * len(layers) + 2 * layers.count("R") + 4  # (+ head's)
            for kind in ("routed", "finish"):
                assert kinds.count(kind) == layers.count("R")
    assert results[True][0] == results[False][0]
    for a, b in zip(results[True][1], results[False][1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fraction", [1.0, 0.4], ids=["complete", "misses"])
def test_no_captured_piece_waits_for_the_host(containers, generator, monkeypatch, fraction):
    """What StepGraphs captures on CUDA (each layer's attention entry and FFN, or with misses its router, its routed
    work over the pool and its finish), run on a CPU along the branches a GPU takes (no compiled token kernels, no
    native mHC): no op in it waits for the host (an .item(), a nonzero, a mask, a host list made a tensor) -- one
    would fail the capture on CUDA."""
    from moepack.backends import ops
    from moepack.families.deepseek_v4 import mhc_native
    from moepack.runtime import device_decode

    monkeypatch.setattr(ops, "kernels_for", lambda *a: None)
    for name in ("hc_mix_weights", "token_pre", "token_post"):
        monkeypatch.setattr(mhc_native, name, lambda *a, **k: None)
    captured = []

    class Checked(_StaticBuffers):
        def __init__(self, fn, inputs, pool=None):
            with HostSyncs() as mode:  # none may run inside a captured piece: the capture fails on CUDA
                super().__init__(fn, inputs, pool)
            captured.append((fn, mode.seen))
    monkeypatch.setattr(device_decode, "CapturedCall", Checked)
    with generator(containers["A"], compute_dtype="bfloat16", decoded_experts=True, expert_pool=True) as g:
        d = g.decoder
        d.cache.resize(int(fraction * _routed_bytes(d)))
        d.seed(_all_experts(d))
        d.pool.graphs.enabled = True
        _greedy_rows(g, steps=2)
        # two a layer-step, two more where it had misses (a sync each: its router and finish); the head's
        assert d.pool.graphs.replays == 2 * 2 * len(d.blocks) + 2 * d.pool.syncs + 2
    assert len(captured) >= 2 * len(d.blocks) + 1
    assert [seen for _, seen in captured if seen] == []


def test_a_pool_of_more_slots_than_cudas_grouped_gemm_takes_runs_in_runs_of_slots(containers, generator, monkeypatch):
    """CUDA's grouped GEMM takes at most MAX_GROUPS groups: a larger pool runs its slots in runs, each GEMM over
    every row, each row taken from its own slot's run. The same tokens and logits as one GEMM over the pool; every
    grouped GEMM call meets CUDA's checks (alignment, strides, dtype, group count, offsets)."""
    from moepack.backends import grouped_experts

    real, calls = grouped_experts._GROUPED_MM, []

    def checked(a, b, offs):
        calls.append((b.shape[0], grouped_experts.grouped_mm_refusal(a, b, offs, as_cuda=True)))
        return real(a, b, offs=offs)
    monkeypatch.setattr(grouped_experts, "_GROUPED_MM", checked)
    results = {}
    for limit in (grouped_experts.MAX_GROUPS, 7):
        monkeypatch.setattr(grouped_experts, "MAX_GROUPS", limit)
        with generator(containers["A"], compute_dtype="bfloat16", decoded_experts=True, expert_pool=True) as g:
            d = g.decoder
            d.seed(_all_experts(d))
            assert d.pool.capacity == 40 > 7
            results[limit] = _greedy_rows(g, steps=3)
    # one GEMM of 40 groups; runs of 6 slots (the first), 6 and their lead, ..., the last 4 and their lead
    assert {groups for groups, _ in calls} == {40, 6, 7, 40 - 6 * 6 + 1}
    assert [refusal for _, refusal in calls if refusal] == []
    assert results[7][0] == results[grouped_experts.MAX_GROUPS][0]
    for a, b in zip(results[7][1], results[grouped_experts.MAX_GROUPS][1]):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_the_pools_routed_work_is_a_replayed_graph_equal_to_eager(containers, generator):
    """On a GPU (bf16 experts, the pool by default): each layer's fixed-shape work (its attention's mHC entry, its
    FFN with the routed experts over the pool) captured once per B and replayed, no synchronisation with every
    expert pooled; the same tokens as the eager pool, logits to bf16 rounding of the
    per-expert path's."""
    results = {}
    for mode in ("graphs", "eager", "per-expert"):
        pool = {"expert_pool": False} if mode == "per-expert" else {}
        with generator(containers["A"], compute_dtype="bfloat16", device="cuda", **pool) as g:
            d = g.decoder
            assert d.device.type == "cuda" and (d.pool is not None) == (mode != "per-expert")
            if d.pool is not None:
                d.pool.graphs.enabled = mode == "graphs"
            d.seed(_all_experts(d))
            results[mode] = _greedy_rows(g, steps=4)
            if d.pool is not None:  # each layer: its attention's entry, then its FFN, each one graph
                assert d.pool.syncs == 0 and d.pool.calls == 4 * len(d.blocks)
                assert d.pool.graphs.replays == (2 * d.pool.calls + 4 if mode == "graphs" else 0)  # (+ the head's)
    assert results["graphs"][0] == results["eager"][0]
    for a, b in zip(results["graphs"][1], results["eager"][1]):
        assert _relative(a, b) < 1e-6
    for a, b in zip(results["graphs"][1], results["per-expert"][1]):
        assert _relative(a, b) < 2e-2


def test_a_piece_reads_another_pieces_output_in_place_and_one_replaced_is_copied_in(monkeypatch):
    """StepGraphs (graphs as a CPU emulates them): a piece whose input is an earlier piece's output buffer reads it
    where it is (no copy at its replays); when that producer is captured again (new buffers) or the input comes
    from elsewhere, the new tensor is copied where the piece reads, and the piece is not captured again."""
    from moepack.runtime import device_decode

    monkeypatch.setattr(device_decode, "CapturedCall", _StaticBuffers)
    graphs = device_decode.StepGraphs(True, torch.device("cpu"))

    def double(t):
        return t * 2

    def plus_one(t):
        return t + 1
    x = torch.arange(4.0)
    produced = graphs.run(("double",), double, x)
    assert torch.equal(graphs.run(("plus",), plus_one, produced), x * 2 + 1)
    piece = graphs._captured[("plus",)]
    assert piece.copied == () and piece.shared[0][1] is produced
    x = torch.arange(4.0) + 10
    assert graphs.run(("double",), double, x) is produced
    assert torch.equal(graphs.run(("plus",), plus_one, produced), x * 2 + 1)
    graphs.forget(("double",))  # (a new bucket's producer: its outputs are new tensors)
    again = graphs.run(("double",), double, x - 5)
    assert again is not produced
    assert torch.equal(graphs.run(("plus",), plus_one, again), (x - 5) * 2 + 1)
    assert torch.equal(graphs.run(("plus",), plus_one, torch.ones(4)), torch.full((4,), 2.0))  # (an eager input)
    assert graphs._captured[("plus",)] is piece and graphs.replays == 7


def test_transient_pieces_share_one_memory_pool_and_copy_each_others_outputs(monkeypatch):
    """Transient pieces are captured into one shared graph memory pool, the others each into their own; a
    transient piece copies another transient piece's output (its own intermediates may lie there) and reads a
    non-transient piece's in place; a non-transient piece reads either in place."""
    from moepack.runtime import device_decode

    monkeypatch.setattr(device_decode, "CapturedCall", _StaticBuffers)
    graphs = device_decode.StepGraphs(True, torch.device("cpu"))
    x = torch.arange(4.0)
    first = graphs.run(("first",), lambda t: t * 2, x, transient=True)
    second = graphs.run(("second",), lambda t: t + 1, first, transient=True)
    plain = graphs.run(("plain",), lambda a, b: a - b, first, second)
    last = graphs.run(("last",), lambda t: t * 3, plain, transient=True)
    assert torch.equal(last, (x * 2 - (x * 2 + 1)) * 3)
    pieces = graphs._captured
    pools = [pieces[(k,)].call.pool for k in ("first", "second", "plain", "last")]
    assert pools[0] is not None and pools[0] is pools[1] is pools[3] and pools[2] is None
    assert pieces[("second",)].copied == (0,) and pieces[("second",)].shared == ()  # a transient's: copied
    assert [i for i, _ in pieces[("plain",)].shared] == [0, 1]  # read in place
    assert [i for i, _ in pieces[("last",)].shared] == [0]  # a non-transient's: in place
    graphs.clear()
    assert graphs.run(("first",), lambda t: t * 2, x, transient=True) is not first
    assert graphs._captured[("first",)].call.pool is not pools[0]  # (a new pool with the new captures)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_a_piece_whose_capture_fails_runs_eagerly_on_the_callers_stream():
    """A piece that waits for the host cannot be captured: StepGraphs runs it eagerly from then on, its result
    right, the caller's stream current again, and a capturable piece after it is captured and replayed."""
    from moepack.runtime.device_decode import StepGraphs

    graphs = StepGraphs(True, torch.device("cuda"))
    stream = torch.cuda.Stream()
    x = torch.arange(6.0, device="cuda")
    with torch.cuda.stream(stream):
        waits = graphs.run(("waits",), lambda t: t * float(t.sum()), x)  # float(): a host sync
        assert torch.cuda.current_stream() == stream
        assert graphs._captured[("waits",)] is None and graphs.replays == 0
        torch.testing.assert_close(waits, x * 15.0)
        doubled = graphs.run(("doubles",), lambda t: t * 2, x)
        torch.testing.assert_close(doubled, x * 2)
        assert graphs._captured[("doubles",)] is not None and graphs.replays == 1
        torch.testing.assert_close(graphs.run(("doubles",), lambda t: t * 2, x + 1), (x + 1) * 2)
    torch.cuda.synchronize()


def test_the_gpu_decode_benchmark_runs_on_a_cpu(tmp_path):
    """benchmarks/gpu_decode.py's dry run: both paths at B = 1 and 2, every expert pooled (no sync), the bytes a
    token reads at B = 1 the resident weights plus top-k experts per layer, a bandwidth fraction against the copy
    rate it measured."""
    import json
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu_decode.py")
    done = subprocess.run([sys.executable, script, "--device", "cpu", "--preset", "tiny", "--batch", "1,2",
                           "--steps", "2", "--warmup", "1", "--tokens", "8", "--copy-gib", "0.01",
                           "--workdir", str(tmp_path), "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    shape, rows = report["shape"], report["rows"]
    assert report["hbm_gbps"] > 0 and report["goal_met"] is None  # a goal for the GPU only
    assert report["stored_gemv"] == {}  # the stored FP4 kernel's choices: none on a CPU (no kernel tried)
    assert [(r["path"], r["batch"]) for r in rows] == [("pool", 1), ("per-expert", 1), ("pool", 2), ("per-expert", 2),
                                                       ("stored pool", 1), ("stored pool", 2)]
    cached = shape["routed_cached_bytes"]  # every expert, decoded to bf16 and as the FP4 bytes stored
    assert set(cached) == {"decoded", "stored"} and 3 * cached["stored"] < cached["decoded"]
    expert_bytes = 3 * shape["hidden"] * shape["inter"] * 2  # bf16
    for r in rows:
        assert r["tokens_per_s"] > 0 and 0 < r["bandwidth_fraction"] < 1 and r["cache_misses"] == 0
        assert r["hit_rate"] == 1 and r["read_bytes_per_token"] == 0
        assert r["syncs"] == (None if r["path"] == "per-expert" else 0)
        assert 0 < r["experts_per_step"] <= r["batch"] * shape["layers"] * shape["top_k"]
        assert r["step_bytes"] == shape["resident_bytes"] + int(r["experts_per_step"] * expert_bytes)
        assert r["bytes_per_token"] == r["step_bytes"] // r["batch"]
    one = rows[0]
    assert one["experts_per_step"] <= shape["layers"] * shape["top_k"]


def test_at_a_quarter_of_the_decoded_size_the_stored_pool_holds_more_and_reads_less(tmp_path):
    """benchmarks/gpu_decode.py --cache-fraction 0.25 on a CPU (the tiny preset's FP4 experts, bf16): each pool
    gets a budget of a quarter of every expert decoded; the stored pool's slots (the FP4 bytes) hold several times
    as many experts, so its rows hit more often and read fewer bytes a token than the decoded pool's."""
    import json
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu_decode.py")
    done = subprocess.run([sys.executable, script, "--device", "cpu", "--preset", "tiny", "--batch", "1,2",
                           "--steps", "4", "--warmup", "1", "--tokens", "8", "--copy-gib", "0.01",
                           "--cache-fraction", "0.25", "--workdir", str(tmp_path), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    cached = report["shape"]["routed_cached_bytes"]
    assert report["goal_met"] is None and 3 * cached["decoded"] < 4 * cached["stored"] <= 4 * cached["decoded"]
    rows = {(r["path"], r["batch"]): r for r in report["rows"]}
    for batch in (1, 2):
        stored, decoded = rows[("stored pool", batch)], rows[("pool", batch)]
        assert stored["hit_rate"] > decoded["hit_rate"] + 0.3
        assert stored["read_bytes_per_token"] < decoded["read_bytes_per_token"] / 2


def test_the_device_check_runs_its_steps_in_the_order_steps_names(tmp_path):
    """benchmarks/device_check.sh runs the steps in STEPS's order (the first named gets the time first), each
    skipped in one line once under a minute of TOTAL_S is left, an unknown step named and failed. The device tool
    brings back 8 files of $OUT: past the 7th (steps.txt, versions.txt, then the steps' own in STEPS's order, then
    any other) they are packed in rest.tar.gz."""
    import os
    import subprocess
    import sys
    import tarfile

    root = os.path.join(os.path.dirname(__file__), "..")
    out = tmp_path / "out"
    out.mkdir()
    others = [f"other{i}.txt" for i in range(5)]
    for name in ["tests.txt", "gpu_decode.txt", *others]:  # (as if those steps had run)
        (out / name).write_text(name)
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               DEVICE="cpu", STEPS="gpu_decode tests gpu_prefill nosuch", TOTAL_S="1", OUT=str(out))
    done = subprocess.run(["bash", "benchmarks/device_check.sh"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0
    steps = (out / "steps.txt").read_text().splitlines()
    packed = others[3:]
    assert steps[1:] == ["== gpu_decode: skipped, under a minute of TOTAL_S left",
                         "== tests: skipped, under a minute of TOTAL_S left",
                         "== gpu_prefill: skipped, under a minute of TOTAL_S left",
                         "== nosuch: no such step",
                         f"== packed in rest.tar.gz (the device tool brings back 8 files): {' '.join(packed)}",
                         steps[-1]]
    assert steps[0].startswith("== install") and steps[-1].startswith("== done") and "FAILED: nosuch" in steps[-1]
    kept = ["steps.txt", "versions.txt", "gpu_decode.txt", "tests.txt", *others[:3], "rest.tar.gz"]
    assert sorted(os.listdir(out)) == sorted(kept)
    with tarfile.open(out / "rest.tar.gz") as rest:
        assert sorted(rest.getnames()) == packed
        assert [rest.extractfile(name).read().decode() for name in packed] == packed


@pytest.mark.parametrize("name, form", [("B", "decoded"), ("tiny-fp4", "stored")])
def test_a_pool_smaller_than_a_steps_experts_keeps_what_admission_takes_and_runs_every_layer_pooled(
        containers, generator, name, form):
    """Three rows over a pool of 40 % of the experts (a step's distinct experts more than its slots): the misses
    the cache's admission refuses run from the pool's scratch slots, never evicting a cached expert, so the cache
    keeps what it holds (its hits near the per-expert path's with the same admission; taking every miss, the pool
    evicted nearly one expert a miss and hit a third as often) and every layer still runs as one pooled call; the
    same greedy tokens as the per-expert path, logits to float32 rounding. Either pool form."""
    results, counts = {}, {}
    for pooled in (False, True):
        with generator(containers[name], cache_gib=0.0, decoded_experts=form == "decoded", expert_pool=pooled,
                       pool_form=form) as g:
            d = g.decoder
            d.cache.resize(int(0.4 * _routed_bytes(d)))
            results[pooled] = _greedy_rows(g, steps=4)
            cache, pool = d.cache, d.pool
            counts[pooled] = cache.hits
            if pooled:
                layers = sum(1 for b in d.blocks if b.experts)
                assert pool.calls == 4 * layers and 0 < pool.syncs <= 4 * layers  # none expert by expert
                assert cache.admitted > 0 and cache.evicted < cache.misses / 4
                assert pool.scratch_runs == cache.refused > 0 and pool._scratch
                assert d.stats_dict()["cache_bytes"] == cache.bytes == len(pool._slots) * pool.slot_bytes
                assert cache.bytes + cache.reserved <= cache.budget
                if form == "decoded":
                    _assert_table_consistent(d)
    assert counts[True] > 0.6 * counts[False]
    assert results[True][0] == results[False][0]
    for a, b in zip(results[True][1], results[False][1]):
        assert _relative(a, b) < 1e-5


def test_a_pools_stacks_grow_back_with_its_budget(containers, generator, monkeypatch):
    """A budget shrunk (for a long sequence's KV, say) and grown again: the stacks grow to it, every slot kept where
    it was (the table, the scratch and the cache's views follow); side by side on the device, else through the host
    (no room for old and new together), else at the old capacity without an error; the steps after it the same."""
    with generator(containers["A"], decoded_experts=True, expert_pool=True, cache_gib=0.0) as g:
        d = g.decoder
        cache, pool, every = d.cache, d.pool, _routed_bytes(d)
        cache.resize(int(0.4 * every))
        before = _greedy_rows(g, steps=3)
        cache.resize(int(0.2 * every))
        shrunk = pool.capacity
        allocations, scarce = [], []  # each new stacks' capacity; how many of the next allocations fail
        new_stacks = pool._new_stacks

        def allocate(capacity):
            allocations.append(capacity)
            if scarce and scarce.pop():
                raise torch.OutOfMemoryError("no room")
            return new_stacks(capacity)
        monkeypatch.setattr(pool, "_new_stacks", allocate)
        for fraction, fails, grown in ((0.6, [], True), (0.8, [True], True), (1.0, [True, True], False)):
            old, slots, scratch = pool.capacity, dict(pool._slots), list(pool._scratch)
            held = {key: pool.gate_up[slot].clone() for key, slot in slots.items()}
            scarce[:], allocations[:] = fails, []
            cache.resize(int(fraction * every))
            wanted = min(cache.budget // pool.slot_bytes, pool.routed_experts)
            assert pool.capacity == (wanted if grown else old) > shrunk
            assert allocations == [wanted] * (len(fails) + grown) + ([] if grown else [old])
            assert pool._slots == slots and pool._scratch == scratch
            assert all(torch.equal(pool.gate_up[slot], held[key]) for key, slot in slots.items())
            _assert_table_consistent(d)
        assert _greedy_rows(g, steps=3)[0] == before[0]
        assert len(cache) > shrunk  # the larger stacks used
        _assert_table_consistent(d)
        # no stacks at all, growing (not even the old ones again) or shrinking: the pool empties, its experts out
        # of the cache (read again as misses), the steps after it the same
        for fraction, fails in ((1.0, [True, True, True]), (0.3, [True])):
            cache.resize(int(0.6 * every))
            _greedy_rows(g, steps=1)
            assert pool.capacity and len(cache)
            scarce[:] = fails
            cache.resize(int(fraction * every))
            assert pool.capacity == 0 and not pool.stacks and len(cache) == 0 and cache.bytes == 0
            _assert_table_consistent(d)
            assert _greedy_rows(g, steps=3)[0] == before[0]
