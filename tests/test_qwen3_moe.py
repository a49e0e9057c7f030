"""moepack.families.qwen3_moe against transformers' Qwen3MoeForCausalLM (the oracle): a tiny random model of each
configuration, saved with save_pretrained (float32 and bf16), loaded through the family's tensor schema and run by
its forward; the FP8 128x128 block-scaled layout of the official `-FP8` releases made from the same weights."""

from __future__ import annotations

import json

import pytest
import torch

from moepack.families import UnknownFamilyError, family_for, family_named
from moepack.families.base import ROLE_EXPERT, ModelFamily
from moepack.families.qwen3_moe.config import Qwen3MoeConfig
from moepack.families.qwen3_moe.model import KVState, forward, greedy
from moepack.families.qwen3_moe.tensors import EXPERT_NAMING, FP8_SCALE_SUFFIX, load_checkpoint, tensor_specs
from moepack.format_spec.errors import MoepackError

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=300, hidden_size=160, intermediate_size=224, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, moe_intermediate_size=96, num_experts=6, num_experts_per_tok=2,
            norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
CONFIGS = {
    "gqa": {},  # two query heads per KV head, every layer routed
    "sparse-step": dict(decoder_sparse_step=2, mlp_only_layers=[3], num_hidden_layers=4, norm_topk_prob=False),
    "mha-tied": dict(num_key_value_heads=4, tie_word_embeddings=True, mlp_only_layers=[0]),
    "sliding": dict(use_sliding_window=True, sliding_window=4),  # each query attends its last 4 positions
}
PROMPT = [5, 17, 42, 250, 3, 99, 7, 128, 64]


def save_model(directory, overrides: dict, dtype: torch.dtype, without: tuple[str, ...] = ()):
    """A seeded random Qwen3MoeForCausalLM saved to `directory` (BASE with `overrides`, its keys `without` left out
    for transformers' defaults); returns the model (float32)."""
    config = transformers.Qwen3MoeConfig(**{k: v for k, v in {**BASE, **overrides}.items() if k not in without})
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():  # weights well away from zero, so every path shows in the logits
        for p in model.parameters():
            p.normal_(0.0, 0.1) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    model.to(dtype).save_pretrained(directory)
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    """(config name, directory of the float32 checkpoint)."""
    directory = tmp_path_factory.mktemp(f"qwen3-{request.param}")
    save_model(directory, CONFIGS[request.param], torch.float32)
    return request.param, directory


def reference(directory, dtype=torch.float32):
    return transformers.Qwen3MoeForCausalLM.from_pretrained(directory, dtype=dtype).eval()


@torch.no_grad()
def reference_logits(model, ids) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


# ------------------------------------------------------------------------------------------ the forward


def test_logits_equal_transformers_float32(checkpoint):
    _, directory = checkpoint
    ours = forward(load_checkpoint(directory), PROMPT)
    torch.testing.assert_close(ours, reference_logits(reference(directory), PROMPT), atol=1e-5, rtol=1e-5)


def test_greedy_tokens_equal_transformers_generate(checkpoint):
    _, directory = checkpoint
    model = reference(directory)
    with torch.no_grad():
        theirs = model.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert greedy(load_checkpoint(directory), PROMPT, 8) == theirs[0, len(PROMPT):].tolist()


def test_a_token_continues_the_prefills_kv_state(checkpoint):
    _, directory = checkpoint
    loaded = load_checkpoint(directory)
    kv = KVState.empty(loaded.config)
    forward(loaded, PROMPT[:5], kv)
    continued = torch.cat([forward(loaded, [t], kv) for t in PROMPT[5:]])
    assert kv.length == len(PROMPT)
    torch.testing.assert_close(continued, forward(loaded, PROMPT)[5:], atol=1e-5, rtol=1e-5)


def test_bf16_checkpoint(tmp_path):
    """A bf16 checkpoint: our float32 forward over its weights equals transformers' float32 load of it to ~1e-5;
    both computing in bf16 agree within bf16's rounding, on the same greedy tokens."""
    save_model(tmp_path, {}, torch.bfloat16)
    ours = forward(load_checkpoint(tmp_path), PROMPT)
    torch.testing.assert_close(ours, reference_logits(reference(tmp_path), PROMPT), atol=1e-5, rtol=1e-5)
    ours16 = forward(load_checkpoint(tmp_path, dtype=torch.bfloat16), PROMPT)
    theirs16 = reference_logits(reference(tmp_path, torch.bfloat16), PROMPT)
    scale = theirs16.abs().max()
    assert (ours16 - theirs16).abs().max() <= 0.03 * scale
    assert (ours16 - ours).abs().max() <= 0.03 * scale


