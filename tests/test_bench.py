"""moepack bench: the io grid with the runtime's reader (and fio beside it), memory and compute, the per-machine
cache and what `prefill` and `plan` take from it."""

from __future__ import annotations

import json
import os

import pytest

from containers import tiny_keep_container
from click.testing import CliRunner

from moepack.cli.main import cli
from moepack.runtime import tuning
from moepack.tools import bench as B


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return tiny_keep_container(tmp_path_factory)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> str:
    d = tmp_path / "cache"
    monkeypatch.setenv(tuning.CACHE_ENV, str(d))
    return str(d)


def test_io_grid_and_tuned_defaults(tiny, cache):
    assert tuning.tuned_defaults(tiny) is None  # nothing measured yet
    seen = []
    r = B.bench_io(tiny, bundles=(1, 4), depths=(1, 2), max_bytes=None, fio=False, on_cell=seen.append)
    assert [(c["bundle_experts"], c["queue_depth"]) for c in r["cells"]] == [(1, 1), (1, 2), (4, 1), (4, 2)]
    assert seen == r["cells"]
    from moepack.format_spec.reader import Container

    with Container(tiny) as c:
        sections = sum(b.experts_span[1] for b in c.layers)
    assert all(cell["bytes"] == sections and cell["gbps"] > 0 for cell in r["cells"])  # every expert, once
    assert r["io_mode"] in ("direct", "buffered")
    best = (r["best"]["bundle_experts"], r["best"]["queue_depth"])
    assert best in [(c["bundle_experts"], c["queue_depth"]) for c in r["cells"]]
    assert r["best"]["gbps"] >= (1 - B.NEAR_TIE) * max(c["gbps"] for c in r["cells"])
    # stored in the cache file, keyed by this machine and the file; prefill's defaults come back from it
    assert r["cache"] == os.path.join(cache, "bench.json")
    with open(r["cache"]) as f:
        data = json.load(f)
    assert data["format"] == "moepack-bench" and tuning.file_key(tiny) in data["machines"][tuning.machine_id()]["io"]
    assert tuning.tuned_defaults(tiny) == best


