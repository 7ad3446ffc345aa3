"""Resumable checkpoints that are complete or visibly not: :func:`save_checkpoint` and :func:`load_checkpoint`.

Built on ``get_state_dict`` + ``torch.distributed.checkpoint`` (DCP). DCP alone commits by writing
``.metadata`` last into the final directory, with no checksums: a directory with ``.metadata`` looks complete
even when a rank died before the job agreed the save was done. Here every save goes into a temporary sibling
directory and becomes ``ROOT/step-NNNNNN`` only by the coordinator's atomic rename, after every rank has
written, fsynced and hashed its files, the coordinator has written ``manifest.json``, and every rank has voted
to commit. See :func:`save_checkpoint` for the order of events, :mod:`ckptaudit.store.layout` for the layout
and :mod:`ckptaudit.store.faults` for the points where faults can be injected.

Every collective is bounded by the process group's timeout: a rank whose peer died ends with
:class:`CheckpointSaveError` / :class:`CheckpointLoadError` instead of waiting forever. Without an initialised
process group, everything runs locally (one process).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from ckptaudit import __version__
from ckptaudit.exporters import rng_state, set_rng_state
from ckptaudit.model import HASH_ALGORITHM
from ckptaudit.recipe import Job
from ckptaudit.store import layout
from ckptaudit.store import manifest as mf
from ckptaudit.store.faults import FaultHook, hook_from_env

__all__ = [
    "KEYS",
    "CheckpointLoadError",
    "CheckpointSaveError",
    "LoadedCheckpoint",
    "SavedCheckpoint",
    "load_checkpoint",
    "save_checkpoint",
]

KEYS: dict[str, str] = {
    "model": "model",
    "optimizer": "optim",
    "scheduler": "scheduler",
    "step": "train_state",
    "rng": "rng",
    "data-progress": "data",
    "extras": "extras",
}
"""Component -> top-level key of the DCP state dict (the names ``ckptaudit audit`` recognises)."""

_COMPONENT_OF_KEY = {v: k for k, v in KEYS.items()}
_ISSUE_SILENT_CAST = "pytorch/pytorch#187138"


class CheckpointSaveError(Exception):
    """A save that did not commit (or could not confirm its commit). The message says what failed, on which
    rank, and what is left on disk."""


class CheckpointLoadError(Exception):
    """A checkpoint that cannot be restored as asked; the message names the thing, the value and the fix."""


@dataclass(frozen=True, slots=True)
class SavedCheckpoint:
    path: str
    """The committed directory, ``ROOT/step-NNNNNN``."""
    step: int
    deleted: tuple[str, ...] = ()
    """Older checkpoints removed by retention after the commit."""
    warnings: tuple[str, ...] = ()
    """Problems after the commit point (pointer or retention); the checkpoint itself is committed."""


@dataclass(frozen=True, slots=True)
class LoadedCheckpoint:
    path: str
    step: int
    extras: dict[str, Any]
    casts: tuple[str, ...] = ()
    """Tensors loaded into another dtype than saved (only with ``allow_dtype_change=True``)."""
    skipped: tuple[str, ...] = ()
    """Components not restored (only with ``strict=False`` or ``allow_world_size_change=True``)."""


# ---------------------------------------------------------------------------------------------------------------
# Collectives, each bounded by the process group timeout, each failure turned into one clear error.


class _CollectiveError(Exception):
    def __init__(self, what: str, rank: int, exc: BaseException, elapsed: float) -> None:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        super().__init__(f"collective '{what}' failed on rank {rank} after {elapsed:.1f} s ({first})")


class _Group:
    """This process's place in the default process group; local no-ops without one."""

    def __init__(self) -> None:
        self.on = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.on else 0
        self.world = dist.get_world_size() if self.on else 1
        self.coordinator = self.rank == 0

    def _run(self, what: str, fn: Callable[[], Any]) -> Any:
        t0 = time.monotonic()
        try:
            return fn()
        except Exception as exc:  # gloo/nccl raise RuntimeError subclasses; all mean the same here
            raise _CollectiveError(what, self.rank, exc, time.monotonic() - t0) from exc

    def broadcast(self, obj: Any, what: str) -> Any:
        if not self.on:
            return obj
        box = [obj if self.coordinator else None]
        self._run(what, lambda: dist.broadcast_object_list(box, src=0))
        return box[0]

    def gather(self, obj: Any, what: str) -> list[Any] | None:
        if not self.on:
            return [obj]
        out: list[Any] | None = [None] * self.world if self.coordinator else None
        self._run(what, lambda: dist.gather_object(obj, out, dst=0))
        return out

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        if not self.on:
            return [obj]
        out: list[Any] = [None] * self.world
        self._run(what, lambda: dist.all_gather_object(out, obj))
        return out

    def all_min(self, value: int, what: str) -> int:
        if not self.on:
            return value
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor([value], dtype=torch.int32, device=device)
        self._run(what, lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN))
        return int(t.item())


