"""The guard judges the bytes torch reads: a checkpoint file that is a symbolic link is pinned as its target.

A relative link moved into the pin's folder (two folders deeper) would point elsewhere: the guard's report must
hash the tensors ``ckptaudit audit`` hashes on the same checkpoint, find the same errors, and quarantine the
checkpoint itself (never call it "replaced"). Real files: the safetensors library's writer, ``torch.save``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ckptaudit.integrations.guard import Guard
from ckptaudit.integrations.pinning import pin
from real_checkpoints import trained
from runs import cli


def _cli(path: Path) -> dict[str, Any]:
    code, out, err = cli("audit", str(path), "--format", "json", "--no-progress")
    assert code == 1, err
    report: dict[str, Any] = json.loads(out)
    return report


def _errors(report: dict[str, Any]) -> set[str]:
    return {f["code"] for f in report["findings"] if f["severity"] == "error"}


def _hashes(report: dict[str, Any]) -> dict[str, str]:
    return {t["name"]: t["hash"] for t in report["tensors"]}


def _guard(path: Path) -> tuple[Any, dict[str, Any]]:
    guard = Guard(background="thread")
    guard.submit(str(path), step=1)
    assert guard.close(120)
    verdict = guard.verdicts[-1]
    assert verdict.report is not None, verdict
    with open(verdict.report) as fh:
        return verdict, json.load(fh)


def test_a_directory_checkpoint_whose_weights_are_a_relative_link_is_judged_on_the_target(tmp_path: Path) -> None:
    """The attack: ``a/run/step-1/model.safetensors -> ../../../blobs/model.safetensors`` (bf16-rounded weights).
    A pin that moved the link itself into ``a/run/.ckptaudit-pins/<pin>/step-1/`` would read
    ``a/run/blobs/model.safetensors``, a decoy of genuine fp32 weights, and pass."""
    import torch
    from safetensors.torch import save_file

    step = tmp_path / "a" / "run" / "step-1"
    step.mkdir(parents=True)
    for where, rounded in ((tmp_path / "blobs", True), (tmp_path / "a" / "run" / "blobs", False)):
        where.mkdir()
        g = torch.Generator().manual_seed(0)
        weight, bias = torch.randn(32, 32, generator=g), torch.randn(32, generator=g)
        if rounded:
            weight, bias = weight.bfloat16().float(), bias.bfloat16().float()
        save_file({"layer.weight": weight, "layer.bias": bias}, str(where / "model.safetensors"))
    os.symlink(os.path.join("..", "..", "..", "blobs", "model.safetensors"), step / "model.safetensors")
    expected = _cli(step)
    assert "precision.bf16-rounded" in _errors(expected)
    verdict, report = _guard(step)
    assert verdict.ok is False and set(verdict.codes) == _errors(expected), verdict
    assert _hashes(report) == _hashes(expected) and None not in _hashes(report).values()
    # The checkpoint itself was judged "same" and quarantined; the link's target is untouched.
    assert verdict.note == "" and verdict.quarantined_to is not None
    assert os.path.islink(os.path.join(verdict.quarantined_to, "model.safetensors"))
    assert (tmp_path / "blobs" / "model.safetensors").exists() and not step.exists()


def test_a_file_checkpoint_that_is_a_relative_link_is_judged_on_the_target(tmp_path: Path) -> None:
    """Lightning's ``save_last="link"``: ``last.ckpt`` is a relative link to the step's file beside it."""
    trained(tmp_path / "step=4.ckpt", rounded=True)
    os.symlink("step=4.ckpt", tmp_path / "last.ckpt")
    expected = _cli(tmp_path / "last.ckpt")
    verdict, report = _guard(tmp_path / "last.ckpt")
    assert verdict.ok is False and set(verdict.codes) == _errors(expected) and "precision.bf16-rounded" in verdict.codes
    assert _hashes(report) == _hashes(expected) and None not in _hashes(report).values()
    assert verdict.note == ""


def test_the_pin_of_a_link_holds_its_targets_inode(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (tmp_path / "weights.bin").write_bytes(b"w" * 100)
    os.symlink(os.path.join("..", "weights.bin"), ckpt / "model.bin")
    made = pin(str(ckpt))
    try:
        assert made.pinned
        pinned = Path(made.path) / "model.bin"
        assert not pinned.is_symlink() and pinned.stat().st_ino == (tmp_path / "weights.bin").stat().st_ino
        assert made.changed() is None and made.at_checkpoint() == "same"
    finally:
        made.release()
