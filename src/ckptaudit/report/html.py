"""A self-contained HTML page: the verdict, the findings, the tables, and plots (inline SVG, no scripts, no
network). Renders any report; a resume test adds deviation and loss-difference plots per step.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any, TextIO

from ckptaudit import __version__
from ckptaudit.model import Precision, Report, Severity

__all__ = ["render_html", "render_page"]

_COLORS = ["#2ca02c", "#d62728", "#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
"""The first series (the reference) is green; candidates follow."""
_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1100px;
color:#222;padding:0 1em}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
.verdict{padding:.6em 1em;border-radius:6px;font-weight:600}
.bad{background:#fdecea;color:#a61b1b}.ok{background:#eaf7ee;color:#1b6e35}.warn{background:#fff6e0;color:#8a5a00}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}td,th{border:1px solid #ddd;padding:3px 7px;
text-align:left;vertical-align:top}th{background:#f5f5f5}.error{color:#a61b1b;font-weight:600}
.warning{color:#8a5a00}.info{color:#1f5f8b}code{font-size:.95em}.plots{display:flex;flex-wrap:wrap;gap:1em}
.muted{color:#777;font-size:.85em}
"""


def render_html(report: Report, out: TextIO) -> None:
    render_page([report], out, title=f"ckptaudit {report.command}")


