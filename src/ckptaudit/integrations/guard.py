"""The guard every integration shares: audit each new checkpoint in the background, quarantine a failed one.

Which process runs what: only the process that owns the checkpoint's files (rank 0, or the rank that wrote
them) creates a :class:`Guard` and calls :meth:`Guard.submit` right after the library's save returns. The
audit (:func:`ckptaudit.audit`, nothing re-implemented) runs on one background worker, one long-lived child
interpreter at the lowest CPU and I/O priority, scanning with one thread (``background="process"``, the default:
measured cheaper for the training loop, bench/bench_guard.py; the training thread's part is a message on a queue)
or a thread of this process (``background="thread"``: no second interpreter, but it shares the GIL), while
training goes on; saves that come while an audit is running wait in a queue, in order (logged), and no step
ever waits. Then, on the worker:

1. the JSON report is written beside the checkpoint, ``<checkpoint>.ckptaudit.json`` (atomically);
2. a checkpoint that fails (a finding at or above ``fail_on``) is quarantined: moved to a name no resume path
   picks (:func:`quarantine_name`: ``quarantined-<dir>``, ``<file>.quarantined``), its report with it, and the
   integration's own ``quarantine`` callable repairs that library's pointer (Lightning's ``last.ckpt``, ...);
   a checkpoint that passes calls the integration's ``on_pass`` (DeepSpeed's ``latest`` moves only then);
3. with ``on_failure="stop"``, :meth:`Guard.should_stop` turns true; the integration polls it at each step
   boundary and stops training through the library's own mechanism.

An audit that cannot run (the directory vanished under a retention policy, a bug) gives a verdict that is
*not judged*: logged, nothing quarantined, training not stopped. At the end of training the integration calls
:meth:`Guard.close`, which waits for the audits still queued.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from ckptaudit.ondisk.quarantine import REPORT_SUFFIX, is_quarantined, quarantine_name

__all__ = ["BACKGROUNDS", "ON_FAILURE", "REPORT_SUFFIX", "Guard", "Verdict", "is_quarantined", "quarantine_name",
           "report_path", "stop_requested"]

log = logging.getLogger("ckptaudit.guard")

ON_FAILURE = ("warn", "stop")
BACKGROUNDS = ("thread", "process")


def report_path(checkpoint: str) -> str:
    """Where the guard writes the report of ``checkpoint``: beside it, ``<checkpoint>.ckptaudit.json``."""
    return os.path.normpath(checkpoint) + REPORT_SUFFIX


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of one checkpoint's audit in the loop."""

    checkpoint: str
    """The path audited (where the library saved it)."""
    step: int | None
    ok: bool | None
    """``True`` passed, ``False`` failed, ``None`` not judged (the audit could not run: see ``error``)."""
    summary: str
    codes: tuple[str, ...]
    """The codes of the findings at or above ``fail_on``."""
    report: str | None
    """Where the JSON report lies (after any quarantine), or ``None``."""
    quarantined_to: str | None
    seconds: float
    """Wall time of the audit on the worker."""
    queued_s: float
    """Time between the save and the start of its audit (waiting behind earlier audits)."""
    error: str = ""


@dataclass(frozen=True, slots=True)
class _Job:
    checkpoint: str
    step: int | None
    quarantine: Callable[[str], str | None] | None
    on_pass: Callable[[str], None] | None
    submitted: float
    report: str
    """Where the report goes (``<checkpoint>.ckptaudit.json`` unless the integration names another place)."""
    signature: tuple[int, int, int] | None
    """(inode, mtime_ns, size) at submit: a checkpoint replaced since (Lightning rewrites ``last.ckpt``) is not
    the one audited, and is never quarantined for it."""
    ready: Future[Any] | None = None
    """An asynchronous save's future: the worker waits for it (never the training loop) before the audit."""


