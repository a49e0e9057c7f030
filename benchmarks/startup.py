"""Start-up cost of `moepack prefill` on the tiny model: the process's wall time minus the prefill's own `seconds`,
for a first run (an empty kernel cache: every native library compiled) and the runs after it (cached), beside
the floor every run pays: a process that only imports torch (`python3 -c "import torch"`), timed in the same run.

    python3 benchmarks/startup.py [--runs 3] [--moepack PATH] [--json]

`--moepack` runs another installation's command (e.g. an older checkout's virtual environment) for a comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


def run_prefill(moepack: str, container: str, env: dict) -> tuple[float, float]:
    """(process wall seconds, the prefill's own seconds)."""
    start = time.perf_counter()
    done = subprocess.run([moepack, "prefill", container, "--prompt", PROMPT, "--json"], env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"moepack prefill failed: {done.stdout.strip() or done.stderr.strip()}")
    return wall, json.loads(done.stdout)["seconds"]


def torch_import_seconds(python: str, env: dict) -> float:
    start = time.perf_counter()
    subprocess.run([python, "-c", "import torch"], env=env, check=True)
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="cached runs after the first")
    ap.add_argument("--moepack", default=shutil.which("moepack") or "moepack")
    ap.add_argument("--python", default=sys.executable, help="the interpreter whose torch import is the floor")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="moepack-startup-") as work:
        # as on a user's machine: Python keeps the compiled bytecode of moepack's modules between runs
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["MOEPACK_CACHE_DIR"] = os.path.join(work, "cache")
        src, container = os.path.join(work, "src"), os.path.join(work, "tiny.moepack")
        for cmd in (["synth", src, "--preset", "tiny"], ["convert", src, "-o", container, "--keep"]):
            subprocess.run([args.moepack, *cmd, "--json"], env=env, check=True, capture_output=True)
        shutil.rmtree(env["MOEPACK_CACHE_DIR"], ignore_errors=True)  # the first prefill starts from nothing
        runs, floors = [], []
        for _ in range(1 + args.runs):  # interleaved, so both see the same machine
            runs.append(run_prefill(args.moepack, container, env))
            floors.append(torch_import_seconds(args.python, env))
    rows = [{"run": i + 1, "wall_s": round(w, 3), "prefill_s": round(p, 3), "startup_s": round(w - p, 3)}
            for i, (w, p) in enumerate(runs)]
    later = [r["startup_s"] for r in rows[1:]]
    floor = statistics.median(floors)
    result = {"moepack": args.moepack, "first_startup_s": rows[0]["startup_s"],
              "cached_startup_s_median": statistics.median(later) if later else None,
              "torch_import_process_s_median": round(floor, 3), "runs": rows}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{'run':>4} {'wall s':>8} {'prefill s':>10} {'start-up s':>11}")
        for r in rows:
            print(f"{r['run']:>4} {r['wall_s']:>8.3f} {r['prefill_s']:>10.3f} {r['startup_s']:>11.3f}")
        print(f"start-up: first run {result['first_startup_s']:.2f} s, later runs (median) "
              f"{result['cached_startup_s_median']:.2f} s; a process importing only torch: {floor:.2f} s (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
