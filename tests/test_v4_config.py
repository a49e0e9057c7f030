"""moepack.families.deepseek_v4: the one config.json reader (both spellings, every field checked), and the tensor names
table."""

from __future__ import annotations

import copy
import json
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402
from v4_models import CONFIGS  # noqa: E402

from moepack.families.deepseek_v4 import config as V, kv as K, names as N  # noqa: E402
from moepack.families.deepseek_v4.config import CSA, HCA, SLIDING, ConfigError, ModelConfig  # noqa: E402
from moepack.families.deepseek_v4.tensors import v4_tensor_specs  # noqa: E402
from moepack.format_spec.errors import FormatError, MoepackError  # noqa: E402
from moepack.packer.synth import preset_config  # noqa: E402

RELEASE = os.path.join(os.path.dirname(__file__), "data", "deepseek-v4-flash.config.json")


def release_config() -> dict:
    with open(RELEASE) as f:
        return json.load(f)


def transformers_dict(config: dict) -> dict:
    """transformers' reading of a config.json, as its to_dict() writes it back."""
    return DeepseekV4Config(**{k: v for k, v in config.items() if k != "architectures"}).to_dict()


def legacy_spelling(config: dict) -> dict:
    """The same model with the release's legacy keys instead of transformers' lists and nested ropes."""
    c = {k: v for k, v in config.items() if k not in ("layer_types", "mlp_layer_types", "rope_parameters",
                                                       "partial_rotary_factor")}
    ratio = {SLIDING: 0, CSA: 4, HCA: 128}
    c["compress_ratios"] = [ratio[t] for t in config["layer_types"]] + [0]  # one more for the MTP layer
    c["num_hash_layers"] = config["mlp_layer_types"].count("hash_moe")
    c["qk_rope_head_dim"] = int(config["head_dim"] * config["partial_rotary_factor"])
    compress = config["rope_parameters"]["compress"]
    c["rope_scaling"] = {k: compress[k] for k in ("type", "factor", "beta_fast", "beta_slow",
                                                   "original_max_position_embeddings")}
    return c


def test_release_config_in_both_spellings_and_as_transformers_reads_it():
    release = release_config()
    cfg = ModelConfig.from_hf(release)
    assert cfg == ModelConfig.from_hf(transformers_dict(release)) == ModelConfig.from_hf(legacy_spelling(release))
    assert cfg.num_layers == 43 and cfg.layer_types.count(CSA) == cfg.layer_types.count(HCA) == 20
    assert cfg.compress_rates[:4] == (0, 0, 4, 128) and cfg.hash_layers[:4] == (True, True, True, False)
    assert cfg.main_rope.dim == cfg.compress_rope.dim == 64 and cfg.compress_rope.scaling == "yarn"
    assert V.kv_geometry(release) == V.kv_geometry(legacy_spelling(release))
    assert V.mtp_layer_types(release) == V.mtp_layer_types(legacy_spelling(release)) == (SLIDING,)
    assert V.quant_method(release) == "fp8"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_test_configurations_read_as_transformers_reads_them(name):
    config = CONFIGS[name]
    hf = transformers_dict(config)
    cfg = ModelConfig.from_hf(config)
    assert cfg == ModelConfig.from_hf(hf)
    geometry = V.kv_geometry(config)
    assert geometry == V.kv_geometry(hf) == K.kv_geometry(hf)
    assert (tuple(geometry["layer_types"]), tuple(geometry["compress_rates"])) == (cfg.layer_types, cfg.compress_rates)
    assert (geometry["sliding_window"], geometry["head_dim"], geometry["index_head_dim"]) == \
        (cfg.sliding_window, cfg.head_dim, cfg.index_head_dim)
    assert cfg.hash_layers == tuple(t == "hash_moe" for t in hf["mlp_layer_types"])
    assert cfg.main_rope.dim == cfg.compress_rope.dim == hf["qk_rope_head_dim"]


YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
ROPE_FORMS = {  # config changes: the RoPE spellings transformers reads in a way of its own
    "nested, no rope_theta": dict(rope_theta=5000.0, rope_parameters={"main": {"rope_type": "default"},
                                                                      "compress": dict(YARN)}),
    "nested, top-level share": dict(partial_rotary_factor=0.25, rope_parameters={
        "main": {"rope_type": "default", "rope_theta": 1e4}, "compress": {"rope_type": "default", "rope_theta": 2e4}}),
    "rope_scaling over rope_parameters": dict(rope_scaling={"rope_type": "default"}, rope_parameters=dict(YARN)),
    "rope_scaling yarn over default": dict(rope_scaling=dict(YARN), rope_parameters={"rope_type": "default"}),
    "empty rope_scaling": dict(rope_scaling={}, rope_parameters=dict(YARN)),
    "yarn without original_max_position_embeddings": dict(max_position_embeddings=256, rope_parameters={
        "rope_type": "yarn", "factor": 2.0}),
    "nested yarn, whole-float original_max_position_embeddings": dict(rope_parameters={
        "main": {"rope_type": "default", "rope_theta": 1e4}, "compress": {**YARN, "rope_theta": 2e4,
                                                                          "original_max_position_embeddings": 64.0}}),
}


@pytest.mark.parametrize("form", ROPE_FORMS)
def test_rope_spellings_read_as_transformers_reads_them(form):
    """A nested rope without rope_theta takes the top-level one (the compressed rope too; it had been refused), a
    non-empty rope_scaling wins over rope_parameters (rope_parameters had won: another RoPE, silently), a YaRN without
    original_max_position_embeddings has max_position_embeddings, a whole float is its int (both had been refused)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    config = {**CONFIGS["B"], "compress_rope_theta": 7e4, **ROPE_FORMS[form]}
    cfg = ModelConfig.from_hf(config)
    rotary = DeepseekV4RotaryEmbedding(DeepseekV4Config(**copy.deepcopy(config)))  # (transformers fills in dicts)
    for kind in ("main", "compress"):
        rope = getattr(cfg, f"{kind}_rope")
        torch.testing.assert_close(rope.inv_freq(), getattr(rotary, f"{kind}_inv_freq"), rtol=0, atol=0)
        assert rope.attention_factor == getattr(rotary, f"{kind}_attention_scaling")


def test_defaults_are_transformers_defaults():
    """An empty config is transformers' default model (the V4-Pro schedule: 2 HCA, then CSA / HCA alternating)."""
    cfg = ModelConfig.from_hf({})
    assert cfg == ModelConfig.from_hf(DeepseekV4Config().to_dict())
    assert cfg.layer_types[:4] == (HCA, HCA, HCA, CSA) and cfg.hash_layers[:4] == (True, True, True, False)
    assert V.mtp_layer_types({}) == ()  # moepack counts no MTP layer unless the config says (transformers: 1)


# --- every field checked -------------------------------------------------------------------------------------------

BAD = [  # (what to change, the field the message must name)
    ({"scoring_func": "foo"}, "scoring_func"),
    ({"rms_norm_eps": "x"}, "rms_norm_eps"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ({"hc_eps": float("nan")}, "hc_eps"),
    ({"index_topk": -1}, "index_topk"),
    ({"routed_scaling_factor": None}, "routed_scaling_factor"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"rope_theta": 0}, "rope_theta"),
    ({"compress_rope_theta": float("inf")}, "compress_rope_theta"),
    ({"hc_sinkhorn_iters": -1}, "hc_sinkhorn_iters"),
    ({"hc_sinkhorn_iters": 0}, "hc_sinkhorn_iters"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"num_hidden_layers": 1 << 20}, "num_hidden_layers"),
    ({"num_hidden_layers": 3.0}, "num_hidden_layers"),
    ({"hidden_size": True}, "hidden_size"),
    ({"vocab_size": 2 ** 64}, "vocab_size"),
    ({"swiglu_limit": None}, "swiglu_limit"),
    ({"swiglu_limit": -1.0}, "swiglu_limit"),
    ({"swiglu_limit": 3.5e38}, "swiglu_limit"),  # overflows the float32 the runtime computes in
    ({"hc_sinkhorn_iters": 10 ** 9}, "hc_sinkhorn_iters"),  # work per token per layer
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ({"layer_types": [SLIDING, "full_attention", HCA, CSA]}, "layer_types[1]"),
    ({"layer_types": [SLIDING, CSA]}, "layer_types"),
    ({"layer_types": "sliding_attention"}, "layer_types"),
    ({"mlp_layer_types": ["hash_moe"]}, "mlp_layer_types"),
    ({"mlp_layer_types": ["hash_moe", "dense", "moe", "moe"]}, "mlp_layer_types[1]"),
    ({"layer_types": None, "compress_ratios": [0, 4, 5, 128]}, "compress_ratios[2]"),
    ({"layer_types": None, "compress_ratios": [0, 4]}, "compress_ratios"),
    ({"compress_rates": {CSA: 0}}, "compress_rates"),
    ({"compress_rates": {"sliding_attention": 4}}, "compress_rates"),
    ({"compress_rates": [4, 128]}, "compress_rates"),
    ({"compress_rate_hca": -8}, "compress_rate_hca"),
    ({"mlp_layer_types": None, "num_hash_layers": -1}, "num_hash_layers"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),  # tiny: 8 experts
    ({"o_groups": 3}, "o_groups"),  # tiny: 4 heads
    ({"partial_rotary_factor": 2}, "partial_rotary_factor"),
    ({"partial_rotary_factor": None, "qk_rope_head_dim": 1000}, "qk_rope_head_dim"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type"),  # scales by the prompt's length
    ({"rope_parameters": {"rope_type": "linear"}}, "factor"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64.5}},
     "original_max_position_embeddings"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": -4.0, "original_max_position_embeddings": 64}}, "factor"),
    ({"rope_parameters": {"main": {"rope_type": "default", "rope_theta": -1.0},
                          "compress": {"rope_type": "default", "rope_theta": 1e4}}}, "rope_theta"),
    ({"partial_rotary_factor": None, "rope_parameters": {"main": {"rope_type": "default"}, "compress": {
        "rope_type": "default", "partial_rotary_factor": 0.125}}}, "rope_parameters.main.partial_rotary_factor"),
    ({"rope_parameters": "yarn"}, "rope_parameters"),
    ({"max_position_embeddings": -1}, "max_position_embeddings"),
]


