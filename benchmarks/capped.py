"""Larger-than-memory prefill: moepack and llama.cpp on the same weights, each process inside a memory cgroup capped
at --cap-fraction (default 0.45) of the container, page cache included, from a cold page cache.

The design note's argument, measured: a layer-major prefill reads each weight once, whatever N; llama.cpp's
ubatch loop (chunk-major, 512 tokens) re-reads what the cap evicted for every ubatch. The model is
benchmarks/vs_llama_cpp.py's float32 DeepSeek-V4 (~3.4 GB, 8 layers, 64 experts top-6), `convert --keep`, and
its GGUF export for llama.cpp. For each N, each engine as a user runs it, a fresh process per run:
  moepack     `moepack prefill CONTAINER --token-ids IDS --json` with its defaults (`--io auto`: the process's
              memory limit, the cgroup's, is what it compares the container with)
  llama.cpp   `llama-bench -m GGUF -p N -n 0 -r 1 --no-warmup` (its defaults: mmap, batch 2048, ubatch 512)
and prints the wall seconds of the whole process, prompt tokens/s, the bytes the machine read from its disks during
the run (/proc/diskstats) against the container's size, the cgroup's peak memory, and moepack's speed-up.
transformers + accelerate's disk offload is run where accelerate is installed.

Usage: python benchmarks/capped.py --llama-cpp BUILD [--tokens 1024 4096 8192] [--cap-fraction 0.45]
                                   [--type f32|bf16|q8_0] [--threads 2] [--workdir DIR] [--json]
Root only (a cgroup is made for each run).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import sys
import time

import cgroup
from cgroup import disk_read_bytes, failure, memory_cgroup, peak_bytes, run_capped
from vs_llama_cpp import ensure_files

from moepack.runtime.bench import drop_page_cache


def _capped(limit: int, argv: list[str], drop: list[str]) -> dict:
    """argv in a fresh cgroup of `limit` bytes, the files `drop` evicted from the page cache first."""
    with memory_cgroup(limit, "moepack-capped") as procs:
        if procs is None:
            return {"failed": cgroup.skip_reason}
        for path in drop:
            drop_page_cache(path)
        before, start = disk_read_bytes(), time.perf_counter()
        done = run_capped(procs, argv)
        wall = time.perf_counter() - start
        row = {"wall_s": round(wall, 2), "disk_read_bytes": disk_read_bytes() - before, "peak_bytes": peak_bytes(procs)}
    if done.returncode:
        row["failed"] = failure(done)
    row["stdout"] = done.stdout
    return row


def moepack_run(container: str, n: int, limit: int, threads: int, workdir: str) -> dict:
    ids = os.path.join(workdir, f"ids-{n}.json")
    with open(ids, "w") as f:
        json.dump([3 + (7919 * i) % 8000 for i in range(n)], f)
    moepack = shutil.which("moepack") or "moepack"
    row = _capped(limit, [moepack, "prefill", container, "--token-ids", ids, "--threads", str(threads), "--json"],
                  [container])
    if "failed" not in row:
        stats = json.loads(row["stdout"])
        row["engine_s"], row["io_mode"] = stats.get("seconds"), stats.get("io_mode")
    return row


def llama_run(bench: str, gguf: str, n: int, limit: int, threads: int) -> dict:
    row = _capped(limit, [bench, "-m", gguf, "-p", str(n), "-n", "0", "-r", "1", "--no-warmup", "-t", str(threads),
                          "-o", "json"], [gguf])
    if "failed" not in row:
        result = json.loads(row["stdout"])[0]
        row["engine_s"] = round(n / float(result["avg_ts"]), 2)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", default=os.environ.get("MOEPACK_LLAMA_CPP"))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--cap-fraction", type=float, default=0.45)
    ap.add_argument("--type", default="f32", choices=["f32", "bf16", "q8_0"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "moepack-vs-llama"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    bench = os.path.join(args.llama_cpp or "", "bin", "llama-bench")
    if not os.path.exists(bench):
        print("no llama-bench: pass --llama-cpp BUILD (benchmarks/llama_cpp.sh builds it)", file=sys.stderr)
        return 2
    os.makedirs(args.workdir, exist_ok=True)
    container, gguf = ensure_files(args.workdir, args.type)
    size = os.path.getsize(container)
    limit = int(args.cap_fraction * size)
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "date": time.strftime("%Y-%m-%d"), "type": args.type, "container_bytes": size,
              "gguf_bytes": os.path.getsize(gguf), "cap_bytes": limit, "threads": args.threads, "rows": []}
    if importlib.util.find_spec("accelerate") is None:
        result["transformers"] = "not run: accelerate (its disk offload) is not installed"
    for n in args.tokens:
        ours = moepack_run(container, n, limit, args.threads, args.workdir)
        theirs = llama_run(bench, gguf, n, limit, args.threads)
        row = {"tokens": n}
        for name, r in (("moepack", ours), ("llama_cpp", theirs)):
            r.pop("stdout", None)
            if "failed" not in r:
                r["tokens_per_s"] = round(n / r["wall_s"], 1)
                r["read_vs_container"] = round(r["disk_read_bytes"] / size, 2)
            row[name] = r
        if "failed" not in ours and "failed" not in theirs:
            row["speedup"] = round(theirs["wall_s"] / ours["wall_s"], 2)
        result["rows"].append(row)
        if not args.json:
            def show(r):
                if "failed" in r:
                    return f"failed: {r['failed']}"
                peak = f"{r['peak_bytes'] / 2**20:.0f} MiB" if r["peak_bytes"] else "?"
                return (f"{r['wall_s']:7.1f} s {r['tokens_per_s']:6.1f} tok/s, read {r['disk_read_bytes'] / 1e9:5.1f} GB "
                        f"({r['read_vs_container']:.2f}x), peak {peak}")
            print(f"N={n:5}  moepack {show(ours)} | llama.cpp {show(theirs)} | moepack "
                  f"{row.get('speedup', '-')}x", flush=True)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{args.type} model {size / 1e9:.2f} GB, cap {limit / 2**30:.2f} GiB ({args.cap_fraction} x), "
              f"{args.threads} threads; {result.get('transformers', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
