"""The findings a reader reports for a pickle it did not (or only inertly) load: the globals outside the allowlist,
named, and the evidence that a finding is a reader's safety limit."""

from __future__ import annotations

from typing import Any

from ckptaudit.catalogue import finding
from ckptaudit.findings import Finding
from ckptaudit.formats.pickle.allowlist import WRITER_DECLARED_SAFE
from ckptaudit.formats.pickle.scan import PickleScan

__all__ = ["limit_evidence", "report_unloaded"]


def limit_evidence(flag: bool) -> dict[str, Any]:
    """Evidence that a finding is a reader's safety limit rather than malformed data."""
    return {"limit": True} if flag else {}


def report_unloaded(subject: str, result: PickleScan, findings: list[Finding], *, inert: bool = False) -> None:
    """The security finding for a pickle with globals outside the allowlist. ``inert``: the rest of the file was
    read with inert placeholders where those objects were (nothing executed), and is audited."""
    unsafe = result.unsafe
    harmless = tuple(h for h in result.harmless if h not in WRITER_DECLARED_SAFE)
    if not unsafe and not harmless and result.error is None:
        return  # only objects the writing library declares safe for its own weights_only load: nothing to say
    what = ("their objects were replaced by inert placeholders and the rest of the file was read and audited"
            if inert else "it was not loaded")
    if unsafe:
        misused = [n for n in unsafe if n in result.misused]
        why = (f" ({', '.join(misused)} called with arguments its own pickling never uses)" if misused else "")
        findings.append(
            finding(
                "security.unsafe-pickle",
                subject,
                f"{subject} references {', '.join(unsafe)}, outside the safe allowlist{why}; {what}, and "
                "nothing in it was executed. Do not torch.load it with weights_only=False.",
                globals=list(unsafe + result.harmless),
            )
        )
    elif harmless:
        findings.append(
            finding(
                "security.not-loaded",
                subject,
                f"{subject} pickles framework objects ({', '.join(harmless)}) that need arbitrary code to load; "
                + ("left as inert placeholders, never executed" if inert else "skipped, never executed"),
                globals=list(harmless),
            )
        )
    if result.error is not None:
        findings.append(finding("integrity.corrupt", subject,
                                f"{subject}: the pickle is also malformed ({result.error} at byte "
                                f"{result.error_offset})", offset=result.error_offset))
