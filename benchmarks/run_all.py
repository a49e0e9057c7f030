"""Run every benchmark and write docs/benchmarks.md: one command, one markdown report with the machine it ran on.

    python benchmarks/run_all.py                          # medium preset, the full set (tens of minutes on 2 cores)
    python benchmarks/run_all.py --quick                  # tiny preset, reduced grids: a smoke run
    python benchmarks/run_all.py --workdir /data/bench --tokens 256,1024,2048 --out docs/benchmarks.md

Sections (each is skipped, with the reason in the report, when it cannot run):
  machine          CPU model, cores, RAM, the disk under --workdir, torch, GPU
  io               `moepack bench io` on the container: GB/s per bundle x queue depth, best cell, fio beside it
  memory/compute   `moepack bench memory` and `bench compute` (the container's experts, and V4-Flash-sized ones)
  prefill          benchmarks/prefill.py: io-alone, compute-alone, streamed, overlap ratio, transformers resident
  plan vs prefill  `moepack plan`'s prediction from the measurements above against the streamed prefill
  read order       bytes read by a layer-major prefill and by a chunk-major one (`prefill --order chunk`,
                   C = 1K, 2K) of the same prompt, against the note's 1x vs ceil(N/C)x
  quant, convert   benchmarks/quant_speed.py and benchmarks/convert_speed.py when present
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# `moepack ...` with the bench/plan commands registered whether or not this checkout's cli/main.py imports them
MOEPACK = [sys.executable, "-c", "import moepack.cli.plan_bench; from moepack.cli.main import main; main()"]


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_json(cmd: list[str], timeout: float) -> tuple[dict | None, str | None]:
    """Run a command that prints one JSON object on stdout; (object, None) or (None, why it failed)."""
    log("$ " + " ".join(cmd))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    if p.returncode:
        tail = (p.stderr.strip() or p.stdout.strip()).splitlines()[-1:] or [f"exit status {p.returncode}"]
        return None, tail[0][:300]
    try:
        return json.loads(p.stdout[p.stdout.index("{"):]), None
    except ValueError as e:
        return None, f"unreadable output ({e})"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def machine_description(workdir: str) -> dict:
    import torch

    cpu = ""
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = 0
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            mem = int(line.split()[1]) * 1024
    disk = "unknown"
    try:
        src = subprocess.run(["findmnt", "-no", "SOURCE,FSTYPE", "-T", workdir], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dev = src.split()[0] if src else ""
        name = os.path.basename(os.path.realpath(dev)) if dev.startswith("/dev/") else ""
        base = name.rstrip("0123456789") if name and not name.startswith("nvme") else name.split("p")[0]
        model = _read(f"/sys/block/{base}/device/model") if base else ""
        rot = _read(f"/sys/block/{base}/queue/rotational") if base else ""
        size = int(_read(f"/sys/block/{base}/size") or 0) * 512 if base else 0
        kind = f"queue/rotational={rot}" if rot else ""
        disk = ", ".join(x for x in (src, model, f"{size / 1e9:.0f} GB" if size else "", kind) if x)
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    gpu = None
    if torch.cuda.is_available():
        gpu = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    virt = _read("/sys/class/dmi/id/sys_vendor") or ""
    return {"cpu": cpu or platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "ram_gib": round(mem / 2 ** 30, 1), "disk": disk, "workdir": os.path.realpath(workdir),
            "os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "gpu": gpu,
            "vendor": virt, "hostname": platform.node()}


def table(head: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        out.append("| " + " | ".join("" if v is None else str(v) for v in r) + " |")
    return "\n".join(out)


def nbytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def f3(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, (int, float)) and not math.isfinite(x):
        return "-"
    return f"{x:.{digits}g}" if isinstance(x, float) else str(x)


# ---------------------------------------------------------------------------------------------------------------
# the benchmarks
# ---------------------------------------------------------------------------------------------------------------


def ensure_container(workdir: str, preset: str) -> str:
    """The container benchmarks/prefill.py uses (same paths, so it finds it built)."""
    from moepack.packer.convert import convert_checkpoint
    from moepack.packer.synth import synth_checkpoint

    src = os.path.join(workdir, f"{preset}-release")
    container = os.path.join(workdir, f"{preset}-keep.moepack")
    if not os.path.exists(os.path.join(src, "model.safetensors.index.json")):
        log(f"synthesizing the {preset} model in {src}")
        synth_checkpoint(src, preset=preset, layout="release", seed=0, progress=False)
    if not os.path.exists(container):
        log(f"converting to {container}")
        convert_checkpoint(src, container, progress=False)
    return container


def section_io(container: str, quick: bool) -> dict:
    from moepack.runtime.bench import bench_io

    grid = ((1, 4), (1, 4)) if quick else ((1, 2, 4, 8, 16), (1, 2, 4, 8, 16))
    return bench_io(container, grid[0], grid[1], max_bytes=None if quick else 1 << 30, mode="direct",
                    repeat=1 if quick else 2)


def section_compute(container: str, quick: bool) -> list[dict]:
    import torch

    from moepack.runtime.bench import bench_compute

    tokens = (1, 16, 64) if quick else (1, 8, 32, 128, 512, 2048)
    runs = [bench_compute("cpu", tokens, file=container, experts=2, repeat=2 if quick else 3)]
    if not quick:
        runs.append(bench_compute("cpu", tokens, file=container, expert_dtype="bfloat16", experts=2, repeat=3))
        runs.append(bench_compute("cpu", tokens, storage="FP4_E2M1", experts=2, repeat=2))  # V4-Flash sized
    if torch.cuda.is_available():
        for dtype in ("float32", "bfloat16"):
            runs.append(bench_compute("cuda", tokens, file=container, expert_dtype=dtype, experts=4, repeat=5))
        runs.append(bench_compute("cuda", tokens + (8192,), storage="FP4_E2M1", expert_dtype="bfloat16", experts=4,
                                  repeat=5))
    return runs


def plan_prediction(container: str, n: int, bundle: int, depth: int) -> dict:
    """What `moepack plan FILE --context n --attention` predicts from this machine's measurements."""
    r, err = run_json([*MOEPACK, "plan", container, "--context", str(n), "--attention",
                       "--bundle-experts", str(bundle), "--queue-depth", str(depth), "--json"], 300)
    return r["rows"][0] | {"W_bytes": r["W_bytes"]} if r else {"error": err}


