"""Listing a root for :mod:`ckptaudit.latest.candidates`: a local folder, or an object-store prefix (``s3://``,
``gs://``) listed through fsspec with bounded requests.

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

__all__ = ["MAX_REMOTE_KEYS", "MAX_REMOTE_LISTINGS", "REMOTE_DEADLINE_S", "RemoteLister", "local_survey",
           "remote_survey"]

MAX_REMOTE_LISTINGS = 200
MAX_REMOTE_KEYS = 20_000
REMOTE_DEADLINE_S = 120.0


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
                  root_mtime=_mtime(root))


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
    if info.get("type") != "directory":
        return survey(url, lister, root_name=name, join=_RemoteJoin(), is_file=True, root_mtime=_when(info))
    try:
        lister("")  # the root itself must list: an error here is the store's, said in one line (exit 2)
    except OSError as exc:
        raise RemoteError(f"{url}: cannot list it ({exc})") from None
    lister.listings, lister.keys = 0, 0
    out = survey(url, lister, root_name=name, join=_RemoteJoin(), root_mtime=_when(info))
    out.skipped += [Skipped(f"{folder}/...", f"listing cut at the bound of {max_keys} keys") for folder in lister.cut]
    return out
