"""Layouts read by their dict keys: plain dicts and bare state dicts, ``torch.distributed.checkpoint`` with
``get_state_dict`` and ckptaudit's writer, torchtitan (model FQNs at the top level, a flattened optimizer,
``dataloader``/``train_state``), and Lightning ``.ckpt`` (``state_dict``, ``optimizer_states``, ``loops``).

Pure: no I/O.
"""

from __future__ import annotations

import re
from typing import Any

from ckptaudit.findings import ComponentKind, safe_str, text
from ckptaudit.formats.base import Checkpoint, Part, Unreadable
from ckptaudit.formats.io.tensors import TensorData
from ckptaudit.layouts.precision import LIGHTNING_SCALER_KEYS, scaler_record
from ckptaudit.layouts.rules import Context, PartRule, register_rule
from ckptaudit.layouts.view import (
    DATA_KEYS,
    MODEL_KEYS,
    OPTIMIZER_KEYS,
    RNG_KEYS,
    SCHEDULER_KEYS,
    STEP_KEYS,
    OptimizerView,
    TensorRef,
    View,
    find_step,
    holds_value,
    is_state_dict,
    is_step_key,
    leaf_file,
    part_label,
    unreadable_detail,
)


def classify_keys(part: Part, tree: dict[str, Any], view: View, found: Any, add_model: Any,
                   ckpt: Checkpoint) -> bool:
    matched = False
    top_tensors = {k: v for k, v in tree.items() if isinstance(v, TensorData | Unreadable)}
    for key, value in tree.items():
        k = safe_str(key)
        where = part_label(part, k)
        if k in MODEL_KEYS and isinstance(value, dict):
            add_model(part, value, where, (k,))
            matched = True
        elif k in OPTIMIZER_KEYS:
            matched = True
            opt = optimizer_view(part, value, where, ckpt)
            if opt is not None:
                if view.optimizer is None:
                    view.optimizer = opt
                found(ComponentKind.OPTIMIZER, where)
        elif k in SCHEDULER_KEYS:
            matched = True
            if holds_value(value):
                found(ComponentKind.SCHEDULER, where, unreadable_detail(where, value))
        elif k in RNG_KEYS:
            matched = True
            if holds_value(value):
                found(ComponentKind.RNG, where, unreadable_detail(where, value))
        elif k in DATA_KEYS:
            matched = True
            if holds_value(value):
                found(ComponentKind.DATA_PROGRESS, where)
        elif k in STEP_KEYS or is_step_key(k) or (isinstance(value, dict) and find_step({k: value})):
            matched = True
            found(ComponentKind.DATA_PROGRESS, where)
        elif k in LIGHTNING_SCALER_KEYS:
            record = scaler_record(value, where)
            if record is not None:
                view.contract_records.append(record)
    step = find_step(tree)
    step_key = step[0] if step is not None else None
    if step is not None and view.step is None:
        view.step = step[1]
    detail = _data_detail(tree, step_key)
    if detail and (ComponentKind.DATA_PROGRESS not in view.details
                   or view.details[ComponentKind.DATA_PROGRESS].startswith("step counter only")):
        view.details[ComponentKind.DATA_PROGRESS] = detail
    if matched and top_tensors and len(top_tensors) >= 1 and not any(
        safe_str(k) in MODEL_KEYS for k in tree
    ):
        # torchtitan: model FQNs at the top level beside optimizer/lr_scheduler/...
        add_model(part, top_tensors, part_label(part) + " (top-level keys)", ())
    return matched



def _data_detail(tree: dict[str, Any], step_key: str | None) -> str:
    """What the data-progress state of one top-level dict can restore, in a sentence for the inventory."""
    loops = tree.get("loops")
    if isinstance(loops, dict) and "fit_loop" in loops:
        fit = loops.get("fit_loop")
        fit_state = fit.get("state_dict") if isinstance(fit, dict) else None
        where = f"epoch {text(tree.get('epoch'))}, global step {text(tree.get('global_step'))}"
        if isinstance(fit_state, dict) and holds_value(fit_state.get("combined_loader")):
            return f"Lightning loop progress ({where}) with data-loader state (loops/fit_loop/state_dict/combined_loader)"
        return (f"Lightning loop progress ({where}); no data-loader state (Lightning saves it only for stateful "
                "data loaders), so a mid-epoch resume restarts the epoch's data")
    loader = tree.get("dataloader")
    if isinstance(loader, dict) and loader:
        ranks = sorted(safe_str(k)[len("dp_rank_"):] for k in loader if safe_str(k).startswith("dp_rank_"))
        if ranks:
            world = loader.get("world_size")
            lost = [r for r in ranks if isinstance(loader.get(f"dp_rank_{r}"), Unreadable)]
            return (f"torchtitan data-loader state for dp rank(s) {', '.join(ranks)}"
                    + (f" of world size {world}" if isinstance(world, int) else "")
                    + (f"; rank(s) {', '.join(lost)} unreadable (see the integrity findings)" if lost else ""))
    present = [k for k in tree if k in DATA_KEYS and holds_value(tree[k])]
    if present:
        return f"data-loader / loop state ({', '.join(map(str, present))})"
    if step_key is not None or any(k in tree for k in STEP_KEYS):
        return f"step counter only ({step_key or next(k for k in tree if k in STEP_KEYS)}); no data-loader position"
    return ""



