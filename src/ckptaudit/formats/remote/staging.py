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

Every read goes through :class:`~ckptaudit.formats.remote.objects.RemoteObject`, bounded, pinned to the ETag staged
and exactly the range asked (:mod:`ckptaudit.formats.remote.objects`).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

from ckptaudit.formats.remote import is_url, local_path
from ckptaudit.formats.remote.errors import RemoteError, RemoteReadError
from ckptaudit.formats.remote.objects import (
    FILL_PIECE,
    Pins,
    ReadGuard,
    RemoteFiles,
    RemoteObject,
    filesystem,
    fill,
    info_of,
)

__all__ = ["MAX_STAGED_BYTES", "RemoteFiles", "ShareReader", "is_url", "local_path", "object_name", "request_url",
           "stage"]


def _is_http(url: str) -> bool:
    return url.partition("://")[0].lower() in ("http", "https")


def request_url(url: str) -> str:
    """What is asked of the store for ``url``: an ``http(s)://`` URL without its ``#fragment`` (a client never sends
    one) and with its query (a presigned URL's signature, a token: the server needs it); any other URL unchanged
    (``#`` and ``?`` are characters of an S3 or GCS object's key)."""
    return url.partition("#")[0] if _is_http(url) else url


def object_name(url: str) -> str:
    """The name ``url``'s object is read as (the readers recognise files by it): the last segment of its path,
    percent-decoded for ``http(s)://`` URLs, whose query and fragment are no part of it."""
    if _is_http(url):
        from urllib.parse import unquote, urlsplit

        return unquote(urlsplit(url).path.rstrip("/").rpartition("/")[2])
    return os.path.basename(url.rstrip("/"))

MAX_STAGED_BYTES = 1 << 30
"""Metadata bytes staged per checkpoint at most (headers, pickles, JSON): a limit against hostile listings."""
MAX_MEMBER_BYTES = 64 << 20
"""A zip member larger than this is tensor data: only its local header is staged."""
MAX_FILES = 100_000
_SAFETENSORS_HEADER_LIMIT = 100_000_000
TORCH_EXTENSIONS = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle", ".tar")


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
    fs, root = filesystem(request_url(url))
    info = info_of(fs, root, url)
    import tempfile  # here: only an audit of a URL needs it

    tmp = tempfile.mkdtemp(prefix="ckptaudit-remote-")
    remote = RemoteFiles(tmp)
    budget = _Budget(url)
    ctx = _Staging(fs, ReadGuard(), Pins(fs), remote, budget)
    remote.on_close.append(ctx.pins.release)
    try:
        base = _safe_name(object_name(root)) or "checkpoint"
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
    guard: ReadGuard
    pins: Pins
    remote: RemoteFiles
    budget: _Budget

    def handle(self, path: str, size: int, info: dict[str, Any]) -> RemoteObject:
        return RemoteObject(self.fs, path, size, self.guard, self.pins.add(path, info))


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
    handles: dict[str, RemoteObject] = {}
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


def _stage_file(ctx: _Staging, path: str, size: int, info: dict[str, Any], local: str) -> RemoteObject:
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
        fill(r, local, 0, 8 + n)
        return r
    if lower.endswith(".json"):
        budget.take(size)
        fill(r, local, 0, size)
        return r
    if not lower.endswith(TORCH_EXTENSIONS):
        return r  # not a file the readers open
    head = r.read(0, min(size, 4))
    if head != b"PK\x03\x04":  # a plain or legacy pickle: the readers parse all of it
        budget.take(size)
        fill(r, local, 0, size)
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


def _stage_zip(r: RemoteObject, local: str, budget: _Budget) -> None:
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
    view check (:meth:`view`) and its data reads (:meth:`stand_in`) go through :class:`RemoteObject` as rank 0's
    staging does: a deadline per request, replies exactly the range asked, the listed ETag sent with every read
    (S3 ``IfMatch``, HTTP ``If-Match``) and a later replacement an :class:`ObjectChanged`. The stand-in's
    :class:`RemoteFiles` takes over the pins (released by its ``close``); :meth:`close` releases them otherwise.

    File names are relative to ``url``, or to the prefix holding it when ``single_file``.
    """

    def __init__(self, url: str, *, single_file: bool) -> None:
        self.url = url
        self.fs, root = filesystem(request_url(url))
        self.query = ""
        """An ``http(s)://`` URL's ``?query`` (a signature, a token), sent with every object's request."""
        if _is_http(root) and "?" in root:
            root, _, query = root.partition("?")
            self.query = "?" + query
        root = root.rstrip("/")
        self.base = root.rsplit("/", 1)[0] if single_file and "/" in root else root
        self.guard = ReadGuard()
        self._pins: Pins | None = None  # made at the first pin: an S3 filesystem's client exists after a request
        self._listed: dict[str, dict[str, dict[str, Any]] | str | None] = {}
        self._handles: dict[str, RemoteObject | str] = {}
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

    def handle(self, name: str) -> RemoteObject | str:
        """The pinned object behind ``name``, or why this rank cannot read it."""
        known = self._handles.get(name)
        if known is not None:
            return known
        path = f"{self.base}/{name}{self.query}"
        entry = self._entry(path)
        if isinstance(entry, str):
            out: RemoteObject | str = entry
        else:
            try:
                size = _size(entry, self.url)
            except RemoteError as exc:
                out = f"cannot be read ({exc})"
            else:
                if self._pins is None:
                    self._pins = Pins(self.fs)
                out = RemoteObject(self.fs, path, size, self.guard, self._pins.add(path, entry))
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
                for pos in range(0, r.size, FILL_PIECE):
                    h.update(r.read(pos, min(r.size, pos + FILL_PIECE)))
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
