"""ckptaudit's own writer (:mod:`ckptaudit.store`): the ``latest`` pointer and retention wait for the audit.
See ``docs/integrations/store.md``.

    from ckptaudit.integrations.guard import Guard, stop_requested
    from ckptaudit.integrations.store import save_checkpoint

    guard = Guard(on_failure="stop")                                  # on every rank; only rank 0 audits
    for step in ...:
        train_step()
        if step % 500 == 0:
            save_checkpoint(job, "ckpts", guard=guard, keep_last=3)   # all ranks, collective
        if stop_requested(guard):                                      # all ranks agree at the step boundary
            break
    guard.finish()                                                     # raises CheckpointAuditFailed (stop)

Which ranks run what: every rank calls :func:`save_checkpoint`; the coordinator (rank 0) first waits while
``max_unverified`` saves are waiting for a verdict (:func:`~ckptaudit.integrations.guard.before_save_everywhere`; default 1 with
``on_failure="stop"``); then the writer's collective save and commit, unchanged; then the coordinator (rank 0) holds ``latest`` at the previous checkpoint and submits the new one to
the guard. The audit runs on rank 0's background worker; when it passes, ``latest`` moves to it and retention
(``keep_last``) runs, so a failed save never costs the last good checkpoint (the reports of the checkpoints it
deletes go with them); when it fails, ``step-N`` becomes
``quarantined-step-N``, which neither ``load_checkpoint`` nor ``ckptaudit latest`` resumes from.
:func:`stop_requested` shares rank 0's decision with every rank (one tiny all-reduce per call).

Between the commit and the end of the audit the new ``step-N`` is committed but not yet audited: a job that
dies in that window resumes from it (its manifest is verified on load), as it would without the guard.
"""

from __future__ import annotations

import os
from typing import Any

from ckptaudit.integrations.guard import Guard, before_save_everywhere, report_path, stop_requested
from ckptaudit.integrations.live_contract import declare_live_contract

__all__ = ["save_checkpoint", "stop_requested"]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def save_checkpoint(job: Any, root: str | os.PathLike[str], *, guard: Guard, keep_last: int | None = None,
                    **kwargs: Any) -> Any:
    """(all ranks, collective) :func:`ckptaudit.store.save_checkpoint` with the audit before ``latest`` advances
    and before retention; other keywords go to the writer. Returns its ``SavedCheckpoint`` (``deleted`` is
    empty: retention runs after the audit)."""
    from ckptaudit.store import layout
    from ckptaudit.store import save_checkpoint as store_save

    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be at least 1 (the checkpoint just written), got {keep_last}")
    root = os.path.abspath(os.fspath(root))
    coordinator = _rank() == 0
    previous = layout.read_pointer(root) if coordinator and os.path.isdir(root) else None
    before_save_everywhere(guard, None)
    saved = store_save(job, root, keep_last=None, **kwargs)
    if not coordinator:
        return saved
    pointer = os.path.join(root, layout.POINTER)
    # The writer moved `latest` at its commit point; it stays on the previous checkpoint until this one passes.
    if previous is not None:
        layout.write_durably(pointer, (previous + "\n").encode())
    elif os.path.exists(pointer):
        os.remove(pointer)
    name = os.path.basename(saved.path)

    def passed(path: str) -> None:
        from ckptaudit.store.retention import apply_retention

        layout.write_durably(pointer, (name + "\n").encode())
        if keep_last is not None:
            for gone in apply_retention(root, keep_last, protect=(name,)):
                report = report_path(os.path.join(root, gone))
                if os.path.exists(report):
                    os.remove(report)

    declare_live_contract(guard, job.optimizer, "ckptaudit.store")
    guard.submit(saved.path, step=saved.step, on_pass=passed)
    return saved
