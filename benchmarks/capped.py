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
transformers + accelerate's disk offload (`from_pretrained(device_map="auto", max_memory={"cpu": cap / 2},
offload_folder=...)`, then one forward) is run too where accelerate is installed.

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
import subprocess
import sys
import time

import cgroup
from cgroup import disk_read_bytes, failure, memory_cgroup, peak_bytes, run_capped
from vs_llama_cpp import ensure_files

from moepack.runtime.bench import drop_page_cache


def _capped(limit: int, argv: list[str], drop: list[str], timeout: float | None = None) -> dict:
    """argv in a fresh cgroup of `limit` bytes, the files `drop` evicted from the page cache first."""
    with memory_cgroup(limit, "moepack-capped") as procs:
        if procs is None:
            return {"failed": cgroup.skip_reason}
        for path in drop:
            drop_page_cache(path)
        before, start = disk_read_bytes(), time.perf_counter()
        done = run_capped(procs, argv, timeout)
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


# transformers as a user runs a model larger than memory: accelerate's device_map with the CPU share capped and the
# rest offloaded to disk (accelerate copies it there first, then reads each layer back in its forward)
TRANSFORMERS_CHILD = """
import json, sys, time
import torch
from transformers import DeepseekV4ForCausalLM
src, n, cpu_bytes, offload, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
torch.set_num_threads(threads)
start = time.perf_counter()
model = DeepseekV4ForCausalLM.from_pretrained(src, device_map="auto", max_memory={"cpu": cpu_bytes},
                                              offload_folder=offload, dtype=torch.float32).eval()
loaded = time.perf_counter()
ids = torch.tensor([[3 + (7919 * i) % 8000 for i in range(n)]])
with torch.no_grad():
    model(ids, logits_to_keep=1)
print(json.dumps({"load_s": round(loaded - start, 2), "forward_s": round(time.perf_counter() - loaded, 2)}))
"""


def transformers_run(src: str, n: int, limit: int, threads: int, workdir: str, timeout: float) -> dict:
    """transformers + accelerate disk offload under the same cap: half the cap for weights in memory (the rest of
    the cgroup for activations and the page cache), the others offloaded to disk."""
    offload = os.path.join(workdir, "accelerate-offload")
    shutil.rmtree(offload, ignore_errors=True)
    try:
        row = _capped(limit, [sys.executable, "-c", TRANSFORMERS_CHILD, src, str(n), str(limit // 2), offload,
                              str(threads)], [os.path.join(src, f) for f in os.listdir(src)], timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"failed": f"still running after {timeout:.0f} s"}
    finally:
        shutil.rmtree(offload, ignore_errors=True)
    if "failed" not in row:
        row.update(json.loads(row["stdout"].strip().splitlines()[-1]))
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
    ap.add_argument("--transformers-timeout", type=float, default=900,
                    help="seconds one transformers + accelerate run may take")
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
    with_transformers = importlib.util.find_spec("accelerate") is not None
    if not with_transformers:
        result["transformers"] = "not run: accelerate (its disk offload) is not installed"
    src = os.path.join(args.workdir, f"bench-{'bf16' if args.type == 'bf16' else 'f32'}-src")
    for n in args.tokens:
        ours = moepack_run(container, n, limit, args.threads, args.workdir)
        theirs = llama_run(bench, gguf, n, limit, args.threads)
        row = {"tokens": n}
        engines = [("moepack", ours), ("llama_cpp", theirs)]
        if with_transformers and args.type != "q8_0":  # (transformers reads the float checkpoint)
            engines.append(("transformers", transformers_run(src, n, limit, args.threads, args.workdir,
                                                             args.transformers_timeout)))
            row["transformers"] = engines[-1][1]
        for name, r in engines:
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
                  f"{row.get('speedup', '-')}x"
                  + (f" | transformers + accelerate {show(row['transformers'])}" if "transformers" in row else ""),
                  flush=True)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{args.type} model {size / 1e9:.2f} GB, cap {limit / 2**30:.2f} GiB ({args.cap_fraction} x), "
              f"{args.threads} threads; {result.get('transformers', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
