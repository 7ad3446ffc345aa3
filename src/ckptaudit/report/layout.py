"""Tables laid out by rich's own rules without rich: the column widths rich would give a table
(:func:`layout`), and plain text wrapped as rich wraps it (:func:`wrap`). The table renderer
(:mod:`ckptaudit.report.table`) streams long tables with them, and draws a whole report without importing rich
where the output is no terminal (:mod:`ckptaudit.report.plain`); ``tests/report/test_table_stream.py`` holds both
to rich's drawing, character for character."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

__all__ = ["layout", "longest_line", "plain", "simple", "wrap", "wrap_line"]

_WORD = re.compile(r"\s*\S+\s*")
"""A word and the whitespace around it, as rich's word wrap cuts text."""


def plain(cell: Any) -> str:
    return cell.plain if hasattr(cell, "plain") else str(cell)


def simple(text: str) -> bool:
    """Printable ASCII: one cell per character, no line breaks, nothing rich would treat specially."""
    return text.isascii() and text.isprintable()


def longest_line(text: str) -> int:
    """rich's measure of a text's widest line, in terminal cells."""
    if simple(text):
        return len(text)
    from rich.cells import cell_len  # wide characters: rich's own measure

    return max((cell_len(line) for line in text.splitlines()), default=0)


def layout(con: Any, table: Any, rows: Sequence[Sequence[Any]]) -> list[int] | None:
    """The column widths (padding included) rich would give ``table`` holding ``rows``, or ``None`` for a table this
    module does not lay out (options our tables do not use, a table wider than the console)."""
    columns = table.columns
    if (table.expand or table.width is not None or table.min_width is not None or table.box is None
            or tuple(table.padding) != (0, 1, 0, 1) or not table.pad_edge or table.collapse_padding
            or table.show_lines or table.leading or table.show_footer or not table.show_header or table.row_styles
            or any(c.justify != "left" or c.max_width is not None or c.style or c.vertical != "top"
                   for c in columns)
            or any(len(row) != len(columns) for row in rows)):
        return None
    extra = len(columns) - 1 + (2 if table.show_edge else 0)
    available = con.width - extra
    longest = [longest_line(plain(c.header)) for c in columns]
    for row in rows:
        for i, cell in enumerate(row):
            if isinstance(cell, str) and len(cell) <= longest[i] and cell.isascii():
                continue
            n = longest_line(plain(cell))
            if n > longest[i]:
                longest[i] = n

    def measure(limit: int) -> list[int]:
        # rich's Table._measure_column over Padding(Text): the widest line plus the padding, capped at the limit,
        # raised to the column's min_width; a fixed-width column is its width plus the padding.
        out = []
        for c, n in zip(columns, longest, strict=True):
            if limit < 1:
                out.append(0)
            elif c.width is not None:
                out.append(min(c.width + 2, limit))
            else:
                w = limit if limit <= 2 else min(n + 2, limit)
                out.append(w if c.min_width is None else max(w, c.min_width + 2))
        return out

    widths = [w or 1 for w in measure(available)]
    if sum(widths) > available:
        widths = _collapse(widths, [c.width is None and not c.no_wrap for c in columns], available)
        if sum(widths) > available:
            widths = _reduce(sum(widths) - available, [1] * len(widths), widths, widths)
        widths = [w or 0 for w in (measure(w)[i] for i, w in enumerate(widths))]
    if sum(widths) > available or min(widths) < 3:
        return None
    return widths


def _reduce(total: int, ratios: list[int], maximums: list[int], values: list[int]) -> list[int]:
    """Take ``total`` off ``values`` in proportion to ``ratios``, at most ``maximums`` each (rich's rounding)."""
    ratios = [r if m else 0 for r, m in zip(ratios, maximums, strict=True)]
    left_ratio = sum(ratios)
    if not left_ratio:
        return values[:]
    remaining = total
    out = []
    for r, m, v in zip(ratios, maximums, values, strict=True):
        if r and left_ratio > 0:
            cut = min(m, round(r * remaining / left_ratio))
            out.append(v - cut)
            remaining -= cut
            left_ratio -= r
        else:
            out.append(v)
    return out


