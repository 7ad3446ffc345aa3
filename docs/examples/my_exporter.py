"""A user's exporter for ``ckptaudit resume-test``: the training state, saved and restored the documented way.

An exporter is ``export(job, path, ctx)``, run on every rank (collectives allowed), writing ``path`` (a file or
a directory). Its ``load(job, path, ctx)`` attribute restores it into a fresh job; the resume test judges what
that restores, component by component. Optional ``prepare(job)`` returns a capture to arm before a forward pass
(see docs/resume-test.md).

It saves in the layout ckptaudit's default loader reads (docs/resume-test.md, "The default loader's layout"):
``model`` and ``optim`` from ``get_state_dict``, ``scheduler``, ``train_state: {"step": N}``, and per rank
``rng: {"rank<r>": {"python", "numpy", "torch"}}`` and ``data: {"rank<r>": ...}``; so ``export`` without its
``load`` is restored whole by the default loader too. Run::

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
            "train_state": {"step": job.step}, "rng": {f"rank{rank}": _rng()},
            "data": {f"rank{rank}": job.data.state_dict()}}


def export(job: Any, path: str, ctx: Any) -> None:
    """(all ranks) Model, optimizer, scheduler, step, and per rank the RNG state and the data position."""
    dcp.save(_state(job, ctx.rank), checkpoint_id=path)


def load(job: Any, path: str, ctx: Any) -> None:
    """(all ranks) Restore everything :func:`export` saved (on the same number of ranks)."""
    from ckptaudit.load import load_dcp  # vets .metadata and every item before DCP unpickles them

    state = _state(job, ctx.rank)
    load_dcp(state, path)
    set_state_dict(job.model, job.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    job.scheduler.load_state_dict(state["scheduler"])
    job.step = int(state["train_state"]["step"])
    job.data.load_state_dict(state["data"][f"rank{ctx.rank}"])
    rng = state["rng"][f"rank{ctx.rank}"]
    random.setstate(tuple(_tuples(rng["python"])))
    np.random.set_state(tuple(_tuples(rng["numpy"])))
    torch.set_rng_state(rng["torch"])


def _tuples(v: Any) -> Any:
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


export.load = load  # type: ignore[attr-defined]
