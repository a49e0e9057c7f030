"""`moepack serve`: an OpenAI-compatible HTTP API (starlette, served by uvicorn) over one Generator.

    app = make_app(Generator("model.moepack", cache_gib=4), "model", api_key=None, max_queue=8)

Endpoints: GET /health, GET /v1/models, GET /v1/models/{id}, POST /v1/completions, POST /v1/chat/completions (stream
or not), POST /v1/responses (OpenAI's Responses API, put as a chat: serve/responses.py), POST /v1/messages and
/v1/messages/count_tokens (Anthropic's Messages API, put as a chat: serve/messages.py; its errors in Anthropic's
shape), GET /metrics (Prometheus: serve/metrics.py), POST /tokenize and /detokenize (llama-server's shapes). The API
key, where the server has one, goes in `Authorization: Bearer KEY` or (Anthropic's clients) `x-api-key: KEY`.
Every request field is acted on or refused by name (CHAT_FIELDS, COMPLETION_FIELDS, serve/openai_api.py's
REFUSED_FIELDS and check_fields); logprobs, penalties and logit_bias go to the Sampler, response_format to a JSON
constraint (serve/grammar.py), tools to the release's encoder and back out of the answer (serve/tool_calls.py).
Chat and completions answers carry llama-server's `timings`.
A model whose family has no chat encoding (Qwen3-MoE) chats through its tokenizer_config's chat template
(serve/chat_template.py): none there is a 400 naming it; tools go to a template that renders them in the
`<tool_call>` format, and are refused for one that does not.

Scheduling: with `max_batch` > 1 (`moepack serve --max-batch`, default 8) the generations go to a BatchScheduler
(runtime/batching.py): up to max_batch sequences decode together, one step feeding each its next token, a newcomer
joining between steps once its prefill is done (the newcomers' prompts prefilled together, one pass per turn of
`prefill_chunk` tokens in all while others decode), and a sequence leaving at its end or when stopped; a request's
n choices decode side by side, their prompt prefilled once (BatchScheduler's shared prefills: so too for
identical prompts that arrive together) (streamed: interleaved, each chunk's choices[0].index naming its choice,
each one's finish chunk sent as it ends; one that fails stops the others and fails the request). Each request waits
for its generations on a thread of an executor of max_queue threads. With max_batch 1 every generation runs on ONE
worker thread (a single-thread executor) through Generator.generate, in arrival order, the choices one after the other.
At most `max_queue` requests are admitted at once (reading their body, being prepared, waiting or running); one
more is answered 429 at once. A streamed answer's pieces go from the worker's `on_text` to the event loop through
an asyncio.Queue (loop.call_soon_threadsafe). A client that goes
away (stream or not) or a request past its deadline (--request-timeout) sets its job's stop flag: a job not yet
started is skipped (a client gone while it waits for the worker or, batched, its choices for a slot: dropped at
once, its --max-queue place free), a running one stops before its prefill's next layer or its next token (finish_reason
"cancelled", or "timeout" past the deadline), and its slot is free once the worker lets go of it.

Limits (ServerLimits; docs/failures.md "Server limits"): the body's size (413, counted as it is read, never
buffered past the limit), the time to send a request (headers: the connection is closed; body: 408), the prompt
and max_tokens within max_context, the stop strings' number and length, concurrent connections (503). Nothing
heavy runs on the event loop: the body is parsed (format_spec.untrusted.loads), validated and tokenized on a
worker thread (the tokenizer's batch call lets go of the GIL), its cost bounded by the body limit. A streamed
request's status comes once its generation has passed every check (its prefill's first layer starts): a bad
value is a 4xx, never a 200 followed by an error event.

Chat with thinking on (`"thinking": true`, DeepSeek's `{"thinking": {"type": "enabled"}}`, or vLLM's
`"chat_template_kwargs": {"enable_thinking": true}`): with a chat encoding the prompt ends with `<think>`; the
generated text before the first `</think>` is `reasoning_content`, the rest `content` (all of it reasoning when
`</think>` never comes). A chat template takes it as its enable_thinking (unsaid: the template's default); where the
template writes thoughts (it spells `</think>`: Qwen3's, QwQ's), the answer's thought is split off the same way,
whether its generation prompt opened it or the answer opens it with `<think>` (as vLLM's reasoning parsers do).

Errors a request causes: 4xx with OpenAI's error object {"error": {"message", "type", "param", "code"}} (under
/v1/messages, Anthropic's: {"type": "error", "error": {"type", "message"}}), a path or
method no endpoint serves included (404 / 405), and a body not sent as UTF-8 JSON (415: another charset, a
Content-Encoding). Anything else: 500, one log line, and the server goes on. A streamed answer's include_usage is
OpenAI's: usage null on every chunk (with vLLM's continuous_usage_stats: its choice's usage so far), then a chunk
of its own (choices []) with the request's usage. A browser's
page may call the API only from an origin `allowed_origins` names (CORS; none by default: its preflight, and any
request with an Origin header not named, is a 403).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import hmac
import itertools
import json
import re
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from moepack.format_spec.errors import MoepackError
from moepack.format_spec.generation_config import GENERATION_CONFIG, MAX_REPETITION_PENALTY, recommended_sampling
from moepack.format_spec.untrusted import UntrustedInputError, finite_float, int_in_range, loads
from moepack.runtime.batching import BatchScheduler
from moepack.runtime.generate import GenerateOptions, GenerateResult
from moepack.runtime.limits import DEFAULT_PREFILL_CHUNK
from moepack.runtime.prompt_cache import prompt_cache_bytes
from moepack.runtime.sampling import (MAX_TOP_LOGPROBS, REPLACEMENT, IncrementalDetokenizer, TokenLogprob,
                                      bad_word_ids, is_int)

from .chat_template import family_chat_template, tokenizer_info
from .metrics import CONTENT_TYPE, ServerMetrics, cache_counts_of
from .openai_api import (IDENTIFIER_FIELDS, Prepared, RequestError, _get, _token_text, _value, cached_tokens,
                         chat_logprobs, check_fields, client_gone)
from .reasoning import AnswerSplitter, ThoughtMarks, chat_thought, split_thinking, thought_tokens
from .messages import anthropic_error, is_messages_path, messages_endpoints, messages_error_event
from .responses import responses_endpoints, responses_error_event
from .tokenizer import ChatInputError, chat_prompt_ids, ends_open, markup_warning
from .tool_calls import ToolPlan, renders_tool_calls, split_answer, tool_plan, with_prompt_extras

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
DEFAULT_CHAT_TOKENS = 1024  # chat without max_tokens: this, within what the context leaves
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default (the request's temperature: 0 for greedy)
POLL_S = 0.25  # how often a waiting handler checks that its client is still there
MAX_BODY_DEPTH = 32  # a request body nests a few levels (messages, their content parts)
OVER_LIMIT_HEADER_S = 2.0  # a connection past --max-connections: its request must come this fast (then 503)
# a request meeting a full queue waits this long for a place before its 429: a vanished client's is given back at
# its handler's next poll, which a loaded machine may run late
ADMIT_GRACE_S = 4 * POLL_S
LINGER_BYTES = 16 << 20  # a body declared at most this far over --max-body-mb is read and dropped before its 413
MAX_TOKENS_LIMIT = 1 << 31  # max_tokens / top_k bounds before the context's
MAX_N = 8  # choices per prompt (n): side by side in a batch, else one after the other
MAX_PROMPTS_PER_REQUEST = 64  # a completions request's prompts (OpenAI's batch; lm-eval's batch size), n choices each
TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,17}")  # logit_bias's keys (18 digits: int() on them is cheap)
# The request fields each endpoint acts on: OpenAI's, and moepack's extensions `top_k` and (chat) `thinking`
# (docs/guide.md "Serving real clients"), vLLM's `ignore_eos`, `min_tokens`, `min_p`, `repetition_penalty`,
# `stop_token_ids`, `include_stop_str_in_output`, `skip_special_tokens`, `spaces_between_special_tokens`,
# `truncate_prompt_tokens`, `add_special_tokens`, `prompt_logprobs`, the structured outputs (STRUCTURED_FIELDS),
# `return_token_ids` (the prompt's and each choice's token ids beside the text), `return_tokens_as_token_ids` (the
# logprobs' tokens as "token_id:{id}"), `allowed_token_ids` (only those ids sampled) and `bad_words` (their tokens
# never completed: runtime/sampling.py's Sampler), llama-server's `cache_prompt`.
# `user`, `safety_identifier` and `prompt_cache_key` are accepted and not used (IDENTIFIER_FIELDS).
_COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "logprobs",
                  "stop", "presence_penalty", "frequency_penalty", "logit_bias", *IDENTIFIER_FIELDS, "seed", "top_k",
                  "ignore_eos", "min_tokens", "min_p", "repetition_penalty", "stop_token_ids",
                  "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                  "truncate_prompt_tokens", "add_special_tokens", "prompt_logprobs", "structured_outputs",
                  "guided_json", "guided_regex", "guided_choice", "guided_grammar", "cache_prompt",
                  "return_token_ids", "return_tokens_as_token_ids", "allowed_token_ids", "bad_words"}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                                "tool_choice", "parallel_tool_calls", "reasoning_effort", "thinking",
                                "chat_template_kwargs", "continue_final_message", "add_generation_prompt",
                                "service_tier", "store", "metadata", "modalities"}
# vLLM's structured outputs: `structured_outputs` {json | regex | choice | grammar | json_object} and the older
# guided_* fields, each an OutputSpec kind (serve/grammar.py)
STRUCTURED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                     "guided_grammar": "grammar"}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
MAX_PATTERN_CHARS = 65536  # a regular expression's or a grammar's text
MAX_CHOICES = 1024  # guided_choice's strings (MAX_PATTERN_CHARS characters in all)
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # allowed_token_ids' ids (a vocabulary's worth)
MAX_BAD_WORDS = 256  # bad_words' strings: each step looks at every distinct word length
MAX_BAD_WORD_CHARS = 256  # characters per bad word
# the generator's checks name the CLI's flags: the request's fields they stand for
FLAG_FIELDS = {"--temperature": "temperature", "--top-p": "top_p", "--top-k": "top_k", "--seed": "seed",
               "--stop": "stop", "--max-new-tokens": "max_tokens", "--presence-penalty": "presence_penalty",
               "--frequency-penalty": "frequency_penalty", "--logit-bias": "logit_bias",
               "--logprobs": "logprobs", "allowed_token_ids": "allowed_token_ids", "bad_words": "bad_words",
               "response_format": "response_format"}  # (the JSON constraint's own errors, serve/grammar.py)


@dataclass(frozen=True)
class ServerLimits:
    """What one request or connection may cost (`moepack serve`'s flags; docs/failures.md "Server limits")."""
    max_body_bytes: int = 4 << 20  # --max-body-mb 4: about the text of a 1M-token context
    max_context: int | None = None  # --max-context: prompt + max_tokens, in tokens; None: the model's context
    max_stop: int = 16  # stop strings per request
    max_stop_chars: int = 256  # characters per stop string
    read_timeout_s: float = 30.0  # --timeout-read: a request's headers (from the connection's start or its
    # previous response) and its body must each arrive within this
    keep_alive_s: float = 5.0  # --timeout-keep-alive: an idle connection between requests
    request_timeout_s: float = 600.0  # --request-timeout: from arrival to the generation's end
    max_connections: int = 256  # --max-connections: open connections; more get 503

    def __post_init__(self):
        for flag, value in (("--timeout-read", self.read_timeout_s), ("--request-timeout", self.request_timeout_s)):
            finite_float(value, flag, lo=0.0, lo_open=True)
        finite_float(self.keep_alive_s, "--timeout-keep-alive", lo=0.0)
        int_in_range(self.max_body_bytes, "--max-body-mb (in bytes)", 1, 1 << 40)
        int_in_range(self.max_connections, "--max-connections", 1, 1 << 20)


async def first_of(work, stop) -> bool:
    """Await `work` (True once it ends; its error raised) unless `stop` ends first (False: `work` cancelled)."""
    working, stopping = asyncio.ensure_future(work), asyncio.ensure_future(stop)
    try:
        done, _ = await asyncio.wait({working, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (working, stopping):
            task.cancel()  # (its error, if it ends in one as it is cancelled, retrieved: not logged as lost)
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
    if working in done:
        working.result()
        return True
    return False


def error_response(e: RequestError, path: str = ""):
    """The error's response: OpenAI's error object, Anthropic's under /v1/messages (`path`: the request's)."""
    from starlette.responses import JSONResponse

    body = anthropic_error(e) if is_messages_path(path) else e.body()
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def request_error(e: MoepackError) -> RequestError:
    """A MoepackError the request caused, as a 400 naming the request's field where the message names the CLI
    flag that stands for it (the generator's checks are the CLI's)."""
    text = str(e)
    for flag, name in FLAG_FIELDS.items():
        if text.startswith(flag):
            return RequestError(name + text[len(flag):], param=name, code="invalid_value")
    return RequestError(text, code="invalid_request")


def check_api_key(key: str | None) -> str | None:
    """The server's API key, or MoepackError: a client sends it in an HTTP header as ASCII (a key with another
    character could never be matched), its ends stripped (a space or tab there would never match either), and an
    empty one would let in anyone."""
    if key is not None and not re.fullmatch(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?", key):
        raise MoepackError("the API key (--api-key, --api-key-file or MOEPACK_API_KEY) must be printable ASCII, at "
                           "least one character, no space at its ends: an HTTP header carries it as that")
    return key


@dataclass
class Job:
    """One request's generations: what the worker thread runs, and the flags that stop it."""
    request_id: str
    prompts: list[list[int]]  # each prompt's ids (a completions request may send several)
    options: GenerateOptions
    deadline: float  # time.monotonic() past which it stops (--request-timeout)
    arrived: float = 0.0  # time.monotonic() of the request's arrival (the time to first token counts from it)
    n: int = 1  # choices per prompt: generations of their own (distinct seeds: seed, seed + 1, ... when one is given)
    make_constraint: Callable[[], object] | None = None  # each generation's own output constraint
    on_text: Callable[[int, str], None] | None = None  # a streamed job's text: (choice, piece)
    on_token: Callable[[int, int, object], None] | None = None  # its tokens: (choice, token, logprob)
    # a streamed echo's prompt logprobs, before the choice's first token: (choice, entries)
    on_prompt_logprobs: Callable[[int, list], None] | None = None
    on_start: Callable[[], None] | None = None  # called on the worker once its generation passed every check
    on_finish: Callable[[int, GenerateResult], None] | None = None  # a streamed job's choice over: (choice, result)
    queue: asyncio.Queue | None = None  # a streamed job's (kind, choice, piece) events
    began: asyncio.Event | None = None  # a streamed job's on_start, on the event loop
    cancelled: bool = False  # its client went away
    holds_place: bool = True  # its --max-queue place, given back once (its client gone, or its run over)
    running: bool = False  # on the worker (Server.run); without its place (its client gone): still in flight
    timed_out: bool = False
    started: bool = False
    first_token_s: float | None = None  # from its arrival to its first generation's first token (the log line's)
    tokenizer: object = None  # what its answer's text is decoded with (Prepared.tokenizer)

    def stopped(self) -> bool:
        if not self.timed_out and time.monotonic() > self.deadline:
            self.timed_out = True
        return self.cancelled or self.timed_out

    @property
    def choices(self) -> int:
        """Its generations: n per prompt, the i-th of prompt p choice p * n + i (OpenAI's order)."""
        return len(self.prompts) * self.n

    def ids_of(self, choice: int) -> list[int]:
        return self.prompts[choice // self.n]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompts)

    def options_for(self, choice: int) -> GenerateOptions:
        """A choice's options: its own seed (when one was given: the i-th of its prompt's seed + i, as that prompt
        sent alone) and constraint."""
        seed = self.options.seed
        return dataclasses.replace(self.options, seed=None if seed is None else (seed + choice % self.n) % 2**64,
                                   constraint=self.make_constraint() if self.make_constraint else None)

    def should_stop(self, closing: bool = False) -> bool:
        """The generator's `cancelled`: asked first before the prefill's first layer, once every check passed.
        The job starts (on_start: a stream's 200 goes out) only if it is not to stop there (`closing`: the server
        shutting down), so a job stopped before its start is answered as such (408, 503), never a 200."""
        stop = self.stopped() or closing
        if not self.started and not stop:
            self.started = True
            if self.on_start is not None:
                self.on_start()
        return stop


MAX_UNREAD_EVENTS = 4096  # a stream's events its client has not read yet: past them, it is taken as not reading


def events_onto(job: Job, loop, log: Callable[[str], None]) -> Callable[[tuple], None]:
    """How the worker thread hands a streamed job's events to its queue on the event loop. Past MAX_UNREAD_EVENTS
    unread (a client that never reads its stream: they would pile up in memory until max_tokens), the job is
    stopped as a client gone is, and logged."""
    def push(event: tuple) -> None:
        if not job.cancelled and job.queue.qsize() > MAX_UNREAD_EVENTS:
            job.cancelled = True
            log(f"moepack serve: {job.request_id} stopped: its client read none of its last {MAX_UNREAD_EVENTS} "
                "events")
        loop.call_soon_threadsafe(job.queue.put_nowait, event)
    return push


# ---- request checking -------------------------------------------------------------------------------------------

# chat_template_kwargs (vLLM's and SGLang's extension) keys moepack acts on: the thinking switch as Qwen3's and
# DeepSeek's templates name it (other keys would change a template's rendering in ways not checked here: a 400)
THINKING_KWARGS = ("enable_thinking", "thinking")


def _thinking_flag(body: dict) -> bool | None:
    """The request's thinking switch: `thinking` (true/false, or DeepSeek's {"type": "enabled" | "disabled"}) or
    chat_template_kwargs' enable_thinking / thinking (booleans); None where none says (the chat's default)."""
    v, by = body.get("thinking"), "thinking"  # (by: which field said it)
    if v is None or isinstance(v, bool):
        said = v
    elif isinstance(v, dict) and v.get("type") in ("enabled", "disabled"):
        said = v["type"] == "enabled"
    else:
        raise RequestError('thinking: expected true/false or {"type": "enabled" | "disabled"}', param="thinking",
                           code="invalid_type")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return said
    if not isinstance(kwargs, dict):
        raise RequestError("chat_template_kwargs: expected an object", param="chat_template_kwargs",
                           code="invalid_type")
    for key, value in kwargs.items():
        if key not in THINKING_KWARGS:
            raise RequestError(f"chat_template_kwargs.{key[:40]}: not supported (moepack takes "
                               f"{' / '.join(THINKING_KWARGS)})", param="chat_template_kwargs",
                               code="unsupported_parameter")
        if value is None:  # (null: unset, as elsewhere in a request)
            continue
        if not isinstance(value, bool):
            raise RequestError(f"chat_template_kwargs.{key}: expected true or false", param="chat_template_kwargs",
                               code="invalid_type")
        if said is not None and value != said:
            raise RequestError(f"chat_template_kwargs.{key} ({str(value).lower()}) and {by} disagree: give one",
                               param="chat_template_kwargs", code="invalid_value")
        said, by = value, f"chat_template_kwargs.{key}"
    return said


def _scoring_the_prompt(options: GenerateOptions, k: int | None) -> GenerateOptions:
    """The options scoring the prompt for vLLM's prompt_logprobs k too: its ranks, and k alternatives at least (an
    echo's logprobs may ask fewer: completion_logprobs' `most` cuts them)."""
    if k is None:
        return options
    return dataclasses.replace(options, prompt_logprobs=max(k, options.prompt_logprobs or 0),
                               prompt_logprob_ranks=True)


def _prompts_of(prompt) -> list:
    """completions' prompt as its prompts: a string or a list of token ids is one; a list of those is several
    (OpenAI's batch: n choices each)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return prompt
    return [prompt]


def _stream_flags(body: dict) -> tuple[bool, bool, bool]:
    """stream, stream_options' include_usage (OpenAI's) and continuous_usage_stats (vLLM's: the usage so far on
    every chunk too, with include_usage only, as vLLM has it)."""
    stream = _get(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    so = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    if so and not stream:
        raise RequestError("stream_options: only with stream: true", param="stream_options", code="invalid_value")
    flags = [so.get(name) for name in ("include_usage", "continuous_usage_stats")]
    # (null: unset, as elsewhere in a request)
    if set(so) - {"include_usage", "continuous_usage_stats"} or not all(f is None or isinstance(f, bool)
                                                                         for f in flags):
        raise RequestError("stream_options: only include_usage and continuous_usage_stats (booleans) are supported",
                           param="stream_options", code="unsupported_value")
    include, continuous = (bool(f) for f in flags)
    return stream, include, include and continuous


_LOG_LOCK = threading.Lock()


def write_log_line(line: str) -> None:
    """One line onto stderr in one write, under a lock: lines the worker threads log at once stay whole (print writes
    the text and its newline apart)."""
    with _LOG_LOCK:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


class Server:
    """The app's state: the generator, the batch scheduler or the one worker thread, the admission count, the
    limits."""

    def __init__(self, generator, model_name: str, api_key: str | None, max_queue: int,
                 log: Callable[[str], None] | None, limits: ServerLimits | None = None, max_batch: int = 1,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, sampling_defaults: str = "model",
                 prompt_cache_gib: float = 0.0):
        if max_queue < 1:
            raise MoepackError("--max-queue must be at least 1")
        cache_bytes = prompt_cache_bytes(prompt_cache_gib)
        if cache_bytes and max_batch == 1:
            raise MoepackError("--prompt-cache-gib needs --max-batch above 1 (the batch scheduler keeps the prompt "
                               "cache): give --prompt-cache-gib 0, or a --max-batch above 1")
        self.generator = generator
        self.model_name = model_name
        self.api_key = check_api_key(api_key)
        self.max_queue = max_queue
        self.limits = limits = limits or ServerLimits()
        self.log = log or write_log_line
        self.max_batch = max_batch
        self.scheduler: BatchScheduler | None = None
        self.metrics = ServerMetrics(cache_counts_of(generator), lambda: self.in_flight,
                                     lambda: self.scheduler.decoding if self.scheduler is not None else None,
                                     lambda: self.prompt_cache,
                                     lambda: self.scheduler.shared_tokens if self.scheduler is not None else None)
        self.scheduler = BatchScheduler(generator, max_batch, prefill_chunk, self.metrics.batch_size.observe,
                                        prompt_cache_bytes=cache_bytes) if max_batch > 1 else None
        self.prompt_cache = self.scheduler.prompt_cache if self.scheduler is not None else None
        # batched: each admitted request's thread waits for its generations; else the one that runs them
        self.executor = ThreadPoolExecutor(max_workers=1 if self.scheduler is None else max_queue,
                                           thread_name_prefix="moepack-generate")
        self.lock = threading.Lock()
        self.closing = threading.Event()  # set by close(): a running generation stops before its next layer or token
        self.admitted = 0  # reading, being prepared, waiting or running
        self.stopping = 0  # runs without their places (their clients left), until they stop: in flight still
        self.finished: collections.deque = collections.deque(maxlen=256)  # (request id, finish reason)
        self.created = int(time.time())
        self.counter = itertools.count(1)
        config = generator.c.config
        model_context = config.get("max_position_embeddings")
        if limits.max_context is not None and limits.max_context < 2:
            raise MoepackError(f"--max-context must be at least 2 tokens, got {limits.max_context}")
        if limits.max_context is not None and model_context and limits.max_context > model_context:
            raise MoepackError(f"--max-context {limits.max_context} exceeds the model's context of "
                               f"{model_context} tokens")
        self.context = limits.max_context or model_context
        self.vocab = config.get("vocab_size")
        self._tokenizer = None
        self._tokenizer_error: str | None = None
        self._tokenizer_lock = threading.Lock()
        self.family = generator.family
        # the family's chat encoder (DeepSeek-V4's: markup rendered in code, thinking, tools), else None
        self.encoding = self.family.chat_encoding
        # without one (Qwen3-MoE): its chat template (serve/chat_template.py), compiled at the first chat
        self._chat_template = None
        self._chat_template_error: str | None = None
        self._grammar = None  # serve.grammar.JsonGrammar, built at the first response_format
        self._grammar_lock = threading.Lock()
        # what a request that omits temperature / top_p / top_k samples with: OpenAI's defaults, or over them the
        # model's own recommendation (its generation_config.json, as vLLM and transformers take it)
        self.sampling_defaults = {"temperature": DEFAULT_TEMPERATURE, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                  "repetition_penalty": 1.0}
        if sampling_defaults not in ("model", "openai"):
            raise MoepackError(f"--sampling-defaults: expected model or openai, got {sampling_defaults!r}")
        if sampling_defaults == "model":
            recommended, notes = recommended_sampling(generator.c.tokenizer_json(GENERATION_CONFIG))
            self.sampling_defaults.update(recommended)
            for note in notes:
                self.log(f"moepack serve: warning: {note}")
            if recommended:
                said = ", ".join(f"{k} is {v}" for k, v in recommended.items())
                self.log(f"moepack serve: a request's omitted {said} (the model's generation_config.json; "
                         "--sampling-defaults openai: OpenAI's)")

    # -- helpers
    @property
    def in_flight(self) -> int:
        """Requests admitted, and runs still stopping after their client left (/health, /metrics)."""
        with self.lock:
            return self.admitted + self.stopping

    @property
    def tokenizer(self):
        with self._tokenizer_lock:  # loaded once, by whichever preparing thread comes first
            if self._tokenizer is None and self._tokenizer_error is None:
                from .tokenizer import PromptTokenizer

                try:
                    self._tokenizer = PromptTokenizer(self.generator.c)
                except MoepackError as e:
                    self._tokenizer_error = str(e)
                else:
                    warning = markup_warning(self.family, self._tokenizer)
                    if warning:  # once, as the tokenizer loads (at the first request that needs it)
                        self.log(f"moepack serve: warning: {warning}")
        return self._tokenizer

    def need_tokenizer(self, param: str):
        tok = self.tokenizer
        if tok is None:
            raise RequestError(f"{param}: the model's container carries no tokenizer ({self._tokenizer_error}): "
                               "give the prompt as token ids", param=param, code="no_tokenizer")
        return tok

    def json_grammar(self, param: str = "response_format"):
        """The vocabulary's grammar side (llguidance), built once; a 400 naming the extra to install (and `param`, the
        field that asked for it) without it."""
        from .grammar import GrammarUnavailable, JsonGrammar

        tok = self.need_tokenizer(param)
        with self._grammar_lock:
            if self._grammar is None:
                try:
                    self._grammar = JsonGrammar(tok.tokenizer_json, self.vocab or tok.vocab_size,
                                                sorted(self.generator.eos_ids))
                except GrammarUnavailable as e:
                    raise RequestError(f"{param}: {e}", param=param, code="unsupported_value") from None
        return self._grammar

    def output_schema(self, body: dict) -> dict | None:
        """The JSON schema response_format asks for (json_object: any object), None for text."""
        from .grammar import ANY_OBJECT

        fmt = _get(body, "response_format", lambda v: isinstance(v, dict), "an object")
        kind = None if fmt is None else fmt.get("type")
        # OpenAI's keys (json_schema's `strict` asks for no more than the constraint does); another is refused
        # by name rather than left unread
        unread = [] if fmt is None else sorted(set(fmt) - {"type", "json_schema"})
        spec = None if fmt is None else fmt.get("json_schema")
        if isinstance(spec, dict):
            unread += [f"json_schema.{k}" for k in sorted(set(spec) - {"name", "description", "schema", "strict"})]
        if unread:
            raise RequestError(f"response_format.{unread[0][:40]}: not a response_format key moepack reads",
                               param="response_format", code="unknown_field")
        if kind in (None, "text"):
            return None
        if kind == "json_object":
            return ANY_OBJECT
        if kind == "json_schema":
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise RequestError("response_format.json_schema.schema: expected a JSON schema object",
                                   param="response_format", code="invalid_type")
            return schema
        raise RequestError(f"response_format.type: expected text, json_object or json_schema, got "
                           f"{json.dumps(kind)[:40]}", param="response_format", code="invalid_value")

    def structured_output(self, body: dict):
        """vLLM's structured outputs (`structured_outputs`, or one of the older guided_* fields) as an OutputSpec,
        None where none is asked for; two of them, or a value of the wrong type, a 400 naming the field."""
        from .grammar import ANY_OBJECT, OutputSpec

        given = [f for f in ("structured_outputs", *STRUCTURED_FIELDS) if body.get(f) is not None]
        if len(given) > 1:
            raise RequestError(f"{given[1]}: give one structured output (this request also has {given[0]})",
                               param=given[1], code="invalid_value")
        if not given:
            return None
        field = given[0]
        if field == "structured_outputs":
            so = _get(body, field, lambda v: isinstance(v, dict), "an object")
            unread = sorted(set(so) - set(STRUCTURED_KEYS))
            if unread:
                raise RequestError(f"structured_outputs.{unread[0][:40]}: not a key moepack reads (it takes "
                                   f"{', '.join(STRUCTURED_KEYS)})", param=field, code="unknown_field")
            asked = [k for k in STRUCTURED_KEYS if so.get(k) not in (None, False)]
            if len(asked) != 1:
                raise RequestError(f"structured_outputs: give exactly one of {', '.join(STRUCTURED_KEYS)}",
                                   param=field, code="invalid_value")
            kind, value, where = asked[0], so[asked[0]], f"structured_outputs.{asked[0]}"
            if kind == "json_object":
                if value is not True:
                    raise RequestError("structured_outputs.json_object: expected true", param=field,
                                       code="invalid_type")
                return OutputSpec("json", ANY_OBJECT, field)
        else:
            kind, value, where = STRUCTURED_FIELDS[field], body[field], field
        if kind == "json" and isinstance(value, str):  # (vLLM takes a schema as its JSON text too)
            try:
                value = loads(value, where)
            except UntrustedInputError as e:
                raise RequestError(str(e)[:200], param=field, code="invalid_value") from None
        ok = {"json": lambda v: isinstance(v, dict),
              "choice": lambda v: isinstance(v, list) and 0 < len(v) <= MAX_CHOICES and all(
                  isinstance(c, str) and c for c in v) and sum(map(len, v)) <= MAX_PATTERN_CHARS}.get(
            kind, lambda v: isinstance(v, str) and 0 < len(v) <= MAX_PATTERN_CHARS)
        if not ok(value):
            what = {"json": "a JSON schema object",
                    "choice": f"a list of 1 to {MAX_CHOICES} non-empty strings, {MAX_PATTERN_CHARS} characters in all"
                    }.get(kind, f"a non-empty string of at most {MAX_PATTERN_CHARS} characters")
            raise RequestError(f"{where}: expected {what}", param=field, code="invalid_type")
        return OutputSpec(kind, value, field)

    def output_spec(self, body: dict):
        """What the answer must be (an OutputSpec): response_format's JSON (chat), or vLLM's structured outputs;
        None for free text; both at once a 400."""
        from .grammar import OutputSpec

        schema = self.output_schema(body)
        structured = self.structured_output(body)
        if schema is not None and structured is not None:
            raise RequestError(f"{structured.field}: give either response_format or a structured output",
                               param=structured.field, code="invalid_value")
        return OutputSpec("json", schema) if schema is not None else structured

    def constraint_factory(self, body: dict, thought: ThoughtMarks | None,
                           max_tokens: int) -> Callable[[], object] | None:
        """Each generation's constraint for the request's response_format or structured output (compiled and probed
        once here, so that a spec llguidance refuses, or no answer within max_tokens could satisfy, is this
        request's 400); a thought the prompt opened runs free until its end (one the answer may open: none, the
        constrained answer comes first)."""
        spec = self.output_spec(body)
        if spec is None:
            return None
        # (past the answer's end the grammar allows no token but the end of sentence)
        held = next((field for field in ("ignore_eos", "min_tokens") if body.get(field)), None)
        if held is not None:
            raise RequestError(f"{held}: a {spec.field}'s answer ends with the end of sentence",
                               param=held, code="unsupported_value")
        grammar = self.json_grammar(spec.field)
        opened = thought is not None and thought.start is None
        after = self.need_tokenizer(spec.field).encode_special(thought.end) if opened else None
        try:
            grammar.check(spec, max_tokens)  # (it compiles the spec: one llguidance refuses is this 400)
        except MoepackError as e:
            raise RequestError(f"{spec.field}: {e}", param=spec.field, code="invalid_value") from None
        return lambda: grammar.constraint(spec, after)

    def check_auth(self, request) -> None:
        """The API key, as `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's): either
        one given and right lets the request in. One x-api-key header is read (as one Authorization): a request
        with many could try many keys at once."""
        if self.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        # the scheme's case is the client's (RFC 9110); the key compared in a time that does not tell how much of
        # it matched
        given = [key] if scheme.lower() == "bearer" else []
        given += [request.headers["x-api-key"]] if "x-api-key" in request.headers else []
        if not any(hmac.compare_digest(k.strip().encode(), self.api_key.encode()) for k in given):
            raise RequestError("invalid or missing API key (Authorization: Bearer KEY, or x-api-key: KEY)",
                               status=401, kind="invalid_request_error", code="invalid_api_key")

    async def read_body(self, request) -> bytes:
        """The request's body, refused (413) once over --max-body-mb: by its Content-Length up front (a body
        declared within LINGER_BYTES of the limit read and dropped first, discard_body), else as the bytes of a
        chunked body come (never more than the limit is held or read); 408 when it does not arrive within
        --timeout-read. Both responses close the connection."""
        from starlette.requests import ClientDisconnect

        limit = self.limits.max_body_bytes
        too_large = RequestError(f"the request body is over the limit of {limit} bytes ({limit / 2**20:g} MB, "
                                 "--max-body-mb)", code="body_too_large", status=413,
                                 headers={"Connection": "close"})
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            if int(declared) <= limit + LINGER_BYTES:
                await self.discard_body(request)
            raise too_large
        body = bytearray()

        async def read() -> None:
            async for chunk in request.stream():
                if len(body) + len(chunk) > limit:
                    raise too_large
                body.extend(chunk)
        try:
            async with asyncio.timeout(self.limits.read_timeout_s):
                if not await first_of(read(), self.closed()):  # a slow body does not hold up a shutdown
                    stopped = self.stopped_error(None)
                    stopped.headers["Connection"] = "close"
                    raise stopped
        except TimeoutError:
            raise RequestError(f"the request body did not arrive within {self.limits.read_timeout_s:g} s "
                               "(--timeout-read)", code="request_timeout", status=408,
                               headers={"Connection": "close"}) from None
        except ClientDisconnect:
            raise RequestError("the client went away while sending its body", code="client_gone") from None
        self.check_body_encoding(request.headers)
        return bytes(body)

    async def closed(self) -> None:
        """Returns once the server is closing (its flag is set by the signal handler: looked at every POLL_S)."""
        while not self.closing.is_set():
            await asyncio.sleep(POLL_S)

    @staticmethod
    def check_body_encoding(headers) -> None:
        """A body declared in a charset other than UTF-8, or compressed, is a 415 naming it: read as UTF-8 JSON it
        would be refused for bytes the client did not get wrong, or (a Latin-1 text that happens to be valid UTF-8,
        a Content-Encoding on an uncompressed body) read as other text than the client meant."""
        def refused(what: str) -> RequestError:
            return RequestError(what[:120], code="unsupported_media_type", status=415)

        for param in headers.get("content-type", "").split(";")[1:]:
            name, _, value = param.partition("=")
            charset = value.strip().strip('"')
            if name.strip().lower() == "charset" and charset.lower() not in ("utf-8", "utf8"):
                raise refused(f"Content-Type charset {charset}: the request body must be JSON in UTF-8")
        encoding = headers.get("content-encoding", "").strip()
        if encoding and encoding.lower() != "identity":
            raise refused(f"Content-Encoding {encoding}: the request body must be sent uncompressed")

    async def discard_body(self, request) -> None:
        """Read and drop a refused body, within --timeout-read: a connection closed with request bytes unread is
        reset, and the reset can destroy the response before the client has read it (an honest client a little
        over the limit would see its connection dropped, not its 413)."""
        from starlette.requests import ClientDisconnect

        try:
            async with asyncio.timeout(self.limits.read_timeout_s):
                async for _ in request.stream():
                    pass
        except (TimeoutError, ClientDisconnect):
            pass

    def json_object(self, raw: bytes) -> dict:
        """The body as a JSON object (format_spec.untrusted.loads: depth, number length, NaN, UTF-8, surrogates, a
        key given twice)."""
        try:
            body = loads(raw, "the request body", max_bytes=self.limits.max_body_bytes, max_depth=MAX_BODY_DEPTH,
                         unique_keys=True)
        except UntrustedInputError as e:
            raise RequestError(str(e), code="invalid_json") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object", code="invalid_json")
        return body

    def small_body(self, raw: bytes, fields: set[str]) -> dict:
        """A /tokenize-like body: a JSON object of these fields only (another is a 400 naming it)."""
        body = self.json_object(raw)
        for name in body:
            if name not in fields:
                raise RequestError(f"{name[:60]}: unknown field (expected {', '.join(sorted(fields))})",
                                   param=name[:60], code="unknown_field")
        return body

    def parse(self, raw: bytes, chat: bool) -> dict:
        """The body as a JSON object, every field one this endpoint acts on (else a 400 naming it), its model
        checked."""
        body = self.json_object(raw)
        self.check_model(body)
        if chat:
            check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
        else:
            check_fields(body, COMPLETION_FIELDS, "/v1/completions")
        return body

    def check_model(self, body: dict) -> None:
        """A request's `model`, where given, must be this server's (else a 404 naming it)."""
        model = _get(body, "model", lambda v: isinstance(v, str), "a string")
        if model is not None and model != self.model_name:
            raise RequestError(f"the model {model[:80]!r} does not exist (this server has {self.model_name!r})",
                               param="model", code="model_not_found", status=404)

    def stop_strings(self, body: dict) -> list[str]:
        stop = _get(body, "stop", lambda v: isinstance(v, str) or isinstance(v, list)
                    and all(isinstance(s, str) for s in v), "a string or a list of strings", [])
        stop = [stop] if isinstance(stop, str) else stop
        most, longest = self.limits.max_stop, self.limits.max_stop_chars
        if len(stop) > most:
            raise RequestError(f"stop: {len(stop)} stop strings, over the limit of {most}", param="stop",
                               code="too_many_stop_strings")
        if any(len(s) > longest for s in stop):
            raise RequestError(f"stop: a stop string of {max(map(len, stop))} characters, over the limit of "
                               f"{longest}", param="stop", code="stop_string_too_long")
        if any(not s for s in stop):
            raise RequestError("stop: an empty stop string", param="stop", code="invalid_value")
        if stop:
            self.need_tokenizer("stop")
        return stop

    def stop_token_ids(self, body: dict) -> tuple[int, ...]:
        """vLLM's stop_token_ids: ids of the vocabulary that end the answer as the end of sentence does."""
        ids = _get(body, "stop_token_ids", lambda v: isinstance(v, list) and all(is_int(i) for i in v),
                   "a list of token ids", [])
        if len(ids) > self.limits.max_stop:
            raise RequestError(f"stop_token_ids: {len(ids)} ids, over the limit of {self.limits.max_stop}",
                               param="stop_token_ids", code="invalid_value")
        self.check_in_vocabulary(ids, "stop_token_ids", "stop_token_ids")
        return tuple(ids)

    def check_in_vocabulary(self, ids: list[int], where: str, param: str) -> None:
        """A 400 naming `param` where an id lies outside the model's vocabulary."""
        if self.vocab and any(not 0 <= i < self.vocab for i in ids):
            raise RequestError(f"{where}: token ids must lie in [0, {self.vocab})", param=param, code="invalid_value")

    def allowed_token_ids(self, body: dict, forced_call: bool) -> tuple[int, ...] | None:
        """vLLM's allowed_token_ids: the only ids the answer may hold (at least one, within the vocabulary). Beside a
        constraint (response_format, a structured output, a forced tool call) it is refused: the constraint alone
        says which tokens may come next, and the two could leave none."""
        ids = _get(body, "allowed_token_ids", lambda v: isinstance(v, list) and 0 < len(v) <= MAX_ALLOWED_TOKEN_IDS
                   and all(is_int(i) for i in v), f"a list of 1 to {MAX_ALLOWED_TOKEN_IDS} token ids")
        if ids is None:
            return None
        self.check_in_vocabulary(ids, "allowed_token_ids", "allowed_token_ids")
        spec = self.output_spec(body)
        if spec is not None or forced_call:
            by = "a forced tool call (tool_choice)" if forced_call else spec.field
            raise RequestError(f"allowed_token_ids: {by} already decides which tokens may come next (the two could "
                               "leave none): give one of them", param="allowed_token_ids", code="unsupported_value")
        return tuple(ids)

    def bad_words(self, body: dict) -> tuple[tuple[int, ...], ...]:
        """vLLM's bad_words as the token sequences the Sampler bans (sampling.bad_word_ids: each word at the text's
        start and after a space), tokenized as vLLM does (no special tokens added; a special token's text is it)."""
        words = _get(body, "bad_words", lambda v: isinstance(v, list) and len(v) <= MAX_BAD_WORDS and all(
            isinstance(w, str) and w.strip() and len(w) <= MAX_BAD_WORD_CHARS for w in v),
            f"a list of at most {MAX_BAD_WORDS} strings, not blank, of at most {MAX_BAD_WORD_CHARS} characters", [])
        if not words:
            return ()
        tok = self.need_tokenizer("bad_words")
        try:
            sequences = bad_word_ids(words, tok.encode_special)
        except MoepackError as e:
            raise RequestError(str(e), param="bad_words", code="invalid_value") from None
        self.check_in_vocabulary([t for ids in sequences for t in ids], "bad_words", "bad_words")
        return sequences

    @staticmethod
    def token_flags(body: dict) -> dict:
        """vLLM's return_token_ids and return_tokens_as_token_ids (Prepared's fields of those names)."""
        return {name: _get(body, name, lambda v: isinstance(v, bool), "a boolean", False)
                for name in ("return_token_ids", "return_tokens_as_token_ids")}

    def max_tokens(self, body: dict) -> int | None:
        max_tokens = _value(body, "max_tokens", int_in_range, 1, MAX_TOKENS_LIMIT)
        completion = _value(body, "max_completion_tokens", int_in_range, 1, MAX_TOKENS_LIMIT)
        if max_tokens is not None and completion is not None and max_tokens != completion:
            raise RequestError("max_tokens and max_completion_tokens differ: give one", param="max_completion_tokens",
                               code="invalid_value")
        return completion if completion is not None else max_tokens

    def logit_bias(self, body: dict) -> dict[int, float] | None:
        """OpenAI's logit_bias: {"token id": bias in [-100, 100]}, the ids within the vocabulary."""
        bias = _get(body, "logit_bias", lambda v: isinstance(v, dict), "an object of token id -> bias")
        if not bias:
            return None
        out = {}
        for key, value in bias.items():
            # a token id as a JSON encoder writes one: ASCII digits, no sign, blank or leading zero (str.isdigit
            # takes "²", which int() refuses, and "٣", which it reads as 3; "05" and "5" would be one id)
            if not TOKEN_ID_KEY.fullmatch(key) or (self.vocab and int(key) >= self.vocab):
                raise RequestError(f"logit_bias: {key[:20]!r} is not a token id in [0, {self.vocab})",
                                   param="logit_bias", code="invalid_value")
            out[int(key)] = _value({"logit_bias": value}, "logit_bias", finite_float, lo=-100.0, hi=100.0)
        return out

    @staticmethod
    def min_tokens(body: dict, max_tokens: int) -> int:
        """vLLM's min_tokens: the end of sentence held back until that many tokens were generated, and a stop
        string ending before then not acted on (as vLLM checks none); at most max_tokens."""
        least = _value(body, "min_tokens", int_in_range, 0, MAX_TOKENS_LIMIT, default=0)
        if least > max_tokens:
            raise RequestError(f"min_tokens: {least} is over max_tokens ({max_tokens})", param="min_tokens",
                               code="invalid_value")
        return least

    @staticmethod
    def logprobs_count(body: dict, chat: bool) -> int | None:
        """How many alternatives per token (None: no logprobs). Chat: logprobs true with top_logprobs k;
        completions: logprobs k."""
        if not chat:
            return _value(body, "logprobs", int_in_range, 0, MAX_TOP_LOGPROBS)
        on = _get(body, "logprobs", lambda v: isinstance(v, bool), "a boolean", False)
        top = _value(body, "top_logprobs", int_in_range, 0, MAX_TOP_LOGPROBS)
        if top is not None and not on:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        return (top or 0) if on else None

    def options(self, body: dict, n_prompt: int, default_tokens: int, chat: bool, n: int = 1,
                forced_call: bool = False) -> GenerateOptions:
        max_tokens = self.max_tokens(body)
        if n_prompt == 0:
            raise RequestError("empty prompt", param="prompt" if "prompt" in body else "messages",
                               code="empty_prompt")
        if self.context and n_prompt >= self.context:
            raise RequestError(f"the prompt is {n_prompt} tokens: this server's max_context is {self.context} "
                               "tokens (--max-context)", param="prompt" if "prompt" in body else "messages",
                               code="context_length_exceeded")
        room = self.context - n_prompt if self.context else None
        if max_tokens is None:
            max_tokens = default_tokens if room is None else min(default_tokens, room)
        elif room is not None and max_tokens > room:
            raise RequestError(f"the prompt ({n_prompt} tokens) and max_tokens ({max_tokens}) exceed this server's "
                               f"max_context of {self.context} tokens (--max-context)", param="max_tokens",
                               code="context_length_exceeded")
        defaults = self.sampling_defaults
        temperature = _value(body, "temperature", finite_float, lo=0.0, default=defaults["temperature"])
        top_p = _value(body, "top_p", finite_float, lo=0.0, hi=1.0, lo_open=True, default=defaults["top_p"])
        # (-1: off, as vLLM spells it)
        top_k = max(0, _value(body, "top_k", int_in_range, -1, MAX_TOKENS_LIMIT, default=defaults["top_k"]))
        seed = _value(body, "seed", int_in_range, -1, 2**64 - 1)
        seed = None if seed == -1 else seed  # (-1: a seed of its own, as llama.cpp's clients spell it)
        penalties = {name: _value(body, name, finite_float, lo=-2.0, hi=2.0, default=0.0)
                     for name in ("presence_penalty", "frequency_penalty")}
        penalties["repetition_penalty"] = _value(body, "repetition_penalty", finite_float, lo=0.0,
                                                 hi=MAX_REPETITION_PENALTY, lo_open=True,
                                                 default=defaults["repetition_penalty"])
        min_p = _value(body, "min_p", finite_float, lo=0.0, hi=1.0, default=defaults["min_p"])
        options = GenerateOptions(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                  min_p=min_p, seed=seed, stop=tuple(self.stop_strings(body)),
                                  stop_token_ids=self.stop_token_ids(body),
                                  logit_bias=self.logit_bias(body),
                                  min_new_tokens=self.min_tokens(body, max_tokens),
                                  logprobs=self.logprobs_count(body, chat), **penalties,
                                  stop_at_eos=not _get(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean",
                                                       False),
                                  include_stop=_get(body, "include_stop_str_in_output", lambda v: isinstance(v, bool),
                                                    "a boolean", False),
                                  cache_prompt=_get(body, "cache_prompt", lambda v: isinstance(v, bool), "a boolean",
                                                    True),
                                  allowed_token_ids=self.allowed_token_ids(body, forced_call),
                                  bad_words=self.bad_words(body))
        banned = {ids[0] for ids in options.bad_words if len(ids) == 1}
        if options.allowed_token_ids is not None and banned.issuperset(options.allowed_token_ids):
            raise RequestError("bad_words: they ban every one of allowed_token_ids", param="bad_words",
                               code="invalid_value")
        if n > 1 and temperature == 0:
            raise RequestError(f"n: {n} greedy choices would all be the same: give a temperature above 0",
                               param="n", code="invalid_value")
        try:  # the generator's own checks, here and not after the response has begun
            options.sampler()
        except MoepackError as e:
            raise request_error(e) from None
        return options

    def choices(self, body: dict) -> int:
        """n (choices: generations of their own) and completions' best_of (only equal to n: no ranking)."""
        n = _value(body, "n", int_in_range, 1, MAX_N, default=1)
        best_of = _value(body, "best_of", int_in_range, 1, MAX_N)
        if best_of is not None and best_of != n:
            raise RequestError("best_of: ranking more generations than are returned is not supported (give best_of "
                               "equal to n, or leave it out)", param="best_of", code="unsupported_value")
        return n

    def echo_text(self, body: dict, prompts: list[list[int]], cut: list[bool]) -> list[str] | None:
        """completions' echo: each prompt's own text (or its ids' text, also where truncate_prompt_tokens `cut` it),
        in front of its answers."""
        if not _get(body, "echo", lambda v: isinstance(v, bool), "a boolean", False):
            return None
        return [p if isinstance(p, str) and not c else self.need_tokenizer("echo").decode(ids)
                for p, ids, c in zip(_prompts_of(body["prompt"]), prompts, cut)]

    def truncated(self, body: dict, prompts: list[list[int]], default_tokens: int,
                  leading: Sequence[int] = ()) -> tuple[list[list[int]], list[bool]]:
        """vLLM's truncate_prompt_tokens k: each prompt's last k tokens (-1: as many as leave the answer room in the
        server's context, max_tokens or else the endpoint's `default_tokens`, as vLLM's -1 is the context less
        max_tokens); and which were cut. `leading`: how many tokens the tokenizer put in front of each prompt (a
        text prompt's BOS), kept in front of the k (as the tokenizer's own truncation in vLLM keeps them)."""
        keep = _value(body, "truncate_prompt_tokens", int_in_range, -1, MAX_TOKENS_LIMIT)
        if keep == 0 or keep is not None and self.context and keep > self.context:
            within = f"[1, {self.context}] (the context)" if self.context else "at least 1"
            raise RequestError(f"truncate_prompt_tokens: {keep} is not a number of tokens {within}, or -1 for what "
                               "the context holds beside the answer", param="truncate_prompt_tokens",
                               code="invalid_value")
        if keep == -1:  # (a prompt of the whole context had been kept: no room for any answer, always a 400)
            answer = self.max_tokens(body) or default_tokens
            keep = max(1, self.context - min(answer, self.context - 1)) if self.context else None
        cut = [bool(keep) and len(ids) > keep for ids in prompts]
        leading = list(leading) or [0] * len(prompts)
        return [ids[:lead] + ids[len(ids) - max(keep - lead, 0):] if c else ids
                for ids, c, lead in zip(prompts, cut, leading)], cut

    def answer_tokenizer(self, body: dict, markup: Sequence[str] = ()):
        """What the answer's text is decoded with: the tokenizer, or (vLLM's skip_special_tokens) it leaving out the
        special tokens but those in the chat's own `markup` (its thought's marks, its tool calls': what the answer is
        split at); by default, as vLLM's and OpenAI's answers, where the model has a tokenizer. vLLM's
        spaces_between_special_tokens changes nothing with a fast tokenizer: either is taken."""
        _get(body, "spaces_between_special_tokens", lambda v: isinstance(v, bool), "a boolean")
        skip = _get(body, "skip_special_tokens", lambda v: isinstance(v, bool), "a boolean", None)
        if skip is False or skip is None and self.tokenizer is None:
            return self.tokenizer
        return self.need_tokenizer("skip_special_tokens").skipping_specials(markup)

    def prompts(self, body: dict) -> list[list[int]]:
        """completions' prompts' ids: one prompt, or OpenAI's batch of them (at most MAX_PROMPTS_PER_REQUEST)."""
        given = _prompts_of(body.get("prompt"))
        if len(given) > MAX_PROMPTS_PER_REQUEST:
            raise RequestError(f"prompt: {len(given)} prompts, more than the {MAX_PROMPTS_PER_REQUEST} one request "
                               "takes", param="prompt", code="invalid_value")
        add_bos = _get(body, "add_special_tokens", lambda v: isinstance(v, bool), "a boolean")
        return [self.prompt_ids(p, "prompt" if len(given) == 1 else f"prompt[{i}]", add_bos)
                for i, p in enumerate(given)]

    def prompt_ids(self, prompt, where: str, add_bos: bool | None = None) -> list[int]:
        """One prompt's ids (`where`: how a message names it; `add_bos`: vLLM's add_special_tokens, None: as the
        tokenizer's config says)."""
        if isinstance(prompt, str):
            if not prompt:  # the tokenizer's BOS alone is nobody's prompt (the CLI refuses it too)
                raise RequestError(f"{where}: empty prompt", param="prompt", code="empty_prompt")
            # a client's text: a special token's text stays text (token ids are the way to send special tokens)
            return self.need_tokenizer("prompt").encode(prompt, special_tokens=False, add_bos=add_bos)
        if isinstance(prompt, list) and all(is_int(i) for i in prompt):
            if not prompt:
                raise RequestError(f"{where}: empty prompt", param="prompt", code="empty_prompt")
            self.check_in_vocabulary(prompt, where, "prompt")
            return list(prompt)
        # (a list holding a number that is no integer, a bool, a string among ids: a prompt of the wrong type)
        got = json.dumps(prompt)
        raise RequestError(f"{where}: expected a string or a list of integer token ids, got "
                           f"{got if len(got) <= 60 else got[:57] + '...'}", param="prompt", code="invalid_type")

    def chat_template(self):
        """The model's chat template (its family has no chat encoding), compiled once; a 400 naming what is
        missing where it has none."""
        with self._tokenizer_lock:
            if self._chat_template is None and self._chat_template_error is None:
                try:
                    self._chat_template = family_chat_template(self.generator.c, self.family)
                except MoepackError as e:
                    self._chat_template_error = str(e)
        if self._chat_template is None:
            raise RequestError(f"messages: {self._chat_template_error}: use /v1/completions with a prompt",
                               param="messages", code="no_chat_template")
        return self._chat_template

    def check_template_tools(self, body: dict) -> None:
        """A 400 for tools or tool_choice where the model's chat template renders no tools in the `<tool_call>`
        format (the one serve/tool_calls.py parses)."""
        field = next((f for f in ("tools", "tool_choice") if body.get(f) is not None), None)
        if field is not None and not renders_tool_calls(self.chat_template()):
            raise RequestError(f"{field}: the {self.family.name} model's chat template renders no tools (in the "
                               "<tool_call> format moepack parses)", param=field, code="unsupported_parameter")

    def chat_ids(self, body: dict) -> tuple[list[int], ThoughtMarks | None, ToolPlan]:
        """The conversation's prompt ids (chat_prompt_ids, as `moepack generate` encodes it: the request's tools and
        response_format where the family's encoder puts them, a forced tool call's start after it), how the
        answer's thought is marked (None: it has none; a forced call's start closed it), the tool plan. A family
        without its own encoding chats through its template: tools where the template renders them in the
        `<tool_call>` format (serve/tool_calls.py), a thought where it writes one (ChatTemplate.opens_thought)."""
        messages = body.get("messages")
        thinking = _thinking_flag(body)
        effort = _get(body, "reasoning_effort", lambda v: isinstance(v, str), "a string")
        continue_final = self.continues_final(body) or self.left_open_by_its_message(body)
        encoding, plan, after, inserted = self.encoding, ToolPlan(None, False), (), 0
        if isinstance(messages, list) and messages:
            if encoding is None:
                self.check_template_tools(body)
            try:
                plan = tool_plan(encoding, body.get("tools"), body.get("tool_choice"),
                                 body.get("parallel_tool_calls"), thinking)
            except MoepackError as e:
                param = str(e).split(":")[0].split("[")[0]
                raise RequestError(str(e), param=param if param in body else "tools", code="invalid_value") from None
            if encoding is None:
                after = [(plan.prefill, True)] if plan.prefill else ()
            else:
                fmt = body.get("response_format") if self.output_schema(body) is not None else None
                extended = with_prompt_extras(messages, plan.tools, fmt)
                inserted, messages = len(extended) - len(messages), extended
                after = encoding.markup_segments(plan.prefill)
        spec = self.output_spec(body)
        if spec is not None and plan.prefill:  # (the constraint would begin inside the call's markup: no call made)
            raise RequestError(f"{spec.field}: a constrained answer cannot be a forced tool call (tool_choice "
                               f"{json.dumps(body.get('tool_choice'))[:60]}): give one of them",
                               param=spec.field, code="unsupported_value")
        if continue_final and (plan.prefill or spec is not None):
            field = "tool_choice" if plan.prefill else spec.field
            raise RequestError(f"{field}: continue_final_message goes on from the assistant's text, where a "
                               f"{'forced tool call' if plan.prefill else 'constrained answer'} would have to begin",
                               param=field, code="unsupported_value")
        try:
            ids = chat_prompt_ids(self.family, lambda: self.need_tokenizer("messages"), messages, thinking=thinking,
                                  reasoning_effort=effort, template=self.chat_template, after=after,
                                  tools=plan.tools if encoding is None else None, continue_final=continue_final)
        except ChatInputError as e:
            # a bad message named by its index in the request, not in the conversation with a system message put
            # first for the tools / response_format
            said = re.sub(r"^messages\[(\d+)\]", lambda m: f"messages[{int(m[1]) - inserted}]", str(e))
            raise RequestError(said, param=e.param, code=e.code) from None
        # (a forced call's start closed the thought)
        return ids, None if plan.prefill else chat_thought(self.family, self.chat_template, thinking,
                                                           continue_final), plan

    def next_turn_prefix(self, body: dict, ids: list[int]) -> int | None:
        """How many of a chat prompt's ids its next turn renders again (the conversation, an answer and another
        question): the prompt cache keeps the state there too. Less than all of them where the generation prompt
        opens a thought that an earlier turn drops (DeepSeek-V4's thinking `<think>`, Qwen3's closed empty one with
        thinking off). None where the next turn cannot be rendered."""
        messages = body.get("messages")
        if not isinstance(messages, list) or self.continues_final(body) or ends_open(messages):
            return None
        turn = [{"role": "assistant", "content": "x"}, {"role": "user", "content": "x"}]
        try:
            after, _, _ = self.chat_ids({**body, "messages": [*messages, *turn]})
        except (RequestError, MoepackError):
            return None
        return next((i for i, (a, b) in enumerate(zip(ids, after)) if a != b), min(len(ids), len(after)))

    @staticmethod
    def continues_final(body: dict) -> bool:
        """vLLM's continue_final_message (the answer goes on from the final assistant message's text) and
        add_generation_prompt (true, its default, opens a new assistant turn: not with the former)."""
        go_on = _get(body, "continue_final_message", lambda v: isinstance(v, bool), "a boolean", False)
        opens = _get(body, "add_generation_prompt", lambda v: isinstance(v, bool), "a boolean")
        if go_on and opens:
            raise RequestError("add_generation_prompt: a new assistant turn cannot both open and continue the final "
                               "message (continue_final_message): give false", param="add_generation_prompt",
                               code="invalid_value")
        if opens is False and not go_on:
            raise RequestError("add_generation_prompt: false is taken with continue_final_message: true (a prompt "
                               "that opens no assistant turn would have the model go on with the last message)",
                               param="add_generation_prompt", code="unsupported_value")
        return go_on

    @staticmethod
    def left_open_by_its_message(body: dict) -> bool:
        """Whether the conversation's final message says it is left open (its `wo_eos`, the release encoder's
        field); a request that also says otherwise (continue_final_message false, add_generation_prompt true) is
        a 400 rather than one of them silently winning."""
        if not ends_open(body.get("messages")):
            return False
        said = next((f for f, v in (("continue_final_message", False), ("add_generation_prompt", True))
                     if body.get(f) is v), None)
        if said is not None:
            raise RequestError(f"{said}: the final message's wo_eos leaves it open to be continued, and {said} "
                               f"{str(body[said]).lower()} says otherwise: give one", param=said,
                               code="invalid_value")
        return True

    @staticmethod
    def prompt_logprobs(body: dict, stream: bool) -> int | None:
        """vLLM's prompt_logprobs k: each prompt token's log-probability, rank and k likeliest (-1, all of the
        vocabulary's, is not served; nor, as in vLLM, with stream)."""
        k = _value(body, "prompt_logprobs", int_in_range, -1, MAX_TOP_LOGPROBS)
        if k == -1:
            raise RequestError(f"prompt_logprobs: -1 (the whole vocabulary's) is not served: give at most "
                               f"{MAX_TOP_LOGPROBS}", param="prompt_logprobs", code="invalid_value")
        if k is not None and stream:
            raise RequestError("prompt_logprobs: not available with stream: true (as in vLLM)",
                               param="prompt_logprobs", code="unsupported_value")
        return k

    def prepare(self, raw: bytes, chat: bool) -> Prepared:
        """On a worker thread (the event loop stays free): parse, check and tokenize one request."""
        body = self.parse(raw, chat)
        stream, include_usage, usage_so_far = _stream_flags(body)
        n = self.choices(body)
        if chat:
            return self.prepared_chat(body, stream, include_usage, usage_so_far, n)
        scored = self.prompt_logprobs(body, stream)
        prompts = self.prompts(body)
        bos = self.tokenizer.bos_id if self.tokenizer is not None else None
        # (a text prompt's BOS is the tokenizer's: its text cannot spell one)
        added = [int(isinstance(p, str) and bos is not None and ids[:1] == [bos])
                 for p, ids in zip(_prompts_of(body["prompt"]), prompts)]
        prompts, cut = self.truncated(body, prompts, DEFAULT_COMPLETION_TOKENS, added)
        # (the longest prompt is checked against the context, and caps an omitted max_tokens for all)
        options = self.options(body, max(len(ids) for ids in prompts), DEFAULT_COMPLETION_TOKENS, False, n)
        echo = self.echo_text(body, [ids[lead:] for ids, lead in zip(prompts, added)], cut)
        if echo is not None and options.logprobs is not None:  # the echoed prompt's tokens get theirs too (lm-eval)
            options = dataclasses.replace(options, prompt_logprobs=options.logprobs)
        return Prepared(prompts, _scoring_the_prompt(options, scored), stream, include_usage, usage_so_far, n=n,
                        echo=echo, tokenizer=self.answer_tokenizer(body), prompt_logprobs=scored,
                        make_constraint=self.constraint_factory(body, None, options.max_new_tokens),
                        **self.token_flags(body))

    def prepared_chat(self, body: dict, stream: bool, include_usage: bool = False, usage_so_far: bool = False,
                      n: int = 1) -> Prepared:
        """A chat request's body (its fields checked) tokenized, its options and constraint made: the chat
        completions' and the Responses API's (serve/responses.py, its request put as a chat's)."""
        # (vLLM's add_special_tokens: false, its default for chat, is what is done)
        if _get(body, "add_special_tokens", lambda v: isinstance(v, bool), "a boolean"):
            raise RequestError("add_special_tokens: a chat's prompt is its template's or encoding's, special "
                               "tokens and all (a BOS would be doubled): leave it out or give false",
                               param="add_special_tokens", code="unsupported_value")
        scored = self.prompt_logprobs(body, stream)
        ids, thought, plan = self.chat_ids(body)
        [ids], cut = self.truncated(body, [ids], DEFAULT_CHAT_TOKENS)
        options = _scoring_the_prompt(self.options(body, len(ids), DEFAULT_CHAT_TOKENS, True, n,
                                                   forced_call=bool(plan.prefill)), scored)
        if self.prompt_cache is not None and options.cache_prompt and not any(cut):
            options = dataclasses.replace(options, snapshot_at=self.next_turn_prefix(body, ids))
        markup = plan.markup() + (tuple(filter(None, (thought.start, thought.end))) if thought else ())
        return Prepared([ids], options, stream, include_usage, usage_so_far, thought, n, tools=plan,
                        make_constraint=self.constraint_factory(body, thought, options.max_new_tokens),
                        tokenizer=self.answer_tokenizer(body, markup), prompt_logprobs=scored, **self.token_flags(body))

    # -- admission and the worker
    def admit(self) -> None:
        with self.lock:
            if self.admitted >= self.max_queue:
                raise RequestError(f"the server is busy: {self.admitted} requests waiting or running (--max-queue "
                                   f"{self.max_queue}); retry later", status=429, kind="rate_limit_error",
                                   code="queue_full")
            self.admitted += 1

    async def admit_soon(self) -> None:
        """A --max-queue place, waiting up to ADMIT_GRACE_S for one: a vanished client's place is given back once
        its handler sees it gone (within POLL_S), so a request that follows it at once is not refused for it."""
        deadline = time.monotonic() + ADMIT_GRACE_S
        while True:
            try:
                return self.admit()
            except RequestError:
                if time.monotonic() >= deadline or self.closing.is_set():
                    raise
            await asyncio.sleep(ADMIT_GRACE_S / 20)

    def release(self, job: Job | None = None) -> None:
        """Give back a --max-queue place; a job's only once (when its client leaves, its run may go on until its
        next layer or token: the place is free at once)."""
        with self.lock:
            if job is not None:
                if not job.holds_place:
                    return
                job.holds_place = False
                # (its client gone: a run stops at its next layer or token, in flight till then)
                self.stopping += job.running
            self.admitted -= 1

    def run(self, job: Job) -> list[GenerateResult] | None:
        """On an executor's thread: the job's n generations. None: stopped before it started (its client left, or
        its deadline passed)."""
        with self.lock:
            job.running = True
            self.stopping += not job.holds_place  # (its client left before it started: in flight till it stops)
        try:
            if job.stopped() or self.closing.is_set():
                return self.skipped(job)
            tok = job.tokenizer

            asked = [False] * job.choices  # each choice's cancelled() asked: admitted by the scheduler (memory checked)

            def arguments(i: int) -> dict:
                def cancelled() -> bool:
                    asked[i] = True
                    return job.should_stop(self.closing.is_set())
                on_text = None if job.on_text is None else (lambda piece: job.on_text(i, piece))
                on_prompt = (None if job.on_prompt_logprobs is None else
                             lambda entries: job.on_prompt_logprobs(i, entries))
                return dict(detokenize=tok.decode if tok is not None else None, on_text=on_text,
                            cancelled=cancelled, on_token=self.timed(job, i), on_prompt_logprobs=on_prompt)
            def over(i: int, result: GenerateResult) -> GenerateResult:  # each choice as it ends
                self.counted(job, i, result)
                if job.on_finish is not None:
                    job.on_finish(i, result)
                return result
            results = []
            if self.scheduler is not None:  # the choices decode side by side
                futures = self.scheduler.submit_together([dict(token_ids=job.ids_of(i), options=job.options_for(i),
                                                                    **arguments(i)) for i in range(job.choices)])
                results = self.choice_results(job, futures, asked, over)
                if not results:
                    return self.skipped(job)
            else:  # one at a time
                for i in range(job.choices):
                    results.append(over(i, self.generator.generate(job.ids_of(i), job.options_for(i),
                                                                   **arguments(i))))
                    if results[-1].finish_reason in ("cancelled", "timeout"):
                        break
            self.finished.append((job.request_id, results[-1].finish_reason))
            return results
        except MoepackError:
            raise
        except BaseException as e:
            self.finished.append((job.request_id, "error"))
            where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
            self.log(f"moepack serve: {job.request_id} internal error: {type(e).__name__}: {e}"
                     + (f" (at {where.filename}:{where.lineno})" if where else ""))
            raise
        finally:
            with self.lock:
                job.running = False
                self.stopping -= not job.holds_place
            self.release(job)

    def skipped(self, job: Job) -> None:
        """A job stopped before any of its choices started: logged, nothing run."""
        reason = "timeout" if job.timed_out else "cancelled"
        self.finished.append((job.request_id, reason))
        self.log(f"moepack serve: {job.request_id} prompt_tokens={job.prompt_tokens} {reason} before it started")
        return None

    @staticmethod
    def choice_results(job: Job, futures: list, asked: list[bool],
                       over: Callable[[int, GenerateResult], GenerateResult]) -> list[GenerateResult]:
        """The batched choices' results, waited for together, each given to over(choice, result) as soon as it
        ends (a streamed choice's finish chunk goes then, not at the request's end). One that fails stops the
        others at once (their futures cancelled: the scheduler drops or stops them) and its error is the
        request's; a client gone while choices wait for a slot gets them dropped at once (never admitted: its
        --max-queue place is free as soon as those running stopped). [] when no choice ran."""
        pending = set(futures)
        while pending:
            done, pending = concurrent.futures.wait(pending, timeout=POLL_S,
                                                    return_when=concurrent.futures.FIRST_COMPLETED)
            failed = [f for f in done if not f.cancelled() and f.exception() is not None]
            if failed:
                for f in futures:
                    f.cancel()
                raise failed[0].exception()
            for i, f in enumerate(futures):
                if f in done and not f.cancelled():
                    over(i, f.result())
            if job.cancelled:
                for i, f in enumerate(futures):
                    if not asked[i]:
                        f.cancel()
            # a future cancelled by its caller is never notified (concurrent.futures.wait would wait on): done here
            pending = {f for f in pending if not f.cancelled()}
        return [f.result() for f in futures if not f.cancelled()]

    def counted(self, job: Job, choice: int, result: GenerateResult) -> GenerateResult:
        """A generation's tokens into the metrics and its line into the log ("timeout" for one its deadline
        stopped)."""
        self.metrics.prompt_tokens.inc(len(job.ids_of(choice)))
        self.metrics.generated_tokens.inc(len(result.generated_ids))
        if result.finish_reason == "cancelled" and job.timed_out:
            result.finish_reason = "timeout"
        self.log_generation(job, choice, result)
        return result

    def timed(self, job: Job, choice: int) -> Callable[[int, object], None]:
        """The generation's on_token: the time to its first token (the request's first generation) and between
        its tokens into the metrics, then the job's own on_token."""
        last: list[float] = []

        def on_token(token: int, logprob) -> None:
            now = time.monotonic()
            if last:
                self.metrics.tpot.observe(now - last[0])
            elif choice == 0:
                job.first_token_s = now - job.arrived
                self.metrics.ttft.observe(job.first_token_s)
            last[:] = [now]
            if job.on_token is not None:
                job.on_token(choice, token, logprob)
        return on_token

    def log_generation(self, job: Job, choice: int, result: GenerateResult) -> None:
        p, d = result.stats.get("prefill", {}), result.stats.get("decode", {})
        hit = d.get("expert_cache_hit_rate")
        cut = p.get("cancelled_after_layers")
        self.log(f"moepack serve: {job.request_id} prompt_tokens={len(job.ids_of(choice))} "
                 f"generated_tokens={len(result.generated_ids)} prefill_s={p.get('seconds', 0):.3f} "
                 f"decode_s={d.get('seconds', 0) or 0:.3f} cache_hit_rate={'-' if hit is None else f'{hit:.3f}'} "
                 + ("" if job.first_token_s is None else f"first_token_s={job.first_token_s:.3f} ")
                 + ("" if self.prompt_cache is None else f"cached_tokens={cached_tokens(result)} ")
                 + (f"shared_tokens={p['shared_tokens']} " if "shared_tokens" in p else "")
                 + f"finish={result.finish_reason}" + ("" if cut is None else f" prefill_stopped_after_layers={cut}"))

    def close(self) -> None:
        """No more generations: those waiting are dropped, a batch's running ones end (a prefill before its next
        layer); its worker lets go of the generator. One at a time (no batch): the running generation is waited for
        (it stops at its next layer or token), so that the generator it runs on is closed after it."""
        self.closing.set()
        self.executor.shutdown(wait=self.scheduler is None, cancel_futures=True)
        if self.scheduler is not None:
            self.scheduler.close()

    def stopped_error(self, otherwise: RequestError | None) -> RequestError | None:
        """Why a generation stopped before its answer: the server shutting down (a 503 the client may retry
        elsewhere), else `otherwise`."""
        if self.closing.is_set():
            return RequestError("the server is shutting down; retry later", code="server_shutting_down", status=503)
        return otherwise

    def unanswered(self, job: Job, results: list[GenerateResult] | None) -> RequestError | None:
        """Why a job that ended (`results` None: never run) has no answer to give: stopped before any token by its
        deadline (408) or by the server's shutdown (503); None when it has one, or its client left."""
        if results is not None and any(r.generated_ids for r in results):
            return None
        if job.timed_out:
            return self.timeout_error()
        return self.stopped_error(None) if self.closing.is_set() else None

    def timeout_error(self) -> RequestError:
        return RequestError(f"the request ran past its deadline of {self.limits.request_timeout_s:g} s "
                            "(--request-timeout)", code="request_timeout", status=408)

    def new_id(self, prefix: str, sep: str = "-") -> str:
        return f"{prefix}{sep}{next(self.counter)}{sep}{uuid.uuid4().hex[:8]}"

    def usage(self, job: Job, results: list[GenerateResult], thought: ThoughtMarks | None = None,
              chat: bool = False) -> dict:
        """OpenAI's usage of the job; a `chat`'s with completion_tokens_details.reasoning_tokens, the thoughts'
        tokens (`thought`: its answers' marks; None: it has none, 0), as DeepSeek's API and OpenAI's give them (each
        answer decoded again: off the event loop)."""
        usage = usage_of(job.prompt_tokens, sum(len(r.generated_ids) for r in results))
        if chat:
            usage["completion_tokens_details"] = {
                "reasoning_tokens": sum(thought_tokens(job.tokenizer, r, thought) for r in results)}
        if self.prompt_cache is not None:  # OpenAI's: each prompt's tokens its prefill took from the prompt cache
            cached = {}
            for choice, r in enumerate(results):
                prompt = choice // job.n
                cached[prompt] = max(cached.get(prompt, 0), cached_tokens(r))
            usage["prompt_tokens_details"] = {"cached_tokens": sum(cached.values())}
        return usage


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's `usage` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


JSON_SLICE = 1 << 16  # list items json_body writes in one call


def json_body(obj: dict) -> bytes:
    """obj as compact JSON (Starlette's JSONResponse's), a long list a slice at a time: the encoder holds the GIL
    through a call, and a million token ids would hold the event loop ~0.2 s."""
    def value(v) -> str:
        if not isinstance(v, list) or len(v) <= JSON_SLICE:
            return json.dumps(v, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return "[" + ",".join(value(v[i:i + JSON_SLICE])[1:-1] for i in range(0, len(v), JSON_SLICE)) + "]"

    return ("{" + ",".join(f"{value(k)}:{value(v)}" for k, v in obj.items()) + "}").encode()


def timings(job: Job, results: list[GenerateResult], choices: list[int] | None = None) -> dict:
    """llama-server's `timings` of a response: the prompt's prefill and the generated tokens' decode (summed over
    the choices: `results` are those of `choices`, default the first ones), in milliseconds and tokens per
    second."""
    prompt_s = sum(r.stats.get("prefill", {}).get("seconds", 0) or 0 for r in results)
    predicted_s = sum(r.stats.get("decode", {}).get("seconds", 0) or 0 for r in results)
    prompt_n = sum(len(job.ids_of(i)) for i in (range(len(results)) if choices is None else choices))
    predicted_n = sum(len(r.generated_ids) for r in results)
    return {"prompt_n": prompt_n, "prompt_ms": round(prompt_s * 1000, 3),
            "prompt_per_second": round(prompt_n / prompt_s, 3) if prompt_s else None,
            "predicted_n": predicted_n, "predicted_ms": round(predicted_s * 1000, 3),
            "predicted_per_second": round(predicted_n / predicted_s, 3) if predicted_s else None}


def _piece(tokenizer, token: int, text: str) -> str | list[int]:
    """/tokenize's piece of a token as llama-server gives it: its text, or where the token holds part of a character
    (its text alone is U+FFFD) the list of its bytes, so that the pieces join into the text."""
    if REPLACEMENT not in text:
        return text
    raw = tokenizer.token_bytes(token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


class TextOffsets:
    """Where each generated token's text begins in a completion's text, in characters from `start` (the echoed
    prompt's), token after token (a stream's chunks go on where the last left off): a token that ends inside a
    character begins where that character will, as the text holds only whole characters; a whole token that
    comes after such bytes that never made a character (they come out with it, as U+FFFD) begins after them."""

    def __init__(self, tokenizer, start: int = 0):
        self.at = start
        self._tokenizer = tokenizer
        self._text = IncrementalDetokenizer(tokenizer.decode) if tokenizer is not None else None
        self._held = False  # the last token's bytes held back (inside a character)

    def of(self, tokens: list[int]) -> list[int]:
        out = []
        for token in tokens:
            if self._text is None:
                out.append(self.at)
                self.at += len(_token_text(None, token))
                continue
            piece = self._text.add(token)
            own = _token_text(self._tokenizer, token) if self._held and piece else ""
            whole_after_held = own and REPLACEMENT not in own and piece.endswith(own)
            out.append(self.at + len(piece) - len(own) if whole_after_held else self.at)
            self.at += len(piece)
            self._held = not piece
        return out


class EchoOffsets:
    """Where each of an echoed prompt's tokens begins in the echo, the prompt's text as the client sent it: what the
    tokenizer put in front of a string prompt's text (its BOS) is no part of it, so those tokens begin at 0 and the
    text's own tokens where they stand in it; a token past the echo's end (a tokenizer that gives back other text
    than it was given) at its end."""

    def __init__(self, tokenizer, echo: str):
        self.tokenizer, self.echo = tokenizer, echo

    def of(self, tokens: list[int]) -> list[int]:
        decoded = self.tokenizer.decode(tokens)
        added = len(decoded) - len(self.echo) if decoded.endswith(self.echo) else 0
        return [min(max(0, at - added), len(self.echo)) for at in TextOffsets(self.tokenizer).of(tokens)]


def completion_logprobs(tokenizer, entries: list[TokenLogprob | None], offsets: TextOffsets | EchoOffsets,
                        tokens: list[int] | None = None, most: int | None = None, as_ids: bool = False) -> dict:
    """OpenAI's (legacy) completions `logprobs`: tokens, token_logprobs, top_logprobs ({text: logprob} each, of the
    `most` likeliest where given), text_offset (`offsets`: the completion's, carried on from chunk to chunk).
    `tokens`: the entries' tokens where some entry is None (an echoed prompt's first: its logprob and top_logprobs
    null, as OpenAI's). `as_ids` (vLLM's return_tokens_as_token_ids): the tokens and top_logprobs' keys
    "token_id:{id}" (text_offset still the text's)."""
    named = None if as_ids else tokenizer

    def top(entry: TokenLogprob) -> dict[str, float]:
        # keyed by text, as OpenAI's: tokens of one text (the bytes of several characters' parts, all U+FFFD) keep
        # the likeliest's logprob (the top come likeliest first), not the last one's
        out: dict[str, float] = {}
        for token, logprob in entry.top[:most]:
            out.setdefault(_token_text(named, token), logprob)
        return out

    tokens = [e.token for e in entries] if tokens is None else tokens
    return {"tokens": [_token_text(named, token) for token in tokens],
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else top(e) for e in entries],
            "text_offset": offsets.of(tokens)}


def vllm_prompt_logprobs(tokenizer, entries: list[TokenLogprob | None], k: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token None (the first: nothing is before it) or {token id: {logprob, rank,
    decoded_token}}, the token's own first (its rank counted over the vocabulary), then its k likeliest (ranked 1 to
    k; the token itself among them keeps its place first, with that rank), as vLLM builds them."""
    def one(e: TokenLogprob) -> dict:
        ranked = {e.token: (e.logprob, e.rank), **{t: (lp, r) for r, (t, lp) in enumerate(e.top[:k], 1)}}
        return {str(t): {"logprob": lp, "rank": r, "decoded_token": _token_text(tokenizer, t)}
                for t, (lp, r) in ranked.items()}
    return [None if e is None else one(e) for e in entries]


@dataclass(frozen=True)
class ChoiceStream:
    """One streamed choice's chunks: pieces(text) for each text piece, final(result) at its end, logprobs(entries)
    the `logprobs` of the chunk that carries its tokens' text."""
    pieces: Callable[[str], list[dict]]
    final: Callable[[GenerateResult], list[dict]]
    logprobs: Callable[[list[TokenLogprob]], dict]
    prompt: Callable[[list], None] | None = None  # an echo's prompt logprobs, before the first token


def client_gone_stream_end(path: str = "") -> str:
    """The end of a stream whose client closed its side, in the form of its endpoint (`path`): the error event, then
    [DONE]; a Responses stream's, OpenAI's `error` event (a half-closed client reads it; the stream is never cut
    short)."""
    if path == "/v1/responses":
        return responses_error_event(client_gone())
    if is_messages_path(path):
        return messages_error_event(client_gone())
    return f"data: {json.dumps(client_gone().body())}\n\ndata: [DONE]\n\n"


def _internal_error() -> RequestError:
    return RequestError("internal server error (see the server's log)", status=500, kind="server_error",
                        code="internal_error")


def make_app(generator, model_name: str, api_key: str | None = None, max_queue: int = 8,
             log: Callable[[str], None] | None = None, limits: ServerLimits | None = None, max_batch: int = 1,
             prefill_chunk: int = DEFAULT_PREFILL_CHUNK, allowed_origins: Sequence[str] = (),
             sampling_defaults: str = "model", prompt_cache_gib: float = 0.0):
    """The starlette app serving `generator` (a runtime.generate.Generator, or with max_batch 1 anything with its
    generate() and `.c`) as `model_name`; `max_batch` > 1: up to that many sequences decode together
    (runtime/batching.py, its prompts prefilled together, `prefill_chunk` tokens in all per pass while others
    decode). `log`: where the one line per request goes (default stderr). `allowed_origins`: the web pages' origins
    (`*`: any) whose scripts may call the API (CORS); none by default. app.state.server holds the Server (its
    `finished` deque: (request id, finish reason) per generation, newest last). `sampling_defaults`: what a
    request's omitted temperature, top_p and top_k are: "model" (the model's generation_config.json recommends them,
    where it does; OpenAI's otherwise) or "openai" (1.0, 1.0, off). Serve it with uvicorn_config(app, limits): the
    connection limits and timeouts live there. `prompt_cache_gib`: the batch scheduler's prompt cache
    (runtime/prompt_cache.py; 0: none; max_batch > 1 only)."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    server = Server(generator, model_name, api_key, max_queue, log, limits, max_batch, prefill_chunk,
                    sampling_defaults, prompt_cache_gib)

    def as_request_error(e: Exception) -> RequestError:
        """The error a request's response carries: its own, a MoepackError's 400, else a 500 (logged where it
        happened when on the worker; here otherwise)."""
        if isinstance(e, RequestError):
            return e
        if isinstance(e, MoepackError):
            return request_error(e)
        if not getattr(e, "_moepack_logged", False):
            server.log(f"moepack serve: internal error: {type(e).__name__}: {e}")
        return _internal_error()

    def check_origin(request) -> None:
        """A browser's request from a web page carries its Origin: one --allowed-origin does not name is a 403
        before any work. (Without a preflight, a page of any site could otherwise have a local server generate for
        it, a form's text/plain POST: unread, but run; no same-host exception, which DNS rebinding would forge.)
        Other clients (curl, the SDKs) send no Origin."""
        origin = request.headers.get("origin")
        if origin is None or "*" in allowed_origins or origin in allowed_origins:
            return
        raise RequestError(f"a web page of origin {origin[:100]!r} may not call this server: start moepack serve "
                           "with --allowed-origin ORIGIN for it", code="cors_not_allowed", status=403)

    def handles_errors(fn, path: str):
        async def endpoint(request):
            try:
                check_origin(request)
                response = await fn(request)
            except Exception as e:
                response = error_response(as_request_error(e), path)
            server.metrics.answered(path, response.status_code)
            return response
        return endpoint

    async def health(request):
        return JSONResponse({"status": "ok", "model": model_name, "requests_in_flight": server.in_flight,
                             "max_queue": max_queue, "max_batch": server.max_batch})

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": server.created, "owned_by": "moepack",
                "max_model_len": server.context}

    async def models(request):
        server.check_auth(request)
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def one_model(request):
        server.check_auth(request)
        wanted = request.path_params["model_id"]
        if wanted != model_name:
            raise RequestError(f"the model {wanted[:80]!r} does not exist (this server has {model_name!r})",
                               param="model", code="model_not_found", status=404)
        return JSONResponse(model_card())

    async def metrics(request):
        server.check_auth(request)
        return Response(server.metrics.exposition(), media_type=CONTENT_TYPE)

    async def tokenize(request):
        """llama-server's /tokenize: {"content": text, "add_special": false, "with_pieces": false} ->
        {"tokens": [ids]} (with_pieces: [{"id", "piece"}]); the text's special-token spellings stay text. Or vLLM's
        (what lm-eval's remote tokenizer sends): {"prompt": text, "add_special_tokens": true, "return_token_strs":
        false} -> {"count", "max_model_len", "tokens", "token_strs"}, special-token spellings their tokens, as
        a Hugging Face tokenizer's encode gives them."""
        def answer(body: dict) -> dict:
            server.check_model(body)  # (either form may name it)
            if "prompt" in body:
                return vllm_answer(body)
            content = _get(body, "content", lambda v: isinstance(v, str), "a string", "")
            add_special = _get(body, "add_special", lambda v: isinstance(v, bool), "a boolean", False)
            pieces = _get(body, "with_pieces", lambda v: isinstance(v, bool), "a boolean", False)
            tok = server.need_tokenizer("content")
            ids = tok.encode(content, False, add_special)
            if not pieces:
                return {"tokens": ids}
            return {"tokens": [{"id": i, "piece": piece}
                               for i, piece in zip(ids, pieces_within_context(tok, ids, "with_pieces", "content"))]}

        def pieces_within_context(tok, ids: list[int], field: str, text_field: str) -> list:
            """The tokens' pieces, for a text of at most --max-context tokens (a piece is ~25 bytes of JSON a token:
            a 4 MB text's were ~100 MB), else a 400 naming `field`."""
            if server.context and len(ids) > server.context:
                raise RequestError(f"{field}: the {text_field} is {len(ids)} tokens, over this server's max_context "
                                   f"of {server.context} (--max-context): ask for fewer, or without pieces",
                                   param=field, code="invalid_value")
            return [_piece(tok, i, p) for i, p in zip(ids, tok.pieces(ids))]

        def vllm_answer(body: dict) -> dict:
            if "content" in body:
                raise RequestError("give content (llama-server's form) or prompt (vLLM's), not both", param="prompt",
                                   code="invalid_value")
            prompt = _get(body, "prompt", lambda v: isinstance(v, str), "a string")
            add_special = _get(body, "add_special_tokens", lambda v: isinstance(v, bool), "a boolean", True)
            strings = _get(body, "return_token_strs", lambda v: isinstance(v, bool), "a boolean", False)
            tok = server.need_tokenizer("prompt")
            ids = tok.encode(prompt, True, add_special)
            return {"count": len(ids), "max_model_len": server.context, "tokens": ids,
                    "token_strs": pieces_within_context(tok, ids, "return_token_strs", "prompt") if strings else None}

        return await small_request(request, {"content", "add_special", "with_pieces", "prompt", "add_special_tokens",
                                             "return_token_strs", "model"}, answer)

    async def detokenize(request):
        """llama-server's /detokenize: {"tokens": [ids]} -> {"content": text}; the text is also "prompt", as vLLM's
        answer names it."""
        def answer(body: dict) -> dict:
            server.check_model(body)
            ids = _get(body, "tokens", lambda v: isinstance(v, list) and all(is_int(i) for i in v),
                       "a list of token ids", [])
            server.check_in_vocabulary(ids, "tokens", "tokens")
            text = server.need_tokenizer("tokens").decode(ids)
            return {"content": text, "prompt": text}

        return await small_request(request, {"tokens", "model"}, answer)

    @functools.cache
    def the_tokenizer_info() -> dict:  # (the container's files do not change: read once)
        return tokenizer_info(generator.c, server.family, server.context)

    async def tokenizer_information(request):
        """vLLM's /tokenizer_info (serve/chat_template.py tokenizer_info): lm-eval's remote tokenizer asks it first."""
        server.check_auth(request)
        server.need_tokenizer("tokenizer_info")
        return JSONResponse(the_tokenizer_info())

    async def small_request(request, fields: set[str], answer: Callable[[dict], dict]):
        """A /tokenize-like request: auth, a --max-queue place (a 4 MB text's encoding is seconds of work), the
        body read, then parsed, answered and written out as JSON on a worker thread, never on the event loop."""
        server.check_auth(request)
        await server.admit_soon()
        try:
            raw = await server.read_body(request)
            content = await run_in_threadpool(lambda: json_body(answer(server.small_body(raw, fields))))
        finally:
            server.release()
        return Response(content, media_type="application/json")

    async def admitted_request(request, prepare: Callable[[bytes], Prepared], prefix: str,
                               sep: str = "-") -> tuple[Prepared, Job, object]:
        """Auth, a queue slot (429 when none), the body read and prepared (`prepare`) off the event loop, the job
        submitted to the worker: (prepared, job, its concurrent future; the job's id `prefix`, `sep`, a count, `sep`,
        8 hex digits). The slot is the worker's to free from then on."""
        server.check_auth(request)
        arrived = time.monotonic()
        await server.admit_soon()
        try:
            raw = await server.read_body(request)
            prepared = await run_in_threadpool(prepare, raw)
            job = Job(server.new_id(prefix, sep), prepared.prompts, prepared.options,
                      deadline=arrived + server.limits.request_timeout_s, arrived=arrived, n=prepared.n,
                      make_constraint=prepared.make_constraint,
                      tokenizer=server.tokenizer if prepared.tokenizer is None else prepared.tokenizer)
            if prepared.stream:
                loop = asyncio.get_running_loop()
                job.queue = asyncio.Queue()
                job.began = asyncio.Event()
                push = events_onto(job, loop, server.log)
                job.on_text = lambda i, piece: push(("text", i, piece))
                job.on_start = lambda: loop.call_soon_threadsafe(job.began.set)
                job.on_finish = lambda i, result: push(("finish", i, result))
                if prepared.options.logprobs is not None or prepared.usage_so_far or prepared.return_token_ids:
                    job.on_token = lambda i, token, lp: push(("token", i, (token, lp)))  # (each token counted)
                if prepared.options.prompt_logprobs is not None:
                    job.on_prompt_logprobs = lambda i, entries: push(("prompt", i, entries))
            future = server.executor.submit(server.run, job)
        except BaseException:
            server.release()
            raise
        return prepared, job, future

    async def wait_job(request, job: Job, future, until: asyncio.Event | None = None) -> list[GenerateResult] | None:
        """Wait for the job's end (or, given `until`, for that event, returning None), checking every POLL_S that
        its client is still there (else the job is stopped). A job that ended in an error raises it; one
        stopped by its deadline before any token is a 408."""
        wrapped = asyncio.wrap_future(future)
        waits = {wrapped} if until is None else {wrapped, asyncio.ensure_future(until.wait())}
        try:
            while True:
                done, _ = await asyncio.wait(waits, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
                if wrapped in done:
                    break
                if done:  # (the job's end is read elsewhere: its error, unread here, is no "never retrieved")
                    wrapped.add_done_callback(lambda f: f.cancelled() or f.exception())
                    return None
                if await request.is_disconnected():
                    job.cancelled = True
                    server.release(job)  # its place free now (a run stops at its next layer or token)
                    if future.cancel():  # still waiting for the worker: never run
                        server.skipped(job)
                        return None
        finally:
            for w in waits - {wrapped}:
                w.cancel()
        try:
            results = wrapped.result()
        except MoepackError:
            raise
        except Exception as e:
            e._moepack_logged = True
            raise
        error = server.unanswered(job, results)
        if error is not None:
            raise error
        return results

    async def finished_job(request, job: Job, future) -> list[GenerateResult]:
        results = await wait_job(request, job, future)
        if results is None:
            raise server.stopped_error(client_gone())
        return results

    async def job_events(request, job: Job, future):
        """A streamed job's events as the worker pushed them: (kind, choice, piece) with kind "text", "token",
        "finish" or "prompt"; then its end: ("done", None, results), ("error", None, RequestError) where it failed
        or has no answer, or ("gone", None, None) where its client went away (the job stopped, its place given
        back). A consumer that stops reading (its client gone, the response torn down) stops the job too: close
        this generator (contextlib.aclosing) as it stops."""
        queue = job.queue
        try:
            wrapped = asyncio.wrap_future(future)
            wrapped.add_done_callback(lambda f: queue.put_nowait(("done", None, None)))
            while True:
                try:
                    kind, i, piece = await asyncio.wait_for(queue.get(), timeout=POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():  # a client that only half-closed reads why
                        job.cancelled = True
                        server.release(job)
                        yield "gone", None, None
                        return
                    continue
                if kind != "done":
                    yield kind, i, piece
                    continue
                try:
                    results = wrapped.result()
                    error = server.unanswered(job, results) or (RequestError("cancelled") if results is None
                                                                 else None)
                    if error is not None:
                        raise error
                except Exception as e:
                    e._moepack_logged = True  # the worker logged its own errors
                    yield "error", None, as_request_error(e)
                    return
                yield "done", None, results
                return
        finally:
            if not future.done():
                job.cancelled = True  # the client went away (or the response was torn down)
                server.release(job)

    def streamed(request, job: Job, future, choices: list[ChoiceStream], include_usage: bool, head: dict,
                 usage_so_far: bool = False, prompt_ids_in: str | None = None, thought: ThoughtMarks | None = None):
        """The SSE events (an async iterator of their text) of the job's choices, interleaved as their pieces come
        (each chunk's choices[0].index names its choice): choices[i].pieces(text) per text piece, each choice's
        final(result) chunks as soon as it ends when there are several (one: at the request's end). With
        include_usage, as OpenAI's: every chunk's usage null (`usage_so_far`, vLLM's continuous_usage_stats: its
        choice's usage so far), then one more chunk (`head`: its id, object, created, model) with choices [] and the
        request's usage. The logprobs of a choice's tokens since its previous chunk (choices[i].logprobs(entries) ->
        the chunk's `logprobs`) go with its next chunk that carries text. `prompt_ids_in` (vLLM's return_token_ids:
        "choice" for completions, "chunk" for chat): each chunk's choice carries `token_ids`, those taken since the
        choice's previous chunk on the last chunk of each batch (joined: the choice's generated ids), and a choice's
        first chunk the prompt's ids, as `prompt_token_ids` of its choice or of the chunk. A chat's usage (`head`'s
        object) counts its reasoning_tokens (`thought`: its marks; Server.usage)."""
        generated = [0] * len(choices)  # each choice's tokens so far
        new_ids: list[list[int]] = [[] for _ in choices]  # (return_token_ids) each choice's ids not yet sent
        sent = [0] * len(choices)  # (return_token_ids) each choice's ids sent, and whether its first chunk was
        started = [False] * len(choices)

        def event(chunk: dict) -> str:
            if usage_so_far and chunk["choices"]:
                i = chunk["choices"][0]["index"]
                chunk["usage"] = usage_of(len(job.ids_of(i)), generated[i])
            elif include_usage:
                chunk.setdefault("usage", None)
            return f"data: {json.dumps(chunk)}\n\n"
        pending: list[list] = [[] for _ in choices]
        ended = [False] * len(choices)  # its final chunks sent

        def final(i, result) -> list[dict]:
            ended[i] = True
            generated[i] = len(result.generated_ids)
            new_ids[i] = result.generated_ids[sent[i]:]  # (the ids after the last text: a stop string's, the end's)
            chunks = choices[i].final(result)
            attach(i, chunks)
            return chunks

        def attach(i, chunks):
            # (the first chunk that carries none: an echo's chunk carries its prompt's)
            free = [c for c in chunks if c["choices"][0].get("logprobs") is None]
            if pending[i] and free:
                free[0]["choices"][0]["logprobs"] = choices[i].logprobs(pending[i])
                pending[i] = []
            if prompt_ids_in is not None and chunks:
                with_token_ids(i, chunks)

        def with_token_ids(i, chunks):
            for c in chunks:
                c["choices"][0]["token_ids"] = []
            chunks[-1]["choices"][0]["token_ids"], new_ids[i] = new_ids[i], []
            sent[i] += len(chunks[-1]["choices"][0]["token_ids"])
            if not started[i]:
                started[i] = True
                at = chunks[0]["choices"][0] if prompt_ids_in == "choice" else chunks[0]
                at["prompt_token_ids"] = job.ids_of(i)

        async def events():
            async with contextlib.aclosing(job_events(request, job, future)) as happenings:
                async for kind, i, piece in happenings:
                    if kind == "gone":
                        yield client_gone_stream_end()
                        return
                    if kind == "prompt":  # (before the choice's first token; a prompt's length of them: off the loop)
                        await run_in_threadpool(choices[i].prompt, piece)
                        continue
                    if kind == "token":
                        token, logprob = piece
                        generated[i] += 1
                        if logprob is not None:  # (its logprobs, when asked for)
                            pending[i].append(logprob)
                        if prompt_ids_in is not None:
                            new_ids[i].append(token)
                        continue
                    if kind == "finish":
                        # one choice's end while others go on; a lone choice's goes with the usage at the end
                        if len(choices) > 1:
                            for chunk in final(i, piece):
                                yield event(chunk)
                        continue
                    if kind == "text":
                        chunks = choices[i].pieces(piece)
                        attach(i, chunks)
                        for chunk in chunks:
                            yield event(chunk)
                        continue
                    if kind == "error":
                        yield f"data: {json.dumps(piece.body())}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    results = piece
                    out = [chunk for i, result in enumerate(results) if not ended[i] for chunk in final(i, result)]
                    if include_usage:
                        chat = head["object"] == "chat.completion.chunk"
                        usage = await run_in_threadpool(server.usage, job, results, thought, chat)
                        out.append({**head, "choices": [], "usage": usage})
                    for chunk in out:
                        yield event(chunk)
                    yield "data: [DONE]\n\n"
                    return

        return events()

    async def stream_when_started(request, job: Job, future, events):
        """The 200 and the stream's first event (`events`: an async iterator of its SSE text) only once the
        generation passed every check: an error before that (a bad value, the memory check) is the request's
        4xx."""
        result = await wait_job(request, job, future, until=job.began)
        if result is None and future.done() and not job.began.is_set():
            raise server.stopped_error(client_gone())
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": job.request_id})

    def response(job: Job, results: list[GenerateResult], kind: str, choices: list[dict],
                 thought: ThoughtMarks | None = None, **extra):
        return JSONResponse({"id": job.request_id, "object": kind, "created": int(time.time()), "model": model_name,
                             "choices": choices,
                             "usage": server.usage(job, results, thought, chat=kind == "chat.completion"),
                             "timings": timings(job, results), **extra}, headers={"X-Request-Id": job.request_id})

    async def completions(request):
        prepared, job, future = await admitted_request(request, functools.partial(server.prepare, chat=False),
                                                       "cmpl")
        rid, created = job.request_id, int(time.time())
        tok = job.tokenizer

        def echo(i: int) -> str:  # the i-th choice's prompt's text, where echo was asked for
            return prepared.echo[i // job.n] if prepared.echo else ""

        as_ids = prepared.return_tokens_as_token_ids

        def prompt_logprobs(i, entries):  # an echoed prompt's, its offsets into the echo
            # (the echo is the prompt's text, special tokens and all: skip_special_tokens is the answer's, as vLLM's)
            plain = server.tokenizer
            return completion_logprobs(plain, entries, EchoOffsets(plain, echo(i)), job.ids_of(i), job.options.logprobs,
                                       as_ids)

        def choice_extra(result):
            scored = {} if prepared.prompt_logprobs is None else {"prompt_logprobs": vllm_prompt_logprobs(
                server.tokenizer, result.prompt_logprobs, prepared.prompt_logprobs)}
            return {"token_ids": result.generated_ids, **scored}

        def logprobs_of(i, result):
            if result.logprobs is None:
                return None
            answer = completion_logprobs(tok, result.logprobs, TextOffsets(tok, len(echo(i))), as_ids=as_ids)
            if result.prompt_logprobs is None or not prepared.echo:  # (vLLM's prompt_logprobs alone: its own field)
                return answer
            return {key: values + answer[key] for key, values in prompt_logprobs(i, result.prompt_logprobs).items()}

        if not prepared.stream:
            results = await finished_job(request, job, future)
            # (on a worker thread: a prompt's logprobs are a prompt's length of entries, seconds at 128K)
            # (return_token_ids: each choice's prompt ids beside its generated ones, as vLLM puts them)
            return await run_in_threadpool(lambda: response(job, results, "text_completion", [
                {"index": i, "text": echo(i) + (r.text or ""), "logprobs": logprobs_of(i, r),
                 "finish_reason": r.finish_reason, **choice_extra(r),
                 **({"prompt_token_ids": job.ids_of(i)} if prepared.return_token_ids else {})}
                for i, r in enumerate(results)]))

        def chunk(i, text, finish=None, extra=None):
            return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": finish,
                                 **(extra or {})}]}

        def choice_stream(i: int) -> ChoiceStream:
            offsets = TextOffsets(tok, len(echo(i)))
            echo_due = [bool(echo(i))]  # the prompt's text first, once the choice's stream has begun
            echo_logprobs = [None]  # with its logprobs, where asked for (they come before the first token)

            def prompt(entries):
                echo_logprobs[0] = prompt_logprobs(i, entries)

            def with_logprobs(entries):
                return completion_logprobs(tok, entries, offsets, as_ids=as_ids)

            def final(result):
                last = chunk(i, "", result.finish_reason, choice_extra(result))
                last["timings"] = timings(job, [result], [i])
                return pieces("") + [last] if echo_due[0] else [last]

            def pieces(piece):
                out = [chunk(i, echo(i))] if echo_due[0] else []
                if out:
                    out[0]["choices"][0]["logprobs"] = echo_logprobs[0]
                echo_due[0] = False
                return out + ([chunk(i, piece)] if piece else [])
            return ChoiceStream(pieces, final, with_logprobs, prompt)

        return await stream_when_started(request, job, future, streamed(
            request, job, future, [choice_stream(i) for i in range(job.choices)], prepared.include_usage,
            chunk(0, ""), prepared.usage_so_far, "choice" if prepared.return_token_ids else None))

    def thought_fields(text: str) -> dict:
        """A chat answer's thought under both its names: reasoning_content (DeepSeek's API, llama-server's, the
        clients built on them) and reasoning (vLLM's since it renamed it, OpenRouter's)."""
        return {"reasoning_content": text, "reasoning": text}

    async def chat_completions(request):
        prepared, job, future = await admitted_request(request, functools.partial(server.prepare, chat=True),
                                                       "chatcmpl")
        rid, created, thought, plan = job.request_id, int(time.time()), prepared.thought, prepared.tools
        tok, as_ids = job.tokenizer, prepared.return_tokens_as_token_ids
        if not prepared.stream:
            results = await finished_job(request, job, future)

            def answer():
                choices = []
                for i, result in enumerate(results):
                    text = result.text or ""
                    reasoning, content = split_thinking(text, thought)
                    message = {"role": "assistant", "content": content,
                               **({} if reasoning is None else thought_fields(reasoning))}
                    finish = result.finish_reason
                    if plan.parse:
                        message["content"], calls = split_answer(message["content"], plan)
                        if calls:
                            message["tool_calls"] = calls
                            finish = "tool_calls" if finish == "stop" else finish
                    choices.append({"index": i, "message": message, "finish_reason": finish, "logprobs": (
                        None if result.logprobs is None else chat_logprobs(tok, result.logprobs, as_ids)),
                        **({"token_ids": result.generated_ids} if prepared.return_token_ids else {})})
                # (vLLM's: the response's, of the prompt all choices share: a prompt's length of entries, k + 1 each)
                scored = {} if prepared.prompt_logprobs is None else {"prompt_logprobs": vllm_prompt_logprobs(
                    server.tokenizer, results[0].prompt_logprobs, prepared.prompt_logprobs)}
                if prepared.return_token_ids:  # (vLLM's: the response's, as its prompt_logprobs)
                    scored["prompt_token_ids"] = job.prompts[0]
                return response(job, results, "chat.completion", choices, thought, **scored)
            # (built and its JSON written on a worker thread, as completions' are: the answer's logprobs, top_logprobs
            # + 1 objects a token, took 2.8 s of the event loop at 32,000 tokens; its split, its whole length)
            return await run_in_threadpool(answer)

        def chunk(i, delta, finish=None):
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        def choice_stream(i: int) -> ChoiceStream:
            splitter = AnswerSplitter(thought, plan)
            first, n_calls = [True], [0]

            def pieces(parts):
                out = []
                for f, text in parts:
                    if f == "tool_call":
                        delta = {"tool_calls": [{"index": n_calls[0], **text}]}
                        n_calls[0] += 1
                    else:
                        delta = thought_fields(text) if f == "reasoning_content" else {f: text}
                    if first[0]:
                        delta = {"role": "assistant", **delta}
                        first[0] = False
                    out.append(chunk(i, delta))
                return out

            def final(result):
                out = pieces(splitter.flush())
                if first[0]:
                    out.append(chunk(i, {"role": "assistant", "content": ""}))
                    first[0] = False
                finish = result.finish_reason
                last = chunk(i, {}, "tool_calls" if n_calls[0] and finish == "stop" else finish)
                last["timings"] = timings(job, [result], [i])
                out.append(last)
                return out
            return ChoiceStream(lambda piece: pieces(splitter.feed(piece)), final,
                                lambda entries: chat_logprobs(tok, entries, as_ids))

        return await stream_when_started(request, job, future, streamed(
            request, job, future, [choice_stream(i) for i in range(job.choices)], prepared.include_usage,
            chunk(0, {}), prepared.usage_so_far, "chunk" if prepared.return_token_ids else None, thought))

    # OpenAI's Responses API, put as a chat (serve/responses.py)
    create_response, response_not_stored = responses_endpoints(server, model_name, admitted_request, finished_job,
                                                               stream_when_started, job_events)

    # Anthropic's Messages API, put as a chat (serve/messages.py)
    create_message, count_message_tokens = messages_endpoints(server, model_name, admitted_request, finished_job,
                                                              stream_when_started, job_events, small_request)

    async def shutdown():
        await run_in_threadpool(server.close)

    endpoints = {"/health": (health, "GET"), "/metrics": (metrics, "GET"), "/v1/models": (models, "GET"),
                 "/v1/models/{model_id:path}": (one_model, "GET"), "/tokenize": (tokenize, "POST"),
                 "/detokenize": (detokenize, "POST"), "/tokenizer_info": (tokenizer_information, "GET"),
                 "/v1/completions": (completions, "POST"),
                 "/v1/chat/completions": (chat_completions, "POST"), "/v1/responses": (create_response, "POST"),
                 "/v1/responses/{response_id}": (response_not_stored, "GET/DELETE"),
                 "/v1/responses/{response_id}/input_items": (response_not_stored, "GET"),
                 "/v1/responses/{response_id}/cancel": (response_not_stored, "POST"),
                 "/v1/messages": (create_message, "POST"), "/v1/messages/count_tokens": (count_message_tokens, "POST")}
    routes = [Route(path, handles_errors(fn, path), methods=method.split("/"))
              for path, (fn, method) in endpoints.items()]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await shutdown()

    served = ", ".join(f"{method} {path.replace('{model_id:path}', '{id}')}" for path, (_, method) in endpoints.items())

    async def not_served(request, exc):
        """A path or method no endpoint serves: OpenAI's error object naming it (Starlette's is plain text, which
        a client shows as a bare status), not counted in the metrics (its path is the client's to choose)."""
        # the path as sent (percent-encoded, as HTTP has it printable): the decoded one may hold control characters
        what = f"{request.method} {request.scope.get('raw_path', b'').decode('latin-1')[:200]}"
        if request.method == "OPTIONS" and "access-control-request-method" in request.headers:
            err = RequestError("cross-origin requests (CORS) are not allowed here: start moepack serve with "
                               "--allowed-origin ORIGIN for the web page's origin", code="cors_not_allowed",
                               status=403)
        elif exc.status_code == 405:
            err = RequestError(f"{what}: method not allowed (this endpoint takes {exc.headers['Allow']})",
                               code="method_not_allowed", status=405, headers=exc.headers)
        else:
            err = RequestError(f"{what}: no such endpoint (moepack serves {served})", code="unknown_endpoint",
                               status=404)
        return error_response(err, request.url.path)

    # a browser's page of an allowed origin may call the API and read its answers (the key still needed)
    cors = [Middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                       allow_headers=["*"], expose_headers=["X-Request-Id", "Retry-After"])] if allowed_origins else []
    app = Starlette(routes=routes, lifespan=lifespan, middleware=cors,
                    exception_handlers={404: not_served, 405: not_served})
    # a path with a slash added is not served (Starlette's redirect would name a host from the client's Host header)
    app.router.redirect_slashes = False
    app.state.server = server
    return app


def uvicorn_server(app, config):
    """uvicorn's Server over `config` whose SIGTERM (or Ctrl-C) also ends the app's generations at their next token
    or layer, each stream with its last chunk, and answers the requests still waiting with a 503: uvicorn waits
    for every open connection before the app's own shutdown, so a long stream would otherwise keep a stopping server
    running for minutes, and requests queued behind it would start after the signal."""
    import uvicorn

    class StoppingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.server.closing.set()
            super().handle_exit(sig, frame)

    return StoppingServer(config)


def uvicorn_config(app, limits: ServerLimits | None = None, **kw):
    """uvicorn's Config for `app` with the connection limits: keep-alive (limits.keep_alive_s), each request's
    headers within limits.read_timeout_s of the connection's start (or of its previous response) else the
    connection is closed (half-sent requests do not pile up), and past limits.max_connections open connections a
    503 with Retry-After (and such a connection gets OVER_LIMIT_HEADER_S for its request). `kw`: more of
    uvicorn.Config's arguments."""
    import h11
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    limits = limits or ServerLimits()

    async def too_many_connections(scope, receive, send):
        n = limits.max_connections
        err = RequestError(f"the server has more than {n} connections open (--max-connections {n}); retry later",
                           status=503, kind="server_busy", code="too_many_connections",
                           headers={"Connection": "close"})
        await error_response(err, scope.get("path", ""))(scope, receive, send)

    class GuardedH11Protocol(H11Protocol):
        """uvicorn's h11 protocol with a deadline on each request's headers and the connection limit's 503."""

        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self._inner_app = self.app
            self._app = self._app_seeing_half_close
            self._half_closed = False
            self._header_timer: asyncio.TimerHandle | None = None

        def eof_received(self) -> bool | None:
            # a client that half-closes (shutdown(SHUT_WR)) once its request is sent may still read: the
            # connection stays open for the answer (uvicorn closed it: no answer at all). The app sees the client
            # gone (a vanished client's FIN looks the same), so a generation stops; what it answers still arrives.
            if self.cycle is None or self.cycle.response_complete or self.conn.their_state is not h11.DONE:
                return None  # between requests, or a request cut short: closed as uvicorn does
            self._half_closed = True
            self.cycle.keep_alive = False  # closed once the answer is written
            self.cycle.message_event.set()  # a receive() waiting wakes to see it
            return True

        async def _app_seeing_half_close(self, scope, receive, send):
            body_read = False  # the body's bytes come first: they arrived before the half-close

            async def receive_or_gone():
                nonlocal body_read
                if body_read and self._half_closed:
                    return {"type": "http.disconnect"}
                message = await receive()
                body_read = body_read or (message["type"] == "http.request" and not message.get("more_body"))
                return message

            stream_open = False  # a streamed answer begun and not ended

            async def sending(message):
                nonlocal stream_open
                if message["type"] == "http.response.start":
                    stream_open = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                      for k, v in message.get("headers", []))
                elif not message.get("more_body"):
                    stream_open = False
                await send(message)
            await self._inner_app(scope, receive_or_gone, sending)
            if stream_open and self._half_closed:  # Starlette stops a stream whose client is gone mid-write
                end = client_gone_stream_end(scope.get("path", "")).encode()
                await send({"type": "http.response.body", "body": end, "more_body": False})

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            over = len(self.connections) > limits.max_connections
            self._arm(OVER_LIMIT_HEADER_S if over else limits.read_timeout_s)

        def data_received(self, data: bytes) -> None:
            # a request whose headers complete now gets the app, or the 503 past the limit
            over = len(self.connections) > limits.max_connections
            self.app = too_many_connections if over else self._app
            super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():  # the next request's headers: after the idle time, as fast
                self._arm(limits.keep_alive_s + limits.read_timeout_s)

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _arm(self, seconds: float) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(seconds, self._headers_late)

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a request is in hand: its headers came in time (its body has the app's deadline)
            if not self.transport.is_closing():
                self.transport.close()

    return uvicorn.Config(app, http=GuardedH11Protocol, timeout_keep_alive=limits.keep_alive_s, **kw)
