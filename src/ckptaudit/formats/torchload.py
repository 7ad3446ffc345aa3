"""Loading checkpoints into real tensors, safely, for the parts of ckptaudit that need values (resuming,
comparing, exporting).

One reading: what torch loads is what ckptaudit vetted, from the same open file.

The stable names a user imports are in :mod:`ckptaudit.load` (``load``, ``load_dcp``, ``dcp_reader``); the names
0.x taught here (``safe_torch_load``, ``safe_dcp_load``, ``safe_dcp_reader``) still import, with a
``DeprecationWarning``.

- :func:`vetted_torch_load`: the archive is read as the audit reads it first (torch's zip reading restated, the
  allowlist scan, then the restricted unpickler and its limits), through one open descriptor, then loaded with
  ``torch.load(weights_only=True, mmap=True)`` from that same descriptor (``/proc/self/fd``: a file renamed over
  the path in between is not what torch reads) and only the NumPy globals RNG states need added.
- :func:`vetted_dcp_load`: :func:`ckptaudit.formats.dcp.reader.check_metadata_safe` first (``.metadata`` and every
  non-tensor item are pickles that ``torch.distributed.checkpoint.load`` unpickles without restriction), then
  ``torch.distributed.checkpoint.load`` through :func:`vetted_dcp_reader`, a storage reader that serves the
  metadata the check rebuilt as plain data (converted to torch's classes here), never the pickle itself, and
  reads every item itself: each non-tensor item's bytes are read once, checked, and those very bytes handed to
  the planner; each tensor item is checked and loaded through one open descriptor. Call it on every rank, like
  ``torch.distributed.checkpoint.load``.

What no reader of a shared file can promise: a process that rewrites a file in place, bytes at the same offsets,
while it is loaded (tensor items and ``torch.save`` files are mapped or read after the check).
"""

from __future__ import annotations

import os
from typing import IO, Any, cast

from ckptaudit.formats.dcp.metadata import BytesMeta, DcpMetadata, TensorMeta
from ckptaudit.formats.dcp.reader import UnsafeCheckpointError, check_metadata_safe
from ckptaudit.formats.io.safeio import NotRegularFile
from ckptaudit.formats.io.tensors import TensorData
from ckptaudit.formats.zip.archive import (
    RegionStream,
    TorchZip,
    TorchZipError,
    TorchZipFile,
    read_torch_zip_bytes,
)
from ckptaudit.formats.zip.central import Region

__all__ = ["to_torch_metadata", "vetted_dcp_load", "vetted_dcp_reader", "vetted_torch_load"]

_DEPRECATED = {"safe_torch_load": ("vetted_torch_load", "ckptaudit.load.load(path)"),
               "safe_dcp_load": ("vetted_dcp_load", "ckptaudit.load.load_dcp(state_dict, path)"),
               "safe_dcp_reader": ("vetted_dcp_reader", "ckptaudit.load.dcp_reader(path)")}
"""The names the docs of 0.x taught (``from ckptaudit.formats.torchload import safe_dcp_load``): still importable,
with a ``DeprecationWarning`` naming the stable one, until the release CHANGELOG.md names."""


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        import warnings

        internal, public = _DEPRECATED[name]
        warnings.warn(f"ckptaudit.formats.torchload.{name} is internal and deprecated; use {public} (docs/api.md, "
                      "'Loading a checkpoint safely'); the old name goes in ckptaudit 0.3", DeprecationWarning,
                      stacklevel=2)
        return globals()[internal]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def numpy_globals() -> list[Any]:
    import numpy as np

    found: list[Any] = [np.ndarray, np.dtype]
    for mod_name in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            mod = __import__(mod_name, fromlist=["_reconstruct"])
        except ImportError:
            continue
        found += [getattr(mod, "_reconstruct", None), getattr(mod, "scalar", None)]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        found += [getattr(dtypes, n) for n in dir(dtypes) if n.endswith("DType")]
    return [g for g in found if g is not None]


