"""The master-dtype contract and the precision findings held against it.

Pure functions over tensor records. ``auto`` takes the contract from what declares it (ckptaudit's manifest),
else from the training stack's own record of its precision (DeepSpeed's ds_config, Megatron's args, a saved
GradScaler: :class:`~ckptaudit.layouts.view.ContractRecord`), else from the tensors: fp32 optimizer moments beside
the parameters mean fp32 masters; 16-bit moments beside 16-bit (or 16-bit-valued) parameters look like a run
that trains with low-precision masters, which the file alone cannot tell from a mixed-precision run's state cast
to 16 bits: that inference is a warning (``contract.inferred``) naming the flag that settles it.

The contract is per parameter where the evidence is (:func:`per_parameter`): torch's optimizers create each
parameter's state in that parameter's dtype (``torch.zeros_like(p)``), so a checkpoint whose moments are float32
for some parameters and 16-bit for others holds a model with 16-bit parameters by design (``.to(torch.bfloat16)``
on some submodules, FSDP2 modules under another ``MixedPrecisionPolicy``): each parameter is held to its own
moments' dtype. A 16-bit parameter whose own moments are float32 still lost its master's bits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptaudit.catalogue import finding
from ckptaudit.findings import ComponentKind, Contract, Finding, Precision, TensorRecord
from ckptaudit.layouts.view import ContractRecord, View

__all__ = ["MASTER_DTYPES", "PerParameter", "check_precision", "infer_contract", "judged_params", "live_per_parameter",
           "manifest_per_parameter", "masters_not_saved", "per_parameter", "place_live_dtypes"]

MASTER_DTYPES = ("auto", "float32", "bfloat16", "float16")
_WIDE = ("float32", "float64")
_NARROW = ("bfloat16", "float16")
_ATTACHED = ("by-name", "by-param-names", "unique-order")
"""Attachment statuses that tell every optimizer entry's parameter (:class:`~ckptaudit.layouts.attachment.Attachment`)."""


def _majority(records: Sequence[TensorRecord]) -> str | None:
    counts = Counter(r.dtype for r in records)
    return counts.most_common(1)[0][0] if counts else None


def infer_contract(
    flag: str,
    params: Sequence[TensorRecord],
    moments: Sequence[TensorRecord],
    manifest_dtype: str | None = None,
    *,
    records: Sequence[ContractRecord] = (),
    flag_source: str = "flag",
    flag_detail: str = "",
) -> tuple[Contract, list[Finding]]:
    """Decide the master dtype parameters are held to: declared (``flag``, the manifest), else read from the
    training stack's own record (``records``: DeepSpeed's ds_config, Megatron's args, a saved GradScaler), else
    inferred from the tensors' dtypes, which is said (``contract.inferred``) when it makes the masters 16-bit.

    ``params``: the model's float parameters (masters in place); ``moments``: the optimizer's element-wise float
    state. ``flag_source``/``flag_detail``: who declared ``flag`` (``live`` and the evidence, for a guard).
    A record that says full-precision masters beside 16-bit parameters and moments is ``contract.mismatch``.
    """
    seen = tuple(r.text() for r in records)
    tensors = _from_tensors(params, moments)
    if flag != "auto":
        detail = flag_detail or (f"--master-dtype {flag}" if flag_source == "flag" else flag)
        contract = Contract(flag, flag_source, detail, records=seen)
        if flag_source == "live":  # the running job is a record too, and the most direct one
            return contract, _mismatch(contract, tensors, "the running job", f"{flag} masters", detail)
        return contract, []
    if manifest_dtype:
        contract = Contract(manifest_dtype, "manifest", "recorded by the writer in manifest.json",
                            where="manifest.json", records=seen)
        return contract, _low(contract, "the manifest records it") + _mismatch(
            contract, tensors, "manifest.json", f"master_dtype {manifest_dtype}",
            "the dtype of the parameters the live optimizer stepped, recorded by ckptaudit's writer")
    deciding = next((r for r in records if r.master_dtype is not None), None)
    if deciding is not None:
        assert deciding.master_dtype is not None
        if deciding.source == "run":  # the run's other checkpoints (ckptaudit latest): deciding.why names this one
            contract = Contract(deciding.master_dtype, "run", deciding.says, where=deciding.where, records=seen)
            return contract, _run_mismatch(contract, tensors, deciding)
        contract = Contract(deciding.master_dtype, deciding.source, f"{deciding.says}: {deciding.why}",
                            where=deciding.where, records=seen)
        return contract, _low(contract, f"{deciding.where} records {deciding.says}") + _mismatch(
            contract, tensors, deciding.where, deciding.says, deciding.why)
    contract = Contract(tensors.master_dtype, tensors.source, tensors.detail, records=seen)
    if tensors.source == "optimizer-state" and tensors.master_dtype in _NARROW:
        return contract, [_inferred(contract, records)]
    if tensors.master_dtype == "unknown" and params:
        return contract, [
            finding(
                "contract.unknown",
                "contract",
                f"{tensors.detail} to tell low-precision masters from a down-cast copy"
                + (f" (the stack's record does not decide it: {'; '.join(seen)})" if seen else "")
                + "; pass --master-dtype float32 (or bfloat16) to hold them to a contract",
            )
        ]
    return contract, []


