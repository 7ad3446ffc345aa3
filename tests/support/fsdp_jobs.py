"""Distributed jobs the tests run on real gloo ranks (importable by name, as spawn requires)."""

from __future__ import annotations

import os
from typing import Any

from ckptaudit import exporters
from ckptaudit.exporters import capture_and_export
from ckptaudit.launch import RankContext
from ckptaudit.recipes.rng import rng_state


def write_variants(ctx: RankContext, out_dir: str, steps: int) -> dict[str, Any]:
    """(2 ranks) Train the built-in recipe and save it every way the tests need, from the same state."""
    from ckptaudit.recipes.tinygpt import recipe
    from configurations import configuration

    with configuration("training"):
        job = recipe.setup(ctx)
        for _ in range(steps):
            recipe.step(job)
    # Each save named: a failure (its exception, or a rank's stderr when it dies by a signal) says which one.
    with configuration("faithful"):
        exporters.documented(job, os.path.join(out_dir, "faithful"), ctx)
    with configuration("faithful.pt"):
        write_torch_save_copy(job, os.path.join(out_dir, "faithful.pt"), ctx)
    with configuration("compute-copy-fp32.pt"):
        capture_and_export(job, exporters.compute_copy, os.path.join(out_dir, "compute-copy-fp32.pt"), ctx, recipe)
    with configuration("compute-copy-bf16.pt"):
        capture_and_export(job, exporters.compute_copy_bf16, os.path.join(out_dir, "compute-copy-bf16.pt"), ctx,
                           recipe)
    with configuration("fp16-copy.pt"):
        exporters.fp16_copy(job, os.path.join(out_dir, "fp16-copy.pt"), ctx)
    with configuration("swapped.pt"):
        exporters.swapped_moments(job, os.path.join(out_dir, "swapped.pt"), ctx)
    full = exporters.full_model_state(job.model)
    return {"params": [n for n, _ in job.model.named_parameters()], "shapes": {k: tuple(v.shape) for k, v in full.items()}}


def write_torch_save_copy(job: Any, path: str, ctx: RankContext) -> None:
    """(all ranks, collective) The state ``documented`` saved, written by rank 0 with ``torch.save``.

    Full (unsharded) model and FQN-keyed optimizer tensors, the scheduler, and every rank's RNG state and data
    position gathered, under the keys a hand-written exporter would use (``optimizer``, ``step``) rather than
    the DCP checkpoint's (``optim``, ``train_state``): the same training state in another format and layout.
    Nothing here draws random numbers, so the RNG states equal the ones the DCP checkpoint holds.
    """
    import torch
    import torch.distributed as dist

    model = exporters.full_model_state(job.model)
    optim = exporters.full_optimizer_state(job.model, job.optimizer)
    mine = {"rng": rng_state(), "data": job.data.state_dict() if job.data is not None else None}
    every: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(every, mine)
    if ctx.rank == 0:
        torch.save({
            "model": model,
            "optimizer": optim,
            "scheduler": job.scheduler.state_dict() if job.scheduler is not None else None,
            "rng": {f"rank{r}": s["rng"] for r, s in enumerate(every)},
            "data": {f"rank{r}": s["data"] for r, s in enumerate(every)},
            "step": job.step,
        }, path)
    dist.barrier()


def write_low_precision(ctx: RankContext, out_dir: str, steps: int) -> None:
    """(2 ranks) A run with bf16 masters (the model cast to bf16 before fully_shard), saved the documented way."""
    from ckptaudit.recipes.tinygpt import low_precision_recipe

    job = low_precision_recipe.setup(ctx)
    for _ in range(steps):
        low_precision_recipe.step(job)
    exporters.documented(job, os.path.join(out_dir, "low-precision-masters"), ctx)


def _uneven_model() -> Any:
    """(4 ranks, collective) A model FSDP2 shards unevenly over 4 ranks: a ``Linear(8, 3)`` leaves rank 3 empty
    shards, a ``Linear(3, 6)`` splits its rows 2-2-2-0."""
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 3), torch.nn.Linear(3, 6), torch.nn.LayerNorm(6),
                                torch.nn.Linear(6, 5))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def write_uneven_shards(ctx: RankContext, out_dir: str) -> None:
    """(4 ranks) FSDP2 over parameters with fewer rows than ranks and rows that do not divide evenly, so that
    some ranks hold empty shards; saved the documented way (DCP) and, by rank 0, as one full ``torch.save``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model = _uneven_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out_dir, "dcp"))
    full_msd, full_osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ctx.rank == 0:
        torch.save({"model": full_msd, "optim": full_osd}, os.path.join(out_dir, "full.pt"))


def snapshot_gather_equals_full_tensor(ctx: RankContext) -> bool:
    """(4 ranks) The resume snapshot's gather of each FSDP2 parameter (empty and uneven shards included) equals
    ``full_tensor()``'s."""
    import torch

    from ckptaudit.resume.snapshot import _full

    model = _uneven_model()
    same = True
    for _, p in model.named_parameters():
        mine, theirs = _full(p.detach()), p.detach().full_tensor()
        same = same and mine.shape == theirs.shape and torch.equal(mine, theirs)
    return same


def mixed_model() -> Any:
    """A model holding its MLP body in bf16 by design and its embedding, norm and head in fp32."""
    import torch
    from torch import nn

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(32, 16)
            self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).to(torch.bfloat16)
            self.norm = nn.LayerNorm(16)
            self.head = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # Each part computes in its own weights' dtype (under FSDP2: the unsharded ones, its policy's).
            h = self.body(self.emb(x).to(self.body[0].weight.dtype))
            return self.head(self.norm(h.to(self.norm.weight.dtype)))

    return Mixed()


def write_mixed_masters(ctx: RankContext, out_dir: str, steps: int) -> dict[str, Any]:
    """(2 ranks) FSDP2 over a model with bf16 parameters by design: the bf16 body its own ``fully_shard`` unit, the
    fp32 rest under the root's bf16 ``MixedPrecisionPolicy`` (fp32 masters); AdamW; saved the documented way
    (``mixed``), and through an exporter that casts every model tensor to bf16 (``cast``)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = mixed_model()
    fully_shard(model.body, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(ctx.rank)
    for _ in range(steps):
        model(torch.randint(0, 32, (8,), generator=gen)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "train_state": {"step": steps}},
             checkpoint_id=os.path.join(out_dir, "mixed"))
    cast = {k: v.to(torch.bfloat16) for k, v in msd.items()}
    dcp.save({"model": cast, "optim": osd, "train_state": {"step": steps}}, checkpoint_id=os.path.join(out_dir, "cast"))
    return {n: str(p.dtype).removeprefix("torch.") for n, p in model.named_parameters()}
