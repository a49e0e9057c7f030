"""Multi-part containers (`convert --parts P`, SPEC.md section 9): the same logits as one file, bit for bit; every
part read once; broken, missing and foreign parts refused with one line naming the part; interrupted multi-part
conversions resume to the same bytes; single-file containers exactly as before."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from containers import (
    build_container, container_files, copy_container, kill_convert_at_random_points, mutate_index, read_parts,
    restamp_parts, source_reads_fail_at,
)
from moepack.cli.main import cli
from moepack.format_spec.errors import FormatError, MoepackError
from moepack.format_spec.layout import _PART_HEADER_FIELDS, HEADER_SIZE
from moepack.format_spec.reader import Container
from moepack.format_spec.verify import verify_container
from moepack.packer.convert import convert_checkpoint
from moepack.packer.synth import synth_checkpoint
from moepack.runtime.engine import PrefillOptions, prefill
from moepack.runtime.read_scheduler import expert_reads
from moepack.runtime.io import RegionReader

IDS = list(range(3, 23))  # 20 tokens: "all" reads every expert of the top-k layers, "routed" only the chosen ones
LAYOUTS = [(2, 2), (3, 1)]  # (parts, stripe_experts) over the tiny model's 8 experts per layer
SINGLE_FILE_INDEX_KEYS = {"format", "format_version", "architecture", "config", "policy", "tokenizer", "provenance",
                          "extra", "regions", "tensors"}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("parts-src") / "tiny")
    synth_checkpoint(d, preset="tiny", layout="release", seed=3, progress=False)
    return d


@pytest.fixture(scope="module")
def build(src, tmp_path_factory):
    """build(policy, parts, stripe) -> path of that conversion, converted once per module."""
    base = tmp_path_factory.mktemp("parts-out")
    done: dict[tuple, str] = {}

    def get(policy: str = "keep", parts: int = 1, stripe: int = 1) -> str:
        key = (policy, parts, stripe if parts > 1 else 1)
        if key not in done:
            out = str(base / f"{policy}-p{parts}-s{stripe}.moepack")
            convert_checkpoint(src, out, policy=policy, progress=False, parts=parts, stripe_experts=stripe)
            done[key] = out
        return done[key]

    return get


def _used_bytes_by_part(path: str) -> list[int]:
    """What an all-experts prefill needs from each part file: every region but the MTP block's."""
    with Container(path) as c:
        return [sum(r.length for r in c.regions if r.part == k and not (r.block or "").startswith("mtp."))
                for k in range(c.part_count)]


@pytest.mark.parametrize("policy", ["keep", "bf16", "nvfp4", "fp4"])
def test_parts_give_the_single_file_logits_bit_exactly(build, policy):
    single = build(policy)
    for selection in ("all", "routed"):
        ref = prefill(single, IDS, PrefillOptions(expert_selection=selection, io_mode="direct"))
        for parts, stripe in LAYOUTS:
            r = prefill(build(policy, parts, stripe), IDS, PrefillOptions(expert_selection=selection,
                                                                          io_mode="direct"))
            assert torch.equal(r.logits, ref.logits), (policy, selection, parts)
            assert r.stats["bytes_read"] == ref.stats["bytes_read"]  # the same bytes, only spread over the parts
            per_part = r.stats["bytes_read_per_part"]
            assert len(per_part) == parts and sum(per_part) == r.stats["bytes_read"]
            if selection == "all":
                assert r.stats["bytes_read_per_part"] == _used_bytes_by_part(build(policy, parts, stripe))


