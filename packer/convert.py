"""Checkpoint (hub id or local directory) -> container, region by region in read order.

Three stages overlap: a reader thread fetches the next regions' source bytes, the main thread converts the current
region (dequantize the release's FP8/FP4 with their scales, quantize to the policy's type; torch spreads that over
every core), and a writer thread appends the previous region to the container. At most a few regions' bytes are in
memory at once, whatever the model's size. After each block the output is made durable and resumable: a rerun of
the same command continues after the last complete block and produces the same bytes as an uninterrupted run.
With `parts=P` the experts are striped over P part files (SPEC.md section 9), e.g. one per SSD.
"""

from __future__ import annotations

import os
import struct
import threading
import time
import warnings
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from moepack.families import adapter_for, family_for, value_type_problem
from moepack.format_spec import quants
from moepack.format_spec.adapter import Adapter
from moepack.format_spec.decode import (as_uint8, checks_finiteness, decode_float, decode_tensor, first_non_finite,
                                        scale_name, tensor_scale_name)
from moepack.format_spec.dtypes import FROM_SAFETENSORS, STORAGE_TYPES, storage_type, tensor_nbytes
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.files import check_free_space, existing_ancestor
from moepack.format_spec.layout import (DEFAULT_STRIPE_EXPERTS, SCALE_SUFFIXES, TENSOR_ALIGNMENT, align_up,
                                        layer_count_problem, parse_block_name, region_name)
from moepack.format_spec.policies import POLICY_NAMES, policy as policy_table, target_type
from moepack.format_spec.writer import ContainerWriter, partial_path

from .progress import progress_bar
from .source import SourceTensor, check_side_files, keep_refusal

READ_AHEAD = 2  # regions read ahead of the one being converted


