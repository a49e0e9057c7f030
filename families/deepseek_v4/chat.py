"""DeepSeek-V4's prompt format: an OpenAI-style conversation as the exact string the model was trained on.

DeepSeek-V4 ships no chat template; its release carries a Python encoder instead (`encoding/encoding_dsv4.py` in
deepseek-ai/DeepSeek-V4-Flash and -Pro, the same file in both). This module renders the same strings for the text
part of that format, written from its documented behaviour and checked against its output
(tests/data/dsv4_chat_reference.json):

    <｜begin▁of▁sentence｜>[effort prefix][system]
    <｜User｜>question<｜Assistant｜></think>answer<｜end▁of▁sentence｜>   an earlier turn (chat, or reasoning dropped)
    <｜User｜>question<｜Assistant｜><think>                               the turn to generate, thinking mode

* Chat mode: `</think>` follows the assistant tag at once (an empty thought); thinking mode opens `<think>` on the
  turn to generate. With `drop_thinking` (the default, as the release) an earlier turn's `reasoning_content` is
  dropped and that turn is rendered as in chat mode; an assistant message after the last user message (a prefill
  being continued) keeps its reasoning, closed by `</think>`.
* A system message is its bare text; a developer message is rendered as a user turn (`<｜User｜>` + text) and, in
  thinking mode with drop_thinking, dropped altogether when an earlier turn's. Consecutive user messages are one
  turn, their texts joined by a blank line. Every assistant message ends with `<｜end▁of▁sentence｜>`.
* Special tokens: only this encoder's markup (BOS, the role tags, the thinking tags, EOS) is special. The
  encoder hands its prompt on as segments (`encode_message_segments`): markup, tokenized into its special tokens,
  and text (every message's content and reasoning, the effort prefix), tokenized as plain text, so a message that
  spells out `<｜end▁of▁sentence｜>` or `<｜User｜>` gets the ordinary tokens of that text and cannot forge a turn
  (serve/tokenizer.py `PromptTokenizer.encode_segments`). Joined, the segments are the release encoder's string.
* reasoning_effort: None, "high" or "max" (what the release's encoder accepts). Only "max" changes the prompt: in
  thinking mode a fixed instruction goes in front of the first message, right after BOS. "high" renders as None
  does. (DeepSeek's hosted API, and the later Flash-Vision-Exp encoder, use low/high/max with other texts; this
  is the open-weights V4-Flash/Pro encoder.)

* Tools (families/deepseek_v4/tools.py, the DSML format): a system or developer message's OpenAI `tools` (a `## Tools`
  section, one JSON schema a line) and `response_format` (`## Response Format:`), an assistant's `tool_calls` (its DSML
  block after the content), `tool` messages (merged with the user messages around them into one user turn of
  `<tool_result>` blocks, sorted by the order of the calls they answer). A conversation with tools keeps every
  turn's reasoning (drop_thinking is off), as the release does. Checked against the release's encoder in
  tests/test_chat_tools.py (tests/data/dsv4_tools_reference.json). The Jinja template renders no tools.

An assistant turn left open (`wo_eos`, as the release's encoder has it: no end of sentence after it) is the prompt
of that turn's continuation when it ends the conversation (the server's `continue_final_message`).

Left out (a message using them raises MoepackError rather than render something else): the quick-instruction
`task` tokens, the `latest_reminder` role, user content given as a list of parts, and the encoder's `context=`
continuation (`add_bos=False` covers rendering a conversation's tail without BOS).
"""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from typing import Any, Iterable, Mapping, NamedTuple

from moepack.format_spec.errors import MoepackError

from ..openai_tools import check_tools

# the encoding's tool-call format (DSML): the server parses answers by it (serve/tool_calls.py)
from . import tools as tool_format  # noqa: F401
from .tools import (DSML, RESPONSE_FORMAT_PREFIX, TOOL_RESULT_END, TOOL_RESULT_START, TOOLS_TEMPLATE_END,
                    check_tool_calls, to_json, tool_calls_parts, tool_schemas, tools_intro)

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END)
_MARKUP = (*SPECIAL_TOKENS, DSML)  # what a template's text spells as special tokens
_SPECIAL_SPLIT = re.compile("(" + "|".join(map(re.escape, _MARKUP)) + ")")

ROLES = ("system", "developer", "user", "assistant", "tool")
REASONING_EFFORTS = (None, "high", "max")

