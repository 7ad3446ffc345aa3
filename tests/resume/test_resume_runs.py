"""The resume experiments that each run on their own (no shared fixture): borrowed state, the CLI's exit code and
frames, a world-size change, the low-precision recipe, the demo. Apart from tests/resume/test_resume.py (the shared
experiments and their readings) so that a parallel run (pytest-xdist, whole files per worker) can run the two files
side by side: together they were the suite's longest file.

Run: ``.venv/bin/python -m pytest -q tests/resume/test_resume_runs.py``
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from ckptaudit.cli import main
from ckptaudit.resume import COMPONENTS, ResumeConfig, run_resume_test

from .test_resume import RESUME_SRC, USER, candidate, subjects

pytestmark = pytest.mark.dist


def test_borrowed_state_is_the_explicit_experiment(tmp_path: Path) -> None:
    cfg = ResumeConfig(exporters=(f"{USER}:partial",), save_at=2, steps=2, borrow_state=True, nproc=1)
    report = run_resume_test(cfg)
    c = report.extra["resume"]["candidates"][0]
    assert c["verdict"] == "faithful" and max(c["rel_l2"]) == 0.0
    assert c["restore"]["rng"]["status"] == "borrowed" and c["restore"]["data position"]["status"] == "borrowed"
    assert not subjects(report, "resume.not-restored")
    borrowed = [f for f in report.findings if f.code == "resume.state-borrowed"]
    assert len(borrowed) == 1 and "rng" in borrowed[0].message and "data position" in borrowed[0].message
    assert "borrowed" in report.extra["sections"][0]["title"]


def test_cli_exporter_failure_exits_1_with_frames_and_debug_shows_all(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = main(["resume-test", "--exporter", f"{USER}:full_disk", "--exporter", "ckptaudit.exporters:documented",
                 "--nproc", "1", "--save-at", "2", "--steps", "2", "--format", "json", "--debug", "--no-progress"],
                stdout=out, stderr=err)
    assert code == 1, err.getvalue()
    doc = json.loads(out.getvalue())
    verdicts = {c["exporter"].rpartition(":")[2]: c["verdict"] for c in doc["resume"]["candidates"]}
    assert verdicts == {"full_disk": "failed", "documented": "faithful"}
    failed = next(f for f in doc["findings"] if f["code"] == "resume.candidate-failed")
    assert RESUME_SRC in failed["message"]  # --debug: every frame, ckptaudit's too


# ----------------------------------------------------------------------------------------------------------------
# Across a world-size change


@pytest.mark.parametrize("resume_nproc", [1, 4])
def test_resume_on_another_world_size(resume_nproc: int) -> None:
    cfg = ResumeConfig(exporters=("ckptaudit.exporters:compute_copy", "ckptaudit.exporters:documented"),
                       nproc=2, resume_nproc=resume_nproc, save_at=2, steps=2)
    report = run_resume_test(cfg)
    doc = report.extra["resume"]
    assert (doc["nproc"], doc["resume_nproc"]) == (2, resume_nproc) and doc["power"]
    assert doc["floor"][0] == 0.0  # DCP reshards exactly; the steps differ by reduction order only
    assert candidate(report, "documented")["verdict"] == "faithful"
    assert all(candidate(report, "documented")["restore"][k]["status"] == "restored" for k in COMPONENTS)
    assert candidate(report, "compute_copy")["verdict"] == "drift"
    assert f"resumed on {resume_nproc}" in report.extra["sections"][0]["title"]


# ----------------------------------------------------------------------------------------------------------------
# A recipe of its own, and the demo


def test_low_precision_master_recipe_resumes_faithfully_through_its_own_checkpoint(tmp_path: Path) -> None:
    cfg = ResumeConfig(recipe="ckptaudit.recipes.tinygpt:low_precision_recipe",
                       exporters=("ckptaudit.exporters:documented",), save_at=3, steps=3, workdir=str(tmp_path))
    report = run_resume_test(cfg)
    assert report.findings == ()
    assert candidate(report, "documented")["rel_l2"] == [0.0] * 4
    assert "one ulp" in report.extra["resume"]["control"]["what"]  # the masters are bf16 already


def test_demo_tells_the_whole_story(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = main(["demo", "--out", str(tmp_path / "demo"), "--steps", "4"], stdout=out, stderr=err)
    text = out.getvalue()
    assert code == 0, text + err.getvalue()
    assert "precision.bf16-rounded" in text and "DRIFT" in text and "bit-identical" in text
    assert (tmp_path / "demo" / "report.html").read_text().count("<svg") == 2