def _collapse(widths: list[int], wrapable: list[bool], available: int) -> list[int]:
    """Narrow the widest wrapping columns toward the next widest until the table fits (rich's rule)."""
    excess = sum(widths) - available
    if not any(wrapable):
        return widths
    while sum(widths) and excess > 0:
        widest = max(w for w, ok in zip(widths, wrapable, strict=True) if ok)
        second = max(w if ok and w != widest else 0 for w, ok in zip(widths, wrapable, strict=True))
        ratios = [1 if w == widest and ok else 0 for w, ok in zip(widths, wrapable, strict=True)]
        if not any(ratios) or not widest - second:
            break
        widths = _reduce(excess, ratios, [min(excess, widest - second)] * len(widths), widths)
        excess = sum(widths) - available
    return widths


def wrap(text: str, width: int, fold: bool) -> list[str]:
    """Printable ASCII ``text`` cut into lines of exactly ``width`` characters, as rich's ``Text.wrap`` cuts and
    pads it (left-justified; a word longer than the width folded when ``fold``, else cropped)."""
    if len(text) <= width:
        return [text + " " * (width - len(text))]
    if text[0] != " " and max(map(len, text.split())) <= width:
        return _fit(_wrap_words(text, width), width)
    breaks = []
    offset = 0
    for m in _WORD.finditer(text):
        start, word = m.start(), m.group()
        length = len(word.rstrip())
        if width - offset >= length:
            offset += len(word)
        elif length > width:
            if fold:
                pieces = [word[i:i + width] for i in range(0, len(word), width)]
                for piece in pieces[:-1]:
                    if start:
                        breaks.append(start)
                    start += len(piece)
                if start:
                    breaks.append(start)
                offset = len(pieces[-1])
            else:
                if start:
                    breaks.append(start)
                offset = len(word)
        elif offset and start:
            breaks.append(start)
            offset = len(word)
    return _fit([text[a:b] for a, b in zip([0, *breaks], [*breaks, len(text)], strict=True)], width)


def _wrap_words(text: str, width: int) -> list[str]:
    """The same cut, for text with no leading space and no word longer than the width (a finding's message): each
    line runs from a word's start to the start of the first word that does not end within the width."""
    lines = []
    p, n = 0, len(text)
    while p + width < n:
        q = p + width
        if text[q] == " ":
            while q < n and text[q] == " ":
                q += 1
            if q == n:
                break
        else:
            q = text.rfind(" ", p, q) + 1
        lines.append(text[p:q])
        p = q
    lines.append(text[p:])
    return lines


def _fit(lines: list[str], width: int) -> list[str]:
    """Each line as rich finishes it: whitespace past the width dropped, then cropped or padded to the width."""
    out = []
    for line in lines:
        if len(line) > width:
            spaces = len(line) - len(line.rstrip())
            line = line[: len(line) - min(spaces, len(line) - width)]
        out.append(line[:width] + " " * (width - len(line)))
    return out


def wrap_line(text: str, width: int) -> list[str] | None:
    """The lines rich prints printable ASCII ``text`` as, wider than ``width`` (``Console.print`` of a plain
    ``Text``: cut as :func:`wrap` cuts it, whitespace past the width dropped, no padding), or ``None`` where the
    text starts with a space or holds a word longer than the width (rich folds those: :func:`wrap` does)."""
    if not text or text[0] == " " or max(map(len, text.split())) > width:
        return None
    out = []
    for line in _wrap_words(text, width):
        if len(line) > width:
            spaces = len(line) - len(line.rstrip())
            line = line[: len(line) - min(spaces, len(line) - width)]
        out.append(line)
    return out

