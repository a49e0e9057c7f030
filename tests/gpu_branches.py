"""A prefill run on a CPU along the branches a CUDA device takes, and an audit of what it computes.

`cuda_branches()`: no compiled token kernels, no native mHC, DeepSeek-V4's own CUDA branches (model.on_cuda):
what a GPU runs, in torch on a CPU. `PrefillAudit`: a dispatch mode that records, per layer and part of it
(attention, indexer, route, experts, finish), every matmul-like op with its dtype and FLOPs, the largest tensor
an op allocated, and the ops that would make the host wait for the device. `audited_prefill` runs both.
benchmarks/prefill_audit.py prints it; tests/test_gpu_prefill_precision.py holds the device path to it."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# aten ops whose output size (or result) the host must see on CUDA: the host waits (repeat_interleave: the
# overload a dispatch mode sees is the one with a tensor of repeats)
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "unique", "_unique",
            "_unique2", "unique_consecutive", "unique_dim", "repeat_interleave", "_assert_async", "item"}
# where no host/device boundary is drawn: those, and host data copied to the device (torch.tensor(data))
HOST_SYNCS = SYNC_OPS | {"lift_fresh"}
_MASKED = ("index", "index_put", "index_put_", "_index_put_impl_")  # a sync where indexed by a boolean mask


def host_sync(func, args, kwargs, ops=HOST_SYNCS) -> str | None:
    """The op's name where it would wait for the host on CUDA (one of `ops`, or indexing by a boolean mask). Shared
    with tests/step_audit.py, which passes SYNC_OPS: a host tensor copied in is its boundary's to count."""
    name = func.overloadpacket.__name__
    if name in ops or (name in _MASKED and any(isinstance(t, torch.Tensor) and t.dtype == torch.bool and t.dim() > 0
                                               for t in tree_leaves((args, kwargs or {})))):
        return name
    return None


class HostSyncs(TorchDispatchMode):
    """Records the ops run under it that would wait for the host on CUDA (`host_sync` of `ops`: SYNC_OPS where
    host tensors made on a CPU, a CUDA device's torch.empty, are not to be counted)."""

    def __init__(self, ops=HOST_SYNCS):
        super().__init__()
        self.seen, self.ops = [], ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = host_sync(func, args, kwargs, self.ops)
        if name:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def without_native_code(patch) -> None:
    """What a CPU runs natively and a CUDA device does not, patched out with `patch(owner, name, value)`: the
    compiled token kernels (ops.kernels_for; a prefill's few-token experts in them) and DeepSeek-V4's native mHC
    (cuda_branches here, and tests/step_audit.py's gpu_branches); an expert thread's reused decode buffers (a
    CPU's: fresh tensors on a GPU); and torch's fused RMS norm taken, as on CUDA."""
    from moepack.backends import ops
    from moepack.families.deepseek_v4 import mhc_native
    from moepack.runtime import expert_runner
    from moepack.runtime.expert_decode import ExpertDecoder

    from moepack.format_spec import source_formats

    patch(ops, "kernels_for", lambda *a: None)
    patch(ops, "fused_norm_on", lambda device: True)  # (torch's rms_norm: on a CPU its composite of the same steps)
    for name in ("hc_mix_weights", "token_pre", "token_post"):
        patch(mhc_native, name, lambda *a, **k: None)
    patch(source_formats, "_fp8_native", lambda: None)  # (the FP8 decode's compiled loop: its torch lookup)
    patch(expert_runner, "KERNEL_MAX_TOKENS", 0)
    patch(ExpertDecoder, "buffer_for", lambda self, prefix: lambda entry, dtype: None)


@contextlib.contextmanager
def cuda_branches():
    """The forward's CUDA branches on a CPU: torch's ops where a CPU would call compiled kernels, and
    DeepSeek-V4's device path (its query chunk, its indexer) taken as on a CUDA device."""
    from moepack.families.deepseek_v4 import model

    with contextlib.ExitStack() as stack:
        def patch(owner, name, value):
            stack.enter_context(mock.patch.object(owner, name, value))
        without_native_code(patch)
        patch(model, "on_cuda", lambda device: True)
        yield


