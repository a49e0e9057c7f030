"""benchmarks/run_all.py writes its own generated report and never a hand-written doc."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


@pytest.fixture(scope="module")
def run_all():
    spec = importlib.util.spec_from_file_location("run_all", os.path.join(ROOT, "benchmarks", "run_all.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def results(run_all, tmp_path) -> str:
    """A run's raw results with no benchmark in them: what --render turns into a report."""
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"argv": [], "preset": "tiny", "date": "2026-12-03 00:00 UTC", "minutes": 0.0,
                                "machine": run_all.machine_description(str(tmp_path))}))
    return str(path)


def test_it_refuses_a_file_it_did_not_write_unless_forced(run_all, results, tmp_path, capsys):
    hand = tmp_path / "notes.md"
    hand.write_text("written by hand\n")
    assert run_all.main(["--render", results, "--out", str(hand)]) == 2
    assert hand.read_text() == "written by hand\n"
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--force" in err and str(hand) in err
    assert run_all.main(["--render", results, "--out", str(hand), "--force"]) == 0
    assert hand.read_text().splitlines()[0] == run_all.GENERATED_MARKER


def test_it_rewrites_its_own_report_and_leaves_no_temporary_file(run_all, results, tmp_path):
    out = tmp_path / "generated.md"
    assert run_all.main(["--render", results, "--out", str(out)]) == 0
    first = out.read_text()
    assert first.splitlines()[0] == run_all.GENERATED_MARKER
    assert run_all.main(["--render", results, "--out", str(out)]) == 0  # its own file: no --force needed
    assert sorted(os.listdir(tmp_path)) == ["generated.md", "results.json"]


@pytest.mark.parametrize("doc", ["docs/benchmarks.md", "README.md", "format_spec/SPEC.md"])
def test_the_repositorys_hand_written_docs_are_never_overwritten(run_all, results, doc):
    path = os.path.join(ROOT, doc)
    before = open(path).read()
    assert run_all.main(["--render", results, "--out", path, "--force"]) == 2
    assert open(path).read() == before
