"""Interpret a checkpoint's parts: which tensors are the model, which the optimizer, where the rest lives.

Readers say *what is in the files*; this module says *what it means*, for the layouts real tools write:

- ``torch.distributed.checkpoint`` with ``get_state_dict`` (``model``, ``optim``/``optimizer`` FQN-keyed),
  and ckptaudit's own writer;
- torchtitan (model FQNs at the top level, ``optimizer`` flattened to ``state.<fqn>.<name>`` and
  ``param_groups.<fqn>.<key>``, ``lr_scheduler``, ``dataloader``, ``train_state``);
- Hugging Face Trainer ``checkpoint-N/`` (``model.safetensors`` or ``pytorch_model.bin``, sharded with an
  index or not; ``optimizer.pt``; ``scheduler.pt``; ``rng_state*.pth``; ``trainer_state.json``);
- Accelerate ``save_state`` (``model*.safetensors``/``pytorch_model*.bin``, ``optimizer*.bin``,
  ``scheduler*.bin``, ``random_states_*.pkl``, ``sampler*.bin``/``dl_state_dict*.bin``);
- Lightning ``.ckpt`` (``state_dict``, ``optimizer_states``, ``lr_schedulers``, ``loops``, ``global_step``);
- Megatron-Core ``torch_dist`` (``metadata.json``, ``common.pt``, DCP keyed by each ShardedTensor's flat key;
  optimizer state under ``optimizer.state.<name>.<key>``, the distributed optimizer's under
  ``optimizer.distributed.dp_group_idx_<g>.*``; see :func:`_megatron`);
- DeepSpeed ``global_stepN/`` and its root (read by :mod:`ckptaudit.formats.deepspeed`): the fp32 masters
  rebuilt from the ZeRO partitions are the model's parameters, the bf16/fp16 ``module`` weights their compute
  copies, the moments keyed by parameter name, ``lr_scheduler``, ``client_state`` and ``global_steps``;
- plain dicts (``model``/``state_dict``/``module``, ``optimizer``/``optim``, ``scheduler``/``lr_scheduler``,
  ``rng``/``rng_state``, ``step``/``train_state``/``data``/``dataloader``) and bare state dicts.

Pure: no I/O beyond what the parts already describe.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ckptaudit.formats.base import Checkpoint, Part, Unreadable, walk
from ckptaudit.formats.tensors import TensorData
from ckptaudit.model import ComponentKind, text

__all__ = ["ModelView", "OptimizerView", "TensorRef", "View", "interpret", "normalize_fqn"]

MODEL_KEYS = ("model", "state_dict", "module", "model_state_dict", "model_state", "net", "network")
OPTIMIZER_KEYS = ("optimizer", "optim", "optimizer_states", "optimizer_state_dict", "optimizer_state", "opt")
SCHEDULER_KEYS = ("scheduler", "lr_scheduler", "lr_schedulers", "scheduler_state_dict", "lr_scheduler_state_dict",
                  "schedulers")
RNG_KEYS = ("rng", "rng_state", "rng_states", "random_state", "random_states", "rng_tracker")
DATA_KEYS = ("data", "dataloader", "data_loader", "dataloaders", "loops", "sampler", "data_progress",
             "dataloader_state", "data_state")
STEP_KEYS = ("step", "global_step", "train_state", "iteration", "iter_num", "epoch")
_STEP_PRIORITY = ("global_step", "step", "train_state", "iteration", "iter_num")
"""Keys that hold the optimizer-step counter, best first; ``epoch`` counts epochs, never steps."""

_FILE_RULES: tuple[tuple[str, ComponentKind | str], ...] = (
    ("optimizer*.pt", ComponentKind.OPTIMIZER),
    ("optimizer*.bin", ComponentKind.OPTIMIZER),
    ("optimizer*.pth", ComponentKind.OPTIMIZER),
    ("scheduler*.pt", ComponentKind.SCHEDULER),
    ("scheduler*.bin", ComponentKind.SCHEDULER),
    ("lr_scheduler*.pt", ComponentKind.SCHEDULER),
    ("rng_state*.pth", ComponentKind.RNG),
    ("random_states_*.pkl", ComponentKind.RNG),
    ("sampler*.bin", ComponentKind.DATA_PROGRESS),
    ("dl_state_dict*.bin", ComponentKind.DATA_PROGRESS),
    ("trainer_state.json", ComponentKind.DATA_PROGRESS),
    ("training_args.bin", "ignore"),
    ("*.index.json", "index"),
    ("manifest.json", "manifest"),
    ("ckptaudit.json", "manifest"),
    ("*.json", "ignore"),
)

_INNER_WRAPPERS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
_OUTER_WRAPPERS = ("module.", "_orig_mod.", "_forward_module.")


def normalize_fqn(fqn: str) -> str:
    """A parameter's name without wrapper segments, so names from differently wrapped models meet.

    FSDP1 and activation-checkpoint wrappers insert ``_fsdp_wrapped_module`` / ``_checkpoint_wrapped_module``
    segments anywhere; DDP (``module.``), ``torch.compile`` (``_orig_mod.``) and Lightning
    (``_forward_module.``) prefix the whole name. Only leading occurrences of the latter are stripped, so a
    submodule a user named ``module`` keeps its name.
    """
    name = ".".join(p for p in fqn.split(".") if p not in _INNER_WRAPPERS)
    stripped = True
    while stripped:
        stripped = False
        for prefix in _OUTER_WRAPPERS:
            if name.startswith(prefix):
                name, stripped = name[len(prefix):], True
    return name


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor leaf with a readable name and the file it lives in."""

    name: str
    data: TensorData | Unreadable
    file: str