# In thinking mode with reasoning_effort="max", this instruction opens the prompt (right after BOS).
REASONING_EFFORT_MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

# Message fields of the release format this encoder does not render: refused, never silently dropped.
_UNSUPPORTED_FIELDS = {
    "task": "quick-instruction tasks",
}
_UNSUPPORTED_ROLES = ("latest_reminder",)
# fields the release renders only on some roles: elsewhere refused rather than dropped
_FIELD_ROLES = {"tools": ("system", "developer"), "response_format": ("system", "developer"),
                "tool_calls": ("assistant",), "reasoning_content": ("assistant",)}


class Segment(NamedTuple):
    """A piece of the prompt: `special` marks the encoder's own markup (its special tokens); any other text, message
    content above all, is tokenized as plain text, whatever special token's text it holds."""
    text: str
    special: bool


def encode_message_segments(messages: Iterable[Mapping[str, Any]], thinking: bool = False,
                            reasoning_effort: str | None = None, *, drop_thinking: bool = True,
                            add_bos: bool = True, reply: bool = False) -> list[Segment]:
    """The prompt of `encode_messages` as segments: markup and text alternate (adjacent texts joined, so the text
    between two markups is tokenized in one piece, as in the whole string; empty texts left out). `reply`: the
    prompt of a reply to generate, so the conversation must end with the turn the format opens a reply after (a
    user, developer or tool message) or with an assistant's left open (`wo_eos`: the reply goes on from it); ending
    with a system message (the model would go on with the system text) or an assistant's closed by its end of
    sentence is refused, naming that message."""
    turns = _sort_tool_results(_merge_user_turns(_checked(messages, reasoning_effort)))
    if reply and turns and turns[-1]["role"] not in ("user", "developer") and not turns[-1]["open"]:
        role = turns[-1]["role"]
        raise MoepackError(f"messages[{len(messages) - 1}]: the conversation ends with this {role} message, "
                           "which opens no reply (DeepSeek-V4's chat opens the assistant's turn after a user, "
                           "developer or tool message; an assistant's left open, wo_eos, is continued)")
    # as the release: a conversation with tools keeps every turn's reasoning
    drop_thinking = drop_thinking and not any(t["tools"] for t in turns)
    if thinking and drop_thinking:
        turns = _drop_earlier_thinking(turns)
    last_user = _last_user_index(turns)
    segments: list[Segment] = []

    def add(text: str, special: bool = False) -> None:
        if not text:
            return
        if not special and segments and not segments[-1].special:
            segments[-1] = Segment(segments[-1].text + text, False)
        else:
            segments.append(Segment(text, special))

    def markup(text: str) -> None:
        for piece in markup_segments(text):
            add(*piece)

    def system_extras(turn: dict) -> None:
        if turn["tools"]:
            add("\n\n")
            markup(tools_intro())
            add(tool_schemas(turn["tools"]))
            add(TOOLS_TEMPLATE_END)
        if turn["response_format"]:
            add("\n\n" + RESPONSE_FORMAT_PREFIX + to_json(turn["response_format"]))

    if add_bos:
        add(BOS, True)
    if thinking and reasoning_effort == "max" and turns:
        add(REASONING_EFFORT_MAX_PREFIX)
    for i, turn in enumerate(turns):
        role = turn["role"]
        if role == "system":
            add(turn["text"])
            system_extras(turn)
        elif role == "developer":
            add(USER, True)
            add(turn["text"])
            system_extras(turn)
        elif role == "user":
            add(USER, True)
            for j, (kind, text) in enumerate(turn["blocks"]):
                add("\n\n" if j else "")
                add(TOOL_RESULT_START + text + TOOL_RESULT_END if kind == "tool_result" else text)
        else:  # assistant
            if thinking and (not drop_thinking or i > last_user):
                add(turn["reasoning"] or "")
                add(THINK_END, True)
            add(turn["text"])
            if turn["tool_calls"]:
                for text, is_markup in tool_calls_parts([(name, args) for _, name, args in turn["tool_calls"]]):
                    markup(text) if is_markup else add(text)
            if not turn["open"]:
                add(EOS, True)
        followed_by_reply = i + 1 == len(turns) or turns[i + 1]["role"] == "assistant"
        if role in ("user", "developer") and followed_by_reply:
            opens_thought = thinking and (not drop_thinking or i >= last_user)
            add(ASSISTANT, True)
            add(THINK_START if opens_thought else THINK_END, True)
    return segments


