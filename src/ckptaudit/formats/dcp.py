"""``torch.distributed.checkpoint`` directories: ``.metadata`` plus ``__<rank>_<n>.distcp`` data files.

``.metadata`` is a pickle; :func:`read_dcp` scans it and unpickles it only through the DCP allowlist
(:func:`ckptaudit.formats.pickles.dcp_metadata_loads`), never with plain :mod:`pickle` as
``FileSystemReader.read_metadata`` does. :func:`check_metadata_safe` is the same guard for callers that
are about to hand a directory to ``torch.distributed.checkpoint.load`` (ours included).

Every item named in the metadata is located (file inside the directory, offset + length inside the file)
before it is read; each item is itself a ``torch.save`` archive, read with
:func:`ckptaudit.formats.torchzip.read_torch_zip`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ckptaudit.catalogue import finding
from ckptaudit.formats.base import Part, Unreadable
from ckptaudit.formats.pickles import DCP_METADATA_GLOBALS, UnsafeGlobalError, dcp_metadata_loads, scan
from ckptaudit.formats.tensors import DTYPES, Piece, TensorData
from ckptaudit.formats.torchzip import TorchZipError, read_torch_zip
from ckptaudit.model import Finding

__all__ = ["DcpRead", "UnsafeCheckpointError", "check_metadata_safe", "is_dcp_dir", "read_dcp"]

METADATA = ".metadata"
MAX_BYTES_ITEM = 64 << 20
"""Non-tensor items larger than this are not loaded (real ones are a few bytes to a few KiB)."""


def is_dcp_dir(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    if os.path.exists(os.path.join(path, METADATA)):
        return True
    return any(n.endswith(".distcp") for n in os.listdir(path))


@dataclass
class DcpRead:
    part: Part | None
    findings: list[Finding]
    files: dict[str, int]
    metadata: Any = None


class UnsafeCheckpointError(Exception):
    """A DCP directory whose ``.metadata`` must not be given to ``torch.distributed.checkpoint.load``."""


def check_metadata_safe(path: str) -> None:
    """Raise :class:`UnsafeCheckpointError` unless ``path/.metadata`` exists, parses, and references only the
    DCP allowlist, and every file it names lies inside ``path``.

    Run this before any ``torch.distributed.checkpoint.load``: DCP unpickles ``.metadata`` with plain
    ``pickle``, so a hostile one would run code.
    """
    meta_path = os.path.join(path, METADATA)
    try:
        with open(meta_path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise UnsafeCheckpointError(f"{meta_path}: cannot read ({exc.strerror})") from None
    result = scan(data, DCP_METADATA_GLOBALS)
    if result.error is not None:
        raise UnsafeCheckpointError(f"{meta_path}: malformed pickle at byte {result.error_offset}: {result.error}")
    bad = result.unsafe + result.harmless
    if bad:
        raise UnsafeCheckpointError(
            f"{meta_path} references {', '.join(bad)}, outside the DCP metadata allowlist; refusing to load it"
        )
    try:
        md = dcp_metadata_loads(data)
    except Exception as exc:  # noqa: BLE001
        raise UnsafeCheckpointError(f"{meta_path}: cannot be read ({exc})") from None
    for info in (getattr(md, "storage_data", None) or {}).values():
        rel = getattr(info, "relative_path", None)
        problem = _path_problem(path, rel)
        if problem:
            raise UnsafeCheckpointError(f"{meta_path}: {problem}")


def _path_problem(root: str, rel: Any) -> str | None:
    if not isinstance(rel, str) or not rel:
        return f"names a data file {rel!r} that is not a relative path"
    if os.path.isabs(rel) or rel.startswith(("/", "\\")):
        return f"names data file {rel!r} by an absolute path"
    if ".." in rel.replace("\\", "/").split("/"):
        return f"names data file {rel!r} outside its directory"
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(root, rel))
    if os.path.commonpath([real_root, real]) != real_root:
        return f"names data file {rel!r}, a link leading outside the directory"
    return None


def read_dcp(path: str, name: str = "") -> DcpRead:
    """Read a DCP directory's metadata and describe every item, without loading tensor data."""
    findings: list[Finding] = []
    subject = name or os.path.basename(os.path.normpath(path))
    files = {
        n: os.path.getsize(os.path.join(path, n))
        for n in sorted(os.listdir(path))
        if os.path.isfile(os.path.join(path, n)) and (n.endswith(".distcp") or n == METADATA)
    }
    files = {os.path.join(name, n) if name else n: s for n, s in files.items()}
    meta_path = os.path.join(path, METADATA)
    if not os.path.exists(meta_path):
        findings.append(
            finding(
                "integrity.incomplete",
                os.path.join(name, METADATA) if name else METADATA,
                f"{subject}: no {METADATA} file; torch.distributed.checkpoint writes it last, so the save did "
                "not finish (or the file was lost). The data files cannot be interpreted without it.",
                data_files=[f for f in files if f.endswith(".distcp")],
            )
        )
        return DcpRead(None, findings, files)
    with open(meta_path, "rb") as fh:
        data = fh.read()
    meta_subject = os.path.join(name, METADATA) if name else METADATA
    result = scan(data, DCP_METADATA_GLOBALS)
    if result.error is not None:
        findings.append(
            finding(
                "integrity.corrupt",
                meta_subject,
                f"{METADATA} is not a readable pickle (byte {result.error_offset}: {result.error})",
                offset=result.error_offset,
            )
        )
        return DcpRead(None, findings, files)
    bad = result.unsafe + result.harmless
    if bad:
        findings.append(
            finding(
                "security.unsafe-pickle",
                meta_subject,
                f"{METADATA} references {', '.join(bad)}, outside the DCP metadata allowlist; it was not "
                "loaded (torch.distributed.checkpoint.load would have executed it)",
                globals=list(bad),
            )
        )
        return DcpRead(None, findings, files)
    try:
        md = dcp_metadata_loads(data)
        sd_meta = md.state_dict_metadata
        storage = md.storage_data
        if not isinstance(sd_meta, dict) or not isinstance(storage, dict):
            raise ValueError("state_dict_metadata or storage_data is not a dict")
    except (UnsafeGlobalError, Exception) as exc:  # noqa: BLE001
        findings.append(
            finding("integrity.corrupt", meta_subject, f"{METADATA} cannot be interpreted ({exc})")
        )
        return DcpRead(None, findings, files)

    # Locate every storage item once: file inside the directory, range inside the file.
    located: dict[Any, tuple[str, int, int] | Unreadable] = {}
    missing_files: dict[str, list[str]] = {}
    short_files: dict[str, tuple[int, int]] = {}
    for index, info in storage.items():
        rel = getattr(info, "relative_path", None)
        fqn = getattr(index, "fqn", "?")
        problem = _path_problem(path, rel)
        if problem:
            findings.append(
                finding("integrity.path-escape", meta_subject, f"{METADATA} {problem} (item {fqn}); not read",
                        item=fqn, file=str(rel))
            )
            located[_key(index)] = Unreadable(problem, str(rel))
            continue
        assert isinstance(rel, str)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        full = os.path.join(path, rel)
        rel_name = os.path.join(name, rel) if name else rel
        if not isinstance(offset, int) or not isinstance(length, int) or offset < 0 or length < 0:
            located[_key(index)] = Unreadable(f"bad offset/length {offset!r}/{length!r}", rel_name)
            continue
        if getattr(info, "transform_descriptors", None):
            located[_key(index)] = Unreadable(
                f"storage transforms {info.transform_descriptors} are not supported", rel_name
            )
            continue
        if not os.path.isfile(full):
            missing_files.setdefault(rel_name, []).append(fqn)
            located[_key(index)] = Unreadable(f"data file {rel_name} is missing", rel_name)
            continue
        size = os.path.getsize(full)
        files.setdefault(rel_name, size)
        if offset + length > size:
            need = max(offset + length, short_files.get(rel_name, (0, 0))[0])
            short_files[rel_name] = (need, size)
            located[_key(index)] = Unreadable(
                f"{rel_name} has {size} bytes, item needs bytes {offset}..{offset + length}", rel_name
            )
            continue
        located[_key(index)] = (full, offset, length)
    for rel_name, fqns in missing_files.items():
        findings.append(
            finding(
                "integrity.incomplete",
                rel_name,
                f"data file {rel_name} named by {METADATA} is missing; {len(fqns)} item(s) lost, e.g. "
                f"{', '.join(sorted(fqns)[:5])}",
                items=sorted(fqns),
            )
        )
    for rel_name, (need, size) in short_files.items():
        findings.append(
            finding(
                "integrity.incomplete",
                rel_name,
                f"{rel_name} has {size} bytes but {METADATA} records items up to byte {need}: truncated",
                size=size,
                needed=need,
            )
        )

    flat: dict[str, Any] = {}
    corrupt: list[tuple[str, str, int | None]] = []
    for fqn, item in sd_meta.items():
        if type(item).__name__ == "TensorStorageMetadata":
            flat[fqn] = _tensor_item(fqn, item, located, corrupt)
        else:
            flat[fqn] = _bytes_item(fqn, located, corrupt)
    for fqn, reason, offset in corrupt:
        findings.append(
            finding("integrity.corrupt", fqn, f"item {fqn}: {reason}", offset=offset)
        )
    tree = _unflatten(flat, getattr(md, "planner_data", None))
    return DcpRead(Part(name, "dcp", tree), findings, files, md)