def _from_tensors(params: Sequence[TensorRecord], moments: Sequence[TensorRecord]) -> Contract:
    """The contract the tensors' dtypes suggest (``optimizer-state``, ``parameters`` or ``none``)."""
    moment_dtype = _majority(moments)
    param_dtype = _majority(params)
    if moment_dtype is not None:
        own = _own_dtypes(moments)
        wide = sum(1 for d in own.values() if d & set(_WIDE))
        narrow = Counter(min(d) for d in own.values() if d and d <= set(_NARROW))
        if wide and narrow:  # per parameter: each is held to its own moments' dtype (per_parameter)
            sixteen = ", ".join(f"{dt} for {n}" for dt, n in sorted(narrow.items()))
            return Contract("float32", "optimizer-state", f"optimizer moments are float32 for {wide} parameter(s) "
                            f"and {sixteen}: each parameter is held to its own moments' dtype")
        if moment_dtype in _WIDE:
            return Contract("float32", "optimizer-state", f"optimizer moments are {moment_dtype}")
        effectively_narrow = bool(params) and all(
            r.dtype in _NARROW or r.precision in (Precision.BF16, Precision.FP16, Precision.INCONCLUSIVE)
            for r in params
        )
        if effectively_narrow:
            return Contract(moment_dtype, "optimizer-state",
                            f"parameters are {param_dtype} and optimizer moments are {moment_dtype}")
        return Contract("float32", "parameters", f"float32 parameters beside {moment_dtype} optimizer moments")
    if param_dtype is None:
        return Contract("unknown", "none", "no float parameters")
    if param_dtype in _WIDE:
        return Contract("float32", "parameters", f"parameters are {param_dtype} (no optimizer state)")
    return Contract("unknown", "none", f"parameters are {param_dtype} and there is no optimizer state")


def _own_dtypes(moments: Sequence[TensorRecord]) -> dict[str, set[str]]:
    """Parameter -> the float dtypes of the optimizer state attached to it (its moments, its master copy)."""
    own: dict[str, set[str]] = {}
    for m in moments:
        if m.param is not None and m.dtype in (*_WIDE, *_NARROW):
            own.setdefault(m.param, set()).add(m.dtype)
    return own


def _narrow_valued(r: TensorRecord) -> bool:
    """Stored in 16 bits, or wide with every value 16-bit-representable (or too few informative values to tell)."""
    return r.dtype in _NARROW or r.precision in (Precision.BF16, Precision.FP16, Precision.INCONCLUSIVE)


@dataclass(frozen=True, slots=True)
class PerParameter:
    """Where a parameter's own optimizer state decides its master dtype apart from the checkpoint's contract."""

    masters: Mapping[str, str] = field(default_factory=dict)
    """Parameter -> the 16-bit dtype it is trained in by design (its own moments are that dtype, beside other
    parameters' float32 moments): held to that dtype, not to the contract's."""
    undecided: Mapping[str, str] = field(default_factory=dict)
    """Parameter -> why the evidence does not decide its master dtype (``precision.not-judged``)."""
    findings: tuple[Finding, ...] = ()


