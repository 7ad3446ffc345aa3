"""A child process that audits paths on request, under a memory limit, so tests can bound time and memory.

The parent (:class:`AuditWorker`) sends one path per line; the child runs ``ckptaudit.auditing.judge.run_audit`` on it,
renders the report as JSON and as a table (rendering must not fail either), and answers one JSON line:
``{"ok": true, "codes": [...], "seconds": s, "maxrss_mib": m}`` or ``{"ok": false, "error": traceback}``. The one
accepted error is the documented one: the top-level path is missing or unreadable (``OSError``), and then the CLI
must exit 2 naming the path.

Bounds: the parent waits at most ``timeout_s`` for each answer (a hang fails the test and the child is killed);
the child runs under ``RLIMIT_AS`` = its address space after warm-up + ``headroom_mib`` (a reader that tries to
allocate what a declared size claims gets ``MemoryError``, which ckptaudit never swallows), and reports its
peak resident set (``ru_maxrss``) after every input so the parent can bound its growth.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _vm_size_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1])
    return 0


def _serve(headroom_mib: int) -> None:
    import io
    import resource

    import ckptaudit.formats.io.safeio  # noqa: F401 - import everything the audit needs before limiting memory
    from ckptaudit.auditing.judge import run_audit
    from ckptaudit.cli import main
    from ckptaudit.report import OutputFormat, render

    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but answers on the protocol stream
    limited = False
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("limit") and not limited:
            soft = (_vm_size_kib() << 10) + (headroom_mib << 20)
            resource.setrlimit(resource.RLIMIT_AS, (soft, resource.RLIM_INFINITY))
            limited = True
        start = time.perf_counter()
        try:
            report = run_audit(request["path"])
            buf = io.StringIO()
            render(report, OutputFormat.JSON, buf)
            doc = json.loads(buf.getvalue())
            render(report, OutputFormat.TABLE, io.StringIO(), verbose=True)
            answer: dict[str, Any] = {
                "ok": True,
                "codes": sorted({f["code"] for f in doc["findings"]}),
                "findings": [[f["code"], f["subject"], f["message"][:300]] for f in doc["findings"]],
                "tensors": len(doc["tensors"]),
            }
        except OSError as exc:
            # The documented clear error: the top-level path itself is missing or unreadable. The CLI must turn
            # it into exit code 2 with a message naming the path.
            err = io.StringIO()
            code = main(["audit", request["path"], "--no-progress"], stdout=io.StringIO(), stderr=err)
            top_level = exc.filename == request["path"] or str(exc) == request["path"]
            answer = {"ok": top_level and code == 2 and request["path"] in err.getvalue(), "codes": [],
                      "findings": [], "tensors": 0, "exit": code,
                      "error": traceback.format_exc()[-4000:] + f"\nCLI exit {code}: {err.getvalue()}"}
        except BaseException:  # the test wants every failure, MemoryError included
            answer = {"ok": False, "error": traceback.format_exc()[-4000:]}
        answer["seconds"] = time.perf_counter() - start
        answer["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out.write(json.dumps(answer) + "\n")
        out.flush()


class AuditWorker:
    """Parent side: ``audit(path)`` returns the child's answer; a hang raises ``TimeoutError``."""

    def __init__(self, headroom_mib: int = 2048, timeout_s: float = 60.0) -> None:
        self.headroom_mib, self.timeout_s = headroom_mib, timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.baseline_mib = 0.0

    def start(self, warmup: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"import sys; sys.path.insert(0, {SRC!r}); import audit_worker; "
             f"audit_worker._serve({self.headroom_mib})"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            cwd=str(Path(__file__).parent), env=env,
        )
        # Warm up on real checkpoints (imports, caches), then limit the address space for what follows.
        for path in warmup:
            answer = self.audit(path, timeout_s=max(self.timeout_s, 180))
            assert answer["ok"], answer
        answer = self.audit(warmup[0], limit=True, timeout_s=max(self.timeout_s, 180))
        assert answer["ok"], answer
        self.baseline_mib = answer["maxrss_mib"]

    def audit(self, path: str, *, limit: bool = False, timeout_s: float | None = None) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"path": path, "limit": limit}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s or self.timeout_s)
        if not ready:
            self.close()
            raise TimeoutError(f"auditing {path} took more than {timeout_s or self.timeout_s} s (a hang)")
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(timeout=30)
            raise RuntimeError(f"the audit worker died (exit code {code}) on {path}")
        return dict(json.loads(line))

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(timeout=30)
            self.proc = None
