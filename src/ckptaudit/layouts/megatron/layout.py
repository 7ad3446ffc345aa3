"""Megatron-Core ``torch_dist`` (``metadata.json``, ``common.pt``, DCP keyed by each ShardedTensor's flat key;
optimizer state under ``optimizer.state.<name>.<key>``, the distributed optimizer's under
``optimizer.distributed.dp_group_idx_<g>.*``; see :func:`megatron_view`).

Pure: no I/O.
"""

from __future__ import annotations

import re
from typing import Any

from ckptaudit.findings import ComponentKind, safe_str, text
from ckptaudit.formats.base import Checkpoint, Part, Unreadable, walk
from ckptaudit.formats.io.tensors import TensorData
from ckptaudit.layouts.keyed import clean_groups
from ckptaudit.layouts.precision import megatron_record
from ckptaudit.layouts.view import (
    RNG_KEYS,
    ModelView,
    OptimizerView,
    TensorRef,
    View,
    as_int,
    holds_value,
    leaf_file,
    part_label,
    unreadable_detail,
)

MEGATRON_MASTERS = frozenset({"fp32_param", "param"})
"""Megatron's names for the fp32 master of a parameter: ``fp32_param`` (``Float16OptimizerWithFloat16Params``, the
distributed optimizer's ``fully_sharded_model_space``), ``param`` (its ``fully_reshardable`` and bucket layouts)."""
_MEGATRON_STATE = re.compile(r"^optimizer\.state\.(?P<name>[^./]+)\.(?P<fqn>[^/]+)$")
_MEGATRON_BUCKET = re.compile(
    r"^optimizer\.distributed\.(?P<bucket>dp_group_idx_\d+\.gbuf_idx_\d+\.dtype_.+\.bucket_idx_\d+)\.(?P<name>[^./]+)$")
_SHARD_SUFFIX = re.compile(r"/shard_[\d.]+_[\d.]+$")
"""How Megatron names the DCP item of one rank's ``ShardedObject``: ``<key>/shard_<offset>_<global shape>``."""


def is_megatron(ckpt: Checkpoint) -> bool:
    """A DCP directory with Megatron-Core's ``metadata.json`` (``sharded_backend``) or its ``common.pt``."""
    if ckpt.format != "dcp":
        return False
    for part in ckpt.parts:
        if part.name == "metadata.json" and isinstance(part.tree, dict) and "sharded_backend" in part.tree:
            return True
        if part.name == "common.pt":
            return True
    return False