@dataclass
class ModelView:
    params: dict[str, TensorRef]
    """Model tensors by FQN, in the order the writer saw them (when ``order_known``)."""
    where: list[str]
    order_known: bool
    aliases: dict[str, str] = field(default_factory=dict)
    """Tied weights: a later FQN -> the first FQN whose stored bytes it shares (``torch.save`` stores a shared
    tensor once, e.g. ``lm_head.weight`` tied to the token embedding). ``named_parameters()`` yields such a
    parameter once, under its first name."""


@dataclass
class OptimizerView:
    where: str
    keyed: str
    """``fqn`` or ``index``."""
    state: dict[Any, dict[str, Any]]
    """Parameter key (FQN or int) -> state name -> :class:`TensorRef` or plain value."""
    groups: list[dict[str, Any]]
    """``param_groups``, each with a ``params`` list of FQNs or ints whatever the file held (see
    :func:`_clean_groups`), and ``param_names`` if saved."""
    count: int = 1
    """How many optimizers the checkpoint holds (only the first is checked)."""
    masters: frozenset[str] = frozenset()
    """State names that hold the parameter's full-precision master copy (Megatron: ``fp32_param``, ``param``):
    the master, not the model's 16-bit copy, is the training state held to the contract."""
    unattached_masters: list[TensorRef] = field(default_factory=list)
    """Masters that belong to no one parameter (the distributed optimizer's flat buckets)."""


@dataclass
class View:
    layout: str
    model: ModelView | None
    optimizer: OptimizerView | None
    components: dict[ComponentKind, list[str]] = field(default_factory=dict)
    details: dict[ComponentKind, str] = field(default_factory=dict)
    tensors: list[tuple[TensorRef, str]] = field(default_factory=list)
    """Every tensor with its component label (model tensors first)."""
    step: int | None = None
    indexes: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    """Hugging Face ``*.index.json`` files: (name, parsed)."""
    manifest: dict[str, Any] | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    """Format metadata of the model files (safetensors ``__metadata__``), merged."""
    roles: dict[int, tuple[str, str | None]] = field(default_factory=dict)
    """``id(tensor data)`` -> (role, parameter) where the layout knows better than the model/optimizer split:
    DeepSpeed's bf16 module weights are ``compute-copy`` records of the parameter whose master is audited."""


def file_rule(name: str) -> ComponentKind | str | None:
    """What a file of a checkpoint directory holds, by its name: a component, ``index``, ``manifest``, ``ignore``."""
    base = os.path.basename(name)
    for pattern, kind in _FILE_RULES:
        if fnmatch.fnmatch(base, pattern):
            return kind
    return None


def _label(part: Part, *keys: Any) -> str:
    bits = [part.name] if part.name else []
    bits += [str(k) for k in keys]
    return "/".join(bits) if bits else "(root)"


def _is_state_dict(tree: Any) -> bool:
    """A flat mapping whose values are mostly tensors: a model state dict."""
    if not isinstance(tree, dict) or not tree:
        return False
    tensors = sum(isinstance(v, TensorData | Unreadable) for v in tree.values())
    return tensors > 0 and tensors >= len(tree) / 2


