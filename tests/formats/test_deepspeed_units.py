"""The pure DeepSpeed readers on inputs shaped by hand as DeepSpeed 0.19.8 writes them (no engine, no fixture).

- ``formats.deepspeed.zero.zero12``: one ZeRO-1/2 param group as DeepSpeed lays it out with
  ``zero_optimization.parameter_alignment`` (every parameter but the last padded to a multiple of 16 bytes, so the
  padding sits between parameters), partitioned over 2 ranks. The layout is computed as
  ``deepspeed/runtime/zero/stage_1_and_2.py`` does it: the per-parameter padding (``param_alignment = 16 //
  gcd(16, element_size)``; ``padding = 0 if last else (-offset) % param_alignment``: lines 444 and 490-497), the
  flat buffer aligned to ``2 * world`` with zeros (``align_dense_tensors``, ``runtime/utils.py``), cut by
  ``get_data_parallel_partitions`` (the first ``numel % world`` ranks one element longer), each rank's saved masters
  without its share of the final alignment padding (``groups_padding``, lines 541-551, and
  ``_get_groups_without_padding``), its moments as the base optimizer holds them (the whole partition:
  ``state_dict[BASE_OPTIMIZER_STATE] = self.optimizer.state_dict()`` without ``elastic_checkpoint``), and
  ``param_alignment_paddings`` (line 3393). The masters must come out as the parameters went in, and as DeepSpeed's
  own ``zero_to_fp32._zero2_merge_trainable_params`` gives them from the same partitions.
- ``checks.lr_history.deepspeed_zero_lr_steps`` from a hand-written ``ds_config``, with the scheduler state and the
  saved lr that DeepSpeed's own ``WarmupLR`` (``deepspeed/runtime/lr_schedules.py``) produces for it step by step.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptaudit.checks.lr_history import deepspeed_zero_lr_steps
from ckptaudit.formats.deepspeed.zero import zero12
from ckptaudit.formats.io.tensors import DTYPES, FileMaps, Piece, TensorData, iter_chunks

SHAPES = [("body.0.weight", (13, 7)), ("body.0.bias", (13,)), ("body.1.weight", (13,)), ("body.1.bias", (13,)),
          ("body.2.weight", (4, 13)), ("body.2.bias", (4,))]
"""The DeepSpeed writer's tiny model (lib_writers._deepspeed_tiny): 91, 13, 13, 13, 52 and 4 elements."""
WORLD = 2


def _values(shapes: list[tuple[str, tuple[int, ...]]]) -> dict[str, np.ndarray]:
    return {name: (1000.0 * (i + 1) + np.arange(math.prod(shape), dtype=np.float32)).reshape(shape)
            for i, (name, shape) in enumerate(shapes)}


def zero2_layout(values: dict[str, np.ndarray], world: int, element_size: int
                 ) -> tuple[list[int], list[np.ndarray], list[np.ndarray]]:
    """(param_alignment_paddings of the group, each rank's saved masters, each rank's whole partition)."""
    param_alignment = 16 // math.gcd(16, element_size)
    chunks, paddings, offset = [], [], 0
    names = list(values)
    for i, name in enumerate(names):
        chunks.append(values[name].reshape(-1))
        offset += values[name].size
        padding = 0 if i == len(names) - 1 else (-offset) % param_alignment
        paddings.append(padding)
        chunks.append(np.zeros(padding, np.float32))
        offset += padding
    padded_group_numel = offset
    alignment = 2 * world
    if offset % alignment:
        chunks.append(np.zeros(alignment - offset % alignment, np.float32))
    flat = np.concatenate(chunks)
    base, remaining = divmod(flat.size, world)
    sizes = [base + (1 if r < remaining else 0) for r in range(world)]
    starts = [sum(sizes[:r]) for r in range(world)]
    partitions = [flat[s:s + n] for s, n in zip(starts, sizes, strict=True)]
    saved = []
    for r, part in enumerate(partitions):
        left = starts[r]
        if padded_group_numel <= left:
            padding = part.size
        elif padded_group_numel < left + part.size:
            padding = left + part.size - padded_group_numel
        else:
            padding = 0
        saved.append(part[:part.size - padding])
    return paddings, saved, partitions


