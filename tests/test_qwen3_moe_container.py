"""Qwen3-MoE through the container tools: `moepack convert` (a directory, a hub id; bf16 and the `-FP8` layout),
`verify`, `inspect`, the round trip (the container's tensors decoded equal the checkpoint's, and the family's
forward over them gives transformers' logits), with DeepSeek-V4's conversions pinned byte for byte."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from moepack.cli.main import cli
from moepack.families.qwen3_moe.config import Qwen3MoeConfig
from moepack.families.qwen3_moe.synth import RELEASE_QUANTIZATION_CONFIG
from moepack.families.qwen3_moe.model import forward
from moepack.families.qwen3_moe.tensors import EXPERT_NAMING, Checkpoint, load_checkpoint, tensor_specs
from moepack.format_spec.decode import decode_group, entry_bytes
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.reader import Container
from moepack.format_spec.verify import verify_container
from moepack.packer.convert import convert_checkpoint
from moepack.packer.source import CheckpointDir
from moepack.packer.synth import synth_checkpoint

transformers = pytest.importorskip("transformers")
from test_qwen3_moe import (CONFIGS, PROMPT, fp8_release, reference, reference_logits, save_model,  # noqa: E402
                            save_widened)


def container_checkpoint(path) -> Checkpoint:
    """Every tensor of a Qwen3-MoE container decoded to float32 (scales folded in), as the family's Checkpoint."""
    tensors = {}
    with Container(path) as c:
        for region in c.regions:
            raw = torch.frombuffer(bytearray(c.pread(region.offset, region.length, region.part)), dtype=torch.uint8)
            tensors.update(decode_group(region.tensors, entry_bytes(raw, region.offset)))
        return Checkpoint(Qwen3MoeConfig.from_hf(c.config), c.config, tensors)


def index_digest(path) -> str:
    """sha256 of what a conversion decides (architecture, config, policy, every region's and tensor's place, type
    and xxh3); the provenance (paths, times) left out."""
    with Container(path) as c:
        kept = {k: c.index[k] for k in ("architecture", "config", "policy", "regions", "tensors")}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


@pytest.fixture(scope="module")
def synth_dirs(tmp_path_factory):
    """`synth --family qwen3-moe --preset tiny`: {layout: directory} for the -FP8 release layout and bf16."""
    base = tmp_path_factory.mktemp("qwen3-synth")
    out = {}
    for layout in ("release", "bf16"):
        out[layout] = base / layout
        synth_checkpoint(str(out[layout]), preset="tiny", layout=layout, seed=2, progress=False, family="qwen3-moe")
    return out


@pytest.fixture(scope="module")
def keep_containers(synth_dirs, tmp_path_factory):
    base = tmp_path_factory.mktemp("qwen3-keep")
    out = {}
    for layout, src in synth_dirs.items():
        out[layout] = str(base / f"{layout}.moepack")
        convert_checkpoint(str(src), out[layout], policy="keep", progress=False)
    return out


# ------------------------------------------------------------------------------------------ DeepSeek-V4 unchanged

# index_digest of `synth --preset tiny --layout release --seed 3` converted, before the converter asked the families
V4_DIGESTS = {"keep": "be3970fb1276fb896997ea094deceacf356e389198f101def0abd429e501501c",
              "fp4": "a098c35e749b05c061907b7dcd3814458942b9597581847398700e052cf3cc51",
              "q2": "7f1b8dbd4d8f70b34252b5a76df69cb79921a81d3aff962dcd9645686294521e"}


def test_deepseek_v4_conversions_are_byte_identical(tmp_path):
    synth_checkpoint(str(tmp_path / "src"), preset="tiny", layout="release", seed=3, progress=False)
    for policy, digest in V4_DIGESTS.items():
        out = str(tmp_path / f"{policy}.moepack")
        convert_checkpoint(str(tmp_path / "src"), out, policy=policy, progress=False)
        assert index_digest(out) == digest, policy


# ------------------------------------------------------------------------------------------ convert


@pytest.mark.parametrize("layout", ["release", "bf16"])
def test_keep_stores_every_source_tensor_bit_exact_in_read_order(synth_dirs, keep_containers, layout):
    src = CheckpointDir(str(synth_dirs[layout]))
    config = Qwen3MoeConfig.from_hf(src.config)
    with Container(keep_containers[layout]) as c:
        assert c.architecture == "qwen3_moe" and c.config == src.config
        renamed = {n.replace(".weight_scale_inv", ".scale"): n for n in src.tensors}
        assert set(c.tensors) == set(renamed)
        for name, t in c.tensors.items():
            source = src.tensors[renamed[name]]
            assert c.tensor_bytes(name) == src.read(source) and t.dtype == source.dtype, name
        assert [r.name for r in c.global_regions] == ["global.model.embed_tokens.weight", "global.lm_head.weight",
                                                       "global.model.norm.weight"]
        assert len(c.layers) == config.num_layers
        for block in c.layers:
            assert not any(".mlp.experts." in t.name for t in block.dense.tensors)
            assert [r.expert for r in block.experts] == list(range(config.num_experts))
            for region in block.experts:  # one region per expert: gate, up, down (each with its scale)
                names = EXPERT_NAMING.names(block.number, region.expert)
                weights = [t.name for t in region.tensors if t.name.endswith(".weight")]
                assert weights == [names["gate"], names["up"], names["down"]]
                assert len(region.tensors) == (6 if layout == "release" else 3)
    src.close()
    verify_container(keep_containers[layout])