# ---------------------------------------------------------------------------------------------------------------
# DCP extensions: fingerprint every item as it is written; fire the write-time fault points.


@contextlib.contextmanager
def _single_process_quiet(group: _Group) -> Iterator[None]:
    """Without a process group DCP warns that it assumes a single process; that is the documented intent here."""
    with warnings.catch_warnings():
        if not group.on:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _offsets(offset: Any) -> tuple[int, ...] | None:
    return tuple(int(o) for o in offset) if offset is not None else None


def tensor_hash(t: torch.Tensor) -> str:
    """xxh3-128 of a tensor's elements, little-endian, row-major: the hash of :class:`TensorRecord`."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return xxhash.xxh3_128().hexdigest()
    return xxhash.xxh3_128(t.view(torch.uint8).numpy().data).hexdigest()


def _save_planner(hook: FaultHook | None) -> Any:
    from torch.distributed.checkpoint import DefaultSavePlanner

    class FingerprintPlanner(DefaultSavePlanner):
        """``DefaultSavePlanner`` that hashes each tensor's values as the writer asks for them."""

        def __init__(self) -> None:
            super().__init__()
            self.content: dict[tuple[str, tuple[int, ...] | None], str] = {}
            self.resolved = 0
            self.partial_at = 1

        def finish_plan(self, new_plan: Any) -> Any:
            plan = super().finish_plan(new_plan)
            self.partial_at = max(1, len(plan.items) // 2)
            return plan

        def resolve_data(self, write_item: Any) -> Any:
            data = super().resolve_data(write_item)
            if isinstance(data, torch.Tensor):
                self.content[(write_item.index.fqn, _offsets(write_item.index.offset))] = tensor_hash(data)
            self.resolved += 1
            if hook is not None and self.resolved == self.partial_at:
                hook("write.partial")  # this rank's file is open and partly written
            return data

    return FingerprintPlanner()


def _storage_writer(path: str, final_name: str, hook: FaultHook | None) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Writer(FileSystemWriter):
        """``FileSystemWriter`` (fsync on) that keeps its write results and names the final directory, not the
        temporary one, in ``.metadata`` (no host path in the file)."""

        def __init__(self) -> None:
            super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=False)
            self.results: list[Any] = []

        def write_data(self, plan: Any, planner: Any) -> Any:
            fut = super().write_data(plan, planner)
            self.results = list(fut.wait())
            if hook is not None:
                hook("write.done")
            return fut

        def storage_meta(self) -> Any:
            return StorageMeta(checkpoint_id=final_name, save_id=self.save_id)

    return Writer()


