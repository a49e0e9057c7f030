"""Conversion speed, side by side with the disk's plain sequential write rate, in one run.

  plain write   N bytes of sequential 64 MiB writes + fsync to the output's filesystem: the disk's ceiling
  --fp4 ...     every policy (--policies) from a release-layout source (FP8 dense + FP4 experts), as a user
                converts DeepSeek-V4-Flash
  --q8, --q2    also from a bf16 source (every linear requantized)
Each conversion runs in its own process from a cold page cache (source files evicted) and reports source GB/s,
output GB/s, the ratio of output rate to the plain write rate, and peak RSS; for the release-layout rows, the hours
the real DeepSeek-V4-Flash would take at that source rate (its release size from tests/data's config.json; an
extrapolation: a larger model's conversion runs at about the rate of a smaller one's, on the same cores and disk).
Usage: python benchmarks/convert_speed.py [--preset medium] [--bf16-preset small] [--policies fp4,q8] [--json]
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
    ap.add_argument("--policies", default="keep,bf16,fp4,nvfp4,q8,q2",
                    help="policies to run from the release-layout source (comma-separated)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    release_gb = _v4_flash_source_gb()
    os.makedirs(args.workdir, exist_ok=True)
    release = os.path.join(args.workdir, f"{args.preset}-release")
    bf16 = os.path.join(args.workdir, f"{args.bf16_preset}-bf16")
    for d, preset, layout in ((release, args.preset, "release"), (bf16, args.bf16_preset, "bf16")):
        if not os.path.exists(os.path.join(d, "model.safetensors.index.json")):
            synth_checkpoint(d, preset=preset, layout=layout, seed=0, progress=False, overwrite=True)
    source_bytes = sum(os.path.getsize(os.path.join(release, f)) for f in os.listdir(release))
    plain = plain_write_rate(args.workdir, min(source_bytes, 2 << 30))
    rows = []
    runs = [(release, p) for p in args.policies.split(",") if p] + [(bf16, "q8"), (bf16, "q2")]
    for src, policy in runs:
        r = convert(src, os.path.join(args.workdir, f"bench-{policy}.moepack"), policy)
        hours = release_gb / (r["bytes_in"] / r["seconds"] / 1e9) / 3600 if src == release else None
        rows.append({
            "source": os.path.basename(src), "policy": policy, "bytes_in": r["bytes_in"], "bytes_out": r["bytes_out"],
            "seconds": r["seconds"], "source_gb_s": round(r["bytes_in"] / r["seconds"] / 1e9, 3),
            "output_gb_s": round(r["bytes_out"] / r["seconds"] / 1e9, 3),
            "output_vs_plain_write": round(r["bytes_out"] / r["seconds"] / plain, 3),
            "peak_rss_mib": round(r["peak_rss"] / 2**20, 1),
            "v4_flash_hours": None if hours is None else round(hours, 2),
        })
    result = {"plain_write_gb_s": round(plain / 1e9, 3), "v4_flash_source_gb": round(release_gb, 1), "rows": rows}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"plain sequential write: {plain / 1e9:.3f} GB/s")
    print(f"DeepSeek-V4-Flash as released: {release_gb:.1f} GB")
    print("source | policy | in GB | out GB | s | source GB/s | output GB/s | out/plain | peak RSS MiB | "
          "V4-Flash h (extrapolated)")
    for r in rows:
        hours = "-" if r["v4_flash_hours"] is None else r["v4_flash_hours"]
        print(f"{r['source']} | {r['policy']} | {r['bytes_in'] / 1e9:.3f} | {r['bytes_out'] / 1e9:.3f} | "
              f"{r['seconds']:.1f} | {r['source_gb_s']} | {r['output_gb_s']} | {r['output_vs_plain_write']} | "
              f"{r['peak_rss_mib']} | {hours}")


def _v4_flash_source_gb() -> float:
    """The release's size (its container with --keep holds every tensor as the release stores it)."""
    from moepack.tools.plan import load_config, sizes_from_config

    config = load_config(os.path.join(os.path.dirname(__file__), "..", "tests", "data",
                                      "deepseek-v4-flash.config.json"))
    return sizes_from_config(config, "keep").file_bytes / 1e9


if __name__ == "__main__":
    main()
