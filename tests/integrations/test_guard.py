"""The in-loop guard: the shared engine (background audit, report beside the checkpoint, quarantine, stop flag,
queueing, "not judged"), ``ckptaudit latest`` honouring quarantine, and the Trainer story end to end."""

from __future__ import annotations

import io
import json
import logging
import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.cli import main
from ckptaudit.integrations.guard import Guard, report_path
from ckptaudit.schema import validate
from guard_jobs import launch_job, live, run_job
from real_checkpoints import trained


@pytest.mark.parametrize("background", ["thread", "process"])
def test_a_failing_checkpoint_is_quarantined_with_its_report_and_stops(tmp_path: Path, background: str) -> None:
    good, bad = trained(tmp_path / "step=2.ckpt"), trained(tmp_path / "step=4.ckpt", rounded=True)
    passed: list[str] = []
    guard = Guard(on_failure="stop", background=background)
    guard.submit(str(good), step=2, on_pass=passed.append)
    guard.submit(str(bad), step=4, on_pass=passed.append)
    assert guard.close(120)
    first, second = guard.verdicts
    assert (first.ok, first.quarantined_to, first.report) == (True, None, report_path(str(good)))
    assert passed == [str(good)] and good.exists()
    assert second.ok is False and set(second.codes) == {"precision.bf16-rounded"}
    assert second.quarantined_to == str(bad) + ".quarantined" and not bad.exists()
    assert Path(second.quarantined_to).exists()
    assert second.report == second.quarantined_to + ".ckptaudit.json"
    doc = json.loads(Path(second.report).read_text())
    validate(doc)
    assert doc["counts"]["error"] == len(second.codes) and not os.path.exists(report_path(str(bad)))
    assert guard.should_stop() and guard.failed == second


def test_warn_quarantines_but_does_not_stop(tmp_path: Path) -> None:
    bad = trained(tmp_path / "bad.pt", rounded=True)
    guard = Guard(on_failure="warn", quick=True)
    guard.submit(str(bad))
    assert guard.close(60)
    (v,) = guard.verdicts
    assert v.ok is False and v.quarantined_to is not None and not guard.should_stop()
    assert json.loads(Path(v.report or "").read_text())["mode"] == "quick"


@pytest.mark.parametrize("background", ["thread", "process"])
def test_a_guard_judges_an_export_cast_to_bf16_with_the_live_contract(tmp_path: Path, background: str) -> None:
    # The exporter casts the whole state to bf16. The file alone looks like a run with bf16 masters (a warning on
    # defaults); the guard knows the optimizer steps fp32 parameters, so it is an error, and the report says why.
    import torch

    from ckptaudit.integrations.live_contract import declare_live_contract

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    osd = opt.state_dict()
    torch.save({"model": {k: v.bfloat16() for k, v in model.state_dict().items()},
                "optimizer": {"state": {i: {k: v.bfloat16() if v.dim() else v for k, v in e.items()}
                                        for i, e in osd["state"].items()}, "param_groups": osd["param_groups"]},
                "step": 2}, tmp_path / "export.pt")
    plain = Guard(background=background)
    plain.submit(str(tmp_path / "export.pt"))
    assert plain.close(60)
    assert plain.verdicts[0].ok is True  # on the file alone: contract.inferred, a warning
    guard = Guard(background=background)
    declare_live_contract(guard, opt, "a test loop")
    guard.submit(str(tmp_path / "export.pt"))
    assert guard.close(60)
    (v,) = guard.verdicts
    assert v.ok is False and {"contract.mismatch", "precision.low-precision-storage"} == set(v.codes)
    doc = json.loads(Path(v.report or "").read_text())
    assert doc["contract"]["source"] == "live" and doc["contract"]["master_dtype"] == "float32"
    assert doc["contract"]["detail"] == "the live run: AdamW steps 4 float32 parameter tensor(s) (a test loop)"
    # A master_dtype the user gave the guard is theirs to keep.
    own = Guard(master_dtype="bfloat16")
    declare_live_contract(own, opt)
    assert own.audit_options == {"jobs": 1, "master_dtype": "bfloat16"}  # and one thread, beside training
    own.close()