# op -> index of its first matrix operand (the contraction dimension is that operand's last)
_MATMULS = {"mm": 0, "bmm": 0, "addmm": 1, "baddbmm": 1, "addbmm": 1, "_grouped_mm": 0, "dot": 0, "mv": 0,
            "addmv": 1, "_scaled_mm": 0}
_ATTENTION = ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
              "_scaled_dot_product_flash_attention_for_cpu")


@dataclass
class Part:
    """What one part of a layer computed: matmuls (op, input dtype, FLOPs, output shape), the largest tensor an
    op allocated (bytes, dtype, shape, op), the largest float32 one, the ops that would sync the host."""

    matmuls: list = field(default_factory=list)
    largest: tuple = (0, None, (), "")
    largest_float32: tuple = (0, None, (), "")
    syncs: list = field(default_factory=list)

    def flops(self, dtype: torch.dtype) -> int:
        return sum(f for _, d, f, _ in self.matmuls if d == dtype)


class PrefillAudit(TorchDispatchMode):
    """Every op of a prefill, by part: `parts[(layer, part)]` is a Part ("attention" without its indexer, which is
    "indexer"; "route", "experts", "finish"; layer None: before the first layer and the head)."""

    def __init__(self):
        super().__init__()
        self.parts: dict[tuple, Part] = defaultdict(Part)
        self.where: list[tuple] = [(None, "outside")]
        self.layer = None  # the layer last named: the parts that do not name theirs (indexer, experts) are its

    @contextlib.contextmanager
    def inside(self, layer, part: str):
        self.layer = self.layer if layer is None else layer
        self.where.append((self.layer, part))
        try:
            yield
        finally:
            self.where.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        part = self.parts[self.where[-1]]
        name = func.overloadpacket.__name__
        sync = host_sync(func, args, kwargs)
        if sync:
            part.syncs.append(sync)
        first = out[0] if isinstance(out, tuple) else out
        if name in _MATMULS and isinstance(first, torch.Tensor):
            a = args[_MATMULS[name]]
            part.matmuls.append((name, a.dtype, 2 * first.numel() * a.shape[-1], tuple(first.shape)))
        elif name in _ATTENTION:
            q, k = args[0], args[1]
            part.matmuls.append((name, q.dtype, 4 * q.numel() * k.shape[-2], tuple(q.shape)))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                size = t.numel() * t.element_size()
                entry = (size, t.dtype, tuple(t.shape), name)
                part.largest = max(part.largest, entry, key=lambda e: e[0])
                if t.dtype == torch.float32:
                    part.largest_float32 = max(part.largest_float32, entry, key=lambda e: e[0])
        return out


@contextlib.contextmanager
def attributed(audit: PrefillAudit):
    """The audit told which layer and part runs: DeepSeek-V4's prefill steps and the grouped expert backend
    wrapped to say so."""
    from moepack.backends.grouped_experts import GroupedExperts
    from moepack.families.deepseek_v4 import model

    def wrap(owner, name, part, layer_arg: int | None):
        real = getattr(owner, name)

        def wrapped(*args, **kwargs):
            with audit.inside(None if layer_arg is None else args[layer_arg], part):
                return real(*args, **kwargs)
        return mock.patch.object(owner, name, wrapped)

    with contextlib.ExitStack() as stack:
        for name, part in (("attention", "attention"), ("route", "route"), ("finish", "finish")):
            stack.enter_context(wrap(model.DeepseekV4Prefill, name, part, 1))
        stack.enter_context(wrap(model, "indexer_topk", "indexer", None))
        stack.enter_context(wrap(GroupedExperts, "run_layer", "experts", None))
        yield


def audited_prefill(container: str, ids, **options):
    """(the PrefillResult, its PrefillAudit) of a bf16 grouped prefill run along the CUDA branches."""
    from moepack.runtime.engine import PrefillOptions, prefill

    opts = dict(compute_dtype="bfloat16", expert_dtype="bfloat16", expert_backend="grouped", expert_selection="all")
    audit = PrefillAudit()
    with cuda_branches(), attributed(audit), audit:
        result = prefill(container, ids, PrefillOptions(**{**opts, **options}))
    return result, audit
