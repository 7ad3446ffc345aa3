"""Memoised zip layouts: the structure that the DCP items of one shape share, checked once and matched per item.

:func:`ckptaudit.formats.torchzip.read_torch_zip` checks an archive in full (end records, central directory, local
headers one to one, names, ``byteorder``, the CRC of ``data.pkl``, storages inside the archive). DCP writes
thousands of items whose archives agree byte for byte in everything but their CRCs and their data: same length,
same member names, sizes, offsets and local headers (``torch.save`` writes zero timestamps). After a full read
succeeds, :func:`learn` records that structure as a :class:`Layout`; a later archive whose bytes equal it
everywhere the full read looks, CRC fields aside, would pass every structural check the same way, so
:func:`match` only compares those bytes (two ``struct`` unpacks), checks the CRCs of ``data.pkl`` and
``byteorder`` and reads them.

What is compared: every byte from the central directory's start to the archive's end (the directory, the zip64
records, the end record) except each central entry's CRC field, the signature and name/extra lengths of each
checked local header (``data.pkl``, ``byteorder``, every ``data/`` storage member and the small records
``version``, ``.data/version``, ``.format_version``, ``.storage_alignment`` and ``.data/serialization_id``: what the
full read takes from a local header), the bytes of the records ``torch.save`` writes alike into every archive, and
the CRCs of every member the full read reads; ``.data/serialization_id`` changes from item to item and must be
unable to name a global (the full read scans every member as a pickle). An archive holding any other member, or a
storage its pickle does not use, is read in full. Anything else the full read looks at is a function of those bytes and the archive's
length (both in the key), or is checked per archive here (the two CRCs, the byte order) or by the caller (the
pickle's scan and load, keyed on its bytes; the storages the pickle uses against the sizes recorded here). Where
anything differs, :func:`match` answers ``None`` and the caller reads the archive in full, so every refusal is
the full read's, with its message. :func:`learn` records only the canonical layout ``torch.save`` writes (what
:func:`ckptaudit.formats.zipdir.lean_directory` answers for, end records whose counts need no zip64 lookup, the
checked local headers and the small members inside the archive's first bytes); other archives are always read
in full.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

from ckptaudit.formats.pickle_scan import may_name_global
from ckptaudit.formats.zipdir import Member

__all__ = ["Layout", "Matched", "clear", "learn", "match"]

MAX_LAYOUTS = 1024
"""Layouts kept at once (a checkpoint has a few per distinct item shape); the memo is emptied when full."""

_FIXED_RECORDS = ("version", ".data/version", ".format_version", ".storage_alignment")
"""Records ``torch.save`` writes with the same bytes into every archive (compared byte for byte)."""
_FREE_RECORD = ".data/serialization_id"
"""The record whose bytes change from one ``torch.save`` to the next (an id)."""
_CENTRAL = 46
"""Bytes of a central directory entry before its name; its CRC field is at bytes 16..20."""


@dataclass(frozen=True, slots=True)
class Layout:
    """The shared structure of the archives of one length and one end record (see the module docstring)."""

    length: int
    """The archive's length (part of the key)."""
    back: int
    """Bytes from the central directory's start to the archive's end (all inside the tail the reader reads)."""
    directory: struct.Struct
    """Unpacks those bytes into fixed segments and CRCs, alternately (``<Ns L Ms L ... Ks``)."""
    fixed: tuple[bytes, ...]
    """The segments: every byte of the directory and end records but the CRC fields."""
    headers: struct.Struct
    """Unpacks, from the archive's first bytes, the signature and the name/extra lengths of each checked local
    header."""
    header_fields: tuple[bytes, ...]
    pkl: tuple[int, int, int]
    """``data.pkl``: (data start, data end) relative to the archive, and its CRC's index among the CRCs."""
    byteorder: tuple[int, int, int] | None
    """``byteorder`` likewise, or ``None`` where the archive has none."""
    storages: dict[str, tuple[int, int]]
    """Storage key -> (data start relative to the archive, stored bytes), for each uncompressed storage."""
    records: tuple[tuple[int, int, bytes], ...]
    """The small records torch reads besides ``data.pkl`` and ``byteorder`` (``version``, ``.format_version``,
    ``.storage_alignment``) that lie in the archive's last bytes: (start, end) relative to the archive, and the bytes
    they held when learnt, which every matching archive must hold too (their CRCs are compared with the directory;
    those in the first bytes are compared with :attr:`headers`)."""
    record_headers: tuple[tuple[int, bytes], ...]
    """The local headers of those records and of a free one in the last bytes (offset, signature and name/extra
    lengths)."""
    free: tuple[tuple[int, int, int], ...]
    """Records whose bytes differ from archive to archive (``.data/serialization_id``): (start, end, CRC index); a
    matching
    archive's must not be able to name a global (:func:`~ckptaudit.formats.pickle_scan.may_name_global`), else the
    full read scans them."""
    located: dict[bytes, tuple[object, tuple[tuple[int, int], ...] | None]] = field(default_factory=dict)
    """Memo of :meth:`relocate`: ``data.pkl`` bytes -> (the ``used`` it was asked about, its answer)."""

    def relocate(self, pkl: bytes, used: dict[str, tuple[Any, int, int]]) -> tuple[tuple[int, int], ...] | None:
        """Where the storages ``used`` (key -> (dtype, elements, data start in the archive the tree was loaded
        from)) of a cached tree lie in an archive of this layout, as ``(old data start, data start relative to
        the archive)`` pairs, checked as the full read's ``locate`` checks them (present, uncompressed, holding
        the elements, inside the archive); ``None`` where any does not fit."""
        memo = self.located.get(pkl)
        if memo is not None and memo[0] is used:
            return memo[1]
        out: list[tuple[int, int]] = []
        answer: tuple[tuple[int, int], ...] | None = None
        for key, (dtype, numel, old) in used.items():
            found = self.storages.get(key)
            nbytes = numel * dtype.itemsize
            if found is None or found[0] < 0 or nbytes != found[1] or found[0] + nbytes > self.length:
                break
            out.append((old, found[0]))
        else:
            # A storage member no tensor uses is scanned as a pickle by the full read (defense in depth).
            answer = tuple(out) if len(out) == len(self.storages) else None
        if len(self.located) >= 64:
            self.located.clear()
        self.located[pkl] = (used, answer)
        return answer


