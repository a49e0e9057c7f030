"""Inputs nobody meant: knobs out of range, files that are not regular files, empty prompts, usage errors under
--json. Each is refused at once with one line naming the problem and a non-zero exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from click.testing import CliRunner

from moepack.cli.main import cli
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.files import check_regular, open_regular
from moepack.runtime.engine import PrefillOptions, StreamingPrefill
from moepack.runtime.io import ReadPipeline, RegionReader
from moepack.runtime.limits import MAX_BUNDLE_EXPERTS, MAX_QUEUE_DEPTH


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile")
    runner = CliRunner()
    assert runner.invoke(cli, ["synth", str(base / "src"), "--preset", "tiny"]).exit_code == 0
    out = str(base / "tiny.moepack")
    assert runner.invoke(cli, ["convert", str(base / "src"), "-o", out, "--keep"]).exit_code == 0
    return out


def _moepack(*args, timeout=60, **kwargs) -> subprocess.CompletedProcess:
    """The installed console entry (usage errors are handled there, not inside the command)."""
    return subprocess.run([sys.executable, "-m", "moepack", *args], capture_output=True, text=True, timeout=timeout,
                          **kwargs)


@pytest.mark.parametrize("flags", [["--queue-depth", str(MAX_QUEUE_DEPTH + 1)], ["--queue-depth", "0"],
                                   ["--bundle-experts", str(MAX_BUNDLE_EXPERTS + 1)],
                                   ["--threads", str(8 * (os.cpu_count() or 1) + 1)]])
def test_prefill_knobs_out_of_range_are_usage_errors(container, flags):
    started = time.monotonic()
    p = _moepack("prefill", container, "--prompt", "hi", *flags, "--json")
    assert p.returncode == 2 and time.monotonic() - started < 30
    out = json.loads(p.stdout)  # --json: the error object on stdout too
    assert out["ok"] is False and out["usage_error"] and flags[0] in out["error"]
    assert "Invalid value for" in p.stderr and f"'{flags[0]}'" in p.stderr  # (with its short form, if it has one)


@pytest.mark.parametrize("args", [["io", "FILE", "--repeat", "100000000"], ["memory", "--repeat", "100000000"],
                                  ["compute", "--repeat", "100000000"], ["compute", "--experts", "100000"]],
                         ids=["io repeat", "memory repeat", "compute repeat", "compute experts"])
def test_bench_counts_that_would_never_end_are_usage_errors(container, args):
    """`bench io --repeat 100000000` ran for ever and `bench compute --experts 100000` made experts until the
    memory ran out: each is bounded (runtime/limits.py), and again for the tools' API callers."""
    from moepack.runtime.limits import MAX_BENCH_REPEAT
    from moepack.tools.bench import bench_compute, bench_memory

    started = time.monotonic()
    p = _moepack("bench", *[container if a == "FILE" else a for a in args], "--no-save")
    assert p.returncode == 2 and time.monotonic() - started < 30, p.stderr
    assert f"Invalid value for '{args[-2]}'" in p.stderr
    with pytest.raises(MoepackError, match="--repeat"):
        bench_memory(1, MAX_BENCH_REPEAT + 1, save=False)
    with pytest.raises(MoepackError, match="--experts"):
        bench_compute("cpu", [1], None, "FP4_E2M1", 256, 256, "float32", MAX_BUNDLE_EXPERTS + 1, 1, save=False)


def test_generate_cache_budget_out_of_range(container):
    p = _moepack("generate", container, "--prompt", "hi", "--cache-gib", "1e12")
    assert p.returncode == 2 and "--cache-gib" in p.stderr


def test_an_unknown_command_under_json_prints_the_error_object():
    p = _moepack("nonsense", "--json")
    assert p.returncode == 2 and json.loads(p.stdout) == {"ok": False, "error": "No such command 'nonsense'.",
                                                          "usage_error": True}


def test_the_runtime_bounds_its_knobs_for_api_callers(container):
    from moepack.format_spec.reader import Container

    with Container(container) as c:
        reader = RegionReader(c.part_paths, "buffered")
        try:
            with pytest.raises(MoepackError, match="queue depth"):
                ReadPipeline(reader, 4096, MAX_QUEUE_DEPTH + 1)
        finally:
            reader.close()
        with pytest.raises(MoepackError, match="--bundle-experts"):
            StreamingPrefill(c, PrefillOptions(bundle_experts=MAX_BUNDLE_EXPERTS + 1))


