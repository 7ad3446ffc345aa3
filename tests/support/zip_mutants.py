"""Hostile inputs crafted from real checkpoints: a zip writer that lays ``torch.save``'s members out however a test
asks (order, counts, prefixes, offsets, flags), ``torch.save``'s pickling with its storage references rewritten,
and a payload pickle that leaves a marker file. Used by ``tests/formats/test_differential.py`` and
``tests/formats/test_one_reading.py``."""

from __future__ import annotations

import io
import pickle
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["Member", "Reduce", "Zip", "members_of", "payload", "stored", "torch_pickle", "torch_save_bytes"]


class Reduce:
    """An object whose pickle calls ``fn(*args)`` when unpickled."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> Any:
        return self.fn, self.args


def payload(marker: Path) -> bytes:
    """A pickle that creates ``marker`` when unpickled (``io.open(marker, "w")``)."""
    return pickle.dumps(Reduce(io.open, str(marker), "w"), protocol=2)


@dataclass
class Member:
    name: bytes
    data: bytes
    """As stored."""
    size: int
    """Declared uncompressed size."""
    method: int = 0
    crc: int = 0
    flags: int = 0
    external: int = 0
    local_name: bytes | None = None
    local_extra: bytes = b""
    zip64: bool = False
    """The central entry's sizes and offset given as 0xFFFFFFFF, with a zip64 extended information field."""


@dataclass
class Zip:
    members: list[Member]
    local_order: list[int] = field(default_factory=list)
    central_order: list[int] = field(default_factory=list)
    count_delta: int = 0
    zip64_count_delta: int = 0
    prefix: bytes = b""
    relative: bool = False
    """Offsets relative to the archive after ``prefix`` (``cat prefix archive``), else absolute."""
    suffix: bytes = b""
    comment: bytes = b""
    zip64: bool = True
    locator_delta: int = 0
    header_delta: dict[int, int] = field(default_factory=dict)
    between: bytes = b""
    """Bytes between the central directory and the end records."""

    def build(self) -> bytes:
        n = len(self.members)
        local = _order(self.local_order, n)
        central = _order(self.central_order, n)
        out = bytearray(self.prefix)
        base = len(self.prefix) if self.relative else 0
        at: dict[int, int] = {}
        for i in local:
            m = self.members[i]
            lname = m.name if m.local_name is None else m.local_name
            at[i] = len(out)
            out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, m.flags, m.method, 0, 0, m.crc, len(m.data), m.size,
                               len(lname), len(m.local_extra)) + lname + m.local_extra + m.data
        cd_at = len(out)
        for i in central:
            if i not in at:
                continue
            m = self.members[i]
            offset = (at[i] - base + self.header_delta.get(i, 0)) & 0xFFFFFFFF
            extra = b""
            comp, size = len(m.data), m.size
            if m.zip64:
                extra = struct.pack("<HHQQQ", 1, 24, size, comp, offset)
                comp = size = offset = 0xFFFFFFFF
            out += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45, m.flags, m.method, 0, 0, m.crc, comp,
                               size, len(m.name), len(extra), 0, 0, 0, m.external, offset) + m.name + extra
        cd_size = len(out) - cd_at
        out += self.between
        count = max(0, len([i for i in central if i in at]) + self.count_delta)
        if self.zip64:
            z_at = len(out)
            z_count = max(0, count + self.zip64_count_delta)
            out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, z_count, z_count, cd_size, cd_at - base)
            out += struct.pack("<IIQI", 0x07064B50, 0, max(0, z_at - base + self.locator_delta), 1)
        out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count & 0xFFFF, count & 0xFFFF, cd_size, cd_at - base,
                           len(self.comment)) + self.comment + self.suffix
        return bytes(out)


def _order(order: list[int], n: int) -> list[int]:
    """``order`` over ``n`` members: indices past the end dropped, members it does not name appended."""
    kept = [i for i in order if i < n]
    return kept + [i for i in range(n) if i not in kept]


def members_of(archive: bytes) -> list[Member]:
    import zipfile

    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        return [Member(i.filename.encode(), zf.read(i), i.file_size, 0, i.CRC) for i in zf.infolist()]


def stored(name: bytes, data: bytes) -> Member:
    return Member(name, data, len(data), 0, zlib.crc32(data))


def torch_pickle(obj: Any, remap: dict[str, tuple[str, str, int | None]] | None = None,
                 first_only: bool = False) -> tuple[bytes, dict[str, int]]:
    """``data.pkl`` of ``obj`` as ``torch.save`` pickles it (protocol 2, one persistent id per storage) and each
    storage key's bytes; ``remap``: storage key -> (key, storage type name, elements or None to keep) written instead, for
    every reference to that storage (or only its first, with ``first_only``)."""
    keys: dict[int, str] = {}
    records: dict[str, int] = {}
    done: set[str] = set()

    class Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            if not isinstance(o, torch.storage.TypedStorage):
                return None
            untyped = o._untyped_storage
            key = keys.setdefault(untyped._cdata, str(len(keys)))
            records.setdefault(key, untyped.nbytes())
            stype, numel = getattr(torch, o._pickle_storage_type()), o._size()
            if remap and key in remap and not (first_only and key in done):
                done.add(key)
                new_key, type_name, new_numel = remap[key]
                return ("storage", getattr(torch, type_name), new_key, "cpu", numel if new_numel is None else new_numel)
            return ("storage", stype, key, "cpu", numel)

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue(), records


def torch_save_bytes(obj: Any, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, **kwargs)
    return buf.getvalue()