@pytest.mark.parametrize("change, field", BAD, ids=[field for _, field in BAD])
def test_a_bad_field_is_one_line_naming_it(change, field):
    config = {**preset_config("tiny"), **change}
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(config)
    message = str(e.value)
    assert isinstance(e.value, MoepackError) and "\n" not in message, message
    assert message.startswith("config.json: ") and field in message, message
    with pytest.raises(MoepackError, match=field.replace("[", r"\[").replace("]", r"\]")):
        v4_tensor_specs(config)


def test_the_example_message():
    expected = r"^config\.json: rms_norm_eps must be a positive number at most 1e\+38, not 'x'$"
    with pytest.raises(ConfigError, match=expected):
        ModelConfig.from_hf({"rms_norm_eps": "x"})
    with pytest.raises(ConfigError, match="not a JSON object"):
        ModelConfig.from_hf([1, 2])


def test_the_kv_geometry_reads_only_its_fields_and_says_so_as_a_format_error():
    config = {**preset_config("tiny"), "scoring_func": "foo"}  # not a geometry field
    assert V.kv_geometry(config)["num_layers"] == 4
    with pytest.raises(FormatError, match=r"^config: sliding_window must be a positive integer, not 0$"):
        K.kv_geometry({**config, "sliding_window": 0})


# Fields whose bad value may be reported against a field that depends on it (the layer lists follow the count,
# top-k is checked against the expert count, o_groups against the heads, the rope dims against head_dim).
RELATED = {
    "num_hidden_layers": ("layer_types", "mlp_layer_types"),
    "n_routed_experts": ("num_experts_per_tok",),
    "num_attention_heads": ("o_groups",),
    "head_dim": ("qk_rope_head_dim",),
    "rope_parameters": ("rope_parameters",),
}
FIELDS = sorted({*V.DEFAULTS, "layer_types", "mlp_layer_types", "compress_rates", "compress_ratios",
                 "compress_rate_csa", "compress_rate_hca", "num_hash_layers", "qk_rope_head_dim",
                 "partial_rotary_factor", "rope_parameters", "rope_scaling", "num_nextn_predict_layers",
                 "quantization_config"})
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=12)
    | st.sampled_from([SLIDING, CSA, HCA, "hash_moe", "moe", "yarn", "default", "sigmoid"]),
    lambda children: st.lists(children, max_size=6) | st.dictionaries(
        st.text(max_size=8) | st.sampled_from([CSA, HCA, "rope_type", "factor", "main", "compress", "rope_theta",
                                               "original_max_position_embeddings"]), children, max_size=5),
    max_leaves=12)


