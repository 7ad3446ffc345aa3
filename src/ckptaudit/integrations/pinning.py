"""What the guard judges is what was saved: a private snapshot of a checkpoint's files, taken at submit.

(training thread, at :meth:`Guard.submit <ckptaudit.integrations.guard.Guard.submit>`) :func:`pin` hard-links every
file of the checkpoint into a private folder beside it, ``.ckptaudit-pins/<host>.<pid>.<n>/<name>`` (the same
name and layout, so the audit reads it as it would read the original), and records each file's identity:
device, inode, size, mtime_ns, ctime_ns, and an xxh3 hash of its first and last 64 KiB. The audit reads the pin.

Why both. A hard link keeps the bytes that were saved when the library later *replaces* the file (writes a new
file and renames it over the name: Lightning's ``last.ckpt`` when its temporary file is on the same filesystem)
or deletes it (retention): the name moves on, the inode the pin holds does not. A hard link does not keep them
when the library *rewrites the same inode* (``open(path, "wb")``: Lightning's ``last.ckpt`` when its temporary
file is on another filesystem and is copied over in place): the pin changes with it. That is what the identity
catches, checked on the worker after the audit and before the verdict is recorded (:meth:`Pin.changed`): every
write sets the inode's ctime to the current time, and unlike mtime no call can set it back (``os.utime`` itself
sets ctime), so a rewrite in place that keeps the size and restores the mtime still differs. Removing a name of
the inode moves its ctime too (the link count changes): a ctime that moved while the link count dropped (the
library deleted the checkpoint, or renamed a new file over its name) is accepted when size, mtime and both
ends are unchanged, the one case this cannot tell from a rewrite in place that restores the mtime, keeps the
size and both ends, and then unlinks the name. The pin's own links are made before the identity is recorded;
:meth:`Guard.detach` unlinks a name, which that rule accepts. On Linux 6.13 and later, ext4, xfs, btrfs and tmpfs stamp a change with the
fine-grained clock once the old stamp has been read (multigrain timestamps), so a rewrite right after the pin
gets a later ctime; on older kernels stamps have the resolution of a clock tick (1-10 ms), and a rewrite of the
same size within the tick of the pin is seen only if it changes the first or last 64 KiB (a ``torch.save``
archive's last chunk holds its zip directory, with the CRC-32 of every record). A pinned file that changed is
*not judged*: the audit may have read anything.

A file of the checkpoint that is a symbolic link is pinned as the file it points to (``linkat`` with
``AT_SYMLINK_FOLLOW``, resolved once, where the checkpoint lies): torch and safetensors read the link's target, so
the pin holds those bytes, never the link itself (a relative link moved into the pin's folder would point
elsewhere). A target outside the checkpoint is pinned too (the bytes torch reads at submit); where it lies on
another filesystem the hard link is refused and the checkpoint is audited in place, as below.

Where the pin cannot be made (hard links refused: another filesystem, EPERM, EMLINK; a directory symlink inside
the checkpoint), the checkpoint is audited in place and the identity of its own files is checked instead: a file
replaced or rewritten in the meantime makes the verdict *not judged*.

Nothing here imports torch; the folder's name matches no library's resume or retention pattern (Trainer's
``checkpoint-*``, torchtitan's ``step-<digits>``, Lightning's ``*.ckpt``, ``ckptaudit latest``'s candidates).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import shutil
import socket
import threading
from dataclasses import dataclass

__all__ = ["CHUNK", "PINS_DIR", "FileIdentity", "Pin", "identity", "pin"]

log = logging.getLogger("ckptaudit.guard")

PINS_DIR = ".ckptaudit-pins"
"""The private folder beside a checkpoint where the guard keeps its hard links while the audit runs."""
CHUNK = 64 << 10
"""Bytes hashed at each end of a file for its identity."""

_seq = itertools.count(1)
_swept: set[str] = set()
_swept_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class FileIdentity:
    """One file as it was when pinned."""

    rel: str
    """Its path inside the checkpoint ("" for a single-file checkpoint)."""
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    nlink: int
    head: int
    """xxh3-64 of its first :data:`CHUNK` bytes."""
    tail: int
    """xxh3-64 of its last :data:`CHUNK` bytes."""

    def differs(self, other: FileIdentity) -> str | None:
        """Why ``other`` (the same file, stated again) is not the file this identity recorded; ``None`` if it is.

        A moved ctime alone is explained only by a name of the inode going away (its link count dropped: the
        library deleted the checkpoint, or renamed a new file over its name); otherwise the inode was written
        (or its attributes changed)."""
        for name in ("dev", "ino", "size", "mtime_ns", "head", "tail"):
            if getattr(self, name) != getattr(other, name):
                what = {"head": "first 64 KiB", "tail": "last 64 KiB", "dev": "device", "ino": "inode"}.get(name, name)
                return f"{self.rel or 'the file'}: {what} changed"
        if self.ctime_ns != other.ctime_ns and other.nlink >= self.nlink:
            return f"{self.rel or 'the file'}: changed in place (its ctime moved and no name of it went away)"
        return None


def identity(path: str, rel: str = "") -> FileIdentity:
    """The identity of the file at ``path`` now (follows symlinks, as every reader does)."""
    import xxhash

    with open(path, "rb") as fh:
        st = os.fstat(fh.fileno())
        head = fh.read(CHUNK)
        if st.st_size > CHUNK:
            fh.seek(max(CHUNK, st.st_size - CHUNK))
            tail = fh.read(CHUNK)
        else:
            tail = head
    return FileIdentity(rel, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_nlink,
                        xxhash.xxh3_64_intdigest(head), xxhash.xxh3_64_intdigest(tail))


def _files(root: str) -> list[str]:
    """The files of a checkpoint (relative paths, sorted); ``[""]`` for a file. Raises ``OSError`` for a directory
    symlink inside it (a pin of hard links cannot hold a linked directory)."""
    if not os.path.isdir(root):
        if not os.path.exists(root):
            raise FileNotFoundError(f"{root} does not exist")
        return [""]
    out: list[str] = []
    for folder, dirs, names in os.walk(root):
        for d in dirs:
            if os.path.islink(os.path.join(folder, d)):
                raise OSError(f"{os.path.join(folder, d)} is a linked directory")
        out += [os.path.relpath(os.path.join(folder, n), root) for n in names]
    return sorted(out)


def _join(root: str, rel: str) -> str:
    return os.path.join(root, rel) if rel else root


class Pin:
    """A checkpoint's files as they were at submit: where the audit reads them and how to tell they still are."""

    def __init__(self, checkpoint: str, folder: str | None, files: dict[str, FileIdentity]) -> None:
        self.checkpoint = checkpoint
        self.folder = folder
        """The pin's private folder (``None``: not pinned, the audit reads the checkpoint in place)."""
        self.files = files

    @property
    def pinned(self) -> bool:
        return self.folder is not None

    @property
    def path(self) -> str:
        """What the audit reads: the pinned copy, or the checkpoint itself when not pinned."""
        if self.folder is None:
            return self.checkpoint
        return os.path.join(self.folder, os.path.basename(os.path.normpath(self.checkpoint)))

    def changed(self) -> str | None:
        """(worker, after the audit) Why the bytes the audit read may not be the bytes saved; ``None`` when every
        file is as it was pinned (and, unpinned, when the checkpoint holds no file it did not hold then)."""
        try:
            now = _files(self.path)
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"
        if set(now) != set(self.files):
            gone, new = sorted(set(self.files) - set(now)), sorted(set(now) - set(self.files))
            return f"files changed: {', '.join([*(f'-{g}' for g in gone[:3]), *(f'+{n}' for n in new[:3])])}"
        for rel, was in self.files.items():
            try:
                why = was.differs(identity(_join(self.path, rel), rel))
            except OSError as exc:
                why = f"{rel or 'the file'}: {type(exc).__name__}: {exc}"
            if why:
                return why
        return None

    def at_checkpoint(self) -> str:
        """(worker) What the checkpoint's own path holds now: ``"same"`` (the pinned files, by inode, and nothing
        else), ``"gone"`` (nothing) or ``"replaced"`` (anything else)."""
        if not os.path.lexists(self.checkpoint):
            return "gone"
        if self.folder is None:
            return "same"  # unpinned: the path is what was read, and changed() vouched for it
        try:
            now = _files(self.checkpoint)
        except OSError:
            return "replaced"
        if set(now) != set(self.files):
            return "replaced"
        for rel, was in self.files.items():
            try:
                st = os.stat(_join(self.checkpoint, rel))
            except OSError:
                return "replaced"
            if (st.st_dev, st.st_ino) != (was.dev, was.ino):
                return "replaced"
        return "same"

    def holds(self, dev: int, ino: int) -> str | None:
        """The relative path of the pinned file with this inode, if any."""
        return next((rel for rel, f in self.files.items() if (f.dev, f.ino) == (dev, ino)), None)

    def release(self) -> None:
        """Remove the pin's folder (the hard links; the checkpoint's own files are untouched)."""
        if self.folder is None:
            return
        shutil.rmtree(self.folder, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(self.folder))  # the pins folder, once empty
        except OSError:
            pass


