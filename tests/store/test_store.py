"""The resumable-checkpoint writer, its manifest, retention and ``ckptaudit latest`` in one real process.

Real models, real ``torch.distributed.checkpoint`` (single-process mode), real files; the multi-rank fault
tests are in ``test_store_dist.py``.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptaudit.auditing.judge import run_audit
from ckptaudit.cli import main
from ckptaudit.findings import Severity
from ckptaudit.latest import find_latest
from ckptaudit.launch import RankContext
from ckptaudit.recipes import Job
from ckptaudit.recipes.tinygpt import plain_recipe
from ckptaudit.store import (
    CheckpointLoadError,
    CheckpointSaveError,
    load_checkpoint,
    plan_retention,
    save_checkpoint,
)
from ckptaudit.store.faults import parse_fault
from store_jobs import CTX, one_thread, trained  # noqa: F401  (one_thread: the fixture pytestmark uses)

pytestmark = pytest.mark.usefixtures("one_thread")


def codes(findings: Any, severity: Severity | None = None) -> set[str]:
    return {f.code for f in findings if severity is None or f.severity is severity}


def largest_shard(ckpt: Path) -> dict[str, Any]:
    manifest = json.loads((ckpt / "manifest.json").read_text())
    return max((s for t in manifest["tensors"].values() for s in t["shards"]), key=lambda s: s["length"])


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x40]))


def test_resume_restores_everything_bit_identically(tmp_path: Path) -> None:
    job = trained(2)
    saved = save_checkpoint(job, tmp_path, extras={"run": "abc", "lr": 3e-3})
    assert saved.path == str(tmp_path / "step-000002")
    assert (tmp_path / "latest").read_text() == "step-000002\n"
    # The uninterrupted run: dropout draws from torch's CPU generator; the data stream is positional.
    losses = [plain_recipe.step(job) for _ in range(3)]
    params = {k: v.clone() for k, v in job.model.state_dict().items()}
    draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))

    fresh = plain_recipe.setup(RankContext(rank=0, world_size=1, backend="gloo", shared_dir=""))
    random.seed(99)
    np.random.seed(99)  # disturb what the checkpoint must restore
    loaded = load_checkpoint(fresh, tmp_path)
    assert (loaded.path, loaded.step, loaded.extras) == (saved.path, 2, {"run": "abc", "lr": 3e-3})
    assert fresh.data.position == 2 and fresh.scheduler.last_epoch == 2
    assert [plain_recipe.step(fresh) for _ in range(3)] == losses
    assert all(torch.equal(params[k], v) for k, v in fresh.model.state_dict().items())
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == draws


def test_the_writer_as_a_resume_test_exporter(tmp_path: Path) -> None:
    from ckptaudit.exporters.store import resumable

    job = trained(3)
    resumable(job, str(tmp_path))
    expected = [plain_recipe.step(job) for _ in range(2)]
    fresh = trained(0)
    resumable.load(fresh, str(tmp_path))  # type: ignore[attr-defined]
    assert fresh.step == 3 and [plain_recipe.step(fresh) for _ in range(2)] == expected


def test_committed_checkpoint_audits_clean_under_its_manifest(tmp_path: Path) -> None:
    saved = save_checkpoint(trained(2), tmp_path)
    manifest = json.loads(Path(saved.path, "manifest.json").read_text())
    assert manifest["contract"]["master_dtype"] == "float32"
    n_params = len(list(trained(0).model.parameters()))
    assert manifest["contract"]["parameter_dtypes"] == {"float32": n_params}
    assert manifest["contract"]["optimizer_state_dtypes"] == {"float32": 2 * n_params}  # exp_avg, exp_avg_sq
    assert set(manifest["components"]) >= {"model", "optimizer", "scheduler", "rng", "data-progress", "step"}
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp"}
    report = run_audit(saved.path)
    assert report.findings == (), [f.message for f in report.findings]
    assert report.format == "ckptaudit"
    assert report.contract is not None and report.contract.source == "manifest"
    # The writer hashed every tensor's values in memory; the audit's own hashes agree with all of them.
    by_name = {r.name.replace("/", "."): r.hash for r in report.tensors}
    assert all(t["shards"][0]["content_xxh3_128"] == by_name[k] for k, t in manifest["tensors"].items())


def test_flipped_byte_is_caught_everywhere(tmp_path: Path) -> None:
    saved = Path(save_checkpoint(trained(2), tmp_path).path)
    shard = largest_shard(saved)
    flip_byte(saved / shard["file"], shard["offset"] + shard["length"] // 2)
    report = run_audit(str(saved))
    corrupt = [f for f in report.findings if f.code == "integrity.corrupt"]
    assert corrupt and corrupt[0].subject == shard["file"], report.findings
    assert "changed item(s)" in corrupt[0].message
    result = find_latest(str(tmp_path))
    assert result.latest is None
    assert "integrity.corrupt" in codes(result.checked[0].findings)
    with pytest.raises(CheckpointLoadError, match="does not match its manifest"):
        load_checkpoint(trained(0), tmp_path / "step-000002")
    # Sizes alone cannot see it: the option exists for speed, and says what it skips.
    assert find_latest(str(tmp_path), verify="sizes").latest is not None


@pytest.mark.parametrize("damage", ["truncate", "delete-data", "delete-metadata"])
def test_truncated_or_missing_files_are_incomplete(tmp_path: Path, damage: str) -> None:
    save_checkpoint(trained(1), tmp_path)
    good = Path(save_checkpoint(trained(2), tmp_path).path)
    if damage == "truncate":
        with open(good / "__0_0.distcp", "r+b") as fh:
            fh.truncate(os.path.getsize(good / "__0_0.distcp") // 2)
    elif damage == "delete-data":
        (good / "__0_0.distcp").unlink()
    else:
        (good / ".metadata").unlink()
    assert "integrity.incomplete" in codes(run_audit(str(good)).findings, Severity.ERROR)
    result = find_latest(str(tmp_path))
    assert result.latest is not None and result.latest.name == "step-000001"
    assert "integrity.incomplete" in codes(result.checked[0].findings)
    assert any(f.code == "store.pointer-stale" for f in result.findings)  # the pointer still names step 2
    with pytest.raises(CheckpointLoadError):
        load_checkpoint(trained(0), good)


def test_loading_into_another_dtype_is_refused_unless_allowed(tmp_path: Path) -> None:
    save_checkpoint(trained(2), tmp_path)

    def bf16_job() -> Job:
        job = trained(0)
        job.model.to(torch.bfloat16)
        job.optimizer = torch.optim.AdamW(job.model.parameters(), lr=plain_recipe.lr)
        job.scheduler = torch.optim.lr_scheduler.LambdaLR(job.optimizer, lambda s: 1.0)
        return job

    with pytest.raises(CheckpointLoadError) as err:
        load_checkpoint(bf16_job(), tmp_path)
    text = str(err.value)
    assert "saved as float32 but the live tensor is bfloat16" in text
    assert "pytorch/pytorch#187138" in text and "allow_dtype_change=True" in text
    job = bf16_job()
    loaded = load_checkpoint(job, tmp_path, allow_dtype_change=True)
    assert loaded.casts and all(p.dtype is torch.bfloat16 for p in job.model.parameters())


def test_failing_storage_leaves_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    job = trained(2)
    save_checkpoint(job, tmp_path)
    plain_recipe.step(job)
    plain_recipe.step(job)

    def full_disk(point: str) -> None:
        if point == "write.partial":
            raise OSError(28, "No space left on device")

    with pytest.raises(CheckpointSaveError) as err:
        save_checkpoint(job, tmp_path, keep_last=1, fault_hook=full_disk)
    text = str(err.value)
    assert "No space left on device" in text and "rank 0" in text
    assert "the previous checkpoint step-000002 is untouched" in text
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-000002"]  # temporary removed, retention never ran
    result = find_latest(str(tmp_path))
    assert result.latest is not None and result.latest.name == "step-000002" and not result.findings


def _mount_tmpfs(path: Path, size: int) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, check=False)
    return done.returncode == 0


def test_a_really_full_disk(tmp_path: Path) -> None:
    job = trained(2)
    probe = Path(save_checkpoint(job, tmp_path / "probe").path)
    one = sum(f.stat().st_size for f in probe.iterdir())
    disk = tmp_path / "disk"
    # Room for one checkpoint and a half: the second cannot fit beside the first.
    if not _mount_tmpfs(disk, (one * 3 // 2 + 4095) // 4096 * 4096):
        pytest.skip("needs root and mount -t tmpfs for a real full disk (the injected ENOSPC test covers the rest)")
    try:
        first = save_checkpoint(job, disk, keep_last=1)
        plain_recipe.step(job)
        with pytest.raises(CheckpointSaveError) as err:
            save_checkpoint(job, disk, keep_last=1)
        # torch's zip writer may report ENOSPC as a short write; the message says what the disk looks like.
        assert "is full" in str(err.value) or "No space left on device" in str(err.value), err.value
        assert "the previous checkpoint step-000002 is untouched" in str(err.value)
        assert sorted(os.listdir(disk)) == ["latest", "step-000002"]
        assert find_latest(str(disk)).latest is not None
        assert load_checkpoint(trained(0), disk).path == first.path
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_retention_keeps_the_newest_resumable_ones_after_the_commit(tmp_path: Path) -> None:
    job = trained(0)
    deleted: list[str] = []
    for _ in range(4):
        plain_recipe.step(job)
        deleted += save_checkpoint(job, tmp_path, keep_last=2).deleted
    assert deleted == ["step-000001", "step-000002"]
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-000003", "step-000004"]
    # A damaged newest checkpoint does not count towards keep_last: the last good one is never deleted.
    (tmp_path / "step-000004" / "__0_0.distcp").unlink()
    assert plan_retention(str(tmp_path), 1) == []
    plain_recipe.step(job)
    assert save_checkpoint(job, tmp_path, keep_last=1).deleted == ("step-000003", "step-000004")


def test_a_crash_after_the_rename_leaves_a_committed_checkpoint_and_a_stale_pointer(tmp_path: Path) -> None:
    job = trained(1)
    save_checkpoint(job, tmp_path)
    plain_recipe.step(job)

    def crash(point: str) -> None:
        if point == "commit.renamed":
            raise RuntimeError("coordinator lost after the rename")

    with pytest.raises(RuntimeError):
        save_checkpoint(job, tmp_path, fault_hook=crash)
    result = find_latest(str(tmp_path))
    assert result.latest is not None and result.latest.name == "step-000002"
    assert [f.code for f in result.findings] == ["store.pointer-stale"]
    assert result.findings[0].message.startswith(
        "ckptaudit's latest pointer (ckptaudit.store's save_checkpoint advances it) names step-000001, which is "
        "older than the newest resumable checkpoint; the newest resumable checkpoint is step-000002.")


def test_an_uncommitted_directory_is_rejected_then_removed_by_the_next_save(tmp_path: Path) -> None:
    job = trained(1)
    save_checkpoint(job, tmp_path)
    plain_recipe.step(job)

    def die(point: str) -> None:
        if point == "commit.manifest":
            raise RuntimeError("coordinator lost before the vote")

    with pytest.raises(RuntimeError):
        save_checkpoint(job, tmp_path, fault_hook=die)
    partial = [n for n in os.listdir(tmp_path) if ".partial-" in n]
    assert len(partial) == 1 and (tmp_path / partial[0] / ".metadata").exists()
    result = find_latest(str(tmp_path))
    assert result.latest is not None and result.latest.name == "step-000001"
    assert result.checked[0].candidate.name == partial[0]
    assert codes(result.checked[0].findings) == {"store.uncommitted"}
    assert "plain torch.distributed.checkpoint would call it complete" in result.checked[0].reason
    assert "store.uncommitted" in codes(run_audit(str(tmp_path / partial[0])).findings)
    save_checkpoint(job, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-000001", "step-000002"]


def test_existing_step_is_not_replaced_unless_asked(tmp_path: Path) -> None:
    job = trained(2)
    save_checkpoint(job, tmp_path)
    with pytest.raises(CheckpointSaveError, match="already exists"):
        save_checkpoint(job, tmp_path)
    plain_recipe.step(job)
    save_checkpoint(job, tmp_path, step=2, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-000002"]
    assert load_checkpoint(trained(0), tmp_path).step == 2


class TensorStateLoader:
    """Shaped like torchdata's StatefulDataLoader: nested state with tensors (a generator state) inside."""

    def __init__(self) -> None:
        self.gen = torch.Generator().manual_seed(5)
        self.epoch = 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "sampler": {"generator": self.gen.get_state(), "yielded": [1, 2]}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = state["epoch"]
        self.gen.set_state(state["sampler"]["generator"])