def _load_planner() -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        """``DefaultLoadPlanner`` whose non-tensor items load with ``weights_only=True`` (the default planner
        unpickles them with ``weights_only=False``, which would run whatever a hostile file holds)."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            obj = safe_loads(value, f"item {fqn}")
            if self.flatten_state_dict:
                _set_path(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafeLoadPlanner()


def _set_path(root: Any, path: tuple[Any, ...], value: Any) -> None:
    node = root
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def safe_loads(blob: bytes | io.BytesIO, what: str) -> Any:
    """Unpickle a ``torch.save`` blob with ``weights_only=True`` (plus the NumPy globals RNG states need)."""
    from ckptaudit.formats.torchload import _numpy_globals

    buf = io.BytesIO(blob) if isinstance(blob, bytes) else blob
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(buf, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointLoadError(f"{what} cannot be loaded safely (weights_only=True): {first}") from None


def _blob(obj: Any, what: str) -> bytes:
    """``torch.save`` bytes of ``obj``, checked to load back with ``weights_only=True`` (fail at save time,
    not at resume time)."""
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise CheckpointSaveError(f"{what} cannot be saved ({exc}); make it return plain values (numbers, strings, "
                                  "lists, dicts) and tensors") from None
    try:
        safe_loads(buf.getvalue(), what)
    except CheckpointLoadError as exc:
        raise CheckpointSaveError(f"{exc}; make it return plain values (numbers, strings, lists, dicts) and "
                                  "tensors") from None
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------------------------
# Save


def _has_state(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _contract(job: Job) -> dict[str, Any]:
    """The master-dtype contract read from the live objects: the dtype of the parameters the optimizer updates
    (under FSDP2, the sharded masters, not the compute copies) and of its element-wise state."""
    params = Counter(_dtype_name(p.dtype) for p in job.model.parameters() if p.requires_grad and p.is_floating_point())
    states = Counter(
        _dtype_name(v.dtype)
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
        if not _has_state(job.scheduler):
            raise CheckpointSaveError(f"job.scheduler ({type(job.scheduler).__name__}) has no state_dict/"
                                      "load_state_dict; give it one or set job.scheduler = None")
        sched = job.scheduler.state_dict()
        _blob(sched, "job.scheduler.state_dict()")
        state[KEYS["scheduler"]] = sched
        inventory["scheduler"] = {"key": KEYS["scheduler"], "type": type(job.scheduler).__name__}
    else:
        absent["scheduler"] = "job.scheduler is None"
    if job.data is not None and _has_state(job.data):
        # One opaque blob per rank: a StatefulDataLoader's state changes shape as it iterates, so it cannot be
        # loaded into a template the way tensors are.
        state[KEYS["data-progress"]] = {f"rank{rank}": _blob(job.data.state_dict(), "job.data.state_dict()")}
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


def _previous(root: str, exclude: str = "") -> str | None:
    """The newest committed step directory name under ``root`` (for messages)."""
    best: tuple[int, str] | None = None
    for name in _listdir(root):
        parsed = layout.parse_step_name(name)
        if parsed and parsed[1] == "committed" and name != exclude and (best is None or parsed[0] > best[0]):
            best = (parsed[0], name)
    return best[1] if best else None


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _prepare(root: str, step: int, overwrite: bool) -> tuple[str, str]:
    """(coordinator) Create ROOT, refuse to clobber, remove temporaries of dead saves, make the temporary dir."""
    final = layout.step_name(step)
    try:
        os.makedirs(root, exist_ok=True)
        if os.path.exists(os.path.join(root, final)) and not overwrite:
            return ("error", f"{os.path.join(root, final)} already exists (a committed checkpoint); save under "
                             "another step, or pass overwrite=True to replace it once the new one is committed")
        for name in _listdir(root):
            parsed = layout.parse_step_name(name)
            if parsed is None or parsed[1] == "committed":
                continue
            committed_twin = os.path.isdir(os.path.join(root, layout.step_name(parsed[0])))
            # A 'replaced' directory is the only copy of its step until the replacement is in place.
            if parsed[1] in ("partial", "deleting") or committed_twin:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        tmp_name = layout.partial_name(step, layout.nonce())
        os.makedirs(os.path.join(root, tmp_name))
        layout.fsync_dir(root)
    except OSError as exc:
        return ("error", f"cannot prepare {root} for step {step}: {exc.strerror or exc} ({exc.filename or root})")
    return ("ok", tmp_name)


def _report(tmp: str, writer: Any, planner: Any, rank: int) -> dict[str, Any]:
    """(all ranks) Size and xxh3-128 of this rank's files and of every item in them, read back from disk."""
    by_file: dict[str, list[Any]] = {}
    for wr in writer.results:
        by_file.setdefault(wr.storage_data.relative_path, []).append(wr)
    plan_items = {(wi.index.fqn, _offsets(wi.index.offset)): wi for wi in planner.plan.items}
    files: dict[str, Any] = {}
    tensors: list[tuple[str, str, list[int], dict[str, Any]]] = []
    objects: list[tuple[str, dict[str, Any]]] = []
    for name, results in sorted(by_file.items()):
        ranges = [(int(wr.storage_data.offset), int(wr.storage_data.length)) for wr in results]
        size, digest, parts = mf.hash_file(os.path.join(tmp, name), ranges)
        files[name] = {"size": size, "xxh3_128": digest}
        for wr, part in zip(results, parts, strict=True):
            key = (wr.index.fqn, _offsets(wr.index.offset))
            entry: dict[str, Any] = {"file": name, "offset": int(wr.storage_data.offset),
                                     "length": int(wr.storage_data.length), "xxh3_128": part}
            item = plan_items.get(key)
            td = getattr(item, "tensor_data", None)
            if td is not None:
                entry = {"offsets": list(td.chunk.offsets), "sizes": list(td.chunk.sizes), **entry,
                         "content_xxh3_128": planner.content.get(key)}
                tensors.append((wr.index.fqn, _dtype_name(td.properties.dtype), list(td.size), entry))
            else:
                objects.append((wr.index.fqn, entry))
    return {"rank": rank, "ok": True, "files": files, "tensors": tensors, "objects": objects}


