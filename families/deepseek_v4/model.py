"""DeepSeek-V4 forward, written for layer-major prefill.

All N prompt tokens go through layer L before layer L+1, so every weight is read once. A layer is split where
the engine needs to interleave disk reads:

    streams = embed(cfg, token_ids, embed_weight)                          # [N, hc_mult, H]
    for layer:
        streams, kv_state = attention_sublayer(cfg, layer, w, streams, positions, query_chunk)
        routing = moe_route(cfg, layer, w, streams, token_ids)
        groups = routing.groups()                                           # (token, expert) pairs by expert
        inputs, outputs = groups.gather(routing.x), empty [P, H]
        for expert, (a, b) in groups.spans.items():                        # ascending expert id, as bytes arrive
            outputs[a:b] = expert_forward(cfg, inputs[a:b], w1, w3, w2)
        streams = moe_finish(cfg, layer, w, streams, routing, groups.combine(outputs, N))
    logits = head(cfg, streams, w_globals)                                 # last position: [vocab]

`forward_resident` is exactly that loop with every weight in memory (the reference path).

Configuration. `ModelConfig` (moepack.families.deepseek_v4.config, the one reader of a config.json) says what to
compute.

Continuation. A prefill leaves one `LayerKVState` per layer (families/deepseek_v4/kv.py; written to disk by KVWriter,
see format_spec/KV.md). Passing a layer's state as `past` to `attention_sublayer` (with positions P..P+N-1) runs N
more tokens against it, layer-major like the first chunk: prefill(A) then continue(B) equals prefill(A + B).

Weights. Canonical names (moepack.families.deepseek_v4.names: the release's, no `model.` prefix), float32. `w` is one
layer's non-expert tensors keyed RELATIVE to the layer (`w["attn.wq_a.weight"]` for `layers.3.attn.wq_a.weight`;
`layer_weights()` builds it from a full mapping). `w_globals` holds `embed.weight`, `head.weight` (none where
`tie_word_embeddings`: the embedding is the head), `norm.weight`, `hc_head_{fn,base,scale}`. The
attention's KV norm is `attn.kv_norm.weight` in the release and `attn.norm.weight` in what transformers'
save_pretrained writes; both are accepted. Routed experts are `ffn.experts.E.{w1,w3,w2}.weight`
(gate [I,H], up [I,H], down [H,I]).

Numerics follow transformers' `DeepseekV4ForCausalLM` (the test oracle; nothing here imports transformers), not
the DeepSeek reference's FP8/FP4 fake-quantisation of the KV cache and indexer.

Memory. Everything per token is O(N x hidden); attention and the Lightning Indexer run over query chunks of at
most `query_chunk` queries, so the score tensors are O(chunk x keys): a chunk sees at most chunk+window-1
sliding keys, the HCA entries (N / rate), and index_topk gathered CSA entries per query. Results do not
depend on the chunk size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from moepack.backends.fused_scores import weighted_relu_scores
from moepack.backends.ops import (DeviceCompiled, clamped_swiglu, fused_rms_norm, grouped_projection, linear, linears,
                                  low_matmul, matmul, swiglu_ffn, widened_matmul)
from moepack.families.base import MoeShape, PrefillNames
from moepack.families.base import Routing as FamilyRouting
from moepack.families.base import check_finite
from moepack.families.deepseek_v4 import mhc_native
from moepack.families.deepseek_v4.config import CSA, HCA, SLIDING, ModelConfig, RopeConfig
from moepack.families.deepseek_v4.kv import CompressorState, LayerKVState
from moepack.families.deepseek_v4.names import EXPERT_NAMING


# ---------------------------------------------------------------------------------------------------------------
# Small pieces: norms, RoPE, mHC
# ---------------------------------------------------------------------------------------------------------------


# The low-precision compute path (engine: compute_dtype="bfloat16") keeps these matrices in bfloat16: the
# attention's projections (with its compressors and indexer) and the shared expert, most of a layer's dense
# multiply work. Norms, mHC, the router, the sinks and the head stay float32: they are small, and the residual
# streams and the choice of experts are where rounding would compound. The float32 matmuls that stay on a GPU's
# bf16 prefill (benchmarks/prefill_audit.py) are the mHC mixes, collapse and stream mixing, and the router: O(N x
# hidden x a few dozen), at the release's dimensions about 4 MFLOP a token a layer against the layer's ~600 MFLOP
# of bf16 matrix work, none growing with the prompt's length per token (TF32 there:
# engine.float32_matmuls_on_tensor_cores).
LOW_PRECISION_PREFIXES = ("attn.", "ffn.shared_experts.")


def is_low_precision_matrix(name: str, ndim: int) -> bool:
    """Whether the low-precision path stores layer tensor `name` (relative to the layer, `ndim` dimensions) in
    bfloat16."""
    return name.startswith(LOW_PRECISION_PREFIXES) and name.endswith(".weight") and ndim == 2


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    fused = fused_rms_norm(x, weight, eps)  # one kernel on CUDA
    if fused is not None:
        return fused
    # the mean square from the vector norm (one pass, no squared copy of x), the weight applied in place: on
    # V4-Flash's per-head query norm ([256, 64, 512] per chunk) 26 -> 16 ms
    inverse = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps).rsqrt_()
    out = x * inverse
    if weight is None:
        return out
    return out.mul_(weight) if weight.dtype == out.dtype else weight * out


@functools.lru_cache(maxsize=8)
def rope_rotation(rope: RopeConfig, start: int, count: int, step: int = 1,
                  device: torch.device | None = None) -> Tensor:
    """cos + i*sin [count, rope.dim/2] complex64 for the positions start, start + step, ...: the rotation of each
    channel pair. Cached (never written to): every layer of a prefill rotates the same positions."""
    return rows_rotation(rope, torch.arange(count, device=device) * step + start)


def rows_rotation(rope: RopeConfig, positions: Tensor) -> Tensor:
    """cos + i*sin [N, rope.dim/2] complex64 for the positions [N] (int64, on their device: a decode step's rows
    made inside a CUDA graph, the host not asked)."""
    angles = positions[:, None].float() * _inv_freq(rope, positions.device)
    return torch.complex(angles.cos() * rope.attention_factor, angles.sin() * rope.attention_factor)


ROTATION_BLOCK = 256  # decoded positions whose rotations are made together
_ROTATION_BLOCKS: dict[tuple, tuple[RopeConfig, Tensor]] = {}  # (id(rope), start, device) -> (rope, its block)


def token_rotation(rope: RopeConfig, position: int, device: torch.device | None = None) -> Tensor:
    """rope_rotation(rope, position, 1): a decoded token's rotation [1, rope.dim/2], sliced from its block of
    ROTATION_BLOCK positions (made once per block: the same values, not two cos / sin calls per token and rope;
    found by the rope's identity: hashing a RopeConfig per layer and token cost more than the slice)."""
    start = position - position % ROTATION_BLOCK
    key = (id(rope), start, device)
    known = _ROTATION_BLOCKS.get(key)
    if known is None or known[0] is not rope:
        if len(_ROTATION_BLOCKS) >= 64:
            _ROTATION_BLOCKS.clear()
        known = _ROTATION_BLOCKS[key] = (rope, rope_rotation(rope, start, ROTATION_BLOCK, 1, device))
    return known[1][position - start:position - start + 1]


@functools.cache
def _inv_freq(rope: RopeConfig, device: torch.device | None) -> Tensor:
    """On `device` once (a decode's compressor makes an entry's rotation every few tokens: a copy from the host
    each time would make it wait for the device)."""
    inv = rope.inv_freq()
    return inv if device is None else inv.to(device)


def apply_rope(x: Tensor, rotation: Tensor) -> Tensor:
    """x [N, ..., D] float32 with its trailing 2*rotation.shape[-1] channels rotated pairwise, (even, odd) as the
    complex number even + i*odd times rotation [N, D_rope/2]; heads are laid out [nope | rope]."""
    rope_dim = 2 * rotation.shape[-1]
    pairs = torch.view_as_complex(x[..., -rope_dim:].unflatten(-1, (-1, 2)))
    rotated = torch.view_as_real(pairs * rotation.view(rotation.shape[0], *([1] * (x.dim() - 2)), rotation.shape[-1]))
    return torch.cat([x[..., :-rope_dim], rotated.flatten(-2)], dim=-1)


def hc_pre(cfg: ModelConfig, fn: Tensor, base: Tensor, scale: Tensor, streams: Tensor):
    """Manifold-constrained hyper-connection, entry side. From the hc_mult residual streams [N, hc, H] derive, per
    token, `pre` (collapse the streams into the sublayer input), `post` (spread the sublayer output back over the
    streams) and `comb` (mix the streams; projected onto doubly-stochastic matrices by Sinkhorn-Knopp so the
    residual cannot blow up). Returns (collapsed [N, H], post [N, hc], comb [N, hc, hc])."""
    hc = cfg.hc_mult
    flat = streams.flatten(1)
    # the RMS norm's per-token factor applied to the few mixes rather than to the hc x H inputs; the mean square
    # from the vector norm (no [N, hc x H] temporary: 3x faster at N = 1024)
    mean_square = torch.linalg.vector_norm(flat, dim=-1, keepdim=True).square_().div_(flat.shape[1])
    mixes = matmul(flat, fn) * torch.rsqrt(mean_square + cfg.rms_norm_eps)
    args = (mixes, scale, base, hc, cfg.hc_sinkhorn_iters, cfg.hc_eps)
    # compiled where it can: a CPU's native call; a CUDA device's torch.compile for a decode step's rows (a
    # prefill's chunk pays its ops' launches once for many tokens, and would pay a compile at its first call)
    mix_weights = device_mix_weights if mixes.shape[0] <= COMPILED_MIX_ROWS else hc_mix_weights
    pre, post, comb = mhc_native.hc_mix_weights(*args, hc_mix_weights) or mix_weights(*args)
    collapsed = torch.bmm(pre.unsqueeze(1), streams).squeeze(1)
    return collapsed, post, comb


def hc_pre_norm(cfg: ModelConfig, fn: Tensor, base: Tensor, scale: Tensor, streams: Tensor, norm_weight: Tensor):
    """hc_pre, then the sublayer's RMS norm of the collapsed streams: (x [N, H], post [N, hc], comb [N, hc, hc]).
    One decoded token takes one compiled call (mhc_native.py) where it can."""
    if streams.shape[0] == 1:
        got = mhc_native.token_pre(streams, fn, scale, base, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps,
                                   cfg.rms_norm_eps, norm_weight, hc_mix_weights)
        if got is not None:
            return got
    collapsed, post, comb = hc_pre(cfg, fn, base, scale, streams)
    return rms_norm(collapsed, norm_weight, cfg.rms_norm_eps), post, comb


def hc_mix_weights(mixes: Tensor, scale: Tensor, base: Tensor, hc: int, sinkhorn_iters: int, eps: float
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """The mixes [N, (2 + hc) * hc] -> pre [N, hc], post [N, hc] and comb [N, hc, hc] (Sinkhorn-Knopp, rows
    then columns to sum 1). mhc_native.py computes the same in one compiled call on a CPU."""
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (hc, hc)) * scale[2] + comb_b.view(hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):  # in place: 2 x 19 passes over [N, hc, hc], no allocations
        comb.div_(comb.sum(dim=-1, keepdim=True).add_(eps))
        comb.div_(comb.sum(dim=-2, keepdim=True).add_(eps))
    return pre, post, comb


# On a CUDA device the mixes' ~120 small kernels (the Sinkhorn iterations' 114: each a launch, or a graph node of
# ~2 us, twice a layer and token) fused by torch.compile into a few, for up to COMPILED_MIX_ROWS rows
device_mix_weights = DeviceCompiled(hc_mix_weights)
COMPILED_MIX_ROWS = 64


def hc_post(streams: Tensor, out: Tensor, post: Tensor, comb: Tensor, into: Tensor | None = None) -> Tensor:
    """New streams: the old streams mixed by comb (stream j feeds stream k with weight comb[j, k], i.e.
    comb^T @ streams), plus the sublayer output spread by `post` (added in place: no [N, hc, H] temporary).
    `into`: a buffer of the streams' shape, not `streams` itself, to write them into (a caller alternating two
    buffers never allocates [N, hc, H] again). One decoded token takes one compiled call where it can."""
    if into is None and streams.shape[0] == 1:
        got = mhc_native.token_post(streams, out, post, comb, hc_mix_weights)
        if got is not None:
            return got
    return torch.bmm(comb.transpose(-1, -2), streams, out=into).addcmul_(post.unsqueeze(-1), out.unsqueeze(-2))


def embed(cfg: ModelConfig, token_ids: Tensor, embed_weight: Tensor) -> Tensor:
    """Token embeddings copied into hc_mult residual streams: [N, hc_mult, H] float32."""
    return residual_streams(cfg, embed_weight[token_ids])


def residual_streams(cfg: ModelConfig, embeddings: Tensor) -> Tensor:
    """The prompt's embeddings [N, H] copied into hc_mult residual streams: [N, hc_mult, H] float32."""
    return embeddings.float().unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()


# ---------------------------------------------------------------------------------------------------------------
# KV compression (CSA / HCA compressors, the indexer's compressor)
# ---------------------------------------------------------------------------------------------------------------


def _on(t: Tensor | None, like: Tensor) -> Tensor | None:
    return None if t is None else t.to(like)


def compress(kv: Tensor, gate: Tensor, ape: Tensor, norm_weight: Tensor, rate: int, overlapping: bool,
             rope: RopeConfig, eps: float, past: CompressorState | None = None) -> tuple[Tensor, CompressorState]:
    """Compress the projections kv, gate [N, width] of a prompt into one entry per full window of `rate` tokens.

    Entry i = RMSNorm(sum over slots of softmax_slots(gate + ape) * kv), RoPE'd at position i*rate; the softmax runs
    per channel over the window's slots. HCA (not overlapping): the window's `rate` tokens. CSA (overlapping): each
    token carries two series, Ca = [..., :d] and Cb = [..., d:]; entry i pools window i-1's Ca with window i's Cb
    (2*rate slots: width 2*rate, stride rate). Window 0 has no predecessor: those slots get weight 0.

    With `past` (a continuation), the new tokens follow past's buffered tokens: windows continue at entry
    past.entry_count, the first new CSA window pools with past's overlap (the last full window's Ca), and the
    returned entries are past's followed by the new ones; the state is the combined one.
    """
    first_entry = 0
    previous = None
    if past is not None:
        if past.buffer_kv.shape[0]:
            kv = torch.cat([past.buffer_kv.to(kv), kv])
            gate = torch.cat([past.buffer_gate.to(gate), gate])
        first_entry = past.entry_count
        previous = past.compressed_kv.to(kv)
    n_tokens, width = kv.shape
    out_width = width // 2 if overlapping else width
    n_entries = n_tokens // rate
    used = n_entries * rate
    windows_kv = kv[:used].view(n_entries, rate, width)
    windows_gate = gate[:used].view(n_entries, rate, width) + ape
    # State tensors are cloned so they do not keep the prompt-sized projections alive.
    state = CompressorState(compressed_kv=previous if previous is not None else kv.new_zeros(0, out_width),
                            buffer_kv=kv[used:].clone(), buffer_gate=gate[used:].clone(),
                            entry_count=first_entry + n_entries,
                            overlap_kv=_on(past.overlap_kv, kv) if past is not None else None,
                            overlap_gate=_on(past.overlap_gate, gate) if past is not None else None)
    if n_entries == 0:
        return state.compressed_kv, state

    if overlapping:
        d = out_width
        # the window before the first new one closed in an earlier call, or none
        first_kv, first_gate = _overlap(state.overlap_kv, state.overlap_gate, kv, gate, rate, d)
        # The last window's Ca is what the next (later) window pools with.
        state.overlap_kv, state.overlap_gate = windows_kv[-1, :, :d].clone(), windows_gate[-1, :, :d].clone()
        previous_kv = torch.cat([first_kv[None], windows_kv[:-1, :, :d]])
        previous_gate = torch.cat([first_gate[None], windows_gate[:-1, :, :d]])
        windows_kv, windows_gate = after_previous(windows_kv, windows_gate, previous_kv, previous_gate)

    # entry i sits at position i * rate
    entries = apply_rope(pooled_windows(windows_kv, windows_gate, norm_weight, eps),
                         rope_rotation(rope, first_entry * rate, n_entries, rate, kv.device))
    state.compressed_kv = torch.cat([previous, entries]) if previous is not None and previous.shape[0] else entries
    return state.compressed_kv, state


def _overlap(overlap_kv: Tensor | None, overlap_gate: Tensor | None, kv: Tensor, gate: Tensor, rate: int, d: int
             ) -> tuple[Tensor, Tensor]:
    """The Ca [rate, d] a CSA window pools with: the previous window's (overlap_kv, overlap_gate), or before the
    first window none (zero slots of gate -inf: no weight)."""
    if overlap_kv is not None:
        return overlap_kv, overlap_gate
    return kv.new_zeros(rate, d), gate.new_full((rate, d), float("-inf"))


def after_previous(windows_kv: Tensor, windows_gate: Tensor, previous_kv: Tensor, previous_gate: Tensor
                   ) -> tuple[Tensor, Tensor]:
    """CSA's windows [N, 2*rate, d]: each window's Cb (its slots' second half) after the Ca before it (previous_*
    [N, rate, d])."""
    d = previous_kv.shape[-1]
    return (torch.cat([previous_kv, windows_kv[..., d:]], dim=1),
            torch.cat([previous_gate, windows_gate[..., d:]], dim=1))


def pooled_windows(windows_kv: Tensor, windows_gate: Tensor, norm_weight: Tensor, eps: float) -> Tensor:
    """N compressed entries [N, d] before their RoPE, from N windows' slots [N, slots, d] and their gates (ape
    included): each window's slots summed by the softmax of their gates, RMS-normed."""
    pooled = (windows_kv * windows_gate.softmax(dim=1)).sum(dim=1)
    return rms_norm(pooled, norm_weight, eps)


# ---------------------------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------------------------


# Queries per attention chunk: a few sliding windows (each chunk scores chunk + window - 1 sliding keys, so a
# chunk much larger than the window spends most of its work on masked keys), at least MIN_QUERY_CHUNK
SLIDING_CHUNK_WINDOWS = 2
MIN_QUERY_CHUNK = 128
# On a GPU a chunk is a few dozen kernel launches whatever its size: larger chunks, fewer launches (the masked
# sliding keys cost the tensor cores less than the launches cost the host)
GPU_QUERY_CHUNK = 1024


# The device path's Lightning Indexer (bf16_device_path): its scores [C', T] float32 for at most
# INDEXER_SCORE_BYTES (C' of a chunk's queries at a time, however many entries T a long prompt has), each from
# blocks of keys whose bf16 products [C', heads, block] stay within INDEXER_BLOCK_BYTES (no [C, heads, T] tensor:
# at 128K, C = 1024, 64 heads and T = 32K it would be 4 GiB in bf16, 8 GiB in float32)
INDEXER_SCORE_BYTES = 256 << 20
INDEXER_BLOCK_BYTES = 256 << 20


def on_cuda(device: torch.device) -> bool:
    """Whether the forward takes a CUDA device's branches (the one test of it: a test on a CPU forces them here)."""
    return device.type == "cuda"


def bf16_device_path(device: torch.device, low: torch.dtype) -> bool:
    """Whether the attention runs the device's way: on a CUDA device with bfloat16 products, the indexer's scores
    from bf16 products in key blocks (no float32 product of every head and entry) and a chunk's compressed entries
    only those its last query can see. A CPU, or float32 products, keeps the reference arithmetic."""
    return on_cuda(device) and low == torch.bfloat16


def preferred_query_chunk(cfg: ModelConfig, device: torch.device) -> int:
    """Queries per attention chunk this device runs best (a smaller `query_chunk` bounds it further)."""
    if on_cuda(device):
        return GPU_QUERY_CHUNK
    return max(SLIDING_CHUNK_WINDOWS * cfg.sliding_window, MIN_QUERY_CHUNK)


def layer_weights(weights: Mapping[str, Tensor], layer: int) -> dict[str, Tensor]:
    """One layer's tensors from a full release-name mapping, keyed relative to the layer."""
    prefix = f"layers.{layer}."
    return {name[len(prefix):]: t for name, t in weights.items() if name.startswith(prefix)}


def kv_norm_weight(w: Mapping[str, Tensor]) -> Tensor:
    return w["attn.kv_norm.weight"] if "attn.kv_norm.weight" in w else w["attn.norm.weight"]


def attention_entry(cfg: ModelConfig, w: Mapping[str, Tensor], streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The attention's mHC entry and norm on every row: (its input [N, H], the mHC post and comb weights)."""
    return hc_pre_norm(cfg, w["hc_attn_fn"], w["hc_attn_base"], w["hc_attn_scale"], streams, w["attn_norm.weight"])


def attention_sublayer(cfg: ModelConfig, layer: int, w: Mapping[str, Tensor], streams: Tensor, positions: Tensor,
                       query_chunk: int | None = None, past: LayerKVState | None = None,
                       into: Tensor | None = None, between_chunks: Callable[[], None] | None = None
                       ) -> tuple[Tensor, LayerKVState]:
    """mHC + attention for all N tokens of one layer: streams [N, hc, H] -> (streams, kv_state); the new streams
    are written into `into` where it is given (hc_post). `between_chunks()` runs before each query chunk after
    the first (a prefill's stop check: it may raise).

    Prefill from an empty cache: `positions` must be arange(N). Continuation (`past`, the layer's state after P
    tokens): `positions` must be arange(P, P + N); the new tokens attend to past's window, compressed entries and
    indexer keys plus each other, and the returned state covers all P + N tokens."""
    n_tokens = streams.shape[0]
    first = past.seen_tokens if past is not None else 0
    # checked where it is free: on a GPU the comparison would make the host wait for every queued kernel, each
    # layer (the engine passes the arange itself)
    if not on_cuda(positions.device) and not torch.equal(positions, torch.arange(first, first + n_tokens)):
        raise ValueError(f"positions must be arange({first}, {first} + N): the tokens continue "
                         f"{'the past state' if past is not None else 'an empty cache'}")
    x, post, comb = attention_entry(cfg, w, streams)
    out, kv_state = attention(cfg, layer, w, x, positions, query_chunk, past, between_chunks)
    return hc_post(streams, out, post, comb, into), kv_state


def attention(cfg: ModelConfig, layer: int, w: Mapping[str, Tensor], x: Tensor, positions: Tensor,
              query_chunk: int | None = None, past: LayerKVState | None = None,
              between_chunks: Callable[[], None] | None = None) -> tuple[Tensor, LayerKVState]:
    """x [N, H] (normed sublayer input) -> attention output [N, H], kv_state.

    Shared-KV MQA: one head of K=V. Each query sees the sliding window of the last `sliding_window` tokens, plus
    (HCA) every compressed entry whose window is complete, or (CSA) the index_topk complete entries the Lightning
    Indexer picks for it; a per-head learned sink logit takes part in the softmax and absorbs weight. With `past`,
    the keys of the earlier tokens (window tail, compressed entries, indexer keys) come from it."""
    kind, rate, eps = cfg.layer_types[layer], cfg.compress_rates[layer], cfg.rms_norm_eps
    if past is not None and past.layer_type != kind:
        raise ValueError(f"layer {layer}: past state of a {past.layer_type} layer, the model has {kind}")
    n_tokens = x.shape[0]
    rope = cfg.main_rope if kind == SLIDING else cfg.compress_rope
    first, n_past = (0, 0) if past is None else (past.seen_tokens, past.window_kv.shape[0])
    rotation = rope_rotation(rope, first, n_tokens, 1, x.device)  # positions = arange(first, first + n_tokens)

    # Per-token projections, O(N x hidden): the query LoRA bottleneck (also the indexer's query input) and K=V.
    q_lora = rms_norm(linear(x, w["attn.wq_a.weight"]), w["attn.q_norm.weight"], eps)
    kv = apply_rope(rms_norm(linear(x, w["attn.wkv.weight"]), kv_norm_weight(w), eps), rotation)
    # Sliding keys: past's window tail (the window-1 tokens before positions[0]), then the new tokens.
    keys = kv if not n_past else torch.cat([past.window_kv.to(kv), kv])
    key_positions = torch.arange(first - n_past, first + n_tokens, device=x.device)
    state = LayerKVState(layer_type=kind, seen_tokens=first + n_tokens,
                         window_kv=keys[max(0, keys.shape[0] - (cfg.sliding_window - 1)):].clone())

    compressed = index_keys = None
    if kind != SLIDING:
        compressed, state.compressor = compress(
            linear(x, w["attn.compressor.wkv.weight"]), linear(x, w["attn.compressor.wgate.weight"]),
            w["attn.compressor.ape"], w["attn.compressor.norm.weight"], rate, kind == CSA, cfg.compress_rope, eps,
            past.compressor if past is not None else None)
    if kind == CSA:
        index_keys, state.indexer = compress(
            linear(x, w["attn.indexer.compressor.wkv.weight"]),
            linear(x, w["attn.indexer.compressor.wgate.weight"]), w["attn.indexer.compressor.ape"],
            w["attn.indexer.compressor.norm.weight"], rate, True, cfg.compress_rope, eps,
            past.indexer if past is not None else None)

    out = x.new_empty(n_tokens, cfg.hidden_size)
    low = w["attn.wq_b.weight"].dtype  # the attention products' dtype (bfloat16 on the low-precision path)
    compressed_low = compressed.to(low) if compressed is not None else None
    # the device's chunk (a few sliding windows on a CPU), or the fewer queries `query_chunk` (a memory bound) asks
    chunk = min(query_chunk or n_tokens, preferred_query_chunk(cfg, x.device))
    on_device = bf16_device_path(x.device, low)
    for start in range(0, n_tokens, chunk):
        if start and between_chunks is not None:
            between_chunks()
        end = min(start + chunk, n_tokens)
        q_pos, q_rotation = positions[start:end], rotation[start:end]
        q = linear(q_lora[start:end], w["attn.wq_b.weight"]).unflatten(-1, (cfg.num_heads, cfg.head_dim))
        q = apply_rope(rms_norm(q, None, eps), q_rotation)  # [C, heads, D], per-head unweighted norm

        # Sliding window: keys at positions (p - window, p].
        first_key = max(0, n_past + start - cfg.sliding_window + 1)
        k_pos = key_positions[first_key:n_past + end]
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - cfg.sliding_window)
        parts = [(keys[first_key:n_past + end], logit_bias(visible))]

        if compressed is not None and compressed.shape[0] > 0:
            # Entry i summarises positions [i*rate, (i+1)*rate): visible once the query has passed its end.
            complete = (q_pos + 1) // rate  # [C] entries visible to each query
            # the device scores no entry past the chunk's last query (a host count: half the work of a long
            # prompt, whose later entries every earlier chunk masks); at least index_topk, the top-k's width
            seen = (first + end) // rate if on_device else compressed.shape[0]
            if kind == HCA or compressed.shape[0] <= cfg.index_topk:
                # HCA: every complete entry. CSA with no more entries than index_topk: the indexer would keep
                # every complete one too (its top-k of T <= k entries is all of them), so it is not run.
                entries = compressed_low[:seen]
                visible = torch.arange(entries.shape[0], device=x.device)[None, :] < complete[:, None]
                parts.append((entries, logit_bias(visible)))
            else:
                keys_seen = index_keys[:max(seen, cfg.index_topk)]
                picked = indexer_topk(cfg, w, x[start:end], q_lora[start:end], q_rotation, keys_seen, complete)
                # [C, k, D] per query, gathered in the products' dtype (half the bytes on the bf16 path)
                gathered = compressed_low.index_select(0, picked.clamp(min=0).flatten())
                parts.append((gathered.view(*picked.shape, compressed_low.shape[-1]), logit_bias(picked >= 0)))

        o = attend_key_sets(q, parts, w["attn.attn_sink"], cfg.head_dim ** -0.5, low)
        # V = K carries RoPE on its rope channels: rotate the output back by the query's angle, so what each
        # entry contributes depends on its distance to the query only.
        o = apply_rope(o, q_rotation.conj())
        out[start:end] = grouped_output(cfg, o, w["attn.wo_a.weight"], w["attn.wo_b.weight"])
    return out, state


def logit_bias(visible: Tensor) -> Tensor:
    """Boolean visibility -> additive logit bias (0 / -inf)."""
    return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, float("-inf"))


