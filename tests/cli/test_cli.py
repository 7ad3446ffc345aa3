"""The command line: exit codes, usage errors that name the thing, and the JSON report schema (golden)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from ckptaudit.findings import SCHEMA_VERSION
from runs import cli

GOLDEN = Path(__file__).parent / "golden"


def small_checkpoint(path: Path, *, rounded: bool = False) -> Path:
    """A deterministic tiny training checkpoint: two parameters, fp32 AdamW state, scheduler, RNG, step."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 4, generator=g)
    b = torch.randn(8, generator=g)
    if rounded:
        w, b = w.bfloat16().float(), b.bfloat16().float()
    state = {
        "model": {"lin.weight": w, "lin.bias": b},
        "optimizer": {
            "state": {
                "lin.weight": {"step": torch.tensor(3.0), "exp_avg": torch.randn(8, 4, generator=g),
                               "exp_avg_sq": torch.rand(8, 4, generator=g)},
                "lin.bias": {"step": torch.tensor(3.0), "exp_avg": torch.randn(8, generator=g),
                             "exp_avg_sq": torch.rand(8, generator=g)},
            },
            "param_groups": [{"lr": 0.1, "params": ["lin.weight", "lin.bias"]}],
        },
        "scheduler": {"last_epoch": 3, "base_lrs": [0.1]},
        "rng": {"torch": torch.Generator().manual_seed(1).get_state()},
        "step": 3,
    }
    torch.save(state, path)
    return path


def test_clean_checkpoint_exits_0(tmp_path: Path) -> None:
    code, out, err = cli("audit", str(small_checkpoint(tmp_path / "ok.pt")))
    assert code == 0, out + err
    assert "resumable" in out


def test_findings_exit_1_and_fail_on_controls_the_level(tmp_path: Path) -> None:
    bad = small_checkpoint(tmp_path / "bad.pt", rounded=True)
    code, out, _ = cli("audit", str(bad), "--format", "json")
    assert code == 1
    doc = json.loads(out)
    assert {f["subject"] for f in doc["findings"] if f["code"] == "precision.bf16-rounded"} == {
        "model/lin.weight", "model/lin.bias"}
    # A warning-only checkpoint: clean at --fail-on error, failing at --fail-on warning.
    warn = tmp_path / "warn.pt"
    full = torch.load(small_checkpoint(tmp_path / "x.pt"), weights_only=True)
    del full["rng"]
    torch.save(full, warn)
    assert cli("audit", str(warn))[0] == 0
    assert cli("audit", str(warn), "--fail-on", "warning")[0] == 1


def test_usage_errors_exit_2_with_a_message_that_names_the_problem(tmp_path: Path) -> None:
    code, _, err = cli("audit", str(tmp_path / "nope"))
    assert code == 2 and "nope: no such file or directory" in err
    code, _, err = cli("audit", str(small_checkpoint(tmp_path / "a.pt")), "--require", "scheduler,weather")
    assert code == 2 and "unknown component 'weather'" in err and "data-progress" in err
    code, _, err = cli("audit", str(tmp_path), "--master-dtype", "float8")
    assert code == 2 and "invalid choice: 'float8'" in err
    assert cli()[0] == 2


def test_output_file_and_require(tmp_path: Path) -> None:
    ckpt = tmp_path / "c.pt"
    full = torch.load(small_checkpoint(tmp_path / "x.pt"), weights_only=True)
    del full["scheduler"]
    torch.save(full, ckpt)
    report = tmp_path / "r.json"
    assert cli("audit", str(ckpt), "--format", "json", "--output", str(report))[0] == 0
    assert json.loads(report.read_text())["counts"]["warning"] == 1
    assert cli("audit", str(ckpt), "--require", "scheduler")[0] == 1


def test_json_report_matches_the_golden_schema(tmp_path: Path) -> None:
    ckpt = small_checkpoint(tmp_path / "golden.pt", rounded=True)
    code, out, _ = cli("audit", str(ckpt), "--format", "json")
    assert code == 1
    doc = json.loads(out)
    assert doc["schema_version"] == SCHEMA_VERSION
    doc["path"] = os.path.basename(doc["path"])
    doc["tool"]["version"] = "X"
    golden_path = GOLDEN / "audit_small.json"
    if os.environ.get("CKPTAUDIT_UPDATE_GOLDEN"):
        golden_path.write_text(json.dumps(doc, indent=2) + "\n")
    assert doc == json.loads(golden_path.read_text())


def test_json_reports_have_a_line_per_tensor_record_finding_and_pair(tmp_path: Path) -> None:
    # A large checkpoint's report holds hundreds of thousands of records: one per line keeps it quick to write and
    # lets a search for a tensor's name show its whole record.
    ckpt = small_checkpoint(tmp_path / "lines.pt", rounded=True)
    _code, out, _ = cli("audit", str(ckpt), "--format", "json")
    doc = json.loads(out)
    assert len(doc["tensors"]) > 3 and doc["findings"]
    one_line = [json.loads(line.strip().rstrip(",")) for line in out.splitlines()
                if line.startswith('    {"')]
    assert one_line == doc["tensors"] + doc["findings"]
    _code, out, _ = cli("compare", str(ckpt), str(ckpt), "--format", "json")
    doc = json.loads(out)
    assert len(doc["pairs"]) > 3
    one_line = [json.loads(line.strip().rstrip(",")) for line in out.splitlines()
                if line.startswith('    {"')]
    assert one_line == doc["tensors"] + doc["findings"] + doc["pairs"]


def test_table_prints_hostile_names_verbatim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tensor names come from the checkpoint: rich markup in them must be printed, not interpreted. The width the
    # output gets when it is no terminal (COLUMNS may be anything: pytest-xdist's workers have 80, which folds it).
    monkeypatch.delenv("COLUMNS", raising=False)
    path = tmp_path / "markup.pt"
    torch.save({"model": {"[/]x[bold]:smile:": torch.ones(3).bfloat16()}}, path)
    code, out, err = cli("audit", str(path), "--verbose")
    assert code == 1, err
    assert "[/]x[bold]:smile:" in out
