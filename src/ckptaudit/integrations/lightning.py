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
replaced by a copy of the content it had at its newest save that passed (kept by the guard, so the resumed run's
``ModelCheckpoint`` state still names ``last.ckpt`` and its next save writes ``last.ckpt``, not ``last-v1.ckpt``),
or else of the newest checkpoint that passed (or removed, when none has), so ``ckpt_path="last"`` resumes from a
checkpoint that passed. A real copy, never a link: Lightning's next ``save_last=True`` save writes through a link
into its target.

``last.ckpt`` is rewritten at every save: the guard judges the bytes each save wrote (pinned at submit), and
before each save the callback unlinks a ``last*.ckpt`` whose bytes a pin still needs (:meth:`Guard.detach`), since
Lightning rewrites it in place when its temporary file is on another filesystem. With ``on_failure="stop"`` at
most ``max_unverified`` save points (default 1) wait for a verdict: a save beyond that waits in the wrapped
``save_checkpoint`` (:func:`~ckptaudit.integrations.guard.before_save_everywhere`: every rank calls it), and ``fit`` ends by raising
:class:`~ckptaudit.integrations.guard.CheckpointAuditFailed` on every rank (in ``on_fit_end``, after the last
audit) when a checkpoint failed.

Retention: ``ModelCheckpoint``'s ``save_top_k`` removes files through ``trainer.strategy.remove_checkpoint``,
which the callback wraps during ``fit``: a file whose audit is pending, or the newest that passed, is kept until
a newer one has passed (then removed, with its report), so the last good checkpoint is never deleted first.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
from typing import Any

import lightning.pytorch as pl

from ckptaudit.integrations.guard import Guard, Verdict, before_save_everywhere, report_path, wait_everywhere
from ckptaudit.integrations.live_contract import declare_live_contract

__all__ = ["AuditCallback"]

log = logging.getLogger("ckptaudit.guard")
_LAST = re.compile(r"^last(-v?\d+)?\.ckpt$")
"""ModelCheckpoint's ``last`` files: ``last.ckpt``, ``last-v1.ckpt`` (what ``ckpt_path="last"`` looks for)."""


