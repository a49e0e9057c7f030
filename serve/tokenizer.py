"""The prompt's tokenizer, loaded from the files the container carries (never from the network, never with
remote code).

Special tokens come only from markup that is trusted: a chat encoding's own (`encode_segments`: the segments of
families/deepseek_v4/chat.py, message content plain text; a chat template's markup, `encode_rendered`, a message
string spelling out a special token's text plain) or a raw prompt the user typed (`moepack prefill/generate
--prompt`: the user's own text, spelled-out special tokens and all). Text from elsewhere (a server's completions prompt)
goes through `encode(text, special_tokens=False)`: a special or added token's text stays that text's ordinary tokens.
The tokenizers library matches its added tokens in every `encode` (add_special_tokens only governs the BOS a
post-processor adds), so plain text goes through a second tokenizer, the same one without its added tokens.

`chat_prompt_ids` is a conversation's prompt ids as the model's chat, written once for `moepack generate` and the
server: its errors (ChatInputError) name the field, the server answers them with a 400, the CLI with one line."""

from __future__ import annotations

import json
import re
import secrets
from functools import cached_property
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from moepack.format_spec import untrusted
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.reader import Container

from .chat_template import EMPTY_THOUGHT_END

MAX_TOKEN_IDS_BYTES = 256 << 20  # a million ids take under 8 MiB
MAX_PROMPT_BYTES = 256 << 20  # a prompt file: far beyond a million tokens of text
_ID_WORD = re.compile(r"[+-]?[0-9]{1,32}")  # an id of a whitespace-separated file (ranges are the engine's to check)
# any shield_messages placeholder (private-use characters around its nonce and number): one pattern, each match
# looked up (an alternation of every placeholder had split a rendered chat in time quadratic in their number)
_PLACEHOLDER = re.compile("\ue000[0-9a-f]{16}[0-9]+\ue001")


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's (GPT-2's) character for each byte, inverted: printable Latin-1 bytes stand for themselves,
    the other bytes for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + k): b for k, b in enumerate(others)}}


_BYTE_OF_CHAR = _byte_level_chars()


