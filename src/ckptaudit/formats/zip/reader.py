"""The ``torch.save`` archive reader (:mod:`ckptaudit.formats.contract`): one zip file of a checkpoint, read by
:func:`~ckptaudit.formats.zip.archive.read_torch_zip` into one ``torch.save`` part."""

from __future__ import annotations

from typing import Any

from ckptaudit.catalogue import finding
from ckptaudit.findings import Finding
from ckptaudit.formats.base import Part
from ckptaudit.formats.pickle.report import limit_evidence, report_unloaded
from ckptaudit.formats.zip.archive import TorchZipError, read_torch_zip

__all__ = ["read_torch_save"]


def read_torch_save(probe: Any, findings: list[Finding]) -> Part | None:
    """The archive's object tree with lazy tensors; globals outside the allowlist become inert placeholders (named
    by a finding), so the rest (the tensors) is still audited; an archive torch could read otherwise, refused."""
    full, name, subject = probe.path, probe.name, probe.subject
    try:
        tz = read_torch_zip(full, inert=True)
    except TorchZipError as exc:
        what = "not a readable torch.save archive" if exc.code == "integrity.corrupt" else \
            "refused, nothing in it was executed"
        findings.append(finding(exc.code, subject, f"{subject}: {what}: {exc}", offset=exc.offset,
                                **limit_evidence(exc.limit)))
        return None
    if not tz.loaded:
        report_unloaded(subject, tz.scan, findings)
        return Part(name, "torch.save", None)
    if tz.scan.unsafe or tz.scan.harmless:
        report_unloaded(subject, tz.scan, findings, inert=True)
    return Part(name, "torch.save", tz.obj)
