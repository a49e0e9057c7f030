"""Continuous batching (runtime/batching.py's BatchScheduler, `moepack serve --max-batch`): sequences decoding together,
joining and leaving at step boundaries, give each the tokens it gets decoded alone by Generator.generate."""

from __future__ import annotations

import copy
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from moepack.families.deepseek_v4.kv import kv_bytes
from moepack.format_spec.errors import MoepackError
from moepack.runtime import memory as memory_module
from moepack.runtime.batching import BatchScheduler
from moepack.runtime.engine import PrefillOptions, StreamingPrefill
from moepack.runtime.expert_decode import fused_available
from moepack.runtime.generate import GenerateOptions, Generator
from moepack.runtime.memory import memory_need
from moepack.serve.app import ServerLimits, make_app
from moepack.serve.tokenizer import PromptTokenizer
from containers import tiny_keep_container
from test_prefill import BAD_PROMPTS
from test_serve import Running

TIMEOUT = 120


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_keep_container(tmp_path_factory)


@pytest.fixture(scope="module")
def generator(tiny):
    with Generator(tiny, cache_gib=0.5) as g:
        yield g


@pytest.fixture(scope="module")
def decode(generator):
    return PromptTokenizer(generator.c).decode


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _solo(g, ids, **options):
    return g.generate(ids, GenerateOptions(**{"stop_at_eos": False, **options}))


class Batch:
    """A BatchScheduler over `g` that records each step's batch size; `submit` as the scheduler's, with
    stop_at_eos off unless given."""

    def __init__(self, g, **kw):
        self.sizes: list[int] = []
        self.scheduler = BatchScheduler(g, on_step=self.sizes.append, **kw)

    def submit(self, ids, on_token=None, cancelled=None, detokenize=None, **options):
        return self.scheduler.submit(ids, GenerateOptions(**{"stop_at_eos": False, **options}), detokenize=detokenize,
                                     on_token=on_token, cancelled=cancelled)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.scheduler.close()


def _tokens_seen(n: int):
    """An on_token that sets the returned event once n tokens went through it."""
    seen, event = [], threading.Event()

    def on_token(token, logprob):
        seen.append(token)
        if len(seen) >= n:
            event.set()
    return on_token, event


def test_concurrent_greedy_sequences_equal_each_decoded_alone(generator):
    vocab = generator.cfg.vocab_size
    cases = [(_prompt(3, 1, vocab), 14), (_prompt(23, 2, vocab), 6), (_prompt(41, 3, vocab), 18),
             (_prompt(9, 4, vocab), 10), (_prompt(1, 5, vocab), 12)]
    alone = [_solo(generator, ids, max_new_tokens=new).generated_ids for ids, new in cases]
    with Batch(generator, max_batch=4) as batch:
        on_token, two_out = _tokens_seen(2)
        futures = [batch.submit(cases[0][0], max_new_tokens=cases[0][1], on_token=on_token)]
        assert two_out.wait(TIMEOUT)  # the others join a sequence already decoding, at different steps
        on_token, three_out = _tokens_seen(3)
        futures += [batch.submit(cases[1][0], max_new_tokens=cases[1][1], on_token=on_token),
                    batch.submit(cases[2][0], max_new_tokens=cases[2][1])]
        assert three_out.wait(TIMEOUT)
        futures += [batch.submit(ids, max_new_tokens=new) for ids, new in cases[3:]]
        results = [f.result(TIMEOUT) for f in futures]
    assert [r.generated_ids for r in results] == alone
    assert all(r.finish_reason == "length" for r in results)
    assert max(batch.sizes) == 4  # at most max_batch at once; the fifth waited for a slot
    assert 1 in batch.sizes and len(set(batch.sizes)) >= 3  # sequences joined and left between steps
    assert all(r.stats["decode"]["steps"] == len(r.generated_ids) - 1 for r in results)
    assert max(r.stats["decode"]["mean_batch"] for r in results) > 1


