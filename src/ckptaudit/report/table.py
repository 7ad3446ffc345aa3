"""The human-readable report: a verdict line, the findings (grouped), the components and the odd tensors."""

from __future__ import annotations

import errno
import os
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

from ckptaudit.catalogue import CATALOGUE
from ckptaudit.findings import Finding, Precision, RawReport, Severity
from ckptaudit.report.layout import layout, plain, simple, wrap
from ckptaudit.report.plain import Cell, Grid, Line, draw, plain_output
from ckptaudit.report.text import clean

if TYPE_CHECKING:  # rich is imported where a report is drawn by it (not for plain output: report.plain)
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

__all__ = ["STREAM_ABOVE", "print_table", "render_table"]

_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}
GROUP_ABOVE = 3
MAX_SUBJECTS = 8
MAX_DETAIL_LINES = 16
"""Lines of a finding's traceback printed below the table (its last frames) unless --verbose."""

# Names and messages come from untrusted files: shown through report.text.clean (controls, format characters,
# line separators and lone surrogates escaped), and no string is parsed as markup.


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


_CONSOLE: Any = None


def console_for(out: TextIO) -> Console:
    global _CONSOLE
    if _CONSOLE is None:
        from rich.console import Console

        class _Console(Console):
            def on_broken_pipe(self) -> None:
                """A closed pipe is the caller's to handle (the CLI stops rendering and returns the verdict's exit
                code); rich's default would point the process's fd 1 at /dev/null and exit."""
                raise BrokenPipeError(errno.EPIPE, "the reader of the output has gone")

        _CONSOLE = _Console
    # Markup and emoji off: names and messages come from untrusted checkpoints ("[/]" would be a markup error).
    return _CONSOLE(file=out, width=width_for(out), highlight=False, soft_wrap=False, markup=False,  # type: ignore[no-any-return]
                    emoji=False)


def _column(t: Table, header: str, **kwargs: Any) -> None:
    """A column whose header never breaks inside a word (its narrowest width is the header's longest word)."""
    kwargs.setdefault("min_width", max(len(w) for w in header.split()) if header.strip() else None)
    t.add_column(header, **kwargs)


def render_table(report: RawReport, out: TextIO, *, verbose: bool = False) -> None:
    blocks = _blocks(report, verbose)
    if plain_output(out):
        text = draw(blocks, width_for(out) or PIPE_WIDTH)
        if text is not None:  # what rich would draw, without importing it
            out.write(text)
            return
    con = console_for(out)
    for block in blocks:
        if isinstance(block, Line):
            con.print(_text(block.text, block.style), end=block.end, soft_wrap=True if block.soft_wrap else None)
            continue
        from rich.table import Table

        if block.section:
            t = Table(title=_text(block.title), title_justify="left", show_edge=False)
            for header, options in block.columns:
                t.add_column(_text(header), **options)
        else:
            t = Table(title=block.title, title_justify="left", show_edge=False)
            for header, options in block.columns:
                _column(t, header, **options)
        print_table(con, t, [tuple(_text(c.plain, c.style) if isinstance(c, Cell) else c for c in row)
                             for row in block.rows])


def _text(text: str, style: str = "") -> Text:
    from rich.text import Text

    return Text(text, style=style)


