"""torch's reading of a zip archive, restated: what ``torch.load`` and DCP read from a ``torch.save`` archive.

``torch.load`` opens a ``torch.save`` archive (a file, or one DCP item's byte range) with
``torch._C.PyTorchFileReader``: ``caffe2/serialize/inline_container.cc`` over miniz (``third_party/miniz-3.0.2``),
built with ``MINIZ_DISABLE_ZIP_READER_CRC32_CHECKS``. Its reading differs from Python's :mod:`zipfile` in ways a
crafted archive can use to show a checker one pickle and torch another, so ckptaudit reads every archive the way
miniz does (this module) and refuses the archive wherever the two readings could part:

- ``torch.load`` takes the zip path only if the first four bytes are a local header signature; anything else is
  read by its legacy path (``pickle.load`` from byte 0). zipfile finds an archive from its end records, behind
  any prefix. Here: the signature at byte 0, the first local header at byte 0, the central directory where the
  end records put it (no prefix: miniz does not shift offsets as zipfile does).
- miniz finds the end record scanning back from the end (the last signature with 22 bytes after it), takes the
  zip64 record where the locator points (zipfile: right before the locator), and reads exactly as many central
  entries as the end record counts (zipfile: every entry the directory's size holds). Here: :func:`end_records`
  as miniz, and the count must equal the entries the directory holds.
- miniz looks names up ignoring ASCII case (with two names equal but for case it opens either); torch reads every
  record under the first entry's top folder. Here: names ASCII, without NUL, at most 511 bytes (torch lists
  them through a 512-byte buffer), none equal to another ignoring case, all under that one folder, looked up
  ignoring case as miniz does.
- miniz extracts nothing from a member it takes for a directory (a name ending in ``/``, or the DOS directory
  attribute), refuses encrypted and patch members and methods other than stored and deflate. Here: refused.

:func:`end_records` and :func:`directory` raise :class:`ZipReadError` wherever miniz refuses the archive, and
:func:`check_members` wherever the readings could differ; the records torch reads besides ``data.pkl``
(``version``, ``byteorder``, ``.storage_alignment``, ``constants.pkl``) are checked by
:func:`check_records`. The caller is :mod:`ckptaudit.formats.torchzip`.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from dataclasses import dataclass

from ckptaudit.formats.zipdir import Member

__all__ = ["MAX_FILE_FORMAT_VERSION", "EndRecords", "ZipReadError", "check_members", "check_records", "directory",
           "end_records", "version_problem"]

MAX_FILE_FORMAT_VERSION = 10
"""``kMaxSupportedFileFormatVersion`` of ``caffe2/serialize/versions.h`` (torch 2.13): the newest archive version
torch reads (``torch.save`` writes 3)."""
MIN_FILE_FORMAT_VERSION = 1
MAX_NAME_BYTES = 511
"""``getAllRecords`` copies each name into a 512-byte buffer (``MZ_ZIP_MAX_ARCHIVE_FILENAME_SIZE``): a longer name
is listed cut short."""

_EOCD = struct.Struct("<4s4H2LH")
_LOCATOR = struct.Struct("<4sLQL")
_EOCD64 = struct.Struct("<4sQ2H2L4Q")
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")
_U32 = 0xFFFFFFFF
_SEARCH = 4096 + 4093 * 16
"""How far back miniz's ``mz_zip_reader_locate_header_sig`` scans for the end record: 4 KiB blocks overlapping by
three bytes, until one starts ``0xFFFF + 22`` bytes or more before the end."""
_DOS_DIRECTORY = 0x10
_REFUSED_FLAGS = 0x0001 | 0x0020 | 0x0040 | 0x2000
"""Encrypted, compressed patch, strong encryption, masked local header: miniz refuses them."""


class ZipReadError(Exception):
    """The archive is refused: miniz would refuse it, or its reading and ckptaudit's could differ.
    ``offset`` is relative to the archive's start where known."""

    def __init__(self, message: str, offset: int | None = None, code: str = "integrity.corrupt") -> None:
        super().__init__(message)
        self.offset = offset
        self.code = code


@dataclass(frozen=True, slots=True)
class EndRecords:
    """The end records as miniz reads them."""

    at: int
    """Offset of the end-of-central-directory record (22 bytes)."""
    entries: int
    """Central entries miniz reads (the zip64 count where a zip64 record is found)."""
    cd_size: int
    cd_offset: int
    records_at: int
    """Where the end records start: the zip64 record when there is one, else the end record; the central
    directory must end exactly here."""


