"""The layout on disk of a checkpoint root written by :mod:`ckptaudit.store`: the names (which directory is
committed, which is a temporary one, the ``latest`` pointer) and how to read them. Pure; no writes here (the
durable-write primitives live with the writer, in :mod:`ckptaudit.store.durable`).

::

    ROOT/
      step-000002/            a committed checkpoint (the commit is the rename onto this name)
        .metadata             torch.distributed.checkpoint metadata (written by the coordinator)
        __0_0.distcp ...      one data file per rank (fsynced by the rank that wrote it)
        manifest.json         sizes + xxh3-128 of every file, tensor fingerprints, components, contract
      step-000004.partial-1a2b3c4d/
                              a save in progress, or one that never committed (never resumable)
      latest                  "step-000002\\n": a pointer, updated only after a commit; a hint, not the truth

A directory is committed exactly when it has a ``step-NNNNNN`` name; nothing but the coordinator's atomic
``rename`` gives it one, and only after every file in it is written and fsynced.
"""

from __future__ import annotations

import os
import re

from ckptaudit.formats.io.safeio import open_regular

__all__ = [
    "MANIFEST",
    "POINTER",
    "parse_step_name",
    "partial_name",
    "read_pointer",
    "step_name",
]

MANIFEST = "manifest.json"
POINTER = "latest"
STEP_DIGITS = 6

STEP_RE = re.compile(r"^step-(\d+)$")
TEMP_RE = re.compile(r"^step-(\d+)\.(partial|deleting|replaced)-([0-9a-f]+)$")


def step_name(step: int) -> str:
    """``step-000123``: zero-padded so that names sort like steps (torchtitan's ``step-N`` parses the same)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:0{STEP_DIGITS}d}"


def partial_name(step: int, tag: str) -> str:
    return f"{step_name(step)}.partial-{tag}"


def parse_step_name(name: str) -> tuple[int, str] | None:
    """``(step, kind)`` for ``step-N`` (kind ``committed``) and our temporary names (``partial``,
    ``deleting``, ``replaced``); ``None`` for anything else."""
    m = STEP_RE.match(name)
    if m:
        return int(m.group(1)), "committed"
    t = TEMP_RE.match(name)
    if t:
        return int(t.group(1)), t.group(2)
    return None


def read_pointer(root: str) -> str | None:
    """The directory name the ``latest`` pointer holds, or ``None`` (absent, unreadable or not a step name)."""
    try:
        # A regular file only, opened without blocking: a FIFO as the pointer must not hang `latest`.
        with open_regular(os.path.join(root, POINTER)) as fh:
            text = fh.read(256).decode("utf-8", "replace").strip()
    except OSError:
        return None
    return text if text and os.sep not in text and text not in (".", "..") else None
