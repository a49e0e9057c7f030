"""Property tests: whatever the bytes or the index say, opening a container ends in moepack's own FormatError (one
line) or in a valid container -- never another exception."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from containers import build_container, read_parts, write_with_index
from moepack.format_spec.errors import FormatError
from moepack.format_spec.reader import Container
from moepack.format_spec.verify import verify_container

SETTINGS = settings(max_examples=int(__import__("os").environ.get("MOEPACK_FUZZ_EXAMPLES", "150")), deadline=None, suppress_health_check=list(HealthCheck))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fuzz") / "good.moepack")
    build_container(path, n_layers=1, n_experts=2)
    return path


def _open_or_format_error(path: str, full: bool = False) -> None:
    try:
        Container(path).close()
        if full:
            verify_container(path)
    except FormatError as e:
        assert "\n" not in str(e)


@SETTINGS
@given(data=st.data())
def test_flipped_and_overwritten_bytes(good, tmp_path_factory, data):
    raw = bytearray(open(good, "rb").read())
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.one_of(st.none(), st.integers(0, len(raw))))
    path = tmp_path_factory.mktemp("f") / "x.moepack"
    path.write_bytes(bytes(raw[:cut] if cut is not None else raw))
    _open_or_format_error(str(path), full=True)


@SETTINGS
@given(data=st.data(), value=json_values)
def test_any_value_in_any_index_field(good, tmp_path_factory, data, value):
    """Replace one field anywhere in the index (top level, a region, a tensor) by an arbitrary JSON value."""
    raw, header, index = read_parts(good)
    where = data.draw(st.sampled_from(["top", "region", "tensor"]))
    if where == "top":
        target = index
    else:
        items = index["regions" if where == "region" else "tensors"]
        target = items[data.draw(st.integers(0, len(items) - 1))]
    key = data.draw(st.sampled_from(sorted(target)))
    target[key] = value
    path = str(tmp_path_factory.mktemp("f") / "x.moepack")
    write_with_index(path, raw, header, json.dumps(index).encode())
    _open_or_format_error(path, full=True)


@SETTINGS
@given(blob=st.binary(max_size=300), compress=st.booleans())
def test_arbitrary_index_bytes(good, tmp_path_factory, blob, compress):
    raw, header, _ = read_parts(good)
    path = str(tmp_path_factory.mktemp("f") / "x.moepack")
    if not blob:
        blob = b"{}"
    write_with_index(path, raw, header, blob, compress=compress)
    _open_or_format_error(path)


@pytest.fixture(scope="module")
def kv_dir(tmp_path_factory):
    from moepack.packer.convert import convert_checkpoint
    from moepack.packer.synth import synth_checkpoint
    from moepack.runtime.engine import PrefillOptions, prefill

    base = tmp_path_factory.mktemp("kvfuzz")
    synth_checkpoint(str(base / "src"), preset="tiny", layout="release", seed=1, progress=False)
    convert_checkpoint(str(base / "src"), str(base / "t.moepack"), policy="keep", progress=False)
    prefill(str(base / "t.moepack"), list(range(3, 30)), PrefillOptions(), kv_out=str(base / "kv"))
    return base / "kv"


def _paths(value, prefix=()):
    """Every (path, container) position inside a JSON value."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value[:3]):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


@SETTINGS
@given(data=st.data(), value=json_values)
def test_any_value_anywhere_in_the_kv_manifest(kv_dir, tmp_path_factory, data, value):
    import shutil

    from moepack.families.deepseek_v4.kv import inspect_kv, read_kv

    manifest = json.loads((kv_dir / "manifest.json").read_text())
    path = data.draw(st.sampled_from(list(_paths(manifest))))
    target = manifest
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    copy = tmp_path_factory.mktemp("kvf") / "kv"
    shutil.copytree(kv_dir, copy)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    for load in (read_kv, inspect_kv):
        try:
            load(str(copy))
        except FormatError as e:
            assert "\n" not in str(e)


# --- Regressions found by the long-running harness (fuzz/fuzz_container.py, docs/fuzzing.md) ---------------------


def _format_error(path: str, full: bool = False) -> str:
    with pytest.raises(FormatError) as info:
        Container(path).close()
        if full:
            verify_container(path)
    assert str(info.value) and "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("text", [b"[" * 100_000 + b"]" * 100_000, b'{"format": 1' + b"0" * 5000 + b"}"],
                         ids=["nesting deeper than the recursion limit", "integer of more than 4300 digits"])
def test_index_json_python_cannot_parse_is_a_format_error(good, tmp_path, text):
    raw, header, _ = read_parts(good)
    path = str(tmp_path / "x.moepack")
    write_with_index(path, raw, header, text)
    assert "index is not valid JSON" in _format_error(path)


