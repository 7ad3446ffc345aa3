"""``torch.save`` zip archives, read without ``torch.load``: the object tree with lazy tensors.

A ``torch.save`` file is a zip of ``<name>/data.pkl`` (the object tree, a pickle) and one stored
(uncompressed) member ``<name>/data/<key>`` per storage. Every item of a ``.distcp`` file of
``torch.distributed.checkpoint`` is the same kind of archive, at an offset inside the file, so this reader
works on a byte region of a file.

The pickle is scanned first (:func:`ckptaudit.formats.pickle_scan.scan`); only a pickle whose every global is
allowed is unpickled, through a restricted unpickler that turns each tensor into a :class:`TensorData`
pointing into the file. Storage sizes and tensor views are checked against the archive before anything is
described, so a hostile header cannot make us allocate or read past the file: ``data.pkl`` must declare at
most :data:`MAX_PICKLE_BYTES` (checked before it is inflated, and inflation stops at the declared size), every
storage must be stored uncompressed inside the archive, and the tensors of one archive may together address
at most a few times the archive's bytes (overlapping views cannot turn a small file into an endless scan).

:class:`TorchZipFile` opens a file once for many archives (the items of a ``.distcp`` file; the restricted
unpickler's tensor table is :mod:`ckptaudit.formats.tensor_rebuild`). An archive whose structure equals one
read in full before, CRCs and data aside (:mod:`ckptaudit.formats.ziplayout`), is compared with it instead of
being parsed again; its pickle is scanned and loaded once per distinct pickle (memoised by its bytes).
"""

from __future__ import annotations

import io
import itertools
import os
import pickle
import struct
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptaudit.formats import ziplayout
from ckptaudit.formats.object_tree import check_tree
from ckptaudit.formats.pickle_scan import PickleLimitError, PickleScan, opcode_limit, scan
from ckptaudit.formats.safeio import open_regular, open_regular_fd
from ckptaudit.formats.tensor_rebuild import VIEW_BUDGET_FACTOR, StorageRef, StorageType, ViewBudget, torch_table
from ckptaudit.formats.tensors import DType, Piece, TensorData
from ckptaudit.formats.unpickler import RestrictedUnpickler
from ckptaudit.formats.zipdir import HEAD_BYTES, TAIL_BYTES, Member, Region, lean_directory

__all__ = ["TorchZip", "TorchZipError", "TorchZipFile", "TorchZipFiles", "is_zip", "read_torch_zip"]

MAX_PICKLE_BYTES = 256 << 20
"""A ``data.pkl`` larger than this is refused: object trees of real checkpoints are far smaller."""


class TorchZipError(Exception):
    """The archive is not a readable ``torch.save`` zip; ``offset`` is the absolute byte offset if known;
    ``limit`` says the archive exceeds a safety limit rather than being malformed."""

    def __init__(self, message: str, offset: int | None = None, *, limit: bool = False) -> None:
        super().__init__(message)
        self.offset = offset
        self.limit = limit


@dataclass(frozen=True, slots=True)
class TorchZip:
    """One archive: its pickle scan and, when the scan allowed loading, the object tree."""

    scan: PickleScan
    obj: Any
    """The unpickled tree (dicts, lists, numbers, strings, :class:`TensorData` leaves); ``None`` if not loaded."""
    loaded: bool


class _Region(io.RawIOBase):
    """A read-only, seekable view of ``[start, start+length)`` of an open file."""

    def __init__(self, fh: Any, start: int, length: int) -> None:
        self._fh, self._start, self._len, self._pos = fh, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        # Never allocate a buffer of a declared size: read only what the region holds.
        left = max(0, self._len - self._pos)
        n = left if n is None or n < 0 else min(n, left)
        if n == 0:
            return b""
        self._fh.seek(self._start + self._pos)
        data = self._fh.read(n)
        self._pos += len(data)
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, b: Any) -> int:
        n = min(len(b), self._len - self._pos)
        if n <= 0:
            return 0
        self._fh.seek(self._start + self._pos)
        data = self._fh.read(n)
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)


MAX_ZIP_ENTRIES = 1_000_000
"""Most members of one archive (``torch.save`` writes one per storage, plus three)."""
_LOCAL_HEADER = 30
"""Bytes of a zip local file header before its name: every member takes at least this much before the central
directory."""


