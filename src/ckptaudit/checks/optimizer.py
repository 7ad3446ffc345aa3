"""Optimizer attachment: is every piece of optimizer state attached to the parameter it was computed for?

FQN-keyed state (``get_optimizer_state_dict``, DCP, torchtitan) is checked by name: every state entry names a
model parameter, every moment has its parameter's shape, the step counters agree.

Index-keyed state (``optimizer.state_dict()``, as Hugging Face Trainer's ``optimizer.pt``, Accelerate's
``optimizer.bin`` and Lightning's ``optimizer_states`` are) carries no names. Groups that saved
``param_names`` are mapped by those. Otherwise the integers are mapped by the one thing real optimizers
guarantee: each param group is an *order-preserving subsequence* of ``named_parameters()`` (Trainer builds a
weight-decay group, then a no-decay group of biases and norms). :func:`assign_by_order` counts the
order-consistent assignments of the groups to the model's parameters that fit every shape: none is a shape
mismatch, exactly one verifies the attachment, several mean it cannot be verified offline.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptaudit.catalogue import finding
from ckptaudit.formats.tensors import TensorData
from ckptaudit.layouts import OptimizerView, TensorRef, View, normalize_fqn
from ckptaudit.model import Finding, Severity

__all__ = ["ELEMENTWISE_STATE", "Attachment", "assign_by_order", "check_attachment", "check_steps", "group_params"]

ELEMENTWISE_STATE = frozenset(
    "exp_avg exp_avg_sq max_exp_avg_sq momentum_buffer square_avg acc_delta sum ax prev exp_inf grad_avg "
    "momentum exp_avg_diff".split()
)
"""State names that always have their parameter's shape (torch.optim's optimizers)."""

MAX_DP_STATES = 50_000


@dataclass
class Attachment:
    mapping: dict[Any, str] = field(default_factory=dict)
    """State key -> model FQN, where it is known (by name, or by the unique order-consistent assignment)."""
    status: str = "none"
    """``by-name``, ``by-param-names``, ``unique-order``, ``ambiguous``, ``unknown-order``, ``mismatch``,
    ``none``."""
    findings: list[Finding] = field(default_factory=list)


def _shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, TensorRef) and isinstance(value.data, TensorData):
        return value.data.shape
    return None


def moment_shape(entry: dict[str, Any]) -> tuple[int, ...] | None:
    """The parameter shape an optimizer state entry implies (from its element-wise moments)."""
    fallback = None
    for name, value in entry.items():
        shp = _shape(value)
        if shp is None:
            continue
        if name in ELEMENTWISE_STATE:
            return shp
        if fallback is None and len(shp) >= 1 and name != "step":
            fallback = shp
    return fallback


def check_attachment(view: View) -> Attachment:
    opt, model = view.optimizer, view.model
    if opt is None or model is None:
        return Attachment()
    if opt.keyed == "fqn":
        return _by_names(opt, model.params, {k: k for k in opt.state}, "by-name", opt.where)
    result = Attachment()
    result.findings.append(
        finding(
            "optimizer.index-keyed",
            opt.where,
            f"{opt.where}: optimizer state is keyed by integers, so which parameter each entry belongs to "
            "depends on parameter order (pytorch/pytorch#1489); save it FQN-keyed with "
            "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict",
        )
    )
    names = _param_names(opt)
    if names is not None:
        sub = _by_names(opt, model.params, names, "by-param-names", opt.where)
        sub.findings[:0] = result.findings
        return sub
    grouped: list[list[Any]] = [group_params(g) for g in opt.groups]
    in_groups = {k for g in grouped for k in g}
    stray = [k for k in opt.state if k not in in_groups] if grouped else []
    for k in stray:
        result.findings.append(
            finding("optimizer.unmatched", f"{opt.where}/state/{k}",
                    f"optimizer state entry {k} belongs to no param group", key=str(k))
        )
    if not grouped:
        grouped = [list(opt.state)]
    expected = [[moment_shape(opt.state[k]) if k in opt.state else None for k in g] for g in grouped]
    candidates = [(fqn, ref.data.shape) for fqn, ref in model.params.items()
                  if isinstance(ref.data, TensorData) and ref.data.dtype.is_float]
    n_entries = sum(len(g) for g in grouped)
    if not model.order_known:
        have = Counter(shape for _, shape in candidates)
        need = Counter(s for g in expected for s in g if s is not None)
        missing = {s: c - have.get(s, 0) for s, c in need.items() if c > have.get(s, 0)}
        if missing or n_entries > len(candidates):
            result.status = "mismatch"
            result.findings.append(_mismatch(opt, n_entries, len(candidates), expected, candidates, missing))
        else:
            result.status = "unknown-order"
            result.findings.append(
                finding(
                    "optimizer.attachment-unverified",
                    opt.where,
                    f"{opt.where}: the model file does not keep parameter order (safetensors sorts names), so "
                    f"the {n_entries} index-keyed entries can only be checked as a multiset: every moment "
                    "shape exists in the model, but which parameter each belongs to cannot be verified offline",
                )
            )
        return result
    count, solution = assign_by_order([s for _, s in candidates], expected)
    if count == 0:
        result.status = "mismatch"
        result.findings.append(_mismatch(opt, n_entries, len(candidates), expected, candidates, {}))
    elif count == 1 and solution is not None:
        result.status = "unique-order"
        for g, keys in enumerate(grouped):
            for j, key in enumerate(keys):
                result.mapping[key] = candidates[solution[g][j]][0]
    else:
        result.status = "ambiguous"
        result.findings.append(
            finding(
                "optimizer.attachment-unverified",
                opt.where,
                f"{opt.where}: the {n_entries} index-keyed entries fit the model's parameter shapes in more than "
                "one order-consistent way (parameters of equal shape); the attachment cannot be verified "
                "offline. Compare against a reference (ckptaudit compare) or save FQN-keyed state.",
            )
        )
    return result


def _mismatch(opt: OptimizerView, n_entries: int, n_params: int, expected: list[list[Any]],
              candidates: list[tuple[str, tuple[int, ...]]], missing: dict[Any, int]) -> Finding:
    # Evidence: the first disagreement when the entries are read in plain parameter order.
    flat = [s for g in expected for s in g]
    first = next(
        ((i, s, candidates[i]) for i, s in enumerate(flat) if i < len(candidates) and s is not None
         and s != candidates[i][1]), None)
    detail = ""
    if first is not None:
        i, s, (fqn, shp) = first
        detail = f" (in plain order, entry {i} has shape {list(s)} but parameter {fqn} has {list(shp)})"
    if missing:
        detail = f" (moment shapes with no parameter: {', '.join(str(list(s)) for s in missing)})"
    return finding(
        "optimizer.shape-mismatch",
        opt.where,
        f"{opt.where}: no order-consistent assignment of the {n_entries} index-keyed entries "
        f"({len(expected)} group(s)) to the model's {n_params} float parameters fits their shapes{detail}: "
        "this optimizer state belongs to another model or another parameter order",
        entries=n_entries,
        parameters=n_params,
    )


def group_params(group: dict[str, Any]) -> list[Any]:
    """A param group's ``params`` list; ``[]`` when it is absent or could not be read (its file is lost)."""
    params = group.get("params")
    return list(params) if isinstance(params, list) else []


