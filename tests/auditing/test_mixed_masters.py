"""The contract per parameter: a real model that holds some parameters in bf16 by design (``.to(torch.bfloat16)``
on a submodule) and the rest in fp32, trained a few AdamW steps (whose moments follow each parameter's dtype), saved
with ``torch.save`` and with DCP. Clean on defaults; the same state through a bad exporter (the fp32 masters cast to
bf16, the moments or not) is still caught, naming the parameters that lost their bits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckptaudit.auditing.judge import AuditOptions, run_audit
from ckptaudit.checks.precision import per_parameter
from ckptaudit.findings import Contract, Precision, RawReport, Severity, TensorRecord
from fsdp_jobs import mixed_model

BF16 = ["body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"]
FP32 = ["emb.weight", "norm.weight", "norm.bias", "head.weight", "head.bias"]


@pytest.fixture(scope="module")
def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = mixed_model()  # a bf16 MLP body by design; fp32 embedding, norm and head
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randint(0, 32, (8,))).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    # What makes the run genuine: AdamW's moments follow each parameter's dtype.
    assert {n: opt.state[p]["exp_avg"].dtype for n, p in model.named_parameters()} == {
        **dict.fromkeys(BF16, torch.bfloat16), **dict.fromkeys(FP32, torch.float32)}
    return model, opt


def _torch_save(path: Path, model: nn.Module, opt: torch.optim.Optimizer, *, cast_masters: bool = False,
                cast_moments: bool = False) -> Path:
    """``torch.save`` of the training state; ``cast_masters``/``cast_moments``: a bad exporter's cast to bf16."""
    msd = {k: v.bfloat16() if cast_masters and v.is_floating_point() else v for k, v in model.state_dict().items()}
    osd = opt.state_dict()
    state = {i: {k: v.bfloat16() if cast_moments and v.dim() else v for k, v in e.items()}
             for i, e in osd["state"].items()}
    torch.save({"model": msd, "optimizer": {"state": state, "param_groups": osd["param_groups"]}, "step": 3}, path)
    return path


def _dcp_save(path: Path, model: nn.Module, opt: torch.optim.Optimizer, *, cast_masters: bool = False) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    if cast_masters:
        msd = {k: v.bfloat16() for k, v in msd.items()}
    dcp.save({"model": msd, "optim": osd, "train_state": {"step": 3}}, checkpoint_id=str(path), no_dist=True)
    return path


def subjects(report: RawReport, code: str) -> set[str]:
    return {f.subject for f in report.findings if f.code == code}


def precision_problems(report: RawReport) -> list[str]:
    return [f"{f.code} {f.subject}" for f in report.findings
            if f.severity >= Severity.WARNING and f.code.split(".")[0] in ("precision", "contract")]


@pytest.mark.parametrize("save", ["torch.save", "dcp"])
def test_a_model_with_bf16_parameters_by_design_is_clean_on_defaults(tmp_path: Path, trained: Any, save: str) -> None:
    model, opt = trained
    path = (_torch_save(tmp_path / "mixed.pt", model, opt) if save == "torch.save"
            else _dcp_save(tmp_path / "mixed", model, opt))
    report = run_audit(str(path))
    assert not report.fails(Severity.ERROR) and precision_problems(report) == [], precision_problems(report)
    # Said, not silent: which parameters are held to bf16, and why.
    (note,) = [f for f in report.findings if f.code == "contract.per-parameter"]
    assert note.severity is Severity.INFO and note.evidence["params"] == sorted(BF16)
    assert report.contract is not None and report.contract.master_dtype == "float32"
    assert "float32 for 5 parameter(s) and bfloat16 for 4" in report.contract.detail
    assert "master dtype float32, bfloat16 for some parameters by design" in report.summary


@pytest.mark.parametrize("save", ["torch.save", "dcp"])
def test_an_export_that_casts_the_fp32_masters_to_bf16_names_exactly_those(tmp_path: Path, trained: Any,
                                                                           save: str) -> None:
    model, opt = trained
    path = (_torch_save(tmp_path / "cast.pt", model, opt, cast_masters=True) if save == "torch.save"
            else _dcp_save(tmp_path / "cast", model, opt, cast_masters=True))
    report = run_audit(str(path))
    assert report.fails(Severity.ERROR)
    # The fp32 masters lost their bits (their own moments are still fp32); the bf16-by-design ones did not.
    assert subjects(report, "precision.low-precision-storage") == {f"model/{n}" for n in FP32}


