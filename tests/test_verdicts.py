"""Verdicts on checkpoints that look rounded but are right: before the first update, frozen parameters, and a
model-only checkpoint whose contract is unknown; and the true positives beside them that must still fire.

Checkpoints come from ``get_state_dict`` + ``torch.distributed.checkpoint.save`` in one process
(``lib_writers.write_dcp``, a fresh interpreter, once per session): a tiny GPT initialised from bf16-representable
weights (a bf16 release loaded into fp32 masters), AdamW, a LambdaLR warmup.

- ``step0``: saved before any step (``get_state_dict`` fills AdamW's state by its own zero-lr step: step 1,
  zero moments; scheduler and train step 0);
- ``step0-frozen``: the same with ``tok_emb.weight`` frozen (not in the optimizer);
- ``trained``, ``trained-frozen``: after 2 real steps, saved right;
- ``trained-rounded-frozen``: after 2 real steps, the model saved through its bf16 compute copy (the defect);
- ``trained-model-bf16.pt``: the trained model alone, cast to bf16 (``torch.save``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.audit import audit
from ckptaudit.model import Precision, Report, Severity
from configurations import Written

pytestmark = pytest.mark.libs


@pytest.fixture(scope="session")
def dcp_jobs(tmp_path_factory: pytest.TempPathFactory) -> Written:
    import lib_writers

    out = tmp_path_factory.mktemp("dcp-jobs")
    written: Written = lib_writers.run_writer("dcp", str(out))
    return written


def truth(checkpoint: Path) -> dict[str, Any]:
    return json.loads(Path(str(checkpoint) + ".truth.json").read_text())


def by_code(report: Report, code: str) -> dict[str, Any]:
    return {f.subject: f for f in report.findings if f.code == code}


def rounded_params(report: Report) -> set[str]:
    return {t.name for t in report.tensors if t.component == "model" and t.precision is Precision.BF16}


def test_before_the_first_update_bf16_masters_are_a_warning_that_says_what_it_means(dcp_jobs: Written) -> None:
    report = audit(str(dcp_jobs / "step0"))
    assert report.extra["step"] == 0
    assert not report.fails(Severity.ERROR), [f.message for f in report.findings if f.severity is Severity.ERROR]
    early = by_code(report, "precision.before-first-update")
    # Every parameter with enough informative values is bf16-representable (the initial weights); each is named.
    assert len(early) >= 15 and set(early) == rounded_params(report)
    assert all(f.severity is Severity.WARNING for f in early.values())
    message = next(iter(early.values())).message
    assert ("in a checkpoint saved before any optimizer update (all 58 optimizer moments are exactly zero, step "
            "counters 1; train step 0; scheduler step 0)") in message
    assert "what a start from bf16 weights looks like" in message
    assert "had the initial weights been fp32, their low bits were lost before this save" in message
    assert not by_code(report, "precision.bf16-rounded")


def test_after_real_steps_rounded_masters_are_still_errors_and_the_frozen_one_is_info(dcp_jobs: Written) -> None:
    path = dcp_jobs / "trained-rounded-frozen"
    report = audit(str(path))
    assert report.extra["step"] == 2
    errors = by_code(report, "precision.bf16-rounded")
    trainable = {f"model/{n}" for n in truth(path)["trainable"]}
    # Every trainable parameter the scan can call rounded (all but a LayerNorm weight with 3 informative values)
    # is an error; none of them is excused as "before the first update".
    assert set(errors) == rounded_params(report) & trainable and len(errors) >= 25
    assert all(f.severity is Severity.ERROR for f in errors.values())
    assert not by_code(report, "precision.before-first-update")
    frozen = by_code(report, "precision.not-optimised")
    assert set(frozen) == {"model/tok_emb.weight"}
    assert frozen["model/tok_emb.weight"].severity is Severity.INFO
    assert "carries no optimizer state (no optimizer state entry names it)" in frozen["model/tok_emb.weight"].message


def test_a_frozen_parameter_is_info_before_and_after_training(dcp_jobs: Written) -> None:
    trained = audit(str(dcp_jobs / "trained-frozen"))
    assert [(f.code, f.subject) for f in trained.findings if f.severity >= Severity.WARNING] == [
        ("component.missing", "rng")]  # this job saves no RNG state
    assert set(by_code(trained, "precision.not-optimised")) == {"model/tok_emb.weight"}
    roles = {t.name: t.role for t in trained.tensors if t.component == "model"}
    assert roles.pop("model/tok_emb.weight") == "buffer" and set(roles.values()) == {"parameter"}
    early = audit(str(dcp_jobs / "step0-frozen"))
    assert not early.fails(Severity.ERROR)
    assert set(by_code(early, "precision.not-optimised")) == {"model/tok_emb.weight"}
    assert "model/tok_emb.weight" not in by_code(early, "precision.before-first-update")


def test_a_checkpoint_saved_right_after_real_steps_is_clean(dcp_jobs: Written) -> None:
    report = audit(str(dcp_jobs / "trained"))
    assert [(f.code, f.subject) for f in report.findings] == [("component.missing", "rng")]
    assert not rounded_params(report)


def test_model_only_bf16_checkpoint_has_an_unknown_contract_and_no_contradictory_precision_errors(
        dcp_jobs: Written) -> None:
    report = audit(str(dcp_jobs / "trained-model-bf16.pt"))
    assert report.contract is not None and report.contract.master_dtype == "unknown"
    severities = {f.code: f.severity for f in report.findings if f.subject != "rng"}
    assert severities["contract.unknown"] is Severity.WARNING
    assert not [f for f in report.findings if f.code.startswith("precision.")]
    assert not [f.message for f in report.findings if "unknown masters" in f.message or "into unknown" in f.message]
    # The optimizer is missing: that, not the parameters' dtype, is what makes it not resumable.
    assert [(f.code, f.subject) for f in report.findings if f.severity is Severity.ERROR] == [
        ("component.missing", "optimizer")]
    # Held to a contract on request, the parameters are judged.
    strict = audit(str(dcp_jobs / "trained-model-bf16.pt"), _options("float32"))
    assert len(by_code(strict, "precision.low-precision-storage")) == 29


def _options(master: str) -> Any:
    from ckptaudit.audit import AuditOptions

    return AuditOptions(master_dtype=master)
