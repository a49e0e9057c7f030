"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (the `anthropic` SDK's
`client.messages.create` / `.stream` / `.count_tokens`, Claude Code) as a translation over the chat completions path
of serve/app.py, as serve/responses.py puts OpenAI's Responses API.

A request is put as the chat request it stands for (chat_request: `system` a system message in front; a message's
text blocks its content, an assistant's thinking blocks its reasoning_content and its tool_use blocks its tool calls,
a user's tool_result blocks tool messages, in order; tools, tool_choice, thinking, stop_sequences as chat's fields; a
final assistant message continued, as Anthropic's prefill) and prepared, scheduled, cancelled and counted as a
chat's (Server.prepared_chat, the app's admitted_request, job_events...); a chat error names the Messages field it
came from (`messages[2]` -> `messages[1].content[0]`, `stop` -> `stop_sequences`). The answer is split as a chat's
(AnswerSplitter: thought, content, tool calls) into content blocks (ContentBlocks): a "thinking" block (its
signature a hash of its text: nothing checks one sent back), a "text" block, a "tool_use" block per call; streamed,
Anthropic's events that build them. Every error under /v1/messages is in Anthropic's shape (anthropic_error).
docs/guide.md "Serving real clients" lists the fields served and refused.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import uuid
from collections.abc import Callable

from moepack.format_spec import untrusted
from moepack.format_spec.untrusted import UntrustedInputError, finite_float, int_in_range

from .openai_api import RequestError, _get, _value, cached_tokens, check_fields, client_gone
from .reasoning import AnswerSplitter
from .tool_calls import Pieces
from .translation import _known_keys, _object, _refused, _text, each_tool, renamed, whole_answer

MESSAGES_PATH = "/v1/messages"
MAX_TOKENS = 1 << 31  # max_tokens' and budget_tokens' bound before the context's
MESSAGES_FIELDS = {"model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k",
                   "stream", "tools", "tool_choice", "thinking", "metadata", "service_tier", "cache_control", "speed",
                   "context_management"}
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "cache_control",
                "context_management"}
# Anthropic's fields moepack does not act on: a 400 naming the field whenever one is given (not null)
MESSAGES_REFUSED = {
    "container": "containers (code execution) are not supported: moepack runs no tools",
    "mcp_servers": "MCP servers are not supported: moepack runs no tools (give the client's tools as tools)",
    "output_config": "output_config (effort, structured output formats) is not supported",
}
# the thinking settings moepack acts on: enabled (budget_tokens required) and adaptive (the model decides how much:
# Claude Code sends it, with a budget_tokens of 0) both turn chat's thinking on; disabled turns it off
THINKING_KEYS = {"enabled": {"type", "budget_tokens", "display"}, "adaptive": {"type", "budget_tokens", "display"},
                 "disabled": {"type"}}
# the one context management edit served: clearing no thinking (what moepack does: the conversation goes to the
# model as it is sent); Claude Code sends it with thinking
KEEP_ALL = ("all", {"type": "all"})
MESSAGES_PLAIN = {"service_tier": ((None, "auto", "standard_only"), 'service tiers are not supported (give "auto" or '
                                                                    '"standard_only")'),
                  "speed": ((None, "standard"), 'only the "standard" speed is served')}
TEXT_MODEL = "moepack serves a text model (text, tool_use, tool_result and thinking blocks only)"
# the keys of each content block type a message may carry (cache_control: moepack's prompt cache finds a prompt's
# cached prefix by itself; citations: only null or none, they point into documents, which are refused)
BLOCK_KEYS = {"text": {"type", "text", "cache_control", "citations"},
              "tool_use": {"type", "id", "name", "input", "cache_control"},
              "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
              "thinking": {"type", "thinking", "signature"},
              "redacted_thinking": {"type", "data"}}
ROLE_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")  # Anthropic's
# Anthropic's choices as chat's tool_choice
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none", "tool": None}
# chat's params and names in a chat error, as the Messages request names them
CHAT_PARAMS = {"stop": "stop_sequences", "parallel_tool_calls": "tool_choice"}
CHAT_NAMES = ((r"^stop\b", "stop_sequences"), (r"\b(tools\[\d+\])\.parameters\b", r"\1.input_schema"),
              (r"\bcontinue_final_message\b", "a prefill (the final assistant message, continued)"))
