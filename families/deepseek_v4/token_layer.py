"""One decoded token through the model's layers in compiled calls over fixed buffers (a CPU's decode).

At one token a layer's work is a scan of its weights, done by the compiled kernels at the memory's pace; what is
left is the Python between them. Calling each kernel through its checked wrapper (backends/token_kernels.py: its
arguments converted, checked and its output allocated on every call) and torch's small ops between them cost
about a third of a resident BF16 token. Here everything a layer's calls take is arranged once: the weights'
descriptors, the plans of its projections, and buffers that never move (the residual streams in two of them, the
attention sublayer writing the second from the first and the FFN the first from the second), so a call is the
C function on ready arguments. What varies per token is passed per call: the window's next row (the key is
written there, with its bf16-rounded copy), the token's RoPE angles, the key sets, the chosen experts.

The arithmetic is model.py's, call for call (attention_token_sublayer, moe_route + decode's token_choice,
moe_finish with the shared expert), its sums added in another order (the mHC mixes by the matmul kernel, the
router's exponentials from libm): float32 results agree to rounding, and a near-tie in a top-k may go the other
way. TokenLayers.make gives None where a layer's weights are not what the kernels take, and the decoder then runs
model.py's functions; tests hold the two paths and the prefill together.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping

import torch
from torch import Tensor

from moepack.backends import ops, token_kernels
from moepack.backends.token_kernels import ROUND_INPUT, ROUND_OUTPUT, Matrix
from moepack.families.base import check_finite
from moepack.families.deepseek_v4 import indexer_native, mhc_native
from moepack.families.deepseek_v4.config import CSA, SLIDING, ModelConfig

from . import model


def _ptr(t: Tensor) -> int:
    return t.data_ptr()


def _offset(t: Tensor, floats: int) -> int:
    return t.data_ptr() + 4 * floats


def _row_addresses(t: Tensor, rows: int):
    """The addresses of the first `rows` rows (first dimension) of t, as a C array of pointers."""
    step = t.stride(0) * t.element_size()
    return (ctypes.c_void_p * rows)(*(t.data_ptr() + row * step for row in range(rows)))


def _addresses(tensors) -> ctypes.Array:
    """The tensors' addresses (None: a null pointer) as a C array of pointers."""
    addresses = [None if t is None else t.data_ptr() for t in tensors]
    return (ctypes.c_void_p * len(addresses))(*addresses)


def _buffer(*shape: int) -> Tensor:
    """A fixed float32 buffer (explicitly: a process may have changed torch's default dtype)."""
    return torch.empty(*shape, dtype=torch.float32)