class AuditCallback(pl.Callback):  # type: ignore[misc]
    """Audit each checkpoint file in the background; quarantine it when it fails; keep ``last`` good.

    ``on_failure``: ``"warn"`` (log and quarantine) or ``"stop"`` (also ``trainer.should_stop`` at the first
    batch end after the failing audit finishes, and :class:`~ckptaudit.integrations.guard.CheckpointAuditFailed`
    at the end of ``fit``). ``background``: ``"process"`` (default) or ``"thread"``. ``wait_at_end``: seconds to
    wait at the end of fitting for the audits still queued (``None``: no limit). ``max_unverified`` and every
    option of :func:`ckptaudit.audit` (``quick=True``, ``fail_on``, ``ignore``...) go to the
    :class:`~ckptaudit.integrations.guard.Guard`; without a ``master_dtype`` the audits hold the parameters to the
    live run's (the dtype of what the optimizer steps).
    """

    def __init__(self, on_failure: str = "warn", *, background: str = "process",
                 wait_at_end: float | None = None, **guard_options: Any) -> None:
        self.guard = Guard(on_failure=on_failure, background=background, **guard_options)
        self.wait_at_end = wait_at_end
        self._passed: list[tuple[int, str]] = []
        self._deferred: list[str] = []
        self._lock = threading.Lock()
        self._wrapped: pl.Trainer | None = None
        self._remove: Any = None

    @property
    def verdicts(self) -> tuple[Verdict, ...]:
        return self.guard.verdicts

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._wrapped is trainer:
            return
        if trainer.is_global_zero:
            self.guard.start()
        original = trainer.save_checkpoint
        remove = self._remove = trainer.strategy.remove_checkpoint

        def save_checkpoint(filepath: Any, weights_only: bool | None = None, storage_options: Any = None) -> None:
            before_save_everywhere(self.guard, trainer.global_step, self._any_rank(trainer))
            if trainer.is_global_zero:
                self.guard.detach(os.fspath(filepath))
            original(filepath, weights_only, storage_options)
            if trainer.is_global_zero:
                if trainer.optimizers:
                    declare_live_contract(self.guard, trainer.optimizers[0],
                                          f"Lightning precision={trainer.precision}")
                self._saved(os.fspath(filepath), trainer.global_step, bool(weights_only))
            if self.guard.on_failure == "stop":
                # The wait in before_save may have brought a failing verdict: stop after this batch, on every
                # rank (every rank calls save_checkpoint), rather than one batch later.
                self._agree_to_stop(trainer)

        def remove_checkpoint(filepath: Any) -> None:
            path = os.fspath(filepath)
            if trainer.is_global_zero and self._protected(path):
                with self._lock:
                    self._deferred.append(path)
                log.info("ckptaudit guard: ModelCheckpoint removes %s; kept until a newer checkpoint has passed "
                         "(its audit is pending, or it is the newest that passed)", path)
                return
            remove(filepath)
            if trainer.is_global_zero:
                _remove_report(path)

        # Instance attributes over the methods: removed at teardown.
        trainer.save_checkpoint = save_checkpoint  # type: ignore[method-assign]
        trainer.strategy.remove_checkpoint = remove_checkpoint  # type: ignore[method-assign]
        self._wrapped = trainer

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._wrapped is trainer:
            del trainer.save_checkpoint
            del trainer.strategy.remove_checkpoint
            self._wrapped = None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if self._deferred and trainer.is_global_zero:
            self._remove_deferred()
        if self.guard.on_failure != "stop":
            return  # "warn" never stops: no per-batch collective (every rank has the same on_failure)
        self._agree_to_stop(trainer)

    @staticmethod
    def _any_rank(trainer: pl.Trainer) -> Any:
        """Lightning's own "any rank true" reduction (as EarlyStopping uses), or ``None`` alone."""
        if trainer.world_size == 1:
            return None
        return lambda flag: trainer.strategy.reduce_boolean_decision(flag, all=False)

    def _agree_to_stop(self, trainer: pl.Trainer) -> None:
        """(all ranks) ``trainer.should_stop`` when the global-zero process's guard asks to stop."""
        stop = self.guard.should_stop()  # only the global-zero process audits: False on the others
        if trainer.world_size > 1:
            # Every rank agrees, as EarlyStopping does: True on all when the global-zero process says so.
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if stop:
            trainer.should_stop = True

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After ModelCheckpoint's own on_train_end (its last save): every save of the fit has been submitted.
        if self.guard.on_failure == "stop":
            wait_everywhere(self.guard, self.wait_at_end, self._any_rank(trainer))  # a collective follows
        else:
            self.guard.wait(self.wait_at_end)
        if trainer.is_global_zero:
            self._remove_deferred()
            self.guard.release_kept()
        if self.guard.on_failure != "stop":
            return
        failed = self.guard.should_stop()
        if trainer.world_size > 1:
            failed = trainer.strategy.reduce_boolean_decision(failed, all=False)
        if failed:
            raise self.guard.failure()

    # -- retention ---------------------------------------------------------------------------------------------

    def _protected(self, path: str) -> bool:
        """A file ModelCheckpoint wants removed that must stay for now: its audit is pending, or it is the newest
        checkpoint that passed (what ``last.ckpt`` is repaired from)."""
        if self.guard.status(path) == "pending":
            return True
        with self._lock:
            good = next((p for _, p in sorted(self._passed, reverse=True) if os.path.isfile(p)), None)
        return good is not None and os.path.abspath(good) == os.path.abspath(path)

    def _remove_deferred(self) -> None:
        """(global zero, training thread) Carry out the removals ModelCheckpoint asked for once they are safe."""
        with self._lock:
            deferred, self._deferred = self._deferred, []
        for path in deferred:
            if not os.path.exists(path):
                continue  # quarantined meanwhile
            if self._protected(path):
                with self._lock:
                    self._deferred.append(path)
                continue
            if self._remove is not None:
                self._remove(path)
            _remove_report(path)
            log.info("ckptaudit guard: removed %s, as ModelCheckpoint asked, now that a newer checkpoint passed",
                     path)

    # -- worker side ------------------------------------------------------------------------------------------

    def _saved(self, path: str, step: int, weights_only: bool) -> None:
        if weights_only:
            log.info("ckptaudit guard: %s is a weights-only save, not a training checkpoint; not audited", path)
            return
        if not os.path.isfile(path):
            log.warning("ckptaudit guard: Lightning saved %s, but it is not a local file; not audited", path)
            return
        last = bool(_LAST.match(os.path.basename(path)))
        self.guard.submit(path, step=step, after_quarantine=self._repair, keep_pin=last,
                          on_pass=None if last else (lambda p: self._pass(p, step)))

    def _pass(self, path: str, step: int) -> None:
        with self._lock:
            self._passed.append((step, path))

    def _repair(self, path: str, dest: str) -> None:
        """(guard worker) ``path`` failed and was moved to ``dest``: every ``last*.ckpt`` that held that state
        becomes a copy of good content, or is removed when there is none."""
        folder = os.path.dirname(os.path.abspath(path))
        real = os.path.realpath(path)  # the name is gone; a link to it still resolves to it
        links = [os.path.join(folder, n) for n in os.listdir(folder)
                 if _LAST.match(n) and os.path.islink(os.path.join(folder, n))
                 and os.path.realpath(os.path.join(folder, n)) == real]
        stale = links + ([path] if _LAST.match(os.path.basename(path)) else [])
        for last in stale:
            kept = self.guard.kept(last)
            with self._lock:
                good = next(((s, p) for s, p in sorted(self._passed, reverse=True) if os.path.isfile(p)), None)
            # Its own newest passing content first (its ModelCheckpoint state names last.ckpt, so the resumed run
            # keeps writing last.ckpt), unless a top-k file passed at a later step.
            own = kept is not None and (good is None or kept.step is None or kept.step >= good[0])
            source = kept.path if own and kept is not None else (good[1] if good is not None else None)
            if os.path.lexists(report_path(last)):
                os.remove(report_path(last))
            if source is None:
                if os.path.lexists(last):
                    os.remove(last)
                log.warning("ckptaudit guard: %s held the failed state and no checkpoint has passed yet: "
                            "removed, so ckpt_path='last' finds none", last)
                continue
            tmp = f"{last}.tmp-ckptaudit"
            shutil.copyfile(source, tmp)
            os.replace(tmp, last)
            if own and kept is not None:
                shutil.copyfile(kept.report, report_path(last))
            log.warning("ckptaudit guard: %s held the failed state; it is now a copy of %s", last,
                        f"its own content at step {kept.step}, its newest save that passed" if own and kept
                        else os.path.basename(source) + ", the newest checkpoint that passed")


def _remove_report(path: str) -> None:
    """The guard's files beside a checkpoint file that is removed: its report and its passport."""
    from ckptaudit.ondisk.passport import passport_path, signature_path

    for beside in (report_path(path), passport_path(path, is_dir=False), signature_path(path, is_dir=False)):
        if os.path.exists(beside):
            os.remove(beside)
