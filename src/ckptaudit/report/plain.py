"""The table report drawn without rich, for output that is no terminal (a pipe, a file): the same characters rich
draws, for the reports this can draw exactly, so that a small audit's whole process does not pay for importing
rich (about a third of its start-up: docs/performance.md, "Start-up").

:func:`ckptaudit.report.table.render_table` describes a report as :class:`Line` and :class:`Grid` blocks; rich draws
them (:mod:`ckptaudit.report.table`), or :func:`draw` does here. :func:`draw` answers ``None`` for anything it does
not draw as rich would (text that is not printable ASCII, a line longer than the width, a table
:func:`~ckptaudit.report.layout.layout` does not lay out, a long table, a command's own sections, a console rich
would treat as a terminal), and rich draws that report. ``tests/report/test_table_plain.py`` holds the two drawings
equal on real reports and random tables.
"""

from __future__ import annotations

import builtins
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from ckptaudit.report.layout import layout, plain, simple, wrap, wrap_line

__all__ = ["MAX_ROWS", "Cell", "Grid", "Line", "draw", "plain_output"]

MAX_ROWS = 100
"""Tables of more rows are left to the table renderer, which streams them in batches (a closed pipe stops it)."""


class Cell:
    """A table cell with a style (shown only on a terminal): ``plain`` is its text."""

    __slots__ = ("plain", "style")

    def __init__(self, text: str, style: str) -> None:
        self.plain = text
        self.style = style


class Line:
    """``text`` printed as one line (``end`` after it); ``soft_wrap``: never wrapped, whatever the width."""

    __slots__ = ("end", "soft_wrap", "style", "text")

    def __init__(self, text: str = "", style: str = "", *, end: str = "\n", soft_wrap: bool = False) -> None:
        self.text, self.style, self.end, self.soft_wrap = text, style, end, soft_wrap


class Grid:
    """A table: its title, its columns (header and rich ``Column`` options) and rows of ``str`` or :class:`Cell`;
    ``section``: a command's own table, drawn by rich only."""

    __slots__ = ("columns", "rows", "section", "title")

    def __init__(self, title: str, columns: Sequence[tuple[str, dict[str, Any]]], rows: Sequence[Sequence[Any]],
                 *, section: bool = False) -> None:
        self.title, self.columns, self.rows, self.section = title, columns, rows, section


class _Column:
    """What :func:`~ckptaudit.report.layout.layout` reads of a rich ``Column``, with rich's defaults."""

    def __init__(self, header: str, options: dict[str, Any]) -> None:
        self.header = header
        self.justify, self.max_width, self.style, self.vertical, self.width = "left", None, "", "top", None
        self.overflow = options.get("overflow", "ellipsis")
        self.no_wrap = bool(options.get("no_wrap", False))
        self.min_width = options.get("min_width")
        unknown = set(options) - {"overflow", "no_wrap", "min_width", "ratio"}  # ratio: no effect unless expand
        self.known = not unknown


class _Table:
    """What :func:`~ckptaudit.report.layout.layout` reads of our rich ``Table`` (title left, no edge), with rich's
    defaults."""

    expand, width, min_width, box, padding, pad_edge = False, None, None, "heavy head", (0, 1, 0, 1), True
    collapse_padding, show_lines, leading, show_footer, show_header, row_styles = False, False, 0, False, True, ()
    show_edge = False

    def __init__(self, columns: list[_Column]) -> None:
        self.columns = columns


class _Width:
    def __init__(self, width: int) -> None:
        self.width = width


def plain_output(out: TextIO) -> bool:
    """Whether rich would draw on ``out`` without styles or terminal features: what :func:`draw` reproduces (rich's
    ``Console.is_terminal`` false, UTF-8, not Windows' legacy console, not Jupyter)."""
    if sys.platform == "win32" or hasattr(builtins, "get_ipython"):
        return False
    if not (getattr(out, "encoding", "utf-8") or "utf-8").lower().startswith("utf"):
        return False  # rich would draw the boxes in ASCII
    if getattr(sys.stdin, "__module__", "").startswith("idlelib"):
        return False
    env = os.environ
    if env.get("TTY_COMPATIBLE", "") == "1" or env.get("FORCE_COLOR", "") != "":
        return False
    try:
        return not out.isatty()
    except ValueError:  # a closed file: rich says "no terminal" too
        return True


def draw(blocks: Sequence[Line | Grid], width: int) -> str | None:
    """The report as rich draws it at ``width`` on a console without styles, or ``None`` (see the module's doc)."""
    out: list[str] = []
    for block in blocks:
        if isinstance(block, Line):
            if not simple(block.text) and block.text:
                return None
            if not block.soft_wrap and len(block.text) > width:
                lines = wrap_line(block.text, width)
                if lines is None:
                    return None
                out.append("\n".join(lines) + block.end)
                continue
            out.append(block.text + block.end)
            continue
        lines = _grid(block, width)
        if lines is None:
            return None
        out += lines
    return "".join(out)


def _grid(grid: Grid, width: int) -> list[str] | None:
    if grid.section or not grid.rows or len(grid.rows) > MAX_ROWS:
        return None
    columns = [_Column(header, options) for header, options in grid.columns]
    if not all(c.known for c in columns):
        return None
    widths = layout(_Width(width), _Table(columns), grid.rows)
    if widths is None:
        return None
    total = sum(widths) + len(widths) - 1
    if not simple(grid.title) or len(grid.title) > total:
        return None
    lines = [grid.title + " " * (total - len(grid.title)) + "\n"]
    heads = []
    for c, w in zip(columns, widths, strict=True):
        if not simple(c.header) or len(c.header) > w - 2:
            return None
        heads.append(c.header + " " * (w - 2 - len(c.header)))
    lines.append(" " + " ┃ ".join(heads) + " \n")
    lines.append("╇".join("━" * w for w in widths) + "\n")
    for row in grid.rows:
        cells = []
        for cell, w, c in zip(row, widths, columns, strict=True):
            text = plain(cell)
            if not simple(text) and text:
                return None
            if len(text) <= w - 2:
                cells.append([text + " " * (w - 2 - len(text))])
            elif not c.no_wrap and c.overflow in ("fold", "crop"):
                cells.append(wrap(text, w - 2, c.overflow == "fold"))
            else:
                return None
        for k in range(max(len(lines_) for lines_ in cells)):
            parts = [lines_[k] if k < len(lines_) else " " * (w - 2) for lines_, w in zip(cells, widths, strict=True)]
            lines.append(" " + " │ ".join(parts) + " \n")
    return lines
