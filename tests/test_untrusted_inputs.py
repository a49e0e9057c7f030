"""Issue #37's hostile inputs outside the server: JSON nested 100,000 deep, numbers of 5,000 digits, NaN, invalid
UTF-8 and lone surrogates in every file a command reads and in argv; configs convert would write but verify refuses;
files that hang or blow up a reader (/dev/zero, a FIFO, a GGUF whose counts outrun it); the temporaries of a killed
export. Each is refused in one line that names the file, the field or the flag: no traceback, a non-zero status."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time

import click
import pytest
from click.testing import CliRunner

from console import run_console
from containers import tiny_keep_container
from moepack.cli.common import FiniteFloat, Text
from moepack.cli.main import cli
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.files import remove_stale_temporaries, temporary_prefix

DEEP = "[" * 100_000 + "]" * 100_000
LONG_NUMBER = "9" * 5000


def _moepack(*args, timeout=120, **kwargs) -> subprocess.CompletedProcess:
    """The console entry in a process of its own (argv as bytes where a test needs bytes that are not UTF-8)."""
    return subprocess.run([sys.executable, "-m", "moepack", *args], capture_output=True, timeout=timeout, **kwargs)


def _refused(p: subprocess.CompletedProcess, *named: str, status: int = 1) -> str:
    """One line of error naming each of `named`, the exit status, and no traceback."""
    err = p.stderr.decode("utf-8", "backslashreplace")
    assert p.returncode == status, (p.returncode, err)
    assert "Traceback" not in err, err
    if status == 1:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("moepack: error: "), err
        line = lines[0]
    else:  # click's usage error: usage lines, then one "Error: ..." line
        line = next(x for x in err.splitlines() if x.startswith("Error: "))
    for name in named:
        assert name in line, (name, line)
    return line


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    return tiny_keep_container(tmp_path_factory)


@pytest.fixture(scope="module")
def source(container):
    return os.path.join(os.path.dirname(container), "src")


def _checkpoint_copy(source, tmp_path) -> str:
    out = str(tmp_path / "src")
    shutil.copytree(source, out)
    return out


def _edit_config(src: str, text_of_value: str, field: str) -> None:
    """Set one config.json field to raw JSON text (NaN, a 5000-digit number: what json.dump will not write)."""
    path = os.path.join(src, "config.json")
    with open(path) as f:
        config = json.load(f)
    config[field] = "@@"
    with open(path, "w") as f:
        f.write(json.dumps(config).replace('"@@"', text_of_value))


# --- JSON files --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, named", [("NaN", "rms_norm_eps: NaN"), (LONG_NUMBER, "a number of 5000 digits"),
                                          ("1e999", "overflows"), ('"\\ud800"', "lone surrogate"), (DEEP, "nested")],
                         ids=["nan", "5000 digits", "1e999", "lone surrogate", "nested 100000 deep"])
def test_config_json_values_python_takes_are_refused_by_convert(source, tmp_path, value, named):
    src = _checkpoint_copy(source, tmp_path)
    _edit_config(src, value, "rms_norm_eps")
    out = tmp_path / "x.moepack"
    _refused(run_console("convert", src, "-o", str(out), "--q8"), "config.json", named)
    assert not os.listdir(tmp_path / "src") == [] and not out.exists() and not (tmp_path / "x.moepack.partial").exists()
    _refused(run_console("plan", src), "config.json", named)  # plan reads a checkpoint's config too


def test_invalid_utf8_in_config_json_is_named(source, tmp_path):
    src = _checkpoint_copy(source, tmp_path)
    with open(os.path.join(src, "config.json"), "ab") as f:
        f.write(b"\xff")
    _refused(run_console("convert", src, "-o", str(tmp_path / "x.moepack"), "--q8"), "config.json", "not valid UTF-8")


def test_the_shard_index_and_a_safetensors_header_are_bounded(source, tmp_path):
    src = _checkpoint_copy(source, tmp_path)
    index = os.path.join(src, "model.safetensors.index.json")
    with open(index, "w") as f:
        f.write('{"weight_map": ' + DEEP + "}")
    _refused(run_console("convert", src, "-o", str(tmp_path / "x.moepack"), "--q8"), "model.safetensors.index.json",
             "nested more than")
    os.remove(index)
    shard = os.path.join(src, sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))[0])
    with open(shard, "rb") as f:
        data = bytearray(f.read())
    (n,) = struct.unpack_from("<Q", data)
    header = b'{"a": ' + DEEP[:200].encode() + b"}"
    bad = bytearray(struct.pack("<Q", n) + header + b" " * (n - len(header)) + data[8 + n:])
    with open(shard, "wb") as f:
        f.write(bad)
    _refused(run_console("convert", src, "-o", str(tmp_path / "x.moepack"), "--q8"), os.path.basename(shard),
             "safetensors header is not valid JSON", "nested")
    struct.pack_into("<Q", bad, 0, 1 << 40)  # a header length beyond the file: refused before any read
    with open(shard, "wb") as f:
        f.write(bad)
    _refused(run_console("convert", src, "-o", str(tmp_path / "x.moepack"), "--q8"), os.path.basename(shard),
             "bad safetensors header length 1099511627776")


@pytest.mark.parametrize("content, named", [
    (DEEP.encode(), "nested more than"), (b'[{"role": "user", "content": "x\\udc00"}]', "[0].content: a string"),
    (b'[{"role": "user", "content": "\xff"}]', "not valid UTF-8"), (("[" + LONG_NUMBER + "]").encode(), "5000 digits"),
    (b'[{"role": "user", "content": NaN}]', "NaN")],
    ids=["nested 100000 deep", "lone surrogate", "invalid utf-8", "5000 digits", "nan"])
def test_messages_files_are_bounded(container, tmp_path, content, named):
    path = tmp_path / "messages.json"
    path.write_bytes(content)
    _refused(run_console("generate", container, "--messages", str(path), "--max-new-tokens", "1"), str(path), named)


@pytest.mark.parametrize("content, named", [
    (b"1 2 \xff 3", "not valid UTF-8 (byte 4)"), (b"[1, " + LONG_NUMBER.encode() + b"]", "5000 digits"),
    (DEEP.encode(), "nested more than"), (LONG_NUMBER.encode(), "expected a non-empty list of integer token ids")],
    ids=["invalid utf-8", "5000 digits in json", "nested 100000 deep", "5000 digits bare"])
def test_token_id_files_are_bounded(container, tmp_path, content, named):
    path = tmp_path / "ids.txt"
    path.write_bytes(content)
    for command in (["prefill"], ["generate", "--max-new-tokens", "1"]):
        _refused(run_console(command[0], container, "--token-ids", str(path), *command[1:]), str(path), named)


def test_a_prompt_file_of_invalid_utf8_or_over_its_bound_is_one_line(container, tmp_path, monkeypatch):
    from moepack.serve import tokenizer

    path = tmp_path / "prompt.txt"
    path.write_bytes(b"hello \xff")
    _refused(run_console("prefill", container, "--prompt-file", str(path)), str(path),
             "not valid UTF-8 (byte 6): expected the prompt")
    path.write_bytes(b"hello" * 100)
    monkeypatch.setattr(tokenizer, "MAX_PROMPT_BYTES", 100)
    with pytest.raises(MoepackError, match="more than 100 bytes of the prompt"):
        tokenizer.read_prompt_file(str(path))


def test_a_damaged_tokenizer_config_in_a_container_leaves_the_default(container, tmp_path):
    from containers import mutate_index

    from moepack.format_spec.reader import Container
    from moepack.serve.tokenizer import PromptTokenizer

    path = str(tmp_path / "t.moepack")
    mutate_index(container, path, lambda index: index["tokenizer"].__setitem__(
        "tokenizer_config.json", {"encoding": "utf-8", "data": DEEP}))
    with Container(path) as c:
        assert PromptTokenizer(c).add_special_tokens is True


@pytest.mark.parametrize("cache", [
    DEEP, "{", '{"format": "moepack-bench", "version": 1, "x": ' + LONG_NUMBER + "}", "\xff",
    "machines-nan", "machines-zero", "machines-string", "machines-points"],
    ids=["nested 100000 deep", "bad json", "5000 digits", "invalid utf-8", "nan rate", "zero rate", "string rate",
         "negative gflops"])
def test_a_damaged_bench_cache_is_ignored_in_one_line(container, tmp_path, cache):
    from moepack.runtime.tuning import CACHE_ENV, CACHE_FORMAT, CACHE_VERSION, machine_id

    machine = {"io": {"x": {"best": {"gbps": "nan", "bundle_experts": 4, "queue_depth": 4, "read_bytes": 1},
                            "measured_at": "now", "path": "/x"}},
               "memory": {"latest": {"host_copy_gbps": 10.0, "measured_at": "now"}}}
    if cache == "machines-zero":
        machine["io"]["x"]["best"]["gbps"] = 0
    elif cache == "machines-string":
        machine["memory"]["latest"]["host_copy_gbps"] = "fast"
        machine["io"]["x"]["best"]["gbps"] = 3.0
    elif cache == "machines-points":
        machine["io"]["x"]["best"]["gbps"] = 3.0
        machine["compute"] = {"k": {"device": "cpu", "points": [{"tokens_per_expert": 1, "gflops": -1}],
                                    "storage": "F32", "hidden": 1, "intermediate": 1, "expert_dtype": "float32",
                                    "measured_at": "now"}}
    if cache.startswith("machines"):
        cache = json.dumps({"format": CACHE_FORMAT, "version": CACHE_VERSION, "machines": {machine_id(): machine}})
    directory = tmp_path / "cache"
    directory.mkdir()
    (directory / "bench.json").write_bytes(cache.encode("utf-8", "surrogateescape") if cache != "\xff" else b"\xff")
    p = run_console("plan", container, "--context", "1K", env={CACHE_ENV: str(directory)})
    out, err = p.stdout.decode(), p.stderr.decode()
    assert p.returncode == 0, err
    assert "Traceback" not in err and "nan" not in out.lower(), (out, err)
    warnings = [x for x in err.splitlines() if x.strip()]
    assert len(warnings) <= 1 and all(x.startswith("moepack: warning: ") for x in warnings), err


# --- argv --------------------------------------------------------------------------------------------------------


def _all_params():
    commands = [((), cli)]
    while commands:
        path, command = commands.pop()
        if isinstance(command, click.Group):
            commands += [((*path, name), sub) for name, sub in command.commands.items()]
        for param in command.params:
            yield " ".join(path), param


def test_every_float_option_of_every_command_is_finite_and_every_text_option_valid_utf8():
    floats = [(c, p) for c, p in _all_params() if isinstance(p.type, click.types.FloatParamType)]
    assert {p.name for _, p in floats} >= {"cache_gib", "temperature", "top_p", "ssd_gbps", "dist_timeout"}
    for command, param in floats:
        assert isinstance(param.type, FiniteFloat), (command, param.name)
        for text in ("nan", "NaN", "inf", "-inf", "1e999"):
            with pytest.raises(click.BadParameter, match="not a finite number"):
                param.type.convert(text, param, None)
    texts = [(c, p) for c, p in _all_params() if isinstance(p, click.Option) and p.type is click.STRING]
    assert not texts, texts  # every plain string option is Text (or a file name's PATH_TEXT)
    prompt = next(p for c, p in _all_params() if c == "generate" and p.name == "prompt")
    assert isinstance(prompt.type, Text)
    with pytest.raises(click.BadParameter, match="not valid UTF-8"):
        prompt.type.convert("a\udcffb", prompt, None)


@pytest.mark.parametrize("args, flag", [
    (["generate", "{c}", "--prompt", "hi", "--cache-gib", "nan"], "--cache-gib"),
    (["generate", "{c}", "--prompt", "hi", "--temperature", "nan"], "--temperature"),
    (["generate", "{c}", "--prompt", "hi", "--top-p", "nan"], "--top-p"),
    (["plan", "{c}", "--ssd-gbps", "nan"], "--ssd-gbps"),
    (["plan", "{c}", "--tflops", "inf"], "--tflops"),
    (["serve", "{c}", "--cache-gib", "nan"], "--cache-gib"),
    (["prefill", "{c}", "--prompt", "hi", "--dist-timeout", "nan"], "--dist-timeout"),
    ([b"prefill", "{c}", b"--prompt", b"a\xffb"], "--prompt"),
    ([b"generate", "{c}", b"--chat", b"\xed\xa0\x80"], "--chat"),  # a surrogate encoded as UTF-8 bytes
    ([b"generate", "{c}", b"--prompt", b"hi", b"--stop", b"\xff"], "--stop"),
])
def test_nan_and_broken_text_in_argv_are_usage_errors_naming_the_flag(container, args, flag):
    argv = [container if a == "{c}" else a for a in args]
    line = _refused(_moepack(*argv), flag, status=2)
    assert "not a finite number" in line or "not valid UTF-8" in line


@pytest.mark.parametrize("low", ["--ssd-gbps", "--tflops", "--mem-gbps", "--gflop-per-token"])
def test_plan_never_prints_nan_or_inf_at_the_bounds_of_its_rates(container, low):
    from moepack.cli.plan_bench import PLAN_RATE
    from moepack.tools.plan import MAX_PLAN_CONTEXT

    rates = ["--ssd-gbps", "--tflops", "--mem-gbps", "--pcie-gbps", "--gflop-per-token", "--routed-gflop-per-token"]
    args = [x for r in rates for x in (r, str(PLAN_RATE.min if r == low else PLAN_RATE.max))]
    p = run_console("plan", container, *args, "--vram-gib", "1e-300", "--context", "1",
                 "--context", str(MAX_PLAN_CONTEXT))
    out = p.stdout.decode().lower()
    assert p.returncode == 0, p.stderr
    assert not {"nan", "inf"} & set(out.replace("(", " ").replace(")", " ").split()), out
    _refused(run_console("plan", container, low, "1e-300"), low, "not in the range", status=2)
    _refused(run_console("plan", container, "--context", "1e999"), "bad context length '1e999'")


# --- convert validates what verify and prefill refuse -------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("max_position_embeddings", "0"), ("n_routed_experts", "0"), ("num_experts_per_tok", "99"),
    ("sliding_window", "0"), ("hidden_size", "-4"), ("hidden_size", "1e30"), ("rms_norm_eps", '"x"'),
    ("rms_norm_eps", "0"), ("num_hidden_layers", str((1 << 16) + 1)), ("hc_sinkhorn_iters", "1000000")])
def test_convert_refuses_a_config_verify_would_refuse_before_writing(source, tmp_path, field, value):
    src = _checkpoint_copy(source, tmp_path)
    _edit_config(src, value, field)
    out = tmp_path / "x.moepack"
    r = CliRunner().invoke(cli, ["convert", src, "-o", str(out), "--q8", "--json"])
    assert r.exit_code == 1, r.output
    error = json.loads(r.stdout)["error"]
    assert field in error and "\n" not in error, error
    assert not any(n.startswith("x.moepack") for n in os.listdir(tmp_path)), os.listdir(tmp_path)


def test_convert_refuses_an_expert_count_other_than_the_configs(source, tmp_path):
    src = _checkpoint_copy(source, tmp_path)
    with open(os.path.join(src, "config.json")) as f:
        experts = json.load(f)["n_routed_experts"]
    _edit_config(src, str(experts // 2), "n_routed_experts")
    _edit_config(src, "1", "num_experts_per_tok")
    r = CliRunner().invoke(cli, ["convert", src, "-o", str(tmp_path / "x.moepack"), "--q8"])
    assert r.exit_code == 1 and f"holds {experts} experts, the config's n_routed_experts is {experts // 2}" in r.output


def test_convert_refuses_a_tensor_of_another_shape_than_the_config_says(source, tmp_path):
    """A tensor a prefill runs, stored in another shape (a damaged GGUF's zero dimension, a mislabelled
    checkpoint): refused before anything is written, as verify would refuse the container."""
    from safetensors.torch import load_file, save_file

    src = _checkpoint_copy(source, tmp_path)
    shard = next(os.path.join(src, n) for n in sorted(os.listdir(src)) if n.endswith(".safetensors")
                 and any(k.endswith("norm.weight") for k in load_file(os.path.join(src, n))))
    tensors = load_file(shard)
    name = next(k for k in sorted(tensors) if k.endswith("norm.weight"))
    tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, shard)
    r = CliRunner().invoke(cli, ["convert", src, "-o", str(tmp_path / "x.moepack"), "--q8", "--json"])
    assert r.exit_code == 1, r.output
    error = json.loads(r.stdout)["error"]
    assert re.search(r"tensor \S+norm\S* is \[\d+\] but the config says \[\d+\]$", error), error
    assert not any(n.startswith("x.moepack") for n in os.listdir(tmp_path)), os.listdir(tmp_path)


@pytest.mark.parametrize("name,data,named", [
    ("tokenizer.json", "{", "tokenizer.json: not a tokenizer.json the tokenizers library loads"),
    ("tokenizer.json", '{"model": 5}', "tokenizer.json: not a tokenizer.json the tokenizers library loads"),
    ("tokenizer.json", b"\xff\xfe", "tokenizer.json: not a tokenizer.json the tokenizers library loads"),
    ("tokenizer_config.json", "[1]", "tokenizer_config.json: expected a JSON object"),
    ("generation_config.json", '{"temperature": NaN}', "generation_config.json: temperature: NaN"),
    ("generation_config.json", '{"eos_token_id": true}',
     "generation_config.json: eos_token_id: expected a token id or a list of them, got true"),
    ("generation_config.json", '{"eos_token_id": [2, 100000000]}',
     "generation_config.json: eos_token_id 100000000 is past the model's embedding of")],
    ids=["tokenizer cut", "tokenizer of no model", "tokenizer not utf-8", "config a list", "generation NaN",
         "eos a boolean", "eos past the embedding"])
def test_convert_refuses_damaged_tokenizer_files_before_writing(source, tmp_path, name, data, named):
    """A damaged tokenizer file was carried into the container, which then refused every text prompt (and
    `export --format gguf` ended in a traceback): convert names it before any work."""
    src = _checkpoint_copy(source, tmp_path)
    with open(os.path.join(src, name), "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    r = CliRunner().invoke(cli, ["convert", src, "-o", str(tmp_path / "x.moepack"), "--q8", "--json"])
    assert r.exit_code == 1, r.output
    error = json.loads(r.stdout)["error"]
    assert named in error and "\n" not in error, error
    assert not any(n.startswith("x.moepack") for n in os.listdir(tmp_path)), os.listdir(tmp_path)


def test_convert_refuses_a_tokenizer_with_ids_past_the_embedding(source, tmp_path):
    """A tokenizer.json with a token id past config.json's vocab_size: every prompt holding it (a chat's markup,
    perhaps) would be refused at run time as an id out of range; convert names the mismatch before any work."""
    src = _checkpoint_copy(source, tmp_path)
    vocab = json.load(open(os.path.join(src, "config.json")))["vocab_size"]
    path = os.path.join(src, "tokenizer.json")
    tokenizer = json.load(open(path))
    ids = {t["id"] for t in tokenizer["added_tokens"]} | set(tokenizer["model"]["vocab"].values())
    tokenizer["added_tokens"] += [{"id": i, "content": f"<filler{i}>", "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": False, "special": True}
                                  for i in range(max(ids) + 1, vocab + 4)]  # (the library renumbers a gap away)
    with open(path, "w") as f:
        json.dump(tokenizer, f)
    r = CliRunner().invoke(cli, ["convert", src, "-o", str(tmp_path / "x.moepack"), "--q8", "--json"])
    assert r.exit_code == 1, r.output
    assert json.loads(r.stdout)["error"].endswith(
        f"tokenizer.json: token id {vocab + 3} is past the model's embedding of {vocab} rows (config.json "
        "vocab_size): a prompt holding it could not be run")


def test_a_containers_damaged_tokenizer_is_one_line_in_every_command_that_reads_it(container, tmp_path):
    from containers import mutate_index

    path = str(tmp_path / "t.moepack")
    mutate_index(container, path, lambda index: index["tokenizer"].__setitem__(
        "tokenizer.json", {"encoding": "utf-8", "data": '{"model": 5}'}))
    runs = [["prefill", path, "-p", "hi"], ["generate", path, "-p", "hi", "-n", "1"]]
    try:
        import gguf  # noqa: F401
        runs.append(["export", path, "--format", "gguf", "-o", str(tmp_path / "t.gguf")])
    except ImportError:
        pass
    for args in runs:
        _refused(run_console(*args),
                 "the container's tokenizer.json: not a tokenizer.json the tokenizers library loads")
    ids = tmp_path / "ids.json"  # token ids need no tokenizer: they run, their text left out with a warning
    ids.write_text("[5, 6, 7]")
    r = CliRunner().invoke(cli, ["generate", path, "--token-ids", str(ids), "-n", "2", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["text"] is None, r.output


# --- files that hang or blow up a reader --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kv_dir(container, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("kv") / "kv")
    r = CliRunner().invoke(cli, ["prefill", container, "--prompt", "hello there", "--kv-out", out])
    assert r.exit_code == 0, r.output
    return out


def test_a_kv_manifest_that_is_a_link_to_dev_zero_is_refused_at_once(kv_dir, tmp_path):
    copy = tmp_path / "kv"
    shutil.copytree(kv_dir, copy)
    os.remove(copy / "manifest.json")
    os.symlink("/dev/zero", copy / "manifest.json")
    started = time.monotonic()
    _refused(_moepack("kv", "inspect", str(copy), timeout=30), "manifest.json", "not a regular file",
             "character device")
    assert time.monotonic() - started < 20


def test_an_oversized_kv_manifest_is_refused(kv_dir, tmp_path, monkeypatch):
    from moepack.families.deepseek_v4 import kv as K

    copy = tmp_path / "kv"
    shutil.copytree(kv_dir, copy)
    monkeypatch.setattr(K, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(MoepackError, match="manifest.json is larger than 100 bytes"):
        K.KVDirectory(str(copy))


def test_a_kv_layer_file_that_is_a_fifo_is_refused_not_waited_on(container, kv_dir, tmp_path):
    copy = tmp_path / "kv"
    shutil.copytree(kv_dir, copy)
    os.remove(copy / "layer-0001.safetensors")
    os.mkfifo(copy / "layer-0001.safetensors")
    for args in (["kv", "inspect", str(copy)],
                 ["generate", container, "--continue-from", str(copy), "--prompt", " more", "--max-new-tokens", "1"]):
        _refused(_moepack(*args, timeout=60), "layer-0001.safetensors", "not a regular file (a FIFO or pipe)")


def _small_gguf(path: str) -> bytes:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(path, "deepseek4")
    w.add_array("test.tokens", ["a", "bb", "ccc"])
    w.add_array("test.ints", [1, 2, 3])
    w.add_string("test.name", "hello")
    w.add_tensor("x", np.zeros((64, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize("key, skip, field, named", [
    (b"test.tokens", 8, "Q", "test.tokens (an array of 1099511627776)"),  # after the value type and item type
    (b"test.ints", 8, "Q", "test.ints (an array of 1099511627776)"),
    (b"test.name", 4, "Q", "test.name (a string of 1099511627776 bytes)"),
    (b"GGUF", 8, "Q", "a key/value count of 1099511627776"),  # after the magic and version: the tensor count
    (b"GGUF", 16, "Q", "a key/value count of 1099511627776")])
def test_a_gguf_whose_counts_outrun_the_file_is_refused_at_once(tmp_path, key, skip, field, named):
    pytest.importorskip("gguf")
    path = str(tmp_path / "m.gguf")
    data = bytearray(_small_gguf(path))
    at = data.index(key) + (len(key) if key != b"GGUF" else 0) + skip
    if key == b"GGUF" and skip == 8:  # the tensor count: the key/values first, then it is checked
        named = "a tensor count of 1099511627776"
    struct.pack_into("<" + field, data, at, 1 << 40)
    data += bytes(8 << 20)  # zeros for gguf-py to loop over as items
    with open(path, "wb") as f:
        f.write(data)
    started = time.monotonic()
    out = str(tmp_path / "x.moepack")
    _refused(run_console("convert", path, "-o", out, "--q8"), "m.gguf", "damaged GGUF", named)
    _refused(run_console("verify", out, "--source", path))  # no container: refused, no hang either
    assert time.monotonic() - started < 30


def test_control_characters_from_a_damaged_file_or_a_name_stay_one_line(tmp_path):
    """A GGUF whose key holds a newline (a damaged header puts any byte there) and a path holding one: the error
    is still one line, the control characters written as escapes."""
    pytest.importorskip("gguf")
    path = str(tmp_path / "m.gguf")
    data = bytearray(_small_gguf(path))
    at = data.index(b"test.name") + len(b"test.name")
    data[at - 5] = ord("\n")  # the key "test\nname"
    struct.pack_into("<I", data, at, 99)  # its value type, unknown: refused naming the key
    with open(path, "wb") as f:
        f.write(data)
    line = _refused(run_console("convert", path, "-o", str(tmp_path / "x.moepack"), "--q8"), "damaged GGUF")
    assert "test\\nname" in line, line
    _refused(run_console("prefill", str(tmp_path / "a\nb.moepack"), "-p", "hi"), "a\\nb.moepack")


# --- leftovers of a killed export ----------------------------------------------------------------------------------


def test_only_our_stale_temporaries_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine = tmp_path / (temporary_prefix("export") + "abc")
    stale = tmp_path / (temporary_prefix("export").replace(f".{os.getpid()}-", f".{dead.pid}-") + "def")
    stale_file = tmp_path / (temporary_prefix("export").replace(f".{os.getpid()}-", f".{dead.pid}-") + "x.gguf.tmp")
    other_host = tmp_path / f".export-someotherhost.{dead.pid}-ghi"
    other_kind = tmp_path / (temporary_prefix("bench").replace(f".{os.getpid()}-", f".{dead.pid}-") + "jkl")
    not_ours = tmp_path / ".export-abcdef"
    for p in (mine, stale, other_host, other_kind, not_ours):
        p.mkdir()
    stale_file.write_bytes(b"x")
    removed = remove_stale_temporaries(str(tmp_path), ("export",))
    assert sorted(removed) == sorted([str(stale), str(stale_file)])
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in (mine, other_host, other_kind, not_ours))


def _temporaries(directory) -> list[str]:
    return [n for n in os.listdir(directory) if n.startswith(".export-")]


def _export_killed_mid_write(container: str, out: str, sig: int, fmt: str) -> subprocess.Popen:
    """An export in a process of its own, sent `sig` as soon as its temporary output appears."""
    parent = os.path.dirname(out)
    p = subprocess.Popen([sys.executable, "-m", "moepack", "export", container, "-o", out, "--format", fmt],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not _temporaries(parent) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert p.poll() is None, "the export ended before it could be killed"
    p.send_signal(sig)
    p.wait(timeout=60)
    return p


@pytest.fixture(scope="module")
def small_container(tmp_path_factory):
    """A container whose export takes long enough to be killed in the middle (the tiny one's is over at once)."""
    from moepack.packer.convert import convert_checkpoint
    from moepack.packer.synth import synth_checkpoint

    base = tmp_path_factory.mktemp("small")
    synth_checkpoint(str(base / "src"), preset="small", progress=False)
    return convert_checkpoint(str(base / "src"), str(base / "small.moepack"), policy="keep", progress=False)["output"]


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_a_sigterm_export_leaves_no_temporaries_and_a_sigkill_one_is_cleared_by_the_rerun(small_container, tmp_path,
                                                                                         fmt):
    if fmt == "gguf":
        pytest.importorskip("gguf")
    out = str(tmp_path / ("out" if fmt == "hf" else "out.gguf"))
    p = _export_killed_mid_write(small_container, out, signal.SIGTERM, fmt)
    err = p.stderr.read().decode()
    assert p.returncode == 130 and err.strip() == "moepack: error: interrupted", (p.returncode, err)
    assert not _temporaries(tmp_path) and not os.path.exists(out)
    p = _export_killed_mid_write(small_container, out, signal.SIGKILL, fmt)
    assert p.returncode == -signal.SIGKILL and _temporaries(tmp_path)
    again = run_console("export", small_container, "-o", out, "--format", fmt)
    assert again.returncode == 0, again.stderr
    assert not _temporaries(tmp_path) and os.path.exists(out)


def test_a_dangling_link_or_a_stub_gguf_is_named_as_what_it_is(tmp_path):
    """A symbolic link loop (or one to nothing) is a local path gone wrong, never a hub repo id to look up; a
    .gguf too short for its magic is named as such, not only as "not a directory"."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "gone").symlink_to(tmp_path / "nothing")
    (tmp_path / "t.gguf").write_bytes(b"GG")
    nowhere = "a symbolic link that leads nowhere (a loop, or its target is gone)"
    for src, words in ((tmp_path / "a", nowhere), (tmp_path / "gone", nowhere),
                       (tmp_path / "t.gguf", "not a directory (nor a GGUF file: too short for its magic)")):
        r = CliRunner().invoke(cli, ["convert", str(src), "-o", str(tmp_path / "x.moepack"), "--keep", "--json"])
        assert r.exit_code == 1 and json.loads(r.stdout)["error"] == f"{src}: {words}", r.output
    assert not any(n.startswith("x.moepack") for n in os.listdir(tmp_path))


def test_a_tokenizer_that_panics_on_a_text_is_one_line():
    """A tokenizer.json whose pre-tokenizer regex backtracks past the regex engine's limit loads and converts; the
    tokenizers library then panics on some texts (a Rust panic: a BaseException, past every `except Exception`):
    one line naming the tokenizer, not a dead server thread or a traceback."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    from moepack.serve.tokenizer import PromptTokenizer

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(a|aa)+$"), "isolated")
    assert PromptTokenizer._ids(tok, "b", False) == [1]
    with pytest.raises(MoepackError, match="the container's tokenizer failed on the text .*retry-limit"):
        PromptTokenizer._ids(tok, "a" * 59 + "b", False)


@pytest.mark.parametrize("entry", [
    {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]},
    {"dtype": {"F32": 1}, "shape": [2], "data_offsets": [0, 8]},
    {"dtype": None, "shape": [2], "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": {"2": 2}, "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": [2], "data_offsets": {"0": 0, "8": 8}},
    {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": ["a", 2], "data_offsets": [0, 8]}])
def test_a_safetensors_header_entry_of_any_json_type_is_one_line(tmp_path, entry):
    from moepack.packer.source import read_safetensors_header

    header = json.dumps({"w": entry}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(MoepackError, match=r"^model.safetensors: .*\bw\b"):
        read_safetensors_header(str(path))


@pytest.mark.parametrize("name, entry, named", [
    ("tokenizer.json", "x", "'tokenizer.json' is not an object of an encoding"),
    ("tokenizer.json", {"encoding": "utf-8", "data": 5}, "'tokenizer.json' is not an object of an encoding"),
    ("tokenizer.json", {"encoding": "rot13", "data": "{}"}, "'tokenizer.json' is not an object of an encoding"),
    ("tokenizer.model", {"encoding": "base64", "data": "!!!"}, "'tokenizer.model': its data is not base64"),
    ("../../evil.json", {"encoding": "utf-8", "data": "{}"}, "'../../evil.json' is not a plain file name"),
    ("", {"encoding": "utf-8", "data": "{}"}, "'' is not a plain file name")])
def test_a_containers_tokenizer_file_of_another_form_is_refused_at_open(container, tmp_path, name, entry, named):
    """The index's tokenizer files are read by the tokenizer and both exports (b64decode, .get, a path joined):
    an entry of another form had been a traceback in each; the reader refuses it for all of them."""
    from containers import mutate_index

    from moepack.format_spec.reader import Container

    path = str(tmp_path / "t.moepack")
    mutate_index(container, path, lambda index: index["tokenizer"].__setitem__(name, entry))
    with pytest.raises(MoepackError, match=re.escape(f"index tokenizer file {'name ' * ('plain' in named)}{named}")):
        Container(path)


def test_a_gguf_export_refuses_a_damaged_json_tokenizer_file_or_a_container_unlike_its_family(container, tmp_path):
    """gguf-py's SpecialVocab json.loads the tokenizer's side files (a damaged one had been a JSONDecodeError
    traceback), and the family's tensor names were looked up unchecked (a container whose architecture names
    another family: a KeyError traceback)."""
    pytest.importorskip("gguf")
    from containers import mutate_index

    damaged, other = str(tmp_path / "d.moepack"), str(tmp_path / "o.moepack")
    mutate_index(container, damaged, lambda index: index["tokenizer"].__setitem__(
        "tokenizer_config.json", {"encoding": "utf-8", "data": "{bad"}))
    _refused(run_console("export", damaged, "--format", "gguf", "-o", str(tmp_path / "d.gguf")),
             "the container's tokenizer_config.json: not valid JSON")
    foreign = next(a for a in ("deepseek_v4", "qwen3_moe") if a != _index(container)["architecture"])
    mutate_index(container, other, lambda index: index.__setitem__("architecture", foreign))
    r = run_console("export", other, "--format", "gguf", "-o", str(tmp_path / "o.gguf"))
    assert r.returncode == 1 and b"Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not list(tmp_path.glob("*.gguf"))


def _index(path: str) -> dict:
    from containers import read_parts

    return read_parts(path)[2]


@pytest.mark.parametrize("name, stored_as, named", [
    ("layers.0.attn_norm.weight", "I32", "stored as I32, not a float type"),  # had run: its bits read as numbers
    ("layers.0.ffn.gate.weight", "I16", "stored as I16, not a float type"),  # a matmul of int16 and float: a traceback
    ("layers.0.ffn.gate.tid2eid", "F64", "stored as F64, not an integer type")])  # float expert ids: a traceback
def test_a_tensor_stored_in_a_type_of_other_values_than_the_model_reads_is_refused(container, source, tmp_path, name,
                                                                                    stored_as, named):
    """A weight stored in an integer type of its byte size (or DeepSeek-V4's hash routing table in a float type)
    passes every checksum and shape check: the container is refused before anything is read, the checkpoint before
    anything is written."""
    from containers import mutate_index

    from moepack.families import check_container
    from moepack.format_spec.reader import Container

    path = str(tmp_path / "t.moepack")
    mutate_index(container, path, lambda index: next(t for t in index["tensors"] if t["name"] == name).__setitem__(
        "dtype", stored_as))
    with Container(path) as c, pytest.raises(MoepackError, match=f"tensor {re.escape(name)} is {named}"):
        check_container(c)
    if name.endswith("tid2eid"):
        return
    src = _checkpoint_copy(source, tmp_path)
    shard = next(os.path.join(src, n) for n in sorted(os.listdir(src)) if n.endswith(".safetensors")
                 and name.encode() in open(os.path.join(src, n), "rb").read(1 << 16))
    data = bytearray(open(shard, "rb").read())
    (n,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + n])
    size = {"F32": 4, "BF16": 2}[header[name]["dtype"]]
    header[name]["dtype"] = {4: "I32", 2: "I16"}[size]
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(text) == n
    open(shard, "wb").write(data[:8] + text + data[8 + n:])
    _refused(run_console("convert", src, "-o", str(tmp_path / "x.moepack"), "--q8"), f"tensor {name} is stored as")
    assert not os.path.exists(tmp_path / "x.moepack")


@pytest.mark.parametrize("make, named", [(os.mkdir, "not a regular file (a directory)"),
                                         (lambda p: os.symlink("nowhere", p), "no such file")])
def test_a_tokenizer_file_that_is_not_a_file_is_refused_not_left_out(source, tmp_path, make, named):
    """A tokenizer.json that is a directory or a link to nothing (a broken copy) had been skipped: the container
    came out without a tokenizer, silently."""
    src = _checkpoint_copy(source, tmp_path)
    os.remove(os.path.join(src, "tokenizer.json"))
    make(os.path.join(src, "tokenizer.json"))
    _refused(run_console("convert", src, "-o", str(tmp_path / "x.moepack"), "--q8"), "tokenizer.json: " + named)


def test_an_hf_export_refuses_a_container_verify_refuses(container, tmp_path):
    """The export's checksums pass a tensor stored unlike its config (an I32 norm, a shape of another model): it had
    gone on into a checkpoint transformers then reads as it finds it."""
    from containers import mutate_index

    def norm_as_int32(index):
        next(t for t in index["tensors"] if t["name"] == "layers.0.attn_norm.weight")["dtype"] = "I32"

    path = str(tmp_path / "t.moepack")
    mutate_index(container, path, norm_as_int32)
    _refused(run_console("export", path, "-o", str(tmp_path / "hf")), "layers.0.attn_norm.weight is stored as I32")
    assert not (tmp_path / "hf").exists()
