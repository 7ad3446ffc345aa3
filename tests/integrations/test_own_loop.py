"""docs/integrations/own-loop.md's example runs as written: docs/examples/own_loop.py, a plain loop saving with its
own exporter under a Guard, passes every checkpoint of a healthy run and quarantines the first bf16-rounded save,
stopping training there (exit 1)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "own_loop.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("own_loop_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_documented_commands_are_the_examples() -> None:
    page = (ROOT / "docs" / "integrations" / "own-loop.md").read_text()
    assert ".venv/bin/python docs/examples/own_loop.py --out own-loop-run" in page
    assert ".venv/bin/python docs/examples/own_loop.py --out own-loop-bad --bad-from 4" in page
    assert "own-loop.md" in (ROOT / "docs" / "integrations" / "index.md").read_text()


def test_a_healthy_run_passes_every_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "own-loop-run"
    assert _example().main(["--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([f"step-{s}.pt{end}" for s in (2, 4, 6, 8) for end in ("", ".ckptaudit.json", ".passport.json")])
    # each passing checkpoint's passport (written by the guard, digest-only) verifies against its bytes
    from ckptaudit.passport import verify

    assert all(verify(str(out / f"step-{s}.pt")).ok for s in (2, 4, 6, 8))
    report = json.loads((out / "step-8.pt.ckptaudit.json").read_text())
    assert report["counts"]["error"] == 0 and report["contract"]["source"] == "live"
    assert capsys.readouterr().out.count(": passed: resumable") == 4


def test_a_rounded_save_is_quarantined_and_stops_training(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "own-loop-bad"
    assert _example().main(["--out", str(out), "--bad-from", "4"]) == 1
    # the failing checkpoint gets no passport: only step 2, which passed
    assert sorted(p.name for p in out.iterdir()) == ["step-2.pt", "step-2.pt.ckptaudit.json", "step-2.pt.passport.json",
                                                     "step-4.pt.quarantined", "step-4.pt.quarantined.ckptaudit.json"]
    err = capsys.readouterr().err
    assert "step-4.pt (step 4): precision.bf16-rounded -> quarantined to" in err
