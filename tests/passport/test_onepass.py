"""The passport's digests from the audit's own pass (``run_audit(digests=...)``, :func:`ckptaudit.passport.digests.
audit_digests`): the same bytes as the standalone digest functions give, on real torch.save, DCP (a 2-rank FSDP2
save) and safetensors checkpoints; the audit's own report unchanged; the guard's passport taken from its audit's
pass (the files digested while it scans, nothing read after it) with the tensor digests ``attest`` gives.

Run: ``.venv/bin/python -m pytest -q tests/passport/test_onepass.py``
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.auditing.judge import AuditOptions, run_audit
from ckptaudit.auditing.plan import plan_scan
from ckptaudit.ondisk.passport import passport_path
from ckptaudit.passport import attest, read_passport
from ckptaudit.passport.digests import audit_digests, digest_files, list_files, tensor_digests
from real_checkpoints import trained


def _tensors(torch: Any) -> dict[str, Any]:
    """Every path of the scan's chunk loop: a 3 MiB genuine fp32 tensor (decided by its first chunk, the rest in
    pieces), a bf16-rounded fp32 one (undecided: every chunk visited), 16-bit and integer ones, small ones, an
    empty one."""
    g = torch.Generator().manual_seed(1)
    big = torch.randn(768, 1024, generator=g)
    return {"big": big, "rounded": torch.randn(600, 1000, generator=g).bfloat16().float(),
            "half": torch.randn(300, 700, generator=g).bfloat16(), "ints": torch.arange(70000, dtype=torch.int64),
            "small": torch.randn(5, 3, generator=g), "empty": torch.zeros(0, 4), "flag": torch.tensor(True)}


@pytest.fixture(scope="module")
def checkpoints(fsdp_run: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch
    from safetensors.torch import save_file

    work = tmp_path_factory.mktemp("onepass")
    state = _tensors(torch)
    torch.save({"model": {**state, "strided": state["big"].t()}}, work / "model.pt")  # a view saved with strides
    save_file(state, str(work / "model.safetensors"))
    dcp = work / "dcp"
    shutil.copytree(Path(fsdp_run["dir"]) / "faithful", dcp)  # row shards of two ranks, in two files
    return {"torch.save": work / "model.pt", "safetensors": work / "model.safetensors", "dcp": dcp}


@pytest.mark.parametrize("algorithm", ["sha256", "blake3"])
@pytest.mark.parametrize("fmt", ["torch.save", "safetensors", "dcp"])
@pytest.mark.parametrize("jobs", [1, 3])
def test_the_audit_gives_the_standalone_digests_and_its_own_report(checkpoints: dict[str, Path], fmt: str,
                                                                   algorithm: str, jobs: int) -> None:
    path = str(checkpoints[fmt])
    asked = audit_digests(path, algorithm, jobs=jobs)
    report = run_audit(path, AuditOptions(jobs=jobs), digests=asked.scan)
    assert asked.scan.done and asked.scan.beside_error is None and not asked.scan.errors

    assert asked.file_digests() == digest_files(list_files(path), algorithm, jobs=jobs)
    plan = plan_scan(path)
    try:
        alone, errors = tensor_digests([item[0] for item in plan.items], plan.ckpt.maps, jobs=jobs)
    finally:
        plan.close()
    assert not errors and len(alone) >= 7
    assert asked.tensor_digests() == alone  # names, dtypes, shapes and digests, in the checkpoint's order

    plain = run_audit(path, AuditOptions(jobs=jobs))  # the audit is the same with or without the digests
    assert report.tensors == plain.tensors and report.findings == plain.findings and report.summary == plain.summary


def test_attest_records_the_digests_of_its_audits_pass(checkpoints: dict[str, Path], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``attest`` reads the tensors once: the second pass of :func:`tensor_digests` is not run."""
    import ckptaudit.passport.attesting as attesting

    def not_again(*a: Any, **k: Any) -> Any:
        raise AssertionError("attest read the tensors a second time for their digests")

    path = str(checkpoints["torch.save"])
    monkeypatch.setattr(attesting, "tensor_digests", not_again)
    p = attest(path, output=str(tmp_path / "p.json"), algorithm="sha256", jobs=2)
    monkeypatch.undo()
    plan = plan_scan(path)
    try:
        alone, _ = tensor_digests([item[0] for item in plan.items], plan.ckpt.maps)
    finally:
        plan.close()
    assert list(p.tensors) == alone and p.files == tuple(digest_files(list_files(path), "sha256"))


