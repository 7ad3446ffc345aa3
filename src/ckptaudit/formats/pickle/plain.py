"""The plain pickle reader: a file that is neither a zip nor a tar (``*.pkl``, a ``torch.save`` file in the legacy
stream format), scanned, then loaded only through the restricted unpickler; the legacy stream format refused."""

from __future__ import annotations

from typing import Any

from ckptaudit.catalogue import finding
from ckptaudit.findings import Finding
from ckptaudit.formats.base import Part
from ckptaudit.formats.io.safeio import open_regular
from ckptaudit.formats.pickle.legacy import LEGACY_MAGIC, read_legacy_stream
from ckptaudit.formats.pickle.object_tree import check_tree
from ckptaudit.formats.pickle.report import limit_evidence, report_unloaded
from ckptaudit.formats.pickle.scan import PickleLimitError, PickleScan, scan
from ckptaudit.formats.pickle.unpickler import RestrictedUnpickler, base_table

__all__ = ["read_pickle"]


def read_pickle(probe: Any, findings: list[Finding]) -> Part | None:
    """The pickle reader (:mod:`ckptaudit.formats.contract`), last in order: ``torch.load`` reads pickles from byte
    0 once the zip and the tar are ruled out: the legacy stream format (a pickled magic number first), or it fails
    after unpickling the first one."""
    full, name, subject, size = probe.path, probe.name, probe.subject, probe.size
    with open_regular(full) as fh:
        result = scan(fh)
        if result.unsafe or result.harmless:
            report_unloaded(subject, result, findings)
            return Part(name, "pickle", None)
        if result.error is not None:
            _corrupt_pickle(subject, result, findings)
            return None
        fh.seek(0)
        first = _small_pickle_value(fh, result.end)
    if first == LEGACY_MAGIC:
        return read_legacy_stream(full, name, subject, findings)
    if result.end != size:
        findings.append(
            finding("integrity.corrupt", subject, f"{subject}: {size - result.end} bytes after the pickle's end",
                    offset=result.end)
        )
    with open_regular(full) as fh:
        try:
            value = RestrictedUnpickler(fh, base_table(), size=result.end).load()
            problem = check_tree(value)
            if problem is not None:
                raise PickleLimitError(problem)
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the pickle does wrong is a corrupt file
            findings.append(finding("integrity.corrupt", subject, f"{subject}: cannot be unpickled ({exc})",
                                    **limit_evidence(isinstance(exc, PickleLimitError))))
            return None
    return Part(name, "pickle", value)


def _corrupt_pickle(subject: str, result: PickleScan, findings: list[Finding]) -> None:
    findings.append(
        finding("format.unrecognized" if result.error_offset == 0 else "integrity.corrupt", subject,
                f"{subject}: not a torch.save archive, safetensors file or readable pickle "
                f"({result.error} at byte {result.error_offset})", offset=result.error_offset,
                **limit_evidence(result.limit))
    )


def _small_pickle_value(fh: Any, end: int) -> Any:
    if end > 4096:
        return None
    try:
        return RestrictedUnpickler(fh, {}, size=end).load()
    except Exception:  # noqa: BLE001 - only the legacy magic number matters here
        return None