def test_a_steps_plain_greedy_rows_are_chosen_together_as_each_alone(generator, monkeypatch):
    """At each step the rows whose sampler is plain greedy get their tokens from one greedy_choices call (one copy
    to the host for all of them, where the logits are); sampled rows and rows with logprobs go their own way; every
    sequence's tokens are its solo run's."""
    from moepack.runtime import batching

    calls = []

    def counted(rows):
        calls.append(rows.shape[0])
        return greedy_choices(rows)
    greedy_choices = batching.greedy_choices
    monkeypatch.setattr(batching, "greedy_choices", counted)
    vocab = generator.cfg.vocab_size
    cases = [(_prompt(5 + i, 20 + i, vocab), options) for i, options in enumerate(
        [{}, {}, {}, dict(temperature=0.9, seed=3), dict(logprobs=2)])]
    alone = [_solo(generator, ids, max_new_tokens=8, **options).generated_ids for ids, options in cases]
    with Batch(generator, max_batch=5) as batch:
        futures = [batch.submit(ids, max_new_tokens=8, **options) for ids, options in cases]
        results = [f.result(TIMEOUT) for f in futures]
    assert [r.generated_ids for r in results] == alone
    assert max(calls) == 3 and len(calls) <= 8  # (one call a step: 7 steps after the prompts' first tokens)


def test_a_seeded_sampled_sequence_in_a_batch_equals_its_solo_run(generator):
    vocab = generator.cfg.vocab_size
    sampled = dict(max_new_tokens=16, temperature=0.9, top_k=20, seed=1234, presence_penalty=0.5)
    ids = _prompt(12, 7, vocab)
    alone = _solo(generator, ids, **sampled)
    other = _solo(generator, _prompt(30, 8, vocab), max_new_tokens=20)
    with Batch(generator, max_batch=3) as batch:
        futures = [batch.submit(_prompt(30, 8, vocab), max_new_tokens=20), batch.submit(ids, **sampled),
                   batch.submit(ids, **{**sampled, "seed": 99})]
        results = [f.result(TIMEOUT) for f in futures]
    assert results[0].generated_ids == other.generated_ids
    assert results[1].generated_ids == alone.generated_ids
    assert results[1].stats["sampling_seed"] == 1234
    assert results[2].generated_ids != alone.generated_ids  # its own sampler: another seed, other tokens


def test_stop_strings_and_max_new_tokens_are_each_sequences_own(generator, decode):
    vocab = generator.cfg.vocab_size
    ids = _prompt(10, 11, vocab)
    whole = generator.generate(ids, GenerateOptions(max_new_tokens=24, stop_at_eos=False), detokenize=decode)
    text = whole.text
    at = next(i for i in range(4, len(text) - 3) if text.find(text[i:i + 3]) == i and text[i:i + 3].strip())
    stop = text[at:at + 3]
    with Batch(generator, max_batch=3) as batch:
        pieces = []
        stopped = batch.scheduler.submit(ids, GenerateOptions(max_new_tokens=24, stop=(stop,), stop_at_eos=False),
                                         detokenize=decode, on_text=pieces.append)
        short = batch.submit(_prompt(5, 12, vocab), max_new_tokens=3)
        long = batch.submit(ids, max_new_tokens=24, detokenize=decode)
        stopped, short, long = (f.result(TIMEOUT) for f in (stopped, short, long))
    assert stopped.finish_reason == "stop" and stopped.text == text[:at] and "".join(pieces) == text[:at]
    assert len(short.generated_ids) == 3 and short.finish_reason == "length"
    assert long.text == text and long.generated_ids == whole.generated_ids


def test_cancelling_one_sequence_leaves_the_others_outputs_unchanged(generator):
    vocab = generator.cfg.vocab_size
    cases = [(_prompt(7, 21, vocab), 16), (_prompt(15, 22, vocab), 16), (_prompt(4, 23, vocab), 12)]
    alone = [_solo(generator, ids, max_new_tokens=new).generated_ids for ids, new in cases]
    with Batch(generator, max_batch=3) as batch:
        on_token, three_out = _tokens_seen(3)
        futures = [batch.submit(cases[0][0], max_new_tokens=16),
                   batch.submit(cases[1][0], max_new_tokens=16, on_token=on_token, cancelled=three_out.is_set),
                   batch.submit(cases[2][0], max_new_tokens=12)]
        results = [f.result(TIMEOUT) for f in futures]
    assert results[1].finish_reason == "cancelled" and results[1].generated_ids == alone[1][:3]
    assert results[0].generated_ids == alone[0] and results[2].generated_ids == alone[2]
    # cancelled while queued or prefilling: stopped before the prefill's next layer, no token
    with Batch(generator, max_batch=1) as batch:
        first = batch.submit(cases[0][0], max_new_tokens=16)
        gone = batch.submit(cases[1][0], max_new_tokens=16, cancelled=lambda: True)
        assert gone.result(TIMEOUT).finish_reason == "cancelled" and not gone.result().generated_ids
        assert gone.result().stats["prefill"]["cancelled_after_layers"] == 0
        assert first.result(TIMEOUT).generated_ids == alone[0]


