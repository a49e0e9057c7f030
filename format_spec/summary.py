"""What `moepack inspect` reports about a container."""

from __future__ import annotations

from collections import defaultdict

from .layout import HEADER_SIZE, SCALE_SUFFIXES
from .reader import Container


def summarize(c: Container) -> dict:
    region_bytes: dict[str, int] = defaultdict(int)
    for r in c.regions:
        section = "mtp." if r.block and r.block.startswith("mtp.") else ""
        region_bytes[section + r.kind] += r.length
    types: dict[str, dict] = defaultdict(lambda: {"tensors": 0, "bytes": 0, "elements": 0})
    for t in c.tensors.values():
        types[t.dtype]["tensors"] += 1
        types[t.dtype]["bytes"] += t.length
        types[t.dtype]["elements"] += t.numel
    expert_regions = [r for b in c.layers for r in b.experts]
    expert_params = sum(t.numel for r in expert_regions for t in r.tensors if not t.name.endswith(SCALE_SUFFIXES))
    expert_bytes = sum(r.length for r in expert_regions)
    cfg = c.config
    return {
        "path": c.path,
        "format_version": f"{c.header.major}.{c.header.minor}",
        "architecture": c.architecture,
        "model_type": cfg.get("model_type"),
        "policy": c.policy.get("name"),
        "layers": len(c.layers),
        "mtp_layers": sum(1 for b in c.blocks if b.section == "mtp"),
        "experts_per_layer": sorted({len(b.experts) for b in c.layers}),
        "hidden_size": cfg.get("hidden_size"),
        "vocab_size": cfg.get("vocab_size"),
        "regions": len(c.regions),
        "tensors": len(c.tensors),
        "bytes_by_region_kind": dict(region_bytes),
        # the rest of the file: its header, its index (compressed) and the alignment padding between regions
        "header_bytes": HEADER_SIZE,
        "index_bytes": c.header.index_length,
        "storage_types": {k: dict(v) for k, v in sorted(types.items())},
        "expert_bits_per_weight": round(expert_bytes * 8 / expert_params, 3) if expert_params else None,
        "tokenizer_files": sorted(c.index["tokenizer"]),
        "file_bytes": c.file_size,
        "total_bytes": c.total_bytes,
    }

