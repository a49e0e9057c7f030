"""`moepack bench io|memory|compute` and `moepack plan`: the measurements and the break-even calculator
(tools/bench.py, tools/plan.py, docs/plan.md). cli/main.py adds them to the
`moepack` group."""

from __future__ import annotations

import os

import click

from moepack.format_spec.errors import MoepackError
from moepack.runtime.limits import MAX_BENCH_REPEAT, MAX_BUNDLE_EXPERTS, MAX_QUEUE_DEPTH

from .common import Dtype, FiniteFloat, emit, force_option, json_option, refuse_existing, reports_errors


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).replace(" ", "").split(",") if v]
    except ValueError:
        raise MoepackError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise MoepackError(f"{what}: expected integers >= 1, got {text!r}")
    return values


def _busy(r: dict) -> None:
    if r.get("busy"):
        click.echo(f"  warning: the machine was busy (load {r['loadavg']} on {r['cpus']} CPUs): figures may be low",
                   err=True)


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"


# ---------------------------------------------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------------------------------------------


@click.group()
def bench():
    """Measure this machine: SSD reads with the runtime's reader (io), host memory and host->device copies
    (memory), the expert matmul path's FLOP/s (compute). Results go to a per-machine cache
    (bench.json in $MOEPACK_CACHE_DIR, else $XDG_CACHE_HOME/moepack or ~/.cache/moepack) that `prefill` and `plan`
    use as defaults."""


@bench.command("io")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--bundles", default="1,2,4,8,16", show_default=True, help="Experts per read to try.")
@click.option("--depths", default="1,2,4,8,16", show_default=True, help="Reads in flight to try.")
@click.option("--max-gib", type=FiniteFloat(min=0, min_open=True), default=1.0, show_default=True,
              help="Bytes each cell reads (the same leading expert sections for every cell).")
@click.option("--all", "read_all", is_flag=True, help="Read every expert section in every cell (no --max-gib cap).")
@click.option("--repeat", type=click.IntRange(1, MAX_BENCH_REPEAT), default=1, show_default=True,
              help="Best of this many runs.")
@click.option("--io", "io_mode", type=click.Choice(["direct", "buffered", "mmap"]), default="direct",
              show_default=True, help="direct: O_DIRECT, what prefill uses for a container larger than RAM.")
@click.option("--no-fio", is_flag=True, help="Skip the fio comparison even when fio is installed.")
@click.option("--no-save", is_flag=True, help="Do not record the result in the bench cache.")
@json_option
@reports_errors
def bench_io_cmd(file, bundles, depths, max_gib, read_all, repeat, io_mode, no_fio, no_save, as_json):
    """Read FILE's expert sections for a grid of bundle sizes x queue depths; print GB/s per cell and the best
    setting (which `prefill` then uses by default for FILE), and fio's rate for the same reads when installed."""
    from moepack.tools.bench import bench_io

    if not os.path.exists(file):
        raise MoepackError(f"{file}: no such file")
    result = bench_io(file, _int_list(bundles, "--bundles"), _int_list(depths, "--depths"),
                      None if read_all else int(max_gib * 2 ** 30), io_mode, repeat, fio=not no_fio,
                      save=not no_save)
    emit(as_json, result, _print_io)


def _print_io(r: dict) -> None:
    _busy(r)
    click.echo(f"{r['path']}: {_gb(r['bytes_per_cell'])} of expert sections per cell, io {r['io_mode']}, "
               f"expert region {_gb(r['expert_bytes'])}")
    if r.get("warning"):
        click.echo(f"  warning: {r['warning']}")
    cells = {(c["bundle_experts"], c["queue_depth"]): c for c in r["cells"]}
    click.echo("GB/s      " + "".join(f"{'depth ' + str(d):>10}" for d in r["depths"]))
    for b in r["bundles"]:
        click.echo(f"bundle {b:<3}" + "".join(f"{cells[(b, d)]['gbps']:>10.3f}" for d in r["depths"]))
    best = r["best"]
    click.echo(f"best: {best['bundle_experts']} experts per read ({_gb(best['read_bytes'])}), queue depth "
               f"{best['queue_depth']}: {best['gbps']:.3f} GB/s"
               + (f" (fastest cell {r['fastest']['gbps']:.3f} GB/s at {r['fastest']['bundle_experts']} x "
                  f"{r['fastest']['queue_depth']}; within 3%, the smaller buffers win)"
                  if r["fastest"] != {k: best[k] for k in r["fastest"]} else ""))
    f = r.get("fio")
    if f and f.get("gbps"):
        click.echo(f"fio ({f['engine']}, O_DIRECT, sequential, bs {_gb(f['block_bytes'])}, iodepth {f['iodepth']}): "
                   f"{f['gbps']:.3f} GB/s; ours / fio = {r['ours_over_fio']:.2f}")
    elif f:
        click.echo(f"fio: {f.get('skipped') or 'failed: ' + str(f.get('failed'))}")
    if r.get("cache"):
        click.echo(f"saved to {r['cache']}: `moepack prefill {os.path.basename(r['path'])}` now defaults to "
                   f"--bundle-experts {best['bundle_experts']} --queue-depth {best['queue_depth']}")


