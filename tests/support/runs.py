"""How the tests run ckptaudit and this folder's job scripts: the command line in this process, ``torchrun`` on
local ranks, and a job script in a fresh interpreter (so that a library's process-wide state stays out of the test
process)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

SUPPORT = Path(__file__).resolve().parent
SRC = SUPPORT.parents[1] / "src"
TORCHRUN_TIMEOUT_S = 240


def cli(*argv: str) -> tuple[int, str, str]:
    """``ckptaudit ARGV`` in this process: the exit code, standard output and standard error."""
    from ckptaudit.cli import main

    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def torchrun(nproc: int, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone -m ckptaudit ARGV`` (c10d rendezvous on a free port of 127.0.0.1) as a child, killed
    with its whole process group when it outlives :data:`TORCHRUN_TIMEOUT_S`."""
    import pytest

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--monitor-interval=0.2", "-m", "ckptaudit", *argv]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TORCHRUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun did not finish in {TORCHRUN_TIMEOUT_S} s:\n{err[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_script(script: str, what: str, out: str, *, env: dict[str, str], timeout_s: float) -> \
        subprocess.CompletedProcess[str]:
    """(test process) ``python SCRIPT WHAT OUT`` in a fresh interpreter with ``env`` added to this environment, the
    package under test and this folder importable, in ``out`` (whatever a library drops into its working directory
    stays out of the repository). The caller judges the exit code."""
    full = {**os.environ, **env,
            "PYTHONPATH": os.pathsep.join([str(SRC), str(SUPPORT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, os.path.abspath(script), what, out], env=full, cwd=out,
                          capture_output=True, text=True, timeout=timeout_s, check=False)


def run_job(script: str, what: str, out: str, *, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """(test process) Run job ``what`` of ``script`` (:func:`run_script`); its ``OUT/result.json`` with the job's
    standard error as ``log``, or raise with its output."""
    proc = run_script(script, what, out, env=env, timeout_s=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(script).stem} {what} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                           f"{proc.stderr[-8000:]}")
    with open(os.path.join(out, "result.json")) as fh:
        result: dict[str, Any] = json.load(fh)
    result["log"] = proc.stderr
    return result
