"""moepack serve (serve/app.py): the OpenAI-compatible API over one Generator, spoken to with the official
`openai` client (and plain httpx for what that client cannot send), on uvicorn in a background thread."""

from __future__ import annotations

import random
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn

from moepack.packer.convert import convert_checkpoint
from moepack.runtime.generate import GenerateOptions, Generator, generate
from moepack.serve.app import make_app, uvicorn_config
from moepack.serve.reasoning import ThinkSplitter, ThoughtMarks, split_thinking
from moepack.serve.tokenizer import PromptTokenizer
from v4_models import CONFIGS, saved_model

KEY = "sekret"
TIMEOUT = 60


class Running:
    """uvicorn serving `app` on 127.0.0.1 and a free port, in a daemon thread."""

    def __init__(self, app, limits=None):
        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(app, limits, log_level="warning", access_log=False,
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or "none", max_retries=0, timeout=TIMEOUT)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=20)
        self.sock.close()
        assert not self.thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def containers(tmp_path_factory):
    from moepack.packer.synth import synth_checkpoint

    base = tmp_path_factory.mktemp("serve")
    hf_model = saved_model(CONFIGS["A"], 101, str(base / "A"))
    convert_checkpoint(str(base / "A"), str(base / "A.moepack"), progress=False)
    synth_checkpoint(str(base / "tiny"), preset="tiny", progress=False)
    convert_checkpoint(str(base / "tiny"), str(base / "tiny.moepack"), policy="keep", progress=False)
    return {"hf": hf_model, "A": str(base / "A.moepack"), "tiny": str(base / "tiny.moepack")}


@pytest.fixture(scope="module")
def logs():
    return []


def _serve(path, logs, **kw):
    g = Generator(path, cache_gib=1.0)
    name = kw.pop("model_name", "m")
    running = Running(make_app(g, name, log=logs.append, **kw))
    running.generator = g
    running.state = running.app.state.server
    return running


@pytest.fixture(scope="module")
def a_server(containers, logs):
    running = _serve(containers["A"], logs, model_name="A", max_queue=4)
    yield running
    running.stop()
    running.generator.close()


@pytest.fixture(scope="module")
def tiny_server(containers, logs):
    running = _serve(containers["tiny"], logs, model_name="tiny", api_key=KEY, max_queue=4)
    yield running
    running.stop()
    running.generator.close()


def _ok(running, key=None):
    """The request after a failure: a short completion works."""
    client = running.client(key)
    out = client.completions.create(model=client.models.list().data[0].id, prompt=[1, 2, 3], max_tokens=2)
    assert len(out.choices[0].model_dump()["token_ids"]) >= 1


def test_health_and_models(a_server):
    assert httpx.get(f"{a_server.url}/health", timeout=TIMEOUT).json()["status"] == "ok"
    assert [m.id for m in a_server.client().models.list().data] == ["A"]


def test_completion_from_token_ids_equals_transformers_and_generate(a_server, containers):
    hf = containers["hf"]
    ids = torch.randint(0, hf.config.vocab_size, (20,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = hf.generate(ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=12,
                          do_sample=False)
    expected = out[0, len(ids):].tolist()
    resp = a_server.client().completions.create(model="A", prompt=ids.tolist(), max_tokens=12, temperature=0)
    got = resp.choices[0].model_dump()["token_ids"]
    assert got == expected
    assert got == generate(containers["A"], ids, GenerateOptions(max_new_tokens=12)).generated_ids
    assert resp.usage.prompt_tokens == 20 and resp.usage.completion_tokens == len(got)
    assert resp.usage.total_tokens == 20 + len(got)
    assert resp.choices[0].finish_reason == ("length" if len(got) == 12 else "stop")
    # no tokenizer: skip_special_tokens' default (true where there is one) asks for none; asked for, a 400 naming it
    with pytest.raises(openai.BadRequestError) as e:
        a_server.client().completions.create(model="A", prompt=ids.tolist(), max_tokens=2,
                                             extra_body={"skip_special_tokens": True})
    assert e.value.body["param"] == "skip_special_tokens" and e.value.body["code"] == "no_tokenizer"


def test_text_completion_equals_generate(tiny_server, containers):
    prompt = "Once upon a time"
    resp = tiny_server.client(KEY).completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
    g = tiny_server.generator
    tok = PromptTokenizer(g.c)
    expected = generate(containers["tiny"], tok.encode(prompt), GenerateOptions(max_new_tokens=10),
                        detokenize=tok.decode)
    assert resp.choices[0].text == expected.text
    assert resp.choices[0].finish_reason == expected.finish_reason
    assert resp.usage.prompt_tokens == len(tok.encode(prompt))
    # streamed: the pieces add up to the same text
    stream = tiny_server.client(KEY).completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                                        stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_streamed_chat_equals_the_whole_answer(tiny_server):
    client = tiny_server.client(KEY)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_thinking_splits_reasoning_from_content(tiny_server):
    client = tiny_server.client(KEY)
    messages = [{"role": "user", "content": "Why?"}]
    for thinking in (True, {"type": "enabled"}):
        whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                               extra_body={"thinking": thinking})
        message = whole.choices[0].message.model_dump()
        assert isinstance(message["reasoning_content"], str)
        assert message["reasoning"] == message["reasoning_content"]  # (vLLM's name of it too)
        stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                extra_body={"thinking": thinking}, stream=True)
        deltas = [c.choices[0].delta.model_dump() for c in stream if c.choices]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
        assert [d.get("reasoning") for d in deltas] == [d.get("reasoning_content") for d in deltas]
        assert "".join(d.get("content") or "" for d in deltas) == (message["content"] or "")
    off = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                         extra_body={"thinking": {"type": "disabled"}})
    assert off.choices[0].message.model_dump().get("reasoning_content") is None
    assert off.choices[0].message.model_dump().get("reasoning") is None
    assert off.usage.completion_tokens_details.reasoning_tokens == 0  # (a chat's usage always has it, as OpenAI's)
    plain = client.completions.create(model="tiny", prompt="Why?", max_tokens=2)
    assert plain.usage.completion_tokens_details is None  # (a completion's has none)


