"""Retention: delete old checkpoints only after a new one is committed, never the newest resumable one.

Accelerate's ``total_limit`` deletes the oldest checkpoint *before* writing the new one, so a save that fails
leaves one good checkpoint fewer. Here retention runs as step 9 of
:func:`ckptaudit.store.writer.save_checkpoint`, after the commit and the pointer update, and it only ever
deletes committed ``step-N`` directories of our own layout (with a manifest) that are older than the
``keep_last`` newest *resumable* ones. Newer directories that fail the check are kept (they are evidence, and
do not count towards ``keep_last``); directories other tools wrote are never touched.

A deletion renames ``step-N`` to ``step-N.deleting-<tag>`` first, so a crash half-way through ``rmtree``
never leaves a half-deleted directory under a committed name.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable

from ckptaudit.ondisk import layout
from ckptaudit.ondisk import manifest as mf
from ckptaudit.store import durable

__all__ = ["apply_retention", "plan_retention"]


def _resumable_quick(path: str) -> bool:
    """Manifest readable and every file present with its recorded size (no hashing: retention must be cheap)."""
    try:
        manifest = mf.read_manifest(os.path.join(path, layout.MANIFEST))
    except mf.ManifestError:
        return False
    return not mf.verify_files(path, manifest, hashes=False)


def plan_retention(root: str, keep_last: int, *, protect: Iterable[str] = ()) -> list[str]:
    """Names of the directories under ``root`` that retention would delete, oldest first. Pure: deletes nothing.

    Walks the committed ``step-N`` directories with a manifest from newest to oldest, keeping each until
    ``keep_last`` resumable ones have been kept; everything older is deleted, except the names in ``protect``
    and the one the ``latest`` pointer names.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    keep = set(protect)
    pointer = layout.read_pointer(root)
    if pointer:
        keep.add(pointer)
    ours: list[tuple[int, str]] = []
    for name in os.listdir(root):
        parsed = layout.parse_step_name(name)
        if parsed and parsed[1] == "committed" and os.path.isfile(os.path.join(root, name, layout.MANIFEST)):
            ours.append((parsed[0], name))
    ours.sort(reverse=True)
    kept_resumable = 0
    doomed: list[str] = []
    for _, name in ours:
        if kept_resumable < keep_last:
            if _resumable_quick(os.path.join(root, name)):
                kept_resumable += 1
            continue
        if name not in keep:
            doomed.append(name)
    return doomed[::-1]


def apply_retention(root: str, keep_last: int, *, protect: Iterable[str] = ()) -> list[str]:
    """(coordinator, after a commit) Delete what :func:`plan_retention` names; return the names deleted."""
    deleted = []
    for name in plan_retention(root, keep_last, protect=protect):
        parsed = layout.parse_step_name(name)
        assert parsed is not None
        aside = os.path.join(root, f"{name}.deleting-{durable.nonce()}")
        os.rename(os.path.join(root, name), aside)
        durable.fsync_dir(root)
        shutil.rmtree(aside, ignore_errors=True)
        deleted.append(name)
    return deleted