def test_an_audit_that_cannot_run_is_not_judged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    guard = Guard(on_failure="stop")
    with caplog.at_level(logging.WARNING, logger="ckptaudit.guard"):
        guard.submit(str(tmp_path / "rotated-away"))
        assert guard.close(60)
    (v,) = guard.verdicts
    assert v.ok is None and v.quarantined_to is None and "does not exist" in v.error
    assert not guard.should_stop()
    assert "was not judged" in caplog.text


def test_an_asynchronous_save_is_audited_once_its_future_completes(tmp_path: Path) -> None:
    target = tmp_path / "step=4.ckpt"
    writing: Future[None] = Future()
    guard = Guard(on_failure="stop", background="thread")
    guard.submit(str(target), step=4, ready=writing)  # the file does not exist yet: the save is still writing
    assert not guard.wait(0.5) and guard.pending == 1  # the worker waits for the future, not for a timeout
    trained(target, rounded=True)
    writing.set_result(None)
    assert guard.close(60)
    (v,) = guard.verdicts
    assert v.ok is False and set(v.codes) == {"precision.bf16-rounded"} and v.quarantined_to == str(target) + ".quarantined"
    assert guard.should_stop()


def test_an_asynchronous_save_that_failed_is_not_judged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    target = trained(tmp_path / "step=2.ckpt", rounded=True)
    failed: Future[None] = Future()
    failed.set_exception(OSError("No space left on device"))
    guard = Guard(on_failure="stop", background="thread")
    with caplog.at_level(logging.WARNING, logger="ckptaudit.guard"):
        guard.submit(str(target), step=2, ready=failed)
        assert guard.close(60)
    (v,) = guard.verdicts
    assert v.ok is None and v.quarantined_to is None and "No space left on device" in v.error
    assert target.exists() and not guard.should_stop()
    assert "the asynchronous save of" in caplog.text and "not judged" in caplog.text


