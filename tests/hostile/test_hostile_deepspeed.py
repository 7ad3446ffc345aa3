"""Hostile and damaged DeepSpeed tag folders (issue 25), each made by mutating the files DeepSpeed 0.19.8 wrote
(``ds`` fixture; see ``hostile_deepspeed.py``): work linear in parameters + ranks, zero-size parameters, values
that would overflow, a damaged ``ds_config``, optimizer shards of ranks the save did not have. Where DeepSpeed's
own ``zero_to_fp32`` reads the same folder, it runs in a child process and the audit must agree with it: the
masters it rebuilds are ours bit for bit, and what it refuses is an error here."""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hostile_deepspeed as hd
from ckptaudit.auditing.judge import run_audit
from ckptaudit.auditing.scan import scan_checkpoint
from ckptaudit.cli import main
from ckptaudit.findings import RawReport, Severity
from ckptaudit.formats.deepspeed.zero import MAX_EMPTY_PARAMS, _cut
from ckptaudit.formats.io.tensors import iter_chunks
from configurations import Written

pytestmark = pytest.mark.libs

_ZERO_TO_FP32 = """
import json, os, sys
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
try:
    sd = get_fp32_state_dict_from_zero_checkpoint(sys.argv[1], tag=sys.argv[2])
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
    raise SystemExit(0)
torch.save({k: v.detach().clone().contiguous() for k, v in sd.items()}, sys.argv[3])
print(json.dumps({"ok": len(sd)}))
"""


