"""Lossless pack (`moepack convert SRC -o OUT --keep`): every tensor keeps its exact source bytes, in read order."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct

import pytest
import torch

from containers import kill_convert_at_random_points, source_reads_fail_at
from moepack.families.deepseek_v4.names import from_transformers
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.reader import Container
from moepack.format_spec.verify import verify_container
from moepack.packer.convert import convert_checkpoint
from moepack.packer.source import CheckpointDir
from moepack.packer.synth import synth_checkpoint


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("src") / "tiny-release")
    synth_checkpoint(d, preset="tiny", layout="release", seed=1, progress=False)
    return d


@pytest.fixture(scope="module")
def packed(release_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("out") / "tiny.moepack")
    summary = convert_checkpoint(release_dir, out, policy="keep", progress=False)
    return out, summary


def test_every_tensor_bit_exact(release_dir, packed):
    out, summary = packed
    src = CheckpointDir(release_dir)
    with Container(out) as c:
        assert len(c.tensors) == len(src.tensors) == summary["tensors"]
        for name, t in src.tensors.items():
            entry = c.tensors[from_transformers(name)]
            assert c.tensor_bytes(entry.name) == src.read(t), name
            if entry.dtype == "FP4_E2M1":  # packed FP4 keeps its bytes, with its logical shape
                assert t.dtype == "I8" and entry.shape == (*t.shape[:-1], 2 * t.shape[-1])
            else:
                assert entry.dtype == t.dtype and entry.shape == t.shape
    src.close()
    verify_container(out)


def test_release_types_and_read_order(packed, release_dir):
    out, _ = packed
    config = json.load(open(os.path.join(release_dir, "config.json")))
    with Container(out) as c:
        assert c.config == config
        assert len(c.layers) == config["num_hidden_layers"]
        assert all(len(b.experts) == config["n_routed_experts"] for b in c.blocks)
        assert sum(b.section == "mtp" for b in c.blocks) == config.get("num_nextn_predict_layers", 0)
        assert c.global_regions[0].name == "global.embed.weight"
        types = {t.dtype for t in c.tensors.values()}
        assert {"F8_E4M3", "F8_E8M0", "FP4_E2M1", "BF16", "F32", "I64"} <= types
        for block in c.blocks:
            names = [t.name for t in block.experts[0].tensors]
            suffixes = [n.split("experts.0.")[1] for n in names]
            assert suffixes == ["w1.weight", "w1.scale", "w3.weight", "w3.scale", "w2.weight", "w2.scale"]
            # the dense region holds no routed expert, the expert regions nothing else
            assert not any(".experts." in t.name for t in block.dense.tensors)
        assert "tokenizer.json" in c.index["tokenizer"]
        assert c.policy["name"] == "keep"


def test_deterministic_output(release_dir, packed, tmp_path):
    again = str(tmp_path / "again.moepack")
    convert_checkpoint(release_dir, again, policy="keep", progress=False)
    assert open(again, "rb").read() == open(packed[0], "rb").read()


def test_transformers_save_pretrained_names_are_canonicalised(tmp_path):
    transformers = pytest.importorskip("transformers")
    from moepack.packer.synth import synth_checkpoint as synth

    src = str(tmp_path / "f32")
    synth(src, preset="tiny", layout="f32", seed=0, progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    saved = str(tmp_path / "saved")
    model.save_pretrained(saved)
    out = str(tmp_path / "saved.moepack")
    convert_checkpoint(saved, out, policy="keep", progress=False)
    with Container(out) as c:
        for name in ("embed.weight", "head.weight", "norm.weight", "hc_head_fn", "layers.0.ffn.experts.0.w1.weight"):
            assert name in c.tensors, name
        embed = c.read_tensor("embed.weight")
        assert torch.equal(embed, model.model.embed_tokens.weight.detach())


def test_a_config_that_counts_other_layers_than_the_tensors_is_refused_before_converting(release_dir, tmp_path):
    """num_hidden_layers that disagrees with the checkpoint's layers: refused before any work, and never a file
    under the final name that the reader would then refuse (the writer checks it too)."""
    import json

    from moepack.format_spec.writer import ContainerWriter

    src = str(tmp_path / "src")
    shutil.copytree(release_dir, src)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    layers = config["num_hidden_layers"]
    config["num_hidden_layers"] = layers - 1
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(config, f)
    out = str(tmp_path / "x.moepack")
    with pytest.raises(MoepackError, match=f"config has {layers - 1} layers but the container holds {layers}"):
        convert_checkpoint(src, out, progress=False)
    assert not os.path.exists(out)
    writer = ContainerWriter(out)
    writer.begin_region("dense", block="layers.0")
    writer.add_tensor("layers.0.attn_norm.weight", "F32", [4], bytes(16))
    writer.end_region()
    with pytest.raises(MoepackError, match="config has 2 layers but the container holds 1"):
        writer.finish(config={"num_hidden_layers": 2}, architecture="deepseek_v4", policy={})
    writer.abort()
    assert not os.path.exists(out)


@pytest.mark.parametrize("change, named", [
    ({"weight_block_size": [64, 64]}, "quantization_config weight_block_size [64, 64] fmt 'e4m3': only e4m3 in "
                                      "[128, 128] blocks"),
    ({"fmt": "e5m2"}, "quantization_config weight_block_size [128, 128] fmt 'e5m2'"),
    ({"quant_method": "awq"}, "quantization_config.quant_method 'awq': only the release's fp8"),
], ids=["block-64", "e5m2", "awq"])
def test_a_quantization_the_converter_cannot_read_is_refused_in_one_line(release_dir, tmp_path, change, named):
    """A DeepSeek-V4 quantization_config other than the release's (FP8 e4m3 in 128x128 blocks): `convert` refuses
    it in one line naming the field and what it reads, writing nothing (it converted, and prefill then failed on
    scales that did not fit their weights)."""
    from click.testing import CliRunner

    from moepack.cli.main import cli

    src = str(tmp_path / "src")
    shutil.copytree(release_dir, src)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"].update(change)
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(config, f)
    out = str(tmp_path / "x.moepack")
    r = CliRunner().invoke(cli, ["convert", src, "-o", out, "--keep"])
    assert r.exit_code == 1 and named in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not os.path.exists(out)


def test_missing_shard_and_bad_sources(release_dir, tmp_path):
    broken = str(tmp_path / "broken")
    shutil.copytree(release_dir, broken)
    shards = sorted(f for f in os.listdir(broken) if f.endswith(".safetensors"))
    os.remove(os.path.join(broken, shards[-1]))
    with pytest.raises(MoepackError, match=f"shard {shards[-1]}"):
        convert_checkpoint(broken, str(tmp_path / "x.moepack"), progress=False)
    assert not os.path.exists(tmp_path / "x.moepack")

    truncated = str(tmp_path / "truncated")
    shutil.copytree(release_dir, truncated)
    p = os.path.join(truncated, shards[0])
    os.truncate(p, os.path.getsize(p) - 100)
    with pytest.raises(MoepackError, match="truncated"):
        convert_checkpoint(truncated, str(tmp_path / "y.moepack"), progress=False)

    with pytest.raises(MoepackError, match="missing config.json"):
        convert_checkpoint(str(tmp_path), str(tmp_path / "z.moepack"), progress=False)

    other = str(tmp_path / "other")
    shutil.copytree(release_dir, other)
    cfg = json.load(open(os.path.join(other, "config.json")))
    cfg["model_type"] = "llama"
    json.dump(cfg, open(os.path.join(other, "config.json"), "w"))
    with pytest.raises(MoepackError, match="unsupported architecture"):
        convert_checkpoint(other, str(tmp_path / "w.moepack"), progress=False)


def test_a_folder_of_numbered_shards_without_an_index_names_the_missing_one(release_dir, tmp_path):
    """No index to list the shards, one of model-0000K-of-0000N gone (a partial copy): the converter said only that
    a layer lacks experts."""
    partial = str(tmp_path / "partial")
    shutil.copytree(release_dir, partial)
    os.remove(os.path.join(partial, "model.safetensors.index.json"))
    shards = sorted(f for f in os.listdir(partial) if f.endswith(".safetensors"))
    assert len(shards) > 2
    os.remove(os.path.join(partial, shards[1]))
    with pytest.raises(MoepackError, match=f"shard {shards[1]} is missing"):
        convert_checkpoint(partial, str(tmp_path / "x.moepack"), progress=False)


@pytest.mark.parametrize("shard, named", [
    ({"a": 1}, "weight_map lists {'a': 1} as a shard"), (7, "weight_map lists 7 as a shard"),
    (None, "weight_map lists None as a shard"),
    ("", "lists shard '' outside the checkpoint directory"), ("../x.safetensors", "outside the checkpoint"),
    ("x\u0000.safetensors", "cannot open (not a file name this system can have)")],
    ids=["an object", "a number", "null", "empty", "a path", "a NUL"])
def test_an_index_listing_what_is_no_shard_name_is_refused(release_dir, tmp_path, shard, named):
    """(Found by fuzzing.) A weight_map value that is no string was sorted among the shard names: a TypeError; one
    holding a NUL reached os.open: a ValueError."""
    src = str(tmp_path / "src")
    shutil.copytree(release_dir, src)
    path = os.path.join(src, "model.safetensors.index.json")
    index = json.load(open(path))
    index["weight_map"][next(iter(index["weight_map"]))] = shard
    json.dump(index, open(path, "w"))
    with pytest.raises(MoepackError, match=re.escape(named)):
        CheckpointDir(src)  # as `moepack plan DIR` reads it
    with pytest.raises(MoepackError, match="model.safetensors.index.json"):
        convert_checkpoint(src, str(tmp_path / "x.moepack"), progress=False)
    assert not os.path.exists(tmp_path / "x.moepack")


def _edit_header(path: str, edit) -> None:
    """A shard's safetensors header changed by `edit(header)` in place, re-padded to its length."""
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack_from("<Q", data)[0]
    header = json.loads(data[8:8 + n])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(text) == n
    with open(path, "wb") as f:
        f.write(data[:8] + text + data[8 + n:])


