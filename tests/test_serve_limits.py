"""moepack serve's limits (issue #37): the body's size, the prompt's tokens, stop strings, header / body / idle
timeouts, concurrent connections, JSON and values named by their request field, a streamed request's 4xx before
its 200, tokenization off the event loop, and a prefill that stops when its client leaves or its deadline passes.
Real HTTP (uvicorn on 127.0.0.1) where the behaviour is the transport's."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import re
import socket
import threading
import time
from collections.abc import Callable

import httpx
import pytest
import torch

from moepack.packer.convert import convert_checkpoint
from moepack.runtime.engine import GenerationCancelled, StreamingPrefill
from moepack.runtime.generate import GenerateOptions, Generator
from moepack.runtime.sampling import StopMatcher
from moepack.serve.app import MAX_PROMPTS_PER_REQUEST, ServerLimits, make_app
from test_serve import Running

TIMEOUT = 60
GOOD = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from moepack.packer.synth import synth_checkpoint

    base = tmp_path_factory.mktemp("serve-limits")
    synth_checkpoint(str(base / "tiny"), preset="tiny", progress=False)
    convert_checkpoint(str(base / "tiny"), str(base / "tiny.moepack"), policy="keep", progress=False)
    return str(base / "tiny.moepack")


def _serve(path, logs=None, max_queue=4, **limits):
    g = Generator(path, cache_gib=0.5)
    lim = ServerLimits(**limits)
    running = Running(make_app(g, "tiny", log=(logs.append if logs is not None else lambda line: None),
                               max_queue=max_queue, limits=lim), lim)
    running.generator, running.state = g, running.app.state.server
    return running


def _stop(running):
    running.stop()
    running.generator.close()


@pytest.fixture(scope="module")
def server(tiny):
    running = _serve(tiny, max_body_bytes=1 << 20, max_context=256, read_timeout_s=1.0, keep_alive_s=1.0)
    yield running
    _stop(running)


def _post(running, body=None, path="completions", raw=None, **kw):
    if raw is not None:
        return httpx.post(f"{running.url}/v1/{path}", content=raw, timeout=TIMEOUT,
                          headers={"Content-Type": "application/json"}, **kw)
    return httpx.post(f"{running.url}/v1/{path}", json=body, timeout=TIMEOUT, **kw)


def _error(r, status):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"]
    return error


def _answers(running, expect: str | None = None) -> str:
    """The request after an abuse: a greedy completion, at once, with the same text as before."""
    t0 = time.monotonic()
    r = _post(running, GOOD)
    assert r.status_code == 200, r.text
    assert time.monotonic() - t0 < 10
    text = r.json()["choices"][0]["text"]
    if expect is not None:
        assert text == expect
    return text


def _health_worst(url: str, while_running: Callable) -> tuple[float, object]:
    """The worst /health latency (s) while `while_running()` runs in a thread."""
    done = threading.Event()
    result = {}

    def work():
        try:
            result["value"] = while_running()
        finally:
            done.set()

    t = threading.Thread(target=work, daemon=True)
    t.start()
    worst = 0.0
    with httpx.Client(timeout=TIMEOUT) as client:
        while not done.is_set():
            t0 = time.monotonic()
            assert client.get(f"{url}/health").status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.05)
    t.join()
    return worst, result.get("value")


# ---- the body's size --------------------------------------------------------------------------------------------

def test_a_body_over_the_limit_is_413_by_its_content_length(server):
    error = _error(_post(server, raw=b"x" * ((1 << 20) + 1)), 413)
    assert error["code"] == "body_too_large" and "--max-body-mb" in error["message"]
    _answers(server)


def test_a_chunked_body_is_counted_as_it_comes_and_never_read_past_the_limit(server):
    """No Content-Length: the server stops reading at the limit and answers 413 while the client still sends
    (64 MiB offered against a 1 MiB limit; the kernel's buffers take a few MiB at most)."""
    sent = 0
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (1 << 16, b"x" * (1 << 16))
        try:
            while sent < 64 << 20:
                s.sendall(chunk)
                sent += 1 << 16
        except OSError:  # the server closed the connection after its 413
            pass
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:100]
    assert sent < 32 << 20
    _answers(server)


# ---- the prompt's tokens, stop strings, values ------------------------------------------------------------------

