"""``ckptaudit demo``: the whole story on the built-in recipe, on CPU, with several real ranks.

1. (2 ranks) train the tiny GPT under FSDP2 with a bf16 ``MixedPrecisionPolicy`` for a few steps;
2. (all ranks) save a faithful checkpoint through the documented path (``get_state_dict`` + DCP);
3. (all ranks) save a lossy one through a custom exporter that captured the bf16 compute copies in forward;
4. (this process) audit both and print the verdicts; write the reports under the output directory.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from ckptaudit.dist.launch import RankContext, launch
from ckptaudit.model import Severity

__all__ = ["DemoResult", "capture_and_export", "run_demo"]


def capture_and_export(job: Any, exporter: Callable[..., None], path: str, ctx: Any, recipe: Any) -> None:
    """(all ranks) Run ``exporter``; if it has ``prepare``, first arm it and run one forward in eval mode.

    The capture forward runs in eval mode on the recipe's held-out batch, so it takes no RNG draws and does
    not disturb the training state.
    """
    prepare = getattr(exporter, "prepare", None)
    if prepare is None:
        exporter(job, path, ctx)
        return
    capture = prepare(job)
    was_training = job.model.training
    job.model.eval()
    try:
        with torch.no_grad():
            batch = recipe.eval_batch(job)
            device = next(job.model.parameters()).device
            job.model(batch[:2, :-1].to(device))
    finally:
        job.model.train(was_training)
        capture.armed = False
        remove = getattr(capture, "remove", None)
        if remove is not None:
            remove()
    exporter(job, path, ctx, capture=capture)


def _train_and_save(ctx: RankContext, out_dir: str, steps: int) -> list[float]:
    from ckptaudit import exporters
    from ckptaudit.recipes.tinygpt import recipe

    job = recipe.setup(ctx)
    losses = [recipe.step(job) for _ in range(steps)]
    exporters.documented(job, os.path.join(out_dir, "faithful"), ctx)
    capture_and_export(job, exporters.compute_copy, os.path.join(out_dir, "lossy-compute-copy.pt"), ctx, recipe)
    return losses


@dataclass(frozen=True)
class DemoResult:
    out_dir: str
    exit_code: int


def run_demo(out_dir: str, *, nproc: int = 2, steps: int = 8, out: TextIO = sys.stdout,
             err: TextIO = sys.stderr) -> DemoResult:
    """Run the demo, print the verdicts to ``out``; progress goes to ``err``."""
    from ckptaudit.audit import audit
    from ckptaudit.report import OutputFormat, render

    os.makedirs(out_dir, exist_ok=True)
    t0 = time.monotonic()
    err.write(f"[1/2] training the tiny GPT for {steps} steps on {nproc} ranks (FSDP2, bf16 compute, gloo)...\n")
    losses = launch(_train_and_save, nproc, (out_dir, steps), timeout_s=300)[0]
    err.write(f"      loss {losses[0]:.3f} -> {losses[-1]:.3f}; saved both checkpoints "
              f"({time.monotonic() - t0:.1f} s)\n")
    err.write("[2/2] auditing both checkpoints...\n")
    verdicts: dict[str, bool] = {}
    for name, label in (("faithful", "documented path: get_state_dict + torch.distributed.checkpoint"),
                        ("lossy-compute-copy.pt", "custom exporter: bf16 compute copies upcast to fp32")):
        report = audit(os.path.join(out_dir, name))
        out.write(f"\n=== {name}  ({label})\n")
        render(report, OutputFormat.TABLE, out)
        with open(os.path.join(out_dir, f"audit-{name.split('.')[0]}.json"), "w") as fh:
            render(report, OutputFormat.JSON, fh)
        verdicts[name] = report.fails(Severity.ERROR)
    out.write(f"\nreports written to {out_dir} ({time.monotonic() - t0:.1f} s in all)\n")
    # The story holds when the faithful checkpoint is clean and the lossy one is caught.
    as_expected = not verdicts["faithful"] and verdicts["lossy-compute-copy.pt"]
    return DemoResult(out_dir, 0 if as_expected else 1)
