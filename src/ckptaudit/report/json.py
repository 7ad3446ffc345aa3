"""The JSON report: a documented, versioned interface (``schema_version``; see README "JSON report")."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from typing import Any, TextIO

from ckptaudit import __version__
from ckptaudit.model import HASH_ALGORITHM, SCHEMA_VERSION, Report, Severity

__all__ = ["render_json", "to_dict"]


def _plain(value: Any) -> Any:
    if isinstance(value, Severity):
        return value.label
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    if isinstance(value, float) and value != value:  # NaN is not JSON
        return None
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


def to_dict(report: Report) -> dict[str, Any]:
    counts = {s.label: sum(f.severity is s for f in report.findings) for s in Severity}
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "ckptaudit", "version": __version__},
        "command": report.command,
        "path": report.path,
        "format": report.format,
        "summary": report.summary,
        "counts": counts,
        "contract": _plain(report.contract),
        "components": _plain(report.components),
        "hash_algorithm": HASH_ALGORITHM,
        "tensors": _plain(report.tensors),
        "findings": _plain(report.findings),
    }
    for key, value in report.extra.items():
        if key not in doc:
            doc[key] = _plain(value)
    if os.environ.get("CKPTAUDIT_VALIDATE_REPORTS") == "1":  # set by the test suite: see ckptaudit.schema
        from ckptaudit.schema import validate

        validate(doc)
    return doc


def render_json(report: Report, out: TextIO) -> None:
    json.dump(to_dict(report), out, indent=2, allow_nan=False)
    out.write("\n")