def end_records(read_at: Callable[[int, int], bytes], length: int, tail: bytes = b"") -> EndRecords:
    """The end records of the archive of ``length`` bytes (``read_at(offset, n)`` reads inside it; ``tail``: its
    last bytes where already read), found and checked as miniz's ``mz_zip_reader_read_central_dir`` does."""
    if length < _EOCD.size:
        raise ZipReadError(f"{length} bytes is too short for a zip archive", 0)
    # miniz scans back from the end: the first signature it meets with a whole record after it.
    window, start = tail[-min(len(tail), length):] if tail else b"", length - min(len(tail), length)
    at = window.rfind(b"PK\x05\x06", 0, len(window) - _EOCD.size + 4)
    if at < 0:
        start = max(0, length - _SEARCH)
        window = read_at(start, length - start)
        if len(window) != length - start:
            raise ZipReadError("the archive ends early (truncated, or changed while being read)", start)
        at = window.rfind(b"PK\x05\x06", 0, len(window) - _EOCD.size + 4)
        if at < 0:
            raise ZipReadError("no zip end-of-central-directory record where torch's zip reader looks for it", None)
    at += start
    (_sig, this_disk, cd_disk, on_disk, entries, cd_size, cd_offset,
     _comment) = _EOCD.unpack_from(window, at - start)
    records_at = at
    if at >= _LOCATOR.size + _EOCD64.size:
        loc = read_at(at - _LOCATOR.size, _LOCATOR.size)
        if len(loc) == _LOCATOR.size and loc[:4] == b"PK\x06\x07":
            _sig, _disk, rec_at, total_disks = _LOCATOR.unpack(loc)
            if rec_at > length - _EOCD64.size:
                raise ZipReadError(f"the zip64 locator points at byte {rec_at}, past the archive", at - _LOCATOR.size)
            rec = read_at(rec_at, _EOCD64.size)
            if len(rec) == _EOCD64.size and rec[:4] == b"PK\x06\x06":
                (_sig, rec_size, _made, _need, this_disk, cd_disk, on_disk, entries, cd_size,
                 cd_offset) = _EOCD64.unpack(rec)
                if rec_size < _EOCD64.size - 12:
                    raise ZipReadError(f"the zip64 end record declares {rec_size} bytes", rec_at)
                if total_disks != 1:
                    raise ZipReadError(f"the zip64 locator counts {total_disks} disks (torch reads one)",
                                       at - _LOCATOR.size)
                if entries > _U32 or on_disk > _U32 or cd_size > _U32:
                    raise ZipReadError("the zip64 end record counts more members or directory bytes than torch's "
                                       "zip reader takes", rec_at)
                if rec_at + _EOCD64.size + _LOCATOR.size != at:
                    raise ZipReadError(
                        f"the zip64 end record the locator names (byte {rec_at}) is not the one right before the "
                        "locator: zip readers differ on which one counts", rec_at)
                records_at = rec_at
    if entries != on_disk:
        raise ZipReadError(f"the end record counts {entries} members in all and {on_disk} on this disk",
                           records_at)
    if this_disk or cd_disk:
        raise ZipReadError("the end record names a multi-disk archive", records_at)
    if cd_size < entries * _CENTRAL.size or cd_offset + cd_size > length:
        raise ZipReadError(f"the end record's central directory ({entries} members, {cd_size} bytes at byte "
                           f"{cd_offset}) does not fit the archive", records_at)
    if cd_offset + cd_size != records_at:
        raise ZipReadError(
            f"the central directory ends at byte {cd_offset + cd_size}, the end records start at byte {records_at}: "
            "bytes before an archive, or between its directory and end records, make zip readers disagree on "
            "where its members are (torch's reads the offsets as they are, Python's zipfile shifts them)",
            cd_offset + cd_size)
    return EndRecords(at, entries, cd_size, cd_offset, records_at)


