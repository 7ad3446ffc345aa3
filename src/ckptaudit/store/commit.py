"""The two-phase commit of :func:`~ckptaudit.store.writer.save_checkpoint`: the coordinator prepares a
temporary directory, every rank reports its files (vote 1), the coordinator writes ``manifest.json``, every rank
votes to commit (vote 2), then the coordinator renames the temporary directory into place (the commit point),
updates the ``latest`` pointer and applies retention. Each function's docstring says which ranks run it."""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

import torch

from ckptaudit.findings import HASH_ALGORITHM
from ckptaudit.ondisk import layout
from ckptaudit.ondisk import manifest as mf
from ckptaudit.store import durable
from ckptaudit.store.checkpoint import COMPONENT_OF_KEY, dtype_name
from ckptaudit.store.dcpio import item_offsets
from ckptaudit.store.faults import FaultHook
from ckptaudit.version import __version__

__all__ = ["build_manifest", "commit_and_tidy", "file_report", "prepare", "previous_committed", "write_manifest"]


def previous_committed(root: str, exclude: str = "") -> str | None:
    """The newest committed step directory name under ``root`` (for messages)."""
    best: tuple[int, str] | None = None
    for name in _listdir(root):
        parsed = layout.parse_step_name(name)
        if parsed and parsed[1] == "committed" and name != exclude and (best is None or parsed[0] > best[0]):
            best = (parsed[0], name)
    return best[1] if best else None


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def prepare(root: str, step: int, overwrite: bool) -> tuple[str, str]:
    """(coordinator) Create ROOT, refuse to clobber, remove temporaries of dead saves, make the temporary dir."""
    final = layout.step_name(step)
    try:
        os.makedirs(root, exist_ok=True)
        if os.path.exists(os.path.join(root, final)) and not overwrite:
            return ("error", f"{os.path.join(root, final)} already exists (a committed checkpoint); save under "
                             "another step, or pass overwrite=True to replace it once the new one is committed")
        for name in _listdir(root):
            parsed = layout.parse_step_name(name)
            if parsed is None or parsed[1] == "committed":
                continue
            committed_twin = os.path.isdir(os.path.join(root, layout.step_name(parsed[0])))
            # A 'replaced' directory is the only copy of its step until the replacement is in place.
            if parsed[1] in ("partial", "deleting") or committed_twin:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        tmp_name = layout.partial_name(step, durable.nonce())
        os.makedirs(os.path.join(root, tmp_name))
        durable.fsync_dir(root)
    except OSError as exc:
        return ("error", f"cannot prepare {root} for step {step}: {exc.strerror or exc} ({exc.filename or root})")
    return ("ok", tmp_name)


def file_report(tmp: str, writer: Any, planner: Any, rank: int) -> dict[str, Any]:
    """(all ranks) Size and xxh3-128 of this rank's files and of every item in them, read back from disk."""
    by_file: dict[str, list[Any]] = {}
    for wr in writer.results:
        by_file.setdefault(wr.storage_data.relative_path, []).append(wr)
    plan_items = {(wi.index.fqn, item_offsets(wi.index.offset)): wi for wi in planner.plan.items}
    files: dict[str, Any] = {}
    tensors: list[tuple[str, str, list[int], dict[str, Any]]] = []
    objects: list[tuple[str, dict[str, Any]]] = []
    for name, results in sorted(by_file.items()):
        ranges = [(int(wr.storage_data.offset), int(wr.storage_data.length)) for wr in results]
        size, digest, parts = mf.hash_file(os.path.join(tmp, name), ranges)
        files[name] = {"size": size, "xxh3_128": digest}
        for wr, part in zip(results, parts, strict=True):
            key = (wr.index.fqn, item_offsets(wr.index.offset))
            entry: dict[str, Any] = {"file": name, "offset": int(wr.storage_data.offset),
                                     "length": int(wr.storage_data.length), "xxh3_128": part}
            item = plan_items.get(key)
            td = getattr(item, "tensor_data", None)
            if td is not None:
                entry = {"offsets": list(td.chunk.offsets), "sizes": list(td.chunk.sizes), **entry,
                         "content_xxh3_128": planner.content.get(key)}
                tensors.append((wr.index.fqn, dtype_name(td.properties.dtype), list(td.size), entry))
            else:
                objects.append((wr.index.fqn, entry))
    return {"rank": rank, "ok": True, "files": files, "tensors": tensors, "objects": objects}


