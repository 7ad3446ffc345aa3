"""One reading: each way torch's reading of a container and ckptaudit's could part, closed one by one.

The attacks of issue 25 end to end (each with a control run showing torch really does what the attacker wants),
then the checks the differential test (``tests/formats/test_differential.py``) cannot see fail because torch's reading
does not change when they are removed: defense in depth against other readers (Python's ``zipfile``), the scan of
every archive member, the memoised layouts, and the live loaders reading the bytes they checked.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import subprocess
import sys
import textwrap
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptaudit.formats import open_checkpoint
from ckptaudit.formats.dcp.reader import UnsafeCheckpointError, check_metadata_safe, read_dcp
from ckptaudit.formats.torchload import vetted_dcp_load, vetted_dcp_reader, vetted_torch_load
from ckptaudit.formats.zip import memo as ziplayout
from ckptaudit.formats.zip.archive import TorchZipError, TorchZipFile, read_torch_zip_bytes
from zip_mutants import Zip, members_of, payload, stored, torch_pickle, torch_save_bytes


def _codes(path: Path) -> dict[str, str]:
    with open_checkpoint(str(path)) as ckpt:
        return {f.code: f.message for f in ckpt.findings}


def _child(code: str, *args: str) -> None:
    """Run ``code`` in a fresh interpreter (the control runs that do execute payloads)."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