def test_the_fp8_layout_decodes_to_the_loaders_values(synth_dirs, keep_containers):
    with Container(keep_containers["release"]) as c:
        assert c.tensors["model.layers.0.self_attn.q_proj.weight"].dtype == "F8_E4M3"
        assert c.tensors["model.layers.0.self_attn.q_proj.scale"].dtype == "BF16"
        assert c.tensors["model.layers.0.mlp.gate.weight"].dtype == "BF16"  # the router stays as released
    ours, theirs = container_checkpoint(keep_containers["release"]), load_checkpoint(synth_dirs["release"])
    assert set(ours.tensors) == set(theirs.tensors)
    for name, value in theirs.tensors.items():
        assert torch.equal(ours.tensors[name], value), name


@pytest.mark.parametrize("policy", ["bf16", "q8", "fp4", "q2"])
def test_every_policy_converts_and_verifies(synth_dirs, tmp_path, policy):
    """A policy quantizes the linears it names (the routed experts, the attention), never the router or norms."""
    out = str(tmp_path / f"{policy}.moepack")
    convert_checkpoint(str(synth_dirs["release"]), out, policy=policy, progress=False)
    verify_container(out)
    with Container(out) as c:
        assert c.tensors["model.layers.1.mlp.gate.weight"].dtype == "BF16"
        assert c.tensors["model.layers.1.input_layernorm.weight"].dtype == "BF16"
        expert = c.tensors[EXPERT_NAMING.names(1, 3)["down"]].dtype
        assert expert == {"bf16": "BF16", "q8": "Q8_0", "fp4": "MXFP4", "q2": "Q2_K"}[policy]
    decoded = container_checkpoint(out).tensors
    source = load_checkpoint(synth_dirs["release"]).tensors
    for name, value in source.items():  # lossless for bf16, within the type's error else
        err = (decoded[name] - value).norm() / value.norm()
        assert err <= {"bf16": 0.0, "q8": 0.01, "fp4": 0.2, "q2": 0.45}[policy], (name, float(err))


