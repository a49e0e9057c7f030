"""The console commands: output, --json, exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from moepack.cli.main import cli


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def container(workdir):
    runner = CliRunner()
    src = str(workdir / "src")
    r = runner.invoke(cli, ["synth", src, "--preset", "tiny", "--layout", "release", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["ok"] is True
    out = str(workdir / "tiny.moepack")
    r = runner.invoke(cli, ["convert", src, "-o", out, "--keep", "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output)
    assert summary["ok"] and summary["bytes_out"] == os.path.getsize(out)
    return out


def test_inspect_json_and_text(container):
    runner = CliRunner()
    r = runner.invoke(cli, ["inspect", container, "--json"])
    assert r.exit_code == 0
    info = json.loads(r.output)
    assert info["architecture"] == "deepseek_v4" and info["layers"] >= 2
    assert info["file_bytes"] == os.path.getsize(container)
    # header, index and regions make up the file, but for the alignment padding between them
    regions = sum(info["bytes_by_region_kind"].values())
    padding = info["file_bytes"] - info["header_bytes"] - info["index_bytes"] - regions
    assert info["header_bytes"] == 4096 and 0 <= padding < 4096 * (info["regions"] + 1)
    assert "FP4_E2M1" in info["storage_types"] and info["expert_bits_per_weight"] > 4
    r = runner.invoke(cli, ["inspect", container])
    assert r.exit_code == 0 and "deepseek_v4" in r.output and "FP4_E2M1" in r.output


def test_verify_good_and_damaged(container, workdir):
    runner = CliRunner()
    r = runner.invoke(cli, ["verify", container, "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["ok"] is True
    data = bytearray(open(container, "rb").read())
    data[len(data) // 2] ^= 0xFF
    bad = str(workdir / "bad.moepack")
    open(bad, "wb").write(data)
    r = runner.invoke(cli, ["verify", bad, "--json"])
    assert r.exit_code == 1
    first = json.loads(r.output.splitlines()[0])
    assert first["ok"] is False and "damaged" in first["error"]


def test_errors_are_one_line_with_nonzero_exit(workdir):
    """Run the real console entry point: stderr holds exactly one line naming the problem."""
    truncated = str(workdir / "trunc.moepack")
    open(truncated, "wb").write(b"MOEPACK\0" + b"\0" * 100)
    for args, message in (
        (["verify", str(workdir / "missing.moepack")], "no such file"),
        (["inspect", truncated], "truncated|damaged"),
        (["convert", str(workdir / "nowhere"), "-o", str(workdir / "x.moepack"), "--keep"], "no such directory"),
    ):
        p = subprocess.run([sys.executable, "-m", "moepack", *args], capture_output=True, text=True)
        assert p.returncode == 1, p
        lines = [line for line in p.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("moepack: error: "), p.stderr
        assert any(m in lines[0] for m in message.split("|")), lines[0]


def test_demo_runs_end_to_end(workdir):
    r = CliRunner().invoke(cli, ["demo", "--workdir", str(workdir / "demo"), "--preset", "tiny", "--json"])
    assert r.exit_code == 0, r.output
    steps = json.loads(r.output)
    assert steps["verify"]["ok"] and steps["inspect"]["layers"] >= 2
    assert steps["convert"]["bytes_out"] == steps["inspect"]["file_bytes"]


def test_convert_names_the_output_after_the_source_by_default(container, workdir, monkeypatch):
    """`moepack convert deepseek-ai/DeepSeek-V4-Flash --fp4` works without -o: ./DeepSeek-V4-Flash-fp4.moepack."""
    monkeypatch.chdir(workdir)
    r = CliRunner().invoke(cli, ["convert", str(workdir / "src"), "--keep", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["output"] == "src-keep.moepack" and (workdir / "src-keep.moepack").exists()


def test_absurd_numbers_are_refused_before_any_work(container, workdir):
    """Counts no machine has (threads), chunk sizes past 2^31 (torch's split overflowed at 2^63: a traceback), a
    benchmark buffer past the memory: usage errors (exit 2, click's) or one line (exit 1, the JSON error on
    stdout), naming the flag."""
    src = os.path.join(workdir, "src")
    cases = ((["convert", src, "-o", os.path.join(workdir, "w.moepack"), "--keep", "--workers", "100000"], 2,
              "--workers"),
             (["prefill", container, "-p", "hi", "--order", "chunk", "--chunk-tokens", str(1 << 64)], 2,
              "--chunk-tokens"),
             (["prefill", container, "-p", "hi", "--query-chunk", str(10 ** 30)], 2, "--query-chunk"),
             (["bench", "memory", "--size-mib", str(10 ** 20), "--no-save"], 1, "--size-mib"))
    for args, code, flag in cases:
        r = CliRunner().invoke(cli, [*args, "--json"])
        assert r.exit_code == code, (args, r.output)
        error = json.loads(r.stdout)["error"] if code == 1 else r.output.strip().splitlines()[-1]
        assert flag in error and "\n" not in error, error
    assert not any(n.startswith("w.moepack") for n in os.listdir(workdir))