# ------------------------------------------------------------------------------------------ the tensor schema


def test_the_schema_is_every_tensor_of_the_checkpoint(checkpoint):
    from safetensors import safe_open

    name, directory = checkpoint
    config = Qwen3MoeConfig.from_hf(json.loads((directory / "config.json").read_text()))
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert stored == {s.name: s.shape for s in tensor_specs(config)}
    experts = [s for s in tensor_specs(config) if s.role == ROLE_EXPERT]
    assert len(experts) == 3 * config.num_experts * len(config.moe_layers)
    assert config.moe_layers == {"gqa": (0, 1, 2), "sparse-step": (1,), "mha-tied": (1, 2), "sliding": (0, 1, 2)}[name]


def test_gguf_names_are_llama_cpps_qwen3moe():
    """Each tensor's GGUF name is what gguf-py's own name map (the one convert_hf_to_gguf.py uses) gives its
    transformers name in the qwen3moe architecture; a routed expert's is its layer's stacked tensor; llama.cpp's
    qwen3moe has no dense-MLP layer, so those have none."""
    gguf = pytest.importorskip("gguf")
    config = Qwen3MoeConfig.from_hf({**BASE, "mlp_only_layers": [0]})
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, config.num_layers)
    specs = tensor_specs(config)
    for spec in specs:
        hf = spec.name if spec.expert is None else spec.name.replace(f".experts.{spec.expert}.", ".experts.")
        assert spec.gguf == name_map.get_name(hf, try_suffixes=(".weight",)), spec
    assert [s.name for s in specs if s.gguf is None] == [f"model.layers.0.mlp.{m}_proj.weight"
                                                          for m in ("gate", "up", "down")]
    assert EXPERT_NAMING.names(2, 5)["down"] == "model.layers.2.mlp.experts.5.down_proj.weight"


def _rewrite(directory, change):
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("damage, message", [
    (lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"),
     "tensor model.layers.1.mlp.experts.3.up_proj.weight is missing"),
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(32, 160)}),
     "tensor model.layers.0.self_attn.k_proj.weight has shape [32, 160], the config implies [64, 160]"),
    (lambda t: t.update({"model.layers.0.mlp.experts.6.up_proj.weight": torch.zeros(96, 160)}),
     "tensor model.layers.0.mlp.experts.6.up_proj.weight is not one a qwen3-moe config implies"),
    (lambda t: t.update({"model.norm.weight": torch.zeros(160, dtype=torch.int32)}),
     "tensor model.norm.weight is torch.int32, not a float type"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(128, 160, dtype=torch.float8_e4m3fn)}),
     "tensor model.layers.0.self_attn.q_proj.weight is FP8 without a quantization_config"),
])
def test_a_missing_misshapen_or_unknown_tensor_is_refused_by_name(tmp_path, damage, message):
    save_model(tmp_path, {}, torch.float32)
    _rewrite(tmp_path, damage)
    with pytest.raises(MoepackError) as e:
        load_checkpoint(tmp_path)
    assert message in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------ the -FP8 layout

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # the router stays bf16


def fp8_release(directory):
    """Rewrite a checkpoint as Qwen's `-FP8` releases store it: each linear (not the embedding, the head, the norms
    or the routers) F8_E4M3 with `weight_scale_inv` BF16 per 128x128 block (amax / 448, not a power of two), the
    rest BF16, config.json's quantization_config fp8 [128, 128]. Returns {name: the FP8 weight's values}."""
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors, out, values = load_file(str(path)), {}, {}
    for name, w in tensors.items():
        if name.rsplit(".", 2)[-2] not in QUANTIZED:
            out[name] = w.to(torch.bfloat16)
            continue
        rows, cols = w.shape
        padded = torch.nn.functional.pad(w.float(), (0, -cols % 128, 0, -rows % 128))
        blocks = padded.view(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128)
        scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).to(torch.bfloat16)
        per_element = scale.float().repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
        out[name] = (w.float() / per_element).to(torch.float8_e4m3fn)
        out[name + FP8_SCALE_SUFFIX] = scale
        values[name] = out[name].float() * per_element
    save_file(out, str(path), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [128, 128]}
    (directory / "config.json").write_text(json.dumps(config))
    return values


