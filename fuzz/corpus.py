"""Seed corpus of the fuzz harness: small valid containers and KV directories built with the project's own tools
(what moepack reads of its own), small checkpoint directories and GGUF files (what `moepack convert` reads from
outside), and the one-file "bundle" encoding that lets several files travel as one fuzz input: a KV directory, a
checkpoint directory, a GGUF's split files, or a multi-part container (members `main`, `part1`, ...: SPEC.md
section 9).

Seeds are cached in the corpus directory (`<corpus>/<target>/seed-*<extension>`): building the full set (a
synthetic model converted under every policy, transformers' tiny models saved) takes about a minute, the quick set
a few seconds.
"""

from __future__ import annotations

import os
import re
import struct
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGETS = ("container", "kv", "checkpoint", "gguf")
EXTENSIONS = {"container": ".moepack", "kv": ".kvbundle", "checkpoint": ".ckptbundle", "gguf": ".ggufbundle"}

# --- bundles ----------------------------------------------------------------------------------------------------
BUNDLE_MAGIC = b"MOEPACK-FUZZ-BUNDLE\n"
MAIN_MEMBER = "main"  # a multi-part container's main file; part k is member f"part{k}"
_MEMBER = struct.Struct("<HI")  # name length, data length
_MEMBER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def pack_bundle(files: dict[str, bytes]) -> bytes:
    """Several files as one byte string: magic, then per file (name length, data length, name, data)."""
    out = [BUNDLE_MAGIC]
    for name, data in files.items():
        encoded = name.encode()
        out += [_MEMBER.pack(len(encoded), len(data)), encoded, data]
    return b"".join(out)


def unpack_bundle(data: bytes) -> dict[str, bytes]:
    """Lenient inverse of pack_bundle: a damaged bundle yields the files up to the damage (mutated bundles are
    still inputs: a KV directory missing files is a case too). Names that are not plain file names are dropped."""
    files: dict[str, bytes] = {}
    pos = len(BUNDLE_MAGIC) if data.startswith(BUNDLE_MAGIC) else len(data)
    while pos + _MEMBER.size <= len(data):
        name_len, data_len = _MEMBER.unpack_from(data, pos)
        pos += _MEMBER.size
        name = data[pos:pos + name_len].decode("utf-8", "replace")
        pos += name_len
        files_data = data[pos:pos + data_len]
        pos += data_len
        if _MEMBER_NAME.fullmatch(name):
            files[name] = files_data
    return files


def read_kv_dir(path: str | os.PathLike) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(path).iterdir()) if p.is_file()}


def container_bundle(path: str | os.PathLike, parts: int) -> bytes:
    """A multi-part container's main file and part files as one bundle."""
    return pack_bundle({MAIN_MEMBER: Path(path).read_bytes(),
                        **{f"part{k}": Path(f"{path}.part{k}").read_bytes() for k in range(1, parts)}})


