"""The JSON report: a documented, versioned interface (``schema_version``; see docs/json-schema.md)."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from typing import Any, TextIO

from ckptaudit import __version__
from ckptaudit.model import HASH_ALGORITHM, SCHEMA_VERSION, Report, Severity, printable, text

__all__ = ["render_json", "to_dict"]


def _plain(value: Any) -> Any:
    if isinstance(value, Severity):
        return value.label
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {text(k): _plain(v) for k, v in dict.items(value)}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        # Integers past Python's int-to-string limit and NaN / infinities become documented texts.
        return printable(value)
    np_value = _numpy_value(value)
    if np_value is not None:
        return np_value
    return str(value)


def _numpy_value(value: Any) -> Any:
    """NumPy scalars and small arrays (RNG states) as JSON values; ``None`` for anything else."""
    import numpy as np

    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return printable(value.item())
    if isinstance(value, np.ndarray):
        return f"<array {value.dtype}{list(value.shape)}>"
    return None


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
