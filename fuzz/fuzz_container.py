#!/usr/bin/env python3
"""Long-running fuzz harness for what moepack reads: its own containers and KV directories, and the checkpoint
directories and GGUF files `moepack convert` reads from outside (docs/fuzzing.md).

    python3 fuzz/fuzz_container.py --seconds 600 --corpus DIR --crashes DIR [--target TARGET[,TARGET...]|all]
                                   [--seed N] [--runs N] [--engine mutation|atheris] [--json]
    python3 fuzz/fuzz_container.py --replay CRASH_FILE...      # rerun saved inputs here, with tracebacks
    python3 fuzz/fuzz_container.py --unpack CRASH_FILE DIR     # write a saved input out as real files

Engines. `mutation` (default, no extra dependency): the parent process mutates inputs drawn from the corpus
(mutations.py) and a worker subprocess runs each through the user-facing operations (targets.py), under an
address-space cap and a per-input timeout, so a crash, hang or memory blow-up is caught and the worker restarted.
Inputs whose outcome shows behaviour not seen before join the corpus. `atheris` (pip install atheris): libFuzzer's
coverage guidance over moepack.format_spec, moepack.families and moepack.packer, in-process, with the same
structure-aware mutations offered as a custom mutator beside libFuzzer's own.

Every distinct failure -- deduplicated by (exception type, innermost moepack frame) -- is saved once in the
crashes directory (the input, plus a .txt with the traceback), the smallest input seen for it kept. Exit status 1
when any failure was found.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from corpus import EXTENSIONS, REPO, TARGETS, ensure_seeds, load_corpus  # noqa: E402

# Per target, seeds included; beyond either cap a new entry replaces a random non-seed one.
MAX_CORPUS_ENTRIES = 400
MAX_CORPUS_BYTES = 512 << 20
WORKER_START_SECONDS = 180  # importing torch on a loaded 2-core machine
_FRAME_LINE = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


# --- the worker -------------------------------------------------------------------------------------------------
def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def worker_main(memory_mb: int, timeout: float, scratch: str) -> None:
    """Serve requests from stdin, one JSON line each ({"target", "path"}), answering one JSON outcome line each."""
    import faulthandler

    os.environ["HF_HUB_OFFLINE"] = "1"  # a source input is a local folder or file: nothing may be fetched
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything the code under test prints goes to the worker log, not into the protocol
    import torch

    torch.set_num_threads(1)
    import targets

    dump = open(os.path.join(scratch, "worker-traceback.txt"), "w+b", buffering=0)
    faulthandler.enable(dump)  # a segfault or abort leaves the stack here for the parent
    limit = _vm_size() + (memory_mb << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    protocol.write('{"ready": true}\n')
    for line in sys.stdin:
        request = json.loads(line)
        dump.seek(0)
        dump.truncate()
        faulthandler.dump_traceback_later(timeout, exit=True, file=dump)  # a hang: stack dumped, worker exits
        outcome = targets.run_one(request["target"], request["path"])
        faulthandler.cancel_dump_traceback_later()
        protocol.write(json.dumps(outcome) + "\n")


class Worker:
    """The parent's handle on one worker subprocess; restarts it after a crash or hang."""

    def __init__(self, scratch: str, timeout: float, memory_mb: int):
        self.scratch, self.timeout, self.memory_mb = scratch, timeout, memory_mb
        self.proc: subprocess.Popen | None = None
        self._buffer = b""
        self.restarts = 0

    def start(self) -> None:
        log = open(os.path.join(self.scratch, "worker.log"), "ab")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", "--scratch", self.scratch,
             "--timeout", str(self.timeout), "--memory-mb", str(self.memory_mb)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, start_new_session=True)
        log.close()
        self._buffer = b""
        if self._read_line(time.monotonic() + WORKER_START_SECONDS) is None:
            raise RuntimeError(f"fuzz worker did not start (see {self.scratch}/worker.log)")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def _read_line(self, deadline: float) -> bytes | None:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def run(self, target: str, path: str) -> dict:
        if self.proc is None:
            self.start()
        try:
            self.proc.stdin.write(json.dumps({"target": target, "path": path}).encode() + b"\n")
            self.proc.stdin.flush()
            line = self._read_line(time.monotonic() + self.timeout + 30)
        except BrokenPipeError:
            line = None
        if line is not None:
            return json.loads(line)
        outcome = self._death_outcome()
        self.restarts += 1
        return outcome

    def _death_outcome(self) -> dict:
        """The worker hung or died: name how, and where (from faulthandler's dump)."""
        proc, self.proc = self.proc, None
        try:
            code = proc.wait(timeout=10)  # it died (or faulthandler ended a hang): let it be reaped
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
        with open(os.path.join(self.scratch, "worker-traceback.txt"), "rb") as f:
            dump = f.read().decode("utf-8", "replace")
        if "Timeout (" in dump or code == -signal.SIGKILL:
            kind = "hang"
        elif code < 0:
            kind = f"crash ({signal.Signals(-code).name})"
        else:
            kind = f"worker died (exit status {code})"
        from targets import innermost_project_frame

        # faulthandler lists the current thread's frames most recent first (after a "Fatal Python error" paragraph
        # for a crash); innermost_project_frame wants them outermost first.
        stack = next((block for block in dump.split("\n\n") if 'File "' in block), "")
        frames = [(m.group(1), int(m.group(2)), m.group(3)) for m in _FRAME_LINE.finditer(stack)]
        frame = innermost_project_frame(list(reversed(frames)))
        return {"status": "failure", "stage": "?", "kind": kind, "frame": frame, "key": f"{kind} @ {frame}",
                "message": kind, "traceback": dump[-8000:]}