@bench.command("memory")
@click.option("--size-mib", type=click.IntRange(min=1), default=256, show_default=True, help="Bytes per copy.")
@click.option("--repeat", type=click.IntRange(1, MAX_BENCH_REPEAT), default=5, show_default=True,
              help="Best of this many copies.")
@click.option("--device", default=None, help="cuda or cuda:N to time host->device copies (default: cuda when "
                                             "torch sees one, else host only).")
@click.option("--no-save", is_flag=True, help="Do not record the result in the bench cache.")
@json_option
@reports_errors
def bench_memory_cmd(size_mib, repeat, device, no_save, as_json):
    """Host memory copy bandwidth and, on CUDA, pinned host->device bandwidth: the pipeline's other stages."""
    from moepack.tools.bench import bench_memory

    if device is not None and device != "cpu" and not device.startswith("cuda"):
        raise MoepackError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    result = bench_memory(size_mib, repeat, None if device == "cpu" else device, save=not no_save)
    emit(as_json, result, _print_memory)


def _print_memory(r: dict) -> None:
    _busy(r)
    click.echo(f"host memory copy: {r['host_copy_gbps']:.2f} GB/s ({r['host_traffic_gbps']:.2f} GB/s of DRAM "
               f"traffic, {r['threads']} threads, {r['bytes'] >> 20} MiB)")
    c = r.get("cuda")
    if c:
        click.echo(f"{c['device']}: host->device pinned {c['h2d_pinned_gbps']:.2f} GB/s, pageable "
                   f"{c['h2d_pageable_gbps']:.2f} GB/s; device->host pinned {c['d2h_pinned_gbps']:.2f} GB/s")
    else:
        click.echo("no CUDA device: host->device copies not measured")
    click.echo("a streamed prefill moves every byte through host RAM twice (SSD -> RAM, RAM -> consumer): at "
               f"{r['host_copy_gbps']:.1f} GB/s the host stage carries up to {r['host_copy_gbps']:.1f} GB/s of SSD "
               "reads")


@bench.command("compute")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--tokens", default="1,8,32,128,512,2048", show_default=True, help="Tokens per expert to time.")
@click.option("--file", "file", type=click.Path(dir_okay=False),
              help="Time this container's own experts (its storage type and shapes).")
@click.option("--storage", type=click.Choice(["FP4_E2M1", "MXFP4", "NVFP4", "Q8_0", "BF16"]), default="FP4_E2M1",
              show_default=True, help="Storage of the random experts (FP4_E2M1: the release / keep policy).")
@click.option("--hidden", type=click.IntRange(min=32), help="Hidden size of the random experts (default 4096).")
@click.option("--intermediate", type=click.IntRange(min=32), help="Expert intermediate size (default 2048).")
@click.option("--expert-dtype", type=Dtype(("float32", "bfloat16")), default="float32", show_default=True,
              help="Compute dtype, as prefill's --expert-dtype.")
@click.option("--experts", type=click.IntRange(1, MAX_BUNDLE_EXPERTS), default=None,
              help="Distinct experts per run (default 2; 16 for the grouped backend, decoded and run together).")
@click.option("--expert-backend", type=click.Choice(["auto", "grouped", "per-expert"]), default="auto",
              show_default=True, help="As prefill's: auto is grouped on a GPU, per-expert on a CPU.")
@click.option("--repeat", type=click.IntRange(1, MAX_BENCH_REPEAT), default=3, show_default=True,
              help="Best of this many runs.")
