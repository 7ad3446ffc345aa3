"""The audit and ``latest`` on Megatron-Core ``torch_dist`` checkpoints written by the real megatron-core 0.16.1.

One 2-rank gloo job (``megatron_writer.write_megatron``; see its docstring for what is real and what is replaced:
``torch.cuda.synchronize``/``current_device`` in the writer process, and the CUDA-only optimizer, whose state is
laid out with Megatron's own helpers) trains a tensor-parallel GPTModel for 2 steps and saves three checkpoints:
``full`` (bf16 weights, fp32 masters, AdamW moments, scheduler, RNG), ``model-only`` and ``rounded-masters``
(the masters saved after a round trip through bf16). Each is loaded back by ``dist_checkpointing.load`` in the
writer. The job takes 55-90 s wall on 2 busy cores, once per session.
"""

from __future__ import annotations

import io
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.auditing.judge import run_audit
from ckptaudit.findings import ComponentKind, Precision, Severity
from ckptaudit.formats.dcp.metadata import dcp_metadata_loads, load_dcp_metadata
from ckptaudit.formats.dcp.reader import check_metadata_safe
from ckptaudit.formats.pickle.allowlist import DCP_METADATA_GLOBALS
from ckptaudit.formats.pickle.scan import scan
from ckptaudit.latest import find_latest, latest_report
from configurations import fixture_launch

pytestmark = pytest.mark.dist

VARIANTS = ["full", "model-only", "rounded-masters", "distributed-fully-reshardable", "distributed-dp-reshardable",
            "cast-to-bf16"]
PLANNER = {f"torch.distributed.checkpoint.planner.{n}" for n in ("SavePlan", "WriteItem", "WriteItemType",
                                                                   "TensorWriteData")}


@pytest.fixture(scope="session")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import megatron_writer

    out = tmp_path_factory.mktemp("megatron")
    info: dict[str, Any] = fixture_launch("megatron", megatron_writer.write_megatron, 2, (str(out), VARIANTS),
                                          timeout_s=400)[0]
    return info


def _codes(report: Any, severity: Severity | None = None) -> set[str]:
    return {f.code for f in report.findings if severity is None or f.severity is severity}


def test_metadata_holds_the_save_plans_and_passes_the_allowlist(megatron: dict[str, Any]) -> None:
    path = megatron["paths"]["full"]
    data = (Path(path) / ".metadata").read_bytes()
    result = scan(data, DCP_METADATA_GLOBALS)
    assert PLANNER <= set(result.globals)  # Megatron's save really puts them there (Metadata.all_local_plans)
    assert result.loadable, result.unsafe
    md = dcp_metadata_loads(data)  # the plans are vetted and rebuilt like the rest of the metadata
    assert md.save_plans == 2
    # What Megatron writes takes the fast load (the C unpickler), and it gives the same record.
    assert result.plain and load_dcp_metadata(data, result) == md
    check_metadata_safe(path)  # what callers run before torch.distributed.checkpoint.load: no exception


def test_planner_allowlist_admits_the_dataclasses_only() -> None:
    # A class of the same module that is not plain data (a planner, with methods that run) stays refused.
    from torch.distributed.checkpoint.planner import LoadPlan

    data = pickle.dumps(LoadPlan(items=[]))
    result = scan(data, DCP_METADATA_GLOBALS)
    assert result.unsafe == ("torch.distributed.checkpoint.planner.LoadPlan",)
    with pytest.raises(pickle.UnpicklingError):
        dcp_metadata_loads(io.BytesIO(data).getvalue())