def per_parameter(contract: Contract, params: Sequence[TensorRecord], moments: Sequence[TensorRecord],
                  attachment: str, records: Sequence[ContractRecord] = ()) -> PerParameter:
    """Each parameter's own master dtype, from its own optimizer state, where the checkpoint's moments are float32
    for some parameters and 16-bit for others (a model holding some parameters in bf16 by design: torch's
    optimizers create every parameter's state in that parameter's dtype). Only under a contract inferred from the
    tensors: a declared one (``--master-dtype``, the live run, the manifest) or the stack's record speaks for
    every parameter.

    A 16-bit parameter whose own moments are 16-bit is a 16-bit master by design, unless the optimizer keeps
    16-bit state for float32 parameters too (then 16-bit moments show nothing: not judged); one whose entry cannot
    be told (``attachment``: the :class:`~ckptaudit.layouts.attachment.Attachment` status) is not judged either.
    A 16-bit parameter whose own moments are float32 is judged by the contract (its master lost its bits).
    Under the run's contract (``records``: the run's other checkpoints, source ``run``), the parameters those
    checkpoints show 16-bit by design (:attr:`~ckptaudit.layouts.view.ContractRecord.sixteen_bit`) are held to
    that dtype."""
    if contract.source == "run":
        return _by_run(contract, params, records)
    if contract.source not in ("optimizer-state", "parameters") or contract.master_dtype not in _WIDE:
        return PerParameter()
    own = _own_dtypes(moments)
    wide = {p for p, d in own.items() if d & set(_WIDE)}
    narrow = {p: d for p, d in own.items() if d and d <= set(_NARROW)}
    loose = {m.dtype for m in moments if m.param is None and m.dtype in (*_WIDE, *_NARROW)}
    mixed_state = bool(wide or loose & set(_WIDE)) and bool(narrow or loose & set(_NARROW))
    if not mixed_state:
        return PerParameter()  # one dtype of state for every parameter: the checkpoint's contract says it
    by_param = {r.param: r for r in params if r.param is not None}
    # A float32 parameter with 16-bit moments: this optimizer keeps 16-bit state whatever the parameter's dtype.
    wide_with_narrow = sorted(p for p in narrow if p in by_param and not _narrow_valued(by_param[p]))
    masters: dict[str, str] = {}
    undecided: dict[str, str] = {}
    for r in params:
        p = r.param
        if p is None or not _narrow_valued(r):
            continue
        if p in narrow:
            if wide_with_narrow:
                undecided[p] = (f"its optimizer moments are {'/'.join(sorted(narrow[p]))}, but this optimizer keeps "
                                f"16-bit state for float32 parameters too ({wide_with_narrow[0]}), so 16-bit moments "
                                "do not show a 16-bit master")
            elif len(narrow[p]) == 1:
                masters[p] = next(iter(narrow[p]))
            else:
                undecided[p] = f"its optimizer moments are of two 16-bit dtypes ({', '.join(sorted(narrow[p]))})"
        elif p not in own and attachment not in _ATTACHED:
            undecided[p] = (f"the optimizer state holds float32 moments for some parameters and 16-bit ones for "
                            f"others, and which entry is this parameter's cannot be told (attachment: {attachment})")
    if not masters:
        return PerParameter(undecided=undecided)
    names = sorted(masters)
    shown = ", ".join(names[:8]) + (f" (+{len(names) - 8} more)" if len(names) > 8 else "")
    dtypes = sorted(set(masters.values()))
    note = finding(
        "contract.per-parameter",
        "contract",
        f"the optimizer keeps float32 state for {len(wide)} parameter(s) and {'/'.join(dtypes)} state for "
        f"{len(names)}, each in the dtype of the parameter it belongs to (as torch's optimizers create it): a model "
        f"that holds those {len(names)} parameter(s) in {'/'.join(dtypes)} by design (e.g. .to(torch.bfloat16) on "
        f"some submodules, or FSDP2 modules under another MixedPrecisionPolicy). Each parameter is held to its own "
        f"master dtype: {shown} to {'/'.join(dtypes)}, the others to float32. Pass --master-dtype float32 if every "
        "parameter of this run had a float32 master",
        params=names,
        dtypes=dict(sorted(masters.items())),
    )
    return PerParameter(masters=masters, undecided=undecided, findings=(note,))


