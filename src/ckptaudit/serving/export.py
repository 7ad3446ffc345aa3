"""Serving export: a training checkpoint's model weights converted to a 16-bit (or narrower) dtype, written as
safetensors behind an output-quality gate, and marked so that nobody resumes training from it.

    ckptaudit export-serving CKPT --recipe module:attr --dtype bfloat16 --out DIR [--keep-fp32 PATTERN ...]

What runs (one process, no process group):

1. scan the training checkpoint once (:func:`ckptaudit.auditing.scan.scan_checkpoint`: every tensor hashed, streaming)
   and derive its content hash from the per-tensor hashes;
2. load the model weights tensor by tensor into the recipe's unwrapped model in fp32 (the full-precision
   reference): a DCP checkpoint is consolidated one tensor at a time from its shards and the optimizer state is
   never loaded; convert each floating tensor to the export dtype, except those matching a ``--keep-fp32`` glob;
3. quality gate (:mod:`ckptaudit.serving.gate`): both models on the evaluation batch, on the same device, through
   the recipe's ``forward`` (and ``eval_loss``); the exported model's floating inputs are cast to its compute
   dtype as a serving runtime's would be (integer inputs such as token ids are left alone), and its floating
   outputs upcast to fp32 (exactly) for the comparison and the recipe's loss;
4. only if the gate passed (or with ``--force``): write the shards into a temporary sibling directory, fsync,
   and rename it to ``DIR``. A failure at any point leaves no ``DIR`` behind.

The metadata contract (each shard's safetensors ``__metadata__``; the index's ``metadata`` repeats it), read by
:mod:`ckptaudit.checks.artifact`: ``artifact=serving``, ``dtype``, ``keep_fp32`` (JSON list of globs),
``source`` (absolute path), ``source_hash``, ``weights_hash``, ``tool``, ``recipe``, ``quality_gate`` (JSON:
``passed``, ``failures``, ``metrics``, ``thresholds``, ``batch``, ``device``, ``forced``) and ``format=pt``
(Hugging Face ``from_pretrained`` refuses safetensors without it).

One module though just over ~600 lines: the steps above are one linear pipeline sharing :class:`ExportOptions`,
:class:`ExportError` and the recipe's model, and the gate's metrics already live in :mod:`ckptaudit.serving.gate`.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash
from torch import nn

from ckptaudit.catalogue import finding
from ckptaudit.checks.artifact import HASH_PREFIX, manifest_hash
from ckptaudit.findings import Finding, RawReport
from ckptaudit.serving.gate import (
    GateResult,
    GateThresholds,
    compare_outputs,
    judge_gate,
    next_token_targets,
    output_kind,
)
from ckptaudit.store import durable
from ckptaudit.version import __version__

__all__ = [
    "EXPORT_DTYPES",
    "ExportError",
    "ExportOptions",
    "ExportResult",
    "convert_name",
    "export_serving",
    "parse_size",
    "plan_shards",
    "tensor_hash",
    "write_artifact",
]

EXPORT_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    # Unscaled float8 is too coarse for most models' weights: it exists so the gate can be seen refusing it.
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
"""Storage dtypes an export may convert to."""

_COMPUTE_DTYPE = {"float8_e4m3fn": torch.bfloat16, "float8_e5m2": torch.bfloat16}
"""The dtype a runtime computes in for storage dtypes nobody computes in (float8 weights are upcast)."""

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 << 30

class ExportError(ValueError):
    """The export cannot run (bad options, a recipe that cannot evaluate, a checkpoint without the weights the
    model needs, an output directory in the way). The message names the thing, the value and the fix."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportOptions:
    recipe: str
    """``module:attr`` or ``path.py:attr`` of a recipe with ``build_model()`` (see :mod:`ckptaudit.recipes`)."""
    out: str
    """The artifact directory to create; it must not exist, or be empty. Never overwritten."""
    dtype: str = "bfloat16"
    """One of :data:`EXPORT_DTYPES`."""
    keep_fp32: tuple[str, ...] = ()
    """Glob patterns (``fnmatch``) of tensor names kept in fp32, e.g. ``*ln*`` or ``*norm*``."""
    force: bool = False
    """Write the artifact even when the gate fails, with the failure recorded in its metadata."""
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    """Shards are cut before a tensor that would take a shard past this size (a larger tensor gets its own)."""
    eval_batch: str | None = None
    """A ``torch.save`` file holding the evaluation batch (what the recipe's ``forward`` takes: a tensor, or a
    tuple, list or dict of tensors); default: the recipe's ``eval_batch(None)``."""
    device: str = "cpu"
    """Where both models run for the gate."""
    thresholds: GateThresholds = field(default_factory=GateThresholds)
    convert: Callable[[str, torch.Tensor, torch.dtype], torch.Tensor] | None = None
    """A custom conversion ``(name, tensor, dtype) -> tensor of that dtype`` (your own rounding or quantiser: the
    thing the gate is for); default ``tensor.to(dtype)``. Not applied to the ``keep_fp32`` tensors."""
    passport: bool = True
    """Write the artifact's passport (``docs/passport.md``): its audit, the gate's results, the source's passport."""
    passport_key: str | None = None
    """A PEM EC private key to sign the passport with (the ``[sign]`` extra); ``None``: digest-only."""

    def __post_init__(self) -> None:
        if self.dtype not in EXPORT_DTYPES:
            raise ExportError(f"--dtype {self.dtype!r} is not supported; choose one of {', '.join(EXPORT_DTYPES)}")
        if self.max_shard_bytes < 1:
            raise ExportError(f"--max-shard-size must be positive, got {self.max_shard_bytes} bytes")
        if not self.out:
            raise ExportError("--out is empty; name the directory the serving artifact goes to")
        try:
            torch.device(self.device)
        except RuntimeError:
            raise ExportError(f"--device {self.device!r} is not a torch device; use cpu, cuda or cuda:N") from None
        for pattern in self.keep_fp32:
            if not pattern:
                raise ExportError("--keep-fp32 got an empty pattern; give a glob such as '*norm*'")


