"""One validation layer for untrusted JSON and numbers (config.json, index files, safetensors headers,
--messages, --token-ids, argv, request bodies, the bench cache).

Python's json module takes any nesting (until a RecursionError, or a C stack far deeper), integers of
thousands of digits (a ValueError past 4300, and quadratic work up to it), the constants NaN and Infinity,
and lone surrogates in strings. Each of these reaches code far from the reader as a traceback, a hang or a
silent NaN. `loads` refuses them all up front, in one line that names what was being read.

No imports beyond the standard library: the CLI and the server use this without loading torch.
"""

from __future__ import annotations

import json
import math
import re

from .errors import MoepackError

MAX_JSON_DEPTH = 64  # the deepest real file (a tokenizer.json, a chat with tool calls) nests under 20
MAX_NUMBER_CHARS = 64  # a float64 or int64 needs at most about 25; a longer literal is an attack or damage
DEFAULT_MAX_BYTES = 64 << 20


class UntrustedInputError(MoepackError, ValueError):
    """Input from outside (a file, a request, argv) that fails a bound: the message names what and why."""


# a JSON string (its escapes included) or one bracket: strings are skipped whole, brackets counted
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.DOTALL)


def nesting_depth(text: str, limit: int) -> int:
    """The deepest bracket nesting of a JSON text, outside strings; stops once past `limit`. Linear in the
    text and free of recursion, so it is safe before json.loads sees the text."""
    depth = deepest = 0
    for m in _TOKEN.finditer(text):
        c = m.group()[0]
        if c in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        elif c in "]}":
            depth -= 1
    return deepest


def _constant(name: str):
    raise UntrustedInputError(f"{name} is not a JSON number (NaN and Infinity are refused)")


def _parse_int(literal: str) -> int:
    if len(literal) > MAX_NUMBER_CHARS:
        raise UntrustedInputError(f"a number of {len(literal)} digits (at most {MAX_NUMBER_CHARS})")
    return int(literal)


def _parse_float(literal: str) -> float:
    if len(literal) > MAX_NUMBER_CHARS:
        raise UntrustedInputError(f"a number of {len(literal)} characters (at most {MAX_NUMBER_CHARS})")
    value = float(literal)
    if not math.isfinite(value):
        raise UntrustedInputError(f"the number {literal[:24]} overflows a float64")
    return value


def _check_strings(value) -> None:
    """No lone surrogate (JSON's \\udXXX escapes can make one): it cannot be encoded as UTF-8 anywhere later."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise UntrustedInputError("a string holds a lone surrogate (not valid Unicode)") from None
        elif isinstance(v, dict):
            for k, item in v.items():
                stack.append(k)
                stack.append(item)
        elif isinstance(v, list):
            stack.extend(v)


def loads(data: str | bytes | bytearray, what: str, *, max_bytes: int = DEFAULT_MAX_BYTES,
          max_depth: int = MAX_JSON_DEPTH):
    """Parse untrusted JSON. Refused in one line naming `what`: over `max_bytes`, not UTF-8, nested deeper
    than `max_depth`, a number literal over MAX_NUMBER_CHARS or not finite, a lone surrogate, bad JSON."""
    if len(data) > max_bytes:
        raise UntrustedInputError(f"{what}: {len(data)} bytes, over the limit of {max_bytes}")
    if isinstance(data, (bytes, bytearray)):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise UntrustedInputError(f"{what}: not valid UTF-8 (byte {e.start})") from None
    else:
        text = data
    depth = nesting_depth(text, max_depth)
    if depth > max_depth:
        raise UntrustedInputError(f"{what}: JSON nested more than {max_depth} deep")
    try:
        value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_constant)
    except UntrustedInputError as e:
        raise UntrustedInputError(f"{what}: {e}") from None
    except (ValueError, RecursionError) as e:
        raise UntrustedInputError(f"{what}: not valid JSON ({str(e).splitlines()[0] if str(e) else 'bad'})") from None
    try:
        _check_strings(value)
    except UntrustedInputError as e:
        raise UntrustedInputError(f"{what}: {e}") from None
    return value


def load_file(path, what: str | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES,
              max_depth: int = MAX_JSON_DEPTH):
    """`loads` over a regular file's bytes, read at most max_bytes + 1 (a FIFO or /dev/zero is refused by
    format_spec.files.open_regular, not read)."""
    from .files import open_regular

    name = what or str(path)
    with open_regular(path) as f:
        data = f.read(max_bytes + 1)
    return loads(data, name, max_bytes=max_bytes, max_depth=max_depth)


def finite_float(value, name: str, *, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False) -> float:
    """A finite float within [lo, hi] (or (lo, hi] with lo_open); bools and strings refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UntrustedInputError(f"{name}: expected a number, got {type(value).__name__}")
    try:
        v = float(value)
    except OverflowError:
        raise UntrustedInputError(f"{name}: the number is too large") from None
    if not math.isfinite(v):
        raise UntrustedInputError(f"{name}: must be a finite number, got {v}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise UntrustedInputError(f"{name}: must be {'>' if lo_open else '>='} {lo}, got {v:g}")
    if hi is not None and v > hi:
        raise UntrustedInputError(f"{name}: must be <= {hi}, got {v:g}")
    return v


def int_in_range(value, name: str, lo: int, hi: int) -> int:
    """An integer (not a bool, not a float) within [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise UntrustedInputError(f"{name}: expected an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise UntrustedInputError(f"{name}: must be between {lo} and {hi}, got {_short(value)}")
    return value


def valid_text(value: str, name: str) -> str:
    """A str that is valid Unicode (argv and JSON can carry lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise UntrustedInputError(f"{name}: holds a lone surrogate or undecodable bytes (not valid UTF-8)") from None
    return value


def _short(value: int) -> str:
    text = str(value) if abs(value) < 10 ** 30 else f"a {len(str(abs(value)))}-digit number"
    return text
