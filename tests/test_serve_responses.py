"""POST /v1/responses (serve/responses.py), through the official `openai` client: the answer is the chat completions'
answer to the same conversation, whole and streamed (OpenAI's events, in order), with its reasoning item, function
calls and tool round trip, JSON text format, logprobs, max_output_tokens' incomplete status; a client leaving
mid-stream stops its generation; every field OpenAI has and moepack does not serve (stored responses above all) is
refused by name."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from moepack.runtime.generate import GenerateResult
from moepack.runtime.sampling import IncrementalDetokenizer, TokenLogprob
from test_serve_clients import (CHAT, EXPECTED_CALLS, SEARCH, TIMEOUT, TWO_CALLS, WEATHER, _bad,
                                _needs_llguidance, batched, scripted, server, tiny_path)

__all__ = ["batched", "scripted", "server", "tiny_path"]  # (the fixtures, test_serve_clients.py's)

TOOLS = [{"type": "function", **tool["function"]} for tool in (WEATHER, SEARCH)]  # the Responses form
STATS = {"prefill": {"seconds": 0.01}, "decode": {"seconds": 0.01}}


def _text_of(chat) -> str:
    return chat.choices[0].message.content


def script_tokens(server, monkeypatch, ids: list[int], delay: float = 0.0, fail_after: int | None = None) -> list:
    """The generator answers the token ids `ids` as Generator.generate would (each token to on_token, with a
    logprob of -(its place + 1) where logprobs are asked for, then its text, as the server's `detokenize` makes it,
    to on_text; max_new_tokens and the cancel check heeded, `delay` s a token); it raises after `fail_after` tokens.
    The prompts it got are returned, as they come."""
    prompts = []

    def generate(prompt, options, detokenize=None, on_text=None, cancelled=None, on_token=None, **kw):
        prompts.append(list(prompt))
        decode = detokenize or server.tok.decode
        pieces, out, logprobs = IncrementalDetokenizer(decode), [], []
        for token in ids[:options.max_new_tokens]:
            if cancelled is not None and cancelled():
                return GenerateResult(out, decode(out), "cancelled", STATS)
            if fail_after is not None and len(out) == fail_after:
                raise RuntimeError("the scripted generator fails")
            out.append(token)
            logprobs.append(TokenLogprob(token, -float(len(out)), ()) if options.logprobs is not None else None)
            if on_token is not None:
                on_token(token, logprobs[-1])
            piece = pieces.add(token)
            if piece and on_text is not None:
                on_text(piece)
            time.sleep(delay)
        return GenerateResult(out, decode(out), "length" if len(ids) > len(out) else "stop", STATS,
                              logprobs if options.logprobs is not None else None)

    monkeypatch.setattr(server.generator, "generate", generate)
    return prompts


CONVERSATIONS = [
    # (instructions, input, the chat messages they stand for)
    ("Be brief.", "Tell me a story", [{"role": "system", "content": "Be brief."}, *CHAT]),
    (None, [{"role": "user", "content": "Hi"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!",
                                                                  "annotations": []}]},
            {"role": "developer", "content": [{"type": "input_text", "text": "Answer in French."}]}, *CHAT],
     [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
      {"role": "developer", "content": "Answer in French."}, *CHAT]),
]


@pytest.mark.parametrize("instructions, given, messages", CONVERSATIONS)
def test_a_response_is_the_chat_answer_whole_and_streamed(server, instructions, given, messages):
    c = server.client()
    chat = c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert chat.choices[0].finish_reason == "length"  # (the tiny model writes on: cut short)
    kw = dict(model="tiny", instructions=instructions, input=given, max_output_tokens=12, temperature=0)
    r = c.responses.create(**kw)
    assert r.output_text == _text_of(chat) and r.id.startswith("resp_") and r.object == "response"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [(item.type, item.status) for item in r.output] == [("message", "incomplete")]
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    echoed = r.model_dump()
    assert (echoed["instructions"], echoed["max_output_tokens"], echoed["temperature"], echoed["store"],
            echoed["tools"], echoed["tool_choice"], echoed["model"]) == (instructions, 12, 0, False, [], "auto", "tiny")
    events = list(c.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == _text_of(chat)
    last = events[-1].response
    assert last.output_text == _text_of(chat) and last.usage == r.usage and last.id == events[0].response.id


def metric_samples(server) -> dict:
    """The server's /metrics: {(name, its labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_batched_it_is_the_chats_answer_too_and_counted_in_the_metrics(batched):
    """With --max-batch 4 the response runs on the batch scheduler as a chat does: the same text, whole and
    streamed; /metrics counts it under its endpoint, its tokens too."""
    c = batched.client()
    chat = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0)
    before = metric_samples(batched)
    r = c.responses.create(model="tiny", input="Tell me a story", max_output_tokens=8, temperature=0)
    streamed = list(c.responses.create(model="tiny", input="Tell me a story", max_output_tokens=8, temperature=0,
                                       stream=True))
    after = metric_samples(batched)
    assert r.output_text == streamed[-1].response.output_text == _text_of(chat)
    ok = ("moepack_requests_total", (("endpoint", "/v1/responses"), ("status", "200")))
    assert after.get(ok, 0) - before.get(ok, 0) == 2
    generated = ("moepack_generated_tokens_total", ())
    assert after[generated] - before[generated] == 2 * r.usage.output_tokens