@settings(max_examples=int(os.environ.get("MOEPACK_FUZZ_EXAMPLES", "300")), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from(FIELDS), value=json_values)
def test_any_value_of_any_field_reads_or_fails_as_one_line(field, value):
    config = {**preset_config("tiny"), field: value}
    for read in (ModelConfig.from_hf, V.kv_geometry, V.mtp_layer_types, V.compress_rates_by_type, V.quant_method):
        try:
            read(config)
        except ConfigError as e:  # only ConfigError: any other exception fails the test
            message = str(e)
            assert "\n" not in message and message.startswith("config.json: "), message
            named = (field, *RELATED.get(field, ()))
            assert any(name in message for name in named), (field, message)
    try:
        K.kv_geometry(config)
    except FormatError as e:
        assert "\n" not in str(e)


# --- names ---------------------------------------------------------------------------------------------------------

def _name_configs():
    tiny = preset_config("tiny")  # num_nextn_predict_layers 1: an MTP layer
    tied = {**transformers_dict(CONFIGS["B"]), "tie_word_embeddings": True}
    return {"tiny": tiny, "release": release_config(), "A": dict(CONFIGS["A"], num_nextn_predict_layers=2),
            "B-tied": tied}


@pytest.mark.parametrize("name", ["tiny", "release", "A", "B-tied"])
def test_names_round_trip_for_every_tensor(name):
    config = _name_configs()[name]
    # experts 0 and 1 of each block stand for the rest (V4-Flash has 256 per layer)
    specs = [s for s in v4_tensor_specs(config) if not re.search(r"\.experts\.(?:[2-9]|[1-9][0-9]+)\.", s.name)]
    gguf_seen: dict[str, str] = {}
    for spec in specs:
        hf = N.to_transformers(spec.name)
        assert hf is not None and N.from_transformers(hf) == spec.name, spec.name
        assert N.canonical(hf) == N.canonical(spec.name) == spec.name
        for stored in N.stored_names(spec.name):
            assert N.canonical(stored) == spec.name
        gguf = N.to_gguf(spec.name)
        if spec.name.startswith("mtp."):
            assert gguf is None and N.to_module(spec.name) is None
            continue
        assert gguf is not None and N.to_module(spec.name) is not None, spec.name
        if ".ffn.experts." not in spec.name:  # routed experts share their layer's merged tensor
            assert gguf_seen.setdefault(gguf, spec.name) == spec.name, (gguf, spec.name)


