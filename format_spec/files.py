"""Opening inputs: only regular files. A FIFO would block `open` until a writer came (a `verify` that hangs), a pipe
(`<(cat file)`) cannot seek, a directory or a device is not a file of ours: each is refused at once, by name.
Writing outputs: check_free_space refuses, before any work, an output its disk cannot hold; temporary outputs are
named by temporary_prefix, so that remove_stale_temporaries can clear what a killed run left."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import resource
import shutil
import socket
import stat

from .errors import FormatError, MoepackError

FREE_SPACE_MARGIN = 1.02  # estimates miss a little (headers, an index, a filesystem's own blocks)

_KINDS = ((stat.S_ISFIFO, "a FIFO or pipe"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def not_regular(mode: int) -> str | None:
    """What a file of this st_mode is when it is not a regular file, else None."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def refuse_replacing_a_special_file(path: str) -> None:
    """Outputs are written under a temporary name and renamed over their path: one that is a device, a FIFO or a
    socket (`--logits-out /dev/null --force`, as root) would itself be replaced by a file. A link is replaced, never
    what it points to; so one to a device, a FIFO or a socket is refused too (`/dev/stdout`, a link to the process's
    pipe or terminal: meant to be written through, it would have been replaced in /dev)."""
    try:
        mode, link = os.lstat(path).st_mode, ""
        if stat.S_ISLNK(mode):
            mode, link = os.stat(path).st_mode, "a link to "
    except OSError:  # (none there, or a link to nothing: replaced)
        return
    if not stat.S_ISDIR(mode) and (kind := not_regular(mode)):
        raise MoepackError(f"{path} is {link}{kind}: an output is renamed over its path, which would replace it by a "
                           "file (--force or not)")


def open_regular(path: str, missing: str | None = None) -> int:
    """A read-only descriptor of the regular file `path`; FormatError naming it otherwise (`missing`: the message
    where it does not exist). Opened non-blocking, so a FIFO is refused instead of waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise FormatError(missing or f"{path}: no such file") from None
    except IsADirectoryError:
        raise FormatError(f"{path}: not a regular file (a directory)") from None
    except OSError as e:
        raise FormatError(f"{path}: cannot open ({e.strerror})") from None
    except ValueError:  # a NUL byte, or a lone surrogate the file system cannot encode: a name read from a file
        raise FormatError(f"{path!r}: cannot open (not a file name this system can have)") from None
    kind = not_regular(os.fstat(fd).st_mode)
    if kind is not None:
        os.close(fd)
        raise FormatError(f"{path}: not a regular file ({kind})")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def check_regular(path: str) -> None:
    """FormatError naming `path` unless it is a regular file (or does not exist: the opener says so)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    kind = not_regular(mode)
    if kind is not None:
        raise FormatError(f"{path}: not a regular file ({kind})")


def existing_ancestor(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 2**20:.1f} MiB"