@dataclass(frozen=True, slots=True)
class WrittenFile:
    name: str
    tensors: int
    bytes: int


@dataclass(frozen=True)
class ExportResult:
    source: str
    out: str
    dtype: str
    written: bool
    gate: GateResult
    files: tuple[WrittenFile, ...]
    tensors: int
    kept_fp32: tuple[str, ...]
    ignored: tuple[str, ...]
    """Checkpoint model tensors the recipe's model does not have (not exported)."""
    metadata: dict[str, str]
    batch: str
    device: str
    passport: str | None = None
    """The artifact's passport file, when one was written."""

    @property
    def exit_code(self) -> int:
        return 0 if self.gate.passed else 1

    def report(self) -> RawReport:
        findings: list[Finding] = []
        for check in self.gate.checks:
            if not check.passed:
                findings.append(finding("gate.failed", check.metric, check.describe(), value=check.value,
                                        limit=check.limit))
        if self.gate.metrics.nonfinite:
            findings.append(finding("gate.failed", "logits", self.gate.failures[0],
                                    nonfinite=self.gate.metrics.nonfinite))
        if self.written and not self.gate.passed:
            findings.append(finding("gate.forced", self.out, f"written despite the failed gate (--force) to "
                                    f"{self.out}; the failure is recorded in its metadata"))
        if self.gate.metrics.loss_diff is None:
            findings.append(finding("gate.no-loss", self.batch, "no loss to compare: the recipe has no "
                                    "eval_loss(model, batch) and the evaluation batch is not a (batch, sequence) "
                                    "tensor of token ids, so the loss difference was not checked"))
        findings.sort(key=lambda f: (-int(f.severity), f.code, f.subject))
        total = sum(f.bytes for f in self.files)
        if self.written:
            where = (f"{self.dtype} serving artifact written to {self.out} ({self.tensors} tensors"
                     f"{f', {len(self.kept_fp32)} kept in fp32' if self.kept_fp32 else ''}, "
                     f"{len(self.files)} file(s), {total / 2**20:.2f} MiB)")
        else:
            where = f"nothing written to {self.out}"
        verdict = "quality gate passed" if self.gate.passed else "quality gate FAILED"
        gate_rows = [[c.metric, c.shown(),
                      f"{'<=' if c.kind == 'max' else '>='} {c.limit:g}", c.flag, "ok" if c.passed else "FAILED"]
                     for c in self.gate.checks]
        m = self.gate.metrics
        sections: list[dict[str, Any]] = [{
            "title": f"quality gate: {self.dtype} vs fp32 on {m.describe()} ({self.device})",
            "columns": ["metric", "value", "limit", "flag", "result"],
            "rows": gate_rows,
        }]
        if self.files:
            sections.append({"title": "files", "columns": ["file", "tensors", "bytes"],
                             "rows": [[f.name, f.tensors, f.bytes] for f in self.files]})
        doc: dict[str, Any] = {
            "source": self.source, "out": self.out, "dtype": self.dtype, "written": self.written,
            "gate": {**self.gate.as_dict(), "batch": self.batch, "device": self.device},
            "files": [{"name": f.name, "tensors": f.tensors, "bytes": f.bytes} for f in self.files],
            "tensors": self.tensors, "kept_fp32": list(self.kept_fp32), "ignored": list(self.ignored),
            "metadata": self.metadata,
        }
        return RawReport(command="export-serving", path=self.out, format="safetensors", findings=tuple(findings),
                      summary=f"{verdict}: {where}", extra={"serving": doc, "sections": sections})


