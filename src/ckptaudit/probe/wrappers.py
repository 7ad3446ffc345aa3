"""Where each parameter of a wrapped model lives: which module unshards it, and which region each rank holds.

Supported wrappers (see docs/probe.md for what was tried on CPU/gloo):

- FSDP2 (``fully_shard``, with or without ``MixedPrecisionPolicy``): parameters are ``DTensor`` s outside
  forward. The region of the local shard is read from the DTensor itself (``__create_chunk_list__``, what
  ``torch.distributed.checkpoint`` saves it by), checked against ``to_local()``'s shape. Forward unshards a
  module's own parameters after FSDP's own pre-forward hook, so a pre-hook we add to each ``fully_shard`` -ed
  module sees them as plain tensors.
- FSDP1 (``FullyShardedDataParallel``) with ``use_orig_params=True``: outside forward each original parameter
  is a 1-D view of the part of the flat parameter this rank holds, an arbitrary element range. The range
  and the full shape are FSDP1 internals (``_handle.flat_param._shard_param_infos``/``_shapes``), read here
  and nowhere else. FSDP1 unshards inside its own ``forward``, so the pre-hook goes on the wrapped module.
- DDP and plain modules: every rank holds the whole parameter (a replica); the pre-hook goes on the module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ckptaudit.layouts import normalize_fqn
from ckptaudit.probe.regions import Region, dtype_name

__all__ = ["ParamEntry", "ProbeError", "clean_fqn", "dtensor_region", "index_parameters", "is_dtensor",
           "master_region"]

# One normalisation for the whole tool (saved names and live names must meet the same way).
clean_fqn = normalize_fqn


class ProbeError(Exception):
    """The probe cannot attach to (or record) this model; the message says why and what to do."""


def is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" or any(c.__name__ == "DTensor" for c in type(t).__mro__)


@dataclass
class ParamEntry:
    """One trained parameter and where to find it on this rank."""

    fqn: str
    raw_name: str
    owner: nn.Module
    """The module holding it as attribute ``leaf`` (FSDP swaps the object behind that attribute)."""
    leaf: str
    hook_module: nn.Module
    """The module whose forward pre-hook sees it unsharded."""
    wrapper: str
    """``fsdp2``, ``fsdp1``, ``ddp`` or ``plain``."""
    shape: tuple[int, ...]
    """Full (global) shape."""
    master_dtype: torch.dtype
    fsdp1_slot: tuple[Any, int] | None = None
    """FSDP1: (flat parameter, index of this parameter in it)."""

    def current(self) -> Any:
        """The object behind the parameter's attribute right now (sharded outside forward)."""
        return getattr(self.owner, self.leaf, None)

    def sharded(self) -> Any:
        """The parameter as the optimizer sees it (its sharded master).

        FSDP2 leaves the root module unsharded after a forward that no backward follows (an eval forward under
        ``no_grad``): its parameters stay plain tensors until the next backward or ``reshard()``. Resharding
        (the public ``FSDPModule.reshard``, local, what ``state_dict()`` itself does first) brings the sharded
        ``DTensor`` back; the next forward unshards again as it would anyway.
        """
        t = self.current()
        module: Any = self.hook_module
        if self.wrapper == "fsdp2" and not is_dtensor(t) and hasattr(module, "reshard"):
            module.reshard()
            t = self.current()
        return t


def _fsdp_classes() -> tuple[type | None, type | None]:
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # pragma: no cover - very old or stripped torch builds
        return None, None
    return FSDPModule, FullyShardedDataParallel


def _ddp_class() -> type | None:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # pragma: no cover
        return None
    return DistributedDataParallel


