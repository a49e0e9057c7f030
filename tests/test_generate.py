"""moepack generate: the streamed prefill, then token-major decode with the routed experts through an expert cache,
against transformers' own greedy `generate` on the same checkpoint."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace

import pytest
import torch

from moepack.backends import token_kernels
from moepack.families.deepseek_v4.token_layer import TokenLayers
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.reader import Container
from moepack.packer.convert import convert_checkpoint
from moepack.runtime.decode import ExpertCache
from moepack.runtime.engine import PrefillOptions, prefill
from moepack.runtime.generate import GenerateOptions, Generator, generate
from v4_models import CONFIGS, indexer_boundary_ties, random_config, saved_model, wide_indexer_models

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (transformers model, container --keep) for A, B, C and two random configurations."""
    base = tmp_path_factory.mktemp("generate")
    import random

    configs = {name: CONFIGS[name] for name in ("A", "B", "C")}
    for seed in (7, 11):
        configs[f"random{seed}"] = {**random_config(random.Random(seed)), "max_position_embeddings": 4096}
    out = {}
    for i, (name, config) in enumerate(sorted(configs.items())):
        src = str(base / name)
        hf_model = saved_model(config, 100 + i, src)
        container = str(base / f"{name}.moepack")
        convert_checkpoint(src, container, progress=False)
        out[name] = hf_model, container
    return out


def _prompt(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _transformers_greedy(hf_model, ids: torch.Tensor, new: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=new, do_sample=False)
    return out[0, len(ids):].tolist()


CASES = [("A", 1), ("A", 40), ("B", 9), ("B", 300), ("C", 70), ("random7", 33), ("random11", 129)]


@pytest.mark.parametrize("name,n", CASES, ids=[f"{c}-N{n}" for c, n in CASES])
@pytest.mark.parametrize("cache_gib", [1.0, 0.0], ids=["cache", "no-cache"])
def test_greedy_generation_equals_transformers(models, name, n, cache_gib):
    hf_model, container = models[name]
    ids = _prompt(n, hf_model.config.vocab_size, seed=n)
    expected = _transformers_greedy(hf_model, ids, NEW_TOKENS)
    result = generate(container, ids, GenerateOptions(max_new_tokens=NEW_TOKENS, cache_gib=cache_gib))
    assert result.generated_ids == expected
    assert result.finish_reason == ("length" if len(expected) == NEW_TOKENS else "stop")
    decode = result.stats["decode"]
    assert decode["tokens"] == len(expected) - 1  # the first token comes from the prefill's logits
    if cache_gib == 0:
        assert decode["expert_cache_hit_rate"] in (0.0, None) and decode["cache_bytes"] == 0
        assert decode["tokens"] == 0 or decode["bytes_read_per_token"] > 0
    else:  # the whole model fits: every expert read at most once
        with open(container, "rb") as f:
            size = os.fstat(f.fileno()).st_size
        assert decode["bytes_read"] + decode["cache_seed_bytes"] <= size


def test_greedy_generation_with_a_repetition_penalty_equals_transformers(models):
    """repetition_penalty over the prompt and the answer, as transformers' generate applies it to its input_ids:
    the same greedy tokens, alone and in a batch beside another sequence (whose tokens must not count)."""
    from moepack.runtime.batching import BatchScheduler

    hf_model, container = models["B"]
    ids, other = (_prompt(n, hf_model.config.vocab_size, seed=n) for n in (40, 23))
    with torch.no_grad():
        expected = hf_model.generate(ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=NEW_TOKENS, do_sample=False, repetition_penalty=1.8)[0, len(ids):]
    expected = expected.tolist()
    assert expected != _transformers_greedy(hf_model, ids, NEW_TOKENS)  # (the test's own check: it changes them)
    options = GenerateOptions(max_new_tokens=NEW_TOKENS, repetition_penalty=1.8)
    with Generator(container, cache_gib=1.0) as g:
        assert g.generate(ids, options).generated_ids == expected
        with BatchScheduler(g, max_batch=2) as scheduler:
            futures = [scheduler.submit(prompt, options) for prompt in (other, ids)]
            assert futures[1].result(120).generated_ids == expected


@pytest.mark.parametrize("name,n", [("B", 9), ("random7", 33)], ids=["B-N9", "random7-N33"])
def test_greedy_generation_without_the_compiled_layers_equals_transformers(models, monkeypatch, name, n):
    """The path decode takes where TokenLayers does not apply (model.py's attention, moe_route and moe_finish, the
    routed experts in one kernel call) decodes the same tokens."""
    monkeypatch.setattr(TokenLayers, "make", classmethod(lambda cls, *a: None))
    hf_model, container = models[name]
    ids = _prompt(n, hf_model.config.vocab_size, seed=n)
    with Generator(container, cache_gib=1.0) as g:
        assert g.decoder.layers is None
        result = g.generate(ids, GenerateOptions(max_new_tokens=NEW_TOKENS))
    assert result.generated_ids == _transformers_greedy(hf_model, ids, NEW_TOKENS)


def test_decode_on_a_cpu_runs_every_layer_by_compiled_calls(models):
    """Where the native code builds, these models decode through TokenLayers."""
    if token_kernels.token_kernels() is None:
        pytest.skip("no compiled token kernels on this machine")
    for name, (_, container) in models.items():
        with Generator(container, cache_gib=1.0) as g:
            assert g.decoder.layers is not None, name


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory):
    """A and C with 16 indexer heads (v4_models.wide_indexer): no exact ties for the device's top-k to break."""
    return wide_indexer_models(str(tmp_path_factory.mktemp("generate-wide")))


