"""(this process) The experiment's driver: launches each phase in fresh processes, isolates failing exporters,
and hands the trajectories to :func:`ckptaudit.resume.judge._judge`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from ckptaudit.dist.launch import DistributedError, fast, launch
from ckptaudit.model import Report
from ckptaudit.resume.config import _MARKER, ResumeConfig, ResumeError, Trajectory, _Failed
from ckptaudit.resume.judge import _judge
from ckptaudit.resume.phases import _resume_phase, _train_phase

_FAST = fast()  # ranks forked from a server that imported torch once: fresh processes, fast start


def _launch(fn: Callable[..., Any], nproc: int, args: tuple[Any, ...], cfg: ResumeConfig
            ) -> tuple[Any, _Failed | None, str]:
    """(this process) One phase; returns (rank 0's result, the first rank's reported failure, crash text)."""
    try:
        results = launch(fn, nproc, args, timeout_s=cfg.timeout_s, **_FAST)
    except DistributedError as exc:
        reported = [v for _, v in sorted(exc.results.items()) if isinstance(v, _Failed)]
        if reported:
            return None, reported[0], ""
        # Each rank's stderr tail (why a rank killed by a signal died) before its detail, whose last line stays
        # the crash text's last line: the one-line summary of a crashed exporter.
        return None, None, "\n".join(
            f"rank {f.rank}: {f.reason}:"
            + (f"\nlast lines of rank {f.rank}'s stderr:\n{f.stderr.rstrip()}" if f.stderr.strip() else "")
            + f"\n{f.detail.strip()}" for f in exc.failures)
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
