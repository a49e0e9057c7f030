"""`moepack verify FILE --source SRC`: every tensor of a container against the checkpoint it came from.

Each container tensor is decoded to float (with its scale, if it kept one, and its tensor scale, if it has one)
and compared with the source tensor decoded the same way. A tensor stored in its source type must be
bit-identical; a conversion the policy calls lossless (FP8/FP4 -> BF16, FP4 -> MXFP4) must give exactly the
source's values; a lossy one must stay within its type's relative-RMSE threshold. The worst tensors are reported
either way.
"""

from __future__ import annotations

import json

import time

import torch

from moepack.format_spec.decode import (decode_float, decode_tensor, scale_name, tensor_scale_name,
                                       tensor_scale_value)
from moepack.format_spec.dtypes import FROM_SAFETENSORS, STORAGE_TYPES
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.layout import TENSOR_SCALE_SUFFIX
from moepack.format_spec.reader import Container
from moepack.families import adapter_for

from .convert import source_type_and_shape
from .progress import progress_bar
from .source import CheckpointDir

# Per storage type (its codec, format_spec/codecs.py): `exact_from`, the source types it holds exactly, and
# `max_rel_rmse`, the largest relative RMSE (||stored - source|| / ||source||) accepted on weight-like data
# (measured figures are in docs/quantization.md; the thresholds leave headroom above them).


def _source_values(source: CheckpointDir, adapter, names: dict[str, str], name: str):
    """(source storage type, float values) of a canonical tensor name."""
    t = source.tensors[names[name]]
    dtype, shape = source_type_and_shape(adapter, name, t)
    scale = None
    sname = scale_name(name)
    if sname in names and STORAGE_TYPES[dtype].takes_scale:
        st = source.tensors[names[sname]]
        scale = decode_tensor(FROM_SAFETENSORS[st.dtype], st.shape, source.read(st))
    raw = source.read(t)
    return dtype, raw, decode_float(dtype, shape, raw, scale) if dtype not in ("I64", "I32", "I16", "U8", "BOOL") \
        else decode_tensor(dtype, shape, raw)


def compare_with_source(path: str, src: str, revision: str | None = None, progress: bool = True,
                        worst: int = 10) -> dict:
    from .hub import open_source

    start = time.perf_counter()
    source, provenance = open_source(src, revision=revision, progress=progress)
    rows, failures = [], []
    try:
        adapter = adapter_for(source.config)
        names = {adapter.canonical(n): n for n in source.tensors}
        with Container(path) as c:
            problem = config_difference(c, source.config)
            if problem:
                failures.append({"tensor": "config.json", "problem": problem})
            missing = sorted(n for n in names if n not in c.tensors and not _consumed_scale(c, n)
                             and not (c.policy.get("drop_mtp") and n.startswith("mtp.")))
            if missing:
                failures.append({"tensor": missing[0], "problem": f"missing from the container ({len(missing)} "
                                                                   f"source tensors are)"})
            bar = progress_bar(c.data_bytes, "compare", progress)
            for region in c.regions:
                for t in region.tensors:
                    if t.name.endswith(TENSOR_SCALE_SUFFIX):
                        continue  # compared as part of its weight (the reader checked that it has one)
                    if t.name not in names:
                        failures.append({"tensor": t.name, "problem": "not in the source"})
                        continue
                    row = _compare_tensor(c, source, adapter, names, t)
                    rows.append(row)
                    if row.get("problem"):
                        failures.append({"tensor": t.name, "problem": row["problem"]})
                bar.update(region.length)
            bar.close()
    finally:
        source.close()
    lossy = [r for r in rows if "rel_rmse" in r]
    lossy.sort(key=lambda r: -r["rel_rmse"])
    by_type: dict[str, dict] = {}
    for r in lossy:
        agg = by_type.setdefault(r["stored"], {"tensors": 0, "max_rel_rmse": 0.0})
        agg["tensors"] += 1
        agg["max_rel_rmse"] = max(agg["max_rel_rmse"], r["rel_rmse"])
    return {
        "ok": not failures, "path": path, "source": provenance["source"], "tensors": len(rows),
        "bit_identical": sum(1 for r in rows if r["check"] == "bytes"),
        "value_identical": sum(1 for r in rows if r["check"] == "values"),
        "lossy": len(lossy), "by_type": by_type, "worst": lossy[:worst], "failures": failures,
        "seconds": round(time.perf_counter() - start, 3),
    }


