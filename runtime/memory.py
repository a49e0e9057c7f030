"""How much memory a run needs, prefill and decode alike: every estimate that refuses a prompt or a generation
before any work, and the figures a default expert cache is fitted to, computed here and nowhere else.

- the prefill's working set at its peak (`estimate_working_set`, `check_prefill_memory`: StreamingPrefill.check_memory,
  per pass, on the host or the device it computes on);
- a generation's resident weights, expert cache and KV (`memory_need` / `check_memory` on the host,
  `device_memory_need` / `check_device_memory` on a GPU: Generator's checks, BatchScheduler's admissions; a GPU's
  KV, `device_kv`, with what the decode's arena may still grow by for every sequence decoding);
- the expert cache's default budget (`default_cache_bytes`), within what those checks leave.

What this process may use comes from runtime/io.py (available_memory_bytes: RAM, cgroup, RLIMIT_AS) and
`cuda_free_bytes` (the device's, within the process's cap).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from moepack.families import container_family
from moepack.families.base import LayerDecode, LayerPrefill
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.layout import SCALE_SUFFIXES
from moepack.format_spec.reader import Container
from moepack.format_spec.source_formats import fp8_decoder_compiled

from .expert_decode import expert_weight_count
from .io import available_memory_bytes, memory_limit_bytes
from .read_scheduler import global_regions

GIB = 1 << 30
HEADROOM_BYTES = 1 << 30  # activations, the read buffers, the interpreter and torch beside the weights and the KV
# the query chunk the memory estimate assumes where --query-chunk does not bound it (at least the device's own)
ESTIMATE_QUERY_CHUNK = 512


def cuda_free_bytes(device: torch.device) -> int:
    """What this process may still allocate on `device`: the device's free memory within the process's cap
    (torch.cuda.set_per_process_memory_fraction, a budget smaller than the device), plus the blocks torch has
    cached but not handed out."""
    free, total = torch.cuda.mem_get_info(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.6
    budget = int((fraction(device) if fraction else 1.0) * total)
    reserved = torch.cuda.memory_reserved(device)
    return min(free, max(budget - reserved, 0)) + reserved - torch.cuda.memory_allocated(device)


def estimate_working_set(family: LayerPrefill, n_tokens: int, query_chunk: int | None, dense_bytes: int,
                         bundle_bytes: int, pool_buffers: int, expert_params: int,
                         expert_threads: int = 1, globals_bytes: int = 0, decode_scratch_bytes: int = 0,
                         grouped_pairs: int = 0, decoded_experts: int | None = None,
                         device_chunk: int = ESTIMATE_QUERY_CHUNK, device: torch.device | None = None
                         ) -> dict[str, int]:
    """Bytes a prefill of n_tokens needs at its peak (float32 compute), by component: the family's activations,
    KV and attention (`family.working_set`), the routed experts' rows and the weights. Deliberately generous:
    it decides whether to refuse a prompt before any work is done. `expert_threads`: threads that each gather
    an expert's rows (the per-expert backend); `decoded_experts`: experts decoded at once (default: one per expert
    thread); `grouped_pairs`: the grouped backend's (token, expert) pairs; `device_chunk`: the attention's query
    chunk where `query_chunk` does not bound it; `device`: where it runs (None: the family's reference arithmetic)."""
    f32 = 4
    chunk = min(query_chunk or device_chunk, n_tokens)
    hidden, inner = family.shape.hidden_size, family.shape.expert_intermediate
    parts = dict(family.working_set(n_tokens, chunk, device))
    # the routed experts: the FFN input in their dtype and the float32 sum (expert_runner.OrderedSum), and on each
    # expert thread one expert's gathered rows and outputs (at most every token's), or outputs waiting their turn
    parts["activations"] += n_tokens * hidden * f32 * (2 + 2 * expert_threads)
    # the grouped backend: every pair's input and output rows ([P, H] each, P = N x top_k), and a read's gate and up
    # outputs and activation (at most every pair's)
    parts["activations"] += grouped_pairs * f32 * (2 * hidden + 3 * inner)
    # the read pool, and each expert thread's decoded weights
    # `globals_bytes`: the LM head's bytes, read during the last layer, and a decoded slice of it;
    # `decode_scratch_bytes`: what decoding the largest dense matrix needs besides its bytes and its output
    decoded_experts = expert_threads if decoded_experts is None else decoded_experts
    parts["weights"] = (dense_bytes * 5 + bundle_bytes * (pool_buffers + 2) + expert_params * f32 * 2 * decoded_experts
                        + globals_bytes + decode_scratch_bytes)
    parts["total"] = sum(parts.values())
    return parts


def check_prefill_memory(container: Container, family: LayerPrefill, device: torch.device, n_tokens: int, *,
                         query_chunk: int | None, bundle_bytes: int, pool_buffers: int, expert_threads: int,
                         decoded_experts: int, grouped: bool, head_chunk_bytes: int,
                         scoring_bytes: int = 0, freeable_bytes: int = 0) -> None:
    """Refuse a prompt (or prompts prefilled together: n_tokens is all of theirs) whose working set
    (estimate_working_set, with the container's largest regions and the prefill's pool and expert threads: a
    `grouped` expert backend's pairs, `head_chunk_bytes` of the LM head decoded at once; `scoring_bytes` what
    scoring its positions holds, prompt_logprobs) cannot fit in what `device` has, before reading or computing
    anything. `freeable_bytes`: host memory this process would give back first (a prompt cache's entries), counted
    as available."""
    layers = container.layers
    expert_params = max((sum(t.numel for t in r.tensors if not t.name.endswith(SCALE_SUFFIXES))
                         for b in layers for r in b.experts), default=0)
    # FP8 decoded by torch's ops (on a GPU; on a CPU without the compiled decoder): an int32 index per weight
    torch_fp8 = device.type == "cuda" or not fp8_decoder_compiled()
    fp8_weights = max((t.numel for b in layers for t in b.dense.tensors if t.dtype == "F8_E4M3"),
                      default=0) if torch_fp8 else 0
    names = family.names
    head_bytes = sum(r.length for r in global_regions(container, (*names.head_globals, names.head)))
    need = estimate_working_set(family, n_tokens, query_chunk, max(b.dense.length for b in layers),
                                bundle_bytes, pool_buffers, expert_params, expert_threads,
                                head_bytes + head_chunk_bytes,
                                decode_scratch_bytes=4 * fp8_weights,
                                grouped_pairs=n_tokens * family.shape.top_k if grouped else 0,
                                decoded_experts=decoded_experts,
                                device_chunk=max(ESTIMATE_QUERY_CHUNK, family.preferred_query_chunk(device)),
                                device=device)
    if scoring_bytes:  # (a part of its own: the refusal says what scoring the prompt costs)
        need["prompt_logprobs"] = scoring_bytes
        need["total"] += scoring_bytes
    if device.type == "cuda":
        free, where = cuda_free_bytes(device), "free device memory"
    else:
        free, where = available_memory_bytes(), "available host memory"
        if free:  # (0: not known, no check) what the caller would give back first is room too
            free += freeable_bytes
    if free and need["total"] > free:
        detail = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in need.items() if k != "total")
        raise MoepackError(f"a prompt of {n_tokens} tokens needs about {need['total'] / 2**30:.1f} GiB "
                           f"({detail}) but only {free / 2**30:.1f} GiB of {where} is there: shorten the "
                           f"prompt{', score fewer of its tokens' if scoring_bytes else ''} or lower --query-chunk")


