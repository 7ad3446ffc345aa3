"""Scanning on threads (``--jobs``): the report is the same whatever the number of threads, and the per-tensor
hash stays the documented one (xxh3-128 of the elements' bytes in row-major order, streamed in order)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from ckptaudit.auditing.judge import AuditOptions, run_audit
from ckptaudit.cli import main
from real_checkpoints import chunked_training_state


def _json(*argv: str) -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["audit", *argv, "--format", "json", "--no-progress"], stdout=out, stderr=err)
    assert code in (0, 1), err.getvalue()
    report: dict[str, Any] = json.loads(out.getvalue())
    return report


@pytest.mark.parametrize("fmt", ["torch.save", "dcp", "safetensors"])
def test_jobs_1_and_4_give_the_same_report(scale_checkpoints: dict[str, Path], fmt: str) -> None:
    one = _json(str(scale_checkpoints[fmt]), "--jobs", "1")
    four = _json(str(scale_checkpoints[fmt]), "--jobs", "4")
    assert four == one
    # The check could have seen a difference: several tensors, multi-chunk ones, a rounded one, real hashes.
    tensors = one["tensors"]
    assert len(tensors) >= 4 and all(t["hash"] for t in tensors)
    assert {"bf16", "fp16", "exact"} <= {t["precision"] for t in tensors}
    assert any(f["code"] == "precision.bf16-rounded" for f in one["findings"]) or fmt == "safetensors"


def test_threaded_hash_is_the_documented_sequential_hash(scale_checkpoints: dict[str, Path]) -> None:
    sd, _ = chunked_training_state()
    report = run_audit(str(scale_checkpoints["torch.save"]), AuditOptions(jobs=4, chunk_bytes=64 << 10))
    by_name = {r.name: r for r in report.tensors}
    emb = sd["0.weight"]
    assert emb.numel() * 4 > 16 * (64 << 10)  # many chunks
    expected = xxhash.xxh3_128(np.ascontiguousarray(emb.numpy()).tobytes()).hexdigest()
    assert by_name["model/0.weight"].hash == expected


def test_jobs_must_be_a_positive_whole_number(scale_checkpoints: dict[str, Path]) -> None:
    for bad in ("0", "-2", "two"):
        out, err = io.StringIO(), io.StringIO()
        assert main(["audit", str(scale_checkpoints["torch.save"]), "--jobs", bad], stdout=out, stderr=err) == 2
        assert "--jobs" in err.getvalue() and bad in err.getvalue()
    with pytest.raises(ValueError, match="jobs must be at least 1, got 0"):
        AuditOptions(jobs=0)