def _key(index: Any) -> tuple[str, tuple[int, ...] | None]:
    off = getattr(index, "offset", None)
    return (getattr(index, "fqn", ""), tuple(off) if off is not None else None)


def _tensor_item(
    fqn: str,
    item: Any,
    located: dict[Any, tuple[str, int, int] | Unreadable],
    corrupt: list[tuple[str, str, int | None]],
) -> TensorData | Unreadable:
    dtype_name = str(getattr(item.properties, "dtype", "")).replace("torch.", "")
    dtype = DTYPES.get(dtype_name)
    shape = tuple(int(s) for s in item.size)
    if dtype is None:
        corrupt.append((fqn, f"unsupported dtype {dtype_name}", None))
        return Unreadable(f"unsupported dtype {dtype_name}")
    pieces: list[Piece] = []
    for chunk in item.chunks:
        where = located.get((fqn, tuple(chunk.offsets)))
        if where is None:
            corrupt.append((fqn, f"no storage entry for the shard at offsets {list(chunk.offsets)}", None))
            return Unreadable("shard not in storage_data")
        if isinstance(where, Unreadable):
            return where
        file, offset, length = where
        try:
            tz = read_torch_zip(file, offset, length)
        except TorchZipError as exc:
            corrupt.append((fqn, f"shard at offsets {list(chunk.offsets)}: {exc}", exc.offset))
            return Unreadable(str(exc), file)
        td = tz.obj
        if not tz.loaded or not isinstance(td, TensorData):
            corrupt.append((fqn, "shard does not hold a plain tensor", offset))
            return Unreadable("shard does not hold a plain tensor", file)
        if td.dtype != dtype or td.shape != tuple(chunk.sizes):
            corrupt.append(
                (fqn, f"shard holds {td.dtype.name}{list(td.shape)}, metadata says {dtype.name}{list(chunk.sizes)}",
                 offset)
            )
            return Unreadable("shard does not match the metadata", file)
        p = td.pieces[0]
        pieces.append(Piece(p.file, p.data_offset, p.storage_offset, p.sizes, p.stride, tuple(chunk.offsets)))
    td = TensorData(dtype, shape, tuple(pieces))
    err = td.coverage_error()
    if err is not None:
        corrupt.append((fqn, err, None))
        return Unreadable(err)
    return td


