"""The prompt's tokenizer, loaded from the files the container carries (never from the network, never with
remote code)."""

from __future__ import annotations

import re

from moepack.format_spec import untrusted
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.reader import Container

MAX_TOKEN_IDS_BYTES = 256 << 20  # a million ids take under 8 MiB
MAX_PROMPT_BYTES = 256 << 20  # a prompt file: far beyond a million tokens of text
_ID_WORD = re.compile(r"[+-]?[0-9]{1,32}")  # an id of a whitespace-separated file (ranges are the engine's to check)


class PromptTokenizer:
    def __init__(self, container: Container):
        files = container.index["tokenizer"]
        entry = files.get("tokenizer.json")
        if not entry or entry.get("encoding") != "utf-8":
            raise MoepackError(f"{container.path} carries no tokenizer.json: pass the prompt as --token-ids")
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_str(entry["data"])
        except Exception as e:  # the tokenizers library raises its own exception types
            raise MoepackError(f"the container's tokenizer.json does not load: {e}") from None
        config = {}
        if files.get("tokenizer_config.json", {}).get("encoding") == "utf-8":
            try:
                config = untrusted.loads(files["tokenizer_config.json"]["data"], "tokenizer_config.json")
            except untrusted.UntrustedInputError:  # a damaged optional file: the default (a BOS) stands
                config = {}
        self.add_special_tokens = bool(config.get("add_bos_token", True)) if isinstance(config, dict) else True

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=self.add_special_tokens).ids

    def encode_special(self, text: str) -> list[int]:
        """Ids of text that spells out its own special tokens (a chat template's BOS, role tags): none added."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def _read_text(path: str, limit: int, what: str) -> str:
    """A regular file's UTF-8 text, at most `limit` bytes (a FIFO, a device refused by name); one line otherwise."""
    try:
        raw = untrusted.read_bounded(path, limit, missing=f"{path}: cannot read (no such file)")
    except OSError as e:
        raise MoepackError(f"{path}: cannot read ({e.strerror})") from None
    if len(raw) > limit:
        raise MoepackError(f"{path}: more than {limit} bytes of {what} (the limit)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MoepackError(f"{path}: not valid UTF-8 (byte {e.start}): expected {what}") from None


def read_prompt_file(path: str) -> str:
    """A prompt file's text (UTF-8); an empty one is refused (a prompt of BOS alone is nobody's intent)."""
    text = _read_text(path, MAX_PROMPT_BYTES, "the prompt")
    if not text:
        raise MoepackError(f"{path}: empty prompt")
    return text


def read_token_ids(path: str) -> list[int]:
    """Token ids from a file: a JSON array, or integers separated by whitespace or commas."""
    text = _read_text(path, MAX_TOKEN_IDS_BYTES, "token ids")
    if text.lstrip().startswith(("[", "{", '"')):  # JSON: bounded in depth and number length like every reader
        value = untrusted.loads(text, path, max_bytes=MAX_TOKEN_IDS_BYTES)
        ids = value if isinstance(value, list) else [value]
    else:  # one bare number is one token id; else whitespace- or comma-separated integers, each of a bounded length
        words = text.replace(",", " ").split()
        ids = [int(w) for w in words] if all(_ID_WORD.fullmatch(w) for w in words) else None
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise MoepackError(f"{path}: expected a non-empty list of integer token ids")
    return ids
