"""Errors that moepack reports to users as one line."""

import errno


class MoepackError(Exception):
    """Any failure a user can cause or meet (bad input, damaged file, full disk): the CLI prints it as one
    line and exits non-zero."""


class FormatError(MoepackError):
    """A container (or KV directory) that is malformed, damaged or of an unsupported version."""


def error_reason(e: BaseException) -> str:
    """What went wrong, for a one-line message: an OS error's own words, else the exception's first line."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def is_disk_full(e: BaseException) -> bool:
    """A write that failed for want of space: ENOSPC, or a library's own error type saying so (safetensors')."""
    return getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e)
