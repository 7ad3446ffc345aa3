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
- ``trained-model-bf16.pt``: the trained model alone, cast to bf16 (``torch.save``);
- ``finetune-lr0`` (DCP, FQN-keyed groups, the step as ``train/step``) and ``finetune-lr0.pt`` (``torch.save``,
  index-keyed groups, the step as ``trainer/global_step``): a fine-tune whose embeddings and first block sit in a
  param group at learning rate 0 throughout (their bf16 initial weights are never updated), the rest trained.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.auditing.judge import run_audit
from ckptaudit.findings import Precision, RawReport, Severity
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


def by_code(report: RawReport, code: str) -> dict[str, Any]:
    return {f.subject: f for f in report.findings if f.code == code}


def rounded_params(report: RawReport) -> set[str]:
    return {t.name for t in report.tensors if t.component == "model" and t.precision is Precision.BF16}


def test_before_the_first_update_bf16_masters_are_a_warning_that_says_what_it_means(dcp_jobs: Written) -> None:
    report = run_audit(str(dcp_jobs / "step0"))
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
    report = run_audit(str(path))
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
    trained = run_audit(str(dcp_jobs / "trained-frozen"))
    assert [(f.code, f.subject) for f in trained.findings if f.severity >= Severity.WARNING] == [
        ("component.missing", "rng")]  # this job saves no RNG state
    assert set(by_code(trained, "precision.not-optimised")) == {"model/tok_emb.weight"}
    roles = {t.name: t.role for t in trained.tensors if t.component == "model"}
    assert roles.pop("model/tok_emb.weight") == "buffer" and set(roles.values()) == {"parameter"}
    early = run_audit(str(dcp_jobs / "step0-frozen"))
    assert not early.fails(Severity.ERROR)
    assert set(by_code(early, "precision.not-optimised")) == {"model/tok_emb.weight"}
    assert "model/tok_emb.weight" not in by_code(early, "precision.before-first-update")


def test_a_checkpoint_saved_right_after_real_steps_is_clean(dcp_jobs: Written) -> None:
    report = run_audit(str(dcp_jobs / "trained"))
    assert [(f.code, f.subject) for f in report.findings] == [("component.missing", "rng")]
    assert not rounded_params(report)


def test_model_only_bf16_checkpoint_has_an_unknown_contract_and_no_contradictory_precision_errors(
        dcp_jobs: Written) -> None:
    report = run_audit(str(dcp_jobs / "trained-model-bf16.pt"))
    assert report.contract is not None and report.contract.master_dtype == "unknown"
    severities = {f.code: f.severity for f in report.findings if f.subject != "rng"}
    assert severities["contract.unknown"] is Severity.WARNING
    assert not [f for f in report.findings if f.code.startswith("precision.")]
    assert not [f.message for f in report.findings if "unknown masters" in f.message or "into unknown" in f.message]
    # The optimizer is missing: that, not the parameters' dtype, is what makes it not resumable.
    assert [(f.code, f.subject) for f in report.findings if f.severity is Severity.ERROR] == [
        ("component.missing", "optimizer")]
    # Held to a contract on request, the parameters are judged.
    strict = run_audit(str(dcp_jobs / "trained-model-bf16.pt"), _options("float32"))
    assert len(by_code(strict, "precision.low-precision-storage")) == 29


def _options(master: str) -> Any:
    from ckptaudit.auditing.judge import AuditOptions

    return AuditOptions(master_dtype=master)


# ---------------------------------------------------------------------------------------------------------------
# Parameters no update ever touched: a param group at lr 0 throughout


def _lr0_rounded(report: RawReport, lr0: list[str]) -> set[str]:
    return {f"model/{n}" for n in lr0} & rounded_params(report)


@pytest.mark.parametrize("name", ["finetune-lr0", "finetune-lr0.pt"])
def test_a_fine_tune_whose_lower_layers_keep_lr_0_is_clean(dcp_jobs: Path, name: str) -> None:
    path = dcp_jobs / name
    lr0 = truth(path)["lr0"]
    report = run_audit(str(path))
    assert not report.fails(Severity.ERROR), [f.message for f in report.findings if f.severity is Severity.ERROR]
    kept = by_code(report, "precision.never-updated")
    # Every lr-0 weight the scan can call bf16 is named, as info, with the record that shows it; nothing else is.
    assert set(kept) == _lr0_rounded(report, lr0) and len(kept) >= 8
    assert all(f.severity is Severity.INFO for f in kept.values())
    message = kept["model/blocks.0.attn.qkv.weight"].message
    assert ("param group 0: lr 0, initial_lr 0, scheduler base_lrs[0] 0, scheduler _last_lr[0] 0" in message)
    assert ("index-keyed state" in message) == name.endswith(".pt")
    trained = {f"model/{n}" for n in truth(path)["trained"]}
    assert not rounded_params(report) & trained  # the trained ones moved off the bf16 grid
    assert report.extra["step"] == 2