def save_widened(model, fp8, values: dict, widened) -> None:
    """Save `model` to `widened` with the FP8 release `fp8`'s dequantized `values` (fp8_release's) in float32: the
    same model as transformers loads it without an FP8 quantizer."""
    from safetensors.torch import load_file, save_file

    model.save_pretrained(widened)
    tensors = {n: t.float() for n, t in load_file(str(fp8 / "model.safetensors")).items()
               if not n.endswith(FP8_SCALE_SUFFIX)}
    save_file({**tensors, **values}, str(widened / "model.safetensors"), metadata={"format": "pt"})


def test_fp8_release_layout(tmp_path):
    """Loaded from the FP8 layout, the logits equal transformers' over the same dequantized weights (float32), and
    stay within FP8's rounding of the model it was made from."""
    fp8, widened = tmp_path / "fp8", tmp_path / "widened"
    model = save_model(fp8, {}, torch.float32)
    values = fp8_release(fp8)
    loaded = load_checkpoint(fp8)
    for name, value in values.items():  # the codec's dequantization is the layout's arithmetic
        assert torch.equal(loaded.tensors[name], value), name
    assert loaded.tensors["model.layers.0.self_attn.q_proj.weight"].shape == (128, 160)  # edge blocks
    ours = forward(loaded, PROMPT)

    save_widened(model, fp8, values, widened)
    torch.testing.assert_close(ours, reference_logits(reference(widened), PROMPT), atol=1e-5, rtol=1e-5)

    originals = dict(model.named_parameters())  # (transformers holds the experts fused: the others compared)
    for name, value in values.items():
        if name in originals:  # e4m3 keeps 3 mantissa bits: a few per cent of each weight
            assert (value - originals[name]).norm() / originals[name].norm() < 0.05, name
    want = reference_logits(model, PROMPT)
    relative = (ours - want).norm() / want.norm()
    assert 0 < relative < 0.3, relative  # through 3 layers of random weights, a routing choice or two flipped


O_PROJ = "model.layers.2.self_attn.o_proj.weight"


@pytest.mark.parametrize("damage, message", [
    (lambda t: t.pop(O_PROJ + FP8_SCALE_SUFFIX), f"tensor {O_PROJ} is FP8 without {O_PROJ}{FP8_SCALE_SUFFIX}"),
    (lambda t: t.update({O_PROJ + FP8_SCALE_SUFFIX: torch.ones(1, 1, dtype=torch.bfloat16)}),
     f"{O_PROJ}: FP8 scale shape [1, 1] does not match weight [160, 128] in 128x128 blocks (expected [2, 1])"),
])
def test_fp8_with_a_missing_or_misshapen_scale_is_refused(tmp_path, damage, message):
    save_model(tmp_path, {}, torch.float32)
    fp8_release(tmp_path)
    _rewrite(tmp_path, damage)
    with pytest.raises(MoepackError) as e:
        load_checkpoint(tmp_path)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("quantization, message", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "only e4m3 in 128x128 blocks is supported"),
])
def test_a_quantization_other_than_the_fp8_releases_is_refused(tmp_path, quantization, message):
    save_model(tmp_path, {}, torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(MoepackError, match=f"config.json quantization_config: {message}"):
        load_checkpoint(tmp_path)


# ------------------------------------------------------------------------------------------ config and registry


@pytest.mark.parametrize("change, field", [
    (dict(hidden_size=0), "hidden_size"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(num_key_value_heads=8), "num_key_value_heads"),
    (dict(num_experts_per_tok=7), "num_experts_per_tok"),
    (dict(num_experts=0), "num_experts"),
    (dict(head_dim=33), "head_dim"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps"),
    (dict(vocab_size=True), "vocab_size"),
    (dict(mlp_only_layers=[0, "3"]), "mlp_only_layers"),
    (dict(mlp_only_layers=list(range(5000))), "mlp_only_layers"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step"),
    (dict(norm_topk_prob="yes"), "norm_topk_prob"),
    (dict(use_sliding_window="yes"), "use_sliding_window"),
    (dict(use_sliding_window=True, sliding_window=1), "sliding_window"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0}), "rope_parameters"),
    (dict(rope_parameters=None, rope_scaling={"rope_type": "longrope", "factor": 4.0}), "rope_scaling"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6}), "rope_parameters.factor"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0, "partial_rotary_factor": 0.5}),
     "rope_parameters.partial_rotary_factor"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0,
                           "original_max_position_embeddings": 16.5}), "rope_parameters.original_max_position_"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "truncate": "no"}),
     "rope_parameters.truncate"),
    (dict(rope_parameters=None, rope_theta=-1.0), "rope_theta"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0},
          rope_scaling={"rope_type": "linear", "factor": 4.0}), "rope_parameters and rope_scaling disagree"),
])
def test_an_absurd_config_is_one_line_naming_the_field(change, field):
    with pytest.raises(MoepackError) as e:
        Qwen3MoeConfig.from_hf({**BASE, **change})
    assert f"config.json {field}" in str(e.value) and "\n" not in str(e.value)