def markup_segments(text: str) -> list[Segment]:
    """A template's text (the encoder's own, never a message's) as segments: the special tokens it spells are
    markup, the rest plain, as tokenizing the whole string would split it."""
    return [Segment(piece, piece in _MARKUP) for piece in _SPECIAL_SPLIT.split(text) if piece]


def encode_messages(messages: Iterable[Mapping[str, Any]], thinking: bool = False,
                    reasoning_effort: str | None = None, *, drop_thinking: bool = True, add_bos: bool = True) -> str:
    """The prompt DeepSeek-V4 expects for `messages` (dicts with `role` in system/developer/user/assistant/tool and
    a string `content`; an assistant's content may be None and it may carry `reasoning_content` and OpenAI
    `tool_calls`; a system or developer message may carry OpenAI `tools` and a `response_format`; a tool message
    a `tool_call_id`). A conversation ending in a user, tool or developer message ends with the assistant tag and
    `<think>` (thinking) or `</think>` (chat), ready for the reply; one ending in an assistant message ends with
    its end-of-sentence token. To tokenize it, take `encode_message_segments` (the string loses which special
    token's text is markup)."""
    segments = encode_message_segments(messages, thinking, reasoning_effort, drop_thinking=drop_thinking,
                                       add_bos=add_bos)
    return "".join(text for text, _ in segments)


def encode_chat(text: str, thinking: bool = False, reasoning_effort: str | None = None, *,
                system: str | None = None) -> str:
    """The prompt for one user turn (after an optional system message), ready for the assistant's reply."""
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": text})
    return encode_messages(messages, thinking=thinking, reasoning_effort=reasoning_effort)


def check_reasoning_effort(reasoning_effort: str | None, thinking: bool) -> None:
    """What the release's encoder knows (None, "high", "max"), and only where it changes something: "max" renders
    nothing in chat mode, so it is refused there ("high" is the default's name). OpenAI's low / medium / minimal
    are not the release's: refused with what it takes."""
    if reasoning_effort not in REASONING_EFFORTS:
        raise MoepackError(f"reasoning_effort: {reasoning_effort!r} is not one of 'high', 'max' (what DeepSeek-V4's "
                           "encoder knows; 'high' is the default)")
    if reasoning_effort == "max" and not thinking:
        raise MoepackError("reasoning_effort: 'max' changes the prompt only in thinking mode: turn thinking on")