def section_read_order(container: str, n: int, chunks: list[int], vocab: int, timeout: float) -> dict:
    """Bytes read by the same prompt layer-major and chunk-major (`prefill --order chunk --chunk-tokens C`)."""
    import random

    ids_path = os.path.join(tempfile.mkdtemp(prefix="moepack-order-"), "ids.json")
    rng = random.Random(n)
    with open(ids_path, "w") as f:
        json.dump([rng.randrange(3, vocab) for _ in range(n)], f)
    base = [*MOEPACK, "prefill", container, "--token-ids", ids_path, "--io", "direct",
            "--json"]
    out = {"tokens": n, "runs": []}
    layer, err = run_json(base + ["--order", "layer"], timeout)
    if layer is None:
        layer, err2 = run_json(base, timeout)  # a prefill without --order: layer-major is all it does
        if layer is None:
            return {"error": err2 or err}
    out["runs"].append({"order": "layer", "chunk": None, "bytes_read": layer["bytes_read"],
                        "seconds": layer["seconds"], "next_token": layer["next_token"]})
    for c in chunks:
        r, err = run_json(base + ["--order", "chunk", "--chunk-tokens", str(c)], timeout)
        if r is None:
            out["runs"].append({"order": "chunk", "chunk": c, "error": err})
            continue
        out["runs"].append({"order": "chunk", "chunk": c, "bytes_read": r["bytes_read"], "seconds": r["seconds"],
                            "next_token": r["next_token"], "passes": r.get("passes_over_model")})
    return out