def _tensor(path: Path, values: np.ndarray) -> TensorData:
    values.astype(np.float32).tofile(path)
    return TensorData(DTYPES["float32"], (values.size,), (Piece(str(path), 0, 0, (values.size,), (1,), (0,)),))


def _read(data: TensorData) -> np.ndarray:
    maps = FileMaps()
    try:
        return np.concatenate([c.copy() for c in iter_chunks(data, maps)]).reshape(data.shape)
    finally:
        maps.close()


def test_zero2_padding_between_parameters_is_skipped(tmp_path: Path) -> None:
    values = _values(SHAPES)
    paddings, saved, partitions = zero2_layout(values, WORLD, element_size=2)  # a bf16 model
    assert paddings == [5, 3, 3, 3, 4, 0]  # the case: padding after every middle parameter
    states = []
    for r in range(WORLD):
        states.append({
            "single_partition_of_fp32_groups": [_tensor(tmp_path / f"master{r}", saved[r])],
            "param_alignment_paddings": [paddings],
            "base_optimizer_state": {
                "state": {0: {"step": 2, "exp_avg": _tensor(tmp_path / f"m{r}", 2 * partitions[r]),
                              "exp_avg_sq": _tensor(tmp_path / f"v{r}", 3 * partitions[r])}},
                "param_groups": [{"params": [0], "lr": 1e-2, "weight_decay": 0.01}]},
        })
    tree: dict[str, Any] = {"fp32_masters": {}, "optimizer": None}
    zero12("", [SHAPES], states, tree)
    for name, want in values.items():
        assert np.array_equal(_read(tree["fp32_masters"][name]), want), name
        moments = tree["optimizer"]["state"][name]
        assert np.array_equal(_read(moments["exp_avg"]), 2 * want), name
        assert np.array_equal(_read(moments["exp_avg_sq"]), 3 * want), name
    assert tree["optimizer"]["param_groups"] == [{"lr": 1e-2, "weight_decay": 0.01, "params": [n for n, _ in SHAPES]}]

    # DeepSpeed's own converter reads the same partitions the same way.
    torch = pytest.importorskip("torch")
    zero_to_fp32 = pytest.importorskip("deepspeed.utils.zero_to_fp32")
    model_state = zero_to_fp32.zero_model_state(
        buffers={}, param_shapes=[OrderedDict((n, torch.Size(s)) for n, s in SHAPES)], shared_params=[],
        ds_version="0.19.8", frozen_param_shapes=None, frozen_param_fragments=None)
    theirs: dict[str, Any] = OrderedDict()
    zero_to_fp32._zero2_merge_trainable_params(theirs, WORLD, [[torch.from_numpy(s.copy())] for s in saved],
                                              [model_state], [paddings])
    assert {n: t.numpy().tolist() for n, t in theirs.items()} == {n: v.tolist() for n, v in values.items()}


def test_zero2_without_parameter_alignment_has_no_padding_between_parameters(tmp_path: Path) -> None:
    values = _values(SHAPES)
    paddings, saved, _ = zero2_layout(values, WORLD, element_size=16)  # param_alignment 1: DeepSpeed's default
    assert paddings == [0] * len(SHAPES)
    states = [{"single_partition_of_fp32_groups": [_tensor(tmp_path / f"master{r}", saved[r])],
               "param_alignment_paddings": [paddings]} for r in range(WORLD)]
    tree: dict[str, Any] = {"fp32_masters": {}, "optimizer": None}
    zero12("", [SHAPES], states, tree)
    assert all(np.array_equal(_read(tree["fp32_masters"][n]), v) for n, v in values.items())


# ---------------------------------------------------------------------------------------------------------------
# lr 0 from DeepSpeed's WarmupLR, from a hand-written ds_config


def _config(scheduler: dict[str, Any]) -> dict[str, Any]:
    """A ds_config as a user writes it (the DeepSpeed writer's, lib_writers._deepspeed_rank)."""
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
            "scheduler": scheduler, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}


