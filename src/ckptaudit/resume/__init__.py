"""The differential resume test: does a checkpoint resume the original trajectory?

Phases, each a fresh set of real processes (:func:`ckptaudit.launch.launch`):

1. **train** (``nproc`` ranks): build the recipe's job, train ``save_at`` steps; save the reference through the
   documented path (:func:`ckptaudit.exporters.documented`: ``get_state_dict`` + DCP, with scheduler, RNG and
   data position); then continue ``steps`` steps uninterrupted, recording the loss and the parameters (rank 0
   keeps them) after every step, and the job's state right after the save and after the last step (what changed
   is what the steps use: generators drawn from, a scheduler stepped, a data source advanced). No exporter
   under test runs in these processes.
2. **reference resume** (``resume_nproc`` ranks, fresh processes): build the job, restore the reference, run the
   same steps. Its per-step deviation from the uninterrupted run is the *floor* (zero on deterministic CPU
   kernels on the same number of ranks; reduction order when the world size changes).
3. **positive control** (``resume_nproc`` ranks): the reference with its parameters rounded to the compute dtype
   (or nudged by one ulp when the masters are already that narrow), resumed like a candidate. It must stand out
   from the floor after restore, or the test has no power: ``resume.no-power``, and no candidate is judged.
4. **candidate export** (``nproc`` ranks, fresh processes, once per candidate): the reference restored into a
   fresh job (checked equal to the training run's state at the save), then the exporter with its ``prepare``
   forward. Whatever it does (raise inside FSDP's forward, kill its processes, hang until ``export_timeout_s``)
   ends with these processes: it is that candidate's ``resume.candidate-failed`` and touches nothing else.
5. **candidate resume** (``resume_nproc`` ranks, once per candidate that wrote something): a fresh job restored
   from the candidate alone, through its exporter's ``load`` (default: :func:`default_load`), nothing of the
   reference underneath (``borrow_state``: the reference first, then the candidate's loader over it, the old
   controlled experiment).

Every resumed run snapshots the job's state right after the restore, before any step, component by component
(parameters, optimizer moments, optimizer step, optimizer hyperparameters, scheduler, each rank's RNG, each
rank's data position, the training step). There is no kernel noise before the first step, so a candidate whose
restored state differs from the reference's restored state is a finding however noisy the steps are:
``resume.not-restored`` (still the fresh job's value) or ``resume.restored-differs``, unless the steps never use
that part (``resume.unused-state-differs``, info). After the restore, the verdict is floor-relative per step:
``resume.drift`` when the relative L2 deviation of the parameters at step ``k >= 1`` exceeds
``max(margin x floor[k], min_rel)``, or at step 0 differs at all.

The package follows the phases: :mod:`~ckptaudit.resume.config` (the experiment asked and the records handed
back), :mod:`~ckptaudit.resume.phases` and :mod:`~ckptaudit.resume.snapshot` (what each rank runs and records),
:mod:`~ckptaudit.resume.deviation` (the pure comparisons), :mod:`~ckptaudit.resume.judge` (the verdicts and the
report) and :mod:`~ckptaudit.resume.driver` (:func:`run_resume_test`, which launches the phases).
"""

from __future__ import annotations

from ckptaudit.resume.config import (
    COMPONENTS,
    DEFAULT_EXPORTER,
    DEFAULT_RECIPE,
    ResumeConfig,
    ResumeError,
    Trajectory,
)
from ckptaudit.resume.deviation import Deviation, compare_states, compare_trajectories, thresholds
from ckptaudit.resume.driver import run_resume_test
from ckptaudit.resume.judge import judge_resume
from ckptaudit.resume.phases import default_load, load_weights

__all__ = [
    "COMPONENTS",
    "DEFAULT_EXPORTER",
    "DEFAULT_RECIPE",
    "Deviation",
    "ResumeConfig",
    "ResumeError",
    "Trajectory",
    "compare_states",
    "compare_trajectories",
    "default_load",
    "judge_resume",
    "load_weights",
    "run_resume_test",
    "thresholds",
]
