"""POST /v1/messages and /v1/messages/count_tokens (serve/messages.py), through the official `anthropic` client: the
answer is the chat completions' answer to the same conversation, whole and streamed (the SDK's stream helper builds
the same message), with its thinking block (sent back, in the next prompt where the conversation has tools), its
tool_use blocks and tool_result round trip, stop_sequences and max_tokens stop reasons, count_tokens, x-api-key auth;
a client leaving mid-stream stops its generation; every error is Anthropic's shape, naming the field."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import pytest

from test_serve_clients import CHAT, EXPECTED_CALLS, SEARCH, TIMEOUT, TWO_CALLS, WEATHER, batched, scripted, server, \
    tiny_path
from test_serve_responses import metric_samples, script_tokens

__all__ = ["batched", "scripted", "server", "tiny_path"]  # (the fixtures, test_serve_clients.py's)

TOOLS = [{"name": t["function"]["name"], **({"description": t["function"]["description"]}
                                           if "description" in t["function"] else {}),
          "input_schema": t["function"]["parameters"]} for t in (WEATHER, SEARCH)]  # Anthropic's form
GREEDY = {"extra_body": {"temperature": 0}}  # (the SDK has no temperature argument; the API takes it)
THINKING = {"type": "enabled", "budget_tokens": 1024}


def client(server, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=TIMEOUT)


def _blocks(message) -> list[dict]:
    return [block.model_dump(exclude={"parsed_output"}, exclude_none=True) for block in message.content]


def _same_message(streamed, whole) -> None:
    """The stream helper's final message is the non-streamed one (but its id)."""
    assert _blocks(streamed) == _blocks(whole)
    assert (streamed.stop_reason, streamed.stop_sequence, streamed.usage, streamed.model, streamed.role) == (
        whole.stop_reason, whole.stop_sequence, whole.usage, whole.model, whole.role)
    assert streamed.id.startswith("msg_") and whole.id.startswith("msg_") and streamed.id != whole.id


def _streamed(c, **kw):
    with c.messages.stream(**kw) as stream:
        events = list(stream)
        return events, stream.get_final_message()


def test_a_message_is_the_chat_answer_whole_and_streamed(server):
    c = client(server)
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    chat = server.client().chat.completions.create(model="tiny", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, *CHAT])
    assert chat.choices[0].finish_reason == "length"  # (the tiny model writes on: cut short)
    kw = dict(model="tiny", max_tokens=12, system=system, messages=CHAT, metadata={"user_id": "u1"},
              service_tier="auto", **GREEDY)
    m = client(server).messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny"
    assert _blocks(m) == [{"type": "text", "text": chat.choices[0].message.content}]
    assert (m.stop_reason, m.stop_sequence) == ("max_tokens", None)
    assert (m.usage.input_tokens, m.usage.output_tokens, m.usage.cache_read_input_tokens,
            m.usage.cache_creation_input_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens, 0, 0)
    events, final = _streamed(c, **kw)
    _same_message(final, m)
    kinds = [e.type for e in events if not e.type.endswith(("text", "thinking", "input_json"))]  # (the SDK's own)
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    # the raw stream: Anthropic's `event:` lines, a ping after message_start
    with httpx.stream("POST", f"{server.url}/v1/messages", timeout=TIMEOUT,
                      json={"model": "tiny", "max_tokens": 3, "messages": CHAT, "stream": True}) as r:
        names = [line.split(": ", 1)[1] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-1] == "message_stop"


def test_batched_it_is_the_chats_answer_too_and_counted_in_the_metrics(batched):
    """With --max-batch 4 the message runs on the batch scheduler as a chat does: the same text, whole and
    streamed; /metrics counts it under its endpoint, its tokens too."""
    c = client(batched)
    chat = batched.client().chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0)
    before = metric_samples(batched)
    kw = dict(model="tiny", max_tokens=8, messages=CHAT, **GREEDY)
    m = c.messages.create(**kw)
    _same_message(_streamed(c, **kw)[1], m)
    after = metric_samples(batched)
    assert _blocks(m) == [{"type": "text", "text": chat.choices[0].message.content}]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    ok = ("moepack_requests_total", (("endpoint", "/v1/messages"), ("status", "200")))
    assert after.get(ok, 0) - before.get(ok, 0) == 2
    generated = ("moepack_generated_tokens_total", ())
    assert after[generated] - before[generated] == 2 * m.usage.output_tokens
    text = m.content[0].text  # (the stop string that ended it, from the batch scheduler's sequence too)
    stop = c.messages.create(**kw, stop_sequences=[text[2:4]])
    assert (stop.stop_reason, stop.stop_sequence, stop.content[0].text) == (
        "stop_sequence", text[2:4], text[:text.index(text[2:4])])


