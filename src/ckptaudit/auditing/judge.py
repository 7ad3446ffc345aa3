"""The judgement of an audit: the checks run on a scanned checkpoint, and the :class:`Report`.

files -> readers (:mod:`ckptaudit.formats`) -> interpretation (:mod:`ckptaudit.layouts`) -> records
(:mod:`ckptaudit.auditing.plan`, :mod:`ckptaudit.auditing.scan`: one streaming pass per tensor, on threads) ->
checks (:mod:`ckptaudit.checks`, :func:`judge`) -> Report.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ckptaudit.auditing.scan import Progress, ScannedCheckpoint, scan_checkpoint
from ckptaudit.auditing.tensor_scan import SMALL_TENSOR_BYTES
from ckptaudit.catalogue import finding, finding_order, ignore_note, mark_ignored, parse_ignore
from ckptaudit.checks.artifact import check_artifact
from ckptaudit.checks.components import check_components
from ckptaudit.checks.integrity import check_indexes
from ckptaudit.checks.lr_history import deepspeed_zero_lr_steps, zero_lr_groups
from ckptaudit.checks.manifest import check_manifest
from ckptaudit.checks.optimizer import check_steps, may_all_be_unattached, never_updated
from ckptaudit.checks.precision import MASTER_DTYPES, check_precision, infer_contract
from ckptaudit.findings import ComponentKind, Contract, Finding, Precision, RawReport, Severity, TensorRecord
from ckptaudit.formats.base import Checkpoint, walk
from ckptaudit.formats.io.tensors import (
    DEFAULT_CHUNK_BYTES,
    FileMaps,
    TensorData,
    iter_chunks,
    read_exact,
    small_read_plan,
)
from ckptaudit.layouts import SCHEDULER_KEYS, View, file_rule
from ckptaudit.layouts.attachment import ELEMENTWISE_STATE

__all__ = ["AuditOptions", "before_first_update", "judge_scan", "run_audit", "scheduler_steps", "scheduler_trees"]


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
    ignore: tuple[str, ...] = ()
    """Finding codes or families acknowledged (:func:`ckptaudit.catalogue.parse_ignore`): kept in the report,
    marked ignored, counted toward nothing."""
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
        if self.master_dtype_from and self.master_dtype == "auto":
            raise ValueError("master_dtype_from names who declared master_dtype; it needs a master_dtype, not auto")
        object.__setattr__(self, "ignore", parse_ignore(self.ignore))


def run_audit(path: str, options: AuditOptions | None = None, *, progress: Progress | None = None) -> RawReport:
    """Audit the checkpoint at ``path``. Raises ``FileNotFoundError`` when it does not exist."""
    options = options or AuditOptions()
    scanned = scan_checkpoint(path, chunk_bytes=options.chunk_bytes, progress=progress, jobs=options.jobs,
                              quick=options.quick)
    try:
        return judge_scan(scanned, options)
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
    params = _masters_in_place(params, s.records, view)
    manifest_dtype = None
    if view.manifest is not None:
        contract_info = view.manifest.get("contract")
        if isinstance(contract_info, dict) and isinstance(contract_info.get("master_dtype"), str):
            manifest_dtype = contract_info["master_dtype"]
    contract, contract_findings = infer_contract(options.master_dtype, params, moments, manifest_dtype,
                                                 records=view.contract_records,
                                                 flag_source="live" if options.master_dtype_from else "flag",
                                                 flag_detail=options.master_dtype_from)
    components: tuple[Any, ...] = ()
    if options.expect == "training":
        findings += contract_findings
        components, comp_findings = check_components(view, options.require)
        findings += comp_findings
        findings += s.attachment.findings
        findings += check_steps(view.optimizer, s.steps)
        frozen = [r for r in s.records if r.component == ComponentKind.MODEL.value and r.role == "buffer"
                  and r.precision not in (Precision.NOT_FLOAT, Precision.UNREAD)]
        if not _masters_not_saved(view, contract):
            findings += check_precision(params, contract, frozen=frozen,
                                        frozen_why=_FROZEN_WHY.get(s.attachment.status, ""),
                                        before_first_update=before_first_update(s),
                                        not_judged=_maybe_frozen(s, params, contract.master_dtype),
                                        not_judged_why=_NOT_JUDGED_WHY.get(s.attachment.status, ""),
                                        never_updated=_never_updated(s, params, contract.master_dtype))
    findings = mark_ignored(findings, options.ignore)
    findings.sort(key=finding_order)
    summary = _summary(s, findings, contract.master_dtype, options)
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


def _masters_not_saved(view: View, contract: Contract) -> bool:
    """The deciding record keeps the masters in the optimizer's state (DeepSpeed, Megatron) and the checkpoint
    holds no optimizer: its 16-bit model tensors are compute copies with no master to judge
    (``component.missing`` says the optimizer is absent)."""
    return view.optimizer is None and any(r.in_optimizer and r.where == contract.where and r.master_dtype
                                          for r in view.contract_records)


_FROZEN_WHY = {
    "by-name": "no optimizer state entry names it",
    "by-param-names": "no optimizer state entry names it",
    "unique-order": "no order-consistent assignment of the index-keyed optimizer state gives it an entry",
    "ambiguous": "no order-consistent assignment of the index-keyed optimizer state gives it an entry",
    "unknown-order": "no entry of the index-keyed optimizer state has its shape",
}
"""How :func:`~ckptaudit.layouts.attachment.attach` decided, by its status, that a model tensor carries no
optimizer state."""


_NOT_JUDGED_WHY = {
    "ambiguous": "an order-consistent assignment of the index-keyed state that fits every entry leaves all such "
                 "parameters out",
    "unknown-order": "the model file keeps no parameter order, and the index-keyed state's shapes fit the other "
                     "parameters",
}


def _maybe_frozen(s: ScannedCheckpoint, params: list[TensorRecord], master: str) -> set[str]:
    """The parameters below a wide master dtype when index-keyed optimizer state may give none of them an entry
    (every one could be frozen); empty when the state decides (a unique attachment, names) or some must be
    trainable."""
    if master not in ("float32", "float64") or s.attachment.status not in _NOT_JUDGED_WHY:
        return set()
    below = _below(params)
    return below if may_all_be_unattached(s.view, below) else set()


def _below(params: list[TensorRecord]) -> set[str]:
    """The parameters stored or rounded below a wide master dtype."""
    return {r.param for r in params if r.param is not None
            and (r.dtype in ("bfloat16", "float16") or (r.dtype == "float32"
                                                        and r.precision in (Precision.BF16, Precision.FP16)))}


def _never_updated(s: ScannedCheckpoint, params: list[TensorRecord], master: str) -> dict[str, str]:
    """The parameters below a wide master dtype that a param group at learning rate 0 throughout holds (every lr
    its record keeps is 0: :func:`~ckptaudit.checks.lr_history.zero_lr_groups`), with that evidence."""
    opt = s.view.optimizer
    if master not in ("float32", "float64") or opt is None or not opt.groups:
        return {}
    below = _below(params)
    if not below:
        return {}
    zero = zero_lr_groups(opt.groups, scheduler_trees(s.ckpt))
    return never_updated(s.view, s.attachment, zero, below) if zero else {}


def before_first_update(s: ScannedCheckpoint) -> str | None:
    """The evidence, in words, that no optimizer update was applied before this save; ``None`` when the
    checkpoint's own state does not show it.

    Shown by: an optimizer whose state is empty (one that keeps state from its first step: Adam's betas, or a
    momentum), or whose every moment is exactly zero with step counters 0 or 1 (``get_state_dict`` fills a fresh
    optimizer's state by its own zero-lr step: step 1, zero moments); and no train step or scheduler step above 0.
    Reads the moments that could be zero (one pass, stopping at the first non-zero byte). Also shown, after
    steps, by a record of the learning rates applied that says every one was 0 (DeepSpeed's WarmupLR from its
    default ``warmup_min_lr`` 0: :mod:`ckptaudit.checks.lr_history`).
    """
    opt = s.view.optimizer
    if opt is not None and s.view.layout == "deepspeed":
        zero_lr = _deepspeed_zero_lr(s, opt.groups)
        if zero_lr is not None:
            return zero_lr
    if opt is None or (s.view.step is not None and s.view.step != 0):
        return None
    epochs = scheduler_steps(s.ckpt)
    if any(e > 0 for e in epochs):
        return None
    said = [f"train step {s.view.step}"] if s.view.step is not None else []
    said += ["scheduler step 0"] if epochs else []
    if not opt.state:
        stateful = any("betas" in g or (isinstance(g.get("momentum"), int | float) and g["momentum"] > 0)
                       for g in opt.groups)
        if not stateful and not said:
            return None  # plain SGD keeps no state even after many steps
        return "; ".join(["the optimizer holds no state", *said])
    if any(v not in (0.0, 1.0) for v in s.steps.values()):
        return None
    moments = [(r, ref) for r, ref in zip(s.records, s.refs, strict=True)
               if r.component == ComponentKind.OPTIMIZER.value and r.role in ELEMENTWISE_STATE]
    if not moments:
        return None
    # Zero moments are 16-bit-representable with no informative value: rule out every other tensor before reading.
    if any(r.precision not in (Precision.INCONCLUSIVE, Precision.NATIVE_16) or not isinstance(ref.data, TensorData)
           for r, ref in moments):
        return None
    if not all(isinstance(ref.data, TensorData) and _all_zero(ref.data, s.ckpt.maps) for _, ref in moments):
        return None
    counters = sorted({f"{v:g}" for v in s.steps.values()})
    return "; ".join([f"all {len(moments)} optimizer moments are exactly zero"
                      + (f", step counters {' and '.join(counters)}" if counters else ""), *said])


def _deepspeed_zero_lr(s: ScannedCheckpoint, groups: Any) -> str | None:
    trees = [p.tree for p in s.ckpt.parts if isinstance(p.tree, dict) and isinstance(p.tree.get("deepspeed"), dict)]
    if len(trees) != 1:
        return None
    facts = trees[0]["deepspeed"]
    return deepspeed_zero_lr_steps(facts.get("ds_config"), trees[0].get("lr_scheduler"), facts, groups)


def _all_zero(data: TensorData, maps: FileMaps) -> bool:
    try:
        plan = small_read_plan(data, SMALL_TENSOR_BYTES)
        if plan is not None:  # without NumPy
            return not any(any(read_exact(maps, p, pos, p.numel * data.dtype.itemsize)) for p, pos in plan)
        import numpy as np

        return not any(np.ascontiguousarray(chunk).view(np.uint8).any() for chunk in iter_chunks(data, maps))
    except (ValueError, OSError):
        return False


def scheduler_trees(ckpt: Checkpoint) -> list[Any]:
    """Every learning-rate scheduler state the checkpoint holds, wherever its layout keeps schedulers
    (``scheduler*.pt`` files, ``scheduler``/``lr_scheduler(s)`` keys)."""
    trees: list[Any] = []
    for part in ckpt.parts:
        if part.name and file_rule(part.name) is ComponentKind.SCHEDULER:
            trees.append(part.tree)
        elif isinstance(part.tree, dict):
            trees += [v for k, v in part.tree.items() if str(k) in SCHEDULER_KEYS]
    return trees


def scheduler_steps(ckpt: Checkpoint) -> list[int]:
    """Every learning-rate scheduler's ``last_epoch`` (steps taken; 0 right after construction) the checkpoint
    holds (:func:`scheduler_trees`)."""
    trees = scheduler_trees(ckpt)
    return [leaf for tree in trees for path, leaf in walk(tree)
            if path and path[-1] == "last_epoch" and isinstance(leaf, int) and not isinstance(leaf, bool)]


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

def _masters_in_place(params: list[TensorRecord], records: list[TensorRecord], view: View) -> list[TensorRecord]:
    """The records the precision checks judge: where the optimizer keeps a parameter's master copy (Megatron's
    ``fp32_param``), that master is the training state, so it takes the place of the model's 16-bit copy.
    Masters in flat buckets (Megatron's distributed optimizer) belong to no one parameter: they are judged
    themselves, in place of every 16-bit model copy."""
    opt = view.optimizer
    if opt is None or not opt.masters:
        return params
    buckets = {ref.name for ref in opt.unattached_masters}
    usable = [r for r in records if r.component == ComponentKind.OPTIMIZER.value
              and (r.role in opt.masters or r.name in buckets)
              and r.precision is not Precision.NOT_FLOAT and r.precision is not Precision.UNREAD]
    by_param = {r.param: r for r in usable if r.param is not None}
    judged = [by_param.get(r.param, r) if r.param is not None else r for r in params]
    bucket_masters = [r for r in usable if r.name in buckets]
    if bucket_masters:
        judged = [r for r in judged if r.dtype not in ("bfloat16", "float16")] + bucket_masters
    return judged


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
