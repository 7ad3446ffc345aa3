"""The guard's lineage and passports: the live check of the masters, which of the training state or the saved file
a failure damaged, the passport written beside each passing checkpoint with its lineage, and the descendants of a
damaged state marked so. Real torch models, optimizers and ``torch.save`` checkpoints; the library stories are in
test_guard_lineage_runs.py."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.integrations.guard import CheckpointAuditFailed, Guard
from ckptaudit.integrations.guard_lineage import SAMPLE_PER_TENSOR, observe_live
from ckptaudit.ondisk.passport import passport_path
from ckptaudit.passport import read_passport


def _trained(width: int = 64) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.Linear(width, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt)
    return model, opt


def _step(model: Any, opt: Any) -> None:
    import torch

    model(torch.randn(8, model[0].in_features)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _round_in_place(tensor: Any, dtype: Any = None) -> None:
    import torch

    with torch.no_grad():
        tensor.copy_(tensor.to(dtype or torch.bfloat16).float())


def test_the_live_check_finds_masters_rounded_in_memory_and_nothing_in_healthy_ones() -> None:
    import torch

    model, opt = _trained()
    healthy = observe_live(opt, step=1)
    assert healthy is not None and healthy.checked == 6 and healthy.rounded == () and not healthy.damaged
    _round_in_place(model[0].weight)
    _round_in_place(model[2].bias, torch.float16)
    seen = observe_live(opt, step=2)
    assert seen is not None and seen.damaged
    assert seen.rounded == ("param group 0 #0 (64, 64): bf16", "param group 0 #5 (4,): fp16")
    # The LayerNorm's ones and zeros are 16-bit-representable but carry no information: never "rounded".
    fresh = torch.nn.LayerNorm(64)
    assert observe_live(torch.optim.AdamW(fresh.parameters())).rounded == ()  # type: ignore[union-attr]


def test_a_sample_that_looks_rounded_is_confirmed_on_every_value() -> None:
    """The sample may miss the values that carry the low bits; the whole-tensor test then says "not rounded"."""
    import torch

    model, opt = _trained(width=256)
    weight = model[0].weight
    _round_in_place(weight)
    with torch.no_grad():  # one value off the sample's runs keeps its low bits: the tensor is not all bf16
        flat = weight.view(-1)
        stride = (flat.numel() - 32) // 7
        flat[stride // 2] += 1e-7
    assert flat.numel() > SAMPLE_PER_TENSOR
    seen = observe_live(opt)
    assert seen is not None and seen.confirmed == 1 and seen.rounded == ()


def test_no_float32_master_means_nothing_to_tell() -> None:
    import torch

    params = [torch.nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16))]
    assert observe_live(torch.optim.SGD(params, lr=0.1)) is None


def _save(model: Any, opt: Any, path: Path, *, export_rounded: bool = False) -> Path:
    import torch

    state = {k: v.clone() for k, v in model.state_dict().items()}
    if export_rounded:  # the lossy exporter: the file is rounded, the live masters keep their bits
        state = {k: v.bfloat16().float() for k, v in state.items()}
    torch.save({"model": state, "optimizer": opt.state_dict()}, path)
    return path


def _run(tmp_path: Path, *, damage: str, on_failure: str = "warn") -> tuple[Guard, dict[int, Path]]:
    """Saves at steps 2, 4, 6, 8 of a real loop, the guard told of the live optimizer at each; at step 6 either the
    live masters are rounded in place (``state``) or only the file written (``file``)."""
    model, opt = _trained()
    guard = Guard(on_failure=on_failure, background="thread")
    saved: dict[int, Path] = {}
    for step in range(1, 9):
        _step(model, opt)
        if step == 6 and damage == "state":
            for p in model.parameters():
                _round_in_place(p)
        if step % 2 == 0:
            saved[step] = _save(model, opt, tmp_path / f"step-{step}.pt", export_rounded=damage == "file" and step == 6)
            guard.observe(opt, step)
            guard.submit(str(saved[step]), step=step)
            assert guard.wait(120)  # a slow step: each verdict before the next save
    return guard, saved


def test_rounded_live_masters_damage_the_state_and_every_later_save_descends_from_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ckptaudit.guard"):
        guard, saved = _run(tmp_path, damage="state")
    v2, v4, v6, v8 = guard.verdicts
    assert (v2.ok, v4.ok, v6.ok, v8.ok) == (True, True, False, True)
    assert v6.damage == "state" and "TRAINING STATE itself is damaged" in v6.advice
    assert "Restore step-4.pt (step 4), the last checkpoint that passed," in v6.advice
    assert "fix the training code that rounds the masters" in v6.advice
    assert v8.damaged_ancestor == "step-6.pt" and guard.status(str(saved[8])) == "descends from damage"
    assert "descends from the damage at step-6.pt" in caplog.text
    # Step 8 passed its own audit, but it is moved aside as a failure is: a resume by name never picks it.
    assert v8.quarantined_to == f"{saved[8]}.quarantined" and not saved[8].exists()
    assert Path(v8.quarantined_to).is_file() and v8.report == f"{v8.quarantined_to}.ckptaudit.json"
    assert "its training state descends from the damage at step-6.pt" in v8.advice
    assert "Restore step-4.pt (step 4), the last checkpoint that passed," in v8.advice
    assert v8.passport == passport_path(v8.quarantined_to)
    # The passports: one beside each passing checkpoint, bound to its bytes, with its lineage.
    assert v6.passport is None and not Path(passport_path(str(saved[6]))).exists()
    p4, p8 = read_passport(v4.passport or ""), read_passport(v8.passport or "")
    assert v4.passport == passport_path(str(saved[4])) and p4.verdict == "pass" and not p4.signed
    assert p4.lineage.state == "clean" and p4.lineage.parent is not None
    assert (p4.lineage.parent.checkpoint, p4.lineage.parent.verdict) == ("step-2.pt", "pass")
    assert p4.lineage.parent.passport_digest == read_passport(v2.passport or "").digest
    assert p8.verdict == "pass" and p8.lineage.state == "descends-from-damage"
    assert p8.lineage.parent is not None and p8.lineage.damaged_ancestor is not None
    assert (p8.lineage.parent.checkpoint, p8.lineage.parent.verdict) == ("step-6.pt", "fail")
    assert p8.lineage.damaged_ancestor.checkpoint == "step-6.pt"
    assert p8.lineage.damaged_ancestor.root_digest.startswith("sha256:")
    assert guard.close(120)


def test_a_file_rounded_by_the_exporter_leaves_later_saves_clean(tmp_path: Path) -> None:
    guard, saved = _run(tmp_path, damage="file")
    v2, v4, v6, v8 = guard.verdicts
    assert (v2.ok, v4.ok, v6.ok, v8.ok) == (True, True, False, True)
    assert v6.damage == "file" and "only the SAVED FILE is damaged" in v6.advice and "Fix the save" in v6.advice
    assert v8.damaged_ancestor is None and guard.status(str(saved[8])) == "passed"
    p8 = read_passport(v8.passport or "")
    assert p8.lineage.state == "clean" and p8.lineage.parent is not None
    assert p8.lineage.parent.verdict == "fail"
    assert guard.close(120)


def test_the_failure_says_which_way_to_go(tmp_path: Path) -> None:
    guard, _ = _run(tmp_path, damage="state", on_failure="stop")
    with pytest.raises(CheckpointAuditFailed, match="failed their audit; training stopped") as caught:
        guard.finish(120)
    text = str(caught.value)
    assert "TRAINING STATE itself is damaged" in text and "Restore step-4.pt (step 4)" in text
    assert "Each failure above says which way to go" in text
    assert "1 later checkpoint(s) passed their own audit but descend from the damaged training state" in text
    assert f"step-8.pt (step 8): descends from step-6.pt -> quarantined to {tmp_path}/step-8.pt.quarantined" in text


def test_a_guard_without_the_live_optimizer_says_it_cannot_tell(tmp_path: Path) -> None:
    bad = _save(*_trained(), tmp_path / "bad.pt", export_rounded=True)
    guard = Guard(background="thread", passport=False)
    guard.submit(str(bad), step=2)
    assert guard.close(120)
    (v,) = guard.verdicts
    assert v.ok is False and v.damage == "unknown" and "cannot tell" in v.advice and v.passport is None


def test_a_signed_passport_when_the_guard_has_a_key(tmp_path: Path) -> None:
    pytest.importorskip("model_signing")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = tmp_path / "key.pem"
    key.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    good = _save(*_trained(), tmp_path / "good.pt")
    guard = Guard(background="thread", passport_key=str(key))
    guard.submit(str(good), step=2)
    assert guard.close(120)
    (v,) = guard.verdicts
    assert v.ok and read_passport(v.passport or "").signed
    with pytest.raises(ValueError, match=r"passport_key='nope\.pem' is not valid"):
        Guard(passport_key="nope.pem")


def _latest(root: Path, *flags: str) -> tuple[int, str]:
    import io

    from ckptaudit.cli import main

    out = io.StringIO()
    code = main(["latest", str(root), "--format", "json", *flags], stdout=out, stderr=io.StringIO())
    return code, out.getvalue()


def test_latest_passes_over_the_descendants_of_a_damaged_state_and_says_why(tmp_path: Path) -> None:
    import json

    guard, _ = _run(tmp_path, damage="state")
    assert guard.close(120)
    code, text = _latest(tmp_path)
    doc = json.loads(text)
    assert code == 0 and doc["latest"] == str(tmp_path / "step-4.pt"), doc["latest"]
    # The guard moved step 8 aside: latest says it passed its own audit but descends from the damage.
    (aside,) = [f for f in doc["findings"] if f["subject"] == "step-8.pt.quarantined"]
    assert aside["code"] == "guard.quarantined" and aside["evidence"]["damaged_ancestor"] == "step-6.pt"
    assert "descends from the damage at step-6.pt" in aside["message"]
    # Moved back by hand (with its passport): latest passes over it by its lineage, unless told otherwise.
    shutil.move(f"{tmp_path}/step-8.pt.quarantined", tmp_path / "step-8.pt")
    shutil.move(passport_path(f"{tmp_path}/step-8.pt.quarantined"), passport_path(str(tmp_path / "step-8.pt")))
    code, text = _latest(tmp_path)
    doc = json.loads(text)
    assert code == 0 and doc["latest"] == str(tmp_path / "step-4.pt"), doc["latest"]
    (why,) = [f for f in doc["findings"] if f["code"] == "guard.descends-from-damage"]
    assert why["subject"] == "step-8.pt" and "descends from damage at step-6.pt" in why["message"]
    assert "Resume from a checkpoint saved before step-6.pt" in why["message"]
    code, text = _latest(tmp_path, "--allow-damaged-lineage")  # the old choice
    assert code == 0 and json.loads(text)["latest"] == str(tmp_path / "step-8.pt")


def test_latest_names_the_newest_passing_save_after_a_file_only_failure(tmp_path: Path) -> None:
    import json

    guard, _ = _run(tmp_path, damage="file")
    assert guard.close(120)
    code, text = _latest(tmp_path)
    doc = json.loads(text)
    assert code == 0 and doc["latest"] == str(tmp_path / "step-8.pt")
    assert not [f for f in doc["findings"] if f["code"] == "guard.descends-from-damage"]


def test_a_run_that_restores_inherits_the_lineage_of_what_it_restored(tmp_path: Path) -> None:
    guard, saved = _run(tmp_path, damage="state")
    assert guard.close(120)
    aside = Path(guard.verdicts[-1].quarantined_to or "")  # step 8, moved aside: restored from there by hand
    for restored, step, state in ((aside, 8, "descends-from-damage"), (saved[4], 4, "clean")):
        model, opt = _trained()
        resumed = Guard(background="thread")
        resumed.restored(str(restored), step=step)
        later = _save(model, opt, tmp_path / f"after-{step}.pt")
        resumed.observe(opt)
        resumed.submit(str(later), step=10)
        assert resumed.close(120)
        (v,) = resumed.verdicts
        lineage = read_passport(v.passport or "").lineage
        assert lineage.parent is not None and lineage.parent.checkpoint == str(restored)
        assert lineage.parent.verdict == "pass" and lineage.state == state
        if state == "clean":  # restoring a passed checkpoint ends the setting aside
            assert lineage.damaged_ancestor is None and v.damaged_ancestor is None
            assert v.quarantined_to is None and later.exists()
        else:
            assert lineage.damaged_ancestor is not None and lineage.damaged_ancestor.checkpoint == "step-6.pt"
            assert v.damaged_ancestor == "step-6.pt" and v.quarantined_to is not None and not later.exists()


def test_a_path_saved_again_loses_the_passport_of_its_old_bytes(tmp_path: Path) -> None:
    """Lightning's last.ckpt is rewritten at every save: the passport of the bytes it held before never stays
    beside new bytes, even while their audit waits."""
    from concurrent.futures import Future

    model, opt = _trained()
    last = _save(model, opt, tmp_path / "last.ckpt")
    guard = Guard(background="thread")
    guard.submit(str(last), step=2)
    assert guard.wait(120) and Path(passport_path(str(last))).exists()
    held: Future[None] = Future()  # an earlier save still writing: the next audit waits behind it
    guard.submit(str(_save(model, opt, tmp_path / "other.ckpt")), step=3, ready=held)
    _save(model, opt, last, export_rounded=True)
    guard.submit(str(last), step=4)
    assert guard.status(str(last)) == "pending" and not Path(passport_path(str(last))).exists()
    held.set_result(None)
    assert guard.close(120) and guard.verdicts[-1].ok is False


def test_the_guards_passport_is_written_whole_without_an_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An fsync right after a save would force the save's own data out with it (ext4's ordered journal), on the
    training's disk, for a passport no more durable than the unsynced checkpoint and report beside it; a passport
    written by ``ckptaudit attest`` is fsynced."""
    import os

    from ckptaudit.passport import attest

    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    good = _save(*_trained(), tmp_path / "good.pt")
    guard = Guard(background="thread")
    guard.submit(str(good), step=2)
    assert guard.close(120)
    (v,) = guard.verdicts
    assert v.ok and read_passport(v.passport or "").verdict == "pass" and synced == []
    attest(str(good))
    assert len(synced) == 1
