"""The differential resume test: does a checkpoint resume the original trajectory?

Phases, each a fresh set of real processes (:func:`ckptaudit.dist.launch.launch`):

1. **train** (``nproc`` ranks): build the recipe's job, train ``save_at`` steps; save the reference through the
   documented path (:func:`ckptaudit.exporters.documented`: ``get_state_dict`` + DCP, with scheduler, RNG and
   data position) and each candidate through its exporter (a failing exporter is recorded and skipped); then
   continue ``steps`` steps uninterrupted, recording the loss and the parameters (rank 0 keeps them) after
   every step.
2. **reference resume** (``resume_nproc`` ranks, fresh processes): build the job, restore the reference, run the
   same steps. Its per-step deviation from the uninterrupted run is the *floor* (zero on deterministic CPU
   kernels on the same number of ranks; reduction order when the world size changes).
3. **positive control** (``resume_nproc`` ranks): the reference with its parameters rounded to the compute dtype
   (or nudged by one ulp when the masters are already that narrow), resumed like a candidate. It must stand out
   from the floor after restore, or the test has no power: ``resume.no-power``, and no candidate is judged.
4. **candidate resume** (``resume_nproc`` ranks, once per candidate): a fresh job restored from the candidate
   alone, through its exporter's ``load`` (default: :func:`default_load`), nothing of the reference underneath
   (``borrow_state``: the reference first, then the candidate's loader over it, the old controlled experiment).

Every resumed run snapshots the job's state right after the restore, before any step, component by component
(parameters, optimizer moments, optimizer step, optimizer hyperparameters, scheduler, each rank's RNG, each
rank's data position, the training step). There is no kernel noise before the first step, so a candidate whose
restored state differs from the reference's restored state is a finding however noisy the steps are:
``resume.not-restored`` (still the fresh job's value) or ``resume.restored-differs``. After the restore, the
verdict is floor-relative per step: ``resume.drift`` when the relative L2 deviation of the parameters at step
``k`` exceeds ``max(margin x floor[k], min_rel)``.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ckptaudit.catalogue import finding
from ckptaudit.dist.launch import DistributedError, RankContext, fast, launch
from ckptaudit.model import Finding, Report

__all__ = ["COMPONENTS", "Deviation", "ResumeConfig", "ResumeError", "Trajectory", "compare_states",
           "compare_trajectories", "default_load", "load_weights", "run_resume_test"]

DEFAULT_RECIPE = "ckptaudit.recipes.tinygpt:recipe"
DEFAULT_EXPORTER = "ckptaudit.exporters:documented"

_FAST = fast()  # ranks forked from a server that imported torch once: fresh processes, fast start
_MARKER = ".ckptaudit-exporting"

COMPONENTS = ("parameters", "optimizer moments", "optimizer step", "optimizer hyperparameters", "scheduler",
              "rng", "data position", "training step")
"""The parts of a job's state compared right after each restore."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ResumeConfig:
    recipe: str = DEFAULT_RECIPE
    """``module:attr`` or ``path.py:attr`` of a :class:`ckptaudit.recipe.Recipe`."""
    exporters: tuple[str, ...] = (DEFAULT_EXPORTER,)
    """The exporters under test, ``module:attr`` or ``path.py:attr`` each."""
    nproc: int = 2
    """Ranks that train and save."""
    resume_nproc: int | None = None
    """Ranks that resume (``None``: ``nproc``). DCP reshards; single-file exporters go through their loaders."""
    save_at: int = 8
    """Training steps before the checkpoint."""
    steps: int = 8
    """Steps taken after resuming (and by the uninterrupted run)."""
    margin: float = 10.0
    """At step k a candidate drifts when its deviation exceeds ``margin`` x the reference's (the floor) ..."""
    min_rel: float = 1e-6
    """... and this relative L2 deviation (about eight fp32 ulps), whichever is larger."""
    loss_threshold: float = 0.01
    """Relative loss difference under which the loss "looks normal"."""
    borrow_state: bool = False
    """Restore the reference under each candidate (only what the candidate's loader overwrites is its own)."""
    full_values_limit: int = 4_000_000
    """Parameters with at most this many elements in all are recorded in full at every step; larger models
    are recorded as per-parameter norms (deviation is then estimated from the norms)."""
    timeout_s: float = 600.0
    """Bound of each phase (and of each collective in it)."""
    workdir: str | None = None
    """Where checkpoints are written; a temporary directory (removed afterwards) when ``None``."""
    reference_name: str = "reference"
    candidate_names: tuple[str, ...] = ()
    """File names for the candidates inside ``workdir`` (default: derived from the exporter names)."""
    debug: bool = False
    """Failures of user code carry every frame of the traceback, not only the user's own."""

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"nproc must be at least 1, got {self.nproc}")
        if self.resume_nproc is not None and self.resume_nproc < 1:
            raise ValueError(f"resume_nproc must be at least 1, got {self.resume_nproc}")
        if self.save_at < 1 or self.steps < 1:
            raise ValueError(f"save_at and steps must be at least 1 (got {self.save_at} and {self.steps}): the "
                             "optimizer needs state before the checkpoint and the test needs steps after it")
        if not self.margin >= 1.0:
            raise ValueError(f"margin must be at least 1 (got {self.margin}): below 1 the reference itself "
                             "would drift")
        if not self.exporters:
            raise ValueError("name at least one exporter to test (module:attr)")
        if self.candidate_names and len(self.candidate_names) != len(self.exporters):
            raise ValueError("candidate_names must name every exporter")

    @property
    def resume_ranks(self) -> int:
        return self.resume_nproc or self.nproc

    def candidate_name(self, i: int) -> str:
        if self.candidate_names:
            return self.candidate_names[i]
        attr = self.exporters[i].rpartition(":")[2]
        return f"candidate-{i}-{re.sub(r'[^A-Za-z0-9_.-]', '_', attr)}"


