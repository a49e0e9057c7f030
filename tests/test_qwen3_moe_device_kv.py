"""Qwen3-MoE's decode KV in the device arena (families/qwen3_moe/device_kv.py), run on a CPU along a CUDA device's
branches: every row's attention one fixed-shape piece over slots, equal to the per-row LayerKV attention (which the
CPU keeps) to float32 rounding, across a key bucket's growth; the state it hands on the same; a batch equal to each
sequence alone; slots given back and grown; a piece run twice (as a capture runs it) changes nothing; nothing in it
waits for the host; a state that is not a prefill's refused in one line naming its layer."""

from __future__ import annotations

import contextlib
import gc
import inspect

import pytest
import torch

from moepack.families.qwen3_moe import device_kv
from moepack.families.qwen3_moe.device_kv import ArenaKV
from moepack.families.qwen3_moe.model import LayerKV
from moepack.format_spec.errors import MoepackError
from moepack.packer.convert import convert_checkpoint
from gpu_branches import HostSyncs, without_native_code
from test_device_decode import _StaticBuffers, _all_experts, _relative, generator  # noqa: F401, F811
from test_device_kv import _greedy, _prefilled, arena_within_its_estimate
from test_qwen3_moe import CONFIGS, save_model

# two query heads per KV head; dense-MLP layers beside routed ones; a sliding window of 4
ARENA_CONFIGS = ("gqa", "sparse-step", "sliding")
PROMPTS = (5, 17, 30)  # 30: its bucket of 32 keys outgrown at its third step (64)
STEPS = 20


@pytest.fixture(scope="module")
def containers(tmp_path_factory):
    base = tmp_path_factory.mktemp("qwen3-device-kv")
    out = {}
    for name in ARENA_CONFIGS:
        save_model(base / name, CONFIGS[name], torch.float32)
        out[name] = str(base / f"{name}.moepack")
        convert_checkpoint(str(base / name), out[name], progress=False)
    return out


@contextlib.contextmanager
def states_kept(path: str):
    """Within: a CUDA device's branches on a CPU, the decoder's sequences in the arena ("arena"), or the CPU's
    per-row states ("per-row")."""
    with pytest.MonkeyPatch.context() as patch:
        without_native_code(patch.setattr)
        patch.setattr(device_kv, "on_cuda", lambda device: path == "arena")
        yield


def _steps(g, steps=STEPS, lengths=PROMPTS, follow: list | None = None):
    """Greedy steps of every prompt together (test_device_kv._greedy), or steps fed the greedy tokens of
    `follow`'s logits (another run's, step by step): (each step's logits [B, vocab], the sequences)."""
    if follow is None:
        return _greedy(g, steps, lengths)
    got, step_batch = [], g.decoder.step_batch
    with pytest.MonkeyPatch.context() as patch:  # each step's logits kept, `follow`'s handed to _greedy
        patch.setattr(g.decoder, "step_batch", lambda *args: got.append(step_batch(*args)) or follow[len(got) - 1])
        seqs = _greedy(g, steps, lengths)[1]
    return got, seqs


def _same_states(a: list[LayerKV], b: list[LayerKV], atol: float) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert type(x) is type(y) is LayerKV and x.length == y.length
        for name in ("keys", "values"):
            tx, ty = getattr(x, name), getattr(y, name)
            assert tx.shape == ty.shape and tx.dtype == ty.dtype and tx.is_contiguous(), name
            assert torch.allclose(tx, ty, atol=atol, rtol=0), name


