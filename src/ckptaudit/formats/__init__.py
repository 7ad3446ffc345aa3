"""Readers: turn a path (file or directory) into a :class:`Checkpoint` of parts, executing nothing.

One module per container format (:mod:`.torchzip`, :mod:`.safetensors`, :mod:`.dcp`, plain pickles here);
:func:`open_checkpoint` picks the readers by looking at the path. Every failure of a reader becomes a
finding on the checkpoint; only a path that does not exist raises (``FileNotFoundError``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from ckptaudit.catalogue import finding
from ckptaudit.formats.base import Checkpoint, Part, Unreadable, walk
from ckptaudit.formats.dcp import is_dcp_dir, read_dcp
from ckptaudit.formats.pickles import RestrictedUnpickler, base_table, scan
from ckptaudit.formats.safetensors import SafetensorsError, read_safetensors
from ckptaudit.formats.tensors import TensorData
from ckptaudit.formats.torchzip import TorchZipError, is_zip, read_torch_zip
from ckptaudit.model import Finding

__all__ = ["Checkpoint", "Part", "TensorData", "Unreadable", "open_checkpoint", "walk"]

TORCH_EXTENSIONS = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle", ".tar")
MAX_JSON_BYTES = 64 << 20
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


def open_checkpoint(path: str) -> Checkpoint:
    """Read ``path`` (a file, a DCP directory, or a directory of component files) into a :class:`Checkpoint`.

    Raises ``FileNotFoundError`` when ``path`` does not exist; everything else becomes a finding.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    path = os.path.abspath(path)
    findings: list[Finding] = []
    files: dict[str, int] = {}
    parts: list[Part] = []
    if os.path.isdir(path):
        if is_dcp_dir(path):
            read = read_dcp(path)
            findings += read.findings
            files.update(read.files)
            if read.part is not None:
                parts.append(read.part)
            fmt = "dcp"
            for extra in ("manifest.json", "ckptaudit.json"):
                extra_path = os.path.join(path, extra)
                if os.path.isfile(extra_path):
                    files[extra] = os.path.getsize(extra_path)
                    part = _read_file(extra_path, extra, findings)
                    if part is not None:
                        parts.append(part)
        else:
            fmt = "directory"
            for name in sorted(os.listdir(path)):
                full = os.path.join(path, name)
                if os.path.isdir(full):
                    if is_dcp_dir(full):
                        read = read_dcp(full, name)
                        findings += read.findings
                        files.update(read.files)
                        if read.part is not None:
                            parts.append(read.part)
                    continue
                if not _recognised_name(name):
                    continue
                files[name] = os.path.getsize(full)
                part = _read_file(full, name, findings)
                if part is not None:
                    parts.append(part)
            if not files:
                findings.append(
                    finding(
                        "format.unrecognized",
                        os.path.basename(path),
                        f"{path} holds no checkpoint files (no .metadata/.distcp, .safetensors, "
                        f"{'/'.join(TORCH_EXTENSIONS)} or index .json); point ckptaudit at a checkpoint "
                        "file or directory",
                    )
                )
    else:
        name = os.path.basename(path)
        files[name] = os.path.getsize(path)
        part = _read_file(path, "", findings)
        fmt = part.format if part is not None else "unknown"
        if part is not None:
            parts.append(part)
    return Checkpoint(path=path, format=fmt, parts=parts, findings=findings, files=files)


def _recognised_name(name: str) -> bool:
    lower = name.lower()
    return lower.endswith((".safetensors", ".json", *TORCH_EXTENSIONS))


def _read_file(full: str, name: str, findings: list[Finding]) -> Part | None:
    subject = name or os.path.basename(full)
    lower = full.lower()
    try:
        if lower.endswith(".safetensors"):
            return _read_safetensors(full, name, subject, findings)
        if lower.endswith(".json"):
            return _read_json(full, name, subject, findings)
        return _read_pickled(full, name, subject, findings)
    except OSError as exc:
        findings.append(finding("integrity.corrupt", subject, f"cannot read {subject}: {exc.strerror or exc}"))
        return None


def _read_safetensors(full: str, name: str, subject: str, findings: list[Finding]) -> Part | None:
    try:
        st = read_safetensors(full)
    except SafetensorsError as exc:
        findings.append(
            finding("integrity.corrupt", subject, f"{subject}: not a readable safetensors file: {exc}",
                    offset=exc.offset)
        )
        return None
    return Part(name, "safetensors", dict(st.tensors), metadata=st.metadata, order_known=False)


