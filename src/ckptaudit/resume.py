"""The differential resume test: does a checkpoint resume the original trajectory?

Three phases, each a fresh set of real processes (:func:`ckptaudit.dist.launch.launch`):

1. **train** (all ranks): build the recipe's job, train ``save_at`` steps; save the reference through the
   documented path (:func:`ckptaudit.exporters.documented`: ``get_state_dict`` + DCP, with scheduler, RNG and
   data position) and each candidate through its exporter; then continue ``steps`` steps uninterrupted,
   recording the loss and the parameters (rank 0 keeps them) after every step.
2. **reference resume** (all ranks, fresh processes): build the job, restore the reference, run the same steps.
   Its deviation from the uninterrupted run is the *noise floor* (zero on deterministic CPU kernels).
3. **candidate resume** (all ranks, fresh processes, once per candidate): restore the reference, then the
   candidate over it: the exporter's own loader (``exporter.load``) when it has one, else the candidate's model
   weights only. So the candidate is judged with the reference's optimizer, scheduler, RNG and data state
   unless its exporter provides them. Run the same steps.

The verdict compares each candidate's deviation with the floor: ``resume.drift`` when the relative L2
deviation of the parameters exceeds ``max(margin x floor, min_rel)`` at any step (defaults: 10 x floor, and
1e-6, about eight fp32 ulps), naming the parameters that drift most and the step where it starts.
``resume.loss-looks-normal`` when, meanwhile, the loss stays within ``loss_threshold`` (relative) of the
uninterrupted run: the trap this test exists to reveal.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ckptaudit.catalogue import finding
from ckptaudit.dist.launch import RankContext, fast, launch
from ckptaudit.model import Finding, Report

__all__ = ["ResumeConfig", "Trajectory", "compare_trajectories", "load_weights", "run_resume_test"]

DEFAULT_RECIPE = "ckptaudit.recipes.tinygpt:recipe"

_FAST = fast()  # ranks forked from a server that imported torch once: fresh processes, fast start



@dataclass(frozen=True, kw_only=True, slots=True)
class ResumeConfig:
    recipe: str = DEFAULT_RECIPE
    """``module:attr`` or ``path.py:attr`` of a :class:`ckptaudit.recipe.Recipe`."""
    exporters: tuple[str, ...] = ("ckptaudit.exporters:compute_copy",)
    """The exporters under test, ``module:attr`` each."""
    nproc: int = 2
    save_at: int = 8
    """Training steps before the checkpoint."""
    steps: int = 8
    """Steps taken after resuming (and by the uninterrupted run)."""
    margin: float = 10.0
    """A candidate drifts when its deviation exceeds ``margin`` x the reference's (the noise floor) ..."""
    min_rel: float = 1e-6
    """... and this relative L2 deviation (about eight fp32 ulps), whichever is larger."""
    loss_threshold: float = 0.01
    """Relative loss difference under which the loss "looks normal"."""
    full_values_limit: int = 4_000_000
    """Parameters with at most this many elements in all are recorded in full at every step; larger models
    are recorded as per-parameter norms and hashes (deviation is then estimated from the norms)."""
    timeout_s: float = 600.0
    workdir: str | None = None
    """Where checkpoints are written; a temporary directory (removed afterwards) when ``None``."""
    reference_name: str = "reference"
    candidate_names: tuple[str, ...] = ()
    """File names for the candidates inside ``workdir`` (default: derived from the exporter names)."""

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"nproc must be at least 1, got {self.nproc}")
        if self.save_at < 1 or self.steps < 1:
            raise ValueError(f"save_at and steps must be at least 1 (got {self.save_at} and {self.steps}): the "
                             "optimizer needs state before the checkpoint and the test needs steps after it")
        if not self.exporters:
            raise ValueError("name at least one exporter to test (module:attr)")
        if self.candidate_names and len(self.candidate_names) != len(self.exporters):
            raise ValueError("candidate_names must name every exporter")

    def candidate_name(self, i: int) -> str:
        if self.candidate_names:
            return self.candidate_names[i]
        attr = self.exporters[i].rpartition(":")[2]
        return f"candidate-{i}-{re.sub(r'[^A-Za-z0-9_.-]', '_', attr)}"


