"""`moepack perplexity` (runtime/perplexity.py): llama-perplexity's measure over the layer-major prefill equals
the same windows scored by transformers' forward, whether the windows share passes or not; bad input is one line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from moepack.format_spec.errors import MoepackError
from moepack.runtime.engine import PrefillOptions
from moepack.runtime.perplexity import perplexity, windows_of
from console import run_console
from containers import tiny_keep_container

transformers = pytest.importorskip("transformers")
from test_qwen3_moe import CONFIGS, reference, save_model  # noqa: E402

FLOAT32 = PrefillOptions(compute_dtype="float32")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A Qwen3-MoE container (float32, converted --keep) and transformers' model over the same weights."""
    from moepack.packer.convert import convert_checkpoint

    base = tmp_path_factory.mktemp("perplexity")
    save_model(base / "src", CONFIGS["sparse-step"], torch.float32)
    convert_checkpoint(str(base / "src"), str(base / "m.moepack"), policy="keep", progress=False)
    return str(base / "m.moepack"), reference(base / "src")


def _transformers_perplexity(model, windows: list[torch.Tensor]) -> tuple[float, int]:
    """exp of the mean negative log-probability of each window's tokens at positions ctx // 2 + 1 on."""
    nll = []
    with torch.no_grad():
        for w in windows:
            first = len(w) // 2
            lp = torch.log_softmax(model(w[None]).logits[0].double(), dim=-1)
            nll += (-lp[first:-1].gather(1, w[first + 1:, None])[:, 0]).tolist()
    return math.exp(sum(nll) / len(nll)), len(nll)


@pytest.mark.parametrize("bos", [None, 1])
def test_perplexity_equals_transformers_over_the_same_windows(qwen3, bos):
    path, model = qwen3
    ids = torch.randint(3, 300, (100,), generator=torch.Generator().manual_seed(4))
    windows = windows_of(ids, 16, bos)
    assert len(windows) == 6 and all(len(w) == 16 for w in windows)
    if bos is None:
        assert torch.equal(torch.cat(windows), ids[:96])
    else:  # llama-perplexity's: the text read as BOS + text, each window's first token made the BOS
        assert all(int(w[0]) == bos for w in windows) and torch.equal(windows[1][1:], ids[16:31])
        assert len(windows_of(ids[:95], 16, bos)) == 6 and len(windows_of(ids[:94], 16, bos)) == 5
    want, scored = _transformers_perplexity(model, windows)
    alone = perplexity(path, ids, 16, FLOAT32, bos_id=bos, tokens_per_pass=16)  # one window a pass
    together = perplexity(path, ids, 16, FLOAT32, bos_id=bos)  # all in one pass
    assert (alone["passes"], together["passes"]) == (6, 1)
    for result in (alone, together):
        assert result["tokens_scored"] == scored == 6 * 7 and result["windows"] == 6
        assert result["perplexity"] == pytest.approx(want, rel=1e-5)
        assert 0 < result["perplexity_stderr"] < result["perplexity"]
    limited = perplexity(path, ids, 16, FLOAT32, bos_id=bos, max_windows=2)
    assert limited["windows"] == 2 and limited["perplexity"] == pytest.approx(
        _transformers_perplexity(model, windows[:2])[0], rel=1e-5)


def test_windows_that_do_not_fit_together_run_fewer_to_a_pass(qwen3, prefill_room):
    path, _ = qwen3
    prefill_room(40)
    ids = torch.arange(3, 103)
    result = perplexity(path, ids, 16, FLOAT32)
    assert result["windows_per_pass"] == 2 and result["passes"] == 3  # 6 windows of 16: 2 fit in 40 tokens
    assert result["perplexity"] == pytest.approx(perplexity(path, ids, 16, FLOAT32, tokens_per_pass=16)
                                                 ["perplexity"], rel=1e-5)
    with pytest.raises(MoepackError, match=r"one window of --ctx 48 tokens does not fit: a prompt of 48"):
        perplexity(path, ids, 48, FLOAT32)


