"""families/deepseek_v4/model.py against transformers' DeepseekV4ForCausalLM (the oracle), float32 on CPU.

Each configuration is a randomly initialised transformers model whose weights are re-drawn with a fixed seed so
that no path is degenerate (transformers' init zeroes the sinks, the mHC biases, the compressors' ape, the router
correction bias and tid2eid), saved with save_pretrained (which writes release names) and read back.
`test_every_component_is_visible` checks that breaking any one component would fail the comparison.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from safetensors.torch import load_file
from torch.utils._pytree import tree_flatten

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4Config  # noqa: E402

from moepack.families.deepseek_v4 import model as M  # noqa: E402
from moepack.families.deepseek_v4.config import ModelConfig, RopeConfig  # noqa: E402
from moepack.families.deepseek_v4.kv import LayerKVState  # noqa: E402
from moepack.families.deepseek_v4.names import from_transformers  # noqa: E402

from v4_models import CONFIGS, S, C, H, _randomise, build, saved_model  # noqa: E402,F401

REL_TOL = 1e-3  # max abs error <= REL_TOL * max |logit|
PROMPTS = [("A", 1), ("A", 7), ("A", 37), ("A", 301), ("B", 5), ("B", 130), ("C", 20), ("C", 257)]
ERRORS: dict[str, float] = {}  # printed at the end of the module, for the record


@pytest.fixture(scope="module")
def tmp_dir(tmp_path_factory):
    yield str(tmp_path_factory.mktemp("dsv4"))
    print("\nmax abs error / max |logit| vs transformers:")
    for key, value in ERRORS.items():
        print(f"  {key}: {value}")


def prompt(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1000 * seed + n))


def reference(hf_model, ids):
    with torch.no_grad():
        out = hf_model(ids[None], use_cache=True)
    return out.logits[0], out.cache


def max_error(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    return (ours - ref).abs().max().item(), ref.abs().max().item()


def assert_kv_state_matches(states: list[LayerKVState], cache, cfg: ModelConfig) -> None:
    def close(a, b):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-4)

    for layer, (state, cached) in enumerate(zip(states, cache.layers)):
        assert state.layer_type == cfg.layer_types[layer]
        assert state.seen_tokens == cached.cumulative_length
        close(state.window_kv, cached.keys[0, 0])
        names = {S: (), H: ("compressor",), C: ("compressor", "indexer")}[state.layer_type]
        assert (state.compressor is not None) == bool(names) and (state.indexer is not None) == (len(names) == 2)
        for name in names:
            ours = getattr(state, name)
            assert ours.entry_count == cached.entry_count[name]
            close(ours.compressed_kv, cached.compressed_kv[name][0])
            close(ours.buffer_kv, cached.buffer_kv[name][0])
            close(ours.buffer_gate, cached.buffer_gate[name][0])
            if state.layer_type == C:
                if cached.overlap_kv[name] is None:
                    assert ours.overlap_kv is None and ours.overlap_gate is None
                else:
                    close(ours.overlap_kv, cached.overlap_kv[name][0])
                    close(ours.overlap_gate, cached.overlap_gate[name][0])


@pytest.mark.parametrize("name,n", PROMPTS, ids=[f"{c}-N{n}" for c, n in PROMPTS])
def test_matches_transformers(tmp_dir, name, n):
    hf_model, cfg, weights = build(name, tmp_dir)
    ids = prompt(n, cfg.vocab_size)
    ref, cache = reference(hf_model, ids)
    logits, states = M.forward_resident(cfg, weights, ids, query_chunk=32, return_kv_state=True)
    err, scale = max_error(logits, ref)
    ERRORS[f"{name} N={n}"] = f"{err:.2e} / {scale:.2f} = {err / scale:.1e}"
    assert err <= REL_TOL * scale
    assert_kv_state_matches(states, cache, cfg)
    # The engine's call: last position only.
    last = M.head(cfg, _streams_before_head(cfg, weights, ids), weights)
    assert last.shape == (cfg.vocab_size,) and torch.allclose(last, logits[-1], atol=1e-5)


def _streams_before_head(cfg, weights, ids):
    """The layer-major loop of forward_resident, written out as the streaming engine runs it."""
    positions = torch.arange(len(ids))
    streams = M.embed(cfg, ids, weights["embed.weight"])
    for layer in range(cfg.num_layers):
        w = M.layer_weights(weights, layer)
        streams, _ = M.attention_sublayer(cfg, layer, w, streams, positions, query_chunk=None)
        routing = M.moe_route(cfg, layer, w, streams, ids)
        routed = torch.zeros_like(routing.x)
        by_expert = routing.tokens_by_expert()
        assert list(by_expert) == sorted(by_expert)
        for expert in reversed(list(by_expert)):  # order of experts must not matter beyond rounding
            token_index, _ = by_expert[expert]
            y = M.expert_forward(cfg, routing.x[token_index], *(w[f"ffn.experts.{expert}.{p}.weight"]
                                                                 for p in ("w1", "w3", "w2")))
            M.accumulate(routed, routing, expert, y)
        streams = M.moe_finish(cfg, layer, w, streams, routing, routed)
    return streams


def test_prompts_cover_every_window_case(tmp_dir):
    """The longest prompt of each configuration spans several windows of every compressed kind, ends on a partial
    window, and CSA queries have more complete entries than index_topk; short prompts have no entries at all."""
    for name in ("A", "B", "C"):
        _, cfg, _ = build(name, tmp_dir)
        n_max = max(n for c, n in PROMPTS if c == name)
        n_min = min(n for c, n in PROMPTS if c == name)
        for kind, rate in zip(cfg.layer_types, cfg.compress_rates):
            if kind == S:
                continue
            assert n_max >= 2 * rate and n_max % rate != 0
            if kind == C:
                assert n_max // rate > cfg.index_topk
        assert n_min < max(cfg.compress_rates)
        assert n_max > cfg.sliding_window


@pytest.mark.parametrize("n", [20, 27, 28, 301])
def test_the_indexer_runs_only_when_it_has_a_choice(tmp_dir, monkeypatch, n):
    """CSA with no more compressed entries than index_topk attends to every complete entry without running the
    Lightning Indexer (its top-k would be all of them); with more it selects. transformers' logits either way."""
    hf_model, cfg, weights = build("A", tmp_dir)
    calls = []
    real = M.indexer_topk
    monkeypatch.setattr(M, "indexer_topk", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = prompt(n, cfg.vocab_size, seed=3)
    logits = M.forward_resident(cfg, weights, ids, query_chunk=16)
    rate = min(r for r, kind in zip(cfg.compress_rates, cfg.layer_types) if kind == C)
    assert bool(calls) == (n // rate > cfg.index_topk), (n, len(calls))
    err, scale = max_error(logits, reference(hf_model, ids)[0])
    assert err <= REL_TOL * scale


def test_attend_skips_an_empty_key_set(tmp_dir):
    """A key set with no keys (index_topk = 0 picks none) takes no part in the softmax."""
    _, cfg, weights = build("A", tmp_dir)
    no_picks = M.forward_resident(dataclasses.replace(cfg, index_topk=0), weights, prompt(90, cfg.vocab_size))
    assert torch.isfinite(no_picks).all()
    g = torch.Generator().manual_seed(0)
    q, kv, sink = torch.randn(3, 2, 8, generator=g), torch.randn(5, 8, generator=g), torch.randn(2, generator=g)
    bias = torch.zeros(3, 5)
    alone = M.attend_key_sets(q, [(kv, bias)], sink, 0.3)
    with_empty = M.attend_key_sets(q, [(kv, bias), (torch.empty(3, 0, 8), torch.empty(3, 0))], sink, 0.3)
    assert torch.equal(alone, with_empty)
    logits = torch.cat([torch.einsum("chd,kd->chk", q, kv) * 0.3, sink.view(1, 2, 1).expand(3, 2, 1)], dim=-1)
    expected = torch.einsum("chk,kd->chd", torch.softmax(logits, dim=-1)[..., :5], kv)
    assert torch.allclose(alone, expected, atol=1e-6)


def test_routing_tokens_by_expert(tmp_dir):
    _, cfg, weights = build("B", tmp_dir)
    ids = prompt(50, cfg.vocab_size)
    streams = M.embed(cfg, ids, weights["embed.weight"])
    for layer in (0, 1):  # a hash layer and a learned one
        routing = M.moe_route(cfg, layer, M.layer_weights(weights, layer), streams, ids)
        assert routing.experts.shape == routing.weights.shape == (50, cfg.num_experts_per_tok)
        torch.testing.assert_close(routing.weights.sum(-1), torch.full((50,), cfg.routed_scaling_factor))
        by_expert = routing.tokens_by_expert()
        assert list(by_expert) == sorted(by_expert) and routing.tokens_by_expert() is by_expert
        pairs = sorted((t, e, w) for e, (ts, ws) in by_expert.items() for t, w in zip(ts.tolist(), ws.tolist()))
        expected = sorted((t, e, w) for t in range(50) for e, w in zip(routing.experts[t].tolist(),
                                                                        routing.weights[t].tolist()))
        assert pairs == expected
        for ts, _ in by_expert.values():
            assert torch.all(ts[1:] > ts[:-1])
    hashed = M.moe_route(cfg, 0, M.layer_weights(weights, 0), streams, ids)
    assert torch.equal(hashed.experts, weights["layers.0.ffn.gate.tid2eid"][ids])


def test_combine_sums_each_tokens_rows_in_expert_order(tmp_dir):
    """groups.combine: each token's top_k expert rows times their weights, summed (ascending expert id); rows of
    experts that did not run (another rank's) are zero and add nothing."""
    _, cfg, weights = build("B", tmp_dir)
    ids = prompt(50, cfg.vocab_size)
    streams = M.embed(cfg, ids, weights["embed.weight"])
    routing = M.moe_route(cfg, 1, M.layer_weights(weights, 1), streams, ids)
    groups = routing.groups()
    outputs = torch.randn(groups.token_index.numel(), cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    skipped = next(iter(groups.spans))
    a, b = groups.spans[skipped]
    outputs[a:b] = 0
    want = torch.zeros(50, cfg.hidden_size, dtype=torch.float64)
    for expert, (a, b) in groups.spans.items():
        want.index_add_(0, groups.token_index[a:b], outputs[a:b].double() * groups.weight[a:b, None].double())
    got = groups.combine(outputs, 50)
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, atol=1e-6)
    assert torch.allclose(groups.combine(outputs.bfloat16(), 50).double(), want, atol=2e-2)
    for t in range(50):  # each token's rows ascending, their experts its chosen ones
        rows = groups.token_rows[t]
        assert torch.all(rows[1:] > rows[:-1]) and torch.all(groups.token_index[rows] == t)


def test_query_chunk_does_not_change_results(tmp_dir):
    _, cfg, weights = build("A", tmp_dir)
    ids = prompt(150, cfg.vocab_size, seed=3)
    whole, whole_states = M.forward_resident(cfg, weights, ids, query_chunk=None, return_kv_state=True)
    for chunk in (1, 5, 16, 64, 149):
        logits, states = M.forward_resident(cfg, weights, ids, query_chunk=chunk, return_kv_state=True)
        err, scale = max_error(logits, whole)
        ERRORS[f"A N=150 chunk={chunk} vs unchunked"] = f"{err / scale:.1e}"
        assert err <= 1e-5 * scale
        torch.testing.assert_close(states[3].indexer.compressed_kv, whole_states[3].indexer.compressed_kv)


def _ablations(cfg: ModelConfig):
    """(what, {weight: edit}, config edits): each breaks one component."""
    zero, one, negate = torch.zeros_like, torch.ones_like, torch.neg

    def other_experts(t):
        return (t + 1) % cfg.n_routed_experts

    yield "indexer query", {"layers.1.attn.indexer.wq_b.weight": zero}, {}
    yield "indexer head weights", {"layers.3.attn.indexer.weights_proj.weight": negate}, {}
    yield "indexer compressor ape", {"layers.1.attn.indexer.compressor.ape": zero}, {}
    yield "CSA compressor gate", {"layers.1.attn.compressor.wgate.weight": zero}, {}
    yield "CSA compressor ape", {"layers.3.attn.compressor.ape": zero}, {}
    yield "HCA compressor ape", {"layers.2.attn.compressor.ape": zero}, {}
    yield "HCA compressor norm", {"layers.4.attn.compressor.norm.weight": one}, {}
    yield "attention sink", {"layers.0.attn.attn_sink": zero}, {}
    yield "q norm", {"layers.2.attn.q_norm.weight": one}, {}
    yield "mHC base", {"layers.0.hc_attn_base": zero}, {}
    yield "mHC scale", {"layers.3.hc_ffn_scale": one}, {}
    yield "mHC head", {"hc_head_fn": negate}, {}
    yield "router correction bias", {"layers.2.ffn.gate.bias": zero}, {}
    yield "tid2eid", {"layers.0.ffn.gate.tid2eid": other_experts}, {}
    yield "shared expert", {"layers.1.ffn.shared_experts.w2.weight": zero}, {}
    yield "SwiGLU clamp", {}, {"swiglu_limit": 1e4}
    yield "YaRN", {}, {"compress_rope": dataclasses.replace(cfg.compress_rope, scaling="default")}
    yield "Sinkhorn", {}, {"hc_sinkhorn_iters": 1}
    yield "sliding window", {}, {"sliding_window": cfg.sliding_window // 2}
    yield "index top-k", {}, {"index_topk": 10_000}
    yield "routed scaling", {}, {"routed_scaling_factor": 1.0}


def test_every_component_is_visible(tmp_dir):
    """Break one component at a time in our weights/config: the comparison with transformers must fail by far,
    so a bug there could not hide behind the tolerance."""
    hf_model, cfg, weights = build("A", tmp_dir)
    ids = prompt(301, cfg.vocab_size)
    ref, _ = reference(hf_model, ids)
    for what, weight_edits, config_edits in _ablations(cfg):
        broken = {**weights, **{key: edit(weights[key]) for key, edit in weight_edits.items()}}
        logits = M.forward_resident(dataclasses.replace(cfg, **config_edits), broken, ids, query_chunk=64)
        err, scale = max_error(logits, ref)
        assert err > 10 * REL_TOL * scale, what


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_long_prompt_memory_is_not_quadratic(tmp_dir):
    hf_model, cfg, weights = build("long", tmp_dir)
    ids = prompt(2048, cfg.vocab_size)
    largest = {}
    for n, chunk in ((1024, 256), (2048, 256), (1024, None), (2048, None)):
        with LargestTensor() as probe:
            logits = M.forward_resident(cfg, weights, ids[:n], query_chunk=chunk)
        largest[n, chunk] = probe.numel
        if (n, chunk) == (2048, 256):
            ref, _ = reference(hf_model, ids)
            err, scale = max_error(logits, ref)
            ERRORS["long N=2048 chunk=256"] = f"{err:.2e} / {scale:.2f} = {err / scale:.1e}"
            assert err <= REL_TOL * scale
    # Chunked, the largest tensor grows linearly with N (it is the indexer's [chunk, index heads, N / rate]
    # scores), within chunk x N x heads. Without a query_chunk the attention still runs in chunks of a few sliding
    # windows (model.SLIDING_CHUNK_WINDOWS): no heads x N x N scores either.
    assert largest[2048, 256] <= 2.2 * largest[1024, 256]
    assert largest[2048, None] <= 2.2 * largest[1024, None] < cfg.num_heads * 1024 * 1024
    assert largest[2048, 256] <= 256 * 2048 * max(cfg.num_heads, cfg.index_n_heads) / 4
    ERRORS["long largest tensor (numel)"] = str(largest)


def test_config_from_hf():
    """V4-Flash as its config.json may spell it (legacy keys) and as transformers normalises it."""
    flash = dict(num_hidden_layers=43, compress_ratios=[0, 0] + [4, 128] * 20 + [0, 0], num_hash_layers=3,
                 qk_rope_head_dim=64, rope_scaling={"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                                                    "original_max_position_embeddings": 65536})
    hf = DeepseekV4Config(**flash)
    cfg = ModelConfig.from_hf(flash)
    assert cfg == ModelConfig.from_hf(hf.to_dict())
    assert cfg.layer_types[:4] == (S, S, C, H) and cfg.layer_types[-1] == S and len(cfg.layer_types) == 43
    assert cfg.compress_rates[:4] == (0, 0, 4, 128) and cfg.hash_layers[:4] == (True, True, True, False)
    assert cfg.main_rope.dim == cfg.compress_rope.dim == 64 and cfg.compress_rope.scaling == "yarn"
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    rotary = DeepseekV4RotaryEmbedding(hf)
    torch.testing.assert_close(cfg.compress_rope.inv_freq(), rotary.compress_inv_freq, rtol=0, atol=0)
    torch.testing.assert_close(cfg.main_rope.inv_freq(), rotary.main_inv_freq, rtol=0, atol=0)
    assert cfg.compress_rope.attention_factor == rotary.compress_attention_scaling == 1.0


LINEAR_ROPES = {"flat": {"rope_type": "linear", "factor": 2.0},  # the compressed layers' RoPE
                "nested": {"main": {"rope_type": "linear", "factor": 3.0, "rope_theta": 1e4},
                           "compress": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1.6e5}}}


@pytest.mark.parametrize("form", LINEAR_ROPES)
def test_a_linear_rope_gives_transformers_frequencies_and_logits(tmp_path, form):
    """transformers runs a linear-scaled RoPE (every frequency divided by factor) on either rope; it had been
    refused (rope_type must be one of default, yarn)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    from moepack.packer.convert import convert_checkpoint
    from moepack.runtime.engine import PrefillOptions, prefill

    config = {**CONFIGS["B"], "layer_types": [S, C, H, C], "rope_parameters": LINEAR_ROPES[form]}
    hf_model = saved_model(config, 5, str(tmp_path / "src"))
    cfg = ModelConfig.from_hf(hf_model.config.to_dict())
    rotary = DeepseekV4RotaryEmbedding(hf_model.config)
    torch.testing.assert_close(cfg.compress_rope.inv_freq(), rotary.compress_inv_freq, rtol=0, atol=0)
    torch.testing.assert_close(cfg.main_rope.inv_freq(), rotary.main_inv_freq, rtol=0, atol=0)
    convert_checkpoint(str(tmp_path / "src"), str(tmp_path / "m.moepack"), progress=False)
    ids = torch.randint(0, config["vocab_size"], (40,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0, -1]
    got = prefill(str(tmp_path / "m.moepack"), ids, PrefillOptions()).logits
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_rope_rotates_each_channel_pair_by_its_positions_angle():
    """apply_rope against the rotation written out: channels (2i, 2i+1) of the rope part turn by position x
    inv_freq[i] (YaRN frequencies too), the rest of the head is untouched, and the conjugate turns them back."""
    rope = RopeConfig(dim=8, theta=160000.0, scaling="yarn", factor=16.0, original_max_position_embeddings=4096)
    x = torch.randn(5, 3, 12, dtype=torch.float32)
    rotation = M.rope_rotation(rope, 7, 5, 4)  # positions 7, 11, ..., 23
    angles = (torch.arange(5) * 4 + 7)[:, None, None].double() * rope.inv_freq().double()
    even, odd = x[..., 4::2].double(), x[..., 5::2].double()
    want = x.double().clone()
    want[..., 4::2] = even * angles.cos() - odd * angles.sin()
    want[..., 5::2] = odd * angles.cos() + even * angles.sin()
    got = M.apply_rope(x, rotation)
    assert torch.equal(got[..., :4], x[..., :4]) and torch.allclose(got.double(), want, atol=1e-5)
    assert torch.allclose(M.apply_rope(got, rotation.conj()), x, atol=1e-5)
    assert M.rope_rotation(rope, 7, 5, 4) is rotation  # cached: every layer rotates the same positions
    assert M.apply_rope(x[:0], M.rope_rotation(rope, 0, 0)).shape == (0, 3, 12)  # no tokens: nothing to turn


# (config, query chunk): a CSA layer whose wide head and large top-k over few heads make its gathered entries
# outgrow the scores; a sliding layer of many heads whose chunk of 128 queries (a CPU's least) scores 131 keys a
# query, not its window's 4
_WORKING_SET_CASES = {
    "csa-gathered": (dict(layer_types=[C], compress_rates={C: 4}, head_dim=128, partial_rotary_factor=0.125,
                          index_topk=64), 64),
    "sliding-chunk": (dict(layer_types=[S], compress_rates={}, num_attention_heads=16, sliding_window=4,
                           index_topk=4, head_dim=16), 128),
}


@pytest.mark.parametrize("case", sorted(_WORKING_SET_CASES))
def test_the_working_set_counts_a_chunks_largest_tensor(tmp_path, case):
    """The memory estimate that refuses a long prompt must count what a query chunk's attention holds: a CSA chunk
    gathers index_topk entries of head_dim per query ([chunk, k, D]), and a chunk scores its sliding keys for every
    query of it, the masked ones too ([chunk, heads, chunk + window - 1]). The largest tensor a chunked forward
    makes fits in the estimate's attention_chunk."""
    config = {**CONFIGS["long"], "num_hidden_layers": 1, "mlp_layer_types": ["moe"], "max_position_embeddings": 4096,
              **_WORKING_SET_CASES[case][0]}
    saved_model(config, 1, str(tmp_path))
    weights = {from_transformers(k): t for k, t in load_file(str(tmp_path / "model.safetensors")).items()}
    cfg = ModelConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    n, chunk = 400, _WORKING_SET_CASES[case][1]
    with LargestTensor() as probe:
        M.forward_resident(cfg, weights, prompt(n, cfg.vocab_size), query_chunk=chunk)
    estimate = M.DeepseekV4Prefill(cfg, torch.float32).working_set(n, chunk, torch.device("cpu"))
    assert probe.numel * 4 <= estimate["attention_chunk"], (probe.numel * 4, estimate)
