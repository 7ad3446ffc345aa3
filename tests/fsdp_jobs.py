"""Distributed jobs the tests run on real gloo ranks (importable by name, as spawn requires)."""

from __future__ import annotations

import os
from typing import Any

from ckptaudit import exporters
from ckptaudit.demo import capture_and_export
from ckptaudit.dist.launch import RankContext


def write_variants(ctx: RankContext, out_dir: str, steps: int) -> dict[str, Any]:
    """(2 ranks) Train the built-in recipe and save it every way the tests need, from the same state."""
    from ckptaudit.recipes.tinygpt import recipe

    job = recipe.setup(ctx)
    for _ in range(steps):
        recipe.step(job)
    exporters.documented(job, os.path.join(out_dir, "faithful"), ctx)
    capture_and_export(job, exporters.compute_copy, os.path.join(out_dir, "compute-copy-fp32.pt"), ctx, recipe)
    capture_and_export(job, exporters.compute_copy_bf16, os.path.join(out_dir, "compute-copy-bf16.pt"), ctx, recipe)
    exporters.fp16_copy(job, os.path.join(out_dir, "fp16-copy.pt"), ctx)
    exporters.swapped_moments(job, os.path.join(out_dir, "swapped.pt"), ctx)
    full = exporters.full_model_state(job.model)
    return {"params": [n for n, _ in job.model.named_parameters()], "shapes": {k: tuple(v.shape) for k, v in full.items()}}


def write_low_precision(ctx: RankContext, out_dir: str, steps: int) -> None:
    """(2 ranks) A run with bf16 masters (the model cast to bf16 before fully_shard), saved the documented way."""
    from ckptaudit.recipes.tinygpt import low_precision_recipe

    job = low_precision_recipe.setup(ctx)
    for _ in range(steps):
        low_precision_recipe.step(job)
    exporters.documented(job, os.path.join(out_dir, "low-precision-masters"), ctx)
