"""The memoised zip layout of DCP items (``formats/zip/memo.py``) and the one-open-per-file reader.

An archive that matches a learnt layout skips the full structural read; these tests hold that shortcut to the full
read: on real DCP items written by ``torch.distributed.checkpoint.save`` and on damaged copies of them, the reader
with layouts gives exactly what it gives with layouts switched off (same tree, or same error, offset and limit),
and each way an archive can differ from its layout in a place the shortcut compares is refused (or read) as the
full read refuses (or reads) it.
"""

from __future__ import annotations

import io
import os
import random
import shutil
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.formats.dcp.metadata import load_dcp_metadata
from ckptaudit.formats.dcp.reader import read_dcp
from ckptaudit.formats.io.tensors import TensorData
from ckptaudit.formats.zip import memo as ziplayout
from ckptaudit.formats.zip.archive import TorchZipError, TorchZipFile, TorchZipFiles, read_torch_zip


def _items(dcp: Path) -> list[bytes]:
    """Every item archive of a DCP directory, as bytes."""
    md = load_dcp_metadata((dcp / ".metadata").read_bytes())
    files: dict[str, bytes] = {}
    out = []
    for info in md.storage_data.values():
        data = files.setdefault(info.relative_path, (dcp / info.relative_path).read_bytes())
        out.append(data[info.offset:info.offset + info.length])
    return out


@pytest.fixture(scope="module")
def family(scale_checkpoints: dict[str, Path]) -> list[bytes]:
    """The largest group of distinct items that share one layout key (length and end record), pristine."""
    groups: dict[tuple[int, bytes], list[bytes]] = {}
    for data in _items(scale_checkpoints["dcp"]):
        groups.setdefault((len(data), data[-22:]), []).append(data)
    best = max((list(dict.fromkeys(g)) for g in groups.values()), key=len)  # distinct items (data, CRCs)
    assert len(best) >= 3
    return best


def _outcome(read: Callable[[], Any]) -> tuple[Any, ...]:
    try:
        tz = read()
    except TorchZipError as exc:
        return ("refused", str(exc), exc.offset, exc.limit)
    return ("read", tz.loaded, tz.scan, tz.obj)


@contextmanager
def _layouts_off() -> Iterator[None]:
    real = ziplayout.match
    ziplayout.match = lambda length, head, tail: None  # type: ignore[assignment]
    try:
        yield
    finally:
        ziplayout.match = real


def _file_of(tmp_path: Path, archives: list[bytes]) -> tuple[Path, list[tuple[int, int]]]:
    """The archives one after another in one file (as a .distcp holds items), with their (offset, length)."""
    path = tmp_path / "items.distcp"
    places, at = [], 7  # not at offset 0: items sit inside their data file
    with open(path, "wb") as fh:
        fh.write(b"\xee" * at)
        for data in archives:
            fh.write(data)
            places.append((at, len(data)))
            at += len(data)
    return path, places


def _central(data: bytes) -> dict[str, int]:
    """Member name -> offset of its central directory entry."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        names = [i.filename for i in zf.infolist()]
    out, pos = {}, data.index(b"PK\x01\x02")
    while data[pos:pos + 4] == b"PK\x01\x02":
        n, m, k = struct.unpack_from("<3H", data, pos + 28)
        out[data[pos + 46:pos + 46 + n].decode()] = pos
        pos += 46 + n + m + k
    assert sorted(out) == sorted(names)
    return out


def _member(data: bytes, suffix: str) -> tuple[int, int, int]:
    """(local header offset, data start, size) of the member whose name ends with ``suffix``."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        (info,) = [i for i in zf.infolist() if i.filename.endswith(suffix)]
    h = info.header_offset
    n, m = struct.unpack_from("<HH", data, h + 26)
    return h, h + 30 + n + m, info.file_size


def _with_member(data: bytes, suffix: str, new: bytes, fix_crc: bool = True) -> bytes:
    """``data`` with the bytes of member ``suffix`` replaced by ``new`` (same size), its CRC fixed or not."""
    _h, start, size = _member(data, suffix)
    assert len(new) == size
    out = bytearray(data)
    out[start:start + size] = new
    if fix_crc:
        (name,) = [n for n in _central(data) if n.endswith(suffix)]
        struct.pack_into("<L", out, _central(data)[name] + 16, zlib.crc32(new))
    return bytes(out)


