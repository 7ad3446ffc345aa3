"""The differential resume test on real multi-process runs of the built-in recipe (FSDP2, bf16 compute) and of
user code loaded by path (tests/support/resume_user_code.py)."""

from __future__ import annotations

import io
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptaudit.findings import RawReport
from ckptaudit.formats.torchload import vetted_torch_load
from ckptaudit.report import OutputFormat, render
from ckptaudit.resume import COMPONENTS, ResumeConfig, Trajectory, judge_resume, run_resume_test, thresholds
from runs import SUPPORT

pytestmark = pytest.mark.dist

USER = str(SUPPORT / "resume_user_code.py")
EXPORTERS = ("ckptaudit.exporters:compute_copy", "ckptaudit.exporters:swapped_moments",
             "ckptaudit.exporters:documented", f"{USER}:partial")
RESUME_SRC = os.path.join("ckptaudit", "resume", "")
"""How a frame of ckptaudit's own resume package shows in a traceback."""
HEALTHY = f"{USER}:torch_rng_only"
FAILURES = (f"{USER}:full_disk", f"{USER}:crash", f"{USER}:hang", f"{USER}:raises_mid_forward")
"""An exporter that raises, one that kills its processes, one that hangs, and one whose prepare forward raises
inside FSDP2's forward: none may touch the reference or the healthy candidate. The last one last: it leaves the
root's and a block's parameters unsharded bf16 tensors, and in the processes of the uninterrupted run (before
the export phases were isolated) nothing after it resharded them, so the reference trajectory started from
bf16-rounded parameters (floor[0] 1.6e-3, no power, the healthy candidate not judged)."""
EXPORT_TIMEOUT = 40.0
"""The hung exporter's deadline at most (the 2 cores loaded) ..."""
EXPORT_TIMEOUT_MIN = 15.0
"""... and at least: ``export_timeout`` takes 5x the healthy exporter's own export phase in the ``alone`` run
(the same phase, same exporter, just before), which no export phase of the run beside the failures may outlast."""


@pytest.fixture(scope="module")
def experiment(tmp_path_factory: pytest.TempPathFactory) -> tuple[RawReport, Path]:
    work = tmp_path_factory.mktemp("resume")
    cfg = ResumeConfig(exporters=EXPORTERS, save_at=3, steps=3, workdir=str(work))
    return run_resume_test(cfg), work


def _unseeded(exporters: tuple[str, ...], work: Path, export_timeout: float,
              log: Callable[[str], None] | None = None) -> RawReport:
    return run_resume_test(ResumeConfig(recipe=f"{USER}:unseeded", exporters=exporters, save_at=3, steps=3,
                                        export_timeout_s=export_timeout, workdir=str(work)), log=log)


@pytest.fixture(scope="module")
def alone_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[RawReport, Path, float]:
    """The torch-RNG-only job and its complete exporter, alone; and how long its export phase took (seconds: from
    the driver's announcement of the export to that of the candidate's restore)."""
    work = tmp_path_factory.mktemp("alone")
    said: list[tuple[float, str]] = []
    report = _unseeded((HEALTHY,), work, EXPORT_TIMEOUT, log=lambda msg: said.append((time.monotonic(), msg)))
    (begin,) = (t for t, msg in said if msg.startswith("export candidate"))
    (end,) = (t for t, msg in said if msg.startswith("restore candidate"))
    return report, work, end - begin


@pytest.fixture(scope="module")
def alone(alone_run: tuple[RawReport, Path, float]) -> tuple[RawReport, Path]:
    return alone_run[0], alone_run[1]


@pytest.fixture(scope="module")
def export_timeout(alone_run: tuple[RawReport, Path, float]) -> float:
    """The export deadline of the run beside the failures: what the hung exporter costs (it used to be a fixed
    40 s, the bound for a loaded machine, waited in full even on a quiet one)."""
    return min(EXPORT_TIMEOUT, max(EXPORT_TIMEOUT_MIN, 5 * alone_run[2]))


