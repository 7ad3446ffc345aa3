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
    guard.close()

Which ranks run what: every rank calls ``manager.save`` as before (collective, torchtitan's own DCP save); after
it returns ``True`` (a checkpoint was written), rank 0 queues ``<folder>/step-N`` for the audit. A failing
``step-N`` is renamed ``quarantined-step_N``: torchtitan's ``_find_load_step`` (``manager.load()``, newest step)
and its purge search the names for ``step-<digits>`` anywhere, so the quarantine name must not contain it;
``ckptaudit latest`` lists it as ``guard.quarantined``. For the same reason the report is
``<folder>/step_N.ckptaudit.json`` (a ``step-N.ckptaudit.json`` would be counted, and deleted, by the purge).
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from ckptaudit.integrations.guard import REPORT_SUFFIX, Guard, quarantine_name, stop_requested
from ckptaudit.integrations.live_contract import declare_live_contract

__all__ = ["guard_checkpoint_manager", "quarantine", "stop_requested"]

log = logging.getLogger("ckptaudit.guard")


def guard_checkpoint_manager(manager: Any, guard: Guard) -> Any:
    """(all ranks) Wrap ``manager.save`` (an instance attribute over the method) so that every checkpoint it
    writes is audited; returns ``manager``. With ``async_mode="async"`` (or ``"async_with_pinned_mem"``) the
    files are still being written when ``save`` returns: rank 0 queues the audit with the save's future
    (``manager.save_future``), and the guard's worker waits for it, never the training loop."""
    if not getattr(manager, "enable", False):
        return manager
    original = manager.save

    def save(curr_step: int, last_step: bool = False) -> bool:
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
                             quarantine=quarantine,
                             report=os.path.join(manager.folder, f"step_{curr_step}{REPORT_SUFFIX}"),
                             ready=getattr(manager, "save_future", None))
        return written

    manager.save = save
    return manager


def quarantine(path: str) -> str:
    """(guard worker) ``step-N`` -> ``quarantined-step_N``: no ``step-<digits>`` left for torchtitan to find."""
    generic = quarantine_name(path)
    parent, name = os.path.split(generic)
    dest = os.path.join(parent, name.replace("step-", "step_"))
    n = 1
    while os.path.lexists(dest):
        n += 1
        dest = os.path.join(parent, f"{name.replace('step-', 'step_')}-{n}")
    shutil.move(path, dest)
    return dest


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