def test_a_chunked_prefill_gives_the_tokens_of_an_unchunked_one(generator):
    vocab = generator.cfg.vocab_size
    long_prompt, other = _prompt(45, 31, vocab), _prompt(6, 32, vocab)
    alone = _solo(generator, long_prompt, max_new_tokens=8, prompt_logprobs=3)
    other_alone = _solo(generator, other, max_new_tokens=30)
    handed = []
    with Batch(generator, max_batch=2, prefill_chunk=7) as batch:
        on_token, decoding = _tokens_seen(2)
        first = batch.submit(other, max_new_tokens=30, on_token=on_token)
        assert decoding.wait(TIMEOUT)
        chunked = batch.scheduler.submit(long_prompt, GenerateOptions(max_new_tokens=8, stop_at_eos=False,
                                                                      prompt_logprobs=3),
                                         on_prompt_logprobs=handed.append).result(TIMEOUT)
        assert first.result(TIMEOUT).generated_ids == other_alone.generated_ids
    assert chunked.stats["prefill"]["chunks"] == 7 and chunked.stats["prefill"]["tokens"] == 45
    assert chunked.generated_ids == alone.generated_ids
    assert alone.stats["prefill"].get("chunks") is None  # alone: one run
    # the prompt's log-probabilities: each chunk's first token scored from the chunk before's logits
    assert handed == [chunked.prompt_logprobs] and first.result().prompt_logprobs is None
    assert alone.prompt_logprobs[0] is None and chunked.prompt_logprobs[0] is None
    for a, b in zip(alone.prompt_logprobs[1:], chunked.prompt_logprobs[1:], strict=True):
        assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4
        assert [i for i, _ in a.top] == [i for i, _ in b.top] and len(a.top) == 3
    assert [e.token for e in alone.prompt_logprobs[1:]] == long_prompt[1:]


def test_lm_evals_is_greedy_holds_at_a_chunks_first_token(generator):
    """lm-eval's is_greedy (a token's logprob == its top's, float equality) for a greedy continuation prefilled in
    chunks beside a decoding sequence: a chunk's first token, scored from the chunk before's logits (TokenLogprob.of),
    as exact as the others (NextTokenScores)."""
    context = _prompt(6, 41, generator.cfg.vocab_size)
    greedy = _solo(generator, context, max_new_tokens=14).generated_ids
    with Batch(generator, max_batch=2, prefill_chunk=5) as batch:
        on_token, decoding = _tokens_seen(2)
        other = batch.submit(_prompt(3, 42, generator.cfg.vocab_size), max_new_tokens=40, on_token=on_token)
        assert decoding.wait(TIMEOUT)
        scored = batch.submit(context + greedy, max_new_tokens=1, prompt_logprobs=1).result(TIMEOUT)
        other.result(TIMEOUT)
    assert scored.stats["prefill"]["chunks"] > 2
    continuation = scored.prompt_logprobs[len(context):]
    assert [e.token for e in continuation] == greedy
    assert all(e.logprob == max(v for _, v in e.top) for e in continuation)


def test_a_sequence_that_does_not_fit_beside_the_others_is_refused_alone(generator, monkeypatch):
    vocab = generator.cfg.vocab_size
    first_ids, second_ids = _prompt(8, 41, vocab), _prompt(8, 42, vocab)
    alone = _solo(generator, first_ids, max_new_tokens=30)
    c = generator.c
    one = memory_need(c, 8 + 30, generator.host_cache_bytes)
    free = one + kv_bytes(c.config, 8 + 30) // 2  # room for one sequence's KV, not two
    monkeypatch.setattr(memory_module, "memory_for_generation", lambda held=0: free)
    with Batch(generator, max_batch=2) as batch:
        on_token, decoding = _tokens_seen(2)
        first = batch.submit(first_ids, max_new_tokens=30, on_token=on_token)
        assert decoding.wait(TIMEOUT)
        second = batch.submit(second_ids, max_new_tokens=30)
        with pytest.raises(MoepackError, match="beside the KV of the sequences decoding"):
            second.result(TIMEOUT)
        assert "\n" not in str(second.exception())
        assert first.result(TIMEOUT).generated_ids == alone.generated_ids


