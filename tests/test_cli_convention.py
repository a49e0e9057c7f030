"""One CLI convention: the shared model-run options on every command that runs the model, one sampling default,
llama.cpp's short forms, conflicting precision flags refused, the `moepack convert` command named for a GGUF file or
a checkpoint directory, `plan` on a hub id (from a fake Hugging Face cache: no network), `demo` outside the
current directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from moepack.cli.common import DEFAULT_TEMPERATURE, RUN_OPTION_NAMES
from moepack.cli.main import cli

from containers import tiny_keep_container

MODEL_COMMANDS = ("prefill", "generate", "chat", "serve")
CONTAINER_COMMANDS = ("prefill", "generate", "chat", "serve", "verify", "inspect", "export")
FLASH_CONFIG = os.path.join(os.path.dirname(__file__), "data", "deepseek-v4-flash.config.json")


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    return tiny_keep_container(tmp_path_factory)


def _params(command: str) -> dict:
    return {p.name: p for p in cli.commands[command].params}


def _run(*args: str, **kwargs):
    return CliRunner().invoke(cli, list(args), **kwargs)


def test_the_shared_options_are_the_same_on_every_command_that_runs_the_model():
    first = _params("prefill")
    for command in MODEL_COMMANDS:
        params = _params(command)
        for name in RUN_OPTION_NAMES:
            assert name in params, f"{command} lacks {name}"
            mine, theirs = params[name], first[name]
            assert (mine.opts, mine.default, mine.is_flag, type(mine.type)) == \
                   (theirs.opts, theirs.default, theirs.is_flag, type(theirs.type)), (command, name)
            choices = getattr(mine.type, "choices", None)
            assert choices == getattr(theirs.type, "choices", None), (command, name)
    assert _params("generate")["threads"].opts == ["-t", "--threads"]


def test_every_option_of_every_command_says_what_it_does():
    """--help is where a newcomer learns a flag: a flag listed with only its default says nothing of what it does."""
    import click

    def options(command, path):
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                yield from options(sub, path + (name,))
        else:
            yield from ((" ".join(path), p) for p in command.params if isinstance(p, click.Option) and not p.hidden)

    silent = [f"{path} {option.opts[-1]}" for path, option in options(cli, ()) if not (option.help or "").strip()]
    assert not silent, f"options without help text: {silent}"


def test_a_reader_that_stops_reading_ends_the_command_quietly(container):
    """`moepack inspect X | head -1`: the pipe's reader gone had been an error line, 'moepack: error: Broken pipe';
    now no line, status 1 as click's own --help gives there."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has gone before the command writes
    try:
        r = subprocess.run([sys.executable, "-m", "moepack", "inspect", container], stdout=write_end,
                           stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(write_end)
    assert (r.returncode, r.stderr) == (1, b"")


def test_an_option_a_command_has_no_use_for_is_refused_naming_why():
    for args, flag, why in ((["prefill", "x.moepack", "-p", "a", "--cache-gib", "1"], "--cache-gib", "no expert cache"),
                            (["chat", "x.moepack", "--kv-dtype", "bf16"], "--kv-dtype", "writes none"),
                            (["serve", "x.moepack", "--kv-dtype", "f8_e4m3"], "--kv-dtype", "writes none")):
        r = _run(*args)
        assert r.exit_code == 2 and flag in r.output and why in r.output, r.output
    assert "Not on this command" in _params("chat")["kv_dtype"].help
    assert "Not on this command" not in _params("generate")["kv_dtype"].help


def test_threads_and_the_kv_dtype_act_on_generate(container, tmp_path, monkeypatch):
    import torch

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    kv = str(tmp_path / "kv")
    r = _run("generate", container, "-p", "hello", "-n", "2", "-t", "1", "--kv-out", kv, "--kv-dtype", "bf16", "--json")
    assert r.exit_code == 0, r.output
    assert calls[0] == 1  # before the run (which may set it again for a stage of its own)
    r = _run("kv", "inspect", kv, "--json")
    assert r.exit_code == 0 and json.loads(r.output)["dtype"] == "BF16", r.output


def test_sampling_defaults_are_the_same_in_generate_and_chat_and_documented():
    generate, chat = _params("generate"), _params("chat")
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop"):
        assert generate[name].default == chat[name].default, name
    assert generate["temperature"].default == DEFAULT_TEMPERATURE == 0
    guide = open(os.path.join(os.path.dirname(__file__), "..", "docs", "guide.md"), encoding="utf-8").read()
    assert "Sampling defaults" in guide and "1.0" in guide


def test_min_p_and_repetition_penalty_reach_the_generation(container):
    """--min-p 1 keeps only the likeliest token (greedy's answer at any temperature); --repetition-penalty changes
    a greedy answer; a value out of range is a usage error naming the flag."""
    def ids(*flags):
        r = _run("generate", container, "-p", "hello hello hello", "-n", "12", "--json", *flags)
        assert r.exit_code == 0, r.output
        return json.loads(r.output)["generated_ids"]
    greedy = ids()
    assert ids("--temperature", "2", "--min-p", "1", "--seed", "3") == greedy
    assert ids("--repetition-penalty", "0.05") != greedy  # (below 1: the tokens held made likelier)
    for flag, value in (("--min-p", "1.5"), ("--repetition-penalty", "0"), ("--repetition-penalty", "nan")):
        r = _run("generate", container, "-p", "hi", flag, value)
        assert r.exit_code == 2 and flag in r.output, (flag, value, r.output)


def test_llama_cpp_short_forms(container):
    assert _params("generate")["prompt"].opts == ["-p", "--prompt"]
    for command in ("generate", "chat"):
        assert _params(command)["max_new_tokens"].opts == ["-n", "--max-new-tokens"]
    for command in ("generate", "chat", "serve"):
        assert _params(command)["max_context"].opts[:2] == ["-c", "--max-context"]
    assert "--max-model-len" in _params("serve")["max_context"].opts  # vLLM's name for it
    r = _run("generate", container, "-p", "hello", "-n", "50", "--json")
    prompt_tokens = json.loads(r.output)["stats"]["prefill"]["tokens"]
    # -c caps prompt + new tokens: the generation stops where it reaches the cap
    r = _run("generate", container, "-p", "hello", "-n", "50", "-c", str(prompt_tokens + 3), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert len(out["generated_ids"]) == 3 and out["finish_reason"] in ("length", "stop")
    # a prompt that fills the cap: one line
    r = _run("generate", container, "-p", "hello", "-c", str(prompt_tokens), "--json")
    assert r.exit_code == 1 and "context cap" in json.loads(r.output.splitlines()[0])["error"]


def test_the_context_cap_counts_the_tokens_of_a_kv_continued(container, tmp_path):
    kv = str(tmp_path / "kv")
    r = _run("prefill", container, "-p", "hello there", "--kv-out", kv, "--json")
    assert r.exit_code == 0, r.output
    past = json.loads(r.output)["tokens"]
    r = _run("generate", container, "--continue-from", kv, "-n", "50", "-c", str(past + 2), "--json")
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.output)["generated_ids"]) == 2