def _component_of(fqn: str) -> str:
    return COMPONENT_OF_KEY.get(fqn.split(".", 1)[0], "other")


def build_manifest(tmp: str, step: int, world: int, reports: list[dict[str, Any]], inventory: dict[str, Any],
                    contract: dict[str, Any]) -> dict[str, Any]:
    """(coordinator) Merge the ranks' reports into the manifest."""
    files: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    for rep in reports:
        files.update(rep["files"])
        for fqn, dtype, shape, entry in rep["tensors"]:
            t = tensors.setdefault(fqn, {"component": _component_of(fqn), "dtype": dtype, "shape": shape,
                                         "shards": []})
            t["shards"].append(entry)
        for fqn, entry in rep["objects"]:
            objects[fqn] = {"component": _component_of(fqn), **entry}
    for t in tensors.values():
        t["shards"].sort(key=lambda s: s["offsets"])
    size, digest, _ = mf.hash_file(os.path.join(tmp, ".metadata"))
    files[".metadata"] = {"size": size, "xxh3_128": digest}
    return {
        "format": mf.FORMAT,
        "version": mf.VERSION,
        "step": step,
        "world_size": world,
        "torch_version": torch.__version__,
        "ckptaudit_version": __version__,
        "hash_algorithm": HASH_ALGORITHM,
        "created_unix": round(time.time(), 3),
        "contract": contract,
        "components": inventory,
        "files": dict(sorted(files.items())),
        "tensors": dict(sorted(tensors.items())),
        "objects": dict(sorted(objects.items())),
    }


def write_manifest(tmp: str, manifest: dict[str, Any]) -> None:
    path = os.path.join(tmp, layout.MANIFEST)
    with open(path, "wb") as fh:
        fh.write(json.dumps(manifest, separators=(",", ":"), allow_nan=False).encode("utf-8"))
        fh.flush()
        os.fsync(fh.fileno())
    durable.fsync_dir(tmp)


def _commit(root: str, tmp_name: str, final_name: str) -> None:
    """(coordinator) The commit point: one atomic rename. An existing ``step-N`` (``overwrite=True``) is moved
    aside first and removed only after the new one is in place."""
    final = os.path.join(root, final_name)
    aside = None
    if os.path.exists(final):
        aside = os.path.join(root, f"{final_name}.replaced-{durable.nonce()}")
        os.rename(final, aside)
    os.rename(os.path.join(root, tmp_name), final)
    durable.fsync_dir(root)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def commit_and_tidy(root: str, tmp_name: str, final_name: str, keep_last: int | None,
                     hook: FaultHook | None) -> tuple[str, Any]:
    """(coordinator) Steps 7-9 of :func:`save_checkpoint`."""
    from ckptaudit.store.retention import apply_retention

    try:
        _commit(root, tmp_name, final_name)
    except OSError as exc:
        return ("error", f"the commit rename {tmp_name} -> {final_name} failed ({exc.strerror or exc}); nothing "
                         "was committed")
    if hook is not None:
        hook("commit.renamed")
    notes: list[str] = []
    try:
        durable.write_durably(os.path.join(root, layout.POINTER), (final_name + "\n").encode())
    except OSError as exc:
        notes.append(f"committed, but the {layout.POINTER} pointer was not updated ({exc.strerror or exc}); "
                        "`ckptaudit latest` finds the checkpoint without it")
    if hook is not None:
        hook("commit.pointer")
    deleted: list[str] = []
    if keep_last is not None:
        try:
            deleted = apply_retention(root, keep_last, protect=(final_name,))
        except OSError as exc:
            notes.append(f"committed, but retention failed ({exc.strerror or exc}); older checkpoints remain")
    return ("ok", (deleted, notes))
