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

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(template)
        except jinja2.exceptions.TemplateError as e:
            raise MoepackError(f"the model's chat template does not compile: {str(e)[:200]}") from None
        self._special = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **variables: Any) -> str:
        """The conversation's text; the template's own refusal (raise_exception) or failure is a MoepackError."""
        import jinja2

        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self._special, **variables)
        except jinja2.exceptions.TemplateError as e:
            raise MoepackError(f"the model's chat template refused the messages: {str(e)[:200]}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as e:  # a template over messages it cannot take
            raise MoepackError(f"the model's chat template failed on the messages ({type(e).__name__}: "
                               f"{str(e)[:200]})") from None


def family_chat_template(container: Container, family) -> ChatTemplate:
    """The chat template of a family container's model (`family`: its ModelFamily); NoChatTemplateError naming
    where it was looked for when there is none."""
    config = tokenizer_config(container)
    template = family.chat_template(config) or container.tokenizer_text(TEMPLATE_FILE)
    if not template:
        raise NoChatTemplateError(f"the {family.name} model's container carries no chat template (neither "
                                  f"tokenizer_config.json chat_template nor {TEMPLATE_FILE})")
    return ChatTemplate(template, config)
