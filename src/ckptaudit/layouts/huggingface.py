"""Hugging Face Trainer, Accelerate and PEFT: which file of a checkpoint directory holds what, by its name
(``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth``, ``random_states_*.pkl``, ``sampler*.bin``,
``trainer_state.json``, ``*.index.json``; a PEFT adapter is an ordinary ``adapter_model.safetensors``), and
the name of a directory layout.

Pure: no I/O.
"""

from __future__ import annotations

import fnmatch
import os

from ckptaudit.findings import ComponentKind
from ckptaudit.formats.base import Checkpoint, Part
from ckptaudit.layouts.keyed import optimizer_view
from ckptaudit.layouts.precision import (
    model_config_record,
    scaler_record,
    trainer_autocast_record,
    training_args_record,
)
from ckptaudit.layouts.rules import Context, PartRule, register_rule
from ckptaudit.layouts.view import View, as_int

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
    ("training_args.bin", "training-args"),
    ("scaler*.pt", "scaler"),
    ("*.index.json", "index"),
    ("manifest.json", "manifest"),
    ("config.json", "model-config"),
    ("ckptaudit.json", "manifest"),
    ("*.json", "ignore"),
)


def file_rule(name: str) -> ComponentKind | str | None:
    """What a file of a checkpoint directory holds, by its name: a component, ``index``, ``manifest``, ``ignore``,
    or a record of the run's precision (``training-args``, ``scaler``: see :mod:`ckptaudit.layouts.precision`)."""
    base = os.path.basename(name)
    for pattern, kind in _FILE_RULES:
        if fnmatch.fnmatch(base, pattern):
            return kind
    return None


NAMED_FILES = ("ignore", "training-args", "scaler", "manifest", "index", "model-config")
"""The file rules whose files are not components: read (or skipped) by their name alone."""


def read_named_file(part: Part, ctx: Context) -> bool:
    """A file its name says is an index, a manifest, a record of the run's precision, or to be ignored."""
    rule, tree, view = ctx.file_rule, part.tree, ctx.view
    if rule in ("training-args", "scaler", "model-config"):
        read = {"training-args": training_args_record, "scaler": scaler_record,
                "model-config": model_config_record}[rule]
        record = read(tree, part.name)
        if record is not None:
            view.contract_records.append(record)
            both = trainer_autocast_record(view.contract_records)  # whichever of the two is read second
            if both is not None and not any(r.source == both.source for r in view.contract_records):
                view.contract_records.append(both)
    elif rule == "manifest":
        if isinstance(tree, dict):
            view.manifest = tree
    elif rule == "index":
        if isinstance(tree, dict):
            view.indexes.append((part.name, tree))
            ctx.found(ComponentKind.MODEL, part.name)
    return True


def read_metadata(part: Part, ctx: Context) -> bool:
    """A safetensors file's header metadata (``{"format": "pt"}``), gathered; the part is read on by later rules."""
    ctx.view.metadata.update(part.metadata)
    return False


def read_component_file(part: Part, ctx: Context) -> bool:
    """A file its name says holds one component other than the model (``optimizer.pt``, ``scheduler.pt``,
    ``rng_state.pth``, ``trainer_state.json``, ...)."""
    rule, tree, view, where = ctx.file_rule, part.tree, ctx.view, part.name
    assert isinstance(rule, ComponentKind)
    if rule is ComponentKind.OPTIMIZER:
        if tree is not None:
            opt = optimizer_view(part, tree, where, ctx.ckpt)
            if opt is not None and view.optimizer is None:
                view.optimizer = opt
        ctx.found(rule, where)
    elif rule is ComponentKind.DATA_PROGRESS and part.name.endswith("trainer_state.json"):
        if isinstance(tree, dict) and "global_step" in tree:
            view.step = as_int(tree.get("global_step"))
        ctx.found(rule, where, "Trainer global_step/epoch (the sampler is re-seeded and skipped forward)")
    else:
        ctx.found(rule, where)
    return True


# By file name first: these files are what their names say, whatever their keys.
register_rule(PartRule("named-files", order=10, applies=lambda part, ctx: ctx.file_rule in NAMED_FILES,
                  read="ckptaudit.layouts.huggingface:read_named_file"))
register_rule(PartRule("safetensors-metadata", order=20, applies=lambda part, ctx: part.format == "safetensors",
                  read="ckptaudit.layouts.huggingface:read_metadata"))
# After DeepSpeed's part (order 30), before the keyed rule: a component file is that component, whatever its keys.
register_rule(PartRule("component-files", order=40,
                  applies=lambda part, ctx: isinstance(ctx.file_rule, ComponentKind)
                  and ctx.file_rule is not ComponentKind.MODEL,
                  read="ckptaudit.layouts.huggingface:read_component_file"))


def layout_name(ckpt: Checkpoint, view: View) -> str:
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