def test_items_of_one_layout_are_matched_and_read_as_the_full_read_reads_them(family: list[bytes],
                                                                               tmp_path: Path) -> None:
    path, places = _file_of(tmp_path, family)
    ziplayout.clear()
    with TorchZipFile(str(path)) as f:
        fast = [f.read(o, n) for o, n in places]
        assert all(ziplayout.match(n, family[i], family[i][-4096:]) is not None for i, (o, n) in enumerate(places))
    with _layouts_off():
        full = [read_torch_zip(str(path), o, n) for o, n in places]
    assert fast == full
    assert all(isinstance(tz.obj, TensorData) for tz in fast)
    assert len({tz.obj.pieces[0].data_offset for tz in fast}) == len(family)  # each bound to its own bytes


def _mutants(family: list[bytes], rng: random.Random, count: int) -> list[bytes]:
    """Copies of the family's items damaged where the shortcut compares (directory, local headers, data.pkl,
    byteorder), sometimes with the damaged member's CRC fixed, or damaged in the tensor's data only."""
    out = []
    for _ in range(count):
        data = rng.choice(family)
        d = bytearray(data)
        kind = rng.random()
        if kind < 0.15:  # the tensor's bytes only: still the layout, read through the shortcut
            _h, start, size = _member(data, "data/0")
            for _ in range(rng.randint(1, 3)):
                d[start + rng.randrange(size)] = rng.randrange(256)
        elif kind < 0.35:  # data.pkl or byteorder changed, its CRC fixed: the pickle or order decides
            suffix = rng.choice(("data.pkl", "byteorder"))
            _h, start, size = _member(data, suffix)
            new = bytearray(data[start:start + size])
            new[rng.randrange(size)] = rng.choice((rng.randrange(256), 0x80, ord("."), ord("c")))
            d = bytearray(_with_member(data, suffix, bytes(new)))
        else:  # anywhere in the structure: the first bytes (local headers, data.pkl) or the last (directory)
            for _ in range(rng.randint(1, 2)):
                span = min(len(data), 700)
                at = rng.randrange(span) if rng.random() < 0.5 else len(data) - 1 - rng.randrange(span)
                d[at] = rng.choice((rng.randrange(256), 0, 0xFF, d[at] ^ 1, d[at] ^ 0x80))
        out.append(bytes(d))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_damaged_items_are_judged_exactly_as_by_the_full_read(family: list[bytes], tmp_path: Path,
                                                                seed: int) -> None:
    mutants = _mutants(family, random.Random(seed), 500)
    path, places = _file_of(tmp_path, [*family, *mutants])
    ziplayout.clear()
    matched = []
    real_match = ziplayout.match

    def counting(length: int, head: bytes, tail: bytes) -> Any:
        hit = real_match(length, head, tail)
        matched.append(hit is not None)
        return hit

    ziplayout.match = counting  # type: ignore[assignment]
    try:
        with TorchZipFile(str(path)) as f:
            for o, n in places[:len(family)]:
                f.read(o, n)  # learn the layout from the pristine items
            del matched[:]
            # Each item three times (the later reads find its pickle's scan, and load, memoised), loaded or not.
            fast = [tuple(_outcome(lambda o=o, n=n, load=load: f.read(o, n, load=load)) for load in (True, False, True))
                    for o, n in places[len(family):]]
    finally:
        ziplayout.match = real_match
    with _layouts_off():
        full = [tuple(_outcome(lambda o=o, n=n, load=load: read_torch_zip(str(path), o, n, load=load))
                      for load in (True, False, True)) for o, n in places[len(family):]]
    for i, (a, b) in enumerate(zip(fast, full, strict=True)):
        assert a == b, (i, a, b)
    refused = sum(o[0][0] == "refused" for o in full)
    unsafe = sum(o[0][0] == "read" and not o[0][1] for o in full)
    # Every outcome is exercised: matched and read through the shortcut, refused, not loaded, read in full.
    assert sum(matched) > 50 and refused > 100 and unsafe > 0 and matched.count(False) > 100, \
        (sum(matched), refused, unsafe)


