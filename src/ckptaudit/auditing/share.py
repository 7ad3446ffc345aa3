"""A rank's share of a distributed audit, as plain data: what rank 0 sends each rank after vetting the checkpoint.

Rank 0 opens and interprets the checkpoint once (:func:`ckptaudit.auditing.plan.plan_scan`: the readers' hostile-input
rules, the DCP ``.metadata`` walked and loaded once); every other rank is sent only its share
(:func:`encode_share`, JSON, never pickle) and reads nothing of the metadata but to check it:

- for each of its tensors: the index in the plan, dtype, shape, whether its one value is a step counter, and
  each piece (file, byte offset, storage offset, sizes, strides, offsets in the tensor): bytes linear in the
  pieces it will read;
- the files to check (:class:`VettedFile`): every file rank 0 parsed whole as metadata (DCP ``.metadata``) with
  the size and xxh3-128 of the bytes it parsed, and every data file of the share with its size; each with the
  version rank 0 read (:class:`~ckptaudit.formats.io.safeio.FileId`: device, inode, size, ``mtime_ns``; a rank on
  another host compares size and ``mtime_ns`` only), which the rank's view check and every open of its scan
  must find again.

Files are named relative to the checkpoint's root (its directory; for a one-file checkpoint, the directory
holding it), so a rank resolves them against its own path (:func:`share_datas`) and checks its own view of them
(:func:`view_problems`) before it reads any tensor data: a file that changed since rank 0 vetted it (or a rank
that sees other files at this path) is reported, not scanned.
"""

from __future__ import annotations

import functools
import json
import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from ckptaudit.auditing.plan import ScanPlan
from ckptaudit.formats.io.safeio import FileId, FileIds, open_regular_fd
from ckptaudit.formats.io.tensors import DTYPES, Piece, TensorData

__all__ = ["SHARE_FORMAT", "RawShare", "VettedFile", "checkpoint_root", "decode_share", "encode_error",
           "encode_share", "file_digest", "host_key", "is_single_file", "share_datas", "share_ids",
           "vetted_file_problems", "vetted_files", "view_problems"]

SHARE_FORMAT = 3
"""Version of the share's encoding (every rank runs the same ckptaudit; a mismatch is an error, not a guess)."""
_READ_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class VettedFile:
    """A file as rank 0 read it: its name (relative to the checkpoint's root), size and, for a file parsed whole
    as metadata, the xxh3-128 (hex) of its bytes; behind a URL, the ETag rank 0 pinned it to (if the store gave
    one), so that another rank reads the same object or says it cannot."""

    name: str
    size: int
    digest: str | None = None
    etag: str | None = None
    version: FileId | None = None
    """The version rank 0 read (a local file; ``None`` behind a URL, where the ETag pins it)."""


@dataclass(frozen=True, slots=True)
class RawShare:
    """A decoded share, its file names not yet resolved (:func:`share_datas` does that against a root)."""

    vetted: tuple[VettedFile, ...]
    single_file: bool
    """The checkpoint is one file (its root is the directory holding it)."""
    error: str = ""
    """Rank 0 could not plan the audit (it raises the error itself): nothing to scan."""
    host: str = ""
    """Rank 0's :func:`host_key`: a rank on the same host compares every part of a file's version."""
    files: tuple[str, ...] = ()
    items: tuple[Any, ...] = ()
    """``[index, dtype, shape, step, pieces]`` rows, as sent."""

    @property
    def indices(self) -> list[int]:
        return [int(row[0]) for row in self.items]

    @property
    def data_files(self) -> dict[str, int]:
        """The share's data files (name -> size rank 0 saw)."""
        named = set(self.files)
        return {v.name: v.size for v in self.vetted if v.name in named}


def checkpoint_root(read_path: str, single_file: bool) -> str:
    """The directory the share's file names are relative to: ``read_path`` itself, or the directory holding it."""
    return os.path.dirname(read_path) if single_file else read_path


