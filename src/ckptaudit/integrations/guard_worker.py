"""The guard's child process (``Guard(background="process")``): one JSON request per line on stdin, one answer
per line on stdout, until stdin closes.

    (first, once started)                                  ->  {"ready": true, "priority": {...}}
    {"checkpoint": PATH, "report": PATH, "as_path": PATH, "options": {...}, "passport": {...} | null}
                                                           ->  {"ok": bool, "summary": str, "codes": [...],
                                                                "passport": {...}}
                                                               or {"error": "Type: message"}
    {"quit": true}                                         ->  (exits)

``as_path`` is the path the report names (the checkpoint's own; ``checkpoint`` is its pinned copy). The ready
line comes after the audit engine, NumPy and every reader are imported (:func:`warm`), so the first audit costs what the others do: the guard starts
this process when it is created, off the training thread, and waits for that line on its worker thread.

Started as ``python -m ckptaudit.integrations.guard_worker`` (never by re-importing the training script, as
multiprocessing's spawn would), it imports no torch: the audit reads files with NumPy.

Cheap by construction for the training process beside it: before it imports anything else, the worker lowers
itself to the lowest CPU priority (:func:`lower_priority`: ``nice`` 19 and, on Linux, ``SCHED_IDLE``, so it
runs only on CPU time nothing else wants) and to the idle I/O class (Linux ``ioprio_set``, best effort), and it
scans with one thread (the guard passes ``jobs=1`` unless told otherwise, and starts it with ``OMP_NUM_THREADS=1`` and the like,
so no numerical library starts a thread pool of its own).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from dataclasses import replace
from typing import Any

# ioprio_set(2): which = IOPRIO_WHO_PROCESS, the class in the top bits; syscall numbers per architecture
_IOPRIO_WHO_PROCESS = 1
_IOPRIO_CLASS_IDLE = 3
_IOPRIO_CLASS_SHIFT = 13
_IOPRIO_SYSCALLS = {"x86_64": (251, 252), "aarch64": (30, 31), "ppc64le": (273, 274), "s390x": (282, 283)}
"""(ioprio_set, ioprio_get) by ``platform.machine()``."""


def audit_to_file(checkpoint: str, where: str, options: dict[str, Any], as_path: str | None = None,
                  passport: dict[str, Any] | None = None) -> dict[str, Any]:
    """(worker) Audit ``checkpoint``, write its JSON report to ``where`` atomically, return the gist. ``as_path``:
    the path the report names (the checkpoint's own, when ``checkpoint`` is its pinned copy). ``passport``:
    ``{"output": PATH, "key": PATH | None, "certificate": PATH | None, "cert_chain": [PATH], "sigstore": bool,
    "durable": bool, "lineage": {...}}`` also writes the checkpoint's passport there, of the
    same bytes, with this audit's report and the digests taken in its own pass (:func:`ckptaudit.passport.attest`,
    :func:`~ckptaudit.passport.digests.audit_digests`: nothing read twice); the answer's ``"passport"`` then holds its
    ``file``, ``digest`` and ``root_digest`` (or an ``error``: the verdict stands without a passport)."""
    from ckptaudit.api import audit

    report, digests = _audit_digesting(checkpoint, options) if passport is not None else (None, None)
    report = report or audit(checkpoint, **options)
    if as_path is not None:
        report = replace(report, raw=replace(report.raw, path=as_path))
    tmp = f"{where}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(report.to_json())
        fh.write("\n")
    os.replace(tmp, where)
    answer: dict[str, Any] = {"ok": report.ok, "summary": report.summary,
                              "codes": [f.code for f in report.failing]}
    if passport is not None:
        answer["passport"] = _attest(checkpoint, report.raw, options, passport, digests)
    return answer


def _audit_digesting(checkpoint: str, options: dict[str, Any]) -> tuple[Any, Any]:
    """(worker) :func:`ckptaudit.audit` of a local ``checkpoint`` whose passport is asked for, with the passport's
    digests asked of the audit's own pass; ``(None, None)`` where they cannot be (a URL, a symbolic link inside:
    the plain audit runs, and the passport says why there is none)."""
    from ckptaudit.api import Report, audit_options
    from ckptaudit.auditing.judge import run_audit
    from ckptaudit.findings import Severity
    from ckptaudit.ondisk.passport import is_url
    from ckptaudit.options import AUDIT_OPTIONS, resolve
    from ckptaudit.passport import PassportError
    from ckptaudit.passport.digests import audit_digests

    if is_url(checkpoint):
        return None, None
    opts = resolve("ckptaudit guard", options, AUDIT_OPTIONS)
    engine = audit_options(opts)
    try:
        digests = audit_digests(checkpoint, jobs=engine.jobs)
    except (PassportError, OSError):
        return None, None
    return Report(run_audit(checkpoint, engine, digests=digests.scan), Severity.parse(opts["fail_on"])), digests


def _attest(checkpoint: str, raw: Any, options: dict[str, Any], spec: dict[str, Any],
            digests: Any = None) -> dict[str, Any]:
    """(worker) The passport of the bytes just audited (``raw``: their audit; ``digests``: the ones its pass
    took), written to ``spec["output"]``."""
    from ckptaudit.api import audit_options
    from ckptaudit.options import AUDIT_OPTIONS, resolve
    from ckptaudit.passport import attest
    from ckptaudit.passport.document import lineage_from_json
    from ckptaudit.passport.keyless import SigstoreSigning

    try:
        lineage = lineage_from_json(spec.get("lineage"), "the guard's lineage")
        opts = audit_options(resolve("ckptaudit guard", options, AUDIT_OPTIONS))
        made = attest(checkpoint, key=spec.get("key"), output=spec["output"], lineage=lineage, report=raw,
                      options=opts, jobs=opts.jobs, digests=digests,
                      certificate=spec.get("certificate"), cert_chain=spec.get("cert_chain") or (),
                      sigstore=SigstoreSigning() if spec.get("sigstore") else None,
                      durable=bool(spec.get("durable", True)))
    except Exception as exc:  # noqa: BLE001 - the verdict stands; the guard says why there is no passport
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"file": made.file, "digest": made.digest, "root_digest": made.root_digest, "signed": made.signed}


def _ioprio_syscall(index: int, *args: int) -> int:
    """(this process) Call ioprio_set (index 0) or ioprio_get (1) through libc's ``syscall``; -1 where unknown."""
    import ctypes
    import platform

    numbers = _IOPRIO_SYSCALLS.get(platform.machine())
    if numbers is None or not sys.platform.startswith("linux"):
        return -1
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.syscall(numbers[index], *args))


