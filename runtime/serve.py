"""`moepack serve`: an OpenAI-compatible HTTP API (starlette, served by uvicorn) over one Generator.

    app = make_app(Generator("model.moepack", cache_gib=4), "model", api_key=None, max_queue=8)

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (stream or not).

Scheduling: the Generator runs one generation at a time, so every generation runs on ONE worker thread (a
single-thread executor), in arrival order. At most `max_queue` requests are admitted at once (waiting + running);
one more is answered 429 at once. A streamed answer's pieces go from the worker's `on_text` to the event loop
through an asyncio.Queue (loop.call_soon_threadsafe). A client that goes away (stream or not) sets its job's
cancel flag: a job not yet started is skipped, a running one stops at its next token (finish_reason "cancelled"),
and its slot is free once the worker lets go of it.

Chat with thinking on (`"thinking": true`, or DeepSeek's `{"thinking": {"type": "enabled"}}`): the prompt ends with
`<think>`; the generated text before the first `</think>` is `reasoning_content`, the rest `content` (all of it
reasoning when `</think>` never comes).

Errors a request causes: 4xx with OpenAI's error object {"error": {"message", "type", "param", "code"}}. Anything
else: 500, one log line, and the server goes on.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from moepack.format_spec.errors import MoepackError
from moepack.v4.chat import THINK_END, encode_message_segments

from .generate import GenerateOptions, GenerateResult
from .sampling import is_int, is_number, partial_match_length

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
DEFAULT_CHAT_TOKENS = 1024  # chat without max_tokens: this, within what the context leaves
POLL_S = 0.25  # how often a waiting handler checks that its client is still there


class RequestError(Exception):
    """A request the client got wrong: HTTP `status` with OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind


def error_response(e: RequestError):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}},
                        status_code=e.status)


@dataclass
class Job:
    """One generation: what the worker thread runs, and the flag that cancels it."""
    request_id: str
    ids: list[int]
    options: GenerateOptions
    on_text: Callable[[str], None] | None = None
    cancelled: bool = False
    started: float = field(default_factory=time.monotonic)


class ThinkSplitter:
    """Splits streamed text at the first `</think>`: (field, text) pairs, "reasoning_content" before it and
    "content" after; a tail that may be the start of `</think>` is held back until the next piece says."""

    def __init__(self, thinking: bool):
        self.in_thought = thinking
        self.held = ""

    def feed(self, piece: str) -> list[tuple[str, str]]:
        if not self.in_thought:
            return [("content", piece)] if piece else []
        text = self.held + piece
        at = text.find(THINK_END)
        if at >= 0:
            self.in_thought, self.held = False, ""
            out = [("reasoning_content", text[:at]), ("content", text[at + len(THINK_END):])]
            return [(f, t) for f, t in out if t]
        keep = partial_match_length(text, (THINK_END,))
        self.held = text[len(text) - keep:] if keep else ""
        shown = text[:len(text) - keep]
        return [("reasoning_content", shown)] if shown else []

    def flush(self) -> list[tuple[str, str]]:
        held, self.held = self.held, ""
        return [("reasoning_content" if self.in_thought else "content", held)] if held else []


def split_thinking(text: str) -> tuple[str | None, str]:
    """(reasoning_content, content) of a whole answer generated in thinking mode."""
    reasoning, sep, content = text.partition(THINK_END)
    return (reasoning, content) if sep else (reasoning, "")


# ---- request checking -------------------------------------------------------------------------------------------

def _get(body: dict, name: str, check: Callable, what: str, default=None):
    v = body.get(name)
    if v is None:
        return default
    if not check(v):
        raise RequestError(f"{name}: expected {what}, got {json.dumps(v)[:60]}", param=name, code="invalid_type")
    return v


