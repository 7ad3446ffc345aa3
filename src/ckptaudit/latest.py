"""``ckptaudit latest ROOT``: the newest checkpoint under ROOT that can be resumed, and why newer ones cannot.

Hugging Face's ``get_last_checkpoint`` and DeepSpeed's ``latest`` file pick a directory by name without
looking inside. Here every candidate, newest first, is validated until one passes:

- candidates: our ``step-N/`` (and the writer's temporaries, ``step-N.partial-*``), torchtitan ``step-N/``,
  Megatron ``iter_NNNNNNN/``, other DCP directories, Hugging Face ``checkpoint-N/``, Accelerate
  ``checkpoint_N/``, Lightning ``*.ckpt``, DeepSpeed tag folders (``global_stepN/``; its ``latest`` tag file is
  read like our pointer, and a tag naming a damaged folder is reported as a stale pointer);
- validation (see :func:`validate`): the format's commit marker (our manifest and name, DCP ``.metadata``,
  Trainer's ``trainer_state.json``, written last), every file the metadata references present with its recorded
  size, the manifest's hashes where there is one, the components the format's contract requires (model and
  optimizer, plus ``require``, plus what the manifest lists), and, by default (``verify="quick"``), a quick audit
  (:attr:`ckptaudit.auditing.judge.AuditOptions.quick`): every tensor's precision judged from its first chunk, against the
  contract, and the optimizer state's attachment, so a checkpoint of bf16-rounded masters is never the one named.
  ``verify="hashes"`` is integrity only (no precision is judged), ``verify="sizes"`` also skips the manifest's
  hashes, ``verify="full"`` runs the whole :func:`ckptaudit.auditing.judge.run_audit`.

A candidate is resumable when no finding is an error (findings acknowledged by ``ignore`` do not count). The root's pointer, when there is one (ours: ``latest``;
Megatron-LM's ``latest_checkpointed_iteration.txt``), is compared with the newest resumable candidate.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from ckptaudit.catalogue import finding
from ckptaudit.findings import ComponentKind, Finding, RawReport, Severity
from ckptaudit.formats.io.safeio import open_regular
from ckptaudit.ondisk import layout, quarantine
from ckptaudit.ondisk import manifest as mf

__all__ = ["Candidate", "Checked", "LatestResult", "discover", "find_latest", "latest_report", "validate"]

VERIFY_LEVELS = ("sizes", "hashes", "quick", "full")
DEFAULT_VERIFY = "quick"
QUICK_CHUNK_BYTES = 64 << 10
"""What ``verify="quick"`` reads of each tensor: its first 64 KiB (16,384 fp32 values), far more than a genuine fp32
tensor needs to show one value off the bf16 grid, and a small share of a large checkpoint's bytes."""

_HF = re.compile(r"^checkpoint-(\d+)$")
_ACCELERATE = re.compile(r"^checkpoint_(\d+)$")
_LIGHTNING_STEP = re.compile(r"step=(\d+)")
_TRAILING = re.compile(r"(\d+)$")
_MEGATRON = re.compile(r"^iter_(\d+)$")
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron-LM's pointer: the iteration (``2``) of ``iter_0000002/``, or ``release``."""


@dataclass(frozen=True, slots=True)
class Candidate:
    path: str
    name: str
    """Relative to the root (the root's own name when the root is a checkpoint)."""
    layout: str
    """``ckptaudit``, ``ckptaudit-temporary``, ``torchtitan``, ``dcp``, ``huggingface-trainer``,
    ``accelerate``, ``megatron``, ``lightning``, ``deepspeed`` or ``quarantined`` (moved aside by the in-loop
    guard: never resumable)."""
    step: int | None
    mtime: float


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
class LatestResult:
    root: str
    latest: Candidate | None
    checked: list[Checked]
    """Validated candidates, newest first, ending at the latest resumable one."""
    unchecked: list[Candidate] = field(default_factory=list)
    """Older candidates not validated (the newest resumable one was found first)."""
    pointer: str | None = None
    findings: list[Finding] = field(default_factory=list)
    """About the root itself (a stale ``latest`` pointer)."""


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0


