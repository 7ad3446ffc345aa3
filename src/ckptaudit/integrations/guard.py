"""The guard every integration shares: audit each new checkpoint in the background, quarantine a failed one.

Which process runs what: only the process that owns the checkpoint's files (rank 0, or the rank that wrote
them) starts the guard's worker and calls :meth:`Guard.submit` right after the library's save returns. The
audit (:func:`ckptaudit.audit`, nothing re-implemented) runs on one background worker, one long-lived child
interpreter at the lowest CPU and I/O priority, scanning with one thread (``background="process"``, the default:
measured cheaper for the training loop, bench/bench_guard.py; the training thread's part is a message on a queue)
or a thread of this process (``background="thread"``: no second interpreter, but it shares the GIL), while
training goes on. The worker starts when the guard is created (on the process that looks like rank 0: the
default group's rank 0, or ``RANK=0``, or a single process) or at the latest when the integration calls
:meth:`Guard.start` at the beginning of training, so the first verdict waits for its audit, not for a start-up.

1. **At submit** (training thread) the checkpoint's files are pinned (:mod:`.pinning`: hard links in a private
   ``.ckptaudit-pins`` folder beside it, and each file's identity), so the audit judges the bytes that were
   saved even when the library replaces or deletes them before the audit's turn; a pinned file rewritten in
   place makes the verdict *not judged*, never "passed". A checkpoint behind an object-store URL is pinned by its
   objects' versions and marked quarantined in place, never moved (:mod:`.guard_remote`).
2. **Bounded unverified saves**: at most ``max_unverified`` save points (default 1 with ``on_failure="stop"``,
   no bound with ``"warn"``) are ever waiting for a verdict. The integration calls :meth:`Guard.before_save`
   just before the library writes the next checkpoint (:func:`before_save_everywhere` on every rank, which keeps
   the other ranks beside the auditing one in short rounds rather than in one long collective); when the bound is reached it waits there for the oldest
   verdict (logged, and measured in :attr:`Guard.waits`). In a run whose saves are further apart than an audit
   takes, it never waits. Saves at the same step (Lightning's ``epoch=..-step=N.ckpt`` and ``last.ckpt``) are one
   save point.
3. **On the worker**, in order: the audit, then the pin's check; the JSON report is written beside the
   checkpoint, ``<checkpoint>.ckptaudit.json`` (atomically); a checkpoint that fails (a finding at or above
   ``fail_on``) is quarantined: moved to a name no resume path picks (:func:`quarantine_name`:
   ``quarantined-<dir>``, ``<file>.quarantined``, or the integration's ``quarantine_to``), its report with it,
   then the integration's ``after_quarantine`` repairs that library's pointer (Lightning's ``last.ckpt``); one
   that passes calls the integration's ``on_pass`` (DeepSpeed's ``latest`` moves only then).
4. With ``on_failure="stop"``, :meth:`Guard.should_stop` turns true; the integration polls it at each step
   boundary and stops training through the library's own mechanism, and at the end of training (after the last
   audits, every checkpoint saved and quarantined) raises :class:`CheckpointAuditFailed` on every rank.

A checkpoint whose path holds other files by the time of its verdict (replaced) keeps the verdict of what was
saved: a failing one's pinned bytes are quarantined, the new content is left alone for its own audit. One
deleted before its verdict (retention) is judged from its pin, and no report is left behind for it; reports this
guard wrote for checkpoints deleted since are removed too. An audit that cannot run (a bug, a read error) gives
a verdict that is *not judged*: logged, nothing quarantined, training not stopped.

The audit options flow unchanged from the integration's constructor (``AuditCallback(quick=True, ...)``) to
``Guard(**audit_options)`` (checked there, :data:`ckptaudit.options.AUDIT_OPTIONS`), to :attr:`Guard.audit_options`,
to every worker request's ``"options"``, to :func:`~ckptaudit.integrations.guard_worker.audit_to_file`, to :func:`ckptaudit.audit`.

Cut by concept, every name importable from here: the records (:mod:`.guard_records`: :class:`Verdict`,
:class:`SaveWait`, :class:`Kept`, :class:`CheckpointAuditFailed`), the collectives every rank calls
(:mod:`.guard_collective`), the worker process's client (:mod:`.guard_process`) and the process itself
(:mod:`.guard_worker`, which also writes each passing checkpoint's passport), the quarantine
(:mod:`.guard_quarantine`), the live check and the lineage (:mod:`.guard_lineage`); this module holds the
:class:`Guard`: its queue, the bound on unverified saves and the verdicts.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptaudit.integrations import pinning
from ckptaudit.integrations.guard_collective import (
    ROUND_S,
    before_save_everywhere,
    likely_owner,
    stop_requested,
    wait_everywhere,
)
from ckptaudit.integrations.guard_lineage import (
    LiveState,
    RunLineage,
    SaveRecord,
    classify,
    drop_stale_passport,
    failure_advice,
    observe_live,
    passport_drafts,
    passport_request,
    passport_signing,
    place_passport,
)
from ckptaudit.integrations.guard_process import WORKER_ONE_THREAD, WorkerProcess, worker_env
from ckptaudit.integrations.guard_quarantine import descendant_advice, descends_why, failure_message, quarantine
from ckptaudit.integrations.guard_records import (
    BACKGROUNDS,
    ON_FAILURE,
    CheckpointAuditFailed,
    Kept,
    SaveWait,
    Verdict,
    report_path,
)
from ckptaudit.integrations.guard_remote import RemotePin, judge_remote, pin_remote
from ckptaudit.ondisk.quarantine import REPORT_SUFFIX, is_quarantined, quarantine_name

if TYPE_CHECKING:
    import subprocess

__all__ = ["BACKGROUNDS", "ON_FAILURE", "REPORT_SUFFIX", "ROUND_S", "WAIT_WARN_S", "WORKER_ONE_THREAD", "CheckpointAuditFailed", "Guard",
           "Kept", "SaveWait", "Verdict", "before_save_everywhere", "is_quarantined", "quarantine_name", "report_path",
           "stop_requested", "wait_everywhere", "worker_env"]

log = logging.getLogger("ckptaudit.guard")

_BY_MODE = object()
"""``max_unverified``'s default: 1 with ``on_failure="stop"``, no bound with ``"warn"``."""
WAIT_WARN_S = 30.0
"""A save that waited longer than this for an earlier verdict (:meth:`Guard.before_save`) is logged as a WARNING: a
stall of the training loop, no longer the bound at work. A shorter wait is INFO: the documented behaviour of
``max_unverified`` in a loop whose saves come faster than an audit."""


