"""``repr(ckptaudit.Report)`` is one short line (command, verdict, counts, path), whatever the checkpoint's size:
it is what a notebook, a debugger and a log line show. The whole report stays on ``Report.raw``.

Run: ``.venv/bin/python -m pytest -q tests/report/test_report_repr.py``
"""

from __future__ import annotations

from pathlib import Path

import ckptaudit


def test_repr_is_one_line_with_the_verdict_counts_and_path(tmp_path: Path) -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(64, generator=g) for i in range(2000)}
    state["layers.0.weight"] = state["layers.0.weight"].to(torch.bfloat16).float()  # one rounded parameter
    path = tmp_path / "odd\nname.pt"
    torch.save({"model": state}, path)

    report = ckptaudit.audit(path)
    text = repr(report)
    errors = sum(f.severity.label == "error" for f in report.findings)
    warnings = sum(f.severity.label == "warning" for f in report.findings)
    assert errors >= 2 and warnings >= 1  # the rounded parameter, no optimizer; no scheduler...
    assert "\n" not in text and len(text) < 300, text
    assert text.startswith("Report(command='audit', ok=False, fail_on='error', ")
    assert f"errors={errors}, warnings={warnings}, " in text and "tensors=2000, " in text
    assert text.endswith(f"path={str(path)!r})")

    relaxed = ckptaudit.audit(path, ignore="component,precision", quick=True)
    assert repr(relaxed).startswith("Report(command='audit', ok=True, quick=True, ")
    assert "errors=0, " in repr(relaxed) and f"ignored={len(relaxed.findings)}, " in repr(relaxed)
