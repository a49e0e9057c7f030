"""The project's Triton kernels compiled ahead of time for a GPU this machine need not have (default sm_90: H100,
H200), at every autotune config of theirs and every specialization the runtime can launch them with: what Triton's
interpreter (the CPU tests) never checks (tl.dot's block and dtype rules, layouts, ptxas, shared memory over the
chip's, register spills).

The kernels, their configs and their arguments are the runtime's own: each module's `_kernel(False)` (the autotuned
kernel a GPU runs: its configs and jitted function) and `kernel_arguments` (what its launch passes), called here with
CPU tensors of each case's shapes and dtypes; Triton's own binder then specialises them as a launch would (pointer
dtypes, pointers and integers divisible by 16, integers equal to 1 made constants, the do_not_specialize ones left
alone), and triton.compile builds each for the target through ptxas. The cases: the release's dimensions
(DeepSeek-V4-Flash: the indexer's 64 heads of 128, the experts' 2048 x 4096 and 4096 x 2048 FP4 matrices), every
operand dtype and constexpr flag the callers can give (bf16 / fp16 / FP8 scores, with and without counts; bf16 or
float32 inputs and float32 or bf16 outputs of the FP4 kernel), and the tests' small and odd sizes (integers
not divisible by 16, one key).

One line per kernel x config x case: compiled or the compiler's error (its first line), registers a thread and
bytes of register spills (cuobjdump's resource usage of the cubin Triton built: its stack frame), shared memory
against the target's limit, the dot's instruction (wgmma, mma.sync, none: no tensor cores). A failure is a compile
error, shared memory over the limit, registers the config's threads cannot have, or spills over --max-spill-bytes
(default 0). A case the kernel's module refuses (its operands check) is one line, "refused", not compiled.
Usage: python benchmarks/triton_aot.py [--arch 90] [--json] [--kernel fused_scores|stored_gemv] [--quick]
  --quick    the release's cases only (the tests' fast check)
  --json     every row in one JSON object on stdout (the lines go to stderr)
Exit status 1 on any failure, 2 where this Triton cannot compile ahead of time (no CUDA backend, TRITON_INTERPRET=1).
Needs Triton (its wheel carries ptxas), not a GPU. Compiles land in Triton's cache: a second run takes seconds."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import moepack  # noqa: F401  (before torch: moepack sets OpenMP's spin limit)
import torch

from moepack.backends import fused_scores, kernel_choice, stored_gemv

# the most shared memory a block may take (cudaDevAttrMaxSharedMemoryPerBlockOptin), by compute capability
SHARED_LIMITS = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448}
REGISTERS_PER_SM = 65536
THREADS_PER_WARP = 32


@dataclass(frozen=True)
class Case:
    """One launch the runtime can make: `make()` gives (out, arguments, constexprs) from the kernel module's own
    kernel_arguments, or None where the module refuses these operands (then nothing is compiled: a case at the
    edge of what the kernel takes, checking that the refusal is there)."""
    kernel: str
    name: str
    make: Callable[[], tuple]
    quick: bool = False


def _zeros(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype)


def _scores_case(name: str, queries: int, heads: int, head_dim: int, keys: int, dtype=torch.bfloat16,
                 counts: bool = False, fp8: bool = False, offset: int = 0, weights_dtype=None,
                 quick: bool = False) -> Case:
    """fused_scores' launch for q [queries, heads, head_dim], keys [keys, head_dim] and head weights of `dtype` (as
    indexer_scores gives them: all three in the weights' dtype; the weights `weights_dtype` where given), FP8's
    operands from them where `fp8`, per-query counts where `counts`; `offset` elements into each operand's storage
    (pointers not 16-byte aligned)."""
    def make():
        q = _zeros(queries * heads * head_dim + offset, dtype=dtype)[offset:].view(queries, heads, head_dim)
        k = _zeros(keys * head_dim + offset, dtype=dtype)[offset:].view(keys, head_dim)
        w = _zeros(queries * heads + offset, dtype=weights_dtype or dtype)[offset:].view(queries, heads)
        if not fused_scores.operands_apply(q, k, w, fp8):
            return None  # (fused_applies refuses these: no launch)
        scales = None
        if fp8:
            q, k, w, scales = fused_scores.fp8_operands(q, k, w)
        visible = torch.randint(0, keys + 1, (queries,)) if counts else None
        return fused_scores.kernel_arguments(q, k, w, visible, scales, interpret=False)
    shape = f"C={queries} heads={heads} D={head_dim} T={keys}"
    return Case("fused_scores", f"{name} ({shape})", make, quick)


def _gemv_case(name: str, n_out: int, n_in: int, pairs: int, x_dtype=torch.bfloat16, out_dtype=torch.float32,
               lead: int = 0, slot_pad: int = 0, quick: bool = False) -> Case:
    """stored_gemv's launch for a [n_out, n_in] FP4 matrix `lead` bytes into each slot (its scales after its codes),
    slots of its bytes and `slot_pad` more, `pairs` inputs of `x_dtype`, outputs of `out_dtype`."""
    def make():
        matrix = stored_gemv.Fp4Matrix(n_out, n_in, lead, lead + n_out * n_in // 2)
        stack = torch.zeros(3, matrix.scales_at + matrix.scales_bytes + slot_pad, dtype=torch.uint8)
        slots = torch.arange(pairs) % 3
        return stored_gemv.kernel_arguments(stack, slots, _zeros(pairs, n_in, dtype=x_dtype), matrix, out_dtype)
    shape = f"N={n_out} K={n_in} pairs={pairs} x {str(x_dtype)[6:]} out {str(out_dtype)[6:]}"
    return Case("stored_gemv", f"{name} ({shape})", make, quick)


def cases() -> list[Case]:
    """Every launch class the runtime and the kernels' public functions can make (module doc)."""
    release = dict(queries=1024, heads=64, head_dim=128, keys=32768)
    scores = [
        _scores_case("release bf16", **release, quick=True),  # indexer_scores' path (the prefill)
        _scores_case("release fp16", **release, dtype=torch.float16, quick=True),  # fp16 weights
        _scores_case("release bf16 counts", **release, counts=True, quick=True),
        _scores_case("release fp8", **release, fp8=True, quick=True),  # weighted_relu_head_sum_fp8
        _scores_case("release fp8 counts", **release, fp8=True, counts=True, quick=True),
        _scores_case("one key", 16384, 64, 128, 1),  # out's row stride 1: a constant
        _scores_case("odd sizes, unaligned", 37, 7, 16, 71, counts=True, offset=1),
        _scores_case("test sizes", 19, 16, 64, 45),
        _scores_case("test sizes", 37, 4, 32, 71),
        _scores_case("float32 head weights", 37, 4, 32, 71, dtype=torch.float16, counts=True,
                     weights_dtype=torch.float32),  # (weighted_relu_head_sum takes any)
        _scores_case("fp8 under the dot's 32 bytes", 21, 8, 16, 50, fp8=True),  # refused
        _scores_case("fp8 smallest head", 21, 8, 32, 50, fp8=True),
        _scores_case("bf16 over every tile's shared memory", 37, 4, 256, 71),  # refused
        _scores_case("fp8 widest head", 37, 4, 256, 71, fp8=True, counts=True),
        _scores_case("fp8 over every tile's shared memory", 37, 4, 512, 71, fp8=True),  # refused
        _scores_case("fp8 test sizes", 21, 8, 128, 50, fp8=True, counts=True),
    ]
    gemv = [
        _gemv_case(f"release {role}", n_out, n_in, pairs, x_dtype, out_dtype, lead=16 * 1024,
                   quick=x_dtype == torch.bfloat16 and out_dtype == torch.float32)
        for role, n_out, n_in in (("gate/up", 2048, 4096), ("down", 4096, 2048))
        for pairs in (48,) for x_dtype in (torch.bfloat16, torch.float32) for out_dtype in (torch.float32,
                                                                                              torch.bfloat16)]
    gemv += [_gemv_case("one output, odd offsets", 1, 64, 1, lead=3, slot_pad=7),
             _gemv_case("test sizes", 37, 96, 7, torch.float32, lead=16, slot_pad=7),
             _gemv_case("test sizes", 70, 160, 7, torch.bfloat16, torch.bfloat16, lead=16, slot_pad=7),
             _gemv_case("fewer inputs than a tile", 5, 32, 7, lead=16, slot_pad=7)]
    return scores + gemv