def test_the_prompt_and_max_tokens_are_bounded_by_max_context(server):
    error = _error(_post(server, {"prompt": [1] * 300, "max_tokens": 2}), 400)
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
    assert "max_context" in error["message"]
    error = _error(_post(server, {"prompt": [1] * 200, "max_tokens": 100}), 400)
    assert error["param"] == "max_tokens" and "max_context of 256" in error["message"]
    _answers(server)


def test_stop_strings_are_bounded_in_number_and_length(server):
    error = _error(_post(server, {**GOOD, "stop": [f"s{i}" for i in range(17)]}), 400)
    assert error["param"] == "stop" and "limit of 16" in error["message"]
    error = _error(_post(server, {**GOOD, "stop": ["x" * 257]}), 400)
    assert error["param"] == "stop" and "limit of 256" in error["message"]
    error = _error(_post(server, {**GOOD, "stop": [f"s{i}" for i in range(10_000)]}), 400)
    assert error["param"] == "stop"
    assert _post(server, {**GOOD, "stop": [f"zz{i}" for i in range(16)]}).status_code == 200


def test_ten_thousand_stop_strings_cost_the_matcher_what_one_does():
    text = "the quick brown fox jumps over the lazy dog " * 8
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]

    def feed(stop):
        m = StopMatcher(stop, eos_ids=set())
        t0, so_far = time.perf_counter(), ""
        for p in pieces:
            so_far += p
            m.feed(1, so_far)
        return time.perf_counter() - t0, m

    one, _ = feed(["<never>"])
    many, m = feed([f"<never{i}>" for i in range(10_000)] + ["lazy d"])
    assert m.finish_reason == "stop" and m.text == text[:text.index("lazy d")]
    assert many < 0.1 + 5 * one, (one, many)


@pytest.mark.parametrize("field,value", [("temperature", -1), ("temperature", "hot"), ("top_p", 0),
                                         ("top_p", 1.5), ("top_k", -2), ("seed", 2 ** 64), ("seed", -2),
                                         ("max_tokens", 0), ("max_tokens", 2 ** 40), ("n", 2), ("stream", "yes"),
                                         ("top_k", 1.5)])
def test_a_bad_value_is_a_400_naming_its_field(server, field, value):
    error = _error(_post(server, {**GOOD, field: value}), 400)
    assert error["param"] == field
    assert "--" not in error["message"] and error["message"].startswith(field)


@pytest.mark.parametrize("raw,what", [
    (b"[" * 100_000 + b"]" * 100_000, "nested"),
    (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", "digits"),
    (b'{"prompt": "x", "temperature": NaN}', "NaN"),
    (b'{"prompt": "x", "temperature": 1e999}', "overflows"),
    (b'{"prompt": "\\ud800"}', "surrogate"),
    (b'{"prompt": "\xff\xfe"}', "UTF-8"),
    (b'{"prompt": ', "JSON"),
])
def test_hostile_json_is_a_400_invalid_json(server, raw, what):
    error = _error(_post(server, raw=raw), 400)
    assert error["code"] == "invalid_json" and what in error["message"]
    _answers(server)


def test_an_empty_prompt_is_refused_like_the_cli(server):
    for prompt in ("", [""], []):
        error = _error(_post(server, {**GOOD, "prompt": prompt}), 400)
        assert error["param"] == "prompt" and "empty prompt" in error["message"]


def test_a_prompt_of_the_wrong_type_is_named_so(server):
    """A list that is not token ids (a float, a bool, a string among the ids, in a batch of one too) is a prompt of
    the wrong type; in a batch of several, named by its place; more prompts than one request takes are a 400."""
    for prompt in ([5.0], [True, 5], ["a", 5], [[1, True]], [1, [2]], {"text": "a"}, 7):
        error = _error(_post(server, {**GOOD, "prompt": prompt}), 400)
        assert error["param"] == "prompt" and error["message"].startswith(
            "prompt: expected a string or a list of integer token ids, got "), (prompt, error)
    for prompt, message in ((["a", [1, True]], "prompt[1]: expected a string or a list of integer token ids"),
                            (["a", ""], "prompt[1]: empty prompt"), ([[1], []], "prompt[1]: empty prompt"),
                            (["a"] * (MAX_PROMPTS_PER_REQUEST + 1), f"prompt: {MAX_PROMPTS_PER_REQUEST + 1} prompts")):
        error = _error(_post(server, {**GOOD, "prompt": prompt}), 400)
        assert error["param"] == "prompt" and error["message"].startswith(message), (prompt, error)


def test_a_streamed_request_with_a_bad_value_gets_its_4xx_before_any_200(server, monkeypatch):
    """Values checked up front, and what only the generation checks (here its memory check) also comes before
    the status line: never a 200 followed by an error event."""
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=TIMEOUT,
                      json={**GOOD, "stream": True, "temperature": -1}) as r:
        assert r.status_code == 400 and json.loads(r.read())["error"]["param"] == "temperature"
    from moepack.runtime import memory as memory_module

    monkeypatch.setattr(memory_module, "available_memory_bytes", lambda: 1 << 30)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=TIMEOUT,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                            "stream": True}) as r:
        assert r.status_code == 400
        assert "memory" in json.loads(r.read())["error"]["message"]
    monkeypatch.undo()
    _answers(server)


