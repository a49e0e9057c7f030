"""Multi-part read benchmark: the reads of an all-experts prefill from a container written as P = 1, 2, 4 part files.

Converts one synthetic DeepSeek-V4 checkpoint (default: the `medium` preset, release layout, `--keep`) with
`--parts P --stripe-experts S` for each P, then reads exactly what a prefill with `--experts all` reads (globals,
each layer's dense region, each layer's experts in bundles cut at stripe boundaries, in the engine's order, through
the runtime's RegionReader + ReadPipeline, O_DIRECT, cold cache) and prints GB/s side by side, with the bytes each
part file gave. With fio installed it also prints fio's figure for the same disk (the single file's expert range,
O_DIRECT, sequential, same request size and depth).

The parts only add up when they sit on different devices (`convert --part-dir K=DIR`, or symlinks). Here they all
live on one disk, so this measures what striping costs or gains on one device, not the sum of several.
Usage: python benchmarks/parts_read.py [--workdir DIR] [--preset medium] [--parts 1,2,4] [--json]
"""

from __future__ import annotations

import argparse
import json
import os

from moepack.format_spec.layout import DEFAULT_STRIPE_EXPERTS
from moepack.format_spec.reader import Container
from moepack.packer.convert import convert_checkpoint
from moepack.packer.synth import synth_checkpoint
from moepack.tools.bench import drop_page_cache, prefill_read_plan, run_fio, time_reads


def timed_read(path: str, bundle: int, depth: int) -> dict:
    with Container(path) as c:
        paths = list(c.part_paths)
        reads = prefill_read_plan(c, bundle)
    for p in paths:
        drop_page_cache(p)
    r = time_reads(paths, reads, depth, "direct")
    return {**r, "gbps": r["bytes"] / r["seconds"] / 1e9}


def _already_converted(path: str, parts: int, stripe: int) -> bool:
    try:
        with Container(path) as c:
            return c.part_count == parts and (parts == 1 or c.stripe_experts == stripe)
    except Exception:  # missing or stale: convert again
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/moepack-parts-bench")
    ap.add_argument("--preset", default="medium", choices=["tiny", "small", "medium"])
    ap.add_argument("--parts", default="1,2,4")
    ap.add_argument("--stripe-experts", type=int, default=DEFAULT_STRIPE_EXPERTS)
    ap.add_argument("--bundle-experts", type=int, default=None, help="default: the stripe")
    ap.add_argument("--queue-depth", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3, help="best of this many cold reads per P")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    bundle = args.bundle_experts or args.stripe_experts
    os.makedirs(args.workdir, exist_ok=True)
    src = os.path.join(args.workdir, f"{args.preset}-release")
    if not os.path.exists(os.path.join(src, "model.safetensors.index.json")):
        synth_checkpoint(src, preset=args.preset, layout="release", seed=0, progress=False)
    rows = []
    for parts in [int(p) for p in args.parts.split(",")]:
        out = os.path.join(args.workdir, f"{args.preset}-keep-p{parts}.moepack")
        if not _already_converted(out, parts, args.stripe_experts):
            convert_checkpoint(src, out, policy="keep", progress=False, parts=parts,
                               stripe_experts=args.stripe_experts)
        best = min((timed_read(out, bundle, args.queue_depth) for _ in range(args.repeat)),
                   key=lambda r: r["seconds"])
        rows.append({"parts": parts, "path": out, **best})
        if not args.json:
            print(f"P={parts}: {best['bytes'] / 1e9:.2f} GB in {best['seconds']:.3f} s = {best['gbps']:.3f} GB/s "
                  f"({best['requests']} reads, {best['io_mode']}); per part "
                  + " / ".join(f"{b / 1e9:.2f}" for b in best["bytes_per_part"]) + " GB", flush=True)
    single = os.path.join(args.workdir, f"{args.preset}-keep-p1.moepack")
    fio = None
    if os.path.exists(single):
        with Container(single) as c:
            first = c.layers[0].experts[0]
            last = c.layers[-1].experts[-1]
            request = max(r.length for r in c.layers[0].experts) * bundle
        drop_page_cache(single)
        fio = run_fio(single, first.offset, last.end - first.offset, request, args.queue_depth)
    result = {"preset": args.preset, "stripe_experts": args.stripe_experts, "bundle_experts": bundle,
              "queue_depth": args.queue_depth, "rows": rows, "fio": fio}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    base = rows[0]["gbps"] if rows else 0
    print(f"\n| parts | GB read | seconds | GB/s | vs P={rows[0]['parts']} | GB per part |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['parts']} | {r['bytes'] / 1e9:.2f} | {r['seconds']:.3f} | {r['gbps']:.3f} | "
              f"{r['gbps'] / base:.2f}x | " + " / ".join(f"{b / 1e9:.2f}" for b in r["bytes_per_part"]) + " |")
    if fio and "gbps" in fio:
        print(f"\nfio {fio['version']} ({fio['engine']}, O_DIRECT, sequential, bs {fio['block_bytes'] / 1e6:.2f} MB, "
              f"iodepth {fio['iodepth']}, the single file's expert range): {fio['gbps']:.3f} GB/s")
    elif fio:
        print(f"\nfio: {fio.get('skipped') or fio.get('failed')}")


if __name__ == "__main__":
    main()
