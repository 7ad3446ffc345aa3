"""Optimizer attachment: which parameter each piece of optimizer state was computed for, and whether that can be
told.

FQN-keyed state (``get_optimizer_state_dict``, DCP, torchtitan) is checked by name: every state entry names a
model parameter, every moment has its parameter's shape, the step counters agree.

Index-keyed state (``optimizer.state_dict()``, as Hugging Face Trainer's ``optimizer.pt``, Accelerate's
``optimizer.bin`` and Lightning's ``optimizer_states`` are) carries no names. Groups that saved
``param_names`` are mapped by those. Otherwise the integers are mapped by the one thing real optimizers
guarantee: each param group is an *order-preserving subsequence* of ``named_parameters()`` (Trainer builds a
weight-decay group, then a no-decay group of biases and norms, so reading its ``optimizer.pt`` in plain
parameter order puts the wrong shape on most entries of a checkpoint that resumes fine).
:func:`assign_by_order` counts the order-consistent assignments of the groups to the model's parameters that
fit every shape: none is a shape mismatch, exactly one verifies the attachment, several mean it cannot be
verified offline (and say which entries are still pinned to one parameter).

The model's parameter order is known for ``torch.save`` state dicts (``pytorch_model.bin``, Lightning's
``state_dict``): its key order is ``named_parameters()`` order with buffers and tied aliases interleaved, which
the assignment may skip. Safetensors files do not keep it (their tensors are sorted), so index-keyed state next
to ``model.safetensors`` can only be checked as a multiset of shapes.

Part of the interpretation (the scan plan gives every moment its parameter from it; the checks judge with it):
pure functions over the interpreted view, in one process, reading no tensor data. The attachment's own findings
(a shape mismatch, index-keyed state) travel in :attr:`Attachment.findings`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptaudit.catalogue import finding
from ckptaudit.findings import Finding, Severity, safe_str
from ckptaudit.formats.io.tensors import TensorData
from ckptaudit.layouts.view import ModelView, OptimizerView, TensorRef, View, normalize_fqn

__all__ = [
    "ELEMENTWISE_STATE",
    "KNOWN_BUFFERS",
    "Attachment",
    "OrderFit",
    "assign_by_order",
    "attach",
    "attachable",
    "moment_shape",
    "saved_param_names",
]

ELEMENTWISE_STATE = frozenset(
    "exp_avg exp_avg_sq max_exp_avg_sq momentum_buffer square_avg acc_delta sum ax prev exp_inf grad_avg "
    "momentum exp_avg_diff variance".split()
)
"""State names that always have their parameter's shape (torch.optim's optimizers)."""

_FACTORED_STATE = (("exp_avg_sq_row", "exp_avg_sq_col", False), ("row_var", "col_var", True))
"""Adafactor's factored second moments: (row name, column name, whether the reduced dim is kept as 1).
Hugging Face's ``exp_avg_sq_row`` has shape ``p[:-1]`` and ``exp_avg_sq_col`` ``p[:-2] + p[-1:]``;
torch.optim's ``row_var`` has ``p[:-1] + (1,)`` and ``col_var`` ``p[:-2] + (1,) + p[-1:]``."""

KNOWN_BUFFERS = frozenset({"running_mean", "running_var", "num_batches_tracked"})
"""Leaf names torch's own modules (BatchNorm, InstanceNorm) register as buffers: never optimizer-attached, so
they are not offered to the order-consistent assignment (they have their weight's shape and would make every
norm layer ambiguous)."""

MAX_DP_STATES = 200_000
"""Search states (summed over all parameters) :func:`assign_by_order` may visit before it gives up."""


@dataclass
class Attachment:
    """Which model parameter each optimizer state entry belongs to, and how that was established."""

    mapping: dict[Any, str] = field(default_factory=dict)
    """State key -> model FQN, where it is known (by name, or pinned by every order-consistent assignment)."""
    status: str = "none"
    """``by-name``, ``by-param-names``, ``unique-order``, ``ambiguous``, ``unknown-order``, ``mismatch``,
    ``flat-buckets``, ``none``."""
    findings: list[Finding] = field(default_factory=list)
    params: frozenset[str] = frozenset()
    """Model FQNs that carry optimizer state in some fitting attachment (the trainable parameters); the rest are
    not optimised (frozen parameters, buffers). Empty when that cannot be told (a mismatch, or an unknown order
    with an entry whose shape its state does not say)."""


