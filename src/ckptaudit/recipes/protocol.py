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

        def eval_batch(self, job: Job | None) -> Any: ...    # optional: a held-out batch, whatever the model
                                                             # takes (export-serving runs offline: job is None)
        def forward(self, model, batch) -> Any: ...          # optional: the model on that batch (default:
                                                             # model(batch), model(**batch) for a dict)
        def eval_loss(self, model, batch) -> Tensor: ...     # optional: a scalar loss for the serving gate
        def build_model(self) -> nn.Module: ...              # optional: the unwrapped model (export-serving)
        output_kind = "logits"                               # optional: "logits", "embedding" or "values"

``eval_batch``, ``forward`` and ``eval_loss`` are all a model of any kind needs: the probe's armed forward, an
exporter's ``prepare`` forward and the serving gate call :func:`eval_forward` / :func:`model_forward`, never a
language model's slicing of their own. ``eval_logits(model, batch)`` is the older name of ``forward``.

Recipes are named ``module:attr`` (an instance, a class, or a zero-argument factory) or ``path/to/file.py:attr``
(the file's folder is importable while it loads, so it may import modules beside it). The built-in one is
``ckptaudit.recipes.tinygpt:recipe``. The whole protocol, with a worked example: docs/resume-test.md.

Errors in user code are reported as :class:`UserFailure` records: the user's function, the rule it broke and the
user's own frames of the traceback (:func:`checked_setup`, :func:`checked_step` and :func:`user_failure`).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import sysconfig
import traceback
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from ckptaudit.launch import RankContext

__all__ = ["DataSource", "Job", "Recipe", "RecipeError", "UserFailure", "checked_setup", "checked_step",
           "describe_function", "eval_forward", "load_object", "load_recipe", "model_forward", "to_device",
           "user_failure"]


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
    """Training steps taken so far. The recipe's ``step`` increments it; when it does not, the resume test does
    (so the documented checkpoint records the right step)."""


@runtime_checkable
class Recipe(Protocol):
    name: str
    seed: int

    def setup(self, ctx: RankContext) -> Job: ...

    def step(self, job: Job) -> float: ...


def load_object(spec: str) -> Any:
    """Import ``module:attr`` or ``path/to/file.py:attr``; errors name the spec and what to fix.

    A file is loaded with its folder on ``sys.path`` (so it may import modules beside it). A syntax error, a
    failed import or an exception while the module runs becomes a ``ValueError`` naming the file and line; the
    original exception is its ``__cause__`` (``--verbose`` shows its traceback).
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{spec!r} is not of the form module:attr or path/to/file.py:attr")
    if module_name.endswith(".py") or os.sep in module_name:
        if not os.path.isfile(module_name):
            raise ValueError(f"{spec!r}: file {module_name} does not exist")
        folder = os.path.dirname(os.path.abspath(module_name))
        if folder not in sys.path:
            sys.path.insert(0, folder)
        mod_id = "ckptaudit_user_" + os.path.splitext(os.path.basename(module_name))[0]
        loader_spec = importlib.util.spec_from_file_location(mod_id, module_name)
        if loader_spec is None or loader_spec.loader is None:
            raise ValueError(f"{spec!r}: cannot import {module_name}")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[mod_id] = module
        try:
            loader_spec.loader.exec_module(module)
        except BaseException as exc:
            sys.modules.pop(mod_id, None)
            raise ValueError(f"{spec!r}: {_import_problem(module_name, exc)}") from exc
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            hint = module_name.replace(".", os.sep) + ".py"
            there = (f"the file {hint} exists: load it by path with {hint}:{attr}" if os.path.isfile(hint)
                     else f"to load a file by path, write path/to/file.py:{attr}")
            raise ValueError(f"{spec!r}: cannot import module {module_name} ({exc}); {there}") from exc
        except BaseException as exc:
            raise ValueError(f"{spec!r}: {_import_problem(module_name, exc)}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        import difflib

        close = difflib.get_close_matches(attr, [n for n in dir(module) if not n.startswith("_")], n=1)
        hint = f"; did you mean {module_name}:{close[0]}?" if close else ""
        raise ValueError(f"{spec!r}: module {module_name} has no attribute {attr!r}{hint}") from None


def _import_problem(where: str, exc: BaseException) -> str:
    if isinstance(exc, SyntaxError):
        return f"syntax error in {exc.filename or where}, line {exc.lineno}: {exc.msg}; fix the file"
    if isinstance(exc, ImportError):
        return f"importing {where} failed: {exc}; install the module or put it beside the file"
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" at {frame.filename}, line {frame.lineno}" if frame else ""
    return f"running {where} raised {type(exc).__name__}: {exc}{at}"


def load_recipe(spec: str) -> Recipe:
    obj = load_object(spec)
    if isinstance(obj, type) or (callable(obj) and not isinstance(obj, Recipe)):
        try:
            obj = obj()
        except Exception as exc:
            raise ValueError(f"{spec!r}: creating the recipe raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, Recipe):
        raise ValueError(
            f"{spec!r} is not a recipe: it needs a name, a seed, setup(ctx) -> Job and step(job) -> float"
        )
    return obj


# ---------------------------------------------------------------------------------------------------------------
# User code, called and checked


@dataclass(frozen=True, slots=True)
class UserFailure:
    """An error in user code (a recipe's or an exporter's function), reduced to text so it crosses processes."""

    function: str
    """The user's function, e.g. ``MyRecipe.step (my_recipe.py:40)``."""
    rule: str
    """What it broke, e.g. ``step must return the loss as a float or a 0-dim tensor`` or ``raised``."""
    error: str
    """The exception's last line, e.g. ``OSError: [Errno 28] No space left on device``; empty if none."""
    frames: str = ""
    """The user's own frames of the traceback (not torch's, the standard library's or ckptaudit's runner's)."""
    traceback: str = ""
    """Every frame."""

    def message(self, *, debug: bool = False) -> str:
        head = f"{self.function}: {self.rule}" + (f": {self.error}" if self.error and self.rule != self.error
                                                   else "")
        tb = self.traceback if debug else self.frames
        return head + (f"\n{tb.rstrip()}" if tb else "")


class RecipeError(Exception):
    """The recipe broke the protocol or raised: a usage error (exit 2), not a finding."""

    def __init__(self, failure: UserFailure) -> None:
        super().__init__(failure.message())
        self.failure = failure

    def __reduce__(self) -> tuple[Any, ...]:
        return (RecipeError, (self.failure,))


_SKIP_DIRS = tuple(os.path.dirname(p) + os.sep for p in (torch.__file__,)) + tuple(
    os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib"))
_PACKAGE = os.path.dirname(os.path.dirname(__file__))
_RUNNER = (os.path.join(_PACKAGE, "resume") + os.sep, __file__, os.path.join(_PACKAGE, "launch.py"))
"""ckptaudit's own code that runs user code: never the user's frames (the shipped recipes are user code)."""
_RUNNER_FUNCTIONS = ((os.path.join(_PACKAGE, "exporters", "__init__.py"), "capture_and_export"),)
"""ckptaudit's own functions that call user code from a module that also holds shipped user-facing code."""


def _is_user_frame(filename: str, function: str = "") -> bool:
    if any(os.path.realpath(filename) == os.path.realpath(f) and function == name for f, name in _RUNNER_FUNCTIONS):
        return False
    real = os.path.realpath(filename)
    if "site-packages" + os.sep + "torch" + os.sep in real:
        return False
    return not (real.startswith(_SKIP_DIRS) or filename.startswith(_RUNNER) or real.startswith(_RUNNER))


def user_failure(function: str, rule: str, exc: BaseException | None = None) -> UserFailure:
    """A :class:`UserFailure` for ``exc`` raised by ``function`` (or for a rule broken without an exception)."""
    if exc is None:
        return UserFailure(function, rule, "")
    error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    summary = traceback.extract_tb(exc.__traceback__)
    mine = traceback.StackSummary.from_list([f for f in summary if _is_user_frame(f.filename, f.name)])
    frames = ("Traceback (your code; all frames with --debug):\n" + "".join(mine.format()) + error
              if len(mine) else "")
    full = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return UserFailure(function, rule, error, frames, full)


def describe_function(fn: Any) -> str:
    """``qualname (file:line)`` of a function or bound method, for messages; ckptaudit's own functions by their
    import name (``ckptaudit.resume.default_load``): a user reads the frames of their own code, never ours."""
    target = getattr(fn, "__func__", fn)
    name = getattr(target, "__qualname__", None) or repr(target)
    module = getattr(target, "__module__", None) or ""
    if module == "ckptaudit" or module.startswith("ckptaudit."):
        parent = module.rpartition(".")[0]  # the package's name for it where it re-exports it (the documented one)
        shown = parent if parent and getattr(sys.modules.get(parent), name, None) is target else module
        return f"{shown}.{name}"
    try:
        file = inspect.getsourcefile(target)
        line = inspect.getsourcelines(target)[1]
    except (TypeError, OSError):
        return name
    return f"{name} ({os.path.relpath(file) if file else '?'}:{line})"


def checked_setup(recipe: Any, ctx: RankContext) -> Job:
    """(all ranks) ``recipe.setup(ctx)``; raises :class:`RecipeError` naming setup when it raises or returns no
    Job (an object with a ``model`` module and an ``optimizer``)."""
    fn = recipe.setup
    try:
        job = fn(ctx)
    except Exception as exc:  # noqa: BLE001 - the user's code: any exception is theirs to fix
        raise RecipeError(user_failure(describe_function(fn), "raised", exc)) from None
    if not isinstance(getattr(job, "model", None), torch.nn.Module) or not isinstance(
            getattr(job, "optimizer", None), torch.optim.Optimizer):
        raise RecipeError(user_failure(
            describe_function(fn), "setup must return a Job(model=<nn.Module>, optimizer=<torch.optim.Optimizer>, "
            f"scheduler=..., data=...) (from ckptaudit.recipes); it returned {type(job).__name__}"))
    return job


def checked_step(recipe: Any, job: Job) -> float:
    """(all ranks) One ``recipe.step(job)``; the loss as a float. Raises :class:`RecipeError` naming step when it
    raises or returns something other than a float or a 0-dim tensor. Advances ``job.step`` when the
    recipe did not."""
    fn = recipe.step
    before = job.step
    try:
        loss = fn(job)
    except Exception as exc:  # noqa: BLE001 - the user's code
        raise RecipeError(user_failure(describe_function(fn), "raised", exc)) from None
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        value = float(loss.detach())
    elif isinstance(loss, (float, int)) and not isinstance(loss, bool):
        value = float(loss)
    else:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)[:80]
        raise RecipeError(user_failure(describe_function(fn), "step must return the loss as a float or a 0-dim "
                                       f"tensor; it returned {got}"))
    if job.step == before:
        job.step += 1
    return value


# ---------------------------------------------------------------------------------------------------------------
# A forward on the recipe's held-out batch, for a model of any kind


def to_device(batch: Any, device: torch.device | str) -> Any:
    """``batch`` with every tensor in it (nested in tuples, lists and dicts) moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, tuple):
        return tuple(to_device(v, device) for v in batch)
    if isinstance(batch, list):
        return [to_device(v, device) for v in batch]
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def model_forward(recipe: Any, model: torch.nn.Module, batch: Any) -> Any:
    """The recipe's forward of ``model`` on ``batch``: ``recipe.forward(model, batch)`` when it has one (or
    ``eval_logits``, its older name), else ``model(batch)`` for a tensor and ``model(**batch)`` for a dict (the
    Hugging Face convention). A tuple or list needs the recipe's ``forward``: which element is the input, which
    the target, only the recipe knows. Runs in the caller's mode (train/eval) and grad setting."""
    for name in ("forward", "eval_logits"):
        fn = getattr(recipe, name, None)
        if callable(fn):
            return fn(model, batch)
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        raise TypeError(f"the recipe's eval_batch returned a {type(batch).__name__} of {len(batch)}; give the recipe "
                        "forward(model, batch) that calls the model on its input (e.g. model(batch[0]))")
    return model(batch)


def eval_forward(recipe: Any, job: Job) -> Any:
    """(all ranks) One forward of ``job.model`` in eval mode without gradients on ``recipe.eval_batch(job)``,
    moved to the model's device: no dropout, no RNG draw, no update. Returns the output. Used by the probe's
    armed forward and before an exporter's ``prepare`` capture. The model's mode is restored afterwards."""
    model = job.model
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            batch = recipe.eval_batch(job)
            first = next(model.parameters(), None)
            if first is not None:
                batch = to_device(batch, first.device)
            return model_forward(recipe, model, batch)
    finally:
        model.train(was_training)
