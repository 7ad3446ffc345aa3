"""Matching by meaning on small real torch.save files: wrapper prefixes, component key spellings, per-rank
state, index-keyed optimizers (no distributed run needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ckptaudit.comparing import run_compare


def training_state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    w, b = torch.randn(8, 4, generator=g), torch.randn(8, generator=g)
    return {
        "model": {"lin.weight": w, "lin.bias": b},
        "optimizer": {
            "state": {"lin.weight": {"step": torch.tensor(3.0), "exp_avg": torch.randn(8, 4, generator=g)},
                      "lin.bias": {"step": torch.tensor(3.0), "exp_avg": torch.randn(8, generator=g)}},
            "param_groups": [{"lr": 0.1, "params": ["lin.weight", "lin.bias"]}],
        },
        "scheduler": {"last_epoch": 3},
        "rng": {"rank0": {"torch": torch.Generator().manual_seed(1).get_state()},
                "rank1": {"torch": torch.Generator().manual_seed(2).get_state()}},
        "train_state": {"step": 3},
    }


def statuses(report: Any) -> dict[str, str]:
    return {p["key"]: p["status"] for p in report.extra["pairs"]}


def test_the_same_state_under_other_spellings_is_identical(tmp_path: Path) -> None:
    ref = training_state()
    torch.save(ref, tmp_path / "ref.pt")
    # DDP/compile wrappers on the model, other component keys, the optimizer index-keyed, step at the top.
    opt = ref["optimizer"]
    respelled = {
        "state_dict": {f"module._orig_mod.{k}": v for k, v in ref["model"].items()},
        "optim": {"state": {0: opt["state"]["lin.weight"], 1: opt["state"]["lin.bias"]},
                  "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
        "lr_scheduler": ref["scheduler"],
        "rng_state": ref["rng"],
        "step": 3,
    }
    torch.save(respelled, tmp_path / "cand.pt")
    report = run_compare(str(tmp_path / "ref.pt"), str(tmp_path / "cand.pt"))
    got = statuses(report)
    assert set(got.values()) == {"identical"}, got
    assert {"model/lin.weight", "optimizer/state/lin.weight/exp_avg", "optimizer/state/lin.bias/step",
            "scheduler/last_epoch", "rng/rank1/torch", "data-progress/step"} <= set(got)


def test_one_ranks_state_is_matched_to_rank0_and_the_others_are_missing(tmp_path: Path) -> None:
    ref = training_state()
    torch.save(ref, tmp_path / "ref.pt")
    cand = dict(ref, rng=ref["rng"]["rank0"])  # an exporter that saved rank 0's RNG state only
    torch.save(cand, tmp_path / "cand.pt")
    report = run_compare(str(tmp_path / "ref.pt"), str(tmp_path / "cand.pt"))
    got = statuses(report)
    assert got["rng/rank0/torch"] == "identical" and got["rng/rank1/torch"] == "missing"
    assert any("rank0" in n for n in report.extra["notes"])
    assert "RNG of rank1 missing in the candidate" in report.summary


def test_a_stale_step_and_scheduler_are_different(tmp_path: Path) -> None:
    ref = training_state()
    torch.save(ref, tmp_path / "ref.pt")
    stale = dict(ref, scheduler={"last_epoch": 2}, train_state={"step": 2})
    torch.save(stale, tmp_path / "stale.pt")
    report = run_compare(str(tmp_path / "ref.pt"), str(tmp_path / "stale.pt"))
    got = {p["key"]: p for p in report.extra["pairs"]}
    assert got["scheduler/last_epoch"]["status"] == "different"
    assert got["scheduler/last_epoch"]["reference"]["value"] == "3"
    assert got["scheduler/last_epoch"]["candidate"]["value"] == "2"
    assert got["data-progress/step"]["status"] == "different"
    different = {f.subject for f in report.findings if f.code == "compare.different"}
    assert different == {"scheduler", "data-progress"}
    assert "parameters identical" in report.summary


def test_a_tensor_over_many_chunks_that_differs_only_in_its_last_element_is_different(tmp_path: Path) -> None:
    """The multi-chunk route: the first chunks are bitwise equal (the pass switches to hashing only), so only the
    digests, taken over every chunk, can see the last element; with 64-byte chunks a 4096-element tensor is 256
    chunks on each side."""
    from ckptaudit.comparing import CompareOptions

    ref = training_state()
    big = torch.randn(64, 64, generator=torch.Generator().manual_seed(7))
    ref["model"]["big.weight"] = big
    cand = training_state()
    late = big.clone()
    late.view(-1)[-1] += 1.0
    cand["model"]["big.weight"] = late
    torch.save(ref, tmp_path / "ref.pt")
    torch.save(cand, tmp_path / "cand.pt")
    options = CompareOptions(chunk_bytes=64)
    assert big.numel() * 4 > 200 * options.chunk_bytes
    report = run_compare(str(tmp_path / "ref.pt"), str(tmp_path / "cand.pt"), options)
    pair = next(p for p in report.extra["pairs"] if p["key"] == "model/big.weight")
    assert pair["status"] == "different"
    assert pair["diff"]["differ"] == 1 and pair["diff"]["elements"] == 4096
    assert abs(pair["diff"]["max_abs"] - 1.0) < 1e-5
    assert statuses(report)["model/lin.weight"] == "identical"
    assert any(f.code == "compare.different" and "big.weight" in f.message for f in report.findings)


def test_the_hashes_of_an_identical_pair_are_the_audits(tmp_path: Path) -> None:
    """An identical pair is decided by each side's hash, taken as the audit takes it (large tensors through the
    leased map, in windows; small ones by positional reads): the digests in the report are the audit's records',
    for a tensor on both sides and for one only the candidate has."""
    from ckptaudit.api import audit

    g = torch.Generator().manual_seed(11)
    ref = training_state()
    ref["model"]["big.weight"] = torch.randn(1536, 1024, generator=g)  # 6 MiB: windows of the map
    cand = training_state()
    cand["model"]["big.weight"] = ref["model"]["big.weight"].clone()
    cand["model"]["extra.weight"] = torch.randn(640, 512, generator=g)  # 1.25 MiB, only in the candidate
    torch.save(ref, tmp_path / "ref.pt")
    torch.save(cand, tmp_path / "cand.pt")
    report = run_compare(str(tmp_path / "ref.pt"), str(tmp_path / "cand.pt"))
    pairs = {p["key"]: p for p in report.extra["pairs"]}
    assert pairs["model/big.weight"]["status"] == "identical"
    audited = {t.name: t.hash for t in audit(str(tmp_path / "cand.pt")).raw.tensors}
    assert pairs["model/big.weight"]["candidate"]["hash"] == audited["model/big.weight"]
    assert pairs["model/big.weight"]["reference"]["hash"] == audited["model/big.weight"]
    assert pairs["model/extra.weight"]["candidate"]["hash"] == audited["model/extra.weight"]
    assert pairs["model/lin.weight"]["candidate"]["hash"] == audited["model/lin.weight"]
