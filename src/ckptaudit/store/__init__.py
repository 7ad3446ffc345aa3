"""The writer library: resumable checkpoints that are complete or visibly not, and survive a dying rank.

:func:`save_checkpoint` (:mod:`~ckptaudit.store.writer`, through the two-phase commit of
:mod:`~ckptaudit.store.commit`), :func:`load_checkpoint` (:mod:`~ckptaudit.store.loader`), retention
(:mod:`~ckptaudit.store.retention`), with their DCP extensions (:mod:`~ckptaudit.store.dcpio`), collectives
(:mod:`~ckptaudit.store.collective`), durable writes (:mod:`~ckptaudit.store.durable`) and fault points
(:mod:`~ckptaudit.store.faults`). The manifest format and the names of the on-disk layout live below the writer, the
offline checks and ``ckptaudit latest`` (which the loader asks for the newest resumable checkpoint under a root):
:mod:`ckptaudit.ondisk`. The public names here are imported lazily, so that ``import ckptaudit.store`` does not
import ``torch.distributed``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CheckpointLoadError",
    "CheckpointSaveError",
    "LoadedCheckpoint",
    "SavedCheckpoint",
    "apply_retention",
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
