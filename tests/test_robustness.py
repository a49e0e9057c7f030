"""Hostile environments: odd paths, read-only targets, concurrent readers, foreign containers, no code execution."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import threading

import pytest
import torch

from containers import mutate_index, small_disk
from moepack.format_spec.errors import MoepackError
from moepack.packer.convert import convert_checkpoint
from moepack.packer.synth import synth_checkpoint
from moepack.runtime.engine import PrefillOptions, prefill

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("robust")
    src = base / "src"
    synth_checkpoint(str(src), preset="tiny", layout="release", seed=5, progress=False)
    return base, str(src)


def test_paths_with_spaces_and_unicode(tiny):
    base, src = tiny
    odd = base / "モデル dir" / "mixed ünïcode name.moepack"
    odd.parent.mkdir()
    convert_checkpoint(src, str(odd), policy="fp4", progress=False)
    kv = base / "kv ä ö"
    result = prefill(str(odd), [1, 2, 3, 4], PrefillOptions(), kv_out=str(kv))
    assert (kv / "manifest.json").exists() and result.stats["tokens"] == 4


@pytest.mark.parametrize("size", ["64M", "64K"])
def test_read_only_output_is_one_line(tiny, tmp_path, size):
    """A read-only disk is named so, whether or not it has room (a small one's free count had read as "not enough
    free space")."""
    _, src = tiny
    with small_disk(tmp_path / "ro", size) as ro:
        subprocess.run(["mount", "-o", "remount,ro", ro], check=True)
        with pytest.raises(MoepackError, match="cannot write .*Read-only file system") as info:
            convert_checkpoint(src, os.path.join(ro, "x.moepack"), policy="keep", progress=False)
        assert "\n" not in str(info.value)


def test_concurrent_prefills_share_a_container(tiny):
    base, src = tiny
    path = str(base / "shared.moepack")
    convert_checkpoint(src, path, policy="keep", progress=False)
    prompts = [torch.arange(3, 3 + n) for n in (5, 40, 17, 40)]
    results: dict[int, torch.Tensor] = {}

    def run(i):
        results[i] = prefill(path, prompts[i], PrefillOptions(io_mode="direct")).logits

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, p in enumerate(prompts):
        assert torch.allclose(results[i], prefill(path, p, PrefillOptions()).logits, atol=1e-5)


def test_container_of_another_architecture_is_refused(tiny, tmp_path):
    base, src = tiny
    path = str(base / "arch.moepack")
    convert_checkpoint(src, path, policy="keep", progress=False)
    foreign = str(tmp_path / "foreign.moepack")
    mutate_index(path, foreign, lambda i: i.update(architecture="llama"))
    with pytest.raises(MoepackError, match="holds a 'llama' model"):
        prefill(foreign, [1, 2, 3], PrefillOptions())
    broken = str(tmp_path / "broken.moepack")
    mutate_index(path, broken, lambda i: i["config"].pop("hidden_size"))
    with pytest.raises(MoepackError, match="but the config says"):
        prefill(broken, [1, 2, 3], PrefillOptions())


def test_no_code_execution_on_any_loading_path():
    """Containers and KV directories are JSON + raw bytes + safetensors: no pickle, no torch.load, no remote code."""
    forbidden = re.compile(r"\bimport pickle\b|\bpickle\.|torch\.load\(|trust_remote_code\s*=\s*True|\beval\(|\bexec\(")
    offenders = []
    for folder in ("format_spec", "packer", "runtime", "cli", "moepack"):
        for path in (ROOT / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if forbidden.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, offenders


@pytest.mark.parametrize("zero_copy", [False, True])
def test_a_mapped_container_cut_short_while_open_is_one_line_not_a_sigbus(tmp_path, zero_copy):
    """`cp other.moepack c.moepack` over a container a server has mapped shrinks the file under the mapping: a read
    past its new end had been a SIGBUS that killed the process. Read in a forked child, which a SIGBUS kills alone."""
    from containers import build_container

    from moepack.runtime.io import HostBuffer, RegionReader

    path = str(tmp_path / "c.moepack")
    build_container(path, n_layers=1, n_experts=2)
    reader = RegionReader(path, mode="mmap", zero_copy=zero_copy)
    os.truncate(path, 4096)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child's outcome is reported through the pipe and its status)
        try:
            bytes(reader.read_into(HostBuffer(8192, pinned=False), 8192, 8192)[:1])
            message = "read"
        except MoepackError as e:
            message = str(e)
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    message = os.read(read, 4096).decode()
    os.close(read)
    _, status = os.waitpid(child, 0)
    reader.close()
    assert os.WIFEXITED(status), f"the read killed the process (signal {os.WTERMSIG(status)})"
    assert "shrank to 4096 bytes while being read" in message, message
