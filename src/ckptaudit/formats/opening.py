"""The dispatcher: :func:`open_checkpoint` turns a path into a :class:`Checkpoint`, handing each directory and each
file to the first registered reader that recognises it (:mod:`ckptaudit.formats.contract`).

A directory no directory reader recognises is a plain directory of files: each file whose name a file reader
claims is read, and each sub-directory a ``nested`` directory reader recognises.
"""

from __future__ import annotations

import os
import stat

from ckptaudit.catalogue import finding
from ckptaudit.findings import Finding
from ckptaudit.formats.base import Checkpoint, Part
from ckptaudit.formats.contract import FileHead, Reading, directory_readers, file_readers, load_function
from ckptaudit.formats.io.safeio import FileIds, LimitExceeded, NotRegularFile, describe_kind
from ckptaudit.formats.io.safeio import reading as reading_files
from ckptaudit.formats.io.tensors import FileMaps

__all__ = ["open_checkpoint", "read_entry"]


def open_checkpoint(path: str) -> Checkpoint:
    """Read ``path`` (a file, a DCP directory, or a directory of component files) into a :class:`Checkpoint`.

    Raises ``FileNotFoundError`` when ``path`` does not exist and ``OSError`` (e.g. ``PermissionError``) when
    the directory ``path`` cannot be listed; everything else, down to a named pipe given as ``path``, becomes a
    finding. Nothing but regular files is ever opened.

    ``path`` may be an fsspec URL (``s3://bucket/ckpt.pt``): the readers then parse a local stand-in holding the
    metadata bytes, and tensor data is streamed with ranged reads (:mod:`ckptaudit.formats.remote.staging`).
    """
    from ckptaudit.formats.remote import is_url, local_path

    if is_url(path):
        return _open_remote(path)
    return _open_local(local_path(path), FileIds())


def _open_local(path: str, ids: FileIds | None) -> Checkpoint:
    """:func:`open_checkpoint` of a local path; every file the readers open is recorded in ``ids`` (the version the
    scan must find again: :class:`~ckptaudit.formats.io.safeio.FileIds`), or not (``None``: a remote checkpoint's
    stand-in, whose objects are pinned by their ETags)."""
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    path = os.path.abspath(path)
    with reading_files(ids):
        return _read_local(path, ids)


def _read_local(path: str, ids: FileIds | None) -> Checkpoint:
    reading = Reading(read_entry=lambda full, name: read_entry(full, name, reading.findings, reading.files))
    if os.path.isdir(path):
        fmt = "directory"
        for reader in directory_readers():
            if reader.recognises(path):
                fmt = reader.name
                load_function(reader.read)(path, "", reading)
                break
        else:
            _read_plain_directory(path, reading)
    else:
        part = read_entry(path, "", reading.findings, reading.files)
        fmt = part.format if part is not None else "unknown"
        if part is not None:
            reading.parts.append(part)
    return Checkpoint(path=path, format=fmt, parts=reading.parts, findings=reading.findings, files=reading.files,
                      digests=reading.digests, maps=FileMaps(ids))


def _read_plain_directory(path: str, reading: Reading) -> None:
    """A directory of component files (a Trainer's ``checkpoint-N/``): the claimed files, and the sub-directories a
    nested directory reader recognises."""
    from ckptaudit.formats.pickle import TORCH_EXTENSIONS

    findings = reading.findings
    nested = [r for r in directory_readers() if r.nested]
    claims = _claims()

    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        claimed = name.lower().endswith(claims)
        read = next((r.read for r in nested if r.recognises(full)), None)
        if (claimed or read is not None) and os.path.islink(full):
            _report_link(path, name, findings)
        if os.path.isdir(full):
            if read is not None:
                load_function(read)(full, name, reading)
            elif claimed:
                findings.append(finding("integrity.corrupt", name,
                                        f"{name} is a directory, not a checkpoint file; not read"))
            continue
        if not claimed:
            continue
        part = read_entry(full, name, findings, reading.files)
        if part is not None:
            reading.parts.append(part)
    if not reading.files and not findings:
        findings.append(
            finding(
                "format.unrecognized",
                os.path.basename(path),
                f"{path} holds no checkpoint files (no .metadata/.distcp, .safetensors, "
                f"{'/'.join(TORCH_EXTENSIONS)} or index .json); point ckptaudit at a checkpoint "
                "file or directory",
            )
        )


def _open_remote(url: str) -> Checkpoint:
    from ckptaudit.formats.remote.staging import stage

    local, remote = stage(url)
    try:
        ckpt = _open_local(local, None)
    except BaseException:
        remote.close()
        raise
    ckpt.maps.remote = remote
    ckpt.path, ckpt.local_path = url, ckpt.path
    return ckpt


def _report_link(root: str, name: str, findings: list[Finding]) -> None:
    """A link whose target lies outside ``root`` is reported (never refused: the Hugging Face cache is links)."""
    target = os.path.realpath(os.path.join(root, name))
    real_root = os.path.realpath(root)
    if os.path.commonpath([real_root, target]) != real_root:
        findings.append(finding("integrity.link-outside", name,
                                f"{name} is a link to {target}, outside the checkpoint; it was read from there",
                                target=target))


def _claims() -> tuple[str, ...]:
    """The name endings (lower case) file readers claim in a directory listing."""
    return tuple(c for r in file_readers() for c in r.claims)


def read_entry(full: str, name: str, findings: list[Finding], files: dict[str, int]) -> Part | None:
    """Read one file of the checkpoint if it is a regular file (symlinks followed); record it in ``files``."""
    subject = name or os.path.basename(full)
    try:
        st = os.stat(full)
    except FileNotFoundError:
        findings.append(finding("integrity.incomplete", subject,
                                f"{subject} is a symbolic link to {os.readlink(full)!r}, which does not exist"
                                if os.path.islink(full) else f"{subject} disappeared while it was being read"))
        return None
    except OSError as exc:
        findings.append(finding("integrity.corrupt", subject, f"cannot read {subject}: {exc.strerror or exc}"))
        return None
    if not stat.S_ISREG(st.st_mode):
        findings.append(finding("integrity.corrupt", subject,
                                f"{subject} is {describe_kind(st.st_mode)}, not a regular file; not opened"))
        return None
    files[name or os.path.basename(full)] = st.st_size
    return _read_file(full, name, findings)


def _read_file(full: str, name: str, findings: list[Finding]) -> Part | None:
    probe = FileHead(full, name)
    subject = probe.subject
    try:
        for reader in file_readers():
            if reader.recognises(probe):
                part: Part | None = load_function(reader.read)(probe, findings)
                return part
        raise AssertionError(f"no reader took {subject}: the pickle reader takes every file")
    except NotRegularFile as exc:
        findings.append(finding("integrity.corrupt", subject, f"{subject}: {exc.strerror}"))
        return None
    except LimitExceeded as exc:
        findings.append(finding("integrity.corrupt", subject, f"{subject}: {exc}; not read", limit=True))
        return None
    except OSError as exc:
        findings.append(finding("integrity.corrupt", subject, f"cannot read {subject}: {exc.strerror or exc}"))
        return None
