"""One configuration's outcome per checkpoint a library writer writes, so that one configuration's failure never
takes the others' tests with it, and a configuration the library refuses on this CPU is a skip that says why.

Writer side (a writer process, or rank 0 of a launch): :class:`Outcomes` runs each configuration and records it in
``<out>/configurations.json`` (``written``, ``refused`` with the library's reason, or ``failed`` with the error),
rewritten before and after each one, so a writer that dies mid-way leaves the name of the configuration it was in.
Test side: the session fixture returns :class:`Written`; ``written / "s2-fp16"`` is that configuration's path, or
skips the test (refused) or fails it naming the configuration and its error (failed, or never written).
:func:`configuration` names the configuration a rank is in, on its stderr and in its exception.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RECORD = "configurations.json"


class Refused(Exception):
    """The library itself refuses this configuration on this machine (e.g. DeepSpeed: "Type fp16 is not supported
    on your device."): the configuration's tests are skipped with this reason, never errors."""


class ConfigurationFailed(Exception):
    """A configuration's step failed; the message names the configuration, the cause is chained."""


@contextmanager
def configuration(name: str) -> Iterator[None]:
    """(any process) Run a block that writes configuration ``name``: announced on file descriptor 2 first, so the
    stderr tail of a rank killed by a signal inside it names it; an exception leaving it names it too."""
    os.write(2, f"configuration {name}: writing\n".encode())
    try:
        yield
    except (Refused, ConfigurationFailed):
        raise
    except Exception as exc:  # DCP's CheckpointException is a BaseException: wrapped below
        raise ConfigurationFailed(f"configuration {name!r} failed: {type(exc).__name__}: {exc}") from exc
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise ConfigurationFailed(f"configuration {name!r} failed: {type(exc).__name__}: {exc}") from exc


class Outcomes:
    """(writer) Each configuration's outcome, kept in ``<out>/configurations.json``."""

    def __init__(self, out: str, names: list[str]) -> None:
        self.path = os.path.join(out, RECORD)
        self.record: dict[str, dict[str, Any]] = {n: {"status": "pending"} for n in names}
        self._save()

    def run(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` as configuration ``name``; record and return its result (``None`` if it did not write)."""
        self.record[name] = {"status": "writing"}
        self._save()
        t0 = time.monotonic()
        try:
            result = fn(*args)
        except Refused as exc:
            self.set(name, "refused", str(exc), time.monotonic() - t0)
            return None
        except Exception as exc:
            self.set(name, "failed", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}", time.monotonic() - t0)
            return None
        self.set(name, "written", "", time.monotonic() - t0)
        return result

    def set(self, name: str, status: str, reason: str = "", seconds: float = 0.0) -> None:
        self.record[name] = {"status": status, **({"reason": reason} if reason else {}), "s": round(seconds, 1)}
        self._save()

    def _save(self) -> None:
        with open(self.path + ".tmp", "w") as fh:
            json.dump(self.record, fh, indent=1)
        os.replace(self.path + ".tmp", self.path)


def read(out: str | Path) -> dict[str, dict[str, Any]]:
    try:
        return json.loads((Path(out) / RECORD).read_text())
    except FileNotFoundError:
        return {}


def in_progress(out: str | Path) -> str:
    """The configuration a writer was in (for the error of a writer that died), or ``""``."""
    return next((n for n, o in read(out).items() if o["status"] == "writing"), "")


@dataclass(frozen=True)
class Written:
    """(test process) What a session fixture's writer left: ``written / name`` is configuration ``name``'s path
    (``name`` may continue past the configuration, ``"s2-bf16.zero_to_fp32.pt"``: the longest configuration name
    it starts with owns it). A refused configuration skips the test with the library's reason; a failed one, or
    one the writer never finished, fails the test with its error, naming it."""

    out: Path
    library: str

    def __truediv__(self, name: str) -> Path:
        self.require(name)
        return self.out / name

    def require(self, name: str) -> None:
        record = read(self.out)
        owner = max((c for c in record if name == c or name.startswith(c)), key=len, default=None)
        if owner is None:
            return
        outcome = record[owner]
        if outcome["status"] == "written":
            return
        import pytest

        if outcome["status"] == "refused":
            pytest.skip(f"{self.library} configuration {owner}: refused on this CPU: {outcome['reason']}")
        pytest.fail(f"{self.library} configuration {owner} was not written ({outcome['status']}):\n"
                    f"{outcome.get('reason', '')}", pytrace=False)

    def __str__(self) -> str:
        return str(self.out)


def fixture_launch(fixture: str, fn: Callable[..., Any], world_size: int, args: tuple[Any, ...],
                   **options: Any) -> list[Any]:
    """(test process) ``ckptaudit.launch`` for a session fixture whose ranks write one run: its failure names
    the fixture and the job (and, through :func:`configuration`, the configuration each rank was in), with each
    failed rank's stderr tail, in the first error every test that uses the fixture reports."""
    from ckptaudit.launch import DistributedError, launch

    try:
        return launch(fn, world_size, args, **options)
    except DistributedError as exc:
        raise RuntimeError(f"fixture {fixture}: the {world_size}-rank job {fn.__module__}.{fn.__name__} failed, so "
                           f"every test that uses {fixture} errors with this message:\n{exc}") from exc