def test_configs_transformers_reads_past_give_its_logits(tmp_path):
    """What transformers' Qwen3-MoE reads past is read past, not refused: a head_dim left out where the heads do
    not divide hidden_size (its floor, 172 // 6 = 28), mlp_only_layers naming no layer (5, -1) beside one that
    does, use_sliding_window true with sliding_window null (full attention), hidden_act "swish" (SiLU's other
    name)."""
    overrides = dict(hidden_size=172, num_attention_heads=6, mlp_only_layers=[5, 0, -1], use_sliding_window=True,
                     sliding_window=None, hidden_act="swish")
    save_model(tmp_path, overrides, torch.float32, without=("head_dim",))
    loaded = load_checkpoint(tmp_path)
    assert (loaded.config.head_dim, loaded.config.moe_layers) == (28, (1, 2))
    model = reference(tmp_path)
    torch.testing.assert_close(forward(loaded, PROMPT), reference_logits(model, PROMPT), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        theirs = model.generate(torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert greedy(loaded, PROMPT, 4) == theirs[0, len(PROMPT):].tolist()


def test_a_sliding_window_is_read_as_transformers_reads_it():
    """use_sliding_window true: sliding_window, its default 4096 where absent, none where null; false: none, a
    sliding_window beside it dropped."""
    for change, window in ((dict(use_sliding_window=True), 4096), (dict(use_sliding_window=True, sliding_window=8), 8),
                           (dict(use_sliding_window=True, sliding_window=None), None),
                           (dict(use_sliding_window=False, sliding_window=8), None)):
        assert Qwen3MoeConfig.from_hf({**BASE, **change}).sliding_window == window, change
        assert transformers.Qwen3MoeConfig(**BASE, **change).sliding_window == window, change


def test_a_sliding_windows_attention_flops_are_bounded_by_it():
    """Query t reads min(t + 1, W) keys: up to W tokens the full attention's (N + 1) / 2 on average, past it
    (W (W + 1) / 2 + (N - W) W) / N, every layer."""
    family = family_named("qwen3-moe")
    config = Qwen3MoeConfig.from_hf({**BASE, **CONFIGS["sliding"]})
    per_key = 4 * config.num_heads * config.head_dim * config.num_layers
    assert family.attention_flops(config, 4) == {"window": 0.0, "growing": per_key * 2.5, "total": per_key * 2.5}
    assert family.attention_flops(config, 8) == {"window": per_key * 26 / 8, "growing": 0.0, "total": per_key * 26 / 8}


def test_a_sliding_window_masks_a_fused_attention_chunk(tmp_path):
    """27 queries from the sequence's start go through torch's fused attention: past the window its causal mask
    alone would let them see too far."""
    from moepack.families.qwen3_moe.model import FUSED_MIN_QUERIES

    save_model(tmp_path, CONFIGS["sliding"], torch.float32)
    ids = PROMPT * 3
    assert len(ids) >= FUSED_MIN_QUERIES
    torch.testing.assert_close(forward(load_checkpoint(tmp_path), ids), reference_logits(reference(tmp_path), ids),
                               atol=1e-5, rtol=1e-5)


def test_both_spellings_of_a_config():
    """The releases' num_experts / rope_theta and transformers 5's num_local_experts / rope_parameters."""
    release = {k: v for k, v in BASE.items() if k != "rope_parameters"} | {"rope_theta": 1e6}
    written = {k: v for k, v in BASE.items() if k != "num_experts"} | {"num_local_experts": 6}
    assert Qwen3MoeConfig.from_hf(release).rope_theta == 1e6
    assert Qwen3MoeConfig.from_hf(written).num_experts == 6
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}  # both names, agreeing: one scaling
    both = Qwen3MoeConfig.from_hf(BASE | {"rope_theta": 1e6, "rope_parameters": yarn,
                                          "rope_scaling": {"type": "yarn", "factor": 4.0}})
    assert both.rope_scaling == Qwen3MoeConfig.from_hf(BASE | {"rope_parameters": yarn}).rope_scaling


# The RoPE scalings Qwen's model cards configure (YaRN, factor 4 over 32768 positions, as rope_scaling) and
# transformers' other spellings of them, each field chosen so that it moves the logits.
SCALED_ROPES = {
    "yarn-release": dict(rope_parameters=None, rope_theta=1e6, max_position_embeddings=64,
                         rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    "yarn-untruncated-mscale": dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "original_max_position_embeddings": 4096,
        "truncate": False, "mscale": 0.8, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2}),
    "yarn-attention-factor": dict(max_position_embeddings=32, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "attention_factor": 1.3}),
    "linear": dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 3.0}),
    # what transformers reads as its defaults (a beta of 0 or null) or as a number (a context length 16.0)
    "yarn-transformers-defaults": dict(max_position_embeddings=64, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16.0,
        "beta_fast": 0, "beta_slow": None}),
}


