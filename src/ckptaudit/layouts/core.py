"""The driver: :func:`interpret` walks a checkpoint's parts and hands each to the library rule that reads it
(see :mod:`ckptaudit.layouts` for the layouts).

Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from ckptaudit.formats.base import Checkpoint, Part, Unreadable, walk
from ckptaudit.formats.tensors import TensorData
from ckptaudit.layouts.huggingface import _layout_name, file_rule
from ckptaudit.layouts.keyed import _classify_keys, _optimizer_view
from ckptaudit.layouts.precision import scaler_record, training_args_record
from ckptaudit.layouts.view import (
    DATA_KEYS,
    MODEL_KEYS,
    OPTIMIZER_KEYS,
    RNG_KEYS,
    SCHEDULER_KEYS,
    ModelView,
    TensorRef,
    View,
    _as_int,
    _is_state_dict,
    _label,
    _leaf_file,
)
from ckptaudit.model import ComponentKind


def interpret(ckpt: Checkpoint) -> View:
    """Map the parts of ``ckpt`` to checkpoint components (see :mod:`ckptaudit.layouts` for the layouts)."""
    # The Megatron rule (and the DeepSpeed one below) is imported only where it may apply: a DCP directory with
    # Megatron-Core's metadata.json or common.pt (what _is_megatron looks for).
    if ckpt.format == "dcp" and any(p.name in ("metadata.json", "common.pt") for p in ckpt.parts):
        from ckptaudit.layouts.megatron import _is_megatron, _megatron

        if _is_megatron(ckpt):
            return _megatron(ckpt)
    view = View(layout=ckpt.format, model=None, optimizer=None)
    model_params: dict[str, TensorRef] = {}
    model_aliases: dict[str, str] = {}
    first_name: dict[TensorData, str] = {}
    model_where: list[str] = []
    order_known = True
    seen_tensors: set[int] = set()

    def found(kind: ComponentKind, where: str, detail: str = "") -> None:
        view.components.setdefault(kind, []).append(where)
        if detail and kind not in view.details:
            view.details[kind] = detail

    def add_model(part: Part, tree: dict[str, Any], where: str, prefix: tuple[Any, ...]) -> None:
        nonlocal order_known
        for path, leaf in walk(tree):
            if isinstance(leaf, TensorData | Unreadable):
                fqn = ".".join(str(p) for p in path)
                ref = TensorRef(_label(part, *prefix, fqn), leaf, _leaf_file(ckpt, part, leaf))
                model_params[fqn] = ref
                seen_tensors.add(id(leaf))
                if isinstance(leaf, TensorData) and leaf.numel > 0:
                    # Equal descriptions mean the same bytes: a tied weight saved under a second name.
                    original = first_name.setdefault(leaf, fqn)
                    if original != fqn:
                        model_aliases[fqn] = original
        model_where.append(where)
        order_known = order_known and part.order_known
        found(ComponentKind.MODEL, where)

    for part in ckpt.parts:
        rule = file_rule(part.name) if part.name else None
        tree = part.tree
        if rule == "ignore":
            continue
        if rule in ("training-args", "scaler"):
            read = training_args_record if rule == "training-args" else scaler_record
            record = read(tree, part.name)
            if record is not None:
                view.contract_records.append(record)
            continue
        if rule == "manifest":
            if isinstance(tree, dict):
                view.manifest = tree
            continue
        if rule == "index":
            if isinstance(tree, dict):
                view.indexes.append((part.name, tree))
                found(ComponentKind.MODEL, part.name)
            continue
        if part.format == "safetensors":
            view.metadata.update(part.metadata)
        if part.format == "deepspeed" and isinstance(tree, dict):
            from ckptaudit.layouts.deepspeed import _deepspeed

            _deepspeed(part, tree, view, found, add_model, ckpt)
            continue
        if isinstance(rule, ComponentKind) and rule is not ComponentKind.MODEL:
            where = part.name
            if rule is ComponentKind.OPTIMIZER:
                if tree is not None:
                    opt = _optimizer_view(part, tree, where, ckpt)
                    if opt is not None and view.optimizer is None:
                        view.optimizer = opt
                found(rule, where)
            elif rule is ComponentKind.DATA_PROGRESS and part.name.endswith("trainer_state.json"):
                if isinstance(tree, dict) and "global_step" in tree:
                    view.step = _as_int(tree.get("global_step"))
                found(rule, where, "Trainer global_step/epoch (the sampler is re-seeded and skipped forward)")
            else:
                found(rule, where)
            continue
        if tree is None:
            continue
        if not isinstance(tree, dict):
            continue
        matched = _classify_keys(part, tree, view, found, add_model, ckpt)
        if not matched and _is_state_dict(tree):
            add_model(part, {k: v for k, v in tree.items() if isinstance(v, TensorData | Unreadable)},
                      _label(part), ())

    if model_params:
        view.model = ModelView(model_params, model_where, order_known, model_aliases)
    view.layout = _layout_name(ckpt, view)
    # Every tensor, model first, each labelled with the component it belongs to.
    for ref in model_params.values():
        view.tensors.append((ref, ComponentKind.MODEL.value))
    if view.optimizer is not None:
        for entry in view.optimizer.state.values():
            for value in entry.values():
                if isinstance(value, TensorRef):
                    seen_tensors.add(id(value.data))
                    view.tensors.append((value, ComponentKind.OPTIMIZER.value))
    for part in ckpt.parts:
        if part.tree is None:
            continue
        comp = _component_of_part(part, view)
        for path, leaf in walk(part.tree):
            if isinstance(leaf, TensorData | Unreadable) and id(leaf) not in seen_tensors:
                seen_tensors.add(id(leaf))
                view.tensors.append(
                    (TensorRef(_label(part, *path), leaf, _leaf_file(ckpt, part, leaf)), comp(path))
                )
    return view


def _component_of_part(part: Part, view: View) -> Any:
    rule = file_rule(part.name) if part.name else None

    def comp(path: tuple[Any, ...]) -> str:
        if isinstance(rule, ComponentKind):
            return rule.value
        head = str(path[0]) if path else ""
        for keys, kind in (
            (SCHEDULER_KEYS, ComponentKind.SCHEDULER),
            (RNG_KEYS, ComponentKind.RNG),
            (DATA_KEYS, ComponentKind.DATA_PROGRESS),
            (OPTIMIZER_KEYS, ComponentKind.OPTIMIZER),
            (MODEL_KEYS, ComponentKind.MODEL),
        ):
            if head in keys:
                return kind.value
        return "other"

    return comp

