"""Container format v1: round trip of every field, and one bad file per validation rule."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from containers import build_container, mutate_index, patch_header_field, read_parts, write_with_index
from moepack.format_spec.errors import FormatError, MoepackError
from moepack.format_spec.layout import ALIGNMENT, HEADER_SIZE, TENSOR_ALIGNMENT
from moepack.format_spec.reader import Container
from moepack.format_spec.verify import verify_container
from moepack.format_spec.writer import ContainerWriter


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fmt") / "good.moepack")
    arrays = build_container(path)
    return path, arrays


def test_round_trip_every_field(good):
    path, arrays = good
    with Container(path) as c:
        assert (c.header.major, c.header.minor) == (1, 0)
        assert c.file_size == os.path.getsize(path) and c.file_size % ALIGNMENT == 0
        assert c.architecture == "deepseek_v4"
        assert c.config["n_routed_experts"] == 3 and c.policy == {"name": "keep"}
        assert c.index["tokenizer"]["tokenizer.json"]["data"] == "{}"
        assert c.index["provenance"] == {"source": "test"}
        assert [b.name for b in c.blocks] == ["layers.0", "layers.1", "mtp.0"]
        assert [b.name for b in c.layers] == ["layers.0", "layers.1"]
        assert [r.name for r in c.global_regions] == ["global.embed.weight", "global.norm.weight"]
        assert set(c.tensors) == set(arrays)
        for name, array in arrays.items():
            t = c.tensors[name]
            assert t.shape == array.shape
            assert t.file_offset % TENSOR_ALIGNMENT == 0 and t.region.offset % ALIGNMENT == 0
            got = c.read_tensor(name)
            assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(array))), name


def test_regions_follow_read_order_and_expert_spans(good):
    path, _ = good
    with Container(path) as c:
        offsets = [r.offset for r in c.regions]
        assert offsets == sorted(offsets) and offsets[0] == HEADER_SIZE
        for r, nxt in zip(c.regions, c.regions[1:]):
            assert r.end == nxt.offset
        layer = c.layer(1)
        assert layer.dense.end == layer.experts[0].offset
        assert [r.expert for r in layer.experts] == [0, 1, 2]
        off, length = layer.expert_span(1, 2)
        assert off == layer.experts[1].offset and off + length == layer.experts[2].end
        assert off % ALIGNMENT == 0 and length % ALIGNMENT == 0
        # within an expert: gate (w1), up (w3), down (w2)
        names = [t.name.split(".")[-2] for t in layer.experts[0].tensors]
        assert names == ["w1", "w3", "w2"]
        with pytest.raises(IndexError):
            layer.expert_span(2, 2)


def test_writer_leaves_no_partial_and_refuses_wrong_length(tmp_path):
    path = str(tmp_path / "w.moepack")
    build_container(path)
    assert os.path.exists(path) and not os.path.exists(path + ".partial")
    w = ContainerWriter(str(tmp_path / "x.moepack"))
    w.begin_region("global", tensor="a")
    with pytest.raises(MoepackError, match="needs 16"):
        w.add_tensor("a", "F32", [4], b"\0" * 12)
    w.abort()
    assert not os.path.exists(tmp_path / "x.moepack")


def test_verify_good_file(good):
    path, _ = good
    seen = []
    report = verify_container(path, on_bytes=seen.append)
    assert report.regions == 2 + 3 * 4 and sum(seen) == os.path.getsize(path)


# ---- one bad file per validation rule ---------------------------------------------------------------------------

def _edit_bytes(offset, value):
    def apply(data):
        data[offset] ^= value
    return apply


HEADER_CASES = [
    ("bad magic", lambda d: d.__setitem__(slice(0, 8), b"NOTMOEPK"), "bad magic"),
    ("gguf", lambda d: d.__setitem__(slice(0, 4), b"GGUF"), "GGUF"),
    ("header checksum", _edit_bytes(30, 0x01), "header checksum"),
    ("header padding", _edit_bytes(200, 0x01), "header padding"),
]


@pytest.mark.parametrize("label,edit,message", HEADER_CASES, ids=[c[0] for c in HEADER_CASES])
def test_header_damage(good, tmp_path, label, edit, message):
    data = bytearray(open(good[0], "rb").read())
    edit(data)
    bad = tmp_path / "bad.moepack"
    bad.write_bytes(data)
    with pytest.raises(FormatError, match=message):
        Container(str(bad))


FIELD_CASES = [
    ("unknown major", 8, "H", 2, "version 2.0 is not supported"),
    ("byte order", 12, "I", 0x04030201, "byte-order mark"),
    ("alignment", 16, "I", 512, "geometry"),
    ("codec", 56, "I", 7, "unknown index codec"),
    ("index offset unaligned", 32, "Q", 4097 * 3, "not an aligned position"),
    ("file size", 24, "Q", 1 << 40, "truncated"),
    ("index raw length", 48, "Q", 1 << 40, "out of range"),
]


@pytest.mark.parametrize("label,offset,fmt,value,message", FIELD_CASES, ids=[c[0] for c in FIELD_CASES])
def test_header_fields(good, tmp_path, label, offset, fmt, value, message):
    bad = str(tmp_path / "bad.moepack")
    patch_header_field(good[0], bad, offset, fmt, value)
    with pytest.raises(FormatError, match=message):
        Container(bad)


def test_truncated_and_appended(good, tmp_path):
    data = open(good[0], "rb").read()
    for cut in (3, 8, 10, 79, HEADER_SIZE, HEADER_SIZE + 100, len(data) - ALIGNMENT, len(data) - 1):
        p = tmp_path / f"cut{cut}.moepack"
        p.write_bytes(data[:cut])
        # (its magic whole: named truncated, never "not a moepack container")
        with pytest.raises(FormatError, match="truncated" if cut >= 8 else "bad magic"):
            Container(str(p))
    p = tmp_path / "long.moepack"
    p.write_bytes(data + b"\0" * 10)
    with pytest.raises(FormatError, match="longer than recorded"):
        Container(str(p))


def test_index_damage(good, tmp_path):
    data, header, index = read_parts(good[0])
    p = tmp_path / "bad.moepack"
    flipped = bytearray(data)
    flipped[header.index_offset + 5] ^= 0x10
    p.write_bytes(flipped)
    with pytest.raises(FormatError, match="index checksum"):
        Container(str(p))
    padded = bytearray(data)
    padded[-1] = 1
    p.write_bytes(padded)
    with pytest.raises(FormatError, match="index padding"):
        Container(str(p))
    write_with_index(str(p), data, header, b"this is not zstd", compress=False)
    with pytest.raises(FormatError, match="does not decompress"):
        Container(str(p))
    raw = json.dumps(index).encode()
    write_with_index(str(p), data, header, raw, raw_length=len(raw) + 1)
    with pytest.raises(FormatError, match="decompresses to"):
        Container(str(p))
    write_with_index(str(p), data, header, b"{not json")
    with pytest.raises(FormatError, match="not valid JSON"):
        Container(str(p))
    write_with_index(str(p), data, header, b"[1, 2]")
    with pytest.raises(FormatError, match="JSON object"):
        Container(str(p))


def _region(index, name):
    return next(r for r in index["regions"] if r["name"] == name)


def _tensor(index, name):
    return next(t for t in index["tensors"] if t["name"] == name)


INDEX_CASES = [
    ("version disagrees", lambda i: i.update(format_version=[1, 5]), "disagrees"),
    ("missing field", lambda i: i.pop("config"), "'config' is missing"),
    ("wrong format", lambda i: i.update(format="gguf"), "'format'"),
    ("unknown region kind", lambda i: i["regions"][3].update(kind="blob"), "unknown kind"),
    ("unaligned region", lambda i: i["regions"][2].update(offset=i["regions"][2]["offset"] + 512), "not aligned"),
    ("overlapping regions", lambda i: i["regions"][2].update(offset=i["regions"][2]["offset"] - ALIGNMENT), "overlaps"),
    ("gap between regions", lambda i: i["regions"][2].update(offset=i["regions"][2]["offset"] + ALIGNMENT), "gap"),
    ("region past data", lambda i: i["regions"][-1].update(length=i["regions"][-1]["length"] + ALIGNMENT),
     "runs past the end"),
    ("regions end early", lambda i: i["regions"].pop(), "regions end at"),
    ("duplicate region", lambda i: i["regions"][1].update(name="global.embed.weight"), "duplicate region"),
    ("bad region name", lambda i: i["regions"][2].update(name="layers.0.densest"), "name should be"),
    ("bad block name", lambda i: i["regions"][2].update(block="layer.zero"), "bad block name"),
    ("bad region hash", lambda i: i["regions"][0].update(xxh3="xyz"), "16 lowercase hex"),
    ("tensor too short", lambda i: _tensor(i, "embed.weight").update(shape=[50, 63]), "needs exactly"),
    ("tensor too long", lambda i: _tensor(i, "layers.0.attn_norm.weight").update(length=8, shape=[7]),
     "needs exactly"),
    ("tensor past region", lambda i: _tensor(i, "norm.weight").update(offset=4096), "runs past the end of region"),
    ("tensor unaligned", lambda i: _tensor(i, "layers.0.ffn.gate.tid2eid").update(offset=8), "not aligned"),
    ("tensor overlap", lambda i: _tensor(i, "layers.0.ffn.gate.tid2eid").update(offset=0), "overlaps"),
    ("unknown dtype", lambda i: _tensor(i, "norm.weight").update(dtype="F12"), "unknown storage type"),
    ("block type shape", lambda i: _tensor(i, "norm.weight").update(dtype="Q8_0", shape=[3, 10]),
     "not a multiple of its block"),
    ("negative dim", lambda i: _tensor(i, "norm.weight").update(shape=[-64]), "non-negative"),
    ("tensor in no region", lambda i: _tensor(i, "norm.weight").update(region=999), "does not exist"),
    ("duplicate tensor", lambda i: i["tensors"].append(dict(i["tensors"][0])), "listed twice"),
    ("layer count", lambda i: i["config"].update(num_hidden_layers=5), "5 layers"),
]


@pytest.mark.parametrize("label,mutate,message", INDEX_CASES, ids=[c[0] for c in INDEX_CASES])
def test_index_rules(good, tmp_path, label, mutate, message):
    bad = str(tmp_path / "bad.moepack")
    mutate_index(good[0], bad, mutate)
    with pytest.raises(FormatError, match=message):
        Container(bad)


ORDER_CASES = [
    ("mtp before layers", [("dense", "mtp.0", None), ("dense", "layers.0", None)], "mtp blocks must come after"),
    ("global after a layer", [("dense", "layers.0", None), ("global", None, None)], "before every layer"),
    ("experts out of order", [("dense", "layers.0", None), ("expert", "layers.0", 1), ("expert", "layers.0", 0)],
     "ID order"),
    ("expert without its dense", [("dense", "layers.0", None), ("expert", "layers.1", 0)], "follow their block"),
    ("block twice", [("dense", "layers.0", None), ("dense", "layers.1", None), ("dense", "layers.0", None)],
     "duplicate region|appears twice"),
    ("layer numbering", [("dense", "layers.1", None)], "numbered 0..0"),
]


@pytest.mark.parametrize("label,order,message", ORDER_CASES, ids=[c[0] for c in ORDER_CASES])
def test_region_order_rules(tmp_path, label, order, message):
    path = str(tmp_path / "order.moepack")
    w = ContainerWriter(path)
    for i, (kind, block, expert) in enumerate(order):
        w.begin_region(kind, block=block, expert=expert, tensor=f"g{i}")
        w.add_tensor(f"t{i}", "F32", [4], np.zeros(4, np.float32).tobytes())
        w.end_region()
    w.finish(config={}, architecture="deepseek_v4", policy={"name": "keep"})
    with pytest.raises(FormatError, match=message):
        Container(path)


def test_verify_catches_flips_in_every_region_and_padding(good, tmp_path):
    path = good[0]
    with Container(path) as c:
        regions = [(r.name, r.offset, r.length, r.tensors[-1].offset + r.tensors[-1].length) for r in c.regions]
    data = open(path, "rb").read()
    bad = tmp_path / "flip.moepack"
    for name, offset, length, used in regions:
        for where in (offset, offset + used - 1, offset + length - 1):  # first byte, last tensor byte, padding
            flipped = bytearray(data)
            flipped[where] ^= 0x40
            bad.write_bytes(flipped)
            with pytest.raises(FormatError, match=name.replace(".", r"\.")):
                verify_container(str(bad))


def test_verify_names_nonzero_padding_even_with_matching_region_hash(good, tmp_path):
    """Padding is checked for zero on its own, not only through the region checksum."""
    from containers import read_parts as parts
    import xxhash

    data, header, index = parts(good[0])
    region = index["regions"][0]
    end = region["offset"] + region["length"]
    data[end - 1] = 7
    region["xxh3"] = xxhash.xxh3_64_hexdigest(bytes(data[region["offset"]:end]))
    bad = str(tmp_path / "pad.moepack")
    write_with_index(bad, data, header, json.dumps(index).encode())
    with pytest.raises(FormatError, match="padding .* is not zero"):
        verify_container(bad)


def test_missing_file_is_a_format_error(tmp_path):
    with pytest.raises(FormatError, match="no such file"):
        Container(str(tmp_path / "nope.moepack"))


# ------------------------------------------------------------------------------------------------- row decoding


def _stored(dtype: str, rows: int, cols: int):
    """(stored bytes, decoded scale or None) of a random [rows, cols] tensor in `dtype`."""
    from moepack.format_spec import quants
    from moepack.format_spec.decode import TORCH_DTYPES
    from moepack.format_spec.source_formats import fp4_quantize, fp8_block_quantize

    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols))
    if dtype == "F8_E4M3":  # the release's block-scaled FP8
        weight, scale = fp8_block_quantize(w)
        return weight.view(torch.uint8).reshape(-1), scale
    if dtype in TORCH_DTYPES:
        return w.to(TORCH_DTYPES[dtype]).view(torch.uint8).reshape(-1), None
    if dtype == "FP4_E2M1":
        packed, scale = fp4_quantize(w)
        return packed.view(torch.uint8).reshape(-1), scale
    return quants.quantize_torch(w, dtype).reshape(-1), None


@pytest.mark.parametrize("dtype,rows,cols", [("F32", 300, 64), ("BF16", 300, 64), ("F16", 7, 32),
                                             ("Q8_0", 300, 96), ("Q2_K", 40, 512), ("IQ2_XXS", 9, 256),
                                             ("MXFP4", 33, 64), ("F8_E4M3", 300, 200), ("FP4_E2M1", 70, 64)])
def test_decode_rows_is_the_whole_decode_indexed(dtype, rows, cols):
    """Rows decoded alone (index tensors with repeats, slices on and off the FP8 scale blocks, a tensor scale)
    equal the same rows of the whole tensor decoded."""
    from moepack.format_spec.decode import decode_float, decode_rows

    stored, scale = _stored(dtype, rows, cols)
    whole = decode_float(dtype, (rows, cols), stored, scale)
    picks = [torch.tensor([rows - 1, 0, 3, 3, rows // 2]), torch.tensor([], dtype=torch.long), slice(0, rows),
             slice(128 % rows, rows + 50), slice(5, 6), slice(rows, rows + 3)]
    for pick in picks:
        got = decode_rows(dtype, (rows, cols), stored, pick, scale)
        assert got.dtype == torch.float32 and torch.equal(got, whole[pick]), (dtype, pick)
    scaled = decode_rows(dtype, (rows, cols), stored, torch.tensor([1, rows - 1]), scale, tensor_scale=0.25)
    assert torch.equal(scaled, whole[[1, rows - 1]] * 0.25)
    assert torch.equal(decode_rows(dtype, (rows, cols), stored, slice(0, 2), scale, out_dtype=torch.bfloat16),
                       decode_float(dtype, (rows, cols), stored, scale, torch.bfloat16)[:2])


def test_decode_rows_never_decodes_the_whole_table(monkeypatch):
    """The embedding lookup and the LM head's slices decode their rows alone, for every type a container stores:
    nothing decodes the [300, 64] table."""
    from moepack.format_spec import decode

    shapes = []
    real = decode.decode_float
    monkeypatch.setattr(decode, "decode_float", lambda dtype, shape, *a, **k: shapes.append(tuple(shape)) or
                        real(dtype, shape, *a, **k))
    for dtype in ("BF16", "Q8_0", "F8_E4M3", "FP4_E2M1"):
        stored, scale = _stored(dtype, 300, 64)
        for pick in (torch.tensor([299, 2, 2, 130]), slice(100, 200), slice(0, 300)):
            shapes.clear()
            got = decode.decode_rows(dtype, (300, 64), stored, pick, scale)
            assert (300, 64) not in shapes or pick == slice(0, 300), (dtype, pick, shapes)
            assert got.shape[0] == (4 if isinstance(pick, torch.Tensor) else pick.stop - pick.start)
    assert decode.row_decodable("F8_E4M3", None) and not decode.row_decodable("FP4_E2M1", None)
    assert not decode.row_decodable("F8_E4M3", torch.ones(3, 1))  # float32 block scales: decoded whole


def test_decode_rows_rejects_bad_input():
    from moepack.format_spec.decode import decode_rows

    stored, _ = _stored("BF16", 10, 32)
    with pytest.raises(FormatError, match="2-D"):
        decode_rows("BF16", (320,), stored, slice(0, 1))
    with pytest.raises(FormatError, match="needs 640 bytes"):
        decode_rows("BF16", (10, 32), stored[:-2], slice(0, 1))
    with pytest.raises(ValueError, match="step 1"):
        decode_rows("BF16", (10, 32), stored, slice(0, 10, 2))


def _one_region_written(path: str) -> ContainerWriter:
    """A writer of `path` with one region written and checkpointed (resumable), still open."""
    w = ContainerWriter(path)
    w.begin_region("global", tensor="embed.weight")
    w.add_tensor("embed.weight", "F32", [4, 4], np.ones((4, 4), np.float32).tobytes())
    w.end_region()
    w.checkpoint()
    return w


def test_the_writer_refuses_tokenizer_files_its_reader_would(tmp_path):
    """A container whose index names a tokenizer file of another form than the spec's (a path, data not base64)
    never gets its final name: its reader would refuse it at every open."""
    for name, entry in (("../x.json", {"encoding": "utf-8", "data": "{}"}),
                        ("t.model", {"encoding": "base64", "data": "not base64!"})):
        path = str(tmp_path / "t.moepack")
        w = _one_region_written(path)
        with pytest.raises(FormatError, match="index tokenizer file"):
            w.finish(config={}, architecture="a", policy={}, tokenizer={name: entry})
        w.abort()
        assert not os.path.exists(path)


def test_a_second_writer_of_the_same_path_is_refused_while_the_first_writes(tmp_path):
    """Two writers of one path would write into one partial file, and one would finish with the other's model
    under its name: the second is refused in one line, the first's bytes untouched, until the first ends."""
    path = str(tmp_path / "m.moepack")
    first = _one_region_written(path)
    written = open(path + ".partial", "rb").read()
    for resume in (False, True):
        with pytest.raises(MoepackError, match=r"^another process is writing .*m\.moepack \(its m\.moepack\.partial "
                                               r"is locked\): wait for it to finish, or write elsewhere$"):
            ContainerWriter(path, resume=resume)
    assert open(path + ".partial", "rb").read() == written
    first.abort()  # the partial kept (resumable), the lock let go
    second = ContainerWriter(path, resume=True)
    assert second.completed == ["global.embed.weight"]
    second.abort()


def test_the_lock_is_let_go_on_every_failure_and_the_output_keeps_a_plain_files_mode(tmp_path):
    """A writer that fails while opening (a journal of this job whose entries are damaged) lets go of its lock: the
    next writer of the path starts, in this process too; the finished container's mode is what the umask gives a
    new file (0664 under 002), as its part files' are."""
    path = str(tmp_path / "m.moepack")
    _one_region_written(path).abort()
    journal = json.load(open(path + ".partial.journal"))
    journal["tensors"].append(5)  # not a tensor's entry
    json.dump(journal, open(path + ".partial.journal", "w"))
    with pytest.raises(Exception):
        ContainerWriter(path, resume=True)
    os.remove(path + ".partial.journal")
    old = os.umask(0o002)
    try:
        ContainerWriter(path, resume=True).abort()  # not "another process is writing"
        os.remove(path + ".partial")
        fresh = ContainerWriter(path)
        assert os.stat(path + ".partial").st_mode & 0o777 == 0o664
        fresh.abort()
    finally:
        os.umask(old)
