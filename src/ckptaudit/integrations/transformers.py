"""Hugging Face ``Trainer``: audit every ``checkpoint-N`` as it is saved. See ``docs/integrations/transformers.md``.

    from ckptaudit.integrations.transformers import AuditCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[AuditCallback(on_failure="stop")])
    trainer.train()                               # raises CheckpointAuditFailed at the end if a save failed
    trainer.train(resume_from_checkpoint=True)   # never picks a checkpoint that failed

Which process runs what: every process gets the callback; only the main process (``state.is_world_process_zero``,
the one that writes ``checkpoint-N``'s model, trainer state and rotation) audits, in the background. A failed
``checkpoint-N`` is renamed ``quarantined-checkpoint-N``: ``get_last_checkpoint`` (used by
``resume_from_checkpoint=True``) only matches ``checkpoint-<digits>``, and Trainer's rotation only globs
``checkpoint-*``, so it is neither resumed from nor counted or deleted.

Bounded unverified saves: at the step end that will save (``control.should_save``, set by Trainer's flow
callback before this one), the main process waits while ``max_unverified`` save points (default 1 with
``on_failure="stop"``) are still waiting for a verdict
(:func:`~ckptaudit.integrations.guard.before_save_everywhere`: the other processes wait beside it in rounds of
one tiny all-reduce, never in one collective as long as an audit).
With ``on_failure="stop"``, ``train()`` ends by raising
:class:`~ckptaudit.integrations.guard.CheckpointAuditFailed` on every process (in ``on_train_end``, after the
last audit) when a checkpoint failed.

Retention: the callback takes over ``save_total_limit`` (it sets ``args.save_total_limit`` to ``None`` for the
run, on the main process, and puts it back at the end): after each save and each verdict it deletes the oldest
``checkpoint-N`` beyond the limit by :meth:`~ckptaudit.integrations.guard.Guard.retention`'s rule, so the newest
checkpoint that passed, one whose audit is pending, and ``state.best_model_checkpoint`` are never deleted, and
each one's report goes with it.

With several processes (DDP through accelerate, ``torchrun``): at each save every rank waits at a barrier in
``on_save`` (all ranks have written their files, ``rng_state_<rank>.pth`` included, before rank 0 audits or
moves them); with ``on_failure="stop"``, at each step end every rank takes rank 0's decision from
:func:`~ckptaudit.integrations.guard.stop_requested` (one 4-byte all-reduce per step) and sets
``control.should_training_stop``, so all ranks leave the loop at the same step.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ckptaudit.integrations.guard import (
    Guard,
    Verdict,
    before_save_everywhere,
    report_path,
    stop_requested,
    wait_everywhere,
)
from ckptaudit.integrations.live_contract import declare_live_contract

__all__ = ["AuditCallback"]

log = logging.getLogger("ckptaudit.guard")
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
"""Trainer's checkpoint folders (``get_last_checkpoint``'s pattern)."""


class AuditCallback(TrainerCallback):  # type: ignore[misc]
    """Audit each new ``checkpoint-N`` in the background; quarantine it when it fails.

    ``on_failure``: ``"warn"`` (log and quarantine) or ``"stop"`` (also ``control.should_training_stop`` at the
    first step end after the failing audit finishes, and
    :class:`~ckptaudit.integrations.guard.CheckpointAuditFailed` at the end of ``train()``). ``background``:
    ``"process"`` (default) or ``"thread"``. ``wait_at_end``: seconds to wait at the end of training for the
    audits still queued (``None``: no limit). ``max_unverified`` and every option of :func:`ckptaudit.audit`
    (``quick=True``, ``fail_on``, ``ignore``...) go to the :class:`~ckptaudit.integrations.guard.Guard`; without a
    ``master_dtype`` the audits hold the parameters to the live run's (the dtype of what the optimizer steps).
    """

    def __init__(self, on_failure: str = "warn", *, background: str = "process",
                 wait_at_end: float | None = None, **guard_options: Any) -> None:
        self.guard = Guard(on_failure=on_failure, background=background, **guard_options)
        self.wait_at_end = wait_at_end
        self._limit: int | None = None
        """``save_total_limit``, taken over for this run (on the main process)."""
        self._rotated_at = -1

    @property
    def verdicts(self) -> tuple[Verdict, ...]:
        return self.guard.verdicts

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        self.guard.start()
        resumed = os.path.join(args.output_dir or ".", f"checkpoint-{state.global_step}")
        if state.global_step > 0 and os.path.isdir(resumed):
            self.guard.restored(resumed, state.global_step)  # the lineage's parent (and its damage, if any)
        limit = args.save_total_limit
        if limit is not None and limit > 0:
            self._limit = int(limit)
            args.save_total_limit = None  # Trainer's rotation would delete the last good one before a newer passed

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if control.should_save:  # the same on every rank (Trainer's flow callback, from the step)
            before_save_everywhere(self.guard, state.global_step)
        if state.is_world_process_zero:
            self._rotate(args, state, when_judged=True)
        stop = stop_requested(self.guard) if args.world_size > 1 else self.guard.should_stop()
        if stop:
            control.should_training_stop = True

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if control.should_save:
            before_save_everywhere(self.guard, state.global_step)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        if args.world_size > 1:
            _barrier()  # every rank has written its files (rng_state_<rank>.pth) before rank 0 audits or moves them
        if not state.is_world_process_zero:
            return
        path = os.path.join(args.output_dir or ".", f"checkpoint-{state.global_step}")
        if not os.path.isdir(path):
            log.warning("ckptaudit guard: Trainer reported a save at step %d, but %s does not exist; not audited",
                        state.global_step, path)
            return
        declare_live_contract(self.guard, kwargs.get("optimizer"), f"Trainer bf16={args.bf16}, fp16={args.fp16}")
        self.guard.submit(path, step=state.global_step)
        self._rotate(args, state)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.guard.on_failure == "stop":
            wait_everywhere(self.guard, self.wait_at_end)  # every rank, in short rounds: a collective follows
        else:
            self.guard.wait(self.wait_at_end)
        if state.is_world_process_zero:
            self._rotate(args, state)
            if self._limit is not None:
                args.save_total_limit, self._limit = self._limit, None
        if self.guard.on_failure != "stop":
            return
        failed = stop_requested(self.guard) if args.world_size > 1 else self.guard.should_stop()
        if failed:
            raise self.guard.failure()

    def _rotate(self, args: TrainingArguments, state: TrainerState, when_judged: bool = False) -> None:
        """(main process, training thread) ``save_total_limit`` by the guard's retention rule; with
        ``when_judged``, only when a verdict has come since the last rotation."""
        if self._limit is None:
            return
        judged = len(self.guard.verdicts)
        if when_judged and judged == self._rotated_at:
            return
        self._rotated_at = judged
        out = args.output_dir or "."
        found = sorted((int(m.group(1)), os.path.join(out, n)) for n in os.listdir(out)
                       if (m := _CHECKPOINT.match(n)) and os.path.isdir(os.path.join(out, n)))
        best = [state.best_model_checkpoint] if state.best_model_checkpoint else []
        for path in self.guard.retention([p for _, p in found], self._limit, best):
            shutil.rmtree(path, ignore_errors=True)
            if os.path.exists(report_path(path)):
                os.remove(report_path(path))
            log.info("ckptaudit guard: deleted %s (save_total_limit=%d; a newer checkpoint has passed)", path,
                     self._limit)


def _barrier() -> None:
    """(all ranks) Wait until every rank is here (Trainer's own process group, set up by accelerate)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl":
            import torch

            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()
