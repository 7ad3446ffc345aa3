"""The guard's side of its worker process (``Guard(background="process")``): start it, send it one request per
line, read one answer per line, stop it. The process itself is :mod:`ckptaudit.integrations.guard_worker`.

Which thread runs what: only the guard's worker thread (never the training thread) talks to the process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

__all__ = ["WORKER_ONE_THREAD", "WorkerProcess", "worker_env"]

WORKER_ONE_THREAD = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")
"""Set to 1 in the worker process's environment: NumPy's BLAS would otherwise start a thread per core."""


def worker_env() -> dict[str, str]:
    """(training process) The audit worker's environment: this one, with one thread per numerical library (the
    worker scans with one thread and lowers its own priority first thing: :mod:`ckptaudit.integrations.guard_worker`)."""
    return {**os.environ, **dict.fromkeys(WORKER_ONE_THREAD, "1")}


class WorkerProcess:
    """(guard's worker thread) The long-lived child interpreter that runs the audits, started on first need."""

    def __init__(self) -> None:
        self.child: subprocess.Popen[str] | None = None
        """The running process, or ``None`` (not started yet, exited, or stopped)."""

    def spawn(self) -> subprocess.Popen[str]:
        """Start the worker process and wait for its ready line (priority lowered, engine imported)."""
        child = subprocess.Popen([sys.executable, "-m", "ckptaudit.integrations.guard_worker"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, bufsize=1, env=worker_env())
        self.child = child
        assert child.stdout is not None
        line = child.stdout.readline()
        if not line:
            code = child.wait()
            self.child = None
            raise RuntimeError(f"the audit worker process exited with code {code} before it was ready")
        return child

    def request(self, req: dict[str, Any]) -> dict[str, Any]:
        """Send one request (starting the process when it is not running) and return its answer; an answer that
        says ``"error"``, or a process that exits, raises :class:`RuntimeError`."""
        child = self.child
        if child is None or child.poll() is not None:
            child = self.spawn()
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(json.dumps(req) + "\n")
        child.stdin.flush()
        line = child.stdout.readline()
        if not line:
            code = child.wait()
            self.child = None
            raise RuntimeError(f"the audit worker process exited with code {code}")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def stop(self) -> None:
        """Ask the process to quit and reap it (killed after 30 s). Idempotent."""
        child, self.child = self.child, None
        if child is None:
            return
        try:
            if child.stdin is not None:
                # A quit line, not only EOF: a process forked from training (a DataLoader worker) may hold the
                # pipe's write end open, and the worker would never see EOF.
                try:
                    child.stdin.write(json.dumps({"quit": True}) + "\n")
                    child.stdin.flush()
                except OSError:
                    pass
                child.stdin.close()
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
