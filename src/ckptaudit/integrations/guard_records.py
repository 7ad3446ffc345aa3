"""The guard's records: the verdict of one checkpoint, a save that waited, a kept checkpoint, the error that ends a
run whose checkpoint failed, and where a report goes. Importable from :mod:`ckptaudit.integrations.guard`."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ckptaudit.ondisk.quarantine import REPORT_SUFFIX

__all__ = ["BACKGROUNDS", "ON_FAILURE", "CheckpointAuditFailed", "Kept", "SaveWait", "Verdict", "report_path"]

ON_FAILURE = ("warn", "stop")
BACKGROUNDS = ("thread", "process")


def report_path(checkpoint: str) -> str:
    """Where the guard writes the report of ``checkpoint``: beside it, ``<checkpoint>.ckptaudit.json``."""
    return os.path.normpath(checkpoint) + REPORT_SUFFIX



@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of one checkpoint's audit in the loop."""

    checkpoint: str
    """The path audited (where the library saved it)."""
    step: int | None
    ok: bool | None
    """``True`` passed, ``False`` failed, ``None`` not judged (the audit could not run, or the bytes it read may
    not be the bytes saved: see ``error``)."""
    summary: str
    codes: tuple[str, ...]
    """The codes of the findings at or above ``fail_on``."""
    report: str | None
    """Where the JSON report lies (after any quarantine), or ``None``."""
    quarantined_to: str | None
    """Where a failing checkpoint was moved; behind an object-store URL, its quarantine marker (left in place)."""
    seconds: float
    """Wall time of the audit on the worker."""
    queued_s: float
    """Time between the save and the start of its audit (waiting behind earlier audits)."""
    error: str = ""
    note: str = ""
    """What happened to the checkpoint's path between the save and the verdict, when anything did: replaced by
    newer content (the verdict is the saved content's) or deleted (no report is left behind)."""
    damage: str = ""
    """For a failure, what it damaged, from the live check at its save point: ``"state"`` (the live masters held
    only 16-bit values: the training state itself; every later save descends from it), ``"file"`` (the live
    masters kept their bits: only the saved file; later saves are not tainted) or ``"unknown"`` (the guard saw
    no optimizer). Empty for a pass."""
    advice: str = ""
    """For a failure: which of the two failed, and which way to go (fix the save, or restore and fix training)."""
    passport: str | None = None
    """Where the guard wrote the checkpoint's passport (a pass, ``Guard(passport=True)``), or ``None``."""
    damaged_ancestor: str | None = None
    """For a checkpoint that descends from a damaged training state: the save whose failure damaged it (its name
    relative to the run). Such a checkpoint may pass on its own; it is not one to resume from."""


@dataclass(frozen=True, slots=True)
class SaveWait:
    """A save that waited at :meth:`Guard.before_save` because ``max_unverified`` save points were unverified."""

    step: int | None
    seconds: float
    unverified: int
    """Save points waiting for a verdict when the wait began."""


@dataclass(frozen=True, slots=True)
class Kept:
    """A checkpoint's newest passing content, kept by the guard (:meth:`Guard.kept`)."""

    path: str
    """The pinned copy (the guard's hard link; copy it, never write to it)."""
    step: int | None
    report: str
    """A copy of its JSON report."""


class CheckpointAuditFailed(RuntimeError):
    """Raised at the end of training, with ``on_failure="stop"``, when a checkpoint saved during it failed its audit.

    Raised on every rank, after the last audit has finished and every failing checkpoint is quarantined (the
    library's own resume path skips it): by the Trainer and Lightning callbacks at the end of ``train()`` /
    ``fit()``, and by :meth:`Guard.finish` in the loops that call it. ``failed`` holds the failing verdicts on
    the rank that audited (empty on the others).
    """

    def __init__(self, message: str, failed: tuple[Verdict, ...] = ()) -> None:
        super().__init__(message)
        self.failed = failed
