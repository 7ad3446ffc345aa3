"""The differential resume test on real multi-process runs of the built-in recipe (FSDP2, bf16 compute)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.cli import main
from ckptaudit.formats.torchload import safe_torch_load
from ckptaudit.model import Report
from ckptaudit.report import OutputFormat, render
from ckptaudit.resume import ResumeConfig, run_resume_test

pytestmark = pytest.mark.dist

EXPORTERS = ("ckptaudit.exporters:compute_copy", "ckptaudit.exporters:swapped_moments",
             "ckptaudit.exporters:documented")


@pytest.fixture(scope="module")
def experiment(tmp_path_factory: pytest.TempPathFactory) -> tuple[Report, Path]:
    work = tmp_path_factory.mktemp("resume")
    cfg = ResumeConfig(exporters=EXPORTERS, save_at=4, steps=4, workdir=str(work))
    return run_resume_test(cfg), work


def candidate(report: Report, attr: str) -> dict[str, Any]:
    return next(c for c in report.extra["resume"]["candidates"] if c["exporter"].endswith(":" + attr))


def test_documented_path_resumes_bit_identically(experiment: tuple[Report, Path]) -> None:
    report, _ = experiment
    doc = report.extra["resume"]
    assert doc["noise_floor"] == 0.0
    assert doc["reference"]["rel_l2"] == [0.0] * 5 and doc["reference"]["loss_diff"] == [0.0] * 4
    faithful = candidate(report, "documented")
    assert faithful["verdict"] == "faithful" and max(faithful["rel_l2"]) == 0.0
    assert not any(f.subject.endswith(":documented") for f in report.findings)


def test_compute_copy_drifts_far_above_the_floor_while_the_loss_looks_normal(experiment: tuple[Report, Path]) -> None:
    report, _ = experiment
    c = candidate(report, "compute_copy")
    assert c["verdict"] == "drift" and c["drift_start"] == 0  # the rounding is there right after the restore
    assert min(c["rel_l2"]) > 1e-4  # bf16 rounding: ~1e-3 relative, a thousand times the 1e-6 threshold
    assert max(abs(d) for d in c["loss_diff"][:2]) < 0.01 * max(report.extra["resume"]["uninterrupted_loss"])
    codes = {(f.code, f.subject) for f in report.findings}
    assert ("resume.drift", EXPORTERS[0]) in codes
    assert ("resume.loss-looks-normal", EXPORTERS[0]) in codes


def test_swapped_moments_are_caught_and_named(experiment: tuple[Report, Path]) -> None:
    report, work = experiment
    c = candidate(report, "swapped_moments")
    assert c["verdict"] == "drift"
    assert c["rel_l2"][0] == 0.0  # weights are faithful: nothing differs until the first step uses the moments
    swapped = safe_torch_load(work / "candidate-1-swapped_moments")["swapped"]
    named = [p["name"] for p in c["top_parameters"][:2]]
    assert sorted(named) == sorted(swapped)
    # The offline comparison names the pair exactly.
    misattached = [f for f in report.findings if f.code == "optimizer.misattached"]
    assert len(misattached) == 1 and all(p in misattached[0].subject for p in swapped)
    assert "rounded to bf16" in candidate(report, "compute_copy")["forensics"]


def test_reports_render_as_table_json_and_html(experiment: tuple[Report, Path]) -> None:
    report, _ = experiment
    for fmt in OutputFormat:
        buf = io.StringIO()
        render(report, fmt, buf)
        assert "compute_copy" in buf.getvalue()
    html = io.StringIO()
    render(report, OutputFormat.HTML, html)
    page = html.getvalue()
    assert page.count("<svg") == 2 and "<polyline" in page and "drift threshold" in page
    assert "<script" not in page


def test_low_precision_master_recipe_resumes_faithfully_through_its_own_checkpoint(tmp_path: Path) -> None:
    cfg = ResumeConfig(recipe="ckptaudit.recipes.tinygpt:low_precision_recipe",
                       exporters=("ckptaudit.exporters:documented",), save_at=3, steps=3, workdir=str(tmp_path))
    report = run_resume_test(cfg)
    assert report.findings == ()
    assert candidate(report, "documented")["rel_l2"] == [0.0] * 4


def test_cli_usage_errors_name_the_spec(tmp_path: Path) -> None:
    err = io.StringIO()
    code = main(["resume-test", "--recipe", "no_such_module:recipe"], stdout=io.StringIO(), stderr=err)
    assert code == 2 and "cannot import module no_such_module" in err.getvalue()
    err = io.StringIO()
    code = main(["resume-test", "--exporter", "ckptaudit.exporters"], stdout=io.StringIO(), stderr=err)
    assert code == 2 and "not of the form module:attr" in err.getvalue()


def test_demo_tells_the_whole_story(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = main(["demo", "--out", str(tmp_path / "demo"), "--steps", "4"], stdout=out, stderr=err)
    text = out.getvalue()
    assert code == 0, text + err.getvalue()
    assert "precision.bf16-rounded" in text and "DRIFT" in text and "bit-identical" in text
    assert (tmp_path / "demo" / "report.html").read_text().count("<svg") == 2
