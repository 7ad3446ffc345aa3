"""Checkpoints written by :mod:`ckptaudit.store`: the files match ``manifest.json``, the components it lists are
there, and a temporary directory of a save that never committed is called what it is."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence

from ckptaudit.catalogue import finding
from ckptaudit.formats import manifest as mf
from ckptaudit.formats import storelayout as layout
from ckptaudit.formats.base import Checkpoint
from ckptaudit.layouts import View
from ckptaudit.model import ComponentKind, Finding, TensorRecord

__all__ = ["check_manifest", "uncommitted"]

_PER_RANK = {"rng": "rng", "data-progress": "data"}


def uncommitted(path: str) -> Finding | None:
    """``store.uncommitted`` when ``path`` carries one of the writer's temporary names."""
    name = os.path.basename(os.path.normpath(path))
    parsed = layout.parse_step_name(name)
    if parsed is None or parsed[1] == "committed":
        return None
    has_meta = os.path.isfile(os.path.join(path, ".metadata"))
    has_manifest = os.path.isfile(os.path.join(path, layout.MANIFEST))
    if parsed[1] == "partial":
        state = ("it has DCP's .metadata" + (" and a manifest" if has_manifest else "")
                 + ", so plain torch.distributed.checkpoint would call it complete, but not every rank voted to "
                 "commit" if has_meta else "it has no .metadata: the ranks were still writing")
        why = f"temporary directory of the save of step {parsed[0]}, which never committed ({state})"
    elif parsed[1] == "deleting":
        why = f"step {parsed[0]} being deleted by retention"
    else:
        why = f"step {parsed[0]} moved aside while being replaced (overwrite)"
    return finding("store.uncommitted", name, f"{name}: {why}; never resumable, and the next save removes it",
                   step=parsed[0], kind=parsed[1])


def check_manifest(ckpt: Checkpoint, view: View, records: Sequence[TensorRecord] = (), *,
                   hashes: bool = True) -> list[Finding]:
    """Verify a checkpoint of :mod:`ckptaudit.store` against its manifest.

    Missing or shorter files are ``integrity.incomplete``; changed ones ``integrity.corrupt`` (naming the items
    whose bytes changed); a component the manifest lists but the checkpoint lacks is ``component.missing``.
    ``records`` (from a scan) lets unsharded tensors be matched against the values hashed in memory at save
    time. Checkpoints without our manifest get no finding here.
    """
    findings: list[Finding] = []
    temp = uncommitted(ckpt.read_path) if os.path.isdir(ckpt.read_path) else None
    if temp is not None:
        findings.append(temp)
    m = view.manifest
    if not mf.is_manifest(m):
        return findings
    assert m is not None
    problem = mf.schema_problem(m)
    if problem:
        findings.append(finding("integrity.corrupt", layout.MANIFEST, f"{layout.MANIFEST}: {problem}"))
        return findings
    # Behind a URL the files are read through their stand-ins, whose bytes come from the object store.
    findings += mf.verify_files(ckpt.read_path, m, hashes=hashes,
                                read_into=ckpt.maps.read_into if ckpt.local_path else None)
    findings += _inventory(ckpt, view, m)
    findings += _content(records, m)
    return findings


def _inventory(ckpt: Checkpoint, view: View, m: dict) -> list[Finding]:  # type: ignore[type-arg]
    out: list[Finding] = []
    comps = m.get("components", {})
    for comp in comps:
        try:
            kind = ComponentKind(comp)
        except ValueError:
            continue  # step, extras, absent: not audit components
        if not view.components.get(kind):
            out.append(finding("component.missing", kind.value,
                               f"the manifest records {kind.value} state, but the checkpoint has none",
                               component=kind.value))
    world = m.get("world_size")
    trees = [p.tree for p in ckpt.parts if p.format == "dcp" and isinstance(p.tree, dict)]
    for comp, key in _PER_RANK.items():
        if comp not in comps or not trees or not isinstance(world, int):
            continue
        held = trees[0].get(key)
        ranks = set(held) if isinstance(held, dict) else set()
        # Bounded by what is on disk: a world_size of 2**31 names at most 64 lost ranks, never one entry each.
        lost = list(itertools.islice((r for r in range(world) if f"rank{r}" not in ranks), 64))
        if lost:
            out.append(finding("component.missing", comp,
                               f"{comp} state of rank(s) {', '.join(map(str, lost[:8]))} is missing; the manifest "
                               f"records it for all {world} ranks", component=comp, ranks=lost))
    return out


def _content(records: Sequence[TensorRecord], m: dict) -> list[Finding]:  # type: ignore[type-arg]
    out: list[Finding] = []
    malformed: list[str] = []
    tensors = m.get("tensors", {})
    for rec in records:
        if rec.hash is None:
            continue
        key = rec.name.replace("/", ".")
        entry = tensors.get(key)
        shards = entry.get("shards") if isinstance(entry, dict) else None
        if not isinstance(shards, list) or len(shards) != 1 or not isinstance(shards[0], dict):
            continue
        saved, sizes = shards[0].get("content_xxh3_128"), shards[0].get("sizes")
        # The values come from a file: compared only when the entry's shape is a list of plain ints.
        if not isinstance(sizes, list) or not all(type(n) is int for n in sizes):
            malformed.append(key)
            continue
        if isinstance(saved, str) and sizes == list(rec.shape) and saved != rec.hash:
            out.append(finding("integrity.corrupt", rec.name,
                               f"{rec.name}: its values differ from those hashed in memory at save time",
                               xxh3_128=rec.hash, expected_xxh3_128=saved))
    if malformed:
        out.append(finding("integrity.corrupt", layout.MANIFEST,
                           f"{layout.MANIFEST}: the entries of {len(malformed)} tensor(s) ({', '.join(malformed[:8])}"
                           f"{', ...' if len(malformed) > 8 else ''}) have a shape (\"sizes\") that is not a list of "
                           "integers: the manifest is damaged, and their values were not compared with those hashed "
                           "at save time", tensors=malformed[:64]))
    return out