def _text_of(content, where: str, joiner: str) -> str:
    """A message's content: a string, or OpenAI's list of text parts (joined by `joiner`)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return joiner.join(p["text"] for p in content)
    raise MoepackError(f"{where}: expected a string or a list of text parts")


def _checked(messages: Iterable[Mapping[str, Any]], reasoning_effort: str | None) -> list[dict]:
    """A turn per message ({role, text, reasoning, tools, response_format, tool_calls, tool_call_id}), or
    MoepackError naming the first bad message and field."""
    if reasoning_effort not in REASONING_EFFORTS:
        raise MoepackError(f"reasoning_effort: {reasoning_effort!r} is not one of None, 'high', 'max'")
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Iterable):
        raise MoepackError(f"messages: expected a list of {{role, content}} objects, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise MoepackError(f"messages[{i}]: expected an object with role and content, got {type(m).__name__}")
        role = m.get("role")
        if role in _UNSUPPORTED_ROLES:
            raise MoepackError(f"messages[{i}].role: {role!r} messages are not supported by moepack's DeepSeek-V4 "
                               "encoder")
        if role not in ROLES:
            raise MoepackError(f"messages[{i}].role: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        for field, what in _UNSUPPORTED_FIELDS.items():
            value = m.get(field)
            present = value is not None if field == "task" else bool(value)  # as the release tests each field
            if present:
                raise MoepackError(f"messages[{i}].{field}: {what} are not supported by moepack's DeepSeek-V4 encoder")
        for field, roles in _FIELD_ROLES.items():
            if m.get(field) and role not in roles:
                raise MoepackError(f"messages[{i}].{field}: only a {' or '.join(roles)} message carries {field}")
        content = m.get("content")
        if role == "tool":  # (a tool's parts as the release joins blocks: a blank line; another's as vLLM: a line)
            content = _text_of(content if content is not None else "", f"messages[{i}].content", "\n\n")
        elif isinstance(content, list):
            content = _text_of(content, f"messages[{i}].content", "\n")
        if content is None and role in ("system", "assistant"):
            content = ""  # as the release renders a missing system or assistant text
        if not isinstance(content, str):
            raise MoepackError(f"messages[{i}].content: expected a string, got {type(content).__name__}")
        if role == "developer" and not content:
            raise MoepackError(f"messages[{i}].content: a developer message needs non-empty content")
        reasoning = m.get("reasoning_content") if role == "assistant" else None
        if reasoning is not None and not isinstance(reasoning, str):
            raise MoepackError(f"messages[{i}].reasoning_content: expected a string, got {type(reasoning).__name__}")
        tools = check_tools(m["tools"], f"messages[{i}].tools") if m.get("tools") else None
        calls = check_tool_calls(m["tool_calls"], f"messages[{i}].tool_calls") if m.get("tool_calls") else None
        fmt = m.get("response_format") or None
        if fmt is not None and not isinstance(fmt, Mapping):
            raise MoepackError(f"messages[{i}].response_format: expected an object")
        call_id = m.get("tool_call_id") if role == "tool" else None
        out.append({"role": role, "text": content, "reasoning": reasoning, "tools": tools, "response_format": fmt,
                    "tool_calls": calls, "tool_call_id": call_id if isinstance(call_id, str) else "",
                    "open": role == "assistant" and bool(m.get("wo_eos"))})  # (truthy, as the release tests it)
    return out


def _merge_user_turns(turns: list[dict]) -> list[dict]:
    """Consecutive user and tool messages are one user turn of blocks (text, or a tool's result), rendered joined
    by a blank line (the release's merge_tool_messages)."""
    merged: list[dict] = []
    for turn in turns:
        if turn["role"] not in ("user", "tool"):
            merged.append(turn)
            continue
        block = ("tool_result", turn["text"], turn["tool_call_id"]) if turn["role"] == "tool" else \
            ("text", turn["text"], None)
        if merged and merged[-1]["role"] == "user":
            merged[-1]["raw_blocks"].append(block)
        else:
            merged.append({**turn, "role": "user", "raw_blocks": [block]})
    return merged


def _sort_tool_results(turns: list[dict]) -> list[dict]:
    """Each user turn's tool results in the order of the calls of the assistant turn before it (by call id; as
    the release, results with an unknown id sort as the first call's), its text blocks where they were."""
    order: dict[str, int] = {}
    for turn in turns:
        if turn["role"] == "assistant" and turn["tool_calls"]:
            order = {call_id: k for k, (call_id, _, _) in enumerate(turn["tool_calls"]) if call_id}
        if turn["role"] != "user":
            continue
        blocks = turn["raw_blocks"]
        results = [b for b in blocks if b[0] == "tool_result"]
        if len(results) > 1 and order:
            ranked = iter(sorted(results, key=lambda b: order.get(b[2], 0)))
            blocks = [next(ranked) if b[0] == "tool_result" else b for b in blocks]
        turn["blocks"] = [(kind, text) for kind, text, _ in blocks]
    return turns


def _last_user_index(turns: list[dict]) -> int:
    return max((i for i, t in enumerate(turns) if t["role"] in ("user", "developer")), default=-1)


def _drop_earlier_thinking(turns: list[dict]) -> list[dict]:
    """Before the last user turn: assistants lose their reasoning, developer messages go; the rest stays."""
    last_user = _last_user_index(turns)
    kept = []
    for i, turn in enumerate(turns):
        if i >= last_user or turn["role"] in ("system", "user"):
            kept.append(turn)
        elif turn["role"] == "assistant":
            kept.append({**turn, "reasoning": None})
    return kept


@lru_cache(maxsize=1)
def chat_template() -> str:
    """The same format as a Jinja chat template (families/deepseek_v4/chat_template.jinja), for engines that take one (a
    GGUF's `tokenizer.chat_template`). Its variables: messages, bos_token, add_generation_prompt, thinking (or
    enable_thinking), reasoning_effort, drop_thinking."""
    with open(os.path.join(os.path.dirname(__file__), "chat_template.jinja"), encoding="utf-8") as f:
        template = f.read()
    return template.replace("__REASONING_EFFORT_MAX_PREFIX__", json.dumps(REASONING_EFFORT_MAX_PREFIX))
