"""A real FSDP2 save of Llama-shaped parameters, as ``launch`` runs it for tests/bench/test_bench_sim.py (importable by
name): the checkpoint ``bench/sim_dcp.py`` must reproduce."""

from __future__ import annotations

import random
from typing import Any

from ckptaudit.launch import RankContext


def save_llama(ctx: RankContext, path: str, params: list[tuple[str, tuple[int, ...]]]) -> dict[str, Any]:
    """(all ranks) Parameters of ``params``' names and shapes, ``fully_shard`` -ed (Shard(0) over every rank), one
    AdamW step under a scheduler, saved the documented way (``get_state_dict`` + ``dcp.save``) with the train step
    and this rank's RNG state as ``bench/sim_dcp.py``'s ``documented_state`` describes them.

    Returns this rank's state dict with every DTensor as its local shard (plain tensors), for the simulator's
    ``values``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    root = torch.nn.Module()
    for name, shape in params:  # nested modules, so the FQNs are the names given
        *path_parts, leaf = name.split(".")
        mod = root
        for part in path_parts:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.randn(shape)))
    fully_shard(root)
    optim = torch.optim.AdamW(root.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda _: 1.0)
    loss = sum((p.to_local() ** 2).sum() for p in root.parameters())  # type: ignore[operator]
    loss.backward()
    optim.step()
    sched.step()
    msd, osd = get_state_dict(root, optim)
    state = {"model": msd, "optim": osd, "train_state": {"step": 1},
             "rng": {f"rank{ctx.rank}": {"python": random.Random(ctx.rank).getstate(),
                                         "torch": torch.Generator().manual_seed(ctx.rank).get_state()}}}
    dcp.save(state, checkpoint_id=path)

    def local(obj: Any) -> Any:
        if isinstance(obj, DTensor):
            return obj.to_local().clone()
        if isinstance(obj, dict):
            return {k: local(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [local(v) for v in obj]
        return obj

    out: dict[str, Any] = local(state)
    return out