def zero_to_fp32(step: Path, tmp: Path) -> dict[str, Any]:
    """DeepSpeed's own consolidation of the tag folder ``step``, in a child: ``{"masters": {name: array}}`` or
    ``{"error": its message}``."""
    out = tmp / f"zero_to_fp32-{step.parent.name}.pt"
    proc = subprocess.run([sys.executable, "-c", _ZERO_TO_FP32, str(step.parent), step.name, str(out)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    if "error" in answer:
        return answer
    import torch

    return {"masters": {k: v.numpy() for k, v in torch.load(out, weights_only=True).items()}}


def tag(ds: Written, name: str) -> Path:
    root = ds / name
    return root / (root / "latest").read_text().strip()


def errors(report: RawReport) -> list[tuple[str, str]]:
    return [(f.code, f.message) for f in report.findings if f.severity is Severity.ERROR]


def tensors(path: Path) -> dict[tuple[str, str], np.ndarray]:
    """(parameter, role) -> values of every master and moment the audit reads, through the lazy pieces."""
    scanned = scan_checkpoint(str(path))
    try:
        out = {}
        for r, ref in zip(scanned.records, scanned.refs, strict=True):
            if r.role in ("parameter", "exp_avg", "exp_avg_sq") and not isinstance(ref.data, str):
                chunks = [c.copy() for c in iter_chunks(ref.data, scanned.ckpt.maps)]
                out[(r.param or r.name, r.role)] = (np.concatenate(chunks) if chunks else np.empty(0)).reshape(
                    r.shape)
        return out
    finally:
        scanned.close()


def mutated(ds: Written, name: str, dst: Path, edit: Any, pattern: str = "*.pt") -> Path:
    """A copy of the root ``name`` at ``dst`` whose latest tag folder's files matching ``pattern`` are edited."""
    shutil.copytree(ds / name, dst)
    step = dst / (dst / "latest").read_text().strip()
    shutil.rmtree(step)
    hd.mutate(tag(ds, name), step, edit, pattern)
    return step


# ---------------------------------------------------------------------------------------------------------------
# Work linear in parameters + ranks


class _Counting(Sequence[int]):
    """A list whose reads are counted: the work of a sweep over it, measured without a clock."""

    def __init__(self, values: list[int]) -> None:
        self.values, self.reads = values, 0

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i: Any) -> Any:
        self.reads += 1
        return self.values[i]

    def __iter__(self) -> Iterator[int]:
        raise AssertionError("the sweep indexes the boundaries; it never copies them")


@pytest.mark.parametrize(("ranks", "params"), [(256, 51_200), (4096, 3), (3, 20_000), (512, 512)])
def test_cutting_parameters_along_rank_partitions_is_one_sweep(ranks: int, params: int) -> None:
    rng = random.Random(ranks * params)
    sizes = [rng.choice([0, 1, 2, 7, 200]) for _ in range(ranks)]
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    ranges, pos = [], 0
    for _ in range(params):  # one-element, empty, padded and straddling parameters
        numel = min(rng.choice([0, 1, 1, 3, 50]), bounds[-1] - pos)
        ranges.append((pos, pos + numel))
        pos += numel + min(rng.choice([0, 0, 1]), bounds[-1] - pos - numel)
    counted = _Counting(bounds)
    cuts = _cut(counted, ranges)
    # Linear: each parameter and each rank boundary is read a bounded number of times (not parameters x ranks).
    assert counted.reads <= 4 * (params + ranks) + 8, (counted.reads, params, ranks)
    for (lo, hi), cut in zip(ranges, cuts, strict=True):  # and exact: the brute-force cut of every range
        want = [(r, max(lo, bounds[r]) - bounds[r], max(lo, bounds[r]) - lo, min(hi, bounds[r + 1]) - max(lo, bounds[r]))
                for r in range(ranks) if max(lo, bounds[r]) < min(hi, bounds[r + 1])]
        assert cut == want


def test_many_ranks_and_parameters_are_rebuilt_exactly_as_zero_to_fp32_does(ds: Written, tmp_path: Path) -> None:
    """128 ranks, 4096 one-element parameters (each rank's partition holds 32 of them): every master and
    moment is the element at its offset of the concatenated partitions, and the masters are DeepSpeed's own."""
    ranks, params = 128, 4096
    step = hd.many_ranks(tag(ds, "s2-bf16"), tmp_path / "run" / "global_step2", ranks=ranks, params=params)
    (tmp_path / "run" / "latest").write_text("global_step2")
    got = tensors(step)
    full = {role: np.concatenate([hd.expected_slice(r, params // ranks, seed).numpy() for r in range(ranks)])
            for role, seed in (("parameter", 0), ("exp_avg", 1), ("exp_avg_sq", 2))}
    assert len(got) == 3 * params
    for i in range(params):
        for role, values in full.items():
            assert got[(f"p.{i}", role)].tolist() == [abs(values[i]) if role == "exp_avg_sq" else values[i]], (i, role)
    theirs = zero_to_fp32(step, tmp_path)
    assert theirs.get("masters") is not None, theirs
    assert all(np.array_equal(theirs["masters"][f"p.{i}"], got[(f"p.{i}", "parameter")]) for i in range(params))


# ---------------------------------------------------------------------------------------------------------------
# Parameters with no elements


def test_zero_size_parameters_get_empty_moments_not_rank_0s_whole_partition(ds: Written, tmp_path: Path) -> None:
    step = hd.empty_params(tag(ds, "s2-bf16"), tmp_path / "run" / "global_step2", count=3)
    (tmp_path / "run" / "latest").write_text("global_step2")
    report = run_audit(str(step))
    assert not errors(report), errors(report)
    got = tensors(step)
    intact = tensors(tag(ds, "s2-bf16"))
    for i in range(3):
        for role in ("parameter", "exp_avg", "exp_avg_sq"):
            assert got[(f"e.{i}", role)].shape == (0,), (i, role)
    assert all(np.array_equal(got[k], v) for k, v in intact.items())  # the real ones where they were
    theirs = zero_to_fp32(step, tmp_path)
    assert theirs.get("masters") is not None, theirs
    assert theirs["masters"]["e.0"].shape == (0,)
    assert all(np.array_equal(theirs["masters"][p], got[(p, "parameter")]) for p, r in intact if r == "parameter")


def test_a_flood_of_empty_parameters_is_refused_before_any_is_built(ds: Written, tmp_path: Path) -> None:
    """Each empty parameter costs a few bytes of pickle (a name and a memoised shape) and would be a master and
    two moments to audit: past MAX_EMPTY_PARAMS the layout is refused as a limit, nothing per parameter built."""
    step = hd.empty_params(tag(ds, "s2-bf16"), tmp_path / "global_step2", count=MAX_EMPTY_PARAMS + 1)
    report = run_audit(str(step))
    (lost,) = [f for f in report.findings if f.code == "deepspeed.masters-missing"]
    assert lost.evidence.get("limit") is True and f"more than {MAX_EMPTY_PARAMS} parameters" in lost.message
    assert "were not rebuilt" in lost.message and "load_checkpoint would fail" not in lost.message
    assert not [r for r in report.tensors if r.role in ("parameter", "exp_avg", "exp_avg_sq")]


# ---------------------------------------------------------------------------------------------------------------
# Values that would overflow: a finding, never a traceback


def _huge(shape: list[int]) -> Any:
    def edit(state: dict[str, Any], name: str) -> None:
        if "param_shapes" in state:
            first = next(iter(state["param_shapes"][0]))
            state["param_shapes"][0][first] = shape
    return edit


@pytest.mark.parametrize(("name", "shape"), [("s3-bf16", [10**400, 7]), ("s3-bf16", [2**62, 2**62]),
                                             ("s2-bf16", [10**5000]), ("s3-bf16", [-1, 3]), ("s2-bf16", [True])])
def test_absurd_parameter_shapes_are_masters_missing(ds: Written, tmp_path: Path, name: str, shape: list[int]) -> None:
    step = mutated(ds, name, tmp_path / name, _huge(shape), "*model_states.pt")
    report = run_audit(str(step))
    (lost,) = [f for f in report.findings if f.code == "deepspeed.masters-missing"]
    assert "parameter shape" in lost.message and "cannot be mapped back" in lost.message, lost.message
    assert not [r for r in report.tensors if r.role == "parameter"]
    out = io.StringIO()
    assert main(["audit", str(step), "--no-progress"], stdout=out, stderr=io.StringIO()) == 1


def test_an_absurd_frozen_parameter_shape_under_zero3_is_one_unreadable_parameter(ds: Written, tmp_path: Path) -> None:
    def edit(state: dict[str, Any], name: str) -> None:
        state["frozen_param_shapes"] = {"frozen.w": [10**400]}

    step = mutated(ds, "s3-bf16", tmp_path / "s3", edit, "*model_states.pt")
    report = run_audit(str(step))
    (lost,) = [f for f in report.findings if f.code == "deepspeed.masters-missing"]
    assert "parameter shape" in lost.message


def test_absurd_schedule_numbers_leave_the_lr_0_reading_undecided(ds: Written, tmp_path: Path) -> None:
    """WarmupDecayLR's total_num_steps = 10**400 (DeepSpeed's own formula would overflow on it): the schedule is
    not decided, and the rounded masters of the real run are judged as such."""
    def edit(state: dict[str, Any], name: str) -> None:
        state["ds_config"]["scheduler"] = {"type": "WarmupDecayLR", "params": {
            "warmup_max_lr": 0.01, "warmup_num_steps": 1, "total_num_steps": 10**400}}

    step = mutated(ds, "s1-bf16-warmup0", tmp_path / "w0", edit, "*model_states.pt")
    report = run_audit(str(step))
    assert "precision.bf16-rounded" in {c for c, _ in errors(report)}


def test_the_lr_schedule_refuses_every_absurd_number_without_raising() -> None:
    from ckptaudit.checks.lr_history import deepspeed_zero_lr_steps

    config = {"optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 1,
                                                                "total_num_steps": 10}}}
    base = (config, {"last_batch_iteration": 3}, {"global_steps": 4, "skipped_steps": 0}, [{"lr": 0.0}])
    for bad in (10**400, -(10**400), 2**63, float("inf"), float("nan"), 1e300):
        for key in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps",
                    "last_batch_iteration"):
            c = json.loads(json.dumps(config))
            c["scheduler"]["params"][key] = bad
            assert deepspeed_zero_lr_steps(c, *base[1:]) is None, (key, bad)
        assert deepspeed_zero_lr_steps(config, {"last_batch_iteration": bad}, *base[2:]) is None
        assert deepspeed_zero_lr_steps(config, base[1], {"global_steps": bad}, base[3]) is None
        assert deepspeed_zero_lr_steps(config, *base[1:3], [{"lr": bad}]) is None


# ---------------------------------------------------------------------------------------------------------------
# Damaged records: the files present decide, as DeepSpeed's readers do


@pytest.mark.parametrize("name", ["s2-bf16", "s3-bf16"])
@pytest.mark.parametrize("config", ["garbage", None, [1, 2]])
def test_a_ds_config_that_is_not_a_dict_changes_no_verdict(ds: Written, tmp_path: Path, name: str, config: Any) -> None:
    """load_checkpoint never reads the saved ds_config (the resuming engine has its own): the stage and dtype
    come from the files, and the audit is the intact one's."""
    def edit(state: dict[str, Any], fname: str) -> None:
        state["ds_config"] = config

    step = mutated(ds, name, tmp_path / name, edit, "*model_states.pt")
    damaged, intact = run_audit(str(step)), run_audit(str(tag(ds, name)))
    assert not errors(damaged), errors(damaged)
    assert [(t.name, t.hash, t.role) for t in damaged.tensors] == [(t.name, t.hash, t.role) for t in intact.tensors]
    assert {f.code for f in damaged.findings} == {f.code for f in intact.findings}
    assert [(c.kind, c.found, c.where) for c in damaged.components] == [(c.kind, c.found, c.where)
                                                                         for c in intact.components]


def test_an_optimizer_shard_of_a_rank_the_save_did_not_have_is_an_error(ds: Written, tmp_path: Path) -> None:
    root = tmp_path / "s2"
    shutil.copytree(ds / "s2-bf16", root)
    step = root / (root / "latest").read_text().strip()
    shutil.copy(step / hd.optim_name(1), step / hd.optim_name(2))  # left over from a 3-rank save
    theirs = zero_to_fp32(step, tmp_path)
    assert "Expected 2 of '*_optim_states.pt'" in theirs.get("error", ""), theirs
    report = run_audit(str(step))
    (bad,) = [f for f in report.findings if f.code == "integrity.corrupt"]
    assert bad.subject == hd.optim_name(2) and bad.severity is Severity.ERROR
    assert "beyond the 2 ranks" in bad.message and "zero_to_fp32 refuses" in bad.message
    # What load_checkpoint reads (ranks 0 and 1) is still audited: the masters are the intact ones.
    intact = run_audit(str(tag(ds, "s2-bf16")))
    assert [(t.name, t.hash) for t in report.tensors if t.role == "parameter"] == [
        (t.name, t.hash) for t in intact.tensors if t.role == "parameter"]


@pytest.mark.parametrize("damage", ["partition_count", "paddings-too-few", "paddings-negative"])
def test_shard_bookkeeping_zero_to_fp32_refuses_is_masters_missing(ds: Written, tmp_path: Path, damage: str) -> None:
    def edit(state: dict[str, Any], name: str) -> None:
        osd = state["optimizer_state_dict"]
        if damage == "partition_count":
            osd["partition_count"] = [3]
        elif damage == "paddings-too-few":
            osd["param_alignment_paddings"] = [osd["param_alignment_paddings"][0][:-1]]
        else:
            osd["param_alignment_paddings"] = [[0] * 5 + [-2]]

    step = mutated(ds, "s2-bf16", tmp_path / "s2", edit, "*optim_states.pt")
    theirs = zero_to_fp32(step, tmp_path)
    report = run_audit(str(step))
    (lost,) = [f for f in report.findings if f.code == "deepspeed.masters-missing"]
    assert "cannot be mapped back" in lost.message
    assert not [r for r in report.tensors if r.role == "parameter"]
    if damage != "paddings-negative":  # DeepSpeed narrows with a negative offset: garbage rather than an error
        assert "error" in theirs, theirs
        assert ("partition_count" if damage == "partition_count" else "param_alignment_paddings") in lost.message


# ---------------------------------------------------------------------------------------------------------------
# The same under torchrun: the reader's finding, never a rank's traceback


def test_an_absurd_zero3_shape_under_torchrun_is_the_single_process_report(ds: Written, tmp_path: Path) -> None:
    from runs import torchrun

    step = mutated(ds, "s3-bf16", tmp_path / "s3", _huge([10**400, 7]), "*model_states.pt")
    out = io.StringIO()
    assert main(["audit", str(step), "--format", "json", "--no-progress"], stdout=out, stderr=io.StringIO()) == 1
    run = torchrun(2, "audit", str(step), "--format", "json", "--no-progress", cwd=tmp_path)
    assert run.returncode == 1, run.stderr[-3000:]
    assert json.loads(run.stdout) == json.loads(out.getvalue())
    # torchrun prints its own ChildFailedError traceback for exit code 1; no frame of ours may appear.
    assert not re.search(r'File ".*ckptaudit', run.stderr), run.stderr[-3000:]


def test_absurd_numbers_in_the_model_states_record_are_rendered_not_raised(ds: Written, tmp_path: Path) -> None:
    """global_steps, global_samples, skipped_steps, dp_world_size and the scheduler's iteration past Python's
    int-to-string limit: the audit judges the masters as usual and every renderer prints the report."""
    from ckptaudit.report import OutputFormat, render

    def edit(state: dict[str, Any], name: str) -> None:
        for key in ("global_steps", "global_samples", "skipped_steps", "dp_world_size"):
            state[key] = 10**5000
        state["lr_scheduler"] = {"last_batch_iteration": 10**5000}

    step = mutated(ds, "s2-bf16", tmp_path / "s2", edit, "*model_states.pt")
    report = run_audit(str(step))
    intact = run_audit(str(tag(ds, "s2-bf16")))
    assert [(t.name, t.hash) for t in report.tensors if t.role == "parameter"] == [
        (t.name, t.hash) for t in intact.tensors if t.role == "parameter"]
    for fmt in OutputFormat:
        out = io.StringIO()
        render(report, fmt, out, verbose=True)
        if fmt is OutputFormat.JSON:
            assert json.loads(out.getvalue())["step"] == "<integer of about 5001 digits>"


# ---------------------------------------------------------------------------------------------------------------
# Every value of the records, replaced: a report in every format, never a traceback


@pytest.mark.parametrize("name", ["s2-fp16", "s3-bf16"])
def test_every_record_value_replaced_by_a_hostile_one_is_a_report(ds: Written, tmp_path: Path, name: str) -> None:
    """Each number, string and None of the model-states and optimizer records (ds_config, counters, param
    groups, partition counts, paddings...) replaced in turn by one of hd.HOSTILE_VALUES (rotated, so every
    value meets every kind of field): the audit and its three renderings complete. One leaf per mutant, all of
    them, seeded by position (the same cases every run)."""
    import copy

    import torch

    from ckptaudit.report import OutputFormat, render

    src = tag(ds, name)
    files = {f.name: hd.load(f) for f in sorted(src.glob("*.pt"))}
    cases = [(fname, path) for fname, state in files.items() for path in hd.record_leaves(state)]
    assert len(cases) > 50, len(cases)  # ds_config, counters, param groups... all seen
    failures = []
    for i, (fname, path) in enumerate(cases):
        value = hd.HOSTILE_VALUES[i % len(hd.HOSTILE_VALUES)]
        step = tmp_path / str(i) / "global_step2"
        shutil.copytree(src, step, copy_function=os.link)
        state = copy.deepcopy(files[fname])
        hd.set_leaf(state, path, value)
        (step / fname).unlink()  # a hard link to the fixture's file: never written through
        torch.save(state, step / fname)
        try:
            report = run_audit(str(step))
            for fmt in OutputFormat:
                render(report, fmt, io.StringIO(), verbose=True)
        except Exception as exc:  # every escape collected, reported at once
            failures.append(f"{fname} {path} = {value!r:.40}: {type(exc).__name__}: {exc}")
        shutil.rmtree(step.parent)
    assert not failures, "\n".join(failures)
