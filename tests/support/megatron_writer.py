"""Megatron-Core ``torch_dist`` checkpoints, written by the real megatron-core 0.16.1 on 2 gloo ranks (CPU).

:func:`write_megatron` runs on every rank (``ckptaudit.launch``; imported by name, as spawn requires). What is
real and what is not:

- real: ``parallel_state`` (tensor parallel size 2, so every matrix is split across the two ranks' files), a tiny
  ``GPTModel`` (local layer spec, bf16 parameters) and its ``sharded_state_dict``, the optimizer key layout built
  with Megatron's own helpers (``get_param_id_to_sharded_param_map``, ``make_sharded_optimizer_tensor``,
  ``optim_state_to_sharding_state``), ``OptimizerParamScheduler``, and ``dist_checkpointing.save`` with its
  default ``torch_dist`` strategy (``metadata.json``, ``common.pt``, ``__R_T.distcp``, DCP ``.metadata`` with
  ``all_local_plans``); every checkpoint is loaded back with ``dist_checkpointing.load`` to prove it is real.
- replaced, in this writer process only: ``torch.cuda.synchronize`` (a no-op) and ``torch.cuda.current_device``
  (``"cpu"``): the torch_dist save calls the first unconditionally and builds its failure flag on the second.
- written by hand, because Megatron's ``Float16OptimizerWithFloat16Params`` needs CUDA to build: the optimizer
  itself. Its state is what that class keeps and how its ``sharded_state_dict`` lays it out: fp32 masters of the
  bf16 parameters (``optimizer.state.fp32_param.<key>``), ``torch.optim.AdamW`` moments of the masters and of
  the fp32 parameters (``optimizer.state.exp_avg.<key>``, ``optimizer.state.exp_avg_sq.<key>``), the shared
  step as ``common_step``; after each step the masters are copied into the bf16 parameters, as its
  ``_copy_main_params_to_model_params`` does. Gradients are seeded random numbers (no forward pass).
- the top-level state is the one Megatron-LM's ``generate_state_dict`` builds (megatron-core does not ship
  ``megatron.training``): ``args`` (an ``argparse.Namespace``), ``checkpoint_version``, ``iteration``, ``model``,
  ``optimizer``, ``opt_param_scheduler``, ``rng_state`` (a ``ShardedObject`` per rank), and the folder names
  ``iter_NNNNNNN`` and ``latest_checkpointed_iteration.txt`` of its ``get_checkpoint_name``.

Variants: ``full``; ``model-only`` (no optimizer, no scheduler); ``rounded-masters`` (the masters saved after a
round trip through bf16: the defect ckptaudit must find); ``cast-to-bf16`` (masters and moments stored as bf16, as
an exporter that casts the whole state writes them: the same defect, which the saved ``args.bf16`` contradicts); ``distributed-fully-reshardable`` and
``distributed-dp-reshardable`` (the same state in the key layouts of Megatron's ``DistributedOptimizer``, which
needs CUDA too: see :func:`_distributed_state`).
"""

from __future__ import annotations

import argparse
import os
import random
from typing import Any

STEPS = 2


def _patch_cuda() -> None:
    import torch

    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]


def _model(ctx: Any, init: bool = True) -> Any:
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    if init:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=ctx.world_size)
    torch.manual_seed(1)
    cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                            bf16=True, params_dtype=torch.bfloat16, tensor_model_parallel_size=ctx.world_size)
    return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)


