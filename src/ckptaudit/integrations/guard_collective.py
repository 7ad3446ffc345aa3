"""The guard's collectives: every rank asks rank 0's guard the same question at the same point, in tiny all-reduces.

Which ranks run what: every rank calls each of these at the same point of its loop (with the same ``on_failure``
and ``max_unverified``, so no rank enters a collective alone); only the rank that audits holds the answer
(:class:`~ckptaudit.integrations.guard.Guard`), the others learn it from the all-reduce. Importable from
:mod:`ckptaudit.integrations.guard`.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptaudit.integrations.guard import Guard

__all__ = ["ROUND_S", "before_save_everywhere", "likely_owner", "stop_requested", "wait_everywhere"]


def likely_owner() -> bool:
    """Whether this process looks like the one that will audit (rank 0), before the integration knows: the
    default group's rank when torch.distributed is already up, else ``RANK`` (torchrun, ...), else
    ``LOCAL_RANK`` and ``NODE_RANK`` (Lightning's launcher sets no ``RANK`` in the processes it starts), else a
    single process (yes)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()) == 0
    except (AttributeError, RuntimeError):
        pass
    env = os.environ
    if env.get("RANK", "").strip():
        return env["RANK"].strip() == "0"
    return all(env.get(name, "0").strip() in ("", "0") for name in ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK"))


def stop_requested(guard: Guard) -> bool:
    """(all ranks, collective when distributed) Whether rank 0's guard asks training to stop; every rank gets
    the same answer (a one-element all-reduce of the default group), so all of them leave the loop at the same
    step. Call it at the same point of every step on every rank. Its cost: one 4-byte all-reduce per call (a
    latency, no bandwidth), on the current CUDA device under NCCL, on the CPU under gloo; none at all with
    ``on_failure="warn"``, which never stops (every rank builds its guard with the same ``on_failure``, so no
    rank enters the collective alone)."""
    if guard.on_failure != "stop":
        return False
    import torch
    import torch.distributed as dist

    on = dist.is_available() and dist.is_initialized()
    flag = guard.should_stop() if not on or dist.get_rank() == 0 else False
    if not on or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


ROUND_S = 1.0
"""How long the rank that audits waits between two all-reduces in :func:`before_save_everywhere` and
:func:`wait_everywhere`."""


def _any_rank_default() -> Callable[[bool], bool] | None:
    """An "any rank says true" reduction over the default group (a 4-byte all-reduce), or ``None`` when this
    process is alone."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None

    def any_rank(flag: bool) -> bool:
        import torch

        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    return any_rank


def before_save_everywhere(guard: Guard, step: int | None = None,
                           any_rank: Callable[[bool], bool] | None = None) -> None:
    """(all ranks, just before a collective save; collective when distributed and ``max_unverified`` is set)
    :meth:`Guard.before_save` on the rank that audits, while the others wait beside it in rounds of at most
    :data:`ROUND_S` seconds, one tiny all-reduce each (``any_rank``: the library's own "any rank true" reduction,
    Lightning's ``reduce_boolean_decision``; default, the default group's all-reduce): no rank sits in the save's
    first collective for as long as an audit takes, which its timeout (10 to 30 minutes) could end. Every rank
    builds its guard with the same ``max_unverified``, so none enters the rounds alone; with no bound there are
    none."""
    if guard.max_unverified is None:
        return
    reduce = any_rank or _any_rank_default()
    if reduce is None:
        guard.before_save(step)
        return
    while reduce(guard.before_save(step, timeout=ROUND_S) is None):
        pass


def wait_everywhere(guard: Guard, timeout: float | None = None,
                    any_rank: Callable[[bool], bool] | None = None) -> bool:
    """(all ranks, at the end of training; collective when distributed) :meth:`Guard.wait` on the rank that
    audits (up to ``timeout`` seconds), the others beside it in rounds of one tiny all-reduce (as in
    :func:`before_save_everywhere`). Returns whether every audit finished (on the rank that audits; true on
    the others)."""
    reduce = any_rank or _any_rank_default()
    if reduce is None:
        return guard.wait(timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = ROUND_S if deadline is None else max(0.0, min(ROUND_S, deadline - time.monotonic()))
        done = guard.wait(left)
        expired = deadline is not None and time.monotonic() >= deadline
        if not reduce(not done and not expired):
            return done


def _collective_device() -> Any:
    """The device a collective's tensor must live on for the default group's backend: NCCL needs this process's
    current CUDA device (``torch.cuda.current_device()``, set by the launcher per local rank; a bare ``"cuda"``
    would be device 0 on every rank); gloo takes CPU tensors."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
