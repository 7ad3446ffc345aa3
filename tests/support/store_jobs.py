"""Distributed jobs the store tests run on real gloo ranks (importable by name, as spawn requires)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

from ckptaudit.exporters import full_model_state
from ckptaudit.launch import RankContext
from ckptaudit.recipes import Job
from ckptaudit.recipes.tinygpt import GPTConfig, plain_recipe, recipe
from ckptaudit.store import load_checkpoint, save_checkpoint

SMALL = dataclasses.replace(recipe, name="tinygpt-small", batch_size=2, total_steps=16,
                            cfg=GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=1))
"""FSDP2 with a bf16 MixedPrecisionPolicy and fp32 masters, small enough for 8 ranks on 2 cores."""


CTX = RankContext(rank=0, world_size=1, backend="gloo", shared_dir="")
"""One process, no process group: the in-process store tests' rank."""


@pytest.fixture
def one_thread() -> Iterator[None]:
    """A tiny model on a shared 2-core machine: one intra-op thread is ~50x faster than two spinning ones (a test
    module uses it with ``pytestmark = pytest.mark.usefixtures("one_thread")`` after importing it)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def trained(steps: int) -> Job:
    """The plain (single-process) tiny GPT after ``steps`` steps."""
    job = plain_recipe.setup(CTX)
    for _ in range(steps):
        plain_recipe.step(job)
    return job


def train_and_save(ctx: RankContext, root: str, total: int, save_at: list[int], keep_last: int | None = None
                   ) -> list[float]:
    """(all ranks) Train ``total`` steps from scratch, saving after the steps in ``save_at``; the losses."""
    job = SMALL.setup(ctx)
    losses = []
    for s in range(1, total + 1):
        losses.append(SMALL.step(job))
        if s in save_at:
            save_checkpoint(job, root, keep_last=keep_last, extras={"recipe": SMALL.name})
    return losses


def _run(ctx: RankContext, job: Any, steps: int) -> dict[str, Any]:
    losses = [SMALL.step(job) for _ in range(steps)]
    params = full_model_state(job.model)  # collective: every rank gathers
    return {"losses": losses, "params": params if ctx.rank == 0 else None, "step": job.step}


def reference_and_resumes(ctx: RankContext, total: int, roots: list[str]) -> dict[str, Any]:
    """(all ranks) The uninterrupted run of ``total`` steps, then for each root: resume from the newest
    resumable checkpoint (``load_checkpoint(job, root)``) and continue to ``total``."""
    out: dict[str, Any] = {"reference": _run(ctx, SMALL.setup(ctx), total), "resumed": {}}
    for root in roots:
        job = SMALL.setup(ctx)
        loaded = load_checkpoint(job, root)
        out["resumed"][root] = {"from": loaded.path, "start": loaded.step, "extras": loaded.extras,
                                **_run(ctx, job, total - loaded.step)}
    return out


def failing_storage_then_stall(ctx: RankContext, root: str, stall_s: float) -> dict[str, Any]:
    """(2 ranks) Step 2 committed; step 4 fails on rank 1 with ENOSPC mid-write; the retry commits (retention
    keep_last=1 then removes step 2); step 5 stalls on rank 1 after writing, so rank 0 meets the group timeout."""
    import errno
    import os
    import time

    from ckptaudit.store import CheckpointSaveError

    job = SMALL.setup(ctx)
    for _ in range(2):
        SMALL.step(job)
    save_checkpoint(job, root)
    for _ in range(2):
        SMALL.step(job)

    def full_disk(point: str) -> None:
        if ctx.rank == 1 and point == "write.partial":
            raise OSError(errno.ENOSPC, "No space left on device")

    out: dict[str, Any] = {}
    try:
        save_checkpoint(job, root, keep_last=1, fault_hook=full_disk)
    except CheckpointSaveError as exc:
        out["enospc"] = str(exc)
    out["listing"] = sorted(os.listdir(root))
    saved = save_checkpoint(job, root, keep_last=1)
    out["saved"], out["deleted"] = saved.path, list(saved.deleted)
    SMALL.step(job)

    def stall(point: str) -> None:
        if ctx.rank == 1 and point == "write.done":
            time.sleep(stall_s)
            os._exit(3)  # a hung rank that never comes back

    t0 = time.monotonic()
    try:
        save_checkpoint(job, root, fault_hook=stall)
    except CheckpointSaveError as exc:
        out["stall"] = str(exc)
    out["stall_s"] = time.monotonic() - t0
    return out
