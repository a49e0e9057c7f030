"""Continuous batching (runtime/batching.py's BatchScheduler, `moepack serve --max-batch`): sequences decoding together,
joining and leaving at step boundaries, give each the tokens it gets decoded alone by Generator.generate."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from moepack.format_spec.errors import MoepackError
from moepack.runtime import generate as generate_module
from moepack.runtime.batching import BatchScheduler
from moepack.runtime.generate import GenerateOptions, Generator, memory_need
from moepack.serve.app import ServerLimits, make_app
from moepack.serve.tokenizer import PromptTokenizer
from moepack.v4.kv import kv_bytes
from containers import tiny_keep_container
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
    alone = _solo(generator, long_prompt, max_new_tokens=8)
    other_alone = _solo(generator, other, max_new_tokens=30)
    with Batch(generator, max_batch=2, prefill_chunk=7) as batch:
        on_token, decoding = _tokens_seen(2)
        first = batch.submit(other, max_new_tokens=30, on_token=on_token)
        assert decoding.wait(TIMEOUT)
        chunked = batch.submit(long_prompt, max_new_tokens=8).result(TIMEOUT)
        assert first.result(TIMEOUT).generated_ids == other_alone.generated_ids
    assert chunked.stats["prefill"]["chunks"] == 7 and chunked.stats["prefill"]["tokens"] == 45
    assert chunked.generated_ids == alone.generated_ids
    assert alone.stats["prefill"].get("chunks") is None  # alone: one run


def test_a_sequence_that_does_not_fit_beside_the_others_is_refused_alone(generator, monkeypatch):
    vocab = generator.cfg.vocab_size
    first_ids, second_ids = _prompt(8, 41, vocab), _prompt(8, 42, vocab)
    alone = _solo(generator, first_ids, max_new_tokens=30)
    c = generator.c
    one = memory_need(c, 8 + 30, generator.host_cache_bytes)
    free = one + kv_bytes(c.config, 8 + 30) // 2  # room for one sequence's KV, not two
    monkeypatch.setattr(generate_module, "memory_for_generation", lambda held=0: free)
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
    with pytest.raises(MoepackError, match="--max-batch"):
        BatchScheduler(generator, max_batch=0)


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
        assert ready["max_batch"] == 3
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
