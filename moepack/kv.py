"""Consumers of a moepack KV directory (format_spec/KV.md) outside moepack's own runtime, for any model family.

`load_transformers_cache(kv_dir, model)` fills the Cache a transformers model keeps while it decodes from a KV a
moepack prefill wrote, so decoding continues where the prefill stopped::

    cache = load_transformers_cache(kv_dir, model)
    ids = continuation_input_ids(kv_dir)              # the prompt + the prefill's next token, [1, N + 1]
    out = model.generate(ids, cache=cache, max_new_tokens=..., do_sample=False)

(`cache=` is transformers 5's name; `past_key_values=` its deprecated alias.) `generate` feeds only the tokens
past the cache (the prefill's next token, at position N) and builds the masks from the cache's length.

The KV directory's manifest names its model's architecture: its family (moepack.families) reads the layer files
and fills the cache (its `transformers_cache`, e.g. families/deepseek_v4/transformers_cache.py for transformers'
DeepseekV4). A family without one is refused in one line. transformers is imported on first use only.
"""

from __future__ import annotations

import os

import torch

from moepack.families import FAMILY_NAMES, family_named, family_of_architecture, kv_format_for
from moepack.families import kv_directory as kvd
from moepack.families.kv_directory import KVCache
from moepack.format_spec.errors import FormatError, MoepackError

__all__ = ["load_transformers_cache", "continuation_input_ids", "read_kv"]


def _family(architecture: str):
    family = family_of_architecture(architecture)
    if family is None:
        raise MoepackError(f"its model ({architecture!r}) is of no model family moepack knows "
                           f"(supported: {', '.join(FAMILY_NAMES)})")
    return family


def read_kv(kv_dir, expect_identity=None, expect_prompt=None, prompt_prefix_of=None, device="cpu",
            dtype: torch.dtype = torch.float32) -> KVCache:
    """families.kv_directory.read_kv of a KV directory of any family: its layers in the format of the family its
    manifest names (validated; FormatError, one line, naming the problem)."""
    return kvd.read_kv(os.fspath(kv_dir), kv_format_for, expect_identity, expect_prompt, prompt_prefix_of, device, dtype)


def _load(kv, expect_prompt=None) -> KVCache:
    if isinstance(kv, KVCache):
        if expect_prompt is not None:
            ids = [int(t) for t in (expect_prompt.tolist() if hasattr(expect_prompt, "tolist") else expect_prompt)]
            if ids != kv.token_ids:
                raise FormatError(f"{kv.path}: prompt mismatch: the KV holds {len(kv.token_ids)} other tokens")
        return kv
    return read_kv(kv, expect_prompt=expect_prompt)


def load_transformers_cache(kv_dir, model, expect_prompt=None, device=None, dtype=None):
    """A `transformers.DynamicCache` for `model` (the transformers model of the KV's family, e.g. a
    DeepseekV4ForCausalLM) holding the state of the KV in `kv_dir` (a path, or a KVCache from `read_kv`). Tensors
    go to the model's device and dtype unless given. The KV is validated (`read_kv`, `expect_prompt`: the exact
    token ids it must hold), and the family checks its shape against `model.config`. A KV of a family that fills
    no transformers cache is a MoepackError naming it and the families that do."""
    kv = _load(kv_dir, expect_prompt)
    family = _family(kv.identity["architecture"])
    fill = getattr(family, "transformers_cache", None)
    if fill is None:
        able = [n for n in FAMILY_NAMES if getattr(family_named(n), "transformers_cache", None) is not None]
        raise MoepackError(f"{kv.path}: a {family.name} KV directory: moepack.kv fills no transformers cache for "
                           f"this family (it does for: {', '.join(able) or 'none'})")
    return fill(kv, model, device=device, dtype=dtype)


def continuation_input_ids(kv_dir, next_token: int | None = None, device=None) -> torch.Tensor:
    """[1, N + 1] LongTensor for `model.generate(..., cache=cache)`: the KV's N prompt tokens followed
    by the prefill's next token (recorded in the KV by KVWriter.finish, or given). generate runs only the last
    one, at position N, against the cache."""
    kv = kv_dir if isinstance(kv_dir, KVCache) else read_kv(kv_dir)
    token = next_token if next_token is not None else kv.next_token
    if token is None:
        raise FormatError(f"{kv.path}: the KV records no next token (finish(next_token=...)); pass next_token")
    return torch.tensor([kv.token_ids + [int(token)]], dtype=torch.long, device=device)
