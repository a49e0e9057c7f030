"""Stored FP4 experts for the stored FP4 kernel's tests (test_stored_gemv.py under Triton's interpreter,
test_stored_gemv_cuda.py on a GPU): byte stacks of FP4_E2M1 matrices with E8M0 scales as a stored pool's slots
hold them, their exact products by format_spec's decode, and a one-layer StoredExpertPool over such slots."""

from __future__ import annotations

import torch

from moepack.backends import stored_gemv
from moepack.format_spec.decode import decode_side_by_side, decode_tensor
from moepack.format_spec.source_formats import fp4_quantize
from moepack.runtime.device_decode import StoredExpertPool, _StoredMatrix

LEAD = 16  # bytes before the first matrix in a slot: offsets not at the slot's start


def stored_slots(shapes: list[tuple[int, int]], slots: int, seed: int = 0, device: str = "cpu"):
    """A byte stack [slots, bytes] on `device` whose every slot holds FP4 matrices of `shapes` (codes then scales,
    one after another from LEAD), with their Fp4Matrix; each scale byte moved by up to +-8 (no block at its amax's
    scale)."""
    g = torch.Generator().manual_seed(seed)
    matrices, at = [], LEAD
    for n, k in shapes:
        matrices.append(stored_gemv.Fp4Matrix(n, k, at, at + n * k // 2))
        at += n * k // 2 + n * k // 32
    stack = torch.zeros(slots, at + 7, dtype=torch.uint8, device=device)
    for slot in range(slots):
        for m in matrices:
            codes, scale = fp4_quantize(torch.randn(m.out_features, m.in_features, generator=g).to(device))
            stack[slot, m.codes_at:m.codes_at + m.codes_bytes] = codes.view(torch.uint8).reshape(-1)
            moved = torch.randint(-8, 9, (m.scales_bytes,), generator=g).to(device)
            stack[slot, m.scales_at:m.scales_at + m.scales_bytes] = (scale.view(torch.uint8).reshape(-1) + moved)
    return stack, matrices


def decoded_matmul(stack, slots, x, m: stored_gemv.Fp4Matrix) -> torch.Tensor:
    """Each pair's matrix decoded by format_spec (float32) times its x, in float64: the exact sums."""
    raw = stack[slots.long()]
    scale = decode_tensor("F8_E8M0", (len(slots), m.out_features, m.in_features // 32),
                          raw[:, m.scales_at:m.scales_at + m.scales_bytes])
    w = decode_side_by_side("FP4_E2M1", (m.out_features, m.in_features), raw[:, m.codes_at:m.codes_at + m.codes_bytes],
                            scale)
    return torch.bmm(w.double(), x.double()[:, :, None])[:, :, 0]


def stored_pool(hidden: int, inter: int, experts: int, seed: int = 0, device: str = "cpu") -> StoredExpertPool:
    """A one-layer stored pool on `device`, every expert's FP4 gate, up and down matrices in a slot of its own
    (the slots in a shuffled order)."""
    stack, matrices = stored_slots([(inter, hidden), (inter, hidden), (hidden, inter)], experts, seed, device)
    layout = {role: _StoredMatrix("FP4_E2M1", (m.out_features, m.in_features),
                                  (m.codes_at, m.codes_at + m.codes_bytes),
                                  ("F8_E8M0", (m.out_features, m.in_features // 32),
                                   (m.scales_at, m.scales_at + m.scales_bytes)), None)
              for role, m in zip(("gate", "up", "down"), matrices)}

    def swiglu(gate, up):
        return torch.nn.functional.silu(gate) * up
    pool = StoredExpertPool(None, [layout], [stack.shape[1]], experts, inter, hidden, torch.bfloat16,
                            torch.device(device), swiglu)
    pool._allocate(experts)
    pool.stacks[0][:, :stack.shape[1]] = stack
    pool.slot_of[0] = torch.randperm(experts, generator=torch.Generator().manual_seed(seed)).to(device)
    return pool


def routed_inputs(rows: int, hidden: int, experts: int, top_k: int, device: str = "cpu"):
    """x [rows, hidden] bf16, each row's top_k distinct experts and their routing weights, on `device`."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=g).bfloat16()
    chosen = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(rows)])
    return x.to(device), chosen.to(device), torch.rand(rows, top_k, generator=g).to(device)
