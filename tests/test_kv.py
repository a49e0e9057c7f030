"""The KV hand-off (format_spec/KV.md): writer, validating reader, continuation, transformers' Cache from a KV.

The oracle is transformers' DeepseekV4ForCausalLM on the random models of v4_models.py: greedy generation from
moepack's KV (written through KVWriter, read back) must equal transformers' own greedy generation from the prompt,
token for token, and a prefill continued from a KV must equal a single prefill of the whole prompt.
"""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
import v4_models  # noqa: E402
from v4_models import CONFIGS  # noqa: E402

from moepack.backends import token_kernels  # noqa: E402
from moepack.families.deepseek_v4 import kv as K  # noqa: E402
from moepack.families.deepseek_v4 import model as M  # noqa: E402
from moepack.families.deepseek_v4.config import CSA as C  # noqa: E402
from moepack.families.deepseek_v4.config import HCA as H  # noqa: E402
from moepack.families.deepseek_v4.config import ModelConfig  # noqa: E402
from moepack.families.deepseek_v4.config import SLIDING as S  # noqa: E402
from moepack.families.deepseek_v4.token_layer import TokenLayers  # noqa: E402
from moepack.format_spec.errors import FormatError, MoepackError  # noqa: E402
from moepack.kv import continuation_input_ids, load_transformers_cache  # noqa: E402
FLASH_CONFIG = os.path.join(os.path.dirname(__file__), "data", "deepseek-v4-flash.config.json")


