"""Checkpoints behind fsspec URLs (``s3://``, ``gs://``, ``https://``...), read with ranged reads and never
downloaded: :mod:`~ckptaudit.formats.remote.staging` builds a local stand-in the readers parse,
:mod:`~ckptaudit.formats.remote.objects` makes every read of a remote object (bounded, pinned, exactly the range
asked), :mod:`~ckptaudit.formats.remote.dcp` stages a DCP directory's metadata with batched ranged reads, and
:mod:`~ckptaudit.formats.remote.http` bounds every ``http(s)://`` request (deadline, reply capped, ETag pinned).

:func:`is_url` and :func:`local_path` live here, not in ``staging``: every command asks them of its path at
start-up, and a local path must not pay for importing the remote machinery."""

from __future__ import annotations

__all__ = ["is_url", "local_path"]


def is_url(path: str) -> bool:
    """Whether ``path`` names a remote object (``scheme://``, other than ``file://``)."""
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.isidentifier() and scheme.lower() != "file" and len(scheme) > 1


def local_path(path: str) -> str:
    """``file:///x`` -> ``/x``; anything else unchanged."""
    return path[len("file://"):] if path.lower().startswith("file://") else path
