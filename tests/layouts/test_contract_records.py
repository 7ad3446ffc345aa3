"""The pure parts of the contract and step readers: what each stack's precision record means
(:mod:`ckptaudit.layouts.precision`), the training step's spellings (:func:`ckptaudit.layouts.is_step_key`,
:func:`ckptaudit.layouts.find_step`), and how a record and the tensors combine (:func:`infer_contract`). The real
libraries' checkpoints are in ``test_libs_*.py``; these pin the rules on plain data.

Run: ``.venv/bin/python -m pytest -q tests/layouts/test_contract_records.py``
"""

from __future__ import annotations

import pytest

from ckptaudit.checks.precision import infer_contract
from ckptaudit.findings import Precision, TensorRecord
from ckptaudit.layouts import find_step, is_step_key
from ckptaudit.layouts.precision import deepspeed_record, megatron_record, scaler_record


@pytest.mark.parametrize(("config", "expected"), [
    ({"bf16": {"enabled": True}}, ("float32", True, "bf16.enabled=true")),
    ({"bfloat16": {"enabled": True}}, ("float32", True, "bf16.enabled=true")),  # DeepSpeed's older key
    ({"fp16": {"enabled": True, "loss_scale": 0}}, ("float32", True, "fp16.enabled=true")),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
     ("bfloat16", True, "bf16.enabled=true, bf16.bf16_master_weights_and_grads=true")),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
     ("float16", True, "fp16.enabled=true, fp16.fp16_master_weights_and_grads=true")),
    ({"bf16": {"enabled": False}, "optimizer": {"type": "AdamW"}}, (None, False, "neither bf16 nor fp16 enabled")),
    ({"bf16": {"enabled": "true"}}, (None, False, "neither bf16 nor fp16 enabled")),  # not a bool: not believed
])
def test_deepspeed_config(config: dict[str, object], expected: tuple[object, ...]) -> None:
    record = deepspeed_record(config, "mp_rank_00_model_states.pt/ds_config")
    assert record is not None
    assert (record.master_dtype, record.in_optimizer, record.says) == expected
    assert deepspeed_record({}, "x") is None and deepspeed_record(None, "x") is None


def test_megatron_args() -> None:
    assert megatron_record({"bf16": True, "fp16": False}, "common.pt/args").master_dtype == "float32"  # type: ignore[union-attr]
    plain = megatron_record({"bf16": False, "fp16": False}, "common.pt/args")
    assert plain is not None and plain.master_dtype == "float32" and not plain.in_optimizer
    aware = megatron_record({"bf16": True, "use_precision_aware_optimizer": True, "main_params_dtype": "float16"},
                            "common.pt/args")
    assert aware is not None and (aware.master_dtype, aware.in_optimizer) == ("float16", True)
    assert megatron_record({"lr": 1e-3}, "common.pt/args") is None


def test_grad_scaler_state() -> None:
    record = scaler_record({"scale": 65536.0, "growth_factor": 2.0, "_growth_tracker": 0}, "scaler.pt")
    assert record is not None and (record.source, record.master_dtype) == ("grad-scaler", "float32")
    assert scaler_record({}, "scaler.pt") is None  # a disabled GradScaler saves an empty state
    assert scaler_record({"scale": True}, "scaler.pt") is None


@pytest.mark.parametrize(("key", "is_step"), [
    ("step", True), ("global_step", True), ("iteration", True), ("train/step", True), ("train.step", True),
    ("train_state.step", True), ("trainer/global_step", True), ("training_state/iteration", True),
    ("epoch", False), ("steps_per_epoch", False), ("model/step", False), ("optimizer.state.0.step", False),
    ("lr_step", False), ("", False),
])
def test_step_spellings(key: str, is_step: bool) -> None:
    assert is_step_key(key) is is_step


def test_the_step_is_read_best_name_first_then_shallowest() -> None:
    assert find_step({"epoch": 3, "train": {"step": 40}, "global_step": 41}) == ("global_step", 41)
    assert find_step({"train_state": {"step": 7, "ntokens_seen": 9}}) == ("train_state/step", 7)
    assert find_step({"train/step": 5, "iteration": 6}) == ("train/step", 5)
    assert find_step({"step": True, "model": {}}) is None  # a bool is no step


