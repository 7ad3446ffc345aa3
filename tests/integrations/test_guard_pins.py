"""The guard's promises under rewrites, fast saves and deletions, on real torch.save checkpoints (no library):
the bytes judged are the bytes saved (pins), a rewrite in place is never "passed", the bound on unverified
saves, the end-of-training signal, retention's rule, orphaned reports, and the worker's early start.

Each test holds the worker on a save whose (real) future is not done yet, so what happens "before the audit"
happens before it by construction, not by timing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

from ckptaudit.integrations.guard import CheckpointAuditFailed, Guard, report_path
from ckptaudit.integrations.pinning import PINS_DIR
from real_checkpoints import trained


def _hold(guard: Guard, tmp_path: Path) -> Future[None]:
    """Queue an asynchronous save whose future is not done: every audit queued after it waits for it."""
    held: Future[None] = Future()
    guard.submit(str(trained(tmp_path / "blocker.pt")), step=0, ready=held)
    return held


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _rewrite_in_place_keeping_size_and_mtime(path: Path) -> None:
    """Change bytes in the middle of the file (beyond the first and last 64 KiB), through the same inode, then
    put the mtime back: only the ctime can tell."""
    st = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(st.st_size // 2)
        chunk = fh.read(64)
        fh.seek(st.st_size // 2)
        fh.write(bytes(b ^ 0x5A for b in chunk))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)


def test_a_rewrite_in_place_that_keeps_size_and_mtime_is_not_judged(tmp_path: Path) -> None:
    ckpt = trained(tmp_path / "step=4.ckpt", width=256)  # ~800 KiB: the change lies beyond both hashed ends
    guard = Guard(background="thread")
    held = _hold(guard, tmp_path)
    guard.submit(str(ckpt), step=4)
    _rewrite_in_place_keeping_size_and_mtime(ckpt)
    held.set_result(None)
    assert guard.close(120)
    verdict = guard.verdicts[-1]
    assert verdict.ok is None and verdict.error.startswith("replaced: ") and "changed in place" in verdict.error
    assert verdict.quarantined_to is None and verdict.report is None and ckpt.exists()
    assert not os.path.exists(report_path(str(ckpt)))


@pytest.mark.parametrize("background", ["thread", "process"])
def test_a_replaced_file_gets_the_verdict_of_the_bytes_that_were_saved(tmp_path: Path, background: str) -> None:
    ckpt = tmp_path / "last.ckpt"
    trained(ckpt, rounded=True)  # what this save wrote: bf16-rounded weights
    saved = _digest(ckpt)
    guard = Guard(background=background)
    held = _hold(guard, tmp_path)
    guard.submit(str(ckpt), step=4)
    trained(tmp_path / "newer.ckpt")
    os.replace(tmp_path / "newer.ckpt", ckpt)  # the next save replaces the name (a new inode) before the audit
    newer = _digest(ckpt)
    held.set_result(None)
    assert guard.close(120)
    verdict = guard.verdicts[-1]
    # The verdict is the saved content's: failed, though the path now holds a good checkpoint.
    assert verdict.ok is False and set(verdict.codes) == {"precision.bf16-rounded"}
    assert verdict.note.startswith("replaced since it was saved")
    # The failing bytes are kept under the quarantine name; the new content is left alone, with no report.
    assert verdict.quarantined_to == str(ckpt) + ".quarantined"
    assert _digest(Path(verdict.quarantined_to)) == saved and _digest(ckpt) == newer
    assert verdict.report == report_path(verdict.quarantined_to)
    doc = json.loads(Path(verdict.report).read_text())
    assert doc["path"] == str(ckpt) and PINS_DIR not in Path(verdict.report).read_text()
    assert not os.path.exists(report_path(str(ckpt)))
    assert not (tmp_path / PINS_DIR).exists()  # every pin released


def test_a_good_save_replaced_by_a_bad_one_passes_for_what_was_saved(tmp_path: Path) -> None:
    ckpt = tmp_path / "last.ckpt"
    trained(ckpt)
    passed: list[str] = []
    guard = Guard(background="thread")
    held = _hold(guard, tmp_path)
    guard.submit(str(ckpt), step=2, on_pass=passed.append)
    trained(tmp_path / "newer.ckpt", rounded=True)
    os.replace(tmp_path / "newer.ckpt", ckpt)
    held.set_result(None)
    assert guard.close(120)
    verdict = guard.verdicts[-1]
    assert verdict.ok is True and verdict.note.startswith("replaced since it was saved")
    # No report beside content it does not describe, no pointer moved for it, nothing quarantined.
    assert verdict.report is None and not os.path.exists(report_path(str(ckpt)))
    assert passed == [] and verdict.quarantined_to is None and ckpt.exists()


def test_detach_lets_the_library_rewrite_in_place_and_the_pin_keeps_what_was_saved(tmp_path: Path) -> None:
    ckpt = tmp_path / "last.ckpt"
    trained(ckpt, rounded=True)
    saved = _digest(ckpt)
    guard = Guard(background="thread")
    held = _hold(guard, tmp_path)
    guard.submit(str(ckpt), step=4)
    assert guard.detach(str(ckpt)) and not ckpt.exists()
    assert not guard.detach(str(tmp_path / "blocker.pt"))  # no pin of its inode yet (its save is "writing")
    trained(ckpt)  # the library's next write: open(path, "wb") now makes a new file
    held.set_result(None)
    assert guard.close(120)
    verdict = guard.verdicts[-1]
    assert verdict.ok is False and verdict.quarantined_to == str(ckpt) + ".quarantined"
    assert _digest(Path(verdict.quarantined_to)) == saved


def test_a_checkpoint_deleted_before_its_verdict_is_judged_and_leaves_no_report(tmp_path: Path) -> None:
    ckpt = trained(tmp_path / "step=4.ckpt", rounded=True)
    guard = Guard(on_failure="stop", background="thread", max_unverified=None)
    held = _hold(guard, tmp_path)
    guard.submit(str(ckpt), step=4)
    ckpt.unlink()  # the library's retention
    held.set_result(None)
    assert guard.close(120)
    verdict = guard.verdicts[-1]
    # Judged from its pin (the run did write a bad checkpoint: stop mode stops), but nothing is left for it.
    assert verdict.ok is False and verdict.note.startswith("deleted before its verdict") and guard.should_stop()
    assert verdict.report is None and verdict.quarantined_to is None
    assert sorted(os.listdir(tmp_path)) == ["blocker.pt", "blocker.pt.ckptaudit.json", "blocker.pt.passport.json"]


def test_reports_of_checkpoints_deleted_since_are_removed(tmp_path: Path) -> None:
    first, second = trained(tmp_path / "step=2.ckpt"), trained(tmp_path / "step=4.ckpt")
    guard = Guard(background="thread")
    guard.submit(str(first), step=2)
    assert guard.wait(120) and os.path.exists(report_path(str(first)))
    first.unlink()  # a retention the guard does not run (Lightning's save_top_k, a user's script)
    guard.submit(str(second), step=4)
    assert guard.close(120)
    # ... and its passport: none is left beside a checkpoint that is gone.
    assert sorted(os.listdir(tmp_path)) == ["step=4.ckpt", "step=4.ckpt.ckptaudit.json", "step=4.ckpt.passport.json"]


def test_a_save_beyond_max_unverified_waits_for_the_pending_verdict(tmp_path: Path) -> None:
    guard = Guard(on_failure="stop", background="thread")  # max_unverified 1 by default in stop mode
    assert guard.max_unverified == 1
    held: Future[None] = Future()
    guard.submit(str(trained(tmp_path / "step=2.ckpt")), step=2, ready=held)
    assert guard.before_save(2) == 0.0  # the same save point (last.ckpt after the step's file) never waits
    events: list[str] = []

    def next_save() -> None:
        guard.before_save(4)
        events.append("the save at step 4 proceeds")

    saver = threading.Thread(target=next_save)
    saver.start()
    saver.join(1.0)  # room for a broken bound to let it through first; the assertion is on the order
    events.append("the verdict of step 2 arrives")
    held.set_result(None)
    saver.join(120)
    assert events == ["the verdict of step 2 arrives", "the save at step 4 proceeds"]
    (wait,) = guard.waits
    assert (wait.step, wait.unverified) == (4, 1) and wait.seconds > 0
    assert guard.close(120) and guard.verdicts[-1].ok is True


@pytest.mark.parametrize(("warn_after_s", "level"), [(30.0, logging.INFO), (0.0, logging.WARNING)])
def test_a_wait_within_the_bound_is_info_and_a_stall_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                monkeypatch: pytest.MonkeyPatch, warn_after_s: float,
                                                                level: int) -> None:
    """A healthy run whose save waits for the rest of an audit (the bound at work) logs it as INFO; only a wait
    beyond WAIT_WARN_S (a stall) is a WARNING."""
    from ckptaudit.integrations import guard as guard_module

    monkeypatch.setattr(guard_module, "WAIT_WARN_S", warn_after_s)
    guard = Guard(on_failure="stop", background="thread")
    held: Future[None] = Future()
    guard.submit(str(trained(tmp_path / "step=2.ckpt")), step=2, ready=held)
    threading.Timer(0.3, held.set_result, (None,)).start()
    with caplog.at_level(logging.DEBUG, logger="ckptaudit.guard"):
        waited = guard.before_save(4)
    assert waited is not None and waited > 0
    (record,) = [r for r in caplog.records if "waited" in r.getMessage()]
    assert record.levelno == level and "the save at step 4 waited" in record.getMessage()
    assert guard.close(120)


def test_warn_mode_has_no_bound_unless_asked(tmp_path: Path) -> None:
    guard = Guard(background="thread")
    held = _hold(guard, tmp_path)
    assert guard.max_unverified is None and guard.before_save(4) == 0.0 and guard.unverified == 1
    held.set_result(None)
    assert guard.close(120)
    with pytest.raises(ValueError, match="max_unverified=0 is not valid; pass an int of at least 1"):
        Guard(max_unverified=0)


def test_stop_mode_ends_training_with_checkpoint_audit_failed(tmp_path: Path) -> None:
    bad = trained(tmp_path / "step=4.ckpt", rounded=True)
    guard = Guard(on_failure="stop", background="thread")
    guard.submit(str(bad), step=4)
    with pytest.raises(CheckpointAuditFailed, match="failed their audit; training stopped") as caught:
        guard.finish(120)
    (failed,) = caught.value.failed
    assert failed.quarantined_to == str(bad) + ".quarantined"
    assert f"quarantined to {failed.quarantined_to}" in str(caught.value)
    warn = Guard(background="thread")
    warn.submit(str(trained(tmp_path / "step=6.ckpt", rounded=True)), step=6)
    warn.finish(120)  # warn mode: logged and quarantined, no exception
    assert warn.verdicts[-1].ok is False


def test_retention_never_deletes_the_last_good_one_before_a_newer_passed(tmp_path: Path) -> None:
    paths = [str(trained(tmp_path / f"checkpoint-{s}", rounded=s == 4)) for s in (2, 4)]
    resumed_from = str(trained(tmp_path / "checkpoint-0"))
    guard = Guard(background="thread")
    held = _hold(guard, tmp_path)
    for s, p in zip((2, 4), paths, strict=True):
        guard.submit(p, step=s)
    everything = [resumed_from, *paths]
    # Nothing has passed in this run yet: the newest checkpoint it was never given (resumed from) stays, and
    # no pending one is ever deleted, whatever the limit.
    assert guard.retention(everything, 1) == []
    held.set_result(None)
    assert guard.wait(120)
    assert [guard.status(p) for p in paths] == ["passed", "failed"]
    # checkpoint-2 passed: it is the last good one, kept beside the newest; the one resumed from may go.
    assert guard.retention([resumed_from, paths[0], str(tmp_path / "checkpoint-6")], 1) == [resumed_from]
    assert guard.close(120)


def test_the_worker_starts_when_the_guard_is_created(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    guard = Guard()
    try:
        assert guard.started(120), "the worker process did not come up"
        child = guard._child
        assert child is not None and child.poll() is None and guard.verdicts == ()  # up before any save
    finally:
        assert guard.close(120)
    for name, value in (("RANK", "1"), ("LOCAL_RANK", "1")):  # torchrun's; Lightning's launched processes'
        with monkeypatch.context() as env:
            env.delenv("RANK", raising=False)
            env.setenv(name, value)
            other = Guard()  # a rank that does not audit starts no worker process
            assert other._thread is None and other._child is None
            other.close(10)
