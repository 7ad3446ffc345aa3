"""A self-contained HTML page: the verdict, the findings, the tables, and plots (inline SVG, no scripts, no
network). Renders any report; a resume test adds deviation and loss-difference plots per step.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence
from typing import Any, TextIO

from ckptaudit.findings import Precision, RawReport, Severity
from ckptaudit.report.text import clean
from ckptaudit.version import __version__

__all__ = ["render_html", "render_page"]

_COLORS = ["#2ca02c", "#d62728", "#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
"""The first series (the reference) is green; candidates follow."""
_CONTROL = "positive control"
_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1100px;
color:#222;padding:0 1em}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
.verdict{padding:.6em 1em;border-radius:6px;font-weight:600}
.bad{background:#fdecea;color:#a61b1b}.ok{background:#eaf7ee;color:#1b6e35}.warn{background:#fff6e0;color:#8a5a00}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}td,th{border:1px solid #ddd;padding:3px 7px;
text-align:left;vertical-align:top}th{background:#f5f5f5}.error{color:#a61b1b;font-weight:600}
.warning{color:#8a5a00}.info{color:#1f5f8b}code{font-size:.95em}.plots{display:flex;flex-wrap:wrap;gap:1em}
.muted{color:#777;font-size:.85em}pre.tb{white-space:pre-wrap;font-size:.9em;margin:.4em 0 0;color:#444}
td,th,h2,p,code,pre{overflow-wrap:break-word}table{max-width:100%}
"""


def render_html(report: RawReport, out: TextIO) -> None:
    render_page([report], out, title=f"ckptaudit {report.command}")


def render_page(reports: Sequence[RawReport], out: TextIO, *, title: str = "ckptaudit report") -> None:
    """Several reports on one page (the demo puts its audits and its resume test together)."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{_e(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{_e(title)}</h1>"]
    for report in reports:
        parts.append(_report(report))
    parts.append(f"<p class='muted'>ckptaudit {__version__}</p></body></html>\n")
    out.write("".join(parts))


def _e(text: Any) -> str:
    # Untrusted names: bidi controls and line separators shown as escapes, then HTML-escaped.
    return html.escape(clean(text))


_LONG = re.compile(r"\S{24,}")
_BREAK_AFTER = re.compile(r"(?<=[./_:\-])")


def _ew(text: Any) -> str:
    """:func:`_e` for text shown in the page's flow (table cells, headings): a long unbroken run (a tensor's
    dotted name, a path) may wrap after its dots, slashes, underscores, colons and dashes, or every 24 characters
    where it has none (``<wbr>``), so it wraps in its cell instead of widening the table past the page, while
    short words keep whole."""
    cleaned = clean(text)
    out: list[str] = []
    pos = 0
    for m in _LONG.finditer(cleaned):
        out.append(html.escape(cleaned[pos:m.start()]))
        pieces = [p for p in _BREAK_AFTER.split(m.group()) if p]
        out.append("<wbr>".join(html.escape(c) for p in pieces for c in _chunks(p, 24)))
        pos = m.end()
    out.append(html.escape(cleaned[pos:]))
    return "".join(out)


def _chunks(text: str, n: int) -> list[str]:
    return [text[i:i + n] for i in range(0, len(text), n)] or [""]


def _report(r: RawReport) -> str:
    worst = r.worst()
    cls = "bad" if worst is Severity.ERROR else "warn" if worst is Severity.WARNING else "ok"
    resume = r.extra.get("resume")
    parts = [f"<h2>{_e(r.command)}: <code>{_ew(r.path)}</code></h2>"]
    if isinstance(resume, dict):
        kept = resume.get("workdir")
        parts.append(f"<p class='muted'>recipe: <code>{_ew(r.path)}</code> &middot; exporters: "
                     + ", ".join(f"<code>{_ew(c['exporter'])}</code>" for c in resume.get("candidates", []))
                     + f" &middot; {_e(resume.get('nproc'))} rank(s)"
                     + (f", resumed on {_e(resume.get('resume_nproc'))}"
                        if resume.get("resume_nproc") not in (None, resume.get("nproc")) else "")
                     + " &middot; checkpoints: " + (f"<code>{_ew(kept)}</code>" if kept else
                                                    "in a temporary directory, removed (--workdir keeps them)"))
    else:
        parts.append(f"<p class='muted'>format: {_e(r.format)}")
    if r.contract is not None:
        parts.append(f" &middot; master dtype: {_e(r.contract.master_dtype)} ({_e(r.contract.source)}: "
                     f"{_e(r.contract.detail)})")
    parts.append("</p>")
    if r.summary:
        parts.append(f"<p class='verdict {cls}'>{_e(r.summary)}</p>")
    if isinstance(resume, dict):
        parts.append(_resume_plots(resume))
    for section in r.extra.get("sections", []):
        parts.append(_table(section.get("title", ""), section.get("columns", []), section.get("rows", [])))
    if r.components:
        parts.append(_table("components", ["component", "found", "where"],
                            [[c.kind.value, "yes" if c.found else "MISSING", ", ".join(c.where)]
                             for c in r.components]))
    if r.findings:
        rows = [[f"<span class='{f.severity.label}'>{f.severity.label}{' (ignored)' if f.ignored else ''}</span>",
                 f"<code>{_e(f.code)}</code>", _ew(f.subject), _message(f.message)] for f in r.findings]
        parts.append(_table("findings", ["severity", "code", "subject", "message"], rows, escaped=True))
    odd = [t for t in r.tensors if t.precision in (Precision.BF16, Precision.FP16, Precision.UNREAD)]
    if odd:
        parts.append(_table("tensors below their dtype's precision", ["name", "dtype", "shape", "effective"],
                            [[t.name, t.dtype, list(t.shape), t.precision.value] for t in odd[:200]]))
    return "".join(parts)


def _message(text: str) -> str:
    """A finding's message; a traceback after its first line kept in lines of its own."""
    head, _, rest = text.partition("\n")
    if not rest.strip():
        return _ew(head)
    # Each line escaped on its own: the newlines stay line breaks, any other separator in a line is shown escaped.
    return _ew(head) + "<pre class='tb'>" + "\n".join(_e(line) for line in rest.rstrip().split("\n")) + "</pre>"


