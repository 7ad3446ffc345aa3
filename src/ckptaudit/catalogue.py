"""The finding catalogue: every code ckptaudit can report, with its default severity and what it means.

Codes are stable like a linter's rules: a code is never reused for another meaning, and a removed code stays
reserved. ``docs/catalogue.md`` renders this table (``python -m ckptaudit.catalogue`` prints it as Markdown,
``python -m ckptaudit.catalogue --update`` rewrites it there), and a test checks that the page is in sync and that
every code the source emits is listed here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from ckptaudit.findings import Finding, Severity

E, W, INFO = Severity.ERROR, Severity.WARNING, Severity.INFO


@dataclass(frozen=True, slots=True)
class Rule:
    """One finding code: its severity and what it means (docs/catalogue.md)."""

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
    Rule("precision.before-first-update", W, "Full-precision masters whose values are all bf16/fp16-representable "
         "in a checkpoint whose own state shows no optimizer update applied yet (no optimizer state, or all-zero "
         "moments with step counters 0 or 1; train and scheduler step 0; or a DeepSpeed schedule record showing every "
         "step so far applied lr 0): consistent with a start from 16-bit "
         "weights; had the initial weights been fp32, their low bits were lost."),
    Rule("precision.not-optimised", INFO, "A model tensor with no optimizer state (a frozen parameter or a buffer) "
         "stored or rounded below the master dtype: no full-precision master is due for what is never updated."),
    Rule("precision.not-judged", W, "Parameters stored or rounded below the master dtype that index-keyed optimizer "
         "state may leave without an entry (frozen parameters owe no master; trainable ones would have lost bits): "
         "which they are cannot be told offline. Also a 16-bit parameter whose own master dtype the evidence does "
         "not decide in a checkpoint whose parameters have masters of different dtypes."),
    Rule("precision.never-updated", INFO, "Parameters stored or rounded below the master dtype whose every recorded "
         "learning rate is 0 (their param group's lr and initial_lr, the scheduler's base_lrs): no update was ever "
         "applied to them, so they are what was loaded (e.g. a bf16 release) and are judged like frozen parameters."),
    Rule("contract.low-precision-masters", INFO, "A declared or recorded contract of low-precision masters "
         "(ckptaudit's manifest, a stack's record such as DeepSpeed's bf16_master_weights_and_grads); parameters "
         "are held to it."),
    Rule("contract.inferred", W, "No record of the training stack decides the master dtype, and the checkpoint's "
         "tensors look like low-precision masters (parameters and optimizer moments both 16-bit): what a run with "
         "16-bit masters saves, and also what an export that cast a mixed-precision run's state to 16 bits saves. "
         "Held to the 16-bit contract; --master-dtype float32 (a mixed-precision run) or bfloat16/float16 settles "
         "it."),
    Rule("contract.mismatch", E, "The training stack's own record (DeepSpeed's ds_config, Megatron's args, a saved "
         "GradScaler, ckptaudit's manifest) says the run keeps full-precision masters, but the checkpoint's "
         "parameters and optimizer state are 16-bit: the masters were not saved. The message names both."),
    Rule("contract.run-mismatch", E, "The run's other checkpoints (`ckptaudit latest`, or `audit` beside its "
         "siblings) hold full-precision masters, but this one's parameters and optimizer state are 16-bit: judged "
         "alone a bf16-masters run, beside its own run the masters were not saved. The message names the siblings."),
    Rule("contract.per-parameter", INFO, "The optimizer keeps float32 state for some parameters and 16-bit state "
         "for others, each in its parameter's dtype (as torch's optimizers create it): a model holding those "
         "parameters in 16 bits by design. Each parameter is held to its own master dtype; a 16-bit parameter "
         "whose own state is float32 still lost its master's bits."),
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
         "way, or the parameter order is unknown, or the state lies in flat buckets (Megatron's distributed "
         "optimizer): the attachment cannot be verified offline."),
    Rule("optimizer.step-mismatch", W, "Per-parameter optimizer step counters disagree."),
    # integrity
    Rule("integrity.incomplete", E, "A file or item the checkpoint needs is missing or shorter than recorded (e.g. "
         "a DCP directory without .metadata, a shard whose file is absent)."),
    Rule("integrity.corrupt", E, "Data that cannot be parsed: truncated files, bad headers, sizes that do not "
         "add up, a hash that differs from the manifest."),
    Rule("integrity.path-escape", E, "Checkpoint metadata names a file outside the checkpoint directory (absolute "
         "path, '..', or a link leaving it); the file is not read."),
    Rule("integrity.changed", E, "A file of the checkpoint changed while it was audited: the scan found another "
         "version (device, inode, size or mtime) than the one whose header was read, or a rank of a distributed "
         "audit found another size, other bytes or another version than rank 0 had vetted (a save still writing "
         "or overwriting it, or a rank that sees other files at this path), or could not read it. The tensors in "
         "that file (or that rank's share) were not read, so nothing is judged from them; audit again once the "
         "checkpoint is complete."),
    Rule("integrity.link-outside", INFO, "A file or folder of the checkpoint is a symbolic link to a target outside "
         "it (the evidence names the target); it was read from there. Normal for the Hugging Face cache; elsewhere, "
         "check that the target is the file you meant."),
    # security
    Rule("security.unsafe-pickle", E, "A pickle references a global outside the safe allowlist; it is never "
         "executed, and the file's contents are not loaded."),
    Rule("security.unvetted-pickle", E, "A pickle torch would load that ckptaudit cannot vet the way torch reads "
         "it: a legacy (pre-1.6) torch.save file, tar or stream (torch.load unpickles it with its legacy loader), "
         "an archive or DCP item that does not start with a zip header (torch.load takes that legacy path and "
         "unpickles it from byte 0), a TorchScript archive (torch.load hands it to torch.jit.load). Not read, never "
         "executed; re-save it with a current torch.save."),
    Rule("security.not-loaded", W, "A pickle of a well-known, harmless framework object (e.g. Hugging Face "
         "TrainingArguments) that needs arbitrary code to load; skipped, never executed."),
    # DeepSpeed (formats/deepspeed/reader.py, formats/deepspeed/zero.py)
    Rule("deepspeed.masters-missing", E, "A DeepSpeed tag folder whose fp32 masters cannot be found: optimizer "
         "shards (*_optim_states.pt) missing or unreadable, or their partitions do not add up; a resume would fail or "
         "rebuild the masters from the bf16/fp16 module weights."),
    Rule("deepspeed.compute-copies", INFO, "The bf16/fp16 module weights of a DeepSpeed model-states file are the "
         "compute copies; parameters are judged on the fp32 masters rebuilt from the optimizer shards."),
    Rule("deepspeed.not-judged", W, "A DeepSpeed optimizer layout the reader does not map back to parameters "
         "(e.g. the fused fp16 optimizer's fp32_groups_flat): the masters are present but were not judged."),
    Rule("deepspeed.resolved-tag", INFO, "A DeepSpeed root was audited through the tag folder its `latest` file "
         "names."),
    # format
    Rule("format.unrecognized", E, "No reader recognises the file or directory as a checkpoint."),
    Rule("format.unsupported", W, "A part of the checkpoint in a format ckptaudit does not read; it was skipped."),
    # artifacts
    Rule("artifact.serving", E, "A serving artifact (marked artifact=serving) offered as a training checkpoint."),
    Rule("artifact.no-quality-gate", W, "A serving artifact that records no output-quality gate."),
    Rule("artifact.gate-failed", E, "A serving artifact whose recorded quality gate failed."),
    Rule("artifact.not-serving", E, "--expect serving, but the checkpoint is not marked as a serving artifact."),
    # serving export (ckptaudit export-serving, ckptaudit.serving.export) and its audit (checks/artifact.py)
    Rule("artifact.mixed-shards", E, "The shards of a serving artifact carry different serving metadata (dtype, "
         "source, weights hash or quality gate): they come from different exports, so no one gate covers them."),
    Rule("artifact.weights-changed", E, "A serving artifact's weights no longer hash to the weights_hash its quality "
         "gate evaluated: a tensor was changed, added or removed after the export."),
    Rule("gate.failed", E, "The serving export's output-quality gate failed: a metric comparing the exported "
         "model's outputs (logits, embeddings or values) with the full-precision model's is beyond its limit. "
         "Nothing is written (unless --force)."),
    Rule("gate.forced", W, "A serving export whose quality gate failed was written anyway (--force); the failure "
         "is recorded in its metadata, and `audit --expect serving` reports artifact.gate-failed."),
    Rule("gate.no-loss", INFO, "No loss to compare: the recipe has no eval_loss(model, batch) and the evaluation "
         "batch gives no next-token targets (not a 2-D tensor of token ids matching the logits), so the loss "
         "difference was not checked."),
    # resume test (ckptaudit.resume)
    Rule("resume.drift", E, "Resuming from the candidate does not reproduce the uninterrupted run: "
         "its parameters deviate beyond the noise floor of the kernels (by the documented margin)."),
    Rule("resume.loss-looks-normal", W, "The candidate's loss stays within a small threshold of "
         "the uninterrupted run while its parameters drift: a loss curve would not reveal the defect."),
    Rule("resume.reference-not-reproducible", E, "Right after restoring the documented-path reference, its "
         "parameters, or any part of its state the steps use, differ from the saved run's: the documented restore "
         "is not exact (a recipe whose setup changes the model after loading, a data source whose load_state_dict "
         "does not restore its state_dict, a broken storage); candidates cannot be judged. Also for a candidate "
         "whose export started from such a state."),
    Rule("resume.noise-floor", INFO, "The reference's own per-step deviation from the uninterrupted run (kernel "
         "nondeterminism, or reduction order after a world-size change); candidates are judged against it."),
    Rule("resume.no-power", E, "The positive control (the reference's masters rounded to the compute dtype, "
         "resumed like a candidate) does not stand out from the reference's floor after the restore: the recipe's "
         "steps are too noisy to see such a defect, so no candidate is judged (verdict \"not judged\")."),
    Rule("resume.not-restored", E, "Right after the candidate's restore, a component of the job's state that the "
         "steps use (parameters, optimizer moments or step, optimizer hyperparameters, scheduler, a rank's RNG, a "
         "rank's data position, the training step) still holds the fresh job's value: the checkpoint or its loader "
         "does not restore it, and a real resume would start from it. The subject names the component."),
    Rule("resume.restored-differs", E, "Right after the candidate's restore, before any step (no kernel noise "
         "yet), a component of the job's state that the steps use differs from the reference's restored state "
         "(e.g. parameters rounded to bf16). The subject names the component."),
    Rule("resume.unused-state-differs", INFO, "Right after the candidate's restore, a part of the job's state the "
         "uninterrupted steps never use differs from the reference's or is not restored: a generator they never "
         "draw from (Python's, NumPy's, torch's, a CUDA device's), a scheduler they never step, a data source they "
         "never advance. The resumed run does not depend on it, so it is not held against the verdict; a job that "
         "uses it later (an epoch-boundary shuffle) would."),
    Rule("resume.state-borrowed", INFO, "--borrow-state: the candidate was restored over the reference, so "
         "every component its loader did not overwrite came from the reference; only the parameters are judged."),
    Rule("resume.candidate-failed", E, "The candidate could not be written, restored or stepped: its exporter, "
         "its loader or the recipe's steps on it raised (the message names the function and shows the user's "
         "frames of the traceback). The other candidates are still judged."),
    # --- compare (ckptaudit compare REF CAND) -------------------------------------------------------------
    # In a comparison, precision.bf16-rounded / precision.fp16-rounded name each candidate tensor (parameter
    # or optimizer moment) whose values are exactly the reference's rounded to 16 bits.
    Rule("optimizer.misattached", E, "Compared with a reference: the candidate's optimizer state of a parameter "
         "equals the reference's state of another parameter of the same shape (e.g. swapped moments)."),
    Rule("load.silent-cast", W, "Compared with a reference: a tensor whose dtype differs from the reference's; "
         "torch.distributed.checkpoint.load copies it into the template's dtype without a check "
         "(pytorch/pytorch#187138). Info when the values are equal (lossless)."),
    Rule("compare.component-missing", E, "A component the reference has (model, optimizer, scheduler, rng, "
         "data-progress) is absent from the candidate. Error for model and optimizer, warning for the others."),
    Rule("compare.component-extra", INFO, "The candidate has a component the reference lacks (not compared)."),
    Rule("compare.missing", E, "Tensors or values of the reference absent from the candidate (one finding per "
         "component). Error for model and optimizer, warning for the others."),
    Rule("compare.extra", INFO, "Tensors or values only in the candidate (one finding per component)."),
    Rule("compare.shape-mismatch", E, "A tensor whose shape differs between reference and candidate."),
    Rule("compare.different", E, "Tensors or values that differ from the reference other than by a 16-bit "
         "rounding (one finding per component, with max abs / ULP / relative L2 differences). Warning for rng, "
         "info for unclassified entries."),
    # resumable checkpoints: ckptaudit.store writer, `ckptaudit latest` (issue 5)
    Rule("store.uncommitted", E, "A temporary directory of a ckptaudit.store save that never committed (a rank "
         "died or the storage failed before the coordinator's atomic rename), or one being deleted or replaced: "
         "never resumable, even with DCP's .metadata present; the next save removes it."),
    Rule("store.unverified", INFO, "A checkpoint without a ckptaudit manifest: `ckptaudit latest` judged its "
         "completeness from the format's commit marker and recorded sizes; its content was not verified."),
    Rule("guard.quarantined", E, "A checkpoint the in-loop guard (ckptaudit.integrations) audited as it was saved "
         "and found failing, or whose training state descends from an earlier save's damage (damaged_ancestor): "
         "moved to a quarantined-<name> / <name>.quarantined name, which no resume path picks, with its report "
         "beside it (<name>.ckptaudit.json)."),
    Rule("guard.descends-from-damage", E, "A checkpoint whose passport's lineage says its training state descends "
         "from damage: an earlier save of its run failed its audit while the live masters were rounded in memory "
         "(the guard saw it at that save), and every later save carries the damage until the run restores a "
         "checkpoint that passed, even one that passes its own audit. `latest` passes over it (--allow-damaged-"
         "lineage keeps the old choice); the message names the damaged ancestor."),
    Rule("store.pointer-stale", W, "The `latest` pointer names a checkpoint that is missing, not resumable, or "
         "older than the newest resumable one."),
    # ---- passport (ckptaudit attest / verify: a verdict bound to the bytes; docs/passport.md) ----
    Rule("passport.missing", E, "No passport where one is required (`verify`, `latest --require passport`, the "
         "store's loader with require_passport): a directory checkpoint carries ckptaudit.passport.json inside, "
         "a file FILE.passport.json beside it; `ckptaudit attest` writes one."),
    Rule("passport.changed", E, "A file of the checkpoint whose bytes differ from the ones its passport attests "
         "(the evidence names the tensors whose digest changed, where the tensors could be compared)."),
    Rule("passport.file-missing", E, "A file the passport attests is not in the copy verified."),
    Rule("passport.file-extra", E, "A file in the copy verified that the passport does not attest (added after "
         "the audit, or a copy that mixed two checkpoints)."),
    Rule("passport.same-tensors", W, "The copy's files differ from the attested ones but every tensor's "
         "layout-independent digest matches (a DCP folder consolidated into one torch.save, a re-sharded copy): "
         "same tensors, other files. The tensors are the audited ones; the files were not audited."),
    Rule("passport.signature", E, "The passport's signature does not verify with the key given, the passport is "
         "digest-only (unsigned) where a key was given, or its two statements do not name the same root digest: "
         "nothing in it is trusted."),
    Rule("passport.verdict", E, "The passport is intact but records no pass for what the checkpoint is used as "
         "(a failing or not-judged audit, or a training checkpoint used for serving and the reverse)."),
    Rule("passport.malformed", E, "A passport that cannot be read (not JSON, over the size or nesting limits, an "
         "unknown version, a malformed statement): nothing in it is trusted; `verify` exits 2 on it."),
    Rule("passport.unsigned", INFO, "A digest-only passport verified without a key: the bytes are the attested "
         "ones, but anyone could have written it; give the signer's public key (--key) to know who attested."),
    Rule("passport.lineage", W, "The passport says this checkpoint descends from a damaged training state (the "
         "live masters were damaged at an earlier save and never restored since): its own audit may pass, but its "
         "state is not the run's."),
    # ---- probe (ckptaudit probe / ckptaudit.probe.Probe: the live job observed at three points) ----
    Rule("probe.saved-compute-copy", E, "The saved tensor equals the compute representation observed inside "
         "forward (the master rounded to the compute dtype), stored in the compute dtype or upcast back, instead "
         "of the sharded master: bit for bit the compute copy, whether the exporter captured the compute copies "
         "or cast the gathered masters to the compute dtype."),
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


ROOT_CAUSES = ("format", "integrity", "security", "deepspeed")
"""Families whose findings are causes (a file that cannot be read or was not loaded, masters that cannot be
found): listed before what they cause (a component then missing, a parameter then unattached) at each severity."""


def finding_order(f: Finding) -> tuple[int, int, int, str, str]:
    """The reports' order of findings: those that count first, the worst first, root causes first within a
    severity (:data:`ROOT_CAUSES`), then by code and subject."""
    return (int(f.ignored), -int(f.severity), 0 if f.code.split(".", 1)[0] in ROOT_CAUSES else 1, f.code,
            f.subject)


def parse_ignore(entries: str | Iterable[str]) -> tuple[str, ...]:
    """``--ignore`` / ``ignore=``: finding codes (``security.not-loaded``) or families (``optimizer``: every
    ``optimizer.*`` code), as a comma-separated string or an iterable. Raises ``ValueError`` naming an entry that
    matches no catalogued code (a typo must not silently acknowledge nothing)."""
    if isinstance(entries, str):
        entries = entries.split(",")
    out: list[str] = []
    for raw in entries:
        if not isinstance(raw, str):
            raise ValueError(f"ignore entries are finding codes (strings), not {type(raw).__name__}")
        entry = raw.strip()
        if not entry:
            continue
        families = {code.split(".", 1)[0] for code in CATALOGUE}
        if entry not in CATALOGUE and entry not in families:
            import difflib  # here: only a misspelt name needs it, not every start-up

            close = difflib.get_close_matches(entry, [*CATALOGUE, *families], n=1)
            raise ValueError(f"ignore: {entry!r} is neither a finding code nor a family of codes"
                             + (f"; did you mean {close[0]!r}?" if close else "")
                             + f" (the codes are listed in {DOCS_PAGE})")
        if entry not in out:
            out.append(entry)
    return tuple(out)


def is_ignored(code: str, ignore: Collection[str]) -> bool:
    """Whether ``code`` is acknowledged by one of the :func:`parse_ignore` entries ``ignore``."""
    return code in ignore or code.split(".", 1)[0] in ignore


def mark_ignored(findings: Iterable[Finding], ignore: Collection[str]) -> list[Finding]:
    """``findings``, those whose code ``ignore`` acknowledges marked ``ignored`` (kept, in place)."""
    if not ignore:
        return list(findings)
    return [dataclasses.replace(f, ignored=True) if not f.ignored and is_ignored(f.code, ignore) else f
            for f in findings]


def ignore_note(findings: Iterable[Finding]) -> str:
    """``"; N finding(s) ignored (codes)"`` for a summary line, or ``""`` when none is."""
    ignored = [f for f in findings if f.ignored]
    codes = sorted({f.code for f in ignored})
    return f"; {len(ignored)} finding(s) ignored ({', '.join(codes)})" if ignored else ""


def markdown() -> str:
    """The catalogue as a Markdown table (the copy in ``docs/catalogue.md`` is checked against this)."""
    lines = ["| code | default severity | meaning |", "|---|---|---|"]
    for rule in sorted(CATALOGUE.values(), key=lambda r: r.code):
        lines.append(f"| `{rule.code}` | {rule.severity.label} | {rule.summary} |")
    return "\n".join(lines)


DOCS_PAGE = "docs/catalogue.md"
"""The page holding the table between the catalogue markers, relative to the repository root."""


def update_readme(path: str = DOCS_PAGE) -> bool:
    """Rewrite the table between the catalogue markers of ``path``; True when it changed."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    start, end = "<!-- catalogue:start -->", "<!-- catalogue:end -->"
    if start not in text or end not in text:
        raise ValueError(f"{path} has no {start} ... {end} markers; the catalogue table lives in {DOCS_PAGE}")
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    new = f"{head}{start}\n{markdown()}\n{end}{tail}"
    if new != text:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(new)
    return new != text


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--update"]:
        target = sys.argv[2] if len(sys.argv) > 2 else DOCS_PAGE
        try:
            changed = update_readme(target)
        except ValueError as exc:  # e.g. README.md, which held the table before docs/ did
            print(f"{exc}: updating {DOCS_PAGE} instead", file=sys.stderr)
            target, changed = DOCS_PAGE, update_readme(DOCS_PAGE)
        print(f"{target}: " + ("updated" if changed else "unchanged"))
    else:
        print(markdown())
