"""Qwen3-MoE's forward as short torch functions over one layer's weight dict (names inside the layer, as
tensors.layer_prefix strips them), the reference arithmetic of transformers' Qwen3MoeForCausalLM:

    h = embed[ids]
    per layer:  a = h + o_proj(attention(rms(h)))           GQA; q_norm / k_norm per head, then RoPE; causal
                                                              (the last sliding_window keys, if it is set)
                f = rms(a)                                    post_attention_layernorm
                a + experts(f) (routed: softmax, top-k, renormalised when norm_topk_prob; SwiGLU, no clamp)
                  or a + mlp(f)  (the layers of mlp_only_layers or off decoder_sparse_step)
    logits = lm_head(rms(h))

A prefill and each later token go through the same functions: a token continues the KVState the prefill left.
Everything computes in the weights' dtype, as transformers does for a model loaded in that dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from moepack.backends.ops import fused_rms_norm, linears, matmul

from ..base import Routing
from ..rope import default_inv_freq
from .config import Qwen3MoeConfig
from .tensors import DENSE_MLP, ROUTER, Checkpoint


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' Qwen3MoeRMSNorm: the mean square in float32, the weight applied in x's dtype."""
    x32 = x.float()
    normed = fused_rms_norm(x32, None, eps)  # one kernel on CUDA
    if normed is None:
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@functools.cache  # (never evicted: a decode step's CUDA graphs read them by address)
def rope_frequencies(c: Qwen3MoeConfig, device: torch.device) -> Tensor:
    """[head_dim / 2] float32: the RoPE's frequencies on `device`, made once (every layer of a step reuses them; on
    CUDA the scaled ones would otherwise be a host tensor copied in at each layer's graph piece)."""
    if c.rope_scaling is None:
        return default_inv_freq(c.head_dim, c.rope_theta, device)
    return c.rope_scaling.inv_freq(c.head_dim, c.rope_theta).to(device)


