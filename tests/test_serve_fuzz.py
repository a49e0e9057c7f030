"""A fuzz target over moepack serve's request bodies (hypothesis, through the ASGI app in-process): whatever the
body (completions, chat, the Responses API's), the status is a 4xx or a 200, never a 5xx, and the next valid greedy
request answers at once with the same text as before."""

from __future__ import annotations

import json
import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from moepack.packer.convert import convert_checkpoint
from moepack.runtime.generate import Generator
from moepack.serve.app import ServerLimits, make_app

GOOD = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}

# JSON-ish values, including what JSON cannot say (NaN, inf: json.dumps writes them as NaN / Infinity) and
# what the fields do not expect
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=40), st.sampled_from(["", "\ud800", "<｜end▁of▁sentence｜>", "x" * 300]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
# each field: a value it takes (so that most bodies go on to the next check, and some generate) or anything
plausible = {
    "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-3, 600), max_size=8), values),
    "messages": st.one_of(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant",
                                                                                   "tool", "robot"]),
                                                          "content": st.one_of(st.text(max_size=20), values)}),
                                   max_size=3), values),
    "max_tokens": st.one_of(st.integers(-2, 6), values),
    "temperature": st.one_of(st.floats(-1, 3), values),
    "top_p": st.one_of(st.floats(-0.5, 1.5), values),
    "top_k": st.one_of(st.integers(-1, 5), values),
    "seed": st.one_of(st.integers(-1, 2**65), values),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=20), values),
    "stream": st.one_of(st.booleans(), values),
    "n": st.one_of(st.integers(0, 2), values),
    "model": st.one_of(st.just("tiny"), values),
    "thinking": st.one_of(st.booleans(), st.just({"type": "enabled"}), values),
    "stream_options": st.one_of(st.just({"include_usage": True}), values),
    "reasoning_effort": st.one_of(st.sampled_from(["high", "max", "none"]), values),
    # issue #38's fields: acted on or refused, never a 5xx
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 25), values),
    "top_logprobs": st.one_of(st.integers(-1, 25), values),
    "logit_bias": st.one_of(st.dictionaries(st.sampled_from(["1", "5", "-3", "x", "99999"]),
                                            st.one_of(st.floats(-150, 150), values), max_size=3), values),
    "presence_penalty": st.one_of(st.floats(-3, 3), values),
    "frequency_penalty": st.one_of(st.floats(-3, 3), values),
    "echo": st.one_of(st.booleans(), values),
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "xml"]),
                               "json_schema": st.fixed_dictionaries({"name": st.just("x"),
                                                                     "schema": st.one_of(values, st.just(
                                                                         {"type": "object"}))})}), values),
    "tools": st.one_of(st.just([{"type": "function", "function": {"name": "f", "parameters": {}}}]), values),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]),
                             st.just({"type": "function", "function": {"name": "f"}}), values),
    "unknown_field": values,
}
VALID = {"model": "tiny", "max_tokens": 3, "temperature": 0}  # with the endpoint's prompt or messages
# a valid body with one to three fields changed
mutated = (st.lists(st.sampled_from(sorted(plausible)), min_size=1, max_size=3, unique=True)
           .flatmap(lambda keys: st.fixed_dictionaries({k: plausible[k] for k in keys}))
           .map(lambda changes: {**VALID, **changes}))
bodies = st.one_of(
    mutated,
    mutated,
    st.fixed_dictionaries({}, optional=plausible),
    values,
    st.binary(max_size=64),
)


def _raw(body) -> bytes:
    if isinstance(body, bytes):
        return body
    return json.dumps(body, allow_nan=True).encode()  # a lone surrogate as its \ud800 escape


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from moepack.packer.synth import synth_checkpoint

    base = tmp_path_factory.mktemp("serve-fuzz")
    synth_checkpoint(str(base / "tiny"), preset="tiny", progress=False)
    convert_checkpoint(str(base / "tiny"), str(base / "tiny.moepack"), policy="keep", progress=False)
    g = Generator(str(base / "tiny.moepack"), cache_gib=0.5)
    # a small context bounds what a fuzzed max_tokens can make the decode do
    app = make_app(g, "tiny", log=lambda line: None, limits=ServerLimits(max_context=48, max_body_bytes=1 << 16))
    with TestClient(app, raise_server_exceptions=False) as c:
        c.expected = c.post("/v1/completions", json=GOOD).json()["choices"][0]["text"]
        yield c
    g.close()


