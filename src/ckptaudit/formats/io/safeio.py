"""Opening files of an untrusted checkpoint: regular files only, never a blocking open, never unbounded reads.

A checkpoint directory may hold a named pipe (``open`` blocks until a writer appears), a device
(``/dev/zero`` never ends, ``/dev/tty`` waits for input), a socket, or a symlink to any of them. Every reader
opens files through :func:`open_regular`, which opens without blocking (``O_NONBLOCK``), checks the opened
descriptor is a regular file (``fstat``, so a swap between check and open cannot fool it) and only then hands
it out. :func:`read_limited` adds a size limit checked before reading.

One reading, one version: a reader parses a file's header through one open and the scan reads its tensors
through another, later. Each open of a file of one checkpoint is checked against the version the first open
found (:class:`FileIds`: device, inode, size, ``mtime_ns`` of the opened descriptor), so a file replaced or
rewritten between the header and the tensors is :class:`FileChanged` (``integrity.changed``), never a report on
bytes of two versions. The ids of the checkpoint being opened are active in this thread (:func:`reading`).
"""

from __future__ import annotations

import contextvars
import errno
import fcntl
import os
import stat
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO

__all__ = ["FileChanged", "FileId", "FileIds", "LimitExceeded", "NotRegularFile", "describe_kind", "file_kind",
           "open_regular", "open_regular_fd", "read_limited", "reading"]


class NotRegularFile(OSError):
    """The path is a pipe, device, socket or directory: it is never read."""


class LimitExceeded(Exception):
    """A file is larger than a reader's safety limit (checked before reading)."""

    def __init__(self, message: str, offset: int | None = None) -> None:
        super().__init__(message)
        self.offset = offset


class FileChanged(OSError):
    """A file of a checkpoint is not the version an earlier open of it found: replaced (another inode) or written
    (another size or ``mtime_ns``) since. ``filename``: the path; ``str()``: what differs."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(errno.ESTALE, f"{path} changed while the checkpoint was audited ({why})", path)

    def __str__(self) -> str:
        return str(self.strerror)


@dataclass(frozen=True, slots=True)
class FileId:
    """One version of a file: device, inode, size and ``mtime_ns`` (of an opened descriptor, or of a ``stat``
    that follows links, as every open here does)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileId:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def differs(self, now: FileId, *, same_host: bool = True) -> str | None:
        """Why ``now`` is another version than this one, or ``None``. Across hosts (a distributed audit's rank on
        another node of a shared filesystem) the device and inode are local names a filesystem need not keep
        (FUSE mounts number inodes per mount): only size and ``mtime_ns`` are compared."""
        if same_host and (self.dev, self.ino) != (now.dev, now.ino):
            return f"another file: device {now.dev} inode {now.ino}, was device {self.dev} inode {self.ino}"
        if self.size != now.size:
            return f"{now.size} bytes, was {self.size}"
        if self.mtime_ns != now.mtime_ns:
            return f"modified at {now.mtime_ns} ns, was {self.mtime_ns} ns"
        return None

    def as_list(self) -> list[int]:
        return [self.dev, self.ino, self.size, self.mtime_ns]


class FileIds:
    """The version of each file (by absolute path, links not resolved) one reading of a checkpoint found first;
    every later open of the same path, from any thread, must find the same version or raises
    :class:`FileChanged`. ``known``: versions found by another process (a distributed audit's rank 0), compared
    with ``same_host`` (see :meth:`FileId.differs`)."""

    def __init__(self, known: Mapping[str, FileId] | None = None, *, same_host: bool = True) -> None:
        self._ids: dict[str, FileId] = {os.path.abspath(k): v for k, v in (known or {}).items()}
        self._host = {k: same_host for k in self._ids}
        self._lock = threading.Lock()

    def check(self, path: str, now: FileId) -> None:
        """Record ``now`` as ``path``'s version if it has none yet, else raise :class:`FileChanged` if it differs."""
        key = os.path.abspath(path)
        with self._lock:
            was = self._ids.setdefault(key, now)
            same_host = self._host.get(key, True)
        if was is not now:
            why = was.differs(now, same_host=same_host)
            if why is not None:
                raise FileChanged(path, why)

    def pin(self, path: str) -> FileId:
        """``path``'s version: the one recorded, else the one it has now (``stat``, links followed), recorded."""
        key = os.path.abspath(path)
        with self._lock:
            known = self._ids.get(key)
        if known is not None:
            return known
        now = FileId.of(os.stat(path))
        self.check(path, now)
        return self.pin(path)

    def get(self, path: str) -> FileId | None:
        with self._lock:
            return self._ids.get(os.path.abspath(path))


_READING: contextvars.ContextVar[FileIds | None] = contextvars.ContextVar("ckptaudit_reading", default=None)


@contextmanager
def reading(ids: FileIds | None) -> Iterator[None]:
    """Every :func:`open_regular` in this thread (and context) checks and records against ``ids`` while open."""
    token = _READING.set(ids)
    try:
        yield
    finally:
        _READING.reset(token)


def describe_kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISREG(mode):
        return "a regular file"
    return "not a regular file"


def file_kind(path: str) -> str | None:
    """``None`` for a regular file (symlinks followed), else what it is. Raises ``OSError`` (missing, loop)."""
    mode = os.stat(path).st_mode
    return None if stat.S_ISREG(mode) else describe_kind(mode)


def open_regular(path: str, ids: FileIds | None = None) -> BinaryIO:
    """Open ``path`` for binary reading if (and only if) it is a regular file; never blocks.

    Raises :class:`NotRegularFile` for pipes, devices, sockets and directories, :class:`FileChanged` when the
    opened file is another version than ``ids`` (or the ids of the reading under way, :func:`reading`) recorded
    for ``path``, ``OSError`` otherwise.
    """
    fd, _size = open_regular_fd(path, ids)
    try:
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def open_regular_fd(path: str, ids: FileIds | None = None) -> tuple[int, int]:
    """:func:`open_regular` as a raw descriptor (for ``os.pread``; the caller closes it) and the file's size, from
    the same ``fstat`` that found it a regular file."""
    ids = ids if ids is not None else _READING.get()
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except IsADirectoryError:
        raise NotRegularFile(errno.EISDIR, f"{path} is a directory, not a file", path) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno.EINVAL,
                                 f"{path} is {describe_kind(st.st_mode)}, not a regular file; not opened", path)
        if ids is not None:
            ids.check(path, FileId.of(st))
        # Regular files ignore O_NONBLOCK, but clear it so nothing downstream is surprised.
        fl = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, fl & ~getattr(os, "O_NONBLOCK", 0))
        return fd, st.st_size
    except BaseException:
        os.close(fd)
        raise


def read_limited(path: str, limit: int, what: str = "file") -> bytes:
    """The whole content of a regular file of at most ``limit`` bytes (checked before reading)."""
    with open_regular(path) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > limit:
            raise LimitExceeded(f"{what} of {size} bytes exceeds the reader's safety limit of {limit} bytes")
        data = fh.read(limit + 1)
    if len(data) > limit:  # grew while we read it
        raise LimitExceeded(f"{what} grew past the reader's safety limit of {limit} bytes")
    return data
