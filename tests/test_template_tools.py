"""Tool calling for a family that chats through its checkpoint's chat template (Qwen3-MoE): Qwen3's own template
(tests/data/qwen3_chat_template.json; its "note" says where it comes from) on the synthetic Qwen3 tokenizer with
Qwen's tool and thinking tags as added tokens. The prompt ids the server builds are transformers'
apply_chat_template(tools=...)'s; the answer's `<tool_call>` blocks become OpenAI tool_calls, whole and streamed
(serve/tool_calls.py TaggedCallSplitter); forced calls prefill the block; a template without tools, and tools or
calls spelling out a special token, are refused."""

from __future__ import annotations

import json
import os
import re

import pytest

from moepack.families import family_named
from moepack.families.qwen3_moe.synth import CHAT_TEMPLATE, SPECIAL_TOKENS
from moepack.families.synthetic import byte_level_tokenizer
from moepack.format_spec.reader import Container
from moepack.packer.convert import convert_checkpoint
from moepack.packer.synth import synth_checkpoint
from moepack.runtime.generate import Generator
from moepack.serve.app import make_app
from moepack.serve.chat_template import ChatTemplate, family_chat_template
from moepack.serve.tokenizer import PromptTokenizer, chat_prompt_ids
from moepack.serve.tool_calls import TaggedCallSplitter, ToolPlan, renders_tool_calls, split_answer
from test_serve import Running
from test_serve_clients import _bad, scripted_generator

transformers = pytest.importorskip("transformers")

FAMILY = family_named("qwen3-moe")
with open(os.path.join(os.path.dirname(__file__), "data", "qwen3_chat_template.json"), encoding="utf-8") as _f:
    QWEN3_TEMPLATE = json.load(_f)["chat_template"]
# Qwen3's added tokens that are not special (its tokenizer's 151657-151668 among them)
QWEN_MARKUP = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}}}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}}}}}
CHAT = [{"role": "user", "content": "Weather in Paris?"}]


def _call(call_id, name, arguments, separators=None):
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, separators=separators)}}


# (messages as an OpenAI client sends them, tools); transformers is given the calls' arguments as objects
CONVERSATIONS = [
    ([{"role": "system", "content": "Be brief."}, *CHAT], [WEATHER, SEARCH]),
    ([*CHAT, {"role": "assistant", "content": None,  # (compact JSON: the template writes the object's tojson)
              "tool_calls": [_call("c1", "get_weather", {"city": "Paris"}, separators=(",", ":"))]},
      {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21 C"}], [WEATHER]),
    ([{"role": "system", "content": "Be brief."}, *CHAT,
      {"role": "assistant", "content": "Let me look.", "tool_calls": [
          _call("c1", "get_weather", {"city": "Paris", "days": 3}),
          _call("c2", "search", {"query": "Paris \"rain\""})]},
      {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
      {"role": "tool", "tool_call_id": "c2", "content": "[]"},
      {"role": "assistant", "content": "Sunny for three days."}, {"role": "user", "content": "And Oslo?"}],
     [WEATHER, SEARCH]),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."}, *CHAT,
      {"role": "assistant", "content": "", "tool_calls": [_call("c9", "get_weather", {"city": "Paris"})]},
      {"role": "tool", "tool_call_id": "c9", "content": "Rain"}, {"role": "assistant", "content": "Rain."}], None),
]


def _transformers_messages(messages):
    """The conversation as vLLM hands it to transformers' template: text parts joined by newlines, no None content,
    a call's arguments as an object."""
    out = []
    for m in messages:
        content = m["content"]
        m = {**m, "content": "\n".join(p["text"] for p in content) if isinstance(content, list) else content or ""}
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


@pytest.fixture(scope="module")
def qwen3_tools(tmp_path_factory):
    """(checkpoint directory, container path): the synthetic tiny Qwen3-MoE (float32) with Qwen3's chat template and
    its tool and thinking tags as tokens."""
    base = tmp_path_factory.mktemp("template-tools")
    src = base / "src"
    synth_checkpoint(str(src), preset="tiny", layout="f32", seed=5, progress=False, family="qwen3-moe")
    (src / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer(SPECIAL_TOKENS, None, QWEN_MARKUP)))
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN3_TEMPLATE}))
    path = str(base / "q.moepack")
    convert_checkpoint(str(src), path, policy="keep", progress=False)
    return src, path


