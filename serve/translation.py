"""The pieces an API served as a translation over the chat path shares (serve/responses.py, OpenAI's Responses API;
serve/messages.py, Anthropic's Messages API): a request's nested values checked into a 400 naming where they are
(_object, _known_keys, _text), a chat error renamed as the request names its fields (renamed), and the answer's
whole text split as a chat's (whole_answer)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from .openai_api import RequestError
from .reasoning import AnswerSplitter


def _refused(message: str, param: str, code: str = "invalid_value") -> RequestError:
    return RequestError(message, param=param, code=code)


def _object(value, where: str, param: str) -> dict:
    if not isinstance(value, dict):
        raise _refused(f"{where}: expected an object, got {json.dumps(value)[:40]}", param, "invalid_type")
    return value


def _known_keys(value: dict, keys: set[str], where: str, param: str) -> None:
    """Every key of `value` one of `keys`, or null (unset, as elsewhere in a request: an item's model_dump() writes
    each field of its type, null where unset)."""
    unknown = sorted(k for k, v in value.items() if k not in keys and v is not None)
    if unknown:
        raise _refused(f"{where}.{unknown[0][:40]}: not a key moepack reads here (it reads {', '.join(sorted(keys))})",
                       param, "unknown_field")


def _text(value, where: str, param: str) -> str:
    if not isinstance(value, str):
        raise _refused(f"{where}: expected a string, got {json.dumps(value)[:40]}", param, "invalid_type")
    return value


def each_tool(tools) -> list[tuple[str, dict, object]]:
    """A request's `tools` (a list; None: none) as (where, the tool, its type) each, every one an object."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _refused("tools: expected a list of tools", "tools", "invalid_type")
    return [(f"tools[{i}]", tool, _object(tool, f"tools[{i}]", "tools").get("type")) for i, tool in enumerate(tools)]


def renamed(e: RequestError, origins: list[str], conversation: str, params: dict[str, str],
            names: Sequence[tuple[str, str]] = ()) -> RequestError:
    """A chat error as the translated request names its fields: a chat message by where in the request it came from
    (`origins[i]`: "input[3]", "messages[2].content[1]", or a field of its own, "instructions", "system", which is
    then the error's param), a bare `messages` as the request's `conversation` field, chat's params by `params`
    and the texts matching the regular expressions of `names` by theirs."""
    param = params.get(e.param, e.param)

    def origin(m: re.Match) -> str:
        nonlocal param
        i = int(m[1])
        if i >= len(origins):
            return m[0]
        if not origins[i].startswith(conversation):
            param = origins[i]
        return origins[i]
    text = re.sub(r"\bmessages\[(\d+)\]", origin, e.message)
    text = re.sub(r"\bmessages\b(?!\[)", conversation, text)
    text = re.sub(r"\btools\[(\d+)\]\.function\b", r"tools[\1]", text)
    for pattern, name in names:
        text = re.sub(pattern, name, text)
    return RequestError(text, param=param, code=e.code, status=e.status, kind=e.kind, headers=e.headers)


def whole_answer(prepared, text: str) -> list[tuple[str, object]]:
    """A whole answer's parts as a chat's (AnswerSplitter: thought, content, tool calls), for a request prepared as
    a chat (serve/openai_api.py Prepared)."""
    splitter = AnswerSplitter(prepared.thought, prepared.tools)
    return splitter.feed(text) + splitter.flush()
