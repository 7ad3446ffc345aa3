"""The legacy ``torch.save`` formats (torch < 1.6), recognised and refused: the ``.tar`` format and the stream
format (a pickled magic number, then four more pickles and raw storages). ``torch.load(weights_only=False)``
unpickles them with loaders ckptaudit does not restate; their pickles are scanned only to name what they reference.

Light at import: :func:`reads_as_tar` is the tar reader's ``recognises``; the scanning modules are imported by the
readers themselves.
"""

from __future__ import annotations

from io import RawIOBase
from typing import Any

from ckptaudit.catalogue import finding
from ckptaudit.findings import Finding
from ckptaudit.formats.base import Part
from ckptaudit.formats.io.safeio import open_regular

__all__ = ["LEGACY_MAGIC", "TAR_BLOCK", "read_legacy_stream", "read_legacy_tar", "reads_as_tar"]

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
"""The number the legacy stream format pickles first (``torch.serialization.MAGIC_NUMBER``)."""
TAR_BLOCK = 512


def reads_as_tar(block: bytes) -> bool:
    """Whether ``torch.load`` would take the legacy tar path for a file starting with ``block`` (its first
    :data:`TAR_BLOCK` bytes): it does whenever ``tarfile.open(mode="r:")`` reads a first header, which needs
    :meth:`tarfile.TarInfo.frombuf` to accept the first block (an over-approximation: anything frombuf takes is
    refused)."""
    import tarfile

    if len(block) < TAR_BLOCK:
        return False
    try:
        tarfile.TarInfo.frombuf(block, tarfile.ENCODING, "surrogateescape")
    except tarfile.HeaderError:
        return False
    except Exception:  # noqa: BLE001 - tarfile fails otherwise: torch.load fails too, never falls back to pickle
        return True
    return True


def read_legacy_stream(full: str, name: str, subject: str, findings: list[Finding]) -> Part | None:
    """The legacy stream format, refused; the globals of its pickles named."""
    from ckptaudit.formats.pickle.report import report_unloaded
    from ckptaudit.formats.zip.archive import scan_legacy

    with open_regular(full) as fh:
        # magic, protocol, sys info, object tree, storage keys: torch.load unpickles all five
        found = scan_legacy(fh)
    if found.unsafe or found.harmless:
        report_unloaded(subject, found, findings)
    findings.append(
        finding("security.unvetted-pickle", subject,
                f"{subject} uses the legacy torch.save stream format (torch < 1.6, or "
                "_use_new_zipfile_serialization=False): torch.load unpickles it with a loader ckptaudit does not "
                "restate (five pickles, then raw storages), so ckptaudit cannot vet what it would load; not read, "
                "nothing in it was executed. Re-save it with a current torch.save to audit it.",
                globals=list(found.globals))
    )
    return Part(name, "torch.save-legacy", None)


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


def read_legacy_tar(probe: Any, findings: list[Finding]) -> Part:
    """The legacy tar format reader (:mod:`ckptaudit.formats.contract`): refused (torch.load(weights_only=False)
    unpickles its members unvetted); the pickles at the start of its members are scanned to name what they
    reference."""
    import tarfile

    from ckptaudit.formats.pickle.report import report_unloaded
    from ckptaudit.formats.pickle.scan import PickleScan
    from ckptaudit.formats.zip.archive import scan_legacy

    full, name, subject = probe.path, probe.name, probe.subject
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
        report_unloaded(subject, PickleScan(tuple(names), tuple(unsafe), tuple(harmless)), findings)
    findings.append(
        finding("security.unvetted-pickle", subject,
                f"{subject} is a legacy .tar torch.save file (torch < 1.6): torch.load(weights_only=False) untars it "
                "and unpickles its members without the checks ckptaudit makes (weights_only=True refuses it); not "
                "read, nothing in it was executed. Re-save it with a current torch.save to audit it.",
                globals=names)
    )
    return Part(name, "torch.save-legacy", None)
