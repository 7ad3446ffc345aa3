"""The fast paths of the readers agree with the general ones they shortcut, on real archives and damaged copies.

- :func:`ckptaudit.formats.zip.central.lean_directory` (the central directory of a ``torch.save`` archive or a DCP item,
  from one tail read) gives exactly ``zipfile``'s members, or ``None`` (then ``zipfile`` reads the archive): never
  members ``zipfile`` would not give.
- :func:`ckptaudit.formats.pickle.scan.scan` walks an in-memory pickle by index; the result (globals, verdicts,
  error, its offset, limits) equals the stream walk's on real pickles and on every mutation of them.
"""

from __future__ import annotations

import io
import os
import pickletools
import random
import zipfile
from pathlib import Path
from typing import Any

import pytest

import real_checkpoints as rc
from ckptaudit.formats.dcp.metadata import load_dcp_metadata
from ckptaudit.formats.pickle.allowlist import DCP_METADATA_GLOBALS
from ckptaudit.formats.pickle.scan import PickleScan, opcode_limit, scan
from ckptaudit.formats.zip.central import TAIL_BYTES, Member, Region, lean_directory


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("lean")
    return {"pt": rc.torch_save_checkpoint(d / "ckpt.pt"), "dcp": rc.dcp_checkpoint(d / "dcp")}


def _archives(saved: dict[str, Path]) -> list[tuple[bytes, str]]:
    """Every archive the checkpoints hold: the torch.save file and each DCP item (bytes, label)."""
    out = [(saved["pt"].read_bytes(), "torch.save file")]
    md = load_dcp_metadata((saved["dcp"] / ".metadata").read_bytes())
    for index, info in md.storage_data.items():
        data = (saved["dcp"] / info.relative_path).read_bytes()
        out.append((data[info.offset:info.offset + info.length], f"DCP item {index.fqn}"))
    return out


def _lean(data: bytes) -> list[Member] | None:
    fd = os.memfd_create("archive")
    try:
        os.write(fd, b"\xee" * 100 + data + b"\xee" * 100)  # the archive as a region inside a larger file
        region = Region(fd, 100, len(data))
        tail = region.read_at(100 + len(data) - min(len(data), TAIL_BYTES), TAIL_BYTES)
        return lean_directory(region, tail)
    finally:
        os.close(fd)


def _zipfile(data: bytes) -> list[Member] | None:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            return [Member(i.filename, i.header_offset, i.compress_size, i.file_size, i.compress_type, i.CRC)
                    for i in zf.infolist()]
    except Exception:  # any refusal
        return None


def test_lean_directory_gives_zipfiles_members_for_every_real_archive(saved: dict[str, Path]) -> None:
    archives = _archives(saved)
    assert len(archives) > 10
    for data, label in archives:
        lean = _lean(data)
        assert lean is not None, f"{label}: the canonical layout torch writes fell back to zipfile"
        assert lean == _zipfile(data), label


def test_lean_directory_never_accepts_what_zipfile_reads_otherwise(saved: dict[str, Path]) -> None:
    rng = random.Random(14)
    archives = _archives(saved)
    answered = fell_back = 0
    for _ in range(1500):
        data, label = rng.choice(archives[:8])
        damaged = bytearray(data)
        tail_start = max(0, len(data) - 700)  # the end records and the central directory
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(tail_start, len(data))
            damaged[at] = rng.choice((rng.randrange(256), 0, 0xFF, damaged[at] ^ 1))
        if rng.random() < 0.1:
            damaged += b"comment"
        lean = _lean(bytes(damaged))
        if lean is None:
            fell_back += 1
            continue
        answered += 1
        assert lean == _zipfile(bytes(damaged)), label
    assert answered > 100 and fell_back > 100  # both outcomes exercised


def _same(a: PickleScan, b: PickleScan) -> bool:
    fields = ("globals", "unsafe", "harmless", "error", "error_offset", "limit", "misused")
    if a.error is None and a.end != b.end:
        return False
    return all(getattr(a, f) == getattr(b, f) for f in fields)


def _pickles(saved: dict[str, Path]) -> list[bytes]:
    seeds = [(saved["dcp"] / ".metadata").read_bytes()[:6000]]
    for data, _label in _archives(saved)[:6]:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            seeds += [zf.read(n) for n in zf.namelist() if n.endswith("data.pkl")]
    return seeds


