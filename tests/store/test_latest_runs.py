"""``ckptaudit latest`` for every way runs are saved (runs of single files, ``Guard.submit`` folders, nested stages,
an ``s3://`` prefix on a local S3 server) and the run's own evidence (a checkpoint cast to bf16 beside float32
siblings is rejected, naming them; a genuine bf16 run stays clean); the library's and the CLI's default level.

Real checkpoints: tiny models trained with AdamW and saved with ``torch.save``; a real guard; moto's S3 server.
"""

from __future__ import annotations

import inspect
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptaudit.cli import main
from real_checkpoints import trained


def _save(path: Path, *, step: int | None, key: str = "step", cast: torch.dtype | None = None) -> Path:
    """A tiny model trained 2 AdamW steps, saved with torch.save (``key``: the step's key; ``cast``: the model and
    the optimizer moments cast to it, as an exporter of a mixed-precision run's state might)."""
    torch.manual_seed(step or 0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    osd = opt.state_dict()
    if cast is not None:
        state = {k: v.to(cast) for k, v in state.items()}
        osd["state"] = {i: {k: (v.to(cast) if v.is_floating_point() and v.dim() > 0 else v) for k, v in s.items()}
                        for i, s in osd["state"].items()}
    doc: dict[str, Any] = {"model": state, "optimizer": osd}
    if step is not None:
        doc[key] = step
    torch.save(doc, path)
    return path


def _latest(root: str, *args: str) -> tuple[int, dict[str, Any]]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["latest", root, "--format", "json", "--no-progress", *args], stdout=out, stderr=err)
    assert code in (0, 1), err.getvalue()
    return code, json.loads(out.getvalue())


def _rows(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in doc["candidates"]}


# --------------------------------------------------------------------------------------------------------------
# every way runs are saved


def test_a_run_of_pt_files_names_the_newest_and_says_what_it_skipped(tmp_path: Path) -> None:
    trained(tmp_path / "ckpt-0002.pt")
    trained(tmp_path / "ckpt-0004.pt")
    (tmp_path / "train.log").write_text("loss 1.0\n")
    (tmp_path / "ckpt-0004.pt.passport.json").write_text("{}")
    code, doc = _latest(str(tmp_path))
    assert code == 0 and doc["latest"] == str(tmp_path / "ckpt-0004.pt") and doc["latest_step"] == 4
    rows = _rows(doc)
    assert rows["ckpt-0004.pt"]["layout"] == "torch.save" and rows["ckpt-0004.pt"]["step_from"] == "name"
    assert doc["skipped"] == [{"name": "ckpt-0004.pt.passport.json", "reason": "the passport of ckpt-0004.pt"},
                              {"name": "train.log", "reason": "not a checkpoint file (.log)"}]


@pytest.mark.parametrize(("name", "step"), [("ckpt-0004.pt", 4), ("model_step=4.pt", 4), ("epoch=1-step=40.ckpt", 40),
                                            ("global_step12.pth", 12), ("weights_7.bin", 7), ("iter_0003.safetensors", 3),
                                            ("last.pt", None)])
def test_the_step_is_read_from_the_name(name: str, step: int | None) -> None:
    from ckptaudit.latest.candidates import step_from_name

    assert step_from_name(name) == step


def test_where_the_name_has_no_step_it_is_read_from_the_file_without_unpickling(tmp_path: Path) -> None:
    _save(tmp_path / "ckpt-0004.pt", step=4)
    _save(tmp_path / "final.pt", step=9, key="global_step")  # the newest, though its name says nothing
    code, doc = _latest(str(tmp_path))
    assert code == 0 and doc["latest"] == str(tmp_path / "final.pt") and doc["latest_step"] == 9
    assert _rows(doc)["final.pt"]["step_from"] == "the file's step key"


def test_a_guard_submit_folder_lists_the_good_checkpoints_and_the_quarantined_one(tmp_path: Path) -> None:
    from ckptaudit.integrations.guard import Guard

    guard = Guard(on_failure="warn", background="thread")
    for step in (2, 4):
        guard.submit(str(trained(tmp_path / f"ckpt-{step:04d}.pt")), step=step)
    guard.submit(str(trained(tmp_path / "ckpt-0006.pt", rounded=True)), step=6)
    assert guard.close(120)
    assert [v.ok for v in guard.verdicts] == [True, True, False]
    code, doc = _latest(str(tmp_path), "--all")
    assert code == 0 and doc["latest"] == str(tmp_path / "ckpt-0004.pt")
    rows = _rows(doc)
    assert set(rows) == {"ckpt-0006.pt.quarantined", "ckpt-0004.pt", "ckpt-0002.pt"}
    assert rows["ckpt-0006.pt.quarantined"]["layout"] == "quarantined"
    assert [f["code"] for f in rows["ckpt-0006.pt.quarantined"]["findings"]] == ["guard.quarantined"]
    assert rows["ckpt-0002.pt"]["resumable"] is True
    skipped = {s["name"]: s["reason"] for s in doc["skipped"]}
    assert skipped["ckpt-0004.pt.ckptaudit.json"] == "the guard's report of ckpt-0004.pt"
    assert skipped["ckpt-0006.pt.quarantined.ckptaudit.json"].startswith("the guard's report")