def _round_trained_in_torch_save(src: Path, dst: Path, *, base_lr0: float = 0.0) -> list[str]:
    """The torch.save fine-tune with its trained weights rounded to bf16 (the exporter bug), and optionally a
    scheduler record that says group 0 had a learning rate. Returns the trained names."""
    import torch

    state = torch.load(src, weights_only=True)
    trained = truth(src)["trained"]
    for n in trained:
        state["model"][n] = state["model"][n].bfloat16().float()
    state["lr_scheduler"]["base_lrs"][0] = base_lr0
    torch.save(state, dst)
    return trained


def test_lr_0_does_not_excuse_rounded_weights_that_were_trained(dcp_jobs: Path, tmp_path: Path) -> None:
    # The trained layers rounded as well: the rounded set no longer fits the lr-0 group, so nothing is excused.
    src = dcp_jobs / "finetune-lr0.pt"
    trained = _round_trained_in_torch_save(src, tmp_path / "rounded.pt")
    report = run_audit(str(tmp_path / "rounded.pt"))
    errors = by_code(report, "precision.bf16-rounded")
    assert {f"model/{n}" for n in trained} & rounded_params(report) <= set(errors)
    assert _lr0_rounded(report, truth(src)["lr0"]) <= set(errors)
    assert not by_code(report, "precision.never-updated")


def test_lr_0_is_believed_only_when_every_record_says_0(dcp_jobs: Path, tmp_path: Path) -> None:
    # The weights as saved, but the scheduler's base_lrs says group 0 had a learning rate: not excused.
    import shutil

    src = dcp_jobs / "finetune-lr0.pt"
    shutil.copy(src, tmp_path / "base-lr.pt")
    import torch

    state = torch.load(src, weights_only=True)
    state["lr_scheduler"]["base_lrs"][0] = 1e-3
    torch.save(state, tmp_path / "base-lr.pt")
    report = run_audit(str(tmp_path / "base-lr.pt"))
    assert set(by_code(report, "precision.bf16-rounded")) == _lr0_rounded(report, truth(src)["lr0"])
    assert not by_code(report, "precision.never-updated")


def test_lr_0_in_dcp_does_not_excuse_a_trained_weight_saved_rounded(dcp_jobs: Path, tmp_path: Path) -> None:
    # FQN-keyed groups name each parameter: the lr-0 ones are info, a rounded trained one is still an error.
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = dcp_jobs / "finetune-lr0"
    dcp_to_torch_save(str(src), str(tmp_path / "flat.pt"))
    state = torch.load(tmp_path / "flat.pt", weights_only=False)
    state["model"]["head.weight"] = state["model"]["head.weight"].bfloat16().float()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "rounded-head"))
    report = run_audit(str(tmp_path / "rounded-head"))
    assert set(by_code(report, "precision.bf16-rounded")) == {"model/head.weight"}
    assert set(by_code(report, "precision.never-updated")) == _lr0_rounded(report, truth(src)["lr0"])


# ---------------------------------------------------------------------------------------------------------------
# The training step under its common spellings


def test_the_step_is_read_under_its_common_spellings(dcp_jobs: Path) -> None:
    from ckptaudit.findings import ComponentKind

    for name, where in (("finetune-lr0", "train/step"), ("finetune-lr0.pt", "trainer")):
        report = run_audit(str(dcp_jobs / name))
        assert report.extra["step"] == 2
        (progress,) = [c for c in report.components if c.kind is ComponentKind.DATA_PROGRESS]
        assert progress.found and progress.where == (where,)
        assert "step counter only" in progress.detail


def test_compare_pairs_the_step_across_spellings(dcp_jobs: Path, tmp_path: Path) -> None:
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ckptaudit.comparing import run_compare

    src = dcp_jobs / "finetune-lr0"
    dcp_to_torch_save(str(src), str(tmp_path / "flat.pt"))
    state = torch.load(tmp_path / "flat.pt", weights_only=False)
    state["train_state"] = {"step": state.pop("train/step")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "train_state"))
    report = run_compare(str(src), str(tmp_path / "train_state"))
    assert not [f for f in report.findings if f.code in ("compare.missing", "compare.extra")], report.findings
    steps = [p for p in report.extra["pairs"] if p["key"] == "data-progress/step"]
    assert len(steps) == 1 and steps[0]["status"] == "identical", steps
