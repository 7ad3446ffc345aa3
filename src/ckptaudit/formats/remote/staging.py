"""Checkpoints behind fsspec URLs (``s3://``, ``gs://``, ``https://``...): read with ranged reads, never downloaded.

The readers work on local paths. For a URL, :func:`stage` builds a *stand-in*: a local directory of sparse files
with the remote files' names and sizes, where only the bytes the readers parse are filled in (fetched with
ranged reads): a safetensors header; a ``torch.save`` archive's central directory, local headers and small
members (``data.pkl``, ``byteorder``...); a JSON index. Tensor data is never staged: :class:`RemoteFiles` maps
each stand-in file to its remote object, and :class:`~ckptaudit.formats.io.tensors.FileMaps` streams a tensor's
bytes from there with one ranged read per chunk, so memory stays bounded by the chunk as for local files and
local disk holds only metadata (plus the span of the rare strided tensor, which is staged before it is viewed).

``file://`` URLs and plain paths keep the local fast path. A DCP directory (a prefix holding ``.metadata`` or
``.distcp`` objects, at the top or one level down) is staged by :mod:`ckptaudit.formats.remote.dcp`:
``.metadata`` whole, then each item's archive metadata at the byte ranges ``.metadata`` records (the items'
members carry their sizes only after their data, so the data files cannot be walked from the front), and the
stand-in is read by the same DCP reader as a local directory. Other sub-prefixes are left empty, as the readers
open nothing else below a local directory's top level.

Every read goes through :class:`_Remote` (one object of the staged checkpoint): its reply must be exactly the
range asked (never more bytes are kept, fewer is an error), the object must still be the one staged (its ETag,
read at staging, is sent as ``If-Match`` with every S3 ``GetObject`` and every HTTP request and checked in the
replies: a replacement of the same length is reported, never read as the staged object), and the first read
that times out or breaks the protocol fails every later read of the checkpoint at once (a misbehaving server
costs one deadline, not one per request). ``http(s)://`` requests are bounded one by one
(:mod:`ckptaudit.formats.remote.http`: a deadline per request, the reply capped to the range asked); S3 requests
by the client's connect and read timeouts. ``$CKPTAUDIT_REMOTE_TIMEOUT`` (seconds, default 30) sets both.

Credentials and endpoints come from fsspec's and the storage library's usual configuration (for S3:
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, profiles; ``FSSPEC_S3_*`` where the
installed s3fs takes the option). A configuration the storage library rejects, or credentials it cannot find or
use, is a :class:`RemoteError` naming the URL: one line, exit code 2.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ckptaudit.formats.remote.errors import (
    ObjectChanged,
    ProtocolError,
    RemoteError,
    RemoteReadError,
    RequestTimeout,
    request_timeout,
)

__all__ = ["MAX_STAGED_BYTES", "RemoteFiles", "ShareReader", "filesystem", "is_url", "local_path", "stage"]

MAX_STAGED_BYTES = 1 << 30
"""Metadata bytes staged per checkpoint at most (headers, pickles, JSON): a limit against hostile listings."""
MAX_MEMBER_BYTES = 64 << 20
"""A zip member larger than this is tensor data: only its local header is staged."""
MAX_FILES = 100_000
READ_AHEAD = 2
"""Ranged reads issued together per large tensor streamed (:meth:`RemoteFiles.read_ahead`): memory holds as many
pieces (4 MiB each, ``auditing.tensor_scan.REMOTE_PIECE_BYTES``; and the storage library's buffers for them)
per scanning thread."""
COALESCE_BYTES = 8 << 20
"""The largest ranged read that coalesces small tensors (:meth:`RemoteFiles.prefetched`)."""
COALESCE_GAP = 64 << 10
"""Bytes between two small tensors that one ranged read fetches rather than make two requests."""
_SAFETENSORS_HEADER_LIMIT = 100_000_000
TORCH_EXTENSIONS = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle", ".tar")


def is_url(path: str) -> bool:
    """Whether ``path`` names a remote object (``scheme://``, other than ``file://``)."""
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.isidentifier() and scheme.lower() != "file" and len(scheme) > 1


def local_path(path: str) -> str:
    """``file:///x`` -> ``/x``; anything else unchanged."""
    return path[len("file://"):] if path.lower().startswith("file://") else path


class _Guard:
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
class _Remote:
    """One remote object of a staged checkpoint, read only through :meth:`read` / :meth:`read_many`."""

    fs: Any
    path: str
    size: int
    guard: _Guard = field(default_factory=_Guard)
    pin: tuple[tuple[str, str], str] | None = None
    """S3: (bucket, key) and the ETag staged, which must still be the one every read sends."""

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object (clipped to its size): exactly those, or :class:`RemoteReadError`."""
        return self.read_many([(start, end)])[0]

    def read_many(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        """:meth:`read` of each ``(start, end)``, concurrently where the filesystem can (``cat_ranges``)."""
        self.guard.check()
        if self.pin is not None:
            with _S3_LOCK:
                now = _S3_PINS.get(self.pin[0])
            if now is None or now[0] != self.pin[1]:
                raise ObjectChanged(f"{self.path} changed since it was staged (ETag {self.pin[1]} then, "
                                    f"{now[0] if now else 'unknown'} when staged again since)")
        spans = [(s, max(s, min(self.size, e))) for s, e in ranges]
        todo = [(s, e) for s, e in spans if e > s]
        datas: list[Any]
        try:
            if len(todo) == 1:
                datas = [self.fs.cat_file(self.path, start=todo[0][0], end=todo[0][1])]
            elif todo:
                datas = self.fs.cat_ranges([self.path] * len(todo), [s for s, _ in todo], [e for _, e in todo])
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
        self._files: dict[str, _Remote] = {}
        self._staged: set[tuple[str, int, int]] = set()
        self._lock = threading.Lock()
        self._blocks: dict[str, tuple[tuple[int, bytes], ...]] = {}
        """Prefetched ranges by stand-in file (:meth:`prefetched`): ``(offset, bytes)``; replaced, never changed
        in place, so a scanning thread reads it without the lock."""
        self.on_close: list[Any] = []
        """Called by :meth:`close` (the S3 pins released)."""

    def add(self, local: str, remote: _Remote) -> None:
        self._files[local] = remote

    def __contains__(self, local: object) -> bool:
        return local in self._files

    def etag(self, local: str) -> str | None:
        """The ETag the object behind ``local`` is pinned to (S3, HTTP), or ``None`` (not remote, not pinned)."""
        r = self._files.get(local)
        if r is None:
            return None
        if r.pin is not None:
            return r.pin[1]
        pins = getattr(r.fs, "pins", None)
        held = pins.get(r.path) if isinstance(pins, dict) else None
        return held[0] if isinstance(held, tuple) and isinstance(held[0], str) else None

    def read_into(self, local: str, buf: memoryview, offset: int) -> int:
        """Fill ``buf`` with the remote bytes at ``offset`` of the file behind ``local``; the count read. Served
        from a block :meth:`prefetched` fetched when one holds the whole range, else one ranged read
        (:meth:`_Remote.read`: bounded, pinned, exactly the range asked). Raises :class:`RemoteReadError` (an
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
        issued together (:meth:`_Remote.read_many`: concurrent requests, each bounded, pinned and exactly the
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
        (:meth:`_Remote.read_many`, with its checks).
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
            _fill(self._files[local], local, start, length)
            self._staged.add(key)

    def close(self) -> None:
        import shutil

        for release in self.on_close:
            release()
        self.on_close = []
        shutil.rmtree(self.root, ignore_errors=True)


def _fs(url: str) -> tuple[Any, str]:
    """The filesystem of ``url`` (HTTP: a private instance holding this checkpoint's pins) and the
    path in it. Configuration the storage library refuses is a :class:`RemoteError`."""
    try:
        import fsspec
    except ImportError:
        raise RemoteError(f"{url}: reading URLs needs fsspec: pip install 'ckptaudit[remote]' (fsspec and s3fs; "
                          "add gcsfs for gs://)") from None
    protocol = url.partition("://")[0].lower()
    timeout = request_timeout()
    try:
        if protocol in ("http", "https"):
            from ckptaudit.formats.remote.http import BoundedHTTPFileSystem

            return BoundedHTTPFileSystem(skip_instance_cache=True), url
        options: dict[str, Any] = {}
        if protocol in ("s3", "s3a") and "config_kwargs" not in fsspec.config.conf.get("s3", {}):
            # botocore's own per-request bounds (connect, and each wait for bytes), few retries
            options["config_kwargs"] = {"connect_timeout": timeout, "read_timeout": timeout,
                                        "retries": {"max_attempts": 2}}
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        raise RemoteError(f"{url}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the storage library refused its configuration: say so in one line
        hint = ""
        if "endpoint_url" in str(exc):
            hint = (" (this s3fs takes no endpoint_url option: set AWS_ENDPOINT_URL instead of "
                    "FSSPEC_S3_ENDPOINT_URL, or install a newer s3fs)")
        raise RemoteError(f"{url}: the {protocol} filesystem refused its configuration{hint}: "
                          f"{type(exc).__name__}: {exc}") from None
    return fs, path


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` with this module's request bounds, and the path in it (for listings:
    ``ckptaudit latest`` on an object-store prefix). Configuration the storage library refuses is a
    :class:`RemoteError`."""
    return _fs(url)


_S3_PINS: dict[tuple[str, str], tuple[str, int]] = {}
"""(bucket, key) -> (the ETag staged, how many live stagings hold it): what every ``GetObject`` of the key sends
as ``IfMatch``. Process-wide, as the S3 filesystem (and its client) is fsspec's cached instance."""
_S3_LOCK = threading.Lock()


def _inject_if_match(params: dict[str, Any], **_: Any) -> None:
    """botocore's ``before-parameter-build.s3.GetObject`` event: a pinned key is read only as it was staged."""
    with _S3_LOCK:
        pin = _S3_PINS.get((str(params.get("Bucket")), str(params.get("Key"))))
    if pin is not None and "IfMatch" not in params and "VersionId" not in params:
        params["IfMatch"] = pin[0]


class _Pins:
    """The identity of each staged object (its ETag), recorded from ``info``/``ls`` and enforced by the
    filesystem's own requests: S3 sends it as ``IfMatch`` with every ``GetObject`` (botocore's event hook on the
    filesystem's client) and answers 412 once the object was replaced; HTTP sends ``If-Match`` and checks the
    replies' ETag (:mod:`ckptaudit.formats.remote.http`). Other filesystems: not pinned (sizes still checked)."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        self.s3 = False
        self.held: list[tuple[tuple[str, str], str]] = []
        if hasattr(fs, "split_path") and "s3" in (fs.protocol if isinstance(fs.protocol, tuple | list) else
                                                  (fs.protocol,)):
            events = getattr(getattr(getattr(fs, "s3", None), "meta", None), "events", None)
            if events is not None:
                events.register("before-parameter-build.s3.GetObject", _inject_if_match,
                                unique_id="ckptaudit-pin-etag")  # once per client
                self.s3 = True

    def add(self, path: str, info: dict[str, Any]) -> tuple[tuple[str, str], str] | None:
        """Pin ``path`` as ``info`` describes it; the S3 pin (key, ETag) to check before each read, if any."""
        pin = getattr(self.fs, "pin", None)
        if pin is not None:
            pin(path, info)
            return None
        etag = info.get("ETag") or info.get("etag")
        if not self.s3 or not isinstance(etag, str) or not etag:
            return None
        bucket, key = self.fs.split_path(path)[:2]
        with _S3_LOCK:
            old = _S3_PINS.get((bucket, key))
            # Another live staging pinned another ETag: the object changed between the two; its reads now fail
            # their check in _Remote.read_many, and this staging pins what it saw.
            holders = old[1] + 1 if old is not None and old[0] == etag else 1
            _S3_PINS[(bucket, key)] = (etag, holders)
        self.held.append(((bucket, key), etag))
        return (bucket, key), etag

    def release(self) -> None:
        with _S3_LOCK:
            for key, etag in self.held:
                pin = _S3_PINS.get(key)
                if pin is not None and pin[0] == etag:
                    if pin[1] <= 1:
                        del _S3_PINS[key]
                    else:
                        _S3_PINS[key] = (etag, pin[1] - 1)
        self.held = []


_FILL_PIECE = 8 << 20


def _fill(remote: _Remote, local: str, start: int, length: int) -> None:
    """Copy the remote bytes ``[start, start+length)`` (clipped to the file) into the stand-in, 8 MiB at a time
    (memory holds one piece, whatever the span: a strided view's, a DCP shard's)."""
    end = min(remote.size, start + length)
    with open(local, "r+b") as fh:
        for pos in range(start, end, _FILL_PIECE):
            data = remote.read(pos, min(end, pos + _FILL_PIECE))
            fh.seek(pos)
            fh.write(data)


class _Budget:
    def __init__(self, url: str) -> None:
        self.url = url
        self.left = MAX_STAGED_BYTES

    def take(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise RemoteError(f"{self.url}: more than {MAX_STAGED_BYTES} bytes of metadata to read; not a "
                              "checkpoint ckptaudit can audit remotely (copy it locally)")


def stage(url: str) -> tuple[str, RemoteFiles]:
    """A local stand-in for the checkpoint at ``url`` (see the module docstring), and its remote files.

    Raises ``FileNotFoundError`` when nothing is at ``url``, :class:`RemoteError` when it cannot be staged:
    the storage library's configuration, credentials, the network, a server that breaks the protocol, each
    said in one line naming the URL.
    """
    fs, root = _fs(url)
    try:
        info = fs.info(root)
    except FileNotFoundError:
        raise FileNotFoundError(2, "no such object or prefix", url) from None
    except Exception as exc:  # noqa: BLE001 - credentials, endpoint, network: the storage library's own words
        raise RemoteError(f"{url}: cannot reach it ({type(exc).__name__}: {exc})") from None
    import tempfile  # here: is_url and local_path are on every command's start-up path

    tmp = tempfile.mkdtemp(prefix="ckptaudit-remote-")
    remote = RemoteFiles(tmp)
    budget = _Budget(url)
    ctx = _Staging(fs, _Guard(), _Pins(fs), remote, budget)
    remote.on_close.append(ctx.pins.release)
    try:
        base = _safe_name(os.path.basename(root.rstrip("/"))) or "checkpoint"
        if info.get("type") == "directory":
            local_root = os.path.join(tmp, base)
            _stage_dir(ctx, root, url, local_root, nested=True)
            return local_root, remote
        local = os.path.join(tmp, base)
        _stage_file(ctx, root, _size(info, url), info, local)
        return local, remote
    except (RemoteError, FileNotFoundError, KeyboardInterrupt, MemoryError):
        remote.close()
        raise
    except Exception as exc:  # noqa: BLE001 - the storage library's errors while staging: one line, exit 2
        remote.close()
        raise RemoteError(f"{url}: staging failed: {type(exc).__name__}: {exc}") from None
    except BaseException:
        remote.close()
        raise


@dataclass
class _Staging:
    """What staging one checkpoint shares: its filesystem, read guard, pins, remote files and budget."""

    fs: Any
    guard: _Guard
    pins: _Pins
    remote: RemoteFiles
    budget: _Budget

    def handle(self, path: str, size: int, info: dict[str, Any]) -> _Remote:
        return _Remote(self.fs, path, size, self.guard, self.pins.add(path, info))


def _size(entry: dict[str, Any], url: str) -> int:
    """An object's size as the listing gives it: a non-negative int (a server's listing is checked too)."""
    size = entry.get("size")
    if size is None:
        return 0
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size < 1 << 50:
        shown = (type(size).__name__ if isinstance(size, bool) or not isinstance(size, int) else
                 "a negative number" if size < 0 else "more than 2**50 bytes")
        raise RemoteError(f"{url}: the store lists {str(entry.get('name', 'an object'))[:200]} with size {shown}")
    return size


def _stage_dir(ctx: _Staging, root: str, url: str, local_root: str, *, nested: bool) -> None:
    """Stage the prefix ``root`` into the new directory ``local_root``: its files, and when ``nested`` its
    sub-prefixes one level down (a DCP sub-prefix staged like a DCP directory, any other left empty: in a local
    directory the readers open nothing else below the top level either)."""
    os.mkdir(local_root)
    entries = ctx.fs.ls(root, detail=True)
    if len(entries) > MAX_FILES:
        raise RemoteError(f"{url}: more than {MAX_FILES} objects under the prefix")
    names = {os.path.basename(str(e["name"]).rstrip("/")): e for e in entries}
    dcp = ".metadata" in names or any(n.endswith(".distcp") for n in names)
    if not nested and not dcp:
        return  # the readers look one level down for DCP directories only
    files: dict[str, tuple[str, int, str]] = {}
    handles: dict[str, _Remote] = {}
    for name, entry in sorted(names.items()):
        safe = _safe_name(name)
        if safe is None:
            continue  # odd names are not part of a checkpoint directory
        local = os.path.join(local_root, safe)
        if entry.get("type") == "directory":
            if nested:
                _stage_dir(ctx, str(entry["name"]), f"{url.rstrip('/')}/{safe}", local, nested=False)
            continue
        if entry.get("type") != "file":
            continue
        size = _size(entry, url)
        files[safe] = (str(entry["name"]), size, local)
        handles[str(entry["name"])] = _stage_file(ctx, str(entry["name"]), size, entry, local)
    if dcp:
        from ckptaudit.formats.remote.dcp import stage_dcp

        stage_dcp(files, lambda path, size: handles[path], ctx.budget.take)


def _safe_name(name: str) -> str | None:
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        return None
    return name


def _stage_file(ctx: _Staging, path: str, size: int, info: dict[str, Any], local: str) -> _Remote:
    with open(local, "wb") as fh:
        fh.truncate(size)  # sparse: holds no disk blocks until written
    r = ctx.handle(path, size, info)
    ctx.remote.add(local, r)
    lower = local.lower()
    budget = ctx.budget
    if size == 0:
        return r
    if lower.endswith(".safetensors"):
        head = r.read(0, min(size, 8))
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        n = min(n, _SAFETENSORS_HEADER_LIMIT, size - len(head))
        budget.take(8 + n)
        _fill(r, local, 0, 8 + n)
        return r
    if lower.endswith(".json"):
        budget.take(size)
        _fill(r, local, 0, size)
        return r
    if not lower.endswith(TORCH_EXTENSIONS):
        return r  # not a file the readers open
    head = r.read(0, min(size, 4))
    if head != b"PK\x03\x04":  # a plain or legacy pickle: the readers parse all of it
        budget.take(size)
        _fill(r, local, 0, size)
        return r
    _stage_zip(r, local, budget)
    return r


class _StagedFile:
    """The stand-in of one remote object as a seekable file for :class:`zipfile.ZipFile`: every range read is
    staged first (fetched once, charged to the budget), then read back from the stand-in."""

    def __init__(self, stager: Any) -> None:
        self._stager, self._pos = stager, 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = max(0, {0: 0, 1: self._pos, 2: self._stager.remote.size}[whence] + pos)
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = self._stager.remote.size if n is None or n < 0 else min(self._stager.remote.size, self._pos + n)
        self._stager.stage([(self._pos, end)])
        data: bytes = self._stager.read(self._pos, end)
        self._pos += len(data)
        return data


def _stage_zip(r: _Remote, local: str, budget: _Budget) -> None:
    """Stage a zip archive's end records, central directory, every local header and every small member."""
    import zipfile

    from ckptaudit.formats.remote.dcp import RangeStager

    stager = RangeStager(r, local, budget.take)
    try:
        with zipfile.ZipFile(_StagedFile(stager)) as zf:  # type: ignore[arg-type]
            infos = zf.infolist()
            start_dir = getattr(zf, "start_dir", None)
    except RemoteReadError:
        raise
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error):
        # Not a readable zip: stage it whole if small, so the readers report what is wrong with it.
        if r.size <= MAX_MEMBER_BYTES:
            stager.stage([(0, r.size)])
        return
    # The central directory and end records: from the first central header to the end of the file (zipfile
    # staged what it read of them; the archive readers may read the span between them too).
    if start_dir is None or not 0 <= start_dir <= r.size:
        start_dir = min((i.header_offset for i in infos), default=r.size)
    stager.stage([(start_dir, r.size)])
    # One concurrent batch of ranged reads for every local header (and small member), then a second one for
    # the rare header whose own name or extra field is longer than the central directory let us guess.
    plan: list[tuple[int, int, int]] = []  # (offset, guessed length, member bytes needed after the header)
    for i in infos:
        if not 0 <= i.header_offset < r.size:
            continue
        small = (i.compress_size <= MAX_MEMBER_BYTES and "/data/" not in i.filename) or i.compress_size <= 4096
        # 30 fixed bytes, the header's own name and extra field (torch pads the extra field to align the data),
        # then the member's bytes when it is small; the central directory's lengths plus slack are the guess.
        member = i.compress_size if small else 0
        guess = 30 + len(i.orig_filename.encode("utf-8", "surrogateescape")) + len(i.extra) + 128 + member
        plan.append((i.header_offset, guess, member))
    stager.stage((off, off + guess) for off, guess, _ in plan)
    more: list[tuple[int, int]] = []
    for off, _, member in plan:
        got = stager.read(off, off + 30)
        if len(got) < 30:
            continue
        n, m = struct.unpack("<HH", got[26:30])
        more.append((off, off + 30 + n + m + member))
    stager.stage(more)


# --------------------------------------------------------------------------------------------------------------
# The ranks of a distributed audit other than rank 0 (ckptaudit.auditing.distributed): rank 0 stages and vets the
# checkpoint; the others are sent their share and read only its data files, and check their own view of the vetted
# files.


class ShareReader:
    """(ranks other than 0 of a distributed audit) This rank's reads of its share of the checkpoint at ``url``:
    one filesystem, one read guard, and the objects this rank listed pinned as it listed them, so that both its
    view check (:meth:`view`) and its data reads (:meth:`stand_in`) go through :class:`_Remote` as rank 0's
    staging does: a deadline per request, replies exactly the range asked, the listed ETag sent with every read
    (S3 ``IfMatch``, HTTP ``If-Match``) and a later replacement an :class:`ObjectChanged`. The stand-in's
    :class:`RemoteFiles` takes over the pins (released by its ``close``); :meth:`close` releases them otherwise.

    File names are relative to ``url``, or to the prefix holding it when ``single_file``.
    """

    def __init__(self, url: str, *, single_file: bool) -> None:
        self.url = url
        self.fs, root = _fs(url)
        root = root.rstrip("/")
        self.base = root.rsplit("/", 1)[0] if single_file and "/" in root else root
        self.guard = _Guard()
        self._pins: _Pins | None = None  # made at the first pin: an S3 filesystem's client exists after a request
        self._listed: dict[str, dict[str, dict[str, Any]] | str | None] = {}
        self._handles: dict[str, _Remote | str] = {}
        self._etags: dict[str, str] = {}

    def _entry(self, path: str) -> dict[str, Any] | str:
        """The store's entry for ``path`` from a fresh listing of its prefix (one per prefix; no cached listing
        answers), its own ``info`` where the store lists nothing (HTTP), or why there is none."""
        folder, _, leaf = path.rpartition("/")
        if folder not in self._listed:
            try:
                self.fs.invalidate_cache(folder)
                self._listed[folder] = {str(e["name"]).rstrip("/").rpartition("/")[2]: e
                                        for e in self.fs.ls(folder, detail=True) if e.get("type") == "file"}
            except FileNotFoundError:
                self._listed[folder] = {}
            except NotImplementedError:
                self._listed[folder] = None  # no listings (HTTP): each object's own HEAD below
            except Exception as exc:  # noqa: BLE001 - the storage library's own words, as for stage()
                self._listed[folder] = f"cannot be listed ({type(exc).__name__}: {exc})"
        listed = self._listed[folder]
        if isinstance(listed, str):
            return listed
        if listed is not None:
            return listed.get(leaf) or "cannot be read (no such object)"
        try:
            info: dict[str, Any] = self.fs.info(path)
        except FileNotFoundError:
            return "cannot be read (no such object)"
        except Exception as exc:  # noqa: BLE001 - the storage library's own words
            return f"cannot be read ({type(exc).__name__}: {exc})"
        return info

    def handle(self, name: str) -> _Remote | str:
        """The pinned object behind ``name``, or why this rank cannot read it."""
        known = self._handles.get(name)
        if known is not None:
            return known
        path = f"{self.base}/{name}"
        entry = self._entry(path)
        if isinstance(entry, str):
            out: _Remote | str = entry
        else:
            try:
                size = _size(entry, self.url)
            except RemoteError as exc:
                out = f"cannot be read ({exc})"
            else:
                if self._pins is None:
                    self._pins = _Pins(self.fs)
                out = _Remote(self.fs, path, size, self.guard, self._pins.add(path, entry))
                etag = entry.get("ETag") or entry.get("etag")
                if isinstance(etag, str) and etag:
                    self._etags[name] = etag
        self._handles[name] = out
        return out

    def view(self, names: list[str], *,
             digest: set[str]) -> dict[str, tuple[int, str | None, str | None] | str]:
        """This rank's view of the files ``names``: each one's size as listed, for those in ``digest`` the xxh3-128
        (hex) of its bytes, read in 8 MiB pinned ranged reads, and the ETag listed (or ``None``); or why it cannot
        be read."""
        import xxhash

        out: dict[str, tuple[int, str | None, str | None] | str] = {}
        for name in names:
            r = self.handle(name)
            if isinstance(r, str):
                out[name] = r
                continue
            etag = self._etags.get(name)
            if name not in digest:
                out[name] = (r.size, None, etag)
                continue
            h = xxhash.xxh3_128()
            try:
                for pos in range(0, r.size, _FILL_PIECE):
                    h.update(r.read(pos, min(r.size, pos + _FILL_PIECE)))
            except OSError as exc:  # RemoteReadError: reported as this rank's view of the file
                out[name] = f"cannot be read ({exc})"
                continue
            out[name] = (r.size, h.hexdigest(), etag)
        return out

    def stand_in(self, files: dict[str, int]) -> tuple[str, RemoteFiles]:
        """A bare stand-in for the share's data files ``files`` (name -> the size rank 0 saw): sparse files named
        as the share names them, each mapped to its pinned object. Nothing is staged (the rank parses no
        metadata); tensor data streams by ranged reads as for :func:`stage`. Returns the directory the names are
        relative to and the :class:`RemoteFiles`, whose ``close`` removes it and releases the pins. Raises
        :class:`RemoteError` for a name that is not a plain relative path or an object this rank cannot read or
        sees at another size (the view check reports those first)."""
        import tempfile

        tmp = tempfile.mkdtemp(prefix="ckptaudit-share-")
        remote = RemoteFiles(tmp)
        remote.on_close.append(self.close)
        try:
            for name, size in files.items():
                parts = name.split("/")
                if any(_safe_name(p) is None for p in parts):
                    raise RemoteError(f"{self.url}: the share names a file {name!r} that is not a plain relative "
                                      "path")
                r = self.handle(name)
                if isinstance(r, str) or r.size != size:
                    why = r if isinstance(r, str) else f"is {r.size} bytes, rank 0 saw {size}"
                    raise RemoteError(f"{self.url}: {name} {why}")
                local = os.path.join(tmp, *parts)
                os.makedirs(os.path.dirname(local), exist_ok=True)
                with open(local, "wb") as fh:
                    fh.truncate(size)
                remote.add(local, r)
            return tmp, remote
        except BaseException:
            remote.close()
            raise

    def close(self) -> None:
        """Release this rank's pins (idempotent)."""
        if self._pins is not None:
            self._pins.release()
