"""Restore a job from a checkpoint of :func:`~ckptaudit.store.writer.save_checkpoint`: :func:`load_checkpoint`
(all ranks, collective). The manifest is verified, the dtypes compared (:mod:`ckptaudit.store.dtypes`) and DCP's
``.metadata`` checked before anything is unpickled."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Literal, overload

import torch

from ckptaudit.ondisk import layout
from ckptaudit.ondisk import manifest as mf
from ckptaudit.recipes import Job
from ckptaudit.recipes.rng import rng_state, set_rng_state
from ckptaudit.store.checkpoint import KEYS, CheckpointLoadError, LoadedCheckpoint, has_state
from ckptaudit.store.collective import CollectiveError, Group
from ckptaudit.store.dcpio import dcp_failures, load_planner, safe_loads, single_process_quiet
from ckptaudit.store.dtypes import dtype_changes, refusal

__all__ = ["load_checkpoint"]


def _resolve(path: str, require_passport: bool | str = False) -> tuple[str, str]:
    """(coordinator) :func:`_resolve_path`, then with ``require_passport`` the checkpoint's passport verified
    (``("error", why)`` when it does not)."""
    resolved = _resolve_path(path)
    if resolved[0] != "ok" or not require_passport:
        return resolved
    from ckptaudit.passport import passport_findings

    name = os.path.basename(resolved[1])
    key = require_passport if isinstance(require_passport, str) else None
    problems = passport_findings(resolved[1], name, key=key)
    if not problems:
        return resolved
    return ("error", f"{resolved[1]}: require_passport: {'; '.join(f.message for f in problems[:3])}"
            + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "")
            + "; `ckptaudit latest --require passport` names the newest checkpoint whose passport verifies")


def _resolve_path(path: str) -> tuple[str, str]:
    """(coordinator) A checkpoint directory, or the newest resumable one under a root; ``("missing", why)`` when
    there is nothing to resume yet (no such directory, or no committed checkpoint in it)."""
    from ckptaudit.latest import find_latest

    if os.path.isfile(os.path.join(path, layout.MANIFEST)):
        return ("ok", path)
    if not os.path.exists(path):
        return ("missing", f"{path}: no such directory; give a step directory or the root holding them (or pass "
                           "missing_ok=True to start from scratch when no checkpoint exists yet)")
    if not os.path.isdir(path):
        return ("error", f"{path}: not a directory; give a step directory or the root holding them")
    result = find_latest(path, verify="sizes")
    if result.latest is None and all(c.candidate.layout == "ckptaudit-temporary" for c in result.checked):
        temps = [c.candidate.name for c in result.checked]
        return ("missing", f"{path}: no checkpoint has been committed there yet"
                + (f" (only the temporary directories of saves that never committed: {', '.join(temps)})"
                   if temps else "") + "; pass missing_ok=True to start from scratch on a job's first run")
    if result.latest is not None:
        if not os.path.isfile(os.path.join(result.latest.path, layout.MANIFEST)):
            return ("error", f"{path}: the newest resumable checkpoint, {result.latest.name}, was not written by "
                             "ckptaudit.store.save_checkpoint (no manifest.json); load it with the tool that "
                             "wrote it")
        return ("ok", result.latest.path)
    why = "; ".join(f"{c.candidate.name}: {c.reason}" for c in result.checked) or "no step directories"
    return ("error", f"{path}: no resumable checkpoint ({why})")


@overload
def load_checkpoint(job: Job, path: str | os.PathLike[str], *, allow_dtype_change: bool = ...,
                    allow_world_size_change: bool = ..., strict: bool = ..., verify: str = ...,
                    require_passport: bool | str = ...,
                    missing_ok: Literal[False] = ...) -> LoadedCheckpoint: ...


@overload
def load_checkpoint(job: Job, path: str | os.PathLike[str], *, allow_dtype_change: bool = ...,
                    allow_world_size_change: bool = ..., strict: bool = ..., verify: str = ...,
                    require_passport: bool | str = ...,
                    missing_ok: bool) -> LoadedCheckpoint | None: ...


def load_checkpoint(
    job: Job,
    path: str | os.PathLike[str],
    *,
    allow_dtype_change: bool = False,
    allow_world_size_change: bool = False,
    strict: bool = True,
    verify: str = "hashes",
    missing_ok: bool = False,
    require_passport: bool | str = False,
) -> LoadedCheckpoint | None:
    """(all ranks, collective) Restore ``job`` from a checkpoint of :func:`save_checkpoint`.

    ``path`` is a ``step-N`` directory or the root holding them (then the newest resumable one is taken). On
    CPU the continuation is bit-identical to the uninterrupted run.

    On a job's first run there is nothing to restore: with ``missing_ok=True``, when ``path`` does not exist or
    holds no committed checkpoint (at most temporaries of saves that never committed), every rank returns
    ``None`` and ``job`` is left as it is::

        if load_checkpoint(job, "ckpts", missing_ok=True) is None:
            print("no checkpoint yet: starting from step 0")

    A root that does hold committed checkpoints, none of them resumable, still raises: that is damage, not a
    first run.

    ``require_passport``: load only a checkpoint whose passport (``ckptaudit attest``, or a guard; see
    ``docs/passport.md``) verifies: ``True`` for any passport (a digest-only one: the bytes are the attested ones),
    or the path of the signer's PEM public key, or of a PEM file of the CA certificates its signing certificate
    must chain to (``attest --cert``): the signature must verify; a digest-only passport is refused.
    Its recorded verdict must be a pass. Costs one read of every byte, on the coordinator.

    Order of events:

    1. (coordinator) resolves ``path``; with ``require_passport``, verifies the checkpoint against its passport;
       broadcasts the directory (or why it is refused).
    2. (all ranks) read ``manifest.json``; check the world size, the components against ``job`` and the
       dtypes of the live model and optimizer against the saved ones (no silent cast, see
       ``allow_dtype_change``).
    3. (all ranks) verify the files against the manifest, each rank a share (sizes, and xxh3-128 when
       ``verify="hashes"``); exchange the problems, so every rank raises the same error.
    4. (all ranks) ``check_metadata_safe`` on ``.metadata`` (DCP unpickles it with plain ``pickle``); DCP is
       given the metadata it vetted (``vetted_dcp_reader``), never the file to unpickle again.
    5. (all ranks) ``torch.distributed.checkpoint.load`` into the live state (non-tensor items unpickled
       with ``weights_only=True``), then ``set_state_dict``, the scheduler, the step, the data progress, and
       last this rank's RNG state.
    """
    if verify not in ("hashes", "sizes"):
        raise ValueError(f"verify must be 'hashes' or 'sizes', not {verify!r}")
    group = Group()
    path = os.path.abspath(os.fspath(path))
    try:
        resolved = group.broadcast(_resolve(path, require_passport) if group.coordinator else None,
                                   "resolve checkpoint")
    except CollectiveError as exc:
        raise CheckpointLoadError(f"load of {path}: {exc}") from None
    if resolved[0] == "missing" and missing_ok:
        return None
    if resolved[0] != "ok":
        raise CheckpointLoadError(resolved[1])
    ckpt: str = resolved[1]
    name = os.path.basename(ckpt)
    try:
        manifest = mf.read_manifest(os.path.join(ckpt, layout.MANIFEST))
    except mf.ManifestError as exc:
        raise CheckpointLoadError(f"cannot load {ckpt}: {exc}") from None

    skipped: list[str] = []
    saved_world = int(manifest["world_size"])
    if saved_world != group.world and not allow_world_size_change:
        raise CheckpointLoadError(
            f"{name} was saved by {saved_world} rank(s); this job has {group.world}. Model and optimizer state "
            "reshard, but RNG state and data progress are per rank: pass allow_world_size_change=True to restore "
            "them only for the ranks both runs have (the continuation will not be bit-identical)")
    comps: dict[str, Any] = manifest["components"]
    for comp, live in (("scheduler", job.scheduler), ("data-progress", job.data)):
        in_ckpt = comp in comps
        in_job = live is not None and (comp != "data-progress" or has_state(live))
        if in_ckpt != in_job:
            msg = (f"{name} holds {comp} state but job has none to restore it into" if in_ckpt else
                   f"{name} holds no {comp} state ({comps.get('absent', {}).get(comp, 'not saved')}) but job has "
                   "one: it would restart from its initial state")
            if strict:
                raise CheckpointLoadError(msg + "; pass strict=False to go on without it")
            skipped.append(msg)

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(job.model, job.optimizer)
    tmpl: dict[str, Any] = {KEYS["model"]: msd, KEYS["optimizer"]: osd, KEYS["step"]: {"step": 0}}
    casts = dtype_changes(manifest, tmpl)
    if casts and not allow_dtype_change:
        raise CheckpointLoadError(refusal(name, casts, manifest["contract"].get("master_dtype", "?")))

    files = sorted(manifest["files"])
    mine = [f for i, f in enumerate(files) if i % group.world == group.rank]
    problems = [f.message for f in mf.verify_files(ckpt, manifest, hashes=verify == "hashes", only=mine)]
    try:
        all_problems = [p for ps in group.all_gather(problems, "exchange verification") for p in ps]
    except CollectiveError as exc:
        raise CheckpointLoadError(f"load of {ckpt}: {exc}") from None
    if all_problems:
        raise CheckpointLoadError(f"{ckpt} does not match its manifest: {'; '.join(all_problems[:5])}"
                                  + (f" (and {len(all_problems) - 5} more)" if len(all_problems) > 5 else "")
                                  + "; resume from an older checkpoint (`ckptaudit latest` lists them)")
    from ckptaudit.formats.dcp.reader import UnsafeCheckpointError
    from ckptaudit.formats.torchload import vetted_dcp_reader

    try:
        reader = vetted_dcp_reader(ckpt)  # DCP reads the metadata this check vetted, never the pickle again
    except UnsafeCheckpointError as exc:
        raise CheckpointLoadError(f"refusing to load {ckpt}: {exc}") from None

    restore_rank = group.rank < saved_world
    if not restore_rank:
        skipped.append(f"rank {group.rank}: RNG state and data progress (the checkpoint has {saved_world} ranks)")
    rank_key = f"rank{group.rank}"
    if "scheduler" in comps and job.scheduler is not None:
        tmpl[KEYS["scheduler"]] = job.scheduler.state_dict()
    if "rng" in comps and restore_rank:
        tmpl[KEYS["rng"]] = {rank_key: _rng_template(comps["rng"])}
    if "data-progress" in comps and restore_rank and job.data is not None and has_state(job.data):
        tmpl[KEYS["data-progress"]] = {rank_key: b""}
    if "extras" in comps:
        tmpl[KEYS["extras"]] = ""

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with single_process_quiet(group):
            dcp.load(tmpl, storage_reader=reader, planner=load_planner(), no_dist=not group.on)
    except CheckpointException as exc:
        raise CheckpointLoadError(f"torch.distributed.checkpoint.load of {ckpt} failed ({dcp_failures(exc)})") from None
    except Exception as exc:  # noqa: BLE001 - a collective inside DCP failed, or DCP rejected the state dict
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointLoadError(f"torch.distributed.checkpoint.load of {ckpt} failed on rank {group.rank} "
                                  f"({first})") from None

    set_state_dict(job.model, job.optimizer, model_state_dict=tmpl[KEYS["model"]],
                   optim_state_dict=tmpl[KEYS["optimizer"]])
    if KEYS["scheduler"] in tmpl:
        job.scheduler.load_state_dict(tmpl[KEYS["scheduler"]])
    job.step = int(tmpl[KEYS["step"]]["step"])
    if KEYS["data-progress"] in tmpl:
        job.data.load_state_dict(safe_loads(tmpl[KEYS["data-progress"]][rank_key], f"{name}: data progress"))
    extras: dict[str, Any] = json.loads(tmpl[KEYS["extras"]]) if KEYS["extras"] in tmpl else {}
    if KEYS["rng"] in tmpl:
        set_rng_state(tmpl[KEYS["rng"]][rank_key])  # last: nothing after this may draw
    return LoadedCheckpoint(ckpt, job.step, extras, tuple(casts), tuple(skipped))


def _rng_template(info: Mapping[str, Any]) -> dict[str, Any]:
    state = rng_state()
    if "cuda" in info.get("sources", []) and "cuda" not in state and torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state