class ResumeError(Exception):
    """The experiment itself could not run (a phase crashed or timed out outside the user's exporters)."""


@dataclass
class Trajectory:
    """What rank 0 recorded: loss per step and parameters after the restore (index 0) and after each step."""

    losses: list[float] = field(default_factory=list)
    params: list[dict[str, np.ndarray]] = field(default_factory=list)
    norms: list[dict[str, float]] = field(default_factory=list)
    full: bool = True


@dataclass(frozen=True)
class _Failed:
    """A rank's report that user code failed: ``stage`` is ``recipe``, ``export``, ``load`` or ``steps``."""

    stage: str
    failure: Any  # ckptaudit.recipe.UserFailure (imported lazily: it imports torch)
    rank: int


# ----------------------------------------------------------------------------------------------------------------
# Rank functions (run on every rank of a launch)


def _param_names(model: Any) -> list[tuple[str, Any]]:
    from ckptaudit.layouts import normalize_fqn

    return [(normalize_fqn(n), p) for n, p in model.named_parameters()]


def _snapshot(job: Any, full: bool) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """(all ranks, collective for sharded parameters) Gather every parameter; rank 0's copy is the result."""
    import torch

    values: dict[str, np.ndarray] = {}
    norms: dict[str, float] = {}
    for name, p in _param_names(job.model):
        t = p.detach()
        if type(t).__name__ == "DTensor":
            t = t.full_tensor()
        t = t.float().cpu()
        norms[name] = float(torch.linalg.vector_norm(t))
        if full:
            values[name] = t.numpy().copy()
    return values, norms


def _run_steps(recipe: Any, job: Any, steps: int, full: bool) -> Trajectory:
    """(all ranks) ``steps`` checked recipe steps, the mean loss and (rank 0) the parameters after each."""
    import torch
    import torch.distributed as dist

    from ckptaudit.recipe import checked_step

    traj = Trajectory(full=full)
    values, norms = _snapshot(job, full)
    traj.params.append(values)
    traj.norms.append(norms)
    for _ in range(steps):
        loss = torch.tensor([checked_step(recipe, job)], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        traj.losses.append(float(loss))
        values, norms = _snapshot(job, full)
        traj.params.append(values)
        traj.norms.append(norms)
    return traj


def _full_mode(job: Any, cfg: ResumeConfig) -> bool:
    return sum(p.numel() for _, p in _param_names(job.model)) <= cfg.full_values_limit


def _digest(t: Any) -> str:
    """(all ranks, collective for a DTensor) Hash of a tensor's dtype, shape and bytes."""
    import torch

    t = t.detach()
    if type(t).__name__ == "DTensor":
        t = t.full_tensor()
    t = t.cpu().contiguous()
    h = hashlib.blake2b(f"{t.dtype}{tuple(t.shape)}".encode(), digest_size=12)
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _canonical(obj: Any) -> str:
    """A stable text of a (nested) state: tensors by hash, dicts by sorted key, functions by name."""
    import torch

    if isinstance(obj, torch.Tensor):
        return _digest(obj) if obj.dim() else repr(obj.item())
    if isinstance(obj, np.ndarray):
        return hashlib.blake2b(obj.tobytes(), digest_size=12).hexdigest()
    if isinstance(obj, dict):
        return "{" + ",".join(f"{k!r}:{_canonical(v)}" for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))) + "}"
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(_canonical(v) for v in obj) + "]"
    if isinstance(obj, float):
        return repr(float(obj))
    if callable(obj):
        return getattr(obj, "__qualname__", type(obj).__name__)
    return repr(obj)