def test_an_export_that_casts_masters_and_moments_is_caught_beside_the_run(tmp_path: Path, trained: Any) -> None:
    model, opt = trained
    run = tmp_path / "run"
    run.mkdir()
    _torch_save(run / "ckpt-0002.pt", model, opt)
    bad = _torch_save(run / "ckpt-0004.pt", model, opt, cast_masters=True, cast_moments=True)
    # Alone, the whole state in bf16 is what a bf16-masters run saves: a warning that says how to settle it.
    alone = run_audit(str(bad), AuditOptions(run_evidence=False))
    assert not alone.fails(Severity.ERROR) and any(
        f.code == "contract.inferred" and f.severity is Severity.WARNING for f in alone.findings)
    # Beside its own run, whose earlier checkpoint keeps float32 masters: an error.
    # Beside its own run, whose earlier checkpoint keeps float32 masters for the fp32 parameters: an error naming
    # them, and not the parameters that run keeps in bf16 by design.
    beside = run_audit(str(bad), AuditOptions(run_evidence=True))
    assert beside.fails(Severity.ERROR) and "contract.run-mismatch" in {f.code for f in beside.findings}
    assert subjects(beside, "precision.low-precision-storage") == {f"model/{n}" for n in FP32}
    (note,) = [f for f in beside.findings if f.code == "contract.per-parameter"]
    assert note.evidence["params"] == sorted(BF16) and note.evidence["evidence"] == "ckpt-0002.pt"


