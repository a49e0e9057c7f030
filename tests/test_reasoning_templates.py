"""Real chat templates of reasoning and Qwen3-family models (tests/data/reasoning_chat_templates.json, each with a
note of its source; Qwen3's own from tests/data/qwen3_chat_template.json) on the synthetic Qwen3-MoE: the prompt ids
are transformers' apply_chat_template's for many conversations and every thinking switch, ChatTemplate.opens_thought
reads each generation prompt as it is, and the server splits each one's answers into reasoning_content, content and
tool_calls, whole and streamed."""

from __future__ import annotations

import itertools
import json
import os
import shutil

import pytest

from moepack.families.qwen3_moe.synth import SPECIAL_TOKENS
from moepack.families.synthetic import byte_level_tokenizer
from moepack.format_spec.reader import Container
from moepack.packer.convert import convert_checkpoint
from moepack.packer.synth import synth_checkpoint
from moepack.serve.chat_template import ChatTemplate, family_chat_template
from moepack.serve.tokenizer import PromptTokenizer, chat_prompt_ids
from test_serve_clients import _bad, scripted_generator
from test_template_tools import CHAT, FAMILY, QWEN3_TEMPLATE, QWEN_MARKUP, _chat_both_ways, _transformers_messages

transformers = pytest.importorskip("transformers")

with open(os.path.join(os.path.dirname(__file__), "data", "reasoning_chat_templates.json"), encoding="utf-8") as _f:
    TEMPLATES = {name: entry["chat_template"] for name, entry in json.load(_f)["templates"].items()}
TEMPLATES["qwen3"] = QWEN3_TEMPLATE
# DeepSeek-R1's markup (its tokenizer's special tokens), for the distilled Qwen's template
R1_SPECIAL = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>",
              "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
              "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")
# where each one's answer has its thought (ChatTemplate.opens_thought, the same under every thinking switch): its
# generation prompt opens it, the answer may open one (Qwen3's), or there is none (the template never spells </think>)
OPENS_THOUGHT = {"qwen3": False, "qwq-32b": True, "qwen3-thinking-2507": True, "qwen3-instruct-2507": False,
                 "qwen3-coder": None, "deepseek-r1-distill-qwen-32b": True}
TOOL_TEMPLATES = ("qwen3", "qwq-32b", "qwen3-thinking-2507", "qwen3-instruct-2507")  # <tool_call> JSON calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather ☀",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
QUESTION = {"role": "user", "content": "Weather in Zürich? 日本 🌧"}


def _call(call_id, city):
    return {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city}, ensure_ascii=False)}}


