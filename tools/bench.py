"""Measurements the break-even plan stands on (docs/plan.md): SSD read rate with the runtime's own reader, host
memory and host->device copy rates, and the effective FLOP/s of the runtime's expert path.

* `bench_io(path)` reads a container's expert sections with `RegionReader` + `ReadPipeline` (what `prefill` uses),
  O_DIRECT, for a grid of bundle sizes (experts per read) x queue depths (reads in flight), and picks the best
  setting; with `fio` installed it also reads the same file with fio (io_uring, O_DIRECT, sequential, the best
  cell's block size and depth) so the reader can be compared with the tool everyone trusts.
* `bench_memory()` times host memory copies (the pipeline's host RAM stage) and, on CUDA, pinned and pageable
  host->device copies (the PCIe stage).
* `bench_compute()` times decode + FFN of routed experts exactly as the engine runs them (format_spec.decode's
  `decode_float` or the compiled decoders, then the family's expert arithmetic: its LayerPrefill's expert_ffn, or
  expert_forward / expert_limit), for several tokens per expert: F measured, not assumed. For bf16 FP4 experts
  on a CPU with the fused kernel it also finds the tokens per expert up to which that kernel beats decode + GEMM;
  `tuning.tuned_fused_max_tokens()` gives `prefill` that crossover. On a CPU it also times a
  GEMM in float32 and bfloat16: `tuning.default_compute_dtype()` gives `--compute-dtype auto` that choice (before any
  measurement: bfloat16 where the CPU has native bf16 dot products).

Results are kept in a small per-machine cache (runtime/tuning.py, which the runtime reads:
`$MOEPACK_CACHE_DIR/bench.json`), keyed by the host name and, for io, by the container's real path, size and mtime
(a rewritten container is measured again). `tuning.tuned_defaults(path)` gives `prefill` the best (bundle_experts,
queue_depth) measured for that file on this machine; `moepack plan` takes its bandwidth and FLOP/s defaults from
the same file (tools/measured.py `measured_for_plan`, apart from this module so that `plan` does not load torch).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import torch

from moepack.backends.expert_naming import ExpertNaming
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.reader import ReadSpan
from moepack.runtime.io import available_memory_bytes
from moepack.runtime.limits import MAX_BENCH_REPEAT, MAX_BUNDLE_EXPERTS
from moepack.runtime.read_scheduler import expert_reads
from moepack.runtime.tuning import check_cache_writable, cpu_model, file_key, machine_id, store

BUNDLES = (1, 2, 4, 8, 16)
DEPTHS = (1, 2, 4, 8, 16)
NEAR_TIE = 0.03  # cells within 3% of the fastest count as equally fast: the one with the least buffer memory wins
COMPUTE_TOKENS = (1, 8, 32, 128, 512, 2048)
FUSED_TOKENS = (16, 32, 64, 96, 128, 192, 256, 320, 384, 512)  # where the fused kernel's crossover is looked for
COMPUTE_STORAGES = ("FP4_E2M1", "MXFP4", "NVFP4", "Q8_0", "BF16")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _load() -> dict:
    """The 1-minute load average before a measurement, and whether other work was likely running: timings on a
    busy machine come out low (threads of two processes fighting for the same cores)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return {"loadavg": None, "cpus": os.cpu_count(), "busy": False}
    cpus = os.cpu_count() or 1
    return {"loadavg": round(load, 2), "cpus": cpus, "busy": load >= 0.75 * cpus}


# ---------------------------------------------------------------------------------------------------------------
# io
# ---------------------------------------------------------------------------------------------------------------


def _expert_reads(container, bundle: int, max_bytes: int | None) -> list[ReadSpan]:
    """The reads an all-experts prefill makes of the expert sections, layer by layer, `bundle` experts per read
    (cut at stripe boundaries in a multi-part container, as the engine does), stopping once `max_bytes` are
    covered (every cell reads the same prefix of the container)."""
    reads, total = [], 0
    for block in container.layers:
        for span in _all_expert_reads(block, bundle):
            reads.append(span)
            total += span.length
            if max_bytes is not None and total >= max_bytes:
                return reads
    return reads


def _all_expert_reads(block, bundle: int) -> list[ReadSpan]:
    """The reads of every expert of `block`, as the engine makes them."""
    return [span for _, _, span in expert_reads(block, list(range(len(block.experts))), bundle)]


