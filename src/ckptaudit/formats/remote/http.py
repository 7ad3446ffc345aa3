"""``http://`` and ``https://`` URLs: fsspec's HTTP filesystem with every request bounded, for
:mod:`ckptaudit.formats.remote.staging`.

fsspec's ``HTTPFileSystem`` reads a ranged reply whole (``await r.read()``) under aiohttp's default five-minute
timeout, trusting the server to honour ``Range`` and ``Content-Length``. A server need not: one that ignores
ranges sends the whole object (150 MB) for every 4 KiB read, one that promises more bytes than it sends or
trickles them holds each request for five minutes. :class:`BoundedHTTPFileSystem` keeps fsspec's session,
configuration and batching, and changes what one ranged read may cost:

- a deadline per request: connecting and each wait for bytes at most
  :func:`~ckptaudit.formats.remote.errors.request_timeout` seconds, the whole
  request that plus the time to receive its bytes at :data:`MIN_RATE`; ``info`` (a ``HEAD``) the same;
- the reply capped to the range asked: at most ``end - start`` bytes are read, then the connection is dropped
  (the rest is never received); a reply that is not the range asked (``200`` from an offset, another
  ``Content-Range``, fewer bytes than promised) is a :class:`~ckptaudit.formats.remote.errors.ProtocolError`;
- the object pinned as it was at staging: its ``ETag`` (else ``Last-Modified``) is sent as ``If-Match`` (
  ``If-Unmodified-Since``) and checked in every reply, so bytes of a replacement are never read as the
  staged object's (:class:`~ckptaudit.formats.remote.errors.ObjectChanged`).

Threads: the fsspec event loop runs the requests; callers block in ``cat_file``/``cat_ranges`` as usual.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from fsspec.asyn import sync_wrapper
from fsspec.implementations.http import HTTPFileSystem

from ckptaudit.formats.remote.errors import (
    TIMEOUT_ENV,
    ObjectChanged,
    ProtocolError,
    RemoteReadError,
    RequestTimeout,
    request_timeout,
)

__all__ = ["MIN_RATE", "BoundedHTTPFileSystem", "deadline_for"]

MIN_RATE = 64 << 10
"""Bytes per second a reply must at least arrive at (on top of :func:`request_timeout`), else it is cut off."""
_CHUNK = 64 << 10
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


def deadline_for(nbytes: int) -> float:
    """Seconds a request for ``nbytes`` may take in all."""
    return request_timeout() + nbytes / MIN_RATE


class BoundedHTTPFileSystem(HTTPFileSystem):  # type: ignore[misc]
    """fsspec's HTTP filesystem with bounded requests (see the module docstring). ``pins`` maps a URL to the
    ``(ETag, Last-Modified)`` its reads must still see; :meth:`pin` records them from ``info``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pins: dict[str, tuple[str | None, str | None]] = {}

    def pin(self, url: str, info: dict[str, Any]) -> None:
        etag, modified = info.get("ETag"), info.get("Last-Modified")
        if isinstance(etag, str) or isinstance(modified, str):
            self.pins[url] = (etag if isinstance(etag, str) else None,
                              modified if isinstance(modified, str) else None)

    def _timeout(self, nbytes: int) -> Any:
        import aiohttp

        t = request_timeout()
        return aiohttp.ClientTimeout(total=deadline_for(nbytes), sock_connect=t, sock_read=t)

    async def _info(self, url: str, **kwargs: Any) -> Any:
        try:
            return await asyncio.wait_for(super()._info(url, **kwargs), timeout=2 * request_timeout())
        except TimeoutError:
            raise RequestTimeout(f"{url}: no answer to HEAD/GET within {2 * request_timeout():g} s") from None

    async def _ls(self, url: str, detail: bool = True, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{url}: directories are not listed over HTTP")

    # fsspec binds the blocking ``ls`` to its own ``_ls`` (which GETs the folder's URL and reads links out of the
    # reply): bound again, so that a folder is never read as a listing (another rank's view check then asks each
    # object's own HEAD).
    ls = sync_wrapper(_ls)

    async def _cat_file(self, url: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        import aiohttp

        if start is None or end is None or start < 0 or end < start:
            raise ValueError("ckptaudit reads HTTP objects with ranged reads only (start and end required)")
        if end == start:
            return b""
        want = end - start
        kw = {**self.kwargs, **kwargs}
        headers = dict(kw.pop("headers", None) or {})
        headers.update({"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"})
        etag, modified = self.pins.get(url, (None, None))
        if etag is not None:
            headers["If-Match"] = etag
        elif modified is not None:
            headers["If-Unmodified-Since"] = modified
        session = await self.set_session()
        try:
            async with session.get(self.encode_url(url), headers=headers, timeout=self._timeout(want),
                                   **kw) as r:
                if r.status == 412:
                    raise ObjectChanged(f"{url} changed since it was staged (the server refused "
                                        f"{'If-Match ' + etag if etag else 'If-Unmodified-Since ' + str(modified)})")
                if r.status == 416:
                    raise ProtocolError(f"{url}: the server has no bytes {start}-{end - 1} (416): shorter than it "
                                        "said")
                if r.status >= 400:
                    raise RemoteReadError(f"{url}: HTTP {r.status} {r.reason} for bytes {start}-{end - 1}")
                self._check_identity(url, r.headers, etag, modified)
                self._check_range(url, r.status, r.headers, start, end)
                out = bytearray()
                while len(out) < want:  # never more than asked: the rest stays on the wire, dropped
                    chunk = await r.content.read(min(_CHUNK, want - len(out)))
                    if not chunk:
                        raise ProtocolError(f"{url}: the reply ended after {len(out)} of the {want} bytes it "
                                            f"promised for {start}-{end - 1} (a Content-Length that lies, or a "
                                            "connection cut)")
                    out += chunk
                return bytes(out)
        except (TimeoutError, aiohttp.ServerTimeoutError):
            raise RequestTimeout(f"{url}: bytes {start}-{end - 1} did not arrive within {deadline_for(want):g} s "
                                 f"(at most {request_timeout():g} s between bytes, at least {MIN_RATE >> 10} KiB/s; "
                                 f"${TIMEOUT_ENV} sets the first)") from None
        except aiohttp.ClientError as exc:
            raise RemoteReadError(f"{url}: bytes {start}-{end - 1}: {type(exc).__name__}: {exc}") from None

    @staticmethod
    def _check_identity(url: str, headers: Any, etag: str | None, modified: str | None) -> None:
        got_etag, got_modified = headers.get("ETag"), headers.get("Last-Modified")
        if etag is not None and got_etag is not None and got_etag != etag:
            raise ObjectChanged(f"{url} changed since it was staged (ETag {etag} then, {got_etag} now)")
        if etag is None and modified is not None and got_modified is not None and got_modified != modified:
            raise ObjectChanged(f"{url} changed since it was staged (Last-Modified {modified} then, "
                                f"{got_modified} now)")

    @staticmethod
    def _check_range(url: str, status: int, headers: Any, start: int, end: int) -> None:
        if status == 206:
            m = _CONTENT_RANGE.match(headers.get("Content-Range", "").strip())
            if m is None or int(m.group(1)) != start or int(m.group(2)) != end - 1:
                raise ProtocolError(f"{url}: asked for bytes {start}-{end - 1}, the server sent "
                                    f"{headers.get('Content-Range', 'no Content-Range')!r}")
            return
        if status == 200 and start == 0:
            return  # the whole object from its start: its first end bytes are the range (the rest is dropped)
        raise ProtocolError(f"{url}: asked for bytes {start}-{end - 1}, the server answered HTTP {status} "
                            "without that range (it ignores Range requests; ckptaudit reads URLs with ranged reads "
                            "only: copy the checkpoint locally)")