def _table(title: str, columns: Sequence[Any], rows: Sequence[Sequence[Any]], *, escaped: bool = False) -> str:
    head = "".join(f"<th>{_e(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{c if escaped else _ew(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<h3>{_e(title)}</h3><table><tr>{head}</tr>{body}</table>"


def _resume_plots(doc: dict[str, Any]) -> str:
    """Deviation and loss difference per step, on the same x axis (0 = right after the restore, k = after the
    k-th step; a loss belongs to the step that computed it, so its curve starts at 1)."""
    base = [float(v) for v in doc.get("uninterrupted_loss", [])]

    def loss_pct(diff: Sequence[float]) -> list[float]:
        # Signed, in % of the uninterrupted run's loss at that step: the unit of the table's "max loss diff.".
        return [100.0 * d / abs(b) if b else float("nan") for d, b in zip(diff, base, strict=False)]

    ref = ("reference (documented)", doc["reference"]["rel_l2"], loss_pct(doc["reference"]["loss_diff"]))
    runs = [ref]
    for c in doc.get("candidates", []):
        if "rel_l2" in c:
            runs.append((c["exporter"].rpartition(":")[2], c["rel_l2"], loss_pct(c["loss_diff"])))
    control = doc.get("control")
    if isinstance(control, dict) and "rel_l2" in control:  # last, with its own markers: it often lies on a candidate
        runs.append((_CONTROL, control["rel_l2"], loss_pct(control.get("loss_diff", []))))
    thr = doc.get("threshold")
    steps = len(ref[1])
    hline: list[float] | None = None
    if isinstance(thr, list):
        hline = [float(t) for t in thr]
    elif isinstance(thr, (int, float)):
        hline = [float(thr)] * steps
    xlabel = "step after resume (0 = right after the restore)"
    dev = _svg_plot("parameter deviation from the uninterrupted run", [(n, d, 0) for n, d, _ in runs], log=True,
                    xlabel=xlabel, ylabel="relative L2 deviation (log scale)", points=steps, hline=hline,
                    hline_label="threshold (0 at step 0)")
    loss = _svg_plot("loss difference from the uninterrupted run", [(n, ls, 1) for n, _, ls in runs], log=False,
                     xlabel=xlabel, ylabel="% of the uninterrupted loss", points=steps, unit="%")
    return f"<div class='plots'>{dev}{loss}</div>"


def _nice_step(span: float) -> float:
    """A 1-2-5 step that cuts ``span`` into about four intervals."""
    raw = span / 4 if span > 0 else 1.0
    mag = 10.0 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1.0, 2.0, 5.0, 10.0) if m * mag >= raw)


def _linear_ticks(values: Sequence[float]) -> list[float]:
    """Rounded ticks covering ``values`` and 0."""
    lo, hi = min([0.0, *values]), max([0.0, *values])
    if hi == lo:
        hi = lo + 1.0
    step = _nice_step(hi - lo)
    first, last = math.floor(lo / step - 1e-9), math.ceil(hi / step + 1e-9)
    return [round(k * step, 12) for k in range(first, last + 1)]


