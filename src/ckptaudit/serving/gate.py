"""The serving quality gate: the exported model's outputs against the full-precision model's, on one batch.

Both models run the same evaluation batch, on the same device, in eval mode (no dropout), and the gate compares
their outputs. How depends on what the output is (:data:`OUTPUT_KINDS`, the recipe's ``output_kind``; by default
``logits`` when the last dimension has at least 2 entries, else ``values``):

- ``logits`` (a language model's (B, T, V), a classifier's (B, C)): each *row* is one position's (one token's,
  one sample's) vector of scores over the last dimension;
- ``embedding`` (vectors (B, D), (B, T, D)): rows as for logits, but no "top-1" (an embedding has no classes);
- ``values`` (regression outputs (B,), (B, k), images): the whole output is one row, compared at one scale.

The metrics (every one of them a function of that row structure):

- ``max_abs_diff``   max |x - r| over every output value;
- ``max_rel_diff``   max over rows of max|x - r| / max|r|: the error relative to that row's scale;
- ``min_cosine``     the smallest cosine similarity of x and r over rows;
- ``top1_agreement`` the share of rows whose largest score is at the same index (``logits`` only);
- ``loss_diff``      |L(x) - L(r)|: the recipe's own ``eval_loss(model, batch)``, else, for a batch of token ids
  and logits, next-token cross-entropy in nats; not checked when there is neither.

A NaN or an infinity in the exported outputs fails the gate whatever the thresholds (every comparison is written so
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
    "OUTPUT_KINDS",
    "GateCheck",
    "GateMetrics",
    "GateResult",
    "GateThresholds",
    "compare_logits",
    "compare_outputs",
    "judge_gate",
    "next_token_targets",
    "output_kind",
]

OUTPUT_KINDS = ("logits", "embedding", "values")
"""What a model's output is, for the gate: scores over classes or tokens, embedding vectors, or plain values."""

IGNORE = -100
"""Target value of positions without a next token (``F.cross_entropy``'s default ``ignore_index``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GateThresholds:
    """Limits the exported model's outputs must stay within; each has a CLI flag of the same name."""

    max_abs_diff: float = 0.5
    """``--max-abs-diff``: largest absolute output difference allowed (in the output's units, so model dependent:
    generous by default, the relative limit below is the scale-free one)."""
    max_rel_diff: float = 0.05
    """``--max-rel-diff``: largest per-row output error relative to that row's largest |output|."""
    min_cosine: float = 0.999
    """``--min-cosine``: smallest per-row cosine similarity of the output vectors."""
    min_top1: float = 0.90
    """``--min-top1``: smallest share of rows whose top-1 class or token agrees (``logits`` outputs only)."""
    max_loss_diff: float = 0.01
    """``--max-loss-diff``: largest |loss difference|, in the loss's units (nats for cross-entropy)."""

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
    """Rows compared (positions of a language model, samples of a classifier; 1 for ``values``)."""
    vocab: int
    """Entries per row: the last dimension (vocabulary, classes, embedding width), or every value for ``values``."""
    nonfinite: int
    """Non-finite values among the exported outputs (the reference's are required to be finite)."""
    max_abs_diff: float
    max_rel_diff: float
    min_cosine: float
    mean_cosine: float
    top1_agreement: float | None
    """``None`` unless the outputs are ``logits``."""
    loss_full: float | None
    loss_exported: float | None
    loss_diff: float | None
    """``None`` when there is no loss to compare (see :func:`compare_outputs`)."""
    kind: str = "logits"
    """One of :data:`OUTPUT_KINDS`."""
    loss_source: str | None = None
    """``eval_loss`` (the recipe's), ``next-token cross-entropy``, or ``None``."""

    def describe(self) -> str:
        """What was compared, for a report's title."""
        if self.kind == "values":
            return f"{self.vocab} output value(s)"
        what = "logits" if self.kind == "logits" else "embedding entries"
        return f"{self.positions} row(s) of {self.vocab} {what}"

    def as_dict(self) -> dict[str, Any]:
        # JSON has no NaN or infinity: a non-finite metric (exported outputs overflowed) is written as null.
        out = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}
        if self.kind == "values":  # no rows and no vocabulary: one row of every value (for a regressor, not the
            # batch size as a "vocab" and 1 as its "positions")
            del out["positions"], out["vocab"]
            out["values"] = self.vocab
        return out


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


def output_kind(output: torch.Tensor, declared: str | None = None) -> str:
    """The recipe's declared ``output_kind``, checked; else ``logits`` for an output whose last dimension has at
    least 2 entries, ``values`` for anything else (one value per sample, a scalar)."""
    if declared is not None:
        if declared not in OUTPUT_KINDS:
            raise ValueError(f"the recipe's output_kind {declared!r} is not one of {', '.join(OUTPUT_KINDS)}")
        return declared
    return "logits" if output.dim() >= 2 and output.shape[-1] >= 2 else "values"


