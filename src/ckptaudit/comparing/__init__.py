"""``ckptaudit compare``: tensor-by-tensor forensics between a reference and a candidate checkpoint.

    report = compare("ckpt/faithful", "export/model.pt")   # any two layouts the audit reads
    report.summary   # "candidate = reference with 29 of 29 parameters rounded to bf16 (round-to-nearest-even); ..."

Pipeline (one process, streaming, memory bounded by a few chunks):

1. :mod:`.matching`: open and interpret each side (the audit's readers and layouts, nothing executed), and
   key every tensor and value by meaning (normalised FQN, parameter + state name, path under the
   component), aligning per-rank state;
2. :mod:`.pairs`: a status per key, reading both tensors of a pair once, together, in bounded chunks: the
   audit's content hash of each side (the cheap test: an equal first chunk, then equal digests, is
   ``identical``) and the element-wise classification (:mod:`.elementwise`) on the same chunks while they are
   in cache; a moment that differs is looked for among the reference's other moments of the same shape;
3. :mod:`.judge`: findings, the ten-second summary, tables and the JSON ``pairs``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from ckptaudit.catalogue import finding, finding_order, ignore_note, mark_ignored, parse_ignore
from ckptaudit.comparing.elementwise import ROUNDINGS, DiffStats, Pool
from ckptaudit.comparing.judge import component_findings, pair_findings, pair_json, sections, summary
from ckptaudit.comparing.matching import Entry, Side, align_ranks, entries_of, open_side
from ckptaudit.comparing.pairs import STATUSES, Pair, classify, find_moment_sources, hash_entry
from ckptaudit.findings import Finding, RawReport
from ckptaudit.formats.io.tensors import DEFAULT_CHUNK_BYTES

__all__ = ["ROUNDINGS", "STATUSES", "CompareOptions", "DiffStats", "Pair", "run_compare"]

Progress = Callable[[int, int], None]
"""Called with (bytes done, bytes to do) as the comparison proceeds."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CompareOptions:
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Bytes per chunk and side in the streaming passes (1 MiB keeps temporaries in cache)."""
    verbose: bool = False
    """List identical pairs in the human table too (the JSON ``pairs`` always has every pair)."""
    max_moment_checks: int = 256
    """Value comparisons per (state name, shape) when looking for the source of a mismatched moment."""
    threads: int = 2
    """Tensor pairs compared at once (xxhash and NumPy release the GIL, so pairs run in parallel on as many
    cores); 1 compares them one after the other."""
    ignore: tuple[str, ...] = ()
    """Finding codes or families acknowledged (:func:`ckptaudit.catalogue.parse_ignore`): kept, marked ignored."""

    def __post_init__(self) -> None:
        if self.chunk_bytes < 64:
            raise ValueError(f"chunk_bytes must be at least 64 bytes, got {self.chunk_bytes}")
        if not 1 <= self.threads <= 64:
            raise ValueError(f"threads must be between 1 and 64, got {self.threads}")
        object.__setattr__(self, "ignore", parse_ignore(self.ignore))


def run_compare(reference: str, candidate: str, options: CompareOptions | None = None, *,
            progress: Progress | None = None) -> RawReport:
    """Compare ``candidate`` against ``reference``. Raises ``FileNotFoundError`` when either does not exist."""
    options = options or CompareOptions()
    ref = open_side(reference)
    try:
        cand = open_side(candidate)
        try:
            return _compare(ref, cand, options, progress)
        finally:
            cand.close()
    finally:
        ref.close()


def _compare(ref: Side, cand: Side, options: CompareOptions, progress: Progress | None) -> RawReport:
    ref_entries = entries_of(ref)
    cand_entries = entries_of(cand)
    notes = align_ranks(ref_entries, cand_entries)
    keys = list(ref_entries) + [k for k in cand_entries if k not in ref_entries]
    total = sum(e.data.nbytes for e in (*ref_entries.values(), *cand_entries.values()) if e.data is not None)
    done = 0
    read_errors: list[Finding] = []
    _open_maps(ref, ref_entries.values())
    _open_maps(cand, cand_entries.values())
    local = threading.local()

    def work(k: tuple[str, ...]) -> Pair:
        pool = getattr(local, "pool", None)
        if pool is None:  # one pool of work arrays per thread, reused by all its pairs
            pool = local.pool = Pool()
        return _pair(k, ref_entries.get(k), cand_entries.get(k), ref, cand, options, pool)

    pairs: list[Pair] = []
    with ThreadPoolExecutor(max_workers=options.threads, thread_name_prefix="ckptaudit-compare") as ex:
        for p in ex.map(work, keys):  # results in key order (each a small record, no tensor data)
            pairs.append(p)
            read_errors += _read_errors(p)
            done += sum(e.data.nbytes for e in (p.ref, p.cand) if e is not None and e.data is not None)
            if progress is not None:
                progress(done, total)
    pool = Pool()
    find_moment_sources(pairs, list(ref_entries.values()), ref.ckpt.maps, cand.ckpt.maps, options.chunk_bytes,
                        max_value_checks=options.max_moment_checks, pool=pool)
    ref_kinds = set(ref.view.components)
    cand_kinds = set(cand.view.components)
    findings: list[Finding] = []
    findings += _side_findings(ref, "reference")
    findings += _side_findings(cand, "candidate")
    findings += _dedupe(read_errors)
    findings += component_findings(ref_kinds, cand_kinds, ref.view.components)
    wholly = {k.value for k in ref_kinds ^ cand_kinds}
    findings += pair_findings(pairs, skip_components=wholly)
    findings = mark_ignored(findings, options.ignore)
    findings.sort(key=finding_order)
    sides = [_side_info("reference", ref, ref_entries), _side_info("candidate", cand, cand_entries)]
    status_counts = {s: sum(p.status == s for p in pairs) for s in STATUSES}
    return RawReport(
        command="compare",
        path=cand.ckpt.path,
        format=cand.view.layout,
        findings=tuple(findings),
        summary=summary(pairs) + ignore_note(findings),
        extra={
            "reference": sides[0],
            "candidate": sides[1],
            "pair_counts": status_counts,
            "notes": notes,
            "pairs": [pair_json(p) for p in pairs],
            "sections": sections(pairs, sides, notes, verbose=options.verbose),
        },
    )


def _open_maps(side: Side, entries: Iterable[Entry]) -> None:
    # Map every data file before the worker threads start: FileMaps creates maps lazily and is not
    # thread-safe; reading through existing maps is.
    for e in entries:
        if e.data is not None:
            for piece in e.data.pieces:
                try:
                    side.ckpt.maps.get(piece.file)
                except (OSError, ValueError):
                    pass  # reported when the pair is read


def _pair(k: tuple[str, ...], re: Entry | None, ce: Entry | None, ref: Side, cand: Side, options: CompareOptions,
          pool: Pool) -> Pair:
    """(worker thread) The status of one pair; tensors read by no pair (only on one side, or shapes that
    differ) are hashed on their own."""
    p = classify(k, re, ce, ref.ckpt.maps, cand.ckpt.maps, options.chunk_bytes, pool)
    for e, side in ((re, ref), (ce, cand)):
        if e is not None and e.data is not None and not e.hashed and p.status != "unread":
            try:
                hash_entry(e, side.ckpt.maps, options.chunk_bytes)
            except (ValueError, OSError) as exc:
                p.status, p.note = "unread", f"cannot read: {exc}"
    return p


def _read_errors(p: Pair) -> list[Finding]:
    if p.status != "unread" or not p.note.startswith("cannot read"):
        return []
    why = p.note.removeprefix("cannot read: ")
    return [finding("integrity.corrupt", f"{label}: {e.name}", f"{label} {e.name}: cannot read its data ({why})",
                    side=label)
            for e, label in ((p.ref, "reference"), (p.cand, "candidate")) if e is not None and e.data is not None]


def _dedupe(found: list[Finding]) -> list[Finding]:
    seen: set[str] = set()
    out = []
    for f in found:
        if f.subject not in seen:
            seen.add(f.subject)
            out.append(f)
    return out


def _side_findings(s: Side, side: str) -> list[Finding]:
    # What reading each checkpoint found (corrupt files, unsafe pickles) stays visible, tagged by side.
    return [replace(f, subject=f"{side}: {f.subject}", evidence={**f.evidence, "side": side}) for f in s.ckpt.findings]


def _side_info(side: str, s: Side, entries: dict[tuple[str, ...], Entry]) -> dict[str, object]:
    tensors = sum(e.kind == "tensor" for e in entries.values())
    nbytes = sum(e.data.nbytes for e in entries.values() if e.data is not None)
    return {"side": side, "path": s.ckpt.path, "format": s.ckpt.format, "layout": s.view.layout,
            "tensors": tensors, "values": len(entries) - tensors, "tensor_bytes": nbytes}
