"""The audit on the ``.ckpt`` files ``lightning.Trainer``'s ``ModelCheckpoint`` really writes.

A LightningModule around the tiny GPT with nanoGPT's decay / no-decay param groups and a persistent buffer
registered before the model, trained 2 steps on CPU with ``precision="32-true"``, ``"bf16-true"`` (bf16
parameters and bf16 AdamW moments: a run with low-precision masters) and ``"16-mixed"`` (Lightning's
``MixedPrecision`` plugin on the CPU: fp16 autocast, a GradScaler whose state the ``.ckpt`` keeps). Written once
per module in a fresh interpreter (``lib_writers.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.auditing.judge import AuditOptions, run_audit
from ckptaudit.findings import ComponentKind, RawReport, Severity
from ckptaudit.formats.torchload import vetted_torch_load
from configurations import Written

pytestmark = pytest.mark.libs

pytest.importorskip("lightning")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Ckpts:
    import lib_writers

    out = tmp_path_factory.mktemp("lightning")
    return Ckpts(lib_writers.run_writer("lightning", str(out)))


class Ckpts:
    """``ckpts["fp32"]``: the ``.ckpt`` file of that precision's run (a skip or failure naming it if not written)."""

    def __init__(self, written: Written) -> None:
        self.written = written

    def __getitem__(self, precision: str) -> Path:
        return next((self.written / precision).glob("*.ckpt"))


def truth(ckpt: Path) -> dict[str, Any]:
    return json.loads(Path(str(ckpt) + ".truth.json").read_text())


def codes(report: RawReport, severity: Severity | None = None) -> set[str]:
    return {f.code for f in report.findings if severity is None or f.severity is severity}


def test_fp32_run_components_step_and_contract(ckpts: Ckpts) -> None:
    report = run_audit(str(ckpts["fp32"]))
    assert report.format == "lightning"
    comps = {c.kind: c for c in report.components}
    assert comps[ComponentKind.MODEL].where == ("state_dict",)
    assert comps[ComponentKind.OPTIMIZER].where == ("optimizer_states",)
    assert comps[ComponentKind.SCHEDULER].where == ("lr_schedulers",)
    assert "loops" in comps[ComponentKind.DATA_PROGRESS].where
    assert "Lightning loop progress" in comps[ComponentKind.DATA_PROGRESS].detail
    # Lightning saves no RNG state: a warning, not an error.
    assert not comps[ComponentKind.RNG].found
    assert [(f.subject, f.severity) for f in report.findings if f.code == "component.missing"] == [
        ("rng", Severity.WARNING)]
    assert report.extra["step"] == 2  # global_step, not the epoch counter
    assert report.contract is not None and report.contract.master_dtype == "float32"
    assert not codes(report, Severity.ERROR), [f.message for f in report.findings]


def test_decay_groups_and_leading_buffer_are_attached_exactly(ckpts: Ckpts) -> None:
    ckpt = ckpts["fp32"]
    groups = truth(ckpt)["groups"]
    report = run_audit(str(ckpt))
    index_keyed = next(f for f in report.findings if f.code == "optimizer.index-keyed")
    assert index_keyed.evidence["attachment"] == "unique-order"
    assert index_keyed.evidence["groups"] == [len(g) for g in groups]
    osd = vetted_torch_load(ckpt)["optimizer_states"][0]
    expected = {k: n
                for g, names in zip(osd["param_groups"], groups, strict=True)
                for k, n in zip(g["params"], names, strict=True)}
    got = {int(t.name.split("/")[-2]): t.param for t in report.tensors
           if t.component == "optimizer" and t.role == "exp_avg"}
    assert got == expected
    roles = {t.name.split("/", 1)[1]: t.role for t in report.tensors if t.component == "model"}
    assert roles.pop("tokens_seen") == "buffer"
    assert set(roles.values()) == {"parameter"}


def test_bf16_true_is_clean_under_its_low_precision_contract(ckpts: Ckpts) -> None:
    report = run_audit(str(ckpts["bf16-true"]))
    params = [t for t in report.tensors if t.component == "model" and t.role == "parameter"]
    moments = [t for t in report.tensors if t.component == "optimizer" and t.role in ("exp_avg", "exp_avg_sq")]
    assert {t.dtype for t in params} == {"bfloat16"} and {t.dtype for t in moments} == {"bfloat16"}
    assert report.contract is not None and report.contract.master_dtype == "bfloat16"
    # Lightning records no precision setting in the .ckpt (only a 16-mixed GradScaler's state): the bf16 contract is
    # inferred from the tensors, which an all-bf16 export of a bf16-mixed run would look like too. Said, not judged.
    assert report.contract.source == "optimizer-state" and report.contract.records == ()
    (inferred,) = [f for f in report.findings if f.code == "contract.inferred"]
    assert inferred.severity is Severity.WARNING and "--master-dtype float32" in inferred.message
    assert not codes(report, Severity.ERROR)
    assert not {c for c in codes(report) if c.startswith("precision.")}
    # Declared, it is clean of that warning.
    declared = run_audit(str(ckpts["bf16-true"]), AuditOptions(master_dtype="bfloat16"))
    assert "contract.inferred" not in codes(declared) and not codes(declared, Severity.ERROR)
    # Held to fp32 masters, every parameter is low-precision storage.
    strict = run_audit(str(ckpts["bf16-true"]), AuditOptions(master_dtype="float32"))
    flagged = {f.subject for f in strict.findings if f.code == "precision.low-precision-storage"}
    assert flagged == {t.name for t in params}


def test_16_mixed_records_its_grad_scaler_and_an_export_cast_to_bf16_contradicts_it(
        ckpts: Ckpts, tmp_path: Path) -> None:
    import torch

    import lib_writers

    report = run_audit(str(ckpts["16-mixed"]))
    assert report.contract is not None
    assert (report.contract.master_dtype, report.contract.source, report.contract.where) == (
        "float32", "grad-scaler", "MixedPrecision")
    assert not codes(report, Severity.ERROR)
    # An exporter casts the whole state (weights and moments) to bf16 and keeps the rest: the record contradicts it.
    state = torch.load(ckpts["16-mixed"], weights_only=True)
    state["state_dict"] = lib_writers.cast_to_bf16(state["state_dict"])
    state["optimizer_states"] = lib_writers.cast_to_bf16(state["optimizer_states"])
    torch.save(state, tmp_path / "export.ckpt")
    cast = run_audit(str(tmp_path / "export.ckpt"))
    (mismatch,) = [f for f in cast.findings if f.code == "contract.mismatch"]
    assert mismatch.severity is Severity.ERROR and mismatch.message.startswith("MixedPrecision records a GradScaler")
    assert "precision.low-precision-storage" in codes(cast, Severity.ERROR)
    # Without the record (a bf16-mixed run keeps none), the same export is a warning that names the flag.
    del state["MixedPrecision"]
    torch.save(state, tmp_path / "no-record.ckpt")
    bare = run_audit(str(tmp_path / "no-record.ckpt"))
    assert "contract.inferred" in codes(bare, Severity.WARNING) and not codes(bare, Severity.ERROR)
