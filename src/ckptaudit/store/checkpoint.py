"""The writer's vocabulary: the DCP keys of each component, the two errors and the two results of
:func:`~ckptaudit.store.writer.save_checkpoint` and :func:`~ckptaudit.store.loader.load_checkpoint`. Runs on any rank;
no collectives here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "KEYS",
    "CheckpointLoadError",
    "CheckpointSaveError",
    "LoadedCheckpoint",
    "SavedCheckpoint",
    "dtype_name",
    "has_state",
]

KEYS: dict[str, str] = {
    "model": "model",
    "optimizer": "optim",
    "scheduler": "scheduler",
    "step": "train_state",
    "rng": "rng",
    "data-progress": "data",
    "extras": "extras",
}
"""Component -> top-level key of the DCP state dict (the names ``ckptaudit audit`` recognises)."""

COMPONENT_OF_KEY = {v: k for k, v in KEYS.items()}


class CheckpointSaveError(Exception):
    """A save that did not commit (or could not confirm its commit). The message says what failed, on which
    rank, and what is left on disk."""


class CheckpointLoadError(Exception):
    """A checkpoint that cannot be restored as asked; the message names the thing, the value and the fix."""


@dataclass(frozen=True, slots=True)
class SavedCheckpoint:
    path: str
    """The committed directory, ``ROOT/step-NNNNNN``."""
    step: int
    deleted: tuple[str, ...] = ()
    """Older checkpoints removed by retention after the commit."""
    warnings: tuple[str, ...] = ()
    """Problems after the commit point (pointer or retention); the checkpoint itself is committed."""


@dataclass(frozen=True, slots=True)
class LoadedCheckpoint:
    path: str
    step: int
    extras: dict[str, Any]
    casts: tuple[str, ...] = ()
    """Tensors loaded into another dtype than saved (only with ``allow_dtype_change=True``)."""
    skipped: tuple[str, ...] = ()
    """Components not restored (only with ``strict=False`` or ``allow_world_size_change=True``)."""


def has_state(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