def test_each_part_is_read_once(build, monkeypatch):
    """Every read lands in one part file; per part the reads tile exactly the regions prefill uses, none twice."""
    path = build("keep", 3, 1)
    reads: list[tuple[int, int, int]] = []
    real = RegionReader.read_into

    def recording(self, buffer, offset, length, part=0):
        reads.append((part, offset, length))
        return real(self, buffer, offset, length, part)

    monkeypatch.setattr(RegionReader, "read_into", recording)
    for bundle in (1, 2, 8):
        reads.clear()
        prefill(path, IDS, PrefillOptions(expert_selection="all", bundle_experts=bundle, queue_depth=3))
        with Container(path) as c:
            for k in range(c.part_count):
                got = sorted((o, n) for p, o, n in reads if p == k)
                want = sorted((r.offset, r.length) for r in c.regions
                              if r.part == k and not (r.block or "").startswith("mtp."))
                covered = [(o, o + n) for o, n in got]
                assert all(a[1] <= b[0] for a, b in zip(covered, covered[1:])), "a byte read twice"
                assert sum(n for _, n in got) == sum(n for _, n in want)
                assert covered[0][0] == want[0][0] and covered[-1][1] == want[-1][0] + want[-1][1]


def test_consecutive_expert_reads_go_to_different_parts(build):
    with Container(build("keep", 2, 2)) as c:
        block = c.layers[-1]
        parts = lambda bundle: [s.part for _, _, s in expert_reads(block, list(range(8)), bundle)]  # noqa: E731
        assert parts(2) == [0, 1, 0, 1]  # bundle == stripe: each read one stripe, alternating devices
        assert parts(8) == [0, 1, 0, 1]  # a larger bundle is cut at the stripe boundaries
        assert parts(1) == [0, 0, 1, 1, 0, 0, 1, 1]
        assert [(f, n) for f, n, _ in expert_reads(block, [1, 2, 3, 5], 4)] == [(1, 1), (2, 2), (5, 1)]


def test_reader_api_never_hands_out_a_span_of_the_wrong_file(build):
    with Container(build("keep", 2, 2)) as c:
        block = c.layers[0]
        assert block.expert_span(0, 2) == (block.experts[0].offset, 2 * block.experts[0].length)
        span = block.expert_read(2, 2)
        assert (span.part, span.offset) == (1, block.experts[2].offset)
        with pytest.raises(FormatError, match="part file 1.*expert_read"):
            block.expert_span(2, 1)
        with pytest.raises(FormatError, match="not one read"):
            block.expert_read(1, 2)
        assert block.split_runs([(0, 8), (3, 2)]) == [(0, 2), (2, 2), (4, 2), (6, 2), (3, 1), (4, 1)]
        assert c.tensor_bytes(block.experts[2].tensors[0].name) == c.pread(
            block.experts[2].offset + block.experts[2].tensors[0].offset, block.experts[2].tensors[0].length, 1)


def test_single_file_containers_are_unchanged(build, src, tmp_path):
    """--parts 1 (the default) writes format 1.0 exactly as before: no new index key, no part field, no part file."""
    path = build("keep")
    _, header, index = read_parts(path)
    assert (header.major, header.minor) == (1, 0) and set(index) == SINGLE_FILE_INDEX_KEYS
    assert all(set(r) == {"name", "kind", "block", "expert", "offset", "length", "xxh3"} for r in index["regions"])
    assert container_files(path) == [path]
    with Container(path) as c:
        assert c.part_count == 1 and c.part_paths == [path] and c.total_bytes == c.file_size
    assert verify_container(path).parts == 1
    again = str(tmp_path / "again.moepack")  # --stripe-experts means nothing without --parts
    convert_checkpoint(src, again, progress=False, stripe_experts=3)
    assert open(again, "rb").read() == open(path, "rb").read()


def test_multi_part_layout_on_disk(build):
    path = build("keep", 3, 1)
    _, header, index = read_parts(path)
    assert (header.major, header.minor) == (1, 1)
    assert index["parts"] == {"count": 3, "stripe_experts": 1}
    assert container_files(path) == [path, path + ".part1", path + ".part2"]
    with Container(path) as c:
        for k, size in enumerate(c.part_sizes):
            assert os.path.getsize(c.part_paths[k]) == size and size % 4096 == 0
        for block in c.layers:
            assert [r.part for r in block.experts] == [e % 3 for e in range(8)]
        assert all(r.part == 0 for r in c.regions if r.kind != "expert" or r.block.startswith("mtp."))
        assert c.data_bytes == sum(r.length for r in c.regions)
    r = verify_container(path)
    assert r.parts == 3 and r.bytes_read == sum(_used_bytes_by_part(path)) + sum(
        x.length for x in Container(path).regions if (x.block or "").startswith("mtp."))