def _check_directory_size(fh: Any, offset: int, length: int) -> None:
    """Refuse an archive whose central directory lists more members than the bytes before it can hold (entries
    sharing one local header: 2M entries would be read as valid at 1.2 GiB), from the end records alone."""
    tail_len = min(length, 22 + 0xFFFF)
    fh.seek(offset + length - tail_len)
    tail = fh.read(tail_len)

    def read_at(at: int, n: int) -> bytes:
        fh.seek(offset + at)
        return bytes(fh.read(n))

    _directory_size_problem(tail, length, offset, read_at)


def _directory_size_problem(tail: bytes, length: int, offset: int, read_at: Any) -> None:
    """:func:`_check_directory_size` on the archive's last bytes ``tail`` (all of them, or at least up to the last
    end-record signature); ``read_at(relative offset, n)`` reads the zip64 record."""
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + 22 > len(tail):
        return  # no end record: zipfile says what is wrong
    entries, _size, cd_offset = struct.unpack_from("<10xHLL", tail, at)
    locator = at - 20
    if (entries == 0xFFFF or cd_offset == 0xFFFFFFFF) and locator >= 0 and tail[locator:locator + 4] == b"PK\x06\x07":
        (z64_at,) = struct.unpack_from("<8xQ", tail, locator)
        if 0 <= z64_at <= length - 56:
            rec = read_at(z64_at, 56)
            if rec[:4] == b"PK\x06\x06":
                entries, _size, cd_offset = struct.unpack_from("<32xQQQ", rec)
    if entries > MAX_ZIP_ENTRIES:
        raise TorchZipError(f"zip central directory lists {entries} members, more than the reader's limit of "
                            f"{MAX_ZIP_ENTRIES}", offset, limit=True)
    if entries * _LOCAL_HEADER > cd_offset:
        raise TorchZipError(f"zip central directory lists {entries} members, but only {cd_offset} bytes precede it "
                            f"(each member's local header takes at least {_LOCAL_HEADER}): members share local "
                            "headers", offset)


def _check_local_headers(infos: list[Member], offset: int) -> None:
    """Central entries and local headers agree one to one: each entry's local header, name and data fit before
    the next entry's header."""
    ordered = sorted(infos, key=lambda i: i.header_offset)
    for cur, nxt in itertools.pairwise(ordered):
        end = cur.header_offset + _LOCAL_HEADER + len(cur.filename.encode("utf-8", "surrogateescape")) \
            + cur.compress_size
        if nxt.header_offset < end:
            raise TorchZipError(f"zip members {cur.filename!r} and {nxt.filename!r} share bytes (local header at "
                                f"{nxt.header_offset}, inside the member before it)", offset + nxt.header_offset)


def is_zip(path: str, offset: int = 0) -> bool:
    with open_regular(path) as fh:
        fh.seek(offset)
        return fh.read(4) == b"PK\x03\x04"


_SCAN_CACHE: dict[bytes, PickleScan] = {}


def _scan_cached(data: bytes) -> PickleScan:
    """:func:`scan`, memoised on the pickle's bytes: every DCP item of a given shape carries the same small
    ``data.pkl``, and a checkpoint has thousands of items but few distinct shapes."""
    hit = _SCAN_CACHE.get(data)
    if hit is None:
        hit = scan(data, max_opcodes=opcode_limit(len(data)))
        if len(data) <= 4096:
            if len(_SCAN_CACHE) >= 4096:
                _SCAN_CACHE.clear()
            _SCAN_CACHE[data] = hit
    return hit


