"""Compiled matmuls for a few tokens (native/token_matmul.c): decode's linears and a token's routed experts.

Decode multiplies every weight by one token, so it is a scan of the weights and runs at the memory's pace or not
at all. torch's bf16 GEMV reached 5-7 GB/s on the 2-core AVX-512 VM (its float32 one 9-14), and an expert stored
in bf16 or FP4 had to be decoded into a float32 matrix first (a write and a re-read of twice its size per use).
The kernel reads each weight as stored (F32, BF16, F16, FP4_E2M1 + E8M0 scales, MXFP4, Q8_0, F8_E4M3 + float32
scales per 128 x 128 block), turns it into float32 in registers and multiplies in float32, threads splitting the
rows:

- `linear(x, w)`: model.linear's x @ w.T for x of at most SMALL_ROWS rows and a float32 / bfloat16 w: a bfloat16 w
  takes its input rounded to bfloat16 and gives its result rounded to bfloat16, as torch's bf16 matmul does (sums in
  float32 both ways; only their order differs).
- `moe(x, experts, weights, limit, round_bf16)`: out = sum of weights[e] x expert e(x) for one token, the clamped
  SwiGLU of model.expert_forward, every chosen expert of a layer in one call, each matrix read from its stored bytes
  (`stored_matrix`). Weights are never rounded; `round_bf16` rounds the input and the hidden activation (the
  fused FP4 kernel's arithmetic, runtime/expert_decode.py).
- `linear_many`, `norm_rope`: several projections of one input, the RMS norm (and RoPE) of a token's rows, each in
  one call.
- `attend(q, key_sets, sink, scale, rotation, eps, round_bf16)`: one decoded token's attention core (per-head norm,
  RoPE, one softmax over every key set and the sink, the weighted keys, RoPE undone): ~40 small torch ops in one
  call, heads split over the threads.
- `moe_rows`, `route_rows`, `linear_many_rows`, `grouped_rows`, `attend_rows`: the same for several tokens (decode's
  batched step, one per sequence) in one call, each weight read once for all of them and each weight vector decoded
  once for up to 8 (`linear` too); each token's result is, to the bit, what the one-token call gives it.

Built once per machine (skipped with MOEPACK_NATIVE=0), used only after both the AVX-512 and the plain loop agree
with torch on every kind at load; None (callers keep torch) where it cannot be built or disagrees. A model family's
own compiled operations (native/token_matmul.h) take the library's row dot and pool of threads (`shared_entries`),
so that they compute as it does and on its threads.
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from contextlib import contextmanager

import torch

from moepack.native import LazyKernel, c_function, disable, native_library, read_source

_SOURCE = read_source("token_matmul.c")
LIBRARY = "moepack_token_matmul"
KINDS = {"F32": 0, "BF16": 1, "F16": 2, "FP4_E2M1": 3, "MXFP4": 4, "Q8_0": 5, "F8_E4M3": 6}  # the C file's enum
FP8_BLOCK = 128  # an F8_E4M3 matrix's scale blocks (FP8_BLOCK in token_matmul.h)
FLOAT_KINDS = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
SMALL_ROWS = 4  # model.linear takes the kernel up to this many input rows (decode: one)
ROUND_INPUT, ROUND_OUTPUT = 1, 2  # the C file's flags
SCORE_FUNCS = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}  # model.moe_route's scoring functions, the C enum
GROUP = 32


_local = threading.local()


@contextmanager
def using_threads(n: int):
    """The kernels called in this block (on this thread) split their rows over n threads, whatever torch's thread
    count (decode runs its small torch ops on one thread: waking OpenMP's other threads for each op costs more than
    the op)."""
    before = getattr(_local, "threads", None)
    _local.threads = max(1, int(n))
    try:
        yield
    finally:
        _local.threads = before


@contextmanager
def step_rows(n: int):
    """ops' matmuls take the kernels for up to n input rows (not only SMALL_ROWS) in this block, on this thread: a
    decode step's rows, one per sequence, whose torch ops run on one thread beside the kernels' every thread."""
    before = getattr(_local, "step_rows", None)
    _local.step_rows = int(n)
    try:
        yield
    finally:
        _local.step_rows = before


def small_rows() -> int:
    """The most input rows ops' matmuls take the kernels for here (SMALL_ROWS, or a decode step's: step_rows)."""
    return max(SMALL_ROWS, getattr(_local, "step_rows", None) or 0)


def _threads(given: int | None) -> int:
    return given or getattr(_local, "threads", None) or torch.get_num_threads()


def current_threads() -> int:
    """The thread count the kernels called now on this thread split their rows over (`using_threads`)."""
    return _threads(None)


class Matrix(ctypes.Structure):
    """native matrix_t: a weight as stored; `keep` holds the tensors its pointers point into."""
    _fields_ = [("kind", ctypes.c_int64), ("data", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("table", ctypes.c_void_p), ("rows", ctypes.c_int64), ("cols", ctypes.c_int64)]


class TokenKernels:
    def __init__(self, lib):
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        # c_*: the C entry points as they are, for a compiled caller that lays out its own arguments (DeepSeek-V4's
        # one-token path); the methods below check and wrap them
        self.c_linear = c_function(lib, "token_linear", (p, i64, i64, p, p, i64, ctypes.c_int, ctypes.c_int))
        self.c_many = c_function(lib, "token_linear_many", (p, i64, p, ctypes.c_int, p, p, p, ctypes.c_int))
        self.c_grouped = c_function(lib, "token_linear_grouped", (p, i64, i64, p, p, ctypes.c_int, ctypes.c_int))
        self.c_many_rows = c_function(lib, "token_linear_many_rows", (p, i64, i64, i64, p, ctypes.c_int, p, i64, p, p,
                                                                      ctypes.c_int))
        self.c_grouped_rows = c_function(lib, "token_linear_grouped_rows", (p, i64, i64, i64, p, p, i64, ctypes.c_int,
                                                                            ctypes.c_int))
        self.c_moe = c_function(lib, "moe_token", (p, i64, i64, p, p, p, p, ctypes.c_float, p, p, ctypes.c_int))
        self.c_moe_rows = c_function(lib, "moe_rows", (p, i64, i64, i64, p, p, p, p, p, p, p, ctypes.c_float, p,
                                                       ctypes.c_int))
        self.c_route_rows = c_function(lib, "route_rows", (p, i64, p, p, ctypes.c_int, i64, p, ctypes.c_float, p, p, p,
                                                           ctypes.c_int))
        self.c_route = c_function(lib, "route_token", (p, p, p, ctypes.c_int, i64, p, ctypes.c_float, p, p,
                                                       ctypes.c_int))
        self.c_attend = c_function(lib, "attend_token", (p, i64, i64, i64, p, ctypes.c_float, p, p, ctypes.c_int, p,
                                                         ctypes.c_float, ctypes.c_int, p, ctypes.c_int))
        self.c_attend_rows = c_function(lib, "attend_rows", (p, i64, i64, i64, i64, i64, p, ctypes.c_float, p, p, p, p,
                                                             ctypes.c_float, ctypes.c_int, p, ctypes.c_int))
        self.c_norm_rope = c_function(lib, "token_norm_rope", (p, i64, i64, p, ctypes.c_float, i64, p, p, p))
        self.c_norm_rope_rows = c_function(lib, "token_norm_rope_rows", (p, i64, i64, i64, p, ctypes.c_float, i64, p,
                                                                        p, p))
        self._set_level = c_function(lib, "token_matmul_set_level", (ctypes.c_int,), restype=None)
        self.vector = bool(c_function(lib, "token_matmul_vector_level", ())())
        # (row dot, parallel-for) addresses for a kernel compiled elsewhere (native/token_matmul.h's row_dot_fn,
        # parallel_fn); valid while the library is loaded, i.e. for the process (it is never unloaded)
        self.shared_entries = tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p)
                                    for name in ("token_matmul_dot", "token_matmul_parallel"))

    def set_vector(self, on: bool) -> None:
        """The AVX-512 loop (where built) or the plain one, for the whole process (the self-check runs both)."""
        self._set_level(int(on and self.vector))

    def linear(self, x: torch.Tensor, w: Matrix, round_bf16: bool, threads: int | None = None,
               round_output: bool = False) -> torch.Tensor:
        """float32 x [T, cols] -> float32 [T, rows] = x @ W.T; `round_bf16`: x rounded to bfloat16 first;
        `round_output`: the results rounded to bfloat16 too (a bfloat16 layer's output, kept float32)."""
        x = x.float().contiguous()
        if x.dim() != 2 or x.shape[1] != w.cols:
            raise ValueError(f"input {list(x.shape)} for a {w.rows} x {w.cols} matrix")
        out = torch.empty(x.shape[0], w.rows, dtype=torch.float32)
        if self.c_linear(x.data_ptr(), x.shape[0], x.shape[1], ctypes.byref(w), out.data_ptr(), w.rows,
                        int(round_bf16) | (ROUND_OUTPUT if round_output else 0), _threads(threads)):
            raise RuntimeError(f"the token matmul refused a {w.rows} x {w.cols} matrix of kind {w.kind}")
        return out

    def linear_many(self, x: torch.Tensor, plan: "LinearPlan", threads: int | None = None) -> list[torch.Tensor]:
        """One token x [1, cols] times the plan's matrices in one call: [x @ W_i.T ([1, rows_i])], each rounded as
        its flags say (ROUND_INPUT | ROUND_OUTPUT: `linear`'s round_bf16 / round_output)."""
        x = x.float().contiguous()
        if x.numel() != plan.cols:
            raise ValueError(f"input {list(x.shape)} for matrices of {plan.cols} columns")
        out = torch.empty(1, plan.total, dtype=torch.float32)
        if self.c_many(x.data_ptr(), plan.cols, plan.matrices, plan.count, out.data_ptr(), plan.offsets, plan.flags,
                      _threads(threads)):
            raise RuntimeError("the token matmul refused one of several matrices")
        return [out[:, a:b] for a, b in plan.spans]

    def linear_many_rows(self, x: torch.Tensor, plan: "LinearPlan", threads: int | None = None) -> list[torch.Tensor]:
        """`linear_many` of T tokens x [T, cols] in one scan of the matrices: [x @ W_i.T ([T, rows_i])], each
        token's row what linear_many gives it alone."""
        x = x.float().contiguous()
        if x.dim() != 2 or x.shape[1] != plan.cols or not x.shape[0]:
            raise ValueError(f"input {list(x.shape)} for matrices of {plan.cols} columns")
        out = torch.empty(x.shape[0], plan.total, dtype=torch.float32)
        if self.c_many_rows(x.data_ptr(), x.shape[0], plan.cols, plan.cols, plan.matrices, plan.count, out.data_ptr(),
                           plan.total, plan.offsets, plan.flags, _threads(threads)):
            raise RuntimeError("the token matmul refused one of several matrices")
        return [out[:, a:b] for a, b in plan.spans]

    def grouped_rows(self, x: torch.Tensor, w: Matrix, flags: int, threads: int | None = None) -> torch.Tensor:
        """`grouped` of T tokens x [T, G, cols] in one scan of W -> [T, G, rows / G] (flags: ROUND_INPUT |
        ROUND_OUTPUT), each token's what grouped gives it alone."""
        x = x.float().contiguous()
        if x.dim() != 3 or x.shape[2] != w.cols or not x.shape[0] or x.shape[1] < 1 or w.rows % x.shape[1]:
            raise ValueError(f"input {list(x.shape)} for a grouped {w.rows} x {w.cols} matrix")
        out = torch.empty(x.shape[0], x.shape[1], w.rows // x.shape[1], dtype=torch.float32)
        if self.c_grouped_rows(x.data_ptr(), x.shape[0], x.shape[1], x.shape[2], ctypes.byref(w), out.data_ptr(),
                              w.rows, flags, _threads(threads)):
            raise RuntimeError(f"the token matmul refused a grouped {w.rows} x {w.cols} matrix of kind {w.kind}")
        return out

    def grouped(self, x: torch.Tensor, w: Matrix, round_bf16: bool, threads: int | None = None,
                round_output: bool = False) -> torch.Tensor:
        """float32 x [G, cols] -> float32 [G, rows / G]: group g's rows of W (rows g * R ... (g + 1) * R) times
        x[g], one token's grouped projection (`round_bf16`, `round_output`: as `linear`'s)."""
        x = x.float().contiguous()
        groups = x.shape[0]
        if x.dim() != 2 or x.shape[1] != w.cols or groups < 1 or w.rows % groups:
            raise ValueError(f"input {list(x.shape)} for a grouped {w.rows} x {w.cols} matrix")
        out = torch.empty(groups, w.rows // groups, dtype=torch.float32)
        if self.c_grouped(x.data_ptr(), groups, x.shape[1], ctypes.byref(w), out.data_ptr(),
                         int(round_bf16) | (ROUND_OUTPUT if round_output else 0), _threads(threads)):
            raise RuntimeError(f"the token matmul refused a grouped {w.rows} x {w.cols} matrix of kind {w.kind}")
        return out

    def moe(self, x: torch.Tensor, experts: list[tuple[Matrix, Matrix, Matrix]], weights: torch.Tensor,
            limit: float, round_bf16: bool, threads: int | None = None, round_output: bool = False,
            flags: list[int] | None = None) -> torch.Tensor:
        """float32 x [H] -> float32 [H]: the experts' clamped SwiGLU outputs summed with `weights`, in order (each
        expert its own intermediate size). `round_bf16`: the input and hidden activation rounded to bfloat16;
        `round_output` (with it): the gate, up and output rounded too, as three bfloat16 `linear`s round them
        (model.expert_forward of the shared expert). `flags` (ROUND_INPUT | ROUND_OUTPUT per expert) replaces both:
        decode appends the shared expert, weight 1, to the routed ones."""
        x = x.float().reshape(-1).contiguous()
        weights = weights.float().reshape(-1).contiguous()
        if len(weights) != len(experts):
            raise ValueError(f"{len(weights)} weights for {len(experts)} experts")
        if flags is None:
            flags = [(ROUND_INPUT | (ROUND_OUTPUT if round_output else 0)) if round_bf16 else 0] * len(experts)
        if len(flags) != len(experts):
            raise ValueError(f"{len(flags)} flags for {len(experts)} experts")
        n, hidden = len(experts), x.shape[0]
        arrays = [(Matrix * max(n, 1))(*(e[j] for e in experts)) for j in range(3)]
        out = torch.empty(hidden, dtype=torch.float32)
        if self.c_moe(x.data_ptr(), hidden, n, *(ctypes.addressof(a) for a in arrays), weights.data_ptr(),
                     float(limit), (ctypes.c_int * max(n, 1))(*flags), out.data_ptr(), _threads(threads)):
            raise RuntimeError(f"the token MoE refused {n} experts on {hidden} inputs")
        return out

    def moe_rows(self, x: torch.Tensor, experts: list[tuple[Matrix, Matrix, Matrix]], rows: list[list[int]],
                 weights: list[list[float]], limit: float, flags: list[int],
                 threads: int | None = None) -> torch.Tensor:
        """float32 x [T, H] -> [T, H]: expert e runs on the tokens rows[e] (distinct), weighted by weights[e];
        each token's sum adds its experts in the order given, so that its row is bit for bit what `moe` gives
        it with its own experts (flags: `moe`'s). Each expert's matrices are read once for all its tokens."""
        x = x.float().contiguous()
        n = len(experts)
        if x.dim() != 2 or len(rows) != n or len(weights) != n or len(flags) != n \
                or any(len(r) != len(w) for r, w in zip(rows, weights)):
            raise ValueError(f"{n} experts with {len(rows)} token lists for input {list(x.shape)}")
        out = torch.empty_like(x)
        if self.c_moe_rows(x.data_ptr(), *x.shape, n, *moe_arguments(experts, rows, weights, flags), float(limit),
                          out.data_ptr(), _threads(threads)):
            raise RuntimeError(f"the token MoE refused {n} experts on {list(x.shape)} inputs")
        return out

    def route_rows(self, x: torch.Tensor, gate: Matrix, bias: torch.Tensor | None, score_func: str, top_k: int,
                   hash_ids: list[list[int]] | None, scale: float,
                   threads: int | None = None) -> list[tuple[list[int], list[float]]]:
        """`route` of T tokens x [T, H] in one scan of the gate (hash_ids: one list per token): each token's
        (expert ids ascending, weights), what route gives it alone."""
        x = x.float().contiguous()
        T = x.shape[0]
        if (x.dim() != 2 or x.shape[1] != gate.cols or not T or score_func not in SCORE_FUNCS
                or (hash_ids is not None and (len(hash_ids) != T or any(len(h) != top_k for h in hash_ids)))
                or (bias is not None and (bias.dtype != torch.float32 or bias.numel() != gate.rows
                                          or not bias.is_contiguous()))):
            raise ValueError(f"router input {list(x.shape)} for a {gate.rows} x {gate.cols} gate ({score_func})")
        chosen, weights, counts = (ctypes.c_int64 * (T * top_k))(), (ctypes.c_float * (T * top_k))(), \
            (ctypes.c_int64 * T)()
        ids = (ctypes.c_int64 * (T * top_k))(*(e for h in hash_ids for e in h)) if hash_ids is not None else None
        if self.c_route_rows(x.data_ptr(), T, ctypes.byref(gate), bias.data_ptr() if bias is not None else None,
                            SCORE_FUNCS[score_func], top_k, ids, float(scale), chosen, weights, counts,
                            _threads(threads)):
            raise RuntimeError(f"the token router refused {top_k} of {gate.rows} experts ({score_func})")
        return [(chosen[t * top_k:t * top_k + counts[t]], weights[t * top_k:t * top_k + counts[t]])
                for t in range(T)]

    def route(self, x: torch.Tensor, gate: Matrix, bias: torch.Tensor | None, score_func: str, top_k: int,
              hash_ids: list[int] | None, scale: float, threads: int | None = None) -> tuple[list[int], list[float]]:
        """One token's router (model.moe_route, then decode's token_choice): scores = score_func(gate @ x) over the
        experts (gate's rows); the top_k by score + bias (ties: the lower id), or `hash_ids`; their scores
        renormalised over the k, times `scale`. -> (expert ids ascending, an expert picked twice once; their
        weights, a repeated expert's added)."""
        x = x.float().reshape(-1).contiguous()
        if (x.numel() != gate.cols or score_func not in SCORE_FUNCS
                or (hash_ids is not None and len(hash_ids) != top_k)
                or (bias is not None and (bias.dtype != torch.float32 or bias.numel() != gate.rows
                                          or not bias.is_contiguous()))):
            raise ValueError(f"router input {list(x.shape)} for a {gate.rows} x {gate.cols} gate ({score_func})")
        chosen, weights = (ctypes.c_int64 * top_k)(), (ctypes.c_float * top_k)()
        ids = (ctypes.c_int64 * top_k)(*hash_ids) if hash_ids is not None else None
        n = self.c_route(x.data_ptr(), ctypes.byref(gate), bias.data_ptr() if bias is not None else None,
                        SCORE_FUNCS[score_func], top_k, ids, float(scale), chosen, weights, _threads(threads))
        if n < 0:
            raise RuntimeError(f"the token router refused {top_k} of {gate.rows} experts ({score_func})")
        return chosen[:n], weights[:n]

    def attend(self, q: torch.Tensor, key_sets: list[torch.Tensor], sink: torch.Tensor, scale: float,
               rotation: torch.Tensor, eps: float, round_bf16: bool, threads: int | None = None) -> torch.Tensor:
        """One decoded token's attention core: q [heads, D] (wq_b's output) -> [heads, D]. Each head is RMS-normed
        (no weight) and its last 2 x rotation.shape[-1] channels rotated by `rotation` (complex [rope_dim / 2], the
        token's angles); one softmax spans q . k x scale over every key of the float32 sets [K, D] and the per-head
        `sink` logit; the keys weighted by it, summed set by set, rotated back. `round_bf16`: the query, logits,
        probabilities and each set's sum rounded to bfloat16 (the keys must be rounded already)."""
        heads, dim = q.shape
        q = q.float().contiguous()
        rot = angle_pairs(rotation)
        sets = [k.float().contiguous() for k in key_sets if k.shape[0]]
        if any(k.dim() != 2 or k.shape[1] != dim for k in sets) or sink.numel() != heads or 2 * rot.shape[0] > dim:
            raise ValueError(f"keys {[list(k.shape) for k in key_sets]} and sink {list(sink.shape)} for a query "
                             f"{list(q.shape)}")
        sink = sink.float().contiguous()
        pointers = (ctypes.c_void_p * max(len(sets), 1))(*(k.data_ptr() for k in sets))
        counts = (ctypes.c_int64 * max(len(sets), 1))(*(k.shape[0] for k in sets))
        out = torch.empty(heads, dim, dtype=torch.float32)
        if self.c_attend(q.data_ptr(), heads, dim, 2 * rot.shape[0], rot.data_ptr(), eps, pointers, counts,
                        len(sets), sink.data_ptr(), scale, int(round_bf16), out.data_ptr(), _threads(threads)):
            raise RuntimeError(f"the token attention refused a query {list(q.shape)}")
        return out

    def attend_rows(self, q: torch.Tensor, key_sets: list[list[torch.Tensor]], sink: torch.Tensor, scale: float,
                    rotations: list[torch.Tensor], eps: float, round_bf16: bool,
                    threads: int | None = None) -> torch.Tensor:
        """`attend` of T tokens in one call: q [T, heads, D], token t's key sets key_sets[t] and rotation
        rotations[t] -> [T, heads, D], each token's what attend gives it alone."""
        T, heads, dim = q.shape
        q = q.float().contiguous()
        rot = torch.stack([angle_pairs(r) for r in rotations]).contiguous()
        sets = [[k.float().contiguous() for k in row if k.shape[0]] for row in key_sets]
        if (len(sets) != T or rot.shape[0] != T or sink.numel() != heads or 2 * rot.shape[1] > dim
                or any(k.dim() != 2 or k.shape[1] != dim for row in sets for k in row)):
            raise ValueError(f"keys and rotations for {len(key_sets)} tokens for queries {list(q.shape)}")
        sink = sink.float().contiguous()
        out = torch.empty(T, heads, dim, dtype=torch.float32)
        if self.c_attend_rows(q.data_ptr(), T, heads * dim, heads, dim, 2 * rot.shape[1], rot.data_ptr(), eps,
                             *attend_rows_arguments(sets), sink.data_ptr(), scale, int(round_bf16), out.data_ptr(),
                             _threads(threads)):
            raise RuntimeError(f"the token attention refused queries {list(q.shape)}")
        return out

    def norm_rope(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                  rotation: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  out_low: torch.Tensor | None = None) -> torch.Tensor:
        """model.rms_norm(x, weight, eps) of float32 rows x [..., cols], then (with `rotation`, complex
        [rope_dim / 2]: one token's angles) model.apply_rope of every row by it, in one call; written into `out`
        where given (contiguous float32, x's size), and rounded to bfloat16 into `out_low` too where given."""
        x = x.float().contiguous()
        cols = x.shape[-1]
        rot = angle_pairs(rotation) if rotation is not None else None
        if weight is not None:
            weight = weight.float().contiguous()
        if (weight is not None and weight.numel() != cols) or (rot is not None and 2 * rot.shape[0] > cols):
            raise ValueError(f"rows of {cols} for a norm weight / rotation of another size")
        for given in (out, out_low):
            if given is not None and (given.dtype != torch.float32 or not given.is_contiguous()
                                      or given.numel() != x.numel()):
                raise ValueError(f"an output of {given.dtype} {list(given.shape)} for rows {list(x.shape)}")
        out = torch.empty_like(x) if out is None else out
        if self.c_norm_rope(x.data_ptr(), x.numel() // cols, cols, weight.data_ptr() if weight is not None else None,
                           eps, 2 * rot.shape[0] if rot is not None else 0, rot.data_ptr() if rot is not None else None,
                           out.data_ptr(), out_low.data_ptr() if out_low is not None else None):
            raise RuntimeError(f"the token norm refused rows of {cols}")
        return out


def moe_arguments(experts: list[tuple[Matrix, Matrix, Matrix]], rows: list[list[int]], weights: list[list[float]],
                  flags: list[int]) -> tuple:
    """moe_rows' C arguments after x's: the experts' w1, w3, w2 arrays, their flags, and their (token, weight)
    pairs as starts [n + 1], tokens, weights."""
    n = max(len(experts), 1)
    starts = [0]
    for r in rows:
        starts.append(starts[-1] + len(r))
    pairs = max(starts[-1], 1)
    return (*((Matrix * n)(*(e[j] for e in experts)) for j in range(3)), (ctypes.c_int * n)(*flags),
            (ctypes.c_int64 * (len(starts)))(*starts), (ctypes.c_int64 * pairs)(*(t for r in rows for t in r)),
            (ctypes.c_float * pairs)(*(w for ws in weights for w in ws)))


def attend_rows_arguments(key_sets: list[list[torch.Tensor]]) -> tuple:
    """attend_rows' C arguments for each token's non-empty float32 key sets [K, D]: every set's address and row
    count, one token after another, and each token's number of sets."""
    flat = [k for row in key_sets for k in row]
    return ((ctypes.c_void_p * max(len(flat), 1))(*(k.data_ptr() for k in flat)),
            (ctypes.c_int64 * max(len(flat), 1))(*(k.shape[0] for k in flat)),
            (ctypes.c_int * len(key_sets))(*(len(row) for row in key_sets)))


def rotated(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """model.apply_rope of float64 rows x by complex angles `rotation` [rope_dim / 2] (the self-checks' reference)."""
    rope_dim = 2 * rotation.shape[-1]
    pairs = torch.view_as_complex(x[..., -rope_dim:].contiguous().unflatten(-1, (-1, 2)))
    pairs = pairs * rotation.reshape(-1).to(torch.complex128)
    return torch.cat([x[..., :-rope_dim], torch.view_as_real(pairs).flatten(-2)], -1)


def _normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def reference_attend(q, key_sets, sink, scale, rotation, eps, round_bf16) -> torch.Tensor:
    """TokenKernels.attend in float64 torch (the self-check's reference; rounding where the kernel rounds)."""
    def rounded(t):
        return t.float().bfloat16().double() if round_bf16 else t
    q = rounded(rotated(_normed(q, eps), rotation))
    sets = [k.double() for k in key_sets if k.shape[0]]
    logits = [rounded(q @ k.T) * scale for k in sets]
    peak = torch.stack([x.amax(-1) for x in logits] + [sink.double()]).amax(0)
    weights = [(x - peak[:, None]).exp() for x in logits]
    total = (sink.double() - peak).exp() + sum(w.sum(-1) for w in weights)
    out = sum(rounded(rounded(w / total[:, None]) @ k) for w, k in zip(weights, sets))
    return rotated(out, rotation.conj())


def angle_pairs(rotation: torch.Tensor) -> torch.Tensor:
    """A token's complex rotation [rope_dim / 2] as the kernels read it: float32 (cos, sin) pairs."""
    return torch.view_as_real(rotation.reshape(-1)).float().contiguous()


class LinearPlan:
    """Several matrices of one column count, arranged once for `linear_many` (their descriptors, flags and places
    in one output row): decode multiplies the same few matrices by each token. The tensors the descriptors point
    into must outlive the plan's use."""

    def __init__(self, ws: list[Matrix], flags: list[int]):
        if not ws or len(flags) != len(ws) or len({w.cols for w in ws}) != 1:
            raise ValueError(f"matrices of {[w.cols for w in ws]} columns with {len(flags)} flags")
        self.cols, self.count = ws[0].cols, len(ws)
        starts = [sum(w.rows for w in ws[:i]) for i in range(len(ws) + 1)]
        self.total = starts[-1]
        self.spans = list(zip(starts[:-1], starts[1:]))
        self.matrices = (Matrix * len(ws))(*ws)
        self.offsets = (ctypes.c_int64 * len(ws))(*starts[:-1])
        self.flags = (ctypes.c_int * len(ws))(*flags)


_FLOAT_MATRICES: dict[tuple, Matrix] = {}  # a descriptor is its fields: the same fields, the same (valid) Matrix
_MAX_FLOAT_MATRICES = 4096


def float_matrix(w: torch.Tensor) -> Matrix:
    """A contiguous float32 / bfloat16 / float16 [rows, cols] tensor as a Matrix (w must outlive its use). Made once
    per (address, shape, dtype): decode asks for each dense weight's on every token."""
    if w.dim() != 2 or w.dtype not in FLOAT_KINDS or not w.is_contiguous() or w.device.type != "cpu":
        raise ValueError(f"not a contiguous CPU float matrix: {w.dtype} {list(w.shape)}")
    key = (w.data_ptr(), w.shape[0], w.shape[1], w.dtype)
    matrix = _FLOAT_MATRICES.get(key)
    if matrix is None:
        if len(_FLOAT_MATRICES) >= _MAX_FLOAT_MATRICES:
            _FLOAT_MATRICES.clear()
        matrix = _FLOAT_MATRICES[key] = Matrix(KINDS[FLOAT_KINDS[w.dtype]], w.data_ptr(), None, None, w.shape[0],
                                               w.shape[1])
    return matrix


def stored_matrix(kind: str, data: torch.Tensor, rows: int, cols: int, scale: torch.Tensor | None = None,
                  table: torch.Tensor | None = None) -> Matrix:
    """A weight from its stored bytes (uint8 CPU tensors, contiguous): `kind` a KINDS name; FP4_E2M1 takes its E8M0
    `scale` bytes ([rows, cols / 32]), F8_E4M3 its block scales as float32 ([ceil(rows / 128), ceil(cols / 128)]:
    fp8_block_scales); both FP4 kinds their code values `table` (float32 [256, 16], row s the values of codes 0..15
    under scale byte s). The tensors must outlive the Matrix's use."""
    if kind not in KINDS:
        raise ValueError(f"the token matmul has no {kind} weights")
    need = {"F32": 4 * cols, "BF16": 2 * cols, "F16": 2 * cols, "FP4_E2M1": cols // 2,
            "MXFP4": cols // GROUP * 17, "Q8_0": cols // GROUP * 34, "F8_E4M3": cols}[kind] * rows
    if data.numel() * data.element_size() < need or (kind in ("FP4_E2M1", "MXFP4", "Q8_0") and cols % GROUP):
        raise ValueError(f"{kind} [{rows}, {cols}] needs {need} bytes, got {data.numel() * data.element_size()}")
    if kind in ("FP4_E2M1", "MXFP4") and (table is None or table.dtype != torch.float32 or table.numel() != 256 * 16):
        raise ValueError(f"{kind} needs its float32 [256, 16] value table")
    if kind == "FP4_E2M1" and (scale is None or scale.numel() < rows * cols // GROUP):
        raise ValueError(f"FP4_E2M1 [{rows}, {cols}] needs {rows * cols // GROUP} scale bytes")
    if kind == "F8_E4M3" and (scale is None or scale.dtype != torch.float32 or not scale.is_contiguous()
                              or tuple(scale.shape) != fp8_scale_blocks(rows, cols)):
        raise ValueError(f"F8_E4M3 [{rows}, {cols}] needs contiguous float32 block scales "
                         f"{list(fp8_scale_blocks(rows, cols))}")
    return Matrix(KINDS[kind], data.data_ptr(), scale.data_ptr() if scale is not None else None,
                  table.data_ptr() if table is not None else None, rows, cols)


def fp8_scale_blocks(rows: int, cols: int) -> tuple[int, int]:
    """The shape of an F8_E4M3 [rows, cols] weight's block scales."""
    return -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)


def fp8_block_scales(scale: torch.Tensor) -> torch.Tensor:
    """An F8_E4M3 weight's stored block scales (E8M0, or a float dtype: Qwen3's weight_scale_inv) as the float32
    the kernel multiplies by: the factors its decoders apply (format_spec.source_formats), in a tensor of their own
    (never a view of the stored bytes, which a Matrix holding it would keep alive)."""
    return scale.to(torch.float32, copy=True).contiguous()


def _reference_values(kind: str, data: torch.Tensor, rows: int, cols: int, scale=None) -> torch.Tensor:
    """The container's own decoders, for the self-check."""
    from moepack.format_spec import quants, source_formats

    if kind == "F8_E4M3":
        return source_formats.fp8_float_block_dequantize(data.view(torch.float8_e4m3fn).reshape(rows, cols), scale)

    if kind in ("F32", "BF16", "F16"):
        dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[kind]
        return data.view(dtype).reshape(rows, cols).float()
    if kind == "FP4_E2M1":
        return source_formats.fp4_dequantize(data.reshape(rows, cols // 2),
                                             scale.reshape(rows, cols // GROUP).view(torch.float8_e8m0fnu))
    return quants.dequantize_torch(data, kind, (rows, cols))


def _random_stored(kind: str, rows: int, cols: int, gen: torch.Generator):
    """Random stored bytes of a [rows, cols] weight of `kind` with normal magnitudes: (data, scale)."""
    def rand_bytes(n):
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    if kind in ("F32", "BF16", "F16"):
        dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[kind]
        return torch.randn(rows * cols, generator=gen).to(dtype).view(torch.uint8), None
    if kind == "F8_E4M3":  # every code but the two NaNs; scales over a few binades, not powers of two
        codes = rand_bytes(rows * cols)
        codes[(codes & 0x7F) == 0x7F] = 0x3F
        return codes, torch.rand(fp8_scale_blocks(rows, cols), generator=gen) * 0.05 + 1e-3
    groups = rows * cols // GROUP
    if kind == "FP4_E2M1":
        return rand_bytes(groups * 16), torch.randint(118, 136, (groups,), dtype=torch.uint8, generator=gen)
    if kind == "MXFP4":
        blocks = rand_bytes(groups * 17).view(groups, 17)
        blocks[:, 0] = torch.randint(118, 136, (groups,), dtype=torch.uint8, generator=gen)
        return blocks.reshape(-1), None
    blocks = rand_bytes(groups * 34).view(groups, 34)
    blocks[:, :2] = (torch.rand(groups, generator=gen) * 0.02 + 1e-3).to(torch.float16).view(torch.uint8).view(-1, 2)
    return blocks.reshape(-1), None


def value_table(kind: str) -> torch.Tensor:
    """float32 [256, 16]: row s = the values of FP4 codes 0..15 under E8M0 scale byte s, from `kind`'s decoder."""
    scales = torch.arange(256, dtype=torch.uint8)
    if kind == "FP4_E2M1":
        codes = torch.arange(16, dtype=torch.uint8)  # code c as the low nibble of byte c: values 2c (and 0)
        values = _reference_values(kind, codes.repeat(256), 256, GROUP, scales)
        return values[:, 0::2].contiguous()
    blocks = torch.cat([scales[:, None], torch.arange(16, dtype=torch.uint8).repeat(256, 1)], 1)
    return _reference_values(kind, blocks.reshape(-1), 256, GROUP)[:, :16].contiguous()


def _self_check(kernels: TokenKernels) -> str | None:
    """Why the kernel disagrees with torch on random weights of every kind (None: it agrees), in both loops."""
    gen = torch.Generator().manual_seed(0)
    tables = {k: value_table(k) for k in ("FP4_E2M1", "MXFP4")}
    for vector in sorted({False, kernels.vector}):
        kernels.set_vector(vector)
        for kind in KINDS:
            # vector tails, odd rows; F8_E4M3 two blocks of columns
            rows, cols = 37, {"FP4_E2M1": 96, "MXFP4": 96, "Q8_0": 96, "F8_E4M3": 147}.get(kind, 53)
            data, scale = _random_stored(kind, rows, cols, gen)
            w = stored_matrix(kind, data, rows, cols, scale, tables.get(kind))
            values = _reference_values(kind, data, rows, cols, scale).double()
            for round_bf16 in (False, True):
                x = torch.randn(3, cols, generator=gen)
                xr = x.bfloat16().double() if round_bf16 else x.double()
                want, got = xr @ values.T, kernels.linear(x, w, round_bf16, threads=2).double()
                if not torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())):
                    return f"{kind} rows (vector loop: {vector}) differ from torch's"
            if rows % 37 == 0:  # grouped: 37 groups of one row each, each on its own input
                x = torch.randn(37, cols, generator=gen)
                want = (x.double() * values).sum(1, keepdim=True)
                got = kernels.grouped(x, w, False, threads=2).double()
                if not torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())):
                    return f"{kind} grouped rows (vector loop: {vector}) differ from torch's"
                tokens = torch.randn(2, 37, cols, generator=gen)  # two tokens in one scan
                want = (tokens.double() * values).sum(2, keepdim=True)
                got = kernels.grouped_rows(tokens, w, 0, threads=2).double()
                if not torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())):
                    return f"{kind} grouped rows of two tokens (vector loop: {vector}) differ from torch's"
        hidden, inter, limit = 64, 96, 7.0  # one expert of each FP4 kind and one float, mixed
        kinds = (("FP4_E2M1", "FP4_E2M1", "MXFP4"), ("MXFP4", "Q8_0", "FP4_E2M1"), ("BF16", "F32", "F16"))
        experts, refs, keep = [], [], []
        for k1, k3, k2 in kinds:
            mats, vals = [], []
            for kind, (rows, cols) in zip((k1, k3, k2), ((inter, hidden), (inter, hidden), (hidden, inter))):
                data, scale = _random_stored(kind, rows, cols, gen)
                keep.append((data, scale))
                mats.append(stored_matrix(kind, data, rows, cols, scale, tables.get(kind)))
                vals.append(_reference_values(kind, data, rows, cols, scale).double())
            experts.append(tuple(mats))
            refs.append(vals)
        x, weights = torch.randn(hidden, generator=gen), torch.rand(len(kinds), generator=gen)
        want = torch.zeros(hidden, dtype=torch.float64)
        for (w1, w3, w2), weight in zip(refs, weights.double()):
            gate = (w1 @ x.double()).clamp(max=limit)
            up = (w3 @ x.double()).clamp(-limit, limit)
            want += weight * (w2 @ (torch.nn.functional.silu(gate) * up))
        got = kernels.moe(x, experts, weights, limit, False, threads=2).double()
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max())):
            return f"the MoE (vector loop: {vector}) differs from torch's"
        # one expert of bfloat16 linears (the shared expert), alone and appended to the others with another size
        shared_weights = [torch.randn(*shape, generator=gen).bfloat16() for shape in ((48, 64), (48, 64), (64, 48))]
        shared = _shared_reference(x, shared_weights, limit)
        matrices = tuple(float_matrix(w) for w in shared_weights)
        got = kernels.moe(x, [matrices], torch.ones(1), limit, True, threads=2, round_output=True).double()
        if not torch.allclose(got, shared, rtol=1e-2, atol=1e-2 * float(shared.abs().max())):
            return f"one expert of bfloat16 linears (vector loop: {vector}) differs from torch's"
        got = kernels.moe(x, experts + [matrices], torch.cat([weights, torch.ones(1)]), limit, False, threads=2,
                          flags=[0] * len(experts) + [ROUND_INPUT | ROUND_OUTPUT]).double()
        if not torch.allclose(got, want + shared, rtol=1e-2, atol=1e-4 * float((want + shared).abs().max())):
            return f"routed experts and a shared one (vector loop: {vector}) differ from torch's"
        reason = _check_moe_rows(kernels, experts, refs, (matrices, shared_weights), limit, gen)
        if reason is not None:
            return f"{reason} (vector loop: {vector})"
        reason = _check_router(kernels, gen)
        if reason is not None:
            return f"{reason} (vector loop: {vector})"
        mats, refs, keep = [], [], []  # several matrices on one token, float and stored kinds mixed
        for kind, rows in (("BF16", 37), ("F32", 5), ("Q8_0", 70)):
            data, scale = _random_stored(kind, rows, 96, gen)
            keep.append(data)
            mats.append(stored_matrix(kind, data, rows, 96, scale, tables.get(kind)))
            refs.append(_reference_values(kind, data, rows, 96, scale).double())
        flags = [ROUND_INPUT | ROUND_OUTPUT, 0, ROUND_INPUT]
        # one token, then three and six in one scan (two rows side by side, six inputs as four and two)
        for tokens in (1, 3, 6):
            x = torch.randn(tokens, 96, generator=gen)
            plan = LinearPlan(mats, flags)
            outs = kernels.linear_many(x, plan, threads=2) if tokens == 1 else kernels.linear_many_rows(x, plan, 2)
            if tokens > 1 and not all(torch.equal(torch.cat([o[t:t + 1] for o in outs], 1),
                                                  torch.cat(kernels.linear_many(x[t:t + 1], plan, threads=2), 1))
                                      for t in range(tokens)):
                return f"several matrices on {tokens} tokens (vector loop: {vector}) differ from one token's"
            for got, values, flag in zip(outs, refs, flags):
                want = (x.bfloat16().double() if flag & ROUND_INPUT else x.double()) @ values.T
                want = want.float().bfloat16().double() if flag & ROUND_OUTPUT else want
                if not torch.allclose(got.double(), want, rtol=1e-2 if flag & ROUND_OUTPUT else 1e-5,
                                      atol=1e-5 * float(want.abs().max())):
                    return f"several matrices on {tokens} token(s) (vector loop: {vector}) differ from torch's"
        rows = torch.randn(3, 44, generator=gen)
        weight, angles = torch.rand(44, generator=gen) + 0.5, torch.rand(1, 10, generator=gen) * 6
        rotation = torch.polar(torch.full_like(angles, 1.1), angles)
        want = rotated(_normed(rows, 1e-6) * weight.double(), rotation)
        out, out_low = torch.empty(3, 44), torch.empty(3, 44)
        kernels.norm_rope(rows, weight, 1e-6, rotation, out=out, out_low=out_low)
        if not torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5) or not torch.equal(
                out_low, out.bfloat16().float()):
            return "the token norm and RoPE differ from torch's"
        heads, dim = 5, 40  # a dimension off the vector width; an empty set
        q, sink = torch.randn(heads, dim, generator=gen) * 3, torch.randn(heads, generator=gen)
        angles = torch.rand(12, generator=gen) * 6
        rotation = torch.polar(torch.full_like(angles, 1.1), angles)
        for round_bf16 in (False, True):
            sets = [torch.randn(n, dim, generator=gen) for n in (19, 0, 7)]
            sets = [k.bfloat16().float() for k in sets] if round_bf16 else sets
            want = reference_attend(q, sets, sink, 0.3, rotation, 1e-6, round_bf16)
            got = kernels.attend(q, sets, sink, 0.3, rotation, 1e-6, round_bf16, threads=2).double()
            if not torch.allclose(got, want, rtol=1e-2 if round_bf16 else 1e-5, atol=1e-2 if round_bf16 else 1e-5):
                return f"the token attention (vector loop: {vector}) differs from torch's"
            # three tokens in one call: the first as above, one with no keys, one with its own keys and angles
            other = [torch.randn(5, dim, generator=gen)]
            other = [k.bfloat16().float() for k in other] if round_bf16 else other
            turned = torch.polar(torch.full_like(angles, 1.1), torch.rand(12, generator=gen) * 6)
            queries = torch.stack([q, q * 0.5, torch.randn(heads, dim, generator=gen)])
            rows = kernels.attend_rows(queries, [sets, [], other], sink, 0.3, [rotation, rotation, turned], 1e-6,
                                       round_bf16, threads=2)
            for row, keys, turn, query in zip(rows, [sets, [], other], [rotation, rotation, turned], queries):
                want = reference_attend(query, keys, sink, 0.3, turn, 1e-6, round_bf16) if keys else \
                    torch.zeros(heads, dim, dtype=torch.float64)  # (only the sink: nothing attended to)
                if not torch.allclose(row.double(), want, rtol=1e-2 if round_bf16 else 1e-5,
                                      atol=1e-2 if round_bf16 else 1e-5):
                    return f"the attention of several tokens (vector loop: {vector}) differs from torch's"
    kernels.set_vector(True)
    return None


