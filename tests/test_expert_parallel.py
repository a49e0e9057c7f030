"""Expert-parallel prefill: torchrun with 2 and 4 gloo ranks gives the single-process logits, each rank reads only
its share, and a rank that dies makes the others fail with a clear error instead of hanging."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers")
from v4_models import build  # noqa: E402

from moepack.format_spec.reader import Container  # noqa: E402
from moepack.packer.convert import convert_checkpoint  # noqa: E402
from moepack.runtime.distributed import owned_range  # noqa: E402
from moepack.runtime.engine import PrefillOptions, prefill  # noqa: E402

IDS = list(range(5, 85))  # 80 tokens: every expert of config B's layers gets some


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("ep")
    build("B", str(base))
    container = str(base / "B.moepack")
    convert_checkpoint(str(base / "B"), container, progress=False)
    ids_file = base / "ids.json"
    ids_file.write_text(json.dumps([i % 61 for i in IDS]))
    single = prefill(container, [i % 61 for i in IDS], PrefillOptions(expert_selection="all"))
    return base, container, str(ids_file), single


def _torchrun(ranks: int, container: str, ids_file: str, out: str, *extra) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
           str(_free_port()), "-m", "moepack", "prefill", container, "--token-ids", ids_file, "--expert-parallel",
           "--experts", "all", "--logits-out", out, "--json", "--compute-dtype", "float32", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout[p.stdout.index("{"):])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks(setup, tmp_path_factory) -> tuple[dict, torch.Tensor]:
    """(stats, logits) of one 2-rank run with the default (contiguous) ownership: two tests read it."""
    _, container, ids_file, _ = setup
    out = str(tmp_path_factory.mktemp("ep2") / "logits.safetensors")
    return _torchrun(2, container, ids_file, out), load_file(out)["logits"]


@pytest.mark.parametrize("ranks", [2, 4])
def test_ranks_match_single_process_and_split_the_reads(setup, two_ranks, tmp_path, ranks):
    base, container, ids_file, single = setup
    if ranks == 2:
        stats, logits = two_ranks
    else:
        out = str(tmp_path / "logits.safetensors")
        stats = _torchrun(ranks, container, ids_file, out)
        logits = load_file(out)["logits"]
    assert (logits - single.logits).abs().max() <= 1e-3 * single.logits.abs().max()
    assert stats["next_token"] == single.next_token
    per_rank = stats["ranks"]
    assert [r["rank"] for r in per_rank] == list(range(ranks))
    with Container(container) as c:
        globals_ = sum(r.length for r in c.global_regions)
        dense = sum(b.dense.length for b in c.layers)
        for r in per_rank:
            mine = sum(b.experts[e].length for b in c.layers for e in owned_range(len(b.experts), r["rank"], ranks))
            assert r["bytes_read"] == globals_ + dense + mine  # its share only
        all_experts = sum(b.experts_span[1] for b in c.layers)
    expert_bytes = sum(r["bytes_read"] for r in per_rank) - ranks * (globals_ + dense)
    assert expert_bytes == all_experts  # together: the model's experts exactly once
    assert all(r["comm_s"] >= 0 for r in per_rank)


def test_container_per_rank(setup, tmp_path):
    base, container, ids_file, single = setup
    for rank in range(2):
        shutil.copy(container, tmp_path / f"copy{rank}.moepack")
    out = str(tmp_path / "logits.safetensors")
    _torchrun(2, str(tmp_path / "copy{rank}.moepack"), ids_file, out, "--container-per-rank")
    assert torch.allclose(load_file(out)["logits"], single.logits, atol=1e-3 * single.logits.abs().max().item())


def test_a_dying_rank_makes_the_others_fail_fast(setup, tmp_path):
    """Two ranks started by hand (no torchrun agent to clean up): rank 1's copy is damaged in one of its own experts,
    so it stops with an error mid-prefill; rank 0 must exit with a one-line error, not wait forever."""
    base, container, ids_file, _ = setup
    good, bad = tmp_path / "copy0.moepack", tmp_path / "copy1.moepack"
    shutil.copy(container, good)
    data = bytearray(open(container, "rb").read())
    with Container(container) as c:
        victim = c.layer(2).experts[owned_range(len(c.layer(2).experts), 1, 2)[0]]
    data[victim.offset + 10] ^= 0x01
    bad.write_bytes(data)
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "moepack", "prefill", str(tmp_path / "copy{rank}.moepack"), "--token-ids",
             ids_file, "--expert-parallel", "--container-per-rank", "--experts", "all", "--dist-timeout", "20"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    start = time.time()
    outs = [p.communicate(timeout=120) for p in procs]
    assert time.time() - start < 100
    assert procs[1].returncode == 1 and "experts" in outs[1][1]
    assert procs[0].returncode == 1, outs[0]
    err = [line for line in outs[0][1].splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("moepack: error: rank 0"), outs[0][1]


def test_balanced_ranges_are_contiguous_complete_and_optimal():
    import itertools
    import random

    from moepack.runtime.distributed import balanced_ranges

    def optimum(loads, ranks):  # brute force over every way to cut the experts into `ranks` contiguous ranges
        n = len(loads)
        return min(max(sum(loads[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
                   for cuts in itertools.combinations(range(1, n), ranks - 1))

    rng = random.Random(0)
    for _ in range(500):
        n, ranks = rng.randint(1, 9), rng.randint(1, 5)
        loads = [rng.choice([0, 1, 2, 5, 40]) for _ in range(n)]
        got = balanced_ranges(loads, ranks)
        assert len(got) == ranks and [e for r in got for e in r] == list(range(n))
        if ranks <= n:
            assert all(len(r) for r in got)  # nobody idle while experts are left
            assert max(sum(loads[e] for e in r) for r in got) == optimum(loads, ranks)


def test_balanced_ownership_matches_and_evens_the_load(setup, two_ranks, tmp_path):
    base, container, ids_file, single = setup
    out = str(tmp_path / "balanced.safetensors")
    runs = {"contiguous": two_ranks[0]["ranks"],  # (the default)
            "balanced": _torchrun(2, container, ids_file, out, "--expert-ownership", "balanced")["ranks"]}
    for logits in (two_ranks[1], load_file(out)["logits"]):
        assert (logits - single.logits).abs().max() <= 1e-3 * single.logits.abs().max()
    with Container(container) as c:
        fixed = sum(r.length for r in c.global_regions) + sum(b.dense.length for b in c.layers)
        for rank in runs["balanced"]:  # each rank read exactly the experts it owned, layer by layer
            owned = sum(c.layers[s["layer"]].experts[e].length for s in rank["layers"]
                        for e in range(*s["owned_experts"]))
            assert rank["bytes_read"] == fixed + owned
        n_layers = len(c.layers)
    worst = {}
    for ownership, ranks in runs.items():
        for layer in range(n_layers):
            spans = [r["layers"][layer]["owned_experts"] for r in ranks]
            assert spans[0][0] == 0 and spans[0][1] == spans[1][0]  # contiguous, together every expert once
            worst[ownership, layer] = max(r["layers"][layer]["tokens_computed"] for r in ranks)
    assert all(worst["balanced", layer] <= worst["contiguous", layer] for layer in range(n_layers))
    assert sum(worst["balanced", layer] for layer in range(n_layers)) < \
        sum(worst["contiguous", layer] for layer in range(n_layers))


def test_an_empty_balanced_range_stays_empty(setup):
    """A layer's balanced range may be empty (a rank whose share is taken by one hot expert elsewhere): it must
    stay empty, not fall back to the contiguous range, whose experts another rank also computes."""
    from moepack.runtime.distributed import DistContext
    from moepack.runtime.engine import StreamingPrefill

    _, container, _, _ = setup
    with Container(container) as c:
        n_experts = len(c.layers[0].experts)
        engine = StreamingPrefill(c, PrefillOptions(expert_ownership="balanced"),
                                  dist=DistContext(rank=0, world_size=2, backend="gloo"))
        try:
            engine.reads._ownership[0] = range(0, 0)
            assert len(engine.reads.owned(0, n_experts)) == 0
            assert engine.reads.owned(1, n_experts) == owned_range(n_experts, 0, 2)  # not balanced yet: contiguous
            engine.reads._balance(2, [1] * n_experts)
            assert engine.reads.owned(2, n_experts) == range(0, n_experts // 2)
        finally:
            engine.close()


def _ranks_by_hand(files: list[str], ids_files: list[str], timeout_s: int = 20) -> list[tuple[int, str]]:
    """One rank per file, started by hand (no torchrun agent); each rank's exit status and stderr."""
    port = _free_port()
    procs = []
    for rank, (file, ids) in enumerate(zip(files, ids_files)):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(len(files)), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        env.pop("TORCH_CPP_LOG_LEVEL", None)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "moepack", "prefill", file, "--token-ids", ids, "--expert-parallel",
             "--experts", "all", "--dist-timeout", str(timeout_s)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    errs = [p.communicate(timeout=120)[1] for p in procs]
    return [(p.returncode, err) for p, err in zip(procs, errs)]