@pytest.mark.parametrize("damage, message", [
    (lambda t, c: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"),
     "tensor model.layers.1.mlp.experts.3.up_proj.weight is missing (the config implies [256, 256])"),
    (lambda t, c: [t.pop(n) for n in EXPERT_NAMING.names(1, 7).values()], "layers.1 holds 7 experts, the config "
                                                                          "implies 8"),
    (lambda t, c: t.pop("model.layers.2.self_attn.k_norm.weight"), "tensor model.layers.2.self_attn.k_norm.weight "
                                                                   "is missing"),
    (lambda t, c: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2, 2)}),
     "tensor model.layers.0.mlp.extra.weight is not one a qwen3-moe config implies"),
    (lambda t, c: c.update(num_experts=4), "layers.0 holds 8 experts, the config implies 4"),
    (lambda t, c: c.update(num_experts_per_tok=0), "config.json is not a usable qwen3-moe config"),
])
def test_a_checkpoint_unlike_its_config_is_refused_before_writing(synth_dirs, tmp_path, damage, message):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    src.mkdir()
    tensors = {}
    for f in sorted(synth_dirs["bf16"].glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    config = json.loads((synth_dirs["bf16"] / "config.json").read_text())
    damage(tensors, config)
    save_file(tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(MoepackError) as e:
        convert_checkpoint(str(src), str(tmp_path / "out.moepack"), policy="keep", progress=False)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not list(tmp_path.glob("out.moepack*"))



@pytest.mark.parametrize("quantization, message", [
    ({"quant_method": "gptq", "bits": 4}, "config.json quantization_config: quant_method 'gptq' is not supported"),
    ({**RELEASE_QUANTIZATION_CONFIG, "weight_block_size": [64, 64]}, "only e4m3 in 128x128 blocks is supported"),
    ({**RELEASE_QUANTIZATION_CONFIG, "fmt": "e5m2"}, "only e4m3 in 128x128 blocks is supported"),
])
def test_convert_refuses_a_quantization_other_than_the_fp8_releases_before_writing(synth_dirs, tmp_path,
                                                                                   quantization, message):
    """The converter read FP8 weights by the releases' e4m3 128x128 rule whatever quantization_config said (the
    reference loader refused it): another method or block was converted without a word."""
    src = tmp_path / "src"
    shutil.copytree(synth_dirs["release"], src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(MoepackError) as e:
        convert_checkpoint(str(src), str(tmp_path / "out.moepack"), policy="keep", progress=False)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not list(tmp_path.glob("out.moepack*"))

# ------------------------------------------------------------------------------------------ the round trip


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_family_forward_over_the_container_gives_transformers_logits(tmp_path, name):
    """transformers' random model saved, converted --keep: every tensor reads back equal, and the family's forward
    over the container's weights gives transformers' logits (dense-MLP layers, tied head and GQA / MHA included)."""
    model = save_model(tmp_path / "hf", CONFIGS[name], torch.float32)
    out = str(tmp_path / "m.moepack")
    convert_checkpoint(str(tmp_path / "hf"), out, policy="keep", progress=False)
    loaded = container_checkpoint(out)
    for key, value in load_checkpoint(tmp_path / "hf").tensors.items():
        assert torch.equal(loaded.tensors[key], value), key
    torch.testing.assert_close(forward(loaded, PROMPT), reference_logits(model, PROMPT), atol=1e-5, rtol=1e-5)


def test_the_fp8_release_layout_round_trips_to_transformers_logits(tmp_path):
    """An `-FP8` release (F8_E4M3 linears with BF16 weight_scale_inv, not powers of two) converted --keep: the
    container decodes to the FP8 values, and the forward over them equals transformers' over the same values."""
    model = save_model(tmp_path / "fp8", {}, torch.float32)
    values = fp8_release(tmp_path / "fp8")
    out = str(tmp_path / "fp8.moepack")
    convert_checkpoint(str(tmp_path / "fp8"), out, policy="keep", progress=False)
    loaded = container_checkpoint(out)
    for key, value in values.items():
        assert torch.equal(loaded.tensors[key], value), key
    save_widened(model, tmp_path / "fp8", values, tmp_path / "widened")  # transformers over the same values
    torch.testing.assert_close(forward(loaded, PROMPT), reference_logits(reference(tmp_path / "widened"), PROMPT),
                               atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ verify, inspect


def test_verify_and_inspect_a_qwen3_moe_container(keep_containers, synth_dirs):
    path = keep_containers["release"]
    r = CliRunner().invoke(cli, ["verify", path, "--source", str(synth_dirs["release"]), "--json"])
    assert r.exit_code == 0, r.output
    result = json.loads(r.output)
    assert result["source_check"]["ok"] and result["source_check"]["bit_identical"] == result["tensors"]
    assert result["prefill"] == "ok"  # tests/test_family_prefill.py prefills it
    r = CliRunner().invoke(cli, ["inspect", path, "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)
    assert (s["architecture"], s["model_type"], s["layers"], s["experts_per_layer"]) == ("qwen3_moe", "qwen3_moe",
                                                                                            4, [8])
    config = Qwen3MoeConfig.from_hf(json.loads((synth_dirs["release"] / "config.json").read_text()))
    quantized = [t for t in tensor_specs(config) if t.role in ("attention", "expert", "dense_ffn")]
    assert s["storage_types"]["F8_E4M3"]["tensors"] == len(quantized)


def test_verify_refuses_a_container_missing_a_tensor_its_config_implies(keep_containers, tmp_path):
    from containers import mutate_index

    bad = str(tmp_path / "bad.moepack")
    mutate_index(keep_containers["bf16"], bad, lambda index: index["config"].update(num_experts_per_tok=9,
                                                                                    num_experts=9))
    r = CliRunner().invoke(cli, ["verify", bad])
    assert r.exit_code == 1 and "layers.0 holds 8 experts, the config implies 9" in r.output
    assert len(r.output.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------ the hub


def test_convert_a_hub_id(tmp_path, synth_dirs, keep_containers):
    from test_hub import FakeHub, FakeRepo, hub_env

    files = {p.name: p.read_bytes() for p in synth_dirs["release"].iterdir()}
    hub = FakeHub()
    try:
        hub.add_repo("Qwen/Qwen3-tiny-FP8", FakeRepo({"d" * 40: files}, {"main": "d" * 40}))
        out = str(tmp_path / "hub.moepack")
        proc = subprocess.run([sys.executable, "-m", "moepack", "convert", "Qwen/Qwen3-tiny-FP8", "-o", out, "--keep",
                               "--json"], env=hub_env(tmp_path, hub.url), capture_output=True, text=True, timeout=300)
    finally:
        hub.close()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with Container(out) as a, Container(keep_containers["release"]) as b:
        assert a.architecture == "qwen3_moe" and list(a.tensors) == list(b.tensors)
        for name in a.tensors:
            assert a.tensor_bytes(name) == b.tensor_bytes(name), name


# ------------------------------------------------------------------------------------------ plan


@pytest.mark.parametrize("layout", ["release", "bf16"])
def test_plan_sizes_a_container_and_its_config_alike(synth_dirs, keep_containers, layout):
    """`moepack plan` of the container and of the checkpoint's config.json (laid out as convert --keep would) give
    the same layers, expert and dense bytes; the active weights per token are the schema's."""
    from moepack.tools.plan import flops_per_token, sizes_from_config, sizes_from_container

    raw = json.loads((synth_dirs[layout] / "config.json").read_text())
    config = Qwen3MoeConfig.from_hf(raw)
    with Container(keep_containers[layout]) as c:
        ours = sizes_from_container(c)
        expert_region = c.layers[0].experts[0].length
        dense_region = c.layers[0].dense.length
    from_config = sizes_from_config(raw, "keep")
    assert ours.as_dict()["layers"] == from_config.as_dict()["layers"] == [
        {"layers": f"0-{config.num_layers - 1}", "count": config.num_layers, "attention": "full", "routing": "topk",
         "dense_bytes": dense_region, "expert_bytes": expert_region, "experts_bytes": 8 * expert_region,
         "n_experts": 8}]
    for field in ("global_bytes", "expert_params", "hidden_size", "top_k", "n_experts", "expert_bpw",
                  "expert_intermediate"):
        assert getattr(ours, field) == getattr(from_config, field), field
    h, i, d = config.hidden_size, config.moe_intermediate_size, config.head_dim
    assert ours.expert_params == 3 * h * i and ours.top_k == 2
    attention = h * d * (2 * config.num_heads + 2 * config.num_kv_heads)
    active = config.num_layers * (attention + 8 * h + config.top_k * 3 * h * i)
    flops = flops_per_token(raw)
    assert flops["active_params"] == active and flops["routed"] == 2 * config.num_layers * config.top_k * 3 * h * i
    assert flops["head"] == 2 * config.vocab_size * h


def test_plan_command_on_a_qwen3_moe_container(keep_containers):
    r = CliRunner().invoke(cli, ["plan", keep_containers["bf16"], "--ssd-gbps", "7", "--tflops", "50",
                                 "--context", "4K", "--json"])
    assert r.exit_code == 0, r.output
    p = json.loads(r.output)
    assert p["model"]["n_experts"] == 8 and p["model"]["layers"][0]["routing"] == "topk"
    assert p["rows"][0]["tokens"] == 4096 and p["n_star"]["optimistic"] > 0


# ------------------------------------------------------------------------------------------ export --format gguf


def _gguf_key_names(gguf, arch: str) -> set[str]:
    """Every per-architecture key gguf-py's Keys spells, for `arch`."""
    out = set()
    for group in vars(gguf.Keys).values():
        for value in vars(group).values() if isinstance(group, type) else ():
            if isinstance(value, str) and value.startswith("{arch}."):
                out.add(value.replace("{arch}", arch))
    return out


def test_a_scaled_rope_goes_to_the_gguf_and_back(tmp_path):
    """A YaRN (or linear) RoPE is written as llama.cpp's rope.scaling keys and read back from them: the GGUF
    converted back runs the container's logits; a YaRN llama.cpp would scale otherwise is refused in one line."""
    gguf = pytest.importorskip("gguf")
    from test_qwen3_moe import SCALED_ROPES

    from moepack.packer.gguf_export import export_gguf
    from moepack.runtime.engine import PrefillOptions, prefill

    f32 = PrefillOptions(compute_dtype="float32")
    for name in ("yarn-release", "linear", "yarn-attention-factor"):
        src, original, back, out = (tmp_path / name / n for n in ("hf", "m.moepack", "back.moepack", "m.gguf"))
        save_model(src, SCALED_ROPES[name], torch.float32)
        convert_checkpoint(str(src), str(original), policy="keep", progress=False)
        if name == "yarn-attention-factor":
            with pytest.raises(MoepackError, match="llama.cpp's YaRN scales cos and sin by its own mscale"):
                export_gguf(str(original), str(out), progress=False)
            continue
        export_gguf(str(original), str(out), progress=False)
        assert gguf.GGUFReader(str(out)).fields["qwen3moe.rope.scaling.type"].contents() == name.split("-")[0]
        convert_checkpoint(str(out), str(back), policy="keep", progress=False)
        theirs = prefill(str(original), PROMPT * 3, f32).logits
        torch.testing.assert_close(prefill(str(back), PROMPT * 3, f32).logits, theirs,
                                   atol=0.02 * theirs.abs().max().item(), rtol=0)


@pytest.mark.parametrize("layout, policy", [("bf16", "keep"), ("release", "fp4")])
def test_export_gguf_is_llama_cpps_qwen3moe(synth_dirs, keep_containers, tmp_path, layout, policy):
    """The GGUF read back by gguf-py: llama.cpp's qwen3moe architecture and keys, every tensor under gguf-py's name
    for the architecture with its shape, each layer's experts stacked [n_experts, out, in], the values the
    container's (bit for bit where the type is kept: BF16, MXFP4; Q8_0's rounding of an FP8 linear)."""
    gguf = pytest.importorskip("gguf")
    from moepack.families.qwen3_moe.gguf import gguf_model
    from moepack.packer.gguf_export import export_gguf

    if policy == "keep":
        container = keep_containers[layout]
    else:
        container = str(tmp_path / f"{policy}.moepack")
        convert_checkpoint(str(synth_dirs[layout]), container, policy=policy, progress=False)
    out = str(tmp_path / "m.gguf")
    result = export_gguf(container, out, progress=False)
    assert result["architecture"] == "qwen3moe"
    reader = gguf.GGUFReader(out)
    ours = container_checkpoint(container)
    config = ours.config
    assert reader.fields["general.architecture"].contents() == gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN3MOE]
    assert reader.fields["tokenizer.ggml.pre"].contents() == "qwen2"
    tokenizer_config = json.loads((synth_dirs[layout] / "tokenizer_config.json").read_text())
    assert reader.fields["tokenizer.chat_template"].contents() == tokenizer_config["chat_template"]  # Qwen's own
    known = _gguf_key_names(gguf, "qwen3moe")
    for key, _, value in gguf_model(config).keys:
        assert key in known, key
        assert reader.fields[key].contents() == pytest.approx(value), key
    names = {gguf.TENSOR_NAMES[t].format(bid=layer) + ".weight"
             for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.QWEN3MOE] for layer in range(config.num_layers)}
    tensors = {t.name: t for t in reader.tensors}
    specs = tensor_specs(config)
    assert set(tensors) == {s.gguf for s in specs} and set(tensors) <= names
    for spec in specs:
        if spec.expert not in (None, 0):
            continue
        t = tensors[spec.gguf]
        values = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
        if spec.expert == 0:
            matrix = next(m for m, n in EXPERT_NAMING.names(spec.layer, 0).items() if n == spec.name)
            want = torch.stack([ours.tensors[EXPERT_NAMING.names(spec.layer, e)[matrix]]
                                for e in range(config.num_experts)])
        else:
            want = ours.tensors[spec.name]
        assert tuple(values.shape) == tuple(want.shape) == tuple(reversed([int(n) for n in t.shape])), spec.name
        if t.tensor_type.name == "Q8_0":
            assert (values - want).norm() / want.norm() < 0.01, spec.name
        else:
            assert torch.equal(values, want), spec.name


@pytest.mark.parametrize("widths", [dict(moe_intermediate_size=48), dict(hidden_size=72, intermediate_size=40)],
                         ids=["expert-width-48", "hidden-72"])
def test_fp8_weights_of_widths_off_q8_0_blocks_export_as_f32(tmp_path, widths):
    """An `-FP8` checkpoint's linear whose rows are not whole Q8_0 blocks of 32 (a routed expert's down_proj of 48
    inputs, every linear reading a hidden state of 72) goes to the GGUF as F32, stacked experts as single ones, and
    the GGUF converted back runs the same logits."""
    gguf = pytest.importorskip("gguf")
    from moepack.packer.gguf_export import export_gguf
    from moepack.runtime.engine import prefill

    save_model(tmp_path / "hf", widths, torch.float32)
    fp8_release(tmp_path / "hf")
    original, back = str(tmp_path / "m.moepack"), str(tmp_path / "back.moepack")
    convert_checkpoint(str(tmp_path / "hf"), original, policy="keep", progress=False)
    export_gguf(original, str(tmp_path / "m.gguf"), progress=False)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    assert types["blk.0.ffn_down_exps.weight"] == ("F32" if widths.get("moe_intermediate_size", 96) % 32 else "Q8_0")
    assert types["blk.0.attn_q.weight"] == ("F32" if widths.get("hidden_size", 160) % 32 else "Q8_0")
    convert_checkpoint(str(tmp_path / "m.gguf"), back, policy="keep", progress=False)
    theirs = prefill(original, PROMPT).logits
    torch.testing.assert_close(prefill(back, PROMPT).logits, theirs, atol=0.02 * theirs.abs().max().item(), rtol=0)


def test_a_gguf_without_the_keys_llama_cpp_defaults_is_the_same_model(tmp_path):
    """llama.cpp's converter writes attention.key_length / value_length only from a config.json head_dim (and
    rope.freq_base from a rope_theta); its loader then takes embedding_length / head_count (and 10000): such a
    GGUF converts to the model it came from."""
    pytest.importorskip("gguf")
    from test_gguf_import import _rewrite

    from moepack.packer.gguf_export import export_gguf
    from moepack.runtime.engine import PrefillOptions, prefill

    save_model(tmp_path / "hf", {}, torch.float32, without=("head_dim",))  # 160 / 4 heads: head_dim 40
    original, back = str(tmp_path / "m.moepack"), str(tmp_path / "back.moepack")
    convert_checkpoint(str(tmp_path / "hf"), original, policy="keep", progress=False)
    export_gguf(original, str(tmp_path / "m.gguf"), progress=False)
    dropped = tuple(f"qwen3moe.{k}" for k in ("attention.key_length", "attention.value_length", "rope.freq_base"))
    _rewrite(str(tmp_path / "m.gguf"), str(tmp_path / "bare.gguf"), lambda name, qtype, t: (name, qtype, t.data),
             drop_keys=dropped)
    convert_checkpoint(str(tmp_path / "bare.gguf"), back, policy="keep", progress=False)
    f32 = PrefillOptions(compute_dtype="float32")
    torch.testing.assert_close(prefill(back, PROMPT, f32).logits, prefill(original, PROMPT, f32).logits, atol=1e-5,
                               rtol=0)


def test_a_sliding_window_generates_transformers_tokens_alone_and_batched(tmp_path):
    """A window of 4 under prompts of 5 to 13 tokens: the generation and the batch scheduler's (prompts prefilled 3
    tokens a chunk, decoded together) give transformers' greedy tokens; a GGUF (llama.cpp's qwen3moe has no window)
    is refused in one line."""
    from moepack.packer.gguf_export import export_gguf
    from moepack.runtime.batching import BatchScheduler
    from moepack.runtime.engine import PrefillOptions
    from moepack.runtime.generate import GenerateOptions, Generator

    model = save_model(tmp_path / "hf", CONFIGS["sliding"], torch.float32)
    path = str(tmp_path / "m.moepack")
    convert_checkpoint(str(tmp_path / "hf"), path, policy="keep", progress=False)
    prompts, options = [PROMPT, PROMPT[:5], PROMPT + PROMPT[:4]], GenerateOptions(max_new_tokens=6, stop_at_eos=False)
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, len(p):]
                .tolist() for p in prompts]
    with Generator(path, cache_gib=0.5, prefill=PrefillOptions(compute_dtype="float32")) as g:
        assert g.generate(PROMPT, options).generated_ids == want[0]
        with BatchScheduler(g, max_batch=4, prefill_chunk=3) as scheduler:
            futures = [scheduler.submit(p, options) for p in prompts]
            assert [f.result(timeout=120).generated_ids for f in futures] == want
    with pytest.raises(MoepackError, match="llama.cpp's qwen3moe attends every earlier token; .* sliding window of 4"):
        export_gguf(path, str(tmp_path / "m.gguf"), progress=False)


def test_export_gguf_refuses_what_llama_cpps_qwen3moe_cannot_run(tmp_path):
    from moepack.packer.gguf_export import export_gguf

    save_model(tmp_path / "hf", CONFIGS["sparse-step"], torch.float32)
    convert_checkpoint(str(tmp_path / "hf"), str(tmp_path / "m.moepack"), policy="keep", progress=False)
    with pytest.raises(MoepackError, match=r"llama.cpp's qwen3moe has routed experts in every layer; layers \[0, 2, "
                                           r"3\] hold a dense MLP"):
        export_gguf(str(tmp_path / "m.moepack"), str(tmp_path / "m.gguf"), progress=False)
    assert not list(tmp_path.glob("*.gguf*"))


@pytest.mark.parametrize("layout, policy", [("bf16", "keep"), ("release", "fp4")])
def test_convert_from_the_exported_gguf_gives_the_container_back(synth_dirs, keep_containers, tmp_path, layout,
                                                                 policy):
    """container -> export --format gguf -> convert MODEL.gguf: the same config (as the family reads it), the
    same tensors under the same names with the same values (a norm comes back F32, as llama.cpp stores it; the
    fp4 policy's Q8_0 and MXFP4 bytes as they were)."""
    pytest.importorskip("gguf")
    from tokenizers import Tokenizer

    from moepack.packer.gguf_export import export_gguf

    if policy == "keep":
        original = keep_containers[layout]
    else:
        original = str(tmp_path / f"{policy}.moepack")
        convert_checkpoint(str(synth_dirs[layout]), original, policy=policy, progress=False)
    export_gguf(original, str(tmp_path / "m.gguf"), progress=False)
    back = str(tmp_path / "back.moepack")
    convert_checkpoint(str(tmp_path / "m.gguf"), back, policy="keep", progress=False)
    verify_container(back)
    ours, theirs = container_checkpoint(back), container_checkpoint(original)
    assert ours.config == theirs.config
    assert set(ours.tensors) == set(theirs.tensors)
    for name, value in theirs.tensors.items():
        assert torch.equal(ours.tensors[name], value), name
    with Container(back) as a, Container(original) as b:
        assert a.architecture == "qwen3_moe"
        rebuilt, source = (Tokenizer.from_str(x.index["tokenizer"]["tokenizer.json"]["data"]) for x in (a, b))
        text = "hello <|im_start|>user 123's\n<|im_end|>"
        assert rebuilt.encode(text).ids == source.encode(text).ids
        # Qwen's pre-tokenizer (one digit at a time), which the GGUF names "qwen2" and the family spells out
        assert [p for p, _ in rebuilt.pre_tokenizer.pre_tokenize_str("abc 123's")] == ["abc", "Ġ", "1", "2", "3",
                                                                                       "'s"]
        for name, t in b.tensors.items():
            if len(t.shape) == 2 and t.dtype != "F8_E4M3":  # kept as they were; FP8 became Q8_0
                assert a.tensor_bytes(name) == b.tensor_bytes(name), name


def test_export_hf_gives_transformers_the_model_back(tmp_path):
    """`moepack export` (Hugging Face) of a Qwen3-MoE container: transformers loads it and computes the logits of
    the model it was converted from (the container's names are transformers' own)."""
    from moepack.packer.export import export_container

    model = save_model(tmp_path / "hf", CONFIGS["mha-tied"], torch.float32)
    convert_checkpoint(str(tmp_path / "hf"), str(tmp_path / "m.moepack"), policy="keep", progress=False)
    export_container(str(tmp_path / "m.moepack"), str(tmp_path / "out"), dtype="f32", progress=False)
    torch.testing.assert_close(reference_logits(reference(tmp_path / "out"), PROMPT), reference_logits(model, PROMPT),
                               atol=0, rtol=0)


def test_plan_of_a_model_with_dense_mlp_layers(tmp_path):
    """Layers without routed experts (mlp_only_layers, decoder_sparse_step) are planned as dense, from the
    container and from the config alike, the experts' size taken from a layer that has them."""
    from moepack.tools.plan import sizes_from_config, sizes_from_container

    save_model(tmp_path / "hf", CONFIGS["sparse-step"], torch.float32)
    convert_checkpoint(str(tmp_path / "hf"), str(tmp_path / "m.moepack"), policy="keep", progress=False)
    with Container(str(tmp_path / "m.moepack")) as c:
        ours = sizes_from_container(c)
        theirs = sizes_from_config(c.config, "keep")
    assert [(s.routing, s.n_experts) for s in ours.layers] == [("dense", 0), ("topk", 6), ("dense", 0), ("dense", 0)]
    assert [s.routing for s in theirs.layers] == [s.routing for s in ours.layers]
    assert ours.expert_params == theirs.expert_params == 3 * 160 * 96
    assert theirs.expert_bpw > 0


@pytest.mark.parametrize("key, value, message", [
    ("qwen3moe.expert_count", None, "m.gguf: no qwen3moe.expert_count key"),
    ("qwen3moe.expert_count", "many", "m.gguf: a qwen3-moe key of the wrong type"),
    ("qwen3moe.expert_used_count", 0, "m.gguf: config.json num_experts_per_tok: must be between 1 and 8, got 0"),
])
def test_a_qwen3moe_gguf_with_a_bad_key_is_one_line(keep_containers, tmp_path, monkeypatch, key, value, message):
    pytest.importorskip("gguf")
    from moepack.packer import gguf_source
    from moepack.packer.gguf_export import export_gguf

    export_gguf(keep_containers["bf16"], str(tmp_path / "m.gguf"), progress=False)
    read = gguf_source._value
    monkeypatch.setattr(gguf_source, "_value", lambda reader, k, default=None:
                        value if k == key else read(reader, k, default))
    with pytest.raises(MoepackError) as e:
        convert_checkpoint(str(tmp_path / "m.gguf"), str(tmp_path / "out.moepack"), policy="keep", progress=False)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.skipif(not os.environ.get("MOEPACK_LLAMA_CPP"), reason="MOEPACK_LLAMA_CPP (a llama.cpp build) not set")
# llama.cpp's qwen3moe routes every layer (an export with dense-MLP layers is refused): grouped-query attention, and
# multi-head attention with tied embeddings
@pytest.mark.parametrize("overrides", [CONFIGS["gqa"], dict(num_key_value_heads=4, tie_word_embeddings=True)],
                         ids=["gqa", "mha-tied"])
def test_llama_cpp_runs_the_qwen3moe_export_at_transformers_logits(tmp_path, overrides):
    """llama.cpp (benchmarks/llama_logits: F32 KV cache, flash attention off) on `export --format gguf` of a float32
    random Qwen3MoeForCausalLM gives the last position's logits transformers gives, to float32 rounding, for
    prompts of 1-150 tokens (a model saved without a tokenizer: llama.cpp's vocabulary `none`)."""
    import numpy as np

    from moepack.packer.gguf_export import export_gguf
    from test_gguf_export import llama_cpp_last_logits

    exe = os.path.join(os.environ["MOEPACK_LLAMA_CPP"], "bin", "llama-logits")
    if not os.path.exists(exe):
        pytest.skip("no bin/llama-logits in MOEPACK_LLAMA_CPP (benchmarks/llama_cpp.sh builds it)")
    model = save_model(tmp_path / "hf", overrides, torch.float32)
    container = str(tmp_path / "f32.moepack")
    convert_checkpoint(str(tmp_path / "hf"), container, policy="keep", progress=False)
    out = export_gguf(container, str(tmp_path / "f32.gguf"), progress=False)["output"]
    vocab = model.config.vocab_size
    for n in (1, 40, 150):
        ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        theirs = llama_cpp_last_logits(exe, out, ids, tmp_path)
        ours = reference_logits(model, ids)[-1].numpy()
        assert theirs.shape == ours.shape
        err = np.abs(theirs - ours).max() / np.abs(ours).max()
        assert err < 2e-5, (n, err)


def test_a_single_file_beside_an_index_is_converted_as_transformers_loads_it(tmp_path):
    """transformers' from_pretrained reads model.safetensors where there is one, before model.safetensors.index.json
    (a sharded save_pretrained over a single-file checkpoint leaves the old file there): convert reads that file
    alone, locally and as the hub plan lists it, and the container's logits are transformers' of it."""
    from moepack.packer.hub import resolve_source
    from moepack.runtime.engine import PrefillOptions, prefill

    single = save_model(tmp_path, {}, torch.float32)
    with torch.no_grad():  # other weights, saved as shards + index beside the single file
        for p in single.parameters():
            p.mul_(-1.5)
    single.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and (tmp_path / "model.safetensors").exists()
    want = reference_logits(reference(tmp_path), PROMPT)[-1]
    assert not torch.allclose(want, reference_logits(single, PROMPT)[-1], atol=1e-2)  # it loaded the single file
    assert [n for n in resolve_source(str(tmp_path)).provenance["files"] if n.endswith(".safetensors")] == [
        "model.safetensors"]
    out = str(tmp_path / "m.moepack")
    convert_checkpoint(str(tmp_path), out, policy="keep", progress=False)
    got = prefill(out, PROMPT, PrefillOptions(compute_dtype="float32", expert_selection="all")).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_a_tied_config_beside_a_stored_head_uses_the_stored_head_as_transformers_does(tmp_path):
    """config.json ties the head to the embedding, yet the checkpoint stores an lm_head.weight of its own:
    transformers warns and computes with the stored head; convert says so in a warning and keeps that head (the
    container's config untied), so the logits are transformers'."""
    from safetensors.torch import load_file, save_file

    from moepack.runtime.engine import PrefillOptions, prefill

    save_model(tmp_path, {"tie_word_embeddings": True}, torch.float32)
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in weights  # transformers saves a tied head once
    weights["lm_head.weight"] = torch.randn(weights["model.embed_tokens.weight"].shape,
                                            generator=torch.Generator().manual_seed(3))
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    want = reference_logits(reference(tmp_path), PROMPT)[-1]
    out = str(tmp_path / "m.moepack")
    with pytest.warns(UserWarning, match="stores a head of its own: it is kept and used as the head"):
        convert_checkpoint(str(tmp_path), out, policy="keep", progress=False)
    with Container(out) as c:
        assert c.config["tie_word_embeddings"] is False and "lm_head.weight" in c.tensors
    got = prefill(out, PROMPT, PrefillOptions(compute_dtype="float32", expert_selection="all")).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_a_policy_whose_blocks_do_not_fit_a_width_says_what_it_stored_instead(tmp_path):
    """--q2 on widths that are not whole 256-blocks (hidden 160, experts 96 wide) stores those tensors as Q8_0: a
    larger output than the policy says, which convert now names (inspect alone had shown it); --q8, whose 32-blocks
    fit every width here, says nothing."""
    import warnings

    save_model(tmp_path / "src", {}, torch.float32)
    with pytest.warns(UserWarning, match=r"--q2: 36 tensors with rows of 160 \(not whole IQ2_XXS blocks of 256\) "
                                         r"stored as Q8_0; 18 tensors with rows of 96 \(not whole Q2_K blocks"):
        convert_checkpoint(str(tmp_path / "src"), str(tmp_path / "q2.moepack"), policy="q2", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_checkpoint(str(tmp_path / "src"), str(tmp_path / "q8.moepack"), policy="q8", progress=False)
