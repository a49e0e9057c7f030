"""DeepSeek-V4's decode KV in the device arena (families/deepseek_v4/device_kv.py), run on a CPU along a CUDA
device's branches: every row's attention one fixed-shape piece over slots, equal to the per-row states' attention
(model.TokenKV, which the CPU keeps) to float32 rounding, across window closes, the indexer's threshold and entry
buckets; the state it hands on the same; slots given back and grown; a piece run twice (as a capture runs it)
changes nothing; nothing in it waits for the host; a state that is not a prefill's refused in one line."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from moepack.families.deepseek_v4 import device_kv, model
from moepack.families.deepseek_v4.decode import DeepseekV4Decode
from moepack.families.deepseek_v4.device_kv import ArenaKV
from moepack.format_spec.errors import MoepackError
from moepack.packer.convert import convert_checkpoint
from gpu_branches import HostSyncs, without_native_code
from test_device_decode import _StaticBuffers, _all_experts, _relative, generator  # noqa: F401
from v4_models import CONFIGS, saved_model

# A and B with 16 index heads: no exact zero-score ties at the indexer's k-th (with 4, a tie is broken by the
# top-k's length, which the arena's bucket changes); CSA rate 4 / 3, index_topk 6 / 5, windows 16 / 8
ARENA_CONFIGS = {"A16": dict(CONFIGS["A"], index_n_heads=16), "B16": dict(CONFIGS["B"], index_n_heads=16)}
PROMPTS = (5, 17, 70)  # 70: more CSA entries than the first bucket (16) holds
STEPS = 20


@pytest.fixture(scope="module")
def containers(tmp_path_factory):
    base = tmp_path_factory.mktemp("device-kv")
    out = {}
    for i, (name, config) in enumerate(ARENA_CONFIGS.items()):
        saved_model(config, 300 + i, str(base / name))
        out[name] = str(base / f"{name}.moepack")
        convert_checkpoint(str(base / name), out[name], progress=False)
    return out


@pytest.fixture
def device_branches(monkeypatch):
    """A CUDA device's branches on a CPU (model.on_cuda, no native code)."""
    without_native_code(monkeypatch.setattr)
    monkeypatch.setattr(model, "on_cuda", lambda device: True)


@contextlib.contextmanager
def states_kept(path: str):
    """Within: the decoder's sequences in the arena ("arena"), or in per-row states ("per-row") as before it."""
    with pytest.MonkeyPatch.context() as patch:
        if path == "per-row":
            patch.setattr(DeepseekV4Decode, "token_states", None)
        yield


@pytest.fixture
def no_ties(monkeypatch):
    """Fails a test whose indexer met an exact tie at its k-th score (the two paths may then pick apart)."""
    scores = model.indexer_scores
    seen = []

    def checked(cfg, *args, **kwargs):
        out = scores(cfg, *args, **kwargs)
        top = out.topk(min(cfg.index_topk + 1, out.shape[-1]), dim=-1).values
        if top.shape[-1] > cfg.index_topk:
            assert not bool(((top[:, -1] == top[:, -2]) & (top[:, -1] > float("-inf"))).any()), "a tie"
        seen.append(args[4].dim())  # index_keys: [B, T, d] in the arena
        return out
    monkeypatch.setattr(model, "indexer_scores", checked)
    return seen


