"""Checkpoint directory -> container, region by region in read order.

Only one region's source bytes are in memory at a time (the largest is the embedding or one layer's dense block),
whatever the model's size.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

from moepack.format_spec.dtypes import FROM_SAFETENSORS
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.layout import parse_block_name, region_name
from moepack.format_spec.writer import ContainerWriter

from .arch import Adapter, adapter_for
from .progress import progress_bar
from .source import CheckpointDir, SourceTensor

POLICIES_IMPLEMENTED = ("keep",)


def plan_regions(adapter: Adapter, tensors: dict[str, SourceTensor]):
    """Group source tensors into regions in read order.

    Returns a list of (kind, block, expert, [(canonical name, source tensor)]): globals, then each block
    (`layers.N` in order, then `mtp.N`) as its dense region followed by its experts in ID order.
    """
    globals_: list = []
    dense: dict[str, list] = defaultdict(list)
    experts: dict[str, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    seen: dict[str, str] = {}
    for source_name, t in tensors.items():
        name = adapter.canonical(source_name)
        if name in seen:
            raise MoepackError(f"tensors {seen[name]} and {source_name} both map to {name}")
        seen[name] = source_name
        kind, block, expert = adapter.place(name)
        if kind == "global":
            globals_.append((name, t))
        elif kind == "dense":
            dense[block].append((name, t))
        else:
            experts[block][expert].append((name, t))
    plan = [("global", None, None, [item]) for item in sorted(globals_, key=lambda it: adapter.global_sort_key(it[0]))]
    blocks = set(dense) | set(experts)
    for block in sorted(blocks, key=lambda b: (parse_block_name(b)[0] == "mtp", parse_block_name(b)[1])):
        if block not in dense:
            raise MoepackError(f"{block} has experts but no attention/dense tensors")
        plan.append(("dense", block, None, sorted(dense[block])))
        ids = sorted(experts[block])
        if ids != list(range(len(ids))):
            missing = sorted(set(range(max(ids) + 1)) - set(ids))
            raise MoepackError(f"{block}: experts {missing[:8]} are missing from the checkpoint")
        for e in ids:
            items = sorted(experts[block][e], key=lambda it: adapter.expert_sort_key(it[0]))
            plan.append(("expert", block, e, items))
    return plan


def stored_type_and_shape(adapter: Adapter, name: str, t: SourceTensor) -> tuple[str, list[int]]:
    """Keep policy: the source's own storage type; packed FP4 gets its own type and its logical shape."""
    if t.dtype == "I8" and adapter.packed_fp4.search(name):
        return "FP4_E2M1", [*t.shape[:-1], t.shape[-1] * 2]
    return FROM_SAFETENSORS[t.dtype], list(t.shape)


def convert_checkpoint(src: str, out: str, policy: str = "keep", progress: bool = True) -> dict:
    if policy not in POLICIES_IMPLEMENTED:
        raise MoepackError(f"policy {policy!r} is not available yet (available: {', '.join(POLICIES_IMPLEMENTED)})")
    start = time.perf_counter()
    source = CheckpointDir(src)
    try:
        adapter = adapter_for(source.config)
        plan = plan_regions(adapter, source.tensors)
        total = sum(t.length for t in source.tensors.values())
        out_dir = os.path.dirname(os.path.abspath(out))
        if not os.path.isdir(out_dir):
            raise MoepackError(f"output directory {out_dir} does not exist")
        job = {"source": os.path.abspath(src), "policy": policy, "files": source.file_sizes(),
               "tensors": len(source.tensors)}
        writer = ContainerWriter(out, job=job, resume=True)
        resumed = _skip_completed(plan, writer.completed)
        bar = progress_bar(total, "convert", progress)
        bar.update(sum(t.length for _, _, _, items in plan[:resumed] for _, t in items))
        counts: dict[str, int] = defaultdict(int)
        try:
            for i, (kind, block, expert, items) in enumerate(plan):
                if i < resumed:
                    continue
                writer.begin_region(kind, block=block, expert=expert, tensor=items[0][0] if kind == "global" else None)
                for name, t in items:
                    dtype, shape = stored_type_and_shape(adapter, name, t)
                    data = source.read(t)
                    writer.add_tensor(name, dtype, shape, data)
                    bar.update(len(data))
                writer.end_region()
                if i + 1 == len(plan) or plan[i + 1][1] != block:
                    writer.checkpoint()  # a layer (or the globals) is complete: a rerun resumes after it
            for kind, block, expert, items in plan:
                for name, t in items:
                    counts[stored_type_and_shape(adapter, name, t)[0]] += 1
            writer.finish(
                config=source.config, architecture=adapter.architecture,
                policy={"name": policy, "lossless": True},
                tokenizer=source.side_files(),
                provenance={"source": os.path.abspath(src), "revision": None, "files": source.file_sizes()},
            )
        except BaseException:
            writer.abort()
            raise
        finally:
            bar.close()
    finally:
        source.close()
    seconds = time.perf_counter() - start
    out_bytes = os.path.getsize(out)
    return {"output": out, "policy": policy, "resumed_regions": resumed, "tensors": len(source.tensors), "regions": len(plan),
            "bytes_in": total, "bytes_out": out_bytes, "seconds": round(seconds, 3),
            "in_mb_per_s": round(total / max(seconds, 1e-9) / 1e6, 1), "storage_types": dict(counts)}


def _skip_completed(plan, completed: list[str]) -> int:
    """How many leading plan entries a resumed writer already holds (it must be a prefix of the plan)."""
    for i, name in enumerate(completed):
        kind, block, expert, items = plan[i] if i < len(plan) else (None, None, None, [("", None)])
        if kind is None or name != region_name(kind, block, expert, items[0][0]):
            raise MoepackError(f"cannot resume: the partial output's region {name} is not the plan's region {i}; "
                               f"delete the .partial file and convert again")
    return len(completed)