def exclusive_lock(path: str, busy: str) -> int:
    """An exclusive lock on the file at `path` (created empty where missing, never truncated), this process's until
    `release_lock`: the fd, or -1 on a filesystem without locks (NFS without lockd: written unlocked, as before).
    MoepackError(`busy`) where another process holds it."""
    for _ in range(8):
        try:  # (0o666: the umask makes it a plain file's mode, as open() would)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
        except OSError as e:
            raise MoepackError(f"cannot write {path}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise MoepackError(busy) from None
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                return -1
            raise MoepackError(f"cannot lock {path}: {e.strerror or e}") from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except OSError:
            same = False
        if same:
            return fd
        os.close(fd)  # renamed or removed by its holder between the open and the lock: the path's file, again
    raise MoepackError(f"cannot lock {path}: it keeps being replaced")


def release_lock(fd: int | None, remove: str | None = None) -> None:
    """Let go of exclusive_lock's lock; `remove`: its lock file's path, removed first (while still held, so that no
    other process locks a file no longer there)."""
    if fd is None or fd < 0:
        return
    if remove is not None:
        try:
            os.unlink(remove)
        except OSError:
            pass
    os.close(fd)


def plain_file_mode() -> int:
    """The mode open() gives a new file under this process's umask (0644 under 022): what a file made by a library
    that creates its own at 0600 (mkstemp, safetensors) is set to, as every other output is."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def short_write_reason(path: str) -> str | None:
    """Why a write to `path` stopped short where the library that wrote it gave no errno (numpy's tofile says only
    "N requested and M written"): the process's file size limit (ulimit -f) reached, or the disk full; None when
    neither is seen."""
    try:
        size = os.path.getsize(path)
        vfs = os.statvfs(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return None
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and size + (1 << 20) >= limit:  # (a buffered writer may stop a little short)
        return f"File too large: the process's file size limit (ulimit -f) is {limit:,} bytes"
    if vfs.f_bavail * vfs.f_frsize < (1 << 20):
        return "No space left on device (disk full)"
    return None


def check_free_space(needs: dict[str, int], what: str = "the output") -> dict[str, dict]:
    """Refuse (one line) before any work when a filesystem lacks the bytes to be written there. `needs`: directory
    -> bytes that will be written under it (directories on one filesystem are summed). Returns, per filesystem's
    first directory, the need and the free bytes (for reports)."""
    by_fs: dict[int, list] = {}
    for directory, n in needs.items():
        directory = existing_ancestor(directory)  # one not made yet: its disk is its parent's
        st = os.stat(directory)
        entry = by_fs.setdefault(st.st_dev, [directory, 0])
        entry[1] += max(int(n), 0)
    report = {}
    for directory, need in by_fs.values():
        vfs = os.statvfs(directory)
        if vfs.f_flag & os.ST_RDONLY:  # (its free count may be anything: a read-only disk is not a full one)
            raise MoepackError(f"cannot write to {directory} ({what}): Read-only file system")
        free = vfs.f_bavail * vfs.f_frsize
        report[directory] = {"need_bytes": need, "free_bytes": free}
        if need * FREE_SPACE_MARGIN > free:
            raise MoepackError(f"not enough free space for {what} on {directory}: it needs about "
                               f"{_gb(need * FREE_SPACE_MARGIN)} (a margin included), {_gb(free)} is free")
    return report


# Temporary outputs (an export's folder, a GGUF being written, a scratch download) are named
# `.<kind>-<host>.<pid>-<random>`: a run killed by SIGKILL (no cleanup runs) leaves them behind, and the next run
# in the same folder removes those of its own kinds whose process, on this host, is gone.
_OWN_TEMPORARY = re.compile(r"^\.(?P<kind>[a-z-]+)-(?P<host>[A-Za-z0-9]*)\.(?P<pid>[0-9]+)-")


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32]


def temporary_prefix(kind: str) -> str:
    """The prefix for tempfile.mkdtemp / mkstemp of a temporary output of `kind` (say whose it is: this host, this
    process), so remove_stale_temporaries can tell a dead run's leftovers from a live run's work."""
    return f".{kind}-{_host_tag()}.{os.getpid()}-"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except PermissionError:  # another user's process: alive
        return True
    except (ProcessLookupError, OverflowError):  # gone, or no pid this system can have
        return False
    return True


def remove_stale_temporaries(directory: str, kinds: tuple[str, ...]) -> list[str]:
    """Remove, from `directory`, the temporaries of these kinds (named by temporary_prefix) that a process of this
    host left and that is no longer alive; returns their paths. Only ours, only stale: anything else is kept, and a
    failure to remove one is no error (the next run tries again)."""
    removed = []
    host = _host_tag()
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _OWN_TEMPORARY.match(name)
        if not m or m["kind"] not in kinds or m["host"] != host or _process_alive(int(m["pid"])):
            continue
        path = os.path.join(directory, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except OSError:
            continue
        removed.append(path)
    return removed
