"""`moepack serve`: an OpenAI-compatible HTTP server (runtime/serve.py) over one container opened once."""

from __future__ import annotations

import json
import os
import socket

import click

from moepack.runtime.limits import MAX_CACHE_GIB

from .common import Dtype, json_option, reports_errors


@click.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (default: this machine only).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--cache-gib", type=click.FloatRange(0, MAX_CACHE_GIB), default=None,
              help="Byte budget of the routed-expert cache, kept across requests (default: every routed "
                   "expert, within a quarter of the memory this process may use and what is left of it beside the "
                   "rest of a generation).")
@click.option("--max-queue", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests admitted at once (waiting + running); more are answered 429.")
@click.option("--compute-dtype", type=Dtype(("float32", "bfloat16"), extra=("auto",)), default="auto",
              show_default=True, help="As prefill's --compute-dtype.")
@click.option("--api-key", default=None, help="Require `Authorization: Bearer KEY` on every /v1 request.")
@click.option("--model-name", default=None, help="The model's id in the API (default: FILE's stem).")
@json_option
@reports_errors(out_of_memory_hint="lower --cache-gib")
def serve(file, host, port, device, cache_gib, max_queue, compute_dtype, api_key, model_name, as_json):
    """Serve FILE through an OpenAI-compatible API: /v1/completions, /v1/chat/completions, /v1/models, /health.
    With --json: one JSON line on stdout once the socket is bound (its url and port: --port 0 picks a free one)."""
    import uvicorn

    from moepack.runtime.engine import PrefillOptions
    from moepack.runtime.generate import Generator
    from moepack.runtime.serve import make_app

    name = model_name or os.path.splitext(os.path.basename(file))[0]
    generator = Generator(file, cache_gib,
                          prefill=PrefillOptions(device=device, compute_dtype=compute_dtype))
    try:
        app = make_app(generator, name, api_key=api_key, max_queue=max_queue)
        # bound here, not by uvicorn: the port is known (and reported) before the first request can arrive
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        port = sock.getsockname()[1]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
        click.echo(f"moepack serve: {name} at {url} (max queue {max_queue}"
                   f"{', API key required' if api_key else ''})", err=True)
        if as_json:
            click.echo(json.dumps({"ok": True, "model": name, "url": url, "host": host, "port": port,
                                   "max_queue": max_queue, "api_key_required": bool(api_key)}))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        server.run(sockets=[sock])
    finally:
        generator.close()