@pytest.mark.parametrize("call, message", [
    (lambda p: perplexity(p, list(range(3, 10)), 16), "the text is 7 tokens: a window of --ctx 16 needs 16"),
    (lambda p: perplexity(p, list(range(3, 20)), 16, bos_id=1), None),  # 17 tokens: one window of BOS + 15
    (lambda p: perplexity(p, list(range(3, 40)), 2), "--ctx must be at least 3"),
    (lambda p: perplexity(p, list(range(3, 40)), 8, bos_id=300), "BOS id 300 is outside the vocabulary of 300"),
    (lambda p: perplexity(p, list(range(3, 40)), 8, tokens_per_pass=0), "--tokens-per-pass must be at least 1"),
    (lambda p: perplexity(p, list(range(3, 40)), 8, max_windows=0), "--windows must be at least 1"),
    (lambda p: perplexity(p, [3, 4, 999] * 10, 8), "token id out of range"),
    # an id no window holds: the one a BOS replaces (text position 7 of --ctx 8), one in the last part left out
    (lambda p: perplexity(p, [*range(3, 10), -1, *range(3, 20)], 8, bos_id=1), "token id out of range"),
    (lambda p: perplexity(p, [*range(3, 19), 999], 8), "token id out of range"),
])
def test_bad_input_is_one_line(qwen3, call, message):
    path, _ = qwen3
    if message is None:
        assert call(path)["windows"] == 1
        return
    with pytest.raises(MoepackError, match=message):
        call(path)


def test_the_command_scores_a_text_with_the_containers_tokenizer(tmp_path_factory, tmp_path):
    """`moepack perplexity FILE --prompt-file TEXT --json`: the text tokenized without its BOS, which the model's
    tokenizer puts first in each window instead; the figure the runtime gives for those ids; errors one line."""
    from moepack.format_spec.reader import Container
    from moepack.serve.tokenizer import PromptTokenizer

    path = tiny_keep_container(tmp_path_factory)
    text = tmp_path / "text.txt"
    # (a special token's spelling in the text stays text, as llama-perplexity tokenizes it)
    text.write_text("Once upon a time there was a model far larger than its machine. <｜User｜> " * 8)
    r = run_console("perplexity", path, "--prompt-file", str(text), "--ctx", "32", "--json",
                    "--compute-dtype", "float32")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    with Container(path) as c:
        tok = PromptTokenizer(c)
    ids = tok.encode(text.read_text(), special_tokens=False, add_bos=False)
    bos = tok.bos_id if tok.add_special_tokens else None
    assert out["text_tokens"] == len(ids) and out["bos"] == (bos is not None)
    assert out["perplexity"] == pytest.approx(perplexity(path, ids, 32, FLOAT32, bos_id=bos)["perplexity"],
                                              rel=1e-6)
    human = run_console("perplexity", path, "--prompt", "a b c d e f g h i j k l", "--ctx", "4")
    assert human.returncode == 0 and human.stdout.decode().startswith("perplexity "), human.stderr
    bad = run_console("perplexity", path, "--prompt", "a b", "--ctx", "64")
    assert bad.returncode == 1 and bad.stderr.decode().count("\n") == 1 and "the text is" in bad.stderr.decode()
    usage = run_console("perplexity", path, "--ctx", "64")
    assert usage.returncode == 2 and b"give exactly one of" in usage.stderr
    unused = run_console("perplexity", path, "--prompt", "a b", "--cache-gib", "1")
    assert unused.returncode == 2 and b"--cache-gib" in unused.stderr


def test_ctx_beyond_the_models_context_and_one_scored_token(tmp_path_factory, tmp_path):
    """--ctx past the model's context is one line naming --ctx (the command has no -c to raise it); one scored
    token has no uncertainty (null, and said so), not a certain 0."""
    from containers import mutate_index

    path = tiny_keep_container(tmp_path_factory)
    small = str(tmp_path / "small.moepack")
    mutate_index(path, small, lambda index: index["config"].__setitem__("max_position_embeddings", 32))
    bad = run_console("perplexity", small, "--prompt", "a b c d e f g h", "--ctx", "64")
    message = bad.stderr.decode()
    assert bad.returncode == 1 and message.count("\n") == 1, message
    assert "--ctx 64 exceeds the model's context of 32 tokens" in message and "-c " not in message
    one = run_console("perplexity", path, "--token-ids", str(_ids_file(tmp_path, [5, 6, 7, 8])), "--ctx", "4",
                      "--json")
    assert one.returncode == 0, one.stderr
    out = json.loads(one.stdout)
    assert out["tokens_scored"] == 1 and out["perplexity_stderr"] is None and math.isfinite(out["perplexity"])
    human = run_console("perplexity", path, "--token-ids", str(_ids_file(tmp_path, [5, 6, 7, 8])), "--ctx", "4")
    assert human.returncode == 0 and "(one token: no uncertainty)" in human.stdout.decode(), human.stderr


def _ids_file(tmp_path, ids: list[int]):
    out = tmp_path / "ids.txt"
    out.write_text(" ".join(map(str, ids)))
    return out