def vetted_torch_load(path: str | os.PathLike[str]) -> Any:
    """Load a ``torch.save`` zip archive without executing anything outside the allowlist.

    The archive is first read exactly as the offline audit reads it (:meth:`~ckptaudit.formats.zip.archive.
    TorchZipFile.read`: torch's zip reading restated, every opcode scanned against the allowlist, then
    ``data.pkl`` built by the restricted unpickler under its limits: colliding-hash keys, the built-size budget,
    tensors addressing more than the archive; docs/security.md), so ``torch.load`` only ever sees a pickle the
    audit would have accepted, and reads it from the descriptor that was checked.

    Raises :class:`UnsafeCheckpointError` naming the offending globals, the limit the pickle broke or the reading
    torch and ckptaudit would disagree on, or ``ValueError`` for files that are not readable ``torch.save``
    archives.
    """
    import torch

    path = os.fspath(path)
    try:
        archive = TorchZipFile(path)
    except NotRegularFile as exc:
        raise ValueError(f"{path} is not a torch.save zip archive ({exc.strerror})") from None
    with archive:
        if os.pread(archive.fd, 4, 0) != b"PK\x03\x04":
            raise ValueError(f"{path} is not a torch.save zip archive")
        _vetted(path, archive.read)
        # The descriptor that was checked, reopened by torch (mmap included) through /proc: never the path again.
        same = f"/proc/self/fd/{archive.fd}"
        with torch.serialization.safe_globals(numpy_globals()):
            return torch.load(same if os.path.exists(same) else path, map_location="cpu", weights_only=True,
                              mmap=True)


def _vetted(what: str, read: Any, *args: Any) -> TorchZip:
    """``read(*args)`` (a :class:`TorchZip`), or :class:`UnsafeCheckpointError` / ``ValueError`` saying why not."""
    try:
        tz: TorchZip = read(*args)
    except TorchZipError as exc:
        if exc.limit or exc.code != "integrity.corrupt":
            raise UnsafeCheckpointError(f"{what}: {exc}; refusing to load it (docs/security.md)") from None
        raise ValueError(f"{what}: {exc}") from None
    if not tz.scan.loadable or not tz.loaded:
        bad = tz.scan.unsafe + tz.scan.harmless
        raise UnsafeCheckpointError(f"{what} references {', '.join(bad) or 'unvettable data'}; refusing to load it")
    return tz


def materialize(data: Any, maps: Any) -> Any:
    """Read a lazy :class:`~ckptaudit.formats.io.tensors.TensorData` into a real CPU tensor of its stored dtype.

    Only for tensors that fit in memory by design (loading weights into a live model); the audit never does this.
    """
    import numpy as np
    import torch

    from ckptaudit.formats.io.tensors import iter_chunks

    parts = [np.array(c, copy=True) for c in iter_chunks(data, maps)]
    flat = np.concatenate(parts) if parts else np.empty(0, dtype=data.dtype.numpy)
    name = data.dtype.name
    if name == "bfloat16":
        t = torch.from_numpy(flat.view(np.int16)).view(torch.bfloat16)
    elif data.dtype.numpy == "u1" and data.dtype.is_float:
        t = torch.from_numpy(flat).view(getattr(torch, name))
    else:
        t = torch.from_numpy(flat)
    return t.reshape(data.shape)


