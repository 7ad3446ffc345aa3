"""``ckptaudit latest ROOT``: the newest checkpoint under ROOT that can be resumed, and why newer ones cannot.

Hugging Face's ``get_last_checkpoint`` and DeepSpeed's ``latest`` file pick a directory by name without
looking inside. Here every candidate, newest first, is validated until one passes:

- candidates (:mod:`ckptaudit.latest.candidates`): every way a run is saved: our ``step-N/`` (and the writer's
  temporaries), torchtitan ``step-N/``, Megatron ``iter_NNNNNNN/``, other DCP directories, Hugging Face
  ``checkpoint-N/``, Accelerate ``checkpoint_N/``, DeepSpeed tag folders (its ``latest`` tag file is read like our
  pointer), folders of component files, single files (``*.pt``, ``*.pth``, ``*.bin``, ``*.ckpt``,
  ``*.safetensors``; the step from the name or from the file), what the in-loop guard quarantined, in sub-folders
  down to a bounded depth; a local root, or an ``s3://``/``gs://`` prefix listed with bounded requests
  (:mod:`ckptaudit.latest.listing`). What was skipped is reported with the reason;
- validation (:func:`validate`, the steps of :mod:`ckptaudit.latest.steps`): the format's commit marker, every
  file the metadata references present with its recorded size, the manifest's hashes where there is one, the
  components the format's contract requires, and, by default (``verify="quick"``), a quick audit: every tensor's
  precision judged from its first chunk against the contract, and the optimizer state's attachment, so a
  checkpoint of bf16-rounded masters is never the one named. The contract takes the run's own evidence
  (:mod:`ckptaudit.latest.evidence`) where the file alone does not decide: a checkpoint cast to bf16 beside
  siblings with float32 masters is ``contract.run-mismatch``. ``verify="hashes"`` is integrity only,
  ``verify="sizes"`` also skips the manifest's hashes, ``verify="full"`` runs the whole audit.

A candidate is resumable when no finding is an error (findings acknowledged by ``ignore`` do not count). The
root's pointer, when there is one (ours and DeepSpeed's: ``latest``; Megatron-LM's
``latest_checkpointed_iteration.txt``), is compared with the newest resumable candidate, on a local root as behind a
URL (one bounded ranged read each).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from ckptaudit.catalogue import finding
from ckptaudit.findings import ComponentKind, Finding, Severity
from ckptaudit.formats.io.safeio import open_regular
from ckptaudit.latest.candidates import Candidate, Skipped, newest_first
from ckptaudit.latest.evidence import RunEvidence
from ckptaudit.latest.report import latest_report
from ckptaudit.latest.steps import CANDIDATE_STEPS, QUICK_CHUNK_BYTES, Checked, StepContext
from ckptaudit.ondisk import layout

__all__ = ["DEFAULT_VERIFY", "QUICK_CHUNK_BYTES", "VERIFY_LEVELS", "Candidate", "Checked", "LatestResult",
           "Skipped", "discover", "find_latest", "latest_report", "survey_root", "validate"]

VERIFY_LEVELS = ("sizes", "hashes", "quick", "full")
DEFAULT_VERIFY = "quick"
"""The level the library and the CLI validate at when not told: the one that judges precision (a test holds the two
equal)."""
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron-LM's pointer: the iteration (``2``) of ``iter_0000002/``, or ``release``."""


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
    skipped: list[Skipped] = field(default_factory=list)
    """Entries under the root that are no candidate, with the reason."""
    run_evidence: bool = True


def survey_root(root: str) -> tuple[list[Candidate], list[Skipped]]:
    """The candidates under ``root`` (a local path or an ``s3://``/``gs://`` URL), newest first, and what was
    skipped. Raises ``FileNotFoundError`` when nothing is at ``root``."""
    from ckptaudit.formats.remote import is_url, local_path
    from ckptaudit.latest.listing import local_survey, remote_survey

    if is_url(root):
        found = remote_survey(root)
    else:
        root = local_path(root)
        if not os.path.exists(root):
            raise FileNotFoundError(root)
        found = local_survey(os.path.abspath(root))
    found.candidates = [_step_from_file(c) for c in found.candidates]
    return newest_first(found.candidates), found.skipped