@pytest.mark.parametrize("name", sorted(SCALED_ROPES))
def test_a_scaled_rope_gives_transformers_logits(tmp_path, name):
    save_model(tmp_path, SCALED_ROPES[name], torch.float32)
    loaded = load_checkpoint(tmp_path)
    assert loaded.config.rope_scaling.kind == name.split("-")[0]
    ids = PROMPT * 3
    torch.testing.assert_close(forward(loaded, ids), reference_logits(reference(tmp_path), ids), atol=1e-5,
                               rtol=1e-5)


def test_yarn_without_its_original_context_takes_max_position_embeddings():
    """As transformers' rope standardisation fills it in (a config.json written by hand may leave it out)."""
    raw = {**BASE, "max_position_embeddings": 128, "rope_parameters": None, "rope_theta": 1e6,
           "rope_scaling": {"type": "yarn", "factor": 4.0}}
    scaling = Qwen3MoeConfig.from_hf(raw).rope_scaling
    assert (scaling.kind, scaling.factor, scaling.original_max_position_embeddings) == ("yarn", 4.0, 128)
    assert scaling == Qwen3MoeConfig.from_hf({**raw, **transformers.Qwen3MoeConfig(**raw).to_dict()}).rope_scaling


def test_the_rope_frequencies_made_for_a_device_are_kept_for_the_process():
    """A decode step's CUDA graphs read them by address: made once per config and device, never evicted for
    others made since (freed, their memory would be reused under the graphs)."""
    from moepack.families.qwen3_moe.model import rope_frequencies

    cpu = torch.device("cpu")
    c = Qwen3MoeConfig.from_hf({**BASE, "rope_parameters": None, "rope_theta": 1e4})
    kept = rope_frequencies(c, cpu)
    for theta in range(32):
        rope_frequencies(Qwen3MoeConfig.from_hf({**BASE, "rope_parameters": None, "rope_theta": 2e4 + theta}), cpu)
    assert rope_frequencies(c, cpu) is kept