def test_usage_counts_the_prompt_caches_tokens_as_cache_reads():
    """input_tokens are the prompt's tokens not read from the prompt cache, as Anthropic counts them (a client that
    adds the three counts gets the prompt's length)."""
    from types import SimpleNamespace

    from moepack.serve.messages import usage

    result = SimpleNamespace(stats={"prefill": {"cached_tokens": 64}}, generated_ids=[1, 2, 3])
    assert usage(SimpleNamespace(prompt_tokens=100), result) == {
        "input_tokens": 36, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 64, "output_tokens": 3}


def _contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def test_a_thinking_block_goes_out_and_comes_back_in(server, monkeypatch):
    """thinking enabled: the thought is a thinking block (with a signature) before the text, whole and streamed;
    sent back in the next request, it is that assistant message's reasoning_content: in the prompt where the
    conversation has tools (as DeepSeek-V4's release keeps it), dropped where it has none, as chat does."""
    tok = server.tok
    thought, answer = tok.encode("I think so.", False, False), tok.encode("Yes, it is.", False, False)
    prompts = script_tokens(server, monkeypatch, thought + tok.encode_special("</think>") + answer)
    c = client(server)
    user = {"role": "user", "content": "Is it?"}
    kw = dict(model="tiny", max_tokens=2048, messages=[user], thinking=THINKING)
    m = c.messages.create(**kw)
    assert [b["type"] for b in _blocks(m)] == ["thinking", "text"] and m.stop_reason == "end_turn"
    assert (m.content[0].thinking, m.content[1].text) == ("I think so.", "Yes, it is.") and m.content[0].signature
    events, final = _streamed(c, **kw)
    _same_message(final, m)
    order = [(e.type, getattr(getattr(e, "delta", None), "type", None), getattr(e, "index", None))
             for e in events if e.type.startswith("content_block")]
    assert order.index(("content_block_delta", "signature_delta", 0)) == order.index(
        ("content_block_stop", None, 0)) - 1  # (the thinking block's last delta, before its stop)
    chat = server.client().chat.completions.create(model="tiny", messages=[user], extra_body={"thinking": True})
    assert prompts[-1] == prompts[-2]
    assert chat.choices[0].message.model_dump()["reasoning_content"] == "I think so."
    # back in, with tools: the thought in the next prompt (the chat's prompt with reasoning_content)
    again = [user, {"role": "assistant", "content": final.content}, {"role": "user", "content": "Sure?"}]
    c.messages.create(model="tiny", max_tokens=2048, messages=again, thinking=THINKING, tools=TOOLS)
    assert _contains(prompts[-1], thought)
    server.client().chat.completions.create(model="tiny", tools=[WEATHER, SEARCH], extra_body={"thinking": True},
                                            messages=[user, {"role": "assistant", "content": "Yes, it is.",
                                                             "reasoning_content": "I think so."},
                                                      {"role": "user", "content": "Sure?"}])
    assert prompts[-1] == prompts[-2]
    # without tools: dropped, as chat drops it (a thinking block without its signature taken too)
    unsigned = [{"type": "thinking", "thinking": "I think so."}, {"type": "text", "text": "Yes, it is."}]
    c.messages.create(model="tiny", max_tokens=2048, thinking=THINKING, messages=[
        user, {"role": "assistant", "content": unsigned}, {"role": "user", "content": "Sure?"}])
    assert not _contains(prompts[-1], thought)
    server.client().chat.completions.create(model="tiny", extra_body={"thinking": True}, messages=[
        user, {"role": "assistant", "content": "Yes, it is."}, {"role": "user", "content": "Sure?"}])
    assert prompts[-1] == prompts[-2]


