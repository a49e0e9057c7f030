"""Synthetic DeepSeek-V4 checkpoints: every tensor the real release holds, at sizes a test or a demo can afford.

No network exists where moepack is tested, so tests and demos build their own models. What a DeepSeek-V4
checkpoint of a config holds is moepack.families.deepseek_v4.tensors' schema (`v4_tensor_specs`, canonical names, no
`model.` prefix); `synth_checkpoint` writes a Hugging Face-style directory with random but well-scaled weights in one of
three layouts:

* ``release``: what deepseek-ai ships. Dense linears FP8 e4m3 + `.scale` (E8M0, 128x128 blocks); routed experts
  packed FP4 e2m1 as I8 [out, in/2] + `.scale` (E8M0, one per 32 inputs); router, compressor and indexer
  `weights_proj` linears BF16; embed/head BF16; norms, mHC, sinks, ape, router bias F32; tid2eid I64.
* ``bf16``: every float tensor BF16 except the ones transformers keeps in F32 (role "exact").
* ``f32``: every float tensor F32.

Every tensor is drawn in float32 from its own generator, seeded from (seed, name), before it is encoded, so the
layouts of one seed hold the same model (the release one up to FP8/FP4 rounding) and files are byte-identical
run to run. Writing streams: shard headers are known up front (shapes and dtypes follow from the config), so
each tensor is drawn, encoded and written on its own and memory holds one tensor at a time.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import time
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from moepack.families.deepseek_v4.config import CSA, HCA, SLIDING, ModelConfig
from moepack.families.deepseek_v4.tensors import (DTYPE_BYTES as _DTYPE_BYTES, ROLE_DENSE_LINEAR, ROLE_EXPERT,
                                                  StoredTensor, TensorSpec, check_layout as _check_layout,
                                                  stored_tensors, v4_tensor_specs)
from moepack.format_spec import untrusted
from moepack.format_spec.errors import MoepackError, is_disk_full
from moepack.format_spec.files import check_free_space
from moepack.format_spec.source_formats import FP8_BLOCK, fp4_quantize, fp8_block_quantize
from moepack.format_spec.writer import fsync_dir, write_file_atomically

from .sharding import greedy_shards

PRESETS = ("tiny", "small", "medium")
FAMILIES = ("deepseek-v4", "qwen3-moe")  # `synth --family`; DeepSeek-V4 the default

# The release's config.json quantization block (as in tests/data/deepseek-v4-flash.config.json).
RELEASE_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "expert_dtype": "fp4",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
}

_TORCH_DTYPE_NAMES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int8: "I8",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e8m0fnu: "F8_E8M0",
}


# ---------------------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------------------

# Sizes chosen so every linear's input dim is a multiple of 256 and its output dim a multiple of 32 where the
# architecture allows (ggml's 256-element super-blocks and FP8's 128x128 blocks all apply, and hidden >= 256
# tiles FP8 blocks for real), and compress rates small enough that a short prompt closes several windows.
_PRESET_DIMS: dict[str, dict[str, Any]] = {
    # ~12M parameters, a few MB in the release layout: every layer kind once, tests load it in a second.
    "tiny": dict(
        vocab_size=512,
        hidden_size=256,
        moe_intermediate_size=256,
        layer_types=[SLIDING, CSA, HCA, SLIDING],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        num_attention_heads=4,
        head_dim=128,
        q_lora_rank=256,
        o_groups=2,
        o_lora_rank=128,
        index_n_heads=8,
        index_head_dim=32,
        index_topk=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        compress_rates={CSA: 4, HCA: 8},
        sliding_window=16,
    ),
    # ~110M parameters, ~60 MB in the release layout.
    "small": dict(
        vocab_size=1024,
        hidden_size=512,
        moe_intermediate_size=256,
        layer_types=[SLIDING, SLIDING, CSA, HCA, CSA, SLIDING],
        mlp_layer_types=["hash_moe", "hash_moe", "hash_moe", "moe", "moe", "moe"],
        num_attention_heads=8,
        head_dim=128,
        q_lora_rank=256,
        o_groups=4,
        o_lora_rank=128,
        index_n_heads=16,
        index_head_dim=64,
        index_topk=8,
        n_routed_experts=32,
        num_experts_per_tok=4,
        compress_rates={CSA: 4, HCA: 16},
        sliding_window=32,
    ),
    # ~4.4B parameters: ~2.4 GB in the release layout, ~9 GB in bf16 (transformers still holds it in 24 GB).
    "medium": dict(
        vocab_size=8192,
        hidden_size=1024,
        moe_intermediate_size=1024,
        layer_types=[SLIDING, SLIDING] + [CSA, HCA] * 8 + [CSA, SLIDING],
        mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 17,
        num_attention_heads=8,
        head_dim=256,
        q_lora_rank=512,
        o_groups=4,
        o_lora_rank=256,
        index_n_heads=16,
        index_head_dim=64,
        index_topk=16,
        n_routed_experts=64,
        num_experts_per_tok=6,
        compress_rates={CSA: 4, HCA: 32},
        sliding_window=64,
    ),
}


def preset_config(preset: str) -> dict:
    """The config.json (transformers DeepseekV4Config field names) of a preset, without quantization_config."""
    if preset not in _PRESET_DIMS:
        raise MoepackError(f"unknown preset {preset!r} (choose one of {', '.join(PRESETS)})")
    dims = json.loads(json.dumps(_PRESET_DIMS[preset]))  # a deep copy callers may edit
    partial_rotary_factor = 0.125  # as V4-Flash: 64 rope dims of a 512 head
    config = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": None,
        "compress_rope_theta": 160000.0,
        "hc_eps": 1e-06,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_position_embeddings": 1048576,
        "mlp_bias": False,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_hidden_layers": len(dims["layer_types"]),
        "num_key_value_heads": 1,
        "num_nextn_predict_layers": 1,
        "partial_rotary_factor": partial_rotary_factor,
        "qk_rope_head_dim": int(dims["head_dim"] * partial_rotary_factor),
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "rope_parameters": {
            "main": {"partial_rotary_factor": partial_rotary_factor, "rope_theta": 10000.0, "rope_type": "default"},
            "compress": {
                "attention_factor": 1.0,
                "beta_fast": 32,
                "beta_slow": 1,
                "factor": 16,
                "original_max_position_embeddings": 65536,
                "partial_rotary_factor": partial_rotary_factor,
                "rope_theta": 160000.0,
                "rope_type": "yarn",
                "type": "yarn",
            },
        },
        "routed_scaling_factor": 1.5,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "scoring_func": "sqrtsoftplus",
        "swiglu_limit": 10.0,
        "tie_word_embeddings": False,
        "use_cache": True,
    }
    config.update(dims)
    return dict(sorted(config.items()))


# ---------------------------------------------------------------------------------------------------------
# Drawing and encoding one tensor
# ---------------------------------------------------------------------------------------------------------


def _tensor_generator(seed: int, name: str) -> torch.Generator:
    # One generator per tensor: a tensor's values depend on (seed, name) only, not on layout, shard or order.
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def draw_tensor(spec: TensorSpec, config: dict, seed: int) -> torch.Tensor:
    """The float32 (int64 for tid2eid) value of `spec` in the synthetic model of this seed, before encoding."""
    generator = _tensor_generator(seed, spec.name)
    if spec.kind == "tid2eid":
        # Each token routes to top_k distinct experts: the first top_k of a random permutation per row.
        vocab, top_k = spec.shape
        noise = torch.rand(vocab, ModelConfig.from_hf(config).n_routed_experts, generator=generator)
        return noise.argsort(dim=1, stable=True)[:, :top_k].contiguous()
    values = torch.randn(spec.shape, generator=generator)
    if spec.kind in ("linear", "hc_fn"):
        # As an initialised model: unit-variance inputs give unit-variance outputs.
        return values.mul_(1.0 / math.sqrt(spec.shape[-1]))
    if spec.kind == "embedding":
        return values  # rows of unit RMS, as the RMSNorms downstream expect
    if spec.kind in ("norm", "hc_scale"):
        return values.mul_(0.05).add_(1.0)  # near one, but not exactly: a mis-mapped norm shows
    spread = {"hc_base": 0.1, "attn_sink": 0.5, "ape": 0.2, "router_bias": 0.02}
    return values.mul_(spread[spec.kind])


def encode_tensor(spec: TensorSpec, value: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    """`value` (from draw_tensor) as the tensors `stored_tensors(spec, layout)` lists, by name."""
    parts = stored_tensors(spec, layout)
    if spec.kind == "tid2eid":
        return {spec.name: value}
    if layout == "release" and spec.role == ROLE_DENSE_LINEAR:
        weight, scale = fp8_block_quantize(value)
        return {parts[0].name: weight, parts[1].name: scale}
    if layout == "release" and spec.role == ROLE_EXPERT:
        packed, scale = fp4_quantize(value)
        return {parts[0].name: packed, parts[1].name: scale}
    dtype = torch.float32 if parts[0].dtype == "F32" else torch.bfloat16
    return {spec.name: value.to(dtype)}


# the RMS of an e2m1 code drawn uniformly from the 16: sqrt(mean of 0, .25, 1, 2.25, 4, 9, 16, 36) over both signs
_E2M1_UNIFORM_RMS = math.sqrt(68.5 / 8)


def random_fp4_expert(spec: TensorSpec, layout: str, seed: int) -> dict[str, torch.Tensor]:
    """A routed expert's matrix as the release stores it, its packed codes random bytes and every scale the one
    power of two that gives its outputs about unit variance (as draw_tensor's linears): no float is drawn."""
    out_features, in_features = spec.shape
    parts = stored_tensors(spec, layout)
    rng = np.random.default_rng(_tensor_generator(seed, spec.name).initial_seed())  # numpy's bytes: 3x torch's
    packed = torch.from_numpy(rng.integers(0, 256, (out_features, in_features // 2), dtype=np.uint8)).view(torch.int8)
    exponent = round(math.log2(1.0 / (_E2M1_UNIFORM_RMS * math.sqrt(in_features))))
    scale = torch.full((out_features, in_features // 32), exponent + 127, dtype=torch.uint8)
    return {parts[0].name: packed, parts[1].name: scale.view(torch.float8_e8m0fnu)}


# ---------------------------------------------------------------------------------------------------------
# Streaming safetensors writer
# ---------------------------------------------------------------------------------------------------------


class _ShardWriter:
    """Writes one safetensors file whose tensors are all known up front, one tensor at a time.

    The format puts the header first; here every name, dtype and shape is known before any value is drawn, so
    the header goes out at once and tensors follow in header order, each written as soon as it exists.
    """

    def __init__(self, path: Path, tensors: list[StoredTensor]):
        self.path = path
        self.expected = tensors
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for t in tensors:
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        header_bytes = json.dumps(header, separators=(",", ":")).encode()
        header_bytes += b" " * (-(8 + len(header_bytes)) % 8)  # tensor data starts 8-byte aligned
        self.partial = path.with_name(path.name + ".partial")
        self.file: BinaryIO = open(self.partial, "wb")
        self.file.write(struct.pack("<Q", len(header_bytes)))
        self.file.write(header_bytes)
        self.written = 0

    def __enter__(self) -> "_ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Complete: fsynced and renamed to its name. Not (a full disk, an interrupted run): removed."""
        complete = False
        try:
            if exc_type is None:
                if self.written != len(self.expected):
                    raise AssertionError(f"{self.path.name}: {len(self.expected) - self.written} tensors never written")
                self.file.flush()
                os.fsync(self.file.fileno())
                complete = True
        finally:
            try:
                self.file.close()
            finally:
                if complete:
                    os.replace(self.partial, self.path)
                else:
                    self.partial.unlink(missing_ok=True)

    def write(self, name: str, tensor: torch.Tensor) -> int:
        expected = self.expected[self.written]
        actual = (name, _TORCH_DTYPE_NAMES.get(tensor.dtype), tuple(tensor.shape))
        if actual != (expected.name, expected.dtype, expected.shape):
            raise AssertionError(f"{self.path.name}: wrote {actual}, header says {expected}")
        self.file.write(memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy()))
        self.written += 1
        return expected.nbytes


def _element_bytes(spec: TensorSpec, layout: str) -> int:
    # A weight and its scale always have the same element size (1 byte for FP8/FP4 + E8M0).
    return _DTYPE_BYTES[stored_tensors(spec, layout)[0].dtype]


def _plan_shards(specs: list[TensorSpec], layout: str, shard_bytes: int) -> list[list[TensorSpec]]:
    """Greedy, in streaming order; a weight and its scale share a shard; a tensor over shard_bytes gets its own."""
    return greedy_shards(specs, lambda spec: sum(t.nbytes for t in stored_tensors(spec, layout)), shard_bytes)


# ---------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
_SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)  # ids 0, 1, 2, as bos/eos in the release config


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def tokenizer_json(special_tokens: tuple[str, ...] = _SPECIAL_TOKENS, bos_token: str | None = BOS_TOKEN) -> dict:
    """A byte-level BPE tokenizer with no merges: ids 0-2 special, 3-258 the 256 bytes; it adds `bos_token` in front
    (None: nothing, as Qwen's)."""
    vocab = {token: i for i, token in enumerate(special_tokens)}
    for byte, char in _byte_to_unicode().items():
        vocab[char] = len(special_tokens) + byte
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": token,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, token in enumerate(special_tokens)
        ],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None if bos_token is None else {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos_token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": bos_token, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": bos_token, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos_token: {"id": bos_token, "ids": [special_tokens.index(bos_token)],
                                           "tokens": [bos_token]}},
        },
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


TOKENIZER_VOCAB_SIZE = len(_SPECIAL_TOKENS) + 256


def _tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
    }


# A tokenizer of one's own (`synth --tokenizer`), e.g. the release's: embedded byte for byte instead of the one above.
VOCAB_MULTIPLE = 128  # the release pads its tokenizer to 129,280 = 1010 x 128 entries, and vocab_size is that


def read_tokenizer(path: str | os.PathLike) -> dict[str, Any]:
    """A tokenizer to embed: `path` is a tokenizer.json, or a directory holding one (and, if present, its
    tokenizer_config.json, which is embedded too). Returns {"files": {name: bytes}, "vocab": entries (the highest
    id + 1, added tokens included), "bos_token_id"/"eos_token_id": the ids of tokenizer_config.json's bos/eos
    tokens, or None}. A file that does not load raises MoepackError."""
    p = Path(path)
    json_path, config_path = (p / "tokenizer.json", p / "tokenizer_config.json") if p.is_dir() else (p, None)
    files: dict[str, bytes] = {}
    try:
        files["tokenizer.json"] = json_path.read_bytes()
        if config_path is not None and config_path.is_file():
            files["tokenizer_config.json"] = config_path.read_bytes()
    except OSError as e:
        raise MoepackError(f"--tokenizer {path}: cannot read {e.filename} ({e.strerror})") from None
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
    except Exception as e:  # the tokenizers library raises its own exception types; a bad encoding is one too
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MoepackError(f"--tokenizer {json_path}: not a tokenizer.json the tokenizers library loads "
                           f"({reason})") from None
    config: dict = {}
    if "tokenizer_config.json" in files:
        try:
            config = untrusted.loads(files["tokenizer_config.json"], f"--tokenizer {config_path}")
        except untrusted.UntrustedInputError as e:
            raise MoepackError(f"--tokenizer {config_path}: not JSON ({e.detail})") from None
        if not isinstance(config, dict):
            raise MoepackError(f"--tokenizer {config_path}: expected a JSON object")

    def token_id(key: str) -> int | None:
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token  # an AddedToken object or a plain string
        return tok.token_to_id(token) if isinstance(token, str) else None

    vocab = tok.get_vocab(with_added_tokens=True)
    return {"files": files, "vocab": max(vocab.values(), default=-1) + 1,
            "bos_token_id": token_id("bos_token"), "eos_token_id": token_id("eos_token")}


def _fit_config_to_tokenizer(config: dict, tokenizer: dict, vocab_overridden: bool) -> None:
    """Raise vocab_size to the tokenizer's entries, rounded up to VOCAB_MULTIPLE; take its BOS/EOS ids."""
    need = tokenizer["vocab"]
    if config["vocab_size"] < need:
        if vocab_overridden:
            raise MoepackError(f"vocab_size {config['vocab_size']} is smaller than the tokenizer's {need} entries")
        config["vocab_size"] = -(-need // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    for key in ("bos_token_id", "eos_token_id"):
        if tokenizer[key] is not None:
            config[key] = tokenizer[key]


# ---------------------------------------------------------------------------------------------------------
# The checkpoint
# ---------------------------------------------------------------------------------------------------------


_METADATA_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def _write_checkpoint_files(out: Path, config: dict, shards: list, shard_names: list[str], layout: str, seed: int,
                            preset: str, progress: bool, total_tensor_bytes: int,
                            tokenizer_files: dict[str, bytes] | None = None, random_expert_codes: bool = False
                            ) -> None:
    """The checkpoint's metadata files, shards and (last: a directory without it is no checkpoint) its index."""
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"], "do_sample": False},
    )
    if tokenizer_files is None:
        _write_json(out / "tokenizer.json", tokenizer_json())
        _write_json(out / "tokenizer_config.json", _tokenizer_config())
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if name in tokenizer_files:
                write_file_atomically(str(out / name), tokenizer_files[name])
            else:  # an earlier run's must not pass for this tokenizer's
                (out / name).unlink(missing_ok=True)

    from .progress import progress_bar

    weight_map: dict[str, str] = {}
    with progress_bar(total_tensor_bytes, f"synth {preset}", progress) as bar:
        for shard_name, shard_specs in zip(shard_names, shards):
            # Widest elements first (as safetensors' own writer orders them), so every tensor stays aligned to its
            # element size in the file; the sort is stable, so streaming order holds within each width.
            ordered = sorted(shard_specs, key=lambda s: -_element_bytes(s, layout))
            with _ShardWriter(out / shard_name, [t for s in ordered for t in stored_tensors(s, layout)]) as writer:
                for spec in ordered:
                    if random_expert_codes and layout == "release" and spec.role == ROLE_EXPERT:
                        encoded = random_fp4_expert(spec, layout, seed)
                    else:
                        encoded = encode_tensor(spec, draw_tensor(spec, config, seed), layout)
                    for part in stored_tensors(spec, layout):
                        bar.update(writer.write(part.name, encoded[part.name]))
                        weight_map[part.name] = shard_name
    index = {"metadata": {"total_size": total_tensor_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / "model.safetensors.index.json", index)


def _write_json(path: Path, obj: Any) -> None:
    write_file_atomically(str(path), (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))


def _prepare_output(out: Path, total_tensor_bytes: int, overwrite: bool, shard_bytes: int | None) -> int:
    """The output directory made ready (an earlier run's shards removed when `overwrite`, room for the new ones
    checked); returns the shard size (None: at least 3 shards, at most 1 GiB each)."""
    if out.exists() and not out.is_dir():
        raise MoepackError(f"{out} exists and is not a directory")
    stale = sorted(out.glob("model*.safetensors*")) if out.exists() else []
    if stale and not overwrite:
        raise MoepackError(f"{out} already holds a checkpoint ({stale[0].name}); pass --force (overwrite=True) to "
                           "replace it")
    check_free_space({str(out): total_tensor_bytes - sum(p.stat().st_size for p in stale)}, f"synthesizing {out}")
    out.mkdir(parents=True, exist_ok=True)
    for path in stale:
        path.unlink()  # shards of an earlier, differently sharded run must not linger beside the new index
    if shard_bytes is None:
        shard_bytes = min(1 << 30, -(-total_tensor_bytes // 3))
    if shard_bytes <= 0:
        raise MoepackError(f"shard_bytes must be positive, got {shard_bytes}")
    return shard_bytes


def _shard_names(count: int) -> list[str]:
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _write_or_leave_nothing(out: Path, files: list[str], write) -> None:
    """write(), then the directory fsynced; an OSError (a full disk, a vanished folder) is one line, and none of
    this run's `files` are left behind."""
    try:
        write()
    except OSError as e:
        for name in files:
            (out / name).unlink(missing_ok=True)
        full = " (disk full)" if is_disk_full(e) else ""
        raise MoepackError(f"writing {e.filename or out} failed: {e.strerror or e}{full}") from None
    fsync_dir(str(out))


def synth_checkpoint(
    out_dir: str | os.PathLike,
    preset: str = "tiny",
    layout: str = "release",
    seed: int = 0,
    shard_bytes: int | None = None,
    progress: bool = True,
    overwrite: bool = False,
    config_overrides: dict | None = None,
    tokenizer: str | os.PathLike | None = None,
    random_expert_codes: bool = False,
    family: str = "deepseek-v4",
) -> dict:
    """Write a synthetic DeepSeek-V4 checkpoint directory (config, sharded safetensors + index, tokenizer,
    generation config). shard_bytes=None: at least 3 shards, at most 1 GiB each. `config_overrides` replace
    preset fields (e.g. more layers for a streaming-memory test; keep layer_types/mlp_layer_types consistent).
    `tokenizer`: a tokenizer.json, or a directory holding tokenizer.json (+ tokenizer_config.json), embedded
    byte for byte instead of the tiny byte-level tokenizer (see read_tokenizer); `random_expert_codes` (release
    layout): the routed experts' FP4 codes drawn as random bytes, each matrix under one scale (random_fp4_expert;
    a release-sized model's 10 GB of expert floats take minutes to draw and quantize); vocab_size is raised to its
    entries rounded up to a multiple of 128 (the release tokenizer's 129,280 stays 129,280: embed, head and
    tid2eid grow to it) and bos/eos ids follow its tokenizer_config.json.
    `family`: "deepseek-v4", or "qwen3-moe" (synth_qwen3_moe: tiny and small presets, no own tokenizer).
    Returns a summary: dir, preset, layout, files, bytes (all files written), params (logical, MTP included),
    seconds."""
    if family != "deepseek-v4":
        if family not in FAMILIES:
            raise MoepackError(f"unknown model family {family!r} (choose one of {', '.join(FAMILIES)})")
        if tokenizer is not None or random_expert_codes:
            raise MoepackError(f"--tokenizer and random expert codes are for deepseek-v4 only, not {family} (it "
                               "writes its own byte-level tokenizer)")
        return synth_qwen3_moe(out_dir, preset, layout, seed, shard_bytes, progress, overwrite, config_overrides)
    _check_layout(layout)
    started = time.perf_counter()
    config = {**preset_config(preset), **(config_overrides or {})}
    own_tokenizer = read_tokenizer(tokenizer) if tokenizer is not None else None
    if own_tokenizer is not None:
        _fit_config_to_tokenizer(config, own_tokenizer, "vocab_size" in (config_overrides or {}))
    if layout == "release":
        config["quantization_config"] = dict(RELEASE_QUANTIZATION_CONFIG)
    config["dtype"] = "float32" if layout == "f32" else "bfloat16"
    specs = v4_tensor_specs(config)
    if own_tokenizer is None and TOKENIZER_VOCAB_SIZE > ModelConfig.from_hf(config).vocab_size:
        raise AssertionError("preset vocab smaller than the tokenizer's")

    out = Path(out_dir)
    total_tensor_bytes = sum(t.nbytes for s in specs for t in stored_tensors(s, layout))
    shard_bytes = _prepare_output(out, total_tensor_bytes, overwrite, shard_bytes)
    shards = _plan_shards(specs, layout, shard_bytes)

    shard_names = _shard_names(len(shards))
    metadata_files = [f for f in _METADATA_FILES if own_tokenizer is None or not f.startswith("tokenizer")]
    metadata_files += sorted(own_tokenizer["files"]) if own_tokenizer is not None else []
    files = sorted([*metadata_files, *shard_names, "model.safetensors.index.json"])
    _write_or_leave_nothing(out, files, lambda: _write_checkpoint_files(
        out, config, shards, shard_names, layout, seed, preset, progress, total_tensor_bytes,
        own_tokenizer["files"] if own_tokenizer is not None else None, random_expert_codes))

    return {
        "dir": str(out),
        "preset": preset,
        "layout": layout,
        "files": files,
        "bytes": sum((out / f).stat().st_size for f in files),
        "params": sum(s.numel for s in specs),
        "seconds": round(time.perf_counter() - started, 3),
    }


# ---------------------------------------------------------------------------------------------------------
# Qwen3-MoE (`synth --family qwen3-moe`)
# ---------------------------------------------------------------------------------------------------------

# Qwen3-30B-A3B's proportions, shrunk: GQA (two query heads per KV head), head_dim 64, every layer routed, top-k
# renormalised; the dims multiples of 128 and 256 as the DeepSeek-V4 presets' (FP8 blocks, ggml super-blocks).
QWEN3_MOE_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
                 num_experts_per_tok=2),
    "small": dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                  num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=32,
                  num_experts_per_tok=4),
}
# config.json's quantization_config of Qwen's `-FP8` releases (the `release` layout here)
QWEN3_FP8_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                 "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
QWEN3_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # Qwen's: ids 0-2 here
# ChatML, as Qwen3's tokenizer_config carries it (without its tool and thinking parts)
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def qwen3_moe_config(preset: str) -> dict:
    """The config.json (transformers' Qwen3MoeConfig field names, as the releases spell them) of a preset."""
    if preset not in QWEN3_MOE_PRESETS:
        raise MoepackError(f"unknown qwen3-moe preset {preset!r} (choose one of {', '.join(QWEN3_MOE_PRESETS)})")
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": None,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu", "initializer_range": 0.02,
        "max_position_embeddings": 32768, "norm_topk_prob": True, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "rope_scaling": None, "router_aux_loss_coef": 0.001, "sliding_window": None, "use_sliding_window": False,
        "tie_word_embeddings": False, "use_cache": True, **QWEN3_MOE_PRESETS[preset],
    }
    return dict(sorted(config.items()))


