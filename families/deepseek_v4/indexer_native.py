"""The Lightning Indexer's scores for one decoded token, compiled (indexer.c beside this file): a CSA layer's decode
step scores every complete compressed entry against the token's indexer query and attends to the index_topk best.

score(t) = sum_h head_weights[h] x relu(q_h . keys_t), q's last rope channels of each head rotated first; with
`round_bf16` the query and each product rounded to bfloat16, as model.indexer_topk's bfloat16 matmul rounds them.
The kernel runs on the shared token matmul library (backends/token_kernels.py): its row dot and its threads, bound
once at load, so the products are that library's, to the bit. Built once per machine into native/'s cache (skipped
with MOEPACK_NATIVE=0, or where the token matmul is not used), and used only after it agrees with a float64
reference in both of that library's loops; None otherwise (the caller keeps model.py's torch path).
"""

from __future__ import annotations

import ctypes
import os
import warnings

import torch

from moepack.backends import token_kernels
from moepack.native import LazyKernel, c_function, disable, native_library, read_source

_SOURCE = read_source(os.path.join(os.path.dirname(os.path.abspath(__file__)), "indexer.c"))
LIBRARY = "moepack_indexer"


class IndexerKernel:
    def __init__(self, lib, kernels: token_kernels.TokenKernels):
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._index = c_function(lib, "index_token", (p, i64, i64, i64, p, p, i64, p, ctypes.c_int, p, ctypes.c_int))
        c_function(lib, "indexer_bind", (p, p), restype=None)(*kernels.shared_entries)

    def scores(self, q: torch.Tensor, rotation: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor,
               round_bf16: bool, threads: int | None = None) -> torch.Tensor:
        """The scores of one decoded token: q [heads, D] (the indexer's wq_b output), its last
        2 x rotation.shape[-1] channels of each head rotated by `rotation`; keys [T, D] float32 (rounded already
        where `round_bf16`) -> [T] float32, score(t) = sum_h head_weights[h] x relu(q_h . keys_t), the query and
        each product rounded to bfloat16 where `round_bf16`. Threads: token_kernels.current_threads() unless
        given."""
        heads, dim = q.shape
        q, keys = q.float().contiguous(), keys.float().contiguous()
        rot = token_kernels.angle_pairs(rotation)
        head_weights = head_weights.float().reshape(-1).contiguous()
        if keys.dim() != 2 or keys.shape[1] != dim or head_weights.numel() != heads or 2 * rot.shape[0] > dim:
            raise ValueError(f"keys {list(keys.shape)} for an indexer query {list(q.shape)}")
        scores = torch.empty(keys.shape[0], dtype=torch.float32)
        if self._index(q.data_ptr(), heads, dim, 2 * rot.shape[0], rot.data_ptr(), keys.data_ptr(), keys.shape[0],
                       head_weights.data_ptr(), int(round_bf16), scores.data_ptr(),
                       threads or token_kernels.current_threads()):
            raise RuntimeError(f"the token indexer refused a query {list(q.shape)}")
        return scores


def reference_scores(q, rotation, keys, head_weights, round_bf16: bool) -> torch.Tensor:
    """IndexerKernel.scores in float64 torch (the self-check's reference; rounding where the kernel rounds)."""
    def rounded(t):
        return t.float().bfloat16().double() if round_bf16 else t
    products = rounded(rounded(token_kernels.rotated(q.double(), rotation)) @ keys.double().T)
    return head_weights.double() @ products.relu()


def _self_check(indexer: IndexerKernel, kernels: token_kernels.TokenKernels) -> str | None:
    """Why the kernel disagrees with reference_scores (None: it agrees), in both of the token matmul's loops: heads
    of a dimension off the vector width, bfloat16 rounding on and off, no keys."""
    gen = torch.Generator().manual_seed(0)
    rotation = torch.polar(torch.full((10,), 1.1), torch.rand(10, generator=gen) * 6)
    try:
        for vector in sorted({False, kernels.vector}):
            kernels.set_vector(vector)
            for round_bf16 in (False, True):
                for count in (23, 0):
                    q, keys = torch.randn(5, 40, generator=gen), torch.randn(count, 40, generator=gen)
                    keys = keys.bfloat16().float() if round_bf16 else keys
                    head_weights = torch.randn(5, generator=gen)
                    want = reference_scores(q, rotation, keys, head_weights, round_bf16)
                    got = indexer.scores(q, rotation, keys, head_weights, round_bf16, threads=2).double()
                    tol = 1e-2 if round_bf16 else 1e-5
                    if got.shape != want.shape or not torch.allclose(got, want, rtol=tol, atol=tol):
                        return f"the token indexer (vector loop: {vector}) differs from torch's"
    finally:
        kernels.set_vector(True)
    return None


def _load() -> IndexerKernel | None:
    kernels = token_kernels.token_kernels()
    if kernels is None:
        return None
    lib = native_library(LIBRARY, _SOURCE)
    if lib is None:
        return None
    indexer = IndexerKernel(lib, kernels)
    reason = _self_check(indexer, kernels)
    if reason is not None:
        disable(LIBRARY, reason)
        warnings.warn(f"moepack: the compiled indexer disagrees with torch ({reason}); not using it", RuntimeWarning)
        return None
    return indexer


indexer_kernel = LazyKernel(_load)  # indexer_kernel() -> IndexerKernel or None
