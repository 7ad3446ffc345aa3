"""The interpretation's data (:class:`View`, :class:`ModelView`, :class:`OptimizerView`, :class:`TensorRef`),
the key tables every dict layout is read by, and the helpers the library rules share.

Pure: no I/O.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from ckptaudit.findings import ComponentKind, safe_str
from ckptaudit.formats.base import Checkpoint, Part, Unreadable, walk
from ckptaudit.formats.io.tensors import TensorData

MODEL_KEYS = ("model", "state_dict", "module", "model_state_dict", "model_state", "net", "network")
OPTIMIZER_KEYS = ("optimizer", "optim", "optimizer_states", "optimizer_state_dict", "optimizer_state", "opt")
SCHEDULER_KEYS = ("scheduler", "lr_scheduler", "lr_schedulers", "scheduler_state_dict", "lr_scheduler_state_dict",
                  "schedulers")
RNG_KEYS = ("rng", "rng_state", "rng_states", "random_state", "random_states", "rng_tracker")
DATA_KEYS = ("data", "dataloader", "data_loader", "dataloaders", "loops", "sampler", "data_progress",
             "dataloader_state", "data_state")
STEP_KEYS = ("step", "global_step", "train_state", "iteration", "iter_num", "epoch")
"""Top-level keys of training progress (``epoch`` counts epochs, never steps); other spellings of the step:
:func:`is_step_key`."""
STEP_NAMES = ("global_step", "step", "iteration", "global_steps", "iter_num", "num_updates")
"""Names of the optimizer-step counter, best first, alone or under a :data:`STEP_SCOPES` prefix."""
STEP_SCOPES = ("train", "training", "trainer", "train_state", "training_state", "trainer_state", "state",
               "progress")
"""Prefixes a step name may sit under, joined by ``/`` or ``.`` (``train/step``, ``train_state.step``) or as a
nested dict (``{"train": {"step": 5}}``)."""

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
    """The model's tensors, and where in the checkpoint they were found."""

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
    """The optimizer's state and parameter groups, as saved, and where they were found."""

    where: str
    keyed: str
    """``fqn`` or ``index``."""
    state: dict[Any, dict[str, Any]]
    """Parameter key (FQN or int) -> state name -> :class:`TensorRef` or plain value."""
    groups: list[dict[str, Any]]
    """``param_groups``, each with a ``params`` list of FQNs or ints whatever the file held (see
    :func:`clean_groups`), and ``param_names`` if saved."""
    count: int = 1
    """How many optimizers the checkpoint holds (only the first is checked)."""
    masters: frozenset[str] = frozenset()
    """State names that hold the parameter's full-precision master copy (Megatron: ``fp32_param``, ``param``):
    the master, not the model's 16-bit copy, is the training state held to the contract."""
    unattached_masters: list[TensorRef] = field(default_factory=list)
    """Masters that belong to no one parameter (the distributed optimizer's flat buckets)."""


@dataclass(frozen=True, slots=True)
class ContractRecord:
    """What the training stack itself recorded about its precision, read where the library keeps it (DeepSpeed's
    saved ``ds_config``, Megatron-LM's ``args``, a saved GradScaler state, the Trainer's ``training_args.bin``)."""

    source: str
    """The :class:`~ckptaudit.findings.Contract` source it stands for when it decides (``deepspeed-config``,
    ``megatron-args``, ``grad-scaler``), or what it is when it cannot (``training-args``)."""
    where: str
    """The file (and key) it was read from."""
    says: str
    """The record's settings, in words (``bf16.enabled=true``)."""
    master_dtype: str | None
    """The master dtype the record decides, or ``None``: the setting leaves it to the model's own dtype."""
    why: str
    """Why the setting means that master dtype (or why it decides none), from the library's implementation."""
    in_optimizer: bool = False
    """The masters live in the optimizer's state (DeepSpeed's partitions, Megatron's main params), so the model's
    16-bit tensors are compute copies, and without the optimizer state there is no master to judge."""
    sixteen_bit: tuple[tuple[str, str], ...] = ()
    """(parameter, dtype) pairs the record shows trained in 16 bits by design while ``master_dtype`` holds for the
    others (the run's other checkpoints, whose own optimizer state is 16-bit for those parameters only)."""

    def text(self) -> str:
        return f"{self.where}: {self.says} ({self.why})"