def test_index_raw_length_claim_does_not_size_an_allocation(good, tmp_path):
    """A frame without a content size and a header claiming 1 GiB raw: zstd used to allocate the claim up front."""
    import tracemalloc

    import zstandard

    raw, header, _ = read_parts(good)
    path = str(tmp_path / "x.moepack")
    stored = zstandard.ZstdCompressor(write_content_size=False).compress(b"{}")
    write_with_index(path, raw, header, stored, raw_length=1 << 30, compress=False)
    tracemalloc.start()
    try:
        assert "decompresses to 2 bytes, header records 1073741824" in _format_error(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


def _kv_copy(kv_dir, tmp_path, edit, rehash_config: bool = True):
    """A copy of the KV with `edit(manifest)` applied; by default the config hash is kept matching, so the edit
    reaches the checks behind it."""
    import shutil

    from moepack.families.deepseek_v4.kv import config_xxh3

    copy = tmp_path / "kv"
    shutil.copytree(kv_dir, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    if rehash_config:
        manifest["identity"]["config_xxh3"] = config_xxh3(manifest["identity"]["config"])
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return str(copy)


def _kv_format_error(path: str) -> str:
    from moepack.families.deepseek_v4.kv import inspect_kv, read_kv

    messages = []
    for load in (read_kv, inspect_kv):
        with pytest.raises(FormatError) as info:
            load(path)
        assert str(info.value) and "\n" not in str(info.value)
        messages.append(str(info.value))
    return messages[0]


@pytest.mark.parametrize("text", ["[" * 100_000, '{"format": 1' + "0" * 5000 + "}"],
                         ids=["nesting deeper than the recursion limit", "integer of more than 4300 digits"])
def test_kv_manifest_json_python_cannot_parse_is_a_format_error(kv_dir, tmp_path, text):
    import shutil

    copy = tmp_path / "kv"
    shutil.copytree(kv_dir, copy)
    (copy / "manifest.json").write_text(text)
    assert "manifest.json is not valid JSON" in _kv_format_error(str(copy))


@pytest.mark.parametrize("key, value", [
    ("compress_rates", 5), ("compress_rates", {"compressed_sparse_attention": "4"}), ("layer_types", 7),
    ("layer_types", [{}, {}, {}, {}]), ("compress_ratios", [[0]]), ("sliding_window", [1]), ("head_dim", {}),
    ("index_head_dim", float("inf")), ("num_hidden_layers", "4"), ("num_hidden_layers", 10**12),
], ids=lambda v: repr(v)[:40])
def test_kv_config_of_the_wrong_types_is_a_format_error(kv_dir, tmp_path, key, value):
    """The geometry is derived from the recorded config: any value there must end in a one-line error (before
    the fix: TypeError, ValueError, OverflowError, or a list of 10**12 layer types)."""
    def edit(m):
        m["identity"]["config"][key] = value
        if key == "compress_ratios":
            m["identity"]["config"].pop("layer_types", None)

    error = _kv_format_error(_kv_copy(kv_dir, tmp_path, edit))
    assert "config:" in error or f"config.{key}: Infinity is not a JSON number" in error  # refused as it is read


def test_kv_token_ids_beyond_int64_are_a_format_error(kv_dir, tmp_path):
    def edit(m):
        m["tokens"]["ids"][0] = 2**63

    assert "non-empty list of int64 ids" in _kv_format_error(_kv_copy(kv_dir, tmp_path, edit))


@pytest.mark.parametrize("key, value", [("layer", 0.0), ("seen_tokens", 27.0)])
def test_kv_layer_numbers_must_be_integers(kv_dir, tmp_path, key, value):
    """0.0 == 0 in Python: a float layer number passed validation and then indexed a list."""
    def edit(m):
        m["layers"][0][key] = value

    assert "layer entry 0 malformed" in _kv_format_error(_kv_copy(kv_dir, tmp_path, edit))


@pytest.mark.parametrize("size", [2**64, 2**40])
def test_kv_layer_size_claim_does_not_size_a_read(kv_dir, tmp_path, size):
    """The manifest's `bytes` used to be the size of the read buffer (OverflowError, or a huge allocation)."""
    import tracemalloc

    def edit(m):
        m["layers"][0]["bytes"] = size

    path = _kv_copy(kv_dir, tmp_path, edit)
    tracemalloc.start()
    try:
        assert "is truncated" in _kv_format_error(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


def test_kv_inspect_ignores_what_an_incomplete_layer_entry_says(kv_dir, tmp_path):
    """An incomplete entry's other keys are never validated; inspect used to add up its `bytes` (TypeError)."""
    from moepack.families.deepseek_v4.kv import inspect_kv

    def edit(m):
        m["layers"][-1].update(complete=False, bytes="x")
        m["complete"] = False

    report = inspect_kv(_kv_copy(kv_dir, tmp_path, edit))
    assert report["layers_complete"] == report["num_layers"] - 1
    assert report["bytes"] == sum(row.get("bytes", 0) for row in report["layers"])


@pytest.mark.parametrize("where", ["geometry", "tokens count"])
def test_kv_numbers_that_only_equal_integers_are_refused(kv_dir, tmp_path, where):
    """3.0 == 3 in Python: a geometry of floats passed the comparison with the derived one, and the manifest's
    num_layers 4.0 then broke `range(directory.num_layers)` (TypeError)."""
    from moepack.families.deepseek_v4.kv import KVDirectory

    def edit(m):
        if where == "geometry":
            m["geometry"]["num_layers"] = float(m["geometry"]["num_layers"])
        else:
            m["tokens"]["count"] = float(m["tokens"]["count"])

    path = _kv_copy(kv_dir, tmp_path, edit)
    with pytest.raises(FormatError, match="geometry does not follow" if where == "geometry" else "tokens need"):
        KVDirectory(path)


def test_kv_config_nested_near_the_recursion_limit_is_a_format_error(kv_dir, tmp_path):
    """json.loads accepts nesting just under the recursion limit, but hashing the config re-encodes it from a
    deeper stack: RecursionError for a few depths (where exactly depends on the caller's stack, so every depth
    near the limit is tried), found by the atheris engine."""
    import sys

    from moepack.families.deepseek_v4.kv import KVDirectory

    def edit(m):
        m["identity"]["config"]["deep"] = "@DEEP@"

    path = _kv_copy(kv_dir, tmp_path, edit, rehash_config=False)
    manifest = tmp_path / "kv" / "manifest.json"
    template = manifest.read_text()
    limit = sys.getrecursionlimit()
    for depth in range(limit - 120, limit + 1):
        manifest.write_text(template.replace('"@DEEP@"', "[" * depth + "]" * depth))
        with pytest.raises(FormatError) as info:
            KVDirectory(path)
        assert "\n" not in str(info.value)