def test_bad_options_are_refused_when_submitted(generator):
    with Batch(generator) as batch:
        with pytest.raises(MoepackError, match="--max-new-tokens"):
            batch.submit([1, 2], max_new_tokens=0)
        with pytest.raises(MoepackError, match="--stop needs"):
            batch.submit([1, 2], stop=("x",))
        with pytest.raises(MoepackError, match="empty prompt"):
            batch.submit([], max_new_tokens=2)
        for bad in (-1, 21, 1.5, True):
            with pytest.raises(MoepackError, match="prompt_logprobs must be an integer in"):
                batch.submit([1, 2], prompt_logprobs=bad)
        with pytest.raises(MoepackError, match="stop_token_ids must be token ids"):
            batch.submit([1, 2], stop_token_ids=(3, -1))
    with pytest.raises(MoepackError, match="--max-batch"):
        BatchScheduler(generator, max_batch=0)


def test_bad_token_ids_are_refused_by_generate_and_submit(generator):
    """As by prefill (test_prefill.BAD_PROMPTS): none rounded, run as one prompt, or a traceback."""
    with Batch(generator) as batch:
        for ids, message in BAD_PROMPTS:
            with pytest.raises(MoepackError, match=re.escape(message)):
                generator.generate(ids, GenerateOptions(max_new_tokens=1))
            with pytest.raises(MoepackError, match=re.escape(message)):
                batch.submit(ids)


PROMPTS = [f"Client {i} asks about streaming experts" + " and more" * i for i in range(3)]
GREEDY = {"max_tokens": 16, "temperature": 0}


@pytest.fixture(scope="module")
def sequential_answers(tiny):
    """Each of PROMPTS answered by a server of one generation at a time (--max-batch 1)."""
    with Generator(tiny, cache_gib=0.5) as g:
        running = Running(make_app(g, "tiny", log=lambda line: None, max_queue=8))
        try:
            with httpx.Client(base_url=running.url, timeout=TIMEOUT) as http:
                assert http.get("/health").json()["max_batch"] == 1
                return [http.post("/v1/completions", json={**GREEDY, "prompt": p}).json()["choices"][0]["text"]
                        for p in PROMPTS]
        finally:
            running.stop()


@pytest.fixture(scope="module")
def batched(tiny):
    """A server of --max-batch 4 (prompts prefilled 8 tokens at a time while others decode), its log lines in
    .logs."""
    logs: list[str] = []
    with Generator(tiny, cache_gib=0.5) as g:
        running = Running(make_app(g, "tiny", log=logs.append, max_queue=8, max_batch=4, prefill_chunk=8))
        running.logs = logs
        try:
            yield running
        finally:
            running.stop()


def _text(http, prompt, **body):
    r = http.post("/v1/completions", json={**GREEDY, "prompt": prompt, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_serve_with_max_batch_answers_concurrent_clients_as_sequential_ones(batched, sequential_answers):
    with httpx.Client(base_url=batched.url, timeout=TIMEOUT) as http:
        assert http.get("/health").json()["max_batch"] == 4
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: _text(http, p), PROMPTS))
        streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in http.post(
            "/v1/completions", json={**GREEDY, "prompt": PROMPTS[2], "stream": True}).text.splitlines()
            if line.startswith("data: {"))
        n = http.post("/v1/completions", json={**GREEDY, "prompt": PROMPTS[0], "n": 3, "temperature": 1.0,
                                               "seed": 5}).json()
        metrics = http.get("/metrics").text
    assert got == sequential_answers
    assert streamed == sequential_answers[2]
    assert [c["index"] for c in n["choices"]] == [0, 1, 2] and n["usage"]["completion_tokens"] == 48
    assert "moepack_decode_batch_size_bucket" in metrics and "moepack_sequences_decoding" in metrics
    sizes = {line.split()[0]: float(line.split()[-1]) for line in metrics.splitlines()
             if line.startswith("moepack_decode_batch_size_")}
    assert sizes["moepack_decode_batch_size_count"] > sizes['moepack_decode_batch_size_bucket{le="1.0"}']


def test_serve_with_max_batch_cancels_a_vanished_client_alone(batched, sequential_answers):
    with httpx.Client(base_url=batched.url, timeout=TIMEOUT) as http, ThreadPoolExecutor(2) as pool:
        other = pool.submit(_text, http, PROMPTS[1])
        with http.stream("POST", "/v1/completions", json={**GREEDY, "prompt": PROMPTS[0], "max_tokens": 3000,
                                                          "stream": True}) as r:
            next(line for line in r.iter_lines() if line.startswith("data: {"))  # decoding: then it leaves
        assert other.result(TIMEOUT) == sequential_answers[1]
        t0 = time.monotonic()
        while not any("finish=cancelled" in line for line in batched.logs):
            assert time.monotonic() - t0 < 10, batched.logs[-3:]
            time.sleep(0.05)
    gone = [line for line in batched.logs if "finish=cancelled" in line]
    assert int(gone[0].split("generated_tokens=")[1].split()[0]) < 3000


