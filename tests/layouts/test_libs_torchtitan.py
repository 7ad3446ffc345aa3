"""The audit on checkpoints torchtitan 0.3.0's own ``CheckpointManager`` writes, from a real 2-rank FSDP2 job.

``lib_writers.write_torchtitan`` trains a tiny GPT (bf16 ``MixedPrecisionPolicy``, fp32 masters, initial weights
rounded to bf16 as a bf16 release gives them) with torchtitan's ``OptimizersContainer``, ``LRSchedulersContainer``
and ``ParallelAwareDataloader`` on 2 gloo ranks, and saves through ``CheckpointManager`` at step 0 (the seed
checkpoint, before any update) and step 2.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.auditing.judge import run_audit
from ckptaudit.findings import ComponentKind, Precision, Severity
from ckptaudit.formats.dcp.metadata import load_dcp_metadata
from ckptaudit.formats.pickle.allowlist import DCP_METADATA_GLOBALS
from ckptaudit.formats.pickle.scan import opcode_limit, scan
from configurations import fixture_launch

pytestmark = pytest.mark.dist

pytest.importorskip("torchtitan")


@pytest.fixture(scope="session")
def titan(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import lib_writers

    out = tmp_path_factory.mktemp("torchtitan")
    info: dict[str, Any] = fixture_launch("titan", lib_writers.write_torchtitan, 2, (str(out), 2), timeout_s=240)[0]
    return info


def test_torchtitan_layout_is_read_where_it_is_and_clean(titan: dict[str, Any]) -> None:
    path = Path(titan["path"])
    assert path.name == "step-2" and path.parent.name == "checkpoint"
    report = run_audit(str(path))
    assert report.format == "torchtitan"
    comps = {c.kind: c for c in report.components}
    assert comps[ComponentKind.MODEL].where == ("(root) (top-level keys)",)
    assert comps[ComponentKind.OPTIMIZER].where == ("optimizer",)
    assert comps[ComponentKind.SCHEDULER].where == ("lr_scheduler",)
    assert set(comps[ComponentKind.DATA_PROGRESS].where) == {"dataloader", "train_state"}
    assert comps[ComponentKind.DATA_PROGRESS].detail == "torchtitan data-loader state for dp rank(s) 0, 1 of world size 2"
    assert report.extra["step"] == titan["step"] == 2
    # torchtitan saves no RNG state: the only finding, a warning.
    assert [(f.code, f.subject, f.severity) for f in report.findings] == [
        ("component.missing", "rng", Severity.WARNING)]
    assert report.contract is not None and report.contract.master_dtype == "float32"
    params = {t.name: t for t in report.tensors if t.component == "model" and t.role == "parameter"}
    assert set(params) == set(titan["params"])
    # Started from bf16-representable weights; two AdamW steps gave every tensor its low bits.
    assert all(t.precision is Precision.EXACT and t.dtype == "float32" for t in params.values())
    # What torchtitan's DCP save writes takes the fast .metadata load (the C unpickler), with the same record.
    data = (path / ".metadata").read_bytes()
    result = scan(data, DCP_METADATA_GLOBALS, max_opcodes=opcode_limit(len(data)))
    assert result.plain and load_dcp_metadata(data, result) == load_dcp_metadata(data)


def test_flattened_optimizer_state_is_attached_by_name(titan: dict[str, Any]) -> None:
    report = run_audit(titan["path"])
    assert report.extra["attachment"] == "by-name"
    moments = [t for t in report.tensors if t.component == "optimizer" and t.role in ("exp_avg", "exp_avg_sq")]
    assert {t.name for t in moments} == {f"optimizer/state.{p}.{m}" for p in titan["params"]
                                         for m in ("exp_avg", "exp_avg_sq")}
    assert all(t.param == t.name.split(".", 1)[1].rsplit(".", 1)[0] for t in moments)


def test_seed_checkpoint_before_the_first_step_is_a_warning_not_an_error(titan: dict[str, Any]) -> None:
    """torchtitan's step-0 checkpoint: AdamW state filled by its own zero-lr step, masters = the bf16 initial weights."""
    report = run_audit(titan["step0"])
    assert report.extra["step"] == 0
    assert not report.fails(Severity.ERROR), [f.message for f in report.findings if f.severity is Severity.ERROR]
    early = [f for f in report.findings if f.code == "precision.before-first-update"]
    rounded = {t.name for t in report.tensors if t.role == "parameter" and t.precision is Precision.BF16}
    assert rounded and {f.subject for f in early} == rounded
    assert all(f.severity is Severity.WARNING for f in early)
    message = early[0].message
    assert "before any optimizer update" in message and "moments are exactly zero, step counters 1" in message
    assert "train step 0; scheduler step 0" in message
    assert "had the initial weights been fp32, their low bits were lost" in message


def test_a_lost_rank_file_names_what_it_took(titan: dict[str, Any], tmp_path: Path) -> None:
    damaged = tmp_path / "step-2"
    shutil.copytree(titan["path"], damaged)
    # DCP writes replicated items (the scheduler, world_size, step scalars) into the last rank's file.
    (damaged / "__1_0.distcp").unlink()
    report = run_audit(str(damaged))
    incomplete = [f for f in report.findings if f.code == "integrity.incomplete"]
    assert [f.subject for f in incomplete] == ["__1_0.distcp"]
    assert report.fails(Severity.ERROR)
    comps = {c.kind: c for c in report.components}
    assert "unreadable" in comps[ComponentKind.SCHEDULER].detail
    assert comps[ComponentKind.DATA_PROGRESS].detail.endswith("rank(s) 1 unreadable (see the integrity findings)")
