"""``ckptaudit audit``: read a checkpoint, scan every tensor once, run the checks, return a :class:`Report`.

files -> readers (:mod:`ckptaudit.formats`) -> interpretation (:mod:`ckptaudit.layouts`) -> records
(:mod:`ckptaudit.records`, one streaming pass per tensor) -> checks (:mod:`ckptaudit.checks`) -> Report.
"""

from __future__ import annotations

import os
import struct
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptaudit.catalogue import finding
from ckptaudit.checks.artifact import check_artifact
from ckptaudit.checks.components import check_components
from ckptaudit.checks.integrity import check_indexes
from ckptaudit.checks.lr_history import deepspeed_zero_lr_steps
from ckptaudit.checks.manifest import check_manifest
from ckptaudit.checks.optimizer import ELEMENTWISE_STATE, check_attachment, check_steps, may_all_be_unattached
from ckptaudit.checks.precision import MASTER_DTYPES, check_precision, infer_contract
from ckptaudit.formats import open_checkpoint
from ckptaudit.formats.base import Checkpoint, Unreadable, walk
from ckptaudit.formats.tensors import (
    DEFAULT_CHUNK_BYTES,
    FileMaps,
    TensorData,
    iter_chunks,
    read_exact,
    scratch_buffer,
    small_read_plan,
)
from ckptaudit.layouts import SCHEDULER_KEYS, TensorRef, View, file_rule, interpret
from ckptaudit.model import ComponentKind, Finding, Precision, Report, Severity, TensorRecord
from ckptaudit.records import SMALL_TENSOR_BYTES, TensorScan, scan_first_chunk, scan_tensor

__all__ = ["AuditOptions", "ScanOutcome", "ScanPlan", "ScannedCheckpoint", "assemble", "audit", "default_jobs",
           "judge", "plan_scan", "scan_checkpoint", "scan_items"]

