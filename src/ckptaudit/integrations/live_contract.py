"""The running job's master-dtype contract, for the guards: what the audit of a checkpoint saved in the loop holds
its parameters to, read from the live run instead of inferred from the file.

The masters are whatever the optimizer steps: the parameters of its param groups, whatever wraps them (plain
torch optimizers; FSDP2's sharded DTensors; DeepSpeed's ZeRO and bf16 optimizers, whose groups hold the fp32
partitions; Accelerate's and Lightning's wrappers, which forward ``param_groups``). Their dtype is the contract,
passed to :func:`ckptaudit.audit` as ``master_dtype`` (with ``master_dtype_from`` saying so: the report's
contract then says ``live``), unless the user passed a ``master_dtype`` to the guard. An optimizer over parameters
of several dtypes (a model holding some in bf16 by design, FSDP2 modules under different ``MixedPrecisionPolicy``
settings) has no one master dtype: each parameter's is passed, in the order of the param groups, as
``master_dtypes`` (:func:`live_master_dtypes`), and the audit lays them over the saved groups, so that each
parameter is held to its own.

Which process runs what: the owning process (the one that submits the checkpoint), on its training thread, right
before it submits; reading the parameters' dtypes moves no data.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from ckptaudit.integrations.guard import Guard

__all__ = ["FLAT_MASTERS", "declare_live_contract", "live_master_dtype", "live_master_dtypes", "param_groups"]

log = logging.getLogger("ckptaudit.guard")

_CONTRACT_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
FLAT_MASTERS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition")
"""Where DeepSpeed's optimizers keep their master partitions (ZeRO-1/2, ZeRO-3, ``BF16_Optimizer``): ZeRO-3 empties
its ``param_groups`` between steps, so they are read here when the groups hold no parameter."""


def param_groups(optimizer: Any) -> list[Any]:
    """The param groups ``optimizer`` steps (a plain torch optimizer's, a wrapper's that forwards them, or every inner
    optimizer's of a container such as torchtitan's ``OptimizersContainer``)."""
    groups = getattr(optimizer, "param_groups", None)
    if isinstance(groups, list):
        return groups
    inner = getattr(optimizer, "optimizers", None)  # torchtitan's OptimizersContainer, lists of optimizers
    if isinstance(inner, list | tuple):
        return [g for o in inner for g in param_groups(o)]
    return []


def live_master_dtype(optimizer: Any) -> tuple[str, str] | None:
    """(dtype, what shows it in words) of the floating-point parameters ``optimizer`` steps, or ``None`` when it
    steps none, or parameters of different float dtypes (then :func:`live_master_dtypes` gives each one's)."""
    import torch

    counts: Counter[str] = Counter()
    for group in param_groups(optimizer):
        params = group.get("params", []) if isinstance(group, dict) else []
        for p in params:
            if isinstance(p, torch.Tensor) and p.is_floating_point():
                counts[str(p.dtype).removeprefix("torch.")] += 1
    if len(counts) > 1:
        log.info("ckptaudit guard: the optimizer steps parameters of several dtypes (%s); each parameter is held "
                 "to its own (live_master_dtypes)", dict(counts))
        return None
    what = "parameter tensor(s)"
    if not counts:
        for attr in FLAT_MASTERS:
            flat = getattr(optimizer, attr, None)
            if isinstance(flat, list | tuple) and flat:
                counts.update(str(t.dtype).removeprefix("torch.") for t in flat
                              if isinstance(t, torch.Tensor) and t.is_floating_point())
                what = f"master partition(s) ({attr})"
                break
        if len(counts) != 1:
            return None
    ((dtype, n),) = counts.items()
    contract = _CONTRACT_DTYPES.get(dtype)
    if contract is None:
        return None
    return contract, f"{type(optimizer).__name__} steps {n} {dtype} {what}"


def live_master_dtypes(optimizer: Any) -> tuple[tuple[str, ...], str] | None:
    """(each parameter's dtype in the order of ``optimizer``'s param groups, what shows it in words) when its
    parameters have several float dtypes; ``None`` otherwise (one dtype: :func:`live_master_dtype`), or when one
    of them is not a float tensor of a master dtype (the positions would not line up with the saved groups)."""
    import torch

    dtypes: list[str] = []
    for group in param_groups(optimizer):
        for p in (group.get("params", []) if isinstance(group, dict) else []):
            dtype = str(p.dtype).removeprefix("torch.") if isinstance(p, torch.Tensor) else ""
            if dtype not in _CONTRACT_DTYPES:
                return None
            dtypes.append(dtype)
    counts = Counter(dtypes)
    if len(counts) < 2:
        return None
    said = " and ".join(f"{n} {d}" for d, n in sorted(counts.items()))
    return tuple(dtypes), f"{type(optimizer).__name__} steps {said} parameter tensor(s)"


def declare_live_contract(guard: Guard, optimizer: Any, run: str = "") -> None:
    """(owning process, after the library's save and before :meth:`Guard.submit`) Give ``guard``'s audits the
    running job's master dtype (:func:`live_master_dtype`; ``run``: more about the run, e.g. its precision
    setting), unless the user passed a ``master_dtype`` of their own (once set, later calls leave it as it is);
    and give the next submitted checkpoint the live check of its masters (:meth:`Guard.observe`: did the training
    state itself lose its bits, or only the file?)."""
    guard.observe(optimizer)
    if guard.audit_options.get("master_dtype", "auto") != "auto":
        return
    found = live_master_dtype(optimizer)
    if found is None:
        several = live_master_dtypes(optimizer)
        if several is not None:
            dtypes, evidence = several
            why = f"the live run: {evidence}" + (f" ({run})" if run else "")
            guard.audit_options = {**guard.audit_options, "master_dtypes": list(dtypes), "master_dtype_from": why}
        return
    dtype, evidence = found
    why = f"the live run: {evidence}" + (f" ({run})" if run else "")
    # A new dict, swapped in whole: the worker thread reads the options as one object.
    guard.audit_options = {**guard.audit_options, "master_dtype": dtype, "master_dtype_from": why}