# --- damage ------------------------------------------------------------------------------------------------------

def _missing(path):
    os.remove(path + ".part2")
    return r"\.part2: part 2 of 3 of .* is missing"


def _truncated(path):
    os.truncate(path + ".part1", os.path.getsize(path + ".part1") - 4096)
    return r"\.part1 \(part 1 of 3\): part file is truncated"


def _appended(path):
    with open(path + ".part2", "ab") as f:
        f.write(bytes(4096))
    return r"\.part2 \(part 2 of 3\): part file is longer than recorded"


def _renamed(path):
    shutil.copy(path + ".part2", path + ".part1")
    return r"\.part1 \(part 1 of 3\): the file is part 2 of 3"


def _damaged_header(path):
    with open(path + ".part1", "r+b") as f:
        f.seek(33)
        f.write(b"\x07")
    return r"\.part1 \(part 1 of 3\): part header checksum mismatch"


CASES = [("missing", _missing), ("truncated", _truncated), ("appended", _appended), ("renamed", _renamed),
         ("damaged header", _damaged_header)]


@pytest.mark.parametrize("label,damage", CASES, ids=[c[0] for c in CASES])
def test_broken_parts_are_refused_with_one_line_naming_the_part(build, tmp_path, label, damage):
    path = copy_container(build("keep", 3, 1), str(tmp_path / "c.moepack"))
    message = damage(path)
    with pytest.raises(FormatError, match=message) as info:
        Container(path)
    assert "\n" not in str(info.value)
    for command in (["verify", path], ["inspect", path], ["prefill", path, "--prompt", "hi"]):
        r = CliRunner().invoke(cli, command)
        assert r.exit_code == 1 and r.stderr.strip().count("\n") == 0, r.output
        assert r.stderr.startswith("moepack: error: ") and "part" in r.stderr


def test_a_part_from_another_container_is_refused(build, tmp_path):
    path = copy_container(build("keep", 3, 1), str(tmp_path / "c.moepack"))
    shutil.copy(build("bf16", 3, 1) + ".part1", path + ".part1")
    with pytest.raises(FormatError, match=r"\.part1 \(part 1 of 3\): belongs to another container"):
        Container(path)


def test_a_part_file_is_not_a_container(build, tmp_path):
    with pytest.raises(FormatError, match="part file 2 of 3 of a multi-part container, not its main file"):
        Container(build("keep", 3, 1) + ".part2")
    data = bytearray(open(build("keep", 3, 1) + ".part2", "rb").read())
    for number, count in ((9064448, 0), (0, 3), (3, 3), (1, 10_000)):  # numbers no part file has: not repeated
        fields = list(_PART_HEADER_FIELDS.unpack_from(data))
        fields[7:9] = number, count
        _PART_HEADER_FIELDS.pack_into(data, 0, *fields)
        (tmp_path / "odd.part").write_bytes(data)
        with pytest.raises(FormatError, match=rf"^a moepack part file whose header is damaged \(it says part "
                                              rf"{number} of {count}\)$"):
            Container(str(tmp_path / "odd.part"))