@dataclass
class View:
    """One checkpoint interpreted: its library layout, the model, the optimizer, where each component lives."""

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
    contract_records: list[ContractRecord] = field(default_factory=list)
    """What the training stack recorded about its precision (see :class:`ContractRecord`), in the order read."""
    roles: dict[int, tuple[str, str | None]] = field(default_factory=dict)
    """``id(tensor data)`` -> (role, parameter) where the layout knows better than the model/optimizer split:
    DeepSpeed's bf16 module weights are ``compute-copy`` records of the parameter whose master is audited."""


def part_label(part: Part, *keys: Any) -> str:
    bits = [part.name] if part.name else []
    bits += [safe_str(k) for k in keys]
    return "/".join(bits) if bits else "(root)"


def is_state_dict(tree: Any) -> bool:
    """A flat mapping whose values are mostly tensors: a model state dict."""
    if not isinstance(tree, dict) or not tree:
        return False
    tensors = sum(isinstance(v, TensorData | Unreadable) for v in tree.values())
    return tensors > 0 and tensors >= len(tree) / 2


def leaf_file(ckpt: Checkpoint, part: Part, leaf: Any) -> str:
    if isinstance(leaf, TensorData) and leaf.pieces:
        return ckpt.file_name(leaf.pieces[0].file)
    if isinstance(leaf, Unreadable) and leaf.file:
        root = ckpt.read_path
        if os.path.isabs(leaf.file) and os.path.isdir(root) and os.path.commonpath([root, leaf.file]) == root:
            return ckpt.file_name(leaf.file)  # like a readable tensor's (and not the URL's stand-in)
        return leaf.file
    return part.name or os.path.basename(ckpt.path)


def unreadable_detail(where: str, value: Any) -> str:
    """A note for a component whose every value is unreadable (e.g. its DCP data file is lost), else ``""``."""
    leaves = [leaf for _, leaf in walk(value)]
    if leaves and all(isinstance(leaf, Unreadable) for leaf in leaves):
        return f"{where} is named, but its data is unreadable (see the integrity findings)"
    return ""


def _step_parts(key: Any) -> list[str]:
    return [p for p in re.split(r"[./]", safe_str(key)) if p]


def is_step_key(key: Any) -> bool:
    """Whether ``key`` (one key, or a path joined by ``/`` or ``.``) spells the training step: a
    :data:`STEP_NAMES` name alone or under :data:`STEP_SCOPES` prefixes (``step``, ``train/step``,
    ``trainer.global_step``, ``train_state.step``, ``iteration``)."""
    parts = _step_parts(key)
    return 0 < len(parts) <= 3 and parts[-1] in STEP_NAMES and all(p in STEP_SCOPES for p in parts[:-1])


def find_step(tree: dict[Any, Any]) -> tuple[str, int] | None:
    """The training step a top-level dict holds, and the key (``a/b`` for a nested one) it was read from: any
    spelling :func:`is_step_key` accepts, at the top level or one dict below a scope key (``train_state``,
    ``train``...), best name first (:data:`STEP_NAMES`), then the shallowest; ``None`` when there is none."""
    found: list[tuple[int, int, str, int]] = []
    for key, value in tree.items():
        k = safe_str(key)
        if is_step_key(k) and as_int(value) is not None:
            parts = _step_parts(k)
            found.append((STEP_NAMES.index(parts[-1]), len(parts), k, value))
        elif isinstance(value, dict) and _step_parts(k) and all(p in STEP_SCOPES for p in _step_parts(k)):
            for inner, v in value.items():
                parts = [*_step_parts(k), *_step_parts(inner)]
                if is_step_key("/".join(parts)) and as_int(v) is not None:
                    found.append((STEP_NAMES.index(parts[-1]), len(parts), f"{k}/{inner}", v))
    if not found:
        return None
    _, _, where, step = min(found, key=lambda f: (f[0], f[1]))
    return where, step


def holds_value(value: Any) -> bool:
    """Whether a state value holds something: not ``None`` nor an empty list/dict/tuple/string. Never the value's
    own truth (``bool(numpy_array)`` raises, and a pickle decides what its objects say)."""
    if value is None:
        return False
    if isinstance(value, list | dict | tuple | str | bytes):
        return len(value) > 0
    return True


def as_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None