# (text, where the thought starts: None the prompt opened it, else the opening the answer may start with) ->
# (reasoning_content, content)
SPLITS = {
    ("abc</think>def", None): ("abc", "def"),
    ("</think>", None): ("", ""),
    ("no end at all <thi", None): ("no end at all <thi", ""),
    ("a</thin</think>b</think>c", None): ("a</thin", "b</think>c"),
    ("<think>x", None): ("<think>x", ""),
    ("\n <think>x</think>y", "<think>"): ("x", "y"),
    ("<think>x</thi", "<think>"): ("x</thi", ""),
    ("<thin", "<think>"): (None, "<thin"),
    ("  ", "<think>"): (None, "  "),
    ("a <think>x</think>y", "<think>"): (None, "a <think>x</think>y"),
    ("<thinking>x</think>y", "<think>"): (None, "<thinking>x</think>y"),
}


@pytest.mark.parametrize("text, start", SPLITS)
def test_the_think_splitter_streamed_equals_the_whole_split(text, start):
    marks = ThoughtMarks("</think>", start)
    assert split_thinking(text, marks) == SPLITS[text, start]
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        s = ThinkSplitter(marks)
        parts = [p for piece in pieces for p in s.feed(piece)] + s.flush()
        reasoning = "".join(t for f, t in parts if f == "reasoning_content")
        content = "".join(t for f, t in parts if f == "content")
        assert (reasoning if s.had_thought else None, content) == SPLITS[text, start]


def test_three_concurrent_requests_all_succeed(tiny_server):
    results, errors = {}, []

    def one(i):
        try:
            r = tiny_server.client(KEY).completions.create(model="tiny", prompt=f"Story {i}:", max_tokens=8)
            results[i] = r.choices[0].text
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT)
    assert not errors and len(results) == 3


