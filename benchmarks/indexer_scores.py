"""The Lightning Indexer's scores of one query chunk at the release's dimensions: torch's blocks against the fused
Triton kernel (backends/fused_scores.py), and which one the selection keeps.

DeepSeek-V4-Flash's indexer (64 heads of 128, CSA rate 4) with the GPU's query chunk (model.GPU_QUERY_CHUNK =
1024 queries): for each N of --tokens, the chunk that ends the prompt (it sees T = N / rate entries) and the one at
its middle (T / 2), random bf16 operands at the model's scale. Per row:
  torch_s      torch's blocks (_bf16_index_scores with MOEPACK_FUSED_SCORES=0: bf16 products, ReLU, bmm)
  fused_s      the fused kernel, bf16 (q and keys as they are, float32 sums)
  counts_s     the same with each query's visible count (-inf past it, key tiles past the chunk skipped)
  fp8_s        the fused kernel on FP8 e4m3 operands quantised beforehand (a scale per row, as DeepSeek's
               fp8_index; keys would be stored so): the kernel alone
  *_tflops     2 x C x heads x D x T / seconds
  *_error      max |score - float32 reference| / max |reference| over the chunk's first --check-rows queries
  *_topk       the fraction of the reference's top --topk entries (of those queries) the scores pick too
  chosen       what the selection (weighted_relu_scores, on the chunk's first call) kept, with its own timings
Each measurement is on its own: one that fails prints its error and the others go on. The best of --repeat calls
(CUDA events), after one untimed (the kernel's compile and autotune).
Usage: python benchmarks/indexer_scores.py [--device cuda] [--tokens 65536,131072] [--heads 64] [--head-dim 128]
       [--rate 4] [--chunk 1024] [--json]
On a CPU (a dry run: torch's only, the kernel does not apply): --device cpu --tokens 4096 --heads 4 --chunk 64.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import moepack  # noqa: F401  (before torch: moepack sets OpenMP's spin limit)
import torch

from moepack.backends import fused_scores, kernel_choice
from moepack.families.deepseek_v4 import model


def failure(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"


def topk_overlap(scores: torch.Tensor, reference: torch.Tensor, k: int) -> float:
    """The fraction of the reference's top-k entries per query that the scores' top-k also picks (what the indexer
    hands the attention), over the queries that see more than k entries."""
    seen = torch.isfinite(reference).sum(-1) > k
    if not seen.any():
        return 1.0
    want, got = reference[seen].topk(k, dim=-1).indices, scores[seen].topk(k, dim=-1).indices
    hits = (got.sort(-1).values[:, :, None] == want[:, None, :]).any(-1)
    return float(hits.float().mean())


def measure(row: dict, name: str, fn, flops: float, reference: torch.Tensor, rows: int, repeat: int,
            topk: int) -> None:
    """row[name_s], row[name_tflops], row[name_error] and row[name_topk] (topk_overlap) of fn(), or
    row[name_error] = the failure."""
    try:
        scores = fn()  # untimed: a kernel's compile and autotune
        error = fused_scores.relative_error(scores[:rows].float(), reference)
        row[f"{name}_topk"] = round(topk_overlap(scores[:rows].float(), reference, topk), 4)
        del scores
        kernel_choice.TIMED_REPS = repeat
        seconds = kernel_choice.seconds(fn, reference.device)
        row.update({f"{name}_s": round(seconds, 5), f"{name}_tflops": float(f"{flops / seconds / 1e12:.3g}"),
                    f"{name}_error": float(f"{error:.3g}")})
    except Exception as e:  # one failed measurement (no FP8 tensor cores, out of memory) leaves the others
        row[f"{name}_error"] = failure(e)
    if reference.device.type == "cuda":
        torch.cuda.empty_cache()


def chunk_row(entries: int, args, device: torch.device) -> dict:
    heads, dim, chunk = args.heads, args.head_dim, args.chunk
    g = torch.Generator(device=device).manual_seed(entries)
    q = torch.randn(chunk, heads, dim, device=device, generator=g).bfloat16()
    keys = torch.randn(entries, dim, device=device, generator=g).bfloat16()
    weights = (torch.randn(chunk, heads, device=device, generator=g) * (heads * dim) ** -0.5).bfloat16()
    # the chunk's queries end at entry `entries` (the prompt's last chunk): query i sees (first + i + 1) // rate
    first = entries * args.rate - chunk
    counts = ((torch.arange(chunk, device=device) + first + 1) // args.rate).clamp(0, entries)
    rows = min(args.check_rows, chunk)
    products = torch.einsum("chd,td->cht", q[:rows].float(), keys.float()).relu_()
    reference = (weights[:rows].float()[:, :, None] * products).sum(1)
    del products
    flops = 2 * chunk * heads * dim * entries
    row = {"entries": entries, "queries": chunk, "heads": heads, "head_dim": dim}

    def torch_scores():
        os.environ[fused_scores.FORCE_ENV] = "0"
        try:
            return model._bf16_index_scores(q, keys, weights)
        finally:
            os.environ.pop(fused_scores.FORCE_ENV)
    measure(row, "torch", torch_scores, flops, reference, rows, args.repeat, args.topk)
    measure(row, "fused", lambda: fused_scores.weighted_relu_head_sum(q, keys, weights), flops, reference, rows,
            args.repeat, args.topk)
    hidden = torch.arange(entries, device=device)[None, :] >= counts[:rows, None]
    masked = reference.masked_fill(hidden, float("-inf"))
    measure(row, "counts", lambda: fused_scores.weighted_relu_head_sum(q, keys, weights, counts), flops, masked,
            rows, args.repeat, args.topk)
    try:
        if not fused_scores.fused_applies(q, keys, weights, fp8=True):
            raise ValueError("the fused kernel does not apply here (no CUDA device, or no Triton)")
        q8, k8, w8, k_scales = fused_scores.fp8_operands(q, keys, weights)  # (the quantising not timed)
        measure(row, "fp8", lambda: fused_scores._launch(q8, k8, w8, None, k_scales), flops, reference, rows,
                args.repeat, args.topk)
    except Exception as e:
        row["fp8_error"] = failure(e)
    try:  # the selection as the prefill meets it: the first call of this shape class decides
        before = dict(fused_scores.DECISIONS)
        model._bf16_index_scores(q, keys, weights)
        key = fused_scores.shape_class(q, keys)
        decision = fused_scores.DECISIONS.get(key)
        row["class"] = key
        row["chosen"] = decision["chosen"] if decision else \
            "torch (no trial: the kernel does not apply, or too little work)"
        if decision and key in before:
            row["chosen"] += " (decided before)"
        if decision:
            row["selection"] = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in decision.items()}
    except Exception as e:
        row["chosen"] = failure(e)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", default="131072,65536")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rate", type=int, default=4, help="the CSA layers' compression rate")
    ap.add_argument("--chunk", type=int, default=model.GPU_QUERY_CHUNK)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--check-rows", type=int, default=64, help="queries checked against the float32 reference")
    ap.add_argument("--topk", type=int, default=512, help="the indexer's top-k (index_topk), for *_topk")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    forced = os.environ.pop(fused_scores.FORCE_ENV, None)  # (the selection is measured as it runs by default)
    rows = []
    for n in (int(t) for t in args.tokens.split(",")):
        for entries in (n // args.rate, n // args.rate // 2):
            try:
                row = {"tokens": n, **chunk_row(entries, args, device)}
            except Exception as e:  # (out of memory, say): the other rows go on
                row = {"tokens": n, "entries": entries, "error": failure(e)}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)  # each row as it ends: a timeout keeps them
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {"device": name, "torch": torch.__version__, "forced_env_ignored": forced, "rows": rows,
              "decisions": fused_scores.DECISIONS}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{name}: the Lightning Indexer's scores of one {args.chunk}-query chunk, {args.heads} heads of "
          f"{args.head_dim} (torch {torch.__version__})")
    keys = ("tokens", "entries", "torch_s", "torch_tflops", "fused_s", "fused_tflops", "fused_error", "counts_s",
            "counts_error", "fp8_s", "fp8_tflops", "fp8_error", "torch_error", "torch_topk", "fused_topk",
            "counts_topk", "fp8_topk", "chosen", "error")
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, "")) for k in keys))
    for key, decision in fused_scores.DECISIONS.items():
        print(f"selection {key}: {decision}")


if __name__ == "__main__":
    main()
