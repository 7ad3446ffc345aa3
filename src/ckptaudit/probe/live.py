"""The live probe: attach to a running job's model and record its parameters at the three points.

Used inside a training script, on every rank::

    probe = Probe(model)                  # (all ranks) indexes the parameters; installs nothing
    ...train...
    probe.arm()                           # (all ranks) the next forward records the compute copies (point 2)
    model(batch)                          # a training step's forward, or an eval forward
    probe.record_masters()                # (all ranks, collective) point 1
    save(...)                             # your exporter
    probe.record_saved(path_or_state)     # (all ranks, collective) point 3
    report = probe.report()               # (all ranks, collective) rank 0 gets the Report, others None

Points 1 and 3 must see the same training state: no optimizer step between ``record_masters`` and the save.
Point 2 should too (arm right before the last forward before the save, or run an extra forward); when it
does not, the report says the compute copies are not the masters rounded (``probe.compute-not-master``).

Cost: unarmed, the probe has no hook on the model at all; ``arm()`` installs forward pre-hooks that remove
themselves when the model's forward returns (or on :meth:`Probe.disarm`). See ``bench/bench_probe.py``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ckptaudit.findings import Finding, RawReport
from ckptaudit.probe.points import ComputeShard, MasterShard, ParamInfo, ProbeResult, SavedShard
from ckptaudit.probe.regions import Region, dtype_name, hash_tensor_region
from ckptaudit.probe.saved import saved_from_path, saved_from_state_dict
from ckptaudit.probe.wrappers import ParamEntry, ProbeError, index_parameters, is_dtensor, master_region

__all__ = ["Probe"]

_NARROW = (torch.bfloat16, torch.float16)


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj: Any) -> list[Any] | None:
    """(all ranks, collective) ``obj`` of every rank on rank 0 (in rank order); ``None`` elsewhere."""
    rank, world = _rank_world()
    if world == 1:
        return [obj]
    out: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _gather_checked(fn: Callable[[], Any]) -> list[Any] | None:
    """(all ranks, collective) Run ``fn`` here and gather its results on rank 0.

    When ``fn`` fails on any rank, every rank raises the same :class:`ProbeError` (naming the ranks), instead
    of the failed rank leaving its peers waiting in the gather until the process group times out.
    """
    value: Any = None
    error: str | None = None
    try:
        value = fn()
    except (ProbeError, OSError, ValueError) as exc:
        error = str(exc)
    world = _rank_world()[1]
    errors: list[Any] = [error]
    if world > 1:
        errors = [None] * world
        dist.all_gather_object(errors, error)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if failed:
        raise ProbeError("; ".join(failed))
    return _gather(value)


class Probe:
    """Observe a model's parameters at the three points (see the module docstring for the protocol).

    ``model`` is the wrapped model as the training loop calls it: a ``fully_shard`` -ed module, an FSDP1
    module built with ``use_orig_params=True``, a ``DistributedDataParallel`` or a plain module.
    """

    def __init__(self, model: nn.Module) -> None:
        """(all ranks, no collectives) Index the parameters and read each one's region on this rank."""
        self.model = model
        self.rank, self.world_size = _rank_world()
        self.entries, self.wrapper = index_parameters(model)
        if not self.entries:
            raise ProbeError("the model has no trainable parameters to probe")
        self._regions: dict[str, Region] = {}
        self._placements: dict[str, str] = {}
        for e in self.entries:
            region, _, placement = master_region(e, e.sharded())
            self._regions[e.fqn] = region
            self._placements[e.fqn] = placement
        self._handles: list[Any] = []
        self._compute: dict[str, ComputeShard] = {}
        self._armed_once = False
        self._autocast: str | None = None
        self._masters: dict[str, tuple[MasterShard, ...]] = {}
        self._saved: dict[str, tuple[SavedShard, ...]] = {}
        self._saved_source = ""
        self._saved_format = ""
        self._saved_findings: tuple[Finding, ...] = ()

    # -- point 2 -------------------------------------------------------------------------------------------

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self) -> None:
        """(all ranks) Record the compute representation of every parameter during the next forward.

        Installs one forward pre-hook per module that unshards parameters and a forward hook on the model that
        removes them all when its forward returns. Records from an earlier armed forward are replaced.
        """
        self.disarm()
        self._compute = {}
        self._autocast = None
        self._armed_once = True
        by_hook: dict[int, tuple[nn.Module, list[ParamEntry]]] = {}
        for e in self.entries:
            by_hook.setdefault(id(e.hook_module), (e.hook_module, []))[1].append(e)
        for module, entries in by_hook.values():
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(entries)))
        self._handles.append(self.model.register_forward_hook(self._done))

    def disarm(self) -> None:
        """(all ranks) Remove the probe's hooks (they also go by themselves after one forward)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @contextlib.contextmanager
    def armed_forward(self) -> Iterator[None]:
        """``with probe.armed_forward(): model(x)`` arms for that forward and always disarms afterwards."""
        self.arm()
        try:
            yield
        finally:
            self.disarm()

    def _done(self, module: nn.Module, args: Any, output: Any) -> None:
        self.disarm()

    def _pre_hook(self, entries: list[ParamEntry]) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self._autocast is None:
                self._autocast = _autocast_dtype(entries[0])
            for e in entries:
                if e.fqn in self._compute:
                    continue
                t = e.current()
                # Still sharded (a child FSDP module's parameter, or not unsharded yet): not this hook's to record.
                if not isinstance(t, torch.Tensor) or is_dtensor(t) or tuple(t.shape) != e.shape:
                    continue
                self._compute[e.fqn] = self._compute_record(e, t)

        return hook

    def _compute_record(self, e: ParamEntry, t: torch.Tensor) -> ComputeShard:
        region = self._regions[e.fqn]
        with torch.no_grad():
            full = hash_tensor_region(t)
            own = hash_tensor_region(t, region)
            upcast = hash_tensor_region(t, region, cast=e.master_dtype) if t.dtype != e.master_dtype else None
        source = "unsharded" if e.wrapper in ("fsdp2", "fsdp1") else "parameter"
        return ComputeShard(self.rank, dtype_name(t.dtype), tuple(t.shape), full, own, upcast, source)

    # -- point 1 -------------------------------------------------------------------------------------------

    def record_masters(self) -> None:
        """(all ranks, collective) Point 1: hash every rank's master shard; gathered on rank 0.

        Call it outside forward, with the state that will be saved (no optimizer step in between).
        """
        gathered = _gather_checked(self._masters_here)
        if gathered is not None:
            self._masters = {e.fqn: tuple(g[e.fqn] for g in gathered) for e in self.entries}

    def _masters_here(self) -> dict[str, MasterShard]:
        mine: dict[str, MasterShard] = {}
        with torch.no_grad():
            for e in self.entries:
                region, local, placement = master_region(e, e.sharded())
                self._regions[e.fqn] = region
                self._placements[e.fqn] = placement
                rounded: dict[str, str] = {}
                if local.is_floating_point() and local.element_size() > 2:
                    master = dtype_name(local.dtype)
                    for narrow in _NARROW:
                        name = dtype_name(narrow)
                        rounded[name] = hash_tensor_region(local, cast=narrow)
                        rounded[f"{name}>{master}"] = hash_tensor_region(local, via=narrow, cast=local.dtype)
                mine[e.fqn] = MasterShard(self.rank, dtype_name(local.dtype), tuple(local.shape), region,
                                          hash_tensor_region(local), rounded)
        return mine

    # -- point 3 -------------------------------------------------------------------------------------------

    def record_saved(self, source: str | os.PathLike[str] | Mapping[str, Any]) -> None:
        """(all ranks, collective) Point 3: hash each rank's region of the saved tensors; gathered on rank 0.

        ``source`` is a path the audit can read (a DCP directory, a ``torch.save`` or safetensors file, a
        directory of component files), read by every rank for its own regions with bounded memory; or a state
        dict on each rank (the model's, or a dict holding it under ``model``/``state_dict``/...): ``DTensor``
        values laid out like the masters are hashed locally, others are gathered with ``full_tensor()``, plain
        tensors are taken as full tensors (or, if shaped like this rank's shard, as the shard itself).
        """
        shapes = {e.fqn: e.shape for e in self.entries}
        if isinstance(source, str | os.PathLike):
            path = os.fspath(source)
            gathered = _gather_checked(lambda: saved_from_path(path, self._regions, shapes, self.rank))
            label = path
        else:
            # Not through _gather_checked: the state-dict reader runs collectives of its own.
            gathered = _gather(saved_from_state_dict(source, self._regions, shapes, self.rank))
            label = "<state dict>"
        if gathered is not None:
            self._saved = {}
            for e in self.entries:
                shards = tuple(g[0][e.fqn] for g in gathered if e.fqn in g[0])
                if shards:
                    self._saved[e.fqn] = shards
            _, fmt, findings = gathered[0]
            self._saved_source, self._saved_format, self._saved_findings = label, fmt, tuple(findings)

    # -- results -------------------------------------------------------------------------------------------

    def result(self, **meta: object) -> ProbeResult | None:
        """(all ranks, collective) Everything recorded, on rank 0 (``None`` on the others)."""
        gathered = _gather((self._compute, self._autocast, self._armed_once))
        if gathered is None:
            return None
        compute: dict[str, tuple[ComputeShard, ...]] = {}
        for e in self.entries:
            shards = tuple(g[0][e.fqn] for g in gathered if e.fqn in g[0])
            if shards:
                compute[e.fqn] = shards
        autocast = next((g[1] for g in gathered if g[1]), None)
        params = tuple(ParamInfo(e.fqn, e.shape, self._placements[e.fqn]) for e in self.entries)
        return ProbeResult(
            world_size=self.world_size, wrapper=self.wrapper, params=params, masters=dict(self._masters),
            compute=compute, saved=dict(self._saved), armed=any(g[2] for g in gathered), autocast=autocast,
            saved_source=self._saved_source, saved_format=self._saved_format,
            saved_findings=self._saved_findings, meta=dict(meta),
        )

    def report(self, **meta: object) -> RawReport | None:
        """(all ranks, collective) The verdict as a :class:`~ckptaudit.findings.RawReport` on rank 0, else ``None``."""
        from ckptaudit.probe.verdict import judge_probe

        result = self.result(**meta)
        return judge_probe(result) if result is not None else None


def _autocast_dtype(entry: ParamEntry) -> str | None:
    t = entry.current()
    device = t.device.type if isinstance(t, torch.Tensor) else "cpu"
    try:
        if torch.is_autocast_enabled(device):
            return dtype_name(torch.get_autocast_dtype(device))
    except (TypeError, RuntimeError):  # device types without autocast support
        return None
    return None
