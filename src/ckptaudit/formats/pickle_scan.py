"""Walking a pickle's opcodes without executing them: every global it references, and whether it may be loaded.

:func:`scan` walks the opcodes (decoding, never executing) with a symbolic stack and memo, so it resolves every
global the pickle references, also through ``STACK_GLOBAL`` and memo indirections, and reports those outside the
allowlist (:mod:`ckptaudit.formats.allowlist`). Declared lengths are checked against the bytes that remain before
anything is read (a ``BINBYTES8`` claiming terabytes is an error, not an allocation), long byte strings are
skipped rather than read, memo indices may not run ahead of the opcodes, and opcode count and stack depth have
hard limits (:mod:`ckptaudit.formats.pickle_limits`, shared with the restricted unpickler,
:mod:`ckptaudit.formats.unpickler`, and re-exported here). The walk itself is :mod:`ckptaudit.formats.pickle_walk`,
its opcode tables :mod:`ckptaudit.formats.pickle_ops`.
"""

from __future__ import annotations

import io
import re
import struct
from dataclasses import dataclass, field
from typing import IO

from ckptaudit.formats.allowlist import ALL_SAFE, HARMLESS_GLOBALS
from ckptaudit.formats.pickle_limits import (
    BUILD_BUDGET_BASE,
    BUILD_BUDGET_CAP,
    BUILD_BUDGET_FACTOR,
    CALL_BUDGET_FACTOR,
    MAX_DEPTH,
    MAX_HASH_COLLISIONS,
    MAX_INLINE,
    MAX_KEY_NODES,
    MAX_LINE,
    MAX_NODES,
    MAX_OPCODES,
    MAX_STACK,
    PickleLimitError,
    UnsafeBuildError,
    UnsafeGlobalError,
    build_budget,
    opcode_limit,
)
from ckptaudit.formats.pickle_ops import PLAIN_OPCODES
from ckptaudit.formats.pickle_walk import ScanError, Walker

__all__ = [
    "BUILD_BUDGET_BASE",
    "BUILD_BUDGET_CAP",
    "BUILD_BUDGET_FACTOR",
    "CALL_BUDGET_FACTOR",
    "MAX_DEPTH",
    "MAX_HASH_COLLISIONS",
    "MAX_INLINE",
    "MAX_KEY_NODES",
    "MAX_LINE",
    "MAX_NODES",
    "MAX_OPCODES",
    "MAX_STACK",
    "PLAIN_OPCODES",
    "PickleLimitError",
    "PickleScan",
    "UnsafeBuildError",
    "UnsafeGlobalError",
    "build_budget",
    "may_name_global",
    "opcode_limit",
    "scan",
]


@dataclass(frozen=True, slots=True)
class PickleScan:
    """What one pickle references, read at the opcode level."""

    globals: tuple[str, ...]
    """Every global, ``module.name``, in order of first appearance."""
    unsafe: tuple[str, ...]
    """Globals outside the allowlist and outside :data:`HARMLESS_GLOBALS`, and harmless ones misused."""
    harmless: tuple[str, ...]
    """Globals outside the allowlist that :data:`HARMLESS_GLOBALS` names, used as documented: not loaded, not
    a threat."""
    error: str | None = None
    """Why the opcodes could not be walked to the end (truncated, malformed or over a limit)."""
    error_offset: int | None = None
    """Byte offset of the opcode where the walk stopped (relative to the pickle's start in its stream)."""
    end: int = 0
    """Offset just past the ``STOP`` opcode (where a following pickle starts)."""
    limit: bool = False
    """The error is a safety limit of the scanner (the pickle may be well-formed but too large to vet)."""
    misused: tuple[str, ...] = field(default=())
    """Harmless globals called in a way their own pickling never does (they are also in ``unsafe``)."""
    plain: bool = False
    """The walk proved the pickle *plain* (see :data:`PLAIN_OPCODES`): an in-memory pickle of protocol 3 or
    later that uses only the opcodes of containers, short constants, memo, globals, ``REDUCE`` and ``NEWOBJ`` of
    a global, and ``BUILD`` once on each object ``NEWOBJ`` made; whose dict keys are all strings or objects
    ``NEWOBJ`` made (so no key hash can be steered into collisions); and whose objects, estimated at CPython's
    sizes, stay within the build budget. Such a pickle may be loaded by the C unpickler with a restricted
    ``find_class`` (:func:`ckptaudit.formats.dcp_metadata.load_dcp_metadata`): every other defence of the
    restricted unpickler is then already guaranteed by the walk."""

    @property
    def loadable(self) -> bool:
        return self.error is None and not self.unsafe and not self.harmless



def scan(data: bytes | bytearray | memoryview | IO[bytes], allowed: frozenset[str] = ALL_SAFE, *,
         max_opcodes: int = MAX_OPCODES) -> PickleScan:
    """Walk one pickle's opcodes (never executing them) and classify every global it references.

    ``data`` is the pickle's bytes or a seekable stream positioned at its start; a stream is left just past
    ``STOP`` (or where the walk stopped). Offsets in the result are positions in the stream.
    """
    buf = None
    if isinstance(data, bytes | bytearray | memoryview):
        buf = data if isinstance(data, bytes) else bytes(data)
        stream: IO[bytes] = io.BytesIO(buf)
    else:
        stream = data
    walker = Walker(stream, allowed, max_opcodes, buf)
    error: str | None = None
    error_offset: int | None = None
    limit = False
    try:
        walker.run()
    except ScanError as exc:
        error, limit = str(exc), exc.limit
    except (ValueError, struct.error, UnicodeDecodeError, OverflowError) as exc:
        # pickletools' line readers reject malformed numbers and quotes with ValueError.
        error = f"malformed argument ({exc})"
    if error is not None:
        error_offset = walker.op_at
    end = stream.tell()
    names = tuple(walker.found)
    misused = tuple(walker.misused)
    unsafe: list[str] = []
    harmless: list[str] = []
    for n in names:
        if n in allowed:
            continue
        if n in HARMLESS_GLOBALS and n not in walker.misused:
            harmless.append(n)
        else:
            unsafe.append(n)
    plain = (error is None and walker.plain
             and walker.cost <= build_budget(end - walker.start))
    return PickleScan(names, tuple(unsafe), tuple(harmless), error, error_offset, end, limit, misused, plain)




_GLOBAL_OPCODES = re.compile(rb"[\n\x82\x83\x84\x93]")
"""A pickle reaches a global (what any code it runs needs) only through ``GLOBAL``/``INST`` (whose arguments end in
newlines), ``STACK_GLOBAL`` or ``EXT1``/``EXT2``/``EXT4``."""


def may_name_global(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data``, read as a pickle from any byte, could reference a global: ``False`` proves it cannot
    (it holds none of the bytes those opcodes need), so it needs no :func:`scan`."""
    return _GLOBAL_OPCODES.search(data) is not None