def test_family_for_picks_qwen3_moe_and_refuses_the_unknown():
    family = family_for({"architectures": ["Qwen3MoeForCausalLM"]})
    assert isinstance(family, ModelFamily) and family is family_named("qwen3-moe")
    assert family_for({"model_type": "qwen3_moe"}) is family
    shape = family.shape(family.parse_config({**BASE, "mlp_only_layers": [1]}))
    assert (shape.num_experts, shape.top_k, shape.moe_layers, shape.dense_layers) == (6, 2, (0, 2), (1,))
    for config in ({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss"}, {}, []):
        with pytest.raises(UnknownFamilyError, match=r"supported: .*qwen3-moe \(Qwen3MoeForCausalLM, qwen3_moe\)"):
            family_for(config)
    with pytest.raises(UnknownFamilyError, match="unknown model family 'gpt-oss'"):
        family_named("gpt-oss")


def test_the_chat_template_comes_from_the_tokenizer_config():
    family = family_named("qwen3-moe")
    assert family.chat_template({"chat_template": "{{ messages }}"}) == "{{ messages }}"
    assert family.chat_template({"chat_template": [{"name": "tool_use", "template": "t"},
                                                   {"name": "default", "template": "d"}]}) == "d"
    assert family.chat_template({}) is None


# ------------------------------------------------------------------------------------------ moepack synth --family


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory):
    """`moepack synth --family qwen3-moe` in each layout: {layout: directory}."""
    from click.testing import CliRunner

    from moepack.cli.main import cli

    base, out = tmp_path_factory.mktemp("qwen3-synth"), {}
    for layout in ("release", "bf16", "f32"):
        out[layout] = base / layout
        r = CliRunner().invoke(cli, ["synth", str(out[layout]), "--family", "qwen3-moe", "--layout", layout, "--json"])
        assert r.exit_code == 0, r.output
        summary = json.loads(r.output)
        assert (summary["family"], summary["preset"], summary["layout"]) == ("qwen3-moe", "tiny", layout)
    return out


def test_synth_writes_a_checkpoint_transformers_runs_as_our_forward(synthesized):
    loaded = load_checkpoint(synthesized["f32"])
    assert loaded.config.num_kv_heads < loaded.config.num_heads and loaded.config.moe_layers == (0, 1, 2, 3)
    ours = forward(loaded, PROMPT)
    torch.testing.assert_close(ours, reference_logits(reference(synthesized["f32"]), PROMPT), atol=1e-4, rtol=1e-5)
    for layout in ("bf16", "release"):  # the same model drawn: bf16's and FP8's rounding of it
        other = forward(load_checkpoint(synthesized[layout]), PROMPT)
        assert (other - ours).norm() / ours.norm() < {"bf16": 0.02, "release": 0.3}[layout]


def test_synth_release_layout_is_the_fp8_releases(synthesized):
    from safetensors import safe_open

    directory = synthesized["release"]
    config = json.loads((directory / "config.json").read_text())
    assert config["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "weight_block_size": [128, 128]}
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    dtypes = {}
    for shard in sorted(set(index.values())):
        with safe_open(str(directory / shard), "pt") as f:
            dtypes.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
    assert set(dtypes) == set(index)
    for name, dtype in dtypes.items():
        if name.endswith(FP8_SCALE_SUFFIX):
            assert dtype == "BF16" and dtypes[name.removesuffix(FP8_SCALE_SUFFIX)] == "F8_E4M3", name
            continue
        quantized = name.rsplit(".", 2)[-2] in QUANTIZED
        assert dtype == ("F8_E4M3" if quantized else "BF16"), name
        assert (name + FP8_SCALE_SUFFIX in dtypes) == quantized, name
    assert dtypes["model.layers.0.mlp.gate.weight"] == "BF16"  # the router stays BF16


def test_synth_tokenizer_carries_qwens_chat_template(synthesized):
    tokenizer = transformers.AutoTokenizer.from_pretrained(synthesized["bf16"])
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    config = json.loads((synthesized["bf16"] / "tokenizer_config.json").read_text())
    assert family_named("qwen3-moe").chat_template(config) == config["chat_template"]
    assert tokenizer.eos_token_id == json.loads((synthesized["bf16"] / "config.json").read_text())["eos_token_id"]


def test_synth_refusals_are_one_line(tmp_path):
    from click.testing import CliRunner

    from moepack.cli.main import cli
    from moepack.packer.synth import synth_checkpoint

    r = CliRunner().invoke(cli, ["synth", str(tmp_path / "out"), "--family", "qwen3-moe", "--tokenizer", "."])
    message = "--tokenizer and random expert codes are for deepseek-v4 only, not qwen3-moe"
    assert r.exit_code == 1 and message in r.output and len(r.output.strip().splitlines()) == 1
    with pytest.raises(MoepackError, match=r"^unknown qwen3-moe preset 'huge' \(choose one of tiny, small, medium\)$"):
        synth_checkpoint(str(tmp_path / "out"), preset="huge", family="qwen3-moe", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_directory_that_is_no_checkpoint_is_one_line(tmp_path):
    with pytest.raises(MoepackError, match="no config.json"):
        load_checkpoint(tmp_path)
    save_model(tmp_path, {}, torch.float32)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(MoepackError, match="not a safetensors file the safetensors library reads") as e:
        load_checkpoint(tmp_path)
    assert "\n" not in str(e.value)


def test_the_family_computes_a_layer_as_the_forward_does(checkpoint):
    """The protocol's pieces (embed, before_experts, expert_ffn, after_experts, head) make the same logits."""
    _, directory = checkpoint
    loaded, family = load_checkpoint(directory), family_named("qwen3-moe")
    config = family.parse_config(loaded.raw_config)
    kv = family.new_kv(config)
    hidden = family.embed(config, loaded.globals, torch.tensor(PROMPT))
    for layer in range(config.num_layers):
        w = loaded.layer(layer)
        residual, x, routing = family.before_experts(config, layer, w, hidden, kv)
        out = None
        if routing is not None:
            out = torch.zeros_like(x)
            experts = loaded.experts(layer)
            for token in range(len(PROMPT)):
                for expert, weight in zip(routing.experts[token].tolist(), routing.weights[token]):
                    out[token] += weight * family.expert_ffn(config, experts[expert], x[token:token + 1])[0]
        hidden = family.after_experts(config, layer, w, residual, x, out)
    torch.testing.assert_close(family.head(config, loaded.globals, hidden), forward(loaded, PROMPT),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_the_fp8_codec_takes_float_block_scales(scale_dtype, out_dtype):
    """format_spec's F8_E4M3 codec under float scales (not powers of two): each element times its block's scale,
    partial edge blocks included; E8M0 scales decode as before."""
    from moepack.format_spec import decode
    from moepack.format_spec.source_formats import fp8_block_dequantize, fp8_block_quantize

    weight = (torch.randn(200, 300, generator=torch.Generator().manual_seed(1)) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, generator=torch.Generator().manual_seed(2)).add_(0.01).to(scale_dtype)
    got = decode.decode_float("F8_E4M3", (200, 300), weight.view(torch.uint8).reshape(-1), scale, out_dtype)
    per_element = scale.float().repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert got.dtype == out_dtype and torch.equal(got, (weight.float() * per_element).to(out_dtype))
    w8, e8m0 = fp8_block_quantize(torch.randn(200, 300))
    assert torch.equal(decode.decode_float("F8_E4M3", (200, 300), w8.view(torch.uint8).reshape(-1), e8m0),
                       fp8_block_dequantize(w8, e8m0))


def test_synth_is_seeded_refuses_to_overwrite_and_leaves_nothing_when_a_write_fails(tmp_path, monkeypatch):
    import errno

    import moepack.packer.synth as synth

    def files(directory):
        return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}

    a = synth.synth_checkpoint(tmp_path / "a", family="qwen3-moe", seed=3, progress=False)
    synth.synth_checkpoint(tmp_path / "b", family="qwen3-moe", seed=3, progress=False)
    assert files(tmp_path / "a") == files(tmp_path / "b") and sorted(files(tmp_path / "a")) == a["files"]
    with pytest.raises(MoepackError, match="already holds a checkpoint"):
        synth.synth_checkpoint(tmp_path / "a", family="qwen3-moe", seed=4, progress=False)
    assert files(tmp_path / "a") == files(tmp_path / "b")

    def disk_full(self, name, tensor):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.partial))

    monkeypatch.setattr(synth._ShardWriter, "write", disk_full)
    with pytest.raises(MoepackError, match=r"^writing .*failed: No space left on device \(disk full\)$"):
        synth.synth_checkpoint(tmp_path / "c", family="qwen3-moe", progress=False)
    assert list((tmp_path / "c").iterdir()) == []


def test_a_decoded_tokens_keys_go_into_room_kept_for_them_not_a_copy_of_the_kv():
    """LayerKV.append after a prefill's: the rows land in buffers with room for more (a copy of the whole KV only
    when the room is used up, a 32nd more at a time), the keys and values exactly torch.cat's; keys or values set
    from outside since (a KV file's, a moved state's) are what the next append continues."""
    from moepack.families.qwen3_moe.model import ROOM_ROWS, LayerKV

    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 10, 8, generator=gen), torch.randn(2, 10, 8, generator=gen)
    kv, buffers = LayerKV(), set()
    kv.append(keys, values)
    for _ in range(3 * ROOM_ROWS):
        k, v = torch.randn(2, 1, 8, generator=gen), torch.randn(2, 1, 8, generator=gen)
        keys, values = torch.cat((keys, k), dim=1), torch.cat((values, v), dim=1)
        got = kv.append(k, v)
        buffers.add(got[0].data_ptr())
        assert torch.equal(got[0], keys) and torch.equal(got[1], values) and kv.length == keys.shape[1]
    assert len(buffers) <= 3  # 3 x ROOM_ROWS tokens: room made after the prefill's, then grown twice at most
    keys, values = torch.randn(2, 5, 8, generator=gen), torch.randn(2, 5, 8, generator=gen)
    kv.keys, kv.values = keys, values  # set from outside: continued as it is now
    k, v = torch.randn(2, 1, 8, generator=gen), torch.randn(2, 1, 8, generator=gen)
    got = kv.append(k, v)
    assert torch.equal(got[0], torch.cat((keys, k), dim=1)) and kv.length == 6
    assert torch.equal(got[1], torch.cat((values, v), dim=1))