def render_page(reports: Sequence[Report], out: TextIO, *, title: str = "ckptaudit report") -> None:
    """Several reports on one page (the demo puts its audits and its resume test together)."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{_e(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{_e(title)}</h1>"]
    for report in reports:
        parts.append(_report(report))
    parts.append(f"<p class='muted'>ckptaudit {__version__}</p></body></html>\n")
    out.write("".join(parts))


def _e(text: Any) -> str:
    return html.escape(str(text))


def _report(r: Report) -> str:
    worst = r.worst()
    cls = "bad" if worst is Severity.ERROR else "warn" if worst is Severity.WARNING else "ok"
    parts = [f"<h2>{_e(r.command)}: <code>{_e(r.path)}</code></h2>",
             f"<p class='muted'>format: {_e(r.format)}"]
    if r.contract is not None:
        parts.append(f" &middot; master dtype: {_e(r.contract.master_dtype)} ({_e(r.contract.source)}: "
                     f"{_e(r.contract.detail)})")
    parts.append("</p>")
    if r.summary:
        parts.append(f"<p class='verdict {cls}'>{_e(r.summary)}</p>")
    resume = r.extra.get("resume")
    if isinstance(resume, dict):
        parts.append(_resume_plots(resume))
    for section in r.extra.get("sections", []):
        parts.append(_table(section.get("title", ""), section.get("columns", []), section.get("rows", [])))
    if r.components:
        parts.append(_table("components", ["component", "found", "where"],
                            [[c.kind.value, "yes" if c.found else "MISSING", ", ".join(c.where)]
                             for c in r.components]))
    if r.findings:
        rows = [[f"<span class='{f.severity.label}'>{f.severity.label}</span>", f"<code>{_e(f.code)}</code>",
                 _e(f.subject), _e(f.message)] for f in r.findings]
        parts.append(_table("findings", ["severity", "code", "subject", "message"], rows, escaped=True))
    odd = [t for t in r.tensors if t.precision in (Precision.BF16, Precision.FP16, Precision.UNREAD)]
    if odd:
        parts.append(_table("tensors below their dtype's precision", ["name", "dtype", "shape", "effective"],
                            [[t.name, t.dtype, list(t.shape), t.precision.value] for t in odd[:200]]))
    return "".join(parts)


def _table(title: str, columns: Sequence[Any], rows: Sequence[Sequence[Any]], *, escaped: bool = False) -> str:
    head = "".join(f"<th>{_e(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{c if escaped else _e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<h3>{_e(title)}</h3><table><tr>{head}</tr>{body}</table>"


def _resume_plots(doc: dict[str, Any]) -> str:
    series_dev: list[tuple[str, list[float]]] = [("reference (documented)", doc["reference"]["rel_l2"])]
    series_loss: list[tuple[str, list[float]]] = [("reference (documented)", doc["reference"]["loss_diff"])]
    for c in doc.get("candidates", []):
        if "rel_l2" in c:
            name = c["exporter"].rpartition(":")[2]
            series_dev.append((name, c["rel_l2"]))
            series_loss.append((name, c["loss_diff"]))
    floor = max(doc.get("threshold", 1e-6), 1e-12)
    dev = _svg_plot("parameter deviation from the uninterrupted run (relative L2, log scale)", series_dev,
                    log=True, xlabel="steps after resume (0 = right after restore)", hline=floor,
                    hline_label="drift threshold")
    loss = _svg_plot("loss difference from the uninterrupted run", series_loss, log=False,
                     xlabel="training step after resume", first_x=1)
    return f"<div class='plots'>{dev}{loss}</div>"


def _svg_plot(title: str, series: list[tuple[str, list[float]]], *, log: bool, xlabel: str,
              hline: float | None = None, hline_label: str = "", first_x: int = 0) -> str:
    w, h, left, right, top, bottom = 520, 300, 64, 16, 28, 42
    pw, ph = w - left - right, h - top - bottom
    tiny = 1e-12
    values = [v for _, ys in series for v in ys if v == v]
    if hline is not None:
        values.append(hline)
    if log:
        pos = [max(v, tiny) for v in values] or [tiny]
        lo, hi = math.log10(min(pos)), math.log10(max(pos))
        if hi - lo < 1:
            hi = lo + 1
    else:
        lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
        if hi == lo:
            lo, hi = lo - 1, hi + 1
    n = max((len(ys) for _, ys in series), default=1)

    def x(i: int) -> float:
        return left + (pw * i / max(1, n - 1))

    def y(v: float) -> float:
        t = (math.log10(max(v, tiny)) if log else v)
        return top + ph - ph * (t - lo) / (hi - lo)

    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' font-size='11'>",
           f"<text x='{left}' y='16' font-weight='600'>{_e(title)}</text>",
           f"<rect x='{left}' y='{top}' width='{pw}' height='{ph}' fill='none' stroke='#bbb'/>"]
    ticks = range(math.floor(lo), math.ceil(hi) + 1) if log else [lo + (hi - lo) * k / 4 for k in range(5)]
    for t in ticks:
        val = 10.0**t if log else float(t)
        yy = y(val)
        if top - 1 <= yy <= top + ph + 1:
            label = "0" if (log and t == math.floor(lo) and val <= tiny) else (f"1e{int(t)}" if log else f"{val:.2g}")
            out.append(f"<line x1='{left - 4}' x2='{left + pw}' y1='{yy:.1f}' y2='{yy:.1f}' stroke='#eee'/>")
            out.append(f"<text x='{left - 6}' y='{yy + 4:.1f}' text-anchor='end'>{label}</text>")
    for i in range(n):
        out.append(f"<text x='{x(i):.1f}' y='{top + ph + 14}' text-anchor='middle'>{i + first_x}</text>")
    out.append(f"<text x='{left + pw / 2}' y='{h - 6}' text-anchor='middle'>{_e(xlabel)}</text>")
    if hline is not None:
        out.append(f"<line x1='{left}' x2='{left + pw}' y1='{y(hline):.1f}' y2='{y(hline):.1f}' stroke='#888' "
                   f"stroke-dasharray='4 3'/><text x='{left + pw - 4}' y='{y(hline) - 4:.1f}' "
                   f"text-anchor='end' fill='#666'>{_e(hline_label)}</text>")
    for k, (name, ys) in enumerate(series):
        color = _COLORS[k % len(_COLORS)]
        pts = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(ys) if v == v)
        out.append(f"<polyline points='{pts}' fill='none' stroke='{color}' stroke-width='2'/>")
        out.append(f"<text x='{left + 8}' y='{top + 14 + 13 * k}' fill='{color}'>{_e(name)}</text>")
    out.append("</svg>")
    return "".join(out)