@pytest.fixture(scope="module")
def beside_failures(tmp_path_factory: pytest.TempPathFactory, export_timeout: float) -> tuple[RawReport, Path]:
    """The same, with the four failing exporters after it."""
    work = tmp_path_factory.mktemp("beside")
    return _unseeded((HEALTHY, *FAILURES), work, export_timeout), work


def candidate(report: RawReport, attr: str) -> dict[str, Any]:
    return next(c for c in report.extra["resume"]["candidates"] if c["exporter"].endswith(":" + attr))


def subjects(report: RawReport, code: str) -> set[str]:
    return {f.subject for f in report.findings if f.code == code}


def test_documented_path_resumes_bit_identically_and_the_control_proves_power(
        experiment: tuple[RawReport, Path]) -> None:
    report, _ = experiment
    doc = report.extra["resume"]
    assert doc["noise_floor"] == 0.0 and doc["floor"] == [0.0] * 4
    assert doc["reference"]["loss_diff"] == [0.0] * 3
    assert doc["power"] and doc["control"]["stands_out_from_step"] == 1
    assert min(doc["control"]["rel_l2"]) > 1e-4 and "rounded to bfloat16" in doc["control"]["what"]
    faithful = candidate(report, "documented")
    assert faithful["verdict"] == "faithful" and max(faithful["rel_l2"]) == 0.0
    assert all(faithful["restore"][c]["status"] == "restored" for c in COMPONENTS)
    assert not any(f.subject.startswith("ckptaudit.exporters:documented") for f in report.findings)
    assert report.path == "ckptaudit.recipes.tinygpt:recipe" and report.format == "resume-test"


def test_compute_copy_differs_at_restore_and_drifts_while_the_loss_looks_normal(
        experiment: tuple[RawReport, Path]) -> None:
    report, _ = experiment
    c = candidate(report, "compute_copy")
    assert c["verdict"] == "drift" and c["drift_start"] == 0  # the rounding is there right after the restore
    assert min(c["rel_l2"]) > 1e-4  # bf16 rounding: ~1e-3 relative, a thousand times the 1e-6 threshold
    assert c["restore"]["parameters"]["status"] == "differs"
    assert all(c["restore"][k]["status"] == "restored" for k in COMPONENTS if k != "parameters")
    assert {f"{EXPORTERS[0]}: parameters"} == subjects(report, "resume.restored-differs") & {
        f"{EXPORTERS[0]}: {k}" for k in COMPONENTS}
    assert EXPORTERS[0] in subjects(report, "resume.drift") & subjects(report, "resume.loss-looks-normal")


def test_swapped_moments_are_caught_at_restore_and_named(experiment: tuple[RawReport, Path]) -> None:
    report, work = experiment
    c = candidate(report, "swapped_moments")
    swapped = vetted_torch_load(work / "candidate-1-swapped_moments")["swapped"]
    assert c["verdict"] == "drift" and c["rel_l2"][0] == 0.0  # weights faithful; the first step uses the moments
    moments = c["restore"]["optimizer moments"]
    assert moments["status"] == "differs"
    assert {k.rpartition("/")[0] for k in moments["keys"]} == set(swapped)
    named = [p["name"] for p in c["top_parameters"][:2]]
    assert sorted(named) == sorted(swapped)
    misattached = [f for f in report.findings if f.code == "optimizer.misattached"]
    assert len(misattached) == 1 and all(p in misattached[0].subject for p in swapped)


def test_an_exporter_without_rng_and_data_is_reported_for_both(experiment: tuple[RawReport, Path]) -> None:
    report, _ = experiment
    c = candidate(report, "partial")
    spec = EXPORTERS[3]
    not_restored = subjects(report, "resume.not-restored")
    assert {f"{spec}: rng", f"{spec}: data position", f"{spec}: training step"} <= not_restored
    assert c["restore"]["rng"]["keys"][0].startswith("rank0/")
    assert c["restore"]["parameters"]["status"] == "restored"
    assert c["restore"]["optimizer moments"]["status"] == "restored"
    # A real resume from it replays the data from the start: the trajectory leaves the run after the restore.
    assert c["verdict"] == "drift" and c["drift_start"] == 1