def interpret(ckpt: Checkpoint) -> View:
    """Map the parts of ``ckpt`` to checkpoint components (see the module docstring for the layouts)."""
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


def _deepspeed(part: Part, tree: dict[str, Any], view: View, found: Any, add_model: Any, ckpt: Checkpoint) -> None:
    """DeepSpeed (:mod:`ckptaudit.formats.deepspeed`): the fp32 masters are the model's parameters, the bf16/fp16
    module weights their compute copies; moments keyed by parameter name; scheduler, client_state and DeepSpeed's
    own step counters for the rest of the inventory."""
    facts: dict[str, Any] = tree["deepspeed"] if isinstance(tree.get("deepspeed"), dict) else {}
    stage, dtype = facts.get("zero_stage"), facts.get("dtype", "?")
    masters: dict[Any, Any] = tree["fp32_masters"] if isinstance(tree.get("fp32_masters"), dict) else {}
    if masters:
        add_model(part, masters, f"{facts.get('masters_where', _label(part, 'fp32_masters'))}: fp32 masters "
                  f"(ZeRO stage {stage}, {dtype} engine)", ("fp32_masters",))
    for key in ("buffers", "frozen"):
        extra = tree.get(key)
        if isinstance(extra, dict) and extra:
            add_model(part, extra, _label(part, "module") + f" ({key})", ("module",))
            if key == "buffers":
                view.roles.update((id(leaf), ("buffer", fqn)) for fqn, leaf in extra.items())
    module: dict[Any, Any] = tree["module"] if isinstance(tree.get("module"), dict) else {}
    copies = [(fqn, leaf) for fqn, leaf in module.items() if isinstance(leaf, TensorData | Unreadable)]
    if copies and not masters:
        # The masters are gone or not read (a finding says which): the compute copies are all the model there is.
        unread = bool(facts.get("masters_unread"))
        found(ComponentKind.MODEL, _label(part, "module"), f"{dtype} compute copies only; the fp32 masters are "
              + ("present but not read" if unread else "missing"))
        if unread:
            found(ComponentKind.OPTIMIZER, _label(part, "optimizer"), "present, layout not read (not judged)")
    for fqn, leaf in copies:
        view.roles[id(leaf)] = ("compute-copy", fqn)
    opt_tree = tree.get("optimizer")
    if isinstance(opt_tree, dict):
        opt = _optimizer_view(part, opt_tree, _label(part, "optimizer"), ckpt)
        if opt is not None:
            view.optimizer = view.optimizer or opt
            found(ComponentKind.OPTIMIZER, facts.get("masters_where", opt.where),
                  "fp32 masters and moments in the flat partitions, keyed here by parameter name")
    sched = tree.get("lr_scheduler")
    if sched not in (None, [], {}):
        found(ComponentKind.SCHEDULER, _label(part, "lr_scheduler"), "DeepSpeed lr_scheduler state")
    client: dict[Any, Any] = tree["client_state"] if isinstance(tree.get("client_state"), dict) else {}
    for key in client:
        k = str(key)
        if k in RNG_KEYS and client[key] not in (None, [], {}):
            found(ComponentKind.RNG, _label(part, "client_state", k))
    data_keys = [str(k) for k in client if str(k) in DATA_KEYS or str(k) in STEP_KEYS]
    steps = _as_int(facts.get("global_steps"))
    view.step = steps if view.step is None else view.step
    if facts.get("data_sampler"):
        found(ComponentKind.DATA_PROGRESS, _label(part, "data_sampler"), "DeepSpeed data_sampler state")
    elif data_keys:
        found(ComponentKind.DATA_PROGRESS, _label(part, "client_state"),
              f"client_state ({', '.join(data_keys)}), global_steps {steps}")
    elif steps is not None:
        found(ComponentKind.DATA_PROGRESS, _label(part, "global_steps"),
              f"step counter only (global_steps {steps}, global_samples {facts.get('global_samples')}); no "
              "data-loader position: DeepSpeed saves its data_sampler only for its own data-efficiency sampler; "
              "save the loader's state in client_state" + (f" (client_state holds {', '.join(map(str, client))})"
                                                            if client else ""))


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


