"""The prompt's tokenizer, loaded from the files the container carries (never from the network, never with
remote code)."""

from __future__ import annotations

import json

from moepack.format_spec.errors import MoepackError
from moepack.format_spec.files import check_regular
from moepack.format_spec.reader import Container


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
                config = json.loads(files["tokenizer_config.json"]["data"])
            except json.JSONDecodeError:
                config = {}
        self.add_special_tokens = bool(config.get("add_bos_token", True))

    def encode(self, text: str) -> list[int]:
        return self._ids(text, self.add_special_tokens)

    def encode_special(self, text: str) -> list[int]:
        """Ids of text that spells out its own special tokens (a chat template's BOS, role tags): none added."""
        return self._ids(text, False)

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        # the batch call lets go of the GIL while it works (encode() holds it: a server's event loop would stall
        # for the whole of a long prompt)
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def read_prompt_file(path: str) -> str:
    """A prompt file's text (UTF-8); an empty one is refused (a prompt of BOS alone is nobody's intent)."""
    check_regular(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise MoepackError(f"{path}: cannot read the prompt ({e})") from None
    if not text:
        raise MoepackError(f"{path}: empty prompt")
    return text


def read_token_ids(path: str) -> list[int]:
    """Token ids from a file: a JSON array, or integers separated by whitespace or commas."""
    check_regular(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise MoepackError(f"{path}: cannot read ({e.strerror})") from None
    try:
        value = json.loads(text)
        ids = value if isinstance(value, list) else [value]  # one bare number is one token id
    except json.JSONDecodeError:
        try:
            ids = [int(tok) for tok in text.replace(",", " ").split()]
        except ValueError:
            ids = None
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise MoepackError(f"{path}: expected a non-empty list of integer token ids")
    return ids
