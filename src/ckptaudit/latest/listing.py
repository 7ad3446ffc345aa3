"""Listing a root for :mod:`ckptaudit.latest.candidates`: a local folder, or an object-store prefix (``s3://``,
``gs://``) listed through fsspec with bounded requests.

What the local survey reads of files, the remote one reads with one bounded ranged read each (:func:`read_head`):
the root's pointer (``latest``, Megatron's ``latest_checkpointed_iteration.txt``), a guard's quarantine marker (beside
a checkpoint under the root, or beside the root when it is itself one checkpoint: one ``info``), and
the step inside a single file whose name has none (:func:`step_readable`: the staging reads a ``torch.save``
archive's metadata and a safetensors header, never the tensor data; a file in another container is read only when
it is at most :data:`STEP_PROBE_BYTES`).

A remote listing is bounded three ways, each said in the report's skipped entries when reached: at most
:data:`MAX_REMOTE_LISTINGS` folder listings (one ``ls`` each: one request per 1,000 keys), at most
:data:`MAX_REMOTE_KEYS` keys in all, and a deadline of :data:`REMOTE_DEADLINE_S` seconds for the whole listing
(each request is bounded by ``$CKPTAUDIT_REMOTE_TIMEOUT`` as every remote read is).
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from typing import Any

from ckptaudit.latest.candidates import Entry, Skipped, Survey, survey
from ckptaudit.ondisk import quarantine

__all__ = ["MAX_REMOTE_KEYS", "MAX_REMOTE_LISTINGS", "REMOTE_DEADLINE_S", "STEP_PROBE_BYTES", "RemoteLister",
           "local_survey", "read_head", "remote_survey", "step_readable"]

MAX_REMOTE_LISTINGS = 200
MAX_REMOTE_KEYS = 20_000
REMOTE_DEADLINE_S = 120.0
STEP_PROBE_BYTES = 16 << 20
"""A remote single file that is neither a zip archive (``torch.save``'s format) nor safetensors is staged whole to
read its step; one larger than this is not (its step stays unknown: it sorts by time)."""


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0


def local_survey(root: str) -> Survey:
    """The survey of the local path ``root`` (absolute)."""
    real_root = os.path.realpath(root)

    def lister(rel: str) -> list[Entry]:
        folder = os.path.join(root, rel) if rel else root
        out = []
        with os.scandir(folder) as it:
            for e in it:
                outside = False
                if e.is_symlink():
                    target = os.path.realpath(e.path)
                    outside = os.path.commonpath([real_root, target]) != real_root
                try:
                    kind = "dir" if e.is_dir() else "file" if e.is_file() else "other"
                except OSError:
                    kind = "other"
                out.append(Entry(e.name, kind, _mtime(e.path), outside))
        return out

    def join(base: str, rel: str) -> str:
        return os.path.join(base, rel)

    return survey(root, lister, root_name=os.path.basename(root), join=join, is_file=os.path.isfile(root),
                  root_mtime=_mtime(root), root_marked=lambda: os.path.isfile(quarantine.marker_name(root)))


class RemoteLister:
    """``ls`` of the prefixes under one URL, bounded (see the module docstring); raises ``OSError`` naming the
    bound once one is reached, which the survey reports as the folder not listed."""

    def __init__(self, fs: Any, path: str, *, max_listings: int = MAX_REMOTE_LISTINGS,
                 max_keys: int = MAX_REMOTE_KEYS, deadline_s: float = REMOTE_DEADLINE_S) -> None:
        self.fs, self.path = fs, path.rstrip("/")
        self.max_listings, self.max_keys = max_listings, max_keys
        self.deadline = time.monotonic() + deadline_s
        self.deadline_s = deadline_s
        self.listings = 0
        self.keys = 0
        self.cut: list[str] = []
        """Folders whose listing was cut at the key bound."""

    def __call__(self, rel: str) -> list[Entry]:
        if self.listings >= self.max_listings:
            raise OSError(f"the listing bound of {self.max_listings} requests was reached")
        if self.keys >= self.max_keys:
            raise OSError(f"the listing bound of {self.max_keys} keys was reached")
        if time.monotonic() > self.deadline:
            raise OSError(f"the listing deadline of {self.deadline_s:g} s passed")
        self.listings += 1
        folder = f"{self.path}/{rel}" if rel else self.path
        try:
            entries = self.fs.ls(folder, detail=True)
        except OSError:
            raise
        except Exception as exc:  # noqa: BLE001 - the storage library's own words, one line
            raise OSError(f"{type(exc).__name__}: {exc}") from None
        allowed = self.max_keys - self.keys
        self.keys += len(entries)
        if len(entries) > allowed:
            self.cut.append(rel or ".")
        out = []
        for e in entries[:allowed]:
            name = os.path.basename(str(e.get("name", "")).rstrip("/"))
            if not name or name in (".", "..") or "\\" in name or "\0" in name:
                continue
            kind = {"directory": "dir", "file": "file"}.get(str(e.get("type")), "other")
            out.append(Entry(name, kind, _when(e)))
        return out


def _when(entry: dict[str, Any]) -> float:
    for key in ("LastModified", "mtime", "updated", "last_modified"):
        value = entry.get(key)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return 0.0


class _RemoteJoin:
    remote = True

    def __call__(self, base: str, rel: str) -> str:
        return f"{base.rstrip('/')}/{rel}"


def remote_survey(url: str, *, max_listings: int = MAX_REMOTE_LISTINGS, max_keys: int = MAX_REMOTE_KEYS,
                  deadline_s: float = REMOTE_DEADLINE_S) -> Survey:
    """The survey of the object-store prefix ``url``. Raises ``FileNotFoundError`` when nothing is there and
    :class:`~ckptaudit.formats.remote.errors.RemoteError` when the store cannot be reached."""
    from ckptaudit.formats.remote.errors import RemoteError
    from ckptaudit.formats.remote.objects import filesystem, info_of

    fs, path = filesystem(url)
    info = info_of(fs, path, url)
    lister = RemoteLister(fs, path, max_listings=max_listings, max_keys=max_keys, deadline_s=deadline_s)
    url = url.rstrip("/")
    name = os.path.basename(path.rstrip("/")) or url

    def marked() -> bool:
        """Whether the guard's marker lies beside the root (one ``info``; a store that cannot answer is an error,
        never taken for no marker)."""
        marker = quarantine.marker_name(path)
        fs.invalidate_cache(marker)  # a listing cached before the guard wrote it must not answer
        try:
            return info_of(fs, marker, quarantine.marker_name(url)).get("type") == "file"
        except FileNotFoundError:
            return False

    if info.get("type") != "directory":
        return survey(url, lister, root_name=name, join=_RemoteJoin(), is_file=True, root_mtime=_when(info),
                      root_marked=marked)
    try:
        lister("")  # the root itself must list: an error here is the store's, said in one line (exit 2)
    except OSError as exc:
        raise RemoteError(f"{url}: cannot list it ({exc})") from None
    lister.listings, lister.keys = 0, 0
    out = survey(url, lister, root_name=name, join=_RemoteJoin(), root_mtime=_when(info), root_marked=marked)
    out.skipped += [Skipped(f"{folder}/...", f"listing cut at the bound of {max_keys} keys") for folder in lister.cut]
    return out


def read_head(url: str, limit: int) -> bytes | None:
    """The first ``limit`` bytes of the object at ``url`` (all of it when smaller), by one bounded ranged read
    (:class:`~ckptaudit.formats.remote.objects.RemoteObject`: a deadline, exactly the range asked); ``None`` when
    there is no such object or it cannot be read (a pointer or a marker that cannot be read is one not there)."""
    from ckptaudit.formats.remote.objects import RemoteObject, filesystem, info_of

    try:
        fs, path = filesystem(url)
        info = info_of(fs, path, url)
        size = info.get("size")
        if info.get("type") == "directory" or not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return None
        return RemoteObject(fs, path, size).read(0, min(size, limit))
    except OSError:
        return None


def step_readable(url: str) -> bool:
    """Whether the step inside the remote single file ``url`` is read (see the module docstring): safetensors
    (its header), a zip archive (its metadata; the first 4 bytes tell), or at most :data:`STEP_PROBE_BYTES`."""
    if url.lower().endswith(".safetensors"):
        return True
    from ckptaudit.formats.remote.objects import filesystem, info_of

    try:
        fs, path = filesystem(url)
        size = info_of(fs, path, url).get("size")
    except OSError:
        return False
    if isinstance(size, int) and not isinstance(size, bool) and 0 <= size <= STEP_PROBE_BYTES:
        return True
    return read_head(url, 4) == b"PK\x03\x04"
