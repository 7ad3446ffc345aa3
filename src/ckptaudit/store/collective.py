"""Collectives of the writer and the loader, each bounded by the process group's timeout, each failure turned
into one :class:`CollectiveError` that names the step, the rank and the time it waited. Without an initialised
process group every method is a local no-op (one process)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CollectiveError", "Group"]


class CollectiveError(Exception):
    def __init__(self, what: str, rank: int, exc: BaseException, elapsed: float) -> None:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        super().__init__(f"collective '{what}' failed on rank {rank} after {elapsed:.1f} s ({first})")


class Group:
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
            raise CollectiveError(what, self.rank, exc, time.monotonic() - t0) from exc

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
