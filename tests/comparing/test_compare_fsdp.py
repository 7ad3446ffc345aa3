"""``ckptaudit compare`` on real checkpoints of one real 2-rank FSDP2 run (bf16 MixedPrecisionPolicy): the
documented DCP checkpoint as the reference, the exporters' torch.save files as candidates."""

from __future__ import annotations

import io
import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.auditing.judge import run_audit
from ckptaudit.cli import main
from ckptaudit.comparing import CompareOptions, run_compare
from ckptaudit.findings import RawReport, Severity
from ckptaudit.formats.torchload import vetted_torch_load

pytestmark = pytest.mark.dist


def pairs(report: RawReport) -> dict[str, dict[str, Any]]:
    return {p["key"]: p for p in report.extra["pairs"]}


def statuses(report: RawReport, group: str) -> dict[str, str]:
    return {p["key"]: p["status"] for p in report.extra["pairs"] if p["group"] == group}


def subjects(report: RawReport, code: str) -> set[str]:
    return {f.subject for f in report.findings if f.code == code}


def params(run: dict[str, Any]) -> list[str]:
    return [f"model/{p}" for p in run["params"]]


def test_dcp_and_torch_save_copy_of_the_same_state_are_identical_throughout(fsdp_run: dict[str, Any]) -> None:
    d = fsdp_run["dir"]
    report = run_compare(str(d / "faithful"), str(d / "faithful.pt"))
    got = pairs(report)
    # Every tensor and value matched across formats and key spellings (optim vs optimizer, train_state/step
    # vs step), sharded DCP tensors against whole torch.save ones, and all bitwise identical.
    assert {p["status"] for p in got.values()} == {"identical"}
    assert set(params(fsdp_run)) <= set(got)
    moments = [k for k, p in got.items() if p["group"] == "optimizer moments"]
    assert len(moments) == 2 * len(fsdp_run["params"])
    assert {"data-progress/step", "scheduler/last_epoch", "rng/rank0/torch", "rng/rank1/torch"} <= set(got)
    assert report.extra["reference"]["format"] == "dcp" and report.extra["candidate"]["format"] == "torch.save"
    assert report.findings == ()
    assert report.summary.startswith("candidate = reference: all ")
    # The digests are the audit's content hashes of the same tensors.
    audited = {t.name: t.hash for t in run_audit(str(d / "faithful.pt")).tensors}
    assert all(p["candidate"]["hash"] == audited[p["candidate"]["name"]] for p in got.values() if p["kind"] == "tensor")
    # One pair at a time or several at once: the same answer.
    serial = run_compare(str(d / "faithful"), str(d / "faithful.pt"), CompareOptions(threads=1))
    assert serial.extra["pairs"] == report.extra["pairs"]
    assert main(["compare", str(d / "faithful"), str(d / "faithful.pt"), "--no-progress"],
                stdout=io.StringIO(), stderr=io.StringIO()) == 0


def test_compute_copy_is_the_reference_rounded_to_bf16_nearest_even(fsdp_run: dict[str, Any]) -> None:
    d = fsdp_run["dir"]
    report = run_compare(str(d / "faithful"), str(d / "compute-copy-fp32.pt"))
    got = pairs(report)
    for name in params(fsdp_run):
        assert got[name]["status"] == "bf16-rounded", name
        assert got[name]["rounding"] == "round-to-nearest-even"
        assert got[name]["candidate"]["dtype"] == "float32"
    assert subjects(report, "precision.bf16-rounded") == set(params(fsdp_run))
    assert set(statuses(report, "optimizer moments").values()) == {"identical"}
    n = len(fsdp_run["params"])
    assert report.summary.startswith(f"candidate differs from reference: {n} of {n} parameters rounded to bf16 "
                                     "(round-to-nearest-even); optimizer moments and steps/hyperparameters "
                                     "identical; scheduler identical")
    # The exporter saved rank 0's RNG state only: rank 0's matches the reference's, rank 1's is missing.
    assert got["rng/rank0/torch"]["status"] == "identical"
    assert got["rng/rank1/torch"]["status"] == "missing"
    assert "RNG of rank1 missing in the candidate" in report.summary
    missing = {f.subject: f.severity for f in report.findings if f.code == "compare.missing"}
    assert missing == {"rng": Severity.WARNING, "data-progress": Severity.WARNING}
    assert main(["compare", str(d / "faithful"), str(d / "compute-copy-fp32.pt"), "--no-progress"],
                stdout=io.StringIO(), stderr=io.StringIO()) == 1


