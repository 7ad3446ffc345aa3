"""The audit, ``latest`` and ``compare`` on the checkpoints DeepSpeed 0.19.8 really writes.

The writer (``lib_writers.py deepspeed``, a fresh interpreter) trains a tiny model with odd-sized parameters under
``deepspeed.initialize`` on 2 real CPU ranks (``DS_ACCELERATOR=cpu``, gloo) for ZeRO stages 0-3 with a bf16 engine,
ZeRO-2 with an fp16 engine, ZeRO-2 with DeepSpeed's parameter alignment (padding between parameters), and ZeRO-2
with its fp32 masters rounded to bf16 before saving (the true positive); each configuration is its own launch and
``save_checkpoint``s once per session. DeepSpeed refuses an fp16 engine on a CPU whose oneDNN has no fp16 kernels
(its CPU accelerator's ``is_fp16_supported()``): there the fp16 configuration's tests are skipped with DeepSpeed's
reason and every other configuration is still written and tested (``CKPTAUDIT_TEST_CPU=avx2`` runs the suite as on
such a CPU). Beside each ZeRO root, rank 0 saves DeepSpeed's own ``zero_to_fp32`` consolidation of the masters
(``<root>.zero_to_fp32.pt``): the independent truth the rebuilt masters must equal bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptaudit.auditing.judge import run_audit
from ckptaudit.auditing.scan import scan_checkpoint
from ckptaudit.comparing import run_compare
from ckptaudit.findings import ComponentKind, RawReport, Severity
from ckptaudit.formats.deepspeed.zero import _blocks
from ckptaudit.formats.io.tensors import iter_chunks
from ckptaudit.latest import latest_report
from configurations import Written

# The session fixture (8 launches, and DeepSpeed's first-use compile of its op) runs under whichever test comes
# first.
pytestmark = [pytest.mark.libs, pytest.mark.timeout(900)]

ZERO = ("s1-bf16", "s2-bf16", "s3-bf16", "s2-fp16", "s2-bf16-aligned")
ALL = ("s0-bf16", *ZERO, "s0-fp32")


# ``ds`` (the DeepSpeed checkpoints, written once per session) is a fixture of conftest.py.


def truth(ds: Written) -> dict[str, Any]:
    return json.loads(Path(str(ds) + ".truth.json").read_text())


def codes(report: RawReport, severity: Severity | None = None) -> set[str]:
    return {f.code for f in report.findings if severity is None or f.severity is severity}


def tag(ds: Written, name: str) -> Path:
    root = ds / name
    return root / (root / "latest").read_text().strip()


def values(path: Path) -> dict[str, np.ndarray]:
    """The audit's model tensors of ``path`` by FQN, read through the lazy pieces (as the checks stream them)."""
    scanned = scan_checkpoint(str(path))
    try:
        assert scanned.view.model is not None
        return {fqn: np.concatenate([c.copy() for c in iter_chunks(ref.data, scanned.ckpt.maps)] or [np.empty(0)])
                for fqn, ref in scanned.view.model.params.items() if not isinstance(ref.data, str)}
    finally:
        scanned.close()


# ---------------------------------------------------------------------------------------------------------------
# the contract from DeepSpeed's own record (ds_config)


def test_an_export_cast_to_bf16_contradicts_the_saved_ds_config(ds: Path, tmp_path: Path) -> None:
    # ZeRO-0 keeps masters and moments in the model states: an exporter that casts them to bf16 leaves a state that
    # alone looks like bf16 masters; the saved ds_config (bf16.enabled: fp32 masters) says it is not.
    import torch

    import lib_writers

    root = tmp_path / "s0-bf16"
    shutil.copytree(ds / "s0-bf16", root)
    states = root / "global_step2" / "mp_rank_00_model_states.pt"
    sd = torch.load(states, weights_only=True)
    sd["optimizer"] = lib_writers.cast_to_bf16(sd["optimizer"])
    torch.save(sd, states)
    report = run_audit(str(root))
    (mismatch,) = [f for f in report.findings if f.code == "contract.mismatch"]
    assert mismatch.severity is Severity.ERROR
    assert mismatch.message.startswith("global_step2/mp_rank_00_model_states.pt/ds_config records bf16.enabled=true")
    assert "parameters are bfloat16 and optimizer moments are bfloat16" in mismatch.message
    stored = {f.subject for f in report.findings if f.code == "precision.low-precision-storage"}
    assert len(stored) == len(truth(ds)["params"])
    # The same state without the config: nothing records the masters, so the bf16 contract is only inferred.
    del sd["ds_config"]
    torch.save(sd, states)
    bare = run_audit(str(root))
    assert bare.contract is not None and bare.contract.source == "optimizer-state"
    assert "contract.inferred" in codes(bare, Severity.WARNING) and "contract.mismatch" not in codes(bare)


