"""Session fixtures built once per run, whether the suite runs in one process or in pytest-xdist's workers.

Under xdist each worker is its own pytest session, so a plain session fixture (a library's writer: DeepSpeed's four
configurations, the FSDP2 run) would be written once per worker that needs it. :func:`build_once` writes it once
for the whole run: the first worker to ask builds it under a file lock in the run's shared temporary directory and
records what it returned (or the error it raised); the others wait on the lock, bounded, and read that record.
Without xdist it is a plain ``mktemp`` and a call.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

RECORD = "shared-fixture.json"


def worker_id() -> str:
    """This process's xdist worker (``gw0``, ...), or ``""`` when the suite runs in one process."""
    return os.environ.get("PYTEST_XDIST_WORKER", "")


def build_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Any], *,
               wait_s: float) -> tuple[Path, Any]:
    """(test process) ``(out, build(out))`` for the folder ``out`` fixture ``name`` is written into, built once per
    run. ``build``'s result must be JSON (a worker that did not build it reads it back). A build that raised raises
    in every worker that asks, with the builder's traceback, without building again. ``wait_s``: how long a worker
    waits for another's build (its writer's own deadline, plus margin): past it, the test fails naming the fixture."""
    if not worker_id():
        out = tmp_path_factory.mktemp(name)
        return out, build(out)
    from filelock import FileLock, Timeout

    root = tmp_path_factory.getbasetemp().parent  # every worker's basetemp lies in the run's one folder
    out = root / f"shared-{name}"
    record = root / f"shared-{name}.json"
    try:
        with FileLock(str(root / f"shared-{name}.lock"), timeout=wait_s):
            if not record.exists():
                out.mkdir(exist_ok=True)
                try:
                    result = build(out)
                except BaseException as exc:
                    if not isinstance(exc, Exception):
                        raise  # a timeout or an interrupt: this worker's own failure, the next one tries again
                    _write(record, {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"})
                    raise
                _write(record, {"result": result, "worker": worker_id()})
                return out, result
    except Timeout:
        pytest.fail(f"fixture {name}: another xdist worker was still building it after {wait_s:.0f} s", pytrace=False)
    got = json.loads(record.read_text())
    if "error" in got:
        raise RuntimeError(f"fixture {name} failed in the worker that built it:\n{got['error']}")
    return out, got["result"]


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)