class _Layer:
    """One layer's ready arguments and its own buffers (the projections' outputs)."""

    def __init__(self, owner: TokenLayers, layer: int, w: Mapping[str, Tensor]):
        cfg, k, hc = owner.cfg, owner.kernels, owner.hc
        self.layer, self.w = layer, w
        self.kind = cfg.layer_types[layer]
        low = w["attn.wq_b.weight"].dtype == torch.bfloat16
        self.low, self.rope = low, cfg.main_rope if self.kind == SLIDING else cfg.compress_rope
        names = model.projection_names(self.kind)
        self.projections = ops.linear_plan([w[n] for n in names])
        self.queries = ops.linear_plan([w["attn.wq_b.weight"]])
        self.indexed_queries = ops.linear_plan([w["attn.wq_b.weight"], w["attn.indexer.wq_b.weight"]]) \
            if self.kind == CSA else None
        self.keep = list(w.values())  # every tensor a pointer below points into (not only through `w`)
        self.wo_a, self.wo_b = (token_kernels.float_matrix(w[f"attn.wo_{m}.weight"]) for m in "ab")
        self.q_norm = w["attn.q_norm.weight"].float().contiguous()
        self.kv_norm = model.kv_norm_weight(w).float().contiguous()
        self.sink = w["attn.attn_sink"].float().contiguous()
        self.proj = _buffer(1, self.projections.total)
        self.q = _buffer(1, (self.indexed_queries or self.queries).total)
        self.parts = [self.proj[:, a:b] for a, b in self.projections.spans]  # views: the contents change per token
        self.index_q = self.q[:, self.indexed_queries.spans[1][0]:].view(cfg.index_n_heads, cfg.index_head_dim) \
            if self.kind == CSA else None
        H, n_hc = cfg.hidden_size, cfg.hc_mult
        kv_at, kv_stop = self.projections.spans[1]
        a, b = owner.streams
        # (function, arguments but the thread count) per call
        self.attn_pre = self._hc_entry(owner, "attn", "attn_norm.weight", a)
        # the mHC entries' weights for several tokens (TokenLayers' batched calls): (fn, its rows, scale, base, norm)
        self.hc_weights = {sub: (token_kernels.float_matrix(w[f"hc_{sub}_fn"]), w[f"hc_{sub}_fn"].shape[0],
                                 w[f"hc_{sub}_scale"], w[f"hc_{sub}_base"], w[f"{sub}_norm.weight"])
                           for sub in ("attn", "ffn")}
        self.project = (k.c_many, (_ptr(owner.x), H, self.projections.matrices, self.projections.count,
                                  _ptr(self.proj), self.projections.offsets, self.projections.flags))
        self.q_lora_norm = (k.c_norm_rope, (_ptr(self.proj), 1, self.projections.spans[0][1], _ptr(self.q_norm),
                                           cfg.rms_norm_eps, 0, None, _ptr(owner.q_lora), None))
        self.kv_in, self.kv_cols = _offset(self.proj, kv_at), kv_stop - kv_at
        # the window's, the compressor's and the indexer's entries (None: the layer has none)
        self.kv_widths = (cfg.head_dim, None if self.kind == SLIDING else cfg.head_dim,
                          cfg.index_head_dim if self.kind == CSA else None)
        self.query = {indexed: (k.c_many, (_ptr(owner.q_lora), plan.cols, plan.matrices, plan.count, _ptr(self.q),
                                          plan.offsets, plan.flags))
                      for indexed, plan in ((False, self.queries), (True, self.indexed_queries)) if plan is not None}
        self.grouped = (k.c_grouped, (_ptr(owner.o), cfg.o_groups, cfg.num_heads * cfg.head_dim // cfg.o_groups,
                                     ctypes.byref(self.wo_a), _ptr(owner.low_rank), low * (ROUND_INPUT | ROUND_OUTPUT)))
        self.output = (k.c_linear, (_ptr(owner.low_rank), 1, self.wo_b.cols, ctypes.byref(self.wo_b), _ptr(owner.out),
                                   self.wo_b.rows, low * (ROUND_INPUT | ROUND_OUTPUT)))
        self.attn_post = (hc.token_post, (_ptr(a), _ptr(owner.out), _ptr(owner.post), _ptr(owner.comb), n_hc, H,
                                          _ptr(b)))
        self.ffn_pre = self._hc_entry(owner, "ffn", "ffn_norm.weight", b)
        self.gate = token_kernels.float_matrix(w["ffn.gate.weight"])
        bias = None if cfg.hash_layers[layer] else w.get("ffn.gate.bias")
        self.gate_args = (ctypes.byref(self.gate), _ptr(bias) if bias is not None else None,
                          token_kernels.SCORE_FUNCS[cfg.scoring_func], cfg.num_experts_per_tok)
        self.route = (k.c_route, (_ptr(owner.x), *self.gate_args))
        shared = [w[f"ffn.shared_experts.{m}.weight"] for m in ("w1", "w3", "w2")]
        self.shared = tuple(token_kernels.float_matrix(m) for m in shared)
        self.shared_flag = ROUND_INPUT | ROUND_OUTPUT if shared[0].dtype == torch.bfloat16 else 0
        self.ffn_post = (hc.token_post, (_ptr(b), _ptr(owner.moe_out), _ptr(owner.post), _ptr(owner.comb), n_hc, H,
                                         _ptr(a)))

    def _hc_entry(self, owner: TokenLayers, sublayer: str, norm: str, streams: Tensor) -> tuple:
        """A sublayer's mHC entry: (the mixes' call, fn . streams on every thread (fn: 1.5 MB on V4-Flash), the rest
        of the entry's call), each (function, arguments but the thread count)."""
        cfg, w = owner.cfg, self.w
        fn, scale, base = (w[f"hc_{sublayer}_{part}"] for part in ("fn", "scale", "base"))
        mixes = (owner.kernels.c_linear, (_ptr(streams), 1, fn.shape[1], ctypes.byref(token_kernels.float_matrix(fn)),
                                         _ptr(owner.mixes), fn.shape[0], 0))
        rest = (owner.hc.token_pre_mixed, (_ptr(streams), cfg.hc_mult, cfg.hidden_size, _ptr(owner.mixes),
                                           _ptr(scale), _ptr(base), cfg.hc_sinkhorn_iters, cfg.hc_eps,
                                           cfg.rms_norm_eps, _ptr(w[norm]), _ptr(owner.x), _ptr(owner.post),
                                           _ptr(owner.comb)))
        return mixes, rest