# ---------------------------------------------------------------------------------------------------------------
# every stage as written is resumable, judged on the fp32 masters


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("where", ["root", "tag"])
def test_every_stage_audits_without_error_on_the_masters(ds: Written, name: str, where: str) -> None:
    report = run_audit(str(ds / name if where == "root" else tag(ds, name)))
    assert report.format == "deepspeed"
    assert not codes(report, Severity.ERROR), [f.message for f in report.findings if f.severity is Severity.ERROR]
    assert report.contract is not None and report.contract.master_dtype == "float32"
    config = "mp_rank_00_model_states.pt/ds_config"  # under the tag folder the root resolves to
    if name == "s0-fp32":  # an fp32 engine's config decides nothing: the fp32 moments do
        assert report.contract.source == "optimizer-state"
        (record,) = report.contract.records
        assert record.endswith(f"{config}: neither bf16 nor fp16 enabled (an fp32 engine steps the module's own "
                               "weights, in whatever dtype they were given)")
    else:  # the engine's own record: bf16/fp16 enabled, fp32 masters in the optimizer's partitions
        half = "fp16" if "fp16" in name else "bf16"
        assert report.contract.source == "deepspeed-config" and report.contract.where.endswith(config)
        assert report.contract.detail.startswith(f"{half}.enabled=true: DeepSpeed's {half} engine")
    params = {r.param: r for r in report.tensors if r.role == "parameter"}
    assert sorted(params) == sorted(truth(ds)["params"])
    assert {r.dtype for r in params.values()} == {"float32"}
    assert all(r.precision.value == "exact" for r in params.values()), {p: r.precision for p, r in params.items()}
    # The bf16/fp16 module weights are reported as the compute copies, never judged against the contract.
    copies = [r for r in report.tensors if r.role == "compute-copy"]
    if name == "s0-fp32":  # no mixed precision: the module weights are the masters themselves
        assert not copies and "deepspeed.compute-copies" not in codes(report)
        assert {r.name for r in params.values()} == {f"global_step2/fp32_masters/{p}" if where == "root" else
                                                     f"fp32_masters/{p}" for p in params}
    else:
        assert sorted(r.param for r in copies) == sorted(truth(ds)["params"])
        assert {r.dtype for r in copies} == {"float16" if "fp16" in name else "bfloat16"}
        (info,) = [f for f in report.findings if f.code == "deepspeed.compute-copies"]
        assert info.severity is Severity.INFO and "fp32 masters" in info.message
        assert ("empty ZeRO-3 placeholders" in info.message) == (name == "s3-bf16")
    # Moments attached to every parameter by name, with its shape.
    for kind in ("exp_avg", "exp_avg_sq"):
        moments = {r.param: r for r in report.tensors if r.role == kind}
        assert sorted(moments) == sorted(params)
        assert all(moments[p].shape == params[p].shape and moments[p].dtype == "float32" for p in params)
    assert report.extra["attachment"] == "by-name"
    # DeepSpeed's own pickled classes: not loaded (a warning), never unsafe.
    assert "security.unsafe-pickle" not in codes(report)
    warned = {g for f in report.findings if f.code == "security.not-loaded" for g in f.evidence["globals"]}
    assert warned == (set() if name.startswith("s0-") else {
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler" if "fp16" in name else
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        *(("deepspeed.utils.tensor_fragment.fragment_address",) if name != "s3-bf16" else ())})
    assert ("deepspeed.resolved-tag" in codes(report)) == (where == "root")


def test_inventory_reads_scheduler_steps_and_what_is_not_saved(ds: Written) -> None:
    report = run_audit(str(ds / "s2-bf16"))
    comps = {c.kind: c for c in report.components}
    assert comps[ComponentKind.SCHEDULER].where == ("global_step2/lr_scheduler",)
    assert comps[ComponentKind.OPTIMIZER].found and "flat partitions" in comps[ComponentKind.OPTIMIZER].detail
    data = comps[ComponentKind.DATA_PROGRESS]
    assert data.found and "step counter only (global_steps 2, global_samples 8)" in data.detail
    assert "batches_seen" in data.detail  # the user's client_state, named
    assert not comps[ComponentKind.RNG].found  # DeepSpeed saves no RNG state: a warning
    assert [(f.subject, f.severity) for f in report.findings if f.code == "component.missing"] == [
        ("rng", Severity.WARNING)]
    assert report.extra["step"] == 2
    assert run_audit(str(ds / "s1-bf16")).extra["step"] == 4  # latest names global_step4