def test_the_stream_helper_gives_the_final_response_with_its_reasoning_item(server, monkeypatch):
    tok = server.tok
    thought, answer = tok.encode("I think so.", False, False), tok.encode("Yes, it is.", False, False)
    ids = thought + tok.encode_special("</think>") + answer
    prompts = script_tokens(server, monkeypatch, ids)  # (then "stop", as at the end of sentence)
    c = server.client()
    with c.responses.stream(model="tiny", input="Is it?", extra_body={"thinking": True}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "Yes, it is."
    reasoning, message = final.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "I think so." and reasoning.summary == []
    assert final.usage.output_tokens_details.reasoning_tokens == len(thought) + 1  # (its `</think>` too)
    kinds = [(e.type, getattr(e, "output_index", None)) for e in events]
    assert kinds[:4] == [("response.created", None), ("response.in_progress", None),
                         ("response.output_item.added", 0), ("response.content_part.added", 0)]
    assert ("response.reasoning_text.done", 0) in kinds and kinds[-1] == ("response.completed", None)
    assert kinds.index(("response.output_item.done", 0)) < kinds.index(("response.output_item.added", 1))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "I think so."
    whole = c.responses.create(model="tiny", input="Is it?", extra_body={"thinking": True})
    assert [item.content[0].text for item in whole.output] == ["I think so.", "Yes, it is."]
    assert whole.usage == final.usage
    # the output text's logprobs are its own tokens', not the thought's (nor its `</think>`'s), whole and streamed
    kw = dict(model="tiny", input="Is it?", extra_body={"thinking": True}, include=["message.output_text.logprobs"])
    text_tokens = [(tok.decode([t]), -float(place)) for place, t in enumerate(ids, 1)][len(thought) + 1:]
    got = c.responses.create(**kw).output[1].content[0].logprobs
    assert [(e.token, e.logprob) for e in got] == text_tokens
    streamed = [e for event in c.responses.create(**kw, stream=True) if event.type == "response.output_text.delta"
                for e in event.logprobs]
    assert [(e.token, e.logprob) for e in streamed] == text_tokens
    whole_chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Is it?"}],
                                           extra_body={"thinking": True})
    chat = whole_chat.choices[0].message
    assert (chat.model_dump()["reasoning_content"], chat.content) == ("I think so.", "Yes, it is.")
    # the chat's usage counts the thought's tokens as the response's does, whole and streamed
    assert whole_chat.usage.completion_tokens_details.reasoning_tokens == len(thought) + 1
    last = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Is it?"}],
                                          extra_body={"thinking": True}, stream=True,
                                          stream_options={"include_usage": True}))[-1]
    assert last.usage.completion_tokens_details.reasoning_tokens == len(thought) + 1
    # the answer sent back, its reasoning item too (the assistant's reasoning_content, which DeepSeek-V4's encoder
    # drops in a conversation without tools): the chat's prompt
    again = [{"role": "user", "content": "Is it?"}, *final.output, {"role": "user", "content": "Sure?"}]
    c.responses.create(model="tiny", input=again, extra_body={"thinking": True})
    c.chat.completions.create(model="tiny", extra_body={"thinking": True}, messages=[
        {"role": "user", "content": "Is it?"},
        {"role": "assistant", "content": "Yes, it is.", "reasoning_content": "I think so."},
        {"role": "user", "content": "Sure?"}])
    assert prompts[-1] == prompts[-2]


def test_a_summary_asked_for_is_the_thought_and_the_encrypted_content_carries_it(server, monkeypatch):
    """reasoning.summary (auto, concise, detailed): the reasoning item's summary is the thought's text, streamed by
    OpenAI's summary events; every reasoning item's encrypted_content (include's "reasoning.encrypted_content"
    taken) is the thought, which a client that sends back only it and the summary (Codex) gives back."""
    tok = server.tok
    thought = "I think so, \u00e9videmment."
    script_tokens(server, monkeypatch, tok.encode(thought, False, False) + tok.encode_special("</think>")
                  + tok.encode("Yes.", False, False))
    c = server.client()
    kw = dict(model="tiny", input="Is it?", extra_body={"thinking": True}, include=["reasoning.encrypted_content"])
    plain = c.responses.create(**kw)
    assert plain.output[0].summary == [] and plain.reasoning.summary is None
    assert plain.output[0].encrypted_content.startswith("moepack-thought-v1:")
    whole = c.responses.create(**kw, reasoning={"summary": "auto"})
    item = whole.output[0]
    assert [s.text for s in item.summary] == [item.content[0].text] == [thought]
    assert whole.reasoning.summary == "auto" and item.encrypted_content == plain.output[0].encrypted_content
    with c.responses.stream(**kw, reasoning={"summary": "detailed"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta") == thought
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_summary_part.added") < kinds.index("response.reasoning_summary_text.done")
    assert kinds.index("response.reasoning_summary_part.done") < kinds.index("response.output_item.done")
    done = next(e for e in events if e.type == "response.output_item.done").item
    assert done.encrypted_content == item.encrypted_content and final.output[0].summary[0].text == thought
    # the encrypted_content alone gives the thought back: as the reasoning_text, as the summary
    from moepack.serve.responses import thought_of
    sent = item.model_dump()
    assert thought_of({**sent, "content": None, "summary": []}, "input[0]") == thought
    assert thought_of({**sent, "content": None, "encrypted_content": "gAAAAB-another-servers"}, "x") == thought
    assert thought_of({"type": "reasoning", "summary": [], "encrypted_content": "gAAAAB-opaque"}, "x") is None
    assert thought_of({**sent, "content": [{"type": "reasoning_text", "text": "Edited."}]}, "x") == "Edited."


def test_a_reasoning_item_begins_the_assistants_turn_its_calls_go_to():
    """Calls after a reasoning item are a turn of their own with its thought, not calls of an assistant message
    before the reasoning item."""
    from moepack.serve.responses import conversation

    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    said = {"role": "assistant", "content": "Done."}
    thought = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Now f."}]}
    messages, origins = conversation({"input": [{"role": "user", "content": "Go"}, said, thought, call]})
    assert [m.get("reasoning_content") for m in messages] == [None, None, "Now f."]
    assert "tool_calls" not in messages[1] and messages[2]["tool_calls"][0]["id"] == "c1"
    assert origins == ["input[0]", "input[1]", "input[3]"]
    messages, _ = conversation({"input": [{"role": "user", "content": "Go"}, said, call]})
    assert len(messages) == 2 and messages[1]["tool_calls"][0]["id"] == "c1"
    # a thought that another turn follows is no later assistant's
    result = {"type": "function_call_output", "call_id": "c1", "output": "ok"}
    for between in ({"role": "user", "content": "Stop"}, result):
        messages, _ = conversation({"input": [{"role": "user", "content": "Go"}, thought, between, said]})
        assert "reasoning_content" not in messages[-1]


def test_a_thought_sent_back_is_the_next_prompts_in_a_conversation_with_tools(server, scripted):
    """An agent's loop: the reasoning item before its function calls, sent back with their outputs (whole, or as
    Codex sends it: summary and encrypted_content, no content), is the assistant's reasoning_content, which
    DeepSeek-V4's encoder keeps where the conversation has tools: the prompt is the chat's with it."""
    scripted.text = "I should look it up.</think>" + TWO_CALLS
    c = server.client()
    user = {"role": "user", "content": "Weather?"}
    kw = dict(model="tiny", tools=TOOLS, extra_body={"thinking": True}, reasoning={"summary": "auto"})
    r = c.responses.create(input=[user], **kw)
    assert [item.type for item in r.output] == ["reasoning", "message", "function_call", "function_call"]
    calls = r.output[2:]
    results = [{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"} for call in calls]
    scripted.text = "It is sunny."
    c.responses.create(input=[user, *r.output, *results], **kw)
    asked = scripted.prompts[-1]
    codex = {**r.output[0].model_dump(), "content": None}
    c.responses.create(input=[user, codex, *r.output[1:], *results], **kw)
    assert scripted.prompts[-1] == asked
    chat_calls = [{"id": call.call_id, "type": "function", "function": {"name": call.name,
                                                                        "arguments": call.arguments}}
                  for call in calls]
    messages = [user, {"role": "assistant", "content": "Let me check.", "tool_calls": chat_calls,
                       "reasoning_content": "I should look it up."},
                *({"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"} for call in calls)]
    c.chat.completions.create(model="tiny", tools=[WEATHER, SEARCH], messages=messages, extra_body={"thinking": True})
    assert scripted.prompts[-1] == asked
    c.responses.create(input=[user, *r.output[1:], *results], **kw)  # (the thought left out: another prompt)
    assert scripted.prompts[-1] != asked
    # a reasoning item with no message after it: its calls an assistant turn of their own, the thought theirs
    c.responses.create(input=[user, r.output[0], *calls, *results], **kw)
    messages[1]["content"] = None
    c.chat.completions.create(model="tiny", tools=[WEATHER, SEARCH], messages=messages, extra_body={"thinking": True})
    assert scripted.prompts[-1] == scripted.prompts[-2]


def test_reasoning_tokens_count_a_left_out_special_token_in_the_thought(server, monkeypatch):
    """The thought's tokens are counted on the text the answer was written with: a special token in the thought,
    left out of the text (skip_special_tokens' default), is one of its tokens all the same."""
    tok = server.tok
    thought = tok.encode("I think so, at length.", False, False)
    bos = tok.encode_special("<｜begin▁of▁sentence｜>")
    ids = thought[:1] + bos + thought[1:] + tok.encode_special("</think>") + tok.encode("Yes.", False, False)
    script_tokens(server, monkeypatch, ids)
    r = server.client().responses.create(model="tiny", input="Is it?", extra_body={"thinking": True})
    assert (r.output[0].content[0].text, r.output_text) == ("I think so, at length.", "Yes.")
    assert r.usage.output_tokens_details.reasoning_tokens == len(thought) + 2  # (the BOS and `</think>`)


def test_function_calls_and_their_outputs_make_the_chats_tool_round_trip(server, scripted):
    scripted.text = TWO_CALLS
    c = server.client()
    user = {"role": "user", "content": "Weather?"}
    r = c.responses.create(model="tiny", input=[user], tools=TOOLS)
    assert [item.type for item in r.output] == ["message", "function_call", "function_call"]
    assert r.status == "completed" and r.output_text == "Let me check."
    calls = r.output[1:]
    assert [(call.name, json.loads(call.arguments)) for call in calls] == EXPECTED_CALLS
    assert all(call.call_id.startswith("call_") and call.id.startswith("fc_") for call in calls)
    asked = scripted.prompts[-1]
    c.chat.completions.create(model="tiny", messages=[user], tools=[WEATHER, SEARCH])
    assert scripted.prompts[-1] == asked  # the tools where the chat puts them
    # streamed: each call an item of its own, its arguments in one delta
    with c.responses.stream(model="tiny", input=[user], tools=TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [(e.name, json.loads(e.arguments)) for e in events
            if e.type == "response.function_call_arguments.done"] == EXPECTED_CALLS
    assert [item.type for item in final.output] == ["message", "function_call", "function_call"]
    # the calls' outputs sent back with the answer as the SDK gives it (or as its model_dump() writes each field of
    # the item's type, null where unset): the chat's conversation with tool results
    scripted.text = "It is sunny."
    results = [{"type": "function_call_output", "call_id": calls[1].call_id, "output": "nothing"},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny"}]
    again = c.responses.create(model="tiny", input=[user, *r.output, *results], tools=TOOLS)
    assert again.output_text == "It is sunny." and [item.type for item in again.output] == ["message"]
    asked = scripted.prompts[-1]
    c.responses.create(model="tiny", input=[user, *(item.model_dump() for item in r.output), *results], tools=TOOLS)
    assert scripted.prompts[-1] == asked
    chat_calls = [{"id": call.call_id, "type": "function", "function": {"name": call.name,
                                                                        "arguments": call.arguments}}
                  for call in calls]
    c.chat.completions.create(model="tiny", tools=[WEATHER, SEARCH], messages=[
        user, {"role": "assistant", "content": "Let me check.", "tool_calls": chat_calls},
        {"role": "tool", "tool_call_id": calls[1].call_id, "content": "nothing"},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "Sunny"}])
    assert scripted.prompts[-1] == asked
    # a named function: chat's tool_choice
    c.responses.create(model="tiny", input=[user], tools=TOOLS, tool_choice={"type": "function", "name": "search"})
    asked = scripted.prompts[-1]
    c.chat.completions.create(model="tiny", messages=[user], tools=[WEATHER, SEARCH],
                              tool_choice={"type": "function", "function": {"name": "search"}})
    assert scripted.prompts[-1] == asked


PET = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}}, "required": ["pet"],
       "additionalProperties": False}


def test_a_json_schema_text_format_is_the_chats_constraint(server):
    _needs_llguidance()
    import jsonschema

    c = server.client()
    fmt = {"type": "json_schema", "name": "pet", "schema": PET, "strict": True}
    r = c.responses.create(model="tiny", input="Tell me a story", max_output_tokens=16, temperature=0,
                           text={"format": fmt})
    chat = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=16, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}})
    assert r.status == "completed" and r.output_text == _text_of(chat)
    jsonschema.validate(json.loads(r.output_text), PET)
    assert r.text.format.type == "json_schema"
    # the SDK's parse(): a pydantic model's schema as the format, the answer read back into it
    from typing import Literal

    import pydantic

    class Pet(pydantic.BaseModel):
        pet: Literal["cat", "dog"]
    parsed = c.responses.parse(model="tiny", input="Tell me a story", max_output_tokens=16, temperature=0,
                               text_format=Pet)
    assert parsed.output_parsed == Pet.model_validate_json(parsed.output_text)
    obj = c.responses.create(model="tiny", input="Tell me a story", max_output_tokens=6, temperature=0,
                             text={"format": {"type": "json_object"}})
    assert obj.output_text.startswith("{") and obj.output_text == _text_of(c.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=6, temperature=0, response_format={"type": "json_object"}))


