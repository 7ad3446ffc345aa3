"""DCP directories behind URLs: stage ``.metadata`` and each item's archive metadata with batched ranged reads.

Called by :func:`ckptaudit.formats.remote.staging.stage` (one process: the caller's thread, and up to
:data:`FILES_IN_FLIGHT` threads staging data files at once) for a prefix holding ``.metadata`` or ``.distcp``
objects. The stand-in it builds is read by the same DCP reader as a local directory
(:func:`ckptaudit.formats.dcp.reader.read_dcp`: the ``.metadata`` opcode scan and torch-free rebuild, path escapes,
item bounds against the file size, chunks tiling each tensor, each item's archive checked by
:func:`ckptaudit.formats.zip.archive.read_torch_zip`), so a remote DCP directory is judged by the same code.

What is staged, per item that ``.metadata`` places inside a data file (offset + length): the first and last
4 KiB (the pickle, ``byteorder`` and the tensor member's local header; the central directory and end records),
then whatever the end records and the central directory say the reader will read beyond them (a larger central
directory, a zip64 record, a long local header, a large ``data.pkl``). Each round is one batch of concurrent
ranged reads per data file: neighbouring ranges are coalesced (the tail of one item and the head of the next are
one read), and ranges of the same object at most :data:`READ_THROUGH_GAP` apart share one ranged read whose
bytes between them are read through and dropped, never staged (a request costs a round trip, tens of ms on a
real store, while 1 MiB more of a reply costs a few ms: the ends of neighbouring items of a few hundred KiB
each are one request, not one each; a ``torch.save`` file's staging reads nothing through: its gaps are tensor
data the scan reads, and nothing is fetched twice there). No read exceeds :data:`MAX_READ_BYTES` and no batch
holds more than :data:`MAX_IN_FLIGHT_BYTES`, so memory stays bounded by those, whatever the checkpoint's size;
only the ranges asked are written to the stand-in and charged to the staging budget. Tensor data is not staged:
it streams through :class:`~ckptaudit.formats.remote.objects.RemoteFiles` when it is hashed.

The ``.metadata`` parsed here only to plan reads goes through the same scan and restricted rebuild as the reader
(nothing is unpickled otherwise); when it is hostile or malformed, nothing more is staged and the reader reports
it from the staged ``.metadata``, exactly as for the local copy.
"""

from __future__ import annotations

import bisect
import struct
import threading
import zipfile
from collections.abc import Iterable
from typing import Any

from ckptaudit.formats.dcp.metadata import BytesMeta, DcpMetadata, load_dcp_metadata
from ckptaudit.formats.dcp.reader import MAX_BYTES_ITEM, MAX_METADATA_BYTES, METADATA
from ckptaudit.formats.pickle.allowlist import DCP_METADATA_GLOBALS
from ckptaudit.formats.pickle.scan import opcode_limit, scan

__all__ = ["COALESCE_GAP", "FILES_IN_FLIGHT", "MAX_IN_FLIGHT_BYTES", "MAX_READ_BYTES", "READ_THROUGH_GAP",
           "RangeStager", "stage_dcp"]

EDGE_BYTES = 4096
"""Bytes read at each end of an item in the first round (a tensor item's metadata is a few hundred bytes)."""
COALESCE_GAP = 4096
"""Ranges of one file closer than this are fetched as one read (the gap's bytes are staged too)."""
READ_THROUGH_GAP = 1 << 20
"""Ranges of one file at most this far apart are fetched by one ranged read (up to :data:`MAX_READ_BYTES`); the
bytes between them are dropped as they arrive, neither staged nor charged to the budget."""
MAX_READ_BYTES = 8 << 20
"""One ranged read fetches at most this much; a longer range is split."""
MAX_IN_FLIGHT_BYTES = 32 << 20
"""One batch of concurrent ranged reads holds at most this much in memory."""
_EOCD = 22
_EOCD_TAIL = 22 + 0xFFFF
"""The end record and the longest zip comment: how far back the reader looks for the end record."""
_ZIP64_RECORD = 56
_ZIP64_LOCATOR = 20


FILES_IN_FLIGHT = 4
"""Data files of one DCP directory staged at once (a thread each): their rounds of reads overlap, while the bytes
in flight for all of them together stay within :data:`MAX_IN_FLIGHT_BYTES`."""


class _InFlight:
    """Bytes of ranged reads in flight across the data files staged at once, at most ``limit`` (a batch larger than
    that runs alone)."""

    def __init__(self, limit: int) -> None:
        self._limit, self._held = limit, 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cond:
            while self._held and self._held + n > self._limit:
                self._cond.wait()
            self._held += n

    def release(self, n: int) -> None:
        with self._cond:
            self._held -= n
            self._cond.notify_all()