def directory(read_at: Callable[[int, int], bytes], length: int, end: EndRecords) -> list[Member]:
    """The central entries miniz reads (``end.entries`` of them, in directory order), with the sizes and offsets
    its ``mz_zip_reader_file_stat`` gives (zip64 extra fields applied); raises :class:`ZipReadError` for what
    miniz refuses and for entries the directory holds beyond the count."""
    raw = read_at(end.cd_offset, end.cd_size)
    if len(raw) != end.cd_size:
        raise ZipReadError("the archive ends early (truncated, or changed while being read)", end.cd_offset)
    members: list[Member] = []
    pos = 0
    for _ in range(end.entries):
        if end.cd_size - pos < _CENTRAL.size or raw[pos:pos + 4] != b"PK\x01\x02":
            raise ZipReadError("bad central directory entry", end.cd_offset + pos)
        f = _CENTRAL.unpack_from(raw, pos)
        flags, method, crc, comp, size = f[5], f[6], f[9], f[10], f[11]
        name_len, extra_len, comment_len, disk, external, offset = f[12], f[13], f[14], f[15], f[17], f[18]
        total = _CENTRAL.size + name_len + extra_len + comment_len
        if total > end.cd_size - pos:
            raise ZipReadError("a central directory entry runs past the directory", end.cd_offset + pos)
        name_raw = raw[pos + _CENTRAL.size:pos + _CENTRAL.size + name_len]
        extra = raw[pos + _CENTRAL.size + name_len:pos + _CENTRAL.size + name_len + extra_len]
        if extra and max(comp, size, offset) == _U32:
            size, comp, offset = _zip64_values(extra, size, comp, offset, end.cd_offset + pos)
        # (miniz also refuses a stored member whose two sizes differ: every member is read or located later, and
        # refused there with the safety limits' messages.)
        if disk not in (0, 1):
            raise ZipReadError(f"central entry {name_raw!r} lies on disk {disk}", end.cd_offset + pos)
        if comp != _U32 and offset + 30 + comp > length:
            raise ZipReadError(f"central entry {name_raw!r}: {comp} bytes at byte {offset} run past the archive",
                               end.cd_offset + pos)
        if flags & _REFUSED_FLAGS:
            raise ZipReadError(f"central entry {name_raw!r} is encrypted or a patch (flags {flags:#06x}); torch's "
                               "zip reader refuses it", end.cd_offset + pos)
        if external & _DOS_DIRECTORY:
            raise ZipReadError(f"central entry {name_raw!r} is marked as a directory (external attributes "
                               f"{external:#x}): torch's zip reader extracts nothing from it", end.cd_offset + pos)
        members.append(Member(_name(name_raw, end.cd_offset + pos), offset, comp, size, method, crc))
        pos += total
    if pos != end.cd_size:
        raise ZipReadError(
            f"the end record counts {end.entries} members but the central directory holds more ({end.cd_size - pos} "
            "bytes after them): torch's zip reader reads only the counted ones, other readers all of them",
            end.cd_offset + pos)
    return members


def _zip64_values(extra: bytes, size: int, comp: int, offset: int, at: int) -> tuple[int, int, int]:
    """Sizes and offset from an entry's zip64 extended information field, as ``mz_zip_file_stat_internal`` reads
    them (the first ``0x0001`` field; each value present only where the 32-bit one is ``0xFFFFFFFF``)."""
    pos = 0
    while pos < len(extra):
        if len(extra) - pos < 4:
            raise ZipReadError("truncated zip extra field", at)
        field_id, field_size = struct.unpack_from("<HH", extra, pos)
        if pos + 4 + field_size > len(extra):
            raise ZipReadError("a zip extra field runs past its entry", at)
        if field_id == 1:
            data, values = extra[pos + 4:pos + 4 + field_size], [size, comp, offset]
            k = 0
            for i in range(3):
                if values[i] == _U32:
                    if len(data) - k < 8:
                        raise ZipReadError("a zip64 extra field is too short for the values it replaces", at)
                    (values[i],) = struct.unpack_from("<Q", data, k)
                    k += 8
            return values[0], values[1], values[2]
        pos += 4 + field_size
    return size, comp, offset


def _name(raw: bytes, at: int) -> str:
    if not raw.isascii() or b"\0" in raw:
        raise ZipReadError(f"member name {raw!r} is not plain ASCII: zip readers decode such names differently "
                           "(torch compares raw bytes, Python's zipfile decodes cp437 or UTF-8 and cuts at NUL)", at)
    return raw.decode("ascii")


@dataclass(frozen=True, slots=True)
class Names:
    """The member names, checked: the archive's top folder (``archive/``, with its slash) and every member by its
    name lowered (miniz's lookup)."""

    top: str
    by_lower: dict[str, Member]

    def get(self, record: str) -> Member | None:
        """The member torch opens for ``record`` (a name under the top folder, e.g. ``data/0``)."""
        return self.by_lower.get((self.top + record).lower())