def _flash_config() -> dict:
    """The release's config.json (tests/data)."""
    with open(FLASH_CONFIG) as f:
        return json.load(f)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: one intra-op thread is fastest, and immune to a loaded machine's oversubscription."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (transformers model, ModelConfig, weights). v4_models caches built models by name only, and other
    modules expect the saved checkpoint in their own directory: forget the ones built here afterwards."""
    out = str(tmp_path_factory.mktemp("kv-models"))
    before = dict(v4_models._BUILT)
    yield lambda name: v4_models.build(name, out)
    v4_models._BUILT.clear()
    v4_models._BUILT.update(before)


def _prompt(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(7919 * seed + n))


def _identity(hf_model) -> dict:
    return K.make_identity("deepseek_v4", hf_model.config.to_dict(), container_index_xxh3=0x1234ABCD)


def _write(kv_dir, hf_model, ids, states, logits=None, dtype="F32", start_token=0):
    writer = K.KVWriter(str(kv_dir), _identity(hf_model), ids, dtype=dtype, start_token=start_token)
    for layer, state in enumerate(states):
        writer.write_layer(layer, state)
    if logits is not None:
        writer.finish(next_token=int(logits.argmax()), logits=logits)
    return writer


def _prefill_to_disk(kv_dir, models, name, ids, dtype="F32"):
    hf_model, cfg, weights = models(name)
    logits, states = M.forward_resident(cfg, weights, ids, query_chunk=16, return_kv_state=True)
    _write(kv_dir, hf_model, ids, states, logits[-1], dtype)
    return logits, states


def _same_state(a: K.LayerKVState, b: K.LayerKVState, atol: float = 0.0, rtol: float = 0.0) -> None:
    assert a.layer_type == b.layer_type and a.seen_tokens == b.seen_tokens
    ta, tb = a.tensors(), b.tensors()
    assert list(ta) == list(tb)
    for name in ta:
        assert ta[name].shape == tb[name].shape, name
        torch.testing.assert_close(ta[name], tb[name], atol=atol, rtol=rtol, msg=name)
    for part in ("compressor", "indexer"):
        pa, pb = getattr(a, part), getattr(b, part)
        assert (pa is None) == (pb is None)
        if pa is not None:
            assert pa.entry_count == pb.entry_count


# ---------------------------------------------------------------------------------------------------------------
# transformers continues from moepack's KV
# ---------------------------------------------------------------------------------------------------------------

# (config, N): every N leaves a partial window in some compressor; A-37, B-41 and C-70 have more CSA entries than
# index_topk and pass the sliding window; A-7 / B-5 have no HCA entry yet; C-64 ends exactly on window boundaries.
GENERATE = [("A", 7), ("A", 37), ("B", 5), ("B", 41), ("C", 20), ("C", 64), ("C", 70)]
NEW_TOKENS = 16


@pytest.mark.parametrize("name,n", GENERATE, ids=[f"{c}-N{n}" for c, n in GENERATE])
def test_transformers_generation_from_moepack_kv(models, tmp_path, name, n):
    hf_model, cfg, _ = models(name)
    ids = _prompt(n, cfg.vocab_size)
    with torch.no_grad():
        expected = hf_model.generate(ids[None], attention_mask=torch.ones(1, n, dtype=torch.long),
                                     max_new_tokens=NEW_TOKENS, do_sample=False)[0, n:].tolist()
    _prefill_to_disk(tmp_path / "kv", models, name, ids)

    cache = load_transformers_cache(tmp_path / "kv", hf_model, expect_prompt=ids)
    assert cache.get_seq_length() == n
    inputs = continuation_input_ids(tmp_path / "kv")  # the prompt and the prefill's greedy token
    assert inputs.shape == (1, n + 1)
    with torch.no_grad():
        out = hf_model.generate(inputs, attention_mask=torch.ones_like(inputs), cache=cache,
                                max_new_tokens=NEW_TOKENS - 1, do_sample=False)
    assert out[0, n:].tolist() == expected
    assert len(expected) == NEW_TOKENS


def test_first_decode_step_logits_match(models, tmp_path):
    """Finer than token equality: transformers' logits for the prefill's next token, from moepack's KV, equal its
    logits from its own cache."""
    hf_model, cfg, _ = models("A")
    ids = _prompt(45, cfg.vocab_size, seed=2)
    logits, _ = _prefill_to_disk(tmp_path / "kv", models, "A", ids)
    step = torch.tensor([[int(logits[-1].argmax())]])
    with torch.no_grad():
        own = hf_model(ids[None], use_cache=True)
        ref = hf_model(step, cache=own.cache).logits[0, -1]
        ours = hf_model(step, cache=load_transformers_cache(tmp_path / "kv", hf_model)).logits[0, -1]
    torch.testing.assert_close(ours, ref, atol=1e-4 * ref.abs().max().item(), rtol=0)


def test_kv_of_another_shape_is_refused_by_transformers(models, tmp_path):
    hf_a, cfg_a, _ = models("A")
    hf_b, _, _ = models("B")
    _prefill_to_disk(tmp_path / "kv", models, "A", _prompt(9, cfg_a.vocab_size))
    with pytest.raises(FormatError, match="another model"):
        load_transformers_cache(tmp_path / "kv", hf_b)
    with pytest.raises(FormatError, match="prompt mismatch"):
        load_transformers_cache(tmp_path / "kv", hf_a, expect_prompt=_prompt(10, cfg_a.vocab_size))


# ---------------------------------------------------------------------------------------------------------------
# Continuation: prefill(A) then continue(B) == prefill(A + B)
# ---------------------------------------------------------------------------------------------------------------

# (config, len A, len B). A: CSA 4 / HCA 16 / window 16; B: CSA 3 / HCA 8 / window 8; C: CSA 4 / HCA 32 / window 64.
# Splits inside CSA, HCA and sliding windows, at window boundaries, one-token chunks (B=1 is a decode step).
SPLITS = [("A", 1, 40), ("A", 6, 31), ("A", 17, 20), ("A", 32, 1), ("A", 35, 9), ("B", 4, 37), ("B", 9, 16),
          ("B", 23, 2), ("B", 24, 5), ("C", 30, 41), ("C", 64, 6), ("C", 67, 3)]


@pytest.mark.parametrize("name,a,b", SPLITS, ids=[f"{c}-{a}+{b}" for c, a, b in SPLITS])
def test_continuation_equals_single_prefill(models, name, a, b):
    hf_model, cfg, weights = models(name)
    ids = _prompt(a + b, cfg.vocab_size, seed=1)
    whole, whole_states = M.forward_resident(cfg, weights, ids, query_chunk=16, return_kv_state=True)
    _, first = M.forward_resident(cfg, weights, ids[:a], query_chunk=7, return_kv_state=True)
    cont, states = M.forward_resident(cfg, weights, ids[a:], query_chunk=5, return_kv_state=True, past_states=first)
    scale = whole.abs().max().item()
    torch.testing.assert_close(cont, whole[a:], atol=1e-5 * scale, rtol=0)
    for ours, ref in zip(states, whole_states):
        _same_state(ours, ref, atol=2e-5, rtol=1e-4)
    with torch.no_grad():  # transformers as the oracle for the last position
        ref = hf_model(ids[None]).logits[0, -1]
    torch.testing.assert_close(cont[-1], ref, atol=1e-3 * ref.abs().max().item(), rtol=0)


def _token_forward(cfg, weights, layers: list[dict], token_id: int, kvs: list[M.TokenKV],
                   compiled: TokenLayers | None) -> torch.Tensor:
    """One decoded token through every layer with resident weights, as runtime/decode.py's Decoder runs it over a
    container: by `compiled` (TokenLayers over `layers`) where given, else by model.py's functions. Its logits."""
    ids = torch.tensor([token_id])
    if compiled is not None:
        compiled.begin(weights["embed.weight"][ids])
        for layer, w in enumerate(layers):
            compiled.attention(layer, kvs[layer])
            chosen = compiled.route(layer, w["ffn.gate.tid2eid"][token_id].tolist() if cfg.hash_layers[layer]
                                    else None)
            compiled.finish(layer, [tuple(token_kernels.float_matrix(w[f"ffn.experts.{e}.{m}.weight"])
                                          for m in ("w1", "w3", "w2")) for e in chosen], 0)
        return M.head(cfg, compiled.output, weights, -1)
    streams = M.embed(cfg, ids, weights["embed.weight"])
    for layer, w in enumerate(layers):
        streams = M.attention_token_sublayer(cfg, layer, w, streams, kvs[layer])
        routing = M.moe_route(cfg, layer, w, streams, ids)
        routed = torch.zeros(1, cfg.hidden_size)
        for e, weight in sorted(zip(routing.experts[0].tolist(), routing.weights[0])):
            routed += weight * M.expert_forward(cfg, routing.x, *(w[f"ffn.experts.{e}.{m}.weight"]
                                                                  for m in ("w1", "w3", "w2")))
        streams = M.moe_finish(cfg, layer, w, streams, routing, routed)
    return M.head(cfg, streams, weights, -1)