def _shift_tensor_data(path: str, which: int, by: int) -> None:
    """Move the data offsets of the shard's `which`-th tensor (in data order) by `by` bytes."""
    def shift(header):
        name = sorted((v["data_offsets"], k) for k, v in header.items() if k != "__metadata__")[which][1]
        header[name]["data_offsets"] = [o + by for o in header[name]["data_offsets"]]

    _edit_header(path, shift)


@pytest.mark.parametrize("damage, named", [
    (lambda p: _shift_tensor_data(p, 1, -2), "overlaps the tensor before it"),
    (lambda p: _shift_tensor_data(p, 0, 2), "leaves 2 bytes before it"),
    (lambda p: open(p, "ab").write(b"\0" * 16), "16 bytes after the last tensor's data")],
    ids=["overlap", "gap", "trailing bytes"])
def test_a_shard_whose_tensors_do_not_tile_its_data_is_refused(release_dir, tmp_path, damage, named):
    """(Found while fuzzing convert: mutants with moved data_offsets converted, which the harness cannot judge.)
    Tensors sharing bytes, or bytes between or after them: the safetensors library (so transformers) refuses such
    a file, but convert converted it."""
    src = str(tmp_path / "src")
    shutil.copytree(release_dir, src)
    shard = os.path.join(src, sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))[0])
    damage(shard)
    with pytest.raises(MoepackError, match=re.escape(named)):
        convert_checkpoint(src, str(tmp_path / "x.moepack"), progress=False)
    assert not os.path.exists(tmp_path / "x.moepack")