@pytest.mark.parametrize("past", [0, 37])
def test_attention_chunks_of_many_queries_take_the_fused_kernel_and_agree_with_float64(monkeypatch, past):
    """A chunk of FUSED_MIN_QUERIES queries or more goes through torch's fused attention (the kernel's own causal
    mask where the chunk starts the sequence, else the chunk's mask), fewer through the grouped matmuls; chunks of
    every size, after a past or not, give the causal GQA attention a float64 computation gives."""
    import torch.nn.functional as F

    from moepack.families.qwen3_moe import model

    c = Qwen3MoeConfig.from_hf({"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2,
                                  "head_dim": 16, "num_hidden_layers": 1, "num_experts": 4,
                                  "num_experts_per_tok": 2, "moe_intermediate_size": 8, "intermediate_size": 8,
                                  "vocab_size": 32})
    n = 80
    g = torch.Generator().manual_seed(2)
    q = torch.randn(8, n, 16, generator=g)
    keys, values = (torch.randn(2, past + n, 16, generator=g) for _ in range(2))
    positions = torch.arange(past, past + n)
    heads = 8 // 2
    k64, v64 = (t.double().repeat_interleave(heads, 0) for t in (keys, values))
    scores = (q.double() @ k64.transpose(1, 2)) / 4.0
    scores = scores.masked_fill(torch.arange(past + n)[None, :] > positions[:, None], float("-inf"))
    want = (torch.softmax(scores, -1) @ v64).transpose(0, 1).reshape(n, -1)
    fused, whole = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        fused.append((args[0].shape[2], kwargs["is_causal"]))
        return whole(*args, **kwargs)
    monkeypatch.setattr(model.F, "scaled_dot_product_attention", spy)
    for chunk in (1, 7, model.FUSED_MIN_QUERIES - 1, model.FUSED_MIN_QUERIES, 33, n):
        fused.clear()
        got = model.attention_over(c, q, keys, values, positions, chunk)
        assert (got.double() - want).abs().max() < 1e-5, chunk
        sizes = [min(chunk, n - s) for s in range(0, n, chunk)]
        assert [rows for rows, _ in fused] == [m for m in sizes if m >= model.FUSED_MIN_QUERIES], chunk
        assert [causal for _, causal in fused] == [past == 0 and i == 0 for i, m in enumerate(sizes)
                                                   if m >= model.FUSED_MIN_QUERIES], chunk


