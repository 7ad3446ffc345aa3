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

With several processes (DDP through accelerate, ``torchrun``): at each save every rank waits at a barrier in
``on_save`` (all ranks have written their files, ``rng_state_<rank>.pth`` included, before rank 0 audits or
moves them); with ``on_failure="stop"``, at each step end every rank takes rank 0's decision from
:func:`~ckptaudit.integrations.guard.stop_requested` (one 4-byte all-reduce per step) and sets
``control.should_training_stop``, so all ranks leave the loop at the same step.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ckptaudit.integrations.guard import Guard, Verdict, stop_requested
from ckptaudit.integrations.live_contract import declare_live_contract

__all__ = ["AuditCallback"]

log = logging.getLogger("ckptaudit.guard")


class AuditCallback(TrainerCallback):  # type: ignore[misc]
    """Audit each new ``checkpoint-N`` in the background; quarantine it when it fails.

    ``on_failure``: ``"warn"`` (log and quarantine) or ``"stop"`` (also ``control.should_training_stop`` at the
    first step end after the failing audit finishes). ``background``: ``"process"`` (default) or ``"thread"``.
    ``wait_at_end``: seconds to wait at the end of training for the audits still queued (``None``: no limit).
    Other keywords are options of :func:`ckptaudit.audit` (``quick=True``, ``fail_on``, ``ignore``...); without a
    ``master_dtype`` the audits hold the parameters to the live run's (the dtype of what the optimizer steps).
    """

    def __init__(self, on_failure: str = "warn", *, background: str = "process",
                 wait_at_end: float | None = None, **audit_options: Any) -> None:
        self.guard = Guard(on_failure=on_failure, background=background, **audit_options)
        self.wait_at_end = wait_at_end

    @property
    def verdicts(self) -> tuple[Verdict, ...]:
        return self.guard.verdicts

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

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        stop = stop_requested(self.guard) if args.world_size > 1 else self.guard.should_stop()
        if stop:
            control.should_training_stop = True

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self.guard.wait(self.wait_at_end)


def _barrier() -> None:
    """(all ranks) Wait until every rank is here (Trainer's own process group, set up by accelerate)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl":
            import torch

            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()
