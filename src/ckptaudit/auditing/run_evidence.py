"""The run's own evidence: the master dtype a checkpoint's siblings (the run's other checkpoints) establish, as one
more source of the contract (a :class:`~ckptaudit.layouts.view.ContractRecord` of source ``run``), per parameter
where a sibling's own optimizer state shows some parameters 16-bit by design (``sixteen_bit``): a parameter
16-bit in this checkpoint that a sibling keeps a float32 master of lost it, whatever the rest.

Judged alone, a checkpoint whose parameters and optimizer moments are all bf16 may be a genuine bf16-masters run
(``contract.inferred``, a warning). Beside checkpoints of the same run that hold float32 masters, it is not: the
run keeps float32 masters and this one lost them (an exporter cast the state): ``contract.run-mismatch``, an error
naming the siblings. The record comes after the checkpoint's own (its manifest, its stack's record decide first;
``--master-dtype`` above all), and only full-precision evidence is given: a run whose every checkpoint is bf16 is
judged as each file alone (the lossy direction is the one a run loses).

Cheap by construction: the siblings are read (headers and metadata, never tensor data, never unpickling) only when
the checkpoint's own contract came out as 16-bit masters inferred from its tensors (:func:`judge_with_run`), the one
case the evidence can change, and at most :data:`MAX_SIBLINGS` of them. For ``ckptaudit audit``, the siblings are
the entries beside the checkpoint whose names differ from its name only in their numbers (``ckpt-0006.pt`` beside
``ckpt-0008.pt``; ``checkpoint-6/`` beside ``checkpoint-8/``): :func:`siblings_of`; read by the process that
judges (:func:`judge_audit`: the single-process audit, and rank 0 of the distributed one, once every rank's records
are gathered: the siblings lie on the filesystem every rank sees, and only their headers are read).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ckptaudit.layouts.view import ContractRecord

if TYPE_CHECKING:
    from ckptaudit.auditing.judge import AuditOptions
    from ckptaudit.auditing.scan import ScannedCheckpoint
    from ckptaudit.findings import RawReport

__all__ = ["MAX_LISTED", "MAX_SIBLINGS", "Masters", "Sibling", "audit_evidence", "judge_audit", "judge_with_run",
           "masters_of", "nearest", "run_record", "siblings_of", "steps_text"]

MAX_SIBLINGS = 4
"""Siblings read per judged checkpoint at most (each: its headers and metadata, the cost of ``--verify sizes``)."""
MAX_LISTED = 10_000
"""Entries of the checkpoint's folder looked at when finding its siblings (``audit``)."""
_WIDE = ("float32", "float64")
_NARROW = ("bfloat16", "float16")
_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True, slots=True)
class Sibling:
    """Another checkpoint of the same run: its name (as the report shows it), step and path."""

    name: str
    step: int | None
    path: str


@dataclass(frozen=True, slots=True)
class Masters:
    """What one checkpoint holds as masters: ``dtype`` (``None``: not decided by its tensors or records) and how
    that was read, in words."""

    sibling: Sibling
    dtype: str | None
    how: str
    sixteen_bit: tuple[tuple[str, str], ...] = ()
    """(parameter, dtype) of the parameters whose own optimizer state is 16-bit beside others' float32 state: a
    model holding those in 16 bits by design (:func:`~ckptaudit.checks.precision.per_parameter`)."""