def test_output_text_logprobs_are_the_chats_whole_and_streamed(server):
    c = server.client()
    chat = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                     top_logprobs=2)
    expected = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
                for e in chat.choices[0].logprobs.content]
    kw = dict(model="tiny", input="Tell me a story", max_output_tokens=6, temperature=0, top_logprobs=2,
              include=["message.output_text.logprobs"])
    r = c.responses.create(**kw)
    got = r.output[0].content[0].logprobs
    assert [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in got] == expected
    streamed = [e for event in c.responses.create(**kw, stream=True) if event.type == "response.output_text.delta"
                for e in event.logprobs]
    assert [(e.token, e.logprob) for e in streamed] == [x[:2] for x in expected]
    assert c.responses.create(**{**kw, "include": None, "top_logprobs": None}).output[0].content[0].logprobs == []


def test_a_client_that_leaves_mid_stream_stops_its_generation(server, monkeypatch):
    script_tokens(server, monkeypatch, server.tok.encode("word " * 200, False, False), delay=0.05)
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=TIMEOUT,
                      json={"model": "tiny", "input": "Go on", "stream": True}) as first:
        rid = first.headers["x-request-id"]
        lines = first.iter_lines()
        assert next(lines) == "event: response.created"
    start = time.monotonic()  # (200 tokens at 0.05 s would take 10 s)
    while (rid, "cancelled") not in server.state.finished:
        assert time.monotonic() - start < 5, list(server.state.finished)
        time.sleep(0.05)