def encode_share(plan: ScanPlan, indices: Sequence[int]) -> bytes:
    """(rank 0) The share of ``plan.items[i]`` for ``i`` in ``indices``, as JSON bytes."""
    ckpt = plan.ckpt
    fids: dict[str, int] = {}
    names: list[str] = []
    items: list[list[Any]] = []
    for i in indices:
        data = plan.items[i][0].data
        assert isinstance(data, TensorData)
        pieces = []
        for p in data.pieces:
            fid = fids.get(p.file)
            if fid is None:
                fid = fids[p.file] = len(names)
                names.append(ckpt.file_name(p.file))
            pieces.append([fid, p.data_offset, p.storage_offset, p.sizes, p.stride, p.offsets])
        items.append([i, data.dtype.name, data.shape, int(i in plan.step_items), pieces])
    vetted = [[v.name, v.size, v.digest, v.etag, None if v.version is None else v.version.as_list()]
              for v in _vetted(plan, fids)]
    doc = {"format": SHARE_FORMAT, "single_file": is_single_file(plan), "host": host_key(), "vetted": vetted,
           "files": names, "items": items}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def is_single_file(plan: ScanPlan) -> bool:
    """Whether the checkpoint is one file (its root is the directory holding it)."""
    return not os.path.isdir(plan.ckpt.read_path)


def vetted_files(plan: ScanPlan, indices: Sequence[int]) -> tuple[VettedFile, ...]:
    """(rank 0) The files the share of ``indices`` checks (what :func:`encode_share` sends), without encoding the
    share: what rank 0 checks of its own view."""
    files: dict[str, int] = {}
    for i in indices:
        data = plan.items[i][0].data
        assert isinstance(data, TensorData)
        for p in data.pieces:
            files.setdefault(p.file, len(files))
    return _vetted(plan, files)


def _vetted(plan: ScanPlan, files: Iterable[str]) -> tuple[VettedFile, ...]:
    ckpt = plan.ckpt
    remote = ckpt.maps.remote
    root = checkpoint_root(ckpt.read_path, is_single_file(plan))
    vetted = [VettedFile(name, size, digest, version=_version(plan, os.path.join(root, name)))
              for name, (size, digest) in ckpt.digests.items()]
    for file in files:
        name = ckpt.file_name(file)
        size = ckpt.files.get(name)
        vetted.append(VettedFile(name, size if size is not None else os.path.getsize(file),
                                 etag=None if remote is None else remote.etag(file), version=_version(plan, file)))
    return tuple(vetted)


def _version(plan: ScanPlan, path: str) -> FileId | None:
    """(rank 0) The version of the local file ``path`` its readers parsed, or (a data file no reader opened: DCP's)
    the one it has now, recorded: rank 0's own scan must find it too. ``None`` behind a URL or when unreadable."""
    ids = plan.ckpt.maps.ids
    if ids is None:
        return None
    try:
        return ids.pin(path)
    except OSError:  # the view check says it cannot be read
        return None


