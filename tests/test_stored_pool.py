"""The device pool of cached experts in their stored form (runtime/device_decode.py's StoredExpertPool): each
storage type's experts kept as their bytes, decoded side by side at each step, step as the decoded pool and the
per-expert path do; misses are copies of bytes (no expert decoded on its own); the default form follows the
budget. On a CPU, along the pool's device path (its routed work is never captured, so nothing here needs CUDA)."""

from __future__ import annotations

import pytest
import torch

from moepack.format_spec.errors import MoepackError
from moepack.packer.convert import convert_checkpoint
from moepack.packer.synth import synth_checkpoint
from moepack.runtime.device_decode import ExpertPool, StoredExpertPool
from containers import tiny_keep_container, tiny_policy_containers
from gpu_branches import SYNC_OPS, HostSyncs
from test_device_decode import _all_experts, _greedy_rows, _relative, _routed_bytes, generator  # noqa: F401
from test_qwen3_moe import CONFIGS as QWEN_CONFIGS, save_model as save_qwen
from v4_models import CONFIGS, saved_model

# every storage type the container keeps routed experts in: container -> the types of its experts' matrices
TYPES = {"f32": {"F32"}, "fp4-release": {"FP4_E2M1"}, "mxfp4": {"MXFP4"}, "nvfp4": {"NVFP4"}, "q8": {"Q8_0"},
         "q2": {"IQ2_XXS", "Q2_K"}, "bf16": {"BF16"}, "qwen-fp8": {"F8_E4M3"}}


@pytest.fixture(scope="module")
def containers(tmp_path_factory):
    base = tmp_path_factory.mktemp("stored-pool")
    saved_model(CONFIGS["B"], 310, str(base / "B"))
    out = {"f32": str(base / "B.moepack"), "fp4-release": tiny_keep_container(tmp_path_factory)}
    convert_checkpoint(str(base / "B"), out["f32"], progress=False)
    policies = tiny_policy_containers(base / "tiny", ["fp4", "nvfp4", "q8", "q2", "bf16"], seed=4)
    out.update({"mxfp4": policies["fp4"], **{p: policies[p] for p in ("nvfp4", "q8", "q2", "bf16")}})
    out["qwen-fp8"] = _qwen_fp8(base)
    return out


def _qwen_fp8(base) -> str:
    """Qwen3-MoE's tiny synthetic preset in its release (-FP8) layout, converted --keep, under `base`."""
    synth_checkpoint(str(base / "qwen"), preset="tiny", layout="release", seed=5, progress=False, family="qwen3-moe")
    convert_checkpoint(str(base / "qwen"), str(base / "qwen.moepack"), policy="keep", progress=False)
    return str(base / "qwen.moepack")


@pytest.fixture(scope="module")
def release_containers(tmp_path_factory):
    """Only the two release layouts (the CUDA test's: the device's test step has minutes, not the policies')."""
    return {"fp4-release": tiny_keep_container(tmp_path_factory),
            "qwen-fp8": _qwen_fp8(tmp_path_factory.mktemp("stored-pool-release"))}


def _expert_types(d) -> set[str]:
    names = set(d.arithmetic.expert_naming.names(0, 0).values())
    return {t.dtype for t in d.blocks[0].experts[0].tensors if t.name in names}


def _assert_slots_hold_the_bytes(d) -> None:
    """The stored pool's table, its host mirror and the cache agree, and each slot holds its expert's bytes."""
    pool, cache = d.pool, d.cache
    table = pool.slot_of.cpu()
    pooled = {(int(layer), int(e)): int(table[layer, e]) for layer, e in zip(*torch.nonzero(table >= 0, as_tuple=True))}
    assert pooled == pool._slots and set(pooled) == set(cache._entries) and not pool._in_scratch
    assert sorted([*pooled.values(), *pool._free, *pool._scratch]) == list(range(pool.capacity))
    assert cache.bytes == len(pooled) * pool.slot_bytes <= cache.budget - len(pool._scratch) * pool.slot_bytes
    for (layer, e), slot in pooled.items():
        region = d.blocks[layer].experts[e]
        assert torch.equal(pool.stacks[0][slot, :region.length], d._read_region(region))
        assert cache._entries[(layer, e)].data_ptr() == pool.stacks[0][slot].data_ptr()


