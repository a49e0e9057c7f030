"""`moepack export`: a container back to a Hugging Face checkpoint that transformers loads."""

from __future__ import annotations

import json
import os

import pytest
import torch
from containers import small_disk
from safetensors.torch import load_file

from moepack.format_spec import source_formats
from moepack.format_spec.errors import MoepackError
from moepack.packer.convert import convert_checkpoint
from moepack.packer.export import export_container
from moepack.packer.source import CheckpointDir
from moepack.packer.synth import synth_checkpoint


@pytest.fixture(scope="module")
def release_container(tmp_path_factory):
    base = tmp_path_factory.mktemp("export")
    src = str(base / "src")
    synth_checkpoint(src, preset="tiny", layout="release", seed=3, progress=False)
    out = str(base / "tiny.moepack")
    convert_checkpoint(src, out, progress=False)
    return src, out, base


def _load_dir(d):
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(os.path.join(d, shard)))
    assert set(tensors) == set(index["weight_map"])
    return tensors


def test_export_dequantizes_release_weights_exactly(release_container):
    src, out, base = release_container
    exported_dir = str(base / "f32")
    summary = export_container(out, exported_dir, dtype="f32", progress=False, shard_bytes=1 << 20)
    assert summary["shards"] > 1
    exported = _load_dir(exported_dir)
    source = CheckpointDir(src)
    raw = {name: load_file(t.file)[name] for name, t in source.tensors.items()}
    assert not any(n.endswith(".scale") for n in exported)
    for name, value in exported.items():
        original = raw[name]
        scale = raw.get(name[: -len(".weight")] + ".scale") if name.endswith(".weight") else None
        if original.dtype == torch.float8_e4m3fn:
            expected = source_formats.fp8_block_dequantize(original, scale)
        elif original.dtype == torch.int8 and ".experts." in name:
            expected = source_formats.fp4_dequantize(original, scale)
        else:
            expected = original.float() if original.is_floating_point() else original
        assert value.dtype == (torch.float32 if expected.is_floating_point() else expected.dtype), name
        assert torch.equal(value, expected), name
    source.close()
    config = json.load(open(os.path.join(exported_dir, "config.json")))
    assert "quantization_config" not in config
    assert os.path.exists(os.path.join(exported_dir, "tokenizer.json"))


def test_exported_checkpoint_loads_in_transformers(release_container):
    transformers = pytest.importorskip("transformers")
    _, out, base = release_container
    d = str(base / "bf16")
    export_container(out, d, dtype="bf16", progress=False)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert not [k for k in info["unexpected_keys"] if not k.startswith("mtp.")]
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert torch.isfinite(logits).all()


def test_export_refuses_a_non_empty_directory(release_container, tmp_path):
    _, out, _ = release_container
    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "file").write_text("x")
    with pytest.raises(MoepackError, match="not empty"):
        export_container(out, str(tmp_path / "occupied"), progress=False)
    with pytest.raises(MoepackError, match="unknown export dtype"):
        export_container(out, str(tmp_path / "new"), dtype="f8", progress=False)


def test_export_onto_a_full_disk_is_one_line_and_leaves_nothing(release_container, tmp_path, monkeypatch):
    _, container, _ = release_container
    with small_disk(tmp_path / "small-disk", "64K") as small:
        with pytest.raises(MoepackError, match=r"^not enough free space for exporting .*/out on .*small-disk: it "
                                               r"needs about [0-9.]+ MiB \(a margin included\), [0-9.]+ MiB is free$"):
            export_container(container, os.path.join(small, "out"), progress=False)  # seen before any work
        assert os.listdir(small) == []
        # the disk fills during the export (another writer, after the check)
        import moepack.packer.export as E

        monkeypatch.setattr(E, "check_free_space", lambda needs, what: {})
        full = r"writing .*out failed: .*No space left on device.*\(disk full\)"
        with pytest.raises(MoepackError, match=full) as info:
            export_container(container, os.path.join(small, "out"), progress=False)
        assert "\n" not in str(info.value)
        assert os.listdir(small) == []  # neither the output nor its temporary folder


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("kind", ["dense", "expert"])
def test_a_damaged_container_is_not_exported(release_container, tmp_path, fmt, kind):
    """An export carries no checksums of its own: a tensor that fails the container's is a one-line error, and
    nothing is left under the output's name (the damage would go on silently into transformers or llama.cpp)."""
    from moepack.format_spec.reader import Container
    from moepack.packer.gguf_export import export_gguf

    _, container, _ = release_container
    damaged = str(tmp_path / "damaged.moepack")
    with open(container, "rb") as f:
        data = bytearray(f.read())
    with Container(container) as c:
        region = next(r for r in c.regions if r.kind == kind)
        t = max(region.tensors, key=lambda t: t.length)
        data[t.file_offset + t.length // 2] ^= 0x10
    with open(damaged, "wb") as f:
        f.write(data)
    out = str(tmp_path / ("out.gguf" if fmt == "gguf" else "out"))
    export = (lambda: export_gguf(damaged, out, progress=False)) if fmt == "gguf" else (
        lambda: export_container(damaged, out, progress=False))
    damage = rf"^tensor {t.name}: checksum mismatch \(region {region.name} is damaged\)$"
    with pytest.raises(MoepackError, match=damage):
        export()
    assert sorted(os.listdir(tmp_path)) == ["damaged.moepack"]
