"""The lineage with the real Trainer, guard on, in a fast loop: masters rounded IN PLACE at step 6 taint every later
save, which the guard moves aside (the Trainer's own resume by name and ``ckptaudit latest`` name step 4, and say
why); an exporter that rounds only
the saved file at step 6 taints nothing (``latest`` names the newest passing save). Jobs:
``tests/support/lineage_jobs.py``.

Run: ``.venv/bin/python -m pytest -q tests/integrations/test_guard_lineage_runs.py``
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.cli import main
from ckptaudit.passport import read_passport

pytestmark = pytest.mark.libs


def _job(what: str, out: Path) -> dict[str, Any]:
    import lineage_jobs
    from runs import run_job

    return run_job(lineage_jobs.__file__, what, str(out), env=lineage_jobs.JOB_ENV, timeout_s=600)


def _latest(root: Path) -> dict[str, Any]:
    out = io.StringIO()
    assert main(["latest", str(root), "--format", "json"], stdout=out, stderr=io.StringIO()) == 0
    doc: dict[str, Any] = json.loads(out.getvalue())
    return doc


def _by_step(r: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {v["step"]: v for v in r["verdicts"]}


def test_trainer_masters_rounded_in_place_taint_every_later_save_and_latest_names_the_last_good(
        tmp_path: Path) -> None:
    r = _job("hf_state", tmp_path)
    v = _by_step(r)
    # Step 8 was saved before the verdict of step 6 (the bound), then training stopped.
    assert r["stopped_at"] == 8 and sorted(v) == [2, 4, 6, 8], r["verdicts"]
    assert [v[s]["ok"] for s in (2, 4, 6, 8)] == [True, True, False, True]
    assert v[6]["quarantined_to"] == "quarantined-checkpoint-6" and v[6]["damage"] == "state"
    assert "TRAINING STATE itself is damaged" in v[6]["advice"]
    assert "Restore checkpoint-4 (step 4)" in v[6]["advice"] and "fix the training code" in v[6]["advice"]
    assert "Restore checkpoint-4 (step 4)" in r["raised"]["message"]
    # Step 8 passes its own audit; its passport says it descends from the damage at step 6, and the guard moved it
    # aside as it moves a failure, so the Trainer's own resume by name (the newest checkpoint-N) never picks it.
    assert v[8]["damaged_ancestor"] == "checkpoint-6" and v[8]["quarantined_to"] == "quarantined-checkpoint-8"
    assert "descends from the damage at checkpoint-6" in v[8]["advice"]
    assert "Restore checkpoint-4 (step 4)" in v[8]["advice"] and "fix the training code" in v[8]["advice"]
    assert "quarantined-checkpoint-8" in r["raised"]["message"]  # the error names what was set aside
    assert v[8]["passport"] == "quarantined-checkpoint-8/ckptaudit.passport.json"
    lineage = read_passport(str(tmp_path / v[8]["passport"])).lineage
    assert lineage.state == "descends-from-damage" and lineage.damaged_ancestor is not None
    assert (lineage.damaged_ancestor.checkpoint, lineage.damaged_ancestor.verdict) == ("checkpoint-6", "fail")
    assert read_passport(str(tmp_path / v[4]["passport"])).lineage.state == "clean"
    from transformers.trainer_utils import get_last_checkpoint

    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-4")  # resume_from_checkpoint=True's
    doc = _latest(tmp_path)
    assert doc["latest"] == str(tmp_path / "checkpoint-4"), doc["summary"]
    (why,) = [f for f in doc["findings"] if f["subject"] == "quarantined-checkpoint-8"]
    assert why["code"] == "guard.quarantined" and "descends from the damage at checkpoint-6" in why["message"]


def test_trainer_exporter_rounding_only_the_file_taints_nothing(tmp_path: Path) -> None:
    r = _job("hf_file", tmp_path)
    v = _by_step(r)
    assert r["stopped_at"] == 8 and [v[s]["ok"] for s in (2, 4, 6, 8)] == [True, True, False, True]
    assert v[6]["damage"] == "file" and "only the SAVED FILE is damaged" in v[6]["advice"]
    assert v[8]["damaged_ancestor"] is None
    assert read_passport(str(tmp_path / v[8]["passport"])).lineage.state == "clean"
    doc = _latest(tmp_path)
    assert doc["latest"] == str(tmp_path / "checkpoint-8"), doc["summary"]