def _decoded_cache_tokens(monkeypatch, container, ids, cache_gib, new=NEW_TOKENS) -> tuple[list[int], dict]:
    """Greedy tokens with the cache keeping decoded experts (the GPU's default) on this CPU, and what the cache
    held after them: its entries' types, their count, their bytes and the budget."""
    import functools

    from moepack.runtime import generate as generate_module
    from moepack.runtime.decode import Decoder

    with monkeypatch.context() as m:
        m.setattr(generate_module, "Decoder", functools.partial(Decoder, decoded_experts=True))
        with Generator(container, cache_gib=cache_gib) as g:
            assert g.decoder.layers is None and g.decoder.kernels is None  # model.py's path, as on a GPU
            tokens = g.generate(ids, GenerateOptions(max_new_tokens=new)).generated_ids
            cache = g.decoder.cache
            held = {"types": {type(entry).__name__ for entry in cache._entries.values()}, "count": len(cache),
                    "bytes": cache.bytes, "budget": cache.budget}
            return tokens, held


@pytest.mark.parametrize("name,n", [("A", 40), ("B", 130)])
@pytest.mark.parametrize("budget", [1.0, 0.3], ids=["all", "some"])
def test_a_cache_of_decoded_experts_generates_transformers_tokens(models, monkeypatch, name, n, budget):
    """The cache a GPU keeps (each expert's three matrices decoded, counted by their size against the budget):
    the same greedy tokens as transformers, with every expert cached and with a budget that holds only some of
    them (evicting), hash layers included."""
    from moepack.runtime.expert_decode import ExpertWeights

    hf_model, container = models[name]
    ids = _prompt(n, hf_model.config.vocab_size, seed=n)
    with Container(container) as c:  # float32 experts, float32 compute: 4 bytes a weight
        decoded_size = sum(t.numel * 4 for t in c.layers[0].experts[0].tensors if t.name.endswith(".weight"))
    cache_gib = budget if budget == 1.0 else 5.5 * decoded_size / 2**30  # five experts of them
    tokens, cache = _decoded_cache_tokens(monkeypatch, container, ids, cache_gib)
    assert tokens == _transformers_greedy(hf_model, ids, NEW_TOKENS)
    assert cache["types"] == {ExpertWeights.__name__} and cache["count"] > 0
    assert cache["bytes"] == cache["count"] * decoded_size <= cache["budget"]
    assert (cache["count"] == 5) == (budget != 1.0)


@pytest.mark.parametrize("policy", ["keep", "fp4"])
def test_decoded_release_experts_generate_what_their_stored_bytes_do(monkeypatch, tmp_path, policy):
    """FP4 e2m1 (the release's) and MXFP4 (--fp4) experts decoded once into the cache give the tokens the
    compiled kernels give reading their stored bytes."""
    from moepack.packer.synth import synth_checkpoint

    src, container = str(tmp_path / "src"), str(tmp_path / f"{policy}.moepack")
    synth_checkpoint(src, preset="tiny", layout="release", seed=3, progress=False)
    convert_checkpoint(src, container, policy=policy, progress=False)
    ids = _prompt(50, 256, seed=5)
    stored = generate(container, ids, GenerateOptions(max_new_tokens=16, cache_gib=1.0))
    decoded, _ = _decoded_cache_tokens(monkeypatch, container, ids, 1.0, new=16)
    assert decoded == stored.generated_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("name,n,cache_gib", [("A", 40, 1.0), ("C", 70, 0.0), ("A", 300, 0.0)],
                         ids=["A-N40-cache", "C-N70-no-cache", "A-N300-no-cache"])
def test_cuda_greedy_generation_equals_transformers(wide_models, name, n, cache_gib):
    """The decode on a GPU (`--device cuda`: resident weights and the expert cache's hits on the device, the torch
    path of the one-token attention) generates transformers' greedy tokens, with a cache and with none."""
    hf_model, container = wide_models[name]
    ids = _prompt(n, hf_model.config.vocab_size, seed=n)
    options = GenerateOptions(max_new_tokens=NEW_TOKENS, cache_gib=cache_gib, prefill=PrefillOptions(device="cuda"))
    with indexer_boundary_ties() as ties:
        generated = generate(container, ids, options).generated_ids
    assert ties == [0]  # else the device's top-k may rightly choose other entries than the CPU's
    assert generated == _transformers_greedy(hf_model, ids, NEW_TOKENS)