def _streamed_chunks(http, body: dict) -> list[dict]:
    """A streamed completion's chunks, in the order they came."""
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def _early_stop(first: str, other: str) -> str:
    """A short printable piece near the start of `first` that `other` never holds: a stop string that ends the
    first choice early and leaves the other going to max_tokens."""
    for length in (1, 2, 3, 4):
        for start in range(len(first) // 3):
            piece = first[start:start + length]
            if piece.isascii() and piece.isprintable() and piece.strip() and piece not in other:
                return piece
    pytest.skip("no stop string parts these two choices")


def test_a_streamed_choice_that_ends_first_sends_its_finish_chunk_at_once(tiny, batched, generator):
    """n = 2, streamed: the choice that ends early (a stop string) has its finish chunk sent when it ends, before
    the other choice's later tokens, whether the choices decode side by side or one after the other."""
    body = {"prompt": PROMPTS[1], "n": 2, "temperature": 1.0, "seed": 11, "max_tokens": 40,
            "logit_bias": {str(e): -100 for e in generator.eos_ids}}
    sequential = Running(make_app(Generator(tiny, cache_gib=0.5), "tiny", log=lambda line: None))
    try:
        for running in (batched, sequential):
            with httpx.Client(base_url=running.url, timeout=TIMEOUT) as http:
                whole = http.post("/v1/completions", json=body).json()["choices"]
                stop = _early_stop(whole[0]["text"], whole[1]["text"])
                chunks = _streamed_chunks(http, {**body, "stop": [stop]})
            choices = [c["choices"][0] for c in chunks if c["choices"]]
            ends = [k for k, c in enumerate(choices) if c["finish_reason"] is not None]
            assert [choices[k]["index"] for k in ends] == [0, 1]
            assert [choices[k]["finish_reason"] for k in ends] == ["stop", "length"]
            later = [c for c in choices[ends[0]:] if c["index"] == 1 and c["text"]]
            assert later, "the other choice's tokens all came before the first one's finish chunk"
    finally:
        sequential.stop()
        sequential.app.state.server.generator.close()


def test_serve_with_max_batch_ends_a_request_at_its_deadline(tiny):
    logs: list[str] = []
    with Generator(tiny, cache_gib=0.5) as g:
        running = Running(make_app(g, "tiny", log=logs.append, max_batch=4,
                                   limits=ServerLimits(request_timeout_s=2.0)))
        try:
            late = httpx.post(f"{running.url}/v1/completions", timeout=TIMEOUT,
                              json={**GREEDY, "prompt": PROMPTS[0], "max_tokens": 3000}).json()
        finally:
            running.stop()
    assert late["choices"][0]["finish_reason"] == "timeout" and 0 < late["usage"]["completion_tokens"] < 3000
    assert any("finish=timeout" in line for line in logs)


def test_a_sequence_whose_callback_fails_fails_alone(generator):
    vocab = generator.cfg.vocab_size
    ids = _prompt(9, 51, vocab)
    alone = _solo(generator, ids, max_new_tokens=12)

    def broken(token, logprob):
        raise RuntimeError("the client's callback broke")
    with Batch(generator, max_batch=2) as batch:
        futures = [batch.submit(ids, max_new_tokens=12), batch.submit(_prompt(5, 52, vocab), max_new_tokens=12,
                                                                      on_token=broken)]
        with pytest.raises(RuntimeError, match="callback broke"):
            futures[1].result(TIMEOUT)
        assert futures[0].result(TIMEOUT).generated_ids == alone.generated_ids


def test_the_serve_command_takes_max_batch(tiny):
    import os
    import signal
    import subprocess
    import sys

    from click.testing import CliRunner

    from moepack.cli.main import cli

    refused = CliRunner().invoke(cli, ["serve", tiny, "--max-batch", "0"])
    assert refused.exit_code == 2 and "--max-batch" in refused.output
    proc = subprocess.Popen([sys.executable, "-m", "moepack", "serve", tiny, "--port", "0", "--cache-gib", "0.1",
                             "--max-batch", "3", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["max_batch"] == 3 and ready["prompt_cache_gib"] == 4  # (its default with --max-batch above 1)
        url = f"http://127.0.0.1:{ready['port']}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                health = httpx.get(f"{url}/health", timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert health.json()["max_batch"] == 3
        with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
            assert _text(http, PROMPTS[0], max_tokens=4) == _text(http, PROMPTS[0], max_tokens=4)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)  # stops on SIGTERM: the batch's worker let go of the generator, then it closed
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
            raise


# --- prompts prefilled together (StreamingPrefill.run_many, the scheduler's grouped passes) ----------------------
def _tensors(state) -> list[torch.Tensor]:
    """Every tensor of a LayerKVState (its window, its compressors' entries, buffers and overlaps)."""
    parts = [state.window_kv]
    for comp in (state.compressor, state.indexer):
        if comp is not None:
            parts += [t for t in (comp.compressed_kv, comp.buffer_kv, comp.buffer_gate, comp.overlap_kv,
                                  comp.overlap_gate) if t is not None]
    return parts


def _greedy_after(g, states, logits, n: int) -> list[int]:
    """n greedy tokens decoded from a prefill's states and last logits."""
    sequence, tokens = g.decoder.start(states), [int(torch.argmax(logits))]
    while len(tokens) < n:
        tokens.append(int(torch.argmax(g.decoder.step_batch([sequence], [tokens[-1]])[0])))
    return tokens


def test_prompts_prefilled_in_one_pass_get_their_solo_prefills(generator):
    vocab = generator.cfg.vocab_size
    earlier, prompts = _prompt(12, 61, vocab), [_prompt(9, 62, vocab), _prompt(1, 63, vocab), _prompt(30, 64, vocab)]
    engine = generator.prefill_engine()
    try:
        past = engine.run(torch.tensor(earlier), keep_kv=True).states  # the third continues a past state
        pasts = [None, None, past]
        alone = [engine.run(torch.tensor(ids), copy.deepcopy(p), keep_kv=True) for ids, p in zip(prompts, pasts)]
        together = engine.run_many([torch.tensor(ids) for ids in prompts], [None, None, copy.deepcopy(past)])
    finally:
        engine.close()
    for solo, grouped, ids, p in zip(alone, together, prompts, pasts):
        # the same rows through the same weights; a matmul over more rows may round differently (float32)
        torch.testing.assert_close(grouped.logits, solo.logits, rtol=1e-5, atol=1e-5)
        assert grouped.tokens_per_expert == solo.tokens_per_expert
        assert sum(map(sum, grouped.tokens_per_expert)) == len(ids) * generator.cfg.num_experts_per_tok * len(
            grouped.tokens_per_expert)
        assert [s.seen_tokens for s in grouped.states] == [len(ids) + (12 if p else 0)] * generator.cfg.num_layers
        for a, b in zip(solo.states, grouped.states):
            for x, y in zip(_tensors(a), _tensors(b), strict=True):
                torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)
        assert grouped.stats["tokens"] == len(ids) and grouped.stats["group_prompts"] == 3
        assert grouped.stats["group_tokens"] == 40
        assert _greedy_after(generator, grouped.states, grouped.logits, 8) == _greedy_after(
            generator, solo.states, solo.logits, 8)


@pytest.mark.skipif(not fused_available(), reason="the fused FP4 kernel needs AVX512-BF16 and a C compiler")
def test_a_prompt_prefilled_beside_others_keeps_its_own_fused_expert_kernel(tiny):
    """bf16 experts on up to fused_max_tokens tokens run the fused FP4 kernel, which rounds otherwise than the
    decoded matmul: each prompt's rows of a grouped pass take the kernel its own count chooses, never the group's."""
    ids = torch.tensor(_prompt(40, 71, 512))
    with Generator(tiny, cache_gib=0) as probe:
        engine = probe.prefill_engine()
        counts = engine.run(ids, keep_kv=True).tokens_per_expert
        engine.close()
    most = max(max(layer) for layer in counts if layer)  # alone every expert is fused; two copies: the busiest not
    options = PrefillOptions(compute_dtype="bfloat16", fused_max_tokens=most)
    with Generator(tiny, cache_gib=0, prefill=options) as g:
        engine = g.prefill_engine()
        try:
            alone = engine.run(ids, keep_kv=True)
            together = engine.run_many([ids, ids, ids[:5]], [None, None, None])
        finally:
            engine.close()
    for grouped in together[:2]:
        torch.testing.assert_close(grouped.logits, alone.logits, rtol=1e-5, atol=1e-5)
        for a, b in zip(alone.states, grouped.states):
            for x, y in zip(_tensors(a), _tensors(b), strict=True):
                torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)