@pytest.mark.parametrize("differs", ["container", "prompt"])
def test_ranks_that_run_different_jobs_are_refused_in_one_line(setup, tmp_path, differs):
    """The combine adds each rank's partial sums: a rank holding another model (a stale or wrong copy with
    --container-per-rank) made wrong logits without an error, one of another shape aborted in gloo; another prompt
    (a rank started by hand with other arguments) the same. Every rank now refuses, naming what differs."""
    base, container, ids_file, _ = setup
    files, ids_files = [container, container], [ids_file, ids_file]
    if differs == "container":
        files[1] = str(tmp_path / "other.moepack")
        convert_checkpoint(str(base / "B"), files[1], policy="bf16", progress=False)  # same model, other bytes
    else:
        ids_files[1] = str(tmp_path / "ids1.json")
        Path(ids_files[1]).write_text(json.dumps([i % 61 for i in IDS][::-1]))
    for code, err in _ranks_by_hand(files, ids_files):
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 1 and len(lines) == 1, err
        assert lines[0].startswith(f"moepack: error: rank 1's {differs} is not rank 0's"), err


def test_a_launch_environment_outside_the_world_is_refused_at_once(monkeypatch):
    """RANK 3 of a WORLD_SIZE of 2 waited for a rendezvous that never counts it (for ever, under a long timeout)."""
    from moepack.format_spec.errors import MoepackError
    from moepack.runtime.distributed import init_from_env

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    for rank, world in (("3", "2"), ("2", "2"), ("-1", "2"), ("x", "2"), ("0", "0")):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", world)
        start = time.time()
        with pytest.raises(MoepackError, match="must be integers with 0 <= RANK < WORLD_SIZE"):
            init_from_env("cpu", 10)
        assert time.time() - start < 5


def test_a_rank_whose_peers_never_come_is_one_line(tmp_path, setup):
    """A rank whose master never starts: c10d logged an error, a retry warning and a C++ backtrace to stderr
    before the error; the CLI keeps torch's C++ log to fatal messages."""
    _, container, ids_file, _ = setup
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env.pop("TORCH_CPP_LOG_LEVEL", None)
    p = subprocess.run([sys.executable, "-m", "moepack", "prefill", container, "--token-ids", ids_file,
                        "--expert-parallel", "--dist-timeout", "1"], env=env, capture_output=True, text=True,
                       timeout=120)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 1 and len(lines) == 1 and "cannot join the process group" in lines[0], p.stderr
