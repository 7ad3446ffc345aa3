"""The guard's audit worker process is cheap by construction: lowest CPU priority (nice 19, SCHED_IDLE), idle
I/O class, and one thread, read from the kernel's view of the real worker process after a real audit."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ckptaudit.integrations.guard import Guard
from ckptaudit.integrations.guard_worker import io_priority_class
from real_checkpoints import trained

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE and ioprio are Linux's")


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("Threads:"))


def test_the_worker_process_runs_at_idle_cpu_and_io_priority_on_one_thread(tmp_path: Path) -> None:
    ckpt = trained(tmp_path / "step=2.ckpt")
    guard = Guard(background="process")
    try:
        guard.submit(str(ckpt), step=2)
        assert guard.wait(120)
        child = guard._child
        assert child is not None and child.poll() is None, "the worker is long-lived: alive between audits"
        pid = child.pid
        assert os.getpriority(os.PRIO_PROCESS, pid) == 19
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE
        io_class = io_priority_class(pid)
        if io_class is not None:  # an architecture whose ioprio syscall number we know
            assert io_class == 3, f"I/O class {io_class}, not idle (3)"
        assert _threads(pid) == 1, "the worker scans on its main thread; no BLAS or scan pool"
        assert os.sched_getscheduler(0) != os.SCHED_IDLE, "the training process keeps its priority"
        (verdict,) = guard.verdicts
        assert verdict.ok is True
    finally:
        assert guard.close(120)
