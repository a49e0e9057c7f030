"""A whole decode step along the branches a CUDA device takes, audited on a CPU (tests/step_audit.py): with every
expert in the device pool it waits for the host once (its logits, which the sampler needs), with misses once more
per layer that has any; nothing in a captured piece waits; no op mixes host and device tensors. For both families,
one row and four. And Qwen3-MoE runs the pool and its graphs like DeepSeek-V4: the same tokens as its per-expert
decode."""

from __future__ import annotations

import pytest
import torch

from moepack.packer.convert import convert_checkpoint
from moepack.packer.synth import synth_checkpoint
from step_audit import StepAudit, audited_decoder, device_caches, gpu_branches, sequences
from test_device_decode import (_StaticBuffers, _all_experts, _greedy_rows, _relative,  # noqa: F401, F811
                                _routed_bytes, generator)
from test_qwen3_moe import CONFIGS as QWEN_CONFIGS, save_model
from v4_models import CONFIGS, saved_model

# eager kernel launches of a step, every expert pooled, as the audit counts aten ops on a CPU (python
# tests/step_audit.py, the tiny presets of 4 layers), per layer whatever the rows (each family's attention one
# piece over its device arena, the head one piece, a piece reading another's output in place): DeepSeek-V4 57 a
# layer and row at 2ba752c, now 27 a step at B = 1 and 4; Qwen3-MoE 30 a layer and row at 51a41cf (121 a step at
# B = 1, 325 at B = 4), now 27 a step at B = 1 and 4
EAGER_LAUNCHES = {"deepseek-v4": 10, "qwen3-moe": 10, "qwen3-moe-sparse": 15}


@pytest.fixture(scope="module")
def containers(tmp_path_factory):
    """DeepSeek-V4 A (5 layers, 2 hash layers, 8 experts top-2, float32); Qwen3-MoE's synthetic tiny preset (4
    layers, 8 experts top-2) and transformers' sparse-step model (dense-MLP layers beside routed ones)."""
    base = tmp_path_factory.mktemp("step-audit")
    saved_model(CONFIGS["A"], 300, str(base / "A"))
    synth_checkpoint(str(base / "q"), preset="tiny", layout="f32", seed=4, progress=False, family="qwen3-moe")
    save_model(base / "sparse", QWEN_CONFIGS["sparse-step"], torch.float32)
    out = {}
    for name, source in (("deepseek-v4", "A"), ("qwen3-moe", "q"), ("qwen3-moe-sparse", "sparse")):
        out[name] = str(base / f"{name}.moepack")
        convert_checkpoint(str(base / source), out[name], progress=False)
    return out


def _audited_steps(g, monkeypatch, rows: int, steps: int = 4) -> list[tuple]:
    """Greedy steps of `rows` sequences, each audited: (its counts, the pool's synchronisations in it)."""
    d = g.decoder
    seqs, tokens = sequences(g, rows)
    audit = StepAudit()
    audited_decoder(d, audit, monkeypatch, seqs, device_caches())
    with audit:  # the graphs captured (a step's cost is the later ones')
        tokens = d.step_batch(seqs, tokens).argmax(-1).tolist()
    audit.reset()
    out = []
    for _ in range(steps):
        before = d.pool.syncs
        with audit:
            logits = d.step_batch(seqs, tokens)
        out.append((audit.reset(), d.pool.syncs - before))
        tokens = logits.argmax(-1).tolist()
    return out


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("family", ["deepseek-v4", "qwen3-moe", "qwen3-moe-sparse"])
@pytest.mark.parametrize("fraction", [1.0, 0.4], ids=["cached", "misses"])
def test_a_whole_step_waits_for_the_host_once_and_once_per_layer_with_misses(containers, generator, monkeypatch,
                                                                             family, rows, fraction):
    """Every expert pooled (and the dense-MLP layers beside them): one synchronisation a step, the logits going to
    the host (`.cpu()` in _general_step: the sampler, the stop strings and the stream need the token); the token
    ids and embedding rows go to the device and the layers' finite flags and choices come back without the host
    waiting. Misses: one more per
    layer that has any (its choices read, in _routed_from_pool), the misses' bytes copied without a wait. No
    captured piece waits, no op mixes host and device tensors, every layer's fixed-shape work replayed; what runs
    eagerly bounded per layer whatever the rows, the Python calls per layer and row."""
    if family == "qwen3-moe-sparse" and fraction < 1.0:
        pytest.skip("its one routed layer's 6 experts: 40 % of them hold fewer than the rows choose")
    gpu_branches(monkeypatch)
    with generator(containers[family], compute_dtype="bfloat16", decoded_experts=True, expert_pool=True) as g:
        d = g.decoder
        d.cache.resize(int(fraction * _routed_bytes(d)))
        d.seed(_all_experts(d))
        d.pool.graphs.enabled = True
        audited = _audited_steps(g, monkeypatch, rows)
        layers = len(d.blocks)
    for counts, layer_syncs in audited:
        assert counts.graph_syncs == [] and counts.mixed == []
        assert [s.split(" @ ")[0] for s in counts.syncs if "_routed_from_pool" not in s] == ["cpu()"]
        assert "_general_step" in counts.syncs[-1]
        assert len(counts.syncs) == 1 + layer_syncs
        # the attention's inputs, then the FFN; a layer with misses (its one sync) the router, the routed work
        # (each miss got a slot) and the finish; and the head
        assert counts.eager_ops["graph replay"] == counts.replays == 2 * layers + 2 * layer_syncs + 1
        assert layer_syncs == 0 if fraction == 1.0 else layer_syncs <= layers
    if fraction == 1.0:  # what runs eagerly: the replays and their input copies, the embedding rows
        per_layer = len(audited) * layers
        assert sum(c.launches for c, _ in audited) <= EAGER_LAUNCHES[family] * per_layer
        assert sum(c.python_calls for c, _ in audited) <= 72 * per_layer * rows
    assert fraction == 1.0 or sum(n for _, n in audited) > 0


