"""The report of ``ckptaudit latest``: the candidates table, what was skipped and why, and the JSON fields
(``latest``, ``candidates``, ``skipped``)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from ckptaudit.findings import ComponentKind, Finding, RawReport, Severity
from ckptaudit.latest.candidates import Candidate
from ckptaudit.latest.steps import Checked

__all__ = ["MAX_SKIPPED_ROWS", "latest_report"]

MAX_SKIPPED_ROWS = 50
"""Skipped entries shown in the table (the JSON lists them all)."""


def _candidate_json(ch: Checked | None, c: Candidate) -> dict[str, Any]:
    return {"path": c.path, "name": c.name, "layout": c.layout, "step": c.step,
            **({"step_from": c.step_from} if c.step_from else {}),
            "resumable": ch.resumable if ch is not None else None, "checked": ch is not None,
            "findings": [{"code": f.code, "severity": f.severity.label, "subject": f.subject, "message": f.message,
                          **({"ignored": True} if f.ignored else {})}
                         for f in (ch.findings if ch is not None else ())]}


def latest_report(root: str, *, verify: str | None = None, require: Collection[ComponentKind] = frozenset(),
                  check_all: bool = False, progress: Callable[[str], None] | None = None,
                  ignore: Collection[str] = (), master_dtype: str = "auto", run_evidence: bool = True) -> RawReport:
    """The :class:`~ckptaudit.findings.RawReport` of ``ckptaudit latest``: ``extra["latest"]`` (path or ``None``),
    ``extra["candidates"]`` and ``extra["skipped"]``; the findings are the errors of the rejected candidates newer
    than the latest resumable one (subjects prefixed by the candidate), and a stale pointer."""
    from ckptaudit.latest import DEFAULT_VERIFY, find_latest

    verify = verify or DEFAULT_VERIFY
    result = find_latest(root, verify=verify, require=require, check_all=check_all, progress=progress,
                         ignore=ignore, master_dtype=master_dtype, run_evidence=run_evidence)
    findings: list[Finding] = list(result.findings)
    rows: list[list[str]] = []
    candidates: list[dict[str, Any]] = []
    newer = True
    for ch in result.checked:
        c = ch.candidate
        is_latest = result.latest is not None and c.path == result.latest.path
        if is_latest:
            newer = False
        elif newer:
            for f in ch.findings:
                if f.severity is Severity.ERROR and not f.ignored:
                    findings.append(Finding(f.code, f.severity, _prefixed(c.name, f.subject), f.message,
                                            {**f.evidence, "candidate": c.name}))
        candidates.append(_candidate_json(ch, c))
        verdict = "LATEST" if is_latest else ("yes" if ch.resumable else "no")
        rows.append([c.name, _step(c), c.layout, verdict, ch.short_reason or _notes(ch)])
    for c in result.unchecked:
        candidates.append(_candidate_json(None, c))
        rows.append([c.name, _step(c), c.layout, "not checked", "older than the latest resumable checkpoint"])
    if result.latest is not None:
        rejected = sum(1 for ch in result.checked if not ch.resumable)
        summary = (f"newest resumable checkpoint: {result.latest.name}"
                   + (f" (step {result.latest.step})" if result.latest.step is not None else "")
                   + (f"; {rejected} newer candidate(s) rejected" if rejected and not check_all else ""))
    else:
        summary = (f"no resumable checkpoint under {result.root} ({len(result.checked)} candidate(s), none "
                   "resumable)" if result.checked else f"no checkpoint found under {result.root}")
    if result.skipped:
        summary += f"; {len(result.skipped)} entr{'y' if len(result.skipped) == 1 else 'ies'} skipped"
    sections: list[dict[str, Any]] = [{"title": "candidates, newest first",
                                       "columns": ["candidate", "step", "layout", "resumable", "why not / notes"],
                                       "rows": rows}]
    if result.skipped:
        shown = [[s.name, s.reason] for s in result.skipped[:MAX_SKIPPED_ROWS]]
        if len(result.skipped) > MAX_SKIPPED_ROWS:
            shown.append([f"... {len(result.skipped) - MAX_SKIPPED_ROWS} more", "listed in --format json"])
        sections.append({"title": "skipped (not candidates)", "columns": ["entry", "why"], "rows": shown})
    return RawReport(
        command="latest",
        path=result.root,
        format="checkpoint-root",
        findings=tuple(findings),
        summary=summary,
        extra={"latest": result.latest.path if result.latest else None,
               "latest_step": result.latest.step if result.latest else None,
               "pointer": result.pointer, "verify": verify, "run_evidence": result.run_evidence,
               "candidates": candidates,
               "skipped": [{"name": s.name, "reason": s.reason} for s in result.skipped],
               "sections": sections},
    )


def _prefixed(name: str, subject: str) -> str:
    return subject if subject == name or subject.startswith(name + "/") else f"{name}/{subject}"


def _step(c: Candidate) -> str:
    return "?" if c.step is None else str(c.step)


def _notes(ch: Checked) -> str:
    codes = sorted({f.code for f in ch.findings if f.severity is not Severity.ERROR and not f.ignored})
    notes = ", ".join(codes) if codes else "manifest verified" if ch.candidate.layout == "ckptaudit" else ""
    if ch.candidate.step_from and ch.candidate.step_from != "name":
        notes = f"step from {ch.candidate.step_from}" + (f"; {notes}" if notes else "")
    return notes