def test_stateful_data_loader_by_duck_typing(tmp_path: Path) -> None:
    job = trained(1)
    job.data = TensorStateLoader()
    job.data.epoch = 3
    torch.rand(7, generator=job.data.gen)
    save_checkpoint(job, tmp_path)
    expected = torch.rand(4, generator=job.data.gen)
    fresh = trained(0)
    fresh.data = TensorStateLoader()
    load_checkpoint(fresh, tmp_path)
    assert fresh.data.epoch == 3 and torch.equal(torch.rand(4, generator=fresh.data.gen), expected)


class Custom:
    """Not a plain value: pickles, but would need arbitrary code to load."""


class BadData:
    def state_dict(self) -> dict[str, Any]:
        return {"obj": Custom()}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def test_unsaveable_state_fails_at_save_time_with_the_fix(tmp_path: Path) -> None:
    job = trained(1)
    with pytest.raises(CheckpointSaveError, match="extras must be JSON values"):
        save_checkpoint(job, tmp_path, extras={"t": torch.ones(1)})
    job.data = BadData()
    with pytest.raises(CheckpointSaveError, match=r"job.data.state_dict\(\).*plain values"):
        save_checkpoint(job, tmp_path)
    assert os.listdir(tmp_path) == []  # no checkpoint, no temporary left behind