@dataclass(frozen=True, slots=True)
class Matched:
    """An archive that matched a layout: its ``data.pkl`` bytes (CRC checked) and its layout."""

    pkl: bytes
    layout: Layout


_LAYOUTS: dict[tuple[int, bytes], Layout] = {}


def clear() -> None:
    """Forget every layout (tests, and callers that want every archive read in full)."""
    _LAYOUTS.clear()


def match(length: int, head: bytes, tail: bytes) -> Matched | None:
    """The archive of ``length`` bytes whose first bytes are ``head`` (at least ``min(length, 4096)``) and whose
    last ``min(length, 4096)`` or more bytes are ``tail``, if it has a learnt layout and every byte the full read
    would check agrees with it; else ``None`` (read it in full)."""
    layout = _LAYOUTS.get((length, tail[-22:]))
    if layout is None:
        return None
    fields = layout.directory.unpack_from(tail, len(tail) - layout.back)
    if fields[::2] != layout.fixed or layout.headers.unpack_from(head) != layout.header_fields:
        return None
    crcs = fields[1::2]
    start, end, i = layout.pkl
    pkl = head[start:end]
    if zlib.crc32(pkl) != crcs[i]:
        return None
    if layout.byteorder is not None:
        start, end, i = layout.byteorder
        order = head[start:end]
        if zlib.crc32(order) != crcs[i] or order != b"little":
            return None
    for at, lengths in layout.record_headers:
        local = _slice(length, head, tail, at, at + 30)
        if local is None or local[:4] + local[26:30] != lengths:
            return None
    for start, end, expected in layout.records:
        if _slice(length, head, tail, start, end) != expected:
            return None
    for start, end, i in layout.free:
        found = _slice(length, head, tail, start, end)
        if found is None or may_name_global(found) or zlib.crc32(found) != crcs[i]:
            return None
    return Matched(pkl, layout)


def _slice(length: int, head: bytes, tail: bytes, start: int, end: int) -> bytes | None:
    """Bytes ``[start, end)`` of the archive from its first bytes ``head`` or its last bytes ``tail``."""
    if end <= len(head):
        return head[start:end]
    if start >= length - len(tail):
        at = len(tail) - (length - start)
        return tail[at:at + end - start]
    return None


