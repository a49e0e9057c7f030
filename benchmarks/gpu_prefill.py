"""GPU prefill at the release's own dimensions, against the chip's own ceilings measured in the same run.

The model: DeepSeek-V4-Flash's config (tests/data/deepseek-v4-flash.config.json) cut to --layers (default release
layers 1, 2, 3: sliding + hash, CSA + hash, HCA), with all of its 256 routed experts at full size (4096 x 2048):
the release layout (FP8 dense, FP4 experts), the experts' codes written straight as random bytes
(synth_checkpoint(random_expert_codes=True): drawing 10 GB of floats is too slow), converted with --keep.

For each N of --tokens, in each place the weights can be (--places):
  disk        streamed with O_DIRECT from a cold page cache: wall; io-alone (the runtime's reader alone, the same
              reads), compute-alone (the same prefill from a warm page cache), overlap = wall / max(both)
  page-cache  the container warm in the page cache, read through it (what a second run of a new user sees)
  host        the weights pinned in host RAM once per process (--io host): wall of a prefill after the one that
              loaded them; against it, bytes / the pinned H2D rate and the device-resident wall
  device      the weights on the device once per process (--device-resident): pure compute
each with tokens/s, effective TFLOPS (the design note's measure: tokens/s x 2 x active weights per token, the
dense matrices and top-k experts of every layer), the device's peak memory and the Lightning Indexer's share of the
wall (one CSA layer's indexer timed alone on random inputs of its dimensions, times the CSA layers), and per shape
class of the indexer's scores which scorer the selection kept (backends/fused_scores.py: the fused kernel or torch's,
with both timings). In the same run, the ceilings:
  dense bf16  torch's bf16 matmul of 8192^3 (CPU: 512^3; a CPU without bf16 units takes a minute a 2048^3)
  grouped     one layer's routed-expert GEMMs at N tokens as torch's grouped GEMM (bf16 weights on the device, the
              pairs spread evenly over the experts): gate+up, then down
  pinned h2d  a 1 GiB pinned host-to-device copy
Usage: python benchmarks/gpu_prefill.py [--device cuda] [--tokens 4096,16384,65536,131072] [--places disk,page-cache]
       [--layers 1,2,3] [--experts 256] [--dims release|tiny] [--workdir DIR] [--json]
On a CPU (a dry run of the script to its end, a minute): --device cpu --dims tiny --experts 8 --tokens 512,256.
There the host and device places both hold the bytes in host memory, unpinned (the same run twice), and the
pinned H2D rate, the host wall over its bound and the device's peak are left empty.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import moepack  # noqa: F401  (before torch: moepack sets OpenMP's spin limit)
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from prefill import io_alone, warm_cache  # noqa: E402
from release_dims import DIMS, release_cut  # noqa: E402

from moepack.backends import fused_scores  # noqa: E402
from moepack.backends.grouped_experts import grouped_matmul  # noqa: E402
from moepack.families.deepseek_v4 import model  # noqa: E402
from moepack.families.deepseek_v4.config import CSA  # noqa: E402
from moepack.format_spec.reader import Container  # noqa: E402
from moepack.packer.convert import convert_checkpoint  # noqa: E402
from moepack.packer.synth import synth_checkpoint  # noqa: E402
from moepack.runtime.engine import PrefillOptions, model_config, prefill  # noqa: E402
from moepack.runtime.expert_decode import expert_weight_count  # noqa: E402
from moepack.tools.bench import _best_seconds, drop_page_cache  # noqa: E402

PLACES = ("disk", "page-cache", "host", "device")


def figures(x: float) -> float:
    """x to three significant figures (a CPU's TFLOPS round to 0.0 at one decimal)."""
    return float(f"{x:.3g}")


def timed(fn, device: torch.device, repeat: int = 3) -> float:
    """The best of `repeat` timed calls, after one untimed."""
    fn()
    return _best_seconds(fn, repeat, device)


def dense_bf16_tflops(device: torch.device) -> float:
    n = 8192 if device.type == "cuda" else 512
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    return 2 * n ** 3 / timed(lambda: a @ b, device) / 1e12


def grouped_gemm_tflops(device: torch.device, tokens: int, top_k: int, experts: int, hidden: int, inter: int
                        ) -> float:
    """One layer's routed-expert GEMMs as grouped GEMMs: N x top_k pairs spread evenly over the experts."""
    pairs = tokens * top_k
    counts = [pairs // experts + (e < pairs % experts) for e in range(experts)]
    x = torch.randn(pairs, hidden, device=device, dtype=torch.bfloat16)
    gate_up = torch.randn(experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16) / hidden ** 0.5
    down = torch.randn(experts, hidden, inter, device=device, dtype=torch.bfloat16) / inter ** 0.5

    def layer():
        both = grouped_matmul(x, gate_up.transpose(1, 2), counts)
        grouped_matmul(F.silu(both[:, :inter]) * both[:, inter:], down.transpose(1, 2), counts)
    return 2 * pairs * 3 * hidden * inter / timed(layer, device) / 1e12


def pinned_h2d_gbps(device: torch.device) -> float | None:
    """GB/s of a 1 GiB copy from pinned host memory to the device; None on a CPU (no such copy)."""
    if device.type != "cuda":
        return None
    host = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device=device)
    return host.numel() / timed(lambda: dev.copy_(host, non_blocking=True), device) / 1e9


def indexer_seconds(cfg, n: int, device: torch.device) -> float | None:
    """One CSA layer's Lightning Indexer alone over n queries (random inputs at the model's dimensions, bf16 on a
    GPU, in the device's query chunks, each scoring the entries its last query sees as the attention does there);
    None where the model has no CSA layer."""
    if CSA not in cfg.layer_types:
        return None
    rate, chunk = cfg.compress_rates[cfg.layer_types.index(CSA)], model.preferred_query_chunk(cfg, device)
    heads, dim = cfg.index_n_heads, cfg.index_head_dim
    keys = torch.randn(n // rate, dim, device=device)
    projected = (torch.randn(chunk, heads * dim, device=device), torch.randn(chunk, heads, device=device))
    w = {"attn.indexer.wq_b.weight": torch.zeros(1, dtype=torch.bfloat16, device=device)}
    unused = torch.zeros(chunk, 1, device=device)  # x and q_lora: the projections are given
    device_path = model.bf16_device_path(device, torch.bfloat16)

    def run():
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            seen = end // rate if device_path else keys.shape[0]
            if keys.shape[0] > cfg.index_topk:  # (else the attention keeps every entry without the indexer)
                complete = (torch.arange(start, end, device=device) + 1) // rate
                model.indexer_topk(cfg, w, unused[:end - start], unused[:end - start],
                                   model.rope_rotation(cfg.compress_rope, start, end - start, 1, device),
                                   keys[:max(seen, cfg.index_topk)], complete,
                                   (projected[0][:end - start], projected[1][:end - start]))
    return timed(run, device, repeat=1)


def active_weights(path: str) -> tuple[int, dict]:
    """Matrix weights one token uses (every layer's dense matrices, top_k of its experts) and the model's shape."""
    with Container(path) as c:
        cfg = model_config(c)
        dense = sum(t.numel for b in c.layers for t in b.dense.tensors
                    if t.name.endswith(".weight") and len(t.shape) == 2)
        per_layer = cfg.num_experts_per_tok * expert_weight_count(c.layers[0].experts[0])
        shape = dict(layers=len(c.layers), csa_layers=cfg.layer_types.count(CSA), experts=cfg.n_routed_experts,
                     top_k=cfg.num_experts_per_tok,
                     hidden=cfg.hidden_size, inter=cfg.moe_intermediate_size, vocab=cfg.vocab_size,
                     container_bytes=c.file_size)
    return dense + len(c.layers) * per_layer, shape


def build(workdir: str, layers: list[int], experts: int, quiet: bool, dims: str = "release") -> str:
    """The release slice's container in `workdir` (built there once): `layers`, `experts`, widths DIMS[dims]."""
    widths = "" if dims == "release" else f"-{dims}"
    container = os.path.join(workdir, f"release-{'-'.join(map(str, layers))}-{experts}e{widths}.moepack")
    if os.path.exists(container):
        return container
    src = os.path.join(workdir, "src")
    config = release_cut(layers, experts, dims)
    config.pop("vocab_size", None)  # the synthetic tokenizer's, so that the model converts with it
    synth_checkpoint(src, preset="tiny", layout="release", seed=0, progress=not quiet, overwrite=True,
                     config_overrides={k: v for k, v in config.items() if k != "quantization_config"},
                     random_expert_codes=True)
    convert_checkpoint(src, container, progress=not quiet)
    return container


def parse_on_device(ap: argparse.ArgumentParser) -> tuple[argparse.Namespace, torch.device]:
    """The arguments (with --workdir, --dims and --json added) and the --device they name, which torch must see."""
    ap.add_argument("--workdir", default="/tmp/moepack-gpu-prefill")
    ap.add_argument("--dims", default="release", choices=sorted(DIMS),
                    help="the slice's widths: the release's, or tiny ones (a dry run on a CPU, the same code paths)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    return args, device


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def print_report(report: dict, as_json: bool, title: str, head: list[str], keys: tuple[str, ...]) -> None:
    """The report as JSON, or `title` then its rows as a table: `head` the columns' titles, `keys` the rows'
    fields under them ("" where missing)."""
    if as_json:
        print(json.dumps(report, indent=1))
        return
    print(title)
    print(" | ".join(head))
    for r in report["rows"]:
        print(" | ".join(str(r.get(k, "")) for k in keys))


def run_place(place: str, path: str, ids: torch.Tensor, base: dict, bundle: int, depth: int) -> dict:
    row = {"place": place}
    if place == "disk":
        # compute-alone first: a prompt the device has no room for is refused at once, before the reads
        warm_cache(path)
        row["compute_alone_s"] = prefill(path, ids, PrefillOptions(io_mode="buffered", **base)).stats["seconds"]
        row["io_alone_s"] = round(io_alone(path, bundle, depth)[0], 3)  # (from a cold page cache)
        drop_page_cache(path)
        stats = prefill(path, ids, PrefillOptions(io_mode="direct", **base)).stats
        row["overlap"] = round(stats["seconds"] / max(row["io_alone_s"], row["compute_alone_s"]), 3)
    elif place == "page-cache":
        warm_cache(path)
        stats = prefill(path, ids, PrefillOptions(io_mode="buffered", **base)).stats
    else:  # held once per process: the first prefill loads them, the second is timed
        held = dict(io_mode="host") if place == "host" else dict(device_resident=True)
        row["load_s"] = prefill(path, ids[:256], PrefillOptions(**held, **base)).stats["resident_load_s"]
        stats = prefill(path, ids, PrefillOptions(**held, **base)).stats
    # the device's peak beyond the weights held there (the device place keeps them for the process)
    held = stats["resident_bytes"] if stats["io_mode"] == "resident in device memory" else 0
    row.update(seconds=stats["seconds"], tokens_per_s=stats["tokens_per_s"],
               io_busy_s=stats["io_busy_s"], compute_busy_s=stats["compute_busy_s"],
               peak_device_gib=(round((stats["peak_device_bytes"] - held) / 2**30, 2)
                                if stats["peak_device_bytes"] else None),
               expert_backend=stats["expert_backend"], expert_gemm=stats["expert_gemm"])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    # the ends first: a run cut short by its time limit still has the shortest and the longest
    ap.add_argument("--tokens", default="4096,131072,65536,16384")
    ap.add_argument("--places", default=",".join(PLACES))
    ap.add_argument("--layers", default="1,2,3", help="release layer indexes (default 1,2,3)")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--bundle-experts", type=int, default=16)
    ap.add_argument("--queue-depth", type=int, default=8)
    ap.add_argument("--expert-backend", default="auto", choices=["auto", "grouped", "per-expert"])
    args, device = parse_on_device(ap)
    places = args.places.split(",")
    unknown = set(places) - set(PLACES)
    if unknown:
        raise SystemExit(f"unknown places {sorted(unknown)} (choose from {', '.join(PLACES)})")
    os.makedirs(args.workdir, exist_ok=True)
    started = time.perf_counter()
    path = build(args.workdir, [int(v) for v in args.layers.split(",")], args.experts, args.json, args.dims)
    build_s = time.perf_counter() - started
    active, shape = active_weights(path)
    h2d = pinned_h2d_gbps(device)
    ceilings = {"dense_bf16_tflops": figures(dense_bf16_tflops(device)),
                "pinned_h2d_gbps": round(h2d, 1) if h2d is not None else None}
    base = dict(device=str(device), compute_dtype="bfloat16", expert_selection="all", expert_backend=args.expert_backend,
                bundle_experts=args.bundle_experts, queue_depth=args.queue_depth)
    # a warm-up: the first prefill of a process pays one-time costs (kernels loaded, decode tables built) that
    # would otherwise land in the first cell's compute-alone
    prefill(path, torch.arange(3, min(259, shape["vocab"])), PrefillOptions(io_mode="buffered", **base))
    with Container(path) as c:
        cfg = model_config(c)
    rows = []
    for n in (int(t) for t in args.tokens.split(",")):
        ids = torch.randint(3, shape["vocab"], (n,), generator=torch.Generator().manual_seed(n))
        try:  # (its operands at 128K: about 40 GB of device memory; a device without them still runs the cells)
            ideal = figures(grouped_gemm_tflops(device, n, shape["top_k"], shape["experts"], shape["hidden"],
                                                shape["inter"]))
        except Exception as e:
            ideal = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        indexer_s = indexer_seconds(cfg, n, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for place in places:
            try:
                row = run_place(place, path, ids, base, args.bundle_experts, args.queue_depth)
            except Exception as e:  # one failed cell (out of memory at 128K, say) leaves the others
                row = {"place": place, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            if "tokens_per_s" in row:
                row["effective_tflops"] = figures(row["tokens_per_s"] * 2 * active / 1e12)
            if indexer_s is not None and row.get("seconds"):  # the indexer's part of the wall: every CSA layer's
                row["indexer_share"] = round(indexer_s * shape["csa_layers"] / row["seconds"], 3)
            rows.append({"tokens": n, "grouped_gemm_tflops": ideal, **row})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # each cell as it ends: a timeout keeps them
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(json.dumps({"tokens": n, "indexer_scores": fused_scores.DECISIONS}), file=sys.stderr, flush=True)
    for n in {r["tokens"] for r in rows}:  # the host goal: wall <= 1.15 x max(bytes / pinned H2D, device wall)
        by_place = {r["place"]: r for r in rows if r["tokens"] == n and "seconds" in r}
        if "host" in by_place and "device" in by_place and ceilings["pinned_h2d_gbps"]:
            bound = max(shape["container_bytes"] / (ceilings["pinned_h2d_gbps"] * 1e9), by_place["device"]["seconds"])
            by_place["host"]["host_wall_over_bound"] = round(by_place["host"]["seconds"] / bound, 3)
    report = {"device": device_name(device), "torch": torch.__version__, "model": shape,
              "active_weights_per_token": active, "build_s": round(build_s, 1), "ceilings": ceilings, "rows": rows,
              "indexer_scores": fused_scores.DECISIONS}
    print_report(report, args.json,
                 f"{report['device']}: {shape['layers']} release layers, {shape['experts']} experts of "
                 f"{shape['hidden']} x {shape['inter']}, container {shape['container_bytes'] / 1e9:.2f} GB, "
                 f"{active / 1e6:.0f}M active weights per token; dense bf16 {ceilings['dense_bf16_tflops']} TFLOPS, "
                 f"pinned H2D {ceilings['pinned_h2d_gbps']} GB/s",
                 ["N", "place", "tok/s", "eff TFLOPS", "grouped GEMM TFLOPS", "io-alone s", "compute-alone s",
                  "wall s", "overlap", "host wall / bound", "device peak GiB", "indexer share", "error"],
                 ("tokens", "place", "tokens_per_s", "effective_tflops", "grouped_gemm_tflops", "io_alone_s",
                  "compute_alone_s", "seconds", "overlap", "host_wall_over_bound", "peak_device_gib",
                  "indexer_share", "error"))
    if not args.json:  # which indexer scores each shape class took (fused kernel or torch's), with both timings
        for key, decision in fused_scores.DECISIONS.items():
            print(f"indexer scores {key}: {decision}")


if __name__ == "__main__":
    main()
