"""What a checkpoint's own record says about the learning rates its optimizer steps applied.

A step taken at learning rate 0 moves no weight (every update rule a scheduler drives here, Adam/AdamW with
decoupled weight decay, Lion, Adagrad, LAMB, is scaled by the lr), although it fills the moments. So a
checkpoint whose every step so far applied lr 0 still holds the initial weights as its masters, however many
steps its counters show: DeepSpeed's ``WarmupLR`` starts at its default ``warmup_min_lr`` 0, and its first two
steps apply lr 0 (the lr set at construction, then the lr at iteration 0, where the warmup factor is 0).

What can be known, and from what (pure: plain data in, words out):

- **DeepSpeed** ``WarmupLR`` / ``WarmupDecayLR`` built from the engine's config: the checkpoint keeps the config
  (``ds_config``: the scheduler's type and parameters, defaults as in DeepSpeed 0.19.8's
  ``deepspeed/runtime/lr_schedules.py``), the scheduler's state (``last_batch_iteration``), the engine's counters
  (``global_steps``, ``skipped_steps``: an overflow skips the update and the scheduler step) and the optimizer's
  saved ``lr`` per param group (the lr the schedule set for the *next* step). The lrs applied are recomputed
  by the schedule's own formula and believed only when the record agrees with itself: the scheduler stepped once
  per applied step, and the saved lrs equal what the formula gives at ``last_batch_iteration``. A scheduler the
  user passed to ``deepspeed.initialize`` instead of the config, or a config missing a value the formula needs,
  fails these checks: not decided.
- **torch** ``LRScheduler`` s (``LambdaLR``, ``LinearLR``, ...): not decided for the whole run. Their state keeps
  ``last_epoch``, ``base_lrs`` and the *last* lr only, never the lrs already applied, and ``LambdaLR`` saves no
  lambda; a step-0 state is judged by the moments instead (:func:`ckptaudit.checks.updates.before_first_update`).
- **One param group at lr 0 throughout** (:func:`zero_lr_groups`): a fine-tune that keeps some layers by
  learning rate 0. Every lr a torch scheduler can set is its ``base_lr`` times a factor, so a group whose every
  recorded lr is 0 (the group's ``lr``, ``initial_lr`` and ``max_lr``, the scheduler's ``base_lrs``,
  ``_last_lr`` and ``max_lrs`` at its index) was never updated, whatever the step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ckptaudit.findings import safe_str

__all__ = ["deepspeed_zero_lr_steps", "zero_lr_groups"]

_SCHEDULES = ("WarmupLR", "WarmupDecayLR")
"""DeepSpeed schedules whose formula is reproduced here (the warmup phase is the same; ``WarmupDecayLR`` then
decays linearly)."""

_LR_SCALED = frozenset({"adam", "adamw", "lion", "adagrad", "lamb"})
"""DeepSpeed optimizer types (``ds_config["optimizer"]["type"]``, case-insensitive) whose update is scaled by
the lr (weight decay included): at lr 0 they move nothing."""


_MAX_ITERATIONS = 100_000
_MAX_COUNT = 1 << 62
"""Counts and step numbers past this are not a real run's (a float holds them exactly enough, and no formula
below can overflow): the schedule is not decided."""
_MAX_LR = 1e30

_GROUP_LRS = ("lr", "initial_lr", "max_lr")
"""A param group's own learning-rate records (``initial_lr``: set by a torch scheduler at its construction;
``max_lr``: ``OneCycleLR``'s)."""
_SCHEDULER_LRS = ("base_lrs", "_last_lr", "max_lrs")
"""A torch scheduler's per-group learning-rate records (``max_lrs``: ``CyclicLR``'s)."""


def zero_lr_groups(groups: Sequence[Mapping[str, Any]], schedulers: Sequence[Any]) -> dict[int, str]:
    """The param groups whose every recorded learning rate is 0, by index, with that record in words; a group
    with no ``lr``, or any other value (a tensor lr, ``None``, a number above 0), is not one. ``schedulers``: the
    checkpoint's scheduler states (their per-group lists are read where they have one entry per group); a
    scheduler that keeps none leaves every group undecided."""
    lists: list[tuple[str, list[Any]]] = []
    todo = list(schedulers)
    while todo:  # nested schedulers (SequentialLR, ChainedScheduler) keep theirs inside
        tree = todo.pop()
        if isinstance(tree, dict):
            for key, value in tree.items():
                if key in _SCHEDULER_LRS and isinstance(value, list) and len(value) == len(groups):
                    lists.append((safe_str(key), value))
                elif isinstance(value, dict | list):
                    todo.append(value)
        elif isinstance(tree, list):
            todo.extend(v for v in tree if isinstance(v, dict | list))
    if not lists and any(tree not in (None, {}, []) for tree in schedulers):
        # A scheduler that keeps no per-group lr (DeepSpeed's WarmupLR: an iteration count) sets lrs the record
        # does not show: a group's lr of 0 now says nothing about the steps before (nor after).
        return {}
    out: dict[int, str] = {}
    for i, g in enumerate(groups):
        if "lr" not in g:
            continue
        said = [(k, g[k]) for k in _GROUP_LRS if k in g] + [(f"scheduler {k}[{i}]", v[i]) for k, v in lists]
        if all(_number(v) == 0.0 for _, v in said):
            out[i] = f"param group {i}: " + ", ".join(f"{k} 0" for k, _ in said)
    return out


