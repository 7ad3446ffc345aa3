"""The live probe on real jobs: FSDP2 (+ bf16 MixedPrecisionPolicy, and without one), FSDP1, DDP, plain.

Real processes, real gloo groups, real ``fully_shard`` and ``torch.distributed.checkpoint``; the exporters under
test are the ones ``ckptaudit.exporters`` ships. Hashes are checked against an independent computation from
the saved files (plain ``xxhash`` over ``torch.chunk`` slices), not only against the probe's own records.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from ckptaudit.cli import main
from ckptaudit.findings import RawReport, Severity
from ckptaudit.formats.torchload import vetted_torch_load
from ckptaudit.launch import launch
from ckptaudit.probe import Probe, ProbeResult, judge_probe
from ckptaudit.probe.regions import combine

pytestmark = pytest.mark.dist

N_PARAMS = 29  # the tiny GPT's trainable parameters


def _jobs() -> Any:
    import probe_jobs

    return probe_jobs


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("probe-fsdp2")
    results = launch(_jobs().fsdp2_bf16, 2, (str(out), 4), timeout_s=300)[0]
    return {"dir": out, **results}


def verdicts(result: ProbeResult) -> dict[str, str]:
    report = judge_probe(result)
    return {p["name"]: p["verdict"] for p in report.extra["probe"]["parameters"]}


def codes(report: RawReport) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for f in report.findings:
        out.setdefault(f.code, set()).add(f.subject)
    return out


def _independent_combined(full: torch.Tensor, world: int = 2) -> str:
    """What the probe's combined hash must be for an FSDP2 Shard(0) parameter, computed without the probe."""
    digests = []
    for part in torch.chunk(full, world, dim=0):
        raw = part.contiguous().view(torch.uint8).numpy().tobytes()
        digests.append(xxhash.xxh3_128(raw).hexdigest())
    return combine(digests)


# -- FSDP2 + bf16 MixedPrecisionPolicy ------------------------------------------------------------------------


def test_documented_path_is_faithful_at_all_three_points(fsdp2_run: dict[str, Any]) -> None:
    result: ProbeResult = fsdp2_run["documented"]
    report = judge_probe(result)
    assert report.findings == (), [f.message for f in report.findings]
    assert set(verdicts(result).values()) == {"faithful"}
    assert len(result.params) == N_PARAMS and result.wrapper == "fsdp2" and result.world_size == 2
    for p in result.params:
        masters, compute, saved = result.masters[p.fqn], result.compute[p.fqn], result.saved[p.fqn]
        # Point 1: fp32 shards on both ranks, read from the DTensor: Shard(0) with torch.chunk semantics.
        assert [m.dtype for m in masters] == ["float32", "float32"]
        rows = [c.shape[0] for c in torch.chunk(torch.empty(p.shape), 2, dim=0)]
        assert [m.local_shape[0] for m in masters] == rows + [0] * (2 - len(rows))
        assert masters[1].region.offsets[0] == (rows[0] if len(rows) > 1 else p.shape[0])
        # Point 2: the bf16 unsharded copy, seen by both ranks, and exactly the master cast to bf16.
        assert [c.dtype for c in compute] == ["bfloat16", "bfloat16"]
        assert compute[0].full_hash == compute[1].full_hash
        assert all(c.hash == m.rounded["bfloat16"] for c, m in zip(compute, masters, strict=True))
        # Point 3: the DCP tensors, cut to the same regions, hash like the masters.
        assert [s.hash for s in saved] == [m.hash for m in masters]
        assert saved[0].dtype == "float32"
    assert report.contract is not None and report.contract.master_dtype == "float32"
    assert report.extra["probe"]["compute_dtype"] == "bfloat16"


