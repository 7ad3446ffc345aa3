"""Long tables are streamed (``ckptaudit.report.table.print_table``): laid out by rich's rules from one pass over
the cells and written in batches, so that ``audit --verbose`` of 100k tensors prints in seconds and a closed pipe
stops the work. What the user sees must not change: the streamed table is held to rich's own drawing of the same
table, character for character, on random tables (widths that force wrapping, folding, cropping, wide
characters, styles on a colour terminal) and on the tables of a real report.

Run: ``.venv/bin/python -m pytest -q tests/report/test_table_stream.py``
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ckptaudit.auditing.judge import run_audit
from ckptaudit.cli import main
from ckptaudit.report import layout as layout_module
from ckptaudit.report import table as table_module
from ckptaudit.report.layout import layout as _layout
from ckptaudit.report.table import _column, print_table, render_table

ROOT = Path(__file__).resolve().parents[2]


def _console(out: io.StringIO, width: int, color: bool) -> Console:
    if color:
        return Console(file=out, width=width, highlight=False, soft_wrap=False, markup=False, emoji=False,
                       force_terminal=True, color_system="truecolor")
    return Console(file=out, width=width, highlight=False, soft_wrap=False, markup=False, emoji=False)


def _table(columns: list[tuple[str, dict[str, Any]]]) -> Table:
    t = Table(title="tensors", title_justify="left", show_edge=False)
    for header, options in columns:
        _column(t, header, **options)
    return t


def _drawn(columns: list[tuple[str, dict[str, Any]]], rows: list[tuple[Any, ...]], width: int, *, stream: bool,
           color: bool = False) -> str:
    out = io.StringIO()
    print_table(_console(out, width, color), _table(columns), rows, stream_above=0 if stream else 1 << 30)
    return out.getvalue()


_WORDS = ["model", "layers.0.experts.12.w0", "x", "a-long-tensor-name-that-goes-on-and-on-and-on-and-on", "float32",
          "[4, 16]", "", " lead", "trail  ", "é", "漢字", "e\u0301", "a\nb"]
_OPTIONS: list[dict[str, Any]] = [{"overflow": "fold"}, {"no_wrap": True}, {"overflow": "fold", "min_width": 10}, {},
                                  {"overflow": "crop"}]
_HEADERS = ["name", "role", "dtype", "max rel. L2 dev.", "a header of several words", "effective"]

_cell = st.one_of(
    st.lists(st.sampled_from(_WORDS), max_size=7).map(" ".join),
    st.text(alphabet="ab -.é漢", max_size=40),
    st.sampled_from([Text("error", style="bold red"), Text("warning (ignored)", style="dim"),
                     Text("MISSING", style="red")]),
)


@st.composite
def _tables(draw: st.DrawFn) -> tuple[list[tuple[str, dict[str, Any]]], list[tuple[Any, ...]], int]:
    n = draw(st.integers(1, 6))
    columns = [(draw(st.sampled_from(_HEADERS)), draw(st.sampled_from(_OPTIONS))) for _ in range(n)]
    rows = draw(st.lists(st.tuples(*[_cell] * n), min_size=1, max_size=8))
    return columns, rows, draw(st.integers(8, 200))


@settings(max_examples=300, deadline=None)
@given(_tables(), st.booleans())
def test_a_streamed_table_is_the_table_rich_draws(table: Any, color: bool) -> None:
    columns, rows, width = table
    assert _drawn(columns, rows, width, stream=True, color=color) == _drawn(columns, rows, width, stream=False,
                                                                              color=color)


def test_tables_that_wrap_and_fold_are_streamed_not_handed_back_to_rich() -> None:
    """The comparison above would hold trivially if every table fell back to rich: the usual shapes are laid out
    here (a message wrapped over lines, a name folded, a colour terminal)."""
    columns = [("severity", {"no_wrap": True}), ("code", {"no_wrap": True}), ("subject", {"overflow": "fold"}),
               ("message", {"overflow": "fold"})]
    rows = [(Text("error", style="bold red"), "precision.bf16-rounded", "model/" + "layers.0.experts.12.w0" * 3,
             "every value is bf16-representable: the low mantissa bits were lost " * 3)] * 3
    for width in (60, 80, 140):
        assert _layout(_console(io.StringIO(), width, False), _table(columns), rows) is not None
        drawn = _drawn(columns, rows, width, stream=True)
        assert len(drawn.splitlines()) > 3 * 3  # wrapped
        assert drawn == _drawn(columns, rows, width, stream=False)
        assert _drawn(columns, rows, width, stream=True, color=True) == _drawn(columns, rows, width, stream=False,
                                                                               color=True)


@pytest.fixture(scope="module")
def many_tensors(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real ``torch.save`` checkpoint of 600 small parameters, every other one rounded to bf16 (a finding each,
    with a long message), one name with wide characters."""
    import torch

    g = torch.Generator().manual_seed(0)
    state = {}
    for i in range(600):
        t = torch.randn(16 + i % 3 * 24, generator=g)
        state[f"layers.{i // 8}.experts.{i % 8}.w{'漢' if i == 7 else ''}"] = (
            t.to(torch.bfloat16).float() if i % 2 else t)
    path = tmp_path_factory.mktemp("many") / "many.pt"
    torch.save({"model": state}, path)
    return path


