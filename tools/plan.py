"""The break-even calculator: when does a layer-major prefill hide the SSD behind the compute (docs/plan.md)?

The model (the design note's; docs/plan.md): a prefill reads W streamed bytes once (`T_SSD = W / BW`) and
computes `FLOP/token x N` (`T_compute = FLOP/token x N / F`); with reads, copies and compute overlapped it takes
`max(T_SSD, T_compute, ...)`. The SSD is hidden from

    N* = F x W / (FLOP/token x BW)            optimistic: every FLOP of a token hides reads
                                              conservative: only the routed experts' FLOPs do (N* larger)

Everything model-side is derived, never typed in:

* sizes: from a container's index (exact), or from a config.json + precision policy by laying the checkpoint
  out exactly as `moepack convert` would (format_spec/policies.py decides each tensor's storage type,
  format_spec/dtypes.py its bytes, 64-byte tensor and 4096-byte region alignment included);
* FLOPs per token: 2 x the active parameters of the transformer layers (attention projections, compressors,
  indexer, router, mHC mixes, shared expert, top-k routed experts); the LM head runs once per prefill (the last
  position's logits) and is added once; the context-dependent attention (sliding window, CSA top-k, the Lightning
  Indexer's scores and HCA over compressed entries, which grow with N) is computed separately.

Machine-side numbers (BW, F, host-memory and PCIe bandwidth) come from `moepack bench` when it has measured them
on this machine (the cache tools/bench.py writes, runtime/tuning.py), else from the command line, else the design note's assumptions
(14 GB/s, 100 TFLOPS), and every figure says where it came from.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Mapping

from moepack.families import adapter_for, container_family, find_family
from moepack.families.base import sum_entries  # noqa: F401  (plan's closed form, as tests and notes call it)
from moepack.format_spec import untrusted
from moepack.format_spec.dtypes import FROM_SAFETENSORS, storage_type, tensor_nbytes
from moepack.format_spec.errors import MoepackError, error_reason
from moepack.format_spec.layout import (ALIGNMENT, HEADER_SIZE, SCALE_SUFFIXES, TENSOR_ALIGNMENT, TENSOR_SCALE_SUFFIX,
                                        align_up)
from moepack.format_spec.policies import POLICY_NAMES, target_type

GB = 1e9
GIB = 2 ** 30
# The design note's assumptions, used when nothing was measured or given.
ASSUMED_SSD_GBPS = 14.0  # PCIe 5.0 x4 NVMe sequential read, upper end
ASSUMED_TFLOPS = 100.0
DEFAULT_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
STREAM_MODES = ("all", "experts")
# all:     what `moepack prefill` does: globals, every layer's dense region and its experts are read once
# experts: the note's tables: non-routed weights resident on the device, only the routed experts streamed
ACTIVATION_BYTES = 2  # the note's F16 boundary activations (residual streams x hidden per token)
KV_BYTES = {n: storage_type(n).block_bytes for n in ("F32", "BF16", "F8_E4M3")}  # kv.KV_DTYPES (kv imports torch)


MAX_PLAN_CONTEXT = 1 << 30  # a thousand times DeepSeek-V4's context: past it the plan's figures are meaningless


def parse_tokens(text: str | int) -> int:
    """'8K' -> 8192, '1M' -> 1048576 (context lengths count in 1024s, as the note's tables do), '3000' -> 3000."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper()
    mult = 1
    if s.endswith("K"):
        s, mult = s[:-1], 1024
    elif s.endswith("M"):
        s, mult = s[:-1], 1024 * 1024
    try:
        value = int(round(float(s) * mult)) if len(s) <= 32 else None
    except (ValueError, OverflowError):  # not a number, NaN, infinity (1e999)
        value = None
    if value is None:
        raise MoepackError(f"bad context length {str(text)[:40]!r} (use e.g. 4096, 8K, 128K)") from None
    if not 1 <= value <= MAX_PLAN_CONTEXT:
        raise MoepackError(f"context length must be between 1 and {fmt_tokens(MAX_PLAN_CONTEXT)}, got {text!r}")
    return value


def fmt_tokens(n: float) -> str:
    """8192 -> '8K', 131072 -> '128K', 3000 -> '3000'."""
    n = int(round(n))
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}K"
    return str(n)


# ---------------------------------------------------------------------------------------------------------------
# Model sizes
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class LayerSize:
    layer: int
    attention: str  # sliding / csa / hca
    routing: str  # "hash" or "topk"
    dense_bytes: int  # the layer's dense region (attention, norms, router, shared expert, mHC)
    expert_bytes: int  # the largest expert region of the layer (bundle buffers are sized on it)
    experts_bytes: int  # the whole expert section
    n_experts: int


