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
