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

import functools
import json
import re
import sys
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from moepack.format_spec.errors import MoepackError
from moepack.format_spec.reader import Container

TEMPLATE_FILE = "chat_template.jinja"  # where newer checkpoints keep the template instead of tokenizer_config.json
# a reasoning model's thought, as the templates that write one spell it (Qwen3's, QwQ's, DeepSeek-R1's): its text goes
# to reasoning_content (serve/app.py ThinkSplitter), calls written in it are not made
THOUGHT_OPEN, THOUGHT_CLOSE = "<think>", "</think>"
# what closes a thought a generation prompt opened (`<think>\n`) as an empty one: Qwen3's templates write an empty
# thought `<think>\n\n</think>\n\n` (its enable_thinking false, Qwen3-Thinking's reply with no reasoning)
EMPTY_THOUGHT_END = "\n" + THOUGHT_CLOSE + "\n\n"
_PROBE = "\ue004"  # a probe conversation's last text: a private-use character no template changes
# the conversations a template's generation prompt is learnt from, the next where it refuses one (a template that
# wants a system message first)
_PROBES = ([{"role": "user", "content": _PROBE}],
           [{"role": "system", "content": "\ue005"}, {"role": "user", "content": _PROBE}])
# tokenizer_config.json's special tokens a template may name (transformers passes them as variables)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class NoChatTemplateError(MoepackError):
    """The container's model carries no chat template."""


# A template is the checkpoint's code, run on every chat request: its time, its text and the values it builds are
# bounded, so that a damaged or hostile one is a one-line refusal, never a server that hangs (jinja would fold
# `7**(7**9)` while compiling, in C, holding the GIL) or fills the memory (`'A' * 10**9`, a string doubled by `~`
# in a loop, `'a'|center(10**9)`).
RENDER_SECONDS = 5.0
MAX_RENDERED_CHARS = 64 << 20
MAX_VALUE_ITEMS = 16 << 20  # a string or list a template holds, builds with `*` or gets from a filter
MAX_INT_BITS = 4096  # an integer that `*` or `**` builds


class TemplateLimitError(BaseException):
    """A chat template went past one of the bounds above (a BaseException: no `except Exception` of a library the
    template calls can swallow it and go on unbounded)."""


def _bounded_binop(operator: str, left: Any, right: Any) -> None:
    """TemplateLimitError for `left operator right` building past the bounds (checked before it is computed)."""
    ints = type(left) is int and type(right) is int
    if operator == "**" and ints and right > 0 and abs(left) > 1 and right * abs(left).bit_length() > MAX_INT_BITS:
        raise TemplateLimitError(f"** builds an integer of more than {MAX_INT_BITS} bits")
    if operator == "*" and ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
        raise TemplateLimitError(f"* builds an integer of more than {MAX_INT_BITS} bits")
    if operator == "*":
        for items, times in ((left, right), (right, left)):
            if isinstance(items, (str, list, tuple)) and type(times) is int and len(items) * times > MAX_VALUE_ITEMS:
                raise TemplateLimitError(f"* builds more than {MAX_VALUE_ITEMS:,} items")
    sized = (str, list, tuple)
    if operator == "+" and isinstance(left, sized) and isinstance(right, sized) and \
            len(left) + len(right) > MAX_VALUE_ITEMS:
        raise TemplateLimitError(f"+ builds more than {MAX_VALUE_ITEMS:,} items")


def _check_size(value: Any, what: str) -> Any:
    """`value`, or TemplateLimitError for a string or list past MAX_VALUE_ITEMS."""
    if isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_VALUE_ITEMS:
        raise TemplateLimitError(f"{what} builds more than {MAX_VALUE_ITEMS:,} items")
    return value


def _check_arguments(args, what: str) -> None:
    """TemplateLimitError for a width or count past MAX_VALUE_ITEMS (`center(10**9)`, a format spec of one) before
    the call builds it."""
    for a in args:
        if (type(a) is int and a > MAX_VALUE_ITEMS) or (isinstance(a, str) and _WIDE_SPEC.search(a)):
            raise TemplateLimitError(f"{what} asked for more than {MAX_VALUE_ITEMS:,} items")


# a printf or format() width of 9+ digits; the format field's first colon and then the digits looked for lazily (two
# greedy runs of one class had backtracked in time quadratic in a message's text passed to a filter, the GIL held)
_WIDE_SPEC = re.compile(r"%[-+ #0]*\d{9}|\{[^{}:]*:[^{}]*?\d{9}")


