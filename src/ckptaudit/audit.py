"""``ckptaudit audit``: read a checkpoint, scan every tensor once, run the checks, return a :class:`Report`.

files -> readers (:mod:`ckptaudit.formats`) -> interpretation (:mod:`ckptaudit.layouts`) -> records
(:mod:`ckptaudit.records`, one streaming pass per tensor) -> checks (:mod:`ckptaudit.checks`) -> Report.
"""

from __future__ import annotations

from collections.abc import Callable
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
from ckptaudit.records import scan_first_chunk, scan_tensor

__all__ = ["AuditOptions", "ScannedCheckpoint", "audit", "scan_checkpoint"]

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
    quick: bool = False
    """The in-loop mode: inventory, attachment, integrity from headers and recorded sizes, and each tensor's
    precision decided from its first chunk; no content hash (``hash`` is ``None``), manifest hashes not
    verified. A tensor rounded after its first chunk, or corrupted beyond it, is not seen: a quick clean is
    not a full clean (the summary says so, and ``extra["mode"]`` is ``"quick"``)."""

    def __post_init__(self) -> None:
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


def scan_checkpoint(path: str, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                    progress: Progress | None = None, quick: bool = False) -> ScannedCheckpoint:
    """Read ``path`` and scan every tensor once (hash + effective precision; with ``quick``, the precision of
    the first chunk and no hash). Raises ``FileNotFoundError``."""
    ckpt = open_checkpoint(path)
    view = interpret(ckpt)
    findings: list[Finding] = list(ckpt.findings)
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
    total = sum(r.data.nbytes for r, _ in view.tensors if isinstance(r.data, TensorData))
    done = 0
    records: list[TensorRecord] = []
    refs: list[TensorRef] = []
    steps: dict[Any, float] = {}
    corrupt_files: set[str] = set()
    fqn_of = {id(r): f for f, r in view.model.params.items()} if view.model is not None else {}
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
        data = ref.data
        if isinstance(data, Unreadable):
            records.append(TensorRecord(ref.name, comp, role, param, ref.file, "?", (), 0, None, Precision.UNREAD))
            refs.append(ref)
            continue
        try:
            scanned = (scan_first_chunk if quick else scan_tensor)(data, ckpt.maps, chunk_bytes)
        except (ValueError, OSError) as exc:
            if ref.file not in corrupt_files:
                findings.append(finding("integrity.corrupt", ref.name, f"{ref.name}: cannot read its data ({exc})",
                                        file=ref.file))
            records.append(TensorRecord(ref.name, comp, role, param, ref.file, data.dtype.name, data.shape,
                                        data.numel, None, Precision.UNREAD))
            refs.append(ref)
            continue
        records.append(TensorRecord(ref.name, comp, role, param, ref.file, data.dtype.name, data.shape, data.numel,
                                    scanned.hash, scanned.precision, scanned.stats))
        refs.append(ref)
        if id(ref) in opt_meta and opt_meta[id(ref)][1] == "step" and data.numel == 1:
            value = scalar_value(data, ckpt.maps)
            if value is not None:
                steps[opt_meta[id(ref)][0]] = value
        done += data.nbytes
        if progress is not None:
            progress(done, total)
    # Plain-number step counters (optimizers built with capturable=False may store Python floats).
    if view.optimizer is not None:
        for key, entry in view.optimizer.state.items():
            v = entry.get("step")
            if isinstance(v, int | float) and not isinstance(v, bool):
                steps[key] = float(v)
    return ScannedCheckpoint(ckpt, view, records, refs, findings, attachment, steps)


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
    scanned = scan_checkpoint(path, chunk_bytes=options.chunk_bytes, progress=progress, quick=options.quick)
    try:
        return _judge(scanned, options)
    finally:
        scanned.close()


def _judge(s: ScannedCheckpoint, options: AuditOptions) -> Report:
    view = s.view
    findings = list(s.findings)
    findings += check_indexes(s.ckpt, view)
    seen = {(f.code, f.subject) for f in findings}
    findings += [f for f in check_manifest(s.ckpt, view, s.records, hashes=not options.quick)
                 if (f.code, f.subject) not in seen]
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
               "step": view.step, "expect": options.expect, **({"mode": "quick"} if options.quick else {})},
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
    if options.quick:
        text = ("quick audit (first chunk of each tensor, no content hashes): "
                + (text if errors else f"no defect seen, not a full verdict: {text.split(': ', 1)[1]}"))
    return text