def test_the_guards_passport_comes_from_its_audits_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard's passport carries the tensor digests ``attest`` gives, and its files are digested while the audit
    runs (beside the scan), never after it. (The worker process of ``background="process"`` runs the same
    :func:`~ckptaudit.integrations.guard_worker.audit_to_file`; in-process, the reads can be watched.)"""
    import ckptaudit.auditing.judge as judge
    import ckptaudit.passport.digests as digests
    from ckptaudit.integrations.guard import Guard

    ckpt = trained(tmp_path / "step=2.pt", width=256)
    auditing = []
    during: list[bool] = []
    real_audit, real_digest = judge.run_audit, digests.digest_files

    def run_audit_seen(*a: Any, **k: Any) -> Any:
        auditing.append(True)
        try:
            return real_audit(*a, **k)
        finally:
            auditing.pop()

    def digest_seen(*a: Any, **k: Any) -> Any:
        during.append(bool(auditing))
        return real_digest(*a, **k)

    monkeypatch.setattr(judge, "run_audit", run_audit_seen)
    monkeypatch.setattr(digests, "digest_files", digest_seen)
    guard = Guard(background="thread")
    guard.submit(str(ckpt), step=2)
    assert guard.close(120)
    (verdict,) = guard.verdicts
    assert verdict.ok and verdict.passport == passport_path(str(ckpt), is_dir=False), verdict
    monkeypatch.undo()
    assert during == [True]  # one read of the files, while the audit scanned them
    guarded = read_passport(verdict.passport)
    made = attest(str(ckpt), output=str(tmp_path / "attest.json"))
    assert len(guarded.tensors) == len(made.tensors) >= 6
    assert guarded.tensors == made.tensors and guarded.files == made.files


def test_a_quick_audit_gives_file_digests_and_says_why_no_tensor_digests(checkpoints: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    """A quick scan reads each tensor's first chunk: no tensor digest comes from it (and the request says why);
    ``attest`` of a quick audit still records them all, from a pass of their own."""
    path = str(checkpoints["torch.save"])
    asked = audit_digests(path, "sha256", jobs=2)
    run_audit(path, AuditOptions(jobs=2, quick=True), digests=asked.scan)
    assert asked.tensor_digests() == [] and "first chunk" in asked.scan.skipped
    assert asked.file_digests() == digest_files(list_files(path), "sha256")
    p = attest(path, output=str(tmp_path / "quick.json"), options=AuditOptions(quick=True), algorithm="sha256")
    full = attest(path, output=str(tmp_path / "full.json"), algorithm="sha256")
    assert p.verdict == "not-judged" and p.tensors == full.tensors and len(p.tensors) >= 7


def test_a_failed_file_digest_leaves_the_audit_whole(checkpoints: dict[str, Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """What runs beside the scan never fails the audit: its error waits for the passport, which raises it."""
    import ckptaudit.passport.digests as digests

    def unreadable(*a: Any, **k: Any) -> Any:
        raise PermissionError(13, "Permission denied", "model.pt")

    path = str(checkpoints["torch.save"])
    monkeypatch.setattr(digests, "digest_files", unreadable)
    asked = audit_digests(path, "blake3", jobs=2)
    report = run_audit(path, AuditOptions(jobs=2), digests=asked.scan)
    assert report.tensors == run_audit(path, AuditOptions(jobs=2)).tensors and len(asked.tensor_digests()) >= 7
    with pytest.raises(PermissionError, match="Permission denied"):
        asked.file_digests()
    with pytest.raises(RuntimeError, match="one audit"):  # a request is filled once
        run_audit(path, AuditOptions(jobs=2), digests=asked.scan)
