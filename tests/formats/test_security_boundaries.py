"""Security checks held at their exact boundary, each against torch's own reading (issue 36: each of these was
broken on purpose and the suite stayed green): the longest member name torch lists intact, a storage referenced
with another dtype of the same size, and the legacy tar test's failures other than "not a tar"."""

from __future__ import annotations

import io
import pickle
import tarfile
from pathlib import Path

import pytest
import torch

from ckptaudit.formats import open_checkpoint
from ckptaudit.formats.pickle.legacy import TAR_BLOCK, reads_as_tar
from ckptaudit.formats.zip.miniz import MAX_NAME_BYTES
from zip_mutants import Zip, members_of, stored, torch_pickle, torch_save_bytes


def _problems(path: Path) -> list[str]:
    with open_checkpoint(str(path)) as ckpt:
        return [f"{f.code}: {f.message}" for f in ckpt.findings if f.code.startswith(("integrity.", "security."))]


@pytest.mark.parametrize("length", [MAX_NAME_BYTES - 1, MAX_NAME_BYTES, MAX_NAME_BYTES + 1, MAX_NAME_BYTES + 2])
def test_member_names_are_accepted_exactly_as_long_as_torch_lists_them(length: int, tmp_path: Path) -> None:
    members = members_of(torch_save_bytes({"w": torch.arange(4.0)}))
    top = members[0].name.partition(b"/")[0] + b"/"
    name = top + b"n" * (length - len(top))
    assert len(name) == length
    path = tmp_path / "ckpt.pt"
    path.write_bytes(Zip([*members, stored(name, b"extra")]).build())
    # torch's own listing (getAllRecords copies each name into a 512-byte buffer)
    listed = set(torch._C.PyTorchFileReader(str(path)).get_all_records())
    intact = name.decode()[len(top):] in listed
    assert intact == (length <= 511), (length, intact)  # torch's limit, measured: the constant must be it
    problems = _problems(path)
    if length <= MAX_NAME_BYTES:
        assert not problems, problems
    else:
        assert any("torch lists names cut at 511" in p for p in problems), problems


def test_a_storage_referenced_again_with_another_dtype_of_the_same_size_is_refused(tmp_path: Path) -> None:
    x = torch.arange(4.0).to(torch.float16)
    obj = {"a": x, "b": x[1:3]}  # two references to one storage
    members = members_of(torch_save_bytes(obj))
    # the first reference says bfloat16 (2 bytes, 4 elements, as the record holds), the second float16: same count
    data, records = torch_pickle(obj, {"0": ("0", "BFloat16Storage", None)}, first_only=True)
    assert records == {"0": 8}
    i = next(i for i, m in enumerate(members) if m.name.endswith(b"/data.pkl"))
    members[i] = stored(members[i].name, data)
    path = tmp_path / "ckpt.pt"
    path.write_bytes(Zip(members).build())
    loaded = torch.load(str(path), weights_only=True)
    assert loaded["a"].dtype == loaded["b"].dtype == torch.bfloat16  # torch types the storage by its first reference
    problems = _problems(path)
    assert any("referenced as 4 bfloat16 elements and again as 4 float16 elements" in p for p in problems), problems


def _block(text: bytes) -> bytes:
    return (text * (TAR_BLOCK // len(text) + 1))[:TAR_BLOCK]


def test_the_tar_test_takes_only_tarfiles_header_errors_as_not_a_tar(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    """torch.load falls back from the legacy tar to the pickle stream on ``tarfile.TarError`` only; any other
    failure of tarfile fails the load. So only tarfile's header errors mean "not a tar": a file on which tarfile
    fails otherwise must not be read as a pickle (torch would not load it as one)."""
    block = _block(pickle.dumps({"w": 1}, protocol=2))
    assert not reads_as_tar(block)  # tarfile's HeaderError: not a tar, as torch decides
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("storages")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    assert reads_as_tar(buf.getvalue()[:TAR_BLOCK])

    path = tmp_path / "state.pkl"
    path.write_bytes(pickle.dumps({"w": list(range(400))}, protocol=2))
    assert path.stat().st_size >= TAR_BLOCK
    assert not _problems(path)  # read as the pickle it is
    for error in (ValueError("odd number"), OverflowError("huge"), UnicodeDecodeError("ascii", b"\xff", 0, 1, "no"),
                  RuntimeError("other")):
        def fails(*_args: object, error: Exception = error) -> None:
            raise error

        monkeypatch.setattr(tarfile.TarInfo, "frombuf", classmethod(fails))
        assert reads_as_tar(block), error  # tarfile failed otherwise: torch.load fails too, never reads the pickle
        problems = _problems(path)
        assert any("legacy .tar" in p for p in problems), (error, problems)
