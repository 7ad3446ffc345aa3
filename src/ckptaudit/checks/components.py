"""Component inventory: model, optimizer, scheduler, RNG state, data progress — found where, or missing."""

from __future__ import annotations

from collections.abc import Collection

from ckptaudit.catalogue import finding
from ckptaudit.findings import Component, ComponentKind, Finding, Severity
from ckptaudit.layouts import View

__all__ = ["ALWAYS_REQUIRED", "check_components"]

ALWAYS_REQUIRED = frozenset({ComponentKind.MODEL, ComponentKind.OPTIMIZER})

_WHY = {
    ComponentKind.MODEL: "there are no parameters to resume from",
    ComponentKind.OPTIMIZER: "resuming restarts the optimizer moments from zero: a different trajectory",
    ComponentKind.SCHEDULER: "the learning-rate schedule restarts from its first step",
    ComponentKind.RNG: "dropout masks and data shuffling will differ from the uninterrupted run",
    ComponentKind.DATA_PROGRESS: "the data loader restarts from the beginning: batches are seen twice",
}


def check_components(view: View, require: Collection[ComponentKind]) -> tuple[tuple[Component, ...], list[Finding]]:
    comps: list[Component] = []
    findings: list[Finding] = []
    for kind in ComponentKind:
        where = tuple(view.components.get(kind, ()))
        if where:
            comps.append(Component(kind, True, where, view.details.get(kind, "")))
            continue
        comps.append(Component(kind, False))
        required = kind in ALWAYS_REQUIRED or kind in require
        findings.append(
            finding(
                "component.missing",
                kind.value,
                f"no {kind.value} state found: {_WHY[kind]}"
                + ("" if required else f" (a warning; --require {kind.value} makes it an error)"),
                severity=Severity.ERROR if required else Severity.WARNING,
                component=kind.value,
            )
        )
    return tuple(comps), findings
