"""Benchmark helpers: run a command inside a memory cgroup (page cache included), and count what it read from disk.

`memory_cgroup(limit)` makes a cgroup (the v1 memory controller where mounted, else v2's memory.max) and removes it
afterwards; `run_capped(group, argv)` runs argv inside it; `disk_read_bytes()` sums the bytes read by every block
device (/proc/diskstats), so the difference around a run is what it read from disk. Root only; without cgroups the
context manager yields None and says why in `skip_reason`.
"""

from __future__ import annotations

import contextlib
import os
import subprocess

skip_reason = ""


@contextlib.contextmanager
def memory_cgroup(limit: int, name: str = "moepack-bench"):
    """A cgroup whose tasks may use at most `limit` bytes (their page cache included); yields its cgroup.procs
    path, or None (see skip_reason)."""
    global skip_reason
    name = f"{name}-{os.getpid()}"
    if os.path.isdir("/sys/fs/cgroup/memory"):
        group, limit_file = os.path.join("/sys/fs/cgroup/memory", name), "memory.limit_in_bytes"
    elif os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        group, limit_file = os.path.join("/sys/fs/cgroup", name), "memory.max"
        _enable_v2_memory("/sys/fs/cgroup")
    else:
        skip_reason = "no memory cgroup on this machine"
        yield None
        return
    try:
        os.mkdir(group)
        with open(os.path.join(group, limit_file), "w") as f:
            f.write(str(limit))
    except OSError as e:
        skip_reason = f"cannot make a memory cgroup ({e.strerror}): run as root"
        yield None
        return
    try:
        yield os.path.join(group, "cgroup.procs")
    finally:
        try:
            os.rmdir(group)
        except OSError:
            pass


def _enable_v2_memory(root: str) -> None:
    """Hand v2's memory controller down to the root's children where nothing did (a machine without systemd);
    a failure shows when the limit is written."""
    try:
        with open(os.path.join(root, "cgroup.subtree_control")) as f:
            if "memory" in f.read().split():
                return
        with open(os.path.join(root, "cgroup.subtree_control"), "w") as f:
            f.write("+memory")
    except OSError:
        pass


def run_capped(procs: str, argv: list[str], timeout: float | None = None) -> subprocess.CompletedProcess:
    """argv run inside the cgroup whose cgroup.procs is `procs` (the shell joins it, then execs argv)."""
    script = f"echo $$ > '{procs}' && exec " + " ".join("'" + a.replace("'", "'\\''") + "'" for a in argv)
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=timeout)


def peak_bytes(procs: str) -> int | None:
    """The most memory the cgroup's tasks held at once, page cache included (v1 memory.max_usage_in_bytes, v2
    memory.peak), or None where the kernel does not keep it."""
    group = os.path.dirname(procs)
    for name in ("memory.max_usage_in_bytes", "memory.peak"):
        try:
            with open(os.path.join(group, name)) as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return None


def disk_read_bytes() -> int:
    """Bytes read so far by the machine's whole block devices (partitions and loop/ram devices left out)."""
    total = 0
    with open("/proc/diskstats") as f:
        for line in f:
            fields = line.split()
            name = fields[2]
            if name.startswith(("loop", "ram", "zram")) or os.path.exists(f"/sys/class/block/{name}/partition"):
                continue
            total += int(fields[5]) * 512  # sectors read
    return total


def failure(done: subprocess.CompletedProcess) -> str:
    """One line on why a run failed: killed for memory inside the cgroup, else its last line of stderr."""
    if done.returncode in (-9, 137):
        return "killed (out of memory in the cgroup)"
    return (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
