"""The reader contract: what a reader declares, what it must guarantee, and the registry that orders them.

A reader is a :class:`FileReader` (one file of a checkpoint) or a :class:`DirectoryReader` (a directory that is one
checkpoint, e.g. DCP or DeepSpeed), registered with :func:`register_reader` by its container package's ``__init__.py``
(``formats/zip/__init__.py``, ``formats/dcp/__init__.py``, ...). :mod:`ckptaudit.formats.opening` asks the
registered readers in ``order`` and hands the path to the first that recognises it: adding a format is one new
sub-package of :mod:`ckptaudit.formats` registering its reader, with no edit to the dispatcher.

Every reader guarantees:

- **nothing is executed**: no plain :mod:`pickle`, no ``torch.load(weights_only=False)``, no code from the checkpoint;
- **every failure is a finding** on the checkpoint (appended to ``findings``), never an exception, except
  ``NotRegularFile``, ``LimitExceeded`` and ``OSError`` from :mod:`ckptaudit.formats.io.safeio`, which the
  dispatcher turns into findings the same way for every reader;
- **only regular files are opened**, through :func:`~ckptaudit.formats.io.safeio.open_regular` (never a FIFO or a
  device; symbolic links followed, as torch follows them; each open checked against the version of the file the
  first open found, :class:`~ckptaudit.formats.io.safeio.FileIds`);
- **one reading**: what it accepts is what the consumer (torch, DCP, safetensors) reads from the same bytes; where
  the readings could part, it refuses.

``recognises`` is cheap: it looks at the name, the size and the first bytes (:class:`FileHead`), imports neither torch
nor its reader's module; ``read`` names the reader's function as ``"module:function"``, imported only when the
reader applies, so that auditing a small file starts fast.

**Order is precedence, and precedence is security-relevant**: the first reader that recognises a path reads it, so
the order restates the consumer's own (``torch.load`` tries the zip, then the legacy tar, then the pickle stream).
Two readers of one kind may not share an ``order``.
"""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:  # the container packages import this module as they register: it imports none of them
    from ckptaudit.findings import Finding
    from ckptaudit.formats.base import Part

__all__ = [
    "READERS",
    "DirectoryReader",
    "FileHead",
    "FileReader",
    "Reading",
    "Registry",
    "directory_readers",
    "file_readers",
    "load_function",
    "register_reader",
]



class Registered(Protocol):
    """What a registry holds: a name and a place in the order."""

    @property
    def name(self) -> str: ...

    @property
    def order(self) -> int: ...


E = TypeVar("E", bound=Registered)

HEAD_BYTES = 512
"""How much of a file's start a :class:`FileHead` reads once: a tar header block, the longest magic any reader needs."""


class FileHead:
    """One regular file as the file readers' ``recognises`` see it: its path and name, and (read once, lazily, on
    the first question) its size and first :data:`HEAD_BYTES` bytes."""

    def __init__(self, path: str, name: str) -> None:
        self.path, self.name = path, name
        self.subject = name or os.path.basename(path)
        self._head: bytes | None = None
        self._size = -1

    def _read(self) -> None:
        if self._head is None:
            from ckptaudit.formats.io.safeio import open_regular

            with open_regular(self.path) as fh:
                self._size = os.fstat(fh.fileno()).st_size
                self._head = fh.read(HEAD_BYTES)

    @property
    def size(self) -> int:
        self._read()
        return self._size

    def head(self, n: int) -> bytes:
        """The file's first ``n`` bytes (fewer when it is shorter); ``n`` at most :data:`HEAD_BYTES`."""
        if n > HEAD_BYTES:
            raise ValueError(f"a probe holds the first {HEAD_BYTES} bytes, not {n}")
        self._read()
        assert self._head is not None
        return self._head[:n]

    def endswith(self, *suffixes: str) -> bool:
        """Whether the path ends with one of ``suffixes``, case-insensitively."""
        return self.path.lower().endswith(suffixes)


