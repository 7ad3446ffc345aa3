"""Exporters: functions that receive the live training objects and write a checkpoint.

``documented`` is the reference path (``get_state_dict`` + ``torch.distributed.checkpoint``). The others are
the defects ckptaudit exists to catch, shipped as examples and as test subjects:

- ``compute_copy`` captures the bf16 unsharded parameters inside forward (what FSDP mixed precision computes
  with), upcasts them to fp32 and labels the file a training checkpoint;
- ``compute_copy_bf16`` stores the same captured tensors as bf16;
- ``fp16_copy`` rounds the masters to fp16 before saving;
- ``swapped_moments`` saves faithfully but swaps the optimizer moments of two same-shape parameters.

An exporter is ``export(job, path, ctx)``; it runs on every rank (collectives inside are allowed) and writes
``path`` (a file or a directory). One that needs to see forward passes may have a ``prepare(job)`` that
returns hooks to arm before the next step. Exporters are named ``module:attr``, like recipes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ckptaudit.recipes import Job
from ckptaudit.recipes.rng import rng_state, set_rng_state

__all__ = [
    "ComputeCopyCapture",
    "capture_and_export",
    "compute_copy",
    "compute_copy_bf16",
    "documented",
    "fp16_copy",
    "full_model_state",
    "full_optimizer_state",
    "swapped_moments",
]


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor"


def _full(t: Any) -> torch.Tensor:
    """(all ranks) The full tensor of a DTensor, gathered; a plain tensor as is. Always on CPU."""
    if _is_dtensor(t):
        t = t.full_tensor()
    return t.detach().cpu()


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """(all ranks, collective) The model state dict with every sharded tensor gathered to full size."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {k: _full(v).clone() for k, v in get_model_state_dict(model).items()}


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """(all ranks, collective) The FQN-keyed optimizer state dict with full tensors.

    Gathers each DTensor with ``full_tensor()`` instead of ``get_state_dict(full_state_dict=True)``, which
    crashes rank 0 under gloo on torch 2.13 for FSDP1.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd: dict[str, Any] = dict(get_optimizer_state_dict(model, optimizer))
    state = {fqn: {k: (_full(v).clone() if isinstance(v, torch.Tensor) else v) for k, v in entry.items()}
             for fqn, entry in osd["state"].items()}
    return {"state": state, "param_groups": osd["param_groups"]}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def documented(job: Job, path: str, ctx: Any = None) -> None:
    """(all ranks, collective) The documented path: ``get_state_dict`` + ``torch.distributed.checkpoint``.

    Saves model and optimizer (sharded, FQN-keyed, full precision masters), scheduler, step, and per rank the
    RNG state and the data position.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(job.model, job.optimizer)
    rank = _rank()
    state: dict[str, Any] = {
        "model": msd,
        "optim": osd,
        "train_state": {"step": job.step},
        "rng": {f"rank{rank}": rng_state()},
    }
    if job.scheduler is not None:
        state["scheduler"] = job.scheduler.state_dict()
    if job.data is not None:
        state["data"] = {f"rank{rank}": job.data.state_dict()}
    dcp.save(state, checkpoint_id=path)