def _state_snapshot(job: Any) -> dict[str, dict[str, str]]:
    """(all ranks, collective) The job's state by component: key -> digest; rank 0's copy is the whole.

    Reads ``optimizer.state`` directly (``get_state_dict`` would initialise a fresh optimizer's state)."""
    import torch
    import torch.distributed as dist

    snap: dict[str, dict[str, str]] = {c: {} for c in COMPONENTS}
    for name, p in _param_names(job.model):
        snap["parameters"][name] = _digest(p)
        entry = job.optimizer.state.get(p, {})
        for key in sorted(entry):
            v = entry[key]
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                snap["optimizer moments"][f"{name}/{key}"] = _digest(v)
            else:
                snap["optimizer step"][f"{name}/{key}"] = _canonical(v)
    for i, group in enumerate(job.optimizer.param_groups):
        for key, v in group.items():
            if key != "params":
                snap["optimizer hyperparameters"][f"group{i}/{key}"] = _canonical(v)
    if job.scheduler is not None:
        for key, v in job.scheduler.state_dict().items():
            snap["scheduler"][key] = _canonical(v)
    local: dict[str, dict[str, str]] = {
        "rng": {"torch": _digest(torch.get_rng_state()), "python": _canonical(random.getstate()),
                "numpy": _canonical(np.random.get_state())},
        "data position": {"state": _canonical(job.data.state_dict())} if job.data is not None else {},
        "training step": {"step": str(job.step)},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        local["rng"]["cuda"] = _digest(torch.cuda.get_rng_state())
    gathered: list[Any] = [local]
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
    for r, loc in enumerate(gathered):
        for comp, entries in loc.items():
            for key, v in entries.items():
                snap[comp][f"rank{r}/{key}"] = v
    return snap


def _failed(stage: str, failure: Any, ctx: RankContext) -> _Failed:
    return _Failed(stage, failure, ctx.rank)


def _train_phase(ctx: RankContext, cfg: ResumeConfig, workdir: str, skip: tuple[int, ...]) -> Any:
    """(``nproc`` ranks) Train, save the reference and every candidate not in ``skip``, continue uninterrupted.

    Rank 0 returns ``{"traj", "export_failures"}``; a recipe failure is returned as a :class:`_Failed`."""
    import torch.distributed as dist

    from ckptaudit import exporters
    from ckptaudit.exporters import capture_and_export
    from ckptaudit.recipe import (
        RecipeError,
        checked_setup,
        checked_step,
        describe_function,
        load_object,
        load_recipe,
        user_failure,
    )

    try:
        recipe = load_recipe(cfg.recipe)
        job = checked_setup(recipe, ctx)
        for _ in range(cfg.save_at):
            checked_step(recipe, job)
        exporters.documented(job, os.path.join(workdir, cfg.reference_name), ctx)
    except RecipeError as exc:
        return _failed("recipe", exc.failure, ctx)
    export_failures: dict[int, Any] = {}
    marker = os.path.join(workdir, _MARKER)
    for i, spec in enumerate(cfg.exporters):
        if i in skip:
            continue
        if ctx.rank == 0:
            with open(marker, "w") as fh:
                fh.write(str(i))
        error = None
        exporter: Any = spec
        try:
            exporter = load_object(spec)
            capture_and_export(job, exporter, os.path.join(workdir, cfg.candidate_name(i)), ctx, recipe)
        except Exception as exc:  # noqa: BLE001 - the user's exporter: its failure is its candidate's finding
            where = describe_function(exporter) if callable(exporter) else spec
            error = user_failure(where, f"raised while exporting on rank {ctx.rank}", exc)
        errors: list[Any] = [error]
        if dist.is_initialized():
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            export_failures[i] = first
    if ctx.rank == 0 and os.path.exists(marker):
        os.remove(marker)
    try:
        traj = _run_steps(recipe, job, cfg.steps, _full_mode(job, cfg))
    except RecipeError as exc:
        return _failed("recipe", exc.failure, ctx)
    return {"traj": traj, "export_failures": export_failures} if ctx.rank == 0 else None


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
        for _, p in _param_names(job.model):
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

        from ckptaudit.formats.dcp import check_metadata_safe

        check_metadata_safe(path)
        keys = FileSystemReader(path).read_metadata().state_dict_metadata
        if any(k.startswith("model.") for k in keys) and any(k.startswith("optim.") for k in keys):
            exporters.documented_load(job, path, ctx)
            return
    load_weights(job, path, ctx)


def _resume_phase(ctx: RankContext, cfg: ResumeConfig, workdir: str, kind: str, which: int | None) -> Any:
    """(``resume_nproc`` ranks) One resumed run: ``kind`` is ``reference``, ``control`` or ``candidate``.

    Rank 0 returns ``{"fresh", "restored", "traj", "loader", "control"}``; a failure of user code is returned
    as a :class:`_Failed` (``recipe`` for the reference and the control; ``load`` or ``steps`` for a candidate).
    """
    from ckptaudit import exporters
    from ckptaudit.recipe import RecipeError, checked_setup, describe_function, load_object, load_recipe, user_failure

    try:
        recipe = load_recipe(cfg.recipe)
        job = checked_setup(recipe, ctx)
    except RecipeError as exc:
        return _failed("recipe", exc.failure, ctx)
    ref_path = os.path.join(workdir, cfg.reference_name)
    fresh = _state_snapshot(job)
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
    restored = _state_snapshot(job)
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
    from ckptaudit.formats.tensors import TensorData
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


# ----------------------------------------------------------------------------------------------------------------
# Comparison (pure)


@dataclass(frozen=True)
class Deviation:
    """One resumed run against the uninterrupted one, step by step (index 0: right after the restore)."""

    rel_l2: list[float]
    max_abs: list[float]
    loss_diff: list[float]
    """Per training step: resumed loss minus uninterrupted loss."""
    loss_rel: list[float]
    per_param: list[dict[str, float]]
    """Per step: parameter name -> relative L2 deviation."""


def compare_trajectories(base: Trajectory, other: Trajectory) -> Deviation:
    rel, mx, per = [], [], []
    for b_vals, o_vals, b_norms, o_norms in zip(base.params, other.params, base.norms, other.norms, strict=True):
        if base.full and other.full:
            num = den = 0.0
            worst = 0.0
            pp: dict[str, float] = {}
            for name, b in b_vals.items():
                o = o_vals[name]
                d = (o.astype(np.float64) - b.astype(np.float64)).ravel()
                dn = float(np.dot(d, d))
                bn = float(np.dot(b.astype(np.float64).ravel(), b.astype(np.float64).ravel()))
                num += dn
                den += bn
                worst = max(worst, float(np.max(np.abs(d))) if d.size else 0.0)
                pp[name] = math.sqrt(dn) / math.sqrt(bn) if bn > 0 else math.sqrt(dn)
            rel.append(math.sqrt(num) / math.sqrt(den) if den > 0 else math.sqrt(num))
            mx.append(worst)
            per.append(pp)
        else:  # bounded summary: the norm difference is a lower bound of the deviation
            pp = {n: abs(o_norms[n] - b) / b if b > 0 else abs(o_norms[n]) for n, b in b_norms.items()}
            total_b = math.sqrt(sum(b * b for b in b_norms.values()))
            total_d = math.sqrt(sum((o_norms[n] - b) ** 2 for n, b in b_norms.items()))
            rel.append(total_d / total_b if total_b > 0 else total_d)
            mx.append(float("nan"))
            per.append(pp)
    loss_diff = [o - b for b, o in zip(base.losses, other.losses, strict=True)]
    loss_rel = [abs(d) / abs(b) if b else abs(d) for d, b in zip(loss_diff, base.losses, strict=True)]
    return Deviation(rel, mx, loss_diff, loss_rel, per)


def compare_states(reference: dict[str, dict[str, str]], fresh: dict[str, dict[str, str]],
                   candidate: dict[str, dict[str, str]]) -> dict[str, dict[str, Any]]:
    """Per component: ``restored`` (equal to the reference's restored state), ``not restored`` (every differing
    entry still holds the fresh job's value) or ``differs``, with the differing keys."""
    out: dict[str, dict[str, Any]] = {}
    for comp in COMPONENTS:
        r, f, c = reference.get(comp, {}), fresh.get(comp, {}), candidate.get(comp, {})
        diff = [k for k in sorted(set(r) | set(c)) if r.get(k) != c.get(k)]
        if not diff:
            status = "restored"
        elif all(c.get(k) == f.get(k) for k in diff):
            status = "not restored"
        else:
            status = "differs"
        out[comp] = {"status": status, "keys": diff}
    return out


def thresholds(floor: list[float], margin: float, min_rel: float) -> list[float]:
    """Per step: 0 right after the restore (no kernel noise yet: any difference counts), then
    ``max(margin x floor[k], min_rel)``."""
    return [0.0] + [max(margin * f, min_rel) for f in floor[1:]]


# ----------------------------------------------------------------------------------------------------------------
# Orchestration


def _launch(fn: Callable[..., Any], nproc: int, args: tuple[Any, ...], cfg: ResumeConfig
            ) -> tuple[Any, _Failed | None, str]:
    """(this process) One phase; returns (rank 0's result, the first rank's reported failure, crash text)."""
    try:
        results = launch(fn, nproc, args, timeout_s=cfg.timeout_s, **_FAST)
    except DistributedError as exc:
        reported = [v for _, v in sorted(exc.results.items()) if isinstance(v, _Failed)]
        if reported:
            return None, reported[0], ""
        return None, None, "\n".join(f"rank {f.rank}: {f.reason}:\n{f.detail.strip()}" for f in exc.failures)
    reported = [v for v in results if isinstance(v, _Failed)]
    if reported:
        return None, reported[0], ""
    return results[0], None, ""


def run_resume_test(cfg: ResumeConfig, *, log: Callable[[str], None] | None = None) -> Report:
    """Run the phases and judge every candidate.

    Raises :class:`ckptaudit.recipe.RecipeError` when the recipe fails (a usage error: its function, the rule
    it broke, its frames) and :class:`ResumeError` when a phase crashes outside user code. A candidate that
    cannot be written, restored or stepped becomes its own ``resume.candidate-failed``; the rest are judged.
    """
    from ckptaudit.recipe import RecipeError, UserFailure

    say = log or (lambda _msg: None)
    own = cfg.workdir is None
    workdir = cfg.workdir or tempfile.mkdtemp(prefix="ckptaudit-resume-")
    os.makedirs(workdir, exist_ok=True)
    m = cfg.resume_ranks
    try:
        skip: set[int] = set()
        crashed: dict[int, Any] = {}
        marker = os.path.join(workdir, _MARKER)
        while True:
            if os.path.exists(marker):
                os.remove(marker)
            say(f"train {cfg.save_at} steps on {cfg.nproc} rank(s), save the reference and "
                f"{len(cfg.exporters) - len(skip)} candidate(s), continue {cfg.steps} steps")
            out, failed, crash = _launch(_train_phase, cfg.nproc, (cfg, workdir, tuple(sorted(skip))), cfg)
            if out is not None:
                break
            if failed is not None:
                raise RecipeError(failed.failure)
            exporting = open(marker).read().strip() if os.path.exists(marker) else ""
            if not exporting.isdigit():
                raise ResumeError(f"the training phase failed outside the exporters:\n{crash}")
            i = int(exporting)
            crashed[i] = UserFailure(cfg.exporters[i], "crashed or hung while exporting (the training phase was "
                                     "run again without it)", crash.strip().splitlines()[-1] if crash else "",
                                     crash, crash)
            skip.add(i)
            say(f"exporter {cfg.exporters[i]} crashed the training phase; running it again without it")
        base: Trajectory = out["traj"]
        export_failures = {**out["export_failures"], **crashed}

        def resumed(kind: str, which: int | None) -> tuple[Any, _Failed | None, str]:
            return _launch(_resume_phase, m, (cfg, workdir, kind, which), cfg)

        say(f"restore the reference on {m} rank(s) in fresh processes and repeat the steps (the floor)")
        ref, failed, crash = resumed("reference", None)
        if ref is None:
            if failed is not None:
                raise RecipeError(failed.failure)
            raise ResumeError(f"the reference resume failed:\n{crash}")
        say("resume the positive control (the reference's masters rounded to the compute dtype)")
        control, failed, crash = resumed("control", None)
        if control is None:
            if failed is not None:
                raise RecipeError(failed.failure)
            raise ResumeError(f"the positive control failed:\n{crash}")
        candidates: list[tuple[int, Any, str, str]] = []
        for i, spec in enumerate(cfg.exporters):
            if i in export_failures:
                candidates.append((i, None, "export", export_failures[i].message(debug=cfg.debug)))
                continue
            say(f"restore candidate {spec} on {m} rank(s) in fresh processes and repeat the steps")
            run, failed, crash = resumed("candidate", i)
            if run is not None:
                candidates.append((i, run, "", ""))
            elif failed is not None:
                candidates.append((i, None, failed.stage, failed.failure.message(debug=cfg.debug)))
            else:
                candidates.append((i, None, "crash", crash))
        return _judge(cfg, workdir, base, ref, control, candidates)
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


_STAGE = {"export": "could not be written", "load": "could not be restored",
          "steps": "was restored, but the recipe's steps failed on it", "crash": "crashed its resume"}


def _judge(cfg: ResumeConfig, workdir: str, base: Trajectory, ref: dict[str, Any], control: dict[str, Any],
           candidates: list[tuple[int, Any, str, str]]) -> Report:
    findings: list[Finding] = []
    ref_dev = compare_trajectories(base, ref["traj"])
    floor = ref_dev.rel_l2
    thr = thresholds(floor, cfg.margin, cfg.min_rel)
    peak = max(floor)
    ranks = f"{cfg.nproc} rank(s)" + (f", resumed on {cfg.resume_ranks}" if cfg.resume_ranks != cfg.nproc else "")
    if floor[0] > 0:
        findings.append(finding(
            "resume.reference-not-reproducible", "reference",
            f"right after restoring the documented-path reference, its parameters differ from the saved run by rel. "
            f"L2 {floor[0]:.2e}: the documented restore itself is not exact, so no candidate can be judged",
            rel_l2=floor[0]))
    if peak > 0:
        findings.append(finding("resume.noise-floor", "reference",
                                f"the documented-path reference deviates by up to rel. L2 {peak:.2e} over the "
                                f"steps ({ranks}); a candidate drifts at step k above max({cfg.margin:g} x floor[k], "
                                f"{cfg.min_rel:.0e})", floor=floor))
    ctl_dev = compare_trajectories(base, control["traj"])
    power_steps = [k for k in range(1, len(thr)) if ctl_dev.rel_l2[k] > thr[k]]
    power = bool(power_steps) and floor[0] == 0
    if not power:
        findings.append(finding(
            "resume.no-power", "positive control",
            f"the positive control ({control['control']}) stays within the reference's floor after the restore "
            f"(max rel. L2 {max(ctl_dev.rel_l2[1:]):.2e} vs threshold up to {max(thr):.2e}): the steps of this "
            "recipe are too noisy to see a defect of that size, so no candidate is judged; make the recipe "
            "deterministic (seeded data and dropout, deterministic kernels) or take fewer steps",
            control_rel_l2=ctl_dev.rel_l2, threshold=thr))
    borrowed = ["optimizer moments", "optimizer step", "optimizer hyperparameters", "scheduler", "rng",
                "data position", "training step"] if cfg.borrow_state else []
    results: list[dict[str, Any]] = []
    rows: list[list[str]] = [
        ["reference (documented path)", "restored", _fmt(peak), f"{max(ref_dev.loss_rel, default=0.0):.2%}", "-",
         "bit-identical" if peak == 0 else "floor"],
        [f"positive control ({control['control']})", "parameters differ", _fmt(max(ctl_dev.rel_l2)),
         f"{max(ctl_dev.loss_rel, default=0.0):.2%}", str(power_steps[0]) if power_steps else "-",
         "stands out (power)" if power else "NO POWER"]]
    forensic_rows: list[list[str]] = []
    summaries = [f"reference resumes {'bit-identically' if peak == 0 else f'within {peak:.1e}'}"
                 + ("" if power else "; NO POWER: the positive control does not stand out from the floor, "
                    "so no candidate is judged")]
    for i, run, stage, error in candidates:
        spec = cfg.exporters[i]
        name = spec.rpartition(":")[2]
        if run is None:
            findings.append(finding("resume.candidate-failed", spec,
                                    f"{name}: the candidate {_STAGE.get(stage, 'failed')}: {error}", stage=stage))
            results.append({"exporter": spec, "verdict": "failed", "stage": stage, "error": error})
            rows.append([name, "-", "-", "-", "-", "FAILED"])
            summaries.append(f"{name}: FAILED ({stage})")
            continue
        dev = compare_trajectories(base, run["traj"])
        restore = compare_states(ref["restored"], run["fresh"], run["restored"])
        for comp in borrowed:
            if restore[comp]["status"] == "restored":
                restore[comp]["status"] = "borrowed"
        problems = [c for c in COMPONENTS if restore[c]["status"] in ("not restored", "differs")]
        for comp in problems:
            st = restore[comp]
            keys = ", ".join(st["keys"][:3]) + (f" and {len(st['keys']) - 3} more" if len(st["keys"]) > 3 else "")
            if st["status"] == "not restored":
                findings.append(finding(
                    "resume.not-restored", f"{spec}: {comp}",
                    f"{name}: the {comp} is not restored by {run['loader']}: right after loading it is still the "
                    f"fresh job's ({keys}); a real resume from this checkpoint would start with it; save and load "
                    f"the {comp} in the exporter", component=comp, keys=st["keys"]))
            else:
                findings.append(finding(
                    "resume.restored-differs", f"{spec}: {comp}",
                    f"{name}: {comp} restored by {run['loader']}, but not to the reference's values ({keys}), "
                    "before any step (no kernel noise yet)", component=comp, keys=st["keys"]))
        forensics, misattached = _forensics(workdir, cfg, i)
        for f in misattached:
            findings.append(finding("optimizer.misattached", f"{name}: {f.subject}", f"{name}: {f.message}",
                                    **f.evidence))
        # Without power nothing about the steps is judged; what differs right after the restore is reported
        # above as restored-state findings (they need no power).
        drifting = [k for k, r in enumerate(dev.rel_l2) if r > thr[k]] if power else []
        worst_step = int(np.argmax(dev.rel_l2))
        top = sorted(dev.per_param[worst_step].items(), key=lambda kv: -kv[1])[:5]
        max_loss_rel = max(dev.loss_rel, default=0.0)
        if not power:
            verdict = "not judged"
        elif drifting:
            verdict = "drift"
        elif problems:
            verdict = "incomplete"
        else:
            verdict = "faithful"
        if drifting:
            start = drifting[0]
            findings.append(finding(
                "resume.drift", spec,
                f"{name}: parameters deviate from the uninterrupted run by rel. L2 {dev.rel_l2[worst_step]:.2e} at "
                f"step {worst_step} (threshold {thr[worst_step]:.2e}, floor {floor[worst_step]:.1e}), from step "
                f"{start} on; most: {', '.join(f'{n} ({v:.1e})' for n, v in top[:3])}",
                start_step=start, max_rel_l2=max(dev.rel_l2), threshold=thr[worst_step],
                top_parameters=[n for n, _ in top]))
            if max_loss_rel < cfg.loss_threshold:
                findings.append(finding(
                    "resume.loss-looks-normal", spec,
                    f"{name}: the loss stays within {max_loss_rel:.2%} of the uninterrupted run over {cfg.steps} "
                    "steps while the parameters drift: a loss curve would not have shown it",
                    max_loss_rel=max_loss_rel))
        if borrowed:
            findings.append(finding(
                "resume.state-borrowed", spec,
                f"{name}: restored over the reference (--borrow-state): {', '.join(borrowed)} came from the "
                f"reference unless {run['loader']} overwrote them; this judges the parameters, not the whole "
                "checkpoint", borrowed=borrowed))
        results.append({
            "exporter": spec, "verdict": verdict, "drift_start": drifting[0] if drifting else None,
            "loader": run["loader"], "restore": restore, "borrowed": borrowed,
            "rel_l2": dev.rel_l2, "max_abs": dev.max_abs, "loss_diff": dev.loss_diff, "loss_rel": dev.loss_rel,
            "top_parameters": [{"name": n, "rel_l2": v} for n, v in top],
            "forensics": forensics,
        })
        state_text = ("restored" if not problems else
                      "; ".join(f"{c}: {restore[c]['status']}" for c in problems))
        rows.append([name, state_text, _fmt(max(dev.rel_l2)), f"{max_loss_rel:.2%}",
                     str(drifting[0]) if drifting else "-", verdict.upper() if verdict != "faithful" else verdict])
        forensic_rows.append([name, forensics])
        state_issues = ", ".join(f"{c} {'differ' if restore[c]['status'] == 'differs' else 'not restored'}"
                                 for c in problems)
        if verdict == "drift":
            summaries.append(f"{name}: DRIFT (rel. L2 {max(dev.rel_l2):.1e}, loss within {max_loss_rel:.2%})"
                             + (f"; {state_issues}" if problems else ""))
        elif verdict == "faithful":
            summaries.append(f"{name}: resumes faithfully")
        elif verdict == "incomplete":
            summaries.append(f"{name}: INCOMPLETE ({state_issues})")
        else:
            summaries.append(f"{name}: not judged" + (f" ({state_issues})" if problems else ""))
    findings.sort(key=lambda f: (-int(f.severity), f.code, f.subject))
    doc = {
        "config": {k: v for k, v in asdict(cfg).items() if k != "workdir"},
        "workdir": None if cfg.workdir is None else os.path.abspath(cfg.workdir),
        "nproc": cfg.nproc,
        "resume_nproc": cfg.resume_ranks,
        "noise_floor": peak,
        "floor": floor,
        "threshold": thr,
        "power": power,
        "borrowed": borrowed,
        "uninterrupted_loss": base.losses,
        "reference": {"rel_l2": ref_dev.rel_l2, "max_abs": ref_dev.max_abs, "loss_diff": ref_dev.loss_diff},
        "control": {"what": control["control"], "rel_l2": ctl_dev.rel_l2, "loss_diff": ctl_dev.loss_diff,
                    "stands_out_from_step": power_steps[0] if power_steps else None},
        "candidates": results,
        "recorded": "full" if base.full else "norms",
    }
    section = {"title": f"resume test: {cfg.steps} steps after step {cfg.save_at}, {ranks}"
                        + (" (state borrowed from the reference)" if borrowed else ""),
               "columns": ["run", "state right after restore", "max rel. L2 dev.", "max loss diff.",
                           "drift from step", "verdict"],
               "rows": rows}
    sections = [section]
    if forensic_rows:
        sections.append({"title": "offline comparison of each candidate with the reference (ckptaudit compare)",
                         "columns": ["candidate", "summary"], "rows": forensic_rows})
    path = cfg.recipe
    return Report(command="resume-test", path=path, format="resume-test", findings=tuple(findings),
                  summary="; ".join(summaries), extra={"resume": doc, "sections": sections})


def _forensics(workdir: str, cfg: ResumeConfig, i: int) -> tuple[str, list[Finding]]:
    """The offline comparison of a candidate with the reference: its summary, and its misattached moments
    (the comparison names swapped parameters exactly; the trajectory only shows where drift is largest)."""
    from ckptaudit.compare import compare

    path = os.path.join(workdir, cfg.candidate_name(i))
    if not os.path.exists(path):
        return "candidate not found on disk", []
    try:
        report = compare(os.path.join(workdir, cfg.reference_name), path)
    except Exception as exc:  # noqa: BLE001 - forensics are a bonus; the trajectory verdict stands alone
        return f"not compared ({exc})", []
    return report.summary, [f for f in report.findings if f.code == "optimizer.misattached"]


def _fmt(x: float) -> str:
    if x != x:
        return "n/a"
    return "0" if x == 0 else f"{x:.2e}"