def _param_names(opt: OptimizerView) -> dict[Any, str] | None:
    names: dict[Any, str] = {}
    for g in opt.groups:
        pn, ps = g.get("param_names"), g.get("params")
        if not isinstance(pn, list) or not isinstance(ps, list) or len(pn) != len(ps):
            return None
        names.update(zip(ps, (str(n) for n in pn), strict=True))
    return names or None


def _by_names(opt: OptimizerView, params: dict[str, TensorRef], names: dict[Any, str], status: str,
              where: str) -> Attachment:
    result = Attachment(status=status)
    by_norm = {normalize_fqn(f): f for f in params}
    for key, entry in opt.state.items():
        name = names.get(key)
        fqn = None if name is None else (name if name in params else by_norm.get(normalize_fqn(name)))
        if fqn is None:
            result.findings.append(
                finding(
                    "optimizer.unmatched",
                    f"{where}/state/{name if name is not None else key}",
                    f"optimizer state for {name if name is not None else key!r} matches no model parameter: it "
                    "belongs to another model, or the model was renamed",
                    key=str(name if name is not None else key),
                )
            )
            continue
        result.mapping[key] = fqn
        pdata = params[fqn].data
        pshape = pdata.shape if isinstance(pdata, TensorData) else None
        if pshape is None:
            continue
        for sname, value in entry.items():
            shp = _shape(value)
            if shp is None:
                continue
            elementwise = sname in ELEMENTWISE_STATE or (
                len(shp) >= 1 and sname != "step" and math.prod(shp) == math.prod(pshape)
            )
            if elementwise and shp != pshape:
                result.findings.append(
                    finding(
                        "optimizer.shape-mismatch",
                        value.name,
                        f"{value.name} has shape {list(shp)}, its parameter {fqn} has {list(pshape)}",
                        state=sname,
                        param=fqn,
                        state_shape=list(shp),
                        param_shape=list(pshape),
                    )
                )
    listed = [p for g in opt.groups for p in group_params(g)]
    for key in listed:
        name = names.get(key, key if isinstance(key, str) else None)
        if name is None:
            continue
        fqn = name if name in params else by_norm.get(normalize_fqn(name))
        if fqn is None:
            if key not in opt.state:
                result.findings.append(
                    finding("optimizer.unmatched", f"{where}/param_groups/{name}",
                            f"param group lists {name!r}, which the model does not have", key=str(name))
                )
        elif key not in opt.state:
            result.findings.append(
                finding(
                    "optimizer.unmatched",
                    params[fqn].name,
                    f"parameter {fqn} is in a param group but has no optimizer state (frozen, never got a "
                    "gradient, or the state was lost): resuming restarts its moments from zero",
                    severity=Severity.WARNING,
                    param=fqn,
                )
            )
    return result