# ---- timeouts and connections -----------------------------------------------------------------------------------

def _closed_within(sock: socket.socket, seconds: float) -> bytes:
    """What the server sent before closing `sock` (asserting that it did, within `seconds`)."""
    sock.settimeout(seconds)
    got = b""
    while True:
        data = sock.recv(4096)
        if not data:
            return got
        got += data


def test_half_sent_requests_are_closed_and_do_not_hold_the_server(server):
    """Slowloris: 50 connections that send half their headers, one byte more now and then. Each is closed within
    --timeout-read (1 s here) of its start; meanwhile /health answers at once."""
    socks = []
    for _ in range(50):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: a")
        socks.append(s)
    t0 = time.monotonic()
    worst = 0.0
    while time.monotonic() - t0 < 0.6:
        for s in socks[:10]:
            try:
                s.sendall(b"a")
            except OSError:
                pass
        h = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        worst = max(worst, time.monotonic() - h)
        time.sleep(0.1)
    assert worst < 0.5
    for s in socks:
        assert _closed_within(s, 5) == b""
        s.close()
    assert time.monotonic() - t0 < 5
    _answers(server)


def _half_closed(running, method: str, path: str, body: dict | None = None) -> bytes:
    """What a client that sends its request and then shuts down its sending side (SHUT_WR) reads."""
    content = json.dumps(body).encode() if body is not None else b""
    with socket.create_connection(("127.0.0.1", running.port), timeout=10) as s:
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(content)}\r\n\r\n".encode() + content)
        s.shutdown(socket.SHUT_WR)
        return _closed_within(s, 5)


