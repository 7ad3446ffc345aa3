"""The rank functions of the experiment's phases (each run on every rank of a :func:`ckptaudit.launch.launch`):
train and save the reference, export one candidate from the reference's state, restore and repeat the steps; and
the documented restore paths (:func:`default_load`, :func:`load_weights`).

User code that can spoil a run never shares processes with another run: the training phase runs the recipe and
ckptaudit's documented save only; each candidate's ``prepare``, forward and export run in their own phase, and
its load and steps in another.
"""

from __future__ import annotations

import math
import os
from typing import Any

from ckptaudit.launch import RankContext
from ckptaudit.resume.config import PhaseFailed, ResumeConfig, Trajectory
from ckptaudit.resume.snapshot import param_names, state_snapshot, take_snapshot


def _run_steps(recipe: Any, job: Any, steps: int, full: bool) -> Trajectory:
    """(all ranks) ``steps`` checked recipe steps, the mean loss and (rank 0) the parameters after each."""
    import torch
    import torch.distributed as dist

    from ckptaudit.recipes import checked_step

    traj = Trajectory(full=full)
    values, norms = take_snapshot(job, full)
    traj.params.append(values)
    traj.norms.append(norms)
    for _ in range(steps):
        loss = torch.tensor([checked_step(recipe, job)], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        traj.losses.append(float(loss))
        values, norms = take_snapshot(job, full)
        traj.params.append(values)
        traj.norms.append(norms)
    return traj


def _full_mode(job: Any, cfg: ResumeConfig) -> bool:
    return sum(p.numel() for _, p in param_names(job.model)) <= cfg.full_values_limit


def _failed(stage: str, failure: Any, ctx: RankContext) -> PhaseFailed:
    return PhaseFailed(stage, failure, ctx.rank)


def train_phase(ctx: RankContext, cfg: ResumeConfig, workdir: str) -> Any:
    """(``nproc`` ranks) Train ``save_at`` steps, save the reference the documented way, continue ``steps`` steps
    uninterrupted. No exporter of the user's runs here, so nothing a candidate does can touch this trajectory.

    Rank 0 returns ``{"traj", "saved", "after"}``: the trajectory, and the job's state right after the save and
    after the last step (what changed in between is what the steps consume); a recipe failure is a
    :class:`PhaseFailed`."""
    from ckptaudit import exporters
    from ckptaudit.recipes import RecipeError, checked_setup, checked_step, load_recipe

    try:
        recipe = load_recipe(cfg.recipe)
        job = checked_setup(recipe, ctx)
        for _ in range(cfg.save_at):
            checked_step(recipe, job)
        exporters.documented(job, os.path.join(workdir, cfg.reference_name), ctx)
        saved = state_snapshot(job)
        traj = _run_steps(recipe, job, cfg.steps, _full_mode(job, cfg))
        after = state_snapshot(job)
    except RecipeError as exc:
        return _failed("recipe", exc.failure, ctx)
    return {"traj": traj, "saved": saved, "after": after} if ctx.rank == 0 else None


def export_phase(ctx: RankContext, cfg: ResumeConfig, workdir: str, which: int) -> Any:
    """(``nproc`` ranks, one launch per candidate) Rebuild the job, restore the reference into it (the training
    run's state at the save, exactly: the driver checks the snapshot against the training run's), then run the
    candidate's exporter, with its ``prepare`` forward when it has one. Whatever it does (raise mid-forward,
    leave FSDP half-unsharded, kill its process, hang) ends with these processes.

    Rank 0 returns ``{"state"}``, the snapshot the export started from; the exporter's failure is a
    ``PhaseFailed("export")``, the recipe's ``PhaseFailed("recipe")``, ckptaudit's own restore ``PhaseFailed("internal")``."""
    from ckptaudit import exporters
    from ckptaudit.exporters import capture_and_export
    from ckptaudit.recipes import (
        RecipeError,
        checked_setup,
        describe_function,
        load_object,
        load_recipe,
        user_failure,
    )

    try:
        recipe = load_recipe(cfg.recipe)
        job = checked_setup(recipe, ctx)
    except RecipeError as exc:
        return _failed("recipe", exc.failure, ctx)
    try:
        exporters.documented_load(job, os.path.join(workdir, cfg.reference_name), ctx)
    except Exception as exc:  # noqa: BLE001 - reported as the experiment's failure, not the candidate's
        return _failed("internal", user_failure("ckptaudit.exporters.documented_load",
                                                f"raised while restoring the reference on rank {ctx.rank}", exc), ctx)
    state = state_snapshot(job)
    spec = cfg.exporters[which]
    exporter: Any = spec
    try:
        exporter = load_object(spec)
        capture_and_export(job, exporter, os.path.join(workdir, cfg.candidate_name(which)), ctx, recipe)
    except Exception as exc:  # noqa: BLE001 - the user's exporter: its failure is its candidate's finding
        where = describe_function(exporter) if callable(exporter) else spec
        return _failed("export", user_failure(where, f"raised while exporting on rank {ctx.rank}", exc), ctx)
    return {"state": state} if ctx.rank == 0 else None


def _compute_dtype(recipe: Any, model: Any) -> Any:
    """The dtype forward computes in: the recipe's ``compute_dtype``/``param_dtype``, else an FSDP2 module's
    ``MixedPrecisionPolicy.param_dtype``, else bfloat16 (the usual one)."""
    import torch

    for attr in ("compute_dtype", "param_dtype"):
        name = getattr(recipe, attr, None)
        if isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if isinstance(name, torch.dtype):
            return name
    for m in model.modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        if get_state is not None:
            policy = getattr(get_state(), "_mp_policy", None)
            if policy is not None and policy.param_dtype is not None:
                return policy.param_dtype
    return torch.bfloat16


def _perturb_for_control(recipe: Any, job: Any) -> str:
    """(all ranks) Round every floating-point master (each rank its own shard) to the compute dtype, or, where
    the masters are already that narrow, move each by one ulp. Returns what was done."""
    import torch

    target = _compute_dtype(recipe, job.model)
    nudged = False
    with torch.no_grad():
        for _, p in param_names(job.model):
            local = p.to_local() if type(p).__name__ == "DTensor" else p.data
            if not local.is_floating_point():
                continue
            if torch.finfo(local.dtype).bits > torch.finfo(target).bits:
                local.copy_(local.to(target).to(local.dtype))
            else:
                nudged = True
                local.copy_(torch.nextafter(local, torch.full_like(local, math.inf)))
    return (f"masters moved by one ulp (already {str(target).removeprefix('torch.')})" if nudged
            else f"masters rounded to {str(target).removeprefix('torch.')}")


def default_load(job: Any, path: str, ctx: Any = None) -> None:
    """(all ranks) The loader for an exporter without ``load``: a DCP directory in the documented layout
    (``model``, ``optim``, and whichever of ``scheduler``, ``rng``, ``data``, ``train_state`` it has) through
    :func:`ckptaudit.exporters.documented_load`; anything else the audit reads through :func:`load_weights`
    (the model weights only: the rest of the state stays the fresh job's, and the report says so)."""
    from ckptaudit import exporters

    if os.path.isfile(os.path.join(path, ".metadata")):
        from torch.distributed.checkpoint import FileSystemReader

        from ckptaudit.formats.dcp.reader import check_metadata_safe

        check_metadata_safe(path)
        keys = FileSystemReader(path).read_metadata().state_dict_metadata
        if any(k.startswith("model.") for k in keys) and any(k.startswith("optim.") for k in keys):
            exporters.documented_load(job, path, ctx)
            return
    load_weights(job, path, ctx)


def resume_phase(ctx: RankContext, cfg: ResumeConfig, workdir: str, kind: str, which: int | None) -> Any:
    """(``resume_nproc`` ranks) One resumed run: ``kind`` is ``reference``, ``control`` or ``candidate``.

    Rank 0 returns ``{"fresh", "restored", "traj", "loader", "control"}``; a failure of user code is returned
    as a :class:`PhaseFailed` (``recipe`` for the reference and the control; ``load`` or ``steps`` for a candidate).
    """
    from ckptaudit import exporters
    from ckptaudit.recipes import RecipeError, checked_setup, describe_function, load_object, load_recipe, user_failure

    try:
        recipe = load_recipe(cfg.recipe)
        job = checked_setup(recipe, ctx)
    except RecipeError as exc:
        return _failed("recipe", exc.failure, ctx)
    ref_path = os.path.join(workdir, cfg.reference_name)
    fresh = state_snapshot(job)
    control = ""
    loader_name = "ckptaudit.exporters.documented_load"
    stage = "recipe" if kind != "candidate" else "load"
    loader: Any = exporters.documented_load
    try:
        if kind != "candidate" or cfg.borrow_state:
            exporters.documented_load(job, ref_path, ctx)
        if kind == "control":
            control = _perturb_for_control(recipe, job)
        if kind == "candidate":
            assert which is not None
            loader = cfg.exporters[which]
            exporter = load_object(cfg.exporters[which])
            loader = getattr(exporter, "load", None) or default_load
            loader_name = describe_function(loader)
            loader(job, os.path.join(workdir, cfg.candidate_name(which)), ctx)
    except Exception as exc:  # noqa: BLE001 - the loader is user code (or ours on the user's recipe)
        where = describe_function(loader) if callable(loader) else str(loader)
        return _failed(stage, user_failure(where, f"raised while restoring on rank {ctx.rank}", exc), ctx)
    restored = state_snapshot(job)
    try:
        traj = _run_steps(recipe, job, cfg.steps, _full_mode(job, cfg))
    except RecipeError as exc:
        return _failed("recipe" if kind != "candidate" else "steps", exc.failure, ctx)
    if ctx.rank != 0:
        return None
    return {"fresh": fresh, "restored": restored, "traj": traj, "loader": loader_name, "control": control}


def load_weights(job: Any, path: str, ctx: Any = None) -> None:
    """(all ranks) The model weights found in ``path`` (any format the audit reads), loaded into the live model,
    cast to its dtype as any loader would. Everything else stays as it was."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from ckptaudit.formats import open_checkpoint
    from ckptaudit.formats.io.tensors import TensorData
    from ckptaudit.formats.torchload import materialize
    from ckptaudit.layouts import interpret, normalize_fqn

    with open_checkpoint(path) as ckpt:
        view = interpret(ckpt)
        if view.model is None:
            raise ValueError(f"{path}: no model weights found (layout {view.layout}); cannot restore the candidate")
        by_norm = {normalize_fqn(k): ref for k, ref in view.model.params.items()}
        wanted: dict[str, Any] = dict(get_model_state_dict(job.model))
        state: dict[str, Any] = {}
        missing = []
        for key, current in wanted.items():
            ref = view.model.params.get(key) or by_norm.get(normalize_fqn(key))
            if ref is None or not isinstance(ref.data, TensorData):
                missing.append(key)
                continue
            state[key] = materialize(ref.data, ckpt.maps).to(current.dtype)
        if missing:
            raise ValueError(f"{path}: lacks {len(missing)} model tensor(s), e.g. {missing[0]}")
    set_model_state_dict(job.model, state, options=StateDictOptions(full_state_dict=True))
