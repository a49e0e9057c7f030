"""The streamed tool-call splitters (serve/tool_calls.py): any split of an answer into pieces gives the events of
the whole answer, and a long call is read once, piece by piece (the splitters run on the server's event loop)."""

from __future__ import annotations

import json
import time
import types

from hypothesis import given, settings
from hypothesis import strategies as st

from moepack.families.deepseek_v4 import tools as dsml
from moepack.serve import tool_calls
from moepack.serve.reasoning import ThinkSplitter, ThoughtMarks
from moepack.serve.tool_calls import CALL_CLOSE, CALL_OPEN, TaggedCallSplitter, ToolCallSplitter

ENCODING = types.SimpleNamespace(tool_format=dsml, THINK_END="</think>")


def _dsml_call(name: str, arguments: str) -> str:
    return "".join(text for text, _ in dsml.invoke_parts(name, arguments))


DSML_BLOCKS = [_dsml_call("get_weather", '{"city": "Paris", "days": 3}'), _dsml_call("f", "{}"),
               _dsml_call("write", '{"text": "a </｜DSML｜invoke> inside"}'),
               f'<{dsml.DSML}invoke name="broken">\ngarbage\n{dsml.INVOKE_END}', "\n", dsml.TOOL_CALLS_END, "after"]
TAGGED_BLOCKS = [f'{CALL_OPEN}\n{{"name": "search", "arguments": {{"q": "x"}}}}\n{CALL_CLOSE}',
                 f'{CALL_OPEN}\n{{"name": "w", "arguments": {{"t": "a \\"{CALL_CLOSE}\\" \\\\"}}}}\n{CALL_CLOSE}',
                 # (an escape of a plain character: a piece that ends after its backslash, the next one holding
                 # no quote or backslash, had left the escape pending past that character: the call lost)
                 f'{CALL_OPEN}\n{{"name": "nl", "arguments": {{"t": "a\\nb"}}}}\n{CALL_CLOSE}',
                 f'{CALL_OPEN}\nnot json\n{CALL_CLOSE}', f'{CALL_OPEN}\n{{"name": "open", "arguments": {{"x": "',
                 "\n", "text <tool", " more "]


def _events(splitter, pieces: list[str]) -> tuple[str, list]:
    events = [e for piece in pieces for e in splitter.feed(piece)] + splitter.flush()
    calls = [(v["function"]["name"], v["function"]["arguments"]) for k, v in events if k == "tool_call"]
    return "".join(v for k, v in events if k == "content"), calls


def _pieces(data, text: str) -> list[str]:
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=min(len(text), 40))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)]) if a < b]


@settings(max_examples=150, deadline=None)
@given(data=st.data(), lead=st.text(max_size=12), blocks=st.lists(st.sampled_from(DSML_BLOCKS), max_size=5))
def test_a_chat_encodings_calls_split_alike_in_any_pieces(data, lead, blocks):
    answer = lead + dsml.TOOL_CALLS_START + "\n" + "".join(blocks) if blocks else lead
    assert _events(ToolCallSplitter(ENCODING), _pieces(data, answer)) == _events(ToolCallSplitter(ENCODING),
                                                                                  [answer])


@settings(max_examples=150, deadline=None)
@given(data=st.data(), lead=st.text(max_size=12), blocks=st.lists(st.sampled_from(TAGGED_BLOCKS), max_size=5))
def test_a_templates_calls_split_alike_in_any_pieces(data, lead, blocks):
    answer = lead + "".join(blocks)
    assert _events(TaggedCallSplitter(), _pieces(data, answer)) == _events(TaggedCallSplitter(), [answer])


def test_every_piece_size_and_offset_splits_alike():
    """Pieces of every size up to two markers' length, at every offset: each marker split at every place."""
    cases = [(lambda: ToolCallSplitter(ENCODING), "Hi" + dsml.TOOL_CALLS_START + "\n" + "".join(DSML_BLOCKS)),
             (TaggedCallSplitter, "Hi\n" + "".join(TAGGED_BLOCKS))]
    for make, answer in cases:
        whole = _events(make(), [answer])
        for size in range(1, 2 * len(dsml.INVOKE_END) + 1):
            for first in range(1, size + 1):
                pieces = [answer[:first]] + [answer[i:i + size] for i in range(first, len(answer), size)]
                assert _events(make(), pieces) == whole, (size, first)


def test_a_long_call_is_read_once_piece_by_piece(monkeypatch):
    """20,000 pieces of one call's argument: each piece is read once (the tagged block's end found as it comes, a
    DSML invoke's end searched in the piece and the few characters before it) and the call's text joined once, at
    its end; the pieces had been appended to a str (copied whole at each) and searched again from the start."""
    joins, read = [], []
    text = tool_calls.Pieces.text
    monkeypatch.setattr(tool_calls.Pieces, "text", lambda self: joins.append(len(self.parts)) or text(self))
    feed = tool_calls._BlockEnd.feed
    monkeypatch.setattr(tool_calls._BlockEnd, "feed", lambda self, piece: read.append(len(piece)) or feed(self, piece))
    tagged = TaggedCallSplitter()
    head = f'{CALL_OPEN}\n{{"name": "write", "arguments": {{"code": "'
    assert tagged.feed(head) == []
    for _ in range(20_000):
        assert tagged.feed('ab\\"') == []
    events = tagged.feed(f'"}}}}\n{CALL_CLOSE}')
    assert [k for k, _ in events] == ["tool_call"] and [n for n in joins if n > 1] == [20_002]
    assert sum(read) == len(head) - len(CALL_OPEN) + 20_000 * 4 + len(f'"}}}}\n{CALL_CLOSE}')

    joins.clear()
    splitter = ToolCallSplitter(ENCODING)
    whole = _dsml_call("write", '{"code": "' + "ab" * 20_000 + '"}')
    assert splitter.feed(dsml.TOOL_CALLS_START + "\n" + whole[:50]) == []
    for i in range(50, len(whole) - 1, 2):  # (all but the last character, two at a time)
        assert splitter.feed(whole[i:min(i + 2, len(whole) - 1)]) == []
        assert len(splitter.tail) < len(dsml.INVOKE_END)  # (the window searched: a piece and this tail)
    assert [k for k, _ in splitter.feed(whole[-1])] == ["tool_call"]
    assert len([n for n in joins if n > 1]) == 1 and max(joins) > 20_000



