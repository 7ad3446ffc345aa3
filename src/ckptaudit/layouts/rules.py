"""The layout rule contract: how a library layout declares which checkpoints or parts it reads, and the registry
:func:`~ckptaudit.layouts.core.interpret` asks in order.

Two kinds of rule:

- a :class:`CheckpointRule` reads a whole checkpoint into its :class:`~ckptaudit.layouts.view.View` (Megatron-Core's
  ``torch_dist``: its keys mean something only together with ``common.pt`` and ``metadata.json``);
- a :class:`PartRule` reads one part into the view being built: ``interpret`` hands each part to the rules in
  order until one takes it.

A library layout is one module of :mod:`ckptaudit.layouts` registering its rules with :func:`register_rule` at import
(``keyed.py``, ``huggingface.py``), or, where its code should load only when a checkpoint needs it, a sub-package
whose ``__init__.py`` registers rules naming the module that reads (``megatron/``, ``deepspeed/``). No edit to
the driver.

Every rule is pure (no I/O beyond what the parts already describe). ``applies`` is cheap and imports nothing;
the reading function is named ``"module:function"`` and imported only when the rule applies. ``order`` is
precedence: two rules of one kind may not share it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptaudit.formats.contract import Registry

if TYPE_CHECKING:  # the layout modules import this one as they register
    from ckptaudit.findings import ComponentKind
    from ckptaudit.formats.base import Checkpoint, Part
    from ckptaudit.layouts.view import View

__all__ = ["RULES", "CheckpointRule", "Context", "PartRule", "checkpoint_rules", "part_rules", "register_rule"]


@dataclass(frozen=True)
class Context:
    """What a :class:`PartRule` reads a part into: the checkpoint, the view being built, and the driver's two ways
    of recording (``found(kind, where, detail="")``: a component found; ``add_model(part, tree, where, prefix)``:
    a tree of model parameters); ``file_rule``: what the part's file name says it holds
    (:func:`~ckptaudit.layouts.huggingface.file_rule`)."""

    ckpt: Checkpoint
    view: View
    found: Callable[..., None]
    add_model: Callable[..., None]
    file_rule: ComponentKind | str | None


@dataclass(frozen=True)
class CheckpointRule:
    """A rule for a whole checkpoint. ``view(ckpt) -> View | None``: ``None`` when a closer look says the
    checkpoint is not of this layout after all (the part rules then read it)."""

    name: str
    order: int
    applies: Callable[[Checkpoint], bool]
    view: str


@dataclass(frozen=True)
class PartRule:
    """A rule for one part. ``applies(part, context)``; ``read(part, context) -> bool``: ``True`` when it took the
    part (no later rule sees it), ``False`` to let the next rules read it too."""

    name: str
    order: int
    applies: Callable[[Part, Context], bool]
    read: str


RULES = Registry("layout rule", "ckptaudit.layouts", packages_only=False)
"""The layout rules: :class:`CheckpointRule` and :class:`PartRule` entries, registered by the layout modules."""
register_rule = RULES.register


def checkpoint_rules() -> list[CheckpointRule]:
    """The registered whole-checkpoint rules, in precedence order."""
    return RULES.ordered(CheckpointRule)


def part_rules() -> list[PartRule]:
    """The registered part rules, in precedence order."""
    return RULES.ordered(PartRule)