def test_compute_copy_upcast_to_fp32_is_caught(fsdp2_run: dict[str, Any]) -> None:
    result: ProbeResult = fsdp2_run["compute-copy-fp32"]
    report = judge_probe(result)
    assert set(verdicts(result).values()) == {"compute-copy-upcast"}
    assert codes(report) == {"probe.saved-compute-copy": {p.fqn for p in result.params}}
    assert report.fails(Severity.ERROR)
    # Independent check: the saved fp32 values are the compute copy the probe saw in forward, upcast.
    saved = vetted_torch_load(fsdp2_run["dir"] / "compute-copy-fp32.pt")["model"]
    for p in result.params:
        assert _independent_combined(saved[p.fqn]) == combine([c.upcast_hash for c in result.compute[p.fqn]])
        assert _independent_combined(saved[p.fqn]) != combine([m.hash for m in result.masters[p.fqn]])


def test_compute_copy_stored_as_bf16_is_caught(fsdp2_run: dict[str, Any]) -> None:
    result: ProbeResult = fsdp2_run["compute-copy-bf16"]
    report = judge_probe(result)
    assert set(verdicts(result).values()) == {"compute-copy"}
    assert codes(report) == {"probe.saved-compute-copy": {p.fqn for p in result.params}}
    saved = vetted_torch_load(fsdp2_run["dir"] / "compute-copy-bf16.pt")["model"]
    for p in result.params:
        assert saved[p.fqn].dtype == torch.bfloat16
        assert _independent_combined(saved[p.fqn]) == combine([c.hash for c in result.compute[p.fqn]])
    # The table puts the three points side by side: the saved cell repeats the compute cell's hash.
    row = next(r for r in report.extra["sections"][0]["rows"] if r[0] == "head.weight")
    assert row[4].split()[1] == row[3].split()[1] != row[2].split()[1]


def test_a_parameter_forward_did_not_show_is_judged_by_the_rounded_master(fsdp2_run: dict[str, Any]) -> None:
    from dataclasses import replace

    full: ProbeResult = fsdp2_run["compute-copy-fp32"]
    partial = replace(full, compute={k: v for k, v in full.compute.items() if k != "head.weight"})
    report = judge_probe(partial)
    head = next(p for p in report.extra["probe"]["parameters"] if p["name"] == "head.weight")
    # The master rounded to the compute dtype the other parameters were seen in, upcast: still the compute copy.
    assert head["verdict"] == "compute-copy-upcast" and "did not show" in head["detail"]
    assert head["compute"] is None
    assert ("probe.not-observed", "head.weight") in {(f.code, f.subject) for f in report.findings}
    # Without any observation (never armed) the same tensor is only "rounded": the compute dtype is unknown.
    unarmed = replace(full, compute={}, armed=False)
    assert set(verdicts(unarmed).values()) == {"rounded"}


def test_fp16_rounded_masters_are_a_mismatch_not_a_compute_copy(fsdp2_run: dict[str, Any]) -> None:
    result: ProbeResult = fsdp2_run["fp16-copy"]
    report = judge_probe(result)
    v = verdicts(result)
    assert set(v.values()) == {"rounded"}
    assert set(codes(report)) == {"probe.mismatch"}
    assert "float16" in next(f.message for f in report.findings if f.subject == "head.weight")


def test_state_dicts_in_memory(fsdp2_run: dict[str, Any]) -> None:
    # get_state_dict's DTensors (laid out like the masters) and gathered full tensors: both faithful.
    assert set(verdicts(fsdp2_run["state-dict-dtensor"]).values()) == {"faithful"}
    assert set(verdicts(fsdp2_run["state-dict-full"]).values()) == {"faithful"}
    broken = fsdp2_run["state-dict-broken"]
    report = judge_probe(broken)
    v = verdicts(broken)
    assert v["head.weight"] == "not-saved"
    assert v["blocks.0.mlp.fc.weight"] == "mismatch"
    assert sum(x == "faithful" for x in v.values()) == N_PARAMS - 2
    msg = next(f.message for f in report.findings if f.subject == "blocks.0.mlp.fc.weight")
    assert "ranks [1]" in msg  # only rank 1's shard holds the changed element
    assert codes(report) == {"probe.not-saved": {"head.weight"}, "probe.mismatch": {"blocks.0.mlp.fc.weight"}}