@pytest.fixture(scope="module")
def server(qwen3_tools):
    g = Generator(qwen3_tools[1], cache_gib=0.5)
    running = Running(make_app(g, "q", log=lambda line: None))
    running.generator, running.state, running.tok = g, running.app.state.server, PromptTokenizer(g.c)
    yield running
    running.stop()
    g.close()


def _want_ids(theirs, messages, tools, prefill="", **options):
    want = theirs.apply_chat_template(_transformers_messages(messages), tools=tools, tokenize=True,
                                      add_generation_prompt=True, **options)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    return want + (theirs.encode(prefill, add_special_tokens=False) if prefill else [])


def test_the_prompt_ids_with_tools_are_transformers(qwen3_tools):
    directory, path = qwen3_tools
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    with Container(path) as c:
        template, tok = family_chat_template(c, FAMILY), PromptTokenizer(c)
    for messages, tools in CONVERSATIONS:
        ids = chat_prompt_ids(FAMILY, lambda: tok, messages, template=lambda: template, tools=tools)
        assert ids == _want_ids(theirs, messages, tools)
    text = tok.decode(chat_prompt_ids(FAMILY, lambda: tok, *CONVERSATIONS[2][:1], template=lambda: template,
                                      tools=CONVERSATIONS[2][1]))
    assert "<tools>\n" + json.dumps(WEATHER) in text and '"arguments": {"city": "Paris", "days": 3}}' in text
    assert text.count("<tool_response>") == 2 and "<|im_start|>user\n<tool_response>\nSunny\n" in text


# (answer, content, calls as (name, arguments)) of a plain answer, calls with text before or after (or both), a
# broken block, a block cut short
ANSWERS = [
    ("Hello there.\n", "Hello there.\n", []),
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
     '<tool_call>\n{"name": "search", "arguments": {"query": "Eiffel \\"tower\\""}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": 'Eiffel "tower"'})]),
    ('<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>\nDone.',
     "Done.", [("search", {"query": "x"})]),
    ('Before it\n<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>\nafter it.\n',  # text on both sides
     "Before it\nafter it.\n", [("search", {})]),
    ('Hm.\n<tool_call>\n{"name": "search", "arguments": {"query": \n</tool_call> ok',
     'Hm.\n<tool_call>\n{"name": "search", "arguments": {"query": \n</tool_call> ok', []),
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>', []),
    ('Sure <tool_call>\n{"name": "sea', 'Sure <tool_call>\n{"name": "sea', []),
    # an argument that spells the closing tag (code, a prompt) is the call's; a quote left open: as before, its
    # first tag closes the block (content as written), the rest is split again
    ('<tool_call>\n{"name": "write", "arguments": {"text": "a \\"</tool_call>\\" tag </tool_call>"}}\n</tool_call>',
     "", [("write", {"text": 'a "</tool_call>" tag </tool_call>'})]),
    ('<tool_call>\n{"name": "a", "arguments": {"x": "open}}\n</tool_call>\n<tool_call>\n{"name": "search", '
     '"arguments": {}}\n</tool_call>', '<tool_call>\n{"name": "a", "arguments": {"x": "open}}\n</tool_call>',
     [("search", {})]),
]


def _split(pieces, prefill="", parallel=True, fed=None):
    """The events of the answer fed in `pieces` (those before the flush also in `fed`, where given)."""
    splitter = TaggedCallSplitter(prefill, parallel)
    events = [e for piece in pieces for e in splitter.feed(piece)]
    if fed is not None:
        fed += events
    return events + splitter.flush()


@pytest.mark.parametrize("answer, content, calls", ANSWERS)
def test_tool_call_blocks_split_whole_and_streamed(answer, content, calls):
    for pieces in ([answer], list(answer), [answer[i:i + 5] for i in range(0, len(answer), 5)]):
        fed: list = []
        events = _split(pieces, fed=fed)
        assert "".join(v for k, v in events if k == "content") == content
        got = [(v["function"]["name"], json.loads(v["function"]["arguments"])) for k, v in events if k == "tool_call"]
        assert got == calls
        # before the end, a stream never shows what may begin a tag
        assert not [v for k, v in fed if k == "content" and any(v.endswith("<tool_call>"[:n]) for n in range(1, 11))]
    plan = ToolPlan([WEATHER], True)
    text, whole = split_answer(answer, plan)
    assert text == (content or None if calls else content) and len(whole) == len(calls)