class PromptTokenizer:
    @staticmethod
    def carried_by(container: Container) -> bool:
        """Whether the container carries a tokenizer.json (a model converted without one runs by token ids)."""
        entry = container.index["tokenizer"].get("tokenizer.json")
        return bool(entry) and entry.get("encoding") == "utf-8"

    def __init__(self, container: Container):
        if not self.carried_by(container):
            raise MoepackError(f"{container.path} carries no tokenizer.json: pass the prompt as --token-ids")
        files = container.index["tokenizer"]
        self._json = files["tokenizer.json"]["data"]
        self._tok = untrusted.load_tokenizer(self._json, "the container's tokenizer.json")
        config = {}
        if files.get("tokenizer_config.json", {}).get("encoding") == "utf-8":
            try:
                config = untrusted.loads(files["tokenizer_config.json"]["data"], "tokenizer_config.json")
            except untrusted.UntrustedInputError:  # a damaged optional file: the default (a BOS) stands
                config = {}
        self.add_special_tokens = bool(config.get("add_bos_token", True)) if isinstance(config, dict) else True
        bos = config.get("bos_token") if isinstance(config, dict) else None
        bos = bos.get("content") if isinstance(bos, dict) else bos  # a string, or an AddedToken's object
        # the id of the config's BOS, where the vocabulary has it (a chat continuing a KV starts without it)
        self.bos_id = self._tok.token_to_id(bos) if isinstance(bos, str) else None

    @property
    def tokenizer_json(self) -> str:
        """The tokenizer.json text the container carries (what constrained decoding builds its vocabulary from)."""
        return self._json

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def _plain(self):
        """The tokenizer without its added tokens: normalizer, pre-tokenizer, model and post-processor as they are,
        so text without a special token's text gets the same ids, and with one, the ids of its characters."""
        from tokenizers import Tokenizer

        spec = json.loads(self._json)
        spec["added_tokens"] = []
        return Tokenizer.from_str(json.dumps(spec))

    def encode(self, text: str, special_tokens: bool = True, add_bos: bool | None = None) -> list[int]:
        """A raw prompt's ids (BOS in front where the tokenizer's config adds it, or as `add_bos` says).
        `special_tokens=False`: the text of a special or added token in `text` is tokenized as the plain text it
        is."""
        return self._ids(self._tok if special_tokens else self._plain, text,
                         self.add_special_tokens if add_bos is None else add_bos)

    def encode_special(self, text: str) -> list[int]:
        """Ids of text that spells out its own special tokens (a chat template's BOS, role tags): none added."""
        return self._ids(self._tok, text, False)

    @staticmethod
    def _ids(tok, text: str, add_special_tokens: bool) -> list[int]:
        # the batch call lets go of the GIL while it works (encode() holds it: a server's event loop would stall
        # for the whole of a long prompt); the fast one keeps no offsets: the same ids in 0.4x the time, and no
        # per-token strings to free after (freeing a 1M-token encoding's held the GIL 0.1-0.4 s)
        try:
            return tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        except BaseException as e:  # the library's Rust panic is a BaseException: one line, not a dead thread
            if type(e).__name__ != "PanicException":
                raise
            why = (str(e).splitlines() or ["a panic"])[0][:200]
            raise MoepackError(f"the container's tokenizer failed on the text ({why})") from None

    def encode_segments(self, segments: Iterable[tuple[str, bool]]) -> list[int]:
        """Ids of a chat encoding's segments (families/deepseek_v4/chat.py `encode_message_segments`): its markup into
        special tokens, every other text (message content) plain, so no message can spell out a special token; none
        added."""
        ids: list[int] = []
        for text, special in segments:
            ids += self._ids(self._tok if special else self._plain, text, False)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_id(self, text: str) -> int | None:
        """The id of the token whose text is `text` (an added token's content, a vocabulary entry), None without one."""
        return self._tok.token_to_id(text)

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for, also where it holds part of a character (its text alone is then U+FFFD):
        byte-level BPE's characters mapped back to bytes, a byte-fallback piece `<0xC9>` as its byte."""
        text = self.decode([token])
        if "\ufffd" not in text:
            return text.encode()
        piece = self._tok.id_to_token(token) or ""
        if piece and all(ch in _BYTE_OF_CHAR for ch in piece):
            return bytes(_BYTE_OF_CHAR[ch] for ch in piece)
        fallback = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        return bytes([int(fallback.group(1), 16)]) if fallback else text.encode()

    def pieces(self, ids: list[int]) -> list[str]:
        """Each id's text alone (decode([i]) of each; the batch call lets go of the GIL)."""
        return self._tok.decode_batch([[i] for i in ids], skip_special_tokens=False)

    def skipping_specials(self, kept: Sequence[str] = ()) -> "SkippingSpecials":
        """This tokenizer, its decode leaving out the special tokens (vLLM's skip_special_tokens) but those whose
        text one of `kept` holds (a chat's own markup, which its answer is split at)."""
        return SkippingSpecials(self, frozenset(i for i, t in self._tok.get_added_tokens_decoder().items()
                                                if t.special and not any(t.content in k for k in kept)))

    @cached_property
    def _special_texts(self) -> tuple[str, ...]:
        """The texts of the added tokens marked special (a chat's role markers, BOS, EOS; not Qwen3's <think> or
        <tool_call>, added tokens a template reads in a message's text and splits it at)."""
        return tuple(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special and t.content)

    def shield_messages(self, messages: list[dict]) -> tuple[list[dict], dict[str, str]]:
        """`messages` (each with text content: _template_messages) with each string of theirs that spells out a
        special token's text (a content, a reasoning_content) replaced by a placeholder, for a chat template to
        render (`encode_rendered` then tokenizes each such string as the plain text it is, the template's own markup
        with its special tokens); and the placeholders' texts. Messages without one come back as they are, so their
        ids stay transformers' apply_chat_template's."""
        nonce, texts = secrets.token_hex(8), {}

        def shielded(value):
            if not isinstance(value, str) or not any(t in value for t in self._special_texts):
                return value
            key = f"\ue000{nonce}{len(texts)}\ue001"  # (private-use characters: no token's text, kept by templates)
            # (_PLACEHOLDER matches each)
            texts[key] = value
            return key

        return [{**m, **{k: shielded(m[k]) for k in ("content", "reasoning_content") if k in m}}
                for m in messages], texts

    def special_text_in(self, value: Any) -> str | None:
        """The first special token's text a string of `value` (a JSON value: its keys too) spells out; None where
        none does (what a template renders without shield_messages: tools, tool calls)."""
        if isinstance(value, str):
            return next((t for t in self._special_texts if t in value), None)
        items = [*value, *value.values()] if isinstance(value, dict) else value if isinstance(value, list) else ()
        return next((t for t in map(self.special_text_in, items) if t is not None), None)

    def encode_rendered(self, text: str, shielded: dict[str, str]) -> list[int]:
        """A rendered chat's ids: its markup with its special tokens, nothing added (encode_special), and the text
        behind each of `shielded`'s placeholders (shield_messages) plain."""
        if not shielded:
            return self.encode_special(text)
        ids: list[int] = []
        at = 0
        for placeholder in _PLACEHOLDER.finditer(text):
            if placeholder.group() in shielded:
                ids += self.encode_special(text[at:placeholder.start()])
                ids += self._ids(self._plain, shielded[placeholder.group()], False)
                at = placeholder.end()
        return ids + self.encode_special(text[at:])