def container_kv_bytes(container: Container, n_tokens: int) -> int:
    """The KV of n_tokens a generation holds (float32, every layer): its family's KV format's count."""
    return container_family(container).kv_format.kv_bytes(container.config, n_tokens, "F32")


def others_kv(container: Container, others: Sequence[int]) -> int:
    """The KV of sequences of `others` tokens each (container_kv_bytes of each): what the host's checks count
    beside a generation."""
    return sum(container_kv_bytes(container, n) for n in others)


class DeviceKV(NamedTuple):
    """A GPU generation's KV beside the sequences decoding with it (device_kv): `states` their prefills' states
    (container_kv_bytes of each, counted whole, as if none were allocated yet: the device holds a prefill's until
    the decode takes it in), `arena` what the decode's arena may still grow by for all of them."""
    states: int = 0
    arena: int = 0


def device_kv(container: Container, device: torch.device, n_tokens: int, others: Sequence[int] = (),
              decode: LayerDecode | None = None) -> DeviceKV:
    """The device's KV for a generation of n_tokens beside sequences of `others` tokens each (prompt and new tokens:
    those decoding and prefilling beside it), where `decode` (the decoder's LayerDecode) may keep them in device
    tensors of its own (its device_kv_growth: the arena, sized for all of them at once, with its slots doubled and
    its pools' headroom) besides their prefills' states."""
    lengths = [n for n in (n_tokens, *others) if n]
    grows = getattr(decode, "device_kv_growth", None)
    return DeviceKV(others_kv(container, lengths), grows(lengths, device) if grows is not None and lengths else 0)


def resident_bytes(container: Container) -> int:
    """What decode keeps resident besides the cache and the KV: the dense regions and the globals, as float32
    (an upper bound: the low-precision matrices may be bf16)."""
    stored = sum(b.dense.length for b in container.layers) + sum(r.length for r in container.global_regions)
    params = sum(t.numel for b in container.layers for t in b.dense.tensors)
    params += sum(t.numel for r in container.global_regions for t in r.tensors)
    return max(stored, 4 * params)


def memory_need(container: Container, n_tokens: int, cache_bytes: int, other_kv: int = 0) -> int:
    """The host memory a CPU generation of n_tokens needs: resident weights + cache + KV + HEADROOM_BYTES
    (+ `other_kv`: the KV of the sequences decoding beside it)."""
    return (resident_bytes(container) + cache_bytes + container_kv_bytes(container, n_tokens) + other_kv
            + HEADROOM_BYTES)


