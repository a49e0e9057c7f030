"""Progress bars for long work: bytes with rates, cleared when done so errors and summaries stay one line."""

from __future__ import annotations

from tqdm import tqdm


def progress_bar(total: int, desc: str, enabled: bool = True) -> tqdm:
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled,
                dynamic_ncols=True, leave=False)
