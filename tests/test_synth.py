"""Synthetic DeepSeek-V4 checkpoints: tensor inventory, layouts, loading in transformers, determinism."""

import json
import re
from pathlib import Path

import pytest
import torch
from containers import small_disk
from safetensors import safe_open

from moepack.families.deepseek_v4.config import CSA, HCA, SLIDING
from moepack.families.deepseek_v4.tensors import (LAYOUTS, ROLE_BF16_LINEAR, ROLE_DENSE_LINEAR, ROLE_EMBEDDING,
                                                  ROLE_EXACT, ROLE_EXPERT, stored_tensors, v4_tensor_specs)
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.source_formats import fp4_dequantize, fp8_block_dequantize
from moepack.packer.synth import PRESETS, TOKENIZER_VOCAB_SIZE, preset_config, synth_checkpoint

REFERENCE_CONFIG = Path(__file__).parent / "data" / "deepseek-v4-flash.config.json"  # the release's config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny preset written once per layout, same seed."""
    root = tmp_path_factory.mktemp("synth")
    return {layout: synth_checkpoint(root / layout, "tiny", layout, seed=0, progress=False) for layout in LAYOUTS}


def _read_all(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(Path(directory).glob("model-*.safetensors")):
        with safe_open(shard, "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def _reference_config() -> dict:
    if not REFERENCE_CONFIG.exists():
        pytest.skip("reference config not present")
    return json.loads(REFERENCE_CONFIG.read_text())


# ------------------------------------------------------------------------------------------ inventory


def test_real_config_matches_the_release_table():
    specs = {s.name: s for s in v4_tensor_specs(_reference_config())}
    expected = {
        "embed.weight": (129280, 4096),
        "head.weight": (129280, 4096),
        "hc_head_fn": (4, 16384),
        "layers.0.hc_attn_fn": (24, 16384),
        "layers.0.attn.wq_a.weight": (1024, 4096),
        "layers.0.attn.wq_b.weight": (32768, 1024),
        "layers.0.attn.wo_a.weight": (8192, 4096),
        "layers.0.attn.wo_b.weight": (4096, 8192),
        "layers.2.attn.compressor.ape": (4, 1024),  # CSA: two overlapping series
        "layers.3.attn.compressor.ape": (128, 512),  # HCA
        "layers.2.attn.indexer.wq_b.weight": (8192, 1024),
        "layers.2.attn.indexer.compressor.ape": (4, 256),
        "layers.0.ffn.gate.tid2eid": (129280, 6),
        "layers.3.ffn.gate.weight": (256, 4096),
        "layers.3.ffn.gate.bias": (256,),
        "layers.3.ffn.experts.255.w1.weight": (2048, 4096),
        "layers.3.ffn.experts.0.w2.weight": (4096, 2048),
        "layers.3.ffn.shared_experts.w1.weight": (2048, 4096),
        "mtp.0.e_proj.weight": (4096, 4096),
        "mtp.0.hc_head_fn": (4, 16384),
        "mtp.0.ffn.gate.bias": (256,),
    }
    assert {name: specs[name].shape for name in expected} == expected
    # Sliding layers (0, 1, 42) have no compressor; HCA layers no indexer; hash layers 0-2 no router bias.
    assert not any(n.startswith(("layers.0.attn.compressor", "layers.42.attn.compressor")) for n in specs)
    assert not any(n.startswith("layers.3.attn.indexer") for n in specs)
    assert "layers.2.ffn.gate.bias" not in specs and "layers.3.ffn.gate.tid2eid" not in specs
    assert "mtp.0.attn.compressor.ape" not in specs  # the MTP block follows the last (sliding) layer

    def stored(name):
        return [(t.dtype, t.shape) for t in stored_tensors(specs[name], "release")]

    assert stored("layers.0.attn.wq_a.weight") == [("F8_E4M3", (1024, 4096)), ("F8_E8M0", (8, 32))]
    assert stored("layers.2.attn.indexer.wq_b.weight")[0] == ("F8_E4M3", (8192, 1024))
    assert stored("layers.3.ffn.experts.0.w1.weight") == [("I8", (2048, 2048)), ("F8_E8M0", (2048, 128))]
    assert stored("layers.3.ffn.experts.0.w2.weight") == [("I8", (4096, 1024)), ("F8_E8M0", (4096, 64))]
    assert stored("layers.2.attn.compressor.wkv.weight") == [("BF16", (1024, 4096))]
    assert stored("layers.0.hc_attn_fn") == [("F32", (24, 16384))]


def test_real_config_parameter_and_dtype_totals():
    specs = v4_tensor_specs(_reference_config())
    main_model = sum(s.numel for s in specs if not s.name.startswith("mtp."))
    assert main_model == pytest.approx(284e9, rel=0.005)  # "284B total parameters"
    elements: dict[str, int] = {}
    for spec in specs:
        for t in stored_tensors(spec, "release"):
            elements[t.dtype] = elements.get(t.dtype, 0) + t.nbytes // {"F32": 4, "BF16": 2, "I64": 8}.get(t.dtype, 1)
    # The release's dtype totals as reported for the repository (MTP layer included).
    assert elements["I8"] == pytest.approx(141.7e9, rel=0.002)
    assert elements["F8_E8M0"] == pytest.approx(8.86e9, rel=0.002)
    assert elements["F8_E4M3"] == pytest.approx(6.02e9, rel=0.005)
    assert elements["BF16"] == pytest.approx(1.42e9, rel=0.02)


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_shapes_fit_every_block_format(preset):
    config = preset_config(preset)
    specs = v4_tensor_specs(config)
    assert config["hidden_size"] >= 256
    counts = {"n_routed_experts", "index_n_heads"}  # output dims that are counts, not sizes
    for spec in specs:
        if spec.role in (ROLE_DENSE_LINEAR, ROLE_BF16_LINEAR, ROLE_EXPERT) or spec.name == "head.weight":
            out_features, in_features = spec.shape
            assert in_features % 256 == 0, spec
            is_count = out_features in {config[c] for c in counts}
            assert is_count or out_features % 32 == 0, spec
    assert {SLIDING, CSA, HCA} <= set(config["layer_types"])
    assert config["mlp_layer_types"].count("hash_moe") >= 2
    assert config["n_routed_experts"] >= 8
    assert config["vocab_size"] >= TOKENIZER_VOCAB_SIZE
    if preset in ("tiny", "small"):
        assert config["compress_rates"][CSA] <= 4 and config["compress_rates"][HCA] <= 16


def test_unknown_preset_or_layout():
    with pytest.raises(MoepackError):
        preset_config("huge")
    with pytest.raises(MoepackError):
        stored_tensors(v4_tensor_specs(preset_config("tiny"))[0], "fp16")


# ------------------------------------------------------------------------------------------ files


def test_tiny_is_small_fast_and_sharded(tiny, tmp_path):
    for layout, summary in tiny.items():
        shards = [f for f in summary["files"] if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f)]
        assert len(shards) >= 2, layout
        assert summary["params"] == sum(s.numel for s in v4_tensor_specs(preset_config("tiny")))
        for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            assert name in summary["files"]
    assert tiny["release"]["bytes"] < 16e6
    # Under 2 s (about 0.2 s when the box is idle); best of three, as other work may share the CPUs.
    seconds = [synth_checkpoint(tmp_path / str(i), "tiny", "release", progress=False)["seconds"] for i in range(3)]
    assert min(seconds) < 2.0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_index_covers_every_tensor_and_shard(tiny, layout):
    directory = Path(tiny[layout]["dir"])
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    shards = sorted(p.name for p in directory.glob("model-*.safetensors"))
    assert sorted(set(weight_map.values())) == shards
    total = 0
    for shard in shards:
        with safe_open(directory / shard, "pt") as f:
            for name in f.keys():
                assert weight_map[name] == shard
                total += f.get_tensor(name).nbytes
    expected = {t.name for s in v4_tensor_specs(preset_config("tiny")) for t in stored_tensors(s, layout)}
    assert set(weight_map) == expected
    assert index["metadata"]["total_size"] == total


def test_release_dtypes_per_role(tiny):
    tensors = _read_all(tiny["release"]["dir"])
    dtypes = {
        ROLE_DENSE_LINEAR: torch.float8_e4m3fn,
        ROLE_EXPERT: torch.int8,
        ROLE_BF16_LINEAR: torch.bfloat16,
        ROLE_EMBEDDING: torch.bfloat16,
    }
    config = json.loads((Path(tiny["release"]["dir"]) / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    for spec in v4_tensor_specs(config):
        weight = tensors[spec.name]
        if spec.role == ROLE_EXACT:
            assert weight.dtype == (torch.int64 if spec.kind == "tid2eid" else torch.float32), spec.name
            assert weight.shape == spec.shape
            continue
        assert weight.dtype == dtypes[spec.role], spec.name
        scale_name = spec.name.removesuffix(".weight") + ".scale"
        out_features, in_features = spec.shape
        if spec.role == ROLE_DENSE_LINEAR:
            assert weight.shape == spec.shape
            assert tensors[scale_name].dtype == torch.float8_e8m0fnu
            assert tensors[scale_name].shape == (-(-out_features // 128), -(-in_features // 128))
        elif spec.role == ROLE_EXPERT:
            assert weight.shape == (out_features, in_features // 2)
            assert tensors[scale_name].dtype == torch.float8_e8m0fnu
            assert tensors[scale_name].shape == (out_features, in_features // 32)
        else:
            assert weight.shape == spec.shape and scale_name not in tensors
    for name in ("layers.1.attn.indexer.wq_b.weight", "layers.0.ffn.shared_experts.w2.weight"):
        assert tensors[name].dtype == torch.float8_e4m3fn
    for name in ("layers.1.attn.compressor.wkv.weight", "layers.1.attn.indexer.weights_proj.weight"):
        assert tensors[name].dtype == torch.bfloat16


def test_layouts_hold_the_same_model(tiny):
    release, bf16, f32 = (_read_all(tiny[layout]["dir"]) for layout in LAYOUTS)
    for spec in v4_tensor_specs(preset_config("tiny")):
        reference = f32[spec.name]
        scale_name = spec.name.removesuffix(".weight") + ".scale"
        if spec.role == ROLE_EXACT:
            assert torch.equal(release[spec.name], reference) and torch.equal(bf16[spec.name], reference)
            continue
        assert torch.equal(bf16[spec.name], reference.to(torch.bfloat16)), spec.name
        if spec.role == ROLE_DENSE_LINEAR:
            decoded = fp8_block_dequantize(release[spec.name], release[scale_name])
            assert ((decoded - reference).abs() <= reference.abs() * 2**-4 + 1e-6).all(), spec.name
        elif spec.role == ROLE_EXPERT:
            decoded = fp4_dequantize(release[spec.name], release[scale_name])
            assert (decoded - reference).norm() / reference.norm() < 0.15, spec.name
            assert torch.corrcoef(torch.stack([decoded.flatten(), reference.flatten()]))[0, 1] > 0.98
        else:
            assert torch.equal(release[spec.name], reference.to(torch.bfloat16)), spec.name


def test_weights_are_well_scaled(tiny):
    tensors = _read_all(tiny["f32"]["dir"])
    w1 = tensors["layers.2.ffn.experts.0.w1.weight"]
    assert w1.std().item() == pytest.approx(256**-0.5, rel=0.1)
    tid2eid = tensors["layers.0.ffn.gate.tid2eid"]
    assert tid2eid.min() >= 0 and tid2eid.max() < 8
    assert (tid2eid[:, 0] != tid2eid[:, 1]).all()  # distinct experts per token
    assert len(torch.unique(tid2eid)) == 8
    assert tensors["layers.2.ffn.gate.bias"].abs().max() < 0.2


def test_deterministic_and_seeded(tmp_path, tiny):
    again = synth_checkpoint(tmp_path / "again", "tiny", "release", seed=0, progress=False)
    first = Path(tiny["release"]["dir"])
    assert again["files"] == tiny["release"]["files"]
    for name in again["files"]:
        assert (first / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name
    other = synth_checkpoint(tmp_path / "other", "tiny", "release", seed=1, progress=False)
    shard = other["files"][2]
    assert (first / shard).read_bytes() != (tmp_path / "other" / shard).read_bytes()


def test_refuses_to_overwrite_without_asking(tmp_path):
    synth_checkpoint(tmp_path, "tiny", "release", shard_bytes=1 << 20, progress=False)
    with pytest.raises(MoepackError):
        synth_checkpoint(tmp_path, "tiny", "release", progress=False)
    summary = synth_checkpoint(tmp_path, "tiny", "release", progress=False, overwrite=True)
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert shards == [f for f in summary["files"] if f.startswith("model-")]  # no stale shards left behind


def test_a_full_disk_is_one_line_and_leaves_none_of_the_runs_files(tmp_path, monkeypatch):
    """Every file is written under a temporary name, fsynced and renamed; when the disk fills, the error names the
    folder and the cause in one line, and nothing of the run is left to pass for a checkpoint."""
    import subprocess

    import moepack.packer.synth as S

    with small_disk(tmp_path / "small-disk", "1m") as mounted:
        small = Path(mounted)
        with pytest.raises(MoepackError, match=r"^not enough free space for synthesizing .*small-disk/s on "):
            synth_checkpoint(small / "s", "small", "release", progress=False)  # seen before any work
        assert not (small / "s").exists()
        real_check = S.check_free_space
        monkeypatch.setattr(S, "check_free_space", lambda needs, what: {})  # the disk fills after the check
        with pytest.raises(MoepackError, match=r"^writing .*small-disk/s failed: No space left on device "
                                               r"\(disk full\)$"):
            synth_checkpoint(small / "s", "small", "release", progress=False)
        assert list((small / "s").iterdir()) == []
        subprocess.run(["mount", "-o", "remount,size=64m", str(small)], check=True)  # room again: it completes
        monkeypatch.setattr(S, "check_free_space", real_check)
        summary = synth_checkpoint(small / "s", "small", "release", progress=False)
        assert sorted(p.name for p in (small / "s").iterdir()) == summary["files"]



def test_a_replacing_run_that_fails_leaves_the_earlier_checkpoint_as_it_was(tmp_path, monkeypatch):
    """--force (overwrite=True) replaces an earlier checkpoint only once the new one is complete: a full disk (or a
    kill) in the middle of the new run had left neither, the earlier run's shards deleted up front."""
    import errno

    import moepack.packer.synth as S

    synth_checkpoint(tmp_path, "tiny", "f32", shard_bytes=1 << 20, progress=False)  # f32: the fastest to draw
    (tmp_path / "mine.txt").write_text("kept")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real_write, calls = S._ShardWriter.write, []

    def fills_the_disk(self, name, tensor):
        calls.append(name)
        if len(calls) > 40:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, name, tensor)

    monkeypatch.setattr(S._ShardWriter, "write", fills_the_disk)
    with pytest.raises(MoepackError, match=rf"^writing {re.escape(str(tmp_path))} failed: No space left on device "
                                           r"\(disk full\)$"):
        synth_checkpoint(tmp_path, "tiny", "f32", seed=1, progress=False, overwrite=True)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    monkeypatch.setattr(S._ShardWriter, "write", real_write)
    summary = synth_checkpoint(tmp_path, "tiny", "f32", seed=1, progress=False, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*summary["files"], "mine.txt"])


# ------------------------------------------------------------------------------------------ consumers


def test_tokenizer_loads(tiny):
    tokenizers = pytest.importorskip("tokenizers")
    directory = Path(tiny["release"]["dir"])
    tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    text = "Hello, wörld — 深度求索!"
    encoding = tokenizer.encode(text)
    assert encoding.ids[0] == 0  # BOS, as the release's tokenizer adds
    assert max(encoding.ids) < TOKENIZER_VOCAB_SIZE <= preset_config("tiny")["vocab_size"]
    assert tokenizer.decode(encoding.ids) == text

    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(directory)
    ids = auto(text)["input_ids"]
    assert ids == encoding.ids
    assert auto.decode(ids, skip_special_tokens=True) == text
    assert auto.eos_token_id == 1 and auto.bos_token_id == 0


@pytest.mark.parametrize("layout", ["bf16", "f32"])
def test_transformers_loads_and_runs(tiny, layout):
    transformers = pytest.importorskip("transformers")
    directory = tiny[layout]["dir"]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert not info["error_msgs"]

    float32 = sum(p.numel() for p in model.state_dict().values() if p.dtype == torch.float32)
    if layout == "bf16":
        # What transformers keeps in float32 is exactly the "exact" role (MTP aside: transformers drops it).
        specs = v4_tensor_specs(preset_config("tiny"))
        exact = sum(s.numel for s in specs if s.role == ROLE_EXACT and s.kind != "tid2eid" and s.block[:3] != "mtp")
        assert float32 == exact
    else:
        assert all(p.dtype in (torch.float32, torch.int64) for p in model.state_dict().values())

    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    text = "The compressor closes a window every few tokens; the sliding window slides."
    inputs = tokenizer(text, return_tensors="pt")
    assert inputs["input_ids"].shape[1] > 2 * preset_config("tiny")["sliding_window"]
    with torch.no_grad():
        logits = model(**inputs).logits.float()
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.1
    assert not torch.allclose(logits[0, 0], logits[0, -1])  # positions differ: not a degenerate model


# ------------------------------------------------------------------------------------------ families


def test_each_family_s_synth_module_is_found_by_the_registry_and_matches_its_family_json():
    """A family's synthetic checkpoints live in its own package (families/<name>/synth.py), found through the
    registry; its family.json names its presets (what `synth --preset` offers) without importing it."""
    from moepack import families

    entries = families.family_entries()
    assert [e.name for e in entries if e.default] == [families.DEFAULT_FAMILY] == ["deepseek-v4"]
    assert families.SYNTH_PRESETS == ("tiny", "small", "medium")
    for entry in entries:
        synth = families.family_synth(entry.name)
        assert synth.__name__ == f"{entry.module}.synth"
        assert synth.PRESETS == entry.synth_presets and entry.synth_release_layout
        assert synth.LAYOUTS == LAYOUTS
        for preset in synth.PRESETS:
            assert families.family_for(synth.preset_config(preset)).name == entry.name
    with pytest.raises(MoepackError, match=r"^unknown model family 'nope' \(supported: deepseek-v4, qwen3-moe\)$"):
        families.family_synth("nope")
    with pytest.raises(MoepackError, match=r"^unknown model family 'nope' \(choose one of deepseek-v4, qwen3-moe\)$"):
        synth_checkpoint("unused", family="nope", progress=False)


def test_the_writer_takes_any_family_s_checkpoint(tmp_path, monkeypatch):
    """packer/synth.py holds no family: a third family's synth module (here a made-up one registered for the test)
    is written as the two real ones are: its config, its tensors in their stored dtypes (widest first in a shard),
    its tokenizer, a summary naming it; a tokenizer file it leaves out is removed from an earlier run."""
    import sys
    import types
    from dataclasses import replace

    from moepack import families
    from moepack.families.synthetic import SynthCheckpoint, byte_level_tokenizer, tensor_generator

    class Spec:
        def __init__(self, name, shape):
            self.name, self.shape, self.numel = name, shape, shape[0] * shape[1]

    def checkpoint(preset, layout, seed, config_overrides=None, tokenizer=None, random_expert_codes=False):
        specs = [Spec("norm.weight", (1, 8)), Spec("w.weight", (4, 8))]

        def stored(spec):
            return ([(spec.name, "BF16", spec.shape)] if spec.name == "norm.weight" else
                    [(spec.name, "I8", spec.shape), (spec.name + "_scale", "F32", (4, 1))])

        def encode(spec):
            value = torch.randn(spec.shape, generator=tensor_generator(seed, spec.name))
            if spec.name == "norm.weight":
                return {spec.name: value.to(torch.bfloat16)}
            return {spec.name: value.mul(10).round().to(torch.int8), spec.name + "_scale": torch.ones(4, 1)}

        config = {"model_type": "toy", "bos_token_id": 0, "eos_token_id": 1, "preset": preset, "layout": layout}
        return SynthCheckpoint(config, specs, stored, encode, {"tokenizer.json": byte_level_tokenizer(("<s>",), "<s>")})

    module = types.ModuleType("toy_family.synth")
    module.__dict__.update(PRESETS=("p",), LAYOUTS=("release",), TAKES_TOKENIZER=False, RANDOM_EXPERT_CODES=False,
                           checkpoint=checkpoint)
    monkeypatch.setitem(sys.modules, "toy_family.synth", module)
    real = families.family_entries()
    toy = replace(real[0], name="toy-moe", module="toy_family", default=False, synth_presets=("p",))
    monkeypatch.setattr(families, "_families", lambda: (*real, toy))

    out = tmp_path / "toy"
    out.mkdir()
    (out / "tokenizer_config.json").write_text("{}")  # an earlier run's
    summary = synth_checkpoint(out, preset="p", family="toy-moe", progress=False, shard_bytes=1 << 20)
    assert list(summary)[:4] == ["dir", "preset", "layout", "family"] and summary["family"] == "toy-moe"
    assert summary["files"] == sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json",
        "tokenizer.json"]
    assert summary["params"] == 40
    assert json.loads((out / "config.json").read_text())["preset"] == "p"
    tensors = _read_all(out)
    assert {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()} == {
        "norm.weight": (torch.bfloat16, (1, 8)), "w.weight": (torch.int8, (4, 8)),
        "w.weight_scale": (torch.float32, (4, 1))}
    raw = (out / "model-00001-of-00001.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    by_offset = sorted((v["data_offsets"][0], n) for n, v in header.items() if n != "__metadata__")
    assert [n for _, n in by_offset] == ["w.weight_scale", "norm.weight", "w.weight"]  # F32, BF16, I8
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"] == {
        name: "model-00001-of-00001.safetensors" for name in sorted(tensors)}
    with pytest.raises(MoepackError, match=r"^unknown layout 'bf16' \(choose one of release\)$"):
        synth_checkpoint(tmp_path / "other", preset="p", layout="bf16", family="toy-moe", progress=False)
    with pytest.raises(MoepackError, match=r"^--tokenizer and random expert codes are for deepseek-v4 only, not "
                                           r"toy-moe "):
        synth_checkpoint(tmp_path / "other", preset="p", family="toy-moe", random_expert_codes=True, progress=False)


def test_synth_flags_and_help_come_from_the_registry():
    """`moepack synth`'s --family / --preset choices and defaults are the registry's (as they were when spelled out
    in cli/main.py), and the help of synth, convert and export describes every registered family from its
    family.json."""
    from moepack import families
    from moepack.cli.main import cli

    def options(command):
        return {p.name: p for p in cli.commands[command].params}

    def choices(param):
        return list(param.type.choices), param.default

    synth = options("synth")
    assert choices(synth["family"]) == (["deepseek-v4", "qwen3-moe"], "deepseek-v4")
    assert choices(synth["preset"]) == (["tiny", "small", "medium"], "tiny")
    assert choices(synth["layout"]) == (["release", "bf16", "f32"], "release")
    assert choices(options("demo")["preset"]) == (["tiny", "small", "medium"], "small")
    texts = {"synth": [synth["family"].help, synth["preset"].help, synth["layout"].help],
             "convert": [cli.commands["convert"].help], "export": [options("export")["fmt"].help]}
    for entry in families.family_entries():
        assert all(entry.name in text for command_texts in texts.values() for text in command_texts)
        assert entry.architectures[0] in synth["family"].help and entry.synth_release_layout in synth["layout"].help
        assert f"{entry.name}: {', '.join(entry.synth_presets)}" in synth["preset"].help
        assert entry.gguf_architectures[0] in texts["convert"][0] and entry.gguf_architectures[0] in texts["export"][0]
