"""Acknowledging findings (``--ignore`` / ``ignore=``), findings ordered root cause first with the corruption named in
the summary, and ``ckptaudit latest`` judging precision on its defaults. Checkpoints are real ``torch.save`` files of
a tiny model trained 2 AdamW steps (``real_checkpoints.trained``); damage is done to copies of them.

Run: ``.venv/bin/python -m pytest -q tests/auditing/test_acknowledge_and_order.py``
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import ckptaudit
from ckptaudit.catalogue import parse_ignore
from ckptaudit.findings import Severity
from ckptaudit.testing import assert_checkpoint_ok
from real_checkpoints import trained
from runs import cli


def test_ignored_findings_stay_in_the_report_but_count_toward_nothing(tmp_path: Path) -> None:
    bad = trained(tmp_path / "bad.pt", rounded=True)
    code, out, _ = cli("audit", str(bad), "--format", "json")
    assert code == 1
    full = json.loads(out)
    code, out, _ = cli("audit", str(bad), "--format", "json", "--ignore", "precision.bf16-rounded")
    assert code == 0
    doc = json.loads(out)
    ignored = [f for f in doc["findings"] if f["ignored"]]
    assert {f["code"] for f in ignored} == {"precision.bf16-rounded"}
    assert len(ignored) == full["counts"]["error"] and doc["counts"]["error"] == 0
    assert doc["counts"]["ignored"] == len(ignored)
    assert doc["findings"][-len(ignored):] == ignored  # listed after those that count
    assert doc["summary"].startswith("resumable:") and "finding(s) ignored (precision.bf16-rounded)" in doc["summary"]
    # A family acknowledges every code of it; the table says which rows are acknowledged.
    code, out, _ = cli("audit", str(bad), "--ignore", "precision", "--verbose")
    assert code == 0 and "error (ignored)" in out
    # compare takes it too: the rounding it names is acknowledged, the exit code follows.
    good = trained(tmp_path / "good.pt")
    assert cli("compare", str(good), str(bad))[0] == 1
    code, out, _ = cli("compare", str(good), str(bad), "--ignore", "precision.bf16-rounded", "--format", "json")
    assert code == 0 and json.loads(out)["counts"]["error"] == 0 and "ignored" in json.loads(out)["summary"]


def test_an_ignore_entry_that_names_no_code_is_a_usage_error(tmp_path: Path) -> None:
    good = trained(tmp_path / "good.pt")
    code, _, err = cli("audit", str(good), "--ignore", "precision.bf16-rounde")
    assert code == 2
    assert "'precision.bf16-rounde' is neither a finding code nor a family" in err
    assert "did you mean 'precision.bf16-rounded'?" in err
    with pytest.raises(ValueError, match=r"option ignore=.* is not valid"):
        ckptaudit.audit(good, ignore=["nope"])
    assert parse_ignore(" optimizer , security.not-loaded,optimizer") == ("optimizer", "security.not-loaded")


def test_ignore_in_the_api_and_the_testing_helper(tmp_path: Path) -> None:
    bad = trained(tmp_path / "bad.pt", rounded=True)
    report = ckptaudit.audit(bad, ignore="precision.bf16-rounded")
    assert report.ok and report.failing == () and all(f.ignored for f in report.findings
                                                      if f.code == "precision.bf16-rounded")
    assert_checkpoint_ok(bad, ignore=["precision"])
    with pytest.raises(AssertionError, match=r"precision\.bf16-rounded"):
        assert_checkpoint_ok(bad)


def test_a_truncated_file_is_named_first_and_in_the_summary(tmp_path: Path) -> None:
    path = trained(tmp_path / "ckpt.pt")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    report = ckptaudit.audit(path)
    codes = [f.code for f in report.findings]
    assert "integrity.corrupt" in codes and "component.missing" in codes
    # The cause (the file cannot be read) before what it causes (model and optimizer then missing).
    assert codes.index("integrity.corrupt") < codes.index("component.missing")
    assert report.findings[0].severity is Severity.ERROR and report.findings[0].code == "integrity.corrupt"
    assert "corrupt or incomplete: ckpt.pt" in report.summary
    code, out, _ = cli("audit", str(path))
    assert code == 1 and "corrupt or incomplete: ckpt.pt" in out


def test_latest_on_defaults_never_names_a_rounded_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    trained(root / "step=2.ckpt")
    trained(root / "step=4.ckpt", rounded=True)  # newest, complete, and its masters rounded to bf16
    code, out, _ = cli("latest", str(root), "--format", "json")
    doc = json.loads(out)
    assert code == 0 and os.path.basename(doc["latest"]) == "step=2.ckpt" and doc["verify"] == "quick"
    rejected = next(c for c in doc["candidates"] if c["name"] == "step=4.ckpt")
    assert not rejected["resumable"]
    assert {f["code"] for f in rejected["findings"] if f["severity"] == "error"} == {"precision.bf16-rounded"}
    # --verify hashes is integrity only: the same candidate passes it.
    code, out, _ = cli("latest", str(root), "--format", "json", "--verify", "hashes")
    assert code == 0 and os.path.basename(json.loads(out)["latest"]) == "step=4.ckpt"
    # An acknowledged code rejects no candidate.
    code, out, _ = cli("latest", str(root), "--format", "json", "--ignore", "precision.bf16-rounded")
    assert os.path.basename(json.loads(out)["latest"]) == "step=4.ckpt"


def test_latest_quick_rejects_a_state_cast_to_bf16_when_the_contract_is_declared(tmp_path: Path) -> None:
    # An all-bf16 state with nothing recording its masters: the quick audit says contract.inferred (a warning), so
    # latest accepts it on defaults, as `audit` calls it resumable; declared fp32 masters reject it.
    import torch

    root = tmp_path / "run"
    root.mkdir()
    src = trained(tmp_path / "src.pt")
    state = torch.load(src, weights_only=True)
    state["model"] = {k: v.bfloat16() for k, v in state["model"].items()}
    state["optimizer"]["state"] = {i: {k: v.bfloat16() if v.dim() else v for k, v in e.items()}
                                   for i, e in state["optimizer"]["state"].items()}
    torch.save(state, root / "step=2.ckpt")
    report = ckptaudit.audit(root / "step=2.ckpt")
    assert "contract.inferred" in [f.code for f in report.findings if f.severity is Severity.WARNING]
    assert report.ok
    code, out, _ = cli("latest", str(root), "--format", "json")
    assert code == 0
    (cand,) = json.loads(out)["candidates"]
    assert any(f["code"] == "contract.inferred" for f in cand["findings"])
    code, out, _ = cli("latest", str(root), "--format", "json", "--master-dtype", "float32")
    assert code == 1 and json.loads(out)["latest"] is None