@pytest.mark.parametrize("name", list(TYPES))
def test_a_stored_pool_steps_as_the_decoded_pool_for_every_storage_type(containers, generator, name):
    """Every expert pooled as its stored bytes: three rows' greedy tokens equal the decoded pool's, logits to
    float32 rounding; no synchronisation, no read; each slot holds its expert's bytes, a slot the length of the
    longest region (a quantized type's: far under its decoded weights)."""
    results = {}
    for form in ("decoded", "stored"):
        with generator(containers[name], cache_gib=0.0, expert_pool=True, pool_form=form) as g:
            d = g.decoder
            assert _expert_types(d) == TYPES[name]
            assert isinstance(d.pool, StoredExpertPool if form == "stored" else ExpertPool)
            assert d.decoded == (form == "decoded")
            d.cache.resize(_routed_bytes(d))
            d.seed(_all_experts(d))
            assert all(d.pool.complete(layer) for layer in range(len(d.blocks)) if d.blocks[layer].experts)
            results[form] = _greedy_rows(g, steps=4)
            assert d.pool.syncs == 0 and d.cache.misses == 0 and d.stats.bytes_read == 0
            assert d.stats_dict()["expert_pool"] == form
            if form == "stored":
                _assert_slots_hold_the_bytes(d)
                longest = max(r.length for b in d.blocks for r in b.experts)
                assert longest <= d.pool.slot_bytes < longest + 64
    assert results["stored"][0] == results["decoded"][0]
    for a, b in zip(results["stored"][1], results["decoded"][1]):
        assert _relative(a, b) < 1e-5