ATTENTION_PEAK = """
import json, torch
from moepack.families.qwen3_moe import model, prefill
from moepack.families.qwen3_moe.config import Qwen3MoeConfig


def status(field):  # bytes (the file says kB)
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":")) << 10


torch.set_num_threads(2)
c = Qwen3MoeConfig.from_hf({"hidden_size": 1024, "num_attention_heads": 32, "num_key_value_heads": 4,
                            "head_dim": 128, "num_hidden_layers": 1, "num_experts": 4, "num_experts_per_tok": 2,
                            "moe_intermediate_size": 8, "intermediate_size": 8, "vocab_size": 32})
T, chunk = 16384, 1024
q = torch.randn(32, chunk, 128)
keys, values = torch.randn(4, T, 128), torch.randn(4, T, 128)
positions = torch.arange(T - chunk, T)
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) from here on
except OSError as e:
    print(json.dumps({"skip": f"no resettable peak RSS here: {e}"}))
    raise SystemExit(0)
before = status("VmRSS")
model.attention_over(c, q, keys, values, positions, chunk)
grown = status("VmHWM") - before
cpu = prefill._attention_bytes(c, T, chunk, torch.device("cpu"))
print(json.dumps({"grown": grown, "cpu": cpu, "elsewhere": prefill._attention_bytes(c, T, chunk, None)}))
"""


def test_a_cpu_prefills_attention_estimate_covers_what_the_fused_kernel_holds():
    """The memory check's attention term on a CPU is what torch's fused attention holds for a chunk (its mask, not
    the [heads, chunk, T] scores: a 16,384-token prompt's last chunk of 1,024 queries), measured as the process's
    peak: at least that, and a small part of the scores' bytes the check counts where the kernels may hold them."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", ATTENTION_PEAK], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    peak = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in peak:
        pytest.skip(peak["skip"])
    assert 0 < peak["grown"] <= peak["cpu"] < peak["elsewhere"] / 10, peak