def _param(name: str, dtype: str, precision: Precision) -> TensorRecord:
    return TensorRecord(name, "model", "parameter", name, "f", dtype, (4,), 4, None, precision)


def _moment(name: str, dtype: str) -> TensorRecord:
    return TensorRecord(f"optim/{name}/exp_avg", "optimizer", "exp_avg", name, "f", dtype, (4,), 4, None,
                        Precision.NATIVE_16 if dtype == "bfloat16" else Precision.EXACT)


def test_a_record_decides_and_a_contradicting_state_is_an_error() -> None:
    record = deepspeed_record({"bf16": {"enabled": True}}, "ds_config")
    assert record is not None
    bf16 = ([_param("w", "bfloat16", Precision.NATIVE_16)], [_moment("w", "bfloat16")])
    contract, findings = infer_contract("auto", *bf16, records=[record])
    assert (contract.source, contract.master_dtype, contract.where) == ("deepspeed-config", "float32", "ds_config")
    assert [f.code for f in findings] == ["contract.mismatch"]
    # Without the record the same tensors give an inferred bf16 contract: a warning naming the flag.
    contract, findings = infer_contract("auto", *bf16)
    assert (contract.source, contract.master_dtype) == ("optimizer-state", "bfloat16")
    assert [f.code for f in findings] == ["contract.inferred"] and "--master-dtype float32" in findings[0].message
    # fp32 masters and moments agree with the record: nothing to say.
    fp32 = ([_param("w", "float32", Precision.EXACT)], [_moment("w", "float32")])
    assert infer_contract("auto", *fp32, records=[record])[1] == []
    # A record of bf16 masters by design is a declared low-precision contract (info), not a warning.
    own = deepspeed_record({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "ds_config")
    contract, findings = infer_contract("auto", *bf16, records=[own])  # type: ignore[list-item]
    assert contract.master_dtype == "bfloat16" and [f.code for f in findings] == ["contract.low-precision-masters"]
    # The running job (a guard) is a record too.
    contract, findings = infer_contract("float32", *bf16, flag_source="live", flag_detail="the live run: AdamW")
    assert (contract.source, contract.detail) == ("live", "the live run: AdamW")
    assert [f.code for f in findings] == ["contract.mismatch"]
    assert infer_contract("float32", *bf16)[1] == []  # a flag is the user's word; the per-parameter errors follow


def test_the_layout_rules_are_asked_in_their_order() -> None:
    """Megatron's whole-checkpoint rule first; then a file is what its name says (an index, a manifest, a precision
    record, ignored), a safetensors header's metadata is kept, DeepSpeed's part is taken whole, a component file is
    that component, and only then are a dict's keys read. A rule registered out of order, or given another's place,
    fails here."""
    from ckptaudit.layouts.rules import PartRule, checkpoint_rules, part_rules, register_rule

    assert [r.name for r in checkpoint_rules()] == ["megatron"]
    assert [r.name for r in part_rules()] == ["named-files", "safetensors-metadata", "deepspeed", "component-files",
                                              "keyed"]
    with pytest.raises(ValueError, match="as 'keyed' has"):
        register_rule(PartRule("other", order=90, applies=lambda part, ctx: True, read="x:y"))


def test_a_file_named_for_a_component_is_that_component_whatever_its_keys(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``optimizer.pt`` holding a ``model`` key is the optimizer file (the component rule before the keyed one), and
    ``scaler.pt`` is a precision record, never a model."""
    import torch

    from ckptaudit.findings import ComponentKind
    from ckptaudit.formats import open_checkpoint
    from ckptaudit.layouts import interpret

    torch.save({"model": {"w": torch.ones(2)}}, tmp_path / "optimizer.pt")
    torch.save({"model": {"v": torch.ones(2)}, "scale": torch.tensor(2.0)}, tmp_path / "scaler.pt")
    torch.save({"model": {"u": torch.ones(3)}}, tmp_path / "ckpt.pt")
    view = interpret(open_checkpoint(str(tmp_path)))
    assert view.components[ComponentKind.OPTIMIZER] == ["optimizer.pt"]
    assert view.model is not None and set(view.model.params) == {"u"}