def test_saves_during_an_audit_queue_in_order_and_are_logged(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    paths = [str(trained(tmp_path / f"s{i}.pt")) for i in range(3)]
    guard = Guard()
    with caplog.at_level(logging.INFO, logger="ckptaudit.guard"):
        for p in paths:
            guard.submit(p)
        assert guard.close(120)
    assert [v.checkpoint for v in guard.verdicts] == paths and all(v.ok for v in guard.verdicts)
    assert "audit(s) are pending; queued behind them" in caplog.text


class _RewrittenDuringItsAudit(Guard):
    """A Guard whose checkpoint is replaced by a newer, good one while its audit runs, as Lightning rewrites
    ``last.ckpt`` at the next save: ``how`` is ``"in place"`` (the same file rewritten) or ``"renamed"`` (a new
    file moved over it, as atomic savers do). The audit itself is the real one, on the file as it was saved
    (``checkpoint`` is the guard's pin of it; ``as_path`` the library's path, which is what gets replaced)."""

    def __init__(self, how: str, **options: Any) -> None:
        super().__init__(**options)
        self.how = how

    def _run_audit(self, checkpoint: str, where: str, as_path: str, *passport: Any) -> dict[str, Any]:
        result = super()._run_audit(checkpoint, where, as_path, *passport)
        if self.how == "in place":
            trained(Path(as_path))
        else:
            os.replace(trained(Path(as_path + ".tmp")), as_path)
        return result


@pytest.mark.parametrize("how", ["in place", "renamed"])
def test_a_checkpoint_replaced_before_its_verdict_is_not_quarantined(tmp_path: Path, how: str,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    last = trained(tmp_path / "last.ckpt", rounded=True)
    guard = _RewrittenDuringItsAudit(how, on_failure="stop", background="thread")
    with caplog.at_level(logging.WARNING, logger="ckptaudit.guard"):
        guard.submit(str(last), step=4)
        assert guard.close(120)
    (v,) = guard.verdicts
    # The newer, good checkpoint at the path stays where it is, whatever happened to the one that was audited.
    assert last.exists() and _audits_clean(last)
    assert not Path(str(last) + ".quarantined").exists() or not _audits_clean(Path(str(last) + ".quarantined"))
    if how == "in place":
        # The bytes under the audit changed: no verdict can be given for them, and nothing is moved.
        assert v.ok is None and v.error.startswith("replaced: ") and v.quarantined_to is None
    else:
        # The saved bytes (pinned) failed, and say so; they alone go to the quarantine name.
        assert v.ok is False and set(v.codes) == {"precision.bf16-rounded"}
        assert v.note.startswith("replaced since it was saved")
        assert v.quarantined_to == str(last) + ".quarantined"


def _audits_clean(path: Path) -> bool:
    from ckptaudit import audit

    return not [f for f in audit(str(path)).findings if f.code == "precision.bf16-rounded"]


def test_guard_options_are_checked_before_training() -> None:
    with pytest.raises(ValueError, match="on_failure='halt' is not valid; pass 'warn'"):
        Guard(on_failure="halt")
    with pytest.raises(TypeError, match="unknown option 'quik'; did you mean 'quick'"):
        Guard(quik=True)


def test_ckptaudit_latest_never_picks_a_quarantined_checkpoint(tmp_path: Path) -> None:
    trained(tmp_path / "epoch=0-step=2.ckpt")
    bad = trained(tmp_path / "epoch=0-step=4.ckpt", rounded=True)
    guard = Guard()
    guard.submit(str(bad))
    assert guard.close(60)
    out = io.StringIO()
    assert main(["latest", str(tmp_path), "--format", "json", "--all"], stdout=out, stderr=io.StringIO()) == 0
    doc = json.loads(out.getvalue())
    assert os.path.basename(doc["latest"]) == "epoch=0-step=2.ckpt"
    by_name = {c["name"]: c for c in doc["candidates"]}
    quarantined = by_name["epoch=0-step=4.ckpt.quarantined"]
    assert (quarantined["layout"], quarantined["step"], quarantined["resumable"]) == ("quarantined", 4, False)
    assert [f["code"] for f in quarantined["findings"]] == ["guard.quarantined"]
    assert not any(n.endswith(".ckptaudit.json") for n in by_name)


# ---------------------------------------------------------------------------------------------------------------
# The real Trainer on CPU


@pytest.fixture(scope="session")
def hf_story(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_job("hf", str(tmp_path_factory.mktemp("guard-hf")))


@pytest.mark.libs
def test_trainer_stops_after_the_lossy_save_and_resumes_from_the_good_one(hf_story: dict[str, Any]) -> None:
    good, bad = hf_story["verdicts"]
    assert (good["checkpoint"], good["ok"], good["report"]) == ("checkpoint-2", True, "checkpoint-2.ckptaudit.json")
    assert (bad["checkpoint"], bad["ok"]) == ("checkpoint-4", False)
    assert set(bad["codes"]) == {"precision.bf16-rounded"}
    live(good, "Trainer bf16=False, fp16=False")
    # Stopped at the first step end after the failing audit: the save was at 4 (of max_steps 20).
    assert hf_story["stopped_at"] == 5
    assert hf_story["listing"] == ["checkpoint-2", "checkpoint-2.ckptaudit.json", "quarantined-checkpoint-4",
                                   "quarantined-checkpoint-4.ckptaudit.json"]
    assert bad["quarantined_to"] == "quarantined-checkpoint-4"
    assert bad["report"] == "quarantined-checkpoint-4.ckptaudit.json"
    # Trainer's own resume path (resume_from_checkpoint=True -> get_last_checkpoint) took the good one.
    assert hf_story["get_last_checkpoint"] == "checkpoint-2"
    assert hf_story["resumed_from_step"] == 2 and hf_story["resumed_to_step"] == 7
    # on_failure="stop": train() ended with CheckpointAuditFailed, naming the quarantined checkpoint.
    assert hf_story["raised"]["failed"] == ["checkpoint-4"]
    assert "quarantined-checkpoint-4" in hf_story["raised"]["message"]


@pytest.mark.libs
@pytest.mark.dist
def test_trainer_on_two_ranks_stops_on_both_after_the_lossy_save(tmp_path: Path) -> None:
    import guard_jobs

    ranks = launch_job(guard_jobs.hf_ddp, str(tmp_path / "out"))
    zero, one = ranks
    assert [(v["checkpoint"], v["ok"]) for v in zero["verdicts"]] == [("checkpoint-2", True), ("checkpoint-4", False)]
    assert set(zero["verdicts"][1]["codes"]) == {"precision.bf16-rounded"}
    assert one["verdicts"] == []  # only rank 0 audits
    # Both ranks left train() at the same step boundary, the first step end after the failing audit.
    assert [r["stopped_at"] for r in ranks] == [5, 5]
    for r in ranks:
        # Every rank's files (rng_state_<rank>.pth) were written before the move: no half checkpoint-4 is left.
        assert r["listing"] == ["checkpoint-2", "checkpoint-2.ckptaudit.json", "quarantined-checkpoint-4",
                                "quarantined-checkpoint-4.ckptaudit.json"]
        assert r["get_last_checkpoint"] == "checkpoint-2"
        assert (r["resumed_from_step"], r["resumed_to_step"]) == (2, 7)
        # The passport of the good one, inside it, is the only difference (the guard wrote it when it passed).
        assert sorted([*r["files"]["quarantined-checkpoint-4"], "ckptaudit.passport.json"]) == sorted(
            r["files"]["checkpoint-2"])
        assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(r["files"]["checkpoint-2"])
    # Both processes' train() raised CheckpointAuditFailed; the one that audited names the checkpoint.
    assert [r["raised"]["failed"] for r in ranks] == [["checkpoint-4"], []]


# ---------------------------------------------------------------------------------------------------------------
# The real Lightning Trainer on CPU (ModelCheckpoint every 2 steps, save_last=True)


@pytest.fixture(scope="session")
def lightning_story(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_job("lightning", str(tmp_path_factory.mktemp("guard-lightning")))


def _without_passports(listing: list[str]) -> list[str]:
    return [n for n in listing if not n.endswith(".passport.json")]


def _passports_hold(story: dict[str, Any]) -> None:
    """The good top-k file has its passport, and every passport beside a file attests that file's bytes (last.ckpt
    keeps one only when its bytes are the ones attested: the guard drops it when the name is saved again)."""
    assert "epoch=0-step=2.ckpt.passport.json" in story["listing"]
    assert story["passports"] and all(story["passports"].values()), story["passports"]


@pytest.mark.libs
def test_lightning_stops_after_the_lossy_save_and_last_resumes_the_good_one(lightning_story: dict[str, Any]) -> None:
    verdicts = [(v["checkpoint"], v["step"], v["ok"]) for v in lightning_story["verdicts"]]
    assert verdicts == [("epoch=0-step=2.ckpt", 2, True), ("last.ckpt", 2, True),
                        ("epoch=0-step=4.ckpt", 4, False), ("last.ckpt", 4, False)]
    assert all(set(v["codes"]) == {"precision.bf16-rounded"} for v in lightning_story["verdicts"][2:])
    live(lightning_story["verdicts"][0], "Lightning precision=")
    assert lightning_story["stopped_at"] == 5
    assert _without_passports(lightning_story["listing"]) == [
        "epoch=0-step=2.ckpt", "epoch=0-step=2.ckpt.ckptaudit.json",
        "epoch=0-step=4.ckpt.quarantined", "epoch=0-step=4.ckpt.quarantined.ckptaudit.json",
        "last.ckpt", "last.ckpt.ckptaudit.json", "last.ckpt.quarantined", "last.ckpt.quarantined.ckptaudit.json"]
    _passports_hold(lightning_story)
    # last.ckpt was the failed step-4 state; it is now a real copy (not a link) of the step-2 checkpoint, and
    # Lightning's own ckpt_path="last" resumed from it.
    assert lightning_story["last_global_step"] == 2 and not lightning_story["last_is_link"]
    assert lightning_story["resumed_from_step"] == 2 and lightning_story["resumed_to_step"] == 7
    assert lightning_story["raised"]["failed"] == ["epoch=0-step=4.ckpt", "last.ckpt"]


@pytest.mark.libs
@pytest.mark.dist
def test_lightning_ddp_on_two_ranks_stops_on_both_after_the_lossy_save(tmp_path: Path) -> None:
    import guard_jobs

    ranks = launch_job(guard_jobs.lightning_ddp, str(tmp_path / "out"))
    zero, one = ranks
    assert [(v["checkpoint"], v["step"], v["ok"]) for v in zero["verdicts"]] == [
        ("epoch=0-step=2.ckpt", 2, True), ("last.ckpt", 2, True),
        ("epoch=0-step=4.ckpt", 4, False), ("last.ckpt", 4, False)]
    assert one["verdicts"] == []  # only the global-zero process audits
    assert [r["stopped_at"] for r in ranks] == [5, 5]
    for r in ranks:
        assert _without_passports(r["listing"]) == [
            "epoch=0-step=2.ckpt", "epoch=0-step=2.ckpt.ckptaudit.json",
            "epoch=0-step=4.ckpt.quarantined", "epoch=0-step=4.ckpt.quarantined.ckptaudit.json",
            "last.ckpt", "last.ckpt.ckptaudit.json", "last.ckpt.quarantined", "last.ckpt.quarantined.ckptaudit.json"]
        _passports_hold(r)
        # ckpt_path="last" (a copy of step 2 now) resumed both ranks at step 2.
        assert r["last_global_step"] == 2 and not r["last_is_link"]
        assert (r["resumed_from_step"], r["resumed_to_step"]) == (2, 7)
    assert [r["raised"]["failed"] for r in ranks] == [["epoch=0-step=4.ckpt", "last.ckpt"], []]


# ---------------------------------------------------------------------------------------------------------------
# ckptaudit.store on 2 real FSDP2 ranks: latest and retention wait for the audit


@pytest.mark.dist
def test_store_latest_and_retention_wait_for_the_audit(tmp_path: Path) -> None:
    from ckptaudit.launch import launch

    root = tmp_path / "ckpts"
    result = launch(_store_job(), 2, (str(root),), timeout_s=240)[0]
    assert [(v["checkpoint"], v["ok"]) for v in result["verdicts"]] == [("step-000002", True),
                                                                       ("step-000004", False)]
    assert set(result["verdicts"][1]["codes"]) == {"precision.bf16-rounded"}
    live(result["verdicts"][0], "ckptaudit.store")
    # latest moved to step 2 once it passed, not at its commit; it never named step 4.
    assert result["pointer_before_and_after_each_audit"] == [(None, "step-000002"), ("step-000002", "step-000002")]
    assert result["stopped_at"] == 4  # the boundary right after the save: this loop waited for the audit there
    # keep_last=1 did not delete step 2 for the failed step 4 (retention runs only after a pass).
    assert result["listing"] == ["latest", "quarantined-step-000004", "quarantined-step-000004.ckptaudit.json",
                                 "step-000002", "step-000002.ckptaudit.json"]
    assert result["loaded_step"] == 2 and result["pointer"] == "step-000002"


def _store_job() -> Any:
    import guard_jobs

    return guard_jobs.store


# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed on CPU (ZeRO stage 0: what the audit reads today; ZeRO partitions need the DeepSpeed reader)


@pytest.fixture(scope="session")
def deepspeed_story(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_job("deepspeed", str(tmp_path_factory.mktemp("guard-deepspeed")))


@pytest.mark.libs
def test_deepspeed_latest_moves_only_to_a_tag_that_passed(deepspeed_story: dict[str, Any]) -> None:
    verdicts = [(v["checkpoint"], v["step"], v["ok"]) for v in deepspeed_story["verdicts"]]
    assert verdicts == [("global_step2", 2, True), ("global_step4", 4, False)]
    assert set(deepspeed_story["verdicts"][1]["codes"]) == {"precision.bf16-rounded"}
    live(deepspeed_story["verdicts"][0], "DeepSpeed bf16 ")
    assert deepspeed_story["stopped_at"] == 4  # the loop waited for the audit right after the save
    assert deepspeed_story["latest_after_each_audit"] == ["global_step2", "global_step2"]
    assert deepspeed_story["listing"] == ["global_step2", "global_step2.ckptaudit.json", "latest",
                                          "quarantined-global_step4", "quarantined-global_step4.ckptaudit.json"]
    # DeepSpeed's own resume path (engine.load_checkpoint(dir) reads `latest`) loads the tag that passed.
    assert deepspeed_story["loaded"] == "global_step2" and deepspeed_story["resumed_step"] == 2


@pytest.fixture(scope="session")
def deepspeed_zero_story(tmp_path_factory: pytest.TempPathFactory) -> list[dict[int, dict[str, Any]]]:
    import guard_jobs

    return launch_job(guard_jobs.deepspeed_zero, str(tmp_path_factory.mktemp("guard-deepspeed-zero")))


@pytest.mark.libs
@pytest.mark.dist
@pytest.mark.timeout(600)  # the session fixture (2 ranks, 2 stages, DeepSpeed's start-up) runs under the first one
@pytest.mark.parametrize(("stage", "optimizer"), [(2, "DeepSpeedZeroOptimizer"), (3, "DeepSpeedZeroOptimizer_Stage3")])
def test_deepspeed_zero_on_two_ranks_latest_moves_only_to_a_tag_that_passed(
        deepspeed_zero_story: list[dict[int, dict[str, Any]]], stage: int, optimizer: str) -> None:
    zero, one = (r[stage] for r in deepspeed_zero_story)
    assert zero["optimizer"] == optimizer
    verdicts = [(v["checkpoint"], v["step"], v["ok"]) for v in zero["verdicts"]]
    assert verdicts == [("global_step2", 2, True), ("global_step4", 4, False)]
    assert one["verdicts"] == []  # only global rank 0 audits
    # The masters rounded in the optimizer's own fp32 partitions (every rank's) are what the audit names.
    bad = zero["verdicts"][1]
    assert set(bad["codes"]) == {"precision.bf16-rounded"}
    live(zero["verdicts"][0], f"{optimizer} steps ")  # the engine's fp32 partitions
    assert zero["latest_after_each_audit"] == ["global_step2", "global_step2"]
    assert [r["stopped_at"] for r in (zero, one)] == [4, 4]
    for r in (zero, one):
        # (zero_to_fp32.py and zero_to_torch.py: DeepSpeed's own consolidation scripts, written with every ZeRO save.)
        assert r["listing"] == ["global_step2", "global_step2.ckptaudit.json", "latest",
                                "quarantined-global_step4", "quarantined-global_step4.ckptaudit.json",
                                "zero_to_fp32.py", "zero_to_torch.py"]
        # engine.load_checkpoint(dir) with no tag read `latest` and restored step 2's masters on every rank.
        assert (r["loaded"], r["resumed_step"], r["loaded_step_2_masters"]) == ("global_step2", 2, True), r


# ---------------------------------------------------------------------------------------------------------------
# torchtitan's real CheckpointManager (DCP) on one gloo rank


@pytest.fixture(scope="session")
def torchtitan_story(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_job("torchtitan", str(tmp_path_factory.mktemp("guard-torchtitan")))


@pytest.mark.libs
def test_torchtitan_newest_step_is_never_one_that_failed(torchtitan_story: dict[str, Any]) -> None:
    verdicts = [(v["checkpoint"], v["step"], v["ok"], v["report"]) for v in torchtitan_story["verdicts"]]
    assert verdicts == [("step-2", 2, True, "step_2.ckptaudit.json"),
                        ("step-4", 4, False, "quarantined-step_4.ckptaudit.json")]
    assert set(torchtitan_story["verdicts"][1]["codes"]) == {"precision.bf16-rounded"}
    live(torchtitan_story["verdicts"][0], "(torchtitan)")
    assert torchtitan_story["stopped_at"] == 4
    # No name but step-2 holds "step-<digits>", which torchtitan's load and purge search for.
    assert torchtitan_story["listing"] == ["quarantined-step_4", "quarantined-step_4.ckptaudit.json", "step-2",
                                           "step_2.ckptaudit.json"]
    # CheckpointManager.load() (the newest valid step) restored step 2's weights.
    assert torchtitan_story["loaded"] is True and torchtitan_story["loaded_step_2_weights"] is True


@pytest.mark.libs
@pytest.mark.dist
def test_torchtitan_async_save_is_audited_when_its_future_completes(tmp_path: Path) -> None:
    import guard_jobs

    ranks = launch_job(guard_jobs.torchtitan_async, str(tmp_path / "out"))
    zero, one = ranks
    verdicts = [(v["checkpoint"], v["step"], v["ok"], v["report"]) for v in zero["verdicts"]]
    assert verdicts == [("step-2", 2, True, "step_2.ckptaudit.json"),
                        ("step-4", 4, False, "quarantined-step_4.ckptaudit.json")]
    assert set(zero["verdicts"][1]["codes"]) == {"precision.bf16-rounded"}
    assert one["verdicts"] == []  # only rank 0 audits
    assert [r["stopped_at"] for r in ranks] == [4, 4]
    # Both saves returned with their future still held by the manager (really asynchronous).
    assert [r["saves_still_writing_when_save_returned"] for r in ranks] == [2, 2]
    for r in ranks:
        assert r["listing"] == ["quarantined-step_4", "quarantined-step_4.ckptaudit.json", "step-2",
                                "step_2.ckptaudit.json"]
        assert r["loaded"] is True and r["loaded_step_2_weights"] is True
