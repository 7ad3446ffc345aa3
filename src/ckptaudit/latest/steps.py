"""``latest``'s validation of one candidate: a sequence of small steps (:data:`CANDIDATE_STEPS`), each adding its
findings to the candidate's :class:`StepContext`, any of them able to end the sequence (``ctx.stop``).

A new check of a candidate (a passport required, a damaged ancestor) is one function ``step(candidate, ctx)`` and
one line in :data:`CANDIDATE_STEPS`. What a step can read: the options (``verify``, ``require``, ``ignore``,
``master_dtype``), the run (``ctx.run``: every candidate of the survey and what each holds, ``None`` when a
candidate is validated alone) and the candidates validated before this one (``ctx.checked``, newest first).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptaudit.catalogue import finding
from ckptaudit.findings import ComponentKind, Finding, Severity, safe_str
from ckptaudit.latest.candidates import Candidate
from ckptaudit.latest.evidence import RunEvidence
from ckptaudit.latest.lineage import damaged_ancestor, damaged_lineage
from ckptaudit.ondisk import layout, quarantine
from ckptaudit.ondisk import manifest as mf

__all__ = ["CANDIDATE_STEPS", "QUICK_CHUNK_BYTES", "CandidateStep", "Checked", "StepContext"]

QUICK_CHUNK_BYTES = 64 << 10
"""What ``verify="quick"`` reads of each tensor: its first 64 KiB (16,384 fp32 values), far more than a genuine fp32
tensor needs to show one value off the bf16 grid, and a small share of a large checkpoint's bytes."""


@dataclass(frozen=True, slots=True)
class Checked:
    candidate: Candidate
    resumable: bool
    findings: tuple[Finding, ...]

    @property
    def reason(self) -> str:
        """The first error's message (why it is not resumable), or ``""``."""
        errors = [f for f in self.findings if f.severity is Severity.ERROR and not f.ignored]
        if not errors:
            return ""
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        return errors[0].message + more

    @property
    def short_reason(self) -> str:
        """The errors' codes and subjects, for a table whose findings section holds the messages."""
        errors = [f for f in self.findings if f.severity is Severity.ERROR and not f.ignored]
        text = "; ".join(f"{f.code}: {f.subject}" for f in errors[:2])
        return text + (f" (+{len(errors) - 2} more)" if len(errors) > 2 else "")


@dataclass
class StepContext:
    """One candidate's validation: the options, the run, and the findings so far."""

    verify: str
    require: frozenset[Any]
    """What the caller requires: components (:class:`~ckptaudit.findings.ComponentKind`: :attr:`components`), and
    what a step of its own reads (``passport`` / ``passport=KEY``: :mod:`ckptaudit.passport.requirement`)."""
    ignore: tuple[str, ...]
    master_dtype: str
    run: RunEvidence | None = None
    """Every candidate of the survey and what each holds; ``None``: validated alone (no run evidence)."""
    checked: list[Checked] = field(default_factory=list)
    """The candidates validated before this one, newest first."""
    findings: list[Finding] = field(default_factory=list)
    stop: bool = False
    """Set by a step after which nothing more is to be learnt (a temporary, a quarantined checkpoint)."""
    manifest: dict[str, Any] | None = None
    """The candidate's manifest as its reading found it (set by :func:`content`)."""


    @property
    def components(self) -> frozenset[ComponentKind]:
        """The required components, for the audit's component check."""
        return frozenset(r for r in self.require if isinstance(r, ComponentKind))


CandidateStep = Callable[[Candidate, StepContext], None]


def _has(c: Candidate, name: str) -> bool:
    if c.remote:
        return name in (c.files or ())
    return os.path.isfile(os.path.join(c.path, name))


def uncommitted(c: Candidate, ctx: StepContext) -> None:
    """The writer's temporary folders (``step-N.partial-*``): never resumable."""
    if c.layout != "ckptaudit-temporary":
        return
    from ckptaudit.checks.manifest import uncommitted as local_uncommitted

    temp = None if c.remote else local_uncommitted(c.path)
    ctx.findings.append(temp or finding(
        "store.uncommitted", c.name, f"{c.name}: temporary directory of the save of step {c.step}, which never "
        "committed; never resumable, and the next save removes it", step=c.step))
    ctx.stop = True


