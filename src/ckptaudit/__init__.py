"""ckptaudit: is this checkpoint really my training state, and can I resume from it?

The public Python API (documented in ``docs/api.md``; everything else is internal and may change)::

    import ckptaudit

    report = ckptaudit.audit("out/checkpoint-500")           # -> ckptaudit.Report
    report.ok, report.findings, report.to_json()
    ckptaudit.compare("ref/step-8", "export/model.pt")       # -> ckptaudit.Report

plus :mod:`ckptaudit.integrations` (guards for Trainer, Lightning, Accelerate, DeepSpeed, torchtitan,
ckptaudit.store) and :mod:`ckptaudit.testing` (assertions for pytest and CI). ``import ckptaudit`` is cheap:
nothing heavy (no torch, no NumPy) is imported until a function is called. The types of this surface are in ``__init__.pyi`` (the root
imports nothing of its own, not even for type checking).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Report", "__version__", "audit", "compare"]


def __getattr__(name: str) -> Any:
    # Resolved when first used: the package root imports nothing of its own (tests/test_layering.py), so
    # ``import ckptaudit`` stays cheap. ``ckptaudit.audit`` *is* ``ckptaudit.api.audit``: one function, whose
    # signature (``help(ckptaudit.audit)``) is derived from the option table, ckptaudit.options.
    if name == "__version__":
        return importlib.import_module("ckptaudit.version").__version__
    if name in __all__:
        return getattr(importlib.import_module("ckptaudit.api"), name)
    if name == "load":  # the safe loader's module (``ckptaudit.load.load(path)``), imported when first named
        return importlib.import_module("ckptaudit.load")
    raise AttributeError(f"module 'ckptaudit' has no attribute {name!r}")