def merged_choice(ids, weights) -> dict[int, float]:
    """Chosen experts and their weights as {expert id: weight} in ascending id, an expert chosen twice (a hash
    layer may) once with its weights added: decode's token_choice, and what route_token returns."""
    chosen: dict[int, float] = {}
    for e, weight in sorted(zip(ids, weights)):
        chosen[e] = chosen.get(e, 0.0) + weight
    return chosen


def reference_route(x, gate, bias, score_func: str, top_k: int, hash_ids, scale: float):
    """`TokenKernels.route` in float64 torch: (expert ids ascending, their weights)."""
    logits = gate.double() @ x.double()
    scores = {"sqrtsoftplus": lambda v: torch.nn.functional.softplus(v).sqrt(), "sigmoid": torch.sigmoid,
              "softmax": lambda v: torch.softmax(v, -1)}[score_func](logits)
    ids = hash_ids if hash_ids is not None else (scores + (bias.double() if bias is not None else 0)).topk(
        top_k).indices.tolist()
    picked = scores[ids]
    chosen = merged_choice(ids, (picked / (picked.sum() + 1e-20) * scale).tolist())
    return list(chosen), list(chosen.values())


def _check_router(kernels: TokenKernels, gen: torch.Generator) -> str | None:
    """Why the compiled router disagrees with reference_route (None: it agrees): every scoring function, with and
    without a bias, learned and hash choices (one with a repeated expert)."""
    experts, cols = 19, 40
    gate = torch.randn(experts, cols, generator=gen) * 0.3
    for score_func in SCORE_FUNCS:
        for bias in (None, torch.randn(experts, generator=gen) * 0.1):
            for hash_ids in (None, [3, 11, 3, 0]):
                x = torch.randn(cols, generator=gen)
                want = reference_route(x, gate, bias, score_func, 4, hash_ids, 1.5)
                ids, weights = kernels.route(x, float_matrix(gate), bias, score_func, 4, hash_ids, 1.5, threads=2)
                more = torch.randn(2, cols, generator=gen)  # and three tokens in one scan of the gate
                rows = kernels.route_rows(torch.cat([x[None], more]), float_matrix(gate), bias, score_func, 4,
                                          [hash_ids, hash_ids, [1, 2, 3, 4]] if hash_ids else None, 1.5, threads=2)
                wants = [want, *(reference_route(r, gate, bias, score_func, 4, h, 1.5)
                                 for r, h in zip(more, [hash_ids, [1, 2, 3, 4]] if hash_ids else [None, None]))]
                for (ids, weights), want in zip([(ids, weights), *rows], [want, *wants]):
                    if ids != want[0] or not torch.allclose(torch.tensor(weights, dtype=torch.float64),
                                                            torch.tensor(want[1], dtype=torch.float64), rtol=1e-5,
                                                            atol=1e-6):
                        return f"the token router ({score_func}, bias: {bias is not None}, hash: {bool(hash_ids)}) " \
                               "differs from torch's"
    return None


