"""The memory a process may use (runtime/io.py available_memory_bytes): MemAvailable, the cgroup limits of its
cgroup and every ancestor (v1 memory.limit_in_bytes, v2 memory.max) and RLIMIT_AS; `--io auto` reads a container
that does not fit in that with O_DIRECT.

The parsing is tested on made-up /proc and cgroup trees (v1, v2, hybrid, nested, "max", unlimited); the real thing
in a real cgroup where the machine lets a test make one (root, a v1 memory controller or cgroup2 with the memory
controller enabled for children), in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from moepack.runtime.io import cgroup_memory_limit, choose_io_mode

GIB = 1 << 30


def _fake(tmp_path, cgroup_lines: list[str], mounts: list[tuple[str, str, str]], files: dict[str, str]):
    """A /proc/self (cgroup, mountinfo) and cgroup trees under tmp_path; mounts: (fs type, options, mount dir)."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text("\n".join(cgroup_lines) + "\n")
    info = [f"{30 + i} 23 0:{40 + i} / {tmp_path / d} rw,relatime - {fs} {fs} rw,{opts}"
            for i, (fs, opts, d) in enumerate(mounts)]
    (proc / "mountinfo").write_text("\n".join(["22 1 8:1 / / rw - ext4 /dev/vda rw", *info]) + "\n")
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return str(proc)


def test_v1_limit_of_the_cgroup_and_its_parents(tmp_path):
    proc = _fake(tmp_path, ["4:memory:/jobs/job7", "1:cpu:/", "0::/"],
                 [("cgroup", "memory", "cg/memory"), ("cgroup", "cpu", "cg/cpu")],
                 {"cg/memory/memory.limit_in_bytes": "9223372036854771712",
                  "cg/memory/jobs/memory.limit_in_bytes": str(3 * GIB),
                  "cg/memory/jobs/job7/memory.limit_in_bytes": "9223372036854771712"})
    assert cgroup_memory_limit(proc) == 3 * GIB  # the child is unlimited, its parent is not


def test_v2_memory_max_nested_and_max(tmp_path):
    proc = _fake(tmp_path, ["0::/user.slice/app"], [("cgroup2", "nsdelegate", "cg2")],
                 {"cg2/user.slice/memory.max": str(5 * GIB), "cg2/user.slice/app/memory.max": str(2 * GIB)})
    assert cgroup_memory_limit(proc) == 2 * GIB
    (tmp_path / "cg2/user.slice/app/memory.max").write_text("max\n")
    assert cgroup_memory_limit(proc) == 5 * GIB
    (tmp_path / "cg2/user.slice/memory.max").write_text("max\n")
    assert cgroup_memory_limit(proc) is None


def test_hybrid_takes_the_tightest_and_tolerates_junk(tmp_path):
    proc = _fake(tmp_path, ["4:memory,hugetlb:/a", "0::/b", "garbage line"],
                 [("cgroup", "memory,hugetlb", "cg/memory"), ("cgroup2", "", "cg/unified")],
                 {"cg/memory/a/memory.limit_in_bytes": str(7 * GIB), "cg/unified/b/memory.max": "not a number"})
    assert cgroup_memory_limit(proc) == 7 * GIB
    assert cgroup_memory_limit(str(tmp_path / "nowhere")) is None


def test_no_cgroup_mounts(tmp_path):
    proc = _fake(tmp_path, ["4:memory:/a"], [], {})
    assert cgroup_memory_limit(proc) is None


_CHILD = textwrap.dedent("""
    import json
    from moepack.runtime.io import available_memory_bytes, cgroup_memory_limit, choose_io_mode
    print(json.dumps([available_memory_bytes(), cgroup_memory_limit(), choose_io_mode("auto", 2 << 30)]))
""")


def _cgroup_dirs():
    """(kind, directory to make child cgroups in, limit file name) for each memory cgroup version this machine
    lets a test use."""
    found = []
    if os.path.isdir("/sys/fs/cgroup/memory") and os.access("/sys/fs/cgroup/memory", os.W_OK):
        found.append(("v1", "/sys/fs/cgroup/memory", "memory.limit_in_bytes"))
    for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        controllers = os.path.join(root, "cgroup.subtree_control")
        try:
            with open(controllers) as f:
                enabled = "memory" in f.read().split()
        except OSError:
            continue
        if enabled and os.access(root, os.W_OK):
            found.append(("v2", root, "memory.max"))
    return found


