"""The guard's promises with the real libraries in fast loops (steps of milliseconds; nothing waits for the
audit but the guard itself): at most ``max_unverified`` saves wait for a verdict, ``train()``/``fit()`` end with
``CheckpointAuditFailed`` in stop mode, Lightning's rewritten ``last.ckpt`` gets the verdict of the bytes each
save wrote, retention never deletes the last good checkpoint, and the Accelerate guard. Jobs:
``tests/support/guard_fast_jobs.py``.

Run: ``.venv/bin/python -m pytest -q tests/integrations/test_guard_fast.py``
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

import guard_fast_jobs
from guard_jobs import launch_job, live

pytestmark = pytest.mark.libs


def _pairs(verdicts: list[dict[str, Any]]) -> list[tuple[str, int | None, bool | None]]:
    return [(v["checkpoint"], v["step"], v["ok"]) for v in verdicts]


# ---------------------------------------------------------------------------------------------------------------
# The Trainer


def _check_hf_fast(r: dict[str, Any], audits: bool) -> None:
    # Stopped at the first step end after the failing verdict: at the latest at step 6, where the save's wait
    # for the verdict of step 4 (max_unverified=1) made that verdict arrive.
    assert r["stopped_at"] in (5, 6), r["stopped_at"]
    if not audits:  # a process that does not audit sees the decision and the exception only
        assert r["verdicts"] == [] and r["raised"]["failed"] == []
        return
    # The bound, seen inside each write of checkpoint-N: no earlier save is ever waiting for its verdict.
    assert r["unverified_at_each_write"] == [[]] * len(r["saves"]), r["unverified_at_each_write"]
    good = 6 if r["stopped_at"] == 6 else 2
    assert _pairs(r["verdicts"]) == [("checkpoint-2", 2, True), ("checkpoint-4", 4, False)] + (
        [("checkpoint-6", 6, True)] if good == 6 else [])
    # The end of train() was CheckpointAuditFailed, after everything was saved and quarantined.
    assert r["raised"]["failed"] == ["checkpoint-4"] and "quarantined-checkpoint-4" in r["raised"]["message"]
    assert r["get_last_checkpoint"] == f"checkpoint-{good}" and r["resumed_from_step"] == good


def test_trainer_fast_loop_in_stop_mode_bounds_unverified_saves_and_raises_at_the_end(tmp_path: Path) -> None:
    r = guard_fast_jobs.run("hf_fast", str(tmp_path))
    _check_hf_fast(r, audits=True)
    assert "quarantined-checkpoint-4" in r["listing"] and ".ckptaudit-pins" not in r["listing"]


@pytest.mark.dist
def test_trainer_fast_loop_on_two_ranks_bounds_unverified_saves_and_raises_on_both(tmp_path: Path) -> None:
    zero, one = launch_job(guard_fast_jobs.hf_fast_ddp, str(tmp_path / "out"))
    assert zero["stopped_at"] == one["stopped_at"]
    _check_hf_fast(zero, audits=True)
    _check_hf_fast(one, audits=False)


def test_trainer_fast_loop_whose_last_save_fails_raises_after_the_last_step(tmp_path: Path) -> None:
    r = guard_fast_jobs.run("hf_fast_last", str(tmp_path))
    # The lossy save is the last one (step 12): nothing is left to stop, and its verdict comes after the last step,
    # in on_train_end's wait; train() then raises instead of returning as if all was well.
    assert r["stopped_at"] == 12 and r["saves"] == [2, 4, 6, 8, 10, 12]
    assert r["unverified_at_each_write"] == [[]] * 6, r["unverified_at_each_write"]
    assert _pairs(r["verdicts"]) == [(f"checkpoint-{s}", s, True) for s in (2, 4, 6, 8, 10)] + [
        ("checkpoint-12", 12, False)]
    assert r["raised"]["failed"] == ["checkpoint-12"] and "quarantined-checkpoint-12" in r["raised"]["message"]
    assert "quarantined-checkpoint-12" in r["listing"] and "checkpoint-12" not in r["listing"]
    assert r["get_last_checkpoint"] == "checkpoint-10" and r["resumed_from_step"] == 10


def test_trainer_save_total_limit_never_deletes_the_last_good_checkpoint(tmp_path: Path) -> None:
    r = guard_fast_jobs.run("hf_retention", str(tmp_path))
    # Every save after step 2 came while the audits of the earlier ones were held: Trainer's own rotation
    # (save_total_limit=2) would have deleted checkpoint-2, the only one that had passed, at the save of step 6.
    for names in r["on_disk_at_each_save"][1:]:
        assert "checkpoint-2" in names, r["on_disk_at_each_save"]
    assert _pairs(r["verdicts"]) == [("checkpoint-2", 2, True), ("checkpoint-4", 4, False), ("checkpoint-6", 6, True),
                                     ("checkpoint-8", 8, True), ("checkpoint-10", 10, True)]
    # Once they passed, the limit applied: the 2 newest stay; the older ones went with their reports (no orphan),
    # and the failed one is quarantined with its own.
    assert r["listing"] == ["checkpoint-10", "checkpoint-10.ckptaudit.json", "checkpoint-8",
                            "checkpoint-8.ckptaudit.json", "quarantined-checkpoint-4",
                            "quarantined-checkpoint-4.ckptaudit.json"]
    assert r["get_last_checkpoint"] == "checkpoint-10" and r["limit_after"] == 2


# ---------------------------------------------------------------------------------------------------------------
# Lightning


def _check_lightning_fast(r: dict[str, Any], audits: bool) -> None:
    assert r["stopped_at"] in (5, 6), r["stopped_at"]
    # last.ckpt held the failed state; it is restored to its own content at step 2 (the newest that passed),
    # whose ModelCheckpoint state names last.ckpt: the resumed run rewrites last.ckpt, never last-v1.ckpt.
    assert r["last_global_step"] == 2 and r["resumed_from_step"] == 2
    assert r["resumed_to_step"] == r["stopped_at"] + 4
    assert "last.ckpt" in r["listing_after_resume"]
    assert not [n for n in r["listing_after_resume"] if n.startswith("last-v")], r["listing_after_resume"]
    if not audits:
        assert r["verdicts"] == [] and r["raised"]["failed"] == []
        return
    assert r["unverified_at_each_write"] == [[]] * len(r["saves"]), r["unverified_at_each_write"]
    lossy = [4, 6] if r["stopped_at"] == 6 else [4]
    assert _pairs(r["verdicts"]) == [("epoch=0-step=2.ckpt", 2, True), ("last.ckpt", 2, True)] + [
        p for s in lossy for p in ((f"epoch=0-step={s}.ckpt", s, False), ("last.ckpt", s, False))]
    assert r["raised"]["failed"] == [n for s in lossy for n in (f"epoch=0-step={s}.ckpt", "last.ckpt")]
    assert [n for n in r["listing"] if n.endswith(".ckpt")] == ["epoch=0-step=2.ckpt", "last.ckpt"]


def test_lightning_fast_loop_in_stop_mode_bounds_unverified_saves_and_raises_at_the_end(tmp_path: Path) -> None:
    _check_lightning_fast(guard_fast_jobs.run("lightning_fast", str(tmp_path)), audits=True)


def test_lightning_fast_loop_whose_last_save_fails_raises_after_the_last_step(tmp_path: Path) -> None:
    r = guard_fast_jobs.run("lightning_fast_last", str(tmp_path))
    # The last save (step 12, the end of fitting) is the only lossy one: its verdict comes in on_fit_end's wait, and
    # fit() raises, with step 12's files quarantined and last.ckpt restored to its step-10 content.
    assert r["stopped_at"] == 12 and r["saves"] == [s for s in range(2, 13, 2) for _ in range(2)]
    assert r["unverified_at_each_write"] == [[]] * 12, r["unverified_at_each_write"]
    assert _pairs(r["verdicts"]) == [p for s in range(2, 13, 2) for p in (
        (f"epoch=0-step={s}.ckpt", s, s < 12), ("last.ckpt", s, s < 12))]
    assert r["raised"]["failed"] == ["epoch=0-step=12.ckpt", "last.ckpt"]
    assert {"epoch=0-step=12.ckpt.quarantined", "last.ckpt.quarantined", "last.ckpt"} <= set(r["listing"])
    assert "epoch=0-step=12.ckpt" not in r["listing"]
    assert r["last_global_step"] == 10 and r["resumed_from_step"] == 10
    assert not [n for n in r["listing_after_resume"] if n.startswith("last-v")], r["listing_after_resume"]


@pytest.mark.dist
def test_lightning_fast_loop_on_two_ranks_bounds_unverified_saves_and_raises_on_both(tmp_path: Path) -> None:
    zero, one = launch_job(guard_fast_jobs.lightning_fast_ddp, str(tmp_path / "out"))
    assert zero["stopped_at"] == one["stopped_at"]
    _check_lightning_fast(zero, audits=True)
    _check_lightning_fast(one, audits=False)


@pytest.mark.parametrize("tmpdir", ["same-filesystem", "another-filesystem"])
def test_lightning_rewritten_last_ckpt_gets_the_verdict_of_what_each_save_wrote(tmp_path: Path, tmpdir: str) -> None:
    if tmpdir == "another-filesystem":
        shm = Path("/dev/shm")
        if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
            pytest.skip("no other filesystem for Lightning's temporary file (/dev/shm)")
        temp = shm / f"ckptaudit-{os.getpid()}-{tmp_path.name}"
    else:
        temp = tmp_path / "tmp"
    temp.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    try:
        r = guard_fast_jobs.run("lightning_rewrite", str(out), env={"TMPDIR": str(temp)})
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    # Another filesystem: Lightning copies its temporary file into last.ckpt's own inode (rewrite in place).
    assert (r["tmpdir_device"] == r["ckpts_device"]) == (tmpdir == "same-filesystem")
    verdicts = r["verdicts"]
    assert _pairs(verdicts) == [("epoch=0-step=2.ckpt", 2, True), ("last.ckpt", 2, True),
                                ("epoch=0-step=4.ckpt", 4, False), ("last.ckpt", 4, False),
                                ("epoch=0-step=6.ckpt", 6, True), ("last.ckpt", 6, True),
                                ("epoch=0-step=8.ckpt", 8, True), ("last.ckpt", 8, True)]
    # last.ckpt of step 4 failed for the bytes that save wrote, though the name held step 8's by then: those
    # bytes are quarantined, and the newer last.ckpt is left alone (its own audit passed).
    last4 = verdicts[3]
    assert last4["note"].startswith("replaced since it was saved") and last4["quarantined_to"] == "last.ckpt.quarantined"
    assert r["quarantined_last_step"] == 4 and r["last_step"] == 8
    assert verdicts[-1]["report"] == "last.ckpt.ckptaudit.json"
    # save_top_k=1: ModelCheckpoint asked to remove step 2 at the save of step 4; it stayed while it was the
    # last good one (every later checkpoint still waited for its verdict) ...
    assert all("epoch=0-step=2.ckpt" in names for names in r["on_disk_at_each_step"][2:]), r["on_disk_at_each_step"]
    # ... and the removals of step 2 and of steps 4 and 6 (pending when asked) happened once newer ones had
    # passed, with their reports.
    # Each good one keeps its passport beside it; step 2's went with it.
    assert r["listing"] == ["epoch=0-step=4.ckpt.quarantined", "epoch=0-step=4.ckpt.quarantined.ckptaudit.json",
                            "epoch=0-step=8.ckpt", "epoch=0-step=8.ckpt.ckptaudit.json",
                            "epoch=0-step=8.ckpt.passport.json", "last.ckpt", "last.ckpt.ckptaudit.json",
                            "last.ckpt.passport.json", "last.ckpt.quarantined", "last.ckpt.quarantined.ckptaudit.json"]


@pytest.mark.dist
def test_no_rank_waits_for_an_audit_inside_one_collective(tmp_path: Path) -> None:
    # Audits held 3x longer than the process group's timeout: the other rank waits beside the one that audits in
    # rounds of one short all-reduce (ROUND_S, 1 s), at the save and at the end, so no collective times out. The
    # timeout is 5 s (4 s of slack over a round, on a loaded machine), the holds 15 s: 30 s of waiting, not 60.
    # Both ranks are forked from one server that imported torch (no rank joins the group seconds after the other);
    # ckptaudit's own preload list, since the first launch's list serves every later one in this process.
    from ckptaudit.launch import fast, launch
    from real_checkpoints import trained

    for step in (2, 4):
        trained(tmp_path / f"step={step}.pt")
    zero, one = launch(guard_fast_jobs.held_audit, 2, (str(tmp_path), 15.0), timeout_s=300, pg_timeout_s=5,
                       backend="gloo", **fast("guard_fast_jobs"))
    assert (zero["judged_before_the_save"], zero["waits"], zero["verdicts"], zero["done"]) == (1, [(4, 1)],
                                                                                               [True, True], True)
    assert (one["waits"], one["verdicts"], one["done"]) == ([], [], True)


def test_torchtitan_keep_latest_k_never_purges_the_last_good_checkpoint(tmp_path: Path) -> None:
    r = guard_fast_jobs.run("torchtitan_retention", str(tmp_path))
    # keep_latest_k=2 taken over: torchtitan's own purge would delete step-2, the only one that had passed, at
    # the save of step 6, while the audits of steps 4 and 6 were held.
    assert r["keep_latest_k"] == 0 and all("step-2" in names for names in r["on_disk_at_each_save"]), r
    assert _pairs(r["verdicts"]) == [("step-2", 2, True), ("step-4", 4, False), ("step-6", 6, True),
                                     ("step-8", 8, True), ("step-10", 10, True)]
    # The job rounds the live masters in place around the save of step 4 (put back after it): at that save point
    # the training state held only bf16 values, so the guard counts steps 6 to 10 as descending from that damage and
    # moves them aside as it moves a failure (torchtitan's own load, the newest step-N, never picks one), and step 2
    # stays, the last good one (what torchtitan loads and `ckptaudit latest` names).
    assert [v["damaged_ancestor"] for v in r["verdicts"]] == [None, None, "step-4", "step-4", "step-4"]
    assert r["listing"] == [n for s in (10, 4, 6, 8) for n in (f"quarantined-step_{s}",
                                                               f"quarantined-step_{s}.ckptaudit.json")] + [
        "step-2", "step_2.ckptaudit.json"], r["listing"]


# ---------------------------------------------------------------------------------------------------------------
# Accelerate


@pytest.mark.dist
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_accelerate_save_state_quarantines_a_bad_folder_and_load_state_resumes_the_good_one(tmp_path: Path,
                                                                                           parallel: str) -> None:
    job = {"ddp": guard_fast_jobs.accelerate_ddp, "fsdp": guard_fast_jobs.accelerate_fsdp}[parallel]
    zero, one = launch_job(job, str(tmp_path / "out"))
    # Accelerate's own layouts: FSDP2's sharded parameters saved as its DCP folders, DDP's as one file.
    assert zero["sharded"] == (parallel == "fsdp")
    assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(zero["layout"]) if parallel == "fsdp" else (
        "model.safetensors" in zero["layout"]), zero["layout"]
    assert zero["stopped_at"] == one["stopped_at"] and zero["stopped_at"] in (5, 6)
    good = 2 if zero["stopped_at"] == 6 else 0
    assert _pairs(zero["verdicts"]) == [("checkpoint_0", 0, True), ("checkpoint_1", 1, False)] + (
        [("checkpoint_2", 2, True)] if good == 2 else [])
    assert one["verdicts"] == []
    if parallel == "fsdp":  # the masters saved as their bf16 values: what the audit names
        assert "precision.bf16-rounded" in zero["verdicts"][1]["codes"], zero["verdicts"][1]
    # Held to the live run's contract (the reports that remain: the failed one's, the newest good one's).
    for v in (zero["verdicts"][1], zero["verdicts"][-1 if good else 0]):
        live(v, "Accelerate mixed_precision=no")
    # total_limit=1: Accelerate's own rotation deletes the oldest folder before each save, checkpoint_0 at the
    # save of checkpoint_1; the guard kept it until a newer one had passed.
    assert zero["on_disk_at_each_save"][:2] == [["checkpoint_0"], ["checkpoint_0", "checkpoint_1"]]
    # FSDP's job rounds the live masters in place: checkpoint_2 descends from that damage, so the guard moves it aside
    # as it moves a failure, and load_state() (the newest checkpoint_N) restores checkpoint_0, the last good one (the
    # exporter hook of DDP's job rounds only the file: checkpoint_2 is good there).
    aside = parallel == "fsdp" and good == 2
    kept, restored = ([0], 0) if aside else ([good], good)
    if aside:
        assert zero["verdicts"][1]["damage"] == "state" and zero["verdicts"][2]["damaged_ancestor"] == "checkpoint_1"
    elif len(zero["verdicts"]) > 1:
        assert zero["verdicts"][1]["damage"] == ("state" if parallel == "fsdp" else "file")
    for r in (zero, one):
        assert r["checkpoints"] == [f"checkpoint_{k}" for k in kept]  # nothing of ckptaudit's in load_state's folder
        assert r["home"] == [f"checkpoint_{k}.ckptaudit.json" for k in kept] + [
            n for k in ([1, 2] if aside else [1]) for n in (f"quarantined-checkpoint_{k}",
                                                           f"quarantined-checkpoint_{k}.ckptaudit.json")], r["home"]
        assert r["loaded_iteration"] == [restored]  # load_state() restored the weights saved in the good folder
    assert zero["raised"]["failed"] == ["checkpoint_1"] and one["raised"]["failed"] == []
