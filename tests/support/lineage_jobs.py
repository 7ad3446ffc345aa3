"""Training runs for the guard's lineage, for ``test_guard_lineage_runs.py``: the real Trainer on CPU, a tiny model,
a fast loop (steps of milliseconds, nothing waits for the audit but the guard's own bound), stop mode.

Run as a script in a fresh interpreter (``python lineage_jobs.py WHAT OUT``, see ``guard_jobs.run_job``). Two
defects at the save of step 6, the third save:

- ``hf_state``: a bug rounds the live fp32 masters to bf16 values IN PLACE (a callback at the end of step 6,
  before the save): the training state itself is damaged, and step 8, saved before the verdict of step 6 arrives
  (the bound: ``max_unverified=1``), holds fp32 masters that kept training from the rounded values;
- ``hf_file``: the exporter rounds only what it writes at step 6; the live masters keep their bits.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from guard_fast_jobs import _hf_args, _llama
from guard_jobs import JOB_ENV, _bf16_values, _dataset, _raised, _result, _verdict

__all__ = ["JOB_ENV", "hf_file", "hf_state"]


def hf_state(out: str) -> None:
    _result(out, **_hf_story(out, "state"))


def hf_file(out: str) -> None:
    _result(out, **_hf_story(out, "file"))


def _hf_story(out: str, damage: str) -> dict[str, Any]:
    import torch
    from transformers import Trainer, TrainerCallback

    from ckptaudit.integrations.transformers import AuditCallback

    audit = AuditCallback(on_failure="stop")

    class RoundInPlace(TrainerCallback):  # type: ignore[misc]
        """The bug: the live masters rounded to bf16 values in memory at the end of step 6."""

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            if damage == "state" and state.global_step == 6:
                with torch.no_grad():
                    for p in model.parameters():
                        p.copy_(p.to(torch.bfloat16).float())

    class Exporter(Trainer):  # type: ignore[misc]
        def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
            if damage == "file" and self.state.global_step == 6:
                state_dict = _bf16_values(self.model.state_dict())
            super()._save(output_dir, state_dict)

    class Late(TrainerCallback):  # type: ignore[misc]
        """The verdict of step 6 comes after step 7 whatever the machine's speed: the guard's worker process is
        held (SIGSTOP) from the save of step 6 to the end of step 8, where the guard's bound then waits for it."""

        pid: int | None = None

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:  # its request then waits
            child = audit.guard._child
            if state.global_step == 6 and child is not None:
                Late.pid = child.pid
                os.kill(child.pid, signal.SIGSTOP)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:  # before the guard's
            if state.global_step >= 8:
                Late.go()

        @staticmethod
        def go() -> None:
            if Late.pid is not None:
                os.kill(Late.pid, signal.SIGCONT)
                Late.pid = None

    trainer = Exporter(model=_llama(), args=_hf_args(out, 12), train_dataset=_dataset(),
                       callbacks=[RoundInPlace(), Late(), audit])
    try:
        raised = _raised(trainer.train)
    finally:
        Late.go()
    audit.guard.close(120)
    verdicts = [{**_verdict(v), "advice": v.advice,
                 "passport": os.path.relpath(v.passport, out) if v.passport else None} for v in audit.verdicts]
    return dict(stopped_at=trainer.state.global_step, listing=sorted(os.listdir(out)), raised=raised,
                verdicts=verdicts)


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    {"hf_state": hf_state, "hf_file": hf_file}[sys.argv[1]](sys.argv[2])
