"""The hostile cases of ``tests/hostile/test_hostile_views_and_bounds.py`` as builders (a DCP ``.metadata`` that
shows a check another view, pickles whose work is quadratic or amplified, JSON bombs), shared with
``hostile_figures.py``, which times and measures the audit of each.

A case builder takes the clean bases (``{"pt", "dcp", "st"}``: ``real_checkpoints``' torch.save file, DCP directory
and safetensors file) and a scratch folder, and returns the path to audit.
"""

from __future__ import annotations

import collections
import pickle
import pickletools
import shutil
import struct
from pathlib import Path
from typing import Any

import hostile_files as hf
import real_checkpoints as rc

M61 = (1 << 61) - 1
"""Python hashes an int ``n`` to ``n mod M61``: every multiple of it hashes to 0."""


# One view: a pickle may not give an object an attribute that shadows a method a check reads it through


class Shadowed:
    """Pickles as ``OrderedDict(entries)`` followed by ``BUILD {attr: OrderedDict}``: after ``pickle.load`` the
    dict holds every entry, but ``d.<attr>()`` returns an empty dict (``OrderedDict()``)."""

    def __init__(self, entries: dict[Any, Any], attr: str) -> None:
        self.entries, self.attr = entries, attr

    def __reduce__(self) -> tuple[Any, ...]:
        return collections.OrderedDict, (), {self.attr: collections.OrderedDict}, None, iter(self.entries.items())


def payload_dcp(d: Path, sentinel: str) -> Path:
    """A DCP checkpoint written by DCP itself whose non-tensor item ``extra`` runs a payload when
    ``torch.distributed.checkpoint.load`` unpickles it (``torch.load(weights_only=False)``)."""
    return rc.dcp_checkpoint(d, {"extra": hf.payload_object("os.system", sentinel)})


def shadow(ckpt: Path, how: str) -> None:
    md = rc.read_dcp_metadata(ckpt)
    if how == "items":  # the check walks storage_data.items() and sees nothing; DCP looks entries up by key
        md.storage_data = Shadowed(md.storage_data, "items")
    elif how == "values":
        md.state_dict_metadata = Shadowed(md.state_dict_metadata, "values")
    elif how == "planner_data.get":
        md.planner_data = Shadowed(md.planner_data, "get")
    (ckpt / ".metadata").write_bytes(pickle.dumps(md, protocol=4))


def memo_index(data: bytes, class_name: str) -> int:
    """The memo slot of the first object of ``class_name`` a protocol-4 pickle builds (NEWOBJ + MEMOIZE)."""
    memo, pending, last = 0, False, ""
    for op, arg, _pos in pickletools.genops(data):
        if op.name == "SHORT_BINUNICODE" and arg == class_name:
            pending = True
        if op.name == "MEMOIZE":
            if pending and last == "NEWOBJ":
                return memo
            memo += 1
        last = op.name
    raise AssertionError(f"no {class_name} in the pickle")


def memo_mutated_index(ckpt: Path) -> None:
    """After ``storage_data`` is built, ``BUILD`` its first ``MetadataIndex`` key again (through the memo) with
    another item's name: the dict's key no longer hashes where it sits, and lookups by key fail."""
    data = pickle.dumps(rc.read_dcp_metadata(ckpt), protocol=4)
    slot = memo_index(data, "MetadataIndex")
    assert data.endswith(b"b.")  # ... Metadata's BUILD, STOP
    name = b"model.2.bias"
    rebuild = b"j" + struct.pack("<I", slot)  # LONG_BINGET slot
    rebuild += b"}(" + b"\x8c\x03fqn" + b"\x8c" + bytes([len(name)]) + name + b"ub0"  # {fqn: name} BUILD POP
    (ckpt / ".metadata").write_bytes(data[:-1] + rebuild + b".")


ATTACKS = ("items", "values", "planner_data.get", "memo-mutated-MetadataIndex")


# Bounded work: hash collisions, opcode amplification