def _classify(path: str, name: str) -> Candidate | None:
    from ckptaudit.formats.dcp.reader import is_dcp_dir
    from ckptaudit.formats.deepspeed.reader import is_deepspeed_step_dir

    original = quarantine.quarantined_original(os.path.basename(os.path.normpath(path)))
    if original is not None and os.path.exists(path):
        m = _LIGHTNING_STEP.search(original) or _TRAILING.search(original.removesuffix(".ckpt"))
        return Candidate(path, name, "quarantined", int(m.group(1)) if m else None, _mtime(path))
    if os.path.isfile(path):
        if not name.endswith(".ckpt"):
            return None
        m = _LIGHTNING_STEP.search(name)
        return Candidate(path, name, "lightning", int(m.group(1)) if m else None, _mtime(path))
    if not os.path.isdir(path):
        return None
    base = os.path.basename(os.path.normpath(path))
    if is_deepspeed_step_dir(path):  # DeepSpeed's tag folders: global_stepN by default
        m = _TRAILING.search(base)
        return Candidate(path, name, "deepspeed", int(m.group(1)) if m else None, _mtime(path))
    parsed = layout.parse_step_name(base)
    if parsed is not None:
        if parsed[1] != "committed":
            return Candidate(path, name, "ckptaudit-temporary", parsed[0], _mtime(path))
        ours = os.path.isfile(os.path.join(path, layout.MANIFEST))
        return Candidate(path, name, "ckptaudit" if ours else "torchtitan", parsed[0], _mtime(path))
    for regex, kind in ((_HF, "huggingface-trainer"), (_ACCELERATE, "accelerate"), (_MEGATRON, "megatron")):
        m = regex.match(base)
        if m:
            return Candidate(path, name, kind, int(m.group(1)), _mtime(path))
    if is_dcp_dir(path):
        m = _TRAILING.search(base)
        return Candidate(path, name, "dcp", int(m.group(1)) if m else None, _mtime(path))
    if os.path.isfile(os.path.join(path, "trainer_state.json")):
        return Candidate(path, name, "huggingface-trainer", None, _mtime(path))
    return None


def _lightning_step(path: str) -> int | None:
    """``global_step`` inside a Lightning file (for ``last.ckpt``), read without executing anything."""
    from ckptaudit.formats import open_checkpoint
    from ckptaudit.layouts import interpret

    try:
        with open_checkpoint(path) as ckpt:
            return interpret(ckpt).step
    except OSError:
        return None


def _links_outside(root: str, name: str) -> bool:
    full = os.path.join(root, name)
    if not os.path.islink(full):
        return False
    real_root = os.path.realpath(root)
    return os.path.commonpath([real_root, os.path.realpath(full)]) != real_root


def discover(root: str) -> list[Candidate]:
    """The checkpoints under ``root`` (or ``root`` itself, if it is one), newest first.

    Newest means the highest step; at the same step a committed directory before a temporary one; then the
    most recently modified. Candidates without a step sort by modification time, after those with one.
    """
    root = os.path.abspath(root)
    own = _classify(root, os.path.basename(root))
    if os.path.isfile(root):
        return [own] if own is not None else []
    # A candidate that is a link leaving root is never judged: `latest` would vouch for another checkpoint.
    names = [n for n in sorted(os.listdir(root)) if not _links_outside(root, n)]
    children = [c for c in (_classify(os.path.join(root, n), n) for n in names) if c is not None]
    if own is not None and not children:
        return [own]
    found = [Candidate(c.path, c.name, c.layout, _lightning_step(c.path), c.mtime)
             if c.layout == "lightning" and c.step is None else c for c in children]
    found.sort(key=lambda c: (c.step is not None, c.step or 0, c.layout != "ckptaudit-temporary", c.mtime),
               reverse=True)
    return found