def _usable(cfg: ModelConfig, layer: int, w: Mapping[str, Tensor]) -> bool:
    """Whether the kernels take every weight of this layer's token path as it is."""
    kind = cfg.layer_types[layer]
    low = w["attn.wq_b.weight"].dtype
    if low not in (torch.float32, torch.bfloat16) or cfg.scoring_func not in token_kernels.SCORE_FUNCS:
        return False
    queries = [w["attn.wq_b.weight"]] + ([w["attn.indexer.wq_b.weight"]] if kind == CSA else [])
    plans = [[w[n] for n in model.projection_names(kind)], queries[:1]] + ([queries] if kind == CSA else [])
    if any(ops.linear_plan(matrices) is None for matrices in plans):
        return False
    wo = [w["attn.wo_a.weight"], w["attn.wo_b.weight"]]
    shared = [w.get(f"ffn.shared_experts.{m}.weight") for m in ("w1", "w3", "w2")]
    gate, bias = w.get("ffn.gate.weight"), w.get("ffn.gate.bias")
    floats = wo + shared + [gate]
    if any(m is None or ops.kernels_for(1, m, m) is None for m in floats):
        return False
    if not all(mhc_native.token_weights_fit(w[f"hc_{sub}_fn"], w[f"hc_{sub}_scale"], w[f"hc_{sub}_base"],
                                            w.get(f"{sub}_norm.weight"), cfg.hc_mult) for sub in ("attn", "ffn")):
        return False
    return (all(m.dtype == low for m in wo) and len({m.dtype for m in shared}) == 1 and gate.dtype == torch.float32
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())) and _shapes_fit(cfg, kind, w))


