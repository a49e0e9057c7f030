"""Hostile cases for the device expert pools (runtime/device_decode.py's StoredExpertPool and ExpertPool):
containers whose layers keep their experts in different storage types (a stored slot holds the longest region of
all), or have layers without routed experts; on a CPU along the pools' device path."""

from __future__ import annotations

import re

import pytest
import torch

from moepack.packer.convert import RegionConverter, convert_checkpoint
from moepack.packer.synth import synth_checkpoint
from moepack.runtime.device_decode import ExpertPool, StoredExpertPool
from test_device_decode import _all_experts, _greedy_rows, _relative, _routed_bytes, generator  # noqa: F401
from test_qwen3_moe import CONFIGS as QWEN_CONFIGS, save_model as save_qwen


def _converted_by_layer(src: str, out: str, policy_of) -> str:
    """`src` converted with each layer's routed experts in policy_of(layer), everything else as nvfp4 stores it."""
    real = RegionConverter._targets

    def targets(self, items):
        name = items[0][0]
        layer, expert = re.search(r"layers\.(\d+)\.", name), re.search(r"experts\.(\d+)\.", name)
        saved = self.policy
        if layer and expert:
            self.policy = policy_of(int(layer.group(1)))
        try:
            return real(self, items)
        finally:
            self.policy = saved
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RegionConverter, "_targets", targets)
        convert_checkpoint(src, out, policy="nvfp4", progress=False)
    return out


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """The tiny synthetic model with layer 0's experts in BF16 and the other layers' in MXFP4 ("bf16-fp4"), and
    with layer 0's in Q8_0 and the others' in NVFP4 with their tensor scales ("q8-nvfp4")."""
    base = tmp_path_factory.mktemp("stored-hostile")
    synth_checkpoint(str(base / "src"), preset="tiny", layout="release", seed=7, progress=False)
    return {"bf16-fp4": _converted_by_layer(str(base / "src"), str(base / "bf16-fp4.moepack"),
                                            lambda layer: "bf16" if layer == 0 else "fp4"),
            "q8-nvfp4": _converted_by_layer(str(base / "src"), str(base / "q8-nvfp4.moepack"),
                                            lambda layer: "q8" if layer == 0 else "nvfp4")}


def _expert_types(d) -> list[set[str]]:
    """Each layer's storage types of its experts' matrices."""
    names = d.arithmetic.expert_naming.names
    return [{t.dtype for r in b.experts for t in r.tensors if t.name in names(layer, r.expert).values()}
            for layer, b in enumerate(d.blocks)]


def test_the_default_form_counts_a_stored_slot_as_the_longest_region(mixed, generator):
    """One layer's experts in BF16, the others' in MXFP4, decoded to bfloat16: a stored slot is the longest region,
    a BF16 expert's (its decoded size), so the stored pool holds no more experts than the decoded one in half their
    decoded size: the default is the decoded pool, though the stored bytes average far under half."""
    mixed = mixed["bf16-fp4"]
    with generator(mixed, "bfloat16", cache_gib=0.0, expert_pool=True, pool_form="stored") as probe:
        d = probe.decoder
        assert _expert_types(d) == [{"BF16"}, {"MXFP4"}, {"MXFP4"}, {"MXFP4"}]
        stored_slot = d.pool.slot_bytes
        regions = [r for b in d.blocks for r in b.experts]
        assert 2 * sum(r.length for r in regions) < len(regions) * stored_slot  # (the average: under half)
    with generator(mixed, "bfloat16", cache_gib=0.0, expert_pool=True, pool_form="decoded") as probe:
        decoded, decoded_slot = _routed_bytes(probe.decoder), probe.decoder.pool.slot_bytes
    assert stored_slot >= decoded_slot
    with generator(mixed, "bfloat16", cache_gib=0.5 * decoded / (1 << 30), expert_pool=True) as g:
        assert type(g.decoder.pool) is ExpertPool and g.decoder.decoded


@pytest.mark.parametrize("fraction", [1.0, 0.4, 0.05])
def test_a_stored_pool_over_layers_of_different_types_steps_as_the_per_expert_path(mixed, generator, fraction):
    """Layer 0's experts in Q8_0, the others' in NVFP4: each layer's experts decoded by their own layout from slots
    of the longest region; every expert pooled, 40 % of them (misses copied in), or too few slots for a layer's
    choices (its experts one by one, the pooled ones from their slots' bytes): the per-expert path's tokens."""
    results = {}
    for pooled in (False, True):
        with generator(mixed["q8-nvfp4"], cache_gib=0.0, decoded_experts=False, expert_pool=pooled) as g:
            d = g.decoder
            d.cache.resize(int(fraction * _routed_bytes(d)))
            if fraction == 1.0:
                d.seed(_all_experts(d))
            results[pooled] = _greedy_rows(g, steps=4)
            if pooled:
                assert isinstance(d.pool, StoredExpertPool)
                assert _expert_types(d) == [{"Q8_0"}, {"NVFP4"}, {"NVFP4"}, {"NVFP4"}]
                assert d.pool.lengths[0] > d.pool.lengths[1] and d.pool.slot_bytes >= d.pool.lengths[0]
                layers = sum(1 for b in d.blocks if b.experts)
                assert (d.pool.calls == 4 * layers) == (fraction >= 0.4) and (d.pool.syncs == 0) == (fraction == 1.0)
    assert results[True][0] == results[False][0]
    for a, b in zip(results[True][1], results[False][1]):
        assert _relative(a, b) < 1e-5


@pytest.fixture(scope="module")
def sparse_step(tmp_path_factory):
    """A Qwen3-MoE model whose layers 0, 2 and 3 have no routed experts (decoder_sparse_step 2, mlp_only_layers)."""
    base = tmp_path_factory.mktemp("stored-hostile-qwen")
    save_qwen(str(base / "src"), QWEN_CONFIGS["sparse-step"], torch.bfloat16)
    convert_checkpoint(str(base / "src"), str(base / "sparse-step.moepack"), progress=False)
    return str(base / "sparse-step.moepack")


@pytest.mark.parametrize("form", ["stored", "decoded"])
def test_a_pool_over_layers_without_routed_experts_takes_slots_for_the_routed_ones_only(sparse_step, generator,
                                                                                         form):
    """Layers without routed experts take no slots: a budget twice every routed expert gives a pool of one slot
    per routed expert (its stacks hold no device memory that nothing could ever use), all of them pooled."""
    with generator(sparse_step, cache_gib=0.0, expert_pool=True, pool_form=form) as g:
        d = g.decoder
        routed = sum(len(b.experts) for b in d.blocks)
        assert 0 < routed < len(d.blocks) * d.pool.experts  # (layers without routed experts)
        d.cache.resize(2 * _routed_bytes(d))
        d.seed(_all_experts(d))
        assert d.pool.capacity == routed and d.pool.reserved_bytes == d.cache.bytes
        assert all(d.pool.complete(layer) for layer, b in enumerate(d.blocks) if b.experts)
        d.cache.resize(3 * _routed_bytes(d) // 2)  # (a smaller budget, still over every expert: the stacks as they are)
        assert d.pool.capacity == routed