@pytest.mark.parametrize("thinking", [None, False, True])
@pytest.mark.parametrize("said", ["It is sunny", "It is sunny ", [{"type": "text", "text": "It is"}]])
def test_continue_final_message_is_transformers(qwen3_tools, thinking, said):
    """continue_final_message with a chat template: the prompt is transformers' apply_chat_template(
    continue_final_message=True) (rendered without a generation prompt, cut after the final text; a trailing space
    the template trims left out), after tools and tool results too."""
    directory, path = qwen3_tools
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    options = {} if thinking is None else {"enable_thinking": thinking}
    with Container(path) as c:
        template, tok = family_chat_template(c, FAMILY), PromptTokenizer(c)
    for messages, tools in CONVERSATIONS:
        messages = [*messages, {"role": "assistant", "content": said}]
        ids = chat_prompt_ids(FAMILY, lambda: tok, messages, thinking=thinking, template=lambda: template,
                              tools=tools, continue_final=True)
        want = theirs.apply_chat_template(_transformers_messages(messages), tools=tools, tokenize=True,
                                          add_generation_prompt=False, continue_final_message=True, **options)
        assert ids == list(want["input_ids"] if hasattr(want, "keys") else want)


@pytest.mark.parametrize("said", ["<", ">", "end", "|>"])
def test_continue_final_message_goes_on_from_the_final_text_not_the_markup_after_it(qwen3_tools, said):
    """A final text that the template's markup after it also spells (Qwen3's "<|im_end|>": a prefilled "<" or ">") is
    continued where the message has it: transformers' last occurrence in the whole rendering had made the prompt
    "<<" or closed the turn ("><|im_end|>"); continuing a KV (generate --continue-from), the final message stays
    open after the closed exchange too (it had been closed and a new assistant turn opened)."""
    directory, path = qwen3_tools
    with Container(path) as c:
        template, tok = family_chat_template(c, FAMILY), PromptTokenizer(c)
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": said}]
    reply = chat_prompt_ids(FAMILY, lambda: tok, messages[:1], thinking=False, template=lambda: template)
    ids = chat_prompt_ids(FAMILY, lambda: tok, messages, thinking=False, template=lambda: template,
                          continue_final=True)
    # (the reply's prompt without thinking ends with the empty thought the final message is rendered after)
    assert ids == reply + tok.encode(said, special_tokens=False, add_bos=False)
    end = tok.token_id("<|im_end|>")
    then = chat_prompt_ids(FAMILY, lambda: tok, messages, thinking=False, template=lambda: template,
                           continue_final=True, continuing=True, turn_end=end)
    assert tok.decode(then).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n" + said)


def test_a_tool_plans_markup_is_what_its_answer_is_split_at():
    """ToolPlan.markup (kept in the text by skip_special_tokens): a template's tags, a chat encoding's tool-call
    markup (DeepSeek-V4's every piece of it holding its special DSML token), nothing where calls are not parsed."""
    from moepack.serve.tool_calls import CALL_CLOSE, CALL_OPEN, tool_plan

    assert ToolPlan([WEATHER], True).markup() == (CALL_OPEN, CALL_CLOSE)
    assert ToolPlan([WEATHER], False).markup() == ()
    encoding = family_named("deepseek-v4").chat_encoding
    plan = tool_plan(encoding, [WEATHER], None, None, False)
    fmt = encoding.tool_format
    written = "".join(text for text, markup in fmt.tool_calls_parts([("get_weather", '{"city": "Paris"}')]) if markup)
    assert plan.markup() and all(fmt.DSML in m for m in plan.markup())
    assert all(m in written for m in plan.markup())


