"""Remote objects of a checkpoint behind a URL, and the only way they are read: bounded, pinned ranged reads.

Every read goes through :class:`RemoteObject` (one object of the staged checkpoint): its reply must be exactly the
range asked (never more bytes are kept, fewer is an error), the object must still be the one staged (its ETag,
read at staging, is sent as ``If-Match`` with every S3 ``GetObject`` and every HTTP request and checked in the
replies; on GCS every read asks for the object's generation listed at staging, which the store serves or answers
404 once it is no longer stored: a replacement of the same length is reported, never read as the staged object),
and the first read
that times out or breaks the protocol fails every later read of the checkpoint at once (a misbehaving server
costs one deadline, not one per request). ``http(s)://`` requests are bounded one by one
(:mod:`ckptaudit.formats.remote.http`: a deadline per request, the reply capped to the range asked); S3 requests
by the client's connect and read timeouts, GCS requests by gcsfs's ``requests_timeout`` (the same two bounds,
unless fsspec's configuration sets it). ``$CKPTAUDIT_REMOTE_TIMEOUT`` (seconds, default 30) sets them.

Credentials and endpoints come from fsspec's and the storage library's usual configuration (for S3:
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, profiles; ``FSSPEC_S3_*`` for s3fs's own
options, ``endpoint_url`` among them since the aiobotocore-based s3fs the ``[remote]`` extra asks for). A configuration the storage library rejects, or credentials it cannot find or
use, is a :class:`RemoteError` naming the URL: one line, exit code 2.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ckptaudit.extras import install_line
from ckptaudit.formats.remote.errors import (
    ObjectChanged,
    ProtocolError,
    RemoteError,
    RemoteReadError,
    RequestTimeout,
    request_timeout,
)

__all__ = [
    "COALESCE_BYTES",
    "COALESCE_GAP",
    "FILL_PIECE",
    "READ_AHEAD",
    "Pin",
    "Pins",
    "ReadGuard",
    "RemoteFiles",
    "RemoteObject",
    "filesystem",
    "fill",
    "info_of",
]

READ_AHEAD = 2
"""Ranged reads issued together per large tensor streamed (:meth:`RemoteFiles.read_ahead`): memory holds as many
pieces (4 MiB each, ``auditing.tensor_scan.REMOTE_PIECE_BYTES``; and the storage library's buffers for them)
per scanning thread."""
COALESCE_BYTES = 8 << 20
"""The largest ranged read that coalesces small tensors (:meth:`RemoteFiles.prefetched`)."""
COALESCE_GAP = 64 << 10
"""Bytes between two small tensors that one ranged read fetches rather than make two requests."""

class ReadGuard:
    """The reads of one staged checkpoint: the first that times out or breaks the protocol trips it, and every
    later read fails at once with the same reason."""

    def __init__(self) -> None:
        self.tripped: str | None = None

    def check(self) -> None:
        if self.tripped is not None:
            raise RemoteReadError(f"{self.tripped} (an earlier read failed so; no more requests are made)")

    def failed(self, exc: RemoteReadError) -> RemoteReadError:
        if self.tripped is None and isinstance(exc, ProtocolError | RequestTimeout):
            self.tripped = str(exc)
        return exc


@dataclass(frozen=True, slots=True)
class Pin:
    """What one object was when staged, which every read of it is held to (:class:`Pins`)."""

    key: tuple[str, str, str]
    """``("s3" | "gs", bucket, key)``."""
    value: str
    """What each read sends: S3's ETag (``IfMatch``), GCS's generation (the read asks for exactly it)."""
    etag: str | None = None
    """The ETag listed (another rank of a distributed audit compares its own listing's with it)."""

    @property
    def kind(self) -> str:
        return "ETag" if self.key[0] == "s3" else "generation"


@dataclass(frozen=True, slots=True)
class RemoteObject:
    """One remote object of a staged checkpoint, read only through :meth:`read` / :meth:`read_many`."""

    fs: Any
    path: str
    size: int
    guard: ReadGuard = field(default_factory=ReadGuard)
    pin: Pin | None = None
    """S3's ETag or GCS's generation staged, which must still be the one every read sends."""

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object (clipped to its size): exactly those, or :class:`RemoteReadError`."""
        return self.read_many([(start, end)])[0]

    def read_many(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        """:meth:`read` of each ``(start, end)``, concurrently where the filesystem can (``cat_ranges``)."""
        self.guard.check()
        options: dict[str, str] = {}
        if self.pin is not None:
            with _PINS_LOCK:
                now = _PINS.get(self.pin.key)
            if now is None or now[0] != self.pin.value:
                raise ObjectChanged(f"{self.path} changed since it was staged ({self.pin.kind} {self.pin.value} then, "
                                    f"{now[0] if now else 'unknown'} when staged again since)")
            if self.pin.kind == "generation":
                options["generation"] = self.pin.value  # gcsfs asks the store for exactly that generation
        spans = [(s, max(s, min(self.size, e))) for s, e in ranges]
        todo = [(s, e) for s, e in spans if e > s]
        datas: list[Any]
        try:
            if len(todo) == 1:
                datas = [self.fs.cat_file(self.path, start=todo[0][0], end=todo[0][1], **options)]
            elif todo:
                datas = self.fs.cat_ranges([self.path] * len(todo), [s for s, _ in todo], [e for _, e in todo],
                                           **options)
            else:
                datas = []
        except Exception as exc:  # noqa: BLE001 - the storage library's errors, one per read
            datas = [exc] * len(todo)
        got: dict[tuple[int, int], bytes] = {}
        for (s, e), data in zip(todo, datas, strict=True):
            if isinstance(data, BaseException):
                raise self.guard.failed(self._error(data, s, e)) from None
            if len(data) != e - s:
                raise self.guard.failed(ProtocolError(
                    f"{self.path}: {len(data)} bytes came back for bytes {s}-{e - 1} (the object is not the size "
                    f"it was staged with, {self.size} bytes, or the server ignores ranges)"))
            got[(s, e)] = bytes(data)
        return [got.get(span, b"") for span in spans]

    def _error(self, exc: BaseException, start: int, end: int) -> RemoteReadError:
        if isinstance(exc, RemoteReadError):
            return exc
        text = f"{type(exc).__name__}: {exc}"
        lower = text.lower()
        if "precondition" in lower or "pre-condition" in lower or " 412" in lower:  # the pinned ETag refused
            return ObjectChanged(f"{self.path} changed since it was staged (the store refused the ETag pinned "
                                 f"then: {text})")
        if isinstance(exc, FileNotFoundError) and self.pin is not None and self.pin.kind == "generation":
            # GCS answers 404 for a generation it no longer stores: the object was replaced or deleted
            return ObjectChanged(f"{self.path} changed since it was staged (generation {self.pin.value}, listed "
                                 f"then, is no longer stored: replaced or deleted)")
        if isinstance(exc, TimeoutError) or "Timeout" in type(exc).__name__:
            return RequestTimeout(f"{self.path}: bytes {start}-{end - 1}: {text}")
        return RemoteReadError(f"ranged read of {self.path} at {start}: {text}")


class RemoteFiles:
    """Stand-in file (absolute local path) -> its remote object; ranged reads for the tensor data.

    Shared by the scanning threads: fsspec filesystems serve concurrent ranged reads; staging a span is
    serialised by a lock.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        """The stand-in directory (removed by :meth:`close`)."""
        self._files: dict[str, RemoteObject] = {}
        self._staged: set[tuple[str, int, int]] = set()
        self._lock = threading.Lock()
        self._blocks: dict[str, tuple[tuple[int, bytes], ...]] = {}
        """Prefetched ranges by stand-in file (:meth:`prefetched`): ``(offset, bytes)``; replaced, never changed
        in place, so a scanning thread reads it without the lock."""
        self.on_close: list[Any] = []
        """Called by :meth:`close` (the S3 pins released)."""

    def add(self, local: str, remote: RemoteObject) -> None:
        self._files[local] = remote

    def __contains__(self, local: object) -> bool:
        return local in self._files

    def etag(self, local: str) -> str | None:
        """The ETag of the object behind ``local`` as staged (S3 and HTTP reads are pinned to it; GCS reads to the
        generation listed with it), or ``None`` (not remote, not pinned)."""
        r = self._files.get(local)
        if r is None:
            return None
        if r.pin is not None:
            return r.pin.etag
        pins = getattr(r.fs, "pins", None)
        held = pins.get(r.path) if isinstance(pins, dict) else None
        return held[0] if isinstance(held, tuple) and isinstance(held[0], str) else None

    def read_into(self, local: str, buf: memoryview, offset: int) -> int:
        """Fill ``buf`` with the remote bytes at ``offset`` of the file behind ``local``; the count read. Served
        from a block :meth:`prefetched` fetched when one holds the whole range, else one ranged read
        (:meth:`RemoteObject.read`: bounded, pinned, exactly the range asked). Raises :class:`RemoteReadError` (an
        ``OSError``: the scan reports the tensor's data as unreadable, with why)."""
        r = self._files[local]
        end = min(r.size, offset + len(buf))
        if end <= offset:
            return 0
        for start, data in self._blocks.get(local, ()):  # a handful per scanning thread
            if start <= offset and end <= start + len(data):
                buf[: end - offset] = data[offset - start : end - start]
                return end - offset
        data = r.read(offset, end)
        buf[: len(data)] = data
        return len(data)

    def read_ahead(self, local: str, start: int, length: int, piece: int) -> Iterator[bytes]:
        """The remote bytes ``[start, start+length)`` of the file behind ``local``, in order, ``piece`` bytes at a
        time (a short one means the object ended early), fetched :data:`READ_AHEAD` ranged reads at a time,
        issued together (:meth:`RemoteObject.read_many`: concurrent requests, each bounded, pinned and exactly the
        range asked, as every read of the checkpoint is): a large tensor streams at the store's parallel
        throughput rather than one round trip per piece, memory bounded by those pieces. The order (and so a
        tensor's hash) is the sequential one."""
        r = self._files[local]
        end = min(r.size, start + length)
        offsets = range(start, end, piece)
        for k in range(0, len(offsets), READ_AHEAD):
            yield from r.read_many([(o, min(end, o + piece)) for o in offsets[k : k + READ_AHEAD]])

    @contextmanager
    def prefetched(self, ranges: Iterable[tuple[str, int, int]]) -> Iterator[int]:
        """Within the block, :meth:`read_into` serves the ranges ``(local, offset, length)`` (small tensors) from
        memory: they are fetched first, coalesced into ranged reads of at most :data:`COALESCE_BYTES` that span
        gaps of at most :data:`COALESCE_GAP` (a DCP item's archive headers between two tensors), concurrently
        (:meth:`RemoteObject.read_many`, with its checks).
        Yields the number of ranged reads made. The caller bounds the bytes (a batch of small tensors); the
        blocks are dropped on leaving. Ranges of files that are not remote are ignored."""
        spans: dict[str, list[tuple[int, int]]] = {}
        for local, offset, length in ranges:
            r = self._files.get(local)
            if r is not None and length > 0:
                spans.setdefault(local, []).append((offset, min(r.size, offset + length)))
        mine: list[tuple[str, tuple[int, bytes]]] = []
        reads = 0
        try:
            for local, items in spans.items():
                merged: list[list[int]] = []
                for s, e in sorted(items):
                    if merged and s - merged[-1][1] <= COALESCE_GAP and max(e, merged[-1][1]) - merged[-1][0] <= \
                            COALESCE_BYTES:
                        merged[-1][1] = max(merged[-1][1], e)
                    else:
                        merged.append([s, e])
                r = self._files[local]
                datas = r.read_many([(s, e) for s, e in merged if e > s])
                reads += len(datas)
                blocks = [(s, d) for (s, _), d in zip((m for m in merged if m[1] > m[0]), datas, strict=True)]
                with self._lock:
                    self._blocks[local] = self._blocks.get(local, ()) + tuple(blocks)
                mine += [(local, b) for b in blocks]
            yield reads
        finally:
            with self._lock:
                for local in {name for name, _ in mine}:
                    ours = {id(b) for name, b in mine if name == local}
                    held = tuple(x for x in self._blocks.get(local, ()) if id(x) not in ours)
                    if held:
                        self._blocks[local] = held
                    else:
                        self._blocks.pop(local, None)

    def stage_span(self, local: str, start: int, length: int) -> None:
        """Write the remote bytes ``[start, start+length)`` into the stand-in (before a strided view maps it)."""
        key = (local, start, length)
        with self._lock:
            if key in self._staged:
                return
            fill(self._files[local], local, start, length)
            self._staged.add(key)

    def close(self) -> None:
        import shutil

        for release in self.on_close:
            release()
        self.on_close = []
        shutil.rmtree(self.root, ignore_errors=True)


def info_of(fs: Any, path: str, url: str) -> dict[str, Any]:
    """``fs.info(path)`` of the object or prefix ``url`` names. Raises ``FileNotFoundError`` when nothing is there
    and :class:`RemoteError` when the store cannot be reached (credentials, endpoint, network), in one line naming
    ``url``."""
    try:
        info: dict[str, Any] = fs.info(path)
    except FileNotFoundError:
        raise FileNotFoundError(2, "no such object or prefix", url) from None
    except Exception as exc:  # noqa: BLE001 - credentials, endpoint, network: the storage library's own words
        raise RemoteError(f"{url}: cannot reach it ({type(exc).__name__}: {exc})") from None
    return info

def filesystem(url: str) -> tuple[Any, str]:
    """The filesystem of ``url`` (HTTP: a private instance holding this checkpoint's pins) and the
    path in it. Configuration the storage library refuses is a :class:`RemoteError`."""
    try:
        import fsspec
    except ImportError:
        raise RemoteError(f"{url}: reading URLs needs fsspec: {install_line('remote')} (fsspec, s3fs, gcsfs)") from None
    protocol = url.partition("://")[0].lower()
    timeout = request_timeout()
    try:
        if protocol in ("http", "https"):
            from ckptaudit.formats.remote.http import BoundedHTTPFileSystem

            # A URL with a query (a presigned URL's signature) is sent as given: re-encoding it (yarl turns %2F
            # into /) could change the bytes the server signed.
            return BoundedHTTPFileSystem(skip_instance_cache=True, encoded="?" in url), url
        options: dict[str, Any] = {}
        if protocol in ("gs", "gcs"):
            _quiet_library_logger("gcsfs")
            configured = {**fsspec.config.conf.get("gs", {}), **fsspec.config.conf.get("gcs", {})}
            if "requests_timeout" not in configured:
                # gcsfs sends no timeout of its own (aiohttp then waits for ever on a stalled server): S3's bounds,
                # to connect and for each wait for bytes (gcsfs retries a timed-out request, then gives up)
                import aiohttp

                options["requests_timeout"] = aiohttp.ClientTimeout(sock_connect=timeout, sock_read=timeout)
        if protocol in ("s3", "s3a") and "config_kwargs" not in fsspec.config.conf.get("s3", {}):
            # botocore's own per-request bounds (connect, and each wait for bytes), few retries
            options["config_kwargs"] = {"connect_timeout": timeout, "read_timeout": timeout,
                                        "retries": {"max_attempts": 2}}
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:  # fsspec's own words name the library (gcsfs, s3fs) the protocol needs
        raise RemoteError(f"{url}: {exc} ({install_line('remote')})") from None
    except Exception as exc:  # noqa: BLE001 - the storage library refused its configuration: say so in one line
        hint = ""
        if "endpoint_url" in str(exc):
            hint = (" (this s3fs takes no endpoint_url option: set AWS_ENDPOINT_URL instead of "
                    "FSSPEC_S3_ENDPOINT_URL, or install a newer s3fs)")
        raise RemoteError(f"{url}: the {protocol} filesystem refused its configuration{hint}: "
                          f"{type(exc).__name__}: {exc}") from None
    return fs, path


def _quiet_library_logger(name: str) -> None:
    """Give the storage library's logger a ``NullHandler`` (once): gcsfs logs every failed request with its
    traceback (``logger.exception``), which Python's last-resort handler prints to stderr beside our one-line
    error when the program configured no logging. Where it did, the records still reach its handlers."""
    import logging

    log = logging.getLogger(name)
    if not any(isinstance(h, logging.NullHandler) for h in log.handlers):
        log.addHandler(logging.NullHandler())


_PINS: dict[tuple[str, str, str], tuple[str, int]] = {}
"""(store, bucket, key) -> (the ETag or generation staged, how many live stagings hold it): what every read of the
key sends (S3: ``IfMatch`` on ``GetObject``; GCS: the generation asked). Process-wide, as the filesystem (and its
client) is fsspec's cached instance: a staging that lists the object anew with another identity fails the reads
of the stagings before it."""
_PINS_LOCK = threading.Lock()


def _inject_if_match(params: dict[str, Any], **_: Any) -> None:
    """botocore's ``before-parameter-build.s3.GetObject`` event: a pinned key is read only as it was staged."""
    with _PINS_LOCK:
        pin = _PINS.get(("s3", str(params.get("Bucket")), str(params.get("Key"))))
    if pin is not None and "IfMatch" not in params and "VersionId" not in params:
        params["IfMatch"] = pin[0]


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = getattr(fs, "protocol", ())
    return tuple(protocol) if isinstance(protocol, tuple | list) else (str(protocol),)


class Pins:
    """The identity of each staged object, recorded from ``info``/``ls`` and enforced by the filesystem's own
    requests: S3 sends its ETag as ``IfMatch`` with every ``GetObject`` (botocore's event hook on the filesystem's
    client) and answers 412 once the object was replaced; GCS reads ask for its generation (gcsfs's ``generation``,
    sent as the request's ``generation=``), which the store answers with exactly those bytes or a 404 once that
    generation is no longer stored (a bucket without versioning; a versioned bucket still serves the generation
    listed, so the audit reads the object as staged). HTTP sends ``If-Match`` and checks the replies' ETag
    (:mod:`ckptaudit.formats.remote.http`). Other filesystems: not pinned (sizes still checked)."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        self.store: str | None = None
        """``"s3"`` or ``"gs"`` where the reads are pinned here."""
        self.held: list[Pin] = []
        protocols = _protocols(fs)
        if hasattr(fs, "split_path") and "s3" in protocols:
            events = getattr(getattr(getattr(fs, "s3", None), "meta", None), "events", None)
            if events is not None:
                events.register("before-parameter-build.s3.GetObject", _inject_if_match,
                                unique_id="ckptaudit-pin-etag")  # once per client
                self.store = "s3"
        elif hasattr(fs, "split_path") and "gs" in protocols:
            self.store = "gs"

    def add(self, path: str, info: dict[str, Any]) -> Pin | None:
        """Pin ``path`` as ``info`` describes it; the pin to check (and send) with each read, if any."""
        pin = getattr(self.fs, "pin", None)
        if pin is not None:
            pin(path, info)
            return None
        etag = info.get("ETag") or info.get("etag")
        etag = etag if isinstance(etag, str) and etag else None
        value = etag if self.store == "s3" else info.get("generation") if self.store == "gs" else None
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if self.store is None or not isinstance(value, str) or not value:
            return None
        bucket, key = self.fs.split_path(path)[:2]
        made = Pin((self.store, bucket, key), value, etag)
        with _PINS_LOCK:
            old = _PINS.get(made.key)
            # Another live staging pinned another identity: the object changed between the two; its reads now
            # fail their check in RemoteObject.read_many, and this staging pins what it saw.
            holders = old[1] + 1 if old is not None and old[0] == value else 1
            _PINS[made.key] = (value, holders)
        self.held.append(made)
        return made

    def release(self) -> None:
        with _PINS_LOCK:
            for made in self.held:
                now = _PINS.get(made.key)
                if now is not None and now[0] == made.value:
                    if now[1] <= 1:
                        del _PINS[made.key]
                    else:
                        _PINS[made.key] = (made.value, now[1] - 1)
        self.held = []


FILL_PIECE = 8 << 20


def fill(remote: RemoteObject, local: str, start: int, length: int) -> None:
    """Copy the remote bytes ``[start, start+length)`` (clipped to the file) into the stand-in, 8 MiB at a time
    (memory holds one piece, whatever the span: a strided view's, a DCP shard's)."""
    end = min(remote.size, start + length)
    with open(local, "r+b") as fh:
        for pos in range(start, end, FILL_PIECE):
            data = remote.read(pos, min(end, pos + FILL_PIECE))
            fh.seek(pos)
            fh.write(data)
