"""The server's side of tool calling: a request's `tools`, `tool_choice` and `parallel_tool_calls` checked into a
ToolPlan, the tools placed where the model's chat reads them, and the model's answer split into content and OpenAI
`tool_calls`, whole or as a stream (ToolPlan.splitter). Two formats:

* a chat encoding's (its `tool_format` module: DeepSeek-V4's DSML, families/deepseek_v4/tools.py): the tools and
  response_format on the conversation's system message, where the release's encoder reads them (with_prompt_extras);
  the answer's calls split by ToolCallSplitter;
* a chat template's (a family whose chat_encoding is None) that renders `tools` and spells `<tool_call>`
  (renders_tool_calls; Qwen3's): the tools go to the template as transformers passes them (its `tools` variable),
  each call of the answer is a `<tool_call>` JSON `</tool_call>` block (TaggedCallSplitter, as vLLM's hermes parser
  reads them).

tool_choice: "auto" (the default with tools): the tools are in the prompt and the answer's calls are parsed;
"none": the tools are left out of the prompt (the model cannot call what it does not see) and nothing is parsed;
"required" and a named function: the prompt is prefilled with the opening of the tool-call block (and, named, of
that function's call), so the answer can only go on with a call; with a chat encoding in thinking mode the prefill
closes the thought first (`</think>`), a chat template's prompt is rendered with enable_thinking false (Qwen3's empty
thought) before it, a thought its generation prompt opens anyway closed empty (serve/tokenizer.py): the reply then has
no reasoning."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from moepack.families.openai_tools import check_tools
from moepack.format_spec import untrusted
from moepack.format_spec.errors import MoepackError
from moepack.runtime.sampling import partial_match_length

# a chat template's tool-call markup (Qwen3's, vLLM's hermes format): each call one block of JSON
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# the same tag around XML parameters, not JSON (Qwen3-Coder's template, a qwen3_moe model's too): not parsed here
XML_CALL_OPEN = "<function="


def renders_tool_calls(template) -> bool:
    """Whether a chat template (serve/chat_template.py's ChatTemplate) takes tools in the `<tool_call>` format: it
    reads the `tools` variable and its text spells the call's tag, with no `<function=` (the XML dialect)."""
    return "tools" in template.variables and CALL_OPEN in template.source and XML_CALL_OPEN not in template.source


def _invoke_open(fmt) -> str:
    """The opening of an invoke in a tool-call format (a chat encoding's `tool_format` module) up to the name."""
    return f'<{fmt.DSML}invoke name="'


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict] | None  # what goes into the prompt (None: no tools there)
    parse: bool  # the answer's tool calls are parsed
    prefill: str = ""  # markup the prompt ends with: the answer's text goes on from it
    forced_name: str | None = None  # a named tool_choice: the function the prefill opens
    parallel: bool = True  # parallel_tool_calls false: only the first call is kept
    encoding: Any = None  # the chat encoding (a module) whose tool_format the answer is parsed in; None: a template's

    def markup(self) -> tuple[str, ...]:
        """The texts the answer's tool calls are split at (none where they are not parsed)."""
        if not self.parse:
            return ()
        if self.encoding is None:
            return CALL_OPEN, CALL_CLOSE
        fmt = self.encoding.tool_format
        return fmt.TOOL_CALLS_START, _invoke_open(fmt), fmt.INVOKE_END, fmt.TOOL_CALLS_END

    def splitter(self):
        """A new splitter of an answer in the plan's format (ToolCallSplitter or TaggedCallSplitter)."""
        if self.encoding is None:
            return TaggedCallSplitter(self.prefill, self.parallel)
        return ToolCallSplitter(self.encoding, self.prefill, self.parallel)


