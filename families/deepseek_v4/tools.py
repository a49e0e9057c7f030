"""DeepSeek-V4's tool calling format (DSML), as the release's encoder (`encoding/encoding_dsv4.py`) writes and parses
it: the tool schemas a system or developer message carries, an assistant's tool calls, tool results, and the
model's own tool calls parsed back into OpenAI's `tool_calls`.

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

An assistant's calls follow its content after a blank line; a parameter whose value is a string is written as is
(`string="true"`), any other value as JSON. Tool results are `<tool_result>...</tool_result>` blocks of a user turn,
in the order of the calls they answer. `｜DSML｜` is a special token of the release tokenizer:
families/deepseek_v4/chat.py marks it (and the other special tokens these templates spell) as markup, the schemas,
arguments and results as plain text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, Mapping, NamedTuple

from moepack.format_spec.errors import MoepackError
from moepack.format_spec.untrusted import MAX_JSON_DEPTH, nesting_depth

DSML = "｜DSML｜"
TOOL_CALLS_START = f"\n\n<{DSML}tool_calls>"  # what opens an assistant's calls after its content
TOOL_CALLS_END = f"</{DSML}tool_calls>"
INVOKE_END = f"</{DSML}invoke>"

# The release's prompt texts, character for character (they are part of the format the model was trained on).
TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

"""  # noqa: E501  (then the schemas, one JSON per line, then TOOLS_TEMPLATE_END)
TOOLS_TEMPLATE_END = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
RESPONSE_FORMAT_PREFIX = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
TOOL_RESULT_START, TOOL_RESULT_END = "<tool_result>", "</tool_result>"


class ToolCallFormatError(MoepackError):
    """The model's tool calls do not follow the format (the text is then given back as content)."""


def to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tools_intro() -> str:
    return TOOLS_TEMPLATE.format(dsml=DSML)


def tool_schemas(tools: list[Mapping]) -> str:
    """The schemas part of the tools section: each tool's `function` object as JSON, one a line."""
    return "\n".join(to_json(t["function"]) for t in tools)


def call_arguments(arguments: str) -> dict:
    """A call's arguments (OpenAI's JSON string) as the release reads them: not a JSON object -> {"arguments": text}."""
    try:
        value = json.loads(arguments)
    except (TypeError, ValueError):
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": arguments}


def invoke_parts(name: str, arguments: str) -> list[tuple[str, bool]]:
    """One call as (text, is_markup) pieces: the invoke and parameter tags are markup; names and values plain."""
    parts: list[tuple[str, bool]] = [(f'<{DSML}invoke name="', True), (name, False), ('">\n', True)]
    for i, (key, value) in enumerate(call_arguments(arguments).items()):
        is_str = isinstance(value, str)
        parts += [("\n" if i else "", True), (f'<{DSML}parameter name="', True), (key, False),
                  (f'" string="{"true" if is_str else "false"}">', True), (value if is_str else to_json(value), False),
                  (f"</{DSML}parameter>", True)]
    parts.append((f"\n{INVOKE_END}", True))
    return parts


def tool_calls_parts(calls: list[tuple[str, str]]) -> list[tuple[str, bool]]:
    """An assistant's (name, arguments) calls as (text, is_markup) pieces, from the blank line after its content."""
    parts: list[tuple[str, bool]] = [(TOOL_CALLS_START + "\n", True)]
    for i, (name, arguments) in enumerate(calls):
        if i:
            parts.append(("\n", True))
        parts += invoke_parts(name, arguments)
    parts.append((f"\n{TOOL_CALLS_END}", True))
    return parts


_STRING_FLAG = re.compile('" string="(true|false)">')
_INVOKE_HEAD = re.compile(re.escape('">\n'))


class _Tag(NamedTuple):
    start: int
    end: int
    name: str
    flag: str | None  # a parameter's string="true" / "false"
    value: str


