"""What ``latest`` finds under a root: the candidates (every way a run saves) and what it skipped, with why.

One survey for local roots and object-store prefixes: a lister gives the entries of a folder (name, kind, size,
time); the classifier decides by names alone, so a remote prefix is judged as its local copy would be:

- folders: ours ``step-N/`` (and the writer's temporaries), torchtitan ``step-N/``, DeepSpeed tag folders (a
  model-states file inside), Hugging Face ``checkpoint-N/``, Accelerate ``checkpoint_N/``, Megatron ``iter_N/``,
  other DCP folders, a folder of component files (``optimizer.pt`` beside the model...), and a guard's
  ``quarantined-<name>``;
- single files: ``*.pt``, ``*.pth``, ``*.bin``, ``*.ckpt``, ``*.safetensors``, with the step read from the name
  (``ckpt-0004.pt``, ``model_step=4.pt``, ``epoch=1-step=40.ckpt``) or, where the name has none, from the file
  (its ``step``/``global_step``/``iteration`` key, read by our readers: nothing is unpickled; behind a URL with
  the staging's bounded ranged reads); a guard's ``<name>.quarantined``;
- a checkpoint with the guard's quarantine marker beside it (``<name>.ckptaudit-quarantine.json``: an object-store
  checkpoint that failed, left in place) is a ``quarantined`` candidate, never validated;
- any other folder is searched, down to :data:`MAX_DEPTH` levels (a run root with one folder per stage).

Skipped, with the reason: the guard's reports, markers and pins, pointers (read by ``latest`` itself), links leaving the root, files that are no
checkpoint, folders deeper than :data:`MAX_DEPTH`, and whatever lies past :data:`MAX_ENTRIES`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ckptaudit.ondisk import layout, quarantine
from ckptaudit.ondisk.passport import PASSPORT_SUFFIX, SIGNATURE_SUFFIX, is_passport_name

__all__ = ["MAX_DEPTH", "MAX_ENTRIES", "SINGLE_FILE_EXTENSIONS", "Candidate", "Entry", "Skipped", "Survey",
           "classify_dir", "classify_file", "newest_first", "step_from_name", "survey"]

MAX_DEPTH = 3
"""Folders below the root searched for checkpoints: ``root/stage-2/run-b/ckpt-0004.pt`` is found, a deeper one is
skipped and said (a bound against a root that is a whole file system)."""
MAX_ENTRIES = 20_000
"""Entries listed in all at most; the rest is skipped and said."""
SINGLE_FILE_EXTENSIONS = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")
PINS_DIR = ".ckptaudit-pins"
"""The in-loop guard's folder of pins (``ckptaudit.integrations.pinning.PINS_DIR``): hard links of checkpoints
being audited, never a checkpoint of the run."""
_SINGLE_FILES = ("torch.save", "safetensors", "lightning")
POINTERS = (layout.POINTER, "latest_checkpointed_iteration.txt")

_HF = re.compile(r"^checkpoint-(\d+)$")
_ACCELERATE = re.compile(r"^checkpoint_(\d+)$")
_MEGATRON = re.compile(r"^iter_(\d+)$")
_TRAILING = re.compile(r"(\d+)$")
_NAMED_STEP = re.compile(r"(?:^|[^a-z])(?:global_step|step|steps|iteration|iter|it)[=_-]?(\d+)", re.IGNORECASE)
_MODEL_STATES = re.compile(r"^(?:zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt$")


@dataclass(frozen=True, slots=True)
class Candidate:
    path: str
    """A local path, or the URL of an object-store candidate."""
    name: str
    """Relative to the root (the root's own name when the root is a checkpoint)."""
    layout: str
    """``ckptaudit``, ``ckptaudit-temporary``, ``torchtitan``, ``dcp``, ``huggingface-trainer``,
    ``accelerate``, ``megatron``, ``lightning``, ``deepspeed``, ``torch.save`` (a single ``.pt``/``.pth``/``.bin``
    file), ``safetensors`` (a single file), ``directory`` (a folder of component files) or ``quarantined``
    (moved aside by the in-loop guard: never resumable)."""
    step: int | None
    mtime: float
    step_from: str = ""
    """Where the step was read: ``name``, or the file's key (``step``, ``global_step``...); ``""`` when unknown."""
    files: tuple[str, ...] | None = None
    """The names directly inside a folder candidate as the listing gave them (object stores; ``None`` locally,
    where they are read when needed)."""

    @property
    def run(self) -> str:
        """The folder of the run this candidate belongs to, relative to the root (``""``: the root)."""
        return os.path.dirname(self.name)

    @property
    def remote(self) -> bool:
        """Behind an object-store URL (read through the remote staging)."""
        from ckptaudit.formats.remote import is_url

        return is_url(self.path)


@dataclass(frozen=True, slots=True)
class Skipped:
    """An entry under the root that is no candidate, and why."""

    name: str
    reason: str


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry of a listing: ``kind`` is ``file``, ``dir`` or ``other``; ``outside``: a link leaving the root."""

    name: str
    kind: str
    mtime: float = 0.0
    outside: bool = False


@dataclass
class Survey:
    root: str
    candidates: list[Candidate] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    listed: int = 0
    marked: set[str] = field(default_factory=set)
    """Names (relative to the root) of checkpoints with the guard's quarantine marker beside them."""


Lister = Callable[[str], list[Entry]]
"""The entries of a folder given relative to the root (``""``: the root). Raises ``OSError`` when it cannot be
listed."""


def step_from_name(name: str) -> int | None:
    """The step a file or folder name carries: ``step=40``/``global_step40``/``iter_4`` anywhere (Lightning's
    ``epoch=1-step=40``), else the number ending the name without its extension (``ckpt-0004.pt``)."""
    stem = name
    for ext in (*SINGLE_FILE_EXTENSIONS, quarantine.QUARANTINE_SUFFIX):
        if stem.lower().endswith(ext):
            stem = stem[: -len(ext)]
    found = _NAMED_STEP.findall(stem)
    if found:
        return int(found[-1])
    m = _TRAILING.search(stem)
    return int(m.group(1)) if m else None


def _component_file(name: str) -> bool:
    """A file a folder checkpoint holds beside its model (``optimizer.pt``, ``training_args.bin``, an index...)."""
    from ckptaudit.layouts.huggingface import file_rule

    rule = file_rule(name)
    return rule is not None and rule not in ("ignore", "manifest", "model-config")


def classify_dir(base: str, children: list[str]) -> tuple[str, int | None] | None:
    """``(layout, step)`` of a folder named ``base`` holding ``children`` (names), or ``None``: no checkpoint."""
    original = quarantine.quarantined_original(base)
    if original is not None:
        return "quarantined", step_from_name(original)
    names = set(children)
    if any(_MODEL_STATES.match(n) for n in names):  # DeepSpeed's tag folders: global_stepN by default
        m = _TRAILING.search(base)
        return "deepspeed", int(m.group(1)) if m else None
    parsed = layout.parse_step_name(base)
    if parsed is not None:
        if parsed[1] != "committed":
            return "ckptaudit-temporary", parsed[0]
        return ("ckptaudit" if layout.MANIFEST in names else "torchtitan"), parsed[0]
    for regex, kind in ((_HF, "huggingface-trainer"), (_ACCELERATE, "accelerate"), (_MEGATRON, "megatron")):
        m = regex.match(base)
        if m:
            return kind, int(m.group(1))
    if ".metadata" in names or any(n.endswith(".distcp") for n in names):
        m = _TRAILING.search(base)
        return "dcp", int(m.group(1)) if m else None
    if "trainer_state.json" in names:
        return "huggingface-trainer", step_from_name(base)
    if any(_component_file(n) for n in names):
        return "directory", step_from_name(base)
    return None


def classify_file(name: str) -> tuple[str, int | None] | str:
    """``(layout, step)`` of a single file, or why it is skipped."""
    marked = quarantine.marked_original(name)
    if marked is not None:
        return f"the guard's quarantine marker of {marked}"
    original = quarantine.quarantined_original(name)
    if original is not None:
        return "quarantined", step_from_name(original)
    if name.endswith(quarantine.REPORT_SUFFIX):
        return f"the guard's report of {name[: -len(quarantine.REPORT_SUFFIX)]}"
    if is_passport_name(name):  # FILE.passport.json, FILE.passport.sig (ckptaudit.ondisk.passport)
        for suffix in (PASSPORT_SUFFIX, SIGNATURE_SUFFIX):
            if name.endswith(suffix):
                return f"the passport{' signature' if suffix == SIGNATURE_SUFFIX else ''} of {name[: -len(suffix)]}"
        return "a passport"
    if name in POINTERS:
        return "a pointer (read and compared with the newest resumable checkpoint at the root only)"
    lower = name.lower()
    if not lower.endswith(SINGLE_FILE_EXTENSIONS):
        return "not a checkpoint file (" + (os.path.splitext(name)[1] or "no extension") + ")"
    if _component_file(name):
        return "a component file (optimizer, scheduler, RNG, ...) with no folder checkpoint around it"
    kind = ("lightning" if lower.endswith(".ckpt") else "safetensors" if lower.endswith(".safetensors")
            else "torch.save")
    return kind, step_from_name(name)


def survey(root: str, lister: Lister, *, root_name: str, join: Callable[[str, str], str],
           is_file: bool = False, root_mtime: float = 0.0, root_marked: Callable[[], bool] | None = None) -> Survey:
    """The candidates and skipped entries under ``root`` (``join(root, relative name)`` makes a candidate's
    path). ``root_name``: the root's own base name, for a root that is itself one checkpoint; ``root_marked()``:
    whether the guard's quarantine marker lies beside the root (asked only when the root is itself one checkpoint,
    which is then a ``quarantined`` candidate, as it is when its parent is surveyed)."""
    out = Survey(root)
    if is_file:
        kind = classify_file(root_name)
        if isinstance(kind, tuple):
            marked = root_marked is not None and root_marked()
            out.candidates.append(Candidate(root, root_name, "quarantined" if marked else kind[0], kind[1],
                                            root_mtime, "name" if kind[1] is not None else ""))
        else:
            out.skipped.append(Skipped(root_name, kind))
        return out
    top = lister("")
    out.listed = len(top)
    own = classify_dir(root_name, [e.name for e in top])
    if own is not None and own[0] != "directory":
        if own[0] != "quarantined" and root_marked is not None and root_marked():
            # Marked by the guard (an object store's failing checkpoint, left in place): the root is the one
            # candidate, quarantined, whatever folder checkpoint it holds.
            out.candidates.append(_folder(root, root_name, ("quarantined", own[1]), root_mtime, join, "", top))
            return out
        # The root is one checkpoint folder (step-N/ given directly): its files are its parts; a folder checkpoint
        # inside it (the Trainer's checkpoint-N/global_stepN/ of DeepSpeed) is the candidate instead.
        for e in sorted(top, key=lambda e: e.name):
            if e.kind == "dir" and not e.outside and e.name != PINS_DIR:
                try:
                    children = lister(e.name)
                except OSError:
                    continue
                inner = classify_dir(e.name, [c.name for c in children])
                if inner is not None:
                    out.candidates.append(_folder(root, e.name, inner, e.mtime, join, e.name, children))
        if not out.candidates:
            out.candidates.append(_folder(root, root_name, own, root_mtime, join, "", top))
        return out
    _walk(out, lister, join, "", top, 0)
    out.skipped.sort(key=lambda s: s.name)
    # A checkpoint the guard marked (an object store's failing checkpoint, left in place) is quarantined.
    out.candidates = [replace(c, layout="quarantined") if c.name in out.marked else c for c in out.candidates]
    if own is not None:
        # The root holds component files (optimizer.pt, training_args.bin...): its own files are the parts of one
        # checkpoint, the root, which is the candidate unless sub-folders hold checkpoints (a Trainer's output
        # folder holds its final save_pretrained beside checkpoint-N/).
        out.candidates = [c for c in out.candidates if "/" in c.name or c.layout not in _SINGLE_FILES]
        out.skipped = [s for s in out.skipped if "/" in s.name or s.reason.startswith(("the guard", "a link"))]
        if not out.candidates:
            marked = root_marked is not None and root_marked()
            out.candidates.append(_folder(root, root_name, ("quarantined", own[1]) if marked else own, root_mtime,
                                          join, "", top))
    return out


def _folder(root: str, name: str, kind: tuple[str, int | None], mtime: float, join: Callable[[str, str], str],
            rel: str, children: list[Entry] | None) -> Candidate:
    files = tuple(e.name for e in children) if children is not None and _remote(join) else None
    return Candidate(join(root, rel) if rel else root, name, kind[0], kind[1], mtime,
                     "name" if kind[1] is not None else "", files)


def _remote(join: Callable[[str, str], str]) -> bool:
    return getattr(join, "remote", False) is True


def _walk(out: Survey, lister: Lister, join: Callable[[str, str], str], rel: str, entries: list[Entry],
          depth: int) -> None:
    # Newest-looking names first: when a bound stops the listing, what it did not reach are the oldest folders.
    for e in sorted(entries, key=lambda e: (-(step_from_name(e.name) or -1), e.name)):
        name = f"{rel}/{e.name}" if rel else e.name
        if e.outside:
            # A link leaving root is never judged: `latest` would vouch for another checkpoint.
            out.skipped.append(Skipped(name, "a link leading outside the root: never judged"))
            continue
        if e.kind == "file":
            if e.name in POINTERS and not rel:
                continue  # read and compared with the newest resumable checkpoint (the report's `pointer`)
            kind = classify_file(e.name)
            marked = quarantine.marked_original(e.name)
            if marked is not None:
                out.marked.add(f"{rel}/{marked}" if rel else marked)
            if isinstance(kind, str):
                out.skipped.append(Skipped(name, kind))
            else:
                out.candidates.append(Candidate(join(out.root, name), name, kind[0], kind[1], e.mtime,
                                                "name" if kind[1] is not None else ""))
            continue
        if e.kind != "dir":
            out.skipped.append(Skipped(name, "not a regular file or folder"))
            continue
        if e.name == PINS_DIR:
            out.skipped.append(Skipped(name, "the in-loop guard's pins (links to checkpoints being audited)"))
            continue
        if out.listed >= MAX_ENTRIES:
            out.skipped.append(Skipped(name, f"not listed: {MAX_ENTRIES} entries listed already"))
            continue
        try:
            children = lister(name)
        except OSError as exc:
            out.skipped.append(Skipped(name, f"cannot be listed ({exc.strerror or exc})"))
            continue
        out.listed += len(children)
        kind2 = classify_dir(e.name, [c.name for c in children])
        if kind2 is not None:
            out.candidates.append(_folder(out.root, name, kind2, e.mtime, join, name, children))
        elif e.name.startswith("."):
            out.skipped.append(Skipped(name, "a hidden folder holding no checkpoint"))
        elif depth + 1 > MAX_DEPTH:
            out.skipped.append(Skipped(name, f"deeper than {MAX_DEPTH} levels below the root: not searched"))
        elif not children:
            out.skipped.append(Skipped(name, "an empty folder with no checkpoint name"))
        else:
            found, skipped = len(out.candidates), len(out.skipped)
            _walk(out, lister, join, name, children, depth + 1)
            if len(out.candidates) == found:  # a folder of logs, configs...: one line, not one per file
                del out.skipped[skipped:]
                out.skipped.append(Skipped(name, f"no checkpoint inside ({len(children)} entr{'y' if len(children) == 1 else 'ies'})"))


def newest_first(found: list[Candidate]) -> list[Candidate]:
    """Newest first: the highest step; at the same step a committed folder before a temporary one; then the most
    recently modified. Candidates without a step sort by modification time, after those with one."""
    return sorted(found, key=lambda c: (c.step is not None, c.step or 0, c.layout != "ckptaudit-temporary",
                                        c.mtime), reverse=True)