@dataclass
class ModelSizes:
    source: str  # "container", "checkpoint" (its headers) or "config"
    path: str | None
    policy: str
    layers: list[LayerSize]
    global_bytes: int  # embedding, head, final norm, mHC head (read once per prefill)
    mtp_bytes: int  # multi-token-prediction blocks (never read by a prefill)
    file_bytes: int  # the container's size (from a config: header + regions, the small index left out)
    expert_params: int  # parameters of one routed expert (gate + up + down)
    hidden_size: int
    residual_streams: int  # the hidden state's width in hidden_size rows (the family's residual_streams)
    top_k: int
    n_experts: int
    expert_bpw: float  # bits per routed-expert weight, as stored (scales and padding included)
    expert_bpw_override: float | None = None
    notes: list[str] = field(default_factory=list)
    expert_intermediate: int = 0  # a routed expert's FFN width (gate / up rows)

    @property
    def routed_bytes(self) -> int:
        return sum(s.experts_bytes for s in self.layers)

    @property
    def dense_bytes(self) -> int:
        return sum(s.dense_bytes for s in self.layers)

    @property
    def non_routed_bytes(self) -> int:
        """What stays resident when only the experts stream: every dense region and the globals."""
        return self.dense_bytes + self.global_bytes

    @property
    def max_dense_bytes(self) -> int:
        return max((s.dense_bytes for s in self.layers), default=0)

    @property
    def max_expert_bytes(self) -> int:
        return max((s.expert_bytes for s in self.layers), default=0)

    def streamed_bytes(self, stream: str = "all") -> int:
        """W: bytes a prefill reads from the container (stream='all', what moepack does), or the routed experts
        only (stream='experts', the note's tables, everything else resident)."""
        _check_stream(stream)
        return self.routed_bytes + (self.non_routed_bytes if stream == "all" else 0)

    def resident_bytes(self, stream: str = "all") -> int:
        _check_stream(stream)
        return self.non_routed_bytes if stream == "experts" else 0

    def as_dict(self, stream: str = "all") -> dict:
        out = asdict(self)
        out["layers"] = _group_layers(self.layers)
        out.update(routed_bytes=self.routed_bytes, dense_bytes=self.dense_bytes,
                   non_routed_bytes=self.non_routed_bytes, streamed_bytes=self.streamed_bytes(stream),
                   resident_bytes=self.resident_bytes(stream), max_dense_bytes=self.max_dense_bytes,
                   max_expert_bytes=self.max_expert_bytes, stream=stream)
        return out


def _check_stream(stream: str) -> None:
    if stream not in STREAM_MODES:
        raise MoepackError(f"unknown stream mode {stream!r} (choose from {', '.join(STREAM_MODES)})")


def _group_layers(layers: list[LayerSize]) -> list[dict]:
    """Layers with identical kind and sizes, grouped (per-layer sizes, compactly): [{"layers": "4-40/2", ...}]."""
    groups: dict[tuple, dict] = {}
    for s in layers:
        key = (s.attention, s.routing, s.dense_bytes, s.expert_bytes, s.experts_bytes, s.n_experts)
        if key not in groups:
            groups[key] = {"numbers": [], "attention": s.attention, "routing": s.routing,
                           "dense_bytes": s.dense_bytes, "expert_bytes": s.expert_bytes,
                           "experts_bytes": s.experts_bytes, "n_experts": s.n_experts}
        groups[key]["numbers"].append(s.layer)
    out = []
    for g in sorted(groups.values(), key=lambda g: g["numbers"][0]):
        numbers = g.pop("numbers")
        out.append({"layers": _ranges(numbers), "count": len(numbers), **g})
    return out


