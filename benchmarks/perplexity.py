"""`moepack perplexity` benchmark: the same windows scored with several --tokens-per-pass in one run, to show what
reading each weight once per pass (not once per window) buys, and that the figure does not depend on it.

On a synthetic model (--preset, default small, release layout, converted --keep), a random text of --windows windows
of --ctx tokens; per --tokens-per-pass value: the passes over the model, seconds, tokens/s, bytes read, and the
perplexity (equal in every row to float32 rounding; a random model's is about its vocabulary's size). Each row
starts from a cold page cache (the container evicted), read as `--io auto` reads it.

Usage: python benchmarks/perplexity.py [--preset small] [--ctx 512] [--windows 16]
                                       [--tokens-per-pass 512,2048,8192] [--compute-dtype float32] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from decode import ensure_container  # noqa: E402

from moepack.runtime.engine import PrefillOptions  # noqa: E402
from moepack.runtime.perplexity import perplexity  # noqa: E402
from moepack.tools.bench import drop_page_cache  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--tokens-per-pass", default="512,2048,8192")
    ap.add_argument("--compute-dtype", default="float32")
    ap.add_argument("--workdir", default="/tmp/moepack-bench")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    path = ensure_container(args.workdir, args.preset)
    from moepack.format_spec.reader import Container

    with Container(path) as c:
        vocab = int(c.config["vocab_size"])
    ids = torch.randint(3, vocab, (args.windows * args.ctx,), generator=torch.Generator().manual_seed(0))
    # a warm-up: a process's first prefill pays one-time costs (kernels loaded, tables built) no row should carry
    perplexity(path, ids, args.ctx, PrefillOptions(compute_dtype=args.compute_dtype), max_windows=1)
    rows = []
    for per_pass in (int(v) for v in args.tokens_per_pass.split(",")):
        drop_page_cache(path)  # each row from the disk
        options = PrefillOptions(compute_dtype=args.compute_dtype)
        start = time.perf_counter()
        result = perplexity(path, ids, args.ctx, options, tokens_per_pass=per_pass)
        rows.append({"tokens_per_pass": per_pass, "passes": result["passes"],
                     "seconds": round(time.perf_counter() - start, 2), "tokens_per_s": result["tokens_per_s"],
                     "gib_read": round(result["bytes_read"] / 2**30, 3), "perplexity": round(result["perplexity"], 4)})
    out = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
           "date": time.strftime("%Y-%m-%d"), "preset": args.preset, "ctx": args.ctx, "windows": args.windows,
           "container_gib": round(os.path.getsize(path) / 2**30, 3), "rows": rows}
    if args.json:
        print(json.dumps(out))
        return
    print(f"perplexity of {args.windows} windows of {args.ctx} tokens, {args.preset} preset "
          f"({out['container_gib']} GiB), {out['machine']}, {out['date']}")
    print("| tokens per pass | passes | seconds | tokens/s | GiB read | perplexity |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens_per_pass']} | {r['passes']} | {r['seconds']} | {r['tokens_per_s']} | {r['gib_read']} | "
              f"{r['perplexity']} |")


if __name__ == "__main__":
    main()
