"""The human-readable report: a verdict line, the findings (grouped), the components and the odd tensors."""

from __future__ import annotations

import os
import re
from collections import defaultdict
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ckptaudit.catalogue import CATALOGUE
from ckptaudit.model import Finding, Precision, Report, Severity

__all__ = ["render_table"]

_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}
GROUP_ABOVE = 3
MAX_SUBJECTS = 8
MAX_DETAIL_LINES = 16
"""Lines of a finding's traceback printed below the table (its last frames) unless --verbose."""

# Names and messages come from untrusted files: C0/C1 control characters (terminal escape sequences), lone
# surrogates (unencodable) and bidirectional overrides are shown escaped, and no string is parsed as markup.
_UNSAFE_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def clean(value: Any) -> str:
    """``value`` as text that is safe to print on a terminal."""
    return _UNSAFE_CHARS.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                             else f"\\u{ord(m.group()):04x}", str(value))


def _t(value: Any, style: str = "") -> Text:
    return Text(clean(value), style=style)


PIPE_WIDTH = 140
"""Width of the table when the output is not a terminal and ``COLUMNS`` is not set."""


def width_for(out: TextIO) -> int | None:
    """A terminal's own width (``None``: rich asks the terminal, and honours ``COLUMNS``); for a pipe or a file,
    ``COLUMNS`` when it is set to a sane number, else :data:`PIPE_WIDTH`."""
    if out.isatty():
        return None
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and 20 <= int(columns) <= 10_000:
        return int(columns)
    return PIPE_WIDTH


def console_for(out: TextIO) -> Console:
    # Markup and emoji off: names and messages come from untrusted checkpoints ("[/]" would be a markup error).
    return Console(file=out, width=width_for(out), highlight=False, soft_wrap=False, markup=False, emoji=False)


def _column(t: Table, header: str, **kwargs: Any) -> None:
    """A column whose header never breaks inside a word (its narrowest width is the header's longest word)."""
    kwargs.setdefault("min_width", max(len(w) for w in header.split()) if header.strip() else None)
    t.add_column(header, **kwargs)


