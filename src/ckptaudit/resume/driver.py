"""(this process) The experiment's driver: launches each phase in fresh processes, isolates failing exporters,
and hands the trajectories to :func:`ckptaudit.resume.judge.judge_resume`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from ckptaudit.findings import RawReport
from ckptaudit.launch import DistributedError, fast, launch
from ckptaudit.resume.config import PhaseFailed, ResumeConfig, ResumeError
from ckptaudit.resume.judge import judge_resume
from ckptaudit.resume.phases import export_phase, resume_phase, train_phase

_FAST = fast()  # ranks forked from a server that imported torch once: fresh processes, fast start


def _launch(fn: Callable[..., Any], nproc: int, args: tuple[Any, ...], timeout_s: float
            ) -> tuple[Any, PhaseFailed | None, list[Any]]:
    """(this process) One phase; returns (rank 0's result, the first rank's reported failure, the ranks'
    crashes: :class:`~ckptaudit.launch.RankFailure` records)."""
    try:
        results = launch(fn, nproc, args, timeout_s=timeout_s, **_FAST)
    except DistributedError as exc:
        reported = [v for _, v in sorted(exc.results.items()) if isinstance(v, PhaseFailed)]
        if reported:
            return None, reported[0], []
        return None, None, list(exc.failures)
    reported = [v for v in results if isinstance(v, PhaseFailed)]
    if reported:
        return None, reported[0], []
    return results[0], None, []


def _crash_text(failures: list[Any]) -> str:
    # Each rank's stderr tail (why a rank killed by a signal died) before its detail, whose last line stays
    # the crash text's last line: the one-line summary of a crashed exporter.
    return "\n".join(
        f"rank {f.rank}: {f.reason}:"
        + (f"\nlast lines of rank {f.rank}'s stderr:\n{f.stderr.rstrip()}" if f.stderr.strip() else "")
        + f"\n{f.detail.strip()}" for f in failures)


def _export_crash(spec: str, failures: list[Any], timeout_s: float) -> Any:
    """The :class:`~ckptaudit.recipes.UserFailure` of an exporter whose processes died or hung."""
    from ckptaudit.recipes import UserFailure

    detail = _crash_text(failures)
    if any(f.reason == "timeout" for f in failures):
        rule = "hung while exporting (its processes were killed; nothing else waited on them)"
        error = f"no result within {timeout_s:.0f} s (--export-timeout, else --timeout)"
        return UserFailure(spec, rule, error, "", detail)
    rule = "crashed while exporting (its processes died; nothing else ran in them)"
    lasts = [f.detail.strip().splitlines() for f in failures]
    error = "; ".join(f"rank {f.rank}: {lines[-1]}" for f, lines in zip(failures, lasts, strict=True) if lines)
    more = "\n".join(f"rank {f.rank}:\n" + "\n".join(lines[:-1])
                     for f, lines in zip(failures, lasts, strict=True) if len(lines) > 1)
    return UserFailure(spec, rule, error, more, detail)


def run_resume_test(cfg: ResumeConfig, *, log: Callable[[str], None] | None = None) -> RawReport:
    """Run the phases and judge every candidate.

    Phases, each a fresh set of processes: train (the recipe and the documented save only), the reference's
    resume, the positive control's; then per candidate an export phase (the reference restored, the exporter
    run on it) and, when that wrote something, the candidate's resume. No phase runs two users' functions
    that could spoil each other.

    Raises :class:`ckptaudit.recipes.RecipeError` when the recipe fails (a usage error: its function, the rule
    it broke, its frames) and :class:`ResumeError` when a phase crashes outside user code. A candidate that
    cannot be written, restored or stepped becomes its own ``resume.candidate-failed``; the rest are judged.
    """
    from ckptaudit.recipes import RecipeError

    say = log or (lambda _msg: None)
    own = cfg.workdir is None
    workdir = cfg.workdir or tempfile.mkdtemp(prefix="ckptaudit-resume-")
    os.makedirs(workdir, exist_ok=True)
    m = cfg.resume_ranks
    try:
        say(f"train {cfg.save_at} steps on {cfg.nproc} rank(s), save the reference, continue {cfg.steps} steps")
        out, failed, crash = _launch(train_phase, cfg.nproc, (cfg, workdir), cfg.timeout_s)
        if out is None:
            if failed is not None:
                raise RecipeError(failed.failure)
            raise ResumeError(f"the training phase failed:\n{_crash_text(crash)}")

        def resumed(kind: str, which: int | None) -> tuple[Any, PhaseFailed | None, list[Any]]:
            return _launch(resume_phase, m, (cfg, workdir, kind, which), cfg.timeout_s)

        say(f"restore the reference on {m} rank(s) in fresh processes and repeat the steps (the floor)")
        ref, failed, crash = resumed("reference", None)
        if ref is None:
            if failed is not None:
                raise RecipeError(failed.failure)
            raise ResumeError(f"the reference resume failed:\n{_crash_text(crash)}")
        say("resume the positive control (the reference's masters rounded to the compute dtype)")
        control, failed, crash = resumed("control", None)
        if control is None:
            if failed is not None:
                raise RecipeError(failed.failure)
            raise ResumeError(f"the positive control failed:\n{_crash_text(crash)}")
        candidates: list[tuple[int, Any, str, str]] = []
        for i, spec in enumerate(cfg.exporters):
            say(f"export candidate {spec} on {cfg.nproc} rank(s) in fresh processes, from the reference's state")
            exported, failed, crash = _launch(export_phase, cfg.nproc, (cfg, workdir, i), cfg.export_timeout)
            if exported is None:
                if failed is not None and failed.stage == "recipe":
                    raise RecipeError(failed.failure)
                if failed is not None and failed.stage == "internal":
                    raise ResumeError(f"restoring the reference for the export of {spec} failed: "
                                      f"{failed.failure.message(debug=True)}")
                failure = failed.failure if failed is not None else _export_crash(spec, crash, cfg.export_timeout)
                candidates.append((i, None, "export", failure.message(debug=cfg.debug)))
                continue
            say(f"restore candidate {spec} on {m} rank(s) in fresh processes and repeat the steps")
            run, failed, crash = resumed("candidate", i)
            if run is not None:
                candidates.append((i, {**run, "export_state": exported["state"]}, "", ""))
            elif failed is not None:
                candidates.append((i, None, failed.stage, failed.failure.message(debug=cfg.debug)))
            else:
                candidates.append((i, None, "crash", _crash_text(crash)))
        return judge_resume(cfg, workdir, out["traj"], ref, control, candidates, saved=out["saved"], after=out["after"])
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