def test_a_long_argument_spelling_the_closing_tag_streams_in_linear_time():
    """A long argument (a file of code) that spells `</tool_call>` and goes on is read once, not again up to that
    tag at every piece: the stream's splitter runs on the event loop (40,000 characters, then 5,000 pieces: 8 s had
    gone to re-reading them)."""
    import time

    splitter = TaggedCallSplitter()
    start = time.monotonic()
    splitter.feed('<tool_call>\n{"name": "write", "arguments": {"code": "' + "x" * 40_000 + "</tool_call>")
    for _ in range(5_000):
        assert not splitter.feed('ab\\"')  # (an escaped quote: still inside the string)
    events = splitter.feed('"}}\n</tool_call>')
    assert time.monotonic() - start < 1.0
    assert [k for k, _ in events] == ["tool_call"]
    assert json.loads(events[0][1]["function"]["arguments"])["code"].startswith("x" * 40_000 + "</tool_call>")


def test_parallel_false_keeps_the_first_call_and_a_prefill_opens_the_block():
    answer = ANSWERS[1][0]
    assert [v["function"]["name"] for k, v in _split([answer], parallel=False) if k == "tool_call"] == ["get_weather"]
    named = '<tool_call>\n{"name": "search", "arguments": '
    events = _split(list('{"query": "y"}}\n</tool_call>'), prefill=named)
    assert [(k, v["function"]["name"], v["function"]["arguments"]) for k, v in events] == \
        [("tool_call", "search", '{"query": "y"}')]


def test_openai_client_gets_the_templates_tool_calls(qwen3_tools, server, monkeypatch):
    scripted = scripted_generator(server.generator, monkeypatch)
    scripted.text = ANSWERS[1][0]
    c = server.client()
    theirs = transformers.AutoTokenizer.from_pretrained(qwen3_tools[0])
    r = c.chat.completions.create(model="q", messages=CHAT, tools=[WEATHER, SEARCH])
    assert scripted.prompts[-1] == _want_ids(theirs, CHAT, [WEATHER, SEARCH])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls] == ANSWERS[1][2]
    assert all(t.id.startswith("call_") and t.type == "function" for t in choice.message.tool_calls)
    stream = c.chat.completions.create(model="q", messages=CHAT, tools=[WEATHER, SEARCH], stream=True)
    content, calls, finish = "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += [(t.index, t.function.name, json.loads(t.function.arguments)) for t in delta.tool_calls or []]
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me check." and finish == "tool_calls"
    assert calls == [(i, *call) for i, call in enumerate(ANSWERS[1][2])]
    # tool_choice none: no tools in the prompt, the blocks stay text
    r = c.chat.completions.create(model="q", messages=CHAT, tools=[WEATHER], tool_choice="none")
    assert scripted.prompts[-1] == _want_ids(theirs, CHAT, None)
    assert r.choices[0].message.content == ANSWERS[1][0] and not r.choices[0].message.tool_calls


def test_required_and_named_tool_choice_prefill_the_call(qwen3_tools, server, monkeypatch):
    scripted = scripted_generator(server.generator, monkeypatch)
    c = server.client()
    theirs = transformers.AutoTokenizer.from_pretrained(qwen3_tools[0])
    scripted.text = '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    r = c.chat.completions.create(model="q", messages=CHAT, tools=[WEATHER, SEARCH], tool_choice="required")
    # (a forced call follows the template's reply without a thought: Qwen3's `<think>\n\n</think>\n\n`)
    assert scripted.prompts[-1] == _want_ids(theirs, CHAT, [WEATHER, SEARCH], "<tool_call>\n", enable_thinking=False)
    assert server.tok.decode(scripted.prompts[-1]).endswith("assistant\n<think>\n\n</think>\n\n<tool_call>\n")
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls] == \
        [("get_weather", '{"city": "Oslo"}')]
    scripted.text = '{"query": "fjords"}}\n</tool_call>'
    named = {"type": "function", "function": {"name": "search"}}
    stream = c.chat.completions.create(model="q", messages=CHAT, tools=[WEATHER, SEARCH], tool_choice=named,
                                       stream=True)
    deltas = [t for chunk in stream for t in chunk.choices[0].delta.tool_calls or []]
    assert scripted.prompts[-1] == _want_ids(theirs, CHAT, [WEATHER, SEARCH],
                                             '<tool_call>\n{"name": "search", "arguments": ', enable_thinking=False)
    assert [(t.function.name, t.function.arguments) for t in deltas] == [("search", '{"query": "fjords"}')]