def test_a_grouped_pass_refuses_what_runs_one_prompt_at_a_time(generator):
    engine = generator.prefill_engine()
    try:
        with pytest.raises(MoepackError, match="no prompt"):
            engine.run_many([])
        with pytest.raises(MoepackError, match="empty prompt"):
            engine.run_many([torch.tensor([3, 4]), torch.tensor([], dtype=torch.long)])
        engine.on_layer_kv = lambda layer, state: None  # what a kv_out writer hands the layers to
        with pytest.raises(MoepackError, match="one prompt at a time"):
            engine.run_many([torch.tensor([3, 4])])
    finally:
        engine.close()


def _submitted_together(batch, cases, **kw) -> list:
    """The cases (ids, max_new_tokens) submitted while the worker is held: it finds them all waiting at once."""
    with batch.scheduler._cv:
        return [batch.submit(ids, max_new_tokens=new, **kw) for ids, new in cases]


def test_newcomers_are_admitted_together_up_to_max_batch_and_prefilled_in_one_pass(generator):
    vocab = generator.cfg.vocab_size
    cases = [(_prompt(n, 70 + n, vocab), new) for n, new in ((5, 9), (17, 4), (1, 7), (33, 12), (8, 6))]
    alone = [_solo(generator, ids, max_new_tokens=new).generated_ids for ids, new in cases]
    with Batch(generator, max_batch=4) as batch:
        results = [f.result(TIMEOUT) for f in _submitted_together(batch, cases)]
    assert [r.generated_ids for r in results] == alone
    prefills = [r.stats["prefill"] for r in results]
    # the first four in one pass (nothing decoding: every prompt whole), the fifth once a slot was free
    assert [p["group_prompts"] for p in prefills] == [4, 4, 4, 4, 1]
    assert [p["tokens"] for p in prefills] == [5, 17, 1, 33, 8] and prefills[0]["group_tokens"] == 56
    assert max(batch.sizes) == 4 and batch.sizes[0] == 4