def _component_of(fqn: str) -> str:
    return _COMPONENT_OF_KEY.get(fqn.split(".", 1)[0], "other")


def _build_manifest(tmp: str, step: int, world: int, reports: list[dict[str, Any]], inventory: dict[str, Any],
                    contract: dict[str, Any]) -> dict[str, Any]:
    """(coordinator) Merge the ranks' reports into the manifest."""
    files: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    for rep in reports:
        files.update(rep["files"])
        for fqn, dtype, shape, entry in rep["tensors"]:
            t = tensors.setdefault(fqn, {"component": _component_of(fqn), "dtype": dtype, "shape": shape,
                                         "shards": []})
            t["shards"].append(entry)
        for fqn, entry in rep["objects"]:
            objects[fqn] = {"component": _component_of(fqn), **entry}
    for t in tensors.values():
        t["shards"].sort(key=lambda s: s["offsets"])
    size, digest, _ = mf.hash_file(os.path.join(tmp, ".metadata"))
    files[".metadata"] = {"size": size, "xxh3_128": digest}
    return {
        "format": mf.FORMAT,
        "version": mf.VERSION,
        "step": step,
        "world_size": world,
        "torch_version": torch.__version__,
        "ckptaudit_version": __version__,
        "hash_algorithm": HASH_ALGORITHM,
        "created_unix": round(time.time(), 3),
        "contract": contract,
        "components": inventory,
        "files": dict(sorted(files.items())),
        "tensors": dict(sorted(tensors.items())),
        "objects": dict(sorted(objects.items())),
    }


def _write_manifest(tmp: str, manifest: dict[str, Any]) -> None:
    path = os.path.join(tmp, layout.MANIFEST)
    with open(path, "wb") as fh:
        fh.write(json.dumps(manifest, separators=(",", ":"), allow_nan=False).encode("utf-8"))
        fh.flush()
        os.fsync(fh.fileno())
    layout.fsync_dir(tmp)


