"""``torch.save`` zip archives, read without ``torch.load``: the object tree with lazy tensors.

A ``torch.save`` file is a zip of ``<name>/data.pkl`` (the object tree, a pickle) and one stored
(uncompressed) member ``<name>/data/<key>`` per storage. Every item of a ``.distcp`` file of
``torch.distributed.checkpoint`` is the same kind of archive, at an offset inside the file, so this reader
works on a byte region of a file.

The archive is read the way torch reads it (:mod:`ckptaudit.formats.miniz`: the zip signature at byte 0, the end
records and central directory as miniz finds them, names looked up ignoring case under the first member's folder,
the records torch checks), and refused wherever the two readings could part; every member but ``data.pkl`` and its
storages is scanned as a pickle too. The pickle is scanned first (:func:`ckptaudit.formats.pickle_scan.scan`); only
a pickle whose every global is
allowed is unpickled, through a restricted unpickler that turns each tensor into a :class:`TensorData`
pointing into the file. Storage sizes and tensor views are checked against the archive before anything is
described, so a hostile header cannot make us allocate or read past the file: ``data.pkl`` must declare at
most :data:`MAX_PICKLE_BYTES` (checked before it is inflated, and inflation stops at the declared size), every
storage must be stored uncompressed inside the archive, exactly as large as its elements, and referenced with one
dtype (torch types a storage by its first reference), and the tensors of one archive may together address
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
import zlib
from dataclasses import dataclass
from typing import Any

from ckptaudit.formats import miniz, ziplayout
from ckptaudit.formats.object_tree import check_tree
from ckptaudit.formats.pickle_scan import PickleLimitError, PickleScan, may_name_global, opcode_limit, scan
from ckptaudit.formats.safeio import open_regular, open_regular_fd
from ckptaudit.formats.tensor_rebuild import VIEW_BUDGET_FACTOR, StorageRef, StorageType, ViewBudget, torch_table
from ckptaudit.formats.tensors import DType, Piece, TensorData
from ckptaudit.formats.unpickler import RestrictedUnpickler
from ckptaudit.formats.zipdir import HEAD_BYTES, TAIL_BYTES, Member, Region, lean_directory

__all__ = ["RegionStream", "TorchZip", "TorchZipError", "TorchZipFile", "TorchZipFiles", "is_zip", "read_torch_zip",
           "read_torch_zip_bytes", "scan_legacy"]

MAX_PICKLE_BYTES = 256 << 20
"""A ``data.pkl`` larger than this is refused: object trees of real checkpoints are far smaller."""


class TorchZipError(Exception):
    """The archive is not a readable ``torch.save`` zip; ``offset`` is the absolute byte offset if known;
    ``limit`` says the archive exceeds a safety limit rather than being malformed; ``code`` is the finding it is
    (``integrity.corrupt``, or a ``security.*`` code where torch would unpickle bytes ckptaudit did not vet)."""

    def __init__(self, message: str, offset: int | None = None, *, limit: bool = False,
                 code: str = "integrity.corrupt") -> None:
        super().__init__(message)
        self.offset = offset
        self.limit = limit
        self.code = code


@dataclass(frozen=True, slots=True)
class TorchZip:
    """One archive: its pickle scan and, when the scan allowed loading, the object tree."""

    scan: PickleScan
    obj: Any
    """The unpickled tree (dicts, lists, numbers, strings, :class:`TensorData` leaves); ``None`` if not loaded."""
    loaded: bool


MAX_ZIP_ENTRIES = 1_000_000
"""Most members of one archive (``torch.save`` writes one per storage, plus six)."""
_LOCAL_HEADER = 30
"""Bytes of a zip local file header before its name: every member takes at least this much before the central
directory."""


def _entries_problem(end: miniz.EndRecords, offset: int) -> None:
    """Refuse an archive whose central directory lists more members than the bytes before it can hold (entries
    sharing one local header: 2M entries would be read as valid at 1.2 GiB), from the end records alone, before
    anything builds one object per entry."""
    if end.entries > MAX_ZIP_ENTRIES:
        raise TorchZipError(f"zip central directory lists {end.entries} members, more than the reader's limit of "
                            f"{MAX_ZIP_ENTRIES}", offset, limit=True)
    if end.entries * _LOCAL_HEADER > end.cd_offset:
        raise TorchZipError(f"zip central directory lists {end.entries} members, but only {end.cd_offset} bytes "
                            f"precede it (each member's local header takes at least {_LOCAL_HEADER}): members share "
                            "local headers", offset)


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
    if info.compress_type == 0:  # stored
        if info.compress_size != info.file_size:
            raise TorchZipError(f"{info.filename}: stored member with two different sizes", start)
        data = region.read_at(start, info.file_size)
    elif info.compress_type == 8:  # deflated
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
        self._abspath = os.path.abspath(path)

    @property
    def fd(self) -> int:
        """The open descriptor (``-1`` once closed): a loader that must read the very file that was checked
        reads through it."""
        return self._fd

    def close(self) -> None:
        if self._fd < 0:
            return
        os.close(self._fd)
        self._fd = -1

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
        if complete and head[:4] == _ZIP_MAGIC:  # the common case first: a DCP item of a learnt layout
            hit = ziplayout.match(length, head, tail)
            if hit is not None:
                known = _from_layout(hit, self._abspath, offset, length, load)
                if known is not None:
                    return known
        return _read_archive(Region(fd, offset, length, head if complete else None), self._abspath, head, tail,
                             complete, load, inert)


def read_torch_zip_bytes(data: bytes, name: str = "<bytes>", *, load: bool = True) -> TorchZip:
    """:func:`read_torch_zip` of an archive held in memory (a DCP item a loader read once, checks, and hands to
    torch as it is); tensors in it point into a file named ``name`` that does not exist."""
    tail = data[-TAIL_BYTES:] if len(data) > TAIL_BYTES else data
    return _read_archive(Region(-1, 0, len(data), data), name, data, tail, True, load, False)


_ZIP_MAGIC = b"PK\x03\x04"


def _read_archive(region: Region, path: str, head: bytes, tail: bytes, complete: bool, load: bool,
                  inert: bool) -> TorchZip:
    """The archive in ``region`` (``head``/``tail``: its first and last bytes as read; ``complete``: whether those
    reads got every byte asked for): torch's entry check, then the memoised layout, else the full read."""
    offset, length = region.start, region.length
    if len(head) < min(4, length):
        raise TorchZipError("the archive ends early (truncated, or changed while being read)", offset)
    if head[:4] != _ZIP_MAGIC:
        raise _not_a_zip(region, head)
    if complete:
        hit = ziplayout.match(length, head, tail)
        if hit is not None:
            known = _from_layout(hit, path, offset, length, load)
            if known is not None:
                return known
    else:  # the file shrank under us: the full read says what is missing
        tail = region.read_at(offset + length - min(length, TAIL_BYTES), TAIL_BYTES)
    return _read_full(region, path, tail, load, inert)