@pytest.mark.parametrize("name", ["fp4-release", "nvfp4", "qwen-fp8"])
def test_a_stored_pool_too_small_for_every_expert_copies_its_misses_in_and_steps_as_the_per_expert_path(
        containers, generator, monkeypatch, name):
    """A stored pool for 40 % of the experts: misses read and their bytes copied into slots (no expert decoded on
    its own: the per-expert decode is never called), evictions, one synchronisation per layer and step at most,
    the table consistent, through a shrink and a growth of the budget; the same greedy tokens as the per-expert
    path over the cache of stored bytes."""
    results = {}
    for pooled in (False, True):
        with generator(containers[name], cache_gib=0.0, decoded_experts=False, expert_pool=pooled) as g:
            d = g.decoder
            assert isinstance(d.pool, StoredExpertPool) if pooled else d.pool is None
            d.cache.resize(int(0.4 * _routed_bytes(d)))
            if pooled:
                monkeypatch.setattr(d.experts, "expert_weights", None)  # (called: a TypeError)
            results[pooled] = _greedy_rows(g, steps=5)
            if pooled:
                cache, pool = d.cache, d.pool
                assert pool.capacity == cache.budget // pool.slot_bytes
                assert cache.misses > 0 and cache.hits > 0 and cache.evicted > 0
                layers = sum(1 for b in d.blocks if b.experts)
                assert 0 < pool.syncs <= 5 * layers and pool.calls == 5 * layers
                _assert_slots_hold_the_bytes(d)
                cache.resize(cache.budget // 2)  # the stacks shrink, the kept bytes move
                assert pool.capacity == cache.budget // pool.slot_bytes
                _assert_slots_hold_the_bytes(d)
                results["shrunk"] = _greedy_rows(g, steps=5)
                _assert_slots_hold_the_bytes(d)
                kept, shrunk = dict(pool._slots), pool.capacity
                cache.resize(cache.budget * 2)  # and grow back: the kept bytes stay in their slots
                assert pool.capacity == cache.budget // pool.slot_bytes > shrunk and pool._slots == kept
                _assert_slots_hold_the_bytes(d)
    assert results[True][0] == results[False][0] == results["shrunk"][0]
    for a, b in zip(results[True][1], results[False][1]):
        assert _relative(a, b) < 1e-5


@pytest.mark.parametrize("name", ["fp4-release", "q2", "qwen-fp8"])
def test_the_stored_pools_routed_work_asks_the_host_nothing(containers, generator, name):
    """A layer's routed work over the stored pool (gather, decode side by side, batched matmuls, combine) has no
    op that would wait for the host on CUDA, with several decode chunks."""
    with generator(containers[name], cache_gib=0.0, expert_pool=True, pool_form="stored") as g:
        d = g.decoder
        d.cache.resize(_routed_bytes(d))
        d.seed(_all_experts(d))
        pool, layer = d.pool, next(i for i, b in enumerate(d.blocks) if b.experts)
        rows, top_k = 4, min(4, pool.experts)
        x = torch.randn(rows, pool.hidden, generator=torch.Generator().manual_seed(0))
        experts = torch.stack([torch.randperm(pool.experts)[:top_k] for _ in range(rows)])
        weights = torch.rand(rows, top_k)
        whole = pool.routed(layer, x, experts, weights)
        pool.chunk_pairs = 3  # (rows x top_k pairs in several chunks)
        with HostSyncs(SYNC_OPS) as syncs:  # (a CPU's decode makes its outputs from numpy: not a GPU's)
            chunked = pool.routed(layer, x, experts, weights)
        assert syncs.seen == []
        assert torch.allclose(chunked, whole, rtol=1e-5, atol=1e-6)


def test_the_default_form_follows_the_budget(containers, generator, monkeypatch):
    """Decoded where the budget holds every routed expert decoded, stored where it does not (FP4: several times
    as many experts in the same budget; Q8_0 about twice); decoded where the stored bytes are not smaller (BF16
    or F32 experts decoded to bf16);
    MOEPACK_EXPERT_POOL overrides, a form it does not know is refused in one line."""
    def pool_of(name, budget_of_decoded, dtype="float32"):
        with generator(containers[name], dtype, cache_gib=0.0, expert_pool=True, pool_form="decoded") as probe:
            decoded = _routed_bytes(probe.decoder)  # (every expert decoded)
        with generator(containers[name], dtype, cache_gib=budget_of_decoded * decoded / (1 << 30),
                       expert_pool=True) as g:
            assert abs(g.decoder.cache.budget - budget_of_decoded * decoded) <= 1
            return type(g.decoder.pool), g.decoder.cache.budget // g.decoder.pool.slot_bytes, decoded
    assert pool_of("fp4-release", 1.001)[0] is ExpertPool
    kind, stored_slots, decoded = pool_of("fp4-release", 0.5)
    assert kind is StoredExpertPool
    with generator(containers["fp4-release"], cache_gib=0.0, expert_pool=True, pool_form="decoded") as g:
        decoded_slots = int(0.5 * decoded) // g.decoder.pool.slot_bytes
    assert stored_slots >= 3 * decoded_slots
    assert pool_of("bf16", 0.5, "bfloat16")[0] is ExpertPool  # (bf16 bytes decoded to bf16: no smaller stored)
    assert pool_of("bf16", 0.5)[0] is StoredExpertPool  # (decoded to float32 on a CPU: half the size stored)
    assert pool_of("q8", 0.5, "bfloat16")[0] is StoredExpertPool  # (Q8_0's 8.5 bits against bf16's 16)
    assert pool_of("f32", 0.5, "bfloat16")[0] is ExpertPool  # (float32 bytes: twice their bf16 decode)
    monkeypatch.setenv("MOEPACK_EXPERT_POOL", "stored")
    assert pool_of("bf16", 1.001)[0] is StoredExpertPool
    monkeypatch.setenv("MOEPACK_EXPERT_POOL", "packed")
    with pytest.raises(MoepackError, match="'decoded' or 'stored', not 'packed'"):
        pool_of("bf16", 1.001)


def test_a_decoded_pool_refuses_stored_experts_and_a_stored_pool_decoded_ones(containers, generator):
    for form, decoded in (("decoded", False), ("stored", True)):
        with pytest.raises(ValueError, match=f"a {form} expert pool with decoded_experts={decoded}"):
            generator(containers["f32"], expert_pool=True, pool_form=form, decoded_experts=decoded)


class _SharedPoolGraphs:
    """device_decode.CapturedCall on a CPU as a shared graph memory pool can leave it: the inputs copied into
    static tensors, the piece run twice at capture, its outputs static tensors overwritten at each call; and every
    time a transient piece (one captured into the shared pool) is captured or replayed, the other transient
    pieces' outputs are filled with NaN: on a GPU its intermediates may lie where theirs are. A caller that used a
    transient output after the next transient piece ran would see NaN."""

    transient: list = []

    def __init__(self, fn, inputs, pool=None):
        self.fn, self.inputs, self.pool = fn, tuple(t.clone() for t in inputs), pool
        self._clobber_others()
        fn(*self.inputs)
        out = fn(*self.inputs)
        self.output = tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()
        if pool is not None:
            _SharedPoolGraphs.transient.append(self)

    def _clobber_others(self) -> None:
        if self.pool is None:
            return
        for other in _SharedPoolGraphs.transient:
            if other is not self:
                for t in other.output if isinstance(other.output, tuple) else (other.output,):
                    if t.is_floating_point():
                        t.fill_(float("nan"))
                    else:
                        t.fill_(-1 if t.dtype != torch.bool else False)

    def __call__(self, *args):
        for static, arg in zip(self.inputs, args):
            static.copy_(arg)
        self._clobber_others()
        out = self.fn(*self.inputs)
        for static, new in zip(*((self.output, out) if isinstance(out, tuple) else ((self.output,), (out,)))):
            static.copy_(new)
        return self.output


@pytest.mark.parametrize("form, fraction", [("stored", 1.0), ("stored", 0.4), ("decoded", 0.4)])
@pytest.mark.parametrize("name", ["fp4-release", "qwen-fp8"])
def test_every_transient_pieces_output_is_used_before_the_next_one_runs(containers, generator, monkeypatch, name,
                                                                         form, fraction):
    """Along a GPU's branches (each family's attention over its device arena, a transient piece like the routed
    work), with captures that clobber the other transient pieces' outputs as a shared graph memory pool may:
    three rows' greedy tokens and logits equal the eager step's, and the attention and the routed work were
    captured into the shared pool."""
    from moepack.runtime import device_decode
    from step_audit import gpu_branches

    gpu_branches(monkeypatch)
    monkeypatch.setattr(_SharedPoolGraphs, "transient", [])
    results = {}
    for graphs in (False, True):
        with generator(containers[name], "bfloat16", cache_gib=0.0, expert_pool=True, pool_form=form) as g:
            d = g.decoder
            d.cache.resize(int(fraction * _routed_bytes(d)))
            d.seed(_all_experts(d))
            if graphs:
                monkeypatch.setattr(device_decode, "CapturedCall", _SharedPoolGraphs)
                d.pool.graphs.enabled = True
            results[graphs] = _greedy_rows(g, steps=4)
            if graphs:
                kinds = {key[0] for key, piece in d.pool.graphs._captured.items()
                         if piece is not None and piece.call.pool is not None}
                assert kinds == {"arena attention", "routed"}
                # the Routing each router piece made is kept without its tensors (the graphs' outputs)
                kept = d._pieces._routings.values()
                assert kept and all(getattr(r, n) is None for names, r in kept for n in names)
    assert results[True][0] == results[False][0]
    for a, b in zip(results[True][1], results[False][1]):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("form, fraction", [("stored", 1.0), ("stored", 0.4), ("decoded", 1.0), ("decoded", 0.4)])
def test_cuda_either_pool_steps_as_graphs_as_it_does_eagerly(release_containers, generator, form, fraction):
    """On a GPU (bf16, each family's KV in its device arena): three rows' greedy steps with the step's pieces as
    CUDA graphs, the transient ones (the attention, the routed work) in one shared memory pool, equal the same
    pool's eager steps; every expert pooled, no synchronisation of the routed work."""
    for name in ("fp4-release", "qwen-fp8"):
        results = {}
        for graphs in (False, True):
            with generator(release_containers[name], "bfloat16", cache_gib=0.0, device="cuda", expert_pool=True,
                           pool_form=form) as g:
                d = g.decoder
                d.cache.resize(int(fraction * _routed_bytes(d)))
                d.seed(_all_experts(d))
                d.pool.graphs.enabled = graphs
                results[graphs] = _greedy_rows(g, steps=6)
                assert fraction < 1 or d.pool.syncs == 0
                if graphs:
                    assert d.pool.graphs.replays > 0 and d.pool.graphs._transient_pool is not None
        assert results[True][0] == results[False][0], name
        for a, b in zip(results[True][1], results[False][1]):
            assert _relative(a, b) < 1e-3, name
