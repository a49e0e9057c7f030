"""`moepack serve` against `moepack generate` run as one process per prompt: time to first token and tokens/s,
for one request and for 4 requests queued at once, on a synthetic preset (synth + convert --keep; default `small`)
or a given container.

    python benchmarks/serve.py [--workdir /tmp/moepack-serve-bench] [--max-new-tokens 32] [--preset medium]
                               [--container FILE]

Prints a small table. Not a test."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

PROMPTS = ["Once upon a time", "The quick brown fox", "In the beginning", "It was a dark and stormy night"]


def container(workdir: str, preset: str, policy: str = "keep") -> str:
    """The synthetic preset converted with `policy` (made once in `workdir`)."""
    out = os.path.join(workdir, f"{preset}.moepack" if policy == "keep" else f"{preset}-{policy}.moepack")
    if not os.path.exists(out):
        from moepack.packer.convert import convert_checkpoint
        from moepack.packer.synth import synth_checkpoint

        src = os.path.join(workdir, f"{preset}-src")
        if not os.path.exists(os.path.join(src, "model.safetensors.index.json")):
            synth_checkpoint(src, preset=preset, progress=False)
        convert_checkpoint(src, out, policy=policy, progress=False)
    return out


def one_stream(url: str, prompt: str, n: int, t0: float) -> dict:
    """Time to first text piece (from t0) and total, streamed completion at temperature 0."""
    first = None
    with httpx.stream("POST", f"{url}/v1/completions", timeout=600,
                      json={"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        usage = None
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"] and first is None:
                first = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    total = time.perf_counter() - t0
    return {"ttft": first if first is not None else total, "total": total,
            "tokens": usage["completion_tokens"] if usage else n}


def serve_runs(path: str, n: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moepack", "serve", path, "--port", str(port), "--max-queue", "8"],
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        t_start = time.perf_counter()
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        startup = time.perf_counter() - t_start
        one_stream(url, PROMPTS[0], 4, time.perf_counter())  # warm-up: the expert cache fills
        single = one_stream(url, PROMPTS[0], n, time.perf_counter())
        results: list = [None] * len(PROMPTS)
        t0 = time.perf_counter()

        def run(i):
            results[i] = one_stream(url, PROMPTS[i], n, t0)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        return {"startup": startup, "single": single, "queued": results, "queued_wall": wall}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def generate_runs(path: str, n: int, workdir: str) -> list[dict]:
    """`moepack generate` as a process per prompt: time to its first stdout byte, and total."""
    out = []
    for prompt in PROMPTS:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "moepack", "generate", path, "--prompt", prompt,
                                 "--max-new-tokens", str(n)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        proc.stdout.read(1)
        first = time.perf_counter() - t0
        proc.stdout.read()
        proc.wait()
        out.append({"ttft": first, "total": time.perf_counter() - t0, "tokens": n})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/moepack-serve-bench")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--preset", default="small", choices=["tiny", "small", "medium"])
    ap.add_argument("--container", help="an existing container instead of the synthetic preset's")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    path = args.container or container(args.workdir, args.preset)
    n = args.max_new_tokens
    s = serve_runs(path, n)
    g = generate_runs(path, n, args.workdir)
    q = s["queued"]
    rows = [
        ("serve, 1 request", s["single"]["ttft"], s["single"]["tokens"] / s["single"]["total"]),
        ("serve, 4 queued (mean TTFT)", sum(r["ttft"] for r in q) / 4, sum(r["tokens"] for r in q) / s["queued_wall"]),
        ("serve, 4 queued (worst TTFT)", max(r["ttft"] for r in q), None),
        ("generate process, 1 prompt", g[0]["ttft"], g[0]["tokens"] / g[0]["total"]),
        ("generate process x4 (mean TTFT)", sum(r["ttft"] for r in g) / 4,
         sum(r["tokens"] for r in g) / sum(r["total"] for r in g)),
    ]
    print(f"container {path} ({os.path.getsize(path) / 2**20:.0f} MiB), {n} new tokens per prompt; "
          f"serve startup {s['startup']:.2f} s (not in the rows)")
    print(f"{'':34} {'TTFT s':>8} {'tokens/s':>9}")
    for name, ttft, tps in rows:
        print(f"{name:34} {ttft:8.3f} {'' if tps is None else f'{tps:9.1f}':>9}")
    print("tokens/s: generated tokens over wall time from the request (or process start) to the end, all requests")


if __name__ == "__main__":
    main()
