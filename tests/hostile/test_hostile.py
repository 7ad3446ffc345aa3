"""Hostile and broken input: nothing in a checkpoint is ever executed, and no file makes ckptaudit crash, hang or
allocate what it declares.

Every malicious payload writes a sentinel file when it runs. The audit must report it and the sentinel must never
appear; a control run (plain ``pickle.load`` / ``torch.load(weights_only=False)`` /
``torch.distributed.checkpoint.load`` of a second copy, in a child process) shows each payload is live.
Declared sizes and non-regular files are audited in a child process under an address-space limit and a timeout
(:mod:`audit_worker`), so an allocation or a hang fails the test instead of the machine.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import hostile_files as hf
import real_checkpoints as rc
from audit_worker import AuditWorker
from ckptaudit.auditing.judge import run_audit
from ckptaudit.cli import main
from ckptaudit.findings import Precision, RawReport, Severity
from ckptaudit.formats.dcp.reader import UnsafeCheckpointError, check_metadata_safe
from ckptaudit.formats.torchload import vetted_dcp_load, vetted_torch_load
from ckptaudit.report import OutputFormat, render

EXPECTED_GLOBAL = {
    "os.system": "posix.system",
    "subprocess": "subprocess.call",  # pickled as commands.call (protocol 2), which unpicklers map back
    "exec": "builtins.exec",
    "io.open": "io.open",
    "load_from_bytes": "torch.storage._load_from_bytes",
    "stack_global_memo": "os.system",
    "ext": f"<copyreg extension {hf.EXT_CODE}>",
    "inst": "os.system",
    "obj": "os.system",
}


def codes(report: RawReport) -> set[str]:
    return {f.code for f in report.findings}



# --------------------------------------------------------------------------------------------------------------
# Payloads: plain pickles, torch.save archives, Accelerate random states, DCP metadata and DCP non-tensor items


@dataclass(frozen=True)
class Hostile:
    path: Path
    """What the audit is pointed at."""
    subject: str
    """The finding's subject: the file that holds the payload."""
    sentinel: Path
    expected: str
    """The global the finding must name."""
    loader: str
    """How the control loads it unsafely: pickle, torch or dcp."""
    control_path: Path
    control_sentinel: Path


Builder = Callable[[Path, str, dict[str, Path]], tuple[Path, str, str, Path]]
"""(directory, sentinel, bases) -> (audit path, subject, loader, path the control loads)."""


def _plain(kind: str) -> Builder:
    def build(d: Path, sentinel: str, bases: dict[str, Path]) -> tuple[Path, str, str, Path]:
        p = d / "payload.pkl"
        p.write_bytes(hf.payload_pickle(kind, sentinel))
        return p, "payload.pkl", "pickle", p

    return build


def _torch_save(kind: str) -> Builder:
    def build(d: Path, sentinel: str, bases: dict[str, Path]) -> tuple[Path, str, str, Path]:
        p = d / "model.pt"
        hf.torch_save_payload(kind, sentinel, p, bases["pt"])
        return p, "model.pt", "torch", p

    return build


def _accelerate(d: Path, sentinel: str, bases: dict[str, Path]) -> tuple[Path, str, str, Path]:
    ckpt = rc.accelerate_directory(d / "checkpoint", {"sampler": hf.payload_object("os.system", sentinel)})
    return ckpt, "random_states_0.pkl", "torch", ckpt / "random_states_0.pkl"


def _dcp_metadata(d: Path, sentinel: str, bases: dict[str, Path]) -> tuple[Path, str, str, Path]:
    ckpt = d / "dcp"
    shutil.copytree(bases["dcp"], ckpt)
    md = rc.read_dcp_metadata(ckpt)
    md.version = hf.payload_object("os.system", sentinel)  # any field of the metadata will do
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    return ckpt, ".metadata", "dcp", ckpt


def _dcp_bytes_item(d: Path, sentinel: str, bases: dict[str, Path]) -> tuple[Path, str, str, Path]:
    # A non-tensor value saved by DCP itself: torch.distributed.checkpoint.load unpickles it with
    # torch.load(weights_only=False) (DefaultLoadPlanner.load_bytes).
    ckpt = rc.dcp_checkpoint(d / "dcp", {"extra": hf.payload_object("os.system", sentinel)})
    return ckpt, "extra", "dcp", ckpt