def test_claude_codes_adaptive_thinking_and_context_management_are_served(server, monkeypatch):
    """Claude Code (2.1 and later) sends thinking {"type": "adaptive", "budget_tokens": 0} and, with it,
    context_management clearing no thinking (clear_thinking_20251015, keep "all"): both had been 400s, every one of
    its requests refused. Adaptive thinking is chat's thinking on (the prompt of enabled thinking, the thought a
    thinking block), display "summarized" what is written; keeping all thinking is what moepack does."""
    tok = server.tok
    prompts = script_tokens(server, monkeypatch, tok.encode("Hm.", False, False) + tok.encode_special("</think>")
                            + tok.encode("Yes.", False, False))
    c = client(server)
    kw = dict(model="tiny", max_tokens=2048, messages=[{"role": "user", "content": "Is it?"}])
    enabled = c.messages.create(**kw, thinking=THINKING)
    keep_all = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    for thinking in ({"type": "adaptive", "budget_tokens": 0}, {"type": "adaptive", "display": "summarized"}):
        m = c.messages.create(**kw, extra_body={"thinking": thinking, "context_management": keep_all})
        assert prompts[-1] == prompts[-2] and _blocks(m) == _blocks(enabled)
        assert [b.type for b in m.content] == ["thinking", "text"] and m.content[0].thinking == "Hm."
    counted = c.messages.count_tokens(model="tiny", messages=kw["messages"], extra_body={
        "thinking": {"type": "adaptive"}, "context_management": {"edits": [{"type": "clear_thinking_20251015",
                                                                             "keep": {"type": "all"}}]}})
    assert counted.input_tokens == len(prompts[-1])


def test_tool_use_blocks_and_tool_results_make_the_chats_tool_round_trip(server, scripted):
    scripted.text = TWO_CALLS
    c = client(server)
    user = {"role": "user", "content": "Weather?"}
    m = c.messages.create(model="tiny", max_tokens=100, messages=[user], tools=TOOLS)
    assert [b.type for b in m.content] == ["text", "tool_use", "tool_use"] and m.stop_reason == "tool_use"
    assert m.content[0].text == "Let me check."
    calls = m.content[1:]
    assert [(call.name, call.input) for call in calls] == EXPECTED_CALLS
    assert all(call.id.startswith("toolu_") for call in calls) and calls[0].id != calls[1].id
    asked = scripted.prompts[-1]
    server.client().chat.completions.create(model="tiny", messages=[user], tools=[WEATHER, SEARCH])
    assert scripted.prompts[-1] == asked  # the tools where the chat puts them
    events, final = _streamed(c, model="tiny", max_tokens=100, messages=[user], tools=TOOLS)
    assert [(b.name, b.input) for b in final.content[1:]] == EXPECTED_CALLS and final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["text", "tool_use", "tool_use"]
    # the results sent back (is_error taken): the chat's conversation with tool messages, in order
    scripted.text = "It is sunny."
    results = {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": calls[1].id, "content": "nothing", "is_error": True},
        {"type": "tool_result", "tool_use_id": calls[0].id, "content": [{"type": "text", "text": "Sunny"}]}]}
    again = c.messages.create(model="tiny", max_tokens=100, tools=TOOLS, messages=[
        user, {"role": "assistant", "content": m.content}, results])
    assert _blocks(again) == [{"type": "text", "text": "It is sunny."}] and again.stop_reason == "end_turn"
    asked = scripted.prompts[-1]
    chat_calls = [{"id": call.id, "type": "function", "function": {"name": call.name,
                                                                   "arguments": json.dumps(call.input)}}
                  for call in calls]
    server.client().chat.completions.create(model="tiny", tools=[WEATHER, SEARCH], messages=[
        user, {"role": "assistant", "content": "Let me check.", "tool_calls": chat_calls},
        {"role": "tool", "tool_call_id": calls[1].id, "content": "nothing"},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "Sunny"}])
    assert scripted.prompts[-1] == asked
    # a named tool, and any: chat's tool_choice
    c.messages.create(model="tiny", max_tokens=100, messages=[user], tools=TOOLS,
                      tool_choice={"type": "tool", "name": "search", "disable_parallel_tool_use": True})
    asked = scripted.prompts[-1]
    server.client().chat.completions.create(model="tiny", messages=[user], tools=[WEATHER, SEARCH],
                                            tool_choice={"type": "function", "function": {"name": "search"}})
    assert scripted.prompts[-1] == asked
    c.messages.create(model="tiny", max_tokens=100, messages=[user], tools=TOOLS, tool_choice={"type": "any"})
    asked = scripted.prompts[-1]
    server.client().chat.completions.create(model="tiny", messages=[user], tools=[WEATHER, SEARCH],
                                            tool_choice="required")
    assert scripted.prompts[-1] == asked