def io_priority_class(pid: int = 0) -> int | None:
    """The I/O scheduling class of ``pid`` (0: this process; 3 is idle), or ``None`` where it cannot be read."""
    value = _ioprio_syscall(1, _IOPRIO_WHO_PROCESS, pid)
    return None if value < 0 else value >> _IOPRIO_CLASS_SHIFT


def lower_priority() -> dict[str, str]:
    """(worker process, once, first thing) Lowest CPU priority and idle I/O priority for this whole process.

    Best effort, each step on its own: ``os.nice`` to 19 (POSIX), ``SCHED_IDLE`` (Linux: runs only when a
    core would otherwise idle), the idle I/O class (Linux ``ioprio_set``; honoured by the BFQ and CFQ I/O
    schedulers, a no-op under ``none``/``mq-deadline``). A step the platform refuses is recorded, never raised:
    the audit still runs, at a higher priority. Returns what each step did (``"ok"`` or why not).
    """
    done: dict[str, str] = {}
    try:
        os.nice(19 - os.getpriority(os.PRIO_PROCESS, 0))
        done["nice"] = "ok"
    except (AttributeError, OSError) as exc:
        done["nice"] = f"not applied: {exc}"
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        done["sched_idle"] = "ok"
    except (AttributeError, OSError) as exc:
        done["sched_idle"] = f"not applied: {exc}"
    try:
        rc = _ioprio_syscall(0, _IOPRIO_WHO_PROCESS, 0, _IOPRIO_CLASS_IDLE << _IOPRIO_CLASS_SHIFT)
        done["ioprio_idle"] = "ok" if rc == 0 else "not applied: ioprio_set unavailable or refused"
    except OSError as exc:
        done["ioprio_idle"] = f"not applied: {exc}"
    return done


WARM_PACKAGES = ("ckptaudit.formats", "ckptaudit.layouts", "ckptaudit.checks", "ckptaudit.report")
"""Imported whole by :func:`warm`: the readers, layouts, checks and renderers an audit imports lazily."""


def warm() -> None:
    """(worker, before the first audit) Import what an audit imports on first use (the engine, NumPy, every
    reader, layout, check and renderer): ~0.3 s that would otherwise fall on the first verdict (measured by
    bench/bench_guard.py). A module that cannot be imported here is left to the audit that needs it."""
    import importlib
    import pkgutil

    for name in (
        "numpy", "ckptaudit.api", "ckptaudit.auditing.judge", "ckptaudit.auditing.scan", "ckptaudit.auditing.tensor_scan",
    ):
        importlib.import_module(name)
    for package in WARM_PACKAGES:
        module = importlib.import_module(package)
        # Recursively: the readers are sub-packages by container (formats.pickle, formats.zip, ...).
        for info in pkgutil.walk_packages(module.__path__, package + ".", onerror=lambda _name: None):
            try:
                importlib.import_module(info.name)
            except Exception:  # noqa: BLE001,S112 - optional parts (a remote reader's client) load when needed
                continue


def main() -> int:
    priority = lower_priority()
    warm()  # before the ready line: the guard waits for it off the training thread

    sys.stdout.write(json.dumps({"ready": True, "priority": priority}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if req.get("quit"):
                break
            answer = audit_to_file(req["checkpoint"], req["report"], req.get("options", {}), req.get("as_path"),
                                   req.get("passport"))
        except Exception as exc:  # noqa: BLE001 - reported to the guard, which logs it as "not judged"
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