def _tags(text: str, opening: str, head: re.Pattern, closing: str, newline: bool = False) -> Iterator[_Tag]:
    """What re.finditer(opening + '(.*?)' + head + '(.*?)' + closing + ('\\n?' if newline), DOTALL) finds, found
    with a forward search each: the name up to the first head, the value up to the first closing after it (where
    a tag at the first opening has no head or closing, none after it has either). The regex's lazy groups had
    tried every name's end against a search to the text's end: an invoke of many parameters never closed took
    time cubic in them (800: 31 s of the event loop)."""
    at = 0
    while (start := text.find(opening, at)) >= 0:
        found = head.search(text, start + len(opening))  # (a head's one group, where it has one: the tag's flag)
        if found is None:
            return
        close = text.find(closing, found.end())
        if close < 0:
            return
        at = close + len(closing)
        at += newline and text.startswith("\n", at)
        yield _Tag(start, at, text[start + len(opening):found.start()], found.group(1) if head.groups else None,
                   text[found.end():close])


def parse_invoke(name: str, body: str) -> tuple[str, str]:
    """(name, arguments as a JSON object's text) of one invoke's body, as the release decodes it."""
    args, at = {}, 0
    for m in _tags(body, f'<{DSML}parameter name="', _STRING_FLAG, f"</{DSML}parameter>", newline=True):
        if body[at:m.start].strip():
            raise ToolCallFormatError(f"tool call {name!r}: unexpected text {body[at:m.start][:40]!r}")
        key, is_str, value = m.name, m.flag, m.value
        if key in args:
            raise ToolCallFormatError(f"tool call {name!r}: parameter {key!r} given twice")
        if is_str == "false":
            try:
                json.loads(value)
            except (ValueError, RecursionError):  # (nested past the interpreter's recursion: no JSON it can read)
                raise ToolCallFormatError(f"tool call {name!r}: parameter {key!r} is not JSON") from None
        args[key] = to_json(value) if is_str == "true" else value
        at = m.end
    if body[at:].strip():
        raise ToolCallFormatError(f"tool call {name!r}: unexpected text {body[at:][:40]!r}")
    return name, "{" + ", ".join(f"{to_json(k)}: {v}" for k, v in args.items()) + "}"


def parse_tool_calls(block: str) -> list[tuple[str, str]]:
    """The (name, arguments) calls of the text after TOOL_CALLS_START (its closing tag optional: a reply cut by
    max_tokens keeps its complete calls). ToolCallFormatError where the text is not the format."""
    body = block.split(TOOL_CALLS_END, 1)[0]
    calls, at = [], 0
    for m in _tags(body, f'<{DSML}invoke name="', _INVOKE_HEAD, f"</{DSML}invoke>"):
        if body[at:m.start].strip():
            raise ToolCallFormatError(f"tool calls: unexpected text {body[at:m.start][:40]!r}")
        calls.append(parse_invoke(m.name, m.value))
        at = m.end
    rest = body[at:].strip()
    invoke = f"<{DSML}invoke"
    cut = TOOL_CALLS_END not in block and (rest.startswith(invoke) or invoke.startswith(rest))
    if rest and not cut:  # (a call cut short by max_tokens is left out)
        raise ToolCallFormatError(f"tool calls: unexpected text {rest[:40]!r}")
    return calls


def split_tool_calls(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(content, calls) of an assistant's answer: the text before TOOL_CALLS_START and its calls."""
    content, sep, block = text.partition(TOOL_CALLS_START)
    return (content, parse_tool_calls(block)) if sep else (text, [])


def check_tool_calls(calls, where: str) -> list[tuple[str, str, str]]:
    """An assistant's OpenAI `tool_calls` as (id, name, arguments); MoepackError naming the bad one."""
    if not isinstance(calls, list):
        raise MoepackError(f"{where}: expected a list of tool calls")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments", ""), str):
            raise MoepackError(f'{where}[{i}]: expected {{"id", "type": "function", "function": {{"name", '
                               '"arguments"}}')
        # (parsed to be rendered: json.loads recurses, and a client's arguments nest as deep as it likes)
        if nesting_depth(fn.get("arguments", ""), MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
            raise MoepackError(f"{where}[{i}].function.arguments: JSON nested more than {MAX_JSON_DEPTH} deep")
        call_id = call.get("id") or fn.get("id") or ""
        out.append((call_id if isinstance(call_id, str) else "", fn["name"], fn.get("arguments", "")))
    return out