def _thinking_flag(body: dict) -> bool:
    v = body.get("thinking")
    if v is None or isinstance(v, bool):
        return bool(v)
    if isinstance(v, dict) and v.get("type") in ("enabled", "disabled"):
        return v["type"] == "enabled"
    raise RequestError('thinking: expected true/false or {"type": "enabled" | "disabled"}', param="thinking",
                       code="invalid_type")


class Server:
    """The app's state: the generator, its one worker thread, the admission count."""

    def __init__(self, generator, model_name: str, api_key: str | None, max_queue: int,
                 log: Callable[[str], None] | None):
        if max_queue < 1:
            raise MoepackError("--max-queue must be at least 1")
        self.generator = generator
        self.model_name = model_name
        self.api_key = api_key
        self.max_queue = max_queue
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moepack-generate")
        self.lock = threading.Lock()
        self.admitted = 0  # waiting + running
        self.finished: collections.deque = collections.deque(maxlen=256)  # (request id, finish reason)
        self.created = int(time.time())
        self.counter = itertools.count(1)
        config = generator.c.config
        self.context = config.get("max_position_embeddings")
        self.vocab = config.get("vocab_size")
        self._tokenizer = None
        self._tokenizer_error: str | None = None

    # -- helpers
    @property
    def tokenizer(self):
        if self._tokenizer is None and self._tokenizer_error is None:
            from .tokenizer import PromptTokenizer

            try:
                self._tokenizer = PromptTokenizer(self.generator.c)
            except MoepackError as e:
                self._tokenizer_error = str(e)
        return self._tokenizer

    def need_tokenizer(self, param: str):
        if self.tokenizer is None:
            raise RequestError(f"{param}: the model's container carries no tokenizer ({self._tokenizer_error}): "
                               "give the prompt as token ids", param=param, code="no_tokenizer")
        return self.tokenizer

    def check_auth(self, request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {self.api_key}":
            raise RequestError("invalid or missing API key (Authorization: Bearer KEY)", status=401,
                               kind="invalid_request_error", code="invalid_api_key")

    async def body(self, request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"the request body is not valid JSON ({e})", code="invalid_json") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object", code="invalid_json")
        model = _get(body, "model", lambda v: isinstance(v, str), "a string")
        if model is not None and model != self.model_name:
            raise RequestError(f"the model {model!r} does not exist (this server has {self.model_name!r})",
                               param="model", code="model_not_found", status=404)
        if _get(body, "n", is_int, "an integer", 1) != 1:
            raise RequestError("n: only n=1 is supported", param="n", code="unsupported")
        return body

    def options(self, body: dict, n_prompt: int, default_tokens: int) -> GenerateOptions:
        max_tokens = _get(body, "max_tokens", is_int, "an integer")
        if max_tokens is None:
            max_tokens = _get(body, "max_completion_tokens", is_int, "an integer")
        if n_prompt == 0:
            raise RequestError("empty prompt", param="prompt", code="empty_prompt")
        if self.context and n_prompt >= self.context:
            raise RequestError(f"the prompt is {n_prompt} tokens: this model's context is {self.context} tokens",
                               param="prompt" if "prompt" in body else "messages", code="context_length_exceeded")
        room = self.context - n_prompt if self.context else None
        if max_tokens is None:
            max_tokens = default_tokens if room is None else min(default_tokens, room)
        elif max_tokens < 1:
            raise RequestError(f"max_tokens: must be at least 1, got {max_tokens}", param="max_tokens",
                               code="invalid_value")
        elif room is not None and max_tokens > room:
            raise RequestError(f"the prompt ({n_prompt} tokens) and max_tokens ({max_tokens}) exceed this model's "
                               f"context of {self.context} tokens", param="max_tokens",
                               code="context_length_exceeded")
        temperature = _get(body, "temperature", is_number, "a number", 1.0)
        if temperature < 0:
            raise RequestError("temperature: must be >= 0", param="temperature", code="invalid_value")
        top_p = _get(body, "top_p", is_number, "a number", 1.0)
        if not 0 < top_p <= 1:
            raise RequestError("top_p: must be in (0, 1]", param="top_p", code="invalid_value")
        top_k = _get(body, "top_k", is_int, "an integer", 0)
        if top_k < 0:
            raise RequestError("top_k: must be >= 0", param="top_k", code="invalid_value")
        seed = _get(body, "seed", is_int, "an integer")
        stop = _get(body, "stop", lambda v: isinstance(v, str) or isinstance(v, list)
                    and all(isinstance(s, str) for s in v), "a string or a list of strings", [])
        stop = [stop] if isinstance(stop, str) else stop
        if any(not s for s in stop):
            raise RequestError("stop: an empty stop string", param="stop", code="invalid_value")
        if stop:
            self.need_tokenizer("stop")
        return GenerateOptions(max_new_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                               top_k=top_k, seed=seed, stop=tuple(stop))

    def prompt_ids(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            # a client's text: a special token's text stays text (token ids are the way to send special tokens)
            return self.need_tokenizer("prompt").encode(prompt, special_tokens=False)
        if isinstance(prompt, list) and all(is_int(i) for i in prompt):
            if self.vocab and any(not 0 <= i < self.vocab for i in prompt):
                raise RequestError(f"prompt: token ids must lie in [0, {self.vocab})", param="prompt",
                                   code="invalid_value")
            return list(prompt)
        if isinstance(prompt, list):
            raise RequestError("prompt: only one prompt per request (a string or a list of token ids)",
                               param="prompt", code="invalid_type")
        raise RequestError("prompt: expected a string or a list of token ids", param="prompt",
                           code="invalid_type")

    def chat_ids(self, body: dict) -> tuple[list[int], bool]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages: expected a non-empty list of {role, content} objects", param="messages",
                               code="invalid_type")
        thinking = _thinking_flag(body)
        effort = _get(body, "reasoning_effort", lambda v: isinstance(v, str), "a string")
        try:
            segments = encode_message_segments(messages, thinking=thinking, reasoning_effort=effort)
        except MoepackError as e:
            param = "reasoning_effort" if str(e).startswith("reasoning_effort") else "messages"
            raise RequestError(str(e), param=param, code="invalid_value") from None
        return self.need_tokenizer("messages").encode_segments(segments), thinking  # content stays plain text

    # -- admission and the worker
    def admit(self) -> None:
        with self.lock:
            if self.admitted >= self.max_queue:
                raise RequestError(f"the server is busy: {self.admitted} requests waiting or running (--max-queue "
                                   f"{self.max_queue}); retry later", status=429, kind="rate_limit_error",
                                   code="queue_full")
            self.admitted += 1

    def release(self) -> None:
        with self.lock:
            self.admitted -= 1

    def run(self, job: Job) -> GenerateResult | None:
        """On the worker thread. None: cancelled before it started."""
        try:
            if job.cancelled:
                self.finished.append((job.request_id, "cancelled"))
                self.log(f"moepack serve: {job.request_id} prompt_tokens={len(job.ids)} cancelled before it "
                         "started")
                return None
            tok = self.tokenizer
            result = self.generator.generate(job.ids, job.options,
                                             detokenize=tok.decode if tok is not None else None,
                                             on_text=job.on_text, cancelled=lambda: job.cancelled)
            self.finished.append((job.request_id, result.finish_reason))
            p, d = result.stats.get("prefill", {}), result.stats.get("decode", {})
            hit = d.get("expert_cache_hit_rate")
            self.log(f"moepack serve: {job.request_id} prompt_tokens={len(job.ids)} "
                     f"generated_tokens={len(result.generated_ids)} prefill_s={p.get('seconds', 0):.3f} "
                     f"decode_s={d.get('seconds', 0) or 0:.3f} cache_hit_rate={'-' if hit is None else f'{hit:.3f}'} "
                     f"finish={result.finish_reason}")
            return result
        except MoepackError:
            raise
        except BaseException as e:
            self.finished.append((job.request_id, "error"))
            where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
            self.log(f"moepack serve: {job.request_id} internal error: {type(e).__name__}: {e}"
                     + (f" (at {where.filename}:{where.lineno})" if where else ""))
            raise
        finally:
            self.release()

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self.counter)}-{uuid.uuid4().hex[:8]}"

    def usage(self, job: Job, result: GenerateResult) -> dict:
        n = len(result.generated_ids)
        return {"prompt_tokens": len(job.ids), "completion_tokens": n, "total_tokens": len(job.ids) + n}