@pytest.mark.parametrize("name", ARENA_CONFIGS)
def test_the_arena_steps_every_row_as_the_per_row_states_do(containers, generator, name):
    """Three prompts (5, 17, 30 tokens) stepped 20 times together, float32: through the arena and through the
    per-row states, each step's logits agree to float32 rounding and the greedy tokens are the same, across the
    key bucket's growth (32 -> 64); the states handed on after are the same (what a KV file stores)."""
    runs = {}
    for path in ("per-row", "arena"):
        with states_kept(path), generator(containers[name]) as g:
            logits, seqs = _steps(g)
            assert all(isinstance(kv, ArenaKV) == (path == "arena") for s in seqs for kv in s.kv)
            if path == "arena":
                arena = seqs[0].kv[0].arena
                assert device_kv.key_bucket(max(PROMPTS) + 1) == 32
                assert {key[3] for key in arena._keys.values()} == {64} and arena.capacity == 64
            runs[path] = logits, [s.states for s in seqs]
    (want, want_states), (got, got_states) = runs["per-row"], runs["arena"]
    assert len(got) == STEPS
    for a, b in zip(got, want):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        assert max(_relative(a[r], b[r]) for r in range(len(PROMPTS))) < 1e-5
    for a, b in zip(got_states, want_states):
        _same_states(a, b, atol=1e-5)
        assert a[0].length == b[0].length


def test_the_arena_in_bfloat16_steps_as_the_per_row_states_do(containers, generator):
    """bf16 compute: the arena's logits within bf16 rounding of the per-row states' (the same tokens fed)."""
    runs = {}
    for path in ("per-row", "arena"):
        with states_kept(path), generator(containers["gqa"], compute_dtype="bfloat16") as g:
            # the per-row run's tokens fed to both: a near tie may go either way in bf16
            runs[path], seqs = _steps(g, steps=8, follow=runs.get("per-row"))
            state = seqs[0].states[0]
            assert state.keys.dtype == state.values.dtype == torch.bfloat16
    for a, b in zip(runs["arena"], runs["per-row"]):
        assert max(_relative(a[r], b[r]) for r in range(len(PROMPTS))) < 2e-2


def test_a_batch_in_the_arena_equals_each_sequence_alone(containers, generator):
    """Three prompts stepped together, then each alone (in other slots of the same arena, the batch's still
    held): each row's logits to float32 rounding and greedy tokens, and its states, those of its sequence alone."""
    with states_kept("arena"), generator(containers["gqa"]) as g:
        together, seqs = _steps(g, steps=12)
        for row, n in enumerate(PROMPTS):
            alone, (seq,) = _steps(g, steps=12, lengths=(n,))
            for batch, solo in zip(together, alone):
                assert _relative(batch[row], solo[0]) < 1e-5 and int(batch[row].argmax()) == int(solo[0].argmax())
            _same_states(seqs[row].states, seq.states, atol=1e-5)


def test_slots_are_given_back_and_the_arena_grows_under_its_sequences(containers, generator):
    """A dropped sequence's slot is the next one's (the keys its former sequence left there masked and zeroed);
    more sequences than slots double them, and a long prompt every layer's capacity, the sequences already there
    going on as if nothing moved (their keys copied); a move makes the graphs stale (the generation)."""
    with states_kept("arena"), generator(containers["gqa"]) as g:
        d = g.decoder
        prefilled = _prefilled(g, lengths=(5, 17))
        first = [d.start(states) for states, _ in prefilled]
        arena = first[0].kv[0].arena
        assert arena.slots == 2 and {s.kv[0].slot.index for s in first} == {0, 1} and arena.capacity == 32
        generation = arena.generation
        twin = d.start(prefilled[1][0])  # a third: the slots double
        assert arena.slots == 4 and arena.generation > generation
        gone = twin.kv[0].slot.index
        del twin
        gc.collect()
        again = d.start(prefilled[0][0])  # 5 tokens where the twin's 17 were
        assert again.kv[0].slot.index == gone and arena.slots == 4
        assert not arena.keys[0][gone, 5:].any() and not arena.values[-1][gone, 5:].any()
        del again
        gc.collect()
        generation = arena.generation
        (long_states, long_first), = _prefilled(g, lengths=(100,))
        longer = d.start(long_states)  # every layer's capacity doubled past the 101 positions
        assert arena.capacity == 128 and arena.generation > generation
        assert all(t.shape == (4, 128, 2, 32) for t in arena.keys + arena.values)
        tokens = [f for _, f in prefilled] + [long_first]
        rows = first + [longer]
        for _ in range(6):
            tokens = d.step_batch(rows, tokens).argmax(-1).tolist()
        after = [s.states for s in rows]
    with states_kept("per-row"), generator(containers["gqa"]) as g:  # the same sequences through per-row states
        for a, s in zip(after, _steps(g, steps=6, lengths=(5, 17, 100))[1]):
            _same_states(a, s.states, atol=1e-5)