def _tick_label(v: float) -> str:
    if v == 0:
        return "0"
    text = f"{v:.3g}"
    return text.replace("e-0", "e-").replace("e+0", "e")


_WIDTH_STEP = 3.0
"""How much wider each candidate's line is than the next one's (the last candidate's is 2)."""


def _marker(name: str, cx: float, cy: float, color: str, width: float = 2.0) -> str:
    """A candidate's point: a filled dot as wide as its line and a little more (an earlier, wider candidate's dot
    rings a later one's); the positive control's: a hollow square around where a candidate's dot would be, so a
    candidate on the control's curve leaves both visible."""
    if name == _CONTROL:
        return (f"<rect x='{cx - 4.5:.1f}' y='{cy - 4.5:.1f}' width='9' height='9' fill='none' stroke='{color}' "
                "stroke-width='1.5'/>")
    return f"<circle cx='{cx:.1f}' cy='{cy:.1f}' r='{width / 2 + 1.5:g}' fill='{color}'/>"


_LEGEND_CHARS = 23
"""Characters per legend line (about 145 px of 11 px text: the legend's width beside its line sample)."""


def _legend_lines(name: str) -> list[str]:
    """``name`` in lines of at most :data:`_LEGEND_CHARS`, broken after ``_``, ``.``, ``:``, ``-`` or a space where
    one is near the end; two lines at most, the second cut with an ellipsis."""
    lines: list[str] = []
    rest = name
    while rest and len(lines) < 2:
        if len(rest) <= _LEGEND_CHARS:
            lines.append(rest)
            rest = ""
            break
        cut = max((rest.rfind(c, 4, _LEGEND_CHARS) for c in "_.:- "), default=-1)
        cut = cut + 1 if cut > 0 else _LEGEND_CHARS
        lines.append(rest[:cut])
        rest = rest[cut:]
    if rest:
        lines[-1] = lines[-1][: _LEGEND_CHARS - 1] + "…"
    return lines or [""]