class RegionStream(io.RawIOBase):
    """A read-only, seekable stream over a :class:`Region` (the pickle scan of a region's first bytes; ``torch.load``
    of an archive that was checked through the same descriptor)."""

    def __init__(self, region: Region) -> None:
        self._region, self._pos = region, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._region.length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b: Any) -> int:
        data = self._region.read_at(self._region.start + self._pos, len(b))
        b[:len(data)] = data
        self._pos += len(data)
        return len(data)


def scan_legacy(stream: Any) -> PickleScan:
    """The pickles torch's legacy (pre-1.6) loader unpickles one after another from ``stream``'s position (magic
    number, protocol, system info, the object tree, the storage keys), scanned as one: every global any of them
    references; the first malformed one ends the walk (its error is kept)."""
    names: list[str] = []
    unsafe: list[str] = []
    harmless: list[str] = []
    misused: list[str] = []
    last = scan(stream)
    for _ in range(5):
        names += last.globals
        unsafe += last.unsafe
        harmless += last.harmless
        misused += last.misused
        if last.error is not None or len(names) > 4096:
            break
        last = scan(stream)
    return PickleScan(tuple(names), tuple(unsafe), tuple(harmless), last.error, last.error_offset, last.end,
                      last.limit, tuple(misused))


def _not_a_zip(region: Region, head: bytes) -> TorchZipError:
    """The error for an archive that does not start with a local header: torch.load does not read it as a zip but
    with its legacy loader, unpickling it from byte 0, so the pickles there are scanned (named in the message)."""
    found = scan_legacy(RegionStream(region))
    bad = found.unsafe + found.harmless
    what = f"; the pickle there references {', '.join(bad)}" if bad else ""
    return TorchZipError(
        f"does not start with a zip local header (its first bytes are {head[:8]!r}): torch.load would not read it "
        "as a torch.save archive but with its legacy loader, which unpickles it from byte 0 without the checks "
        f"ckptaudit makes{what}", region.start,
        code="security.unsafe-pickle" if found.unsafe else "security.unvetted-pickle")


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


def _zip_error(exc: miniz.ZipReadError, offset: int) -> TorchZipError:
    at = None if exc.offset is None else offset + exc.offset
    return TorchZipError(str(exc), at, code=exc.code)