def test_full_checkpoint_reads_every_tensor_and_attaches_the_masters(megatron: dict[str, Any]) -> None:
    report = run_audit(megatron["paths"]["full"])
    assert report.format == "megatron"
    assert report.extra["step"] == megatron["step"] == 2  # common.pt's iteration
    # No finding at all: common.pt pickles Megatron-LM's args (an argparse.Namespace) and Megatron's enums, which
    # megatron.core.safe_globals declares safe for its own weights_only load: read as inert placeholders, silently.
    assert report.findings == ()
    assert not report.fails(Severity.ERROR)
    assert all(t.precision is not Precision.UNREAD for t in report.tensors)
    params = {t.name: t for t in report.tensors if t.component == "model" and t.role == "parameter"}
    assert set(params) == set(megatron["params"])
    masters = {t.param: t for t in report.tensors if t.component == "optimizer" and t.role == "fp32_param"}
    # Every bf16 weight has its fp32 master, attached by name; fp32 weights (norms) are their own masters.
    assert set(masters) == set(megatron["bf16_params"]) and megatron["bf16_params"]
    assert all(m.dtype == "float32" and m.precision is Precision.EXACT for m in masters.values())
    assert all(m.name == f"optimizer.state.fp32_param.{p}" for p, m in masters.items())
    moments = [t for t in report.tensors if t.role in ("exp_avg", "exp_avg_sq")]
    assert {t.param for t in moments} == set(megatron["params"])
    assert report.extra["attachment"] == "by-name"
    assert report.contract is not None and report.contract.master_dtype == "float32"
    # Decided by the run's own record, Megatron-LM's args in common.pt.
    assert (report.contract.source, report.contract.where) == ("megatron-args", "common.pt/args")
    assert report.contract.detail == "bf16=True: Megatron's mixed-precision optimizers keep fp32 main params of the bf16 weights"
    comps = {c.kind: c for c in report.components}
    assert comps[ComponentKind.MODEL].where == ("(sharded tensors)",)
    assert comps[ComponentKind.OPTIMIZER].where == ("optimizer.state",)
    assert comps[ComponentKind.SCHEDULER].where == ("common.pt/opt_param_scheduler",)
    assert comps[ComponentKind.RNG].where == ("rng_state",)
    assert "consumed_train_samples 16" in comps[ComponentKind.DATA_PROGRESS].detail


def test_masters_rounded_to_bf16_are_found(megatron: dict[str, Any]) -> None:
    report = run_audit(megatron["paths"]["rounded-masters"])
    rounded = {f.subject for f in report.findings if f.code == "precision.bf16-rounded"}
    assert rounded == {f"optimizer.state.fp32_param.{p}" for p in megatron["bf16_params"]}
    assert "precision.low-precision-storage" not in _codes(report)  # the bf16 copies are not the defect
    assert report.fails(Severity.ERROR)


def test_a_state_cast_to_bf16_contradicts_the_saved_args(megatron: dict[str, Any]) -> None:
    # Masters, moments and the fp32 weights all stored as bf16 (an exporter that cast the whole state): alone, the
    # tensors would look like a run with bf16 masters; Megatron's own args (bf16=True: fp32 main params) say not.
    report = run_audit(megatron["paths"]["cast-to-bf16"])
    assert report.contract is not None and (report.contract.source, report.contract.master_dtype) == (
        "megatron-args", "float32")
    (mismatch,) = [f for f in report.findings if f.code == "contract.mismatch"]
    assert mismatch.severity is Severity.ERROR and mismatch.subject == "contract"
    assert mismatch.message.startswith("common.pt/args records bf16=True (Megatron's mixed-precision optimizers")
    assert "parameters are bfloat16 and optimizer moments are bfloat16" in mismatch.message
    stored = {f.subject for f in report.findings if f.code == "precision.low-precision-storage"}
    assert stored == {f"optimizer.state.fp32_param.{p}" for p in megatron["bf16_params"]} | {
        p for p in megatron["params"] if p not in megatron["bf16_params"]}
    assert report.findings[0].code == "contract.mismatch"  # the cause before the per-parameter errors


def test_model_only_checkpoint_reports_the_missing_optimizer(megatron: dict[str, Any]) -> None:
    report = run_audit(megatron["paths"]["model-only"])
    assert report.format == "megatron"
    assert report.extra["step"] == 2
    missing = {f.subject: f.severity for f in report.findings if f.code == "component.missing"}
    assert missing == {"optimizer": Severity.ERROR, "scheduler": Severity.WARNING}
    params = {t.name for t in report.tensors if t.component == "model" and t.role == "parameter"}
    assert params == set(megatron["params"])
    assert "security.unsafe-pickle" not in _codes(report)
    # Megatron's args (bf16=True) decide the contract: fp32 masters, kept in the optimizer, which is missing; the
    # bf16 weights are its compute copies, not held to the contract one by one (component.missing says it all).
    assert report.contract is not None and (report.contract.source, report.contract.master_dtype) == (
        "megatron-args", "float32")
    assert not [f for f in report.findings if f.code.startswith("contract.")]
    assert not [f for f in report.findings if f.code.startswith("precision.")]
    assert not [f for f in report.findings if "unknown masters" in f.message or "into unknown" in f.message]