def quarantined(c: Candidate, ctx: StepContext) -> None:
    """Moved aside by the in-loop guard (a failure, or a descendant of a damaged training state), or marked in
    place (an object store's checkpoint: the marker beside it says why): never resumable."""
    if c.layout != "quarantined":
        return
    base = os.path.basename(c.path.rstrip("/"))
    report = base + quarantine.REPORT_SUFFIX
    original = quarantine.quarantined_original(base)
    if original is None:  # not renamed: its quarantine marker lies beside it
        why, ancestor = _marker_reason(quarantine.marker_name(c.path))
        marked: dict[str, Any] = {"original": base}
        if ancestor:
            marked["damaged_ancestor"] = ancestor
        what = (f"passed its own audit, but its training state descends from the damage at {ancestor}, so it"
                if ancestor else f"failed its audit during training{why} and")
        ctx.findings.append(finding(
            "guard.quarantined", c.name,
            f"{c.name}: {what} was marked quarantined by the guard, which left it in place (marker: "
            f"{base}{quarantine.MARKER_SUFFIX}; report: {report})", **marked))
        ctx.stop = True
        return
    has_report = (os.path.isfile(os.path.normpath(c.path) + quarantine.REPORT_SUFFIX) if not c.remote else False)
    bad = damaged_ancestor(c)  # passed its own audit, but set aside as a descendant of a damaged training state
    evidence: dict[str, Any] = {"original": original}
    if bad is not None:
        evidence["damaged_ancestor"] = bad.checkpoint
    ctx.findings.append(finding(
        "guard.quarantined", c.name,
        f"{c.name}: " + (f"passed its own audit, but its training state descends from the damage at "
                         f"{bad.checkpoint} (the lineage in its passport), so the guard moved it aside"
                         if bad is not None else "failed its audit during training and was moved aside by the guard")
        + (f" (report: {report})" if has_report else ""), **evidence))
    ctx.stop = True


MAX_MARKER_BYTES = 64 << 10
"""What is read of a quarantine marker (a small JSON document the guard writes): one bounded read."""


def _marker_reason(path: str) -> tuple[str, str | None]:
    """`` (CODES)``, the failing codes a quarantine marker records (``""`` when it cannot be read), and the damaged
    ancestor it names when the checkpoint passed but descends from a damaged training state."""
    import json

    from ckptaudit.formats.remote import is_url

    if is_url(path):
        from ckptaudit.latest.listing import read_head

        data = read_head(path, MAX_MARKER_BYTES)
    else:
        from ckptaudit.formats.io.safeio import open_regular

        try:
            with open_regular(path) as fh:
                data = fh.read(MAX_MARKER_BYTES)
        except OSError:
            data = None
    try:
        doc = json.loads(data or b"")
        listed = doc.get("codes") if isinstance(doc, dict) else None
        codes = [str(x)[:80] for x in listed[:5]] if isinstance(listed, list) else []
        ancestor = doc.get("damaged_ancestor") if isinstance(doc, dict) else None
    except (ValueError, AttributeError, TypeError):
        return "", None
    return (f" ({', '.join(codes)})" if codes else ""), (safe_str(ancestor)[:300] if isinstance(ancestor, str)
                                                         else None)


def empty(c: Candidate, ctx: StepContext) -> None:
    """A folder with nothing in it: the save died before writing anything."""
    is_empty = c.files == () if c.remote else os.path.isdir(c.path) and not os.listdir(c.path)
    if is_empty:
        ctx.findings.append(finding("integrity.incomplete", c.name,
                                    f"{c.name} is empty: the save died before writing anything"))
        ctx.stop = True


def content(c: Candidate, ctx: StepContext) -> None:
    """Read the candidate (a URL is staged as ``audit`` stages it) and check it at ``ctx.verify``: the quick or
    full audit, held to the run's evidence where the file alone does not decide; or integrity only."""
    try:
        ctx.findings += _read_and_check(c, ctx)
    except OSError as exc:
        ctx.findings.append(finding("integrity.corrupt", c.name,
                                    f"{c.name}: cannot be read ({exc.strerror or exc})"))


