"""Hugging Face Trainer, Accelerate and PEFT: which file of a checkpoint directory holds what, by its name
(``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth``, ``random_states_*.pkl``, ``sampler*.bin``,
``trainer_state.json``, ``*.index.json``; a PEFT adapter is an ordinary ``adapter_model.safetensors``), and
the name of a directory layout.

Pure: no I/O.
"""

from __future__ import annotations

import fnmatch
import os

from ckptaudit.formats.base import Checkpoint
from ckptaudit.layouts.view import View
from ckptaudit.model import ComponentKind

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