def _fifo(tmp_path):
    path = str(tmp_path / "fifo")
    os.mkfifo(path)
    return path


def test_a_fifo_is_refused_at_open_not_waited_on(tmp_path):
    path = _fifo(tmp_path)
    done = []
    t = threading.Thread(target=lambda: done.append(pytest.raises(MoepackError, open_regular, path)), daemon=True)
    t.start()
    t.join(5)  # a blocking open would never return: nobody writes to the FIFO
    assert done and "not a regular file (a FIFO or pipe)" in str(done[0].value)
    with pytest.raises(MoepackError, match="a directory"):
        open_regular(str(tmp_path))
    with pytest.raises(MoepackError, match="a character device"):
        check_regular("/dev/null")
    check_regular(str(tmp_path / "missing"))  # the opener names a missing file itself


@pytest.mark.parametrize("name", ["x\u0000y", "x\ud800y"], ids=["a NUL", "a lone surrogate"])
def test_a_name_no_file_can_have_is_refused_at_open(tmp_path, name):
    """(Found by fuzzing convert: a shard name from an index.) os.open raises ValueError for these."""
    with pytest.raises(MoepackError, match=r"cannot open \(not a file name this system can have\)"):
        open_regular(str(tmp_path / name))


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_commands_refuse_a_fifo_and_a_pipe_by_name(tmp_path, container, command):
    fifo = _fifo(tmp_path)
    p = _moepack(command, fifo, timeout=30)
    assert p.returncode == 1 and p.stderr.strip() == f"moepack: error: {fifo}: not a regular file (a FIFO or pipe)"


def test_a_pipe_as_the_container_is_named(container):
    """As <(cat file) hands it over."""
    read_end, write_end = os.pipe()
    try:
        p = _moepack("verify", f"/dev/fd/{read_end}", pass_fds=(read_end,), timeout=30)
    finally:
        os.close(read_end)
        os.close(write_end)
    assert p.returncode == 1 and p.stderr.strip() == \
        f"moepack: error: /dev/fd/{read_end}: not a regular file (a FIFO or pipe)"


@pytest.mark.parametrize("command", ["prefill", "generate"])
def test_empty_prompts_are_refused(tmp_path, container, command):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    runner = CliRunner()
    for args in (["--prompt", ""], ["--prompt-file", str(empty)], ["--token-ids", str(empty)]):
        r = runner.invoke(cli, [command, container, *args, "--json"])
        assert r.exit_code == 1, (args, r.output)
        assert json.loads(r.output.splitlines()[0])["ok"] is False and "empty" in r.output
    fifo = _fifo(tmp_path)
    r = runner.invoke(cli, [command, container, "--prompt-file", fifo])
    assert r.exit_code == 1 and "not a regular file" in r.output


def test_demo_refuses_an_empty_prompt_before_any_work(tmp_path):
    """`demo --prompt ""` as prefill refuses it, before it synthesizes or converts anything (it had prefilled the
    BOS alone)."""
    r = CliRunner().invoke(cli, ["demo", "--workdir", str(tmp_path / "w"), "--preset", "tiny", "--prompt", "",
                                 "--json"])
    assert r.exit_code == 1 and json.loads(r.output.splitlines()[0]) == {"ok": False, "error": "empty prompt"}
    assert not (tmp_path / "w").exists()