@functools.cache
def _host() -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname()) or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(pins: str) -> None:
    """Remove pins left in ``pins`` by guards of this host whose process is gone (a crash); once per folder."""
    with _swept_lock:
        if pins in _swept:
            return
        _swept.add(pins)
    host = _host()
    try:
        names = os.listdir(pins)
    except OSError:
        return
    for name in names:
        parts = name.rsplit(".", 2)
        if len(parts) == 3 and parts[0] == host and parts[1].isdigit() and int(parts[1]) != os.getpid() \
                and not _alive(int(parts[1])):
            shutil.rmtree(os.path.join(pins, name), ignore_errors=True)
            log.info("ckptaudit guard: removed %s, a pin left by a guard that is gone", os.path.join(pins, name))


def _link_target(src: str, dest: str) -> None:
    """Hard-link ``dest`` to the file ``src`` names, following ``src`` if it is a symbolic link (``os.link`` alone
    calls ``link(2)``, which on Linux links the symlink itself): ``linkat`` with ``AT_SYMLINK_FOLLOW``, which
    Python uses when given a directory descriptor, resolves the link once, relative to its own folder."""
    if os.link not in os.supports_dir_fd or os.link not in os.supports_follow_symlinks:  # no linkat (Windows)
        os.link(os.path.realpath(src), dest)
        return
    folder = os.open(os.path.dirname(src) or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) |
                     getattr(os, "O_CLOEXEC", 0))
    try:
        os.link(os.path.basename(src), dest, src_dir_fd=folder, follow_symlinks=True)
    finally:
        os.close(folder)