def compare_logits(reference: torch.Tensor, exported: torch.Tensor,
                   targets: torch.Tensor | None = None) -> GateMetrics:
    """:func:`compare_outputs` of two logit tensors (..., V), with next-token ``targets`` when given; pure."""
    return compare_outputs(reference, exported, kind="logits", targets=targets)


def compare_outputs(reference: torch.Tensor, exported: torch.Tensor, *, kind: str = "logits",
                    targets: torch.Tensor | None = None,
                    losses: tuple[float, float] | None = None) -> GateMetrics:
    """The gate's metrics for two outputs of the same shape; pure.

    ``kind`` (:data:`OUTPUT_KINDS`) says what a row is (see the module docstring). The loss compared is ``losses``
    (full precision, exported: the recipe's ``eval_loss`` on each model) when given, else next-token
    cross-entropy against ``targets`` (logits only), else none.
    """
    if kind not in OUTPUT_KINDS:
        raise ValueError(f"output kind {kind!r} is not one of {', '.join(OUTPUT_KINDS)}")
    if reference.shape != exported.shape:
        raise ValueError(f"output shapes differ: full precision {tuple(reference.shape)}, "
                         f"exported {tuple(exported.shape)}")
    if reference.numel() == 0:
        raise ValueError("the evaluation batch produced no output; give a batch with at least one sample")
    if kind == "values" or reference.dim() == 0:
        r = reference.detach().reshape(1, -1).to(torch.float64)
        x = exported.detach().reshape(1, -1).to(torch.float64)
    else:
        width = reference.shape[-1]
        r = reference.detach().reshape(-1, width).to(torch.float64)
        x = exported.detach().reshape(-1, width).to(torch.float64)
    if not bool(torch.isfinite(r).all()):
        raise ValueError("the full-precision model's outputs are not all finite: the checkpoint or the recipe's "
                         "model is broken before any conversion; audit the checkpoint")
    positions, width = r.shape
    nonfinite = int((~torch.isfinite(x)).sum())
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
    top1 = float((x.argmax(dim=1) == r.argmax(dim=1)).to(torch.float64).mean()) if kind == "logits" else None
    loss_full = loss_exp = loss_diff = None
    source = None
    if losses is not None:
        loss_full, loss_exp = float(losses[0]), float(losses[1])
        if not math.isfinite(loss_full):
            raise ValueError(f"the recipe's eval_loss on the full-precision model is {loss_full}: the checkpoint or "
                             "the recipe is broken before any conversion")
        loss_diff = abs(loss_exp - loss_full)
        source = "eval_loss"
    elif targets is not None and kind == "logits":
        t = targets.reshape(-1).to(r.device)
        if t.numel() == positions and bool((t != IGNORE).any()):
            loss_full = float(F.cross_entropy(r, t, ignore_index=IGNORE))
            loss_exp = float(F.cross_entropy(x, t, ignore_index=IGNORE)) if not nonfinite else nan
            loss_diff = abs(loss_exp - loss_full)
            source = "next-token cross-entropy"
    return GateMetrics(positions=positions, vocab=width, nonfinite=nonfinite, max_abs_diff=max_abs,
                       max_rel_diff=max_rel, min_cosine=min_cos, mean_cosine=mean_cos, top1_agreement=top1,
                       loss_full=loss_full, loss_exported=loss_exp, loss_diff=loss_diff, kind=kind,
                       loss_source=source)


def judge_gate(metrics: GateMetrics, thresholds: GateThresholds) -> GateResult:
    """Hold the metrics to the thresholds. Every comparison is phrased so that NaN fails it."""
    checks = [
        GateCheck("max_abs_diff", metrics.max_abs_diff, thresholds.max_abs_diff, "max",
                  metrics.max_abs_diff <= thresholds.max_abs_diff, "--max-abs-diff"),
        GateCheck("max_rel_diff", metrics.max_rel_diff, thresholds.max_rel_diff, "max",
                  metrics.max_rel_diff <= thresholds.max_rel_diff, "--max-rel-diff"),
        GateCheck("min_cosine", metrics.min_cosine, thresholds.min_cosine, "min",
                  metrics.min_cosine >= thresholds.min_cosine, "--min-cosine"),
    ]
    if metrics.top1_agreement is not None:
        checks.append(GateCheck("top1_agreement", metrics.top1_agreement, thresholds.min_top1, "min",
                                metrics.top1_agreement >= thresholds.min_top1, "--min-top1"))
    if metrics.loss_diff is not None:
        checks.append(GateCheck("loss_diff", metrics.loss_diff, thresholds.max_loss_diff, "max",
                                metrics.loss_diff <= thresholds.max_loss_diff, "--max-loss-diff"))
    failures = [c.describe() for c in checks if not c.passed]
    if metrics.nonfinite:
        failures.insert(0, f"{metrics.nonfinite} of {metrics.positions * metrics.vocab} exported outputs are NaN or "
                           "infinite (the dtype's range is too small for the model's values)")
    return GateResult(not failures, tuple(failures), tuple(checks), metrics, thresholds)
