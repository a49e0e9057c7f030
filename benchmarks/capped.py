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
offload_folder=...)`, then one forward) is run too where accelerate is installed (not with --device cuda).

On a GPU (--device cuda, a llama.cpp built with CUDA) the experts are held over a device budget of --vram-gib:
  moepack     `moepack prefill ... --device cuda --compute-dtype bfloat16`, the process's device memory capped at
              the budget (torch's per-process memory fraction); the experts stream through it layer by layer
  llama.cpp   `llama-bench ... -ngl 99 -ncmoe K`: every layer on the GPU, but the experts of the first K layers in
              host memory (the GGUF's mapping, under the same cap), K the fewest that leave at most the budget of
              experts on the device; ggml copies those to the GPU for each ubatch
The cap is on host memory, as above; the device's peak is moepack's own count.

Usage: python benchmarks/capped.py --llama-cpp BUILD [--tokens 1024 4096 8192] [--cap-fraction 0.45]
                                   [--type f32|bf16|q8_0] [--threads 2] [--device cuda --vram-gib 1]
                                   [--no-transformers] [--workdir DIR] [--json]
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

from moepack.format_spec.reader import Container
from moepack.tools.bench import drop_page_cache


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


# the CLI in a process whose device memory is capped first (torch's allocator refuses past the fraction)
CAPPED_DEVICE_CLI = """
import sys
import moepack  # before torch, as the CLI does (OpenMP's settings are read on load)
import torch
torch.cuda.set_per_process_memory_fraction(min(1.0, float(sys.argv[1]) / torch.cuda.mem_get_info()[1]))
from moepack.cli.main import main
sys.argv = ["moepack"] + sys.argv[2:]
sys.exit(main())
"""


def moepack_run(container: str, n: int, limit: int, threads: int, workdir: str, vram: int | None = None) -> dict:
    """`moepack prefill` with its defaults; with `vram` (bytes) on the GPU, its device memory capped there."""
    ids = os.path.join(workdir, f"ids-{n}.json")
    with open(ids, "w") as f:
        json.dump([3 + (7919 * i) % 8000 for i in range(n)], f)
    args = ["prefill", container, "--token-ids", ids, "--threads", str(threads), "--json"]
    if vram is None:
        argv = [shutil.which("moepack") or "moepack"] + args
    else:
        argv = [sys.executable, "-c", CAPPED_DEVICE_CLI, str(vram)] + args + ["--device", "cuda",
                                                                          "--compute-dtype", "bfloat16"]
    row = _capped(limit, argv, [container])
    if "failed" not in row:
        stats = json.loads(row["stdout"])
        row["engine_s"], row["io_mode"] = stats.get("seconds"), stats.get("io_mode")
        if stats.get("peak_device_bytes"):
            row["peak_device_bytes"] = stats["peak_device_bytes"]
    return row


def experts_on_host(container: str, vram: int) -> tuple[int, int]:
    """(K, layers): llama.cpp's -ncmoe K that leaves at most `vram` bytes of routed experts on the device."""
    with Container(container) as c:
        sizes = [layer.experts_span[1] for layer in c.layers]
    on_device, k = 0, len(sizes)
    for size in reversed(sizes):  # -ncmoe keeps the first K layers' experts on the host
        if on_device + size > vram:
            break
        on_device, k = on_device + size, k - 1
    return k, len(sizes)


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


def llama_run(bench: str, gguf: str, n: int, limit: int, threads: int, cpu_moe: int | None = None) -> dict:
    """llama-bench with its defaults; with `cpu_moe` (a CUDA build), every layer on the GPU but the experts of the
    first `cpu_moe` layers."""
    gpu = [] if cpu_moe is None else ["-ngl", "99", "-ncmoe", str(cpu_moe)]
    row = _capped(limit, [bench, "-m", gguf, "-p", str(n), "-n", "0", "-r", "1", "--no-warmup", "-t", str(threads),
                          *gpu, "-o", "json"], [gguf])
    if "failed" not in row:
        result = json.loads(row["stdout"])[0]
        row["engine_s"] = round(n / float(result["avg_ts"]), 2)
    return row


def machine(device: str) -> str:
    cpus = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    if device == "cuda":
        import torch
        return f"{torch.cuda.get_device_name(0)}, {cpus}"
    return cpus


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
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--vram-gib", type=float, default=1.0,
                    help="with --device cuda: the device memory moepack may use, and the most routed experts "
                         "llama.cpp keeps on the device")
    ap.add_argument("--no-transformers", action="store_true")
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
    result = {"machine": machine(args.device), "date": time.strftime("%Y-%m-%d"), "type": args.type,
              "container_bytes": size, "gguf_bytes": os.path.getsize(gguf), "cap_bytes": limit,
              "threads": args.threads, "device": args.device, "rows": []}
    vram = cpu_moe = None
    if args.device == "cuda":
        vram = int(args.vram_gib * 2**30)
        cpu_moe, layers = experts_on_host(container, vram)
        result.update(vram_bytes=vram, llama_cpp_experts_on_host=f"{cpu_moe} of {layers} layers (-ncmoe)")
    with_transformers = importlib.util.find_spec("accelerate") is not None
    if args.no_transformers or args.device == "cuda":
        with_transformers, result["transformers"] = False, "not run (--no-transformers, or on a GPU)"
    elif not with_transformers:
        result["transformers"] = "not run: accelerate (its disk offload) is not installed"
    src = os.path.join(args.workdir, f"bench-{'bf16' if args.type == 'bf16' else 'f32'}-src")
    for n in args.tokens:
        ours = moepack_run(container, n, limit, args.threads, args.workdir, vram)
        theirs = llama_run(bench, gguf, n, limit, args.threads, cpu_moe)
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
                if r.get("peak_device_bytes"):
                    peak += f" (device {r['peak_device_bytes'] / 2**20:.0f} MiB)"
                return (f"{r['wall_s']:7.1f} s {r['tokens_per_s']:6.1f} tok/s, read {r['disk_read_bytes'] / 1e9:5.1f} GB "
                        f"({r['read_vs_container']:.2f}x), peak {peak}")
            print(f"N={n:5}  moepack {show(ours)} | llama.cpp {show(theirs)} | moepack "
                  f"{row.get('speedup', '-')}x"
                  + (f" | transformers + accelerate {show(row['transformers'])}" if "transformers" in row else ""),
                  flush=True)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        gpu = (f"; on {result['machine']}, device budget {args.vram_gib} GiB, llama.cpp's experts on the host: "
               f"{result['llama_cpp_experts_on_host']}" if vram else "")
        print(f"{args.type} model {size / 1e9:.2f} GB, cap {limit / 2**30:.2f} GiB ({args.cap_fraction} x), "
              f"{args.threads} threads{gpu}; {result.get('transformers', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
