"""What the resume test is asked (:class:`ResumeConfig`) and what its phases hand back (:class:`Trajectory`,
the failures the ranks report).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEFAULT_RECIPE = "ckptaudit.recipes.tinygpt:recipe"
DEFAULT_EXPORTER = "ckptaudit.exporters:documented"

COMPONENTS = ("parameters", "optimizer moments", "optimizer step", "optimizer hyperparameters", "scheduler",
              "rng", "data position", "training step")
"""The parts of a job's state compared right after each restore."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ResumeConfig:
    recipe: str = DEFAULT_RECIPE
    """``module:attr`` or ``path.py:attr`` of a :class:`ckptaudit.recipes.Recipe`."""
    exporters: tuple[str, ...] = (DEFAULT_EXPORTER,)
    """The exporters under test, ``module:attr`` or ``path.py:attr`` each."""
    nproc: int = 2
    """Ranks that train and save."""
    resume_nproc: int | None = None
    """Ranks that resume (``None``: ``nproc``). DCP reshards; single-file exporters go through their loaders."""
    save_at: int = 8
    """Training steps before the checkpoint."""
    steps: int = 8
    """Steps taken after resuming (and by the uninterrupted run)."""
    margin: float = 10.0
    """At step k a candidate drifts when its deviation exceeds ``margin`` x the reference's (the floor) ..."""
    min_rel: float = 1e-6
    """... and this relative L2 deviation (about eight fp32 ulps), whichever is larger."""
    loss_threshold: float = 0.01
    """Relative loss difference under which the loss "looks normal"."""
    borrow_state: bool = False
    """Restore the reference under each candidate (only what the candidate's loader overwrites is its own)."""
    full_values_limit: int = 4_000_000
    """Parameters with at most this many elements in all are recorded in full at every step; larger models
    are recorded as per-parameter norms (deviation is then estimated from the norms)."""
    timeout_s: float = 600.0
    """Bound of each phase (and of each collective in it)."""
    export_timeout_s: float | None = None
    """Bound of each candidate's export phase (``None``: ``timeout_s``): an exporter still running then is
    killed and called hung; nothing else waits on it."""
    workdir: str | None = None
    """Where checkpoints are written; a temporary directory (removed afterwards) when ``None``."""
    reference_name: str = "reference"
    candidate_names: tuple[str, ...] = ()
    """File names for the candidates inside ``workdir`` (default: derived from the exporter names)."""
    debug: bool = False
    """Failures of user code carry every frame of the traceback, not only the user's own."""

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"nproc must be at least 1, got {self.nproc}")
        if self.resume_nproc is not None and self.resume_nproc < 1:
            raise ValueError(f"resume_nproc must be at least 1, got {self.resume_nproc}")
        if self.save_at < 1 or self.steps < 1:
            raise ValueError(f"save_at and steps must be at least 1 (got {self.save_at} and {self.steps}): the "
                             "optimizer needs state before the checkpoint and the test needs steps after it")
        if not self.margin >= 1.0:
            raise ValueError(f"margin must be at least 1 (got {self.margin}): below 1 the reference itself "
                             "would drift")
        if not self.exporters:
            raise ValueError("name at least one exporter to test (module:attr)")
        for name in ("timeout_s", "export_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if self.candidate_names and len(self.candidate_names) != len(self.exporters):
            raise ValueError("candidate_names must name every exporter")

    @property
    def resume_ranks(self) -> int:
        return self.resume_nproc or self.nproc

    @property
    def export_timeout(self) -> float:
        return self.export_timeout_s if self.export_timeout_s is not None else self.timeout_s

    def candidate_name(self, i: int) -> str:
        if self.candidate_names:
            return self.candidate_names[i]
        attr = self.exporters[i].rpartition(":")[2]
        return f"candidate-{i}-{re.sub(r'[^A-Za-z0-9_.-]', '_', attr)}"


class ResumeError(Exception):
    """The experiment itself could not run (a phase crashed or timed out outside the user's exporters)."""


@dataclass
class Trajectory:
    """What rank 0 recorded: loss per step and parameters after the restore (index 0) and after each step."""

    losses: list[float] = field(default_factory=list)
    params: list[dict[str, np.ndarray]] = field(default_factory=list)
    norms: list[dict[str, float]] = field(default_factory=list)
    full: bool = True


@dataclass(frozen=True)
class PhaseFailed:
    """A rank's report that user code failed: ``stage`` is ``recipe``, ``export``, ``load`` or ``steps`` (or
    ``internal``: ckptaudit's own restore of the reference failed in an export phase)."""

    stage: str
    failure: Any  # ckptaudit.recipes.UserFailure (imported lazily: it imports torch)
    rank: int