# ----------------------------------------------------------------------------------------------------------------
# Small pure helpers

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``2GiB``, ``500MB``, ``1.5GB``, ``4096`` -> bytes (``KB``/``MB``/``GB`` are powers of 1000, ``KiB``/... of
    1024, as Hugging Face's ``max_shard_size`` reads them)."""
    m = _SIZE.match(text)
    if m is None:
        raise ExportError(f"--max-shard-size {text!r} is not a size; write e.g. 2GiB, 500MB or 1048576")
    number, unit = float(m.group(1)), (m.group(2) or "b").lower()
    if unit == "b":
        scale = 1
    else:
        power = "kmgt".index(unit[0]) + 1
        scale = (1024 if "i" in unit else 1000) ** power
    value = int(number * scale)
    if value < 1:
        raise ExportError(f"--max-shard-size {text!r} is below one byte")
    return value


def tensor_hash(t: torch.Tensor) -> str:
    """xxh3-128 of a tensor's elements as stored (little-endian, row-major): the hash the audit records."""
    flat = t.detach().contiguous().cpu().reshape(-1)
    if flat.numel() == 0:
        return xxhash.xxh3_128().hexdigest()
    raw: np.ndarray = flat.view(torch.uint8).numpy()
    return xxhash.xxh3_128(raw.data.cast("B")).hexdigest()


def _glob_match(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


# ----------------------------------------------------------------------------------------------------------------
# The export


def export_serving(source: str, options: ExportOptions, *, log: Callable[[str], None] | None = None) -> ExportResult:
    """Export the model weights of the training checkpoint at ``source`` (see the module docstring).

    Raises :class:`ExportError` when the export cannot run, ``FileNotFoundError`` when ``source`` does not exist.
    A failed gate is not an exception: the result says so, and nothing was written unless ``options.force``.
    """
    from ckptaudit.auditing.scan import scan_checkpoint

    say = log or (lambda _msg: None)
    if not os.path.exists(source):
        raise FileNotFoundError(source)
    out = os.path.abspath(options.out)
    _check_out(out)
    if options.passport and options.passport_key:  # a key that does not load stops the export before it starts
        from ckptaudit.passport import PassportError
        from ckptaudit.passport.statements import load_private_key

        try:
            load_private_key(options.passport_key)
        except PassportError as exc:
            raise ExportError(f"--passport-key: {exc}") from None
    recipe = _load_serving_recipe(options.recipe)
    storage = EXPORT_DTYPES[options.dtype]
    say(f"scan {source}")
    scanned = scan_checkpoint(source)
    try:
        view = scanned.view
        if view.metadata.get("artifact") == "serving":
            raise ExportError(f"{source} is already a serving artifact ({view.metadata.get('dtype')}); export from "
                              f"the training checkpoint it came from ({view.metadata.get('source', 'unknown')})")
        if view.model is None:
            raise ExportError(f"{source}: no model weights found (layout {view.layout}); point export-serving at a "
                              "training checkpoint that holds the model")
        source_hash = HASH_PREFIX + manifest_hash(
            (r.name, r.dtype, r.shape, r.hash or "unread") for r in scanned.records)
        say(f"load the model weights into {options.recipe}'s model (fp32) and convert them to {options.dtype}")
        reference, exported, kept, ignored = _load_and_convert(recipe, scanned, storage, options)
    finally:
        scanned.close()
    batch, batch_label = _eval_batch(recipe, options)
    say(f"quality gate on {batch_label} ({options.device})")
    gate = _run_gate(recipe, reference, exported, batch, options)
    del reference
    gate_doc = {**gate.as_dict(), "batch": batch_label, "device": options.device,
                "forced": bool(options.force and not gate.passed)}
    weights_hash = HASH_PREFIX + manifest_hash(
        (name, _dtype_name(t.dtype), tuple(t.shape), tensor_hash(t)) for name, t in exported.items())
    metadata = {
        "format": "pt",
        "artifact": "serving",
        "dtype": options.dtype,
        "keep_fp32": json.dumps(list(options.keep_fp32)),
        "source": os.path.abspath(source),
        "source_hash": source_hash,
        "weights_hash": weights_hash,
        "tool": f"ckptaudit {__version__}",
        "recipe": options.recipe,
        "convert": convert_name(options),
        "quality_gate": json.dumps(gate_doc, sort_keys=True),
    }
    files: tuple[WrittenFile, ...] = ()
    written = False
    if gate.passed or options.force:
        say(f"write {out}")
        files = write_artifact(out, exported, metadata, options.max_shard_bytes)
        written = True
    passport = _write_passport(source, out, gate_doc, options, say) if written and options.passport else None
    return ExportResult(os.path.abspath(source), out, options.dtype, written, gate, files, len(exported),
                        tuple(kept), tuple(ignored), metadata, batch_label, options.device, passport)


def _write_passport(source: str, out: str, gate_doc: dict[str, Any], options: ExportOptions,
                    say: Callable[[str], None]) -> str | None:
    """The serving artifact's passport: audited as a serving artifact, with the gate's results and the digest of
    the training checkpoint's passport when it has one (that file's bytes, as a descendant names its parent)."""
    from ckptaudit.ondisk.passport import find_passport
    from ckptaudit.passport import PassportError, ServingInfo, attest
    from ckptaudit.passport.document import read_passport_bytes

    found, digest = find_passport(source), None
    try:
        digest = None if found is None else "sha256:" + hashlib.sha256(read_passport_bytes(found)).hexdigest()
    except (PassportError, OSError) as exc:
        say(f"the training checkpoint's passport {found} cannot be read ({exc}); not recorded")
    try:
        p = attest(out, key=options.passport_key, artifact="serving",
                   serving=ServingInfo(gate_doc, os.path.abspath(source), digest))
    except PassportError as exc:
        raise ExportError(f"{out} was written, but its passport could not be: {exc}") from None
    say(f"passport {p.file} ({'signed' if p.signed else 'digest-only'}, verdict {p.verdict})")
    return p.file


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_out(out: str) -> None:
    if os.path.lexists(out) and not (os.path.isdir(out) and not os.path.islink(out) and not os.listdir(out)):
        raise ExportError(f"--out {out} already exists and is not an empty directory; the export never overwrites "
                          "anything: choose a new directory or remove that one")
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise ExportError(f"--out {out}: its parent directory {parent} does not exist; create it first")


def _load_serving_recipe(spec: str) -> Any:
    from ckptaudit.recipes import load_object

    try:
        obj = load_object(spec)
    except ValueError as exc:
        raise ExportError(f"--recipe {exc}") from None
    if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "build_model")):
        obj = obj()
    if not callable(getattr(obj, "build_model", None)):
        raise ExportError(f"--recipe {spec!r} has no build_model(): the serving gate needs the recipe's unwrapped "
                          "model to evaluate (add build_model() -> nn.Module; see ckptaudit.recipes)")
    return obj