@functools.cache
def host_key() -> str:
    """This machine, as ranks compare it: the host name and the kernel's boot id (Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def share_ids(share: RawShare, root: str) -> FileIds:
    """(ranks other than 0) The versions rank 0 read, by this rank's paths under ``root``: what every open of this
    rank's scan must find (all of a version on rank 0's host; elsewhere its size and ``mtime_ns``)."""
    known = {os.path.join(root, v.name): v.version for v in share.vetted if v.version is not None}
    return FileIds(known, same_host=share.host == host_key())


def encode_error(message: str) -> bytes:
    """(rank 0) What every other rank is sent when rank 0 could not plan the audit."""
    return json.dumps({"format": SHARE_FORMAT, "error": message}).encode()


def decode_share(data: bytes) -> RawShare:
    """(ranks other than 0) The share sent by :func:`encode_share` (or :func:`encode_error`); raises
    ``ValueError`` when it is not one."""
    try:
        doc = json.loads(data)
        if doc.get("format") != SHARE_FORMAT:
            raise ValueError(f"share format {doc.get('format')!r}, this rank reads {SHARE_FORMAT}: every rank must "
                             "run the same ckptaudit")
        if "error" in doc:
            return RawShare((), False, error=str(doc["error"]))
        vetted = tuple(VettedFile(str(n), int(s), None if d is None else str(d), None if e is None else str(e),
                                  None if f is None else FileId(*(int(x) for x in f)))
                       for n, s, d, e, f in doc["vetted"])
        return RawShare(vetted, bool(doc["single_file"]), host=str(doc["host"]),
                        files=tuple(str(n) for n in doc["files"]), items=tuple(doc["items"]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"the share rank 0 sent is malformed ({type(exc).__name__}: {exc})") from None


def share_datas(share: RawShare, root: str) -> tuple[dict[int, TensorData], frozenset[int]]:
    """The share's tensors, their files under ``root``, and the indices of its step counters."""
    files = [os.path.join(root, n) for n in share.files]
    datas: dict[int, TensorData] = {}
    steps: set[int] = set()
    try:
        for index, dtype, shape, step, pieces in share.items:
            datas[int(index)] = TensorData(DTYPES[dtype], tuple(shape), tuple(
                Piece(files[fid], doff, soff, tuple(sizes), tuple(stride), tuple(offsets))
                for fid, doff, soff, sizes, stride, offsets in pieces))
            if step:
                steps.add(int(index))
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ValueError(f"the share rank 0 sent is malformed ({type(exc).__name__}: {exc})") from None
    return datas, frozenset(steps)


def file_digest(path: str) -> tuple[int, str]:
    """Size and xxh3-128 (hex) of the regular file ``path``, read in 8 MiB pieces (memory stays bounded)."""
    h = xxhash.xxh3_128()
    size = 0
    buf = bytearray(_READ_BYTES)
    view = memoryview(buf)
    fd, _ = open_regular_fd(path)
    try:
        while n := os.readv(fd, [buf]):
            h.update(view[:n])
            size += n
    finally:
        os.close(fd)
    return size, h.hexdigest()


def view_problems(root: str, vetted: Iterable[VettedFile], *, same_host: bool = True) -> list[tuple[str, str]]:
    """``(file, what differs)`` for each vetted file this rank sees otherwise under ``root`` (a local path):
    missing or unreadable, another size, (for a file parsed as metadata) other bytes, or another version (on
    another host, ``same_host`` false: size and ``mtime_ns`` only). Empty: the same view."""
    problems: list[tuple[str, str]] = []
    for v in vetted:
        full = os.path.join(root, v.name)
        try:
            st = os.stat(full)
            size = st.st_size
            digest = None
            if v.digest is not None and size == v.size:
                size, digest = file_digest(full)
        except OSError as exc:
            problems.append((v.name, f"cannot be read ({exc.strerror or exc})"))
            continue
        problems += vetted_file_problems(v, size, digest, version=FileId.of(st), same_host=same_host)
    return problems


def vetted_file_problems(v: VettedFile, size: int, digest: str | None, etag: str | None = None, *,
                         version: FileId | None = None, same_host: bool = True) -> list[tuple[str, str]]:
    """What differs between rank 0's reading ``v`` and this rank's (``size``, ``digest`` or ``None`` if not read,
    ``etag`` as this rank's store lists it, or ``None``; ``version``, a local file's, compared as
    :meth:`FileId.differs` does)."""
    if v.etag is not None and etag is not None and etag != v.etag:
        return [(v.name, f"is another object than rank 0 read (ETag {etag}, rank 0: {v.etag})")]
    if size != v.size:
        return [(v.name, f"has {size} bytes where rank 0 read {v.size}")]
    if v.digest is not None and digest != v.digest:
        return [(v.name, f"holds other bytes than rank 0 read (xxh3-128 {digest}, rank 0: {v.digest})")]
    why = None if v.version is None or version is None else v.version.differs(version, same_host=same_host)
    if why is not None:
        return [(v.name, f"is another version than rank 0 read ({why})")]
    return []