def _disguised_training_args(d: Path, sentinel: str, bases: dict[str, Path]) -> tuple[Path, str, str, Path]:
    # transformers.training_args is on the harmless list, but protocol 4 resolves the dotted name "os.system"
    # through the module: transformers.training_args.os.system is os.system.
    pkl = (b"\x80\x04" + hf._op_str("transformers.training_args") + hf._op_str("os.system") + b"\x93"
           + hf._op_str(f"touch {sentinel}") + b"\x85R.")
    p = d / "training_args.bin"
    hf.replace_data_pkl(bases["pt"], p, pkl)
    return p, "training_args.bin", "torch", p


BUILDERS: dict[str, tuple[Builder, str]] = {
    **{f"pickle-{k}": (_plain(k), EXPECTED_GLOBAL[k]) for k in hf.ALL_KINDS},
    **{f"torch.save-{k}": (_torch_save(k), EXPECTED_GLOBAL[k]) for k in hf.ALL_KINDS},
    "accelerate-random_states": (_accelerate, "posix.system"),
    "dcp-metadata": (_dcp_metadata, "posix.system"),
    "dcp-non-tensor-item": (_dcp_bytes_item, "posix.system"),
    "training_args-disguised": (_disguised_training_args, "transformers.training_args.os.system"),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, bases: dict[str, Path]) -> dict[str, Hostile]:
    root = tmp_path_factory.mktemp("hostile")
    out: dict[str, Hostile] = {}
    for name, (build, expected) in BUILDERS.items():
        made = []
        for role in ("audit", "control"):
            d = root / role / name
            d.mkdir(parents=True)
            sentinel = root / role / f"{name}.sentinel"
            made.append((*build(d, str(sentinel), bases), sentinel))
        (path, subject, loader, _, sentinel), (_, _, _, control_path, control_sentinel) = made
        out[name] = Hostile(path, subject, sentinel, expected, loader, control_path, control_sentinel)
    return out


@pytest.mark.parametrize("name", list(BUILDERS))
def test_payload_is_reported_and_never_executed(name: str, corpus: dict[str, Hostile]) -> None:
    h = corpus[name]
    report = run_audit(str(h.path))
    unsafe = [f for f in report.findings if f.code == "security.unsafe-pickle"]
    assert unsafe, [(f.code, f.message) for f in report.findings]
    assert any(f.subject == h.subject and h.expected in f.message for f in unsafe), [
        (f.subject, f.message) for f in unsafe]
    assert all(f.severity is Severity.ERROR for f in unsafe)
    # Nothing else in ckptaudit will load it either.
    if h.loader == "dcp":
        with pytest.raises(UnsafeCheckpointError, match=r"posix\.system"):
            check_metadata_safe(str(h.path))
        import torch

        with pytest.raises(UnsafeCheckpointError):
            vetted_dcp_load({"model": {"w": torch.zeros(2)}, "extra": 0}, str(h.path))
    elif h.loader == "torch" and h.path.is_file():
        with pytest.raises(UnsafeCheckpointError, match="refusing to load"):
            vetted_torch_load(h.path)
    assert not h.sentinel.exists(), f"{name}: the payload ran"


def test_the_rest_of_a_checkpoint_with_a_payload_is_still_audited(corpus: dict[str, Hostile]) -> None:
    report = run_audit(str(corpus["accelerate-random_states"].path))
    model = [t for t in report.tensors if t.component == "model"]
    assert len(model) == 6 and all(t.hash is not None and t.precision is Precision.EXACT for t in model)
    assert any(t.component == "optimizer" and t.hash is not None for t in report.tensors)
    found = {c.kind.value for c in report.components if c.found}
    assert {"model", "optimizer", "scheduler", "rng"} <= found  # the RNG file exists, it just is not loaded
    dcp = run_audit(str(corpus["dcp-non-tensor-item"].path))
    assert {t.name for t in dcp.tensors if t.hash is not None} >= {"model/0.weight", "optim/state/0.weight/exp_avg"}


