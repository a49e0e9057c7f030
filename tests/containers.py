"""Helpers for tests: build small containers, and rewrite a container's index or header to make bad ones."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import subprocess

import numpy as np
import xxhash
import zstandard

from moepack.format_spec.layout import HEADER_SIZE, Header, PartHeader, align_up
from moepack.format_spec.writer import ContainerWriter

CONFIG = {"model_type": "deepseek_v4", "num_hidden_layers": 2, "hidden_size": 64, "n_routed_experts": 3}


def build_container(path: str, n_layers: int = 2, n_experts: int = 3, seed: int = 0,
                    **writer_options) -> dict[str, np.ndarray]:
    """A small container with globals, n_layers blocks of a dense region + n_experts experts, and one mtp block
    (`writer_options`, e.g. parts=2, go to ContainerWriter). Returns the arrays written, by tensor name."""
    rng = np.random.default_rng(seed)
    written: dict[str, np.ndarray] = {}
    w = ContainerWriter(path, **writer_options)

    def put(name, dtype, array):
        written[name] = array
        w.add_tensor(name, dtype, list(array.shape), np.ascontiguousarray(array).tobytes())

    w.begin_region("global", tensor="embed.weight")
    put("embed.weight", "F32", rng.standard_normal((50, 64)).astype(np.float32))
    w.end_region()
    w.begin_region("global", tensor="norm.weight")
    put("norm.weight", "F16", rng.standard_normal(64).astype(np.float16))
    w.end_region()
    blocks = [f"layers.{i}" for i in range(n_layers)] + ["mtp.0"]
    for block in blocks:
        w.begin_region("dense", block=block)
        put(f"{block}.attn.wq_a.weight", "F32", rng.standard_normal((32, 64)).astype(np.float32))
        put(f"{block}.ffn.gate.tid2eid", "I64", rng.integers(0, n_experts, (50, 2)))
        put(f"{block}.attn_norm.weight", "U8", rng.integers(0, 255, (7,), dtype=np.uint8))  # odd size: gaps
        w.end_region()
        for e in range(n_experts):
            w.begin_region("expert", block=block, expert=e)
            for proj, shape in (("w1", (16, 64)), ("w3", (16, 64)), ("w2", (64, 16))):
                put(f"{block}.ffn.experts.{e}.{proj}.weight", "I8",
                    rng.integers(-128, 127, shape, dtype=np.int8))
            w.end_region()
    w.finish(config={**CONFIG, "num_hidden_layers": n_layers, "n_routed_experts": n_experts},
             architecture="deepseek_v4", policy={"name": "keep"},
             tokenizer={"tokenizer.json": {"encoding": "utf-8", "data": "{}"}},
             provenance={"source": "test"})
    return written


def read_parts(path: str) -> tuple[bytearray, Header, dict]:
    data = bytearray(open(path, "rb").read())
    header = Header.unpack(bytes(data[:HEADER_SIZE]), len(data))
    stored = bytes(data[header.index_offset: header.index_offset + header.index_length])
    index = json.loads(zstandard.ZstdDecompressor().decompress(stored, max_output_size=header.index_raw_length))
    return data, header, index


def write_with_index(path: str, data: bytearray, header: Header, index_bytes: bytes, raw_length: int | None = None,
                     compress: bool = True) -> None:
    """Replace the index by `index_bytes` (JSON, compressed here unless compress=False) with a consistent header."""
    stored = zstandard.ZstdCompressor().compress(index_bytes) if compress else index_bytes
    body = bytes(data[: header.index_offset])
    total = header.index_offset + align_up(len(stored))
    new_header = Header(header.major, header.minor, header.alignment, total, header.index_offset, len(stored),
                        raw_length if raw_length is not None else len(index_bytes), header.index_codec,
                        xxhash.xxh3_64_intdigest(stored))
    out = bytearray(body + stored + bytes(total - header.index_offset - len(stored)))
    out[:HEADER_SIZE] = new_header.pack()
    open(path, "wb").write(out)


def mutate_index(src: str, dst: str, mutate) -> None:
    """Copy src to dst with `mutate(index_dict)` applied to the index (hashes kept consistent)."""
    data, header, index = read_parts(src)
    mutate(index)
    write_with_index(dst, data, header, json.dumps(index).encode())


def restamp_parts(src: str, dst: str) -> None:
    """Copy src's part files beside dst with their headers naming dst's index, so a dst made by mutate_index
    still has matching parts (its own index rules are then what a reader meets)."""
    _, header, _ = read_parts(dst)
    for k, path in enumerate(container_files(src)[1:], start=1):
        data = bytearray(open(path, "rb").read())
        data[:HEADER_SIZE] = PartHeader(k, len(container_files(src)), len(data), header.index_xxh3).pack()
        open(f"{dst}.part{k}", "wb").write(data)


def patch_header_field(src: str, dst: str, offset: int, fmt: str, value, rehash: bool = True) -> None:
    """Overwrite one header field; with rehash the header's own checksum is recomputed so only the field is wrong."""
    data = bytearray(open(src, "rb").read())
    struct.pack_into("<" + fmt, data, offset, value)
    if rehash:
        struct.pack_into("<Q", data, 72, xxhash.xxh3_64_intdigest(bytes(data[:72])))
    open(dst, "wb").write(data)