@pytest.mark.parametrize("damage, refusal", [
    ("data.pkl byte, CRC kept", "CRC-32 mismatch"),
    ("data.pkl calls os.system, CRC fixed", None),
    ("byteorder big, CRC fixed", "byte order 'big"),
    ("byteorder byte, CRC kept", "CRC-32 mismatch"),
    ("storage size in the directory", "the archive holds"),
    ("storage local header signature", "bad local header"),
    ("data.pkl local header signature", "does not start with a zip local header"),  # data.pkl is first
    ("storage local header longer", None),
    ("member outside the folder", "outside the"),
    ("storage CRC", None),
])
def test_each_difference_from_a_learnt_layout_is_judged_as_the_full_read_judges_it(
        family: list[bytes], tmp_path: Path, damage: str, refusal: str | None) -> None:
    data = family[0]
    d = bytearray(data)
    central = _central(data)
    if damage == "data.pkl byte, CRC kept":
        _h, start, _n = _member(data, "data.pkl")
        d[start + 5] ^= 1
    elif damage == "data.pkl calls os.system, CRC fixed":
        _h, start, size = _member(data, "data.pkl")
        pkl = data[start:start + size]
        evil = pkl.replace(b"ctorch._utils\n_rebuild_tensor_v2\n", b"cos\nsystem\n" + b"\n" * 22, 1)
        assert evil != pkl and len(evil) == len(pkl)
        d = bytearray(_with_member(data, "data.pkl", evil))
    elif damage == "byteorder big, CRC fixed":
        d = bytearray(_with_member(data, "byteorder", b"big   "))
    elif damage == "byteorder byte, CRC kept":
        _h, start, _n = _member(data, "byteorder")
        d[start] ^= 0x20
    elif damage == "storage size in the directory":
        (name,) = [n for n in central if n.endswith("data/0")]
        size = struct.unpack_from("<L", d, central[name] + 24)[0]
        struct.pack_into("<LL", d, central[name] + 20, size - 4, size - 4)
    elif damage == "storage local header signature":
        h, _start, _n = _member(data, "data/0")
        d[h + 3] ^= 1
    elif damage == "data.pkl local header signature":
        h, _start, _n = _member(data, "data.pkl")
        d[h + 2] ^= 1
    elif damage == "storage local header longer":
        h, _start, _n = _member(data, "data/0")
        struct.pack_into("<H", d, h + 28, struct.unpack_from("<H", d, h + 28)[0] + 4)  # data starts 4 bytes on
    elif damage == "member outside the folder":
        (name,) = [n for n in central if n.endswith("/version") and not n.endswith("format_version")]
        at = central[name] + 46 + name.index("/") - 1
        d[at] ^= 1  # archive/version -> archivd/version: same length, so the same layout key
    elif damage == "storage CRC":
        (name,) = [n for n in central if n.endswith("data/0")]
        d[central[name] + 16] ^= 0xFF
    mutated = bytes(d)
    assert len(mutated) == len(data) and mutated[-22:] == data[-22:]  # same key: the layout is found and compared
    path, places = _file_of(tmp_path, [data, mutated])
    ziplayout.clear()
    with TorchZipFile(str(path)) as f:
        pristine = f.read(*places[0])
        assert ziplayout.match(len(data), data, data[-4096:]) is not None  # learnt
        fast = _outcome(lambda: f.read(*places[1]))
    with _layouts_off():
        full = _outcome(lambda: read_torch_zip(str(path), *places[1]))
    assert fast == full
    if refusal is not None:
        assert fast[0] == "refused" and refusal in fast[1], fast
    elif damage == "data.pkl calls os.system, CRC fixed":
        assert fast[0] == "read" and not fast[1] and "os.system" in fast[2].unsafe
    elif damage == "storage local header longer":
        moved = fast[3].pieces[0].data_offset - places[1][0]
        assert fast[0] == "read" and moved == pristine.obj.pieces[0].data_offset - places[0][0] + 4
    else:
        assert fast[0] == "read" and fast[1]


