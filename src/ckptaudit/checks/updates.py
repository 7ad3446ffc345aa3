"""Whether any optimizer update reached the weights: a save before the first update, param groups at learning
rate 0 throughout, and parameters the index-keyed optimizer state may leave frozen. The precision check
(:func:`ckptaudit.checks.precision.check_precision`) takes these as its evidence that a parameter below the master
precision is what the user did (a start from a low-precision file, a frozen layer), not a defect.

Over the interpreted view, the scan's records and step counters; :func:`before_first_update` alone reads tensor
data: the optimizer moments that could all be zero, one pass stopping at the first non-zero byte.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ckptaudit.checks.lr_history import deepspeed_zero_lr_steps, zero_lr_groups
from ckptaudit.checks.optimizer import may_all_be_unattached, never_updated
from ckptaudit.findings import ComponentKind, Precision, TensorRecord, safe_str
from ckptaudit.formats.base import Checkpoint, walk
from ckptaudit.formats.io import tensors
from ckptaudit.formats.io.tensors import TensorData
from ckptaudit.layouts import SCHEDULER_KEYS, View, file_rule
from ckptaudit.layouts.attachment import ELEMENTWISE_STATE, Attachment
from ckptaudit.layouts.view import TensorRef

__all__ = ["FROZEN_WHY", "NOT_JUDGED_WHY", "all_zero", "before_first_update", "below_master", "maybe_frozen",
           "never_updated_params", "scheduler_steps", "scheduler_trees"]


def before_first_update(view: View, ckpt: Checkpoint, records: Sequence[TensorRecord], refs: Sequence[TensorRef],
                        steps: Mapping[Any, float]) -> str | None:
    """The evidence, in words, that no optimizer update was applied before this save; ``None`` when the
    checkpoint's own state does not show it. ``refs[i]`` is the lazy tensor behind ``records[i]``; ``steps`` the
    optimizer's step counters the scan read.

    Shown by: an optimizer whose state is empty (one that keeps state from its first step: Adam's betas, or a
    momentum), or whose every moment is exactly zero with step counters 0 or 1 (``get_state_dict`` fills a fresh
    optimizer's state by its own zero-lr step: step 1, zero moments); and no train step or scheduler step above 0.
    Reads the moments that could be zero (one pass, stopping at the first non-zero byte). Also shown, after
    steps, by a record of the learning rates applied that says every one was 0 (DeepSpeed's WarmupLR from its
    default ``warmup_min_lr`` 0: :mod:`ckptaudit.checks.lr_history`).
    """
    opt = view.optimizer
    if opt is not None and view.layout == "deepspeed":
        zero_lr = _deepspeed_zero_lr(ckpt, opt.groups)
        if zero_lr is not None:
            return zero_lr
    if opt is None or (view.step is not None and view.step != 0):
        return None
    epochs = scheduler_steps(ckpt)
    if any(e > 0 for e in epochs):
        return None
    said = [f"train step {view.step}"] if view.step is not None else []
    said += ["scheduler step 0"] if epochs else []
    if not opt.state:
        stateful = any("betas" in g or (isinstance(g.get("momentum"), int | float) and g["momentum"] > 0)
                       for g in opt.groups)
        if not stateful and not said:
            return None  # plain SGD keeps no state even after many steps
        return "; ".join(["the optimizer holds no state", *said])
    if any(v not in (0.0, 1.0) for v in steps.values()):
        return None
    moments = [(r, ref) for r, ref in zip(records, refs, strict=True)
               if r.component == ComponentKind.OPTIMIZER.value and r.role in ELEMENTWISE_STATE]
    if not moments:
        return None
    # Zero moments are 16-bit-representable with no informative value: rule out every other tensor before reading.
    if any(r.precision not in (Precision.INCONCLUSIVE, Precision.NATIVE_16) or not isinstance(ref.data, TensorData)
           for r, ref in moments):
        return None
    if not all(isinstance(ref.data, TensorData) and all_zero(ref.data, ckpt.maps) for _, ref in moments):
        return None
    counters = sorted({f"{v:g}" for v in steps.values()})
    return "; ".join([f"all {len(moments)} optimizer moments are exactly zero"
                      + (f", step counters {' and '.join(counters)}" if counters else ""), *said])


def _deepspeed_zero_lr(ckpt: Checkpoint, groups: Any) -> str | None:
    trees = [p.tree for p in ckpt.parts if isinstance(p.tree, dict) and isinstance(p.tree.get("deepspeed"), dict)]
    if len(trees) != 1:
        return None
    facts = trees[0]["deepspeed"]
    return deepspeed_zero_lr_steps(facts.get("ds_config"), trees[0].get("lr_scheduler"), facts, groups)


def all_zero(data: TensorData, maps: tensors.FileMaps) -> bool:
    """Whether every byte of ``data`` is zero; ``False`` when it cannot be read. Small tensors are read without
    NumPy (:func:`~ckptaudit.formats.io.tensors.small_read_plan`)."""
    try:
        plan = tensors.small_read_plan(data, tensors.SMALL_TENSOR_BYTES)
        if plan is not None:  # without NumPy
            return not any(any(tensors.read_exact(maps, p, pos, p.numel * data.dtype.itemsize)) for p, pos in plan)
        import numpy as np

        return not any(np.ascontiguousarray(chunk).view(np.uint8).any() for chunk in tensors.iter_chunks(data, maps))
    except (ValueError, OSError):
        return False


def scheduler_trees(ckpt: Checkpoint) -> list[Any]:
    """Every learning-rate scheduler state the checkpoint holds, wherever its layout keeps schedulers
    (``scheduler*.pt`` files, ``scheduler``/``lr_scheduler(s)`` keys)."""
    trees: list[Any] = []
    for part in ckpt.parts:
        if part.name and file_rule(part.name) is ComponentKind.SCHEDULER:
            trees.append(part.tree)
        elif isinstance(part.tree, dict):
            trees += [v for k, v in part.tree.items() if safe_str(k) in SCHEDULER_KEYS]
    return trees


def scheduler_steps(ckpt: Checkpoint) -> list[int]:
    """Every learning-rate scheduler's ``last_epoch`` (steps taken; 0 right after construction) the checkpoint
    holds (:func:`scheduler_trees`)."""
    trees = scheduler_trees(ckpt)
    return [leaf for tree in trees for path, leaf in walk(tree)
            if path and path[-1] == "last_epoch" and isinstance(leaf, int) and not isinstance(leaf, bool)]


FROZEN_WHY = {
    "by-name": "no optimizer state entry names it",
    "by-param-names": "no optimizer state entry names it",
    "unique-order": "no order-consistent assignment of the index-keyed optimizer state gives it an entry",
    "ambiguous": "no order-consistent assignment of the index-keyed optimizer state gives it an entry",
    "unknown-order": "no entry of the index-keyed optimizer state has its shape",
}
"""How :func:`~ckptaudit.layouts.attachment.attach` decided, by its status, that a model tensor carries no
optimizer state."""


NOT_JUDGED_WHY = {
    "ambiguous": "an order-consistent assignment of the index-keyed state that fits every entry leaves all such "
                 "parameters out",
    "unknown-order": "the model file keeps no parameter order, and the index-keyed state's shapes fit the other "
                     "parameters",
}


def below_master(params: Sequence[TensorRecord]) -> set[str]:
    """The parameters stored or rounded below a wide master dtype."""
    return {r.param for r in params if r.param is not None
            and (r.dtype in ("bfloat16", "float16") or (r.dtype == "float32"
                                                        and r.precision in (Precision.BF16, Precision.FP16)))}


def maybe_frozen(view: View, attachment: Attachment, params: Sequence[TensorRecord], master: str) -> set[str]:
    """The parameters below a wide master dtype when index-keyed optimizer state may give none of them an entry
    (every one could be frozen); empty when the state decides (a unique attachment, names) or some must be
    trainable."""
    if master not in ("float32", "float64") or attachment.status not in NOT_JUDGED_WHY:
        return set()
    below = below_master(params)
    return below if may_all_be_unattached(view, below) else set()


def never_updated_params(view: View, ckpt: Checkpoint, attachment: Attachment, params: Sequence[TensorRecord],
                         master: str) -> dict[str, str]:
    """The parameters below a wide master dtype that a param group at learning rate 0 throughout holds (every lr
    its record keeps is 0: :func:`~ckptaudit.checks.lr_history.zero_lr_groups`), with that evidence."""
    opt = view.optimizer
    if master not in ("float32", "float64") or opt is None or not opt.groups:
        return {}
    below = below_master(params)
    if not below:
        return {}
    zero = zero_lr_groups(opt.groups, scheduler_trees(ckpt))
    return never_updated(view, attachment, zero, below) if zero else {}