def tool_plan(encoding, tools, tool_choice, parallel, thinking: bool) -> ToolPlan:
    """The plan of a request's tools fields in `encoding`'s (a chat encoding module's) tool-call format, or (None) a
    chat template's `<tool_call>` format; MoepackError (its message starting with the field) when wrong."""
    if tools is not None:
        tools = check_tools(tools, "tools")
    if parallel is not None and not isinstance(parallel, bool):
        raise MoepackError("parallel_tool_calls: expected a boolean")
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    name = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise MoepackError('tool_choice: expected "none", "auto", "required" or {"type": "function", '
                               '"function": {"name": ...}}')
        if name not in {t["function"]["name"] for t in tools or []}:
            raise MoepackError(f"tool_choice: the function {name[:60]!r} is not among the request's tools")
    elif choice not in ("none", "auto", "required"):
        raise MoepackError('tool_choice: expected "none", "auto", "required" or a named function')
    if choice in ("auto", "required") and not tools and tool_choice is not None:
        raise MoepackError(f"tool_choice: {choice!r} needs tools")
    if choice == "none":
        return ToolPlan(None, False)
    if choice == "auto":
        return ToolPlan(tools, True, parallel=parallel is not False, encoding=encoding)
    if encoding is None:  # the call's JSON as the template writes an assistant's (`"name"` first)
        prefill = CALL_OPEN + "\n" + ("" if name is None else f'{{"name": {json.dumps(name, ensure_ascii=False)}, '
                                                               '"arguments": ')
    else:
        fmt = encoding.tool_format
        prefill = (encoding.THINK_END if thinking else "") + fmt.TOOL_CALLS_START + "\n" + _invoke_open(fmt)
        prefill += "" if name is None else f'{name}">\n'
    return ToolPlan(tools, True, prefill, name, parallel is not False, encoding)


def with_prompt_extras(messages: list, tools: list[dict] | None, response_format: dict | None) -> list:
    """The conversation with the request's tools and response_format on its system message (the one before the
    first other message; a system message with no text is put first where there is none), where the release's
    encoder renders them."""
    if not tools and not response_format:
        return messages
    extras = {k: v for k, v in (("tools", tools), ("response_format", response_format)) if v}
    messages = list(messages)
    first_other = next((i for i, m in enumerate(messages) if not isinstance(m, dict) or m.get("role") != "system"),
                       len(messages))
    if first_other:
        messages[first_other - 1] = {**messages[first_other - 1], **extras}
    else:
        messages.insert(0, {"role": "system", "content": "", **extras})
    return messages


def openai_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def text_before_marker(text: str, marker: str, hold_space: bool = False) -> tuple[str, str, str | None]:
    """A stream's content so far up to `marker`: (shown, held, after). Where the marker is in `text`: the text
    before it, "", the text after it. Else: what can be shown now, the tail held back until the next piece says (what
    may begin the marker; with `hold_space` the whitespace before that too), None."""
    at = text.find(marker)
    if at >= 0:
        return text[:at], "", text[at + len(marker):]
    cut = len(text) - partial_match_length(text, (marker,))
    if hold_space:
        cut = len(text[:cut].rstrip())
    return text[:cut], text[cut:], None


class Pieces:
    """Text that grows by pieces, kept as a list and joined once, when it is read: a str grown piece by piece is
    copied whole at each (quadratic in a long call's arguments, a file an agent writes, or a model's run of
    newlines held back: on the event loop)."""

    def __init__(self):
        self.parts: list[str] = []

    def add(self, piece: str) -> None:
        self.parts.append(piece)

    def text(self) -> str:
        if len(self.parts) > 1:
            self.parts = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""


class ToolCallSplitter:
    """An answer's text (after its thought), piece by piece, into ("content", text) and ("tool_call", call) events:
    text up to the tool-call block is content (a tail that may open the block is held back until the next piece
    says), each invoke becomes a call once complete. `prefill`: the markup the prompt ended with (the answer goes
    on from it). A call that does not follow the format (`encoding`'s tool_format) comes out as content, as it was
    written."""

    def __init__(self, encoding, prefill: str = "", parallel: bool = True):
        self.fmt = encoding.tool_format
        self.invoke_open = _invoke_open(self.fmt)
        self.held = ""
        self.in_block = False  # TOOL_CALLS_START came: the rest is calls (or, once it closed, text after them)
        self.call = Pieces()  # the block's text since its last complete invoke
        self.tail = ""  # the end of that text, where an INVOKE_END may have begun
        self.any_done = False  # an invoke of the block is complete
        self.calls = 0
        self.parallel = parallel
        if prefill:
            self.feed(prefill.split(encoding.THINK_END, 1)[-1])

    def feed(self, piece: str) -> list[tuple[str, object]]:
        out = []
        if not self.in_block:
            shown, self.held, after = text_before_marker(self.held + piece, self.fmt.TOOL_CALLS_START)
            out = [("content", shown)] if shown else []
            if after is None:
                return out
            self.in_block, piece = True, after
        end_mark = self.fmt.INVOKE_END
        while piece:  # (each piece searched once, with the few characters before it an INVOKE_END may begin in)
            window = self.tail + piece
            at = window.find(end_mark)
            if at < 0:
                self.call.add(piece)
                self.tail = window[max(len(window) - len(end_mark) + 1, 0):]
                return out
            cut = at + len(end_mark) - len(self.tail)  # (>= 1: the tail alone holds no INVOKE_END)
            self.call.add(piece[:cut])
            out += self._call_events(self.call.text())
            self.call, self.tail, self.any_done, piece = Pieces(), "", True, piece[cut:]
        return out

    def _call_events(self, call_text: str) -> list[tuple[str, object]]:
        """The events of one invoke's text (up to its INVOKE_END): its call, or its text as content where it does
        not follow the format."""
        fmt, invoke_open = self.fmt, self.invoke_open
        start = call_text.find(invoke_open)
        head, sep, body = call_text[start + len(invoke_open):].partition('">\n')
        try:
            if start < 0 or call_text[:start].strip() or not sep:
                raise fmt.ToolCallFormatError("not an invoke")
            name, arguments = fmt.parse_invoke(head, body[:-len(fmt.INVOKE_END)])
        except fmt.ToolCallFormatError:
            return [("content", call_text)]
        if self.parallel or not self.calls:
            self.calls += 1
            return [("tool_call", openai_call(name, arguments))]
        return []

    def flush(self) -> list[tuple[str, object]]:
        """The end of the answer: held text is content; so is a block's text that made no call: after the block,
        or a call never finished (cut short by max_tokens or a stop string: as written, the block's opening with
        it where no call came before, so that no text the model wrote is lost)."""
        if not self.in_block:
            held, self.held = self.held, ""
            return [("content", held)] if held else []
        unfinished, *after = self.call.text().split(self.fmt.TOOL_CALLS_END, 1)
        out = []
        if unfinished.strip():
            out.append(("content", (self.fmt.TOOL_CALLS_START.lstrip() if not self.any_done else "") + unfinished))
        if after and after[0].strip():
            out.append(("content", after[0]))
        return out


