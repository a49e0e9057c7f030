"""Expert-parallel prefill over torch.distributed (gloo on CPU, NCCL on CUDA), launched with torchrun.

Every rank holds all N tokens and runs the (replicated) dense part of each layer: attention, router, shared
expert. Each layer's routed experts are split into contiguous ID ranges, one per rank, so a rank reads only its
own experts (still one sequential read per layer) and the ranks together read the model once. The router's
choice is identical on every rank (same inputs, same code), so dispatch needs no communication: each rank runs
its experts on the tokens routed to them, and one all-reduce per layer combines the partial sums (the combine).
A rank that dies or stalls makes the others fail with a one-line error once the collective times out.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch

from moepack.format_spec.errors import MoepackError, error_reason


@dataclass
class DistContext:
    rank: int
    world_size: int
    backend: str
    comm_seconds: float = 0.0

    def owned(self, n_experts: int) -> range:
        """This rank's contiguous expert range (sizes differ by at most one)."""
        return owned_range(n_experts, self.rank, self.world_size)

    def all_reduce_sum(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        import torch.distributed as dist

        start = time.perf_counter()
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        except Exception as e:  # gloo/NCCL raise RuntimeError subclasses with multi-line text
            raise MoepackError(f"rank {self.rank}: {what} failed, a peer rank is gone or stalled "
                               f"({error_reason(e)[:200]})") from None
        self.comm_seconds += time.perf_counter() - start
        return tensor

    def gather(self, obj) -> list | None:
        """Every rank's `obj` on rank 0 (None elsewhere)."""
        import torch.distributed as dist

        out = [None] * self.world_size if self.rank == 0 else None
        try:
            dist.gather_object(obj, out, dst=0)
        except Exception as e:
            raise MoepackError(f"rank {self.rank}: gathering stats failed ({error_reason(e)[:200]})") from None
        return out

    def check_same_job(self, job: dict[str, object]) -> None:
        """Refuse, on every rank, a job whose ranks disagree on `job` (what each rank runs: its container, prompt,
        arithmetic). The combine adds the ranks' partial sums: a rank holding another copy of the model, or another
        prompt, would make wrong logits without an error, or collectives of other shapes that abort the process."""
        import torch.distributed as dist

        jobs = [None] * self.world_size
        try:
            dist.all_gather_object(jobs, job)
        except Exception as e:
            raise MoepackError(f"rank {self.rank}: comparing the ranks' jobs failed, a peer rank is gone or stalled "
                               f"({error_reason(e)[:200]})") from None
        for rank, theirs in enumerate(jobs):
            for what in job:
                if theirs.get(what) != jobs[0].get(what):
                    raise MoepackError(f"rank {rank}'s {what} is not rank 0's ({theirs.get(what)} vs "
                                       f"{jobs[0].get(what)}): every rank must prefill the same prompt over a copy of "
                                       f"the same container, with the same options")

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def owned_range(n_experts: int, rank: int, world_size: int) -> range:
    base, extra = divmod(n_experts, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def balanced_ranges(loads: list[int], world_size: int) -> list[range]:
    """Split experts 0..E-1 into `world_size` contiguous ranges (each rank's read stays one sequential run) so the
    largest range's summed load is as small as it can be: the bottleneck is found by binary search, and each rank
    then takes experts greedily up to it. Ranks may get empty ranges when there are more ranks than experts."""
    if world_size < 1:
        raise MoepackError("world size must be at least 1")

    def parts_needed(limit: int) -> int:
        parts, current = 1, 0
        for load in loads:
            if current + load > limit:
                parts, current = parts + 1, 0
            current += load
        return parts

    low, high = max(loads, default=0), sum(loads)
    while low < high:
        mid = (low + high) // 2
        if parts_needed(mid) <= world_size:
            high = mid
        else:
            low = mid + 1
    ranges, start, current = [], 0, 0
    for e, load in enumerate(loads):
        # close the range when this expert would pass the bottleneck, or when the experts left are just enough
        # to give every remaining rank one
        left_ranks = world_size - len(ranges) - 1
        if e > start and left_ranks > 0 and (current + load > low or len(loads) - e <= left_ranks):
            ranges.append(range(start, e))
            start, current = e, 0
        current += load
    ranges.append(range(start, len(loads)))
    ranges += [range(len(loads), len(loads))] * (world_size - len(ranges))
    return ranges


def init_from_env(device: str, timeout_s: float) -> DistContext:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment)."""
    import torch.distributed as dist

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise MoepackError("--expert-parallel needs a launcher: run it under "
                           "`torchrun --nproc-per-node P -m moepack prefill ... --expert-parallel`")
    rank, world_size = os.environ["RANK"].strip(), os.environ["WORLD_SIZE"].strip()
    if not (rank.isdigit() and world_size.isdigit() and int(rank) < int(world_size)):
        # a rank outside the world would wait for a rendezvous that never counts it, then fail after the timeout
        raise MoepackError(f"--expert-parallel: the launcher's RANK={rank!r} and WORLD_SIZE={world_size!r} must be "
                           f"integers with 0 <= RANK < WORLD_SIZE")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    try:
        if backend == "nccl":  # NCCL works on the current device: "cuda" is this rank's own (LOCAL_RANK)
            import torch

            index = torch.device(device).index
            torch.cuda.set_device(index if index is not None else int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as e:
        raise MoepackError(f"cannot join the process group ({error_reason(e)[:200]})") from None
    return DistContext(dist.get_rank(), dist.get_world_size(), backend)