def test_thinking_is_the_templates_enable_thinking_however_a_client_says_it(qwen3_tools, server):
    """A request's thinking switch (`thinking`, DeepSeek's {"type": ...}, or vLLM's chat_template_kwargs
    enable_thinking) is the template's enable_thinking, as transformers renders it; unsaid, the template's default
    (Qwen3's: it thinks). Another chat_template_kwargs key, a value not a boolean, or two that disagree: a 400."""
    from moepack.serve.app import RequestError

    theirs = transformers.AutoTokenizer.from_pretrained(qwen3_tools[0])
    state = server.state
    for said, body in [(None, {}), (False, {"thinking": False}), (True, {"thinking": {"type": "enabled"}}),
                       (False, {"chat_template_kwargs": {"enable_thinking": False}}),
                       (True, {"chat_template_kwargs": {"thinking": True}, "thinking": True})]:
        ids = state.chat_ids({"messages": CHAT, **body})[0]
        assert ids == _want_ids(theirs, CHAT, None, **({} if said is None else {"enable_thinking": said})), body
    assert state.chat_ids({"messages": CHAT, "thinking": False})[0] != state.chat_ids({"messages": CHAT})[0]
    for body, words in [({"chat_template_kwargs": {"add_generation_prompt": False}},
                         "chat_template_kwargs.add_generation_prompt: not supported"),
                        ({"chat_template_kwargs": {"enable_thinking": "no"}}, "expected true or false"),
                        ({"chat_template_kwargs": [1]}, "chat_template_kwargs: expected an object"),
                        ({"chat_template_kwargs": {"enable_thinking": False}, "thinking": True}, "disagree")]:
        with pytest.raises(RequestError) as refused:
            state.chat_ids({"messages": CHAT, **body})
        assert refused.value.status == 400 and refused.value.param == "chat_template_kwargs"
        assert words in refused.value.message, refused.value.message


@pytest.mark.parametrize("body, said, refused", [
    ({"chat_template_kwargs": {"enable_thinking": None}}, None, None),  # null: unset, the template's default
    ({"chat_template_kwargs": {"enable_thinking": None}, "thinking": False}, False, None),
    ({"chat_template_kwargs": {"enable_thinking": True, "thinking": False}}, None,
     "chat_template_kwargs.thinking (false) and chat_template_kwargs.enable_thinking disagree"),
    ({"chat_template_kwargs": {"thinking": True}, "thinking": False}, None,
     "chat_template_kwargs.thinking (true) and thinking disagree")])
def test_the_thinking_switch_takes_null_as_unset_and_names_the_fields_that_disagree(body, said, refused):
    from moepack.serve.app import RequestError, _thinking_flag

    if refused is None:
        assert _thinking_flag(body) is said
        return
    with pytest.raises(RequestError, match=re.escape(refused)):
        _thinking_flag(body)