def _strict(line: str) -> dict:
    """A stream event's data as strict JSON (NaN or Infinity refused, as JavaScript's JSON.parse refuses them)."""
    def refused(name):
        raise ValueError(f"{name} in an event")
    return json.loads(line[len("data: "):], parse_constant=refused)


def test_a_call_whose_arguments_are_no_json_a_message_carries_is_given_as_their_text(server, scripted):
    """A DeepSeek-V4 parameter the model writes as NaN (Python's json reads it: the chat's arguments text has it):
    the tool_use's input is {"arguments": that text}, for the tool to refuse, whole and streamed (the whole answer
    had been a 500, a streamed one an input_json_delta that is not JSON)."""
    scripted.text = TWO_CALLS.replace('string="false">3<', 'string="false">NaN<')
    kw = dict(model="tiny", max_tokens=100, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS)
    m = client(server).messages.create(**kw)
    assert [(b.name, b.input) for b in m.content[1:]] == [
        ("get_weather", {"arguments": '{"city": "Paris", "days": NaN}'}), EXPECTED_CALLS[1]]
    with httpx.stream("POST", f"{server.url}/v1/messages", json={**kw, "stream": True}, timeout=TIMEOUT) as r:
        events = [_strict(line) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == {"type": "message_stop"} and events[-2]["delta"]["stop_reason"] == "tool_use"
    final = _streamed(client(server), **kw)[1]  # (the SDK's stream helper reads the events)
    assert [(b.name, b.input) for b in final.content[1:]] == [(b.name, b.input) for b in m.content[1:]]


def test_a_user_messages_blocks_are_chat_messages_in_order():
    """A user message's text blocks around its tool_result blocks: a user message each run, the results tool
    messages between them, as the blocks came; an assistant's blocks one message."""
    from moepack.serve.messages import conversation

    text = {"type": "text", "text": "a"}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "r", "cache_control": {"type": "ephemeral"}}
    messages, origins = conversation({"system": "s", "messages": [
        {"role": "user", "content": [text, text, result, {**result, "tool_use_id": "t2", "content": None}, text]},
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"},
                                          {"type": "tool_use", "id": "t3", "name": "f", "input": {"k": "é"}}]}]})
    assert messages == [{"role": "system", "content": "s"}, {"role": "user", "content": [text, text]},
                        {"role": "tool", "tool_call_id": "t1", "content": "r"},
                        {"role": "tool", "tool_call_id": "t2", "content": ""}, {"role": "user", "content": [text]},
                        {"role": "assistant", "content": None, "tool_calls": [
                            {"id": "t3", "type": "function", "function": {"name": "f", "arguments": '{"k": "é"}'}}]}]
    assert origins == ["system", "messages[0].content[0]", "messages[0].content[2]", "messages[0].content[3]",
                       "messages[0].content[4]", "messages[1]"]


def test_stop_sequences_end_the_answer_and_are_echoed(server):
    c = client(server)
    text = server.client().chat.completions.create(model="tiny", messages=CHAT, max_tokens=12,
                                                   temperature=0).choices[0].message.content
    stop = text[3:5]
    kw = dict(model="tiny", max_tokens=12, messages=CHAT, stop_sequences=["never said", stop], **GREEDY)
    m = c.messages.create(**kw)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert _blocks(m) == [{"type": "text", "text": text[:text.index(stop)]}]
    _same_message(_streamed(c, **kw)[1], m)


def test_count_tokens_is_the_prompts_length(server, scripted):
    scripted.text = "Fine."
    c = client(server)
    kw = dict(model="tiny", system="Be brief.", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS)
    counted = c.messages.count_tokens(**kw).input_tokens
    m = c.messages.create(max_tokens=10, **kw)
    assert counted == len(scripted.prompts[-1]) == m.usage.input_tokens
    assert c.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "Weather?"}]).input_tokens \
        < counted  # (the system prompt and the tools counted)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.count_tokens(model="tiny", messages=[], extra_body={"max_tokens": 5})
    assert e.value.body["error"]["type"] == "invalid_request_error"


