"""The long-running fuzz harness (fuzz/fuzz_container.py, docs/fuzzing.md) kept from rotting: a few seconds of it on
each target finds no failure and gets through a fair number of inputs, and it does tell a failure from moepack's
own errors."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
HARNESS = ROOT / "fuzz" / "fuzz_container.py"


@pytest.mark.parametrize("targets, seconds, least", [
    (("container", "kv"), 5, 100),  # what moepack reads of its own
    (("checkpoint", "gguf"), 6, 40),  # what convert reads from outside: each input a whole conversion
], ids=["own files", "convert's sources"])
def test_a_short_run_on_each_target_finds_nothing(tmp_path, targets, seconds, least):
    run = subprocess.run(
        [sys.executable, str(HARNESS), "--seconds", str(seconds), "--target", ",".join(targets), "--quick-seeds",
         "--seed", "7", "--corpus", str(tmp_path / "corpus"), "--crashes", str(tmp_path / "crashes"), "--json",
         "--quiet"],
        capture_output=True, text=True, timeout=180)
    report = json.loads(run.stdout)
    assert report["distinct_failures"] == 0, report["failures"]
    assert run.returncode == 0, run.stderr[-2000:]
    assert sorted(report["targets"]) == sorted(targets)
    for target in targets:
        stats = report["targets"][target]
        assert stats["inputs"] > least, stats
        assert stats["error"] > 0 and stats["ok"] > 0, stats  # both the rejections and the deep paths are reached
    assert not list((tmp_path / "crashes").iterdir())


@pytest.fixture
def targets(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "fuzz"))
    import targets

    return targets


def test_an_exception_other_than_moepacks_is_a_failure_named_by_its_frame(targets, tmp_path, monkeypatch):
    from containers import build_container

    from moepack.format_spec import reader

    path = str(tmp_path / "c.moepack")
    build_container(path, n_layers=1, n_experts=2)
    assert targets.run_one("container", path)["status"] == "ok"

    def broken(self, entries):
        raise KeyError("boom")

    monkeypatch.setattr(reader.Container, "_validate_tensors", broken)
    outcome = targets.run_one("container", path)
    assert outcome["status"] == "failure" and outcome["stage"] == "open"
    assert outcome["frame"].startswith("format_spec/reader.py:") and outcome["frame"].endswith(" _validate_index")
    assert outcome["key"] == f"KeyError @ {outcome['frame']}"


def test_a_hang_is_caught_and_named_by_its_frame(targets, tmp_path, monkeypatch):
    """An open that never returns stands in for a hang (the reader refuses FIFOs, so the worker's interpreter is
    given a sitecustomize that blocks opening one file name): the worker's faulthandler dumps the stack at the
    timeout and the harness reports where it hung, then carries on with a new worker."""
    import os

    from fuzz_container import Worker

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import threading\n"
        "import moepack.format_spec.reader as reader\n"
        "opened = reader._open_file\n"
        "def _open_file(path, missing):\n"
        "    if path.endswith('blocks.moepack'):\n"
        "        threading.Event().wait()  # never set: a read that never comes back\n"
        "    return opened(path, missing)\n"
        "reader._open_file = _open_file\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    blocks = tmp_path / "blocks.moepack"
    blocks.write_bytes(b"\0" * 4096)
    worker = Worker(str(tmp_path), timeout=1, memory_mb=1024)
    try:
        outcome = worker.run("container", str(blocks))
        assert outcome["status"] == "failure" and outcome["kind"] == "hang"
        assert outcome["frame"].startswith("format_spec/reader.py:")
        assert worker.run("container", str(tmp_path / "missing.moepack"))["status"] == "error"
    finally:
        worker.stop()


def test_a_failed_conversion_that_leaves_its_output_is_a_failure(targets, tmp_path, monkeypatch):
    """A conversion may fail (moepack's error) but must not leave a file under the output's name: the harness says
    so even when the error itself is moepack's own. (Its resumable OUT.partial is not such a file.)"""
    from moepack.format_spec.errors import MoepackError

    def convert_leaving(src, out, **kwargs):
        open(out + ".partial", "wb").close()
        if "leave" in os.listdir(src):
            open(out, "wb").close()
        raise MoepackError("refused")

    monkeypatch.setattr(targets, "convert_checkpoint", convert_leaving)
    src = tmp_path / "source"  # the output goes to tmp_path / "output"
    src.mkdir()
    assert targets.run_one("checkpoint", str(src))["status"] == "error"  # (plan refuses an empty folder)
    assert targets.run_one("gguf", str(src)) == {"status": "error", "stage": "convert", "message": "refused"}
    shutil.rmtree(tmp_path / "output")
    (src / "leave").write_bytes(b"")
    outcome = targets.run_one("gguf", str(src))
    assert outcome["status"] == "failure" and outcome["kind"] == "HalfWrittenOutput", outcome