def validate(c: Candidate, *, verify: str = DEFAULT_VERIFY, require: Collection[ComponentKind] = frozenset(),
             ignore: Collection[str] = (), master_dtype: str = "auto") -> Checked:
    """Validate one candidate (see the module docstring); cost: headers and metadata, plus the manifest's
    hashes (one streaming read of the files) where a manifest exists (``verify`` ``hashes`` and up), plus the
    first chunk of every tensor (``quick``, the default) or every byte (``full``). ``ignore``: finding codes or
    families acknowledged (marked, kept, not counted); ``master_dtype``: the contract the audit of ``quick`` and
    ``full`` holds the parameters to (``auto``: the checkpoint's record, else its tensors)."""
    from ckptaudit.catalogue import mark_ignored, parse_ignore
    from ckptaudit.checks.manifest import uncommitted

    if verify not in VERIFY_LEVELS:
        raise ValueError(f"verify must be one of {', '.join(VERIFY_LEVELS)}, not {verify!r}")
    from ckptaudit.passport.requirement import split_require  # `--require passport` (docs/passport.md)

    require, passport = split_require(require)
    findings: list[Finding] = []
    if c.layout == "ckptaudit-temporary":
        temp = uncommitted(c.path)
        assert temp is not None
        return Checked(c, False, (temp,))
    if c.layout == "quarantined":
        report = os.path.normpath(c.path) + quarantine.REPORT_SUFFIX
        return Checked(c, False, (finding(
            "guard.quarantined", c.name,
            f"{c.name}: failed its audit during training and was moved aside by the guard"
            + (f" (report: {os.path.basename(report)})" if os.path.isfile(report) else ""),
            original=quarantine.quarantined_original(os.path.basename(os.path.normpath(c.path)))),))
    if os.path.isdir(c.path) and not os.listdir(c.path):
        return Checked(c, False, (finding("integrity.incomplete", c.name,
                                          f"{c.name} is empty: the save died before writing anything"),))
    ignore = parse_ignore(ignore)
    try:
        findings = _read_and_check(c, verify, require, ignore, master_dtype)
    except OSError as exc:
        findings = [finding("integrity.corrupt", c.name, f"{c.name}: cannot be read ({exc.strerror or exc})")]
    ours = _has_our_manifest(c.path)
    if c.layout == "ckptaudit" and not ours:
        findings.append(finding("integrity.corrupt", layout.MANIFEST,
                                f"{c.name}/{layout.MANIFEST} is not a readable ckptaudit manifest"))
    if c.layout == "huggingface-trainer" and not os.path.isfile(os.path.join(c.path, "trainer_state.json")):
        findings.append(finding(
            "integrity.incomplete", "trainer_state.json",
            f"{c.name} has no trainer_state.json; Trainer writes it last, so the save did not finish"))
    if c.layout == "megatron" and not os.path.isfile(os.path.join(c.path, "metadata.json")):
        findings.append(finding(
            "integrity.incomplete", "metadata.json",
            f"{c.name} has no metadata.json; Megatron-Core's dist_checkpointing.save writes it last, so the save "
            "did not finish"))
    if not ours:
        marker = {"lightning": "the file's own structure", "huggingface-trainer": "trainer_state.json",
                  "deepspeed": "the model states and every rank's optimizer shard"}.get(c.layout, ".metadata")
        findings.append(finding("store.unverified", c.name,
                                f"{c.name}: no ckptaudit manifest; completeness judged from {marker} and the "
                                "recorded sizes, content not verified"))
    findings += passport.findings(c.path, c.name) if passport is not None else ()
    findings = mark_ignored(findings, ignore)
    resumable = not any(f.severity is Severity.ERROR and not f.ignored for f in findings)
    return Checked(c, resumable, tuple(findings))