def _local_data_offset(region: Region, info: Member) -> int:
    """Absolute offset of a member's data (after its local header), checked to lie inside the region."""
    if not 0 <= info.header_offset <= region.length - 30:
        raise TorchZipError(f"{info.filename}: local header offset {info.header_offset} is outside the archive",
                            region.start)
    header_at = region.start + info.header_offset
    header = region.read_at(header_at, 30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise TorchZipError(f"bad local header for {info.filename}", header_at)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return header_at + 30 + name_len + extra_len


def _read_member(region: Region, info: Member, limit: int) -> bytes:
    """A small member's bytes, read by us rather than by ``zipfile``: sizes are checked against the region
    and ``limit`` before anything is read or inflated, inflation stops at the declared size, and the CRC-32
    must match."""
    if info.file_size > limit:
        raise TorchZipError(f"{info.filename} declares {info.file_size} bytes, more than the reader's safety "
                            f"limit of {limit}", region.start, limit=True)
    start = _local_data_offset(region, info)
    if start + info.compress_size > region.start + region.length:
        raise TorchZipError(f"{info.filename} declares {info.compress_size} bytes at offset {start}, past the end "
                            f"of the archive", start)
    if info.compress_type == zipfile.ZIP_STORED:
        if info.compress_size != info.file_size:
            raise TorchZipError(f"{info.filename}: stored member with two different sizes", start)
        data = region.read_at(start, info.file_size)
    elif info.compress_type == zipfile.ZIP_DEFLATED:
        if info.compress_size > limit:
            raise TorchZipError(f"{info.filename} is {info.compress_size} bytes compressed, over the limit",
                                start, limit=True)
        inflater = zlib.decompressobj(-15)
        try:
            data = inflater.decompress(region.read_at(start, info.compress_size), info.file_size + 1)
        except zlib.error as exc:
            raise TorchZipError(f"{info.filename}: cannot inflate ({exc})", start) from None
        if len(data) > info.file_size or inflater.unconsumed_tail:
            raise TorchZipError(f"{info.filename} inflates past its declared {info.file_size} bytes", start)
    else:
        raise TorchZipError(f"{info.filename} uses zip compression method {info.compress_type}; torch.save "
                            "writes members uncompressed", start)
    if len(data) != info.file_size:
        raise TorchZipError(f"{info.filename} is truncated ({len(data)} of {info.file_size} bytes)", start)
    if zlib.crc32(data) != info.CRC:
        raise TorchZipError(f"{info.filename}: CRC-32 mismatch (the bytes were altered)", start)
    return data


_ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError, struct.error,
               OverflowError, NotImplementedError)


def read_torch_zip(path: str, offset: int = 0, length: int | None = None, *, load: bool = True,
                   inert: bool = False) -> TorchZip:
    """Read the ``torch.save`` archive stored at ``[offset, offset+length)`` of ``path``.

    Raises :class:`TorchZipError` for anything malformed: not a zip, no ``data.pkl``, compressed storages,
    big-endian data, storages or views larger than the archive, a truncated pickle, and for archives past a
    safety limit (``limit=True``). A pickle that references globals outside the allowlist is returned
    unloaded (``loaded=False``), even when it is also truncated (``scan.error``) -- unless ``inert``: then its
    outside globals become :class:`~ckptaudit.formats.unpickler.Opaque` records (nothing is imported or run) and the
    rest of the tree, tensors included, is returned (``loaded=True``; ``scan.unsafe`` still names them). An inert
    load that fails for any reason falls back to unloaded. Many archives of one file (the items of a ``.distcp``
    file): :class:`TorchZipFile`, which opens the file once.
    """
    with TorchZipFile(path) as archives:
        return archives.read(offset, length, load=load, inert=inert)


WHOLE_BYTES = HEAD_BYTES + TAIL_BYTES
"""An archive of at most this many bytes (most DCP items) is read with one ``pread``; a longer one, its first
:data:`~ckptaudit.formats.zipdir.HEAD_BYTES` and last :data:`~ckptaudit.formats.zipdir.TAIL_BYTES` (then what
its directory says)."""


