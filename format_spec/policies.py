"""Named precision policies: which storage type each kind of tensor gets when a checkpoint is converted.

A policy maps a tensor's *role* to a storage type name of dtypes.py, or to None (keep the source's own type
and bytes). Roles:

    routed_gate_up   routed experts' gate (w1) and up (w3) projections
    routed_down      routed experts' down projection (w2)
    dense_linear     every other linear: attention (q/kv/o, low-rank parts), shared expert, indexer, compressor
    embedding_head   token embedding and output head
    exact            norms, router weight and bias, mHC, attention sinks, ape, tid2eid hash table, biases

The policy's name and table are recorded in the container index (``policy(name)`` is JSON-ready).

Bits per weight of the routed experts (where nearly all of a MoE's bytes are) and of the dense linears:

    policy   experts                         bpw      dense / head       bpw
    keep     as the source (FP4 + E8M0)      4.25     as the source (FP8 + 128x128 scales) ~8.0
    bf16     BF16 (lossless from FP8/FP4)    16       BF16               16
    fp4      MXFP4 (lossless from FP4)       4.25     Q8_0               8.5
    nvfp4    NVFP4 (+ a tensor scale each)   4.5      Q8_0               8.5
    q8       Q8_0                            8.5      Q8_0               8.5
    q2       gate/up IQ2_XXS, down Q2_K      2.25     Q8_0               8.5
             (2 x 2.0625 + 2.625) / 3

An NVFP4 weight is stored with a power-of-two tensor scale (SPEC.md section 6.1, quants.nvfp4_prescale): ggml's
NVFP4 block has none, and without it weights of std <= 0.001 would quantize to zero.
"""

from __future__ import annotations

import copy

from .dtypes import STORAGE_TYPES
from .errors import MoepackError

ROLES = ("routed_gate_up", "routed_down", "dense_linear", "embedding_head", "exact")

_POLICIES = {
    "keep": {
        "description": "no conversion: every tensor keeps its source type and bytes (lossless)",
        "roles": {r: None for r in ROLES},
        "expert_bpw": None, "dense_bpw": None, "lossless": True,
    },
    "bf16": {
        "description": "reference: FP8 and FP4 weights widened to BF16 (lossless), everything else kept",
        "roles": {"routed_gate_up": "BF16", "routed_down": "BF16", "dense_linear": "BF16",
                  "embedding_head": "BF16", "exact": None},
        "expert_bpw": 16.0, "dense_bpw": 16.0, "lossless": True,
    },
    "fp4": {
        "description": "routed experts MXFP4 (lossless from an FP4 source), other linears Q8_0, exact tensors kept",
        "roles": {"routed_gate_up": "MXFP4", "routed_down": "MXFP4", "dense_linear": "Q8_0",
                  "embedding_head": "Q8_0", "exact": None},
        "expert_bpw": 4.25, "dense_bpw": 8.5, "lossless": False,
    },
    "nvfp4": {
        "description": "routed experts NVFP4 (ggml layout) with a power-of-two tensor scale each, other linears "
                       "Q8_0, exact tensors kept",
        "roles": {"routed_gate_up": "NVFP4", "routed_down": "NVFP4", "dense_linear": "Q8_0",
                  "embedding_head": "Q8_0", "exact": None},
        "expert_bpw": 4.5, "dense_bpw": 8.5, "lossless": False,
    },
    "q8": {
        "description": "all linears Q8_0, exact tensors kept",
        "roles": {"routed_gate_up": "Q8_0", "routed_down": "Q8_0", "dense_linear": "Q8_0",
                  "embedding_head": "Q8_0", "exact": None},
        "expert_bpw": 8.5, "dense_bpw": 8.5, "lossless": False,
    },
    "q2": {
        "description": "routed gate/up IQ2_XXS and down Q2_K (~2.25 bpw on experts), other linears Q8_0",
        "roles": {"routed_gate_up": "IQ2_XXS", "routed_down": "Q2_K", "dense_linear": "Q8_0",
                  "embedding_head": "Q8_0", "exact": None},
        "expert_bpw": 2.25, "dense_bpw": 8.5, "lossless": False,
    },
}

POLICY_NAMES = tuple(_POLICIES)


def policy(name: str) -> dict:
    """The policy's table as a JSON-ready dict: name, description, roles {role: type or None}, bpw figures."""
    if name not in _POLICIES:
        raise MoepackError(f"unknown precision policy {name!r} (expected one of {', '.join(POLICY_NAMES)})")
    out = copy.deepcopy(_POLICIES[name])
    out["name"] = name
    return out


def target_type(policy_name: str, role: str, source_type: str, shape=None) -> str | None:
    """Storage type a tensor of this role gets under the policy, or None to keep the source as it is.

    None also when the source already has the target type, when `bf16` would not be exact for the source,
    and (with `shape` given) when the last dimension isn't a multiple of the target's block: then Q8_0 is used
    if its 32-element block fits, else the tensor is kept.
    """
    p = policy(policy_name)
    if role not in ROLES:
        raise MoepackError(f"unknown tensor role {role!r} (expected one of {', '.join(ROLES)})")
    if source_type not in STORAGE_TYPES:
        raise MoepackError(f"unknown source storage type {source_type!r}")
    target = p["roles"][role]
    if target is None or target == source_type:
        return None
    if target == "BF16" and source_type not in STORAGE_TYPES["BF16"].exact_from:  # `bf16` converts only exactly
        return None
    if shape is not None:
        shape = tuple(shape)
        last = shape[-1] if shape else 1
        if len(shape) < 2 and target != "BF16":
            return None  # 1-D tensors (biases, norms mislabelled) are never block-quantized
        if last % STORAGE_TYPES[target].block_elems:
            if target != "Q8_0" and last % STORAGE_TYPES["Q8_0"].block_elems == 0 and source_type != "Q8_0":
                return "Q8_0"
            return None
    return target
