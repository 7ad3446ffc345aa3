"""Hugging Face ``Trainer``: audit every ``checkpoint-N`` as it is saved. See ``docs/integrations/transformers.md``.

    from ckptaudit.integrations.transformers import AuditCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[AuditCallback(on_failure="stop")])
    trainer.train()
    trainer.train(resume_from_checkpoint=True)   # never picks a checkpoint that failed

Which process runs what: every process gets the callback; only the main process (``state.is_world_process_zero``,
the one that writes ``checkpoint-N``'s model, trainer state and rotation) audits, in the background. A failed
``checkpoint-N`` is renamed ``quarantined-checkpoint-N``: ``get_last_checkpoint`` (used by
``resume_from_checkpoint=True``) only matches ``checkpoint-<digits>``, and Trainer's rotation
(``save_total_limit``) only globs ``checkpoint-*``, so it is neither resumed from nor counted or deleted.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ckptaudit.integrations.guard import Guard, Verdict

__all__ = ["AuditCallback"]

log = logging.getLogger("ckptaudit.guard")


class AuditCallback(TrainerCallback):  # type: ignore[misc]
    """Audit each new ``checkpoint-N`` in the background; quarantine it when it fails.

    ``on_failure``: ``"warn"`` (log and quarantine) or ``"stop"`` (also ``control.should_training_stop`` at the
    first step end after the failing audit finishes). ``background``: ``"process"`` (default) or ``"thread"``.
    ``wait_at_end``: seconds to wait at the end of training for the audits still queued (``None``: no limit).
    Other keywords are options of :func:`ckptaudit.audit` (``quick=True``, ``fail_on``, ``master_dtype``...).
    """

    def __init__(self, on_failure: str = "warn", *, background: str = "process",
                 wait_at_end: float | None = None, **audit_options: Any) -> None:
        self.guard = Guard(on_failure=on_failure, background=background, **audit_options)
        self.wait_at_end = wait_at_end

    @property
    def verdicts(self) -> tuple[Verdict, ...]:
        return self.guard.verdicts

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if self.guard.on_failure == "stop" and args.world_size > 1:
            raise ValueError(
                f"ckptaudit AuditCallback(on_failure='stop') with {args.world_size} processes: the stop decision "
                "is made on the main process only and is not shared with the others yet, which would hang them; "
                "use on_failure='warn' (the failed checkpoint is still quarantined)")

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        path = os.path.join(args.output_dir or ".", f"checkpoint-{state.global_step}")
        if not os.path.isdir(path):
            log.warning("ckptaudit guard: Trainer reported a save at step %d, but %s does not exist; not audited",
                        state.global_step, path)
            return
        self.guard.submit(path, step=state.global_step)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self.guard.should_stop():
            control.should_training_stop = True

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self.guard.wait(self.wait_at_end)
