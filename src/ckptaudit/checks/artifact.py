"""Training checkpoint or serving artifact: the two are kept apart by the ``artifact`` metadata mark.

ckptaudit's serving export writes safetensors with ``artifact=serving`` and the quality gate it passed (or
failed) in every shard's metadata; see :mod:`ckptaudit.serving.export` for the whole contract. Here:

- offered as a training checkpoint, a marked file is ``artifact.serving`` (error);
- with ``--expect serving``: a gate that passed is clean, a failed one ``artifact.gate-failed``, none at all
  ``artifact.no-quality-gate`` (also for plain weights another tool saved, e.g. bf16 ``save_file``); a
  checkpoint with training state (optimizer, scheduler...) is ``artifact.not-serving``; shards whose serving
  metadata disagree are ``artifact.mixed-shards``; weights whose hashes differ from the ones the gate evaluated
  (``weights_hash``) are ``artifact.weights-changed``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import xxhash

from ckptaudit.catalogue import finding
from ckptaudit.findings import ComponentKind, Finding, TensorRecord
from ckptaudit.formats.base import Checkpoint
from ckptaudit.layouts import View

__all__ = ["HASH_PREFIX", "SERVING_KEYS", "check_artifact", "manifest_hash"]

HASH_PREFIX = "xxh3-128:"
SERVING_KEYS = ("artifact", "dtype", "keep_fp32", "source", "source_hash", "weights_hash", "quality_gate")
"""The metadata every shard of one serving export carries identically."""


def manifest_hash(entries: Iterable[tuple[str, str, Sequence[int], str]]) -> str:
    """xxh3-128 over the sorted lines ``name<TAB>dtype<TAB>shape<TAB>tensor hash``: one hash for a set of tensors,
    independent of file layout and order (``source_hash`` and ``weights_hash`` of a serving export)."""
    lines = sorted(f"{name}\t{dtype}\t{','.join(str(d) for d in shape)}\t{h}\n" for name, dtype, shape, h in entries)
    h = xxhash.xxh3_128()
    for line in lines:
        h.update(line.encode("utf-8"))
    return h.hexdigest()


def _shard_metadata(ckpt: Checkpoint | None) -> list[tuple[str, dict[str, str]]]:
    if ckpt is None:
        return []
    return [(p.name or p.format, p.metadata) for p in ckpt.parts if p.format == "safetensors"]


def check_artifact(view: View, expect: str, *, ckpt: Checkpoint | None = None,
                   records: Sequence[TensorRecord] = ()) -> tuple[list[Finding], bool]:
    """Findings for the artifact kind; returns (findings, whether the checkpoint is marked serving).

    ``ckpt`` lets the check compare the metadata of each shard (``view.metadata`` is their merge); ``records``
    (the scanned tensors) let it verify ``weights_hash``.
    """
    shards = _shard_metadata(ckpt)
    marked = view.metadata.get("artifact") == "serving" or any(m.get("artifact") == "serving" for _, m in shards)
    subject = "artifact"
    if expect == "training":
        if marked:
            return [
                finding(
                    "artifact.serving",
                    subject,
                    "this is a serving artifact (metadata artifact=serving, weights converted to "
                    f"{view.metadata.get('dtype', '16-bit')}): it must not be resumed from; resume from the "
                    f"training checkpoint it was exported from ({view.metadata.get('source', 'unknown')})",
                )
            ], True
        return [], False
    if not marked:
        training_state = view.optimizer is not None or any(k is not ComponentKind.MODEL for k in view.components)
        if view.model is not None and not training_state:
            dtypes = sorted({r.dtype for r in records if r.component == ComponentKind.MODEL.value})
            return [
                finding(
                    "artifact.no-quality-gate",
                    subject,
                    f"model weights ({', '.join(dtypes) or 'unknown dtype'}) with no serving mark and no "
                    "output-quality gate: nothing says their outputs were checked against the full-precision "
                    "model; export them with ckptaudit export-serving, which runs the gate and records it",
                    dtypes=dtypes,
                )
            ], False
        return [
            finding(
                "artifact.not-serving",
                subject,
                "--expect serving, but this is a training checkpoint (it holds "
                f"{', '.join(sorted(k.value for k in view.components)) or 'no model'}) with no artifact=serving "
                "mark; export it with ckptaudit export-serving, which runs the quality gate and records it",
            )
        ], False
    findings = _mixed_shards(shards)
    findings += _weights_changed(view, records)
    gate_raw = view.metadata.get("quality_gate")
    if not gate_raw:
        findings.append(
            finding(
                "artifact.no-quality-gate",
                subject,
                "serving artifact records no output-quality gate: nothing says its outputs were checked "
                "against the full-precision model",
            )
        )
        return findings, True
    from ckptaudit.formats.io.safejson import loads_limited  # here: only a serving artifact's metadata is JSON

    try:
        gate = loads_limited(gate_raw, "quality_gate metadata")
    except ValueError:  # not JSON, digits past Python's limit, nesting or containers past the limits
        return [*findings, finding("integrity.corrupt", subject, "quality_gate metadata is not valid JSON")], True
    if not isinstance(gate, dict) or gate.get("passed") is not True:
        failed = gate.get("failures", []) if isinstance(gate, dict) else []
        if not isinstance(failed, list):
            failed = [failed]
        forced = isinstance(gate, dict) and gate.get("forced")
        findings.append(
            finding(
                "artifact.gate-failed",
                subject,
                "serving artifact records a FAILED quality gate"
                + (f" ({'; '.join(str(f) for f in failed)})" if failed else "")
                + ("; it was written with --force" if forced else ""),
                gate=gate,
            )
        )
    return findings, True


def _mixed_shards(shards: list[tuple[str, dict[str, str]]]) -> list[Finding]:
    """Every shard of one export carries the same serving metadata; a shard that differs was swapped in."""
    if len(shards) < 2:
        return []
    first_name, first = shards[0]
    differing: list[str] = []
    keys: set[str] = set()
    for name, meta in shards[1:]:
        diff = [k for k in SERVING_KEYS if meta.get(k) != first.get(k)]
        if diff:
            differing.append(name)
            keys.update(diff)
    if not differing:
        return []
    return [
        finding(
            "artifact.mixed-shards",
            differing[0],
            f"{len(differing)} shard(s) ({', '.join(differing[:4])}) differ from {first_name} in "
            f"{', '.join(sorted(keys))}: the shards come from different exports, so no single quality gate covers "
            "them; export again",
            shards=differing, keys=sorted(keys),
        )
    ]


def _weights_changed(view: View, records: Sequence[TensorRecord]) -> list[Finding]:
    """The gate evaluated the weights whose manifest hash is ``weights_hash``; the file must still hold them."""
    recorded = view.metadata.get("weights_hash")
    model = [r for r in records if r.component == ComponentKind.MODEL.value]
    if not recorded or not model or any(r.hash is None for r in model):
        return []  # no hash recorded (another tool), or unreadable data (integrity findings say why)
    entries: list[tuple[str, str, Any, str]] = [(r.param or r.name, r.dtype, r.shape, r.hash or "") for r in model]
    actual = HASH_PREFIX + manifest_hash(entries)
    if actual == recorded:
        return []
    return [
        finding(
            "artifact.weights-changed",
            "weights",
            f"the weights differ from those the recorded quality gate evaluated (weights_hash {recorded}, the "
            f"files hash to {actual}): a tensor was changed, added or removed after the export; export again",
            recorded=recorded, actual=actual,
        )
    ]
