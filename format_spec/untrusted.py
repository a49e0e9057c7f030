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
import os
import re

from .errors import MoepackError, error_reason

MAX_JSON_DEPTH = 64  # the deepest real file (a tokenizer.json, a chat with tool calls) nests under 20
MAX_NUMBER_CHARS = 64  # a float64 or int64 needs at most about 25; a longer literal is an attack or damage
DEFAULT_MAX_BYTES = 64 << 20


class UntrustedInputError(MoepackError, ValueError):
    """Input from outside (a file, a request, argv) that fails a bound: the message names what and why.
    `detail`: the message without the leading name of what was read (for callers that word their own)."""

    def __init__(self, message: str, detail: str | None = None):
        super().__init__(message)
        self.detail = message if detail is None else detail


def _refuse(what: str, detail: str) -> UntrustedInputError:
    return UntrustedInputError(f"{what}: {detail}", detail)


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


class _Refused:
    """What the parser leaves where a number it must not trust stood; the walk after it names the place."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


def _parse_constant(name: str) -> _Refused:
    return _Refused(f"{name} is not a JSON number (NaN and Infinity are refused)")


def _parse_int(literal: str):
    if len(literal) > MAX_NUMBER_CHARS:
        return _Refused(f"a number of {len(literal)} digits (at most {MAX_NUMBER_CHARS})")
    return int(literal)


def _parse_float(literal: str):
    if len(literal) > MAX_NUMBER_CHARS:
        return _Refused(f"a number of {len(literal)} characters (at most {MAX_NUMBER_CHARS})")
    value = float(literal)
    if not math.isfinite(value):
        return _Refused(f"the number {literal[:24]} overflows a float64")
    return value


def _unique_keys(pairs: list) -> dict:
    """An object whose keys are each given once; a key given again holds a _Refused (parsers disagree on which of
    the two counts: the first, the last, or an error)."""
    out = {}
    for key, value in pairs:
        out[key] = _Refused("given twice in one object") if key in out else value
    return out


def _lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _where(path: tuple) -> str:
    """A JSON path as a reader names a field: `rope_scaling.factor`, `messages[3].content`."""
    out = ""
    for step in path:
        if isinstance(step, int):
            out += f"[{step}]"
        else:
            # a key as written, unless long or not printable (a newline in it would split the one-line error)
            key = step if len(step) <= 40 and step.isprintable() else repr(step[:40].encode("utf-8", "replace"))
            out += f".{key}" if out else key
    return out


def _first_problem(value) -> tuple[tuple, str] | None:
    """(path, reason) of the first refused number or string with a lone surrogate (JSON's \\udXXX escapes can make
    one: it cannot be encoded as UTF-8 anywhere later), in document order; None when there is none. No recursion."""
    stack = [((), value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, _Refused):
            return path, v.reason
        if isinstance(v, str):
            if _lone_surrogate(v):
                return path, "a string holds a lone surrogate (not valid Unicode)"
        elif isinstance(v, dict):
            for k in v:
                if _lone_surrogate(k):
                    return path, "a key holds a lone surrogate (not valid Unicode)"
            stack.extend(((*path, k), item) for k, item in reversed(v.items()))
        elif isinstance(v, list):
            stack.extend(((*path, i), item) for i, item in reversed(list(enumerate(v))))
    return None


def loads(data: str | bytes | bytearray, what: str, *, max_bytes: int = DEFAULT_MAX_BYTES,
          max_depth: int = MAX_JSON_DEPTH, unique_keys: bool = False):
    """Parse untrusted JSON. Refused in one line naming `what` (and the field, where one is to blame): over
    `max_bytes`, not UTF-8, nested deeper than `max_depth`, a number literal over MAX_NUMBER_CHARS or not finite,
    a lone surrogate, bad JSON; with `unique_keys`, a key given twice in one object."""
    if len(data) > max_bytes:
        raise _refuse(what, f"{len(data)} bytes, over the limit of {max_bytes}")
    if isinstance(data, (bytes, bytearray)):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise _refuse(what, f"not valid UTF-8 (byte {e.start})") from None
    else:
        text = data
    depth = nesting_depth(text, max_depth)
    if depth > max_depth:
        raise _refuse(what, f"JSON nested more than {max_depth} deep")
    try:
        value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant,
                           object_pairs_hook=_unique_keys if unique_keys else None)
    except (ValueError, RecursionError) as e:
        raise _refuse(what, f"not valid JSON ({str(e).splitlines()[0] if str(e) else 'bad'})") from None
    problem = _first_problem(value)
    if problem is not None:
        path, reason = problem
        raise _refuse(what, f"{_where(path)}: {reason}" if path else reason)
    return value


def load_file(path, what: str | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES,
              max_depth: int = MAX_JSON_DEPTH, unique_keys: bool = False):
    """`loads` over a regular file's bytes, read at most max_bytes + 1 (a FIFO or /dev/zero is refused by
    format_spec.files.open_regular, not read); a leading UTF-8 byte-order mark (an editor's) is no JSON error."""
    name = what or str(path)
    data = read_bounded(path, max_bytes)
    if len(data) > max_bytes:
        raise _refuse(name, f"more than {max_bytes} bytes (the limit)")
    return loads(data.removeprefix(b"\xef\xbb\xbf"), name, max_bytes=max_bytes, max_depth=max_depth,
                 unique_keys=unique_keys)


def read_bounded(path, max_bytes: int, missing: str | None = None) -> bytes:
    """A regular file's bytes, at most max_bytes + 1 of them (one more than the limit, so the caller can tell an
    oversized file): a FIFO, a device (/dev/zero) or a directory is refused by name, never read (FormatError)."""
    from .files import open_regular

    with os.fdopen(open_regular(os.fspath(path), missing), "rb") as f:
        # sized by the file too: a read of n bytes allocates n up front, however short the file
        return f.read(min(max_bytes, os.fstat(f.fileno()).st_size) + 1)


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
    if _lone_surrogate(value):
        raise UntrustedInputError(f"{name}: holds a lone surrogate or undecodable bytes (not valid UTF-8)")
    return value


def _short(value: int) -> str:
    return str(value) if abs(value) < 10 ** 30 else f"a {len(str(abs(value)))}-digit number"


def load_tokenizer(data: str | bytes, what: str):
    """A tokenizer.json as the tokenizers library's Tokenizer; one line naming `what` where it does not load (bad
    UTF-8, bad JSON, a model the library does not know: its own exception types, their reason's first line)."""
    from tokenizers import Tokenizer

    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
        return Tokenizer.from_str(text)
    except Exception as e:  # the tokenizers library raises its own exception types
        raise _refuse(what, f"not a tokenizer.json the tokenizers library loads ({error_reason(e)})") from None