def prefill_read_plan(container, bundle: int) -> list[ReadSpan]:
    """Every read an all-experts prefill makes, in its order: globals, then per layer the dense region and the
    experts in bundles (cut at stripe boundaries)."""
    reads = [ReadSpan(r.part, r.offset, r.length) for r in container.global_regions]
    for block in container.layers:
        reads.append(ReadSpan(block.dense.part, block.dense.offset, block.dense.length))
        reads += _all_expert_reads(block, bundle)
    return reads


def drop_page_cache(path: str) -> None:
    """Evict a file from the page cache, so the next read comes from the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def time_reads(paths: list[str], reads: list[ReadSpan], depth: int, mode: str) -> dict:
    """Read `reads` (of the part files `paths`) in order with `depth` in flight, through the runtime's reader."""
    from moepack.runtime.io import ReadPipeline, RegionReader

    reader = RegionReader(paths, mode)
    try:
        pipe = ReadPipeline(reader, max(r.length for r in reads), depth)
        try:
            start = time.perf_counter()
            window = []
            for r in reads:
                window.append(pipe.submit(r.offset, r.length, part=r.part))
                if len(window) >= depth:
                    pipe.release(window.pop(0).result()[0])
            for future in window:
                pipe.release(future.result()[0])
            seconds = time.perf_counter() - start
        finally:
            pipe.close()
        return {"seconds": seconds, "bytes": reader.stats.bytes_read, "requests": reader.stats.requests,
                "bytes_per_part": list(reader.stats.bytes_by_part), "io_mode": reader.mode, "warning": reader.warning}
    finally:
        reader.close()


def bench_io(path: str, bundles=BUNDLES, depths=DEPTHS, max_bytes: int | None = 1 << 30, mode: str = "direct",
             repeat: int = 1, fio: bool = True, save: bool = True, on_cell=None) -> dict:
    """The io grid (see the module doc). `max_bytes` caps each cell's reads (None: every expert section);
    `repeat` keeps each cell's best of that many runs; `on_cell(cell)` is called as cells finish."""
    if save:
        check_cache_writable()  # before measuring, not after
    from moepack.format_spec.reader import Container

    bundles = sorted({int(b) for b in bundles})
    depths = sorted({int(d) for d in depths})
    if not bundles or not depths or bundles[0] < 1 or depths[0] < 1:
        raise MoepackError("bundle sizes and queue depths must be at least 1")
    if not 1 <= repeat <= MAX_BENCH_REPEAT:
        raise MoepackError(f"--repeat must be 1 to {MAX_BENCH_REPEAT}")
    with Container(path) as c:
        if not any(b.experts for b in c.layers):
            raise MoepackError(f"{path}: the container has no routed experts to read")
        plans = {b: _expert_reads(c, b, max_bytes) for b in bundles}
        paths = c.part_paths
        expert_bytes = max(r.length for b in c.layers for r in b.experts)
        experts_per_layer = max(len(b.experts) for b in c.layers)
        first_offset = c.layers[0].experts[0].offset if c.layers[0].experts else None
    load = _load()
    cells, warning, io_mode = [], None, mode
    for bundle in bundles:
        for depth in depths:
            best = None
            for _ in range(repeat):
                r = time_reads(paths, plans[bundle], depth, mode)
                if best is None or r["seconds"] < best["seconds"]:
                    best = r
            warning = warning or best["warning"]
            io_mode = best["io_mode"]
            cell = {"bundle_experts": bundle, "queue_depth": depth, "read_bytes": min(bundle, experts_per_layer) *
                    expert_bytes, "bytes": best["bytes"], "requests": best["requests"],
                    "seconds": round(best["seconds"], 6), "gbps": best["bytes"] / best["seconds"] / 1e9}
            cells.append(cell)
            if on_cell:
                on_cell(cell)
    fastest = max(cells, key=lambda x: x["gbps"])
    ties = [x for x in cells if x["gbps"] >= (1 - NEAR_TIE) * fastest["gbps"]]
    best = min(ties, key=lambda x: (x["read_bytes"] * x["queue_depth"], -x["gbps"]))
    result = {
        "path": os.path.realpath(path), "file_key": file_key(path), "machine": machine_id(), "measured_at": _now(),
        **load,
        "io_mode": io_mode, "warning": warning, "bundles": bundles, "depths": depths, "repeat": repeat,
        "bytes_per_cell": cells[0]["bytes"], "expert_bytes": expert_bytes, "cells": cells,
        "fastest": {k: fastest[k] for k in ("bundle_experts", "queue_depth", "gbps")},
        "best": {k: best[k] for k in ("bundle_experts", "queue_depth", "gbps", "read_bytes")},
        "fio": None,
    }
    if fio:
        end = max(r.offset + r.length for r in plans[best["bundle_experts"]] if r.part == 0)  # fio reads the main file
        result["fio"] = run_fio(path, first_offset, end - first_offset, best["read_bytes"], best["queue_depth"])
        f = result["fio"]
        if f.get("gbps"):
            result["ours_over_fio"] = best["gbps"] / f["gbps"]
    if save:
        result["cache"] = store("io", result["file_key"], result)
    return result


