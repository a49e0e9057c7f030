"""OpenAI's shapes that the server's endpoints share (serve/app.py's chat and completions, serve/responses.py's
Responses API): its error object (RequestError), a request's fields checked by name (check_fields, _get, _value:
a 400 naming the field), the request prepared for the worker (Prepared), chat's token logprobs (chat_logprobs)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from moepack.format_spec.untrusted import UntrustedInputError
from moepack.runtime.generate import GenerateOptions
from moepack.runtime.sampling import TokenLogprob

from .reasoning import ThoughtMarks
from .tool_calls import ToolPlan

RETRY_AFTER_S = {429: 2, 503: 1}  # the Retry-After header of a full queue and of too many connections
# OpenAI fields moepack does not act on: a 400 naming the field whenever one is given (not null)
REFUSED_FIELDS = {
    "audio": "audio output is not supported (moepack serves a text model)",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "functions": "the deprecated functions field is not supported: give tools",
    "function_call": "the deprecated function_call field is not supported: give tool_choice",
    "verbosity": "verbosity is not supported",
}
# OpenAI's fields that name the caller or a cache bucket: accepted (a string) and not used. No per-user state is
# kept; the prompt cache finds a prompt's longest cached prefix by its token ids, whatever its key.
IDENTIFIER_FIELDS = ("user", "safety_identifier", "prompt_cache_key")


class RequestError(Exception):
    """A request the client got wrong: HTTP `status` with OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind
        self.headers = dict(headers or {})
        if status in RETRY_AFTER_S:
            self.headers.setdefault("Retry-After", str(RETRY_AFTER_S[status]))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _get(body: dict, name: str, check: Callable, what: str, default=None):
    v = body.get(name)
    if v is None:
        return default
    if not check(v):
        raise RequestError(f"{name}: expected {what}, got {json.dumps(v)[:60]}", param=name, code="invalid_type")
    return v


def _value(body: dict, name: str, checker: Callable, *args, default=None, **kw):
    """body[name] through one of format_spec.untrusted's checkers (finite_float, int_in_range); its refusal is a
    400 naming the field."""
    v = body.get(name)
    if v is None:
        return default
    try:
        return checker(v, name, *args, **kw)
    except UntrustedInputError as e:
        raise RequestError(str(e), param=name,
                           code="invalid_type" if "expected" in str(e) else "invalid_value") from None


# accepted fields whose other values ask for what is not there: (the values served, the refusal)
PLAIN_VALUES = {"service_tier": ((None, "auto", "default"), "service tiers are not supported (give auto or default)"),
                "store": ((None, False), "stored completions are not supported"),
                "suffix": ((None, ""), "suffix (insertion) is not supported"),
                "modalities": ((None, ["text"]), "only the text modality is supported"),
                "metadata": ((None, {}), "metadata goes with stored completions, which are not supported")}


def check_fields(body: dict, allowed: set[str], where: str, refused: dict[str, str] = REFUSED_FIELDS,
                 plain: dict[str, tuple] = PLAIN_VALUES) -> None:
    """Every field one the endpoint (`where`) acts on: an unknown field, or an OpenAI field moepack does not do
    (`refused`), is a 400 naming it (never silently ignored); so are the values of the accepted ones that would
    change nothing here (`plain`)."""
    for name, value in body.items():
        if name in allowed:
            continue
        if name in refused:
            if value is None:
                continue
            raise RequestError(f"{name}: {refused[name]}", param=name, code="unsupported_field")
        raise RequestError(f"{name[:60]}: unknown field for {where} (docs/guide.md lists the fields served)",
                           param=name[:60], code="unknown_field")
    for name, (ok, what) in plain.items():
        if name in body and body[name] not in ok:
            raise RequestError(f"{name}: {what}", param=name, code="unsupported_value")
    for name in IDENTIFIER_FIELDS:  # not used, but OpenAI's type
        _get(body, name, lambda v: isinstance(v, str), "a string")


@dataclass
class Prepared:
    """A request checked and tokenized (on a worker thread), ready to be a Job."""
    prompts: list[list[int]]  # each prompt's ids (chat: one)
    options: GenerateOptions
    stream: bool
    include_usage: bool
    usage_so_far: bool = False  # (continuous_usage_stats) every chunk carries its choice's usage so far
    thought: ThoughtMarks | None = None  # chat: how its answer's thought is marked (None: it has none)
    n: int = 1  # choices per prompt
    echo: list[str] | None = None  # completions' echo: each prompt's text, in front of each of its choices' text
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs k (serve/app.py vllm_prompt_logprobs), where asked for
    make_constraint: Callable[[], object] | None = None
    tools: ToolPlan | None = None  # chat: the request's tools (serve/tool_calls.py)
    tokenizer: object = None  # what its answer's text is decoded with (vLLM's skip_special_tokens); None: the server's
    return_token_ids: bool = False  # (vLLM's) the prompt's and each choice's token ids in the answer
    return_tokens_as_token_ids: bool = False  # (vLLM's) the logprobs' tokens written "token_id:{id}"


def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token]) if tokenizer is not None else f"token_id:{token}"


def chat_logprobs(tokenizer, entries: list[TokenLogprob], as_ids: bool = False) -> dict:
    """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}; `bytes` the token's
    own, also for part of a character (its text is then U+FFFD), so that a client can join them into the text.
    `as_ids` (vLLM's return_tokens_as_token_ids): each token "token_id:{id}", its bytes that text's, as vLLM's."""
    tokenizer = None if as_ids else tokenizer

    def one(token: int, logprob: float) -> dict:
        text = _token_text(tokenizer, token)
        raw = tokenizer.token_bytes(token) if tokenizer is not None else text.encode()
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def client_gone() -> RequestError:
    """A generation stopped because its client's connection closed: a client that only half-closed it
    (shutdown(SHUT_WR)) reads this; a FIN is all a vanished one sends too, so either stops its generation."""
    return RequestError("the client closed its connection (or its sending side) before the answer: a generation "
                        "stops when its client's side closes; keep the connection open until the answer",
                        code="client_gone")


def cached_tokens(result) -> int:
    """The prompt tokens a generation (a GenerateResult) took from the prompt cache (runtime/prompt_cache.py)."""
    return result.stats.get("prefill", {}).get("cached_tokens", 0)