class SkippingSpecials:
    """A PromptTokenizer whose text leaves out the tokens `skipped`: an answer's text, its logprobs' tokens and
    their offsets all without them, so that they still join into the text (ids, bytes and the rest as it has them)."""

    def __init__(self, tokenizer: PromptTokenizer, skipped: frozenset[int]):
        self._tokenizer, self.skipped = tokenizer, skipped

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode([i for i in ids if i not in self.skipped])

    def token_bytes(self, token: int) -> bytes:
        return b"" if token in self.skipped else self._tokenizer.token_bytes(token)


class ChatInputError(MoepackError):
    """A conversation (or a chat option) the model's chat does not take. `param` is the request field it is about
    ("messages", "reasoning_effort"), `code` the server's error code; the message starts with the field's name."""

    def __init__(self, message: str, param: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


# the keys an OpenAI message may carry (`name`: accepted, not rendered, as the release's encoder ignores it;
# `parsed`: the SDK's own reading of the content, which its chat.completions.parse() answer carries back, accepted
# and not rendered, the content says it; SILENT_MESSAGE_KEYS only where they say nothing); tools / response_format
# on a system or developer message: the release's own
MESSAGE_KEYS = {"role", "content", "name", "parsed", "tool_calls", "tool_call_id", "reasoning_content", "refusal",
                "audio", "annotations", "function_call", "tools", "response_format", "task", "wo_eos", "reasoning"}
# keys of OpenAI's response message that a client sends back as it got it (the SDK's message.model_dump() writes
# each, null where unset): taken null (or, a list, empty), refused otherwise (nothing renders them)
SILENT_MESSAGE_KEYS = ("refusal", "audio", "annotations", "function_call")
TEXT_MESSAGE_KEYS = ("name", "tool_call_id")  # read as text or not at all: another type was dropped without a word


def check_message_keys(messages: list) -> None:
    """Every key of every message one moepack renders (a chat encoder or template would drop another without a
    word): the server's request and `generate --messages` alike."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue  # the encoder names it
        for key, value in m.items():
            if key not in MESSAGE_KEYS or (key in SILENT_MESSAGE_KEYS and value is not None and value != []):
                raise ChatInputError(f"messages[{i}].{str(key)[:40]}: not a message field moepack renders",
                                     "messages", "unknown_field")
            if key in TEXT_MESSAGE_KEYS and not isinstance(value, (str, type(None))):  # OpenAI types them so (null:
                # unset, as some clients send it)
                raise ChatInputError(f"messages[{i}].{key}: expected a string, got {json.dumps(value)[:40]}",
                                     "messages", "invalid_type")


def with_reasoning_content(messages: list) -> list:
    """The messages with an assistant's thought given as `reasoning` (vLLM's newer name for reasoning_content, and
    OpenRouter's, which their clients send back) read as its reasoning_content; both given and different, another
    role's or not a string: a 400 naming it (read as reasoning_content, a user's had been dropped without a word)."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and "reasoning" in m:
            m = dict(m)
            given = m.pop("reasoning")
            if given is not None and not isinstance(given, str):
                raise ChatInputError(f"messages[{i}].reasoning: expected a string, got {type(given).__name__}",
                                     "messages", "invalid_type")
            if given and m.get("role") != "assistant":
                raise ChatInputError(f"messages[{i}].reasoning: only an assistant message carries a thought",
                                     "messages")
            if given is not None:
                if m.get("reasoning_content") not in (None, given):
                    raise ChatInputError(f"messages[{i}].reasoning: another text than its reasoning_content (two "
                                         "names of the one thought): give one", "messages")
                m["reasoning_content"] = given
        out.append(m)
    return out