@pytest.mark.parametrize("name", ZERO)
def test_rebuilt_masters_equal_deepspeeds_own_zero_to_fp32_bit_for_bit(ds: Written, name: str) -> None:
    import torch  # only to read the truth file DeepSpeed's converter wrote

    expected = torch.load(ds / f"{name}.zero_to_fp32.pt", weights_only=True)
    got = values(ds / name)
    for fqn, tensor in expected.items():
        want = tensor.float().numpy().reshape(-1)
        assert np.array_equal(got[fqn].view(np.uint32), want.view(np.uint32)), fqn
    # compare: the torch.save of the fp32 state as reference, the DeepSpeed root as candidate.
    report = run_compare(str(ds / f"{name}.zero_to_fp32.pt"), str(ds / name))
    assert not codes(report, Severity.ERROR), [f.message for f in report.findings if f.severity is Severity.ERROR]
    assert "parameters and buffers identical" in report.summary


def test_moments_rebuilt_from_two_flat_layouts_agree(ds: Written) -> None:
    # ZeRO-2 cuts each group's flat buffer across the ranks (a parameter can straddle them, padding at the end);
    # ZeRO-3 cuts every parameter in two (each padded). The same run's moments must agree to float rounding (the
    # gradient reductions differ), so a slice misplaced by either mapping would show. ZeRO-0 keeps one unflattened
    # tensor per parameter, with bf16 gradients: not equal, but strongly correlated with both.
    def moments(path: Path) -> dict[tuple[str, str], np.ndarray]:
        scanned = scan_checkpoint(str(path))
        try:
            return {(r.param or "", r.role): np.concatenate([c.copy() for c in iter_chunks(ref.data, scanned.ckpt.maps)])
                    for r, ref in zip(scanned.records, scanned.refs, strict=True) if r.role in ("exp_avg", "exp_avg_sq")}
        finally:
            scanned.close()

    zero2, zero3, zero0 = moments(ds / "s2-bf16"), moments(ds / "s3-bf16"), moments(ds / "s0-bf16")
    assert sorted(zero2) == sorted(zero3) == sorted(zero0) and len(zero2) == 12
    for key, want in zero3.items():
        np.testing.assert_allclose(zero2[key], want, rtol=1e-4, atol=1e-12, err_msg=str(key))
        if want.size > 4:
            assert np.corrcoef(zero0[key], want)[0, 1] > 0.95, key


def test_compare_deepspeed_against_itself_and_across_stages(ds: Written) -> None:
    same = run_compare(str(ds / "s3-bf16"), str(ds / "s3-bf16"))
    assert same.summary.startswith("candidate = reference"), same.summary
    # ZeRO-2 vs ZeRO-3 of the same run: the masters are paired by name (not the empty ZeRO-3 placeholders).
    across = run_compare(str(ds / "s2-bf16"), str(ds / "s3-bf16"))
    assert "compare.shape-mismatch" not in codes(across)
    assert "compare.missing" not in codes(across)


def test_masters_rounded_in_the_engine_are_still_caught(ds: Written) -> None:
    report = run_audit(str(ds / "s2-bf16-rounded"))
    rounded = [f for f in report.findings if f.code == "precision.bf16-rounded"]
    assert len(rounded) >= 4 and all("fp32_masters/" in f.subject for f in rounded)
    assert all(f.severity is Severity.ERROR for f in rounded)
    # The reference run's masters were not rounded: compare names the rounding too.
    cmp = run_compare(str(ds / "s2-bf16.zero_to_fp32.pt"), str(ds / "s2-bf16-rounded"))
    assert "precision.bf16-rounded" in codes(cmp, Severity.ERROR)


# ---------------------------------------------------------------------------------------------------------------
# WarmupLR from its default warmup_min_lr 0: the first two steps apply lr 0 (moments fill, masters do not move)