def learn(length: int, head: bytes, tail: bytes, members: list[Member], prefix: str) -> None:
    """Record the layout of an archive the full read just accepted (``members`` from
    :func:`~ckptaudit.formats.zipdir.lean_directory`, ``prefix`` the folder of its ``data.pkl``), if it is the
    canonical one :func:`match` can compare; otherwise do nothing."""
    at = len(tail) - 22
    if at < 76 or len(tail) > length:
        return  # no room for a zip64 record and locator before the end record: not what torch.save writes
    entries, offset_cd = struct.unpack_from("<10xH4xL", tail, at)
    if entries == 0xFFFF or offset_cd == 0xFFFFFFFF:
        return  # the size check would look the counts up in a zip64 record
    if tail[at - 20:at - 16] == b"PK\x06\x07":
        if tail[at - 76:at - 72] != b"PK\x06\x06":
            return
        (offset_cd,) = struct.unpack_from("<48xQ", tail, at - 76)
    back = length - offset_cd
    if not 0 < back <= len(tail) or len(members) != entries:
        return
    # The directory, entry by entry as lean_directory read it, cut around each CRC field (but those of the records
    # torch.save writes alike into every archive: their bytes, and so their CRCs, must be the learnt ones).
    fixed_names = {prefix + n for n in _FIXED_RECORDS}
    fmt: list[str] = ["<"]
    fixed: list[bytes] = []
    crc_at: list[Member] = []
    pos = len(tail) - back
    cut = pos
    for m in members:
        if tail[pos:pos + 4] != b"PK\x01\x02":
            return
        name_len = len(m.filename)
        crc = pos + 16
        if m.filename not in fixed_names:
            fmt.append(f"{crc - cut}sL")
            fixed.append(tail[cut:crc])
            crc_at.append(m)
            cut = crc + 4
        pos += _CENTRAL + name_len
    fmt.append(f"{len(tail) - cut}s")
    fixed.append(tail[cut:])
    index = {m.filename: i for i, m in enumerate(crc_at)}

    hdr_fmt: list[str] = ["<"]
    hdr_fields: list[bytes] = []
    last = 0

    def header(m: Member) -> int | None:
        """Data start of ``m`` from its local header in ``head``; records the header for :func:`match`."""
        nonlocal last
        h = m.header_offset
        if h < last or h + 30 > len(head) or head[h:h + 4] != b"PK\x03\x04":
            return None
        hdr_fmt.append(f"{h - last}x4s22x4s")
        hdr_fields.extend((head[h:h + 4], head[h + 26:h + 30]))
        last = h + 30
        name_len, extra_len = struct.unpack_from("<HH", head, h + 26)
        return h + 30 + name_len + extra_len

    pkl_name, bo_name, data_dir = prefix + "data.pkl", prefix + "byteorder", prefix + "data/"
    storages: dict[str, tuple[int, int]] = {}
    small: dict[str, tuple[int, int, int]] = {}
    records: list[tuple[int, int, bytes]] = []
    free: list[tuple[int, int, int]] = []
    locals_: list[tuple[int, bytes]] = []
    for m in sorted(members, key=lambda m: m.header_offset):
        name = m.filename
        if name in (pkl_name, bo_name):
            start = header(m)
            if start is None or start + m.file_size > len(head) or m.compress_type != 0 \
                    or m.compress_size != m.file_size:
                return
            small[name] = (start, start + m.file_size, index[name])
        elif name.startswith(data_dir) and m.compress_type == 0 and m.compress_size == m.file_size:
            start = header(m)
            # -1: its local header is not in the first bytes; an archive whose pickle uses it is read in full
            storages[name[len(data_dir):]] = (-1 if start is None else start, m.file_size)
        elif name in fixed_names or name == prefix + _FREE_RECORD:
            if m.compress_type != 0 or m.compress_size != m.file_size:
                return
            start = header(m)
            if start is not None and start >= last and start + m.file_size <= len(head):
                # In the first bytes (a DCP item's whole archive): compared with the local headers, in one unpack.
                if name in fixed_names:
                    hdr_fmt.append(f"{start - last}x{m.file_size}s")
                    hdr_fields.append(head[start:start + m.file_size])
                    last = start + m.file_size
                else:
                    free.append((start, start + m.file_size, index[name]))
                continue
            if start is not None:
                return
            # Found through its own local header, in the archive's last bytes (else not learnt).
            local = _slice(length, head, tail, m.header_offset, m.header_offset + 30)
            if local is None or local[:4] != b"PK\x03\x04" or m.compress_type != 0 \
                    or m.compress_size != m.file_size:
                return
            name_len, extra_len = struct.unpack_from("<HH", local, 26)
            start = m.header_offset + 30 + name_len + extra_len
            found = _slice(length, head, tail, start, start + m.file_size)
            if found is None or len(found) != m.file_size:
                return
            locals_.append((m.header_offset, local[:4] + local[26:30]))
            if name in fixed_names:
                records.append((start, start + m.file_size, found))
            else:
                free.append((start, start + m.file_size, index[name]))
        else:
            return  # a member the full read scans as a pickle: archives like this one are always read in full
    if pkl_name not in small:
        return
    if len(_LAYOUTS) >= MAX_LAYOUTS:
        _LAYOUTS.clear()
    _LAYOUTS[(length, tail[-22:])] = Layout(
        length, back, struct.Struct("".join(fmt)), tuple(fixed), struct.Struct("".join(hdr_fmt)), tuple(hdr_fields),
        small[pkl_name], small.get(bo_name), storages, tuple(records), tuple(locals_), tuple(free))
