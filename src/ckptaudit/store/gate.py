"""The serving quality gate: the exported model's outputs against the full-precision model's, on one batch.

Both models run the same evaluation batch, on the same device, in eval mode (no dropout), and the gate compares
their logits position by position (a *position* is one token of one sequence; its logits are a vector over the
vocabulary):

- ``max_abs_diff``   max |x - r| over every logit;
- ``max_rel_diff``   max over positions of max|x - r| / max|r|: the error relative to that position's logit scale;
- ``min_cosine``     the smallest cosine similarity of x and r over positions;
- ``top1_agreement`` the share of positions whose most likely next token is the same;
- ``loss_diff``      |CE(x) - CE(r)|, next-token cross-entropy in nats (only when targets can be formed).

A NaN or an infinity in the exported logits fails the gate whatever the thresholds (every comparison is written so
that NaN fails it). The default thresholds are justified in docs/export-serving.md ("The gate") from measurements on
the built-in recipe; ``bench/serving_gate.py`` reproduces them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.nn import functional as F

__all__ = [
    "GateCheck",
    "GateMetrics",
    "GateResult",
    "GateThresholds",
    "compare_logits",
    "judge",
    "next_token_targets",
]

IGNORE = -100
"""Target value of positions without a next token (``F.cross_entropy``'s default ``ignore_index``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GateThresholds:
    """Limits the exported model's outputs must stay within; each has a CLI flag of the same name."""

    max_abs_diff: float = 0.5
    """``--max-abs-diff``: largest absolute logit difference allowed (in logit units, so model dependent:
    generous by default, the relative limit below is the scale-free one)."""
    max_rel_diff: float = 0.05
    """``--max-rel-diff``: largest per-position logit error relative to that position's largest |logit|."""
    min_cosine: float = 0.999
    """``--min-cosine``: smallest per-position cosine similarity of the logit vectors."""
    min_top1: float = 0.90
    """``--min-top1``: smallest share of positions whose top-1 token agrees."""
    max_loss_diff: float = 0.01
    """``--max-loss-diff``: largest |cross-entropy difference| in nats."""

    def __post_init__(self) -> None:
        for name in ("max_abs_diff", "max_rel_diff", "max_loss_diff"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):  # NaN fails the first test
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value} (a large "
                                 "number switches the check off)")
        for name in ("min_cosine", "min_top1"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ValueError(f"--{name.replace('_', '-')} must be between 0 and 1, got {value}")

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class GateMetrics:
    positions: int
    vocab: int
    nonfinite: int
    """Non-finite values among the exported logits (the reference's are required to be finite)."""
    max_abs_diff: float
    max_rel_diff: float
    min_cosine: float
    mean_cosine: float
    top1_agreement: float
    loss_full: float | None
    loss_exported: float | None
    loss_diff: float | None
    """``None`` when the batch gives no next-token targets (see :func:`next_token_targets`)."""

    def as_dict(self) -> dict[str, Any]:
        # JSON has no NaN or infinity: a non-finite metric (exported logits overflowed) is written as null.
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


@dataclass(frozen=True, slots=True)
class GateCheck:
    metric: str
    value: float | None
    limit: float
    kind: str
    """``max`` (value must not exceed the limit) or ``min`` (must not fall below it)."""
    passed: bool
    flag: str

    def shown(self) -> str:
        """The value as a person reads it: a ``min`` metric near 1 (cosine, agreement) keeps its decimals."""
        if self.value is None:
            return "n/a"
        return f"{self.value:.6f}" if self.kind == "min" else f"{self.value:.3g}"

    def describe(self) -> str:
        op = "<=" if self.kind == "max" else ">="
        value = self.shown()
        verdict = "ok" if self.passed else "FAILED"
        return f"{self.metric} {value} (limit {op} {self.limit:g}, {self.flag}) {verdict}"


@dataclass(frozen=True, slots=True)
class GateResult:
    passed: bool
    failures: tuple[str, ...]
    """One sentence per failed check (what the metric was, the limit, the flag that sets it)."""
    checks: tuple[GateCheck, ...]
    metrics: GateMetrics
    thresholds: GateThresholds

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "failures": list(self.failures),
            "metrics": self.metrics.as_dict(),
            "thresholds": self.thresholds.as_dict(),
        }


