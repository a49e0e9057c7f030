"""A chat answer's thought, split off as `reasoning_content` (the server's chat completions, `moepack generate`'s
--json): how the thought is marked for a request (chat_thought: the family's chat encoding in thinking mode, or a
chat template that writes thoughts, ChatTemplate.opens_thought), and the split, streamed (ThinkSplitter; with the
answer's tool calls, AnswerSplitter) or whole (split_thinking)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moepack.runtime.sampling import IncrementalDetokenizer

from .chat_template import THOUGHT_CLOSE, THOUGHT_OPEN
from .tool_calls import Pieces, text_before_marker


@dataclass(frozen=True)
class ThoughtMarks:
    """How a chat answer's thought is marked: `end` closes it; `start` None, the prompt opened it (the answer starts
    inside it: a chat encoding's thinking mode, QwQ's template); else the answer may open one with `start`, at its
    start after whitespace (Qwen3's template)."""
    end: str
    start: str | None = None


class ThinkSplitter:
    """Splits streamed text at the end of its thought (`marks`: ThoughtMarks; None: the answer has none): (field,
    text) pairs, "reasoning_content" before the end and "content" after (all of it reasoning when the end never
    comes); where the answer may open a thought, its opening is dropped, and an answer that opens none is all
    content. A tail that may be the start of a marker is held back until the next piece says."""

    def __init__(self, marks: ThoughtMarks | None):
        self.marks = marks
        # True: in the thought; False: after it, or no thought; None: not yet known whether the answer opens one
        self.in_thought = None if marks is not None and marks.start is not None else marks is not None
        self.had_thought = bool(self.in_thought)  # the answer has a thought (its prompt opened it, or it opened one)
        self.held = ""
        self.spaces = Pieces()  # the whitespace the answer starts with while it may yet open a thought (held)

    def feed(self, piece: str) -> list[tuple[str, str]]:
        if self.in_thought is None and not piece.strip() and not self.held.strip():
            self.spaces.add(piece)  # (a run of whitespace: held as it comes, joined once)
            return []
        text, self.held, self.spaces = self.held + self.spaces.text() + piece, "", Pieces()
        if self.in_thought is None:
            lead = text.lstrip()
            if lead.startswith(self.marks.start):
                self.in_thought = self.had_thought = True
                text = lead[len(self.marks.start):]
            elif self.marks.start.startswith(lead):  # (still maybe: whitespace, "<th")
                self.held = text
                return []
            else:
                self.in_thought = False
        if not self.in_thought:
            return [("content", text)] if text else []
        shown, self.held, after = text_before_marker(text, self.marks.end)
        if after is not None:
            self.in_thought = False
        out = [("reasoning_content", shown), ("content", after or "")]
        return [(f, t) for f, t in out if t]

    def flush(self) -> list[tuple[str, str]]:
        held, self.held, self.spaces = self.held + self.spaces.text(), "", Pieces()
        return [("reasoning_content" if self.in_thought else "content", held)] if held else []


class AnswerSplitter:
    """A streamed chat answer's parts, in order: (field, value) pairs, "reasoning_content" and "content" text as
    ThinkSplitter splits it (`marks`), the content's tool calls (`plan`: serve/tool_calls.py's ToolPlan, whose
    splitter gives "tool_call" pairs, an OpenAI call each, and the content around them) where the plan parses
    them."""

    def __init__(self, marks: ThoughtMarks | None, plan: Any):
        self.thought = ThinkSplitter(marks)
        self.calls = plan.splitter() if plan.parse else None

    def _calls_of(self, parts: list[tuple[str, str]]) -> list[tuple[str, Any]]:
        if self.calls is None:
            return parts
        return [p for f, text in parts for p in ([(f, text)] if f != "content" else self.calls.feed(text))]

    def feed(self, piece: str) -> list[tuple[str, Any]]:
        return self._calls_of(self.thought.feed(piece))

    def flush(self) -> list[tuple[str, Any]]:
        return self._calls_of(self.thought.flush()) + (self.calls.flush() if self.calls is not None else [])


def split_thinking(text: str, marks: ThoughtMarks | None) -> tuple[str | None, str]:
    """(reasoning_content, content) of a whole answer (ThinkSplitter's split fed at once); reasoning None where the
    answer had no thought (`marks` None: it has none)."""
    splitter = ThinkSplitter(marks)
    parts = splitter.feed(text) + splitter.flush()
    reasoning = "".join(t for f, t in parts if f == "reasoning_content")
    content = "".join(t for f, t in parts if f == "content")
    return (reasoning if splitter.had_thought else None), content


def chat_thought(family: Any, template: Callable[[], Any], thinking: bool | None,
                 continued: bool = False) -> ThoughtMarks | None:
    """How the answer to a chat prompt encoded as `family`'s chat (serve/tokenizer.py chat_prompt_ids, with no
    forced tool call: its start closes the thought) marks its thought, None where it has none: a chat encoding's
    thinking mode opens it in the prompt; a chat template (`template()`) where it writes thoughts; an answer that
    goes on from the final assistant message's text (`continued`, after that message's thought) has none."""
    if continued:
        return None
    encoding = family.chat_encoding
    if encoding is not None:
        return ThoughtMarks(encoding.THINK_END) if thinking else None
    opened = template().opens_thought(thinking)
    return None if opened is None else ThoughtMarks(THOUGHT_CLOSE, None if opened else THOUGHT_OPEN)


def thought_tokens(tokenizer, result, thought: ThoughtMarks | None) -> int:
    """How many of the answer's tokens its thought took: those up to the one whose text ends it (its end marker
    included), all of them where it never ended, none where there was none."""
    text = result.text or ""
    reasoning, content = split_thinking(text, thought)
    if reasoning is None:
        return 0
    if not content and thought.end not in text:
        return len(result.generated_ids)
    cut, written = len(text) - len(content), 0
    pieces = IncrementalDetokenizer(tokenizer.decode)
    for count, token in enumerate(result.generated_ids, 1):
        written += len(pieces.add(token))
        if written >= cut:
            return count
    return len(result.generated_ids)
