"""A lean reader of one zip archive's central directory, for the archives ``torch.save`` writes.

:func:`ckptaudit.formats.zip.archive.read_torch_zip` opens one archive per ``torch.save`` file and one per DCP item
(thousands per checkpoint). :func:`lean_directory` reads the end records and the central directory of the
canonical layout ``torch.save`` writes (no archive comment, no extra fields, ASCII names, the directory right
before the end records, nothing torch's zip reader refuses) from one tail read, and answers ``None`` for anything
else, so that the caller reads it with :func:`ckptaudit.formats.zip.miniz.directory`, the general restatement of
torch's reader, and its errors. Where it answers, it gives the same members, names, offsets, sizes, methods and
CRCs as ``zipfile.ZipFile(...).infolist()`` and as miniz (``tests/formats/test_fast_paths.py`` compares them); every
check the caller makes afterwards (the count, names, local headers one to one, sizes, overlaps) is unchanged.

:class:`Region` serves reads inside the archive with ``os.pread`` and keeps the archive's first bytes (local
headers, ``data.pkl``, ``byteorder``) from one read, or takes them (the whole of a small archive, or an archive
held in memory) from its caller, so one DCP item costs one or two reads.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

__all__ = ["HEAD_BYTES", "TAIL_BYTES", "Member", "Region", "lean_directory"]

HEAD_BYTES = 4096
"""The first bytes of an archive read at once: ``torch.save``'s local headers, ``data.pkl`` of a DCP item,
``byteorder`` and the first storage's local header all lie in its first ~600 bytes."""
TAIL_BYTES = 4096
"""The last bytes of an archive read at once: the end records and a small central directory (one DCP item's
takes ~500 bytes); a larger directory takes one more read."""

_EOCD = struct.Struct("<4s4H2LH")
_LOCATOR = struct.Struct("<4sLQL")
_EOCD64 = struct.Struct("<4sQ2H2L4Q")
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")
_MAX_EXTRACT_VERSION = 63  # zipfile.MAX_EXTRACT_VERSION
_REFUSED_FLAGS = 0x0001 | 0x0020 | 0x0040 | 0x2000
"""Encrypted, compressed patch, strong encryption, masked local header."""


@dataclass(frozen=True, slots=True)
class Member:
    """One central-directory entry: what the reader uses of a ``zipfile.ZipInfo``."""

    filename: str
    header_offset: int
    """Offset of the member's local header, relative to the archive's start."""
    compress_size: int
    file_size: int
    compress_type: int
    CRC: int  # zipfile's spelling, so both sources read alike


class Region:
    """Reads inside ``[start, start + length)`` of an open file: ``pread`` at absolute offsets, with the first
    :data:`HEAD_BYTES` of the region read once and served from memory. Never reads past the region."""

    __slots__ = ("_fd", "_head", "length", "start")

    def __init__(self, fd: int, start: int, length: int, head: bytes | None = None) -> None:
        """``head``, where given, is the region's first bytes already read (at least :data:`HEAD_BYTES`, or the
        whole region)."""
        self._fd, self.start, self.length = fd, start, length
        self._head = head

    @property
    def head(self) -> bytes | None:
        """The region's first bytes where read (at least :data:`HEAD_BYTES`, or the whole region), else ``None``."""
        return self._head

    def read_at(self, at: int, n: int) -> bytes:
        """Up to ``n`` bytes at absolute offset ``at`` (fewer at the region's end; none outside it)."""
        end = self.start + self.length
        n = max(0, min(n, end - at))
        if n == 0 or at < self.start:
            return b""
        rel = at - self.start
        head = self._head
        if head is None and rel + n <= HEAD_BYTES:
            head = self._head = os.pread(self._fd, min(HEAD_BYTES, self.length), self.start)
        if head is not None and rel + n <= len(head):
            return head[rel:rel + n]
        return os.pread(self._fd, n, at)


def lean_directory(region: Region, tail: bytes) -> list[Member] | None:
    """The members of the archive in ``region`` from ``tail``, its last ``min(length, TAIL_BYTES)`` bytes, or
    ``None`` where the archive is not in the canonical layout (then :mod:`zipfile` must read it, with its own
    errors)."""
    length = region.length
    if length < _EOCD.size or len(tail) != min(length, TAIL_BYTES):
        return None
    at = len(tail) - _EOCD.size
    # zipfile's first try: a record in the last 22 bytes, no comment. The last signature in the tail must be
    # this one (a later one inside the record would change which record the size check reads).
    if tail[at:at + 4] != b"PK\x05\x06" or tail[-2:] != b"\0\0" or tail.rfind(b"PK\x05\x06") != at:
        return None
    _sig, _disk, _disk_cd, _n_disk, _n_total, size_cd, offset_cd, _comment = _EOCD.unpack_from(tail, at)
    location = length - _EOCD.size
    zip64 = False
    loc_at = at - _LOCATOR.size
    if loc_at >= 0 and tail[loc_at:loc_at + 4] == b"PK\x06\x07":
        _sig, diskno, reloff, disks = _LOCATOR.unpack_from(tail, loc_at)
        if diskno != 0 or disks > 1:
            return None  # zipfile refuses multi-disk archives: let it say so
        rec_at = loc_at - _EOCD64.size
        if rec_at >= 0 and tail[rec_at:rec_at + 4] == b"PK\x06\x06":
            if reloff != length - _LOCATOR.size - _EOCD64.size - _EOCD.size:
                return None  # the size check reads the record the locator names; zipfile, the one before it
            rec = _EOCD64.unpack_from(tail, rec_at)
            size_cd, offset_cd = rec[8], rec[9]
            zip64 = True
        elif rec_at < 0:
            return None  # a locator with no room for its record: zipfile decides
    concat = location - size_cd - offset_cd - (_EOCD64.size + _LOCATOR.size if zip64 else 0)
    if concat != 0 or size_cd > length:
        return None  # bytes before the archive, or a directory that is not where the end records say
    cd_tail_at = len(tail) - (length - offset_cd)
    if cd_tail_at >= 0:
        directory = tail[cd_tail_at:cd_tail_at + size_cd]
    else:
        directory = region.read_at(region.start + offset_cd, size_cd)
    if len(directory) != size_cd:
        return None
    members: list[Member] = []
    pos = 0
    while pos < size_cd:
        if pos + _CENTRAL.size > size_cd:
            return None
        f = _CENTRAL.unpack_from(directory, pos)
        name_len, extra_len, comment_len = f[12], f[13], f[14]
        if f[0] != b"PK\x01\x02" or extra_len or comment_len or f[3] > _MAX_EXTRACT_VERSION:
            return None
        if f[5] & _REFUSED_FLAGS or f[15] not in (0, 1) or f[17] & 0x10 or f[18] + 30 + f[10] > length:
            return None  # what torch's zip reader refuses: ckptaudit.formats.zip.miniz says why
        raw = directory[pos + _CENTRAL.size:pos + _CENTRAL.size + name_len]
        if len(raw) != name_len or not raw.isascii() or b"\0" in raw:
            return None  # cp437, UTF-8 flags and NUL truncation: zipfile's rules
        members.append(Member(raw.decode("ascii"), f[18], f[10], f[11], f[6], f[9]))
        pos += _CENTRAL.size + name_len
    return members
