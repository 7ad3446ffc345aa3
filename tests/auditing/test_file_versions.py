"""One file, one reading: the tensors of a file are read from the version whose header was parsed, or not at all.

A file replaced by another of the same size between the header's parse and the scan (a save overwriting the
checkpoint mid-audit, or an attacker) must be ``integrity.changed`` with its tensors unread, never a report of
hashes that belong to neither version. The replacement is made at a fixed point of the audit (the engine's
functions wrapped), so every test is deterministic: in one process (the public API) and on 2 real gloo ranks.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

import ckptaudit
from ckptaudit.auditing import scan
from ckptaudit.auditing.judge import AuditOptions, run_audit
from ckptaudit.formats.io.safeio import FileChanged, FileId, FileIds, open_regular
from ckptaudit.launch import launch

FAST: dict[str, Any] = {"start_method": "forkserver", "preload": ("torch", "torch.distributed", "dist_plan_jobs")}


def _safetensors(path: Path, seed: int) -> None:
    """A real safetensors file (the library's writer) of two bf16-rounded fp32 parameters; every seed gives a
    file of the same size."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    save_file({"layer.weight": torch.randn(64, 64, generator=g).bfloat16().float(),
               "layer.bias": torch.randn(64, generator=g).bfloat16().float()}, str(path))