def test_tuned_defaults_forget_a_changed_file_or_another_machine(tiny, cache, monkeypatch, tmp_path):
    B.bench_io(tiny, bundles=(2,), depths=(3,), max_bytes=None, fio=False)
    assert tuning.tuned_defaults(tiny) == (2, 3)
    monkeypatch.setattr(tuning, "machine_id", lambda: "another-host")
    assert tuning.tuned_defaults(tiny) is None
    monkeypatch.undo()
    monkeypatch.setenv(tuning.CACHE_ENV, cache)
    st = os.stat(tiny)
    try:
        os.utime(tiny, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # "rewritten"
        assert tuning.tuned_defaults(tiny) is None
    finally:
        os.utime(tiny, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert tuning.tuned_defaults(tiny) == (2, 3)
    assert tuning.tuned_defaults(str(tmp_path / "missing.moepack")) is None
    with open(tuning.cache_path(), "w") as f:
        f.write("{damaged")
    with pytest.warns(RuntimeWarning):
        assert tuning.tuned_defaults(tiny) is None
    with pytest.warns(RuntimeWarning):  # a damaged cache is replaced
        B.bench_io(tiny, bundles=(1,), depths=(1,), max_bytes=None, fio=False)
    assert tuning.tuned_defaults(tiny) == (1, 1)


def test_io_byte_cap_reads_the_same_prefix_for_every_cell(tiny):
    r = B.bench_io(tiny, bundles=(1, 8), depths=(2,), max_bytes=300_000, fio=False, save=False)
    assert "cache" not in r
    cap_cells = [c["bytes"] for c in r["cells"]]
    assert all(300_000 <= b < 300_000 + 8 * r["expert_bytes"] for b in cap_cells)


def test_fio_comparison(tiny):
    if B.fio_available() is None:
        pytest.skip("fio is not installed (apt-get install -y fio): the reader-vs-fio comparison needs it")
    r = B.bench_io(tiny, bundles=(4,), depths=(2,), max_bytes=None, fio=True, save=False)
    f = r["fio"]
    assert f.get("gbps", 0) > 0, f
    assert f["engine"] in B.FIO_ENGINES and f["block_bytes"] == r["best"]["read_bytes"]
    assert f["iodepth"] in (1, 2) and "--direct=1" in f["command"] and "--rw=read" in f["command"]
    assert r["ours_over_fio"] == pytest.approx(r["best"]["gbps"] / f["gbps"])


def test_fio_uses_huge_page_buffers_where_reserved_ones_are_free(tiny, monkeypatch):
    """Huge-page buffers where enough reserved pages are free, ordinary ones otherwise, and ordinary ones again
    where fio refuses the huge pages (here: free ones claimed that are not really there)."""
    if B.fio_available() is None:
        pytest.skip("fio is not installed (apt-get install -y fio)")
    monkeypatch.setattr(B, "free_hugetlb_bytes", lambda: 0)
    plain = B.run_fio(tiny, 0, 1 << 20, 1 << 20, 2)
    if "failed" in plain:
        pytest.skip(f"fio cannot read here: {plain['failed']}")
    assert "--iomem" not in plain["command"] and plain["buffers"] == B.FIO_SMALL_BUFFERS
    calls = []
    real_run = B.subprocess.run
    monkeypatch.setattr(B, "free_hugetlb_bytes", lambda: 64 << 20)
    monkeypatch.setattr(B.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or real_run(cmd, **kw))
    huge = B.run_fio(tiny, 0, 1 << 20, 1 << 20, 2, engines=(plain["engine"],))  # the engine that works here
    assert calls[0] == plain["command"].split() + ["--iomem=mmaphuge"] and huge["gbps"] > 0
    if huge["buffers"] == B.FIO_HUGE_BUFFERS:
        assert len(calls) == 1 and huge["command"] == " ".join(calls[0])
    else:  # refused: the same command again with ordinary buffers, the refusal kept in "errors"
        assert huge["buffers"] == B.FIO_SMALL_BUFFERS and calls[1] == plain["command"].split()
        assert len(huge["errors"]) == 1 and "huge pages" in huge["errors"][0]


def test_free_hugetlb_bytes_reads_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nHugePages_Total:      64\nHugePages_Free:       48\n"
                       "HugePages_Rsvd:        0\nHugepagesize:       2048 kB\nHugetlb:          131072 kB\n")
    assert B.free_hugetlb_bytes(str(meminfo)) == 48 * 2048 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\n")  # no hugetlb support in the kernel
    assert B.free_hugetlb_bytes(str(meminfo)) == 0
    assert B.free_hugetlb_bytes(str(tmp_path / "absent")) == 0
    info = dict(line.split(":", 1) for line in open("/proc/meminfo"))
    if "HugePages_Free" in info:
        pages = int(info["HugePages_Free"].split()[0])
        assert B.free_hugetlb_bytes() == pages * int(info["Hugepagesize"].split()[0]) * 1024


def test_fio_missing_is_reported_not_fatal(tiny, monkeypatch):
    monkeypatch.setattr(B, "fio_available", lambda: None)
    r = B.bench_io(tiny, bundles=(1,), depths=(1,), max_bytes=None, fio=True, save=False)
    assert "not installed" in r["fio"]["skipped"]


def test_memory():
    r = B.bench_memory(size_mib=8, repeat=2, device="cpu")
    assert r["host_copy_gbps"] > 0 and r["host_traffic_gbps"] == pytest.approx(2 * r["host_copy_gbps"])
    assert tuning.cached("memory")["latest"]["host_copy_gbps"] == r["host_copy_gbps"]
    with pytest.raises(B.MoepackError):
        B.bench_memory(size_mib=0)


def test_compute_synthetic_and_from_a_container(tiny):
    r = B.bench_compute("cpu", tokens=(1, 16), storage="FP4_E2M1", hidden=256, intermediate=256, experts=1, repeat=1)
    assert [p["tokens_per_expert"] for p in r["points"]] == [1, 16]
    assert all(p["gflops"] > 0 and p["matmul_gflops"] > 0 and p["decode_seconds_per_expert"] >= 0
               for p in r["points"])
    assert r["storage"] == "FP4_E2M1" and (r["hidden"], r["intermediate"]) == (256, 256)
    key = B.compute_key("cpu", "FP4_E2M1", 256, 256, "float32")
    assert key in tuning.cached("compute")
    r = B.bench_compute("cpu", tokens=(4,), file=tiny, experts=2, repeat=1, save=False)
    assert r["storage"] == "FP4_E2M1" and r["source"] == os.path.realpath(tiny) and r["experts"] == 2
    for storage in ("MXFP4", "Q8_0", "BF16"):
        r = B.bench_compute("cpu", tokens=(2,), storage=storage, hidden=256, intermediate=256, experts=1, repeat=1,
                            expert_dtype="bfloat16", save=False)
        assert r["points"][0]["gflops"] > 0
    with pytest.raises(B.MoepackError):
        B.bench_compute("cpu", tokens=(1,), storage="Q4_K", hidden=256, intermediate=256)


def _crossover(points: list) -> int:
    """The rule the bench states: the last token count at which the fused kernel is as fast, before two in a row
    at which it is slower."""
    limit, losses = 0, []
    for p in points:
        slower = p["fused_seconds_per_expert"] > p["decoded_seconds_per_expert"]
        losses.append(slower)
        if losses[-2:] == [True, True]:
            break
        if not slower:
            limit = p["tokens_per_expert"]
    return limit


def test_compute_finds_the_fused_kernels_crossover(tiny):
    from moepack.runtime.expert_decode import fused_available

    assert tuning.tuned_fused_max_tokens(256, 256) is None  # nothing measured yet
    measured = []
    for storage in ("FP4_E2M1", "MXFP4"):
        r = B.bench_compute("cpu", tokens=(8,), storage=storage, hidden=256, intermediate=256, experts=1,
                            repeat=1, expert_dtype="bfloat16")
        if not fused_available():
            assert "fused" not in r
            continue
        fused = r["fused"]
        tokens = [p["tokens_per_expert"] for p in fused["points"]]
        assert tokens == list(B.FUSED_TOKENS[:len(tokens)]) and fused["threads"] == 1
        assert all(p["fused_seconds_per_expert"] > 0 and p["decoded_seconds_per_expert"] > 0
                   for p in fused["points"])
        assert fused["max_tokens"] == _crossover(fused["points"])
        # it stops at two losses in a row, or ran every point
        slower = [p["fused_seconds_per_expert"] > p["decoded_seconds_per_expert"] for p in fused["points"]]
        assert len(tokens) == len(B.FUSED_TOKENS) or slower[-2:] == [True, True]
        measured.append(fused["max_tokens"])
        assert tuning.tuned_fused_max_tokens(256, 256) in measured  # a run of this shape (both may share a second)
    # the fused kernel is for bf16 FP4 experts only: nothing measured for float32 or other storage types
    for storage, dtype in (("FP4_E2M1", "float32"), ("Q8_0", "bfloat16")):
        r = B.bench_compute("cpu", tokens=(8,), storage=storage, hidden=256, intermediate=256, experts=1, repeat=1,
                            expert_dtype=dtype, save=False)
        assert "fused" not in r


def _store_crossover(hidden: int, inter: int, max_tokens: int, cpu: str, when: str) -> None:
    tuning.store("compute", f"cpu|FP4_E2M1|{hidden}x{inter}|bfloat16|{cpu}", {
        "device": "cpu", "device_name": cpu, "hidden": hidden, "intermediate": inter, "measured_at": when,
        "points": [], "fused": {"threads": 1, "points": [], "max_tokens": max_tokens}})


def test_prefill_takes_the_crossover_measured_on_this_cpu(tiny, monkeypatch):
    import torch

    from moepack.runtime import expert_decode
    from moepack.runtime.engine import PrefillOptions, prefill

    from moepack.format_spec.reader import Container

    with Container(tiny) as c:
        hidden, inter = c.config["hidden_size"], c.config["moe_intermediate_size"]
    cpu = tuning.cpu_model()
    _store_crossover(4096, 2048, 96, cpu, "2026-01-01T00:00:00")
    _store_crossover(hidden, inter, 7, "another CPU", "2026-01-03T00:00:00")  # not this CPU: never taken
    _store_crossover(hidden, inter, 12, cpu, "2026-01-01T00:00:00")
    _store_crossover(hidden, inter, 16, cpu, "2026-01-02T00:00:00")
    _store_crossover(hidden, 2 * inter, 20, cpu, "2026-01-04T00:00:00")
    assert tuning.tuned_fused_max_tokens(hidden, inter) == 16  # the same shape, the latest run
    assert tuning.tuned_fused_max_tokens(hidden, 3 * inter) == 20  # the same hidden size, the latest run
    assert tuning.tuned_fused_max_tokens(4096, 1024) == 96
    assert tuning.tuned_fused_max_tokens(2048, 2048) is None  # another hidden size: its crossover says nothing here
    if not expert_decode.fused_available():
        stats = prefill(tiny, torch.arange(40), PrefillOptions(compute_dtype="bfloat16")).stats
        assert (stats["fused_expert_max_tokens"], stats["fused_expert_max_tokens_source"]) == (0, "not available")
        return
    calls = []
    real_expert = expert_decode.FusedKernels.expert
    monkeypatch.setattr(expert_decode.FusedKernels, "expert",
                        lambda self, *args, **kw: calls.append(len(args[0])) or real_expert(self, *args, **kw))
    ids = torch.randint(0, 500, (90,), generator=torch.Generator().manual_seed(3))
    options = PrefillOptions(compute_dtype="bfloat16", expert_selection="all")
    tuned = prefill(tiny, ids, options)
    assert (tuned.stats["fused_expert_max_tokens"], tuned.stats["fused_expert_max_tokens_source"]) == \
        (16, "bench compute")
    assert calls and max(calls) <= 16 and max(l.tokens_per_expert_max for l in tuned.layers) > 16
    calls.clear()
    given = prefill(tiny, ids, PrefillOptions(compute_dtype="bfloat16", expert_selection="all",
                                              fused_max_tokens=0))
    assert (given.stats["fused_expert_max_tokens"], given.stats["fused_expert_max_tokens_source"]) == (0, "given")
    assert not calls  # 0: never fused
    # the same experts either way, bf16 products either way
    assert (tuned.logits - given.logits).abs().max() <= 3e-2 * given.logits.abs().max()
    with pytest.raises(B.MoepackError, match="fused_max_tokens"):
        prefill(tiny, ids, PrefillOptions(compute_dtype="bfloat16", fused_max_tokens=-1))


def test_compute_decode_is_the_engines(tiny):
    """The bench runs an expert exactly as the engine does: same decode path, same output bits."""
    _assert_bench_runs_experts_as_the_engine(tiny)


def _assert_bench_runs_experts_as_the_engine(path: str) -> None:
    import torch

    from moepack.format_spec.reader import Container
    from moepack.runtime.engine import PrefillOptions, StreamingPrefill
    from moepack.runtime.expert_decode import ExpertDecoder

    experts, hidden, _, _, arith = B._container_experts(path, 1, torch.float32)
    tensors = {n: (t, tuple(s), torch.frombuffer(bytearray(b), dtype=torch.uint8)) for n, t, s, b in experts[0]}
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(0))
    decoder = ExpertDecoder(torch.float32, torch.device("cpu"))
    with Container(path) as c:
        engine = StreamingPrefill(c, PrefillOptions(io_mode="buffered", compute_dtype="float32"))
        try:
            got = arith.run(B._decode_expert(tensors, decoder, arith), x)
            block = [b for b in c.layers if b.experts][-1]
            region = block.experts[0]
            raw = torch.frombuffer(bytearray(c.pread(region.offset, region.length)), dtype=torch.uint8)
            ref = engine.experts.expert_output(block, region, raw, region.offset, x, torch.empty(x.shape))
        finally:
            engine.close()
            decoder.close()
    assert torch.equal(got, ref)


