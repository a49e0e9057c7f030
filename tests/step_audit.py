"""What one decode step would cost a CUDA device, counted on a CPU along the branches a GPU takes: its host
synchronisations (each with where it happens), the kernels it launches eagerly outside captured graphs (a replayed
graph is one launch), and the Python calls of moepack's code it makes.

A CPU run has no device boundary, so the audit draws one: every tensor is the device's unless it was made on the
host, i.e. by a factory without `device=` (torch.tensor(list), torch.arange(n)), by `.cpu()` / `.numpy()` /
`.tolist()`, by an op whose tensors are all the host's, or inside a host region (`host_region`: the Decoder's
embedding rows, decoded from the stored bytes it keeps in host memory). Crossing it is what a GPU pays for:

- device -> host: `.tolist()`, `.item()`, `bool()`, `int()`, `float()`, `.cpu()`, `.numpy()`, a blocking `copy_` into
  a host tensor, and the ops whose output size depends on the data (nonzero, a boolean mask, unique, ...): each is
  a synchronisation (the host waits for every kernel queued before it);
- host -> device: `.to(device)`, `torch.tensor(data, device=)`, a `copy_` from a host tensor: torch makes a
  blocking one wait for the stream (Copy.cu synchronises after a copy that is not `non_blocking`), so each is a
  synchronisation too; a `non_blocking=True` one (from pinned memory, on CUDA) is not;
- an op mixing a host tensor (other than a 0-dim one) with the device's would fail on CUDA: recorded as `mixed`.

Each aten op run on the device's tensors outside a captured piece is one kernel launch (views, allocations and
metadata launch none); a captured piece (device_decode.CapturedCall, replaced by `Captured` here: static inputs
and outputs as a replayed graph keeps them) costs one launch per replay plus one copy per input (none for an input
that is another piece's output buffer, read in place). The ops a replay runs are counted apart (`graph_kernels`:
each a graph node, ~1-2 us of the device's time however small). A sync inside a captured piece would fail its
capture on CUDA: recorded as a sync `in graph`.

`python tests/step_audit.py` prints the counts per step for both families (run it before a GPU run).
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from gpu_branches import SYNC_OPS, host_sync, without_native_code

# device -> host reads at the Python level
_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "__array__", "cpu"}
# aten ops that launch no kernel: allocations, metadata, views (OpOverload.is_view catches the rest)
_NO_LAUNCH = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
              "lift_fresh", "_to_copy_noop", "clone_noop", "record_stream", "set_", "resize_", "sym_size",
              "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type",
              "is_pinned", "_nested_tensor_size"}
# torch functions that are one kernel on CUDA and a composite of several ops on a CPU: one launch
_FUSED_ON_CUDA = {"rms_norm"}
_FACTORIES = {"tensor", "as_tensor", "arange", "zeros", "ones", "empty", "full", "rand", "randn", "randint",
              "linspace", "eye", "frombuffer", "from_numpy", "asarray", "empty_strided", "scalar_tensor"}
_LIKE = {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "new_zeros", "new_ones",
         "new_empty", "new_full", "new_tensor"}


def _in_moepack(frame) -> bool:
    """Whether a frame runs moepack's own code (by its module's name: the package's folders sit anywhere)."""
    return frame.f_globals.get("__name__", "").startswith("moepack.")


