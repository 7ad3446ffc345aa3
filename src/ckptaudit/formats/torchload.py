"""Loading checkpoints into real tensors, safely, for the parts of ckptaudit that need values (resuming,
comparing, exporting).

- :func:`safe_torch_load`: the pickle is scanned against the allowlist first, then loaded with
  ``torch.load(weights_only=True, mmap=True)`` and only the NumPy globals RNG states need added.
- :func:`safe_dcp_load`: :func:`ckptaudit.formats.dcp.check_metadata_safe` first (``.metadata`` and every
  non-tensor item are pickles that ``torch.distributed.checkpoint.load`` unpickles without restriction), then
  ``torch.distributed.checkpoint.load``. Call it on every rank, like ``torch.distributed.checkpoint.load``.
"""

from __future__ import annotations

import os
from typing import Any

from ckptaudit.formats.dcp import UnsafeCheckpointError, check_metadata_safe
from ckptaudit.formats.torchzip import TorchZipError, is_zip, read_torch_zip

__all__ = ["safe_dcp_load", "safe_torch_load"]


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

    Raises :class:`UnsafeCheckpointError` naming the offending globals, or ``ValueError`` for files that are not
    readable ``torch.save`` archives.
    """
    import torch

    path = os.fspath(path)
    if not is_zip(path):
        raise ValueError(f"{path} is not a torch.save zip archive")
    try:
        tz = read_torch_zip(path, load=False)
    except TorchZipError as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not tz.scan.loadable:
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


def safe_dcp_load(state_dict: dict[str, Any], path: str | os.PathLike[str], **kwargs: Any) -> None:
    """``torch.distributed.checkpoint.load(state_dict, checkpoint_id=path, **kwargs)``, but only after
    :func:`~ckptaudit.formats.dcp.check_metadata_safe` accepted ``path`` (raises
    :class:`UnsafeCheckpointError` otherwise, before anything of the checkpoint is unpickled).

    (all ranks) every rank checks the directory itself, so no rank unpickles an unchecked file.
    """
    import torch.distributed.checkpoint as dcp

    path = os.fspath(path)
    check_metadata_safe(path)
    dcp.load(state_dict, checkpoint_id=path, **kwargs)