def test_flipped_byte_in_part_2_is_caught_and_named(build, tmp_path):
    path = copy_container(build("keep", 3, 1), str(tmp_path / "c.moepack"))
    with Container(path) as c:
        victim = c.layers[2].experts[5]  # expert 5 % 3 == 2
        assert victim.part == 2
    with open(path + ".part2", "r+b") as f:
        f.seek(victim.offset + 100)
        byte = f.read(1)
        f.seek(victim.offset + 100)
        f.write(bytes([byte[0] ^ 0x10]))
    named = r"layers\.2\.experts\.5 \(in .*c\.moepack\.part2\)"
    with pytest.raises(FormatError, match=named + ": checksum mismatch"):
        verify_container(path)
    with pytest.raises(FormatError, match=named + ": checksum mismatch while streaming"):
        prefill(path, IDS, PrefillOptions(expert_selection="all"))
    r = CliRunner().invoke(cli, ["verify", path, "--json"])
    assert r.exit_code == 1 and "c.moepack.part2" in json.loads(r.stdout)["error"]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """build_container's model in 2 parts, one expert per stripe: experts 0, 2 in the main file, 1 in part 1."""
    path = str(tmp_path_factory.mktemp("parts-small") / "small.moepack")
    build_container(path, parts=2, stripe_experts=1)
    return path


def _region(index, name):
    return next(r for r in index["regions"] if r["name"] == name)


INDEX_CASES = [
    ("part against the rule", lambda i: _region(i, "layers.0.experts.1").pop("part"),
     "striping rule puts it in part 1"),
    ("dense in a part", lambda i: _region(i, "layers.0.dense").update(part=1), "striping rule puts it in part 0"),
    ("part out of range", lambda i: _region(i, "layers.1.experts.1").update(part=2), "part 2 does not exist"),
    ("part not an int", lambda i: _region(i, "layers.1.experts.1").update(part="1"), "part must be an integer"),
    ("one part", lambda i: i["parts"].update(count=1), "parts count must be an integer >= 2"),
    ("too many parts", lambda i: i["parts"].update(count=100000), "above the limit"),
    ("other stripe", lambda i: i["parts"].update(stripe_experts=2), "striping rule"),
    ("parts not an object", lambda i: i.update(parts=[2, 1]), "'parts' must be an object"),
    ("gap in part 1", lambda i: _region(i, "layers.1.experts.1").update(
        offset=_region(i, "layers.1.experts.1")["offset"] + 4096), "of part 1, leaves a gap"),
    ("no parts key", lambda i: i.pop("parts"), "part 1 does not exist"),
]


@pytest.mark.parametrize("label,mutate,message", INDEX_CASES, ids=[c[0] for c in INDEX_CASES])
def test_index_rules_of_multi_part_containers(small, tmp_path, label, mutate, message):
    bad = str(tmp_path / "bad.moepack")
    mutate_index(small, bad, mutate)
    restamp_parts(small, bad)
    with pytest.raises(FormatError, match=message):
        Container(bad)


def test_part_sizes_must_match_their_regions(small, tmp_path):
    bad = str(tmp_path / "bad.moepack")
    mutate_index(small, bad, lambda i: None)
    restamp_parts(small, bad)
    data = open(bad + ".part1", "rb").read()
    from moepack.format_spec.layout import PartHeader

    grown = bytearray(data + bytes(4096))
    grown[:HEADER_SIZE] = PartHeader(1, 2, len(grown), read_parts(bad)[1].index_xxh3).pack()
    open(bad + ".part1", "wb").write(grown)
    with pytest.raises(FormatError, match=r"part 1 of 2\): .* bytes, but its regions in the index end at"):
        Container(bad)