def test_bf16_storage_is_rounded_and_would_be_silently_upcast_on_load(fsdp_run: dict[str, Any]) -> None:
    d = fsdp_run["dir"]
    report = run_compare(str(d / "faithful"), str(d / "compute-copy-bf16.pt"))
    got = pairs(report)
    assert {got[n]["status"] for n in params(fsdp_run)} == {"bf16-rounded"}
    assert {got[n]["candidate"]["dtype"] for n in params(fsdp_run)} == {"bfloat16"}
    casts = [f for f in report.findings if f.code == "load.silent-cast"]
    assert {f.subject for f in casts} == set(params(fsdp_run))
    assert {(f.evidence["candidate_dtype"], f.evidence["reference_dtype"]) for f in casts} == {("bfloat16",
                                                                                                "float32")}
    assert all(f.severity is Severity.WARNING and "pytorch/pytorch#187138" in f.message for f in casts)


def test_same_values_in_another_dtype_are_equal_values(fsdp_run: dict[str, Any]) -> None:
    d = fsdp_run["dir"]
    # The bf16 compute copies, and the same copies upcast to fp32: equal values, different dtypes.
    report = run_compare(str(d / "compute-copy-bf16.pt"), str(d / "compute-copy-fp32.pt"))
    assert set(statuses(report, "parameters").values()) == {"equal-values"}
    assert set(statuses(report, "optimizer moments").values()) == {"identical"}
    casts = [f for f in report.findings if f.code == "load.silent-cast"]
    assert len(casts) == len(fsdp_run["params"]) and {f.severity for f in casts} == {Severity.INFO}
    assert not report.fails(Severity.WARNING)
    assert report.summary.startswith("candidate = reference with parameters equal in value")


def test_fp16_copy_is_the_reference_rounded_to_fp16(fsdp_run: dict[str, Any]) -> None:
    d = fsdp_run["dir"]
    report = run_compare(str(d / "faithful"), str(d / "fp16-copy.pt"))
    got = pairs(report)
    assert {(got[n]["status"], got[n]["rounding"]) for n in params(fsdp_run)} == {("fp16-rounded",
                                                                                   "round-to-nearest-even")}
    assert subjects(report, "precision.fp16-rounded") == set(params(fsdp_run))
    assert "precision.bf16-rounded" not in {f.code for f in report.findings}


def test_swapped_moments_between_two_same_shape_layers_are_misattached(fsdp_run: dict[str, Any]) -> None:
    d = fsdp_run["dir"]
    a, b = vetted_torch_load(d / "swapped.pt")["swapped"]
    assert fsdp_run["shapes"][a] == fsdp_run["shapes"][b] and a != b
    report = run_compare(str(d / "faithful"), str(d / "swapped.pt"))
    found = [f for f in report.findings if f.code == "optimizer.misattached"]
    assert len(found) == 1
    f = found[0]
    assert f.severity is Severity.ERROR and set(f.evidence["params"]) == {a, b} and f.evidence["swapped"]
    assert f.evidence["states"] == ["exp_avg", "exp_avg_sq"]
    assert a in f.message and b in f.message
    got = pairs(report)
    for mine, theirs in ((a, b), (b, a)):
        for state in ("exp_avg", "exp_avg_sq"):
            p = got[f"optimizer/state/{mine}/{state}"]
            assert p["status"] == "different"
            assert p["matches_reference"]["param"] == theirs and p["matches_reference"]["how"] == "identical"
    # Everything else of the optimizer, and every parameter, is untouched.
    others = {k: s for k, s in statuses(report, "optimizer moments").items() if a not in k and b not in k}
    assert set(others.values()) == {"identical"}
    assert set(statuses(report, "parameters").values()) == {"identical"}
    assert "compare.different" not in {f.code for f in report.findings}


def test_another_run_is_different_with_measured_differences(fsdp_run: dict[str, Any],
                                                            fsdp_low_precision: Path) -> None:
    report = run_compare(str(fsdp_run["dir"] / "faithful"), str(fsdp_low_precision))
    got = pairs(report)
    for name in params(fsdp_run):
        p = got[name]
        assert p["status"] == "different", name
        diff = p["diff"]
        assert diff["max_abs"] > 0 and diff["max_ulp"] >= 1 and diff["rel_l2"] > 0 and 0 < diff["fraction"] <= 1
        assert diff["elements"] == math.prod(p["reference"]["shape"])
    different = {f.subject: f.severity for f in report.findings if f.code == "compare.different"}
    assert different["model"] is Severity.ERROR and different["optimizer"] is Severity.ERROR
    # bf16 parameters and moments where the reference has fp32: a DCP load into the reference's template
    # would silently upcast them.
    casts = subjects(report, "load.silent-cast")
    assert set(params(fsdp_run)) <= casts


