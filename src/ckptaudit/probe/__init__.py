"""The live probe: dtypes and hashes of every parameter at the three points of a running job.

1. outside forward, the sharded master the optimizer updates (:meth:`Probe.record_masters`);
2. inside forward, the compute representation FSDP unshards for the module (:meth:`Probe.arm`);
3. the state an exporter saved, cut to the same shard regions (:meth:`Probe.record_saved`).

:func:`judge` puts them side by side (``faithful`` / ``probe.saved-compute-copy`` / ``probe.mismatch``) in a
:class:`~ckptaudit.findings.RawReport`; :func:`ckptaudit.probe.run.run_probe` drives it on a recipe
(``ckptaudit probe``). See :mod:`ckptaudit.probe.live` for the protocol inside a training script.
"""

from __future__ import annotations

from ckptaudit.probe.live import Probe
from ckptaudit.probe.points import ComputeShard, MasterShard, ParamInfo, ProbeResult, SavedShard
from ckptaudit.probe.regions import Region
from ckptaudit.probe.verdict import ParamVerdict, judge_probe
from ckptaudit.probe.wrappers import ProbeError

__all__ = [
    "ComputeShard",
    "MasterShard",
    "ParamInfo",
    "ParamVerdict",
    "Probe",
    "ProbeError",
    "ProbeResult",
    "Region",
    "SavedShard",
    "judge_probe",
]