def _weights_and_moments(path: Path) -> dict[str, str | None]:
    import ckptaudit

    raw = ckptaudit.audit(str(path)).raw
    kept = {r.name: r.hash for r in raw.tensors if r.role in ("parameter", "exp_avg", "exp_avg_sq", "step")}
    assert len(kept) == 4 * 29  # every parameter and its three optimizer entries
    return kept


def test_failing_exporters_leave_the_reference_and_the_healthy_candidate_as_without_them(
        alone: tuple[RawReport, Path], beside_failures: tuple[RawReport, Path]) -> None:
    (lone, lone_dir), (report, work) = alone, beside_failures
    a, b = lone.extra["resume"], report.extra["resume"]
    for key in ("uninterrupted_loss", "floor", "threshold", "power", "consumed"):
        assert a[key] == b[key], key
    assert b["floor"] == [0.0] * 4 and b["power"]
    for key in ("rel_l2", "loss_diff"):
        assert a["reference"][key] == b["reference"][key] and a["control"][key] == b["control"][key], key
    # The reference on disk: bit for bit the same model and optimizer.
    assert _weights_and_moments(work / "reference") == _weights_and_moments(lone_dir / "reference")
    mine = candidate(report, "torch_rng_only")
    theirs = candidate(lone, "torch_rng_only")
    assert mine["verdict"] == theirs["verdict"] == "faithful"
    for key in ("rel_l2", "loss_diff", "drift_start", "loader"):
        assert mine[key] == theirs[key], key
    assert {c: v["status"] for c, v in mine["restore"].items()} == {c: v["status"] for c, v in theirs["restore"].items()}
    assert [(c["exporter"], c["verdict"], c.get("stage")) for c in b["candidates"]] == [
        (HEALTHY, "faithful", None), *((f, "failed", "export") for f in FAILURES)]


def test_each_failing_exporter_is_its_own_finding_naming_what_happened(
        beside_failures: tuple[RawReport, Path], export_timeout: float) -> None:
    report, _ = beside_failures
    failed = {f.subject: f.message for f in report.findings if f.code == "resume.candidate-failed"}
    assert set(failed) == set(FAILURES)
    mid = failed[FAILURES[3]]
    assert "raises_mid_forward (" in mid and "RuntimeError: capture buffer overflow in block 1" in mid
    assert "in _hook" in mid and "capture_and_export" not in mid  # the user's frames, not ckptaudit's runner
    disk = failed[FAILURES[0]]
    assert "full_disk (" in disk and "resume_user_code.py" in disk and "No space left on device" in disk
    assert "in _write_shard" in disk  # the user's own frames ...
    assert RESUME_SRC not in disk and "launch.py" not in disk  # ... and not ckptaudit's
    assert "crashed while exporting" in failed[FAILURES[1]] and "exit code 3" in failed[FAILURES[1]]
    hung = failed[FAILURES[2]]
    assert "hung while exporting" in hung and f"no result within {export_timeout:.0f} s" in hung


def test_state_the_steps_never_use_is_info_and_a_torch_rng_only_job_resumes_faithfully(
        alone: tuple[RawReport, Path]) -> None:
    report, _ = alone
    doc = report.extra["resume"]
    assert doc["consumed"]["generators"] == {"numpy": False, "python": False, "torch": True}
    assert doc["consumed"]["scheduler"] and doc["consumed"]["data position"]
    c = candidate(report, "torch_rng_only")
    assert c["verdict"] == "faithful" and max(c["rel_l2"]) == 0.0
    rng = c["restore"]["rng"]
    # Python's and NumPy's generators are each process's own (never seeded), not saved, never drawn from.
    assert rng["status"] == "not restored" and rng["unused"] == rng["keys"]
    assert {k.rpartition("/")[2] for k in rng["keys"]} == {"python", "numpy"}
    unused = [f for f in report.findings if f.code == "resume.unused-state-differs"]
    assert [f.subject for f in unused] == [f"{HEALTHY}: rng"] and unused[0].severity.label == "info"
    assert "never draw from" in unused[0].message and "epoch-boundary shuffle" in unused[0].message
    assert report.findings == tuple(unused)  # nothing else: no not-restored, no incomplete
    assert "torch_rng_only: resumes faithfully" in report.summary