def test_nested_stages_are_searched_to_a_bounded_depth(tmp_path: Path) -> None:
    (tmp_path / "stage-1").mkdir()
    (tmp_path / "stage-2").mkdir()
    trained(tmp_path / "stage-1" / "ckpt-0002.pt")
    trained(tmp_path / "stage-2" / "ckpt-0004.pt")
    deep = tmp_path / "a" / "b" / "c" / "d"
    deep.mkdir(parents=True)
    trained(deep / "ckpt-0009.pt")
    trained(deep.parent / "ckpt-0003.pt")  # three levels below the root: still searched
    (tmp_path / "wandb" / "run-1").mkdir(parents=True)
    for i in range(3):
        (tmp_path / "wandb" / "run-1" / f"events-{i}.log").write_text("x")
    code, doc = _latest(str(tmp_path), "--all")
    assert code == 0 and doc["latest"] == str(tmp_path / "stage-2" / "ckpt-0004.pt")
    assert set(_rows(doc)) == {"stage-2/ckpt-0004.pt", "a/b/c/ckpt-0003.pt", "stage-1/ckpt-0002.pt"}
    assert doc["skipped"] == [{"name": "a/b/c/d", "reason": "deeper than 3 levels below the root: not searched"},
                              {"name": "wandb", "reason": "no checkpoint inside (1 entry)"}]


def test_a_folder_of_component_files_is_one_candidate_not_a_run_of_single_files(tmp_path: Path) -> None:
    from ckptaudit.latest import discover

    ckpt = tmp_path / "final"
    ckpt.mkdir()
    model = torch.nn.Linear(4, 4)
    torch.save(model.state_dict(), ckpt / "pytorch_model.bin")
    torch.save(torch.optim.AdamW(model.parameters()).state_dict(), ckpt / "optimizer.pt")
    assert [(c.name, c.layout) for c in discover(str(tmp_path))] == [("final", "directory")]
    assert [(c.name, c.layout) for c in discover(str(ckpt))] == [("final", "directory")]
    # A Trainer's output folder: its final save beside checkpoint-N/ folders, which are the candidates.
    (ckpt / "checkpoint-2").mkdir()
    torch.save(model.state_dict(), ckpt / "checkpoint-2" / "pytorch_model.bin")
    assert [(c.name, c.layout) for c in discover(str(ckpt))] == [("checkpoint-2", "huggingface-trainer")]


# --------------------------------------------------------------------------------------------------------------
# the run's evidence


def _fp32_run_then_cast(root: Path) -> None:
    for step in (2, 4, 6):
        _save(root / f"ckpt-{step:04d}.pt", step=step)
    _save(root / "ckpt-0008.pt", step=8, cast=torch.bfloat16)


def test_a_checkpoint_cast_to_bf16_after_fp32_siblings_is_rejected_naming_them(tmp_path: Path) -> None:
    _fp32_run_then_cast(tmp_path)
    code, doc = _latest(str(tmp_path))
    assert code == 0 and doc["latest"] == str(tmp_path / "ckpt-0006.pt")
    (rejected,) = [f for f in doc["findings"] if f["code"] == "contract.run-mismatch"]
    assert rejected["severity"] == "error" and rejected["subject"] == "ckpt-0008.pt/contract"
    assert rejected["message"].startswith("steps 2-6 hold float32 masters (ckpt-0006.pt: float32 parameters")
    assert "; step 8 holds bfloat16 (parameters are bfloat16 and optimizer moments are bfloat16)" in rejected["message"]
    assert rejected["evidence"]["evidence"] == "ckpt-0002.pt, ckpt-0004.pt, ckpt-0006.pt"
    # Judged alone (the flag), the same file looks like a bf16-masters run: a warning, and it is named.
    code, alone = _latest(str(tmp_path), "--no-run-evidence")
    assert code == 0 and alone["latest"] == str(tmp_path / "ckpt-0008.pt") and alone["run_evidence"] is False
    assert "contract.inferred" in {f["code"] for f in _rows(alone)["ckpt-0008.pt"]["findings"]}