@pytest.mark.parametrize(("tag_dir", "where"), [("global_step1", "tag"), ("global_step2", "tag"),
                                                ("global_step1", "root")])
def test_steps_at_lr_0_by_deepspeeds_own_schedule_are_not_rounded_masters(
        ds: Written, tmp_path: Path, tag_dir: str, where: str) -> None:
    step = ds / "s1-bf16-warmup0" / tag_dir
    # The situation is as claimed: the masters equal the bf16 compute copies bit for bit (nothing moved), while
    # the moments are not zero (the step-0 rule cannot apply) and the step counters show real steps.
    scanned = scan_checkpoint(str(step))
    try:
        moments = [r for r in scanned.records if r.role in ("exp_avg", "exp_avg_sq")]
        assert moments and any(r.precision.value == "exact" for r in moments)
        assert set(scanned.steps.values()) == {float(tag_dir[-1])}
    finally:
        scanned.close()
    # DeepSpeed made the fp32 masters from the bf16 module: unmoved, every value is still bf16-representable.
    assert all(not (v.astype(np.float32).view(np.uint32) & 0xFFFF).any() for v in values(step).values())
    path = step
    if where == "root":  # a root whose latest names the lr-0 tag, as DeepSpeed's load_checkpoint would read it
        path = tmp_path / "root"
        shutil.copytree(step, path / tag_dir)
        (path / "latest").write_text(tag_dir)
    report = run_audit(str(path))
    assert not codes(report, Severity.ERROR), [f.message for f in report.findings if f.severity is Severity.ERROR]
    early = [f for f in report.findings if f.code == "precision.before-first-update"]
    assert len(early) >= 3 and all(f.severity is Severity.WARNING and "fp32_masters/" in f.subject for f in early)
    message = early[0].message
    assert "applied learning rate 0 by DeepSpeed's WarmupLR as its ds_config sets it: warmup_min_lr 0" in message
    assert f"last_batch_iteration {int(tag_dir[-1]) - 1}; global_steps {tag_dir[-1]}, skipped_steps 0" in message


def test_the_same_run_rounded_after_real_steps_still_errors(ds: Written) -> None:
    # latest names global_step4: steps 3 and 4 applied lr > 0, then the masters were rounded to bf16.
    report = run_audit(str(ds / "s1-bf16-warmup0"))
    assert report.extra["step"] == 4
    rounded = [f for f in report.findings if f.code == "precision.bf16-rounded"]
    assert len(rounded) >= 4 and all(f.severity is Severity.ERROR for f in rounded)
    assert "precision.before-first-update" not in codes(report)


def test_lr_0_is_believed_only_when_the_record_agrees_with_itself(ds: Written) -> None:
    """The real record of the 1-step lr-0 checkpoint, changed one fact at a time: each change leaves the lrs
    applied undecided (or not 0), so the evidence is refused and the masters are judged as usual."""
    from ckptaudit.checks.lr_history import deepspeed_zero_lr_steps

    scanned = scan_checkpoint(str(ds / "s1-bf16-warmup0" / "global_step1"))
    try:
        assert scanned.view.optimizer is not None
        groups = [dict(g) for g in scanned.view.optimizer.groups]
        (tree,) = [p.tree for p in scanned.ckpt.parts if isinstance(p.tree, dict) and "deepspeed" in p.tree]
    finally:
        scanned.close()
    facts, sched = dict(tree["deepspeed"]), dict(tree["lr_scheduler"])
    config = json.loads(json.dumps(facts["ds_config"]))
    assert deepspeed_zero_lr_steps(config, sched, facts, groups) is not None

    def changed(path: tuple[str, ...], value: Any) -> dict[str, Any]:
        c = json.loads(json.dumps(config))
        node = c
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return c

    refused = {
        "min lr above 0": (changed(("scheduler", "params", "warmup_min_lr"), 1e-3), sched, facts, groups),
        "client scheduler (none in ds_config)": ({"optimizer": config["optimizer"]}, sched, facts, groups),
        "a torch scheduler named": (changed(("scheduler", "type"), "LambdaLR"), sched, facts, groups),
        "optimizer not lr-scaled": (changed(("optimizer", "type"), "Adafactor"), sched, facts, groups),
        "scheduler stepped more than the engine": (config, {"last_batch_iteration": 1}, facts, groups),
        "a skipped step the scheduler counted": (config, sched, {**facts, "skipped_steps": 1}, groups),
        "saved lr not what the schedule sets": (config, sched, facts, [{**g, "lr": 1e-3} for g in groups]),
        "no saved lr": (config, sched, facts, [{k: v for k, v in g.items() if k != "lr"} for g in groups]),
        "three steps: the third had lr > 0": (config, {"last_batch_iteration": 2}, {**facts, "global_steps": 3},
                                              [{**g, "lr": 1e-2 * math.log(3) / math.log(10)} for g in groups]),
    }
    for why, args in refused.items():
        assert deepspeed_zero_lr_steps(*args) is None, why
    # Two steps, both at lr 0: the saved lr is the one set for the third step (iteration 1 of a log warmup).
    two = ({"last_batch_iteration": 1}, {**facts, "global_steps": 2},
           [{**g, "lr": 1e-2 * math.log(2) / math.log(10)} for g in groups])
    assert deepspeed_zero_lr_steps(config, *two) is not None
    linear = changed(("scheduler", "params", "warmup_type"), "linear")
    assert deepspeed_zero_lr_steps(linear, two[0], two[1], [{**g, "lr": 1e-2 / 10} for g in groups]) is not None