def render_table(report: Report, out: TextIO, *, verbose: bool = False) -> None:
    con = console_for(out)
    worst = report.worst()
    style = _STYLE.get(worst, "bold green") if worst is not None and worst > Severity.INFO else "bold green"
    con.print(_t(f"ckptaudit {report.command}: {report.path}", "bold"))
    con.print(_t(f"format: {report.format}"), end="")
    if report.contract is not None:
        c = report.contract
        con.print(_t(f"   master dtype: {c.master_dtype} ({c.source}: {c.detail})"), end="")
    con.print()
    if report.summary:
        con.print(_t(report.summary, style))
    for section in report.extra.get("sections", []):
        _section(con, section, verbose)
    if report.components:
        missing = [c for c in report.components if not c.found]
        if verbose or missing:
            t = Table(title="components", title_justify="left", show_edge=False)
            _column(t, "component", no_wrap=True)
            _column(t, "found", no_wrap=True)
            _column(t, "where", overflow="fold")
            for comp in report.components:
                t.add_row(comp.kind.value, "yes" if comp.found else Text("MISSING", style="red"),
                          _t(", ".join(comp.where) + (f"  ({comp.detail})" if comp.detail else "")))
            con.print(t)
        else:
            con.print(_t("components: " + ", ".join(f"{c.kind.value} ({', '.join(c.where)})"
                                                    for c in report.components)))
    if report.findings:
        t = Table(title="findings", title_justify="left", show_edge=False)
        _column(t, "severity", no_wrap=True)
        _column(t, "code", no_wrap=True, min_width=min(32, max(len(f.code) for f in report.findings)))
        _column(t, "subject", overflow="fold", ratio=1)
        _column(t, "message", overflow="fold", ratio=3)
        # Rows group by (severity, code): one code can be an error for some subjects and a warning for others
        # (component.missing: model vs rng), and an error row must not list warning subjects.
        by_key: dict[tuple[Severity, str, bool], list[int]] = defaultdict(list)
        for i, f in enumerate(report.findings):
            by_key[(f.severity, f.code, f.ignored)].append(i)
        shown: set[tuple[Severity, str, bool]] = set()
        details: list[tuple[Finding, list[str]]] = []
        for f in report.findings:
            key = (f.severity, f.code, f.ignored)
            same = by_key[key]
            if verbose or len(same) <= GROUP_ABOVE:
                head, _, rest = f.message.partition("\n")
                if rest.strip():  # a traceback: its lines below the table, not escaped inside a cell
                    details.append((f, rest.rstrip().splitlines()))
                    head += " (traceback below)"
                t.add_row(_severity(f), _t(f.code), _t(f.subject), _t(head))
                continue
            if key in shown:
                continue
            shown.add(key)
            # Many findings of one code (e.g. every parameter rounded): one row, the subjects listed.
            subjects = [report.findings[i].subject for i in same]
            listed = ", ".join(subjects[:MAX_SUBJECTS]) + (", ..." if len(subjects) > MAX_SUBJECTS else "")
            rule = CATALOGUE.get(f.code)
            t.add_row(_severity(f), _t(f.code), f"{len(same)} subjects",
                      _t(f"{listed}. {rule.summary if rule else f.message} (--verbose lists each)"))
        con.print(t)
        for f, lines in details:
            cut = not verbose and len(lines) > MAX_DETAIL_LINES
            con.print(_t(f"{f.code} {f.subject}:" + (f" (last {MAX_DETAIL_LINES} of {len(lines)} lines; "
                                                     "--verbose shows all)" if cut else ""), "bold"))
            for line in lines[-MAX_DETAIL_LINES:] if cut else lines:
                con.print(_t("  " + line), soft_wrap=True)
    else:
        con.print(Text("no findings", style="green"))
    # Every tensor in verbose mode; otherwise only unreadable ones (rounded ones are already findings).
    odd = [r for r in report.tensors if verbose or r.precision is Precision.UNREAD]
    if odd:
        t = Table(title="tensors" if verbose else "tensors below their dtype's precision", title_justify="left",
                  show_edge=False)
        for col in ("name", "role", "dtype", "shape", "effective", "hash"):
            _column(t, col, overflow="fold")
        for r in odd[: None if verbose else 20]:
            t.add_row(_t(r.name), _t(r.role), _t(r.dtype), str(list(r.shape)), r.precision.value, (r.hash or "-")[:16])
        if not verbose and len(odd) > 20:
            t.add_row(f"... {len(odd) - 20} more", "", "", "", "", "")
        con.print(t)


def _severity(f: Finding) -> Text:
    """The severity cell: an acknowledged finding (``--ignore``) says so, dimmed."""
    if f.ignored:
        return Text(f"{f.severity.label} (ignored)", style="dim")
    return Text(f.severity.label, style=_STYLE[f.severity])


MAX_SECTION_ROWS = 12


def _section(con: Console, section: dict, verbose: bool) -> None:
    """A command-specific table: ``{"title", "columns", "rows"}``; long ones cut short unless ``verbose``."""
    t = Table(title=_t(section.get("title") or ""), title_justify="left", show_edge=False)
    for col in section.get("columns", []):
        header = clean(col)
        t.add_column(Text(header), overflow="fold", min_width=max((len(w) for w in header.split()), default=1))
    rows = section.get("rows", [])
    shown = rows if verbose or len(rows) <= MAX_SECTION_ROWS else rows[: MAX_SECTION_ROWS - 2]
    for row in shown:
        t.add_row(*[_t(c) for c in row])
    if len(shown) < len(rows):
        t.add_row(_t(f"... {len(rows) - len(shown)} more rows (--verbose, or --format json, lists all)"),
                  *[""] * (len(section.get("columns", [])) - 1))
    con.print(t)
