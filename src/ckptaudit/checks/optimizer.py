"""Optimizer state judged against its attachment (:mod:`ckptaudit.layouts.attachment`): step counters that
disagree, and which parameters the index-keyed state may leave without an entry or place in a group that never
learnt (learning rate 0 throughout).

Pure functions over the interpreted view and the scan's values; reads no tensor data.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from typing import Any

from ckptaudit.catalogue import finding
from ckptaudit.findings import Finding, safe_str, text
from ckptaudit.layouts.attachment import Attachment, assign_by_order, attachable, moment_shape, saved_param_names
from ckptaudit.layouts.view import OptimizerView, View, normalize_fqn

__all__ = ["check_steps", "may_all_be_unattached", "never_updated"]


def may_all_be_unattached(view: View, fqns: Collection[str]) -> bool:
    """Whether some attachment of the index-keyed optimizer state that fits the model gives none of ``fqns`` an
    entry, so that each of them could be a frozen parameter. By the model's order where it is known (an
    order-consistent assignment to the other tensors), else as a multiset of shapes. State keyed by names decides
    by name, so there it is ``False``, as it is when nothing fits."""
    opt, model = view.optimizer, view.model
    if opt is None or model is None or not fqns or opt.keyed == "fqn" or saved_param_names(opt) is not None:
        return False
    grouped: list[list[Any]] = [list(g.get("params", [])) for g in opt.groups] or [list(opt.state)]
    expected = [[moment_shape(opt.state[k]) if k in opt.state else None for k in g] for g in grouped]
    rest = [shape for fqn, shape in attachable(model) if fqn not in fqns]
    if not model.order_known:
        have = Counter(rest)
        need = Counter(s for g in expected for s in g if s is not None)
        return sum(map(len, expected)) <= len(rest) and all(have[s] >= c for s, c in need.items())
    return assign_by_order(rest, expected).count >= 1


def never_updated(view: View, attachment: Attachment, zero_groups: Mapping[int, str],
                  below: Collection[str]) -> dict[str, str]:
    """The parameters of ``below`` (those stored or rounded below the master dtype) that sit in a param group
    whose every recorded learning rate is 0 (``zero_groups``: group index -> that record in words), with the
    evidence: by name where the groups name their parameters (``get_state_dict``, ``param_names``) or the
    attachment pins them; for index-keyed state otherwise, all of them at once when some order-consistent
    attachment that fits the model places every one of them in such a group (or leaves it out), else none."""
    opt, model = view.optimizer, view.model
    if opt is None or model is None or not zero_groups or not below:
        return {}
    names = saved_param_names(opt)
    if opt.keyed == "fqn" or names is not None or attachment.status == "unique-order":
        known: Mapping[Any, str] = ({k: k for g in opt.groups for k in g.get("params", [])} if opt.keyed == "fqn"
                                    else names if names is not None else attachment.mapping)
        by_norm = {normalize_fqn(f): f for f in model.params}
        out: dict[str, str] = {}
        for i, why in zero_groups.items():
            for key in opt.groups[i].get("params", []):
                name = known.get(key)
                fqn = None if name is None else (name if name in model.params else by_norm.get(normalize_fqn(name)))
                if fqn is not None and fqn in below:
                    out[fqn] = why
        return out
    grouped: list[list[Any]] = [list(g.get("params", [])) for g in opt.groups]
    expected = [[moment_shape(opt.state[k]) if k in opt.state else None for k in g] for g in grouped]
    candidates = attachable(model)
    zero = frozenset(zero_groups)
    if model.order_known:
        allowed = [zero if fqn in below else None for fqn, _ in candidates]
        fits = assign_by_order([shape for _, shape in candidates], expected, allowed=allowed).count >= 1
    else:  # by shapes: the other groups' entries from the tensors not below, every entry from some tensor
        others = Counter(shape for fqn, shape in candidates if fqn not in below)
        have = Counter(shape for _, shape in candidates)
        need = Counter(s for g, e in enumerate(expected) if g not in zero for s in e if s is not None)
        total = Counter(s for e in expected for s in e if s is not None)
        fits = (all(others[s] >= c for s, c in need.items()) and all(have[s] >= c for s, c in total.items())
                and sum(map(len, expected)) <= len(candidates))
    if not fits:
        return {}
    groups_text = "; ".join(zero_groups.values())
    return {fqn: f"{groups_text}; index-keyed state: an attachment that fits the model places it in such a group, "
                 "which same-shaped parameter each entry belongs to is not verified"
            for fqn, _ in candidates if fqn in below}


def check_steps(opt: OptimizerView | None, steps: dict[Any, float]) -> list[Finding]:
    """``steps``: state key -> that entry's ``step`` value. Counters that disagree are a finding."""
    if opt is None or len(set(steps.values())) <= 1:
        return []
    values = Counter(steps.values())
    common, _ = values.most_common(1)[0]
    odd = [safe_str(k) for k, v in steps.items() if v != common]
    return [
        finding(
            "optimizer.step-mismatch",
            opt.where,
            f"{opt.where}: per-parameter step counters disagree (most are {_count_text(common)}; {len(odd)} differ, "
            f"e.g. {', '.join(odd[:5])}): bias correction will differ between parameters after resuming",
            counts={_count_text(k): c for k, c in values.items()},
        )
    ]


def _count_text(value: float) -> str:
    """A step counter as text: ``5``, ``2.5``, ``nan``; an int too large for a float or for ``str`` spelled
    by :func:`~ckptaudit.findings.text`, never raised."""
    return text(value) if isinstance(value, int) else f"{value:g}"
