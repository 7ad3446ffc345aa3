"""The offline audit on real checkpoints of a real 2-rank FSDP2 run with a bf16 MixedPrecisionPolicy."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.auditing.judge import AuditOptions, run_audit
from ckptaudit.findings import ComponentKind, Precision, RawReport, Severity
from ckptaudit.formats.dcp.reader import check_metadata_safe
from ckptaudit.formats.torchload import vetted_torch_load

pytestmark = pytest.mark.dist


def codes(report: RawReport, severity: Severity | None = None) -> set[str]:
    return {f.code for f in report.findings if severity is None or f.severity is severity}


def subjects(report: RawReport, code: str) -> set[str]:
    return {f.subject for f in report.findings if f.code == code}


def test_documented_path_is_clean(fsdp_run: dict[str, Any]) -> None:
    report = run_audit(str(fsdp_run["dir"] / "faithful"))
    assert report.format == "dcp"
    assert report.findings == (), [f.message for f in report.findings]
    assert report.contract is not None and report.contract.master_dtype == "float32"
    assert all(c.found for c in report.components)
    params = [t for t in report.tensors if t.component == "model" and t.role == "parameter"]
    assert len(params) == len(fsdp_run["params"])
    assert all(t.precision is Precision.EXACT for t in params)


def test_compute_copy_upcast_is_flagged_on_exactly_the_parameters(fsdp_run: dict[str, Any]) -> None:
    report = run_audit(str(fsdp_run["dir"] / "compute-copy-fp32.pt"))
    flagged = subjects(report, "precision.bf16-rounded")
    assert flagged == {f"model/{p}" for p in fsdp_run["params"]}
    # Optimizer moments are faithful fp32 and are not flagged; the contract comes from them.
    assert report.contract is not None and report.contract.source == "optimizer-state"
    assert not any(s.startswith("optimizer/") for s in flagged)
    assert report.fails(Severity.ERROR)


def test_compute_copy_stored_as_bf16_is_low_precision_storage(fsdp_run: dict[str, Any]) -> None:
    report = run_audit(str(fsdp_run["dir"] / "compute-copy-bf16.pt"))
    assert subjects(report, "precision.low-precision-storage") == {f"model/{p}" for p in fsdp_run["params"]}
    assert report.contract is not None and report.contract.master_dtype == "float32"


def test_fp16_rounded_copy_is_flagged(fsdp_run: dict[str, Any]) -> None:
    report = run_audit(str(fsdp_run["dir"] / "fp16-copy.pt"))
    flagged = subjects(report, "precision.fp16-rounded")
    # LayerNorm weights that are still ones after 6 steps could be inconclusive; the matrices must be caught.
    matrices = {f"model/{n}" for n, s in fsdp_run["shapes"].items() if len(s) == 2}
    assert matrices <= flagged
    assert "precision.bf16-rounded" not in codes(report)


def test_low_precision_master_run_is_clean_under_its_contract(fsdp_low_precision: Path) -> None:
    report = run_audit(str(fsdp_low_precision))
    assert report.contract is not None and report.contract.master_dtype == "bfloat16"
    # Inferred from the tensors (a DCP save records no precision): a warning that names the flag settling it.
    assert codes(report) == {"contract.inferred"}
    assert not report.fails(Severity.ERROR)
    declared = run_audit(str(fsdp_low_precision), AuditOptions(master_dtype="bfloat16"))
    assert codes(declared) == set() and declared.contract is not None and declared.contract.source == "flag"
    # The same checkpoint held to an fp32 contract is a defect.
    strict = run_audit(str(fsdp_low_precision), AuditOptions(master_dtype="float32"))
    assert "precision.low-precision-storage" in codes(strict, Severity.ERROR)


def test_required_components_turn_warnings_into_errors(fsdp_run: dict[str, Any], tmp_path: Path) -> None:
    import torch


    src = vetted_torch_load(fsdp_run["dir"] / "compute-copy-fp32.pt")
    slim = {"model": src["model"], "optimizer": src["optimizer"]}
    path = tmp_path / "slim.pt"
    torch.save(slim, path)
    lenient = run_audit(str(path))
    missing = {f.evidence["component"]: f.severity for f in lenient.findings if f.code == "component.missing"}
    assert missing == {"scheduler": Severity.WARNING, "rng": Severity.WARNING, "data-progress": Severity.WARNING}
    strict = run_audit(str(path), AuditOptions(require=frozenset({ComponentKind.SCHEDULER, ComponentKind.RNG})))
    missing = {f.evidence["component"]: f.severity for f in strict.findings if f.code == "component.missing"}
    assert missing["scheduler"] is Severity.ERROR and missing["rng"] is Severity.ERROR
    assert missing["data-progress"] is Severity.WARNING
    no_opt = tmp_path / "model-only.pt"
    torch.save({"model": src["model"]}, no_opt)
    report = run_audit(str(no_opt))
    assert any(f.code == "component.missing" and f.subject == "optimizer" and f.severity is Severity.ERROR
               for f in report.findings)


def test_index_keyed_and_permuted_optimizer_state(fsdp_run: dict[str, Any], tmp_path: Path) -> None:
    import torch

    src = vetted_torch_load(fsdp_run["dir"] / "compute-copy-fp32.pt")
    model = {k: v for k, v in src["model"].items()}
    names = list(model)
    fqn_state = src["optimizer"]["state"]
    # optimizer.state_dict() style: integers in parameter order, one group.
    state = {i: fqn_state[n] for i, n in enumerate(names)}
    groups = [{**src["optimizer"]["param_groups"][0], "params": list(range(len(names)))}]
    good = tmp_path / "index-keyed.pt"
    torch.save({"model": model, "optimizer": {"state": state, "param_groups": groups}}, good)
    report = run_audit(str(good))
    assert "optimizer.index-keyed" in codes(report, Severity.WARNING)
    assert "optimizer.shape-mismatch" not in codes(report)
    # Permuted: the first two entries exchanged (an embedding and a position table of other shapes).
    perm = dict(state)
    perm[0], perm[2] = state[2], state[0]
    bad = tmp_path / "permuted.pt"
    torch.save({"model": model, "optimizer": {"state": perm, "param_groups": groups}}, bad)
    assert "optimizer.shape-mismatch" in codes(run_audit(str(bad)), Severity.ERROR)


def test_fqn_keyed_state_for_a_missing_parameter(fsdp_run: dict[str, Any], tmp_path: Path) -> None:
    import torch

    src = vetted_torch_load(fsdp_run["dir"] / "compute-copy-fp32.pt")
    osd = src["optimizer"]
    osd["state"]["blocks.9.ghost.weight"] = osd["state"]["head.weight"]
    osd["state"]["head.weight"] = {**osd["state"]["head.weight"], "exp_avg": osd["state"]["head.weight"]["exp_avg"][:3]}
    path = tmp_path / "ghost.pt"
    torch.save({"model": src["model"], "optimizer": osd}, path)
    report = run_audit(str(path))
    assert "optimizer/state/blocks.9.ghost.weight" in subjects(report, "optimizer.unmatched")
    assert any("head.weight" in s for s in subjects(report, "optimizer.shape-mismatch"))


def test_broken_dcp_directories_give_findings_not_tracebacks(fsdp_run: dict[str, Any], tmp_path: Path) -> None:
    import shutil

    from ckptaudit.cli import main

    no_meta = shutil.copytree(fsdp_run["dir"] / "faithful", tmp_path / "no-meta")
    (no_meta / ".metadata").unlink()
    report = run_audit(str(no_meta))
    assert any(f.code == "integrity.incomplete" and f.subject == ".metadata" for f in report.findings)
    assert main(["audit", str(no_meta)], stdout=io.StringIO(), stderr=io.StringIO()) == 1

    truncated = shutil.copytree(fsdp_run["dir"] / "faithful", tmp_path / "truncated")
    data = truncated / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    report = run_audit(str(truncated))
    assert any(f.code == "integrity.incomplete" and f.subject == "__0_0.distcp" for f in report.findings)
    # The other rank's file still reads: its shards are hashed, the lost ones are reported unread.
    assert any(t.hash is not None for t in report.tensors)
    assert any(t.precision is Precision.UNREAD for t in report.tensors)


def test_empty_and_uneven_shards_of_a_4_rank_save_are_read_whole(tmp_path: Path) -> None:
    # FSDP2 over 4 ranks: a Linear(8, 3) leaves rank 3 an empty shard of its weight and bias, a Linear(3, 6) splits
    # its 6 rows 2-2-2-0. The shards tile each tensor (empty ones included): no finding, and every tensor hashes
    # as the full tensors rank 0 saved with torch.save.
    import fsdp_jobs
    from ckptaudit.launch import launch

    launch(fsdp_jobs.write_uneven_shards, 4, (str(tmp_path),), timeout_s=300, start_method="forkserver",
           preload=("torch", "torch.distributed.fsdp", "fsdp_jobs"))
    sharded, full = run_audit(str(tmp_path / "dcp")), run_audit(str(tmp_path / "full.pt"))
    md = check_metadata_safe(str(tmp_path / "dcp"))
    assert any(0 in chunk.sizes for meta in md.state_dict_metadata.values()
               for chunk in getattr(meta, "chunks", ())), "no empty shard: the case is not exercised"
    assert codes(sharded, Severity.ERROR) == set() and codes(sharded) == codes(full), sharded.findings
    by_name = {t.name.split("/", 1)[1]: (t.shape, t.hash) for t in full.tensors}
    assert len(by_name) == 32
    assert {t.name.split("/", 1)[1]: (t.shape, t.hash) for t in sharded.tensors} == by_name


def test_the_resume_snapshot_gathers_what_full_tensor_gathers() -> None:
    import fsdp_jobs
    from ckptaudit.launch import launch

    assert launch(fsdp_jobs.snapshot_gather_equals_full_tensor, 4, (), timeout_s=300, start_method="forkserver",
                  preload=("torch", "torch.distributed.fsdp", "fsdp_jobs")) == [True] * 4
