"""``ckptaudit audit``: read a checkpoint, scan every tensor once, run the checks, return a :class:`Report`.

files -> readers (:mod:`ckptaudit.formats`) -> interpretation (:mod:`ckptaudit.layouts`) -> records
(:mod:`ckptaudit.records`, one streaming pass per tensor) -> checks (:mod:`ckptaudit.checks`) -> Report.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptaudit.catalogue import finding
from ckptaudit.checks.artifact import check_artifact
from ckptaudit.checks.components import check_components
from ckptaudit.checks.integrity import check_indexes
from ckptaudit.checks.manifest import check_manifest
from ckptaudit.checks.optimizer import ELEMENTWISE_STATE, check_attachment, check_steps
from ckptaudit.checks.precision import MASTER_DTYPES, check_precision, infer_contract
from ckptaudit.formats import open_checkpoint
from ckptaudit.formats.base import Checkpoint, Unreadable
from ckptaudit.formats.tensors import DEFAULT_CHUNK_BYTES, FileMaps, TensorData, iter_chunks
from ckptaudit.layouts import TensorRef, View, interpret
from ckptaudit.model import ComponentKind, Finding, Precision, Report, Severity, TensorRecord
from ckptaudit.records import TensorScan, scan_tensor

__all__ = ["AuditOptions", "ScanOutcome", "ScanPlan", "ScannedCheckpoint", "assemble", "audit", "default_jobs",
           "judge", "plan_scan", "scan_checkpoint", "scan_items"]

Progress = Callable[[int, int], None]
"""Called with (bytes scanned so far, total bytes) as the scan proceeds."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AuditOptions:
    master_dtype: str = "auto"
    """``auto`` reads the contract from the checkpoint; or ``float32``, ``bfloat16``, ``float16``."""
    expect: str = "training"
    """``training`` (a resumable checkpoint) or ``serving`` (an inference artifact)."""
    require: frozenset[ComponentKind] = field(default_factory=frozenset)
    """Components whose absence is an error, beyond model and optimizer."""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    jobs: int = 1
    """Threads scanning tensors at once (the CLI's default: every core available, :func:`default_jobs`). The
    report is the same whatever the number."""

    def __post_init__(self) -> None:
        if self.jobs < 1:
            raise ValueError(f"jobs must be at least 1, got {self.jobs}")
        if self.master_dtype not in MASTER_DTYPES:
            raise ValueError(
                f"master dtype {self.master_dtype!r} is not one of {', '.join(MASTER_DTYPES)}"
            )
        if self.expect not in ("training", "serving"):
            raise ValueError(f"expect must be 'training' or 'serving', not {self.expect!r}")


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


@dataclass
class ScanPlan:
    """A checkpoint opened and interpreted, with every tensor's place in the report: the work to scan.

    ``items[i]`` is ``(ref, component, role, param)``; the records come out in this order whatever order the
    tensors are scanned in, and on whichever rank (see :mod:`ckptaudit.dist.audit`).
    """

    ckpt: Checkpoint
    view: View
    items: list[tuple[TensorRef, str, str, str | None]]
    findings: list[Finding]
    attachment: Any
    step_items: frozenset[int]
    """Indices of one-element ``step`` state tensors, whose value the scan also reads."""
    step_keys: dict[int, Any]

    def scannable(self) -> list[int]:
        """Indices of the items with data to scan (not :class:`Unreadable`)."""
        return [i for i, (ref, *_) in enumerate(self.items) if isinstance(ref.data, TensorData)]

    def nbytes(self, index: int) -> int:
        data = self.items[index][0].data
        return data.nbytes if isinstance(data, TensorData) else 0

    def close(self) -> None:
        self.ckpt.close()


def plan_scan(path: str) -> ScanPlan:
    """Open and interpret ``path`` and work out each tensor's role, reading no tensor data.
    Raises ``FileNotFoundError``."""
    ckpt = open_checkpoint(path)
    view = interpret(ckpt)
    attachment = check_attachment(view)
    opt_meta: dict[int, tuple[Any, str]] = {}
    if view.optimizer is not None:
        for key, entry in view.optimizer.state.items():
            for sname, value in entry.items():
                if isinstance(value, TensorRef):
                    opt_meta[id(value)] = (key, sname)
    known_params = set(attachment.params)
    if view.optimizer is not None and view.optimizer.keyed == "fqn":
        known_params |= {p for g in view.optimizer.groups for p in g["params"] if isinstance(p, str)}
    fqn_of = {id(r): f for f, r in view.model.params.items()} if view.model is not None else {}
    items: list[tuple[TensorRef, str, str, str | None]] = []
    step_keys: dict[int, Any] = {}
    for ref, comp in view.tensors:
        role, param = "", None
        if comp == ComponentKind.MODEL.value and view.model is not None:
            fqn = fqn_of.get(id(ref))
            param = fqn
            role = "parameter" if (not known_params or fqn in known_params) else "buffer"
            if fqn in view.model.aliases:  # a tied weight's second name: same bytes as its first
                role, param = "tied", view.model.aliases[fqn]
        elif id(ref) in opt_meta:
            key, sname = opt_meta[id(ref)]
            role = sname
            param = attachment.mapping.get(key)
            if sname == "step" and isinstance(ref.data, TensorData) and ref.data.numel == 1:
                step_keys[len(items)] = key
        items.append((ref, comp, role, param))
    return ScanPlan(ckpt, view, items, list(ckpt.findings), attachment, frozenset(step_keys), step_keys)