NOT_A_CONVERSATION = "messages: expected a non-empty list of {role, content} objects"
# the roles a chat template is given: Qwen3's renders these and drops any other (developer too) without a word
TEMPLATE_ROLES = ("system", "user", "assistant", "tool")


def _template_messages(messages: list[dict], family_name: str) -> list[dict]:
    """The messages as a chat template renders them: a role of TEMPLATE_ROLES, text content (an assistant's may be
    None, beside its tool calls). OpenAI's list of text parts is joined into one text by newlines, as vLLM gives it
    to such templates (Qwen3's renders a list as nothing); a part of another type, another role, other content are
    refused (the template would drop them without a word)."""
    out = []
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content")
        if role not in TEMPLATE_ROLES:
            hint = ": give it as a system message" if role == "developer" else ""
            raise ChatInputError(f"messages[{i}].role: {role[:40]!r} is no role a {family_name} model's chat "
                                 f"template renders (expected one of {', '.join(TEMPLATE_ROLES)}){hint}", "messages")
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    what = f"a {str(kind)[:40]!r} part" if isinstance(kind, str) else "not a {type, text} part"
                    raise ChatInputError(f"messages[{i}].content[{j}]: {what}: a {family_name} model reads text "
                                         "parts only", "messages", "invalid_type")
            m = {**m, "content": "\n".join(part["text"] for part in content)}
        elif content is None and role == "assistant":
            m = {**m, "content": ""}  # (beside its tool calls; a template may join it to text)
        elif not isinstance(content, str):
            raise ChatInputError(f"messages[{i}].content: expected a string or a list of text parts, got "
                                 f"{type(content).__name__} (a {family_name} model's chat template renders text)",
                                 "messages", "invalid_type")
        _check_assistant_fields(m, i)
        if m["role"] == "assistant" and m.get("tool_calls"):
            m = {**m, "tool_calls": [_template_call(call) for call in m["tool_calls"]]}
        out.append(m)
    return out


def _template_call(call: dict) -> dict:
    """An assistant's tool call as a template reads it (as vLLM gives it): OpenAI's `arguments`, a JSON object's
    text, as that object (Qwen3's template writes a string as it is, an object with tojson)."""
    arguments = call["function"].get("arguments")
    try:
        value = untrusted.loads(arguments, "arguments") if isinstance(arguments, str) else None
    except untrusted.UntrustedInputError:
        value = None
    return {**call, "function": {**call["function"], "arguments": value}} if isinstance(value, dict) else call


def _check_assistant_fields(m: dict, i: int) -> None:
    """An assistant's own fields as OpenAI shapes them (a template renders what it finds, or drops it without a
    word): tool_calls a list of {"function": {"name", "arguments"}}, reasoning_content text; on another role
    neither."""
    calls, reasoning = m.get("tool_calls"), m.get("reasoning_content")
    if m["role"] != "assistant":
        for field in ("tool_calls", "reasoning_content"):
            if m.get(field):  # (an empty one says nothing: as DeepSeek-V4's encoder reads them)
                raise ChatInputError(f"messages[{i}].{field}: only an assistant message carries {field}", "messages")
        return
    if calls is not None and not (isinstance(calls, list) and all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
            and isinstance(c["function"].get("arguments", ""), (str, dict)) for c in calls)):
        raise ChatInputError(f'messages[{i}].tool_calls: expected a list of {{"id", "type": "function", "function": '
                             '{"name", "arguments"}}', "messages", "invalid_type")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ChatInputError(f"messages[{i}].reasoning_content: expected a string, got {type(reasoning).__name__}",
                             "messages", "invalid_type")


