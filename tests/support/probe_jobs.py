"""Distributed jobs the probe tests run on real gloo ranks (importable by name, as spawn requires).

Each job trains a few steps of a real wrapped model, records the probe's points and returns, on rank 0, one
:class:`~ckptaudit.probe.ProbeResult` per saved state it compared (``None`` on the other ranks).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from ckptaudit import exporters
from ckptaudit.exporters import capture_and_export
from ckptaudit.launch import RankContext
from ckptaudit.probe import Probe, ProbeError, ProbeResult
from ckptaudit.probe.run import prepared_probe
from ckptaudit.recipes.tinygpt import Block, TinyGPTRecipe


@dataclass(frozen=True, kw_only=True)
class Fsdp1Recipe(TinyGPTRecipe):
    """The built-in tiny GPT under FSDP1 (``use_orig_params=True``, one unit per block) with bf16 compute."""

    name: str = "tinygpt-fsdp1"

    def _wrap(self, model: torch.nn.Module, ctx: Any) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        # device_id=cpu: FSDP1 refuses a CPU-only machine unless told the device (torch 2.13).
        return FullyShardedDataParallel(model, use_orig_params=True, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                        mixed_precision=mp, device_id=torch.device("cpu"))


fsdp1_recipe = Fsdp1Recipe()
ddp_recipe = TinyGPTRecipe(name="tinygpt-ddp", wrap="ddp", param_dtype=None)
fsdp2_fp32_recipe = TinyGPTRecipe(name="tinygpt-fsdp2-fp32", param_dtype=None)


def _prepared(recipe: Any, ctx: RankContext, steps: int) -> tuple[Any, Probe]:
    return prepared_probe(recipe, ctx, steps)


def _compare(probe: Probe, results: dict[str, ProbeResult | None], label: str, source: Any) -> None:
    probe.record_saved(source)
    results[label] = probe.result()


def fsdp2_bf16(ctx: RankContext, out_dir: str, steps: int) -> dict[str, ProbeResult | None] | None:
    """(2 ranks) FSDP2 + bf16 MixedPrecisionPolicy: every exporter and state dict the tests judge."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ckptaudit.recipes.tinygpt import recipe

    job, probe = _prepared(recipe, ctx, steps)
    results: dict[str, ProbeResult | None] = {}
    for label, exporter, name in (("documented", exporters.documented, "faithful"),
                                  ("compute-copy-fp32", exporters.compute_copy, "compute-copy-fp32.pt"),
                                  ("compute-copy-bf16", exporters.compute_copy_bf16, "compute-copy-bf16.pt"),
                                  ("fp16-copy", exporters.fp16_copy, "fp16-copy.pt")):
        path = os.path.join(out_dir, name)
        capture_and_export(job, exporter, path, ctx, recipe)
        _compare(probe, results, label, path)
    msd, _ = get_state_dict(job.model, job.optimizer)
    _compare(probe, results, "state-dict-dtensor", {"model": msd})
    full = exporters.full_model_state(job.model)
    _compare(probe, results, "state-dict-full", full)
    broken = dict(full)
    del broken["head.weight"]
    w = broken["blocks.0.mlp.fc.weight"].clone()
    w[-1, -1] += 1.0  # the last row: rank 1's shard under Shard(0)
    broken["blocks.0.mlp.fc.weight"] = w
    _compare(probe, results, "state-dict-broken", broken)
    # A checkpoint rank 1 cannot see: every rank raises the same error (no rank is left waiting).
    faithful = os.path.join(out_dir, "faithful")
    try:
        probe.record_saved(faithful if ctx.rank == 0 else os.path.join(out_dir, "not-on-this-rank"))
        results["unseen-error"] = None
    except ProbeError as exc:
        results["unseen-error"] = str(exc)  # type: ignore[assignment]
    # Armed for a training step: the compute copies predate that step's update.
    probe.arm()
    recipe.step(job)
    probe.record_masters()
    results["stale"] = probe.result()
    return results if ctx.rank == 0 else None


def low_precision(ctx: RankContext, out_dir: str, steps: int) -> dict[str, ProbeResult | None] | None:
    """(2 ranks) A run whose model was cast to bf16 before fully_shard, saved the documented way."""
    from ckptaudit.recipes.tinygpt import low_precision_recipe

    job, probe = _prepared(low_precision_recipe, ctx, steps)
    results: dict[str, ProbeResult | None] = {}
    path = os.path.join(out_dir, "low-precision")
    exporters.documented(job, path, ctx)
    _compare(probe, results, "documented", path)
    return results if ctx.rank == 0 else None


def ddp_and_fsdp2_fp32(ctx: RankContext, out_dir: str, steps: int) -> dict[str, ProbeResult | None] | None:
    """(2 ranks) DDP, then FSDP2 without a MixedPrecisionPolicy: fp32 compute, fp32 masters."""
    results: dict[str, ProbeResult | None] = {}
    job, probe = _prepared(ddp_recipe, ctx, steps)
    path = os.path.join(out_dir, "ddp")
    exporters.documented(job, path, ctx)
    _compare(probe, results, "ddp-documented", path)
    rounded = {k: v.to(torch.bfloat16) for k, v in exporters.full_model_state(job.model).items()}
    _compare(probe, results, "ddp-bf16", rounded)
    job, probe = _prepared(fsdp2_fp32_recipe, ctx, steps)
    path = os.path.join(out_dir, "fsdp2-fp32")
    exporters.documented(job, path, ctx)
    _compare(probe, results, "fsdp2-fp32-documented", path)
    return results if ctx.rank == 0 else None


def fsdp1(ctx: RankContext, out_dir: str, steps: int) -> dict[str, ProbeResult | None] | None:
    """(2 ranks) FSDP1 with use_orig_params=True and bf16 MixedPrecision: documented save and a rounded copy."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from ckptaudit.probe.wrappers import clean_fqn

    job, probe = _prepared(fsdp1_recipe, ctx, steps)
    results: dict[str, ProbeResult | None] = {}
    path = os.path.join(out_dir, "fsdp1")
    exporters.documented(job, path, ctx)
    _compare(probe, results, "documented", path)
    # What a compute-copy exporter saves: the full parameters rounded to bf16, upcast back to fp32.
    with FullyShardedDataParallel.summon_full_params(job.model, writeback=False):
        rounded = {clean_fqn(n): p.detach().to(torch.bfloat16).float().clone()
                   for n, p in job.model.named_parameters()}
    path = os.path.join(out_dir, "fsdp1-rounded.pt")
    if ctx.rank == 0:
        torch.save({"model": rounded}, path)
    torch.distributed.barrier()
    _compare(probe, results, "rounded-upcast", path)
    # FSDP1's sharded state dict holds ShardedTensors: refused in memory, with the way out in the message.
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    try:
        probe.record_saved(get_model_state_dict(job.model))
        results["sharded-tensor-error"] = None
    except ProbeError as exc:
        results["sharded-tensor-error"] = str(exc)  # type: ignore[assignment]
    # Without use_orig_params the original parameters are flattened away: the probe refuses, and says why.
    from ckptaudit.recipes.tinygpt import GPTConfig, TinyGPT

    flat = FullyShardedDataParallel(TinyGPT(GPTConfig()), device_id=torch.device("cpu"))
    try:
        Probe(flat)
        results["flat-error"] = None
    except ProbeError as exc:
        results["flat-error"] = str(exc)  # type: ignore[assignment]
    return results if ctx.rank == 0 else None