def masters_of(s: Sibling) -> Masters:
    """The masters ``s`` holds, from its headers and metadata: its manifest's contract, else its stack's deciding
    record, else float32 optimizer moments (float32 masters), or 16-bit parameters beside 16-bit moments."""
    from ckptaudit.formats import open_checkpoint
    from ckptaudit.layouts import interpret
    from ckptaudit.layouts.attachment import ELEMENTWISE_STATE, attach
    from ckptaudit.layouts.view import TensorRef

    try:
        with open_checkpoint(s.path) as ckpt:
            view = interpret(ckpt)
    except (OSError, ValueError) as exc:
        return Masters(s, None, f"not read ({exc})")
    contract = view.manifest.get("contract") if isinstance(view.manifest, dict) else None
    if isinstance(contract, dict) and isinstance(contract.get("master_dtype"), str):
        return Masters(s, str(contract["master_dtype"]), f"its manifest records {contract['master_dtype']} masters")
    deciding = next((r for r in view.contract_records if r.master_dtype is not None), None)
    if deciding is not None:
        return Masters(s, deciding.master_dtype, deciding.text())
    params = Counter(ref.data.dtype.name for ref in (view.model.params.values() if view.model else ())
                     if isinstance(ref, TensorRef) and hasattr(ref.data, "dtype") and ref.data.dtype.is_float)
    moments: Counter[str] = Counter()
    own: dict[str, set[str]] = {}
    if view.optimizer is not None:
        mapping = attach(view).mapping
        for pkey, state in view.optimizer.state.items():
            for key, ref in state.items():
                if key in ELEMENTWISE_STATE and isinstance(ref, TensorRef) and hasattr(ref.data, "dtype"):
                    moments[ref.data.dtype.name] += 1
                    if pkey in mapping:
                        own.setdefault(mapping[pkey], set()).add(ref.data.dtype.name)
    param = params.most_common(1)[0][0] if params else None
    moment = moments.most_common(1)[0][0] if moments else None
    wide = sum(1 for d in own.values() if d & set(_WIDE))
    sixteen = tuple(sorted((p, min(d)) for p, d in own.items() if len(d) == 1 and d <= set(_NARROW)))
    if wide and sixteen:  # each parameter's state in its own dtype: 16-bit ones by design, the others float32
        dtypes = "/".join(sorted({d for _, d in sixteen}))
        return Masters(s, "float32", f"float32 optimizer moments for {wide} parameter(s) and {dtypes} for "
                       f"{len(sixteen)}, each in its parameter's dtype", sixteen)
    if set(moments) & set(_WIDE) and set(moments) & set(_NARROW):
        return Masters(s, None, "float32 and 16-bit optimizer moments whose parameters cannot be told apart")
    if moment in _WIDE and param is not None:
        return Masters(s, "float32", f"{param} parameters and {moment} optimizer moments")
    if moment in _NARROW and param in _NARROW:
        return Masters(s, moment, f"{param} parameters and {moment} optimizer moments")
    return Masters(s, None, "no optimizer moments to tell" if moment is None else f"{param} parameters and "
                   f"{moment} optimizer moments")


def steps_text(siblings: Sequence[Sibling]) -> str:
    """``steps 2-6`` (three or more), ``steps 2 and 4``, ``step 2``; names where a step is unknown."""
    steps = sorted(s.step for s in siblings if s.step is not None)
    if len(steps) != len(siblings):
        return ", ".join(sorted(s.name for s in siblings))
    if len(steps) >= 3:
        return f"steps {steps[0]}-{steps[-1]}"
    if len(steps) == 2:
        return f"steps {steps[0]} and {steps[1]}"
    return f"step {steps[0]}"


def nearest(step: int | None, siblings: Sequence[Sibling]) -> list[Sibling]:
    """At most :data:`MAX_SIBLINGS` of ``siblings``, nearest to ``step`` first, older before newer."""
    if step is None:
        return list(siblings)[:MAX_SIBLINGS]
    older = sorted((s for s in siblings if s.step is not None and s.step < step), key=lambda s: -(s.step or 0))
    newer = sorted((s for s in siblings if s.step is not None and s.step > step), key=lambda s: s.step or 0)
    return (older + newer)[:MAX_SIBLINGS]


def run_record(label: str, masters: Sequence[Masters]) -> ContractRecord | None:
    """The full-precision contract the siblings' ``masters`` establish for the checkpoint called ``label``
    (``step 8``), or ``None`` when none of them holds float32 masters. ``why`` names the judged checkpoint."""
    wide = [m for m in masters if m.dtype in _WIDE]
    if not wide:
        return None
    sibs = [m.sibling for m in wide]
    # A parameter 16-bit by design in the nearest sibling that shows any: held to that dtype, not to float32.
    sixteen = next((m.sixteen_bit for m in wide if m.sixteen_bit), ())
    return ContractRecord("run", ", ".join(sorted(s.name for s in sibs)),
                          f"{steps_text(sibs)} hold float32 masters ({wide[0].sibling.name}: {wide[0].how})",
                          "float32", label, sixteen_bit=sixteen)


