"""User code for the resume tests, loaded by path (``tests/support/resume_user_code.py:attr``) as a user's file would be.

- ``NoisyRecipe``: the built-in tiny GPT with deliberate, bounded non-determinism: after backward, every
  gradient gets Gaussian noise of ``noise`` x its mean magnitude, drawn from a generator seeded by the process
  id, so no two processes take the same steps (what nondeterministic kernels do, with a knob).
- ``partial``: an exporter that saves model, optimizer and scheduler only (no RNG, no data position, no step),
  with a loader that restores what it saved.
- ``full_disk``: an exporter whose write fails on every rank (a full disk).
- ``none_step``: a recipe whose ``step`` forgets to return the loss.
- ``unseeded``: the built-in recipe, but Python's and NumPy's generators left unseeded (each process has its
  own), as in most training scripts; its steps draw from torch's generator only (dropout).
- ``torch_rng_only``: a complete exporter for such a job: model, optimizer, scheduler, step, each rank's data
  position and torch generator (not Python's or NumPy's, which the steps never use), with its loader.
- the failure modes an isolated export must survive: ``raises_mid_forward`` (its ``prepare`` forward raises
  inside FSDP2's forward, a block's parameters unsharded), ``full_disk`` (raises), ``crash`` (kills its
  process), ``hang`` (never returns).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import random
import time
from typing import Any

import numpy as np
import torch

from ckptaudit.recipes.tinygpt import TinyGPTRecipe, _core, lm_loss


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoisyRecipe(TinyGPTRecipe):
    noise: float = 0.0

    def step(self, job: Any) -> float:
        batch = job.data.next()
        core = _core(job.model)
        if core is not None:
            core.set_dropout_key((int(torch.randint(0, 2**62, (1,))), job.data.first_row))
        loss = lm_loss(job.model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        g = torch.Generator().manual_seed(os.getpid() * 1009 + job.step)
        with torch.no_grad():
            for p in job.model.parameters():
                if p.grad is None:
                    continue
                local = p.grad.to_local() if type(p.grad).__name__ == "DTensor" else p.grad
                scale = float(local.abs().mean())
                local.add_(torch.randn(local.shape, generator=g, dtype=local.dtype) * (self.noise * scale))
        job.optimizer.step()
        job.optimizer.zero_grad(set_to_none=True)
        job.scheduler.step()
        job.step += 1
        return float(loss.detach())


quiet = NoisyRecipe(name="tinygpt-noise-1e-3", noise=1e-3)
"""Noise well below the signal: a nonzero floor that a bf16 rounding still stands out from."""
loud = NoisyRecipe(name="tinygpt-noise-3", noise=3.0)
"""Noise larger than the signal: no power."""


def partial(job: Any, path: str, ctx: Any = None) -> None:
    """(all ranks) Model, optimizer and scheduler, gathered to rank 0 and saved in one file; nothing else."""
    from ckptaudit.exporters import full_model_state, full_optimizer_state

    state = {"model": full_model_state(job.model), "optimizer": full_optimizer_state(job.model, job.optimizer),
             "scheduler": job.scheduler.state_dict()}
    if ctx is None or ctx.rank == 0:
        torch.save(state, path)
    torch.distributed.barrier()


def _load_partial(job: Any, path: str, ctx: Any = None) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    from ckptaudit.formats.torchload import vetted_torch_load

    state = vetted_torch_load(path)
    set_state_dict(job.model, job.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(full_state_dict=True))
    job.scheduler.load_state_dict(state["scheduler"])


partial.load = _load_partial  # type: ignore[attr-defined]


def full_disk(job: Any, path: str, ctx: Any = None) -> None:
    """(all ranks) Fails the way a write to a full disk does."""
    _write_shard(path)


def _write_shard(path: str) -> None:
    raise OSError(errno.ENOSPC, "No space left on device", path)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoneStep(TinyGPTRecipe):
    def step(self, job: Any) -> float:
        super().step(job)
        return None  # type: ignore[return-value]  # the bug under test


none_step = NoneStep()


def crash(job: Any, path: str, ctx: Any = None) -> None:
    """(all ranks) Kills its process mid-export (a segfaulting extension, an OOM kill)."""
    os._exit(3)


def hang(job: Any, path: str, ctx: Any = None) -> None:
    """(all ranks) Never returns (a deadlocked writer, a stuck network mount)."""
    time.sleep(3600)


class _RaiseInForward:
    """A capture whose hook raises inside the forward, after FSDP2 has unsharded the block's parameters."""

    def __init__(self, job: Any) -> None:
        self.armed = True
        self.handle = job.model.blocks[1].register_forward_pre_hook(self._hook)

    def _hook(self, module: Any, args: Any) -> None:
        if self.armed:
            raise RuntimeError("capture buffer overflow in block 1")

    def remove(self) -> None:
        self.handle.remove()


def raises_mid_forward(job: Any, path: str, ctx: Any = None, capture: Any = None) -> None:
    """(all ranks) Never reached: its prepare forward raises."""
    raise AssertionError("export ran although its prepare forward raised")


raises_mid_forward.prepare = _RaiseInForward  # type: ignore[attr-defined]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Unseeded(TinyGPTRecipe):
    def setup(self, ctx: Any) -> Any:
        job = super().setup(ctx)
        random.seed()  # from the OS: every process its own state, as a script that never seeds them
        np.random.seed()
        return job


unseeded = Unseeded(name="tinygpt-unseeded")


def _torch_rng_state(job: Any, rank: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = get_state_dict(job.model, job.optimizer)
    return {"model": model, "optim": optim, "scheduler": job.scheduler.state_dict(), "step": {"step": job.step},
            f"rank{rank}": {"torch_rng": torch.get_rng_state(), "data": job.data.state_dict()}}


def torch_rng_only(job: Any, path: str, ctx: Any) -> None:
    """(all ranks) Everything a torch-RNG-only job needs, through DCP; no Python or NumPy generator."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_torch_rng_state(job, ctx.rank), checkpoint_id=path)


def _load_torch_rng_only(job: Any, path: str, ctx: Any) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from ckptaudit.formats.torchload import vetted_dcp_load

    state = _torch_rng_state(job, ctx.rank)
    vetted_dcp_load(state, path)
    set_state_dict(job.model, job.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    job.scheduler.load_state_dict(state["scheduler"])
    job.step = int(state["step"]["step"])
    mine = state[f"rank{ctx.rank}"]
    job.data.load_state_dict(mine["data"])
    torch.set_rng_state(mine["torch_rng"])


torch_rng_only.load = _load_torch_rng_only  # type: ignore[attr-defined]