def test_a_client_that_half_closes_after_its_request_reads_its_answer(server):
    """A client that shuts down its sending side once its request is sent (nc -N, HTTP/1.0-style scripts) had
    its connection closed without a word. It reads its answer: a 4xx, a quick GET; a generation stops as for a
    client gone (its FIN is all a vanished client sends too): a whole answer whose finish is `cancelled`, or a
    stream's error event and [DONE], never a stream cut short."""
    assert _half_closed(server, "GET", "/health").startswith(b"HTTP/1.1 200")
    reply = _half_closed(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": -1})
    assert reply.startswith(b"HTTP/1.1 400") and b'"param":"max_tokens"' in reply
    reply = _half_closed(server, "POST", "/v1/completions", {**GOOD, "max_tokens": 200})
    choices = json.loads(reply.partition(b"\r\n\r\n")[2])["choices"]
    # (cancelled at the poll that saw the FIN; a run that ended before that poll is answered whole)
    assert reply.startswith(b"HTTP/1.1 200") and choices[0]["finish_reason"] in ("cancelled", "length"), choices
    reply = _half_closed(server, "POST", "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200, "stream": True})
    assert reply.startswith(b"HTTP/1.1 200") and b'"code": "client_gone"' in reply
    assert reply.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")  # the chunked body ended, not cut
    _answers(server)


def test_a_run_whose_client_left_is_in_flight_until_it_stops(server):
    """A vanished client's --max-queue place is given back at once, but its run goes on to its next layer or
    token: /health's and /metrics' requests_in_flight count it until it stops (they had dropped it at once)."""
    from types import SimpleNamespace

    from moepack.runtime.generate import GenerateResult
    from moepack.serve.app import Job, Server

    inside, go_on = threading.Event(), threading.Event()

    def generate(ids, options, **kw):  # a run that stops only when let go
        inside.set()
        assert go_on.wait(10)
        return GenerateResult([], "", "cancelled", {})
    g = server.generator
    state = Server(SimpleNamespace(c=g.c, family=g.family, generate=generate), "m", None, 2, log=lambda line: None)
    try:
        job = Job("r", [[1, 2]], GenerateOptions(max_new_tokens=4), deadline=time.monotonic() + 60)
        state.admit()
        worker = state.executor.submit(state.run, job)
        assert inside.wait(10) and (state.admitted, state.in_flight) == (1, 1)
        job.cancelled = True  # (what the handler does when it sees the client gone)
        state.release(job)
        assert (state.admitted, state.in_flight) == (0, 1)  # the place free, the run still in flight
        state.release(job)  # (once only)
        assert (state.admitted, state.in_flight) == (0, 1)
        go_on.set()
        worker.result(timeout=10)
        assert (state.admitted, state.in_flight) == (0, 0)
    finally:
        go_on.set()
        state.executor.shutdown()


def test_requests_right_behind_vanished_clients_are_not_refused_below_max_queue(server):
    """--max-queue 4: four clients send a generation and vanish (running, or waiting for the worker); two
    requests sent the moment after are both served: the vanished ones' places had been held until their handlers
    saw them gone (a poll) and their runs stopped (a layer, a token), and the two met a 429."""
    def request(body: dict) -> bytes:
        content = json.dumps(body).encode()
        return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close"
                b"\r\nContent-Length: %d\r\n\r\n" % len(content) + content)
    gone = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(4)]
    following = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(2)]
    for s in gone:
        s.sendall(request({"prompt": "x " * 20, "max_tokens": 200, "temperature": 1}))
    deadline = time.monotonic() + 10
    while server.state.admitted < 4:
        assert time.monotonic() < deadline, server.state.admitted
        time.sleep(0.01)
    for s in gone:
        s.close()
    for s in following:
        s.sendall(request(GOOD))
    replies = [_closed_within(s, 10) for s in following]
    assert all(reply.startswith(b"HTTP/1.1 200") for reply in replies), replies


def test_a_body_that_stops_coming_is_408(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\"")
        t0 = time.monotonic()
        reply = _closed_within(s, 5)
    assert reply.startswith(b"HTTP/1.1 408") and b"--timeout-read" in reply
    assert 0.8 < time.monotonic() - t0 < 4


