"""Decode benchmark: `moepack generate`'s token-major decode with expert-cache budgets of 0, 25 % and 100 % of the
routed experts, beside the disk's limit and transformers' resident `generate`, measured in one run.

On a synthetic model of a family (--family, default deepseek-v4: the `medium` preset in the release layout, FP8
dense + FP4 experts; qwen3-moe: its `medium`, Qwen3-30B-A3B's width, the -FP8 layout):
  moepack, cache B   greedy generation of --new-tokens after a --tokens prompt, misses read with O_DIRECT from
                     a cold page cache: decode tokens/s, expert-cache hit rate, routed bytes read per token;
                     then "warm": the median of three more on the same Generator (its cache kept, as `moepack
                     serve` keeps it), the figure llama-bench's (after its warm-up, over 3 repetitions) compares with
  disk limit         tokens/s if every token read its routed experts (top-k per layer) at fio's rate, with no
                     cache: routed bytes per token / fio GB/s (the reader's own rate where fio is missing)
  transformers       the family's model (DeepseekV4ForCausalLM, Qwen3MoeForCausalLM) resident (loaded from
                     `moepack export`), `generate` greedy; decode tokens/s from the difference of a long and a
                     one-token generation
  llama.cpp          with --vs-llama and a llama.cpp build: llama-bench's decode (`-p 0 -n NEW -d TOKENS`) of the
                     container's GGUF export, the same weights; then "paired": five resident runs of each engine in
                     alternation (moepack warm, every expert cached), the median of the five ratios
--batch 1,4,8 then steps B concurrent sequences together (Decoder.step_batch: B different prompts, each prefilled
through the Generator and started with decoder.start), --new-tokens steps on one Generator whose cache holds every
expert: per B the step's ms, the aggregate tokens/s, its ratio to B = 1, the memory-bound ratio beside it (B x the
bytes a step reads at B = 1 / the bytes at B: the most a step bound only by reading its weights would allow), and the
bytes a step reads (the resident weights once, the distinct experts the rows chose); the sizes run in turn, three
rounds, the median round reported.
--cap-fraction F runs the moepack rows again as a child process in a cgroup (v1 memory controller, or v2) capped at
F x the container's size, page cache included (root only), and llama.cpp's decode in the same cgroup from a cold
page cache, with the bytes each read from disk.

Usage: python benchmarks/decode.py [--family deepseek-v4|qwen3-moe] [--preset medium
                                   | --vs-llama f32|bf16|q8_0 --llama-cpp BUILD] [--tokens 64] [--new-tokens 32]
                                   [--compute-dtype bfloat16] [--cap-fraction 0.45]
                                   [--no-transformers] [--device cpu|cuda] [--batch 1,4,8] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time

import moepack  # noqa: F401  (before torch: moepack sets OpenMP's spin limit)
import torch

from moepack.families import DEFAULT_FAMILY, family_entries
from moepack.format_spec.reader import Container
from moepack.packer.convert import convert_checkpoint
from moepack.packer.export import export_container
from moepack.packer.synth import synth_checkpoint
from moepack.tools.bench import drop_page_cache, run_fio
from moepack.runtime.engine import PrefillOptions
from moepack.runtime.expert_decode import expert_weight_count
from moepack.runtime.generate import GenerateOptions, Generator

GIB = 1 << 30
FAMILY_PRESETS = {entry.name: entry.synth_presets for entry in family_entries() if entry.synth_presets}
BUDGETS = (0.0, 0.25, 1.0)
WARM_RUNS = 3  # generations after the first, their median reported (llama-bench: -r 3)


def ensure_container(workdir: str, preset: str, family: str = DEFAULT_FAMILY) -> str:
    name = preset if family == DEFAULT_FAMILY else f"{family}-{preset}"
    src, out = os.path.join(workdir, f"{name}-src"), os.path.join(workdir, f"{name}.moepack")
    if not os.path.exists(out):
        if not os.path.exists(os.path.join(src, "config.json")):
            synth_checkpoint(src, preset=preset, layout="release", progress=False, family=family)
        convert_checkpoint(src, out, policy="keep", progress=False)
    return out


def routed_facts(container: str) -> dict:
    with Container(container) as c:
        experts = [r.length for b in c.layers for r in b.experts]
        top_k = int(c.config["num_experts_per_tok"])
        per_layer = [sum(r.length for r in b.experts) / len(b.experts) for b in c.layers]
        weights = sum(expert_weight_count(r) for b in c.layers for r in b.experts)
        return {"routed_bytes": sum(experts), "largest_expert": max(experts), "routed_weights": weights,
                "routed_bytes_per_token": int(sum(top_k * avg for avg in per_layer)), "top_k": top_k,
                "first_expert_offset": min(r.offset for b in c.layers for r in b.experts),
                "vocab": int(c.config["vocab_size"]), "size": os.path.getsize(container)}


def disk_rate(container: str, facts: dict) -> dict:
    fio = run_fio(container, facts["first_expert_offset"], min(1 << 30, facts["routed_bytes"]),
                  facts["largest_expert"], facts["top_k"])
    if "gbps" in fio:
        return {"gbps": fio["gbps"], "source": "fio"}
    from moepack.tools.bench import prefill_read_plan, time_reads

    with Container(container) as c:
        plan = prefill_read_plan(c, 1)
        paths = c.part_paths
    drop_page_cache(container)
    got = time_reads(paths, plan, facts["top_k"], "direct")
    return {"gbps": round(got["bytes"] / got["seconds"] / 1e9, 3),
            "source": f"moepack's reader ({fio.get('skipped', 'fio failed')})"}


def moepack_row(container: str, ids: torch.Tensor, new: int, budget_gib: float, compute_dtype: str,
                device: str = "cpu") -> dict:
    """The first generation from a cold page cache (its misses read with O_DIRECT), then three more on the same
    Generator (its expert cache kept, as `moepack serve` keeps it): `warm_tokens_per_s` is their median decode, the
    figure llama-bench's (after its warm-up, over its repetitions) compares with."""
    drop_page_cache(container)
    options = GenerateOptions(max_new_tokens=new, cache_gib=budget_gib, stop_at_eos=False,
                              prefill=PrefillOptions(io_mode="direct", compute_dtype=compute_dtype, device=device))
    with Generator(container, cache_gib=budget_gib, prefill=options.prefill) as g:
        start = time.perf_counter()
        result = g.generate(ids, options)
        first_s = time.perf_counter() - start
        warm = sorted((g.generate(ids, options).stats["decode"] for _ in range(WARM_RUNS)),
                      key=lambda d: d["tokens_per_s"] or 0)[WARM_RUNS // 2]
    d = result.stats["decode"]
    return {"cache_gib": budget_gib, "cache_budget_bytes": d["cache_budget_bytes"],
            "tokens_per_s": d["tokens_per_s"], "hit_rate": d["expert_cache_hit_rate"],
            # misses taken into the cache (each a copy) and entries evicted, in the first generation
            "cache_admitted": d["cache_admitted"], "cache_evicted": d["cache_evicted"],
            "bytes_read_per_token": d["bytes_read_per_token"], "disk_wait_s": d["disk_wait_s"],
            "decode_tokens": d["tokens"], "cache_seed_bytes": d["cache_seed_bytes"],
            "warm_tokens_per_s": warm["tokens_per_s"], "warm_hit_rate": warm["expert_cache_hit_rate"],
            "warm_bytes_read_per_token": warm["bytes_read_per_token"],
            "prefill_s": result.stats["prefill"]["seconds"], "generated": result.generated_ids,
            # the first generation whole (prefill, cache seeding, decode) and the prompt's experts it took from the
            # prefill's reads rather than reading them again
            "first_generation_s": round(first_s, 3), "cache_seed_s": d["cache_seed_s"],
            "cache_from_prefill_bytes": d["cache_from_prefill_bytes"],
            # the process's peak so far (a child per row under --cap-fraction: that row's own)
            "peak_rss_bytes": d["peak_rss_bytes"], "memory_bound_bytes": d["memory_bound_bytes"]}


def batch_rows(container: str, facts: dict, sizes: list[int], prompt: int, steps: int, compute_dtype: str,
               device: str) -> list[dict]:
    """For each B in `sizes`: B sequences (B prompts of `prompt` tokens, seeds 1..B) stepped together `steps` times
    by Decoder.step_batch, greedy, on one Generator whose cache holds every expert (warm: one untimed step first);
    the sizes in turn for WARM_RUNS rounds, each size's median round reported.
    The step's ms, the aggregate tokens/s, and the bytes a step reads: the resident weights once, the distinct
    experts its rows chose (the cache's lookups: one per distinct expert and layer)."""
    options = PrefillOptions(compute_dtype=compute_dtype, device=device)
    with Generator(container, cache_gib=facts["routed_bytes"] * 1.01 / GIB, prefill=options) as g:
        d = g.decoder
        prompts = [torch.randint(0, facts["vocab"], (prompt,), generator=torch.Generator().manual_seed(b + 1))
                   for b in range(max(sizes))]
        prefilled = [g._prefill(ids, None, steps + 1)[:2] for ids in prompts]
        d.seed([[1] * len(block.experts) for block in d.blocks])  # every expert in the cache
        dense = sum(t.nbytes for w in d.dense for t in w.values()) + d.head_weights[d.arithmetic.names.head].nbytes
        expert = facts["routed_bytes"] / sum(len(block.experts) for block in d.blocks)
        runs = {size: [] for size in sizes}  # (seconds, distinct experts per step) per round
        for _ in range(WARM_RUNS):  # the sizes in turn, WARM_RUNS rounds: a shared machine's load hits them alike
            for size in sizes:
                sequences = [d.start(copy.deepcopy(states)) for _, states in prefilled[:size]]
                tokens = [int(logits.argmax()) for logits, _ in prefilled[:size]]
                tokens = d.step_batch(sequences, tokens).argmax(-1).tolist()  # warm-up
                lookups = d.cache.hits + d.cache.misses
                start = time.perf_counter()
                for _ in range(steps):
                    tokens = d.step_batch(sequences, tokens).argmax(-1).tolist()
                runs[size].append((time.perf_counter() - start, (d.cache.hits + d.cache.misses - lookups) / steps))
        rows = []
        for size in sizes:
            seconds, distinct = sorted(runs[size])[WARM_RUNS // 2]  # the median round
            rows.append({"batch": size, "step_ms": round(1000 * seconds / steps, 2),
                         "tokens_per_s": round(size * steps / seconds, 2),
                         "experts_per_step": round(distinct, 1), "dense_mb_per_step": round(dense / 1e6, 1),
                         "expert_mb_per_step": round(distinct * expert / 1e6, 1)})
        one = next((r for r in rows if r["batch"] == 1), None)
        for r in rows:  # to one stream's; the ceiling: what a step bound only by reading its weights would allow
            r["ratio"] = round(r["tokens_per_s"] / one["tokens_per_s"], 2) if one else None
            r["memory_bound_ratio"] = round(r["batch"] * step_mb(one) / step_mb(r), 2) if one else None
        return rows


def step_mb(row: dict) -> float:
    """The MB a batch row's step reads: the resident weights once, its distinct experts."""
    return row["dense_mb_per_step"] + row["expert_mb_per_step"]


def transformers_row(container: str, workdir: str, ids: torch.Tensor, new: int) -> dict:
    from transformers import AutoModelForCausalLM  # (the family's: DeepseekV4ForCausalLM, Qwen3MoeForCausalLM)

    export = os.path.join(workdir, f"export-bf16-{os.path.basename(container)}")
    if not os.path.exists(os.path.join(export, "config.json")):
        export_container(container, export, dtype="bf16", progress=False)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.bfloat16).eval()

    def timed(n: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start
    timed(2)  # warm up
    one, many = timed(1), timed(new)
    return {"tokens_per_s": round((new - 1) / max(many - one, 1e-9), 2)}


def _child_argv(args, budget: float | None) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--workdir", args.workdir, "--family", args.family,
            "--preset", args.preset,
            *(["--vs-llama", args.vs_llama] if args.vs_llama else []), "--tokens", str(args.tokens),
            "--new-tokens", str(args.new_tokens), "--compute-dtype", args.compute_dtype, "--no-transformers",
            "--no-disk", "--json", "--budget-gib", "default" if budget is None else str(round(budget / GIB, 3)),
            "--device", args.device]


def _llama_bench_argv(bench: str, gguf: str, args) -> list[str]:
    """llama-bench generating --new-tokens after a --tokens context, as many threads as moepack, JSON out."""
    return [bench, "-m", gguf, "-p", "0", "-n", str(args.new_tokens), "-d", str(args.tokens), "-t",
            str(torch.get_num_threads()), "-o", "json"]


def llama_row(bench: str, gguf: str, args, procs: str | None = None) -> dict:
    """llama.cpp's decode on the same weights: llama-bench generating --new-tokens after a --tokens context
    (`-p 0 -n new -d tokens`), llama-bench's defaults otherwise. Resident: after its warm-up, the mean of 3. In a
    cgroup (procs): from a cold page cache, one run, no warm-up, with the bytes the machine read from disk."""
    from cgroup import disk_read_bytes, failure, run_capped

    argv = _llama_bench_argv(bench, gguf, args)
    if procs is None:
        done = subprocess.run(argv + ["-r", "3"], capture_output=True, text=True)
        read = None
    else:
        drop_page_cache(gguf)
        before = disk_read_bytes()
        done = run_capped(procs, argv + ["-r", "1", "--no-warmup"])
        read = disk_read_bytes() - before
    if done.returncode:
        return {"failed": failure(done)}
    row = json.loads(done.stdout)[0]
    out = {"tokens_per_s": round(float(row["avg_ts"]), 2)}
    if read is not None:  # the depth's prompt is processed first: its reads are counted too
        out["disk_read_bytes"] = read
    return out


def paired_rows(container: str, gguf: str, bench: str, ids: torch.Tensor, args, budget_gib: float,
                pairs: int = 5) -> dict:
    """Resident decode of both engines in alternation, moepack (warm: a Generator whose cache holds every expert)
    then llama-bench (`-r 1`, after its warm-up), `pairs` times: on a shared machine whose pace drifts from minute to
    minute, the ratio of runs made seconds apart is steadier than the ratio of two separate rows."""
    from cgroup import failure

    options = GenerateOptions(max_new_tokens=args.new_tokens, cache_gib=budget_gib, stop_at_eos=False,
                              prefill=PrefillOptions(compute_dtype=args.compute_dtype, device=args.device))
    argv = _llama_bench_argv(bench, gguf, args) + ["-r", "1"]
    ours, theirs = [], []
    with Generator(container, cache_gib=budget_gib, prefill=options.prefill) as g:
        g.generate(ids, options)  # the cache filled, as after llama-bench's warm-up
        for _ in range(pairs):
            ours.append(g.generate(ids, options).stats["decode"]["tokens_per_s"])
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode:
                return {"failed": failure(done)}
            theirs.append(round(float(json.loads(done.stdout)[0]["avg_ts"]), 2))
    ratios = sorted(a / b for a, b in zip(ours, theirs))
    return {"moepack": ours, "llama_cpp": theirs, "ratio_median": round(ratios[len(ratios) // 2], 3),
            "ratio_range": [round(ratios[0], 3), round(ratios[-1], 3)]}


def capped_rows(args, container: str, facts: dict, gguf: str | None, bench: str | None) -> dict:
    """The moepack rows again, each a child process inside a memory cgroup capped at cap_fraction x the container
    (page cache included), and llama.cpp's decode of the same weights in the same cgroup."""
    import cgroup
    from cgroup import disk_read_bytes, failure, memory_cgroup, peak_bytes, run_capped

    limit = int(args.cap_fraction * facts["size"])
    with memory_cgroup(limit, "moepack-decode") as procs:
        if procs is None:
            return {"skipped": cgroup.skip_reason}
        rows = []
        # a cache that leaves the cgroup room: a quarter of what the routed experts may take of it
        room = max(limit - (facts["size"] - facts["routed_bytes"]) * 2, 0) // 4
        for budget in (0, room, None):  # one child each (None: the default): one killed for memory leaves the others
            before = disk_read_bytes()
            done = run_capped(procs, _child_argv(args, budget))
            if done.returncode:
                rows.append({"cache_gib": None if budget is None else round(budget / GIB, 3),
                             "failed": failure(done)})
            else:
                # (a child's own peak RSS is not its own: Linux keeps ru_maxrss across fork + exec, so the parent's
                # shows through; the cgroup's peak, page cache included, is the bound that held)
                rows += [{**r, "disk_read_bytes": disk_read_bytes() - before, "cgroup_peak_bytes": peak_bytes(procs)}
                         for r in json.loads(done.stdout)["moepack"]]
        out = {"limit_bytes": limit, "rows": rows}
        if bench and gguf:
            out["llama_cpp"] = llama_row(bench, gguf, args, procs)
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "moepack-decode-bench"))
    ap.add_argument("--family", default=DEFAULT_FAMILY, choices=sorted(FAMILY_PRESETS),
                    help="the synthetic model's family (--vs-llama: deepseek-v4)")
    ap.add_argument("--preset", help="the family's preset (default: medium for deepseek-v4, else its largest)")
    ap.add_argument("--vs-llama", choices=["f32", "bf16", "q8_0"],
                    help="instead of --preset: benchmarks/vs_llama_cpp.py's model stored as this type, which "
                         "llama.cpp's deepseek4 runs (its GGUF export is llama.cpp's rows' file)")
    ap.add_argument("--llama-cpp", default=os.environ.get("MOEPACK_LLAMA_CPP"),
                    help="a llama.cpp build (benchmarks/llama_cpp.sh) for the llama.cpp rows (needs --vs-llama)")
    ap.add_argument("--tokens", type=int, default=64, help="prompt length")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--compute-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--budget-gib", help="comma-separated cache budgets in GiB, `default` for moepack's default "
                                         "(default: 0, 25 %% and 100 %% of the routed experts)")
    ap.add_argument("--cap-fraction", type=float, help="also run under a memory cgroup of this x the container")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--no-disk", action="store_true", help="skip the disk-rate measurement")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="moepack's device (cuda: resident weights and the cache's hits on the GPU; llama.cpp's "
                         "rows then want a CUDA build, which offloads every layer by default)")
    ap.add_argument("--batch", help="comma-separated batch sizes (e.g. 1,4,8): B sequences stepped together, after "
                                    "the other rows")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        sizes = [int(b) for b in args.batch.split(",")] if args.batch else []
    except ValueError:
        ap.error(f"--batch: comma-separated integers, got {args.batch!r}")
    if any(b < 1 for b in sizes):
        ap.error("--batch: sizes of at least 1")
    presets = FAMILY_PRESETS[args.family]
    args.preset = args.preset or ("medium" if "medium" in presets else presets[-1])
    if args.preset not in presets:
        ap.error(f"--preset: {args.family} has {', '.join(presets)}")
    if args.vs_llama and args.family != DEFAULT_FAMILY:
        ap.error(f"--vs-llama compares {DEFAULT_FAMILY} containers")
    os.makedirs(args.workdir, exist_ok=True)
    gguf = bench = None
    if args.vs_llama:
        from vs_llama_cpp import ensure_files

        container, gguf = ensure_files(args.workdir, args.vs_llama)
        candidate = os.path.join(args.llama_cpp or "", "bin", "llama-bench")
        bench = candidate if args.llama_cpp and os.path.exists(candidate) else None
    else:
        container = ensure_container(args.workdir, args.preset, args.family)
    facts = routed_facts(container)
    ids = torch.randint(0, facts["vocab"], (args.tokens,), generator=torch.Generator().manual_seed(0))
    # a GPU's cache keeps experts decoded to the compute dtype: its budgets are fractions of that size
    cached = (facts["routed_weights"] * getattr(torch, args.compute_dtype).itemsize if args.device == "cuda"
              else facts["routed_bytes"])
    budgets = ([None if b == "default" else float(b) for b in args.budget_gib.split(",")] if args.budget_gib else
               [round(f * cached / GIB, 4) for f in BUDGETS])
    out = {"model": f"vs-llama {args.vs_llama}" if args.vs_llama else f"{args.family} {args.preset}", "facts": facts,
           "threads": torch.get_num_threads(),
           "device": args.device,
           "moepack": [moepack_row(container, ids, args.new_tokens, b, args.compute_dtype, args.device)
                       for b in budgets]}
    if not args.no_disk:
        disk = disk_rate(container, facts)
        out["disk"] = {**disk, "tokens_per_s_limit": round(disk["gbps"] * 1e9 / facts["routed_bytes_per_token"], 2)}
    if not args.no_transformers:
        out["transformers"] = transformers_row(container, args.workdir, ids, args.new_tokens)
    if bench and not args.no_transformers:  # (children under the cap skip the resident comparisons)
        out["llama_cpp"] = llama_row(bench, gguf, args)
        out["paired"] = paired_rows(container, gguf, bench, ids, args, max(b or 0 for b in budgets))
    if args.cap_fraction:
        out["capped"] = capped_rows(args, container, facts, gguf, bench)
    if sizes:
        out["batch"] = batch_rows(container, facts, sizes, args.tokens, args.new_tokens, args.compute_dtype,
                                  args.device)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{out['model']}: {facts['size'] / 1e9:.2f} GB container, routed {facts['routed_bytes'] / 1e9:.2f} GB, "
          f"{facts['routed_bytes_per_token'] / 1e6:.1f} MB of routed experts per token (top-{facts['top_k']}), "
          f"{out['threads']} threads, prompt {args.tokens}, {args.new_tokens} new tokens, on {args.device}")
    print(f"{'cache GiB':>10} {'tokens/s':>9} {'hit rate':>9} {'MB read/token':>14} {'disk wait s':>12} "
          f"{'warm tokens/s':>14} {'warm hit rate':>14} {'first gen s':>12}")
    for r in out["moepack"]:
        hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.0%}"
        warm_hit = "-" if r["warm_hit_rate"] is None else f"{r['warm_hit_rate']:.0%}"
        print(f"{r['cache_budget_bytes'] / GIB:>10.3f} {r['tokens_per_s'] or 0:>9.2f} {hit:>9} "
              f"{(r['bytes_read_per_token'] or 0) / 1e6:>14.2f} {r['disk_wait_s']:>12.3f} "
              f"{r['warm_tokens_per_s'] or 0:>14.2f} {warm_hit:>14} {r['first_generation_s']:>12.2f}")
    if "disk" in out:
        print(f"disk limit (no cache): {out['disk']['tokens_per_s_limit']} tokens/s at {out['disk']['gbps']} GB/s "
              f"({out['disk']['source']})")
    if "transformers" in out:
        print(f"transformers resident generate (bf16): {out['transformers']['tokens_per_s']} tokens/s")
    if "llama_cpp" in out:
        print(f"llama.cpp resident decode (llama-bench, same weights): {json.dumps(out['llama_cpp'])}")
    if "paired" in out:
        print(f"resident, the two in alternation (tokens/s; moepack / llama.cpp): {json.dumps(out['paired'])}")
    if "capped" in out:
        print(f"under a memory cgroup of {args.cap_fraction} x the container: {json.dumps(out['capped'])}")
    if "batch" in out:
        print(f"batched decode, every expert cached ({args.new_tokens} steps):")
        print(f"{'B':>4} {'step ms':>9} {'tokens/s':>9} {'x B=1':>6} {'memory-bound x':>15} {'experts/step':>13} "
              f"{'dense MB':>9} {'expert MB':>10}")
        for r in out["batch"]:
            print(f"{r['batch']:>4} {r['step_ms']:>9.2f} {r['tokens_per_s']:>9.2f} {r['ratio'] or '-':>6} "
                  f"{r['memory_bound_ratio'] or '-':>15} {r['experts_per_step']:>13.1f} {r['dense_mb_per_step']:>9.1f} "
                  f"{r['expert_mb_per_step']:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