def _leaf_file(ckpt: Checkpoint, part: Part, leaf: Any) -> str:
    if isinstance(leaf, TensorData) and leaf.pieces:
        return os.path.relpath(leaf.pieces[0].file, ckpt.path) if os.path.isdir(ckpt.path) else os.path.basename(
            leaf.pieces[0].file
        )
    if isinstance(leaf, Unreadable) and leaf.file:
        return leaf.file
    return part.name or os.path.basename(ckpt.path)


def _classify_keys(part: Part, tree: dict[str, Any], view: View, found: Any, add_model: Any,
                   ckpt: Checkpoint) -> bool:
    matched = False
    top_tensors = {k: v for k, v in tree.items() if isinstance(v, TensorData | Unreadable)}
    for key, value in tree.items():
        k = str(key)
        where = _label(part, k)
        if k in MODEL_KEYS and isinstance(value, dict):
            add_model(part, value, where, (k,))
            matched = True
        elif k in OPTIMIZER_KEYS:
            matched = True
            opt = _optimizer_view(part, value, where, ckpt)
            if opt is not None:
                if view.optimizer is None:
                    view.optimizer = opt
                found(ComponentKind.OPTIMIZER, where)
        elif k in SCHEDULER_KEYS:
            matched = True
            if _present(value):
                found(ComponentKind.SCHEDULER, where, _unreadable_detail(where, value))
        elif k in RNG_KEYS:
            matched = True
            if _present(value):
                found(ComponentKind.RNG, where, _unreadable_detail(where, value))
        elif k in DATA_KEYS:
            matched = True
            if _present(value):
                found(ComponentKind.DATA_PROGRESS, where)
        elif k in STEP_KEYS:
            matched = True
            found(ComponentKind.DATA_PROGRESS, where)
    step_key = next((k for k in _STEP_PRIORITY if k in tree and _find_step(tree[k]) is not None), None)
    if step_key is not None and view.step is None:
        view.step = _find_step(tree[step_key])
    detail = _data_detail(tree, step_key)
    if detail and (ComponentKind.DATA_PROGRESS not in view.details
                   or view.details[ComponentKind.DATA_PROGRESS].startswith("step counter only")):
        view.details[ComponentKind.DATA_PROGRESS] = detail
    if matched and top_tensors and len(top_tensors) >= 1 and not any(
        str(k) in MODEL_KEYS for k in tree
    ):
        # torchtitan: model FQNs at the top level beside optimizer/lr_scheduler/...
        add_model(part, top_tensors, _label(part) + " (top-level keys)", ())
    return matched


def _unreadable_detail(where: str, value: Any) -> str:
    """A note for a component whose every value is unreadable (e.g. its DCP data file is lost), else ``""``."""
    leaves = [leaf for _, leaf in walk(value)]
    if leaves and all(isinstance(leaf, Unreadable) for leaf in leaves):
        return f"{where} is named, but its data is unreadable (see the integrity findings)"
    return ""


def _data_detail(tree: dict[str, Any], step_key: str | None) -> str:
    """What the data-progress state of one top-level dict can restore, in a sentence for the inventory."""
    loops = tree.get("loops")
    if isinstance(loops, dict) and "fit_loop" in loops:
        fit = loops.get("fit_loop")
        fit_state = fit.get("state_dict") if isinstance(fit, dict) else None
        where = f"epoch {text(tree.get('epoch'))}, global step {text(tree.get('global_step'))}"
        if isinstance(fit_state, dict) and _present(fit_state.get("combined_loader")):
            return f"Lightning loop progress ({where}) with data-loader state (loops/fit_loop/state_dict/combined_loader)"
        return (f"Lightning loop progress ({where}); no data-loader state (Lightning saves it only for stateful "
                "data loaders), so a mid-epoch resume restarts the epoch's data")
    loader = tree.get("dataloader")
    if isinstance(loader, dict) and loader:
        ranks = sorted(str(k)[len("dp_rank_"):] for k in loader if str(k).startswith("dp_rank_"))
        if ranks:
            world = loader.get("world_size")
            lost = [r for r in ranks if isinstance(loader.get(f"dp_rank_{r}"), Unreadable)]
            return (f"torchtitan data-loader state for dp rank(s) {', '.join(ranks)}"
                    + (f" of world size {world}" if isinstance(world, int) else "")
                    + (f"; rank(s) {', '.join(lost)} unreadable (see the integrity findings)" if lost else ""))
    present = [k for k in tree if k in DATA_KEYS and _present(tree[k])]
    if present:
        return f"data-loader / loop state ({', '.join(map(str, present))})"
    if step_key is not None or any(k in tree for k in STEP_KEYS):
        return f"step counter only ({step_key or next(k for k in tree if k in STEP_KEYS)}); no data-loader position"
    return ""


