"""Point 3: the saved tensor of each parameter, cut to this rank's region and hashed.

Two sources, the same result (one :class:`~ckptaudit.probe.points.SavedShard` per parameter found):

- a path: read with the audit's readers (:func:`ckptaudit.formats.open_checkpoint`, nothing executed) and
  interpreted with :func:`ckptaudit.layouts.interpret`, so every layout the audit reads works; each rank streams
  only its region (:func:`ckptaudit.probe.regions.hash_saved_region`, bounded chunks);
- a state dict in memory on each rank (what an exporter is about to save).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.distributed as dist

from ckptaudit.findings import Finding
from ckptaudit.formats.base import Unreadable
from ckptaudit.layouts import MODEL_KEYS
from ckptaudit.probe.points import SavedShard
from ckptaudit.probe.regions import Region, dtype_name, hash_saved_region, hash_tensor_region
from ckptaudit.probe.wrappers import ProbeError, clean_fqn, dtensor_region, is_dtensor

__all__ = ["saved_from_path", "saved_from_state_dict"]


def saved_from_path(path: str, regions: Mapping[str, Region], shapes: Mapping[str, tuple[int, ...]],
                    rank: int) -> tuple[dict[str, SavedShard], str, list[Finding]]:
    """(one rank) Hash this rank's region of every parameter's tensor in the checkpoint at ``path``.

    Returns the records, the checkpoint's layout name and the reader's findings. Raises :class:`ProbeError`
    when ``path`` does not exist.
    """
    from ckptaudit.formats import open_checkpoint
    from ckptaudit.layouts import interpret

    if not os.path.exists(path):
        raise ProbeError(f"saved checkpoint {path} does not exist; give the path the exporter wrote")
    out: dict[str, SavedShard] = {}
    with open_checkpoint(path) as ckpt:
        view = interpret(ckpt)
        tensors = {clean_fqn(k): ref for k, ref in view.model.params.items()} if view.model else {}
        for fqn, region in regions.items():
            ref = tensors.get(fqn)
            if ref is None:
                continue
            data = ref.data
            if isinstance(data, Unreadable):
                out[fqn] = SavedShard(rank, ref.name, "?", (), None, f"unreadable: {data.reason}")
                continue
            if tuple(data.shape) != tuple(shapes[fqn]):
                out[fqn] = SavedShard(rank, ref.name, data.dtype.name, tuple(data.shape), None,
                                      f"saved with shape {list(data.shape)}, the parameter has {list(shapes[fqn])}")
                continue
            try:
                digest: str | None = hash_saved_region(data, ckpt.maps, region)
                note = ""
            except (ValueError, OSError) as exc:
                digest, note = None, f"unreadable: {exc}"
            out[fqn] = SavedShard(rank, ref.name, data.dtype.name, tuple(data.shape), digest, note)
        return out, view.layout, list(ckpt.findings)


def _model_part(state: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    for key in MODEL_KEYS:
        value = state.get(key)
        if isinstance(value, Mapping) and any(isinstance(v, torch.Tensor) for v in value.values()):
            return f"{key}.", value
    return "", state


def saved_from_state_dict(state: Mapping[str, Any], regions: Mapping[str, Region],
                          shapes: Mapping[str, tuple[int, ...]], rank: int
                          ) -> tuple[dict[str, SavedShard], str, list[Finding]]:
    """(all ranks, collective when some DTensor is laid out unlike the masters) Point 3 from a state dict."""
    prefix, model = _model_part(state)
    found = {clean_fqn(k): (k, v) for k, v in model.items() if isinstance(v, torch.Tensor)}
    sharded = [prefix + k for k, v in found.values() if type(v).__name__ == "ShardedTensor"]
    if sharded:
        # Every rank holds the same keys, so every rank refuses alike (no collective is left half-entered).
        raise ProbeError(f"{sharded[0]} is a ShardedTensor (FSDP1's sharded state dict), which the probe does not "
                         "cut in memory; save the state dict (e.g. torch.distributed.checkpoint.save) and pass "
                         "its path to record_saved")
    # DTensors laid out unlike the masters need a gather; decide together so every rank joins the same ones.
    regather = sorted(fqn for fqn, (_, v) in found.items()
                      if fqn in regions and is_dtensor(v) and _dtensor_region_or_none(v) != regions[fqn])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        lists: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(lists, regather)
        regather = sorted({f for lst in lists for f in lst})
    out: dict[str, SavedShard] = {}
    with torch.no_grad():
        for fqn, region in regions.items():
            if fqn not in found:
                continue
            key, value = found[fqn]
            value = cast(Any, value)  # a DTensor or a plain tensor
            name = prefix + key
            shape = tuple(int(s) for s in value.shape)
            if is_dtensor(value):
                if fqn in regather:
                    full = value.full_tensor()
                    digest = hash_tensor_region(full, region) if shape == shapes[fqn] else None
                    del full
                else:
                    digest = hash_tensor_region(value.to_local())
                out[fqn] = SavedShard(rank, name, dtype_name(value.dtype), shape, digest,
                                      "" if digest else f"shape {list(shape)}")
                continue
            if shape == tuple(shapes[fqn]):
                out[fqn] = SavedShard(rank, name, dtype_name(value.dtype), shape, hash_tensor_region(value, region))
            elif value.numel() == region.numel and (region.flat is not None or shape == region.sizes):
                # This rank's shard given as a plain tensor (e.g. to_local()): its elements are the region.
                out[fqn] = SavedShard(rank, name, dtype_name(value.dtype), tuple(shapes[fqn]),
                                      hash_tensor_region(value), "local shard")
            else:
                out[fqn] = SavedShard(rank, name, dtype_name(value.dtype), shape, None,
                                      f"saved with shape {list(shape)}, the parameter has {list(shapes[fqn])}")
    return out, "state-dict", []


def _dtensor_region_or_none(t: Any) -> Region | None:
    try:
        return dtensor_region(t, t.to_local())
    except ProbeError:
        return None