@pytest.mark.parametrize("columns", [None, "80", "200"])
def test_a_real_reports_long_tables_look_as_rich_draws_them(many_tensors: Path, columns: str | None,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    report = run_audit(str(many_tensors))
    assert sum(f.code == "precision.bf16-rounded" for f in report.findings) == 300
    drawn = {}
    for above in (table_module.STREAM_ABOVE, 1 << 30):
        monkeypatch.setattr(table_module, "STREAM_ABOVE", above)
        out = io.StringIO()
        render_table(report, out, verbose=True)
        drawn[above] = out.getvalue()
    streamed, by_rich = drawn.values()
    assert streamed == by_rich
    assert streamed.count("precision.bf16-rounded") == 300 and "漢" in streamed


class _ClosedPipe(io.StringIO):
    """A stdout whose reader has gone: every write fails, as a pipe's does after ``head`` exits."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize("fmt", ["table", "json", "html"])
def test_a_closed_pipe_stops_the_output_and_keeps_the_verdicts_exit_code(many_tensors: Path, fmt: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The renderer stops at the first write that fails (no rows formatted for nobody), the exit code is the
    verdict's, and nothing is printed on stderr."""
    formatted = []
    cell_lines = table_module._cell_lines
    monkeypatch.setattr(table_module, "_cell_lines", lambda *a: formatted.append(1) or cell_lines(*a))
    expected = main(["audit", str(many_tensors), "--format", fmt, "--verbose"], stdout=io.StringIO(),
                    stderr=io.StringIO())
    assert expected == 1
    if fmt == "table":
        assert len(formatted) > 900 * 4  # the cells of the tensors and findings tables
    formatted.clear()
    pipe, err = _ClosedPipe(), io.StringIO()
    assert main(["audit", str(many_tensors), "--format", fmt, "--verbose"], stdout=pipe, stderr=err) == expected
    assert (pipe.writes, err.getvalue(), formatted) == (1, "", [])


def test_verbose_output_into_a_pipe_closed_early_exits_quietly(many_tensors: Path) -> None:
    """``ckptaudit audit CKPT --verbose | head -5`` as a shell runs it: five lines, the verdict's exit code, no
    traceback."""
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen([sys.executable, "-m", "ckptaudit", "audit", str(many_tensors), "--verbose"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    head = [proc.stdout.readline() for _ in range(5)]
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1, err
    assert err == b"" and head[0].startswith(b"ckptaudit audit: ")


def test_json_of_a_streamed_report_is_unchanged(many_tensors: Path) -> None:
    """(The JSON renderer does not go through the table: the same document with or without --verbose.)"""
    docs = []
    for extra in ([], ["--verbose"]):
        out = io.StringIO()
        main(["audit", str(many_tensors), "--format", "json", *extra], stdout=out, stderr=io.StringIO())
        docs.append(json.loads(out.getvalue()))
    assert docs[0] == docs[1] and len(docs[0]["tensors"]) == 600


@settings(max_examples=1500, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab.-  ")), max_size=90), st.integers(1, 30), st.booleans())
def test_plain_text_wraps_as_rich_wraps_it(text: str, width: int, fold: bool) -> None:
    """The plain-text cut (with its fast path for a message whose words all fit) is rich's ``Text.wrap``, line for
    line, on text dense in the cases that matter: runs of spaces, a space at a line's edge, words at the width."""
    con = _console(io.StringIO(), 200, False)
    overflow = "fold" if fold else "crop"
    expected = [line.plain for line in Text(text).wrap(con, width, justify="left", overflow=overflow)]
    expected = [line + " " * (width - len(line)) for line in expected]
    assert layout_module.wrap(text, width, fold) == expected
