"""Match the contents of two checkpoints by meaning, not by raw key.

Every tensor and plain value of a scanned checkpoint becomes an :class:`Entry` under a *key* that two
checkpoints of the same training state share whatever their format:

- model tensors: ``("model", fqn)`` with the FQN normalised (:func:`ckptaudit.layouts.normalize_fqn` strips
  ``module.``, ``_orig_mod.``, FSDP1 wrappers);
- optimizer state: ``("optimizer", "state", fqn, name)`` through the attachment mapping (index-keyed state
  mapped to FQNs by :func:`ckptaudit.layouts.attachment.attach`; unmapped entries keep ``#<index>``),
  hyperparameters as ``("optimizer", "param_groups", i, field)`` (the ``params`` lists are the attachment's
  business, not compared);
- everything else by component and path under the component: ``("scheduler", "last_epoch")``,
  ``("rng", "rank0", "torch")``, ``("data-progress", "step")`` (``step`` at the top level and
  ``train_state/step`` are one key), ``("other", ...)``. Per-rank files (``rng_state_1.pth``) become
  ``rank1``.

:func:`align_ranks` then matches a side that saved one rank's state without a rank level (what an exporter
writing on rank 0 does) to the other side's ``rank0``. Pure: reads nothing beyond the scanned checkpoint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from ckptaudit.auditing.plan import open_interpreted
from ckptaudit.findings import ComponentKind, safe_str
from ckptaudit.formats.base import Checkpoint, Part, Unreadable, walk
from ckptaudit.formats.io.tensors import TensorData
from ckptaudit.layouts import (
    DATA_KEYS,
    MODEL_KEYS,
    OPTIMIZER_KEYS,
    RNG_KEYS,
    SCHEDULER_KEYS,
    STEP_KEYS,
    TensorRef,
    View,
    is_step_key,
    normalize_fqn,
)
from ckptaudit.layouts import file_rule as _layout_file_rule
from ckptaudit.layouts.attachment import Attachment

__all__ = ["Entry", "Side", "align_ranks", "entries_of", "key_text", "open_side"]

_RANK = re.compile(r"^(?:dp_)?rank_?(\d+)$")
_FILE_RANK = re.compile(r"_(\d+)\.[A-Za-z0-9]+$")
_SKIP_GROUP_FIELDS = ("params", "param_names")


@dataclass
class Side:
    """One checkpoint opened and interpreted (no tensor read yet). Owns the memory maps: :meth:`close` it."""

    ckpt: Checkpoint
    view: View
    attachment: Attachment
    known_params: set[str]
    """FQNs the optimizer state names (trainable parameters); model tensors not among them are buffers."""

    def close(self) -> None:
        self.ckpt.close()


def open_side(path: str) -> Side:
    """Open and interpret ``path`` (:func:`ckptaudit.auditing.plan.open_interpreted`, the audit's open), without scanning.
    Raises ``FileNotFoundError``."""
    ckpt, view, attachment = open_interpreted(path)
    known = set(attachment.mapping.values())
    if view.optimizer is not None and view.optimizer.keyed == "fqn":
        known |= {p for g in view.optimizer.groups for p in g.get("params", []) if isinstance(p, str)}
    return Side(ckpt, view, attachment, known)


@dataclass(slots=True, eq=False)
class Entry:
    """One tensor or plain value of one checkpoint, under its matching key."""

    key: tuple[str, ...]
    component: str
    name: str
    """Where it lives in its own checkpoint (the audit's tensor name, or a ``/``-joined path for values)."""
    kind: str
    """``tensor`` or ``value``."""
    role: str = ""
    """``parameter``/``buffer``, the optimizer state name, or ``""``."""
    param: str | None = None
    """Normalised FQN of the parameter (itself, or the one an optimizer entry is attached to)."""
    data: TensorData | None = None
    """The lazy tensor; ``None`` for values and for tensors that cannot be read."""
    unreadable: str = ""
    """Why a tensor cannot be read (its finding is the reader's), or ``""``."""
    value: Any = None
    hash: str | None = None
    """xxh3-128 of the tensor's bytes (as the audit reports it), when the streaming pass computed it: for
    identical pairs and tensors on one side only; a pair decided element-wise is not hashed."""
    hashed: bool = False
    """Whether the streaming pass has read this tensor (hashed or not)."""

    @property
    def dtype(self) -> str:
        return self.data.dtype.name if self.data is not None else "?"

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape if self.data is not None else ()


def key_text(key: tuple[str, ...]) -> str:
    return "/".join(key)


def entries_of(side: Side) -> dict[tuple[str, ...], Entry]:
    """Every tensor and value of ``side`` by matching key, in checkpoint order (model, optimizer, the rest)."""
    view = side.view
    out: dict[tuple[str, ...], Entry] = {}
    covered: set[int] = set()

    def tensor(key: tuple[str, ...], comp: str, ref: TensorRef, role: str, param: str | None) -> None:
        covered.add(id(ref.data))
        _put(out, _tensor_entry(key, comp, ref.name, ref.data, role, param))

    if view.model is not None:
        for fqn, ref in view.model.params.items():
            role = "parameter" if (not side.known_params or fqn in side.known_params) else "buffer"
            norm = normalize_fqn(fqn)
            tensor(("model", norm), ComponentKind.MODEL.value, ref, role, norm)
    opt = view.optimizer
    opt_where = list(view.components.get(ComponentKind.OPTIMIZER, []))
    if opt is not None:
        opt_where.append(opt.where)
        for skey, state in opt.state.items():
            attached = side.attachment.mapping.get(skey)
            pname = normalize_fqn(attached) if attached is not None else f"#{skey}"
            for sname, v in state.items():
                key: tuple[str, ...] = ("optimizer", "state", pname, str(sname))
                if isinstance(v, TensorRef):
                    tensor(key, ComponentKind.OPTIMIZER.value, v, str(sname), pname if attached else None)
                else:
                    _put(out, Entry(key, ComponentKind.OPTIMIZER.value, f"{opt.where}/state/{skey}/{sname}",
                                    "value", str(sname), pname if attached else None, value=v))
        for gi, group in enumerate(opt.groups):
            for field_name, v in group.items():
                if field_name in _SKIP_GROUP_FIELDS:
                    continue
                for path, leaf in walk(v):
                    key = ("optimizer", "param_groups", safe_str(gi), safe_str(field_name), *(safe_str(p) for p in path))
                    name = "/".join((opt.where, "param_groups", *key[2:]))
                    _put(out, Entry(key, ComponentKind.OPTIMIZER.value, name, "value", value=leaf))
    model_where = list(view.components.get(ComponentKind.MODEL, []))
    names = {id(ref.data): ref.name for ref, _ in view.tensors}
    for part in side.ckpt.parts:
        if part.tree is None:
            continue
        rule = _file_rule(part)
        if rule in ("ignore", "index", "manifest", "training-args"):
            continue
        for path, leaf in walk(part.tree):
            label = _label(part, path)
            if _under(label, opt_where):
                continue
            if isinstance(leaf, TensorData | Unreadable) and id(leaf) in covered:
                continue
            if view.roles.get(id(leaf), ("", None))[0] == "compute-copy":
                continue  # DeepSpeed's bf16 module weights: the masters (model entries) are what is compared
            comp, sub = _component_path(part, rule, path, under_model=_under(label, model_where))
            key = (comp, *sub)
            if key in out:  # two spellings landed on one key: keep the raw path for the second
                key = (comp, *(safe_str(p) for p in path))
            if isinstance(leaf, TensorData | Unreadable):
                _put(out, _tensor_entry(key, comp, names.get(id(leaf), label), leaf, "", None))
            else:
                _put(out, Entry(key, comp, label, "value", value=leaf))
    return out


def _tensor_entry(key: tuple[str, ...], comp: str, name: str, data: TensorData | Unreadable, role: str,
                  param: str | None) -> Entry:
    if isinstance(data, Unreadable):
        return Entry(key, comp, name, "tensor", role, param, unreadable=data.reason or "unreadable")
    return Entry(key, comp, name, "tensor", role, param, data)


def _put(out: dict[tuple[str, ...], Entry], e: Entry) -> None:
    key = e.key
    n = 1
    while key in out:  # keep both rather than lose one (e.g. two optimizers' groups)
        n += 1
        key = (*e.key[:-1], f"{e.key[-1]}~{n}") if e.key else (f"~{n}",)
    out[key] = e if key == e.key else replace(e, key=key)


def _label(part: Part, path: tuple[Any, ...]) -> str:
    bits = [part.name] if part.name else []
    bits += [safe_str(p) for p in path]
    return "/".join(bits) if bits else "(root)"


def _under(label: str, places: list[str]) -> bool:
    return any(label == w or label.startswith(w + "/") for w in places)


def _file_rule(part: Part) -> ComponentKind | str | None:
    # The layouts' file-name table is the single source of truth for which file holds which component.
    return _layout_file_rule(part.name) if part.name else None


def _component_path(part: Part, rule: ComponentKind | str | None, path: tuple[Any, ...],
                    *, under_model: bool) -> tuple[str, tuple[str, ...]]:
    p = tuple(safe_str(x) for x in path)
    if isinstance(rule, ComponentKind):
        m = _FILE_RANK.search(part.name)
        rank = (f"rank{int(m[1])}",) if m and rule in (ComponentKind.RNG, ComponentKind.DATA_PROGRESS) else ()
        return rule.value, (*rank, *p)
    if under_model:
        return ComponentKind.MODEL.value, ("value", *p[1:]) if p and p[0] in MODEL_KEYS else ("value", *p)
    head = p[0] if p else ""
    if head in SCHEDULER_KEYS:
        return ComponentKind.SCHEDULER.value, p[1:]
    if head in RNG_KEYS:
        return ComponentKind.RNG.value, p[1:]
    if head in DATA_KEYS:
        return ComponentKind.DATA_PROGRESS.value, p[1:]
    if is_step_key("/".join(p)):  # every spelling of the training step pairs with every other
        return ComponentKind.DATA_PROGRESS.value, ("step",)
    if head in STEP_KEYS:
        if len(p) == 1 or p[1:] == ("step",):
            return ComponentKind.DATA_PROGRESS.value, ("step",)
        return ComponentKind.DATA_PROGRESS.value, p
    if head in MODEL_KEYS:
        return ComponentKind.MODEL.value, ("value", *p[1:])
    if head in OPTIMIZER_KEYS:
        return ComponentKind.OPTIMIZER.value, ("unmapped", *p[1:])
    return "other", p


def align_ranks(ref: dict[tuple[str, ...], Entry], cand: dict[tuple[str, ...], Entry]) -> list[str]:
    """Match a side that holds one rank's state without a rank level to the other side's lowest rank.

    Only an entry whose rank-prefixed key exists on the other side, and whose own key does not, is re-keyed.
    Mutates ``ref``/``cand``; returns a note per component re-keyed.
    """
    notes: list[str] = []
    for this, other, side in ((cand, ref, "candidate"), (ref, cand, "reference")):
        comps = {k[0] for k in other if len(k) > 1 and _RANK.match(k[1])}
        for comp in sorted(comps):
            if any(len(k) > 1 and k[0] == comp and _RANK.match(k[1]) for k in this):
                continue
            ranks = sorted({k[1] for k in other if k[0] == comp and len(k) > 1 and _RANK.match(k[1])},
                           key=lambda r: int(_RANK.match(r)[1]))  # type: ignore[index]
            first = ranks[0]
            moved = 0
            for k in [k for k in this if k[0] == comp]:
                new = (comp, first, *k[1:])
                if k not in other and new in other and new not in this:
                    this[new] = replace(this.pop(k), key=new)
                    moved += 1
            if moved:
                notes.append(f"the {side}'s {comp} state has no rank level (one rank's state, as an exporter "
                             f"writing on rank 0 saves it): matched to the other side's {first}")
    return notes
