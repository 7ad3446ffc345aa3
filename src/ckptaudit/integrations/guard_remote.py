"""The guard on checkpoints saved behind an object-store URL: ``Guard.submit("s3://bucket/run/step-8/")``.

Which thread runs what, as for a local checkpoint (:mod:`ckptaudit.integrations.guard`):

1. **At submit** (training thread, :func:`pin_remote`): the pin is the objects' versions at that moment, one
   ``info`` and one listing (:func:`ckptaudit.formats.remote.snapshot.snapshot`: each object's size, ETag and, where
   the store gives one, version id). No byte is read on the training thread.
2. **On the worker** (:func:`judge_remote`): the objects are copied into a private local folder (``submit(pins=...)``,
   else the system's temporary folder; room for one checkpoint at a time), every read pinned to the ETag listed at
   submit (S3 sends it as ``If-Match``), so the copy is exactly the bytes saved, or the copy fails; the audit (and,
   with ``passport=True``, the passport in the same pass) reads that copy, as for a local checkpoint; then the
   checkpoint is listed again. An object replaced, added or deleted since submit makes the verdict *not judged*
   (named, nothing written), never "passed". The copy is removed after the verdict.
3. **The verdict, written as objects next to the checkpoint**: the JSON report at ``<checkpoint>.ckptaudit.json``
   (or the URL ``submit(report=...)`` names);
   on a pass the passport where :mod:`ckptaudit.ondisk.passport` puts it (``DIR/ckptaudit.passport.json`` inside a
   folder, ``FILE.passport.json`` beside a file), so ``ckptaudit verify s3://...`` finds it; on a failure (or a
   pass whose training state descends from a damaged one: its passport too, its lineage saying so) the
   quarantine marker, ``<checkpoint>.ckptaudit-quarantine.json``
   (:data:`~ckptaudit.ondisk.quarantine.MARKER_SUFFIX`), naming the verdict, its codes, the report and the objects
   judged. ``ckptaudit latest`` passes over a marked checkpoint, saying why.

Why a marker rather than a move. An object store has no rename: moving a checkpoint is a copy of every object
followed by a delete, which for a large checkpoint costs a full copy (time, and the store's bill), and whose
delete is the one step that could lose data if anything about the copy were wrong. The marker is one small write,
never touches the checkpoint's objects, and nothing is ever deleted but the guard's own small objects (a stale
passport or marker of an earlier save to the same URL). What a marker does not stop is a library's own resume
path that picks a checkpoint by its name without asking ckptaudit: resume from what ``ckptaudit latest`` names.

Local-only: the hooks that rename or repair local files. ``quarantine_to`` and ``after_quarantine`` (Lightning's
``last.ckpt`` repair) are never called for a URL, and ``keep_pin`` keeps nothing; a submit that gives them with a
URL logs a WARNING saying so. ``on_pass`` runs when the checkpoint passed and still holds what was judged.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptaudit.integrations.guard_lineage import (
    RunLineage,
    classify,
    drafted_passport,
    failure_advice,
    passport_request,
)
from ckptaudit.integrations.guard_quarantine import descendant_advice
from ckptaudit.integrations.guard_records import Verdict
from ckptaudit.ondisk.passport import is_passport_name, passport_path, signature_path
from ckptaudit.ondisk.quarantine import REPORT_SUFFIX, marker_name

if TYPE_CHECKING:
    from ckptaudit.formats.remote.snapshot import Snapshot

__all__ = ["RemotePin", "judge_remote", "pin_remote", "remote_report"]

log = logging.getLogger("ckptaudit.guard")


@dataclass(frozen=True, slots=True)
class RemotePin:
    """A URL's checkpoint as submitted: its objects' versions, or why they could not be listed (``error``); both
    ``None``/empty for an asynchronous save, listed on the worker once it completes."""

    url: str
    snapshot: Snapshot | None
    error: str = ""
    folder: str | None = None
    """The local folder for the worker's copy (``submit(pins=...)``), or ``None``: the system's temporary folder."""


def remote_report(url: str) -> str:
    """Where the report of the checkpoint at ``url`` goes: ``<checkpoint>.ckptaudit.json`` beside it."""
    return url.rstrip("/") + REPORT_SUFFIX


def pin_remote(url: str, *, listed: bool, pins: str | None, local_only: dict[str, Any]) -> RemotePin:
    """(training thread, at submit) The objects of ``url`` now (``listed=False``: an asynchronous save still writing;
    the worker lists them once it completes). ``local_only``: the hooks given that a URL cannot use (logged)."""
    given = sorted(name for name, value in local_only.items() if value)
    if given:
        log.warning("ckptaudit guard: %s is behind a URL: %s %s local-only (an object store has no rename); a failing "
                    "checkpoint there is left in place and marked by %s, and the library's own pointers are not "
                    "repaired: resume from what `ckptaudit latest` names", url, ", ".join(given),
                    "is" if len(given) == 1 else "are", marker_name(url))
    if not listed:
        return RemotePin(url, None, "", pins)
    from ckptaudit.formats.remote.snapshot import snapshot

    try:
        return RemotePin(url, snapshot(url, is_passport_name), "", pins)
    except OSError as exc:  # nothing there, the store unreachable: the worker says so in its verdict
        return RemotePin(url, None, f"{type(exc).__name__}: {exc}", pins)


def _not_judged(job: Any, why: str, seconds: float, queued: float) -> Verdict:
    log.warning("ckptaudit guard: %s was not judged: %s; nothing is written or marked", job.checkpoint, why)
    return Verdict(job.checkpoint, job.step, None, "not judged", (), None, None, seconds, queued, why)


def judge_remote(job: Any, audit: Callable[[str, str, str, dict[str, Any] | None], dict[str, Any]],
                 lineage: RunLineage, *, passport: bool, signing: dict[str, Any], on_failure: str) -> Verdict:
    """(worker) The verdict of the checkpoint behind ``job.checkpoint``'s URL (see the module docstring); ``audit``
    is the guard's own audit of a local path (``(checkpoint, report draft, as_path, passport request)``)."""
    from ckptaudit.formats.remote.errors import ObjectChanged
    from ckptaudit.formats.remote.snapshot import changes, copy_pinned, snapshot

    url, pin = job.checkpoint, job.remote
    queued = time.monotonic() - job.submitted
    if job.ready is not None:
        try:
            job.ready.result()
        except Exception as exc:  # noqa: BLE001 - a failed save is reported, never kills the worker
            return _not_judged(job, f"the save failed: {type(exc).__name__}: {exc}", 0.0, queued)
    snap = pin.snapshot
    if snap is None:
        if pin.error:
            return _not_judged(job, f"it could not be listed at submit ({pin.error})", 0.0, queued)
        try:
            snap = snapshot(url, is_passport_name)
        except OSError as exc:
            return _not_judged(job, f"it could not be listed ({type(exc).__name__}: {exc})", 0.0, queued)
    start = time.monotonic()
    try:
        if pin.folder is not None:
            os.makedirs(pin.folder, exist_ok=True)
        folder = tempfile.mkdtemp(prefix="ckptaudit-guard-", dir=pin.folder)
    except OSError as exc:
        return _not_judged(job, f"no local folder for its copy ({type(exc).__name__}: {exc})", 0.0, queued)
    try:
        _drop(url, [passport_path(url, is_dir=snap.is_dir), signature_path(url, is_dir=snap.is_dir)])
        try:
            local = copy_pinned(snap, folder)
        except ObjectChanged as exc:  # the store refused the ETag listed at submit
            return _not_judged(job, f"replaced since it was saved, before its audit could read it ({exc})",
                               time.monotonic() - start, queued)
        except OSError as exc:  # deleted since submit (retention), the store unreachable, the local disk full
            return _not_judged(job, f"its objects could not be copied as they were saved ({type(exc).__name__}: "
                               f"{exc})", time.monotonic() - start, queued)
        draft = os.path.join(folder, "report" + REPORT_SUFFIX)
        paper = passport_request(lineage.lineage(), signing, folder, url) if passport else None
        try:
            result = audit(local, draft, url, paper)
        except Exception as exc:  # noqa: BLE001 - any failure of one audit is reported, never kills the loop
            return _not_judged(job, f"the audit could not run ({type(exc).__name__}: {exc})",
                               time.monotonic() - start, queued)
        seconds = time.monotonic() - start
        why = changes(snap, is_passport_name)
        if why:
            return _not_judged(job, f"replaced while it was audited ({why}), so the bytes judged may not be the "
                               "bytes saved", seconds, queued)
        return _decide(job, snap, result, draft, lineage, on_failure, seconds, queued)
    except Exception as exc:  # noqa: BLE001 - the worker thread judges the next checkpoint whatever happens here
        return _not_judged(job, f"{type(exc).__name__}: {exc}", time.monotonic() - start, queued)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _decide(job: Any, snap: Snapshot, result: dict[str, Any], draft: str, lineage: RunLineage, on_failure: str,
            seconds: float, queued: float) -> Verdict:
    """(worker) Write the verdict next to the checkpoint: the report; the passport (a pass) or the marker (a fail)."""
    url = job.checkpoint
    ok, summary, codes = bool(result["ok"]), str(result["summary"]), tuple(result["codes"])
    job.attested = result.get("passport")
    from ckptaudit.formats.remote import is_url

    report = _put(url, draft, job.report if is_url(job.report) else remote_report(url))
    ancestor = lineage.damaged.checkpoint if lineage.damaged is not None else None
    if ok and ancestor is None:
        _drop(url, [marker_name(url)])  # an earlier save's marker: these bytes passed
        papers = _place_passport(url, snap, job.attested)
        log.info("ckptaudit guard: %s passed (%.2f s): %s", url, seconds, summary)
        if job.on_pass is not None:
            try:
                job.on_pass(url)
            except Exception as exc:  # noqa: BLE001
                log.error("ckptaudit guard: %s passed, but on_pass failed (%s: %s)", url, type(exc).__name__, exc)
        return Verdict(url, job.step, True, summary, codes, report, None, seconds, queued, "", "", passport=papers,
                       damaged_ancestor=None)
    if ok and ancestor is not None:  # passed its own audit, but descends from a damaged training state: marked as a failure is (in place)
        papers = _place_passport(url, snap, job.attested)  # its lineage says which ancestor it descends from
        doc = {"checkpoint": url, "verdict": "descends-from-damage", "damaged_ancestor": ancestor,
               "codes": ["guard.descends-from-damage"], "summary": summary, "report": report, "step": job.step,
               "objects": [o.as_json() for o in snap.objects],
               "marked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        marker = marker_name(url)
        placed = _put_bytes(url, (json.dumps(doc, indent=1) + "\n").encode(), marker)
        advice = descendant_advice(ancestor, marker if placed else None, lineage.last_passed(), marked=True)
        log.warning("ckptaudit guard: %s passed its own audit, but %s", url, advice)
        return Verdict(url, job.step, True, summary, codes, report, marker if placed else None, seconds, queued, "",
                       f"left in place and marked quarantined (a descendant of the damage at {ancestor})",
                       passport=papers, advice=advice, damaged_ancestor=ancestor)
    marker = marker_name(url)
    doc = {"checkpoint": url, "verdict": "fail", "codes": sorted(set(codes)), "summary": summary,
           "report": report, "step": job.step, "objects": [o.as_json() for o in snap.objects],
           "marked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    placed = _put_bytes(url, (json.dumps(doc, indent=1) + "\n").encode(), marker)
    damage = classify(job.live)
    advice = failure_advice(damage, job.live, lineage.last_passed())
    log.warning("ckptaudit guard: %s FAILED its audit (%s), %s; report: %s: %s%s", url, ", ".join(sorted(set(codes))),
                f"marked quarantined in place by {marker}" if placed else "and could NOT be marked: do not resume from "
                "it", report, advice, "; stopping training at the next step" if on_failure == "stop" else "")
    note = ("left in place and marked quarantined (an object store has no rename): " + marker if placed else
            "the quarantine marker could not be written")
    return Verdict(url, job.step, False, summary, codes, report, marker if placed else None, seconds, queued, "",
                   note, damage=damage, advice=advice, damaged_ancestor=ancestor)


def _place_passport(url: str, snap: Snapshot, attested: dict[str, Any] | None) -> str | None:
    """(worker, after a pass) Upload the drafted passport (and signature) where ``url``'s passport lives."""
    drafted = drafted_passport(attested, url)
    if drafted is None:
        return None
    draft, sig = drafted
    if os.path.exists(sig) and _put(url, sig, signature_path(url, is_dir=snap.is_dir)) is None:
        return None
    return _put(url, draft, passport_path(url, is_dir=snap.is_dir))


def _put(url: str, local: str, dest: str) -> str | None:
    try:
        with open(local, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        log.warning("ckptaudit guard: %s: %s could not be read to upload (%s)", url, local, exc)
        return None
    return _put_bytes(url, data, dest)


def _put_bytes(url: str, data: bytes, dest: str) -> str | None:
    """Write one small object (a report, a passport, a marker) at ``dest``; where, or ``None`` (logged)."""
    from ckptaudit.formats.remote.objects import filesystem

    try:
        fs, path = filesystem(dest)
        fs.pipe_file(path, data)
        fs.invalidate_cache()  # every cached listing: a later stage of the checkpoint must see what was written
    except Exception as exc:  # noqa: BLE001 - the storage library's own words; the verdict stands
        log.warning("ckptaudit guard: %s: could not write %s (%s: %s)", url, dest, type(exc).__name__, exc)
        return None
    return dest


def _drop(url: str, objects: list[str]) -> None:
    """Remove the guard's own small objects left by an earlier save to ``url`` (a passport, a marker) where they
    are: they speak of other bytes. Never a checkpoint's object."""
    from ckptaudit.formats.remote.objects import filesystem

    for dest in objects:
        try:
            fs, path = filesystem(dest)
            if fs.exists(path):
                fs.rm_file(path)
                log.info("ckptaudit guard: removed %s, left by an earlier save to %s", dest, url)
        except Exception as exc:  # noqa: BLE001
            log.warning("ckptaudit guard: could not remove the stale %s (%s: %s)", dest, type(exc).__name__, exc)