def _read_and_check(c: Candidate, verify: str, require: Collection[ComponentKind],
                    ignore: tuple[str, ...], master_dtype: str) -> list[Finding]:
    if verify in ("quick", "full"):
        from ckptaudit.auditing.judge import AuditOptions, judge_scan
        from ckptaudit.auditing.scan import default_jobs, scan_checkpoint
        from ckptaudit.checks.manifest import check_manifest
        from ckptaudit.formats.io.tensors import DEFAULT_CHUNK_BYTES

        quick = verify == "quick"
        options = AuditOptions(require=frozenset(require), jobs=default_jobs(), quick=quick, ignore=ignore,
                               master_dtype=master_dtype,
                               chunk_bytes=QUICK_CHUNK_BYTES if quick else DEFAULT_CHUNK_BYTES)
        scanned = scan_checkpoint(c.path, jobs=options.jobs, quick=quick, chunk_bytes=options.chunk_bytes)
        try:
            found = list(judge_scan(scanned, options).findings)
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
        findings += check_indexes(ckpt, view)
        findings += check_components(view, require)[1]
        findings += check_manifest(ckpt, view, hashes=verify == "hashes")
    return findings


def _has_our_manifest(path: str) -> bool:
    try:
        mf.read_manifest(os.path.join(path, layout.MANIFEST))
    except mf.ManifestError:
        return False
    return True


def find_latest(root: str, *, verify: str = DEFAULT_VERIFY, require: Collection[ComponentKind] = frozenset(),
                check_all: bool = False, progress: Callable[[str], None] | None = None,
                ignore: Collection[str] = (), master_dtype: str = "auto") -> LatestResult:
    """Validate the candidates under ``root`` newest first; stop at the first resumable one (or go on through
    all of them with ``check_all``); ``progress`` hears the name of each candidate before it is validated.
    Raises ``FileNotFoundError`` when ``root`` does not exist, ``ValueError`` for a bad ``verify`` or ``ignore``."""
    from ckptaudit.catalogue import parse_ignore

    if verify not in VERIFY_LEVELS:
        raise ValueError(f"verify must be one of {', '.join(VERIFY_LEVELS)}, not {verify!r}")
    ignore = parse_ignore(ignore)
    if not os.path.exists(root):
        raise FileNotFoundError(root)
    root = os.path.abspath(root)
    candidates = discover(root)
    pointer, pointer_file = (layout.read_pointer(root), layout.POINTER) if os.path.isdir(root) else (None, "")
    if pointer is None and os.path.isdir(root):
        pointer, pointer_file = _megatron_pointer(root), MEGATRON_TRACKER
    result = LatestResult(root, None, [], pointer=pointer)
    for i, c in enumerate(candidates):
        if progress is not None:
            progress(f"checking {c.name} ({i + 1} of {len(candidates)}, --verify {verify})")
        checked = validate(c, verify=verify, require=require, ignore=ignore, master_dtype=master_dtype)
        result.checked.append(checked)
        if checked.resumable and result.latest is None:
            result.latest = c
            if not check_all:
                result.unchecked = candidates[i + 1:]
                break
    if result.pointer is not None and result.latest is not None and result.pointer != result.latest.name:
        state = {ch.candidate.name: ch for ch in result.checked}.get(result.pointer)
        why = ("does not exist" if not os.path.exists(os.path.join(root, result.pointer)) else
               "is not resumable" if state is not None and not state.resumable else
               "is older than the newest resumable checkpoint")
        owner, fix = _pointer_owner(root, pointer_file, result.latest)
        result.findings.append(finding("store.pointer-stale", pointer_file,
                                       f"{owner} names {result.pointer}, which {why}; the newest resumable "
                                       f"checkpoint is {result.latest.name}. {fix}",
                                       pointer=result.pointer, latest=result.latest.name))
    return result