def _bytes_item(
    fqn: str,
    located: dict[Any, tuple[str, int, int] | Unreadable],
    corrupt: list[tuple[str, str, int | None]],
) -> Any:
    where = located.get((fqn, None))
    if where is None:
        corrupt.append((fqn, "no storage entry", None))
        return Unreadable("no storage entry")
    if isinstance(where, Unreadable):
        return where
    file, offset, length = where
    if length > MAX_BYTES_ITEM:
        return Unreadable(f"non-tensor item of {length} bytes not loaded", file)
    try:
        tz = read_torch_zip(file, offset, length)
    except TorchZipError as exc:
        corrupt.append((fqn, str(exc), exc.offset))
        return Unreadable(str(exc), file)
    if not tz.loaded:
        corrupt.append((fqn, f"references {', '.join(tz.scan.unsafe + tz.scan.harmless)}; not loaded", offset))
        return Unreadable("unsafe pickle", file)
    return tz.obj


def _unflatten(flat: dict[str, Any], mapping: Any) -> Any:
    """Rebuild the nested state dict from DCP's flattened keys, using the saved path tuples."""
    root: dict[Any, Any] = {}
    for key, value in flat.items():
        path = mapping.get(key) if isinstance(mapping, dict) else None
        if not isinstance(path, tuple | list) or not path:
            path = (key,)
        node = root
        for p in path[:-1]:
            nxt = node.get(p)
            if not isinstance(nxt, dict):
                nxt = {}
                node[p] = nxt
            node = nxt
        node[path[-1]] = value
    return _lists(root)


def _lists(node: Any) -> Any:
    if isinstance(node, dict):
        converted = {k: _lists(v) for k, v in node.items()}
        keys = list(converted)
        if keys and all(isinstance(k, int) for k in keys) and sorted(keys) == list(range(len(keys))):
            return [converted[i] for i in range(len(keys))]
        return converted
    return node
