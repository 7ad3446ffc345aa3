"""Checkpoints behind fsspec URLs (``s3://``, ``gs://``, ``https://``...): read with ranged reads, never downloaded.

The readers work on local paths. For a URL, :func:`stage` builds a *stand-in*: a local directory of sparse files
with the remote files' names and sizes, where only the bytes the readers parse are filled in (fetched with
ranged reads): a safetensors header; a ``torch.save`` archive's central directory, local headers and small
members (``data.pkl``, ``byteorder``...); a JSON index. Tensor data is never staged: :class:`RemoteFiles` maps
each stand-in file to its remote object, and :class:`~ckptaudit.formats.tensors.FileMaps` streams a tensor's
bytes from there with one ranged read per chunk, so memory stays bounded by the chunk as for local files and
local disk holds only metadata (plus the span of the rare strided tensor, which is staged before it is viewed).

``file://`` URLs and plain paths keep the local fast path. A DCP directory (a prefix holding ``.metadata`` or
``.distcp`` objects, at the top or one level down) is staged by :mod:`ckptaudit.formats.remote_dcp`:
``.metadata`` whole, then each item's archive metadata at the byte ranges ``.metadata`` records (the items'
members carry their sizes only after their data, so the data files cannot be walked from the front), and the
stand-in is read by the same DCP reader as a local directory. Other sub-prefixes are left empty, as the readers
open nothing else below a local directory's top level.

Credentials and endpoints come from fsspec's and the storage library's usual configuration (for S3:
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL`` or ``FSSPEC_S3_ENDPOINT_URL``...).
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_STAGED_BYTES", "RemoteError", "RemoteFiles", "is_url", "local_path", "stage"]

MAX_STAGED_BYTES = 1 << 30
"""Metadata bytes staged per checkpoint at most (headers, pickles, JSON): a limit against hostile listings."""
MAX_MEMBER_BYTES = 64 << 20
"""A zip member larger than this is tensor data: only its local header is staged."""
MAX_FILES = 100_000
READ_AHEAD = 2
"""Ranged reads issued together per large tensor streamed (:meth:`RemoteFiles.read_ahead`): memory holds as many
pieces (4 MiB each, ``records.REMOTE_PIECE_BYTES``; and the storage library's buffers for them) per scanning
thread."""
COALESCE_BYTES = 8 << 20
"""The largest ranged read that coalesces small tensors (:meth:`RemoteFiles.prefetched`)."""
COALESCE_GAP = 64 << 10
"""Bytes between two small tensors that one ranged read fetches rather than make two requests."""
_SAFETENSORS_HEADER_LIMIT = 100_000_000
TORCH_EXTENSIONS = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle", ".tar")


class RemoteError(OSError):
    """A URL that cannot be read: unknown protocol, missing library, unsupported layout, too much metadata."""


def is_url(path: str) -> bool:
    """Whether ``path`` names a remote object (``scheme://``, other than ``file://``)."""
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.isidentifier() and scheme.lower() != "file" and len(scheme) > 1


def local_path(path: str) -> str:
    """``file:///x`` -> ``/x``; anything else unchanged."""
    return path[len("file://"):] if path.lower().startswith("file://") else path


@dataclass(frozen=True, slots=True)
class _Remote:
    fs: Any
    path: str
    size: int


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

    def add(self, local: str, fs: Any, path: str, size: int) -> None:
        self._files[local] = _Remote(fs, path, size)

    def __contains__(self, local: object) -> bool:
        return local in self._files

    def read_into(self, local: str, buf: memoryview, offset: int) -> int:
        """Fill ``buf`` with the remote bytes at ``offset`` of the file behind ``local``; the count read. Served
        from a block :meth:`prefetched` fetched when one holds the whole range, else one ranged read."""
        r = self._files[local]
        end = min(r.size, offset + len(buf))
        if end <= offset:
            return 0
        for start, data in self._blocks.get(local, ()):  # a handful per scanning thread
            if start <= offset and end <= start + len(data):
                buf[: end - offset] = data[offset - start : end - start]
                return end - offset
        got = self._get(r, offset, end)
        buf[: len(got)] = got
        return len(got)

    @staticmethod
    def _get(r: _Remote, start: int, end: int) -> bytes:
        try:
            data: bytes = r.fs.cat_file(r.path, start=start, end=end)
        except OSError:
            raise
        except Exception as exc:  # noqa: BLE001 - the scan reports OSError as unreadable data, with this text
            raise OSError(f"ranged read of {r.path} at {start}: {type(exc).__name__}: {exc}") from None
        return data

    def read_ahead(self, local: str, start: int, length: int, piece: int) -> Iterator[bytes]:
        """The remote bytes ``[start, start+length)`` of the file behind ``local``, in order, ``piece`` bytes at a
        time (a short one means the object ended early), fetched :data:`READ_AHEAD` ranged reads at a time,
        issued together (``cat_ranges``: concurrent requests): a large tensor streams at the store's parallel
        throughput rather than one round trip per piece, memory bounded by those pieces. The order (and so a
        tensor's hash) is the sequential one."""
        r = self._files[local]
        end = min(r.size, start + length)
        offsets = range(start, end, piece)
        for k in range(0, len(offsets), READ_AHEAD):
            yield from _cat_ranges(r, [(o, min(end, o + piece)) for o in offsets[k : k + READ_AHEAD]])

    @contextmanager
    def prefetched(self, ranges: Iterable[tuple[str, int, int]]) -> Iterator[int]:
        """Within the block, :meth:`read_into` serves the ranges ``(local, offset, length)`` (small tensors) from
        memory: they are fetched first, coalesced into ranged reads of at most :data:`COALESCE_BYTES` that span
        gaps of at most :data:`COALESCE_GAP` (a DCP item's archive headers between two tensors), concurrently.
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
                datas = _cat_ranges(r, [(s, e) for s, e in merged if e > s])
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

        shutil.rmtree(self.root, ignore_errors=True)


def _cat_ranges(r: _Remote, spans: list[tuple[int, int]]) -> list[bytes]:
    """The remote bytes of each ``(start, end)`` span of ``r``, fetched concurrently (``cat_ranges``), checked."""
    if not spans:
        return []
    try:
        datas = r.fs.cat_ranges([r.path] * len(spans), [s for s, _ in spans], [e for _, e in spans])
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - as read_into: an unreadable tensor, with the storage library's words
        raise OSError(f"ranged reads of {r.path}: {type(exc).__name__}: {exc}") from None
    out = []
    for (s, _), data in zip(spans, datas, strict=True):
        if isinstance(data, BaseException):
            raise OSError(f"ranged read of {r.path} at {s}: {type(data).__name__}: {data}")
        out.append(bytes(data))
    return out


def _fs(url: str) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError:
        raise RemoteError(f"{url}: reading URLs needs fsspec (pip install fsspec s3fs/gcsfs)") from None
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:
        raise RemoteError(f"{url}: {exc}") from None
    return fs, path


_FILL_PIECE = 8 << 20


def _fill(remote: _Remote, local: str, start: int, length: int) -> None:
    """Copy the remote bytes ``[start, start+length)`` (clipped to the file) into the stand-in, 8 MiB at a time
    (memory holds one piece, whatever the span: a strided view's, a DCP shard's)."""
    end = min(remote.size, start + length)
    with open(local, "r+b") as fh:
        for pos in range(start, end, _FILL_PIECE):
            data: bytes = remote.fs.cat_file(remote.path, start=pos, end=min(end, pos + _FILL_PIECE))
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

    Raises ``FileNotFoundError`` when nothing is at ``url``, :class:`RemoteError` when it cannot be staged.
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
    try:
        base = _safe_name(os.path.basename(root.rstrip("/"))) or "checkpoint"
        if info.get("type") == "directory":
            local_root = os.path.join(tmp, base)
            _stage_dir(fs, root, url, local_root, remote, budget, nested=True)
            return local_root, remote
        local = os.path.join(tmp, base)
        _stage_file(fs, root, int(info.get("size") or 0), local, remote, budget)
        return local, remote
    except BaseException:
        remote.close()
        raise


def _stage_dir(fs: Any, root: str, url: str, local_root: str, remote: RemoteFiles, budget: _Budget, *,
               nested: bool) -> None:
    """Stage the prefix ``root`` into the new directory ``local_root``: its files, and when ``nested`` its
    sub-prefixes one level down (a DCP sub-prefix staged like a DCP directory, any other left empty: in a local
    directory the readers open nothing else below the top level either)."""
    os.mkdir(local_root)
    entries = fs.ls(root, detail=True)
    if len(entries) > MAX_FILES:
        raise RemoteError(f"{url}: more than {MAX_FILES} objects under the prefix")
    names = {os.path.basename(str(e["name"]).rstrip("/")): e for e in entries}
    dcp = ".metadata" in names or any(n.endswith(".distcp") for n in names)
    if not nested and not dcp:
        return  # the readers look one level down for DCP directories only
    files: dict[str, tuple[str, int, str]] = {}
    for name, entry in sorted(names.items()):
        safe = _safe_name(name)
        if safe is None:
            continue  # odd names are not part of a checkpoint directory
        local = os.path.join(local_root, safe)
        if entry.get("type") == "directory":
            if nested:
                _stage_dir(fs, str(entry["name"]), f"{url.rstrip('/')}/{safe}", local, remote, budget, nested=False)
            continue
        if entry.get("type") != "file":
            continue
        size = int(entry.get("size") or 0)
        files[safe] = (str(entry["name"]), size, local)
        _stage_file(fs, str(entry["name"]), size, local, remote, budget)
    if dcp:
        from ckptaudit.formats.remote_dcp import stage_dcp

        stage_dcp(files, lambda path, size: _Remote(fs, path, size), budget.take)


def _safe_name(name: str) -> str | None:
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        return None
    return name


def _stage_file(fs: Any, path: str, size: int, local: str, remote: RemoteFiles, budget: _Budget) -> None:
    with open(local, "wb") as fh:
        fh.truncate(size)  # sparse: holds no disk blocks until written
    r = _Remote(fs, path, size)
    remote.add(local, fs, path, size)
    lower = local.lower()
    if size == 0:
        return
    if lower.endswith(".safetensors"):
        head = fs.cat_file(path, start=0, end=min(size, 8))
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        n = min(n, _SAFETENSORS_HEADER_LIMIT, size - len(head))
        budget.take(8 + n)
        _fill(r, local, 0, 8 + n)
        return
    if lower.endswith(".json"):
        budget.take(size)
        _fill(r, local, 0, size)
        return
    if not lower.endswith(TORCH_EXTENSIONS):
        return  # not a file the readers open
    head = fs.cat_file(path, start=0, end=min(size, 4))
    if head != b"PK\x03\x04":  # a plain or legacy pickle: the readers parse all of it
        budget.take(size)
        _fill(r, local, 0, size)
        return
    _stage_zip(r, local, budget)


def _stage_zip(r: _Remote, local: str, budget: _Budget) -> None:
    """Stage a zip archive's end records, central directory, every local header and every small member."""
    import zipfile

    with r.fs.open(r.path, "rb", block_size=1 << 20, cache_type="readahead") as fh:
        try:
            zf = zipfile.ZipFile(fh)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error):
            # Not a readable zip: stage it whole if small, so the readers report what is wrong with it.
            if r.size <= MAX_MEMBER_BYTES:
                budget.take(r.size)
                _fill(r, local, 0, r.size)
            return
        infos = zf.infolist()
        start_dir = getattr(zf, "start_dir", None)
        zf.close()
    # The central directory and end records: from the first central header to the end of the file.
    if start_dir is None or not 0 <= start_dir <= r.size:
        start_dir = min((i.header_offset for i in infos), default=r.size)
    budget.take(r.size - start_dir)
    _fill(r, local, start_dir, r.size - start_dir)
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
    budget.take(sum(g for _, g, _ in plan))
    more: list[tuple[int, int]] = []
    for (off, _, member), got in zip(plan, _fill_many(r, local, [(o, g) for o, g, _ in plan]), strict=True):
        if len(got) < 30:
            continue
        n, m = struct.unpack("<HH", got[26:30])
        need = 30 + n + m + member
        if need > len(got):
            more.append((off + len(got), need - len(got)))
    budget.take(sum(n for _, n in more))
    _fill_many(r, local, more)


def _fill_many(r: _Remote, local: str, ranges: list[tuple[int, int]]) -> list[bytes]:
    """:func:`_fill` for many ranges at once (``cat_ranges``: concurrent requests where the filesystem can)."""
    spans = [(o, min(r.size, o + n)) for o, n in ranges]
    if not spans:
        return []
    out: list[bytes] = []
    batch = 1024
    with open(local, "r+b") as fh:
        for k in range(0, len(spans), batch):
            part = spans[k : k + batch]
            datas = r.fs.cat_ranges([r.path] * len(part), [s for s, _ in part], [e for _, e in part])
            for (s, e), data in zip(part, datas, strict=True):
                if isinstance(data, BaseException):
                    raise data
                if e > s:
                    fh.seek(s)
                    fh.write(data)
                out.append(bytes(data) if e > s else b"")
    return out


# --------------------------------------------------------------------------------------------------------------
# The ranks of a distributed audit other than rank 0 (ckptaudit.distaudit): rank 0 stages and vets the checkpoint;
# the others are sent their share and read only its data files, and check their own view of the vetted files.


def _share_base(url: str, single_file: bool) -> tuple[Any, str]:
    """The filesystem and the remote prefix a share's file names are relative to."""
    fs, root = _fs(url)
    root = root.rstrip("/")
    return fs, (root.rsplit("/", 1)[0] if single_file and "/" in root else root)


def share_view(url: str, names: list[str], *, digest: set[str],
               single_file: bool) -> dict[str, tuple[int, str | None] | str]:
    """This rank's view of the files ``names`` of the checkpoint at ``url`` (names relative to it, or to the prefix
    holding it when ``single_file``): each file's size and, for those in ``digest``, the xxh3-128 (hex) of its
    bytes, read in 8 MiB ranges; or why it cannot be read. One listing per prefix, made afresh (no cached listing
    answers for the object store)."""
    import xxhash

    fs, base = _share_base(url, single_file)
    listed: dict[str, dict[str, int]] = {}
    out: dict[str, tuple[int, str | None] | str] = {}
    for name in names:
        folder, _, leaf = f"{base}/{name}".rpartition("/")
        if folder not in listed:
            try:
                fs.invalidate_cache(folder)
                listed[folder] = {str(e["name"]).rstrip("/").rpartition("/")[2]: int(e.get("size") or 0)
                                  for e in fs.ls(folder, detail=True) if e.get("type") == "file"}
            except FileNotFoundError:
                listed[folder] = {}
            except Exception as exc:  # noqa: BLE001 - the storage library's own words, as for stage()
                listed[folder] = {}
                out[name] = f"cannot be listed ({type(exc).__name__}: {exc})"
                continue
        size = listed[folder].get(leaf)
        if size is None:
            out.setdefault(name, "cannot be read (no such object)")
            continue
        if name not in digest:
            out[name] = (size, None)
            continue
        h = xxhash.xxh3_128()
        try:
            for pos in range(0, size, _FILL_PIECE):
                h.update(fs.cat_file(f"{base}/{name}", start=pos, end=min(size, pos + _FILL_PIECE)))
        except Exception as exc:  # noqa: BLE001 - reported as this rank's view of the file
            out[name] = f"cannot be read ({type(exc).__name__}: {exc})"
            continue
        out[name] = (size, h.hexdigest())
    return out


def share_stand_in(url: str, files: dict[str, int], *, single_file: bool) -> tuple[str, RemoteFiles]:
    """A bare stand-in for the data files of one rank's share of a distributed audit of ``url``: sparse files of
    the sizes rank 0 saw, named as the share names them, each mapped to its object. Nothing is staged (the rank
    parses no metadata); tensor data streams by ranged reads as for :func:`stage`. Returns the directory the
    names are relative to and the :class:`RemoteFiles`, whose ``close`` removes it."""
    import tempfile

    fs, base = _share_base(url, single_file)
    tmp = tempfile.mkdtemp(prefix="ckptaudit-share-")
    remote = RemoteFiles(tmp)
    try:
        for name, size in files.items():
            parts = name.split("/")
            if any(_safe_name(p) is None for p in parts):
                raise RemoteError(f"{url}: the share names a file {name!r} that is not a plain relative path")
            local = os.path.join(tmp, *parts)
            os.makedirs(os.path.dirname(local), exist_ok=True)
            with open(local, "wb") as fh:
                fh.truncate(size)
            remote.add(local, fs, f"{base}/{name}", size)
        return tmp, remote
    except BaseException:
        remote.close()
        raise