def _qwen3_stored(spec, layout: str) -> list[StoredTensor]:
    """What `layout` stores for `spec`: a release's tensors (the `release` layout's FP8 linears with their BF16
    `weight_scale_inv`, as families.qwen3_moe reads them), or the one float tensor of `bf16` / `f32`."""
    from moepack.families.qwen3_moe.tensors import release_tensors

    if layout == "f32":
        return [StoredTensor(spec.name, "F32", spec.shape)]
    return [StoredTensor(*t) for t in release_tensors(spec, fp8=layout == "release")]


def _qwen3_encoded(spec, layout: str, seed: int) -> dict[str, torch.Tensor]:
    """A tensor drawn from its own generator (as DeepSeek-V4's: unit-variance linears, unit-RMS embedding rows,
    norms near one) and stored in `layout`; FP8 through format_spec's block quantizer, its power-of-two scales
    exact in BF16."""
    from moepack.families.base import ROLE_EMBED, ROLE_NORM

    value = torch.randn(spec.shape, generator=_tensor_generator(seed, spec.name))
    if spec.role == ROLE_NORM:
        value.mul_(0.05).add_(1.0)
    elif spec.role != ROLE_EMBED:
        value.mul_(1.0 / math.sqrt(spec.shape[-1]))
    parts = _qwen3_stored(spec, layout)
    if len(parts) == 2:  # an FP8 weight and its block scales
        weight, scale = fp8_block_quantize(value)
        return {parts[0].name: weight, parts[1].name: scale.float().to(torch.bfloat16)}
    return {spec.name: value.to(torch.float32 if layout == "f32" else torch.bfloat16)}


