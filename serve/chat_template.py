"""A model family's chat encoding: the Jinja chat template its tokenizer_config carries (ModelFamily.chat_template;
else the checkpoint's chat_template.jinja), rendered as transformers' apply_chat_template renders it (a sandboxed
environment, trim_blocks and lstrip_blocks, its `tojson`, `raise_exception` and `strftime_now`, the tokenizer's
special tokens as variables). DeepSeek-V4 keeps its own encoder (families/deepseek_v4/chat.py).

The rendered text spells out the template's markup, so it is tokenized with its special tokens and nothing added
(PromptTokenizer.encode_special), as apply_chat_template(tokenize=True) does: the ids are transformers'. Only a
message string that spells out a special token's text differs: it is rendered as a placeholder and tokenized as
plain text (PromptTokenizer.shield_messages, encode_rendered), so no message forges a turn.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from moepack.format_spec.errors import MoepackError
from moepack.format_spec.reader import Container

TEMPLATE_FILE = "chat_template.jinja"  # where newer checkpoints keep the template instead of tokenizer_config.json
# tokenizer_config.json's special tokens a template may name (transformers passes them as variables)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class NoChatTemplateError(MoepackError):
    """The container's model carries no chat template."""


# A template is the checkpoint's code, run on every chat request: its time, its text and what one operator of its
# builds are bounded, so that a damaged or hostile one is a one-line refusal, never a server that hangs (jinja
# would fold `7**(7**9)` while compiling, in C, holding the GIL) or fills the memory (`'A' * 10**9`).
RENDER_SECONDS = 5.0
MAX_RENDERED_CHARS = 64 << 20
MAX_REPEATED_ITEMS = 1 << 20  # a string or list that `*` builds
MAX_POWER_BITS = 4096  # an integer that `**` builds


class TemplateLimitError(Exception):
    """A chat template went past one of the bounds above."""


def _bounded_binop(operator: str, left: Any, right: Any) -> None:
    """TemplateLimitError for `left operator right` building past the bounds (checked before it is computed)."""
    if operator == "**" and type(left) is int and type(right) is int and right > 0 and abs(left) > 1:
        if right * abs(left).bit_length() > MAX_POWER_BITS:
            raise TemplateLimitError(f"{operator} builds an integer of more than {MAX_POWER_BITS} bits")
    if operator == "*":
        for items, times in ((left, right), (right, left)):
            if isinstance(items, (str, list, tuple)) and type(times) is int and len(items) * times > MAX_REPEATED_ITEMS:
                raise TemplateLimitError(f"* builds more than {MAX_REPEATED_ITEMS:,} items")


def _within_time(run, seconds: float):
    """run() with Python's line tracing asking the clock every 1,024 events: TemplateLimitError past `seconds`
    (the one way to stop a loop of pure Python on this thread; a template renders in milliseconds)."""
    deadline, events = time.monotonic() + seconds, [0]

    def local(frame, event, arg):
        events[0] += 1
        if not events[0] & 1023 and time.monotonic() > deadline:
            raise TemplateLimitError(f"it ran past {seconds:g} s")
        return local

    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: local)
    try:
        return run()
    finally:
        sys.settrace(previous)


def _joined_within(pieces, limit: int) -> str:
    """The rendered pieces joined, TemplateLimitError past `limit` characters."""
    out, size = [], 0
    for piece in pieces:
        size += len(piece)
        if size > limit:
            raise TemplateLimitError(f"its text ran past {limit:,} characters")
        out.append(piece)
    return "".join(out)


def tokenizer_config(container: Container) -> dict:
    """The container's tokenizer_config.json ({} where it has none or it is damaged: it is optional)."""
    return container.tokenizer_json("tokenizer_config.json")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string, or an AddedToken object's content."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A family's chat template, compiled once: `render(messages)` gives the prompt's text."""

    def __init__(self, template: str, config: Mapping[str, Any]):
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):  # transformers' (no escaping)
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        class BoundedEnvironment(ImmutableSandboxedEnvironment):
            intercepted_binops = frozenset({"*", "**"})  # (jinja then folds neither while compiling)

            def call_binop(self, context, operator, left, right):
                _bounded_binop(operator, left, right)
                return super().call_binop(context, operator, left, right)

        env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = _within_time(lambda: env.from_string(template), RENDER_SECONDS)
        except jinja2.exceptions.TemplateError as e:
            raise MoepackError(f"the model's chat template does not compile: {str(e)[:200]}") from None
        except Exception as e:  # noqa: BLE001 - the checkpoint's code: any failure is one line
            raise MoepackError(f"the model's chat template does not compile ({_failure(e)})") from None
        self._special = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **variables: Any) -> str:
        """The conversation's text; the template's own refusal (raise_exception), its failure, or its going past
        the bounds (RENDER_SECONDS, MAX_RENDERED_CHARS, ...) is a MoepackError."""
        import jinja2

        pieces = lambda: _joined_within(self._template.generate(  # noqa: E731
            messages=messages, add_generation_prompt=add_generation_prompt, **self._special, **variables),
            MAX_RENDERED_CHARS)
        try:
            return _within_time(pieces, RENDER_SECONDS)
        except jinja2.exceptions.TemplateError as e:
            raise MoepackError(f"the model's chat template refused the messages: {str(e)[:200]}") from None
        except Exception as e:  # noqa: BLE001 - the checkpoint's code over the messages: any failure is one line
            raise MoepackError(f"the model's chat template failed on the messages ({_failure(e)})") from None


def _failure(e: BaseException) -> str:
    what = "too much memory" if isinstance(e, MemoryError) else str(e)[:200]
    return what if isinstance(e, TemplateLimitError) else f"{type(e).__name__}: {what}"


def family_chat_template(container: Container, family) -> ChatTemplate:
    """The chat template of a family container's model (`family`: its ModelFamily); NoChatTemplateError naming
    where it was looked for when there is none."""
    config = tokenizer_config(container)
    template = family.chat_template(config) or container.tokenizer_text(TEMPLATE_FILE)
    if not template:
        raise NoChatTemplateError(f"the {family.name} model's container carries no chat template (neither "
                                  f"tokenizer_config.json chat_template nor {TEMPLATE_FILE})")
    return ChatTemplate(template, config)
