"""Pickles without execution, one module per concept; this module keeps the names other code imports.

Three kinds of pickle reach ckptaudit: ``data.pkl`` inside ``torch.save`` zip archives (and inside every item
of a ``.distcp`` file), ``.metadata`` of ``torch.distributed.checkpoint`` directories, and plain pickles
(legacy ``torch.save`` files, ``*.pkl``). None of them is ever unpickled with plain :mod:`pickle`.

- :mod:`ckptaudit.formats.allowlist`: the names a pickle may reference, and how.
- :mod:`ckptaudit.formats.pickle_scan`: :func:`scan`, the opcode walk (never executing), and the limits.
- :mod:`ckptaudit.formats.unpickler`: :class:`RestrictedUnpickler` (one view: declared attributes only, vetted keys,
  charged containers); :mod:`ckptaudit.formats.numpy_pickles`: NumPy arrays, scalars and dtypes in it;
  :mod:`ckptaudit.formats.torch_values`: torch's dtypes, devices and sizes in it, as torch-free stand-ins.
- :mod:`ckptaudit.formats.object_tree`: :func:`check_tree`, the bound on what was loaded.
- :mod:`ckptaudit.formats.dcp_metadata`: DCP ``.metadata`` through the DCP allowlist, rebuilt as plain data.
"""

from __future__ import annotations

from ckptaudit.formats.allowlist import (
    ALL_SAFE,
    DCP_METADATA_GLOBALS,
    HARMLESS_GLOBALS,
    NUMPY_GLOBALS,
    TORCH_GLOBALS,
    global_name,
)
from ckptaudit.formats.dcp_metadata import dcp_metadata_loads
from ckptaudit.formats.object_tree import check_tree
from ckptaudit.formats.pickle_scan import (
    MAX_DEPTH,
    MAX_NODES,
    MAX_OPCODES,
    PickleLimitError,
    PickleScan,
    UnsafeGlobalError,
    opcode_limit,
    scan,
)
from ckptaudit.formats.unpickler import Opaque, RestrictedUnpickler, base_table

__all__ = [
    "ALL_SAFE",
    "DCP_METADATA_GLOBALS",
    "HARMLESS_GLOBALS",
    "MAX_DEPTH",
    "MAX_NODES",
    "MAX_OPCODES",
    "NUMPY_GLOBALS",
    "TORCH_GLOBALS",
    "Opaque",
    "PickleLimitError",
    "PickleScan",
    "RestrictedUnpickler",
    "UnsafeGlobalError",
    "base_table",
    "check_tree",
    "dcp_metadata_loads",
    "global_name",
    "opcode_limit",
    "scan",
]