# Anthropic's error type for each HTTP status (another 4xx: invalid_request_error; 5xx: api_error)
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_error(e: RequestError) -> dict:
    """Anthropic's error object: {"type": "error", "error": {"type", "message"}}, the type the status's."""
    kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def messages_error_event(error: RequestError) -> str:
    """The `error` event that ends a stream which failed after it began (a half-closed client's too)."""
    return sse(anthropic_error(error))


def _cache_control(block: dict, where: str, param: str) -> None:
    """cache_control, taken as Anthropic's {"type": "ephemeral", "ttl"} and not acted on: moepack's prompt cache
    finds the longest cached prefix of every prompt by itself."""
    control, name = block.get("cache_control"), f"{where}.cache_control" if where else "cache_control"
    if control is None:
        return
    _known_keys(_object(control, name, param), {"type", "ttl"}, name, param)
    if control.get("type") != "ephemeral" or control.get("ttl") not in (None, "5m", "1h"):
        raise _refused(f'{name}: expected {{"type": "ephemeral", "ttl": "5m" | "1h"}}', param)


def _block(block, where: str, param: str, allowed: tuple[str, ...]) -> tuple[str, dict]:
    """A content block's type and the block, its keys checked (BLOCK_KEYS); another type is a 400 naming it."""
    kind = _object(block, where, param).get("type")
    if kind not in allowed:
        said = json.dumps(kind)[:40]
        if isinstance(kind, str) and kind in BLOCK_KEYS:  # (a list or an object is no type: unhashable)
            raise _refused(f"{where}: a {said} block does not go here (a message of this role carries "
                           f"{', '.join(allowed)} blocks)", param, "unsupported_value")
        raise _refused(f"{where}.type: {said} blocks are not served: {TEXT_MODEL}", param, "unsupported_value")
    _known_keys(block, BLOCK_KEYS[kind], where, param)
    _cache_control(block, where, param)
    if block.get("citations"):
        raise _refused(f"{where}.citations: citations point into documents, which are not served", param)
    return kind, block


