"""Lightning: audit every checkpoint ``ModelCheckpoint`` (or any ``trainer.save_checkpoint``) writes.
See ``docs/integrations/lightning.md``.

    from ckptaudit.integrations.lightning import AuditCallback

    trainer = L.Trainer(callbacks=[ModelCheckpoint(dirpath="ckpts", save_last=True, every_n_train_steps=500),
                                   AuditCallback(on_failure="stop")])
    trainer.fit(model, loader)
    trainer.fit(model, loader, ckpt_path="last")   # never a checkpoint that failed

Which process runs what: every process gets the callback; the global-zero process audits each file after
``trainer.save_checkpoint`` returns (all ranks have passed its barrier, the file is complete), in the background.
Weights-only saves (``save_weights_only=True``) are not training checkpoints and are not audited. With several
processes (``strategy="ddp"``) and ``on_failure="stop"``, at each batch end every rank takes the global-zero
process's decision through ``trainer.strategy.reduce_boolean_decision`` (one one-element all-reduce per batch, as
``EarlyStopping`` does per check) and sets ``trainer.should_stop``, so all ranks stop at the same step.

A failed ``*.ckpt`` becomes ``*.ckpt.quarantined``: ``ckpt_path="last"`` takes the newest ``last*.ckpt`` and
nothing else, and ``ckptaudit latest`` only ``*.ckpt``. Every ``last*.ckpt`` that then holds the failed state (a
``save_last=True`` copy, itself audited and quarantined, or a ``save_last="link"`` symlink to the failed file) is
replaced by a copy of the newest checkpoint that passed (or removed, when none has), so ``ckpt_path="last"``
resumes from a checkpoint that passed. A real copy, never a link: Lightning's next ``save_last=True`` save writes
through a link into its target.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
from typing import Any

import lightning.pytorch as pl

from ckptaudit.integrations.guard import Guard, Verdict, quarantine_name
from ckptaudit.integrations.live_contract import declare_live_contract

__all__ = ["AuditCallback"]

log = logging.getLogger("ckptaudit.guard")
_LAST = re.compile(r"^last(-v?\d+)?\.ckpt$")
"""ModelCheckpoint's ``last`` files: ``last.ckpt``, ``last-v1.ckpt`` (what ``ckpt_path="last"`` looks for)."""


class AuditCallback(pl.Callback):  # type: ignore[misc]
    """Audit each checkpoint file in the background; quarantine it when it fails; keep ``last`` good.

    ``on_failure``: ``"warn"`` (log and quarantine) or ``"stop"`` (also ``trainer.should_stop`` at the first
    batch end after the failing audit finishes). ``background``: ``"process"`` (default) or ``"thread"``.
    ``wait_at_end``: seconds to wait at the end of fitting for the audits still queued (``None``: no limit).
    Other keywords are options of :func:`ckptaudit.audit` (``quick=True``, ``fail_on``, ``ignore``...); without a
    ``master_dtype`` the audits hold the parameters to the live run's (the dtype of what the optimizer steps).
    """

    def __init__(self, on_failure: str = "warn", *, background: str = "process",
                 wait_at_end: float | None = None, **audit_options: Any) -> None:
        self.guard = Guard(on_failure=on_failure, background=background, **audit_options)
        self.wait_at_end = wait_at_end
        self._passed: list[str] = []
        self._lock = threading.Lock()
        self._wrapped: pl.Trainer | None = None

    @property
    def verdicts(self) -> tuple[Verdict, ...]:
        return self.guard.verdicts

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._wrapped is trainer:
            return
        original = trainer.save_checkpoint

        def save_checkpoint(filepath: Any, weights_only: bool | None = None, storage_options: Any = None) -> None:
            original(filepath, weights_only, storage_options)
            if trainer.is_global_zero:
                if trainer.optimizers:
                    declare_live_contract(self.guard, trainer.optimizers[0],
                                          f"Lightning precision={trainer.precision}")
                self._saved(os.fspath(filepath), trainer.global_step, bool(weights_only))

        trainer.save_checkpoint = save_checkpoint  # type: ignore[method-assign]  # an instance attribute over the method: removed at teardown
        self._wrapped = trainer

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._wrapped is trainer:
            del trainer.save_checkpoint
            self._wrapped = None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if self.guard.on_failure != "stop":
            return  # "warn" never stops: no per-batch collective (every rank has the same on_failure)
        stop = self.guard.should_stop()  # only the global-zero process audits: False on the others
        if trainer.world_size > 1:
            # Every rank agrees, as EarlyStopping does: True on all when the global-zero process says so.
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if stop:
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.guard.wait(self.wait_at_end)

    # -- worker side ------------------------------------------------------------------------------------------

    def _saved(self, path: str, step: int, weights_only: bool) -> None:
        if weights_only:
            log.info("ckptaudit guard: %s is a weights-only save, not a training checkpoint; not audited", path)
            return
        if not os.path.isfile(path):
            log.warning("ckptaudit guard: Lightning saved %s, but it is not a local file; not audited", path)
            return
        self.guard.submit(path, step=step, quarantine=self._quarantine, on_pass=self._pass)

    def _pass(self, path: str) -> None:
        with self._lock:
            self._passed.append(path)

    def _quarantine(self, path: str) -> str:
        folder = os.path.dirname(os.path.abspath(path))
        real = os.path.realpath(path)
        links = [os.path.join(folder, n) for n in os.listdir(folder)
                 if _LAST.match(n) and os.path.islink(os.path.join(folder, n))
                 and os.path.realpath(os.path.join(folder, n)) == real]
        dest = quarantine_name(path)
        shutil.move(path, dest)
        stale = links + ([path] if _LAST.match(os.path.basename(path)) else [])
        if stale:
            with self._lock:
                good = next((p for p in reversed(self._passed)
                             if not _LAST.match(os.path.basename(p)) and os.path.isfile(p)), None)
            for last in stale:
                if good is None:
                    if os.path.lexists(last):
                        os.remove(last)
                    log.warning("ckptaudit guard: %s held the failed state and no checkpoint has passed yet: "
                                "removed, so ckpt_path='last' finds none", last)
                    continue
                tmp = f"{last}.tmp-ckptaudit"
                shutil.copyfile(good, tmp)
                os.replace(tmp, last)
                log.warning("ckptaudit guard: %s held the failed state; it is now a copy of %s, the newest "
                            "checkpoint that passed", last, os.path.basename(good))
        return dest