@pytest.mark.parametrize("tensor, entry, named", [
    ("layers.0.attn.wq_a.scale", {"shape": [4]}, "layers.0.attn.wq_a.scale is F8_E8M0[4], but "
     "layers.0.attn.wq_a.weight (F8_E4M3[256, 256]) takes a block scale of [2, 2] in F8_E8M0 or F32 or BF16 or F16"),
    ("layers.0.ffn.experts.0.w2.scale", {"shape": [8, 256]}, "takes a block scale of [256, 8] in F8_E8M0"),
    ("layers.0.ffn.experts.0.w2.scale", {"dtype": "F8_E4M3"}, "is F8_E4M3[256, 8], but"),
    ("mtp.0.attn.wq_a.weight", {"shape": [256, 256, 1]},
     "tensor mtp.0.attn.wq_a.weight is F8_E4M3[256, 256, 1] beside a block scale: a block-scaled weight is 2-D")],
    ids=["FP8 scale of another shape", "FP4 scale transposed", "FP4 scale of another type", "a 3-D MTP weight"])
def test_a_block_scale_its_weight_cannot_take_is_refused(release_dir, tmp_path, tensor, entry, named):
    """(Found by fuzzing convert.) A block scale of another shape or type than its weight's decoding takes (the
    same bytes), or a block-scaled weight that is not 2-D (an MTP layer's, whose shapes nothing else checks):
    --keep stored both as they were, verify found nothing, and a prefill or verify --source refused the weight."""
    src = str(tmp_path / "src")
    shutil.copytree(release_dir, src)
    shard = next(os.path.join(src, n) for n in sorted(os.listdir(src)) if n.endswith(".safetensors")
                 and tensor.encode() in open(os.path.join(src, n), "rb").read(1 << 20))
    _edit_header(shard, lambda header: header[tensor].update(entry))
    with pytest.raises(MoepackError, match=re.escape(named)):
        convert_checkpoint(src, str(tmp_path / "x.moepack"), policy="keep", progress=False)
    assert not os.path.exists(tmp_path / "x.moepack")