def test_a_checkpoint_one_rank_cannot_read_fails_on_every_rank(fsdp2_run: dict[str, Any]) -> None:
    # The job went on to its next collectives afterwards, so rank 1 raised too (else the launch had hung).
    message = fsdp2_run["unseen-error"]
    assert message is not None and message.startswith("rank 1: saved checkpoint")
    assert "not-on-this-rank does not exist" in message and "rank 0" not in message


def test_compute_copies_recorded_before_an_update_are_flagged(fsdp2_run: dict[str, Any]) -> None:
    report = judge_probe(fsdp2_run["stale"])
    stale = codes(report).get("probe.compute-not-master", set())
    # AdamW moves every parameter in a step, so every recorded compute copy is now out of date.
    assert stale == {p.fqn for p in fsdp2_run["stale"].params}
    assert all(f.severity is Severity.WARNING for f in report.findings if f.code == "probe.compute-not-master")


def test_json_report_carries_the_three_points(fsdp2_run: dict[str, Any]) -> None:
    from ckptaudit.report import OutputFormat, render

    buf = io.StringIO()
    render(judge_probe(fsdp2_run["compute-copy-bf16"]), OutputFormat.JSON, buf)
    doc = json.loads(buf.getvalue())
    assert doc["command"] == "probe"
    probe = doc["probe"]
    assert probe["schema"] == 1 and probe["world_size"] == 2 and probe["wrapper"] == "fsdp2"
    assert probe["verdicts"] == {"compute-copy": N_PARAMS}
    head = next(p for p in probe["parameters"] if p["name"] == "head.weight")
    assert head["master"]["dtype"] == "float32" and head["compute"]["dtype"] == "bfloat16"
    assert head["saved"]["hash"] == head["compute"]["hash"] != head["master"]["hash"]
    assert [s["region"] for s in head["master"]["shards"]] == [
        {"offsets": [0, 0], "sizes": [32, 32]}, {"offsets": [32, 0], "sizes": [32, 32]}]


# -- low-precision masters, DDP, FSDP2 without mixed precision, FSDP1 -------------------------------------------


def test_low_precision_masters_are_a_contract_not_a_defect(tmp_path: Path) -> None:
    result = launch(_jobs().low_precision, 2, (str(tmp_path), 3), timeout_s=300)[0]["documented"]
    report = judge_probe(result)
    assert set(verdicts(result).values()) == {"faithful"}
    assert {f.code for f in report.findings} == {"probe.low-precision-masters"}
    assert not report.fails(Severity.WARNING)
    assert report.contract is not None and report.contract.master_dtype == "bfloat16"
    assert all(m.dtype == "bfloat16" for shards in result.masters.values() for m in shards)


def test_ddp_and_fsdp2_without_mixed_precision(tmp_path: Path) -> None:
    results = launch(_jobs().ddp_and_fsdp2_fp32, 2, (str(tmp_path), 3), timeout_s=300)[0]
    ddp = results["ddp-documented"]
    assert ddp.wrapper == "ddp" and set(verdicts(ddp).values()) == {"faithful"}
    assert judge_probe(ddp).findings == ()
    # Replicas: each rank's region is the whole tensor, and the replicas agree.
    for shards in ddp.masters.values():
        assert shards[0].hash == shards[1].hash and shards[0].region.sizes == shards[0].local_shape
    # DDP computes in fp32: a bf16 copy of the weights is rounded, but it is not the compute copy.
    assert {c[0].dtype for c in ddp.compute.values()} == {"float32"}
    assert set(verdicts(results["ddp-bf16"]).values()) == {"rounded"}
    fp32 = results["fsdp2-fp32-documented"]
    assert fp32.wrapper == "fsdp2" and judge_probe(fp32).findings == ()
    assert {c[0].dtype for c in fp32.compute.values()} == {"float32"}