def test_an_idle_connection_is_closed_after_the_keep_alive(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        t0 = time.monotonic()
        reply = _closed_within(s, 5)
    assert reply.startswith(b"HTTP/1.1 200") and time.monotonic() - t0 < 3


def test_connections_past_the_limit_get_503_with_retry_after(tiny):
    running = _serve(tiny, max_connections=3, read_timeout_s=2.0)
    try:
        held = [socket.create_connection(("127.0.0.1", running.port), timeout=10) for _ in range(3)]
        for s in held:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers not finished: the connection is held
        time.sleep(0.2)
        r = httpx.get(f"{running.url}/health", timeout=5)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "too_many_connections" and "--max-connections" in r.text
        for s in held:
            assert _closed_within(s, 5) == b""  # the header deadline lets the held ones go
            s.close()
        assert httpx.get(f"{running.url}/health", timeout=5).status_code == 200
    finally:
        _stop(running)


# ---- work off the event loop ------------------------------------------------------------------------------------

def test_health_answers_while_the_largest_allowed_prompt_is_tokenized(server):
    """A prompt of the body limit (1 MiB: about a million tokens with tiny's byte-level tokenizer) is tokenized on
    a worker thread (then refused: over max_context); /health answers meanwhile."""
    prompt = "Once upon a time, a fox. " * (((1 << 20) - 100) // 25)
    worst, r = _health_worst(server.url, lambda: _post(server, {"prompt": prompt, "max_tokens": 1}))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # tokenized: the prompt's length in tokens is named
    assert int(re.search(r"the prompt is (\d+) tokens", r.json()["error"]["message"]).group(1)) > 500_000
    assert worst < 0.5, worst


@pytest.mark.parametrize("pieces", [False, True])
def test_health_answers_while_the_largest_allowed_text_is_tokenized_by_itself(server, pieces):
    """/tokenize of a text of the body limit: encoded, answered and its JSON written on a worker thread; its pieces
    (a JSON object a token) only within max_context, else a 400 naming with_pieces."""
    content = "Once upon a time, a fox. " * (((1 << 20) - 100) // 25)
    worst, r = _health_worst(server.url, lambda: httpx.post(f"{server.url}/tokenize", timeout=TIMEOUT,
                                                            json={"content": content, "with_pieces": pieces}))
    if pieces:
        assert _error(r, 400)["param"] == "with_pieces"
        assert re.search(r"the content is \d{6,} tokens, over this server's max_context of 256", r.text), r.text
    else:
        assert r.status_code == 200 and len(r.json()["tokens"]) > 500_000
    assert worst < 0.5, worst


@pytest.mark.parametrize("stream", [False, True])
def test_health_answers_while_an_echoed_prompts_logprobs_are_built(server, monkeypatch, stream):
    """An echo with logprobs answers a prompt's length of entries (text offsets, top texts: seconds at 128K
    tokens): they are built on a worker thread, streamed or not; /health answers meanwhile (here their offsets
    take 1 s)."""
    from moepack.serve import app as app_module

    real = app_module.EchoOffsets.of
    monkeypatch.setattr(app_module.EchoOffsets, "of", lambda self, tokens: time.sleep(1.0) or real(self, tokens))
    body = {"prompt": "Once upon a time", "echo": True, "logprobs": 1, "max_tokens": 2, "stream": stream}
    worst, r = _health_worst(server.url, lambda: _post(server, body))
    assert r.status_code == 200 and "text_offset" in r.text, r.text
    assert worst < 0.5, worst


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_health_answers_while_vllms_prompt_logprobs_are_written(server, monkeypatch, path):
    """vLLM's prompt_logprobs answer a prompt's length of entries, k + 1 each (100s of MB of JSON at 128K tokens):
    the response is built and its JSON written on a worker thread on either endpoint (chat's had been written on
    the event loop); /health answers meanwhile (here writing them takes 1 s)."""
    from starlette.responses import JSONResponse

    real = JSONResponse.render
    monkeypatch.setattr(JSONResponse, "render", lambda self, content: (
        time.sleep(1.0) if "prompt_logprobs" in json.dumps(content) else None) or real(self, content))
    prompt = {"prompt": "Once upon a time"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "Once upon a time"}]}
    worst, r = _health_worst(server.url, lambda: httpx.post(f"{server.url}{path}", timeout=TIMEOUT, json={
        **prompt, "prompt_logprobs": 2, "max_tokens": 2}))
    assert r.status_code == 200 and "prompt_logprobs" in r.text, r.text
    assert worst < 0.5, worst


def test_health_answers_while_a_chats_logprobs_are_built(server, monkeypatch):
    """A chat's answer with logprobs (top_logprobs + 1 objects a token: 2.8 s at 32,000 tokens of top 20) is built,
    split and its JSON written on a worker thread, as a completion's is (it had been on the event loop); /health
    answers meanwhile (here building them takes 1 s)."""
    from moepack.serve import app as app_module

    real = app_module.chat_logprobs
    monkeypatch.setattr(app_module, "chat_logprobs", lambda *args: time.sleep(1.0) or real(*args))
    body = {"messages": [{"role": "user", "content": "Once upon a time"}], "logprobs": True, "top_logprobs": 2,
            "max_tokens": 2}
    worst, r = _health_worst(server.url, lambda: _post(server, body, path="chat/completions"))
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["content"], r.text
    assert worst < 0.5, worst


def test_health_answers_while_a_response_streams_last_events_are_written(server, monkeypatch):
    """A /v1/responses stream's last events (each closed item with its whole text and logprobs, then the response:
    copied and written, 1.9 s at 32,000 tokens of top 20) are built on a worker thread; /health answers meanwhile
    (here closing the items takes 1 s)."""
    from moepack.serve import responses

    real = responses.OutputItems.end
    monkeypatch.setattr(responses.OutputItems, "end", lambda self, status: time.sleep(1.0) or real(self, status))
    body = {"input": "Once upon a time", "max_output_tokens": 2, "stream": True}
    worst, r = _health_worst(server.url, lambda: _post(server, body, path="responses"))
    assert r.status_code == 200 and "response.output_text.done" in r.text and '"sequence_number"' in r.text, r.text
    assert worst < 0.5, worst


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_truncate_prompt_tokens_minus_one_leaves_the_answer_room(server, path):
    """vLLM's truncate_prompt_tokens -1 keeps as much of the prompt's end as the context holds beside the answer
    (max_tokens, or the endpoint's default): it had kept the whole context (256 here), always a 400."""
    from moepack.serve.app import DEFAULT_COMPLETION_TOKENS

    text = "Once upon a time, a fox. " * 20  # (500 tokens)
    prompt = {"prompt": text} if path == "/v1/completions" else {"messages": [{"role": "user", "content": text}]}
    for max_tokens in (10, None):
        if max_tokens is None and path != "/v1/completions":
            continue  # (chat's default, 1024 tokens, is over this context: its prompt would keep a token)
        body = {**prompt, "truncate_prompt_tokens": -1, "temperature": 0,
                **({} if max_tokens is None else {"max_tokens": max_tokens})}
        r = httpx.post(f"{server.url}{path}", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 256 - (max_tokens or DEFAULT_COMPLETION_TOKENS)


def test_vllms_token_strs_only_within_max_context(server):
    """vLLM's /tokenize form bounds its token strings as llama-server's form bounds its pieces (a JSON string a
    token): a text over max_context asked for them is a 400 naming return_token_strs; its ids alone are answered."""
    prompt = "Once upon a time, a fox. " * 40
    for strings in (True, False):
        r = httpx.post(f"{server.url}/tokenize", timeout=TIMEOUT,
                       json={"prompt": prompt, "add_special_tokens": False, "return_token_strs": strings})
        if strings:
            assert _error(r, 400)["param"] == "return_token_strs"
            assert re.search(r"the prompt is \d+ tokens, over this server's max_context of 256", r.text), r.text
        else:
            assert r.status_code == 200 and r.json()["count"] > 256 and r.json()["token_strs"] is None


def test_tokenize_takes_a_place_in_the_queue(server, monkeypatch):
    """Requests to /tokenize count against --max-queue as generations do (4 here): a fifth at once is a 429."""
    release = threading.Event()
    tok = server.state.tokenizer
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda *a, **kw: release.wait(TIMEOUT) and encode(*a, **kw))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        held = [pool.submit(httpx.post, f"{server.url}/tokenize", json={"content": "a fox"}, timeout=TIMEOUT)
                for _ in range(4)]
        deadline = time.monotonic() + 10
        while server.state.admitted < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            assert _error(httpx.post(f"{server.url}/tokenize", json={"content": "x"}, timeout=TIMEOUT),
                          429)["code"] == "queue_full"
        finally:
            release.set()
        assert [f.result().status_code for f in held] == [200] * 4
    assert server.state.admitted == 0
    assert httpx.post(f"{server.url}/tokenize", json={"content": "x"}, timeout=TIMEOUT).status_code == 200


# ---- a prefill that stops -----------------------------------------------------------------------------------------

def _slow_layers(generator, delay: float) -> list[int]:
    """Each prefill layer of `generator` takes `delay` s more; returns the list of layers run (appended to)."""
    ran: list[int] = []

    def on_layer(layer, n_layers, nbytes):
        ran.append(layer)
        time.sleep(delay)

    generator.prefill_options = dataclasses.replace(generator.prefill_options, on_layer=on_layer)
    return ran


def test_the_generator_stops_a_prefill_between_layers_and_the_next_one_is_the_same(tiny):
    with Generator(tiny, cache_gib=0.5) as g:
        before = g.generate([5, 6, 7, 8], GenerateOptions(max_new_tokens=6)).generated_ids
        asked = []
        result = g.generate([5, 6, 7, 8], GenerateOptions(max_new_tokens=6),
                            cancelled=lambda: (asked.append(1), len(asked) > 2)[1])
        assert result.finish_reason == "cancelled" and result.generated_ids == []
        assert result.stats["prefill"]["cancelled_after_layers"] == 2
        assert g.generate([5, 6, 7, 8], GenerateOptions(max_new_tokens=6)).generated_ids == before
        # the engine alone (its dense weights read, not resident): asked before the first layer
        with pytest.raises(GenerationCancelled) as stopped:
            engine = StreamingPrefill(g.c, g.prefill_options)
            try:
                engine.run(torch.tensor([1, 2, 3]), should_stop=lambda: True)
            finally:
                engine.close()
        assert stopped.value.layers_done == 0
        # and between a layer's query chunks: 40 tokens in chunks of 8, stopped at the second call, inside layer 0
        asked.clear()
        with pytest.raises(GenerationCancelled) as stopped:
            engine = StreamingPrefill(g.c, dataclasses.replace(g.prefill_options, query_chunk=8))
            try:
                engine.run(torch.arange(1, 41), should_stop=lambda: (asked.append(1), len(asked) > 1)[1])
            finally:
                engine.close()
        assert stopped.value.layers_done == 0 and len(asked) == 2
        assert g.generate([5, 6, 7, 8], GenerateOptions(max_new_tokens=6)).generated_ids == before


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_mid_prefill_stops_it(tiny, stream):
    """Each of tiny's 4 layers takes 0.8 s more; the client leaves 0.5 s in: the prefill stops at its next layer
    (not all 4 run) and the next request is served at once."""
    logs: list[str] = []
    running = _serve(tiny, logs)
    try:
        expect = _answers(running)
        ran = _slow_layers(running.generator, 0.8)
        body = {**GOOD, "stream": stream}
        with pytest.raises(httpx.TimeoutException):
            with httpx.stream("POST", f"{running.url}/v1/completions", json=body,
                              timeout=httpx.Timeout(0.5, connect=5)) as r:
                for _ in r.iter_lines():
                    pass
        t0 = time.monotonic()
        while not any("finish=cancelled" in line for line in logs):
            assert time.monotonic() - t0 < 5, logs[-3:]
            time.sleep(0.05)
        assert any("prefill_stopped_after_layers=" in line for line in logs)
        assert len(ran) < 4, ran
        running.generator.prefill_options = dataclasses.replace(running.generator.prefill_options, on_layer=None)
        _answers(running, expect)
    finally:
        _stop(running)


def test_closing_the_server_mid_prefill_stops_the_generation_before_the_generator_closes(tiny):
    """One generation at a time (no batch): Server.close() stops the running one at its next layer and waits for
    it, so the generator closed right after (as `moepack serve` does on shutdown) is not closed under it."""
    logs: list[str] = []
    running = _serve(tiny, logs)
    try:
        ran = _slow_layers(running.generator, 0.8)
        answer = {}
        client = threading.Thread(target=lambda: answer.update(r=_post(running, GOOD)))
        client.start()
        t0 = time.monotonic()
        while not ran:
            assert time.monotonic() - t0 < 30
            time.sleep(0.05)
        running.state.close()
        assert any("finish=cancelled" in line for line in logs), logs[-3:]  # stopped, and waited for
        assert len(ran) < 4, ran
        running.generator.close()
        client.join(30)
        assert not any("internal error" in line for line in logs), logs[-3:]
    finally:
        running.stop()


def test_a_request_past_its_deadline_stops_its_prefill_with_408(tiny):
    logs: list[str] = []
    running = _serve(tiny, logs, request_timeout_s=1.0)
    try:
        expect = _answers(running)
        ran = _slow_layers(running.generator, 0.6)
        error = _error(_post(running, GOOD), 408)
        assert error["code"] == "request_timeout" and "--request-timeout" in error["message"]
        assert len(ran) < 4 and any("finish=timeout" in line for line in logs)
        running.generator.prefill_options = dataclasses.replace(running.generator.prefill_options, on_layer=None)
        _answers(running, expect)
    finally:
        _stop(running)


def test_a_body_a_little_over_the_limit_gets_its_413_even_when_read_late(server):
    """The whole body sent, the reply read only afterwards: the server reads and drops a body declared a little
    over the limit before it answers, so closing the connection does not reset it with bytes unread (a reset
    destroys the 413 the client has not read yet)."""
    body = b"x" * ((1 << 20) + 1)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(0.5)  # the server has answered and closed by now
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413"), reply[:100]
    assert b"body_too_large" in reply
    _answers(server)


@pytest.mark.parametrize("max_batch", [1, 4])
def test_sigterm_ends_running_streams_cleanly_and_the_server_exits_at_once(tiny, max_batch):
    """SIGTERM while streams run: each ends with its last chunk and [DONE] (a request still waiting gets its 503
    or its stream's end; a waiting request not streamed its 503, never an empty 200), and the process exits
    within seconds; uvicorn alone waited for every stream to run to
    its max_tokens and started the waiting ones after the signal."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "moepack", "serve", tiny, "--port", "0", "--json",
                             "--max-batch", str(max_batch), "--cache-gib", "0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ends: dict[int, object] = {}
    started = threading.Event()

    def stream(i):
        body = {"prompt": "hi", "max_tokens": 100000, "stream": True, "logit_bias": {"65": 100}}  # never an EOS
        try:
            with httpx.stream("POST", f"{url}/completions", json=body, timeout=60) as r:
                if r.status_code != 200:
                    ends[i] = (r.status_code, json.loads(r.read())["error"]["code"])
                    return
                lines = []
                for line in r.iter_lines():
                    started.set()
                    lines.append(line)
                ends[i] = [x for x in lines if x][-1]
        except httpx.HTTPError as e:
            ends[i] = e

    def whole(i):  # not streamed (the openai client's default): an empty 200 would read as a success
        body = {"prompt": "hi", "max_tokens": 100000, "logit_bias": {"65": 100}}
        try:
            r = httpx.post(f"{url}/completions", json=body, timeout=60)
            answer = r.json()
            ends[i] = (r.status_code, answer["error"]["code"] if r.status_code != 200 else
                       min(len(c["token_ids"]) for c in answer["choices"]))
        except httpx.HTTPError as e:
            ends[i] = e

    try:
        url = json.loads(proc.stdout.readline())["url"]
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        assert started.wait(60)
        threads += [threading.Thread(target=whole, args=(i,)) for i in (2, 3)]
        for t in threads[2:]:
            t.start()
        host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
        slow = socket.create_connection((host, int(port)))  # its body half sent: held up the exit --timeout-read
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        assert proc.wait(timeout=30) == 0  # a server's normal end
        assert time.monotonic() - stopped < 15 and proc.stdout.read() == ""  # --json: its one object only
        assert slow.recv(4096).startswith(b"HTTP/1.1 503 ")
        for t in threads:
            t.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert len(ends) == 4, ends
    for i in (0, 1):
        assert ends[i] == "data: [DONE]" or ends[i] == (503, "server_shutting_down"), ends
    for i in (2, 3):  # waiting behind the one stream (max_batch 1): a 503; running: its tokens so far
        assert ends[i] == (503, "server_shutting_down") or max_batch > 1 and ends[i][0] == 200 and ends[i][1] > 0, ends


def test_log_lines_from_many_threads_stay_whole(capfd):
    """The worker threads log at once: each line is written whole (print wrote the text and its newline apart,
    and under load two lines ran together with an empty one after)."""
    from moepack.serve.app import write_log_line

    def log(t):
        for i in range(300):
            write_log_line(f"moepack serve: thread {t} line {i} " + "x" * 50)

    threads = [threading.Thread(target=log, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 2400 and all(line.startswith("moepack serve: thread ") and line.endswith("x" * 50)
                                      for line in lines)


def test_a_stream_whose_client_reads_none_of_its_events_is_stopped(monkeypatch):
    """A client that never reads its stream: its events pile up in the server's memory (every token, its logprobs)
    until max_tokens or --request-timeout. Past MAX_UNREAD_EVENTS unread the job is stopped as a client gone is,
    and the log says why; a client that keeps reading is never stopped."""
    import asyncio

    from moepack.serve import app as serve_app

    monkeypatch.setattr(serve_app, "MAX_UNREAD_EVENTS", 8)
    logs: list[str] = []

    async def run(read: bool) -> serve_app.Job:
        job = serve_app.Job("cmpl-1", [[1]], None, deadline=time.monotonic() + 60)
        job.queue = asyncio.Queue()
        push = serve_app.events_onto(job, asyncio.get_running_loop(), logs.append)
        for i in range(40):  # (the worker thread's pushes, each delivered by the loop before the next)
            push(("text", 0, f"piece {i}"))
            await asyncio.sleep(0)
            if read:
                job.queue.get_nowait()
        return job

    assert not asyncio.run(run(read=True)).cancelled and not logs
    assert asyncio.run(run(read=False)).cancelled
    assert logs == ["moepack serve: cmpl-1 stopped: its client read none of its last 8 events"]
