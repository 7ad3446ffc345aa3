"""Fault injection on real processes: a rank killed (SIGKILL) or hung during a save, a failing disk.

Eight gloo ranks train the tiny GPT under FSDP2 (bf16 compute, fp32 masters), commit a checkpoint at step 2
and are saving step 4 when rank 7 dies: while writing its data, after writing it, and while the coordinator
commits. Each time the other ranks must end with an error by themselves (no hang), ``ckptaudit latest`` must
pick step 2, and resuming from it must reproduce the uninterrupted run bit for bit (losses of every rank and
every parameter).
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import store_jobs
from ckptaudit.cli import main
from ckptaudit.latest import find_latest
from ckptaudit.launch import DistributedError, launch

pytestmark = pytest.mark.dist

POINTS = ("write.partial", "write.done", "commit.wait")
PG_TIMEOUT_S = 30.0
"""Bounds every collective. A killed peer is noticed at once (its sockets close); the bound matters for a
rank that hangs (see the 2-rank test), and must exceed the start-up skew of 8 processes on 2 busy cores."""
FAST = {"start_method": "forkserver", "preload": ("torch", "torch.distributed.checkpoint", "torch.distributed.fsdp",
                                                   "ckptaudit.store.writer", "store_jobs")}
"""Ranks forked from a server that imported torch once: 8 ranks start in under a second instead of ~15 s of CPU."""


@pytest.fixture(scope="module")
def rank7_faults(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("rank7")
    runs: dict[str, Any] = {}
    for point in POINTS:
        root = base / point
        t0 = time.monotonic()
        try:
            launch(store_jobs.train_and_save, 8, (str(root), 4, [2, 4]), timeout_s=300, pg_timeout_s=PG_TIMEOUT_S,
                   env={"CKPTAUDIT_FAULT": f"rank=7,point={point},step=4,action=kill"}, **FAST)
        except DistributedError as exc:
            runs[point] = {"root": root, "error": exc, "elapsed": time.monotonic() - t0}
        else:
            runs[point] = {"root": root, "error": None, "elapsed": time.monotonic() - t0}
    # One launch for the uninterrupted reference run and the three resumes (8 ranks each time).
    results = launch(store_jobs.reference_and_resumes, 8, (6, [str(base / p) for p in POINTS]), timeout_s=300,
                     pg_timeout_s=PG_TIMEOUT_S, **FAST)
    return {"runs": runs, "results": results}


@pytest.mark.parametrize("point", POINTS)
def test_rank7_killed_during_a_save(rank7_faults: dict[str, Any], point: str) -> None:
    run = rank7_faults["runs"][point]
    err = run["error"]
    assert isinstance(err, DistributedError), "the save must not succeed with a rank dead"
    failures = {f.rank: f for f in err.failures}
    assert failures[7].reason == "exit" and "-9" in failures[7].detail
    # Every other rank ended by itself with one clear error; none was killed by the harness's deadline.
    assert sorted(failures) == list(range(8))
    for rank in range(7):
        assert failures[rank].reason == "exception", failures[rank]
        last = failures[rank].detail.strip().splitlines()[-1]
        assert "CheckpointSaveError: save of step 4" in last, last
        assert "nothing was committed" in last
        assert "step-000002 is untouched" in last or "aborted by the coordinator" in last
    assert run["elapsed"] < 300

    root: Path = run["root"]
    result = find_latest(str(root))
    assert result.latest is not None and result.latest.name == "step-000002"
    newer = result.checked[0]
    assert newer.candidate.step == 4 and not newer.resumable
    assert {f.code for f in newer.findings} == {"store.uncommitted"}
    out = io.StringIO()
    assert main(["latest", str(root), "--format", "json"], stdout=out, stderr=io.StringIO()) == 0
    assert json.loads(out.getvalue())["latest"] == str(root / "step-000002")

    # Resuming from it reproduces the uninterrupted run, bit for bit, on every rank.
    results = rank7_faults["results"]
    for rank, res in enumerate(results):
        resumed = res["resumed"][str(root)]
        assert (resumed["from"], resumed["start"]) == (str(root / "step-000002"), 2)
        assert resumed["losses"] == res["reference"]["losses"][2:], f"rank {rank}"
    ref, got = results[0]["reference"]["params"], results[0]["resumed"][str(root)]["params"]
    assert ref.keys() == got.keys()
    assert all(torch.equal(ref[k], got[k]) for k in ref), [k for k in ref if not torch.equal(ref[k], got[k])]


def test_failing_disk_and_hung_rank_on_two_ranks(tmp_path: Path) -> None:
    pg_timeout, stall = 8.0, 12.0
    root = tmp_path / "ckpt"
    with pytest.raises(DistributedError) as err:
        launch(store_jobs.failing_storage_then_stall, 2, (str(root), stall), timeout_s=240, pg_timeout_s=pg_timeout,
               **FAST)
    assert [f.rank for f in err.value.failures] == [1]  # rank 1 hung and exited; rank 0 returned
    out = err.value.results[0]
    # The disk failure on rank 1 is reported on rank 0, once, with what is left on disk.
    assert "rank 1: OSError: [Errno 28] No space left on device" in out["enospc"]
    assert "the previous checkpoint step-000002 is untouched" in out["enospc"]
    assert out["listing"] == ["latest", "step-000002"]
    assert out["saved"] == str(root / "step-000004") and out["deleted"] == ["step-000002"]
    # The hung rank: rank 0 gives up through the group timeout, not the harness.
    assert "a rank died or stalled" in out["stall"] and "nothing was committed" in out["stall"]
    assert pg_timeout - 1 <= out["stall_s"] < stall
    result = find_latest(str(root))
    assert result.latest is not None and result.latest.name == "step-000004"
