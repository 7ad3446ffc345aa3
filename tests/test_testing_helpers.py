"""ckptaudit.testing: assertions that fail with the findings as the message (what pytest and CI show), each failure
its own ``AssertionError`` subclass carrying the report, so a test can assert the right failure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ckptaudit.api import Report
from ckptaudit.catalogue import finding
from ckptaudit.findings import RawReport
from ckptaudit.testing import (
    AuditFailed,
    CheckFailed,
    CheckpointDrift,
    ExporterFailed,
    IncompleteRestore,
    NoPower,
    ReferenceNotReproducible,
    ResumeFailed,
    _resume_failure,
    assert_checkpoint_ok,
    assert_resumes_faithfully,
)
from real_checkpoints import trained
from runs import SUPPORT

USER = str(SUPPORT / "resume_user_code.py")


def test_assert_checkpoint_ok_passes_a_good_checkpoint_and_names_each_finding_of_a_bad_one(tmp_path: Path) -> None:
    report = assert_checkpoint_ok(trained(tmp_path / "good.pt"))
    assert report.ok and not report.quick
    with pytest.raises(AuditFailed) as info:
        assert_checkpoint_ok(trained(tmp_path / "bad.pt", rounded=True))
    text = str(info.value)
    assert isinstance(info.value, AssertionError) and isinstance(info.value, CheckFailed)
    assert not info.value.report.ok and "precision.bf16-rounded" in {f.code for f in info.value.report.failing}
    assert text.startswith("checkpoint audit failed (fail_on=error):\n")
    assert "error precision.bf16-rounded model/0.weight: model/0.weight: float32 parameter whose" in text
    assert text.count("\n  error precision.bf16-rounded ") == 4  # one line per rounded parameter
    with pytest.raises(AssertionError, match=r"component\.missing scheduler"):
        assert_checkpoint_ok(tmp_path / "good.pt", require="scheduler")


@pytest.mark.dist
def test_assert_resumes_faithfully_raises_drift_for_a_drifting_exporter(tmp_path: Path) -> None:
    recipe = "ckptaudit.recipes.tinygpt:recipe"
    with pytest.raises(CheckpointDrift) as info:
        assert_resumes_faithfully(recipe, "ckptaudit.exporters:compute_copy", nproc=1, save_at=2, steps=2,
                                  workdir=str(tmp_path / "drift"))
    text = str(info.value)
    assert "\n  error resume.drift " in text and "parameters deviate from the uninterrupted run" in text
    assert info.value.report.raw.extra["resume"]["candidates"][0]["verdict"] == "drift"
    report = assert_resumes_faithfully(recipe, "ckptaudit.exporters:documented", nproc=1, save_at=2, steps=2,
                                       workdir=str(tmp_path / "faithful"))
    assert report.ok


@pytest.mark.dist
def test_an_exporter_that_cannot_write_is_exporter_failed_not_drift() -> None:
    with pytest.raises(ExporterFailed) as info:
        assert_resumes_faithfully("ckptaudit.recipes.tinygpt:recipe", f"{USER}:full_disk", nproc=1, save_at=1,
                                  steps=1)
    assert not isinstance(info.value, CheckpointDrift)
    assert "No space left on device" in str(info.value)
    assert [f.code for f in info.value.report.failing] == ["resume.candidate-failed"]


def _resume_report(verdict: str, *codes: str) -> Report:
    findings = tuple(finding(code, "x", "m") for code in codes)
    raw = RawReport(command="resume-test", path="r", format="resume-test", findings=findings,
                    extra={"resume": {"candidates": [{"exporter": "e:x", "verdict": verdict}]}})
    return Report(raw)


@pytest.mark.parametrize(("verdict", "codes", "expected"), [
    ("drift", ("resume.drift", "resume.restored-differs"), CheckpointDrift),
    ("incomplete", ("resume.not-restored",), IncompleteRestore),
    ("failed", ("resume.candidate-failed",), ExporterFailed),
    ("not judged", ("resume.no-power",), NoPower),
    ("not judged", ("resume.reference-not-reproducible", "resume.no-power"), ReferenceNotReproducible),
    ("faithful", ("optimizer.misattached",), ResumeFailed),
])
def test_each_resume_failure_has_its_exception(verdict: str, codes: tuple[str, ...], expected: Any) -> None:
    assert _resume_failure(_resume_report(verdict, *codes)) is expected
    assert issubclass(expected, AssertionError) and issubclass(expected, CheckFailed)


def test_assert_resumes_faithfully_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="unknown option\\(s\\) 'save_after'; the options are: nproc, save_at"):
        assert_resumes_faithfully("a:b", "c:d", save_after=3)
    with pytest.raises(ValueError, match="exporter='compute_copy' is not valid; pass 'module:attr'"):
        assert_resumes_faithfully("ckptaudit.recipes.tinygpt:recipe", "compute_copy")