Progress = Callable[[int, int], None]
"""Called with (bytes scanned so far, total bytes) as the scan proceeds."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AuditOptions:
    master_dtype: str = "auto"
    """``auto`` reads the contract from the checkpoint; or ``float32``, ``bfloat16``, ``float16``."""
    expect: str = "training"
    """``training`` (a resumable checkpoint) or ``serving`` (an inference artifact)."""
    require: frozenset[ComponentKind] = field(default_factory=frozenset)
    """Components whose absence is an error, beyond model and optimizer."""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    jobs: int = 1
    """Threads scanning tensors at once (the CLI's default: every core available, :func:`default_jobs`). The
    report is the same whatever the number."""
    quick: bool = False
    """The in-loop mode: inventory, attachment, integrity from headers and recorded sizes, and each tensor's
    precision decided from its first chunk; no content hash (``hash`` is ``None``), manifest hashes not
    verified. A tensor rounded after its first chunk, or corrupted beyond it, is not seen: a quick clean is
    not a full clean (the summary says so, and ``extra["mode"]`` is ``"quick"``)."""

    def __post_init__(self) -> None:
        if self.jobs < 1:
            raise ValueError(f"jobs must be at least 1, got {self.jobs}")
        if self.master_dtype not in MASTER_DTYPES:
            raise ValueError(
                f"master dtype {self.master_dtype!r} is not one of {', '.join(MASTER_DTYPES)}"
            )
        if self.expect not in ("training", "serving"):
            raise ValueError(f"expect must be 'training' or 'serving', not {self.expect!r}")


@dataclass
class ScannedCheckpoint:
    """A checkpoint read, interpreted and scanned: what ``audit`` and ``compare`` both start from."""

    ckpt: Checkpoint
    view: View
    records: list[TensorRecord]
    refs: list[TensorRef]
    """``refs[i]`` is the lazy tensor behind ``records[i]``."""
    findings: list[Finding]
    attachment: Any
    steps: dict[Any, float]

    def close(self) -> None:
        self.ckpt.close()


def default_jobs() -> int:
    """The cores this process may run on (``os.sched_getaffinity``), or ``os.cpu_count()`` where that is missing."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True, slots=True)
class ScanOutcome:
    """What scanning one tensor gave: its :class:`TensorScan`, or why its data could not be read."""

    scan: TensorScan | None
    error: str = ""
    """Why the data could not be read (``scan`` is then ``None``)."""
    step: float | None = None
    """The value of a one-element ``step`` state tensor."""


@dataclass
class ScanPlan:
    """A checkpoint opened and interpreted, with every tensor's place in the report: the work to scan.

    ``items[i]`` is ``(ref, component, role, param)``; the records come out in this order whatever order the
    tensors are scanned in, and on whichever rank (see :mod:`ckptaudit.distaudit`).
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


def plan_scan(path: str) -> ScanPlan:
    """Open and interpret ``path`` and work out each tensor's role, reading no tensor data.
    Raises ``FileNotFoundError``."""
    ckpt = open_checkpoint(path)
    view = interpret(ckpt)
    attachment = check_attachment(view)
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


SERIAL_BYTES = 1 << 20
"""Checkpoints up to this many tensor bytes are scanned by one thread whatever ``jobs``: that takes about a
millisecond, less than starting a pool."""
BATCH_BYTES = SMALL_TENSOR_BYTES
"""Tensors up to this size are scanned in batches (:func:`scan_items`): their scan is mostly Python, holding the
GIL, so two threads on them only take turns; one thread on them beside threads streaming large tensors (a few
microseconds of GIL a chunk) keeps every core busy."""
BATCH_COUNT = 256
"""Small tensors in a batch: the hand-out costs nothing, and a checkpoint of small tensors still spreads."""


def scan_items(plan: ScanPlan, indices: Sequence[int], *, jobs: int = 1, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               progress: Progress | None = None, quick: bool = False) -> dict[int, ScanOutcome]:
    """Scan the tensors ``plan.items[i]`` for ``i`` in ``indices`` on ``jobs`` threads.

    Each tensor is streamed in order by one thread (its hash is the sequential xxh3-128 of its bytes, whatever
    ``jobs``); one thread reads in the checkpoint's order. Several share two queues (docs/performance.md, "Two
    threads"): the large tensors, largest first (no thread left alone with a big one at the end), and batches of
    small ones (:data:`BATCH_BYTES`); the first thread takes batches first, the others large tensors first, each
    turning to the other queue when its own is empty. Memory: one chunk buffer per thread. ``progress`` is
    called from the scanning threads, one call at a time; an exception it raises (or any but the
    ``ValueError``/``OSError`` of an unreadable tensor, which is that tensor's outcome) stops every thread after
    its current tensor and is raised here.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    sizes = {i: plan.nbytes(i) for i in indices}
    total = sum(sizes.values())
    out: dict[int, ScanOutcome] = {}
    local = threading.local()  # one read buffer per scanning thread, reused across its tensors

    def one(index: int) -> ScanOutcome:
        data = plan.items[index][0].data
        assert isinstance(data, TensorData)
        try:
            if quick:
                scanned = scan_first_chunk(data, plan.ckpt.maps, chunk_bytes)
            else:
                buffer = getattr(local, "buffer", None)
                if buffer is None and (sizes[index] > SMALL_TENSOR_BYTES or "numpy" in sys.modules):
                    # Not for a small tensor while NumPy is not loaded: scan_tensor may judge it without NumPy.
                    buffer = local.buffer = scratch_buffer(chunk_bytes)
                scanned = scan_tensor(data, plan.ckpt.maps, chunk_bytes, buffer)
        except (ValueError, OSError) as exc:
            return ScanOutcome(None, str(exc))
        step = scalar_value(data, plan.ckpt.maps) if index in plan.step_items else None
        return ScanOutcome(scanned, step=step)

    if jobs == 1 or len(sizes) <= 1 or total <= SERIAL_BYTES:
        done = 0
        for i in sorted(sizes):
            out[i] = one(i)
            done += sizes[i]
            if progress is not None:
                progress(done, total)
        return out
    return _scan_on_threads(sizes, one, jobs, progress, out)


def _scan_on_threads(sizes: dict[int, int], one: Callable[[int], ScanOutcome], jobs: int,
                     progress: Progress | None, out: dict[int, ScanOutcome]) -> dict[int, ScanOutcome]:
    """(main thread) Start the scanning threads of :func:`scan_items`, wait for them, raise what stopped them."""
    large = deque([[i] for i in sorted((i for i in sizes if sizes[i] > BATCH_BYTES), key=lambda i: (-sizes[i], i))])
    small = sorted(i for i in sizes if sizes[i] <= BATCH_BYTES)
    batches = deque([small[lo : lo + BATCH_COUNT] for lo in range(0, len(small), BATCH_COUNT)])
    total = sum(sizes.values())
    failed: list[BaseException] = []
    lock = threading.Lock()
    done = 0

    def work(queues: tuple[deque[list[int]], ...]) -> None:
        nonlocal done
        try:
            for queue in queues:
                while not failed:
                    try:
                        unit = queue.popleft()  # atomic: no lock needed to hand out work
                    except IndexError:
                        break
                    for i in unit:
                        if failed:
                            return
                        out[i] = one(i)  # each index is written by one thread only
                    if progress is not None:
                        with lock:
                            done += sum(sizes[i] for i in unit)
                            progress(done, total)
        except BaseException as exc:  # noqa: BLE001 - raised again by the main thread, after the others stop
            failed.append(exc)

    n = min(jobs, len(large) + len(batches))
    threads = [threading.Thread(target=work, args=((batches, large) if k == 0 else (large, batches),),
                                name=f"ckptaudit-scan-{k}", daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except BaseException as exc:  # KeyboardInterrupt in the main thread: stop the others after their tensor
        failed.append(exc)
        for t in threads:
            t.join()
        raise
    if failed:
        raise failed[0]
    return out


def assemble(plan: ScanPlan, outcomes: dict[int, ScanOutcome]) -> ScannedCheckpoint:
    """The records of ``plan`` in its order, from the scans of every scannable item (``outcomes``)."""
    findings = list(plan.findings)
    records: list[TensorRecord] = []
    refs: list[TensorRef] = []
    steps: dict[Any, float] = {}
    for index, (ref, comp, role, param) in enumerate(plan.items):
        data = ref.data
        refs.append(ref)
        if isinstance(data, Unreadable):
            records.append(TensorRecord(ref.name, comp, role, param, ref.file, "?", (), 0, None, Precision.UNREAD))
            continue
        outcome = outcomes[index]
        if outcome.scan is None:
            findings.append(finding("integrity.corrupt", ref.name, f"{ref.name}: cannot read its data ({outcome.error})",
                                    file=ref.file))
            records.append(TensorRecord(ref.name, comp, role, param, ref.file, data.dtype.name, data.shape,
                                        data.numel, None, Precision.UNREAD))
            continue
        scanned = outcome.scan
        records.append(TensorRecord(ref.name, comp, role, param, ref.file, data.dtype.name, data.shape, data.numel,
                                    scanned.hash, scanned.precision, scanned.stats))
        if outcome.step is not None:
            steps[plan.step_keys[index]] = outcome.step
    view = plan.view
    # Plain-number step counters (optimizers built with capturable=False may store Python floats).
    if view.optimizer is not None:
        for key, entry in view.optimizer.state.items():
            v = entry.get("step")
            if isinstance(v, int | float) and not isinstance(v, bool):
                steps[key] = float(v)
    return ScannedCheckpoint(plan.ckpt, view, records, refs, findings, plan.attachment, steps)


def scan_checkpoint(path: str, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: Progress | None = None,
                    jobs: int = 1, quick: bool = False) -> ScannedCheckpoint:
    """Read ``path`` and scan every tensor once (hash + effective precision; with ``quick``, the precision of
    the first chunk and no hash) on ``jobs`` threads. Raises ``FileNotFoundError``."""
    plan = plan_scan(path)
    try:
        outcomes = scan_items(plan, plan.scannable(), jobs=jobs, chunk_bytes=chunk_bytes, progress=progress,
                              quick=quick)
    except BaseException:
        plan.close()
        raise
    return assemble(plan, outcomes)


def scalar_value(data: TensorData, maps: FileMaps) -> float | None:
    """The value of a one-element tensor (a step counter), or ``None`` if it cannot be read."""
    code = _SCALAR_CODES.get(data.dtype.numpy)
    try:
        plan = small_read_plan(data, 16) if code is not None else None
        if code is not None and plan is not None:  # without NumPy: a small audit need not import it for this
            if len(plan) != 1 or data.numel != 1:
                return None
            piece, pos = plan[0]
            value = struct.unpack(code, read_exact(maps, piece, pos, data.dtype.itemsize))[0]
        else:
            chunk = next(iter(iter_chunks(data, maps)), None)
            if chunk is None or chunk.size != 1:
                return None
            value = chunk[0]
    except (ValueError, OSError):
        return None
    if data.dtype.name == "bfloat16":
        return float(struct.unpack("<f", struct.pack("<I", int(value) << 16))[0])
    if data.dtype.numpy.startswith("u") and data.dtype.is_float:
        return None
    return float(value)


_SCALAR_CODES = {"<f8": "<d", "<f4": "<f", "<f2": "<e", "<i8": "<q", "<i4": "<i", "<i2": "<h", "i1": "<b",
                 "u1": "<B", "<u2": "<H", "<u4": "<I", "<u8": "<Q", "?": "<?"}
"""``struct`` codes of the NumPy types :func:`scalar_value` reads without NumPy (complex ones go through it)."""


def audit(path: str, options: AuditOptions | None = None, *, progress: Progress | None = None) -> Report:
    """Audit the checkpoint at ``path``. Raises ``FileNotFoundError`` when it does not exist."""
    options = options or AuditOptions()
    scanned = scan_checkpoint(path, chunk_bytes=options.chunk_bytes, progress=progress, jobs=options.jobs,
                              quick=options.quick)
    try:
        return judge(scanned, options)
    finally:
        scanned.close()


def judge(s: ScannedCheckpoint, options: AuditOptions) -> Report:
    """Run the checks on a scanned checkpoint and build the report."""
    view = s.view
    findings = list(s.findings)
    findings += check_indexes(s.ckpt, view)
    seen = {(f.code, f.subject) for f in findings}
    findings += [f for f in check_manifest(s.ckpt, view, s.records, hashes=not options.quick)
                 if (f.code, f.subject) not in seen]
    serving_findings, _ = check_artifact(view, options.expect, ckpt=s.ckpt, records=s.records)
    findings += serving_findings
    params = [r for r in s.records if r.component == ComponentKind.MODEL.value and r.role == "parameter"
              and r.precision is not Precision.NOT_FLOAT and r.precision is not Precision.UNREAD]
    moments = [r for r in s.records if r.component == ComponentKind.OPTIMIZER.value
               and (r.role in ELEMENTWISE_STATE or (len(r.shape) >= 1 and r.role != "step"))
               and r.precision not in (Precision.NOT_FLOAT, Precision.UNREAD)]
    params = _masters_in_place(params, s.records, view)
    manifest_dtype = None
    if view.manifest is not None:
        contract_info = view.manifest.get("contract")
        if isinstance(contract_info, dict) and isinstance(contract_info.get("master_dtype"), str):
            manifest_dtype = contract_info["master_dtype"]
    contract, contract_findings = infer_contract(options.master_dtype, params, moments, manifest_dtype)
    components: tuple[Any, ...] = ()
    if options.expect == "training":
        findings += contract_findings
        components, comp_findings = check_components(view, options.require)
        findings += comp_findings
        findings += s.attachment.findings
        findings += check_steps(view.optimizer, s.steps)
        frozen = [r for r in s.records if r.component == ComponentKind.MODEL.value and r.role == "buffer"
                  and r.precision not in (Precision.NOT_FLOAT, Precision.UNREAD)]
        findings += check_precision(params, contract, frozen=frozen,
                                    frozen_why=_FROZEN_WHY.get(s.attachment.status, ""),
                                    before_first_update=before_first_update(s),
                                    not_judged=_maybe_frozen(s, params, contract.master_dtype),
                                    not_judged_why=_NOT_JUDGED_WHY.get(s.attachment.status, ""))
    findings.sort(key=lambda f: (-int(f.severity), f.code, f.subject))
    summary = _summary(s, findings, contract.master_dtype, options)
    if _nothing_recognised(s, components):
        findings, summary, components = _not_a_checkpoint(s, findings)
    return Report(
        command="audit",
        path=s.ckpt.path,
        format=view.layout,
        findings=tuple(findings),
        contract=contract,
        components=components,
        tensors=tuple(s.records),
        summary=summary,
        extra={"files": dict(s.ckpt.files), "attachment": s.attachment.status,
               "step": view.step, "expect": options.expect, **({"mode": "quick"} if options.quick else {})},
    )


_FROZEN_WHY = {
    "by-name": "no optimizer state entry names it",
    "by-param-names": "no optimizer state entry names it",
    "unique-order": "no order-consistent assignment of the index-keyed optimizer state gives it an entry",
    "ambiguous": "no order-consistent assignment of the index-keyed optimizer state gives it an entry",
    "unknown-order": "no entry of the index-keyed optimizer state has its shape",
}
"""How :func:`~ckptaudit.checks.optimizer.check_attachment` decided, by its status, that a model tensor carries no
optimizer state."""


_NOT_JUDGED_WHY = {
    "ambiguous": "an order-consistent assignment of the index-keyed state that fits every entry leaves all such "
                 "parameters out",
    "unknown-order": "the model file keeps no parameter order, and the index-keyed state's shapes fit the other "
                     "parameters",
}


def _maybe_frozen(s: ScannedCheckpoint, params: list[TensorRecord], master: str) -> set[str]:
    """The parameters below a wide master dtype when index-keyed optimizer state may give none of them an entry
    (every one could be frozen); empty when the state decides (a unique attachment, names) or some must be
    trainable."""
    if master not in ("float32", "float64") or s.attachment.status not in _NOT_JUDGED_WHY:
        return set()
    below = {r.param for r in params if r.param is not None
             and (r.dtype in ("bfloat16", "float16") or (r.dtype == "float32"
                                                         and r.precision in (Precision.BF16, Precision.FP16)))}
    return below if may_all_be_unattached(s.view, below) else set()


def before_first_update(s: ScannedCheckpoint) -> str | None:
    """The evidence, in words, that no optimizer update was applied before this save; ``None`` when the
    checkpoint's own state does not show it.

    Shown by: an optimizer whose state is empty (one that keeps state from its first step: Adam's betas, or a
    momentum), or whose every moment is exactly zero with step counters 0 or 1 (``get_state_dict`` fills a fresh
    optimizer's state by its own zero-lr step: step 1, zero moments); and no train step or scheduler step above 0.
    Reads the moments that could be zero (one pass, stopping at the first non-zero byte). Also shown, after
    steps, by a record of the learning rates applied that says every one was 0 (DeepSpeed's WarmupLR from its
    default ``warmup_min_lr`` 0: :mod:`ckptaudit.checks.lr_history`).
    """
    opt = s.view.optimizer
    if opt is not None and s.view.layout == "deepspeed":
        zero_lr = _deepspeed_zero_lr(s, opt.groups)
        if zero_lr is not None:
            return zero_lr
    if opt is None or (s.view.step is not None and s.view.step != 0):
        return None
    epochs = scheduler_steps(s.ckpt)
    if any(e > 0 for e in epochs):
        return None
    said = [f"train step {s.view.step}"] if s.view.step is not None else []
    said += ["scheduler step 0"] if epochs else []
    if not opt.state:
        stateful = any("betas" in g or (isinstance(g.get("momentum"), int | float) and g["momentum"] > 0)
                       for g in opt.groups)
        if not stateful and not said:
            return None  # plain SGD keeps no state even after many steps
        return "; ".join(["the optimizer holds no state", *said])
    if any(v not in (0.0, 1.0) for v in s.steps.values()):
        return None
    moments = [(r, ref) for r, ref in zip(s.records, s.refs, strict=True)
               if r.component == ComponentKind.OPTIMIZER.value and r.role in ELEMENTWISE_STATE]
    if not moments:
        return None
    # Zero moments are 16-bit-representable with no informative value: rule out every other tensor before reading.
    if any(r.precision not in (Precision.INCONCLUSIVE, Precision.NATIVE_16) or not isinstance(ref.data, TensorData)
           for r, ref in moments):
        return None
    if not all(isinstance(ref.data, TensorData) and _all_zero(ref.data, s.ckpt.maps) for _, ref in moments):
        return None
    counters = sorted({f"{v:g}" for v in s.steps.values()})
    return "; ".join([f"all {len(moments)} optimizer moments are exactly zero"
                      + (f", step counters {' and '.join(counters)}" if counters else ""), *said])


def _deepspeed_zero_lr(s: ScannedCheckpoint, groups: Any) -> str | None:
    trees = [p.tree for p in s.ckpt.parts if isinstance(p.tree, dict) and isinstance(p.tree.get("deepspeed"), dict)]
    if len(trees) != 1:
        return None
    facts = trees[0]["deepspeed"]
    return deepspeed_zero_lr_steps(facts.get("ds_config"), trees[0].get("lr_scheduler"), facts, groups)


def _all_zero(data: TensorData, maps: FileMaps) -> bool:
    try:
        plan = small_read_plan(data, SMALL_TENSOR_BYTES)
        if plan is not None:  # without NumPy
            return not any(any(read_exact(maps, p, pos, p.numel * data.dtype.itemsize)) for p, pos in plan)
        import numpy as np

        return not any(np.ascontiguousarray(chunk).view(np.uint8).any() for chunk in iter_chunks(data, maps))
    except (ValueError, OSError):
        return False


def scheduler_steps(ckpt: Checkpoint) -> list[int]:
    """Every learning-rate scheduler's ``last_epoch`` (steps taken; 0 right after construction) the checkpoint
    holds, wherever its layout keeps schedulers (``scheduler*.pt`` files, ``scheduler``/``lr_scheduler(s)`` keys)."""
    trees: list[Any] = []
    for part in ckpt.parts:
        if part.name and file_rule(part.name) is ComponentKind.SCHEDULER:
            trees.append(part.tree)
        elif isinstance(part.tree, dict):
            trees += [v for k, v in part.tree.items() if str(k) in SCHEDULER_KEYS]
    return [leaf for tree in trees for path, leaf in walk(tree)
            if path and path[-1] == "last_epoch" and isinstance(leaf, int) and not isinstance(leaf, bool)]


_NOT_RECOGNISED = ("format.unrecognized",)
"""Only this says "no reader knows it"; ``format.unsupported`` is a known format ckptaudit does not read (legacy
``torch.save``), so such a checkpoint is judged as one."""


def _nothing_recognised(s: ScannedCheckpoint, components: tuple[Any, ...]) -> bool:
    """No tensor, no component, and the readers said only that they recognise nothing (a text file, a folder of
    other files): a checkpoint that is hostile or damaged says more than that and is judged as usual."""
    return (not s.records and not any(c.found for c in components)
            and all(f.code in _NOT_RECOGNISED for f in s.findings))


def _not_a_checkpoint(s: ScannedCheckpoint, findings: list[Finding]) -> tuple[list[Finding], str, tuple[Any, ...]]:
    """Say first that ``path`` is no checkpoint, then why each file was not one; no component is judged missing
    (there is no checkpoint for them to be missing from)."""
    name = os.path.basename(os.path.normpath(s.ckpt.path)) or s.ckpt.path
    per_file = [f for f in findings if f.code in _NOT_RECOGNISED and f.subject != name]
    same = [f for f in findings if f.code in _NOT_RECOGNISED and f.subject == name]
    known = ("torch.save, safetensors, torch.distributed.checkpoint, or a Hugging Face Trainer, Accelerate, "
             "Lightning or torchtitan checkpoint directory")
    detail = "; ".join(f.message for f in same)
    head = finding("format.unrecognized", name,
                   f"{name}: not a checkpoint in any known format ({known})"
                   + (f". Detail: {detail}" if detail else f"; {len(per_file)} file(s) were tried, see below"
                      if per_file else ""),
                   files=sorted(s.ckpt.files))
    rest = [f for f in findings if f.code != "component.missing" and f not in same and f not in per_file]
    summary = f"not a checkpoint: {name} is not in any format ckptaudit reads"
    return [head, *per_file, *rest], summary, ()

def _masters_in_place(params: list[TensorRecord], records: list[TensorRecord], view: View) -> list[TensorRecord]:
    """The records the precision checks judge: where the optimizer keeps a parameter's master copy (Megatron's
    ``fp32_param``), that master is the training state, so it takes the place of the model's 16-bit copy.
    Masters in flat buckets (Megatron's distributed optimizer) belong to no one parameter: they are judged
    themselves, in place of every 16-bit model copy."""
    opt = view.optimizer
    if opt is None or not opt.masters:
        return params
    buckets = {ref.name for ref in opt.unattached_masters}
    usable = [r for r in records if r.component == ComponentKind.OPTIMIZER.value
              and (r.role in opt.masters or r.name in buckets)
              and r.precision is not Precision.NOT_FLOAT and r.precision is not Precision.UNREAD]
    by_param = {r.param: r for r in usable if r.param is not None}
    judged = [by_param.get(r.param, r) if r.param is not None else r for r in params]
    bucket_masters = [r for r in usable if r.name in buckets]
    if bucket_masters:
        judged = [r for r in judged if r.dtype not in ("bfloat16", "float16")] + bucket_masters
    return judged


def _summary(s: ScannedCheckpoint, findings: list[Finding], master: str, options: AuditOptions) -> str:
    errors = sum(f.severity is Severity.ERROR for f in findings)
    warnings = sum(f.severity is Severity.WARNING for f in findings)
    n_params = sum(r.component == "model" and r.role == "parameter" for r in s.records)
    rounded = sum(f.code in ("precision.bf16-rounded", "precision.fp16-rounded",
                             "precision.low-precision-storage") for f in findings)
    verdict = "resumable" if errors == 0 else "NOT resumable as-is"
    if options.expect == "serving":
        verdict = "acceptable serving artifact" if errors == 0 else "NOT an acceptable serving artifact"
    text = (f"{verdict}: {len(s.records)} tensors ({n_params} parameters, master dtype {master}), "
            f"{errors} error(s), {warnings} warning(s)")
    if rounded:
        text += f"; {rounded} parameter(s) below the master precision"
    if options.quick:
        text = ("quick audit (first chunk of each tensor, no content hashes): "
                + (text if errors else f"no defect seen, not a full verdict: {text.split(': ', 1)[1]}"))
    return text