def config_difference(c: Container, source_config: dict) -> str | None:
    """How the container's config.json differs from its source's (the model computes by it: another
    routed_scaling_factor is another model with the same weights), or None. The one difference convert makes is
    allowed: a tied head untied where the checkpoint stored a head of its own (convert.untie_a_stored_head)."""
    ours = dict(c.config)
    if source_config.get("tie_word_embeddings") is True and ours.get("tie_word_embeddings") is False:
        ours["tie_word_embeddings"] = True
    keys = sorted(set(ours) | set(source_config), key=str)
    differ = [k for k in keys if ours.get(k, _ABSENT) != source_config.get(k, _ABSENT)]
    if not differ:
        return None

    def shown(config, key):
        return "absent" if key not in config else json.dumps(config[key])[:60]
    first = differ[0]
    return (f"differs from the source's: {first} is {shown(source_config, first)} there, "
            f"{shown(c.config, first)} here" + (f" (and {len(differ) - 1} more keys)" if len(differ) > 1 else ""))


_ABSENT = object()


def _consumed_scale(c: Container, name: str) -> bool:
    """A source scale the container folded into its (requantized) weight."""
    return name.endswith(".scale") and name[: -len(".scale")] + ".weight" in c.tensors


def _compare_tensor(c: Container, source: CheckpointDir, adapter, names, t) -> dict:
    src_type, src_raw, expected = _source_values(source, adapter, names, t.name)
    stored = c.tensor_bytes(t.name)
    row = {"tensor": t.name, "source": src_type, "stored": t.dtype}
    ts_name = tensor_scale_name(t.name)
    tensor_scale = tensor_scale_value(c.tensor_bytes(ts_name), ts_name) if ts_name in c.tensors else None
    if t.dtype == src_type and tensor_scale is None:
        row["check"] = "bytes"
        if stored != src_raw:
            row["problem"] = f"stored in its source type {src_type} but the bytes differ"
        return row
    scale = None
    sname = scale_name(t.name)
    if sname in c.tensors and STORAGE_TYPES[t.dtype].takes_scale:
        s = c.tensors[sname]
        scale = decode_tensor(s.dtype, s.shape, c.tensor_bytes(sname))
    got = decode_float(t.dtype, t.shape, stored, scale, tensor_scale=tensor_scale)
    if got.shape != expected.shape:
        row["problem"] = f"shape {list(got.shape)} differs from the source's {list(expected.shape)}"
        return row
    if src_type in STORAGE_TYPES[t.dtype].exact_from:
        row["check"] = "values"
        if not torch.equal(got, expected.float()):
            row["problem"] = f"{src_type} -> {t.dtype} should be lossless but values differ " \
                             f"(max abs error {float((got - expected).abs().max()):.3g})"
        return row
    ref = expected.float()
    err = got - ref
    norm = float(ref.norm())
    row["check"] = "error"
    row["rel_rmse"] = float(err.norm()) / norm if norm else float(err.norm())
    row["max_abs_error"] = float(err.abs().max()) if err.numel() else 0.0
    limit = STORAGE_TYPES[t.dtype].max_rel_rmse
    if limit is None:
        row["problem"] = f"no accuracy threshold for {src_type} -> {t.dtype}"
    elif row["rel_rmse"] > limit:
        row["problem"] = f"{t.dtype} relative RMSE {row['rel_rmse']:.4f} exceeds its threshold {limit}"
    return row


def raise_on_failures(report: dict) -> None:
    if report["failures"]:
        first = report["failures"][0]
        more = len(report["failures"]) - 1
        what = first["tensor"] if first["tensor"].endswith(".json") else f"tensor {first['tensor']}"
        raise MoepackError(f"{what}: {first['problem']}" + (f" (and {more} more)" if more else ""))
