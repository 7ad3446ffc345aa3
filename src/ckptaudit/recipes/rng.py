"""A rank's random number generators, captured and restored: Python's, NumPy's, torch's CPU generator and, where
present, CUDA's. The writer (:mod:`ckptaudit.store`) and the reference exporter save them with the job's state."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """This rank's RNG state: Python, NumPy, torch CPU and (where present) CUDA."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuple(state["python"]))
    np.random.set_state(_as_tuple(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _as_tuple(v: Any) -> Any:
    # Round trips through torch.save/DCP may turn tuples into lists.
    if isinstance(v, list):
        return tuple(_as_tuple(x) for x in v)
    return v