def _refuse_spelled_markup(tok: PromptTokenizer, messages: list[dict], tools: list[dict] | None) -> None:
    """ChatInputError where the tools or an assistant's tool calls (rendered by a template as they are, JSON and
    all: no placeholder stands for them) spell out a special token's text."""
    for where, value in (("tools", tools), *((f"messages[{i}].tool_calls", m.get("tool_calls"))
                                            for i, m in enumerate(messages))):
        spelled = tok.special_text_in(value) if value else None
        if spelled is not None:
            raise ChatInputError(f"{where}: spells out the special token {spelled!r}, which the chat template would "
                                 "render as markup", where.split("[")[0].split(".")[0])


def markup_warning(family: Any, tokenizer: PromptTokenizer) -> str | None:
    """What to tell the user where `family`'s own chat encoding has markup (its SPECIAL_TOKENS: role and thinking
    tags) that `tokenizer` holds no token for: a chat spells each out as plain text, which the model never saw (a
    checkpoint converted with another model's tokenizer, say); None where every one is a token, or the family chats
    through a template (its tokenizer's own)."""
    markup = getattr(family.chat_encoding, "SPECIAL_TOKENS", ()) if family.chat_encoding is not None else ()
    missing = [text for text in markup if tokenizer.token_id(text) is None]
    if not missing:
        return None
    return (f"the container's tokenizer has no token for {', '.join(missing)} ({family.name}'s chat markup): chat "
            "prompts spell them out as plain text, which the model was not trained on")


def warn_of_missing_markup(family: Any, tokenizer: PromptTokenizer) -> None:
    """markup_warning as a command's warning line (`generate --messages`, `chat`; the server logs it instead)."""
    import warnings

    warning = markup_warning(family, tokenizer)
    if warning:
        warnings.warn(warning, stacklevel=2)  # (the command's line: its module names the warning ours)


def chat_prompt_ids(family: Any, tokenizer: Callable[[], PromptTokenizer], messages: Any, *,
                    thinking: bool | None = None,
                    reasoning_effort: str | None = None, template: Callable[[], Any] | None = None,
                    after: Sequence[tuple[str, bool]] = (), continuing: bool = False,
                    turn_end: int | None = None, tools: list[dict] | None = None,
                    continue_final: bool = False) -> list[int]:
    """The prompt ids of `messages` (an OpenAI-style list) as `family`'s chat:

    * its own chat encoding (family.chat_encoding): markup rendered in code into special tokens, message content
      plain text; `thinking` its thinking mode (None: off, its chat mode); `reasoning_effort` as the encoding
      checks it; `after`: more of its segments (a forced tool call's start);
    * else the chat template `template()` gives (serve/chat_template.py), tokenized as apply_chat_template does;
      `thinking` is its enable_thinking (None: not passed, the template's default); `tools` its tools variable (as
      apply_chat_template(tools=...) passes them); `after`: text the prompt ends with (a forced tool call's start);
      a template takes no reasoning effort, and only messages of TEMPLATE_ROLES with text content, a list of text
      parts joined (what it would drop is refused); tools or tool calls that spell out a special token are
      refused (no request forges a turn).

    `continuing`: the messages go on after a KV's conversation (`generate --continue-from`), so the BOS a first
    turn starts with is left out, as the whole conversation has it only at its start. `turn_end`: the token that
    conversation ends with, its last turn closed; a template's messages then start with what the template puts
    after a turn so closed (Qwen3's newline after <|im_end|>), as in the whole conversation.

    `continue_final`: the conversation's final message, an assistant's text, is left open and the answer goes on
    from it (vLLM's continue_final_message: a chat encoding's turn left open, its `wo_eos`; a template's rendering
    without a generation prompt cut after that text, as transformers' apply_chat_template(continue_final_message));
    a final message's own truthy `wo_eos` (the release encoder's field) says the same.

    `tokenizer()` and `template()` are asked for only when needed (a missing template is named before a missing
    tokenizer). Bad input is a ChatInputError naming the field."""
    if continue_final or ends_open(messages):
        continue_final, messages = True, _left_open(messages)
    ids = _first_turn_ids(family, tokenizer, messages, thinking, reasoning_effort, template, after,
                          turn_end if continuing else None, tools, continue_final)
    bos = tokenizer().bos_id if continuing and ids else None
    return ids[1:] if bos is not None and ids[0] == bos else ids