def _post(running, path, body, key=KEY, raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        headers["Content-Type"] = "application/json"
        return httpx.post(f"{running.url}/v1/{path}", content=raw, headers=headers, timeout=TIMEOUT)
    return httpx.post(f"{running.url}/v1/{path}", json=body, headers=headers, timeout=TIMEOUT)


@pytest.mark.parametrize("case", ["unknown model", "negative max_tokens", "zero max_tokens", "malformed JSON",
                                  "wrong-typed field", "wrong-typed temperature", "bad message", "no key",
                                  "wrong key", "token id out of range"])
def test_each_bad_request_gets_its_4xx_and_the_server_lives_on(tiny_server, case):
    good = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    r = {
        "unknown model": lambda: _post(tiny_server, "completions", {**good, "model": "gpt-9"}),
        "negative max_tokens": lambda: _post(tiny_server, "completions", {**good, "max_tokens": -1}),
        "zero max_tokens": lambda: _post(tiny_server, "completions", {**good, "max_tokens": 0}),
        "malformed JSON": lambda: _post(tiny_server, "completions", None, raw=b'{"model": "tiny", "prompt": '),
        "wrong-typed field": lambda: _post(tiny_server, "completions", {**good, "max_tokens": "many"}),
        "wrong-typed temperature": lambda: _post(tiny_server, "chat/completions",
                                                 {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                  "temperature": [1]}),
        "bad message": lambda: _post(tiny_server, "chat/completions",
                                     {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}),
        "no key": lambda: _post(tiny_server, "completions", good, key=None),
        "wrong key": lambda: _post(tiny_server, "completions", good, key="nope"),
        "token id out of range": lambda: _post(tiny_server, "completions", {**good, "prompt": [1, 10 ** 9]}),
    }[case]()
    status = {"unknown model": 404, "no key": 401, "wrong key": 401}.get(case, 400)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if status == 400:
        assert error["type"] == "invalid_request_error"
    if case == "unknown model":
        assert error["code"] == "model_not_found"
    _ok(tiny_server, KEY)


def test_the_openai_client_sees_its_errors(tiny_server):
    with pytest.raises(openai.AuthenticationError):
        tiny_server.client("nope").models.list()
    with pytest.raises(openai.NotFoundError):
        tiny_server.client(KEY).completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        tiny_server.client(KEY).completions.create(model="tiny", prompt="x", max_tokens=-3)


def test_the_api_key_is_read_as_a_bearer_token(tiny_server):
    def status(authorization: str) -> int:
        return httpx.get(f"{tiny_server.url}/v1/models", headers={"Authorization": authorization}).status_code

    assert status(f"Bearer {KEY}") == status(f"bearer {KEY}") == status(f"BEARER  {KEY}") == 200
    for wrong in (f"Basic {KEY}", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer", KEY, f"Bearer {KEY} {KEY}"):
        assert status(wrong) == 401, wrong


def test_a_prompt_longer_than_the_context_is_refused(a_server):
    context = a_server.generator.c.config["max_position_embeddings"]
    r = _post(a_server, "completions", {"model": "A", "prompt": [1] * (context + 5), "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = _post(a_server, "completions", {"model": "A", "prompt": [1] * (context - 2), "max_tokens": 10})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    _ok(a_server)


def test_a_prompt_longer_than_memory_allows_is_refused(tiny_server, monkeypatch):
    """The generation's memory check (resident weights + cache + KV + 1 GiB) fails: a 400 naming it, before any
    prefill, and the next request works."""
    from moepack.runtime import memory as memory_module

    monkeypatch.setattr(memory_module, "available_memory_bytes", lambda: 1 << 30)
    r = _post(tiny_server, "completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert "memory" in r.json()["error"]["message"] and "\n" not in r.json()["error"]["message"]
    monkeypatch.undo()
    _ok(tiny_server, KEY)


def test_an_internal_error_is_a_500_and_the_next_request_works(tiny_server, monkeypatch, logs):
    real = tiny_server.generator.generate
    calls = []

    def fails_once(*a, **k):
        if not calls:
            calls.append(1)
            raise RuntimeError("boom")
        return real(*a, **k)

    monkeypatch.setattr(tiny_server.generator, "generate", fails_once)
    before = len(logs)
    r = _post(tiny_server, "completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    lines = [line for line in logs[before:] if "boom" in line]
    assert len(lines) == 1 and "\n" not in lines[0]
    _ok(tiny_server, KEY)


def _slow(generator, monkeypatch, delay=0.05):
    """Each decode step of `generator` takes `delay` s more (its cancel check sleeps)."""
    real = generator.generate

    def slow(ids, options, **k):
        inner = k.get("cancelled") or (lambda: False)
        k["cancelled"] = lambda: (time.sleep(delay), inner())[1]
        return real(ids, options, **k)

    monkeypatch.setattr(generator, "generate", slow)


def test_a_full_queue_answers_429(containers, logs, monkeypatch):
    """The running generation holds the only slot until the test lets it go (it waits in its cancel check, first
    asked before the prefill's first layer once the checks passed (the stream's 200 goes then), so an early end of
    sentence cannot free the slot before the second request comes); the 429 says when to retry."""
    import threading

    running = _serve(containers["tiny"], logs, model_name="tiny", max_queue=1)
    release = threading.Event()
    real = running.generator.generate

    def held(ids, options, **k):
        inner = k.get("cancelled") or (lambda: False)
        k["cancelled"] = lambda: (inner(), release.wait(TIMEOUT))[0]
        return real(ids, options, **k)

    monkeypatch.setattr(running.generator, "generate", held)
    try:
        with httpx.stream("POST", f"{running.url}/v1/completions", timeout=TIMEOUT,
                          json={"model": "tiny", "prompt": "Hi", "max_tokens": 60, "stream": True,
                                "temperature": 0}) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            deadline = time.monotonic() + 10
            while running.state.admitted != 1:  # the stream has begun: its generation holds the slot
                assert time.monotonic() < deadline
                time.sleep(0.01)
            second = _post(running, "completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2}, key=None)
            release.set()
            assert second.status_code == 429, (second.text, logs[-3:], running.state.admitted)
            assert second.json()["error"]["code"] == "queue_full" and second.headers["retry-after"] == "2"
            body = "".join(lines)
            assert "[DONE]" in body
        deadline = time.monotonic() + 10
        while running.state.admitted:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        _ok(running)
    finally:
        running.stop()
        running.generator.close()


def test_a_client_that_goes_away_cancels_its_generation(containers, logs, monkeypatch):
    running = _serve(containers["tiny"], logs, model_name="tiny", max_queue=1)
    try:
        _slow(running.generator, monkeypatch, delay=0.1)
        with httpx.stream("POST", f"{running.url}/v1/chat/completions", timeout=TIMEOUT,
                          json={"model": "tiny", "messages": [{"role": "user", "content": "Go on"}],
                                "max_tokens": 500, "stream": True,  # no end of sentence: only the client ends it
                                "logit_bias": {str(e): -100 for e in running.generator.eos_ids}}) as first:
            rid = first.headers["x-request-id"]
            lines = first.iter_lines()
            assert next(lines).startswith("data: ")
        # closed mid-stream (500 tokens at 0.1 s each would take 50 s)
        start = time.monotonic()
        while (rid, "cancelled") not in running.state.finished:
            assert time.monotonic() - start < 10, list(running.state.finished)
            time.sleep(0.05)
        monkeypatch.undo()
        r = _post(running, "completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2}, key=None)
        assert r.status_code == 200, r.text
        assert time.monotonic() - start < 15
        assert any(rid in line and "finish=cancelled" in line for line in logs)
    finally:
        running.stop()
        running.generator.close()


def test_a_client_gone_while_waiting_frees_its_queue_place_at_once(containers, logs, monkeypatch):
    """--max-queue 2: one generation held running, a second client gives up while it waits for the worker; its
    place is free at once (a third request is admitted, not 429) and it never runs."""
    import concurrent.futures

    running = _serve(containers["tiny"], logs, model_name="tiny", max_queue=2)
    release, ran = threading.Event(), []
    real = running.generator.generate

    def held(ids, options, **k):
        ran.append(list(ids))
        inner = k.get("cancelled") or (lambda: False)
        k["cancelled"] = lambda: (inner(), release.wait(TIMEOUT))[0]
        return real(ids, options, **k)

    monkeypatch.setattr(running.generator, "generate", held)

    def wait_admitted(n):
        deadline = time.monotonic() + 10
        while running.state.admitted != n:
            assert time.monotonic() < deadline, running.state.admitted
            time.sleep(0.02)
    try:
        with httpx.stream("POST", f"{running.url}/v1/completions", timeout=TIMEOUT,
                          json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True}) as first:
            assert first.status_code == 200
            wait_admitted(1)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{running.url}/v1/completions", timeout=httpx.Timeout(TIMEOUT, read=0.5),
                           json={"model": "tiny", "prompt": [4, 5, 6], "max_tokens": 4})
            wait_admitted(1)  # the vanished one's place, freed while the first still runs
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                third = pool.submit(_post, running, "completions",
                                    {"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 2}, None)
                wait_admitted(2)
                release.set()
                assert third.result(TIMEOUT).status_code == 200
            assert "[DONE]" in "".join(first.iter_lines())
        assert ran == [[1, 2, 3], [7, 8, 9]]
        assert any("cancelled before it started" in line for line in logs)
    finally:
        release.set()
        running.stop()
        running.generator.close()


def test_the_log_has_one_line_per_request(tiny_server, logs):
    before = len(logs)
    r = tiny_server.client(KEY).completions.create(model="tiny", prompt="Log me", max_tokens=3)
    new = [line for line in logs[before:] if r.id in line]
    assert len(new) == 1
    for field in ("prompt_tokens=", "generated_tokens=", "prefill_s=", "decode_s=", "cache_hit_rate=", "finish="):
        assert field in new[0]


def test_the_command_starts_and_serves(containers, tmp_path):
    """`moepack serve` as a process: it binds (--port 0: a free port, reported by --json), answers /health and
    /v1/models, and stops on SIGTERM."""
    import json
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "moepack", "serve", containers["tiny"], "--port", "0",
                             "--cache-gib", "0.1", "--model-name", "tiny-x", "--allowed-origin", "http://ui.example",
                             "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = json.loads(proc.stdout.readline())  # printed once the socket is bound
        port = ready["port"]
        assert ready["ok"] and ready["model"] == "tiny-x" and port > 0
        assert ready["url"] == f"http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
        assert [m["id"] for m in models["data"]] == ["tiny-x"]
        assert ready["allowed_origins"] == ["http://ui.example"]
        preflight = httpx.options(f"http://127.0.0.1:{port}/v1/models", timeout=5, headers={
            "Origin": "http://ui.example", "Access-Control-Request-Method": "GET"})
        assert preflight.headers["access-control-allow-origin"] == "http://ui.example"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
