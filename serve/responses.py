"""POST /v1/responses: OpenAI's Responses API (openai-python's `client.responses.create` / `.stream`, the Agents SDK,
Codex-style clients) as a translation over the chat completions path of serve/app.py.

A request is put as the chat request it stands for (chat_request: `instructions` a system message in front, the
input items messages, a function_call item an assistant's tool call, a function_call_output item a tool message; the
function tools, tool_choice, text.format, reasoning.effort, include's logprobs as chat's fields; a reasoning item
sent back the `reasoning_content` of the assistant's turn after it) and prepared, scheduled, cancelled and counted
as a chat's (Server.prepared_chat, the app's admitted_request, job_events...); a chat error names the Responses
field it came from (`messages[2]` -> `input[1]`, `max_tokens` -> `max_output_tokens`). The answer is split as a
chat's (AnswerSplitter: thought, content, tool calls) into output items (OutputItems): a "reasoning" item (the
thought as a reasoning_text part, as its summary where one is asked for, and as its encrypted_content, which moepack
does not encrypt: the thought's own text, base64, so that a client that sends back only that, as Codex does with
store false, gives the thought back), a "message" item with one output_text part, a "function_call" item per call;
streamed, the events that build them, each with its sequence_number. Nothing is stored: `store` is taken (OpenAI's
default is true) and answered false, `previous_response_id` and `conversation` are 400s, GET / DELETE
/v1/responses/{id} 404s, all saying so. docs/guide.md "Serving real clients" lists the fields served and refused.
"""

from __future__ import annotations

import base64
import binascii
import copy
import dataclasses
import functools
import itertools
import json
import re
import time
import uuid
from collections.abc import Callable

from moepack.format_spec.untrusted import int_in_range
from moepack.runtime.sampling import MAX_TOP_LOGPROBS

from .openai_api import (IDENTIFIER_FIELDS, PLAIN_VALUES, REFUSED_FIELDS, Prepared, RequestError, _get, _value,
                         cached_tokens, chat_logprobs, check_fields, client_gone)
from .reasoning import AnswerSplitter, thought_tokens
from .tool_calls import Pieces
from .translation import _known_keys, _object, _refused, _text, each_tool, renamed, whole_answer

NOT_STORED = "responses are not stored by moepack serve (store is taken, nothing is kept)"
# the chat extensions (moepack's, vLLM's) a Responses request may carry too, passed on to the chat as they are
CHAT_EXTENSIONS = ("top_k", "min_p", "repetition_penalty", "seed", "thinking", "chat_template_kwargs")
RESPONSES_FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
                    "stream_options", "tools", "tool_choice", "parallel_tool_calls", "text", "reasoning", "include",
                    "top_logprobs", "metadata", *IDENTIFIER_FIELDS, "store", "service_tier", "background", "truncation",
                    *CHAT_EXTENSIONS}
# OpenAI's Responses fields moepack does not act on: a 400 naming the field whenever one is given (not null)
RESPONSES_REFUSED = {
    "previous_response_id": f"{NOT_STORED}: send the whole conversation as input",
    "conversation": "conversations are not stored by moepack serve: send the whole conversation as input",
    "prompt": "stored prompt templates are not supported: send the prompt as instructions and input",
    "max_tool_calls": "max_tool_calls counts built-in tool calls, which are not served (function tools only)",
    "context_management": "context management (compaction) is not supported",
    "prompt_cache_retention": "prompt_cache_retention is not supported",
    "prompt_cache_options": "prompt_cache_options is not supported",
    "background_options": "background responses are not supported",
    "moderation": "moderation is not supported",
    "image": "image generation is not supported (moepack serves a text model)",
    "access_programs": "access_programs is not supported",
}
RESPONSES_PLAIN = {
    "service_tier": PLAIN_VALUES["service_tier"],
    "background": ((None, False), f"background responses are not supported ({NOT_STORED}: none to poll)"),
    "truncation": ((None, "disabled"), 'only "disabled" is served (a conversation over the context is a 400, never '
                                       "cut short)"),
}
# chat's params and names in a chat error, as the Responses request names them (the longer first)
CHAT_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
               "reasoning_effort": "reasoning.effort"}
