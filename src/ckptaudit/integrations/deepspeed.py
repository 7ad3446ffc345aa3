"""DeepSpeed: ``latest`` moves to a new tag only when its audit passes. See ``docs/integrations/deepspeed.md``.

    from ckptaudit.integrations.guard import Guard, stop_requested
    from ckptaudit.integrations.deepspeed import save_checkpoint

    guard = Guard(on_failure="stop")                         # on every rank; only global rank 0 audits
    for step, batch in enumerate(loader, 1):
        engine.backward(engine(batch)); engine.step()
        if step % 500 == 0:
            save_checkpoint(engine, "ckpts", guard=guard)   # all ranks, instead of engine.save_checkpoint
        if stop_requested(guard):                            # all ranks, the same answer
            break
    guard.finish()                                           # raises CheckpointAuditFailed if a save failed (stop)

    engine.load_checkpoint("ckpts")                          # reads `latest`: never a tag that failed

Which ranks run what: every rank calls :func:`save_checkpoint`; global rank 0 first waits while
``max_unverified`` saves are waiting for a verdict (:func:`before_save_everywhere`: the other ranks wait
beside it in rounds of one tiny all-reduce; default 1 with ``on_failure="stop"``); then every rank calls ``engine.save_checkpoint(..., save_latest=False)`` (collective;
DeepSpeed's own files, nothing changed); then global rank 0 queues
``save_dir/<tag>`` for the audit. When it passes, rank 0 writes ``save_dir/latest`` (atomically: a temporary file
renamed over it) with the tag, which is what ``engine.load_checkpoint(save_dir)`` reads; when it fails, the tag
directory becomes ``quarantined-<tag>`` and ``latest`` keeps naming the previous tag that passed.
"""

from __future__ import annotations

import os
from typing import Any

from ckptaudit.integrations.guard import Guard, before_save_everywhere, stop_requested
from ckptaudit.integrations.live_contract import declare_live_contract

__all__ = ["save_checkpoint", "stop_requested"]


def save_checkpoint(engine: Any, save_dir: str | os.PathLike[str], tag: str | None = None,
                    client_state: dict[str, Any] | None = None, *, guard: Guard, **kwargs: Any) -> str:
    """(all ranks, collective) ``engine.save_checkpoint`` without moving ``latest``; the audit moves it.

    ``tag`` defaults to DeepSpeed's ``global_step<N>``; other keywords go to ``engine.save_checkpoint``
    (``exclude_frozen_parameters``). Returns the tag directory. Raises ``ValueError`` for a decoupled
    (asynchronous) checkpoint engine, whose files are not complete when ``save_checkpoint`` returns. Unless
    ``guard`` has a ``master_dtype``, its audits hold the masters to the engine's optimizer's (its fp32 partitions).
    """
    if "save_latest" in kwargs:
        raise TypeError("ckptaudit deepspeed save_checkpoint: save_latest is not an option; `latest` moves when "
                        "the audit passes")
    ckpt_engine = getattr(engine, "checkpoint_engine", None)
    decoupled = getattr(ckpt_engine, "is_decoupled", None)
    if callable(decoupled) and decoupled():
        raise ValueError(
            f"ckptaudit deepspeed save_checkpoint: the checkpoint engine {type(ckpt_engine).__name__} is decoupled "
            "(asynchronous): its files are not complete when save_checkpoint returns, so they cannot be audited "
            "then; use DeepSpeed's default (synchronous) checkpoint engine")
    save_dir = os.fspath(save_dir)
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    before_save_everywhere(guard, int(engine.global_steps))
    engine.save_checkpoint(save_dir, tag=tag, client_state=client_state or {}, save_latest=False, **kwargs)
    path = os.path.join(save_dir, tag)
    if engine.global_rank == 0:
        enabled = {k: getattr(engine, f"{k}_enabled", lambda: None)() for k in ("bfloat16", "fp16")}
        declare_live_contract(guard, engine.optimizer,
                              f"DeepSpeed bf16 {enabled['bfloat16']}, fp16 {enabled['fp16']}")
        guard.submit(path, step=int(engine.global_steps), on_pass=lambda p: _point_latest(save_dir, tag))
    return path


def _point_latest(save_dir: str, tag: str) -> None:
    """(rank 0, guard worker) ``save_dir/latest`` := ``tag``, atomically (DeepSpeed reads it whole)."""
    from ckptaudit.store.layout import write_durably

    write_durably(os.path.join(save_dir, "latest"), tag.encode())