def test_an_api_key_is_taken_as_x_api_key_or_bearer(server, monkeypatch):
    monkeypatch.setattr(server.state, "api_key", "sekret")
    kw = dict(model="tiny", max_tokens=1, messages=CHAT)
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(server, "wrong").messages.create(**kw)
    assert e.value.status_code == 401 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error" and "x-api-key" in e.value.body["error"]["message"]
    r = httpx.post(f"{server.url}/v1/messages", json=kw, timeout=TIMEOUT)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert client(server, "sekret").messages.create(**kw).usage.output_tokens == 1  # (x-api-key)
    bearer = anthropic.Anthropic(base_url=server.url, auth_token="sekret", max_retries=0, timeout=TIMEOUT)
    assert bearer.messages.create(**kw).usage.output_tokens == 1
    assert server.client("sekret").chat.completions.create(model="tiny", messages=CHAT, max_tokens=1).usage
    r = httpx.get(f"{server.url}/v1/models", headers={"x-api-key": "sekret"}, timeout=TIMEOUT)
    assert r.status_code == 200  # (on every endpoint)
    assert httpx.get(f"{server.url}/v1/models", timeout=TIMEOUT).json()["error"]["code"] == "invalid_api_key"
    many = [("x-api-key", guess) for guess in ("a", "b", "sekret")]  # (one request, many keys: only the first read)
    assert httpx.get(f"{server.url}/v1/models", headers=many, timeout=TIMEOUT).status_code == 401


def test_a_client_that_leaves_mid_stream_stops_its_generation(server, monkeypatch):
    script_tokens(server, monkeypatch, server.tok.encode("word " * 200, False, False), delay=0.05)
    with httpx.stream("POST", f"{server.url}/v1/messages", timeout=TIMEOUT,
                      json={"model": "tiny", "max_tokens": 500, "messages": CHAT, "stream": True}) as first:
        rid = first.headers["x-request-id"]
        assert next(first.iter_lines()) == "event: message_start"
    start = time.monotonic()  # (200 tokens at 0.05 s would take 10 s)
    while (rid, "cancelled") not in server.state.finished:
        assert time.monotonic() - start < 5, list(server.state.finished)
        time.sleep(0.05)
    script_tokens(server, monkeypatch, server.tok.encode("Fine.", False, False))
    assert client(server).messages.create(model="tiny", max_tokens=5, messages=CHAT).content[0].text == "Fine."


def test_a_client_that_half_closes_reads_an_error_event(server, monkeypatch):
    """A client that shuts down its sending side once its request is sent stops its generation as one gone; its
    stream ends with Anthropic's `error` event (not chat's `data: {"error"...}` and [DONE]), never cut."""
    from test_serve_limits import _half_closed

    script_tokens(server, monkeypatch, server.tok.encode("word " * 200, False, False), delay=0.02)
    reply = _half_closed(server, "POST", "/v1/messages", {"max_tokens": 500, "messages": CHAT, "stream": True})
    assert reply.startswith(b"HTTP/1.1 200") and b"event: message_start" in reply
    assert b'event: error\ndata: {"type": "error", "error": {"type": "invalid_request_error", "message": "the ' \
        b'client closed' in reply
    assert b"[DONE]" not in reply and reply.endswith(b"\r\n0\r\n\r\n")  # the chunked body ended, not cut


def test_a_failure_after_the_stream_began_is_an_error_event(server, monkeypatch):
    script_tokens(server, monkeypatch, server.tok.encode("word " * 20, False, False), fail_after=3)
    with httpx.stream("POST", f"{server.url}/v1/messages", timeout=TIMEOUT,
                      json={"model": "tiny", "max_tokens": 50, "messages": CHAT, "stream": True}) as r:
        lines = list(r.iter_lines())
    assert r.status_code == 200 and lines[-3] == "event: error"
    assert json.loads(lines[-2][len("data: "):]) == {"type": "error", "error": {
        "type": "api_error", "message": "internal server error (see the server's log)"}}
    with pytest.raises(anthropic.APIStatusError):
        _streamed(client(server), model="tiny", max_tokens=50, messages=CHAT)


def _user(*blocks) -> list[dict]:
    return [{"role": "user", "content": list(blocks)}]


