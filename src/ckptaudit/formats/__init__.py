"""Readers: turn a path (file or directory) into a :class:`Checkpoint` of parts, executing nothing.

One package per container (:mod:`.zip` for ``torch.save`` archives, :mod:`.dcp`, :mod:`.deepspeed` for DeepSpeed's
``global_stepN/`` folders, :mod:`.pickle` for the pickles inside them all), :mod:`.safetensors`, plain pickles here;
:func:`open_checkpoint` picks the readers by looking at the path. Every failure of a reader becomes a
finding on the checkpoint; only a path that does not exist raises (``FileNotFoundError``).

Each reader's module is imported when a checkpoint needs it (a directory for DCP and DeepSpeed, the file's
extension and magic bytes for safetensors and ``torch.save``), so that auditing a small file starts fast.
"""

from __future__ import annotations

import os
import stat
from io import RawIOBase
from typing import TYPE_CHECKING, Any

from ckptaudit.catalogue import finding
from ckptaudit.findings import Finding
from ckptaudit.formats.base import Checkpoint, Part, Unreadable, walk
from ckptaudit.formats.io.safeio import LimitExceeded, NotRegularFile, describe_kind, open_regular, read_limited
from ckptaudit.formats.io.safejson import JsonLimitError, loads_limited
from ckptaudit.formats.io.tensors import TensorData
from ckptaudit.formats.pickle.allowlist import WRITER_DECLARED_SAFE

if TYPE_CHECKING:
    from ckptaudit.formats.pickle.scan import PickleScan

__all__ = ["Checkpoint", "Part", "TensorData", "Unreadable", "open_checkpoint", "walk"]

TORCH_EXTENSIONS = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle", ".tar")
MAX_JSON_BYTES = 64 << 20
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


def open_checkpoint(path: str) -> Checkpoint:
    """Read ``path`` (a file, a DCP directory, or a directory of component files) into a :class:`Checkpoint`.

    Raises ``FileNotFoundError`` when ``path`` does not exist and ``OSError`` (e.g. ``PermissionError``) when
    the directory ``path`` cannot be listed; everything else, down to a named pipe given as ``path``, becomes a
    finding. Nothing but regular files is ever opened.

    ``path`` may be an fsspec URL (``s3://bucket/ckpt.pt``): the readers then parse a local stand-in holding the
    metadata bytes, and tensor data is streamed with ranged reads (:mod:`ckptaudit.formats.remote.staging`).
    """
    from ckptaudit.formats.remote.staging import is_url, local_path

    if is_url(path):
        return _open_remote(path)
    path = local_path(path)
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    path = os.path.abspath(path)
    findings: list[Finding] = []
    files: dict[str, int] = {}
    digests: dict[str, tuple[int, str]] = {}
    parts: list[Part] = []
    if os.path.isdir(path):
        from ckptaudit.formats.dcp.reader import METADATA, is_dcp_dir, read_dcp
        from ckptaudit.formats.deepspeed.reader import is_deepspeed_root, is_deepspeed_step_dir

        if is_deepspeed_step_dir(path) or is_deepspeed_root(path):
            fmt = "deepspeed"
            parts.append(_read_deepspeed(path, findings, files))
        elif is_dcp_dir(path):
            read = read_dcp(path)
            findings += read.findings
            files.update(read.files)
            if read.digest is not None:
                digests[METADATA] = read.digest
            if read.part is not None:
                parts.append(read.part)
            fmt = "dcp"
            # Our manifest; Megatron-Core's metadata.json (backends) and common.pt (its unsharded state).
            for extra in ("manifest.json", "ckptaudit.json", "metadata.json", "common.pt"):
                extra_path = os.path.join(path, extra)
                if os.path.lexists(extra_path):
                    part = _read_entry(extra_path, extra, findings, files)
                    if part is not None:
                        parts.append(part)
        else:
            fmt = "directory"
            for name in sorted(os.listdir(path)):
                full = os.path.join(path, name)
                if (_recognised_name(name) or is_dcp_dir(full)) and os.path.islink(full):
                    _report_link(path, name, findings)
                if os.path.isdir(full):
                    if is_dcp_dir(full):
                        read = read_dcp(full, name)
                        findings += read.findings
                        files.update(read.files)
                        if read.digest is not None:
                            digests[os.path.join(name, METADATA)] = read.digest
                        if read.part is not None:
                            parts.append(read.part)
                    elif _recognised_name(name):
                        findings.append(finding("integrity.corrupt", name,
                                                f"{name} is a directory, not a checkpoint file; not read"))
                    continue
                if not _recognised_name(name):
                    continue
                part = _read_entry(full, name, findings, files)
                if part is not None:
                    parts.append(part)
            if not files and not findings:
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
        part = _read_entry(path, "", findings, files)
        fmt = part.format if part is not None else "unknown"
        if part is not None:
            parts.append(part)
    return Checkpoint(path=path, format=fmt, parts=parts, findings=findings, files=files, digests=digests)