@pytest.mark.parametrize("seed", [0, 1])
def test_scan_of_bytes_equals_the_stream_walk(saved: dict[str, Path], seed: int) -> None:
    seeds = _pickles(saved)
    for data in seeds:  # the real pickles themselves
        assert _same(scan(data, DCP_METADATA_GLOBALS), scan(io.BufferedReader(io.BytesIO(data)), DCP_METADATA_GLOBALS))
    rng = random.Random(seed)
    errors = 0
    hot = b"\x94hj()t\x85\x86\x87R\x81\x8cKMJ\x89}]eu.qb"
    for i in range(1200):
        d = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            k = rng.random() if d else 0.6
            if k < 0.35:
                d[rng.randrange(len(d))] = rng.randrange(256)
            elif k < 0.55:
                at = rng.randrange(len(d))
                del d[at:at + rng.randint(1, 40)]
            elif k < 0.85:
                d.insert(rng.randrange(len(d) + 1), rng.choice(hot))
            else:
                d = d[:rng.randrange(len(d) + 1)]
        data = bytes(d)
        allowed = DCP_METADATA_GLOBALS if i % 2 else frozenset()
        limit: Any = opcode_limit(len(data)) if i % 5 else rng.randint(1, 200)
        fast = scan(data, allowed, max_opcodes=limit)
        slow = scan(io.BufferedReader(io.BytesIO(data)), allowed, max_opcodes=limit)
        assert _same(fast, slow), (i, data[:200], fast, slow)
        errors += fast.error is not None
    assert errors > 300  # the mutations reach the error paths


def _general_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route every archive through zipfile and every in-memory pickle through the stream walk (the readers' general
    paths, which the fast ones shortcut), with the memo caches emptied."""
    import ckptaudit.formats.pickle.walk as pickle_walk
    import ckptaudit.formats.zip.archive as torchzip
    import ckptaudit.formats.zip.memo as ziplayout

    monkeypatch.setattr(torchzip, "lean_directory", lambda region, tail: None)
    monkeypatch.setattr(ziplayout, "match", lambda length, head, tail: None)
    stream_run = pickle_walk.Walker.run

    def run_on_stream(self: Any) -> int:
        self.buf = None
        return stream_run(self)

    monkeypatch.setattr(pickle_walk.Walker, "run", run_on_stream)
    torchzip._SCAN_CACHE.clear()
    torchzip._LOAD_CACHE.clear()


@pytest.mark.parametrize("which", ["single-process DCP", "2-rank FSDP2 DCP"])
def test_records_and_findings_are_those_of_the_general_paths(
    which: str, scale_checkpoints: dict[str, Path], fsdp_run: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptaudit.auditing.judge import run_audit

    path = str(scale_checkpoints["dcp"] if which.startswith("single") else fsdp_run["dir"] / "faithful")
    assert os.path.isfile(os.path.join(path, ".metadata"))
    fast = run_audit(path)
    assert len(fast.tensors) > 10
    with monkeypatch.context() as m:
        _general_paths(m)
        general = run_audit(path)
    assert fast.tensors == general.tensors
    assert fast.findings == general.findings


def test_a_torch_save_of_many_tensors_is_not_refused_for_its_size(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # A torch.save of a mixture-of-experts model's full state holds 100k tensors and more; its data.pkl has 20-30
    # opcodes a tensor (a fixed 5M refused ~200k tensors) and the restricted unpickler estimates it builds ~15-17x
    # its size (the budget was 16x + 32 MiB). Measured on a real file of 3000 tensors, scaled to the sizes a save of
    # 100x as many reaches: within both limits, with a quarter of the build budget to spare.
    import torch

    from ckptaudit.auditing.judge import run_audit
    from ckptaudit.formats.pickle import unpickler
    from ckptaudit.formats.pickle.scan import build_budget

    path = tmp_path / "experts.pt"
    torch.save({"model": {f"layers.{i // 64}.experts.{i % 64}.w": torch.full((4,), float(i)) for i in range(3000)}},
               path)
    spent: list[int] = []
    load = unpickler.RestrictedUnpickler.load

    def measured(self: Any) -> Any:
        try:
            return load(self)
        finally:
            spent.append(self._build_budget - self._build_left)

    monkeypatch.setattr(unpickler.RestrictedUnpickler, "load", measured)
    report = run_audit(str(path))
    assert len(report.tensors) == 3000 and not [f for f in report.findings if f.code.startswith("integrity")]
    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    opcodes = sum(1 for _ in pickletools.genops(data))
    per_byte = max(spent) / len(data)
    assert per_byte > 8, per_byte  # (what the estimate is, for the record)
    for size in (len(data), 100 * len(data), 64 << 20):
        assert opcode_limit(size) >= opcodes / len(data) * size, (size, opcodes)
        assert 1.25 * per_byte * size <= build_budget(size), (size, per_byte)