def test_a_damaged_item_among_items_of_its_shape_is_a_finding_of_read_dcp(
        scale_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """The layout learnt from an item's neighbours in the same read does not let a damaged item pass."""
    src = scale_checkpoints["dcp"]
    ckpt = tmp_path / "dcp"
    shutil.copytree(src, ckpt)
    md = load_dcp_metadata((ckpt / ".metadata").read_bytes())
    seen: dict[tuple[int, bytes], list[tuple[str, Any]]] = {}
    for index, info in md.storage_data.items():
        raw = (ckpt / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
        seen.setdefault((len(raw), raw[-22:]), []).append((index.fqn, info))
    fqn, info = max(seen.values(), key=len)[-1]  # the last item of the largest family: read after the others
    blob = bytearray((ckpt / info.relative_path).read_bytes())
    archive = bytes(blob[info.offset:info.offset + info.length])
    _h, start, _n = _member(archive, "data.pkl")
    blob[info.offset + start + 3] ^= 1
    (ckpt / info.relative_path).write_bytes(bytes(blob))
    ziplayout.clear()
    clean = read_dcp(str(src))
    assert not clean.findings and len(ziplayout._LAYOUTS) > 0
    damaged = read_dcp(str(ckpt))
    (f,) = [f for f in damaged.findings if f.subject == fqn]
    assert f.code == "integrity.corrupt" and "CRC-32 mismatch" in f.message


def test_one_open_per_data_file_and_closed_after(family: list[bytes], tmp_path: Path) -> None:
    path, places = _file_of(tmp_path, family)
    fds = len(os.listdir("/proc/self/fd"))
    files = TorchZipFiles()
    try:
        first = [files.read(str(path), o, n) for o, n in places]
        assert len(files._open) == 1
        handle = files._open[str(path)]
        assert [files.read(str(path), o, n) for o, n in places] == first and files._open[str(path)] is handle
    finally:
        files.close()
    assert not files._open and len(os.listdir("/proc/self/fd")) == fds  # the descriptor is closed
    with pytest.raises(TorchZipError, match="exceeds the file"):
        TorchZipFile(str(path)).read(places[-1][0], places[-1][1] + 1)


@pytest.mark.parametrize("crc", ["fixed", "kept"])
def test_a_memoised_pickle_whose_storage_does_not_fit_the_layout_is_refused(family: list[bytes], tmp_path: Path,
                                                                            crc: str) -> None:
    """The pickle of a tensor of another size, loaded (and memoised) from a real torch.save file, then put into an
    item of the learnt layout: its scan and load are memoised, so the CRC check (a smaller tensor, CRC kept) or the
    storage check against the layout's sizes (a larger tensor, CRC fixed: the layout matches) is all that stands
    between it and a wrong read."""
    import torch

    data = family[0]
    path, places = _file_of(tmp_path, [data])
    ziplayout.clear()
    with TorchZipFile(str(path)) as f:
        item = f.read(*places[0]).obj
    assert isinstance(item, TensorData)
    _h, start, size = _member(data, "data.pkl")
    pkl = data[start:start + size]

    def saved(shape: tuple[int, ...], where: Path) -> bytes:
        torch.save(torch.zeros(shape, dtype=getattr(torch, item.dtype.name)), where)
        with zipfile.ZipFile(where) as zf:
            return zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))

    assert saved(item.shape, tmp_path / "same.pt") == pkl  # DCP's item pickle is torch.save's of the tensor
    rows = item.shape[0]
    candidates = [n for n in ((rows * 2, rows + 1) if crc == "fixed" else (rows // 2, rows - 1)) if n > 0]
    pickles = {n: saved((n, *item.shape[1:]), tmp_path / f"{n}.pt") for n in candidates}
    n = next(n for n in candidates if len(pickles[n]) == len(pkl))  # the same length keeps the layout
    assert read_torch_zip(str(tmp_path / f"{n}.pt")).loaded  # scanned and loaded: memoised
    other = pickles[n]
    crafted = _with_member(data, "data.pkl", other, fix_crc=crc == "fixed")
    path, places = _file_of(tmp_path, [data, crafted])
    with TorchZipFile(str(path)) as f:
        f.read(*places[0])
        matched = ziplayout.match(len(crafted), crafted, crafted[-4096:]) is not None
        assert matched == (crc == "fixed")  # a CRC that does not match the pickle: no layout match
        fast = _outcome(lambda: f.read(*places[1]))
    with _layouts_off():
        full = _outcome(lambda: read_torch_zip(str(path), *places[1]))
    assert fast == full
    assert fast[0] == "refused" and ("the archive holds" if crc == "fixed" else "CRC-32 mismatch") in fast[1], fast