def synth_qwen3_moe(out_dir: str | os.PathLike, preset: str = "tiny", layout: str = "release", seed: int = 0,
                    shard_bytes: int | None = None, progress: bool = True, overwrite: bool = False,
                    config_overrides: dict | None = None) -> dict:
    """Write a synthetic Qwen3-MoE checkpoint directory as Qwen ships one: config.json, sharded safetensors + index
    under transformers' names (moepack.families.qwen3_moe's schema), a byte-level tokenizer with Qwen's special
    tokens and a ChatML chat_template in its tokenizer_config, generation_config. Layouts: `release` (the `-FP8`
    releases: F8_E4M3 linears + BF16 `weight_scale_inv` per 128x128 block), `bf16`, `f32`. Returns the same
    summary as synth_checkpoint."""
    from moepack.families.qwen3_moe.config import Qwen3MoeConfig
    from moepack.families.qwen3_moe.tensors import tensor_specs as qwen3_tensor_specs

    _check_layout(layout)
    started = time.perf_counter()
    config = {**qwen3_moe_config(preset), **(config_overrides or {})}
    if layout == "release":
        config["quantization_config"] = dict(QWEN3_FP8_QUANTIZATION_CONFIG)
    config["dtype"] = "float32" if layout == "f32" else "bfloat16"
    specs = qwen3_tensor_specs(Qwen3MoeConfig.from_hf(config))
    out = Path(out_dir)
    total_tensor_bytes = sum(t.nbytes for s in specs for t in _qwen3_stored(s, layout))
    shard_bytes = _prepare_output(out, total_tensor_bytes, overwrite, shard_bytes)
    shards = greedy_shards(specs, lambda s: sum(t.nbytes for t in _qwen3_stored(s, layout)), shard_bytes)
    shard_names = _shard_names(len(shards))
    files = sorted([*_METADATA_FILES, *shard_names, "model.safetensors.index.json"])

    def write() -> None:
        from .progress import progress_bar

        _write_json(out / "config.json", config)
        _write_json(out / "generation_config.json", {"bos_token_id": config["bos_token_id"],
                                                     "eos_token_id": config["eos_token_id"], "do_sample": False})
        _write_json(out / "tokenizer.json", tokenizer_json(QWEN3_SPECIAL_TOKENS, bos_token=None))
        _write_json(out / "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>", "add_bos_token": False, "add_eos_token": False,
            "clean_up_tokenization_spaces": False, "model_max_length": config["max_position_embeddings"],
            "chat_template": QWEN3_CHAT_TEMPLATE})
        weight_map: dict[str, str] = {}
        with progress_bar(total_tensor_bytes, f"synth qwen3-moe {preset}", progress) as bar:
            for shard_name, shard_specs in zip(shard_names, shards):
                # widest elements first (an FP8 weight's BF16 scale before every FP8 weight), so each tensor stays
                # aligned to its element size; a drawn tensor's parts wait in `encoded` until their turn
                parts = sorted(((t, spec) for spec in shard_specs for t in _qwen3_stored(spec, layout)),
                               key=lambda part: -_DTYPE_BYTES[part[0].dtype])
                encoded: dict[str, torch.Tensor] = {}
                with _ShardWriter(out / shard_name, [t for t, _ in parts]) as writer:
                    for stored, spec in parts:
                        if stored.name not in encoded:
                            encoded.update(_qwen3_encoded(spec, layout, seed))
                        bar.update(writer.write(stored.name, encoded.pop(stored.name)))
                        weight_map[stored.name] = shard_name
        _write_json(out / "model.safetensors.index.json",
                    {"metadata": {"total_size": total_tensor_bytes}, "weight_map": dict(sorted(weight_map.items()))})

    _write_or_leave_nothing(out, files, write)
    return {"dir": str(out), "preset": preset, "layout": layout, "family": "qwen3-moe", "files": files,
            "bytes": sum((out / f).stat().st_size for f in files), "params": sum(s.numel for s in specs),
            "seconds": round(time.perf_counter() - started, 3)}