def test_names_are_what_transformers_saves_and_holds(tmp_path):
    """The transformers and module columns against a real DeepseekV4ForCausalLM (every attention kind, hash and
    routed layers): save_pretrained's keys map onto the schema exactly, and every module name exists."""
    config = CONFIGS["A"]
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**config))
    model.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(os.path.join(tmp_path, "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    specs = v4_tensor_specs(config, mtp=False)
    assert {N.from_transformers(k) for k in saved} == {s.name for s in specs}
    assert {N.to_transformers(s.name) for s in specs} == saved
    held = {n for n, _ in (*model.named_parameters(), *model.named_buffers())}
    assert {N.to_module(s.name) for s in specs} <= held


def test_release_spelling_of_the_kv_norm_and_legacy_names():
    assert N.stored_names("layers.7.attn.norm.weight") == ("layers.7.attn.norm.weight", "layers.7.attn.kv_norm.weight")
    assert N.canonical("layers.7.attn.kv_norm.weight") == "layers.7.attn.norm.weight"
    assert N.stored_names("layers.7.attn.wkv.weight") == ("layers.7.attn.wkv.weight",)
    assert N.from_transformers("lm_head.weight") == N.from_transformers("model.lm_head.weight") == "head.weight"
    assert N.from_transformers("embed_tokens.weight") == "embed.weight"  # as the converter always read it
    assert N.from_transformers("model.something.else") == "something.else"  # unknown: the prefix dropped, kept
    assert N.canonical("model.something.else") is None


def test_gguf_names_that_gguf_py_knows_agree():
    """gguf-py (0.19) predates the deepseek4 architecture, but the names V4 shares with older ones must agree."""
    gguf = pytest.importorskip("gguf")
    known = set(gguf.constants.TENSOR_NAMES.values())
    shared = ("token_embd", "output_norm", "output", "blk.{bid}.attn_norm", "blk.{bid}.ffn_norm",
              "blk.{bid}.attn_q_a", "blk.{bid}.attn_q_a_norm", "blk.{bid}.attn_q_b", "blk.{bid}.attn_kv_a_norm",
              "blk.{bid}.attn_sinks", "blk.{bid}.ffn_gate_inp", "blk.{bid}.exp_probs_b", "blk.{bid}.ffn_gate_exps",
              "blk.{bid}.ffn_up_exps", "blk.{bid}.ffn_down_exps", "blk.{bid}.ffn_gate_shexp",
              "blk.{bid}.ffn_up_shexp", "blk.{bid}.ffn_down_shexp", "blk.{bid}.indexer.proj",
              "blk.{bid}.indexer.attn_q_b")
    ours = {row.gguf.rsplit(".", 1)[0].replace("{L}", "{bid}") for row in N.TABLE if row.gguf}
    for name in shared:
        assert name in ours and name in known, name


def test_reading_does_not_change_the_config():
    config = release_config()
    before = copy.deepcopy(config)
    ModelConfig.from_hf(config), v4_tensor_specs(config), V.kv_geometry(config)
    assert config == before



def test_an_indexer_narrower_than_the_rope_is_refused_only_where_a_layer_has_one(tmp_path):
    """index_head_dim below the RoPE dimensions: the Lightning Indexer rotates the last rope-dim channels of its
    heads, which it does not have. transformers' model fails in its forward (a shape mismatch), moepack's prefill
    failed with a traceback; no computation is defined, so the config is refused naming the field. A model
    without compressed_sparse_attention layers has no indexer, and computes."""
    narrow = dict(CONFIGS["A"], index_head_dim=4)  # rope: head_dim 32 x partial_rotary_factor 0.25 = 8
    with pytest.raises(Exception, match="must match the size"):
        DeepseekV4ForCausalLM(DeepseekV4Config(**narrow)).eval()(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]))
    hf = DeepseekV4Config(**narrow).to_dict()
    with pytest.raises(ConfigError, match=r"index_head_dim must be at least the RoPE dimensions \(8, "
                                          r"qk_rope_head_dim\).*not 4$"):
        ModelConfig.from_hf(hf)
    assert ModelConfig.from_hf({**hf, "index_head_dim": 8}).index_head_dim == 8
    no_csa = {**hf, "layer_types": [SLIDING, HCA, HCA, SLIDING, HCA]}
    assert ModelConfig.from_hf(no_csa).index_head_dim == 4


def test_experts_one_channel_wide_compute_as_transformers_eager_experts(tmp_path):
    """moe_intermediate_size 1: transformers' default experts (torch's grouped_mm) fail on the 4-byte rows
    ("strides should be multiple of 16 bytes"); its eager experts, the same arithmetic, are the reference."""
    from v4_models import saved_model

    from moepack.packer.convert import convert_checkpoint
    from moepack.runtime.engine import PrefillOptions, prefill

    src = str(tmp_path / "m")
    saved_model(dict(CONFIGS["A"], moe_intermediate_size=1), 7, src)
    reference = DeepseekV4ForCausalLM.from_pretrained(src, experts_implementation="eager",
                                                      dtype=torch.float32).eval()
    ids = [3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 2, 4]
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0, -1]
    convert_checkpoint(src, str(tmp_path / "m.moepack"), progress=False)
    got = prefill(str(tmp_path / "m.moepack"), ids, PrefillOptions(compute_dtype="float32")).logits
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.parametrize("share, dims", [(5 / 32, 5), (1 / 64, 0), (1 / 32, 1)])
def test_rope_dimensions_that_are_not_channel_pairs_are_refused(share, dims):
    """Interleaved RoPE turns channel pairs: an odd count of RoPE dimensions (or none: x[..., -0:] is the whole
    head) has no defined rotation. transformers' model fails to build (YaRN) or in its forward; moepack's prefill
    failed with a traceback. Refused naming the field, with the count it gives."""
    hf = DeepseekV4Config(**CONFIGS["A"]).to_dict()  # head_dim 32
    for where in ("main", "compress"):
        params = copy.deepcopy(hf["rope_parameters"])
        params[where]["partial_rotary_factor"] = share
        with pytest.raises(ConfigError, match=rf"rope_parameters\.{where}\.partial_rotary_factor must be a share of "
                                              rf"head_dim \(32\) giving an even number of RoPE dimensions, at least 2 "
                                              rf"\(it gives {dims}\)"):
            ModelConfig.from_hf({**hf, "rope_parameters": params})
