"""The passport file: reading it as untrusted input, and writing it."""

from __future__ import annotations

from ckptaudit.passport.model import Passport

__all__ = ["read_passport"]


def read_passport(file: str) -> Passport:
    """Read a passport file (a local path or URL). Untrusted input: a file over
    :data:`~ckptaudit.ondisk.passport.MAX_PASSPORT_BYTES`, JSON beyond the readers' limits, an unknown version or a
    malformed field raises :class:`~ckptaudit.passport.model.PassportError` with one line naming the file. Nothing
    in it is trusted until :func:`~ckptaudit.passport.verify` checked its signature."""
    raise NotImplementedError("read_passport: being built on branch h38-passport")