def _build_model(recipe: Any) -> nn.Module:
    model = recipe.build_model()
    if not isinstance(model, nn.Module):
        raise ExportError(f"the recipe's build_model() returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _find_ref(params: dict[str, Any], key: str) -> Any:
    """The checkpoint tensor for the model's ``key``: exact, without wrapper prefixes, or a unique suffix match
    (a Lightning module holding the model as ``self.model``)."""
    from ckptaudit.layouts import normalize_fqn

    if key in params:
        return params[key]
    norm = normalize_fqn(key)
    by_norm = [r for k, r in params.items() if normalize_fqn(k) == norm]
    if len(by_norm) == 1:
        return by_norm[0]
    by_suffix = [r for k, r in params.items() if normalize_fqn(k).endswith("." + norm)]
    return by_suffix[0] if len(by_suffix) == 1 else None


def _load_and_convert(recipe: Any, scanned: Any, storage: torch.dtype, options: ExportOptions
                      ) -> tuple[nn.Module, dict[str, torch.Tensor], list[str], list[str]]:
    """Read each model tensor once: copy it into the fp32 reference model, convert it for the export."""
    from ckptaudit.formats.io.tensors import TensorData
    from ckptaudit.formats.torchload import materialize
    from ckptaudit.layouts import normalize_fqn

    view = scanned.view
    model = _build_model(recipe).float().eval()
    wanted = model.state_dict(keep_vars=True)
    params = view.model.params
    exported: dict[str, torch.Tensor] = {}
    kept: list[str] = []
    used: set[int] = set()
    missing: list[str] = []
    for key, current in wanted.items():
        ref = _find_ref(params, key)
        if ref is None:
            missing.append(key)
            continue
        if not isinstance(ref.data, TensorData):
            raise ExportError(f"{ref.name}: its data could not be read ({ref.data.reason}); audit the checkpoint "
                              "and export from an intact copy")
        if tuple(ref.data.shape) != tuple(current.shape):
            raise ExportError(f"{ref.name} has shape {list(ref.data.shape)}, the recipe's model expects "
                              f"{list(current.shape)} for {key}: wrong --recipe for this checkpoint?")
        try:
            value = materialize(ref.data, scanned.ckpt.maps)
        except (ValueError, OSError) as exc:
            raise ExportError(f"{ref.name}: cannot read its data ({exc}); audit the checkpoint") from None
        used.add(id(ref))
        with torch.no_grad():
            current.copy_(value.to(current.dtype))
        if value.dtype.is_floating_point:
            if _glob_match(key, options.keep_fp32):
                exported[key] = value.to(torch.float32).contiguous()
                kept.append(key)
            else:
                exported[key] = _convert(options, key, value, storage)
        else:
            exported[key] = value.contiguous()
        del value
    if missing:
        raise ExportError(f"the checkpoint lacks {len(missing)} tensor(s) the recipe's model has, e.g. "
                          f"{missing[0]!r} (checkpoint has e.g. {next(iter(params))!r}): wrong --recipe?")
    unmatched = [p for p in options.keep_fp32 if not any(fnmatch.fnmatchcase(k, p) for k in exported)]
    if unmatched:
        raise ExportError(f"--keep-fp32 {unmatched[0]!r} matches no tensor of the model (names look like "
                          f"{next(iter(exported))!r}); fix the pattern")
    ignored = [normalize_fqn(k) for k, r in params.items() if id(r) not in used]
    return model, exported, kept, ignored


def convert_name(options: ExportOptions) -> str:
    """How the tensors were converted, as recorded in the metadata."""
    fn = options.convert
    if fn is None:
        return "torch.Tensor.to"
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def _convert(options: ExportOptions, key: str, value: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    if options.convert is None:
        return value.to(storage).contiguous()
    out = options.convert(key, value, storage)
    if not isinstance(out, torch.Tensor) or out.dtype != storage or tuple(out.shape) != tuple(value.shape):
        got = f"{out.dtype} {list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ExportError(f"--convert {convert_name(options)} returned {got} for {key}; it must return a tensor of "
                          f"dtype {_dtype_name(storage)} and shape {list(value.shape)}")
    return out.detach().cpu().contiguous()


def _eval_batch(recipe: Any, options: ExportOptions) -> tuple[Any, str]:
    if options.eval_batch:
        from ckptaudit.formats.dcp.reader import UnsafeCheckpointError
        from ckptaudit.formats.torchload import vetted_torch_load

        path = options.eval_batch
        if not os.path.isfile(path):
            raise ExportError(f"--eval-batch {path}: no such file; give a torch.save file of the batch the recipe's "
                              "forward takes")
        try:
            batch = vetted_torch_load(path)
        except (ValueError, UnsafeCheckpointError) as exc:
            raise ExportError(f"--eval-batch {path}: {exc}") from None
        if not _has_tensor(batch):
            raise ExportError(f"--eval-batch {path} holds a {type(batch).__name__} without a tensor; save the "
                              "batch the recipe's forward takes (a tensor, or a tuple, list or dict of tensors)")
        return batch, os.path.basename(path)
    fn = getattr(recipe, "eval_batch", None)
    if not callable(fn):
        raise ExportError("the recipe has no eval_batch(); give --eval-batch FILE.pt (a torch.save file of the batch "
                          "the model takes) or add eval_batch(job) to the recipe")
    # Offline there is no live job: the recipe receives None.
    return fn(None), "recipe eval_batch"


def _has_tensor(batch: Any) -> bool:
    if isinstance(batch, torch.Tensor):
        return True
    if isinstance(batch, (tuple, list)):
        return any(_has_tensor(v) for v in batch)
    if isinstance(batch, dict):
        return any(_has_tensor(v) for v in batch.values())
    return False


def _eval_model(recipe: Any, exported: dict[str, torch.Tensor], compute: torch.dtype) -> nn.Module:
    """The recipe's model holding the exported tensors as a serving runtime would compute with them.

    Every tensor computes in the export dtype (float8 is upcast to bf16 first, as runtimes do), except the ones
    kept in fp32: a module holding one computes in fp32, its inputs upcast and its outputs cast back.
    """
    model = _build_model(recipe).to(compute).eval()
    state = {k: (t.to(compute) if t.dtype.is_floating_point and t.dtype not in (compute, torch.float32) else t)
             for k, t in exported.items()}
    model.load_state_dict(state, strict=True, assign=True)
    # As a serving runtime feeds it: floating inputs in the compute dtype (token ids untouched); its floating
    # outputs upcast to fp32 (exact) so that the comparison and the recipe's eval_loss see the same dtype as
    # the full-precision model's. Prepended/appended so that a kept-fp32 root's own casts run inside these.
    model.register_forward_pre_hook(_cast_inputs(compute), with_kwargs=True, prepend=True)
    model.register_forward_hook(_cast_outputs(torch.float32))
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False)] + [b for b in module.buffers(recurse=False)]
        if not any(t.is_floating_point() and t.dtype == torch.float32 for t in own):
            continue
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_floating_point() and p.dtype != torch.float32:  # exact upcast of the module's 16-bit tensors
                setattr(module, name, nn.Parameter(p.detach().float(), requires_grad=False))
        module.register_forward_pre_hook(_cast_inputs(torch.float32), with_kwargs=True)
        module.register_forward_hook(_cast_outputs(compute))
    return model


