"""`moepack serve` under abuse (issue #37): starts the server on a synthetic preset (synth + convert --keep;
default `small`) or a given container, on 127.0.0.1 only, runs each abuse kind against it and prints, per kind,
the statuses it got, the server's worst /health latency while it ran, and the server's RSS before and after.

    python benchmarks/serve_abuse.py [--workdir /tmp/moepack-serve-abuse] [--preset small] [--container FILE]
                                     [--slowloris 300] [--json]

Every loop is bounded; the server is stopped at the end. Not a test (tests/test_serve_limits.py is)."""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
from serve import container  # benchmarks/serve.py: the synthetic preset's container, made once

READ_TIMEOUT_S = 5  # the server's --timeout-read here: slowloris connections must be gone after it
GOOD = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class HealthWatch:
    """Polls /health every 50 ms in a thread; `worst` is the longest answer (a timeout counts as its 10 s)."""

    def __init__(self, url: str):
        self.url, self.worst, self.failures = url, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    ok = client.get(f"{self.url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.worst = max(self.worst, time.monotonic() - t0)
                self.failures += not ok
                self._stop.wait(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def post(url: str, path: str = "completions", body=None, raw: bytes | None = None, timeout: float = 300) -> int:
    try:
        if raw is not None:
            r = httpx.post(f"{url}/v1/{path}", content=raw, timeout=timeout,
                           headers={"Content-Type": "application/json"})
        else:
            r = httpx.post(f"{url}/v1/{path}", json=body, timeout=timeout)
        return r.status_code
    except httpx.HTTPError as e:
        return type(e).__name__


# ---- the kinds ----------------------------------------------------------------------------------------------------

def _send_body(port: int, head: bytes, chunks, total: int) -> str:
    """Send a request's head, then its body's chunks until the server answers (or `total` bytes went); its
    status line and how much of the body went before it."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head)
        try:
            for chunk in chunks:
                if sent >= total:
                    break
                s.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass  # the server answered and closed
        s.settimeout(30)
        reply = s.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace")
    return f"{reply.removeprefix('HTTP/1.1 ')} after {sent / 2**20:.0f} of {total / 2**20:.0f} MiB sent"


def huge_body(url, port, max_body):
    """40 MiB declared by Content-Length, then chunked (no length): refused either way, not read to its end."""
    total = 40 << 20
    piece = b"x" * (1 << 16)
    declared = _send_body(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % total, iter(lambda: piece, None), total)
    chunked = _send_body(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n",
                         iter(lambda: b"%x\r\n%s\r\n" % (len(piece), piece), None), total)
    return [declared, chunked]


def huge_prompt(url, port, max_body):
    """The largest prompt the body limit lets through, tokenized on the server (then over max_context)."""
    text = "Once upon a time, a fox. " * ((max_body - 200) // 25)
    return [post(url, body={"prompt": text, "max_tokens": 1})]


def tokenize_everything(url, port, max_body):
    """/tokenize of a text of the body limit, without and with its pieces (a JSON object a token: refused past
    max_context), and the same text twice at once."""
    text = "Once upon a time, a fox. " * ((max_body - 200) // 25)

    def one(pieces: bool):
        try:
            r = httpx.post(f"{url}/tokenize", json={"content": text, "with_pieces": pieces}, timeout=300)
            return r.status_code
        except httpx.HTTPError as e:
            return type(e).__name__

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        both = list(pool.map(one, (False, False)))
    return [one(False), one(True), *both]


def slowloris(url, port, max_body, count):
    """`count` connections each sending half a request's headers and a byte a second; how many the server
    closed by READ_TIMEOUT_S + 2 s, then a normal request."""
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        s.setblocking(False)
        socks.append(s)
    closed, t0 = set(), time.monotonic()
    while time.monotonic() - t0 < READ_TIMEOUT_S + 2 and len(closed) < count:
        for i, s in enumerate(socks):
            if i in closed:
                continue
            try:
                s.sendall(b"a")
                if s.recv(1) == b"":
                    closed.add(i)
            except BlockingIOError:
                pass
            except OSError:
                closed.add(i)
        time.sleep(1)
    for s in socks:
        s.close()
    return [f"closed by the server: {len(closed)}/{count}", post(url, body=GOOD)]


def leaves_mid_prefill(url, port, max_body, log_path):
    """A long prompt whose client gives up after 1 s; how long the next request takes, and what the server's log
    says of the prefill (the layers it ran before it stopped)."""
    statuses = [post(url, body={"prompt": list(range(1, 500)) * 16, "max_tokens": 1}, timeout=1.0)]
    t0 = time.monotonic()
    statuses.append(post(url, body=GOOD))
    statuses.append(f"next request served in {time.monotonic() - t0:.2f} s")
    with open(log_path) as f:
        stopped = [line.split("prefill_stopped_after_layers=")[1].strip() for line in f
                   if "prefill_stopped_after_layers=" in line]
    statuses.append(f"prefill stopped after {stopped[-1] if stopped else '?'} layers")
    return statuses


def many_stop_strings(url, port, max_body):
    return [post(url, body={**GOOD, "stop": [f"stop{i}" for i in range(10_000)]})]


def raw_kind(raw: bytes):
    return lambda url, port, max_body: [post(url, raw=raw)]


def empty_prompt(url, port, max_body):
    return [post(url, body={**GOOD, "prompt": ""}), post(url, path="chat/completions",
                                                         body={"messages": [], "max_tokens": 2})]


def streamed_bad_value(url, port, max_body):
    out = []
    for bad in ({"temperature": float("nan")}, {"temperature": -1}, {"top_p": 7}, {"seed": 2 ** 70}):
        raw = json.dumps({**GOOD, "stream": True, **bad}).encode()
        with httpx.stream("POST", f"{url}/v1/completions", content=raw, timeout=60,
                          headers={"Content-Type": "application/json"}) as r:
            out.append(r.status_code)
    return out


def kinds(slowloris_count: int, log_path: str):
    return [
        ("huge body (40 MiB)", huge_body),
        ("huge prompt (the body limit)", huge_prompt),
        ("/tokenize the body limit (alone, pieces, twice at once)", tokenize_everything),
        (f"slowloris ({slowloris_count} half-sent)", lambda u, p, m: slowloris(u, p, m, slowloris_count)),
        ("client leaves mid-prefill", lambda u, p, m: leaves_mid_prefill(u, p, m, log_path)),
        ("10,000 stop strings", many_stop_strings),
        ("JSON nested 100,000 deep", raw_kind(b"[" * 100_000 + b"]" * 100_000)),
        ("a 5000-digit number", raw_kind(b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}")),
        ("NaN temperature", raw_kind(b'{"prompt": "x", "temperature": NaN}')),
        ("bad UTF-8", raw_kind(b'{"prompt": "\xff\xfe\xfd"}')),
        ("empty prompt", empty_prompt),
        ("streamed bad value", streamed_bad_value),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/moepack-serve-abuse")
    ap.add_argument("--preset", default="small", choices=["tiny", "small", "medium"])
    ap.add_argument("--container", help="an existing container instead of the synthetic preset's")
    ap.add_argument("--slowloris", type=int, default=300, help="half-sent connections (bounded: at most 900)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    path = args.container or container(args.workdir, args.preset)
    count = max(1, min(args.slowloris, 900))
    log_path = os.path.join(args.workdir, "server.log")
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "moepack", "serve", path, "--host", "127.0.0.1", "--port", "0",
                             "--json", "--timeout-read", str(READ_TIMEOUT_S), "--max-connections", "1000",
                             "--cache-gib", "0.5"], stdout=subprocess.PIPE, stderr=log, text=True)
    rows = []
    try:
        ready = json.loads(proc.stdout.readline())
        port, max_body = ready["port"], ready["max_body_bytes"]
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while post(url, body=GOOD) != 200:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(0.2)
        for name, run in kinds(count, log_path):
            before = rss_mib(proc.pid)
            t0 = time.monotonic()
            with HealthWatch(url) as watch:
                statuses = run(url, port, max_body)
            rows.append({"kind": name, "statuses": [str(s) for s in statuses], "seconds": round(
                time.monotonic() - t0, 2), "worst_health_s": round(watch.worst, 3), "health_failures":
                watch.failures, "rss_before_mib": round(before, 1), "rss_after_mib": round(rss_mib(proc.pid), 1),
                "server_alive": proc.poll() is None})
            if proc.poll() is not None:
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    if args.json:
        print(json.dumps({"container": path, "kinds": rows}, indent=1))
        return
    print(f"container {path} ({os.path.getsize(path) / 2**20:.0f} MiB); server --timeout-read {READ_TIMEOUT_S}, "
          f"body limit {max_body / 2**20:g} MiB")
    print(f"{'kind':30} {'worst /health s':>15} {'RSS MiB before -> after':>24}  statuses")
    for r in rows:
        counted = ", ".join(s if n == 1 else f"{s} x{n}" for s, n in collections.Counter(r["statuses"]).items())
        print(f"{r['kind']:30} {r['worst_health_s']:15.3f} {r['rss_before_mib']:11.0f} -> {r['rss_after_mib']:<9.0f}"
              f"  {counted}")


if __name__ == "__main__":
    main()