def _blocks(report: RawReport, verbose: bool) -> list[Line | Grid]:
    """The report as lines and tables (names and messages through :func:`~ckptaudit.report.text.clean`)."""
    out: list[Line | Grid] = []
    worst = report.worst()
    style = _STYLE.get(worst, "bold green") if worst is not None and worst > Severity.INFO else "bold green"
    out.append(Line(clean(f"ckptaudit {report.command}: {report.path}"), "bold"))
    out.append(Line(clean(f"format: {report.format}"), end=""))
    if report.contract is not None:
        c = report.contract
        out.append(Line(clean(f"   master dtype: {c.master_dtype} ({c.source}: {c.detail})"), end=""))
    out.append(Line())
    if report.summary:
        out.append(Line(clean(report.summary), style))
    for section in report.extra.get("sections", []):
        out.append(_section(section, verbose))
    if report.components:
        missing = [c for c in report.components if not c.found]
        if verbose or missing:
            out.append(Grid("components", [("component", {"no_wrap": True}), ("found", {"no_wrap": True}),
                                           ("where", {"overflow": "fold"})],
                            [(comp.kind.value, "yes" if comp.found else Cell("MISSING", "red"),
                              clean(", ".join(comp.where) + (f"  ({comp.detail})" if comp.detail else "")))
                             for comp in report.components]))
        else:
            out.append(Line(clean("components: " + ", ".join(f"{c.kind.value} ({', '.join(c.where)})"
                                                             for c in report.components))))
    if report.findings:
        columns: list[tuple[str, dict[str, Any]]] = [("severity", {"no_wrap": True}),
                   ("code", {"no_wrap": True, "min_width": min(32, max(len(f.code) for f in report.findings))}),
                   ("subject", {"overflow": "fold", "ratio": 1}), ("message", {"overflow": "fold", "ratio": 3})]
        # Rows group by (severity, code): one code can be an error for some subjects and a warning for others
        # (component.missing: model vs rng), and an error row must not list warning subjects.
        by_key: dict[tuple[Severity, str, bool], list[int]] = defaultdict(list)
        for i, f in enumerate(report.findings):
            by_key[(f.severity, f.code, f.ignored)].append(i)
        shown: set[tuple[Severity, str, bool]] = set()
        details: list[tuple[Finding, list[str]]] = []
        rows: list[tuple[Any, ...]] = []
        for f in report.findings:
            key = (f.severity, f.code, f.ignored)
            same = by_key[key]
            if verbose or len(same) <= GROUP_ABOVE:
                head, _, rest = f.message.partition("\n")
                if rest.strip():  # a traceback: its lines below the table, not escaped inside a cell
                    details.append((f, rest.rstrip().split("\n")))  # not splitlines(): U+2028 stays escaped
                    head += " (traceback below)"
                rows.append((_severity(f), clean(f.code), clean(f.subject), clean(head)))
                continue
            if key in shown:
                continue
            shown.add(key)
            # Many findings of one code (e.g. every parameter rounded): one row, the subjects listed.
            subjects = [report.findings[i].subject for i in same]
            listed = ", ".join(subjects[:MAX_SUBJECTS]) + (", ..." if len(subjects) > MAX_SUBJECTS else "")
            rule = CATALOGUE.get(f.code)
            rows.append((_severity(f), clean(f.code), f"{len(same)} subjects",
                         clean(f"{listed}. {rule.summary if rule else f.message} (--verbose lists each)")))
        out.append(Grid("findings", columns, rows))
        for f, lines in details:
            cut = not verbose and len(lines) > MAX_DETAIL_LINES
            out.append(Line(clean(f"{f.code} {f.subject}:" + (f" (last {MAX_DETAIL_LINES} of {len(lines)} lines; "
                                                              "--verbose shows all)" if cut else "")), "bold"))
            for line in lines[-MAX_DETAIL_LINES:] if cut else lines:
                out.append(Line(clean("  " + line), soft_wrap=True))
    else:
        out.append(Line("no findings", "green"))
    # Every tensor in verbose mode; otherwise only unreadable ones (rounded ones are already findings).
    odd = [r for r in report.tensors if verbose or r.precision is Precision.UNREAD]
    if odd:
        rows = [(clean(r.name), clean(r.role), clean(r.dtype), str(list(r.shape)), r.precision.value,
                 (r.hash or "-")[:16]) for r in odd[: None if verbose else 20]]
        if not verbose and len(odd) > 20:
            rows.append((f"... {len(odd) - 20} more", "", "", "", "", ""))
        out.append(Grid("tensors" if verbose else "tensors below their dtype's precision",
                        [(col, {"overflow": "fold"}) for col in ("name", "role", "dtype", "shape", "effective",
                                                                  "hash")], rows))
    return out


def _severity(f: Finding) -> Cell:
    """The severity cell: an acknowledged finding (``--ignore``) says so, dimmed."""
    if f.ignored:
        return Cell(f"{f.severity.label} (ignored)", "dim")
    return Cell(f.severity.label, _STYLE[f.severity])


MAX_SECTION_ROWS = 12


def _section(section: dict, verbose: bool) -> Grid:
    """A command-specific table: ``{"title", "columns", "rows"}``; long ones cut short unless ``verbose``."""
    columns = []
    for col in section.get("columns", []):
        header = clean(col)
        columns.append((header, {"overflow": "fold", "min_width": max((len(w) for w in header.split()), default=1)}))
    rows = section.get("rows", [])
    shown = rows if verbose or len(rows) <= MAX_SECTION_ROWS else rows[: MAX_SECTION_ROWS - 2]
    cells: list[tuple[Any, ...]] = [tuple(clean(c) for c in row) for row in shown]
    if len(shown) < len(rows):
        cells.append((clean(f"... {len(rows) - len(shown)} more rows (--verbose, or --format json, lists all)"),
                      *[""] * (len(section.get("columns", [])) - 1)))
    return Grid(clean(section.get("title") or ""), columns, cells, section=True)