CHAT_NAMES = tuple((rf"\b{re.escape(chat)}\b", name) for chat, name in (
    ("max_tokens", "max_output_tokens"), ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"), ("reasoning_effort", "reasoning.effort")))
LOGPROBS_INCLUDE = "message.output_text.logprobs"
ENCRYPTED_INCLUDE = "reasoning.encrypted_content"  # (always written: OpenAI's is now written by default too)
SUMMARIES = ("auto", "concise", "detailed")
THOUGHT_PREFIX = "moepack-thought-v1:"  # a reasoning item's encrypted_content: this, then the thought's text, base64
# the keys of each input item type (those of the output items a client sends back as it got them included; an
# item's id and status say nothing to the model and are not read, nor an output_text's annotations, logprobs and
# `parsed`, the SDK's reading of the text that responses.parse() answers carry, as chat takes a message's)
ITEM_KEYS = {"message": {"type", "role", "content", "id", "status", "phase"},
             "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
             "function_call_output": {"type", "call_id", "output", "id", "status"},
             "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"}}
PART_KEYS = {"input_text": {"type", "text"}, "output_text": {"type", "text", "annotations", "logprobs", "parsed"}}
REASONING_PARTS = {"content": "reasoning_text", "summary": "summary_text"}  # a reasoning item's lists, their parts
ROLES = ("user", "system", "developer", "assistant")
MAX_METADATA = 16  # OpenAI's: 16 pairs, keys of 64 characters, values of 512


def _parts(content, where: str, param: str) -> str | list[dict]:
    """A message's content: a string, or its text parts as chat's ({"type": "text", "text"}); another part type
    (an image, a file, audio) is a 400 naming it: moepack serves a text model."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refused(f"{where}: expected a string or a list of input_text parts", param, "invalid_type")
    parts = []
    for j, part in enumerate(content):
        kind = _object(part, f"{where}[{j}]", param).get("type")
        if not isinstance(kind, str) or kind not in PART_KEYS:
            raise _refused(f"{where}[{j}]: a {json.dumps(kind)[:40]} part: moepack serves a text model (input_text "
                           "and output_text parts only)", param, "unsupported_value")
        _known_keys(part, PART_KEYS[kind], f"{where}[{j}]", param)
        parts.append({"type": "text", "text": _text(part.get("text"), f"{where}[{j}].text", param)})
    return parts


def conversation(body: dict) -> tuple[list[dict], list[str]]:
    """The chat messages of `instructions` and `input`, and where in the request each came from ("instructions",
    "input[3]"): a function_call item is a tool call of the assistant message before it (one of its own where
    none is, or where a reasoning item came between), a function_call_output a tool message, a reasoning item's
    thought (thought_of) the `reasoning_content` of the assistant message that follows it (a chat's encoder renders
    it where its model's template does: DeepSeek-V4's in a conversation with tools, an agent's loop; one that
    another message follows is dropped)."""
    messages, origins, thought = [], [], None
    instructions = _get(body, "instructions", lambda v: isinstance(v, str), "a string")
    if instructions:
        messages.append({"role": "system", "content": instructions})
        origins.append("instructions")
    given = body.get("input")
    if isinstance(given, str):
        return messages + [{"role": "user", "content": given}], origins + ["input"]
    if not isinstance(given, list) or not given:
        raise _refused("input: expected a string or a non-empty list of input items", "input", "invalid_type")
    for i, item in enumerate(given):
        where = f"input[{i}]"
        kind = _object(item, where, "input").get("type", "message" if "role" in item else None)
        if kind == "item_reference":
            raise _refused(f"{where}: an item_reference: {NOT_STORED}: send the item itself", "input",
                           "unsupported_value")
        if not isinstance(kind, str) or kind not in ITEM_KEYS:
            raise _refused(f"{where}.type: {json.dumps(kind)[:40]} items are not served (message, function_call, "
                           "function_call_output and reasoning are)", "input", "unsupported_value")
        _known_keys(item, ITEM_KEYS[kind], where, "input")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise _refused(f"{where}.role: expected one of {', '.join(ROLES)}, got {json.dumps(role)[:40]}",
                               "input")
            messages.append({"role": role, "content": _parts(item.get("content"), f"{where}.content", "input")})
            origins.append(where)
            if role == "assistant" and thought is not None:
                messages[-1]["reasoning_content"] = thought
            thought = None  # (one another turn came after: no assistant's)
        elif kind == "reasoning":
            own = thought_of(item, where)
            if own is not None:
                thought = own if thought is None else thought + own
        elif kind == "function_call":
            call = {"id": _text(item.get("call_id"), f"{where}.call_id", "input"), "type": "function",
                    "function": {"name": _text(item.get("name"), f"{where}.name", "input"),
                                 "arguments": _text(item.get("arguments"), f"{where}.arguments", "input")}}
            if messages and messages[-1]["role"] == "assistant" and thought is None:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call],
                                 **({} if thought is None else {"reasoning_content": thought})})
                origins.append(where)
                thought = None
        elif kind == "function_call_output":
            output = _parts(item.get("output"), f"{where}.output", "input")
            messages.append({"role": "tool", "tool_call_id": _text(item.get("call_id"), f"{where}.call_id", "input"),
                             "content": output})
            origins.append(where)
            thought = None
    return messages, origins


def sealed_thought(text: str) -> str:
    """A reasoning item's encrypted_content: the thought's text, base64 (not encrypted: the client's own answer)."""
    return THOUGHT_PREFIX + base64.urlsafe_b64encode(text.encode()).decode("ascii")


def thought_of(item: dict, where: str) -> str | None:
    """A reasoning item's thought: its reasoning_text parts' text; else its encrypted_content where moepack wrote it
    (another server's is opaque: none); else its summary_text parts' text; None where it has none."""
    texts = {}
    for key, part_type in REASONING_PARTS.items():
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise _refused(f"{where}.{key}: expected a list of {part_type} parts", "input", "invalid_type")
        for j, part in enumerate(parts):
            if _object(part, f"{where}.{key}[{j}]", "input").get("type") != part_type:
                raise _refused(f"{where}.{key}[{j}].type: expected {part_type!r}", "input")
            _known_keys(part, {"type", "text"}, f"{where}.{key}[{j}]", "input")
        texts[key] = "".join(_text(part.get("text"), f"{where}.{key}[{j}].text", "input")
                             for j, part in enumerate(parts))
    sealed = item.get("encrypted_content")
    if sealed is not None and not isinstance(sealed, str):
        raise _refused(f"{where}.encrypted_content: expected a string", "input", "invalid_type")
    if texts["content"]:
        return texts["content"]
    if sealed and sealed.startswith(THOUGHT_PREFIX):
        try:
            return base64.b64decode(sealed[len(THOUGHT_PREFIX):].encode("ascii"), b"-_", validate=True).decode()
        except (binascii.Error, UnicodeError, ValueError):
            raise _refused(f"{where}.encrypted_content: damaged (not the base64 of a UTF-8 text moepack wrote): "
                           "send it back as it came", "input") from None
    return texts["summary"] or None


def function_tools(tools) -> list[dict] | None:
    """The Responses function tools ({"type": "function", "name", "description", "parameters", "strict"}) as chat's;
    another tool type (web_search, file_search, mcp, ...) is a 400 naming it: moepack runs no tools of its own."""
    out = []
    for where, tool, kind in each_tool(tools):
        if kind != "function":
            raise _refused(f"{where}.type: {json.dumps(kind)[:40]} tools are not served (function tools only: "
                           "moepack runs no tools of its own)", "tools", "unsupported_value")
        _known_keys(tool, {"type", "name", "description", "parameters", "strict"}, where, "tools")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out or None  # (an empty list, as the Agents SDK sends it: no tools)


def chat_tool_choice(choice):
    """tool_choice as chat's: "none" / "auto" / "required", or {"type": "function", "name"} for one function."""
    if choice is None or isinstance(choice, str):
        return choice
    kind = _object(choice, "tool_choice", "tool_choice").get("type")
    if kind != "function":
        raise _refused(f"tool_choice.type: {json.dumps(kind)[:40]} is not served (function tools only)",
                       "tool_choice", "unsupported_value")
    _known_keys(choice, {"type", "name"}, "tool_choice", "tool_choice")
    return {"type": "function", "function": {"name": _text(choice.get("name"), "tool_choice.name", "tool_choice")}}


def response_format(text) -> dict | None:
    """text.format as chat's response_format (json_schema's name, schema, description and strict under
    `json_schema`); text.verbosity is refused as chat's verbosity is."""
    if text is None:
        return None
    _known_keys(_object(text, "text", "text"), {"format", "verbosity"}, "text", "text")
    if text.get("verbosity") is not None:
        raise _refused(f"text.verbosity: {REFUSED_FIELDS['verbosity']}", "text.verbosity", "unsupported_field")
    fmt = text.get("format")
    if fmt is None:
        return None
    if _object(fmt, "text.format", "text.format").get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return fmt  # (text, json_object; another type or key is chat's 400, named text.format)


def reasoning_settings(reasoning) -> tuple[str | None, str | None]:
    """reasoning.effort (chat's reasoning_effort) and the summary asked for (summary, or its older name
    generate_summary: "auto", "concise", "detailed"; None: none). moepack writes no shorter summary: one asked for
    is the thought's whole text, the detail "auto" leaves to the server (Codex shows a thought through it)."""
    if reasoning is None:
        return None, None
    _known_keys(_object(reasoning, "reasoning", "reasoning"), {"effort", "summary", "generate_summary"},
                "reasoning", "reasoning")
    summary = reasoning.get("summary")
    for key in ("summary", "generate_summary"):
        value = reasoning.get(key)
        if value is not None and value not in SUMMARIES:
            raise _refused(f"reasoning.{key}: expected one of {', '.join(SUMMARIES)}, got {json.dumps(value)[:40]}",
                           f"reasoning.{key}")
        summary = summary or value
    return reasoning.get("effort"), summary


def wants_logprobs(body: dict) -> bool:
    """include's "message.output_text.logprobs"; "reasoning.encrypted_content" is taken (a reasoning item always
    carries it); another is a 400 naming it."""
    include = _get(body, "include", lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
                   "a list of strings", [])
    for name in include:
        if name not in (LOGPROBS_INCLUDE, ENCRYPTED_INCLUDE):
            raise _refused(f"include: {name[:60]!r} is not served (only {LOGPROBS_INCLUDE} and {ENCRYPTED_INCLUDE}; "
                           f"{NOT_STORED})", "include", "unsupported_value")
    return LOGPROBS_INCLUDE in include


def check_metadata(body: dict) -> dict:
    """metadata, echoed in the response: at most 16 pairs of strings (keys of 64 characters, values of 512)."""
    metadata = _get(body, "metadata", lambda v: isinstance(v, dict), "an object", {})
    if len(metadata) > MAX_METADATA or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str)
                                               and len(v) <= 512 for k, v in metadata.items()):
        raise _refused(f"metadata: expected at most {MAX_METADATA} pairs of strings (keys of at most 64 characters, "
                       "values of 512)", "metadata")
    return metadata


def chat_request(body: dict) -> tuple[dict, list[str], bool, str | None]:
    """The chat completions body a Responses request stands for, where each chat message came from
    (conversation), whether the output text's logprobs are asked for and the reasoning summary asked for."""
    chat = {name: body[name] for name in ("temperature", "top_p", "parallel_tool_calls", *CHAT_EXTENSIONS)
            if name in body}
    messages, origins = conversation(body)
    chat["messages"] = messages
    effort, summary = reasoning_settings(body.get("reasoning"))
    extras = {"max_tokens": body.get("max_output_tokens"), "tools": function_tools(body.get("tools")),
              "tool_choice": chat_tool_choice(body.get("tool_choice")),
              "response_format": response_format(body.get("text")),
              "reasoning_effort": effort}
    chat.update({k: v for k, v in extras.items() if v is not None})
    logprobs = wants_logprobs(body)
    top = _value(body, "top_logprobs", int_in_range, 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise _refused(f"top_logprobs: give include [{LOGPROBS_INCLUDE!r}] with it", "top_logprobs")
    if logprobs:
        chat.update(logprobs=True, top_logprobs=top or 0)
    return chat, origins, logprobs, summary


@dataclasses.dataclass
class PreparedResponse(Prepared):
    """A Responses request prepared as its chat: the settings its response object echoes, whether its output text
    carries logprobs, the reasoning summary asked for."""
    settings: dict = dataclasses.field(default_factory=dict)
    logprobs: bool = False
    summary: str | None = None


def prepare(server, raw: bytes) -> PreparedResponse:
    """On a worker thread: a Responses request's body checked, put as its chat request and prepared as one."""
    body = server.json_object(raw)
    server.check_model(body)
    check_fields(body, RESPONSES_FIELDS, "/v1/responses", RESPONSES_REFUSED, RESPONSES_PLAIN)
    stream = _get(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    options = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    if options and not stream:
        raise _refused("stream_options: only with stream: true", "stream_options")
    _known_keys(options, {"include_obfuscation"}, "stream_options", "stream_options")
    if options.get("include_obfuscation"):
        raise _refused("stream_options.include_obfuscation: no obfuscation field is written (give false)",
                       "stream_options", "unsupported_value")
    _get(body, "store", lambda v: isinstance(v, bool), "a boolean")
    metadata = check_metadata(body)
    chat, origins, logprobs, summary = chat_request(body)
    try:
        prepared = server.prepared_chat(chat, stream)
    except RequestError as e:
        raise renamed(e, origins, "input", CHAT_PARAMS, CHAT_NAMES) from None
    fmt = (body.get("text") or {}).get("format")
    settings = {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
                "metadata": metadata, "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
                "previous_response_id": None, "reasoning": {"effort": chat.get("reasoning_effort"), "summary": summary},
                "store": False, "temperature": prepared.options.temperature, "top_p": prepared.options.top_p,
                "text": {"format": fmt or {"type": "text"}}, "tool_choice": body.get("tool_choice") or "auto",
                "tools": body.get("tools") or [], "top_logprobs": body.get("top_logprobs") or 0,
                "truncation": "disabled", "background": False, "service_tier": body.get("service_tier") or "default",
                **{name: body.get(name) for name in IDENTIFIER_FIELDS}}  # (echoed, as OpenAI's response object does)
    fields = {f.name: getattr(prepared, f.name) for f in dataclasses.fields(Prepared)}
    return PreparedResponse(**fields, settings=settings, logprobs=logprobs, summary=summary)


# the item each part of an answer (AnswerSplitter's fields) goes to
ITEM_OF = {"reasoning_content": "reasoning", "content": "message", "tool_call": "function_call"}


class OutputItems:
    """A response's output items, built from its answer's parts in order (AnswerSplitter's): a run of thought one
    "reasoning" item (a reasoning_text part; with `summary`, the same text as a summary_text part too; its
    encrypted_content written once it is done), a run of content one "message" item (an output_text part), each tool
    call a "function_call" item. add() and end() give the stream events that build them, OpenAI's, without their
    sequence_number. The logprobs of tokens held (hold) go with the next output_text delta. The open item's text is
    kept as its pieces (a str grown at each delta is copied whole: quadratic in a long answer, on the event loop):
    `output()` gives the items with it."""

    def __init__(self, summary: bool = False):
        self.summary = summary
        self.items: list[dict] = []
        self.open: dict | None = None  # the reasoning or message item being written
        self.text = Pieces()  # its part's text so far
        self.held: list[dict] = []

    def output(self) -> list[dict]:
        """The items so far, the open one's text in place."""
        if self.open is not None:
            text = self.text.text()
            for part in self._parts(self.open):
                part["text"] = text
        return self.items

    def _parts(self, item: dict) -> list[dict]:
        """The item's parts that hold its text: its content's, and a reasoning item's summary's."""
        return item["content"][:1] + item.get("summary", [])[:1]

    def hold(self, logprobs: list[dict]) -> None:
        self.held += logprobs

    def drop_held(self) -> None:
        """The tokens held were the thought's: no output text's."""
        self.held = []

    def add(self, parts: list[tuple[str, object]]) -> list[dict]:
        events = []
        for field, value in parts:
            kind = ITEM_OF[field]
            if self.open is not None and self.open["type"] != kind:
                events += self._close("completed")
            if kind == "function_call":
                events += self._call(value)
                continue
            if self.open is None:
                events += self._open(kind)
            events += self._delta(value)
        return events

    def end(self, status: str) -> list[dict]:
        """The answer's end: the item being written closed (`status`: its own, "incomplete" where the answer was
        cut short); an answer with no item gets an empty message (the response's output_text is "")."""
        if not self.items:
            return self._open("message") + self._close(status)
        return self._close(status) if self.open is not None else []

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1, "content_index": 0}

    def _open(self, kind: str) -> list[dict]:
        if kind == "message":
            item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        self.open, self.text = item, Pieces()
        events = [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                   "item": copy.deepcopy(item)},
                  {"type": "response.content_part.added", **self._where(), "part": copy.deepcopy(part)}]
        item["content"].append(part)
        if kind == "reasoning" and self.summary:
            item["summary"].append({"type": "summary_text", "text": ""})
            events.append({"type": "response.reasoning_summary_part.added", **self._summary_where(),
                           "part": {"type": "summary_text", "text": ""}})
        return events

    def _summary_where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1, "summary_index": 0}

    def _delta(self, text: str) -> list[dict]:
        part = self.open["content"][0]
        self.text.add(text)
        if self.open["type"] == "reasoning":
            return [{"type": "response.reasoning_text.delta", **self._where(), "delta": text},
                    *([{"type": "response.reasoning_summary_text.delta", **self._summary_where(), "delta": text}]
                      if self.summary else [])]
        logprobs, self.held = self.held, []
        part["logprobs"] += logprobs
        return [{"type": "response.output_text.delta", **self._where(), "delta": text, "logprobs": logprobs}]

    def _close(self, status: str) -> list[dict]:
        self.output()
        where, item = self._where(), self.open
        part = item["content"][0]
        if item["type"] == "message":
            part["logprobs"] += self.held
            self.held = []
            done = {"type": "response.output_text.done", **where, "text": part["text"], "logprobs": part["logprobs"]}
        else:
            done = {"type": "response.reasoning_text.done", **where, "text": part["text"]}
            item["encrypted_content"] = sealed_thought(part["text"])
        events = [done, {"type": "response.content_part.done", **where, "part": copy.deepcopy(part)}]
        if item.get("summary"):
            summary, at = item["summary"][0], self._summary_where()
            events += [{"type": "response.reasoning_summary_text.done", **at, "text": summary["text"]},
                       {"type": "response.reasoning_summary_part.done", **at, "part": copy.deepcopy(summary)}]
        item["status"] = status
        self.open = None
        return events + [{"type": "response.output_item.done", "output_index": where["output_index"],
                          "item": copy.deepcopy(item)}]

    def _call(self, call: dict) -> list[dict]:
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call["id"], "name": name,
                "arguments": "", "status": "in_progress"}
        self.items.append(item)
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        events = [{"type": "response.output_item.added", "output_index": where["output_index"],
                   "item": copy.deepcopy(item)},
                  {"type": "response.function_call_arguments.delta", **where, "delta": arguments},
                  {"type": "response.function_call_arguments.done", **where, "name": name, "arguments": arguments}]
        item.update(arguments=arguments, status="completed")
        return events + [{"type": "response.output_item.done", "output_index": where["output_index"],
                          "item": copy.deepcopy(item)}]


