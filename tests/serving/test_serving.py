"""Serving export behind a quality gate, and the audit telling serving artifacts from training checkpoints.

Every export here reads the real FSDP2 checkpoint of the session fixture (a DCP directory written by the
documented path from a 2-rank run of the built-in recipe) and runs the real gate on the recipe's model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ckptaudit.auditing.judge import AuditOptions, run_audit
from ckptaudit.auditing.scan import scan_checkpoint
from ckptaudit.checks.artifact import HASH_PREFIX, manifest_hash
from ckptaudit.cli import SERVING_DTYPES
from ckptaudit.formats import open_checkpoint
from ckptaudit.formats.dcp.reader import check_metadata_safe
from ckptaudit.formats.torchload import materialize
from ckptaudit.layouts import interpret
from ckptaudit.serving.export import (
    EXPORT_DTYPES,
    INDEX_FILE,
    ExportError,
    ExportOptions,
    export_serving,
    parse_size,
    plan_shards,
    write_artifact,
)
from ckptaudit.serving.gate import GateThresholds, compare_logits, judge_gate, next_token_targets
from runs import cli

RECIPE = "ckptaudit.recipes.tinygpt:recipe"


def export(src: Path, out: Path, *extra: str) -> tuple[int, dict[str, Any], str]:
    code, stdout, err = cli("export-serving", str(src), "--recipe", RECIPE, "--out", str(out), "--format", "json",
                            "--no-progress", *extra)
    return code, json.loads(stdout) if stdout else {}, err


def codes(report: dict[str, Any]) -> list[str]:
    return [f["code"] for f in report["findings"]]


def audit_json(path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    code, out, err = cli("audit", str(path), "--format", "json", "--no-progress", *extra)
    assert out, err
    return code, json.loads(out)


def training_weights(src: Path) -> dict[str, torch.Tensor]:
    with open_checkpoint(str(src)) as ckpt:
        view = interpret(ckpt)
        assert view.model is not None
        return {k: materialize(r.data, ckpt.maps) for k, r in view.model.params.items()}


def dcp_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """The model weights as torch.distributed.checkpoint itself reads them (independently of ckptaudit's reader)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    check_metadata_safe(str(path))
    md = dcp.FileSystemReader(str(path)).read_metadata()
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
          if k.startswith("model.") and hasattr(v, "size")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
        dcp.load(sd, checkpoint_id=str(path))
    return {k.removeprefix("model."): v for k, v in sd.items()}


def metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as fh:
        return dict(fh.metadata() or {})


def leftovers(parent: Path) -> list[str]:
    return [n for n in os.listdir(parent) if ".tmp-" in n]


# ----------------------------------------------------------------------------------------------------------------
# The export and the audit of what it wrote


def test_bf16_export_passes_the_gate_is_exactly_the_rounded_weights_and_audits_clean_as_serving(
        fsdp_run: dict[str, Any], tmp_path: Path) -> None:
    src = fsdp_run["dir"] / "faithful"
    out = tmp_path / "serving"
    code, report, err = export(src, out)
    assert code == 0, err
    assert report["serving"]["gate"]["passed"] is True
    assert sorted(os.listdir(out)) == ["ckptaudit.passport.json", "model.safetensors"]
    # Its passport: audited as a serving artifact, with the gate's results and where it came from.
    from ckptaudit.passport import read_passport, verify

    passport = read_passport(str(out / "ckptaudit.passport.json"))
    assert passport.artifact == "serving" and passport.verdict == "pass" and not passport.signed
    assert passport.serving is not None and passport.serving.gate["passed"] is True
    assert passport.serving.source == str(src.resolve()) and passport.serving.source_passport_digest is None
    assert [f.name for f in passport.files] == ["model.safetensors"]
    assert verify(str(out), expect="serving").ok and not verify(str(out)).ok  # not a training checkpoint
    # The artifact holds the training weights rounded to bf16, nothing else and nothing lost besides that.
    exported = load_file(str(out / "model.safetensors"))
    weights = dcp_model_weights(src)
    assert set(exported) == set(weights) == set(fsdp_run["params"])
    for name, w in weights.items():
        assert exported[name].dtype == torch.bfloat16
        assert torch.equal(exported[name], w.to(torch.bfloat16)), name
    meta = metadata(out / "model.safetensors")
    assert meta["artifact"] == "serving" and meta["dtype"] == "bfloat16" and meta["format"] == "pt"
    assert meta["source"] == str(src.resolve())
    scanned = scan_checkpoint(str(src))
    try:
        expected = HASH_PREFIX + manifest_hash((r.name, r.dtype, r.shape, r.hash or "") for r in scanned.records)
    finally:
        scanned.close()
    assert meta["source_hash"] == expected
    gate = json.loads(meta["quality_gate"])
    assert gate["passed"] is True and gate["failures"] == [] and gate["forced"] is False
    assert gate["metrics"]["top1_agreement"] >= GateThresholds().min_top1
    assert meta["tool"].startswith("ckptaudit ")

    code, doc = audit_json(out, "--expect", "serving")
    assert code == 0 and doc["findings"] == [], doc["findings"]
    # The same file offered as a training checkpoint is refused, naming where to resume from.
    code, doc = audit_json(out)
    assert code == 1
    serving = [f for f in doc["findings"] if f["code"] == "artifact.serving"]
    assert serving and serving[0]["severity"] == "error" and str(src.resolve()) in serving[0]["message"]


def test_a_format_too_coarse_fails_the_gate_writes_nothing_and_exits_1(fsdp_run: dict[str, Any],
                                                                       tmp_path: Path) -> None:
    out = tmp_path / "serving"
    code, report, _ = export(fsdp_run["dir"] / "faithful", out, "--dtype", "float8_e5m2")
    assert code == 1
    assert not out.exists() and leftovers(tmp_path) == []
    failed = {f["subject"] for f in report["findings"] if f["code"] == "gate.failed"}
    assert {"max_rel_diff", "min_cosine"} <= failed
    assert "nothing written" in report["summary"]


def test_a_broken_conversion_fails_the_gate_and_writes_nothing(fsdp_run: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "serving"
    code, report, err = export(fsdp_run["dir"] / "faithful", out, "--convert", "serving_faults:zero_matrix")
    assert code == 1, err
    assert not out.exists() and leftovers(tmp_path) == []
    assert "gate.failed" in codes(report)
    # A conversion that does not deliver the dtype it was asked for is a usage error, not an artifact.
    code, _, err = cli("export-serving", str(fsdp_run["dir"] / "faithful"), "--recipe", RECIPE, "--out",
                       str(out), "--convert", "serving_faults:wrong_dtype")
    assert code == 2 and "must return a tensor of dtype bfloat16" in err
    assert not out.exists()


def test_weights_beyond_fp16_range_fail_the_fp16_gate_but_not_bf16(fsdp_run: dict[str, Any],
                                                                   tmp_path: Path) -> None:
    # A copy of the checkpoint with one MLP rescaled: x 2**16 in, / 2**16 out. In fp32 (and bf16, which has fp32's
    # range) the model computes nearly the same function; in fp16 the hidden activations overflow.
    sd = training_weights(fsdp_run["dir"] / "faithful")
    sd["blocks.0.mlp.fc.weight"] = sd["blocks.0.mlp.fc.weight"] * 2.0**16
    sd["blocks.0.mlp.fc.bias"] = sd["blocks.0.mlp.fc.bias"] * 2.0**16
    sd["blocks.0.mlp.out.weight"] = sd["blocks.0.mlp.out.weight"] / 2.0**16
    src = tmp_path / "rescaled.pt"
    torch.save({"model": sd}, src)
    code, report, _ = export(src, tmp_path / "fp16", "--dtype", "float16")
    assert code == 1 and not (tmp_path / "fp16").exists()
    assert report["serving"]["gate"]["metrics"]["nonfinite"] > 0
    assert any("NaN or infinite" in f["message"] for f in report["findings"])
    code, _, err = export(src, tmp_path / "bf16", "--dtype", "bfloat16")
    assert code == 0, err


def test_force_writes_the_failed_gate_into_the_metadata_and_audit_reports_it(fsdp_run: dict[str, Any],
                                                                             tmp_path: Path) -> None:
    out = tmp_path / "serving"
    code, report, _ = export(fsdp_run["dir"] / "faithful", out, "--dtype", "float8_e4m3fn", "--force")
    assert code == 1
    assert {"gate.failed", "gate.forced"} <= set(codes(report))
    exported = load_file(str(out / "model.safetensors"))
    assert {t.dtype for t in exported.values()} == {torch.float8_e4m3fn}
    gate = json.loads(metadata(out / "model.safetensors")["quality_gate"])
    assert gate["passed"] is False and gate["forced"] is True and gate["failures"]
    code, doc = audit_json(out, "--expect", "serving")
    assert code == 1
    failed = [f for f in doc["findings"] if f["code"] == "artifact.gate-failed"]
    assert failed and failed[0]["severity"] == "error" and "--force" in failed[0]["message"]


def test_keep_fp32_patterns_keep_those_tensors_in_fp32(fsdp_run: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "serving"
    code, report, err = export(fsdp_run["dir"] / "faithful", out, "--keep-fp32", "*ln*", "*.bias")
    assert code == 0, err
    exported = load_file(str(out / "model.safetensors"))
    weights = training_weights(fsdp_run["dir"] / "faithful")
    kept = {n for n in weights if ".ln" in n or n.startswith("ln_") or n.endswith(".bias")}
    assert {n for n, t in exported.items() if t.dtype == torch.float32} == kept
    for name in kept:
        assert torch.equal(exported[name], weights[name])
    assert sorted(report["serving"]["kept_fp32"]) == sorted(kept)
    assert json.loads(metadata(out / "model.safetensors")["keep_fp32"]) == ["*ln*", "*.bias"]
    code, doc = audit_json(out, "--expect", "serving")
    assert code == 0 and doc["findings"] == []


def test_sharded_export_has_an_index_and_audits_clean(fsdp_run: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "serving"
    code, report, err = export(fsdp_run["dir"] / "faithful", out, "--max-shard-size", "16KiB")
    assert code == 0, err
    shards = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    assert len(shards) > 2 and INDEX_FILE in os.listdir(out)
    assert sorted(f["name"] for f in report["serving"]["files"]) == sorted([*shards, INDEX_FILE])
    index = json.loads((out / INDEX_FILE).read_text())
    union: dict[str, str] = {}
    for shard in shards:
        assert (out / shard).stat().st_size <= 16 * 1024 + 4096  # the data limit plus the header
        meta = metadata(out / shard)
        assert meta["artifact"] == "serving" and json.loads(meta["quality_gate"])["passed"] is True
        union.update({name: shard for name in load_file(str(out / shard))})
    assert index["weight_map"] == union and set(union) == set(fsdp_run["params"])
    assert index["metadata"]["artifact"] == "serving"
    code, doc = audit_json(out, "--expect", "serving")
    assert code == 0 and doc["findings"] == [], doc["findings"]
    code, doc = audit_json(out)
    assert code == 1 and "artifact.serving" in codes(doc)


def test_shards_from_another_export_and_changed_weights_are_caught(fsdp_run: dict[str, Any], tmp_path: Path,
                                                                   copy_of: Any) -> None:
    src = fsdp_run["dir"] / "faithful"
    assert export(src, tmp_path / "bf16", "--max-shard-size", "16KiB")[0] == 0
    assert export(src, tmp_path / "fp16", "--max-shard-size", "16KiB", "--dtype", "float16")[0] == 0
    mixed = tmp_path / "mixed"
    os.rename(tmp_path / "bf16", mixed)
    shard = sorted(n for n in os.listdir(mixed) if n.endswith(".safetensors"))[-1]
    os.replace(tmp_path / "fp16" / shard, mixed / shard)
    code, doc = audit_json(mixed, "--expect", "serving")
    assert code == 1 and "artifact.mixed-shards" in codes(doc)
    # One tensor edited after the export, the metadata kept: the gate no longer covers these weights.
    assert export(src, tmp_path / "edited")[0] == 0
    path = tmp_path / "edited" / "model.safetensors"
    meta = metadata(path)
    tensors = load_file(str(path))
    tensors["head.weight"] = tensors["head.weight"] * 2
    save_file(tensors, str(path), metadata=meta)
    code, doc = audit_json(tmp_path / "edited", "--expect", "serving")
    assert code == 1 and codes(doc) == ["artifact.weights-changed"]


# ----------------------------------------------------------------------------------------------------------------
# The audit of serving files other tools wrote, and of training checkpoints offered as serving


def test_plain_bf16_safetensors_records_no_quality_gate(fsdp_run: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in training_weights(fsdp_run["dir"] / "faithful").items()},
              str(path))
    code, doc = audit_json(path, "--expect", "serving")
    assert code == 0 and codes(doc) == ["artifact.no-quality-gate"]
    assert doc["findings"][0]["severity"] == "warning"
    assert audit_json(path, "--expect", "serving", "--fail-on", "warning")[0] == 1
    # A serving mark without a gate is the same warning.
    save_file({"w": torch.ones(2, dtype=torch.bfloat16)}, str(path), metadata={"artifact": "serving"})
    assert codes(audit_json(path, "--expect", "serving")[1]) == ["artifact.no-quality-gate"]
    # A gate that is not a JSON object saying passed=true is not a passed gate.
    for gate, code in (("{not json", "integrity.corrupt"), ('{"passed": "yes"}', "artifact.gate-failed"),
                       ('{"passed": false, "failures": "all"}', "artifact.gate-failed"), ("[1]", "artifact.gate-failed")):
        save_file({"w": torch.ones(2, dtype=torch.bfloat16)}, str(path),
                  metadata={"artifact": "serving", "quality_gate": gate})
        result, doc = audit_json(path, "--expect", "serving")
        assert result == 1 and codes(doc) == [code], (gate, doc["findings"])


def test_a_training_checkpoint_is_not_a_serving_artifact(fsdp_run: dict[str, Any]) -> None:
    report = run_audit(str(fsdp_run["dir"] / "faithful"), AuditOptions(expect="serving"))
    assert [f.code for f in report.findings] == ["artifact.not-serving"]
    assert "optimizer" in report.findings[0].message


# ----------------------------------------------------------------------------------------------------------------
# Bad input: a clear message and exit 2, nothing touched


def test_usage_errors_name_the_problem_and_touch_nothing(fsdp_run: dict[str, Any], tmp_path: Path) -> None:
    src = str(fsdp_run["dir"] / "faithful")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    code, _, err = cli("export-serving", src, "--recipe", RECIPE, "--out", str(taken))
    assert code == 2 and "already exists and is not an empty directory" in err
    assert os.listdir(taken) == ["keep.txt"] and (taken / "keep.txt").read_text() == "mine"
    cases = [
        (["--recipe", "no.such.module:recipe"], "cannot import module no.such.module"),
        (["--recipe", "ckptaudit.recipes.tinygpt:GPTConfig"], "has no build_model()"),
        (["--recipe", RECIPE, "--keep-fp32", "*nothing*"], "--keep-fp32 '*nothing*' matches no tensor"),
        (["--recipe", RECIPE, "--max-shard-size", "lots"], "--max-shard-size 'lots' is not a size"),
        (["--recipe", RECIPE, "--min-cosine", "2"], "--min-cosine must be between 0 and 1"),
        (["--recipe", RECIPE, "--device", "gpu"], "--device 'gpu' is not a torch device"),
        (["--recipe", RECIPE, "--eval-batch", str(tmp_path / "missing.pt")], "no such file"),
    ]
    for extra, message in cases:
        code, _, err = cli("export-serving", src, "--out", str(tmp_path / "new"), *extra)
        assert code == 2 and message in err, (extra, err)
        assert not (tmp_path / "new").exists()
    code, _, err = cli("export-serving", str(tmp_path / "nope"), "--recipe", RECIPE, "--out", str(tmp_path / "n"))
    assert code == 2 and "no such file or directory" in err


def test_a_recipe_that_does_not_fit_the_checkpoint_is_refused(fsdp_run: dict[str, Any], tmp_path: Path) -> None:
    bigger = tmp_path / "bigger.py"
    bigger.write_text("from ckptaudit.recipes.tinygpt import GPTConfig, TinyGPTRecipe\n"
                      "recipe = TinyGPTRecipe(cfg=GPTConfig(d_model=48))\n")
    with pytest.raises(ExportError, match=r"tok_emb.weight has shape \[64, 32\].*expects \[64, 48\]"):
        export_serving(str(fsdp_run["dir"] / "faithful"), ExportOptions(recipe=f"{bigger}:recipe",
                                                                          out=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


def test_a_serving_artifact_is_not_exported_again(fsdp_run: dict[str, Any], tmp_path: Path) -> None:
    assert export(fsdp_run["dir"] / "faithful", tmp_path / "serving")[0] == 0
    code, _, err = cli("export-serving", str(tmp_path / "serving"), "--recipe", RECIPE, "--out",
                       str(tmp_path / "again"))
    assert code == 2 and "already a serving artifact" in err and "faithful" in err


def test_user_eval_batch_is_loaded_safely_and_bad_tokens_are_a_clear_error(fsdp_run: dict[str, Any],
                                                                           tmp_path: Path) -> None:
    batch = tmp_path / "batch.pt"
    torch.save(torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(1)), batch)
    code, report, err = export(fsdp_run["dir"] / "faithful", tmp_path / "out", "--eval-batch", str(batch))
    assert code == 0, err
    assert report["serving"]["gate"]["metrics"]["positions"] == 3 * 16
    assert json.loads(metadata(tmp_path / "out" / "model.safetensors")["quality_gate"])["batch"] == "batch.pt"
    torch.save(torch.full((2, 9), 1000), batch)
    code, _, err = cli("export-serving", str(fsdp_run["dir"] / "faithful"), "--recipe", RECIPE, "--out",
                       str(tmp_path / "out2"), "--eval-batch", str(batch))
    assert code == 2 and "failed on the evaluation batch" in err and not (tmp_path / "out2").exists()


# ----------------------------------------------------------------------------------------------------------------
# Pure parts: metrics, thresholds, sizes, the atomic writer


def test_gate_metrics_on_known_logits() -> None:
    ref = torch.tensor([[[2.0, 1.0, 0.0], [0.0, 4.0, 1.0]]])
    same = compare_logits(ref, ref.clone(), torch.tensor([[1, 1]]))
    assert same.max_abs_diff == 0 and same.max_rel_diff == 0 and same.top1_agreement == 1
    assert same.min_cosine == pytest.approx(1.0) and same.loss_diff == 0
    assert judge_gate(same, GateThresholds()).passed
    shifted = ref.clone()
    shifted[0, 0, 1] = 3.0  # position 0 now prefers token 1: error 2 against a scale of 2
    m = compare_logits(ref, shifted, torch.tensor([[1, 1]]))
    assert m.max_abs_diff == 2 and m.max_rel_diff == 1 and m.top1_agreement == 0.5
    assert m.loss_diff is not None and m.loss_diff > 0
    result = judge_gate(m, GateThresholds())
    assert not result.passed and {c.metric for c in result.checks if not c.passed} >= {"max_abs_diff", "top1_agreement"}
    assert judge_gate(m, GateThresholds(max_abs_diff=2, max_rel_diff=1, min_cosine=0, min_top1=0.5,
                                   max_loss_diff=10)).passed


def test_the_loss_difference_alone_can_fail_the_gate() -> None:
    """Logits whose every other metric is within lax limits but whose next-token loss moved: the gate fails on
    --max-loss-diff alone, with the value computed by hand (log-sum-exp), and passes once the limit is above it."""
    import math

    ref = torch.tensor([[[2.0, 1.0, 0.0], [0.0, 4.0, 1.0], [1.0, 1.0, 3.0]]])
    exported = ref * 1.5  # sharper, same argmax everywhere
    targets = torch.tensor([[0, 2, 2]])

    def ce(rows: list[list[float]], tgt: list[int]) -> float:
        return sum(math.log(sum(math.exp(v) for v in row)) - row[t] for row, t in zip(rows, tgt, strict=True)) / 3

    want = abs(ce(exported[0].tolist(), [0, 2, 2]) - ce(ref[0].tolist(), [0, 2, 2]))
    m = compare_logits(ref, exported, targets)
    assert m.loss_diff == pytest.approx(want, rel=1e-9) and want > 0.05
    lax = dict(max_abs_diff=1e9, max_rel_diff=1e9, min_cosine=0.0, min_top1=0.0)
    result = judge_gate(m, GateThresholds(**lax, max_loss_diff=0.05))
    assert not result.passed
    assert [c.metric for c in result.checks if not c.passed] == ["loss_diff"]
    assert len(result.failures) == 1 and "--max-loss-diff" in result.failures[0]
    assert judge_gate(m, GateThresholds(**lax, max_loss_diff=want * 1.01)).passed
    # Without next-token targets there is no loss check at all (reported as gate.no-loss, not as a pass on it).
    untargeted = compare_logits(ref, exported)
    assert untargeted.loss_diff is None
    assert "loss_diff" not in {c.metric for c in judge_gate(untargeted, GateThresholds(**lax, max_loss_diff=0.0)).checks}


def test_non_finite_exported_logits_fail_whatever_the_thresholds() -> None:
    ref = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0))
    bad = ref.clone()
    bad[1, 2, 3] = float("inf")
    m = compare_logits(ref, bad)
    lax = GateThresholds(max_abs_diff=1e30, max_rel_diff=1e30, min_cosine=0, min_top1=0, max_loss_diff=1e30)
    result = judge_gate(m, lax)
    assert m.nonfinite == 1 and not result.passed and "NaN or infinite" in result.failures[0]
    assert json.dumps(result.as_dict(), allow_nan=False)  # the metadata stays valid JSON


def test_next_token_targets_align_with_the_logits() -> None:
    batch = torch.arange(10).reshape(2, 5)
    assert torch.equal(next_token_targets(batch, torch.zeros(2, 4, 7)), batch[:, 1:])  # type: ignore[arg-type]
    full = next_token_targets(batch, torch.zeros(2, 5, 7))
    assert full is not None and torch.equal(full[:, :-1], batch[:, 1:]) and bool((full[:, -1] == -100).all())
    assert next_token_targets(batch.float(), torch.zeros(2, 4, 7)) is None
    assert next_token_targets(batch, torch.zeros(2, 3, 7)) is None


def test_parse_size() -> None:
    assert parse_size("2GiB") == 2 << 30 and parse_size("500MB") == 500_000_000 and parse_size("4096") == 4096
    assert parse_size("1.5 kb") == 1500
    with pytest.raises(ExportError, match="not a size"):
        parse_size("-3")


def test_cli_dtype_choices_match_the_exporter() -> None:
    assert SERVING_DTYPES == list(EXPORT_DTYPES)


def test_a_failed_write_leaves_nothing_behind(tmp_path: Path) -> None:
    out = tmp_path / "serving"
    out.mkdir()  # an empty directory may be the target; it must still be there, empty, after a failure
    tensors = {"a": torch.ones(4, 4), "b": torch.ones(4, 4).t()[:, :2]}  # "b" is not contiguous: save_file refuses
    with pytest.raises(ValueError):
        write_artifact(str(out), tensors, {"artifact": "serving"}, max_bytes=64)
    assert os.listdir(out) == [] and leftovers(tmp_path) == []
    files = write_artifact(str(out), {"a": torch.ones(4, 4), "b": torch.zeros(3)}, {"artifact": "serving"}, 64)
    assert [f.name for f in files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                       INDEX_FILE]
    assert leftovers(tmp_path) == []


def test_shards_are_cut_before_the_tensor_that_would_overflow_them() -> None:
    tensors = {"big": torch.zeros(100), "a": torch.zeros(5), "b": torch.zeros(5), "c": torch.zeros(4)}  # fp32
    assert plan_shards(tensors, 40) == [["big"], ["a", "b"], ["c"]]
    assert plan_shards(tensors, 10_000) == [["big", "a", "b", "c"]]
