"""GPU decode with every routed expert cached on the device, against the chip's memory bandwidth measured in the
same run (issue 36's goal: one stream at >= 500 tokens/s on the release-dimension slice of an H200).

The model: the release-dimension slice benchmarks/gpu_prefill.py builds (DeepSeek-V4-Flash's config cut to --layers,
default release layers 1, 2, 3, with all --experts 256 routed experts at full size, FP4 experts, converted with
--keep; the same --workdir reuses that step's container), or a synthetic --preset. Every expert is put into the
device's expert pool first (runtime/device_decode.py: decoded, or as its stored bytes, each of --pool-forms), then for
each B of --batch, B prompts of --tokens (different ones) are prefilled and stepped together greedily, --steps
timed steps after --warmup untimed ones (which capture the CUDA graphs). Each row of the output:
  path           pool: the routed work of a layer one grouped GEMM over the pool, no host sync, a CUDA graph per
                 (layer, B); per-expert: the same cached weights, each chosen expert's three matmuls on its own
                 (the path before the pool: host look-ups of every choice); stored pool (--pool-forms): the
                 experts' stored FP4 bytes pooled (a quarter of the memory), each step's chosen experts decoded side
                 by side and run as batched matmuls, or read straight from their bytes by the stored FP4 kernel
                 where its selection chose it (backends/stored_gemv.py: the report's stored_gemv, each shape class's
                 choice with both timings), no host sync, a CUDA graph per (layer, B) between the router's and the
                 finish's (runtime/device_decode.py StoredExpertPool)
  tokens/s       B x steps / seconds (a step ends with its logits on the host)
  bytes/token    what a step reads over its B tokens, every matrix in the compute dtype (the issue's measure): the
                 resident weights (dense and shared expert, the head; norms and mHC as held), plus the routed
                 experts it chose (each distinct (layer, expert) once a step, in the expert dtype); at B = 1
                 dense + shared + top-k routed. held bytes/token: the same with the resident weights as held (the
                 head and the router float32 on a GPU)
  bw fraction    bytes a step reads x steps/s over the HBM rate (a device-to-device copy of --copy-gib, bytes read
                 plus bytes written, timed with events; on a CPU a host copy)
  hit rate       the expert cache's hits over its look-ups in the timed steps; read/token: the bytes of missed
                 experts read per token (both 1 and 0 with every expert cached; --cache-fraction F gives each pool
                 a budget of F x every expert decoded: the stored pool holds several times as many)
  syncs          host synchronisations of the pool's routed work (0 when every expert is pooled)
  graph replays  CUDA graphs replayed in the timed steps (two a layer: its attention's mHC entry, its FFN)
  pool calls/step  layers whose routed work ran as one call over the pool, a step (the rest ran expert by expert:
                 a miss that could not be had in a slot); scratch/step: misses the cache refused that ran from the
                 pool's scratch slots, a step
  launches, graph launches, host waits per step (CUDA only, JSON rows): the CUDA runtime calls of one more step
                 under torch's profiler (kernels launched eagerly, graphs replayed, synchronisations; a step's
                 one expected wait is its logits' copy to the host); tests/step_audit.py predicts them on a CPU
Usage: python benchmarks/gpu_decode.py [--device cuda] [--batch 1,8] [--layers 1,2,3] [--experts 256]
       [--preset NAME] [--dims release|tiny] [--workdir DIR] [--json]
On a CPU (a dry run, seconds): --device cpu --preset small, or the slice at --dims tiny --experts 8. The floor,
predictions and the device command: benchmarks/gpu_decode.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import moepack  # noqa: F401  (before torch: moepack sets OpenMP's spin limit)
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from decode import ensure_container  # noqa: E402
from gpu_prefill import build, device_name, parse_on_device, print_report  # noqa: E402

from moepack.backends import stored_gemv  # noqa: E402
from moepack.runtime import generate as generate_module  # noqa: E402
from moepack.runtime.decode import Decoder  # noqa: E402
from moepack.runtime.engine import PrefillOptions  # noqa: E402
from moepack.runtime.generate import Generator  # noqa: E402
from moepack.runtime.memory import cuda_free_bytes  # noqa: E402

GIB = 1 << 30
GOAL_TOKENS_PER_S = 500  # issue 36: H200, release-dimension slice, one stream


def hbm_rate(device: torch.device, gib: float) -> float:
    """Bytes per second of a large copy on `device` (read + written), the best of five after one untimed."""
    n = int(gib * GIB)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)  # not zeros: real data
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    return 2 * n / best


def resident_bytes(decoder: Decoder, matrices_in: torch.dtype | None = None) -> int:
    """The resident weights a step reads (matrices, norms, router, mHC, the head; index tables left out: a hash
    layer reads one row): as held, or with every matrix counted in `matrices_in` (the issue's measure: the
    compute dtype; the head and the router are held float32 on a GPU)."""
    tensors = [t for weights in [*decoder.dense, decoder.head_weights] for t in weights.values()
               if t.is_floating_point()]
    return sum(t.numel() * (matrices_in.itemsize if matrices_in is not None and t.dim() == 2 else t.element_size())
               for t in tensors)


# CUDA runtime calls a step makes, by what they cost it: a kernel launched eagerly, a graph replayed, the host
# waiting for the device (a synchronisation, or a blocking copy's own)
_RUNTIME_CALLS = {"launches": ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"),
                  "graph_launches": ("cudaGraphLaunch", "cuGraphLaunch"),
                  "host_waits": ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                                 "cudaMemcpy", "cuStreamSynchronize", "cuCtxSynchronize")}


def device_runtime_calls(step, device: torch.device) -> dict:
    """One more step under torch's profiler: its CUDA runtime calls counted (_RUNTIME_CALLS), the measure of
    tests/step_audit.py's counts on the device. Empty on a CPU."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    return {f"{what}_per_step": sum(names.count(n) for n in calls) for what, calls in _RUNTIME_CALLS.items()}


