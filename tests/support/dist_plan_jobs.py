"""The distributed audit's ranks, as ``launch`` runs them for tests/auditing/test_dist_plan.py (importable by name)."""

from __future__ import annotations

import io
import json
from typing import Any

from ckptaudit.launch import RankContext


def audit_rank(ctx: RankContext, paths: list[str], jobs: int) -> dict[str, Any]:
    """(all ranks) ``audit_distributed`` of ``paths[rank]`` in the group ``launch`` set up; rank 0 returns the JSON
    report. Every rank returns its phase figures and how often it walked and loaded a DCP ``.metadata``."""
    from ckptaudit.auditing.distributed import audit_distributed
    from ckptaudit.auditing.judge import AuditOptions
    from ckptaudit.formats.dcp import reader as dcp
    from ckptaudit.report import OutputFormat, render

    calls = {"walk": 0, "load": 0}
    walk, load = dcp.scan, dcp.load_dcp_metadata

    def counted_walk(*a: Any, **k: Any) -> Any:
        calls["walk"] += 1
        return walk(*a, **k)

    def counted_load(*a: Any, **k: Any) -> Any:
        calls["load"] += 1
        return load(*a, **k)

    dcp.scan, dcp.load_dcp_metadata = counted_walk, counted_load  # type: ignore[assignment]
    stats: dict[str, float] = {}
    report = audit_distributed(paths[ctx.rank], AuditOptions(jobs=jobs), rank=ctx.rank, world_size=ctx.world_size,
                               timeout_s=120, stats=stats)
    out: dict[str, Any] = {"stats": stats, "calls": calls}
    if report is not None:
        buf = io.StringIO()
        render(report, OutputFormat.JSON, buf)
        out["report"] = json.loads(buf.getvalue())
    return out


def audit_rank_replacing(ctx: RankContext, path: str, replacement: str, when: str) -> dict[str, Any]:
    """(all ranks) ``audit_distributed`` of ``path``, which is replaced by ``replacement`` (``os.replace``) at one
    point of the audit: ``"after-plan"`` (rank 0, once its readers parsed the header, before it sends the shares)
    or ``"after-check"`` (rank 1, once its view check found the files as rank 0 read them, before its scan opens
    them). Rank 0 returns the JSON report."""
    import os

    from ckptaudit.auditing import distributed
    from ckptaudit.auditing.judge import AuditOptions
    from ckptaudit.report import OutputFormat, render

    def replacing(inner: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            out = inner(*a, **k)
            os.replace(replacement, path)
            return out
        return call

    if when == "after-plan" and ctx.rank == 0:
        distributed.plan_scan = replacing(distributed.plan_scan)  # type: ignore[assignment]
    elif when == "after-check" and ctx.rank == 1:
        distributed.view_problems = replacing(distributed.view_problems)  # type: ignore[assignment]
    report = distributed.audit_distributed(path, AuditOptions(jobs=1), rank=ctx.rank, world_size=ctx.world_size,
                                           timeout_s=120)
    out: dict[str, Any] = {}
    if report is not None:
        buf = io.StringIO()
        render(report, OutputFormat.JSON, buf)
        out["report"] = json.loads(buf.getvalue())
    return out
