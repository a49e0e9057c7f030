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

    from moepack.format_spec.kv import inspect_kv, read_kv

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