_TORCH_LOAD_UNSAFE = """
import sys, torch
try:
    torch.load(sys.argv[1], weights_only=False)
except BaseException:
    pass
"""


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("one-reading") / "ckpt"
    state = {"model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, "step": 5}
    dcp.save(state, checkpoint_id=str(root), no_dist=True)
    return root


def _items(root: Path) -> dict[str, Any]:
    with open(root / ".metadata", "rb") as fh:
        md = pickle.load(fh)
    return {key.fqn: info for key, info in md.storage_data.items()}


def _rewrite_item(src: Path, dest: Path, fqn: str, new: bytes) -> None:
    """``src`` copied to ``dest`` with item ``fqn``'s bytes replaced by ``new`` (the file and .metadata updated)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    with open(src / ".metadata", "rb") as fh:
        md = pickle.load(fh)
    dest.mkdir()
    files: dict[str, bytearray] = {}
    for key, info in sorted(md.storage_data.items(), key=lambda kv: kv[1].offset):
        data = (src / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
        if key.fqn == fqn:
            data = new
        out = files.setdefault(info.relative_path, bytearray())
        md.storage_data[key] = _StorageInfo(info.relative_path, len(out), len(data), info.transform_descriptors)
        out += data
    for rel, data in files.items():
        (dest / rel).write_bytes(bytes(data))
    (dest / ".metadata").write_bytes(pickle.dumps(md))


def _item_bytes(root: Path, fqn: str) -> bytes:
    info = _items(root)[fqn]
    return (root / info.relative_path).read_bytes()[info.offset:info.offset + info.length]


# ----------------------------------------------------------------------------------------------------------------
# The attacks of issue 25


def test_a_dcp_bytes_item_with_a_pickle_before_its_zip_is_refused_everywhere(dcp_dir: Path, tmp_path: Path) -> None:
    marker = tmp_path / "dcp-pwned"
    evil = tmp_path / "evil"
    _rewrite_item(dcp_dir, evil, "step", payload(marker) + _item_bytes(dcp_dir, "step"))
    read = read_dcp(str(evil))
    (f,) = [f for f in read.findings if f.subject == "step"]
    assert f.code == "security.unsafe-pickle" and "legacy loader" in f.message and "io.open" in f.message, f
    with pytest.raises(UnsafeCheckpointError, match="step"):
        check_metadata_safe(str(evil))
    with pytest.raises(UnsafeCheckpointError):
        vetted_dcp_load({"model": {"w": torch.zeros(3, 4)}, "step": 0}, str(evil))
    assert not marker.exists()
    # The control: torch.distributed.checkpoint.load runs it.
    _child("""
        import sys, torch, torch.distributed.checkpoint as dcp
        try:
            dcp.load({"model": {"w": torch.zeros(3, 4)}, "step": 0}, checkpoint_id=sys.argv[1], no_dist=True)
        except BaseException:  # DCP's CheckpointException is not an Exception
            pass
    """, str(evil))
    assert marker.exists(), "the control did not run the payload: the test proves nothing"


def test_a_hidden_data_pkl_behind_a_short_count_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "count-pwned"
    z = Zip(members_of(torch_save_bytes({"w": torch.ones(3)})))
    z.members.append(stored(b"archive/DATA.pkl", payload(marker)))
    pkl = next(i for i, m in enumerate(z.members) if m.name == b"archive/data.pkl")
    z.central_order = [len(z.members) - 1, *[i for i in range(len(z.members) - 1) if i != pkl], pkl]
    z.count_delta = -1  # miniz reads every entry but the real data.pkl
    path = tmp_path / "count.pt"
    path.write_bytes(z.build())
    codes = _codes(path)
    assert "integrity.corrupt" in codes, codes
    assert "same name ignoring case" in codes["integrity.corrupt"] or "counts" in codes["integrity.corrupt"]
    _child(_TORCH_LOAD_UNSAFE, str(path))
    assert marker.exists(), "the control did not run the payload"


def test_a_storage_referenced_as_bf16_first_is_refused_naming_what_torch_hands_back(tmp_path: Path) -> None:
    state = {"a": torch.zeros(0, dtype=torch.bfloat16), "w": torch.arange(8, dtype=torch.float32) / 3}
    # the empty bf16 view's reference rewritten to name the weight's storage (32 bytes: 16 bf16 elements)
    pkl, nbytes = torch_pickle(state, {"0": ("1", "BFloat16Storage", 16)})
    assert nbytes["1"] == 32
    z = Zip(members_of(torch_save_bytes(state)))
    i = next(i for i, m in enumerate(z.members) if m.name.endswith(b"data.pkl"))
    z.members[i] = stored(z.members[i].name, pkl)
    path = tmp_path / "shared.pt"
    path.write_bytes(z.build())
    # The control: torch hands back the float32 weight as bfloat16.
    assert torch.load(str(path), weights_only=True)["w"].dtype == torch.bfloat16
    msg = _codes(path)["integrity.corrupt"]
    assert "storage '1'" in msg and "comes back as bfloat16" in msg, msg


def test_legacy_tar_and_stream_files_are_unvetted_pickles(tmp_path: Path) -> None:
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (("storages", pickle.dumps(0, 2) + pickle.dumps([], 2)), ("tensors", pickle.dumps(0, 2)),
                           ("pickle", payload(tmp_path / "tar-pwned"))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (tmp_path / "old.pt").write_bytes(buf.getvalue())
    codes = _codes(tmp_path / "old.pt")
    assert "security.unvetted-pickle" in codes and "legacy .tar" in codes["security.unvetted-pickle"], codes
    assert "io.open" in codes.get("security.unsafe-pickle", ""), codes  # the payload member is named
    torch.save({"w": torch.ones(2)}, tmp_path / "stream.pt", _use_new_zipfile_serialization=False)
    codes = _codes(tmp_path / "stream.pt")
    assert set(codes) == {"security.unvetted-pickle"}, codes


def test_dcp_items_stored_through_transforms_are_refused_not_left_unjudged(dcp_dir: Path, tmp_path: Path) -> None:
    """DCP undoes an item's storage transforms (zstd) before torch.load; ckptaudit does not read them, so the item
    is refused (a non-tensor item as an unvetted pickle) instead of the audit calling the rest resumable."""
    import shutil

    root = tmp_path / "zstd"
    shutil.copytree(dcp_dir, root)
    with open(root / ".metadata", "rb") as fh:
        md = pickle.load(fh)
    for info in md.storage_data.values():
        info.transform_descriptors = ["stream.zstd/1"]
    (root / ".metadata").write_bytes(pickle.dumps(md))
    codes = {f.subject: f.code for f in read_dcp(str(root)).findings}
    assert codes == {"model.w": "integrity.corrupt", "step": "security.unvetted-pickle"}, codes
    with pytest.raises(UnsafeCheckpointError, match="transforms"):
        check_metadata_safe(str(root))


# ----------------------------------------------------------------------------------------------------------------
# Defense in depth: what torch reads alike either way, refused because other readers would not


def _zip_with(tmp_path: Path, name: str, **changes: Any) -> Path:
    z = Zip(members_of(torch_save_bytes({"w": torch.arange(4.0)})), **changes)
    path = tmp_path / name
    path.write_bytes(z.build())
    return path


def test_bytes_before_or_inside_the_archive_that_python_zipfile_reads_otherwise_are_refused(tmp_path: Path) -> None:
    # `cat prefix archive`: Python's zipfile shifts every offset by the prefix, miniz does not
    msg = _codes(_zip_with(tmp_path, "cat.pt", prefix=b"PK\x03\x04" + bytes(26), relative=True))["integrity.corrupt"]
    assert "zipfile shifts them" in msg, msg
    msg = _codes(_zip_with(tmp_path, "between.pt", between=bytes(12)))["integrity.corrupt"]
    assert "end records start" in msg, msg
    # A zip64 locator naming a record other than the one right before it: miniz reads the one it names (here
    # describing a second copy of the directory), zipfile the one before the locator.
    data = Zip(members_of(torch_save_bytes({"w": torch.arange(4.0)}))).build()
    rec = data.rfind(b"PK\x06\x06")
    loc, eocd = data.rfind(b"PK\x06\x07"), data.rfind(b"PK\x05\x06")
    cd_size, cd_at = struct.unpack_from("<QQ", data, rec + 40)
    hidden = data[cd_at:cd_at + cd_size]
    named = bytearray(data[rec:rec + 56])
    struct.pack_into("<Q", named, 48, rec)  # the named record describes the copy of the directory
    forked = bytearray(data[:rec] + hidden + bytes(named) + data[rec:loc] + data[loc:eocd] + data[eocd:])
    struct.pack_into("<Q", forked, rec + cd_size + 56 + 56 + 8, rec + cd_size)  # the locator names it
    (tmp_path / "z64.pt").write_bytes(bytes(forked))
    msg = _codes(tmp_path / "z64.pt")["integrity.corrupt"]
    assert "zip64 end record the locator names" in msg, msg


def test_the_first_local_header_must_be_at_byte_zero(tmp_path: Path) -> None:
    z = Zip(members_of(torch_save_bytes({"w": torch.arange(4.0)})), prefix=b"PK\x03\x04" + bytes(40))
    path = tmp_path / "lead.pt"
    path.write_bytes(z.build())  # offsets absolute: every member where the directory says, 44 bytes read by none
    msg = _codes(path)["integrity.corrupt"]
    assert "not at byte 0" in msg, msg


@pytest.mark.parametrize("name", [b"archive/d\xe9ta", b"archive/data.pkl\x00x", b"archive/" + b"n" * 600])
def test_names_readers_decode_differently_are_refused(tmp_path: Path, name: bytes) -> None:
    z = Zip(members_of(torch_save_bytes({"w": torch.arange(4.0)})))
    z.members.append(stored(name, b"x"))
    path = tmp_path / "names.pt"
    path.write_bytes(z.build())
    assert "integrity.corrupt" in _codes(path)


@pytest.mark.parametrize("name", ["archive/extra.pkl", "archive/data/9", "archive/notes", "archive/.data/serialization_id"])
def test_every_member_that_is_a_pickle_is_scanned(tmp_path: Path, name: str) -> None:
    z = Zip(members_of(torch_save_bytes({"w": torch.arange(4.0)})))
    evil = payload(tmp_path / "never")
    for i, m in enumerate(z.members):
        if m.name == name.encode():
            z.members[i] = stored(m.name, evil)
            break
    else:
        z.members.append(stored(name.encode(), evil))
    path = tmp_path / "member.pt"
    path.write_bytes(z.build())
    msg = _codes(path)["security.unsafe-pickle"]
    assert name in msg and "io.open" in msg, msg


def test_a_member_that_names_no_global_is_read_as_torch_reads_it(tmp_path: Path) -> None:
    z = Zip(members_of(torch_save_bytes({"w": torch.arange(4.0)})))
    z.members.append(stored(b"archive/notes", b"plain text, no globals"))
    path = tmp_path / "notes.pt"
    path.write_bytes(z.build())
    assert _codes(path) == {} or "security.unsafe-pickle" not in _codes(path)
    assert torch.equal(torch.load(str(path), weights_only=True)["w"], torch.arange(4.0))


def test_a_dcp_item_matched_to_a_learnt_layout_still_has_its_changing_record_scanned(dcp_dir: Path,
                                                                                       tmp_path: Path) -> None:
    """DCP items of one shape are compared with a learnt layout instead of read in full; the one record whose bytes
    differ from item to item (``.data/serialization_id``) must still be scanned."""
    item = _item_bytes(dcp_dir, "model.w")
    members = members_of(item)
    (sid,) = [m for m in members if m.name.endswith(b".data/serialization_id")]
    evil = b"c_io\nopen\n(S'x'\ntR."
    evil = evil + b"0" * (len(sid.data) - len(evil))
    assert len(evil) == len(sid.data)
    start = item.index(sid.data)
    hostile = item[:start] + evil + item[start + len(sid.data):]
    # The central entry's CRC fixed too, so that only the bytes differ (the name's last occurrence is the central one).
    hostile = bytearray(hostile)
    crc_at = hostile.rindex(sid.name) - 46 + 16
    assert hostile[crc_at:crc_at + 4] == zlib.crc32(sid.data).to_bytes(4, "little")
    hostile[crc_at:crc_at + 4] = zlib.crc32(evil).to_bytes(4, "little")
    path = tmp_path / "items.distcp"
    path.write_bytes(item + bytes(hostile))
    ziplayout.clear()
    with TorchZipFile(str(path)) as f:
        assert f.read(0, len(item)).loaded  # learns the layout
        with pytest.raises(TorchZipError, match="serialization_id") as exc:
            f.read(len(item), len(item))
    assert exc.value.code == "security.unsafe-pickle"
    with pytest.raises(TorchZipError, match="serialization_id"):
        read_torch_zip_bytes(bytes(hostile))


# ----------------------------------------------------------------------------------------------------------------
# The live loaders: torch reads the bytes that were checked


def test_safe_torch_load_reads_the_file_it_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.pt"
    torch.save({"w": torch.arange(6.0)}, path)
    swapped = tmp_path / "other.pt"
    torch.save({"w": torch.full((6,), 7.0)}, swapped)
    real_read = TorchZipFile.read

    def read_then_swap(self: TorchZipFile, *args: Any, **kwargs: Any) -> Any:
        out = real_read(self, *args, **kwargs)
        os.replace(swapped, path)  # the path now names another file: torch must not read that one
        return out

    monkeypatch.setattr(TorchZipFile, "read", read_then_swap)
    assert torch.equal(vetted_torch_load(path)["w"], torch.arange(6.0))


def test_safe_dcp_reader_hands_torch_the_bytes_it_checked(dcp_dir: Path, tmp_path: Path) -> None:
    """An item rewritten after the metadata check (same length, a payload first): the reader checks the bytes it
    reads and refuses them; nothing runs."""
    import shutil

    import torch.distributed.checkpoint as dcp

    root = tmp_path / "ckpt"
    shutil.copytree(dcp_dir, root)
    reader = vetted_dcp_reader(root)  # checked here
    info = _items(root)["step"]
    marker = tmp_path / "late-pwned"
    item = _item_bytes(root, "step")
    evil = payload(marker)
    late = evil + item[len(evil):]
    data = bytearray((root / info.relative_path).read_bytes())
    data[info.offset:info.offset + info.length] = late
    (root / info.relative_path).write_bytes(bytes(data))
    state = {"model": {"w": torch.zeros(3, 4)}, "step": 0}
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match="UnsafeCheckpointError"):  # DCP wraps the reader's refusal
        dcp.load(state, storage_reader=reader, no_dist=True)
    assert not marker.exists()
    # And the untouched directory loads, through the same reader's read_data, exactly.
    state = {"model": {"w": torch.zeros(3, 4)}, "step": 0}
    vetted_dcp_load(state, str(dcp_dir))
    assert state["step"] == 5 and torch.equal(state["model"]["w"], torch.arange(12.0).reshape(3, 4))


# ----------------------------------------------------------------------------------------------------------------
# Remote: the same directory behind s3:// gets the same refusal


@pytest.fixture
def s3_env() -> Iterator[Any]:
    from local_s3 import local_s3

    with local_s3("one-reading") as s3:
        yield s3.fs


def test_the_prefixed_dcp_item_is_refused_behind_s3_too(dcp_dir: Path, tmp_path: Path, s3_env: Any) -> None:
    from ckptaudit.auditing.judge import run_audit

    evil = tmp_path / "evil"
    _rewrite_item(dcp_dir, evil, "step", payload(tmp_path / "never") + _item_bytes(dcp_dir, "step"))
    s3_env.put(str(evil), "one-reading/evil", recursive=True)
    report = run_audit("s3://one-reading/evil")
    assert any(f.code == "security.unsafe-pickle" and f.subject == "step" for f in report.findings), report.findings



def test_the_readers_are_asked_in_the_consumers_order() -> None:
    """The registry's precedence is the one reading: by name first (a ``.safetensors`` file is what the safetensors
    library opens, whatever its bytes), then torch.load's own order (the zip, the legacy tar, the pickle stream);
    a DeepSpeed folder is never read as DCP, and only DCP is read as a folder inside a plain directory. A reader
    registered out of order fails here; the behaviour behind each place is held by the tests above and
    test_hostile*."""
    from ckptaudit.formats.contract import directory_readers, file_readers

    assert [r.name for r in file_readers()] == ["safetensors", "json", "empty", "torch.save", "torch.save-legacy-tar",
                                                 "pickle"]
    assert [(r.name, r.nested) for r in directory_readers()] == [("deepspeed", False), ("dcp", True)]
    claimed = {c for r in file_readers() for c in r.claims}
    assert claimed == {".safetensors", ".json", ".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle", ".tar"}


def test_two_readers_cannot_share_a_place() -> None:
    """Precedence is never left to the order of discovery: a reader given another's place, or another's name, is
    refused when it registers."""
    from ckptaudit.formats.contract import FileReader, file_readers, register_reader

    zip_order = next(r.order for r in file_readers() if r.name == "torch.save")
    with pytest.raises(ValueError, match=r"order 40, as 'torch.save' has"):
        register_reader(FileReader("other", order=zip_order, recognises=lambda probe: True, read="x:y"))
    with pytest.raises(ValueError, match="two readers are named 'pickle'"):
        register_reader(FileReader("pickle", order=999, recognises=lambda probe: True, read="x:y"))
    assert "other" not in [r.name for r in file_readers()]


def test_a_file_named_safetensors_holding_a_zip_is_read_as_safetensors(tmp_path: Path) -> None:
    """The name decides before the bytes (the safetensors library would open it): a torch.save archive renamed
    ``.safetensors`` is a corrupt safetensors file, never loaded as an archive; a safetensors file named ``.pt`` is
    not a readable pickle (torch.load refuses it too)."""
    from safetensors.torch import save_file

    torch.save({"w": torch.ones(2)}, tmp_path / "x.safetensors")
    ckpt = open_checkpoint(str(tmp_path / "x.safetensors"))
    assert ckpt.parts == [] and "not a readable safetensors file" in ckpt.findings[0].message
    save_file({"w": torch.ones(2)}, str(tmp_path / "y.pt"))
    ckpt = open_checkpoint(str(tmp_path / "y.pt"))
    assert ckpt.parts == [] and "not a torch.save archive, safetensors file or readable pickle" in ckpt.findings[0].message