def _tagged_call(block: str) -> dict | None:
    """The OpenAI call of a `<tool_call>` block's text: JSON {"name": ..., "arguments": ...} (the arguments given
    back as JSON text); None where it is not one."""
    try:
        value = untrusted.loads(block, "a tool call")  # (the model's text: bounded in depth like every JSON read)
    except untrusted.UntrustedInputError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    return openai_call(value["name"], json.dumps(value.get("arguments", {}), ensure_ascii=False))


class _BlockEnd:
    """Where an open `<tool_call>` block's text ends: its first CALL_CLOSE outside the call's JSON strings (an
    argument may spell the tag: code, a prompt template). Fed the block's pieces, each read once: the block re-read
    whole at every piece had taken seconds of the event loop (quadratic in a long argument). `failed`: the states
    (distance from the text's end, and inside a string or not) that blocks read to the text's end without finding
    their end were in, where every piece fed ends where the text does (the answer's end: flush): a block in one of
    them will not find its end either (flush's blocks, each read to the end, had made it quadratic)."""

    def __init__(self, failed: set[int] | None = None):
        self.inside = self.escaped = False  # where the text read so far ends: inside a string, after its backslash
        self.recent = ""  # the last characters read outside a string, where a CALL_CLOSE may have begun
        self.failed = failed
        self.states: list[int] = []  # (with `failed`) this block's states, as `failed` holds them

    def feed(self, piece: str) -> int:
        """The index in `piece` just after the block's closing tag, -1 while none came."""
        inside, escaped, recent, at = self.inside, self.escaped, self.recent, 0
        quote = slash = -2  # inside a string: the next quote and backslash from `at` (-1: none; -2: not looked for)
        failed = self.failed
        while at < len(piece):
            if inside:  # (to the string's closing quote, its escapes skipped)
                if escaped:  # (the escaped character, whatever it is: a piece may end right after its backslash)
                    escaped, at = False, at + 1
                else:
                    if quote == -2 or 0 <= quote < at:  # (each found once: a rescan per escape was quadratic)
                        quote = piece.find('"', at)
                    if slash == -2 or 0 <= slash < at:
                        slash = piece.find("\\", at)
                    if quote < 0 and slash < 0:
                        break
                    if 0 <= slash < quote or quote < 0:
                        escaped, at = True, slash + 1
                    else:
                        inside, at = False, quote + 1
            else:
                next_quote = piece.find('"', at)
                stop = len(piece) if next_quote < 0 else next_quote
                text = recent + piece[at:stop]
                end = text.find(CALL_CLOSE)
                if end >= 0:
                    self.inside, self.escaped, self.recent = False, False, ""
                    return stop - len(text) + end + len(CALL_CLOSE)
                recent = text[max(len(text) - len(CALL_CLOSE) + 1, 0):] if next_quote < 0 else ""
                if next_quote < 0:
                    break
                inside, at = True, next_quote + 1
            if failed is not None:
                state = (len(piece) - at) * 3 + inside + escaped
                if state in failed:
                    break  # (its end will not come: the rest of the state is of no use)
                self.states.append(state)
        self.inside, self.escaped, self.recent = inside, escaped, recent
        return -1