class _Scanned(str):
    """A piece whose searches count the characters they read (into `read`)."""
    read = [0]

    def find(self, sub, start=0, *args):
        at = str.find(self, sub, start, *args)
        self.read[0] += (at if at >= 0 else len(self)) - start
        return at


def test_a_blocks_end_is_searched_in_time_linear_in_the_answer(monkeypatch):
    """The characters _BlockEnd reads grow linearly with the answer: a whole answer's long argument full of escapes
    (a non-streamed answer is split whole: the next quote had been searched for again after every escape), and at
    the answer's end thousands of blocks whose quote never closes, each split at its first closing tag and the rest
    read again (each had been read to the end: quadratic, and the flush had called itself once per block, a
    RecursionError past ~500)."""
    feed = tool_calls._BlockEnd.feed
    monkeypatch.setattr(tool_calls._BlockEnd, "feed", lambda self, piece: feed(self, _Scanned(piece)))
    unit = f'{CALL_OPEN}\\"{CALL_CLOSE}'  # (its quote escaped: the string opened before it never closes)
    for n in (1_000, 4_000):
        _Scanned.read[0] = 0
        argument = "x = 1;\\n" * n
        call = f'{CALL_OPEN}\n{{"name": "write", "arguments": {{"code": "{argument}"}}}}\n{CALL_CLOSE}'
        content, calls = _events(TaggedCallSplitter(), [call])
        assert calls == [("write", json.dumps({"code": "x = 1;\n" * n}))] and _Scanned.read[0] < 3 * len(call)
        _Scanned.read[0] = 0
        unclosed = f'{CALL_OPEN}"{CALL_CLOSE}' + unit * n
        content, calls = _events(TaggedCallSplitter(), [unclosed[:40], unclosed[40:]])
        assert content == unclosed and not calls and _Scanned.read[0] < 10 * len(unclosed)


def test_an_invoke_of_many_parameters_is_parsed_in_time_linear_in_it():
    """A DSML invoke whose parameters never close (a model looping on `<｜DSML｜parameter ...>`) is content as
    written, at once: the parameters' regex (lazy name and value) had tried every name's end against a search to
    the end, cubic in them (600: ~13 s of the event loop; a timing bound, generous: here a few ms); and many closed
    parameters are read as the regex read them."""
    opening = f'<{dsml.DSML}invoke name="f">\n'
    unclosed = opening + f'<{dsml.DSML}parameter name="a" string="true">x' * 600 + dsml.INVOKE_END
    started = time.perf_counter()
    content, calls = _events(ToolCallSplitter(ENCODING), [dsml.TOOL_CALLS_START + "\n" + unclosed])
    assert content.endswith(unclosed) and not calls
    assert time.perf_counter() - started < 1.0
    closed = "".join(f'<{dsml.DSML}parameter name="k{i}" string="false">{i}</{dsml.DSML}parameter>\n'
                     for i in range(2000))
    assert dsml.parse_invoke("f", closed) == ("f", json.dumps({f"k{i}": i for i in range(2000)}))

THOUGHTS = ["   \n", "<think>", "let me see", "</think>", "\n\nAnswer", "<th", "  "]


@settings(max_examples=150, deadline=None)
@given(data=st.data(), parts=st.lists(st.sampled_from(THOUGHTS), max_size=6))
def test_a_thought_splits_alike_in_any_pieces(data, parts):
    answer = "".join(parts)

    def events(pieces):
        splitter = ThinkSplitter(ThoughtMarks("</think>", "<think>"))
        return [e for p in pieces for e in splitter.feed(p)] + splitter.flush(), splitter.had_thought

    def joined(got):
        parts, had = got
        return ("".join(t for f, t in parts if f == "reasoning_content"),
                "".join(t for f, t in parts if f == "content"), had)
    assert joined(events(_pieces(data, answer) if answer else [])) == joined(events([answer] if answer else []))


def test_a_run_of_whitespace_is_held_as_it_comes_and_joined_once(monkeypatch):
    """A model's run of 20,000 newlines, where whitespace is held back (before a possible `<tool_call>`, or at an
    answer's start before a possible `<think>`): no piece copies what came before it (the held text had been grown
    and re-read at each: quadratic, on the event loop), and the text comes out whole once something else comes."""
    joins = []
    text = tool_calls.Pieces.text
    monkeypatch.setattr(tool_calls.Pieces, "text", lambda self: joins.append(len(self.parts)) or text(self))
    for splitter, field in ((TaggedCallSplitter(), "content"),
                            (ThinkSplitter(ThoughtMarks("</think>", "<think>")), "content")):
        joins.clear()
        assert all(splitter.feed("\n") == [] for _ in range(20_000)) and not joins
        events = splitter.feed("x") + splitter.flush()
        assert "".join(t for f, t in events if f == field) == "\n" * 20_000 + "x"
        assert joins[0] == 20_000