def attend_key_sets(q: Tensor, parts: list[tuple[Tensor, Tensor | None]], sink: Tensor, scale: float,
                    dtype: torch.dtype = torch.float32) -> Tensor:
    """Softmax attention of q [C, heads, D] over several key sets, each (kv, bias [C, K], or None: every key
    visible) with kv either shared by all queries [K, D] or per query [C, K, D] (K = V). One softmax spans all
    sets plus the per-head sink logit,
    whose probability is dropped (the sink only absorbs weight). The two products run in `dtype` (bfloat16 on the
    low-precision path); logits, softmax and the result are float32.

    Every tensor stays [C, heads, K]: both products are then plain (batched) matmuls with no transposed copies,
    and the softmax runs set by set against a shared max and sum rather than over one concatenated copy."""
    q_low = q.to(dtype)
    sets = []
    for kv, bias in parts:
        if kv.shape[-2] == 0:  # no keys in this set (e.g. index_topk = 0): nothing to attend to
            continue
        kv = kv.to(dtype)  # [K, D] shared, or [C, K, D] per query: matmul broadcasts or batches over C
        logits = low_matmul(q_low, kv.transpose(-2, -1), dtype)
        logits = logits.float().mul_(scale)
        sets.append((kv, logits if bias is None else logits.add_(bias[:, None, :])))
    sink = sink.float().view(1, -1)
    peak = torch.stack([logits.amax(-1) for _, logits in sets]).amax(0).maximum(sink)  # [C, heads]
    total = (sink - peak).exp_()
    for _, logits in sets:
        total += logits.sub_(peak[..., None]).exp_().sum(-1)
    inverse = total.reciprocal_()[..., None]
    out = None
    for kv, weights in sets:
        probs = weights.mul_(inverse).to(dtype)
        part = low_matmul(probs, kv, dtype)
        out = part.float() if out is None else out.add_(part)
    return out