def check_steps(opt: OptimizerView | None, steps: dict[Any, float]) -> list[Finding]:
    """``steps``: state key -> that entry's ``step`` value. Counters that disagree are a finding."""
    if opt is None or len(set(steps.values())) <= 1:
        return []
    values = Counter(steps.values())
    common, _ = values.most_common(1)[0]
    odd = [str(k) for k, v in steps.items() if v != common]
    return [
        finding(
            "optimizer.step-mismatch",
            opt.where,
            f"{opt.where}: per-parameter step counters disagree (most are {common:g}; {len(odd)} differ, e.g. "
            f"{', '.join(odd[:5])}): bias correction will differ between parameters after resuming",
            counts={f"{k:g}": c for k, c in values.items()},
        )
    ]


def assign_by_order(
    params: Sequence[tuple[int, ...]], groups: Sequence[Sequence[tuple[int, ...] | None]]
) -> tuple[int, list[list[int]] | None]:
    """Count order-consistent assignments of ``groups`` to ``params`` (saturating at 2).

    Each group is a sequence of expected shapes (``None`` matches any parameter: an entry with no state). An
    assignment gives every group entry a distinct parameter, preserving order within each group, with the
    shapes equal; parameters may be left out (buffers, frozen parameters) when there are more parameters than
    entries. Returns the count (0, 1 or 2 meaning "two or more") and, when exactly one, the parameter index
    of every entry. When the search space exceeds :data:`MAX_DP_STATES` the count is 2 (cannot verify).
    """
    k = len(groups)
    sizes = tuple(len(g) for g in groups)
    total = sum(sizes)
    slack = len(params) - total
    if slack < 0:
        return 0, None
    start = (0,) * k
    # layer[i] maps a state (entries consumed per group) to (count, predecessor state, group or -1).
    layers: list[dict[tuple[int, ...], tuple[int, tuple[int, ...] | None, int]]] = [{start: (1, None, -1)}]
    for i, shape in enumerate(params):
        nxt: dict[tuple[int, ...], tuple[int, tuple[int, ...] | None, int]] = {}
        for state, (count, _, _) in layers[-1].items():
            used = sum(state)
            if i - used < slack:  # leave parameter i out
                _add(nxt, state, count, state, -1)
            for g in range(k):
                j = state[g]
                if j < sizes[g]:
                    want = groups[g][j]
                    if want is None or want == shape:
                        new = (*state[:g], j + 1, *state[g + 1:])
                        _add(nxt, new, count, state, g)
        if len(nxt) > MAX_DP_STATES:
            return 2, None
        layers.append(nxt)
    final = layers[-1].get(sizes)
    if final is None:
        return 0, None
    count = final[0]
    if count != 1:
        return 2, None
    solution: list[list[int]] = [[0] * s for s in sizes]
    state = sizes
    for i in range(len(params), 0, -1):
        _, prev, g = layers[i][state]
        if g >= 0:
            solution[g][state[g] - 1] = i - 1
        assert prev is not None
        state = prev
    return 1, solution


def _add(layer: dict[tuple[int, ...], tuple[int, tuple[int, ...] | None, int]], state: tuple[int, ...],
         count: int, prev: tuple[int, ...], g: int) -> None:
    old = layer.get(state)
    if old is None:
        layer[state] = (min(count, 2), prev, g)
    else:
        layer[state] = (min(old[0] + count, 2), old[1], old[2])