def _internal_error() -> RequestError:
    return RequestError("internal server error (see the server's log)", status=500, kind="server_error",
                        code="internal_error")


def make_app(generator, model_name: str, api_key: str | None = None, max_queue: int = 8,
             log: Callable[[str], None] | None = None):
    """The starlette app serving `generator` (a runtime.generate.Generator, or anything with its generate() and
    `.c`) as `model_name`. `log`: where the one line per request goes (default stderr). app.state.server holds
    the Server (its `finished` deque: (request id, finish reason) per generation, newest last)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    server = Server(generator, model_name, api_key, max_queue, log)

    def handles_errors(fn):
        async def endpoint(request):
            try:
                return await fn(request)
            except RequestError as e:
                return error_response(e)
            except MoepackError as e:
                return error_response(RequestError(str(e), code="invalid_request"))
            except Exception as e:  # logged where it happened when on the worker; here otherwise
                if not getattr(e, "_moepack_logged", False):
                    server.log(f"moepack serve: internal error: {type(e).__name__}: {e}")
                return error_response(_internal_error())
        return endpoint

    async def health(request):
        with server.lock:
            busy = server.admitted
        return JSONResponse({"status": "ok", "model": model_name, "requests_in_flight": busy,
                             "max_queue": max_queue})

    async def models(request):
        server.check_auth(request)
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": server.created, "owned_by": "moepack"}]})

    async def submit(job: Job):
        """The job's concurrent future on the worker thread; the slot is taken before (429 when none)."""
        server.admit()
        try:
            future = server.executor.submit(server.run, job)
        except BaseException:
            server.release()
            raise
        return future

    async def wait_result(request, job: Job, future) -> GenerateResult:
        """Wait for a non-streamed job, cancelling it if the client goes away."""
        wrapped = asyncio.wrap_future(future)
        while True:
            done, _ = await asyncio.wait({wrapped}, timeout=POLL_S)
            if done:
                break
            if await request.is_disconnected():
                job.cancelled = True
        try:
            return wrapped.result()
        except MoepackError:
            raise
        except Exception as e:
            e._moepack_logged = True
            raise

    def streamed(request, job: Job, future_holder: list, queue: asyncio.Queue, make_chunks, final_chunks,
                 include_usage: bool):
        async def events():
            try:
                future = future_holder[0]
                wrapped = asyncio.wrap_future(future)
                wrapped.add_done_callback(lambda f: queue.put_nowait(("done", None)))
                while True:
                    try:
                        kind, piece = await asyncio.wait_for(queue.get(), timeout=POLL_S)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            job.cancelled = True
                            return
                        continue
                    if kind == "text":
                        for chunk in make_chunks(piece):
                            yield f"data: {json.dumps(chunk)}\n\n"
                        continue
                    try:
                        result = wrapped.result()
                    except Exception as e:
                        if not isinstance(e, MoepackError):
                            e._moepack_logged = True
                        err = (RequestError(str(e), code="invalid_request") if isinstance(e, MoepackError)
                               else _internal_error())
                        yield ("data: " + json.dumps({"error": {"message": err.message, "type": err.kind,
                                                                "param": None, "code": err.code}}) + "\n\n")
                        yield "data: [DONE]\n\n"
                        return
                    if result is None:
                        return
                    for chunk in final_chunks(result, server.usage(job, result) if include_usage else None):
                        yield f"data: {json.dumps(chunk)}\n\n"
                    yield "data: [DONE]\n\n"
                    return
            finally:
                if not future_holder[0].done():
                    job.cancelled = True  # the client went away (or the response was torn down)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": job.request_id})

    def begin_stream(body: dict) -> tuple[bool, bool]:
        stream = _get(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
        so = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
        return stream, bool(so.get("include_usage")) if stream else False

    async def completions(request):
        server.check_auth(request)
        body = await server.body(request)
        ids = server.prompt_ids(body)
        options = server.options(body, len(ids), DEFAULT_COMPLETION_TOKENS)
        stream, include_usage = begin_stream(body)
        rid = server.new_id("cmpl")
        job = Job(rid, ids, options)
        created = int(time.time())

        def choice_extra(result):
            return {"token_ids": result.generated_ids}

        if not stream:
            result = await wait_result(request, job, await submit(job))
            return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                                 "choices": [{"index": 0, "text": result.text or "", "logprobs": None,
                                              "finish_reason": result.finish_reason, **choice_extra(result)}],
                                 "usage": server.usage(job, result)}, headers={"X-Request-Id": rid})
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        job.on_text = lambda piece: loop.call_soon_threadsafe(queue.put_nowait, ("text", piece))

        def chunk(text, finish=None, extra=None):
            return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                                 **(extra or {})}]}

        def final(result, usage):
            last = chunk("", result.finish_reason, choice_extra(result))
            if usage is not None:
                last["usage"] = usage
            return [last]

        holder = [await submit(job)]
        return streamed(request, job, holder, queue, lambda piece: [chunk(piece)], final, include_usage)

    async def chat_completions(request):
        server.check_auth(request)
        body = await server.body(request)
        ids, thinking = server.chat_ids(body)
        options = server.options(body, len(ids), DEFAULT_CHAT_TOKENS)
        stream, include_usage = begin_stream(body)
        rid = server.new_id("chatcmpl")
        job = Job(rid, ids, options)
        created = int(time.time())
        if not stream:
            result = await wait_result(request, job, await submit(job))
            text = result.text or ""
            message = {"role": "assistant", "content": text}
            if thinking:
                message["reasoning_content"], message["content"] = split_thinking(text)
            return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                                 "choices": [{"index": 0, "message": message, "logprobs": None,
                                              "finish_reason": result.finish_reason}],
                                 "usage": server.usage(job, result)}, headers={"X-Request-Id": rid})
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        job.on_text = lambda piece: loop.call_soon_threadsafe(queue.put_nowait, ("text", piece))
        splitter = ThinkSplitter(thinking)
        first = [True]

        def chunk(delta, finish=None):
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        def pieces(parts):
            out = []
            for f, text in parts:
                delta = {f: text}
                if first[0]:
                    delta = {"role": "assistant", **delta}
                    first[0] = False
                out.append(chunk(delta))
            return out

        def final(result, usage):
            out = pieces(splitter.flush())
            if first[0]:
                out.append(chunk({"role": "assistant", "content": ""}))
                first[0] = False
            last = chunk({}, result.finish_reason)
            out.append(last)
            if usage is not None:
                out.append({**chunk({}), "choices": [], "usage": usage})
            return out

        holder = [await submit(job)]
        return streamed(request, job, holder, queue, lambda piece: pieces(splitter.feed(piece)), final,
                        include_usage)

    async def shutdown():
        server.executor.shutdown(wait=False, cancel_futures=True)

    routes = [Route("/health", handles_errors(health), methods=["GET"]),
              Route("/v1/models", handles_errors(models), methods=["GET"]),
              Route("/v1/completions", handles_errors(completions), methods=["POST"]),
              Route("/v1/chat/completions", handles_errors(chat_completions), methods=["POST"])]

    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await shutdown()

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.server = server
    return app
