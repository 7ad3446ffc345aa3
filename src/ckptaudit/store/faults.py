"""Fault injection for the writer: named points of a save where a test (or an operator) makes a rank fail.

The writer calls its hook at each point; with no hook it does one ``is None`` test per point (eight per save).
A hook is any ``Callable[[str], None]`` taking the point's name, or comes from the environment::

    CKPTAUDIT_FAULT="rank=7,point=write.partial,step=4,action=kill"

``rank`` and ``point`` are required; ``step`` (only that save) and ``action`` are optional. Actions: ``kill``
(``SIGKILL`` this process: a rank dying with no chance to clean up), ``stall`` (sleep for an hour: a rank that
hangs, which its peers detect only through the process group timeout), ``enospc`` (raise ``OSError(ENOSPC)``: a
full disk) and ``error`` (raise ``RuntimeError``).

Points, in the order a save reaches them (see :func:`ckptaudit.store.writer.save_checkpoint`):

==================  ======================  ============================================================
point               ranks                   the state on disk when it fires
==================  ======================  ============================================================
``collect``         all                     state collected; nothing written yet for this step
``write.partial``   all                     this rank's data file is open, about half its items written
``write.done``      all                     this rank's data files written and fsynced
``report``          all                     DCP done (``.metadata`` in the temporary directory); this
                                            rank hashed its files and is about to report them
``commit.wait``     all but the coordinator report sent; the coordinator is writing the manifest
``commit.manifest`` coordinator             manifest written and fsynced; not yet renamed
``commit.renamed``  coordinator             ``step-N/`` renamed into place; ``latest`` pointer not updated
``commit.pointer``  coordinator             pointer updated; retention not yet run
==================  ======================  ============================================================
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable

__all__ = ["ENV_VAR", "POINTS", "FaultHook", "hook_from_env", "parse_fault"]

ENV_VAR = "CKPTAUDIT_FAULT"

POINTS = ("collect", "write.partial", "write.done", "report", "commit.wait", "commit.manifest", "commit.renamed",
          "commit.pointer")
ACTIONS = ("kill", "stall", "enospc", "error")

FaultHook = Callable[[str], None]
"""Called with the point's name on the rank that registered it."""


def _act(action: str, point: str) -> None:
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stall":
        time.sleep(3600)
    elif action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {point})")
    else:
        raise RuntimeError(f"injected fault at {point}")


def parse_fault(spec: str) -> tuple[int, str, int | None, str]:
    """Parse ``rank=R,point=P[,step=S][,action=A]``; ``ValueError`` names the bad field and the choices."""
    fields: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in ("rank", "point", "step", "action"):
            raise ValueError(f"{ENV_VAR}={spec!r}: {item!r} is not one of rank=, point=, step=, action=")
        fields[key] = value
    if "rank" not in fields or "point" not in fields:
        raise ValueError(f"{ENV_VAR}={spec!r}: rank= and point= are required, e.g. rank=7,point=write.partial")
    if fields["point"] not in POINTS:
        raise ValueError(f"{ENV_VAR}={spec!r}: point {fields['point']!r} is not one of {', '.join(POINTS)}")
    action = fields.get("action", "kill")
    if action not in ACTIONS:
        raise ValueError(f"{ENV_VAR}={spec!r}: action {action!r} is not one of {', '.join(ACTIONS)}")
    try:
        rank = int(fields["rank"])
        step = int(fields["step"]) if "step" in fields else None
    except ValueError:
        raise ValueError(f"{ENV_VAR}={spec!r}: rank and step must be integers") from None
    return rank, fields["point"], step, action


def hook_from_env(rank: int, step: int) -> FaultHook | None:
    """The hook ``CKPTAUDIT_FAULT`` asks for on this rank and step, or ``None`` (the normal case)."""
    spec = os.environ.get(ENV_VAR)
    if not spec:
        return None
    want_rank, want_point, want_step, action = parse_fault(spec)
    if want_rank != rank or (want_step is not None and want_step != step):
        return None

    def hook(point: str) -> None:
        if point == want_point:
            _act(action, point)

    return hook
