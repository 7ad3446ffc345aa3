"""Fixed cases at the edges where a reader's fast path shortcuts its general one: each must read as the general
path (and the consumer) does, or defer to it.

- Pickle: the in-memory walk (``scan`` of bytes, walked by index) against the stream walk (``scan`` of a stream),
  on opcodes straight after a ``MARK``: a memo store with nothing above the mark, a ``BUILD``, ``TUPLE1..3``,
  ``REDUCE``/``NEWOBJ``, ``SETITEM``, ``APPEND``, ``DUP`` that would pop the mark. Python's own unpickler refuses
  every one ("unexpected MARK found"); both walks must refuse it too, with the same error at the same offset (the
  stricter reading wins: a walk that accepted one would vet a pickle the consumer cannot load the same way).
- Zip: the lean central-directory reader (``zipdir.lean_directory``) reads a ``torch.save`` archive's end record
  from its last 22 bytes only where that record's signature is the last one in the tail; an end record that holds
  a second signature is left to ``zipfile``.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import Path

import pytest

from ckptaudit.formats.pickle.scan import scan
from ckptaudit.formats.zip.central import TAIL_BYTES, Region, lean_directory

P4 = b"\x80\x04"

AFTER_MARK = {
    # name: (pickle, the error both walks give)
    "MEMOIZE": (P4 + b"K\x01(\x94t.", "MEMOIZE with nothing to remember"),
    "BINPUT": (P4 + b"K\x01(q\x00t.", "BINPUT with nothing to remember"),
    "LONG_BINPUT": (P4 + b"K\x01(r\x00\x00\x00\x00t.", "LONG_BINPUT with nothing to remember"),
    "PUT": (b"\x80\x02K\x01(p0\nt.", "PUT with nothing to remember"),
    "MEMOIZE after a memoized MARK-less value": (P4 + b"K\x01\x94(\x94t.", "MEMOIZE with nothing to remember"),
    "BUILD": (P4 + b"K\x01K\x02(bt.", "stack underflow at BUILD (it would pop a MARK)"),
    "BUILD one above": (P4 + b"K\x01(K\x02bt.", "stack underflow at BUILD (it would pop a MARK)"),
    "TUPLE1": (P4 + b"K\x01(\x85t.", "stack underflow at TUPLE1 (it would pop a MARK)"),
    "TUPLE2 one above": (P4 + b"K\x01(K\x02\x86t.", "stack underflow at TUPLE2 (it would pop a MARK)"),
    "TUPLE3 two above": (P4 + b"K\x01(K\x02K\x03\x87t.", "stack underflow at TUPLE3 (it would pop a MARK)"),
    "REDUCE": (P4 + b"K\x01)(Rt.", "stack underflow at REDUCE (it would pop a MARK)"),
    "NEWOBJ": (P4 + b"K\x01)(\x81t.", "stack underflow at NEWOBJ (it would pop a MARK)"),
    "SETITEM": (P4 + b"}K\x01(K\x02st.", "stack underflow at SETITEM (it would pop a MARK)"),
    "APPEND": (P4 + b"]K\x01(at.", "stack underflow at APPEND (it would pop a MARK)"),
    "DUP": (P4 + b"K\x01(2t.", "stack underflow at DUP (it would pop a MARK)"),
    "STOP": (P4 + b"K\x01(.", "stack underflow at STOP (it would pop a MARK)"),
}


@pytest.mark.parametrize("case", list(AFTER_MARK))
def test_an_opcode_straight_after_a_mark_is_refused_alike_by_both_walks(case: str) -> None:
    data, error = AFTER_MARK[case]
    with pytest.raises(pickle.UnpicklingError, match="MARK"):
        pickle.loads(data)  # the consumer refuses it
    fast = scan(data)
    stream = scan(io.BufferedReader(io.BytesIO(data)))
    assert fast.error == stream.error == error, (fast, stream)
    assert fast.error_offset == stream.error_offset
    assert not fast.loadable and not fast.plain


def test_the_same_opcodes_above_an_item_are_read_alike_and_accepted() -> None:
    # The controls: each opcode with something to act on above the mark walks cleanly on both paths, and loads.
    for data in (P4 + b"K\x01(K\x02\x94t.", P4 + b"K\x01(K\x02q\x00t.", P4 + b"(K\x01K\x02\x86t.",
                 P4 + b"](K\x01K\x02e.", P4 + b"}(K\x01K\x02u."):
        pickle.loads(data)
        fast, stream = scan(data), scan(io.BufferedReader(io.BytesIO(data)))
        assert fast.error is None and stream.error is None and fast.end == stream.end == len(data), data


def _lean(data: bytes) -> object:
    fd = os.memfd_create("archive")
    try:
        os.write(fd, data)
        region = Region(fd, 0, len(data))
        return lean_directory(region, region.read_at(len(data) - min(len(data), TAIL_BYTES), TAIL_BYTES))
    finally:
        os.close(fd)


@pytest.mark.parametrize("field", [4, 8, 12, 16])
def test_an_end_record_holding_a_second_signature_is_left_to_zipfile(tmp_path: Path, field: int) -> None:
    import torch

    torch.save({"w": torch.arange(12.0).reshape(3, 4)}, tmp_path / "ckpt.pt")
    data = (tmp_path / "ckpt.pt").read_bytes()
    assert _lean(data) is not None  # the canonical layout torch writes: read lean
    at = len(data) - 22
    assert data[at:at + 4] == b"PK\x05\x06"
    # The record's disk numbers, entry counts, directory size or offset spelling the signature again (torch's
    # archives are zip64: both zipfile and torch take the directory from the zip64 record).
    twice = data[:at + field] + b"PK\x05\x06" + data[at + field + 4:]
    assert _lean(twice) is None
    with zipfile.ZipFile(io.BytesIO(twice)) as zf:  # zipfile decides, as the audit's general path does
        assert "ckpt/data.pkl" in zf.namelist()
