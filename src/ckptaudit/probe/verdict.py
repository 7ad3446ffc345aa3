"""Judge what the probe saw: per parameter, is the saved tensor the master, the compute copy, or neither?

Pure (no torch, no I/O): :class:`~ckptaudit.probe.points.ProbeResult` in, :class:`~ckptaudit.findings.RawReport` out.
Every comparison is per rank over the same region (see :mod:`ckptaudit.probe.regions`), so "equal" means
bitwise equal on every rank's shard.

Verdicts, in the order they are tried:

``faithful``
    the saved tensor has the master's dtype and every shard hashes like the master's.
``compute-copy`` / ``compute-copy-upcast`` (``probe.saved-compute-copy``)
    it equals the compute representation observed inside forward, stored in the compute dtype or cast back
    to the master dtype; or, for a parameter forward did not show, the master rounded to the compute dtype
    the other parameters were observed in.
``rounded`` (``probe.mismatch``)
    it equals the master rounded to bf16 or fp16, but not to a compute dtype the probe observed (not armed,
    or rounded to another format).
``mismatch`` (``probe.mismatch``)
    anything else; the detail says which ranks' shards differ.
``not-saved`` (``probe.not-saved``)
    the saved state lacks the parameter, or its data could not be read.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from ckptaudit.catalogue import finding
from ckptaudit.findings import HASH_ALGORITHM, Contract, Finding, RawReport, Severity
from ckptaudit.probe.points import ComputeShard, MasterShard, ParamInfo, ProbeResult, SavedShard
from ckptaudit.probe.regions import combine, short_dtype

__all__ = ["PROBE_SCHEMA", "ParamVerdict", "judge_probe"]

PROBE_SCHEMA = 1
"""Version of ``Report.extra["probe"]`` (docs/probe.md)."""

_NARROW = ("bfloat16", "float16")
_LABEL = {
    "faithful": "faithful",
    "compute-copy": "COMPUTE COPY",
    "compute-copy-upcast": "COMPUTE COPY, upcast",
    "rounded": "ROUNDED master",
    "mismatch": "MISMATCH",
    "not-saved": "NOT SAVED",
    "unjudged": "not judged",
}


@dataclass(frozen=True, slots=True)
class ParamVerdict:
    fqn: str
    verdict: str
    """``faithful``, ``compute-copy``, ``compute-copy-upcast``, ``rounded``, ``mismatch``, ``not-saved``, or
    ``unjudged`` (point 1 or point 3 was not recorded)."""
    detail: str = ""


def _combined(shards: tuple[Any, ...], attr: str = "hash") -> str | None:
    digests = [getattr(s, attr) for s in shards]
    if not digests or any(d is None for d in digests):
        return None
    return combine(digests)


def _all_equal(saved: dict[int, str], other: dict[int, str | None]) -> bool:
    return bool(saved) and all(other.get(r) == h for r, h in saved.items())


def _judge_param(p: ParamInfo, masters: tuple[MasterShard, ...], compute: tuple[ComputeShard, ...],
                 saved: tuple[SavedShard, ...] | None, compute_dtype: str | None) -> ParamVerdict:
    if not masters or saved is None:
        return ParamVerdict(p.fqn, "unjudged", "point 1 not recorded" if not masters else "point 3 not recorded")
    if not saved:
        return ParamVerdict(p.fqn, "not-saved", "the saved state has no tensor for this parameter")
    unreadable = [s for s in saved if s.hash is None and s.note.startswith("unreadable")]
    if unreadable:
        return ParamVerdict(p.fqn, "not-saved", f"{unreadable[0].key}: {unreadable[0].note}")
    bad_shape = [s for s in saved if s.hash is None]
    if bad_shape:
        return ParamVerdict(p.fqn, "mismatch", f"{bad_shape[0].key}: {bad_shape[0].note}")
    m_dtype = masters[0].dtype
    s_dtype = saved[0].dtype
    s_hash = {s.rank: s.hash for s in saved if s.hash is not None}
    missing_ranks = sorted({m.rank for m in masters} - set(s_hash))
    note = f"; ranks {missing_ranks} not checked (the saved state was not visible there)" if missing_ranks else ""
    if s_dtype == m_dtype and _all_equal(s_hash, {m.rank: m.hash for m in masters}):
        return ParamVerdict(p.fqn, "faithful", f"bitwise equal to the {m_dtype} master on every shard{note}")
    if compute:
        c_dtype = compute[0].dtype
        if s_dtype == c_dtype and _all_equal(s_hash, {c.rank: c.hash for c in compute}):
            return ParamVerdict(p.fqn, "compute-copy",
                                f"equal to the {c_dtype} compute copy observed inside forward, saved as {c_dtype}{note}")
        if s_dtype == m_dtype and _all_equal(s_hash, {c.rank: c.upcast_hash for c in compute}):
            return ParamVerdict(p.fqn, "compute-copy-upcast",
                                f"equal to the {c_dtype} compute copy observed inside forward, upcast to {m_dtype}{note}")
    order = ([compute_dtype] if compute_dtype in _NARROW else []) + [d for d in _NARROW if d != compute_dtype]
    for narrow in order:
        stored = {m.rank: m.rounded.get(narrow) for m in masters}
        upcast = {m.rank: m.rounded.get(f"{narrow}>{m_dtype}") for m in masters}
        how = None
        if s_dtype == narrow and _all_equal(s_hash, stored):
            how, verdict = f"saved as {narrow}", "compute-copy"
        elif s_dtype == m_dtype and _all_equal(s_hash, upcast):
            how, verdict = f"upcast to {m_dtype}", "compute-copy-upcast"
        if how is None:
            continue
        if narrow == compute_dtype:
            return ParamVerdict(p.fqn, verdict, f"the {m_dtype} master rounded to the {narrow} compute dtype, {how} "
                                f"(forward did not show this parameter){note}")
        seen = f"the compute dtype observed is {compute_dtype}" if compute_dtype else "the probe was not armed"
        return ParamVerdict(p.fqn, "rounded", f"the {m_dtype} master rounded to {narrow}, {how}; {seen}{note}")
    differ = sorted(r for r, h in s_hash.items() if h != next((m.hash for m in masters if m.rank == r), None))
    what = f"saved as {s_dtype}, master is {m_dtype}; " if s_dtype != m_dtype else ""
    return ParamVerdict(p.fqn, "mismatch", f"{what}shards of ranks {differ} differ from the master and from its "
                        f"rounded copies{note}")


def _compute_consistent(masters: tuple[MasterShard, ...], compute: tuple[ComputeShard, ...]) -> bool | None:
    """Whether every observed compute shard is its master shard cast to the compute dtype (``None``: cannot say)."""
    by_rank = {m.rank: m for m in masters}
    answers = []
    for c in compute:
        m = by_rank.get(c.rank)
        if m is None:
            continue
        expected = m.hash if c.dtype == m.dtype else m.rounded.get(c.dtype)
        if expected is None:
            return None
        answers.append(c.hash == expected)
    return all(answers) if answers else None


def judge_probe(result: ProbeResult) -> RawReport:
    """The probe's :class:`Report`: findings, a per-parameter table (``extra["sections"]``) and JSON
    (``extra["probe"]``)."""
    observed = Counter(s[0].dtype for s in result.compute.values() if s)
    compute_dtype = observed.most_common(1)[0][0] if observed else None
    judged_saved = bool(result.saved_source)
    findings: list[Finding] = list(result.saved_findings)
    verdicts: list[ParamVerdict] = []
    rows: list[list[str]] = []
    params_json: list[dict[str, Any]] = []
    for p in result.params:
        masters = result.masters.get(p.fqn, ())
        compute = result.compute.get(p.fqn, ())
        saved = result.saved.get(p.fqn, ()) if judged_saved else None
        v = _judge_param(p, masters, compute, saved, compute_dtype)
        verdicts.append(v)
        findings += _findings_for(v, masters, compute, saved)
        consistent = _compute_consistent(masters, compute) if masters and compute else None
        if consistent is False:
            findings.append(finding(
                "probe.compute-not-master", p.fqn,
                f"{p.fqn}: the {compute[0].dtype} tensor forward computed with is not the current master cast to "
                f"{compute[0].dtype}; the probe was armed before an optimizer step, or forward computes with "
                "something other than a cast of the master",
                compute_hash=_combined(compute), master_hash=_combined(masters)))
        if result.armed and not compute and masters:
            findings.append(finding("probe.not-observed", p.fqn,
                                    f"{p.fqn}: the armed forward did not use this parameter unsharded"))
        rows.append(_row(p, masters, compute, saved, v, result.armed))
        params_json.append(_param_json(p, masters, compute, saved, v, consistent))
    master_dtypes = Counter(m[0].dtype for m in result.masters.values() if m)
    low = sorted(f for f, m in result.masters.items() if m and m[0].dtype in _NARROW)
    if low:
        findings.append(finding(
            "probe.low-precision-masters", "masters",
            f"{len(low)} of {len(result.masters)} parameters are trained with {'/'.join(sorted({result.masters[f][0].dtype for f in low}))} "
            "masters: the sharded parameters the optimizer updates are themselves 16-bit (a different contract: "
            "a bitwise copy of them is a faithful checkpoint)",
            parameters=low))
    findings.sort(key=lambda f: (-int(f.severity), f.code, f.subject))
    counts = Counter(v.verdict for v in verdicts)
    master = master_dtypes.most_common(1)[0][0] if master_dtypes else "unknown"
    extra = {
        "sections": [{
            "title": "probe: master (outside forward) | compute (inside forward) | saved -- dtype and combined hash",
            "columns": ["parameter", "placement", "master", "compute", "saved", "verdict"],
            "rows": rows,
        }],
        "probe": {
            "schema": PROBE_SCHEMA,
            "world_size": result.world_size,
            "wrapper": result.wrapper,
            "armed": result.armed,
            "autocast": result.autocast,
            "master_dtypes": dict(master_dtypes),
            "compute_dtype": compute_dtype,
            "saved": {"source": result.saved_source or None, "format": result.saved_format or None},
            "hash": f"{HASH_ALGORITHM} of each rank's region of the tensor (row-major, little-endian bytes); "
                    "combined = xxh3-128 over the per-rank digests in rank order",
            "meta": dict(result.meta),
            "verdicts": dict(counts),
            "parameters": params_json,
        },
    }
    return RawReport(
        command="probe",
        path=result.saved_source or "(nothing saved)",
        format=result.saved_format or "live",
        findings=tuple(findings),
        contract=Contract(master, "live", f"the sharded masters of the running job ({result.wrapper}, "
                          f"{result.world_size} rank(s))"),
        summary=_summary(counts, len(verdicts), master, compute_dtype, findings),
        extra=extra,
    )


def _findings_for(v: ParamVerdict, masters: tuple[MasterShard, ...], compute: tuple[ComputeShard, ...],
                  saved: tuple[SavedShard, ...] | None) -> list[Finding]:
    ev: dict[str, Any] = {"verdict": v.verdict, "master_hash": _combined(masters) if masters else None,
                          "saved_hash": _combined(saved) if saved else None}
    if compute:
        ev["compute_hash"] = _combined(compute)
    if v.verdict in ("compute-copy", "compute-copy-upcast"):
        return [finding("probe.saved-compute-copy", v.fqn,
                        f"{v.fqn}: the saved tensor is bit for bit the compute copy (the master rounded to the compute "
                        f"dtype), not the master: {v.detail}. Either the exporter captured the compute copies or it "
                        "cast the masters to the compute dtype; both lose the low mantissa bits", **ev)]
    if v.verdict in ("rounded", "mismatch"):
        return [finding("probe.mismatch", v.fqn, f"{v.fqn}: the saved tensor is not the master: {v.detail}", **ev)]
    if v.verdict == "not-saved":
        return [finding("probe.not-saved", v.fqn, f"{v.fqn}: {v.detail}", **ev)]
    return []


def _cell(dtype: str, digest: str | None) -> str:
    return f"{short_dtype(dtype)} {digest[:8] if digest else '?'}"


def _row(p: ParamInfo, masters: tuple[MasterShard, ...], compute: tuple[ComputeShard, ...],
         saved: tuple[SavedShard, ...] | None, v: ParamVerdict, armed: bool) -> list[str]:
    m = _cell(masters[0].dtype, _combined(masters)) if masters else "-"
    if compute:
        c = _cell(compute[0].dtype, _combined(compute))
        up = _combined(compute, "upcast_hash")
        if up is not None and masters:
            c += f" ({short_dtype(masters[0].dtype)} {up[:8]})"
    else:
        c = "not seen" if armed else "-"
    if saved is None:
        s = "-"
    elif not saved:
        s = "missing"
    else:
        s = _cell(saved[0].dtype, _combined(saved))
    return [p.fqn, p.placement, m, c, s, _LABEL[v.verdict]]


def _param_json(p: ParamInfo, masters: tuple[MasterShard, ...], compute: tuple[ComputeShard, ...],
                saved: tuple[SavedShard, ...] | None, v: ParamVerdict, consistent: bool | None) -> dict[str, Any]:
    doc: dict[str, Any] = {"name": p.fqn, "shape": list(p.shape), "placement": p.placement,
                           "verdict": v.verdict, "detail": v.detail}
    doc["master"] = {
        "dtype": masters[0].dtype, "hash": _combined(masters),
        "shards": [{"rank": m.rank, "local_shape": list(m.local_shape), "region": m.region.to_json(),
                    "hash": m.hash} for m in masters],
    } if masters else None
    doc["compute"] = {
        "dtype": compute[0].dtype, "source": compute[0].source, "full_hash": compute[0].full_hash,
        "full_hash_agrees": len({c.full_hash for c in compute}) == 1,
        "hash": _combined(compute), "upcast_hash": _combined(compute, "upcast_hash"),
        "is_master_cast": consistent,
        "shards": [{"rank": c.rank, "hash": c.hash, "upcast_hash": c.upcast_hash} for c in compute],
    } if compute else None
    doc["saved"] = {
        "dtype": saved[0].dtype, "key": saved[0].key, "shape": list(saved[0].shape), "hash": _combined(saved),
        "shards": [{"rank": s.rank, "hash": s.hash, **({"note": s.note} if s.note else {})} for s in saved],
    } if saved else None
    return doc


def _summary(counts: Counter[str], total: int, master: str, compute_dtype: str | None,
             findings: list[Finding]) -> str:
    errors = sum(f.severity is Severity.ERROR for f in findings)
    head = "faithful" if errors == 0 else "NOT faithful"
    if counts.get("unjudged") == total:
        head = "not judged (no saved state recorded: call record_saved)"
    parts = [f"{counts[k]} {_LABEL[k].lower()}" for k in _LABEL if counts.get(k)]
    text = f"{head}: {total} parameters ({', '.join(parts)}); master dtype {master}"
    if compute_dtype:
        text += f", compute dtype {compute_dtype}"
    return text
