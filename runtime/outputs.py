"""Files the prefill leaves behind, written atomically (temporary name, fsync, rename)."""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file

from moepack.format_spec.errors import MoepackError


def write_logits(path: str, logits: torch.Tensor) -> None:
    """safetensors with one tensor `logits`, float32 [vocab]."""
    tmp = path + ".tmp"
    try:
        save_file({"logits": logits.detach().float().cpu().contiguous()}, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise MoepackError(f"cannot write {path}: {e.strerror or e}") from None