def test_a_response_past_its_deadline_is_incomplete_with_what_it_wrote(server, monkeypatch):
    """--request-timeout stops the generation at its next token: the response is incomplete (reason "timeout"),
    its message the text so far, whole and streamed (response.incomplete)."""
    import dataclasses

    monkeypatch.setattr(server.state, "limits", dataclasses.replace(server.state.limits, request_timeout_s=0.5))
    script_tokens(server, monkeypatch, server.tok.encode("word " * 100, False, False), delay=0.05)
    c = server.client()
    r = c.responses.create(model="tiny", input="Go on")
    assert (r.status, r.incomplete_details.reason, r.output[0].status) == ("incomplete", "timeout", "incomplete")
    assert r.output_text.startswith("word word") and 0 < r.usage.output_tokens < 100
    last = list(c.responses.create(model="tiny", input="Go on", stream=True))[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "timeout"
    assert last.response.output_text.startswith("word word")


def test_a_client_that_half_closes_reads_a_responses_error_event(server, monkeypatch):
    """A client that shuts down its sending side once its request is sent stops its generation as one gone; its
    stream ends with OpenAI's Responses `error` event (not chat's `data: {"error"...}` and [DONE]), never cut."""
    from test_serve_limits import _half_closed

    script_tokens(server, monkeypatch, server.tok.encode("word " * 200, False, False), delay=0.02)
    reply = _half_closed(server, "POST", "/v1/responses", {"input": "Hi", "stream": True})
    assert reply.startswith(b"HTTP/1.1 200") and b"event: response.created" in reply
    assert b'event: error\ndata: {"type": "error", "code": "client_gone"' in reply
    assert b"[DONE]" not in reply and reply.endswith(b"\r\n0\r\n\r\n")  # the chunked body ended, not cut


def test_a_failure_after_the_stream_began_is_a_response_failed_event(server, monkeypatch, caplog):
    """...and the server's log holds no "Future exception was never retrieved" traceback from asyncio (the wait
    for the stream's start had left the job's future unread once the stream began)."""
    import gc
    import logging

    script_tokens(server, monkeypatch, server.tok.encode("word " * 20, False, False), fail_after=3)
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        events = list(server.client().responses.create(model="tiny", input="Go on", stream=True))
        gc.collect()
        time.sleep(0.2)  # (the loop's thread reports a future's unread exception when it is collected)
        gc.collect()
    assert events[-1].type == "response.failed" and events[-1].response.status == "failed"
    assert events[-1].response.error.code == "internal_error"
    assert events[-2].type == "response.output_text.delta" and events[-1].response.output[0].content[0].text
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


REFUSED = [
    (dict(previous_response_id="resp_1"), "previous_response_id", "not stored"),
    (dict(extra_body={"conversation": "conv_1"}), "conversation", "not stored"),
    (dict(tools=[{"type": "web_search"}]), "tools", "web_search"),
    (dict(tool_choice={"type": "file_search"}), "tool_choice", "file_search"),
    (dict(include=["file_search_call.results"]), "include", "file_search_call.results"),
    (dict(background=True), "background", "background"),
    (dict(truncation="auto"), "truncation", "only \"disabled\""),
    (dict(reasoning={"effort": "high", "summary": "verbose"}), "reasoning.summary", "auto, concise, detailed"),
    (dict(input=[{"type": "reasoning", "summary": [], "encrypted_content": "moepack-thought-v1:%%"},
                 {"role": "user", "content": "Hi"}]), "input", "damaged"),
    (dict(input=[{"type": "reasoning", "summary": [{"type": "output_text", "text": "x"}]},
                 {"role": "user", "content": "Hi"}]), "input", "summary_text"),
    (dict(prompt={"id": "pmpt_1"}), "prompt", "templates"),
    (dict(top_logprobs=2), "top_logprobs", "include"),
    (dict(text={"format": {"type": "text"}, "verbosity": "low"}), "text.verbosity", "verbosity"),
    (dict(stream=True, stream_options={"include_obfuscation": True}), "stream_options", "obfuscation"),
    (dict(extra_body={"frobnicate": 1}), "frobnicate", "unknown field for /v1/responses"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input",
     "input[0].content[0]: a \"input_image\" part"),
    (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input", "not stored"),
    (dict(input=[{"type": ["message"], "role": "user"}]), "input", "input[0].type: [\"message\"] items"),
    (dict(input=[{"role": "user", "content": [{"type": {"text": 1}}]}]), "input", "input[0].content[0]: a {"),
    (dict(input=[{"role": "user", "content": "Hi"}, {"role": "narrator", "content": "Hi"}]), "input",
     "input[1].role"),
    # chat's own checks, named as the Responses request names the field
    (dict(input=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]), "input",
     "input[1]: the conversation ends with this assistant message"),
    (dict(max_output_tokens=10**7), "max_output_tokens", "max_output_tokens (10000000) exceed"),
    (dict(text={"format": {"type": "xml"}}), "text.format", "text.format.type: expected text"),
    (dict(reasoning={"effort": "low"}), "reasoning.effort", "reasoning.effort"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "name": "nope"}), "tool_choice", "'nope'"),
]