def check_members(members: list[Member], length: int) -> Names:
    """Refuse an archive whose members torch and ckptaudit could read differently (see the module docstring):
    ``members`` in central directory order, offsets relative to the archive of ``length`` bytes."""
    if not members:
        raise ZipReadError("the archive has no members (torch refuses it)", None)
    first = members[0].filename
    slash = first.find("/")
    if slash < 0:
        raise ZipReadError(f"the archive's first member {first!r} is not in a folder: torch reads every record "
                           "from its first member's folder", None)
    top = first[:slash + 1]
    by_lower: dict[str, Member] = {}
    lowest = length
    for m in members:
        name = m.filename
        if len(name) > MAX_NAME_BYTES:
            raise ZipReadError(f"member name {name[:60]!r}... is {len(name)} bytes; torch lists names cut at "
                               f"{MAX_NAME_BYTES}", None)
        if name.endswith("/"):
            raise ZipReadError(f"member {name!r} is a directory entry: torch's zip reader extracts nothing from it",
                               m.header_offset)
        if not name.startswith(top):
            raise ZipReadError(f"member {name!r} lies outside the archive's folder {top!r} (the folder of its first "
                               "member, from which torch reads every record)", m.header_offset)
        low = name.lower()
        other = by_lower.get(low)
        if other is not None:
            raise ZipReadError(
                f"members {other.filename!r} and {name!r} have the same name ignoring case: torch's zip reader looks "
                "names up ignoring case and may open either", m.header_offset)
        by_lower[low] = m
        lowest = min(lowest, m.header_offset)
    if lowest != 0:
        raise ZipReadError(f"the first member's local header is at byte {lowest}, not at byte 0: the bytes before "
                           "it are read by no member", 0)
    return Names(top, by_lower)


_STOULL = re.compile(rb"[ \t\n\v\f\r]*\+?([0-9]+)")


def version_problem(data: bytes) -> str | None:
    """Why torch refuses an archive whose ``version`` record holds ``data`` (``std::stoull``, then the range
    torch reads), or ``None``."""
    m = _STOULL.match(data)
    if m is None:
        return f"its version record {data[:20]!r} is not a number"
    value = int(m.group(1))
    if not MIN_FILE_FORMAT_VERSION <= value <= MAX_FILE_FORMAT_VERSION:
        return (f"its version record says {value}; torch reads versions {MIN_FILE_FORMAT_VERSION} to "
                f"{MAX_FILE_FORMAT_VERSION}")
    return None


def check_records(names: Names, read: Callable[[Member, int], bytes]) -> None:
    """Refuse an archive whose records besides ``data.pkl`` make torch refuse it or read it as something else:
    no ``version`` (``.data/version`` first), a version torch does not read, a ``.storage_alignment`` that is not
    an integer, a ``byteorder`` that is neither ``little`` nor ``big`` exactly, and ``constants.pkl`` (a
    TorchScript archive: ``torch.load`` hands it to ``torch.jit.load``). ``read(member, limit)`` returns a small
    member's bytes."""
    script = names.by_lower.get(names.top.lower() + "constants.pkl")
    if script is not None and script.filename == names.top + "constants.pkl":
        raise ZipReadError(
            f"the archive holds {script.filename!r}: torch.load takes it for a TorchScript archive and hands it to "
            "torch.jit.load (weights_only=True refuses it), which ckptaudit does not vet", script.header_offset,
            code="security.unvetted-pickle")
    version = names.get(".data/version") or names.get("version")
    if version is None:
        raise ZipReadError("the archive has no version record (torch refuses it)", None)
    problem = version_problem(read(version, 64))
    if problem is not None:
        raise ZipReadError(f"{problem} (torch refuses the archive)", version.header_offset)
    align = names.get(".storage_alignment")
    if align is not None:
        text = read(align, 64)
        try:
            int(text)
        except ValueError:
            raise ZipReadError(f".storage_alignment holds {text[:20]!r}, not an integer (torch refuses the archive)",
                               align.header_offset) from None
    order = names.get("byteorder")
    if order is not None:
        text = read(order, 16)
        if text != b"little":
            raise ZipReadError(
                f"byte order {text[:16].decode('ascii', 'replace')!r} is not supported (only little-endian, spelled "
                "exactly 'little' as torch compares it)", order.header_offset)