def _shapes_fit(cfg: ModelConfig, kind: str, w: Mapping[str, Tensor]) -> bool:
    """Whether the weights have the shapes the fixed buffers are made for (a call reads and writes them whole)."""
    H, heads, dim, rank = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.o_groups * cfg.o_lora_rank
    want = {"attn.wq_a.weight": (cfg.q_lora_rank, H), "attn.wkv.weight": (dim, H),
            "attn.wq_b.weight": (heads * dim, cfg.q_lora_rank), "attn.wo_a.weight": (rank, heads * dim // cfg.o_groups),
            "attn.wo_b.weight": (H, rank), "attn.q_norm.weight": (cfg.q_lora_rank,), "attn.attn_sink": (heads,),
            "attn_norm.weight": (H,), "ffn_norm.weight": (H,), "ffn.shared_experts.w1.weight": (None, H),
            "ffn.shared_experts.w2.weight": (H, None), "ffn.gate.weight": (None, H)}
    if w.get("ffn.gate.bias") is not None:
        want["ffn.gate.bias"] = (w["ffn.gate.weight"].shape[0],)
    if kind == CSA:
        want["attn.indexer.wq_b.weight"] = (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
    return (heads * dim % cfg.o_groups == 0 and tuple(model.kv_norm_weight(w).shape) == (dim,)
            and all(len(w[name].shape) == len(shape) and all(n is None or n == m for n, m in zip(shape, w[name].shape))
                    for name, shape in want.items()))


class TokenLayers:
    """Every layer of one decoded token in compiled calls over fixed buffers (the module's docstring). Per token:
    `begin(embedding)`, then per layer `attention(layer, kv)`, `route(layer, hash_ids)` -> the chosen experts, and
    `finish(layer, experts, routed_flag)` with their Matrices; `output` is then the last layer's streams.

    Several tokens (one per sequence, each its own KV) in one step: `begin_rows(embeddings)`, then per layer
    `attention_rows(layer, kvs)`, `route_rows(layer, hash_ids)` and `finish_rows(layer, experts, choices,
    routed_flag)`; `rows_output` is then the streams [B, hc, H]. Every weight is read once for all of them (the
    projections, wo_a / wo_b, the mHC mixes, the gate, each chosen expert once for the tokens that chose it); the
    mHC's weights and mixing, the norms, the keys and the attention core run each token's own arithmetic, every
    row in one call; the compressors' windows closing at this token pooled together (model.grow_states), the
    indexer's choice per token. Each token's arithmetic is the one-token path's, so its results are the same to
    the bit."""

    def __init__(self, cfg: ModelConfig, dense: list[Mapping[str, Tensor]], kernels, hc, indexer):
        self.cfg, self.kernels, self.hc, self.indexer = cfg, kernels, hc, indexer
        H, n_hc = cfg.hidden_size, cfg.hc_mult
        self.streams = (_buffer(1, n_hc, H), _buffer(1, n_hc, H))
        self.x, self.post, self.comb = _buffer(1, H), _buffer(1, n_hc), _buffer(1, n_hc, n_hc)
        self.q_lora = _buffer(1, cfg.q_lora_rank)
        self.o = _buffer(cfg.num_heads, cfg.head_dim)
        self.low_rank = _buffer(1, cfg.o_groups * cfg.o_lora_rank)
        self.out, self.moe_out = _buffer(1, H), _buffer(1, H)
        k = cfg.num_experts_per_tok
        self.chosen, self.weights = (ctypes.c_int64 * k)(), (ctypes.c_float * (k + 1))()
        self.hash_ids = (ctypes.c_int64 * k)()
        self.experts = [(Matrix * (k + 1))() for _ in range(3)]
        self.flags = (ctypes.c_int * (k + 1))()

        self.mixes = _buffer(1, (2 + n_hc) * n_hc)
        self.layers = [_Layer(self, layer, w) for layer, w in enumerate(dense)]
        self.rows: _Rows | None = None  # the batched calls' buffers, for the most tokens stepped together so far

    @classmethod
    def make(cls, cfg: ModelConfig, dense: list[Mapping[str, Tensor]]) -> TokenLayers | None:
        """The compiled token path over these resident layer weights, or None where the native code is off or a
        layer's weights are not what it takes (the caller runs model.py's functions)."""
        kernels = token_kernels.token_kernels()
        if kernels is None:
            return None
        if not all(_usable(cfg, layer, w) for layer, w in enumerate(dense)):
            return None
        hc, indexer = mhc_native.kernel(model.hc_mix_weights), indexer_native.indexer_kernel()
        return None if hc is None or indexer is None else cls(cfg, dense, kernels, hc, indexer)

    def begin(self, embedding: Tensor) -> None:
        """A token's embedding [1, H] into every residual stream."""
        self.streams[0].copy_(embedding.float().reshape(1, 1, -1).expand_as(self.streams[0]))

    @property
    def output(self) -> Tensor:
        """The residual streams [1, hc, H] after the last `finish` (a buffer: read before the next token)."""
        return self.streams[0]

    def attention(self, layer: int, kv_state: model.TokenKV) -> None:
        """model.attention_token_sublayer of streams[0] into streams[1], kv_state grown."""
        L, cfg, k = self.layers[layer], self.cfg, self.kernels
        self._check_state(L, layer, kv_state)
        threads = token_kernels.current_threads()
        _entry(L.attn_pre, threads)
        fn, args = L.project
        _call(fn, args, threads)
        fn, args = L.q_lora_norm
        _call(fn, args)
        rotation = model.token_rotation(L.rope, kv_state.seen_tokens)
        angles = token_kernels.angle_pairs(rotation)
        row, mirror = kv_state.window.next_row()  # the key straight into the window (and its rounded copy)
        _call(k.c_norm_rope, (L.kv_in, 1, L.kv_cols, _ptr(L.kv_norm), cfg.rms_norm_eps, 2 * angles.shape[0],
                             _ptr(angles), _ptr(row), _ptr(mirror) if mirror is not None else None))
        kv_state.window.commit()
        keys, entries, indexed = model.grow_state(cfg, layer, L.w, kv_state, L.parts)
        fn, args = L.query[indexed]
        _call(fn, args, threads)
        if entries is not None and entries.shape[0]:
            if indexed:  # every entry is complete: the index_topk best scores
                entries = self._picked(L, L.index_q, rotation, kv_state, L.parts, entries)
            keys.append(entries)
        self._attend(L, _ptr(L.q), angles, keys, self.o, threads)
        fn, args = L.grouped
        _call(fn, args, threads)
        fn, args = L.output
        _call(fn, args, threads)
        fn, args = L.attn_post
        if fn(*args) == 1:  # (2: not finite; the layer's FFN exit checks)
            raise RuntimeError(f"layer {layer}: the mHC exit refused its arguments")

    def _picked(self, L: _Layer, index_q: Tensor, rotation: Tensor, kv_state: model.TokenKV, parts: list[Tensor],
                entries: Tensor) -> Tensor:
        """A CSA layer's compressed entries (every one complete) that one token attends to: the indexer's index_topk
        best scores of its query index_q [index heads, D], its head weights parts[6]."""
        cfg = self.cfg
        head_weights = parts[6] * (cfg.index_n_heads ** -0.5 * cfg.index_head_dim ** -0.5)
        scores = self.indexer.scores(index_q, rotation, kv_state.indexer.entries.mirror(), head_weights, L.low)
        return entries.index_select(0, scores.topk(cfg.index_topk).indices)

    @staticmethod
    def _check_state(L: _Layer, layer: int, kv_state: model.TokenKV) -> None:
        if L.kind != kv_state.layer_type:
            raise ValueError(f"layer {layer}: past state of a {kv_state.layer_type} layer, the model has {L.kind}")
        if kv_state.widths() != L.kv_widths:  # the kernels write and read rows of exactly these widths
            raise ValueError(f"layer {layer}: past state of widths {kv_state.widths()}, the model's are {L.kv_widths}")

    def _attend(self, L: _Layer, q: int, angles: Tensor, keys: list[Tensor], out: Tensor, threads: int) -> None:
        """The attention core of one token's queries (at address q) over its key sets into out [heads, D]."""
        cfg = self.cfg
        sets = [t for t in keys if t.shape[0]]
        _call(self.kernels.c_attend, (q, cfg.num_heads, cfg.head_dim, 2 * angles.shape[0], _ptr(angles),
                                     cfg.rms_norm_eps, _addresses(sets),
                                     (ctypes.c_int64 * len(sets))(*(t.shape[0] for t in sets)), len(sets),
                                     _ptr(L.sink), cfg.head_dim ** -0.5, int(L.low), _ptr(out)), threads)

    def route(self, layer: int, hash_ids: list[int] | None) -> dict[int, float]:
        """The FFN's mHC entry and router from streams[1]: {expert id: weight} ascending (token_choice's)."""
        L, cfg, threads = self.layers[layer], self.cfg, token_kernels.current_threads()
        _entry(L.ffn_pre, threads)
        if hash_ids is not None:
            self.hash_ids[:] = hash_ids
        fn, args = L.route
        n = fn(*args, self.hash_ids if hash_ids is not None else None, float(cfg.routed_scaling_factor),
               self.chosen, self.weights, threads)
        if n < 0:
            raise RuntimeError(f"layer {layer}: the token router refused its input")
        return dict(zip(self.chosen[:n], self.weights[:n]))

    def finish(self, layer: int, experts: list[tuple[Matrix, Matrix, Matrix]], routed_flag: int) -> None:
        """The chosen experts (their Matrices, in route's order, its weights) and the shared expert in one call,
        then the FFN's mHC exit into streams[0]; a non-finite result stops here, named (model.check_finite)."""
        L, n = self.layers[layer], len(experts)
        for j, array in enumerate(self.experts):
            for e, matrices in enumerate(experts):
                array[e] = matrices[j]
            array[n] = L.shared[j]
        self.flags[:n + 1] = [routed_flag] * n + [L.shared_flag]
        self.weights[n] = 1.0
        _call(self.kernels.c_moe, (_ptr(self.x), self.cfg.hidden_size, n + 1, *self.experts, self.weights,
                                  float(self.cfg.swiglu_limit), self.flags, _ptr(self.moe_out)),
              token_kernels.current_threads())
        fn, args = L.ffn_post
        done = fn(*args)
        if done == 1:
            raise RuntimeError(f"layer {layer}: the mHC exit refused its arguments")
        if done == 2:  # the new streams hold a NaN or an infinity: the one-line error naming the layer
            check_finite(self.streams[0], layer)

    # --- several tokens in one step ------------------------------------------------------------------------------
    def begin_rows(self, embeddings: Tensor) -> None:
        """B tokens' embeddings [B, H] into every residual stream of their rows."""
        count = embeddings.shape[0]
        if self.rows is None or self.rows.capacity < count:
            self.rows = _Rows(self, count)
        self.rows.count = count
        streams = self.rows.streams[0][:count]
        streams.copy_(embeddings.float().reshape(count, 1, -1).expand_as(streams))

    @property
    def rows_output(self) -> Tensor:
        """The residual streams [B, hc, H] after the last `finish_rows` (a buffer: read before the next step)."""
        return self.rows.streams[0][:self.rows.count]

    def attention_rows(self, layer: int, kv_states: list[model.TokenKV]) -> None:
        """`attention` of each row's token, row b growing kv_states[b]: the projections of every row in one scan of
        their weights, the norms and keys of every row in one call, the indexer's choice per row, every row's
        attention core in one call."""
        L, cfg, k, R = self.layers[layer], self.cfg, self.kernels, self.rows
        B, H = R.count, cfg.hidden_size
        if len(kv_states) != B:
            raise ValueError(f"{len(kv_states)} KV states for {B} tokens")
        for kv_state in kv_states:
            self._check_state(L, layer, kv_state)
        threads = token_kernels.current_threads()
        self._entry_rows(L, "attn", 0, threads)
        plan = L.projections
        _call(k.c_many_rows, (_ptr(R.x), B, H, H, plan.matrices, plan.count, _ptr(R.proj), plan.total, plan.offsets,
                             plan.flags), threads)
        rank = plan.spans[0][1]
        kv_at, kv_stop = plan.spans[1]
        eps, stride = cfg.rms_norm_eps, plan.total
        _call(k.c_norm_rope_rows, (_ptr(R.proj), B, stride, rank, _ptr(L.q_norm), eps, 0, None, R.q_lora_rows, None))
        # each row's key straight into its window (and the rounded copy), the rows' angles side by side
        rotations = [model.token_rotation(L.rope, kv_state.seen_tokens) for kv_state in kv_states]
        angles = torch.view_as_real(torch.cat(rotations))  # [B, rope_dim / 2, 2]: (cos, sin) pairs
        places = [kv_state.window.next_row() for kv_state in kv_states]
        _call(k.c_norm_rope_rows, (_offset(R.proj, kv_at), B, stride, kv_stop - kv_at, _ptr(L.kv_norm), eps,
                                  2 * angles.shape[1], _row_addresses(angles, B), _addresses(key for key, _ in places),
                                  _addresses(mirror for _, mirror in places)))
        for kv_state in kv_states:
            kv_state.window.commit()
        parts = [R.parts(layer, plan, row) for row in range(B)]
        grown = model.grow_states(cfg, layer, L.w, kv_states, parts)  # each row's (keys, entries, indexed)
        indexed = any(g[-1] for g in grown)  # the indexer's queries too where one row needs them
        queries = L.indexed_queries if indexed else L.queries
        q = R.q[:B * queries.total].view(B, queries.total)
        _call(k.c_many_rows, (_ptr(R.q_lora), B, queries.cols, queries.cols, queries.matrices, queries.count, _ptr(q),
                             queries.total, queries.offsets, queries.flags), threads)
        key_sets = []
        for row, (kv_state, rotation, row_parts, (keys, entries, row_indexed)) in enumerate(
                zip(kv_states, rotations, parts, grown)):
            if entries is not None and entries.shape[0]:
                if row_indexed:
                    index_q = q[row, queries.spans[1][0]:].view(cfg.index_n_heads, cfg.index_head_dim)
                    entries = self._picked(L, index_q, rotation, kv_state, row_parts, entries)
                keys.append(entries)
            key_sets.append([t for t in keys if t.shape[0]])
        # every row's attention in one call (one wake of the threads, not one per row)
        sets, counts, n_sets = token_kernels.attend_rows_arguments(key_sets)
        _call(k.c_attend_rows, (_ptr(q), B, queries.total, cfg.num_heads, cfg.head_dim, 2 * angles.shape[1],
                               _ptr(angles), cfg.rms_norm_eps, sets, counts, n_sets, _ptr(L.sink), cfg.head_dim ** -0.5,
                               int(L.low), _ptr(R.o)), threads)
        rounding = L.low * (ROUND_INPUT | ROUND_OUTPUT)
        _call(k.c_grouped_rows, (_ptr(R.o), B, cfg.o_groups, cfg.num_heads * cfg.head_dim // cfg.o_groups,
                                ctypes.byref(L.wo_a), _ptr(R.low_rank), L.wo_a.rows, rounding), threads)
        _call(k.c_linear, (_ptr(R.low_rank), B, L.wo_b.cols, ctypes.byref(L.wo_b), _ptr(R.out), L.wo_b.rows, rounding),
              threads)
        if self.hc.rows_post(_ptr(R.streams[0]), _ptr(R.out), _ptr(R.post), _ptr(R.comb), B, cfg.hc_mult, H,
                             _ptr(R.streams[1])) == 1:  # (2: not finite; the layer's FFN exit checks)
            raise RuntimeError(f"layer {layer}: the mHC exit refused its arguments")

    def route_rows(self, layer: int, hash_ids: list[list[int]] | None) -> list[dict[int, float]]:
        """`route` of each row's token, the gate read once for all: {expert id: weight} ascending per row."""
        L, cfg, R = self.layers[layer], self.cfg, self.rows
        B, top_k, threads = R.count, cfg.num_experts_per_tok, token_kernels.current_threads()
        self._entry_rows(L, "ffn", 1, threads)
        if hash_ids is not None:
            R.hash_ids[:B * top_k] = [e for ids in hash_ids for e in ids]
        if self.kernels.c_route_rows(_ptr(R.x), B, *L.gate_args, R.hash_ids if hash_ids is not None else None,
                                    float(cfg.routed_scaling_factor), R.chosen, R.weights, R.counts, threads):
            raise RuntimeError(f"layer {layer}: the token router refused its input")
        return [dict(zip(R.chosen[row * top_k:row * top_k + n], R.weights[row * top_k:row * top_k + n]))
                for row, n in enumerate(R.counts[:B])]

    def finish_rows(self, layer: int, experts: dict[int, tuple[Matrix, Matrix, Matrix]],
                    choices: list[dict[int, float]], routed_flag: int) -> None:
        """Every row's chosen experts (`experts`: id -> Matrices, the union of `choices`, route_rows' per row) and
        the shared expert in one call, each expert's matrices read once for the rows that chose it, then each row's
        FFN mHC exit; a non-finite result stops here, named."""
        L, cfg, R = self.layers[layer], self.cfg, self.rows
        B, H = R.count, cfg.hidden_size
        ids = sorted(experts)  # ascending, the shared expert last: each row adds its experts as `finish` does
        rows = [[row for row in range(B) if e in choices[row]] for e in ids] + [list(range(B))]
        weights = [[choices[row][e] for row in picked] for e, picked in zip(ids, rows)] + [[1.0] * B]
        flags = [routed_flag] * len(ids) + [L.shared_flag]
        arguments = token_kernels.moe_arguments([experts[e] for e in ids] + [L.shared], rows, weights, flags)
        _call(self.kernels.c_moe_rows, (_ptr(R.x), B, H, len(ids) + 1, *arguments, float(cfg.swiglu_limit),
                                       _ptr(R.moe_out)), token_kernels.current_threads())
        done = self.hc.rows_post(_ptr(R.streams[1]), _ptr(R.moe_out), _ptr(R.post), _ptr(R.comb), B, cfg.hc_mult, H,
                                 _ptr(R.streams[0]))
        if done == 1:
            raise RuntimeError(f"layer {layer}: the mHC exit refused its arguments")
        if done == 2:  # a row's new streams hold a NaN or an infinity: the one-line error naming the layer
            check_finite(R.streams[0][:B], layer)

    def _entry_rows(self, L: _Layer, sublayer: str, stream: int, threads: int) -> None:
        """A sublayer's mHC entry for every row from R.streams[stream]: the mixes in one scan of fn, the rest in one
        call (each row's the one-token call's)."""
        cfg, R = self.cfg, self.rows
        streams = _ptr(R.streams[stream])
        fn, width, scale, base, norm = L.hc_weights[sublayer]
        _call(self.kernels.c_linear, (streams, R.count, fn.cols, ctypes.byref(fn), _ptr(R.mixes), width, 0), threads)
        _call(self.hc.rows_pre_mixed, (streams, R.count, cfg.hc_mult, cfg.hidden_size, _ptr(R.mixes), _ptr(scale),
                                       _ptr(base), cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps, _ptr(norm),
                                       _ptr(R.x), _ptr(R.post), _ptr(R.comb)))


class _Rows:
    """TokenLayers' buffers for up to `capacity` tokens stepped together (`count` of them this step)."""

    def __init__(self, owner: TokenLayers, capacity: int):
        cfg = owner.cfg
        H, n_hc = cfg.hidden_size, cfg.hc_mult
        self.capacity = self.count = capacity
        self.streams = (_buffer(capacity, n_hc, H), _buffer(capacity, n_hc, H))
        self.x, self.post, self.comb = _buffer(capacity, H), _buffer(capacity, n_hc), _buffer(capacity, n_hc, n_hc)
        self.mixes = _buffer(capacity, (2 + n_hc) * n_hc)
        self.q_lora = _buffer(capacity, cfg.q_lora_rank)
        # each layer's projections and queries, rows of its own width (CSA layers have the most)
        self.proj = _buffer(capacity * max(L.projections.total for L in owner.layers))
        self.q = _buffer(capacity * max((L.indexed_queries or L.queries).total for L in owner.layers))
        self.o = _buffer(capacity, cfg.num_heads, cfg.head_dim)
        self.low_rank = _buffer(capacity, cfg.o_groups * cfg.o_lora_rank)
        self.out, self.moe_out = _buffer(capacity, H), _buffer(capacity, H)
        k = cfg.num_experts_per_tok
        self.chosen, self.weights = (ctypes.c_int64 * (capacity * k))(), (ctypes.c_float * (capacity * k))()
        self.hash_ids, self.counts = (ctypes.c_int64 * (capacity * k))(), (ctypes.c_int64 * capacity)()
        self.q_lora_rows = _row_addresses(self.q_lora, capacity)  # where the query norms write each row
        self._parts: dict[tuple[int, int], list[Tensor]] = {}

    def parts(self, layer: int, plan, row: int) -> list[Tensor]:
        """Row `row`'s views [1, width] of a layer's projections (`plan`'s spans) in `proj`, made once."""
        key = (layer, row)
        if key not in self._parts:
            proj = self.proj[:self.capacity * plan.total].view(self.capacity, plan.total)
            self._parts[key] = [proj[row:row + 1, lo:hi] for lo, hi in plan.spans]
        return self._parts[key]


def _entry(calls: tuple, threads: int) -> None:
    """A sublayer's mHC entry: the mixes on every thread, then the rest in one call."""
    (mixes, mixes_args), (rest, rest_args) = calls
    _call(mixes, mixes_args, threads)
    _call(rest, rest_args)


def _call(fn, args: tuple, *threads) -> None:
    if fn(*args, *threads):
        raise RuntimeError(f"a compiled decode call ({getattr(fn, '__name__', fn)}) refused its arguments")