@click.option("--no-save", is_flag=True, help="Do not record the result in the bench cache.")
@json_option
@reports_errors
def bench_compute_cmd(device, tokens, file, storage, hidden, intermediate, expert_dtype, experts, expert_backend,
                      repeat, no_save, as_json):
    """Effective FLOP/s of the runtime's routed-expert path (decode of the stored bytes + clamped SwiGLU) at several
    tokens per expert: the F of `moepack plan`, measured. With --expert-dtype bfloat16 on a CPU with the fused FP4
    kernel, also up to how many tokens per expert that kernel beats decode + GEMM: `prefill` uses it."""
    from moepack.tools.bench import bench_compute

    if file is not None and not os.path.exists(file):
        raise MoepackError(f"{file}: no such file")
    if device != "cpu" and not device.startswith("cuda"):
        raise MoepackError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    if hidden is not None and hidden % 256 or intermediate is not None and intermediate % 256:
        raise MoepackError("--hidden and --intermediate must be multiples of 256 (the storage types' blocks)")
    result = bench_compute(device, _int_list(tokens, "--tokens"), file, storage, hidden, intermediate, expert_dtype,
                           experts, repeat, save=not no_save, expert_backend=expert_backend)
    emit(as_json, result, _print_compute)


def _print_compute(r: dict) -> None:
    _busy(r)
    click.echo(f"{r['device']} ({r['device_name']}, {r['threads']} threads, {r['expert_backend']} backend): "
               f"{r['storage']} experts "
               f"{r['hidden']}x{r['intermediate']} from {r['source']}, computed in {r['expert_dtype']}; decode "
               f"{r['decode_seconds_per_expert'] * 1e3:.2f} ms per expert")
    click.echo(f"{'tokens/expert':>14} {'GFLOP/s':>10} {'matmul only':>12} {'ms/expert':>10}")
    for p in r["points"]:
        click.echo(f"{p['tokens_per_expert']:>14} {p['gflops']:>10.1f} {p['matmul_gflops']:>12.1f} "
                   f"{p['seconds_per_expert'] * 1e3:>10.2f}")
    fused = r.get("fused")
    if fused:
        click.echo(f"fused FP4 kernel against decode + GEMM, {fused['threads']} thread (ms per expert):")
        click.echo(f"{'tokens/expert':>14} {'fused':>10} {'decoded':>10}")
        for p in fused["points"]:
            click.echo(f"{p['tokens_per_expert']:>14} {p['fused_seconds_per_expert'] * 1e3:>10.2f} "
                       f"{p['decoded_seconds_per_expert'] * 1e3:>10.2f}")
        click.echo(f"prefill runs the fused kernel for experts on up to {fused['max_tokens']} tokens on this CPU")


# ---------------------------------------------------------------------------------------------------------------
# plan
# ---------------------------------------------------------------------------------------------------------------


def _model_source(target: str, policy: str | None, expert_bpw: float | None):
    """(sizes, config, container path or None) for a container, a config.json / checkpoint directory (sized by its
    safetensors headers where it has weights), a hub repo id (owner/name: its config.json alone is fetched) or a
    synthetic preset name (tiny, small, medium)."""
    from moepack.tools.plan import load_config, sizes_from_config, sizes_from_container

    if os.path.isfile(target):
        with open(target, "rb") as f:
            magic = f.read(8)
        if magic == b"MOEPACK\x00":
            from moepack.format_spec.reader import Container

            if policy is not None:
                raise MoepackError("--policy is for a config: a container's policy is the one it was converted with")
            if expert_bpw is not None:
                raise MoepackError("--expert-bpw is for a config: a container's expert sizes are in its index")
            with Container(target) as c:
                return sizes_from_container(c), c.config, target
        if magic[:4] == b"GGUF":
            raise MoepackError(f"{target} is a GGUF file: plan a container, or its checkpoint's config.json; convert "
                               f"it first, e.g. `moepack convert {target} --fp4`")
    from moepack.packer.hub import fetch_config, looks_like_repo_id

    stored, notes = None, []
    if os.path.exists(target):
        config = load_config(target)
        if os.path.isdir(target):
            stored, notes = _checkpoint_tensors(target)
    elif looks_like_repo_id(target):  # a hub repo: its config.json alone (from the cache when offline)
        config = load_config(fetch_config(target))
    else:  # (the synthetic models' module loads torch: asked only for a name that is no path and no repo id)
        from moepack.packer.synth import PRESETS, RELEASE_QUANTIZATION_CONFIG, preset_config

        if target not in PRESETS:
            raise MoepackError(f"{target}: no such file (give a container, a config.json, a checkpoint directory, a "
                               f"Hugging Face repo id or a preset: {', '.join(PRESETS)})")
        config = {**preset_config(target), "quantization_config": dict(RELEASE_QUANTIZATION_CONFIG)}
    try:
        sizes = sizes_from_config(config, policy or "keep", expert_bpw, stored=stored)
    except MoepackError as e:
        if stored is None:
            raise
        sizes = sizes_from_config(config, policy or "keep", expert_bpw)
        notes = [f"sized from config.json alone: the weights do not match it ({e})"]
    sizes.notes[:0] = notes
    sizes.path = target  # (the plan's first line names what it sized: a file, a directory, a repo id, a preset)
    return sizes, config, None


