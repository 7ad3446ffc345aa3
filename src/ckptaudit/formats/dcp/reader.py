"""``torch.distributed.checkpoint`` directories: ``.metadata`` plus ``__<rank>_<n>.distcp`` data files.

``.metadata`` is a pickle; :func:`read_dcp` scans it and unpickles it only through the DCP allowlist into
plain data (:func:`ckptaudit.formats.dcp.metadata.load_dcp_metadata`), never with plain :mod:`pickle` as
``FileSystemReader.read_metadata`` does. :func:`check_metadata_safe` is the same guard for callers that are
about to load the directory; it returns the vetted :class:`~ckptaudit.formats.dcp.metadata.DcpMetadata`, which
:func:`ckptaudit.formats.torchload.vetted_dcp_load` hands to ``torch.distributed.checkpoint.load`` (so the loader
reads exactly what was checked, never the pickle again).

Every item named in the metadata is located (file inside the directory, offset + length inside the file)
before it is read; each item is itself a ``torch.save`` archive, read with
:func:`ckptaudit.formats.zip.archive.read_torch_zip`'s checks (through
:class:`~ckptaudit.formats.zip.archive.TorchZipFiles`, which opens each data file once for all its items).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from ckptaudit.catalogue import finding
from ckptaudit.findings import Finding
from ckptaudit.formats.base import Part, Unreadable
from ckptaudit.formats.dcp.metadata import (
    BytesMeta,
    DcpMetadata,
    IndexKey,
    MalformedMeta,
    MetadataShapeError,
    StorageInfo,
    TensorMeta,
    load_dcp_metadata,
)
from ckptaudit.formats.io.safeio import LimitExceeded, NotRegularFile, file_kind, read_limited
from ckptaudit.formats.io.tensors import DTYPES, Piece, TensorData
from ckptaudit.formats.pickle.allowlist import DCP_METADATA_GLOBALS
from ckptaudit.formats.pickle.scan import (
    PickleLimitError,
    PickleScan,
    UnsafeBuildError,
    opcode_limit,
    scan,
)
from ckptaudit.formats.zip.archive import TorchZipError, TorchZipFiles, read_torch_zip

if TYPE_CHECKING:
    from ckptaudit.formats.contract import Reading

__all__ = ["DcpRead", "UnsafeCheckpointError", "check_metadata_safe", "is_dcp_dir", "read_dcp", "read_dcp_into"]

METADATA = ".metadata"
MAX_BYTES_ITEM = 64 << 20
"""Non-tensor items larger than this are not loaded (real ones are a few bytes to a few KiB)."""
MAX_METADATA_BYTES = 512 << 20
"""``.metadata`` larger than this is not read (real ones: a few KiB to tens of MiB)."""


def is_dcp_dir(path: str) -> bool:
    """Whether ``path`` is a directory with ``.metadata`` or ``.distcp`` files (``False`` if unreadable)."""
    if not os.path.isdir(path):
        return False
    if os.path.lexists(os.path.join(path, METADATA)):
        return True
    try:
        return any(n.endswith(".distcp") for n in os.listdir(path))
    except OSError:
        return False


@dataclass
class DcpRead:
    part: Part | None
    findings: list[Finding]
    files: dict[str, int]
    metadata: DcpMetadata | None = None
    digest: tuple[int, str] | None = None
    """The size and xxh3-128 (hex) of the ``.metadata`` bytes parsed: what a distributed audit's ranks check
    their own view of the file against (:mod:`ckptaudit.auditing.distributed`); ``None`` when it was not read."""


class UnsafeCheckpointError(Exception):
    """A DCP directory (or file) that must not be given to ``torch.distributed.checkpoint.load`` (or
    ``torch.load``): it would execute code, leave its directory, block, or read past its files."""


def _metadata_problem(root: str) -> tuple[str, str, bytes | None]:
    """Read ``root/.metadata`` safely: ``(code, message, None)`` on failure, ``("", "", data)`` on success."""
    meta_path = os.path.join(root, METADATA)
    escape = path_problem(root, METADATA)
    if escape is not None:
        return ("integrity.path-escape",
                f"{METADATA} is a link leading outside the directory (to {os.path.realpath(meta_path)}); not read",
                None)
    try:
        return "", "", read_limited(meta_path, MAX_METADATA_BYTES, METADATA)
    except LimitExceeded as exc:
        return "integrity.corrupt", str(exc), None
    except NotRegularFile as exc:
        return "integrity.corrupt", f"{METADATA} is not a regular file ({exc.strerror}); not opened", None
    except OSError as exc:
        return "integrity.corrupt", f"cannot read {METADATA} ({exc.strerror or exc})", None


def _scan_problem(result: PickleScan) -> tuple[str, str] | None:
    bad = result.unsafe + result.harmless
    if bad:
        return "security.unsafe-pickle", (
            f"{METADATA} references {', '.join(bad)}, outside the DCP metadata allowlist; it was not loaded "
            "(torch.distributed.checkpoint.load would have executed it)")
    if result.error is not None:
        return "integrity.corrupt", (
            f"{METADATA} is not a readable pickle (byte {result.error_offset}: {result.error})")
    return None


def _load_metadata(data: bytes, scanned: PickleScan) -> tuple[DcpMetadata | None, str, str]:
    """Unpickle (restricted) and rebuild the metadata as plain data: ``(md, "", "")`` or
    ``(None, finding code, why)``. ``scanned`` is the scan of ``data``."""
    try:
        return load_dcp_metadata(data, scanned), "", ""
    except MemoryError:
        raise
    except UnsafeBuildError as exc:
        return None, "security.unsafe-pickle", (
            f"{METADATA} is crafted to show checks one thing and torch.distributed.checkpoint.load another ({exc}); "
            "it was not loaded")
    except PickleLimitError as exc:
        return None, "integrity.corrupt", f"{METADATA} exceeds a safety limit ({exc})"
    except MetadataShapeError as exc:
        return None, "integrity.corrupt", f"{METADATA} cannot be interpreted ({exc})"
    except Exception as exc:  # noqa: BLE001 - any failure of the restricted unpickler is corrupt metadata
        return None, "integrity.corrupt", f"{METADATA} cannot be interpreted ({type(exc).__name__}: {exc})"


def _item_range(info: StorageInfo) -> tuple[str, int, int] | str:
    """``(relative path, offset, length)`` of a storage entry, or why it is malformed."""
    if info.problem is not None:
        return info.problem
    return info.relative_path, info.offset, info.length


def check_metadata_safe(path: str) -> DcpMetadata:
    """The vetted metadata of ``path``; raise :class:`UnsafeCheckpointError` unless
    ``torch.distributed.checkpoint.load`` can be given ``path`` with that metadata (see
    :func:`ckptaudit.formats.torchload.vetted_dcp_load`) without running code from it, leaving it, blocking on it
    or reading past its files.

    Checks: ``path/.metadata`` is a regular file inside ``path``, parses, and references only the DCP
    allowlist; every file it names lies inside ``path`` (no ``..``, absolute path or escaping link) and, if
    present, is a regular file holding the item's byte range; and every non-tensor item (which DCP's
    ``DefaultLoadPlanner.load_bytes`` unpickles with ``torch.load(weights_only=False)``) is a ``torch.save``
    archive whose pickle references only the allowlist and loads, restricted, within the limits (no hash-collision
    or amplification bomb). DCP unpickles ``.metadata`` with plain ``pickle``, so
    call this before every ``torch.distributed.checkpoint.load``, and load through the metadata it returns.
    """
    meta_path = os.path.join(path, METADATA)
    _code, message, data = _metadata_problem(path)
    if data is None:
        raise UnsafeCheckpointError(f"{meta_path}: {message}")
    scanned = scan(data, DCP_METADATA_GLOBALS, max_opcodes=opcode_limit(len(data)))
    problem = _scan_problem(scanned)
    if problem is not None:
        raise UnsafeCheckpointError(f"{meta_path}: {problem[1]}; refusing to load it")
    md, _code, why = _load_metadata(data, scanned)
    if md is None:
        raise UnsafeCheckpointError(f"{meta_path}: {why}")
    for item_md in md.state_dict_metadata.values():
        if isinstance(item_md, MalformedMeta):
            raise UnsafeCheckpointError(f"{meta_path}: {item_md.reason}")
    if md.planner_problems:
        raise UnsafeCheckpointError(f"{meta_path}: {md.planner_problems[0]}; the audit judges this checkpoint "
                                    "corrupt (what a key-path reading of it would load is not what was checked)")
    entries: dict[IndexKey, tuple[str, int, int, StorageInfo]] = {}
    for index, info in md.storage_data.items():
        where = _item_range(info)
        item = index.fqn
        if isinstance(where, str):
            raise UnsafeCheckpointError(f"{meta_path}: item {item}: {where}")
        rel, offset, length = where
        escape = path_problem(path, rel)
        if escape is not None:
            raise UnsafeCheckpointError(f"{meta_path} {escape} (item {item})")
        full = os.path.join(path, rel)
        try:
            kind = file_kind(full)
        except OSError:
            continue  # missing: torch.distributed.checkpoint.load fails on it with a clear error
        if kind is not None:
            raise UnsafeCheckpointError(f"{full} is {kind}, not a regular file (item {item})")
        size = os.path.getsize(full)
        if offset + length > size:
            raise UnsafeCheckpointError(
                f"{meta_path}: item {item} needs bytes {offset}..{offset + length} of {rel}, which has {size}")
        entries[index] = (full, offset, length, info)
    for fqn, item_md in md.state_dict_metadata.items():
        if isinstance(item_md, TensorMeta):
            continue  # tensors are loaded with torch.load(weights_only=True)
        found = entries.get(IndexKey(fqn, None))
        if found is None:
            continue
        full, offset, length, info = found
        if info.transform_descriptors:
            raise UnsafeCheckpointError(
                f"{meta_path}: non-tensor item {fqn} is stored through transforms {info.transform_descriptors}; "
                "its pickle cannot be vetted before torch.load(weights_only=False) runs it")
        try:
            # Loaded (restricted) too, not only scanned: what torch.load would build must be within the limits
            # (hash collisions, amplification), or loading it would hang the job.
            tz = read_torch_zip(full, offset, length, load=True)
        except TorchZipError as exc:
            raise UnsafeCheckpointError(
                f"{full}: non-tensor item {fqn} at byte {offset} is not a readable torch.save archive within the "
                f"reader's limits ({exc}); torch.distributed.checkpoint.load would unpickle it with "
                "weights_only=False") from None
        bad = tz.scan.unsafe + tz.scan.harmless
        if bad or tz.scan.error is not None:
            raise UnsafeCheckpointError(
                f"{full}: non-tensor item {fqn} at byte {offset} references {', '.join(bad) or 'unvettable data'}; "
                "torch.distributed.checkpoint.load would unpickle it with torch.load(weights_only=False)")
    return md


def path_problem(root: str, rel: Any) -> str | None:
    if not isinstance(rel, str) or not rel:
        return f"names a data file {rel!r} that is not a relative path"
    if "\x00" in rel:
        return f"names data file {rel!r} with a NUL byte"
    if os.path.isabs(rel) or rel.startswith(("/", "\\")) or (len(rel) > 1 and rel[1] == ":"):
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
    files: dict[str, int] = {}
    try:
        listing = sorted(os.listdir(path))
    except OSError as exc:
        findings.append(finding("integrity.corrupt", subject or path,
                                f"{subject}: cannot list the directory ({exc.strerror or exc})"))
        return DcpRead(None, findings, files)
    for n in listing:
        if not (n.endswith(".distcp") or n == METADATA):
            continue
        try:
            st_kind, size = file_kind(os.path.join(path, n)), os.path.getsize(os.path.join(path, n))
        except OSError:
            continue
        if st_kind is None:
            files[os.path.join(name, n) if name else n] = size
    meta_path = os.path.join(path, METADATA)
    meta_subject = os.path.join(name, METADATA) if name else METADATA
    if not os.path.lexists(meta_path):
        findings.append(
            finding(
                "integrity.incomplete",
                meta_subject,
                f"{subject}: no {METADATA} file; torch.distributed.checkpoint writes it last, so the save did "
                "not finish (or the file was lost). The data files cannot be interpreted without it.",
                data_files=[f for f in files if f.endswith(".distcp")],
            )
        )
        return DcpRead(None, findings, files)
    code, message, data = _metadata_problem(path)
    if data is None:
        findings.append(finding(code, meta_subject, f"{subject}: {message}", file=meta_subject))
        return DcpRead(None, findings, files)
    digest = (len(data), xxhash.xxh3_128_hexdigest(data))
    result = scan(data, DCP_METADATA_GLOBALS, max_opcodes=opcode_limit(len(data)))
    problem = _scan_problem(result)
    if problem is not None:
        evidence: dict[str, Any] = {"globals": list(result.unsafe + result.harmless)} if problem[0].startswith(
            "security") else {"offset": result.error_offset}
        findings.append(finding(problem[0], meta_subject, problem[1], file=meta_subject, **evidence))
        return DcpRead(None, findings, files, digest=digest)
    md, code, why = _load_metadata(data, result)
    if md is None:
        findings.append(finding(code, meta_subject, why, file=meta_subject))
        return DcpRead(None, findings, files, digest=digest)
    sd_meta, storage = md.state_dict_metadata, md.storage_data
    for why in md.planner_problems:
        # DCP loads items by their keys; a path that disagrees would let one item stand in another's place
        findings.append(finding(
            "integrity.corrupt", meta_subject,
            f"{METADATA}: {why}; torch.distributed.checkpoint.load finds every item by its key, so the key paths "
            "of planner_data are not used (every key is judged at the top of the state dict)", file=meta_subject))

    # Locate every storage item once: file inside the directory, a regular file, range inside the file, and
    # no two items sharing bytes (a hostile metadata could point a million items at one range).
    # Keyed by (fqn, offsets), plain tuples: looked up once per shard (thousands), hashed and compared in C.
    located: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int] | Unreadable] = {}
    missing_files: dict[str, list[str]] = {}
    short_files: dict[str, tuple[int, int]] = {}
    by_file: dict[str, list[tuple[int, int, tuple[str, tuple[int, ...] | None]]]] = {}
    # Thousands of items share a few data files: each file's path is vetted and stat'ed once.
    path_problems: dict[str, str | None] = {}
    stats: dict[str, tuple[str | None, int] | None] = {}
    irregular: set[str] = set()
    fulls: dict[str, tuple[str, str]] = {}  # a data file's path and name, joined once
    for index, info in storage.items():
        fqn = index.fqn
        key = (fqn, index.offset)
        where = _item_range(info)
        if isinstance(where, str):
            located[key] = Unreadable(where)
            findings.append(finding("integrity.corrupt", meta_subject, f"{METADATA}: item {fqn}: {where}",
                                    item=fqn))
            continue
        rel, offset, length = where
        if type(rel) is str:
            if rel not in path_problems:
                path_problems[rel] = path_problem(path, rel)
            problem_path = path_problems[rel]
        else:
            problem_path = path_problem(path, rel)
        if problem_path:
            findings.append(
                finding("integrity.path-escape", meta_subject, f"{METADATA} {problem_path} (item {fqn}); not read",
                        item=fqn, file=str(rel))
            )
            located[key] = Unreadable(problem_path, str(rel))
            continue
        joined = fulls.get(rel)
        if joined is None:
            joined = fulls[rel] = (os.path.join(path, rel), os.path.join(name, rel) if name else rel)
        full, rel_name = joined
        if info.transform_descriptors:
            # torch.distributed.checkpoint.load reads such an item through its transforms (zstd, ...), which
            # ckptaudit does not: the two readings differ, so the item is refused rather than left unjudged.
            located[key] = Unreadable(
                f"storage transforms {info.transform_descriptors} are not supported", rel_name
            )
            if isinstance(sd_meta.get(fqn), BytesMeta):
                findings.append(finding(
                    "security.unvetted-pickle", fqn,
                    f"item {fqn} is stored through transforms {list(info.transform_descriptors)}: "
                    "torch.distributed.checkpoint.load would undo them and unpickle the result with "
                    "torch.load(weights_only=False); ckptaudit does not read transformed items, so it cannot vet it",
                    item=fqn, file=rel_name))
            else:
                findings.append(finding(
                    "integrity.corrupt", fqn,
                    f"item {fqn} is stored through transforms {list(info.transform_descriptors)}, which "
                    "torch.distributed.checkpoint.load undoes and ckptaudit does not: its data is not read, so it "
                    "cannot be judged", item=fqn, file=rel_name))
            continue
        if full not in stats:
            try:
                stats[full] = (file_kind(full), os.path.getsize(full))
            except OSError:
                stats[full] = None
        st = stats[full]
        if st is not None:
            kind, size = st
        else:
            missing_files.setdefault(rel_name, []).append(fqn)
            located[key] = Unreadable(f"data file {rel_name} is missing", rel_name)
            continue
        if kind is not None:
            if rel_name not in irregular:  # once per file (a set: the items naming it may be millions)
                irregular.add(rel_name)
                findings.append(finding("integrity.corrupt", rel_name,
                                        f"data file {rel_name} is {kind}, not a regular file; not opened",
                                        file=rel_name))
            located[key] = Unreadable(f"{rel_name} is {kind}", rel_name)
            continue
        files.setdefault(rel_name, size)
        if offset + length > size:
            need = max(offset + length, short_files.get(rel_name, (0, 0))[0])
            short_files[rel_name] = (need, size)
            located[key] = Unreadable(
                f"{rel_name} has {size} bytes, item needs bytes {offset}..{offset + length}", rel_name
            )
            continue
        located[key] = (full, offset, length)
        by_file.setdefault(full, []).append((offset, length, key))
    for full, ranges in by_file.items():
        ranges.sort(key=lambda r: (r[0], r[1]))
        prev_end = 0
        prev_fqn: str | None = None
        for offset, length, key in ranges:
            if length and offset < prev_end:
                rel_name = os.path.relpath(full, path)
                rel_name = os.path.join(name, rel_name) if name else rel_name
                fqn = key[0]
                findings.append(finding(
                    "integrity.corrupt", rel_name,
                    f"{METADATA} puts item {fqn} at bytes {offset}..{offset + length} of {rel_name}, overlapping "
                    f"item {prev_fqn or '?'}; torch.distributed.checkpoint never shares bytes "
                    "between items", offset=offset, item=fqn))
                located[key] = Unreadable("overlaps another item", rel_name)
                continue
            prev_end, prev_fqn = max(prev_end, offset + length), key[0]
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

    flat: dict[Any, Any] = {}
    corrupt: list[tuple[str, str, str, int | None]] = []
    where_of: dict[int, str] = {}  # corrupt entry -> file of the item
    with TorchZipFiles() as archives:  # each data file opened once for all its items
        for fqn, item in sd_meta.items():
            first = len(corrupt)
            try:
                if isinstance(item, TensorMeta):
                    flat[fqn] = _tensor_item(fqn, item, located, corrupt, archives)
                elif isinstance(item, BytesMeta):
                    flat[fqn] = _bytes_item(fqn, located, corrupt, archives)
                else:
                    corrupt.append(("integrity.corrupt", fqn, f"its metadata entry is malformed ({item.reason})",
                                    None))
                    flat[fqn] = Unreadable("malformed metadata entry")
            except (AttributeError, TypeError, ValueError, KeyError, OverflowError) as exc:
                corrupt.append(("integrity.corrupt", str(fqn),
                                f"its metadata entry is malformed ({type(exc).__name__}: {exc})", None))
                flat[fqn] = Unreadable("malformed metadata entry")
            leaf = flat[fqn]
            if isinstance(leaf, Unreadable) and leaf.file:
                rel_file = os.path.relpath(leaf.file, path) if os.path.isabs(leaf.file) else leaf.file
                for i in range(first, len(corrupt)):
                    where_of[i] = os.path.join(name, rel_file) if name else rel_file
    for i, (code, fqn, reason, at) in enumerate(corrupt):
        item_evidence: dict[str, Any] = {"offset": at}
        if i in where_of:
            item_evidence["file"] = where_of[i]
        findings.append(finding(code, fqn, f"item {fqn}: {reason}", **item_evidence))
    tree = _unflatten(flat, md.planner_data)
    return DcpRead(Part(name, "dcp", tree), findings, files, md, digest)


def _tensor_item(
    fqn: str,
    item: TensorMeta,
    located: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int] | Unreadable],
    corrupt: list[tuple[str, str, str, int | None]],
    archives: TorchZipFiles,
) -> TensorData | Unreadable:
    dtype_name = item.properties.dtype
    dtype = DTYPES.get(dtype_name)
    shape = item.size
    if dtype is None:
        corrupt.append(("integrity.corrupt", fqn, f"unsupported dtype {dtype_name}", None))
        return Unreadable(f"unsupported dtype {dtype_name}")
    pieces: list[Piece] = []
    for chunk in item.chunks:
        offsets, sizes = chunk.offsets, chunk.sizes
        where = located.get((fqn, offsets))
        if where is None:
            corrupt.append(("integrity.corrupt", fqn, f"no storage entry for the shard at offsets {list(offsets)}",
                            None))
            return Unreadable("shard not in storage_data")
        if isinstance(where, Unreadable):
            return where
        file, offset, length = where
        try:
            tz = archives.read(file, offset, length)
        except TorchZipError as exc:
            corrupt.append((exc.code, fqn, f"shard at offsets {list(offsets)}: {exc}", exc.offset))
            return Unreadable(str(exc), file)
        td = tz.obj
        if not tz.loaded:
            corrupt.append(("security.unsafe-pickle", fqn, f"shard at offsets {list(offsets)} references "
                            f"{', '.join(tz.scan.unsafe + tz.scan.harmless)}, outside the safe allowlist; not "
                            "loaded, never executed", offset))
            return Unreadable("unsafe pickle", file)
        if not isinstance(td, TensorData):
            corrupt.append(("integrity.corrupt", fqn, "shard does not hold a plain tensor", offset))
            return Unreadable("shard does not hold a plain tensor", file)
        if td.dtype != dtype or td.shape != sizes:
            corrupt.append(
                ("integrity.corrupt", fqn,
                 f"shard holds {td.dtype.name}{list(td.shape)}, metadata says {dtype.name}{list(sizes)}", offset)
            )
            return Unreadable("shard does not match the metadata", file)
        p = td.pieces[0]
        # The archive's piece sits at offset zero: a whole tensor's (a one-process save) is the shard as it is.
        pieces.append(p if p.offsets == offsets else Piece(p.file, p.data_offset, p.storage_offset, p.sizes,
                                                           p.stride, offsets))
    td = TensorData(dtype, shape, tuple(pieces))
    err = td.coverage_error()
    if err is not None:
        corrupt.append(("integrity.corrupt", fqn, err, None))
        return Unreadable(err)
    return td


def _bytes_item(
    fqn: str,
    located: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int] | Unreadable],
    corrupt: list[tuple[str, str, str, int | None]],
    archives: TorchZipFiles,
) -> Any:
    where = located.get((fqn, None))
    if where is None:
        corrupt.append(("integrity.corrupt", fqn, "no storage entry", None))
        return Unreadable("no storage entry")
    if isinstance(where, Unreadable):
        return where
    file, offset, length = where
    if length > MAX_BYTES_ITEM:
        return Unreadable(f"non-tensor item of {length} bytes not loaded", file)
    try:
        tz = archives.read(file, offset, length)
    except TorchZipError as exc:
        corrupt.append((exc.code, fqn, str(exc), exc.offset))
        return Unreadable(str(exc), file)
    if not tz.loaded:
        corrupt.append(("security.unsafe-pickle", fqn,
                        f"references {', '.join(tz.scan.unsafe + tz.scan.harmless)}, outside the safe allowlist; "
                        "not loaded, never executed (torch.distributed.checkpoint.load would run it: it unpickles "
                        "non-tensor items with torch.load(weights_only=False))", offset))
        return Unreadable("unsafe pickle", file)
    return tz.obj


def _unflatten(flat: dict[str, Any], mapping: Mapping[str, tuple[str | int, ...]]) -> Any:
    """The nested state dict of DCP's items, each found by its flattened key (as ``dcp.load`` finds it) and placed
    at its key path: ``mapping`` holds only paths that join back to their keys and never meet
    (:func:`ckptaudit.formats.dcp.metadata.rebuild` vetted them), so no item can take another's place. Should two
    meet anyway, the items stay at the top under their keys: never an overwrite."""
    root: dict[Any, Any] = {}
    made = {id(root)}  # the dicts made here (an item's own value may be a dict too: never written into)
    for key, value in flat.items():
        path: tuple[str | int, ...] = mapping.get(key) or (key,)
        node = root
        for p in path[:-1]:
            if p not in node:
                node[p] = {}
                made.add(id(node[p]))
            elif id(node[p]) not in made:
                return dict(flat)
            node = node[p]
        if path[-1] in node:
            return dict(flat)
        node[path[-1]] = value
    return _lists(root, made)


def _lists(node: Any, made: set[int]) -> Any:
    if id(node) not in made:
        return node  # an item's value, as loaded
    converted = {k: _lists(v, made) for k, v in node.items()}
    keys = list(converted)
    if keys and all(type(k) is int for k in keys) and sorted(keys) == list(range(len(keys))):
        return [converted[i] for i in range(len(keys))]
    return converted


EXTRAS = ("manifest.json", "ckptaudit.json", "metadata.json", "common.pt")
"""The files read beside a DCP checkpoint's items: our manifest; Megatron-Core's metadata.json (backends) and
common.pt (its unsharded state)."""


def read_dcp_into(path: str, name: str, reading: Reading) -> None:
    """The DCP directory reader (:mod:`ckptaudit.formats.contract`): ``path`` read into ``reading``; the checkpoint
    itself (``name`` empty) with the files of :data:`EXTRAS` beside it."""
    read = read_dcp(path, name) if name else read_dcp(path)
    reading.findings.extend(read.findings)
    reading.files.update(read.files)
    if read.digest is not None:
        reading.digests[os.path.join(name, METADATA) if name else METADATA] = read.digest
    if read.part is not None:
        reading.parts.append(read.part)
    if name:
        return
    for extra in EXTRAS:
        extra_path = os.path.join(path, extra)
        if os.path.lexists(extra_path):
            part = reading.read_entry(extra_path, extra)
            if part is not None:
                reading.parts.append(part)
