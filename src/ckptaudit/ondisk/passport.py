"""Where a checkpoint's passport lives, and which files are passport machinery rather than checkpoint.

A passport (:mod:`ckptaudit.passport`) binds an audit's verdict to a checkpoint's bytes. These are its on-disk
names, shared by ``ckptaudit attest`` / ``verify``, the guards (which write one beside each passing checkpoint),
``ckptaudit latest`` and the store's loader, like the writer's ``step-N`` and the guard's quarantine names:

- a **directory** checkpoint carries its passport inside, ``DIR/ckptaudit.passport.json``, so that ``cp -r``,
  ``rsync`` and ``aws s3 sync`` carry it with the bytes; a signed one also carries model-signing's own signature,
  ``DIR/ckptaudit.passport.sig`` (a sigstore bundle ``model_signing verify`` reads as it is);
- a **single-file** checkpoint has them beside it: ``FILE.passport.json`` and ``FILE.passport.sig``.

Neither file is part of the checkpoint: they are left out of its file digests (a file cannot hold its own
digest), and the readers and ``latest`` do not count them as unknown or extra files (:func:`is_passport_name`).
The guard's JSON report, ``<checkpoint>.ckptaudit.json`` (:data:`~ckptaudit.ondisk.quarantine.REPORT_SUFFIX`),
stays what it was.
"""

from __future__ import annotations

import os
import posixpath

__all__ = [
    "MAX_PASSPORT_BYTES",
    "PASSPORT_NAME",
    "PASSPORT_SUFFIX",
    "PASSPORT_VERSION",
    "PREDICATE_TYPE",
    "SIGNATURE_NAME",
    "SIGNATURE_SUFFIX",
    "find_passport",
    "is_passport_name",
    "is_url",
    "passport_path",
    "signature_path",
]

PASSPORT_NAME = "ckptaudit.passport.json"
"""A directory checkpoint's passport, inside it."""
SIGNATURE_NAME = "ckptaudit.passport.sig"
"""A directory checkpoint's model-signing signature (a sigstore bundle), inside it; written only when signed."""
PASSPORT_SUFFIX = ".passport.json"
"""A single-file checkpoint's passport lies beside it: ``model.pt`` -> ``model.pt.passport.json``."""
SIGNATURE_SUFFIX = ".passport.sig"
"""A single-file checkpoint's model-signing signature: ``model.pt`` -> ``model.pt.passport.sig``."""

PASSPORT_VERSION = 1
"""The passport's format version (``passport_version`` in the file; ``schema/passport.schema.json``). A reader
refuses a version it does not know rather than guessing at it."""
PREDICATE_TYPE = "https://ckptaudit.dev/passport/v1"
"""The in-toto predicate type of ckptaudit's own statement (the audit), beside model-signing's
``https://model_signing/signature/v1.0`` statement about the same root digest."""
MAX_PASSPORT_BYTES = 64 << 20
"""A passport is untrusted input: one larger than this is refused before it is parsed (a tensor's digest takes about
160 bytes: 64 MiB holds some 400k tensors)."""


def is_url(path: str) -> bool:
    """``s3://...``, ``gs://...``, ``http(s)://...``: a checkpoint behind the remote layer."""
    return "://" in path


def is_passport_name(name: str) -> bool:
    """Whether a file name (a base name, or a path whose last part is taken) is passport machinery: excluded from
    a checkpoint's digests, and not an unknown or extra file of the checkpoint."""
    base = posixpath.basename(name.replace(os.sep, "/").rstrip("/"))
    return (base in (PASSPORT_NAME, SIGNATURE_NAME) or base.endswith(PASSPORT_SUFFIX)
            or base.endswith(SIGNATURE_SUFFIX))


def _is_dir(checkpoint: str, is_dir: bool | None) -> bool:
    if is_dir is not None:
        return is_dir
    if is_url(checkpoint):
        return checkpoint.endswith("/")
    return os.path.isdir(checkpoint)


def passport_path(checkpoint: str, *, is_dir: bool | None = None) -> str:
    """Where ``checkpoint``'s passport lives (inside a directory, beside a file), whether or not it exists.

    ``is_dir``: what ``checkpoint`` is, when the caller knows; otherwise a local path is asked, and a URL is a
    directory when it ends with ``/``.
    """
    if _is_dir(checkpoint, is_dir):
        if is_url(checkpoint):
            return checkpoint.rstrip("/") + "/" + PASSPORT_NAME
        return os.path.join(checkpoint, PASSPORT_NAME)
    return checkpoint.rstrip("/") + PASSPORT_SUFFIX


def signature_path(checkpoint: str, *, is_dir: bool | None = None) -> str:
    """Where ``checkpoint``'s model-signing signature lives (see :func:`passport_path`)."""
    if _is_dir(checkpoint, is_dir):
        if is_url(checkpoint):
            return checkpoint.rstrip("/") + "/" + SIGNATURE_NAME
        return os.path.join(checkpoint, SIGNATURE_NAME)
    return checkpoint.rstrip("/") + SIGNATURE_SUFFIX


def find_passport(checkpoint: str) -> str | None:
    """The passport of a local ``checkpoint`` if one is there (a regular file, not a link), else ``None``."""
    path = passport_path(checkpoint)
    try:
        st = os.lstat(path)
    except OSError:
        return None
    import stat

    return path if stat.S_ISREG(st.st_mode) else None