def _checkpoint_tensors(path: str) -> tuple[dict | None, list[str]]:
    """A checkpoint directory's tensors as its safetensors headers give them ({name: (dtype, shape)}: what it
    stores, not what its config implies), and notes; (None, ...) for a directory of its config alone (or of weights
    that do not read: a partial download, say), which its config.json sizes."""
    from moepack.packer.source import INDEX_FILE, CheckpointDir

    if not any(n.endswith(".safetensors") or n == INDEX_FILE for n in os.listdir(path)):
        return None, []
    try:
        source = CheckpointDir(path)
    except MoepackError as e:
        return None, [f"sized from config.json alone: the weights do not read ({e})"]
    try:
        return {name: (t.dtype, t.shape) for name, t in source.tensors.items()}, []
    finally:
        source.close()


# A rate or size `plan` takes (GB/s, TFLOPS, GFLOP per token): beyond these the arithmetic under- or overflows to a
# zero, an infinity or a NaN, and no machine or model is anywhere near them.
PLAN_RATE = FiniteFloat(1e-3, 1e6)


@click.command()
@click.argument("target", metavar="FILE|CONFIG")
@click.option("--ssd-gbps", type=PLAN_RATE,
              help="Sequential read GB/s of one SSD (default: `bench io`'s measurement, else 14).")
@click.option("--tflops", type=PLAN_RATE,
              help="Effective TFLOPS of one GPU (default: `bench compute`'s measured curve, else 100).")
@click.option("--gpus", type=click.IntRange(min=1), default=1, show_default=True, help="GPUs (experts split).")
@click.option("--ssds", type=click.IntRange(min=1), default=1, show_default=True, help="SSDs (reads striped).")
@click.option("--context", "contexts", multiple=True, metavar="N",
              help="Prompt length(s) to plan for: 8192, 8K, 128K; repeat or comma-separate "
                   "(default 1K..128K in powers of two).")
@click.option("--vram-gib", type=FiniteFloat(0, PLAN_RATE.max, min_open=True), help="Device memory to judge the budget by.")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False), help="Write tokens/s versus N to this PNG.")
@click.option("--policy", type=click.Choice(["keep", "bf16", "fp4", "nvfp4", "q8", "q2"]),
              help="Precision policy a CONFIG is sized for (default keep).")
@click.option("--expert-bpw", type=FiniteFloat(0, 64, min_open=True),
              help="Size the routed experts at this many bits per weight (what-if).")
@click.option("--stream", type=click.Choice(["all", "experts"]), default="all", show_default=True,
              help="all: every region streams, as moepack prefill does; experts: non-routed weights resident "
                   "(the design note's tables).")
@click.option("--bundle-experts", type=click.IntRange(1, MAX_BUNDLE_EXPERTS),
              help="Experts per read for the buffer budget (default: bench io's best for FILE, else 4; 16 for a "
                   "CONFIG).")
@click.option("--queue-depth", type=click.IntRange(1, MAX_QUEUE_DEPTH),
              help="Reads in flight for the buffer budget (default: bench io's best for FILE, else 4; 2 for a "
                   "CONFIG).")
@click.option("--attention/--no-attention", "with_attention", default=False, show_default=True,
              help="Count the context-dependent attention FLOPs in T_compute (the note's tables do not).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), help="Whose measured compute curve to use "
                                                                   "(default: cuda's when measured, else cpu's).")
@click.option("--expert-dtype", type=Dtype(("float32", "bfloat16")), default="float32", show_default=True,
              help="Which measured compute curve: the one timed in prefill's --expert-dtype.")
@click.option("--mem-gbps", type=PLAN_RATE,
              help="Host memory copy GB/s (default: bench memory's measurement; the host RAM stage).")
@click.option("--pcie-gbps", type=PLAN_RATE,
              help="Host->device GB/s per GPU (default: bench memory's pinned measurement on CUDA).")
@click.option("--gflop-per-token", type=PLAN_RATE,
              help="Override the config's FLOPs per token (what-if; the note rounds to 26).")
