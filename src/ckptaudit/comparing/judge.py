"""From classified pairs to what a person and a machine read: findings, the summary line, tables, JSON.

Pure functions over :class:`~ckptaudit.comparing.pairs.Pair` lists; nothing here reads a checkpoint.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from ckptaudit.catalogue import finding
from ckptaudit.comparing.matching import Entry, key_text
from ckptaudit.comparing.pairs import Pair, is_moment
from ckptaudit.findings import ComponentKind, Finding, Severity, printable

__all__ = ["component_findings", "group_of", "pair_findings", "pair_json", "sections", "summary"]

GROUPS = ("parameters", "buffers", "model values", "optimizer moments", "optimizer steps/hyperparameters",
          "scheduler", "RNG", "data progress", "other entries")
_NOUN = {"parameters": "parameters", "buffers": "buffers", "optimizer moments": "optimizer moments"}
_FAMILIES = (GROUPS[:3], GROUPS[3:5], GROUPS[5:])
_CORE = (ComponentKind.MODEL.value, ComponentKind.OPTIMIZER.value)
MAX_TABLE_ROWS = 60
_SHOWN = 5


def group_of(e: Entry) -> str:
    """The summary group an entry is counted in."""
    if e.component == ComponentKind.MODEL.value:
        if e.kind == "tensor":
            return "buffers" if e.role == "buffer" else "parameters"
        return "model values"
    if e.component == ComponentKind.OPTIMIZER.value:
        return "optimizer moments" if is_moment(e) else "optimizer steps/hyperparameters"
    return {ComponentKind.SCHEDULER.value: "scheduler", ComponentKind.RNG.value: "RNG",
            ComponentKind.DATA_PROGRESS.value: "data progress"}.get(e.component, "other entries")


# --- the summary line -----------------------------------------------------------------------------------


def summary(pairs: Sequence[Pair]) -> str:
    """One line a person reads in ten seconds, e.g. ``candidate = reference with 14 of 16 parameters rounded
    to bf16 (round-to-nearest-even); optimizer moments identical; scheduler and RNG identical``."""
    if not pairs:
        return "nothing to compare: neither checkpoint holds tensors or values ckptaudit reads"
    counts = Counter(p.status for p in pairs)
    n_t = sum(p.entry.kind == "tensor" for p in pairs)
    n_v = len(pairs) - n_t
    if counts["identical"] == len(pairs):
        return f"candidate = reference: all {n_t} tensors and {n_v} values identical (bitwise)"
    by_group: dict[str, list[Pair]] = defaultdict(list)
    for p in pairs:
        by_group[group_of(p.entry)].append(p)
    clauses: list[str] = []
    for family in _FAMILIES:
        same: list[str] = []
        for g in family:
            if g not in by_group:
                continue
            text = _phrase(g, by_group[g])
            if text == f"{g} identical":
                same.append(g)
            else:
                if same:
                    clauses.append(_join(same) + " identical")
                    same = []
                clauses.append(text)
        if same:
            clauses.append(_join(same) + " identical")
    faithful = all(p.status in ("identical", "equal-values", "bf16-rounded", "fp16-rounded") for p in pairs)
    head = "candidate = reference with " if faithful else "candidate differs from reference: "
    return head + "; ".join(clauses)


def _join(names: list[str]) -> str:
    # "optimizer moments" + "optimizer steps/hyperparameters" -> "optimizer moments and steps/hyperparameters"
    first = names[0].split(" ")[0]
    names = [names[0]] + [n[len(first) + 1:] if n.startswith(first + " ") else n for n in names[1:]]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _phrase(group: str, pairs: list[Pair]) -> str:
    n = len(pairs)
    noun = _NOUN.get(group, f"{group} entries")
    c = Counter(p.status for p in pairs)
    if c["identical"] == n:
        return f"{group} identical"
    if c["missing"] == n:
        return f"{group} missing in the candidate"
    if c["extra"] == n:
        return f"{group} only in the candidate"
    if c["identical"] + c["equal-values"] == n:
        return f"{group} equal in value ({c['equal-values']} of {n} stored in another dtype)"
    bits: list[str] = []
    for fmt in ("bf16", "fp16"):
        modes = Counter(p.rounding for p in pairs if p.status == f"{fmt}-rounded")
        for mode, k in modes.most_common():
            bits.append(f"{k} of {n} {noun} rounded to {fmt} ({mode})")
    moved = [p for p in pairs if p.source is not None]
    if moved:
        swaps = sorted({" <-> ".join(sorted((str(p.entry.param), str(p.source[0].param)))) for p in moved
                        if p.source is not None})
        bits.append(f"{len(moved)} of {n} {noun} belong to other parameters ({', '.join(swaps[:3])}"
                    f"{', ...' if len(swaps) > 3 else ''})")
    missing = [p for p in pairs if p.status == "missing"]
    gone_ranks = _wholly_missing_ranks(pairs)
    if gone_ranks:
        bits.append(f"{group} of {_join(gone_ranks)} missing in the candidate")
        missing = [p for p in missing if len(p.key) < 2 or p.key[1] not in gone_ranks]
    if missing:
        bits.append(f"{len(missing)} of {n} {noun} missing in the candidate")
    simple = (("different", "different"), ("shape-mismatch", "with another shape"), ("unread", "unreadable"))
    for status, words in simple:
        k = c[status] - (len(moved) if status == "different" else 0)
        if k:
            bits.append(f"{k} of {n} {noun} {words}")
    if c["extra"]:
        bits.append(f"{c['extra']} {noun} only in the candidate")
    if c["equal-values"] and not bits:
        bits.append(f"{c['equal-values']} {noun} stored in another dtype")
    return ", ".join(bits)


def _wholly_missing_ranks(pairs: list[Pair]) -> list[str]:
    """Ranks (``rank1``) all of whose entries in this group are missing in the candidate."""
    by_rank: dict[str, set[str]] = defaultdict(set)
    for p in pairs:
        if len(p.key) > 1 and p.key[1].startswith(("rank", "dp_rank")) and p.ref is not None:
            by_rank[p.key[1]].add(p.status)
    return sorted(r for r, statuses in by_rank.items() if statuses == {"missing"})


# --- findings ------------------------------------------------------------------------------------------


def component_findings(ref_components: Iterable[ComponentKind], cand_components: Iterable[ComponentKind],
                       ref_where: dict[ComponentKind, list[str]]) -> list[Finding]:
    """``compare.component-missing`` / ``compare.component-extra``."""
    ref_set, cand_set = set(ref_components), set(cand_components)
    out: list[Finding] = []
    for kind in ComponentKind:
        if kind in ref_set and kind not in cand_set:
            sev = Severity.ERROR if kind.value in _CORE else Severity.WARNING
            out.append(finding(
                "compare.component-missing", kind.value,
                f"the reference has {kind.value} state ({', '.join(ref_where.get(kind, [])) or 'found'}), the "
                f"candidate has none: it is not the same training state; save the {kind.value} state too",
                severity=sev, component=kind.value))
        elif kind in cand_set and kind not in ref_set:
            out.append(finding(
                "compare.component-extra", kind.value,
                f"the candidate has {kind.value} state the reference lacks; it was not compared",
                component=kind.value))
    return out


def pair_findings(pairs: Sequence[Pair], *, skip_components: set[str]) -> list[Finding]:
    """Per-pair findings: rounding, silent casts, shapes, misattached moments; missing / extra / different
    entries grouped per component (``skip_components``: wholly missing or extra, already reported)."""
    out: list[Finding] = []
    for p in pairs:
        re, ce = p.ref, p.cand
        if re is None or ce is None:
            continue
        if p.status in ("bf16-rounded", "fp16-rounded"):
            out.append(_rounded(p, re, ce))
        if p.status == "shape-mismatch":
            out.append(finding(
                "compare.shape-mismatch", ce.name,
                f"{ce.name}: shape {list(ce.shape)} in the candidate, {list(re.shape)} in the "
                f"reference ({re.name}){' (' + p.note + ')' if p.note else ''}: a load into the reference's "
                "template fails; this is another model or another parallel layout",
                reference=re.name, reference_shape=list(re.shape), candidate_shape=list(ce.shape)))
        cast = _silent_cast(p, re, ce)
        if cast is not None:
            out.append(cast)
    out += _misattached(pairs)
    for status, code in (("missing", "compare.missing"), ("extra", "compare.extra"),
                         ("different", "compare.different")):
        grouped: dict[str, list[Pair]] = defaultdict(list)
        totals: Counter[str] = Counter(p.entry.component for p in pairs)
        for p in pairs:
            if p.status == status and p.source is None and p.entry.component not in skip_components:
                grouped[p.entry.component].append(p)
        for comp, ps in grouped.items():
            out.append(_grouped(code, comp, ps, totals[comp]))
    return out


def _rounded(p: Pair, re: Entry, ce: Entry) -> Finding:
    fmt = p.status.split("-")[0]
    rd, cd = re.dtype, ce.dtype
    what = "parameter" if ce.component == "model" else (f"optimizer {ce.role}" if ce.role else "tensor")
    if what == "parameter" and ce.data is not None and ce.data.dtype.itemsize == 2 and ce.data.dtype.is_float:
        # Stored in the 16-bit dtype itself: what audit calls it too (precision.*-rounded is for values rounded
        # to 16 bits but stored in a wider dtype, which look like masters until their bits are read).
        return finding(
            "precision.low-precision-storage", ce.name,
            f"{ce.name}: the candidate's parameter is stored as {cd} where the reference keeps {rd} masters "
            f"({re.name}); its values are the reference's rounded to {fmt} by {p.rounding}: the low bits are "
            f"gone and cannot be recovered by loading into {rd}; export the {rd} masters instead (get_state_dict + "
            "torch.distributed.checkpoint)",
            reference=re.name, rounding=p.rounding, reference_dtype=rd, candidate_dtype=cd, dtype=cd, expected=rd)
    return finding(
        f"precision.{fmt}-rounded", ce.name,
        f"{ce.name}: the candidate's {what} is the reference's {rd} tensor ({re.name}) rounded to {fmt} by "
        f"{p.rounding} (stored as {cd}): its low mantissa bits were lost before saving, e.g. by exporting "
        f"the {fmt} compute copies; export the {rd} masters instead (get_state_dict + "
        "torch.distributed.checkpoint)",
        reference=re.name, rounding=p.rounding, reference_dtype=rd, candidate_dtype=cd)


def _silent_cast(p: Pair, re: Entry, ce: Entry) -> Finding | None:
    if re.kind != "tensor" or ce.kind != "tensor" or re.data is None or ce.data is None:
        return None
    rd, cd = re.data.dtype, ce.data.dtype
    if rd.name == cd.name or re.data.shape != ce.data.shape:
        return None
    narrower = cd.itemsize < rd.itemsize or (rd.is_float and not cd.is_float)
    if p.status in ("identical", "equal-values"):
        effect = "lossless here (the values are equal), but nothing would have said so otherwise"
        sev = Severity.INFO
    elif narrower:
        effect = (f"the load succeeds and hides that only {cd.name} precision was saved"
                  + (f" (the values are the reference's {p.status} by {p.rounding})" if p.rounding else ""))
        sev = Severity.WARNING
    else:
        effect = f"the candidate's values are rounded to {rd.name} on load, and nothing reports the loss"
        sev = Severity.WARNING
    return finding(
        "load.silent-cast", ce.name,
        f"{ce.name} is {cd.name} where the reference's {re.name} is {rd.name}: torch.distributed.checkpoint.load "
        f"copies it into a {rd.name} template without checking the dtype (pytorch/pytorch#187138), so {effect}. "
        f"Save it as {rd.name}, or compare dtypes before loading",
        severity=sev, reference=re.name, reference_dtype=rd.name, candidate_dtype=cd.name)


def _misattached(pairs: Sequence[Pair]) -> list[Finding]:
    moved: dict[tuple[str, str], list[Pair]] = defaultdict(list)
    for p in pairs:
        if p.source is not None and p.cand is not None:
            moved[(str(p.cand.param), str(p.source[0].param))].append(p)
    out: list[Finding] = []
    done: set[tuple[str, str]] = set()
    for (a, b), ps in moved.items():
        if (a, b) in done:
            continue
        states = sorted({p.entry.role for p in ps})
        shape = list(ps[0].cand.shape) if ps[0].cand else []
        how = sorted({p.source[1] for p in ps if p.source is not None})
        if (b, a) in moved:
            done |= {(a, b), (b, a)}
            first, second = sorted((a, b))
            out.append(finding(
                "optimizer.misattached", f"{first} <-> {second}",
                f"the candidate's optimizer state ({', '.join(states)}) of {first} is the reference's state of "
                f"{second} and the other way round ({'/'.join(how)}): the moments of two same-shape parameters "
                f"({shape}) are swapped. Resuming applies each parameter's update history to the other; check "
                "the exporter's key mapping and save optimizer state keyed by FQN (get_optimizer_state_dict)",
                params=[first, second], states=states, shape=shape, swapped=True))
        else:
            done.add((a, b))
            out.append(finding(
                "optimizer.misattached", a,
                f"the candidate's optimizer state ({', '.join(states)}) of {a} is the reference's state of {b} "
                f"({'/'.join(how)}), a parameter of the same shape ({shape}): it is attached to the wrong "
                "parameter; check the exporter's key mapping and save optimizer state keyed by FQN",
                params=[a, b], states=states, shape=shape, swapped=False))
    return out


def _grouped(code: str, comp: str, ps: list[Pair], total: int) -> Finding:
    n = len(ps)
    tensors = sum(p.entry.kind == "tensor" for p in ps)
    shown = ", ".join(_describe(p) for p in ps[:_SHOWN]) + (f", ... ({n - _SHOWN} more)" if n > _SHOWN else "")
    keys = [key_text(p.key) for p in ps]
    if code == "compare.missing":
        sev = Severity.ERROR if comp in _CORE else Severity.WARNING
        msg = (f"{n} {comp} entr{'y' if n == 1 else 'ies'} of the reference ({tensors} tensor(s)) "
               f"{'is' if n == 1 else 'are'} absent from the candidate: {shown}; the candidate is not the whole "
               "training state")
        return finding(code, comp, msg, severity=sev, keys=keys)
    if code == "compare.extra":
        msg = f"{n} {comp} entr{'y' if n == 1 else 'ies'} only in the candidate (not compared): {shown}"
        return finding(code, comp, msg, keys=keys)
    sev = {ComponentKind.RNG.value: Severity.WARNING, "other": Severity.INFO}.get(comp, Severity.ERROR)
    msg = (f"{n} of {total} {comp} entries differ from the reference, not by a 16-bit rounding: {shown}. "
           "This is another training state (another step, run or exporter bug), not a copy of the reference")
    evidence = [{"key": key_text(p.key), **(_stats_json(p) or {})} for p in ps]
    return finding(code, comp, msg, severity=sev, entries=evidence)


def _describe(p: Pair) -> str:
    e = p.entry
    if p.status == "different":
        if p.stats is not None and p.stats.max_abs is not None:
            s = p.stats
            return (f"{e.name} (max |diff| {s.max_abs:.3g}, {_g(s.max_ulp)} ULP, rel. L2 {_g(s.rel_l2)}, "
                    f"{s.fraction:.1%} of elements)")
        if p.ref is not None and p.cand is not None and e.kind == "value":
            return f"{e.name} ({_short(p.ref.value)} vs {_short(p.cand.value)})"
        return f"{e.name}{' (' + p.note + ')' if p.note else ''}"
    return e.name


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _short(v: Any, n: int = 40) -> str:
    shown = repr(printable(v))  # an integer past Python's int-to-string limit must not break the report
    return shown if len(shown) <= n else shown[: n - 3] + "..."


# --- JSON and tables -------------------------------------------------------------------------------------


def _side_json(e: Entry | None) -> dict[str, Any] | None:
    if e is None:
        return None
    doc: dict[str, Any] = {"name": e.name}
    if e.kind == "tensor":
        doc.update(dtype=e.dtype if e.data is not None else None,
                   shape=list(e.shape) if e.data is not None else None, hash=e.hash)
    return doc


def _stats_json(p: Pair) -> dict[str, Any] | None:
    s = p.stats
    if s is None:
        return None
    return {"elements": s.numel, "differ": s.differ, "fraction": s.fraction, "max_abs": _finite(s.max_abs),
            "max_ulp": _finite(s.max_ulp), "rel_l2": _finite(s.rel_l2)}


def _finite(x: float | None) -> float | None:
    # JSON has no infinity: an undefined measure (relative error against an all-zero reference) is null.
    return x if x is not None and math.isfinite(x) else None


def pair_json(p: Pair) -> dict[str, Any]:
    """One element of the report's ``pairs`` (schema in docs/compare.md)."""
    e = p.entry
    doc: dict[str, Any] = {
        "key": key_text(p.key),
        "kind": e.kind,
        "component": e.component,
        "group": group_of(e),
        "role": e.role,
        "param": e.param,
        "status": p.status,
        "rounding": p.rounding,
        "reference": _side_json(p.ref),
        "candidate": _side_json(p.cand),
        "diff": _stats_json(p),
        "matches_reference": None,
        "note": p.note,
    }
    if p.source is not None:
        doc["matches_reference"] = {"name": p.source[0].name, "param": p.source[0].param, "how": p.source[1]}
    if e.kind == "value" and p.status != "identical":
        for side, ent in (("reference", p.ref), ("candidate", p.cand)):
            if ent is not None and doc[side] is not None:
                doc[side]["value"] = _short(ent.value, 80)
    return doc