def test_mismatched_jobs_and_world_sizes_are_refused(tmp_path: Path) -> None:
    saved = Path(save_checkpoint(trained(2), tmp_path).path)
    no_sched = trained(0)
    no_sched.scheduler = None
    with pytest.raises(CheckpointLoadError, match="holds scheduler state but job has none"):
        load_checkpoint(no_sched, saved)
    assert load_checkpoint(no_sched, saved, strict=False).skipped
    manifest = json.loads((saved / "manifest.json").read_text())
    manifest["world_size"] = 4
    (saved / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointLoadError, match="saved by 4 rank"):
        load_checkpoint(trained(0), saved)
    assert load_checkpoint(trained(0), saved, allow_world_size_change=True).step == 2


def test_hostile_manifest_is_not_followed(tmp_path: Path) -> None:
    saved = Path(save_checkpoint(trained(1), tmp_path).path)
    manifest = json.loads((saved / "manifest.json").read_text())
    manifest["files"]["../../etc/passwd"] = {"size": 1, "xxh3_128": "0" * 32}
    (saved / "manifest.json").write_text(json.dumps(manifest))
    report = run_audit(str(saved))
    assert any(f.code == "integrity.corrupt" and "not a plain name" in f.message for f in report.findings)
    assert find_latest(str(tmp_path)).latest is None
    with pytest.raises(CheckpointLoadError, match="not a plain name"):
        load_checkpoint(trained(0), saved)