REFUSED = [
    # (the body's fields over a plain request's, the field named first in the message)
    (dict(max_tokens=None), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=10**12), "max_tokens"),
    (dict(max_tokens="12"), "max_tokens"),
    (dict(messages=[{"role": "system", "content": "Hi"}]), "messages[0].role"),
    (dict(messages=[{"role": "user", "content": "Hi", "name": "ann"}]), "messages[0].name"),
    (dict(messages=[]), "messages"),
    (dict(messages="Hi"), "messages"),
    (dict(messages=_user({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}})),
     "messages[0].content[0].type"),
    (dict(messages=_user({"type": "document", "source": {}})), "messages[0].content[0].type"),
    (dict(messages=_user({"type": "search_result", "source": "x"})), "messages[0].content[0].type"),
    (dict(messages=_user({"type": "tool_use", "id": "t", "name": "f", "input": {}})), "messages[0].content[0]"),
    (dict(messages=_user({"type": "text", "text": 5})), "messages[0].content[0].text"),
    (dict(messages=_user({"type": "text", "text": "x", "cache_control": {"type": "forever"}})),
     "messages[0].content[0].cache_control"),
    (dict(messages=_user({"type": "text", "text": "x", "junk": {"a": [1]}})), "messages[0].content[0].junk"),
    (dict(messages=_user({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]})),
     "messages[0].content[0].content[0].type"),
    (dict(messages=_user({"type": "tool_result", "tool_use_id": "t", "is_error": "yes"})),
     "messages[0].content[0].is_error"),
    (dict(messages=[*CHAT, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                              "input": [1]}]}]), "messages[1].content[0].input"),
    (dict(messages=[{"role": "user", "content": [[{"type": "text", "text": "x"}]]}]), "messages[0].content[0]"),
    # (a type or role that is a list or an object: no key of a table, never a 500)
    (dict(messages=_user({"type": ["text"], "text": "x"})), "messages[0].content[0].type"),
    (dict(messages=[{"role": {"user": 1}, "content": "Hi"}]), "messages[0].role"),
    (dict(tools=TOOLS, tool_choice={"type": ["auto"]}), "tool_choice.type"),
    (dict(thinking={"type": {"enabled": True}}), "thinking.type"),
    (dict(messages=[*CHAT, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {
        "a": json.loads("[" * 40 + "]" * 40)}}]}]), "the request body"),  # (nested past MAX_BODY_DEPTH)
    (dict(system=[{"type": "image"}]), "system[0].type"),
    (dict(system=7), "system"),
    (dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
    (dict(tools=[{"type": "bash_20250124", "name": "bash"}]), "tools[0].type"),
    (dict(tools=[{"name": "f"}]), "tools[0].input_schema"),
    (dict(tools=[{"name": "f g", "input_schema": {}}]), "tools[0].name"),
    (dict(tools=[{"name": "f", "input_schema": {}, "strict": {"x": 1}}]), "tools[0].strict"),
    (dict(tool_choice={"type": "auto"}), "tool_choice"),  # (chat's: no tools to choose)
    (dict(tools=TOOLS, messages=[*CHAT, {"role": "assistant", "content": [  # (chat's, named as Anthropic's)
        {"type": "tool_use", "id": "t", "name": "search", "input": {}}]}]), "messages[1]: a prefill (the final"),
    (dict(tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "some"}), "tool_choice.type"),
    (dict(thinking={"type": "enabled", "budget_tokens": 100}), "thinking.budget_tokens"),
    (dict(max_tokens=2000, thinking={"type": "enabled", "budget_tokens": 4000}), "thinking.budget_tokens"),
    (dict(thinking={"type": "adaptive", "display": "omitted"}), "thinking.display"),
    (dict(thinking={"type": "adaptive", "budget_tokens": -1}), "thinking.budget_tokens"),
    (dict(thinking={"type": "between_tools"}), "thinking.type"),
    (dict(temperature=1.5), "temperature"),
    (dict(temperature=float("nan")), None),  # (not JSON: the body's own error)
    (dict(top_p=-1), "top_p"),
    (dict(top_k="many"), "top_k"),
    (dict(stop_sequences="stop"), "stop_sequences"),
    (dict(stop_sequences=[""]), "stop_sequences"),
    (dict(stop_sequences=["x"] * 1000), "stop_sequences"),
    (dict(stream="yes"), "stream"),
    (dict(metadata={"user_id": 5}), "metadata.user_id"),
    (dict(metadata={"tags": ["a"]}), "metadata.tags"),
    (dict(service_tier="priority"), "service_tier"),
    (dict(container="c_1"), "container"),
    (dict(mcp_servers=[{"type": "url", "url": "http://x", "name": "x"}]), "mcp_servers"),
    (dict(context_management={"edits": [{"type": "clear_tool_uses_20250919"}]}), "context_management.edits[0]"),
    (dict(context_management={"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns",
                                                                                 "value": 1}}]}),
     "context_management.edits[0]"),
    (dict(context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all", "x": 1}]}),
     "context_management.edits[0].x"),
    (dict(context_management={"edits": "all"}), "context_management.edits"),
    (dict(frobnicate=1), "frobnicate"),
]