def indexer_topk(cfg: ModelConfig, w: Mapping[str, Tensor], x: Tensor, q_lora: Tensor, rotation: Tensor,
                 index_keys: Tensor, complete: Tensor, projected: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Lightning Indexer for a chunk of C queries: the top min(index_topk, T) entry ids [C, k] by indexer_scores;
    -1 where a query has fewer than k complete entries. index_keys [T, d] are every query's, or [C, T, d] each
    query's own (a decode step's rows, each its sequence's). Exact ties at the k-th score are broken by the device's
    top-k, as the reference does (DeepSeek's and transformers' torch.topk): with a real indexer's 64 heads an exact
    tie (every head's ReLU zero) does not happen, on a tiny random model it does."""
    k = min(cfg.index_topk, index_keys.shape[-2])
    if not bf16_device_path(x.device, w["attn.indexer.wq_b.weight"].dtype):
        picked = indexer_scores(cfg, w, x, q_lora, rotation, index_keys, complete, projected).topk(k, dim=-1).indices
        return torch.where(picked < complete[:, None], picked, -1)
    # the device: C' queries at a time, their [C', T] float32 scores within INDEXER_SCORE_BYTES
    rows = max(1, INDEXER_SCORE_BYTES // (4 * index_keys.shape[-2]))
    picked = []
    for a in range(0, x.shape[0], rows):
        part = slice(a, a + rows)
        scores = indexer_scores(cfg, w, x[part], q_lora[part], rotation[part],
                                index_keys[part] if index_keys.dim() == 3 else index_keys, complete[part],
                                None if projected is None else (projected[0][part], projected[1][part]))
        picked.append(scores.topk(k, dim=-1).indices)
    picked = picked[0] if len(picked) == 1 else torch.cat(picked)
    return torch.where(picked < complete[:, None], picked, -1)


def indexer_scores(cfg: ModelConfig, w: Mapping[str, Tensor], x: Tensor, q_lora: Tensor, rotation: Tensor,
                   index_keys: Tensor, complete: Tensor, projected: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """The Lightning Indexer's scores [C, T]: score(t, s) = sum_h w[t,h] * relu(q[t,h] . k[s]) over the complete
    compressed entries s < complete[t], -inf for the others (index_keys [T, d] shared or [C, T, d] per query, as
    indexer_topk's). `projected`: the indexer's query and head weights projections (q_lora @ wq_b.T,
    x @ weights_proj.T) where the caller made them already."""
    n_heads, head_dim = cfg.index_n_heads, cfg.index_head_dim
    if projected is None:
        projected = linear(q_lora, w["attn.indexer.wq_b.weight"]), linear(x, w["attn.indexer.weights_proj.weight"])
    q = projected[0].unflatten(-1, (n_heads, head_dim))
    q = apply_rope(q, rotation)  # compress rope, like the indexer's keys
    low = w["attn.indexer.wq_b.weight"].dtype  # the products in the weights' precision (bf16: low-precision path)
    head_weights = projected[1] * (n_heads ** -0.5 * head_dim ** -0.5)
    entry_ids = torch.arange(index_keys.shape[-2], device=x.device)
    hidden = entry_ids[None, :] >= complete[:, None]
    if bf16_device_path(x.device, low):
        return _bf16_index_scores(q.to(low), index_keys.to(low), head_weights.to(low)).masked_fill_(hidden,
                                                                                                   float("-inf"))
    scores = low_matmul(q, index_keys.transpose(-2, -1), low).float().relu_()  # [C, heads, T]
    scores = torch.bmm(head_weights.unsqueeze(1), scores).squeeze(1)  # [C, T]: the heads' weighted sum, one matmul
    return scores.masked_fill(hidden, float("-inf"))


def indexer_bytes(cfg: ModelConfig, n_queries: int, entries: int, device_path: bool) -> int:
    """Bytes indexer_topk's pieces take at once for n_queries over `entries` compressed entries: the reference's
    [C, heads, T] products and their float32 copy, or on the device's bf16 path at most its scores' and a key
    block's bounds (each of which a larger chunk or prompt does not grow)."""
    reference = n_queries * cfg.index_n_heads * entries * 4 * 2
    return min(reference, INDEXER_SCORE_BYTES + 2 * INDEXER_BLOCK_BYTES) if device_path else reference


def _bf16_index_scores(q: Tensor, keys: Tensor, head_weights: Tensor) -> Tensor:
    """sum_h head_weights[c, h] * relu(q[c, h] . keys[t]) [C, T] float32 from bf16 q [C, heads, D], keys [T, D]
    (or [C, T, D]: each query's own) and head_weights [C, heads], a block of keys at a time (DeepSeek's own
    indexer kernel keeps a block's products on the chip the same way): each block's products rounded to bf16 as
    the reference's are, the ReLU in place, and the heads' weighted sum one bf16 matmul with float32 sums, its
    result rounded to bf16 (the reference keeps the head weights and the sum in float32: a score within bf16's
    rounding of it). No float32 tensor of heads x entries, no float32 matmul over them. On CUDA, where it
    measurably beats these blocks, backends/fused_scores.py's kernel computes the same scores with the products
    never leaving the chip (float32 sums throughout)."""
    def blocks() -> Tensor:
        n_queries, heads, _ = q.shape
        entries = keys.shape[-2]
        scores = q.new_empty(n_queries, entries, dtype=torch.float32)
        block = max(1, INDEXER_BLOCK_BYTES // (2 * n_queries * heads))
        weights = head_weights.unsqueeze(1)  # [C, 1, heads]
        for start in range(0, entries, block):
            block_keys = keys[..., start:start + block, :].transpose(-2, -1)
            products = torch.matmul(q, block_keys).relu_()  # [C, heads, block] bf16
            scores[:, start:start + block] = torch.bmm(weights, products).squeeze(1)
        return scores
    return weighted_relu_scores(q, keys, head_weights, blocks)


def grouped_output(cfg: ModelConfig, o: Tensor, wo_a: Tensor, wo_b: Tensor) -> Tensor:
    """o [C, heads, D] -> [C, H]. Heads split into o_groups groups; each group is projected on its own to
    o_lora_rank (wo_a holds the groups' matrices stacked), then wo_b mixes all groups to the hidden size."""
    return grouped_projection(o, wo_a, wo_b, cfg.o_groups, cfg.o_lora_rank)


# ---------------------------------------------------------------------------------------------------------------
# Decode: one token at a time against a layer's state
# ---------------------------------------------------------------------------------------------------------------


class GrowingRows:
    """Rows appended one at a time into spare room (a view of the live rows, no copy of them per token), keeping
    at most `keep` of the latest where `keep` is given. `mirror` rows ride along: each row rounded to the attention
    products' dtype once, as float32 (what the products read every token)."""

    def __init__(self, rows: Tensor, keep: int | None = None, low: torch.dtype = torch.float32):
        self.keep, self.low = keep, low
        room = max(2 * (keep or 0), rows.shape[0] + 64)
        self._rows = rows.new_empty(room, rows.shape[1])
        self._mirror = self._rows if low == torch.float32 else torch.empty_like(self._rows)
        self.count = 0
        self.append(rows)

    def _tensors(self) -> tuple[Tensor, ...]:
        return (self._rows,) if self._mirror is self._rows else (self._rows, self._mirror)

    def _make_room(self, n: int) -> None:
        if self.count + n > self._rows.shape[0]:
            if self.keep is not None and self.keep + n <= self._rows.shape[0]:  # move the kept rows to the front
                for t in self._tensors():
                    t[:self.keep] = t[self.count - self.keep:self.count].clone()
                self.count = self.keep
            else:  # twice the room
                before = self._tensors()
                self._rows = self._rows.new_empty(2 * (self.count + n), self._rows.shape[1])
                self._mirror = self._rows if self.low == torch.float32 else torch.empty_like(self._rows)
                for t, old in zip(self._tensors(), before):
                    t[:self.count] = old[:self.count]

    def append(self, rows: Tensor) -> None:
        n = rows.shape[0]
        self._make_room(n)
        self._rows[self.count:self.count + n] = rows
        if self._mirror is not self._rows:
            self._mirror[self.count:self.count + n] = rows.to(self.low)
        self.count += n

    def next_row(self) -> tuple[Tensor, Tensor | None]:
        """Room for one more row: (its place [1, cols], its mirror's place or None where the mirror is the rows),
        for a kernel to write them; `commit` then counts it."""
        self._make_room(1)
        row = self._rows[self.count:self.count + 1]
        return row, (None if self._mirror is self._rows else self._mirror[self.count:self.count + 1])

    def commit(self) -> None:
        self.count += 1

    @property
    def width(self) -> int:
        return self._rows.shape[1]

    def _start(self, last: int | None) -> int:
        return 0 if last is None else max(0, self.count - last)

    def rows(self, last: int | None = None) -> Tensor:
        return self._rows[self._start(last if last is not None else self.keep):self.count]

    def mirror(self, last: int | None = None) -> Tensor:
        return self._mirror[self._start(last if last is not None else self.keep):self.count]


class TokenCompressor:
    """A compressor's state grown one token at a time: the buffered projections of the current window, the entries
    emitted so far (with their low-precision mirror) and the CSA overlap; a window's entry is made by `compress`
    itself when its last token arrives."""

    def __init__(self, state: CompressorState, rate: int, low: torch.dtype):
        self.rate = rate
        self.entries = GrowingRows(state.compressed_kv.float(), low=low)
        width = state.buffer_kv.shape[1]
        self.buffer_kv = state.buffer_kv.new_empty(rate, width, dtype=torch.float32)
        self.buffer_gate = torch.empty_like(self.buffer_kv)
        self.buffered = state.buffer_kv.shape[0]
        self.buffer_kv[:self.buffered], self.buffer_gate[:self.buffered] = state.buffer_kv, state.buffer_gate
        # each slot's row [1, width], made once: a token's copy is then one op (indexing and setting cost 2.5x)
        self.slots = list(zip(self.buffer_kv.split(1), self.buffer_gate.split(1)))
        self.entry_count, self.overlap_kv, self.overlap_gate = state.entry_count, state.overlap_kv, state.overlap_gate

    def add(self, kv: Tensor, gate: Tensor, ape: Tensor, norm_weight: Tensor, overlapping: bool, rope: RopeConfig,
            eps: float) -> None:
        if self.buffer(kv, gate):
            self.close(ape, norm_weight, overlapping, rope, eps)

    def buffer(self, kv: Tensor, gate: Tensor) -> bool:
        """A token's projections [1, width] buffered: whether its window is now full (`close` makes its entry)."""
        kv_slot, gate_slot = self.slots[self.buffered]
        kv_slot.copy_(kv)
        gate_slot.copy_(gate)
        self.buffered += 1
        return self.buffered == self.rate

    def close(self, ape: Tensor, norm_weight: Tensor, overlapping: bool, rope: RopeConfig, eps: float) -> None:
        """The full window's entry (`compress` of its tokens after the state so far), the buffer emptied."""
        empty = self.buffer_kv.new_zeros(0, self.buffer_kv.shape[1])
        entry, state = compress(self.buffer_kv, self.buffer_gate, ape, norm_weight, self.rate, overlapping, rope,
                                eps, CompressorState(empty[:, :0], empty, empty, self.entry_count, self.overlap_kv,
                                                     self.overlap_gate))
        self.entries.append(entry)
        self.entry_count, self.overlap_kv, self.overlap_gate = state.entry_count, state.overlap_kv, state.overlap_gate
        self.buffered = 0

    def state(self) -> CompressorState:
        return CompressorState(self.entries.rows(), self.buffer_kv[:self.buffered].clone(),
                               self.buffer_gate[:self.buffered].clone(), self.entry_count, self.overlap_kv,
                               self.overlap_gate)


def close_windows(full: list[TokenCompressor], ape: Tensor, norm_weight: Tensor, overlapping: bool,
                  rope: RopeConfig, eps: float) -> None:
    """`close` of several sequences' compressors (one layer's, each window full: a batched decode step's rows) in
    one pass of torch ops over their windows side by side: each entry, overlap and count those of its own `close`
    (compress's arithmetic per window; tests/test_batched_decode.py holds them equal to the bit). Only on one torch
    thread, as the CPU decode step runs: on more, torch splits even a small op's rows between its threads by their
    count, so a row's vector lanes, and its rounding, could depend on the others; then each closes alone."""
    if len(full) < 2 or torch.get_num_threads() > 1:
        for compressor in full:
            compressor.close(ape, norm_weight, overlapping, rope, eps)
        return
    rate = full[0].rate
    kv = torch.stack([c.buffer_kv for c in full])  # [N, rate, width]
    gate = torch.stack([c.buffer_gate for c in full]) + ape
    if overlapping:  # compress's two series: each window's Cb after the Ca of the window before it
        d = kv.shape[2] // 2
        first = [_overlap(c.overlap_kv, c.overlap_gate, kv, gate, rate, d) for c in full]
        first_kv, first_gate = torch.stack([f[0] for f in first]), torch.stack([f[1] for f in first])
        for i, c in enumerate(full):
            c.overlap_kv, c.overlap_gate = kv[i, :, :d].clone(), gate[i, :, :d].clone()
        kv, gate = after_previous(kv, gate, first_kv, first_gate)
    entries = pooled_windows(kv, gate, norm_weight, eps)
    for i, c in enumerate(full):
        # the RoPE row by row: torch's complex product of several rows may round a row's tail otherwise
        c.entries.append(apply_rope(entries[i:i + 1], rope_rotation(rope, c.entry_count * rate, 1, rate, kv.device)))
        c.entry_count += 1
        c.buffered = 0


class TokenKV:
    """A layer's KV state grown one decoded token at a time (attention_token): the sliding window's last keys and
    the compressors, in preallocated rows. `state()` gives the LayerKVState it amounts to."""

    def __init__(self, cfg: ModelConfig, layer: int, state: LayerKVState, low: torch.dtype):
        self.layer_type, self.seen_tokens = state.layer_type, state.seen_tokens
        # the window's keys: the last window - 1 kept for the next token, this token's attention reads `window`
        self.window = GrowingRows(state.window_kv.float(), keep=cfg.sliding_window - 1, low=low)
        rate = cfg.compress_rates[layer]
        self.compressor = TokenCompressor(state.compressor, rate, low) if state.compressor is not None else None
        self.indexer = TokenCompressor(state.indexer, rate, low) if state.indexer is not None else None

    def widths(self) -> tuple[int, int | None, int | None]:
        """The widths of the window's rows and of the compressor's and the indexer's entries (None: none)."""
        return (self.window.width, self.compressor.entries.width if self.compressor is not None else None,
                self.indexer.entries.width if self.indexer is not None else None)

    def state(self) -> LayerKVState:
        return LayerKVState(self.layer_type, self.seen_tokens, self.window.rows().clone(),
                            self.compressor.state() if self.compressor is not None else None,
                            self.indexer.state() if self.indexer is not None else None)


def attention_token_sublayer(cfg: ModelConfig, layer: int, w: Mapping[str, Tensor], streams: Tensor,
                             kv_state: TokenKV) -> Tensor:
    """attention_sublayer for one decoded token (streams [1, hc, H]) after kv_state's tokens, kv_state grown (the
    torch path; families/deepseek_v4/token_layer.py computes the same in compiled calls)."""
    x, post, comb = attention_entry(cfg, w, streams)
    return hc_post(streams, attention_token(cfg, layer, w, x, kv_state), post, comb)


INDEXER_HEAD_WEIGHTS = "attn.indexer.weights_proj.weight"


@functools.lru_cache(maxsize=None)
def projection_names(kind: str) -> tuple[str, ...]:
    """The matrices a token's attention input goes through first: the query's LoRA, K=V, the compressors' (kv,
    gate) pairs and the indexer's head weights (made once per layer kind: a decoded row asks for every layer)."""
    names = ("attn.wq_a.weight", "attn.wkv.weight")
    if kind != SLIDING:
        names += ("attn.compressor.wkv.weight", "attn.compressor.wgate.weight")
    if kind == CSA:
        names += ("attn.indexer.compressor.wkv.weight", "attn.indexer.compressor.wgate.weight", INDEXER_HEAD_WEIGHTS)
    return names


# The compressors a token of each layer kind feeds (grow_state, grow_states, device_kv): TokenKV's attribute,
# where its (kv, gate) pair sits in projection_names' order, its ape and norm weights.
TOKEN_COMPRESSORS = {SLIDING: (),
                     HCA: (("compressor", 2, "attn.compressor.ape", "attn.compressor.norm.weight"),),
                     CSA: (("compressor", 2, "attn.compressor.ape", "attn.compressor.norm.weight"),
                           ("indexer", 4, "attn.indexer.compressor.ape", "attn.indexer.compressor.norm.weight"))}


def grow_state(cfg: ModelConfig, layer: int, w: Mapping[str, Tensor], kv_state: TokenKV,
               projected: list[Tensor]) -> tuple[list[Tensor], Tensor | None, bool]:
    """After a token's key went into the window: its projections into the compressors, the token counted; (the
    keys it attends to, the compressed entries or None, whether the indexer picks among them)."""
    kind, eps = cfg.layer_types[layer], cfg.rms_norm_eps
    for name, at, ape, norm in TOKEN_COMPRESSORS[kind]:
        getattr(kv_state, name).add(*projected[at:at + 2], w[ape], w[norm], kind == CSA, cfg.compress_rope, eps)
    return _token_counted(cfg, kind, kv_state)


def grow_states(cfg: ModelConfig, layer: int, w: Mapping[str, Tensor], kv_states: list[TokenKV],
                projected: list[list[Tensor]]) -> list[tuple[list[Tensor], Tensor | None, bool]]:
    """grow_state of several sequences' tokens (a batched decode step's rows, row b's projections projected[b]):
    the windows that close at this token compressed together (close_windows), each row's state and result those
    of its own grow_state."""
    kind, eps = cfg.layer_types[layer], cfg.rms_norm_eps
    for name, at, ape, norm in TOKEN_COMPRESSORS[kind]:
        full = [getattr(s, name) for s, p in zip(kv_states, projected) if getattr(s, name).buffer(*p[at:at + 2])]
        close_windows(full, w[ape], w[norm], kind == CSA, cfg.compress_rope, eps)
    return [_token_counted(cfg, kind, kv_state) for kv_state in kv_states]


def _token_counted(cfg: ModelConfig, kind: str, kv_state: TokenKV) -> tuple[list[Tensor], Tensor | None, bool]:
    """grow_state's end, its compressors fed: the token counted; its keys, entries and whether the indexer picks."""
    kv_state.seen_tokens += 1
    entries = kv_state.compressor.entries.mirror() if kind != SLIDING else None
    return [kv_state.window.mirror(cfg.sliding_window)], entries, kind == CSA and entries.shape[0] > cfg.index_topk


def attention_token(cfg: ModelConfig, layer: int, w: Mapping[str, Tensor], x: Tensor, kv_state: TokenKV) -> Tensor:
    """`attention` for one decoded token x [1, H] after kv_state's tokens, growing kv_state in place: the same
    arithmetic without what a single query never needs (no masks: the token sees every key of its window and
    every complete compressed entry; no per-token copies of the window or the entries). In three parts: what
    needs only the rows (token_attention_inputs, token_attention_output: fixed shapes, all rows of a step at
    once) around what needs each row's state (token_attention_core)."""
    rotation = token_attention_rotation(cfg, layer, kv_state, x.device)
    inputs = token_attention_inputs(cfg, layer, w, x, rotation)
    return token_attention_output(cfg, w, token_attention_core(cfg, layer, w, x, rotation, inputs, kv_state),
                                  rotation)


def token_attention_rotation(cfg: ModelConfig, layer: int, kv_state: TokenKV, device) -> Tensor:
    """The rotation [1, rope.dim/2] of the token after kv_state's."""
    kind = cfg.layer_types[layer]
    if kind != kv_state.layer_type:
        raise ValueError(f"layer {layer}: past state of a {kv_state.layer_type} layer, the model has {kind}")
    return token_rotation(cfg.main_rope if kind == SLIDING else cfg.compress_rope, kv_state.seen_tokens, device)


def token_attention_inputs(cfg: ModelConfig, layer: int, w: Mapping[str, Tensor], x: Tensor, rotation: Tensor
                           ) -> tuple[Tensor, ...]:
    """What a token's attention computes from its row alone, for rows x [B, H] (rotation [B, rope.dim/2] each
    row's): its projections (projection_names'), the query's LoRA normed, the key normed and rotated, the query
    heads normed and rotated, and (a CSA layer) the indexer's query (used where the indexer picks)."""
    kind, eps = cfg.layer_types[layer], cfg.rms_norm_eps
    projected = linears(x, [w[name] for name in projection_names(kind)])
    q_lora = rms_norm(projected[0], w["attn.q_norm.weight"], eps)
    key = apply_rope(rms_norm(projected[1], kv_norm_weight(w), eps), rotation)
    queries = linears(q_lora, [w["attn.wq_b.weight"]] + ([w["attn.indexer.wq_b.weight"]] if kind == CSA else []))
    q = apply_rope(rms_norm(queries[0].view(x.shape[0], cfg.num_heads, cfg.head_dim), None, eps), rotation)
    return (*projected, q_lora, key, q, *queries[1:])


def token_attention_core(cfg: ModelConfig, layer: int, w: Mapping[str, Tensor], x: Tensor, rotation: Tensor,
                         inputs: tuple[Tensor, ...], kv_state: TokenKV) -> Tensor:
    """One row's attention over its state (x [1, H], its rotation and token_attention_inputs' rows), the key
    and the compressors' projections appended to kv_state: the attention's output heads [1, heads, D] (rotated)."""
    names = projection_names(cfg.layer_types[layer])
    projected, (q_lora, key, q, *index_query) = list(inputs[:len(names)]), inputs[len(names):]
    kv_state.window.append(key)
    keys, entries, indexed = grow_state(cfg, layer, w, kv_state, projected)
    if entries is not None and entries.shape[0]:
        if indexed:
            complete = torch.full((1,), entries.shape[0], device=x.device)  # (no host copy: a GPU would wait)
            picked = indexer_topk(cfg, w, x, q_lora, rotation, kv_state.indexer.entries.rows(), complete,
                                  (index_query[0], projected[names.index(INDEXER_HEAD_WEIGHTS)]))[0]
            entries = entries.index_select(0, picked)
        keys.append(entries)
    # the prefill's attention, every key visible (the keys are rounded already: rounding again is exact)
    return attend_key_sets(q, [(k, None) for k in keys], w["attn.attn_sink"], cfg.head_dim ** -0.5,
                   w["attn.wq_b.weight"].dtype)


def token_attention_output(cfg: ModelConfig, w: Mapping[str, Tensor], o: Tensor, rotation: Tensor) -> Tensor:
    """The attention's output rows [B, H] from its heads o [B, heads, D] (rotation each row's)."""
    return grouped_output(cfg, apply_rope(o, rotation.conj()), w["attn.wo_a.weight"], w["attn.wo_b.weight"])


# ---------------------------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Routing(FamilyRouting):
    """A layer's routing (families.base.Routing: x the FFN input after the ffn mHC collapse and ffn_norm; the
    weights normalised over the k, times routed_scaling_factor) with the mHC weights moe_finish needs."""

    post: Tensor | None = None  # [N, hc] mHC post weights, for moe_finish
    comb: Tensor | None = None  # [N, hc, hc] mHC stream mixing, for moe_finish


def _router_scores(scoring_func: str, logits: Tensor) -> Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    if scoring_func == "softmax":
        return torch.softmax(logits, dim=-1)
    raise NotImplementedError(f"scoring_func {scoring_func!r}")


def moe_route(cfg: ModelConfig, layer: int, w: Mapping[str, Tensor], streams: Tensor,
              token_ids: Tensor) -> Routing:
    """The ffn mHC collapse, ffn_norm and router for all N tokens. Learned layers pick the top-k experts by score
    plus the correction bias (the bias steers the choice only, not the weights); hash layers take the fixed
    tid2eid[token id]. Weights are the chosen scores, renormalised, times routed_scaling_factor."""
    x, post, comb = hc_pre_norm(cfg, w["hc_ffn_fn"], w["hc_ffn_base"], w["hc_ffn_scale"], streams,
                                w["ffn_norm.weight"])
    scores = _router_scores(cfg.scoring_func, matmul(x, w["ffn.gate.weight"]))
    if cfg.hash_layers[layer]:
        experts = w["ffn.gate.tid2eid"][token_ids].long()
    else:
        bias = w.get("ffn.gate.bias")
        choice = scores if bias is None else scores + bias
        experts = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, experts)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
    return Routing(x=x, experts=experts, weights=weights, post=post, comb=comb)


def expert_forward(cfg: ModelConfig, x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
                   hidden_order: Tensor | None = None) -> Tensor:
    """Clamped SwiGLU: x [n, H], w1 (gate) / w3 (up) [I, H], w2 (down) [H, I] -> [n, H]. The gate is clamped from
    above, the up projection on both sides, at swiglu_limit. `hidden_order`: w2's columns are stored permuted
    (w2[:, hidden_order]), so the hidden activation is permuted the same way."""
    return swiglu_ffn(x, w1, w3, w2, cfg.swiglu_limit, hidden_order)


def expert_arithmetic(cfg: ModelConfig) -> dict:
    """runtime/expert_decode.py ExpertWeights.apply's arithmetic for this config: {"forward": expert_forward on
    decoded matrices, "limit": the clamp of the fused FP4 kernel's SwiGLU}."""
    return {"forward": functools.partial(expert_forward, cfg), "limit": cfg.swiglu_limit}


def accumulate(acc: Tensor, routing: Routing, expert_id: int, y: Tensor) -> Tensor:
    """acc [N, H] += expert `expert_id`'s output y (rows in tokens_by_expert()[expert_id] order) times the routing
    weights."""
    batch = routing.tokens_by_expert()[expert_id]
    return acc.index_add_(0, batch.token_index, y * batch.weight[:, None])


def shared_expert(cfg: ModelConfig, w: Mapping[str, Tensor], routing: Routing) -> Tensor:
    """The shared expert on every token [N, H]: it needs only the routing's input, so it may run beside the routed
    experts."""
    return expert_forward(cfg, routing.x, w["ffn.shared_experts.w1.weight"], w["ffn.shared_experts.w3.weight"],
                          w["ffn.shared_experts.w2.weight"])


def moe_finish(cfg: ModelConfig, layer: int, w: Mapping[str, Tensor], streams: Tensor, routing: Routing,
               routed_out: Tensor, shared: Tensor | None = None, into: Tensor | None = None,
               checked: bool = True) -> Tensor:
    """Add the shared expert (computed here unless `shared` is given) to the routed experts' sum and spread the
    result over the streams (ffn mHC post), written into `into` where it is given. A layer whose output is not
    finite stops the forward, named (check_finite), unless `checked` is False (a caller that checks after the
    step: no synchronisation per layer)."""
    if shared is None:
        shared = shared_expert(cfg, w, routing)
    streams = hc_post(streams, routed_out + shared, routing.post, routing.comb, into)
    return check_finite(streams, layer) if checked else streams


# ---------------------------------------------------------------------------------------------------------------
# Head and the resident reference path
# ---------------------------------------------------------------------------------------------------------------


HEAD_GLOBALS = ("hc_head_fn", "hc_head_base", "hc_head_scale", "norm.weight")  # head()'s weights besides the matrix


def head(cfg: ModelConfig, streams: Tensor, w_globals: Mapping[str, Tensor],
         which: int | slice | Tensor = -1) -> Tensor:
    """Logits float32 for the positions `which` selects: an int gives [vocab] (default: the last position), a
    slice or index tensor gives [n, vocab]. The streams collapse through the mHC head (pre weights only), then the
    final norm and the LM head."""
    x = head_input(cfg, streams, w_globals, which)
    weight = w_globals[cfg.head_weight]
    logits = (matmul(x, weight) if weight.dtype == x.dtype else widened_matmul(x, weight)).float()
    single = not isinstance(which, slice) and torch.as_tensor(which).dim() == 0  # an int: [vocab]
    return logits[0] if single else logits


def head_input(cfg: ModelConfig, streams: Tensor, w_globals: Mapping[str, Tensor],
               which: int | slice | Tensor = -1) -> Tensor:
    """The LM head's input [n, H] for the positions `which` selects (n = 1 for an int): the streams collapsed
    through the mHC head (pre weights only), then the final norm."""
    selected = streams[which]
    if selected.dim() == 2:
        selected = selected.unsqueeze(0)
    mixes = matmul(rms_norm(selected.flatten(1), None, cfg.rms_norm_eps), w_globals["hc_head_fn"])
    pre = torch.sigmoid(mixes * w_globals["hc_head_scale"] + w_globals["hc_head_base"]) + cfg.hc_eps
    return rms_norm((pre.unsqueeze(-1) * selected).sum(dim=1), w_globals["norm.weight"], cfg.rms_norm_eps)


def forward_resident(cfg: ModelConfig, weights: Mapping[str, Tensor], token_ids: Tensor,
                     query_chunk: int | None = None, return_kv_state: bool = False,
                     past_states: list[LayerKVState] | None = None):
    """Reference path: every weight in memory (release names), layer-major. Returns logits [N, vocab] (and the
    per-layer LayerKVState list when return_kv_state). With `past_states` (one per layer, all after the same P
    tokens) the N tokens continue that state at positions P..P+N-1; the states returned cover all P + N tokens."""
    n_tokens = token_ids.shape[0]
    first = 0
    if past_states is not None:
        if len(past_states) != cfg.num_layers or len({s.seen_tokens for s in past_states}) != 1:
            raise ValueError("past_states: one state per layer, all after the same number of tokens")
        first = past_states[0].seen_tokens
    positions = torch.arange(first, first + n_tokens, device=token_ids.device)
    streams = embed(cfg, token_ids, weights["embed.weight"])
    kv_states = []
    for layer in range(cfg.num_layers):
        w = layer_weights(weights, layer)
        past = past_states[layer] if past_states is not None else None
        streams, kv_state = attention_sublayer(cfg, layer, w, streams, positions, query_chunk, past)
        kv_states.append(kv_state)
        routing = moe_route(cfg, layer, w, streams, token_ids)
        groups = routing.groups()
        inputs = groups.gather(routing.x)
        outputs = torch.empty_like(inputs)
        for expert, (a, b) in groups.spans.items():
            outputs[a:b] = expert_forward(cfg, inputs[a:b], w[f"ffn.experts.{expert}.w1.weight"],
                                          w[f"ffn.experts.{expert}.w3.weight"], w[f"ffn.experts.{expert}.w2.weight"])
        streams = moe_finish(cfg, layer, w, streams, routing, groups.combine(outputs, n_tokens))
    logits = head(cfg, streams, weights, slice(None))
    return (logits, kv_states) if return_kv_state else logits


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek-V4 as the prefill engine's family (families.base.LayerPrefill): the functions above, named once
# ---------------------------------------------------------------------------------------------------------------


class DeepseekV4Prefill:
    """LayerPrefill for one DeepSeek-V4 config: the residual is hc_mult streams [N, hc, H] float32, a layer's
    state its LayerKVState, the shared expert runs beside the routed ones, and the per-expert backend's compiled
    kernels compute the routed experts (expert_ffn None)."""

    expert_naming = EXPERT_NAMING  # names.py's: where a routed expert's matrices are
    expert_ffn = None

    def __init__(self, cfg: ModelConfig, compute_dtype: torch.dtype = torch.float32):
        self.config, self.dtype = cfg, compute_dtype
        self.shape = MoeShape(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                              num_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok,
                              expert_intermediate=cfg.moe_intermediate_size, moe_layers=tuple(range(cfg.num_layers)),
                              hash_layers=tuple(i for i, hashed in enumerate(cfg.hash_layers) if hashed))
        self.names = PrefillNames(embedding="embed.weight", head=cfg.head_weight, head_globals=HEAD_GLOBALS,
                                  tied=cfg.tie_word_embeddings)
        self.expert_limit = cfg.swiglu_limit  # the clamp of the compiled expert kernels' SwiGLU

    def expert_forward(self, x: Tensor, gate: Tensor, up: Tensor, down: Tensor,
                       hidden_order: Tensor | None = None) -> Tensor:
        """A routed expert the runner decoded (expert_ffn None): expert_forward, the clamped SwiGLU."""
        return expert_forward(self.config, x, gate, up, down, hidden_order)

    def layer_prefix(self, layer: int) -> str:
        return f"layers.{layer}."

    def in_compute_dtype(self, name: str, ndim: int) -> bool:
        return is_low_precision_matrix(name, ndim)

    def hidden_from_embeddings(self, rows: Tensor) -> Tensor:
        return residual_streams(self.config, rows)

    def hash_table(self, layer: int, w: Mapping[str, Tensor]) -> Tensor:
        return w["ffn.gate.tid2eid"]

    def seen_tokens(self, state: LayerKVState) -> int:
        return state.seen_tokens

    def attention(self, layer: int, w: Mapping[str, Tensor], hidden: Tensor, positions: Tensor,
                  past: LayerKVState | None, query_chunk: int | None, into: Tensor | None,
                  between_chunks: Callable[[], None] | None) -> tuple[Tensor, LayerKVState]:
        past = past.to(hidden.device) if past is not None else None
        return attention_sublayer(self.config, layer, w, hidden, positions, query_chunk, past, into=into,
                                  between_chunks=between_chunks)

    def route(self, layer: int, w: Mapping[str, Tensor], hidden: Tensor, token_ids: Tensor) -> Routing:
        return moe_route(self.config, layer, w, hidden, token_ids)

    def beside_experts(self, layer: int, w: Mapping[str, Tensor], routing: Routing) -> tuple:
        return shared_expert, (self.config, w, routing)

    def finish(self, layer: int, w: Mapping[str, Tensor], hidden: Tensor, routing: Routing, routed: Tensor,
               beside: Tensor | None = None, into: Tensor | None = None, checked: bool = True) -> Tensor:
        return moe_finish(self.config, layer, w, hidden, routing, routed, beside, into=into, checked=checked)

    def head_input(self, w_globals: Mapping[str, Tensor], hidden: Tensor, rows: Tensor) -> Tensor:
        return head_input(self.config, hidden, w_globals, rows)

    def expert_activation(self, gate: Tensor, up: Tensor) -> Tensor:
        return clamped_swiglu(gate, up, self.config.swiglu_limit)

    def preferred_query_chunk(self, device: torch.device) -> int:
        return preferred_query_chunk(self.config, device)

    def working_set(self, n_tokens: int, query_chunk: int, device: torch.device | None = None) -> dict[str, int]:
        cfg, f32 = self.config, 4
        hc, hidden = cfg.hc_mult, cfg.hidden_size
        # residual streams (in and out of a sublayer), mHC collapse, FFN input, routed accumulator, projections
        activations = n_tokens * hidden * f32 * (3 * hc + 8)
        # the layer's K=V, compressor projections (2 series) and indexer keys, for every token
        kv = n_tokens * f32 * (cfg.head_dim * 5 + cfg.index_head_dim * 4)
        csa = max([r for r, t in zip(cfg.compress_rates, cfg.layer_types) if t == CSA] or [0])
        hca = max([r for r, t in zip(cfg.compress_rates, cfg.layer_types) if t == HCA] or [0])
        # per query: the chunk's sliding keys (its chunk + window - 1, the masked ones scored too), the picked or
        # complete compressed entries
        keys = query_chunk + cfg.sliding_window - 1 + cfg.index_topk + (n_tokens // hca if hca else 0)
        attention = query_chunk * cfg.num_heads * (keys + cfg.head_dim) * f32 * 3
        # a CSA chunk's entries gathered per query, [chunk, index_topk, head_dim] in the products' dtype, and a copy
        # as large (a product's operand): more than the scores where head_dim x index_topk outgrows the heads
        gathered = query_chunk * cfg.index_topk * cfg.head_dim * self.dtype.itemsize * 2 if csa else 0
        indexer = indexer_bytes(cfg, query_chunk, n_tokens // csa if csa else 0,
                                device is not None and bf16_device_path(device, self.dtype))
        return {"activations": activations, "kv": kv, "attention_chunk": attention + gathered + indexer}

    def close(self) -> None:
        rope_rotation.cache_clear()  # this prompt's rotation tables (on a GPU, device memory)
