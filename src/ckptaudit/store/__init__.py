"""Writers. Resumable checkpoints that survive a dying rank (:mod:`ckptaudit.store.writer` saves through the two-phase
commit of :mod:`ckptaudit.store.commit`, :mod:`ckptaudit.store.loader` restores), ``ckptaudit latest``
(:mod:`ckptaudit.store.latest`) and retention (:mod:`ckptaudit.store.retention`); the serving export behind a quality gate
(:mod:`ckptaudit.store.serving`, :mod:`ckptaudit.store.gate`).

The manifest format and the names of the on-disk layout live below both the writer and the offline checks, in
:mod:`ckptaudit.formats.manifest` and :mod:`ckptaudit.formats.storelayout`. The public names here are imported
lazily, so that ``import ckptaudit.store`` does not import ``torch.distributed``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CheckpointLoadError",
    "CheckpointSaveError",
    "LoadedCheckpoint",
    "SavedCheckpoint",
    "apply_retention",
    "find_latest",
    "load_checkpoint",
    "plan_retention",
    "save_checkpoint",
]

_WHERE = {
    "CheckpointLoadError": "checkpoint",
    "CheckpointSaveError": "checkpoint",
    "LoadedCheckpoint": "checkpoint",
    "SavedCheckpoint": "checkpoint",
    "load_checkpoint": "loader",
    "save_checkpoint": "writer",
    "find_latest": "latest",
    "apply_retention": "retention",
    "plan_retention": "retention",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptaudit.store' has no attribute {name!r}")
    import importlib

    if module in ("checkpoint", "loader", "writer"):
        from ckptaudit.extras import require_torch

        require_torch(f"ckptaudit.store.{name}")
    return getattr(importlib.import_module(f"ckptaudit.store.{module}"), name)
