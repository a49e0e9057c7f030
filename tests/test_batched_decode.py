"""Batched decode on a CPU: Decoder.step_batch runs B sequences' tokens through TokenLayers' batched calls (every
weight read once per step, each chosen expert once for the rows that chose it), and each row's logits are, to the
bit, those of its sequence stepped alone through Decoder.step."""

from __future__ import annotations

import copy

import pytest
import torch

from moepack.backends import token_kernels
from moepack.backends.token_kernels import ROUND_INPUT, ROUND_OUTPUT, float_matrix, stored_matrix
from moepack.families.deepseek_v4 import model
from moepack.families.deepseek_v4.config import RopeConfig
from moepack.families.deepseek_v4.kv import CompressorState
from moepack.packer.convert import convert_checkpoint
from moepack.packer.synth import synth_checkpoint
from moepack.runtime.engine import PrefillOptions
from moepack.runtime.generate import Generator

STEPS = 8


@pytest.fixture(scope="module")
def containers(tmp_path_factory):
    """layout -> the tiny synthetic model (SLIDING, CSA, HCA layers; two hash layers) converted --keep: FP8 dense
    and FP4 experts (release), or bfloat16 everywhere."""
    base = tmp_path_factory.mktemp("batched")
    out = {}
    for layout in ("release", "bf16"):
        src = str(base / f"{layout}-src")
        synth_checkpoint(src, preset="tiny", layout=layout, seed=4, progress=False)
        out[layout] = str(base / f"{layout}.moepack")
        convert_checkpoint(src, out[layout], policy="keep", progress=False)
    return out


def _prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def _prefilled(g: Generator, prompts: list[torch.Tensor]) -> list[tuple[torch.Tensor, list]]:
    """Each prompt's (last logits, KV states) through the generator's prefill."""
    return [g._prefill(ids, None, STEPS)[:2] for ids in prompts]


