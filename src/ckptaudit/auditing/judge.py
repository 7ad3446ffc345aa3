"""The judgement of an audit: the checks run on a scanned checkpoint, and the :class:`~ckptaudit.findings.RawReport`.

files -> readers (:mod:`ckptaudit.formats`) -> interpretation (:mod:`ckptaudit.layouts`) -> records
(:mod:`ckptaudit.auditing.plan`, :mod:`ckptaudit.auditing.scan`: one streaming pass per tensor, on threads) ->
checks (:mod:`ckptaudit.checks`, :func:`judge_scan`) -> RawReport.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

from ckptaudit.auditing.digesting import ScanDigests
from ckptaudit.auditing.scan import Progress, ScannedCheckpoint, scan_checkpoint
from ckptaudit.catalogue import finding, finding_order, ignore_note, mark_ignored, parse_ignore
from ckptaudit.checks.artifact import check_artifact
from ckptaudit.checks.components import check_components
from ckptaudit.checks.integrity import check_indexes
from ckptaudit.checks.manifest import check_manifest
from ckptaudit.checks.optimizer import check_steps
from ckptaudit.checks.precision import (
    MASTER_DTYPES,
    check_precision,
    infer_contract,
    judged_params,
    live_per_parameter,
    manifest_per_parameter,
    masters_not_saved,
    per_parameter,
    place_live_dtypes,
)
from ckptaudit.checks.updates import (
    FROZEN_WHY,
    NOT_JUDGED_WHY,
    before_first_update,
    maybe_frozen,
    never_updated_params,
)
from ckptaudit.findings import ComponentKind, Finding, Precision, RawReport, Severity
from ckptaudit.formats.io.tensors import DEFAULT_CHUNK_BYTES
from ckptaudit.layouts.attachment import ELEMENTWISE_STATE
from ckptaudit.layouts.view import ContractRecord

__all__ = ["AuditOptions", "judge_scan", "run_audit"]


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
    """Threads scanning tensors at once (the CLI's default: every core available, :func:`~ckptaudit.auditing.scan.default_jobs`). The
    report is the same whatever the number."""
    master_dtype_from: str = ""
    """Who declared ``master_dtype``, in words, when it was not the user: the guards pass the running job's evidence
    (``"the live run: the optimizer steps float32 parameters"``); the report's contract then says ``live``."""
    master_dtypes: tuple[str, ...] = ()
    """Each parameter's master dtype, in the order of the optimizer's param groups (the guards: the live optimizer's,
    when its parameters have several dtypes; ``master_dtype_from`` says so): each parameter is held to its own
    (:func:`~ckptaudit.checks.precision.live_per_parameter`). Ignored under a ``master_dtype`` other than auto."""
    ignore: tuple[str, ...] = ()
    """Finding codes or families acknowledged (:func:`ckptaudit.catalogue.parse_ignore`): kept in the report,
    marked ignored, counted toward nothing."""
    run_evidence: bool = False
    """:func:`run_audit` reads the run's evidence beside a local checkpoint (its siblings: the run's other
    checkpoints, :mod:`ckptaudit.auditing.run_evidence`) where its own contract is 16-bit masters inferred from its
    tensors. The API and the command line turn it on by default (``run_evidence`` option)."""
    run_records: tuple[ContractRecord, ...] = ()
    """Records of the contract from outside the checkpoint (``ckptaudit latest``: what the run's other checkpoints
    hold, source ``run``), consulted after the checkpoint's own: its manifest and its stack's record decide first."""
    quick: bool = False
    """The in-loop mode: inventory, attachment, integrity from headers and recorded sizes, and each tensor's
    precision decided from its first chunk; no content hash (``hash`` is ``None``), manifest hashes not
    verified. A tensor rounded after its first chunk, or corrupted beyond it, is not seen: a quick clean is
    not a full clean (the summary says so, and ``extra["mode"]`` is ``"quick"``)."""

    def __post_init__(self) -> None:
        if self.jobs < 1:
            raise ValueError(f"jobs must be at least 1, got {self.jobs}")
        if self.master_dtype not in MASTER_DTYPES:
            raise ValueError(
                f"master dtype {self.master_dtype!r} is not one of {', '.join(MASTER_DTYPES)}"
            )
        if self.expect not in ("training", "serving"):
            raise ValueError(f"expect must be 'training' or 'serving', not {self.expect!r}")
        if self.master_dtype_from and self.master_dtype == "auto" and not self.master_dtypes:
            raise ValueError("master_dtype_from names who declared master_dtype; it needs a master_dtype (or "
                             "master_dtypes), not auto")
        object.__setattr__(self, "ignore", parse_ignore(self.ignore))


def run_audit(path: str, options: AuditOptions | None = None, *, progress: Progress | None = None,
              digests: ScanDigests | None = None) -> RawReport:
    """Audit the checkpoint at ``path``. ``digests``: a request the scan fills with each tensor's digest from the
    same pass over its bytes (:mod:`ckptaudit.auditing.digesting`; a passport's). Raises ``FileNotFoundError`` when
    it does not exist."""
    options = options or AuditOptions()
    scanned = scan_checkpoint(path, chunk_bytes=options.chunk_bytes, progress=progress, jobs=options.jobs,
                              quick=options.quick, digests=digests)
    try:
        from ckptaudit.auditing.run_evidence import judge_audit

        return judge_audit(scanned, options, path)
    finally:
        scanned.close()


def judge_scan(s: ScannedCheckpoint, options: AuditOptions) -> RawReport:
    """Run the checks on a scanned checkpoint and build the report."""
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
    params = judged_params(params, s.records, view)
    manifest_dtype = None
    recorded = None  # the writer's per-parameter record, when it recorded parameters of several dtypes
    if view.manifest is not None:
        contract_info = view.manifest.get("contract")
        if isinstance(contract_info, dict) and isinstance(contract_info.get("master_dtype"), str):
            manifest_dtype = contract_info["master_dtype"]
            recorded = manifest_per_parameter(view.manifest, params)
            if recorded is not None:  # float32 where any master is (the writer records the majority)
                manifest_dtype = "float32"
    flag = options.master_dtype
    placed = (place_live_dtypes(options.master_dtypes, view, s.attachment.mapping)
              if options.master_dtypes and flag == "auto" else None)
    if placed is not None:  # the live optimizer's dtype per parameter: float32 where any master is
        wide = [d for d in placed.values() if d not in ("bfloat16", "float16")]
        flag = "float32" if wide or len(set(placed.values())) != 1 else next(iter(placed.values()))
    contract, contract_findings = infer_contract(flag, params, moments, manifest_dtype,
                                                 records=[*view.contract_records, *options.run_records],
                                                 flag_source="live" if options.master_dtype_from and flag != "auto"
                                                 else "flag",
                                                 flag_detail=options.master_dtype_from)
    if options.master_dtypes and flag == "auto":  # said, not silent: the checkpoint's own evidence decides instead
        saved = sum(len(g.get("params", [])) for g in (view.optimizer.groups if view.optimizer else [])
                    if isinstance(g, dict))
        contract = replace(contract, detail=f"{contract.detail}; the live run's dtype per parameter "
                           f"({options.master_dtype_from or 'master_dtypes'}: {len(options.master_dtypes)}) could "
                           f"not be laid over the {saved} parameter(s) of the saved param groups")
    components: tuple[Any, ...] = ()
    if options.expect == "training":
        findings += contract_findings
        components, comp_findings = check_components(view, options.require)
        findings += comp_findings
        findings += s.attachment.findings
        findings += check_steps(view.optimizer, s.steps)
        frozen = [r for r in s.records if r.component == ComponentKind.MODEL.value and r.role == "buffer"
                  and r.precision not in (Precision.NOT_FLOAT, Precision.UNREAD)]
        if not masters_not_saved(view, contract):
            master = contract.master_dtype
            if placed is not None:
                per_param = live_per_parameter(placed, params, contract.detail)
            elif recorded is not None and contract.source == "manifest":
                per_param = live_per_parameter(recorded, params, contract.detail, "the writer recorded")
            else:
                per_param = per_parameter(contract, params, moments, s.attachment.status,
                                          [*view.contract_records, *options.run_records])
            findings += per_param.findings
            # The parameters the contract judges; those their own state decides are judged by check_precision.
            held = [r for r in params if r.param not in per_param.masters and r.param not in per_param.undecided]
            findings += check_precision(
                params, contract, frozen=frozen, frozen_why=FROZEN_WHY.get(s.attachment.status, ""),
                before_first_update=before_first_update(view, s.ckpt, s.records, s.refs, s.steps),
                not_judged=maybe_frozen(view, s.attachment, held, master),
                not_judged_why=NOT_JUDGED_WHY.get(s.attachment.status, ""),
                never_updated=never_updated_params(view, s.ckpt, s.attachment, held, master), per_param=per_param)
    findings = mark_ignored(findings, options.ignore)
    findings.sort(key=finding_order)
    master = contract.master_dtype
    sixteen = sorted({d for f in findings if f.code == "contract.per-parameter"
                      for d in f.evidence.get("dtypes", {}).values()})
    if sixteen:
        master = f"{master}, {'/'.join(sixteen)} for some parameters by design"
    summary = _summary(s, findings, master, options)
    if _nothing_recognised(s, components):
        findings, summary, components = _not_a_checkpoint(s, findings)
    return RawReport(
        command="audit",
        path=s.ckpt.path,
        format=view.layout,
        findings=tuple(findings),
        contract=contract,
        components=components,
        tensors=tuple(s.records),
        summary=summary,
        extra={"files": dict(s.ckpt.files), "attachment": s.attachment.status,
               "step": view.step, "expect": options.expect, **({"mode": "quick"} if options.quick else {})},
    )


_NOT_RECOGNISED = ("format.unrecognized",)
"""Only this says "no reader knows it"; ``format.unsupported`` and ``security.unvetted-pickle`` (legacy ``torch.save``)
are known formats ckptaudit does not read, so such a checkpoint is judged as one."""


def _nothing_recognised(s: ScannedCheckpoint, components: tuple[Any, ...]) -> bool:
    """No tensor, no component, and the readers said only that they recognise nothing (a text file, a folder of
    other files): a checkpoint that is hostile or damaged says more than that and is judged as usual."""
    return (not s.records and not any(c.found for c in components)
            and all(f.code in _NOT_RECOGNISED for f in s.findings))


def _not_a_checkpoint(s: ScannedCheckpoint, findings: list[Finding]) -> tuple[list[Finding], str, tuple[Any, ...]]:
    """Say first that ``path`` is no checkpoint, then why each file was not one; no component is judged missing
    (there is no checkpoint for them to be missing from)."""
    name = os.path.basename(os.path.normpath(s.ckpt.path)) or s.ckpt.path
    per_file = [f for f in findings if f.code in _NOT_RECOGNISED and f.subject != name]
    same = [f for f in findings if f.code in _NOT_RECOGNISED and f.subject == name]
    known = ("torch.save, safetensors, torch.distributed.checkpoint, or a Hugging Face Trainer, Accelerate, "
             "Lightning or torchtitan checkpoint directory")
    detail = "; ".join(f.message for f in same)
    head = finding("format.unrecognized", name,
                   f"{name}: not a checkpoint in any known format ({known})"
                   + (f". Detail: {detail}" if detail else f"; {len(per_file)} file(s) were tried, see below"
                      if per_file else ""),
                   files=sorted(s.ckpt.files))
    rest = [f for f in findings if f.code != "component.missing" and f not in same and f not in per_file]
    summary = f"not a checkpoint: {name} is not in any format ckptaudit reads"
    return [head, *per_file, *rest], summary, ()

def _summary(s: ScannedCheckpoint, findings: list[Finding], master: str, options: AuditOptions) -> str:
    counted = [f for f in findings if not f.ignored]
    errors = sum(f.severity is Severity.ERROR for f in counted)
    warnings = sum(f.severity is Severity.WARNING for f in counted)
    n_params = sum(r.component == "model" and r.role == "parameter" for r in s.records)
    rounded = sum(f.code in ("precision.bf16-rounded", "precision.fp16-rounded",
                             "precision.low-precision-storage") for f in counted)
    damaged = sorted({f.subject for f in counted if f.severity is Severity.ERROR
                      and f.code in ("integrity.corrupt", "integrity.incomplete")})
    verdict = "resumable" if errors == 0 else "NOT resumable as-is"
    if options.expect == "serving":
        verdict = "acceptable serving artifact" if errors == 0 else "NOT an acceptable serving artifact"
    text = (f"{verdict}: {len(s.records)} tensors ({n_params} parameters, master dtype {master}), "
            f"{errors} error(s), {warnings} warning(s)")
    if damaged:
        more = f" (+{len(damaged) - 3} more)" if len(damaged) > 3 else ""
        text += f"; corrupt or incomplete: {', '.join(damaged[:3])}{more}"
    if rounded:
        text += f"; {rounded} parameter(s) below the master precision"
    text += ignore_note(findings)
    if options.quick:
        text = ("quick audit (first chunk of each tensor, no content hashes): "
                + (text if errors else f"no defect seen, not a full verdict: {text.split(': ', 1)[1]}"))
    return text