def test_a_genuine_run_is_not_judged_by_its_majority(tmp_path: Path) -> None:
    # A model mostly in bf16 (the majority of moments bf16) with fp32 norms: still each held to its own.
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)).to(torch.bfloat16)
    model.append(nn.LayerNorm(8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model[3](model[:3](torch.randn(4, 8).bfloat16()).float()).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    report = run_audit(str(_torch_save(tmp_path / "mostly-bf16.pt", model, opt)))
    assert precision_problems(report) == [], precision_problems(report)
    assert report.contract is not None and report.contract.master_dtype == "float32"


def _rec(name: str, dtype: str, *, param: str | None = None, role: str = "parameter",
         precision: Precision = Precision.EXACT) -> TensorRecord:
    component = "model" if role == "parameter" else "optimizer"
    if dtype in ("bfloat16", "float16"):
        precision = Precision.NATIVE_16
    return TensorRecord(name, component, role, param, "f", dtype, (4,), 4, "h", precision)


def test_where_the_state_does_not_decide_a_parameter_it_is_not_judged() -> None:
    contract = Contract("float32", "optimizer-state", "optimizer moments are float32 for 1 and bfloat16 for 1")
    params = [_rec("model/a", "float32", param="a"), _rec("model/b", "bfloat16", param="b"),
              _rec("model/c", "bfloat16", param="c")]
    own = [_rec("optimizer/a", "float32", param="a", role="exp_avg"),
           _rec("optimizer/b", "bfloat16", param="b", role="exp_avg")]
    decided = per_parameter(contract, params, own, "by-name")
    assert decided.masters == {"b": "bfloat16"} and decided.undecided == {}
    # Index-keyed state whose entries cannot be told apart: c's own moments are unknown, so c is not judged.
    unattached = [*own, _rec("optimizer/?", "bfloat16", role="exp_avg")]
    ambiguous = per_parameter(contract, params, unattached, "ambiguous")
    assert set(ambiguous.undecided) == {"c"} and "attachment: ambiguous" in ambiguous.undecided["c"]
    # An optimizer that keeps bf16 state for a float32 parameter too: bf16 moments show no bf16 master.
    bf16_state = [_rec("optimizer/a", "bfloat16", param="a", role="exp_avg"),
                  _rec("optimizer/b", "bfloat16", param="b", role="exp_avg"),
                  _rec("optimizer/c", "float32", param="c", role="exp_avg")]
    loose = per_parameter(contract, params, bf16_state, "by-name")
    assert loose.masters == {} and set(loose.undecided) == {"b"} and "16-bit state for float32" in loose.undecided["b"]
    # A float32 master copy kept in the optimizer state beside bf16 moments: that parameter has a float32 master,
    # so its stored bf16 is held to float32, not excused as bf16 by design.
    with_master = [*own, _rec("optimizer/c", "bfloat16", param="c", role="exp_avg"),
                   _rec("optimizer/c.master", "float32", param="c", role="master_param")]
    assert per_parameter(contract, params, with_master, "by-name").masters == {"b": "bfloat16"}
    # Declared or recorded contracts speak for every parameter: nothing per parameter.
    assert per_parameter(Contract("float32", "flag", "--master-dtype float32"), params, own, "by-name").masters == {}


@pytest.mark.parametrize("cast_moments", [False, True])
def test_the_guard_holds_each_parameter_to_its_live_dtype(tmp_path: Path, trained: Any, cast_moments: bool) -> None:
    from ckptaudit.integrations.guard import Guard
    from ckptaudit.integrations.live_contract import declare_live_contract

    model, opt = trained
    good = _torch_save(tmp_path / "good.pt", model, opt)
    bad = _torch_save(tmp_path / "bad.pt", model, opt, cast_masters=True, cast_moments=cast_moments)
    guard = Guard(background="thread", run_evidence=False)
    try:
        declare_live_contract(guard, opt, "a test loop")
        assert guard.audit_options["master_dtypes"] == ["float32"] + ["bfloat16"] * 4 + ["float32"] * 4
        guard.submit(str(good))
        guard.submit(str(bad))
    finally:
        assert guard.close(60)
    ok, failed = guard.verdicts
    assert ok.ok is True, ok.codes
    # Cast whole (moments too), the file alone would look like a bf16-masters run; the live optimizer says which
    # parameters keep float32 masters, and exactly those are named.
    assert failed.ok is False and "precision.low-precision-storage" in failed.codes
    doc = json.loads(Path(failed.report or "").read_text())
    assert {f["subject"] for f in doc["findings"] if f["code"] == "precision.low-precision-storage"} == {
        f"model/{n}" for n in FP32}
    assert doc["contract"]["source"] == "live" and "4 bfloat16 and 5 float32" in doc["contract"]["detail"]


def test_ckptaudits_own_writer_records_each_parameters_dtype(tmp_path: Path, trained: Any) -> None:
    # The writer's manifest records the trainable parameters' dtypes ({bfloat16: 4, float32: 5}) and each tensor's:
    # each parameter is held to the dtype it had live, not to the majority the manifest's master_dtype names.
    from ckptaudit.recipes import Job
    from ckptaudit.store import save_checkpoint

    model, opt = trained
    job = Job(model=model, optimizer=opt)
    job.step = 3
    saved = save_checkpoint(job, str(tmp_path / "run"), step=3)
    report = run_audit(saved.path)
    assert report.contract is not None and report.contract.source == "manifest"
    assert precision_problems(report) == [], precision_problems(report)
    (note,) = [f for f in report.findings if f.code == "contract.per-parameter"]
    assert note.evidence["params"] == sorted(BF16)


@pytest.mark.dist
def test_fsdp2_units_of_two_dtypes_are_each_held_to_their_own(tmp_path: Path) -> None:
    # A real 2-rank gloo run: the bf16 body its own fully_shard unit, the fp32 rest under the root's bf16 policy.
    import fsdp_jobs
    from configurations import fixture_launch

    # The session's forkserver options (tests/conftest.py FSDP_FAST): one server for every FSDP launch.
    fast: dict[str, Any] = {"start_method": "forkserver", "preload": ("torch", "torch.distributed.fsdp", "fsdp_jobs")}
    dtypes = fixture_launch("fsdp_mixed", fsdp_jobs.write_mixed_masters, 2, (str(tmp_path), 3), timeout_s=180,
                            **fast)[0]
    assert {n for n, d in dtypes.items() if d == "bfloat16"} == set(BF16)
    report = run_audit(str(tmp_path / "mixed"))
    assert precision_problems(report) == [] and not report.fails(Severity.ERROR), precision_problems(report)
    assert [f.evidence["params"] for f in report.findings if f.code == "contract.per-parameter"] == [sorted(BF16)]
    cast = run_audit(str(tmp_path / "cast"))
    assert subjects(cast, "precision.low-precision-storage") == {f"model/{n}" for n in FP32}


def test_a_parameter_the_run_keeps_in_fp32_cast_with_its_moments_is_caught_beside_the_run(tmp_path: Path,
                                                                                           trained: Any) -> None:
    # An exporter that casts only the head and its moments to bf16: alone, that looks like one more parameter held
    # in bf16 by design; the run's earlier checkpoint keeps it in float32, its bf16 ones by design.
    model, opt = trained
    run = tmp_path / "run"
    run.mkdir()
    _torch_save(run / "ckpt-0002.pt", model, opt)
    good = _torch_save(run / "ckpt-0003.pt", model, opt)
    msd = {k: v.bfloat16() if k.startswith("head.") else v for k, v in model.state_dict().items()}
    osd = opt.state_dict()
    head = {i for i, (n, _) in enumerate(model.named_parameters()) if n.startswith("head.")}
    state = {i: {k: v.bfloat16() if i in head and v.dim() else v for k, v in e.items()} for i, e in osd["state"].items()}
    torch.save({"model": msd, "optimizer": {"state": state, "param_groups": osd["param_groups"]}, "step": 4},
               run / "ckpt-0004.pt")
    alone = run_audit(str(run / "ckpt-0004.pt"), AuditOptions(run_evidence=False))
    assert precision_problems(alone) == []
    beside = run_audit(str(run / "ckpt-0004.pt"), AuditOptions(run_evidence=True))
    assert subjects(beside, "precision.low-precision-storage") == {"model/head.weight", "model/head.bias"}
    assert beside.contract is not None and beside.contract.source == "run"
    # A genuine checkpoint of the same run, beside the same siblings, stays clean.
    assert precision_problems(run_audit(str(good), AuditOptions(run_evidence=True))) == []


def test_live_dtypes_that_do_not_fit_the_saved_groups_are_said(tmp_path: Path, trained: Any) -> None:
    # Another optimizer's dtypes (one parameter fewer): the checkpoint's own state decides, and the contract says so.
    model, opt = trained
    path = _torch_save(tmp_path / "mixed.pt", model, opt)
    live = ("float32",) + ("bfloat16",) * 4 + ("float32",) * 3
    report = run_audit(str(path), AuditOptions(master_dtypes=live, master_dtype_from="the live run: a test"))
    assert report.contract is not None and report.contract.source == "optimizer-state"
    assert "(the live run: a test: 8) could not be laid over the 9 parameter(s)" in report.contract.detail
    assert precision_problems(report) == []
