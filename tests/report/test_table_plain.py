"""The table report drawn without rich (``ckptaudit.report.plain``) for output that is no terminal: what the user
sees must be what rich draws, character for character, on real reports (findings grouped and not, an acknowledged
finding, hostile names, verbose tensor tables, several widths) and on random tables; and where it cannot draw a
report exactly it says so, and rich draws it.

Run: ``.venv/bin/python -m pytest -q tests/report/test_table_plain.py``
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console
from rich.table import Table

from ckptaudit.auditing.judge import AuditOptions, run_audit
from ckptaudit.findings import RawReport
from ckptaudit.report import plain as plain_module
from ckptaudit.report import table as table_module
from ckptaudit.report.plain import Grid, draw
from ckptaudit.report.table import _column, print_table, render_table


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RawReport]:
    """Real reports: a model and its AdamW state with some parameters rounded to bf16 (grouped findings), the
    same with one finding acknowledged, names with rich markup in them, and a clean-ish model alone."""
    import torch

    tmp = tmp_path_factory.mktemp("plain")
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8, generator=g)).sum().backward()
    opt.step()
    sd = {k: (v.bfloat16().float() if i % 3 == 0 else v) for i, (k, v) in enumerate(model.state_dict().items())}
    torch.save({"model": sd, "optimizer": opt.state_dict()}, tmp / "rounded.pt")
    torch.save({"model": {"[/]x[bold]:smile:": torch.randn(4, generator=g), "w": torch.randn(4, generator=g)}},
               tmp / "markup.pt")
    torch.save({"model": model.state_dict()}, tmp / "model.pt")
    return {"rounded": run_audit(str(tmp / "rounded.pt")),
            "ignored": run_audit(str(tmp / "rounded.pt"), AuditOptions(ignore=("component.missing",))),
            "markup": run_audit(str(tmp / "markup.pt")),
            "model": run_audit(str(tmp / "model.pt"))}


def _by_rich(report: RawReport, verbose: bool, monkeypatch: pytest.MonkeyPatch) -> str:
    with monkeypatch.context() as m:
        m.setattr(table_module, "plain_output", lambda out: False)
        out = io.StringIO()
        render_table(report, out, verbose=verbose)
        return out.getvalue()


@pytest.mark.parametrize("columns", [None, "100", "200", "60"])
@pytest.mark.parametrize("verbose", [False, True])
def test_a_real_report_drawn_plain_is_the_report_rich_draws(reports: dict[str, RawReport], columns: str | None,
                                                            verbose: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    drawn = 0
    for name, report in reports.items():
        out = io.StringIO()
        render_table(report, out, verbose=verbose)
        assert out.getvalue() == _by_rich(report, verbose, monkeypatch), name
        width = table_module.width_for(out) or table_module.PIPE_WIDTH
        drawn += draw(table_module._blocks(report, verbose), width) is not None
    if columns in (None, "200"):  # the comparison would hold trivially if rich drew everything
        assert drawn == len(reports)


def test_what_it_cannot_draw_exactly_rich_draws(reports: dict[str, RawReport]) -> None:
    blocks = table_module._blocks(reports["rounded"], False)
    assert draw(blocks, 140) is not None
    assert draw(blocks, 30) is None  # lines longer than the width: rich wraps them
    wide = [Grid("tensors", [("name", {"overflow": "fold"})], [("漢字",)])]
    assert draw(wide, 140) is None  # wide characters
    many = [Grid("tensors", [("name", {"overflow": "fold"})], [("x",)] * (plain_module.MAX_ROWS + 1))]
    assert draw(many, 140) is None  # long tables are streamed by the table renderer


def test_a_terminal_or_forced_colour_is_drawn_by_rich(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert plain_module.plain_output(io.StringIO())
    assert not plain_module.plain_output(Tty())
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert not plain_module.plain_output(io.StringIO())


_WORDS = ["model", "layers.0.experts.12.w0", "x", "a-long-tensor-name-that-goes-on-and-on-and-on-and-on", "float32",
          "[4, 16]", "", " lead", "trail  ", "[/]x[bold]:smile:"]
_OPTIONS = [{"overflow": "fold"}, {"no_wrap": True}, {"overflow": "fold", "min_width": 10}, {}, {"overflow": "crop"},
            {"overflow": "fold", "ratio": 3}]
_HEADERS = ["name", "role", "dtype", "severity", "a header of several words", "effective"]
_cell = st.one_of(st.lists(st.sampled_from(_WORDS), max_size=7).map(" ".join), st.text(alphabet="ab -.", max_size=40))


@st.composite
def _grids(draw_: st.DrawFn) -> tuple[list[tuple[str, dict]], list[tuple[str, ...]], int]:
    n = draw_(st.integers(1, 6))
    columns = [(draw_(st.sampled_from(_HEADERS)), dict(draw_(st.sampled_from(_OPTIONS)))) for _ in range(n)]
    rows = draw_(st.lists(st.tuples(*[_cell] * n), min_size=1, max_size=8))
    return columns, rows, draw_(st.integers(8, 200))


@settings(max_examples=300, deadline=None)
@given(_grids())
def test_a_random_table_drawn_plain_is_the_table_rich_draws(grid: tuple[list[tuple[str, dict]], list, int]) -> None:
    columns, rows, width = grid
    got = draw([Grid("tensors", columns, rows)], width)
    if got is None:
        return
    out = io.StringIO()
    t = Table(title="tensors", title_justify="left", show_edge=False)
    for header, options in columns:
        _column(t, header, **options)
    print_table(Console(file=out, width=width, highlight=False, soft_wrap=False, markup=False, emoji=False), t, rows,
                stream_above=1 << 30)
    assert got == out.getvalue()


def test_usual_tables_are_drawn_plain() -> None:
    """The random comparison above would hold trivially if every table were left to rich."""
    columns = [("severity", {"no_wrap": True}), ("code", {"no_wrap": True}), ("subject", {"overflow": "fold"}),
               ("message", {"overflow": "fold", "ratio": 3})]
    rows = [("error", "precision.bf16-rounded", "model/" + "layers.0.experts.12.w0" * 3,
             "every value is bf16-representable: the low mantissa bits were lost " * 3)] * 3
    for width in (80, 140):
        assert draw([Grid("findings", columns, rows)], width) is not None


def test_the_plain_drawing_of_a_file_keeps_its_path(tmp_path: Path, reports: dict[str, RawReport]) -> None:
    """Writing to a real file (the CLI's ``--output``) goes the plain way too, with the same text."""
    path = tmp_path / "report.txt"
    with open(path, "w", encoding="utf-8") as fh:
        render_table(reports["rounded"], fh)
    out = io.StringIO()
    render_table(reports["rounded"], out)
    assert path.read_text(encoding="utf-8") == out.getvalue()
