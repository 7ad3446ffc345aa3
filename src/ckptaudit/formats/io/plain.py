"""The two readers that need nothing beyond safe I/O (:mod:`ckptaudit.formats.contract`): a JSON file, bounded
before it is parsed, and the empty file, which no consumer reads."""

from __future__ import annotations

from typing import Any

from ckptaudit.catalogue import finding
from ckptaudit.findings import Finding
from ckptaudit.formats.base import Part
from ckptaudit.formats.io.safeio import read_limited
from ckptaudit.formats.io.safejson import JsonLimitError, loads_limited

__all__ = ["MAX_JSON_BYTES", "read_empty", "read_json"]

MAX_JSON_BYTES = 64 << 20


def read_json(probe: Any, findings: list[Finding]) -> Part | None:
    """A JSON file (an index, a manifest, ``trainer_state.json``) as one ``json`` part."""
    name, subject = probe.name, probe.subject
    raw = read_limited(probe.path, MAX_JSON_BYTES, "JSON file")
    try:
        value = loads_limited(raw, subject)
    except JsonLimitError as exc:
        findings.append(finding("integrity.corrupt", subject, f"{exc}; not read (JSON, limit)", limit=True))
        return None
    except ValueError as exc:  # not JSON, bad UTF-8, integers beyond Python's digit limit
        findings.append(finding("integrity.corrupt", subject, str(exc)))
        return None
    return Part(name, "json", value)


def read_empty(probe: Any, findings: list[Finding]) -> None:
    """An empty file where a ``torch.save`` file or a pickle was expected: corrupt."""
    findings.append(finding("integrity.corrupt", probe.subject, f"{probe.subject} is empty (0 bytes)", offset=0))