def where() -> str:
    """The innermost frames of moepack's code (file:line function), innermost first."""
    frames, frame = [], sys._getframe(1)
    while frame is not None and len(frames) < 3:
        if _in_moepack(frame):
            code = frame.f_code
            folder, name = code.co_filename.replace("\\", "/").rsplit("/", 2)[-2:]
            frames.append(f"{folder}/{name}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return " < ".join(frames)


@dataclass
class StepCounts:
    """One step's (or several steps') counts."""
    syncs: list[str] = field(default_factory=list)  # "what @ where" of each host synchronisation
    launches: int = 0  # kernels launched: eager ops on the device, graph replays, their input copies, copies across
    eager_ops: Counter = field(default_factory=Counter)  # the eager launches by aten op
    replays: int = 0
    graph_syncs: list[str] = field(default_factory=list)  # syncs inside a captured piece (its capture would fail)
    mixed: list[str] = field(default_factory=list)  # ops mixing host and device tensors (fail on CUDA)
    python_calls: int = 0  # calls of moepack's Python functions
    graph_kernels: int = 0  # kernels inside the replayed graphs (each a graph node: ~1-2 us of the device's time)
    calls_by_function: Counter = field(default_factory=Counter)
    launch_sites: Counter = field(default_factory=Counter)  # eager launches by moepack function (StepAudit.sites)
    graph_sites: Counter = field(default_factory=Counter)  # the graphs' kernels by moepack function (sites)

    def per_step(self, steps: int) -> dict:
        return {"syncs": len(self.syncs) / steps, "launches": self.launches / steps, "replays": self.replays / steps,
                "graph_syncs": len(self.graph_syncs) / steps, "mixed": len(self.mixed) / steps,
                "python_calls": self.python_calls / steps, "graph_kernels": self.graph_kernels / steps}


class StepAudit:
    """Installs the device boundary and the counters (module docstring) while entered; `counts` accumulates
    from `reset()`. `Captured` stands for device_decode.CapturedCall (monkeypatched in by the caller, or by
    `audited_decoder`)."""

    def __init__(self, count_python: bool = True, sites: bool = False):
        self.sites = sites  # count the eager launches by the moepack function that made them (slow)
        self._host = WeakIdKeyDictionary()
        self.counts = StepCounts()
        self._placement: list[str] = []  # "host" / "device" / "silent" for the torch call being run
        self._graph = 0  # > 0: inside a captured piece (replay or capture)
        self._capturing = 0
        self.count_python = count_python
        self._fn_mode = _Boundary(self)
        self._dispatch_mode = _Launches(self)

    def reset(self) -> StepCounts:
        done, self.counts = self.counts, StepCounts()
        return done

    # --- tags ------------------------------------------------------------------------------------------------
    def is_host(self, t: torch.Tensor) -> bool:
        """A tensor made before the audit is the host's unless `on_device` named it."""
        return self._host.get(t, True)

    def tag(self, out, host: bool) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._host[t] = host

    def on_device(self, *objects, depth: int = 10) -> None:
        """The tensors reachable from `objects` (through containers, dataclasses and attributes) are the
        device's: what lives there before the step (resident weights, the pool, each sequence's KV)."""
        seen = set()

        def walk(obj, left):
            if id(obj) in seen or left < 0 or isinstance(obj, (str, bytes, int, float, type, torch.dtype)):
                return
            seen.add(id(obj))
            if isinstance(obj, torch.Tensor):
                self._host[obj] = False
                return
            items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple, set)) else \
                vars(obj).values() if hasattr(obj, "__dict__") and not callable(obj) else ()
            for item in items:
                walk(item, left - 1)
        for obj in objects:
            walk(obj, depth)

    @contextlib.contextmanager
    def placed(self, placement: str):
        self._placement.append(placement)
        try:
            yield
        finally:
            self._placement.pop()

    @contextlib.contextmanager
    def host_region(self):
        """Everything run under it is the host's (its results too)."""
        with self.placed("host"):
            yield

    def sync(self, what: str) -> None:
        if self._capturing:
            return
        (self.counts.graph_syncs if self._graph else self.counts.syncs).append(f"{what} @ {where()}")

    def launch(self, name: str, n: int = 1) -> None:
        if self._capturing:
            return
        if self._graph:  # a kernel (a node) of a replayed graph: the device's time, not the host's
            self.counts.graph_kernels += n
            if self.sites:
                self.counts.graph_sites[where().split(" < ")[0].split(" ", 1)[-1]] += n
            return
        self.counts.launches += n
        self.counts.eager_ops[name] += n
        if self.sites:
            self.counts.launch_sites[where().split(" < ")[0].split(" ", 1)[-1]] += n

    # --- entering ------------------------------------------------------------------------------------------------
    def __enter__(self):
        self._dispatch_mode.__enter__()
        self._fn_mode.__enter__()
        if self.count_python:
            sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        if self.count_python:
            sys.setprofile(None)
        self._fn_mode.__exit__(*exc)
        self._dispatch_mode.__exit__(*exc)

    def _profile(self, frame, event, arg):
        if event == "call" and not self._capturing and not self._graph:
            if _in_moepack(frame):
                self.counts.python_calls += 1
                name = frame.f_code.co_filename.rsplit("/", 1)[-1]
                self.counts.calls_by_function[f"{name}:{frame.f_code.co_name}"] += 1

    # --- a captured piece ---------------------------------------------------------------------------------------
    def captured_class(self):
        audit = self

        class Captured:
            """CapturedCall's contract on a CPU (inputs copied into static tensors, the piece run twice at capture,
            its outputs static tensors overwritten at each call), its replays counted as one launch each."""

            def __init__(self, fn, inputs, pool=None):
                audit._capturing += 1
                try:
                    self.fn, self.inputs = fn, tuple(t.clone() for t in inputs)
                    fn(*self.inputs)
                    out = fn(*self.inputs)
                    self.output = tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()
                finally:
                    audit._capturing -= 1

            def __call__(self, *args):
                for static, arg in zip(self.inputs, args):
                    static.copy_(arg)  # (counted: one copy each)
                audit._graph += 1
                try:
                    out = self.fn(*self.inputs)
                    outs = (self.output, out) if isinstance(out, tuple) else ((self.output,), (out,))
                    for static, new in zip(*outs):
                        static.copy_(new)
                finally:
                    audit._graph -= 1
                audit.counts.replays += 1
                audit.launch("graph replay")
                return self.output
        return Captured