def _read_json(full: str, name: str, subject: str, findings: list[Finding]) -> Part | None:
    size = os.path.getsize(full)
    if size > MAX_JSON_BYTES:
        findings.append(finding("format.unsupported", subject, f"{subject}: JSON of {size} bytes not read"))
        return None
    with open(full, "rb") as fh:
        raw = fh.read()
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        findings.append(finding("integrity.corrupt", subject, f"{subject}: not valid JSON ({exc})"))
        return None
    return Part(name, "json", value)


def _read_pickled(full: str, name: str, subject: str, findings: list[Finding]) -> Part | None:
    size = os.path.getsize(full)
    if size == 0:
        findings.append(finding("integrity.corrupt", subject, f"{subject} is empty (0 bytes)", offset=0))
        return None
    if is_zip(full):
        try:
            tz = read_torch_zip(full)
        except TorchZipError as exc:
            findings.append(
                finding("integrity.corrupt", subject, f"{subject}: not a readable torch.save archive: {exc}",
                        offset=exc.offset)
            )
            return None
        if not tz.loaded:
            _report_unloaded(subject, tz.scan.unsafe, tz.scan.harmless, findings)
            return Part(name, "torch.save", None)
        return Part(name, "torch.save", tz.obj)
    # Not a zip: a plain pickle, or the legacy (pre-1.6) torch.save format, which starts with a pickled magic.
    with open(full, "rb") as fh:
        result = scan(fh)
        if result.error is not None:
            findings.append(
                finding("format.unrecognized" if result.error_offset == 0 else "integrity.corrupt", subject,
                        f"{subject}: not a torch.save archive, safetensors file or readable pickle "
                        f"({result.error} at byte {result.error_offset})", offset=result.error_offset)
            )
            return None
        fh.seek(0)
        first = _small_pickle_value(fh, result.end) if result.loadable else None
    if first == _LEGACY_MAGIC:
        with open(full, "rb") as fh:
            unsafe: list[str] = []
            harmless: list[str] = []
            for _ in range(4):  # magic, protocol, sys info, object tree
                r = scan(fh)
                if r.error is not None:
                    break
                unsafe += r.unsafe
                harmless += r.harmless
        if unsafe or harmless:
            _report_unloaded(subject, tuple(unsafe), tuple(harmless), findings)
        findings.append(
            finding("format.unsupported", subject,
                    f"{subject} uses the legacy torch.save format (torch < 1.6); its tensors are not read. "
                    "Re-save it with a current torch.save to audit it.")
        )
        return Part(name, "torch.save-legacy", None)
    if not result.loadable:
        _report_unloaded(subject, result.unsafe, result.harmless, findings)
        return Part(name, "pickle", None)
    if result.end != size:
        findings.append(
            finding("integrity.corrupt", subject, f"{subject}: {size - result.end} bytes after the pickle's end",
                    offset=result.end)
        )
    with open(full, "rb") as fh:
        try:
            value = RestrictedUnpickler(fh, base_table()).load()  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001
            findings.append(finding("integrity.corrupt", subject, f"{subject}: cannot be unpickled ({exc})"))
            return None
    return Part(name, "pickle", value)


def _small_pickle_value(fh: Any, end: int) -> Any:
    if end > 4096:
        return None
    try:
        return RestrictedUnpickler(fh, {}).load()
    except Exception:  # noqa: BLE001
        return None


def _report_unloaded(subject: str, unsafe: tuple[str, ...], harmless: tuple[str, ...],
                     findings: list[Finding]) -> None:
    if unsafe:
        findings.append(
            finding(
                "security.unsafe-pickle",
                subject,
                f"{subject} references {', '.join(unsafe)}, outside the safe allowlist; it was not loaded and "
                "nothing in it was executed. Do not torch.load it with weights_only=False.",
                globals=list(unsafe + harmless),
            )
        )
    else:
        findings.append(
            finding(
                "security.not-loaded",
                subject,
                f"{subject} pickles framework objects ({', '.join(harmless)}) that need arbitrary code to load; "
                "skipped, never executed",
                globals=list(harmless),
            )
        )


def tensors_in(tree: Any) -> list[tuple[tuple[Any, ...], TensorData | Unreadable]]:
    """Every tensor (or unreadable tensor) leaf of a tree, with its path."""
    return [(p, v) for p, v in walk(tree) if isinstance(v, TensorData | Unreadable)]