def plan_regions(adapter: Adapter, tensors: dict[str, SourceTensor], drop_mtp: bool = False):
    """Group source tensors into regions in read order.

    Returns a list of (kind, block, expert, [(canonical name, source tensor)]): globals, then each block
    (`layers.N` in order, then `mtp.N`) as its dense region followed by its experts in ID order.
    """
    globals_: list = []
    dense: dict[str, list] = defaultdict(list)
    experts: dict[str, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    seen: dict[str, str] = {}
    for source_name, t in tensors.items():
        name = adapter.canonical(source_name)
        if name in seen:
            raise MoepackError(f"tensors {seen[name]} and {source_name} both map to {name}")
        seen[name] = source_name
        kind, block, expert = adapter.place(name)
        if drop_mtp and block is not None and block.startswith("mtp."):
            continue
        if kind == "global":
            globals_.append((name, t))
        elif kind == "dense":
            dense[block].append((name, t))
        else:
            experts[block][expert].append((name, t))
    plan = [("global", None, None, [item]) for item in sorted(globals_, key=lambda it: adapter.global_sort_key(it[0]))]
    blocks = set(dense) | set(experts)
    for block in sorted(blocks, key=lambda b: (parse_block_name(b)[0] == "mtp", parse_block_name(b)[1])):
        if block not in dense:
            raise MoepackError(f"{block} has experts but no attention/dense tensors")
        plan.append(("dense", block, None, sorted(dense[block])))
        ids = sorted(experts[block])
        if ids != list(range(len(ids))):
            missing = sorted(set(range(max(ids) + 1)) - set(ids))
            raise MoepackError(f"{block}: experts {missing[:8]} are missing from the checkpoint")
        for e in ids:
            items = sorted(experts[block][e], key=lambda it: adapter.expert_sort_key(it[0]))
            plan.append(("expert", block, e, items))
    return plan


def config_problem(config, plan) -> str | None:
    """What in a checkpoint's config `verify` and `prefill` would refuse, found before anything is written: a field
    of the wrong type or out of range (named, as they name it), a layer with another expert count than the
    config's, a tensor missing or of another shape than the config says (the family's checkpoint_problem). None
    when they will take it."""
    family = family_for(config)
    blocks = [(kind, parse_block_name(block)) for kind, block, _, _ in plan if kind in ("dense", "expert")]
    experts = Counter(number for kind, (section, number) in blocks if kind == "expert" and section == "layers")
    layers = {number: experts.get(number, 0) for _, (section, number) in blocks if section == "layers"}
    stored = {name: source_type_and_shape(family.adapter, name, t) for _, _, _, items in plan for name, t in items}
    shapes = {name: shape for name, (_, shape) in stored.items() if not name.endswith(SCALE_SUFFIXES)}
    return (family.checkpoint_problem(config, layers, shapes)
            or value_type_problem(family, {name: type_name for name, (type_name, _) in stored.items()})
            or block_scale_problem(stored))


# The types a weight's block scale (`P.scale`) may be stored in, by the weight's type (source_formats: FP8's E8M0
# exponents or other releases' float scales, FP4's E8M0 exponents).
_SCALE_TYPES = {"F8_E4M3": ("F8_E8M0", "F32", "BF16", "F16"), "FP4_E2M1": ("F8_E8M0",)}


def block_scale_problem(stored: dict[str, tuple[str, list[int]]]) -> str | None:
    """The first weight whose block scale is not of the shape and type its decoding takes, or None: `--keep`
    stores both as they are, and every prefill would then refuse the weight (`stored`: name -> (type, shape))."""
    for name, (dtype, shape) in stored.items():
        sname = scale_name(name)
        if sname not in stored or dtype not in _SCALE_TYPES:
            continue
        if len(shape) != 2:  # (the MTP layers' shapes are checked by nothing else: no prefill runs them)
            return f"tensor {name} is {dtype}{list(shape)} beside a block scale: a block-scaled weight is 2-D"
        expected = list(STORAGE_TYPES[dtype].scale_shape(*shape))
        scale_type, scale_shape = stored[sname]
        if scale_type not in _SCALE_TYPES[dtype] or list(scale_shape) != expected:
            return (f"tensor {sname} is {scale_type}{list(scale_shape)}, but {name} ({dtype}{list(shape)}) takes a "
                    f"block scale of {expected} in {' or '.join(_SCALE_TYPES[dtype])}")
    return None


def untie_a_stored_head(config: dict, plan) -> dict:
    """The config a checkpoint is converted under when its config.json ties the LM head to the embedding
    (`tie_word_embeddings`) and it stores a head as well (the family's head_tensor, under any name its adapter
    reads as that): transformers then leaves the two untied and computes with the stored head ("both are present
    in the checkpoints ... we will NOT tie them"), so the container's config says untied and holds that head (a
    warning says so). Any other config is returned as it is."""
    if config.get("tie_word_embeddings") is not True:
        return config
    family = family_for(config)
    stored = {family.adapter.canonical(name) for _, _, _, items in plan for name, _ in items}
    if family.head_tensor not in stored:
        return config
    warnings.warn("config.json ties the LM head to the embedding, but the checkpoint stores a head of its own: it is "
                  "kept and used as the head, as transformers does", stacklevel=2)
    return {**config, "tie_word_embeddings": False}


def source_type_and_shape(adapter: Adapter, name: str, t: SourceTensor) -> tuple[str, list[int]]:
    """The source's storage type and logical shape; packed FP4 (I8 [out, in/2]) is FP4_E2M1 [out, in]."""
    if t.storage is not None:
        return t.storage, list(t.shape)
    if t.dtype == "I8" and adapter.packed_fp4.search(name):
        return "FP4_E2M1", [*t.shape[:-1], t.shape[-1] * 2]
    return FROM_SAFETENSORS[t.dtype], list(t.shape)


class RegionConverter:
    """Turns one region's source tensors into the tensors the policy stores (name, type, shape, bytes)."""

    def __init__(self, adapter: Adapter, policy: str):
        self.adapter = adapter
        self.policy = policy

    def _targets(self, items: list[tuple[str, SourceTensor]]) -> list[tuple]:
        """(name, source type, shape, target type or None: kept as it is, the name of its block scale or None) of
        each tensor the region stores from `items`, in order; a block scale that goes into its weight's
        requantization is not stored (one kept beside a kept weight stays, in the weight's order)."""
        by_name = dict(items)
        out, consumed = [], set()
        for name, t in items:
            if name in consumed:
                continue
            dtype, shape = source_type_and_shape(self.adapter, name, t)
            target = target_type(self.policy, self.adapter.role(name, shape), dtype, shape)
            scale = scale_name(name) if target is not None and scale_name(name) in by_name else None
            if scale is not None:
                consumed.add(scale)
            out.append((name, dtype, shape, target, scale))
        return [o for o in out if o[0] not in consumed]

    def warn_of_block_fallbacks(self, plan) -> None:
        """A warning naming the tensors whose rows are not whole blocks of the policy's type for them (stored as
        Q8_0 instead, or kept): the output is larger than the policy says, which `inspect` alone had shown."""
        wanted = policy_table(self.policy)["roles"]
        fallbacks: dict[tuple[str, str], list[int]] = {}
        for _, _, _, items in plan:
            for name, _, shape, target, _ in self._targets(items):
                want = wanted.get(self.adapter.role(name, shape))
                if want not in (None, "BF16") and target != want and len(shape) >= 2 and \
                        shape[-1] % STORAGE_TYPES[want].block_elems:
                    fallbacks.setdefault((want, f"stored as {target}" if target else "kept in their source type"),
                                         []).append(shape[-1])
        if fallbacks:
            warnings.warn(f"--{self.policy}: " + "; ".join(
                f"{len(widths)} tensors with rows of {min(widths)} (not whole {want} blocks of "
                f"{STORAGE_TYPES[want].block_elems}) {got}" for (want, got), widths in fallbacks.items()),
                stacklevel=2)

    def stored_bytes(self, items: list[tuple[str, SourceTensor]]) -> int:
        """About the bytes the region of `items` takes in the container (each tensor aligned, room for a tensor
        scale), from the source's metadata alone: for the free-space check before a conversion."""
        size = sum(align_up(tensor_nbytes(target or dtype, shape), TENSOR_ALIGNMENT) + TENSOR_ALIGNMENT
                   for _, dtype, shape, target, _ in self._targets(items))
        return align_up(size)

    def convert(self, items: list[tuple[str, SourceTensor]], data: dict[str, bytes]) -> list[tuple]:
        by_name = dict(items)
        out = []
        for name, shape, bad in self._non_finite_values(items, data):
            if bad is not None:
                where = ", ".join(str(int(i)) for i in np.unravel_index(bad, shape)) if shape else ""
                raise MoepackError(f"{name}: not finite (NaN or infinity) at index [{where}] (flat {bad}) of the "
                                   "source: the checkpoint is damaged")
        for name, dtype, shape, target, sname in self._targets(items):
            if target is None:
                out.append((name, dtype, shape, data[name]))
                continue
            scale = None
            if sname is not None:
                st = by_name[sname]
                scale = decode_tensor(FROM_SAFETENSORS[st.dtype], st.shape, data[sname])
            blocks, tensor_scale = self._requantize(name, dtype, shape, data[name], scale, target)
            out.append((name, target, shape, blocks))
            if tensor_scale is not None:  # right after its weight (SPEC.md section 6.1)
                out.append((tensor_scale_name(name), "F32", [], tensor_scale))
        return out

    def _non_finite_values(self, items: list[tuple[str, SourceTensor]], data: dict[str, bytes]):
        """(name, logical shape, flat index of its first NaN or infinity or None) of each of `items`: each tensor's
        own by its bits, then each weight times its block scale (`P.scale`), finite both, decoded where the scale
        could carry a finite value past float32 (at 2^112 and above: source values stay below 2^16; rare). A NaN or
        infinity in a weight is refused whatever the policy, --keep too."""
        by_name, scaled = dict(items), []
        for name, t in items:
            dtype, shape = source_type_and_shape(self.adapter, name, t)
            yield name, shape, first_non_finite(dtype, data[name])
            if scale_name(name) in by_name:
                scaled.append((name, dtype, shape, by_name[scale_name(name)]))
        for name, dtype, shape, st in scaled:
            scale = decode_tensor(FROM_SAFETENSORS[st.dtype], st.shape, data[scale_name(name)])
            if scale.numel() and float(scale.float().abs().max()) >= 2.0 ** 112:
                bad = torch.nonzero(~torch.isfinite(decode_float(dtype, shape, data[name], scale).reshape(-1)))
                yield name, shape, int(bad[0, 0]) if len(bad) else None

    def _requantize(self, name, dtype, shape, raw, scale, target) -> tuple[memoryview, bytes | None]:
        """(the stored bytes, the F32 bytes of its tensor scale or None)."""
        tensor_scale = exponent = None
        if target == "MXFP4" and dtype == "FP4_E2M1" and scale is not None:
            # lossless: the same codes and exponents, nibbles rearranged into ggml's order
            packed = as_uint8(raw).view(*shape[:-1], shape[-1] // 2)
            blocks = quants.fp4_to_mxfp4(packed, scale.view(torch.uint8))
        else:
            values = decode_float(dtype, shape, raw, scale)
            blocks, exponent = storage_type(target).encode(values)
            if exponent is not None:
                tensor_scale = struct.pack("<f", 2.0 ** exponent)
        blocks = blocks.contiguous().reshape(-1)
        if blocks.numel() != tensor_nbytes(target, shape):
            raise MoepackError(f"{name}: {target} conversion produced {blocks.numel()} bytes")
        stored = memoryview(blocks.numpy())
        if _holds_an_infinity(target, shape, stored, exponent):  # finite source values beyond the type's range
            largest = float(decode_float(dtype, shape, raw, scale).abs().max())
            raise MoepackError(f"{name}: {target} cannot hold its values (the largest magnitude, {largest:.4g}, "
                               f"overflows to an infinity or NaN there): convert it under another policy")
        return stored, tensor_scale


def _holds_an_infinity(dtype: str, shape, stored, exponent: int | None = None) -> bool:
    """Whether stored bytes of `dtype`, times their tensor scale 2^exponent where they take one, hold a NaN or an
    infinity: by the bits where decode.first_non_finite reads the type and the tensor scale cannot carry a finite
    value past float32 (NVFP4's blocks decode below 2^12: 2^exponent below 2^116), else decoded (rare)."""
    if checks_finiteness(dtype) and (exponent is None or exponent < 116):
        return first_non_finite(dtype, stored) is not None
    values = decode_float(dtype, shape, stored, tensor_scale=None if exponent is None else 2.0 ** exponent)
    return not bool(torch.isfinite(values).all())


def convert_checkpoint(src: str, out: str, policy: str = "keep", progress: bool = True, revision: str | None = None,
                       workers: int | None = None, drop_mtp: bool = False, parts: int = 1,
                       stripe_experts: int = DEFAULT_STRIPE_EXPERTS, part_dirs: dict[int, str] | None = None,
                       keep_source: bool = True) -> dict:
    """`parts` > 1 writes OUT plus OUT.part1 .. OUT.part<P-1>, each layer's experts striped over them
    `stripe_experts` at a time; `part_dirs` {k: directory} writes part k there (a symlink stays at OUT.part<k>).

    A hub repo is converted as its shards arrive (fetched in the order the container needs them);
    `keep_source=False` downloads them into a scratch folder beside OUT instead of the Hugging Face cache and
    deletes each one once the regions made from it are durable. Before any work, the disks are checked for room
    for the output and the download; the summary's `disk` reports the peak use measured."""
    if policy not in POLICY_NAMES:
        raise MoepackError(f"unknown policy {policy!r} (choose from {', '.join(POLICY_NAMES)})")
    out_dir = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(out_dir):
        raise MoepackError(f"output directory {out_dir} does not exist")
    start = time.perf_counter()
    from .hub import open_source

    source, provenance = open_source(src, revision=revision, progress=progress, stream=True,
                                     keep_source=keep_source, scratch_parent=out_dir)
    if workers:
        torch.set_num_threads(workers)
    try:
        adapter = adapter_for(source.config)
        plan = plan_regions(adapter, source.tensors, drop_mtp)
        source.config = untie_a_stored_head(source.config, plan)
        # before hours of work, not at the end of it
        layers = sum(1 for kind, block, _, _ in plan if kind == "dense" and parse_block_name(block)[0] == "layers")
        problem = config_problem(source.config, plan) or layer_count_problem(source.config, layers)
        if problem:
            raise MoepackError(f"{provenance['source']}: {problem}")
        side_files = source.side_files()
        check_side_files(side_files, provenance["source"], source.config.get("vocab_size"), source.config)
        refusal = keep_refusal(source) if policy == "keep" else None
        if refusal:
            raise MoepackError(f"{provenance['source']}: {refusal}")
        _check_stripes(plan, parts, stripe_experts)
        converter = RegionConverter(adapter, policy)
        converter.warn_of_block_fallbacks(plan)
        needs = _output_needs(plan, converter, out_dir, parts, part_dirs)
        if os.path.exists(partial_path(out)):  # a conversion to resume has written part of it already
            needs[out_dir] -= os.path.getsize(partial_path(out))
        free = check_free_space(needs | _nonzero(source.download_need()), f"converting {provenance['source']}")
        disk = _DiskUse([*free, *(part_dirs or {}).values()])
        job = {"source": provenance["source"], "revision": provenance.get("revision"),
               "policy": policy, "drop_mtp": drop_mtp, "files": source.file_sizes(),
               "tensors": len(source.tensors)}
        total_in = sum(t.length for _, _, _, items in plan for _, t in items)
        read_bar = progress_bar(total_in, "read", progress)
        write_bar = progress_bar(0, "write", progress)
        writer = ContainerWriter(out, job=job, resume=True, on_bytes=write_bar.update, parts=parts,
                                 stripe_experts=stripe_experts, part_dirs=part_dirs)
        resumed = _skip_completed(plan, writer.completed)
        read_bar.update(sum(t.length for _, _, _, items in plan[:resumed] for _, t in items))
        order, last_use = _file_uses(plan, resumed)
        try:
            source.fetch(order)
            _run_pipeline(plan, resumed, source, converter, writer, read_bar,
                          after_checkpoint=lambda i: _release(source, last_use, i, disk))
            writer.finish(
                config=source.config, architecture=adapter.architecture,
                policy={**policy_table(policy), "drop_mtp": drop_mtp},
                tokenizer=side_files, provenance=provenance,
            )
        except BaseException:
            writer.abort()
            raise
        finally:
            read_bar.close()
            write_bar.close()
    finally:
        source.close()
    seconds = time.perf_counter() - start
    summary = _summary(out, policy, plan, resumed, total_in, seconds)
    summary["disk"] = {"peak_bytes": disk.peak, "source_peak_bytes": getattr(source, "peak_kept_bytes", 0),
                       "source_kept": keep_source, "free_space": free}
    return summary


def _file_uses(plan, resumed: int) -> tuple[list[str], dict[str, int]]:
    """The source files the regions from `resumed` on read, in the order of their first use, and each file's last
    use (plan index)."""
    order: list[str] = []
    last: dict[str, int] = {}
    for i in range(resumed, len(plan)):
        for _, t in plan[i][3]:
            name = os.path.basename(t.file)
            if name not in last:
                order.append(name)
            last[name] = i
    return order, last


def _release(source, last_use: dict[str, int], durable_through: int, disk: "_DiskUse") -> None:
    """Regions up to `durable_through` are on disk for good: files no later region reads can go."""
    disk.sample()  # before: the peak is with the files still there
    for name, last in list(last_use.items()):
        if last <= durable_through:
            source.release(name)
            del last_use[name]


def _nonzero(needs: dict[str, int]) -> dict[str, int]:
    return {d: n for d, n in needs.items() if n}


def _output_needs(plan, converter: "RegionConverter", out_dir: str, parts: int,
                  part_dirs: dict[int, str] | None) -> dict[str, int]:
    """{directory: bytes} the remaining regions will write: experts spread over the part files' directories."""
    dirs = [(part_dirs or {}).get(k, out_dir) for k in range(max(parts, 1))]
    needs = dict.fromkeys(dirs, 0)
    for kind, _, expert, items in plan:
        n = converter.stored_bytes(items)
        target = dirs[expert % len(dirs)] if kind == "expert" else out_dir
        needs[target] += n
    return needs


class _DiskUse:
    """The most bytes the conversion added to its filesystems at once (output and download together), sampled
    after each durable block: what `--no-keep-source` saves is measured, not computed."""

    def __init__(self, directories):
        self._start = {}  # filesystem -> (a directory on it, its used bytes at the start)
        for d in map(existing_ancestor, directories):
            self._start.setdefault(os.stat(d).st_dev, (d, self._used(d)))
        self.peak = 0

    @staticmethod
    def _used(directory: str) -> int:
        st = os.statvfs(directory)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def sample(self) -> None:
        self.peak = max(self.peak, sum(self._used(d) - used0 for d, used0 in self._start.values()))


def _run_pipeline(plan, resumed, source, converter, writer, read_bar, after_checkpoint=None) -> None:
    """read (thread) -> convert (here, all cores) -> write (thread), in plan order."""
    write_error: list[BaseException] = []
    lock = threading.Lock()

    def read(items):
        data = {name: source.read(t) for name, t in items}
        read_bar.update(sum(len(b) for b in data.values()))
        return data

    def write(i, kind, block, expert, tensors):
        if write_error:
            return
        try:
            writer.begin_region(kind, block=block, expert=expert, tensor=tensors[0][0] if kind == "global" else None)
            for name, dtype, shape, data in tensors:
                writer.add_tensor(name, dtype, shape, data)
            writer.end_region()
            if i + 1 == len(plan) or plan[i + 1][1] != block:
                writer.checkpoint()  # a block (or the globals) is complete: a rerun resumes after it
                if after_checkpoint is not None:
                    after_checkpoint(i)
        except BaseException as e:  # surfaced in the main thread
            with lock:
                write_error.append(e)

    todo = list(range(resumed, len(plan)))
    with ThreadPoolExecutor(1, thread_name_prefix="moepack-read") as readers, \
            ThreadPoolExecutor(1, thread_name_prefix="moepack-write") as writers:
        reads = {}
        writes = []
        for pos, i in enumerate(todo):
            for j in todo[pos:pos + READ_AHEAD + 1]:
                if j not in reads:
                    reads[j] = readers.submit(read, plan[j][3])
            kind, block, expert, items = plan[i]
            tensors = converter.convert(items, reads.pop(i).result())
            if write_error:
                break
            writes.append(writers.submit(write, i, kind, block, expert, tensors))
            while len(writes) > READ_AHEAD:  # bound the converted bytes waiting for the disk
                writes.pop(0).result()
        for f in writes:
            f.result()
        for f in reads.values():
            f.cancel()
    if write_error:
        raise write_error[0]


def _summary(out, policy, plan, resumed, total_in, seconds) -> dict:
    from moepack.format_spec.reader import Container

    with Container(out) as c:
        weights = [t for t in c.tensors.values() if not t.name.endswith(SCALE_SUFFIXES)]
        total_params = sum(t.numel for t in weights)
        expert_params = sum(t.numel for t in weights if t.region.kind == "expert")
        expert_bytes = sum(t.length for t in c.tensors.values() if t.region.kind == "expert")
        tensor_bytes = sum(t.length for t in c.tensors.values())
        types: dict[str, int] = defaultdict(int)
        for t in c.tensors.values():
            types[t.dtype] += 1
        out_bytes = c.total_bytes
        files = c.parts_summary()
    return {
        "output": out, "policy": policy, "resumed_regions": resumed, "regions": len(plan),
        "tensors": sum(types.values()), "bytes_in": total_in, "bytes_out": out_bytes, "seconds": round(seconds, 3),
        "in_mb_per_s": round(total_in / max(seconds, 1e-9) / 1e6, 1),
        "out_mb_per_s": round(out_bytes / max(seconds, 1e-9) / 1e6, 1),
        "storage_types": dict(sorted(types.items())),
        "expert_bits_per_weight": round(expert_bytes * 8 / expert_params, 4) if expert_params else None,
        "bits_per_weight": round(tensor_bytes * 8 / total_params, 4) if total_params else None,
        "parts": files,
    }


def _check_stripes(plan, parts: int, stripe_experts: int) -> None:
    """Refuse a part count that leaves a part file without experts (it would only add a file to keep track of)."""
    if parts <= 1 or stripe_experts < 1:  # (the writer refuses a bad stripe)
        return
    experts = max((expert + 1 for kind, block, expert, _ in plan if kind == "expert" and block.startswith("layers.")),
                  default=0)
    stripes = -(-experts // stripe_experts)
    if parts > stripes:
        raise MoepackError(f"--parts {parts}: {experts} experts per layer make only {stripes} stripe(s) of "
                           f"{stripe_experts}, so some part files would hold no expert (lower --stripe-experts or "
                           f"--parts)")


def _skip_completed(plan, completed: list[str]) -> int:
    """How many leading plan entries a resumed writer already holds (it must be a prefix of the plan)."""
    for i, name in enumerate(completed):
        kind, block, expert, items = plan[i] if i < len(plan) else (None, None, None, [("", None)])
        if kind is None or name != region_name(kind, block, expert, items[0][0]):
            raise MoepackError(f"cannot resume: the partial output's region {name} is not the plan's region {i}; "
                               f"delete the .partial file and convert again")
    return len(completed)