class RangeStager:
    """Fills byte ranges of one stand-in file from its remote object, each byte fetched at most once.

    ``remote`` is a :class:`~ckptaudit.formats.remote.objects.RemoteObject` (its reads bounded and checked there);
    ``take(n)`` charges the staged-metadata budget before anything is fetched. ``read_through``: ranges at most
    this far apart share one ranged read, the bytes between them dropped (:data:`READ_THROUGH_GAP` for a DCP
    data file's items; 0, the default, where those bytes are tensor data read again by the scan and few
    requests are saved, as in a ``torch.save`` file: nothing is then fetched twice).
    """

    def __init__(self, remote: Any, local: str, take: Any, *, read_through: int = 0,
                 in_flight: _InFlight | None = None) -> None:
        self.remote, self.local, self._take, self._read_through = remote, local, take, read_through
        self._in_flight = in_flight
        self._starts: list[int] = []  # staged intervals, sorted and disjoint
        self._ends: list[int] = []
        self.reads = 0
        """Ranged requests made (for tests and benchmarks)."""
        self.fetched = 0
        """Bytes fetched (the staged ones, and those read through between them)."""

    def missing(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[start, end)`` (clipped to the object) not staged yet."""
        start, end = max(0, start), min(self.remote.size, end)
        out: list[tuple[int, int]] = []
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        pos = start
        while pos < end and i < len(self._starts):
            s, e = self._starts[i], self._ends[i]
            if e <= pos:
                i += 1
                continue
            if s >= end:
                break
            if s > pos:
                out.append((pos, s))
            pos = max(pos, e)
            i += 1
        if pos < end:
            out.append((pos, end))
        return out

    def _mark(self, start: int, end: int) -> None:
        i = bisect.bisect_left(self._ends, start)
        j = bisect.bisect_right(self._starts, end)
        if i < j:
            start, end = min(start, self._starts[i]), max(end, self._ends[j - 1])
        self._starts[i:j] = [start]
        self._ends[i:j] = [end]

    def stage(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Fetch every unstaged byte of ``ranges`` (``(start, end)`` pairs) into the stand-in, in coalesced,
        bounded batches of concurrent ranged reads (see the module docstring)."""
        gaps = sorted(g for s, e in ranges if e > s for g in self.missing(s, e))
        merged: list[list[int]] = []
        for s, e in gaps:
            if merged and s - merged[-1][1] <= COALESCE_GAP:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        pieces = [(p, min(e, p + MAX_READ_BYTES)) for s, e in merged for p in range(s, e, MAX_READ_BYTES)]
        if not pieces:
            return
        self._take(sum(e - s for s, e in pieces))
        # One ranged read per run of pieces at most read_through apart and MAX_READ_BYTES long in all.
        reads: list[tuple[int, int, list[tuple[int, int]]]] = []
        for s, e in pieces:
            if reads and s - reads[-1][1] <= self._read_through and e - reads[-1][0] <= MAX_READ_BYTES:
                reads[-1][2].append((s, e))
                reads[-1] = (reads[-1][0], e, reads[-1][2])
            else:
                reads.append((s, e, [(s, e)]))
        batch: list[tuple[int, int, list[tuple[int, int]]]] = []
        held = 0
        for read in reads:
            if batch and held + (read[1] - read[0]) > MAX_IN_FLIGHT_BYTES:
                self._fetch(batch)
                batch, held = [], 0
            batch.append(read)
            held += read[1] - read[0]
        self._fetch(batch)

    def _fetch(self, batch: list[tuple[int, int, list[tuple[int, int]]]]) -> None:
        """Issue the ranged reads ``(start, end, pieces)`` of ``batch`` together; write their ``pieces`` only."""
        held = sum(e - s for s, e, _ in batch)
        if self._in_flight is not None:
            self._in_flight.acquire(held)
        try:
            self._write(batch, self.remote.read_many([(s, e) for s, e, _ in batch]))  # exactly the bytes asked
        finally:
            if self._in_flight is not None:
                self._in_flight.release(held)
        self.reads += len(batch)

    def _write(self, batch: list[tuple[int, int, list[tuple[int, int]]]], datas: list[bytes]) -> None:
        with open(self.local, "r+b") as fh:
            for (s, e, pieces), data in zip(batch, datas, strict=True):
                view = memoryview(data)  # no copy of the read
                for ps, pe in pieces:
                    fh.seek(ps)
                    fh.write(view[ps - s : pe - s])
                    self._mark(ps, pe)
                self.fetched += e - s

    def read(self, start: int, end: int) -> bytes:
        """Staged bytes ``[start, end)`` (clipped to the object), read back from the stand-in."""
        start, end = max(0, start), min(self.remote.size, end)
        if end <= start:
            return b""
        with open(self.local, "rb") as fh:
            fh.seek(start)
            return fh.read(end - start)


def _metadata(stager: RangeStager) -> DcpMetadata | None:
    """Stage ``.metadata`` whole and rebuild it as the reader does; ``None`` when the reader would refuse it (it
    then reports why from the staged copy)."""
    size = stager.remote.size
    if size > MAX_METADATA_BYTES:
        return None  # the reader refuses it by its size, which the stand-in has
    stager.stage([(0, size)])
    data = stager.read(0, size)
    result = scan(data, DCP_METADATA_GLOBALS, max_opcodes=opcode_limit(len(data)))
    if result.unsafe or result.harmless or result.error is not None:
        return None
    try:
        return load_dcp_metadata(data, result)
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 - whatever the reader makes of it, it says so from the staged bytes
        return None


def item_ranges(md: DcpMetadata, sizes: dict[str, int]) -> dict[str, list[tuple[int, int]]]:
    """Data file name -> the ``(offset, length)`` of every item the reader will open in it.

    Left out, as the reader leaves them unread: malformed entries, files not in ``sizes`` (missing, nested or
    escaping names), items past the end of their file, items stored through transforms, and non-tensor items
    over :data:`~ckptaudit.formats.dcp.reader.MAX_BYTES_ITEM`.
    """
    out: dict[str, list[tuple[int, int]]] = {}
    for index, info in md.storage_data.items():
        if info.problem is not None or info.transform_descriptors:
            continue
        size = sizes.get(info.relative_path)
        if size is None or info.offset < 0 or info.length <= 0 or info.offset + info.length > size:
            continue
        if isinstance(md.state_dict_metadata.get(index.fqn), BytesMeta) and info.length > MAX_BYTES_ITEM:
            continue
        out.setdefault(info.relative_path, []).append((info.offset, info.length))
    return out


def stage_items(stager: RangeStager, items: list[tuple[int, int]]) -> None:
    """Stage what :func:`~ckptaudit.formats.zip.archive.read_torch_zip` reads of each item (see the module
    docstring), in four rounds of batched reads for all the items of one file."""
    items = sorted(set(items))
    # 1. Both ends of every item.
    stager.stage(r for o, n in items for r in ((o, o + min(n, EDGE_BYTES)), (o + n - min(n, EDGE_BYTES), o + n)))
    # 2. The end records where they are not the last 22 bytes (a comment), the zip64 record, the central
    #    directory: what the reader's size check and zipfile read.
    far = [(o + n - min(n, _EOCD_TAIL), o + n) for o, n in items
           if n >= _EOCD and stager.read(o + n - _EOCD, o + n - _EOCD + 4) != b"PK\x05\x06"]
    stager.stage(far)
    for _ in range(2):  # the second pass reads the zip64 record the first one staged
        stager.stage(r for o, n in items for r in _directory_ranges(stager, o, n))
    # 3. Every member's local header and the small members the reader reads (data.pkl, byteorder).
    members: list[tuple[int, int, int, int]] = []  # (header offset, guessed header length, member bytes, item end)
    for o, n in items:
        members += _member_plan(stager, o, n)
    stager.stage((h, min(end, h + guess + member)) for h, guess, member, end in members)
    # 4. Local headers whose own name or extra field is longer than the central directory let us guess.
    more: list[tuple[int, int]] = []
    for h, _guess, member, end in members:
        head = stager.read(h, h + 30)
        if len(head) == 30 and head[:4] == b"PK\x03\x04":
            name_len, extra_len = struct.unpack("<HH", head[26:30])
            more.append((h, min(end, h + 30 + name_len + extra_len + member)))
    stager.stage(more)


def _directory_ranges(stager: RangeStager, o: int, n: int) -> list[tuple[int, int]]:
    """The central directory (where the end record says and where zipfile computes it) and the zip64 record
    of the item ``[o, o+n)``, from its staged end records."""
    # Where the end record closes the item (no comment, always for torch.save) its last 4 KiB hold everything the
    # search finds in the last 64 KiB (the last signature is the same one).
    quick = n >= _EOCD and stager.read(o + n - _EOCD, o + n - _EOCD + 4) == b"PK\x05\x06"
    tail = stager.read(o + n - min(n, EDGE_BYTES if quick else _EOCD_TAIL), o + n)
    base = o + n - len(tail)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + _EOCD > len(tail):
        return []
    _entries, cd_size, cd_offset = struct.unpack_from("<10xHLL", tail, at)
    out = [(o + cd_offset, o + cd_offset + cd_size)]
    end_at = base + at  # absolute offset of the end record
    before = end_at
    locator = at - _ZIP64_LOCATOR
    if locator >= 0 and tail[locator:locator + 4] == b"PK\x06\x07":
        (z64_at,) = struct.unpack_from("<8xQ", tail, locator)
        before = end_at - _ZIP64_LOCATOR - _ZIP64_RECORD  # where zipfile reads the zip64 record
        out += [(o + z64_at, o + z64_at + _ZIP64_RECORD), (before, before + _ZIP64_RECORD)]
        rec = stager.read(before, before + _ZIP64_RECORD)
        if len(rec) == _ZIP64_RECORD and rec[:4] == b"PK\x06\x06":  # zipfile then takes the sizes from it
            cd_size, cd_offset = struct.unpack_from("<40xQQ", rec)
            out.append((o + cd_offset, o + min(n, cd_offset + cd_size)))
    # zipfile reads the directory just before the end records, whatever offset they record.
    out.append((max(o, before - cd_size), end_at + _EOCD))
    return [(s, min(e, o + n)) for s, e in out if s < o + n]


class _Region:
    """``[o, o+n)`` of an open file as a seekable file for :class:`zipfile.ZipFile` (staged bytes only)."""

    def __init__(self, fh: Any, o: int, n: int) -> None:
        self._fh, self._o, self._n, self._pos = fh, o, n, 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = max(0, {0: 0, 1: self._pos, 2: self._n}[whence] + pos)
        return self._pos

    def read(self, k: int = -1) -> bytes:
        left = max(0, self._n - self._pos)
        k = left if k is None or k < 0 else min(k, left)
        self._fh.seek(self._o + self._pos)
        data: bytes = self._fh.read(k)
        self._pos += len(data)
        return data


def _member_plan(stager: RangeStager, o: int, n: int) -> list[tuple[int, int, int, int]]:
    """``(absolute local header offset, guessed header length, member bytes to stage, item end)`` for each member of the
    item ``[o, o+n)``, from its staged central directory; empty when it is not a readable zip (the reader says
    why from the same bytes)."""
    with open(stager.local, "rb") as fh:
        try:
            with zipfile.ZipFile(_Region(fh, o, n)) as zf:  # type: ignore[arg-type]
                infos = zf.infolist()
        except Exception:  # noqa: BLE001 - malformed archives are the reader's to report
            return []
    plan = []
    for i in infos[:100_000]:
        if not 0 <= i.header_offset <= n - 30:
            continue
        small = i.filename.endswith(("data.pkl", "byteorder")) or i.compress_size <= 4096
        member = min(i.compress_size, n) if small else 0
        guess = 30 + len(i.orig_filename.encode("utf-8", "surrogateescape")) + len(i.extra) + 128
        plan.append((o + i.header_offset, guess, member, o + n))
    return plan


def stage_dcp(files: dict[str, tuple[str, int, str]], make: Any, take: Any) -> tuple[int, int]:
    """Stage a DCP directory's ``.metadata`` and its items' archive metadata; return ``(ranged reads, bytes
    fetched)``.

    ``files``: object name -> (remote path, size, stand-in path) of the directory's objects, whose sparse
    stand-ins already exist; ``make(remote_path, size)`` builds the remote handle a :class:`RangeStager` reads;
    ``take(n)`` charges the staged-metadata budget.
    """
    meta = files.get(METADATA)
    if meta is None:
        return 0, 0  # the reader reports the missing .metadata
    path, size, local = meta
    stager = RangeStager(make(path, size), local, take)
    md = _metadata(stager)
    stagers = [stager]
    if md is not None:
        sizes = {name: size for name, (_p, size, _l) in files.items() if name != METADATA}
        work = [(files[name], items) for name, items in item_ranges(md, sizes).items()]
        lock = threading.Lock()

        def locked_take(n: int) -> None:
            with lock:
                take(n)

        pool = _InFlight(MAX_IN_FLIGHT_BYTES)
        stagers += [RangeStager(make(path, size), local, locked_take, read_through=READ_THROUGH_GAP, in_flight=pool)
                    for (path, size, local), _ in work]
        _each(FILES_IN_FLIGHT, [(st, items) for st, (_, items) in zip(stagers[1:], work, strict=True)])
    return sum(s.reads for s in stagers), sum(s.fetched for s in stagers)


def _each(workers: int, jobs: list[tuple[RangeStager, list[tuple[int, int]]]]) -> None:
    """:func:`stage_items` of every ``(stager, items)``, ``workers`` data files at a time; the first failure in
    the files' order is raised once every started file has stopped (later files are not started)."""
    if workers <= 1 or len(jobs) <= 1:
        for st, items in jobs:
            stage_items(st, items)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptaudit-stage") as ex:
        futures = [ex.submit(stage_items, st, items) for st, items in jobs]
        failed: BaseException | None = None
        for f in futures:
            if failed is not None:
                f.cancel()
                continue
            exc = f.exception()
            if exc is not None:
                failed = exc
                for g in futures:
                    g.cancel()
    if failed is not None:
        raise failed