def _pointer_owner(root: str, pointer_file: str, latest: Candidate) -> tuple[str, str]:
    """Whose pointer ``pointer_file`` is, in words (with what it holds where that differs from the folder
    name), and how to point it at ``latest``: DeepSpeed's tag file, Megatron's tracker, or ckptaudit's own."""
    if pointer_file == MEGATRON_TRACKER:
        try:
            with open_regular(os.path.join(root, pointer_file)) as fh:
                raw = fh.read(64).decode("utf-8", "replace").strip()
        except OSError:
            raw = "?"
        step = latest.step if latest.step is not None else latest.name
        return (f"Megatron's {pointer_file} (it holds {raw!r}; Megatron's load_checkpoint resumes from the folder "
                "it names)", f"Write '{step}' into {pointer_file} to resume from {latest.name}.")
    if latest.layout == "deepspeed":
        return (f"DeepSpeed's tag file {pointer_file} (engine.load_checkpoint resumes from the tag it names)",
                f"Write {latest.name!r} into {pointer_file}, or pass tag={latest.name!r} to load_checkpoint.")
    if latest.layout.startswith("ckptaudit"):
        return (f"ckptaudit's {pointer_file} pointer (ckptaudit.store's save_checkpoint advances it)",
                "Resume from the path `ckptaudit latest` prints; the next committed save moves the pointer.")
    return f"the {pointer_file} file", f"Resume from {latest.name}, the path `ckptaudit latest` prints."


def _megatron_pointer(root: str) -> str | None:
    """The folder Megatron-LM's ``latest_checkpointed_iteration.txt`` names (``iter_0000002`` for ``2``,
    ``release`` for ``release``), or ``None`` (absent, unreadable, or neither)."""
    try:
        with open_regular(os.path.join(root, MEGATRON_TRACKER)) as fh:  # a FIFO must not hang `latest`
            text = fh.read(64).decode("utf-8", "replace").strip()
    except OSError:
        return None
    if text == "release":
        return text
    return f"iter_{int(text):07d}" if text.isdigit() and len(text) <= 12 else None


def _candidate_json(ch: Checked | None, c: Candidate) -> dict[str, Any]:
    return {"path": c.path, "name": c.name, "layout": c.layout, "step": c.step,
            "resumable": ch.resumable if ch is not None else None, "checked": ch is not None,
            "findings": [{"code": f.code, "severity": f.severity.label, "subject": f.subject, "message": f.message,
                          **({"ignored": True} if f.ignored else {})}
                         for f in (ch.findings if ch is not None else ())]}


def latest_report(root: str, *, verify: str = DEFAULT_VERIFY, require: Collection[ComponentKind] = frozenset(),
                  check_all: bool = False, progress: Callable[[str], None] | None = None,
                  ignore: Collection[str] = (), master_dtype: str = "auto") -> RawReport:
    """The :class:`~ckptaudit.findings.RawReport` of ``ckptaudit latest``: ``extra["latest"]`` (path or ``None``)
    and ``extra["candidates"]``; the findings are the errors of the rejected candidates newer than the latest
    resumable one (subjects prefixed by the candidate), and a stale pointer."""
    result = find_latest(root, verify=verify, require=require, check_all=check_all, progress=progress,
                         ignore=ignore, master_dtype=master_dtype)
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
    sections = [{"title": "candidates, newest first", "columns": ["candidate", "step", "layout", "resumable",
                                                                  "why not / notes"], "rows": rows}]
    return RawReport(
        command="latest",
        path=result.root,
        format="checkpoint-root",
        findings=tuple(findings),
        summary=summary,
        extra={"latest": result.latest.path if result.latest else None,
               "latest_step": result.latest.step if result.latest else None,
               "pointer": result.pointer, "verify": verify, "candidates": candidates, "sections": sections},
    )


def _prefixed(name: str, subject: str) -> str:
    return subject if subject == name or subject.startswith(name + "/") else f"{name}/{subject}"


def _step(c: Candidate) -> str:
    return "?" if c.step is None else str(c.step)


def _notes(ch: Checked) -> str:
    codes = sorted({f.code for f in ch.findings if f.severity is not Severity.ERROR and not f.ignored})
    return ", ".join(codes) if codes else "manifest verified" if ch.candidate.layout == "ckptaudit" else ""