def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 9, 11] -> '0-2,5-11/2' (runs of a constant step, '/step' when it isn't 1)."""
    parts, i = [], 0
    while i < len(numbers):
        j = i + 1
        if j < len(numbers):
            step = numbers[j] - numbers[i]
            while j + 1 < len(numbers) and numbers[j + 1] - numbers[j] == step:
                j += 1
            if j - i >= 2 or step == 1:
                parts.append(f"{numbers[i]}-{numbers[j]}" + (f"/{step}" if step != 1 else ""))
                i = j + 1
                continue
        parts.append(str(numbers[i]))
        i += 1
    return ",".join(parts)


@dataclass(frozen=True)
class _Facts:
    """What a plan needs of a model beside its bytes: from DeepSeek-V4's config, or a family's (moepack.families)."""

    attention: list[str]  # per layer: sliding / csa / hca (DeepSeek-V4), full
    routing: list[str]  # per layer: hash / topk, or dense (no routed experts)
    hidden_size: int
    residual_streams: int  # the family's residual_streams (1 for a plain residual)
    top_k: int
    n_experts: int
    expert_intermediate: int


def _family_of(config: dict):
    """The family of a config.json (one no family takes is refused as `convert` refuses it)."""
    adapter_for(config)
    return find_family(config)


def _facts(config: dict, family) -> _Facts:
    parsed = family.parse_config(config)
    shape = family.shape(parsed)
    return _Facts(family.attention_kinds(parsed),
                  ["hash" if layer in shape.hash_layers else "topk" if layer in shape.moe_layers else "dense"
                   for layer in range(shape.num_layers)],
                  shape.hidden_size, family.residual_streams(parsed), shape.top_k, shape.num_experts,
                  shape.expert_intermediate)


def _stored_types(adapter, stored: list[tuple[str, str, tuple[int, ...]]]) -> list[tuple[str, str, list[int]]]:
    """(container name, storage type, logical shape) of what the source checkpoint holds for one tensor: packed FP4
    (I8 [out, in/2]) is FP4_E2M1 [out, in]."""
    out = []
    for name, dtype, shape in stored:
        name, shape = adapter.canonical(name), list(shape)
        if dtype == "I8" and adapter.packed_fp4.search(name):
            out.append((name, "FP4_E2M1", [*shape[:-1], shape[-1] * 2]))
        else:
            out.append((name, FROM_SAFETENSORS[dtype], shape))
    return out


def _region_bytes(items: list[tuple[str, str, list[int]]], adapter, policy: str) -> tuple[int, int]:
    """Bytes of one region as `moepack convert` writes it (packer/convert.py RegionConverter + writer.py): a
    weight the policy converts drops its scale; tensors start 64-byte aligned; the region is 4096-aligned.
    Returns (region bytes, tensor bytes)."""
    names = {name for name, _, _ in items}
    out, consumed = [], set()
    for name, dtype, shape in items:
        if name in consumed:
            continue
        target = target_type(policy, adapter.role(name, shape), dtype, shape)
        if target is None:
            out.append((name, dtype, shape))
            continue
        scale = name[: -len(".weight")] + ".scale" if name.endswith(".weight") else None
        if scale in names:
            consumed.add(scale)
        out.append((name, target, shape))
        if storage_type(target).needs_tensor_scale:  # stored after the weight (SPEC.md section 6.1)
            out.append((name[: -len(".weight")] + TENSOR_SCALE_SUFFIX, "F32", []))
    used = tensors = 0
    for name, dtype, shape in out:
        if name in consumed:
            continue
        n = tensor_nbytes(dtype, shape)
        used = align_up(used, TENSOR_ALIGNMENT) + n
        tensors += n
    return align_up(max(used, 1), ALIGNMENT), tensors


def sizes_from_config(config: dict, policy: str = "keep", expert_bpw: float | None = None,
                      layout: str | None = None,
                      stored: Mapping[str, tuple[str, tuple[int, ...]]] | None = None) -> ModelSizes:
    """The container `moepack convert --<policy>` would write for a checkpoint of this config.json, sized without
    reading a weight. `layout` is the source's: 'release' (FP8 dense + FP4 experts, as DeepSeek ships; the default
    when the config has the release's quantization_config) or 'bf16'. `stored`: instead of a layout, what the
    checkpoint itself holds (its safetensors headers: source name -> (dtype, shape)), so an F32 checkpoint is sized
    at 32 bits and a block it lacks (its MTP, say) is not counted. `expert_bpw` replaces the routed experts' size
    by params x bpw / 8 (a what-if: the note's q2 tables assume 2.3 bits per weight)."""
    if policy not in POLICY_NAMES:
        raise MoepackError(f"unknown policy {policy!r} (choose from {', '.join(POLICY_NAMES)})")
    if expert_bpw is not None and not 0 < expert_bpw <= 64:
        raise MoepackError(f"--expert-bpw must be in (0, 64], got {expert_bpw}")
    adapter = adapter_for(config)
    family = find_family(config)
    # the release's own layout (or `layout`), as the family says; its names made the container's by the adapter
    specs = dict(family.source_tensors(config, layout)) if stored is None else {
        adapter.canonical(name): [(name, dtype, tuple(shape))] for name, (dtype, shape) in stored.items()}

    def stored_types(name: str) -> list:
        return _stored_types(adapter, specs[name])
    facts = _facts(config, family)
    # Group what each region holds. Experts of one block are identical in shape: size expert 0 and multiply.
    regions: dict[tuple, list] = {}
    experts_of: dict[str, set[int]] = {}
    for name in specs:
        kind, block, expert = adapter.place(name)
        if kind == "expert":
            experts_of.setdefault(block, set()).add(expert)
            if expert != 0:
                continue
        key = (kind, block if kind != "global" else name, expert)
        regions.setdefault(key, []).extend(stored_types(name))
    sizes: dict[tuple, int] = {}
    expert_params = expert_tensor_bytes = 0
    for key, items in regions.items():
        kind, block, _ = key
        if kind == "dense":
            items.sort(key=lambda it: it[0])
        elif kind == "expert":
            items.sort(key=lambda it: adapter.expert_sort_key(it[0]))
        sizes[key], tensor_bytes = _region_bytes(items, adapter, policy)
        if kind == "expert" and block.startswith("layers.") and not expert_params:  # the first layer with experts
            expert_params = sum(math.prod(s) for n, _, s in items if not n.endswith(SCALE_SUFFIXES))
            expert_tensor_bytes = tensor_bytes
    if expert_bpw is not None:
        per_expert = int(round(expert_params * expert_bpw / 8))
        for key in sizes:
            if key[0] == "expert":
                sizes[key] = per_expert
    n_experts_of = {block: len(ids) for block, ids in experts_of.items()}
    missing = [i for i in range(len(facts.attention)) if ("dense", f"layers.{i}", None) not in sizes]
    if missing:  # (only `stored` can lack one: a checkpoint that holds fewer layers than its config names)
        raise MoepackError(f"the checkpoint holds no tensor of layers.{missing[0]} ({len(missing)} of the config's "
                           f"{len(facts.attention)} layers)")
    short = [i for i, routing in enumerate(facts.routing)
             if routing != "dense" and n_experts_of.get(f"layers.{i}", 0) != facts.n_experts]
    if short:  # (`stored` again: a partial download, say; convert would refuse it)
        block = f"layers.{short[0]}"
        raise MoepackError(f"the checkpoint holds {n_experts_of.get(block, 0)} of {block}'s {facts.n_experts} routed "
                           f"experts ({len(short)} layers short)")
    layers = []
    for i in range(len(facts.attention)):
        block = f"layers.{i}"
        n_exp = n_experts_of.get(block, 0)
        one = sizes.get(("expert", block, 0), 0)
        layers.append(LayerSize(i, facts.attention[i], facts.routing[i], sizes[("dense", block, None)], one,
                                one * n_exp, n_exp))
    global_bytes = sum(v for k, v in sizes.items() if k[0] == "global")
    mtp = sum(v * (n_experts_of.get(k[1], 0) if k[0] == "expert" else 1)
              for k, v in sizes.items() if k[0] != "global" and k[1].startswith("mtp."))
    routed = sum(s.experts_bytes for s in layers)
    file_bytes = HEADER_SIZE + global_bytes + sum(s.dense_bytes for s in layers) + routed + mtp
    notes = []
    if expert_bpw is not None:
        notes.append(f"routed experts sized at {expert_bpw} bits/weight (--expert-bpw), not by the {policy} policy")
    # bits per weight as stored (tensor bytes with their scales, region padding left out), as `convert` reports it
    bpw = (expert_bpw if expert_bpw is not None else
           expert_tensor_bytes * 8 / expert_params if expert_params else 0.0)
    return ModelSizes("config" if stored is None else "checkpoint", None, policy, layers, global_bytes, mtp,
                      file_bytes, expert_params, facts.hidden_size, facts.residual_streams, facts.top_k,
                      facts.n_experts, round(bpw, 4), expert_bpw, notes, facts.expert_intermediate)


def sizes_from_container(container) -> ModelSizes:
    """Exact sizes from an open container's index (format_spec.reader.Container)."""
    facts = _facts(container.config, container_family(container))
    layers = []
    for b in container.layers:
        lengths = [r.length for r in b.experts]
        layers.append(LayerSize(b.number, facts.attention[b.number], facts.routing[b.number], b.dense.length,
                                max(lengths, default=0), sum(lengths), len(lengths)))
    mtp = sum(b.dense.length + sum(r.length for r in b.experts) for b in container.blocks if b.section == "mtp")
    expert_params, expert_tensor_bytes, n_expert_regions = 0, 0, 0
    for b in container.layers:
        for r in b.experts:
            n_expert_regions += 1
            expert_tensor_bytes += sum(t.length for t in r.tensors)
            if not expert_params:
                expert_params = sum(math.prod(t.shape) for t in r.tensors if not t.name.endswith(SCALE_SUFFIXES))
    bpw = expert_tensor_bytes * 8 / (expert_params * n_expert_regions) if expert_params else 0.0
    return ModelSizes("container", container.path, str(container.policy.get("name", "?")), layers,
                      sum(r.length for r in container.global_regions), mtp, container.total_bytes, expert_params,
                      facts.hidden_size, facts.residual_streams, facts.top_k, facts.n_experts, round(bpw, 4),
                      expert_intermediate=facts.expert_intermediate)


# ---------------------------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------------------------

_FLOPS_MEMO: dict[str, dict] = {}


def flops_per_token(config: dict) -> dict:
    """Matmul FLOPs (2 per multiply-add) one prompt token costs in the transformer layers, by part, from the config:

    total            every layer's linears a token goes through (top-k routed experts included) = 2 x active params
    routed           the top-k routed experts' share (what the conservative break-even counts)
    head             the mHC head + LM head, per position whose logits are computed (a prefill: the last one)
    active_params    total / 2; with the head, the usual "active parameters" headline
    The embedding is a lookup (no FLOPs); MTP blocks are not run by a prefill. Attention over the context is
    `attention_flops_per_token` (it depends on N)."""
    key = json.dumps(config, sort_keys=True, default=str)
    if key not in _FLOPS_MEMO:
        _FLOPS_MEMO.clear()  # one config at a time is what callers ask for
        _FLOPS_MEMO[key] = _flops_per_token(config)
    out = _FLOPS_MEMO[key]
    return {**out, "parts": dict(out["parts"])}


def _flops_per_token(config: dict) -> dict:
    return _family_of(config).flops_per_token(config)


def attention_flops_per_token(config: dict, n_tokens: int) -> dict:
    """Average attention FLOPs per token of an n_tokens prefill (QK scores and the weighted sum, 4 x heads x
    head_dim per key, plus the Lightning Indexer's scores), by kind:

    window    sliding window keys (every layer) and CSA's top-k selected entries: bounded, not growing with N
    growing   HCA's dense attention over N/rate compressed entries and the indexer scoring N/rate entries per
              query: the O(N^2) part of a prefill (per token, it grows linearly with N)"""
    family = _family_of(config)
    return family.attention_flops(family.parse_config(config), max(int(n_tokens), 1))


# ---------------------------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Measured:
    """A machine number and where it came from ('given', 'measured ...', 'assumed ...')."""

    value: float
    source: str


class ComputeCurve:
    """Effective FLOP/s as a function of tokens per expert, from `moepack bench compute` (log-log interpolation,
    clamped at the measured ends)."""

    def __init__(self, points: list[tuple[float, float]]):
        pts = sorted((float(t), float(f)) for t, f in points if t > 0 and f > 0)
        if not pts:
            raise MoepackError("a compute curve needs at least one (tokens per expert, FLOP/s) point")
        self.t = [p[0] for p in pts]
        self.f = [p[1] for p in pts]

    def __call__(self, tokens_per_expert: float) -> float:
        x = max(tokens_per_expert, 1e-9)
        if x <= self.t[0]:
            return self.f[0]
        if x >= self.t[-1]:
            return self.f[-1]
        i = bisect.bisect_right(self.t, x)
        t0, t1, f0, f1 = self.t[i - 1], self.t[i], self.f[i - 1], self.f[i]
        a = (math.log(x) - math.log(t0)) / (math.log(t1) - math.log(t0))
        return math.exp(math.log(f0) + a * (math.log(f1) - math.log(f0)))


def vram_budget(sizes: ModelSizes, n_tokens: int, config: dict, *, stream: str = "all", bundle_experts: int = 16,
                queue_depth: int = 2, activation_bytes: int = ACTIVATION_BYTES, kv_dtype: str = "F32") -> dict:
    """The note's VRAM table for one device: the dense weights (2 layers' regions, the running one and the
    prefetch; or every non-routed weight when stream='experts' keeps them resident), the expert bundle buffers
    (bundle x largest expert x queue depth), the layer-boundary activations (N x residual streams x hidden x 2
    bytes) and one layer's KV (layers hand their KV off as they finish: the largest layer's, at N tokens; the row
    names what the family's KV holds)."""
    _check_stream(stream)
    if stream == "all":
        dense = ("dense regions of 2 layers (running + prefetch)", 2 * sizes.max_dense_bytes)
    else:
        dense = ("non-routed weights, resident", sizes.non_routed_bytes)
    rows = [
        dense,
        (f"expert bundle buffers ({bundle_experts} experts x {queue_depth} in flight)",
         bundle_experts * sizes.max_expert_bytes * queue_depth),
        (f"layer-boundary activations ({fmt_tokens(n_tokens)} x {sizes.residual_streams} x {sizes.hidden_size} x "
         f"{activation_bytes} B)", n_tokens * sizes.residual_streams * sizes.hidden_size * activation_bytes),
        (f"one layer's {_family_of(config).kv_label} ({kv_dtype}, handed off per layer)",
         one_layer_kv_bytes(config, n_tokens, kv_dtype)),
    ]
    return {"tokens": n_tokens, "rows": [{"item": k, "bytes": int(v)} for k, v in rows],
            "total_bytes": int(sum(v for _, v in rows))}


def one_layer_kv_bytes(config: dict, n_tokens: int, dtype: str = "F32") -> int:
    """The largest layer's KV after n_tokens: the sliding window tail plus the compressed entries (CSA: and the
    indexer's keys), as format_spec/KV.md stores them."""
    if dtype not in KV_BYTES:
        raise MoepackError(f"unknown KV dtype {dtype!r} (choose from {', '.join(KV_BYTES)})")
    family = _family_of(config)
    return family.kv_bytes(family.parse_config(config), n_tokens, KV_BYTES[dtype])


def make_plan(sizes: ModelSizes, config: dict, *, ssd_gbps: Measured, tflops: Measured | None = None,
              compute_curve: ComputeCurve | None = None, compute_source: str = "", gpus: int = 1, ssds: int = 1,
              contexts=DEFAULT_CONTEXTS, stream: str = "all", vram_gib: float | None = None,
              bundle_experts: int = 16, queue_depth: int = 2, mem_gbps: Measured | None = None,
              pcie_gbps: Measured | None = None, flops: dict | None = None, with_attention: bool = False,
              activation_bytes: int = ACTIVATION_BYTES, kv_dtype: str = "F32") -> dict:
    """Everything `moepack plan` prints, as a JSON-ready dict.

    F is `tflops` x gpus (constant), or `compute_curve` (measured FLOP/s per tokens-per-expert, x gpus).
    BW is ssd_gbps x ssds. Stages: SSD (W / BW), host memory (W / copy bandwidth: the SSD writes W into RAM and
    the consumer reads it back), PCIe (W / (host->device bandwidth x gpus)) and compute; a prefill takes the
    slowest. `flops` overrides the config's FLOPs per token ({"total", "routed"}; for what-ifs)."""
    _check_stream(stream)
    if gpus < 1 or ssds < 1:
        raise MoepackError("--gpus and --ssds must be at least 1")
    if (tflops is None) == (compute_curve is None):
        raise MoepackError("give the compute rate as either tflops or a measured compute curve")
    contexts = sorted({parse_tokens(c) for c in contexts})
    if not contexts:
        raise MoepackError("no context length to plan for")
    fl = flops_per_token(config)
    if flops:
        fl = {**fl, **flops}
    per_token, routed, head = float(fl["total"]), float(fl["routed"]), float(fl.get("head", 0))
    if per_token > 0 and routed <= 0 and not flops:
        raise MoepackError("this model has no routed experts (every layer a dense MLP): nothing of it is streamed "
                           "from disk, so there is no break-even to plan")
    if per_token <= 0 or routed <= 0:
        raise MoepackError("FLOPs per token must be positive")
    W = sizes.streamed_bytes(stream)
    bw = ssd_gbps.value * GB * ssds
    if bw <= 0:
        raise MoepackError("SSD bandwidth must be positive")
    t_ssd = W / bw
    top_k, n_exp = sizes.top_k, max(sizes.n_experts, 1)

    def F(n: float) -> float:
        if compute_curve is not None:
            return compute_curve(n * top_k / n_exp) * gpus
        return tflops.value * 1e12 * gpus

    stages_fixed = {"ssd": t_ssd}
    if mem_gbps is not None and mem_gbps.value > 0:
        stages_fixed["host_memory"] = W / (mem_gbps.value * GB)
    if pcie_gbps is not None and pcie_gbps.value > 0:
        stages_fixed["pcie"] = W / (pcie_gbps.value * GB * gpus)

    def compute_seconds(n: int, attention: bool) -> float:
        work = per_token * n + (attention_flops_per_token(config, n)["total"] * n + head if attention else 0.0)
        return work / F(n)

    rows = []
    for n in contexts:
        t_lin = compute_seconds(n, False)
        t_att = compute_seconds(n, True)
        t_c = t_att if with_attention else t_lin
        stages = {**stages_fixed, "compute": t_c}
        bottleneck = max(stages, key=stages.get)
        wall = stages[bottleneck]
        att = attention_flops_per_token(config, n)
        # one bundle of the note's granularity table: its read time against its experts' compute time
        bundle_bytes = bundle_experts * sizes.max_expert_bytes
        bundle_flops = 2 * sizes.expert_params * bundle_experts * n * top_k / n_exp
        rows.append({
            "tokens": n, "tokens_per_expert": round(n * top_k / n_exp, 2), "tflops": round(F(n) / 1e12, 4),
            "t_ssd_s": t_ssd, "t_compute_s": t_lin, "t_compute_with_attention_s": t_att,
            "attention_share": att["total"] / per_token, "attention_growing_share": att["growing"] / per_token,
            "stages_s": stages, "bottleneck": bottleneck, "seconds": wall, "tokens_per_s": n / wall,
            "ssd_hidden": t_c >= t_ssd, "bundle_read_s": bundle_bytes / bw,
            "bundle_compute_s": bundle_flops / (F(n) / gpus),
        })
    # the same on a fine grid between the planned lengths (for the plot): N, tokens/s, compute-only tokens/s
    lo, hi = contexts[0], contexts[-1]
    grid = sorted({int(round(lo * (hi / lo) ** (i / 96))) for i in range(97)}) if hi > lo else [lo]
    curve = []
    for n in grid:
        t_c = compute_seconds(n, with_attention)
        curve.append([n, n / max(max(stages_fixed.values()), t_c), n / t_c])
    n_star = {"optimistic": _break_even(W, bw, per_token, F, tflops is not None),
              "conservative": _break_even(W, bw, routed, F, tflops is not None)}
    vram = [vram_budget(sizes, n, config, stream=stream, bundle_experts=bundle_experts, queue_depth=queue_depth,
                        activation_bytes=activation_bytes, kv_dtype=kv_dtype) for n in contexts]
    verdict = None
    if vram_gib is not None:
        budget = vram_gib * GIB
        fits = [v["tokens"] for v in vram if v["total_bytes"] <= budget]
        verdict = {"vram_gib": vram_gib, "fits_up_to_tokens": max(fits) if fits else None,
                   "fits": {str(v["tokens"]): v["total_bytes"] <= budget for v in vram},
                   "headroom_bytes_at_max": int(budget - vram[-1]["total_bytes"])}
    host_traffic_gbps = 2 * bw / GB  # every streamed byte is written into RAM once and read out once
    decode = decode_estimate(sizes, per_token, bw, F(1 / max(top_k / n_exp, 1e-9)))
    result = {
        "model": sizes.as_dict(stream),
        "flops": fl,
        "settings": {
            "stream": stream, "gpus": gpus, "ssds": ssds, "ssd_gbps_each": ssd_gbps.value,
            "ssd_source": ssd_gbps.source, "bandwidth_gbps": bw / GB,
            "tflops_each": tflops.value if tflops is not None else None,
            "compute_source": tflops.source if tflops is not None else compute_source,
            "compute_curve": ({"tokens_per_expert": compute_curve.t, "flops": compute_curve.f}
                              if compute_curve is not None else None),
            "mem_gbps": mem_gbps.value if mem_gbps else None, "mem_source": mem_gbps.source if mem_gbps else None,
            "pcie_gbps": pcie_gbps.value if pcie_gbps else None,
            "pcie_source": pcie_gbps.source if pcie_gbps else None,
            "with_attention": with_attention, "bundle_experts": bundle_experts, "queue_depth": queue_depth,
            "activation_bytes": activation_bytes, "kv_dtype": kv_dtype,
        },
        "W_bytes": W, "resident_bytes": sizes.resident_bytes(stream),
        "t_ssd_s": t_ssd, "n_star": n_star, "rows": rows, "curve": curve, "vram": vram, "vram_verdict": verdict,
        "decode": decode,
        "host_memory": {"traffic_gbps": host_traffic_gbps,
                        "copy_gbps": mem_gbps.value if mem_gbps else None,
                        "share": (bw / GB / mem_gbps.value) if mem_gbps and mem_gbps.value else None},
    }
    return result


def decode_estimate(sizes: ModelSizes, flop_per_token: float, bw: float, flops: float) -> dict:
    """Token-major decode with no expert cache: every token reads its top-k experts of every layer (the rest stays
    resident), so a token takes max(routed bytes per token / BW, FLOPs per token / F). A cache that hits a
    fraction h of the experts reads (1 - h) of those bytes."""
    routed = sum(layer.experts_bytes / max(layer.n_experts, 1) * sizes.top_k for layer in sizes.layers)
    t_read, t_compute = routed / bw, flop_per_token / flops
    return {"routed_bytes_per_token": int(routed), "t_read_s": t_read, "t_compute_s": t_compute,
            "tokens_per_s_no_cache": 1 / max(t_read, t_compute),
            "bound": "ssd" if t_read >= t_compute else "compute"}


def _break_even(W: float, bw: float, flop_per_token: float, F, constant: bool) -> float | None:
    """N* with T_compute(N*) = T_SSD: F x W / (FLOP/token x BW) for a constant F; solved numerically when F depends
    on N (a measured curve). None when the compute never catches up within 2^30 tokens."""
    t_ssd = W / bw
    if constant:
        return F(1) * W / (flop_per_token * bw)

    def gap(n):
        return flop_per_token * n / F(n) - t_ssd

    lo, hi = 1.0, 2.0
    if gap(lo) >= 0:
        return lo
    while gap(hi) < 0:
        lo, hi = hi, hi * 2
        if hi > 2 ** 30:
            return None
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gap(mid) < 0 else (lo, mid)
    return hi


# ---------------------------------------------------------------------------------------------------------------
# Text and plot
# ---------------------------------------------------------------------------------------------------------------


def _gb(n: float) -> str:
    return f"{n / GB:.3g} GB" if n >= 1e8 else f"{n / 1e6:.3g} MB"


def _secs(s: float) -> str:
    return f"{s:.3g} s" if s >= 0.1 else f"{s * 1000:.3g} ms"


def format_plan(p: dict) -> str:
    m, s, fl = p["model"], p["settings"], p["flops"]
    lines = []
    src = m["path"] or m["source"]
    lines.append(f"{src}: {m['policy']} policy, {len(m['layers']) and sum(g['count'] for g in m['layers'])} layers, "
                 f"{m['n_experts']} experts/layer (top-{m['top_k']}), experts {m['expert_bpw']} bits/weight")
    for note in m.get("notes", []):
        lines.append(f"  note: {note}")
    lines.append(f"  W (streamed, {s['stream']}) {_gb(p['W_bytes'])}: routed experts {_gb(m['routed_bytes'])}, "
                 f"non-routed {_gb(m['non_routed_bytes'])} ({'streamed' if s['stream'] == 'all' else 'resident'})"
                 f"; resident {_gb(p['resident_bytes'])}; file {_gb(m['file_bytes'])}")
    lines.append("  per layer:")
    for g in m["layers"]:
        lines.append(f"    layers {g['layers']:<10} ({g['count']:2d}) {g['attention']:>7} {g['routing']:>4}: dense "
                     f"{_gb(g['dense_bytes'])}, experts {g['n_experts']} x {_gb(g['expert_bytes'])} = "
                     f"{_gb(g['experts_bytes'])}")
    lines.append(f"  FLOPs/token: {fl['total'] / 1e9:.4g} GFLOP total (2 x {fl['active_params'] / 1e9:.4g}B active), "
                 f"routed {fl['routed'] / 1e9:.4g} GFLOP; head {fl['head'] / 1e9:.3g} GFLOP once per prefill")
    bw_what = f"{s['ssd_gbps_each']:g} GB/s x {s['ssds']} SSD" + ("s" if s["ssds"] > 1 else "")
    if s["tflops_each"] is not None:
        f_what = f"{s['tflops_each']:g} TFLOPS x {s['gpus']}"
    else:
        f_what = f"measured curve x {s['gpus']}"
    lines.append(f"  BW = {bw_what} ({s['ssd_source']}); F = {f_what} ({s['compute_source']})")
    if s["mem_gbps"]:
        h = p["host_memory"]
        lines.append(f"  host memory: {s['mem_gbps']:.3g} GB/s copy ({s['mem_source']}); streaming moves "
                     f"{h['traffic_gbps']:.3g} GB/s through RAM (write + read), {100 * h['share']:.0f}% of it")
    if s["pcie_gbps"]:
        lines.append(f"  PCIe host->device: {s['pcie_gbps']:.3g} GB/s x {s['gpus']} ({s['pcie_source']})")
    lines.append(f"T_SSD = W / BW = {_secs(p['t_ssd_s'])}")
    ns = p["n_star"]
    lines.append("N* = F x W / (FLOP/token x BW): optimistic (all FLOPs) "
                 f"{_fmt_nstar(ns['optimistic'])}, conservative (routed FLOPs) {_fmt_nstar(ns['conservative'])}")
    att = "incl. attention" if s["with_attention"] else "weights only"
    lines.append(f"{'N':>6} {'tok/exp':>8} {'T_SSD':>9} {'T_compute':>10} {'+attn':>6} {'bound':>11} {'time':>9} "
                 f"{'tokens/s':>9}   (T_compute: {att})")
    for r in p["rows"]:
        lines.append(f"{fmt_tokens(r['tokens']):>6} {r['tokens_per_expert']:>8.4g} {_secs(r['t_ssd_s']):>9} "
                     f"{_secs(r['stages_s']['compute']):>10} {100 * r['attention_share']:>5.0f}% {r['bottleneck']:>11} "
                     f"{_secs(r['seconds']):>9} {r['tokens_per_s']:>9.4g}")
    d = p["decode"]
    lines.append(f"decode (no expert cache): {_gb(d['routed_bytes_per_token'])} of routed experts read per token, "
                 f"{_secs(d['t_read_s'])} read + {_secs(d['t_compute_s'])} compute: {d['tokens_per_s_no_cache']:.3g} "
                 f"tokens/s ({d['bound']}-bound; a cache hitting h of the experts reads (1 - h) of it)")
    v = p["vram"][-1]
    lines.append(f"VRAM per device at {fmt_tokens(v['tokens'])} tokens:")
    for row in v["rows"]:
        lines.append(f"  {row['item']:<62} {row['bytes'] / GB:8.3f} GB")
    lines.append(f"  {'total (+ runtime workspace)':<62} {v['total_bytes'] / GB:8.3f} GB")
    verdict = p.get("vram_verdict")
    if verdict:
        fit = verdict["fits_up_to_tokens"]
        lines.append(f"  verdict for {verdict['vram_gib']:g} GiB: " + (
            f"fits up to {fmt_tokens(fit)} tokens" if fit else "does not fit at any planned length") +
            (f" (over by {-verdict['headroom_bytes_at_max'] / GB:.2f} GB at {fmt_tokens(v['tokens'])})"
             if verdict["headroom_bytes_at_max"] < 0 else
             f" ({verdict['headroom_bytes_at_max'] / GB:.2f} GB left at {fmt_tokens(v['tokens'])})"))
    return "\n".join(lines)


def _fmt_nstar(n: float | None) -> str:
    if n is None:
        return "never (compute stays faster than the SSD)"
    if n <= 1:
        return "any N (the compute is slower than the reads from the first token on)"
    return f"{n:,.0f} tokens ({n / 1000:.1f}K)" if n >= 1000 else f"{n:,.0f} tokens"


def plot_plan(p: dict, out_path: str) -> str:
    """tokens/s versus N: the plan's curve, the SSD-bound line N / T_SSD, the compute ceiling, and N* marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MoepackError("--plot needs matplotlib (pip install 'moepack[plot]' or pip install matplotlib)") from None
    rows, curve = p["rows"], p["curve"]
    lo, hi = rows[0]["tokens"], rows[-1]["tokens"]
    t_ssd = p["t_ssd_s"]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ns = [c[0] for c in curve]
    ax.plot(ns, [c[1] for c in curve], "-", color="C0", label="plan: N / max(stages)")
    ax.plot([r["tokens"] for r in rows], [r["tokens_per_s"] for r in rows], "o", color="C0")
    ax.plot(ns, [n / t_ssd for n in ns], "--", color="gray", label=f"SSD bound N / T_SSD (T_SSD = {t_ssd:.3g} s)")
    ax.plot(ns, [c[2] for c in curve], ":", color="C1", label="compute bound N / T_compute")
    for key, style in (("optimistic", "-"), ("conservative", "-.")):
        n = p["n_star"][key]
        if n is not None and lo / 4 <= n <= hi * 4:
            ax.axvline(n, color="C3", linestyle=style, alpha=0.7, label=f"N* {key} = {n / 1000:.1f}K")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens N")
    ax.set_ylabel("prefill tokens/s")
    s = p["settings"]
    f_what = f"{s['tflops_each']:g} TFLOPS" if s["tflops_each"] is not None else "measured F"
    ax.set_title(f"{p['model']['policy']}: W {p['W_bytes'] / GB:.3g} GB, {s['bandwidth_gbps']:g} GB/s, "
                 f"{f_what} x {s['gpus']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    import io

    from moepack.format_spec.writer import write_file_atomically

    image = io.BytesIO()
    try:
        fig.savefig(image, format=os.path.splitext(out_path)[1].lstrip(".").lower() or "png")
        write_file_atomically(out_path, image.getvalue())  # a plot already there goes only for a complete one
    except (OSError, ValueError) as e:
        raise MoepackError(f"cannot write {out_path}: {e}") from None
    finally:
        plt.close(fig)
    return out_path


MAX_CONFIG_BYTES = 16 << 20  # a config.json takes kilobytes


def load_config(path: str) -> dict:
    """A config.json (or a directory holding one)."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        config = untrusted.load_file(path, max_bytes=MAX_CONFIG_BYTES)
    except OSError as e:
        raise MoepackError(f"{path}: not a readable config.json ({error_reason(e)})") from None
    if not isinstance(config, dict):
        raise MoepackError(f"{path}: a config.json holds a JSON object")
    return config
