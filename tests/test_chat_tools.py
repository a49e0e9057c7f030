"""DeepSeek-V4's tool format (families/deepseek_v4/tools.py, families/deepseek_v4/chat.py) against the release's own
encoder: conversations with two tools, tool calls, tool results (out of call order) and response formats render string
for string as encoding_dsv4.py renders them, tokenize to the release tokenizer's ids with the content as plain text, and
the model's tool calls parse to what the release's parser gives (tests/data/dsv4_tools_reference.json; its "note"
says how it was recorded)."""

from __future__ import annotations

import json
import os

import pytest

from moepack.families.deepseek_v4.chat import encode_message_segments, encode_messages
from moepack.families.deepseek_v4.tools import ToolCallFormatError, parse_tool_calls, split_tool_calls
from test_chat_encoding import RELEASE_TOKENIZER, needs_release_tokenizer

DATA = os.path.join(os.path.dirname(__file__), "data")
with open(os.path.join(DATA, "dsv4_tools_reference.json"), encoding="utf-8") as _f:
    REFERENCE = json.load(_f)
CASES = {case["name"]: case for case in REFERENCE["cases"]}
OUTPUTS = {out["name"]: out for out in REFERENCE["outputs"]}


def _encode(case, **kw):
    options = dict(case["options"])
    return encode_messages(case["messages"], thinking=options.pop("thinking"), **options, **kw)


def test_the_reference_covers_tools():
    assert REFERENCE["encoder"]["sha256"] == "bdbd57c132a1b3725042323d02b98b9d1df28e5f388f134399555d041f5055e0"
    roles = {m["role"] for case in CASES.values() for m in case["messages"]}
    assert roles == {"system", "developer", "user", "assistant", "tool"}
    two_tools = CASES["two_tools_round_trip_chat"]["messages"]
    assert len(two_tools[0]["tools"]) == 2 and len(two_tools[2]["tool_calls"]) == 2


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_the_release_encoder(name):
    assert _encode(CASES[name]) == CASES[name]["expected"]


@needs_release_tokenizer
@pytest.mark.parametrize("name", sorted(CASES))
def test_tokenizes_as_the_release_with_content_plain(name):
    from moepack.serve.tokenizer import PromptTokenizer

    class Carrier:  # what PromptTokenizer reads of a container
        path = "release"
        with open(os.path.join(RELEASE_TOKENIZER, "tokenizer.json"), encoding="utf-8") as f:
            index = {"tokenizer": {"tokenizer.json": {"encoding": "utf-8", "data": f.read()}}}

    case = CASES[name]
    options = dict(case["options"])
    segments = encode_message_segments(case["messages"], thinking=options.pop("thinking"), **options)
    ids = PromptTokenizer(Carrier()).encode_segments(segments)
    if name == "special_text_in_tool_content_thinking":  # content spelling special tokens stays plain text here
        assert ids != case["token_ids"] and len(ids) > len(case["token_ids"])
    else:
        assert ids == case["token_ids"]


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_the_models_tool_calls_parse_as_the_release_parses_them(name):
    out = OUTPUTS[name]
    text = out["text"].removesuffix("<｜end▁of▁sentence｜>")  # the server's text stops before the eos
    if out["thinking"]:
        reasoning, _, text = text.partition("</think>")
        assert reasoning == out["parsed"]["reasoning_content"]
    content, calls = split_tool_calls(text)
    assert content == out["parsed"]["content"]
    assert [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls] == \
        out["parsed"]["tool_calls"]


def test_a_call_cut_short_keeps_the_complete_ones_and_bad_markup_is_refused():
    whole = OUTPUTS["two_calls_after_content"]["text"].removesuffix("<｜end▁of▁sentence｜>")
    cut = whole[:whole.index('<｜DSML｜invoke name="search"') + 10]
    assert [n for n, _ in split_tool_calls(cut)[1]] == ["get_weather"]
    with pytest.raises(ToolCallFormatError):
        parse_tool_calls('\n<｜DSML｜invoke name="f">\ngarbage\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    with pytest.raises(ToolCallFormatError):
        parse_tool_calls('\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="x" string="false">{oops'
                         '</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
    deep = "[" * 100_000 + "]" * 100_000  # (a RecursionError had escaped: a 500, or a stream's error event)
    with pytest.raises(ToolCallFormatError, match="is not JSON"):
        parse_tool_calls(f'\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="x" string="false">{deep}'
                         '</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
