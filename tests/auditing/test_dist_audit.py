"""The distributed audit: ``torchrun -m ckptaudit audit`` on 2 and 4 local ranks prints one report, equal to
the single-process one (the run's evidence included: a checkpoint cast to bf16 beside float32 siblings is
``contract.run-mismatch`` under torchrun too); a rank that cannot read the path makes one error, not a hang."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.auditing.distributed import partition, shares_of, torchrun_rank
from ckptaudit.cli import main
from real_checkpoints import trained
from runs import torchrun


def _single(path: Path) -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["audit", str(path), "--format", "json", "--no-progress", "--jobs", "1"], stdout=out, stderr=err)
    assert code in (0, 1), err.getvalue()
    report: dict[str, Any] = json.loads(out.getvalue())
    return report


@pytest.mark.parametrize(("fmt", "nproc"), [("dcp", 2), ("torch.save", 4)])
def test_torchrun_prints_the_single_process_report(scale_checkpoints: dict[str, Path], tmp_path: Path, fmt: str,
                                                   nproc: int) -> None:
    path = scale_checkpoints[fmt]
    expected = _single(path)
    run = torchrun(nproc, "audit", str(path), "--format", "json", "--no-progress", cwd=tmp_path)
    # torchrun turns rank 0's exit code 1 (findings at the fail level) into its own 1.
    assert run.returncode in (0, 1), run.stderr[-3000:]
    got = json.loads(run.stdout)  # exactly one JSON document: the other ranks printed nothing
    assert got["findings"] == expected["findings"]
    assert got["tensors"] == expected["tensors"]
    assert got == expected
    assert len(got["tensors"]) >= 8
    assert {"bf16", "fp16", "exact"} <= {t["precision"] for t in got["tensors"]}
    # torchrun prints its own ChildFailedError traceback for exit code 1; no frame of ours may appear.
    assert not re.search(r'File ".*ckptaudit', run.stderr), run.stderr[-3000:]


def test_torchrun_holds_a_checkpoint_to_its_runs_evidence_as_one_process_does(tmp_path: Path) -> None:
    """Steps 2-6 hold float32 masters, step 8 was cast to bf16 (model and moments): 2 gloo ranks give the
    single-process report, ``contract.run-mismatch`` naming the siblings, read by rank 0."""
    import torch

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for step in (2, 4, 6, 8):
        trained(run_dir / f"ckpt-{step:04d}.pt")
    cast = run_dir / "ckpt-0008.pt"
    doc = torch.load(cast, weights_only=True)
    doc["model"] = {k: v.bfloat16() for k, v in doc["model"].items()}
    for state in doc["optimizer"]["state"].values():
        state.update({k: v.bfloat16() for k, v in state.items() if v.is_floating_point() and v.dim() > 0})
    torch.save(doc, cast)
    expected = _single(cast)
    (mismatch,) = [f for f in expected["findings"] if f["code"] == "contract.run-mismatch"]
    assert mismatch["message"].startswith("steps 2-6 hold float32 masters"), mismatch
    run = torchrun(2, "audit", str(cast), "--format", "json", "--no-progress", cwd=tmp_path)
    assert run.returncode == 1, run.stderr[-3000:]
    got = json.loads(run.stdout)
    assert [f["code"] for f in got["findings"]] == [f["code"] for f in expected["findings"]], run.stderr[-3000:]
    assert got == expected


def test_torchrun_on_a_missing_path_fails_once_with_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-checkpoint"
    run = torchrun(2, "audit", str(missing), "--no-progress", cwd=tmp_path)
    assert run.returncode != 0
    assert run.stdout == ""
    errors = [line for line in run.stderr.splitlines() if line.startswith("ckptaudit audit: error:")]
    assert len(errors) == 1 and str(missing) in errors[0], run.stderr[-3000:]


def test_partition_balances_bytes_and_covers_every_item_once() -> None:
    sizes = {i: s for i, s in enumerate([100, 1, 50, 50, 7, 0, 99, 3, 3, 60])}
    for world in (1, 2, 3, 4, 16):
        shares = partition(sizes, world)
        assert len(shares) == world
        flat = sorted(i for s in shares for i in s)
        assert flat == sorted(sizes)
        assert all(s == sorted(s) for s in shares)
        assert partition(sizes, world) == shares  # deterministic: every rank computes the same split
        loads = shares_of(list(sizes.values()), world)
        # Greedy by size: no share exceeds the mean by more than the largest item.
        assert max(loads) <= sum(sizes.values()) / world + max(sizes.values())
    assert shares_of([4, 4, 4, 4, 1, 1], 2) == [9, 9]
    with pytest.raises(ValueError, match="world_size must be at least 1, got 0"):
        partition(sizes, 0)


def test_torchrun_environment_is_detected_and_checked() -> None:
    assert torchrun_rank({}) is None
    assert torchrun_rank({"RANK": "0", "WORLD_SIZE": "2"}) is None  # no rendezvous address: not torchrun
    place = torchrun_rank({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"})
    assert place is not None and (place.rank, place.world_size) == (1, 2)
    with pytest.raises(ValueError, match="RANK=2 is not within WORLD_SIZE=2"):
        torchrun_rank({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})
    with pytest.raises(ValueError, match="must be whole numbers"):
        torchrun_rank({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})