def _key(path: str) -> str:
    return os.path.normpath(os.path.abspath(path))


@dataclass(eq=False, slots=True)
class _Job:
    checkpoint: str
    step: int | None
    point: object
    """Its save point: the step, or an object of its own when no step is given."""
    quarantine_to: Callable[[str], str] | None
    after_quarantine: Callable[[str, str], None] | None
    on_pass: Callable[[str], None] | None
    submitted: float
    report: str
    """Where the report goes (``<checkpoint>.ckptaudit.json`` unless the integration names another place)."""
    pins: str | None
    keep_pin: bool
    pin: pinning.Pin | None = None
    """The checkpoint's files as saved (pinned at submit; for an asynchronous save, when its future completes)."""
    ready: Future[Any] | None = None
    """An asynchronous save's future: the worker waits for it (never the training loop) before the audit."""
    live: LiveState | None = None
    """The live check at its save point (:meth:`Guard.observe`), or ``None`` when the guard saw no optimizer."""
    attested: dict[str, Any] | None = None
    """(worker) The worker's answer about its passport: ``file``, ``digest``, ``root_digest``, or ``error``."""
    remote: RemotePin | None = None
    """A checkpoint behind a URL: its objects' versions at submit (:mod:`.guard_remote`), judged there."""


class Guard:
    """Audits checkpoints as they are saved, in the background (see the module docstring).

    ``on_failure``: ``"warn"`` (log, quarantine, go on) or ``"stop"`` (also make :meth:`should_stop` true, and
    raise :class:`CheckpointAuditFailed` at the end of training); ``background``: ``"process"`` (default) or
    ``"thread"``; ``max_unverified``: the most save points ever waiting for a verdict (an int >= 1, or ``None``
    for no bound; default 1 with ``"stop"``, ``None`` with ``"warn"``); every other keyword is an option of
    :func:`ckptaudit.audit` (``quick``, ``fail_on``, ``master_dtype``, ``require``, ...), checked here, before
    training starts.
    """

    def __init__(self, *, on_failure: str = "warn", background: str = "process",
                 max_unverified: int | object | None = _BY_MODE, passport: bool = True,
                 passport_key: str | os.PathLike[str] | None = None, passport_sigstore: bool = False,
                 passport_certificate: str | os.PathLike[str] | None = None,
                 passport_cert_chain: Sequence[str | os.PathLike[str]] = (), **audit_options: Any) -> None:
        from ckptaudit.options import AUDIT_OPTIONS, resolve

        if on_failure not in ON_FAILURE:
            raise ValueError(f"ckptaudit guard: on_failure={on_failure!r} is not valid; pass 'warn' (log and "
                             "quarantine) or 'stop' (also stop training at the next step boundary)")
        if background not in BACKGROUNDS:
            raise ValueError(f"ckptaudit guard: background={background!r} is not valid; pass 'thread' or "
                             "'process'")
        if max_unverified is _BY_MODE:
            max_unverified = 1 if on_failure == "stop" else None
        if max_unverified is not None and (isinstance(max_unverified, bool) or not isinstance(max_unverified, int)
                                           or max_unverified < 1):
            raise ValueError(f"ckptaudit guard: max_unverified={max_unverified!r} is not valid; pass an int of at "
                             "least 1 (the most saves waiting for a verdict) or None (no bound)")
        resolve("ckptaudit guard", audit_options, AUDIT_OPTIONS)
        self.passport = bool(passport)
        """Write a passport beside (inside) each checkpoint that passes (:mod:`ckptaudit.passport`)."""
        self.signing = passport_signing(passport, passport_key, passport_certificate, passport_cert_chain,
                                        passport_sigstore)
        """How each passport is signed (key, certificate, chain; all ``None`` for digest-only passports)."""
        self.passport_key = self.signing["key"]
        self.on_failure = on_failure
        self.background = background
        self.max_unverified: int | None = max_unverified  # type: ignore[assignment]
        # One scanning thread unless told otherwise: the audit runs beside training, which owns the cores.
        self.audit_options = {"jobs": 1, **audit_options}
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._cond = threading.Condition()
        self._live: list[_Job] = []
        """Jobs submitted and not yet judged, in order."""
        self._open: dict[object, int] = {}
        """Save point -> its jobs not yet judged."""
        self._status: dict[str, str] = {}
        self._verdicts: list[Verdict] = []
        self._failed: Verdict | None = None
        self._waits: list[SaveWait] = []
        self._wait_began: tuple[float, int] | None = None
        self._kept: dict[str, tuple[pinning.Pin, int | None]] = {}
        """Checkpoint path -> the pin of its newest passing content (``submit(keep_pin=True)``), and its step."""
        self._placed: dict[str, str] = {}
        """Report (or passport) path -> the checkpoint it describes (to remove it when the checkpoint is deleted)."""
        self._thread: threading.Thread | None = None
        self._process = WorkerProcess()
        self._observed: LiveState | None = None
        """The live check of the save about to be submitted (:meth:`observe`)."""
        self.lineage = RunLineage()
        """(worker) The run's history: each save's parent, and the save that damaged the live state."""
        self._ready = threading.Event()
        self._closed = False
        if likely_owner():
            self.start()

    # -- training side (the owning process's main thread) ----------------------------------------------------

    def start(self) -> None:
        """(owning process) Start the worker now, if it is not running: the worker process (or thread) starts and
        imports the audit engine in the background, off the training thread. Idempotent; the integrations call
        it at the beginning of training on the process that audits."""
        with self._cond:
            if self._thread is not None or self._closed:
                return
            self._thread = threading.Thread(target=self._work, name="ckptaudit-guard", daemon=True)
            self._thread.start()

    def started(self, timeout: float | None = None) -> bool:
        """Whether the worker is up (its process started and the audit engine imported), waiting up to
        ``timeout`` seconds for it."""
        return self._ready.wait(timeout)

    def before_save(self, step: int | None = None, *, timeout: float | None = None) -> float | None:
        """(owning process, training thread) Called just before the library writes a checkpoint at ``step``: when
        ``max_unverified`` other save points are waiting for a verdict, wait here until the oldest has one
        (logged). Returns the seconds waited (0.0 in a run whose saves are further apart than an audit takes),
        or ``None`` when ``timeout`` seconds passed and it must still wait (call it again; the wait is recorded
        once, whole). A save at a step whose save point is already pending (Lightning's ``last.ckpt`` after the
        step's top-k file) never waits. With several ranks, call :func:`before_save_everywhere` on all of them
        instead."""
        limit = self.max_unverified
        if limit is None:
            return 0.0
        with self._cond:
            def others() -> int:
                return sum(1 for p in self._open if step is None or p != step)
            if others() >= limit:
                if self._wait_began is None:
                    self._wait_began = (time.monotonic(), others())
                if not self._cond.wait_for(lambda: others() < limit, timeout):
                    return None  # still waiting: call again (before_save_everywhere's rounds)
            began, self._wait_began = self._wait_began, None
            if began is None:
                return 0.0
            waited = time.monotonic() - began[0]
            self._waits.append(SaveWait(step, waited, began[1]))
        if waited <= WAIT_WARN_S:  # the bound at work, as documented: at most the rest of an audit
            log.info("ckptaudit guard: the save at step %s waited %.3f s for the verdict of an earlier save "
                     "(max_unverified=%d)", step, waited, limit)
        else:
            log.warning("ckptaudit guard: the save at step %s waited %.3f s for the verdict of an earlier save "
                        "(max_unverified=%d): its audit takes far longer than the time between the saves; pass "
                        "quick=True, save less often, or raise max_unverified", step, waited, limit)
        return waited

    def submit(self, checkpoint: str, *, step: int | None = None,
               quarantine_to: Callable[[str], str] | None = None,
               after_quarantine: Callable[[str, str], None] | None = None,
               on_pass: Callable[[str], None] | None = None, report: str | None = None,
               ready: Future[Any] | None = None, pins: str | None = None, keep_pin: bool = False) -> None:
        """Queue ``checkpoint`` (just saved, complete) for an audit; returns once its files are pinned.

        Waits first, as :meth:`before_save` does, when the save bound is reached (the integrations call
        :meth:`before_save` before the library writes, so this never waits for them).

        ``ready``: the future of an asynchronous save still writing ``checkpoint``; the worker waits for it, pins
        the files then, and audits (a save that fails gives a *not judged* verdict); the queue keeps its place.

        ``report``: where to write the JSON report instead of ``<checkpoint>.ckptaudit.json`` (it moves beside
        the quarantined checkpoint if it fails). ``quarantine_to(path)``: where a failing checkpoint goes
        (default :func:`quarantine_name`, beside it); ``after_quarantine(path, dest)`` then repairs the library's
        pointers (only when the checkpoint at ``path`` was the one judged); ``on_pass(path)`` runs when it passes
        and ``path`` still holds what was judged. All three run on the worker. ``pins``: the folder for the pins
        (default ``.ckptaudit-pins`` beside the checkpoint; on the same filesystem). ``keep_pin``: keep the pin
        of the newest passing content of ``checkpoint`` until the next one passes or :meth:`close`
        (:meth:`kept`: Lightning restores ``last.ckpt`` from it).
        """
        if self._closed:
            raise RuntimeError("ckptaudit guard: submit() after close(); create a new Guard")
        self.before_save(step)
        from ckptaudit.formats.remote import is_url  # here: importing the readers is not the guard's start-up

        remote = None if not is_url(checkpoint) else pin_remote(checkpoint, listed=ready is None, pins=pins, local_only={
            "quarantine_to": quarantine_to, "after_quarantine": after_quarantine, "keep_pin": keep_pin})
        if self.passport and remote is None:
            drop_stale_passport(checkpoint)
        pin: pinning.Pin | None = None
        if ready is None and remote is None:
            try:
                pin = pinning.pin(checkpoint, pins)
            except OSError:
                pin = None  # it does not exist (the audit says so), or cannot be read
        live, self._observed = self._observed, None
        job = _Job(checkpoint, step, step if step is not None else object(), quarantine_to, after_quarantine,
                   on_pass, time.monotonic(), report or report_path(checkpoint), pins, keep_pin, pin, ready, live,
                   remote=remote)
        with self._cond:
            ahead = len(self._live)
            self._live.append(job)
            self._open[job.point] = self._open.get(job.point, 0) + 1
            self._status[_key(checkpoint)] = "pending"
        if ahead:
            log.info("ckptaudit guard: %s saved while %d audit(s) are pending; queued behind them", checkpoint, ahead)
        self.start()
        self._jobs.put(job)

    def observe(self, optimizer: Any, step: int | None = None) -> LiveState | None:
        """(owning process, training thread, after the library's save and before :meth:`submit`) The live check of
        the masters ``optimizer`` steps (:func:`~ckptaudit.integrations.guard_lineage.observe_live`), given to the
        next submitted checkpoint: its failure then says whether the training state or only the file is damaged.
        The integrations call it through :func:`~ckptaudit.integrations.live_contract.declare_live_contract`.
        A check that cannot run is logged and left out, never raised into training."""
        try:
            self._observed = observe_live(optimizer, step)
        except Exception as exc:  # noqa: BLE001 - training goes on; the failure then says it could not tell
            log.info("ckptaudit guard: the live check of the masters could not run (%s: %s)", type(exc).__name__,
                     exc)
            self._observed = None
        return self._observed

    def restored(self, checkpoint: str, step: int | None = None) -> None:
        """(owning process, before the first save of a run that resumed) The run restored ``checkpoint``: the next
        save descends from it, and from its damaged ancestor when its passport says it descends from damage."""
        from ckptaudit.integrations.guard_lineage import restored_record

        parent, damaged = restored_record(checkpoint, step)
        with self._cond:
            self.lineage.restored(parent, damaged)

    def detach(self, path: str) -> bool:
        """(training thread, just before the library writes ``path`` again in place) When a pin still needs the
        bytes at ``path`` (an audit pending, or a kept pin), unlink the name, so the library's write makes a new
        file and the pin keeps the bytes that were saved. Returns whether it did. Lightning's callback calls it
        before every save: its ``last.ckpt`` is rewritten in place when its temporary file is on another
        filesystem."""
        try:
            st = os.stat(path)
        except OSError:
            return False
        with self._cond:
            pins = [j.pin for j in self._live if j.pin is not None and j.pin.pinned] + [p for p, _ in
                                                                                        self._kept.values()]
            if not any(p.holds(st.st_dev, st.st_ino) is not None for p in pins):
                return False
            # The pin's identity accepts this: a ctime moved with the link count dropping (pinning.FileIdentity).
            os.unlink(path)
        return True

    def should_stop(self) -> bool:
        """True once a checkpoint failed and ``on_failure="stop"``: stop at this step boundary."""
        return self.on_failure == "stop" and self._failed is not None

    @property
    def failed(self) -> Verdict | None:
        """The first failed verdict, if any."""
        return self._failed

    @property
    def verdicts(self) -> tuple[Verdict, ...]:
        """Every verdict so far, in the order the audits finished."""
        with self._cond:
            return tuple(self._verdicts)

    @property
    def waits(self) -> tuple[SaveWait, ...]:
        """Every save that waited for a verdict (:meth:`before_save`), in order."""
        with self._cond:
            return tuple(self._waits)

    @property
    def _child(self) -> subprocess.Popen[str] | None:
        """The worker process, while it runs (``background="process"``)."""
        return self._process.child

    @property
    def pending(self) -> int:
        """Audits queued or running."""
        with self._cond:
            return len(self._live)

    @property
    def unverified(self) -> int:
        """Save points waiting for a verdict now (what ``max_unverified`` bounds)."""
        with self._cond:
            return len(self._open)

    def status(self, checkpoint: str) -> str | None:
        """``"pending"``, ``"passed"``, ``"failed"`` or ``"not judged"`` for a checkpoint this guard was given (its
        newest submission), ``None`` for any other."""
        with self._cond:
            return self._status.get(_key(checkpoint))

    def kept(self, checkpoint: str) -> Kept | None:
        """The pinned copy of the newest content of ``checkpoint`` that passed (``submit(keep_pin=True)``), its
        step and its report, if the guard still keeps it."""
        with self._cond:
            kept = self._kept.get(_key(checkpoint))
        if kept is None or kept[0].folder is None:
            return None
        return Kept(kept[0].path, kept[1], os.path.join(kept[0].folder, "kept" + REPORT_SUFFIX))

    def release_kept(self) -> None:
        """Remove the kept pins (:meth:`kept`); :meth:`close` does it too."""
        with self._cond:
            kept, self._kept = [p for p, _ in self._kept.values()], {}
        for pin in kept:
            pin.release()

    def retention(self, checkpoints: Sequence[str], keep: int, protect: Sequence[str] = ()) -> list[str]:
        """Which of ``checkpoints`` (one library's, oldest first) a retention of ``keep`` may delete now.

        The rule every integration applies to the retention it takes over: the ``keep`` newest stay; so does the
        newest that passed its audit (before any has passed in this run: the newest this guard was never given,
        the one training resumed from), so the last good checkpoint is never deleted before a newer one has
        passed; so does every one whose audit is pending, and those in ``protect``."""
        with self._cond:
            status = [self._status.get(_key(c)) for c in checkpoints]
        good = next((c for c, s in zip(reversed(checkpoints), reversed(status), strict=True) if s == "passed"),
                    None)
        if good is None:
            good = next((c for c, s in zip(reversed(checkpoints), reversed(status), strict=True) if s is None),
                        None)
        keep_set = {_key(c) for c in checkpoints[-keep:]} if keep > 0 else set()
        keep_set |= {_key(p) for p in protect}
        if good is not None:
            keep_set.add(_key(good))
        return [c for c, s in zip(checkpoints, status, strict=True) if s != "pending" and _key(c) not in keep_set]

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted audit has finished (True) or ``timeout`` seconds pass (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._live, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Wait for the pending audits (``timeout``: give up after that many seconds, logged), then stop the
        worker and remove the guard's pins. Returns whether every audit finished. Idempotent."""
        done = self.wait(timeout)
        if not done:
            log.warning("ckptaudit guard: %d audit(s) still running after %.0f s; not waiting for them",
                        self.pending, timeout or 0.0)
        self._closed = True
        with self._cond:
            thread = self._thread
        if thread is not None and done:
            self._jobs.put(None)
            thread.join()
            with self._cond:
                self._thread = None
            self.release_kept()
            self._sweep()
        return done

    def finish(self, timeout: float | None = None) -> None:
        """(all ranks, at the end of training; one tiny collective when distributed with ``on_failure="stop"``)
        :meth:`close`, then raise :class:`CheckpointAuditFailed` on every rank when a checkpoint saved during
        training failed its audit and ``on_failure="stop"``."""
        done = wait_everywhere(self, timeout) if self.on_failure == "stop" else self.wait(timeout)
        self.close(None if done else 0.0)
        if stop_requested(self):
            raise self.failure()

    def failure(self) -> CheckpointAuditFailed:
        """The :class:`CheckpointAuditFailed` that says which checkpoints failed (on the rank that audited), or
        that rank 0's guard found one (on the others)."""
        with self._cond:
            failed = tuple(v for v in self._verdicts if v.ok is False)
            aside = tuple(v for v in self._verdicts if v.ok and v.damaged_ancestor is not None)
        return CheckpointAuditFailed(failure_message(failed, aside), failed)

    # -- worker side ----------------------------------------------------------------------------------------

    def _work(self) -> None:
        try:
            try:
                self._boot()
            except Exception as exc:  # noqa: BLE001 - the audits then start their own worker (and say why not)
                log.warning("ckptaudit guard: the audit worker did not start (%s: %s); each audit retries",
                            type(exc).__name__, exc)
            finally:
                self._ready.set()
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                verdict = self._judge(job)
                self._record(job, verdict)
                self._sweep()  # before the verdict is published: wait() returns with the orphans gone
                with self._cond:
                    self._verdicts.append(verdict)
                    if verdict.ok is False and self._failed is None:
                        self._failed = verdict
                    self._live.remove(job)
                    self._open[job.point] -= 1
                    if not self._open[job.point]:
                        del self._open[job.point]
                    self._cond.notify_all()
                self._settle(job, verdict.ok, done=True, descends=verdict.damaged_ancestor is not None)
        finally:
            self._process.stop()

    def _record(self, job: _Job, verdict: Verdict) -> None:
        """(worker, after each verdict) The save joins the run's lineage: the next save's parent, and the damaged
        ancestor of every later save when its failure damaged the live training state."""
        attested = job.attested or {}
        word = {True: "pass", False: "fail", None: "not-judged"}[verdict.ok]
        saved = SaveRecord(self.lineage.name(job.checkpoint), attested.get("root_digest"), word,
                           attested.get("digest") if verdict.passport else None, job.step)
        with self._cond:
            self.lineage.record(saved, verdict.damage or None)

    def _boot(self) -> None:
        """(worker thread, once) The worker process started and ready, or the audit engine imported."""
        if self.background == "process":
            self._process.spawn()
        else:
            from ckptaudit.integrations.guard_worker import warm

            warm()  # the engine's imports, paid here rather than by the first audit

    def _judge(self, job: _Job) -> Verdict:
        if job.remote is not None:
            return judge_remote(job, self._run_audit, self.lineage, passport=self.passport, signing=self.signing,
                                on_failure=self.on_failure)
        if job.ready is not None:
            try:
                job.ready.result()
            except Exception as exc:  # noqa: BLE001 - a failed save is reported, never kills the worker
                log.warning("ckptaudit guard: the asynchronous save of %s failed (%s: %s); not judged",
                            job.checkpoint, type(exc).__name__, exc)
                return Verdict(job.checkpoint, job.step, None, "not judged", (), None, None, 0.0,
                               time.monotonic() - job.submitted, f"the save failed: {type(exc).__name__}: {exc}")
            try:
                pin = pinning.pin(job.checkpoint, job.pins)
            except OSError:
                pin = None
            with self._cond:
                job.pin, job.ready = pin, None
        start = time.monotonic()
        queued = start - job.submitted
        pin = job.pin
        target = pin.path if pin is not None else job.checkpoint
        draft = (os.path.join(pin.folder, "report" + REPORT_SUFFIX) if pin is not None and pin.folder
                 else f"{job.report}.tmp-{os.getpid()}-{threading.get_ident()}")
        paper = None if not self.passport else passport_request(
            self.lineage.lineage(), self.signing, pin.folder if pin is not None else None, job.checkpoint)
        try:
            try:
                result = self._run_audit(target, draft, job.checkpoint, paper)
            except Exception as exc:  # noqa: BLE001 - any failure of one audit is reported, never kills the loop
                log.warning("ckptaudit guard: %s was not judged: the audit could not run (%s: %s); it stays "
                            "where it is", job.checkpoint, type(exc).__name__, exc)
                return Verdict(job.checkpoint, job.step, None, "not judged", (), None, None,
                               time.monotonic() - start, queued, f"{type(exc).__name__}: {exc}")
            seconds = time.monotonic() - start
            with self._cond:  # against detach(): the pin's record and its files are read together
                why = pin.changed() if pin is not None else None
                state = pin.at_checkpoint() if pin is not None else (
                    "same" if os.path.lexists(job.checkpoint) else "gone")
            if why:
                log.warning("ckptaudit guard: %s was not judged: it was replaced or rewritten in place while it "
                            "waited for its audit (%s), so the bytes the audit read may not be the bytes saved; "
                            "nothing is quarantined", job.checkpoint, why)
                return Verdict(job.checkpoint, job.step, None, "not judged", (), None, None, seconds, queued,
                               f"replaced: {why}")
            return self._decide(job, result, state, draft, seconds, queued)
        finally:
            for left in (draft, *passport_drafts(paper)):
                if os.path.exists(left):
                    os.remove(left)
            if pin is not None and not (job.keep_pin and self._status_of_kept(job, pin)):
                pin.release()

    def _status_of_kept(self, job: _Job, pin: pinning.Pin) -> bool:
        """(worker) Whether ``pin`` became the kept pin of its checkpoint (set by :meth:`_decide`)."""
        with self._cond:
            kept = self._kept.get(_key(job.checkpoint))
            return kept is not None and kept[0] is pin

    def _decide(self, job: _Job, result: dict[str, Any], state: str, draft: str, seconds: float,
                queued: float) -> Verdict:
        """(worker) Record the verdict of what was saved: report, passport, quarantine, the integration's hooks."""
        ok, summary, codes = bool(result["ok"]), str(result["summary"]), tuple(result["codes"])
        pin = job.pin
        note = ""
        where: str | None = None
        moved: str | None = None
        job.attested = result.get("passport")
        damaged = self.lineage.damaged
        ancestor = damaged.checkpoint if damaged is not None else None
        if state == "replaced":
            note = ("replaced since it was saved: this is the verdict of the content saved then; the new content "
                    "has its own audit")
        elif state == "gone":
            note = "deleted before its verdict (retention): judged from its pin; no report is left behind"
        self._settle(job, ok, descends=ancestor is not None)  # before the hooks: on_pass's retention sees it
        if ok:
            papers = None
            if ancestor is not None and state == "same":  # moved aside as a failure is: its report, passport follow
                moved = quarantine(job.checkpoint, job.checkpoint, job.quarantine_to, job.after_quarantine,
                                   descends_why(ancestor))
            if state == "same":
                home = moved or job.checkpoint
                where = self._place(draft, report_path(moved) if moved else job.report, home)
                papers = place_passport(job.attested, home)
                if papers is not None:
                    with self._cond:  # swept with the report when the checkpoint is deleted
                        self._placed[papers] = home
            if ancestor is not None:
                advice = descendant_advice(ancestor, moved, self.lineage.last_passed())
                log.warning("ckptaudit guard: %s passed its own audit, but %s", job.checkpoint, advice)
                return Verdict(job.checkpoint, job.step, True, summary, codes, where, moved, seconds, queued, "",
                               note, advice=advice, passport=papers, damaged_ancestor=ancestor)
            log.info("ckptaudit guard: %s passed (%.2f s): %s%s", job.checkpoint, seconds, summary,
                     f" ({note})" if note else "")
            if job.keep_pin and pin is not None and pin.folder is not None:
                shutil.copyfile(where or draft, os.path.join(pin.folder, "kept" + REPORT_SUFFIX))
                with self._cond:
                    old = self._kept.get(_key(job.checkpoint))
                    self._kept[_key(job.checkpoint)] = (pin, job.step)
                if old is not None:
                    old[0].release()
            if state == "same" and job.on_pass is not None:
                try:
                    job.on_pass(job.checkpoint)
                except Exception as exc:  # noqa: BLE001
                    log.error("ckptaudit guard: %s passed, but updating the library's pointer failed (%s: %s)",
                              job.checkpoint, type(exc).__name__, exc)
            return Verdict(job.checkpoint, job.step, True, summary, codes, where, None, seconds, queued, "", note,
                           passport=papers)
        source = job.checkpoint if state == "same" else (pin.path if state == "replaced" and pin is not None
                                                         else None)
        if source is not None:
            moved = quarantine(job.checkpoint, source, job.quarantine_to, job.after_quarantine)
            if moved is not None:
                where = self._place(draft, report_path(moved), moved)
        damage = classify(job.live)
        advice = failure_advice(damage, job.live, self.lineage.last_passed())
        log.warning("ckptaudit guard: %s FAILED its audit (%s)%s; report: %s%s: %s%s", job.checkpoint,
                    ", ".join(sorted(set(codes))), f", moved to {moved}" if moved else "", where,
                    f" ({note})" if note else "", advice,
                    "; stopping training at the next step" if self.on_failure == "stop" else "")
        return Verdict(job.checkpoint, job.step, False, summary, codes, where, moved, seconds, queued, "", note,
                       damage=damage, advice=advice, damaged_ancestor=ancestor)

    def _settle(self, job: _Job, ok: bool | None, done: bool = False, descends: bool = False) -> None:
        """(worker) :meth:`status` of ``job``'s checkpoint once it has a verdict, unless a newer save of the same
        path still waits for one (``done``: ``job`` has left the pending list; ``descends``: from damage)."""
        word = "descends from damage" if ok and descends else {True: "passed", False: "failed", None: "not judged"}[ok]
        with self._cond:
            if sum(j.checkpoint == job.checkpoint for j in self._live) <= (0 if done else 1):
                self._status[_key(job.checkpoint)] = word

    def _place(self, draft: str, where: str, checkpoint: str) -> str:
        """(worker) Move the report drafted in the pin (or beside) to ``where``, atomically."""
        try:
            os.replace(draft, where)
        except OSError:
            shutil.move(draft, where)  # another filesystem: copied, then the draft removed
        with self._cond:
            self._placed[where] = checkpoint
        return where

    def _sweep(self) -> None:
        """(worker, after each verdict; close) Remove the reports this guard wrote for checkpoints that are gone
        (deleted by the library's retention, or by hand): no ``checkpoint-N.ckptaudit.json`` is left orphaned."""
        with self._cond:
            placed = list(self._placed.items())
        for rep, ckpt in placed:
            if os.path.lexists(ckpt):
                continue
            try:
                os.remove(rep)
                log.info("ckptaudit guard: removed %s: %s was deleted", rep, ckpt)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("ckptaudit guard: could not remove the orphaned report %s (%s)", rep, exc)
            with self._cond:
                if self._placed.get(rep) == ckpt:
                    del self._placed[rep]

    def _run_audit(self, checkpoint: str, where: str, as_path: str,
                   passport: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.background == "process":
            return self._process.request({"checkpoint": checkpoint, "report": where, "as_path": as_path,
                                          "options": self.audit_options, "passport": passport})
        from ckptaudit.integrations.guard_worker import audit_to_file

        return audit_to_file(checkpoint, where, self.audit_options, as_path, passport)