def _read_full(region: Region, path: str, tail: bytes, load: bool, inert: bool) -> TorchZip:
    """Every check on the archive in ``region`` (``tail``: its last ``min(length, TAIL_BYTES)`` bytes), read the
    way torch reads it (:mod:`ckptaudit.formats.miniz`); learns its layout when it is the canonical one."""
    offset, length = region.start, region.length

    def read_rel(at: int, n: int) -> bytes:
        return region.read_at(offset + at, n)

    try:
        end = miniz.end_records(read_rel, length, tail)
        _entries_problem(end, offset)  # before anything builds one object per central entry
        lean = lean_directory(region, tail)
        if lean is None or len(lean) != end.entries:
            lean = None
            infos = miniz.directory(read_rel, length, end)
        else:
            infos = lean
        names = miniz.check_members(infos, length)
        _check_local_headers(infos, offset)
    except miniz.ZipReadError as exc:
        raise _zip_error(exc, offset) from None
    prefix = names.top
    pkl = names.get("data.pkl")
    if pkl is None:
        raise TorchZipError(f"zip archive without {prefix}data.pkl: not a torch.save file", offset)
    data = _read_member(region, pkl, MAX_PICKLE_BYTES)
    result = _scan_cached(data)
    outside = bool(result.unsafe or result.harmless)
    if outside and (not inert or not load or result.error is not None):
        return TorchZip(result, None, False)
    if result.error is not None:
        raise TorchZipError(f"data.pkl: {result.error} (pickle byte {result.error_offset})", offset,
                            limit=result.limit)
    if not load:
        _scan_members(region, names, pkl, None)
        return TorchZip(result, None, False)
    budget = ViewBudget(length)

    def locate(key: str, dtype: DType, numel: int) -> int:
        """The absolute offset of storage ``key``, checked against the archive."""
        info = names.get(f"data/{key}")
        if info is None:
            raise pickle.UnpicklingError(f"storage {key!r} is missing from the archive")
        if info.compress_type != 0 or info.compress_size != info.file_size:
            raise pickle.UnpicklingError(f"storage {key!r} is compressed; torch.save never does that")
        nbytes = numel * dtype.itemsize
        if nbytes != info.file_size:
            raise pickle.UnpicklingError(
                f"storage {key!r} declares {numel} {dtype.name} elements ({nbytes} bytes), the archive holds "
                f"{info.file_size} bytes for it (torch.load refuses a storage whose record is not exactly its size)")
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
        seen = storages.get(key)
        if seen is not None:
            # torch.load builds each storage once, typed by its first reference, and hands every later reference
            # that one: a later dtype or size is not what the tensors get.
            if seen[0] != stype.dtype or seen[1] != numel:
                raise pickle.UnpicklingError(
                    f"storage {key!r} is referenced as {seen[1]} {seen[0].name} elements and again as {numel} "
                    f"{stype.dtype.name} elements; torch.load keeps the first reference's type, so every tensor "
                    f"on it comes back as {seen[0].name}")
            return StorageRef(seen[0], seen[2], seen[1])
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
        _scan_members(region, names, pkl, used)
        _learn(region, tail, lean, names)
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
    _scan_members(region, names, pkl, storages)
    if not outside:
        _learn(region, tail, lean, names)
        if len(data) <= _LOAD_CACHE_MAX_PICKLE and _is_plain_tree(obj):
            if len(_LOAD_CACHE) >= _LOAD_CACHE_ENTRIES:
                _LOAD_CACHE.clear()
            _LOAD_CACHE[data] = (obj, dict(storages), _tensor_bytes(obj))
    return TorchZip(result, _bind_file(obj, path), True)


def _learn(region: Region, tail: bytes, lean: list[Member] | None, names: miniz.Names) -> None:
    """Every check passed on an archive of the canonical layout: archives of this layout need only be compared
    with it (:mod:`ckptaudit.formats.ziplayout`)."""
    head = region.head
    if lean is not None and head is not None:
        ziplayout.learn(region.length, head, tail, lean, names.top)


def _scan_members(region: Region, names: miniz.Names, pkl: Member, storages: dict[str, Any] | None) -> None:
    """The records torch reads besides ``data.pkl`` (:func:`ckptaudit.formats.miniz.check_records`), then, in
    defense in depth: every member besides ``data.pkl`` and the storages it references (raw tensor bytes, never
    unpickled by torch) is scanned as a pickle; one that references a global is refused, whatever its name or
    position (torch.load never unpickles it, but no torch.save archive holds one, and another reader may).
    ``storages`` ``None``: the pickle was not loaded, every member outside ``data/`` is scanned."""
    try:
        miniz.check_records(names, lambda m, limit: _read_member(region, m, limit))
    except miniz.ZipReadError as exc:
        raise _zip_error(exc, region.start) from None
    data_dir = (names.top + "data/").lower()
    skip = {pkl.filename.lower()}
    if storages is not None:
        skip.update(f"{data_dir}{key}".lower() for key in storages)
    for low, member in names.by_lower.items():
        if low in skip or (storages is None and low.startswith(data_dir)):
            continue
        blob = _read_member(region, member, MAX_PICKLE_BYTES)
        if not may_name_global(blob):
            continue
        found = _scan_cached(blob)
        bad = found.unsafe + found.harmless
        if bad:
            raise TorchZipError(
                f"member {member.filename!r} is a pickle that references {', '.join(bad)}: torch.load unpickles "
                "only data.pkl, but no torch.save archive holds another pickle, and another reader may unpickle it",
                region.start + member.header_offset, code="security.unsafe-pickle")


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