def index_parameters(model: nn.Module) -> tuple[list[ParamEntry], str]:
    """(any rank, no collectives) Every trainable parameter of ``model`` with its owner and hook module.

    Raises :class:`ProbeError` for FSDP1 without ``use_orig_params=True`` (its parameters are flattened away).
    """
    fsdp2_cls, fsdp1_cls = _fsdp_classes()
    ddp_cls = _ddp_class()
    modules = dict(model.named_modules())
    fsdp2 = {n for n, m in modules.items() if fsdp2_cls is not None and isinstance(m, fsdp2_cls)}
    fsdp1 = {n for n, m in modules.items() if fsdp1_cls is not None and isinstance(m, fsdp1_cls)}
    if fsdp1:
        from torch.distributed.fsdp import FlatParameter

        # FlatParameter is matched by isinstance (a metaclass check), not by the type's name.
        flat = [n for n, p in model.named_parameters() if isinstance(p, FlatParameter)]
        if flat:
            raise ProbeError(
                f"FSDP1 without use_orig_params=True: the parameters are flattened into {flat[0]} and the "
                "original ones cannot be observed; wrap with FullyShardedDataParallel(..., use_orig_params=True) "
                "or use FSDP2 (fully_shard)"
            )
    wrapper = "fsdp2" if fsdp2 else "fsdp1" if fsdp1 else "ddp" if ddp_cls is not None and isinstance(model, ddp_cls) \
        else "plain"
    entries: list[ParamEntry] = []
    for raw, p in model.named_parameters():
        if not p.requires_grad:
            continue
        prefix, _, leaf = raw.rpartition(".")
        owner = modules[prefix]
        ancestors = _ancestors(prefix)
        hook: nn.Module = model
        kind = wrapper
        slot = None
        shape = tuple(int(s) for s in p.shape)
        if wrapper == "fsdp2":
            home = next((a for a in ancestors if a in fsdp2), None)
            if home is None:
                kind = "plain"
            else:
                hook = modules[home]
        elif wrapper == "fsdp1":
            home = next((a for a in ancestors if a in fsdp1), None)
            if home is None:
                kind = "plain"
            else:
                fsdp_mod = modules[home]
                hook = fsdp_mod.module  # FSDP1 unshards inside its forward: hook the wrapped module
                slot = _fsdp1_slot(fsdp_mod, p)
                if slot is None:
                    raise ProbeError(f"FSDP1: parameter {raw} is not in its FSDP module's flat parameter")
                shape = tuple(int(s) for s in slot[0]._shapes[slot[1]])
        elif wrapper == "ddp":
            hook = model.module  # type: ignore[assignment]
        entries.append(ParamEntry(clean_fqn(raw), raw, owner, leaf, hook, kind, shape, p.dtype, slot))
    return entries, wrapper


def _ancestors(prefix: str) -> list[str]:
    """``a.b.c`` -> ``["a.b.c", "a.b", "a", ""]`` (nearest first)."""
    parts = prefix.split(".") if prefix else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _fsdp1_slot(fsdp_module: nn.Module, param: nn.Parameter) -> tuple[Any, int] | None:
    # FSDP1 internals (the only place ckptaudit reads them): the handle's flat parameter keeps the original
    # parameters (use_orig_params=True), their full shapes and which element range of each this rank holds.
    handle = getattr(fsdp_module, "_handle", None)
    flat = getattr(handle, "flat_param", None)
    params = getattr(flat, "_params", None)
    if flat is None or params is None:
        return None
    for i, q in enumerate(params):
        if q is param:
            return flat, i
    return None


def master_region(entry: ParamEntry, t: Any) -> tuple[Region, Any, str]:
    """(this rank) The region ``t`` (the parameter outside forward) holds, its local tensor and its placement.

    Raises :class:`ProbeError` when ``t`` is not sharded the way the wrapper shards it (e.g. called inside
    forward, while the parameter is unsharded).
    """
    if is_dtensor(t):
        local = t.to_local()
        region = dtensor_region(t, local)
        mesh = t.device_mesh
        placement = f"fsdp2 {', '.join(str(p) for p in t.placements)} x{mesh.size()}"
        return region, local, placement
    if entry.wrapper == "fsdp2":
        raise ProbeError(f"{entry.fqn} is not a DTensor right now: record the masters outside forward")
    if entry.wrapper == "fsdp1" and entry.fsdp1_slot is not None:
        flat, i = entry.fsdp1_slot
        info = flat._shard_param_infos[i]
        rng = (int(info.intra_param_start_idx), int(info.intra_param_end_idx) + 1) if info.in_shard else (0, 0)
        if t.numel() != rng[1] - rng[0] or t.dtype != entry.master_dtype:
            raise ProbeError(f"{entry.fqn}: an FSDP1 shard of {t.numel()} {dtype_name(t.dtype)} elements, expected "
                             f"{rng[1] - rng[0]} {dtype_name(entry.master_dtype)}; record the masters outside forward")
        # The placement describes the parameter on all ranks; this rank may happen to hold all of it.
        region = Region.whole(entry.shape) if rng == (0, math.prod(entry.shape)) else Region(flat=rng)
        return region, t, f"fsdp1 flat x{_world()}"
    kind = "ddp replica" if entry.wrapper == "ddp" else "replica" if _world() > 1 else "plain"
    return Region.whole(t.shape), t, f"{kind} x{_world()}" if _world() > 1 else kind


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def dtensor_region(t: Any, local: torch.Tensor) -> Region:
    """The block of the global tensor this rank's DTensor shard holds."""
    chunks = t.__create_chunk_list__()
    if len(chunks) != 1:
        raise ProbeError(f"a DTensor with {len(chunks)} local chunks (placements {t.placements}) is not supported")
    offsets = tuple(int(o) for o in chunks[0].offsets)
    sizes = tuple(int(s) for s in chunks[0].sizes)
    if sizes != tuple(local.shape):
        raise ProbeError(f"DTensor placements {t.placements}: local shard of shape {list(local.shape)} does not "
                         f"match the chunk {list(sizes)} at {list(offsets)}; this layout is not supported")
    return Region(offsets, sizes)