@dataclass(frozen=True, slots=True)
class OrderFit:
    """What :func:`assign_by_order` found."""

    count: int
    """Order-consistent assignments that fit: 0, 1, or 2 meaning "two or more"."""
    options: tuple[tuple[tuple[int, ...], ...], ...] = ()
    """Per group, per entry: the parameter indices some fitting assignment gives that entry (one index when the
    entry is pinned). Empty when ``count`` is 0 or the search gave up."""
    exhausted: bool = False
    """The search exceeded :data:`MAX_DP_STATES` and stopped; ``count`` is then 2 (cannot verify)."""

    @property
    def solution(self) -> list[list[int]] | None:
        """The parameter index of every entry when exactly one assignment fits."""
        if self.count != 1:
            return None
        return [[opts[0] for opts in group] for group in self.options]


def _shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, TensorRef) and isinstance(value.data, TensorData):
        return value.data.shape
    return None


def moment_shape(entry: dict[str, Any]) -> tuple[int, ...] | None:
    """The parameter shape an optimizer state entry implies, or ``None`` when its state names do not say.

    Only state known to have the parameter's shape (:data:`ELEMENTWISE_STATE`) or to factor it (Adafactor's
    row/column statistics) counts: guessing from an unknown optimizer's tensors would turn per-row statistics
    into false shape mismatches.
    """
    for name, value in entry.items():
        shp = _shape(value)
        if shp is not None and name in ELEMENTWISE_STATE:
            return shp
    for row_name, col_name, keepdim in _FACTORED_STATE:
        row, col = _shape(entry.get(row_name)), _shape(entry.get(col_name))
        if row is not None and col is not None and len(row) >= 1 and len(col) >= 1:
            return (row[:-1] if keepdim else row) + col[-1:]
    return None


def attach(view: View) -> Attachment:
    """Attach the optimizer state to the model's parameters: by name, by saved ``param_names``, or by order."""
    opt, model = view.optimizer, view.model
    if opt is None or model is None:
        return Attachment()
    if opt.keyed == "fqn":
        result = _by_names(opt, model.params, {k: k for k in opt.state}, "by-name", opt.where)
        if opt.unattached_masters:
            result.status = "flat-buckets"
            result.findings.append(finding(
                "optimizer.attachment-unverified", opt.where,
                f"{opt.where}: the optimizer keeps its masters and moments in {len(opt.unattached_masters)} flat "
                "bucket(s) (Megatron's distributed optimizer, dp_reshardable), each holding many parameters; which "
                "slice belongs to which parameter is not saved (Megatron rebuilds it from the model), so the "
                "attachment is not verified offline. The buckets' masters are held to the contract as a whole; "
                "save with distrib_optim_sharding_type fully_reshardable to have every parameter's state by name.",
                buckets=[ref.name for ref in opt.unattached_masters]))
        return result
    names = saved_param_names(opt)
    if names is not None:
        result = _by_names(opt, model.params, names, "by-param-names", opt.where)
        result.findings.insert(0, _index_keyed(opt, result.status, "the param groups saved param_names, so every "
                                               "entry was matched to its parameter by name"))
        return result
    return _by_order(opt, model)


def _index_keyed(opt: OptimizerView, status: str, outcome: str, **evidence: Any) -> Finding:
    return finding(
        "optimizer.index-keyed",
        opt.where,
        f"{opt.where}: optimizer state is keyed by integers (optimizer.state_dict()), so which parameter each entry "
        f"belongs to depends on parameter order (pytorch/pytorch#1489); {outcome}. Save it FQN-keyed "
        "(torch.distributed.checkpoint.state_dict.get_optimizer_state_dict) to make it independent of order.",
        attachment=status,
        **evidence,
    )


