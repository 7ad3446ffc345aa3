"""The guard on checkpoints behind ``s3://`` URLs (moto's S3 server): a DCP folder and a ``torch.save`` file that pass get
their report and passport written as objects next to them (``ckptaudit verify`` of the URL exits 0); one that fails is
marked quarantined in place (no object deleted, its bytes unchanged) and ``ckptaudit latest`` passes over it, naming
why; an object replaced after submit makes the verdict *not judged*; the local-only hooks are said to be local-only.

Real checkpoints written by torch (``torch.save``, ``torch.distributed.checkpoint.save``), a real guard, a real S3
server.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.cli import main
from real_checkpoints import dcp_checkpoint, trained

BUCKET = "guard-remote"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from local_s3 import local_s3

    local = tmp_path_factory.mktemp("guard-remote")
    dcp_checkpoint(local / "step-2")
    trained(local / "ckpt-0004.pt")
    trained(local / "ckpt-0006.pt", rounded=True)
    with local_s3(BUCKET) as s3:
        yield {"local": local, "fs": s3.fs}


def _objects(fs: Any, prefix: str) -> dict[str, bytes]:
    fs.invalidate_cache()
    return {name: fs.cat_file(name) for name in fs.find(prefix)}


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main([*args], stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def _guarded(*urls: str, background: str = "thread", options: dict[str, Any] | None = None,
             **submit: Any) -> list[Any]:
    from ckptaudit.integrations.guard import Guard

    guard = Guard(on_failure="warn", background=background, **(options or {}))
    for url in urls:
        guard.submit(url, **submit)
    assert guard.close(180)
    return list(guard.verdicts)


def test_a_passing_dcp_folder_gets_its_report_and_passport_as_objects_and_verifies(s3: dict[str, Any]) -> None:
    fs = s3["fs"]
    fs.put(str(s3["local"] / "step-2"), f"{BUCKET}/pass/step-2", recursive=True)
    saved = _objects(fs, f"{BUCKET}/pass/step-2")
    url = f"s3://{BUCKET}/pass/step-2/"
    [verdict] = _guarded(url, step=2, background="process")  # the default: the audit in the worker process
    assert verdict.ok is True, verdict
    assert verdict.report == f"s3://{BUCKET}/pass/step-2.ckptaudit.json"
    assert verdict.passport == f"s3://{BUCKET}/pass/step-2/ckptaudit.passport.json"
    report = json.loads(fs.cat_file(f"{BUCKET}/pass/step-2.ckptaudit.json"))
    assert report["path"] == url and report["counts"]["error"] == 0
    after = _objects(fs, f"{BUCKET}/pass/step-2")
    assert {k: v for k, v in after.items() if not k.endswith("ckptaudit.passport.json")} == saved
    assert not fs.exists(f"{BUCKET}/pass/step-2.ckptaudit-quarantine.json")
    code, out, err = _cli("verify", url)
    assert code == 0 and out.startswith("VERIFIED"), out + err


def test_a_passing_file_gets_its_passport_beside_it(s3: dict[str, Any]) -> None:
    fs = s3["fs"]
    fs.put(str(s3["local"] / "ckpt-0004.pt"), f"{BUCKET}/file/ckpt-0004.pt")
    url = f"s3://{BUCKET}/file/ckpt-0004.pt"
    [verdict] = _guarded(url, step=4)
    assert verdict.ok is True and verdict.passport == url + ".passport.json", verdict
    assert fs.exists(f"{BUCKET}/file/ckpt-0004.pt.ckptaudit.json")
    code, out, err = _cli("verify", url)
    assert code == 0, out + err


def _latest(root: str) -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["latest", root, "--format", "json", "--no-progress"], stdout=out, stderr=err)
    assert code in (0, 1) and out.getvalue(), err.getvalue()
    doc: dict[str, Any] = json.loads(out.getvalue())
    return doc


def test_a_failing_checkpoint_is_marked_never_deleted_and_latest_passes_over_it(s3: dict[str, Any]) -> None:
    fs = s3["fs"]
    for name in ("ckpt-0004.pt", "ckpt-0006.pt"):
        fs.put(str(s3["local"] / name), f"{BUCKET}/run/{name}")
    saved = _objects(fs, f"{BUCKET}/run")
    good, bad = f"s3://{BUCKET}/run/ckpt-0004.pt", f"s3://{BUCKET}/run/ckpt-0006.pt"
    verdicts = _guarded(good, bad)
    assert [v.ok for v in verdicts] == [True, False], verdicts
    failed = verdicts[1]
    marker = bad + ".ckptaudit-quarantine.json"
    assert failed.quarantined_to == marker and "left in place" in failed.note
    after = _objects(fs, f"{BUCKET}/run")
    assert all(after.get(k) == v for k, v in saved.items())  # every object of the run still there, byte for byte
    doc = json.loads(after[f"{BUCKET}/run/ckpt-0006.pt.ckptaudit-quarantine.json"])
    assert doc["verdict"] == "fail" and "precision.bf16-rounded" in doc["codes"]
    assert doc["report"] == bad + ".ckptaudit.json" and f"{BUCKET}/run/ckpt-0006.pt.ckptaudit.json" in after
    assert f"{BUCKET}/run/ckpt-0006.pt.passport.json" not in after
    assert [o["name"] for o in doc["objects"]] == [""] and doc["objects"][0]["etag"]

    out, err = io.StringIO(), io.StringIO()
    code = main(["latest", f"s3://{BUCKET}/run/", "--all", "--format", "json", "--no-progress"], stdout=out,
                stderr=err)
    result = json.loads(out.getvalue())
    assert code == 0 and result["latest"] == good, err.getvalue()
    rows = {c["name"]: c for c in result["candidates"]}
    assert rows["ckpt-0006.pt"]["layout"] == "quarantined" and rows["ckpt-0006.pt"]["resumable"] is False
    [found] = rows["ckpt-0006.pt"]["findings"]
    assert found["code"] == "guard.quarantined"
    assert "(precision.bf16-rounded" in found["message"] and "ckpt-0006.pt.ckptaudit-quarantine.json" in found["message"]
    skipped = {s["name"]: s["reason"] for s in result["skipped"]}
    assert skipped["ckpt-0006.pt.ckptaudit-quarantine.json"] == "the guard's quarantine marker of ckpt-0006.pt"

    # The same folder copied locally (aws s3 sync) is judged the same way.
    local = s3["local"] / "synced"
    fs.get(f"{BUCKET}/run", str(local), recursive=True)
    out = io.StringIO()
    assert main(["latest", str(local), "--all", "--format", "json", "--no-progress"], stdout=out,
                stderr=io.StringIO()) == 0
    here = {c["name"]: c for c in json.loads(out.getvalue())["candidates"]}
    assert here["ckpt-0006.pt"]["layout"] == "quarantined"

    # The marked checkpoint given itself as the root, on the store and on the local copy: the marker beside it is
    # read as when its folder is surveyed; the good one beside it stays resumable.
    for root, ok in ((bad, False), (str(local / "ckpt-0006.pt"), False), (good, True)):
        doc = _latest(root)
        [row] = doc["candidates"]
        assert row["resumable"] is ok and (row["layout"] == "quarantined") is not ok, (root, row)
        if not ok:
            assert [f["code"] for f in row["findings"]] == ["guard.quarantined"], row
            assert "(precision.bf16-rounded" in row["findings"][0]["message"], row


def test_a_failing_folder_is_marked_beside_it_and_latest_passes_over_it(s3: dict[str, Any]) -> None:
    fs = s3["fs"]
    fs.put(str(s3["local"] / "step-2"), f"{BUCKET}/dirs/step-2", recursive=True)
    saved = _objects(fs, f"{BUCKET}/dirs")
    [verdict] = _guarded(f"s3://{BUCKET}/dirs/step-2/", step=2, options={"fail_on": "warning"})  # its warnings fail
    assert verdict.ok is False and verdict.quarantined_to == f"s3://{BUCKET}/dirs/step-2.ckptaudit-quarantine.json"
    after = _objects(fs, f"{BUCKET}/dirs")
    assert set(after) == {*saved, f"{BUCKET}/dirs/step-2.ckptaudit.json", f"{BUCKET}/dirs/step-2.ckptaudit-quarantine.json"}
    assert all(after[k] == v for k, v in saved.items())
    out = io.StringIO()
    code = main(["latest", f"s3://{BUCKET}/dirs/", "--format", "json", "--no-progress"], stdout=out,
                stderr=io.StringIO())
    doc = json.loads(out.getvalue())
    assert code == 1 and doc["latest"] is None, doc  # nothing resumable: the one checkpoint is quarantined
    [row] = doc["candidates"]
    assert row["name"] == "step-2" and row["layout"] == "quarantined"
    assert [f["code"] for f in row["findings"]] == ["guard.quarantined"]
    # The marked folder given itself as the root: the marker beside it is read as when its parent is surveyed.
    for root in (f"s3://{BUCKET}/dirs/step-2/", f"s3://{BUCKET}/dirs/step-2"):
        [row] = _latest(root)["candidates"]
        assert row["name"] == "step-2" and row["layout"] == "quarantined" and row["resumable"] is False, row
        assert [f["code"] for f in row["findings"]] == ["guard.quarantined"], row


def test_an_object_replaced_after_submit_is_not_judged(s3: dict[str, Any]) -> None:
    from ckptaudit.integrations.guard import Guard

    fs = s3["fs"]
    fs.put(str(s3["local"] / "ckpt-0004.pt"), f"{BUCKET}/race/ckpt-0004.pt")
    fs.put(str(s3["local"] / "ckpt-0004.pt"), f"{BUCKET}/race/ckpt-0008.pt")
    hold: Future[None] = Future()
    guard = Guard(on_failure="warn", background="thread")
    guard.submit(f"s3://{BUCKET}/race/ckpt-0004.pt", ready=hold)  # holds the worker until the object is replaced
    url = f"s3://{BUCKET}/race/ckpt-0008.pt"
    guard.submit(url, step=8)  # pinned now: its ETag at submit
    fs.put(str(s3["local"] / "ckpt-0004.pt"), f"{BUCKET}/race/ckpt-0010.pt")
    guard.submit(f"s3://{BUCKET}/race/ckpt-0010.pt", step=10)
    fs.pipe(f"{BUCKET}/race/ckpt-0008.pt", (s3["local"] / "ckpt-0006.pt").read_bytes())  # a rounded one, in its place
    fs.rm(f"{BUCKET}/race/ckpt-0010.pt")  # retention, before its audit: no hard link keeps it
    hold.set_result(None)
    assert guard.close(180)
    held, verdict, deleted = guard.verdicts
    assert deleted.ok is None and deleted.error.startswith("its objects could not be copied as they were saved"), \
        deleted
    assert held.ok is True, held  # an asynchronous save: listed on the worker once its future completed
    assert verdict.checkpoint == url and verdict.ok is None, verdict
    # The copy's reads sent the ETag listed at submit: the store refused it (412).
    assert verdict.error.startswith("replaced since it was saved, before its audit could read it"), verdict.error
    fs.invalidate_cache()
    assert not fs.exists(f"{BUCKET}/race/ckpt-0008.pt.ckptaudit-quarantine.json")
    assert not fs.exists(f"{BUCKET}/race/ckpt-0008.pt.passport.json")
    assert not fs.exists(f"{BUCKET}/race/ckpt-0008.pt.ckptaudit.json")


def test_an_object_replaced_while_it_is_audited_is_not_judged(s3: dict[str, Any]) -> None:
    from ckptaudit.integrations.guard import Guard

    fs = s3["fs"]
    fs.put(str(s3["local"] / "ckpt-0004.pt"), f"{BUCKET}/during/ckpt-0004.pt")
    guard = Guard(on_failure="warn", background="thread")
    audit = guard._run_audit

    def replaced_meanwhile(*args: Any) -> dict[str, Any]:  # the copy was read; a new save lands during the audit
        fs.pipe(f"{BUCKET}/during/ckpt-0004.pt", (s3["local"] / "ckpt-0006.pt").read_bytes())
        return audit(*args)

    guard._run_audit = replaced_meanwhile  # type: ignore[method-assign]
    guard.submit(f"s3://{BUCKET}/during/ckpt-0004.pt", step=4)
    assert guard.close(180)
    [verdict] = guard.verdicts
    assert verdict.ok is None and verdict.error.startswith("replaced while it was audited (ckpt-0004.pt: "), verdict
    fs.invalidate_cache()
    assert fs.find(f"{BUCKET}/during") == [f"{BUCKET}/during/ckpt-0004.pt"]  # nothing written beside it


def test_the_local_only_hooks_are_said_to_be_local_only(s3: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    fs = s3["fs"]
    fs.put(str(s3["local"] / "ckpt-0004.pt"), f"{BUCKET}/hooks/ckpt-0004.pt")
    calls: list[tuple[str, str]] = []
    with caplog.at_level(logging.WARNING, logger="ckptaudit.guard"):
        [verdict] = _guarded(f"s3://{BUCKET}/hooks/ckpt-0004.pt", after_quarantine=lambda a, b: calls.append((a, b)),
                             quarantine_to=lambda p: p + ".elsewhere")
    assert verdict.ok is True and calls == []
    [line] = [r.getMessage() for r in caplog.records if "local-only" in r.getMessage()]
    assert "after_quarantine, quarantine_to are local-only" in line and "ckpt-0004.pt.ckptaudit-quarantine.json" in line


def test_latest_reads_a_remote_files_step_and_the_roots_pointer(s3: dict[str, Any], tmp_path: Path) -> None:
    import torch

    fs = s3["fs"]
    doc = torch.load(s3["local"] / "ckpt-0004.pt", weights_only=True)  # a trained model and its AdamW state
    del doc["step"]
    torch.save({**doc, "global_step": 9}, tmp_path / "final.pt")  # the newest, though its name says nothing
    fs.put(str(s3["local"] / "ckpt-0004.pt"), f"{BUCKET}/steps/ckpt-0004.pt")
    fs.put(str(tmp_path / "final.pt"), f"{BUCKET}/steps/final.pt")
    fs.pipe(f"{BUCKET}/steps/latest", b"ckpt-0004.pt\n")
    out = io.StringIO()
    code = main(["latest", f"s3://{BUCKET}/steps/", "--verify", "sizes", "--format", "json", "--no-progress"],
                stdout=out, stderr=io.StringIO())
    doc = json.loads(out.getvalue())
    assert code == 0 and doc["latest"] == f"s3://{BUCKET}/steps/final.pt" and doc["latest_step"] == 9, doc["candidates"]
    assert {c["name"]: c for c in doc["candidates"]}["final.pt"]["step_from"] == "the file's step key"
    assert doc["pointer"] == "ckpt-0004.pt" and doc["skipped"] == []
    stale = [f for f in doc["findings"] if f["code"] == "store.pointer-stale"]
    assert stale and "older than the newest resumable checkpoint" in stale[0]["message"]


def test_a_save_descending_from_a_damaged_state_is_marked_and_latest_names_the_last_good(s3: dict[str, Any]) -> None:
    """A real loop whose live masters are rounded in memory at step 6, saved to the store: step 6 fails (the
    training state itself), step 8 passes its own audit but descends from it, so it is marked quarantined in
    place as a failure is (a resume by name over the store never picks it), and ``latest`` names step 4."""
    import torch

    from ckptaudit.integrations.guard import Guard

    fs = s3["fs"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = Guard(on_failure="warn", background="thread")
    urls: dict[int, str] = {}
    for step in range(1, 9):
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 6:
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.bfloat16().float())
        if step % 2 == 0:
            local = s3["local"] / f"lineage-{step}.pt"
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, local)
            fs.put(str(local), f"{BUCKET}/lineage/step-{step}.pt")
            urls[step] = f"s3://{BUCKET}/lineage/step-{step}.pt"
            guard.observe(opt, step)
            guard.submit(urls[step], step=step)
            assert guard.wait(120)
    assert guard.close(120)
    v2, v4, v6, v8 = guard.verdicts
    assert (v2.ok, v4.ok, v6.ok, v8.ok) == (True, True, False, True), guard.verdicts
    assert v6.damage == "state" and v8.damaged_ancestor is not None and "step-6.pt" in v8.damaged_ancestor
    marker = urls[8] + ".ckptaudit-quarantine.json"
    assert v8.quarantined_to == marker and "marked quarantined in place" in v8.advice
    doc = json.loads(fs.cat_file(marker.removeprefix("s3://")))
    assert doc["verdict"] == "descends-from-damage" and "step-6.pt" in doc["damaged_ancestor"]
    assert fs.exists(f"{BUCKET}/lineage/step-8.pt")  # marked, never deleted

    out, err = io.StringIO(), io.StringIO()
    code = main(["latest", f"s3://{BUCKET}/lineage/", "--all", "--format", "json", "--no-progress"], stdout=out,
                stderr=err)
    result = json.loads(out.getvalue())
    assert code == 0 and result["latest"] == urls[4], err.getvalue()
    rows = {c["name"]: c for c in result["candidates"]}
    [found] = rows["step-8.pt"]["findings"]
    assert found["code"] == "guard.quarantined" and "descends from the damage at" in found["message"]
