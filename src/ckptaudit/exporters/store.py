"""The writer as an exporter of the resume test (``--exporter ckptaudit.exporters.store:resumable``).

An exporter is ``export(job, path, ctx)`` with an optional ``load(job, path, ctx)`` (see
:mod:`ckptaudit.exporters`); here ``path`` is the checkpoint root, and ``load`` restores the newest resumable
checkpoint under it.
"""

from __future__ import annotations

from typing import Any

from ckptaudit.recipes import Job
from ckptaudit.store.loader import load_checkpoint
from ckptaudit.store.writer import save_checkpoint

__all__ = ["resumable", "resumable_load"]


def resumable(job: Job, path: str, ctx: Any = None) -> None:
    """(all ranks, collective) :func:`~ckptaudit.store.writer.save_checkpoint` into the root ``path``."""
    save_checkpoint(job, path)


def resumable_load(job: Job, path: str, ctx: Any = None) -> None:
    """(all ranks, collective) :func:`~ckptaudit.store.loader.load_checkpoint` from the root ``path``."""
    load_checkpoint(job, path)


resumable.load = resumable_load  # type: ignore[attr-defined]