def _find_step(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, dict):
        for k in ("step", "global_step", "iteration"):
            if k in value:
                return _find_step(value[k])
    return None


def _present(value: Any) -> bool:
    """Whether a state value holds something: not ``None`` nor an empty list/dict/tuple/string. Never the value's
    own truth (``bool(numpy_array)`` raises, and a pickle decides what its objects say)."""
    if value is None:
        return False
    if isinstance(value, list | dict | tuple | str | bytes):
        return len(value) > 0
    return True


def _as_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


_TITAN_STATE = re.compile(r"^state\.(?P<fqn>.+)\.(?P<name>[^.]+)$")
_TITAN_GROUP = re.compile(r"^param_groups\.(?P<fqn>.+)\.(?P<name>[^.]+)$")


def _optimizer_view(part: Part, tree: Any, where: str, ckpt: Checkpoint) -> OptimizerView | None:
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
            return TensorRef(_label(part, *where_keys, *path), leaf, _leaf_file(ckpt, part, leaf))
        return leaf

    where_keys = tuple(where.split("/")[1:]) if part.name else tuple(where.split("/"))
    if where == "(root)" or where == part.name:
        where_keys = ()
    if "state" in tree:
        raw_state = tree.get("state")
        groups = _clean_groups(tree.get("param_groups"))
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
                key = key if isinstance(key, str | int) else str(key)  # state is keyed by FQN or index
                state[key] = {str(n): ref(("state", key, n), v) for n, v in entry.items()}
        keyed = "index" if any(isinstance(k, int) for k in state) else "fqn"
        if not state and groups:
            params = [p for g in groups for p in g["params"]]
            keyed = "index" if any(isinstance(p, int) for p in params) else "fqn"
        return OptimizerView(where, keyed, state, groups, count)
    # torchtitan flattened optimizer: state.<fqn>.<name>, param_groups.<fqn>.<key>
    flat_state: dict[Any, dict[str, Any]] = {}
    group_params: list[str] = []
    for key, value in tree.items():
        m = _TITAN_STATE.match(str(key))
        if m:
            flat_state.setdefault(m["fqn"], {})[m["name"]] = ref((key,), value)
            continue
        g = _TITAN_GROUP.match(str(key))
        if g and g["fqn"] not in group_params:
            group_params.append(g["fqn"])
    if flat_state or group_params:
        return OptimizerView(where, "fqn", flat_state, [{"params": group_params}] if group_params else [], count)
    return None


def _clean_groups(raw: Any) -> list[dict[str, Any]]:
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


def _layout_name(ckpt: Checkpoint, view: View) -> str:
    names = {os.path.basename(p.name) for p in ckpt.parts}
    if ckpt.format == "deepspeed":
        return "deepspeed"
    if ckpt.format == "dcp":
        if view.manifest is not None:
            return "ckptaudit"
        if view.model is not None and any("(top-level keys)" in w for w in view.model.where):
            return "torchtitan"
        return "dcp"
    if ckpt.format == "directory":
        if "trainer_state.json" in names or any(n.startswith("rng_state") for n in names):
            return "huggingface-trainer"
        if any(n.startswith("random_states_") for n in names):
            return "accelerate"
        if any(n.endswith(".index.json") for n in names):
            return "huggingface-sharded"
        return "directory"
    for part in ckpt.parts:
        if isinstance(part.tree, dict) and "optimizer_states" in part.tree and "state_dict" in part.tree:
            return "lightning"
    return ckpt.format


# ----------------------------------------------------------------------------------------------------------------
# Megatron-Core torch_dist

MEGATRON_MASTERS = frozenset({"fp32_param", "param"})
"""Megatron's names for the fp32 master of a parameter: ``fp32_param`` (``Float16OptimizerWithFloat16Params``, the
distributed optimizer's ``fully_sharded_model_space``), ``param`` (its ``fully_reshardable`` and bucket layouts)."""
_MEGATRON_STATE = re.compile(r"^optimizer\.state\.(?P<name>[^./]+)\.(?P<fqn>[^/]+)$")
_MEGATRON_BUCKET = re.compile(
    r"^optimizer\.distributed\.(?P<bucket>dp_group_idx_\d+\.gbuf_idx_\d+\.dtype_.+\.bucket_idx_\d+)\.(?P<name>[^./]+)$")