def _signature(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class Guard:
    """Audits checkpoints as they are saved, in the background (see the module docstring).

    ``on_failure``: ``"warn"`` (log, quarantine, go on) or ``"stop"`` (also make :meth:`should_stop` true);
    ``background``: ``"process"`` (default) or ``"thread"``; every other keyword is an option of :func:`ckptaudit.audit`
    (``quick``, ``fail_on``, ``master_dtype``, ``require``, ...), checked here, before training starts.
    """

    def __init__(self, *, on_failure: str = "warn", background: str = "process", **audit_options: Any) -> None:
        from ckptaudit.options import AUDIT_OPTIONS, resolve

        if on_failure not in ON_FAILURE:
            raise ValueError(f"ckptaudit guard: on_failure={on_failure!r} is not valid; pass 'warn' (log and "
                             "quarantine) or 'stop' (also stop training at the next step boundary)")
        if background not in BACKGROUNDS:
            raise ValueError(f"ckptaudit guard: background={background!r} is not valid; pass 'thread' or "
                             "'process'")
        resolve("ckptaudit guard", audit_options, AUDIT_OPTIONS)
        self.on_failure = on_failure
        self.background = background
        # One scanning thread unless told otherwise: the audit runs beside training, which owns the cores.
        self.audit_options = {"jobs": 1, **audit_options}
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._cond = threading.Condition()
        self._pending = 0
        self._verdicts: list[Verdict] = []
        self._failed: Verdict | None = None
        self._thread: threading.Thread | None = None
        self._child: subprocess.Popen[str] | None = None
        self._closed = False

    # -- training side (the owning process's main thread) ----------------------------------------------------

    def submit(self, checkpoint: str, *, step: int | None = None,
               quarantine: Callable[[str], str | None] | None = None,
               on_pass: Callable[[str], None] | None = None, report: str | None = None,
               ready: Future[Any] | None = None) -> None:
        """Queue ``checkpoint`` (just saved, complete) for an audit; returns at once.

        ``ready``: the future of an asynchronous save still writing ``checkpoint``; the worker waits for it
        before the audit (a save that fails gives a *not judged* verdict), and the queue keeps its place.

        ``report``: where to write the JSON report instead of ``<checkpoint>.ckptaudit.json`` (it then stays
        there when the checkpoint is quarantined).
        ``quarantine(path)`` replaces the default move (:func:`quarantine_name`) and returns where the checkpoint
        went (or ``None`` if it stayed); ``on_pass(path)`` runs when it passes. Both run on the worker.
        """
        if self._closed:
            raise RuntimeError("ckptaudit guard: submit() after close(); create a new Guard")
        with self._cond:
            ahead = self._pending
            self._pending += 1
        if ahead:
            log.info("ckptaudit guard: %s saved while %d audit(s) are pending; queued behind them", checkpoint, ahead)
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="ckptaudit-guard", daemon=True)
            self._thread.start()
        self._jobs.put(_Job(checkpoint, step, quarantine, on_pass, time.monotonic(),
                            report or report_path(checkpoint), None if ready else _signature(checkpoint), ready))

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
    def pending(self) -> int:
        """Audits queued or running."""
        with self._cond:
            return self._pending

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted audit has finished (True) or ``timeout`` seconds pass (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Wait for the pending audits (``timeout``: give up after that many seconds, logged), then stop the
        worker. Returns whether every audit finished."""
        done = self.wait(timeout)
        if not done:
            log.warning("ckptaudit guard: %d audit(s) still running after %.0f s; not waiting for them",
                        self.pending, timeout or 0.0)
        self._closed = True
        if self._thread is not None and done:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
        return done

    # -- worker side ----------------------------------------------------------------------------------------

    def _work(self) -> None:
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                verdict = self._judge(job)
                with self._cond:
                    self._verdicts.append(verdict)
                    if verdict.ok is False and self._failed is None:
                        self._failed = verdict
                    self._pending -= 1
                    self._cond.notify_all()
        finally:
            self._stop_child()

    def _judge(self, job: _Job) -> Verdict:
        if job.ready is not None:
            try:
                job.ready.result()
            except Exception as exc:  # noqa: BLE001 - a failed save is reported, never kills the worker
                log.warning("ckptaudit guard: the asynchronous save of %s failed (%s: %s); not judged",
                            job.checkpoint, type(exc).__name__, exc)
                return Verdict(job.checkpoint, job.step, None, "not judged", (), None, None, 0.0,
                               time.monotonic() - job.submitted, f"the save failed: {type(exc).__name__}: {exc}")
            job = replace(job, signature=_signature(job.checkpoint), ready=None)
        start = time.monotonic()
        queued = start - job.submitted
        where = job.report
        try:
            result = self._run_audit(job.checkpoint, where)
        except Exception as exc:  # noqa: BLE001 - any failure of one audit is reported, never kills the loop
            log.warning("ckptaudit guard: %s was not judged: the audit could not run (%s: %s); it stays "
                        "where it is", job.checkpoint, type(exc).__name__, exc)
            return Verdict(job.checkpoint, job.step, None, "not judged", (), None, None,
                           time.monotonic() - start, queued, f"{type(exc).__name__}: {exc}")
        seconds = time.monotonic() - start
        ok, summary, codes = bool(result["ok"]), str(result["summary"]), tuple(result["codes"])
        moved: str | None = None
        if ok:
            log.info("ckptaudit guard: %s passed (%.2f s): %s", job.checkpoint, seconds, summary)
            if job.on_pass is not None:
                try:
                    job.on_pass(job.checkpoint)
                except Exception as exc:  # noqa: BLE001
                    log.error("ckptaudit guard: %s passed, but updating the library's pointer failed (%s: %s)",
                              job.checkpoint, type(exc).__name__, exc)
        elif _signature(job.checkpoint) != job.signature:
            log.warning("ckptaudit guard: %s FAILED its audit (%s), but it was replaced since it was saved; the new "
                        "one is not quarantined for it. Report: %s", job.checkpoint, ", ".join(sorted(set(codes))),
                        where)
        else:
            try:
                moved = (job.quarantine or _move_aside)(job.checkpoint)
                if moved is not None and where == report_path(job.checkpoint) and os.path.exists(where):
                    os.replace(where, report_path(moved))
                    where = report_path(moved)
            except Exception as exc:  # noqa: BLE001
                log.error("ckptaudit guard: %s failed its audit and could NOT be quarantined (%s: %s); do not "
                          "resume from it", job.checkpoint, type(exc).__name__, exc)
            log.warning("ckptaudit guard: %s FAILED its audit (%s)%s; report: %s%s", job.checkpoint,
                        ", ".join(sorted(set(codes))), f", moved to {moved}" if moved else "", where,
                        "; stopping training at the next step" if self.on_failure == "stop" else "")
        return Verdict(job.checkpoint, job.step, ok, summary, codes, where, moved, seconds, queued)

    def _run_audit(self, checkpoint: str, where: str) -> dict[str, Any]:
        if self.background == "process":
            return self._run_in_child(checkpoint, where)
        return audit_to_file(checkpoint, where, self.audit_options)

    def _run_in_child(self, checkpoint: str, where: str) -> dict[str, Any]:
        if self._child is None or self._child.poll() is not None:
            self._child = subprocess.Popen([sys.executable, "-m", "ckptaudit.integrations._worker"],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                           env=worker_env())
        assert self._child.stdin is not None and self._child.stdout is not None
        self._child.stdin.write(json.dumps({"checkpoint": checkpoint, "report": where,
                                            "options": self.audit_options}) + "\n")
        self._child.stdin.flush()
        line = self._child.stdout.readline()
        if not line:
            code = self._child.wait()
            self._child = None
            raise RuntimeError(f"the audit worker process exited with code {code}")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def _stop_child(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        try:
            if child.stdin is not None:
                child.stdin.close()
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


WORKER_ONE_THREAD = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")
"""Set to 1 in the worker process's environment: NumPy's BLAS would otherwise start a thread per core."""


def worker_env() -> dict[str, str]:
    """(training process) The audit worker's environment: this one, with one thread per numerical library (the
    worker scans with one thread and lowers its own priority first thing: :mod:`ckptaudit.integrations._worker`)."""
    return {**os.environ, **dict.fromkeys(WORKER_ONE_THREAD, "1")}


def audit_to_file(checkpoint: str, where: str, options: dict[str, Any]) -> dict[str, Any]:
    """(worker) Audit ``checkpoint``, write its JSON report to ``where`` atomically, return the gist."""
    from ckptaudit.api import audit

    report = audit(checkpoint, **options)
    tmp = f"{where}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(report.to_json())
        fh.write("\n")
    os.replace(tmp, where)
    return {"ok": report.ok, "summary": report.summary, "codes": [f.code for f in report.failing]}


def _move_aside(checkpoint: str) -> str:
    dest = quarantine_name(checkpoint)
    shutil.move(checkpoint, dest)
    return dest


def stop_requested(guard: Guard) -> bool:
    """(all ranks, collective when distributed) Whether rank 0's guard asks training to stop; every rank gets
    the same answer (a one-element all-reduce of the default group), so all of them leave the loop at the same
    step. Call it at the same point of every step on every rank. Its cost: one 4-byte all-reduce per call (a
    latency, no bandwidth), on the current CUDA device under NCCL, on the CPU under gloo; none at all with
    ``on_failure="warn"``, which never stops (every rank builds its guard with the same ``on_failure``, so no
    rank enters the collective alone)."""
    if guard.on_failure != "stop":
        return False
    import torch
    import torch.distributed as dist

    on = dist.is_available() and dist.is_initialized()
    flag = guard.should_stop() if not on or dist.get_rank() == 0 else False
    if not on or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _collective_device() -> Any:
    """The device a collective's tensor must live on for the default group's backend: NCCL needs this process's
    current CUDA device (``torch.cuda.current_device()``, set by the launcher per local rank; a bare ``"cuda"``
    would be device 0 on every rank); gloo takes CPU tensors."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