def colliding_dict_pickle(n: int) -> bytes:
    """A protocol-4 pickle of a dict of ``n`` integer keys that all hash to 0 (assembled: building the dict in
    Python to pickle it would itself take quadratic time)."""
    out = [b"\x80\x04}("]
    for i in range(1, n + 1):
        k = (i * M61).to_bytes(((i * M61).bit_length() + 8) // 8, "little", signed=True)
        out.append(b"\x8a" + bytes([len(k)]) + k + b"K\x00")
        if i % 1000 == 0:
            out.append(b"u(")
    out.append(b"u.")
    return b"".join(out)


def case_collisions_pkl(b: dict[str, Path], d: Path) -> Path:
    p = d / "state.pkl"
    p.write_bytes(colliding_dict_pickle(200_000))
    return p


def case_collisions_data_pkl(b: dict[str, Path], d: Path) -> Path:
    p = d / "model.pt"
    hf.replace_data_pkl(b["pt"], p, colliding_dict_pickle(200_000))
    return p


def case_empty_set_amplification(b: dict[str, Path], d: Path) -> Path:
    p = d / "state.pkl"
    # A list of 2M empty sets, 1000 per APPENDS: 2 MB of pickle, 460 MiB if built.
    p.write_bytes(b"\x80\x04]" + (b"(" + b"\x8f" * 1000 + b"e") * 2000 + b".")
    return p


def case_memo_amplification(b: dict[str, Path], d: Path) -> Path:
    p = d / "model.pt"
    hf.replace_data_pkl(b["pt"], p, b"\x80\x04K\x00" + b"\x94" * 4_000_000 + b".")  # 4M memo entries
    return p


BOUNDED = {
    "200k-colliding-keys.pkl": (case_collisions_pkl, "share the hash value"),
    "200k-colliding-keys-in-data.pkl": (case_collisions_data_pkl, "share the hash value"),
    "2MB-of-EMPTY_SET": (case_empty_set_amplification, "amplification"),
    "4M-MEMOIZE": (case_memo_amplification, "amplification"),
}


# JSON: bounded size, containers and nesting


def case_trainer_state_of_empty_objects(b: dict[str, Path], d: Path) -> Path:
    ckpt = d / "checkpoint-10"
    ckpt.mkdir()
    shutil.copy(b["st"], ckpt / "model.safetensors")
    (ckpt / "trainer_state.json").write_bytes(b"[" + b"{}," * 7_000_000 + b"{}]")  # 21 MB, 1.3 GiB if parsed
    return ckpt


def case_safetensors_header_of_empty_objects(b: dict[str, Path], d: Path) -> Path:
    header = b'{"__metadata__": {}, "x": [' + b"{}," * 2_000_000 + b"{}]}"
    p = d / "model.safetensors"
    p.write_bytes(struct.pack("<Q", len(header)) + header)
    return p


def case_deep_manifest(b: dict[str, Path], d: Path) -> Path:
    ckpt = d / "step-000010"
    shutil.copytree(b["dcp"], ckpt)
    (ckpt / "manifest.json").write_bytes(b"[" * 200_000 + b"]" * 200_000)
    return ckpt


JSON_CASES = {
    "trainer_state.json-7M-empty-objects": (case_trainer_state_of_empty_objects, "objects and arrays"),
    "safetensors-header-2M-empty-objects": (case_safetensors_header_of_empty_objects, "objects and arrays"),
    "manifest.json-nested-200k-deep": (case_deep_manifest, "deeper"),
}


# Work that grew faster than the input: what a pickle shares through its memo


def shared_chunks_dcp(path: Path, n: int) -> Path:
    """A DCP save whose ``.metadata`` has ``n`` tensor entries sharing one list of ``n`` chunks (pickled once, then
    one memo reference each: a few hundred KB that build ``n * n`` chunk objects if the sharing is lost)."""
    import pickle

    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

    ckpt = rc.dcp_checkpoint(path, {"base": torch.arange(4.0)})
    md = rc.read_dcp_metadata(ckpt)
    shared = [ChunkStorageMetadata(torch.Size([i]), torch.Size([1])) for i in range(n)]
    for j in range(n):
        md.state_dict_metadata[f"t{j}"] = TensorStorageMetadata(md.state_dict_metadata["base"].properties,
                                                                torch.Size([n]), shared)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md, protocol=4))
    return ckpt


def column_chunks_dcp(path: Path, n: int) -> Path:
    """A DCP checkpoint of one ``[1, n]`` fp32 tensor ``w`` saved as ``n`` ``[1, 1]`` column chunks (issue 36: a
    pairwise tiling check took 151 s at n = 5,000), built cheaply: one real ``torch.save`` archive of a ``[1, 1]``
    tensor written ``n`` times into one data file (each chunk a whole archive at its own offset, as DCP writes
    them), and the ``.metadata`` torch's own classes describe it with."""
    import io
    import pickle

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    path.mkdir(parents=True)
    buf = io.BytesIO()
    torch.save(torch.full((1, 1), 0.5), buf)
    item = buf.getvalue()
    (path / "__0_0.distcp").write_bytes(item * n)
    chunks = [ChunkStorageMetadata(torch.Size([0, i]), torch.Size([1, 1])) for i in range(n)]
    storage = {MetadataIndex("w", torch.Size([0, i])): _StorageInfo("__0_0.distcp", i * len(item), len(item))
               for i in range(n)}
    md = Metadata(state_dict_metadata={"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                                                   torch.Size([1, n]), chunks)},
                  planner_data={"w": ("w",)}, storage_data=storage)
    (path / ".metadata").write_bytes(pickle.dumps(md, protocol=4))
    return path