@dataclass
class Reading:
    """What a directory reader adds to: the checkpoint's parts, findings, file sizes and digests.

    ``read_entry(full_path, name)`` reads one file of the checkpoint through the file readers (regular files only,
    its size recorded in ``files``, its failures in ``findings``); ``None`` for a file that could not be read.
    """

    read_entry: Callable[[str, str], Part | None]
    parts: list[Part] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    files: dict[str, int] = field(default_factory=dict)
    digests: dict[str, tuple[int, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class FileReader:
    """A reader of one file. ``read(probe, findings) -> Part | None`` (``None``: nothing readable, a finding
    says why). ``claims``: the name endings a directory listing reads as checkpoint files (``.safetensors``)."""

    name: str
    order: int
    recognises: Callable[[FileHead], bool]
    read: str
    claims: tuple[str, ...] = ()


@dataclass(frozen=True)
class DirectoryReader:
    """A reader of a directory that is one checkpoint. ``read(path, name, reading)``: ``name`` is the directory's
    name inside the checkpoint, ``""`` for the checkpoint itself. ``nested``: also read as a sub-directory of a
    plain directory of files (a DCP folder beside a Trainer's files)."""

    name: str
    order: int
    recognises: Callable[[str], bool]
    read: str
    nested: bool = False


class Registry:
    """Entries (anything with a ``name`` and an ``order``) registered, by kind (their class), by the modules of
    ``package`` as they are imported; :meth:`ordered` imports them all once (``packages_only``: only its
    sub-packages, whose ``__init__`` registers what their heavier modules implement) and lists one kind's entries
    in precedence order. One name, one entry; one place, one entry: precedence is never left to the order of
    discovery."""

    def __init__(self, what: str, package: str, *, packages_only: bool) -> None:
        self.what, self.package, self.packages_only = what, package, packages_only
        self._entries: dict[type, dict[str, Registered]] = {}
        self._discovered = False

    def register(self, entry: Registered) -> None:
        """Add ``entry`` (again: a no-op)."""
        table = self._entries.setdefault(type(entry), {})
        known = table.get(entry.name)
        if known is not None and known != entry:
            raise ValueError(f"two {self.what}s are named {entry.name!r}: {known} and {entry}; give the new one its "
                             "own name")
        clash = [n for n, e in table.items() if e.order == entry.order and n != entry.name]
        if clash:
            raise ValueError(f"{self.what} {entry.name!r} has order {entry.order}, as {clash[0]!r} has: the order is "
                             f"the {self.what}s' precedence, so two may not share it; give it its own place")
        table[entry.name] = entry

    def ordered(self, kind: type[E]) -> list[E]:
        """Every entry of ``kind``, in precedence order (the package's modules imported first, once)."""
        if not self._discovered:
            package = importlib.import_module(self.package)
            for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
                if info.ispkg or not self.packages_only:
                    importlib.import_module(f"{self.package}.{info.name}")
            self._discovered = True
        entries = [e for e in self._entries.get(kind, {}).values() if isinstance(e, kind)]
        return sorted(entries, key=lambda e: e.order)


READERS = Registry("reader", "ckptaudit.formats", packages_only=True)
"""The readers: :class:`FileReader` and :class:`DirectoryReader` entries, registered by the container packages."""


def register_reader(reader: FileReader | DirectoryReader) -> None:
    """Add ``reader`` to the registry (again: a no-op). Called by a container package's ``__init__.py``."""
    READERS.register(reader)


def file_readers() -> list[FileReader]:
    """The registered file readers, in precedence order."""
    return READERS.ordered(FileReader)


def directory_readers() -> list[DirectoryReader]:
    """The registered directory readers, in precedence order."""
    return READERS.ordered(DirectoryReader)


@functools.cache
def load_function(spec: str) -> Callable[..., Any]:
    """The function ``"module:function"`` names, its module imported on the first call (then remembered: the
    dispatcher and the layout driver resolve a reader or rule for every file and part)."""
    module, _, attr = spec.partition(":")
    fn: Callable[..., Any] = getattr(importlib.import_module(module), attr)
    return fn
