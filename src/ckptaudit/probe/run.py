"""``ckptaudit probe``: run the live probe on a recipe and an exporter, on several real ranks.

Order of events (all ranks, each step collective where it says so):

1. build the recipe's job and attach a :class:`~ckptaudit.probe.live.Probe` (installs nothing);
2. train ``steps`` steps, unarmed;
3. arm the probe and run one forward in eval mode under ``no_grad`` on the recipe's held-out batch (no RNG
   draw, no update): point 2;
4. (collective) record the masters: point 1; nothing has changed them since step 3;
5. (collective) save through the exporter (``ckptaudit.exporters.capture_and_export``, which also runs the
   exporter's own capture forward if it has ``prepare``);
6. (collective) read what it saved, each rank its own regions: point 3;
7. (rank 0) return the gathered records; the calling process judges them into a Report.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from ckptaudit.findings import RawReport
from ckptaudit.launch import RankContext, fast, launch
from ckptaudit.probe.points import ProbeResult

__all__ = ["DEFAULT_EXPORTER", "DEFAULT_RECIPE", "probe_job", "run_probe"]

DEFAULT_RECIPE = "ckptaudit.recipes.tinygpt:recipe"
DEFAULT_EXPORTER = "ckptaudit.exporters:documented"


def armed_eval_forward(probe: Any, job: Any, recipe: Any) -> None:
    """(all ranks) One forward with the probe armed, in eval mode, without gradients, on the held-out batch
    (:func:`ckptaudit.recipes.eval_forward`: the recipe's ``eval_batch`` through its ``forward``, any model).

    Falls back to one training step when the recipe has no ``eval_batch``; the compute copies then predate that
    step's update, which the report flags as ``probe.compute-not-master``.
    """
    from ckptaudit.recipes import eval_forward

    if not hasattr(recipe, "eval_batch"):
        probe.arm()
        try:
            recipe.step(job)
        finally:
            probe.disarm()
        return
    with probe.armed_forward():
        eval_forward(recipe, job)


def prepared_probe(recipe: Any, ctx: RankContext, steps: int) -> tuple[Any, Any]:
    """(all ranks) Set up the recipe's job with a probe attached, train ``steps`` steps, then record point 2
    (an armed forward in eval mode) and point 1 (the masters). Returns ``(job, probe)``."""
    from ckptaudit.probe.live import Probe

    job = recipe.setup(ctx)
    probe = Probe(job.model)
    for _ in range(steps):
        recipe.step(job)
    armed_eval_forward(probe, job, recipe)
    probe.record_masters()
    return job, probe


def probe_job(ctx: RankContext, recipe_spec: str, exporter_spec: str, steps: int, path: str) -> ProbeResult | None:
    """(all ranks) Steps 1-7 of the module docstring; rank 0 returns the result, the others ``None``."""
    from ckptaudit.exporters import capture_and_export
    from ckptaudit.recipes import load_object, load_recipe

    recipe = load_recipe(recipe_spec)
    exporter = load_object(exporter_spec)
    job, probe = prepared_probe(recipe, ctx, steps)
    capture_and_export(job, exporter, path, ctx, recipe)
    probe.record_saved(path)
    return probe.result(recipe=recipe_spec, exporter=exporter_spec, steps=steps, world_size=ctx.world_size)


def run_probe(recipe: str = DEFAULT_RECIPE, exporter: str = DEFAULT_EXPORTER, *, nproc: int = 2, steps: int = 4,
              out_dir: str | None = None, timeout_s: float = 300.0) -> RawReport:
    """Run :func:`probe_job` on ``nproc`` ranks and judge it. The checkpoint goes to ``out_dir/checkpoint``
    (kept), or to a temporary directory (removed).

    Raises ``ValueError`` for a recipe or exporter that cannot be loaded (checked here, before any process
    starts) and :class:`~ckptaudit.launch.DistributedError` when a rank fails.
    """
    from ckptaudit.probe.verdict import judge_probe
    from ckptaudit.recipes import load_object, load_recipe

    load_recipe(recipe)
    if not callable(load_object(exporter)):
        raise ValueError(f"{exporter!r} is not an exporter: it must be a function export(job, path, ctx)")
    own = out_dir is None
    base = tempfile.mkdtemp(prefix="ckptaudit-probe-") if out_dir is None else out_dir
    try:
        os.makedirs(base, exist_ok=True)
        path = os.path.join(os.path.abspath(base), "checkpoint")
        result = launch(probe_job, nproc, (recipe, exporter, steps, path), timeout_s=timeout_s,
                        **fast("ckptaudit.probe.run"))[0]
        report = judge_probe(result)
        if own:
            # The checkpoint is gone after this call; do not point the reader at it.
            report = _relabel(report, f"{exporter} (a temporary checkpoint; --out keeps it)")
        return report
    finally:
        if own:
            shutil.rmtree(base, ignore_errors=True)


def _relabel(report: RawReport, path: str) -> RawReport:
    from dataclasses import replace

    return replace(report, path=path)
