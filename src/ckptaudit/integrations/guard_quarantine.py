"""The guard's quarantine: a failing checkpoint moved where no resume path picks it, and the error that ends the run.

Which thread runs what: :func:`quarantine` on the guard's worker thread, after a failing verdict, or after a passing
one whose training state descends from damage (the lineage, :mod:`~ckptaudit.integrations.guard_lineage`: the library
would resume from it by name otherwise);
:func:`failure_message` wherever :meth:`Guard.failure <ckptaudit.integrations.guard.Guard.failure>` is asked.
Importable from :mod:`ckptaudit.integrations.guard` (``quarantine_name``, ``is_quarantined``).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Sequence

from ckptaudit.integrations.guard_lineage import SaveRecord
from ckptaudit.integrations.guard_records import Verdict
from ckptaudit.ondisk.quarantine import quarantine_name

__all__ = ["descendant_advice", "descends_why", "failure_message", "quarantine"]

log = logging.getLogger("ckptaudit.guard")


def quarantine(checkpoint: str, source: str, quarantine_to: Callable[[str], str] | None,
               after_quarantine: Callable[[str, str], None] | None, why: str = "failed its audit") -> str | None:
    """(worker) Move ``source`` (the checkpoint, or its pinned bytes when the path was replaced since) to
    ``quarantine_to(checkpoint)`` (default :func:`quarantine_name`, beside it), then let the integration repair its
    pointers (``after_quarantine``, only when ``source`` is the checkpoint itself). Returns where it went, or
    ``None`` when it could not be moved (logged as an error, saying ``why`` it was to move: do not resume from
    it)."""
    try:
        dest = (quarantine_to or quarantine_name)(checkpoint)
        os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
        shutil.move(source, dest)
    except Exception as exc:  # noqa: BLE001
        log.error("ckptaudit guard: %s %s and could NOT be quarantined (%s: %s); do not resume from it",
                  checkpoint, why, type(exc).__name__, exc)
        return None
    if source == checkpoint and after_quarantine is not None:
        try:
            after_quarantine(checkpoint, dest)
        except Exception as exc:  # noqa: BLE001
            log.error("ckptaudit guard: %s was quarantined to %s, but repairing the library's pointer failed (%s: "
                      "%s)", checkpoint, dest, type(exc).__name__, exc)
    return dest


def descends_why(ancestor: str) -> str:
    """Why a checkpoint that passed its own audit is moved aside (the log's words)."""
    return (f"passed its own audit, but its training state descends from the damage at {ancestor} (its masters "
            "were rounded in memory there)")


def descendant_advice(ancestor: str, moved: str | None, good: SaveRecord | None, *, marked: bool = False) -> str:
    """(worker) What a descendant of a damaged training state's verdict says: which failed ancestor it descends
    from, where it went (``marked``: ``moved`` is the quarantine marker of an object left in place), and which way
    to go."""
    back = (f"restore {good.checkpoint}" + (f" (step {good.step})" if good.step is not None else "")
            + ", the last checkpoint that passed," if good is not None else
            "restore a checkpoint saved before this run (none passed in it)")
    where = (f"marked quarantined in place by {moved} (an object store has no rename)" if marked and moved else
             f"moved aside to {moved} so that no resume by name picks it" if moved is not None else
             "it could NOT be moved aside: do not resume from it")
    return (f"its training state descends from the damage at {ancestor} (that save failed its audit while the live "
            f"masters were rounded in memory; this one trained on from them): {where}. "
            f"{back[0].upper()}{back[1:]} and fix the training code that rounds the masters; every later save is "
            "set aside the same way until the run restores a checkpoint that passed")


def failure_message(failed: Sequence[Verdict], set_aside: Sequence[Verdict] = ()) -> str:
    """The text of :class:`~ckptaudit.integrations.guard.CheckpointAuditFailed`: each failing checkpoint, where it
    went, and which way to go (fix the save, or restore and fix the training code)."""
    if not failed:
        return ("ckptaudit guard (on_failure='stop'): a checkpoint saved during training failed its audit on the "
                "process that audits (rank 0), and was quarantined; training stopped. Rank 0's log (logger "
                "ckptaudit.guard) names it and its report")
    lines = [f"ckptaudit guard (on_failure='stop'): {len(failed)} checkpoint(s) saved during training failed their "
             "audit; training stopped:"]
    for v in failed:
        where = f" -> quarantined to {v.quarantined_to}" if v.quarantined_to else " (not kept: " + v.note + ")"
        lines.append(f"  {v.checkpoint}{f' (step {v.step})' if v.step is not None else ''}: "
                     f"{', '.join(sorted(set(v.codes)))}{where}; report: {v.report}")
        if v.advice:
            lines.append(f"    {v.advice}")
    if set_aside:
        lines.append(f"{len(set_aside)} later checkpoint(s) passed their own audit but descend from the damaged "
                     "training state, and were moved aside too:")
        lines += [f"  {v.checkpoint}{f' (step {v.step})' if v.step is not None else ''}: descends from "
                  f"{v.damaged_ancestor}" + (f" -> quarantined to {v.quarantined_to}" if v.quarantined_to else
                                             " (could NOT be moved: do not resume from it)") for v in set_aside]
    lines.append("The library's own resume path skips quarantined checkpoints; `ckptaudit latest DIR` names the "
                 "newest that can be resumed (passing over checkpoints that descend from a damaged training state). "
                 + ("Each failure above says which way to go before resuming." if any(v.advice for v in failed)
                    else "Fix the save (the report says what is wrong) before resuming."))
    return "\n".join(lines)