def test_a_forced_call_runs_on_the_model(server):
    """The real generator (the tiny random model) after a named call's prefill: the unfinished call, its opening
    with it, is the content, as written."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = server.client().chat.completions.create(model="q", messages=CHAT, tools=[WEATHER], max_tokens=2,
                                                temperature=0, tool_choice=named)
    choice = r.choices[0]
    assert choice.finish_reason in ("length", "stop") and not choice.message.tool_calls
    assert choice.message.content.startswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    assert r.usage.completion_tokens == 2


def test_tools_refused_where_the_template_has_none_or_they_spell_a_special_token(server, monkeypatch):
    c = server.client()
    bad_tool = {"type": "function", "function": {"name": "f", "description": "ends <|im_end|>"}}
    message = _bad(lambda: c.chat.completions.create(model="q", messages=CHAT, tools=[bad_tool]), "tools")
    assert message == ("tools: spells out the special token '<|im_end|>', which the chat template would render as "
                       "markup")
    calls = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": "<|im_start|>system"}'}}]}]
    assert _bad(lambda: c.chat.completions.create(model="q", messages=[*CHAT, *calls]), "messages").startswith(
        "messages[1].tool_calls: spells out the special token '<|im_start|>'")
    other = {"type": "function", "function": {"name": "nope"}}
    _bad(lambda: c.chat.completions.create(model="q", messages=CHAT, tools=[WEATHER], tool_choice=other),
         "tool_choice")
    _bad(lambda: c.chat.completions.create(model="q", messages=CHAT, tool_choice="required"), "tool_choice")
    monkeypatch.setattr(server.state, "_chat_template", ChatTemplate(CHAT_TEMPLATE, {}))  # ChatML: no tools
    for field, value in (("tools", [WEATHER]), ("tool_choice", "none")):
        message = _bad(lambda: c.chat.completions.create(model="q", messages=CHAT, **{field: value}), field)
        assert message == (f"{field}: the qwen3-moe model's chat template renders no tools (in the <tool_call> "
                           "format moepack parses)")
    assert c.chat.completions.create(model="q", messages=CHAT, max_tokens=1).choices[0].finish_reason



def test_only_a_template_writing_json_calls_takes_tools():
    """Qwen3's template writes a call as `<tool_call>` JSON; Qwen3-Coder's (a qwen3_moe model too) spells the same tag
    around XML parameters (`<function=NAME>`), which TaggedCallSplitter cannot read (every call would come back as
    content, a forced one prefilled in the wrong format): its tools are refused, as a template's without tools."""
    coder = ("{%- if tools %}{{- tools | tojson }}{%- endif %}{%- for m in messages %}{{- m.content }}"
             "{%- for c in m.tool_calls or [] %}{{- '<tool_call>\\n<function=' + c.function.name + '>\\n' }}"
             "{{- '</function>\\n</tool_call>' }}{%- endfor %}{%- endfor %}")
    assert renders_tool_calls(ChatTemplate(QWEN3_TEMPLATE, {}))
    assert not renders_tool_calls(ChatTemplate(coder, {}))
    assert not renders_tool_calls(ChatTemplate(CHAT_TEMPLATE, {}))


# Qwen3-Thinking's and QwQ's form of the template: its generation prompt opens the thought (the answer starts in it)
OPENING_TEMPLATE = QWEN3_TEMPLATE.replace("{{- '<|im_start|>assistant\\n' }}",
                                          "{{- '<|im_start|>assistant\\n<think>\\n' }}")

# (answer, reasoning_content, content, calls) where Qwen3's template lets the answer open a thought: a call thought of
# is not made, the one after the thought is; a thought cut short is all reasoning; an answer that opens none (what
# only may begin the opening, a tag later in the text) is content
THOUGHTS = [
    ('<think>\nI could call <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call> hmm\n</think>\n\n'
     '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>',
     '\nI could call <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call> hmm\n', None,
     [("search", {"query": "x"})]),
    ('\n<think>\nhm <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
     '\nhm <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', "", []),
    ("<think>Short.</think>Sunny.", "Short.", "Sunny.", []),
    ("<thi", None, "<thi", []),
    ("Sunny, <think>not one</think>.", None, "Sunny, <think>not one</think>.", []),
]


def _chat_both_ways(c, **request):
    """(reasoning_content, content, calls as (name, arguments)) of one chat request, whole and streamed."""
    message = c.chat.completions.create(model="q", messages=CHAT, **request).choices[0].message
    whole = (message.model_dump().get("reasoning_content"), message.content,
             [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls or []])
    reasoning, content, calls = [], "", []
    for chunk in c.chat.completions.create(model="q", messages=CHAT, stream=True, **request):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            reasoning += [delta.model_dump().get("reasoning_content") or ""]
            content += delta.content or ""
            calls += [(t.function.name, json.loads(t.function.arguments)) for t in delta.tool_calls or []]
    streamed = ("".join(reasoning) if any(reasoning) else None, content, calls)
    return whole, streamed


@pytest.mark.parametrize("answer, reasoning, content, calls", THOUGHTS)
def test_a_templates_thought_is_reasoning_content_and_its_calls_are_not_made(server, monkeypatch, answer,
                                                                              reasoning, content, calls):
    """Qwen3's template writes thoughts (it spells </think>) and its generation prompt leaves the answer to open one:
    an answer that opens with <think> has its thought split off as reasoning_content, whole and streamed (pieces of
    7 characters), before its tool calls are parsed; an answer that opens none is all content."""
    scripted = scripted_generator(server.generator, monkeypatch)
    scripted.text = answer
    whole, streamed = _chat_both_ways(server.client(), tools=[WEATHER, SEARCH])
    assert whole == (reasoning, content, calls)
    assert streamed == (reasoning, content or "", calls)