def _train(model: Any) -> tuple[Any, list[Any], list[Any], Any]:
    """Megatron's mixed-precision optimizer on CPU: AdamW over fp32 masters of the bf16 parameters (and over the
    fp32 parameters themselves), masters copied into the model after each step."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_(True) if p.dtype == torch.bfloat16 else p for p in params]
    decay = [i for i, p in enumerate(params) if p.dim() > 1]
    no_decay = [i for i, p in enumerate(params) if p.dim() <= 1]
    order = decay + no_decay  # Megatron's groups: weight decay first, then biases and norms
    opt = torch.optim.AdamW([{"params": [masters[i] for i in decay], "weight_decay": 0.1},
                             {"params": [masters[i] for i in no_decay], "weight_decay": 0.0}], lr=1e-3)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=1,
                                    lr_decay_steps=10, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                    wd_incr_steps=10, wd_incr_style="constant")
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for m in masters:
            m.grad = torch.randn(m.shape, generator=gen) * 1e-2
        opt.step()
        sched.step(1)
        with torch.no_grad():
            for p, m in zip(params, masters, strict=True):
                if p is not m:
                    p.copy_(m)
    return opt, [params[i] for i in order], [masters[i] for i in order], sched


def _distributed_state(ctx: Any, model_sd: Any, opt: Any, params: list[Any], masters: list[Any],
                       sharding: str) -> Any:
    """What ``DistributedOptimizer.sharded_state_dict`` returns for ``sharding`` (``metadata
    ["distrib_optim_sharding_type"]``): ``fully_reshardable`` keeps every parameter's fp32 master and moments under
    ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>`` (``sharded_param_state_fully_reshardable``);
    ``dp_reshardable`` keeps them in flat per-bucket tensors ``optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<b>
    .dtype_<(param, grad dtype)>.bucket_idx_<k>.<name>`` and the param groups in a ShardedObject
    (``sharded_param_state_dp_reshardable``). One bucket per rank here; ``<g>`` is the rank's data-parallel group
    (one per tensor-parallel rank)."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        make_sharded_optimizer_tensor,
    )

    inner = opt.state_dict()
    live = [opt.state[m] for m in masters]
    groups = [{k: v for k, v in g.items()} for g in inner["param_groups"]]
    if sharding == "fully_reshardable":
        id_map = get_param_id_to_sharded_param_map(model_sd, params)
        param_state = {i: {name: make_sharded_optimizer_tensor(id_map[i], t.detach(), prefix=f"optimizer.state.{name}")
                           for name, t in (("param", m.detach().float()), ("exp_avg", s["exp_avg"]),
                                           ("exp_avg_sq", s["exp_avg_sq"]))}
                       for i, (m, s) in enumerate(zip(masters, live, strict=True))}
        return {"optimizer": {"param_groups": groups}, "param_state": param_state,
                "param_state_sharding_type": sharding}
    prefix = f"optimizer.distributed.dp_group_idx_{ctx.rank}"
    bucket = f"{prefix}.gbuf_idx_0.dtype_{(torch.bfloat16, torch.float32)}.bucket_idx_0"
    flat = {"param": torch.cat([m.detach().float().flatten() for m in masters]),
            "exp_avg": torch.cat([s["exp_avg"].flatten() for s in live]),
            "exp_avg_sq": torch.cat([s["exp_avg_sq"].flatten() for s in live])}
    numel = int(flat["param"].numel())
    return {"optimizer": ShardedObject(f"{prefix}.optimizer", {"param_groups": groups}, (1,), (0,), replica_id=0),
            "param_state": {
                "per_bucket_numel": ShardedObject(f"{prefix}.per_bucket_numel", {0: {"bf16": [numel]}}, (1,), (0,),
                                                  replica_id=0),
                0: {"bf16": [{name: ShardedTensor.from_rank_offsets(f"{bucket}.{name}", t, replica_id=0)
                              for name, t in flat.items()}]}},
            "param_state_sharding_type": sharding}


def _optimizer_state(model_sd: Any, opt: Any, params: list[Any], masters: list[Any], round_masters: bool,
                     cast: bool = False) -> Any:
    """What ``Float16OptimizerWithFloat16Params.sharded_state_dict`` returns, built with Megatron's helpers.
    ``round_masters``: the masters' values rounded to bf16 (kept fp32); ``cast``: masters and moments stored as
    bf16 (an exporter that cast the whole state)."""
    import torch
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        make_sharded_optimizer_tensor,
        optim_state_to_sharding_state,
    )

    id_map = get_param_id_to_sharded_param_map(model_sd, params)
    assert len(id_map) == len(params), "every optimized parameter has a sharded tensor"
    inner = opt.state_dict()
    inner["state"] = {k: dict(v) for k, v in inner["state"].items()}  # torch shares the live dicts: copy them
    steps = {float(s["step"]) for s in inner["state"].values()}
    assert len(steps) == 1
    for s in inner["state"].values():
        s.pop("step")
        if cast:
            s.update({k: v.to(torch.bfloat16) for k, v in s.items() if isinstance(v, torch.Tensor)})
    optim_state_to_sharding_state(inner, id_map)
    inner["state"]["common_step"] = int(steps.pop())
    fp32_from_fp16 = []
    for i, (p, m) in enumerate(zip(params, masters, strict=True)):
        if p is m:
            continue
        saved = m.detach().to(torch.bfloat16) if cast else m.detach().to(torch.bfloat16).float() if round_masters \
            else m.detach()
        fp32_from_fp16.append(make_sharded_optimizer_tensor(id_map[i], saved, prefix="optimizer.state.fp32_param"))
    return {"optimizer": inner, "fp32_from_fp16_params": [fp32_from_fp16]}


