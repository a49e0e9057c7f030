"""What a family's synthetic checkpoint is made of; packer/synth.py (`synth_checkpoint`, `moepack synth`) writes it.

No network exists where moepack is tested, so tests and demos build their own models. Each family's package has a
`synth` module (moepack.families.family_synth finds it) that says what its checkpoint of a preset holds:

* ``PRESETS``: its preset names (as its family.json's `synth_presets`);
* ``LAYOUTS``: the layouts it writes (``release``: as the family's releases store their tensors; ``bf16``; ``f32``);
* ``RELEASE_QUANTIZATION_CONFIG``: the config.json quantization block of its release layout;
* ``TAKES_TOKENIZER`` / ``RANDOM_EXPERT_CODES``: whether it embeds a tokenizer of one's own / can draw its routed
  experts' release codes as random bytes;
* ``preset_config(preset)``: a preset's config.json (without quantization_config); ``tokenizer_json()``: its
  byte-level tokenizer;
* ``checkpoint(preset, layout, seed, config_overrides, tokenizer, random_expert_codes)``: a SynthCheckpoint.

The writer streams: every stored tensor's name, dtype and shape is known before any value is drawn, so memory holds
one tensor at a time. Every tensor is drawn in float32 from its own generator (tensor_generator), seeded from
(seed, name), before it is encoded, so the layouts of one seed hold the same model and files are byte-identical
run to run.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moepack.format_spec import untrusted
from moepack.format_spec.errors import MoepackError

# (name, safetensors dtype, shape): one tensor as a layout stores it (a weight, or the scale beside it)
StoredPart = tuple[str, str, tuple[int, ...]]


@dataclass(frozen=True)
class SynthCheckpoint:
    """A family's synthetic checkpoint of a preset, before anything is written."""

    config: dict  # config.json
    specs: Sequence[Any]  # its tensors (each with .name, .numel), in streaming order
    stored: Callable[[Any], list[StoredPart]]  # what a spec becomes in the layout's safetensors files
    encode: Callable[[Any], dict[str, torch.Tensor]]  # a spec's drawn value as those tensors, by name
    # tokenizer.json / tokenizer_config.json: a JSON object, or bytes embedded as they are; one left out is removed
    # from the directory (an earlier run's must not pass for this tokenizer's)
    tokenizer_files: dict[str, dict | bytes]


def layout_config(config: dict, layout: str, release_quantization_config: dict) -> dict:
    """`config` (edited in place, returned) as `layout` stores its model: the release layout's quantization_config
    (a copy of `release_quantization_config`), then the dtype of its floats."""
    if layout == "release":
        config["quantization_config"] = dict(release_quantization_config)
    config["dtype"] = "float32" if layout == "f32" else "bfloat16"
    return config


def tensor_generator(seed: int, name: str) -> torch.Generator:
    """One generator per tensor: a tensor's values depend on (seed, name) only, not on layout, shard or order."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


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


def byte_level_tokenizer(special_tokens: tuple[str, ...], bos_token: str | None,
                         markup_tokens: tuple[str, ...] = ()) -> dict:
    """A byte-level BPE tokenizer.json with no merges: ids 0..len(special_tokens)-1 special, then the 256 bytes, then
    `markup_tokens` (a chat format's role and thinking tags: added tokens, not special, as a release marks them); it
    adds `bos_token` in front (None: nothing)."""
    vocab = {token: i for i, token in enumerate(special_tokens)}
    for byte, char in _byte_to_unicode().items():
        vocab[char] = len(special_tokens) + byte
    added = [(i, token, True) for i, token in enumerate(special_tokens)]
    added += [(len(special_tokens) + 256 + i, token, False) for i, token in enumerate(markup_tokens)]
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
                "normalized": not special,
                "special": special,
            }
            for i, token, special in added
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


def read_tokenizer(path: str | os.PathLike) -> dict[str, Any]:
    """A tokenizer to embed (`synth --tokenizer`): `path` is a tokenizer.json, or a directory holding one (and, if
    present, its tokenizer_config.json, which is embedded too). Returns {"files": {name: bytes}, "vocab": entries
    (the highest id + 1, added tokens included), "bos_token_id"/"eos_token_id": the ids of tokenizer_config.json's
    bos/eos tokens, or None}. A file that does not load raises MoepackError."""
    p = Path(path)
    json_path, config_path = (p / "tokenizer.json", p / "tokenizer_config.json") if p.is_dir() else (p, None)
    files: dict[str, bytes] = {}
    try:
        files["tokenizer.json"] = json_path.read_bytes()
        if config_path is not None and config_path.is_file():
            files["tokenizer_config.json"] = config_path.read_bytes()
    except OSError as e:
        raise MoepackError(f"--tokenizer {path}: cannot read {e.filename} ({e.strerror})") from None
    tok = untrusted.load_tokenizer(files["tokenizer.json"], f"--tokenizer {json_path}")
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