def test_a_prefill_past_the_model_context_is_refused_unless_c_raises_the_cap(tmp_path):
    """A prompt (with the KV it continues) longer than max_position_embeddings was prefilled without a word,
    where generate refuses it; prefill now applies the same cap, and -c moves it."""
    from moepack.packer.convert import convert_checkpoint
    from moepack.packer.synth import synth_checkpoint

    src, container = str(tmp_path / "src"), str(tmp_path / "short.moepack")
    synth_checkpoint(src, preset="tiny", layout="release", progress=False)
    config = json.load(open(os.path.join(src, "config.json")))
    json.dump({**config, "max_position_embeddings": 12}, open(os.path.join(src, "config.json"), "w"))
    convert_checkpoint(src, container, policy="keep", progress=False)
    ids = tmp_path / "ids.json"
    for n, cap, code in ((12, None, 0), (13, None, 1), (13, 13, 0), (12, 11, 1)):
        ids.write_text(json.dumps(list(range(3, 3 + n))))
        r = _run("prefill", container, "--token-ids", str(ids), "--json", *(("-c", str(cap)) if cap else ()))
        assert r.exit_code == code, r.output
        if code:
            error = json.loads(r.output.splitlines()[0])["error"]
            assert error == (f"the prompt's {n} tokens exceed the context cap of {cap or 12} "
                             + ("(-c/--max-context)" if cap else
                                "(the model context, max_position_embeddings; -c raises it)")), error
    kv = str(tmp_path / "kv")
    ids.write_text(json.dumps(list(range(3, 11))))
    assert _run("prefill", container, "--token-ids", str(ids), "--kv-out", kv).exit_code == 0
    r = _run("prefill", container, "--token-ids", str(ids), "--continue-from", kv, "--json")  # 8 + 8 tokens
    assert r.exit_code == 1 and "the prompt's 16 tokens exceed the context cap of 12" in r.output, r.output