# eager launches per layer of a stored pool's step (its routed work a transient piece between the router's and the
# finish's), the tiny release presets of 4 layers: DeepSeek-V4 (FP4 experts) 43 a step at B = 1 and 4 (187 and
# 195 with the routed work eager); Qwen3-MoE (FP8 with float block scales) 35 (303 and 455 eager)
STORED_EAGER_LAUNCHES = {"deepseek-v4": 15, "qwen3-moe": 15}


@pytest.fixture(scope="module")
def release_containers(tmp_path_factory):
    """Each family's tiny synthetic preset in its release layout (DeepSeek-V4: FP4 experts; Qwen3-MoE: FP8)."""
    base = tmp_path_factory.mktemp("step-audit-release")
    out = {}
    for family in STORED_EAGER_LAUNCHES:
        synth_checkpoint(str(base / family), preset="tiny", layout="release", seed=4, progress=False, family=family)
        out[family] = str(base / f"{family}.moepack")
        convert_checkpoint(str(base / family), out[family], progress=False)
    return out


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("family", list(STORED_EAGER_LAUNCHES))
def test_a_stored_pool_step_waits_for_the_host_once(release_containers, generator, monkeypatch, family, rows):
    """Every expert pooled as its stored bytes: one synchronisation a step (the logits); the routed work (gather,
    decode side by side, batched matmuls) a captured piece between the router's and the finish's, none waiting,
    no op mixing host and device tensors; what runs eagerly bounded per layer whatever the rows."""
    gpu_branches(monkeypatch)
    with generator(release_containers[family], compute_dtype="bfloat16", expert_pool=True, pool_form="stored") as g:
        d = g.decoder
        assert d.pool.form == "stored"
        d.cache.resize(_routed_bytes(d))
        d.seed(_all_experts(d))
        d.pool.graphs.enabled = True
        audited = _audited_steps(g, monkeypatch, rows)
        layers = len(d.blocks)
    for counts, layer_syncs in audited:
        assert counts.graph_syncs == [] and counts.mixed == [] and layer_syncs == 0
        assert [s.split(" @ ")[0] for s in counts.syncs] == ["cpu()"]
        assert counts.replays == 4 * layers + 1  # the attention, the router, the routed work, the finish; the head
    assert sum(c.launches for c, _ in audited) <= STORED_EAGER_LAUNCHES[family] * len(audited) * layers


@pytest.mark.parametrize("name", ["qwen3-moe", "qwen3-moe-sparse"])
@pytest.mark.parametrize("fraction", [1.0, 0.4], ids=["complete", "misses"])
def test_qwen3_moe_runs_the_pool_and_its_graphs_with_the_per_expert_tokens(containers, generator, monkeypatch,
                                                                             name, fraction):
    """Qwen3-MoE with decoded experts along a GPU's branches: the pool (its dense-MLP layers take no slots), each
    layer's FFN a captured piece where its experts are all pooled; the same greedy tokens as its per-expert
    decode, logits to float32 rounding, and the replays equal to eager."""
    from moepack.runtime import device_decode

    results = {}
    for mode in ("per-expert", "eager", "graphs"):
        with generator(containers[name], decoded_experts=True, expert_pool=mode != "per-expert") as g:
            d = g.decoder
            assert (d.pool is not None) == (mode != "per-expert")
            d.cache.resize(int(fraction * _routed_bytes(d)))
            d.seed(_all_experts(d))
            if mode == "graphs":
                monkeypatch.setattr(device_decode, "CapturedCall", _StaticBuffers)
                d.pool.graphs.enabled = True
            results[mode] = _greedy_rows(g, steps=4)
            if d.pool is not None:
                routed = [layer for layer, b in enumerate(d.blocks) if b.experts]
                # (with misses, a step whose rows chose more experts than the pool holds runs them one by one)
                assert d.pool.calls <= 4 * len(routed) and (d.pool.syncs == 0) == (fraction == 1.0)
                assert fraction < 1.0 or d.pool.calls == 4 * len(routed)
                # each layer's attention inputs, its FFN (a dense layer's too), or with misses (a sync each) its
                # router and finish with the routed work over the pool between them; the head
                dense = len(d.blocks) - len(routed)
                assert d.pool.graphs.replays == (4 * (len(d.blocks) + dense + 1) + d.pool.calls + 2 * d.pool.syncs
                                                 if mode == "graphs" else 0)
    assert results["graphs"][0] == results["eager"][0] == results["per-expert"][0]
    for a, b, c in zip(results["graphs"][1], results["eager"][1], results["per-expert"][1]):
        assert torch.equal(a, b) and _relative(a, c) < 1e-5


def test_a_qwen3_moe_pooled_layer_not_finite_is_named_by_its_number_beside_dense_layers(containers, generator):
    """The sparse-step model routes only layer 1 (the others hold a dense MLP, outside the pool): a pooled layer
    that is not finite is named by its own number after the step, not by its place among the pooled layers."""
    from moepack.format_spec.errors import MoepackError

    with generator(containers["qwen3-moe-sparse"], decoded_experts=True, expert_pool=True) as g:
        d = g.decoder
        assert [layer for layer, b in enumerate(d.blocks) if b.experts] == [1]
        d.seed(_all_experts(d))
        seqs, tokens = sequences(g, 1)
        for e in range(len(d.blocks[1].experts)):
            d.pool.gate_up[d.pool.slot(1, e)] = float("nan")
        with pytest.raises(MoepackError, match="^layer 1: its output is not finite"):
            d.step_batch(seqs, tokens)
