"""The reader interface: a checkpoint is a set of parts, each an object tree with lazy tensor leaves.

Every reader turns one file or directory into a :class:`Part`; :func:`ckptaudit.formats.open_checkpoint`
collects the parts of a path into a :class:`Checkpoint`. Interpreting the trees (which part is the model,
which the optimizer) is :mod:`ckptaudit.layouts`' job, not the readers'.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ckptaudit.findings import Finding
from ckptaudit.formats.io.tensors import FileMaps

__all__ = ["Checkpoint", "Part", "Unreadable", "walk"]


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A leaf whose value could not be read, and why (the matching finding is in the checkpoint)."""

    reason: str
    file: str = ""


@dataclass(frozen=True, slots=True)
class Part:
    """One file (or one DCP directory) of a checkpoint, read into an object tree."""

    name: str
    """Path relative to the audited path; ``""`` when the audited path is this file itself."""
    format: str
    """``torch.save``, ``safetensors``, ``dcp``, ``json``, ``pickle`` or ``unknown``."""
    tree: Any
    """Nested dicts/lists with :class:`TensorData`, :class:`Unreadable` and plain-value leaves; ``None``
    when the part was not loaded (see the findings)."""
    metadata: dict[str, str] = field(default_factory=dict)
    """Format-level metadata (safetensors ``__metadata__``)."""
    order_known: bool = True
    """Whether the tree's key order is the order the writer saw (false for safetensors: sorted by offset)."""


@dataclass
class Checkpoint:
    """Everything read from one path. Owns the memory maps of its files: use it as a context manager."""

    path: str
    format: str
    parts: list[Part]
    findings: list[Finding]
    files: dict[str, int] = field(default_factory=dict)
    """Every file that belongs to the checkpoint (relative path -> size in bytes)."""
    maps: FileMaps = field(default_factory=FileMaps)
    digests: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Files parsed whole as metadata (DCP ``.metadata``): relative path -> size and xxh3-128 (hex) of the bytes
    parsed. A distributed audit's ranks check their own view of these files against it
    (:mod:`ckptaudit.auditing.distributed`)."""
    local_path: str = ""
    """The local path the files were read from, when ``path`` is a URL (its stand-in, see
    :mod:`ckptaudit.formats.remote.staging`); ``""`` otherwise. Use :attr:`read_path` for file paths."""

    _names: dict[str, str] = field(default_factory=dict, init=False, repr=False, compare=False)
    _is_dir: bool | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def read_path(self) -> str:
        """The local path the checkpoint's files are under: ``local_path`` or ``path``."""
        return self.local_path or self.path

    def file_name(self, file: str) -> str:
        """How the report names the data file ``file`` (a path the readers opened): relative to the checkpoint's
        directory, or its base name for a single-file checkpoint. Worked out once per file (a DCP file holds
        thousands of tensors)."""
        name = self._names.get(file)
        if name is None:
            if self._is_dir is None:  # asked once
                self._is_dir = os.path.isdir(self.read_path)
            name = os.path.relpath(file, self.read_path) if self._is_dir else os.path.basename(file)
            self._names[file] = name
        return name

    def close(self) -> None:
        self.maps.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def walk(tree: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Yield ``(path, leaf)`` for every leaf of a nested dict/list/tuple tree, in order."""
    if isinstance(tree, dict):
        for k, v in dict.items(tree):  # the data, never a method a pickle could shadow
            yield from walk(v, (*prefix, k))
    elif isinstance(tree, list | tuple) and not _is_rng_tuple(tree):
        for i, v in enumerate(tree):
            yield from walk(v, (*prefix, i))
    else:
        yield prefix, tree


def _is_rng_tuple(value: Any) -> bool:
    # Python's random.getstate() is a tuple of 625 ints; walking it leaf by leaf is pointless.
    return isinstance(value, tuple) and len(value) > 64 and all(isinstance(v, int) for v in value[:8])


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for the block (opening and interpreting a checkpoint).

    An open allocates a million small objects that all stay alive (the DCP ``.metadata`` of an 8-rank save:
    records for 7301 items) and creates no garbage cycles to speak of, so every collection the allocations
    trigger walks a growing heap for nothing: 100-250 ms of the 0.6-0.9 s that open took
    (bench/README.md, "The collector paused"). The collector is switched back on afterwards if it was on before; a thread that runs
    meanwhile only sees collections come later. Memory stays bounded by the readers' own limits, as the
    objects are live until the open returns anyway.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