def scan_items(plan: ScanPlan, indices: Sequence[int], *, jobs: int = 1, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               progress: Progress | None = None) -> dict[int, ScanOutcome]:
    """Scan the tensors ``plan.items[i]`` for ``i`` in ``indices`` on ``jobs`` threads.

    Each tensor is streamed in order by one thread (its hash is the sequential xxh3-128 of its bytes, whatever
    ``jobs``). One thread reads in the checkpoint's order (sequential on disk); several take the largest tensors
    first, so that no thread is left alone with a big one at the end. Memory: one chunk buffer per thread.
    xxhash, NumPy's reductions and ``os.preadv`` release the GIL, so the threads run on as many cores.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    order = sorted(indices) if jobs == 1 else sorted(indices, key=lambda i: (-plan.nbytes(i), i))
    total = sum(plan.nbytes(i) for i in order)
    done = 0
    out: dict[int, ScanOutcome] = {}

    def one(index: int) -> ScanOutcome:
        data = plan.items[index][0].data
        assert isinstance(data, TensorData)
        try:
            scanned = scan_tensor(data, plan.ckpt.maps, chunk_bytes)
        except (ValueError, OSError) as exc:
            return ScanOutcome(None, str(exc))
        step = scalar_value(data, plan.ckpt.maps) if index in plan.step_items else None
        return ScanOutcome(scanned, step=step)

    if jobs == 1 or len(order) <= 1:
        for i in order:
            out[i] = one(i)
            done += plan.nbytes(i)
            if progress is not None:
                progress(done, total)
        return out
    with ThreadPoolExecutor(max_workers=min(jobs, len(order)), thread_name_prefix="ckptaudit-scan") as pool:
        futures = {pool.submit(one, i): i for i in order}
        try:
            for fut in as_completed(futures):
                i = futures[fut]
                out[i] = fut.result()
                done += plan.nbytes(i)
                if progress is not None:
                    progress(done, total)
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise
    return out


def assemble(plan: ScanPlan, outcomes: dict[int, ScanOutcome]) -> ScannedCheckpoint:
    """The records of ``plan`` in its order, from the scans of every scannable item (``outcomes``)."""
    findings = list(plan.findings)
    records: list[TensorRecord] = []
    refs: list[TensorRef] = []
    steps: dict[Any, float] = {}
    for index, (ref, comp, role, param) in enumerate(plan.items):
        data = ref.data
        refs.append(ref)
        if isinstance(data, Unreadable):
            records.append(TensorRecord(ref.name, comp, role, param, ref.file, "?", (), 0, None, Precision.UNREAD))
            continue
        outcome = outcomes[index]
        if outcome.scan is None:
            findings.append(finding("integrity.corrupt", ref.name, f"{ref.name}: cannot read its data ({outcome.error})",
                                    file=ref.file))
            records.append(TensorRecord(ref.name, comp, role, param, ref.file, data.dtype.name, data.shape,
                                        data.numel, None, Precision.UNREAD))
            continue
        scanned = outcome.scan
        records.append(TensorRecord(ref.name, comp, role, param, ref.file, data.dtype.name, data.shape, data.numel,
                                    scanned.hash, scanned.precision, scanned.stats))
        if outcome.step is not None:
            steps[plan.step_keys[index]] = outcome.step
    view = plan.view
    # Plain-number step counters (optimizers built with capturable=False may store Python floats).
    if view.optimizer is not None:
        for key, entry in view.optimizer.state.items():
            v = entry.get("step")
            if isinstance(v, int | float) and not isinstance(v, bool):
                steps[key] = float(v)
    return ScannedCheckpoint(plan.ckpt, view, records, refs, findings, plan.attachment, steps)


def scan_checkpoint(path: str, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: Progress | None = None,
                    jobs: int = 1) -> ScannedCheckpoint:
    """Read ``path`` and scan every tensor once (hash + effective precision) on ``jobs`` threads.
    Raises ``FileNotFoundError``."""
    plan = plan_scan(path)
    try:
        outcomes = scan_items(plan, plan.scannable(), jobs=jobs, chunk_bytes=chunk_bytes, progress=progress)
    except BaseException:
        plan.close()
        raise
    return assemble(plan, outcomes)


def scalar_value(data: TensorData, maps: FileMaps) -> float | None:
    """The value of a one-element tensor (a step counter), or ``None`` if it cannot be read."""
    try:
        chunk = next(iter(iter_chunks(data, maps)), None)
    except (ValueError, OSError):
        return None
    if chunk is None or chunk.size != 1:
        return None
    if data.dtype.name == "bfloat16":
        return float(np.array([int(chunk[0]) << 16], dtype=np.uint32).view(np.float32)[0])
    if data.dtype.numpy.startswith("u") and data.dtype.is_float:
        return None
    return float(chunk[0])


def audit(path: str, options: AuditOptions | None = None, *, progress: Progress | None = None) -> Report:
    """Audit the checkpoint at ``path``. Raises ``FileNotFoundError`` when it does not exist."""
    options = options or AuditOptions()
    scanned = scan_checkpoint(path, chunk_bytes=options.chunk_bytes, progress=progress, jobs=options.jobs)
    try:
        return judge(scanned, options)
    finally:
        scanned.close()


def judge(s: ScannedCheckpoint, options: AuditOptions) -> Report:
    """Run the checks on a scanned checkpoint and build the report."""
    view = s.view
    findings = list(s.findings)
    findings += check_indexes(s.ckpt, view)
    seen = {(f.code, f.subject) for f in findings}
    findings += [f for f in check_manifest(s.ckpt, view, s.records) if (f.code, f.subject) not in seen]
    serving_findings, _ = check_artifact(view, options.expect, ckpt=s.ckpt, records=s.records)
    findings += serving_findings
    params = [r for r in s.records if r.component == ComponentKind.MODEL.value and r.role == "parameter"
              and r.precision is not Precision.NOT_FLOAT and r.precision is not Precision.UNREAD]
    moments = [r for r in s.records if r.component == ComponentKind.OPTIMIZER.value
               and (r.role in ELEMENTWISE_STATE or (len(r.shape) >= 1 and r.role != "step"))
               and r.precision not in (Precision.NOT_FLOAT, Precision.UNREAD)]
    manifest_dtype = None
    if view.manifest is not None:
        contract_info = view.manifest.get("contract")
        if isinstance(contract_info, dict) and isinstance(contract_info.get("master_dtype"), str):
            manifest_dtype = contract_info["master_dtype"]
    contract, contract_findings = infer_contract(options.master_dtype, params, moments, manifest_dtype)
    components: tuple[Any, ...] = ()
    if options.expect == "training":
        findings += contract_findings
        components, comp_findings = check_components(view, options.require)
        findings += comp_findings
        findings += s.attachment.findings
        findings += check_steps(view.optimizer, s.steps)
        findings += check_precision(params, contract)
    findings.sort(key=lambda f: (-int(f.severity), f.code, f.subject))
    return Report(
        command="audit",
        path=s.ckpt.path,
        format=view.layout,
        findings=tuple(findings),
        contract=contract,
        components=components,
        tensors=tuple(s.records),
        summary=_summary(s, findings, contract.master_dtype, options),
        extra={"files": dict(s.ckpt.files), "attachment": s.attachment.status,
               "step": view.step, "expect": options.expect},
    )


def _summary(s: ScannedCheckpoint, findings: list[Finding], master: str, options: AuditOptions) -> str:
    errors = sum(f.severity is Severity.ERROR for f in findings)
    warnings = sum(f.severity is Severity.WARNING for f in findings)
    n_params = sum(r.component == "model" and r.role == "parameter" for r in s.records)
    rounded = sum(f.code in ("precision.bf16-rounded", "precision.fp16-rounded",
                             "precision.low-precision-storage") for f in findings)
    verdict = "resumable" if errors == 0 else "NOT resumable as-is"
    if options.expect == "serving":
        verdict = "acceptable serving artifact" if errors == 0 else "NOT an acceptable serving artifact"
    text = (f"{verdict}: {len(s.records)} tensors ({n_params} parameters, master dtype {master}), "
            f"{errors} error(s), {warnings} warning(s)")
    if rounded:
        text += f"; {rounded} parameter(s) below the master precision"
    return text