def _target_device(args, kwargs) -> bool:
    """Whether a .to() call names a device (the device: a CPU run's only one; .cpu() is how code goes to the
    host)."""
    if "device" in kwargs:
        return True
    return any(isinstance(a, (torch.device, str)) for a in args[1:])


class _Boundary(TorchFunctionMode):
    def __init__(self, audit: StepAudit):
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        audit = self.audit
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__", "__len__", "dim", "size", "stride", "numel", "element_size",
                    "data_ptr", "is_contiguous", "__repr__", "__format__", "untyped_storage"):
            return func(*args, **kwargs)
        if audit._placement and audit._placement[-1] == "host":
            with audit.placed("host"):
                out = func(*args, **kwargs)
            audit.tag(out, host=True)
            return out
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        host = [t for t in tensors if audit.is_host(t)]
        device = [t for t in tensors if not audit.is_host(t)]
        non_blocking = bool(kwargs.get("non_blocking", False))
        if name in _READS:
            read = args and isinstance(args[0], torch.Tensor) and not audit.is_host(args[0])
            if read:
                audit.sync(f"{name}()")
            with audit.placed("host"):
                out = func(*args, **kwargs)
                # a device tensor's .cpu() is a new host tensor (a CPU's is the tensor itself: not here)
                out = out.clone() if read and out is args[0] else out
            audit.tag(out, host=True)
            return out
        if name in ("to", "cuda") and args and isinstance(args[0], torch.Tensor) and (
                name == "cuda" or _target_device(args, kwargs)) and audit.is_host(args[0]):
            if not non_blocking:
                audit.sync("blocking copy to the device")
            audit.launch("copy to the device")
            with audit.placed("silent"):
                out = func(*args, **kwargs)
                out = out.clone() if out is args[0] else out
            audit.tag(out, host=False)
            return out
        if name == "copy_" and len(args) >= 2:
            dst, src = args[0], args[1]
            non_blocking = non_blocking or (len(args) > 2 and bool(args[2]))
            if audit.is_host(dst) != audit.is_host(src):
                if not non_blocking:
                    audit.sync("blocking copy " + ("to the host" if audit.is_host(dst) else "to the device"))
                audit.launch("copy across")
                with audit.placed("silent"):
                    return func(*args, **kwargs)
        if name in _FACTORIES and not (device and name not in ("tensor", "as_tensor", "asarray")):
            on_device = kwargs.get("device") is not None
            if on_device and name in ("tensor", "as_tensor", "asarray"):
                audit.sync(f"torch.{name}(host data, device=)")
                audit.launch("copy to the device")
                with audit.placed("silent"):
                    out = func(*args, **kwargs)
                audit.tag(out, host=False)
                return out
            with audit.placed("device" if on_device else "host"):
                out = func(*args, **kwargs)
            audit.tag(out, host=not on_device)
            return out
        if name in _FUSED_ON_CUDA and device and not host:
            audit.launch(name)
            with audit.placed("silent"):
                out = func(*args, **kwargs)
            audit.tag(out, host=False)
            return out
        if name in _LIKE and args and isinstance(args[0], torch.Tensor) and kwargs.get("device") is None:
            on_host = audit.is_host(args[0])
        else:
            on_host = bool(tensors) and not device
        if host and device and any(t.dim() for t in host):
            audit.counts.mixed.append(f"{name} @ {where()}")
        with audit.placed("host" if on_host else "device"):
            out = func(*args, **kwargs)
        audit.tag(out, host=on_host)
        return out