class TaggedCallSplitter:
    """A chat template's answer, piece by piece, into ("content", text) and ("tool_call", call) events, as
    ToolCallSplitter does for a chat encoding's: each `<tool_call>` JSON `</tool_call>` block is a call once closed;
    one whose JSON does not parse (or names no function) is content as written, as vLLM's hermes parser leaves it.
    The whitespace around a call's block is its markup (the template writes a newline before each call), so a reply
    of calls alone has no content; where text comes both before and after calls, the whitespace after parts them.
    It is fed the answer after its thought (the server splits that off first: a call the model only thinks of is
    not made). `prefill`: the markup the prompt ended with (the answer goes on from it)."""

    def __init__(self, prefill: str = "", parallel: bool = True):
        self.held = ""  # content held back: whitespace and what may begin CALL_OPEN
        self.spaces = Pieces()  # whitespace after a held one, piece by piece (held too: joined once)
        self.space = ""  # the whitespace before the open block (content again if the block makes no call)
        self.block: Pieces | None = None  # the open block's text so far
        self.block_end = _BlockEnd()  # where it ends
        self.failed: set[int] | None = None  # while flushing: _BlockEnd's `failed`
        self.after_call = False  # the whitespace after a call's block is still its markup
        self.shown = False  # some content came out: the whitespace after a call then parts it from what follows
        self.calls = 0
        self.parallel = parallel
        if prefill:
            self.feed(prefill)

    def _content(self, text: str) -> list[tuple[str, object]]:
        if self.after_call:  # (text that goes on after a call keeps its whitespace, where text came before)
            stripped = text.lstrip()
            self.after_call = not stripped
            text = text if stripped and self.shown else stripped
        self.shown = self.shown or bool(text)
        return [("content", text)] if text else []

    def feed(self, piece: str) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        while True:
            if self.block is None:
                if not piece.strip() and not self.held.strip():  # (a run of whitespace: no text to split yet)
                    self.spaces.add(piece)
                    return out
                held, self.spaces = self.held + self.spaces.text(), Pieces()
                shown, self.held, after = text_before_marker(held + piece, CALL_OPEN, hold_space=True)
                if after is None:
                    return out + self._content(shown)
                content = shown.rstrip()
                out += self._content(content)
                self.space, self.block, piece = shown[len(content):], Pieces(), after
                self.block_end = _BlockEnd(self.failed)
            end = self.block_end.feed(piece)
            if end < 0:
                self.block.add(piece)
                return out
            self.block.add(piece[:end])
            block, piece, self.block = self.block.text()[:-len(CALL_CLOSE)], piece[end:], None
            call = _tagged_call(block)
            if call is None:
                out += self._content(self.space + CALL_OPEN + block + CALL_CLOSE)
                continue
            self.after_call = True
            if self.parallel or not self.calls:
                out.append(("tool_call", call))
                self.calls += 1

    def flush(self) -> list[tuple[str, object]]:
        """The end of the answer: held text is content; so is a block never closed (cut short by max_tokens or a
        stop string), as written. A block whose closing tags all came inside a string never ended (a quote left
        open): its first tag closes it, as written, and what follows is split again."""
        out: list[tuple[str, object]] = []
        # (a loop, not a call of itself per such block: thousands of them had ended in a RecursionError)
        self.failed = set()
        while self.block is not None and CALL_CLOSE in (written := self.block.text()):
            self.failed.update(self.block_end.states)  # (it read to the end: its states lead nowhere)
            block, rest = written.split(CALL_CLOSE, 1)
            self.block = None
            out += self._content(self.space + CALL_OPEN + block + CALL_CLOSE)
            out += self.feed(rest)
        self.failed = None
        if self.block is None:
            text, self.held, self.spaces = self.held + self.spaces.text(), "", Pieces()
        else:
            text, self.block = self.space + CALL_OPEN + self.block.text(), None
        return out + self._content(text)


def split_answer(text: str, plan: ToolPlan) -> tuple[str | None, list[dict]]:
    """(content, OpenAI tool_calls) of a whole answer; content None when there are calls and no text."""
    splitter = plan.splitter()
    events = splitter.feed(text) + splitter.flush()
    content = "".join(v for k, v in events if k == "content")
    calls = [v for k, v in events if k == "tool_call"]
    return (content or None) if calls else content, calls