def place_live_dtypes(dtypes: Sequence[str], view: View, mapping: Mapping[object, str]) -> dict[str, str] | None:
    """Parameter -> master dtype, from ``dtypes`` (one per parameter the live optimizer steps, in the order of its
    param groups) laid over the checkpoint's saved param groups (``mapping``: the attachment's state key ->
    parameter); ``None`` when the saved groups do not hold as many parameters (another optimizer, or none)."""
    groups = view.optimizer.groups if view.optimizer is not None else []
    keys = [k for g in groups for k in (g.get("params", []) if isinstance(g, dict) else [])]
    if not keys or len(keys) != len(dtypes):
        return None
    placed: dict[str, str] = {}
    for key, dtype in zip(keys, dtypes, strict=True):
        fqn = mapping.get(key, key if isinstance(key, str) else None)
        if fqn is not None:
            placed[fqn] = dtype
    return placed


def live_per_parameter(placed: Mapping[str, str], params: Sequence[TensorRecord], detail: str,
                       who: str = "the live optimizer steps") -> PerParameter:
    """The declared per-parameter contract (:func:`place_live_dtypes`: the live optimizer's;
    :func:`manifest_per_parameter`: the writer's record of it): each parameter it names 16-bit is held to that
    dtype; a 16-bit parameter whose place cannot be told is not judged."""
    masters = {p: d for p, d in placed.items() if d in _NARROW}
    if not masters:
        return PerParameter()
    undecided = {r.param: f"{who} parameters of several dtypes, and which of them this one is cannot be told"
                 for r in params if r.param is not None and r.param not in placed and _narrow_valued(r)}
    names = sorted(p for p in masters if any(r.param == p for r in params))
    dtypes = "/".join(sorted(set(masters.values())))
    note = _per_parameter_note(f"{detail}: {who} {len(masters)} parameter(s) in {dtypes} and the others in float32 "
                               f"(a model holding those in {dtypes} by design)", names, masters)
    return PerParameter(masters=masters, undecided=undecided, findings=(note,))


def _per_parameter_note(lead: str, names: Sequence[str], masters: Mapping[str, str], evidence: str | None = None) -> Finding:
    """``contract.per-parameter``: ``lead`` (where the per-parameter contract comes from), then which parameters are
    held to which master dtype."""
    shown = ", ".join(names[:8]) + (f" (+{len(names) - 8} more)" if len(names) > 8 else "")
    dtypes = "/".join(sorted(set(masters.values())))
    where: dict[str, Any] = {} if evidence is None else {"evidence": evidence}
    return finding("contract.per-parameter", "contract",
                   f"{lead}. Each parameter is held to its own master dtype: {shown} to {dtypes}, the others to "
                   "float32", params=list(names), dtypes=dict(sorted(masters.items())),
                   **where)


def manifest_per_parameter(manifest: Mapping[str, object], params: Sequence[TensorRecord]) -> dict[str, str] | None:
    """Parameter -> dtype, from ckptaudit's manifest, when its writer recorded trainable parameters of several float
    dtypes (``contract.parameter_dtypes``): each parameter's dtype is then the live one its ``tensors`` entry
    records (the writer saves the live state as it is); ``None`` when the manifest records one dtype."""
    info = manifest.get("contract")
    counts = info.get("parameter_dtypes") if isinstance(info, dict) else None
    if not isinstance(counts, dict) or len([d for d in counts if d in (*_WIDE, *_NARROW)]) < 2:
        return None
    tensors = manifest.get("tensors")
    components = manifest.get("components")
    model = components.get("model") if isinstance(components, dict) else None
    key = model.get("key") if isinstance(model, dict) else None
    if not isinstance(tensors, dict) or not isinstance(key, str):
        return None
    placed: dict[str, str] = {}
    for r in params:
        entry = tensors.get(f"{key}.{r.param}") if r.param is not None else None
        if r.param is not None and isinstance(entry, dict) and entry.get("dtype") in (*_WIDE, *_NARROW):
            placed[r.param] = str(entry["dtype"])
    return placed


def _by_run(contract: Contract, params: Sequence[TensorRecord], records: Sequence[ContractRecord]) -> PerParameter:
    run = next((r for r in records if r.source == "run" and r.sixteen_bit), None)
    if run is None:
        return PerParameter()
    design = dict(run.sixteen_bit)
    masters = {r.param: design[r.param] for r in params
               if r.param is not None and r.param in design and _narrow_valued(r)}
    if not masters:
        return PerParameter()
    names = sorted(masters)
    dtypes = "/".join(sorted(set(masters.values())))
    note = _per_parameter_note(f"{contract.detail}, except {len(names)} parameter(s) whose own optimizer state there "
                               f"is {dtypes}, in their dtype: a model holding them in {dtypes} by design", names,
                               masters, evidence=run.where)
    return PerParameter(masters=masters, findings=(note,))