def commit_marker(c: Candidate, ctx: StepContext) -> None:
    """The format's commit marker, written last by its library: our manifest, Trainer's ``trainer_state.json``,
    Megatron's ``metadata.json``; without our manifest the content is not verified (``store.unverified``)."""
    ours = _has_our_manifest(c, ctx)
    if c.layout == "ckptaudit" and not ours:
        ctx.findings.append(finding("integrity.corrupt", layout.MANIFEST,
                                    f"{c.name}/{layout.MANIFEST} is not a readable ckptaudit manifest"))
    if c.layout == "huggingface-trainer" and not _has(c, "trainer_state.json"):
        ctx.findings.append(finding(
            "integrity.incomplete", "trainer_state.json",
            f"{c.name} has no trainer_state.json; Trainer writes it last, so the save did not finish"))
    if c.layout == "megatron" and not _has(c, "metadata.json"):
        ctx.findings.append(finding(
            "integrity.incomplete", "metadata.json",
            f"{c.name} has no metadata.json; Megatron-Core's dist_checkpointing.save writes it last, so the save "
            "did not finish"))
    if not ours:
        marker = {"lightning": "the file's own structure", "torch.save": "the file's own structure",
                  "safetensors": "the file's own header", "huggingface-trainer": "trainer_state.json",
                  "directory": "the files' own structure",
                  "deepspeed": "the model states and every rank's optimizer shard"}.get(c.layout, ".metadata")
        ctx.findings.append(finding("store.unverified", c.name,
                                    f"{c.name}: no ckptaudit manifest; completeness judged from {marker} and the "
                                    "recorded sizes, content not verified"))


def passport(c: Candidate, ctx: StepContext) -> None:
    """``--require passport``: the candidate's passport must verify (:mod:`ckptaudit.passport.requirement`)."""
    from ckptaudit.passport.requirement import require_passport_step

    require_passport_step(c, ctx)


CANDIDATE_STEPS: list[CandidateStep] = [uncommitted, quarantined, empty, damaged_lineage, content, commit_marker,
                                       passport]
"""The steps every candidate goes through, in order (add one line here for a new one)."""


def _read_and_check(c: Candidate, ctx: StepContext) -> list[Finding]:
    if ctx.verify in ("quick", "full"):
        from ckptaudit.auditing.judge import AuditOptions
        from ckptaudit.auditing.run_evidence import judge_with_run
        from ckptaudit.auditing.scan import default_jobs, scan_checkpoint
        from ckptaudit.checks.manifest import check_manifest
        from ckptaudit.formats.io.tensors import DEFAULT_CHUNK_BYTES

        quick = ctx.verify == "quick"
        options = AuditOptions(require=ctx.components, jobs=default_jobs(), quick=quick, ignore=ctx.ignore,
                               master_dtype=ctx.master_dtype,
                               chunk_bytes=QUICK_CHUNK_BYTES if quick else DEFAULT_CHUNK_BYTES)
        run = ctx.run
        scanned = scan_checkpoint(c.path, jobs=options.jobs, quick=quick, chunk_bytes=options.chunk_bytes)
        try:
            ctx.manifest = scanned.view.manifest
            # The run's evidence is read only where it can decide (a contract of 16-bit masters inferred).
            found = list(judge_with_run(scanned, options,
                                        (lambda: run.record_for(c)) if run is not None else (lambda: None)).findings)
            if quick:  # a quick audit reads no content: the manifest's hashes are verified as "hashes" does
                seen = {(f.code, f.subject) for f in found}
                found += [f for f in check_manifest(scanned.ckpt, scanned.view, hashes=True)
                          if (f.code, f.subject) not in seen]
        finally:
            scanned.close()
        return found
    from ckptaudit.checks.components import check_components
    from ckptaudit.checks.integrity import check_indexes
    from ckptaudit.checks.manifest import check_manifest
    from ckptaudit.formats import open_checkpoint
    from ckptaudit.layouts import interpret

    with open_checkpoint(c.path) as ckpt:
        findings = list(ckpt.findings)
        view = interpret(ckpt)
        ctx.manifest = view.manifest
        findings += check_indexes(ckpt, view)
        findings += check_components(view, ctx.components)[1]
        findings += check_manifest(ckpt, view, hashes=ctx.verify == "hashes")
    return findings


def _has_our_manifest(c: Candidate, ctx: StepContext) -> bool:
    if c.remote:  # read with the candidate (staged): a manifest the reading accepted
        return _has(c, layout.MANIFEST) and isinstance(ctx.manifest, dict)
    if not os.path.isdir(c.path):
        return False
    try:
        mf.read_manifest(os.path.join(c.path, layout.MANIFEST))
    except mf.ManifestError:
        return False
    return True