def _bounded_filter(f):
    """A jinja filter under _check_arguments and _check_size."""
    @functools.wraps(f)  # (its jinja_pass_arg too: pass_context and the like)
    def bounded(*args, **kwargs):
        _check_arguments((*args, *kwargs.values()), "a filter")
        return _check_size(f(*args, **kwargs), "a filter")
    return bounded


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
        import jinja2.meta
        from jinja2.compiler import CodeGenerator
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):  # transformers' (no escaping)
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        class BoundedCodeGenerator(CodeGenerator):
            def visit_Concat(self, node, frame):  # `a ~ b`: through the environment's bounded join
                self.write("environment.bounded_concat((")
                for arg in node.nodes:
                    self.visit(arg, frame)
                    self.write(", ")
                self.write("))")

        class BoundedEnvironment(ImmutableSandboxedEnvironment):
            intercepted_binops = frozenset({"*", "**", "+"})  # (jinja then folds none of them while compiling)
            code_generator_class = BoundedCodeGenerator

            def call_binop(self, context, operator, left, right):
                _bounded_binop(operator, left, right)
                return super().call_binop(context, operator, left, right)

            def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
                _check_arguments((*args, *kwargs.values()), "a call")
                return _check_size(super().call(__context, __obj, *args, **kwargs), "a call")

            def wrap_str_format(self, value):  # '{:>999999999}'.format: its width is in its string
                owner = getattr(value, "__self__", None)
                if isinstance(owner, str) and getattr(value, "__name__", None) in ("format", "format_map"):
                    _check_arguments((owner,), "a format")
                return super().wrap_str_format(value)

            @staticmethod
            def bounded_concat(parts) -> str:
                return _check_size("".join(map(str, parts)), "~")

        env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.filters.update({name: _bounded_filter(f) for name, f in env.filters.items()})
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:  # (no clock: parsing is linear in the text, and jinja folds no bounded operator or call while compiling)
            parsed = env.parse(template)
            # the variables it reads (`tools`: it renders a request's tools, serve/tool_calls.py renders_tool_calls)
            self.variables = frozenset(jinja2.meta.find_undeclared_variables(parsed))
            self._template = env.from_string(parsed)
        except jinja2.exceptions.TemplateError as e:
            raise MoepackError(f"the model's chat template does not compile: {str(e)[:200]}") from None
        except (Exception, TemplateLimitError) as e:  # noqa: BLE001 - the checkpoint's code: any failure is one line
            raise MoepackError(f"the model's chat template does not compile ({_failure(e)})") from None
        self.source = template
        self._special = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}
        self._opens_thought: dict[bool | None, bool | None] = {}

    def opens_thought(self, thinking: bool | None = None) -> bool | None:
        """Where an answer to this template's prompt (rendered with `thinking` as its enable_thinking, None: not
        passed) has its thought: None, it has none (the template never spells THOUGHT_CLOSE); True, the generation
        prompt opens it (the answer starts inside it: QwQ's, Qwen3-Thinking's); False, the answer may open one
        itself with THOUGHT_OPEN (Qwen3's, also after the empty one its enable_thinking false writes).
        Learnt once per value from a probe conversation's generation prompt (_PROBES; a template that refuses them
        all: False, asked again next time)."""
        if THOUGHT_CLOSE not in self.source:
            return None
        if thinking not in self._opens_thought:
            options = {} if thinking is None else {"enable_thinking": thinking}
            for conversation in _PROBES:
                try:
                    text = self.render(conversation, **options)
                    break
                except MoepackError:
                    continue
            else:  # (not kept: a probe cut short by RENDER_SECONDS on a loaded machine is tried again next time)
                return False
            prompt = text[text.rfind(_PROBE) + len(_PROBE):] if _PROBE in text else ""
            self._opens_thought[thinking] = prompt.rfind(THOUGHT_OPEN) > prompt.rfind(THOUGHT_CLOSE)
        return self._opens_thought[thinking]

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
        except (Exception, TemplateLimitError) as e:  # noqa: BLE001 - the checkpoint's code: any failure, one line
            raise MoepackError(f"the model's chat template failed on the messages ({_failure(e)})") from None


def _failure(e: BaseException) -> str:
    what = "too much memory" if isinstance(e, MemoryError) else str(e)[:200]
    return what if isinstance(e, TemplateLimitError) else f"{type(e).__name__}: {what}"


def chat_template_text(container: Container, family) -> str | None:
    """The Jinja text of a family container's chat template, or None where it carries none."""
    from_file = container.tokenizer_text(TEMPLATE_FILE)
    # transformers: a chat_template.jinja takes priority over tokenizer_config.json's (a family with its own chat
    # encoding renders its own)
    if from_file and family.chat_encoding is None:
        return from_file
    return family.chat_template(tokenizer_config(container)) or from_file or None


def family_chat_template(container: Container, family) -> ChatTemplate:
    """The chat template of a family container's model (`family`: its ModelFamily); NoChatTemplateError naming
    where it was looked for when there is none."""
    template = chat_template_text(container, family)
    if not template:
        raise NoChatTemplateError(f"the {family.name} model's container carries no chat template (neither "
                                  f"tokenizer_config.json chat_template nor {TEMPLATE_FILE})")
    return ChatTemplate(template, tokenizer_config(container))


def tokenizer_info(container: Container, family, context: int | None) -> dict:
    """vLLM's GET /tokenizer_info, what lm-eval's remote tokenizer reads: the special tokens' texts, whether a BOS is
    added, the context and the chat template's text (where there is one), from the container's tokenizer_config.json
    (named fields only: never the file whole)."""
    config = tokenizer_config(container)
    info: dict[str, Any] = {name: _token_text(config.get(name))
                            for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    info["add_bos_token"] = bool(config.get("add_bos_token", True))
    info["model_max_length"] = context
    if isinstance(config.get("tokenizer_class"), str):
        info["tokenizer_class"] = config["tokenizer_class"][:200]
    try:
        template = chat_template_text(container, family)
    except MoepackError:  # a malformed one: chat requests name it; the info goes without it
        template = None
    if template:
        info["chat_template"] = template
    return info
