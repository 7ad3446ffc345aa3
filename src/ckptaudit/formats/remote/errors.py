"""What goes wrong reading a checkpoint behind a URL, and how long one request may wait: the errors the stager
(:mod:`ckptaudit.formats.remote.staging`) and the bounded ``http(s)://`` filesystem (:mod:`ckptaudit.formats.remote.http`)
both raise, kept apart so that neither imports the other for them."""

from __future__ import annotations

import math
import os

__all__ = ["DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "ObjectChanged", "ProtocolError", "RemoteError", "RemoteReadError",
           "RequestTimeout", "request_timeout"]


class RemoteError(OSError):
    """A URL that cannot be read: unknown protocol, missing library, unsupported layout, too much metadata,
    a configuration or credentials the storage library refuses."""


class RemoteReadError(OSError):
    """A ranged read that did not return the bytes asked (the message says why)."""


class ProtocolError(RemoteReadError):
    """The reply is not the range asked: ranges ignored, another range, more or fewer bytes than asked."""


class RequestTimeout(RemoteReadError):
    """A request that outlived its deadline."""


class ObjectChanged(RemoteReadError):
    """The object is no longer the one staged (another ETag, or the server refused the pinned one)."""


TIMEOUT_ENV = "CKPTAUDIT_REMOTE_TIMEOUT"
DEFAULT_TIMEOUT_S = 30.0


def request_timeout() -> float:
    """Seconds one request may wait to connect or for its next bytes: ``$CKPTAUDIT_REMOTE_TIMEOUT`` (default
    30). A value that is not a number of seconds in (0, 3600] is a :class:`RemoteError` (a configuration
    error: one line, exit 2)."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value <= 3600:
        raise RemoteError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds between 0 and 3600")
    return value
