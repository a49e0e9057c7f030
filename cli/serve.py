"""`moepack serve`: an OpenAI-compatible HTTP server (serve/app.py) over one container opened once."""

from __future__ import annotations

import json
import os
import socket

import click

from moepack.runtime.limits import (DEFAULT_MAX_BATCH, DEFAULT_PREFILL_CHUNK, DEFAULT_PROMPT_CACHE_GIB, MAX_BATCH,
                                    MAX_CACHE_GIB)

from .common import check_container_path, container_argument, json_option, model_run_options, reports_errors

API_KEY_ENV = "MOEPACK_API_KEY"


def resolve_api_key(api_key: str | None, api_key_file: str | None) -> str | None:
    """The key from --api-key, --api-key-file (a file only its owner may read, its first line stripped) or the
    MOEPACK_API_KEY environment variable, in that order; MoepackError for a file that is unsafe or empty."""
    import stat

    from moepack.format_spec.errors import MoepackError

    if api_key is not None and api_key_file is not None:
        raise click.UsageError("give --api-key or --api-key-file, not both")
    if api_key_file is not None:
        try:
            with open(api_key_file, encoding="utf-8") as f:
                mode = os.fstat(f.fileno()).st_mode
                if mode & (stat.S_IRWXG | stat.S_IRWXO):
                    raise MoepackError(f"--api-key-file {api_key_file}: readable by others (mode "
                                       f"{stat.S_IMODE(mode):o}): chmod 600 it")
                api_key = f.readline(4096).strip()
        except OSError as e:
            raise MoepackError(f"--api-key-file {api_key_file}: cannot read ({e.strerror})") from None
        except UnicodeDecodeError:
            raise MoepackError(f"--api-key-file {api_key_file}: not UTF-8 text") from None
        if not api_key:
            raise MoepackError(f"--api-key-file {api_key_file}: empty")
    elif api_key is None and os.environ.get(API_KEY_ENV, "").strip():
        api_key = os.environ[API_KEY_ENV].strip()
    from moepack.serve.app import check_api_key

    return check_api_key(api_key)  # (before the model is loaded)


def _origins(ctx, param, values: tuple[str, ...]) -> tuple[str, ...]:
    """--allowed-origin's values as a browser sends its Origin (scheme://host[:port], no path), or `*`: another
    would never match, and the pages it was meant for would be refused without a word. Any scheme: a browser
    extension's or an app's pages (chrome-extension://ID, moz-extension://ID, tauri://localhost) send theirs."""
    import re

    for value in values:
        if value != "*" and not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*://[^/\s?#]+", value):
            raise click.BadParameter(f"{value!r} is not an origin (scheme://host[:port], no path; or *)")
    return values


@click.command()
@container_argument
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (default: this machine only).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Port to listen on (0: a free one, named in the start line and --json).")
@click.option("--max-queue", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests admitted at once (waiting + running); more are answered 429.")
@click.option("--max-batch", type=click.IntRange(1, MAX_BATCH), default=DEFAULT_MAX_BATCH, show_default=True,
              help="Sequences decoded together, one step feeding each its next token (continuous batching: a "
                   "request joins between steps once its prompt is prefilled, a request's n choices decode side by "
                   "side); each sequence's KV is counted in the memory check. 1: one generation at a time.")
@click.option("--prefill-chunk", type=click.IntRange(min=0), default=DEFAULT_PREFILL_CHUNK, show_default=True,
              help="While others decode, the prompts waiting are prefilled together, this many tokens in all per "
                   "pass between their steps, the earliest first (each pass reads the experts again); 0: every "
                   "prompt whole in one pass.")
@click.option("--prompt-cache-gib", type=click.FloatRange(min=0, max=MAX_CACHE_GIB), default=None,
              help="Host memory kept for the prompt cache: the states where prompts and answers ended, so that a "
                   "prompt starting with one (a chat's next turn, a retry) prefills only the rest; least recently "
                   f"used dropped first, all of it before a request is refused for memory. Default: "
                   f"{DEFAULT_PROMPT_CACHE_GIB:g} with --max-batch above 1 (it lives in the batch scheduler), else 0; "
                   "0: off. A request's cache_prompt: false neither uses nor fills it.")
@click.option("--api-key", default=None, help="Require `Authorization: Bearer KEY` on every /v1 request (and "
              "/metrics, /tokenize, /detokenize). Visible to `ps`: prefer --api-key-file or MOEPACK_API_KEY.")
@click.option("--api-key-file", type=click.Path(dir_okay=False), default=None,
              help="Read the API key from this file (its first line, stripped); the file must not be readable by "
                   "group or others. Default: the MOEPACK_API_KEY environment variable, if set.")
@click.option("--model-name", "--served-model-name", "model_name", default=None,
              help="The model's id in the API (default: FILE's stem).")
@click.option("--max-body-mb", type=click.FloatRange(min=0, min_open=True, max=1024), default=4, show_default=True,
              help="A request body over this is refused (413), by its Content-Length or as it is read.")
@click.option("-c", "--max-context", "--max-model-len", "max_context", type=click.IntRange(min=2), default=None,
              help="Prompt tokens + max_tokens allowed per request (400 beyond; default: the model's context, "
                   "max_position_embeddings).")
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True, max=7 * 86400), default=600,
              show_default=True, help="Seconds from a request's arrival to its generation's end: past it the "
                                      "prefill stops between layers (408) or the decode ends (finish 'timeout').")