@pytest.mark.parametrize("batch", [1, 4], ids=["top-20", "four-prompts"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
def test_more_misses_in_a_step_than_read_buffers_decode(tmp_path, monkeypatch, batch, compiled):
    """A decode step whose misses outnumber the decoder's read buffers (16: top-20 of 24 experts with no cache,
    or four prompts' union of top-10s) holds no more buffers than leave its next read one: it generates
    transformers' tokens (it waited for ever, every buffer held by an expert waiting for the rest)."""
    if not compiled:
        monkeypatch.setattr(TokenLayers, "make", classmethod(lambda cls, *a: None))
    config = {**CONFIGS["C"], "n_routed_experts": 24, "num_experts_per_tok": 20 if batch == 1 else 10,
              "index_n_heads": 16}
    hf_model = saved_model(config, 5, str(tmp_path / "src"))
    container = str(tmp_path / "m.moepack")
    convert_checkpoint(str(tmp_path / "src"), container, progress=False)
    prompts = [_prompt(n, config["vocab_size"], seed=n) for n in (9, 4, 17, 12)[:batch]]

    def run():
        from moepack.runtime.batching import BatchScheduler

        with Generator(container, cache_gib=0.0) as g:
            assert g.decoder.pipe.buffers < 20 and (g.decoder.layers is not None) == compiled
            with BatchScheduler(g, max_batch=batch) as scheduler:
                futures = [scheduler.submit(ids, GenerateOptions(max_new_tokens=6)) for ids in prompts]
                return [f.result() for f in futures]

    from test_prefill import _within

    results = _within(120, run)  # (on the thread: a hang would also keep the scheduler from closing)
    for ids, result in zip(prompts, results):
        assert result.generated_ids == _transformers_greedy(hf_model, ids, 6)


@pytest.mark.parametrize("cache_gib", [0.0, 1.0], ids=["no-cache", "cache"])
def test_a_damaged_expert_met_by_decode_is_refused_by_its_checksum(models, tmp_path, cache_gib):
    """A byte of every expert of the last layer flipped after the prefill: decode's first read of one (checked by
    the reader thread as it lands, whether or not the cache keeps it) fails with one line naming the region."""
    hf_model, container = models["A"]
    damaged = str(tmp_path / "damaged.moepack")
    shutil.copyfile(container, damaged)
    ids = _prompt(12, hf_model.config.vocab_size, seed=3)
    with Generator(damaged, cache_gib=cache_gib) as g:
        g.decoder.begin(g._prefill(ids, None, 4)[1])
        regions = g.c.layers[-1].experts
        with open(damaged, "r+b") as f:
            for r in regions:
                f.seek(r.offset + r.length // 2)
                byte = f.read(1)[0]
                f.seek(r.offset + r.length // 2)
                f.write(bytes([byte ^ 0x40]))
        g.decoder.cache = type(g.decoder.cache)(g.decoder.cache.budget)  # nothing cached from the prefill's seed
        with pytest.raises(MoepackError, match="checksum mismatch"):
            for token in ids[:4].tolist():
                g.decoder.step(token)


def test_generation_continued_from_a_kv_equals_the_whole(models, tmp_path):
    hf_model, container = models["C"]
    ids = _prompt(90, hf_model.config.vocab_size, seed=5)
    expected = _transformers_greedy(hf_model, ids, NEW_TOKENS)
    kv = str(tmp_path / "kv")
    prefill(container, ids[:60], PrefillOptions(), kv_out=kv)
    result = generate(container, ids[60:], GenerateOptions(max_new_tokens=NEW_TOKENS, cache_gib=0.0,
                                                           prompt_logprobs=2), continue_from=kv)
    assert result.generated_ids == expected
    # the prompt's log-probabilities: transformers' over the whole sequence, the first from the KV's logits
    with torch.no_grad():
        want = torch.log_softmax(hf_model(ids[None]).logits[0, 59:-1].double(), dim=-1)
    got = result.prompt_logprobs
    assert [e.token for e in got] == ids[60:].tolist()
    torch.testing.assert_close(torch.tensor([e.logprob for e in got], dtype=torch.float64),
                               want.gather(1, ids[60:, None])[:, 0], atol=2e-4, rtol=0)
    assert [[i for i, _ in e.top] for e in got] == want.topk(2, dim=1).indices.tolist()
    # no new prompt: decoding starts from the KV's own logits
    prefill(container, ids, PrefillOptions(), kv_out=str(tmp_path / "kv2"))
    again = generate(container, [], GenerateOptions(max_new_tokens=NEW_TOKENS, prompt_logprobs=2),
                     continue_from=str(tmp_path / "kv2"))
    assert again.generated_ids == expected and again.prompt_logprobs == []


def test_sampling_with_a_seed_is_reproducible(models):
    hf_model, container = models["A"]
    ids = _prompt(20, hf_model.config.vocab_size, seed=3)
    options = dict(max_new_tokens=16, temperature=1.0, top_p=0.9, top_k=20)
    first = generate(container, ids, GenerateOptions(**options, seed=1234))
    second = generate(container, ids, GenerateOptions(**options, seed=1234))
    other = generate(container, ids, GenerateOptions(**options, seed=4321))
    assert first.generated_ids == second.generated_ids
    assert first.generated_ids != other.generated_ids
    assert first.stats["sampling_seed"] == 1234


def test_the_expert_cache_evicts_the_least_recently_used():
    cache = ExpertCache(budget=10)
    cache.put((0, 0), torch.zeros(4, dtype=torch.uint8))
    cache.put((0, 1), torch.zeros(4, dtype=torch.uint8))
    assert cache.get((0, 0)) is not None  # (0, 1) is now the least recently used
    cache.put((0, 2), torch.zeros(4, dtype=torch.uint8))
    assert (0, 1) not in cache and (0, 0) in cache and (0, 2) in cache and cache.bytes == 8
    cache.put((0, 3), torch.zeros(11, dtype=torch.uint8))  # larger than the whole budget: not kept
    assert (0, 3) not in cache and cache.bytes == 8
    assert cache.get((9, 9)) is None and cache.hit_rate == 0.5
    nothing = ExpertCache(budget=0)
    nothing.put((0, 0), torch.zeros(1, dtype=torch.uint8))
    assert len(nothing) == 0


def test_a_full_cache_takes_in_only_experts_used_more_than_what_they_evict():
    """Once full, a miss evicts the least recently used only where it was looked up more of late (by more than
    ADMIT_MARGIN); otherwise it is refused (used in place) and the cache keeps what it holds."""
    cache = ExpertCache(budget=8)
    for key in [(0, 0), (0, 1)]:
        assert cache.admits(key, 4)  # room left
        cache.put(key, torch.zeros(4, dtype=torch.uint8))
        assert cache.get(key) is not None  # used once each; (0, 0) is the least recently used
    assert cache.get((0, 2)) is None and not cache.admits((0, 2), 4)  # one use against one
    assert cache.get((0, 2)) is None and not cache.admits((0, 2), 4)  # two: a lead of one is noise
    assert cache.get((0, 2)) is None and cache.admits((0, 2), 4)  # three: it leads (0, 0) by two
    assert cache.get((0, 0)) is not None and cache.get((0, 0)) is not None  # (0, 0) three uses, (0, 1) the victim
    assert cache.admits((0, 2), 4) and cache.refused == 2
    assert not cache.admits((0, 3), 9) and cache.refused == 2  # larger than the whole budget: no refusal counted
    cache.put((0, 2), torch.zeros(4, dtype=torch.uint8))
    assert list(cache._entries) == [(0, 0), (0, 2)] and cache.evicted == 1
    cache.resize(4)
    assert list(cache._entries) == [(0, 2)] and cache.bytes == 4 and cache.evicted == 2


def test_a_cache_smaller_than_a_tokens_experts_does_not_copy_and_evict_per_miss(models):
    """A budget below one layer's chosen experts: a decode visits the layers in a cycle, so a cache that took in
    every miss would evict each entry before its next use (no hit, a copy per miss: a 0.1 GiB cache decoded 3.4x
    slower than none). Misses are used in place instead, the cache keeps what it holds and hits, and the tokens are
    those of no cache."""
    hf_model, container = models["B"]
    with Container(container) as c:
        expert = max(r.length for b in c.layers for r in b.experts)
        top_k = int(c.config["num_experts_per_tok"])
    ids = _prompt(20, hf_model.config.vocab_size, seed=5)
    options = GenerateOptions(max_new_tokens=40, stop_at_eos=False)
    none = generate(container, ids, replace(options, cache_gib=0.0))
    with Generator(container, cache_gib=(top_k - 1) * expert / 2**30) as g:
        small = g.generate(ids, options)
        misses = g.decoder.cache.misses
    d = small.stats["decode"]
    assert small.generated_ids == none.generated_ids
    assert misses > 10 * d["tokens"] and d["cache_evicted"] <= d["tokens"] // 4
    assert d["cache_admitted"] <= top_k + d["tokens"] // 4 and d["expert_cache_hit_rate"] > 0.05


def test_the_kv_after_a_generation_continues_it(models, tmp_path):
    """--kv-out after generating: the KV covers the prompt and every generated token (the last one was given out:
    it is fed too), its result the greedy token after them; generating on from it, without a prompt or with a new
    one, gives what one generation over all of it gives."""
    from moepack.families.deepseek_v4.kv import read_kv

    hf_model, container = models["B"]
    ids = _prompt(30, hf_model.config.vocab_size, seed=8).tolist()
    options = GenerateOptions(max_new_tokens=20, stop_at_eos=False)
    kv = str(tmp_path / "kv")
    with Generator(container) as g:  # (one container opened for all of them)
        whole = g.generate(ids, options).generated_ids
        first = g.generate(ids, replace(options, max_new_tokens=8), kv_out=kv).generated_ids
        written = read_kv(kv)
        assert written.token_ids == ids + first and written.next_token == whole[8]
        rest = g.generate([], replace(options, max_new_tokens=12), continue_from=kv,
                          kv_out=kv).generated_ids  # in place: the new KV written beside the old one, then swapped in
        assert first + rest == whole
        assert read_kv(kv).token_ids == ids + whole
        assert os.listdir(tmp_path) == ["kv"]
        more = _prompt(5, hf_model.config.vocab_size, seed=9).tolist()  # the next turn's prompt
        after = g.generate(more, replace(options, max_new_tokens=6), continue_from=kv).generated_ids
        assert after == g.generate(ids + whole + more, replace(options, max_new_tokens=6)).generated_ids


def two_letters(ids: list[int]) -> str:
    """A detokenizer of two letters a token: a stop string can begin in the middle of one."""
    return "".join(chr(97 + i % 26) + chr(97 + i // 26 % 26) for i in ids)


def check_the_kv_at_a_stop_string_holds_the_shown_tokens(container, ids: list[int], tmp_path) -> None:
    """A generation ended by a stop string writes a KV of the prompt and the tokens whose text was shown whole:
    not the stop string's (which the user never saw), nor the token it begins in the middle of. Its result is the
    greedy token after them, and generating on from it gives what the one generation gave there."""
    from moepack.families.kv_directory import read_kv
    from moepack.runtime.engine import container_kv_format

    options = GenerateOptions(max_new_tokens=16, stop_at_eos=False)
    with Generator(container) as g:
        whole = g.generate(ids, options).generated_ids
        text = two_letters(whole)
        for cut in (1, 2 * (len(whole) // 2) - 5):  # in the first token, and in the middle of a later one
            stop = next(text[cut:cut + n] for n in range(3, len(text)) if text.find(text[cut:cut + n]) == cut)
            kv = str(tmp_path / f"kv{cut}")
            r = g.generate(ids, replace(options, stop=(stop,)), detokenize=two_letters, kv_out=kv)
            assert r.finish_reason == "stop" and r.text == text[:cut]
            assert r.generated_ids == whole[:len(r.generated_ids)]
            shown = cut // 2
            written = read_kv(kv, container_kv_format(g.c))
            assert written.token_ids == ids + whole[:shown] and written.next_token == whole[shown]
            assert r.stats["kv_out"] == {"generated_tokens": shown, "dropped_tokens": len(r.generated_ids) - shown}
            on = g.generate([], replace(options, max_new_tokens=4), continue_from=kv).generated_ids
            assert on == whole[shown:shown + 4]


def test_the_kv_at_a_stop_string_holds_the_shown_tokens(models, tmp_path):
    hf_model, container = models["B"]
    check_the_kv_at_a_stop_string_holds_the_shown_tokens(container, _prompt(30, hf_model.config.vocab_size, 8).tolist(),
                                                         tmp_path)


def test_the_prompts_kv_copy_a_stop_string_may_need_is_counted_in_the_memory_check(models, tmp_path, monkeypatch):
    """generate --kv-out with --stop keeps a copy of the prompt's KV (to cut the KV back at a stop string): the
    host memory check counts it as a second prompt's KV; without --stop, or without --kv-out, nothing more."""
    import moepack.runtime.generate as generate_module

    counted: list[list[int]] = []
    real = generate_module.others_kv
    monkeypatch.setattr(generate_module, "others_kv", lambda c, others: counted.append(list(others)) or real(c, others))
    hf_model, container = models["B"]
    ids = _prompt(30, hf_model.config.vocab_size, seed=8).tolist()
    options = GenerateOptions(max_new_tokens=2, stop_at_eos=False)
    with Generator(container) as g:
        for stop, kv_out, copies in (((), True, []), (("zz",), False, []), (("zz",), True, [30])):
            counted.clear()
            g.generate(ids, replace(options, stop=stop), detokenize=two_letters,
                       kv_out=str(tmp_path / f"kv{len(stop)}") if kv_out else None, kv_overwrite=True)
            assert counted == [copies], (stop, kv_out, counted)


def test_the_command_streams_the_text_and_prints_one_json_object(models, tmp_path):
    import json

    from click.testing import CliRunner

    from moepack.cli.main import cli
    from moepack.packer.synth import synth_checkpoint

    src, container = str(tmp_path / "src"), str(tmp_path / "tiny.moepack")
    synth_checkpoint(src, preset="tiny", layout="release", progress=False)
    convert_checkpoint(src, container, policy="keep", progress=False)
    args = ["generate", container, "--prompt", "Once upon a time", "--max-new-tokens", "6", "--cache-gib", "0"]
    as_json = CliRunner().invoke(cli, [*args, "--json"])
    assert as_json.exit_code == 0, as_json.output
    out = json.loads(as_json.stdout)
    assert len(out["generated_ids"]) == 6 and out["finish_reason"] == "length"
    assert out["stats"]["decode"]["tokens"] == 5 and out["stats"]["decode"]["bytes_read_per_token"] > 0
    streamed = CliRunner().invoke(cli, args)
    assert streamed.exit_code == 0, streamed.output
    assert streamed.stdout == out["text"] + "\n"
    assert "tokens/s" in streamed.stderr
    empty = CliRunner().invoke(cli, ["generate", container, "--prompt", ""])
    assert empty.exit_code == 1 and "empty prompt" in empty.stderr


def test_a_generation_that_cannot_fit_is_refused_before_any_work(models, monkeypatch):
    """Resident weights + cache + KV + 1 GiB over the available memory: one line naming what to lower, before the
    prefill reads anything."""
    from moepack.format_spec.errors import MoepackError
    from moepack.runtime import engine, memory as memory_module

    hf_model, container = models["A"]
    monkeypatch.setattr(memory_module, "available_memory_bytes", lambda: 1 << 30)  # the headroom alone
    monkeypatch.setattr(engine.StreamingPrefill, "run", lambda *a, **k: pytest.fail("the prefill ran"))
    with pytest.raises(MoepackError, match="--cache-gib or --max-new-tokens") as e:
        generate(container, [1, 2, 3], GenerateOptions(max_new_tokens=4, cache_gib=0.5))
    assert "\n" not in str(e.value) and "0.50" in str(e.value)


def test_the_default_cache_runs_wherever_no_cache_runs(models, monkeypatch, tmp_path):
    """The default budget is what the memory this process may use leaves beside the rest of the generation (the
    refusal's own figures): with memory between what no cache needs and what the old default (every expert, within
    a quarter) needed, the default runs where an explicit budget of every expert is refused, through the command
    too; a longer generation lowers it and a shorter one raises it again. Bound by a cgroup (whose limit counts what
    the process holds) or by MemAvailable (which no longer counts the resident weights once loaded), alike."""
    import json

    from click.testing import CliRunner

    from moepack.cli.main import cli
    from moepack.runtime import memory as memory_module

    hf_model, container = models["A"]
    ids = _prompt(12, hf_model.config.vocab_size, seed=4).tolist()
    options = GenerateOptions(max_new_tokens=6, stop_at_eos=False)
    with Container(container) as c:
        routed = sum(r.length for b in c.layers for r in b.experts)
        no_cache = memory_module.memory_need(c, len(ids) + 6, 0)
        free = no_cache + routed // 2
        one_token = memory_module.memory_need(c, 1, 0)
        longest, too_long = len(ids) + 6, 1 << 24  # the longest generation no cache runs in `free`
        while longest + 1 < too_long:
            mid = (longest + too_long) // 2
            longest, too_long = (mid, too_long) if memory_module.memory_need(c, mid, 0) <= free else (longest, mid)
        room_left = free - memory_module.memory_need(c, longest, 0)
    monkeypatch.setattr(memory_module, "available_memory_bytes", lambda: free)
    monkeypatch.setattr(memory_module, "memory_limit_bytes", lambda: free)  # a cgroup's limit
    with pytest.raises(MoepackError, match="lower --cache-gib"):  # the old default: every expert
        generate(container, ids, replace(options, cache_gib=routed / 2**30))
    expected = generate(container, ids, replace(options, cache_gib=0.0)).generated_ids
    with Generator(container) as g:
        assert g.decoder.cache.budget == min(routed, free // 4, free - one_token) == free - one_token
        result = g.generate(ids, options)
        assert result.generated_ids == expected
        assert g.decoder.cache.budget == free - no_cache == routed // 2  # fitted to this generation's KV
        assert result.stats["decode"]["memory_bound_bytes"] <= free
        g._check_memory(longest)  # its KV takes nearly all the cache's room: the budget drops, no refusal
        assert g.decoder.cache.budget == room_left < routed // 2 and g.decoder.cache.bytes <= room_left
        with pytest.raises(MoepackError, match="lower --cache-gib"):
            g._check_memory(too_long)  # where no cache cannot run either, the default is refused as it is
        g._check_memory(1)
        assert g.decoder.cache.budget == free - one_token
    monkeypatch.setattr(memory_module, "memory_limit_bytes", lambda: None)  # MemAvailable binds
    with Generator(container) as g:
        held = g._held()  # the resident weights, loaded: MemAvailable is that much lower now
        assert held > 0
        monkeypatch.setattr(memory_module, "available_memory_bytes", lambda: free - held)
        g._check_memory(len(ids) + 6)
        assert g.decoder.cache.budget == free - no_cache  # not counted twice
    monkeypatch.setattr(memory_module, "available_memory_bytes", lambda: free)
    monkeypatch.setattr(memory_module, "memory_limit_bytes", lambda: free)
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    done = CliRunner().invoke(cli, ["generate", container, "--token-ids", str(tmp_path / "ids.json"),
                                    "--max-new-tokens", "6", "--json"])
    assert done.exit_code == 0, done.output
    decode = json.loads(done.stdout)["stats"]["decode"]
    assert decode["cache_budget_bytes"] == free - no_cache and decode["memory_bound_bytes"] <= free


def test_on_a_gpu_the_cache_is_counted_against_the_device_not_the_host(models, monkeypatch):
    """--device cuda keeps the expert cache on the device: a cache larger than the host's free memory is not
    refused for it, one larger than what the device has free is, in one line, before anything is read."""
    from moepack.runtime import generate as generate_module, memory as memory_module

    hf_model, container = models["A"]
    monkeypatch.setattr(generate_module, "compute_device", lambda name: torch.device("cuda", 0))
    monkeypatch.setattr(memory_module, "available_memory_bytes", lambda: 2 << 30)  # less than the cache
    monkeypatch.setattr(memory_module, "cuda_free_bytes", lambda device: 3 << 30)
    monkeypatch.setattr(generate_module, "Decoder", lambda *a, **k: pytest.fail("past the device check"))
    with pytest.raises(MoepackError, match="device memory.*lower --cache-gib") as e:
        Generator(container, cache_gib=2.5, prefill=PrefillOptions(device="cuda"))
    assert "\n" not in str(e.value) and "2.50" in str(e.value) and "cuda:0" in str(e.value)
    with pytest.raises(pytest.fail.Exception, match="past the device check"):  # 1.5 GiB of cache fits there
        Generator(container, cache_gib=1.5, prefill=PrefillOptions(device="cuda"))
    # the default budget on a GPU: every expert decoded as float32 within half of the device's free memory
    with Container(container) as c:
        decoded = 4 * sum(t.numel for b in c.layers for r in b.experts for t in r.tensors
                          if t.name.endswith(".weight"))
    monkeypatch.setattr(memory_module, "cuda_free_bytes", lambda device: 64 << 30)
    with Container(container) as c:
        assert memory_module.default_cache_bytes(c, torch.device("cuda", 0)) == decoded > 0
        besides = memory_module.device_memory_need(c, 0)  # resident weights + headroom
        for free, default in [(2 * besides, decoded), (besides + decoded // 2, decoded // 2), (besides - 1, 0)]:
            monkeypatch.setattr(memory_module, "cuda_free_bytes", lambda device: free)
            assert memory_module.default_cache_bytes(c, torch.device("cuda", 0)) == min(default, free // 2)


def test_each_gpu_generation_checks_the_device_for_its_kv_and_the_cache_still_to_fill(models, monkeypatch):
    """Before each generation on a GPU: the KV of prompt + new tokens (its prefill's state, and what the decode's
    arena takes for it) and the part of the cache's budget not yet filled must fit what the device has free (the
    resident weights, loaded already, are not counted again)."""
    from moepack.runtime import memory as memory_module
    from moepack.families.deepseek_v4.kv import kv_bytes

    hf_model, container = models["A"]
    with Generator(container, cache_gib=0.01) as g:
        g.decoder.cache.bytes = g.cache_bytes // 2  # half of the budget filled
        g.device = torch.device("cuda", 0)
        arena = g.decoder.arithmetic.device_kv_growth([4000], g.device)
        assert arena > 0
        need = kv_bytes(g.c.config, 4000) + arena + (g.cache_bytes - g.cache_bytes // 2) + (1 << 30)
        monkeypatch.setattr(memory_module, "cuda_free_bytes", lambda device: need)
        g._check_memory(4000)  # fits exactly
        monkeypatch.setattr(memory_module, "cuda_free_bytes", lambda device: need - 1)
        with pytest.raises(MoepackError, match="KV .*lower --cache-gib or --max-new-tokens"):
            g._check_memory(4000)
        g.decoder.cache.bytes = 0


def _prompt_scores_on(device: str, hf_model, container, ids) -> None:
    """The prompt's log-probabilities (GenerateOptions.prompt_logprobs) and the perplexity of its windows computed
    on `device` in float32: transformers' log_softmax of each position, the windows' figure as the CPU's."""
    from moepack.runtime.perplexity import perplexity

    options = PrefillOptions(device=device, compute_dtype="float32")
    result = generate(container, ids, GenerateOptions(max_new_tokens=1, prompt_logprobs=2, prefill=options))
    with torch.no_grad():
        want = torch.log_softmax(hf_model(ids[None]).logits[0, :-1].double(), dim=-1)
    got = result.prompt_logprobs
    assert got[0] is None and [e.token for e in got[1:]] == ids[1:].tolist()
    torch.testing.assert_close(torch.tensor([e.logprob for e in got[1:]], dtype=torch.float64),
                               want.gather(1, ids[1:, None])[:, 0], atol=2e-3, rtol=0)
    on_device = perplexity(container, ids, 16, options, tokens_per_pass=64)
    on_cpu = perplexity(container, ids, 16, PrefillOptions(compute_dtype="float32"))
    assert on_device["perplexity"] == pytest.approx(on_cpu["perplexity"], rel=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_prompt_logprobs_and_perplexity_equal_the_reference(wide_models):
    """On a GPU the LM head over every prompt position (a vocabulary slice at a time, its running scores on the
    device) gives transformers' log-probabilities, and the perplexity the CPU's."""
    hf_model, container = wide_models["C"]
    _prompt_scores_on("cuda", hf_model, container, _prompt(70, hf_model.config.vocab_size, seed=9))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there")
def test_generate_on_a_missing_cuda_device_is_one_line(models, tmp_path):
    from click.testing import CliRunner

    from moepack.cli.main import cli

    _, container = models["A"]
    (tmp_path / "ids.json").write_text("[1, 2]")
    done = CliRunner().invoke(cli, ["generate", container, "--token-ids", str(tmp_path / "ids.json"), "--device",
                                    "cuda"])
    assert done.exit_code == 1 and len(done.stderr.strip().splitlines()) == 1 and "cuda" in done.stderr.lower()


def test_one_generator_serves_several_generations_with_its_cache_kept(models):
    """A Generator opens the container once: the second generation of the same prompt finds its experts in the
    cache the first one filled (no expert read), and gives the same tokens as a fresh generate()."""
    from moepack.runtime.generate import Generator

    hf_model, container = models["B"]
    ids = _prompt(12, hf_model.config.vocab_size, seed=2)
    options = GenerateOptions(max_new_tokens=10, stop_at_eos=False)
    with Generator(container, cache_gib=1.0) as g:
        first = g.generate(ids, options)
        second = g.generate(ids, options)
        stop_early = g.generate(ids, options, cancelled=lambda: True)  # before the prefill's first layer
        asked = []  # asked before each prefill layer, then after each token
        n_layers = len(g.c.layers)
        stop_in_decode = g.generate(ids, options, cancelled=lambda: (asked.append(1), len(asked) > n_layers)[1])
    assert first.generated_ids == second.generated_ids == generate(container, ids, options).generated_ids
    # the prompt's experts came from the prefill's reads: seeding read nothing again
    assert first.stats["decode"]["cache_from_prefill_bytes"] > 0 and first.stats["decode"]["cache_seed_bytes"] == 0
    assert second.stats["decode"]["bytes_read"] == 0 and second.stats["decode"]["expert_cache_hit_rate"] == 1.0
    assert stop_early.finish_reason == "cancelled" and stop_early.generated_ids == []
    assert stop_early.stats["prefill"]["cancelled_after_layers"] == 0
    assert stop_in_decode.finish_reason == "cancelled" and len(stop_in_decode.generated_ids) == 1


@pytest.mark.parametrize("fraction", [0.3, 1.0])
def test_the_cache_keeps_the_prompts_most_used_experts_from_the_prefills_reads(models, fraction):
    """The prefill hands its experts to the cache while it has room; seeding then holds exactly the experts the
    prompt used most (greedy by count within the budget: those kept but used less go), reads only what the prefill
    could not keep, and leaves the most used as the most recently used."""
    hf_model, container = models["random11"]
    ids = _prompt(40, hf_model.config.vocab_size, seed=9)
    with Generator(container, cache_gib=1.0) as g:
        d = g.decoder
        routed = sum(b.experts[e].length for b in d.blocks for e in range(len(b.experts)))
        d.cache = ExpertCache(int(fraction * routed))
        _, states, _, counts, *_ = g._prefill(ids, None, 1)
        kept = set(d._from_prefill)
        assert kept and all(key in d.cache for key in kept)
        d.begin(states)
        d.seed(counts)
        ranked = sorted(((n, layer, e) for layer, c in enumerate(counts) for e, n in enumerate(c) if n), reverse=True)
        room, wanted = d.cache.budget, []
        for _, layer, e in ranked:
            if d.blocks[layer].experts[e].length <= room:
                wanted.append((layer, e))
                room -= d.blocks[layer].experts[e].length
        assert list(d.cache._entries) == wanted[::-1]  # least used first out
        assert d.cache.bytes <= d.cache.budget
        read = sum(d.blocks[layer].experts[e].length for layer, e in set(wanted) - kept)
        assert d.stats.seed_bytes == read and d.stats.prefill_kept_bytes == sum(
            d.blocks[layer].experts[e].length for layer, e in kept)
        if fraction == 1.0:
            assert d.stats.seed_bytes == 0
        else:  # the case where the prefill's first-come experts are not all the most used ones
            assert kept - set(wanted) and set(wanted) - kept


def test_a_prefill_over_resident_dense_weights_is_the_streamed_one(models):
    """The server's prefill runs through the decoder's resident dense weights: the same logits to the bit, and
    only the experts (and globals) read."""
    from moepack.format_spec.reader import Container
    from moepack.runtime.engine import StreamingPrefill
    from moepack.runtime.generate import Generator

    hf_model, container = models["A"]
    ids = _prompt(50, hf_model.config.vocab_size, seed=9)
    with Generator(container, cache_gib=0.0) as g:
        resident = g.decoder.dense
        with Container(container) as c:
            for dense in (None, resident):
                engine = StreamingPrefill(c, PrefillOptions(expert_selection="all"), resident_dense=dense)
                try:
                    result = engine.run(ids)
                finally:
                    engine.close()
                if dense is None:
                    streamed = result
            dense_bytes = sum(b.dense.length for b in c.layers)
    assert torch.equal(result.logits, streamed.logits)
    assert result.stats["bytes_read"] == streamed.stats["bytes_read"] - dense_bytes


def test_prompt_logprobs_and_perplexity_equal_the_reference_on_the_cpu(wide_models):
    """The CUDA test's body on this CPU (DeepSeek-V4's head over every prompt position: transformers'
    log-probabilities), so that a device run finds it sound."""
    hf_model, container = wide_models["C"]
    _prompt_scores_on("cpu", hf_model, container, _prompt(70, hf_model.config.vocab_size, seed=9))