# (config, prompt, decoded tokens): B decodes past 64 new CSA entries (the entries' rows grow) and many sliding
# windows (the window's rows move to the front); A and C cross HCA windows and the indexer's top-k.
TOKEN_STEPS = [("A", 5, 60), ("B", 3, 200), ("C", 40, 40)]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize("name,a,b", TOKEN_STEPS, ids=[f"{c}-{a}+{b}" for c, a, b in TOKEN_STEPS])
def test_token_attention_equals_the_prefill(models, monkeypatch, name, a, b, compiled):
    """One decoded token at a time over a TokenKV (families/deepseek_v4/token_layer.py's compiled calls, or model.py's
    torch path) gives the logits of a single prefill of the whole sequence at every step, and ends in its KV."""
    if not compiled:
        monkeypatch.setattr(token_kernels, "token_kernels", lambda: None)
    _, cfg, weights = models(name)
    ids = _prompt(a + b, cfg.vocab_size, seed=3)
    whole, whole_states = M.forward_resident(cfg, weights, ids, query_chunk=16, return_kv_state=True)
    _, states = M.forward_resident(cfg, weights, ids[:a], return_kv_state=True)
    kvs = [M.TokenKV(cfg, layer, state, torch.float32) for layer, state in enumerate(states)]
    layers = [M.layer_weights(weights, layer) for layer in range(cfg.num_layers)]
    fast = TokenLayers.make(cfg, layers)
    assert (fast is not None) == (compiled and token_kernels.token_kernels() is not None)
    scale = whole.abs().max().item()
    for step, token in enumerate(ids[a:].tolist()):
        logits = _token_forward(cfg, weights, layers, token, kvs, fast)
        torch.testing.assert_close(logits, whole[a + step], atol=2e-5 * scale, rtol=0, msg=f"step {step}")
    for kv, ref in zip(kvs, whole_states):
        _same_state(kv.state(), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
def test_a_decoded_layer_whose_output_is_not_finite_is_named(models, monkeypatch, compiled):
    """A KV continued with an infinity in layer 1's window: the decoded token stops at layer 1, in one line."""
    if not compiled:
        monkeypatch.setattr(token_kernels, "token_kernels", lambda: None)
    _, cfg, weights = models("A")
    ids = _prompt(6, cfg.vocab_size, seed=5)
    _, states = M.forward_resident(cfg, weights, ids[:5], return_kv_state=True)
    states[1].window_kv[-1, 0] = float("inf")
    kvs = [M.TokenKV(cfg, layer, state, torch.float32) for layer, state in enumerate(states)]
    layers = [M.layer_weights(weights, layer) for layer in range(cfg.num_layers)]
    with pytest.raises(MoepackError, match=r"^layer 1: its output is not finite"):
        _token_forward(cfg, weights, layers, int(ids[5]), kvs, TokenLayers.make(cfg, layers))


def test_compiled_layers_are_refused_for_weights_they_do_not_take(models):
    """TokenLayers.make gives None (decode then runs model.py's functions) for a layer whose weights are not what
    its fixed buffers and kernels take: another shape, another dtype, a missing shared expert."""
    if token_kernels.token_kernels() is None:
        pytest.skip("no compiled token kernels on this machine")
    _, cfg, weights = models("A")
    layers = [M.layer_weights(weights, layer) for layer in range(cfg.num_layers)]
    assert TokenLayers.make(cfg, layers) is not None
    for name, change in [("attn.wo_b.weight", lambda t: t[:, :-1].contiguous()),
                         ("attn.wq_a.weight", lambda t: t[:-1].contiguous()),
                         ("attn.wq_b.weight", lambda t: t.half()),
                         ("ffn.gate.weight", lambda t: t.bfloat16()),
                         ("ffn.shared_experts.w2.weight", None)]:
        changed = [dict(w) for w in layers]
        if change is None:
            del changed[1][name]
        else:
            changed[1][name] = change(changed[1][name])
        assert TokenLayers.make(cfg, changed) is None, name


def test_compiled_layers_keep_float32_buffers_and_refuse_a_state_of_other_widths(models):
    """The fixed buffers are float32 whatever torch's default dtype (a script may set bfloat16: half-size buffers
    would be overrun), and a KV state whose rows are not the model's widths is refused before a kernel writes."""
    if token_kernels.token_kernels() is None:
        pytest.skip("no compiled token kernels on this machine")
    _, cfg, weights = models("A")
    layers = [M.layer_weights(weights, layer) for layer in range(cfg.num_layers)]
    ids = _prompt(6, cfg.vocab_size, seed=4)
    whole = M.forward_resident(cfg, weights, ids)
    _, states = M.forward_resident(cfg, weights, ids[:5], return_kv_state=True)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        fast = TokenLayers.make(cfg, layers)
    finally:
        torch.set_default_dtype(before)
    assert all(t.dtype == torch.float32 for t in (*fast.streams, fast.x, fast.q_lora, fast.o, fast.moe_out))
    kvs = [M.TokenKV(cfg, layer, state, torch.float32) for layer, state in enumerate(states)]
    torch.testing.assert_close(_token_forward(cfg, weights, layers, int(ids[5]), kvs, fast), whole[5],
                               atol=2e-5 * whole.abs().max().item(), rtol=0)
    wide = M.TokenKV(cfg, 0, states[0], torch.float32)
    wide.window = M.GrowingRows(torch.zeros(3, cfg.head_dim + 2), keep=cfg.sliding_window - 1)
    fast.begin(weights["embed.weight"][ids[:1]])
    with pytest.raises(ValueError, match="widths"):
        fast.attention(0, wide)


def test_growing_rows_keep_what_was_appended():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(300, 6, generator=gen)
    grown, window = M.GrowingRows(rows[:3], low=torch.bfloat16), M.GrowingRows(rows[:3], keep=5)
    for n in range(3, 300):
        grown.append(rows[n:n + 1])
        window.append(rows[n:n + 1])
        assert torch.equal(window.rows(), rows[max(0, n - 4):n + 1])
        assert torch.equal(window.mirror(6), rows[max(0, n - 5):n + 1])  # the last `keep` + 1: a token's keys
    assert torch.equal(grown.rows(), rows) and grown.count == 300
    assert torch.equal(grown.mirror(), rows.bfloat16().float())


def test_splits_cover_every_window_case(models):
    """Every compress rate of every configuration is split inside a window and exactly at a window boundary (after
    at least one full window), and the first chunk passes the sliding window."""
    for name in ("A", "B", "C"):
        _, cfg, _ = models(name)
        firsts = [a for c, a, _ in SPLITS if c == name]
        for rate in {r for r in cfg.compress_rates if r}:
            assert any(a % rate for a in firsts) and any(a % rate == 0 and a >= rate for a in firsts)
        assert any(a > cfg.sliding_window for a in firsts)


def test_multi_turn_through_disk_then_transformers_decodes(models, tmp_path):
    """Three prompt chunks, each continuing the KV read back from disk (the --continue-from flow), then transformers
    generates from the last KV exactly as from the whole prompt."""
    hf_model, cfg, weights = models("B")
    ids = _prompt(50, cfg.vocab_size, seed=5)
    cuts = [0, 11, 30, 50]
    identity = _identity(hf_model)
    past, kv_dir = None, None
    for turn, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        if kv_dir is not None:
            kv = K.read_kv(kv_dir, expect_identity=identity, prompt_prefix_of=ids[:hi])
            assert kv.new_tokens(ids[:hi]) == ids[lo:hi].tolist()
            past = kv.layers
        logits, states = M.forward_resident(cfg, weights, ids[lo:hi], query_chunk=8, return_kv_state=True,
                                            past_states=past)
        kv_dir = str(tmp_path / f"turn{turn}")
        writer = K.KVWriter(kv_dir, identity, ids[:hi], start_token=lo)
        for layer, state in enumerate(states):
            writer.write_layer(layer, state)
        writer.finish(next_token=int(logits[-1].argmax()), logits=logits[-1])
    assert K.inspect_kv(kv_dir)["start_token"] == 30
    with torch.no_grad():
        expected = hf_model.generate(ids[None], attention_mask=torch.ones(1, 50, dtype=torch.long),
                                     max_new_tokens=NEW_TOKENS, do_sample=False)[0, 50:].tolist()
        inputs = continuation_input_ids(kv_dir)
        out = hf_model.generate(inputs, attention_mask=torch.ones_like(inputs),
                                cache=load_transformers_cache(kv_dir, hf_model), max_new_tokens=NEW_TOKENS - 1,
                                do_sample=False)
    assert out[0, 50:].tolist() == expected


def test_bad_continuations(models):
    _, cfg, weights = models("A")
    ids = _prompt(12, cfg.vocab_size)
    _, states = M.forward_resident(cfg, weights, ids, return_kv_state=True)
    w = M.layer_weights(weights, 1)
    streams = M.embed(cfg, ids[:3], weights["embed.weight"])
    with pytest.raises(ValueError, match="arange"):
        M.attention_sublayer(cfg, 1, w, streams, torch.arange(3), past=states[1])
    with pytest.raises(ValueError, match="past state of a"):
        M.attention_sublayer(cfg, 1, w, streams, torch.arange(12, 15), past=states[2])
    with pytest.raises(ValueError, match="one state per layer"):
        M.forward_resident(cfg, weights, ids[:3], past_states=states[:2])


# ---------------------------------------------------------------------------------------------------------------
# Format: round trip, dtypes, layer-wise writes
# ---------------------------------------------------------------------------------------------------------------


def test_round_trip_every_field(models, tmp_path):
    hf_model, cfg, _ = models("A")
    ids = _prompt(37, cfg.vocab_size)
    logits, states = _prefill_to_disk(tmp_path / "kv", models, "A", ids)
    kv = K.read_kv(str(tmp_path / "kv"), expect_identity=_identity(hf_model), expect_prompt=ids)
    assert kv.token_ids == ids.tolist() and kv.start_token == 0 and kv.dtype == "F32" and kv.complete
    assert kv.identity["container_index_xxh3"] == "000000001234abcd"
    assert kv.identity["config"] == json.loads(json.dumps(hf_model.config.to_dict()))
    assert kv.next_token == int(logits[-1].argmax()) and torch.equal(kv.logits, logits[-1])
    assert len(kv.layers) == cfg.num_layers
    for ours, written in zip(kv.layers, states):
        _same_state(ours, written)  # bit-exact
    kinds = [s.layer_type for s in kv.layers]
    assert kinds == [S, C, H, C, H]
    csa, hca = kv.layers[1], kv.layers[2]
    assert csa.compressor.overlap_kv.shape == (4, cfg.head_dim) and csa.indexer.overlap_gate.shape == (4, 16)
    assert csa.compressor.buffer_kv.shape == (1, 2 * cfg.head_dim) and hca.compressor.buffer_gate.shape == (5, 32)
    assert hca.compressor.overlap_kv is None and kv.layers[0].compressor is None
    # The files are plain safetensors, self-describing.
    with safe_open(str(tmp_path / "kv" / "layer-0001.safetensors"), "pt") as f:
        meta = f.metadata()
        assert meta["layer_type"] == C and meta["seen_tokens"] == "37" and meta["compressor.entry_count"] == "9"
        assert set(f.keys()) == set(csa.tensors())
    assert sorted(os.listdir(tmp_path / "kv")) == sorted(
        [K.MANIFEST_NAME, K.LOGITS_NAME] + [K.layer_file_name(i) for i in range(5)])
    # Exact tensor bytes are what kv_bytes predicts.
    assert sum(s.nbytes() for s in states) == K.kv_bytes(hf_model.config.to_dict(), 37)


@pytest.mark.parametrize("dtype,tol", [("BF16", 2 ** -8), ("F8_E4M3", 2 ** -3)])
def test_reduced_precision_round_trip_records_dtype(models, tmp_path, dtype, tol):
    hf_model, cfg, _ = models("A")
    ids = _prompt(37, cfg.vocab_size)
    _, states = _prefill_to_disk(tmp_path / "kv", models, "A", ids, dtype=dtype)
    kv = K.read_kv(str(tmp_path / "kv"))
    assert kv.dtype == dtype and K.inspect_kv(str(tmp_path / "kv"))["dtype"] == dtype
    with safe_open(str(tmp_path / "kv" / "layer-0001.safetensors"), "pt") as f:
        assert f.metadata()["dtype"] == dtype
        assert f.get_tensor("compressor.compressed_kv").dtype == K._TORCH_DTYPES[dtype]
        assert f.get_tensor("compressor.buffer_gate").dtype == torch.float32  # working state stays F32
    for ours, written in zip(kv.layers, states):
        for name, t in ours.tensors().items():
            ref = written.tensors()[name]
            assert t.dtype == torch.float32 and t.shape == ref.shape
            if name in K._KV_TENSORS:
                if t.numel():
                    assert ((t - ref).abs() <= tol * ref.abs().amax(dim=-1, keepdim=True) + 1e-30).all(), name
                if dtype == "BF16":
                    torch.testing.assert_close(t, ref.to(torch.bfloat16).float(), rtol=0, atol=0)
            else:
                assert torch.equal(t, ref), name  # buffers and overlap are exact
    f32_bytes = K.kv_bytes(hf_model.config.to_dict(), 37, "F32")
    assert K.kv_bytes(hf_model.config.to_dict(), 37, dtype) < f32_bytes


def test_layers_are_readable_as_they_complete(models, tmp_path):
    """A consumer sees layer 0 complete (and loadable) while later layers are not written; no temp files stay."""
    hf_model, cfg, weights = models("A")
    ids = _prompt(20, cfg.vocab_size)
    _, states = M.forward_resident(cfg, weights, ids, return_kv_state=True)
    writer = K.KVWriter(str(tmp_path / "kv"), _identity(hf_model), ids)
    d = K.KVDirectory(str(tmp_path / "kv"))
    assert d.incomplete_layers() == [0, 1, 2, 3, 4] and not d.manifest["complete"]
    writer.write_layer(2, states[2])  # any order
    writer.write_layer(0, states[0])
    d.refresh()
    assert d.layer_complete(0) and d.layer_complete(2) and not d.layer_complete(1)
    _same_state(d.layer(2), states[2])
    with pytest.raises(FormatError, match="layer 1 is not complete"):
        d.layer(1)
    with pytest.raises(FormatError, match=r"KV incomplete: layers 1, 3\.\.4 of 5 not written"):
        K.read_kv(str(tmp_path / "kv"))
    report = K.inspect_kv(str(tmp_path / "kv"))
    assert report["layers_complete"] == 2 and report["incomplete_layers"] == "1, 3..4" and not report["complete"]
    assert not [n for n in os.listdir(tmp_path / "kv") if n.endswith(".partial")]


def test_writer_is_thread_safe_and_background_writer(models, tmp_path):
    hf_model, cfg, weights = models("C")
    ids = _prompt(70, cfg.vocab_size)
    logits, states = M.forward_resident(cfg, weights, ids, return_kv_state=True)
    writer = K.KVWriter(str(tmp_path / "threads"), _identity(hf_model), ids, sync=False)
    threads = [threading.Thread(target=writer.write_layer, args=(i, s)) for i, s in enumerate(states)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.finish(next_token=3)
    kv = K.read_kv(str(tmp_path / "threads"))
    assert kv.complete and kv.next_token == 3 and kv.logits is None
    for ours, ref in zip(kv.layers, states):
        _same_state(ours, ref)

    background = K.BackgroundKVWriter(K.KVWriter(str(tmp_path / "bg"), _identity(hf_model), ids), max_pending=2)
    for layer, state in enumerate(states):
        background(layer, state)  # usable as the engine's on_layer_kv
    background.finish(next_token=int(logits[-1].argmax()), logits=logits[-1])
    assert background.write_seconds > 0
    for ours, ref in zip(K.read_kv(str(tmp_path / "bg")).layers, states):
        _same_state(ours, ref)

    failing = K.BackgroundKVWriter(K.KVWriter(str(tmp_path / "bad"), _identity(hf_model), ids))
    failing.submit(0, states[1])  # a CSA state for the sliding layer 0: the writer thread fails
    with pytest.raises(MoepackError, match="layer 0: state of a heavily_compressed_attention layer"):
        failing.finish()


def test_writer_refusals(models, tmp_path):
    hf_model, cfg, weights = models("A")
    ids = _prompt(10, cfg.vocab_size)
    _, states = M.forward_resident(cfg, weights, ids, return_kv_state=True)
    writer = K.KVWriter(str(tmp_path / "kv"), _identity(hf_model), ids)
    writer.write_layer(0, states[0])
    with pytest.raises(MoepackError, match="written twice"):
        writer.write_layer(0, states[0])
    with pytest.raises(MoepackError, match="config says"):
        writer.write_layer(1, states[2])
    with pytest.raises(MoepackError, match="outside"):
        writer.write_layer(5, states[0])
    with pytest.raises(MoepackError, match=r"cannot finish, layers 1\.\.4 not written"):
        writer.finish()
    # one writer of a KV at a time, in this process too (a second one had removed the first one's new directory)
    with pytest.raises(MoepackError, match=r"another process is writing the KV in .*kv: wait for it to finish"):
        K.KVWriter(str(tmp_path / "kv"), _identity(hf_model), ids, overwrite=True)
    writer.abandon()
    with pytest.raises(MoepackError, match="already holds a KV"):
        K.KVWriter(str(tmp_path / "kv"), _identity(hf_model), ids)
    short = K.KVWriter(str(tmp_path / "kv2"), _identity(hf_model), ids[:5])
    with pytest.raises(MoepackError, match="covers 10 tokens"):
        short.write_layer(0, states[0])
    short.abandon()
    with pytest.raises(MoepackError, match="unknown KV dtype"):
        K.KVWriter(str(tmp_path / "kv3"), _identity(hf_model), ids, dtype="F16")
    replacing = K.KVWriter(str(tmp_path / "kv"), _identity(hf_model), ids, overwrite=True)
    assert K.KVDirectory(replacing.write_dir).incomplete_layers() == [0, 1, 2, 3, 4]  # the new one, beside
    assert K.KVDirectory(str(tmp_path / "kv")).incomplete_layers() == [1, 2, 3, 4]  # the old one, until finished
    replacing.abandon()
    assert sorted(os.listdir(tmp_path)) == ["kv", "kv2"]  # nothing left beside


# ---------------------------------------------------------------------------------------------------------------
# Damage
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture()
def kv_dir(models, tmp_path):
    _, cfg, _ = models("A")
    path = tmp_path / "kv"
    _prefill_to_disk(path, models, "A", _prompt(23, cfg.vocab_size))
    return path


def _refused(path, match, **kwargs):
    with pytest.raises(FormatError, match=match) as e:
        K.read_kv(str(path), **kwargs)
    assert "\n" not in str(e.value)
    return str(e.value)


def _edit_manifest(path, edit):
    m = json.loads((path / K.MANIFEST_NAME).read_text())
    edit(m)
    (path / K.MANIFEST_NAME).write_text(json.dumps(m))


def test_missing_layer_file(kv_dir):
    os.remove(kv_dir / "layer-0003.safetensors")
    msg = _refused(kv_dir, "layer 3: file layer-0003.safetensors is missing")
    assert msg.startswith(str(kv_dir))
    with pytest.raises(FormatError, match="is missing"):
        K.inspect_kv(str(kv_dir))
    assert K.inspect_kv(str(kv_dir), verify=False)["layers_complete"] == 5


def test_truncated_layer_file(kv_dir):
    f = kv_dir / "layer-0001.safetensors"
    size = f.stat().st_size
    os.truncate(f, size - 100)
    _refused(kv_dir, rf"layer 1: file layer-0001.safetensors is truncated \({size - 100} of {size} bytes\)")
    with open(f, "ab") as out:
        out.write(bytes(200))
    _refused(kv_dir, f"has {size + 100} bytes, the manifest records {size}")


def test_flipped_byte(kv_dir):
    f = kv_dir / "layer-0002.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x40
    f.write_bytes(bytes(data))
    _refused(kv_dir, r"layer 2: file layer-0002.safetensors is damaged \(xxh3 mismatch\)")
    logits = kv_dir / K.LOGITS_NAME
    logits.write_bytes(logits.read_bytes()[:-1] + b"\x00")
    f.write_bytes(bytes(data[:-5]) + bytes([data[-5] ^ 0x40]) + bytes(data[-4:]))
    _refused(kv_dir, "logits: file logits.safetensors is damaged")


def test_layer_file_consistent_with_manifest(kv_dir):
    """A readable file whose tensors do not fit the recorded counts (the manifest rehashed to match) is refused."""
    import xxhash

    def lie(m):
        m["layers"][1]["entries"]["compressor"] = 4

    _edit_manifest(kv_dir, lie)
    _refused(kv_dir, "does not fit 23 tokens")

    def swap(m):
        m["layers"][1]["entries"]["compressor"] = 5
        data = (kv_dir / "layer-0002.safetensors").read_bytes()
        (kv_dir / "layer-0001.safetensors").write_bytes(data)
        m["layers"][1].update(bytes=len(data), xxh3=xxhash.xxh3_64_hexdigest(data))

    _edit_manifest(kv_dir, swap)
    _refused(kv_dir, "tensors do not match the layer's kind")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_layer_file_holding_a_nan_or_an_infinity_is_refused(kv_dir, value):
    """A readable file whose size and xxh3 agree with the manifest (rehashed: a writer's bug or a hostile file)
    but whose compressor entries hold a NaN or an infinity: refused in one line naming the layer and the tensor,
    not carried into every decoded token (a NaN in the indexer's keys would change its picks unseen)."""
    import xxhash
    from safetensors.torch import load, save

    layer = kv_dir / "layer-0001.safetensors"
    tensors = load(layer.read_bytes())
    name = next(n for n in tensors if n.startswith("indexer.compressed_kv"))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[3] = value
    data = save(tensors)
    layer.write_bytes(data)
    _edit_manifest(kv_dir, lambda m: m["layers"][1].update(bytes=len(data), xxh3=xxhash.xxh3_64_hexdigest(data)))
    _refused(kv_dir, rf"layer 1 \(layer-0001.safetensors\): {name} holds a NaN or an infinity$")


def test_identity_mismatch(models, kv_dir):
    hf_a, _, _ = models("A")
    hf_b, _, _ = models("B")
    ok = _identity(hf_a)
    K.read_kv(str(kv_dir), expect_identity=ok)
    _refused(kv_dir, "KV from another model: config xxh3", expect_identity=_identity(hf_b))
    other_container = K.make_identity("deepseek_v4", hf_a.config.to_dict(), 0xFEED)
    _refused(kv_dir, "KV from another model: container index xxh3 000000001234abcd, expected 000000000000feed",
             expect_identity=other_container)
    _refused(kv_dir, "architecture", expect_identity=dict(ok, architecture="llama"))
    with pytest.raises(FormatError, match="another model"):
        K.inspect_kv(str(kv_dir), expect_identity=_identity(hf_b))


def test_prompt_mismatch(models, kv_dir):
    _, cfg, _ = models("A")
    ids = _prompt(23, cfg.vocab_size)
    K.read_kv(str(kv_dir), expect_prompt=ids)
    other = ids.clone()
    other[17] = (other[17] + 1) % cfg.vocab_size
    _refused(kv_dir, "prompt mismatch: the KV holds 23 tokens .* they differ from position 17", expect_prompt=other)
    _refused(kv_dir, "prompt mismatch", expect_prompt=ids[:-1])
    _refused(kv_dir, "prompt mismatch: the prompt does not continue", prompt_prefix_of=other.tolist() + [1])
    _refused(kv_dir, "prompt mismatch", prompt_prefix_of=ids)  # nothing new to prefill
    assert K.read_kv(str(kv_dir), prompt_prefix_of=ids.tolist() + [5, 6]).new_tokens(ids.tolist() + [5, 6]) == [5, 6]


def test_incomplete_or_malformed_manifest(kv_dir, tmp_path):
    def drop(m):
        m["layers"][4] = {"layer": 4, "file": "layer-0004.safetensors", "complete": False}
        m["complete"] = False

    _edit_manifest(kv_dir, drop)
    _refused(kv_dir, "KV incomplete: layers 4 of 5 not written")
    _edit_manifest(kv_dir, lambda m: m.update(complete=True))
    _refused(kv_dir, "marked complete with incomplete layers")
    _edit_manifest(kv_dir, lambda m: m.update(format_version=[2, 0]))
    _refused(kv_dir, r"KV format version 2\.0 is not supported")
    _edit_manifest(kv_dir, lambda m: m.update(format_version=[1, 0], dtype="F64"))
    _refused(kv_dir, "unknown dtype")
    _edit_manifest(kv_dir, lambda m: (m.update(dtype="F32"), m["tokens"]["ids"].append(3)))
    _refused(kv_dir, "tokens need ids")
    (kv_dir / K.MANIFEST_NAME).write_text('{"format": "moepack-kv", ')
    _refused(kv_dir, "manifest.json is not valid JSON")
    os.remove(kv_dir / K.MANIFEST_NAME)
    _refused(kv_dir, "no manifest.json: not a moepack KV directory")
    _refused(tmp_path / "nowhere", "no such KV directory")


# ---------------------------------------------------------------------------------------------------------------
# inspect and the size arithmetic
# ---------------------------------------------------------------------------------------------------------------


def test_inspect(models, kv_dir):
    hf_model, cfg, _ = models("A")
    report = K.inspect_kv(str(kv_dir), expect_identity=_identity(hf_model), expect_prompt=_prompt(23, cfg.vocab_size))
    assert report["complete"] and report["layers_complete"] == report["num_layers"] == 5
    assert report["tokens"] == 23 and report["dtype"] == "F32" and report["incomplete_layers"] == ""
    assert report["bytes"] == sum(os.path.getsize(kv_dir / K.layer_file_name(i)) for i in range(5))
    assert report["by_type"][C]["layers"] == 2 and report["by_type"][S]["layers"] == 1
    assert report["layers"][1] == {"layer": 1, "type": C, "complete": True, "tokens": 23,
                                   "entries": {"compressor": 5, "indexer": 5}, "bytes": report["layers"][1]["bytes"]}
    json.dumps(report)


def test_geometry_agrees_with_the_model_config():
    for config in [*CONFIGS.values(), _flash_config(),
                   dict(num_hidden_layers=43, compress_ratios=[0, 0] + [4, 128] * 20 + [0])]:
        g = K.kv_geometry(config)
        cfg = ModelConfig.from_hf(config)
        assert tuple(g["layer_types"]) == cfg.layer_types and tuple(g["compress_rates"]) == cfg.compress_rates
        assert (g["head_dim"], g["index_head_dim"], g["sliding_window"]) == (cfg.head_dim, cfg.index_head_dim,
                                                                              cfg.sliding_window)


def test_v4_flash_bytes_per_token_by_hand():
    """docs/kv.md's table. V4-Flash: 43 layers = 3 sliding + 20 CSA (rate 4) + 20 HCA (rate 128), head_dim 512,
    index_head_dim 128, window 128."""
    config = _flash_config()
    f32 = K.kv_bytes_per_token(config, "F32")
    bf16 = K.kv_bytes_per_token(config, "BF16")
    t = f32["per_layer_type"]
    assert (t[S]["layers"], t[C]["layers"], t[H]["layers"]) == (3, 20, 20)
    assert t[S]["bytes_per_token"] == 0 and t[S]["fixed_bytes"] == 127 * 512 * 4 == 260_096
    assert t[C]["bytes_per_token"] == (512 + 128) * 4 / 4 == 640  # one entry + one indexer key per 4 tokens
    assert t[H]["bytes_per_token"] == 512 * 4 / 128 == 16  # one entry per 128 tokens
    assert f32["total"]["bytes_per_token"] == 20 * 640 + 20 * 16 == 13_120
    assert bf16["total"]["bytes_per_token"] == 6_560 and bf16["per_layer_type"][C]["bytes_per_token"] == 320
    assert f32["total"]["fixed_bytes"] == 43 * 260_096
    n = 128 * 1024
    total = K.kv_bytes(config, n, "F32")
    overlap = 20 * 4 * (512 + 128) * 2 * 4  # CSA: the last window's Ca kv + gate, compressor and indexer, F32
    assert total == 13_120 * n + 43 * 260_096 + overlap  # 128K is a multiple of every rate: no buffered tokens
    assert 1.7e9 < total < 1.74e9 and total / 160e9 < 0.011  # ~1 % of the weights
    # The seed's working set: one CSA layer's KV + indexer KV at 128K tokens is ~0.1 GB in F32.
    assert 0.08e9 < 640 * n + 260_096 < 0.1e9
    assert K.kv_bytes(config, n, "BF16") == 6_560 * n + 43 * 127 * 512 * 2 + overlap
    f8 = K.kv_bytes_per_token(config, "F8_E4M3")["per_layer_type"][C]["bytes_per_token"]
    assert f8 == (512 + 4 + 128 + 4) / 4  # one F32 scale per stored row
