"""The comparison (pure, this process): a resumed trajectory against the uninterrupted one, a restored state
against the reference's, what the uninterrupted steps consume, and the floor-relative drift thresholds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptaudit.resume.config import COMPONENTS, Trajectory


@dataclass(frozen=True)
class Deviation:
    """One resumed run against the uninterrupted one, step by step (index 0: right after the restore)."""

    rel_l2: list[float]
    max_abs: list[float]
    loss_diff: list[float]
    """Per training step: resumed loss minus uninterrupted loss."""
    loss_rel: list[float]
    per_param: list[dict[str, float]]
    """Per step: parameter name -> relative L2 deviation."""


def compare_trajectories(base: Trajectory, other: Trajectory) -> Deviation:
    rel, mx, per = [], [], []
    for b_vals, o_vals, b_norms, o_norms in zip(base.params, other.params, base.norms, other.norms, strict=True):
        if base.full and other.full:
            num = den = 0.0
            worst = 0.0
            pp: dict[str, float] = {}
            for name, b in b_vals.items():
                o = o_vals[name]
                d = (o.astype(np.float64) - b.astype(np.float64)).ravel()
                dn = float(np.dot(d, d))
                bn = float(np.dot(b.astype(np.float64).ravel(), b.astype(np.float64).ravel()))
                num += dn
                den += bn
                worst = max(worst, float(np.max(np.abs(d))) if d.size else 0.0)
                pp[name] = math.sqrt(dn) / math.sqrt(bn) if bn > 0 else math.sqrt(dn)
            rel.append(math.sqrt(num) / math.sqrt(den) if den > 0 else math.sqrt(num))
            mx.append(worst)
            per.append(pp)
        else:  # bounded summary: the norm difference is a lower bound of the deviation
            pp = {n: abs(o_norms[n] - b) / b if b > 0 else abs(o_norms[n]) for n, b in b_norms.items()}
            total_b = math.sqrt(sum(b * b for b in b_norms.values()))
            total_d = math.sqrt(sum((o_norms[n] - b) ** 2 for n, b in b_norms.items()))
            rel.append(total_d / total_b if total_b > 0 else total_d)
            mx.append(float("nan"))
            per.append(pp)
    loss_diff = [o - b for b, o in zip(base.losses, other.losses, strict=True)]
    loss_rel = [abs(d) / abs(b) if b else abs(d) for d, b in zip(loss_diff, base.losses, strict=True)]
    return Deviation(rel, mx, loss_diff, loss_rel, per)


def compare_states(reference: dict[str, dict[str, str]], fresh: dict[str, dict[str, str]],
                   candidate: dict[str, dict[str, str]]) -> dict[str, dict[str, Any]]:
    """Per component: ``restored`` (equal to the reference's restored state), ``not restored`` (every differing
    entry still holds the fresh job's value) or ``differs``, with the differing keys."""
    out: dict[str, dict[str, Any]] = {}
    for comp in COMPONENTS:
        r, f, c = reference.get(comp, {}), fresh.get(comp, {}), candidate.get(comp, {})
        diff = [k for k in sorted(set(r) | set(c)) if r.get(k) != c.get(k)]
        if not diff:
            status = "restored"
        elif all(c.get(k) == f.get(k) for k in diff):
            status = "not restored"
        else:
            status = "differs"
        out[comp] = {"status": status, "keys": diff}
    return out


def thresholds(floor: list[float], margin: float, min_rel: float) -> list[float]:
    """Per step: 0 right after the restore (no kernel noise yet: any difference counts), then
    ``max(margin x floor[k], min_rel)``."""
    return [0.0] + [max(margin * f, min_rel) for f in floor[1:]]


CONSUMABLE = ("rng", "scheduler", "data position")
"""Components whose use by a step shows as a change of their state: a generator advances with every draw, a
scheduler only acts through its ``step()`` (which advances it), a data source yields batches by advancing. The
others are read by every optimizer step whether or not they change (an lr without a scheduler, the moments)."""


def changed_by_steps(before: dict[str, dict[str, str]], after: dict[str, dict[str, str]]) -> dict[str, list[str]]:
    """Per component: the keys whose state the uninterrupted steps changed (snapshots of the training run right
    after the save and after the last step)."""
    out: dict[str, list[str]] = {}
    for comp in COMPONENTS:
        b, a = before.get(comp, {}), after.get(comp, {})
        out[comp] = [k for k in sorted(set(b) | set(a)) if b.get(k) != a.get(k)]
    return out


def _generator(key: str) -> str:
    """``rank1/cuda:0`` -> ``cuda:0``: the generator whatever rank holds it (ranks may differ after a resize)."""
    return key.partition("/")[2] or key


def consumed_summary(changed: dict[str, list[str]], before: dict[str, dict[str, str]]) -> dict[str, Any]:
    """For the report: which generators the steps draw from (on any rank), and whether they step the scheduler
    and advance the data source."""
    drawn = {_generator(k) for k in changed.get("rng", [])}
    generators = sorted({_generator(k) for k in before.get("rng", {})})
    return {"generators": {g: g in drawn for g in generators},
            "scheduler": bool(changed.get("scheduler")), "data position": bool(changed.get("data position"))}


def unused_by_steps(component: str, key: str, changed: dict[str, list[str]] | None) -> bool:
    """Whether the uninterrupted steps never consume ``key`` of ``component``: a generator no rank drew from, a
    scheduler they never stepped, a data source they never advanced. ``changed=None`` (not recorded): never."""
    if changed is None or component not in CONSUMABLE:
        return False
    if component == "rng":
        return _generator(key) not in {_generator(k) for k in changed.get("rng", [])}
    return not changed.get(component)


def consumed_differences(expected: dict[str, dict[str, str]], actual: dict[str, dict[str, str]],
                         changed: dict[str, list[str]] | None) -> dict[str, list[str]]:
    """Per component, the keys whose digests differ between two states of the same ranks, leaving out what the
    steps never consume; components without such a difference are left out."""
    out: dict[str, list[str]] = {}
    for comp in COMPONENTS:
        e, a = expected.get(comp, {}), actual.get(comp, {})
        keys = [k for k in sorted(set(e) | set(a)) if e.get(k) != a.get(k) and not unused_by_steps(comp, k, changed)]
        if keys:
            out[comp] = keys
    return out