@pytest.mark.parametrize("kind,root,limit_file", _cgroup_dirs() or [pytest.param(None, None, None, marks=pytest.mark.skip(
    reason="no writable memory cgroup here (needs root and a v1 memory controller or cgroup2 with memory)"))])
def test_in_a_real_cgroup_auto_io_goes_direct(kind, root, limit_file):
    """A child in a cgroup capped at 1 GiB (its parent cgroup, the child's own unlimited) sees at most 1 GiB and
    reads a 2 GiB container with O_DIRECT; outside it, the same machine picks mmap for it if RAM allows."""
    parent = os.path.join(root, f"moepack-test-{os.getpid()}")
    child = os.path.join(parent, "inner")
    os.mkdir(parent)
    try:
        with open(os.path.join(parent, limit_file), "w") as f:
            f.write(str(GIB))
        if kind == "v2":
            with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                f.write("+memory")
        os.mkdir(child)
        try:
            script = f"echo $$ > {os.path.join(child, 'cgroup.procs')} && exec {sys.executable} -c '{_CHILD}'"
            out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
            available, limit, mode = __import__("json").loads(out.stdout)
            assert limit == GIB and 0 < available <= GIB and mode == "direct"
        finally:
            os.rmdir(child)
    finally:
        os.rmdir(parent)
    if choose_io_mode("auto", 2 << 30) != "mmap":
        pytest.skip("this machine itself has under 3 GiB available: the contrast outside the cgroup is not shown")


def test_address_space_limit_counts():
    """RLIMIT_AS (ulimit -v) bounds what the process may use: a child limited to 12 GiB sees at most that."""
    import resource

    limit = 12 * GIB
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    assert out.returncode == 0, out.stderr
    available = __import__("json").loads(out.stdout)[0]
    assert 0 < available <= limit


def test_cpu_quota_of_the_cgroup_and_its_parents_v1_and_v2(tmp_path):
    """A container's CPU quota (docker --cpus, a Kubernetes limit) is what its threads may keep busy, however many
    cores the machine has: v2 cpu.max and v1 cfs quota / period, the tightest of the cgroup and its parents."""
    from moepack.runtime.io import cgroup_cpu_limit

    for kind in ("v2", "v1", "none"):
        (tmp_path / kind).mkdir()
    proc = _fake(tmp_path / "v2", ["0::/pod/app"], [("cgroup2", "nsdelegate", "cg2")],
                 {"cg2/pod/cpu.max": "250000 100000", "cg2/pod/app/cpu.max": "max 100000"})
    assert cgroup_cpu_limit(proc) == 2.5
    (tmp_path / "v2/cg2/pod/app/cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(proc) == 1.5
    proc = _fake(tmp_path / "v1", ["3:cpu,cpuacct:/docker/abc", "4:memory:/docker/abc"],
                 [("cgroup", "cpu,cpuacct", "cg/cpu"), ("cgroup", "memory", "cg/memory")],
                 {"cg/cpu/docker/abc/cpu.cfs_quota_us": "-1", "cg/cpu/docker/abc/cpu.cfs_period_us": "100000",
                  "cg/cpu/docker/cpu.cfs_quota_us": "300000", "cg/cpu/docker/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_limit(proc) == 3.0
    proc = _fake(tmp_path / "none", ["0::/a"], [("cgroup2", "", "cg2")], {"cg2/a/cpu.max": "max 100000"})
    assert cgroup_cpu_limit(proc) is None and cgroup_cpu_limit(str(tmp_path / "nowhere")) is None


def test_a_model_command_runs_no_more_threads_than_the_cpus_it_may_use(monkeypatch, tmp_path_factory):
    """Under a CPU quota below torch's count of the cores, a command's default threads are the quota's CPUs
    (rounded up); a --threads given is kept."""
    import torch
    from click.testing import CliRunner
    from containers import tiny_keep_container

    from moepack.cli.main import cli
    from moepack.runtime import io

    tiny = tiny_keep_container(tmp_path_factory)
    before = torch.get_num_threads()
    monkeypatch.setattr(io, "cgroup_cpu_limit", lambda proc="/proc/self": 0.5)
    assert io.usable_cpus() == 1
    try:
        torch.set_num_threads(2)
        r = CliRunner().invoke(cli, ["prefill", tiny, "-p", "hi", "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["threads"] == 1 == torch.get_num_threads()
        r = CliRunner().invoke(cli, ["prefill", tiny, "-p", "hi", "--json", "--threads", "2"])
        assert r.exit_code == 0 and json.loads(r.stdout)["threads"] == 2, r.output
    finally:
        torch.set_num_threads(before)
