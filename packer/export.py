"""Container -> Hugging Face checkpoint directory, dequantized (`moepack export FILE -o DIR --dtype bf16|f32`).

The way to compare any container with the reference model (transformers loads the result), and a way back for
users. Tensors stored as F32 stay F32 (norms, mHC, sinks, router bias: the model keeps them in float32); integer
tensors (the hash table) stay as they are; every other weight is dequantized (FP8 + block scales, packed FP4 +
scales, ggml blocks, times the tensor scale an NVFP4 weight carries) and written in the requested dtype. Scale and
tensor-scale tensors are consumed by their weights. Written region by region, never more than one shard in
memory, into `model-XXXXX-of-YYYYY.safetensors` shards, then the index, config and tokenizer files; the directory
appears under its name only when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from moepack.families import check_container
from moepack.format_spec.decode import companion_names, decode_group, is_companion
from moepack.format_spec.errors import MoepackError, error_reason, is_disk_full
from moepack.format_spec.files import check_free_space, remove_stale_temporaries, temporary_prefix
from moepack.format_spec.reader import Container
from moepack.format_spec.writer import fsync_dir, fsync_file

from .progress import progress_bar

# the temporary outputs of both exports (temporary_prefix kinds): a killed export's are removed by the next one
EXPORT_TEMPORARIES = ("export", "export-old", "export-tokenizer")
EXPORT_DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
_KEEP_TYPES = ("F32", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL")


def export_tensors(c: Container, region_tensors, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Decode the tensors of some regions into what a Hugging Face checkpoint holds. A weight's scale
    companions are decoded with it wherever they lie (a global weight and its `.scale` are separate regions)."""
    names = {t.name for t in region_tensors}
    tensors = [t for t in region_tensors if is_companion(t.name, names) or not is_companion(t.name, c.tensors)]
    tensors += [c.tensors[n] for t in region_tensors for n in companion_names(t.name)
                if n in c.tensors and n not in names]
    return decode_group(tensors, lambda t: c.tensor_bytes(t.name), dtype, keep=_KEEP_TYPES)


def export_container(path: str, out_dir: str, dtype: str = "bf16", progress: bool = True,
                     shard_bytes: int = 2 << 30, force: bool = False) -> dict:
    """`out_dir` must not exist or be empty, unless `force`: it is then replaced once the new one is complete."""
    if dtype not in EXPORT_DTYPES:
        raise MoepackError(f"unknown export dtype {dtype!r} (choose from {', '.join(EXPORT_DTYPES)})")
    start = time.perf_counter()
    torch_dtype = EXPORT_DTYPES[dtype]
    parent = os.path.dirname(os.path.abspath(out_dir))
    if not os.path.isdir(parent):
        raise MoepackError(f"output's parent directory {parent} does not exist")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise MoepackError(f"{out_dir} exists and is not a directory")
    if os.path.exists(out_dir) and os.listdir(out_dir) and not force:
        raise MoepackError(f"{out_dir} exists and is not empty")
    with Container(path) as c:
        check_container(c, computable=False)  # a model verify refuses (a tensor unlike its config) goes no further
        # every weight comes out dequantized (its scales go into it): elements x the dtype's size
        element_bytes = torch.empty((), dtype=torch_dtype).element_size()
        weights = sum(t.numel for t in c.tensors.values() if not is_companion(t.name, c.tensors))
        remove_stale_temporaries(parent, EXPORT_TEMPORARIES)  # what a killed export left: its space counts
        check_free_space({parent: weights * element_bytes}, f"exporting {out_dir}")
        tmp = tempfile.mkdtemp(prefix=temporary_prefix("export"), dir=parent)
        try:
            shards: list[dict[str, str]] = []  # per shard: tensor name -> (final) shard file
            pending: dict[str, torch.Tensor] = {}
            pending_bytes = total = 0
            bar = progress_bar(c.data_bytes, "export", progress)

            def flush():
                nonlocal pending, pending_bytes
                if pending:
                    save_file(pending, os.path.join(tmp, f"shard-{len(shards)}.tmp"), metadata={"format": "pt"})
                    shards.append(list(pending))
                    pending, pending_bytes = {}, 0

            # regions are decoded one at a time (a weight with its scales)
            for region in c.regions:
                for name, t in export_tensors(c, region.tensors, torch_dtype).items():
                    pending[name] = t
                    nbytes = t.numel() * t.element_size()
                    pending_bytes += nbytes
                    total += nbytes
                bar.update(region.length)
                if pending_bytes >= shard_bytes:
                    flush()
            flush()
            bar.close()
            weight_map = {}
            for i, names in enumerate(shards):
                final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                os.rename(os.path.join(tmp, f"shard-{i}.tmp"), os.path.join(tmp, final))
                weight_map.update({n: final for n in names})
            config = {k: v for k, v in c.config.items() if k != "quantization_config"}
            config["dtype"] = "bfloat16" if dtype == "bf16" else "float32"
            _write_json(os.path.join(tmp, "config.json"), config)
            _write_json(os.path.join(tmp, "model.safetensors.index.json"),
                        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
            for name, data in c.tokenizer_files().items():
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(data)
            for name in os.listdir(tmp):  # on disk before the directory gets its final name
                fsync_file(os.path.join(tmp, name))
            fsync_dir(tmp)
            old = None
            if os.path.exists(out_dir):  # the old one goes only now that the new one is complete
                old = tempfile.mkdtemp(prefix=temporary_prefix("export-old"), dir=parent)
                os.rename(out_dir, os.path.join(old, "dir"))
            os.replace(tmp, out_dir)
            fsync_dir(parent)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except (OSError, SafetensorError) as e:  # a full disk, a vanished folder: one line, nothing left behind
            shutil.rmtree(tmp, ignore_errors=True)
            full = " (disk full)" if is_disk_full(e) else ""
            raise MoepackError(f"writing {out_dir} failed: {error_reason(e)}{full}") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return {"output": out_dir, "dtype": dtype, "tensors": len(weight_map), "shards": len(shards),
            "bytes": total, "seconds": round(time.perf_counter() - start, 3)}


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
