"""Digests the audit's scan computes on request, from the bytes it reads: what a passport binds to the verdict.

``run_audit(path, options, digests=ScanDigests(...))`` (:mod:`ckptaudit.auditing.judge`): each tensor's bytes are
given to one more hasher (:attr:`ScanDigests.new_hasher`, a cryptographic one) by the scan's own chunk loop
(:func:`~ckptaudit.auditing.tensor_scan.scan_tensor`'s ``extra``), each chunk right after the audit's hash read it,
while it is in cache: the tensors' digests cost no read of their own. Work that must read the files in their own
order (a file digest: SHA-256 is sequential) runs beside the scan on threads of its own (:attr:`ScanDigests.beside`),
the scan on the cores it leaves (:attr:`ScanDigests.reserve`): the files are read from storage once, the second
reader finds them in the page cache. :mod:`ckptaudit.passport` fills one for ``attest`` and the guards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ckptaudit.auditing.plan import ScanPlan
    from ckptaudit.auditing.scan import ScanOutcome

__all__ = ["Hasher", "ScanDigests", "TensorDigestRecord"]


class Hasher(Protocol):
    """What ``hashlib`` and ``blake3`` hashers share."""

    def update(self, data: Any, /) -> Any: ...
    def hexdigest(self) -> str: ...


@dataclass(frozen=True, slots=True)
class TensorDigestRecord:
    """One tensor's digest, ``algorithm:hex``, with the name, dtype and shape the scan read it as."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    digest: str


@dataclass(eq=False)
class ScanDigests:
    """A request to an audit's scan for digests of the bytes it reads, and what it gave (filled by the audit).

    One audit fills one (:func:`ckptaudit.auditing.judge.run_audit`, :func:`ckptaudit.auditing.scan.scan_checkpoint`);
    read the results once that returned.
    """

    algorithm: str
    """The tensors' digest algorithm, as it prefixes each digest (``blake3``, ``sha256``)."""
    new_hasher: Callable[[], Hasher]
    """A fresh hasher of :attr:`algorithm`, one per tensor; called from the scanning threads."""
    beside: Callable[[threading.Event], Any] | None = None
    """Work run on a thread of its own from before the checkpoint is opened until after its scan (the files'
    digests); given an event set when the scan failed (stop early). Its result lands in :attr:`beside_result`, an
    exception it raises in :attr:`beside_error`: the audit itself never fails for it."""
    reserve: int = 0
    """Cores :attr:`beside` keeps busy alone (a file's SHA-256 runs on one core): the scan runs on ``jobs`` minus
    these, at least one, so that the sequential digest is never the one kept waiting."""

    tensors: list[TensorDigestRecord] = field(default_factory=list)
    """Every readable tensor's digest, in the checkpoint's order (filled by the scan)."""
    errors: dict[str, str] = field(default_factory=dict)
    """Why a tensor has no digest (its bytes could not be read), by name."""
    skipped: str = ""
    """Why no tensor has a digest (a quick audit reads only each tensor's first chunk); empty when they have."""
    beside_result: Any = None
    beside_error: BaseException | None = None
    done: bool = False
    """The audit has filled this request (whatever it found)."""
    _thread: threading.Thread | None = field(default=None, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)

    def scan_jobs(self, jobs: int) -> int:
        """The scan's threads beside :attr:`beside`: ``jobs`` minus :attr:`reserve`, at least one."""
        return max(1, jobs - self.reserve) if self.beside is not None else jobs

    def start(self) -> None:
        """(the audit, before opening the checkpoint) Start :attr:`beside` on its thread."""
        if self.done or self._thread is not None:
            raise RuntimeError("a ScanDigests is filled by one audit; make a new one for each")
        if self.beside is None:
            return
        work = self.beside

        def run() -> None:
            try:
                self.beside_result = work(self._stop)
            except BaseException as exc:  # noqa: BLE001 - kept for the caller: the audit's verdict stands without it
                self.beside_error = exc

        self._thread = threading.Thread(target=run, name="ckptaudit-digest-beside", daemon=True)
        self._thread.start()

    def finish(self, *, failed: bool = False) -> None:
        """(the audit, once its scan ended) Wait for :attr:`beside`; ``failed``: the scan raised, stop it early."""
        if failed:
            self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.done = True

    def collect(self, plan: ScanPlan, outcomes: Mapping[int, ScanOutcome], *, quick: bool) -> None:
        """(the audit) The tensors' digests from the scan's outcomes, in the plan's order."""
        from ckptaudit.formats.io.tensors import TensorData

        if quick:
            self.skipped = "a quick audit reads only the first chunk of each tensor"
            return
        for index, (ref, *_) in enumerate(plan.items):
            data = ref.data
            if not isinstance(data, TensorData):
                continue
            outcome = outcomes.get(index)
            if outcome is not None and outcome.digest is not None:
                self.tensors.append(TensorDigestRecord(ref.name, data.dtype.name, tuple(data.shape), outcome.digest))
            else:
                self.errors[ref.name] = outcome.error if outcome is not None and outcome.error else "not read"
