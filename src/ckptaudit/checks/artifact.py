"""Training checkpoint or serving artifact: the two are kept apart by the ``artifact`` metadata mark.

ckptaudit's serving export writes safetensors with ``artifact=serving`` and the quality gate it passed (or
failed) in the file's metadata; see :mod:`ckptaudit.store.serving`.
"""

from __future__ import annotations

import json

from ckptaudit.catalogue import finding
from ckptaudit.layouts import View
from ckptaudit.model import Finding

__all__ = ["check_artifact"]


def check_artifact(view: View, expect: str) -> tuple[list[Finding], bool]:
    """Findings for the artifact kind; returns (findings, whether the checkpoint is marked serving)."""
    marked = view.metadata.get("artifact") == "serving"
    subject = "artifact"
    if expect == "training":
        if marked:
            return [
                finding(
                    "artifact.serving",
                    subject,
                    "this is a serving artifact (metadata artifact=serving, weights converted to "
                    f"{view.metadata.get('dtype', '16-bit')}): it must not be resumed from; resume from the "
                    f"training checkpoint it was exported from ({view.metadata.get('source', 'unknown')})",
                )
            ], True
        return [], False
    if not marked:
        return [
            finding(
                "artifact.not-serving",
                subject,
                "--expect serving, but the checkpoint has no artifact=serving mark; export it with "
                "ckptaudit export-serving, which runs the quality gate and records it",
            )
        ], False
    gate_raw = view.metadata.get("quality_gate")
    if not gate_raw:
        return [
            finding(
                "artifact.no-quality-gate",
                subject,
                "serving artifact records no output-quality gate: nothing says its outputs were checked "
                "against the full-precision model",
            )
        ], True
    try:
        gate = json.loads(gate_raw)
    except (ValueError, RecursionError):  # not JSON, digits past Python's limit, nesting too deep
        return [finding("integrity.corrupt", subject, "quality_gate metadata is not valid JSON")], True
    if not isinstance(gate, dict) or not gate.get("passed", False):
        failed = gate.get("failures", []) if isinstance(gate, dict) else []
        failed = failed if isinstance(failed, list) else [failed]
        return [
            finding(
                "artifact.gate-failed",
                subject,
                "serving artifact records a FAILED quality gate"
                + (f" ({'; '.join(str(f) for f in failed)})" if failed else "")
                + "; it was written with --force",
                gate=gate,
            )
        ], True
    return [], True
