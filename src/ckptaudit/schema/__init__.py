"""The JSON report's schema, shipped with the package: ``report.schema.json`` (JSON Schema, draft 2020-12).

    .venv/bin/python -c "import ckptaudit.schema as s; print(s.SCHEMA_PATH)"

:func:`validate` checks one report document against it (it needs ``jsonschema``, a test dependency). With
``CKPTAUDIT_VALIDATE_REPORTS=1`` in the environment, every report :mod:`ckptaudit.report.json` renders is
validated before it is returned (the test suite sets it, so every report the tests produce is checked).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

__all__ = ["SCHEMA_PATH", "VALIDATE_ENV", "load_schema", "validate"]

SCHEMA_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "report.schema.json")
VALIDATE_ENV = "CKPTAUDIT_VALIDATE_REPORTS"


@functools.cache
def load_schema() -> dict[str, Any]:
    with open(SCHEMA_PATH, encoding="utf-8") as fh:
        schema: dict[str, Any] = json.load(fh)
    return schema


def validate(doc: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the first place where ``doc`` breaks the schema (and every other one)."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(load_schema())
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"  at /{'/'.join(map(str, e.absolute_path))}: {e.message[:300]}" for e in errors[:10]]
        raise ValueError(f"JSON report of {doc.get('command')!r} breaks {os.path.basename(SCHEMA_PATH)} "
                         f"({len(errors)} error(s)):\n" + "\n".join(lines))
