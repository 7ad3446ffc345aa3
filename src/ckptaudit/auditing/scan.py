"""The scan phase of an audit: the tensors of a plan scanned on threads, the records assembled in the plan's order.

:func:`~ckptaudit.auditing.plan.plan_scan` (each tensor's component, role and parameter; the optimizer's
attachment) -> :func:`scan_items` (one streaming
pass per tensor, :mod:`ckptaudit.auditing.tensor_scan`, on ``jobs`` threads of this process) -> :func:`assemble` (the
records, in the plan's order). :func:`ckptaudit.auditing.judge.judge_scan` runs the checks on the result;
:mod:`ckptaudit.auditing.distributed` runs the same three steps with the scan shared between ranks; ``compare`` and the
serving export start from :func:`scan_checkpoint`.
"""

from __future__ import annotations

import os
import struct
import sys
import threading
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from ckptaudit.auditing.digesting import Hasher, ScanDigests
from ckptaudit.auditing.plan import ScanPlan, plan_scan
from ckptaudit.auditing.tensor_scan import SMALL_TENSOR_BYTES, TensorScan, scan_first_chunk, scan_tensor
from ckptaudit.catalogue import finding
from ckptaudit.findings import Finding, Precision, TensorRecord
from ckptaudit.formats.base import Checkpoint, Unreadable
from ckptaudit.formats.io.safeio import FileChanged
from ckptaudit.formats.io.tensors import (
    DEFAULT_CHUNK_BYTES,
    FileMaps,
    TensorData,
    iter_chunks,
    read_exact,
    scratch_buffer,
    small_read_plan,
)
from ckptaudit.layouts import TensorRef, View

__all__ = ["BATCH_BYTES", "BATCH_COUNT", "SERIAL_BYTES", "Progress", "ScanDigests", "ScanOutcome", "ScannedCheckpoint",
           "assemble", "default_jobs", "scalar_value", "scan_checkpoint", "scan_datas", "scan_items"]

Progress = Callable[[int, int], None]
"""Called with (bytes scanned so far, total bytes) as the scan proceeds."""


@dataclass
class ScannedCheckpoint:
    """A checkpoint read, interpreted and scanned: what ``audit`` and ``compare`` both start from."""

    ckpt: Checkpoint
    view: View
    records: list[TensorRecord]
    refs: list[TensorRef]
    """``refs[i]`` is the lazy tensor behind ``records[i]``."""
    findings: list[Finding]
    attachment: Any
    steps: dict[Any, float]

    def close(self) -> None:
        self.ckpt.close()