def test_unused_by_steps_is_decided_per_generator_and_per_component() -> None:
    from ckptaudit.resume.deviation import changed_by_steps, consumed_differences, unused_by_steps

    before = {"rng": {"rank0/torch": "a", "rank0/python": "p", "rank1/torch": "a", "rank1/python": "p"},
              "scheduler": {"last_epoch": "3"}, "data position": {"rank0/state": "s"},
              "optimizer hyperparameters": {"group0/lr": "0.1"}}
    after = {**before, "rng": {**before["rng"], "rank1/torch": "b"}}
    changed = changed_by_steps(before, after)
    assert changed["rng"] == ["rank1/torch"]
    assert not unused_by_steps("rng", "rank0/torch", changed)  # drawn on rank 1: torch's generator is used
    assert unused_by_steps("rng", "rank3/python", changed)  # any rank, even one the training run did not have
    assert unused_by_steps("scheduler", "last_epoch", changed) and unused_by_steps("data position", "x", changed)
    # An lr no scheduler changes is still read by every step.
    assert not unused_by_steps("optimizer hyperparameters", "group0/lr", changed)
    assert not unused_by_steps("rng", "rank0/python", None)  # not recorded: everything counts
    moved = {**before, "rng": {**before["rng"], "rank0/python": "q", "rank0/torch": "z"},
             "optimizer hyperparameters": {"group0/lr": "0.2"}}
    assert consumed_differences(before, moved, changed) == {"optimizer hyperparameters": ["group0/lr"],
                                                           "rng": ["rank0/torch"]}




# ----------------------------------------------------------------------------------------------------------------
# Power: a recipe with deliberate, bounded non-determinism


def test_a_noisy_recipe_has_a_floor_and_a_bf16_rounding_still_stands_out() -> None:
    cfg = ResumeConfig(recipe=f"{USER}:quiet", exporters=("ckptaudit.exporters:compute_copy",
                                                           "ckptaudit.exporters:documented"),
                       nproc=1, save_at=2, steps=3)
    report = run_resume_test(cfg)
    doc = report.extra["resume"]
    assert doc["floor"][0] == 0.0 and all(f > 0 for f in doc["floor"][1:])  # noise after the restore only
    assert doc["power"]
    assert candidate(report, "documented")["verdict"] == "faithful"  # its own noise is within 10 x the floor
    assert max(candidate(report, "documented")["rel_l2"][1:]) > 0
    assert candidate(report, "compute_copy")["verdict"] == "drift"
    assert "resume.noise-floor" in {f.code for f in report.findings}


def test_a_recipe_noisier_than_the_defect_has_no_power_and_judges_nothing() -> None:
    cfg = ResumeConfig(recipe=f"{USER}:loud", exporters=("ckptaudit.exporters:compute_copy",
                                                          "ckptaudit.exporters:documented"),
                       nproc=1, save_at=2, steps=3)
    report = run_resume_test(cfg)
    doc = report.extra["resume"]
    assert not doc["power"]
    assert [c["verdict"] for c in doc["candidates"]] == ["not judged", "not judged"]
    no_power = [f for f in report.findings if f.code == "resume.no-power"]
    assert len(no_power) == 1 and no_power[0].severity.label == "error"
    assert "NO POWER" in report.summary and "faithful" not in report.summary
    assert not subjects(report, "resume.drift")
    # What differs right after the restore needs no power: the rounded parameters are still a finding.
    assert "ckptaudit.exporters:compute_copy: parameters" in subjects(report, "resume.restored-differs")