def megatron_view(ckpt: Checkpoint) -> View:
    """Megatron-Core ``dist_checkpointing`` (``torch_dist``): every ShardedTensor is a DCP item under its flat key
    (``decoder.layers.mlp.linear_fc1.weight``), each rank's ShardedObject an item ``<key>/shard_<o>_<s>``;
    ``common.pt`` holds the rest (``iteration``, ``args``, optimizer ``param_groups``, ``opt_param_scheduler``).

    Optimizer state is recognised by Megatron's key prefixes (``megatron/core/optimizer``):
    ``optimizer.state.<name>.<key>`` (per parameter: ``exp_avg``, ``exp_avg_sq``, and the fp32 master as
    ``fp32_param`` or ``param``), attached to the parameter ``<key>`` by name; and the distributed optimizer's
    ``optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<b>.dtype_<t>.bucket_idx_<k>.<name>`` flat buckets, which
    belong to no one parameter (its masters are judged as buckets).
    """
    view = View(layout="megatron", model=None, optimizer=None)
    common: dict[str, Any] = {}
    common_part: Part | None = None
    dcp_part: Part | None = None
    for part in ckpt.parts:
        if part.name == "common.pt":
            common_part = part
            common = part.tree if isinstance(part.tree, dict) else {}
        elif part.format == "dcp":
            dcp_part = part
        elif part.name in ("manifest.json", "ckptaudit.json") and isinstance(part.tree, dict):
            view.manifest = part.tree

    def found(kind: ComponentKind, where: str, detail: str = "") -> None:
        view.components.setdefault(kind, []).append(where)
        if detail and kind not in view.details:
            view.details[kind] = detail

    params: dict[str, TensorRef] = {}
    state: dict[Any, dict[str, Any]] = {}
    buckets: dict[str, dict[str, Any]] = {}
    others: list[tuple[TensorRef, str]] = []
    dcp_part = dcp_part or Part("", "dcp", None)
    tree = dcp_part.tree if isinstance(dcp_part.tree, dict) else {}
    for key, leaf in tree.items():
        k = safe_str(key)
        is_tensor = isinstance(leaf, TensorData | Unreadable)
        base = _SHARD_SUFFIX.sub("", k)
        head = base.split(".", 1)[0]
        if k.startswith("optimizer."):
            m, b = _MEGATRON_STATE.match(k), _MEGATRON_BUCKET.match(k)
            if is_tensor and m:
                state.setdefault(m["fqn"], {})[m["name"]] = TensorRef(k, leaf, leaf_file(ckpt, dcp_part, leaf))
            elif is_tensor and b:
                ref = TensorRef(k, leaf, leaf_file(ckpt, dcp_part, leaf))
                buckets.setdefault(b["bucket"], {})[b["name"]] = ref
            elif is_tensor:
                others.append((TensorRef(k, leaf, leaf_file(ckpt, dcp_part, leaf)), ComponentKind.OPTIMIZER.value))
            continue
        if head in RNG_KEYS:  # Megatron-LM's rng_state: one ShardedObject per rank
            if holds_value(leaf) and base not in view.components.get(ComponentKind.RNG, []):
                found(ComponentKind.RNG, base, unreadable_detail(base, leaf))
            for path, inner in walk(leaf):
                if isinstance(inner, TensorData | Unreadable):
                    ref = TensorRef(part_label(dcp_part, k, *path), inner, leaf_file(ckpt, dcp_part, inner))
                    others.append((ref, ComponentKind.RNG.value))
            continue
        if is_tensor:
            params[k] = TensorRef(k, leaf, leaf_file(ckpt, dcp_part, leaf))
    if params:
        view.model = ModelView(params, ["(sharded tensors)"], order_known=False)
        found(ComponentKind.MODEL, "(sharded tensors)")

    # common.pt: the step, the optimizer's param groups, the scheduler, and the args' precision (the contract).
    record = megatron_record(common.get("args"), "common.pt/args")
    if record is not None:
        view.contract_records.append(record)
    iteration = common.get("iteration")
    view.step = as_int(iteration)
    common_opt = common.get("optimizer")
    groups_tree = common_opt.get("optimizer", common_opt) if isinstance(common_opt, dict) else None
    groups = clean_groups(groups_tree.get("param_groups")) if isinstance(groups_tree, dict) else []
    if state or buckets or groups:
        where = "optimizer.state" if state else "optimizer.distributed" if buckets else "common.pt/optimizer"
        masters = [ref for entry in buckets.values() for n, ref in entry.items() if n in MEGATRON_MASTERS]
        # Megatron saves no parameter list in its groups (Megatron restores it from the model): attach by name.
        view.optimizer = OptimizerView(where, "fqn", state, [{**g, "params": []} for g in groups],
                                       masters=MEGATRON_MASTERS, unattached_masters=masters)
        found(ComponentKind.OPTIMIZER, where)
    for entry in buckets.values():
        for ref in entry.values():
            others.append((ref, ComponentKind.OPTIMIZER.value))
    if holds_value(common.get("opt_param_scheduler")):
        found(ComponentKind.SCHEDULER, "common.pt/opt_param_scheduler")
    if view.step is not None:
        found(ComponentKind.DATA_PROGRESS, "common.pt/iteration", _megatron_data_detail(common))
    if common_part is not None and holds_value(common.get("rng_state")):
        found(ComponentKind.RNG, "common.pt/rng_state")

    for ref in params.values():
        view.tensors.append((ref, ComponentKind.MODEL.value))
    seen = {id(ref.data) for ref in params.values()}
    for entry in state.values():
        for ref in entry.values():
            view.tensors.append((ref, ComponentKind.OPTIMIZER.value))
            seen.add(id(ref.data))
    for ref, comp in others:
        view.tensors.append((ref, comp))
        seen.add(id(ref.data))
    for part in ckpt.parts:
        if part.tree is None:
            continue
        for path, leaf in walk(part.tree):
            if isinstance(leaf, TensorData | Unreadable) and id(leaf) not in seen:
                seen.add(id(leaf))
                view.tensors.append((TensorRef(part_label(part, *path), leaf, leaf_file(ckpt, part, leaf)), "other"))
    return view


def _megatron_data_detail(common: dict[str, Any]) -> str:
    """Megatron-LM resumes its data sampler from ``args.consumed_train_samples``, not from a loader state."""
    args = common.get("args")
    values = args if isinstance(args, dict) else getattr(args, "state", None) or getattr(args, "__dict__", {})
    consumed = values.get("consumed_train_samples") if isinstance(values, dict) else None
    it = common.get("iteration")
    if isinstance(consumed, int) and not isinstance(consumed, bool):
        return (f"Megatron iteration {text(it)}, args.consumed_train_samples {text(consumed)} (the sampler skips "
                "the consumed samples)")
    return (f"step counter only (iteration {text(it)}); no data-loader position (args.consumed_train_samples not "
            "saved)")


def view_if_megatron(ckpt: Checkpoint) -> View | None:
    """The Megatron rule (:mod:`ckptaudit.layouts.rules`): the checkpoint's view, or ``None`` when it is not
    Megatron-Core's after all."""
    return megatron_view(ckpt) if is_megatron(ckpt) else None