def _low(contract: Contract, why: str) -> list[Finding]:
    if contract.master_dtype not in _NARROW:
        return []
    return [
        finding(
            "contract.low-precision-masters",
            "contract",
            f"this run trains with {contract.master_dtype} masters ({why}); parameters are held to that contract, "
            "and no full-precision master is expected",
            master_dtype=contract.master_dtype,
            source=contract.source,
        )
    ]


def _mismatch(contract: Contract, tensors: Contract, where: str, says: str, why: str) -> list[Finding]:
    """``contract.mismatch`` when the record promises full-precision masters and the tensors are 16-bit masters
    (parameters and moments): the lossy direction, the one that loses a run."""
    if contract.master_dtype not in _WIDE or not (tensors.source == "optimizer-state"
                                                  and tensors.master_dtype in _NARROW):
        return []
    return [
        finding(
            "contract.mismatch",
            "contract",
            f"{where} records {says} ({why}), so this run keeps {contract.master_dtype} masters; but "
            f"the checkpoint's {tensors.detail}: the full-precision masters were not saved (e.g. an export that cast "
            f"the whole state to {tensors.master_dtype}), and resuming from it continues from rounded weights. Each "
            "parameter is listed below. Save the masters the documented way, or pass --master-dtype "
            f"{tensors.master_dtype} if the record is not this run's.",
            record=where,
            record_says=says,
            expected=contract.master_dtype,
            tensors=tensors.detail,
        )
    ]


def _run_mismatch(contract: Contract, tensors: Contract, run: ContractRecord) -> list[Finding]:
    """``contract.run-mismatch``: the run's other checkpoints hold full-precision masters, this one holds 16-bit
    parameters and moments (what the file alone would call a bf16-masters run)."""
    if contract.master_dtype not in _WIDE or not (tensors.source == "optimizer-state"
                                                  and tensors.master_dtype in _NARROW):
        return []
    return [
        finding(
            "contract.run-mismatch",
            "contract",
            f"{run.says}; {run.why} holds {tensors.master_dtype} ({tensors.detail}). Judged alone it could be a "
            f"run with {tensors.master_dtype} masters; beside its own run's checkpoints it is not: its "
            f"{contract.master_dtype} masters were not saved (e.g. an export that cast the whole state to "
            f"{tensors.master_dtype}), and resuming from it continues from rounded weights. Pass --master-dtype "
            f"{tensors.master_dtype} if the run switched to {tensors.master_dtype} masters on purpose, or "
            "--no-run-evidence to judge each checkpoint alone.",
            evidence=run.where,
            expected=contract.master_dtype,
            tensors=tensors.detail,
        )
    ]


def _inferred(contract: Contract, records: Sequence[ContractRecord]) -> Finding:
    dtype = contract.master_dtype
    seen = [r.text() for r in records]
    return finding(
        "contract.inferred",
        "contract",
        f"no record of the training stack says what the masters are, and the checkpoint's {contract.detail}: what a "
        f"run with {dtype} masters saves (held to that contract here), but also what an export that cast a "
        f"mixed-precision run's state to {dtype} saves, whose masters lost their low bits. If the run trained with "
        "fp32 masters (FSDP or AMP mixed precision, DeepSpeed, Megatron), pass --master-dtype float32 "
        f"(master_dtype='float32'); pass --master-dtype {dtype} to declare the {dtype} masters"
        + (f". Records seen, which do not decide it: {'; '.join(seen)}" if seen else ""),
        master_dtype=dtype,
        records=seen,
    )