def _alone(g: Generator, logits: torch.Tensor, states: list, steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """The sequence after `states` stepped alone (Decoder.begin / step), greedy: each step's logits and tokens."""
    g.decoder.begin(copy.deepcopy(states))
    token, out, tokens = int(logits.argmax()), [], []
    for _ in range(steps):
        tokens.append(token)
        out.append(g.decoder.step(token))
        token = int(out[-1].argmax())
    return out, tokens


@pytest.mark.parametrize("layout", ["release", "bf16"])
@pytest.mark.parametrize("cache_gib", [0.0, 1.0], ids=["no-cache", "cache"])
@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_each_row_of_a_batch_is_its_sequence_stepped_alone(containers, layout, cache_gib, compute_dtype):
    """Four sequences of different prompt lengths (the CSA layer's indexer picking for some, not others) stepped
    together for 8 greedy steps: every row's logits torch.equal to the sequence's own steps; in float32 and in
    bfloat16 (the keys' rounded copies, the low-precision matmuls)."""
    with Generator(containers[layout], cache_gib=cache_gib, prefill=PrefillOptions(compute_dtype=compute_dtype)) as g:
        d = g.decoder
        assert d.layers is not None
        assert d.layers.layers[0].low == (compute_dtype == "bfloat16")
        prompts = [_prompt(n, seed) for n, seed in ((5, 1), (23, 2), (40, 3), (12, 4))]
        prefilled = _prefilled(g, prompts)
        alone = [_alone(g, logits, states, STEPS) for logits, states in prefilled]
        sequences = [d.start(copy.deepcopy(states)) for _, states in prefilled]
        tokens = [int(logits.argmax()) for logits, _ in prefilled]
        steps_before, tokens_before = d.stats.steps, d.stats.tokens
        for step in range(STEPS):
            assert tokens == [a[1][step] for a in alone]  # the greedy tokens are the same
            logits = d.step_batch(sequences, tokens)
            assert logits.shape == (4, 512) and logits.dtype == torch.float32
            for row, (want, _) in enumerate(alone):
                assert torch.equal(logits[row], want[step]), (layout, step, row)
            tokens = logits.argmax(-1).tolist()
        assert (d.stats.steps - steps_before, d.stats.tokens - tokens_before) == (STEPS, 4 * STEPS)
        assert [s.seen_tokens for s in sequences] == [len(p) + STEPS for p in prompts]


def test_a_sequence_joins_a_running_batch(containers):
    """A sequence started after the others have run three steps (its seen_tokens differ from theirs) and one of
    eight rows, and one alone through step_batch (B = 1): each row still its own sequence's logits."""
    with Generator(containers["release"], cache_gib=1.0) as g:
        d = g.decoder
        prompts = [_prompt(6 + 5 * i, 10 + i) for i in range(8)]
        prefilled = _prefilled(g, prompts)
        alone = [_alone(g, logits, states, STEPS) for logits, states in prefilled]
        sequences = [d.start(copy.deepcopy(states)) for _, states in prefilled]
        for step in range(STEPS):
            rows = [0, 1] if step < 3 else list(range(8)) if step < 6 else [5]  # six join at 3; one left at 6
            positions = [step - (0 if b < 2 else 3) for b in rows]
            logits = d.step_batch([sequences[b] for b in rows], [alone[b][1][p] for b, p in zip(rows, positions)])
            for i, (b, p) in enumerate(zip(rows, positions)):
                assert torch.equal(logits[i], alone[b][0][p]), (step, b)


def test_rows_closing_their_windows_together_are_each_their_sequence_alone(containers, monkeypatch):
    """Four prompts of one length (every row closes its CSA and HCA windows, attention's and indexer's, at the same
    step: their entries made in one pass, model.close_windows): each row's logits still those of its sequence
    stepped alone, in float32 and bfloat16."""
    closed_together = []
    close_windows = model.close_windows

    def spy(full, *args):
        closed_together.append(len(full))
        return close_windows(full, *args)

    monkeypatch.setattr(model, "close_windows", spy)
    for compute_dtype in ("float32", "bfloat16"):
        with Generator(containers["release"], cache_gib=1.0, prefill=PrefillOptions(compute_dtype=compute_dtype)) as g:
            d = g.decoder
            prefilled = _prefilled(g, [_prompt(8, 30 + i) for i in range(4)])
            alone = [_alone(g, logits, states, STEPS) for logits, states in prefilled]
            closed_together.clear()
            sequences = [d.start(copy.deepcopy(states)) for _, states in prefilled]
            for step in range(STEPS):
                logits = d.step_batch(sequences, [a[1][step] for a in alone])
                for row, (want, _) in enumerate(alone):
                    assert torch.equal(logits[row], want[step]), (compute_dtype, step, row)
            # positions 8 to 15: CSA's two compressors close twice (rate 4), HCA's once (rate 8)
            assert closed_together.count(4) == 5


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("overlapping", [False, True], ids=["HCA", "CSA"])
def test_windows_closed_together_are_each_closed_alone(overlapping, threads):
    """close_windows on five compressors (entries so far 0 to 4: with and without the CSA overlap; widths and rope
    dims that fill torch's vectors or not; a bfloat16 mirror): each entry, mirror, overlap and count equal to the
    bit to the compressor's own close, on one torch thread (together) and on two (each alone)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _close_windows_together_and_alone(overlapping)
    finally:
        torch.set_num_threads(before)


def _close_windows_together_and_alone(overlapping: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    for d, rate, rope_dim, low in ((32, 4, 16, torch.float32), (40, 3, 14, torch.bfloat16), (8, 4, 8, torch.float32)):
        width = 2 * d if overlapping else d
        rope = RopeConfig(rope_dim, 10000.0)
        ape, norm = torch.randn(rate, width, generator=gen), torch.rand(d, generator=gen) + 0.5
        together = []
        for entries in range(5):
            overlap = [torch.randn(rate, d, generator=gen) for _ in range(2)] if overlapping and entries else [None] * 2
            state = CompressorState(torch.randn(entries, d, generator=gen), torch.randn(rate - 1, width, generator=gen),
                                    torch.randn(rate - 1, width, generator=gen), entries, *overlap)
            together.append(model.TokenCompressor(state, rate, low))
        alone = copy.deepcopy(together)
        for t, a in zip(together, alone):
            kv, gate = torch.randn(1, width, generator=gen), torch.randn(1, width, generator=gen) * 3
            assert t.buffer(kv, gate) and a.buffer(kv, gate)  # the window full
            a.close(ape, norm, overlapping, rope, 1e-6)
        model.close_windows(together, ape, norm, overlapping, rope, 1e-6)
        for t, a in zip(together, alone):
            assert torch.equal(t.entries.rows(), a.entries.rows()) and torch.equal(t.entries.mirror(), a.entries.mirror())
            assert (t.entry_count, t.buffered) == (a.entry_count, 0)
            for mine, theirs in ((t.overlap_kv, a.overlap_kv), (t.overlap_gate, a.overlap_gate)):
                assert (mine is None and theirs is None) if not overlapping else torch.equal(mine, theirs)


def test_one_row_keeps_the_one_token_path(containers, monkeypatch):
    """B = 1 runs the one-token calls (they cost less than the batched ones for one row)."""
    with Generator(containers["release"], cache_gib=1.0) as g:
        d = g.decoder
        logits, states = _prefilled(g, [_prompt(9, 5)])[0]
        monkeypatch.setattr(d.layers, "attention_rows", None)  # would raise if called
        out = d.step_batch([d.start(states)], [int(logits.argmax())])
        assert out.shape == (1, 512)


def test_a_batch_reads_each_chosen_expert_once(containers):
    """With no cache, a step of B rows reads the union of their experts once per layer: no more than one row's
    reads x B, and exactly the distinct (layer, expert) pairs chosen."""
    with Generator(containers["release"], cache_gib=0.0) as g:
        d = g.decoder
        prefilled = _prefilled(g, [_prompt(7, 20), _prompt(7, 20)])  # the same prompt twice: the same experts
        sequences = [d.start(copy.deepcopy(states)) for _, states in prefilled]
        token = int(prefilled[0][0].argmax())
        before = d.stats.bytes_read
        d.step_batch(sequences, [token, token])
        twice = d.stats.bytes_read - before
        single = d.start(copy.deepcopy(prefilled[0][1]))
        before = d.stats.bytes_read
        d.step_batch([single], [token])
        assert twice == d.stats.bytes_read - before > 0


def _random_expert(kinds, hidden, inter, gen, tables, keep):
    mats = []
    for kind, (rows, cols) in zip(kinds, ((inter, hidden), (inter, hidden), (hidden, inter))):
        data, scale = token_kernels._random_stored(kind, rows, cols, gen)
        keep.append((data, scale))
        mats.append(stored_matrix(kind, data, rows, cols, scale, tables.get(kind)))
    return tuple(mats)


@pytest.mark.parametrize("vector", [False, True], ids=["plain", "avx512"])
def test_moe_rows_is_each_tokens_moe_token_and_torch(vector):
    """moe_rows on 5 tokens (experts of FP4, MXFP4, Q8_0, BF16 chosen by different subsets, a bfloat16 shared one on
    all): each token's row equal to the bit to moe_token on that token with its experts, and close to torch's."""
    k = token_kernels.token_kernels()
    if vector and not k.vector:
        pytest.skip("no AVX-512 loop on this CPU")
    k.set_vector(vector)
    try:
        gen = torch.Generator().manual_seed(1)
        tables = {kind: token_kernels.value_table(kind) for kind in ("FP4_E2M1", "MXFP4")}
        hidden, inter, limit, keep = 64, 96, 7.0, []
        kinds = (("FP4_E2M1",) * 3, ("MXFP4", "Q8_0", "FP4_E2M1"), ("BF16", "F32", "F16"), ("Q8_0",) * 3)
        experts = [_random_expert(k3, hidden, inter, gen, tables, keep) for k3 in kinds]
        shared_w = [torch.randn(*shape, generator=gen).bfloat16() for shape in ((48, 64), (48, 64), (64, 48))]
        shared = tuple(float_matrix(w) for w in shared_w)
        rows = [[0, 3, 4], [1], [4, 2, 0], []]  # expert 3 chosen by no token; token 3 by one expert
        weights = [[float(w) for w in torch.rand(len(r), generator=gen)] for r in rows]
        x = torch.randn(5, hidden, generator=gen) * 2
        flags = [0, ROUND_INPUT, 0, 0, ROUND_INPUT | ROUND_OUTPUT]
        got = k.moe_rows(x, experts + [shared], rows + [list(range(5))], weights + [[1.0] * 5], limit, flags,
                         threads=3)
        for t in range(5):
            mine = [e for e, r in enumerate(rows) if t in r]
            picked = [weights[e][rows[e].index(t)] for e in mine]
            alone = k.moe(x[t], [experts[e] for e in mine] + [shared], torch.tensor(picked + [1.0]), limit, False,
                          threads=2, flags=[flags[e] for e in mine] + [flags[-1]])
            assert torch.equal(got[t], alone), t
            want = token_kernels._shared_reference(x[t], shared_w, limit)
            for e, weight in zip(mine, picked):
                w1, w3, w2 = (token_kernels._reference_values(kind, data, m.rows, m.cols, scale).double()
                              for kind, (data, scale), m in zip(kinds[e], keep[3 * e:3 * e + 3], experts[e]))
                xr = x[t].bfloat16().double() if flags[e] & ROUND_INPUT else x[t].double()
                gate, up = (w1 @ xr).clamp(max=limit), (w3 @ xr).clamp(-limit, limit)
                want += weight * (w2 @ (torch.nn.functional.silu(gate) * up))
            assert torch.allclose(got[t].double(), want, rtol=1e-2, atol=2e-2 * float(want.abs().max())), t
    finally:
        k.set_vector(True)


def test_moe_rows_refuses_a_token_outside_the_input():
    k = token_kernels.token_kernels()
    w = [torch.randn(8, 32).bfloat16(), torch.randn(8, 32).bfloat16(), torch.randn(32, 8).bfloat16()]
    expert = tuple(float_matrix(m) for m in w)
    with pytest.raises(RuntimeError, match="refused"):
        k.moe_rows(torch.randn(2, 32), [expert], [[0, 2]], [[1.0, 1.0]], 7.0, [0])


def test_batched_linears_are_each_tokens_one_token_linears():
    """linear_many_rows and grouped_rows on 6 tokens: each token's results equal to the bit to the one-token
    calls', bfloat16 roundings included."""
    k = token_kernels.token_kernels()
    gen = torch.Generator().manual_seed(2)
    ws = [torch.randn(40, 96, generator=gen).bfloat16(), torch.randn(7, 96, generator=gen)]
    plan = token_kernels.LinearPlan([float_matrix(w) for w in ws], [ROUND_INPUT | ROUND_OUTPUT, 0])
    x = torch.randn(6, 96, generator=gen)
    rows = k.linear_many_rows(x, plan, threads=3)
    for t in range(6):
        for got, want in zip(rows, k.linear_many(x[t:t + 1], plan, threads=2)):
            assert torch.equal(got[t:t + 1], want)
    wo = torch.randn(4 * 16, 24, generator=gen).bfloat16()
    groups = torch.randn(6, 4, 24, generator=gen)
    got = k.grouped_rows(groups, float_matrix(wo), ROUND_INPUT | ROUND_OUTPUT, threads=3)
    for t in range(6):
        assert torch.equal(got[t], k.grouped(groups[t], float_matrix(wo), True, threads=2, round_output=True))


def test_route_rows_is_each_tokens_route():
    k = token_kernels.token_kernels()
    gen = torch.Generator().manual_seed(3)
    gate, bias = torch.randn(24, 64, generator=gen), torch.randn(24, generator=gen) * 0.1
    x = torch.randn(5, 64, generator=gen)
    for hash_ids in (None, [[1, 2, 1], [0, 5, 7], [3, 3, 3], [23, 0, 1], [4, 5, 6]]):
        rows = k.route_rows(x, float_matrix(gate), bias, "sqrtsoftplus", 3, hash_ids, 2.5, threads=3)
        for t in range(5):
            assert rows[t] == tuple(k.route(x[t], float_matrix(gate), bias, "sqrtsoftplus", 3,
                                            hash_ids[t] if hash_ids else None, 2.5, threads=2))


@pytest.mark.parametrize("kind", ["FP4_E2M1", "MXFP4"])
def test_an_experts_gate_and_up_in_one_pass_give_the_row_by_row_sums(kind):
    """An FP4 expert's gate and up rows run in one pass for 2 to 4 tokens, row by row (the weight decoded once per
    8 tokens) for one or more than 4: each token's output is the same to the bit whichever count chose the expert."""
    k = token_kernels.token_kernels()
    if not k.vector:
        pytest.skip("no AVX-512 loop on this CPU")
    gen = torch.Generator().manual_seed(2)
    tables = {kind: token_kernels.value_table(kind)}
    keep = []
    expert = _random_expert((kind,) * 3, 64, 96, gen, tables, keep)
    x = torch.randn(6, 64, generator=gen) * 2
    weights = [float(w) for w in torch.rand(6, generator=gen)]
    for flags in (0, ROUND_INPUT):
        every = k.moe_rows(x, [expert], [list(range(6))], [weights], 7.0, [flags])  # 6 tokens: row by row
        for count in (1, 2, 3, 4):  # 2 to 4: the one-pass kernel
            tokens = list(range(6 - count, 6))
            some = k.moe_rows(x, [expert], [tokens], [[weights[t] for t in tokens]], 7.0, [flags], threads=2)
            assert torch.equal(some[tokens], every[tokens]), (flags, count)
        for t in range(6):
            alone = k.moe(x[t], [expert], torch.tensor([weights[t]]), 7.0, False, flags=[flags])
            assert torch.equal(alone, every[t]), (flags, t)
