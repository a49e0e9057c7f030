"""Prefill benchmark: streaming vs its parts vs transformers, measured side by side in one run.

For each prompt length N, on a synthetic model of a family (--family, default deepseek-v4) in its release layout
(default: its `medium` preset; DeepSeek-V4's FP8 dense + FP4 experts, Qwen3-MoE's `-FP8`, a few GB):
  io-alone       every region a prefill reads, read with the runtime's own reader (O_DIRECT, same bundles and
                 queue depth), cold cache, no compute
  compute-alone  the same prefill with the container already in RAM (page cache, mmap): no disk in the way
  streamed       the prefill from a cold cache with O_DIRECT: wall, io busy, compute busy,
                 overlap = wall / max(io-alone, compute-alone)  (1.00 = perfect overlap), each streamed run
                 against the io-alone and compute-alone runs beside it (the three interleaved), the median kept;
                 "overlap in run" is the prefill's own stat, wall / max(io busy, compute busy) within the streamed
                 run, and "steal s" what the hypervisor took from each streamed run's CPUs (0 on bare metal)
  transformers   the family's model (DeepseekV4ForCausalLM, Qwen3MoeForCausalLM) resident in memory (bf16, or
                 --transformers-dtype float32; loaded from `moepack export`), forward only
  io floor       the bytes a streamed prefill reads at the best speed measured in this run (fio's, or the
                 reader's alone where fio had no huge-page buffers and so read slower): no streamed prefill is
                 faster, so "best possible x" = transformers / io floor is the most a streamed run could show
                 where the prompt is too short to hide the disk
  resident x     compute-alone against transformers: both with the weights in RAM
Every measurement is the best of --repeat runs (default 3), ours and transformers' alike.

On a GPU (--device cuda) the same rows come out with the device's peak memory; --device-budget-gib B caps what
this process (and transformers') may allocate on the device (torch's per-process memory fraction), so a model
whose experts exceed B shows the prefill streaming what cannot stay resident: T_ssd = io-alone, T_compute =
compute-alone, wall = streamed. transformers is reported only where the model fits the budget.
Usage: python benchmarks/prefill.py [--family deepseek-v4|qwen3-moe] [--preset medium] [--tokens 256,1024]
                                    [--compute-dtype bfloat16] [--transformers-dtype float32]
                                    [--device cuda --device-budget-gib 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import moepack  # before torch: it limits OpenMP's spinning (moepack/__init__.py), which libgomp reads on load

import torch  # noqa: E402

from moepack.families import DEFAULT_FAMILY, family_entries
from moepack.format_spec.reader import Container
from moepack.packer.convert import convert_checkpoint
from moepack.packer.export import export_container
from moepack.packer.synth import synth_checkpoint
from moepack.runtime.engine import PrefillOptions, layer_prefill, prefill
from moepack.runtime.expert_decode import COMPUTE_DTYPES as EXPERT_DTYPES
from moepack.runtime.expert_decode import ExpertDecoder, expert_weight_count
from moepack.runtime.expert_runner import decode_expert
from moepack.tools.bench import drop_page_cache, prefill_read_plan, run_fio, time_reads


PRESETS = {entry.name: entry.synth_presets for entry in family_entries() if entry.synth_presets}


def warm_cache(path: str) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass


def io_alone(path: str, bundle: int, depth: int) -> tuple[float, int]:
    """Read what an all-experts prefill reads, in the same order and sizes, with nothing else going on."""
    with Container(path) as c:
        paths, reads = list(c.part_paths), prefill_read_plan(c, bundle)
    for p in paths:
        drop_page_cache(p)
    r = time_reads(paths, reads, depth, "direct")
    return r["seconds"], r["bytes"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_alone(path: str, dtype: torch.dtype, device: torch.device) -> tuple[float, int, int]:
    """Decode every routed expert once (bytes already in memory: RAM, or the device's), as the prefill's expert
    threads do (runtime/expert_runner.py's decode_expert, the family's naming and kernels): (seconds, bytes,
    weights)."""
    decoder = ExpertDecoder(dtype, device, threads=1)  # on a CPU as each expert thread of the prefill
    seconds = stored = weights = 0
    with Container(path) as c:
        family = layer_prefill(c, dtype)
        for block in c.layers:
            for region in block.experts:
                raw = torch.frombuffer(bytearray(c.pread(region.offset, region.length, region.part)),
                                       dtype=torch.uint8).to(device)
                _sync(device)
                start = time.perf_counter()
                decode_expert(decoder, family.expert_naming, block.number, region, raw, region.offset,
                              compiled=family.expert_ffn is None)
                _sync(device)
                seconds += time.perf_counter() - start
                stored += region.length
                weights += expert_weight_count(region)
        family.close()
    decoder.close()
    return seconds, stored, weights


TRANSFORMERS_RUN = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM
torch.set_num_threads(int(sys.argv[3]))
device, budget = torch.device(sys.argv[5]), float(sys.argv[6])
if device.type == "cuda" and budget:
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / torch.cuda.get_device_properties(device).total_memory))
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=getattr(torch, sys.argv[7])).eval().to(device)
sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
results = {}
for n in json.loads(sys.argv[2]):
    ids = torch.randint(3, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)).to(device)
    with torch.no_grad():
        model(ids[:, :8])
        best = float("inf")
        for _ in range(int(sys.argv[4])):
            sync()
            start = time.perf_counter()
            logits = model(ids).logits[0, -1].float()
            sync()
            best = min(best, time.perf_counter() - start)
        results[n] = {"seconds": best, "next_token": int(logits.argmax())}
print(json.dumps(results))
"""


def transformers_resident(export_dir: str, tokens: list[int], repeat: int, device: str = "cpu",
                          budget_bytes: int = 0, omp_spincount: str | None = None, dtype: str = "bfloat16") -> dict:
    """transformers' forward on the model in memory (in `dtype`, on `device`, within `budget_bytes` of it where
    given): {N:
    {"seconds", "next_token"}}, or {"error": ...} (e.g. the model does not fit the budget). It runs with OpenMP's
    defaults unless `omp_spincount` is given: the spin limit moepack sets for itself is not passed on."""
    env = dict(os.environ)
    if moepack.OMP_SPINCOUNT_SET_HERE:
        env.pop("GOMP_SPINCOUNT", None)
    if omp_spincount is not None:
        env["GOMP_SPINCOUNT"] = omp_spincount
    p = subprocess.run([sys.executable, "-c", TRANSFORMERS_RUN, export_dir, json.dumps(tokens),
                        str(torch.get_num_threads()), str(repeat), device, str(budget_bytes), dtype],
                       capture_output=True, text=True, env=env)
    if p.returncode:
        return {"error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "failed"}
    return {int(k): v for k, v in json.loads(p.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="bench-work")
    ap.add_argument("--family", default=DEFAULT_FAMILY, choices=sorted(PRESETS), help="the synthetic model's family")
    ap.add_argument("--preset", help="the family's preset (default: medium where it has one, else its largest)")
    ap.add_argument("--tokens", default="128,512,2048")
    ap.add_argument("--bundle-experts", type=int, default=4)
    ap.add_argument("--queue-depth", type=int, default=4)
    ap.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="prefill's --compute-dtype (bfloat16: as transformers runs)")
    ap.add_argument("--expert-dtype", default=None, choices=["float32", "bfloat16"],
                    help="prefill's --expert-dtype (default: --compute-dtype)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of each measurement, the best kept (ours and transformers alike): a shared VM's "
                         "run-to-run noise is 10-30%%")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--device-budget-gib", type=float, default=0,
                    help="cuda: the device memory this process may use (0: all of it)")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--transformers-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the dtype transformers' model is loaded in (float32: the compute dtype float32's twin; "
                         "its experts take 4 bytes a weight in RAM)")
    ap.add_argument("--transformers-omp-spincount", default=None,
                    help="run transformers with this GOMP_SPINCOUNT too (default: OpenMP's own)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.repeat = max(1, args.repeat)
    presets = PRESETS[args.family]
    args.preset = args.preset or ("medium" if "medium" in presets else presets[-1])
    if args.preset not in presets:
        ap.error(f"--preset: {args.family} has {', '.join(presets)}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    budget = int(args.device_budget_gib * 2**30)
    if device.type == "cuda" and budget:
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / torch.cuda.get_device_properties(device).total_memory))
    tokens = [int(t) for t in args.tokens.split(",")]
    os.makedirs(args.workdir, exist_ok=True)
    name = args.preset if args.family == DEFAULT_FAMILY else f"{args.family}-{args.preset}"
    src = os.path.join(args.workdir, f"{name}-release")
    container = os.path.join(args.workdir, f"{name}-keep.moepack")
    if not os.path.exists(os.path.join(src, "model.safetensors.index.json")):
        synth_checkpoint(src, preset=args.preset, layout="release", seed=0, progress=not args.json,
                         family=args.family)
    if not os.path.exists(container):
        convert_checkpoint(src, container, progress=not args.json)
    with Container(container) as c:
        vocab = c.config["vocab_size"]
        file_bytes = c.file_size
        expert_params = sum(expert_weight_count(r) for b in c.layers for r in b.experts)

    rows = []
    max_read_gbps = 0.0  # the reader's best speed alone so far in this run
    # the disk's own limit, measured in this run: a cloud disk's bandwidth varies by the hour (burst credits)
    fio_runs = [run_fio(container, 0, file_bytes, 8 << 20, args.queue_depth) for _ in range(args.repeat)]
    fio = max((f for f in fio_runs if "gbps" in f), key=lambda f: f["gbps"], default=fio_runs[0])
    args.expert_dtype = args.expert_dtype or args.compute_dtype
    dec_seconds, dec_bytes, dec_weights = decode_alone(container, EXPERT_DTYPES[args.expert_dtype], device)
    decode = {"seconds": round(dec_seconds, 3), "stored_gb_per_s": round(dec_bytes / dec_seconds / 1e9, 3),
              "gweights_per_s": round(dec_weights / dec_seconds / 1e9, 3)}
    warm_cache(container)  # one untimed prefill first: thread pools, allocator and page cache warmed up
    prefill(container, torch.arange(3, 3 + tokens[0]) % vocab, PrefillOptions(io_mode="mmap", device=args.device))
    for n in tokens:
        ids = torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n))
        base = dict(device=args.device, bundle_experts=args.bundle_experts, queue_depth=args.queue_depth,
                    expert_selection="all",
                    compute_dtype=args.compute_dtype, expert_dtype=args.expert_dtype)
        # io-alone, streamed and resident runs interleaved, so that each trio sees the disk and the cores as they
        # are at that minute (a shared VM drifts by 10-30 % from minute to minute)
        io_runs, streamed_runs, resident_runs = [], [], []
        for _ in range(max(1, args.repeat)):
            io_runs.append(io_alone(container, args.bundle_experts, args.queue_depth))
            drop_page_cache(container)
            streamed_runs.append(prefill(container, ids, PrefillOptions(io_mode="direct", **base)))
            warm_cache(container)
            resident_runs.append(prefill(container, ids, PrefillOptions(io_mode="mmap", **base)))
        io_seconds, io_bytes = min(io_runs)
        max_read_gbps = max(max_read_gbps, io_bytes / io_seconds / 1e9)
        streamed, resident = (min(runs, key=lambda r: r.stats["seconds"]) for runs in (streamed_runs, resident_runs))
        s = streamed.stats
        # each streamed run against the io-alone and resident runs of its own trio
        paired = [st.stats["seconds"] / max(io[0], rs.stats["seconds"])
                  for io, st, rs in zip(io_runs, streamed_runs, resident_runs)]
        rows.append({
            "tokens": n, "io_alone_s": round(io_seconds, 3), "compute_alone_s": resident.stats["seconds"],
            "streamed_s": s["seconds"], "io_busy_s": s["io_busy_s"], "compute_busy_s": s["compute_busy_s"],
            # the median trio: one run's overlap below 1 (streamed faster than resident) is the VM's noise
            "overlap": round(statistics.median(paired), 3), "overlap_runs": [round(x, 3) for x in paired],
            "overlap_of_bests": round(s["seconds"] / max(io_seconds, resident.stats["seconds"]), 3),
            # the stats' own overlap: wall against the run's io busy and compute busy time (the same run's parts)
            "overlap_in_run": round(statistics.median(st.stats["overlap"] for st in streamed_runs), 3),
            # what the hypervisor took from each run: on a shared VM a streamed run can lose CPU time to the host's
            # disk work that its resident twin never pays
            "steal_s_streamed": [st.stats["steal_s"] for st in streamed_runs],
            "steal_s_resident": [rs.stats["steal_s"] for rs in resident_runs],
            "tokens_per_s": s["tokens_per_s"], "bytes_read": s["bytes_read"],
            "read_gb_per_s_alone": round(io_bytes / io_seconds / 1e9, 3), "peak_rss_gib": round(s["peak_rss_bytes"] / 2**30, 2),
            "peak_device_gib": round(s["peak_device_bytes"] / 2**30, 3) if s.get("peak_device_bytes") else None,
            "peak_device_reserved_gib": (round(s["peak_device_reserved_bytes"] / 2**30, 3)
                                         if s.get("peak_device_reserved_bytes") else None),
            # no streamed prefill can beat reading its bytes at the disk's speed
            "io_floor_s": round(s["bytes_read"] / (max(fio.get("gbps", 0), max_read_gbps) * 1e9), 3),
            "same_token_as_resident": streamed.next_token == resident.next_token,
            "fused_expert_max_tokens": s["fused_expert_max_tokens"],
            "fused_expert_max_tokens_source": s["fused_expert_max_tokens_source"],
        })
    if not args.no_transformers:
        export_dir = os.path.join(args.workdir, f"{name}-bf16-export")
        if not os.path.exists(os.path.join(export_dir, "config.json")):
            export_container(container, export_dir, dtype="bf16", progress=not args.json)
        ref = transformers_resident(export_dir, tokens, args.repeat, args.device, budget,
                                    args.transformers_omp_spincount, args.transformers_dtype)
        for row in rows:
            r = ref.get(row["tokens"]) if "error" not in ref else None
            row["transformers_s"] = round(r["seconds"], 3) if r else None
            row["transformers_tokens_per_s"] = round(row["tokens"] / r["seconds"], 2) if r else None
            row["speedup_vs_transformers"] = round(r["seconds"] / row["streamed_s"], 2) if r else None
            # resident against resident: our prefill from the page cache (no disk) against transformers in RAM
            row["resident_speedup_vs_transformers"] = round(r["seconds"] / row["compute_alone_s"], 2) if r else None
            # the best any streamed prefill could do here: the disk's floor, or transformers' own time
            floor = row["io_floor_s"]
            row["best_possible_vs_transformers"] = round(r["seconds"] / floor, 2) if r and floor else None
        if "error" in ref:
            print(f"transformers run failed: {ref['error']}", file=sys.stderr)
    result = {"family": args.family, "preset": args.preset, "container_bytes": file_bytes,
              "compute_dtype": args.compute_dtype, "transformers_dtype": args.transformers_dtype,
              "expert_dtype": args.expert_dtype,
              "bundle_experts": args.bundle_experts, "queue_depth": args.queue_depth,
              "threads": torch.get_num_threads(), "repeat": args.repeat, "expert_decode_alone": decode,
              "fio": fio, "device": args.device, "device_budget_bytes": budget or None,
              "omp_spincount": os.environ.get("GOMP_SPINCOUNT"),
              "transformers_omp_spincount": args.transformers_omp_spincount,
              "expert_bytes_in_compute_dtype": expert_params * EXPERT_DTYPES[args.expert_dtype].itemsize,
              "rows": rows}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{args.family} {args.preset}: container {file_bytes / 1e9:.2f} GB, compute in {args.compute_dtype}, "
          f"experts in {args.expert_dtype}, transformers in {args.transformers_dtype}, bundle "
          f"{args.bundle_experts}, depth {args.queue_depth}, {torch.get_num_threads()} threads, on {args.device}; "
          f"fused FP4 experts up to {rows[0]['fused_expert_max_tokens']} tokens "
          f"({rows[0]['fused_expert_max_tokens_source']})")
    if budget:
        experts = result["expert_bytes_in_compute_dtype"]
        print(f"device budget {budget / 2**30:.2f} GiB; the experts in {args.expert_dtype} are {experts / 2**30:.2f} "
              f"GiB: {'they cannot all stay resident' if experts > budget else 'they fit: pick a larger preset'}")
    print(f"expert decode alone (every routed expert once, from memory, one thread): {decode['seconds']} s, "
          f"{decode['stored_gb_per_s']} GB/s stored, {decode['gweights_per_s']} G weights/s")
    fio_text = (f"{fio['gbps']:.3f} GB/s ({fio['engine']}, {fio['buffers']} buffers)" if "gbps" in fio
                else next(iter(fio.values())))
    print(f"disk: fio {fio_text}, reader alone {rows[0]['read_gb_per_s_alone']} GB/s; best of {args.repeat} runs each")
    head = ["N", "io-alone s", "io floor s", "compute-alone s", "streamed s", "overlap", "overlap in run",
            "steal s (streamed runs)", "tok/s", "transformers s",
            "x transformers", "resident x transformers", "best possible x", "peak device GiB", "reserved GiB"]
    print(" | ".join(head))
    for r in rows:
        print(" | ".join(str(v) for v in (r["tokens"], r["io_alone_s"], r["io_floor_s"], r["compute_alone_s"],
                                          r["streamed_s"], r["overlap"], r["overlap_in_run"], r["steal_s_streamed"],
                                          r["tokens_per_s"], r.get("transformers_s"),
                                          r.get("speedup_vs_transformers"), r.get("resident_speedup_vs_transformers"),
                                          r.get("best_possible_vs_transformers"), r["peak_device_gib"],
                                          r["peak_device_reserved_gib"])))


if __name__ == "__main__":
    main()