def _dot_instruction(ptx: str) -> str:
    return "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if re.search(r"\bmma\.sync", ptx) else "none"


def _cubin_usage(cubin: bytes) -> tuple[int, int]:
    """(registers a thread, stack frame bytes) of the kernel's cubin, as ptxas built it for Triton (cuobjdump's
    resource usage): a Triton kernel has no local arrays or calls, so a stack frame is its register spills."""
    from triton import knobs
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage = _run([knobs.nvidia.cuobjdump.path, "-res-usage", path])
    registers, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
    return int(registers), int(stack)


def _run(command: list[str]) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


class Compiler:
    """triton.compile for one target, fed as a launch feeds it: the runtime's binder specialises the arguments."""

    def __init__(self, arch: int):
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        self.triton, self.arch = triton, arch
        self.target = GPUTarget("cuda", arch, THREADS_PER_WARP)
        self.backend = make_backend(self.target)

    def compile(self, jitted, arguments: tuple, constexprs: dict, config) -> object:
        from triton.compiler import ASTSource
        from triton.runtime.jit import create_function_from_signature
        binder = create_function_from_signature(jitted.signature, jitted.params, self.backend)
        launch = dict(constexprs, **config.all_kwargs())  # as the autotuner's run of a config
        bound, specialization, options = binder(*arguments, **launch)
        options, signature, constants, attrs = jitted._pack_args(self.backend, launch, bound, specialization, options)
        return self.triton.compile(ASTSource(jitted, signature, constants, attrs), target=self.target,
                                   options=options.__dict__)


