"""What the Triton kernel tests share: Triton imported for its interpreter (kernels on CPU tensors), and a kernel's
ahead-of-time compile for sm_90 (H100 / H200) in a process of its own, both without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

_imported = False  # Triton imported here for its interpreter (by an earlier test module)


def import_for_the_interpreter() -> None:
    """Triton imported with TRITON_INTERPRET=1, or the calling test module skipped: where CUDA is (the _cuda test
    files run the kernels there, and the two Tritons cannot share a process), where Triton is absent (the
    project's CI) or was imported before without it. Triton's interpreter takes over its library's jitted
    functions (tl.max...) when they are decorated, at its import: each test sets TRITON_INTERPRET again."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device: the kernels are tested there (the _cuda test files)", allow_module_level=True)
    global _imported
    if "triton" in sys.modules and not _imported and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before, not for its interpreter", allow_module_level=True)
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pytest.importorskip("triton")
        pytest.importorskip("triton.language")
        _imported = True
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]


def compiled_for_hopper(script: str) -> str:
    """The output of `script` (Python compiling kernels with triton.compile for GPUTarget("cuda", 90, 32)), run in
    a process of its own: this one's Triton is the interpreter's, whose library Triton's compiler refuses. Skips
    where this Triton has no ahead-of-time compile; fails with the script's error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    if "ModuleNotFoundError: No module named 'triton.backends.compiler'" in done.stderr:
        pytest.skip("this Triton has no ahead-of-time compile")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def interpreting(monkeypatch, kernel_module) -> None:
    """Kernels run by Triton's interpreter on CPU tensors, with no decision or forcing of `kernel_module`'s (its
    FORCE_ENV, its DECISIONS) left over from another test."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(kernel_module.FORCE_ENV, raising=False)
    monkeypatch.setattr(kernel_module, "DECISIONS", {})