@pytest.fixture(scope="module")
def qwen_tiny(tmp_path_factory) -> str:
    from moepack.packer.convert import convert_checkpoint
    from moepack.packer.synth import synth_checkpoint

    base = tmp_path_factory.mktemp("bench-qwen3")
    synth_checkpoint(str(base / "src"), preset="tiny", layout="bf16", progress=False, family="qwen3-moe")
    convert_checkpoint(str(base / "src"), str(base / "q.moepack"), policy="keep", progress=False)
    return str(base / "q.moepack")


def test_compute_times_any_familys_container_as_the_engine_runs_it(qwen_tiny, tiny):
    """A second family's container is timed with its own expert names and FFN (its expert_ffn, no compiled
    kernels, no fused crossover), and the bench's expert output is the engine's, bit for bit."""
    r = B.bench_compute("cpu", tokens=(1, 4), file=qwen_tiny, experts=2, repeat=1, save=False,
                        expert_dtype="bfloat16")
    assert r["family"] == "qwen3-moe" and r["experts"] == 2 and "fused" not in r
    assert all(p["gflops"] > 0 for p in r["points"])
    _assert_bench_runs_experts_as_the_engine(qwen_tiny)
    # synthetic experts as that family's, and a container timed as another family's is refused in one line
    r = B.bench_compute("cpu", tokens=(2,), storage="BF16", hidden=256, intermediate=256, experts=1, repeat=1,
                        save=False, family="qwen3-moe")
    assert r["family"] == "qwen3-moe" and r["source"] == "synthetic"
    assert B.bench_compute("cpu", tokens=(2,), storage="BF16", hidden=256, intermediate=256, experts=1, repeat=1,
                           save=False)["family"] == "deepseek-v4"  # the default: the compiled kernels' family
    with pytest.raises(B.MoepackError, match="holds a deepseek-v4 model"):
        B.bench_compute("cpu", tokens=(2,), file=tiny, experts=1, repeat=1, save=False, family="qwen3-moe")


