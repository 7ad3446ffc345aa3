"""The run's own evidence: the master dtype a run's other checkpoints establish, as one more source of the contract.

Judged alone, a checkpoint whose parameters and optimizer moments are all bf16 may be a genuine bf16-masters run
(``contract.inferred``, a warning). Beside checkpoints of the same run that hold float32 masters, it is not: the
run keeps float32 masters and this one lost them (an exporter cast the state). :class:`RunEvidence` reads what
each sibling holds (headers and metadata only: no tensor data) and gives the judged checkpoint a
:class:`~ckptaudit.layouts.view.ContractRecord` of source ``run``, placed after the checkpoint's own records, so
that its manifest or its stack's record still decides first and ``--master-dtype`` above all. A contradiction is
``contract.run-mismatch`` (an error naming the siblings). Only full-precision evidence is given: a run whose every
checkpoint is bf16 is judged as each file alone is (the lossy direction is the one a run loses).

Siblings: the other candidates in the same folder (the same run), not temporaries nor quarantined ones, nearest
first (older before newer), at most :data:`MAX_SIBLINGS`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ckptaudit.latest.candidates import Candidate
from ckptaudit.layouts.view import ContractRecord

__all__ = ["MAX_SIBLINGS", "Masters", "RunEvidence", "masters_of", "steps_text"]

MAX_SIBLINGS = 4
"""Siblings read per judged checkpoint at most (each: its headers and metadata, the cost of ``--verify sizes``)."""
_WIDE = ("float32", "float64")
_NARROW = ("bfloat16", "float16")
_NOT_SIBLINGS = ("ckptaudit-temporary", "quarantined")


@dataclass(frozen=True, slots=True)
class Masters:
    """What one checkpoint holds as masters: ``dtype`` (``None``: not decided by its tensors or records) and how
    that was read, in words."""

    candidate: Candidate
    dtype: str | None
    how: str


def masters_of(c: Candidate) -> Masters:
    """The masters ``c`` holds, from its headers and metadata (never its tensor data, never unpickling): its
    manifest's contract, else its stack's deciding record, else float32 optimizer moments (float32 masters), or
    16-bit parameters beside 16-bit moments."""
    from ckptaudit.formats import open_checkpoint
    from ckptaudit.layouts import interpret
    from ckptaudit.layouts.attachment import ELEMENTWISE_STATE
    from ckptaudit.layouts.view import TensorRef

    try:
        with open_checkpoint(c.path) as ckpt:
            view = interpret(ckpt)
    except (OSError, ValueError) as exc:
        return Masters(c, None, f"not read ({exc})")
    contract = view.manifest.get("contract") if isinstance(view.manifest, dict) else None
    if isinstance(contract, dict) and isinstance(contract.get("master_dtype"), str):
        return Masters(c, str(contract["master_dtype"]), f"its manifest records {contract['master_dtype']} masters")
    deciding = next((r for r in view.contract_records if r.master_dtype is not None), None)
    if deciding is not None:
        return Masters(c, deciding.master_dtype, deciding.text())
    params = Counter(ref.data.dtype.name for ref in (view.model.params.values() if view.model else ())
                     if isinstance(ref, TensorRef) and hasattr(ref.data, "dtype") and ref.data.dtype.is_float)
    moments: Counter[str] = Counter()
    if view.optimizer is not None:
        for state in view.optimizer.state.values():
            for key, ref in state.items():
                if key in ELEMENTWISE_STATE and isinstance(ref, TensorRef) and hasattr(ref.data, "dtype"):
                    moments[ref.data.dtype.name] += 1
    param = params.most_common(1)[0][0] if params else None
    moment = moments.most_common(1)[0][0] if moments else None
    if moment in _WIDE and param is not None:
        return Masters(c, "float32", f"{param} parameters and {moment} optimizer moments")
    if moment in _NARROW and param in _NARROW:
        return Masters(c, moment, f"{param} parameters and {moment} optimizer moments")
    return Masters(c, None, "no optimizer moments to tell" if moment is None else f"{param} parameters and "
                   f"{moment} optimizer moments")


def steps_text(cands: list[Candidate]) -> str:
    """``steps 2-6`` (three or more), ``steps 2 and 4``, ``step 2``; names where a step is unknown."""
    steps = sorted(c.step for c in cands if c.step is not None)
    if len(steps) != len(cands):
        return ", ".join(sorted(c.name for c in cands))
    if len(steps) >= 3:
        return f"steps {steps[0]}-{steps[-1]}"
    if len(steps) == 2:
        return f"steps {steps[0]} and {steps[1]}"
    return f"step {steps[0]}"


@dataclass
class RunEvidence:
    """The candidates of one ``latest`` survey, and what each holds (read once, when first needed)."""

    candidates: list[Candidate]
    _read: dict[str, Masters] = field(default_factory=dict)

    def masters(self, c: Candidate) -> Masters:
        if c.path not in self._read:
            self._read[c.path] = masters_of(c)
        return self._read[c.path]

    def siblings(self, c: Candidate) -> list[Candidate]:
        same = [s for s in self.candidates if s.run == c.run and s.path != c.path and s.layout not in _NOT_SIBLINGS]
        if c.step is None:
            return same[:MAX_SIBLINGS]
        older = sorted((s for s in same if s.step is not None and s.step < c.step), key=lambda s: -(s.step or 0))
        newer = sorted((s for s in same if s.step is not None and s.step > c.step), key=lambda s: s.step or 0)
        return (older + newer)[:MAX_SIBLINGS]

    def record_for(self, c: Candidate) -> ContractRecord | None:
        """The full-precision contract ``c``'s siblings establish, or ``None`` (none holds float32 masters)."""
        wide = [m for m in (self.masters(s) for s in self.siblings(c)) if m.dtype in _WIDE]
        if not wide:
            return None
        cands = [m.candidate for m in wide]
        label = f"step {c.step}" if c.step is not None else c.name
        return ContractRecord(
            "run", ", ".join(sorted(s.name for s in cands)),
            f"{steps_text(cands)} hold float32 masters ({wide[0].candidate.name}: {wide[0].how})", "float32",
            label)