def test_a_genuine_bf16_run_stays_clean(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        _save(tmp_path / f"ckpt-{step:04d}.pt", step=step, cast=torch.bfloat16)
    code, doc = _latest(str(tmp_path))
    assert code == 0 and doc["latest"] == str(tmp_path / "ckpt-0008.pt")
    assert not [f for f in _rows(doc)["ckpt-0008.pt"]["findings"] if f["severity"] == "error"]


def test_the_run_evidence_is_one_more_contract_record_after_the_checkpoints_own(tmp_path: Path) -> None:
    # An explicit --master-dtype decides over the run's evidence; the library judges a candidate alone without a run.
    from ckptaudit.latest import discover, validate

    _fp32_run_then_cast(tmp_path)
    code, doc = _latest(str(tmp_path), "--master-dtype", "bfloat16")
    assert code == 0 and doc["latest"] == str(tmp_path / "ckpt-0008.pt")
    newest = discover(str(tmp_path))[0]
    assert newest.name == "ckpt-0008.pt" and validate(newest).resumable


def test_audit_beside_the_siblings_holds_the_checkpoint_to_its_run(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptaudit
    from ckptaudit.auditing import run_evidence

    _fp32_run_then_cast(tmp_path)
    cast = str(tmp_path / "ckpt-0008.pt")
    report = ckptaudit.audit(cast)
    assert not report.ok and report.raw.contract is not None and report.raw.contract.source == "run"
    (f,) = [f for f in report.findings if f.code == "contract.run-mismatch"]
    assert f.message.startswith("steps 2-6 hold float32 masters") and "step 8 holds bfloat16" in f.message
    out, err = io.StringIO(), io.StringIO()
    assert main(["audit", cast, "--format", "json", "--no-progress"], stdout=out, stderr=err) == 1, err.getvalue()
    assert "contract.run-mismatch" in {f["code"] for f in json.loads(out.getvalue())["findings"]}
    alone = ckptaudit.audit(cast, run_evidence=False)
    assert alone.ok and "contract.inferred" in {f.code for f in alone.findings}
    assert main(["audit", cast, "--no-run-evidence", "--no-progress"], stdout=io.StringIO(),
                stderr=io.StringIO()) == 0
    # Cheap: a checkpoint that decides its own contract never reads its siblings.
    def unreadable(s: Any) -> Any:
        raise AssertionError(f"read {s.name}")

    monkeypatch.setattr(run_evidence, "masters_of", unreadable)
    assert ckptaudit.audit(str(tmp_path / "ckpt-0006.pt")).ok


def test_audit_of_a_genuine_bf16_run_stays_clean(tmp_path: Path) -> None:
    import ckptaudit

    for step in (2, 4):
        _save(tmp_path / f"ckpt-{step:04d}.pt", step=step, cast=torch.bfloat16)
    report = ckptaudit.audit(str(tmp_path / "ckpt-0004.pt"))
    assert report.ok and report.raw.contract is not None and report.raw.contract.source == "optimizer-state"


# --------------------------------------------------------------------------------------------------------------
# defaults


def test_the_library_and_the_cli_default_to_the_protecting_level(tmp_path: Path) -> None:
    import argparse

    from ckptaudit import latest
    from ckptaudit.cli import _parser

    assert latest.DEFAULT_VERIFY == "quick"  # the level that judges precision
    for fn in (latest.find_latest, latest.validate):
        assert inspect.signature(fn).parameters["verify"].default == latest.DEFAULT_VERIFY, fn
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    verify = next(a for a in sub.choices["latest"]._actions if a.dest == "verify")
    assert verify.default == latest.DEFAULT_VERIFY
    trained(tmp_path / "ckpt-0002.pt")
    trained(tmp_path / "ckpt-0004.pt", rounded=True)
    report = latest.latest_report(str(tmp_path))
    assert report.extra["verify"] == "quick" and report.extra["latest"] == str(tmp_path / "ckpt-0002.pt")
    assert latest.find_latest(str(tmp_path)).latest is not None
    assert latest.find_latest(str(tmp_path)).latest.name == "ckpt-0002.pt"  # type: ignore[union-attr]


# --------------------------------------------------------------------------------------------------------------
# an s3:// root


@pytest.fixture(scope="module")
def s3_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from ckptaudit.launch import RankContext
    from ckptaudit.recipes.tinygpt import plain_recipe
    from ckptaudit.store import save_checkpoint
    from local_s3 import local_s3

    store = tmp_path_factory.mktemp("s3-store")
    job = plain_recipe.setup(RankContext(rank=0, world_size=1, backend="gloo", shared_dir=""))
    for _ in range(2):
        plain_recipe.step(job)
        save_checkpoint(job, store)
    local = tmp_path_factory.mktemp("s3-run")
    trained(local / "ckpt-0002.pt")
    trained(local / "ckpt-0004.pt")
    trained(local / "ckpt-0006.pt", rounded=True)
    with local_s3("latest-runs") as s3:
        fs = s3.fs
        for p in sorted(local.iterdir()):
            fs.put(str(p), f"latest-runs/run/{p.name}")
        fs.put(str(local / "ckpt-0002.pt"), "latest-runs/nested/stage-1/ckpt-0002.pt")
        fs.pipe("latest-runs/run/notes.txt", b"hello")
        fs.put(str(store), "latest-runs/store", recursive=True)
        yield {"local": local, "store": store, "fs": fs}


def test_an_s3_root_is_listed_and_judged_like_its_local_copy(s3_run: Any) -> None:
    code, doc = _latest("s3://latest-runs/run/")
    _, here = _latest(str(s3_run["local"]))
    assert code == 0 and doc["latest"] == "s3://latest-runs/run/ckpt-0004.pt"
    rows = _rows(doc)
    assert {f["code"] for f in rows["ckpt-0006.pt"]["findings"] if f["severity"] == "error"} == {
        "precision.bf16-rounded"}
    local_rows = _rows(here)
    for name, row in rows.items():
        assert ([f["code"] for f in row["findings"]] == [f["code"] for f in local_rows[name]["findings"]]), name
    assert doc["skipped"] == [{"name": "notes.txt", "reason": "not a checkpoint file (.txt)"}]


def test_an_s3_root_of_store_folders_is_judged_like_its_local_copy(s3_run: Any) -> None:
    code, doc = _latest("s3://latest-runs/store", "--all")
    _, here = _latest(str(s3_run["store"]), "--all")
    assert code == 0 and doc["latest"] == "s3://latest-runs/store/step-000002"
    rows, local_rows = _rows(doc), _rows(here)
    assert set(rows) == set(local_rows) == {"step-000001", "step-000002"}
    for name, row in rows.items():
        assert row["layout"] == "ckptaudit" and row["resumable"] is True, row
        assert [f["code"] for f in row["findings"]] == [f["code"] for f in local_rows[name]["findings"]], name
    # The pointer is read behind the URL as on the local copy (one bounded ranged read), not skipped.
    assert doc["skipped"] == here["skipped"] == [] and doc["pointer"] == here["pointer"] == "step-000002"


def test_an_s3_listing_is_bounded_and_says_where_it_stopped(s3_run: Any) -> None:
    from ckptaudit.latest.listing import remote_survey

    survey = remote_survey("s3://latest-runs/nested", max_listings=1)
    assert survey.candidates == []
    assert [(s.name, s.reason) for s in survey.skipped] == [
        ("stage-1", "cannot be listed (the listing bound of 1 requests was reached)")]
    code, doc = _latest("s3://latest-runs/nested")
    assert code == 0 and doc["latest"] == "s3://latest-runs/nested/stage-1/ckpt-0002.pt"
    # The bound stops at the oldest folders: the newest-looking names are listed first.
    survey = remote_survey("s3://latest-runs/store", max_listings=2)  # the root, then one folder
    assert [c.name for c in survey.candidates] == ["step-000002"]
    assert ("step-000001", "cannot be listed (the listing bound of 2 requests was reached)") in [
        (s.name, s.reason) for s in survey.skipped]


def test_latest_on_an_unreachable_url_is_one_line_and_exit_2(tmp_path: Path) -> None:
    err = io.StringIO()
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
           "CKPTAUDIT_REMOTE_TIMEOUT": "2"}
    from local_s3 import environment

    s3fs = pytest.importorskip("s3fs")
    s3fs.S3FileSystem.clear_instance_cache()  # a cached client would still reach an earlier endpoint
    try:
        with environment(env):
            code = main(["latest", "s3://nowhere/run/", "--no-progress"], stdout=io.StringIO(), stderr=err)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    assert code == 2 and err.getvalue().count("\n") == 1 and "s3://nowhere/run" in err.getvalue()
    assert os.path.exists(tmp_path)