@settings(max_examples=int(os.environ.get("MOEPACK_FUZZ_EXAMPLES", "60")), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_part_field_or_part_byte(small, tmp_path_factory, data):
    """Arbitrary `parts` / `part` values (parts re-stamped to match) and arbitrary bytes in a part file end in a
    valid container or one line of FormatError, never another exception."""
    values = st.none() | st.booleans() | st.integers(-3, 5) | st.text(max_size=3) | st.dictionaries(
        st.sampled_from(["count", "stripe_experts", "x"]), st.integers(-1, 4) | st.none(), max_size=3)
    field = data.draw(st.sampled_from(["parts", "part", "part bytes"]))
    dst = str(tmp_path_factory.mktemp("pf") / "x.moepack")
    value = data.draw(values)
    if field == "parts":
        mutate_index(small, dst, lambda i: i.update(parts=value))
    elif field == "part":
        n = data.draw(st.integers(0, len(read_parts(small)[2]["regions"]) - 1))
        mutate_index(small, dst, lambda i: i["regions"][n].update(part=value))
    else:
        mutate_index(small, dst, lambda i: None)
    restamp_parts(small, dst)
    if field == "part bytes":
        raw = bytearray(open(dst + ".part1", "rb").read())
        for _ in range(data.draw(st.integers(1, 3))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        cut = data.draw(st.one_of(st.none(), st.integers(0, len(raw))))
        open(dst + ".part1", "wb").write(bytes(raw[:cut] if cut is not None else raw))
    try:
        Container(dst).close()
        verify_container(dst)
    except FormatError as e:
        assert "\n" not in str(e)


# --- writing -----------------------------------------------------------------------------------------------------

def test_bad_part_options_are_refused(src, tmp_path):
    out = str(tmp_path / "x.moepack")
    with pytest.raises(MoepackError, match="some part files would hold no expert"):
        convert_checkpoint(src, out, progress=False, parts=3, stripe_experts=4)  # 8 experts: 2 stripes of 4
    with pytest.raises(MoepackError, match="part 3 does not exist"):
        convert_checkpoint(src, out, progress=False, parts=2, stripe_experts=1, part_dirs={3: str(tmp_path)})
    with pytest.raises(MoepackError, match="no such directory"):
        convert_checkpoint(src, out, progress=False, parts=2, stripe_experts=1, part_dirs={1: str(tmp_path / "no")})
    r = CliRunner().invoke(cli, ["convert", src, "-o", out, "--keep", "--part-dir", "1=" + str(tmp_path)])
    assert r.exit_code == 2 and "--part-dir needs --parts" in r.output
    assert not os.path.exists(out)


def test_cli_convert_with_a_part_on_another_directory(build, src, tmp_path):
    """--part-dir writes a part elsewhere (another SSD) and leaves a symlink under the canonical name; inspect,
    verify and prefill see the same container as one written in one directory."""
    elsewhere = tmp_path / "ssd2"
    elsewhere.mkdir()
    out = str(tmp_path / "c.moepack")
    r = CliRunner().invoke(cli, ["convert", src, "-o", out, "--keep", "--parts", "2", "--stripe-experts", "2",
                                 "--part-dir", f"1={elsewhere}", "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert [p["path"] for p in summary["parts"]] == [out, out + ".part1"]
    assert os.path.islink(out + ".part1") and os.path.realpath(out + ".part1") == str(elsewhere / "c.moepack.part1")
    reference = build("keep", 2, 2)
    for mine, theirs in zip(container_files(out), container_files(reference)):
        assert open(mine, "rb").read() == open(theirs, "rb").read()
    inspected = json.loads(CliRunner().invoke(cli, ["inspect", out, "--json"]).stdout)
    assert [p["part"] for p in inspected["parts"]] == [0, 1] and inspected["stripe_experts"] == 2
    assert inspected["total_bytes"] == sum(p["bytes"] for p in summary["parts"])
    assert "part 1:" in CliRunner().invoke(cli, ["inspect", out]).stdout
    verified = json.loads(CliRunner().invoke(cli, ["verify", out, "--json"]).stdout)
    assert verified["ok"] and verified["parts"] == 2
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(IDS))
    r = CliRunner().invoke(cli, ["prefill", out, "--token-ids", str(ids), "--experts", "all", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["bytes_read_per_part"] == _used_bytes_by_part(out)


def test_interrupted_multi_part_convert_resumes_to_identical_bytes(build, src, tmp_path):
    out = str(tmp_path / "resume.moepack")
    with source_reads_fail_at(150, KeyboardInterrupt()), pytest.raises(KeyboardInterrupt):
        convert_checkpoint(src, out, progress=False, parts=2, stripe_experts=2)
    assert not os.path.exists(out) and not os.path.exists(out + ".part1")
    assert os.path.exists(out + ".part1.partial") and os.path.exists(out + ".partial.journal")
    # another part layout must not pick up this journal
    other = convert_checkpoint(src, out, progress=False, parts=3, stripe_experts=1)
    assert other["resumed_regions"] == 0
    os.remove(out), os.remove(out + ".part1"), os.remove(out + ".part2")
    with source_reads_fail_at(150, KeyboardInterrupt()), pytest.raises(KeyboardInterrupt):
        convert_checkpoint(src, out, progress=False, parts=2, stripe_experts=2)
    summary = convert_checkpoint(src, out, progress=False, parts=2, stripe_experts=2)
    assert summary["resumed_regions"] > 0
    for mine, theirs in zip(container_files(out), container_files(build("keep", 2, 2))):
        assert open(mine, "rb").read() == open(theirs, "rb").read()
    assert not [f for f in os.listdir(tmp_path) if "partial" in f]


def test_kill_9_during_a_multi_part_convert_then_rerun_is_byte_identical(build, src, tmp_path):
    """Real SIGKILLs at random moments of a 3-part conversion (one part in another directory), each followed by the
    same command; no final name ever holds a partial file, and the result equals an uninterrupted run's bytes."""
    out = str(tmp_path / "killed.moepack")
    elsewhere = tmp_path / "ssd2"
    elsewhere.mkdir()

    def after_kill():
        assert not os.path.exists(out + ".part1") or os.path.exists(out + ".partial")

    kills = kill_convert_at_random_points(
        f"{src!r}, {out!r}, progress=False, parts=3, stripe_experts=1, part_dirs={{2: {str(elsewhere)!r}}}", out,
        99, after_kill)
    assert kills >= 1
    if not os.path.exists(out):
        convert_checkpoint(src, out, progress=False, parts=3, stripe_experts=1, part_dirs={2: str(elsewhere)})
    assert os.path.islink(out + ".part2")
    for mine, theirs in zip(container_files(out), container_files(build("keep", 3, 1)), strict=True):
        assert open(mine, "rb").read() == open(theirs, "rb").read()


# --- expert parallel ---------------------------------------------------------------------------------------------

def test_expert_parallel_container_per_rank_with_parts(build, tmp_path):
    """torchrun, 2 gloo ranks, each its own copy of a 2-part container: the single-process logits, and each rank
    reads only its own experts from each part."""
    path = build("keep", 2, 2)
    for rank in range(2):
        copy_container(path, str(tmp_path / f"copy{rank}.moepack"))
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(IDS))
    logits = str(tmp_path / "logits.safetensors")
    port = subprocess.run([sys.executable, "-c", "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); "
                           "print(s.getsockname()[1])"], capture_output=True, text=True).stdout.strip()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port, "-m",
           "moepack", "prefill", str(tmp_path / "copy{rank}.moepack"), "--token-ids", str(ids), "--expert-parallel",
           "--container-per-rank", "--experts", "all", "--logits-out", logits, "--json",
           "--compute-dtype", "float32"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    stats = json.loads(p.stdout[p.stdout.index("{"):])
    from safetensors.torch import load_file

    single = prefill(path, IDS, PrefillOptions(expert_selection="all"))
    got = load_file(logits)["logits"]
    assert torch.allclose(got, single.logits, atol=1e-3 * single.logits.abs().max().item())
    total = [0, 0]
    for r in stats["ranks"]:
        for k, n in enumerate(r["bytes_read_per_part"]):
            total[k] += n
    with Container(path) as c:
        shared = sum(r.length for r in c.global_regions) + sum(b.dense.length for b in c.layers)
    # each rank reads the globals and dense regions (part 0); across the ranks every expert is read once
    assert total[0] == _used_bytes_by_part(path)[0] + shared
    assert total[1] == _used_bytes_by_part(path)[1]