def test_existing_output_survives_a_failed_convert(release_dir, packed, tmp_path):
    out = str(tmp_path / "keep.moepack")
    shutil.copy(packed[0], out)
    before = open(out, "rb").read()
    with source_reads_fail_at(20, MoepackError("simulated read failure")), \
            pytest.raises(MoepackError, match="simulated"):
        convert_checkpoint(release_dir, out, progress=False)
    assert open(out, "rb").read() == before
    assert os.path.exists(out + ".partial")  # kept for a later resume, never under the final name


def test_interrupted_convert_resumes_to_identical_bytes(release_dir, packed, tmp_path):
    out = str(tmp_path / "resume.moepack")
    with source_reads_fail_at(150, KeyboardInterrupt()), pytest.raises(KeyboardInterrupt):
        convert_checkpoint(release_dir, out, progress=False)  # as if the process were stopped mid-layer
    assert not os.path.exists(out) and os.path.exists(out + ".partial.journal")
    summary = convert_checkpoint(release_dir, out, progress=False)
    assert summary["resumed_regions"] > 0
    assert open(out, "rb").read() == open(packed[0], "rb").read()
    assert not os.path.exists(out + ".partial") and not os.path.exists(out + ".partial.journal")


def test_kill_9_at_random_points_then_rerun_is_byte_identical(release_dir, packed, tmp_path):
    """Real SIGKILLs at random moments of a conversion, each followed by the same command again (which may be
    killed in turn); the final name never holds a partial file and the finished file equals an uninterrupted
    run's."""
    out = str(tmp_path / "killed.moepack")

    def after_kill():
        assert os.path.exists(out + ".partial"), "a killed run keeps its partial output for the next one"

    kills = kill_convert_at_random_points(f"{release_dir!r}, {out!r}, progress=False", out, 1234, after_kill)
    assert kills >= 1
    if not os.path.exists(out):
        journaled = os.path.exists(out + ".partial.journal")
        summary = convert_checkpoint(release_dir, out, progress=False)
        assert summary["resumed_regions"] > 0 or not journaled
    assert open(out, "rb").read() == open(packed[0], "rb").read()
