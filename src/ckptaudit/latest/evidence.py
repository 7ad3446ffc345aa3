"""The run's own evidence in ``latest``: a candidate's siblings are the other candidates of the survey in the same
folder (the same run), not temporaries nor quarantined ones, nearest first; what each holds is read once, when first
needed (:mod:`ckptaudit.auditing.run_evidence` says what is read, when, and what it decides)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptaudit.auditing.run_evidence import Masters, Sibling, masters_of, nearest, run_record
from ckptaudit.latest.candidates import Candidate
from ckptaudit.layouts.view import ContractRecord

__all__ = ["RunEvidence"]

_NOT_SIBLINGS = ("ckptaudit-temporary", "quarantined")


@dataclass
class RunEvidence:
    """The candidates of one ``latest`` survey, and what each holds (read once, when first needed)."""

    candidates: list[Candidate]
    _read: dict[str, Masters] = field(default_factory=dict)

    def masters(self, s: Sibling) -> Masters:
        if s.path not in self._read:
            self._read[s.path] = masters_of(s)
        return self._read[s.path]

    def siblings(self, c: Candidate) -> list[Sibling]:
        return nearest(c.step, [Sibling(s.name, s.step, s.path) for s in self.candidates
                                if s.run == c.run and s.path != c.path and s.layout not in _NOT_SIBLINGS])

    def record_for(self, c: Candidate) -> ContractRecord | None:
        """The full-precision contract ``c``'s siblings establish, or ``None`` (none holds float32 masters)."""
        label = f"step {c.step}" if c.step is not None else c.name
        return run_record(label, [self.masters(s) for s in self.siblings(c)])