def _read_deepspeed(path: str, findings: list[Finding], files: dict[str, int]) -> Part:
    """A DeepSpeed tag folder, or the root ``save_checkpoint`` wrote (its ``latest`` tag resolved)."""
    from ckptaudit.formats.deepspeed.reader import is_deepspeed_step_dir, read_deepspeed, resolve_tag

    step_dir, prefix = path, ""
    if not is_deepspeed_step_dir(path):
        tag, notes = resolve_tag(path)
        findings += notes
        for extra in ("latest", "zero_to_fp32.py"):
            if os.path.isfile(os.path.join(path, extra)):  # recorded, never executed
                files[extra] = os.path.getsize(os.path.join(path, extra))
        assert tag is not None  # is_deepspeed_root: at least one tag folder
        step_dir, prefix = os.path.join(path, tag), tag + "/"
    read = read_deepspeed(step_dir, prefix, lambda full, name: _read_entry(full, name, findings, files))
    findings += read.findings
    return read.part


def _open_remote(url: str) -> Checkpoint:
    from ckptaudit.formats.remote.staging import stage

    local, remote = stage(url)
    try:
        ckpt = open_checkpoint(local)
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


def _limit(flag: bool) -> dict[str, Any]:
    """Evidence that a finding is a reader's safety limit rather than malformed data."""
    return {"limit": True} if flag else {}


def _recognised_name(name: str) -> bool:
    lower = name.lower()
    return lower.endswith((".safetensors", ".json", *TORCH_EXTENSIONS))


def _read_entry(full: str, name: str, findings: list[Finding], files: dict[str, int]) -> Part | None:
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
    subject = name or os.path.basename(full)
    lower = full.lower()
    try:
        if lower.endswith(".safetensors"):
            return _read_safetensors(full, name, subject, findings)
        if lower.endswith(".json"):
            return _read_json(full, name, subject, findings)
        return _read_pickled(full, name, subject, findings)
    except NotRegularFile as exc:
        findings.append(finding("integrity.corrupt", subject, f"{subject}: {exc.strerror}"))
        return None
    except LimitExceeded as exc:
        findings.append(finding("integrity.corrupt", subject, f"{subject}: {exc}; not read", limit=True))
        return None
    except OSError as exc:
        findings.append(finding("integrity.corrupt", subject, f"cannot read {subject}: {exc.strerror or exc}"))
        return None


def _read_safetensors(full: str, name: str, subject: str, findings: list[Finding]) -> Part | None:
    from ckptaudit.formats.safetensors import SafetensorsError, read_safetensors

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
    raw = read_limited(full, MAX_JSON_BYTES, "JSON file")
    try:
        value = loads_limited(raw, subject)
    except JsonLimitError as exc:
        findings.append(finding("integrity.corrupt", subject, f"{exc}; not read (JSON, limit)", limit=True))
        return None
    except ValueError as exc:  # not JSON, bad UTF-8, integers beyond Python's digit limit
        findings.append(finding("integrity.corrupt", subject, str(exc)))
        return None
    return Part(name, "json", value)


def _corrupt_pickle(subject: str, result: PickleScan, findings: list[Finding]) -> None:
    findings.append(
        finding("format.unrecognized" if result.error_offset == 0 else "integrity.corrupt", subject,
                f"{subject}: not a torch.save archive, safetensors file or readable pickle "
                f"({result.error} at byte {result.error_offset})", offset=result.error_offset,
                **_limit(result.limit))
    )