def check_precision(
    params: Sequence[TensorRecord],
    contract: Contract,
    *,
    frozen: Sequence[TensorRecord] = (),
    frozen_why: str = "",
    before_first_update: str | None = None,
    not_judged: Collection[str] = (),
    not_judged_why: str = "",
    never_updated: Mapping[str, str] | None = None,
    per_param: PerParameter | None = None,
) -> list[Finding]:
    """Per-parameter findings: stored or effectively rounded below the contract's master dtype.

    ``params``: the model's float parameters that carry optimizer state, or whose state cannot be told.
    ``frozen``: model float tensors the optimizer state shows carry none (frozen parameters, buffers; how that
    was decided: ``frozen_why``): never updated, so no master is due; what lies below the master dtype is info.
    ``before_first_update``: the evidence, in words, that no optimizer update was applied before this save;
    then 16-bit-representable masters are what a start from 16-bit weights looks like (a warning, not an error).
    ``not_judged``: FQNs of parameters below the master dtype that the optimizer state may leave without an entry
    (``not_judged_why``: how); frozen ones owe no master, trainable ones lost bits: a warning, not a verdict.
    ``never_updated``: FQNs whose every recorded learning rate is 0 -> that record in words: never updated, so
    judged like frozen parameters (``precision.never-updated``, info).
    ``per_param``: the parameters whose own optimizer state decides their master dtype (:func:`per_parameter`):
    each held to that dtype, or not judged where the evidence does not decide.
    Under an unknown contract nothing is judged per parameter (``contract.unknown`` says why).
    """
    findings: list[Finding] = []
    if contract.master_dtype == "unknown":
        return findings
    if contract.master_dtype not in ("float32", "float64"):
        # A 16-bit contract: only a different 16-bit storage is a defect.
        for r in params:
            if r.dtype in _NARROW and r.dtype != contract.master_dtype:
                findings.append(_storage(r, contract))
        return findings
    never_updated = never_updated or {}
    per_param = per_param or PerParameter()
    for r in params:
        own = per_param.masters.get(r.param) if r.param is not None else None
        if own is not None:  # a 16-bit master by design: only another 16-bit storage lost bits
            if r.dtype in _NARROW and r.dtype != own:
                findings.append(_storage(r, Contract(own, "optimizer-state", f"its own optimizer state is {own}")))
            continue
        why = per_param.undecided.get(r.param) if r.param is not None else None
        if why is not None:
            findings.append(
                finding(
                    "precision.not-judged",
                    r.name,
                    f"{r.name}: " + (f"stored as {r.dtype}" if r.dtype in _NARROW else
                                     f"{r.dtype} with every value 16-bit-representable")
                    + f", in a checkpoint whose parameters have masters of different dtypes; {why}. Not judged: "
                    f"pass --master-dtype float32 if it had a float32 master, or compare against a reference "
                    "(ckptaudit compare).",
                    dtype=r.dtype,
                    reason="per-parameter",
                )
            )
            continue
        rounded = _rounded(r)
        lr0 = never_updated.get(r.param) if r.param is not None else None
        if lr0 is not None and (r.dtype in _NARROW or rounded is not None):
            what = (f"{r.dtype}, with all {r.numel} values {rounded[0]}-representable" if rounded is not None
                    else f"stored as {r.dtype}")
            findings.append(
                finding(
                    "precision.never-updated",
                    r.name,
                    f"{r.name}: {what}, in a param group whose every recorded learning rate is 0 "
                    f"({lr0}): no update was ever applied to it, so it holds the weights as "
                    f"they were loaded (e.g. a {rounded[0] if rounded else r.dtype} release), and no "
                    f"{contract.master_dtype} master is due",
                    dtype=r.dtype,
                    lr_record=lr0,
                )
            )
            continue
        if r.param in not_judged and (r.dtype in _NARROW or rounded is not None):
            what = (f"{r.dtype}, with all {r.numel} values {rounded[0]}-representable" if rounded is not None
                    else f"stored as {r.dtype}")
            findings.append(
                finding(
                    "precision.not-judged",
                    r.name,
                    f"{r.name}: {what}, and the optimizer state may hold no entry for it ({not_judged_why}). As a "
                    f"frozen parameter it owes no {contract.master_dtype} master; as a trainable one it lost its low "
                    "bits before saving. Not judged: compare against a reference (ckptaudit compare) or save "
                    "FQN-keyed optimizer state (get_optimizer_state_dict) so that frozen parameters are named.",
                    dtype=r.dtype,
                )
            )
            continue
        if r.dtype in _NARROW:
            findings.append(_storage(r, contract))
            continue
        if rounded is None:
            continue
        fmt, bits, informative = rounded
        if before_first_update is not None:
            findings.append(
                finding(
                    "precision.before-first-update",
                    r.name,
                    f"{r.name}: float32 master whose {r.numel} values are all {fmt}-representable, in a checkpoint "
                    f"saved before any optimizer update ({before_first_update}). That is what a start from {fmt} "
                    f"weights looks like (e.g. a {fmt} release loaded into fp32 masters), and nothing was lost "
                    f"since; had the initial weights been fp32, their low bits were lost before this save. After "
                    f"real steps, masters like these are precision.{fmt}-rounded (an error).",
                    numel=r.numel,
                    informative=informative,
                    dtype=r.dtype,
                )
            )
            continue
        findings.append(
            finding(
                f"precision.{fmt}-rounded",
                r.name,
                f"{r.name}: float32 parameter whose {r.numel} values are all {fmt}-representable "
                f"({informative} informative values; a genuine fp32 tensor does this with probability "
                f"below 2^-{bits * min(informative, 64)}). Its low mantissa bits were lost before saving, "
                f"e.g. by capturing the {fmt} compute copy; save the sharded fp32 masters instead "
                "(get_state_dict + torch.distributed.checkpoint).",
                numel=r.numel,
                informative=informative,
                dtype=r.dtype,
            )
        )
    for r in frozen:
        rounded = _rounded(r)
        if r.dtype in _NARROW:
            what = f"stored as {r.dtype}"
        elif rounded is not None:
            what = f"{r.dtype}, with all {r.numel} values {rounded[0]}-representable"
        else:
            continue
        findings.append(
            finding(
                "precision.not-optimised",
                r.name,
                f"{r.name}: {what}, but it carries no optimizer state "
                f"({frozen_why or 'no optimizer entry belongs to it'}): a frozen parameter or a buffer is never updated, so no {contract.master_dtype} master is due "
                "and nothing is lost by keeping it as it was loaded",
                dtype=r.dtype,
            )
        )
    return findings


