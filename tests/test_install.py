"""Installing moepack: the extras the docs name exist in pyproject.toml, and pip keeps a CUDA build of the pinned
torch (docs/guide.md, "With a CUDA build of torch").

pip is run offline (`--no-index`, `--dry-run`, `--isolated`: no index, nothing installed, no user configuration)
on pyproject's own dependency list, with a made-up installed torch (a dist-info on PYTHONPATH, ahead of the real
one): a `+cu128` build of the pinned version is found satisfied (nothing to install), another version is not."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def test_the_extras_the_docs_and_errors_name_exist():
    from moepack.packer.gguf_source import GGUF_EXTRA

    extras = _pyproject()["optional-dependencies"]
    assert any(r.startswith("gguf") for r in extras["gguf"]) and any(r.startswith("gguf") for r in extras["test"])
    named = set()
    for doc in ("README.md", "docs/guide.md"):
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            named |= set(re.findall(r"moepack\[(\w+)\]", f.read()))
    named |= set(re.findall(r"moepack\[(\w+)\]", GGUF_EXTRA))
    assert "gguf" in named and named <= set(extras), named - set(extras)


def _pip_resolves(tmp_path, torch_version: str) -> subprocess.CompletedProcess:
    """pip's offline dry run of pyproject's dependencies where torch `torch_version` is installed."""
    fake = tmp_path / "site"
    info = fake / f"torch-{torch_version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {torch_version}\n")
    (info / "RECORD").write_text("")
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(fake)}
    done = subprocess.run([sys.executable, "-m", "pip", "--isolated", "install", "--dry-run", "--no-index",
                           "--quiet", "--report", str(report), *_pyproject()["dependencies"]],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    done.installs = json.loads(report.read_text())["install"] if report.exists() else None
    return done


def test_pip_keeps_an_installed_cuda_build_of_the_pinned_torch(tmp_path):
    pin = next(r for r in _pyproject()["dependencies"] if r.startswith("torch"))
    version = pin.split("==")[1]
    kept = _pip_resolves(tmp_path / "cuda", f"{version}+cu128")
    assert kept.returncode == 0, kept.stderr[-2000:]
    assert kept.installs == []  # every requirement met as installed: the CUDA torch stays
    other = _pip_resolves(tmp_path / "other", "2.0.0+cu118")  # another version: pip would have to replace it
    assert other.returncode != 0 or any(i["metadata"]["name"] == "torch" for i in other.installs or [])
