"""DCP ``.metadata`` through the restricted unpickler and the DCP allowlist."""

from __future__ import annotations

import collections
import io
from typing import Any

from ckptaudit.formats.allowlist import DCP_METADATA_GLOBALS
from ckptaudit.formats.pickle_scan import PickleLimitError
from ckptaudit.formats.unpickler import RestrictedUnpickler, base_table, check_tree

__all__ = ["dcp_metadata_loads"]

def dcp_metadata_loads(data: bytes) -> Any:
    """Unpickle a DCP ``.metadata`` file through the DCP allowlist. Call :func:`scan` first for a report.

    Raises :class:`UnsafeGlobalError` for anything outside the allowlist, :class:`PickleLimitError` past a
    limit, ``pickle.UnpicklingError`` or ``ValueError``/``EOFError``/``TypeError`` for malformed data.
    """
    import pathlib

    import torch
    import torch.distributed.checkpoint.filesystem as dcp_fs
    import torch.distributed.checkpoint.metadata as dcp_md
    import torch.distributed.checkpoint.planner as dcp_planner
    import torch.serialization

    table = base_table()
    classes: list[type] = [collections.OrderedDict, dcp_fs._StorageInfo]
    for name in DCP_METADATA_GLOBALS:
        module, _, attr = name.rpartition(".")
        if module == "torch.distributed.checkpoint.metadata":
            table[name] = getattr(dcp_md, attr)
            if attr != "_MEM_FORMAT_ENCODING":
                classes.append(getattr(dcp_md, attr))
    table["torch.distributed.checkpoint.filesystem._StorageInfo"] = dcp_fs._StorageInfo
    for name in DCP_METADATA_GLOBALS:  # the planner's dataclasses (Megatron-Core's all_local_plans)
        module, _, attr = name.rpartition(".")
        if module == "torch.distributed.checkpoint.planner":
            table[name] = getattr(dcp_planner, attr)
            if attr != "WriteItemType":
                classes.append(getattr(dcp_planner, attr))
    table["torch.distributed.checkpoint.filesystem._StoragePrefix"] = dcp_fs._StoragePrefix
    classes.append(dcp_fs._StoragePrefix)
    table["torch.serialization._get_layout"] = torch.serialization._get_layout
    table["torch.Size"] = torch.Size
    table["pathlib.PosixPath"] = pathlib.PurePosixPath
    table["pathlib.PurePosixPath"] = pathlib.PurePosixPath
    table["pathlib.PureWindowsPath"] = pathlib.PureWindowsPath
    # Only the names the DCP allowlist admits: drop numpy, devices and the like from the base table.
    table = {k: v for k, v in table.items() if k in DCP_METADATA_GLOBALS}
    md = RestrictedUnpickler(io.BytesIO(data), table, build_types=classes).load()
    problem = check_tree(md)
    if problem is not None:
        raise PickleLimitError(problem)
    return md