def test_the_arena_pieces_as_cuda_graphs_replay_them_equal_eager_and_never_wait(containers, generator, monkeypatch):
    """Each layer's attention over the arena as a CUDA graph keeps it (device_decode.CapturedCall on a CPU: the
    piece run twice at its capture, static inputs and outputs): the same logits to the bit as eager, one piece per
    layer whatever the rows, none waiting for the host, and a new bucket retiring its layer's last graph."""
    from moepack.runtime import device_decode

    captured = []  # (the piece's function, the host syncs its capture met)

    def checked_capture(fn, inputs, pool=None):
        with HostSyncs() as mode:
            call = _StaticBuffers(fn, inputs, pool)
        piece = inspect.unwrap(fn)  # (StepGraphs binds the inputs it reads in place around the piece)
        captured.append((getattr(piece, "func", piece), mode.seen))
        return call

    def decoded(graphs: bool) -> tuple[list, list[tuple], int, int]:
        """12 greedy steps of the prompts with every expert pooled: (their logits, the graph keys held after, the
        replays, the layers)."""
        with states_kept("arena"), generator(containers["sparse-step"], decoded_experts=True,
                                             expert_pool=True) as g:
            g.decoder.seed(_all_experts(g.decoder))
            step_graphs = g.decoder.pool.graphs
            step_graphs.enabled = graphs
            logits = _steps(g, steps=12)[0]
            return logits, list(step_graphs._captured), step_graphs.replays, len(g.decoder.blocks)

    eager, *_ = decoded(False)
    monkeypatch.setattr(device_decode, "CapturedCall", checked_capture)
    replayed, held, replays, layers = decoded(True)
    keys = [k for k in held if k[0] == "arena attention"]
    # one live graph per layer (rows 3), at the latest bucket (64: 30 + 12 tokens), the one of 32 retired
    assert sorted(k[1] for k in keys) == list(range(layers)) and {k[3] for k in keys} == {64}
    assert len([fn for fn, _ in captured if fn.__name__ == "_attention"]) == 2 * layers
    assert replays == 2 * 12 * layers + 12  # each layer's attention, its FFN (routed over the pool, or dense); the head
    assert captured and all(seen == [] for _, seen in captured)
    for a, b in zip(replayed, eager):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_arena_holds_at_most_its_estimate_from_the_config(containers, generator, dtype):
    """What the arena's tensors hold, stepping sequences that join at different times (the slots doubling, every
    layer's capacity growing in a step and at a long prompt), is at most device_kv.arena_bytes for their lengths,
    and that estimate at most 2 x (1 + 1 / layers) of what the arena held at its fullest (a longest sequence's
    bucket may be twice its keys', one layer's tensors beside them for a growth's copy); an arena larger than a
    short sequence needs may still take one layer's copy (the decoder's device_kv_growth)."""
    with states_kept("arena"), generator(containers["sparse-step"], compute_dtype=dtype) as g:
        fullest, estimate, _sequences = arena_within_its_estimate(g, device_kv)
        layers = len(g.decoder.blocks)
        assert estimate <= 2 * (1 + 1 / layers) * fullest
        arena = g.decoder.arithmetic._arena
        assert g.decoder.arithmetic.device_kv_growth([1], torch.device("cuda", 0)) == arena.allocated_bytes() // layers
        assert arena.allocated_bytes() == sum(t.nbytes for t in arena.keys + arena.values)


