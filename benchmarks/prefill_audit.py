"""What a GPU's bf16 prefill computes, audited on a CPU: the tiny synthetic DeepSeek-V4 (sliding, CSA, HCA and hash
layers) prefilled along the CUDA branches (tests/gpu_branches.py: no compiled kernels, DeepSeek-V4's device path,
the grouped expert backend, bf16), per layer and part: the matmuls by dtype (count, FLOPs), the largest tensor an
op allocated, the largest float32 one, and the ops that would make the host wait for the device.

    python3 benchmarks/prefill_audit.py [--tokens 256 512] [--query-chunk Q]

Then the indexer's float32 and bf16 pieces at the release's dimensions (64 heads of 128, CSA rate 4, query chunk
1024, N = 128K) by the formulas the audit's shapes follow."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from gpu_branches import audited_prefill  # noqa: E402

from moepack.families.deepseek_v4 import model  # noqa: E402
from moepack.packer.convert import convert_checkpoint  # noqa: E402
from moepack.packer.synth import synth_checkpoint  # noqa: E402


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def report(audit, n_tokens: int) -> None:
    print(f"N = {n_tokens}")
    print(f"  {'layer':>5} {'part':<10} {'matmuls':>7} {'f32 GFLOP':>10} {'bf16 GFLOP':>10} "
          f"{'largest':>12} {'largest f32 (shape, op)':<44} syncs")
    for (layer, part), p in sorted(audit.parts.items(), key=lambda kv: (kv[0][0] is None, kv[0][0] or 0, kv[0][1])):
        size, _, shape, op = p.largest_float32
        print(f"  {'-' if layer is None else layer:>5} {part:<10} {len(p.matmuls):>7} "
              f"{p.flops(torch.float32) / 1e9:>10.4f} {p.flops(torch.bfloat16) / 1e9:>10.4f} "
              f"{mib(p.largest[0]):>12} {mib(size) + f' {list(shape)} {op}':<44} {','.join(sorted(set(p.syncs)))}")
    for dtype in (torch.float32, torch.bfloat16):
        ops = sorted({(name, shape) for p in audit.parts.values() for name, d, _, shape in p.matmuls if d == dtype})
        print(f"  {dtype} matmuls (op, output shape): {ops[:12]}{' ...' if len(ops) > 12 else ''}")


def release_indexer(n_tokens: int = 131072, chunk: int = 1024, heads: int = 64, head_dim: int = 128,
                    rate: int = 4) -> None:
    """The indexer's pieces per query chunk at the release's dimensions: before (one [C, heads, T] product, its
    float32 copy and a float32 head sum over it) and on the device path now (key blocks of INDEXER_BLOCK_BYTES,
    query rows of INDEXER_SCORE_BYTES, the entries past the chunk left out)."""
    entries = n_tokens // rate
    print(f"release indexer, N = {n_tokens}, T = {entries}, C = {chunk}, {heads} x {head_dim}:")
    print(f"  per chunk before: bf16 products {mib(chunk * heads * entries * 2)}, their float32 copy "
          f"{mib(chunk * heads * entries * 4)}, float32 head-sum bmm {2 * chunk * heads * entries / 1e9:.1f} GFLOP "
          f"reading it; per layer {2 * n_tokens * heads * entries / 1e12:.2f} TFLOP float32, "
          f"{n_tokens * heads * entries * 20 / 1e12:.1f} TB moved (2 + 6 + 8 + 4 bytes an element)")
    rows = min(chunk, max(1, model.INDEXER_SCORE_BYTES // (4 * entries)))
    block = max(1, model.INDEXER_BLOCK_BYTES // (2 * rows * heads))
    chunks = range(0, n_tokens, chunk)
    seen = sum(min(entries, (start + chunk) // rate) for start in chunks) / len(chunks)  # entries a chunk scores
    print(f"  now: query rows {rows} at a time ([C', T] float32 scores {mib(rows * entries * 4)}), key blocks of "
          f"{block} (bf16 products {mib(rows * heads * block * 2)}), {seen / entries:.2f} of the entries scored on "
          f"average; no float32 matmul over heads x entries; per layer {n_tokens * heads * seen * 8 / 1e12:.1f} TB "
          f"moved (bf16 products written, ReLU read and written, read by the head sum)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--query-chunk", type=int, default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(prefix="moepack-audit-") as work:
        synth_checkpoint(os.path.join(work, "src"), preset="tiny", layout="release", progress=False)
        container = os.path.join(work, "tiny.moepack")
        convert_checkpoint(os.path.join(work, "src"), container, policy="keep", progress=False)
        for n in args.tokens:
            ids = [3 + (7 * i) % 500 for i in range(n)]
            _, audit = audited_prefill(container, ids, query_chunk=args.query_chunk)
            report(audit, n)
    release_indexer()
    return 0


if __name__ == "__main__":
    sys.exit(main())
