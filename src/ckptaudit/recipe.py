"""The recipe protocol: how a user describes their training job to ckptaudit, and how to find one by name.

A recipe is the smallest thing that lets ckptaudit train a few deterministic steps of *your* job: it builds
the model and wraps it (FSDP2 with a ``MixedPrecisionPolicy``, DDP, or plain), the optimizer, the scheduler and
a data source whose progress can be saved and restored, and it runs one training step. Like a
``LightningModule`` without the framework; like torchtitan's train spec, minus the config system::

    class MyRecipe:
        name = "my-job"
        seed = 0

        def setup(self, ctx: RankContext) -> Job:        # (all ranks) after the process group exists
            ...
            return Job(model=model, optimizer=opt, scheduler=sched, data=data)

        def step(self, job: Job) -> float:               # (all ranks) one training step; returns the loss
            ...

        def eval_batch(self, job: Job | None) -> Any: ...    # optional: the batch the serving gate evaluates
                                                             # (export-serving runs offline: job is None)
        def build_model(self) -> nn.Module: ...              # optional: the unwrapped model (export-serving)
        def eval_logits(self, model, batch) -> Tensor: ...   # optional: logits for the serving gate

Recipes are named ``module:attr`` (an instance, a class, or a zero-argument factory) or ``path/to/file.py:attr``.
The built-in one is ``ckptaudit.recipes.tinygpt:recipe``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from ckptaudit.dist.launch import RankContext

__all__ = ["DataSource", "Job", "Recipe", "load_object", "load_recipe"]


@runtime_checkable
class DataSource(Protocol):
    """A data source whose position can be saved and restored (``torchdata``'s ``StatefulDataLoader`` fits)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class Job:
    """The live training objects of one rank."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    """An ``LRScheduler`` (or anything with ``state_dict``/``load_state_dict``), or ``None``."""
    data: Any = None
    """A :class:`DataSource`, or ``None`` when the batches do not depend on progress."""
    step: int = 0
    """Training steps taken so far (the recipe's ``step`` increments it)."""


@runtime_checkable
class Recipe(Protocol):
    name: str
    seed: int

    def setup(self, ctx: RankContext) -> Job: ...

    def step(self, job: Job) -> float: ...


def load_object(spec: str) -> Any:
    """Import ``module:attr`` or ``path/to/file.py:attr``; errors name the spec and what to fix."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{spec!r} is not of the form module:attr or path/to/file.py:attr")
    if module_name.endswith(".py") or os.sep in module_name:
        if not os.path.isfile(module_name):
            raise ValueError(f"{spec!r}: file {module_name} does not exist")
        mod_id = "ckptaudit_user_" + os.path.splitext(os.path.basename(module_name))[0]
        loader_spec = importlib.util.spec_from_file_location(mod_id, module_name)
        if loader_spec is None or loader_spec.loader is None:
            raise ValueError(f"{spec!r}: cannot import {module_name}")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[mod_id] = module
        loader_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"{spec!r}: cannot import module {module_name} ({exc})") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{spec!r}: module {module_name} has no attribute {attr!r}") from None


def load_recipe(spec: str) -> Recipe:
    obj = load_object(spec)
    if isinstance(obj, type) or (callable(obj) and not isinstance(obj, Recipe)):
        obj = obj()
    if not isinstance(obj, Recipe):
        raise ValueError(
            f"{spec!r} is not a recipe: it needs a name, a seed, setup(ctx) -> Job and step(job) -> float"
        )
    return obj
