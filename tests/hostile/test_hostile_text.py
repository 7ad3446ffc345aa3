"""Names that would break the report (issue 25): every Unicode control, format or separator character in a name
from a checkpoint is shown escaped in the table and the HTML page, and kept exact in the JSON report."""

from __future__ import annotations

import html
import io
import json
import sys
import unicodedata
from pathlib import Path

import pytest

from ckptaudit.auditing.judge import run_audit
from ckptaudit.report import OutputFormat, render
from ckptaudit.report.text import clean

# One of each kind: line and paragraph separators (Zl, Zp), bidi marks and overrides (Cf: the Arabic letter
# mark, the right-to-left override, an isolate, a zero-width joiner, a language tag), C0 and C1 controls (Cc).
HOSTILE = ["\u2028", "\u2029", "\u061c", "\u202e", "\u2067", "\u200d", "\U000e0001", "\x1b", "\x85", "\r"]


def test_every_control_format_and_separator_character_is_escaped() -> None:
    escaped = {"Cc", "Cf", "Zl", "Zp", "Cs"}
    for code in range(sys.maxunicode + 1):
        ch = chr(code)
        shown = clean(f"a{ch}b")
        if unicodedata.category(ch) in escaped:
            assert ch not in shown and shown.startswith("a\\") and shown.endswith("b"), hex(code)
        else:
            assert shown == f"a{ch}b", hex(code)


@pytest.mark.parametrize("fmt", [OutputFormat.TABLE, OutputFormat.HTML])
def test_hostile_names_are_escaped_in_the_table_and_the_page(fmt: OutputFormat, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from safetensors.torch import save_file

    # fp32 holding bf16 values: listed among the odd tensors of the page too
    names = {f"layer{i}{ch}weight": torch.randn(512).to(torch.bfloat16).float() for i, ch in enumerate(HOSTILE)}
    path = tmp_path / "model.safetensors"
    save_file(names, str(path))
    report = run_audit(str(path))
    assert {t.name for t in report.tensors} == set(names)  # read exactly as the library wrote them
    monkeypatch.delenv("COLUMNS", raising=False)  # the pipe's width (pytest-xdist's workers set 80: names fold)
    out = io.StringIO()
    render(report, fmt, out, verbose=True)
    text = out.getvalue()
    for ch in HOSTILE:
        assert ch not in text, (hex(ord(ch)), fmt)
    for shown in ("\\u2028", "\\u2029", "\\u061c", "\\u202e", "\\u2067", "\\u200d", "\\U000e0001", "\\x1b", "\\x85",
                  "\\x0d"):
        assert f"{shown}weight" in text, (shown, fmt)
    js = io.StringIO()
    render(report, OutputFormat.JSON, js)
    assert {t["name"] for t in json.loads(js.getvalue())["tensors"]} == set(names)


@pytest.mark.parametrize("fmt", [OutputFormat.TABLE, OutputFormat.HTML])
def test_a_traceback_keeps_its_lines_and_escapes_what_is_inside_them(fmt: OutputFormat) -> None:
    from ckptaudit.catalogue import finding
    from ckptaudit.findings import RawReport

    # A user's exception message quoting a hostile name: the traceback's own newlines stay line breaks (below the
    # table, in the page's <pre>), every character of HOSTILE inside a line is shown escaped.
    name = "w" + "".join(HOSTILE) + "end"
    frames = f"Traceback (most recent call last):\n  File \"x.py\", line 3, in export\n    boom()\nKeyError: {name}"
    bad = RawReport(command="resume-test", path="r:recipe", format="resume-test", findings=(finding(
        "resume.candidate-failed", "x.py:export", f"export: the candidate could not be written\n{frames}",
        stage="export"),))
    out = io.StringIO()
    render(bad, fmt, out)
    text = out.getvalue()
    for ch in HOSTILE:
        assert ch not in text, (hex(ord(ch)), fmt)
    assert "\\x0a" not in text
    shown = "w" + "".join(clean(ch) for ch in HOSTILE) + "end"
    lines = [html.unescape(line).strip() for line in text.split("\n")]
    assert 'File "x.py", line 3, in export' in lines and "boom()" in lines
    assert any(f"KeyError: {shown}" in line for line in lines), (shown, fmt)


@pytest.mark.parametrize("fmt", [OutputFormat.TABLE, OutputFormat.HTML])
def test_hostile_names_are_escaped_in_grouped_rows_too(fmt: OutputFormat, tmp_path: Path) -> None:
    """Without --verbose, four or more findings of one code are one row listing their subjects: those names are
    escaped there as everywhere (every other test of hostile names renders verbose, which never groups)."""
    import torch
    from safetensors.torch import save_file

    from ckptaudit.report.table import GROUP_ABOVE, MAX_SUBJECTS

    hostile = HOSTILE[:MAX_SUBJECTS]
    assert len(hostile) > GROUP_ABOVE
    names = {f"layer{i}{ch}weight": torch.randn(512).to(torch.bfloat16).float() for i, ch in enumerate(hostile)}
    path = tmp_path / "model.safetensors"
    save_file(names, str(path))
    report = run_audit(str(path))
    rounded = [f for f in report.findings if f.code == "precision.bf16-rounded"]
    assert len(rounded) == len(hostile) > GROUP_ABOVE
    out = io.StringIO()
    render(report, fmt, out, verbose=False)
    text = out.getvalue()
    if fmt == OutputFormat.TABLE:
        assert f"{len(hostile)} subjects" in text  # grouped
    for ch in hostile:
        assert ch not in text, (hex(ord(ch)), fmt)
    assert sum(f"{clean(ch)}weight" in text for ch in hostile) == len(hostile), (fmt, text[-3000:])