def rope_tables(c: Qwen3MoeConfig, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [N, head_dim] of the RoPE at `positions` (both halves of a head rotate by one frequency): the
    default, or the config's linear or YaRN scaling (YaRN's cos and sin times its attention factor)."""
    angles = positions.float()[:, None] * rope_frequencies(c, positions.device)[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    if c.rope_scaling is None or c.rope_scaling.attention_factor == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    scale = c.rope_scaling.attention_factor
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [heads, N, D] rotated: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


ROOM_ROWS = 64  # the fewest rows a LayerKV's buffers grow by (a decode's tokens between two copies)


@dataclass
class LayerKV:
    """One layer's keys and values so far, [kv_heads, T, head_dim] each (after k_norm and RoPE). Appended to, they
    are views of buffers with room for more tokens (`_room`: a 32nd more, at least ROOM_ROWS: little beside the KV
    the memory checks count), so that a decoded token writes its row in place: a copy of the whole KV at every token
    would make each step cost more the longer its context. The first append (a prefill's) keeps its tensors as they
    are."""

    keys: Tensor | None = None
    values: Tensor | None = None
    _room: tuple[Tensor, Tensor] | None = field(default=None, repr=False, compare=False)
    _views: tuple[Tensor, Tensor] | None = field(default=None, repr=False, compare=False)  # the last append's

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    @property
    def seen_tokens(self) -> int:  # (families/base.py: what a prefill hands a decode)
        return self.length

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.keys is None:
            self.keys, self.values = k, v
            return k, v
        before, after = self.length, self.length + k.shape[1]
        if not self._in_room(after):  # new buffers, this state's rows copied in once
            rows = after + max(ROOM_ROWS, after // 32)
            self._room = tuple(t.new_empty(t.shape[0], rows, *t.shape[2:]) for t in (self.keys, self.values))
            for buffer, t in zip(self._room, (self.keys, self.values)):
                buffer[:, :before] = t
        for buffer, t in zip(self._room, (k, v)):
            buffer[:, before:after] = t
        self.keys, self.values = self._views = tuple(buffer[:, :after] for buffer in self._room)
        return self.keys, self.values

    def _in_room(self, rows: int) -> bool:
        """Whether the keys and values are still the room's views the last append gave (not tensors set since) and
        `rows` rows fit."""
        return (self._room is not None and self._room[0].shape[1] >= rows
                and self.keys is self._views[0] and self.values is self._views[1])


@dataclass
class KVState:
    """Every layer's LayerKV: what a prefill hands to the tokens after it."""

    layers: list[LayerKV] = field(default_factory=list)

    @classmethod
    def empty(cls, c: Qwen3MoeConfig) -> KVState:
        return cls([LayerKV() for _ in range(c.num_layers)])

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0


def attention(c: Qwen3MoeConfig, w: Mapping[str, Tensor], x: Tensor, kv: LayerKV, query_chunk: int | None = None,
              between_chunks: Callable[[], None] | None = None) -> Tensor:
    """The attention of N new tokens x [N, H] (already normed) after kv's earlier ones; appends their keys and
    values to kv. Returns o_proj's output [N, H]. The queries go `query_chunk` at a time (all at once by default),
    each chunk over the keys up to its last position: the scores are [heads, chunk, keys], never [heads, N, T];
    `between_chunks()` runs before each chunk after the first (a prefill's stop check: it may raise)."""
    positions = torch.arange(kv.length, kv.length + x.shape[0], device=x.device)
    q, k, v = attention_inputs(c, w, x, positions)
    keys, values = kv.append(k, v)
    heads = attention_over(c, q, keys, values, positions, query_chunk, between_chunks)
    return matmul(heads, w["self_attn.o_proj.weight"])


def attention_inputs(c: Qwen3MoeConfig, w: Mapping[str, Tensor], x: Tensor, positions: Tensor
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """What the attention computes from the rows alone (x [N, H] normed, at `positions` [N]): the queries
    [heads, N, D] and keys [kv_heads, N, D] normed and rotated, the values [kv_heads, N, D]."""
    n = x.shape[0]
    q, k, v = linears(x, [w[f"self_attn.{m}_proj.weight"] for m in "qkv"])  # (a decoded token: one kernel call)
    q, k, v = (t.view(n, -1, c.head_dim) for t in (q, k, v))
    q = rms_norm(q, w["self_attn.q_norm.weight"], c.rms_norm_eps).transpose(0, 1)
    k = rms_norm(k, w["self_attn.k_norm.weight"], c.rms_norm_eps).transpose(0, 1)
    cos, sin = rope_tables(c, positions, x.dtype)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.transpose(0, 1)


# A chunk of at least this many queries goes through torch's fused attention (scaled_dot_product_attention: on a
# CPU flash attention, 3-8x the matmuls' speed on a prefill's chunks, the causal part skipped where the chunk starts
# the sequence); fewer (a decoded token's) through two matmuls over the group's queries, which are faster there
# (at 3,000 keys, 1-8 queries: 5 ms against 7-21 ms; 16: 32 against 14). On a GPU only a chunk that starts the
# sequence (the kernel's own causal mask): torch's fused GPU kernels take no mask beside GQA, and their fallback
# would copy the keys per query head.
FUSED_MIN_QUERIES = 16


def attention_over(c: Qwen3MoeConfig, q: Tensor, keys: Tensor, values: Tensor, positions: Tensor,
                   query_chunk: int | None = None, between_chunks: Callable[[], None] | None = None) -> Tensor:
    """The queries q [heads, N, D] at `positions` (the last N of the keys') over keys and values [kv_heads, T, D],
    causal: the heads' output [N, heads * D], before o_proj (attention's chunks). The query heads of one KV head
    (GQA's group) read its keys in place: never a copy of the keys per query head (a decoded token's step would
    copy the whole KV, group times over)."""
    n, past = q.shape[1], keys.shape[1] - q.shape[1]
    out = torch.empty(n, c.num_heads * c.head_dim, dtype=q.dtype, device=q.device)
    chunk = query_chunk or n
    for start in range(0, n, chunk):
        if start and between_chunks is not None:
            between_chunks()
        stop = min(start + chunk, n)
        seen = past + stop  # the keys this chunk's last query sees
        visible = visible_keys(c, seen, positions[start:stop])
        # (a chunk starting the sequence needs only the kernel's causal mask while no query reaches past the window)
        causal = past + start == 0 and (c.sliding_window is None or stop <= c.sliding_window)
        fused = stop - start >= FUSED_MIN_QUERIES and (causal or q.device.type == "cpu")
        attend = _fused_attention if fused else _grouped_attention
        heads = attend(c, q[:, start:stop], keys[:, :seen], values[:, :seen], visible, causal=causal)
        out[start:stop] = heads.transpose(0, 1).reshape(stop - start, -1)
    return out


def visible_keys(c: Qwen3MoeConfig, keys: int, positions: Tensor) -> Tensor:
    """[N, keys] bool: which of the first `keys` positions each query at `positions` [N] attends: its own and
    earlier ones, and of those (a sliding window) only the last sliding_window, as transformers' sliding mask."""
    index = torch.arange(keys, device=positions.device)[None, :]
    visible = index <= positions[:, None]
    if c.sliding_window is not None:
        visible &= index > positions[:, None] - c.sliding_window
    return visible


def _fused_attention(c: Qwen3MoeConfig, q: Tensor, keys: Tensor, values: Tensor, visible: Tensor,
                     causal: bool) -> Tensor:
    """attention_over's chunk q [heads, n, D] over keys and values [kv_heads, T, D] by torch's fused attention:
    [heads, n, D]. `causal`: the chunk starts the sequence (n == T), masked by the kernel itself (its masked blocks
    skipped), else by `visible` [n, T]."""
    mask = None if causal else visible
    return F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, is_causal=causal,
                                          scale=c.head_dim ** -0.5, enable_gqa=True)[0]


def _grouped_attention(c: Qwen3MoeConfig, q: Tensor, keys: Tensor, values: Tensor, visible: Tensor,
                       causal: bool) -> Tensor:
    """attention_over's chunk by two matmuls, a GQA group's queries one matmul's rows over its KV head's keys:
    [heads, n, D]."""
    n, seen = q.shape[1], keys.shape[1]
    group = c.num_heads // c.num_kv_heads  # query heads per KV head (GQA)
    rows = q.reshape(c.num_kv_heads, group * n, c.head_dim)
    scores = (rows @ keys.transpose(1, 2)) * c.head_dim ** -0.5  # [kv_heads, group * n, seen]
    scores = scores.view(c.num_kv_heads, group, n, seen).masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (probs.view(c.num_kv_heads, group * n, seen) @ values).view(c.num_heads, n, c.head_dim)


def route(c: Qwen3MoeConfig, w: Mapping[str, Tensor], x: Tensor) -> Routing:
    """The router: softmax over every expert (float32), the top-k, renormalised to sum 1 when norm_topk_prob."""
    probs = torch.softmax(matmul(x, w[ROUTER]), dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, c.top_k, dim=-1)
    if c.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(experts=experts, weights=weights.to(x.dtype))


def swiglu_ffn(ffn: Mapping[str, Tensor], x: Tensor) -> Tensor:
    """down(silu(gate x) * up x): a routed expert's and a dense layer's FFN alike (no clamp)."""
    return matmul(F.silu(matmul(x, ffn["gate"])) * matmul(x, ffn["up"]), ffn["down"])


def routed_experts(experts: Sequence[Mapping[str, Tensor]], routing: Routing, x: Tensor) -> Tensor:
    """Each chosen expert over its tokens, combined by the routing weights: [N, H]."""
    out = torch.zeros_like(x)
    for expert in routing.experts.unique().tolist():
        tokens, slot = torch.nonzero(routing.experts == expert, as_tuple=True)
        y = swiglu_ffn(experts[expert], x[tokens]) * routing.weights[tokens, slot, None]
        out.index_add_(0, tokens, y)
    return out


def dense_mlp(w: Mapping[str, Tensor], x: Tensor) -> Tensor:
    """A layer without routed experts: one SwiGLU MLP of width intermediate_size."""
    return swiglu_ffn({m: w[name] for m, name in DENSE_MLP.items()}, x)


def before_experts(c: Qwen3MoeConfig, layer: int, w: Mapping[str, Tensor], hidden: Tensor, kv: LayerKV
                   ) -> tuple[Tensor, Tensor, Routing | None]:
    """Attention with its residual, the FFN's norm and (a routed layer) the router: (residual, FFN input,
    routing or None)."""
    residual = hidden + attention(c, w, rms_norm(hidden, w["input_layernorm.weight"], c.rms_norm_eps), kv)
    ffn_input = rms_norm(residual, w["post_attention_layernorm.weight"], c.rms_norm_eps)
    return residual, ffn_input, route(c, w, ffn_input) if c.is_moe_layer(layer) else None


def after_experts(c: Qwen3MoeConfig, layer: int, w: Mapping[str, Tensor], residual: Tensor, ffn_input: Tensor,
                  expert_out: Tensor | None) -> Tensor:
    """The layer's output: the residual plus the combined experts (or, a dense layer, its MLP)."""
    return residual + (expert_out if c.is_moe_layer(layer) else dense_mlp(w, ffn_input))


def embed(globals_: Mapping[str, Tensor], ids: Tensor) -> Tensor:
    return globals_["embed"][ids]


def head(c: Qwen3MoeConfig, globals_: Mapping[str, Tensor], hidden: Tensor) -> Tensor:
    """Final norm and LM head: logits [N, vocab] float32."""
    return matmul(rms_norm(hidden, globals_["norm"], c.rms_norm_eps), globals_["head"]).float()


def forward(checkpoint: Checkpoint, ids: Sequence[int] | Tensor, kv: KVState | None = None) -> Tensor:
    """Logits [N, vocab] of `ids` after the tokens `kv` holds (a prefill when kv is empty or None); kv is
    continued in place."""
    c = checkpoint.config
    kv = kv if kv is not None else KVState.empty(c)
    hidden = embed(checkpoint.globals, torch.as_tensor(ids, dtype=torch.long))
    for layer in range(c.num_layers):
        w = checkpoint.layer(layer)
        residual, ffn_input, routing = before_experts(c, layer, w, hidden, kv.layers[layer])
        out = routed_experts(checkpoint.experts(layer), routing, ffn_input) if routing is not None else None
        hidden = after_experts(c, layer, w, residual, ffn_input, out)
    return head(c, checkpoint.globals, hidden)


def greedy(checkpoint: Checkpoint, prompt: Sequence[int], new_tokens: int) -> list[int]:
    """The prompt prefilled, then `new_tokens` tokens chosen greedily one at a time over the KV state."""
    kv = KVState.empty(checkpoint.config)
    logits = forward(checkpoint, prompt, kv)
    out: list[int] = []
    for _ in range(new_tokens):
        out.append(int(logits[-1].argmax()))
        logits = forward(checkpoint, [out[-1]], kv)
    return out
