"""Renderers: one report, three faces. ``table`` for people (rich), ``json`` for machines (versioned schema,
see docs/json-schema.md), ``html`` for plots. Every command's :class:`~ckptaudit.findings.RawReport` goes through
:func:`render`; nothing else in ckptaudit prints reports.
"""

from __future__ import annotations

import enum
from typing import TextIO

from ckptaudit.findings import RawReport

__all__ = ["OutputFormat", "render"]


class OutputFormat(enum.StrEnum):
    TABLE = "table"
    JSON = "json"
    HTML = "html"


def render(report: RawReport, fmt: OutputFormat, out: TextIO, *, verbose: bool = False) -> None:
    if fmt is OutputFormat.JSON:
        from ckptaudit.report.json import render_json

        render_json(report, out)
    elif fmt is OutputFormat.TABLE:
        from ckptaudit.report.table import render_table

        render_table(report, out, verbose=verbose)
    elif fmt is OutputFormat.HTML:
        from ckptaudit.report.html import render_html

        render_html(report, out)
    else:  # pragma: no cover - exhaustive over the enum
        raise AssertionError(fmt)