def test_where_the_generation_prompt_opens_the_thought_the_answer_starts_in_it(server, monkeypatch):
    """A template whose generation prompt ends inside a thought (Qwen3-Thinking's, QwQ's): the answer's text up to
    </think> is reasoning_content (all of it where </think> never comes); Qwen3's own leaves the thought to the
    answer, under every thinking switch; a template that never spells </think> (ChatML) has no thought to split."""
    assert ChatTemplate(OPENING_TEMPLATE, {}).opens_thought() is True
    assert [ChatTemplate(QWEN3_TEMPLATE, {}).opens_thought(t) for t in (None, True, False)] == [False] * 3
    assert ChatTemplate(CHAT_TEMPLATE, {}).opens_thought() is None
    scripted = scripted_generator(server.generator, monkeypatch)
    monkeypatch.setattr(server.state, "_chat_template", ChatTemplate(OPENING_TEMPLATE, {}))
    c = server.client()
    for answer, want in [("Let me see.\n</think>\n\nSunny.", ("Let me see.\n", "\n\nSunny.", [])),
                         ("Still thinking <think> about it", ("Still thinking <think> about it", "", []))]:
        scripted.text = answer
        whole, streamed = _chat_both_ways(c)
        assert server.tok.decode(scripted.prompts[-1]).endswith("<|im_start|>assistant\n<think>\n")
        assert whole == streamed == want
    monkeypatch.setattr(server.state, "_chat_template", ChatTemplate(CHAT_TEMPLATE, {}))
    scripted.text = "<think>x</think>y"
    assert _chat_both_ways(c) == ((None, "<think>x</think>y", []),) * 2


def test_json_output_waits_for_the_end_of_a_thought_the_prompt_opened(server, monkeypatch):
    """response_format's constraint: where the generation prompt opened the thought, any token until </think>;
    where the answer only may open one (Qwen3's own template), the JSON from the first token."""
    from test_serve_clients import _needs_llguidance

    _needs_llguidance()
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"enum": ["yes", "no"]}}}
    raw = json.dumps({"model": "q", "messages": CHAT, "response_format": fmt}).encode()
    n = server.state.vocab
    assert server.state.prepare(raw, chat=True).make_constraint().allowed(n) is not None
    monkeypatch.setattr(server.state, "_chat_template", ChatTemplate(OPENING_TEMPLATE, {}))
    constraint = server.state.prepare(raw, chat=True).make_constraint()
    for token in server.tok.encode("any text", special_tokens=False):
        assert constraint.allowed(n) is None
        constraint.accept(token)
    constraint.accept(server.tok.token_id("</think>"))
    assert constraint.allowed(n) is not None


def test_generate_json_splits_a_templates_thought_as_the_server_does(qwen3_tools, monkeypatch):
    """`generate --chat --json` on Qwen3's template: an answer that opens a thought has it as "reasoning_content"
    (ThinkSplitter's split, as the server's message); one that opens none is all "content"."""
    from click.testing import CliRunner

    import moepack.runtime.generate as generate_module
    from moepack.cli.main import cli
    from moepack.runtime.generate import GenerateResult

    for answer, reasoning, content in [("\n<think>\nhm\n</think>\n\nSunny.", "\nhm\n", "\n\nSunny."),
                                       ("Sunny.", None, "Sunny.")]:
        monkeypatch.setattr(generate_module, "generate", lambda *a, **k: GenerateResult([1], answer, "stop", {}))
        r = CliRunner().invoke(cli, ["generate", qwen3_tools[1], "--chat", "Weather?", "--json"])
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        assert (out["text"], out.get("reasoning_content"), out["content"]) == (answer, reasoning, content)


def test_tokenizer_info_carries_the_chat_template_a_remote_tokenizer_renders(server):
    """vLLM's GET /tokenizer_info gives the model's Jinja chat template (lm-eval's remote tokenizer renders chats
    with it: --apply_chat_template with local-completions), as the container carries it."""
    import httpx

    info = httpx.get(f"{server.url}/tokenizer_info", timeout=60).json()
    assert info["chat_template"] == QWEN3_TEMPLATE and info["tokenizer_class"]
