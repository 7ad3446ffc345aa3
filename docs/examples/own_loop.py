"""A guard in your own training loop, with your own exporter (docs/integrations/own-loop.md).

A plain PyTorch loop (no Trainer, no Lightning) that saves with its own function, ``export``, every
``--save-every`` steps; a :class:`ckptaudit.integrations.guard.Guard` audits each checkpoint in the background
as it is saved, quarantines one that fails, and stops training at the next step with ``on_failure="stop"``.
``--bad-from N`` makes the exporter save the weights through a bfloat16 copy from step N on (the silent defect),
to see it caught. From the repository root::

    .venv/bin/python docs/examples/own_loop.py --out own-loop-run
    .venv/bin/python docs/examples/own_loop.py --out own-loop-bad --bad-from 4

The first trains 8 steps and leaves ``step-2.pt`` ... ``step-8.pt``, each with its report beside it
(``step-2.pt.ckptaudit.json``); the second stops at the first step boundary after step 4's verdict (it saves
nothing more): ``step-4.pt.quarantined`` and its report, exit code 1, and ``step-2.pt`` is the newest good one.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import torch

from ckptaudit.integrations.guard import CheckpointAuditFailed, Guard
from ckptaudit.integrations.live_contract import declare_live_contract


def export(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, step: int, path: str,
           *, bad: bool = False) -> None:
    """Your exporter: whatever your run saves, written completely before it returns (here one torch.save file).
    ``bad``: the defect, the weights saved through a bf16 copy (as a compute copy would be)."""
    weights = model.state_dict()
    if bad:
        weights = {k: v.to(torch.bfloat16).float() for k, v in weights.items()}
    torch.save({"model": weights, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "step": step}, path)


def train(out: str, *, steps: int = 8, save_every: int = 2, bad_from: int | None = None) -> Guard:
    """Train ``steps`` steps, save and audit every ``save_every``; returns the guard (its verdicts)."""
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4)
    # One guard for the run: its worker starts now, off the training thread. "stop": a failing checkpoint stops
    # training at the next step boundary (should_stop), and finish() raises CheckpointAuditFailed at the end.
    guard = Guard(on_failure="stop", require=["scheduler"])
    declare_live_contract(guard, optimizer)  # the masters are what the optimizer steps: float32 here
    try:
        for step in range(1, steps + 1):
            x = torch.randn(16, 32)
            loss = torch.nn.functional.cross_entropy(model(x), x[:, :4].argmax(dim=1))
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if step % save_every == 0:
                path = os.path.join(out, f"step-{step}.pt")
                guard.before_save(step)  # waits only when max_unverified saves still wait for a verdict
                if guard.should_stop():  # the verdict it waited for failed: save nothing more
                    break
                export(model, optimizer, scheduler, step, path, bad=bad_from is not None and step >= bad_from)
                guard.submit(path, step=step)  # returns at once: the audit runs in the background
            if guard.should_stop():  # a checkpoint failed its audit: stop at this step boundary
                break
    finally:
        guard.finish(timeout=600)  # waits for the audits; raises CheckpointAuditFailed if one failed
    return guard


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for the checkpoints and their reports")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--bad-from", type=int, help="save the weights through a bf16 copy from this step on")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        guard = train(args.out, steps=args.steps, save_every=args.save_every, bad_from=args.bad_from)
    except CheckpointAuditFailed as exc:
        print(exc, file=sys.stderr)
        return 1
    for v in guard.verdicts:
        print(f"{v.checkpoint}: {'passed' if v.ok else 'not judged' if v.ok is None else 'FAILED'}: {v.summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