def attachable(model: ModelView) -> list[tuple[str, tuple[int, ...]]]:
    """The model tensors an index-keyed entry may belong to, in the writer's order.

    Tied aliases (a second name for a stored tensor) are left out: ``named_parameters()`` yields a shared
    parameter once, under its first name. So are the buffers of torch's norm layers (:data:`KNOWN_BUFFERS`).
    """
    out = []
    for fqn, ref in model.params.items():
        if not isinstance(ref.data, TensorData) or not ref.data.dtype.is_float:
            continue
        if fqn in model.aliases or fqn.rsplit(".", 1)[-1] in KNOWN_BUFFERS:
            continue
        out.append((fqn, ref.data.shape))
    return out


def _by_order(opt: OptimizerView, model: ModelView) -> Attachment:
    result = Attachment()
    findings: list[Finding] = []
    grouped: list[list[Any]] = [list(g.get("params", [])) for g in opt.groups]
    in_groups = {k for g in grouped for k in g}
    if grouped:
        for k in (k for k in opt.state if k not in in_groups):
            findings.append(
                finding("optimizer.unmatched", f"{opt.where}/state/{k}",
                        f"optimizer state entry {k} belongs to no param group", key=safe_str(k))
            )
    else:
        grouped = [list(opt.state)]
    sizes = [len(g) for g in grouped]
    n_entries = sum(sizes)
    groups_text = f"{n_entries} entries in {len(grouped)} param group(s) ({', '.join(map(str, sizes))})"
    expected = [[moment_shape(opt.state[k]) if k in opt.state else None for k in g] for g in grouped]
    candidates = attachable(model)
    if not model.order_known:
        have = Counter(shape for _, shape in candidates)
        need = Counter(s for g in expected for s in g if s is not None)
        missing = {s: c - have.get(s, 0) for s, c in need.items() if c > have.get(s, 0)}
        if missing or n_entries > len(candidates):
            result.status = "mismatch"
            detail = (f"moment shapes the model lacks: {', '.join(f'{c} x {list(s)}' for s, c in missing.items())}"
                      if missing else f"{n_entries} entries but only {len(candidates)} float model tensors")
            findings.append(_mismatch(opt, groups_text, len(candidates), detail, "as a multiset"))
            outcome = "their shapes do not fit the model's (see optimizer.shape-mismatch)"
        else:
            result.status = "unknown-order"
            findings.append(
                finding(
                    "optimizer.attachment-unverified",
                    opt.where,
                    f"{opt.where}: the model file does not keep parameter order (safetensors sorts its tensors), so "
                    f"the {groups_text} can only be checked as a multiset: every moment shape exists in the model, "
                    "but which parameter each entry belongs to cannot be verified offline (a permutation of "
                    "entries would pass). Compare against a reference (ckptaudit compare) or save FQN-keyed "
                    "optimizer state.",
                    entries=n_entries,
                )
            )
            outcome = "the model file keeps no parameter order, so only the multiset of shapes was checked"
            if all(s is not None for g in expected for s in g):
                # Any placement of entries on tensors of their shape fits: a tensor whose shape no entry has
                # carries no optimizer state in any of them (a frozen parameter, e.g. the base embedding PEFT
                # saves beside its adapters). An entry of unknown shape could sit anywhere: then nothing is decided.
                result.params = frozenset(fqn for fqn, shape in candidates if shape in need)
        result.findings = [_index_keyed(opt, result.status, outcome, groups=sizes), *findings]
        return result
    fit = assign_by_order([s for _, s in candidates], expected)
    if fit.count == 0:
        result.status = "mismatch"
        findings.append(_mismatch(opt, groups_text, len(candidates), _diagnose(expected, grouped, candidates),
                                  "in the model's parameter order"))
        outcome = "no order-consistent assignment fits their shapes (see optimizer.shape-mismatch)"
    elif fit.count == 1:
        result.status = "unique-order"
        outcome = (f"the {groups_text} fit the model's parameter order in exactly one order-consistent way, so the "
                   "attachment is verified")
    else:
        result.status = "ambiguous"
        outcome = (f"the {groups_text} fit the model's parameter order in more than one way, so the attachment "
                   "cannot be verified offline (see optimizer.attachment-unverified)")
        findings.append(_ambiguous(opt, groups_text, fit, grouped, candidates))
    if fit.count >= 1 and not fit.exhausted:
        for g, keys in enumerate(grouped):
            for j, key in enumerate(keys):
                opts = fit.options[g][j]
                if len(opts) == 1:
                    result.mapping[key] = candidates[opts[0]][0]
        result.params = frozenset(candidates[i][0] for group in fit.options for opts in group for i in opts)
    result.findings = [_index_keyed(opt, result.status, outcome, groups=sizes), *findings]
    return result


