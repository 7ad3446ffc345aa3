"""The demo's sample output and stated duration as the README and docs/demo.md show them: ``test_docs.py`` holds
the two pages to each other, ``test_install.py`` holds them to a real run of the demo from the installed wheel."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

DEMO_PAGES = (ROOT / "README.md", DOCS / "demo.md")
_VOLATILE = re.compile(r"\b[0-9a-f]{8}\b|\d+\.\d+e[+-]\d+|\d+\.\d+%|\(\d+ s\)")
"""Hashes of the run's tensors, deviations, loss differences (what another CPU's kernels may change) and the
demo's time."""


def demo_sample(page: Path) -> str:
    """The abridged demo output a page shows: the code block after "ends like this"."""
    text = page.read_text()
    start = text.index("```\n", text.index("ends like this")) + 4
    return text[start:text.index("```\n", start)]


def stated_demo_seconds(page: Path) -> int:
    return int(re.search(r"takes about (\d+) s on 2 quiet cores", re.sub(r"\s+", " ", page.read_text()))[1])


def _norm(line: str) -> str:
    line = _VOLATILE.sub("<n>", line.replace("│", "|").replace("┃", "|"))
    return re.sub(r"\s+", " ", line).strip()


def _cells_in_row(cells: list[str], row: list[str]) -> bool:
    """The sample row's cells appear in the real row in order (columns may be left out); a cell ending in "..."
    is abridged: a prefix of the real cell."""
    it = iter(row)
    for cell in cells:
        want = cell.removesuffix("...").rstrip()
        if not any(real == cell or (cell.endswith("...") and real.startswith(want)) for real in it):
            return False
    return True


def demo_sample_differences(sample: str, real: str) -> list[str]:
    """The lines of a page's abridged demo output that the real run does not bear out: a section header that is
    not in the real output verbatim, a table row whose cells are not a real row's (in order), any other line that
    does not begin a real line (a docs line wrapped in two is joined first). Volatile numbers are masked."""
    real_lines = [_norm(line) for line in real.splitlines() if line.strip()]
    rows = [[c.strip() for c in line.split("|")] for line in real_lines if "|" in line]
    lines = [_norm(line) for line in sample.splitlines() if line.strip()]
    wrong = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("==="):
            ok = line in real_lines
        elif " | " in line:
            ok = any(_cells_in_row([c.strip() for c in line.split("|")], row) for row in rows)
        else:
            joined = f"{line} {lines[i + 1]}" if i + 1 < len(lines) else None
            if joined and any(r.startswith(joined) for r in real_lines):
                ok, i = True, i + 1
            else:
                ok = any(r.startswith(line) for r in real_lines)
        if not ok:
            wrong.append(line)
        i += 1
    return wrong