def default_jobs() -> int:
    """The cores this process may run on (``os.sched_getaffinity``), or ``os.cpu_count()`` where that is missing."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True, slots=True)
class ScanOutcome:
    """What scanning one tensor gave: its :class:`TensorScan`, or why its data could not be read."""

    scan: TensorScan | None
    error: str = ""
    """Why the data could not be read (``scan`` is then ``None``)."""
    step: float | None = None
    """The value of a one-element ``step`` state tensor."""
    reported: bool = False
    """``scan`` is ``None`` for a reason another finding already reports (a distributed audit's
    ``integrity.changed``): :func:`assemble` adds no ``integrity.corrupt`` of its own for this tensor."""
    changed: str = ""
    """The file found to be another version than the one the readers parsed (``scan`` is then ``None``): an
    absolute path of this process, or a name relative to the checkpoint's root (sent by a distributed audit's
    rank). :func:`assemble` makes one ``integrity.changed`` per such file."""
    digest: str | None = None
    """``algorithm:hex`` of the tensor's bytes by the scan's extra hasher (:class:`~ckptaudit.auditing.digesting.
    ScanDigests`), when one was asked for and the tensor was read whole."""


SERIAL_BYTES = 1 << 20
"""Checkpoints up to this many tensor bytes are scanned by one thread whatever ``jobs``: that takes about a
millisecond, less than starting a pool."""
BATCH_BYTES = SMALL_TENSOR_BYTES
"""Tensors up to this size are scanned in batches (:func:`scan_items`): their scan is mostly Python, holding the
GIL, so two threads on them only take turns; one thread on them beside threads streaming large tensors (a few
microseconds of GIL a chunk) keeps every core busy."""
BATCH_COUNT = 256
"""Small tensors in a batch: the hand-out costs nothing, and a checkpoint of small tensors still spreads."""


def scan_items(plan: ScanPlan, indices: Sequence[int], *, jobs: int = 1, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               progress: Progress | None = None, quick: bool = False,
               digests: ScanDigests | None = None) -> dict[int, ScanOutcome]:
    """Scan the tensors ``plan.items[i]`` for ``i`` in ``indices`` on ``jobs`` threads.

    Each tensor is streamed in order by one thread (its hash is the sequential xxh3-128 of its bytes, whatever
    ``jobs``); one thread reads in the checkpoint's order. Several share two queues (bench/README.md, "Two
    threads"): the large tensors, largest first (no thread left alone with a big one at the end), and batches of
    small ones (:data:`BATCH_BYTES`); the first thread takes batches first, the others large tensors first, each
    turning to the other queue when its own is empty. Memory: one chunk buffer per thread. ``progress`` is
    called from the scanning threads, one call at a time; an exception it raises (or any but the
    ``ValueError``/``OSError`` of an unreadable tensor, which is that tensor's outcome) stops every thread after
    its current tensor and is raised here. ``digests``: each tensor's bytes also given to a new
    :attr:`~ckptaudit.auditing.digesting.ScanDigests.new_hasher` from the same chunks (:attr:`ScanOutcome.digest`;
    a quick scan reads too little for one).
    """
    datas: dict[int, TensorData] = {}
    for i in indices:
        data = plan.items[i][0].data
        assert isinstance(data, TensorData)
        datas[i] = data
    return scan_datas(datas, plan.ckpt.maps, step_items=plan.step_items, jobs=jobs, chunk_bytes=chunk_bytes,
                      progress=progress, quick=quick, digests=digests)


def scan_datas(datas: Mapping[int, TensorData], maps: FileMaps, *, step_items: Collection[int] = frozenset(),
               jobs: int = 1, chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: Progress | None = None,
               quick: bool = False, digests: ScanDigests | None = None) -> dict[int, ScanOutcome]:
    """:func:`scan_items` on tensors given by index (``datas``) and the files they lie in (``maps``), without a
    plan: what a rank of a distributed audit scans from the share it was sent (:mod:`ckptaudit.auditing.distributed`).
    ``step_items``: the indices whose one-element value is also read (:attr:`ScanPlan.step_items`)."""
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    sizes = {i: d.nbytes for i, d in datas.items()}
    total = sum(sizes.values())
    out: dict[int, ScanOutcome] = {}
    local = threading.local()  # one read buffer per scanning thread, reused across its tensors
    new_hasher = digests.new_hasher if digests is not None and not quick else None

    def one(index: int) -> ScanOutcome:
        data = datas[index]
        extra: Hasher | None = None
        try:
            if quick:
                scanned = scan_first_chunk(data, maps, chunk_bytes)
            else:
                buffer = getattr(local, "buffer", None)
                if buffer is None and (sizes[index] > SMALL_TENSOR_BYTES or "numpy" in sys.modules):
                    # Not for a small tensor while NumPy is not loaded: scan_tensor may judge it without NumPy.
                    buffer = local.buffer = scratch_buffer(chunk_bytes)
                extra = new_hasher() if new_hasher is not None else None
                scanned = scan_tensor(data, maps, chunk_bytes, buffer, extra)
        except FileChanged as exc:  # the bytes are another version's than the header read: none is judged
            return ScanOutcome(None, str(exc), changed=str(exc.filename))
        except (ValueError, OSError) as exc:
            return ScanOutcome(None, str(exc))
        step = scalar_value(data, maps) if index in step_items else None
        digest = f"{digests.algorithm}:{extra.hexdigest()}" if digests is not None and extra is not None else None
        return ScanOutcome(scanned, step=step, digest=digest)

    remote = maps.remote

    def prefetched(unit: list[int]) -> AbstractContextManager[Any]:
        """Behind a URL, a batch of small tensors is fetched first in a few coalesced ranged reads (their hash is
        then computed from memory); one request per tensor is what makes many small items slow to audit there."""
        if remote is None or len(unit) < 2:
            return nullcontext()
        return remote.prefetched(_small_ranges(datas, unit))

    if jobs == 1 or len(sizes) <= 1 or total <= SERIAL_BYTES:
        done = 0
        for unit in (_units(sizes) if remote is not None else [sorted(sizes)]):
            with prefetched(unit):
                for i in unit:
                    out[i] = one(i)
                    done += sizes[i]
                    if progress is not None:
                        progress(done, total)
        return out
    return _scan_on_threads(sizes, one, jobs, progress, out, prefetched)


def _units(sizes: Mapping[int, int]) -> list[list[int]]:
    """Batches of at most :data:`BATCH_COUNT` small tensors (in index order), then each large one alone."""
    small = sorted(i for i in sizes if sizes[i] <= BATCH_BYTES)
    large = sorted((i for i in sizes if sizes[i] > BATCH_BYTES), key=lambda i: (-sizes[i], i))
    return [small[lo : lo + BATCH_COUNT] for lo in range(0, len(small), BATCH_COUNT)] + [[i] for i in large]


def _small_ranges(datas: Mapping[int, TensorData], unit: list[int]) -> list[tuple[str, int, int]]:
    """``(file, offset, length)`` of every byte the scan of the small tensors ``unit`` reads (the contiguous ones:
    a tensor read otherwise is fetched as it is read)."""
    out = []
    for i in unit:
        data = datas[i]
        try:
            pieces = small_read_plan(data, BATCH_BYTES)
        except ValueError:  # pieces that do not tile it: its scan says so, reading nothing
            continue
        for piece, pos in pieces or ():
            out.append((piece.file, pos, piece.numel * data.dtype.itemsize))
    return out


def _scan_on_threads(sizes: dict[int, int], one: Callable[[int], ScanOutcome], jobs: int,
                     progress: Progress | None, out: dict[int, ScanOutcome],
                     prefetched: Callable[[list[int]], AbstractContextManager[Any]]) -> dict[int, ScanOutcome]:
    """(main thread) Start the scanning threads of :func:`scan_items`, wait for them, raise what stopped them."""
    large = deque([[i] for i in sorted((i for i in sizes if sizes[i] > BATCH_BYTES), key=lambda i: (-sizes[i], i))])
    small = sorted(i for i in sizes if sizes[i] <= BATCH_BYTES)
    batches = deque([small[lo : lo + BATCH_COUNT] for lo in range(0, len(small), BATCH_COUNT)])
    total = sum(sizes.values())
    failed: list[BaseException] = []
    lock = threading.Lock()
    done = 0

    def work(queues: tuple[deque[list[int]], ...]) -> None:
        nonlocal done
        try:
            for queue in queues:
                while not failed:
                    try:
                        unit = queue.popleft()  # atomic: no lock needed to hand out work
                    except IndexError:
                        break
                    with prefetched(unit):
                        for i in unit:
                            if failed:
                                return
                            out[i] = one(i)  # each index is written by one thread only
                    if progress is not None:
                        with lock:
                            done += sum(sizes[i] for i in unit)
                            progress(done, total)
        except BaseException as exc:  # noqa: BLE001 - raised again by the main thread, after the others stop
            failed.append(exc)

    n = min(jobs, len(large) + len(batches))
    threads = [threading.Thread(target=work, args=((batches, large) if k == 0 else (large, batches),),
                                name=f"ckptaudit-scan-{k}", daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except BaseException as exc:  # KeyboardInterrupt in the main thread: stop the others after their tensor
        failed.append(exc)
        for t in threads:
            t.join()
        raise
    if failed:
        raise failed[0]
    return out


def assemble(plan: ScanPlan, outcomes: dict[int, ScanOutcome]) -> ScannedCheckpoint:
    """The records of ``plan`` in its order, from the scans of every scannable item (``outcomes``)."""
    findings = list(plan.findings)
    records: list[TensorRecord] = []
    refs: list[TensorRef] = []
    steps: dict[Any, float] = {}
    changed: dict[str, list[str]] = {}
    for index, (ref, comp, role, param) in enumerate(plan.items):
        data = ref.data
        refs.append(ref)
        if isinstance(data, Unreadable):
            records.append(TensorRecord(ref.name, comp, role, param, ref.file, "?", (), 0, None, Precision.UNREAD))
            continue
        outcome = outcomes[index]
        if outcome.scan is None:
            if outcome.changed:
                name = (plan.ckpt.file_name(outcome.changed) if os.path.isabs(outcome.changed)
                        else outcome.changed)
                changed.setdefault(name, []).append(outcome.error)
            elif not outcome.reported:
                findings.append(finding("integrity.corrupt", ref.name,
                                        f"{ref.name}: cannot read its data ({outcome.error})", file=ref.file))
            records.append(TensorRecord(ref.name, comp, role, param, ref.file, data.dtype.name, data.shape,
                                        data.numel, None, Precision.UNREAD))
            continue
        scanned = outcome.scan
        records.append(TensorRecord(ref.name, comp, role, param, ref.file, data.dtype.name, data.shape, data.numel,
                                    scanned.hash, scanned.precision, scanned.stats))
        if outcome.step is not None:
            steps[plan.step_keys[index]] = outcome.step
    findings += [_changed_finding(name, whys) for name, whys in changed.items()]
    view = plan.view
    # Plain-number step counters (optimizers built with capturable=False may store Python floats).
    if view.optimizer is not None:
        for key, entry in view.optimizer.state.items():
            v = entry.get("step")
            if isinstance(v, int | float) and not isinstance(v, bool):
                steps[key] = v  # an int stays one: 10**400 has no float (2 and 2.0 still count as equal)
    return ScannedCheckpoint(plan.ckpt, view, records, refs, findings, plan.attachment, steps)


def _changed_finding(name: str, whys: list[str]) -> Finding:
    """``integrity.changed`` for the data file ``name`` whose tensors (``len(whys)``) were not read: it was another
    version when the scan opened it than when the readers parsed the checkpoint."""
    return finding(
        "integrity.changed", name,
        f"{name} changed while the checkpoint was audited: {whys[0]}. Its {len(whys)} tensor(s) were not read, so "
        "nothing is judged from bytes of two versions; audit again once the checkpoint is no longer being written",
        file=name, unread=len(whys))


def scan_checkpoint(path: str, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: Progress | None = None,
                    jobs: int = 1, quick: bool = False, digests: ScanDigests | None = None) -> ScannedCheckpoint:
    """Read ``path`` and scan every tensor once (hash + effective precision; with ``quick``, the precision of
    the first chunk and no hash) on ``jobs`` threads. ``digests``: also fill this request with each tensor's
    digest from the same pass, its :attr:`~ckptaudit.auditing.digesting.ScanDigests.beside` work running meanwhile
    (the scan then on :meth:`~ckptaudit.auditing.digesting.ScanDigests.scan_jobs` threads). Raises
    ``FileNotFoundError``."""
    if digests is None:
        plan = plan_scan(path)
        try:
            outcomes = scan_items(plan, plan.scannable(), jobs=jobs, chunk_bytes=chunk_bytes, progress=progress,
                                  quick=quick)
        except BaseException:
            plan.close()
            raise
        return assemble(plan, outcomes)
    digests.start()  # before the open: the file digests' reads start while the headers are parsed
    try:
        plan = plan_scan(path)
    except BaseException:
        digests.finish(failed=True)
        raise
    try:
        outcomes = scan_items(plan, plan.scannable(), jobs=digests.scan_jobs(jobs), chunk_bytes=chunk_bytes,
                              progress=progress, quick=quick, digests=digests)
    except BaseException:
        plan.close()
        digests.finish(failed=True)
        raise
    digests.finish()
    digests.collect(plan, outcomes, quick=quick)
    return assemble(plan, outcomes)


def scalar_value(data: TensorData, maps: FileMaps) -> float | None:
    """The value of a one-element tensor (a step counter), or ``None`` if it cannot be read."""
    code = _SCALAR_CODES.get(data.dtype.numpy)
    try:
        plan = small_read_plan(data, 16) if code is not None else None
        if code is not None and plan is not None:  # without NumPy: a small audit need not import it for this
            if len(plan) != 1 or data.numel != 1:
                return None
            piece, pos = plan[0]
            value = struct.unpack(code, read_exact(maps, piece, pos, data.dtype.itemsize))[0]
        else:
            chunk = next(iter(iter_chunks(data, maps)), None)
            if chunk is None or chunk.size != 1:
                return None
            value = chunk[0]
    except (ValueError, OSError):
        return None
    if data.dtype.name == "bfloat16":
        return float(struct.unpack("<f", struct.pack("<I", int(value) << 16))[0])
    if data.dtype.numpy.startswith("u") and data.dtype.is_float:
        return None
    return float(value)


_SCALAR_CODES = {"<f8": "<d", "<f4": "<f", "<f2": "<e", "<i8": "<q", "<i4": "<i", "<i2": "<h", "i1": "<b",
                 "u1": "<B", "<u2": "<H", "<u4": "<I", "<u8": "<Q", "?": "<?"}
"""``struct`` codes of the NumPy types :func:`scalar_value` reads without NumPy (complex ones go through it)."""
