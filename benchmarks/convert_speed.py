"""Conversion speed, side by side with the disk's plain sequential write rate, in one run.

  plain write   N bytes of sequential 64 MiB writes + fsync to the output's filesystem: the disk's ceiling
  --fp4         from a release-layout source (FP8 dense + FP4 experts; experts repack losslessly to MXFP4)
  --q8, --q2    from a bf16 source (every linear requantized)
Each conversion runs in its own process from a cold page cache (source files evicted) and reports source GB/s,
output GB/s, the ratio of output rate to the plain write rate, and peak RSS.
Usage: python benchmarks/convert_speed.py [--preset medium] [--bf16-preset small] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from moepack.packer.synth import synth_checkpoint

RUN = r"""
import json, resource, sys
from moepack.packer.convert import convert_checkpoint
r = convert_checkpoint(sys.argv[1], sys.argv[2], policy=sys.argv[3], progress=False)
r["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(r))
"""


def evict(directory: str) -> None:
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_write_rate(directory: str, nbytes: int) -> float:
    path = os.path.join(directory, "plain-write.tmp")
    block = os.urandom(64 << 20)
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        written = 0
        while written < nbytes:
            written += f.write(block)
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    os.remove(path)
    return written / seconds


def convert(src: str, out: str, policy: str) -> dict:
    evict(src)
    if os.path.exists(out):
        os.remove(out)
    p = subprocess.run([sys.executable, "-c", RUN, src, out, policy], capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(p.stderr)
    r = json.loads(p.stdout.strip().splitlines()[-1])
    os.remove(out)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="bench-work")
    ap.add_argument("--preset", default="medium", choices=["tiny", "small", "medium"])
    ap.add_argument("--bf16-preset", default="small", choices=["tiny", "small", "medium"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    release = os.path.join(args.workdir, f"{args.preset}-release")
    bf16 = os.path.join(args.workdir, f"{args.bf16_preset}-bf16")
    for d, preset, layout in ((release, args.preset, "release"), (bf16, args.bf16_preset, "bf16")):
        if not os.path.exists(os.path.join(d, "model.safetensors.index.json")):
            synth_checkpoint(d, preset=preset, layout=layout, seed=0, progress=False)
    source_bytes = sum(os.path.getsize(os.path.join(release, f)) for f in os.listdir(release))
    plain = plain_write_rate(args.workdir, min(source_bytes, 2 << 30))
    rows = []
    for src, policy in ((release, "fp4"), (bf16, "q8"), (bf16, "q2")):
        r = convert(src, os.path.join(args.workdir, f"bench-{policy}.moepack"), policy)
        rows.append({
            "source": os.path.basename(src), "policy": policy, "bytes_in": r["bytes_in"], "bytes_out": r["bytes_out"],
            "seconds": r["seconds"], "source_gb_s": round(r["bytes_in"] / r["seconds"] / 1e9, 3),
            "output_gb_s": round(r["bytes_out"] / r["seconds"] / 1e9, 3),
            "output_vs_plain_write": round(r["bytes_out"] / r["seconds"] / plain, 3),
            "peak_rss_mib": round(r["peak_rss"] / 2**20, 1),
        })
    result = {"plain_write_gb_s": round(plain / 1e9, 3), "rows": rows}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"plain sequential write: {plain / 1e9:.3f} GB/s")
    print("source | policy | in GB | out GB | s | source GB/s | output GB/s | out/plain | peak RSS MiB")
    for r in rows:
        print(f"{r['source']} | {r['policy']} | {r['bytes_in'] / 1e9:.3f} | {r['bytes_out'] / 1e9:.3f} | "
              f"{r['seconds']:.1f} | {r['source_gb_s']} | {r['output_gb_s']} | {r['output_vs_plain_write']} | "
              f"{r['peak_rss_mib']}")


if __name__ == "__main__":
    main()
