"""The finding catalogue: every code ckptaudit can report, with its default severity and what it means.

Codes are stable like a linter's rules: a code is never reused for another meaning, and a removed code stays
reserved. ``README.md`` renders this table (``python -m ckptaudit.catalogue`` prints it as Markdown), and a
test checks that the README is in sync and that every code the source emits is listed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptaudit.model import Finding, Severity

E, W, INFO = Severity.ERROR, Severity.WARNING, Severity.INFO


@dataclass(frozen=True, slots=True)
class Rule:
    code: str
    severity: Severity
    summary: str


_RULES: tuple[Rule, ...] = (
    # precision
    Rule("precision.bf16-rounded", E, "Parameters stored in a wider dtype whose values are all bf16-representable "
         "(the low 16 bits of every fp32 value are zero), where full-precision masters are expected: the bits were "
         "lost before saving, typically by capturing the bf16 compute copies."),
    Rule("precision.fp16-rounded", E, "Parameters whose values are all fp16-representable where full-precision "
         "masters are expected."),
    Rule("precision.low-precision-storage", E, "Parameters stored as bf16/fp16 where the contract expects "
         "full-precision masters."),
    Rule("contract.low-precision-masters", INFO, "The checkpoint's own state shows a run with low-precision masters "
         "(parameters and optimizer moments both 16-bit); parameters are held to that contract."),
    Rule("contract.unknown", W, "The master dtype could not be inferred (no optimizer state, mixed dtypes); pass "
         "--master-dtype."),
    # components
    Rule("component.missing", E, "A component of a resumable checkpoint is absent. Model and optimizer are errors; "
         "scheduler, rng and data-progress are warnings unless --require names them."),
    # optimizer attachment
    Rule("optimizer.unmatched", E, "Optimizer state keyed by a parameter name the model does not have, or a "
         "trainable parameter with no optimizer state."),
    Rule("optimizer.shape-mismatch", E, "An optimizer moment's shape differs from its parameter's, or no "
         "order-consistent assignment of index-keyed state to the model's parameters fits the shapes."),
    Rule("optimizer.index-keyed", W, "Optimizer state keyed by integers (optimizer.state_dict()): its attachment "
         "depends on parameter order (pytorch/pytorch#1489)."),
    Rule("optimizer.attachment-unverified", W, "Index-keyed optimizer state fits the model's shapes in more than one "
         "way, or the parameter order is unknown: the attachment cannot be verified offline."),
    Rule("optimizer.step-mismatch", W, "Per-parameter optimizer step counters disagree."),
    # integrity
    Rule("integrity.incomplete", E, "A file or item the checkpoint needs is missing or shorter than recorded (e.g. "
         "a DCP directory without .metadata, a shard whose file is absent)."),
    Rule("integrity.corrupt", E, "Data that cannot be parsed: truncated files, bad headers, sizes that do not "
         "add up, a hash that differs from the manifest."),
    Rule("integrity.path-escape", E, "Checkpoint metadata names a file outside the checkpoint directory (absolute "
         "path, '..', or a link leaving it); the file is not read."),
    # security
    Rule("security.unsafe-pickle", E, "A pickle references a global outside the safe allowlist; it is never "
         "executed, and the file's contents are not loaded."),
    Rule("security.not-loaded", W, "A pickle of a well-known, harmless framework object (e.g. Hugging Face "
         "TrainingArguments) that needs arbitrary code to load; skipped, never executed."),
    # format
    Rule("format.unrecognized", E, "No reader recognises the file or directory as a checkpoint."),
    Rule("format.unsupported", W, "A part of the checkpoint in a format ckptaudit does not read (e.g. legacy "
         "pre-1.6 torch.save); it was skipped."),
    # artifacts
    Rule("artifact.serving", E, "A serving artifact (marked artifact=serving) offered as a training checkpoint."),
    Rule("artifact.no-quality-gate", W, "A serving artifact that records no output-quality gate."),
    Rule("artifact.gate-failed", E, "A serving artifact whose recorded quality gate failed."),
    Rule("artifact.not-serving", E, "--expect serving, but the checkpoint is not marked as a serving artifact."),
    # ---- probe (ckptaudit probe / ckptaudit.probe.Probe: the live job observed at three points) ----
    Rule("probe.saved-compute-copy", E, "The saved tensor equals the compute representation observed inside "
         "forward (the master rounded to the compute dtype), stored in the compute dtype or upcast back, instead "
         "of the sharded master: the exporter saved the FSDP compute copies."),
    Rule("probe.mismatch", E, "The saved tensor equals neither the sharded master nor its compute copy (the "
         "detail says which ranks' shards differ, or that it is the master rounded to another format)."),
    Rule("probe.not-saved", E, "A parameter the job trains is absent from the saved state, or its data could not "
         "be read."),
    Rule("probe.low-precision-masters", INFO, "The sharded masters of the running job are themselves 16-bit: a "
         "low-precision-master run (a different contract, not a defect); faithful means equal to them."),
    Rule("probe.compute-not-master", W, "The compute representation observed inside forward is not the current "
         "master cast to the compute dtype: the probe was armed before an optimizer step, or forward computes "
         "with something other than a cast of the master."),
    Rule("probe.not-observed", INFO, "The armed forward did not use this parameter unsharded (e.g. a parameter "
         "forward does not touch), so its compute representation was not recorded."),
)

CATALOGUE: dict[str, Rule] = {r.code: r for r in _RULES}


def register(rule: Rule) -> None:
    """Add a rule (used by modules that own a family of codes, e.g. ``compare``, ``resume``)."""
    existing = CATALOGUE.get(rule.code)
    if existing is not None and existing != rule:
        raise ValueError(f"finding code {rule.code!r} is already registered with another meaning")
    CATALOGUE[rule.code] = rule


def finding(
    code: str,
    subject: str,
    message: str,
    *,
    severity: Severity | None = None,
    **evidence: Any,
) -> Finding:
    """Make a :class:`Finding` for a catalogued code; ``severity`` overrides the default where a rule says so."""
    rule = CATALOGUE.get(code)
    if rule is None:
        raise KeyError(f"finding code {code!r} is not in the catalogue; add it to ckptaudit.catalogue")
    return Finding(code=code, severity=severity if severity is not None else rule.severity, subject=subject,
                   message=message, evidence=evidence)


def markdown() -> str:
    """The catalogue as a Markdown table (the README's copy is checked against this)."""
    lines = ["| code | default severity | meaning |", "|---|---|---|"]
    for rule in sorted(CATALOGUE.values(), key=lambda r: r.code):
        lines.append(f"| `{rule.code}` | {rule.severity.label} | {rule.summary} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