def _answered_and_unharmed(client, path: str, body) -> None:
    """`body` posted to `path` is a 200 or a 4xx with a one-line error, and the next valid request is unharmed."""
    r = client.post(path, content=_raw(body), headers={"Content-Type": "application/json"})
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code != 200:
        error = r.json()["error"]
        assert error["message"] and "\n" not in error["message"] and "Traceback" not in error["message"]
        assert error["param"] is None or not error["param"].startswith("-")
    else:  # a value the generation refuses came before the 200, never as an error event after it
        assert 'data: {"error"' not in r.text and not r.text.startswith('{"error"')
        assert "event: response.failed" not in r.text
    t0 = time.monotonic()
    after = client.post("/v1/completions", json=GOOD)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == client.expected
    assert time.monotonic() - t0 < 10
    assert client.app.state.server.admitted == 0


FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                     HealthCheck.too_slow])


@FUZZ
@given(body=bodies, chat=st.booleans())
def test_any_body_is_a_4xx_or_a_200_and_the_next_request_is_unharmed(client, body, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if isinstance(body, dict) and body.get("model") == "tiny" and "prompt" not in body and "messages" not in body:
        body = {**body, **({"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hello there"})}
    _answered_and_unharmed(client, path, body)


# /v1/responses (serve/responses.py): its input items, tools and settings, put as a chat's
parts = st.lists(st.fixed_dictionaries({"type": st.one_of(st.sampled_from(["input_text", "output_text",
                                                                          "input_image"]), values),
                                        "text": st.one_of(st.text(max_size=10), values)}), max_size=2)
input_items = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "developer", "assistant", "tool"]),
                                             values),
                           "content": st.one_of(st.text(max_size=20), parts, values)},
                          optional={"type": st.one_of(st.just("message"), values), "id": values}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.one_of(st.just("c1"), values),
                           "name": st.one_of(st.just("f"), values), "arguments": st.one_of(st.just("{}"), values)}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.one_of(st.just("c1"), values),
                           "output": st.one_of(st.text(max_size=10), parts, values)}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference", "web_search_call"])},
                          optional={"id": values, "summary": values, "content": values}),
    values), max_size=4)
responses_fields = {
    "input": st.one_of(st.text(max_size=20), input_items, values),
    "instructions": st.one_of(st.text(max_size=20), values),
    "max_output_tokens": st.one_of(st.integers(-2, 6), values),
    "temperature": plausible["temperature"],
    "stream": plausible["stream"],
    "model": plausible["model"],
    "thinking": plausible["thinking"],
    "tools": st.one_of(st.just([{"type": "function", "name": "f", "parameters": {}}]),
                       st.lists(st.fixed_dictionaries({"type": st.one_of(st.sampled_from(["function", "web_search"]),
                                                                         values), "name": values}), max_size=2),
                       values),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), st.just({"type": "function", "name": "f"}),
                             values),
    "text": st.one_of(st.fixed_dictionaries({"format": st.one_of(st.fixed_dictionaries({
        "type": st.sampled_from(["text", "json_object", "json_schema", "xml"]),
        "schema": st.one_of(values, st.just({"type": "object"}))}), values)}), values),
    "reasoning": st.one_of(st.fixed_dictionaries({"effort": st.one_of(st.sampled_from(["high", "max", "low"]), values)},
                                                 optional={"summary": values}), values),
    "include": st.one_of(st.just(["message.output_text.logprobs"]), values),
    "top_logprobs": plausible["top_logprobs"],
    "metadata": st.one_of(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3), values),
    "store": st.one_of(st.booleans(), values),
    "stream_options": values,
    "previous_response_id": values,
    "truncation": st.one_of(st.just("disabled"), values),
    "background": values,
    "parallel_tool_calls": values,
    "unknown_field": values,
}
responses_bodies = st.one_of(
    st.lists(st.sampled_from(sorted(responses_fields)), min_size=1, max_size=3, unique=True)
    .flatmap(lambda keys: st.fixed_dictionaries({k: responses_fields[k] for k in keys}))
    .map(lambda changes: {"model": "tiny", "max_output_tokens": 3, "temperature": 0, "input": "Hi", **changes}),
    st.fixed_dictionaries({}, optional=responses_fields),
    values,
)


@settings(FUZZ, max_examples=30)  # (a few seconds: the chat's own checks are fuzzed above)
@given(body=responses_bodies)
def test_any_responses_body_is_a_4xx_or_a_200_and_the_next_request_is_unharmed(client, body):
    _answered_and_unharmed(client, "/v1/responses", body)


def test_the_fuzz_bodies_reach_the_values_checks():
    """The strategy makes NaN, infinities and huge integers, which the server must refuse as JSON."""
    assert "NaN" in _raw({"t": math.nan}).decode() and "Infinity" in _raw({"t": math.inf}).decode()
