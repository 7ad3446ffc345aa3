"""(this process) The judgement and the report: the noise floor, the positive control's power, each candidate's
drift and restored state, and the offline comparison with the reference.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

import numpy as np

from ckptaudit.catalogue import finding
from ckptaudit.findings import Finding, RawReport
from ckptaudit.resume.config import COMPONENTS, ResumeConfig, Trajectory
from ckptaudit.resume.deviation import (
    CONSUMABLE,
    changed_by_steps,
    compare_states,
    compare_trajectories,
    consumed_differences,
    consumed_summary,
    thresholds,
    unused_by_steps,
)

_UNUSED = {"rng": ("generators they never draw from", "an epoch-boundary shuffle"),
           "scheduler": ("a scheduler they never step", "a scheduler stepped once per epoch"),
           "data position": ("a data source they never advance", "a data source advanced once per epoch")}
"""For each consumable component: what 'unused' means, and how a job would use it beyond the steps."""
_STAGE = {"export": "could not be written", "load": "could not be restored",
          "steps": "was restored, but the recipe's steps failed on it", "crash": "crashed its resume"}


def _keys(keys: list[str]) -> str:
    return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


_PLURAL = frozenset({"parameters", "optimizer moments", "optimizer hyperparameters"})


def _is(comp: str) -> str:
    """The verb for a component's name: "the optimizer moments are", "the scheduler is"."""
    return "are" if comp in _PLURAL else "is"


def _named(comp: str, keys: list[str]) -> str:
    """A component as a user reads it: the RNG with the generators in question (``rng (numpy, python)``; its keys
    are ``rank<r>/<generator>``), any other by its name."""
    if comp != "rng" or not keys:
        return comp
    return f"rng ({', '.join(sorted({k.rpartition('/')[2] for k in keys}))})"