class _Launches(TorchDispatchMode):
    def __init__(self, audit: StepAudit):
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        audit = self.audit
        out = func(*args, **kwargs)
        placement = audit._placement[-1] if audit._placement else None
        if placement is None:  # an op no torch function call announced: placed by its tensors
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            placement = "host" if tensors and all(audit.is_host(t) for t in tensors) else "device"
        if placement == "silent":
            return out
        audit.tag(out, host=placement == "host")
        if placement == "host":
            return out
        name = func.overloadpacket.__name__
        if host_sync(func, args, kwargs, SYNC_OPS):  # (a host tensor copied in is the boundary's: _Boundary)
            audit.sync(f"aten.{name}")
        if not (func.is_view or name in _NO_LAUNCH):
            audit.launch(name)
        return out


def audited_decoder(decoder, audit: StepAudit, monkeypatch, sequences=(), caches=()) -> None:
    """The Decoder's resident weights, its pool, the `sequences`' KV states and `caches` (a family's module-level
    caches of device tensors) on the device; its embedding rows and a read's bytes the host's; its pool's captured
    pieces `audit.captured_class()`."""
    audit.on_device(decoder.dense, decoder.head_weights, decoder.pool, decoder.cache, *sequences, *caches)
    from moepack.runtime import device_decode

    def on_host(fn):
        def run(*args, **kwargs):
            with audit.host_region():
                out = fn(*args, **kwargs)
            audit.tag(out, host=True)
            return out
        return run
    # the embedding rows decoded from its stored bytes in host memory; the bytes a read delivered (a miss's)
    monkeypatch.setattr(decoder, "_embedding_rows", on_host(decoder._embedding_rows))
    monkeypatch.setattr(decoder.copier, "host_bytes", on_host(decoder.copier.host_bytes))

    def copied(buffer, view, pooled=True):  # the copier's CUDA branch: a copy on its stream, the host not waiting
        host = decoder.copier.host_bytes(buffer, view)
        audit.launch("copy to the device")
        with audit.placed("silent"):
            out = host.clone()
        audit.tag(out, host=False)
        return out
    monkeypatch.setattr(decoder.copier, "to_device", copied)
    monkeypatch.setattr(device_decode, "CapturedCall", audit.captured_class())


PROMPTS = (5, 17, 33, 9)  # the prompt lengths of the sequences a step decodes (`sequences`)