def _shared_reference(x: torch.Tensor, weights: list[torch.Tensor], limit: float) -> torch.Tensor:
    """An expert of bfloat16 linears (w1, w3, w2: the shared expert) on x [H], float64 torch, rounded where three
    bfloat16 linears round."""
    w1, w3, w2 = (w.double() for w in weights)
    gate = (x.bfloat16().double() @ w1.T).float().bfloat16().double().clamp(max=limit)
    up = (x.bfloat16().double() @ w3.T).float().bfloat16().double().clamp(-limit, limit)
    hidden = (torch.nn.functional.silu(gate) * up).float().bfloat16().double()
    return (hidden @ w2.T).float().bfloat16().double()


def _check_moe_rows(kernels: TokenKernels, experts: list, refs: list, shared: tuple, limit: float,
                    gen: torch.Generator) -> str | None:
    """Why moe_rows disagrees with torch (None: it agrees): three tokens, the routed `experts` (float64 values
    `refs`) each on some of them, the bfloat16 shared expert (`shared`: its Matrices, its tensors) on all; each
    token's row also equal to the bit to moe_token's on that token alone."""
    (shared, shared_weights), hidden = shared, experts[0][2].rows
    x = torch.randn(3, hidden, generator=gen)
    rows = [[0, 2], [1], [2, 1]]
    weights = [[float(w) for w in torch.rand(len(r), generator=gen)] for r in rows]
    got = kernels.moe_rows(x, experts + [shared], rows + [[0, 1, 2]], weights + [[1.0] * 3], limit,
                           [0] * len(experts) + [ROUND_INPUT | ROUND_OUTPUT], threads=2)
    for t in range(3):
        mine = [e for e, r in enumerate(rows) if t in r]
        picked = [weights[e][rows[e].index(t)] for e in mine]
        want = torch.zeros(hidden, dtype=torch.float64)
        for e, weight in zip(mine, picked):
            w1, w3, w2 = refs[e]
            gate = (w1 @ x[t].double()).clamp(max=limit)
            up = (w3 @ x[t].double()).clamp(-limit, limit)
            want += weight * (w2 @ (torch.nn.functional.silu(gate) * up))
        want += _shared_reference(x[t], shared_weights, limit)
        if not torch.allclose(got[t].double(), want, rtol=1e-2, atol=1e-4 * float(want.abs().max())):
            return "the experts of one of several tokens differ from torch's"
        alone = kernels.moe(x[t], [experts[e] for e in mine] + [shared], torch.tensor(picked + [1.0]), limit, False,
                            threads=2, flags=[0] * len(mine) + [ROUND_INPUT | ROUND_OUTPUT])
        if not torch.equal(got[t], alone):
            return "the MoE of several tokens differs from one token's"
    return None


def _load() -> TokenKernels | None:
    lib = native_library(LIBRARY, _SOURCE)
    if lib is None:
        return None
    kernels = TokenKernels(lib)
    reason = _self_check(kernels)
    if reason is not None:
        disable(LIBRARY, reason)
        warnings.warn(f"moepack: the compiled token matmul disagrees with torch ({reason}); not using it",
                      RuntimeWarning)
        return None
    return kernels


token_kernels = LazyKernel(_load)  # token_kernels() -> TokenKernels or None