# ---------------------------------------------------------------------------------------------------------------
# lost and damaged masters; `latest`


@pytest.mark.parametrize(("name", "lose"), [("s2-bf16", "*optim_states.pt"), ("s3-bf16", "*zero_pp_rank_1_*optim_states.pt"),
                                            ("s0-bf16", None)])
def test_masters_lost_is_an_error_naming_the_masters(ds: Written, tmp_path: Path, name: str, lose: str | None) -> None:
    root = tmp_path / name
    shutil.copytree(ds / name, root)
    step = root / "global_step2"
    if lose is None:  # ZeRO-0 keeps the masters inside the model states: drop them there
        import torch

        sd = torch.load(step / "mp_rank_00_model_states.pt", weights_only=True)
        sd["optimizer"] = None
        torch.save(sd, step / "mp_rank_00_model_states.pt")
    else:
        for f in step.glob(lose):
            f.unlink()
    report = run_audit(str(root))
    (lost,) = [f for f in report.findings if f.code == "deepspeed.masters-missing"]
    assert lost.severity is Severity.ERROR
    assert "fp32 masters are gone" in lost.message and "rebuild the masters from the bf16" in lost.message
    if name == "s3-bf16":
        assert "rank 1 of 2 is missing" in lost.message
    # The compute copies are not held against the contract: the one error about the model is the lost masters.
    assert not [f for f in report.findings if f.code.startswith("precision.")]
    assert not [r for r in report.tensors if r.role == "parameter"]


@pytest.mark.parametrize("name", ["s2-bf16", "s3-bf16"])
def test_partitions_that_do_not_add_up_are_masters_missing_not_a_traceback(ds: Written, tmp_path: Path,
                                                                           name: str) -> None:
    import torch

    root = tmp_path / name
    shutil.copytree(ds / name, root)
    for f in (root / "global_step2").glob("*model_states.pt"):
        sd = torch.load(f, weights_only=True)
        sd["param_shapes"][0]["body.0.weight"] = torch.Size([13, 9])  # 26 elements more than were partitioned
        torch.save(sd, f)
    report = run_audit(str(root))
    (lost,) = [f for f in report.findings if f.code == "deepspeed.masters-missing"]
    assert "cannot be mapped back to parameters" in lost.message and "would end at element" in lost.message
    assert not [r for r in report.tensors if r.role == "parameter"]