def pin(checkpoint: str, pins: str | None = None) -> Pin:
    """(training thread) Pin ``checkpoint`` (a file or a directory, complete): hard links in a private folder of
    ``pins`` (default: ``.ckptaudit-pins`` beside it, which must be on the same filesystem), and every file's
    identity. When a hard link is refused the checkpoint is not pinned, and the identities are its own files'.
    Raises ``FileNotFoundError`` when ``checkpoint`` does not exist."""
    checkpoint = os.path.normpath(checkpoint)
    rels = _files(checkpoint)
    pins = pins or os.path.join(os.path.dirname(os.path.abspath(checkpoint)), PINS_DIR)
    folder = os.path.join(pins, f"{_host()}.{os.getpid()}.{next(_seq)}")
    try:
        os.makedirs(pins, exist_ok=True)
        sweep_stale(pins)
        os.mkdir(folder)
        target = os.path.join(folder, os.path.basename(checkpoint))
        if rels != [""]:
            os.mkdir(target)  # a directory checkpoint, even an empty one
        for rel in rels:
            dest = _join(target, rel)
            if rel:
                os.makedirs(os.path.dirname(dest), exist_ok=True)
            _link_target(_join(checkpoint, rel), dest)
        made = Pin(checkpoint, folder, {})
        made.files = {rel: identity(_join(target, rel), rel) for rel in rels}  # after the links: ctime moved
        return made
    except OSError as exc:
        shutil.rmtree(folder, ignore_errors=True)
        log.info("ckptaudit guard: %s could not be pinned (%s: %s); it is audited in place, and a file replaced "
                 "before its audit makes the verdict 'not judged'", checkpoint, type(exc).__name__, exc)
    return Pin(checkpoint, None, {rel: identity(_join(checkpoint, rel), rel) for rel in rels})