def ending(finish_reason: str) -> tuple[str, dict | None]:
    """The response's status and incomplete_details for the generation's finish reason: cut short by
    max_output_tokens, OpenAI's "incomplete"; stopped by --request-timeout or the server's shutdown, incomplete too,
    the reason moepack's finish reason ("timeout", "cancelled")."""
    if finish_reason in ("stop", "tool_calls"):
        return "completed", None
    return "incomplete", {"reason": "max_output_tokens" if finish_reason == "length" else finish_reason}


def responses_error_event(error: RequestError) -> str:
    """OpenAI's Responses `error` event (a stream's end where the server cannot write its response.failed: a
    half-closed client's stream, cut by Starlette, whose sequence is not known there)."""
    event = {"type": "error", "code": error.code, "message": error.message, "param": error.param}
    return f"event: error\ndata: {json.dumps(event)}\n\n"


def responses_endpoints(server, model_name: str, admitted_request: Callable, finished_job: Callable,
                        stream_when_started: Callable, job_events: Callable) -> tuple[Callable, Callable]:
    """The app's POST /v1/responses and the answer to GET / DELETE /v1/responses/{id} (and its cancel and
    input_items), built on make_app's steps of a request (serve/app.py): admitted_request, finished_job,
    stream_when_started, job_events."""
    import contextlib

    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse

    def response_object(job, prepared: PreparedResponse, created: int, status: str, output: list[dict],
                        **more) -> dict:
        return {"id": job.request_id, "object": "response", "created_at": created, "status": status, "error": None,
                "incomplete_details": None, "model": model_name, "output": output, "usage": None,
                **prepared.settings, **more}

    def finished(job, prepared: PreparedResponse, created: int, result, output: OutputItems,
                 whole: bool = False) -> dict:
        """The response object of a generation that ended, its output built; `whole` (not streamed): its message's
        logprobs are those of the tokens after the thought. On a worker thread: the thought's tokens are counted by
        decoding the answer again, as its text was (job.tokenizer: special tokens left out or not)."""
        thought = thought_tokens(job.tokenizer, result, prepared.thought)
        items = output.output()
        message = next((item for item in items if item["type"] == "message"), None)
        if whole and prepared.logprobs and message is not None:
            message["content"][0]["logprobs"] = chat_logprobs(server.tokenizer, result.logprobs[thought:])["content"]
        status, incomplete = ending(result.finish_reason)
        generated = len(result.generated_ids)
        usage = {"input_tokens": job.prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens(result)},
                 "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": thought},
                 "total_tokens": job.prompt_tokens + generated}
        return response_object(job, prepared, created, status, items, usage=usage,
                               incomplete_details=incomplete,
                               **({"completed_at": int(time.time())} if status == "completed" else {}))

    async def create(request):
        prepared, job, future = await admitted_request(request, functools.partial(prepare, server), "resp", "_")
        created = int(time.time())
        if not prepared.stream:
            result = (await finished_job(request, job, future))[0]

            def whole() -> dict:
                output = OutputItems(summary=prepared.summary is not None)
                output.add(whole_answer(prepared, result.text or ""))
                output.end(ending(result.finish_reason)[0])
                return finished(job, prepared, created, result, output, whole=True)
            return JSONResponse(await run_in_threadpool(whole), headers={"X-Request-Id": job.request_id})

        async def events():
            numbers = itertools.count()
            output, splitter = OutputItems(summary=prepared.summary is not None), AnswerSplitter(prepared.thought,
                                                                                                prepared.tools)
            tok = server.tokenizer

            def sse(event: dict) -> str:
                return f"event: {event['type']}\ndata: {json.dumps({**event, 'sequence_number': next(numbers)})}\n\n"
            for kind in ("response.created", "response.in_progress"):
                yield sse({"type": kind, "response": response_object(job, prepared, created, "in_progress", [])})
            async with contextlib.aclosing(job_events(request, job, future)) as happenings:
                async for kind, _, piece in happenings:
                    if kind == "token" and piece[1] is not None:  # (its logprobs, asked for)
                        output.hold(chat_logprobs(tok, [piece[1]])["content"])
                    elif kind == "text":
                        thinking = splitter.thought.in_thought  # (the tokens of a piece fed in the thought: its)
                        parts = splitter.feed(piece)
                        if splitter.thought.had_thought and thinking is not False:
                            output.drop_held()
                        for event in output.add(parts):
                            yield sse(event)
                    elif kind in ("gone", "error"):  # (a client that only half-closed reads why)
                        error = client_gone() if kind == "gone" else piece
                        yield sse({"type": "response.failed", "response": response_object(
                            job, prepared, created, "failed", output.output(),
                            error={"code": error.code, "message": error.message})})
                        return
                    elif kind == "done":
                        result = piece[0]
                        status = ending(result.finish_reason)[0]

                        def last_events() -> str:  # (on a worker thread: the items' copies and JSON, each holding
                            # the whole text and its logprobs, had taken 1.9 s of the event loop at 32,000 tokens)
                            closed = [sse(event) for event in output.add(splitter.flush()) + output.end(status)]
                            answer = finished(job, prepared, created, result, output)
                            return "".join(closed) + sse({"type": f"response.{status}", "response": answer})
                        yield await run_in_threadpool(last_events)
                        return
        return await stream_when_started(request, job, future, events())

    async def not_stored(request):
        server.check_auth(request)
        what = request.path_params["response_id"][:80]
        raise RequestError(f"{request.method} /v1/responses/{what}: {NOT_STORED}, so none can be retrieved, listed, "
                           "cancelled or deleted", param="response_id", code="response_not_found", status=404)

    return create, not_stored
