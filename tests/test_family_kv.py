"""A model family's KV directory (format_spec/KV.md, section 9; issue 39), Qwen3-MoE first: `moepack prefill
--kv-out` on a prompt A, then `moepack generate --continue-from` with a prompt B gives the greedy tokens of A + B
(transformers' `generate` of A + B); `generate --kv-out` hands its KV on; --kv-dtype stores the keys and values as
asked; a KV of another container, a truncated or damaged layer file, is one line. The directory's container part is
every family's (families/kv_directory.py), the layer files the family's (families/qwen3_moe/kv.py)."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from click.testing import CliRunner

from moepack.cli.main import cli
from moepack.families import family_named, kv_directory as kvd
from moepack.families.base import KVFormat, family_kv_format
from moepack.format_spec.errors import FormatError, MoepackError
from moepack.runtime.engine import PrefillOptions, prefill

transformers = pytest.importorskip("transformers")
from test_qwen3_moe import CONFIGS, reference, save_model  # noqa: E402

FAMILY = family_named("qwen3-moe")
KV_FORMAT = family_kv_format(FAMILY)
A = [5, 17, 42, 250, 3, 99, 7, 128, 64, 11, 200]
B = [31, 8, 144, 2, 77]
NEW_TOKENS = 6
F32 = ["--compute-dtype", "float32"]


@pytest.fixture(scope="module")
def containers(tmp_path_factory):
    """{name: (container, transformers' float32 model)}: a Qwen3-MoE with dense-MLP layers and one with a tied head
    (MHA), random float32 weights, converted --keep."""
    from moepack.packer.convert import convert_checkpoint

    base = tmp_path_factory.mktemp("family-kv")
    out = {}
    for name in ("sparse-step", "mha-tied"):
        hf = save_model(base / name, CONFIGS[name], torch.float32)
        out[name] = str(base / f"{name}.moepack"), hf.eval()
        convert_checkpoint(str(base / name), out[name][0], policy="keep", progress=False)
    return out


def _ids_file(path, ids) -> str:
    path.write_text(json.dumps(list(ids)))
    return str(path)


def _run(*args) -> dict:
    r = CliRunner().invoke(cli, [*map(str, args), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _refused(*args) -> str:
    """The one error line of a command that must fail."""
    r = CliRunner().invoke(cli, list(map(str, args)))
    assert r.exit_code == 1, r.output
    errors = [line for line in r.stderr.splitlines() if line.startswith("moepack: error")]
    assert len(errors) == 1 and "Traceback" not in r.output, r.output
    return errors[0]


def _greedy(hf, ids, new=NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return out[0, len(ids):].tolist()


def _generate(container, tmp_path, *args) -> list[int]:
    return _run("generate", container, "--max-new-tokens", NEW_TOKENS, "--temperature", 0, "--cache-gib", 0, *F32,
                *args)["generated_ids"]


def _continue(container, kv_dir) -> list[int]:
    """The greedy tokens after a KV, without a prompt: the command needs no tokenizer for none (these containers
    carry none)."""
    return _generate(container, None, "--continue-from", kv_dir)


def test_qwen3_moe_has_a_kv_format():
    assert isinstance(KV_FORMAT, KVFormat) and KV_FORMAT.entry_fields == ("seen_tokens",)


@pytest.mark.parametrize("name", ["sparse-step", "mha-tied"])
def test_prefill_kv_out_then_generate_continue_from_gives_the_whole_prompts_tokens(containers, tmp_path, name):
    container, hf = containers[name]
    kv_dir = tmp_path / "kv"
    done = _run("prefill", container, "--token-ids", _ids_file(tmp_path / "a.json", A), "--kv-out", kv_dir, *F32)
    assert done["kv_out"] == str(kv_dir) and done["kv_bytes"] > 0
    manifest = json.loads((kv_dir / kvd.MANIFEST_NAME).read_text())
    assert manifest["identity"]["architecture"] == "qwen3_moe" and manifest["tokens"]["ids"] == A
    assert manifest["complete"] and all(e["complete"] and e["seen_tokens"] == len(A) for e in manifest["layers"])
    want = _greedy(hf, A + B)
    continued = _generate(container, tmp_path, "--token-ids", _ids_file(tmp_path / "b.json", B), "--continue-from",
                          kv_dir)
    whole = _generate(container, tmp_path, "--token-ids", _ids_file(tmp_path / "ab.json", A + B))
    assert continued == whole == want
    # no prompt: the KV's own last logits give the first token, A's greedy continuation
    assert _continue(container, kv_dir) == _greedy(hf, A)


def test_a_continued_prefill_written_in_place_equals_one_prefill_of_the_whole(containers, tmp_path):
    container, _ = containers["sparse-step"]
    kv_dir, whole_dir = str(tmp_path / "kv"), str(tmp_path / "whole")
    options = PrefillOptions(compute_dtype="float32")
    handed = []  # the layer-by-layer hand-off beside the writer, and without one
    prefill(container, A, options, kv_out=kv_dir, on_layer_kv=lambda layer, state: handed.append(layer))
    prefill(container, A, options, on_layer_kv=lambda layer, state: handed.append(state.length))
    assert handed == [0, 1, 2, 3] + [len(A)] * 4
    continued = prefill(container, B, options, kv_out=kv_dir, continue_from=kv_dir)
    whole = prefill(container, A + B, options, kv_out=whole_dir)
    assert continued.next_token == whole.next_token and continued.stats["past_tokens"] == len(A)
    torch.testing.assert_close(continued.logits, whole.logits, atol=1e-4, rtol=0)
    got, want = kvd.read_kv(kv_dir, KV_FORMAT), kvd.read_kv(whole_dir, KV_FORMAT)
    assert got.token_ids == A + B and got.start_token == len(A) and got.next_token == whole.next_token
    for mine, theirs in zip(got.layers, want.layers):
        assert mine.keys.shape == (2, len(A) + len(B), 32)
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-4, rtol=0)
        torch.testing.assert_close(mine.values, theirs.values, atol=1e-4, rtol=0)


def test_generate_kv_out_hands_its_kv_to_the_next_generation(containers, tmp_path):
    container, hf = containers["mha-tied"]
    kv_dir = tmp_path / "kv"
    first = _generate(container, tmp_path, "--token-ids", _ids_file(tmp_path / "a.json", A), "--kv-out", kv_dir)
    kv = kvd.read_kv(str(kv_dir), KV_FORMAT)
    whole = _greedy(hf, A, 2 * NEW_TOKENS)
    assert kv.token_ids == A + first and kv.next_token == whole[NEW_TOKENS]  # every token given out is fed
    assert first + _continue(container, kv_dir) == whole
    # a next turn's prompt goes on after the last generated token, as one generation over all of it
    continued = _generate(container, tmp_path, "--token-ids", _ids_file(tmp_path / "b.json", B), "--continue-from",
                          kv_dir)
    assert continued == _greedy(hf, A + first + B)


@pytest.mark.parametrize("dtype,storage,tolerance", [("bfloat16", "BF16", 1e-2), ("float8_e4m3", "F8_E4M3", 0.07)])
def test_kv_dtype_stores_the_keys_and_values_as_asked(containers, tmp_path, dtype, storage, tolerance):
    container, _ = containers["sparse-step"]
    ids = _ids_file(tmp_path / "a.json", A)
    _run("prefill", container, "--token-ids", ids, "--kv-out", tmp_path / "f32", *F32)
    _run("prefill", container, "--token-ids", ids, "--kv-out", tmp_path / "low", "--kv-dtype", dtype, *F32)
    full, low = (kvd.read_kv(str(tmp_path / d), KV_FORMAT) for d in ("f32", "low"))
    assert low.dtype == storage and low.bytes < full.bytes
    with open(tmp_path / "low" / kvd.layer_file_name(0), "rb") as f:
        from safetensors.torch import load

        stored = load(f.read())
    assert stored["keys"].dtype == kvd.TORCH_DTYPES[storage] and ("keys.scale" in stored) == (storage == "F8_E4M3")
    for a, b in zip(full.layers, low.layers):
        assert b.keys.dtype == torch.float32
        scale = a.keys.abs().amax(dim=-1, keepdim=True)
        assert ((a.keys - b.keys).abs() <= tolerance * scale).all()
        if storage == "BF16":
            assert torch.equal(b.values, a.values.to(torch.bfloat16).float())
    # a continuation from the rounded KV runs (its own prompt's tokens)
    assert len(_generate(container, tmp_path, "--token-ids", _ids_file(tmp_path / "b.json", B), "--continue-from",
                         tmp_path / "low")) == NEW_TOKENS


def test_a_kv_of_another_container_is_refused(containers, tmp_path):
    (one, _), (other, _) = containers["sparse-step"], containers["mha-tied"]
    kv_dir = tmp_path / "kv"
    prefill(one, A, PrefillOptions(compute_dtype="float32"), kv_out=str(kv_dir))
    b = _ids_file(tmp_path / "b.json", B)
    for command in (["generate", other, "--token-ids", b, "--max-new-tokens", 2, "--cache-gib", 0],
                    ["prefill", other, "--token-ids", b]):
        error = _refused(*command, "--continue-from", kv_dir)
        assert f"{kv_dir}: KV from another model: config xxh3 " in error, error  # (its config first)
    # another family's KV (DeepSeek-V4's: its config no Qwen3-MoE config) is named as another model's, not by what
    # its config lacks for this family's format
    manifest = json.loads((kv_dir / kvd.MANIFEST_NAME).read_text())
    config = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "num_hidden_layers": 4}
    manifest["identity"].update(architecture="deepseek_v4", config=config, config_xxh3=kvd.config_xxh3(config))
    (kv_dir / kvd.MANIFEST_NAME).write_text(json.dumps(manifest))
    for command in (["generate", one, "--token-ids", b, "--max-new-tokens", 2, "--cache-gib", 0],
                    ["prefill", one, "--token-ids", b]):
        error = _refused(*command, "--continue-from", kv_dir)
        assert f"{kv_dir}: KV from another model: architecture 'deepseek_v4', expected 'qwen3_moe'" in error, error


def test_a_truncated_or_damaged_layer_file_is_refused(containers, tmp_path):
    container, _ = containers["sparse-step"]
    kv_dir = tmp_path / "kv"
    prefill(container, A, PrefillOptions(compute_dtype="float32"), kv_out=str(kv_dir))
    b = _ids_file(tmp_path / "b.json", B)
    layer = kv_dir / kvd.layer_file_name(1)
    data = layer.read_bytes()
    layer.write_bytes(data[:-100])
    error = _refused("generate", container, "--token-ids", b, "--continue-from", kv_dir, "--cache-gib", 0)
    assert f"{kv_dir}: layer 1: file layer-0001.safetensors is truncated ({len(data) - 100} of {len(data)} bytes)" \
        in error, error
    damaged = bytearray(data)
    damaged[-7] ^= 0x40
    layer.write_bytes(bytes(damaged))
    error = _refused("prefill", container, "--token-ids", b, "--continue-from", kv_dir)
    assert f"{kv_dir}: layer 1: file layer-0001.safetensors is damaged (xxh3 mismatch)" in error, error
    layer.write_bytes(data)
    assert kvd.read_kv(str(kv_dir), KV_FORMAT).seen_tokens == len(A)


def test_a_layer_file_whose_tensors_are_not_the_formats_is_refused(containers, tmp_path):
    """The family's check of a file whose size and xxh3 agree with the manifest (a writer's bug, not damage)."""
    from safetensors.torch import save

    import xxhash

    container, _ = containers["sparse-step"]
    kv_dir = tmp_path / "kv"
    prefill(container, A, PrefillOptions(compute_dtype="float32"), kv_out=str(kv_dir))
    manifest = json.loads((kv_dir / kvd.MANIFEST_NAME).read_text())
    for tensors, problem in (({"keys": torch.zeros(2, len(A), 32)}, "missing values"),
                             ({"keys": torch.zeros(2, len(A), 32), "values": torch.zeros(2, len(A) - 1, 32)},
                              f"values is torch.float32 [2, {len(A) - 1}, 32], expected torch.float32 "
                              f"[2, {len(A)}, 32]")):
        data = save(tensors)
        (kv_dir / kvd.layer_file_name(0)).write_bytes(data)
        manifest["layers"][0].update(bytes=len(data), xxh3=xxhash.xxh3_64_hexdigest(data))
        (kv_dir / kvd.MANIFEST_NAME).write_text(json.dumps(manifest))
        with pytest.raises(FormatError) as e:
            kvd.read_kv(str(kv_dir), KV_FORMAT)
        assert str(e.value).startswith(f"{kv_dir}: layer 0 (layer-0000.safetensors): ") and problem in str(e.value)
        assert "\n" not in str(e.value)


def test_the_writer_refuses_a_state_of_another_shape(containers, tmp_path):
    from moepack.families.qwen3_moe.model import LayerKV

    container, _ = containers["sparse-step"]
    from moepack.format_spec.reader import Container

    with Container(container) as c:
        writer = kvd.KVWriter(str(tmp_path / "kv"), KV_FORMAT, kvd.identity_of_container(c), A)
    with pytest.raises(MoepackError, match=r"^layer 2: keys \[4, 11, 32\], the config implies \[2, 11, 32\]$"):
        writer.write_layer(2, LayerKV(torch.zeros(4, len(A), 32), torch.zeros(4, len(A), 32)))
    with pytest.raises(MoepackError, match=r"^layer 0: state covers 3 tokens, the KV's prompt has 11$"):
        writer.write_layer(0, LayerKV(torch.zeros(2, 3, 32), torch.zeros(2, 3, 32)))


def test_kv_inspect_reads_a_family_kv(containers, tmp_path):
    container, _ = containers["sparse-step"]
    kv_dir = tmp_path / "kv"
    prefill(container, A, PrefillOptions(compute_dtype="float32"), kv_out=str(kv_dir))
    report = _run("kv", "inspect", kv_dir, "--container", container)
    assert report["architecture"] == "qwen3_moe" and report["tokens"] == len(A) and report["complete"]
    assert report["by_type"] == {"attention": {"layers": 4, "bytes": report["bytes"]}}
    assert os.path.getsize(kv_dir / kvd.layer_file_name(3)) == report["layers"][3]["bytes"]


def test_moepack_kv_fills_transformers_cache_from_a_family_kv(containers, tmp_path, monkeypatch):
    """moepack.kv dispatches through the family its manifest names: read_kv and continuation_input_ids read a
    Qwen3-MoE KV, and load_transformers_cache fills transformers' cache from it, so that transformers' own decode
    goes on from moepack's prefill to the tokens it gives over the whole prompt; a model of another shape, or a
    family with no loader, is one line."""
    from moepack import kv as moepack_kv

    container, hf = containers["sparse-step"]
    kv_dir = tmp_path / "kv"
    result = prefill(container, A, PrefillOptions(compute_dtype="float32"), kv_out=str(kv_dir))
    kv = moepack_kv.read_kv(kv_dir, expect_prompt=A)
    assert kv.identity["architecture"] == "qwen3_moe" and kv.token_ids == A and len(kv.layers) == 4
    assert [KV_FORMAT.seen_tokens(state) for state in kv.layers] == [len(A)] * 4
    assert moepack_kv.continuation_input_ids(kv_dir).tolist() == [A + [kv.next_token]]
    assert kv.next_token == result.next_token
    ids = moepack_kv.continuation_input_ids(kv_dir)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), cache=moepack_kv.load_transformers_cache(kv, hf),
                          max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    assert [kv.next_token] + out[0, ids.shape[1]:].tolist() == _greedy(hf, A, NEW_TOKENS + 1)
    with pytest.raises(FormatError, match="KV from another model: num_layers is 4 in the KV, 3 in the transformers"):
        moepack_kv.load_transformers_cache(kv, containers["mha-tied"][1])
    monkeypatch.delattr(type(FAMILY), "transformers_cache")
    with pytest.raises(MoepackError) as refused:
        moepack_kv.load_transformers_cache(kv_dir, hf)
    message = str(refused.value)
    assert "\n" not in message and "moepack.kv fills no transformers cache for this family" in message, message


def test_the_kv_at_a_stop_string_holds_the_shown_tokens(containers, tmp_path):
    """As DeepSeek-V4's (test_generate.py): this family's decode continues its prompt's state in place, so the KV
    of the shown tokens is continued from a copy of that state."""
    from test_generate import check_the_kv_at_a_stop_string_holds_the_shown_tokens

    check_the_kv_at_a_stop_string_holds_the_shown_tokens(containers["sparse-step"][0], A + B, tmp_path)


def test_a_kv_records_its_compute_dtype_and_a_continuation_in_another_is_told(containers, tmp_path):
    """The manifest's extra says what the KV's tokens were computed in; continuing it in another compute dtype
    warns (the logits are then neither dtype's prefill of the whole), the same one does not."""
    container, _ = containers["sparse-step"]
    ids = _ids_file(tmp_path / "a.json", A)
    kv_dir = tmp_path / "kv"
    prefill = CliRunner().invoke(cli, ["prefill", container, "--token-ids", ids, "--kv-out", str(kv_dir),
                                       "--compute-dtype", "bfloat16", "--json"])
    assert prefill.exit_code == 0, prefill.output
    assert json.loads((kv_dir / "manifest.json").read_text())["extra"] == {"compute_dtypes": ["bfloat16"]}
    more = _ids_file(tmp_path / "b.json", B)
    for dtype, warned in (("bfloat16", False), ("float32", True)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            r = CliRunner().invoke(cli, ["generate", container, "--token-ids", more, "--continue-from", str(kv_dir),
                                         "-n", "2", "--compute-dtype", dtype, "--kv-out", str(tmp_path / dtype),
                                         "--json"])
        assert r.exit_code == 0, r.output
        told = [w for w in seen if "the KV was computed in bfloat16; this run computes in float32" in str(w.message)]
        assert len(told) == warned, [str(w.message) for w in seen]
        extra = json.loads((tmp_path / dtype / "manifest.json").read_text())["extra"]
        assert extra == {"compute_dtypes": sorted({"bfloat16", dtype})}
    with warnings.catch_warnings(record=True) as seen:  # a prefill continuing it, as generate
        warnings.simplefilter("always")
        r = CliRunner().invoke(cli, ["prefill", container, "--token-ids", more, "--continue-from", str(kv_dir),
                                     "--compute-dtype", "float32", "--json"])
    assert r.exit_code == 0 and any("this run computes in float32" in str(w.message) for w in seen), r.output
