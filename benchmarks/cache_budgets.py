"""Expert-cache budgets side by side, token by token: is any budget slower than none?

One Generator per configuration in one process, each decoding the same greedy sequence after the same prompt, their
steps interleaved (the configurations' order rotated each token), so that a shared machine's drift, which moves a
run's pace by 2x within minutes on a 2-vCPU VM, falls on all of them alike; each is warmed first by one generation
(its cache as `moepack serve` keeps it). A configuration is a budget in GiB, `default` (moepack's default budget),
or `lru:B`: budget B taking in every miss that fits (the cache before its admission policy; that cache alone).
Per configuration: the median step, tokens/s from it, its speed relative to the first configuration per token
(median and quartiles of the ratios), the hit rate, the misses copied into the cache and the evictions over the
timed tokens, and whether it generated the first configuration's tokens. Misses are read with O_DIRECT.

--cap-fraction F runs the whole thing as a child process in a memory cgroup of F x the container (root only;
benchmarks/cgroup.py): the setting where a cache smaller than a token's experts decoded 3.4x slower than none.

Usage: python benchmarks/cache_budgets.py CONTAINER [--configs 0,0.1,lru:0.1,1.0,lru:1.0] [--tokens 40]
                                         [--prompt 32] [--cap-fraction 0.45]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import moepack  # noqa: F401  (before torch: moepack sets OpenMP's spin limit)
import torch

from moepack.format_spec.reader import Container
from moepack.runtime.engine import PrefillOptions
from moepack.runtime.generate import GenerateOptions, Generator


def _generator(path: str, conf: str) -> Generator:
    budget = conf.removeprefix("lru:")
    g = Generator(path, cache_gib=None if budget == "default" else float(budget),
                  prefill=PrefillOptions(io_mode="direct", compute_dtype="bfloat16"))
    if conf.startswith("lru:"):  # every miss that fits taken in, the least recently used evicted
        cache = g.decoder.cache
        cache.admits = lambda key, nbytes: cache.fits(nbytes) and key not in cache
    return g


def side_by_side(path: str, configs: list[str], tokens: int, prompt: int) -> list[str]:
    with Container(path) as c:
        vocab = int(c.config["vocab_size"])
    ids = torch.randint(0, vocab, (prompt,), generator=torch.Generator().manual_seed(0))
    runs = []
    for conf in configs:
        g = _generator(path, conf)
        d = g.decoder
        g.generate(ids, GenerateOptions(max_new_tokens=8, stop_at_eos=False))  # warm, as a server's cache is
        logits, states, _, counts, *_ = g._prefill(ids, None, tokens + 2)
        d.begin(states)
        d.seed(counts)
        c = d.cache
        runs.append({"conf": conf, "g": g, "token": int(logits.argmax()), "times": [], "tokens": [],
                     "start": (c.hits, c.misses, c.admitted, c.evicted)})
    for i in range(tokens):
        for k in range(len(runs)):
            r = runs[(i + k) % len(runs)]
            start = time.perf_counter()
            logits = r["g"].decoder.step(r["token"])
            r["times"].append(time.perf_counter() - start)
            r["token"] = int(logits.argmax())
            r["tokens"].append(r["token"])
    lines, base = [], runs[0]
    for r in runs:
        c = r["g"].decoder.cache
        hits, misses, copied, evicted = (a - b for a, b in zip((c.hits, c.misses, c.admitted, c.evicted), r["start"]))
        step = statistics.median(r["times"])
        ratios = sorted(b / a for a, b in zip(r["times"], base["times"]))  # its speed relative to the first's
        q = [ratios[int(p * (len(ratios) - 1))] for p in (0.25, 0.5, 0.75)]
        lines.append(f"{r['conf']:>10} ({c.budget / 2**30:.3f} GiB): {1 / step:6.2f} tokens/s (median step "
                     f"{step * 1000:.0f} ms), speed / {base['conf']}: {q[1]:.2f} (quartiles {q[0]:.2f}-{q[2]:.2f}), "
                     f"hit rate {hits / max(hits + misses, 1):.3f}, copied in {copied} ({copied / tokens:.1f} per "
                     f"token), evicted {evicted}, tokens as {base['conf']}: {r['tokens'] == base['tokens']}")
        r["g"].close()
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container")
    ap.add_argument("--configs", default="0,0.1,lru:0.1,1.0,lru:1.0")
    ap.add_argument("--tokens", type=int, default=40, help="timed decode steps per configuration")
    ap.add_argument("--prompt", type=int, default=32, help="prompt length")
    ap.add_argument("--cap-fraction", type=float, help="run in a memory cgroup of this x the container")
    args = ap.parse_args()
    if args.cap_fraction:
        import cgroup

        limit = int(args.cap_fraction * os.path.getsize(args.container))
        with cgroup.memory_cgroup(limit, "moepack-cache-budgets") as procs:
            if procs is None:
                print(f"skipped: {cgroup.skip_reason}")
                return 1
            done = cgroup.run_capped(procs, [sys.executable, os.path.abspath(__file__), args.container, "--configs",
                                             args.configs, "--tokens", str(args.tokens), "--prompt", str(args.prompt)])
            print(f"in a cgroup of {limit / 2**30:.2f} GiB ({args.cap_fraction} x the container); its peak "
                  f"{(cgroup.peak_bytes(procs) or 0) / 2**30:.2f} GiB")
            print(done.stdout if done.returncode == 0 else cgroup.failure(done))
            return done.returncode
    print("\n".join(side_by_side(args.container, args.configs.split(","), args.tokens, args.prompt)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