def test_a_data_file_swapped_for_a_link_outside_is_not_followed(tmp_path: Path) -> None:
    saved = Path(save_checkpoint(trained(1), tmp_path / "run").path)
    outside = tmp_path / "elsewhere.distcp"
    shutil.move(saved / "__0_0.distcp", outside)
    (saved / "__0_0.distcp").symlink_to(outside)
    assert "integrity.path-escape" in codes(run_audit(str(saved)).findings, Severity.ERROR)
    assert find_latest(str(tmp_path / "run")).latest is None
    with pytest.raises(CheckpointLoadError, match="outside"):
        load_checkpoint(trained(0), saved)


def test_fault_specs_parse_or_say_what_is_wrong() -> None:
    assert parse_fault("rank=7,point=write.partial,step=4") == (7, "write.partial", 4, "kill")
    assert parse_fault("rank=0,point=commit.manifest,action=enospc") == (0, "commit.manifest", None, "enospc")
    with pytest.raises(ValueError, match=r"point 'write' is not one of collect, write\.partial"):
        parse_fault("rank=1,point=write")
    with pytest.raises(ValueError, match="rank= and point= are required"):
        parse_fault("point=collect")


# ---------------------------------------------------------------------------------------------------------------
# `ckptaudit latest` over the layouts other tools write