def _pattern(name: str) -> re.Pattern[str] | None:
    """``ckpt-0008.pt`` -> ``^ckpt\\-(\\d+)\\.pt$``; ``None`` for a name without a number."""
    parts = _DIGITS.split(name)
    if len(parts) < 2:
        return None
    return re.compile("^" + r"(\d+)".join(re.escape(p) for p in parts) + "$")


def siblings_of(path: str) -> tuple[str, list[Sibling]]:
    """The label of the local checkpoint ``path`` (``step 8``) and its siblings: the entries of its folder of the
    same kind (file or folder) whose names differ from its name only in their numbers, the last number being the
    step; none when its name has no number, for a URL, or past :data:`MAX_LISTED` entries."""
    from ckptaudit.formats.remote import is_url
    from ckptaudit.ondisk import layout, quarantine

    if is_url(path):
        return "", []
    path = os.path.abspath(path)
    folder, name = os.path.split(path.rstrip(os.sep))
    pattern = _pattern(name)
    parsed = layout.parse_step_name(name)
    if pattern is None or quarantine.is_quarantined(name) or (parsed is not None and parsed[1] != "committed"):
        return "", []
    m = pattern.match(name)
    assert m is not None
    label = f"step {int(m.groups()[-1])}"
    is_dir = os.path.isdir(path)
    found: list[Sibling] = []
    try:
        with os.scandir(folder) as it:
            for i, e in enumerate(it):
                if i >= MAX_LISTED:
                    return label, []
                hit = pattern.match(e.name)
                if hit is None or e.name == name or e.is_symlink() or e.is_dir() != is_dir:
                    continue
                found.append(Sibling(e.name, int(hit.groups()[-1]), e.path))
    except OSError:
        return label, []
    return label, found


def judge_with_run(s: ScannedCheckpoint, options: AuditOptions,
                   evidence: Callable[[], ContractRecord | None]) -> RawReport:
    """:func:`~ckptaudit.auditing.judge.judge_scan`, then, only when the contract came out as 16-bit masters
    inferred from the tensors (the one case the run's evidence can change), once more with ``evidence()`` (the
    run's record, read then) if it gives one."""
    from ckptaudit.auditing.judge import judge_scan

    report = judge_scan(s, options)
    contract = report.contract
    # 16-bit masters inferred from the tensors: for the whole checkpoint, or for some parameters (their own
    # moments 16-bit beside others' float32: contract.per-parameter), which the run's other checkpoints may contradict.
    per_param = any(f.code == "contract.per-parameter" for f in report.findings)
    if (options.master_dtype != "auto" or options.master_dtypes or options.run_records or contract is None
            or contract.source != "optimizer-state" or (contract.master_dtype not in _NARROW and not per_param)):
        return report
    record = evidence()
    return report if record is None else judge_scan(s, replace(options, run_records=(record,)))


def audit_evidence(path: str) -> Callable[[], ContractRecord | None]:
    """The run's evidence for ``ckptaudit audit`` of ``path``: its siblings (:func:`siblings_of`), read when
    asked."""
    def read() -> ContractRecord | None:
        label, sibs = siblings_of(path)
        if not sibs:
            return None
        step = int(label.split()[-1]) if label else None
        return run_record(label, [masters_of(x) for x in nearest(step, sibs)])
    return read


def judge_audit(s: ScannedCheckpoint, options: AuditOptions, path: str) -> RawReport:
    """The judgement of ``ckptaudit audit PATH`` on its scanned checkpoint, one function for the single-process
    audit (:func:`~ckptaudit.auditing.judge.run_audit`) and rank 0 of the distributed one
    (:func:`~ckptaudit.auditing.distributed.audit_distributed`), so the two reports are the same: the checks, and
    the run's evidence (:func:`audit_evidence`) where ``options.run_evidence`` asks for it."""
    if options.run_evidence:
        return judge_with_run(s, options, audit_evidence(path))
    from ckptaudit.auditing.judge import judge_scan

    return judge_scan(s, options)