def test_control_every_payload_runs_when_loaded_unsafely(corpus: dict[str, Hostile]) -> None:
    """Proves the payloads above are live: the same bytes, loaded the unsafe way, create their sentinel."""
    jobs = [(h.loader, str(h.control_path)) for h in corpus.values()]
    hf.run_unsafely(jobs)
    missing = [name for name, h in corpus.items() if not h.control_sentinel.exists()]
    assert not missing, f"payloads that did not run under an unsafe load: {missing}"
    assert not any(h.sentinel.exists() for h in corpus.values())


def test_real_training_args_is_not_loaded_but_only_a_warning(tmp_path: Path) -> None:
    import torch
    from transformers import TrainingArguments

    ckpt = rc.accelerate_directory(tmp_path / "checkpoint-2")
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[])
    torch.save(args, ckpt / "training_args.bin")  # exactly what Trainer._save does
    report = run_audit(str(ckpt))
    mine = [f for f in report.findings if f.subject == "training_args.bin"]
    assert [f.code for f in mine] == ["security.not-loaded"]
    assert mine[0].severity is Severity.WARNING
    assert "transformers.training_args.TrainingArguments" in mine[0].evidence["globals"]
    assert "security.unsafe-pickle" not in codes(report)


def test_harmless_class_called_with_arguments_is_unsafe(bases: dict[str, Path], tmp_path: Path) -> None:
    # TrainingArguments(...) with arguments runs __init__/__post_init__ on torch.load(weights_only=False);
    # its own pickling never does that (NEWOBJ without arguments + BUILD).
    pkl = (b"\x80\x02ctransformers.training_args\nTrainingArguments\n" + hf._op_str("/tmp/x")
           + b"\x85R.")
    path = tmp_path / "training_args.bin"
    hf.replace_data_pkl(bases["pt"], path, pkl)
    report = run_audit(str(path))
    (f,) = [f for f in report.findings if f.code == "security.unsafe-pickle"]
    assert "TrainingArguments" in f.message and "called with arguments" in f.message


# --------------------------------------------------------------------------------------------------------------
# DCP metadata that leaves its directory


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlinked-data-file", "symlinked-metadata"])
def test_dcp_metadata_naming_files_outside_its_directory_is_rejected(
    how: str, bases: dict[str, Path], tmp_path: Path
) -> None:
    import torch

    ckpt = tmp_path / "ckpt"
    shutil.copytree(bases["dcp"], ckpt)
    data_file = next(p for p in ckpt.iterdir() if p.suffix == ".distcp")
    outside = tmp_path / "outside.distcp"
    shutil.copy(data_file, outside)
    md = rc.read_dcp_metadata(ckpt)
    if how in ("dotdot", "absolute"):
        for info in md.storage_data.values():
            info.relative_path = "../outside.distcp" if how == "dotdot" else str(outside)
        (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    elif how == "symlinked-data-file":
        data_file.unlink()
        data_file.symlink_to(outside)
    else:
        shutil.move(ckpt / ".metadata", tmp_path / "outside.metadata")
        (ckpt / ".metadata").symlink_to(tmp_path / "outside.metadata")
    report = run_audit(str(ckpt))
    escapes = [f for f in report.findings if f.code == "integrity.path-escape"]
    assert escapes and all(f.severity is Severity.ERROR for f in escapes)
    # Nothing outside was read: no tensor of the checkpoint has a hash.
    assert not [t for t in report.tensors if t.hash is not None]
    with pytest.raises(UnsafeCheckpointError, match=r"outside|absolute|link"):
        check_metadata_safe(str(ckpt))
    with pytest.raises(UnsafeCheckpointError):
        vetted_dcp_load({"model": {"0.weight": torch.zeros(16, 8)}}, str(ckpt))


def test_dcp_item_past_the_end_of_its_file_is_never_read(bases: dict[str, Path], tmp_path: Path,
                                                         worker: AuditWorker) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(bases["dcp"], ckpt)
    md = rc.read_dcp_metadata(ckpt)
    info = next(iter(md.storage_data.values()))
    info.length = 1 << 40  # a terabyte
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    answer = worker.audit(str(ckpt))
    assert answer["ok"], answer.get("error")
    assert any(c == "integrity.incomplete" and "records items up to byte" in m for c, _, m in answer["findings"])
    assert answer["maxrss_mib"] - worker.baseline_mib < 200
    with pytest.raises(UnsafeCheckpointError, match="needs bytes"):
        check_metadata_safe(str(ckpt))


def test_dcp_items_sharing_bytes_are_corrupt(bases: dict[str, Path], tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(bases["dcp"], ckpt)
    md = rc.read_dcp_metadata(ckpt)
    infos = list(md.storage_data.values())
    for info in infos[1:]:  # every item points at the first item's bytes
        info.relative_path, info.offset, info.length = infos[0].relative_path, infos[0].offset, infos[0].length
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    report = run_audit(str(ckpt))
    assert any(f.code == "integrity.corrupt" and "overlapping" in f.message for f in report.findings)
    assert len([t for t in report.tensors if t.hash is not None]) <= 1


# --------------------------------------------------------------------------------------------------------------
# Declared sizes, depth, amplification: audited in the worker, under RLIMIT_AS and a timeout


def _st_header(src: Path, dst: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    raw = src.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    dst.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])
    return dst


def _zip(path: Path, members: list[tuple[str, bytes, int, int]]) -> Path:
    """A zip written by hand: (name, bytes as stored, method, declared uncompressed size)."""
    out, central = bytearray(), bytearray()
    for name, data, method, size in members:
        header_at = len(out)
        nb = name.encode()
        crc = zlib.crc32(data) if method == 0 else 0
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0, crc, len(data), size, len(nb), 0)
        out += nb + data
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, method, 0, 0, crc, len(data), size,
                               len(nb), 0, 0, 0, 0, 0, header_at) + nb
    cd_at = len(out)
    out += central + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(central), cd_at, 0)
    path.write_bytes(bytes(out))
    return path


