"""format_spec/untrusted.py: every bound refused in one line naming what was read (and the field), valid JSON
parsed exactly as json.loads parses it."""

from __future__ import annotations

import json
import math
import os
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moepack.format_spec.errors import MoepackError
from moepack.format_spec.untrusted import (MAX_JSON_DEPTH, MAX_NUMBER_CHARS, UntrustedInputError, finite_float,
                                           int_in_range, load_file, loads, nesting_depth, read_bounded, valid_text)


def _refused(data, match: str, **kwargs) -> str:
    with pytest.raises(UntrustedInputError) as info:
        loads(data, "the.json", **kwargs)
    message = str(info.value)
    assert message.startswith("the.json: ") and "\n" not in message and match in message, message
    assert isinstance(info.value, MoepackError) and isinstance(info.value, ValueError)
    return message


@pytest.mark.parametrize("opener", ["[", "{\"a\":"])
def test_nesting_of_100000_is_refused_at_once(opener):
    text = opener * 100_000 + "1" + ("]" if opener == "[" else "}") * 100_000
    started = time.monotonic()
    _refused(text, f"nested more than {MAX_JSON_DEPTH} deep")
    assert time.monotonic() - started < 2
    loads("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH, "ok")  # the bound itself is allowed
    _refused("[" * 5 + "]" * 5, "nested more than 4 deep", max_depth=4)


def test_brackets_inside_strings_are_no_nesting():
    text = json.dumps({"s": "[" * 1000 + "{" * 1000, "q": 'a \\" [ "', "t": "\\"})
    assert nesting_depth(text, 64) == 1
    assert loads(text, "x") == json.loads(text)


def test_a_number_of_5000_digits_is_refused_naming_the_field():
    message = _refused('{"hidden_size": ' + "9" * 5000 + "}", f"hidden_size: a number of 5000 digits (at most "
                                                               f"{MAX_NUMBER_CHARS})")
    assert "9999" not in message
    _refused("[0." + "1" * 5000 + "]", "[0]: a number of 5002 characters")
    assert loads("9" * MAX_NUMBER_CHARS, "x") == int("9" * MAX_NUMBER_CHARS)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_refused_naming_the_field(literal):
    _refused('{"rope": {"eps": ' + literal + "}}", f"rope.eps: {literal} is not a JSON number")


@pytest.mark.parametrize("literal", ["1e999", "-1e999", "1e309"])
def test_a_float_that_overflows_is_refused(literal):
    _refused(f"[1, {literal}]", f"[1]: the number {literal} overflows a float64")


def test_lone_surrogates_are_refused_in_values_and_keys():
    _refused('{"messages": [{"content": "ok"}, {"content": "x\\ud800y"}]}',
             "messages[1].content: a string holds a lone surrogate")
    _refused('{"\\udc00": 1}', "a key holds a lone surrogate")
    _refused('"\\udfff"', "a string holds a lone surrogate")
    assert loads('"\\ud83d\\ude00"', "pair") == "\U0001f600"  # a surrogate pair is one valid character


def test_a_key_with_a_control_character_is_named_escaped_on_one_line():
    """The path to a refused value names its keys; a newline or another control character in a key is escaped, so
    the error stays one line (a fuzzed request body found it)."""
    message = _refused('{"messages": {"\\n": "\\ud800"}}', "a string holds a lone surrogate")
    assert "messages.b'\\n'" in message
    assert _refused('{"caf\u00e9": "\\ud800"}', "caf\u00e9: a string holds")  # a printable key as written


def test_unique_keys_refuses_a_key_given_twice_naming_it():
    text = '{"a": 1, "m": [{"b": 1, "c": 2, "b": 3}]}'
    assert loads(text, "x") == {"a": 1, "m": [{"b": 3, "c": 2}]}  # json's reading by default: the last one
    _refused(text, "m[0].b: given twice in one object", unique_keys=True)
    assert loads('{"a": {"a": 1}, "b": [{"a": 2}, {"a": 3}]}', "x", unique_keys=True)["b"][1] == {"a": 3}


def test_invalid_utf8_is_refused_naming_the_byte():
    _refused(b'{"a": "\xff"}', "not valid UTF-8 (byte 7)")
    _refused(bytearray(b"\xc3"), "not valid UTF-8 (byte 0)")


def test_the_size_bound():
    _refused(b"[" + b"1," * 100 + b"1]", "203 bytes, over the limit of 100", max_bytes=100)
    assert loads(b"[1]", "x", max_bytes=3) == [1]


@pytest.mark.parametrize("text", ["", "{", "[1,]", "{'a': 1}", "01", "[1] x"])
def test_bad_json_is_one_line(text):
    _refused(text, "not valid JSON")


def test_the_detail_is_the_message_without_the_name():
    with pytest.raises(UntrustedInputError) as info:
        loads('{"a": NaN}', "config.json")
    assert info.value.detail == "a: NaN is not a JSON number (NaN and Infinity are refused)"


def test_valid_json_round_trips():
    value = {"name": 'quote " and \\ backslash', "brackets": "[{]}", "nested": [[{"a": [1, 2.5, -3e-7]}]],
             "unicode": "héllo ✓ \U0001f600", "none": None, "flags": [True, False], "big": 2 ** 63 - 1,
             "tiny": 5e-324, "huge": 1.7976931348623157e308}
    text = json.dumps(value)
    assert loads(text, "x") == value
    assert loads(text.encode(), "x") == value
    assert loads(json.dumps(value, ensure_ascii=False).encode("utf-8"), "x") == value


json_scalars = (st.none() | st.booleans() | st.integers(-(10 ** 40), 10 ** 40)
                | st.floats(allow_nan=False, allow_infinity=False)
                | st.text(st.characters(blacklist_categories=("Cs",)), max_size=20))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(st.characters(blacklist_categories=("Cs",)), max_size=8), inner,
                                             max_size=4), max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(value=json_values, ascii_only=st.booleans())