def _prefilled(g, lengths=PROMPTS):
    out = []
    for n in lengths:
        ids = torch.randint(3, g.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        logits, states, *_ = g._prefill(ids, None, 8)
        out.append((states, int(logits.argmax())))
    return out


def _greedy(g, steps=STEPS, lengths=PROMPTS):
    """Greedy steps of every prompt together: (each step's logits [B, vocab], the sequences)."""
    d = g.decoder
    prefilled = _prefilled(g, lengths)
    seqs = [d.start(states) for states, _ in prefilled]
    tokens = [first for _, first in prefilled]
    out = []
    for _ in range(steps):
        logits = d.step_batch(seqs, tokens)
        out.append(logits)
        tokens = logits.argmax(-1).tolist()
    return out, seqs


def _same_states(a: list, b: list, atol: float) -> None:
    for x, y in zip(a, b):
        assert x.seen_tokens == y.seen_tokens and x.layer_type == y.layer_type
        tx, ty = x.tensors(), y.tensors()
        assert tx.keys() == ty.keys()
        for name in tx:
            assert tx[name].shape == ty[name].shape, name
            assert torch.allclose(tx[name], ty[name], atol=atol, rtol=0), name
        for part in ("compressor", "indexer"):
            if getattr(x, part) is not None:
                assert getattr(x, part).entry_count == getattr(y, part).entry_count


@pytest.mark.parametrize("name", list(ARENA_CONFIGS))
def test_the_arena_steps_every_row_as_the_per_row_states_do(containers, generator, device_branches, no_ties, name):
    """Three prompts (5, 17, 70 tokens) stepped 20 times together, float32: through the arena and through the
    per-row states, each step's logits agree to float32 rounding and the greedy tokens are the same, across the
    windows that close, the indexer's threshold (it runs in the arena over the bucket) and a bucket's growth; the
    states handed on after are the same."""
    runs = {}
    for path in ("per-row", "arena"):
        with states_kept(path), generator(containers[name]) as g:
            logits, seqs = _greedy(g)
            assert all(isinstance(kv, ArenaKV) == (path == "arena") for s in seqs for kv in s.kv)
            runs[path] = logits, [s.states for s in seqs]
    (want, want_states), (got, got_states) = runs["per-row"], runs["arena"]
    for a, b in zip(got, want):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        assert max(_relative(a[r], b[r]) for r in range(len(PROMPTS))) < 1e-5
    for a, b in zip(got_states, want_states):
        _same_states(a, b, atol=1e-5)
    assert 3 in no_ties  # the indexer ran in the arena (over each row's own entries)


def test_the_arena_in_bfloat16_steps_as_the_per_row_states_do(containers, generator, device_branches):
    """bf16 products on the device path (the indexer's too): the arena's logits within bf16 rounding of the
    per-row states'."""
    runs = {}
    for path in ("per-row", "arena"):
        with states_kept(path), generator(containers["A16"], compute_dtype="bfloat16") as g:
            d = g.decoder
            prefilled = _prefilled(g)
            seqs = [d.start(states) for states, _ in prefilled]
            tokens = [first for _, first in prefilled]
            out = []
            for step in range(8):  # the per-row run's tokens fed to both: a near tie may go either way in bf16
                out.append(d.step_batch(seqs, tokens))
                tokens = runs["per-row"][step].argmax(-1).tolist() if "per-row" in runs else \
                    out[-1].argmax(-1).tolist()
            runs[path] = out
    for a, b in zip(runs["arena"], runs["per-row"]):
        assert max(_relative(a[r], b[r]) for r in range(len(PROMPTS))) < 2e-2


def test_a_batch_in_the_arena_equals_each_sequence_alone(containers, generator, device_branches, no_ties):
    with generator(containers["B16"]) as g:
        d = g.decoder
        prefilled = _prefilled(g)
        together = [d.start(states) for states, _ in prefilled]
        alone = [d.start(states) for states, _ in prefilled]
        tokens = [first for _, first in prefilled]
        for _ in range(12):
            batch = d.step_batch(together, tokens)
            for b, seq in enumerate(alone):
                solo = d.step_batch([seq], [tokens[b]])[0]
                assert _relative(batch[b], solo) < 1e-5 and int(batch[b].argmax()) == int(solo.argmax())
            tokens = batch.argmax(-1).tolist()
        for a, b in zip(together, alone):
            _same_states(a.states, b.states, atol=1e-5)


def test_slots_are_given_back_and_the_arena_grows_under_its_sequences(containers, generator, device_branches):
    """A dropped sequence's slot is the next one's; more sequences than slots double them, and a long prompt a
    layer's entries, the sequences already there going on as if nothing moved (their states copied); a moved
    layer's graphs are stale (its generation)."""
    with generator(containers["A16"]) as g:
        d = g.decoder
        prefilled = _prefilled(g, lengths=(5, 17))
        first = [d.start(states) for states, _ in prefilled]
        arena = first[0].kv[0].arena
        assert arena.slots == 2 and {s.kv[0].slot.index for s in first} == {0, 1}
        twin = d.start(prefilled[0][0])  # a third: the slots double
        assert arena.slots == 4
        generations = [L.generation for L in arena.layers]
        gone = twin.kv[0].slot.index
        del twin
        gc.collect()
        again = d.start(prefilled[0][0])
        assert again.kv[0].slot.index == gone and arena.slots == 4
        # a long prompt: its CSA layers' entries grow past the first capacity
        (long_states, long_first), = _prefilled(g, lengths=(300,))
        longer = d.start(long_states)
        assert [L.generation for L in arena.layers] != generations
        csa = [layer for layer, L in enumerate(arena.layers) if L.kind == model.CSA]
        assert len(arena.layers[csa[0]].compressors["compressor"].entries.owned[longer.kv[0].slot.index]) \
            * device_kv.ENTRY_PAGE >= 300 // 4 + 1
        tokens = [f for _, f in prefilled] + [long_first]
        rows = first + [longer]
        for _ in range(6):
            tokens = d.step_batch(rows, tokens).argmax(-1).tolist()
        # the first two went on as alone through the per-row states
        after = [s.states for s in first]
    with states_kept("per-row"), generator(containers["A16"]) as g:
        d = g.decoder
        prefilled = _prefilled(g, lengths=(5, 17))
        seqs = [d.start(states) for states, _ in prefilled]
        tokens = [f for _, f in prefilled]
        for _ in range(6):
            tokens = d.step_batch(seqs, tokens).argmax(-1).tolist()
        for a, s in zip(after, seqs):
            _same_states(a, s.states, atol=1e-5)


def test_the_arena_pieces_as_cuda_graphs_replay_them_equal_eager_and_never_wait(containers, generator,
                                                                                  device_branches, monkeypatch):
    """Each layer's attention over the arena as a CUDA graph keeps it (device_decode.CapturedCall on a CPU: the
    piece run twice at its capture, static inputs and outputs): the same logits to the bit as eager, one piece per
    layer whatever the rows, none waiting for the host, and a new bucket retiring its layer's last graph."""
    from moepack.runtime import device_decode

    captured = []

    class Checked(_StaticBuffers):
        def __init__(self, fn, inputs, pool=None):
            with HostSyncs() as mode:
                super().__init__(fn, inputs)
            captured.append(mode.seen)
    results = {}
    for graphs in (False, True):
        with generator(containers["A16"], decoded_experts=True, expert_pool=True) as g:
            d = g.decoder
            d.seed(_all_experts(d))
            if graphs:
                monkeypatch.setattr(device_decode, "CapturedCall", Checked)
                d.pool.graphs.enabled = True
            results[graphs] = _greedy(g, steps=12)[0]
            if graphs:
                keys = [k for k in d.pool.graphs._captured if k[0] == "arena attention"]
                # one live graph per layer (rows 3), each layer's latest bucket
                assert sorted(k[1] for k in keys) == list(range(len(d.blocks)))
                assert d.pool.graphs.replays == 2 * 12 * len(d.blocks) + 12  # (+ the head's)
    assert captured and all(seen == [] for seen in captured)
    for a, b in zip(results[True], results[False]):
        assert torch.equal(a, b)


# prompt lengths joining the arena one after the other, each followed by this many steps of all so far: the slots
# double twice (1 -> 2 -> 4, three sequences in four), a sequence's CSA entries go past a page (60 tokens: 16
# entries, then 17), a long prompt grows every compressor's pool
JOINS = ((5, 2), (60, 6), (17, 3), (300, 4))


def arena_within_its_estimate(g, kv_module, joins=JOINS) -> tuple[int, int, list]:
    """Sequences joining the decoder's arena as `joins` says, stepped greedily together: after each admission and
    step, what the arena holds, and what it held while a growth copied a tensor (its tensors then, the new one
    beside them), is at most the family's arena_bytes, from the config, for the sequences' lengths then (prompt +
    tokens generated). Returns (the most the arena held after an admission or step, the estimate at the end, the
    sequences: the arena is there while they are)."""
    d, seqs, tokens, lengths, held = g.decoder, [], [], [], []
    grown, growing = kv_module.grown, []

    def watched(t, dim, size, fill=0.0):  # (the arena's tensors, the old one among them, and the new one)
        out = grown(t, dim, size, fill)
        growing.append(d.arithmetic._arena.allocated_bytes() + out.nbytes)
        return out

    def within() -> int:
        estimate = kv_module.arena_bytes(d.arithmetic.config, lengths, d.arithmetic.dtype)
        held.append(d.arithmetic._arena.allocated_bytes())
        assert max([held[-1], *growing]) <= estimate, (lengths, held[-1], growing, estimate)
        growing.clear()
        return estimate
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kv_module, "grown", watched)
        for prompt, steps in joins:
            (states, first), = _prefilled(g, lengths=(prompt,))
            seqs.append(d.start(states))
            tokens.append(first)
            lengths.append(prompt + 1)  # (its first token, the prefill's)
            within()
            for _ in range(steps):
                tokens = d.step_batch(seqs, tokens).argmax(-1).tolist()
                lengths = [n + 1 for n in lengths]
                estimate = within()
    assert d.arithmetic._arena.slots == 4 and len(seqs) == 4
    return max(held), estimate, seqs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_arena_holds_at_most_its_estimate_from_the_config(containers, generator, device_branches, dtype):
    """What the arena's tensors hold, stepping sequences that join at different times (the slots doubling, the
    entries growing past a page and the pools past theirs), is at most device_kv.arena_bytes for their lengths,
    and that estimate at most 2 x (1 + 1 / layers) of what the arena held at its fullest (a pool and a table at
    most twice what is in use, one layer's tensors beside them for a growth's copy); an arena larger than a short
    sequence needs may still take one layer's copy (the decoder's device_kv_growth)."""
    with generator(containers["A16"], compute_dtype=dtype) as g:
        fullest, estimate, _sequences = arena_within_its_estimate(g, device_kv)
        assert estimate <= 2 * (1 + 1 / len(g.decoder.blocks)) * fullest
        arena = g.decoder.arithmetic._arena
        layers = [sum(t.nbytes for part in (L.window, *L.compressors.values()) for t in part.tensors())
                  for L in arena.layers]
        assert g.decoder.arithmetic.device_kv_growth([1], torch.device("cuda", 0)) == max(layers)
        assert sum(layers) == arena.allocated_bytes()


