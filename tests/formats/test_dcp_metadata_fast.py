"""DCP ``.metadata`` loads through the C unpickler when the scan proved it plain, and only then.

The fast load (:func:`ckptaudit.formats.dcp.metadata.load_dcp_metadata` with the scan's result) must give what the
restricted unpickler gives on every real save, and must never accept what the restricted unpickler refuses:
the scan's ``plain`` proof (string or record keys, one ``BUILD`` on each ``NEWOBJ`` result, the build budget),
the charged calls and the bounded rebuild each stand for one of the restricted unpickler's defences, and each
test below breaks exactly one of them.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import pickletools
import struct
from pathlib import Path
from typing import Any

import pytest

import real_checkpoints as rc
from ckptaudit.formats.dcp import metadata as dm
from ckptaudit.formats.dcp.metadata import load_dcp_metadata
from ckptaudit.formats.dcp.reader import MAX_METADATA_BYTES
from ckptaudit.formats.pickle.allowlist import DCP_METADATA_GLOBALS
from ckptaudit.formats.pickle.scan import (
    BUILD_BUDGET_BASE,
    BUILD_BUDGET_FACTOR,
    MAX_NODES,
    build_budget,
    opcode_limit,
    scan,
)
from ckptaudit.formats.pickle.walk import Walker

M61 = (1 << 61) - 1


def _scan(data: bytes) -> Any:
    return scan(data, DCP_METADATA_GLOBALS, max_opcodes=opcode_limit(len(data)))


def _outcome(data: bytes, fast: bool) -> Any:
    """What the load gives: the metadata, or the error's type and message."""
    try:
        return load_dcp_metadata(data, _scan(data) if fast else None)
    except Exception as exc:
        return type(exc).__name__, str(exc)


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return rc.dcp_checkpoint(tmp_path_factory.mktemp("fastmd") / "dcp", {"extra": {"step": 3, "tag": "x"}})


def _with(ckpt: Path, **fields: Any) -> bytes:
    """The real ``.metadata`` of ``ckpt`` (torch's own ``Metadata``) with ``fields`` replaced, pickled as DCP does."""
    md = rc.read_dcp_metadata(ckpt)
    for k, v in fields.items():
        setattr(md, k, v)
    return pickle.dumps(md, protocol=4)


def test_real_saves_are_plain_and_load_the_same_both_ways(dcp_dir: Path, fsdp_run: dict[str, Any]) -> None:
    for ckpt in (dcp_dir, fsdp_run["dir"] / "faithful"):
        data = (ckpt / ".metadata").read_bytes()
        assert _scan(data).plain, ckpt  # what DCP writes takes the fast load
        fast, slow = _outcome(data, True), _outcome(data, False)
        assert fast == slow and not isinstance(fast, tuple), (fast, slow)
        assert len(fast.storage_data) >= 4
        # The fast load itself succeeds (a failure would fall back to the restricted load silently: equal, slow).
        assert dm.rebuild(dm._PlainLoader(data, dm._fast_table(len(data))).load()) == slow


def test_a_large_jobs_metadata_is_not_refused_for_its_opcode_count(dcp_dir: Path, fsdp_run: dict[str, Any]) -> None:
    # A real .metadata holds 70-110 opcodes per tensor shard, and a 70B model with Adam state on a few hundred
    # ranks has millions of shards (a fixed limit of 20M opcodes refused such saves from ~200k shards on). Whatever
    # size the byte limit lets through, the opcode limit must let through a real file of that size: at the
    # density torch writes (measured here, on a one-process and an FSDP save), up to the largest size accepted.
    for ckpt in (dcp_dir, fsdp_run["dir"] / "faithful"):
        data = (ckpt / ".metadata").read_bytes()
        opcodes = sum(1 for _ in pickletools.genops(data))
        assert _scan(data).error is None
        for size in (len(data), 64 << 20, MAX_METADATA_BYTES):
            assert opcode_limit(size) >= opcodes / len(data) * size, (ckpt, size, opcodes / len(data))


def test_a_large_jobs_metadata_is_not_refused_for_what_it_builds(dcp_dir: Path, fsdp_run: dict[str, Any],
                                                                 tmp_path: Path) -> None:
    # What the walk estimates a real .metadata builds, per byte, grows with the share of small entries: 14-16x for
    # the realistic benchmark's saves, ~20x for a save of many small tensors (this one), where the budget was 16x
    # (+32 MiB): a one-process save of 45k tensors took the restricted load and was refused as an amplification.
    # Real files of any size up to 64 MiB must stay plain with room to spare (a quarter of the budget).
    import torch

    many = rc.dcp_checkpoint(tmp_path / "many", {"experts": {f"{i // 16}.w{i % 16}": torch.full((4,), float(i))
                                                             for i in range(2000)}})
    for ckpt in (dcp_dir, fsdp_run["dir"] / "faithful", many):
        data = (ckpt / ".metadata").read_bytes()
        walker = Walker(io.BytesIO(data), DCP_METADATA_GLOBALS, opcode_limit(len(data)), data)
        walker.run()
        per_byte = walker.cost / len(data)
        assert walker.plain and per_byte > 8, (ckpt, per_byte)  # (what the estimate is, for the record)
        for size in (len(data), 8 << 20, 64 << 20):
            assert 1.25 * per_byte * size <= build_budget(size), (ckpt, size, per_byte)


def test_colliding_integer_keys_are_not_plain(dcp_dir: Path) -> None:
    # 200 integer keys that all hash to 0: the C unpickler would build the dict in quadratic time; the restricted
    # unpickler counts the collisions. Keys other than strings and records keep a pickle off the fast load.
    data = _with(dcp_dir, planner_data={i * M61: ("a",) for i in range(1, 200)})
    assert not _scan(data).plain
    fast = _outcome(data, True)
    assert fast == _outcome(data, False) and fast[0] == "PickleLimitError" and "share the hash value" in fast[1]


