"""`moepack generate` with several prompts (--prompt repeated, --prompts-file): decoded together through the
BatchScheduler (--max-batch), each prompt's tokens those it gets alone, its output printed as it completes."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from moepack.cli.main import cli
from containers import tiny_keep_container

PROMPTS = ["Once upon a time", "The experts stream from the disk and more", "abc"]
RUN = ["--cache-gib", "0.1", "-n", "7"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_keep_container(tmp_path_factory)


def _run(*args):
    return CliRunner().invoke(cli, ["generate", *args])


def _lines(result) -> list[dict]:
    """The --json lines of a run of several prompts, in index order (they come in completion order)."""
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    return sorted(lines, key=lambda line: line["index"])


def _alone(tiny, *args) -> dict:
    done = _run(tiny, *args, *RUN, "--json")
    assert done.exit_code == 0, done.output
    return json.loads(done.stdout)


def test_greedy_tokens_of_each_prompt_are_those_it_gets_alone(tiny):
    alone = [_alone(tiny, "--prompt", p)["generated_ids"] for p in PROMPTS]
    for max_batch in ("2", "8"):  # two at a time: the third joins as one leaves
        args = [a for p in PROMPTS for a in ("--prompt", p)]
        together = _lines(_run(tiny, *args, *RUN, "--max-batch", max_batch, "--json"))
        assert [line["generated_ids"] for line in together] == alone
        assert all(len(ids) == 7 for ids in alone)


def test_each_prompt_samples_with_its_own_seed_reproducibly(tiny, tmp_path):
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(x) for x in (
        PROMPTS[0], {"prompt": PROMPTS[1]}, {"prompt": PROMPTS[2], "seed": 99})) + "\n")
    args = [tiny, "--prompts-file", str(tmp_path / "p.jsonl"), *RUN, "--temperature", "1.5", "--seed", "7", "--json"]
    first, again = _lines(_run(*args)), _lines(_run(*args))
    assert [x["generated_ids"] for x in first] == [x["generated_ids"] for x in again]
    # --seed S: prompt I samples with S + I, unless its line gives its own
    assert [x["stats"]["sampling_seed"] for x in first] == [7, 8, 99]
    for line, prompt, seed in zip(first, PROMPTS, (7, 8, 99)):
        alone = _alone(tiny, "--prompt", prompt, "--temperature", "1.5", "--seed", str(seed))
        assert line["generated_ids"] == alone["generated_ids"]
    assert len({tuple(x["generated_ids"]) for x in first}) == 3


def test_json_gives_one_line_per_prompt_and_text_lists_each_as_it_completes(tiny, tmp_path):
    (tmp_path / "p.jsonl").write_text(
        json.dumps({"prompt": PROMPTS[0], "id": "first"}) + "\n\n"  # a blank line is skipped
        + json.dumps({"token_ids": [5, 6, 7], "max_new_tokens": 3}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "Hi"}], "id": 12}) + "\n")
    lines = _lines(_run(tiny, "--prompts-file", str(tmp_path / "p.jsonl"), *RUN, "--json"))
    assert [x["index"] for x in lines] == [0, 1, 2] and all(x["ok"] for x in lines)
    assert [x.get("id") for x in lines] == ["first", None, 12]
    for x in lines:
        assert set(x) >= {"generated_ids", "text", "finish_reason", "stats"}
        assert x["stats"]["decode"]["mean_batch"] >= 1 and x["stats"]["prefill"]["tokens"] > 0
    # token ids in: the text of the ids out, and --stop, where the container carries a tokenizer, as alone
    ids_file = tmp_path / "ids.json"
    ids_file.write_text("[5, 6, 7]")
    done = _run(tiny, "--token-ids", str(ids_file), *RUN, "-n", "3", "--json")
    alone = json.loads(done.stdout)
    assert lines[1]["generated_ids"] == alone["generated_ids"] and isinstance(alone["text"], str) and alone["text"]
    assert lines[1]["text"] == alone["text"]
    done = _run(tiny, "--token-ids", str(ids_file), *RUN, "-n", "3", "--stop", alone["text"][-1], "--json")
    assert json.loads(done.stdout)["finish_reason"] == "stop", done.output
    assert lines[0]["text"] == _alone(tiny, "--prompt", PROMPTS[0])["text"]
    assert lines[2]["generated_ids"] == _alone(tiny, "--chat", "Hi")["generated_ids"]

    human = _run(tiny, "--prompt", PROMPTS[0], "--prompt", PROMPTS[2], *RUN)
    assert human.exit_code == 0, human.output
    headers = [line for line in human.stdout.splitlines() if line.startswith("== prompt ")]
    assert sorted(headers) == ["== prompt 0 ==", "== prompt 1 =="]
    assert "prompt 0: prefill:" in human.stderr and "2 prompts: 14 tokens generated" in human.stderr
    # one prompt: the output it always had (the streamed text and a newline, no header)
    single = _run(tiny, "--prompt", PROMPTS[0], *RUN)
    assert single.stdout == lines[0]["text"] + "\n" and "== prompt" not in single.stdout


@pytest.mark.parametrize("content,message", [
    ("", "no prompt"),
    ("\n  \n", "no prompt"),
    ('"fine"\n{"prompt": \n', "line 2: not valid JSON"),
    ('[1, 2]\n', "line 1: expected a JSON string (the prompt) or an object"),
    ('{"prompt": "a", "temperature": 2}\n', "line 1: unknown field 'temperature'"),
    ('{"prompt": "a", "token_ids": [1]}\n', "line 1: give exactly one of prompt, messages, token_ids"),
    ('{"prompt": ""}\n', "line 1: prompt: expected non-empty text"),
    ('{"token_ids": [1, 1000000]}\n', "line 1: token id out of range"),
    ('{"prompt": "a", "seed": -1}\n', "line 1: seed: must be between 0 and"),
    ('"a"\n{"messages": [3]}\n', "line 2: messages[0]"),
])
def test_a_bad_prompts_file_is_refused_in_one_line_before_any_work(tiny, tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    done = _run(tiny, "--prompts-file", str(path), *RUN)
    assert done.exit_code == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("moepack: error: ") and message in done.stderr
    as_json = _run(tiny, "--prompts-file", str(path), *RUN, "--json")
    assert json.loads(as_json.stdout) == {"ok": False, "error": done.stderr[len("moepack: error: "):].strip()}


def test_the_batch_flags_refuse_what_means_nothing(tiny, tmp_path):
    for bad in ("0", "257", "many"):
        done = _run(tiny, "-p", "a", "-p", "b", "--max-batch", bad)
        assert done.exit_code == 2 and "--max-batch" in done.output
    one = _run(tiny, "-p", "a", "-p", "b", "--kv-out", str(tmp_path / "kv"))
    assert one.exit_code == 2 and "--continue-from and --kv-out take one prompt" in one.output
    both = _run(tiny, "-p", "a", "--prompts-file", str(tmp_path / "p.jsonl"))
    assert both.exit_code == 2 and "at most one of" in both.output
    empty = _run(tiny, "-p", "a", "-p", "")
    assert empty.exit_code == 1 and "empty prompt" in empty.stderr
    (tmp_path / "long.jsonl").write_text('"a"\n')
    capped = _run(tiny, "--prompts-file", str(tmp_path / "long.jsonl"), "-c", "2", "--cache-gib", "0.1")
    assert capped.exit_code == 1 and "line 1: the prompt's" in capped.stderr and "context cap" in capped.stderr


def test_a_prompt_that_fails_while_they_run_fails_alone(tiny, tmp_path, monkeypatch):
    """One prompt's memory check refuses it (its KV beside the others'): its line says so, the others complete, and
    the command ends with status 1 saying how many failed."""
    from moepack.format_spec.errors import MoepackError
    from moepack.runtime.generate import Generator

    check = Generator._check_memory

    def refusing(self, n_tokens, other_kv=0, **kw):
        if n_tokens == 5 + 7:  # the second prompt's 5 ids + 7 new tokens
            raise MoepackError("no room for this one")
        return check(self, n_tokens, other_kv, **kw)
    monkeypatch.setattr(Generator, "_check_memory", refusing)
    (tmp_path / "p.jsonl").write_text('{"token_ids": [5, 6, 7]}\n{"token_ids": [5, 6, 7, 8, 9]}\n"abc"\n')
    done = _run(tiny, "--prompts-file", str(tmp_path / "p.jsonl"), *RUN, "--json")
    assert done.exit_code == 1
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert lines[-1] == {"ok": False, "error": "1 of 3 prompts failed (each one's error above)"}
    by_index = {line["index"]: line for line in lines[:-1]}
    assert by_index[1] == {"ok": False, "index": 1, "error": "no room for this one"}
    assert by_index[0]["ok"] and by_index[2]["ok"] and len(by_index[0]["generated_ids"]) == 7
    assert "prompt 1 (" in done.stderr and "line 2): no room for this one" in done.stderr