# ---------------------------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------------------------


def render(res: dict) -> str:
    m = res["machine"]
    lines = [
        "# Benchmarks",
        "",
        f"Written by `python benchmarks/run_all.py {' '.join(res['argv'])}` on {res['date']} "
        f"({res['minutes']:.0f} minutes). Synthetic DeepSeek-V4 `{res['preset']}` model in the release layout "
        "(FP8 dense + FP4 experts), container converted with `--keep`.",
        "",
        "## Machine",
        "",
        table(["", ""], [["CPU", m["cpu"]], ["cores (torch threads)", f"{m['cores']} ({m['torch_threads']})"],
                         ["RAM", f"{m['ram_gib']} GiB"], ["disk", m["disk"]], ["GPU", m["gpu"] or "none"],
                         ["OS", m["os"]], ["python / torch", f"{m['python']} / {m['torch']}"],
                         ["system vendor", m["vendor"] or "-"]]),
        "",
        "Timings are wall-clock. The machine may be shared (other processes contend for the cores): repeated "
        "measurements keep the best run, but treat single figures as indicative.",
    ]
    io = res.get("io")
    lines += ["", "## Reader vs fio (`moepack bench io`)", ""]
    if isinstance(io, dict) and io.get("cells"):
        cells = {(c["bundle_experts"], c["queue_depth"]): c["gbps"] for c in io["cells"]}
        lines.append(f"`{os.path.basename(io['path'])}`, {nbytes(io['bytes_per_cell'])} of expert sections per "
                     f"cell, io {io['io_mode']} (O_DIRECT), best of {io['repeat']}, load average "
                     f"{io.get('loadavg', '-')} before; GB/s:")
        lines.append("")
        lines.append(table(["bundle \\ depth"] + [str(d) for d in io["depths"]],
                           [[f"{b} ({b * io['expert_bytes'] / 1e6:.1f} MB)"] + [f"{cells[(b, d)]:.3f}"
                                                                               for d in io["depths"]]
                            for b in io["bundles"]]))
        best, f = io["best"], io.get("fio") or {}
        lines += ["", f"Best: {best['bundle_experts']} experts per read x queue depth {best['queue_depth']}: "
                      f"**{best['gbps']:.3f} GB/s** (what `prefill` now uses by default on this file)."]
        if f.get("gbps"):
            lines.append(f"fio {f.get('version', '')} ({f['engine']}, O_DIRECT, sequential, bs "
                         f"{f['block_bytes'] / 1e6:.2f} MB, iodepth {f['iodepth']}, same byte range): "
                         f"**{f['gbps']:.3f} GB/s**; ours / fio = **{io['ours_over_fio']:.2f}**.")
        else:
            lines.append(f"fio: {f.get('skipped') or f.get('failed') or 'not run'}.")
    else:
        lines.append(f"not run: {io}")
    mem = res.get("memory")
    lines += ["", "## Memory (`moepack bench memory`)", ""]
    if isinstance(mem, dict) and mem.get("host_copy_gbps"):
        rows = [["host memory copy", f"{mem['host_copy_gbps']:.2f} GB/s ({mem['host_traffic_gbps']:.2f} GB/s of "
                                     f"DRAM traffic)"]]
        if mem.get("cuda"):
            c = mem["cuda"]
            rows += [["host->device, pinned", f"{c['h2d_pinned_gbps']:.2f} GB/s"],
                     ["host->device, pageable", f"{c['h2d_pageable_gbps']:.2f} GB/s"],
                     ["device->host, pinned", f"{c['d2h_pinned_gbps']:.2f} GB/s"]]
        else:
            rows.append(["host->device", "no CUDA device"])
        lines.append(table(["stage", "rate"], rows))
    else:
        lines.append(f"not run: {mem}")
    lines += ["", "## Expert compute (`moepack bench compute`)", "",
              "Effective GFLOP/s of the engine's per-expert work (decode of the stored bytes + clamped SwiGLU, "
              "6 x tokens x hidden x intermediate FLOPs); matmul-only in brackets.", ""]
    comp = res.get("compute")
    if isinstance(comp, list) and comp:
        tokens = sorted({p["tokens_per_expert"] for r in comp for p in r["points"]})
        rows = []
        for r in comp:
            pts = {p["tokens_per_expert"]: p for p in r["points"]}
            rows.append([f"{r['device']} {r['storage']} {r['hidden']}x{r['intermediate']} {r['expert_dtype']}"
                         f" (load {r.get('loadavg', '-')})"] +
                        [f"{pts[t]['gflops']:.1f} ({pts[t]['matmul_gflops']:.0f})" if t in pts else "-"
                         for t in tokens])
        lines.append(table(["experts \\ tokens per expert"] + [str(t) for t in tokens], rows))
    else:
        lines.append(f"not run: {comp}")
    pre = res.get("prefill")
    lines += ["", "## Prefill (benchmarks/prefill.py)", ""]
    if isinstance(pre, dict) and pre.get("rows"):
        lines.append(f"Container {pre['container_bytes'] / 1e9:.2f} GB, experts in {pre['expert_dtype']}, bundle "
                     f"{pre['bundle_experts']}, queue depth {pre['queue_depth']}, {pre['threads']} threads, every "
                     "expert read (`--experts all`). overlap = streamed / max(io-alone, compute-alone): 1.00 is "
                     "a perfect overlap of reads and compute.")
        lines.append("")
        lines.append(table(["N", "io-alone s", "compute-alone s", "streamed s", "overlap", "tokens/s",
                            "bytes read", "transformers (resident, bf16) s", "streamed vs transformers"],
                           [[r["tokens"], f3(r["io_alone_s"]), f3(r["compute_alone_s"]), f3(r["streamed_s"]),
                             f3(r["overlap"]), f3(r["tokens_per_s"]), nbytes(r["bytes_read"]),
                             f3(r.get("transformers_s")),
                             f"{r['speedup_vs_transformers']:.2f}x" if r.get("speedup_vs_transformers") else "-"]
                            for r in pre["rows"]]))
    else:
        lines.append(f"not run: {pre}")
    pv = res.get("plan_vs_prefill")
    lines += ["", "## `moepack plan` against the measured prefill", ""]
    if pv:
        lines.append("The plan from the measurements above (`moepack plan FILE --context N --attention`: BW from "
                     "bench io, F from the bench compute curve at N x top_k / E tokens per expert) against the "
                     "streamed prefill's wall time.")
        lines.append("")
        rows = []
        for r in pv:
            p = r["plan"]
            if "error" in p:
                rows.append([r["tokens"], "-", "-", "-", f3(r["measured_s"]), "-", p["error"]])
                continue
            rows.append([r["tokens"], f3(p["t_ssd_s"]), f3(p["t_compute_with_attention_s"]), p["bottleneck"],
                         f"{p['seconds']:.3g} / {r['measured_s']:.3g}", f"{r['measured_s'] / p['seconds']:.2f}",
                         f"io busy {r['io_busy_s']:.3g} s, compute busy {r['compute_busy_s']:.3g} s"])
        lines.append(table(["N", "plan T_SSD s", "plan T_compute s", "plan bound", "predicted / measured s",
                            "measured / predicted", "prefill's own split"], rows))
    else:
        lines.append("not run (needs the prefill section).")
    ro = res.get("read_order")
    lines += ["", "## Read order: layer-major vs chunk-major", ""]
    if isinstance(ro, dict) and ro.get("runs"):
        layer = ro["runs"][0]
        w = layer["bytes_read"]
        lines.append(f"The same {ro['tokens']}-token prompt, `prefill --io direct`; the note predicts 1x the model "
                     "for layer-major and ceil(N / C)x for chunk-major.")
        lines.append("")
        rows = []
        for r in ro["runs"]:
            if "error" in r:
                rows.append([r["order"], r["chunk"], "-", "-", f"ceil({ro['tokens']}/{r['chunk']}) = "
                             f"{math.ceil(ro['tokens'] / r['chunk'])}", "-", r["error"]])
                continue
            expect = 1 if r["order"] == "layer" else math.ceil(ro["tokens"] / r["chunk"])
            rows.append([r["order"], r["chunk"] or "-", nbytes(r["bytes_read"]),
                         f"{r['bytes_read'] / w:.2f}x", f"{expect}x", f3(r["seconds"]),
                         "same next token" if r["next_token"] == layer["next_token"] else "next token differs"])
        lines.append(table(["order", "C", "bytes read", "vs layer-major", "note", "seconds", ""], rows))
    else:
        lines.append(f"not run: {ro}")
    q = res.get("quant")
    lines += ["", "## Quantization codecs (benchmarks/quant_speed.py)", ""]
    if isinstance(q, dict) and q.get("types"):
        lines.append(f"{q['elements'] / 2 ** 20:g}M-element float32 tensor (Q2_K / IQ2_XXS: "
                     f"{q['search_elements'] / 2 ** 20:g}M), {q['torch_threads']} threads.")
        lines.append("")
        lines.append(table(["type", "quantize Mel/s", "gguf-py Mel/s", "dequantize Mel/s", "out GB/s", "rel RMSE"],
                           [[t, f"{r['quantize_elems_per_s'] / 1e6:.1f}",
                             f"{r['gguf_quantize_elems_per_s'] / 1e6:.1f}" if r.get("gguf_quantize_elems_per_s")
                             else "-", f"{r['dequantize_elems_per_s'] / 1e6:.1f}", f"{r['dequantize_out_GBps']:.2f}",
                             f"{r['rel_rmse']:.5f}"] for t, r in q["types"].items()]))
    else:
        lines.append(f"not run: {q}")
    cv = res.get("convert")
    lines += ["", "## Conversion (benchmarks/convert_speed.py)", ""]
    if isinstance(cv, dict) and cv.get("rows"):
        lines.append(f"Plain sequential write to the same filesystem: {cv.get('plain_write_gb_s')} GB/s.")
        lines.append("")
        lines.append(table(["source", "policy", "in", "out", "seconds", "source GB/s", "output GB/s",
                            "output / plain write", "peak RSS MiB"],
                           [[r.get("source"), r.get("policy"), nbytes(r.get("bytes_in", 0)),
                             nbytes(r.get("bytes_out", 0)), r.get("seconds"), r.get("source_gb_s"),
                             r.get("output_gb_s"), r.get("output_vs_plain_write"), r.get("peak_rss_mib")]
                            for r in cv["rows"]]))
    else:
        lines.append(f"not run: {cv}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "moepack-bench"),
                    help="models and containers (reused when present)")
    ap.add_argument("--preset", default="medium", choices=["tiny", "small", "medium"])
    ap.add_argument("--tokens", default="256,1024,2048", help="prompt lengths for the prefill benchmark")
    ap.add_argument("--order-tokens", type=int, default=4096, help="prompt length of the read-order comparison")
    ap.add_argument("--chunks", default="1024,2048", help="chunk lengths C of the chunk-major runs")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: io,memory,compute,prefill,"
                                               "transformers,order,quant,convert")
    ap.add_argument("--quick", action="store_true", help="tiny preset, short prompts, reduced grids (smoke run)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks.md"))
    ap.add_argument("--json-out", help="also write every raw result here")
    ap.add_argument("--render", metavar="JSON", help="only rewrite --out from a --json-out of an earlier run")
    args = ap.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            text = render(json.load(f))
        with open(args.out, "w") as f:
            f.write(text)
        log(f"wrote {args.out}")
        return 0
    if args.quick:
        args.preset = "tiny" if args.preset == "medium" else args.preset
        args.tokens = "64,256" if args.tokens == "256,1024,2048" else args.tokens
        args.order_tokens = min(args.order_tokens, 512)
        args.chunks = "128,256" if args.chunks == "1024,2048" else args.chunks
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    os.makedirs(args.workdir, exist_ok=True)
    start = time.time()
    res: dict = {"argv": argv if argv is not None else sys.argv[1:], "preset": args.preset,
                 "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "machine": machine_description(args.workdir)}
    container = ensure_container(args.workdir, args.preset)
    from moepack.format_spec.reader import Container

    with Container(container) as c:
        vocab = c.config["vocab_size"]
    bundle, depth = 4, 4
    if "io" not in skip:
        log("bench io")
        try:
            res["io"] = section_io(container, args.quick)
            bundle, depth = res["io"]["best"]["bundle_experts"], res["io"]["best"]["queue_depth"]
        except Exception as e:  # noqa: BLE001 - one failed section must not lose the others
            res["io"] = f"failed: {e}"
    if "memory" not in skip:
        log("bench memory")
        from moepack.runtime.bench import bench_memory

        try:
            res["memory"] = bench_memory(64 if args.quick else 256, 5)
        except Exception as e:  # noqa: BLE001
            res["memory"] = f"failed: {e}"
    if "compute" not in skip:
        log("bench compute")
        try:
            res["compute"] = section_compute(container, args.quick)
        except Exception as e:  # noqa: BLE001
            res["compute"] = f"failed: {e}"
    tokens = [int(t) for t in args.tokens.split(",") if t]
    if "prefill" not in skip:
        cmd = [sys.executable, os.path.join(HERE, "prefill.py"), "--workdir", args.workdir, "--preset", args.preset,
               "--tokens", ",".join(map(str, tokens)), "--bundle-experts", str(bundle), "--queue-depth", str(depth),
               "--json"]
        if "transformers" in skip:
            cmd.append("--no-transformers")
        pre, err = run_json(cmd, 6 * 3600)
        res["prefill"] = pre if pre else f"failed: {err}"
        if pre:
            res["plan_vs_prefill"] = [{"tokens": r["tokens"], "measured_s": r["streamed_s"],
                                       "io_busy_s": r["io_busy_s"], "compute_busy_s": r["compute_busy_s"],
                                       "plan": plan_prediction(container, r["tokens"], bundle, depth)}
                                      for r in pre["rows"]]
    if "order" not in skip:
        log("read order")
        res["read_order"] = section_read_order(container, args.order_tokens,
                                               [int(c) for c in args.chunks.split(",") if c], vocab, 6 * 3600)
    if "quant" not in skip:
        script = os.path.join(HERE, "quant_speed.py")
        if os.path.exists(script):
            q, err = run_json([sys.executable, script, "--json", "--elements", "4M" if args.quick else "16M",
                               "--search-elements", "1M" if args.quick else "4M"], 3600)
            res["quant"] = q if q else f"failed: {err}"
        else:
            res["quant"] = "benchmarks/quant_speed.py is not in this checkout"
    if "convert" not in skip:
        script = os.path.join(HERE, "convert_speed.py")
        if os.path.exists(script):
            cv, err = run_json([sys.executable, script, "--json", "--workdir", args.workdir, "--preset",
                                args.preset, "--bf16-preset", "tiny" if args.quick else "small"], 3 * 3600)
            res["convert"] = cv if cv else f"failed: {err}"
        else:
            res["convert"] = "benchmarks/convert_speed.py is not in this checkout"
    res["minutes"] = (time.time() - start) / 60
    text = render(res)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    log(f"wrote {args.out} in {res['minutes']:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
