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
import os
import sys
import types
from typing import Any

__version__ = "0.1.0"
__all__ = ["Report", "__version__", "audit", "compare"]


def audit(path: str | os.PathLike[str], **options: Any) -> Any:
    """Audit the checkpoint at ``path``; see :func:`ckptaudit.api.audit` for the options."""
    return _api().audit(path, **options)


def compare(reference: str | os.PathLike[str], candidate: str | os.PathLike[str], **options: Any) -> Any:
    """Compare ``candidate`` with ``reference``; see :func:`ckptaudit.api.compare` for the options."""
    return _api().compare(reference, candidate, **options)


def _api() -> Any:
    # Resolved when first called: the package root imports nothing of its own (tests/test_layering.py).
    return importlib.import_module("ckptaudit.api")


def __getattr__(name: str) -> Any:
    if name == "Report":
        return _api().Report
    raise AttributeError(f"module 'ckptaudit' has no attribute {name!r}")


class _Package(types.ModuleType):
    """Keeps ``ckptaudit.audit`` and ``ckptaudit.compare`` the public functions.

    The engine lives in the modules ``ckptaudit.audit`` and ``ckptaudit.compare``; importing a submodule makes
    Python set it as an attribute of its package, which would replace the function of the same name. Those
    modules stay importable by name (``from ckptaudit.audit import AuditOptions``; ``sys.modules``).
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("audit", "compare") and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
