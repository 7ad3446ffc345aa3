"""A user's exporter for ``ckptaudit resume-test``: the training state, saved and restored the documented way.

An exporter is ``export(job, path, ctx)``, run on every rank (collectives allowed), writing ``path`` (a file or
a directory). Its ``load(job, path, ctx)`` attribute restores it into a fresh job; the resume test judges what
that restores, component by component. Optional ``prepare(job)`` returns a capture to arm before a forward pass
(see docs/resume-test.md). Run::

    .venv/bin/python -m ckptaudit resume-test --recipe docs/examples/my_recipe.py:recipe \\
        --exporter docs/examples/my_exporter.py:export
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def _rng() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _state(job: Any, rank: int) -> dict[str, Any]:
    model, optim = get_state_dict(job.model, job.optimizer)  # sharded, FQN-keyed, the fp32 masters
    return {"model": model, "optim": optim, "scheduler": job.scheduler.state_dict(),
            "train": {"step": job.step}, f"rank{rank}": {"rng": _rng(), "data": job.data.state_dict()}}


def export(job: Any, path: str, ctx: Any) -> None:
    """(all ranks) Model, optimizer, scheduler, step, and per rank the RNG state and the data position."""
    dcp.save(_state(job, ctx.rank), checkpoint_id=path)


def load(job: Any, path: str, ctx: Any) -> None:
    """(all ranks) Restore everything :func:`export` saved (on the same number of ranks)."""
    from ckptaudit.formats.torchload import safe_dcp_load  # checks .metadata before DCP unpickles it

    state = _state(job, ctx.rank)
    safe_dcp_load(state, path)
    set_state_dict(job.model, job.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    job.scheduler.load_state_dict(state["scheduler"])
    job.step = int(state["train"]["step"])
    mine = state[f"rank{ctx.rank}"]
    job.data.load_state_dict(mine["data"])
    random.setstate(tuple(_tuples(mine["rng"]["python"])))
    np.random.set_state(tuple(_tuples(mine["rng"]["numpy"])))
    torch.set_rng_state(mine["rng"]["torch"])


def _tuples(v: Any) -> Any:
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


export.load = load  # type: ignore[attr-defined]