def to_torch_metadata(md: DcpMetadata) -> Any:
    """``torch.distributed.checkpoint.metadata.Metadata`` built from vetted plain data (for the live loader).

    What the pickle shared stays shared, as torch's own ``pickle.load`` of ``.metadata`` would share it: each
    distinct chunk list (:func:`~ckptaudit.formats.dcp.metadata.rebuild` converts each once, however many
    entries reach it through the memo) and each distinct set of properties becomes one torch object, so the
    work here is linear in the metadata's bytes, not in its entries times their shared chunks.
    """
    import torch
    from torch.distributed.checkpoint import filesystem as dcp_fs
    from torch.distributed.checkpoint import metadata as dcp_md

    formats = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
               "preserve_format": torch.preserve_format}
    sd: dict[str, Any] = {}
    chunk_lists: dict[int, tuple[Any, list[Any]]] = {}  # id(vetted tuple) -> (the tuple, kept alive; torch's list)
    properties: dict[Any, Any] = {}
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, TensorMeta):
            p = item.properties
            props = properties.get(p)
            if props is None:
                dtype, layout = getattr(torch, p.dtype, None), getattr(torch, p.layout, None)
                if not isinstance(dtype, torch.dtype) or not isinstance(layout, torch.layout):
                    raise UnsafeCheckpointError(f"item {fqn}: dtype {p.dtype} / layout {p.layout} unknown to torch")
                props = properties[p] = dcp_md.TensorProperties(
                    dtype=dtype, layout=layout, requires_grad=p.requires_grad,
                    memory_format=formats[p.memory_format], pin_memory=p.pin_memory)
            got = chunk_lists.get(id(item.chunks))
            if got is None or got[0] is not item.chunks:
                got = chunk_lists[id(item.chunks)] = (item.chunks, [
                    dcp_md.ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in item.chunks])
            sd[fqn] = dcp_md.TensorStorageMetadata(props, torch.Size(item.size), got[1])
        elif isinstance(item, BytesMeta):
            sd[fqn] = dcp_md.BytesStorageMetadata()
        else:
            raise UnsafeCheckpointError(item.reason)
    storage = {}
    for key, info in md.storage_data.items():
        if info.problem is not None:
            raise UnsafeCheckpointError(f"item {key.fqn}: {info.problem}")
        storage[dcp_md.MetadataIndex(key.fqn, key.offset)] = dcp_fs._StorageInfo(
            info.relative_path, info.offset, info.length,
            list(info.transform_descriptors) if info.transform_descriptors is not None else None)
    sm = md.storage_meta
    storage_meta = dcp_md.StorageMeta() if sm is None else dcp_md.StorageMeta(
        checkpoint_id=sm.checkpoint_id, save_id=sm.save_id, load_id=sm.load_id, modules=list(sm.modules))
    return dcp_md.Metadata(state_dict_metadata=sd, planner_data=dict(md.planner_data), storage_data=storage,
                           storage_meta=storage_meta, version=md.version)


def vetted_dcp_reader(path: str | os.PathLike[str]) -> Any:
    """A ``torch.distributed.checkpoint.FileSystemReader`` of ``path`` whose ``read_metadata`` returns the
    metadata :func:`~ckptaudit.formats.dcp.reader.check_metadata_safe` vetted (raises :class:`UnsafeCheckpointError`
    when it refuses ``path``): ``.metadata`` is never unpickled by torch. Its ``read_data`` reads every item
    itself (:func:`_read_vetted`): what torch unpickles is what ckptaudit checked, byte for byte.

    (all ranks) call it on every rank that loads, so each rank loads only what it checked itself.
    """
    from torch.distributed.checkpoint import FileSystemReader

    root = os.fspath(path)
    vetted = to_torch_metadata(check_metadata_safe(root))

    class _VettedReader(FileSystemReader):  # type: ignore[misc]
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            vetted.storage_meta.load_id = self.load_id
            return vetted

        def read_data(self, plan: Any, planner: Any) -> Any:
            return _read_vetted(root, self.storage_data, plan, planner)

    return _VettedReader(root)