# --- seeds ------------------------------------------------------------------------------------------------------
def _import_test_helpers():
    tests = str(REPO / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import containers  # tests/containers.py

    return containers


def _micro_overrides() -> dict:
    """The tiny preset cut to one layer of each attention kind and two experts: every region and tensor kind a
    real container has, a few MB per policy."""
    from moepack.families.deepseek_v4.config import CSA, HCA, SLIDING

    return dict(layer_types=[CSA, HCA, SLIDING], mlp_layer_types=["hash_moe", "moe", "moe"], num_hidden_layers=3,
                n_routed_experts=2, num_experts_per_tok=1)


def _kv_config() -> dict:
    from moepack.packer.synth import preset_config

    return {**preset_config("tiny"), **_micro_overrides()}


def _random_layer_state(kind: str, n_tokens: int, geometry: dict, layer: int, generator):
    """A LayerKVState of the right shapes for `kind` after n_tokens (values random: the reader checks structure)."""
    import torch

    from moepack.families.deepseek_v4.kv import COMPRESSORS, CSA, CompressorState, LayerKVState

    rand = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    d, di, rate = geometry["head_dim"], geometry["index_head_dim"], geometry["compress_rates"][layer]
    parts = {}
    for name in COMPRESSORS[kind]:
        width = d if name == "compressor" else di
        series = 2 if kind == CSA else 1
        entries, buffered = divmod(n_tokens, rate)
        overlap = kind == CSA and entries > 0
        parts[name] = CompressorState(rand(entries, width), rand(buffered, series * width),
                                      rand(buffered, series * width), entries,
                                      rand(rate, width) if overlap else None, rand(rate, width) if overlap else None)
    return LayerKVState(kind, n_tokens, rand(min(n_tokens, geometry["sliding_window"] - 1), d),
                        compressor=parts.get("compressor"), indexer=parts.get("indexer"))


def _write_synthetic_kv(kv_dir: str, dtype: str, n_tokens: int, layers_written: int | None, start: int = 0) -> None:
    """A KV written by KVWriter from random states: complete (with logits) or with only the first layers done."""
    import torch

    from moepack.families.deepseek_v4.kv import KVWriter, make_identity

    config = _kv_config()
    identity = make_identity("deepseek_v4", config, container_index_xxh3=0x0123456789ABCDEF if start else None)
    ids = [(7 * i + 3) % config["vocab_size"] for i in range(n_tokens)]
    writer = KVWriter(kv_dir, identity, ids, dtype=dtype, start_token=start, sync=False)
    generator = torch.Generator().manual_seed(n_tokens)
    geometry = writer.geometry
    count = geometry["num_layers"] if layers_written is None else layers_written
    for layer in range(count):
        writer.write_layer(layer, _random_layer_state(geometry["layer_types"][layer], n_tokens, geometry, layer,
                                                      generator))
    if layers_written is None:
        writer.finish(next_token=ids[-1], logits=torch.randn(config["vocab_size"], generator=generator))


def _handmade_multipart(path: str, parts: int = 2) -> None:
    """A small container of three part files: three experts of one layer, one per part (stripes of 1)."""
    import numpy as np

    from moepack.format_spec.writer import ContainerWriter

    rng = np.random.default_rng(3)
    w = ContainerWriter(path, parts=parts, stripe_experts=1)
    w.begin_region("global", tensor="embed.weight")
    w.add_tensor("embed.weight", "F32", [8, 64], rng.standard_normal((8, 64)).astype(np.float32).tobytes())
    w.end_region()
    w.begin_region("dense", block="layers.0")
    w.add_tensor("layers.0.attn_norm.weight", "BF16", [64], rng.integers(0, 255, 128, dtype=np.uint8).tobytes())
    w.end_region()
    for e in range(3):
        w.begin_region("expert", block="layers.0", expert=e)
        w.add_tensor(f"layers.0.ffn.experts.{e}.w1.weight", "I8", [16, 64],
                     rng.integers(-128, 127, (16, 64), dtype=np.int8).tobytes())
        w.end_region()
    w.finish(config={"model_type": "deepseek_v4", "num_hidden_layers": 1, "n_routed_experts": 3},
             architecture="deepseek_v4", policy={"name": "keep"}, provenance={"source": "fuzz"})


def _quick_seeds(work: Path) -> dict[str, dict[str, bytes]]:
    containers = _import_test_helpers()
    out: dict[str, dict[str, bytes]] = {"container": {}, "kv": {}}
    for name, kwargs in (("handmade-1x2", dict(n_layers=1, n_experts=2)),
                         ("handmade-2x3", dict(n_layers=2, n_experts=3, seed=1)),
                         ("handmade-0x1", dict(n_layers=0, n_experts=1, seed=2))):
        path = work / f"{name}.moepack"
        containers.build_container(str(path), **kwargs)
        out["container"][name] = path.read_bytes()
    _handmade_multipart(str(work / "multipart.moepack"), parts=3)
    out["container"]["handmade-3-parts"] = container_bundle(work / "multipart.moepack", 3)
    # n_tokens 11: CSA closes 2 windows (overlap present), HCA 1; n_tokens 3: no window closed yet.
    for name, args in (("synthetic-f32", ("F32", 11, None)), ("synthetic-bf16", ("BF16", 3, None)),
                       ("synthetic-f8", ("F8_E4M3", 11, None)), ("synthetic-partial", ("F32", 11, 1)),
                       ("synthetic-continued", ("BF16", 11, None, 5))):
        _write_synthetic_kv(str(work / name), *args)
        out["kv"][name] = pack_bundle(read_kv_dir(work / name))
    return out


def _full_seeds(work: Path) -> dict[str, dict[str, bytes]]:
    """A synthetic model (release layout) converted under every policy, and a prefill's KV of it."""
    from moepack.format_spec.policies import POLICY_NAMES
    from moepack.packer.convert import convert_checkpoint
    from moepack.packer.synth import synth_checkpoint
    from moepack.runtime.engine import PrefillOptions, prefill

    out: dict[str, dict[str, bytes]] = {"container": {}, "kv": {}}
    src = str(work / "src")
    synth_checkpoint(src, preset="tiny", layout="release", seed=1, progress=False,
                     config_overrides=_micro_overrides())
    for policy in POLICY_NAMES:
        path = work / f"micro-{policy}.moepack"
        convert_checkpoint(src, str(path), policy=policy, progress=False, drop_mtp=policy == "q8")
        out["container"][f"micro-{policy}"] = path.read_bytes()
    for policy in ("keep", "fp4"):
        path = work / f"micro-{policy}-2-parts.moepack"
        convert_checkpoint(src, str(path), policy=policy, progress=False, parts=2, stripe_experts=1)
        out["container"][f"micro-{policy}-2-parts"] = container_bundle(path, 2)
    for dtype in ("F32", "F8_E4M3"):
        kv_dir = work / f"prefill-{dtype}"
        prefill(str(work / "micro-keep.moepack"), list(range(3, 30)), PrefillOptions(), kv_out=str(kv_dir),
                kv_dtype=dtype)
        out["kv"][f"prefill-{dtype.lower()}"] = pack_bundle(read_kv_dir(kv_dir))
    return out


# A checkpoint seed's dims: the tiny presets narrowed (FP8 blocks and ggml super-blocks still tile them), so that
# a conversion of one takes a tenth of a second and its files a megabyte or two.
_SOURCE_OVERRIDES = {
    "deepseek-v4": lambda: dict(_micro_overrides(), hidden_size=128, q_lora_rank=128, moe_intermediate_size=128,
                                o_lora_rank=64, index_n_heads=4),
    "qwen3-moe": lambda: dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
                              num_experts=4, num_experts_per_tok=2),
}