def _number(value: Any) -> float | None:
    """A finite learning rate, or ``None``: the values come from the checkpoint's pickle, so an int too large
    for a float (``10**400``) or an absurd magnitude is refused before any arithmetic, not raised."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, int):
        return float(value) if -_MAX_COUNT <= value <= _MAX_COUNT else None
    return value if math.isfinite(value) and abs(value) <= _MAX_LR else None


def _int(value: Any) -> int | None:
    """An int within :data:`_MAX_COUNT` of 0, or ``None`` (bools, floats and absurd magnitudes refused)."""
    if isinstance(value, int) and not isinstance(value, bool) and -_MAX_COUNT <= value <= _MAX_COUNT:
        return value
    return None


def _per_group(value: Any, groups: int) -> list[float] | None:
    """DeepSpeed's ``_format_param``: a number for every group, or a list of one per group."""
    if isinstance(value, list | tuple):
        nums = [_number(v) for v in value]
        return [v for v in nums if v is not None] if len(value) == groups and None not in nums else None
    num = _number(value)
    return None if num is None else [num] * groups


def _gamma(kind: str, it: int, steps: int, decay_total: int | None) -> float:
    """``WarmupLR._get_gamma`` / ``WarmupDecayLR._get_gamma`` at ``last_batch_iteration`` ``it`` (>= 0)."""
    if it < steps:
        if kind == "linear":
            return it / steps
        return (1.0 / math.log(steps)) * math.log(it + 1)
    if decay_total is None:
        return 1.0
    return max(0.0, float(decay_total - it) / float(max(1.0, decay_total - steps)))


def deepspeed_zero_lr_steps(config: Any, scheduler_state: Any, facts: Mapping[str, Any],
                            groups: Sequence[Mapping[str, Any]]) -> str | None:
    """The evidence, in words, that every optimizer step of this DeepSpeed checkpoint applied lr 0 (so the masters
    are still the initial weights); ``None`` when the record does not show it or does not agree with itself.

    ``config``: the saved ``ds_config``; ``scheduler_state``: the saved ``lr_scheduler``; ``facts``: the engine's
    ``global_steps`` and ``skipped_steps``; ``groups``: the optimizer's saved param groups (their ``lr``).
    """
    if not isinstance(config, Mapping) or not groups:
        return None
    sched, opt = config.get("scheduler"), config.get("optimizer")
    if not isinstance(sched, Mapping) or sched.get("type") not in _SCHEDULES:
        return None
    if not isinstance(opt, Mapping) or str(opt.get("type", "")).lower() not in _LR_SCALED:
        return None
    params = sched.get("params", {})
    opt_params = opt.get("params", {})
    if not isinstance(params, Mapping) or not isinstance(opt_params, Mapping):
        return None
    n = len(groups)
    mins = _per_group(params.get("warmup_min_lr", 0.0), n)
    raw_max = params.get("warmup_max_lr")
    # warmup_max_lr None: each group's lr at construction, i.e. the optimizer's configured lr.
    maxes = _per_group(opt_params.get("lr") if raw_max is None else raw_max, n)
    num_steps = _int(params.get("warmup_num_steps", 1000))
    start = _int(params.get("last_batch_iteration", -1))
    kind = "linear" if params.get("warmup_type", "log") == "linear" else "log"
    decay_total = _int(params.get("total_num_steps")) if sched["type"] == "WarmupDecayLR" else None
    if mins is None or maxes is None or num_steps is None or num_steps <= 0 or start != -1:
        return None  # start != -1: the constructor then leaves the optimizer's own lr for the first step
    if sched["type"] == "WarmupDecayLR" and decay_total is None:
        return None
    steps = max(2, num_steps)
    state = scheduler_state if isinstance(scheduler_state, Mapping) else {}
    last = _int(state.get("last_batch_iteration"))
    taken, skipped = _int(facts.get("global_steps")), _int(facts.get("skipped_steps", 0))
    if last is None or taken is None or skipped is None or taken < 1 or not 0 <= skipped <= taken:
        return None
    applied = taken - skipped
    if last > _MAX_ITERATIONS:
        return None  # each applied lr is recomputed: past this, not decided (lr 0 this long is not a warmup)
    if last != start + applied:
        return None  # the scheduler did not step once per applied step: its record is not the one that ran

    def lr(group: int, it: int) -> float:
        if it < 0:  # set at construction: get_lr() before the first step returns the minimum
            return mins[group]
        return mins[group] + (maxes[group] - mins[group]) * _gamma(kind, it, steps, decay_total)

    for g, group in enumerate(groups):
        saved = _number(group.get("lr"))
        if saved is None or not math.isclose(saved, lr(g, last), rel_tol=1e-9, abs_tol=0.0):
            return None  # the optimizer's saved lr is not what this schedule sets: another scheduler ran
        # Applied step i (1-based) used the lr set after i - 1 scheduler steps: iterations -1 .. last - 1.
        if any(lr(g, it) != 0.0 for it in range(-1, last)):
            return None
    where = f"warmup_min_lr {_fmt(mins)}, {kind} warmup over {steps} steps"
    return (f"every one of its {applied} optimizer step(s) applied learning rate 0 by DeepSpeed's {sched['type']} "
            f"as its ds_config sets it: {where}; lr_scheduler last_batch_iteration {last}; global_steps {taken}, "
            f"skipped_steps {skipped}; the optimizer's saved lr {_fmt([_number(g.get('lr')) for g in groups])} "
            "matches the schedule; so no step changed the weights")


def _fmt(values: Sequence[float | None]) -> str:
    uniq = sorted({f"{v:g}" for v in values if v is not None})
    return " / ".join(uniq)
