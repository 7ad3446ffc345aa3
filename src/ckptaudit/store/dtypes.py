"""The dtype-change refusal: the loader compares the dtype of every live model and optimizer tensor with the one
saved in the manifest, because ``torch.distributed.checkpoint.load`` casts silently into the live tensor's dtype
(the run would resume from different masters). Pure functions; every rank runs them on its own template."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ckptaudit.store.checkpoint import KEYS, dtype_name

__all__ = ["ISSUE_SILENT_CAST", "dtype_changes", "refusal", "tensor_leaves"]

ISSUE_SILENT_CAST = "pytorch/pytorch#187138"


def tensor_leaves(tree: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """``(dcp_key, tensor)`` for every tensor of a nested dict/list, keyed as DCP flattens them."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from tensor_leaves(v, f"{prefix}.{k}")
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from tensor_leaves(v, f"{prefix}.{i}")
    elif isinstance(tree, torch.Tensor):
        yield prefix, tree


def dtype_changes(manifest: Mapping[str, Any], tmpl: Mapping[str, Any]) -> list[str]:
    """``"key: saved X, live Y"`` for every live model/optimizer tensor whose dtype differs from the saved one."""
    out = []
    saved = manifest["tensors"]
    for top in (KEYS["model"], KEYS["optimizer"]):
        for key, tensor in tensor_leaves(tmpl[top], top):
            rec = saved.get(key)
            if isinstance(rec, dict) and rec.get("dtype") != dtype_name(tensor.dtype):
                out.append(f"{key} was saved as {rec.get('dtype')} but the live tensor is {dtype_name(tensor.dtype)}")
    return out


def refusal(name: str, casts: list[str], master_dtype: str) -> str:
    """The message of the refusal to load checkpoint ``name`` across the dtype ``casts``."""
    more = f" (and {len(casts) - 3} more)" if len(casts) > 3 else ""
    return (f"refusing to load {name} into tensors of another dtype: {'; '.join(casts[:3])}{more}. "
            f"torch.distributed.checkpoint would cast silently ({ISSUE_SILENT_CAST}), and the run would resume "
            f"from different masters. Build the model and optimizer in the saved dtype "
            f"({master_dtype}) before loading, or pass allow_dtype_change=True to cast on purpose")