def _rounded(r: TensorRecord) -> tuple[str, int, int] | None:
    """(format, bits per informative value, informative values) when ``r`` is a wide tensor of 16-bit values."""
    if r.dtype != "float32" or r.stats is None or r.precision not in (Precision.BF16, Precision.FP16):
        return None
    if r.precision is Precision.BF16:
        return "bf16", 16, r.stats.informative_bf16
    return "fp16", 13, r.stats.informative_fp16


def _storage(r: TensorRecord, contract: Contract) -> Finding:
    return finding(
        "precision.low-precision-storage",
        r.name,
        f"{r.name}: parameter stored as {r.dtype}, but the contract expects {contract.master_dtype} masters "
        f"({contract.detail}); the low bits are gone and cannot be recovered by loading into "
        f"{contract.master_dtype}",
        dtype=r.dtype,
        expected=contract.master_dtype,
    )


def judged_params(params: Sequence[TensorRecord], records: Sequence[TensorRecord], view: View) -> list[TensorRecord]:
    """The records the precision checks judge: where the optimizer keeps a parameter's master copy (Megatron's
    ``fp32_param``), that master is the training state, so it takes the place of the model's 16-bit copy.
    Masters in flat buckets (Megatron's distributed optimizer) belong to no one parameter: they are judged
    themselves, in place of every 16-bit model copy."""
    opt = view.optimizer
    if opt is None or not opt.masters:
        return list(params)
    buckets = {ref.name for ref in opt.unattached_masters}
    usable = [r for r in records if r.component == ComponentKind.OPTIMIZER.value
              and (r.role in opt.masters or r.name in buckets)
              and r.precision is not Precision.NOT_FLOAT and r.precision is not Precision.UNREAD]
    by_param = {r.param: r for r in usable if r.param is not None}
    judged = [by_param.get(r.param, r) if r.param is not None else r for r in params]
    bucket_masters = [r for r in usable if r.name in buckets]
    if bucket_masters:
        judged = [r for r in judged if r.dtype not in ("bfloat16", "float16")] + bucket_masters
    return judged


def masters_not_saved(view: View, contract: Contract) -> bool:
    """The deciding record keeps the masters in the optimizer's state (DeepSpeed, Megatron) and the checkpoint
    holds no optimizer: its 16-bit model tensors are compute copies with no master to judge
    (``component.missing`` says the optimizer is absent)."""
    return view.optimizer is None and any(r.in_optimizer and r.where == contract.where and r.master_dtype
                                          for r in view.contract_records)