def _dcp_save(state: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(path), no_dist=True)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_latest_over_torchtitan_and_plain_dcp_directories(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    job = trained(1)
    msd, osd = get_state_dict(job.model, job.optimizer)
    _dcp_save({**msd, "optimizer": osd, "lr_scheduler": job.scheduler.state_dict(),
               "train_state": {"step": 10}}, tmp_path / "step-10")
    _dcp_save({**msd, "optimizer": osd, "train_state": {"step": 20}}, tmp_path / "step-20")
    (tmp_path / "step-20" / ".metadata").unlink()  # died before the coordinator's commit
    (tmp_path / "step-30").mkdir()  # died before writing anything
    result = find_latest(str(tmp_path))
    assert [c.candidate.name for c in result.checked] == ["step-30", "step-20", "step-10"]
    assert result.latest is not None and result.latest.name == "step-10" and result.latest.layout == "torchtitan"
    assert all("integrity.incomplete" in codes(c.findings) for c in result.checked[:2])
    assert "store.unverified" in codes(result.checked[2].findings)


def _hf_checkpoint(path: Path, job: Job, step: int, *, finished: bool) -> None:
    from safetensors.torch import save_file

    path.mkdir()
    save_file({k: v.contiguous() for k, v in job.model.state_dict().items()}, str(path / "model.safetensors"))
    torch.save(job.optimizer.state_dict(), path / "optimizer.pt")
    torch.save(job.scheduler.state_dict(), path / "scheduler.pt")
    torch.save({"python": random.getstate(), "cpu": torch.get_rng_state()}, path / "rng_state.pth")
    if finished:  # Trainer writes trainer_state.json last
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step, "epoch": 0.1}))


def test_latest_over_hugging_face_and_lightning_checkpoints(tmp_path: Path) -> None:
    job = trained(1)
    hf = tmp_path / "hf"
    hf.mkdir()
    _hf_checkpoint(hf / "checkpoint-10", job, 10, finished=True)
    _hf_checkpoint(hf / "checkpoint-20", job, 20, finished=False)
    result = find_latest(str(hf))
    assert result.latest is not None and result.latest.name == "checkpoint-10"
    assert "trainer_state.json" in result.checked[0].reason

    pl = tmp_path / "lightning"
    pl.mkdir()
    buf = io.BytesIO()
    torch.save({"state_dict": job.model.state_dict(), "optimizer_states": [job.optimizer.state_dict()],
                "lr_schedulers": [job.scheduler.state_dict()], "loops": {"fit_loop": {}}, "global_step": 5,
                "epoch": 0}, buf)
    (pl / "epoch=0-step=5.ckpt").write_bytes(buf.getvalue())
    (pl / "epoch=0-step=9.ckpt").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    result = find_latest(str(pl))
    assert result.latest is not None and result.latest.name == "epoch=0-step=5.ckpt"
    assert result.checked[0].candidate.step == 9 and not result.checked[0].resumable


