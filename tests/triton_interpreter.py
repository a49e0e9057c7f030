"""What the Triton kernel tests share: Triton imported for its interpreter (kernels on CPU tensors), and a kernel's
ahead-of-time compile for sm_90 (H100 / H200) in a process of its own, both without a GPU."""

from __future__ import annotations

import json
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


def compiled_for_hopper(kernel: str) -> list[dict]:
    """benchmarks/triton_aot.py's rows for `kernel` at the release's cases (--quick): the runtime's kernel compiled
    by triton.compile for sm_90 (H100 / H200) at each of its autotune configs, as a launch specialises it, in a
    process of its own (this one's Triton is the interpreter's, whose library Triton's compiler refuses). Skips
    where this Triton cannot compile ahead of time (the script's exit status 2); fails with the rows that failed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "triton_aot.py")
    done = subprocess.run([sys.executable, script, "--arch", "90", "--kernel", kernel, "--quick", "--json"], env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode == 2:
        pytest.skip(f"no ahead-of-time compile here: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["rows"]


def interpreting(monkeypatch, kernel_module) -> None:
    """Kernels run by Triton's interpreter on CPU tensors, with no decision or forcing of `kernel_module`'s (its
    FORCE_ENV, its DECISIONS) left over from another test."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(kernel_module.FORCE_ENV, raising=False)
    monkeypatch.setattr(kernel_module, "DECISIONS", {})
