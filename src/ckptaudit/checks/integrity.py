"""Completeness checks that need the interpretation: Hugging Face shard indexes name every tensor's file."""

from __future__ import annotations

import os

from ckptaudit.catalogue import finding
from ckptaudit.findings import Finding
from ckptaudit.formats.base import Checkpoint
from ckptaudit.layouts import View

__all__ = ["check_indexes"]


def check_indexes(ckpt: Checkpoint, view: View) -> list[Finding]:
    """Every shard an ``*.index.json`` names exists, and holds the tensors the index puts there."""
    findings: list[Finding] = []
    parts = {p.name: p for p in ckpt.parts}
    for name, index in view.indexes:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            findings.append(finding("integrity.corrupt", name, f"{name} has no weight_map object"))
            continue
        base = os.path.dirname(name)
        by_shard: dict[str, list[str]] = {}
        for tensor, shard in weight_map.items():
            by_shard.setdefault(str(shard), []).append(str(tensor))
        for shard, tensors in by_shard.items():
            rel = os.path.join(base, shard) if base else shard
            if os.path.isabs(shard) or ".." in shard.replace("\\", "/").split("/") or "\x00" in shard:
                findings.append(
                    finding("integrity.path-escape", name,
                            f"{name} puts {len(tensors)} tensor(s) in {shard!r}, outside the checkpoint directory; "
                            "not read", shard=shard, tensors=sorted(tensors)[:20])
                )
                continue
            if rel not in ckpt.files:
                findings.append(
                    finding("integrity.incomplete", rel,
                            f"{name} puts {len(tensors)} tensor(s) in {rel}, which is missing",
                            tensors=sorted(tensors)[:20])
                )
                continue
            part = parts.get(rel)
            if part is None or not isinstance(part.tree, dict):
                continue  # unreadable shard: its own finding says why
            absent = [t for t in tensors if t not in part.tree]
            if absent:
                findings.append(
                    finding("integrity.incomplete", rel,
                            f"{rel} lacks {len(absent)} tensor(s) that {name} puts there, e.g. {absent[0]}",
                            tensors=sorted(absent)[:20])
                )
    return findings