def _read_pickled(full: str, name: str, subject: str, findings: list[Finding]) -> Part | None:
    from ckptaudit.formats.pickle.object_tree import check_tree
    from ckptaudit.formats.pickle.scan import PickleLimitError, scan
    from ckptaudit.formats.pickle.unpickler import RestrictedUnpickler, base_table

    with open_regular(full) as fh:
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(4)
    if size == 0:
        findings.append(finding("integrity.corrupt", subject, f"{subject} is empty (0 bytes)", offset=0))
        return None
    if head == b"PK\x03\x04":
        from ckptaudit.formats.zip.archive import TorchZipError, read_torch_zip

        try:
            # Inert: globals outside the allowlist become placeholders, so the rest (the tensors) is still audited.
            tz = read_torch_zip(full, inert=True)
        except TorchZipError as exc:
            what = "not a readable torch.save archive" if exc.code == "integrity.corrupt" else \
                "refused, nothing in it was executed"
            findings.append(finding(exc.code, subject, f"{subject}: {what}: {exc}", offset=exc.offset,
                                    **_limit(exc.limit)))
            return None
        if not tz.loaded:
            _report_unloaded(subject, tz.scan, findings)
            return Part(name, "torch.save", None)
        if tz.scan.unsafe or tz.scan.harmless:
            _report_unloaded(subject, tz.scan, findings, inert=True)
        return Part(name, "torch.save", tz.obj)
    # Not a zip. torch.load tries the legacy (pre-1.6) tar format first, then reads pickles from byte 0: the
    # legacy stream format (a pickled magic number first), or fails after unpickling the first one.
    if _torch_reads_as_tar(full):
        return _read_legacy_tar(full, name, subject, findings)
    with open_regular(full) as fh:
        result = scan(fh)
        if result.unsafe or result.harmless:
            _report_unloaded(subject, result, findings)
            return Part(name, "pickle", None)
        if result.error is not None:
            _corrupt_pickle(subject, result, findings)
            return None
        fh.seek(0)
        first = _small_pickle_value(fh, result.end)
    if first == _LEGACY_MAGIC:
        return _read_legacy(full, name, subject, findings)
    if result.end != size:
        findings.append(
            finding("integrity.corrupt", subject, f"{subject}: {size - result.end} bytes after the pickle's end",
                    offset=result.end)
        )
    with open_regular(full) as fh:
        try:
            value = RestrictedUnpickler(fh, base_table(), size=result.end).load()
            problem = check_tree(value)
            if problem is not None:
                raise PickleLimitError(problem)
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the pickle does wrong is a corrupt file
            findings.append(finding("integrity.corrupt", subject, f"{subject}: cannot be unpickled ({exc})",
                                    **_limit(isinstance(exc, PickleLimitError))))
            return None
    return Part(name, "pickle", value)


def _read_legacy(full: str, name: str, subject: str, findings: list[Finding]) -> Part | None:
    from ckptaudit.formats.zip.archive import scan_legacy

    with open_regular(full) as fh:
        # magic, protocol, sys info, object tree, storage keys: torch.load unpickles all five
        found = scan_legacy(fh)
    if found.unsafe or found.harmless:
        _report_unloaded(subject, found, findings)
    findings.append(
        finding("security.unvetted-pickle", subject,
                f"{subject} uses the legacy torch.save stream format (torch < 1.6, or "
                "_use_new_zipfile_serialization=False): torch.load unpickles it with a loader ckptaudit does not "
                "restate (five pickles, then raw storages), so ckptaudit cannot vet what it would load; not read, "
                "nothing in it was executed. Re-save it with a current torch.save to audit it.",
                globals=list(found.globals))
    )
    return Part(name, "torch.save-legacy", None)


_TAR_BLOCK = 512


def _torch_reads_as_tar(full: str) -> bool:
    """Whether ``torch.load`` would take the legacy tar path for the file ``full``: it does whenever
    ``tarfile.open(mode="r:")`` reads a first header, which needs :meth:`tarfile.TarInfo.frombuf` to accept the
    first block (an over-approximation: anything frombuf takes is refused)."""
    import tarfile

    with open_regular(full) as fh:
        block = fh.read(_TAR_BLOCK)
    if len(block) < _TAR_BLOCK:
        return False
    try:
        tarfile.TarInfo.frombuf(block, tarfile.ENCODING, "surrogateescape")
    except tarfile.HeaderError:
        return False
    except Exception:  # noqa: BLE001 - tarfile fails otherwise: torch.load fails too, never falls back to pickle
        return True
    return True


