"""The KV hand-off through the real path: container -> `moepack prefill --kv-out` -> transformers decodes on."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("transformers")
from containers import small_disk  # noqa: E402
from v4_models import build  # noqa: E402

from moepack.cli.main import cli  # noqa: E402
from moepack.families.deepseek_v4 import kv as K  # noqa: E402
from moepack.format_spec.errors import FormatError, MoepackError  # noqa: E402
from moepack.kv import continuation_input_ids, load_transformers_cache  # noqa: E402
from moepack.packer.convert import convert_checkpoint  # noqa: E402
from moepack.runtime.engine import PrefillOptions, prefill  # noqa: E402


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
        r = CliRunner().invoke(cli, ["prefill", container, "--token-ids", str(long_ids), "--kv-out", kv_dir,
                                     "-c", "1000"])  # past the model's context of 256: the cap raised
        assert r.exit_code == 1 and "not enough free space for the KV in " in r.stderr, r.output
        assert not os.path.exists(kv_dir)  # refused before anything is written
        ids = tmp_path / "ids.txt"  # an estimate that fits, then the disk fills anyway
        ids.write_text(" ".join(str(i) for i in _ids(300, 5).tolist()))
        r = CliRunner().invoke(cli, ["prefill", container, "--token-ids", str(ids), "--kv-out", kv_dir, "-c", "1000"])
        assert r.exit_code == 1 and len(r.stderr.strip().splitlines()) == 1, r.output
        assert f"{kv_dir}/" in r.stderr and "cannot write (No space left on device)" in r.stderr
        names = os.listdir(kv_dir)
        assert not [n for n in names if n.endswith(".partial")], names
        assert [n for n in names if n.startswith("layer-")] and "manifest.json" in names  # 64 KiB: some fit
        with pytest.raises(FormatError, match="KV incomplete"):
            K.read_kv(kv_dir)


# ---------------------------------------------------------------------------------------------------------------
# Replacing a KV (continuing one in place, --force): the old one stays usable until the new one is complete
# ---------------------------------------------------------------------------------------------------------------


def _files(kv_dir) -> dict[str, bytes]:
    return {name: open(os.path.join(kv_dir, name), "rb").read() for name in sorted(os.listdir(kv_dir))}


def _write_ids(path, ids) -> str:
    path.write_text(" ".join(str(i) for i in ids.tolist()))
    return str(path)


def _kept(kv_dir, before, container, more, expected_logits) -> None:
    """`kv_dir` holds exactly the KV it held, nothing is left beside it, and it continues to the same logits."""
    assert _files(kv_dir) == before
    assert sorted(os.listdir(os.path.dirname(kv_dir))) in (["kv"], ["filler", "kv"])
    again = prefill(container, more, PrefillOptions(), continue_from=kv_dir)
    assert torch.equal(again.logits, expected_logits)


def test_continuing_a_kv_in_place_on_a_full_disk_keeps_the_old_kv(model_a, tmp_path, monkeypatch):
    """`prefill` and `generate --continue-from D --kv-out D` on a disk without room for the new KV: one line, and D
    still loads and continues to the same logits. Refused before any work by the estimate; and when the disk
    fills during the write anyway (the estimate taken away), the new KV is abandoned at the first failed write."""
    _, container = model_a
    ids = _ids(60, 6)
    more = _write_ids(tmp_path / "more.txt", ids[30:])
    with small_disk(tmp_path / "small-disk", "2M") as small:
        kv_dir = os.path.join(small, "kv")
        prefill(container, ids[:30], PrefillOptions(), kv_out=kv_dir)
        with open(os.path.join(kv_dir, "notes.txt"), "w") as f:
            f.write("the user's")
        before = _files(kv_dir)
        expected = prefill(container, ids[30:], PrefillOptions(), continue_from=kv_dir).logits
        config = K.KVDirectory(kv_dir).identity["config"]
        room = K.kv_bytes(config, 61) // 2  # half the new KV (61: generate's 60 + one generated)
        free = os.statvfs(small).f_bavail * os.statvfs(small).f_frsize
        with open(os.path.join(small, "filler"), "wb") as f:
            f.write(b"\0" * (free - room))
        commands = (["prefill", container, "--token-ids", more],
                    ["generate", container, "--token-ids", more, "--max-new-tokens", "2", "--cache-gib", "0"])
        for command in commands:
            r = CliRunner().invoke(cli, [*command, "--continue-from", kv_dir, "--kv-out", kv_dir])
            assert r.exit_code == 1, r.output
            errors = [line for line in r.stderr.splitlines() if line.startswith("moepack: error")]
            assert len(errors) == 1 and "not enough free space for " in errors[0] and \
                "new KV beside the old one" in errors[0], r.stderr
            _kept(kv_dir, before, container, ids[30:], expected)
        monkeypatch.setattr(K, "check_free_space", lambda needs, what: {})  # the disk fills after the check
        for command in commands:
            r = CliRunner().invoke(cli, [*command, "--continue-from", kv_dir, "--kv-out", kv_dir])
            assert r.exit_code == 1, r.output
            errors = [line for line in r.stderr.splitlines() if line.startswith("moepack: error")]
            assert len(errors) == 1, r.stderr
            assert f"{kv_dir}: cannot write the new KV's " in errors[0] and "(No space left on device) (disk full)" \
                in errors[0] and errors[0].endswith("the KV there is unchanged"), errors[0]
            _kept(kv_dir, before, container, ids[30:], expected)
        os.remove(os.path.join(small, "filler"))  # with room: it is replaced, the user's file carried over
        r = CliRunner().invoke(cli, ["prefill", container, "--token-ids", more, "--continue-from", kv_dir,
                                     "--kv-out", kv_dir])
        assert r.exit_code == 0, r.output
        assert sorted(os.listdir(small)) == ["kv"]
        assert K.read_kv(kv_dir, expect_prompt=ids.tolist()).seen_tokens == 60
        assert open(os.path.join(kv_dir, "notes.txt")).read() == "the user's"
        shutil.rmtree(kv_dir)  # a KV right in a mount point cannot be swapped out: refused, before any work
        prefill(container, ids[:30], PrefillOptions(), kv_out=small)
        with pytest.raises(MoepackError, match=f"^{small} is a mount point: a KV is replaced by renaming"):
            prefill(container, ids[30:], PrefillOptions(), kv_out=small, continue_from=small)
        assert K.read_kv(small).seen_tokens == 30 and not os.path.exists(K.replacement_paths(small)[0])


def test_a_replaced_kv_stays_until_the_new_one_is_complete(model_a, tmp_path, monkeypatch):
    """Without a small disk (a write that raises ENOSPC part-way, an interrupted prefill): continuing in place and
    `--kv-out D --force` over another KV leave D as it was and nothing beside it. A stale new directory of a killed
    run is removed by the next write; the swap works by the atomic exchange and by the two-rename fallback, and a
    fallback killed between its renames is undone by the next write."""
    import errno

    import moepack.format_spec.writer as W

    _, container = model_a
    ids = _ids(40, 8)
    kv_dir = str(tmp_path / "kv")
    prefill(container, ids[:25], PrefillOptions(), kv_out=kv_dir)
    before = _files(kv_dir)
    expected = prefill(container, ids[25:], PrefillOptions(), continue_from=kv_dir).logits
    real_write = K.write_file_atomically
    writes = []

    def disk_fills_at_the_third_write(path, data, sync=True):
        writes.append(path)
        if len(writes) == 3:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_write(path, data, sync)

    monkeypatch.setattr(K, "write_file_atomically", disk_fills_at_the_third_write)
    for kwargs in ({"continue_from": kv_dir, "token_ids": ids[25:]}, {"kv_overwrite": True, "token_ids": _ids(9, 9)}):
        writes.clear()
        with pytest.raises(MoepackError) as e:
            prefill(container, kwargs.pop("token_ids"), PrefillOptions(), kv_out=kv_dir, **kwargs)
        assert str(e.value).startswith(f"{kv_dir}: cannot write the new KV's ") and "(disk full)" in str(e.value)
        assert all(os.path.dirname(p) == os.path.join(str(tmp_path), ".kv.kv-new") for p in writes)  # beside
        _kept(kv_dir, before, container, ids[25:], expected)
    monkeypatch.setattr(K, "write_file_atomically", real_write)

    def interrupted(layer, state):
        if layer == 2:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        prefill(container, ids[25:], PrefillOptions(), on_layer_kv=interrupted, kv_out=kv_dir, continue_from=kv_dir)
    _kept(kv_dir, before, container, ids[25:], expected)

    stale_new, stale_old = K.replacement_paths(kv_dir)  # a run killed while writing the new KV left it
    os.makedirs(stale_new)
    open(os.path.join(stale_new, "layer-0000.safetensors"), "wb").close()
    result = prefill(container, ids[25:], PrefillOptions(), kv_out=kv_dir, continue_from=kv_dir)
    assert torch.equal(result.logits, expected) and sorted(os.listdir(tmp_path)) == ["kv"]
    assert K.read_kv(kv_dir, expect_prompt=ids.tolist()).next_token == result.next_token

    monkeypatch.setattr(W, "exchange_paths", lambda a, b: False)  # no renameat2: two renames
    fresh = prefill(container, ids[:25], PrefillOptions(), kv_out=kv_dir, kv_overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["kv"] and _files(kv_dir) != before
    assert K.read_kv(kv_dir, expect_prompt=ids[:25].tolist()).next_token == fresh.next_token
    fresh_files = _files(kv_dir)
    os.rename(kv_dir, stale_old)  # killed between the fallback's two renames: the old KV is put back
    os.makedirs(stale_new)
    K.clean_interrupted_replacement(kv_dir)
    assert _files(kv_dir) == fresh_files and sorted(os.listdir(tmp_path)) == ["kv"]
    shutil.copytree(kv_dir, stale_old)  # killed after them: the old one is removed
    K.clean_interrupted_replacement(kv_dir)
    assert _files(kv_dir) == fresh_files and sorted(os.listdir(tmp_path)) == ["kv"]