def test_latest_finds_the_iteration_the_tracker_names(megatron: dict[str, Any]) -> None:
    root = Path(megatron["paths"]["full"]).parent
    result = find_latest(str(root))
    assert result.latest is not None and result.latest.name == "iter_0000002"
    assert (result.latest.layout, result.latest.step) == ("megatron", 2)
    assert result.pointer == "iter_0000002" and result.findings == []


def test_latest_skips_a_damaged_iteration_the_tracker_names(megatron: dict[str, Any], tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    shutil.copytree(Path(megatron["paths"]["full"]).parent, root)
    shutil.copytree(root / "iter_0000002", root / "iter_0000004")
    (root / "iter_0000004" / ".metadata").unlink()  # the save of iteration 4 died before DCP's commit
    shutil.copytree(root / "iter_0000002", root / "iter_0000003")
    (root / "iter_0000003" / "metadata.json").unlink()  # ... of iteration 3 before Megatron's finalize
    (root / "latest_checkpointed_iteration.txt").write_text("4")
    report = latest_report(str(root))
    assert report.extra["latest"] == str(root / "iter_0000002") and report.extra["latest_step"] == 2
    [stale] = [f for f in report.findings if f.code == "store.pointer-stale"]
    assert stale.subject == "latest_checkpointed_iteration.txt"
    assert "names iter_0000004, which is not resumable" in stale.message
    assert stale.message.startswith("Megatron's latest_checkpointed_iteration.txt (it holds '4'; Megatron's")
    assert "Write '2' into latest_checkpointed_iteration.txt to resume from iter_0000002" in stale.message
    rejected = {f.code for f in report.findings if f.evidence.get("candidate") == "iter_0000004"}
    assert "integrity.incomplete" in rejected
    unfinished = {(f.code, f.subject) for f in report.findings if f.evidence.get("candidate") == "iter_0000003"}
    assert unfinished == {("integrity.incomplete", "iter_0000003/metadata.json")}


def test_distributed_optimizer_masters_by_name(megatron: dict[str, Any]) -> None:
    # fully_reshardable: every parameter's fp32 master is optimizer.state.param.<key>, the fp32 weights' included.
    report = run_audit(megatron["paths"]["distributed-fully-reshardable"])
    assert report.findings == ()
    masters = {t.param: t for t in report.tensors if t.component == "optimizer" and t.role == "param"}
    assert set(masters) == set(megatron["params"])
    assert all(m.name == f"optimizer.state.param.{p}" and m.dtype == "float32" for p, m in masters.items())
    assert report.extra["attachment"] == "by-name"


def test_distributed_optimizer_buckets_are_optimizer_state_not_judged_by_parameter(megatron: dict[str, Any]) -> None:
    # dp_reshardable: flat buckets per rank; never taken for model parameters, attachment said to be unverified,
    # the bf16 weights not flagged (their masters are in the buckets), the buckets' masters held to the contract.
    report = run_audit(megatron["paths"]["distributed-dp-reshardable"])
    params = {t.name for t in report.tensors if t.component == "model" and t.role == "parameter"}
    assert params == set(megatron["params"])
    buckets = [t for t in report.tensors if t.name.startswith("optimizer.distributed.")]
    assert len(buckets) == 6 and all(t.component == "optimizer" and t.dtype == "float32" for t in buckets)
    assert sorted((f.code, f.severity) for f in report.findings) == [
        ("optimizer.attachment-unverified", Severity.WARNING)]
    assert report.extra["attachment"] == "flat-buckets"
    comps = {c.kind: c for c in report.components}
    assert comps[ComponentKind.OPTIMIZER].where == ("optimizer.distributed",)