def next_token_targets(batch: Any, logits: torch.Tensor) -> torch.Tensor | None:
    """Targets for next-token cross-entropy, aligned with ``logits``' positions, or ``None`` if none can be formed.

    ``batch`` must be a 2-D integer tensor of token ids (B, T). Logits of shape (B, T-1, V) are taken as the
    predictions for tokens 1..T-1 (the model saw ``batch[:, :-1]``); logits of shape (B, T, V) predict tokens
    1..T-1 from positions 0..T-2, the last position has no target.
    """
    if not isinstance(batch, torch.Tensor) or batch.dim() != 2 or batch.dtype.is_floating_point:
        return None
    if logits.dim() != 3 or logits.shape[0] != batch.shape[0]:
        return None
    b, t = batch.shape
    if logits.shape[1] == t - 1:
        return batch[:, 1:].to(logits.device)
    if logits.shape[1] == t:
        targets = torch.full((b, t), IGNORE, dtype=torch.long, device=logits.device)
        targets[:, :-1] = batch[:, 1:]
        return targets
    return None


def compare_logits(reference: torch.Tensor, exported: torch.Tensor,
                   targets: torch.Tensor | None = None) -> GateMetrics:
    """The gate's metrics for two logit tensors of the same shape (..., V); pure."""
    if reference.shape != exported.shape:
        raise ValueError(f"logit shapes differ: full precision {tuple(reference.shape)}, "
                         f"exported {tuple(exported.shape)}")
    if reference.dim() == 0:
        raise ValueError("logits must have at least one dimension (the vocabulary)")
    vocab = reference.shape[-1]
    r = reference.detach().reshape(-1, vocab).to(torch.float64)
    x = exported.detach().reshape(-1, vocab).to(torch.float64)
    if not bool(torch.isfinite(r).all()):
        raise ValueError("the full-precision model's logits are not all finite: the checkpoint or the recipe's "
                         "model is broken before any conversion; audit the checkpoint")
    positions = r.shape[0]
    nonfinite = int((~torch.isfinite(x)).sum())
    if positions == 0 or vocab == 0:
        raise ValueError("the evaluation batch produced no logits; give a batch with at least one token")
    nan = float("nan")
    if nonfinite:
        max_abs = max_rel = min_cos = mean_cos = nan
    else:
        d = (x - r).abs()
        max_abs = float(d.max())
        scale = r.abs().amax(dim=1).clamp_min(1e-12)
        max_rel = float((d.amax(dim=1) / scale).max())
        cos = F.cosine_similarity(x, r, dim=1, eps=1e-12)
        min_cos, mean_cos = float(cos.min()), float(cos.mean())
    top1 = float((x.argmax(dim=1) == r.argmax(dim=1)).to(torch.float64).mean())
    loss_full = loss_exp = loss_diff = None
    if targets is not None:
        t = targets.reshape(-1).to(r.device)
        if t.numel() == positions and bool((t != IGNORE).any()):
            loss_full = float(F.cross_entropy(r, t, ignore_index=IGNORE))
            loss_exp = float(F.cross_entropy(x, t, ignore_index=IGNORE)) if not nonfinite else nan
            loss_diff = abs(loss_exp - loss_full)
    return GateMetrics(positions, vocab, nonfinite, max_abs, max_rel, min_cos, mean_cos, top1, loss_full, loss_exp,
                       loss_diff)


def judge(metrics: GateMetrics, thresholds: GateThresholds) -> GateResult:
    """Hold the metrics to the thresholds. Every comparison is phrased so that NaN fails it."""
    checks = [
        GateCheck("max_abs_diff", metrics.max_abs_diff, thresholds.max_abs_diff, "max",
                  metrics.max_abs_diff <= thresholds.max_abs_diff, "--max-abs-diff"),
        GateCheck("max_rel_diff", metrics.max_rel_diff, thresholds.max_rel_diff, "max",
                  metrics.max_rel_diff <= thresholds.max_rel_diff, "--max-rel-diff"),
        GateCheck("min_cosine", metrics.min_cosine, thresholds.min_cosine, "min",
                  metrics.min_cosine >= thresholds.min_cosine, "--min-cosine"),
        GateCheck("top1_agreement", metrics.top1_agreement, thresholds.min_top1, "min",
                  metrics.top1_agreement >= thresholds.min_top1, "--min-top1"),
    ]
    if metrics.loss_diff is not None:
        checks.append(GateCheck("loss_diff", metrics.loss_diff, thresholds.max_loss_diff, "max",
                                metrics.loss_diff <= thresholds.max_loss_diff, "--max-loss-diff"))
    failures = [c.describe() for c in checks if not c.passed]
    if metrics.nonfinite:
        failures.insert(0, f"{metrics.nonfinite} of {metrics.positions * metrics.vocab} exported logits are NaN or "
                           "infinite (the dtype's range is too small for the model's values)")
    return GateResult(not failures, tuple(failures), tuple(checks), metrics, thresholds)