@dataclass
class Trajectory:
    """What rank 0 recorded: loss per step and parameters after the restore (index 0) and after each step."""

    losses: list[float] = field(default_factory=list)
    params: list[dict[str, np.ndarray]] = field(default_factory=list)
    norms: list[dict[str, float]] = field(default_factory=list)
    full: bool = True


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
    import torch
    import torch.distributed as dist

    traj = Trajectory(full=full)
    values, norms = _snapshot(job, full)
    traj.params.append(values)
    traj.norms.append(norms)
    for _ in range(steps):
        loss = torch.tensor([recipe.step(job)], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        traj.losses.append(float(loss))
        values, norms = _snapshot(job, full)
        traj.params.append(values)
        traj.norms.append(norms)
    return traj


def _full_mode(job: Any, cfg: ResumeConfig) -> bool:
    total = 0
    for _, p in _param_names(job.model):
        total += p.numel()
    return total <= cfg.full_values_limit


def _train_phase(ctx: RankContext, cfg: ResumeConfig, workdir: str) -> Trajectory | None:
    from ckptaudit import exporters
    from ckptaudit.exporters import capture_and_export
    from ckptaudit.recipe import load_object, load_recipe

    recipe = load_recipe(cfg.recipe)
    job = recipe.setup(ctx)
    for _ in range(cfg.save_at):
        recipe.step(job)
    exporters.documented(job, os.path.join(workdir, cfg.reference_name), ctx)
    for i, spec in enumerate(cfg.exporters):
        capture_and_export(job, load_object(spec), os.path.join(workdir, cfg.candidate_name(i)), ctx, recipe)
    traj = _run_steps(recipe, job, cfg.steps, _full_mode(job, cfg))
    return traj if ctx.rank == 0 else None


def _resume_phase(ctx: RankContext, cfg: ResumeConfig, workdir: str, which: int | None) -> Trajectory | None:
    from ckptaudit import exporters
    from ckptaudit.recipe import load_object, load_recipe

    recipe = load_recipe(cfg.recipe)
    job = recipe.setup(ctx)
    exporters.documented_load(job, os.path.join(workdir, cfg.reference_name), ctx)
    if which is not None:
        exporter = load_object(cfg.exporters[which])
        loader: Callable[..., None] = getattr(exporter, "load", None) or load_weights
        loader(job, os.path.join(workdir, cfg.candidate_name(which)), ctx)
    traj = _run_steps(recipe, job, cfg.steps, _full_mode(job, cfg))
    return traj if ctx.rank == 0 else None


def load_weights(job: Any, path: str, ctx: Any = None) -> None:
    """(all ranks) The default candidate loader: the model weights found in ``path`` (any format the audit
    reads), loaded into the live model, cast to its dtype as any loader would. Everything else stays as restored
    from the reference.
    """
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


# ----------------------------------------------------------------------------------------------------------------
# Orchestration


def run_resume_test(cfg: ResumeConfig, *, log: Callable[[str], None] | None = None) -> Report:
    """Run the three phases and judge every candidate. Raises ``DistributedError`` when the training phase fails
    (a recipe that cannot train); a candidate that cannot be written or restored becomes a finding."""
    from ckptaudit.dist.launch import DistributedError

    say = log or (lambda _msg: None)
    own = cfg.workdir is None
    workdir = cfg.workdir or tempfile.mkdtemp(prefix="ckptaudit-resume-")
    os.makedirs(workdir, exist_ok=True)
    try:
        say(f"train {cfg.save_at} steps, save reference and {len(cfg.exporters)} candidate(s), "
            f"continue {cfg.steps} steps ({cfg.nproc} ranks)")
        base = launch(_train_phase, cfg.nproc, (cfg, workdir), timeout_s=cfg.timeout_s, **_FAST)[0]
        say("restore the reference in fresh processes and repeat the steps")
        ref = launch(_resume_phase, cfg.nproc, (cfg, workdir, None), timeout_s=cfg.timeout_s, **_FAST)[0]
        candidates: list[tuple[str, Trajectory | None, str]] = []
        for i, spec in enumerate(cfg.exporters):
            say(f"restore candidate {spec} in fresh processes and repeat the steps")
            try:
                traj = launch(_resume_phase, cfg.nproc, (cfg, workdir, i), timeout_s=cfg.timeout_s, **_FAST)[0]
                candidates.append((spec, traj, ""))
            except DistributedError as exc:
                candidates.append((spec, None, str(exc)))
        return _judge(cfg, workdir, base, ref, candidates)
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


def _judge(cfg: ResumeConfig, workdir: str, base: Trajectory, ref: Trajectory,
           candidates: list[tuple[str, Trajectory | None, str]]) -> Report:
    findings: list[Finding] = []
    ref_dev = compare_trajectories(base, ref)
    floor = max(ref_dev.rel_l2)
    threshold = max(cfg.margin * floor, cfg.min_rel)
    if floor > 0:
        findings.append(finding("resume.noise-floor", "reference",
                                f"the documented-path reference deviates by rel. L2 {floor:.2e} (kernel "
                                f"nondeterminism); candidates drift when above {threshold:.2e}", floor=floor))
    if floor > threshold or max(ref_dev.loss_rel, default=0.0) > cfg.loss_threshold:
        findings.append(finding(
            "resume.reference-not-reproducible", "reference",
            f"resuming from the documented-path reference deviates by rel. L2 {floor:.2e} and loss by "
            f"{max(ref_dev.loss_rel):.2%}: the recipe is not deterministic or its state is not all saved "
            "(scheduler, RNG, data position); fix the recipe before judging candidates"))
    results: list[dict[str, Any]] = []
    rows: list[list[str]] = [["reference (documented path)", _fmt(floor), _fmt(max(ref_dev.max_abs)),
                              f"{max(ref_dev.loss_rel, default=0.0):.2%}", "-",
                              "bit-identical" if floor == 0 else "noise floor"]]
    forensic_rows: list[list[str]] = []
    summaries = [f"reference resumes {'bit-identically' if floor == 0 else f'within {floor:.1e}'}"]
    for spec, traj, error in candidates:
        name = spec.rpartition(":")[2]
        if traj is None:
            findings.append(finding("resume.candidate-failed", spec,
                                    f"candidate {spec} could not be restored: {error}"))
            results.append({"exporter": spec, "verdict": "failed", "error": error})
            rows.append([name, "-", "-", "-", "-", "FAILED"])
            summaries.append(f"{name}: FAILED to restore")
            continue
        dev = compare_trajectories(base, traj)
        forensics, misattached = _forensics(workdir, cfg, spec)
        for f in misattached:
            findings.append(finding("optimizer.misattached", f"{name}: {f.subject}", f"{name}: {f.message}",
                                    **f.evidence))
        drifting = [k for k, r in enumerate(dev.rel_l2) if r > threshold]
        worst_step = int(np.argmax(dev.rel_l2))
        top = sorted(dev.per_param[worst_step].items(), key=lambda kv: -kv[1])[:5]
        max_loss_rel = max(dev.loss_rel, default=0.0)
        verdict = "drift" if drifting else "faithful"
        if drifting:
            start = drifting[0]
            findings.append(finding(
                "resume.drift", spec,
                f"{name}: parameters deviate from the uninterrupted run by rel. L2 {dev.rel_l2[worst_step]:.2e} at "
                f"step {worst_step} (threshold {threshold:.2e}, noise floor {floor:.1e}), from step {start} on; "
                f"most: {', '.join(f'{n} ({v:.1e})' for n, v in top[:3])}",
                start_step=start, max_rel_l2=max(dev.rel_l2), threshold=threshold,
                top_parameters=[n for n, _ in top]))
            if max_loss_rel < cfg.loss_threshold:
                findings.append(finding(
                    "resume.loss-looks-normal", spec,
                    f"{name}: the loss stays within {max_loss_rel:.2%} of the uninterrupted run over {cfg.steps} "
                    "steps while the parameters drift: a loss curve would not have shown it",
                    max_loss_rel=max_loss_rel))
        results.append({
            "exporter": spec, "verdict": verdict, "drift_start": drifting[0] if drifting else None,
            "rel_l2": dev.rel_l2, "max_abs": dev.max_abs, "loss_diff": dev.loss_diff, "loss_rel": dev.loss_rel,
            "top_parameters": [{"name": n, "rel_l2": v} for n, v in top],
            "forensics": forensics,
        })
        rows.append([name, _fmt(max(dev.rel_l2)), _fmt(max(dev.max_abs)), f"{max_loss_rel:.2%}",
                     str(drifting[0]) if drifting else "-", "DRIFT" if drifting else "faithful"])
        forensic_rows.append([name, forensics])
        summaries.append(f"{name}: DRIFT (rel. L2 {max(dev.rel_l2):.1e}, loss within {max_loss_rel:.2%})"
                         if drifting else f"{name}: resumes faithfully")
    findings.sort(key=lambda f: (-int(f.severity), f.code, f.subject))
    doc = {
        "config": {k: v for k, v in asdict(cfg).items() if k != "workdir"},
        "noise_floor": floor,
        "threshold": threshold,
        "uninterrupted_loss": base.losses,
        "reference": {"rel_l2": ref_dev.rel_l2, "max_abs": ref_dev.max_abs, "loss_diff": ref_dev.loss_diff},
        "candidates": results,
        "recorded": "full" if base.full else "norms",
    }
    section = {"title": f"resume test: {cfg.steps} steps after step {cfg.save_at}, {cfg.nproc} ranks",
               "columns": ["run", "max rel. L2 dev.", "max |dev.|", "max loss diff.", "drift from step", "verdict"],
               "rows": rows}
    sections = [section]
    if forensic_rows:
        sections.append({"title": "offline comparison of each candidate with the reference (ckptaudit compare)",
                         "columns": ["candidate", "summary"], "rows": forensic_rows})
    return Report(command="resume-test", path=workdir, format=cfg.recipe, findings=tuple(findings),
                  summary="; ".join(summaries), extra={"resume": doc, "sections": sections})


def _forensics(workdir: str, cfg: ResumeConfig, spec: str) -> tuple[str, list[Finding]]:
    """The offline comparison of a candidate with the reference: its summary, and its misattached moments
    (the comparison names swapped parameters exactly; the trajectory only shows where drift is largest)."""
    from ckptaudit.compare import compare

    i = cfg.exporters.index(spec)
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