def _record(config: dict[str, Any], steps: int) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """What the engine saves after ``steps`` optimizer steps under ``config``'s scheduler, made by DeepSpeed's own
    scheduler class on a torch optimizer: (lr_scheduler state, engine counters, optimizer param groups)."""
    torch = pytest.importorskip("torch")
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], **{
        k: v for k, v in config["optimizer"]["params"].items() if k != "torch_adam"})
    sched = getattr(lr_schedules, config["scheduler"]["type"])(opt, **config["scheduler"]["params"])
    for _ in range(steps):
        sched.step()  # the engine steps the scheduler once after each applied optimizer step
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return sched.state_dict(), {"global_steps": steps, "skipped_steps": 0}, groups


@pytest.mark.parametrize(("params", "steps", "all_at_lr_0"), [
    ({"warmup_max_lr": 1e-2, "warmup_num_steps": 10}, 1, True),  # log warmup from DeepSpeed's default min lr 0
    ({"warmup_max_lr": 1e-2, "warmup_num_steps": 10}, 2, True),  # lr at construction 0, at iteration 0: log(1) = 0
    ({"warmup_max_lr": 1e-2, "warmup_num_steps": 10}, 3, False),  # the third step applied lr(1) > 0
    ({"warmup_max_lr": 1e-2, "warmup_num_steps": 10, "warmup_type": "linear"}, 2, True),
    ({"warmup_max_lr": 1e-2, "warmup_num_steps": 10, "warmup_type": "linear"}, 3, False),
    ({"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 10}, 1, False),  # never 0
    ({"warmup_max_lr": 1e-2, "warmup_num_steps": 1}, 1, True),  # DeepSpeed raises 1 step to 2
])
def test_lr_0_steps_are_recognised_from_the_ds_config_as_deepspeed_schedules_them(
        params: dict[str, Any], steps: int, all_at_lr_0: bool) -> None:
    config = _config({"type": "WarmupLR", "params": params})
    sched, facts, groups = _record(config, steps)
    evidence = deepspeed_zero_lr_steps(config, sched, facts, groups)
    assert (evidence is not None) == all_at_lr_0, (sched, groups, evidence)
    if evidence is not None:
        assert f"every one of its {steps} optimizer step(s) applied learning rate 0 by DeepSpeed's WarmupLR" in evidence
        assert f"last_batch_iteration {steps - 1}; global_steps {steps}, skipped_steps 0" in evidence


def test_warmup_decay_lr_is_read_with_its_total_steps() -> None:
    config = _config({"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 10,
                                                           "total_num_steps": 100}})
    assert deepspeed_zero_lr_steps(config, *_record(config, 2)) is not None
    del config["scheduler"]["params"]["total_num_steps"]  # the formula cannot be recomputed: not decided
    assert deepspeed_zero_lr_steps(config, *_record({**config, "scheduler": {
        "type": "WarmupLR", "params": config["scheduler"]["params"]}}, 2)) is None


def test_a_record_that_disagrees_with_its_ds_config_is_not_believed() -> None:
    config = _config({"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 10}})
    sched, facts, groups = _record(config, 2)
    assert deepspeed_zero_lr_steps(config, sched, facts, groups) is not None
    refused = {
        "a client scheduler (none in ds_config)": ({k: v for k, v in config.items() if k != "scheduler"}, sched,
                                                   facts, groups),
        "a torch scheduler named": ({**config, "scheduler": {"type": "LambdaLR", "params": {}}}, sched, facts, groups),
        "an optimizer whose step is not scaled by lr": (
            {**config, "optimizer": {"type": "Adafactor", "params": {}}}, sched, facts, groups),
        # The scheduler's own record after 2 steps, lrs consistent with it, but the engine applied 1 step: it did
        # not step once per applied step (an overflow skips both the update and the scheduler step).
        "the scheduler stepped more than the engine": (config, sched, {"global_steps": 1, "skipped_steps": 0},
                                                       groups),
        "a skipped step the scheduler counted": (config, sched, {"global_steps": 2, "skipped_steps": 1}, groups),
        "a saved lr the schedule does not set": (config, sched, facts, [{**g, "lr": 1e-3} for g in groups]),
        "no saved lr": (config, sched, facts, [{k: v for k, v in g.items() if k != "lr"} for g in groups]),
        "a scheduler restarted mid-way": ({**config, "scheduler": {"type": "WarmupLR", "params": {
            **config["scheduler"]["params"], "last_batch_iteration": 5}}}, sched, facts, groups),
    }
    for why, args in refused.items():
        assert deepspeed_zero_lr_steps(*args) is None, why