def test_cli_latest_json_and_exit_codes(tmp_path: Path) -> None:
    job = trained(1)
    save_checkpoint(job, tmp_path / "run")
    plain_recipe.step(job)
    save_checkpoint(job, tmp_path / "run")
    (tmp_path / "run" / "step-000002" / "manifest.json").write_text("{not json")
    out, err = io.StringIO(), io.StringIO()
    assert main(["latest", str(tmp_path / "run"), "--format", "json"], stdout=out, stderr=err) == 0
    doc = json.loads(out.getvalue())
    assert doc["latest"] == str(tmp_path / "run" / "step-000001")
    assert [(c["name"], c["resumable"]) for c in doc["candidates"]] == [("step-000002", False),
                                                                        ("step-000001", True)]
    assert doc["candidates"][0]["findings"][0]["code"] == "integrity.corrupt"
    out = io.StringIO()
    assert main(["latest", str(tmp_path / "run"), "--verify", "full", "--format", "json"], stdout=out,
                stderr=err) == 0
    assert json.loads(out.getvalue())["latest"] == str(tmp_path / "run" / "step-000001")
    (tmp_path / "empty").mkdir()
    out = io.StringIO()
    assert main(["latest", str(tmp_path / "empty"), "--format", "json"], stdout=out, stderr=err) == 1
    assert json.loads(out.getvalue())["latest"] is None
    err = io.StringIO()
    assert main(["latest", str(tmp_path / "nowhere")], stdout=io.StringIO(), stderr=err) == 2
    assert "no such file or directory" in err.getvalue()


def test_every_file_and_directory_is_fsynced_before_the_rename_that_publishes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Durability, one fsync at a time: every os.fsync (the writer's and DCP's) and every rename is recorded, the
    fsynced object identified by its inode (a file keeps its inode through renames). Before the commit rename:
    every file of the checkpoint, then its directory (after the last file, so the entries are durable too); after
    it, the root. The ``latest`` pointer: its file before the replace, the root after."""
    events: list[tuple[str, int]] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd: int) -> None:
        real_fsync(fd)
        events.append(("fsync", os.fstat(fd).st_ino))

    def renamer(real: Any, kind: str) -> Any:
        def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            real(src, dst, *args, **kwargs)
            events.append((f"{kind}:{os.path.basename(os.fspath(dst))}", os.stat(dst).st_ino))
        return rename

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", renamer(real_rename, "rename"))
    monkeypatch.setattr(os, "replace", renamer(real_replace, "replace"))
    saved = save_checkpoint(trained(2), tmp_path / "ckpts")
    monkeypatch.undo()

    final, root = Path(saved.path), tmp_path / "ckpts"
    ino = {p.name: p.stat().st_ino for p in final.iterdir()}
    assert set(ino) == {".metadata", "__0_0.distcp", "manifest.json"}
    commit = events.index(("rename:step-000002", final.stat().st_ino))
    before, after = events[:commit], events[commit + 1:]

    def last_fsync(inode: int, within: list[tuple[str, int]], what: str = "") -> int:
        hits = [i for i, e in enumerate(within) if e == ("fsync", inode)]
        assert hits, f"never fsynced in time: {what or [n for n, i in ino.items() if i == inode]} (inode {inode})"
        return hits[-1]

    files_done = max(last_fsync(i, before) for i in ino.values())
    assert last_fsync(final.stat().st_ino, before, "the checkpoint directory") > files_done, "directory before files"
    assert ("fsync", root.stat().st_ino) in before[:files_done], "the root after creating the temporary directory"
    pointer = events.index(("replace:latest", (root / "latest").stat().st_ino))
    assert last_fsync((root / "latest").stat().st_ino, events[commit:pointer], "the latest pointer") >= 0
    assert ("fsync", root.stat().st_ino) in events[commit + 1:pointer], "the root after the commit rename"
    assert ("fsync", root.stat().st_ino) in events[pointer + 1:], "the root after the pointer's replace"
    assert after, "nothing after the commit"
