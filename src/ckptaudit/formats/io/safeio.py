"""Opening files of an untrusted checkpoint: regular files only, never a blocking open, never unbounded reads.

A checkpoint directory may hold a named pipe (``open`` blocks until a writer appears), a device
(``/dev/zero`` never ends, ``/dev/tty`` waits for input), a socket, or a symlink to any of them. Every reader
opens files through :func:`open_regular`, which opens without blocking (``O_NONBLOCK``), checks the opened
descriptor is a regular file (``fstat``, so a swap between check and open cannot fool it) and only then hands
it out. :func:`read_limited` adds a size limit checked before reading.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from typing import BinaryIO

__all__ = ["LimitExceeded", "NotRegularFile", "describe_kind", "file_kind", "open_regular", "open_regular_fd",
           "read_limited"]


class NotRegularFile(OSError):
    """The path is a pipe, device, socket or directory: it is never read."""


class LimitExceeded(Exception):
    """A file is larger than a reader's safety limit (checked before reading)."""

    def __init__(self, message: str, offset: int | None = None) -> None:
        super().__init__(message)
        self.offset = offset


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


def open_regular(path: str) -> BinaryIO:
    """Open ``path`` for binary reading if (and only if) it is a regular file; never blocks.

    Raises :class:`NotRegularFile` for pipes, devices, sockets and directories, ``OSError`` otherwise.
    """
    fd, _size = open_regular_fd(path)
    try:
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def open_regular_fd(path: str) -> tuple[int, int]:
    """:func:`open_regular` as a raw descriptor (for ``os.pread``; the caller closes it) and the file's size, from
    the same ``fstat`` that found it a regular file."""
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