def test_latest_skips_a_damaged_newest_tag_the_latest_file_names(ds: Written, tmp_path: Path) -> None:
    intact = latest_report(str(ds / "s1-bf16"))
    assert intact.extra["latest"] == str(ds / "s1-bf16" / "global_step4")
    assert not intact.findings
    root = tmp_path / "run"
    shutil.copytree(ds / "s1-bf16", root)
    shard = root / "global_step4" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    os.truncate(shard, shard.stat().st_size // 2)
    assert (root / "latest").read_text().strip() == "global_step4"
    report = latest_report(str(root))
    assert report.extra["latest"] == str(root / "global_step2")
    (stale,) = [f for f in report.findings if f.code == "store.pointer-stale"]
    assert "global_step4, which is not resumable" in stale.message and "global_step2" in stale.message
    # The pointer is DeepSpeed's own tag file, named as such, with the fix (not ckptaudit's pointer).
    assert stale.message.startswith("DeepSpeed's tag file latest (engine.load_checkpoint resumes from the tag")
    assert "Write 'global_step2' into latest, or pass tag='global_step2' to load_checkpoint" in stale.message
    rejected = {f.code for f in report.findings if f.evidence.get("candidate") == "global_step4"}
    assert {"integrity.corrupt", "deepspeed.masters-missing"} <= rejected
    rows = {row[0]: row for row in report.extra["sections"][0]["rows"]}
    assert rows["global_step4"][2] == "deepspeed" and rows["global_step4"][3] == "no"
    # The audit of the root follows the tag file, as load_checkpoint does, and says the masters are gone.
    assert "deepspeed.masters-missing" in codes(run_audit(str(root)), Severity.ERROR)


def test_root_whose_latest_file_names_no_folder_audits_the_newest(ds: Written, tmp_path: Path) -> None:
    root = tmp_path / "run"
    shutil.copytree(ds / "s1-bf16", root)
    (root / "latest").write_text("global_step9")
    report = run_audit(str(root))
    (f,) = [f for f in report.findings if f.code == "integrity.incomplete"]
    assert "global_step9" in f.message and "global_step4" in f.message
    assert report.extra["step"] == 4


def test_root_without_its_latest_file_audits_the_newest_tag(ds: Written, tmp_path: Path) -> None:
    root = tmp_path / "run"
    shutil.copytree(ds / "s1-bf16", root)
    (root / "latest").unlink()
    (root / "zero_to_fp32.py").unlink()
    report = run_audit(str(root))
    assert report.format == "deepspeed" and report.extra["step"] == 4
    (f,) = [f for f in report.findings if f.code == "integrity.incomplete"]
    assert "no readable latest file" in f.message


@pytest.mark.parametrize("name", ["s2-bf16", "s3-bf16"])
def test_damaged_files_give_findings_never_a_traceback(ds: Written, tmp_path: Path, name: str) -> None:
    rng = random.Random(name)
    files = sorted((tag(ds, name)).glob("*.pt"))
    for f in files:
        size = f.stat().st_size
        for damage in ("truncate", "truncate", "flip", "flip", "empty"):
            root = tmp_path / f"{name}-{f.name}-{damage}-{rng.random()}"
            shutil.copytree(ds / name, root)
            victim = root / "global_step2" / f.name
            if damage == "truncate":
                os.truncate(victim, rng.randint(1, size - 1))
            elif damage == "empty":
                os.truncate(victim, 0)
            else:
                data = bytearray(victim.read_bytes())
                for _ in range(8):
                    data[rng.randrange(size)] ^= 0xFF
                victim.write_bytes(bytes(data))
            report = run_audit(str(root))  # must not raise
            if damage != "flip":
                assert report.fails(Severity.ERROR), (f.name, damage)
            shutil.rmtree(root)


# ---------------------------------------------------------------------------------------------------------------
# security: DeepSpeed's classes are harmless only as their own pickling uses them


def test_deepspeed_class_called_with_arguments_is_unsafe(ds: Written, tmp_path: Path) -> None:
    import hostile_files as hf

    src = tag(ds, "s2-bf16") / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    # LossScaler("...") runs its __init__ with attacker-chosen arguments on torch.load(weights_only=False); its own
    # pickling is NEWOBJ without arguments + BUILD.
    pkl = b"\x80\x02cdeepspeed.runtime.fp16.loss_scaler\nLossScaler\n" + hf._op_str("/tmp/x") + b"\x85R."
    path = tmp_path / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    hf.replace_data_pkl(src, path, pkl)
    report = run_audit(str(path))
    (f,) = [f for f in report.findings if f.code == "security.unsafe-pickle"]
    assert "LossScaler" in f.message and "called with arguments" in f.message


# ---------------------------------------------------------------------------------------------------------------
# the pure part: a flat element range of a tensor as rectangular pieces


def test_blocks_tile_exactly_the_flat_range() -> None:
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 4)))
        numel = math.prod(shape)
        start = rng.randint(0, numel - 1)
        length = rng.randint(0, numel - start)
        covered = np.zeros(numel, dtype=np.int64)
        for offsets, sizes in _blocks(shape, start, length):
            block = np.zeros(shape, dtype=np.int64)
            block[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))] = 1
            covered += block.reshape(-1)
        want = np.zeros(numel, dtype=np.int64)
        want[start:start + length] = 1
        assert np.array_equal(covered, want), (shape, start, length)