# (messages as an OpenAI client sends them, tools)
CONVERSATIONS = {
    "one user message": ([QUESTION], None),
    "system": ([{"role": "system", "content": "Be brief."}, QUESTION], None),
    "multi-turn": ([{"role": "system", "content": "Be brief."}, QUESTION, {"role": "assistant", "content": "Sunny."},
                    {"role": "user", "content": "And tomorrow?"}], None),
    "reasoning before the last question": ([QUESTION, {"role": "assistant", "content": "Sunny.",
                                                       "reasoning_content": "Let me think.\n"},
                                            {"role": "user", "content": "And tomorrow?"}], None),
    "reasoning last": ([QUESTION, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Hm."}], None),
    "a thought in the content": ([QUESTION, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nSunny."},
                                  {"role": "user", "content": "ok"}], None),
    "tools": ([{"role": "system", "content": "Be brief."}, QUESTION], [WEATHER]),
    "tools, no system": ([QUESTION], [WEATHER]),
    "a call and its result": ([QUESTION, {"role": "assistant", "content": None, "tool_calls": [_call("c1", "Zürich")]},
                               {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}], [WEATHER]),
    "calls with reasoning, then more": (
        [QUESTION, {"role": "assistant", "content": "Let me look.", "reasoning_content": "a tool",
                    "tool_calls": [_call("c1", "Paris"), _call("c2", "Oslo")]},
         {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
         {"role": "tool", "tool_call_id": "c2", "content": ""},
         {"role": "assistant", "content": "Mixed."}, {"role": "user", "content": "thanks"}], [WEATHER]),
    "text parts": ([{"role": "system", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
                    {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}],
                   None),
    "empty content": ([{"role": "user", "content": ""}, {"role": "assistant", "content": ""},
                       {"role": "user", "content": "x"}], None),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (checkpoint directory, container path): the synthetic tiny Qwen3-MoE with that template, made when
    first asked for; the tokenizer has Qwen's tool and thinking tags as tokens (DeepSeek-R1's markup for its
    template)."""
    base = tmp_path_factory.mktemp("reasoning-templates")
    synth_checkpoint(str(base / "weights"), preset="tiny", layout="f32", seed=5, progress=False, family="qwen3-moe")
    made = {}

    def checkpoint(name):
        if name not in made:
            src = base / name
            shutil.copytree(base / "weights", src)
            config = json.loads((src / "tokenizer_config.json").read_text())
            if name.startswith("deepseek-r1"):
                tokenizer = byte_level_tokenizer(SPECIAL_TOKENS + R1_SPECIAL, None, ("<think>", "</think>"))
                config = {**config, "bos_token": R1_SPECIAL[0], "eos_token": R1_SPECIAL[1]}
            else:
                tokenizer = byte_level_tokenizer(SPECIAL_TOKENS, None, QWEN_MARKUP)
            (src / "tokenizer.json").write_text(json.dumps(tokenizer))
            (src / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATES[name]}))
            convert_checkpoint(str(src), str(src) + ".moepack", policy="keep", progress=False)
            made[name] = str(src), str(src) + ".moepack"
        return made[name]
    return checkpoint


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_the_prompt_ids_are_transformers_and_the_thought_is_where_the_generation_prompt_says(checkpoints, name):
    directory, path = checkpoints(name)
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    with Container(path) as c:
        template, tok = family_chat_template(c, FAMILY), PromptTokenizer(c)
    for (what, (messages, tools)), thinking in itertools.product(CONVERSATIONS.items(), (None, True, False)):
        options = {} if thinking is None else {"enable_thinking": thinking}
        want = theirs.apply_chat_template(_transformers_messages(messages), tools=tools, tokenize=True,
                                          add_generation_prompt=True, **options)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        got = chat_prompt_ids(FAMILY, lambda: tok, messages, thinking=thinking, template=lambda: template,
                              tools=tools)
        assert got == want, (what, thinking)
        # the generation prompt, as transformers renders it, against what opens_thought learnt (the R1 distill's
        # writes none after a tool's result: nothing to compare)
        text = [theirs.apply_chat_template(_transformers_messages(messages), tools=tools, tokenize=False,
                                           add_generation_prompt=add, **options) for add in (False, True)]
        assert text[1].startswith(text[0])
        prompt = text[1][len(text[0]):]
        opened = "</think>" in template.source and prompt.rstrip().endswith("<think>")
        assert not prompt or template.opens_thought(thinking) is (opened if "</think>" in template.source else None)
    assert [template.opens_thought(t) for t in (None, True, False)] == [OPENS_THOUGHT[name]] * 3


@pytest.fixture(scope="module")
def qwen_server(checkpoints):
    """A server on the Qwen-tokenizer checkpoint; each test puts the template it tries in place."""
    from moepack.runtime.generate import Generator
    from moepack.serve.app import make_app
    from test_serve import Running

    g = Generator(checkpoints("qwen3")[1], cache_gib=0.5)
    running = Running(make_app(g, "q", log=lambda line: None))
    running.generator, running.state, running.tok = g, running.app.state.server, PromptTokenizer(g.c)
    yield running
    running.stop()
    g.close()


def _with_template(server, monkeypatch, name):
    monkeypatch.setattr(server.state, "_chat_template", ChatTemplate(TEMPLATES[name], {}))
    return scripted_generator(server.generator, monkeypatch)


THOUGHT_AND_CALL = ('I could call <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
                    '\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')


@pytest.mark.parametrize("name", ["qwq-32b", "qwen3-thinking-2507", "deepseek-r1-distill-qwen-32b"])
def test_where_the_generation_prompt_opens_the_thought_it_is_reasoning_content(qwen_server, monkeypatch, name):
    """QwQ's, Qwen3-Thinking's, the R1 distill's: the answer starts in its thought (up to </think> reasoning_content,
    all of it where </think> never comes), whole and streamed, for each of several choices; a call thought of is not
    made, the one after the thought is."""
    scripted = _with_template(qwen_server, monkeypatch, name)
    c = qwen_server.client()
    for answer, want in [("Let me see.\n</think>\n\nSunny.", ("Let me see.\n", "\n\nSunny.", [])),
                         ("Still thinking", ("Still thinking", "", []))]:
        scripted.text = answer
        whole, streamed = _chat_both_ways(c)
        assert whole == streamed == want
        assert qwen_server.tok.decode(scripted.prompts[-1]).endswith("<think>\n")
        stream = c.chat.completions.create(model="q", messages=CHAT, n=2, stream=True)
        parts = {0: ["", ""], 1: ["", ""]}
        for chunk in stream:
            for choice in chunk.choices:
                parts[choice.index][0] += choice.delta.model_dump().get("reasoning_content") or ""
                parts[choice.index][1] += choice.delta.content or ""
        assert list(parts.values()) == [list(want[:2])] * 2
    if name in TOOL_TEMPLATES:
        scripted.text = THOUGHT_AND_CALL
        whole, streamed = _chat_both_ways(c, tools=[WEATHER])
        reasoning = THOUGHT_AND_CALL.split("</think>")[0]
        assert whole == (reasoning, None, [("get_weather", {"city": "Oslo"})])
        assert streamed == (reasoning, "", [("get_weather", {"city": "Oslo"})])
    else:
        assert "renders no tools" in _bad(lambda: c.chat.completions.create(model="q", messages=CHAT,
                                                                            tools=[WEATHER]), "tools")


@pytest.mark.parametrize("name", ["qwen3-instruct-2507", "qwen3-coder"])
def test_a_template_whose_prompt_opens_no_thought_leaves_the_answer_content(qwen_server, monkeypatch, name):
    """Qwen3-Instruct-2507's (it spells </think> for a history reply's reasoning, its generation prompt opens none)
    and Qwen3-Coder's (no thoughts; its XML tool calls refused): an answer without a thought is all content."""
    scripted = _with_template(qwen_server, monkeypatch, name)
    c = qwen_server.client()
    scripted.text = "Sunny, <think>not one</think>."
    assert _chat_both_ways(c) == ((None, "Sunny, <think>not one</think>.", []),) * 2
    if name == "qwen3-coder":
        assert "renders no tools" in _bad(lambda: c.chat.completions.create(model="q", messages=CHAT,
                                                                            tools=[WEATHER]), "tools")
        return
    scripted.text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    whole, streamed = _chat_both_ways(c, tools=[WEATHER])
    assert whole[2] == streamed[2] == [("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("name", TOOL_TEMPLATES)
def test_a_forced_call_follows_a_closed_empty_thought_never_opens_inside_one(qwen_server, checkpoints, monkeypatch,
                                                                               name):
    """tool_choice required / named: the call's opening follows the reply's empty thought `<think>\\n\\n</think>\\n\\n`
    (Qwen3's enable_thinking false writes it; a template whose generation prompt opens the thought anyway, QwQ's and
    Qwen3-Thinking's, has it closed so), as the template renders a reply with that call and no reasoning where it
    writes one; the call is parsed. (It had opened inside the thought: `<think>\\n<tool_call>`.)"""
    scripted = _with_template(qwen_server, monkeypatch, name)
    scripted.text = '{"city": "Oslo"}}\n</tool_call>'
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = qwen_server.client().chat.completions.create(model="q", messages=[QUESTION], tools=[WEATHER],
                                                     tool_choice=named)
    assert [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls] == \
        [("get_weather", '{"city": "Oslo"}')]
    prompt = qwen_server.tok.decode(scripted.prompts[-1])
    opening = '<tool_call>\n{"name": "get_weather", "arguments": '
    thought = "" if name == "qwen3-instruct-2507" else "<think>\n\n</think>\n\n"
    assert prompt.endswith("<|im_start|>assistant\n" + thought + opening)
    # the template's own rendering of that reply (QwQ's writes no thought of a reply; Instruct's generation prompt
    # opens none, though it writes an empty one in a reply)
    if name in ("qwen3", "qwen3-thinking-2507"):
        theirs = transformers.AutoTokenizer.from_pretrained(checkpoints(name)[0])
        reply = {"role": "assistant", "content": "", "tool_calls": [_call("c1", "Oslo")]}
        rendered = theirs.apply_chat_template(_transformers_messages([QUESTION, reply]), tools=[WEATHER],
                                              tokenize=False, enable_thinking=False)
        assert rendered.startswith(prompt)


def test_a_template_that_wants_a_system_message_first_still_has_its_generation_prompt_read():
    """opens_thought learns the generation prompt from a probe conversation: where the template refuses a lone user
    message (it wants a system message first), from one with a system message (it had taken such a template's
    prompt for one that opens no thought: a thought it opened came back as content)."""
    wants_system = ("{%- if messages[0].role != 'system' %}{{- raise_exception('a system message first') }}"
                    "{%- endif %}")
    assert ChatTemplate(wants_system + TEMPLATES["qwq-32b"], {}).opens_thought() is True
    assert ChatTemplate(wants_system + QWEN3_TEMPLATE, {}).opens_thought(True) is False
    refuses_all = ChatTemplate("{{- raise_exception('no') }}</think>", {})
    assert refuses_all.opens_thought() is False
    assert not refuses_all._opens_thought  # (not kept: a probe cut short on a loaded machine is tried again)


@pytest.mark.parametrize("name", ["qwen3", "qwq-32b"])
def test_a_responses_answer_has_the_chats_thought_content_and_calls(qwen_server, monkeypatch, name):
    """/v1/responses (serve/responses.py) on a template's thoughts and `<tool_call>` calls: its reasoning item,
    message and function calls are the chat's reasoning_content, content and tool_calls, whole and streamed, where
    the answer opens the thought (Qwen3's) and where the generation prompt does (QwQ's)."""
    scripted = _with_template(qwen_server, monkeypatch, name)
    c = qwen_server.client()
    tools = [{"type": "function", **WEATHER["function"]}]  # (the Responses form)
    for answer in ("Let me see.\n</think>\n\nSunny.", THOUGHT_AND_CALL):
        scripted.text = ("<think>" if name == "qwen3" else "") + answer
        chat = c.chat.completions.create(model="q", messages=CHAT, tools=[WEATHER]).choices[0].message
        want = [("reasoning", chat.model_dump()["reasoning_content"]), *([("message", chat.content)] * bool(
            chat.content)), *[("function_call", call.function.arguments) for call in chat.tool_calls or []]]

        def items(output):
            return [(item.type, item.arguments if item.type == "function_call" else item.content[0].text)
                    for item in output]
        assert items(c.responses.create(model="q", input=CHAT, tools=tools).output) == want
        with c.responses.stream(model="q", input=CHAT, tools=tools) as stream:
            assert items(stream.get_final_response().output) == want