def prefilled(g: Generator, prompts: int, length: int, new: int) -> list[tuple[list, int]]:
    """(KV states, first greedy token) of `prompts` different prompts of `length` tokens."""
    out = []
    for b in range(prompts):
        ids = torch.randint(3, g.cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(1000 + b))
        logits, states, *_ = g._prefill(ids, None, new)
        out.append((states, int(logits.argmax())))
    return out


def run_rows(g: Generator, prompts: list[tuple[list, int]], warmup: int, steps: int, pooled: bool) -> dict:
    """Greedy steps of the prompts together (each a fresh sequence after its prefill), over the pool or expert
    by expert."""
    d = g.decoder
    pool, batch = d.pool, len(prompts)
    d.pool = pool if pooled else None  # the per-expert path over the very same cached weights
    try:
        seqs = [d.start(states) for states, _ in prompts]
        tokens = [first for _, first in prompts]
        for _ in range(warmup):
            tokens = d.step_batch(seqs, tokens).argmax(dim=1).tolist()
        hits, misses, read = d.cache.hits, d.cache.misses, d.stats.bytes_read
        syncs, replays, calls, scratch = pool.syncs, pool.graphs.replays, pool.calls, pool.scratch_runs
        start = time.perf_counter()
        for _ in range(steps):
            tokens = d.step_batch(seqs, tokens).argmax(dim=1).tolist()
        seconds = time.perf_counter() - start
        hits, misses, read = d.cache.hits - hits, d.cache.misses - misses, d.stats.bytes_read - read
        runtime_calls = device_runtime_calls(lambda: d.step_batch(seqs, tokens), d.device)
        experts_per_step = (hits + misses) / steps  # each distinct (layer, expert) of a step looked up once
        # (the measure: each routed expert's matrices in the expert dtype, whatever the pool keeps)
        routed = experts_per_step * pool.decoded_bytes
        step_bytes = resident_bytes(d, d.compute_dtype) + routed
        path = ("stored pool" if pool.form == "stored" else "pool") if pooled else "per-expert"
        return {"path": path, "batch": batch, "steps": steps,
                "tokens_per_s": round(batch * steps / seconds, 1), "step_ms": round(1e3 * seconds / steps, 3),
                "bytes_per_token": int(step_bytes / batch), "experts_per_step": round(experts_per_step, 1),
                "step_bytes": int(step_bytes), "held_bytes_per_token": int((resident_bytes(d) + routed) / batch),
                "cache_misses": d.cache.misses, "hit_rate": round(hits / (hits + misses), 4),
                "read_bytes_per_token": int(read / (batch * steps)),
                "syncs": (pool.syncs - syncs) if pooled else None,
                "graph_replays": (pool.graphs.replays - replays) if pooled else None,
                "pool_calls_per_step": round((pool.calls - calls) / steps, 2) if pooled else None,
                "scratch_per_step": round((pool.scratch_runs - scratch) / steps, 2) if pooled else None,
                **runtime_calls}
    finally:
        d.pool = pool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--preset", help="a synthetic preset (tiny, small, medium...) instead of the release slice")
    ap.add_argument("--layers", default="1,2,3", help="release layer indexes of the slice (default 1,2,3)")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64, help="each prompt's length (default 64)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 32 on a GPU, 4 on a CPU)")
    ap.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--pool-forms", default="decoded,stored",
                    help="the pools measured: decoded weights, stored bytes decoded at each step (default both)")
    ap.add_argument("--cache-fraction", type=float, default=1.0,
                    help="a budget of this fraction of every expert decoded, for each pool form (default: every "
                         "expert cached): the stored pool holds several times as many, the rest are misses")
    ap.add_argument("--copy-gib", type=float, default=None, help="the bandwidth copy (default 4 GPU, 0.25 CPU)")
    args, device = parse_on_device(ap)  # (--workdir: gpu_prefill's, whose release slice this reuses)
    steps = args.steps or (32 if device.type == "cuda" else 4)
    os.makedirs(args.workdir, exist_ok=True)
    started = time.perf_counter()
    path = (ensure_container(args.workdir, args.preset) if args.preset else
            build(args.workdir, [int(v) for v in args.layers.split(",")], args.experts, args.json, args.dims))
    build_s = time.perf_counter() - started
    rate = hbm_rate(device, args.copy_gib or (4.0 if device.type == "cuda" else 0.25))
    batches = [int(v) for v in args.batch.split(",")]
    options = PrefillOptions(device=str(device), compute_dtype=args.compute_dtype)
    rows, shapes, seeds = [], {}, {}
    for form in args.pool_forms.split(","):
        # the expert pool on any device (a CPU's decoder keeps stored bytes for its compiled kernels by default)
        generate_module.Decoder = functools.partial(Decoder, decoded_experts=form == "decoded", expert_pool=True,
                                                    pool_form=form)
        with Generator(path, cache_gib=0.0, prefill=options) as g:
            d = g.decoder
            if d.pool is None:
                raise SystemExit(f"the {form} expert pool does not take these experts here (the decoded pool: "
                                 "torch's grouped GEMM, bf16 on CUDA)")
            every = [[1] * len(b.experts) for b in d.blocks]
            routed = sum(d._entry_bytes(layer, e) for layer, b in enumerate(d.blocks) for e in range(len(b.experts)))
            # the budget: every expert as this pool keeps it, or --cache-fraction of them all decoded (both forms)
            budget = routed if args.cache_fraction >= 1 else \
                int(args.cache_fraction * d.pool.routed_experts * d.pool.decoded_bytes)
            free = cuda_free_bytes(device) if device.type == "cuda" else 0
            if free and budget > 0.9 * free:  # one line, before a pool allocation fails with a traceback
                raise SystemExit(f"the {form} experts' budget takes {budget / GIB:.1f} GiB but {device} has "
                                 f"{free / GIB:.1f} GiB free: a smaller slice (--experts, --layers)")
            d.cache.resize(budget)
            started = time.perf_counter()
            d.seed(every)  # (as many as the budget holds)
            seeds[form] = round(time.perf_counter() - started, 2)
            assert args.cache_fraction < 1 or all(d.pool.complete(layer) for layer in range(len(d.blocks))), \
                "not every expert was pooled"
            prompts = prefilled(g, max(batches), args.tokens, args.warmup + steps + 1)  # each prompt prefilled once
            for batch in batches:
                for pooled_path in (True, False) if form == "decoded" else (True,):
                    row = run_rows(g, prompts[:batch], args.warmup, steps, pooled_path)
                    row["bandwidth_fraction"] = round(row["step_bytes"] * 1e3 / row["step_ms"] / rate, 4)
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)  # each row as it ends: a timeout keeps them
            shapes[form] = d.cache.bytes + d.cache.reserved  # (its scratch slots too: the budget all used)
            shape = {"layers": len(d.blocks), "experts": len(d.blocks[0].experts),
                     "top_k": g.cfg.num_experts_per_tok, "hidden": g.cfg.hidden_size, "inter": d.pool.inter,
                     "expert_dtype": str(d.pool.dtype), "resident_bytes": resident_bytes(d, d.compute_dtype),
                     "resident_held_bytes": resident_bytes(d)}
    shape["routed_cached_bytes"] = shapes
    one = next((r for r in rows if r["path"] == "pool" and r["batch"] == 1), None)
    report = {"device": device_name(device), "torch": torch.__version__,
              "model": args.preset or f"release layers {args.layers}", "shape": shape, "build_s": round(build_s, 1),
              "seed_s": seeds, "hbm_gbps": round(rate / 1e9, 1), "goal_tokens_per_s": GOAL_TOKENS_PER_S,
              "cache_fraction": args.cache_fraction,
              "goal_met": one["tokens_per_s"] >= GOAL_TOKENS_PER_S
              if one and device.type == "cuda" and args.cache_fraction >= 1 else None,
              "rows": rows, "stored_gemv": stored_gemv.DECISIONS}
    print_report(report, args.json,
                 f"{report['device']}: {report['model']}, {shape['layers']} layers of {shape['experts']} experts "
                 f"({shape['hidden']} x {shape['inter']}, top-{shape['top_k']}, {shape['expert_dtype']}), "
                 + ", ".join(f"{form} {n / 1e9:.3g} GB of experts on the device (seeded in {seeds[form]} s)"
                             for form, n in shapes.items()) + "; "
                 f"copy rate {report['hbm_gbps']} GB/s",
                 ["path", "B", "tok/s", "step ms", "bytes/token", "held bytes/token", "experts/step", "bw fraction",
                  "hit rate", "read/token", "syncs", "graph replays", "pool calls/step", "scratch/step"],
                 ("path", "batch", "tokens_per_s", "step_ms", "bytes_per_token", "held_bytes_per_token",
                  "experts_per_step", "bandwidth_fraction", "hit_rate", "read_bytes_per_token", "syncs",
                  "graph_replays", "pool_calls_per_step", "scratch_per_step"))
    if not args.json:  # which path the stored pool's FP4 experts took per shape class (the kernel or torch's)
        for key, decision in stored_gemv.DECISIONS.items():
            print(f"stored FP4 experts {key}: {decision}")
    if report["goal_met"] is not None and not args.json:
        print(f"goal (one stream >= {GOAL_TOKENS_PER_S} tokens/s): {'met' if report['goal_met'] else 'NOT met'}")


if __name__ == "__main__":
    main()
