"""Loading checkpoints into real tensors, safely, for the parts of ckptaudit that need values (resuming,
comparing, exporting).

- :func:`safe_torch_load`: the archive is read as the audit reads it first (allowlist scan, then the restricted
  unpickler and its limits), then loaded with
  ``torch.load(weights_only=True, mmap=True)`` and only the NumPy globals RNG states need added.
- :func:`safe_dcp_load`: :func:`ckptaudit.formats.dcp.check_metadata_safe` first (``.metadata`` and every
  non-tensor item are pickles that ``torch.distributed.checkpoint.load`` unpickles without restriction), then
  ``torch.distributed.checkpoint.load`` through :func:`safe_dcp_reader`, a storage reader that serves the
  metadata the check rebuilt as plain data (converted to torch's classes here), never the pickle itself: what
  is loaded is exactly what was vetted. Call it on every rank, like ``torch.distributed.checkpoint.load``.
"""

from __future__ import annotations

import os
from typing import Any

from ckptaudit.formats.dcp import UnsafeCheckpointError, check_metadata_safe
from ckptaudit.formats.dcp_metadata import BytesMeta, DcpMetadata, TensorMeta
from ckptaudit.formats.torchzip import TorchZipError, is_zip, read_torch_zip

__all__ = ["safe_dcp_load", "safe_dcp_reader", "safe_torch_load", "to_torch_metadata"]


def _numpy_globals() -> list[Any]:
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


def safe_torch_load(path: str | os.PathLike[str]) -> Any:
    """Load a ``torch.save`` zip archive without executing anything outside the allowlist.

    The archive is first read exactly as the offline audit reads it (:func:`~ckptaudit.formats.torchzip.
    read_torch_zip`: every opcode scanned against the allowlist, then ``data.pkl`` built by the restricted
    unpickler under its limits: colliding-hash keys, the built-size budget, tensors addressing more than the
    archive; docs/security.md), so ``torch.load`` only ever sees a pickle the audit would have accepted.

    Raises :class:`UnsafeCheckpointError` naming the offending globals or the limit the pickle broke, or
    ``ValueError`` for files that are not readable ``torch.save`` archives.
    """
    import torch

    path = os.fspath(path)
    if not is_zip(path):
        raise ValueError(f"{path} is not a torch.save zip archive")
    try:
        tz = read_torch_zip(path)
    except TorchZipError as exc:
        if exc.limit:
            raise UnsafeCheckpointError(f"{path}: {exc}; refusing to load it (the limits: docs/security.md)") \
                from None
        raise ValueError(f"{path}: {exc}") from None
    if not tz.scan.loadable or not tz.loaded:
        bad = tz.scan.unsafe + tz.scan.harmless
        raise UnsafeCheckpointError(f"{path} references {', '.join(bad)}; refusing to load it")
    with torch.serialization.safe_globals(_numpy_globals()):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def materialize(data: Any, maps: Any) -> Any:
    """Read a lazy :class:`~ckptaudit.formats.tensors.TensorData` into a real CPU tensor of its stored dtype.

    Only for tensors that fit in memory by design (loading weights into a live model); the audit never does this.
    """
    import numpy as np
    import torch

    from ckptaudit.formats.tensors import iter_chunks

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
    distinct chunk list (:func:`~ckptaudit.formats.dcp_metadata.rebuild` converts each once, however many
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


def safe_dcp_reader(path: str | os.PathLike[str]) -> Any:
    """A ``torch.distributed.checkpoint.FileSystemReader`` of ``path`` whose ``read_metadata`` returns the
    metadata :func:`~ckptaudit.formats.dcp.check_metadata_safe` vetted (raises :class:`UnsafeCheckpointError`
    when it refuses ``path``): ``.metadata`` is never unpickled by torch.

    (all ranks) call it on every rank that loads, so each rank loads only what it checked itself.
    """
    from torch.distributed.checkpoint import FileSystemReader

    path = os.fspath(path)
    vetted = to_torch_metadata(check_metadata_safe(path))

    class _VettedReader(FileSystemReader):  # type: ignore[misc]
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            vetted.storage_meta.load_id = self.load_id
            return vetted

    return _VettedReader(path)


def safe_dcp_load(state_dict: dict[str, Any], path: str | os.PathLike[str], **kwargs: Any) -> None:
    """``torch.distributed.checkpoint.load(state_dict, checkpoint_id=path, **kwargs)``, but only after
    :func:`~ckptaudit.formats.dcp.check_metadata_safe` accepted ``path`` (raises
    :class:`UnsafeCheckpointError` otherwise, before anything of the checkpoint is unpickled), and through the
    metadata that check vetted (:func:`safe_dcp_reader`), never a second reading of the pickle.

    (all ranks) every rank checks the directory itself, so no rank unpickles an unchecked file.
    """
    import torch.distributed.checkpoint as dcp

    if "storage_reader" in kwargs or "checkpoint_id" in kwargs:
        raise TypeError("safe_dcp_load chooses the storage reader itself (the one that serves the vetted "
                        "metadata); pass the directory as path, not storage_reader= or checkpoint_id=")
    dcp.load(state_dict, storage_reader=safe_dcp_reader(path), **kwargs)
