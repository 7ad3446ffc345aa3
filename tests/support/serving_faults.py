"""Conversions for the serving gate's tests, named ``module:attr`` on the command line as users name theirs."""

from __future__ import annotations

import torch

BROKEN = "blocks.0.mlp.fc.weight"


def zero_matrix(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A conversion bug: one matrix comes out as zeros."""
    return torch.zeros_like(t, dtype=dtype) if name == BROKEN else t.to(dtype)


def wrong_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A conversion that ignores the dtype it was asked for."""
    return t.clone()