# --- the mutation engine ----------------------------------------------------------------------------------------
class Campaign:
    def __init__(self, args, targets_run: list[str]):
        self.args = args
        self.targets = targets_run
        self.corpus: dict[str, list[tuple[str, bytes]]] = {t: load_corpus(args.corpus, t) for t in targets_run}
        for t in targets_run:
            if not self.corpus[t]:
                raise SystemExit(f"no {t} inputs in {args.corpus}/{t}")
        self.seed_count = {t: len(self.corpus[t]) for t in targets_run}
        self.stats = {t: {"inputs": 0, "seconds": 0.0, "ok": 0, "error": 0, "failure": 0, "corpus_added": 0,
                          "by_stage": {}} for t in targets_run}
        self.signatures: set[str] = set()
        self.failures: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.inputs = 0
        self.last_progress = self.started

    def _done(self) -> bool:
        if self.args.runs is not None and self.inputs >= self.args.runs:
            return True
        return time.monotonic() - self.started >= self.args.seconds

    def run(self) -> dict:
        threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(self.args.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return self.report()

    def _loop(self, number: int) -> None:
        from mutations import Mutator
        from targets import materialize

        rng = random.Random(self.args.seed * 1000 + number)
        mutator = Mutator(rng, lambda target: rng.choice(self.corpus[target])[1])
        scratch = tempfile.mkdtemp(prefix=f"moepack-fuzz-{os.getpid()}-{number}-", dir=_scratch_root())
        worker = Worker(scratch, self.args.timeout, self.args.memory_mb)
        pending_seeds = [(t, data) for t in self.targets for _, data in self.corpus[t]] if number == 0 else []
        turn = number
        try:
            while True:
                with self.lock:
                    if self._done():
                        return
                    self.inputs += 1
                if pending_seeds:  # every seed once, unmutated: a seed that fails is a finding too
                    target, data = pending_seeds.pop()
                else:
                    target = self.targets[turn % len(self.targets)]
                    turn += 1
                    data = mutator.mutate(target, self._pick(target, rng))
                t0 = time.monotonic()
                path = materialize(target, data, scratch)
                outcome = worker.run(target, path)
                self._record(target, data, outcome, time.monotonic() - t0, scratch, rng)
        finally:
            worker.stop()
            shutil.rmtree(scratch, ignore_errors=True)

    def _pick(self, target: str, rng) -> bytes:
        """Half the time a seed: inputs grown from valid files keep reaching the deep checks, however many broken
        but novel inputs the corpus has collected."""
        entries = self.corpus[target]
        end = self.seed_count[target] if rng.random() < 0.5 else len(entries)
        return entries[rng.randrange(end)][1]

    def _record(self, target: str, data: bytes, outcome: dict, seconds: float, scratch: str, rng) -> None:
        from targets import behaviour_signature

        with self.lock:
            s = self.stats[target]
            s["inputs"] += 1
            s["seconds"] += seconds
            s[outcome["status"]] += 1
            s["by_stage"][outcome["stage"]] = s["by_stage"].get(outcome["stage"], 0) + 1
            if outcome["status"] == "failure":
                self._save_failure(target, data, outcome)
            else:
                signature = behaviour_signature(target, outcome, scratch)
                if signature not in self.signatures:
                    self.signatures.add(signature)
                    self._add_to_corpus(target, data, rng)
            now = time.monotonic()
            if not self.args.quiet and now - self.last_progress >= 30:
                self.last_progress = now
                done = {t: v["inputs"] for t, v in self.stats.items()}
                print(f"[fuzz {now - self.started:7.0f}s] inputs {done}, behaviours {len(self.signatures)}, "
                      f"failures {len(self.failures)}", file=sys.stderr, flush=True)

    def _add_to_corpus(self, target: str, data: bytes, rng) -> None:
        entries = self.corpus[target]
        name = f"auto-{hashlib.sha1(data).hexdigest()[:16]}{EXTENSIONS[target]}"
        full = len(entries) >= MAX_CORPUS_ENTRIES or sum(len(d) for _, d in entries) + len(data) > MAX_CORPUS_BYTES
        if not full:
            entries.append((name, data))
        elif len(entries) > self.seed_count[target]:
            entries[rng.randrange(self.seed_count[target], len(entries))] = (name, data)
        else:
            return
        self.stats[target]["corpus_added"] += 1
        if self.args.save_corpus:
            (Path(self.args.corpus) / target / name).write_bytes(data)

    def _save_failure(self, target: str, data: bytes, outcome: dict) -> None:
        key = f"{target}: {outcome['key']}"
        known = self.failures.get(key)
        if known is not None:
            known["count"] += 1
            if len(data) >= known["bytes"]:
                return
            for old in (known["reproducer"], known["reproducer"] + ".txt"):
                Path(old).unlink(missing_ok=True)
        slug = re.sub(r"[^A-Za-z0-9]+", "-", outcome["key"]).strip("-")[:70]
        path = Path(self.args.crashes) / f"{target}-{slug}-{hashlib.sha1(data).hexdigest()[:10]}{EXTENSIONS[target]}"
        path.write_bytes(data)
        path.with_name(path.name + ".txt").write_text(
            f"{key}\nstage: {outcome['stage']}\n{outcome['message']}\n\n{outcome.get('traceback', '')}",
            errors="backslashreplace")  # messages may quote the input's lone surrogates
        entry = {"target": target, "key": outcome["key"], "kind": outcome["kind"], "frame": outcome["frame"],
                 "stage": outcome["stage"], "message": outcome["message"], "count": 1, "bytes": len(data),
                 "reproducer": str(path)}
        if known is not None:
            entry["count"] = known["count"]
        self.failures[key] = entry
        if not self.args.quiet:
            print(f"[fuzz] failure: {key}: {outcome['message'][:200]}", file=sys.stderr, flush=True)

    def report(self) -> dict:
        elapsed = time.monotonic() - self.started
        per_target = {}
        for t, s in self.stats.items():
            per_target[t] = {**s, "seconds": round(s["seconds"], 1),
                             "inputs_per_second": round(s["inputs"] / max(s["seconds"], 1e-9), 1),
                             "corpus": len(self.corpus[t])}
        return {"engine": "mutation", "seed": self.args.seed, "workers": self.args.workers,
                "wall_seconds": round(elapsed, 1), "inputs": sum(s["inputs"] for s in self.stats.values()),
                "targets": per_target, "distinct_behaviours": len(self.signatures),
                "distinct_failures": len(self.failures), "failures": list(self.failures.values())}


def _scratch_root() -> str | None:
    """tmpfs when there is one: every input is written to a file before it is read."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


# --- the atheris engine -----------------------------------------------------------------------------------------
def atheris_child_main(args) -> None:
    """One libFuzzer run over one target, in this process (libFuzzer exits the process when it is done)."""
    import torch

    torch.set_num_threads(1)
    import atheris

    with atheris.instrument_imports(include=["moepack.format_spec", "moepack.families", "moepack.packer"]):
        import moepack.packer.convert  # noqa: F401  (convert's sources: the checkpoint and GGUF readers)
        import moepack.packer.gguf_source  # noqa: F401
        import moepack.format_spec.decode  # noqa: F401
        import moepack.format_spec.quants  # noqa: F401
        import moepack.format_spec.reader  # noqa: F401
        import moepack.format_spec.verify  # noqa: F401
        import moepack.families.deepseek_v4.kv  # noqa: F401
    import targets
    from mutations import Mutator

    (target,) = args.target
    corpus = [data for _, data in load_corpus(args.corpus, target)]
    rng = random.Random(args.seed)
    mutator = Mutator(rng, lambda _target: rng.choice(corpus))
    scratch = args.scratch  # the parent removes it: libFuzzer ends this process without unwinding
    stats = {"inputs": 0, "ok": 0, "error": 0, "failure": 0, "failures": {}}
    started = time.monotonic()
    last_write = [0.0]

    def write_stats(force: bool = False) -> None:
        now = time.monotonic()
        if force or now - last_write[0] >= 1:
            last_write[0] = now
            stats["seconds"] = round(now - started, 1)
            Path(args.stats).write_text(json.dumps(stats))

    def test_one_input(data: bytes) -> None:
        outcome = targets.run_one(target, targets.materialize(target, data, scratch))
        stats["inputs"] += 1
        stats[outcome["status"]] += 1
        if outcome["status"] == "failure" and outcome["key"] not in stats["failures"]:
            path = Path(args.crashes) / f"{target}-atheris-{hashlib.sha1(data).hexdigest()[:10]}{EXTENSIONS[target]}"
            path.write_bytes(data)
            path.with_name(path.name + ".txt").write_text(f"{outcome['key']}\n{outcome['traceback']}",
                                                          errors="backslashreplace")
            stats["failures"][outcome["key"]] = {**{k: outcome[k] for k in ("kind", "frame", "stage", "message")},
                                                 "reproducer": str(path)}
            write_stats(force=True)
        else:
            write_stats()

    def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
        rng.seed(seed)
        out = atheris.Mutate(data, max_size) if rng.random() < 0.4 else mutator.mutate(target, data)
        return out[:max_size]

    max_len = max(len(d) for d in corpus) + (64 << 10)
    out_corpus = Path(args.corpus) / f"atheris-{target}"
    out_corpus.mkdir(parents=True, exist_ok=True)
    libfuzzer_args = [sys.argv[0], f"-max_total_time={int(args.seconds)}", f"-timeout={int(args.timeout)}",
                      f"-rss_limit_mb={args.memory_mb + 3072}", f"-max_len={max_len}", f"-seed={args.seed or 1}",
                      f"-artifact_prefix={args.crashes}/{target}-atheris-", "-print_final_stats=1",
                      str(out_corpus), str(Path(args.corpus) / target)]
    if args.runs is not None:
        libfuzzer_args.insert(1, f"-runs={args.runs}")
    write_stats(force=True)
    atheris.Setup(libfuzzer_args, test_one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()


def run_atheris(args, targets_run: list[str]) -> dict:
    try:
        import atheris  # noqa: F401
    except ImportError:
        raise SystemExit("the atheris engine needs `pip install atheris`; or use --engine mutation") from None
    started = time.monotonic()
    report = {"engine": "atheris", "seed": args.seed, "targets": {}, "failures": []}
    for i, target in enumerate(targets_run):
        seconds = (args.seconds - (time.monotonic() - started)) / (len(targets_run) - i)
        stats_path = Path(args.crashes) / f".atheris-{target}-stats.json"
        before = set(os.listdir(args.crashes))
        command = [sys.executable, str(Path(__file__).resolve()), "--atheris-child", "--target", target,
                   "--corpus", args.corpus, "--crashes", args.crashes, "--seconds", str(max(int(seconds), 1)),
                   "--seed", str(args.seed), "--timeout", str(args.timeout), "--memory-mb", str(args.memory_mb),
                   "--stats", str(stats_path)]
        if args.runs is not None:
            command += ["--runs", str(args.runs // len(targets_run))]
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="moepack-atheris-", dir=_scratch_root()) as scratch:
            child = subprocess.run(command + ["--scratch", scratch], stdout=sys.stderr,
                                   stderr=None if not args.quiet else subprocess.DEVNULL)
        stats = json.loads(stats_path.read_text()) if stats_path.exists() else {"inputs": 0, "failures": {}}
        report["targets"][target] = {"inputs": stats["inputs"], "seconds": round(time.monotonic() - t0, 1),
                                     **{k: stats.get(k, 0) for k in ("ok", "error", "failure")}}
        for key, f in stats["failures"].items():
            report["failures"].append({"target": target, "key": key, **f})
        # libFuzzer's own findings (timeout-, oom-, crash- artifacts) end the child with a non-zero status.
        for name in sorted(set(os.listdir(args.crashes)) - before):
            kind = next((k for k in ("timeout", "oom", "crash", "leak", "slow-unit") if f"-atheris-{k}-" in name), None)
            if kind:
                report["failures"].append({"target": target, "key": f"libFuzzer {kind}", "kind": kind,
                                           "reproducer": str(Path(args.crashes) / name),
                                           "message": f"libFuzzer exit status {child.returncode}"})
    report["inputs"] = sum(t["inputs"] for t in report["targets"].values())
    report["wall_seconds"] = round(time.monotonic() - started, 1)
    report["distinct_failures"] = len(report["failures"])
    return report


# --- replay -----------------------------------------------------------------------------------------------------
def replay(paths: list[str]) -> int:
    """Run saved inputs in this process and print each outcome with its traceback."""
    import targets

    failed = 0
    with tempfile.TemporaryDirectory(dir=_scratch_root()) as scratch:
        for path in paths:
            target = _target_of(path)
            outcome = targets.run_one(target, targets.materialize(target, Path(path).read_bytes(), scratch))
            failed += outcome["status"] == "failure"
            print(f"{path}: {outcome['status']} at {outcome['stage']}: {outcome['message']}")
            if outcome["status"] == "failure":
                print(outcome["traceback"])
    return 1 if failed else 0


def _target_of(path: str) -> str:
    return next((t for t, ext in EXTENSIONS.items() if path.endswith(ext)), "container")


# --- command line -----------------------------------------------------------------------------------------------
def _print_report(r: dict) -> None:
    lines = [f"moepack fuzz ({r['engine']}): {r['inputs']} inputs in {r['wall_seconds']} s, "
             f"{r['distinct_failures']} distinct failures"]
    for t, s in r["targets"].items():
        extra = f", {s['inputs_per_second']}/s, corpus {s['corpus']}" if "inputs_per_second" in s else ""
        lines.append(f"  {t:>9}: {s['inputs']} inputs ({s.get('ok', 0)} ok, {s.get('error', 0)} moepack errors, "
                     f"{s.get('failure', 0)} failures){extra}")
    for f in r["failures"]:
        lines.append(f"  FAILURE {f['target']}: {f['key']}\n    {f.get('message', '')[:300]}\n    -> {f['reproducer']}")
    # Messages may quote the input's lone surrogates, which a strict stdout can't encode.
    print("\n".join(lines).encode("utf-8", "backslashreplace").decode("utf-8"))


def _target_list(text: str) -> list[str]:
    names = list(TARGETS) if text == "all" else [t for t in text.split(",") if t]
    unknown = [t for t in names if t not in TARGETS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown target {','.join(unknown)!r} (choose from {', '.join(TARGETS)})")
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="wall-clock budget (default 60)")
    p.add_argument("--runs", type=int, help="stop after this many inputs")
    p.add_argument("--corpus", default=str(REPO / "fuzz" / "corpus"),
                   help="corpus directory (seeds are built into it on first use)")
    p.add_argument("--crashes", default=str(REPO / "fuzz" / "crashes"), help="where reproducers are saved")
    p.add_argument("--target", type=_target_list, default="all",
                   help=f"comma-separated, of {', '.join(TARGETS)}; or all (default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", choices=["mutation", "atheris"], default="mutation")
    p.add_argument("--workers", type=int, default=1, help="worker subprocesses (mutation engine)")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds one input may take before it is a hang")
    p.add_argument("--memory-mb", type=int, default=1024,
                   help="address space one input may add to the worker before it is a memory blow-up")
    p.add_argument("--quick-seeds", action="store_true",
                   help="seed only with hand-made containers and KVWriter KVs (a second, not half a minute)")
    p.add_argument("--save-corpus", action="store_true", help="also write inputs that joined the corpus to disk")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--replay", nargs="+", metavar="FILE", help="rerun saved inputs and print their outcomes")
    p.add_argument("--unpack", nargs=2, metavar=("FILE", "DIR"),
                   help="write a saved input as the file(s) the operations read (bundles become several files)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--atheris-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--scratch", help=argparse.SUPPRESS)
    p.add_argument("--stats", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        worker_main(args.memory_mb, args.timeout, args.scratch)
        return 0
    if args.replay:
        return replay(args.replay)
    if args.unpack:
        import targets

        data = Path(args.unpack[0]).read_bytes()
        print(targets.materialize(_target_of(args.unpack[0]), data, args.unpack[1]))
        return 0
    if args.atheris_child:
        atheris_child_main(args)
        return 0
    os.makedirs(args.crashes, exist_ok=True)
    targets_run = args.target
    ensure_seeds(args.corpus, full=not args.quick_seeds, targets=targets_run)
    report = run_atheris(args, targets_run) if args.engine == "atheris" else Campaign(args, targets_run).run()
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print_report(report)
    return 1 if report["distinct_failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
