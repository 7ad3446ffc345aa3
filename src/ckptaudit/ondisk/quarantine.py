"""The names of checkpoints the in-loop guard (:mod:`ckptaudit.integrations`) found failing, and of its reports.

On-disk names, like the writer's ``step-N`` (a convention every reader of a checkpoint root shares: the guard
writes them, ``ckptaudit latest`` honours them).
"""

from __future__ import annotations

import os
import re

__all__ = ["MARKER_SUFFIX", "QUARANTINE_PREFIX", "QUARANTINE_SUFFIX", "REPORT_SUFFIX", "is_quarantined", "marked_original",
           "marker_name", "quarantine_name", "quarantined_original"]

QUARANTINE_PREFIX = "quarantined-"
"""A directory the in-loop guard (:mod:`ckptaudit.integrations`) found failing becomes ``quarantined-<name>``:
no resume path's pattern (``checkpoint-N``, ``step-N``, ``global_stepN``) matches it, nor Trainer's rotation
glob ``checkpoint-*``."""
QUARANTINE_SUFFIX = ".quarantined"
"""A failing file becomes ``<name>.quarantined`` (no longer ``*.ckpt``)."""
REPORT_SUFFIX = ".ckptaudit.json"
"""The in-loop guard writes each checkpoint's JSON report beside it: ``<checkpoint>.ckptaudit.json``."""
MARKER_SUFFIX = ".ckptaudit-quarantine.json"
"""A checkpoint behind an object-store URL that the guard found failing stays where it is (a store has no rename;
see :mod:`ckptaudit.integrations.guard_remote` for why nothing is copied or deleted) and gets a marker object beside
it: ``<checkpoint>.ckptaudit-quarantine.json`` (the verdict, its codes, the report, the objects judged).
``ckptaudit latest`` treats a checkpoint with a marker beside it as quarantined, on a local copy as on the store."""
_QUARANTINED_DIR = re.compile(r"^quarantined-(?:\d+-)?(.+)$")


def quarantine_name(path: str) -> str:
    """Where a failing checkpoint is moved (see :data:`QUARANTINE_PREFIX`, :data:`QUARANTINE_SUFFIX`); a free
    name (``quarantined-2-<name>``, ``<name>.quarantined-2``, ...) when one is taken."""
    path = os.path.normpath(path)
    parent, name = os.path.split(path)
    is_dir = os.path.isdir(path)
    n = 1
    while True:
        if is_dir:
            dest = os.path.join(parent, f"{QUARANTINE_PREFIX}{'' if n == 1 else f'{n}-'}{name}")
        else:
            dest = f"{path}{QUARANTINE_SUFFIX}{'' if n == 1 else f'-{n}'}"
        if not os.path.lexists(dest):
            return dest
        n += 1


def quarantined_original(name: str) -> str | None:
    """The name a quarantined checkpoint had (``quarantined-checkpoint-4`` -> ``checkpoint-4``), or ``None``
    when ``name`` is not a quarantine name (a guard's report, ``*.ckptaudit.json``, is not one)."""
    if name.endswith(REPORT_SUFFIX):
        return None
    m = _QUARANTINED_DIR.match(name)
    if m:
        return m.group(1)
    if QUARANTINE_SUFFIX in name:
        return name[: name.rindex(QUARANTINE_SUFFIX)]
    return None


def marker_name(checkpoint: str) -> str:
    """The quarantine marker of ``checkpoint`` (a path or URL; a folder's trailing ``/`` dropped)."""
    return checkpoint.rstrip("/") + MARKER_SUFFIX


def marked_original(name: str) -> str | None:
    """The checkpoint a quarantine marker's name marks (``step-8.ckptaudit-quarantine.json`` -> ``step-8``), or
    ``None`` when ``name`` is no marker."""
    return (name[: -len(MARKER_SUFFIX)] or None) if name.endswith(MARKER_SUFFIX) else None


def is_quarantined(name: str) -> bool:
    return quarantined_original(name) is not None