def test_loads_equals_json_loads_on_valid_shallow_json(value, ascii_only):
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert loads(text, "x") == json.loads(text)
    assert loads(text.encode("utf-8"), "x") == json.loads(text)


def test_load_file_refuses_what_is_not_a_regular_file_and_bounds_the_read(tmp_path):
    started = time.monotonic()
    with pytest.raises(MoepackError, match="/dev/zero: not a regular file"):
        load_file("/dev/zero")
    link = tmp_path / "manifest.json"
    os.symlink("/dev/zero", link)
    with pytest.raises(MoepackError, match="not a regular file"):
        load_file(link, "manifest.json")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(MoepackError, match="a FIFO or pipe"):
        load_file(fifo)
    assert time.monotonic() - started < 2
    big = tmp_path / "big.json"
    big.write_bytes(b"[" + b"0," * 1000 + b"0]")
    assert len(read_bounded(big, 10)) == 11
    with pytest.raises(UntrustedInputError, match=r"big.json: more than 100 bytes \(the limit\)"):
        load_file(big, "big.json", max_bytes=100)
    assert load_file(big)[:2] == [0, 0]


def test_finite_float():
    assert finite_float(1, "--top-p") == 1.0
    assert finite_float(0.5, "x", lo=0, hi=1) == 0.5
    for bad, match in [(math.nan, "finite"), (math.inf, "finite"), (True, "expected a number"),
                       ("1", "expected a number"), (10 ** 400, "too large"), (-1, ">= 0"), (2, "<= 1")]:
        with pytest.raises(UntrustedInputError, match=match):
            finite_float(bad, "x", lo=0, hi=1)
    with pytest.raises(UntrustedInputError, match="> 0"):
        finite_float(0, "x", lo=0, lo_open=True)


def test_int_in_range_and_valid_text():
    assert int_in_range(3, "n", 0, 5) == 3
    for bad in (True, 1.0, "1", -1, 6):
        with pytest.raises(UntrustedInputError):
            int_in_range(bad, "n", 0, 5)
    with pytest.raises(UntrustedInputError, match="a 401-digit number"):
        int_in_range(10 ** 400, "n", 0, 5)
    assert valid_text("fine ✓", "--prompt") == "fine ✓"
    with pytest.raises(UntrustedInputError, match="--prompt: holds a lone surrogate"):
        valid_text("a\udc80b", "--prompt")
