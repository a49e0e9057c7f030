"""The sampler's cost per token (runtime/sampling.py Sampler.next_token) on a vocabulary of the release's size,
beside what one float64 sort of that vocabulary costs in the same run (what every sampled token paid before the
nucleus was looked for among the likeliest tokens). Distributions: Zipf-like (logits falling with the log of a
token's rank, ids shuffled: a language model's shape), Gaussian logits (flat: the nucleus is most of the
vocabulary, the whole is sorted) and a Gaussian three times as wide. Greedy: one row at a time, and the rows of a
batch of --batch found together (runtime/batching.py: greedy_choices of the step's plain greedy rows), beside what a
greedy token cost through the general path (the row copied in float64, isfinite over it, argmax: every greedy
token's cost before plain_greedy).

    python benchmarks/sampler.py [--vocab 129280] [--tokens 200] [--batch 8] [--json]"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from moepack.runtime.sampling import Sampler, greedy_choices

SETTINGS = {"greedy": dict(temperature=0.0), "T 0.8, top-p 0.95": dict(temperature=0.8, top_p=0.95),
            "T 1.0, top-p 1": dict(temperature=1.0),
            "T 0.7, top-p 0.9, min-p 0.05": dict(temperature=0.7, top_p=0.9, min_p=0.05),
            "T 0.8, top-k 40, top-p 0.95": dict(temperature=0.8, top_k=40, top_p=0.95)}


def distributions(vocab: int, count: int = 16) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    zipf = [(-3.0 * torch.log(ranks) + 0.5 * torch.randn(vocab, generator=g))[torch.randperm(vocab, generator=g)]
            for _ in range(count)]
    return {"Zipf-like": zipf, "Gaussian": [torch.randn(vocab, generator=g) for _ in range(count)],
            "Gaussian x 3": [3 * torch.randn(vocab, generator=g) for _ in range(count)]}


def per_token_ms(logits: list[torch.Tensor], options: dict, tokens: int) -> float:
    rounds = []
    for _ in range(3):
        sampler = Sampler(seed=1, **options)
        start = time.perf_counter()
        for i in range(tokens):
            sampler.next_token(logits[i % len(logits)])
        rounds.append((time.perf_counter() - start) / tokens * 1e3)
    return statistics.median(rounds)


def float64_greedy_ms(logits: list[torch.Tensor], tokens: int) -> float:
    """A greedy token through the general path's steps: the row in float64, its isfinite mask, argmax."""
    rounds = []
    for _ in range(3):
        start = time.perf_counter()
        for i in range(tokens):
            x = logits[i % len(logits)].to(dtype=torch.float64)
            if bool(torch.isfinite(x).all()):
                int(torch.argmax(x))
        rounds.append((time.perf_counter() - start) / tokens * 1e3)
    return statistics.median(rounds)


def batched_greedy_ms(logits: list[torch.Tensor], batch: int, tokens: int) -> float:
    """A token's share of a step whose `batch` plain greedy rows are chosen together (as BatchScheduler._step)."""
    rows = torch.stack([logits[i % len(logits)] for i in range(batch)])
    rounds = []
    for _ in range(3):
        samplers = [Sampler(seed=1) for _ in range(batch)]
        start = time.perf_counter()
        for _ in range(max(tokens // batch, 1)):
            for sampler, row, chosen in zip(samplers, rows, greedy_choices(rows)):
                sampler.next_token(row, chosen)
        rounds.append((time.perf_counter() - start) / (max(tokens // batch, 1) * batch) * 1e3)
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8, help="rows of a batched greedy step")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    x = torch.randn(args.vocab, dtype=torch.float64)
    start = time.perf_counter()
    for _ in range(20):
        torch.sort(x, descending=True, stable=True)
    sort_ms = (time.perf_counter() - start) / 20 * 1e3
    rows = [{"distribution": name, "setting": setting,
             "ms_per_token": round(per_token_ms(logits, options, args.tokens), 3)}
            for name, logits in distributions(args.vocab).items() for setting, options in SETTINGS.items()]
    zipf = distributions(args.vocab)["Zipf-like"]
    rows += [{"distribution": "Zipf-like", "setting": "greedy through the float64 path (before plain_greedy)",
              "ms_per_token": round(float64_greedy_ms(zipf, args.tokens), 3)},
             {"distribution": "Zipf-like", "setting": f"greedy, {args.batch} rows a step together",
              "ms_per_token": round(batched_greedy_ms(zipf, args.batch, args.tokens), 3)}]
    if args.json:
        print(json.dumps({"vocab": args.vocab, "whole_sort_ms": round(sort_ms, 3), "rows": rows}))
        return
    print(f"vocabulary {args.vocab}: one float64 stable sort of it {sort_ms:.2f} ms; {torch.get_num_threads()} threads")
    print("| distribution | setting | ms a token |\n|---|---|---|")
    for r in rows:
        print(f"| {r['distribution']} | {r['setting']} | {r['ms_per_token']} |")


if __name__ == "__main__":
    main()
