"""`moepack serve` under load: 1, 4 and 16 concurrent streaming clients (the official `openai` client), each
sending one completion at temperature 0, against one server process on a synthetic preset (synth + convert --fp4;
default `small`) or a given container.

Per concurrency level it prints: the time to first token, p50 / p99 over the requests (what the server measured
from each request's arrival: its log line's first_token_s), and to the clients' first text (a synthetic model's
first text comes several tokens after its first token, as byte pieces are held until they make a whole UTF-8
character: it waits those decode steps too); each stream's decode rate (its tokens after the first over the time
after the first) and the aggregate rate (every client's tokens over the level's wall time); the expert cache's hit
rate (from the server's per-request log lines); how many requests were refused (429). Beside them, the load goal's
bound: 2 x one prompt's prefill time plus one decode step per sequence queued ahead (measured alone first, on the
same server; both printed beside it), whether the first token's p99 is within it, and where that p99 request's time
went: its prefill passes (prefill_s) against the rest, waiting (for a batch slot, or between its prefill chunks
while others decode), from its own log line; the same split summed over every request of the level. One run
compares servers by their --max-batch (default 1 and 16: one generation at a time, then every client's sequence
decoding together), one after the other on the same container.

    python benchmarks/serve_load.py [--preset small|medium] [--container FILE] [--clients 1,4,16]
                                    [--max-batch 1,16] [--max-new-tokens 32] [--device cpu]
                                    [--serve-arg=--prefill-chunk=64] [--json]
Loopback only; every loop is bounded; the server is stopped at the end."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import openai

from serve import container  # benchmarks/serve.py: the synthetic preset, converted once

PROMPT = ("The design note argues that a prefill streams experts well because many tokens share each read, "
          "while decode must cache them. Explain why, step by step:")


class Server:
    """`moepack serve` in a child process on a free loopback port, its stderr (one line per request) in a file."""

    def __init__(self, path: str, device: str, max_queue: int, extra: list[str], log_path: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "moepack", "serve", path, "--port", str(self.port),
                                      "--device", device, "--max-queue", str(max_queue), *extra],
                                     stdout=subprocess.DEVNULL, stderr=self._log)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"moepack serve exited ({self.proc.returncode}); its log: {log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            raise SystemExit("moepack serve did not answer /health within 300 s")
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=900)
        self.model = self.client.models.list().data[0].id

    def log_lines(self) -> list[str]:
        with open(self.log_path) as f:
            return f.readlines()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def one_client(server: Server, prompt: str, max_tokens: int, t0: float) -> dict:
    """One streamed completion: time to its first text (from t0), its end, its tokens; or its refusal."""
    first = None
    tokens = 0
    try:
        stream = server.client.completions.create(model=server.model, prompt=prompt, max_tokens=max_tokens,
                                                  temperature=0, stream=True,
                                                  stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text and first is None:
                first = time.perf_counter() - t0
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except openai.RateLimitError:
        return {"refused": True}
    end = time.perf_counter() - t0
    return {"refused": False, "ttft": first if first is not None else end, "end": end, "tokens": tokens}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _field(line: str, key: str) -> float | None:
    m = re.search(rf"\b{key}=([0-9.]+)", line)
    return float(m.group(1)) if m else None


def _logged(lines: list[str], key: str) -> list[float]:
    return [v for line in lines if (v := _field(line, key)) is not None]


def time_split(lines: list[str]) -> dict:
    """Where the requests' time to first token went, from the server's log lines (each request's first_token_s and
    prefill_s): the p99 request's prefill and waiting (the rest: queued for a slot, or between its prefill chunks
    while others decode), and the prefill's share of all the requests' first-token time together."""
    pairs = sorted((first, prefill) for line in lines
                   if (first := _field(line, "first_token_s")) is not None
                   and (prefill := _field(line, "prefill_s")) is not None)
    if not pairs:
        return {"p99_prefill_s": None, "p99_waiting_s": None, "p99_prefill_fraction": None,
                "prefill_fraction_all": None}
    first, prefill = pairs[min(len(pairs) - 1, max(0, round(0.99 * (len(pairs) - 1))))]  # as _percentile picks
    prefill = min(prefill, first)
    total = sum(f for f, _ in pairs)
    return {"p99_prefill_s": round(prefill, 3), "p99_waiting_s": round(first - prefill, 3),
            "p99_prefill_fraction": round(prefill / first, 3) if first else None,
            "prefill_fraction_all": round(sum(min(p, f) for f, p in pairs) / total, 3) if total else None}


def level(server: Server, clients: int, max_tokens: int) -> dict:
    seen = len(server.log_lines())
    results: list = [None] * clients
    t0 = time.perf_counter()

    def run(i: int) -> None:
        results[i] = one_client(server, f"{PROMPT} (client {i})", max_tokens, t0)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    time.sleep(0.2)  # the server logs a request after its last chunk went out
    lines = server.log_lines()[seen:]
    done = [r for r in results if not r["refused"]]
    hits = _logged(lines, "cache_hit_rate")
    first_tokens = _logged(lines, "first_token_s")
    return {
        "clients": clients, "refused": clients - len(done), "wall_s": round(wall, 3),
        "ttft_p50_s": round(_percentile([r["ttft"] for r in done], 0.5), 3) if done else None,
        "ttft_p99_s": round(_percentile([r["ttft"] for r in done], 0.99), 3) if done else None,
        "stream_tokens_per_s": round(statistics.median(
            (r["tokens"] - 1) / (r["end"] - r["ttft"]) for r in done if r["tokens"] > 1 and r["end"] > r["ttft"]),
            2) if any(r["tokens"] > 1 for r in done) else None,
        "aggregate_tokens_per_s": round(sum(r["tokens"] for r in done) / wall, 2),
        "expert_cache_hit_rate": round(statistics.mean(hits), 4) if hits else None,
        "first_token_p50_s": round(_percentile(first_tokens, 0.5), 3) if first_tokens else None,
        "first_token_p99_s": round(_percentile(first_tokens, 0.99), 3) if first_tokens else None,
        **time_split(lines),
    }


def run_server(path: str, args, levels: list[int], max_batch: int) -> dict:
    """One server with --max-batch `max_batch`: a warm-up, one client alone (the bound's prefill and step), then
    each level."""
    extra = ["--max-batch", str(max_batch), *args.serve_arg]
    log = os.path.join(args.workdir, f"serve-batch{max_batch}.log")
    server = Server(path, args.device, max(levels) * 2, extra, log)  # --max-queue: nothing refused
    try:
        one_client(server, PROMPT, 4, time.perf_counter())  # warm-up: the cache fills, the kernels load
        alone = level(server, 1, args.max_new_tokens)
        lines = server.log_lines()
        prefill_s = _logged(lines, "prefill_s")[-1]
        decode_s = _logged(lines, "decode_s")[-1]
        step_s = decode_s / max(args.max_new_tokens - 1, 1)
        rows = [alone if n == 1 else level(server, n, args.max_new_tokens) for n in levels]
    finally:
        server.stop()
    for row in rows:  # the load goal: p99 TTFT <= 2 x prefill + one decode step per sequence queued ahead
        row["ttft_bound_s"] = round(2 * prefill_s + step_s * (row["clients"] - 1), 3)
        row["within_bound"] = row["first_token_p99_s"] is not None and row["first_token_p99_s"] <= row["ttft_bound_s"]
        row["text_within_bound"] = row["ttft_p99_s"] is not None and row["ttft_p99_s"] <= row["ttft_bound_s"]
    return {"max_batch": max_batch, "prefill_alone_s": prefill_s, "decode_step_s": round(step_s, 4), "levels": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "moepack-serve-load"))
    ap.add_argument("--preset", default="small", choices=["tiny", "small", "medium"])
    ap.add_argument("--container", help="an existing container instead of the synthetic preset's")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--max-batch", default="1,16",
                    help="the servers to compare, one after the other: their --max-batch (1: one generation at a "
                         "time)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="an extra `moepack serve` argument (repeat; e.g. --serve-arg=--prefill-chunk=64)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    batches = [int(b) for b in args.max_batch.split(",")]
    if not levels or min(levels) < 1 or max(levels) > 64:
        raise SystemExit("--clients: 1 to 64 each")
    if not batches or min(batches) < 1:
        raise SystemExit("--max-batch: at least 1 each")
    os.makedirs(args.workdir, exist_ok=True)
    path = args.container or container(args.workdir, args.preset, "fp4")
    load_before = os.getloadavg()
    runs = [run_server(path, args, levels, b) for b in batches]
    report = {"container": path, "container_bytes": os.path.getsize(path), "device": args.device,
              "max_new_tokens": args.max_new_tokens, "serve_args": args.serve_arg, "cpus": os.cpu_count(),
              "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)], "runs": runs}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{path} ({report['container_bytes'] / 2**20:.0f} MiB) on {args.device}, {args.max_new_tokens} new tokens "
          f"per client, serve args {args.serve_arg or 'none'}; {report['cpus']} CPUs, 1-minute load "
          f"{report['load_average_before_after'][0]} before, {report['load_average_before_after'][1]} after")
    head = ["clients", "refused", "first token p50 s", "first token p99 s", "bound s", "p99 <= bound",
            "p99: prefill s", "p99: waiting s", "p99: prefill share", "all: prefill share",
            "first text p50 s", "first text p99 s", "stream tok/s", "aggregate tok/s", "cache hit rate", "wall s"]
    for run in runs:
        prefill_s, step_s = run["prefill_alone_s"], run["decode_step_s"]
        print(f"\n--max-batch {run['max_batch']}: one prompt's prefill alone {prefill_s:.3f} s, a decode "
              f"step {step_s * 1e3:.1f} ms (measured alone on this server); bound = 2 x prefill + one step per "
              f"client queued ahead; the p99 request's first-token time split into its prefill passes and waiting")
        print(" | ".join(head))
        for r in run["levels"]:
            cells = [str(r[k]) for k in ("clients", "refused", "first_token_p50_s", "first_token_p99_s")]
            cells.append(f"{r['ttft_bound_s']} = 2 x {prefill_s:.3f} + {r['clients'] - 1} x {step_s:.4f}")
            cells += [str(r[k]) for k in ("within_bound", "p99_prefill_s", "p99_waiting_s")]
            cells += [_percent(r["p99_prefill_fraction"]), _percent(r["prefill_fraction_all"])]
            cells += [str(r[k]) for k in ("ttft_p50_s", "ttft_p99_s", "stream_tokens_per_s", "aggregate_tokens_per_s",
                                          "expert_cache_hit_rate", "wall_s")]
            print(" | ".join(cells))


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:.0%}"


if __name__ == "__main__":
    main()