def _synthetic_source(work: Path, family: str, layout: str) -> Path:
    from moepack.packer.synth import synth_checkpoint

    src = work / f"{family}-{layout}"
    synth_checkpoint(src, preset="tiny", layout=layout, seed=1, progress=False, family=family,
                     config_overrides=_SOURCE_OVERRIDES[family]())
    return src


def _gguf_seeds(work: Path, src: Path, name: str) -> dict[str, bytes]:
    """`moepack export --format gguf` of the checkpoint's keep conversion: one file, and as 2-3 splits."""
    from moepack.packer.convert import convert_checkpoint
    from moepack.packer.gguf_export import export_gguf

    container = str(work / f"{name}.moepack")
    convert_checkpoint(str(src), container, policy="keep", progress=False)
    single = export_gguf(container, str(work / f"{name}.gguf"), progress=False)["output"]
    splits = export_gguf(container, str(work / f"{name}-split.gguf"), progress=False,
                         split_max_size=os.path.getsize(single) // 2)["files"]
    return {name: pack_bundle({Path(single).name: Path(single).read_bytes()}),
            f"{name}-splits": pack_bundle({Path(f).name: Path(f).read_bytes() for f in splits})}


def _source_quick_seeds(work: Path) -> dict[str, dict[str, bytes]]:
    """Synthetic checkpoints (config, sharded safetensors + index, tokenizer files) of both families, and the GGUFs
    exported from their conversions."""
    out: dict[str, dict[str, bytes]] = {"checkpoint": {}, "gguf": {}}
    for family, layout in (("deepseek-v4", "release"), ("qwen3-moe", "bf16")):
        src = _synthetic_source(work, family, layout)
        out["checkpoint"][f"{family}-{layout}"] = pack_bundle(read_kv_dir(src))
        out["gguf"].update(_gguf_seeds(work, src, f"{family}-{layout}"))
    return out


def _source_full_seeds(work: Path) -> dict[str, dict[str, bytes]]:
    """The other synthetic layouts, and transformers' own save_pretrained of tiny random models: DeepSeek-V4
    (tests/v4_models.py's smallest, one model.safetensors) and Qwen3-MoE (sharded by transformers, with its index)."""
    import torch
    import transformers

    _import_test_helpers()  # (puts tests/ on sys.path)
    import v4_models  # tests/v4_models.py

    out: dict[str, dict[str, bytes]] = {"checkpoint": {}, "gguf": {}}
    for family, layout in (("deepseek-v4", "bf16"), ("qwen3-moe", "release")):
        src = _synthetic_source(work, family, layout)
        out["checkpoint"][f"{family}-{layout}"] = pack_bundle(read_kv_dir(src))
    v4 = work / "transformers-deepseek-v4"
    v4_models.saved_model(v4_models.CONFIGS["long"], 5, str(v4))
    out["checkpoint"]["transformers-deepseek-v4"] = pack_bundle(read_kv_dir(v4))
    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                         moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    qwen3 = work / "transformers-qwen3-moe"
    transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(qwen3, max_shard_size="40KB")
    out["checkpoint"]["transformers-qwen3-moe-sharded"] = pack_bundle(read_kv_dir(qwen3))
    return out


# The seed builders, by the targets they seed: (quick, full additions).
_SEEDERS = {("container", "kv"): (_quick_seeds, _full_seeds),
            ("checkpoint", "gguf"): (_source_quick_seeds, _source_full_seeds)}


def ensure_seeds(corpus: str | os.PathLike, full: bool = True, targets=TARGETS) -> None:
    """Write the seed inputs of `targets` into `<corpus>/<target>/seed-*` unless they are there already."""
    corpus = Path(corpus)
    for group, (quick_seeds, full_seeds) in _SEEDERS.items():
        if not set(group) & set(targets):
            continue
        marker = corpus / (f".seeds-full-{'-'.join(group)}" if full else f".seeds-quick-{'-'.join(group)}")
        if marker.exists():
            continue
        with tempfile.TemporaryDirectory(prefix="moepack-fuzz-seeds-") as tmp:
            seeds = quick_seeds(Path(tmp))
            if full:
                for target, items in full_seeds(Path(tmp)).items():
                    seeds[target].update(items)
            for target, items in seeds.items():
                (corpus / target).mkdir(parents=True, exist_ok=True)
                for name, data in items.items():
                    (corpus / target / f"seed-{name}{EXTENSIONS[target]}").write_bytes(data)
        corpus.mkdir(parents=True, exist_ok=True)
        marker.write_text("")


def load_corpus(corpus: str | os.PathLike, target: str) -> list[tuple[str, bytes]]:
    folder = Path(corpus) / target
    return [(p.name, p.read_bytes()) for p in sorted(folder.glob(f"*{EXTENSIONS[target]}"))] if folder.is_dir() else []
