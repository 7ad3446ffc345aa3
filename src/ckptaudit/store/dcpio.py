"""Our extensions of ``torch.distributed.checkpoint``: a save planner that fingerprints every item as it is
written, a ``FileSystemWriter`` that keeps its results and fires the write-time fault points, a load planner that
unpickles non-tensor items with ``weights_only=True`` only, and DCP's failures turned into one line per rank.
Every function here runs on every rank (inside the collective DCP save/load)."""

from __future__ import annotations

import contextlib
import io
import pickle
import shutil
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import xxhash

from ckptaudit.store.checkpoint import CheckpointLoadError, CheckpointSaveError
from ckptaudit.store.collective import Group
from ckptaudit.store.faults import FaultHook

__all__ = [
    "checked_blob",
    "dcp_failures",
    "free_space",
    "item_offsets",
    "load_planner",
    "safe_loads",
    "save_planner",
    "single_process_quiet",
    "storage_writer",
    "tensor_hash",
]


@contextlib.contextmanager
def single_process_quiet(group: Group) -> Iterator[None]:
    """Without a process group DCP warns that it assumes a single process; that is the documented intent here."""
    with warnings.catch_warnings():
        if not group.on:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def item_offsets(offset: Any) -> tuple[int, ...] | None:
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


def save_planner(hook: FaultHook | None) -> Any:
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
                self.content[(write_item.index.fqn, item_offsets(write_item.index.offset))] = tensor_hash(data)
            self.resolved += 1
            if hook is not None and self.resolved == self.partial_at:
                hook("write.partial")  # this rank's file is open and partly written
            return data

    return FingerprintPlanner()


def storage_writer(path: str, final_name: str, hook: FaultHook | None) -> Any:
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


def load_planner() -> Any:
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
    from ckptaudit.formats.torchload import numpy_globals

    buf = io.BytesIO(blob) if isinstance(blob, bytes) else blob
    try:
        with torch.serialization.safe_globals(numpy_globals()):
            return torch.load(buf, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointLoadError(f"{what} cannot be loaded safely (weights_only=True): {first}") from None


def checked_blob(obj: Any, what: str) -> bytes:
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


def free_space(root: str) -> str:
    """`` [the filesystem is full: N bytes free]`` or `` [N MiB free on ROOT's filesystem]``, for messages."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return ""
    if free < 1 << 20:
        return f" [the filesystem holding {root} is full: {free} bytes free]"
    return f" [{free >> 20} MiB free on the filesystem holding {root}]"


def dcp_failures(exc: BaseException) -> str:
    """One line per failed rank from DCP's ``CheckpointException``."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    parts = []
    for rank, wrapped in sorted(failures.items()):
        err = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        parts.append(f"rank {rank}: {type(err).__name__}: {err}")
    return "; ".join(parts)