def test_compare_states_tells_not_restored_from_differs() -> None:
    from ckptaudit.resume import compare_states

    ref = {"rng": {"rank0/torch": "saved", "rank1/torch": "saved1"}, "parameters": {"w": "a"}}
    fresh = {"rng": {"rank0/torch": "seed", "rank1/torch": "seed"}, "parameters": {"w": "init"}}
    cand = {"rng": {"rank0/torch": "seed", "rank1/torch": "saved1"}, "parameters": {"w": "rounded"}}
    out = compare_states(ref, fresh, cand)
    assert out["rng"] == {"status": "not restored", "keys": ["rank0/torch"]}
    assert out["parameters"] == {"status": "differs", "keys": ["w"]}
    assert out["scheduler"] == {"status": "restored", "keys": []}


def _traj(params: list[float], losses: list[float]) -> Trajectory:
    return Trajectory(losses=losses, params=[{"w": np.full(4, p, dtype=np.float64)} for p in params],
                      norms=[{"w": 2.0 * abs(p)} for p in params])


@pytest.mark.parametrize(("margin", "verdict"), [(10.0, "faithful"), (2.0, "drift")])
def test_the_margin_scales_the_floor_step_by_step(margin: float, verdict: str) -> None:
    base = _traj([1.0, 1.0, 1.0], [2.0, 2.0])
    ref = _traj([1.0, 1.0 + 1e-4, 1.0 + 2e-4], [2.0, 2.0])  # the floor: 1e-4, 2e-4
    cand = _traj([1.0, 1.0 + 5e-4, 1.0 + 5e-4], [2.0, 2.0])  # 5x the floor at step 1, 2.5x at step 2
    control = _traj([1.0 + 1e-2] * 3, [2.0, 2.0])
    state = {c: {"k": "v"} for c in COMPONENTS}
    run = {"traj": cand, "fresh": state, "restored": state, "loader": "load", "control": ""}
    cfg = ResumeConfig(margin=margin)
    report = judge_resume(cfg, "/nonexistent", base, {**run, "traj": ref}, {**run, "traj": control, "control": "x"},
                    [(0, run, "", "")])
    assert report.extra["resume"]["threshold"] == pytest.approx(thresholds([0.0, 1e-4, 2e-4], margin, 1e-6))
    c = report.extra["resume"]["candidates"][0]
    assert c["verdict"] == verdict
    if verdict == "drift":
        assert c["drift_start"] == 1


def test_a_reference_that_does_not_restore_exactly_gives_no_power() -> None:
    # The documented restore is off by 1e-5 right after loading (floor[0] > 0): whatever happens afterwards cannot be
    # told from the restore's own error, so no candidate is judged, however far the positive control stands out.
    base = _traj([1.0, 1.0, 1.0], [2.0, 2.0])
    ref = _traj([1.0 + 1e-5, 1.0 + 1e-5, 1.0 + 1e-5], [2.0, 2.0])
    cand = _traj([1.0, 1.0, 1.0], [2.0, 2.0])  # bit-identical to the saved run
    control = _traj([1.0 + 1e-1] * 3, [2.0, 2.0])  # 10^4 x the floor
    state = {c: {"k": "v"} for c in COMPONENTS}
    run = {"traj": cand, "fresh": state, "restored": state, "loader": "load", "control": ""}
    report = judge_resume(ResumeConfig(), "/nonexistent", base, {**run, "traj": ref}, {**run, "traj": control, "control": "x"},
                    [(0, run, "", "")])
    doc = report.extra["resume"]
    assert doc["floor"][0] > 0 and not doc["power"]
    assert [c["verdict"] for c in doc["candidates"]] == ["not judged"]
    # The cause is the finding (the control's power is moot, so no resume.no-power beside it).
    (why,) = [f for f in report.findings if f.code == "resume.reference-not-reproducible"]
    assert why.subject == "reference" and "the documented restore itself is not exact" in why.message
    assert "reference does NOT resume exactly" in report.summary and "faithful" not in report.summary


# ----------------------------------------------------------------------------------------------------------------
# Reports


