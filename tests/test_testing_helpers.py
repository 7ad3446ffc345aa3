"""ckptaudit.testing: assertions that fail with the findings as the message (what pytest and CI show)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptaudit.testing import assert_checkpoint_ok, assert_resumes_faithfully
from test_api import trained


def test_assert_checkpoint_ok_passes_a_good_checkpoint_and_names_each_finding_of_a_bad_one(tmp_path: Path) -> None:
    report = assert_checkpoint_ok(trained(tmp_path / "good.pt"))
    assert report.ok and not report.quick
    with pytest.raises(AssertionError) as info:
        assert_checkpoint_ok(trained(tmp_path / "bad.pt", rounded=True))
    text = str(info.value)
    assert text.startswith("checkpoint audit failed (fail_on=error):\n")
    assert "error precision.bf16-rounded model/0.weight: model/0.weight: float32 parameter whose" in text
    assert text.count("\n  error precision.bf16-rounded ") == 4  # one line per rounded parameter
    with pytest.raises(AssertionError, match=r"component\.missing scheduler"):
        assert_checkpoint_ok(tmp_path / "good.pt", require="scheduler")


@pytest.mark.dist
def test_assert_resumes_faithfully_runs_the_resume_test(tmp_path: Path) -> None:
    recipe = "ckptaudit.recipes.tinygpt:recipe"
    with pytest.raises(AssertionError) as info:
        assert_resumes_faithfully(recipe, "ckptaudit.exporters:compute_copy", save_at=2, steps=2,
                                  workdir=str(tmp_path / "drift"))
    text = str(info.value)
    assert "\n  error resume.drift " in text and "parameters deviate from the uninterrupted run" in text
    report = assert_resumes_faithfully(recipe, "ckptaudit.exporters:documented", save_at=2, steps=2,
                                       workdir=str(tmp_path / "faithful"))
    assert report.ok


def test_assert_resumes_faithfully_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="unknown option\\(s\\) 'save_after'; the options are: nproc, save_at"):
        assert_resumes_faithfully("a:b", "c:d", save_after=3)
    with pytest.raises(ValueError, match="exporter='compute_copy' is not valid; pass 'module:attr'"):
        assert_resumes_faithfully("ckptaudit.recipes.tinygpt:recipe", "compute_copy")
