"""The durable-write primitives of :mod:`ckptaudit.store` (fsync a directory, replace a file atomically, a random tag
for temporary names). The names of the layout they write (``step-N``, the ``latest`` pointer, ``manifest.json``) are
in :mod:`ckptaudit.ondisk.layout`, where the offline checks and ``latest`` read them too."""

from __future__ import annotations

import os
import secrets

__all__ = ["file_mode", "fsync_dir", "nonce", "write_durably"]


def nonce() -> str:
    """A random tag for temporary names (from ``os.urandom``: never touches ``random``'s training state)."""
    return secrets.token_hex(4)


def fsync_dir(path: str) -> None:
    """Make a directory's entries (a created file, a rename) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str, data: bytes) -> None:
    """Replace ``path`` atomically: write a temporary sibling, fsync it, rename it over ``path``, fsync the
    directory. A reader sees the old content or the new, never a mix."""
    parent = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{nonce()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(parent)


def file_mode() -> int:
    """The mode a new file gets from ``open`` under this process's umask (``0o644`` under ``022``), for files that
    a library creates more privately (safetensors: ``0o600``). The umask is read from Linux's ``/proc`` where it
    can be (``os.umask`` changes it while reading it)."""
    mask = None
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    mask = int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        mask = None
    if mask is None:
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask
