"""torchtitan: audit each ``step-N`` its ``CheckpointManager`` saves. See ``docs/integrations/torchtitan.md``.

    from ckptaudit.integrations.guard import Guard, stop_requested
    from ckptaudit.integrations.torchtitan import guard_checkpoint_manager

    guard = Guard(on_failure="stop")                        # on every rank; only rank 0 audits
    checkpointer = guard_checkpoint_manager(CheckpointManager(config, ...), guard)
    for step in range(1, steps + 1):
        train_step(...)
        checkpointer.save(step, last_step=step == steps)   # all ranks, as before
        if stop_requested(guard):                           # all ranks, the same answer
            break
    guard.finish()                                          # raises CheckpointAuditFailed if a save failed (stop)

Which ranks run what: every rank calls ``manager.save`` as before (collective, torchtitan's own DCP save). Rank 0
first waits, when ``max_unverified`` saves are still waiting for a verdict (:func:`~ckptaudit.integrations.guard.before_save_everywhere`, the other ranks beside it); after
``save`` returns ``True`` (a checkpoint was written), rank 0 queues ``<folder>/step-N`` for the audit. A failing
``step-N`` is renamed ``quarantined-step_N``: torchtitan's ``_find_load_step`` (``manager.load()``, newest step)
and its purge search the names for ``step-<digits>`` anywhere, so the quarantine name must not contain it;
``ckptaudit latest`` lists it as ``guard.quarantined``. For the same reason the report is
``<folder>/step_N.ckptaudit.json`` (a ``step-N.ckptaudit.json`` would be counted, and deleted, by the purge), and
the pins' folder ``.ckptaudit-pins``.

Retention: the guard takes over ``keep_latest_k`` (the manager's own purge is turned off:
``manager.keep_latest_k = 0``) and applies it on rank 0 after each save and each verdict with
:meth:`Guard.retention`'s rule: the ``k`` newest stay, and so does the newest that passed, so the last good
checkpoint is never purged before a newer one has passed; the reports go with the checkpoints they describe.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
from typing import Any

from ckptaudit.integrations.guard import (
    REPORT_SUFFIX,
    Guard,
    before_save_everywhere,
    quarantine_name,
    report_path,
    stop_requested,
)
from ckptaudit.integrations.live_contract import declare_live_contract

__all__ = ["guard_checkpoint_manager", "quarantine", "quarantine_to", "stop_requested"]

log = logging.getLogger("ckptaudit.guard")
_STEP = re.compile(r"step-(\d+)")
"""What torchtitan's load and purge look for in a name (``re.search``: anywhere in it)."""


def guard_checkpoint_manager(manager: Any, guard: Guard) -> Any:
    """(all ranks) Wrap ``manager.save`` (an instance attribute over the method) so that every checkpoint it
    writes is audited, and take over its ``keep_latest_k``; returns ``manager``. With ``async_mode="async"`` (or
    ``"async_with_pinned_mem"``) the files are still being written when ``save`` returns: rank 0 queues the audit
    with the save's future (``manager.save_future``), and the guard's worker waits for it, never the training
    loop."""
    if not getattr(manager, "enable", False):
        return manager
    original = manager.save
    keep = int(getattr(manager, "keep_latest_k", 0) or 0)
    if keep > 0:
        manager.keep_latest_k = 0  # torchtitan's purge would delete the last good step-N before a newer passes
    lock = threading.Lock()
    if _rank() == 0:
        guard.start()

    def purge() -> None:
        """(rank 0: training thread or guard worker) ``keep_latest_k`` by :meth:`Guard.retention`'s rule."""
        if keep <= 0 or not os.path.isdir(manager.folder):
            return
        with lock:
            found = sorted((int(m.group(1)), os.path.join(manager.folder, n)) for n in os.listdir(manager.folder)
                           if (m := _STEP.search(n)) and not n.endswith(REPORT_SUFFIX))
            for path in guard.retention([p for _, p in found], keep):
                shutil.rmtree(path, ignore_errors=True)
                step = _STEP.search(os.path.basename(path))
                assert step is not None
                for report in (_report(manager.folder, int(step.group(1))), report_path(path)):
                    if os.path.exists(report):
                        os.remove(report)
                log.info("ckptaudit guard: purged %s (keep_latest_k=%d; a newer checkpoint has passed)", path, keep)

    def will_save(curr_step: int, last_step: bool) -> bool:
        # torchtitan's own decision (interval, last step, first step), so that only a step that saves waits for
        # the bound; without it the wait happens in submit, after the write.
        decide = getattr(manager, "_should_save", None)
        return bool(decide(curr_step, last_step)) if callable(decide) else False

    def save(curr_step: int, last_step: bool = False) -> bool:
        if will_save(curr_step, last_step):  # the same on every rank
            before_save_everywhere(guard, curr_step)
        written = bool(original(curr_step, last_step))
        if written and _rank() == 0:
            if last_step and (getattr(manager, "last_save_model_only", False)
                              or getattr(manager, "last_save_in_hf", False)):
                log.info("ckptaudit guard: the last save of step %d is model-only (last_save_model_only / "
                         "last_save_in_hf), not a training checkpoint; not audited", curr_step)
            else:
                states = getattr(manager, "states", None)
                if isinstance(states, dict) and states.get("optimizer") is not None:
                    declare_live_contract(guard, states["optimizer"], "torchtitan")
                # Asynchronous modes: rank 0's future completes once every rank has written and rank 0 (the
                # coordinator) has written .metadata; synchronous: None, the files are complete.
                guard.submit(os.path.join(manager.folder, f"step-{curr_step}"), step=curr_step,
                             quarantine_to=quarantine_to, report=_report(manager.folder, curr_step),
                             ready=getattr(manager, "save_future", None), on_pass=lambda _: purge())
            purge()
        return written

    manager.save = save
    return manager


def _report(folder: str, step: int) -> str:
    return os.path.join(folder, f"step_{step}{REPORT_SUFFIX}")


def quarantine_to(path: str) -> str:
    """Where a failing ``step-N`` goes: ``quarantined-step_N`` (no ``step-<digits>`` left for torchtitan)."""
    parent, name = os.path.split(quarantine_name(path))
    dest = os.path.join(parent, name.replace("step-", "step_"))
    n = 1
    while os.path.lexists(dest):
        n += 1
        dest = os.path.join(parent, f"{name.replace('step-', 'step_')}-{n}")
    return dest


def quarantine(path: str) -> str:
    """Move a failing ``step-N`` to :func:`quarantine_to`'s name; returns where it went."""
    dest = quarantine_to(path)
    shutil.move(path, dest)
    return dest


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