def test_conflicting_precision_flags_are_a_usage_error_naming_both(tmp_path):
    for args, named in ((["--fp4", "--q8"], ("--fp4", "--q8")), (["--q8", "--fp4"], ("--fp4", "--q8")),
                        (["--fp4", "--policy", "q2"], ("--fp4", "--policy q2"))):
        r = _run("convert", str(tmp_path / "nowhere"), *args)
        assert r.exit_code == 2 and "conflict" in r.output and all(n in r.output for n in named), r.output
    # the same policy twice is no conflict: the run gets as far as the missing source
    r = _run("convert", str(tmp_path / "nowhere"), "--fp4", "--policy", "fp4")
    assert r.exit_code == 1 and "no such directory" in r.output


@pytest.mark.parametrize("command", CONTAINER_COMMANDS)
def test_a_gguf_file_or_a_checkpoint_directory_gets_the_convert_command(command, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    shutil.copyfile(FLASH_CONFIG, checkpoint / "config.json")
    extra = {"prefill": ["-p", "hi"], "generate": ["-p", "hi"], "export": ["-o", str(tmp_path / "out")]}
    for path, kind in ((gguf, "GGUF file"), (checkpoint, "checkpoint directory")):
        r = _run(command, str(path), *extra.get(command, []), "--json")
        assert r.exit_code == 1, r.output
        error = json.loads(r.output.splitlines()[0])["error"]
        assert kind in error and f"`moepack convert {path} --fp4`" in error


def test_the_convert_hint_is_one_line_from_the_console(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    p = subprocess.run([sys.executable, "-m", "moepack", "generate", str(gguf), "-p", "hi"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "moepack convert" in p.stderr, p.stderr


def _fake_hub_cache(home, repo: str, sha: str = "c" * 40) -> None:
    """HF_HOME/hub holding `repo`'s config.json (the release's) at `sha`, as huggingface_hub lays it out."""
    storage = home / "hub" / ("models--" + repo.replace("/", "--"))
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(sha)
    snapshot = storage / "snapshots" / sha
    snapshot.mkdir(parents=True)
    shutil.copyfile(FLASH_CONFIG, snapshot / "config.json")


def _plan(target: str, home, **env):
    environment = {**os.environ, "HF_HOME": str(home), "HF_ENDPOINT": "http://127.0.0.1:9", **env}
    environment.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-m", "moepack", "plan", target, "--json"], capture_output=True, text=True,
                          env=environment, timeout=120)


def test_plan_takes_a_hub_id_from_the_cache_offline(tmp_path):
    home = tmp_path / "hf"
    _fake_hub_cache(home, "acme/flash")
    by_file = subprocess.run([sys.executable, "-m", "moepack", "plan", FLASH_CONFIG, "--json"], capture_output=True,
                             text=True, timeout=120)
    assert by_file.returncode == 0, by_file.stderr
    for env in ({"HF_HUB_OFFLINE": "1"}, {}):  # offline, and online with the hub out of reach (port 9: nothing)
        p = _plan("acme/flash", home, **env)
        assert p.returncode == 0, p.stderr
        got, want = json.loads(p.stdout), json.loads(by_file.stdout)
        assert got["model"]["path"] == "acme/flash" and want["model"]["path"] == FLASH_CONFIG
        assert {**got["model"], "path": None} == {**want["model"], "path": None} and got["W_bytes"] == want["W_bytes"]
    p = _plan("acme/absent", home, HF_HUB_OFFLINE="1")
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "HF_HUB_OFFLINE" in p.stderr, p.stderr
    started = time.monotonic()  # online, the hub out of reach, nothing cached: one line, in seconds (it had taken
    p = _plan("acme/absent", home)  # 76 s of huggingface_hub's retries, each a warning on stderr)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "network unavailable" in p.stderr, p.stderr
    assert time.monotonic() - started < 30


def test_demo_writes_outside_the_current_directory(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cwd = tmp_path / "checkout"
    cwd.mkdir()
    monkeypatch.setenv("MOEPACK_CACHE_DIR", str(cache))
    monkeypatch.chdir(cwd)
    r = _run("demo", "--preset", "tiny", "--json")
    assert r.exit_code == 0, r.output
    steps = json.loads(r.output)
    assert steps["workdir"] == str(cache / "demo") and (cache / "demo" / "tiny-fp4.moepack").exists()
    assert list(cwd.iterdir()) == []


def test_thinking_and_reasoning_effort_without_a_chat_encoding_are_refused(container):
    """They shape the chat encoding only: on a raw prompt they would be taken and change nothing (#38)."""
    for flags in (["--thinking"], ["--no-thinking"], ["--reasoning-effort", "high"]):
        r = _run("generate", container, "-p", "hello", "-n", "2", *flags)
        assert r.exit_code == 2 and "give --chat or --messages" in r.output
    r = _run("generate", container, "--chat", "hello", "-n", "2", "--thinking", "--reasoning-effort", "max", "--json")
    assert r.exit_code == 0, r.output


# Each a refusal before any work (docs/failures.md, "Flags that do not go together"): the arguments (FILE is a file
# that exists, MISSING one that does not, DIR a directory), the exit status (2: a usage error) and the message.
ARGUMENT_REFUSALS = [
    (["generate", "FILE", "-p", "a", "--chat", "b"], 2,
     "give at most one of --prompt, --prompt-file, --token-ids, --messages, --chat, --prompts-file"),
    (["prefill", "FILE", "-p", "a", "--token-ids", "FILE"], 2,
     "give exactly one of --prompt, --prompt-file, --token-ids"),
    (["convert", "MISSING"], 2, "choose a precision policy: --fp4, --nvfp4, --q8, --q2, --bf16 or --keep"),
    (["convert", "MISSING", "--fp4", "--part-dir", "1=/tmp"], 2, "--part-dir needs --parts 2 or more"),
    (["convert", "MISSING", "--fp4", "--parts", "2", "--part-dir", "x"], 2, "--part-dir 'x': expected K=DIR"),
    (["export", "FILE", "-o", "MISSING", "--split-max-size", "1G"], 2, "--split-max-size applies to --format gguf"),
    (["export", "FILE", "-o", "MISSING", "--format", "gguf", "--dtype", "f32"], 2, "--dtype applies to --format hf"),
    (["prefill", "FILE", "-p", "a", "--container-per-rank"], 2,
     "--container-per-rank needs --expert-parallel and '{rank}' in FILE"),
    (["prefill", "FILE", "-p", "a", "--continue-from", ""], 1, "--continue-from is empty"),
    (["serve", "FILE", "--api-key", "k", "--api-key-file", "FILE"], 2, "give --api-key or --api-key-file, not both"),
    (["serve", "FILE", "--max-batch", "1", "--prompt-cache-gib", "1"], 2,
     "--prompt-cache-gib needs --max-batch above 1"),
    (["plan", "MISSING"], 1, "no such file (give a container, a config.json, a checkpoint directory"),
    (["bench", "io", "FILE", "--depths", "0"], 1, "--depths: expected integers >= 1, got '0'"),
    (["bench", "compute", "--device", "tpu"], 1, "--device must be cpu, cuda or cuda:N, got 'tpu'"),
    (["bench", "io", "MISSING"], 1, "no such file"),
    (["inspect", "DIR"], 1, "is a directory, not a moepack container"),
    (["prefill", "FILE", "-p", "a", "-t", "100000"], 2, "per CPU of this machine's"),
]


@pytest.mark.parametrize("args, status, message", ARGUMENT_REFUSALS)
def test_flags_that_do_not_go_together_are_refused_before_any_work(args, status, message, tmp_path):
    file = tmp_path / "m.moepack"
    file.write_bytes(b"not read: the refusal comes first")
    names = {"FILE": str(file), "MISSING": str(tmp_path / "missing"), "DIR": str(tmp_path)}
    r = _run(*(names.get(a, a) for a in args))
    assert r.exit_code == status and message in r.output, r.output
    assert sorted(os.listdir(tmp_path)) == ["m.moepack"]  # nothing written
