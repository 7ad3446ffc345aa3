"""Accelerate: audit every folder ``Accelerator.save_state`` writes. See ``docs/integrations/accelerate.md``.

    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration
    from ckptaudit.integrations.accelerate import guard_accelerator
    from ckptaudit.integrations.guard import Guard, stop_requested

    accelerator = Accelerator(project_config=ProjectConfiguration(
        project_dir="out", automatic_checkpoint_naming=True, total_limit=3))
    guard = guard_accelerator(accelerator, Guard(on_failure="stop"))   # every process
    for step, batch in enumerate(loader, 1):
        ...
        if step % 500 == 0:
            accelerator.save_state()                  # every process, as before: audited
        if stop_requested(guard):                     # every process, the same answer
            break
    guard.finish()                                    # raises CheckpointAuditFailed if a save failed (stop)

    accelerator.load_state()                          # the newest checkpoint_N: never one that failed

Which process runs what: :func:`guard_accelerator` replaces ``accelerator.save_state`` (on the instance) on every
process. Each call: the main process first waits while ``max_unverified`` saves are waiting for a verdict
(:func:`~ckptaudit.integrations.guard.before_save_everywhere`: the others wait beside it in rounds of one
tiny all-reduce; default 1 with ``on_failure="stop"``); every process runs Accelerate's own
``save_state`` (DDP, FSDP, single process: its files, unchanged); every process waits for the others
(``wait_for_everyone``: each has written its ``random_states_<i>.pkl`` and shards); then the main process queues
the folder for the audit, held to the master dtype of what the first prepared optimizer steps
(:func:`~ckptaudit.integrations.live_contract.declare_live_contract`).

Where things go. With ``automatic_checkpoint_naming``, ``load_state()`` takes the folder of ``checkpoints/``
whose name has the highest number, and it sorts *every* entry there by the digits in its name (an entry without
any breaks it): nothing of ckptaudit's may live in ``checkpoints/``. So the reports, the quarantined folders and
the pins go to ``<project_dir>/ckptaudit/``: ``ckptaudit/checkpoint_N.ckptaudit.json``; a failing
``checkpoints/checkpoint_N`` is moved to ``ckptaudit/quarantined-checkpoint_N`` (its report beside it), out of
``load_state``'s sight, so ``load_state()`` resumes from the newest folder that was not quarantined. The guard
also takes over ``total_limit`` (Accelerate's own rotation is turned off: ``project_configuration.total_limit =
None``) and applies it after each save and each verdict with :meth:`Guard.retention`'s rule: the ``total_limit``
newest folders stay, and so does the newest that passed, so the last good checkpoint is never deleted before a
newer one has passed. Without automatic naming, ``save_state(output_dir)``'s folder is audited where it is: the
report beside it, a failing folder renamed ``quarantined-<name>``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
from typing import Any

from ckptaudit.integrations.guard import REPORT_SUFFIX, Guard, before_save_everywhere, stop_requested
from ckptaudit.integrations.live_contract import declare_live_contract
from ckptaudit.integrations.pinning import PINS_DIR
from ckptaudit.ondisk.quarantine import QUARANTINE_PREFIX

__all__ = ["HOME", "guard_accelerator", "stop_requested"]

log = logging.getLogger("ckptaudit.guard")
HOME = "ckptaudit"
"""The folder of ``project_dir`` that holds the guard's reports, quarantined folders and pins (automatic naming)."""
_FOLDER = re.compile(r"^checkpoint_(\d+)$")
"""Accelerate's automatically named folders."""


def guard_accelerator(accelerator: Any, guard: Guard) -> Guard:
    """(every process) Audit every ``accelerator.save_state`` with ``guard``; returns ``guard``."""
    original = accelerator.save_state
    config = accelerator.project_configuration
    automatic = bool(config.automatic_checkpoint_naming)
    keep = int(config.total_limit) if automatic and config.total_limit else 0
    if keep:
        config.total_limit = None  # Accelerate's rotation would delete the last good folder before a newer passed
    lock = threading.Lock()
    if accelerator.is_main_process:
        guard.start()

    def home() -> str:
        return os.path.join(os.path.abspath(accelerator.project_dir), HOME)

    def report(path: str) -> str:
        return os.path.join(home(), os.path.basename(os.path.normpath(path)) + REPORT_SUFFIX)

    def quarantine_to(path: str) -> str:
        # A directory's quarantine name (formats.quarantine's), in the guard's folder rather than beside it.
        base = os.path.basename(os.path.normpath(path))
        dest, n = os.path.join(home(), f"{QUARANTINE_PREFIX}{base}"), 1
        while os.path.lexists(dest):
            n += 1
            dest = os.path.join(home(), f"{QUARANTINE_PREFIX}{n}-{base}")
        return dest

    def rotate() -> None:
        """(main process: training thread or guard worker) ``total_limit`` by :meth:`Guard.retention`'s rule."""
        folder = os.path.join(accelerator.project_dir, "checkpoints")
        if not keep or not os.path.isdir(folder):
            return
        with lock:
            found = sorted((int(m.group(1)), os.path.join(folder, n)) for n in os.listdir(folder)
                           if (m := _FOLDER.match(n)))
            for path in guard.retention([p for _, p in found], keep):
                shutil.rmtree(path, ignore_errors=True)
                if os.path.exists(report(path)):
                    os.remove(report(path))
                log.info("ckptaudit guard: deleted %s (total_limit=%d; a newer checkpoint has passed)", path, keep)

    def save_state(output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> Any:
        iteration = int(config.iteration) if automatic else None
        before_save_everywhere(guard, iteration)
        location = original(output_dir, safe_serialization=safe_serialization, **kwargs)
        accelerator.wait_for_everyone()  # every process's files are written before the main process audits
        if accelerator.is_main_process:
            path = os.fspath(location)
            optimizers = getattr(accelerator, "_optimizers", None)  # what save_state saved, in prepare()'s order
            if optimizers:
                declare_live_contract(guard, optimizers[0], f"Accelerate mixed_precision={accelerator.mixed_precision}")
            if automatic:
                os.makedirs(home(), exist_ok=True)
                guard.submit(path, step=iteration, report=report(path), quarantine_to=quarantine_to,
                             pins=os.path.join(home(), PINS_DIR), on_pass=lambda _: rotate())
                rotate()
            else:
                guard.submit(path)
        return location

    accelerator.save_state = save_state
    return guard
