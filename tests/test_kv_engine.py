"""The KV hand-off through the real path: container -> `moepack prefill --kv-out` -> transformers decodes on."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("transformers")
from containers import small_disk  # noqa: E402
from v4_models import build  # noqa: E402

from moepack.cli.main import cli  # noqa: E402
from moepack.format_spec.errors import FormatError  # noqa: E402
from moepack.kv import continuation_input_ids, load_transformers_cache  # noqa: E402
from moepack.packer.convert import convert_checkpoint  # noqa: E402
from moepack.runtime.engine import PrefillOptions, prefill  # noqa: E402
from moepack.v4 import kv as K  # noqa: E402


@pytest.fixture(scope="module")
def model_a(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("kv-engine"))
    hf_model, _, _ = build("A", base)
    container = os.path.join(base, "A.moepack")
    convert_checkpoint(os.path.join(base, "A"), container, progress=False)
    return hf_model, container


def _ids(n, seed):
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed))


def _greedy(hf_model, ids, steps, cache=None):
    with torch.no_grad():
        out = hf_model.generate(ids, max_new_tokens=steps, do_sample=False, cache=cache) if cache is not None \
            else hf_model.generate(ids, max_new_tokens=steps, do_sample=False)
    return out[0, -steps:].tolist()


@pytest.mark.parametrize("n", [9, 45])  # 45: partial windows of both compressors (rates 4 and 16)
def test_transformers_continues_from_the_streamed_prefill(model_a, tmp_path, n):
    hf_model, container = model_a
    ids = _ids(n, n)
    kv_dir = str(tmp_path / "kv")
    result = prefill(container, ids, PrefillOptions(bundle_experts=3), kv_out=kv_dir)
    assert result.stats["kv_bytes"] > 0
    expected = _greedy(hf_model, ids[None], 17)
    assert result.next_token == expected[0]
    # transformers takes the prompt + moepack's next token, with moepack's cache standing for the prompt
    cache = load_transformers_cache(kv_dir, hf_model)
    got = _greedy(hf_model, continuation_input_ids(kv_dir), 16, cache=cache)
    assert got == expected[1:]


def test_continue_from_equals_one_prefill(model_a, tmp_path):
    _, container = model_a
    ids = _ids(70, 1)
    whole = prefill(container, ids, PrefillOptions())
    first = str(tmp_path / "first")
    prefill(container, ids[:33], PrefillOptions(), kv_out=first)
    second = str(tmp_path / "second")
    cont = prefill(container, ids[33:], PrefillOptions(), kv_out=second, continue_from=first)
    assert torch.allclose(cont.logits, whole.logits, atol=1e-5 * whole.logits.abs().max().item())
    kv = K.read_kv(second, expect_prompt=ids.tolist())
    assert kv.seen_tokens == 70 and kv.next_token == whole.next_token


def test_kv_from_another_container_is_refused(model_a, tmp_path):
    _, container = model_a
    kv_dir = str(tmp_path / "kv")
    prefill(container, _ids(12, 2), PrefillOptions(), kv_out=kv_dir)
    other = str(tmp_path / "other.moepack")  # same weights, another container (another policy, another index)
    convert_checkpoint(os.path.join(os.path.dirname(container), "A"), other, policy="bf16", progress=False)
    with pytest.raises(FormatError, match="container"):
        prefill(other, _ids(5, 3), PrefillOptions(), continue_from=kv_dir)


def test_cli_kv_out_and_inspect(model_a, tmp_path):
    _, container = model_a
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(json.dumps(_ids(30, 4).tolist()))
    kv_dir = str(tmp_path / "kv")
    runner = CliRunner()
    r = runner.invoke(cli, ["prefill", container, "--token-ids", str(ids_file), "--kv-out", kv_dir, "--json"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(cli, ["kv", "inspect", kv_dir, "--container", container, "--token-ids", str(ids_file),
                            "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    assert report["complete"] and report["tokens"] == 30 and report["num_layers"] == 5
    os.remove(os.path.join(kv_dir, "layer-0002.safetensors"))
    r = runner.invoke(cli, ["kv", "inspect", kv_dir])
    assert r.exit_code == 1 and "layer" in r.output.lower()


def test_kv_onto_a_full_disk_is_one_line_leaves_no_partial_file_and_reads_as_incomplete(model_a, tmp_path):
    """A KV that cannot fit is refused before the prefill. When the disk fills anyway while the KV is written layer
    by layer (the estimate leaves out the files' headers and the manifest): one line naming the file and the cause, exit 1; the layers already written stay; the
    half-written one is removed (it would hold the space); the directory says it is incomplete and a continuation
    from it is refused."""
    _, container = model_a
    with small_disk(tmp_path / "small-disk", "64k") as small:
        long_ids = tmp_path / "long.txt"
        long_ids.write_text(" ".join(str(i) for i in _ids(1000, 5).tolist()))
        kv_dir = os.path.join(small, "kv")
        r = CliRunner().invoke(cli, ["prefill", container, "--token-ids", str(long_ids), "--kv-out", kv_dir])
        assert r.exit_code == 1 and "not enough free space for the KV in " in r.stderr, r.output
        assert not [n for n in os.listdir(kv_dir) if n.startswith("layer-")]  # refused before any layer
        ids = tmp_path / "ids.txt"  # an estimate that fits, then the disk fills anyway
        ids.write_text(" ".join(str(i) for i in _ids(300, 5).tolist()))
        r = CliRunner().invoke(cli, ["prefill", container, "--token-ids", str(ids), "--kv-out", kv_dir])
        assert r.exit_code == 1 and len(r.stderr.strip().splitlines()) == 1, r.output
        assert f"{kv_dir}/" in r.stderr and "cannot write (No space left on device)" in r.stderr
        names = os.listdir(kv_dir)
        assert not [n for n in names if n.endswith(".partial")], names
        assert [n for n in names if n.startswith("layer-")] and "manifest.json" in names  # 64 KiB: some fit
        with pytest.raises(FormatError, match="KV incomplete"):
            K.read_kv(kv_dir)