def _read_vetted(root: str, storage_data: dict[Any, Any], plan: Any, planner: Any) -> Any:
    """``FileSystemReader.read_data``, each item checked first and handed to torch from what was checked: a
    non-tensor item's bytes are read once, read as the audit reads an item (:func:`~ckptaudit.formats.zip.archive.
    read_torch_zip_bytes`: torch's zip reading, the allowlist, the restricted load) and those very bytes given to
    ``planner.load_bytes`` (which unpickles them with ``weights_only=False`` in the default planner); a
    tensor item is checked through one open descriptor and ``torch.load(weights_only=True)`` reads it through the
    same descriptor. (each rank) for the items of its plan; raises :class:`UnsafeCheckpointError` before handing
    over an item that was refused."""
    import io

    import torch
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.futures import Future

    from ckptaudit.formats.dcp.reader import path_problem

    per_file: dict[str, list[Any]] = {}
    for item in plan.items:
        per_file.setdefault(storage_data[item.storage_index].relative_path, []).append(item)
    for rel, reqs in per_file.items():
        problem = path_problem(root, rel)
        if problem is not None:
            raise UnsafeCheckpointError(f"{root}/.metadata {problem}")
        full = os.path.join(root, rel)
        try:
            archives = TorchZipFile(full)
        except NotRegularFile as exc:
            raise UnsafeCheckpointError(f"{full} is not a regular file ({exc.strerror})") from None
        with archives:
            for req in reqs:
                info = storage_data[req.storage_index]
                fqn = req.storage_index.fqn
                if info.transform_descriptors:
                    raise UnsafeCheckpointError(f"{full}: item {fqn} is stored through transforms "
                                                f"{info.transform_descriptors}, which ckptaudit does not vet")
                where = f"{full}: item {fqn} at byte {info.offset}"
                if req.type == LoadItemType.BYTE_IO:
                    blob = _pread_all(archives.fd, info.offset, info.length)
                    if len(blob) != info.length:
                        raise UnsafeCheckpointError(f"{where}: the file ends early")
                    _vetted(where, read_torch_zip_bytes, blob, full)
                    planner.load_bytes(req, io.BytesIO(blob))
                    continue
                tz = _vetted(where, archives.read, info.offset, info.length)
                if not isinstance(tz.obj, TensorData):
                    raise UnsafeCheckpointError(f"{where}: does not hold a plain tensor")
                view = RegionStream(Region(archives.fd, info.offset, info.length))
                tensor = torch.load(cast(IO[bytes], view), map_location="cpu", weights_only=True)
                tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                if target.size() != tensor.size():
                    raise UnsafeCheckpointError(f"{where}: holds {list(tensor.size())}, the state dict expects "
                                                f"{list(target.size())}")
                target.copy_(tensor)
                planner.commit_tensor(req, target)
    fut: Any = Future()
    fut.set_result(None)
    return fut


def _pread_all(fd: int, offset: int, length: int) -> bytes:
    parts: list[bytes] = []
    while length > 0:
        part = os.pread(fd, min(length, 1 << 30), offset)
        if not part:
            break
        parts.append(part)
        offset += len(part)
        length -= len(part)
    return b"".join(parts)


def vetted_dcp_load(state_dict: dict[str, Any], path: str | os.PathLike[str], **kwargs: Any) -> None:
    """``torch.distributed.checkpoint.load(state_dict, checkpoint_id=path, **kwargs)``, but only after
    :func:`~ckptaudit.formats.dcp.reader.check_metadata_safe` accepted ``path`` (raises
    :class:`UnsafeCheckpointError` otherwise, before anything of the checkpoint is unpickled), and through the
    metadata that check vetted (:func:`vetted_dcp_reader`), never a second reading of the pickle.

    (all ranks) every rank checks the directory itself, so no rank unpickles an unchecked file.
    """
    import torch.distributed.checkpoint as dcp

    if "storage_reader" in kwargs or "checkpoint_id" in kwargs:
        raise TypeError("the safe DCP load chooses the storage reader itself (the one that serves the vetted "
                        "metadata); pass the directory as path, not storage_reader= or checkpoint_id=")
    dcp.load(state_dict, storage_reader=vetted_dcp_reader(path), **kwargs)