@pytest.mark.parametrize("kw, param, says", REFUSED, ids=[p + ":" + s[:24] for _, p, s in REFUSED])
def test_what_is_not_served_is_a_400_naming_the_field(server, kw, param, says):
    kw = {"input": "Hi", **kw}
    message = _bad(lambda: server.client().responses.create(model="tiny", max_output_tokens=kw.pop(
        "max_output_tokens", 4), **kw), param)
    assert says in message


def test_stored_responses_are_neither_kept_nor_pretended(server, scripted):
    scripted.text = "Fine."
    c = server.client()
    for store in (True, False, None):  # (OpenAI's default is true: taken, and answered false)
        assert c.responses.create(model="tiny", input="Hi", store=store).model_dump()["store"] is False
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.retrieve("resp_1_abc")
    assert e.value.body["code"] == "response_not_found" and "not stored" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        c.responses.delete("resp_1_abc")
    with pytest.raises(openai.NotFoundError):
        c.responses.cancel("resp_1_abc")
    metadata = {"task": "demo"}  # echoed, as OpenAI's
    r = c.responses.create(model="tiny", input="Hi", metadata=metadata, user="u", safety_identifier="s",
                           prompt_cache_key="k")
    assert r.metadata == metadata and (r.user, r.safety_identifier, r.prompt_cache_key) == ("u", "s", "k")
    _bad(lambda: c.responses.create(model="tiny", input="Hi", prompt_cache_key=7), "prompt_cache_key")
    _bad(lambda: c.responses.create(model="tiny", input="Hi", metadata={"k": 5}), "metadata")


def test_a_long_answers_items_keep_its_text_as_pieces(monkeypatch):
    """20,000 deltas of one message: its text is joined once, at its close (a str grown at each delta had been
    copied whole each time, on the event loop); a response object built while it is open (a failure mid-stream)
    has the text so far."""
    from moepack.serve import tool_calls
    from moepack.serve.responses import OutputItems

    joins = []
    text = tool_calls.Pieces.text
    monkeypatch.setattr(tool_calls.Pieces, "text", lambda self: joins.append(len(self.parts)) or text(self))
    items = OutputItems()
    items.add([("reasoning_content", "hm")])
    for _ in range(20_000):
        items.add([("content", "ab")])
    assert [n for n in joins if n > 1] == []  # (the reasoning item's one piece: nothing to join)
    assert items.output()[-1]["content"][0]["text"] == "ab" * 20_000
    items.add([("content", "c")])
    done = items.end("completed")
    assert done[0]["type"] == "response.output_text.done" and done[0]["text"] == "ab" * 20_000 + "c"
    assert [n for n in joins if n > 1] == [20_000, 2]  # (once while open, asked; once at its close)
    assert [i["content"][0]["text"] for i in items.output()] == ["hm", "ab" * 20_000 + "c"]
