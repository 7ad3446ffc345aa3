"""Resumable checkpoints that are complete or visibly not: :func:`save_checkpoint` and :func:`load_checkpoint`.

Built on ``get_state_dict`` + ``torch.distributed.checkpoint`` (DCP). DCP alone commits by writing
``.metadata`` last into the final directory, with no checksums: a directory with ``.metadata`` looks complete
even when a rank died before the job agreed the save was done. Here every save goes into a temporary sibling
directory and becomes ``ROOT/step-NNNNNN`` only by the coordinator's atomic rename, after every rank has
written, fsynced and hashed its files, the coordinator has written ``manifest.json``, and every rank has voted
to commit. See :func:`save_checkpoint` for the order of events, :mod:`ckptaudit.ondisk.layout` for the layout
and :mod:`ckptaudit.store.faults` for the points where faults can be injected.

Every collective is bounded by the process group's timeout: a rank whose peer died ends with
:class:`CheckpointSaveError` / :class:`CheckpointLoadError` instead of waiting forever. Without an initialised
process group, everything runs locally (one process).
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch

from ckptaudit.ondisk import layout
from ckptaudit.recipes import Job
from ckptaudit.recipes.rng import rng_state
from ckptaudit.store.checkpoint import (
    KEYS,
    CheckpointLoadError,
    CheckpointSaveError,
    LoadedCheckpoint,
    SavedCheckpoint,
    dtype_name,
    has_state,
)
from ckptaudit.store.collective import CollectiveError, Group
from ckptaudit.store.commit import (
    build_manifest,
    commit_and_tidy,
    file_report,
    prepare,
    previous_committed,
    write_manifest,
)
from ckptaudit.store.dcpio import (
    checked_blob,
    dcp_failures,
    free_space,
    save_planner,
    single_process_quiet,
    storage_writer,
)
from ckptaudit.store.faults import FaultHook, hook_from_env
from ckptaudit.store.loader import load_checkpoint

__all__ = [
    "KEYS",
    "CheckpointLoadError",
    "CheckpointSaveError",
    "LoadedCheckpoint",
    "SavedCheckpoint",
    "load_checkpoint",
    "save_checkpoint",
]


def _contract(job: Job) -> dict[str, Any]:
    """The master-dtype contract read from the live objects: the dtype of the parameters the optimizer updates
    (under FSDP2, the sharded masters, not the compute copies) and of its element-wise state."""
    params = Counter(dtype_name(p.dtype) for p in job.model.parameters() if p.requires_grad and p.is_floating_point())
    states = Counter(
        dtype_name(v.dtype)
        for entry in job.optimizer.state.values()
        for v in entry.values()
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0
    )
    return {
        "master_dtype": params.most_common(1)[0][0] if params else "unknown",
        "parameter_dtypes": dict(sorted(params.items())),
        "optimizer_state_dtypes": dict(sorted(states.items())),
        "source": "the live model's trainable parameters and the optimizer's state at save time",
    }


def _collect(job: Job, step: int, rank: int, extras: Mapping[str, Any] | None) -> tuple[dict[str, Any],
                                                                                           dict[str, Any]]:
    """(all ranks; ``get_state_dict`` is collective under FSDP) The state dict to save and the inventory."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rng = rng_state()  # first: nothing below may draw from the generators, but take the state as of the call
    msd, osd = get_state_dict(job.model, job.optimizer)
    state: dict[str, Any] = {KEYS["model"]: msd, KEYS["optimizer"]: osd, KEYS["rng"]: {f"rank{rank}": rng}}
    inventory: dict[str, Any] = {
        "model": {"key": KEYS["model"], "tensors": len(msd)},
        "optimizer": {"key": KEYS["optimizer"], "type": type(job.optimizer).__name__, "keyed": "fqn"},
        "step": {"key": KEYS["step"], "value": step},
        "rng": {"key": KEYS["rng"], "per_rank": True, "sources": sorted(rng)},
    }
    absent: dict[str, str] = {}
    if job.scheduler is not None:
        if not has_state(job.scheduler):
            raise CheckpointSaveError(f"job.scheduler ({type(job.scheduler).__name__}) has no state_dict/"
                                      "load_state_dict; give it one or set job.scheduler = None")
        sched = job.scheduler.state_dict()
        checked_blob(sched, "job.scheduler.state_dict()")
        state[KEYS["scheduler"]] = sched
        inventory["scheduler"] = {"key": KEYS["scheduler"], "type": type(job.scheduler).__name__}
    else:
        absent["scheduler"] = "job.scheduler is None"
    if job.data is not None and has_state(job.data):
        # One opaque blob per rank: a StatefulDataLoader's state changes shape as it iterates, so it cannot be
        # loaded into a template the way tensors are.
        state[KEYS["data-progress"]] = {f"rank{rank}": checked_blob(job.data.state_dict(), "job.data.state_dict()")}
        inventory["data-progress"] = {"key": KEYS["data-progress"], "per_rank": True, "type": type(job.data).__name__}
    else:
        absent["data-progress"] = ("job.data is None" if job.data is None else
                                   f"job.data ({type(job.data).__name__}) has no state_dict/load_state_dict")
    if extras:
        try:
            text = json.dumps(dict(extras), sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise CheckpointSaveError(f"extras must be JSON values (numbers, strings, lists, dicts): {exc}") from None
        state[KEYS["extras"]] = text
        inventory["extras"] = {"key": KEYS["extras"], "names": sorted(extras)}
    # Last, so that readers listing keys in order meet the data progress before the bare step counter.
    state[KEYS["step"]] = {"step": step}
    inventory["absent"] = absent
    return state, inventory


def save_checkpoint(
    job: Job,
    root: str | os.PathLike[str],
    *,
    step: int | None = None,
    extras: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
    overwrite: bool = False,
    fault_hook: FaultHook | None = None,
) -> SavedCheckpoint:
    """(all ranks, collective) Save ``job`` as ``ROOT/step-NNNNNN``, complete or not at all.

    Saves the model and the optimizer (``get_state_dict``: sharded, FQN-keyed), the scheduler, the step
    (``step``, default ``job.step``), per rank the RNG state (Python, NumPy, torch CPU, CUDA where initialised)
    and the data progress (``job.data.state_dict()``: a :class:`~ckptaudit.recipes.DataSource` or torchdata's
    ``StatefulDataLoader``), and ``extras`` (JSON values, the same on every rank).

    Order of events:

    1. (coordinator) creates ROOT, refuses to replace an existing ``step-N`` unless ``overwrite``, removes
       temporary directories of earlier saves that died, creates ``step-N.partial-<tag>``; broadcasts its name.
    2. (all ranks) collect their state (``get_state_dict`` is collective under FSDP).
    3. (all ranks) ``torch.distributed.checkpoint.save`` into the temporary directory: each rank writes and
       fsyncs ``__<rank>_0.distcp`` while every item's values are hashed; (coordinator) writes and fsyncs
       ``.metadata``.
    4. (all ranks) hash their files as written (size, xxh3-128, per item) and send the report to the
       coordinator (vote 1: a rank that died sends nothing and the gather fails).
    5. (coordinator) writes and fsyncs ``manifest.json``, then fsyncs the temporary directory.
    6. (all ranks) vote 2, an all-reduce: the commit goes ahead only if every rank is still there and the
       manifest is written.
    7. (coordinator) renames the temporary directory to ``step-N`` and fsyncs ROOT: the commit point.
    8. (coordinator) updates the ``latest`` pointer (temporary file, fsync, rename, fsync ROOT).
    9. (coordinator) retention (``keep_last``): only now, so the last good checkpoint outlives any failed save.
    10. (all ranks) receive the outcome and return it.

    If this function returns, the checkpoint is committed. If it raises :class:`CheckpointSaveError`, a rank
    died before step 6 (nothing committed; the temporary directory is left for the next save to remove) or
    the storage failed (the temporary directory is removed), or, rarely, the outcome of step 7 could not be
    confirmed (``ckptaudit latest ROOT`` says). The previous checkpoint is never touched before step 9.
    """
    root = os.path.abspath(os.fspath(root))
    group = Group()
    step = int(job.step if step is None else step)
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be at least 1 (the checkpoint just written), got {keep_last}")
    hook = fault_hook if fault_hook is not None else hook_from_env(group.rank, step)
    final_name = layout.step_name(step)
    what = f"save of step {step} to {root}"

    def left_behind(tmp_name: str) -> str:
        prev = previous_committed(root, final_name if not overwrite else "")
        return (f"nothing was committed; {tmp_name} is left behind and the next save removes it; "
                + (f"the previous checkpoint {prev} is untouched" if prev else "there is no previous checkpoint"))

    try:
        prep = group.broadcast(prepare(root, step, overwrite) if group.coordinator else None, "prepare")
    except CollectiveError as exc:
        raise CheckpointSaveError(f"{what}: {exc}; nothing was written") from None
    if prep[0] != "ok":
        raise CheckpointSaveError(f"{what}: {prep[1]}")
    tmp_name: str = prep[1]
    tmp = os.path.join(root, tmp_name)

    try:
        state, inventory = _collect(job, step, group.rank, extras)
    except CheckpointSaveError:
        if group.coordinator:  # the same error on every rank (it depends on the job's objects): nobody writes
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    contract = _contract(job)
    if hook is not None:
        hook("collect")

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    planner = save_planner(hook)
    writer = storage_writer(tmp, final_name, hook)
    try:
        with single_process_quiet(group):
            dcp.save(state, storage_writer=writer, planner=planner, no_dist=not group.on)
    except CheckpointException as exc:
        disk = free_space(root)  # before the clean-up: torch's writer may report a full disk as a short write
        # DCP gathered every rank's outcome before raising, so no rank is still writing: safe to clean up.
        if group.coordinator:
            shutil.rmtree(tmp, ignore_errors=True)
        prev = previous_committed(root, final_name if not overwrite else "")
        raise CheckpointSaveError(
            f"{what} failed while writing ({dcp_failures(exc)}){disk}; nothing was committed and the temporary "
            f"directory {tmp_name} was removed; "
            + (f"the previous checkpoint {prev} is untouched" if prev else "there is no previous checkpoint")
        ) from None
    except Exception as exc:  # noqa: BLE001 - a collective inside DCP failed: a peer died or stalled
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointSaveError(f"{what}: torch.distributed.checkpoint.save failed on rank {group.rank} "
                                  f"({first}); a rank died or stalled; {left_behind(tmp_name)}") from None

    try:
        report = file_report(tmp, writer, planner, group.rank)
    except OSError as exc:
        report = {"rank": group.rank, "ok": False, "error": f"cannot hash its files: {exc}"}
    if hook is not None:
        hook("report")
    try:
        reports = group.gather(report, "gather file reports (vote 1)")
    except CollectiveError as exc:
        raise CheckpointSaveError(f"{what}: {exc}; a rank died or stalled; {left_behind(tmp_name)}") from None
    if not group.coordinator and hook is not None:
        hook("commit.wait")

    ready, abort = 1, ""
    if group.coordinator:
        assert reports is not None
        bad = [r for r in reports if not r.get("ok")]
        if bad:
            ready, abort = 0, "; ".join(f"rank {r['rank']}: {r['error']}" for r in bad)
        else:
            try:
                write_manifest(tmp, build_manifest(tmp, step, group.world, reports, inventory, contract))
            except OSError as exc:
                ready, abort = 0, f"rank 0: cannot write {layout.MANIFEST}: {exc.strerror or exc}"
        if ready and hook is not None:
            hook("commit.manifest")
    try:
        agreed = group.all_min(ready, "commit vote (vote 2)")
    except CollectiveError as exc:
        raise CheckpointSaveError(f"{what}: {exc}; a rank died or stalled; {left_behind(tmp_name)}") from None
    if not agreed:
        if group.coordinator:
            shutil.rmtree(tmp, ignore_errors=True)  # every rank voted: nobody is writing there any more
            raise CheckpointSaveError(f"{what} aborted before the commit ({abort}); the temporary directory "
                                      f"{tmp_name} was removed; nothing was committed")
        raise CheckpointSaveError(f"{what} aborted by the coordinator (rank 0) before the commit; its error says "
                                  "why; nothing was committed")

    outcome: tuple[str, Any]
    if group.coordinator:
        outcome = commit_and_tidy(root, tmp_name, final_name, keep_last, hook)
    else:
        outcome = ("pending", None)
    try:
        outcome = group.broadcast(outcome, "commit outcome")
    except CollectiveError as exc:
        raise CheckpointSaveError(f"{what}: {exc}; the checkpoint may or may not be committed; "
                                  f"`ckptaudit latest {root}` says which one is") from None
    if outcome[0] != "ok":
        raise CheckpointSaveError(f"{what}: {outcome[1]}")
    deleted, notes = outcome[1]
    return SavedCheckpoint(os.path.join(root, final_name), step, tuple(deleted), tuple(notes))
