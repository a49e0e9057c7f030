"""The console entry (`moepack.cli.main.main`, what `python -m moepack` runs) called in the test's own process.

A process of its own costs a torch import (about 3 s on a CI runner) before a command can refuse its input; this
runs the same entry with the same argv, stdin and environment, stdout and stderr captured as bytes and the exit
status taken from its SystemExit, warnings shown on its stderr under Python's default filters (not pytest's
capture). What it changes process-wide (argv, the signal handlers, the warnings' format) is put back after.
Tests of what only a process shows (signals, a hang that needs a timeout, the environment torch or huggingface_hub
read as they load, argv bytes) keep a subprocess.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import warnings

from click.testing import CliRunner

from moepack.cli.main import main


def run_console(*args: str, input: bytes | None = None, env: dict[str, str | None] | None = None
                ) -> subprocess.CompletedProcess:
    """`moepack ARGS...` as a subprocess.CompletedProcess (stdout and stderr bytes); `env`: variables set (None:
    unset) for the call only."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    formatwarning, argv = warnings.formatwarning, sys.argv
    status = 0
    with CliRunner().isolation(input=input, env=env) as (out, err, _), warnings.catch_warnings():
        _python_warnings()
        sys.argv = ["moepack", *args]
        try:
            main()
        except SystemExit as e:  # as the interpreter ends a process: a text code is printed, status 1
            status = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if isinstance(e.code, str):
                sys.stderr.write(e.code + "\n")
        finally:
            sys.stdout.flush()  # as a process's exit does (a warning written to sys.stderr is not flushed yet)
            sys.stderr.flush()
            sys.argv, warnings.formatwarning = argv, formatwarning
            for s, handler in handlers.items():
                signal.signal(s, handler)
    return subprocess.CompletedProcess(["moepack", *args], status, out.getvalue(), err.getvalue())


def _python_warnings() -> None:
    """The warning filters and display of a fresh interpreter: each shown once where raised, on sys.stderr, in
    warnings.formatwarning's format (which the console entry sets)."""
    warnings.resetwarnings()
    warnings.simplefilter("default")
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.simplefilter("ignore", category)

    def show(message, category, filename, lineno, file=None, line=None):
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    warnings.showwarning = show
