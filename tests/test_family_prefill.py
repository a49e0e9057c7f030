"""The layer-major prefill engine (runtime/engine.py) running a model family through families.base.LayerPrefill:
Qwen3-MoE containers converted from transformers' Qwen3MoeForCausalLM (a random tiny config with a dense-MLP
layer, saved with save_pretrained: float32, bf16, and the `-FP8` block-scaled layout) prefilled by the engine,
whose last-position logits equal transformers' over the same weights, with either expert backend, grouped with
another prompt or continued from a shorter one; a damaged or mismatched container is one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from moepack.cli.main import cli
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.reader import Container
from moepack.packer.convert import convert_checkpoint
from moepack.runtime.engine import PrefillOptions, StreamingPrefill, prefill

transformers = pytest.importorskip("transformers")
from test_qwen3_moe import (CONFIGS, PROMPT, fp8_release, reference, reference_logits, save_model,  # noqa: E402
                            save_widened)

# layers 0 and 2 dense (decoder_sparse_step 2), layer 3 dense (mlp_only_layers): the engine streams layer 1's
# experts only
DENSE_LAYERS = CONFIGS["sparse-step"]
BACKENDS = ("per-expert", "grouped")
ATOL = 1e-4  # float32 through 4 layers of random weights: summation order only


def _options(backend: str = "per-expert", **kw) -> PrefillOptions:
    return PrefillOptions(expert_backend=backend, compute_dtype="float32", **kw)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """{layout: (container, transformers' float32 model over the container's values)} for float32, bf16 and the
    -FP8 layout, of the config with dense-MLP layers; and "tied" (a head tied to the embedding, layer 0 dense)."""
    base = tmp_path_factory.mktemp("qwen3-prefill")
    out = {}
    for layout, overrides in (("float32", DENSE_LAYERS), ("bf16", DENSE_LAYERS), ("fp8", DENSE_LAYERS),
                              ("tied", CONFIGS["mha-tied"])):
        src = base / layout
        model = save_model(src, overrides, torch.bfloat16 if layout == "bf16" else torch.float32)
        if layout == "fp8":
            save_widened(model, src, fp8_release(src), base / "widened")
            model = reference(base / "widened")
        else:
            model = reference(src)  # transformers' float32 load of what was saved (a bf16 checkpoint widened)
        out[layout] = str(base / f"{layout}.moepack"), model
        convert_checkpoint(str(src), out[layout][0], policy="keep", progress=False)
    # the routed experts as MXFP4 (--fp4): compared with the family's forward over the container's values
    out["fp4"] = str(base / "fp4.moepack"), None
    convert_checkpoint(str(base / "float32"), out["fp4"][0], policy="fp4", progress=False)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["float32", "bf16", "fp8", "tied"])
def test_prefill_logits_equal_transformers(qwen3, layout, backend):
    container, model = qwen3[layout]
    want = reference_logits(model, PROMPT)[-1]
    result = prefill(container, PROMPT, _options(backend, expert_selection="all"))
    torch.testing.assert_close(result.logits, want, atol=ATOL, rtol=0)
    assert result.next_token == int(want.argmax())
    assert result.stats["expert_backend"] == backend
    with Container(container) as c:
        experts = [len(b.experts) for b in c.layers]
    # every expert of a routed layer read once, none of a dense-MLP layer's (it has none)
    assert [s.experts_read for s in result.layers] == experts and 0 in experts and max(experts) == 6


def test_a_cpu_prefill_decodes_each_fp8_expert_into_its_threads_buffers(qwen3, monkeypatch):
    """The per-expert backend on a CPU decodes a family's FP8 experts (the generic decode, for its expert_ffn) into
    its thread's decoder's buffers, reused from one expert to the next (fresh pages for every expert would each
    fault in: 2-3x the decode's time), with the logits of fresh tensors."""
    from moepack.runtime import expert_runner
    from moepack.runtime.expert_decode import ExpertDecoder
    from moepack.runtime.expert_runner import ExpertRunner

    monkeypatch.setattr(expert_runner, "KERNEL_MAX_TOKENS", 0)  # every expert decoded (not the token kernel's)
    container = qwen3["fp8"][0]
    decoded, whole = [], ExpertRunner.expert_weights

    def spy(self, *args, **kwargs):
        w = whole(self, *args, **kwargs)
        buffers = {b.data_ptr() for b in self._decoder()._buffers.values()}
        decoded.append([m.data_ptr() in buffers for m in (w.w1, w.w3, w.w2)])
        return w
    monkeypatch.setattr(ExpertRunner, "expert_weights", spy)
    reused = prefill(container, PROMPT, _options(expert_selection="all")).logits
    chosen = len(decoded)  # (the experts some token chose: of the 6 read)
    assert chosen >= 3 and all(all(roles) for roles in decoded)
    monkeypatch.setattr(ExpertDecoder, "buffer_for", lambda self, prefix: lambda entry, dtype: None)
    decoded.clear()
    fresh = prefill(container, PROMPT, _options(expert_selection="all")).logits
    assert len(decoded) == chosen and not any(any(roles) for roles in decoded)
    assert torch.equal(reused, fresh)


@pytest.mark.parametrize("layout, dtype", [("fp8", "float32"), ("bf16", "float32"), ("fp4", "float32"),
                                           ("fp8", "bfloat16")])
def test_experts_on_few_tokens_run_in_the_token_kernel_from_their_bytes(qwen3, monkeypatch, layout, dtype):
    """On a CPU a family's expert on up to KERNEL_MAX_TOKENS tokens (a short prompt's: every expert here) runs in
    the token kernel from its stored bytes, never decoded; with the logits of every expert decoded and multiplied by
    torch (float32: sums in another order; bfloat16: the kernel's float32 products of bf16-rounded inputs against
    torch's bf16 matmuls)."""
    from moepack.backends import token_kernels
    from moepack.runtime import expert_runner

    if token_kernels.token_kernels() is None:
        pytest.skip("no compiled token kernel here")
    container = qwen3[layout][0]
    decoded, kernel_calls = [], []
    whole_weights, whole_rows = expert_runner.ExpertRunner.expert_weights, token_kernels.TokenKernels.moe_rows

    def weights_spy(self, *args, **kwargs):
        decoded.append(1)
        return whole_weights(self, *args, **kwargs)

    def rows_spy(self, x, *args, **kwargs):
        kernel_calls.append(x.shape[0])
        return whole_rows(self, x, *args, **kwargs)
    monkeypatch.setattr(expert_runner.ExpertRunner, "expert_weights", weights_spy)
    monkeypatch.setattr(token_kernels.TokenKernels, "moe_rows", rows_spy)
    options = PrefillOptions(expert_selection="all", compute_dtype=dtype)
    by_kernel = prefill(container, PROMPT, options).logits
    assert kernel_calls and max(kernel_calls) <= expert_runner.KERNEL_MAX_TOKENS and not decoded
    monkeypatch.setattr(expert_runner, "KERNEL_MAX_TOKENS", 0)
    kernel_calls.clear()
    by_torch = prefill(container, PROMPT, options).logits
    assert decoded and not kernel_calls
    if dtype == "float32":
        torch.testing.assert_close(by_kernel, by_torch, atol=ATOL, rtol=0)
    else:
        assert (by_kernel - by_torch).abs().max() <= 0.05 * by_torch.abs().max()


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp4_experts_equal_the_familys_forward_over_the_containers_values(qwen3, backend):
    from test_qwen3_moe_container import container_checkpoint

    from moepack.families.qwen3_moe.model import forward

    container, _ = qwen3["fp4"]
    with Container(container) as c:
        assert c.tensors["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == "MXFP4"
    want = forward(container_checkpoint(container), PROMPT)[-1]
    torch.testing.assert_close(prefill(container, PROMPT, _options(backend)).logits, want, atol=ATOL, rtol=0)


def test_routed_reads_only_the_chosen_experts(qwen3):
    container, model = qwen3["float32"]
    result = prefill(container, PROMPT[:2], _options(expert_selection="routed"))
    torch.testing.assert_close(result.logits, reference_logits(model, PROMPT[:2])[-1], atol=ATOL, rtol=0)
    layer = result.layers[1]
    assert layer.selection == "routed" and layer.experts_read == layer.experts_used <= 4 and layer.bytes_skipped > 0


def test_the_cli_prefills_a_qwen3_container(qwen3, tmp_path):
    container, model = qwen3["fp8"]
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(PROMPT))
    logits = tmp_path / "logits.safetensors"
    r = CliRunner().invoke(cli, ["prefill", container, "--token-ids", str(ids), "--logits-out", str(logits),
                                 "--compute-dtype", "float32", "--json"])
    assert r.exit_code == 0, r.output
    want = reference_logits(model, PROMPT)[-1]
    out = json.loads(r.output)
    assert out["next_token"] == int(want.argmax()) and out["tokens"] == len(PROMPT)
    from safetensors.torch import load_file

    torch.testing.assert_close(load_file(str(logits))["logits"], want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_run_many_equals_each_prompt_alone(qwen3, backend):
    container, _ = qwen3["float32"]
    prompts = [torch.tensor(PROMPT), torch.tensor([9, 8, 7, 200, 31])]
    with Container(container) as c:
        engine = StreamingPrefill(c, _options(backend))
        try:
            alone = [engine.run(p, keep_kv=True) for p in prompts]
            together = engine.run_many(prompts)
        finally:
            engine.close()
    for one, grouped in zip(alone, together):
        torch.testing.assert_close(grouped.logits, one.logits, atol=ATOL, rtol=0)
        assert grouped.tokens_per_expert == one.tokens_per_expert
        assert [s.length for s in grouped.states] == [s.length for s in one.states]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_continued_prefill_equals_the_whole_prompt(qwen3, backend):
    container, model = qwen3["float32"]
    ids = torch.tensor(PROMPT)
    with Container(container) as c:
        engine = StreamingPrefill(c, _options(backend))
        try:
            first = engine.run(ids[:4], keep_kv=True)
            continued = engine.run(ids[4:], list(first.states), keep_kv=True)
            # two continuations of one past in one pass: each its own copy of the state
            again = engine.run_many([ids[4:], ids[4:6]], [list(first.states), list(first.states)])
        finally:
            engine.close()
    want = reference_logits(model, PROMPT)
    torch.testing.assert_close(continued.logits, want[-1], atol=ATOL, rtol=0)
    assert [s.length for s in continued.states] == [len(PROMPT)] * 4
    torch.testing.assert_close(again[0].logits, want[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(again[1].logits, reference_logits(model, PROMPT[:6])[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_long_prompts_fused_attention_chunks_give_transformers_logits(qwen3, backend, monkeypatch):
    """A prompt long enough for torch's fused attention (chunks of model.FUSED_MIN_QUERIES queries or more): whole
    (one chunk, the kernel's causal mask), in query chunks of 24 (masked chunks after the first), and continued
    after 50 tokens (a fused chunk over a past) or after 60 (a tail of 10 through the grouped matmuls), each with
    the last position's logits of transformers' forward."""
    import torch.nn.functional as F

    from moepack.families.qwen3_moe import model as qwen3_model

    container, model = qwen3["float32"]
    ids = torch.randint(3, 300, (70,), generator=torch.Generator().manual_seed(8))
    want = reference_logits(model, ids.tolist())[-1]
    fused, whole = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        fused.append(args[0].shape[2])
        return whole(*args, **kwargs)
    monkeypatch.setattr(qwen3_model.F, "scaled_dot_product_attention", spy)
    for query_chunk in (None, 24):
        fused.clear()
        result = prefill(container, ids, _options(backend, query_chunk=query_chunk))
        torch.testing.assert_close(result.logits, want, atol=ATOL, rtol=0)
        assert fused and set(fused) == ({70} if query_chunk is None else {24, 22}), fused
    with Container(container) as c:
        engine, layers = StreamingPrefill(c, _options(backend)), len(c.layers)
        try:
            for cut in (50, 60):
                fused.clear()
                first = engine.run(ids[:cut], keep_kv=True)
                continued = engine.run(ids[cut:], list(first.states))
                torch.testing.assert_close(continued.logits, want, atol=ATOL, rtol=0)
                tail = [70 - cut] if 70 - cut >= qwen3_model.FUSED_MIN_QUERIES else []
                assert fused == [cut] * layers + tail * layers
        finally:
            engine.close()


def test_bf16_compute_stays_near_float32(qwen3):
    container, model = qwen3["bf16"]
    want = reference_logits(model, PROMPT)[-1]
    got = prefill(container, PROMPT, PrefillOptions(compute_dtype="bfloat16")).logits
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


# ------------------------------------------------------------------------------------------ refusals


def _mutated(source: str, target, change) -> str:
    from containers import mutate_index

    mutate_index(source, str(target), change)
    return str(target)


@pytest.mark.parametrize("change, message", [
    (lambda index: index["config"].update(num_experts=7, num_local_experts=7),
     "layers.1 holds 6 experts, the config implies 7"),
    (lambda index: index["config"].update(hidden_size=64),
     "tensor model.embed_tokens.weight has shape [300, 160], the config implies [300, 64]"),
    (lambda index: index["config"].update(hidden_act="gelu"), "hidden_act: 'gelu' is not supported"),
])
def test_a_mismatched_container_is_one_line_before_any_read(qwen3, tmp_path, change, message):
    bad = _mutated(qwen3["float32"][0], tmp_path / "bad.moepack", change)
    with pytest.raises(MoepackError) as e:
        prefill(bad, PROMPT, _options())
    assert message in str(e.value) and "\n" not in str(e.value)
    r = CliRunner().invoke(cli, ["prefill", bad, "--token-ids", str(_ids(tmp_path))])
    assert r.exit_code == 1 and message in r.output and "Traceback" not in r.output


def _ids(tmp_path):
    path = tmp_path / "ids.txt"
    path.write_text(" ".join(map(str, PROMPT)))
    return path


def test_a_damaged_expert_is_one_line(qwen3, tmp_path):
    container, _ = qwen3["float32"]
    bad = str(tmp_path / "damaged.moepack")
    shutil.copy(container, bad)
    with Container(bad) as c:
        region = c.layers[1].experts[2]
        assert region.part == 0
    with open(bad, "r+b") as f:
        f.seek(region.offset + 5)
        byte = f.read(1)
        f.seek(region.offset + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(MoepackError, match="checksum mismatch while streaming") as e:
        prefill(bad, PROMPT, _options(expert_selection="all"))
    assert "\n" not in str(e.value)


def test_out_of_vocabulary_ids_are_refused_and_leave_no_usable_kv(qwen3, tmp_path):
    """(a family's KV directories: tests/test_family_kv.py)"""
    from moepack.families import family_named, kv_directory

    container, _ = qwen3["float32"]
    with pytest.raises(MoepackError, match="token id out of range 0..299"):
        prefill(container, [1, 300], _options(), kv_out=str(tmp_path / "kv"))
    with pytest.raises(MoepackError, match="KV incomplete: layers 0..3 of 4 not written"):
        kv_directory.read_kv(str(tmp_path / "kv"), family_named("qwen3-moe").kv_format)


# ------------------------------------------------------------------------------------------ the engine's boundary


def test_the_engine_and_the_read_scheduler_name_no_family():
    """What DeepSeek-V4 computes is its LayerPrefill's (families/deepseek_v4/model.py DeepseekV4Prefill): the engine and
    the read scheduler spell none of its names (its tensors, its functions, its config's fields)."""
    import inspect

    from moepack.runtime import engine, read_scheduler

    v4_names = ("tid2eid", '"embed.weight"', "HEAD_GLOBALS", "residual_streams", "attention_sublayer", "moe_route",
                "moe_finish", "shared_expert", "clamped_swiglu", "EXPERT_NAMING", "hc_mult", "swiglu_limit",
                "num_experts_per_tok", "head_weight", "rope_rotation", "w1.weight")
    for module in (engine, read_scheduler):
        source = inspect.getsource(module)
        assert [n for n in v4_names if n in source] == [], module.__name__


def test_a_stop_between_layers_cancels_a_qwen3_prefill(qwen3):
    from moepack.runtime.engine import GenerationCancelled

    container, _ = qwen3["float32"]
    asked = []
    with Container(container) as c:
        engine = StreamingPrefill(c, _options())
        try:
            with pytest.raises(GenerationCancelled) as e:
                engine.run(torch.tensor(PROMPT), should_stop=lambda: asked.append(1) or len(asked) > 2)
            assert e.value.layers_done == 2
            again = engine.run(torch.tensor(PROMPT))  # the engine runs on after a cancelled pass
        finally:
            engine.close()
    assert again.next_token == prefill(container, PROMPT, _options()).next_token


def test_both_models_implement_the_protocol(qwen3, tmp_path_factory):
    from containers import tiny_keep_container

    from moepack.families.base import LayerPrefill
    from moepack.runtime.engine import layer_prefill
    from moepack.families.deepseek_v4.model import DeepseekV4Prefill

    with Container(tiny_keep_container(tmp_path_factory)) as c:
        v4 = layer_prefill(c, torch.float32)
    with Container(qwen3["float32"][0]) as c:
        family = layer_prefill(c, torch.float32)
    assert isinstance(v4, DeepseekV4Prefill) and isinstance(v4, LayerPrefill) and isinstance(family, LayerPrefill)
    assert v4.shape.moe_layers == tuple(range(v4.shape.num_layers)) and v4.shape.hash_layers
    assert family.shape.moe_layers == (1,) and family.names.head == "lm_head.weight"


def test_query_chunks_give_the_same_logits_and_a_stop_between_them(qwen3):
    from moepack.runtime.engine import GenerationCancelled

    container, model = qwen3["float32"]
    want = reference_logits(model, PROMPT)[-1]
    torch.testing.assert_close(prefill(container, PROMPT, _options(query_chunk=2)).logits, want, atol=ATOL, rtol=0)
    asked = []
    with Container(container) as c:
        engine = StreamingPrefill(c, _options(query_chunk=2))
        try:  # asked before layer 0, then before each of its chunks after the first: the third ask is mid-layer
            with pytest.raises(GenerationCancelled) as e:
                engine.run(torch.tensor(PROMPT), should_stop=lambda: asked.append(1) or len(asked) == 3)
        finally:
            engine.close()
    assert e.value.layers_done == 0 and len(asked) == 3


def _prompt_logprobs_of(model, ids: list[int], k: int) -> tuple[list[float], list[list[int]]]:
    """transformers' log-probability of each of the prompt's tokens after the first, and the k likeliest ids."""
    lp = torch.log_softmax(reference_logits(model, ids)[:-1].double(), dim=-1)
    return lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist(), lp.topk(k, dim=1).indices.tolist()


def _check_prompt_logprobs(entries, model, ids: list[int], k: int) -> None:
    want, want_top = _prompt_logprobs_of(model, ids, k)
    assert [e.token for e in entries] == ids[1:]
    torch.testing.assert_close(torch.tensor([e.logprob for e in entries], dtype=torch.float64),
                               torch.tensor(want, dtype=torch.float64), atol=ATOL, rtol=0)
    assert [[i for i, _ in e.top] for e in entries] == want_top
    for e in entries:  # the alternatives' own log-probabilities, the chosen one's among them where it is
        assert all(a >= b for (_, a), (_, b) in zip(e.top, e.top[1:]))
        assert all(abs(v - e.logprob) < ATOL for i, v in e.top if i == e.token)


def _small_head_slices(monkeypatch) -> None:
    """The LM head in vocabulary slices of 7 ids (the tiny Qwen3's hidden 160), the scores 3 positions at a time:
    the running sums and top k cross slices and parts."""
    from moepack.runtime import engine as engine_module

    monkeypatch.setattr(engine_module, "HEAD_CHUNK_BYTES", 4 * 160 * 7)
    monkeypatch.setattr(engine_module, "SCORE_CHUNK_BYTES", 4 * 7 * 3)


@pytest.mark.parametrize("ranked", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_logprobs_equal_transformers(qwen3, backend, ranked, monkeypatch):
    """The prompt's log-probabilities (run's prompt_logprobs) are transformers' log_softmax at every position, the
    head's vocabulary slices and positions taken a few at a time (the running logsumexp and top k across slices),
    whole, in chunks (a chunk's first token from the chunk before), continued after a past (its first token joined
    from the past's logits) and beside another prompt in one pass (which asked for none). `ranked` (vLLM's
    prompt_logprobs): each token's rank too, how many tokens score at least as high (itself included), counted over
    the head's slices in a second pass: transformers' ranks; unasked, none."""
    from moepack.runtime.engine import joined_prompt_logprobs

    container, model = qwen3["float32"]
    _small_head_slices(monkeypatch)
    ids = torch.tensor(PROMPT)
    with Container(container) as c:
        engine = StreamingPrefill(c, _options(backend))
        try:
            whole = engine.run(ids, prompt_logprobs=4, ranked=ranked)
            chunked = engine.run(ids, chunk_tokens=4, prompt_logprobs=4, ranked=ranked)
            first = engine.run(ids[:4], keep_kv=True, prompt_logprobs=4, ranked=ranked)
            continued = engine.run(ids[4:], list(first.states), prompt_logprobs=4, ranked=ranked)
            grouped = engine.run_many([ids, ids[:1], ids[2:5]], prompt_logprobs=[4, 2, None], ranked=ranked)
            plain = engine.run(ids)
            for wrong in ([4], [4, None, 2]):  # one k a prompt, checked before the pass
                with pytest.raises(ValueError, match=f"2 prompts but {len(wrong)} prompt_logprobs"):
                    engine.run_many([ids, ids[:3]], prompt_logprobs=wrong)
        finally:
            engine.close()
    lp = torch.log_softmax(reference_logits(model, PROMPT)[:-1].double(), dim=-1)
    target = lp.gather(1, ids[1:, None])
    ranks = (lp >= target).sum(dim=1).tolist()
    alone = ((lp - target).abs() < 1e-4).sum(dim=1).tolist()  # 1: no other within rounding that could flip a rank
    assert max(ranks) > 4  # (not only the likeliest tokens)
    for entries in (whole.prompt_logprobs, chunked.prompt_logprobs, grouped[0].prompt_logprobs,
                    first.prompt_logprobs + joined_prompt_logprobs(first.logits, ids[4:], 4,
                                                                   continued.prompt_logprobs, ranked)):
        _check_prompt_logprobs(entries, model, PROMPT, 4)
        got = [e.rank for e in entries]
        assert got == [r if ranked and n == 1 else g if ranked else None for g, r, n in zip(got, ranks, alone)]
    assert joined_prompt_logprobs(None, ids, 4, [])[0] is None
    assert grouped[1].prompt_logprobs == [] and grouped[2].prompt_logprobs is None and plain.prompt_logprobs is None
    torch.testing.assert_close(whole.logits, plain.logits, atol=0, rtol=0)  # the last position's as before


def test_the_memory_check_counts_the_scored_positions(qwen3, monkeypatch):
    """A prefill asked for its prompt's log-probabilities counts what scoring every position holds (the head's
    input and a running score per position, one slice of their logits) before it runs, grouped or alone; a refusal
    names that part (prompt_logprobs, not hidden in the weights') and says to score fewer tokens."""
    from moepack.runtime import engine as engine_module
    from moepack.runtime import memory

    container, _ = qwen3["float32"]
    counted = []
    real = engine_module.check_prefill_memory
    monkeypatch.setattr(engine_module, "check_prefill_memory", lambda *a, **kw: counted.append(
        (kw["head_chunk_bytes"], kw.get("scoring_bytes", 0))) or real(*a, **kw))
    ids = torch.tensor(PROMPT)
    with Container(container) as c:
        engine = StreamingPrefill(c, _options())
        try:
            engine.run(ids)
            engine.run(ids, prompt_logprobs=2)
            engine.run_many([ids, ids[:4]], prompt_logprobs=[None, 2])
            refusals = []
            for scored in (0, len(PROMPT)):
                monkeypatch.setattr(memory, "available_memory_bytes", lambda: 1 << 20)
                with pytest.raises(MoepackError) as e:
                    engine.check_memory(len(PROMPT), scored)
                refusals.append(str(e.value))
        finally:
            engine.close()
    per_position = 4 * 160 + engine_module.SCORE_BYTES_PER_POSITION
    plain = engine_module.HEAD_CHUNK_BYTES
    assert counted[:3] == [(plain, 0), (plain, engine_module.SCORE_CHUNK_BYTES + len(PROMPT) * per_position),
                           (plain, engine_module.SCORE_CHUNK_BYTES + 4 * per_position)]
    assert "prompt_logprobs" not in refusals[0] and "score fewer" not in refusals[0]
    assert "prompt_logprobs 0.02 GiB" in refusals[1] and "score fewer of its tokens" in refusals[1]
    # (the weights' part without the scoring's either way)
    assert len({r.split("weights ")[1].split(" GiB")[0] for r in refusals}) == 1