@click.option("--timeout-read", type=click.FloatRange(min=0, min_open=True, max=3600), default=30,
              show_default=True, help="Seconds a client has to send a request's headers (else the connection is "
                                      "closed) and then its body (else 408).")
@click.option("--timeout-keep-alive", type=click.FloatRange(min=0, max=3600), default=5, show_default=True,
              help="Seconds an idle connection is kept open between requests.")
@click.option("--max-connections", type=click.IntRange(min=1, max=100000), default=256, show_default=True,
              help="Open connections served at once; past it a request gets 503 with Retry-After.")
@click.option("--sampling-defaults", type=click.Choice(["model", "openai"]), default="model", show_default=True,
              help="What a request's omitted temperature, top_p and top_k are: the model's generation_config.json "
                   "recommendation where it makes one (as vLLM takes it), else OpenAI's (1.0, 1.0, off).")
@click.option("--allowed-origin", "allowed_origins", multiple=True, metavar="ORIGIN", callback=_origins,
              help="A web page's origin (http://host:port, chrome-extension://ID; `*`: any) whose scripts may call "
                   "the API and read its answers (CORS); repeatable. Default: none (a browser's request from a page, "
                   "preflight or not, gets 403 naming this flag).")
@model_run_options(unused={"kv_dtype": "the server keeps each request's KV in memory (float32) and writes none"})
@json_option
@reports_errors(out_of_memory_hint="lower --cache-gib")
def serve(file, host, port, max_queue, max_batch, prefill_chunk, prompt_cache_gib, api_key, api_key_file, model_name,
          max_body_mb, max_context, request_timeout, timeout_read, timeout_keep_alive, max_connections,
          sampling_defaults, allowed_origins, run, as_json):
    """Serve FILE through an OpenAI-compatible API: /v1/completions, /v1/chat/completions, /v1/responses (OpenAI's
    Responses API, nothing stored), /v1/models[/ID], /health, /metrics (Prometheus), /tokenize and /detokenize
    (llama-server's). Fields, tools, JSON output: docs/guide.md, "Serving real clients".
    With --json: one JSON line on stdout once the socket is bound (its url and port: --port 0 picks a free one).
    Limits and their refusals: docs/failures.md, "Server limits"."""
    from moepack.runtime.engine import held_for_serving
    from moepack.runtime.generate import Generator
    from moepack.serve.app import ServerLimits, make_app, uvicorn_config, uvicorn_server

    if prompt_cache_gib and max_batch == 1:
        raise click.UsageError("--prompt-cache-gib needs --max-batch above 1 (the batch scheduler keeps the prompt "
                               "cache)")
    if prompt_cache_gib is None:
        prompt_cache_gib = DEFAULT_PROMPT_CACHE_GIB if max_batch > 1 else 0
    check_container_path(file)
    name = model_name or os.path.splitext(os.path.basename(file))[0]
    api_key = resolve_api_key(api_key, api_key_file)
    generator = Generator(file, run.cache_gib, prefill=held_for_serving(file, run.prefill_options()))
    app = None
    try:
        limits = ServerLimits(max_body_bytes=round(max_body_mb * 2**20), max_context=max_context,
                              read_timeout_s=timeout_read, keep_alive_s=timeout_keep_alive,
                              request_timeout_s=request_timeout, max_connections=max_connections)
        app = make_app(generator, name, api_key=api_key, max_queue=max_queue, limits=limits, max_batch=max_batch,
                       prefill_chunk=prefill_chunk, allowed_origins=allowed_origins,
                       sampling_defaults=sampling_defaults, prompt_cache_gib=prompt_cache_gib)
        context = app.state.server.context
        # bound here, not by uvicorn: the port is known (and reported) before the first request can arrive
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        port = sock.getsockname()[1]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
        click.echo(f"moepack serve: {name} at {url} (max queue {max_queue}, max batch {max_batch}, max context "
                   f"{context}, max body {max_body_mb:g} MB{', API key required' if api_key else ''})", err=True)
        if as_json:
            click.echo(json.dumps({"ok": True, "model": name, "url": url, "host": host, "port": port,
                                   "max_queue": max_queue, "max_batch": max_batch,
                                   "api_key_required": bool(api_key),
                                   "max_context": context, "max_body_bytes": limits.max_body_bytes,
                                   "max_connections": max_connections, "allowed_origins": list(allowed_origins),
                                   "sampling_defaults": app.state.server.sampling_defaults,
                                   "prompt_cache_gib": prompt_cache_gib}))
        server = uvicorn_server(app, uvicorn_config(app, limits, log_level="warning", access_log=False))
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn raises the SIGTERM or Ctrl-C it stopped on again once stopped: a
            click.echo("moepack serve: stopped", err=True)  # server's normal end, status 0, --json's one object
    finally:
        if app is not None:
            app.state.server.close()  # its batch's worker lets go of the generator first
        generator.close()