def sequences(g, rows: int) -> tuple[list, list[int]]:
    """`rows` sequences of Generator g's decoder, each prefilled from a random prompt (PROMPTS' lengths), and
    their first greedy tokens."""
    d, seqs, tokens = g.decoder, [], []
    for n in PROMPTS[:rows]:
        ids = torch.randint(3, g.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        logits, states, *_ = g._prefill(ids, None, 8)
        seqs.append(d.start(states))
        tokens.append(int(logits.argmax()))
    return seqs, tokens


def device_caches() -> tuple:
    """DeepSeek-V4's rotations, made on the device once per block of positions and kept; its and Qwen3-MoE's RoPE
    frequencies cached afresh (a CPU's prefill cached them on the host, a GPU's on the device); the FP4 and FP8
    decodes' tables (a stored pool's decode: made on the device at its first decode)."""
    from moepack.families.deepseek_v4 import model
    from moepack.families.qwen3_moe import model as qwen3_model
    from moepack.format_spec import source_formats
    model._inv_freq.cache_clear()
    qwen3_model.rope_frequencies.cache_clear()
    for dtype in (torch.float32, torch.bfloat16):
        source_formats._PAIR_TABLES.setdefault((dtype, torch.device("cpu")), source_formats.byte_pair_table(dtype))
        source_formats._fp8_scaled_table(torch.device("cpu"), dtype)
    return (model._ROTATION_BLOCKS, source_formats._PAIR_TABLES, source_formats._FP8_TABLES)


def gpu_branches(monkeypatch) -> None:
    """The branches a CUDA device takes on a CPU: no compiled token kernels (ops), no native mHC, a bf16 product
    of a few rows in bf16 (ops.low_matmul: a CPU's runs it in float32), DeepSeek-V4's CUDA branches (its KV in
    the device arena, its indexer's bf16 path), Qwen3-MoE's KV in its device arena."""
    from moepack.backends import token_kernels
    from moepack.families.deepseek_v4 import model
    from moepack.families.qwen3_moe import device_kv

    without_native_code(monkeypatch.setattr)
    monkeypatch.setattr(token_kernels, "SMALL_ROWS", 0)
    monkeypatch.setattr(model, "on_cuda", lambda device: True)
    monkeypatch.setattr(device_kv, "on_cuda", lambda device: True)


def main() -> None:
    """Print the counts per step (the mean over --steps after one that captures the graphs) for each family,
    every expert pooled and 40 % pooled, B = 1 and 4, on synthetic containers made in --workdir."""
    import argparse
    import functools
    import itertools
    import os

    import pytest

    from moepack.families.deepseek_v4.token_layer import TokenLayers
    from moepack.packer.convert import convert_checkpoint
    from moepack.packer.synth import synth_checkpoint
    from moepack.runtime import generate as generate_module
    from moepack.runtime.decode import Decoder
    from moepack.runtime.engine import PrefillOptions
    from moepack.runtime.generate import Generator

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--workdir", default="/tmp/moepack-step-audit")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--sites", action="store_true", help="also the launches by moepack function (eager, in graphs)")
    args = ap.parse_args()
    print(f"{'family':12} {'experts, pool':16} {'B':>2} {'syncs':>6} {'launches':>8} {'replays':>7} {'in graphs':>9} "
          f"{'py calls':>8}  where the syncs are")
    # the pool of decoded experts over float32 experts; of stored bytes over the release's (FP4, FP8)
    for family, (form, layout) in itertools.product(("deepseek-v4", "qwen3-moe"),
                                                    (("decoded", "f32"), ("stored", "release"))):
        src, path = (os.path.join(args.workdir, f"{family}-{layout}{ext}") for ext in ("", ".moepack"))
        if not os.path.exists(path):
            synth_checkpoint(src, preset="tiny", layout=layout, seed=4, progress=False, family=family)
            convert_checkpoint(src, path, progress=False)
        for fraction in (1.0, 0.4):
            for rows in (1, 4):
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(TokenLayers, "make", classmethod(lambda cls, *a: None))
                    gpu_branches(mp)
                    options = PrefillOptions(compute_dtype="bfloat16")
                    try:
                        mp.setattr(generate_module, "Decoder", functools.partial(
                            Decoder, decoded_experts=form == "decoded", expert_pool=True, pool_form=form))
                        g = Generator(path, cache_gib=1.0, prefill=options)
                    except ValueError:  # (a family whose decoder keeps no decoded experts: expert by expert)
                        mp.setattr(generate_module, "Decoder", functools.partial(Decoder, expert_pool=False))
                        g = Generator(path, cache_gib=1.0, prefill=options)
                    with g:
                        d = g.decoder
                        d.cache.resize(int(fraction * sum(d._entry_bytes(layer, e) for layer, b in
                                                          enumerate(d.blocks) for e in range(len(b.experts)))))
                        d.seed([[1] * len(b.experts) for b in d.blocks])
                        if d.pool is not None:
                            d.pool.graphs.enabled = True
                        seqs, tokens = sequences(g, rows)
                        audit = StepAudit(sites=args.sites)
                        audited_decoder(d, audit, mp, seqs, device_caches())
                        with audit:
                            tokens = d.step_batch(seqs, tokens).argmax(-1).tolist()
                            audit.reset()
                            for _ in range(args.steps):
                                tokens = d.step_batch(seqs, tokens).argmax(-1).tolist()
                        c = audit.reset()
                per = c.per_step(args.steps)
                sites = Counter(s.split(" @ ")[0] + " @ " + s.split(" @ ")[1].split(" < ")[0] for s in c.syncs)
                pool = f" {form}" if d.pool is not None else " (no pool)"
                print(f"{family:12} {('all' if fraction == 1 else '40 %') + pool:16} {rows:>2} {per['syncs']:>6.2f} "
                      f"{per['launches']:>8.1f} {per['replays']:>7.1f} {per['graph_kernels']:>9.1f} "
                      f"{per['python_calls']:>8.1f}  "
                      + "; ".join(f"{n / args.steps:g} x {s}" for s, n in sites.items()))
                if args.sites:
                    print("    launches by function:", ", ".join(f"{k} {v / args.steps:g}"
                                                             for k, v in c.launch_sites.most_common(12)))
                    print("    in graphs by function:", ", ".join(f"{k} {v / args.steps:g}"
                                                              for k, v in c.graph_sites.most_common(8)))
                assert not c.graph_syncs and not c.mixed, (c.graph_syncs, c.mixed)


if __name__ == "__main__":
    main()
