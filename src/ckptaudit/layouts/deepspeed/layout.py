"""DeepSpeed ``global_stepN/`` and its root (read by :mod:`ckptaudit.formats.deepspeed.reader`): the fp32 masters
rebuilt from the ZeRO partitions are the model's parameters, the bf16/fp16 ``module`` weights their compute
copies, the moments keyed by parameter name, ``lr_scheduler``, ``client_state`` and ``global_steps``.

Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from ckptaudit.findings import ComponentKind, safe_str, text
from ckptaudit.formats.base import Checkpoint, Part, Unreadable
from ckptaudit.formats.io.tensors import TensorData
from ckptaudit.layouts.keyed import optimizer_view
from ckptaudit.layouts.precision import deepspeed_record
from ckptaudit.layouts.rules import Context
from ckptaudit.layouts.view import DATA_KEYS, RNG_KEYS, STEP_KEYS, View, as_int, is_step_key, part_label


def deepspeed_view(part: Part, tree: dict[str, Any], view: View, found: Any, add_model: Any, ckpt: Checkpoint) -> None:
    """DeepSpeed (:mod:`ckptaudit.formats.deepspeed.reader`): the fp32 masters are the model's parameters, the bf16/fp16
    module weights their compute copies; moments keyed by parameter name; scheduler, client_state and DeepSpeed's
    own step counters for the rest of the inventory."""
    facts: dict[str, Any] = tree["deepspeed"] if isinstance(tree.get("deepspeed"), dict) else {}
    stage, dtype = facts.get("zero_stage"), facts.get("dtype", "?")
    record = deepspeed_record(facts.get("ds_config"), str(facts.get("ds_config_where", part_label(part, "ds_config"))))
    if record is not None:
        view.contract_records.append(record)
    masters: dict[Any, Any] = tree["fp32_masters"] if isinstance(tree.get("fp32_masters"), dict) else {}
    if masters:
        add_model(part, masters, f"{facts.get('masters_where', part_label(part, 'fp32_masters'))}: fp32 masters "
                  f"(ZeRO stage {stage}, {dtype} engine)", ("fp32_masters",))
    for key in ("buffers", "frozen"):
        extra = tree.get(key)
        if isinstance(extra, dict) and extra:
            add_model(part, extra, part_label(part, "module") + f" ({key})", ("module",))
            if key == "buffers":
                view.roles.update((id(leaf), ("buffer", fqn)) for fqn, leaf in extra.items())
    module: dict[Any, Any] = tree["module"] if isinstance(tree.get("module"), dict) else {}
    copies = [(fqn, leaf) for fqn, leaf in module.items() if isinstance(leaf, TensorData | Unreadable)]
    if copies and not masters:
        # The masters are gone or not read (a finding says which): the compute copies are all the model there is.
        unread = bool(facts.get("masters_unread"))
        found(ComponentKind.MODEL, part_label(part, "module"), f"{dtype} compute copies only; the fp32 masters are "
              + ("present but not read" if unread else "missing"))
        if unread:
            found(ComponentKind.OPTIMIZER, part_label(part, "optimizer"), "present, layout not read (not judged)")
    for fqn, leaf in copies:
        view.roles[id(leaf)] = ("compute-copy", fqn)
    opt_tree = tree.get("optimizer")
    if isinstance(opt_tree, dict):
        opt = optimizer_view(part, opt_tree, part_label(part, "optimizer"), ckpt)
        if opt is not None:
            view.optimizer = view.optimizer or opt
            found(ComponentKind.OPTIMIZER, facts.get("masters_where", opt.where),
                  "fp32 masters and moments in the flat partitions, keyed here by parameter name")
    sched = tree.get("lr_scheduler")
    if sched not in (None, [], {}):
        found(ComponentKind.SCHEDULER, part_label(part, "lr_scheduler"), "DeepSpeed lr_scheduler state")
    client: dict[Any, Any] = tree["client_state"] if isinstance(tree.get("client_state"), dict) else {}
    for key in client:
        k = safe_str(key)
        if k in RNG_KEYS and client[key] not in (None, [], {}):
            found(ComponentKind.RNG, part_label(part, "client_state", k))
    data_keys = [safe_str(k) for k in client if safe_str(k) in DATA_KEYS or safe_str(k) in STEP_KEYS or is_step_key(k)]
    steps = as_int(facts.get("global_steps"))
    view.step = steps if view.step is None else view.step
    if facts.get("data_sampler"):
        found(ComponentKind.DATA_PROGRESS, part_label(part, "data_sampler"), "DeepSpeed data_sampler state")
    elif data_keys:
        found(ComponentKind.DATA_PROGRESS, part_label(part, "client_state"),
              f"client_state ({', '.join(data_keys)}), global_steps {text(steps)}")
    elif steps is not None:
        found(ComponentKind.DATA_PROGRESS, part_label(part, "global_steps"),
              f"step counter only (global_steps {text(steps)}, global_samples {text(facts.get('global_samples'))}); "
              "no "
              "data-loader position: DeepSpeed saves its data_sampler only for its own data-efficiency sampler; "
              "save the loader's state in client_state" + (f" (client_state holds {', '.join(map(str, client))})"
                                                            if client else ""))



def read_deepspeed_part(part: Part, ctx: Context) -> bool:
    """The DeepSpeed rule (:mod:`ckptaudit.layouts.rules`): the part :mod:`ckptaudit.formats.deepspeed.reader` built,
    taken whole."""
    deepspeed_view(part, part.tree, ctx.view, ctx.found, ctx.add_model, ctx.ckpt)
    return True
