"""The JSON report: a documented, versioned interface (``schema_version``; see docs/json-schema.md)."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from typing import Any, TextIO

from ckptaudit.findings import HASH_ALGORITHM, SCHEMA_VERSION, RawReport, Severity, printable, text
from ckptaudit.version import __version__

__all__ = ["render_json", "to_dict"]


_FIELDS: dict[type, tuple[str, ...]] = {}
"""Field names of the report's dataclasses, by type (``dataclasses.fields`` per record costs more than the rest)."""
_SHORT_INT_BITS = 4 * 3000
"""Integers this short print under any int-to-string limit Python allows (640 digits at least)."""


def _plain(value: Any) -> Any:
    t = type(value)
    if t is str or t is bool or value is None:
        return value
    if t is int and value.bit_length() <= _SHORT_INT_BITS:
        return value
    if isinstance(value, Severity):
        return value.label
    if isinstance(value, enum.Enum):
        return value.value
    names = _FIELDS.get(t)
    if names is None and dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = _FIELDS[t] = tuple(f.name for f in dataclasses.fields(value))
    if names is not None:
        return {name: _plain(getattr(value, name)) for name in names}
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


def to_dict(report: RawReport) -> dict[str, Any]:
    counts = {s.label: sum(f.severity is s and not f.ignored for f in report.findings) for s in Severity}
    ignored = sum(f.ignored for f in report.findings)
    if ignored:
        counts["ignored"] = ignored
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


_ONE_LINE = ("tensors", "findings", "pairs")
"""Arrays whose entries are written one per line (`compare`'s `pairs` too): a report of a large checkpoint holds
hundreds of thousands."""


def render_json(report: RawReport, out: TextIO) -> None:
    """The report as one JSON document, written at once: the envelope indented, each tensor record and finding
    on a line of its own (a search for a tensor's name shows its whole record; a 60k-tensor report is written
    in a fraction of the time an indented one takes)."""
    parts = []
    for key, value in to_dict(report).items():
        name = json.dumps(key)
        if key in _ONE_LINE and isinstance(value, list) and value:
            lines = ",\n".join("    " + json.dumps(v, allow_nan=False) for v in value)
            parts.append(f"  {name}: [\n{lines}\n  ]")
        else:
            parts.append(f"  {name}: " + json.dumps(value, indent=2, allow_nan=False).replace("\n", "\n  "))
    out.write("{\n" + ",\n".join(parts) + "\n}\n")