# a closed exchange a continued conversation's messages are rendered after, to learn what a template puts between
# a turn's end and the next turn; its reply a private-use character no template changes
_CLOSED_EXCHANGE = [{"role": "user", "content": "\ue002"}, {"role": "assistant", "content": "\ue003"}]


def _after_the_closed_exchange(text: str, turn_end: str) -> str | None:
    """The rendered text after _CLOSED_EXCHANGE's reply and the `turn_end` that closes it; None where the
    template does not close a reply so."""
    reply = text.find(_CLOSED_EXCHANGE[1]["content"])
    end = text.find(turn_end, reply) if reply >= 0 and turn_end else -1
    return text[end + len(turn_end):] if end >= 0 else None


def ends_open(messages) -> bool:
    """Whether the conversation's final message says it is left open (the release encoder's `wo_eos`, truthy): the
    answer goes on from it (chat_prompt_ids' continue_final)."""
    return isinstance(messages, list) and bool(messages) and isinstance(messages[-1], dict) \
        and bool(messages[-1].get("wo_eos"))


def _left_open(messages) -> list:
    """The conversation with its final message, an assistant's text (no tool calls), left open (`wo_eos`)."""
    if not isinstance(messages, list) or not messages:  # (none at all had been named messages[-1] or messages[0])
        raise ChatInputError(NOT_A_CONVERSATION, "messages", "invalid_type")
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "assistant" or last.get("tool_calls"):
        raise ChatInputError(f"messages[{len(messages) - 1}]: continue_final_message goes on from a final assistant "
                             "message's text (without tool calls)", "messages")
    content = last.get("content")
    text = "".join(p.get("text", "") for p in content if isinstance(p, dict)) if isinstance(content, list) else content
    if not isinstance(text, str) or not text.strip():
        raise ChatInputError(f"messages[{len(messages) - 1}].content: continue_final_message needs the final assistant "
                             "message's text to go on from", "messages")
    return [*messages[:-1], {**last, "wo_eos": True}]


# put after the final message's text to find where the template renders that text's end (private-use characters)
_FINAL_END = "\ue006\ue007"


def _rendered_to_final(chat_template, messages: list, where: int, options: dict) -> str:
    """The template's rendering of `messages` (a template's, checked) without a generation prompt, cut right after
    the final message's text (as transformers' apply_chat_template(continue_final_message=True) cuts it: a trailing
    space the template trimmed is left out). That text is looked for before where the template renders its end (a
    rendering with _FINAL_END after it says where), not in what follows it: transformers' last occurrence in the
    whole rendering took a final "<" or ">" to be Qwen3's "<|im_end|>" after it (the prompt "<<", or the turn
    closed). `where`: the message's index in the request."""
    final = messages[-1]["content"]
    text = chat_template.render(messages, add_generation_prompt=False, **options)
    marked = chat_template.render([*messages[:-1], {**messages[-1], "content": final + _FINAL_END}],
                                  add_generation_prompt=False, **options)
    end = marked.find(_FINAL_END) if marked.count(_FINAL_END) == 1 else -1
    return _cut_after_final(text, final, where, end if 0 <= end <= len(text) else len(text))


def _cut_after_final(text: str, final: str, where: int, end: int) -> str:
    """`text` cut right after the final message's text `final`, its last occurrence ending by `end`."""
    at = text.rfind(final.strip(), 0, end)
    if at < 0:
        raise ChatInputError(f"messages[{where}].content: the chat template does not render the final message's text "
                             "as it is: there is nothing to go on from (continue_final_message)", "messages")
    whole = text[at:at + len(final.lstrip())] == final
    return text[:at + len(final.lstrip() if whole else final.strip())]