def test_plan_uses_the_measurements(tiny):
    B.bench_io(tiny, bundles=(2,), depths=(3,), max_bytes=None, fio=False)
    B.bench_compute("cpu", tokens=(1, 64), file=tiny, experts=1, repeat=1)
    B.bench_memory(size_mib=8, repeat=1, device="cpu")
    r = CliRunner().invoke(cli, ["plan", tiny, "--context", "64,256", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)["settings"]
    assert s["ssd_source"].startswith("measured by bench io on this file")
    assert s["compute_source"].startswith("measured by bench compute on cpu (FP4_E2M1 256x256")
    assert s["mem_source"].startswith("measured") and s["pcie_gbps"] is None  # CPU compute: no PCIe stage
    assert (s["bundle_experts"], s["queue_depth"]) == (2, 3)
    # given values win over measured ones, and this machine's memory rate stays out of another machine's plan
    r = CliRunner().invoke(cli, ["plan", tiny, "--ssd-gbps", "7", "--tflops", "20", "--json"])
    s = json.loads(r.output)["settings"]
    assert (s["ssd_source"], s["compute_source"], s["mem_gbps"]) == ("given", "given", None)


def test_cli_bench(tiny, cache):
    runner = CliRunner()
    r = runner.invoke(cli, ["bench", "io", tiny, "--bundles", "1,2", "--depths", "1,2", "--all", "--no-fio",
                            "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["ok"] and len(out["cells"]) == 4 and out["fio"] is None
    r = runner.invoke(cli, ["bench", "io", tiny, "--bundles", "1", "--depths", "2", "--all", "--no-fio"])
    assert r.exit_code == 0 and "best: 1 experts per read" in r.output and "saved to" in r.output
    r = runner.invoke(cli, ["bench", "memory", "--size-mib", "4", "--repeat", "1", "--device", "cpu"])
    assert r.exit_code == 0 and "host memory copy:" in r.output
    r = runner.invoke(cli, ["bench", "compute", "--tokens", "1,8", "--hidden", "256", "--intermediate", "256",
                            "--experts", "1", "--repeat", "1", "--no-save"])
    assert r.exit_code == 0 and "tokens/expert" in r.output, r.output
    for args, message in ((["bench", "io", tiny + ".missing"], "no such file"),
                          (["bench", "io", tiny, "--bundles", "0"], "--bundles"),
                          (["bench", "compute", "--device", "tpu"], "--device"),
                          (["bench", "compute", "--hidden", "300"], "multiples of 256")):
        r = runner.invoke(cli, args)
        assert r.exit_code == 1, (args, r.output)
        assert r.output.strip().splitlines() == [r.output.strip()] and r.output.startswith("moepack: error: ")
        assert message in r.output
    if not __import__("torch").cuda.is_available():
        r = runner.invoke(cli, ["bench", "compute", "--device", "cuda", "--hidden", "256", "--intermediate", "256"])
        assert r.exit_code == 1 and "no CUDA device" in r.output


def test_a_bench_cache_that_cannot_be_written_is_refused_before_measuring(tmp_path, monkeypatch):
    """A read-only (or otherwise unwritable) MOEPACK_CACHE_DIR: every bench measured first, for minutes with a
    large container, then failed to keep the result; and a write that failed part-way left its temporary."""
    import errno

    from moepack.format_spec.errors import MoepackError

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(tuning.CACHE_ENV, str(blocker / "cache"))  # under a file: no folder can be made there
    for measure in (lambda: B.bench_io(str(tmp_path / "absent.moepack")), lambda: B.bench_memory(8, 1),
                    lambda: B.bench_compute(tokens=(1,), repeat=1)):
        with pytest.raises(MoepackError, match="cannot write the bench cache .*--no-save"):
            measure()  # the io bench's missing container is never reached

    cache = tmp_path / "cache"
    monkeypatch.setenv(tuning.CACHE_ENV, str(cache))

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(json, "dump", disk_full)
    with pytest.raises(MoepackError, match="No space left on device"):
        tuning.store("memory", "latest", {"x": 1})
    assert os.listdir(cache) == []