def discover(root: str) -> list[Candidate]:
    """The checkpoints under ``root`` (or ``root`` itself, if it is one), newest first.

    Newest means the highest step; at the same step a committed directory before a temporary one; then the
    most recently modified. Candidates without a step sort by modification time, after those with one.
    """
    return survey_root(root)[0]


def _step_from_file(c: Candidate) -> Candidate:
    """A single file whose name has no step: the step it holds (``step``, ``global_step``, ``iteration``...), read
    by our readers without executing anything."""
    if c.step is not None or c.layout not in ("lightning", "torch.save", "safetensors"):
        return c
    if c.remote:
        from ckptaudit.latest.listing import step_readable

        if not step_readable(c.path):  # bounded: metadata only, or a small file (listing.STEP_PROBE_BYTES)
            return c
    from ckptaudit.formats import open_checkpoint
    from ckptaudit.layouts import interpret

    try:
        with open_checkpoint(c.path) as ckpt:
            step = interpret(ckpt).step
    except (OSError, ValueError):
        return c
    if step is None:
        return c
    return Candidate(c.path, c.name, c.layout, step, c.mtime, "the file's step key", c.files)


def validate(c: Candidate, *, verify: str = DEFAULT_VERIFY, require: Collection[ComponentKind | str] = frozenset(),
             ignore: Collection[str] = (), master_dtype: str = "auto", run: RunEvidence | None = None,
             checked: list[Checked] | None = None) -> Checked:
    """Validate one candidate through :data:`~ckptaudit.latest.steps.CANDIDATE_STEPS` (see the module docstring);
    cost: headers and metadata, plus the manifest's hashes where a manifest exists (``verify`` ``hashes`` and up),
    plus the first chunk of every tensor (``quick``, the default) or every byte (``full``). ``ignore``: finding
    codes or families acknowledged (marked, kept, not counted); ``master_dtype``: the contract the audit of
    ``quick`` and ``full`` holds the parameters to (``auto``: the checkpoint's record, else the run's evidence
    ``run`` when given, else its tensors)."""
    from ckptaudit.catalogue import mark_ignored, parse_ignore

    if verify not in VERIFY_LEVELS:
        raise ValueError(f"verify must be one of {', '.join(VERIFY_LEVELS)}, not {verify!r}")
    ctx = StepContext(verify, frozenset(require), parse_ignore(ignore), master_dtype, run, checked or [])
    for step in CANDIDATE_STEPS:
        step(c, ctx)
        if ctx.stop:
            break
    findings = mark_ignored(ctx.findings, ctx.ignore)
    resumable = not any(f.severity is Severity.ERROR and not f.ignored for f in findings)
    return Checked(c, resumable, tuple(findings))


