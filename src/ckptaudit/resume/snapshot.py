"""(every rank) What a resumed job records: its parameters (rank 0 keeps the gathered copy) and a digest of every
component of its state right after the restore, for :func:`ckptaudit.resume.deviation.compare_states`.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np

from ckptaudit.resume.config import COMPONENTS


def _full(t: Any) -> Any:
    """(all ranks of ``t``'s mesh, collective) The whole value of a DTensor.

    Over gloo, a DTensor sharded along one dimension of a 1-D mesh (FSDP2) or replicated is gathered with
    ``all_gather_object`` of the local shards, ordered by mesh coordinate, not with ``full_tensor()``: twice in
    the reversed-order suite a resumed rank died inside ``full_tensor()``'s functional collectives on gloo
    (``malloc(): unaligned tcache chunk detected``, then ``SIGSEGV``), always in this snapshot. Any other
    layout or backend still uses ``full_tensor()``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    mesh = t.device_mesh
    if mesh.ndim != 1 or t.device.type != "cpu":
        return t.full_tensor()
    group = mesh.get_group()
    placement = t.placements[0]
    if dist.get_backend(group) != "gloo" or not isinstance(placement, Shard | Replicate):
        return t.full_tensor()
    local = t.to_local()
    if isinstance(placement, Replicate):
        return local
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, (mesh.get_local_rank(), local.contiguous()), group=group)
    return torch.cat([part for _, part in sorted(parts, key=lambda p: p[0])], dim=placement.dim)


def param_names(model: Any) -> list[tuple[str, Any]]:
    from ckptaudit.layouts import normalize_fqn

    return [(normalize_fqn(n), p) for n, p in model.named_parameters()]


def take_snapshot(job: Any, full: bool) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """(all ranks, collective for sharded parameters) Gather every parameter; rank 0's copy is the result."""
    import torch

    values: dict[str, np.ndarray] = {}
    norms: dict[str, float] = {}
    for name, p in param_names(job.model):
        t = p.detach()
        if type(t).__name__ == "DTensor":
            t = _full(t)
        t = t.float().cpu()
        norms[name] = float(torch.linalg.vector_norm(t))
        if full:
            values[name] = t.numpy().copy()
    return values, norms


def _digest(t: Any) -> str:
    """(all ranks, collective for a DTensor) Hash of a tensor's dtype, shape and bytes."""
    import torch

    t = t.detach()
    if type(t).__name__ == "DTensor":
        t = _full(t)
    t = t.cpu().contiguous()
    h = hashlib.blake2b(f"{t.dtype}{tuple(t.shape)}".encode(), digest_size=12)
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _canonical(obj: Any) -> str:
    """A stable text of a (nested) state: tensors by hash, dicts by sorted key, functions by name."""
    import torch

    if isinstance(obj, torch.Tensor):
        return _digest(obj) if obj.dim() else repr(obj.item())
    if isinstance(obj, np.ndarray):
        return hashlib.blake2b(obj.tobytes(), digest_size=12).hexdigest()
    if isinstance(obj, dict):
        return "{" + ",".join(f"{k!r}:{_canonical(v)}" for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))) + "}"
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(_canonical(v) for v in obj) + "]"
    if isinstance(obj, float):
        return repr(float(obj))
    if callable(obj):
        return getattr(obj, "__qualname__", type(obj).__name__)
    return repr(obj)


def state_snapshot(job: Any) -> dict[str, dict[str, str]]:
    """(all ranks, collective) The job's state by component: key -> digest; rank 0's copy is the whole.

    The generators are keyed ``rank{r}/python``, ``rank{r}/numpy``, ``rank{r}/torch`` and ``rank{r}/cuda:{i}``
    (every CUDA device once CUDA is initialised): a draw advances a generator's state, so two snapshots around
    the steps tell which generators the steps draw from. Reads ``optimizer.state`` directly (``get_state_dict``
    would initialise a fresh optimizer's state)."""
    import torch
    import torch.distributed as dist

    snap: dict[str, dict[str, str]] = {c: {} for c in COMPONENTS}
    for name, p in param_names(job.model):
        snap["parameters"][name] = _digest(p)
        entry = job.optimizer.state.get(p, {})
        for key in sorted(entry):
            v = entry[key]
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                snap["optimizer moments"][f"{name}/{key}"] = _digest(v)
            else:
                snap["optimizer step"][f"{name}/{key}"] = _canonical(v)
    for i, group in enumerate(job.optimizer.param_groups):
        for key, v in group.items():
            if key != "params":
                snap["optimizer hyperparameters"][f"group{i}/{key}"] = _canonical(v)
    if job.scheduler is not None:
        for key, v in job.scheduler.state_dict().items():
            snap["scheduler"][key] = _canonical(v)
    local: dict[str, dict[str, str]] = {
        "rng": {"torch": _digest(torch.get_rng_state()), "python": _canonical(random.getstate()),
                "numpy": _canonical(np.random.get_state())},
        "data position": {"state": _canonical(job.data.state_dict())} if job.data is not None else {},
        "training step": {"step": str(job.step)},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for device in range(torch.cuda.device_count()):  # every device's generator, not only the current one
            local["rng"][f"cuda:{device}"] = _digest(torch.cuda.get_rng_state(device))
    gathered: list[Any] = [local]
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
    for r, loc in enumerate(gathered):
        for comp, entries in loc.items():
            for key, v in entries.items():
                snap[comp][f"rank{r}/{key}"] = v
    return snap