FIO_ENGINES = ("io_uring", "libaio", "psync")


def fio_available() -> str | None:
    return shutil.which("fio")


def free_hugetlb_bytes(meminfo: str = "/proc/meminfo") -> int:
    """Bytes of reserved (hugetlbfs) huge pages free now: what fio's huge-page buffers need (vm.nr_hugepages)."""
    try:
        with open(meminfo) as f:
            info = dict(line.split(":", 1) for line in f if ":" in line)
        return int(info["HugePages_Free"].split()[0]) * int(info["Hugepagesize"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return 0


FIO_HUGE_BUFFERS = "huge pages"
FIO_SMALL_BUFFERS = "4 KiB pages (no free vm.nr_hugepages)"


def run_fio(path: str, offset: int, size: int, block_bytes: int, depth: int, engines=FIO_ENGINES,
            timeout: float = 600) -> dict:
    """fio reading [offset, offset+size) of `path` sequentially, O_DIRECT, `block_bytes` per request, `depth` in
    flight, with the first engine of `engines` that works (io_uring first). {"skipped": reason} without fio.

    fio's buffers are huge pages where enough reserved ones are free (vm.nr_hugepages), as moepack's read buffers
    are (transparent huge pages): a virtual disk can take twice as long over a request scattered across 4 KiB pages
    (this project's VM: 1.7 GB/s with 4 KiB pages, 3.4 GB/s with huge pages). "buffers" says which it used; where
    fio refuses huge-page buffers (another process took the pages) it runs again with ordinary ones."""
    exe = fio_available()
    if exe is None:
        return {"skipped": "fio is not installed (apt-get install fio)"}
    block_bytes = max(4096, block_bytes // 4096 * 4096)
    size = max(block_bytes, size // block_bytes * block_bytes)
    buffer_kinds = [FIO_HUGE_BUFFERS] if free_hugetlb_bytes() >= block_bytes * (depth + 1) else []
    buffer_kinds.append(FIO_SMALL_BUFFERS)
    errors = []
    for engine in engines:
        for buffers in buffer_kinds:
            cmd = [exe, "--name=moepack-read", f"--filename={path}", "--readonly", "--rw=read", "--direct=1",
                   f"--ioengine={engine}", f"--bs={block_bytes}", f"--iodepth={depth if engine != 'psync' else 1}",
                   f"--offset={offset}", f"--size={size}", "--numjobs=1", "--output-format=json",
                   *(["--iomem=mmaphuge"] if buffers == FIO_HUGE_BUFFERS else [])]
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                errors.append(f"{engine}: timed out")
                break  # the engine hangs: the buffers are not why
            try:
                out = json.loads(p.stdout[p.stdout.index("{"):])
                job = out["jobs"][0]
                if job.get("error"):
                    raise ValueError(f"error {job['error']}")
                read = job["read"]
                if not read.get("io_bytes"):
                    raise ValueError("read nothing")
            except (ValueError, KeyError, IndexError) as e:
                tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or [str(e)]
                errors.append(f"{engine} ({buffers}): {tail[0]}")
                continue
            return {"engine": engine, "gbps": read["bw_bytes"] / 1e9, "bytes": read["io_bytes"],
                    "seconds": read["runtime"] / 1000, "block_bytes": block_bytes,
                    "iodepth": depth if engine != "psync" else 1, "version": out.get("fio version"),
                    "buffers": buffers, "command": " ".join(cmd), "errors": errors}
    return {"failed": "; ".join(errors)}


# ---------------------------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn, repeat: int, device: torch.device) -> float:
    best = math.inf
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def bench_memory(size_mib: int = 256, repeat: int = 5, device: str | None = None, save: bool = True) -> dict:
    """Host memory copy rate (bytes copied per second; each byte copied is one read and one write of DRAM) and,
    with a CUDA device (`device`, default: cuda when available), host->device rates from pinned and pageable
    memory and device->host into pinned memory."""
    if save:
        check_cache_writable()  # before measuring, not after
    if size_mib < 1 or not 1 <= repeat <= MAX_BENCH_REPEAT:
        raise MoepackError(f"--size-mib must be at least 1 and --repeat 1 to {MAX_BENCH_REPEAT}")
    want_cuda = device is not None and device.startswith("cuda")
    if want_cuda and not torch.cuda.is_available():
        raise MoepackError("--device cuda asked for, but torch sees no CUDA device")
    n = size_mib << 20
    room = available_memory_bytes()
    if room and 2 * n > room:  # the source and the copy target
        raise MoepackError(f"--size-mib {size_mib}: two buffers of it need {2 * n / 2**30:.3g} GiB, but "
                           f"{room / 2**30:.3g} GiB of memory is available: lower --size-mib")
    load = _load()
    src = torch.empty(n, dtype=torch.uint8)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.fill_(0)
    host = _best_seconds(lambda: dst.copy_(src), repeat, torch.device("cpu"))
    result = {"machine": machine_id(), "measured_at": _now(), **load, "bytes": n, "repeat": repeat,
              "threads": torch.get_num_threads(),
              "host_copy_gbps": n / host / 1e9, "host_traffic_gbps": 2 * n / host / 1e9, "cuda": None}
    dst = None  # release the copy target before the device buffers
    if (device is None and torch.cuda.is_available()) or want_cuda:
        dev = torch.device(device or "cuda")
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        pinned.fill_(1)
        on_dev = torch.empty(n, dtype=torch.uint8, device=dev)
        h2d_pinned = _best_seconds(lambda: on_dev.copy_(pinned, non_blocking=True), repeat, dev)
        h2d_pageable = _best_seconds(lambda: on_dev.copy_(src), repeat, dev)
        d2h_pinned = _best_seconds(lambda: pinned.copy_(on_dev, non_blocking=True), repeat, dev)
        result["cuda"] = {"device": torch.cuda.get_device_name(dev), "h2d_pinned_gbps": n / h2d_pinned / 1e9,
                          "h2d_pageable_gbps": n / h2d_pageable / 1e9, "d2h_pinned_gbps": n / d2h_pinned / 1e9}
        del pinned, on_dev
    if save:
        result["cache"] = store("memory", "latest", result)
    return result


# ---------------------------------------------------------------------------------------------------------------
# compute
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertMath:
    """A family's routed experts as the engine computes them on the token counts a measurement asks about
    (runtime/expert_runner.py ExpertRunner.expert_output; on a CPU a family's expert on up to KERNEL_MAX_TOKENS
    tokens runs in the token kernel instead): where their matrices are, and either the family's expert_ffn on
    generically decoded matrices or the compiled decoders (FP4 by table, or fused) with the family's
    expert_forward and clamp. The measurements build, read and run experts by the family's names and arithmetic,
    never by their own."""

    family: str  # its name, as --family spells it
    arithmetic: Any  # the family's LayerPrefill (families/base.py) for the experts' config

    @property
    def naming(self) -> ExpertNaming:
        return self.arithmetic.expert_naming

    @property
    def compiled(self) -> bool:
        """The compiled decoders (and the fused FP4 kernel) compute these experts (no expert_ffn of the family)."""
        return self.arithmetic.expert_ffn is None

    @property
    def bare_naming(self) -> ExpertNaming:
        """The naming of an expert's tensors as measured here: without their prefix."""
        return dataclasses.replace(self.naming, prefix=lambda layer, expert: "")

    def names(self) -> dict[str, str]:
        """The gate / up / down weights' names of an expert's tensors as measured here (without their prefix)."""
        return self.bare_naming.names(0, 0)

    def run(self, weights, x: torch.Tensor) -> torch.Tensor:
        """The expert (an ExpertWeights) on rows x."""
        a = self.arithmetic
        if a.expert_ffn is not None:
            return a.expert_ffn(x, weights.w1, weights.w3, weights.w2)
        return weights.apply(x, forward=a.expert_forward, limit=a.expert_limit)

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """Between the grouped backend's two GEMMs."""
        return self.arithmetic.expert_activation(gate, up)


def expert_math(family, config: dict, dtype: torch.dtype) -> ExpertMath:
    """`family`'s experts (a registered family) for a config.json of it (a container's, or one giving only the
    experts' hidden_size and moe_intermediate_size, the family's defaults elsewhere), computed in `dtype`."""
    return ExpertMath(family.name, family.layer_prefill(family.parse_config(config), dtype))


def _synthetic_family(name: str | None):
    """The family synthetic experts are computed as: `name`, else the registry's first (DeepSeek-V4, whose experts
    the compiled kernels compute)."""
    from moepack import families

    return families.family_named(name if name is not None else families.FAMILY_NAMES[0])


def _synthetic_expert(storage: str, hidden: int, inter: int, seed: int, naming: ExpertNaming
                      ) -> list[tuple[str, str, tuple, bytes]]:
    """One routed expert's stored tensors (name, storage type, logical shape, bytes), gate/up/down, quantized from
    random Gaussian weights to `storage` the way the release (FP4_E2M1 + E8M0) or `convert` would store them."""
    from moepack.format_spec import quants
    from moepack.format_spec.decode import scale_name
    from moepack.format_spec.source_formats import fp4_quantize

    g = torch.Generator().manual_seed(seed)
    out = []
    for name, shape in ((naming.gate, (inter, hidden)), (naming.up, (inter, hidden)), (naming.down, (hidden, inter))):
        w = torch.randn(shape, generator=g) * shape[1] ** -0.5
        if storage in ("FP4_E2M1", "MXFP4"):
            packed, scale = fp4_quantize(w)
            if storage == "FP4_E2M1":
                out.append((name, "FP4_E2M1", shape, packed.view(torch.uint8).numpy().tobytes()))
                out.append((scale_name(name), "F8_E8M0", (shape[0], shape[1] // 32),
                            scale.view(torch.uint8).numpy().tobytes()))
            else:
                blocks = quants.fp4_to_mxfp4(packed, scale.view(torch.uint8))
                out.append((name, "MXFP4", shape, blocks.contiguous().numpy().tobytes()))
        elif storage == "BF16":
            out.append((name, "BF16", shape, w.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()))
        elif storage in COMPUTE_STORAGES:
            out.append((name, storage, shape, quants.quantize_torch(w, storage).numpy().tobytes()))
        else:
            raise MoepackError(f"unknown expert storage {storage!r} (choose from {', '.join(COMPUTE_STORAGES)}, "
                               f"or measure a container's own experts with --file)")
    return out


def _container_experts(path: str, count: int, dtype: torch.dtype) -> tuple[list, int, int, str, ExpertMath]:
    """`count` experts of the last layer with routed experts of a container, as stored, and its family's
    arithmetic: (experts, hidden, inter, type, math)."""
    from moepack.families import container_family
    from moepack.format_spec.reader import Container

    with Container(path) as c:
        family = container_family(c)
        arith = expert_math(family, c.config, dtype)
        layers = [b for b in c.layers if b.experts]
        if not layers:
            raise MoepackError(f"{path}: the container has no routed experts")
        block = layers[-1]
        naming = arith.naming
        experts = []
        for region in block.experts[:count]:
            prefix = naming.prefix(block.number, region.expert)
            experts.append([(t.name[len(prefix):], t.dtype, t.shape, c.tensor_bytes(t.name))
                            for t in region.tensors])
        gate = next(t for t in experts[0] if t[0] == naming.gate)
    return experts, int(gate[2][1]), int(gate[2][0]), gate[1], arith


def _expert_region(tensors: dict, arith: ExpertMath):
    """(region, raw bytes, layout) of an expert as the engine sees it: the tensors' entries laid out one after the
    other in `raw`, and ExpertDecoder.layout's verdict ("FP4_E2M1", "MXFP4" or None: decode_group's path; always
    None for a family's own expert_ffn). `tensors`: name -> (storage type, shape, bytes on device)."""
    from types import SimpleNamespace

    from moepack.runtime.expert_decode import ExpertDecoder

    entries, offset = [], 0
    for name, (stype, shape, raw) in tensors.items():
        entries.append(SimpleNamespace(name=name, dtype=stype, shape=tuple(shape), file_offset=offset,
                                       length=raw.numel()))
        offset += raw.numel()
    region = SimpleNamespace(tensors=entries, expert=0)
    layout = ExpertDecoder.layout(region, arith.names()) if arith.compiled else None
    return region, torch.cat([raw for _, _, raw in tensors.values()]), layout


def _decode_expert(tensors: dict, decoder, arith: ExpertMath, tokens: int | None = None):
    """The expert (an ExpertWeights) decoded as the engine decodes a region (runtime/expert_runner.py
    decode_expert, in the decoder's dtype): FP4 through its table decoder (left packed for the fused kernel when
    `tokens` is within the decoder's fused_tokens), anything else through decode_group (scales and tensor scales
    applied; on a CPU into the decoder's buffers)."""
    from moepack.runtime.expert_runner import decode_expert

    region, raw, _ = _expert_region(tensors, arith)
    return decode_expert(decoder, arith.bare_naming, 0, region, raw, 0, compiled=arith.compiled, tokens=tokens)


def bench_compute(device: str = "cpu", tokens=COMPUTE_TOKENS, file: str | None = None, storage: str = "FP4_E2M1",
                  hidden: int | None = None, intermediate: int | None = None, expert_dtype: str = "float32",
                  experts: int | None = None, repeat: int = 2, save: bool = True, on_point=None,
                  expert_backend: str = "auto", family: str | None = None) -> dict:
    """Effective FLOP/s of the engine's expert work (decode the stored bytes, then the family's expert FFN:
    6 x tokens x hidden x intermediate FLOPs) at several tokens per expert, by the expert backend prefill would use
    on this device (grouped_experts.py: per-expert on a CPU; grouped on a GPU, `experts` of them decoded together
    and run as grouped GEMMs, as a read's bundle is). The weights are a container's own experts (`file`: computed
    as its family's) or random ones stored as `storage`, computed as `family`'s (its name; default _synthetic_family's)
    and sized as its default config's unless `hidden`/`intermediate` say otherwise. Reports per point:
    effective GFLOP/s (decode included), matmul-only GFLOP/s and the decode time."""
    if save:
        check_cache_writable()  # before measuring, not after
    from moepack.backends.grouped_experts import resolve_expert_backend

    from moepack.runtime.expert_decode import COMPUTE_DTYPES as EXPERT_DTYPES

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MoepackError("--device cuda asked for, but torch sees no CUDA device")
    if expert_dtype not in EXPERT_DTYPES:
        raise MoepackError(f"unknown expert dtype {expert_dtype!r} (choose from {', '.join(EXPERT_DTYPES)})")
    tokens = sorted({int(t) for t in tokens})
    backend = resolve_expert_backend(expert_backend, dev)
    experts = experts or (16 if backend == "grouped" else 2)
    if not tokens or tokens[0] < 1 or not 1 <= experts <= MAX_BUNDLE_EXPERTS or not 1 <= repeat <= MAX_BENCH_REPEAT:
        raise MoepackError(f"tokens per expert must be at least 1, --experts 1 to {MAX_BUNDLE_EXPERTS} (a read's "
                           f"bundle) and --repeat 1 to {MAX_BENCH_REPEAT}")
    dtype = EXPERT_DTYPES[expert_dtype]
    load = _load()
    if file is not None:
        stored, H, I, storage, arith = _container_experts(file, experts, dtype)
        if family is not None and family != arith.family:
            raise MoepackError(f"{file} holds a {arith.family} model: its experts are timed as that family's, "
                               f"not {family}'s")
        source = os.path.realpath(file)
    else:
        chosen = _synthetic_family(family)
        default = chosen.shape(chosen.parse_config({}))  # the family's own default sizes
        H, I = hidden or default.hidden_size, intermediate or default.expert_intermediate
        arith = expert_math(chosen, {"hidden_size": H, "moe_intermediate_size": I}, dtype)
        stored = [_synthetic_expert(storage, H, I, seed, arith.naming) for seed in range(experts)]
        source = "synthetic"
    # The bytes on the compute device, as the engine has them after _to_device; decoded there.
    on_device = [{n: (t, tuple(s), torch.frombuffer(bytearray(b), dtype=torch.uint8).to(dev)) for n, t, s, b in e}
                 for e in stored]
    from moepack.runtime.expert_decode import ExpertDecoder

    decoder = ExpertDecoder(dtype, dev)

    def own(w):  # the table decoder reuses its buffers from one expert to the next
        return dataclasses.replace(w, w1=w.w1.clone(), w3=w.w3.clone(), w2=w.w2.clone())

    decoded = [own(_decode_expert(e, decoder, arith)) for e in on_device]  # also warms the decode path up
    g = torch.Generator().manual_seed(0)
    points = []
    if backend == "grouped":
        points = _grouped_points(on_device, tokens, arith, H, I, dtype, dev, repeat, on_point)
    for t in tokens if backend != "grouped" else ():
        x = (torch.randn(t, H, generator=g) * 0.5).to(dev, dtype)
        arith.run(decoded[0], x)  # warm-up at this shape

        def full():
            for e in on_device:
                arith.run(_decode_expert(e, decoder, arith), x)

        def matmul_only():
            for w in decoded:
                arith.run(w, x)

        points.append(_compute_point(t, H, I, _best_seconds(full, repeat, dev) / len(on_device),
                                     _best_seconds(matmul_only, repeat, dev) / len(on_device), on_point))
    t_dec = _best_seconds(lambda: [_decode_expert(e, decoder, arith) for e in on_device], repeat, dev
                          ) / len(on_device)
    decoder.close()
    fused = _fused_crossover(on_device, arith, H, dtype, dev, repeat)
    dtype_choice = measure_compute_dtype(H, I) if dev.type == "cpu" else None
    result = {
        "machine": machine_id(), "measured_at": _now(), **load, "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_model(),
        "threads": torch.get_num_threads(), "source": source, "family": arith.family, "storage": storage,
        "hidden": H, "intermediate": I,
        "expert_dtype": expert_dtype, "experts": len(on_device), "repeat": repeat, "expert_backend": backend,
        "decode_seconds_per_expert": t_dec, "points": points, **({"fused": fused} if fused else {}),
        **({"compute_dtype": dtype_choice} if dtype_choice else {}),
    }
    if save:
        result["cache"] = store("compute", compute_key(dev.type, storage, H, I, expert_dtype), result)
        if dtype_choice:  # --compute-dtype auto's choice for this CPU model
            store("compute_dtype", dtype_choice["device_name"], dtype_choice)
    return result


def _grouped_points(on_device: list, tokens: list[int], arith: ExpertMath, H: int, inner: int, dtype: torch.dtype,
                    dev: torch.device, repeat: int, on_point=None) -> list[dict]:
    """bench_compute's points for the grouped backend: every expert of `on_device` decoded together
    (decode_stacked) and run on `t` tokens each as grouped GEMMs with the family's activation between them, the
    engine's bundle work."""
    from moepack.format_spec.decode import decode_stacked
    from moepack.backends.grouped_experts import grouped_matmul

    regions = [_expert_region(e, arith) for e in on_device]
    raw_of = {id(t): raw for region, raw, _ in regions for t in region.tensors}
    naming, activation = arith.naming, arith.activation

    def decode():
        w = decode_stacked([("", region.tensors) for region, _, _ in regions],
                           lambda t: raw_of[id(t)][t.file_offset: t.file_offset + t.length],
                           (naming.gate, naming.up, naming.down), dtype)
        return torch.cat([w[naming.gate], w[naming.up]], dim=1), w[naming.down]

    def run(x, counts, gate_up, down):
        both = grouped_matmul(x, gate_up.transpose(1, 2), counts)
        return grouped_matmul(activation(both[:, :inner], both[:, inner:]), down.transpose(1, 2), counts)

    decoded = decode()
    g = torch.Generator().manual_seed(0)
    points = []
    for t in tokens:
        counts = [t] * len(regions)
        x = (torch.randn(t * len(regions), H, generator=g) * 0.5).to(dev, dtype)
        run(x, counts, *decoded)  # warm-up at this shape
        points.append(_compute_point(t, H, inner, _best_seconds(lambda: run(x, counts, *decode()), repeat, dev)
                                     / len(regions),
                                     _best_seconds(lambda: run(x, counts, *decoded), repeat, dev) / len(regions),
                                     on_point))
    return points


def _compute_point(tokens: int, hidden: int, inner: int, full_s: float, matmul_s: float, on_point=None) -> dict:
    """One point of bench_compute: an expert's 6 x tokens x H x I FLOPs in `full_s` (decode included) and
    `matmul_s` (the matmuls alone), per expert."""
    flops = 6 * tokens * hidden * inner
    point = {"tokens_per_expert": tokens, "seconds_per_expert": full_s, "gflops": flops / full_s / 1e9,
             "matmul_gflops": flops / matmul_s / 1e9, "decode_seconds_per_expert": max(full_s - matmul_s, 0.0)}
    if on_point:
        on_point(point)
    return point


def _fused_crossover(on_device: list, arith: ExpertMath, H: int, dtype: torch.dtype, dev: torch.device,
                     repeat: int) -> dict | None:
    """Where this CPU's fused FP4 matmul stops beating decode + GEMM, as the engine runs an expert (one thread):
    {"threads", "points": [{tokens_per_expert, fused_seconds_per_expert, decoded_seconds_per_expert}],
    "max_tokens"}: the last of FUSED_TOKENS at which the fused kernel is as fast, before two in a row at which it
    is slower (one slower point alone can be noise; 0: never as fast). None where the fused kernel does not apply
    (not bf16 on a CPU that has it, not FP4 experts, not a family whose experts the compiled kernels compute)."""
    from moepack.runtime.expert_decode import ExpertDecoder, fused_max_tokens
    from moepack.runtime.io import torch_threads

    if not fused_max_tokens(dtype, dev) or _expert_region(on_device[0], arith)[2] is None:
        return None
    decoder = ExpertDecoder(dtype, dev, threads=1, fused_tokens=max(FUSED_TOKENS))
    try:
        with torch_threads(1):  # an expert thread's own core, as in the engine
            g = torch.Generator().manual_seed(1)
            points, limit, losses = [], 0, 0
            for t in FUSED_TOKENS:
                x = (torch.randn(t, H, generator=g) * 0.5).to(dev, dtype)

                def run(tokens):
                    return lambda: [arith.run(_decode_expert(e, decoder, arith, tokens), x) for e in on_device]

                run(t)(), run(None)()  # warm-up at this shape
                fused_s = _best_seconds(run(t), repeat, dev) / len(on_device)
                decoded_s = _best_seconds(run(None), repeat, dev) / len(on_device)
                points.append({"tokens_per_expert": t, "fused_seconds_per_expert": fused_s,
                               "decoded_seconds_per_expert": decoded_s})
                losses = losses + 1 if fused_s > decoded_s else 0
                if losses == 2:
                    break
                if not losses:
                    limit = t
    finally:
        decoder.close()
    return {"threads": 1, "points": points, "max_tokens": limit}


COMPUTE_DTYPE_TOKENS = 512  # rows of the GEMM float32 and bfloat16 are timed on (a prefill's)
BF16_WINS_BY = 1.1  # bfloat16 becomes the default where it is at least this much faster


def measure_compute_dtype(hidden: int, inter: int, repeat: int = 3) -> dict:
    """float32 against bfloat16 on this CPU: the best time of a [COMPUTE_DTYPE_TOKENS, hidden] x [hidden, inter]
    GEMM (an expert's w1 over a prefill's tokens) in each, all threads. The choice is bfloat16 where it is
    BF16_WINS_BY faster."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(COMPUTE_DTYPE_TOKENS, hidden, generator=g)
    w = torch.randn(inter, hidden, generator=g) * hidden ** -0.5
    cpu = torch.device("cpu")
    out = {"tokens": COMPUTE_DTYPE_TOKENS, "hidden": hidden, "intermediate": inter, "device_name": cpu_model(),
           "threads": torch.get_num_threads(), "measured_at": _now()}
    flops = 2 * COMPUTE_DTYPE_TOKENS * hidden * inter
    for dtype in (torch.float32, torch.bfloat16):
        xd, wd = x.to(dtype), w.to(dtype)
        torch.nn.functional.linear(xd, wd)  # warm-up (oneDNN builds its kernel for the shape)
        seconds = _best_seconds(lambda: torch.nn.functional.linear(xd, wd), repeat, cpu)
        out[f"{str(dtype).removeprefix('torch.')}_gflops"] = round(flops / seconds / 1e9, 2)
    out["choice"] = "bfloat16" if out["bfloat16_gflops"] >= BF16_WINS_BY * out["float32_gflops"] else "float32"
    return out


def compute_key(device_type: str, storage: str, hidden: int, inter: int, expert_dtype: str) -> str:
    return f"{device_type}|{storage}|{hidden}x{inter}|{expert_dtype}"