def _ambiguous(opt: OptimizerView, groups_text: str, fit: OrderFit, grouped: list[list[Any]],
               candidates: list[tuple[str, tuple[int, ...]]]) -> Finding:
    if fit.exhausted:
        why = (f"the search for order-consistent assignments exceeded {MAX_DP_STATES} states and stopped, so it "
               "cannot tell whether exactly one fits")
        loose: list[tuple[Any, list[str]]] = []
    else:
        loose = [(grouped[g][j], [candidates[i][0] for i in opts])
                 for g, group in enumerate(fit.options) for j, opts in enumerate(group) if len(opts) > 1]
        example = ""
        if loose:
            key, fqns = loose[0]
            example = f", e.g. entry {key} could belong to {' or '.join(fqns[:3])}" + (" or ..." if len(fqns) > 3 else "")
        fits = "entry fits" if len(loose) == 1 else "entries fit"
        why = (f"{len(loose)} {fits} more than one parameter of equal shape (a frozen parameter or a buffer could "
               f"sit on either side){example}; the other entries are pinned to one parameter each")
    return finding(
        "optimizer.attachment-unverified",
        opt.where,
        f"{opt.where}: the {groups_text} fit the model's parameter order in more than one order-consistent way: "
        f"{why}. Which of them the optimizer really held cannot be verified offline; compare against a reference "
        "(ckptaudit compare) or save FQN-keyed state.",
        entries=sum(len(g) for g in grouped),
        unpinned={safe_str(k): v for k, v in loose[:20]},
    )


def _mismatch(opt: OptimizerView, groups_text: str, n_params: int, detail: str, how: str) -> Finding:
    return finding(
        "optimizer.shape-mismatch",
        opt.where,
        f"{opt.where}: no order-consistent assignment of the {groups_text} to the model's {n_params} float tensors "
        f"fits their shapes {how} ({detail}): this optimizer state belongs to another model, or its entries were "
        "reordered",
        parameters=n_params,
    )


def _diagnose(expected: list[list[tuple[int, ...] | None]], grouped: list[list[Any]],
              candidates: list[tuple[str, tuple[int, ...]]]) -> str:
    """Why no assignment fits: the first entry a group cannot place, or the shapes the groups compete for."""
    shapes = [s for _, s in candidates]
    for g, group in enumerate(expected):
        # Greedy earliest placement decides whether one group alone embeds in order, and where it stops.
        pos, prev = 0, -1
        for j, want in enumerate(group):
            while pos < len(shapes) and not (want is None or shapes[pos] == want):
                pos += 1
            if pos == len(shapes):
                after = f" after {candidates[prev][0]} (where entry {grouped[g][j - 1]} fits)" if prev >= 0 else ""
                shape = list(want) if want is not None else "any"
                return (f"entry {grouped[g][j]}, position {j} of group {g}, has moment shape {shape} and no parameter "
                        f"of that shape comes{after} in the model's order")
            prev, pos = pos, pos + 1
    need = Counter(s for group in expected for s in group if s is not None)
    have = Counter(shapes)
    short = [f"{need[s]} x {list(s)} needed, {have[s]} in the model" for s in need if need[s] > have[s]]
    if short:
        return "; ".join(short)
    return "each group fits the parameter order on its own, but not all of them at once"