def config_name(config) -> str:
    tiles = " ".join(f"{k}={v}" for k, v in config.kwargs.items())
    return f"{tiles} warps={config.num_warps} stages={config.num_stages}"


def check(compiler: Compiler, case: Case, made: tuple, autotuned, config, shared_limit: int,
          max_spill_bytes: int) -> dict:
    """One row: the case (`made`: its arguments) compiled at one config, its resources and failure (None where it
    passed)."""
    row = {"kernel": case.kernel, "config": config_name(config), "case": case.name}
    began = time.perf_counter()
    try:
        _, arguments, constexprs = made
        compiled = compiler.compile(autotuned.fn, arguments, constexprs, config)
    except Exception as e:  # Triton's compile errors are of many types: each is this row's failure
        row.update(compiled=False, failure=_first_line(e))
        return row
    try:
        registers, spill_bytes = _cubin_usage(compiled.asm["cubin"])
    except (OSError, subprocess.CalledProcessError, AttributeError) as e:
        row.update(compiled=True, failure=f"compiled, but cuobjdump could not read its cubin: {_first_line(e)}")
        return row
    threads = config.num_warps * THREADS_PER_WARP
    shared = compiled.metadata.shared
    row.update(compiled=True, registers=registers, spill_bytes=spill_bytes, shared=shared,
               shared_limit=shared_limit, dot=_dot_instruction(compiled.asm["ptx"]),
               seconds=round(time.perf_counter() - began, 2))
    failures = []
    if shared > shared_limit:
        failures.append(f"shared memory {shared} B over the target's {shared_limit} B")
    if -(-registers // 8) * 8 * threads > REGISTERS_PER_SM:
        failures.append(f"{registers} registers x {threads} threads over the SM's {REGISTERS_PER_SM}")
    if spill_bytes > max_spill_bytes:
        failures.append(f"{spill_bytes} B of register spills, over --max-spill-bytes {max_spill_bytes}")
    row["failure"] = "; ".join(failures) or None
    return row


def _first_line(e: Exception) -> str:
    """The error's first line; a CompilationError's last (its first is the source position, then the source)."""
    lines = str(e).strip().splitlines() or [""]
    if type(e).__name__ == "CompilationError":
        return f"CompilationError {lines[0].strip()} {lines[-1].strip()[:200]}"
    return f"{type(e).__name__}: {lines[0][:200]}"


def line(row: dict) -> str:
    head = f"{row['kernel']:<13} {row['config']:<40} {row['case']:<70}"
    if row.get("refused"):
        return f"{head} refused by the kernel's module (not launched): ok"
    if "registers" not in row:
        return f"{head} FAILED {row['failure']}"
    verdict = "FAILED " + row["failure"] if row["failure"] else "ok"
    return (f"{head} regs {row['registers']:>3}  spills {row['spill_bytes']:>3} B  shared "
            f"{row['shared'] / 1024:6.1f}/{row['shared_limit'] / 1024:.0f} KiB  dot {row['dot']:<8} {verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="the target's compute capability (90: sm_90)")
    parser.add_argument("--shared-limit", type=int, help="bytes of shared memory a block may take (default: the "
                        f"arch's, {SHARED_LIMITS})")
    parser.add_argument("--max-spill-bytes", type=int, default=0, help="the stack frame (register spills) a kernel "
                        "may have")
    parser.add_argument("--kernel", choices=("fused_scores", "stored_gemv"), help="one kernel only")
    parser.add_argument("--quick", action="store_true", help="the release's cases only")
    parser.add_argument("--json", action="store_true", help="one JSON object of every row at the end")
    args = parser.parse_args(argv)
    shared_limit = args.shared_limit or SHARED_LIMITS.get(args.arch)
    if shared_limit is None:
        parser.error(f"--shared-limit is needed for arch {args.arch} (known: {sorted(SHARED_LIMITS)})")
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1: Triton's compiler refuses the interpreter's kernels; run without it",
              file=sys.stderr)
        return 2
    modules = kernel_choice.triton_modules()
    if modules is None:
        print("Triton is not installed", file=sys.stderr)
        return 2
    try:
        compiler = Compiler(args.arch)
    except Exception as e:
        print(f"no ahead-of-time compile with this Triton ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    kernels = {"fused_scores": fused_scores._kernel(False), "stored_gemv": stored_gemv._kernel(False)}
    rows = []
    lines = sys.stderr if args.json else sys.stdout  # (with --json, stdout is the JSON alone)
    print(f"triton {modules[0].__version__}, target sm_{args.arch}", file=lines, flush=True)
    for case in cases():
        if (args.kernel and case.kernel != args.kernel) or (args.quick and not case.quick):
            continue
        made = case.make()
        if made is None:  # (refused by the kernel's module: one row, no config compiled)
            rows.append({"kernel": case.kernel, "config": "-", "case": case.name, "compiled": False,
                         "refused": True, "failure": None})
            print(line(rows[-1]), file=lines, flush=True)
            continue
        for config in kernels[case.kernel].configs:
            rows.append(check(compiler, case, made, kernels[case.kernel], config, shared_limit, args.max_spill_bytes))
            print(line(rows[-1]), file=lines, flush=True)
    failed = [row for row in rows if row["failure"]]
    print(f"{len(rows) - len(failed)} of {len(rows)} passed", file=lines, flush=True)
    if args.json:
        print(json.dumps({"triton": modules[0].__version__, "arch": args.arch, "rows": rows}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