@pytest.mark.parametrize("fields, named", REFUSED, ids=[f"{list(f)[0]}:{n}" for f, n in REFUSED])
def test_hostile_or_unsupported_input_is_a_400_in_anthropics_shape_naming_the_field(server, fields, named):
    body = {"model": "tiny", "max_tokens": 4, "messages": CHAT, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    raw = json.dumps(body, allow_nan=True)
    r = httpx.post(f"{server.url}/v1/messages", content=raw, headers={"content-type": "application/json"},
                   timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    error = r.json()
    assert set(error) == {"type", "error"} and error["type"] == "error", error
    assert set(error["error"]) == {"type", "message"} and error["error"]["type"] == "invalid_request_error"
    message = error["error"]["message"]
    assert "\n" not in message and len(message) < 400
    if named is not None:
        assert message.startswith(named), message


def test_other_errors_are_anthropics_shape_under_v1_messages_only(server):
    c = client(server)
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=CHAT)
    assert e.value.body["error"]["type"] == "not_found_error" and "tiny" in e.value.body["error"]["message"]
    r = httpx.get(f"{server.url}/v1/messages", timeout=TIMEOUT)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error" and r.json()["type"] == "error"
    r = httpx.post(f"{server.url}/v1/messages/batches", json={}, timeout=TIMEOUT)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": "x"}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"  # (OpenAI's, elsewhere)
    # a final assistant message is continued (Anthropic's prefill): the chat's continue_final_message
    prefill = [*CHAT, {"role": "assistant", "content": "Once"}]
    m = c.messages.create(model="tiny", max_tokens=4, messages=prefill, **GREEDY)
    chat = server.client().chat.completions.create(model="tiny", messages=prefill, max_tokens=4, temperature=0,
                                                   extra_body={"continue_final_message": True,
                                                               "add_generation_prompt": False})
    assert m.content[0].text == chat.choices[0].message.content


FULL = {"model": "tiny", "max_tokens": 2,
        "system": [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                     {"role": "assistant", "content": [
                         {"type": "thinking", "thinking": "hm", "signature": "x"}, {"type": "text", "text": "ok"},
                         {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": False,
                                                   "content": [{"type": "text", "text": "r"}]},
                                                  {"type": "text", "text": "go"}]}],
        "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": False}, "thinking": {"type": "disabled"},
        "metadata": {"user_id": "u"}, "stop_sequences": ["zz"], "temperature": 0, "top_p": 0.9, "top_k": 5}


def _places(value, at=()):
    """Every place in a JSON value, as its path of keys and indices."""
    yield at
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        yield from _places(inner, (*at, key))


def test_junk_anywhere_in_a_full_request_is_a_4xx_never_a_500(server, scripted):
    """Each place of a request using every field, its value replaced by a value of another shape (a list, an object
    whose type is a list): answered (where it is still a request) or a 4xx in Anthropic's shape, never a 500."""
    import copy

    scripted.text = "ok"
    with httpx.Client(timeout=TIMEOUT) as http:
        assert http.post(f"{server.url}/v1/messages", json=FULL).status_code == 200
        for at in list(_places(FULL))[1:]:
            for junk in ([[1]], {"type": ["x"]}):
                body = copy.deepcopy(FULL)
                inner = body
                for key in at[:-1]:
                    inner = inner[key]
                inner[at[-1]] = junk
                r = http.post(f"{server.url}/v1/messages", json=body)
                assert r.status_code in (200, 400, 404), (at, junk, r.text)
                assert r.status_code == 200 or set(r.json()) == {"type", "error"}, (at, junk, r.text)