def _cast_tree(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_cast_tree(v, dtype) for v in value)
    if isinstance(value, list):
        return [_cast_tree(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: _cast_tree(v, dtype) for k, v in value.items()}
    return value


def _cast_inputs(dtype: torch.dtype) -> Callable[..., Any]:
    def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return _cast_tree(args, dtype), _cast_tree(kwargs, dtype)

    return hook


def _cast_outputs(dtype: torch.dtype) -> Callable[..., Any]:
    def hook(_module: nn.Module, _args: Any, output: Any) -> Any:
        return _cast_tree(output, dtype)

    return hook


def _outputs(recipe: Any, model: nn.Module, batch: Any) -> torch.Tensor:
    from ckptaudit.recipes import model_forward

    with torch.no_grad():
        out = model_forward(recipe, model, batch)
    if isinstance(out, dict) and "logits" in out:
        out = out["logits"]
    elif hasattr(out, "logits"):
        out = out.logits
    if not isinstance(out, torch.Tensor):
        raise ExportError(f"the recipe's model returned {type(out).__name__}, not a tensor; give the recipe "
                          "forward(model, batch) -> Tensor (the output to compare: logits, embeddings, values)")
    return out


def _loss(recipe: Any, model: nn.Module, batch: Any) -> float | None:
    fn = getattr(recipe, "eval_loss", None)
    if not callable(fn):
        return None
    with torch.no_grad():
        loss = fn(model, batch)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return float(loss.detach().double())
    if isinstance(loss, (float, int)) and not isinstance(loss, bool):
        return float(loss)
    got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
    raise ExportError(f"the recipe's eval_loss(model, batch) returned {got}; it must return one number (a float "
                      "or a 0-dim tensor)")


def _run_gate(recipe: Any, reference: nn.Module, exported: dict[str, torch.Tensor], batch: Any,
              options: ExportOptions) -> GateResult:
    from ckptaudit.recipes import to_device

    device = torch.device(options.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ExportError(f"--device {options.device}: CUDA is not available here; use --device cpu")
    compute = _COMPUTE_DTYPE.get(options.dtype, EXPORT_DTYPES[options.dtype])
    on_device = to_device(batch, device)
    declared = getattr(recipe, "output_kind", None)
    try:
        reference.to(device)
        ref_out = _outputs(recipe, reference, on_device).float().cpu()
        ref_loss = _loss(recipe, reference, on_device)
        reference.cpu()
        model = _eval_model(recipe, exported, compute).to(device)
        exp_out = _outputs(recipe, model, on_device).float().cpu()
        exp_loss = _loss(recipe, model, on_device)
        del model
    except ExportError:
        raise
    except (RuntimeError, IndexError, TypeError, ValueError) as exc:
        raise ExportError(f"the recipe's model failed on the evaluation batch ({type(exc).__name__}: {exc}); check "
                          "the batch (what eval_batch returns or --eval-batch holds must be what the model takes: "
                          "token ids within the vocabulary, the input shape) and give the recipe forward(model, "
                          "batch) when the model does not take the batch as it is") from None
    try:
        kind = output_kind(ref_out, declared)
        losses = (ref_loss, exp_loss) if ref_loss is not None and exp_loss is not None else None
        targets = next_token_targets(batch, ref_out) if losses is None and kind == "logits" else None
        metrics = compare_outputs(ref_out, exp_out, kind=kind, targets=targets, losses=losses)
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    return judge_gate(metrics, options.thresholds)


# ----------------------------------------------------------------------------------------------------------------
# Writing: shards into a temporary sibling directory, fsync, one rename


def plan_shards(exported: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Tensor names per shard, in order: a shard is closed before a tensor that would take it past ``max_bytes``
    (a tensor larger than that gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in exported.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def write_artifact(out: str, exported: dict[str, torch.Tensor], metadata: dict[str, str],
                   max_bytes: int) -> tuple[WrittenFile, ...]:
    """Write ``exported`` as safetensors shards (with a Hugging Face index when there are several) carrying
    ``metadata``, into a temporary sibling of ``out`` that is renamed to ``out`` once every file is fsynced.
    On any failure the temporary directory is removed and ``out`` is left as it was."""
    from safetensors.torch import save_file

    shards = plan_shards(exported, max_bytes)
    names = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    tmp = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.tmp-{secrets.token_hex(4)}")
    os.mkdir(tmp)
    try:
        files: list[WrittenFile] = []
        for fname, keys in zip(names, shards, strict=True):
            path = os.path.join(tmp, fname)
            save_file({k: exported[k] for k in keys}, path, metadata=metadata)
            os.chmod(path, durable.file_mode())  # safetensors creates 0600 files, unreadable to a server's user
            _fsync(path)
            files.append(WrittenFile(fname, len(keys), os.path.getsize(path)))
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": sum(t.numel() * t.element_size() for t in exported.values()),
                             **metadata},
                "weight_map": {k: fname for fname, keys in zip(names, shards, strict=True) for k in keys},
            }
            path = os.path.join(tmp, INDEX_FILE)
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(index, fh, indent=2, sort_keys=True)
                fh.write("\n")
            _fsync(path)
            files.append(WrittenFile(INDEX_FILE, 0, os.path.getsize(path)))
        _fsync(tmp)
        try:
            os.rename(tmp, out)  # replaces an empty directory; fails if something appeared in it meanwhile
        except OSError as exc:
            raise ExportError(f"--out {out}: cannot put the artifact in place ({exc.strerror}); nothing was "
                              "written there") from None
        _fsync(os.path.dirname(out))
        return tuple(files)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _fsync(path: str) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0)
    fd = os.open(path, flags)
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on directories
            os.fsync(fd)
    finally:
        os.close(fd)
