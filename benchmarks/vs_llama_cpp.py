"""Prefill against llama.cpp on the same weights: moepack's layer-major prefill of a container, llama.cpp's
llama-bench on that container's GGUF export (`moepack export --format gguf`), side by side in one run.

The model is a float32 DeepSeek-V4 of ~3.4 GB (8 layers, 64 experts top-6, hidden 1024; llama.cpp's deepseek4
limits: compress ratios 4 / 128, head dims multiples of 64, 4 hyper-connection streams), written by `moepack synth`
and converted three ways, each exported to GGUF so both engines read the same bytes:
  f32    `convert --keep`   every weight F32
  bf16   the bf16 layout of the same synthetic model, `convert --keep` (norms, mHC, sinks F32)
  q8_0   `convert --q8`     the linears Q8_0 (ggml's blocks, byte-identical in both engines)
For each N: prompt tokens/s, warm (the files in the page cache; moepack's second prefill in one process, llama-bench
after its warm-up, median of its repetitions) and cold (the files dropped from the page cache first; one run, no
warm-up). moepack runs with its defaults (float32 compute) and, as a second row, `--compute-dtype bfloat16`;
llama.cpp with llama-bench's defaults (batch 2048, ubatch 512, F16 KV cache, flash attention auto, mmap).
Larger-than-memory runs (a cgroup cap) are benchmarks/capped.py's.

Usage: python benchmarks/vs_llama_cpp.py --llama-cpp BUILD [--tokens 512 1024 2048 4096] [--types f32 bf16 q8_0]
                                         [--threads 2] [--no-cold] [--workdir DIR] [--json]
BUILD: a llama.cpp build directory (benchmarks/llama_cpp.sh; $MOEPACK_LLAMA_CPP by default) with bin/llama-bench.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import moepack  # noqa: F401  (before torch: moepack sets OpenMP's spin limit)

from moepack.families.deepseek_v4.config import CSA, HCA, SLIDING
from moepack.format_spec.reader import Container
from moepack.packer.convert import convert_checkpoint
from moepack.packer.gguf_export import export_gguf
from moepack.packer.synth import synth_checkpoint
from moepack.tools.bench import drop_page_cache

# ~850M parameters: the issue's "3.4 GB float32 V4 model (8 layers, 64 experts, top-6; 302 MB of routed weights
# per token)", within what llama.cpp's deepseek4 runs.
BENCH_MODEL = dict(
    vocab_size=8192, hidden_size=1024, moe_intermediate_size=512, num_hidden_layers=8,
    layer_types=[SLIDING, CSA, HCA, CSA, HCA, CSA, HCA, SLIDING],
    mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 5, num_attention_heads=8, head_dim=256, q_lora_rank=512,
    o_groups=4, o_lora_rank=256, index_n_heads=16, index_head_dim=64, index_topk=16, n_routed_experts=64,
    num_experts_per_tok=6, compress_rates={CSA: 4, HCA: 128}, sliding_window=128, hc_mult=4,
)
POLICIES = {"f32": "keep", "bf16": "keep", "q8_0": "q8"}


def ensure_files(workdir: str, kind: str) -> tuple[str, str]:
    """(container, its GGUF) of the benchmark model stored as `kind`, built once in workdir. bf16 comes from the
    synthetic checkpoint's bf16 layout (the same draws, rounded), since `--bf16` keeps float32 sources (it converts
    only exactly)."""
    layout = "bf16" if kind == "bf16" else "f32"
    src = os.path.join(workdir, f"bench-{layout}-src")
    if not os.path.exists(os.path.join(src, "config.json")):
        synth_checkpoint(src, preset="medium", layout=layout, config_overrides=BENCH_MODEL, progress=False,
                         overwrite=True)
    container = os.path.join(workdir, f"bench-{kind}.moepack")
    if not os.path.exists(container):
        convert_checkpoint(src, container, policy=POLICIES[kind], progress=False)
    gguf = os.path.join(workdir, f"bench-{kind}.gguf")
    if not os.path.exists(gguf):
        export_gguf(container, gguf, progress=False)
    return container, gguf


def _child_prefill(container: str, n: int, runs: int, compute_dtype: str, threads: int) -> None:
    """In a fresh process: `runs` prefills of n tokens, printing each one's seconds (the prefill call only)."""
    import torch

    from moepack.runtime.engine import PrefillOptions, prefill

    torch.set_num_threads(threads)
    with Container(container) as c:
        vocab = int(c.config["vocab_size"])
    ids = torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        prefill(container, ids, PrefillOptions(compute_dtype=compute_dtype))
        times.append(time.perf_counter() - start)
    print(json.dumps(times))


def moepack_tokens_per_s(container: str, n: int, cold: bool, compute_dtype: str, threads: int) -> float:
    if cold:
        drop_page_cache(container)
    runs = 1 if cold else 2
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", container, str(n), str(runs),
                          compute_dtype, str(threads)], capture_output=True, text=True, check=True)
    return n / json.loads(out.stdout.strip().splitlines()[-1])[-1]


def llama_tokens_per_s(bench: str, gguf: str, n: int, cold: bool, threads: int) -> float:
    if cold:
        drop_page_cache(gguf)
    args = [bench, "-m", gguf, "-p", str(n), "-n", "0", "-t", str(threads), "-o", "json"]
    args += ["-r", "1", "--no-warmup"] if cold else ["-r", "3"]
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    row = json.loads(out.stdout)[0]
    return float(statistics.median(row["samples_ts"]) if row.get("samples_ts") else row["avg_ts"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", default=os.environ.get("MOEPACK_LLAMA_CPP"))
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--types", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "moepack-vs-llama"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        container, n, runs, dtype, threads = args.child
        _child_prefill(container, int(n), int(runs), dtype, int(threads))
        return 0
    bench = os.path.join(args.llama_cpp or "", "bin", "llama-bench")
    if not os.path.exists(bench):
        print("no llama-bench: pass --llama-cpp BUILD (benchmarks/llama_cpp.sh builds it)", file=sys.stderr)
        return 2
    os.makedirs(args.workdir, exist_ok=True)
    rows = []
    states = ["warm"] + ([] if args.no_cold else ["cold"])
    for kind in args.types:
        container, gguf = ensure_files(args.workdir, kind)
        size = os.path.getsize(gguf)
        for n in args.tokens:
            for state in states:
                cold = state == "cold"
                row = {"type": kind, "tokens": n, "cache": state, "gguf_bytes": size,
                       "llama_cpp": round(llama_tokens_per_s(bench, gguf, n, cold, args.threads), 1),
                       "moepack": round(moepack_tokens_per_s(container, n, cold, "float32", args.threads), 1),
                       "moepack_bf16_compute": round(moepack_tokens_per_s(container, n, cold, "bfloat16",
                                                                          args.threads), 1)}
                row["ratio"] = round(row["moepack"] / row["llama_cpp"], 2)
                row["ratio_bf16_compute"] = round(row["moepack_bf16_compute"] / row["llama_cpp"], 2)
                rows.append(row)
                if not args.json:
                    print(f"{kind:5} N={n:5} {state}: llama.cpp {row['llama_cpp']:7.1f} tok/s | moepack "
                          f"{row['moepack']:7.1f} ({row['ratio']:.2f}x) | moepack bf16 compute "
                          f"{row['moepack_bf16_compute']:7.1f} ({row['ratio_bf16_compute']:.2f}x)", flush=True)
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "date": time.strftime("%Y-%m-%d"), "threads": args.threads, "rows": rows}
    if args.json:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