_TITAN_STATE = re.compile(r"^state\.(?P<fqn>.+)\.(?P<name>[^.]+)$")
_TITAN_GROUP = re.compile(r"^param_groups\.(?P<fqn>.+)\.(?P<name>[^.]+)$")


def optimizer_view(part: Part, tree: Any, where: str, ckpt: Checkpoint) -> OptimizerView | None:
    count = 1
    if isinstance(tree, list):  # Lightning: optimizer_states is a list, one per optimizer
        count = len(tree)
        if not tree:
            return None
        tree = tree[0]
        where = where + "/0"
    if not isinstance(tree, dict):
        return None

    def ref(path: tuple[Any, ...], leaf: Any) -> Any:
        if isinstance(leaf, TensorData | Unreadable):
            return TensorRef(part_label(part, *where_keys, *path), leaf, leaf_file(ckpt, part, leaf))
        return leaf

    where_keys = tuple(where.split("/")[1:]) if part.name else tuple(where.split("/"))
    if where == "(root)" or where == part.name:
        where_keys = ()
    if "state" in tree:
        raw_state = tree.get("state")
        groups = clean_groups(tree.get("param_groups"))
        state: dict[Any, dict[str, Any]] = {}
        items: list[tuple[Any, Any]]
        if isinstance(raw_state, dict):
            items = list(raw_state.items())
        elif isinstance(raw_state, list):
            items = list(enumerate(raw_state))
        else:
            items = []
        for key, entry in items:
            if isinstance(entry, dict):
                key = key if isinstance(key, str | int) else safe_str(key)  # state is keyed by FQN or index
                state[key] = {safe_str(n): ref(("state", key, n), v) for n, v in entry.items()}
        keyed = "index" if any(isinstance(k, int) for k in state) else "fqn"
        if not state and groups:
            params = [p for g in groups for p in g["params"]]
            keyed = "index" if any(isinstance(p, int) for p in params) else "fqn"
        return OptimizerView(where, keyed, state, groups, count)
    # torchtitan flattened optimizer: state.<fqn>.<name>, param_groups.<fqn>.<key>
    flat_state: dict[Any, dict[str, Any]] = {}
    group_params: list[str] = []
    for key, value in tree.items():
        m = _TITAN_STATE.match(safe_str(key))
        if m:
            flat_state.setdefault(m["fqn"], {})[m["name"]] = ref((key,), value)
            continue
        g = _TITAN_GROUP.match(safe_str(key))
        if g and g["fqn"] not in group_params:
            group_params.append(g["fqn"])
    if flat_state or group_params:
        return OptimizerView(where, "fqn", flat_state, [{"params": group_params}] if group_params else [], count)
    return None


def clean_groups(raw: Any) -> list[dict[str, Any]]:
    """``param_groups`` as real optimizers save them: dicts whose ``params`` list holds ints or FQN strings.

    Anything else a (damaged or hostile) file puts there is dropped, so the checks never meet unhashable keys.
    """
    if not isinstance(raw, list):
        return []
    groups = []
    for g in raw:
        if not isinstance(g, dict):
            continue
        ps = g.get("params")
        ps = [p for p in ps if isinstance(p, int | str) and not isinstance(p, bool)] if isinstance(ps, list) else []
        groups.append({**g, "params": ps})
    return groups


def read_keyed_part(part: Part, ctx: Context) -> bool:
    """The keyed rule (:mod:`ckptaudit.layouts.rules`), last: a dict part read by its keys, or, where no key is
    known, as a bare state dict when it is one."""
    tree = part.tree
    assert isinstance(tree, dict)  # the rule applies to dicts only
    matched = classify_keys(part, tree, ctx.view, ctx.found, ctx.add_model, ctx.ckpt)
    if not matched and is_state_dict(tree):
        ctx.add_model(part, {k: v for k, v in tree.items() if isinstance(v, TensorData | Unreadable)},
                      part_label(part), ())
    return True


# Last of the part rules: whatever dict no rule before took (plain dicts, DCP/get_state_dict, torchtitan, Lightning).
register_rule(PartRule("keyed", order=90, applies=lambda part, ctx: isinstance(part.tree, dict),
                  read="ckptaudit.layouts.keyed:read_keyed_part"))
