"""The plan of an audit: a checkpoint opened and interpreted, and every tensor's place in the report, before any
tensor data is read.

:func:`plan_scan` opens ``path`` (:mod:`ckptaudit.formats`), interprets it (:mod:`ckptaudit.layouts`: which part is
the model, the optimizer, ...; the optimizer state attached to parameters), and gives each tensor its component,
role and parameter. The scan (:mod:`ckptaudit.auditing.scan`) then reads the tensors, on one rank or shared
between ranks (:mod:`ckptaudit.auditing.distributed`); ``compare`` opens its two sides with
:func:`open_interpreted`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptaudit.findings import ComponentKind, Finding
from ckptaudit.formats import open_checkpoint
from ckptaudit.formats.base import Checkpoint, gc_paused
from ckptaudit.formats.io.tensors import TensorData
from ckptaudit.layouts import TensorRef, View, interpret
from ckptaudit.layouts.attachment import Attachment, attach

__all__ = ["ScanPlan", "open_interpreted", "plan_scan"]


@dataclass
class ScanPlan:
    """A checkpoint opened and interpreted, with every tensor's place in the report: the work to scan.

    ``items[i]`` is ``(ref, component, role, param)``; the records come out in this order whatever order the
    tensors are scanned in, and on whichever rank (see :mod:`ckptaudit.auditing.distributed`).
    """

    ckpt: Checkpoint
    view: View
    items: list[tuple[TensorRef, str, str, str | None]]
    findings: list[Finding]
    attachment: Any
    step_items: frozenset[int]
    """Indices of one-element ``step`` state tensors, whose value the scan also reads."""
    step_keys: dict[int, Any]

    def scannable(self) -> list[int]:
        """Indices of the items with data to scan (not :class:`Unreadable`)."""
        return [i for i, (ref, *_) in enumerate(self.items) if isinstance(ref.data, TensorData)]

    def nbytes(self, index: int) -> int:
        data = self.items[index][0].data
        return data.nbytes if isinstance(data, TensorData) else 0

    def close(self) -> None:
        self.ckpt.close()


def open_interpreted(path: str) -> tuple[Checkpoint, View, Attachment]:
    """``path`` opened, interpreted (which part is the model, the optimizer, ...) and its optimizer state attached
    to parameters, reading no tensor data; Python's garbage collector paused meanwhile
    (:func:`~ckptaudit.formats.base.gc_paused`). The open of ``audit`` and ``compare``. Raises
    ``FileNotFoundError``."""
    with gc_paused():
        ckpt = open_checkpoint(path)
        view = interpret(ckpt)
        return ckpt, view, attach(view)


def plan_scan(path: str) -> ScanPlan:
    """Open and interpret ``path`` and work out each tensor's role, reading no tensor data.
    Raises ``FileNotFoundError``."""
    ckpt, view, attachment = open_interpreted(path)
    opt_meta: dict[int, tuple[Any, str]] = {}
    if view.optimizer is not None:
        for key, entry in view.optimizer.state.items():
            for sname, value in entry.items():
                if isinstance(value, TensorRef):
                    opt_meta[id(value)] = (key, sname)
    known_params = set(attachment.params)
    if view.optimizer is not None and view.optimizer.keyed == "fqn":
        known_params |= {p for g in view.optimizer.groups for p in g["params"] if isinstance(p, str)}
    fqn_of = {id(r): f for f, r in view.model.params.items()} if view.model is not None else {}
    items: list[tuple[TensorRef, str, str, str | None]] = []
    step_keys: dict[int, Any] = {}
    for ref, comp in view.tensors:
        role, param = "", None
        if comp == ComponentKind.MODEL.value and view.model is not None:
            fqn = fqn_of.get(id(ref))
            param = fqn
            role = "parameter" if (not known_params or fqn in known_params) else "buffer"
            if fqn in view.model.aliases:  # a tied weight's second name: same bytes as its first
                role, param = "tied", view.model.aliases[fqn]
        elif id(ref) in opt_meta:
            key, sname = opt_meta[id(ref)]
            role = sname
            param = attachment.mapping.get(key)
            if sname == "step" and isinstance(ref.data, TensorData) and ref.data.numel == 1:
                step_keys[len(items)] = key
        role, param = view.roles.get(id(ref.data), (role, param))
        items.append((ref, comp, role, param))
    return ScanPlan(ckpt, view, items, list(ckpt.findings), attachment, frozenset(step_keys), step_keys)