def _texts(content, where: str, param: str) -> str | list[dict]:
    """Text content: a string, or text blocks as chat's text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refused(f"{where}: expected a string or a list of text blocks", param, "invalid_type")
    return [{"type": "text", "text": _text(_block(b, f"{where}[{j}]", param, ("text",))[1].get("text"),
                                          f"{where}[{j}].text", param)} for j, b in enumerate(content)]


def _user(content: list, where: str) -> list[tuple[dict, str]]:
    """A user message's blocks as chat messages, in order, with where each came from: a run of text blocks one user
    message, each tool_result a tool message (its is_error taken, not rendered: the chat encodings' tool results
    carry no flag; its content says what failed)."""
    out, parts = [], []
    for j, given in enumerate(content):
        at = f"{where}.content[{j}]"
        kind, block = _block(given, at, "messages", ROLE_BLOCKS["user"])
        if kind == "text":
            if not parts:
                out.append(({"role": "user", "content": parts}, at))
            parts.append({"type": "text", "text": _text(block.get("text"), f"{at}.text", "messages")})
            continue
        parts = []
        if block.get("is_error") is not None and not isinstance(block["is_error"], bool):
            raise _refused(f"{at}.is_error: expected a boolean", "messages", "invalid_type")
        result = block.get("content")
        out.append(({"role": "tool", "tool_call_id": _text(block.get("tool_use_id"), f"{at}.tool_use_id", "messages"),
                     "content": "" if result is None else _texts(result, f"{at}.content", "messages")}, at))
    return out


def _assistant(content: list, where: str) -> dict:
    """An assistant message's blocks as one chat message: its text blocks its content, its thinking blocks its
    reasoning_content (the chat encodings keep it where the conversation has tools, as DeepSeek-V4's release
    does: an agent's loop gets its thoughts back), its tool_use blocks its tool calls; redacted_thinking dropped
    (it holds no text moepack wrote)."""
    parts, thoughts, calls = [], [], []
    for j, given in enumerate(content):
        at = f"{where}.content[{j}]"
        kind, block = _block(given, at, "messages", ROLE_BLOCKS["assistant"])
        if kind == "text":
            parts.append({"type": "text", "text": _text(block.get("text"), f"{at}.text", "messages")})
        elif kind == "thinking":
            thoughts.append(_text(block.get("thinking"), f"{at}.thinking", "messages"))
            if block.get("signature") is not None:
                _text(block["signature"], f"{at}.signature", "messages")
        elif kind == "tool_use":
            name = _text(block.get("name"), f"{at}.name", "messages")
            arguments = json.dumps(_object(block.get("input"), f"{at}.input", "messages"), ensure_ascii=False)
            calls.append({"id": _text(block.get("id"), f"{at}.id", "messages"), "type": "function",
                          "function": {"name": name, "arguments": arguments}})
    message = {"role": "assistant", "content": parts or (None if calls else "")}
    if thoughts:
        message["reasoning_content"] = "".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


def conversation(body: dict) -> tuple[list[dict], list[str]]:
    """The chat messages of `system` and `messages`, and where in the request each came from ("system",
    "messages[3]", "messages[3].content[1]")."""
    messages, origins = [], []
    system = body.get("system")
    if system is not None:
        system = _texts(system, "system", "system")
        if system:
            messages.append({"role": "system", "content": system})
            origins.append("system")
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise _refused("messages: expected a non-empty list of {role, content} messages", "messages", "invalid_type")
    for i, m in enumerate(given):
        where = f"messages[{i}]"
        _known_keys(_object(m, where, "messages"), {"role", "content"}, where, "messages")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or role not in ROLE_BLOCKS:
            raise _refused(f"{where}.role: expected user or assistant, got {json.dumps(role)[:40]} (the system "
                           "prompt is the request's system field)", "messages")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            origins.append(where)
            continue
        if not isinstance(content, list) or not content:
            raise _refused(f"{where}.content: expected a string or a non-empty list of content blocks", "messages",
                           "invalid_type")
        if role == "assistant":
            messages.append(_assistant(content, where))
            origins.append(where)
            continue
        for message, origin in _user(content, where):
            messages.append(message)
            origins.append(origin)
    return messages, origins


def chat_tools(tools) -> list[dict] | None:
    """The client's tools ({name, description, input_schema}, type absent or "custom") as chat's; a server tool
    (web_search_*, bash_*, text_editor_*, computer_*, ...) is a 400 naming it: moepack runs no tools."""
    out = []
    for where, tool, kind in each_tool(tools):
        if kind not in (None, "custom"):
            raise _refused(f"{where}.type: {json.dumps(kind)[:40]} is a server tool, not served (client tools "
                           "{name, description, input_schema} only: moepack runs no tools)", "tools",
                           "unsupported_value")
        _known_keys(tool, {"type", "name", "description", "input_schema", "cache_control"}, where, "tools")
        _cache_control(tool, where, "tools")
        name = _text(tool.get("name"), f"{where}.name", "tools")
        if not TOOL_NAME.fullmatch(name):
            raise _refused(f"{where}.name: expected 1 to 128 letters, digits, _ or -", "tools")
        described = tool.get("description") is not None  # (OpenAI's order of the keys: the prompt's JSON has it)
        function = {"name": name, **({"description": _text(tool["description"], f"{where}.description", "tools")}
                                     if described else {}),
                    "parameters": _object(tool.get("input_schema"), f"{where}.input_schema", "tools")}
        out.append({"type": "function", "function": function})
    return out or None


def chat_tool_choice(choice) -> tuple[object, bool | None]:
    """tool_choice ({type: auto | any | tool | none, name, disable_parallel_tool_use}) as chat's tool_choice and
    parallel_tool_calls."""
    if choice is None:
        return None, None
    kind = _object(choice, "tool_choice", "tool_choice").get("type")
    if not isinstance(kind, str) or kind not in TOOL_CHOICES:
        raise _refused(f"tool_choice.type: expected auto, any, tool or none, got {json.dumps(kind)[:40]}",
                       "tool_choice")
    keys = {"type"} | ({"name"} if kind == "tool" else set()) | (set() if kind == "none" else
                                                                  {"disable_parallel_tool_use"})
    _known_keys(choice, keys, "tool_choice", "tool_choice")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise _refused("tool_choice.disable_parallel_tool_use: expected a boolean", "tool_choice", "invalid_type")
    chat = TOOL_CHOICES[kind] or {"type": "function", "function": {
        "name": _text(choice.get("name"), "tool_choice.name", "tool_choice")}}
    return chat, (False if disable else None)


def thinking_flag(body: dict, max_tokens: int | None) -> bool | None:
    """thinking: {"type": "enabled", "budget_tokens"} or {"type": "adaptive"} chat's thinking on, {"type":
    "disabled"} off. budget_tokens is checked as Anthropic does (enabled: an integer >= 1024, below max_tokens;
    adaptive: any integer >= 0, Claude Code's 0) and not enforced: the thought runs until the model ends it or
    max_tokens ends the answer. display "summarized" is what is written (the thought whole); "omitted" a 400."""
    thinking = body.get("thinking")
    if thinking is None:
        return None
    kind = _object(thinking, "thinking", "thinking").get("type")
    if not isinstance(kind, str) or kind not in THINKING_KEYS:
        raise _refused(f'thinking.type: expected "enabled", "adaptive" or "disabled", got {json.dumps(kind)[:40]}',
                       "thinking")
    _known_keys(thinking, THINKING_KEYS[kind], "thinking", "thinking")
    if kind == "disabled":
        return False
    if thinking.get("display") not in (None, "summarized"):
        raise _refused(f"thinking.display: {json.dumps(thinking['display'])[:40]} is not served (the thought is "
                       'written whole: "summarized")', "thinking", "unsupported_value")
    given = thinking.get("budget_tokens")
    if kind == "adaptive" and given is None:
        return True
    try:
        budget = int_in_range(given, "thinking.budget_tokens", 1024 if kind == "enabled" else 0, MAX_TOKENS)
    except UntrustedInputError as e:
        raise _refused(str(e), "thinking") from None
    if kind == "enabled" and max_tokens is not None and budget >= max_tokens:
        raise _refused(f"thinking.budget_tokens: {budget} must be below max_tokens ({max_tokens})", "thinking")
    return True


def check_context_management(body: dict) -> None:
    """context_management: its edits each clear_thinking_20251015 keeping all thinking (what moepack does: the
    conversation goes to the model as it is sent; Claude Code sends it); another edit (clearing tool results or
    older thoughts, compaction) a 400 naming it."""
    management = body.get("context_management")
    if management is None:
        return
    _known_keys(_object(management, "context_management", "context_management"), {"edits"},
                "context_management", "context_management")
    edits = management.get("edits") or []
    if not isinstance(edits, list):
        raise _refused("context_management.edits: expected a list of edits", "context_management", "invalid_type")
    for i, edit in enumerate(edits):
        where = f"context_management.edits[{i}]"
        if _object(edit, where, "context_management").get("type") != "clear_thinking_20251015" or \
                edit.get("keep") not in KEEP_ALL:
            raise _refused(f'{where}: only {{"type": "clear_thinking_20251015", "keep": "all"}} is served (context '
                           "management is not: send the conversation as the model is to read it)",
                           "context_management", "unsupported_value")
        _known_keys(edit, {"type", "keep"}, where, "context_management")


def chat_request(body: dict, max_tokens: int | None) -> tuple[dict, list[str]]:
    """The chat completions body a Messages request stands for, and where each chat message came from."""
    _cache_control(body, "", "cache_control")
    check_context_management(body)
    messages, origins = conversation(body)
    chat = {name: body[name] for name in ("temperature", "top_p", "top_k") if name in body}
    chat["messages"] = messages
    tool_choice, parallel = chat_tool_choice(body.get("tool_choice"))
    stop = _get(body, "stop_sequences", lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
                "a list of strings")
    extras = {"max_tokens": max_tokens, "tools": chat_tools(body.get("tools")), "tool_choice": tool_choice,
              "parallel_tool_calls": parallel, "thinking": thinking_flag(body, max_tokens), "stop": stop or None,
              # (Anthropic's prefill: the answer goes on from a final assistant message)
              "continue_final_message": messages[-1]["role"] == "assistant" or None}
    chat.update({k: v for k, v in extras.items() if v is not None})
    return chat, origins


def chat_error(e: RequestError, origins: list[str]) -> RequestError:
    return renamed(e, origins, "messages", CHAT_PARAMS, CHAT_NAMES)


def prepare(server, raw: bytes):
    """On a worker thread: a Messages request's body checked, put as its chat request and prepared as one."""
    body = server.json_object(raw)
    server.check_model(body)
    check_fields(body, MESSAGES_FIELDS, MESSAGES_PATH, MESSAGES_REFUSED, MESSAGES_PLAIN)
    if body.get("max_tokens") is None:
        raise _refused("max_tokens: required (the most tokens the answer may have)", "max_tokens")
    max_tokens = _value(body, "max_tokens", int_in_range, 1, MAX_TOKENS)
    _value(body, "temperature", finite_float, lo=0.0, hi=1.0)  # (Anthropic's range)
    stream = _get(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    metadata = _get(body, "metadata", lambda v: isinstance(v, dict), "an object", {})
    _known_keys(metadata, {"user_id"}, "metadata", "metadata")
    if metadata.get("user_id") is not None:  # (taken, not used: no per-user state is kept)
        _text(metadata["user_id"], "metadata.user_id", "metadata")
    chat, origins = chat_request(body, max_tokens)
    try:
        return server.prepared_chat(chat, stream)
    except RequestError as e:
        raise chat_error(e, origins) from None


def count_tokens(server, body: dict) -> dict:
    """count_tokens: {input_tokens} of the prompt the request renders (its system prompt and tools too)."""
    server.check_model(body)
    chat, origins = chat_request(body, None)
    try:
        ids = server.chat_ids(chat)[0]
    except RequestError as e:
        raise chat_error(e, origins) from None
    return {"input_tokens": len(ids)}


# the block each part of an answer (AnswerSplitter's fields) goes to
BLOCK_OF = {"reasoning_content": "thinking", "content": "text", "tool_call": "tool_use"}


def signature(thought: str) -> str:
    """A thinking block's signature: opaque to clients, which require one and send it back; nothing checks it."""
    return hashlib.sha256(thought.encode()).hexdigest()[:32]


def tool_input(arguments: str) -> dict:
    """A call's arguments (a JSON object's text) as a tool_use's input; a call whose arguments are some other JSON
    value (a model's slip in a `<tool_call>` block) gets them under "arguments", for the tool to refuse, and so do
    arguments that are no JSON a message can carry, as their text (a DeepSeek-V4 parameter's `NaN`: Python's json
    reads it, and the answer had been a 500, or a stream's event not JSON)."""
    try:
        value = untrusted.loads(arguments, "a tool call's arguments")
    except UntrustedInputError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


class ContentBlocks:
    """A message's content blocks, built from its answer's parts in order (AnswerSplitter's): a run of thought one
    "thinking" block, a run of content one "text" block, each tool call a "tool_use" block. add() and end() give
    the stream events that build them, Anthropic's. The open block's text is kept as its pieces (Pieces: joined
    once, at its close)."""

    def __init__(self):
        self.blocks: list[dict] = []
        self.open: dict | None = None  # the thinking or text block being written
        self.text = Pieces()
        self.calls = 0

    def content(self) -> list[dict]:
        """The blocks so far, the open one's text in place."""
        if self.open is not None:
            self.open[self.open["type"]] = self.text.text()
        return self.blocks

    def add(self, parts: list[tuple[str, object]]) -> list[dict]:
        events = []
        for field, value in parts:
            kind = BLOCK_OF[field]
            if self.open is not None and self.open["type"] != kind:
                events += self.end()
            if kind == "tool_use":
                events += self._tool_use(value)
            elif value:
                if self.open is None:
                    events += self._start({"type": kind, kind: "", **({"signature": ""} if kind == "thinking"
                                                                        else {})})
                self.text.add(value)
                events.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                               "delta": {"type": f"{kind}_delta", kind: value}})
        return events

    def end(self) -> list[dict]:
        """The block being written closed (a thinking block's signature first)."""
        if self.open is None:
            return []
        block, index = self.open, len(self.blocks) - 1
        self.content()
        self.open = None
        events = []
        if block["type"] == "thinking":
            block["signature"] = signature(block["thinking"])
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "signature_delta", "signature": block["signature"]}})
        return events + [{"type": "content_block_stop", "index": index}]

    def _start(self, block: dict) -> list[dict]:
        self.blocks.append(block)
        self.open, self.text = (block, Pieces()) if block["type"] != "tool_use" else (None, self.text)
        return [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _tool_use(self, call: dict) -> list[dict]:
        self.calls += 1
        arguments = call["function"]["arguments"]
        block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call["function"]["name"],
                 "input": {}}
        events = self._start(block)
        block["input"] = tool_input(arguments)
        index = len(self.blocks) - 1
        return events + [{"type": "content_block_delta", "index": index,
                          "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}},
                         {"type": "content_block_stop", "index": index}]


def stop_reason(result, blocks: ContentBlocks) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a generation's end: end_turn, stop_sequence (the string), tool_use,
    max_tokens; one stopped by --request-timeout or the server's shutdown, moepack's finish reason ("timeout",
    "cancelled")."""
    if result.finish_reason == "stop":
        if result.stop_string is not None:
            return "stop_sequence", result.stop_string
        return ("tool_use" if blocks.calls else "end_turn"), None
    return ("max_tokens" if result.finish_reason == "length" else result.finish_reason), None


def usage(job, result=None) -> dict:
    """Anthropic's usage: input_tokens the prompt's tokens not read from the prompt cache (the sum of input_tokens
    and cache_read_input_tokens is the prompt's length, as Anthropic's); `result` None: before any token."""
    cached = 0 if result is None else cached_tokens(result)
    return {"input_tokens": job.prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": 0 if result is None else len(result.generated_ids)}


def messages_endpoints(server, model_name: str, admitted_request: Callable, finished_job: Callable,
                       stream_when_started: Callable, job_events: Callable,
                       small_request: Callable) -> tuple[Callable, Callable]:
    """The app's POST /v1/messages and /v1/messages/count_tokens, built on make_app's steps of a request
    (serve/app.py): admitted_request, finished_job, stream_when_started, job_events, small_request."""
    import contextlib

    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse

    def message(job, content: list[dict], reason: str | None = None, sequence: str | None = None,
                used: dict | None = None) -> dict:
        return {"id": job.request_id, "type": "message", "role": "assistant", "model": model_name,
                "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": used or usage(job)}

    async def create(request):
        prepared, job, future = await admitted_request(request, functools.partial(prepare, server), "msg", "_")
        if not prepared.stream:
            result = (await finished_job(request, job, future))[0]

            def whole() -> dict:
                blocks = ContentBlocks()
                blocks.add(whole_answer(prepared, result.text or ""))
                blocks.end()
                return message(job, blocks.content(), *stop_reason(result, blocks), usage(job, result))
            return JSONResponse(await run_in_threadpool(whole), headers={"X-Request-Id": job.request_id})

        async def events():
            blocks, splitter = ContentBlocks(), AnswerSplitter(prepared.thought, prepared.tools)
            yield sse({"type": "message_start", "message": message(job, [])}) + sse({"type": "ping"})
            async with contextlib.aclosing(job_events(request, job, future)) as happenings:
                async for kind, _, piece in happenings:
                    if kind == "text":
                        written = "".join(sse(event) for event in blocks.add(splitter.feed(piece)))
                        if written:
                            yield written
                    elif kind in ("gone", "error"):  # (a client that only half-closed reads why)
                        yield messages_error_event(client_gone() if kind == "gone" else piece)
                        return
                    elif kind == "done":
                        result = piece[0]
                        closing = blocks.add(splitter.flush()) + blocks.end()
                        reason, sequence = stop_reason(result, blocks)
                        closing += [{"type": "message_delta", "delta": {"stop_reason": reason,
                                                                         "stop_sequence": sequence},
                                     "usage": usage(job, result)}, {"type": "message_stop"}]
                        yield "".join(sse(event) for event in closing)
                        return
        return await stream_when_started(request, job, future, events())

    async def count(request):
        return await small_request(request, COUNT_FIELDS, functools.partial(count_tokens, server))

    return create, count