@pytest.mark.parametrize("damage", ["entries", "buffer", "window"])
def test_a_state_that_is_not_a_prefills_is_refused_in_one_line(containers, generator, device_branches, damage):
    with generator(containers["A16"]) as g:
        (states, _), = _prefilled(g, lengths=(17,))
        layer = next(i for i, s in enumerate(states) if s.compressor is not None)
        s = states[layer]
        if damage == "entries":
            s.compressor.entry_count += 1
        elif damage == "buffer":
            s.compressor.buffer_kv = s.compressor.buffer_kv[:-1]
        else:
            s.window_kv = s.window_kv[1:]
        with pytest.raises(MoepackError, match=f"^layer {layer}: ") as info:
            g.decoder.start(states)
        assert "\n" not in str(info.value)


def test_entry_buckets_are_powers_of_two_from_the_least():
    assert [device_kv.entry_bucket(n) for n in (0, 1, 16, 17, 32, 33, 1000)] == [16, 16, 16, 32, 32, 64, 1024]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_the_arena_as_graphs_steps_as_the_per_row_states_do(containers, generator):
    """On a CUDA device, every expert pooled, bf16: each layer's attention over the arena captured as a CUDA graph
    (and replayed), the logits within bf16 rounding of the per-row states' (eager, row by row), fed the same tokens;
    the states handed on after the same."""
    runs, fed = {}, []
    for path in ("per-row", "arena"):
        with states_kept(path), generator(containers["A16"], compute_dtype="bfloat16", device="cuda",
                                          decoded_experts=True, expert_pool=True) as g:
            d = g.decoder
            d.seed(_all_experts(d))
            prefilled = _prefilled(g)
            seqs = [d.start(states) for states, _ in prefilled]
            assert all(isinstance(kv, ArenaKV) == (path == "arena") for s in seqs for kv in s.kv)
            tokens, out = [first for _, first in prefilled], []
            for step in range(12):
                out.append(d.step_batch(seqs, tokens))
                if path == "per-row":
                    fed.append(out[-1].argmax(-1).tolist())
                tokens = fed[step]
            if path == "arena":
                pieces = {k: v for k, v in d.pool.graphs._captured.items() if k[0] == "arena attention"}
                assert len(pieces) == len(d.blocks) and all(v is not None for v in pieces.values())
            runs[path] = out, [[t.to("cpu") for t in s.states] for s in seqs]
    for a, b in zip(runs["arena"][0], runs["per-row"][0]):
        assert max(_relative(a[r], b[r]) for r in range(len(PROMPTS))) < 2e-2
    for a, b in zip(runs["arena"][1], runs["per-row"][1]):
        _same_states(a, b, atol=5e-2)