def container_files(path: str) -> list[str]:
    """The main file and the part files `<path>.part1`, `<path>.part2`, ... that exist beside it, in part order."""
    files, k = [path], 1
    while os.path.lexists(f"{path}.part{k}"):
        files.append(f"{path}.part{k}")
        k += 1
    return files


def copy_container(src: str, dst: str) -> str:
    """Copy a container and its part files (their contents, where a part is a symlink) to `dst`; returns dst."""
    for k, path in enumerate(container_files(src)):
        shutil.copyfile(path, dst if k == 0 else f"{dst}.part{k}")
    return dst


def tiny_keep_container(tmp_path_factory) -> str:
    """The tiny synthetic model converted with --keep, built once per test session and shared by test modules."""
    from moepack.packer.convert import convert_checkpoint
    from moepack.packer.synth import synth_checkpoint

    base = tmp_path_factory.getbasetemp() / "moepack-tiny-keep"
    out = base / "tiny.moepack"
    if not out.exists():
        synth_checkpoint(str(base / "src"), preset="tiny", layout="release", progress=False)
        convert_checkpoint(str(base / "src"), str(out), policy="keep", progress=False)
    return str(out)


def tiny_policy_containers(base, policies, seed: int) -> dict[str, str]:
    """policy -> the tiny synthetic model of `seed` (release layout) converted with that policy, under `base`."""
    from moepack.packer.convert import convert_checkpoint
    from moepack.packer.synth import synth_checkpoint

    src = str(base / "src")
    synth_checkpoint(src, preset="tiny", layout="release", seed=seed, progress=False)
    out = {}
    for policy in policies:
        out[policy] = str(base / f"{policy}.moepack")
        convert_checkpoint(src, out[policy], policy=policy, progress=False)
    return out


@contextlib.contextmanager
def source_reads_fail_at(n: int, exc: BaseException):
    """Inside the block, the n-th source tensor read raises `exc` (the disk going away, the process stopped)."""
    from moepack.packer.source import CheckpointDir

    real = CheckpointDir.read
    calls = [0]

    def read(self, t):
        calls[0] += 1
        if calls[0] == n:
            raise exc
        return real(self, t)

    CheckpointDir.read = read
    try:
        yield
    finally:
        CheckpointDir.read = real


def _journaled_regions(out: str) -> int:
    """How many regions the conversion to `out` has made durable (its journal's count; 0 before the first)."""
    import json

    try:
        with open(out + ".partial.journal", encoding="utf-8") as f:
            return len(json.load(f)["regions"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def kill_convert_at_random_points(convert_args: str, out: str, seed: int, after_kill, rounds: int = 4) -> int:
    """Run `convert_checkpoint(<convert_args>)` in a child (each source read slowed a little) and SIGKILL it at a
    random point of its progress, up to `rounds` times, the same command each time, until one run finishes and
    `out` exists. `after_kill()` checks the state each killed run leaves. Returns how many runs were killed.

    The points are observed, never timed (a delay would mean another point on a slower or busier machine): the
    first run dies as soon as its partial output exists, each later one once its journal holds 1 to 4 more durable
    regions than when it started."""
    import random
    import signal
    import subprocess
    import sys
    import time

    code = (
        "import time, moepack.packer.source as s\n"
        "real = s.CheckpointDir.read\n"
        "def slow(self, t):\n"
        "    time.sleep(0.004)\n"
        "    return real(self, t)\n"
        "s.CheckpointDir.read = slow\n"
        "from moepack.packer.convert import convert_checkpoint\n"
        f"convert_checkpoint({convert_args})\n"
    )
    rng = random.Random(seed)
    kills = 0
    for round_ in range(rounds):
        target = None if round_ == 0 else _journaled_regions(out) + rng.randint(1, 4)
        p = subprocess.Popen([sys.executable, "-c", code])

        def reached() -> bool:
            if target is None:
                return os.path.exists(out + ".partial")
            return _journaled_regions(out) >= target

        deadline = time.monotonic() + 300.0  # only a hung child gets here
        while p.poll() is None and not reached() and time.monotonic() < deadline:
            time.sleep(0.002)
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            kills += 1
        p.wait()
        if os.path.exists(out):
            break
        after_kill()
    return kills


@contextlib.contextmanager
def small_disk(path, size: str):
    """A tmpfs of `size` (mount's notation: 64k, 2M) mounted at `path` (made if missing) while the block runs: a disk
    that fills, or (remounted) one that is read-only. The test is skipped where this process may not mount."""
    path = str(path)
    os.makedirs(path, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True).returncode:
        import pytest

        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path])