def _commit(root: str, tmp_name: str, final_name: str) -> None:
    """(coordinator) The commit point: one atomic rename. An existing ``step-N`` (``overwrite=True``) is moved
    aside first and removed only after the new one is in place."""
    final = os.path.join(root, final_name)
    aside = None
    if os.path.exists(final):
        aside = os.path.join(root, f"{final_name}.replaced-{layout.nonce()}")
        os.rename(final, aside)
    os.rename(os.path.join(root, tmp_name), final)
    layout.fsync_dir(root)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _free_space(root: str) -> str:
    """`` [the filesystem is full: N bytes free]`` or `` [N MiB free on ROOT's filesystem]``, for messages."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return ""
    if free < 1 << 20:
        return f" [the filesystem holding {root} is full: {free} bytes free]"
    return f" [{free >> 20} MiB free on the filesystem holding {root}]"


def _failures(exc: BaseException) -> str:
    """One line per failed rank from DCP's ``CheckpointException``."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    parts = []
    for rank, wrapped in sorted(failures.items()):
        err = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        parts.append(f"rank {rank}: {type(err).__name__}: {err}")
    return "; ".join(parts)


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
    and the data progress (``job.data.state_dict()``: a :class:`~ckptaudit.recipe.DataSource` or torchdata's
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
    group = _Group()
    step = int(job.step if step is None else step)
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be at least 1 (the checkpoint just written), got {keep_last}")
    hook = fault_hook if fault_hook is not None else hook_from_env(group.rank, step)
    final_name = layout.step_name(step)
    what = f"save of step {step} to {root}"

    def left_behind(tmp_name: str) -> str:
        prev = _previous(root, final_name if not overwrite else "")
        return (f"nothing was committed; {tmp_name} is left behind and the next save removes it; "
                + (f"the previous checkpoint {prev} is untouched" if prev else "there is no previous checkpoint"))

    try:
        prep = group.broadcast(_prepare(root, step, overwrite) if group.coordinator else None, "prepare")
    except _CollectiveError as exc:
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

    planner = _save_planner(hook)
    writer = _storage_writer(tmp, final_name, hook)
    try:
        with _single_process_quiet(group):
            dcp.save(state, storage_writer=writer, planner=planner, no_dist=not group.on)
    except CheckpointException as exc:
        disk = _free_space(root)  # before the clean-up: torch's writer may report a full disk as a short write
        # DCP gathered every rank's outcome before raising, so no rank is still writing: safe to clean up.
        if group.coordinator:
            shutil.rmtree(tmp, ignore_errors=True)
        prev = _previous(root, final_name if not overwrite else "")
        raise CheckpointSaveError(
            f"{what} failed while writing ({_failures(exc)}){disk}; nothing was committed and the temporary "
            f"directory {tmp_name} was removed; "
            + (f"the previous checkpoint {prev} is untouched" if prev else "there is no previous checkpoint")
        ) from None
    except Exception as exc:  # noqa: BLE001 - a collective inside DCP failed: a peer died or stalled
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointSaveError(f"{what}: torch.distributed.checkpoint.save failed on rank {group.rank} "
                                  f"({first}); a rank died or stalled; {left_behind(tmp_name)}") from None

    try:
        report = _report(tmp, writer, planner, group.rank)
    except OSError as exc:
        report = {"rank": group.rank, "ok": False, "error": f"cannot hash its files: {exc}"}
    if hook is not None:
        hook("report")
    try:
        reports = group.gather(report, "gather file reports (vote 1)")
    except _CollectiveError as exc:
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
                _write_manifest(tmp, _build_manifest(tmp, step, group.world, reports, inventory, contract))
            except OSError as exc:
                ready, abort = 0, f"rank 0: cannot write {layout.MANIFEST}: {exc.strerror or exc}"
        if ready and hook is not None:
            hook("commit.manifest")
    try:
        agreed = group.all_min(ready, "commit vote (vote 2)")
    except _CollectiveError as exc:
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
        outcome = _commit_and_tidy(root, tmp_name, final_name, keep_last, hook)
    else:
        outcome = ("pending", None)
    try:
        outcome = group.broadcast(outcome, "commit outcome")
    except _CollectiveError as exc:
        raise CheckpointSaveError(f"{what}: {exc}; the checkpoint may or may not be committed; "
                                  f"`ckptaudit latest {root}` says which one is") from None
    if outcome[0] != "ok":
        raise CheckpointSaveError(f"{what}: {outcome[1]}")
    deleted, notes = outcome[1]
    return SavedCheckpoint(os.path.join(root, final_name), step, tuple(deleted), tuple(notes))


def _commit_and_tidy(root: str, tmp_name: str, final_name: str, keep_last: int | None,
                     hook: FaultHook | None) -> tuple[str, Any]:
    """(coordinator) Steps 7-9 of :func:`save_checkpoint`."""
    from ckptaudit.store.retention import apply_retention

    try:
        _commit(root, tmp_name, final_name)
    except OSError as exc:
        return ("error", f"the commit rename {tmp_name} -> {final_name} failed ({exc.strerror or exc}); nothing "
                         "was committed")
    if hook is not None:
        hook("commit.renamed")
    notes: list[str] = []
    try:
        layout.write_durably(os.path.join(root, layout.POINTER), (final_name + "\n").encode())
    except OSError as exc:
        notes.append(f"committed, but the {layout.POINTER} pointer was not updated ({exc.strerror or exc}); "
                        "`ckptaudit latest` finds the checkpoint without it")
    if hook is not None:
        hook("commit.pointer")
    deleted: list[str] = []
    if keep_last is not None:
        try:
            deleted = apply_retention(root, keep_last, protect=(final_name,))
        except OSError as exc:
            notes.append(f"committed, but retention failed ({exc.strerror or exc}); older checkpoints remain")
    return ("ok", (deleted, notes))


# ---------------------------------------------------------------------------------------------------------------
# Load


def _tensor_leaves(tree: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """``(dcp_key, tensor)`` for every tensor of a nested dict/list, keyed as DCP flattens them."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _tensor_leaves(v, f"{prefix}.{k}")
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from _tensor_leaves(v, f"{prefix}.{i}")
    elif isinstance(tree, torch.Tensor):
        yield prefix, tree


def _resolve(path: str) -> tuple[str, str]:
    """(coordinator) A checkpoint directory, or the newest resumable one under a root."""
    from ckptaudit.store.latest import find_latest

    if os.path.isfile(os.path.join(path, layout.MANIFEST)):
        return ("ok", path)
    if not os.path.isdir(path):
        return ("error", f"{path}: no such directory; give a step directory or the root holding them")
    result = find_latest(path, verify="sizes")
    if result.latest is not None:
        if not os.path.isfile(os.path.join(result.latest.path, layout.MANIFEST)):
            return ("error", f"{path}: the newest resumable checkpoint, {result.latest.name}, was not written by "
                             "ckptaudit.store.save_checkpoint (no manifest.json); load it with the tool that "
                             "wrote it")
        return ("ok", result.latest.path)
    why = "; ".join(f"{c.candidate.name}: {c.reason}" for c in result.checked) or "no step directories"
    return ("error", f"{path}: no resumable checkpoint ({why})")


def load_checkpoint(
    job: Job,
    path: str | os.PathLike[str],
    *,
    allow_dtype_change: bool = False,
    allow_world_size_change: bool = False,
    strict: bool = True,
    verify: str = "hashes",
) -> LoadedCheckpoint:
    """(all ranks, collective) Restore ``job`` from a checkpoint of :func:`save_checkpoint`.

    ``path`` is a ``step-N`` directory or the root holding them (then the newest resumable one is taken). On
    CPU the continuation is bit-identical to the uninterrupted run.

    Order of events:

    1. (coordinator) resolves ``path``; broadcasts the directory.
    2. (all ranks) read ``manifest.json``; check the world size, the components against ``job`` and the
       dtypes of the live model and optimizer against the saved ones (no silent cast, see
       ``allow_dtype_change``).
    3. (all ranks) verify the files against the manifest, each rank a share (sizes, and xxh3-128 when
       ``verify="hashes"``); exchange the problems, so every rank raises the same error.
    4. (all ranks) ``check_metadata_safe`` on ``.metadata`` (DCP unpickles it with plain ``pickle``); DCP is
       given the metadata it vetted (``safe_dcp_reader``), never the file to unpickle again.
    5. (all ranks) ``torch.distributed.checkpoint.load`` into the live state (non-tensor items unpickled
       with ``weights_only=True``), then ``set_state_dict``, the scheduler, the step, the data progress, and
       last this rank's RNG state.
    """
    if verify not in ("hashes", "sizes"):
        raise ValueError(f"verify must be 'hashes' or 'sizes', not {verify!r}")
    group = _Group()
    path = os.path.abspath(os.fspath(path))
    try:
        resolved = group.broadcast(_resolve(path) if group.coordinator else None, "resolve checkpoint")
    except _CollectiveError as exc:
        raise CheckpointLoadError(f"load of {path}: {exc}") from None
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
        in_job = live is not None and (comp != "data-progress" or _has_state(live))
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
    casts = _dtype_changes(manifest, tmpl)
    if casts and not allow_dtype_change:
        more = f" (and {len(casts) - 3} more)" if len(casts) > 3 else ""
        raise CheckpointLoadError(
            f"refusing to load {name} into tensors of another dtype: {'; '.join(casts[:3])}{more}. "
            f"torch.distributed.checkpoint would cast silently ({_ISSUE_SILENT_CAST}), and the run would resume "
            f"from different masters. Build the model and optimizer in the saved dtype "
            f"({manifest['contract'].get('master_dtype', '?')}) before loading, or pass allow_dtype_change=True "
            "to cast on purpose")

    files = sorted(manifest["files"])
    mine = [f for i, f in enumerate(files) if i % group.world == group.rank]
    problems = [f.message for f in mf.verify_files(ckpt, manifest, hashes=verify == "hashes", only=mine)]
    try:
        all_problems = [p for ps in group.all_gather(problems, "exchange verification") for p in ps]
    except _CollectiveError as exc:
        raise CheckpointLoadError(f"load of {ckpt}: {exc}") from None
    if all_problems:
        raise CheckpointLoadError(f"{ckpt} does not match its manifest: {'; '.join(all_problems[:5])}"
                                  + (f" (and {len(all_problems) - 5} more)" if len(all_problems) > 5 else "")
                                  + "; resume from an older checkpoint (`ckptaudit latest` lists them)")
    from ckptaudit.formats.dcp import UnsafeCheckpointError
    from ckptaudit.formats.torchload import safe_dcp_reader

    try:
        reader = safe_dcp_reader(ckpt)  # DCP reads the metadata this check vetted, never the pickle again
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
    if "data-progress" in comps and restore_rank and job.data is not None and _has_state(job.data):
        tmpl[KEYS["data-progress"]] = {rank_key: b""}
    if "extras" in comps:
        tmpl[KEYS["extras"]] = ""

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _single_process_quiet(group):
            dcp.load(tmpl, storage_reader=reader, planner=_load_planner(), no_dist=not group.on)
    except CheckpointException as exc:
        raise CheckpointLoadError(f"torch.distributed.checkpoint.load of {ckpt} failed ({_failures(exc)})") from None
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


def _dtype_changes(manifest: Mapping[str, Any], tmpl: Mapping[str, Any]) -> list[str]:
    """``"key: saved X, live Y"`` for every live model/optimizer tensor whose dtype differs from the saved one."""
    out = []
    saved = manifest["tensors"]
    for top in (KEYS["model"], KEYS["optimizer"]):
        for key, tensor in _tensor_leaves(tmpl[top], top):
            rec = saved.get(key)
            if isinstance(rec, dict) and rec.get("dtype") != _dtype_name(tensor.dtype):
                out.append(f"{key} was saved as {rec.get('dtype')} but the live tensor is {_dtype_name(tensor.dtype)}")
    return out
