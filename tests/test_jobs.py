"""Scanning on threads (``--jobs``): the report is the same whatever the number of threads, and the per-tensor
hash stays the documented one (xxh3-128 of the elements' bytes in row-major order, streamed in order)."""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from ckptaudit.audit import AuditOptions, audit
from ckptaudit.cli import main


def _training_state() -> tuple[dict[str, Any], dict[str, Any]]:
    """A small model whose embedding spans several 1 MiB chunks, after two real AdamW steps; one layer's
    weights rounded to bf16 as a compute-copy exporter would leave them (so both precision paths run)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(1024, 640), torch.nn.Linear(640, 64), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 640))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randint(0, 1024, (4, 8))).sum().backward()
        opt.step()
        opt.zero_grad()
    sd = model.state_dict()
    sd["1.weight"] = sd["1.weight"].bfloat16().float()
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in opt.param_groups for p in g["params"]]
    osd = opt.state_dict()
    state = {names[id(params[i])]: s for i, s in osd["state"].items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(params[i])] for i in g["params"]]}
              for g in osd["param_groups"]]
    return sd, {"state": state, "param_groups": groups}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same training state as torch.save, single-process DCP and safetensors (model), written once."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp("jobs")
    sd, osd = _training_state()
    torch.save({"model": sd, "optimizer": osd, "step": 2}, out / "ckpt.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": a single-process save is what we want
        dcp.save({"model": sd, "optim": osd, "step": torch.tensor(2)}, checkpoint_id=str(out / "dcp"))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
    return {"torch.save": out / "ckpt.pt", "dcp": out / "dcp", "safetensors": out / "model.safetensors"}


def _json(*argv: str) -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["audit", *argv, "--format", "json", "--no-progress"], stdout=out, stderr=err)
    assert code in (0, 1), err.getvalue()
    report: dict[str, Any] = json.loads(out.getvalue())
    return report


@pytest.mark.parametrize("fmt", ["torch.save", "dcp", "safetensors"])
def test_jobs_1_and_4_give_the_same_report(checkpoints: dict[str, Path], fmt: str) -> None:
    one = _json(str(checkpoints[fmt]), "--jobs", "1")
    four = _json(str(checkpoints[fmt]), "--jobs", "4")
    assert four == one
    # The check could have seen a difference: several tensors, multi-chunk ones, a rounded one, real hashes.
    tensors = one["tensors"]
    assert len(tensors) >= 4 and all(t["hash"] for t in tensors)
    assert any(t["precision"] == "bf16" for t in tensors), [t["precision"] for t in tensors]
    assert any(f["code"] == "precision.bf16-rounded" for f in one["findings"]) or fmt == "safetensors"


def test_threaded_hash_is_the_documented_sequential_hash(checkpoints: dict[str, Path]) -> None:
    sd, _ = _training_state()
    report = audit(str(checkpoints["torch.save"]), AuditOptions(jobs=4, chunk_bytes=64 << 10))
    by_name = {r.name: r for r in report.tensors}
    emb = sd["0.weight"]
    assert emb.numel() * 4 > 16 * (64 << 10)  # many chunks
    expected = xxhash.xxh3_128(np.ascontiguousarray(emb.numpy()).tobytes()).hexdigest()
    assert by_name["model/0.weight"].hash == expected


def test_jobs_must_be_a_positive_whole_number(checkpoints: dict[str, Path]) -> None:
    for bad in ("0", "-2", "two"):
        out, err = io.StringIO(), io.StringIO()
        assert main(["audit", str(checkpoints["torch.save"]), "--jobs", bad], stdout=out, stderr=err) == 2
        assert "--jobs" in err.getvalue() and bad in err.getvalue()
    with pytest.raises(ValueError, match="jobs must be at least 1, got 0"):
        AuditOptions(jobs=0)