def test_fsdp1_use_orig_params(tmp_path: Path) -> None:
    results = launch(_jobs().fsdp1, 2, (str(tmp_path), 3), timeout_s=300)[0]
    doc = results["documented"]
    assert doc.wrapper == "fsdp1"
    assert judge_probe(doc).findings == (), [f.message for f in judge_probe(doc).findings]
    assert set(verdicts(doc).values()) == {"faithful"}
    # FSDP1 shards the flat parameter at arbitrary elements: each rank's regions are element ranges that
    # together cover every parameter exactly once.
    for p in doc.params:
        covered = sum(m.region.numel for m in doc.masters[p.fqn])
        assert covered == torch.Size(p.shape).numel(), p.fqn
    assert {c[0].dtype for c in doc.compute.values()} == {"bfloat16"}
    assert not any(f.code == "probe.compute-not-master" for f in judge_probe(doc).findings)
    assert set(verdicts(results["rounded-upcast"]).values()) == {"compute-copy-upcast"}
    assert "use_orig_params=True" in results["flat-error"] and "_flat_param" in results["flat-error"]
    assert "ShardedTensor" in results["sharded-tensor-error"] and "pass its path" in results["sharded-tensor-error"]


# -- plain module, in this process --------------------------------------------------------------------------


def test_plain_module_under_autocast_without_a_process_group() -> None:
    from ckptaudit.recipes.tinygpt import GPTConfig, TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(dropout=0.0))
    probe = Probe(model)
    assert probe.wrapper == "plain" and not probe.armed
    idx = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16), probe.armed_forward():
        model(idx)
    assert not probe.armed  # the hooks are gone after the forward
    probe.record_masters()
    probe.record_saved(model.state_dict())
    result = probe.result()
    assert result is not None and result.autocast == "bfloat16"
    assert set(verdicts(result).values()) == {"faithful"}
    # Autocast casts inside each op: the parameter entering forward is the fp32 master itself.
    assert {c[0].dtype for c in result.compute.values()} == {"float32"}
    probe.record_saved({"state_dict": {k: v.bfloat16() for k, v in model.state_dict().items()}})
    assert set(verdicts(probe.result()).values()) == {"rounded"}  # type: ignore[arg-type]


def test_unarmed_probe_installs_no_hooks() -> None:
    from ckptaudit.recipes.tinygpt import GPTConfig, TinyGPT

    model = TinyGPT(GPTConfig(dropout=0.0))

    def hooks() -> int:
        return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())

    before = hooks()
    probe = Probe(model)
    assert hooks() == before
    probe.arm()
    assert hooks() > before
    model(torch.randint(0, 64, (1, 8)))
    assert hooks() == before
    model(torch.randint(0, 64, (1, 8)))  # a second forward records nothing new
    assert len(probe.result().compute) == N_PARAMS  # type: ignore[union-attr]


# -- CLI ------------------------------------------------------------------------------------------------------


def test_cli_probe_catches_the_compute_copy_exporter(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    rc = main(["probe", "--exporter", "ckptaudit.exporters:compute_copy_bf16", "--steps", "2", "--format", "json",
               "--out", str(tmp_path)], stdout=out, stderr=err)
    assert rc == 1, err.getvalue()
    doc = json.loads(out.getvalue())
    assert doc["probe"]["verdicts"] == {"compute-copy": N_PARAMS}
    assert doc["probe"]["meta"]["exporter"] == "ckptaudit.exporters:compute_copy_bf16"
    assert (tmp_path / "checkpoint").is_file()  # --out keeps what the exporter wrote


@pytest.mark.parametrize(("argv", "needle"), [
    (["--recipe", "ckptaudit.recipes.tinygpt:nope"], "has no attribute 'nope'"),
    (["--exporter", "no_such_module:export"], "cannot import module no_such_module"),
    (["--nproc", "0"], "--nproc must be at least 1"),
])
def test_cli_probe_usage_errors(argv: list[str], needle: str) -> None:
    err = io.StringIO()
    assert main(["probe", *argv], stdout=io.StringIO(), stderr=err) == 2
    assert needle in err.getvalue()
