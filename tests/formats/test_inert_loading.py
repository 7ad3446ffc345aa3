"""A checkpoint that pickles objects outside the allowlist beside its tensors: the objects become inert
placeholders (nothing runs), the finding names them, and the rest of the checkpoint is still audited."""

from __future__ import annotations

from pathlib import Path

import torch

from ckptaudit.auditing.judge import run_audit
from ckptaudit.findings import Severity
from ckptaudit.formats import open_checkpoint
from ckptaudit.formats.pickle.unpickler import Opaque
from inert_objects import ModelConfig, Payload


def lightning_like(path: Path, hparams: object) -> Path:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, generator=g).bfloat16().float()  # rounded: the audit must still see it
    torch.save({
        "state_dict": {"model.lin.weight": w},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.randn(4, 3, generator=g),
                                            "exp_avg_sq": torch.rand(4, 3, generator=g)}},
                              "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "lr_schedulers": [{"last_epoch": 2}],
        "global_step": 2,
        "hyper_parameters": {"config": hparams},
    }, path)
    return path


def test_config_object_is_a_placeholder_and_the_tensors_are_audited(tmp_path: Path) -> None:
    path = lightning_like(tmp_path / "cfg.ckpt", ModelConfig())
    with open_checkpoint(str(path)) as ckpt:
        placeholder = ckpt.parts[0].tree["hyper_parameters"]["config"]
        assert isinstance(placeholder, Opaque) and placeholder.name == "inert_objects.ModelConfig"
        assert placeholder.state == {"d_model": 32, "n_layers": 2}  # kept as data, never applied
    report = run_audit(str(path))
    codes = {(f.code, f.severity) for f in report.findings}
    assert ("security.unsafe-pickle", Severity.ERROR) in codes
    assert "inert placeholders" in next(f.message for f in report.findings if f.code == "security.unsafe-pickle")
    # Model and optimizer were found and checked: the rounded weight is caught, nothing is "missing".
    assert not any(f.code == "component.missing" and f.subject in ("model", "optimizer") for f in report.findings)
    assert any(f.code == "precision.bf16-rounded" and f.subject.endswith("lin.weight") for f in report.findings)


def test_a_payload_beside_the_tensors_never_runs(tmp_path: Path) -> None:
    sentinel = tmp_path / "ran"
    path = lightning_like(tmp_path / "payload.ckpt", Payload(str(sentinel)))
    report = run_audit(str(path))
    assert not sentinel.exists()
    finding = next(f for f in report.findings if f.code == "security.unsafe-pickle")
    assert "posix.system" in finding.message or "os.system" in finding.message
    assert any(t.name.endswith("lin.weight") and t.hash for t in report.tensors)
    assert not sentinel.exists()


def test_objects_the_writer_declares_safe_are_read_silently_but_misuse_is_not(tmp_path: Path) -> None:
    # Megatron-LM pickles its args (argparse.Namespace) in common.pt and registers it (megatron.core.safe_globals)
    # for its own weights_only load: an inert placeholder, no security finding. TrainingArguments-like objects
    # nobody declared safe keep security.not-loaded; a Namespace *called* with arguments is a payload shape.
    import argparse

    path = lightning_like(tmp_path / "args.ckpt", argparse.Namespace(lr=0.1, seq_length=16))
    report = run_audit(str(path))
    assert not [f for f in report.findings if f.code.startswith("security.")]
    with open_checkpoint(str(path)) as ckpt:
        placeholder = ckpt.parts[0].tree["hyper_parameters"]["config"]
        assert isinstance(placeholder, Opaque) and placeholder.name == "argparse.Namespace"

    class CalledNamespace:  # pickles as argparse.Namespace("x") through REDUCE: not how a Namespace pickles
        def __reduce__(self) -> tuple[object, ...]:
            return (argparse.Namespace, ("x",))

    misused = tmp_path / "misused.ckpt"
    misused = lightning_like(misused, CalledNamespace())
    report = run_audit(str(misused))
    finding = next(f for f in report.findings if f.code == "security.unsafe-pickle")
    assert "argparse.Namespace" in finding.message and finding.severity is Severity.ERROR
