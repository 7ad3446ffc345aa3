"""The driver: :func:`interpret` hands the checkpoint to the first whole-checkpoint rule that reads it, else walks
its parts and hands each to the part rules in order (:mod:`ckptaudit.layouts.rules`; the layouts:
:mod:`ckptaudit.layouts`), then lists every tensor with the component it belongs to.

Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from ckptaudit.findings import ComponentKind, safe_str
from ckptaudit.formats.base import Checkpoint, Part, Unreadable, walk
from ckptaudit.formats.contract import load_function
from ckptaudit.formats.io.tensors import TensorData
from ckptaudit.layouts.huggingface import file_rule, layout_name
from ckptaudit.layouts.rules import Context, checkpoint_rules, part_rules
from ckptaudit.layouts.view import (
    DATA_KEYS,
    MODEL_KEYS,
    OPTIMIZER_KEYS,
    RNG_KEYS,
    SCHEDULER_KEYS,
    ModelView,
    TensorRef,
    View,
    leaf_file,
    part_label,
)


def interpret(ckpt: Checkpoint) -> View:
    """Map the parts of ``ckpt`` to checkpoint components (see :mod:`ckptaudit.layouts` for the layouts)."""
    for whole in checkpoint_rules():
        if whole.applies(ckpt):
            read = load_function(whole.view)(ckpt)
            if read is not None:
                whole_view: View = read
                return whole_view
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
                fqn = ".".join(safe_str(p) for p in path)
                ref = TensorRef(part_label(part, *prefix, fqn), leaf, leaf_file(ckpt, part, leaf))
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

    rules = part_rules()
    for part in ckpt.parts:
        ctx = Context(ckpt, view, found, add_model, file_rule(part.name) if part.name else None)
        for rule in rules:
            if rule.applies(part, ctx) and load_function(rule.read)(part, ctx):
                break

    if model_params:
        view.model = ModelView(model_params, model_where, order_known, model_aliases)
    view.layout = layout_name(ckpt, view)
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
                    (TensorRef(part_label(part, *path), leaf, leaf_file(ckpt, part, leaf)), comp(path))
                )
    return view


def _component_of_part(part: Part, view: View) -> Any:
    rule = file_rule(part.name) if part.name else None

    def comp(path: tuple[Any, ...]) -> str:
        if isinstance(rule, ComponentKind):
            return rule.value
        head = safe_str(path[0]) if path else ""
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

