"""Files the prefill leaves behind, written atomically (temporary name, fsync, rename)."""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file

from moepack.format_spec.errors import MoepackError, error_reason
from moepack.format_spec.files import plain_file_mode, refuse_replacing_a_special_file
from moepack.format_spec.writer import fsync_file


def check_output_path(path: str) -> None:
    """Refuse, before any work, an output file that could not be written: a directory, or a folder that is not
    there or not writable (else a long prefill would end in the error)."""
    parent = os.path.dirname(os.path.abspath(path))
    refuse_replacing_a_special_file(path)
    if os.path.isdir(path):
        raise MoepackError(f"cannot write {path}: it is a directory")
    if not os.path.isdir(parent):
        raise MoepackError(f"cannot write {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise MoepackError(f"cannot write {path}: the directory {parent} is not writable")


def write_logits(path: str, logits: torch.Tensor) -> None:
    """safetensors with one tensor `logits`, float32 [vocab]."""
    tmp = path + ".tmp"
    try:
        save_file({"logits": logits.detach().float().cpu().contiguous()}, tmp)
        os.chmod(tmp, plain_file_mode())  # (safetensors makes it 0600)
        fsync_file(tmp)
        os.replace(tmp, path)
    except Exception as e:  # OSError, or safetensors' own error type for the same failures
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise MoepackError(f"cannot write {path}: {error_reason(e)}") from None
