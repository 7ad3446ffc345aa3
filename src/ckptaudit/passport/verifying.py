"""``ckptaudit verify``: one streaming pass over a copy, held to its passport."""

from __future__ import annotations

from ckptaudit.findings import Finding
from ckptaudit.passport.model import Artifact, VerifyResult

__all__ = ["passport_findings", "verify"]


def verify(path: str, passport: str | None = None, *, key: str | None = None, expect: Artifact = "training",
           jobs: int | None = None) -> VerifyResult:
    """Verify the checkpoint at ``path`` (a local path or an ``s3://`` / ``gs://`` URL) against its passport
    (``passport``: the passport file; default: the one the checkpoint carries, :func:`passport_path`).

    ``key``: the signer's PEM public key; with it an unsigned (digest-only) or hand-edited passport is refused.
    ``expect``: what the checkpoint is used as; the recorded verdict must be a pass for it. Raises
    :class:`~ckptaudit.passport.model.PassportError` when the passport itself cannot be read (malformed, too large,
    an unknown version: exit 2 on the command line)."""
    raise NotImplementedError("verify: being built on branch h38-passport")


def passport_findings(path: str, name: str, *, key: str | None = None,
                      expect: Artifact = "training") -> tuple[Finding, ...]:
    """``latest --require passport``'s and the store loader's step: the findings that keep the checkpoint at
    ``path`` (named ``name`` in messages) from being chosen: no passport, one that does not verify, or one whose
    verdict was no pass. Empty when its passport verifies."""
    raise NotImplementedError("passport_findings: being built on branch h38-passport")