def judge_resume(cfg: ResumeConfig, workdir: str, base: Trajectory, ref: dict[str, Any], control: dict[str, Any],
           candidates: list[tuple[int, Any, str, str]], *, saved: dict[str, dict[str, str]] | None = None,
           after: dict[str, dict[str, str]] | None = None) -> RawReport:
    """The verdicts. ``saved`` and ``after`` are the training run's state right after the save and after the
    uninterrupted steps: what changed in between is what the steps consume (``None``: not recorded, everything
    counts as consumed)."""
    findings: list[Finding] = []
    ref_dev = compare_trajectories(base, ref["traj"])
    floor = ref_dev.rel_l2
    thr = thresholds(floor, cfg.margin, cfg.min_rel)
    peak = max(floor)
    ranks = f"{cfg.nproc} rank(s)" + (f", resumed on {cfg.resume_ranks}" if cfg.resume_ranks != cfg.nproc else "")
    changed = changed_by_steps(saved, after) if saved is not None and after is not None else None
    if floor[0] > 0:
        findings.append(finding(
            "resume.reference-not-reproducible", "reference",
            f"right after restoring the documented-path reference, its parameters differ from the saved run by rel. "
            f"L2 {floor[0]:.2e}: the documented restore itself is not exact, so no candidate can be judged",
            rel_l2=floor[0]))
    ref_mismatch: dict[str, list[str]] = {}
    if saved is not None and cfg.resume_ranks == cfg.nproc:
        ref_mismatch = {c: k for c, k in consumed_differences(saved, ref["restored"], changed).items()
                        if c != "parameters" or floor[0] == 0}
        for comp, keys in ref_mismatch.items():
            findings.append(finding(
                "resume.reference-not-reproducible", f"reference: {comp}",
                f"right after restoring the documented-path reference, its {comp} differs from the training run's "
                f"at the save ({_keys(keys)}), and the steps use it: the documented restore itself is not exact "
                "(a data source or scheduler whose load_state_dict does not restore what state_dict gave?), so no "
                "candidate can be judged", component=comp, keys=keys))
    if peak > 0:
        findings.append(finding("resume.noise-floor", "reference",
                                f"the documented-path reference deviates by up to rel. L2 {peak:.2e} over the "
                                f"steps ({ranks}); a candidate drifts at step k above max({cfg.margin:g} x floor[k], "
                                f"{cfg.min_rel:.0e})", floor=floor))
    ctl_dev = compare_trajectories(base, control["traj"])
    power_steps = [k for k in range(1, len(thr)) if ctl_dev.rel_l2[k] > thr[k]]
    power = bool(power_steps) and floor[0] == 0 and not ref_mismatch
    control_drift = [k for k, r in enumerate(ctl_dev.rel_l2) if r > thr[k]]
    if not power and not ref_mismatch and floor[0] == 0:
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
    exact = floor[0] == 0 and not ref_mismatch
    rows: list[list[str]] = [
        ["reference (documented path)",
         "restored" if exact else "; ".join(f"{c}: differs" for c in ref_mismatch) or "parameters differ",
         _fmt(peak), f"{max(ref_dev.loss_rel, default=0.0):.2%}", "-",
         ("bit-identical" if peak == 0 else "floor") if exact else "NOT REPRODUCIBLE"],
        [f"positive control ({control['control']})", "parameters differ", _fmt(max(ctl_dev.rel_l2)),
         f"{max(ctl_dev.loss_rel, default=0.0):.2%}", str(control_drift[0]) if control_drift else "-",
         "stands out (power)" if power else "NO POWER"]]
    forensic_rows: list[list[str]] = []
    if not exact:
        head = ("reference does NOT resume exactly (the documented restore is not exact), so no candidate is "
                "judged")
    else:
        head = (f"reference resumes {'bit-identically' if peak == 0 else f'within {peak:.1e}'}"
                + ("" if power else "; NO POWER: the positive control does not stand out from the floor, "
                   "so no candidate is judged"))
    summaries = [head]
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
        unused: dict[str, list[str]] = {}
        for comp in COMPONENTS:
            st = restore[comp]
            if st["status"] in ("not restored", "differs"):
                idle = [k for k in st["keys"] if unused_by_steps(comp, k, changed)]
                st["unused"] = idle
                if idle:
                    unused[comp] = idle
        problems = [c for c in COMPONENTS if restore[c]["status"] in ("not restored", "differs")
                    and len(restore[c]["unused"]) < len(restore[c]["keys"])]
        for comp in problems:
            st = restore[comp]
            listed = _keys([k for k in st["keys"] if k not in st["unused"]])
            if st["status"] == "not restored":
                findings.append(finding(
                    "resume.not-restored", f"{spec}: {comp}",
                    f"{name}: the {_named(comp, st['keys'])} {_is(comp)} not restored by {run['loader']}: right after "
                    f"loading {'they are' if comp in _PLURAL else 'it is'} still the fresh job's ({listed}); a real "
                    f"resume from this checkpoint would start with {'them' if comp in _PLURAL else 'it'}; save and "
                    f"load the {comp} in the exporter", component=comp, keys=st["keys"]))
            else:
                findings.append(finding(
                    "resume.restored-differs", f"{spec}: {comp}",
                    f"{name}: {_named(comp, st['keys'])} restored by {run['loader']}, but not to the reference's "
                    f"values ({listed}), "
                    "before any step (no kernel noise yet)", component=comp, keys=st["keys"]))
        for comp, idle in unused.items():
            what, later = _UNUSED[comp]
            findings.append(finding(
                "resume.unused-state-differs", f"{spec}: {comp}",
                f"{name}: the {_named(comp, idle)} {_is(comp)} {restore[comp]['status']} after {run['loader']} "
                f"({_keys(idle)}), but the "
                f"{cfg.steps} uninterrupted steps never use it ({what}), so the resumed run does not depend on it; "
                f"a job that uses it later ({later}) would: save and restore it if yours does",
                component=comp, keys=idle))
        export_state = run.get("export_state")
        export_off = consumed_differences(saved, export_state, changed) if saved and export_state else {}
        for comp, keys in export_off.items():
            findings.append(finding(
                "resume.reference-not-reproducible", f"{spec}: export",
                f"{name}: the job restored from the reference for this candidate's export differs from the training "
                f"run's at the save in its {comp} ({_keys(keys)}): the exporter did not see the state a live "
                "exporter would, so the candidate is not judged", component=comp, keys=keys))
        forensics, misattached = _forensics(workdir, cfg, i)
        for f in misattached:
            findings.append(finding("optimizer.misattached", f"{name}: {f.subject}", f"{name}: {f.message}",
                                    **f.evidence))
        # Without power nothing about the steps is judged; what differs right after the restore is reported
        # above as restored-state findings (they need no power).
        drifting = [k for k, r in enumerate(dev.rel_l2) if r > thr[k]] if power and not export_off else []
        worst_step = int(np.argmax(dev.rel_l2))
        top = sorted(dev.per_param[worst_step].items(), key=lambda kv: -kv[1])[:5]
        max_loss_rel = max(dev.loss_rel, default=0.0)
        if not power or export_off:
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
        state_text = ("; ".join(f"{_named(c, restore[c]['keys'])}: {restore[c]['status']}" for c in problems)
                      + "; " * bool(problems and unused)
                      + "; ".join(f"{_named(c, unused[c])}: {restore[c]['status']} (unused by the steps)"
                                  for c in unused)
                      or "restored")
        rows.append([name, state_text, _fmt(max(dev.rel_l2)), f"{max_loss_rel:.2%}",
                     str(drifting[0]) if drifting else "-", verdict.upper() if verdict != "faithful" else verdict])
        forensic_rows.append([name, forensics])
        state_issues = ", ".join(f"{_named(c, restore[c]['keys'])} "
                                 f"{'differ' if restore[c]['status'] == 'differs' else 'not restored'}"
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
        "consumed": (None if changed is None or saved is None else
                     {**consumed_summary(changed, saved),
                      "changed": {c: changed[c] for c in CONSUMABLE if changed.get(c)}}),
        "uninterrupted_loss": base.losses,
        "reference": {"rel_l2": ref_dev.rel_l2, "max_abs": ref_dev.max_abs, "loss_diff": ref_dev.loss_diff,
                      "loss_rel": ref_dev.loss_rel, "exact": exact},
        "control": {"what": control["control"], "rel_l2": ctl_dev.rel_l2, "loss_diff": ctl_dev.loss_diff,
                    "loss_rel": ctl_dev.loss_rel, "drift_start": control_drift[0] if control_drift else None,
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
    return RawReport(command="resume-test", path=path, format="resume-test", findings=tuple(findings),
                  summary="; ".join(summaries), extra={"resume": doc, "sections": sections})


def _forensics(workdir: str, cfg: ResumeConfig, i: int) -> tuple[str, list[Finding]]:
    """The offline comparison of a candidate with the reference: its summary, and its misattached moments
    (the comparison names swapped parameters exactly; the trajectory only shows where drift is largest)."""
    from ckptaudit.comparing import run_compare

    path = os.path.join(workdir, cfg.candidate_name(i))
    if not os.path.exists(path):
        return "candidate not found on disk", []
    try:
        report = run_compare(os.path.join(workdir, cfg.reference_name), path)
    except Exception as exc:  # noqa: BLE001 - forensics are a bonus; the trajectory verdict stands alone
        return f"not compared ({exc})", []
    return report.summary, [f for f in report.findings if f.code == "optimizer.misattached"]


def _fmt(x: float) -> str:
    if x != x:
        return "n/a"
    return "0" if x == 0 else f"{x:.2e}"