def test_a_gpu_generation_whose_arena_would_not_fit_is_refused_though_its_kv_would(containers, generator,
                                                                                     monkeypatch):
    """On a GPU a generation beside sequences decoding is checked for what the decode's arena may still take for
    all of them (their slots doubled, each slot as long as the longest one's bucket), besides their prefills'
    states: where the device has room for the states but not the arena, it is refused in one line before any work,
    naming the arena; where it has room for both, not; the default cache's budget leaves the arena its room."""
    from moepack.runtime import memory as memory_module

    with states_kept("arena"), generator(containers["gqa"], cache_gib=None) as g:
        (states, _), = _prefilled(g, lengths=(5,))
        decoding = g.decoder.start(states)  # one sequence decoding: the arena there, one slot of 16 positions
        arena, dtype = g.decoder.arithmetic._arena, g.decoder.arithmetic.dtype
        g.device = torch.device("cuda", 0)
        n, others = 3000, [decoding.kv[0].seen_tokens + 8] * 6  # with the six beside it: eight slots of 4096
        lengths = [n, *others]
        kv = memory_module.device_kv(g.c, g.device, n, others, g.decoder.arithmetic)
        assert kv.states == sum(memory_module.container_kv_bytes(g.c, m) for m in lengths)
        assert kv.arena == device_kv.arena_bytes(g.cfg, lengths, dtype, arena) - arena.allocated_bytes() > kv.states
        g.decoder.cache.bytes = held = 1000  # (what the cache holds of the device already)
        plain = kv.states + memory_module.HEADROOM_BYTES  # what the device needed, its arena not counted
        monkeypatch.setattr(memory_module, "cuda_free_bytes", lambda device: plain + kv.arena + 5000)
        g._check_memory(n, others)  # the default budget: what is left beside the KV and the arena
        assert g.cache_bytes == held + 5000
        g.default_budget, g.cache_bytes = None, held + 5000  # a fixed budget from here: its rest to fill
        monkeypatch.setattr(memory_module, "cuda_free_bytes", lambda device: plain + kv.arena + 4999)
        with pytest.raises(MoepackError, match="decode KV arena .*lower --cache-gib or --max-new-tokens") as e:
            g._check_memory(n, others)
        assert "\n" not in str(e.value)
        monkeypatch.setattr(memory_module, "cuda_free_bytes", lambda device: plain + kv.arena * 2 // 3)
        with pytest.raises(MoepackError, match="decode KV arena"):  # room for the states and more, not the arena
            g._check_memory(n, others)


def test_a_generators_next_sequence_takes_the_last_ones_slot(containers, generator):
    """Decoder.begin drops the sequence before (its slot given back) before the next takes one: one generation at
    a time holds one slot, as the memory checks count."""
    with states_kept("arena"), generator(containers["gqa"]) as g:
        for states, _ in _prefilled(g, lengths=(5, 17, 9)):
            g.decoder.begin(states)
        assert g.decoder.arithmetic._arena.slots == 1


@pytest.mark.parametrize("damage", ["values", "heads", "missing"])
def test_a_state_that_is_not_a_prefills_is_refused_in_one_line(containers, generator, damage):
    with states_kept("arena"), generator(containers["gqa"]) as g:
        (states, _), = _prefilled(g, lengths=(17,))
        layer = 1
        s = states[layer]
        if damage == "values":
            s.values = s.values[:, :-1]
        elif damage == "heads":
            s.keys, s.values = s.keys[:1], s.values[:1]
        else:
            s.values = None
        with pytest.raises(MoepackError, match=f"^layer {layer}: ") as info:
            g.decoder.start(states)
        assert "\n" not in str(info.value)
        assert g.decoder.arithmetic._arena._free == [0]  # refused before it took a slot


def test_key_buckets_are_powers_of_two_from_the_least():
    assert [device_kv.key_bucket(n) for n in (0, 1, 16, 17, 32, 33, 1000)] == [16, 16, 16, 32, 32, 64, 1024]