def saved_param_names(opt: OptimizerView) -> dict[Any, str] | None:
    """State key -> parameter name, where every param group saved ``param_names`` (Trainer's optimizer since
    transformers 4.47 and torch's ``named_parameters`` groups); ``None`` otherwise."""
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
        implied = moment_shape(entry)
        if implied is not None and implied != pshape and not any(n in ELEMENTWISE_STATE for n in entry):
            # Adafactor's factored statistics imply another shape.
            result.findings.append(
                finding("optimizer.shape-mismatch", f"{where}/state/{name}",
                        f"the factored optimizer statistics of {name!r} imply shape {list(implied)}, its parameter "
                        f"{fqn} has {list(pshape)}", param=fqn, state_shape=list(implied), param_shape=list(pshape))
            )
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
    listed = [p for g in opt.groups for p in g["params"]]
    for key in listed:
        name = names.get(key, key if isinstance(key, str) else None)
        if name is None:
            continue
        fqn = name if name in params else by_norm.get(normalize_fqn(name))
        if fqn is None:
            if key not in opt.state:
                result.findings.append(
                    finding("optimizer.unmatched", f"{where}/param_groups/{name}",
                            f"param group lists {name!r}, which the model does not have", key=safe_str(name))
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
    result.params = frozenset(result.mapping.values())
    return result


def assign_by_order(
    params: Sequence[tuple[int, ...]], groups: Sequence[Sequence[tuple[int, ...] | None]],
    *, allowed: Sequence[Collection[int] | None] | None = None,
) -> OrderFit:
    """Count the order-consistent assignments of ``groups`` to ``params`` (saturating at 2).

    ``params``: the shapes of the model's tensors in the writer's order. Each group is a sequence of expected
    shapes (``None`` matches any tensor: an entry with no shape-bearing state). An assignment gives every entry
    a distinct tensor, preserving the order within each group, with equal shapes; tensors may be left out
    (buffers, frozen parameters) as long as every entry is placed. Groups may interleave (Trainer's decay and
    no-decay groups do).

    A dynamic programme over "entries placed per group" after each tensor: forward it counts the paths, backward
    it keeps the states that still reach the end, so every transition between a forward-reached and a
    backward-live state belongs to some fitting assignment; those give :attr:`OrderFit.options`.

    ``allowed``: per tensor, the groups it may join (``None``: any); it may always be left out.
    """
    k = len(groups)
    sizes = tuple(len(g) for g in groups)
    n = len(params)
    slack = n - sum(sizes)
    if slack < 0:
        return OrderFit(0)

    def moves(i: int, state: tuple[int, ...]) -> list[tuple[tuple[int, ...], int]]:
        out: list[tuple[tuple[int, ...], int]] = []
        if i - sum(state) < slack:  # leave tensor i out
            out.append((state, -1))
        only = allowed[i] if allowed is not None else None
        for g in range(k):
            j = state[g]
            if only is not None and g not in only:
                continue
            if j < sizes[g]:
                want = groups[g][j]
                if want is None or want == params[i]:
                    out.append(((*state[:g], j + 1, *state[g + 1:]), g))
        return out

    layers: list[dict[tuple[int, ...], int]] = [{(0,) * k: 1}]
    visited = 1
    for i in range(n):
        nxt: dict[tuple[int, ...], int] = {}
        for state, count in layers[-1].items():
            for new, _ in moves(i, state):
                nxt[new] = min(nxt.get(new, 0) + count, 2)
        visited += len(nxt)
        if visited > MAX_DP_STATES:
            return OrderFit(2, exhausted=True)
        if not nxt:
            return OrderFit(0)
        layers.append(nxt)
    count = layers[n].get(sizes, 0)
    if count == 0:
        return OrderFit(0)
    options: list[list[set[int]]] = [[set() for _ in range(s)] for s in sizes]
    live = {sizes}
    for i in range(n - 1, -1, -1):
        prev_live: set[tuple[int, ...]] = set()
        for state in layers[i]:
            for new, g in moves(i, state):
                if new in live:
                    prev_live.add(state)
                    if g >= 0:
                        options[g][state[g]].add(i)
        live = prev_live
    return OrderFit(count, tuple(tuple(tuple(sorted(o)) for o in group) for group in options))