def test_reports_render_as_table_json_and_html(experiment: tuple[RawReport, Path]) -> None:
    report, _ = experiment
    for fmt in OutputFormat:
        buf = io.StringIO()
        render(report, fmt, buf)
        assert "compute_copy" in buf.getvalue()
    html = io.StringIO()
    render(report, OutputFormat.HTML, html)
    page = html.getvalue()
    assert page.count("<svg") == 2 and "<polyline" in page and "threshold (0 at step 0)" in page
    assert "<script" not in page and "ckptaudit-resume-" not in page
    _check_plots(page)
    dev, loss = re.findall(r"<svg.*?</svg>", page)
    # Both plots on one x axis (0 = right after the restore), every axis labelled with its unit.
    assert _x_ticks(dev) == _x_ticks(loss) == [str(k) for k in range(4)]
    assert "relative L2 deviation (log scale)" in dev and "% of the uninterrupted loss" in loss
    assert re.search(r"text-anchor='end'>-?[\d.e-]+%<", loss)
    # compute_copy's curve is the positive control's (both are the masters rounded to bf16): the control is
    # drawn with markers of its own (hollow squares around the candidate's dots), so both stay visible.
    c = candidate(report, "compute_copy")
    assert c["rel_l2"] == report.extra["resume"]["control"]["rel_l2"]
    assert dev.count("<rect") - 1 == 4 + 1 and dev.count("<circle") >= 2 * 4  # 4 points + legend; dots
    # The threshold is 0 at step 0 (any difference right after the restore counts): a dash on the zero row,
    # not a line across the axis break.
    assert re.search(r"<line x1='[\d.]+' x2='[\d.]+' y1='([\d.]+)' y2='\1' stroke='#888' stroke-dasharray='4 3'/>", dev)
    threshold_line = re.findall(r"<polyline points='([^']*)' fill='none' stroke='#888'", dev)
    assert [len(p.split()) for p in threshold_line] == [3]  # steps 1..3
    rows = {r[0].split(" (")[0]: r for r in report.extra["sections"][0]["rows"]}
    assert rows["positive control"][4] == rows["compute_copy"][4] == "0"  # the same "drift from step"


def _x_ticks(svg: str) -> list[str]:
    return re.findall(r"text-anchor='middle'>(\d+)</text>", svg)


def test_a_traceback_is_printed_below_the_table_not_escaped_in_a_cell() -> None:
    from ckptaudit.catalogue import finding

    frames = "Traceback (your code; all frames with --debug):\n  File \"x.py\", line 3, in export\n    boom()\nOSError: full"
    bad = RawReport(command="resume-test", path="r:recipe", format="resume-test", findings=(finding(
        "resume.candidate-failed", "x.py:export", f"export: the candidate could not be written: OSError: full\n{frames}",
        stage="export"),))
    out = io.StringIO()
    render(bad, OutputFormat.TABLE, out)
    text = out.getvalue()
    assert "\\x0a" not in text and "(traceback below)" in text
    assert "\n    File \"x.py\", line 3, in export\n      boom()\n" in text
    html = io.StringIO()
    render(bad, OutputFormat.HTML, html)
    assert "<pre class='tb'>Traceback (your code" in html.getvalue()


def _check_plots(page: str) -> None:
    """Every curve inside its plot area, not on its frame unless at an axis end; legend right of the area."""

    for svg in re.findall(r"<svg.*?</svg>", page):
        x0, y0, w, h = (float(v) for v in re.search(
            r"<rect x='([\d.]+)' y='([\d.]+)' width='([\d.]+)' height='([\d.]+)'", svg).groups())  # type: ignore[union-attr]
        for pts in re.findall(r"<polyline points='([^']*)'", svg):
            for xy in pts.split():
                px, py = (float(v) for v in xy.split(","))
                assert x0 - 0.01 <= px <= x0 + w + 0.01 and y0 - 0.01 <= py <= y0 + h + 0.01, (px, py)
        labels = [t for t in re.findall(r"text-anchor='end'>([^<]*)<", svg)]
        assert "0" in labels  # the zero row (log) or the zero tick (linear)
        legend_x = [float(v) for v in re.findall(r"<line x1='([\d.]+)' x2='[\d.]+' y1='[\d.]+' y2='[\d.]+' stroke=",
                                                 svg)]
        assert max(legend_x) > x0 + w  # the legend is outside the plot area