class TorchZipFile:
    """One regular file holding ``torch.save`` archives (a ``torch.save`` file, or a ``.distcp`` file holding one
    per DCP item), opened, checked to be a regular file and sized once; :meth:`read` reads one archive, as
    :func:`read_torch_zip` does. Runs in the caller's thread; one instance is not shared between threads.

    An archive whose structure matches one already read in full (:mod:`ckptaudit.formats.ziplayout`: DCP items of
    one shape differ only in CRCs and data) and whose pickle was scanned and loaded before is checked against that
    layout and rebound to its own bytes; anything else, and anything that does not match, is read in full.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd, self.size = open_regular_fd(path)
        self._fh: Any = None  # a file object over the descriptor, for zipfile, made only where it is needed
        self._abspath = os.path.abspath(path)

    def close(self) -> None:
        if self._fd < 0:
            return
        if self._fh is not None:
            self._fh.close()  # closefd=False: the descriptor is closed below
        os.close(self._fd)
        self._fd = -1

    def _file(self) -> Any:
        if self._fh is None:
            self._fh = os.fdopen(self._fd, "rb", closefd=False)
        return self._fh

    def __enter__(self) -> TorchZipFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self, offset: int = 0, length: int | None = None, *, load: bool = True,
             inert: bool = False) -> TorchZip:
        """The archive at ``[offset, offset+length)`` (to the file's end without ``length``); see
        :func:`read_torch_zip`."""
        if length is None:
            length = self.size - offset
        if offset < 0 or length < 0 or offset + length > self.size:
            raise TorchZipError(
                f"archive at offset {offset} with length {length} exceeds the file ({self.size} bytes)", offset
            )
        fd = self._fd
        if length <= WHOLE_BYTES:
            head = os.pread(fd, length, offset)
            complete = len(head) == length
            tail = head if length <= TAIL_BYTES else head[length - TAIL_BYTES:]
        else:
            head = os.pread(fd, HEAD_BYTES, offset)
            tail = os.pread(fd, TAIL_BYTES, offset + length - TAIL_BYTES)
            complete = len(head) == HEAD_BYTES and len(tail) == TAIL_BYTES
        if complete:
            hit = ziplayout.match(length, head, tail)
            if hit is not None:
                known = _from_layout(hit, self._abspath, offset, length, load)
                if known is not None:
                    return known
        else:  # the file shrank under us: the full read says what is missing
            head = None  # type: ignore[assignment]
            tail = Region(fd, offset, length).read_at(offset + length - min(length, TAIL_BYTES), TAIL_BYTES)
        return _read_full(fd, self._file, self._abspath, offset, length, head, tail, load, inert)


class TorchZipFiles:
    """The data files of one DCP read, each opened once as a :class:`TorchZipFile` (at most :data:`MAX_OPEN` at
    a time: the least recently opened is closed first). Runs in the caller's thread."""

    MAX_OPEN = 64

    def __init__(self) -> None:
        self._open: dict[str, TorchZipFile] = {}

    def read(self, path: str, offset: int, length: int, *, load: bool = True) -> TorchZip:
        """:meth:`TorchZipFile.read` of the archive at ``[offset, offset+length)`` of ``path``; raises what
        :func:`read_torch_zip` raises (``OSError`` where the file cannot be opened)."""
        archives = self._open.get(path)
        if archives is None:
            if len(self._open) >= self.MAX_OPEN:
                self._open.pop(next(iter(self._open))).close()
            archives = self._open[path] = TorchZipFile(path)
        return archives.read(offset, length, load=load)

    def close(self) -> None:
        for archives in self._open.values():
            archives.close()
        self._open.clear()

    def __enter__(self) -> TorchZipFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _from_layout(hit: ziplayout.Matched, path: str, offset: int, length: int, load: bool) -> TorchZip | None:
    """The archive that matched a learnt layout, from the memoised scan and load of its (CRC-checked) pickle;
    ``None`` where either is not memoised, the pickle is not loadable, or its storages or views do not fit this
    archive (then the full read decides)."""
    result = _SCAN_CACHE.get(hit.pkl)
    if result is None or not result.loadable:
        return None
    if not load:
        return TorchZip(result, None, False)
    cached = _LOAD_CACHE.get(hit.pkl)
    if cached is None:
        return None
    tree, used, nbytes = cached
    if nbytes > VIEW_BUDGET_FACTOR * length + (64 << 20):
        return None
    where = hit.layout.relocate(hit.pkl, used)
    if where is None:
        return None
    return TorchZip(result, _bind_file(tree, path, moved={old: offset + start for old, start in where}), True)


def _read_full(fd: int, file: Callable[[], Any], path: str, offset: int, length: int, head: bytes | None,
               tail: bytes, load: bool, inert: bool) -> TorchZip:
    """Every check on the archive at ``[offset, offset+length)`` of the open descriptor ``fd`` (``file()``: a file
    object over it, for zipfile; ``head``: the archive's first bytes where already read; ``tail``: its last
    ``min(length, TAIL_BYTES)`` bytes); learns its layout when it is the canonical one."""
    region = Region(fd, offset, length, head)
    # Before anything builds one object per central entry (an exact tail holds the last end record; where it
    # holds none, the fallback below checks the longer tail zipfile searches).
    _directory_size_problem(tail, length, offset, lambda at, n: region.read_at(offset + at, n))
    lean = lean_directory(region, tail)
    if lean is not None:
        infos = lean
    else:  # not the canonical layout: zipfile reads it, with its own errors
        raw = file()
        _check_directory_size(raw, offset, length)
        try:
            with zipfile.ZipFile(_Region(raw, offset, length)) as zf:  # type: ignore[arg-type]
                infos = [Member(i.filename, i.header_offset, i.compress_size, i.file_size, i.compress_type,
                                i.CRC) for i in zf.infolist()]
        except _ZIP_ERRORS as exc:
            raise TorchZipError(f"not a readable zip archive ({exc})", offset) from None
    _check_local_headers(infos, offset)
    names = [i.filename for i in infos]
    if len(set(names)) != len(names):
        raise TorchZipError("zip archive names a member twice (readers could disagree on which one "
                            "counts)", offset)
    # torch.save puts every member under one top-level folder and the pickle at <folder>/data.pkl.
    pkl = [i for i in infos if i.filename.endswith("data.pkl") and i.filename.count("/") <= 1]
    if len(pkl) != 1:
        raise TorchZipError(
            "zip archive without data.pkl: not a torch.save file" if not pkl
            else f"zip archive with {len(pkl)} data.pkl members", offset)
    prefix = pkl[0].filename[: -len("data.pkl")]
    if prefix and any(not n.startswith(prefix) for n in names):
        raise TorchZipError(f"zip archive members outside the {prefix!r} folder of its data.pkl", offset)
    by_name = {i.filename: i for i in infos}
    bo = by_name.get(prefix + "byteorder")
    if bo is not None:
        order = _read_member(region, bo, 16).decode("ascii", "replace").strip()
        if order != "little":
            raise TorchZipError(f"byte order {order!r} is not supported (only little-endian)", offset)
    data = _read_member(region, pkl[0], MAX_PICKLE_BYTES)
    result = _scan_cached(data)
    outside = bool(result.unsafe or result.harmless)
    if outside and (not inert or not load or result.error is not None):
        return TorchZip(result, None, False)
    if result.error is not None:
        raise TorchZipError(f"data.pkl: {result.error} (pickle byte {result.error_offset})", offset,
                            limit=result.limit)
    if lean is not None and not outside and head is not None:
        # Every structural check passed: archives of this layout need only be compared with it.
        ziplayout.learn(length, head, tail, lean, prefix)
    if not load:
        return TorchZip(result, None, False)
    budget = ViewBudget(length)

    def locate(key: str, dtype: DType, numel: int) -> int:
        """The absolute offset of storage ``key``, checked against the archive."""
        info = by_name.get(f"{prefix}data/{key}")
        if info is None:
            raise pickle.UnpicklingError(f"storage {key!r} is missing from the archive")
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise pickle.UnpicklingError(f"storage {key!r} is compressed; torch.save never does that")
        nbytes = numel * dtype.itemsize
        if nbytes > info.file_size:
            raise pickle.UnpicklingError(
                f"storage {key!r} declares {numel} {dtype.name} elements, "
                f"the archive holds {info.file_size} bytes"
            )
        start = _local_data_offset(region, info)
        if start + nbytes > offset + length:
            raise pickle.UnpicklingError(f"storage {key!r} runs past the end of the archive")
        return start

    storages: dict[str, tuple[DType, int, int]] = {}

    def persistent_load(pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        _, stype, key, _location, numel = pid
        if not isinstance(stype, StorageType) or type(numel) is not int or numel < 0 or \
                not isinstance(key, str):
            raise pickle.UnpicklingError(f"bad storage reference {pid!r}")
        start = locate(key, stype.dtype, numel)
        storages[key] = (stype.dtype, numel, start)
        return StorageRef(stype.dtype, start, numel)

    cached = None if outside else _LOAD_CACHE.get(data)
    if cached is not None:
        # The same small pickle seen in an earlier archive (every DCP item of one shape): reuse its tree,
        # with each storage located, and checked, in this archive.
        template, used, nbytes = cached
        try:
            moved = {old: locate(key, dtype, numel) for key, (dtype, numel, old) in used.items()}
        except pickle.UnpicklingError as exc:
            raise TorchZipError(f"data.pkl: {exc}", offset) from None
        if nbytes > VIEW_BUDGET_FACTOR * length + (64 << 20):
            raise TorchZipError("data.pkl: the archive's tensors address more than "
                                f"{VIEW_BUDGET_FACTOR}x its bytes", offset, limit=True)
        return TorchZip(result, _bind_file(template, path, moved=moved), True)

    try:
        obj = RestrictedUnpickler(io.BytesIO(data), torch_table(budget), persistent_load,
                                  inert=outside).load()
        problem = check_tree(obj)
        if problem is not None:
            raise PickleLimitError(problem)
        if _tensor_bytes(obj) > VIEW_BUDGET_FACTOR * length + (64 << 20):
            raise PickleLimitError(
                f"the archive's tensors address more than {VIEW_BUDGET_FACTOR}x its bytes (the same tensor "
                "referenced over and over)")
    except MemoryError:
        raise
    except Exception as exc:  # anything the pickle does wrong is a corrupt archive
        if outside:  # an inert load that does not work out: report the pickle, load nothing
            return TorchZip(result, None, False)
        if isinstance(exc, TorchZipError):
            raise
        if isinstance(exc, PickleLimitError):
            raise TorchZipError(f"data.pkl: {exc}", offset, limit=True) from None
        raise TorchZipError(f"data.pkl: {exc}", offset) from None
    if not outside and len(data) <= _LOAD_CACHE_MAX_PICKLE and _is_plain_tree(obj):
        if len(_LOAD_CACHE) >= _LOAD_CACHE_ENTRIES:
            _LOAD_CACHE.clear()
        _LOAD_CACHE[data] = (obj, dict(storages), _tensor_bytes(obj))
    return TorchZip(result, _bind_file(obj, path), True)


_LOAD_CACHE: dict[bytes, tuple[Any, dict[str, tuple[DType, int, int]], int]] = {}
"""Small ``data.pkl`` -> (its loaded tree, the storages it used, its tensors' bytes): DCP writes one small archive
per item, and items of one shape and dtype carry byte-identical pickles."""
_LOAD_CACHE_MAX_PICKLE = 4096
_LOAD_CACHE_ENTRIES = 4096


def _is_plain_tree(obj: Any) -> bool:
    """Whether a loaded tree holds only immutable leaves and containers the binder copies (so it can be reused)."""
    todo = [obj]
    while todo:
        v = todo.pop()
        if isinstance(v, dict):
            todo.extend(dict.values(v))
        elif isinstance(v, list | tuple):
            todo.extend(v)
        elif not isinstance(v, TensorData | str | bytes | int | float | bool | type(None)):
            return False
    return True


def _bind_file(obj: Any, path: str, memo: dict[int, Any] | None = None, *,
               moved: dict[int, int] | None = None) -> Any:
    """Fill in the file of every tensor piece (the unpickler does not know it), and with ``moved`` (old storage
    offset -> new) relocate the pieces of a cached tree into another archive. Objects the pickle shares (tied
    weights, memo references) stay shared, so each is scanned once."""
    if memo is None:
        if type(obj) is TensorData:  # the whole tree of a DCP tensor item
            return TensorData(obj.dtype, obj.shape, tuple(_with_file(p, path, moved) for p in obj.pieces))
        memo = {}
    done = memo.get(id(obj))
    if done is not None:
        return done
    if isinstance(obj, TensorData):
        pieces = tuple(_with_file(p, path, moved) for p in obj.pieces)
        out: Any = TensorData(obj.dtype, obj.shape, pieces)
    elif isinstance(obj, dict):
        items = [(k, _bind_file(v, path, memo, moved=moved)) for k, v in dict.items(obj)]
        out = type(obj)(items) if type(obj) is not dict else dict(items)
    elif isinstance(obj, list):
        out = [_bind_file(v, path, memo, moved=moved) for v in obj]
    elif isinstance(obj, tuple):
        out = tuple(_bind_file(v, path, memo, moved=moved) for v in obj)
    else:
        return obj
    memo[id(obj)] = out
    return out


def _tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor leaf, counted once per path that reaches it (what a walk of the tree scans).
    The tree is bounded by :func:`check_tree` first."""
    total, todo = 0, [obj]
    while todo:
        value = todo.pop()
        if isinstance(value, TensorData):
            total += value.nbytes
        elif isinstance(value, dict):
            todo.extend(dict.values(value))  # the data, never a method the pickle could shadow
        elif isinstance(value, list | tuple):
            todo.extend(value)
    return total


def _with_file(p: Piece, path: str, moved: dict[int, int] | None = None) -> Piece:
    start = p.data_offset if moved is None else moved[p.data_offset]
    return Piece(path, start, p.storage_offset, p.sizes, p.stride, p.offsets)
