"""A chat's second turn with and without `moepack serve`'s prompt cache (--prompt-cache-gib): the same two-turn
chat (a long first message, its answer, a short question) against a server with the cache off, then on, on a
synthetic preset (synth + convert --fp4; default `small`) or a given container.

Per server it prints each turn's prompt tokens, the tokens its prefill took from the cache
(usage.prompt_tokens_details.cached_tokens), its prefill seconds and the time to its first token, both from the
server's log line (prefill_s, first_token_s); the second turn's is what the cache saves.

Then, on the server with the cache on, a completion of n = 4 sampled choices of the long message: each choice
prefilling its own prompt (cache_prompt false) and the choices sharing one prefill (the default), wall time and
prefill seconds each.

    python benchmarks/prompt_cache.py [--preset small|medium] [--container FILE] [--words 600] [--device cpu]
Loopback only; the servers are stopped at the end."""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import httpx

from serve import container  # benchmarks/serve.py: the synthetic preset, converted once
from serve_load import Server, _field

PARAGRAPH = ("A prefill streams every layer's experts from disk once for all of the prompt's tokens, while a decode "
             "reads only the experts its one token is routed to, and keeps the most used ones in a cache. ")


def long_text(words: int) -> str:
    """PARAGRAPH repeated to `words` words: the long message."""
    return " ".join((PARAGRAPH * (words // 30 + 1)).split()[:words])


def two_turns(server: Server, words: int) -> list[dict]:
    """The chat's two turns, each with its usage and its log line's prefill and first-token times."""
    first = {"role": "user", "content": long_text(words) + "\nSum this up in one line."}
    rows, messages = [], [first]
    with httpx.Client(base_url=server.url, timeout=900) as http:
        for question in ("And why is a second turn cheaper?", None):
            r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 16, "temperature": 0})
            r.raise_for_status()
            body, line = r.json(), server.log_lines()[-1]
            rows.append({"prompt_tokens": body["usage"]["prompt_tokens"],
                         "cached_tokens": body["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0),
                         "prefill_s": _field(line, "prefill_s"), "first_token_s": _field(line, "first_token_s")})
            if question is None:
                break
            messages = [*messages, {"role": "assistant", "content": body["choices"][0]["message"]["content"] or ""},
                        {"role": "user", "content": question}]
    return rows


def n_choices(server: Server, words: int, n: int = 4) -> list[dict]:
    """A completion of n sampled choices of the long message, with and without a shared prefill."""
    prompt = long_text(words)
    rows = []
    with httpx.Client(base_url=server.url, timeout=900) as http:
        for shared in (False, True):
            t0 = time.perf_counter()
            r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16, "n": n, "temperature": 1.0,
                                                   "seed": 1, "cache_prompt": shared})
            r.raise_for_status()
            wall = time.perf_counter() - t0
            rows.append({"shared": shared, "prompt_tokens": r.json()["usage"]["prompt_tokens"], "wall_s": wall,
                         "prefill_s": _field(server.log_lines()[-1], "prefill_s")})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "moepack-serve-load"))
    ap.add_argument("--preset", default="small", choices=["tiny", "small", "medium"])
    ap.add_argument("--container", help="an existing container instead of the synthetic preset's")
    ap.add_argument("--words", type=int, default=600, help="the first message's length in words")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    path = args.container or container(args.workdir, args.preset, "fp4")
    print(f"{path} on {args.device}: a chat's two turns (first message {args.words} words), 16 tokens each")
    print("prompt cache | turn | prompt tokens | cached tokens | prefill s | first token s")
    for gib in ("0", "1"):
        log = os.path.join(args.workdir, f"prompt-cache-{gib}.log")
        server = Server(path, args.device, 4, ["--max-batch", "4", "--prompt-cache-gib", gib], log)
        try:
            for turn, row in enumerate(two_turns(server, args.words), 1):
                print(f"{'on' if gib != '0' else 'off'} | {turn} | {row['prompt_tokens']} | {row['cached_tokens']} | "
                      f"{row['prefill_s']} | {row['first_token_s']}")
            if gib != "0":
                print("\nn = 4 choices | prompt tokens | wall s | prefill s (the request's log line)")
                for row in n_choices(server, args.words):
                    print(f"{'one shared prefill' if row['shared'] else 'a prefill each (cache_prompt false)'} | "
                          f"{row['prompt_tokens']} | {row['wall_s']:.3f} | {row['prefill_s']}")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
