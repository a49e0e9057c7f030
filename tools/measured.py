"""What `moepack plan` takes from the measurements `moepack bench` keeps (tools/bench.py writes them into the cache of
runtime/tuning.py): kept apart from tools/bench.py, which loads torch, so that the plan, a calculator, starts in a
fraction of a second."""

from __future__ import annotations

import os
import warnings

from moepack.format_spec.errors import error_reason
from moepack.format_spec.untrusted import finite_float
from moepack.runtime.tuning import cached, file_key



def measured_for_plan(path: str | None = None, device: str | None = None, storage: str | None = None,
                      dims: tuple[int, int] | None = None, expert_dtype: str = "float32") -> dict:
    """The measurements `plan` defaults to: {"ssd": (GB/s, source), "compute": (result, source), "memory": (GB/s,
    source), "pcie": (GB/s, source)}, each None when not measured. The SSD rate is this file's best io cell when
    it was measured, else the latest io measurement on this machine; the compute curve is the device's run (cuda
    before cpu when not given) that matches best: compute dtype first, then the expert shape, then the storage
    type, the latest among equals."""
    out = {"ssd": None, "compute": None, "memory": None, "pcie": None}
    try:
        io = cached("io")
        entry = io.get(file_key(path)) if path and os.path.exists(path) else None
        if isinstance(entry, dict) and entry.get("best"):
            out["ssd"] = (_rate(entry["best"]["gbps"]), f"measured by bench io on this file, {entry['measured_at']}")
        elif io:
            latest = max((e for e in io.values() if isinstance(e, dict) and e.get("best")),
                         key=lambda e: e.get("measured_at", ""), default=None)
            if latest:
                out["ssd"] = (_rate(latest["best"]["gbps"]),
                              f"measured by bench io on {os.path.basename(latest['path'])}, {latest['measured_at']}")
        runs = [r for r in cached("compute").values() if isinstance(r, dict) and r.get("points")]
        order = [device] if device else ["cuda", "cpu"]
        for dev in order:
            mine = [r for r in runs if r.get("device", "").split(":")[0] == dev]
            if not mine:
                continue
            def score(r):
                return (4 * (r.get("expert_dtype") == expert_dtype)
                        + 2 * (dims is not None and (r.get("hidden"), r.get("intermediate")) == tuple(dims))
                        + (storage is not None and r.get("storage") == storage), r.get("measured_at", ""))

            pick = max(mine, key=score)
            for point in pick["points"]:
                _rate(point["tokens_per_expert"]), _rate(point["gflops"])
            out["compute"] = (pick, f"measured by bench compute on {pick['device']} ({pick['storage']} "
                                    f"{pick['hidden']}x{pick['intermediate']}, {pick['expert_dtype']}), "
                                    f"{pick['measured_at']}")
            break
        mem = cached("memory").get("latest")
        if isinstance(mem, dict) and mem.get("host_copy_gbps"):
            out["memory"] = (_rate(mem["host_copy_gbps"]), f"measured by bench memory, {mem['measured_at']}")
            if mem.get("cuda"):
                out["pcie"] = (_rate(mem["cuda"]["h2d_pinned_gbps"]), f"measured by bench memory (pinned host->device, "
                                                               f"{mem['cuda']['device']}), {mem['measured_at']}")
    except Exception as e:  # noqa: BLE001 - a damaged cache means "not measured"
        warnings.warn(f"bench cache not used ({error_reason(e)})", RuntimeWarning, stacklevel=2)
        out = {"ssd": None, "compute": None, "memory": None, "pcie": None}  # nothing from a cache found damaged
    return out


def _rate(value) -> float:
    """A measured rate or count from the cache: a finite positive number (a hand-edited or damaged cache can hold
    anything; a zero or a string would reach the plan's divisions)."""
    return finite_float(value, "a measured rate", lo=0, lo_open=True)