class ComputeCopyCapture:
    """Forward pre-hooks that copy each FSDP module's unsharded parameters: the compute representation.

    Under FSDP2 a forward pre-hook registered on a ``fully_shard``-ed module sees that module's own parameters
    unsharded (bf16 under a bf16 ``MixedPrecisionPolicy``) while child modules' are still sharded DTensors, so
    the hook keeps only the non-DTensor ones. Armed on demand: unarmed, a hook returns at once.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.captured: dict[str, torch.Tensor] = {}
        self.armed = False
        self._handles = []
        roots = [(name, mod) for name, mod in model.named_modules() if _is_fsdp(mod)] or [("", model)]
        for prefix, module in roots:
            self._handles.append(module.register_forward_pre_hook(self._hook(prefix)))

    def _hook(self, prefix: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if not self.armed:
                return
            for name, p in module.named_parameters():
                if _is_dtensor(p):
                    continue
                fqn = f"{prefix}.{name}" if prefix else name
                self.captured.setdefault(fqn, p.detach().clone().cpu())

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _is_fsdp(module: torch.nn.Module) -> bool:
    return any(c.__name__.startswith("FSDP") for c in type(module).__mro__)


def prepare_compute_copy(job: Job) -> ComputeCopyCapture:
    """Arm a capture of the compute copies; the next training step fills it."""
    capture = ComputeCopyCapture(job.model)
    capture.armed = True
    return capture


def capture_and_export(job: Any, exporter: Callable[..., None], path: str, ctx: Any, recipe: Any) -> None:
    """(all ranks) Run ``exporter``; if it has ``prepare``, first arm it and run one forward in eval mode.

    The capture forward is :func:`ckptaudit.recipes.eval_forward`: eval mode, no gradients, the recipe's held-out
    ``eval_batch(job)`` through its ``forward(model, batch)`` (or ``model(batch)``), whatever kind of model it
    is; it takes no RNG draws and does not update anything.
    """
    from ckptaudit.recipes import eval_forward

    prepare = getattr(exporter, "prepare", None)
    if prepare is None:
        exporter(job, path, ctx)
        return
    if not callable(getattr(recipe, "eval_batch", None)):
        raise ValueError(f"{getattr(exporter, '__qualname__', exporter)} has prepare(job), which needs a forward "
                         "pass: give the recipe eval_batch(job) (a held-out batch) and, unless the model takes "
                         "that batch as it is, forward(model, batch)")
    capture = prepare(job)
    try:
        eval_forward(recipe, job)
    finally:
        capture.armed = False
        remove = getattr(capture, "remove", None)
        if remove is not None:
            remove()
    exporter(job, path, ctx, capture=capture)


def _export_with_model(job: Job, path: str, model_state: dict[str, torch.Tensor]) -> None:
    """(all ranks) rank 0 writes one torch.save file: the given model tensors + faithful everything else."""
    osd = full_optimizer_state(job.model, job.optimizer)
    if _rank() == 0:
        payload: dict[str, Any] = {
            "model": model_state,
            "optimizer": osd,
            "scheduler": job.scheduler.state_dict() if job.scheduler is not None else None,
            "rng": rng_state(),
            "data": job.data.state_dict() if job.data is not None else None,
            "step": job.step,
        }
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save(payload, path)
    if dist.is_initialized():
        dist.barrier()


def _captured(job: Job, capture: ComputeCopyCapture | None) -> dict[str, torch.Tensor]:
    if capture is None or not capture.captured:
        raise RuntimeError(
            "the compute-copy exporter saw no forward pass: call its prepare(job) and take one step first"
        )
    names = list(full_model_state(job.model))
    return {n: capture.captured[n] for n in names if n in capture.captured}


def compute_copy(job: Job, path: str, ctx: Any = None, capture: ComputeCopyCapture | None = None) -> None:
    """(all ranks) The defect: the bf16 compute copies, upcast to fp32, saved as a training checkpoint."""
    _export_with_model(job, path, {k: v.float() for k, v in _captured(job, capture).items()})


def compute_copy_bf16(job: Job, path: str, ctx: Any = None, capture: ComputeCopyCapture | None = None) -> None:
    """(all ranks) The defect, stored as bf16."""
    _export_with_model(job, path, dict(_captured(job, capture)))


compute_copy.prepare = prepare_compute_copy  # type: ignore[attr-defined]
compute_copy_bf16.prepare = prepare_compute_copy  # type: ignore[attr-defined]


def fp16_copy(job: Job, path: str, ctx: Any = None) -> None:
    """(all ranks) Masters rounded to fp16 and back to fp32 before saving."""
    full = full_model_state(job.model)
    _export_with_model(job, path, {k: v.half().float() if v.is_floating_point() else v for k, v in full.items()})


def swapped_moments(job: Job, path: str, ctx: Any = None, pair: tuple[str, str] | None = None) -> None:
    """(all ranks) Faithful weights, but the optimizer moments of two same-shape parameters swapped."""
    full = full_model_state(job.model)
    osd = full_optimizer_state(job.model, job.optimizer)
    a, b = pair or _same_shape_pair(osd["state"])
    osd["state"][a], osd["state"][b] = osd["state"][b], osd["state"][a]
    if _rank() == 0:
        torch.save({"model": full, "optimizer": osd,
                    "scheduler": job.scheduler.state_dict() if job.scheduler is not None else None,
                    "rng": rng_state(), "data": job.data.state_dict() if job.data is not None else None,
                    "step": job.step, "swapped": [a, b]}, path)
    if dist.is_initialized():
        dist.barrier()


def _same_shape_pair(state: dict[str, Any]) -> tuple[str, str]:
    seen: dict[tuple[int, ...], str] = {}
    for fqn, entry in state.items():
        m = entry.get("exp_avg")
        if isinstance(m, torch.Tensor) and m.dim() == 2:
            shape = tuple(m.shape)
            if shape in seen:
                return seen[shape], fqn
            seen[shape] = fqn
    raise RuntimeError("no two parameters of the same shape to swap")


# ---------------------------------------------------------------------------------------------------------------
# Loaders: restore what an exporter wrote into a live job (the differential resume test's restore step)


def documented_load(job: Job, path: str, ctx: Any = None) -> None:
    """(all ranks, collective) Restore everything :func:`documented` saved: model, optimizer, scheduler, step,
    and this rank's RNG state and data position. Refuses a directory whose ``.metadata`` is unsafe to unpickle.

    Also the default loader of a candidate DCP directory in :func:`documented`'s layout: a component the directory
    lacks (scheduler, rng, data, train_state) is left as the job has it. After a world-size change (saved on N
    ranks, loaded on M), rank ``r`` takes the RNG state and data position saved by rank ``r`` if there is one,
    else by rank ``r mod N`` (DCP reshards model and optimizer by itself); the built-in recipe keeps the same
    RNG and data position on every rank, so that is exact for it.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ckptaudit.formats.dcp.reader import check_metadata_safe
    from ckptaudit.formats.torchload import vetted_dcp_load

    check_metadata_safe(path)
    keys = list(FileSystemReader(path).read_metadata().state_dict_metadata)
    rank = _rank()

    def saved_rank(prefix: str) -> str | None:
        ranks = sorted({int(m.group(1)) for k in keys if (m := re.match(rf"{prefix}\.rank(\d+)\.", k))})
        if not ranks:
            return None
        return f"rank{rank if rank in ranks else ranks[rank % len(ranks)]}"

    def has(prefix: str) -> bool:
        return any(k == prefix or k.startswith(prefix + ".") for k in keys)

    msd, osd = get_state_dict(job.model, job.optimizer)
    state: dict[str, Any] = {"model": msd, "optim": osd}
    rng_key, data_key = saved_rank("rng"), saved_rank("data")
    if has("train_state"):
        state["train_state"] = {"step": 0}
    if rng_key is not None:
        state["rng"] = {rng_key: rng_state()}
    if job.scheduler is not None and has("scheduler"):
        state["scheduler"] = job.scheduler.state_dict()
    if job.data is not None and data_key is not None:
        state["data"] = {data_key: job.data.state_dict()}
    vetted_dcp_load(state, path)
    set_state_dict(job.model, job.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if "scheduler" in state:
        job.scheduler.load_state_dict(state["scheduler"])
    if "data" in state:
        job.data.load_state_dict(state["data"][data_key])
    if "train_state" in state:
        job.step = int(state["train_state"]["step"])
    if "rng" in state:
        set_rng_state(state["rng"][rng_key])


documented.load = documented_load  # type: ignore[attr-defined]


def load_model_and_optimizer(job: Job, path: str, ctx: Any = None) -> None:
    """(all ranks, collective) Restore what the example exporters wrote in one ``torch.save`` file: model and
    optimizer (full, FQN-keyed), scheduler, step, and the RNG state and data position they hold. Those files
    hold rank 0's RNG state and data position only, so every rank gets rank 0's: exact for recipes that keep
    them equal on every rank (the built-in one), visibly wrong for the others (the resume test compares each
    rank's restored state with the reference's).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    from ckptaudit.formats.torchload import vetted_torch_load

    payload = vetted_torch_load(path)
    set_state_dict(job.model, job.optimizer, model_state_dict=payload["model"],
                   optim_state_dict=payload["optimizer"], options=StateDictOptions(full_state_dict=True))
    if job.scheduler is not None and payload.get("scheduler") is not None:
        job.scheduler.load_state_dict(payload["scheduler"])
    if job.data is not None and payload.get("data") is not None:
        job.data.load_state_dict(payload["data"])
    if payload.get("step") is not None:
        job.step = int(payload["step"])
    if payload.get("rng") is not None:
        set_rng_state(payload["rng"])


for _exporter in (compute_copy, compute_copy_bf16, fp16_copy, swapped_moments):
    _exporter.load = load_model_and_optimizer  # type: ignore[attr-defined]