def device_memory_need(container: Container, cache_bytes: int, kv: DeviceKV = DeviceKV(), resident: bool = True
                       ) -> int:
    """The device memory a GPU generation needs: resident weights (unless loaded already) + the cache still to fill
    + its KV and that of the sequences decoding beside it (device_kv) + HEADROOM_BYTES."""
    weights = resident_bytes(container) if resident else 0
    return weights + cache_bytes + sum(kv) + HEADROOM_BYTES


def memory_for_generation(held: int = 0) -> int:
    """available_memory_bytes, counting as this process's own the `held` bytes it holds already of a generation's
    need (its resident weights and expert cache): MemAvailable no longer counts them, a cgroup's limit and
    RLIMIT_AS do. 0 where nothing is known."""
    free = available_memory_bytes()
    if not free or not held:
        return free
    limit = memory_limit_bytes()
    return min(free + held, limit) if limit else free + held


def check_memory(container: Container, n_tokens: int, cache_bytes: int, held: int = 0, other_kv: int = 0) -> int:
    """Refuse, before any work, a generation whose resident weights + cache + KV (+ `other_kv`: that of the
    sequences decoding beside it) + HEADROOM_BYTES cannot fit in memory_for_generation(held); returns that bound."""
    need = memory_need(container, n_tokens, cache_bytes, other_kv)
    free = memory_for_generation(held)
    if free and need > free:
        kv = container_kv_bytes(container, n_tokens) + other_kv
        beside = f" beside the KV of the sequences decoding ({other_kv / GIB:.2f} GiB)" if other_kv else ""
        raise MoepackError(f"generating {n_tokens} tokens{beside} needs about {need / GIB:.1f} GiB (weights besides "
                           f"the experts {resident_bytes(container) / GIB:.2f}, expert cache {cache_bytes / GIB:.2f}, "
                           f"KV {kv / GIB:.2f}, headroom 1) but only {free / GIB:.1f} GiB of memory is available: "
                           f"lower --cache-gib or --max-new-tokens")
    return need


def check_device_memory(container: Container, device: torch.device, cache_bytes: int, kv: DeviceKV = DeviceKV(),
                        resident: bool = True) -> None:
    """Refuse, before any work, a GPU generation whose resident weights (unless `resident` is False: loaded
    already) + expert cache still to fill + KV (device_kv: its own and the sequences' decoding beside it, their
    prefills' states and the decode arena's growth) + HEADROOM_BYTES exceed what this process may allocate on the
    device, where all of them live."""
    need = device_memory_need(container, cache_bytes, kv, resident)
    free = cuda_free_bytes(device)
    if need > free:  # the parts of `need`, for the message
        weights = resident_bytes(container) if resident else 0
        raise MoepackError(f"the decode on {device} needs about {need / GIB:.1f} GiB of device memory (weights "
                           f"besides the experts {weights / GIB:.2f}, expert cache {cache_bytes / GIB:.2f}, "
                           f"KV {kv.states / GIB:.2f}, decode KV arena {kv.arena / GIB:.2f}, headroom 1) but only "
                           f"{free / GIB:.1f} GiB is free there: lower --cache-gib or --max-new-tokens")


def cache_room(container: Container, device: torch.device, n_tokens: int, others: Sequence[int], held: int,
               default_budget: int, decode: LayerDecode | None = None, host_copies: int = 0) -> int:
    """The default expert cache's budget for a generation of n_tokens: what check_memory / check_device_memory
    leave beside its KV and that of the sequences of `others` tokens decoding beside it (on a GPU, device_kv's, with
    `decode`'s arena), clamped at 0, at most `default_budget`. `held`: what this process holds already of that
    memory (a GPU's: its cache; a CPU's: the resident weights, the cache and the `host_copies` bytes of states kept
    on the host, a prompt cache's)."""
    if device.type == "cuda":
        need = device_memory_need(container, 0, device_kv(container, device, n_tokens, others, decode), False)
        room = held + cuda_free_bytes(device) - need
    else:
        free = memory_for_generation(held)
        room = (free - memory_need(container, n_tokens, 0, others_kv(container, others) + host_copies) if free
                else default_budget)
    return max(0, min(default_budget, room))


def default_cache_bytes(container: Container, device: torch.device) -> int:
    """The expert cache's default budget: all the routed experts, within a quarter of the memory this process may
    use (available_memory_bytes: cgroup and rlimit included) and within what is left of it beside the resident
    weights, a token's KV and the headroom (the figures the memory check refuses by, so the default runs wherever
    --cache-gib 0 runs; clamped at 0). On a GPU, whose cache keeps experts decoded (at most float32: 8x an FP4
    expert's stored bytes), all of them within half of what the device has free and what is left there beside the
    resident weights and the headroom."""
    if device.type != "cpu":
        decoded = 4 * sum(expert_weight_count(r) for b in container.layers for r in b.experts)
        free = cuda_free_bytes(device)
        return max(0, min(decoded, free // 2, free - device_memory_need(container, 0)))
    routed = sum(r.length for b in container.layers for r in b.experts)
    free = available_memory_bytes()
    if not free:
        return routed
    return max(0, min(routed, free // 4, free - memory_need(container, 1, 0)))