def _bomb(mib: int) -> bytes:
    """A raw deflate stream of ``mib`` MiB of zeros, about 1 KiB per MiB."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = c.compress(b"\0" * (1 << 20)) + c.flush(zlib.Z_FULL_FLUSH)
    return block * mib + c.flush()


def _case_safetensors_header_length(b: dict[str, Path], d: Path) -> Path:
    raw = b["st"].read_bytes()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])
    return d / "model.safetensors"


def _case_safetensors_terabyte_tensor(b: dict[str, Path], d: Path) -> Path:
    def edit(h: dict[str, Any]) -> None:
        name = next(k for k in h if k != "__metadata__")
        h[name] = {"dtype": "F32", "shape": [1 << 18, 1 << 20], "data_offsets": [0, 1 << 40]}

    return _st_header(b["st"], d / "model.safetensors", edit)


def _case_safetensors_deep_header(b: dict[str, Path], d: Path) -> Path:
    header = b"[" * 200_000 + b"]" * 200_000
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return d / "model.safetensors"


def _case_zip_pickle_declares_2gib(b: dict[str, Path], d: Path) -> Path:
    pkl = pickle.dumps({"w": 1}, protocol=2)
    return _zip(d / "model.pt", [("archive/data.pkl", pkl, 0, (1 << 31) - 1)])


def _case_zip_deflate_bomb(b: dict[str, Path], d: Path) -> Path:
    # Declares 100 bytes, inflates to 4 GiB: zipfile would inflate up to 2 GiB in one call.
    return _zip(d / "model.pt", [("archive/data.pkl", _bomb(4096), 8, 100)])


def _case_pickle_binbytes8(b: dict[str, Path], d: Path) -> Path:
    (d / "state.pkl").write_bytes(b"\x80\x04\x8e" + struct.pack("<Q", 1 << 60) + b"xx.")
    return d / "state.pkl"


def _case_pickle_memo_index(b: dict[str, Path], d: Path) -> Path:
    (d / "state.pkl").write_bytes(b"\x80\x02]r" + struct.pack("<I", 0xFFFFFFFF) + b".")
    return d / "state.pkl"


def _case_numpy_reconstruct_huge(b: dict[str, Path], d: Path) -> Path:
    pkl = (b"\x80\x02cnumpy._core.multiarray\n_reconstruct\ncnumpy\nndarray\n" + b"\x8a\x06" + (10**12).to_bytes(6, "little")
           + b"\x85" + b"C\x01b\x87R.")
    (d / "state.pkl").write_bytes(pkl)
    return d / "state.pkl"


def _case_numpy_state_huge(b: dict[str, Path], d: Path) -> Path:
    import numpy as np

    pkl = pickle.dumps(np.zeros(2, dtype=np.float32), protocol=2)
    # The array's shape (2,) becomes (2**40,): the 8 data bytes no longer match.
    pkl = pkl.replace(b"K\x02\x85", b"\x8a\x06" + (1 << 40).to_bytes(6, "little") + b"\x85", 1)
    (d / "state.pkl").write_bytes(pkl)
    return d / "state.pkl"


def _case_storage_numel(b: dict[str, Path], d: Path) -> Path:
    import torch

    torch.save({"w": torch.zeros(4)}, d / "model.pt")
    import zipfile

    with zipfile.ZipFile(d / "model.pt") as zf:
        name = next(n for n in zf.namelist() if n.endswith("data.pkl"))
        pkl = zf.read(name)
    pkl = pkl.replace(b"K\x04t", b"\x8a\x06" + (1 << 40).to_bytes(6, "little") + b"t", 1)  # numel 4 -> 2**40
    hf.replace_data_pkl(d / "model.pt", d / "model2.pt", pkl)
    return d / "model2.pt"


def _case_overlapping_views(b: dict[str, Path], d: Path) -> Path:
    import torch

    big = torch.zeros(1 << 18)  # 1 MiB, viewed 200 times: 200 MiB to scan from a 1 MiB file
    torch.save({f"view{i}": big[:] for i in range(200)}, d / "model.pt")
    return d / "model.pt"


def _case_shared_tensor(b: dict[str, Path], d: Path) -> Path:
    import torch

    big = torch.zeros(1 << 18)  # one tensor object, referenced 200 times through the pickle's memo
    torch.save({f"ref{i}": big for i in range(200)}, d / "model.pt")
    return d / "model.pt"


def _case_codecs_amplification(b: dict[str, Path], d: Path) -> Path:
    s = "a" * (1 << 20)
    body = b"\x80\x02]q\x00" + b"c_codecs\nencode\nq\x010" + b"X" + struct.pack("<I", len(s)) + s.encode()
    body += b"q\x020"  # the function and the string stay in the memo, off the stack
    body += b"(" + b"h\x01h\x02X\x06\x00\x00\x00latin1\x86R" * 300 + b"e."  # 300 copies of 1 MiB
    (d / "state.pkl").write_bytes(body)
    return d / "state.pkl"


def _case_deep_pickle(b: dict[str, Path], d: Path) -> Path:
    n = 200_000
    (d / "state.pkl").write_bytes(b"\x80\x02" + b"]" * n + b"a" * (n - 1) + b".")
    return d / "state.pkl"


def _case_cyclic_pickle(b: dict[str, Path], d: Path) -> Path:
    (d / "state.pkl").write_bytes(b"\x80\x02}q\x00X\x04\x00\x00\x00selfq\x01h\x00s.")
    return d / "state.pkl"


def _case_exponential_sharing(b: dict[str, Path], d: Path) -> Path:
    body = b"\x80\x02]"
    for i in range(64):  # x[i+1] = (x[i], x[i]): 2**64 leaves when expanded
        body += b"r" + struct.pack("<I", i) + b"j" + struct.pack("<I", i) + b"\x86"
    (d / "state.pkl").write_bytes(body + b".")
    return d / "state.pkl"


def _case_deep_json(b: dict[str, Path], d: Path) -> Path:
    ckpt = d / "ckpt"
    ckpt.mkdir()
    shutil.copy(b["st"], ckpt / "model.safetensors")
    (ckpt / "trainer_state.json").write_text("[" * 500_000 + "]" * 500_000)
    (ckpt / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * 900 + "]" * 900 + "}")
    return ckpt


SIZE_CASES: dict[str, tuple[Callable[[dict[str, Path], Path], Path], str, str]] = {
    "safetensors-header-length-1TiB": (_case_safetensors_header_length, "integrity.corrupt", "header declares"),
    "safetensors-tensor-1TiB": (_case_safetensors_terabyte_tensor, "integrity.corrupt", "ends at byte"),
    "safetensors-header-nesting": (_case_safetensors_deep_header, "integrity.corrupt", "not valid JSON"),
    "zip-data.pkl-declares-2GiB": (_case_zip_pickle_declares_2gib, "integrity.corrupt", "safety limit"),
    "zip-deflate-bomb-4GiB": (_case_zip_deflate_bomb, "integrity.corrupt", "inflates past"),
    "pickle-BINBYTES8-2**60": (_case_pickle_binbytes8, "integrity.corrupt", "only"),
    "pickle-memo-index-2**32": (_case_pickle_memo_index, "integrity.corrupt", "memo index"),
    "numpy-reconstruct-10**12": (_case_numpy_reconstruct_huge, "integrity.corrupt", "numpy.ndarray"),
    "numpy-state-shape-2**40": (_case_numpy_state_huge, "integrity.corrupt", "does not match shape"),
    "storage-numel-2**40": (_case_storage_numel, "integrity.corrupt", "elements"),
    "overlapping-views-200x": (_case_overlapping_views, "integrity.corrupt", "address more than"),
    "shared-tensor-200x": (_case_shared_tensor, "integrity.corrupt", "address more than"),
    "codecs-copy-amplification": (_case_codecs_amplification, "integrity.corrupt", "budget"),
    "pickle-nesting-200k": (_case_deep_pickle, "integrity.corrupt", "deeper than"),
    "pickle-cycle": (_case_cyclic_pickle, "integrity.corrupt", "cycle"),
    "pickle-shared-2**64-leaves": (_case_exponential_sharing, "integrity.corrupt", "nodes"),
    "json-nesting": (_case_deep_json, "integrity.corrupt", "JSON"),
}


@pytest.mark.parametrize("case", list(SIZE_CASES))
def test_declared_sizes_depth_and_amplification_are_bounded(
    case: str, bases: dict[str, Path], tmp_path: Path, worker: AuditWorker
) -> None:
    build, code, fragment = SIZE_CASES[case]
    path = build(bases, tmp_path)
    answer = worker.audit(str(path))
    assert answer["ok"], answer.get("error")
    assert any(c == code and fragment in m for c, _, m in answer["findings"]), answer["findings"]
    assert answer["seconds"] < 60, answer["seconds"]
    # The worker's peak resident set grew by less than the reader's own limits allow.
    assert answer["maxrss_mib"] - worker.baseline_mib < 300, (answer["maxrss_mib"], worker.baseline_mib)


def test_a_deflated_data_pkl_within_its_declared_size_still_loads(tmp_path: Path) -> None:
    import torch

    torch.save({"w": torch.arange(4.0)}, tmp_path / "plain.pt")
    import zipfile

    with zipfile.ZipFile(tmp_path / "plain.pt") as zin, zipfile.ZipFile(tmp_path / "repacked.pt", "w") as zout:
        for info in zin.infolist():
            method = zipfile.ZIP_DEFLATED if info.filename.endswith("data.pkl") else zipfile.ZIP_STORED
            zout.writestr(info.filename, zin.read(info), compress_type=method)
    report = run_audit(str(tmp_path / "repacked.pt"))
    (rec,) = report.tensors
    assert rec.name == "w" and rec.hash is not None


# --------------------------------------------------------------------------------------------------------------
# Files that are not regular files, links, directories, permissions


def _dir_with(bases: dict[str, Path], d: Path) -> Path:
    ckpt = d / "ckpt"
    ckpt.mkdir()
    shutil.copy(bases["st"], ckpt / "model.safetensors")
    shutil.copy(bases["pt"], ckpt / "optimizer.pt")
    return ckpt


def _fifo_file(b: dict[str, Path], d: Path) -> Path:
    ckpt = _dir_with(b, d)
    (ckpt / "optimizer.pt").unlink()
    os.mkfifo(ckpt / "optimizer.pt")
    return ckpt


def _device_file(b: dict[str, Path], d: Path) -> Path:
    ckpt = _dir_with(b, d)
    (ckpt / "scheduler.pt").symlink_to("/dev/zero")
    (ckpt / "trainer_state.json").symlink_to("/dev/urandom")
    return ckpt


def _fifo_metadata(b: dict[str, Path], d: Path) -> Path:
    shutil.copytree(b["dcp"], d / "dcp")
    (d / "dcp" / ".metadata").unlink()
    os.mkfifo(d / "dcp" / ".metadata")
    return d / "dcp"


def _fifo_data_file(b: dict[str, Path], d: Path) -> Path:
    shutil.copytree(b["dcp"], d / "dcp")
    data = next(p for p in (d / "dcp").iterdir() if p.suffix == ".distcp")
    data.unlink()
    os.mkfifo(data)
    return d / "dcp"


def _fifo_top_level(b: dict[str, Path], d: Path) -> Path:
    os.mkfifo(d / "model.pt")
    return d / "model.pt"


def _directory_as_file(b: dict[str, Path], d: Path) -> Path:
    ckpt = _dir_with(b, d)
    (ckpt / "optimizer.pt").unlink()
    (ckpt / "optimizer.pt").mkdir()
    return ckpt


def _dangling_link(b: dict[str, Path], d: Path) -> Path:
    ckpt = _dir_with(b, d)
    (ckpt / "optimizer.pt").unlink()
    (ckpt / "optimizer.pt").symlink_to(d / "gone.pt")
    return ckpt


def _link_loop(b: dict[str, Path], d: Path) -> Path:
    ckpt = _dir_with(b, d)
    (ckpt / "optimizer.pt").unlink()
    (ckpt / "optimizer.pt").symlink_to(ckpt / "loop.pt")
    (ckpt / "loop.pt").symlink_to(ckpt / "optimizer.pt")
    return ckpt


NOT_REGULAR: dict[str, tuple[Callable[[dict[str, Path], Path], Path], str, str]] = {
    "fifo-in-directory": (_fifo_file, "integrity.corrupt", "named pipe"),
    "links-to-devices": (_device_file, "integrity.corrupt", "character device"),
    "fifo-.metadata": (_fifo_metadata, "integrity.corrupt", "not a regular file"),
    "fifo-.distcp": (_fifo_data_file, "integrity.corrupt", "named pipe"),
    "fifo-top-level": (_fifo_top_level, "integrity.corrupt", "named pipe"),
    "directory-named-optimizer.pt": (_directory_as_file, "integrity.corrupt", "directory"),
    "dangling-symlink": (_dangling_link, "integrity.incomplete", "does not exist"),
    "symlink-loop": (_link_loop, "integrity.corrupt", "symbolic links"),
}


@pytest.mark.parametrize("case", list(NOT_REGULAR))
def test_non_regular_files_are_never_opened(case: str, bases: dict[str, Path], tmp_path: Path,
                                             worker: AuditWorker) -> None:
    build, code, fragment = NOT_REGULAR[case]
    path = build(bases, tmp_path)
    answer = worker.audit(str(path), timeout_s=60)  # a blocking open would time out here
    assert answer["ok"], answer.get("error")
    assert any(c == code and fragment in m for c, _, m in answer["findings"]), answer["findings"]
    if path.is_dir() and case != "fifo-.metadata":
        assert answer["tensors"] > 0  # the rest of the checkpoint was still read


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_unreadable_file_inside_is_a_finding_and_unreadable_top_level_is_exit_2(
    bases: dict[str, Path], tmp_path: Path
) -> None:
    ckpt = _dir_with(bases, tmp_path)
    (ckpt / "optimizer.pt").chmod(0)
    report = run_audit(str(ckpt))
    assert any(f.code == "integrity.corrupt" and f.subject == "optimizer.pt" for f in report.findings)
    ckpt.chmod(0)
    try:
        assert main(["audit", str(ckpt), "--no-progress"], stdout=io.StringIO(), stderr=io.StringIO()) == 2
    finally:
        ckpt.chmod(0o755)


# --------------------------------------------------------------------------------------------------------------
# What reaches the user: the CLI's exit codes, JSON, and a terminal that names cannot take over


def test_cli_exit_codes_for_hostile_input(corpus: dict[str, Hostile], tmp_path: Path) -> None:
    ckpt = corpus["accelerate-random_states"].path
    out = io.StringIO()
    assert main(["audit", str(ckpt), "--format", "json", "--no-progress"], stdout=out, stderr=io.StringIO()) == 1
    doc = json.loads(out.getvalue())
    hit = [f for f in doc["findings"] if f["code"] == "security.unsafe-pickle"]
    assert hit[0]["subject"] == "random_states_0.pkl" and hit[0]["severity"] == "error"
    assert "posix.system" in hit[0]["evidence"]["globals"]
    err = io.StringIO()
    assert main(["audit", str(tmp_path / "nope"), "--no-progress"], stdout=io.StringIO(), stderr=err) == 2
    assert "no such file or directory" in err.getvalue()
    assert not corpus["accelerate-random_states"].sentinel.exists()


def test_hostile_names_cannot_drive_the_terminal(bases: dict[str, Path], tmp_path: Path) -> None:
    # (No lone surrogate here: the safetensors library refuses a header holding one, and so does ckptaudit.)
    evil = "\x1b]0;pwned\x07\x1b[2J[/bold][link=file:///etc/passwd]x\u202e"

    def edit(h: dict[str, Any]) -> None:
        name = next(k for k in h if k != "__metadata__")
        h[evil] = h.pop(name)

    path = _st_header(bases["st"], tmp_path / "model.safetensors", edit)
    report = run_audit(str(path))
    assert evil in {t.name for t in report.tensors}
    table = io.StringIO()
    render(report, OutputFormat.TABLE, table, verbose=True)
    text = table.getvalue()
    assert "\x1b" not in text and "\u202e" not in text and "\x07" not in text
    assert "\\x1b" in text and "pwned" in text
    js = io.StringIO()
    render(report, OutputFormat.JSON, js)
    assert evil in {t["name"] for t in json.loads(js.getvalue())["tensors"]}


@pytest.mark.parametrize("gate", ["1" * 5000, "[" * 100_000, '{"passed": false, "failures": 7}'])
def test_serving_metadata_that_is_not_what_it_claims_is_a_finding(gate: str, bases: dict[str, Path],
                                                                  tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from ckptaudit.auditing.judge import AuditOptions

    path = tmp_path / "model.safetensors"
    save_file(load_file(str(bases["st"])), str(path), metadata={"artifact": "serving", "quality_gate": gate})
    report = run_audit(str(path), AuditOptions(expect="serving"))
    assert codes(report) & {"integrity.corrupt", "artifact.gate-failed"}


def test_legacy_torch_save_is_scanned_and_never_loaded(tmp_path: Path) -> None:
    import torch

    clean, evil = tmp_path / "clean.pt", tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2)}, clean, _use_new_zipfile_serialization=False)
    sentinel = tmp_path / "legacy.sentinel"
    torch.save({"w": torch.ones(2), "x": hf.payload_object("os.system", str(sentinel))}, evil,
               _use_new_zipfile_serialization=False)
    assert codes(run_audit(str(clean))) >= {"security.unvetted-pickle"}  # an error: torch would unpickle it unvetted
    assert "security.unsafe-pickle" not in codes(run_audit(str(clean)))
    report = run_audit(str(evil))
    assert any(f.code == "security.unsafe-pickle" and "posix.system" in f.message for f in report.findings)
    assert not sentinel.exists()


def test_shard_index_naming_files_outside_the_directory(tmp_path: Path, bases: dict[str, Path]) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(bases["st"], ckpt / "model-00001-of-00001.safetensors")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"0.weight": "../../etc/passwd", "0.bias": "/etc/shadow",
                        "1.weight": "model-00001-of-00001.safetensors"}}))
    report = run_audit(str(ckpt))
    escapes = {f.evidence["shard"] for f in report.findings if f.code == "integrity.path-escape"}
    assert escapes == {"../../etc/passwd", "/etc/shadow"}