def _stderr_on_a_terminal(args: list[str], env: dict) -> bytes:
    """What the command writes to stderr when that is a terminal (a pseudo-terminal here)."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new one is 0 columns wide
    p = subprocess.Popen([sys.executable, "-m", "moepack", *args], stdout=subprocess.DEVNULL, stderr=slave, env=env)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # the terminal closed with the process
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert p.wait(timeout=120) == 0
    return out


def test_progress_bars_on_a_terminal_only_and_tqdm_disable_honoured(tmp_path):
    args = ["synth", str(tmp_path / "s"), "--preset", "tiny", "--force"]
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    assert b"B/s" in _stderr_on_a_terminal(args, env)  # bytes per second on a terminal
    assert b"B/s" not in _stderr_on_a_terminal(args, {**env, "TQDM_DISABLE": "1"})
    piped = subprocess.run([sys.executable, "-m", "moepack", *args], capture_output=True, timeout=120, env=env)
    assert piped.returncode == 0 and b"\r" not in piped.stderr  # a log gets no carriage-return frames


@pytest.mark.parametrize("command", ["prefill", "generate"])
def test_prefill_and_generate_show_their_layers_on_a_terminal(container, command):
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    args = [command, container, "--prompt", "hello there"] + (["--max-new-tokens", "2"] if command == "generate" else [])
    shown = _stderr_on_a_terminal(args, env)
    assert b"prefill layer 4/4" in shown and b"B/s" in shown, shown  # the tiny model's 4 layers, bytes per second
    piped = subprocess.run([sys.executable, "-m", "moepack", *args], capture_output=True, timeout=120, env=env)
    assert piped.returncode == 0 and b"prefill layer" not in piped.stderr


def test_convert_takes_the_policy_by_name_as_by_its_flag(tmp_path, container):
    src = os.path.join(os.path.dirname(container), "src")
    runner = CliRunner()
    by_name, by_flag = str(tmp_path / "name.moepack"), str(tmp_path / "flag.moepack")
    assert runner.invoke(cli, ["convert", src, "-o", by_name, "--policy", "q8"]).exit_code == 0
    assert runner.invoke(cli, ["convert", src, "-o", by_flag, "--q8"]).exit_code == 0
    from moepack.format_spec.reader import Container

    with Container(by_name) as a, Container(by_flag) as b:
        assert a.policy["name"] == b.policy["name"] == "q8"
        assert {n: t.dtype for n, t in a.tensors.items()} == {n: t.dtype for n, t in b.tensors.items()}
    r = runner.invoke(cli, ["convert", src, "-o", str(tmp_path / "x.moepack"), "--policy", "q9"])
    assert r.exit_code == 2 and "q9" in r.output


def test_one_spelling_of_dtypes_with_storage_names_as_synonyms(container, tmp_path):
    import click

    from moepack.cli.common import Dtype

    kv = Dtype(("float32", "bfloat16", "float8_e4m3"), give="storage")
    assert [kv.convert(v, None, None) for v in ("bfloat16", "BF16", "bf16", "Float8_E4M3")] == \
        ["BF16", "BF16", "BF16", "F8_E4M3"]
    assert Dtype(("bfloat16", "float32"), give="short").convert("F32", None, None) == "f32"
    assert Dtype(("float32", "bfloat16"), extra=("auto",)).convert("BF16", None, None) == "bfloat16"
    with pytest.raises(click.BadParameter, match="not one of"):
        kv.convert("float64", None, None)
    ids = tmp_path / "ids.json"
    ids.write_text("[5, 6, 7]")
    runner = CliRunner()
    for spelling in ("bfloat16", "BF16"):  # the same KV either way
        out = tmp_path / spelling
        r = runner.invoke(cli, ["prefill", container, "--token-ids", str(ids), "--kv-out", str(out),
                                "--kv-dtype", spelling, "--compute-dtype", "F32", "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["compute_dtype"] == "float32"
    assert [json.loads((tmp_path / s / "manifest.json").read_text())["dtype"] for s in ("bfloat16", "BF16")] == \
        ["BF16", "BF16"]
    r = runner.invoke(cli, ["export", container, "-o", str(tmp_path / "hf"), "--dtype", "F32", "--json"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(cli, ["prefill", container, "--token-ids", str(ids), "--kv-dtype", "int4"])
    assert r.exit_code == 2 and "int4" in r.output


# --- config values through a prefill (issue #26: "nothing but a one-line error or a finite result") -----------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from containers import mutate_index  # noqa: E402
from test_v4_config import FIELDS, json_values  # noqa: E402

# Near-valid values reach the runtime (shapes, ropes, routing) instead of stopping at the type check.
near_valid = (st.integers(-2, 300) | st.floats(-10.0, 1e40, allow_nan=False) | st.sampled_from([0, 1, 2, 1e-30, 1e30])
              | json_values)


@settings(max_examples=int(os.environ.get("MOEPACK_FUZZ_EXAMPLES", "60")), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from(FIELDS), value=near_valid, prompt_len=st.integers(1, 40))
def test_any_config_value_through_a_prefill_is_a_one_line_error_or_finite_logits(container, tmp_path_factory, field,
                                                                                 value, prompt_len):
    from moepack.runtime.engine import prefill

    path = str(tmp_path_factory.mktemp("cfg") / "c.moepack")
    mutate_index(container, path, lambda index: index["config"].__setitem__(field, value))
    try:
        result = prefill(path, [(7 * i + 3) % 200 for i in range(prompt_len)], PrefillOptions(compute_dtype="float32"))
    except MoepackError as e:
        assert str(e) and "\n" not in str(e), (field, value, str(e))
    else:
        assert bool(result.logits.isfinite().all()), (field, value)


# The issue's examples: valid checksums, wrong values. verify fails naming the field; prefill, generate and serve
# refuse before reading any weight (the index is all they have read).
ISSUE_VALUES = [("scoring_func", "foo"), ("rms_norm_eps", "x"), ("index_topk", -1), ("routed_scaling_factor", None),
                ("sliding_window", 0), ("rope_theta", 0), ("swiglu_limit", -1), ("hc_sinkhorn_iters", -1)]


@pytest.mark.parametrize("field, value", ISSUE_VALUES, ids=[f for f, _ in ISSUE_VALUES])
def test_every_command_refuses_a_bad_config_value_naming_the_field(container, tmp_path, field, value):
    path = str(tmp_path / "bad.moepack")
    mutate_index(container, path, lambda index: index["config"].__setitem__(field, value))
    runner = CliRunner()
    for args in (["verify", path], ["prefill", path, "--prompt", "hello"],
                 ["generate", path, "--prompt", "hello", "--max-new-tokens", "2"],
                 ["serve", path, "--port", "0"]):
        result = runner.invoke(cli, [*args, "--json"])
        assert result.exit_code == 1, (args, result.output)
        error = json.loads(result.stdout)["error"]
        assert field in error and "\n" not in error, (args, error)


def _sha(path: str) -> str:
    import hashlib

    if os.path.isdir(path):
        return "|".join(f"{n}:{_sha(os.path.join(path, n))}" for n in sorted(os.listdir(path)))
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_one_overwrite_rule_for_every_command_that_writes(tmp_path, container):
    """An existing output is refused before any work (one line, exit 1, the old output untouched) unless --force,
    which replaces it with a complete new one."""
    src = os.path.join(os.path.dirname(container), "src")
    runner = CliRunner()
    out = tmp_path / "out"
    out.mkdir()
    targets = {
        "synth": (out / "synth", ["synth", str(out / "synth"), "--preset", "tiny", "--seed", "3"]),
        "convert": (out / "c.moepack", ["convert", src, "-o", str(out / "c.moepack"), "--q8"]),
        "export hf": (out / "hf", ["export", container, "-o", str(out / "hf")]),
        "export gguf": (out / "m.gguf", ["export", container, "--format", "gguf", "-o", str(out / "m.gguf")]),
        "prefill --kv-out": (out / "kv", ["prefill", container, "--prompt", "hi", "--kv-out", str(out / "kv")]),
        "prefill --logits-out": (out / "l.safetensors", ["prefill", container, "--prompt", "hi", "--logits-out",
                                                         str(out / "l.safetensors")]),
        "generate --kv-out": (out / "gkv", ["generate", container, "--prompt", "hi", "--max-new-tokens", "2",
                                            "--kv-out", str(out / "gkv")]),
        "plan --plot": (out / "p.png", ["plan", container, "--plot", str(out / "p.png")]),
    }
    for what, (path, args) in targets.items():
        if what == "export gguf" and not _has_gguf():
            continue
        path = str(path)
        if what.endswith("--kv-out") or what in ("synth", "export hf"):
            os.makedirs(path)
            with open(os.path.join(path, "keep.txt"), "w") as f:
                f.write("mine")
        else:
            with open(path, "w") as f:
                f.write("mine")
        before = _sha(path)
        refused = runner.invoke(cli, [*args, "--json"])
        assert refused.exit_code == 1, (what, refused.output)
        error = json.loads(refused.stdout)["error"]
        assert error == f"{path} exists: pass --force to replace it", (what, error)
        assert _sha(path) == before, what  # untouched
        replaced = runner.invoke(cli, [*args, "--json", "--force"])
        assert replaced.exit_code == 0, (what, replaced.output)
        assert _sha(path) != before, what
        if os.path.isfile(path):  # every file output a plain file's mode (safetensors had made the logits 0600)
            from moepack.format_spec.files import plain_file_mode

            assert os.stat(path).st_mode & 0o777 == plain_file_mode(), (what, oct(os.stat(path).st_mode))
    # continuing a KV in place is no overwrite: --kv-out is --continue-from
    kv = str(out / "kv")
    again = runner.invoke(cli, ["prefill", container, "--prompt", " more", "--continue-from", kv, "--kv-out", kv])
    assert again.exit_code == 0, again.output


def test_no_output_may_replace_the_commands_own_input_even_with_force(tmp_path, container):
    """An output that is the command's input (the container, a prompt file, a GGUF converted), a directory holding
    it, or a file of the checkpoint directory converted is refused before any work with --force too: one line, the
    input untouched (a --force once wrote a prefill's logits over its container)."""
    import shutil

    src = os.path.join(os.path.dirname(container), "src")
    held = tmp_path / "held"
    held.mkdir()
    inside = str(held / "m.moepack")
    shutil.copy(container, inside)
    prompt = tmp_path / "p.txt"
    prompt.write_text("hi")
    cases = [
        (container, ["prefill", container, "-p", "hi", "--logits-out", container]),
        (str(prompt), ["prefill", container, "--prompt-file", str(prompt), "--logits-out", str(prompt)]),
        (container, ["plan", container, "--plot", container]),
        (inside, ["export", inside, "-o", str(held)]),
        (os.path.join(src, "config.json"), ["convert", src, "-o", os.path.join(src, "config.json"), "--keep"]),
    ]
    if _has_gguf():
        cases.append((container, ["export", container, "--format", "gguf", "-o", container]))
    runner = CliRunner()
    for kept, args in cases:
        before = _sha(kept)
        refused = runner.invoke(cli, [*args, "--force", "--json"])
        assert refused.exit_code == 1, (args, refused.output)
        assert "writing there would destroy it" in json.loads(refused.stdout)["error"], args
        assert _sha(kept) == before, args
    # a new file beside the source's own is no input
    beside = os.path.join(src, "new.moepack")
    assert runner.invoke(cli, ["convert", src, "-o", beside, "--keep", "--force"]).exit_code == 0
    os.remove(beside)


def test_an_output_directory_that_keeps_what_it_does_not_write_may_hold_an_input(tmp_path, container):
    """synth and --kv-out keep the files of their directory that are not theirs (synth replaces its checkpoint's
    files, a KV directory carries the others over), so an input there is safe unless it is one of their names; a
    file read in a KV directory continued from is refused, another name there is not."""
    import shutil

    runner = CliRunner()
    held = tmp_path / "held"
    held.mkdir()
    inside = str(held / "m.moepack")
    shutil.copy(container, inside)
    before = _sha(inside)
    r = runner.invoke(cli, ["prefill", inside, "-p", "hi", "--kv-out", str(held), "--force", "--json"])
    assert r.exit_code == 0, r.output
    assert _sha(inside) == before and os.path.exists(held / "manifest.json")
    logits = str(held / "mine.safetensors")
    r = runner.invoke(cli, ["prefill", inside, "-p", " there", "--continue-from", str(held), "--logits-out", logits,
                            "--json"])
    assert r.exit_code == 0 and os.path.exists(logits), r.output
    r = runner.invoke(cli, ["prefill", inside, "-p", " there", "--continue-from", str(held), "--logits-out",
                            str(held / "logits.safetensors"), "--force", "--json"])
    assert r.exit_code == 1 and "is a file of the input" in json.loads(r.stdout)["error"], r.output
    r = runner.invoke(cli, ["prefill", inside, "-p", "hi", "--kv-out", "", "--continue-from", "", "--json"])
    assert r.exit_code == 1 and json.loads(r.stdout)["error"] == "an output path is empty", r.output

    src = tmp_path / "src"
    (src / "toks").mkdir(parents=True)
    shutil.copy(os.path.join(os.path.dirname(container), "src", "tokenizer.json"), src / "toks" / "tokenizer.json")
    r = runner.invoke(cli, ["synth", str(src), "--tokenizer", str(src / "toks"), "--force", "--json"])
    assert r.exit_code == 0 and os.path.exists(src / "toks" / "tokenizer.json"), r.output
    shutil.copy(src / "toks" / "tokenizer.json", src / "tokenizer.json")
    r = runner.invoke(cli, ["synth", str(src), "--tokenizer", str(src / "tokenizer.json"), "--force", "--json"])
    assert r.exit_code == 1 and "writing there would destroy it" in json.loads(r.stdout)["error"], r.output


def test_an_empty_output_path_is_refused_not_taken_for_the_current_directory(tmp_path, container):
    """`synth ""` wrote a checkpoint into the current directory (an empty name is a script's unset variable)."""
    runner = CliRunner()
    for args in (["synth", ""], ["export", container, "-o", ""], ["prefill", container, "-p", "hi", "--kv-out", ""],
                 ["prefill", container, "-p", "hi", "--logits-out", ""]):
        with runner.isolated_filesystem(temp_dir=tmp_path):
            r = runner.invoke(cli, [*args, "--json"])
            assert r.exit_code == 1 and json.loads(r.stdout)["error"] == "an output path is empty", (args, r.output)
            assert os.listdir(".") == [], args


def _has_gguf() -> bool:
    try:
        import gguf  # noqa: F401
    except ImportError:
        return False
    return True


def test_input_files_read_as_the_server_reads_requests(tmp_path, container):
    """A leading byte-order mark (an editor's) is no text of a prompt file, nor a JSON error of a --messages or
    --prompts-file; a key given twice in one of their objects is refused, as the server refuses it (which one
    counts is the parser's choice)."""
    runner = CliRunner()

    def generate(*args):
        r = runner.invoke(cli, ["generate", container, "-n", "2", "--json", *args])
        return r.exit_code, json.loads(r.stdout)

    (tmp_path / "plain.txt").write_text("Hello there")
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfHello there")
    plain, bom = generate("--prompt-file", str(tmp_path / "plain.txt")), generate("--prompt-file",
                                                                                  str(tmp_path / "bom.txt"))
    assert plain[0] == bom[0] == 0 and plain[1]["stats"]["prefill"]["tokens"] == bom[1]["stats"]["prefill"]["tokens"]
    assert plain[1]["generated_ids"] == bom[1]["generated_ids"]
    (tmp_path / "m.json").write_bytes(b'\xef\xbb\xbf[{"role": "user", "content": "Hi"}]')
    assert generate("--messages", str(tmp_path / "m.json"))[0] == 0
    (tmp_path / "dup.json").write_text('[{"role": "user", "content": "abc", "content": "Hi"}]')
    (tmp_path / "dup.jsonl").write_text('{"prompt": "abc", "prompt": "Hello world"}\n')
    for flag, path in (("--messages", "dup.json"), ("--prompts-file", "dup.jsonl")):
        code, out = generate(flag, str(tmp_path / path))
        assert code == 1 and "given twice" in out["error"] and "\n" not in out["error"], out


def test_force_never_renames_a_file_over_a_device_or_a_fifo(tmp_path, container):
    """Outputs are renamed over their path: `--logits-out /dev/null --force` run as root had replaced the device node
    by a file (here a FIFO stands for it). Refused before any work, the FIFO left as it was; the CLI's rule and the
    gguf exporter's own check of its split names alike."""
    import stat

    from moepack.packer.gguf_export import export_gguf

    src = os.path.join(os.path.dirname(container), "src")
    fifo = str(tmp_path / "out")
    os.mkfifo(fifo)
    for args in (["prefill", container, "-p", "hi", "--logits-out", fifo], ["convert", src, "-o", fifo, "--q8"],
                 ["export", container, "--format", "gguf", "-o", fifo]):
        r = CliRunner().invoke(cli, [*args, "--force"])
        assert r.exit_code == 1 and f"{fifo} is a FIFO or pipe: an output is renamed over its path" in r.output, \
            r.output
    split = str(tmp_path / "m-00001-of-00001.gguf")
    os.mkfifo(split)
    pytest.importorskip("gguf")
    with pytest.raises(MoepackError, match="m-00001-of-00001.gguf is a FIFO or pipe"):
        export_gguf(container, str(tmp_path / "m.gguf"), progress=False, split_max_size=1 << 40, force=True)
    from moepack.format_spec.writer import ContainerWriter
    from moepack.runtime.outputs import check_output_path

    for api_call in (ContainerWriter, check_output_path):  # the API's callers, whom no CLI checked for
        with pytest.raises(MoepackError, match="is a FIFO or pipe"):
            api_call(fifo)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and stat.S_ISFIFO(os.stat(split).st_mode)
    link = str(tmp_path / "stdout")  # (/dev/stdout: a link to the process's pipe or terminal, the link itself in /dev)
    os.symlink(fifo, link)
    r = CliRunner().invoke(cli, ["prefill", container, "-p", "hi", "--logits-out", link, "--force"])
    assert r.exit_code == 1 and f"{link} is a link to a FIFO or pipe" in r.output, r.output
    with pytest.raises(MoepackError, match="is a link to a FIFO or pipe"):
        ContainerWriter(link)
    assert os.path.islink(link)