def _torch_save(path: Path, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    torch.save({"layer.weight": torch.randn(64, 64, generator=g).bfloat16().float(),
                "layer.bias": torch.randn(64, generator=g).bfloat16().float()}, str(path))


WRITERS = {"model.safetensors": _safetensors, "model.pt": _torch_save}


@pytest.fixture(params=sorted(WRITERS))
def versions(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Path, Path]:
    """``(checkpoint, replacement, pristine copy of the checkpoint)``: two versions of one file, same size."""
    name = request.param
    for d in ("ckpt", "next", "copy"):
        (tmp_path / d).mkdir()
    WRITERS[name](tmp_path / "ckpt" / name, 1)
    WRITERS[name](tmp_path / "next" / name, 2)
    shutil.copyfile(tmp_path / "ckpt" / name, tmp_path / "copy" / name)
    assert (tmp_path / "ckpt" / name).stat().st_size == (tmp_path / "next" / name).stat().st_size
    assert (tmp_path / "ckpt" / name).read_bytes() != (tmp_path / "next" / name).read_bytes()
    return tmp_path / "ckpt" / name, tmp_path / "next" / name, tmp_path / "copy" / name


def _hashes(report: Any) -> dict[str, str | None]:
    return {t.name: t.hash for t in report.raw.tensors}


def _replace_after_planning(monkeypatch: pytest.MonkeyPatch, path: Path, replacement: Path) -> None:
    plan_scan = scan.plan_scan

    def planned(*a: Any, **k: Any) -> Any:
        out = plan_scan(*a, **k)  # the readers parsed the header (and opened the file) here
        os.replace(replacement, path)
        return out

    monkeypatch.setattr(scan, "plan_scan", planned)


def test_each_version_alone_is_bf16_rounded(versions: tuple[Path, Path, Path]) -> None:
    for p in versions:
        report = ckptaudit.audit(str(p))
        assert {f.subject for f in report.findings if f.code == "precision.bf16-rounded"} == {
            "layer.weight", "layer.bias"}, report.summary


def test_a_file_replaced_between_header_and_scan_is_changed_and_unread(versions: tuple[Path, Path, Path],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path, replacement, _ = versions
    _replace_after_planning(monkeypatch, path, replacement)
    report = ckptaudit.audit(str(path))
    changed = [f for f in report.findings if f.code == "integrity.changed"]
    assert [f.subject for f in changed] == [path.name], report.findings
    assert "another file: device" in changed[0].message and changed[0].evidence["unread"] == 2
    assert _hashes(report) == {"layer.weight": None, "layer.bias": None}  # no hash of bytes of two versions
    assert not [f for f in report.findings if f.code in ("precision.bf16-rounded", "integrity.corrupt")]
    assert not report.ok


def test_a_file_rewritten_in_place_between_header_and_scan_is_changed(versions: tuple[Path, Path, Path],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The same inode, rewritten (another ``mtime_ns``: here one clock tick later, set explicitly so that the
    test does not depend on the filesystem's timestamp resolution)."""
    path, replacement, _ = versions
    plan_scan = scan.plan_scan

    def planned(*a: Any, **k: Any) -> Any:
        out = plan_scan(*a, **k)
        before = path.stat()
        with open(path, "r+b") as fh:
            fh.write(replacement.read_bytes())
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 4_000_000))
        assert path.stat().st_ino == before.st_ino
        return out

    monkeypatch.setattr(scan, "plan_scan", planned)
    report = ckptaudit.audit(str(path))
    changed = [f for f in report.findings if f.code == "integrity.changed"]
    assert [f.subject for f in changed] == [path.name] and "modified at" in changed[0].message
    assert _hashes(report) == {"layer.weight": None, "layer.bias": None}


def test_a_file_replaced_once_the_scan_opened_it_is_read_whole_from_the_version_parsed(
        versions: tuple[Path, Path, Path]) -> None:
    """One descriptor from the first tensor to the last: a replacement after the scan opened the file changes
    nothing that is read (the report is the pristine copy's)."""
    path, replacement, copy = versions
    expected = _hashes(ckptaudit.audit(str(copy)))
    done: list[int] = []

    def progress(scanned: int, total: int) -> None:
        if not done:
            os.replace(replacement, path)
        done.append(scanned)

    report = run_audit(str(path), AuditOptions(jobs=1), progress=progress)
    assert len(done) == 2  # the replacement came between the two tensors
    assert {t.name: t.hash for t in report.tensors} == expected and None not in expected.values()
    assert not [f for f in report.findings if f.code == "integrity.changed"]


def test_file_ids_record_the_first_version_and_refuse_another(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x" * 10)
    b.write_bytes(b"y" * 10)
    ids = FileIds()
    with open_regular(str(a), ids):
        pass
    first = ids.get(str(a))
    assert first == FileId.of(a.stat())
    with open_regular(str(a), ids):  # the same version: accepted
        pass
    os.replace(b, a)
    with pytest.raises(FileChanged, match=r"changed while the checkpoint was audited \(another file: device"):
        open_regular(str(a), ids)
    assert ids.get(str(a)) == first  # the first version stays the one to find
    # Across hosts only size and mtime_ns are compared (inode numbers are local to a mount).
    other_host = FileIds({str(a): FileId(0, 0, first.size, a.stat().st_mtime_ns)}, same_host=False)
    with open_regular(str(a), other_host):
        pass
    assert FileId(1, 2, 10, 5).differs(FileId(1, 2, 11, 5)) == "11 bytes, was 10"


def _audit_two_ranks(path: Path, replacement: Path, when: str) -> dict[str, Any]:
    import dist_plan_jobs

    results = launch(dist_plan_jobs.audit_rank_replacing, 2, (str(path), str(replacement), when), timeout_s=240,
                     pg_timeout_s=120, **FAST)
    report: dict[str, Any] = results[0]["report"]
    return report


def test_two_ranks_refuse_a_file_replaced_after_rank_0_parsed_it(versions: tuple[Path, Path, Path]) -> None:
    """Rank 0 parses the header, the file is replaced, then every rank's view check finds another version than
    the one rank 0 read (a size check alone passes: same size): nothing is read."""
    path, replacement, _ = versions
    report = _audit_two_ranks(path, replacement, "after-plan")
    changed = [f for f in report["findings"] if f["code"] == "integrity.changed"]
    assert [f["subject"] for f in changed] == [path.name], report["findings"]
    assert "is another version than rank 0 read (another file: device" in changed[0]["message"]
    assert sorted(changed[0]["evidence"]["ranks"]) == [0, 1]
    assert {t["precision"] for t in report["tensors"]} == {"unread"}
    assert all(t.get("hash") is None for t in report["tensors"])


def test_two_ranks_refuse_a_file_replaced_after_a_ranks_view_check(versions: tuple[Path, Path, Path]) -> None:
    """Rank 1's view check passes, then the file is replaced before its scan opens it: that open finds another
    version than rank 0 read, and rank 1's tensor is unread. Whatever rank 0 scanned (before or after the
    replacement: the ranks race) is the pristine version's or unread, never the other version's."""
    path, replacement, copy = versions
    expected = {t.name: t.hash for t in ckptaudit.audit(str(copy)).raw.tensors}
    report = _audit_two_ranks(path, replacement, "after-check")
    changed = [f for f in report["findings"] if f["code"] == "integrity.changed"]
    assert [f["subject"] for f in changed] == [path.name], report["findings"]
    assert "another file: device" in changed[0]["message"]
    hashes = {t["name"]: t.get("hash") for t in report["tensors"]}
    assert None in hashes.values()  # rank 1's tensor
    assert all(h is None or h == expected[name] for name, h in hashes.items())