def _cell(e: Entry | None) -> str:
    if e is None:
        return "-"
    if e.kind == "tensor":
        return f"{e.dtype} {list(e.shape)}" if e.data is not None else "unreadable"
    return _short(e.value, 30)


def _detail(p: Pair) -> str:
    if p.source is not None:
        return f"= reference {p.source[0].name} ({p.source[1]})"
    if p.rounding:
        return p.rounding
    if p.stats is not None and p.stats.max_abs is not None:
        s = p.stats
        return f"max|d| {s.max_abs:.3g}, {_g(s.max_ulp)} ULP, rel.L2 {_g(s.rel_l2)}, {s.fraction:.1%} differ"
    if p.stats is not None:
        return f"{p.stats.fraction:.1%} differ"
    return p.note


def sections(pairs: Sequence[Pair], sides: list[dict[str, Any]], notes: list[str], *,
             verbose: bool) -> list[dict[str, Any]]:
    """The human tables: the two checkpoints, statuses per group, and the pairs (non-identical only unless
    ``verbose``)."""
    out: list[dict[str, Any]] = [{
        "title": "checkpoints",
        "columns": ["side", "path", "layout", "tensors", "values"],
        "rows": [[s["side"], s["path"], s["layout"], s["tensors"], s["values"]] for s in sides],
    }]
    cols = ["identical", "equal-values", "bf16-rounded", "fp16-rounded", "different", "shape-mismatch",
            "missing", "extra", "unread"]
    by_group: dict[str, Counter[str]] = defaultdict(Counter)
    for p in pairs:
        by_group[group_of(p.entry)][p.status] += 1
    used = [c for c in cols if any(cnt[c] for cnt in by_group.values())]
    out.append({
        "title": "pairs by group",
        "columns": ["group", "pairs", *used],
        "rows": [[g, sum(by_group[g].values()), *(by_group[g][c] or "" for c in used)]
                 for g in GROUPS if g in by_group],
    })
    rows = [[key_text(p.key), p.status, _cell(p.ref), _cell(p.cand), _detail(p)]
            for p in pairs if verbose or p.status != "identical"]
    if not verbose and len(rows) > MAX_TABLE_ROWS:
        more = len(rows) - MAX_TABLE_ROWS
        rows = [*rows[:MAX_TABLE_ROWS], [f"... {more} more", "", "", "", "(--verbose or --format json)"]]
    if rows:
        out.append({"title": "pairs" if verbose else "pairs that are not identical",
                    "columns": ["key", "status", "reference", "candidate", "detail"], "rows": rows})
    if notes:
        out.append({"title": "notes", "columns": ["note"], "rows": [[n] for n in notes]})
    return out

