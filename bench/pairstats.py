"""Paired-difference statistics for the benchmarks: ABBA blocks, a mean with a Student-t confidence interval,
and a verdict that never states more than the interval supports. Pure Python (no SciPy in the environment).

A *block* is four segments run back to back in ABBA (or BAAB) order: ``a`` the plain loop, ``b`` the loop
under test. A linear drift of the machine's speed across the block cancels exactly in
``(b1 + b2) / (a1 + a2) - 1``, the block's relative overhead; the blocks' overheads are then treated as
independent draws and summarised by their mean and a t interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on :func:`t_cdf`)."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo < 1e-12:
            break
    return (lo + hi) / 2.0


@dataclass(frozen=True, slots=True)
class Interval:
    """The mean of ``n`` paired differences and its two-sided confidence interval at ``level``."""

    mean: float
    low: float
    high: float
    n: int
    sd: float
    level: float

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2.0


def mean_ci(diffs: Sequence[float], level: float = 0.95) -> Interval:
    """Mean of ``diffs`` with a Student-t interval (``n - 1`` degrees of freedom). Needs two values or more."""
    n = len(diffs)
    if n < 2:
        raise ValueError(f"a confidence interval needs at least 2 paired differences, got {n}")
    mean = math.fsum(diffs) / n
    sd = math.sqrt(math.fsum((d - mean) ** 2 for d in diffs) / (n - 1))
    half = t_quantile(0.5 + level / 2.0, n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, sd, level)


def abba_overheads(blocks: Sequence[tuple[float, float, float, float]], order: Sequence[str]) -> list[float]:
    """Each block's relative overhead ``(b1 + b2) / (a1 + a2) - 1``. ``blocks[i]`` holds the four segments'
    times in the order run, ``order[i]`` that order: ``"ABBA"`` or ``"BAAB"``."""
    out: list[float] = []
    for times, kind in zip(blocks, order, strict=True):
        if kind not in ("ABBA", "BAAB"):
            raise ValueError(f"block order must be 'ABBA' or 'BAAB', not {kind!r}")
        a = sum(t for t, k in zip(times, kind, strict=True) if k == "A")
        b = sum(t for t, k in zip(times, kind, strict=True) if k == "B")
        out.append(b / a - 1.0)
    return out


def rounds_needed(ci: Interval, target: float) -> int | None:
    """How many blocks would make the interval exclude ``target`` if the mean and spread stay as measured
    (normal approximation); ``None`` when the mean sits on the target (no number of rounds resolves it)."""
    gap = abs(target - ci.mean)
    if gap < 0.05 * abs(target) or ci.sd == 0.0:
        return None
    z = t_quantile(0.5 + ci.level / 2.0, 1e6)
    return max(ci.n + 1, math.ceil((z * ci.sd / gap) ** 2 * 1.2))


def verdict(ci: Interval, target: float = 0.01, label: str = "overhead", hint: str = "run with --rounds {n}") -> str:
    """One line that states only what the interval supports: below ``target``, above it, or not resolved (then
    ``hint``, formatted with ``n``, the blocks :func:`rounds_needed` projects)."""
    pct = f"{ci.level:.0%} CI [{100 * ci.low:+.2f}%, {100 * ci.high:+.2f}%]"
    if ci.high < target:
        return f"{label} < {100 * target:g}% ({pct}, mean {100 * ci.mean:+.2f}%, {ci.n} blocks)"
    if ci.low > target:
        return f"{label} > {100 * target:g}% ({pct}, mean {100 * ci.mean:+.2f}%, {ci.n} blocks)"
    need = rounds_needed(ci, target)
    advice = hint.format(n=need) if need else "the mean sits on the target; more rounds will not resolve it"
    return f"cannot resolve {100 * target:g}% with this noise ({pct}, mean {100 * ci.mean:+.2f}%); {advice}"
