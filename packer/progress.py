"""Progress bars for long work: bytes with rates, cleared when done so errors and summaries stay one line.

Drawn on a terminal only: a log file or a pipe gets no carriage-return frames (the summary line, or --json's object,
says what was done). TQDM_DISABLE=1 turns them off on a terminal too, as it does for tqdm's own defaults."""

from __future__ import annotations

import os
import sys

from tqdm import tqdm


def bars_wanted(enabled: bool = True) -> bool:
    """Whether a bar is drawn: asked for, stderr a terminal, and TQDM_DISABLE not set (to anything but 0/false)."""
    disabled = os.environ.get("TQDM_DISABLE", "").strip().lower() not in ("", "0", "false", "no")
    return enabled and not disabled and sys.stderr.isatty()


def progress_bar(total: int | None, desc: str, enabled: bool = True) -> tqdm:
    """Bytes with their rate; `total` None: no end known (bytes so far and the rate only)."""
    unbounded = "{desc}: {n_fmt}B [{elapsed}, {rate_fmt}]" if total is None else None
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not bars_wanted(enabled),
                dynamic_ncols=True, leave=False, bar_format=unbounded)