def test_a_second_build_through_the_memo_is_not_plain(dcp_dir: Path) -> None:
    data = pickle.dumps(rc.read_dcp_metadata(dcp_dir), protocol=4)
    # Before Metadata's own BUILD: its state["all_local_plans"] = (the first record NEWOBJ made, fetched from the
    # memo and BUILT again with an empty state). The rebuild never reads that field as a record, so only the
    # one-BUILD rule can refuse it.
    slot, memo, last = None, 0, ""
    import pickletools

    for op, _arg, _pos in pickletools.genops(data):
        if op.name == "MEMOIZE":
            if last == "NEWOBJ" and slot is None:
                slot = memo
            memo += 1
        last = op.name
    assert slot is not None and data.endswith(b"b.")
    data = data[:-2] + b"\x8c\x0fall_local_plans" + b"j" + struct.pack("<I", slot) + b"}bsb."
    assert not _scan(data).plain
    fast = _outcome(data, True)
    assert fast == _outcome(data, False) and fast[0] == "UnsafeBuildError"


def test_build_on_a_global_is_not_plain() -> None:
    data = b"\x80\x04\x8c\x05torch\x8c\x07float32\x93)b."  # BUILD on torch.float32 itself
    assert _scan(data).loadable and not _scan(data).plain


def test_opcode_amplification_past_the_budget_is_not_plain() -> None:
    n = (BUILD_BUDGET_BASE // (64 - BUILD_BUDGET_FACTOR)) + 1000  # empty dicts: 1 byte each, 64 bytes built
    data = b"\x80\x04](" + b"}" * n + b"e."
    result = _scan(data)
    assert result.loadable and not result.plain
    assert _scan(b"\x80\x04](" + b"}" * 1000 + b"e.").plain  # the same shape within the budget is plain


class _Joined:
    """Pickles as ``pathlib.PosixPath(*parts)`` with one shared tuple of 128 parts of 4000 characters: a few
    bytes of pickle per call, half a MB built per call."""

    PARTS = ("x" * 4000,) * 128

    def __reduce__(self) -> tuple[Any, ...]:
        return pathlib.PosixPath, self.PARTS


def test_calls_are_charged_on_the_fast_load(dcp_dir: Path) -> None:
    # planner_data entries that are not key paths are dropped by the rebuild, so only the call budget can refuse
    # this metadata: 200 calls joining 512 KB each from a pickle of ~5 KB.
    data = _with(dcp_dir, planner_data={"k": [_Joined() for _ in range(200)]})
    assert len(data) < 20_000
    result = _scan(data)
    assert result.plain, "the fast load must be the one tried"
    fast = _outcome(data, True)
    assert fast == _outcome(data, False)
    assert fast[0] == "PickleLimitError" and "copy amplification" in fast[1]


def test_shared_chunk_lists_are_bounded_on_the_fast_load(dcp_dir: Path) -> None:
    # One list of 5000 chunks shared by 2100 entries through the memo: 10.5M chunks once expanded, a few hundred
    # KB of pickle. Every consumer walks each entry's chunks, so both loads refuse it.
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    chunks = [ChunkStorageMetadata(offsets=torch.Size([i]), sizes=torch.Size([1])) for i in range(5000)]
    tsm = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([5000]), chunks)
    entries = {f"p{i}": tsm for i in range(2100)}
    assert 5000 * 2100 > MAX_NODES
    data = _with(dcp_dir, state_dict_metadata=entries)
    assert _scan(data).plain
    fast = _outcome(data, True)
    assert fast[0] == "PickleLimitError", fast
    assert _outcome(data, False)[0] == "PickleLimitError"


def test_put_is_not_plain() -> None:
    # BINPUT may name any slot up to the bytes read: the C unpickler's memo array would be that long.
    result = _scan(b"\x80\x03]q\x00.")
    assert result.loadable and not result.plain
    assert _scan(b"\x80\x04]\x94.").plain


def test_a_storage_entry_listed_twice_is_refused_both_ways(dcp_dir: Path, tmp_path: Path) -> None:
    # The second entry for one (fqn, offsets) would decide where that item's bytes are: which one DCP reads depends
    # on its dict. Both loads refuse the metadata, and the audit says so.
    import shutil

    from torch.distributed.checkpoint.metadata import MetadataIndex

    from ckptaudit.auditing.judge import run_audit

    md = rc.read_dcp_metadata(dcp_dir)
    (index, info), *_ = md.storage_data.items()
    # torch's MetadataIndex hashes on (fqn, offset): a second key of another name, renamed in the bytes
    stand_in = "#" * len(index.fqn.encode())
    md.storage_data[MetadataIndex(stand_in, index.offset)] = info
    data = pickle.dumps(md, protocol=4)
    assert data.count(stand_in.encode()) == 1
    data = data.replace(stand_in.encode(), index.fqn.encode())
    assert _scan(data).plain, "the fast load must be the one tried"
    fast = _outcome(data, True)
    assert fast == _outcome(data, False)
    assert isinstance(fast, tuple) and fast[0] == "MetadataShapeError" and "twice" in fast[1], fast
    bad = tmp_path / "dcp"
    shutil.copytree(dcp_dir, bad)
    (bad / ".metadata").write_bytes(data)
    report = run_audit(str(bad))
    assert any(f.code == "integrity.corrupt" and "twice" in f.message for f in report.findings), report.findings