def test_a_group_shares_one_prefill_chunk_first_come_first_served(generator):
    vocab = generator.cfg.vocab_size
    first, rest = (_prompt(4, 80, vocab), 30), [(_prompt(n, 80 + n, vocab), 5) for n in (11, 6, 9)]
    alone = [_solo(generator, ids, max_new_tokens=new).generated_ids for ids, new in (first, *rest)]
    with Batch(generator, max_batch=4, prefill_chunk=8) as batch:
        on_token, decoding = _tokens_seen(2)
        head = batch.submit(first[0], max_new_tokens=first[1], on_token=on_token)
        assert decoding.wait(TIMEOUT)
        results = [f.result(TIMEOUT) for f in _submitted_together(batch, rest)]
        assert head.result(TIMEOUT).generated_ids == alone[0]
    assert [r.generated_ids for r in results] == alone[1:]
    # 8 tokens a turn in all, none short enough to end in a pass beside the earliest's half: [8], [3 + 5], [1 + 7], [2]
    assert [r.stats["prefill"]["chunks"] for r in results] == [2, 2, 2]
    assert [r.stats["prefill"]["tokens"] for r in results] == [11, 6, 9]


def test_a_short_prompt_behind_a_long_ones_chunks_ends_in_the_next_pass(generator):
    """While others decode, a prompt that can end within the chunk left beside the earliest prompt's half goes in
    the next pass: its first token comes before the long prompt's, which first come first served had kept it
    behind for every chunk; the long prompt still gets its half each pass."""
    vocab = generator.cfg.vocab_size
    head, cases = _prompt(4, 90, vocab), [(_prompt(30, 91, vocab), 2), (_prompt(3, 92, vocab), 2)]
    alone = [_solo(generator, ids, max_new_tokens=new).generated_ids for ids, new in cases]
    firsts: list[int] = []
    with Batch(generator, max_batch=4, prefill_chunk=8) as batch:
        on_token, decoding = _tokens_seen(2)
        running = batch.submit(head, max_new_tokens=40, on_token=on_token)
        assert decoding.wait(TIMEOUT)
        with batch.scheduler._cv:
            futures = [batch.submit(ids, max_new_tokens=new, on_token=lambda t, lp, i=i: firsts.append(i))
                       for i, (ids, new) in enumerate(cases)]
        results = [f.result(TIMEOUT) for f in futures]
        running.result(TIMEOUT)
    assert [r.generated_ids for r in results] == alone
    assert firsts[0] == 1  # the short one's first token first
    assert [r.stats["prefill"]["chunks"] for r in results] == [5, 1]  # 30: 4 (+1 left) + 8 + 8 + 8 + 1; 3 at once