def write_megatron(ctx: Any, out: str, variants: list[str]) -> dict[str, Any]:
    """(2 ranks) Train once, then for each variant write ``out/<variant>/iter_0000002`` (and
    ``latest_checkpointed_iteration.txt`` beside it) and load it back with ``dist_checkpointing.load``. Returns what
    the audit is judged against."""
    import numpy as np
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from configurations import configuration

    _patch_cuda()
    model = _model(ctx)
    opt, params, masters, sched = _train(model)
    paths = {}
    try:
        for variant in variants:
            with configuration(variant):  # a variant's failure names it (its exception, its rank's stderr)
                model_sd = model.sharded_state_dict()  # fresh each time: the save rewrites what it is given
                saved = {k: v.data.clone() for k, v in model_sd.items() if isinstance(v, ShardedTensor)}
                state: dict[str, Any] = {
                    "args": argparse.Namespace(num_layers=2, hidden_size=16, bf16=True, lr=1e-3, save_interval=STEPS,
                                               ckpt_format="torch_dist", global_batch_size=8,
                                               consumed_train_samples=8 * STEPS),
                    "checkpoint_version": 3.0,
                    "iteration": STEPS,
                    "model": model_sd,
                    "rng_state": [ShardedObject("rng_state", [{"random_rng_state": random.getstate(),
                                                               "np_rng_state": np.random.get_state(),
                                                               "torch_rng_state": torch.get_rng_state()}],
                                                (1, ctx.world_size), (0, ctx.rank), replica_id=0)],
                    "num_floating_point_operations_so_far": 0,
                }
                if variant in ("full", "rounded-masters", "cast-to-bf16"):
                    state["optimizer"] = _optimizer_state(model_sd, opt, params, masters, variant == "rounded-masters",
                                                          cast=variant == "cast-to-bf16")
                elif variant.startswith("distributed-"):
                    sharding = variant.removeprefix("distributed-").replace("-", "_")
                    state["optimizer"] = _distributed_state(ctx, model_sd, opt, params, masters, sharding)
                if variant == "cast-to-bf16":  # the fp32 weights (norms) cast too: the whole state is bf16
                    for t in _sharded_tensors(model_sd):
                        if t.data.dtype == torch.float32:
                            t.data = t.data.to(torch.bfloat16)
                    saved = {k: v.data.clone() for k, v in model_sd.items() if isinstance(v, ShardedTensor)}
                if variant != "model-only":
                    state["opt_param_scheduler"] = sched.state_dict()
                root = os.path.join(out, variant)
                path = os.path.join(root, f"iter_{STEPS:07d}")
                if ctx.rank == 0:
                    os.makedirs(path, exist_ok=True)
                torch.distributed.barrier()
                dist_checkpointing.save(state, path)
                if ctx.rank == 0:
                    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
                        fh.write(str(STEPS))
                # Proof that the library reads what it wrote: a fresh model's tensors come back equal to the saved ones.
                loaded = dist_checkpointing.load(_model(ctx, init=False).sharded_state_dict(), path)
                back = {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
                assert back.keys() == saved.keys(), sorted(set(back) ^ set(saved))
                differ = [k for k, v in back.items() if not torch.equal(v.float(), saved[k].float())]
                assert not differ, f"dist_checkpointing.load does not give back the saved {differ}"
                paths[variant] = path
    finally:
        # Megatron's async writer leaves a spawned multiprocessing Manager behind: reap it, as every child must be.
        import multiprocessing

        for child in multiprocessing.active_children():
            child.terminate()
            child.join(10)
    model_sd = model.sharded_state_dict()
    names = sorted({t.key for t in _sharded_tensors(model_sd)})
    bf16 = sorted({t.key for t in _sharded_tensors(model_sd) if t.data.dtype == torch.bfloat16})
    return {"paths": paths, "params": names, "bf16_params": bf16, "step": STEPS}


def _sharded_tensors(sd: Any) -> list[Any]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return [v for v in nested_values(sd) if isinstance(v, ShardedTensor)]