_SHARD_SUFFIX = re.compile(r"/shard_[\d.]+_[\d.]+$")
"""How Megatron names the DCP item of one rank's ``ShardedObject``: ``<key>/shard_<offset>_<global shape>``."""


def _is_megatron(ckpt: Checkpoint) -> bool:
    """A DCP directory with Megatron-Core's ``metadata.json`` (``sharded_backend``) or its ``common.pt``."""
    if ckpt.format != "dcp":
        return False
    for part in ckpt.parts:
        if part.name == "metadata.json" and isinstance(part.tree, dict) and "sharded_backend" in part.tree:
            return True
        if part.name == "common.pt":
            return True
    return False


def _megatron(ckpt: Checkpoint) -> View:
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
        k = str(key)
        is_tensor = isinstance(leaf, TensorData | Unreadable)
        base = _SHARD_SUFFIX.sub("", k)
        head = base.split(".", 1)[0]
        if k.startswith("optimizer."):
            m, b = _MEGATRON_STATE.match(k), _MEGATRON_BUCKET.match(k)
            if is_tensor and m:
                state.setdefault(m["fqn"], {})[m["name"]] = TensorRef(k, leaf, _leaf_file(ckpt, dcp_part, leaf))
            elif is_tensor and b:
                ref = TensorRef(k, leaf, _leaf_file(ckpt, dcp_part, leaf))
                buckets.setdefault(b["bucket"], {})[b["name"]] = ref
            elif is_tensor:
                others.append((TensorRef(k, leaf, _leaf_file(ckpt, dcp_part, leaf)), ComponentKind.OPTIMIZER.value))
            continue
        if head in RNG_KEYS:  # Megatron-LM's rng_state: one ShardedObject per rank
            if _present(leaf) and base not in view.components.get(ComponentKind.RNG, []):
                found(ComponentKind.RNG, base, _unreadable_detail(base, leaf))
            for path, inner in walk(leaf):
                if isinstance(inner, TensorData | Unreadable):
                    ref = TensorRef(_label(dcp_part, k, *path), inner, _leaf_file(ckpt, dcp_part, inner))
                    others.append((ref, ComponentKind.RNG.value))
            continue
        if is_tensor:
            params[k] = TensorRef(k, leaf, _leaf_file(ckpt, dcp_part, leaf))
    if params:
        view.model = ModelView(params, ["(sharded tensors)"], order_known=False)
        found(ComponentKind.MODEL, "(sharded tensors)")

    # common.pt: the step, the optimizer's param groups, the scheduler.
    iteration = common.get("iteration")
    view.step = _as_int(iteration)
    common_opt = common.get("optimizer")
    groups_tree = common_opt.get("optimizer", common_opt) if isinstance(common_opt, dict) else None
    groups = _clean_groups(groups_tree.get("param_groups")) if isinstance(groups_tree, dict) else []
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
    if _present(common.get("opt_param_scheduler")):
        found(ComponentKind.SCHEDULER, "common.pt/opt_param_scheduler")
    if view.step is not None:
        found(ComponentKind.DATA_PROGRESS, "common.pt/iteration", _megatron_data_detail(common))
    if common_part is not None and _present(common.get("rng_state")):
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
                view.tensors.append((TensorRef(_label(part, *path), leaf, _leaf_file(ckpt, part, leaf)), "other"))
    return view


def _megatron_data_detail(common: dict[str, Any]) -> str:
    """Megatron-LM resumes its data sampler from ``args.consumed_train_samples``, not from a loader state."""
    args = common.get("args")
    values = args if isinstance(args, dict) else getattr(args, "state", None) or getattr(args, "__dict__", {})
    consumed = values.get("consumed_train_samples") if isinstance(values, dict) else None
    it = common.get("iteration")
    if isinstance(consumed, int) and not isinstance(consumed, bool):
        return (f"Megatron iteration {it}, args.consumed_train_samples {consumed} (the sampler skips the consumed "
                "samples)")
    return f"step counter only (iteration {it}); no data-loader position (args.consumed_train_samples not saved)"