def find_latest(root: str, *, verify: str = DEFAULT_VERIFY, require: Collection[ComponentKind | str] = frozenset(),
                check_all: bool = False, progress: Callable[[str], None] | None = None,
                ignore: Collection[str] = (), master_dtype: str = "auto", run_evidence: bool = True) -> LatestResult:
    """Validate the candidates under ``root`` (a local path or an ``s3://``/``gs://`` URL) newest first; stop at
    the first resumable one (or go on through all of them with ``check_all``); ``progress`` hears the name of each
    candidate before it is validated. ``run_evidence``: hold each candidate to the contract its run's other
    checkpoints establish where its own records do not decide (:mod:`ckptaudit.latest.evidence`).
    Raises ``FileNotFoundError`` when ``root`` does not exist, ``ValueError`` for a bad ``verify`` or ``ignore``."""
    from ckptaudit.catalogue import parse_ignore
    from ckptaudit.formats.remote import is_url, local_path

    if verify not in VERIFY_LEVELS:
        raise ValueError(f"verify must be one of {', '.join(VERIFY_LEVELS)}, not {verify!r}")
    ignore = parse_ignore(ignore)
    remote = is_url(root)
    if not remote:
        root = os.path.abspath(local_path(root))
    candidates, skipped = survey_root(root)
    pointer, pointer_file, raw = _read_pointers(root, remote)
    result = LatestResult(root.rstrip("/") if remote else root, None, [], pointer=pointer, skipped=skipped,
                          run_evidence=run_evidence)
    run = RunEvidence(candidates) if run_evidence else None
    for i, c in enumerate(candidates):
        if progress is not None:
            progress(f"checking {c.name} ({i + 1} of {len(candidates)}, --verify {verify})")
        checked = validate(c, verify=verify, require=require, ignore=ignore, master_dtype=master_dtype, run=run,
                           checked=result.checked)
        result.checked.append(checked)
        if checked.resumable and result.latest is None:
            result.latest = c
            if not check_all:
                result.unchecked = candidates[i + 1:]
                break
    if result.pointer is not None and result.latest is not None and result.pointer != result.latest.name:
        state = {ch.candidate.name: ch for ch in result.checked}.get(result.pointer)
        exists = (any(c.name == result.pointer for c in candidates) or
                  any(s.name == result.pointer for s in skipped)) if remote else \
            os.path.exists(os.path.join(root, result.pointer))
        why = ("does not exist" if not exists else
               "is not resumable" if state is not None and not state.resumable else
               "is older than the newest resumable checkpoint")
        owner, fix = _pointer_owner(raw, pointer_file, result.latest)
        result.findings.append(finding("store.pointer-stale", pointer_file,
                                       f"{owner} names {result.pointer}, which {why}; the newest resumable "
                                       f"checkpoint is {result.latest.name}. {fix}",
                                       pointer=result.pointer, latest=result.latest.name))
    return result


def _read_pointers(root: str, remote: bool) -> tuple[str | None, str, str]:
    """The root's pointer: what it names, which file (ours / DeepSpeed's ``latest``, else Megatron's tracker) and
    the text it holds; read locally as a regular file, behind a URL with one bounded ranged read each."""
    if remote:
        from ckptaudit.latest.listing import read_head

        for name in (layout.POINTER, MEGATRON_TRACKER):
            data = read_head(f"{root.rstrip('/')}/{name}", 256)
            if data is None:
                continue
            text = data.decode("utf-8", "replace").strip()
            named = (_megatron_folder(text) if name == MEGATRON_TRACKER else
                     text if text and "/" not in text and text not in (".", "..") else None)
            if named is not None:
                return named, name, text
        return None, "", ""
    if not os.path.isdir(root):
        return None, "", ""
    pointer = layout.read_pointer(root)
    if pointer is not None:
        return pointer, layout.POINTER, pointer
    try:
        with open_regular(os.path.join(root, MEGATRON_TRACKER)) as fh:  # a FIFO must not hang `latest`
            text = fh.read(64).decode("utf-8", "replace").strip()
    except OSError:
        return None, "", ""
    named = _megatron_folder(text)
    return (named, MEGATRON_TRACKER, text) if named is not None else (None, "", "")


def _pointer_owner(raw: str, pointer_file: str, latest: Candidate) -> tuple[str, str]:
    """Whose pointer ``pointer_file`` is, in words (with what it holds, ``raw``, where that differs from the folder
    name), and how to point it at ``latest``: DeepSpeed's tag file, Megatron's tracker, or ckptaudit's own."""
    if pointer_file == MEGATRON_TRACKER:
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


def _megatron_folder(text: str) -> str | None:
    """The folder Megatron-LM's ``latest_checkpointed_iteration.txt`` holding ``text`` names (``iter_0000002`` for
    ``2``, ``release`` for ``release``), or ``None`` (neither)."""
    if text == "release":
        return text
    return f"iter_{int(text):07d}" if text.isdigit() and len(text) <= 12 else None