def test_dcp_really_casts_silently_on_load(fsdp_run: dict[str, Any], fsdp_low_precision: Path) -> None:
    """The premise of ``load.silent-cast`` on this torch: a bf16 DCP checkpoint loads into an fp32 template
    without an error, the values cast."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ckptaudit.formats.dcp.reader import check_metadata_safe

    check_metadata_safe(str(fsdp_low_precision))
    name = fsdp_run["params"][0]
    shape = fsdp_run["shapes"][name]
    template = {"model": {name: torch.zeros(shape, dtype=torch.float32)}}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(template, checkpoint_id=str(fsdp_low_precision))
    loaded = template["model"][name]
    assert loaded.dtype == torch.float32 and loaded.abs().sum() > 0
    assert torch.equal(loaded, loaded.bfloat16().float())  # bf16 values, widened without a word


def derived(fsdp_run: dict[str, Any], tmp_path: Path, name: str, edit: Any) -> Path:
    import torch

    state = vetted_torch_load(fsdp_run["dir"] / "faithful.pt")
    edit(state)
    path = tmp_path / name
    torch.save(state, path)
    return path


def test_missing_extra_shape_mismatch_and_components(fsdp_run: dict[str, Any], tmp_path: Path) -> None:
    import torch

    gone = fsdp_run["params"][3]
    reshaped = next(n for n, s in fsdp_run["shapes"].items() if len(s) == 2)

    def edit(state: dict[str, Any]) -> None:
        del state["scheduler"]
        del state["model"][gone]
        state["model"]["extra.buffer"] = torch.ones(3)
        w = state["model"][reshaped]
        state["model"][reshaped] = w.reshape(w.shape[1], w.shape[0]).clone()

    cand = derived(fsdp_run, tmp_path, "edited.pt", edit)
    report = run_compare(str(fsdp_run["dir"] / "faithful"), str(cand))
    got = pairs(report)
    assert got[f"model/{gone}"]["status"] == "missing" and got[f"model/{gone}"]["candidate"] is None
    assert got["model/extra.buffer"]["status"] == "extra" and got["model/extra.buffer"]["reference"] is None
    assert got[f"model/{reshaped}"]["status"] == "shape-mismatch"
    assert got["scheduler/last_epoch"]["status"] == "missing"
    codes = {(f.code, f.subject): f.severity for f in report.findings}
    assert codes[("compare.component-missing", "scheduler")] is Severity.WARNING
    assert codes[("compare.missing", "model")] is Severity.ERROR
    assert codes[("compare.extra", "model")] is Severity.INFO
    assert codes[("compare.shape-mismatch", f"model/{reshaped}")] is Severity.ERROR
    # The scheduler is reported once, as a component, not entry by entry.
    assert ("compare.missing", "scheduler") not in codes
    # The other way round, the scheduler is a component only the candidate has.
    back = run_compare(str(cand), str(fsdp_run["dir"] / "faithful"))
    assert ("compare.component-extra", "scheduler") in {(f.code, f.subject) for f in back.findings}


def test_truncated_and_stochastically_rounded_exports(fsdp_run: dict[str, Any], tmp_path: Path) -> None:
    import torch

    g = torch.Generator().manual_seed(0)

    def trunc(t: torch.Tensor) -> torch.Tensor:
        return (t.view(torch.int32) & ~0xFFFF).view(torch.float32)

    def stochastic(t: torch.Tensor) -> torch.Tensor:
        down = trunc(t)
        up = (down.view(torch.int32) + 0x10000).view(torch.float32)
        inexact = (t.view(torch.int32) & 0xFFFF) != 0
        return torch.where((torch.rand(t.shape, generator=g) < 0.5) & inexact, up, down)

    ref = str(fsdp_run["dir"] / "faithful")
    for name, fn, mode in (("trunc.pt", trunc, "round-toward-zero"), ("sr.pt", stochastic, "stochastic-or-other")):
        def edit(state: dict[str, Any], fn: Any = fn) -> None:
            state["model"] = {k: fn(v) for k, v in state["model"].items()}
        report = run_compare(ref, str(derived(fsdp_run, tmp_path, name, edit)))
        got = pairs(report)
        # Two-element-wide tensors could fit several rules by chance; the matrices cannot.
        matrices = [f"model/{n}" for n, s in fsdp_run["shapes"].items() if len(s) == 2]
        assert {(got[m]["status"], got[m]["rounding"]) for m in matrices} == {("bf16-rounded", mode)}, name
        assert {f.evidence["rounding"] for f in report.findings if f.code == "precision.bf16-rounded"} == {mode}


def test_index_keyed_optimizer_state_is_matched_through_the_attachment(fsdp_run: dict[str, Any],
                                                                       tmp_path: Path) -> None:
    names = fsdp_run["params"]

    def edit(state: dict[str, Any]) -> None:
        fqn_state = state["optimizer"]["state"]
        group = state["optimizer"]["param_groups"][0]
        state["optimizer"] = {"state": {i: fqn_state[n] for i, n in enumerate(names)},
                              "param_groups": [{**group, "params": list(range(len(names)))}]}

    report = run_compare(str(fsdp_run["dir"] / "faithful"), str(derived(fsdp_run, tmp_path, "indexed.pt", edit)))
    assert set(statuses(report, "optimizer moments").values()) == {"identical"}
    assert len(statuses(report, "optimizer moments")) == 2 * len(names)


def test_json_report_and_verbose_table(fsdp_run: dict[str, Any], fsdp_low_precision: Path) -> None:
    d = fsdp_run["dir"]
    out = io.StringIO()
    code = main(["compare", str(d / "faithful"), str(fsdp_low_precision), "--format", "json",
                 "--no-progress"], stdout=out, stderr=io.StringIO())
    assert code == 1
    doc = json.loads(out.getvalue())
    assert doc["command"] == "compare" and doc["reference"]["layout"] == "dcp"
    first = doc["pairs"][0]
    assert set(first) == {"key", "kind", "component", "group", "role", "param", "status", "rounding", "reference",
                          "candidate", "diff", "matches_reference", "note"}
    assert set(first["diff"]) == {"elements", "differ", "fraction", "max_abs", "max_ulp", "rel_l2"}
    assert sum(doc["pair_counts"].values()) == len(doc["pairs"])
    # The table lists only pairs that are not identical, unless --verbose.
    quiet = run_compare(str(d / "faithful"), str(d / "swapped.pt"))
    loud = run_compare(str(d / "faithful"), str(d / "swapped.pt"), CompareOptions(verbose=True))
    rows = {s["title"]: s["rows"] for s in quiet.extra["sections"]}
    loud_rows = {s["title"]: s["rows"] for s in loud.extra["sections"]}
    assert all(r[1] != "identical" for r in rows["pairs that are not identical"])
    assert len(loud_rows["pairs"]) == len(loud.extra["pairs"])
    text = io.StringIO()
    assert main(["compare", str(d / "faithful"), str(d / "swapped.pt"), "--no-progress"], stdout=text,
                stderr=io.StringIO()) == 1
    assert "optimizer.misattached" in text.getvalue()


def test_usage_errors(tmp_path: Path, fsdp_run: dict[str, Any]) -> None:
    err = io.StringIO()
    assert main(["compare", str(fsdp_run["dir"] / "faithful"), str(tmp_path / "nope.pt")], stdout=io.StringIO(),
                stderr=err) == 2
    assert "candidate" in err.getvalue() and "nope.pt" in err.getvalue()


def test_damaged_inputs_give_findings_not_tracebacks(fsdp_run: dict[str, Any], copy_of: Any,
                                                     tmp_path: Path) -> None:
    d = fsdp_run["dir"]
    broken = copy_of(d / "faithful")
    shard = broken / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    report = run_compare(str(broken), str(d / "faithful.pt"))
    assert ("integrity.incomplete", "reference: __0_0.distcp") in {(f.code, f.subject) for f in report.findings}
    unread = [p for p in report.extra["pairs"] if p["status"] == "unread"]
    assert unread and all(p["kind"] == "tensor" for p in unread)
    assert "unreadable" in report.summary
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint " * 64)
    out, err = io.StringIO(), io.StringIO()
    assert main(["compare", str(d / "faithful"), str(garbage), "--no-progress"], stdout=out, stderr=err) == 1
    assert err.getvalue() == ""
    report = run_compare(str(d / "faithful"), str(garbage))
    codes = {(f.code, f.subject) for f in report.findings}
    assert ("format.unrecognized", "candidate: garbage.pt") in codes
    assert ("compare.component-missing", "model") in codes
