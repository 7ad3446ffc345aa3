"""A checkpoint behind a URL as it was at one moment: each object's version, and a local copy of exactly those bytes.

The in-loop guard's pin for an object store (:mod:`ckptaudit.integrations.guard_remote`). A local checkpoint is
pinned by hard links; an object store has none, so:

- :func:`snapshot` (one ``info`` and one recursive listing, on the training thread at submit) records every object of
  the checkpoint: its key relative to the checkpoint, size, ETag, and version id where the store gives one
  (``info`` of a single object on a versioned bucket; listings give none). What the caller says is no part of
  it (the guard: a folder's own passport) is left out.
- :func:`copy_pinned` (on the guard's worker) copies those objects into a private local folder through
  :class:`~ckptaudit.formats.remote.objects.RemoteObject`, each read pinned to the ETag of the snapshot (S3 sends it
  as ``If-Match``; the store answers 412 once the object was replaced) or its generation (GCS: 404 once that
  generation is gone), bounded and exactly the range asked: the copy is the bytes that were saved, or
  :class:`~ckptaudit.formats.remote.errors.ObjectChanged`.
- :func:`changes` (after the audit) lists the checkpoint again: what differs from the snapshot (an object added,
  removed, of another size, ETag or version), or ``None``.

Every read is pinned where the store pins reads (S3, GCS); no object is written or deleted here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptaudit.formats.remote.errors import ObjectChanged, RemoteError
from ckptaudit.formats.remote.objects import FILL_PIECE, READ_AHEAD, Pins, ReadGuard, RemoteObject, filesystem, info_of

__all__ = ["MAX_OBJECTS", "ObjectVersion", "Snapshot", "changes", "copy_pinned", "snapshot"]

MAX_OBJECTS = 100_000
"""Objects in one checkpoint at most (the staging's bound): a listing past it is refused, never cut silently."""


@dataclass(frozen=True, slots=True)
class ObjectVersion:
    """One object of the checkpoint as it was when listed."""

    rel: str
    """Its key relative to the checkpoint (``""`` for a single-object checkpoint)."""
    size: int
    etag: str | None
    version: str | None = None
    """The store's version id, where it gives one (a versioned bucket's ``info``)."""

    def as_json(self) -> dict[str, Any]:
        return {"name": self.rel, "size": self.size, "etag": self.etag, "version": self.version}


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The objects of the checkpoint at ``url`` when it was pinned."""

    url: str
    path: str
    """The path in the store's filesystem (``bucket/run/step-8``)."""
    is_dir: bool
    objects: tuple[ObjectVersion, ...]

    def key(self, rel: str) -> str:
        return f"{self.path}/{rel}" if rel else self.path


def _etag(entry: dict[str, Any]) -> str | None:
    etag = entry.get("ETag") or entry.get("etag")
    return etag if isinstance(etag, str) and etag else None


def _version(entry: dict[str, Any]) -> str | None:
    version = entry.get("VersionId") or entry.get("version_id") or entry.get("generation")
    return str(version) if version not in (None, "", "null") else None


def _size(entry: dict[str, Any], url: str) -> int:
    size = entry.get("size", entry.get("Size"))
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size < 1 << 50:
        raise RemoteError(f"{url}: the store lists {str(entry.get('name', 'an object'))[:200]} without a valid size")
    return size


def snapshot(url: str, skip: Callable[[str], bool] | None = None) -> Snapshot:
    """(training thread, at submit) The objects of the checkpoint at ``url`` now (see the module docstring);
    ``skip(name)``: an object directly inside a folder checkpoint that is no part of it (its passport).

    Raises ``FileNotFoundError`` when nothing is there and :class:`RemoteError` when the store cannot be reached or
    lists more than :data:`MAX_OBJECTS` objects under the prefix."""
    fs, path = filesystem(url)
    path = path.rstrip("/")
    fs.invalidate_cache(path)  # a listing cached before the save must not stand for what was saved
    try:
        info = info_of(fs, path, url)
    finally:
        fs.invalidate_cache()
    if info.get("type") != "directory":
        return Snapshot(url, path, False, (ObjectVersion("", _size(info, url), _etag(info), _version(info)),))
    try:
        found: dict[str, dict[str, Any]] = fs.find(path, detail=True, maxdepth=None)
    except Exception as exc:  # noqa: BLE001 - the storage library's own words, one line
        raise RemoteError(f"{url}: cannot list it ({type(exc).__name__}: {exc})") from None
    finally:
        # Nothing of this listing stays cached: fsspec keeps one filesystem per thread, and a later reading of the
        # checkpoint on this thread (ckptaudit verify, latest) must see the objects the guard writes beside it.
        fs.invalidate_cache()
    if len(found) > MAX_OBJECTS:
        raise RemoteError(f"{url}: more than {MAX_OBJECTS} objects under the prefix")
    objects = []
    for name, entry in sorted(found.items()):
        if entry.get("type") not in (None, "file"):
            continue
        rel = name[len(path) + 1:] if name.startswith(path + "/") else os.path.basename(name)
        if not rel or (skip is not None and "/" not in rel and skip(rel)):
            continue
        objects.append(ObjectVersion(rel, _size(entry, url), _etag(entry), _version(entry)))
    return Snapshot(url, path, True, tuple(objects))


def changes(was: Snapshot, skip: Callable[[str], bool] | None = None) -> str | None:
    """What differs between ``was`` and the checkpoint at its URL now, in words; ``None`` when every object is the one
    listed then (same names, sizes, ETags and, where recorded, versions). A version id recorded then and not given
    by a listing now is not a difference (listings give none)."""
    try:
        now = snapshot(was.url, skip)
    except FileNotFoundError:
        return "deleted since it was saved"
    except RemoteError as exc:
        return f"cannot be listed again ({exc})"
    if now.is_dir != was.is_dir:
        return "replaced by a " + ("folder" if now.is_dir else "single object")
    old = {o.rel: o for o in was.objects}
    new = {o.rel: o for o in now.objects}
    gone, added = sorted(old.keys() - new.keys()), sorted(new.keys() - old.keys())
    if gone or added:
        listed = [*(f"-{g}" for g in gone[:3]), *(f"+{a}" for a in added[:3])]
        return f"objects changed: {', '.join(listed)}"
    for rel, o in old.items():
        n = new[rel]
        label = rel or os.path.basename(was.path)
        if o.size != n.size:
            return f"{label}: {o.size} bytes then, {n.size} now"
        if o.etag != n.etag:
            return f"{label}: ETag {o.etag} then, {n.etag} now"
        if o.version is not None and n.version is not None and o.version != n.version:
            return f"{label}: version {o.version} then, {n.version} now"
    return None


def copy_pinned(was: Snapshot, folder: str) -> str:
    """(worker) Copy every object of ``was`` into the new ``folder/<name>`` (a file, or a folder of the same layout),
    each read pinned to its ETag (see the module docstring), :data:`READ_AHEAD` ranged reads of 8 MiB at a time.
    Returns the local path. Raises :class:`ObjectChanged` when an object is no longer the one listed (replaced,
    deleted) and :class:`~ckptaudit.formats.remote.errors.RemoteReadError` (an ``OSError``) when a read fails."""
    fs, _ = filesystem(was.url)
    pins = Pins(fs)
    guard = ReadGuard()
    name = os.path.basename(was.path) or "checkpoint"
    target = os.path.join(folder, name)
    try:
        if was.is_dir:
            os.mkdir(target)
        for o in was.objects:
            parts = o.rel.split("/") if o.rel else []
            if any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
                raise RemoteError(f"{was.url}: the object {o.rel!r} is not a plain relative name; not copied")
            local = os.path.join(target, *parts) if parts else target
            if parts:
                os.makedirs(os.path.dirname(local), exist_ok=True)
            key = was.key(o.rel)
            # What the store's reads are pinned by: S3 the ETag, GCS the generation (recorded as the version).
            entry = {k: v for k, v in (("ETag", o.etag), ("generation", o.version)) if v}
            # Where the store's reads cannot be pinned (no ETag, another protocol) the copy is unpinned, and the
            # guard's listing after the audit (changes) is what vouches for it.
            remote = RemoteObject(fs, key, o.size, guard, pins.add(key, entry))
            try:
                with open(local, "wb") as fh:
                    for start in range(0, o.size, FILL_PIECE * READ_AHEAD):
                        spans = [(s, min(o.size, s + FILL_PIECE))
                                 for s in range(start, min(o.size, start + FILL_PIECE * READ_AHEAD), FILL_PIECE)]
                        for data in remote.read_many(spans):
                            fh.write(data)
            except FileNotFoundError:
                raise ObjectChanged(f"{was.url}: {o.rel or name} was deleted since it was saved") from None
        return target
    finally:
        pins.release()