# ---------------------------------------------------------------------------------------------------------------
# Long tables, streamed. rich measures, wraps and renders every cell of a table before it prints the first line
# (about 1 ms a row: `audit --verbose` of 100k tensors took two minutes, all of it before any output). A long table
# is laid out here by rich's own rules from one pass over its cells: rich draws the title and the header, the rows
# are formatted as plain lines (a wrapped cell is wrapped as rich wraps it) and written in batches, so the first
# rows appear at once and a closed pipe (`| head`) stops the work at the next batch. tests/report/test_table_stream.py
# holds the streamed table to rich's drawing of the same table, line for line.

STREAM_ABOVE = 100
"""Tables of more rows than this are streamed; shorter ones are drawn by rich itself."""
_BATCH = 512
"""Rows formatted before each write."""


def print_table(con: Console, table: Table, rows: Sequence[Sequence[Any]], *,
                stream_above: int | None = None) -> None:
    """Print ``table`` with ``rows`` (cells are ``str`` or :class:`~rich.text.Text`) on ``con``: drawn by rich when
    it has at most ``stream_above`` rows (default :data:`STREAM_ABOVE`), else streamed in the same layout."""
    if len(rows) > (STREAM_ABOVE if stream_above is None else stream_above):
        widths = layout(con, table, rows)
        if widths is not None:
            _stream(con, table, rows, widths)
            return
    for row in rows:
        table.add_row(*row)
    con.print(table)


def _cell_lines(con: Console, cell: Any, width: int, column: Any) -> list[Any]:
    """One cell as lines of exactly ``width`` cells: ``str`` for plain text, :class:`Text` where rich must do it (a
    styled text, wide characters, a no-wrap cell that does not fit)."""
    from rich.text import Text

    text = plain(cell)
    styled = isinstance(cell, Text) and (cell.spans or cell.justify or cell.overflow or cell.no_wrap is not None)
    if not styled and simple(text):
        if len(text) <= width:
            return [text + " " * (width - len(text))]
        if not column.no_wrap and column.overflow in ("fold", "crop"):
            return wrap(text, width, column.overflow == "fold")
    rich_text = cell if isinstance(cell, Text) else Text(text)
    return list(rich_text.wrap(con, width, justify=column.justify, overflow=column.overflow,
                               no_wrap=column.no_wrap))


def _stream(con: Console, table: Table, rows: Sequence[Sequence[Any]], widths: list[int]) -> None:
    """Print the title and header through rich (the columns fixed at ``widths``), then the rows in batches."""
    for column, width in zip(table.columns, widths, strict=True):
        column.width = width - 2
    con.print(table)  # no rows yet: the title, the header and its rule
    box = table.box.substitute(con.options, safe=con.safe_box) if table.box is not None else None
    mid, foot = (box.mid_vertical, box.foot_vertical) if box is not None else (" ", " ")
    left, right = (mid, mid) if box is not None and table.show_edge else ("", "")
    color = con.color_system is not None
    columns = table.columns
    batch: list[Any] = []
    for index, row in enumerate(rows):
        cells = [_cell_lines(con, cell, w - 2, col) for cell, w, col in zip(row, widths, columns, strict=True)]
        divider = foot if index == len(rows) - 1 else mid
        height = max(len(c) for c in cells)
        for k in range(height):
            if color:
                batch.append(_styled_line(cells, k, widths, row, divider, left, right))
            else:
                parts = [plain(c[k]) if k < len(c) else " " * (w - 2) for c, w in zip(cells, widths, strict=True)]
                batch.append(left + " " + f" {divider} ".join(parts) + " " + right + "\n")
        if len(batch) >= _BATCH:
            _flush(con, batch, color)
    _flush(con, batch, color)


def _styled_line(cells: list[list[Any]], k: int, widths: list[int], row: Sequence[Any], divider: str, left: str,
                 right: str) -> Text:
    """Line ``k`` of a row for a terminal that shows styles: each cell's text in its style, the blank lines below
    a shorter cell unstyled (as rich draws them)."""
    from rich.text import Text

    line = Text(left + " ")
    for i, (lines, width, cell) in enumerate(zip(cells, widths, row, strict=True)):
        if i:
            line.append(f" {divider} ")
        if k >= len(lines):
            line.append(" " * (width - 2))
        elif isinstance(lines[k], Text):
            line.append(lines[k])
        else:
            line.append(lines[k], style=cell.style if isinstance(cell, Text) else "")
    line.append(" " + right)
    return line


def _flush(con: Console, batch: list[Any], color: bool) -> None:
    from rich.text import Text

    if not batch:
        return
    if color:
        con.print(Text("\n").join(batch), soft_wrap=True)
    else:
        con.file.write("".join(batch))
    batch.clear()