def _first_turn_ids(family, tokenizer, messages, thinking, reasoning_effort, template, after,
                    turn_end: int | None = None, tools: list[dict] | None = None,
                    continue_final: bool = False) -> list[int]:
    """chat_prompt_ids as a first turn's (`turn_end`, `continue_final`: as a continued conversation's, see
    there)."""
    if not isinstance(messages, list) or not messages:
        raise ChatInputError(NOT_A_CONVERSATION, "messages", "invalid_type")
    check_message_keys(messages)
    messages = with_reasoning_content(messages)
    encoding = family.chat_encoding
    if encoding is None:
        if reasoning_effort is not None:
            raise ChatInputError(f"reasoning_effort: a {family.name} model's chat template takes no reasoning "
                                 "effort", "reasoning_effort")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise ChatInputError(NOT_A_CONVERSATION, "messages", "invalid_type")
        for i, m in enumerate(messages[:-1] if continue_final else messages):
            if m.get("wo_eos"):
                raise ChatInputError(f"messages[{i}].wo_eos: a chat template leaves no assistant turn open but the "
                                     "conversation's last (continue_final_message)", "messages")
        messages = _template_messages([{k: v for k, v in m.items() if k != "wo_eos"} for m in messages], family.name)
        chat_template = template()
        tok = tokenizer()
        _refuse_spelled_markup(tok, messages, tools)
        messages, shielded = tok.shield_messages(messages)  # no message can spell out a special token
        if after:  # a forced tool call's start follows the reply's form with no thought (Qwen3's empty <think>
            thinking = False  # block), as a chat encoding's forced call closes its thought first: none cut short
        options = {} if thinking is None else {"enable_thinking": thinking}
        if tools:
            options["tools"] = tools

        def rendered(conversation: list) -> str:
            if continue_final:
                return _rendered_to_final(chat_template, conversation, len(messages) - 1, options)
            return chat_template.render(conversation, **options)
        try:
            text = rendered(messages)
            if turn_end is not None:  # (a final message left open stays open after the closed exchange too)
                after_end = _after_the_closed_exchange(rendered(_CLOSED_EXCHANGE + messages),
                                                       tok.pieces([turn_end])[0])
                text = text if after_end is None else after_end
        except MoepackError as e:
            raise ChatInputError(f"messages: {e}", "messages") from None
        if after and chat_template.opens_thought(False):  # the prompt opens a thought whatever enable_thinking says
            text += EMPTY_THOUGHT_END  # (Qwen3-Thinking's, QwQ's): the forced call follows it closed, not inside it
        return tok.encode_rendered(text + "".join(piece for piece, _ in after), shielded)
    try:
        thinking = bool(thinking)
        encoding.check_reasoning_effort(reasoning_effort, thinking)  # "max" needs thinking
    except MoepackError as e:
        raise ChatInputError(str(e), "reasoning_effort") from None
    try:
        segments = encoding.encode_message_segments(messages, thinking=thinking, reasoning_effort=reasoning_effort,
                                                    reply=True)
    except MoepackError as e:
        raise ChatInputError(str(e), "messages") from None
    return tokenizer().encode_segments([*segments, *after])


def read_text(path: str, limit: int, what: str) -> str:
    """A regular file's UTF-8 text, at most `limit` bytes (a FIFO, a device refused by name); one line otherwise."""
    try:
        raw = untrusted.read_bounded(path, limit, missing=f"{path}: cannot read (no such file)")
    except OSError as e:
        raise MoepackError(f"{path}: cannot read ({e.strerror})") from None
    if len(raw) > limit:
        raise MoepackError(f"{path}: more than {limit} bytes of {what} (the limit)")
    try:  # (a leading byte-order mark is the file's encoding, an editor's, not text of the prompt)
        return raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise MoepackError(f"{path}: not valid UTF-8 (byte {e.start}): expected {what}") from None


def read_prompt_file(path: str) -> str:
    """A prompt file's text (UTF-8); an empty one is refused (a prompt of BOS alone is nobody's intent)."""
    text = read_text(path, MAX_PROMPT_BYTES, "the prompt")
    if not text:
        raise MoepackError(f"{path}: empty prompt")
    return text


def read_token_ids(path: str) -> list[int]:
    """Token ids from a file: a JSON array, or integers separated by whitespace or commas."""
    text = read_text(path, MAX_TOKEN_IDS_BYTES, "token ids")
    if text.lstrip().startswith(("[", "{", '"')):  # JSON: bounded in depth and number length like every reader
        value = untrusted.loads(text, path, max_bytes=MAX_TOKEN_IDS_BYTES)
        ids = value if isinstance(value, list) else [value]
    else:  # one bare number is one token id; else whitespace- or comma-separated integers, each of a bounded length
        words = text.replace(",", " ").split()
        ids = [int(w) for w in words] if all(_ID_WORD.fullmatch(w) for w in words) else None
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise MoepackError(f"{path}: expected a non-empty list of integer token ids")
    return ids