def test_a_prompt_cancelled_during_a_grouped_prefill_leaves_the_others_exact(generator):
    vocab = generator.cfg.vocab_size
    cases = [(_prompt(13, 91, vocab), 10), (_prompt(6, 92, vocab), 10), (_prompt(21, 93, vocab), 10),
             (_prompt(4, 94, vocab), 10)]
    alone = {i: _solo(generator, cases[i][0], max_new_tokens=10).generated_ids for i in (1, 3)}
    asked: dict[int, int] = {0: 0, 2: 0}

    def cancelled_after(i: int, calls: int):
        def cancelled() -> bool:
            asked[i] += 1
            return asked[i] > calls
        return cancelled
    with Batch(generator, max_batch=4) as batch:
        with batch.scheduler._cv:
            futures = [batch.submit(ids, max_new_tokens=new, cancelled=cancelled_after(i, 2 - i // 2) if i in asked else None)
                       for i, (ids, new) in enumerate(cases)]
        results = [f.result(TIMEOUT) for f in futures]
    # the first: false before the pass and at its first layer, true from its second on; the third: asked before
    # the pass and once it ended (the pass asks its stop only while every prompt before it asked stop), true then
    for gone in (results[0], results[2]):
        assert gone.finish_reason == "cancelled" and gone.generated_ids == []
        # the pass went on for the others (their rows shared its reads); it left with no token once it ended
        assert gone.stats["prefill"]["cancelled_after_layers"] == generator.cfg.num_layers
    assert asked[2] == 2
    assert {i: results[i].generated_ids for i in (1, 3)} == alone
    assert all(results[i].stats["prefill"]["group_prompts"] == 4 for i in (1, 3))
    # every prompt of the pass stopped: the pass itself stops before its next layer
    with Batch(generator, max_batch=3) as batch:
        stop = threading.Event()
        futures = _submitted_together(batch, cases, cancelled=stop.is_set)
        stop.set()
        results = [f.result(TIMEOUT) for f in futures]
    assert all(r.finish_reason == "cancelled" and not r.generated_ids for r in results)
    # one stopped before the pass, behind another: it leaves at once, the others' pass runs without it
    with Batch(generator, max_batch=4) as batch:
        with batch.scheduler._cv:
            futures = [batch.submit(ids, max_new_tokens=new, cancelled=(lambda: True) if i == 2 else None)
                       for i, (ids, new) in enumerate(cases)]
        results = [f.result(TIMEOUT) for f in futures]
    assert results[2].finish_reason == "cancelled" and results[2].stats["prefill"]["cancelled_after_layers"] == 0
    assert {i: results[i].generated_ids for i in (1, 3)} == alone
    assert [results[i].stats["prefill"]["group_prompts"] for i in (0, 1, 3)] == [3, 3, 3]


def test_a_group_whose_working_set_does_not_fit_runs_smaller_and_a_prompt_too_big_alone_fails_alone(
        generator, monkeypatch):
    vocab = generator.cfg.vocab_size
    cases = [(_prompt(10, 101, vocab), 6), (_prompt(40, 102, vocab), 6), (_prompt(10, 103, vocab), 6),
             (_prompt(10, 104, vocab), 6)]
    alone = {i: _solo(generator, cases[i][0], max_new_tokens=6).generated_ids for i in (0, 2, 3)}

    # room for the working set of 25 prompt tokens
    def check_memory(engine, n_tokens, scored_tokens=0, freeable_bytes=0):
        if n_tokens > 25:
            raise MoepackError(f"a prompt of {n_tokens} tokens needs more than there is")
    monkeypatch.setattr(StreamingPrefill, "check_memory", check_memory)
    with Batch(generator, max_batch=4) as batch:
        futures = _submitted_together(batch, cases)
        with pytest.raises(MoepackError, match="a prompt of 40 tokens"):
            futures[1].result(TIMEOUT)
        results = {i: futures[i].result(TIMEOUT) for i in (0, 2, 3)}
    assert {i: r.generated_ids for i, r in results.items()} == alone
    # the group of 0 and 1 did not fit: 0 ran alone; 1 alone failed; 2 and 3 fit together
    assert [results[i].stats["prefill"]["group_prompts"] for i in (0, 2, 3)] == [1, 2, 2]
