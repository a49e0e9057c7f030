"""Errors that moepack reports to users as one line."""


class MoepackError(Exception):
    """Any failure a user can cause or meet (bad input, damaged file, full disk): the CLI prints it as one
    line and exits non-zero."""


class FormatError(MoepackError):
    """A container (or KV directory) that is malformed, damaged or of an unsupported version."""