class _Capped(RawIOBase):
    """A file read through at most ``cap`` bytes in all (tarfile reads what hostile headers declare)."""

    def __init__(self, fh: Any, cap: int) -> None:
        self._fh, self._left = fh, cap

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return int(self._fh.tell())

    def seek(self, pos: int, whence: int = 0) -> int:
        return int(self._fh.seek(pos, whence))

    def readinto(self, b: Any) -> int:
        if self._left <= 0:
            raise OSError("read cap reached")
        data = self._fh.read(min(len(b), self._left))
        self._left -= len(data)
        b[:len(data)] = data
        return len(data)


def _read_legacy_tar(full: str, name: str, subject: str, findings: list[Finding]) -> Part:
    """The legacy tar format: refused (torch.load(weights_only=False) unpickles its members unvetted); the pickles
    at the start of its members are scanned to name what they reference."""
    import tarfile

    from ckptaudit.formats.pickle.scan import PickleScan
    from ckptaudit.formats.zip.archive import scan_legacy

    names: list[str] = []
    unsafe: list[str] = []
    harmless: list[str] = []
    try:
        with open_regular(full) as raw, tarfile.open(fileobj=_Capped(raw, 64 << 20), mode="r:") as tar:
            for member in ("storages", "tensors", "pickle"):
                stream = tar.extractfile(member)
                if stream is None:
                    continue
                found = scan_legacy(stream)
                names += found.globals
                unsafe += found.unsafe
                harmless += found.harmless
    except Exception:  # noqa: BLE001, S110 - a damaged tar: refused all the same, its pickles named where readable
        pass
    if unsafe or harmless:
        _report_unloaded(subject, PickleScan(tuple(names), tuple(unsafe), tuple(harmless)), findings)
    findings.append(
        finding("security.unvetted-pickle", subject,
                f"{subject} is a legacy .tar torch.save file (torch < 1.6): torch.load(weights_only=False) untars it "
                "and unpickles its members without the checks ckptaudit makes (weights_only=True refuses it); not "
                "read, nothing in it was executed. Re-save it with a current torch.save to audit it.",
                globals=names)
    )
    return Part(name, "torch.save-legacy", None)


def _small_pickle_value(fh: Any, end: int) -> Any:
    from ckptaudit.formats.pickle.unpickler import RestrictedUnpickler

    if end > 4096:
        return None
    try:
        return RestrictedUnpickler(fh, {}, size=end).load()
    except Exception:  # noqa: BLE001 - only the legacy magic number matters here
        return None


def _report_unloaded(subject: str, result: PickleScan, findings: list[Finding], *, inert: bool = False) -> None:
    """The security finding for a pickle with globals outside the allowlist. ``inert``: the rest of the file was
    read with inert placeholders where those objects were (nothing executed), and is audited."""
    unsafe = result.unsafe
    harmless = tuple(h for h in result.harmless if h not in WRITER_DECLARED_SAFE)
    if not unsafe and not harmless and result.error is None:
        return  # only objects the writing library declares safe for its own weights_only load: nothing to say
    what = ("their objects were replaced by inert placeholders and the rest of the file was read and audited"
            if inert else "it was not loaded")
    if unsafe:
        misused = [n for n in unsafe if n in result.misused]
        why = (f" ({', '.join(misused)} called with arguments its own pickling never uses)" if misused else "")
        findings.append(
            finding(
                "security.unsafe-pickle",
                subject,
                f"{subject} references {', '.join(unsafe)}, outside the safe allowlist{why}; {what}, and "
                "nothing in it was executed. Do not torch.load it with weights_only=False.",
                globals=list(unsafe + result.harmless),
            )
        )
    elif harmless:
        findings.append(
            finding(
                "security.not-loaded",
                subject,
                f"{subject} pickles framework objects ({', '.join(harmless)}) that need arbitrary code to load; "
                + ("left as inert placeholders, never executed" if inert else "skipped, never executed"),
                globals=list(harmless),
            )
        )
    if result.error is not None:
        findings.append(finding("integrity.corrupt", subject,
                                f"{subject}: the pickle is also malformed ({result.error} at byte "
                                f"{result.error_offset})", offset=result.error_offset))