@click.option("--routed-gflop-per-token", type=PLAN_RATE,
              help="Override the routed experts' FLOPs per token (the note rounds to 13).")
@click.option("--kv-dtype", type=Dtype(("float32", "bfloat16", "float8_e4m3"), give="storage"), default="float32",
              show_default=True,
              help="KV storage dtype for the one-layer KV row of the budget.")
@force_option
@json_option
@reports_errors
def plan(target, ssd_gbps, tflops, gpus, ssds, contexts, vram_gib, plot_out, policy, expert_bpw, stream,
         bundle_experts, queue_depth, with_attention, device, expert_dtype, mem_gbps, pcie_gbps, gflop_per_token,
         routed_gflop_per_token, kv_dtype, force, as_json):
    """Break-even calculator for a streamed layer-major prefill of FILE (a container) or CONFIG (a config.json, a
    checkpoint directory, a Hugging Face repo id such as deepseek-ai/DeepSeek-V4-Flash, whose config.json alone is
    fetched, or a preset name): T_SSD = W/BW, T_compute(N), the bottleneck, N* = F x W / (FLOP/token
    x BW), tokens/s per N and the VRAM budget. Measured `moepack bench` values are the defaults."""
    from moepack.tools import plan as P
    from moepack.runtime.tuning import tuned_defaults
    from moepack.tools.measured import measured_for_plan

    refuse_existing(force, plot_out, inputs=(target,))
    sizes, config, path = _model_source(target, policy, expert_bpw)
    ctx = [P.parse_tokens(v) for c in contexts for v in str(c).split(",") if v.strip()] or list(P.DEFAULT_CONTEXTS)
    storage = None
    if path is not None:
        from moepack.format_spec.reader import Container

        with Container(path) as c:
            w1 = next((t for b in c.layers for r in b.experts[:1] for t in r.tensors), None)
            storage = w1.dtype if w1 is not None else None
    expert_shape = (sizes.hidden_size, sizes.expert_intermediate)
    measured = measured_for_plan(path, device, storage, expert_shape, expert_dtype)

    if ssd_gbps is not None:
        ssd = P.Measured(ssd_gbps, "given")
    elif measured["ssd"]:
        ssd = P.Measured(*measured["ssd"])
    else:
        ssd = P.Measured(P.ASSUMED_SSD_GBPS, "assumed (the design note's PCIe 5.0 x4 NVMe)")
    curve, curve_source, flops_given, compute_device = None, "", None, "gpu"
    if tflops is not None:
        flops_given = P.Measured(tflops, "given")
    elif measured["compute"]:
        run, curve_source = measured["compute"]
        curve = P.ComputeCurve([(p["tokens_per_expert"], p["gflops"] * 1e9) for p in run["points"]])
        compute_device = run["device"].split(":")[0]
    else:
        flops_given = P.Measured(P.ASSUMED_TFLOPS, "assumed (the design note's middle F)")
    # This machine's memory and PCIe rates join only a plan for this machine: not when --ssd-gbps and --tflops
    # both describe another one; PCIe only when the compute is a GPU's.
    this_machine = ssd_gbps is None or tflops is None
    mem = P.Measured(mem_gbps, "given") if mem_gbps else (
        P.Measured(*measured["memory"]) if measured["memory"] and this_machine else None)
    pcie = P.Measured(pcie_gbps, "given") if pcie_gbps else (
        P.Measured(*measured["pcie"]) if measured["pcie"] and this_machine and compute_device != "cpu" else None)
    tuned = tuned_defaults(path) if path else None
    default_bundle, default_depth = tuned or ((4, 4) if path else (16, 2))
    flops = {}
    if gflop_per_token:
        flops["total"] = gflop_per_token * 1e9
    if routed_gflop_per_token:
        flops["routed"] = routed_gflop_per_token * 1e9
    result = P.make_plan(sizes, config, ssd_gbps=ssd, tflops=flops_given, compute_curve=curve,
                         compute_source=curve_source, gpus=gpus, ssds=ssds, contexts=ctx, stream=stream,
                         vram_gib=vram_gib, bundle_experts=bundle_experts or default_bundle,
                         queue_depth=queue_depth or default_depth, mem_gbps=mem, pcie_gbps=pcie, flops=flops or None,
                         with_attention=with_attention, kv_dtype=kv_dtype)
    if plot_out:
        result["plot"] = P.plot_plan(result, plot_out)
    emit(as_json, result, lambda r: click.echo(P.format_plan(r) + (f"\nplot: {r['plot']}" if r.get("plot") else "")))