def _svg_plot(title: str, series: list[tuple[str, list[float], int]], *, log: bool, xlabel: str, ylabel: str,
              points: int, hline: list[float] | None = None, hline_label: str = "", unit: str = "") -> str:
    """A line plot whose axes contain every value (log: whole decades, zeros on their own row below a break;
    linear: rounded ticks including 0, labelled with ``unit``), both axes labelled, the legend right of the plot
    area, and the first series (the reference) drawn as a wide pale band under the others so that a curve equal
    to it does not hide it. Each series is ``(name, values, first x)``; the x axis runs 0..``points - 1``."""
    w, h, left, top, bottom, legend_w = 540, 310, 70, 28, 46, 175
    pw, ph = w - left - legend_w - 16, h - top - bottom
    finite = [v for _, ys, _ in series for v in ys if v == v and math.isfinite(v)]
    if hline is not None:
        finite += [v for v in hline if math.isfinite(v)]
    zero_row = 0.0
    if log:
        pos = [v for v in finite if v > 0]
        lo = math.floor(math.log10(min(pos))) if pos else -7
        hi = math.ceil(math.log10(max(pos))) if pos else -5
        if hi <= lo:
            hi = lo + 1
        has_zero = any(v <= 0 for v in finite)
        zero_row = 18.0 if has_zero else 0.0
        ticks = [float(t) for t in range(lo, hi + 1)]
        span_lo, span_hi = float(lo), float(hi)
    else:
        ticks = _linear_ticks(finite)
        span_lo, span_hi = ticks[0], ticks[-1]
    n = max(points, max((len(ys) + x0 for _, ys, x0 in series), default=1))
    inner = ph - zero_row

    def x(i: int) -> float:
        return left + (pw * i / max(1, n - 1))

    def y(v: float) -> float:
        if log:
            if v <= 0:
                return top + ph
            t = math.log10(v)
            return top + inner - inner * (t - span_lo) / (span_hi - span_lo)
        return top + ph - ph * (v - span_lo) / (span_hi - span_lo)

    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' font-size='11'>",
           f"<text x='{left}' y='16' font-weight='600'>{_e(title)}</text>",
           f"<rect x='{left}' y='{top}' width='{pw}' height='{ph}' class='plot-area' fill='none' stroke='#bbb'/>"]
    for t in ticks:
        yy = y(10.0**t) if log else y(t)
        label = f"1e{int(t)}" if log else _tick_label(t) + (unit if t else "")
        stroke = "#ccc" if (not log and t == 0) else "#eee"
        out.append(f"<line x1='{left - 4}' x2='{left + pw}' y1='{yy:.1f}' y2='{yy:.1f}' stroke='{stroke}'/>")
        out.append(f"<text x='{left - 6}' y='{yy + 4:.1f}' text-anchor='end'>{label}</text>")
    if zero_row:
        yb = top + inner + zero_row / 2
        out.append(f"<line x1='{left - 4}' x2='{left + pw}' y1='{top + ph:.1f}' y2='{top + ph:.1f}' stroke='#eee'/>")
        out.append(f"<text x='{left - 6}' y='{top + ph + 4:.1f}' text-anchor='end'>0</text>")
        out.append(f"<line x1='{left - 5}' x2='{left + 5}' y1='{yb + 3:.1f}' y2='{yb - 3:.1f}' stroke='#888'/>"
                   f"<line x1='{left - 5}' x2='{left + 5}' y1='{yb + 6:.1f}' y2='{yb:.1f}' stroke='#888'/>")
    for i in range(n):
        out.append(f"<text x='{x(i):.1f}' y='{top + ph + 14}' text-anchor='middle'>{i}</text>")
    out.append(f"<text class='xlabel' x='{left + pw / 2}' y='{h - 8}' text-anchor='middle'>{_e(xlabel)}</text>")
    out.append(f"<text class='ylabel' transform='translate(14,{top + ph / 2:.1f}) rotate(-90)' text-anchor='middle'>"
               f"{_e(ylabel)}</text>")
    legend: list[tuple[str, str, str]] = []
    if hline is not None:
        dash = "stroke='#888' stroke-dasharray='4 3'"
        run: list[str] = []
        for i, v in enumerate([*hline[:n], math.nan]):
            if math.isfinite(v) and (v > 0 or not log):
                run.append(f"{x(i):.1f},{y(v):.1f}")
                continue
            if run:
                out.append(f"<polyline points='{' '.join(run)}' fill='none' {dash}/>")
                run = []
            if math.isfinite(v):  # 0 on a log axis: a short dash on the zero row (no line across the break)
                out.append(f"<line x1='{x(i) - 6:.1f}' x2='{x(i) + 6:.1f}' y1='{y(v):.1f}' y2='{y(v):.1f}' {dash}/>")
        legend.append((hline_label, dash, ""))
    # Curves often coincide (a faithful candidate on the reference, a lossy one on the positive control, several
    # near 0): each is drawn narrower than the one before it, so every earlier one shows as a border around the
    # later ones; the reference is a pale band under all, the positive control a thin dashed line over all.
    candidates = [name for k, (name, _, _) in enumerate(series) if k > 0 and name != _CONTROL]
    widths = {name: 2.0 + _WIDTH_STEP * (len(candidates) - 1 - j) for j, name in enumerate(candidates)}
    for k, (name, ys, x0) in enumerate(series):
        color = _COLORS[k % len(_COLORS)]
        pts = [(x(i + x0), y(v)) for i, v in enumerate(ys) if v == v and math.isfinite(v)]
        if k == 0:
            band = max(widths.values(), default=2.0) + 7
            style = f"stroke='{color}' stroke-width='{band:g}' stroke-opacity='0.35' stroke-linecap='round'"
        elif name == _CONTROL:
            color = "#333333"
            style = f"stroke='{color}' stroke-width='1.5' stroke-dasharray='7 5' stroke-dashoffset='3'"
        else:
            style = f"stroke='{color}' stroke-width='{widths[name]:g}'"
        # One group per series (its line and its markers), named: what a reader's tools and the browser test find.
        out.append(f"<g class='series' data-series='{_e(name)}' data-color='{color}'>"
                   f"<polyline points='{' '.join(f'{px:.1f},{py:.1f}' for px, py in pts)}' fill='none' {style}/>")
        if k > 0:
            out.extend(_marker(name, px, py, color, widths.get(name, 2.0)) for px, py in pts)
        out.append("</g>")
        legend.append((name, style, color if k > 0 else ""))
    lx = left + pw + 14
    ly = float(top + 8)
    for name, style, color in legend:
        lines = _legend_lines(name)  # a long name wraps (two lines at most, then cut; whole on hover: <title>)
        text = "".join(f"<tspan x='{lx + 24}' dy='{0 if i == 0 else 12}'>{_e(line)}</tspan>"
                       for i, line in enumerate(lines))
        out.append(f"<g class='legend-item' data-series='{_e(name)}'><title>{_e(name)}</title>"
                   f"<line x1='{lx}' x2='{lx + 18}' y1='{ly:.1f}' y2='{ly:.1f}' {style}/>"
                   + (_marker(name, lx + 9, ly, color, widths.get(name, 2.0)) if color else "")
                   + f"<text x='{lx + 24}' y='{ly + 4:.1f}'>{text}</text></g>")
        ly += 18 + 12 * (len(lines) - 1)
    out.append("</svg>")
    return "".join(out)
