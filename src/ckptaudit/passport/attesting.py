"""``ckptaudit attest``: audit a checkpoint and write its passport."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptaudit.findings import RawReport
from ckptaudit.passport.model import Artifact, Lineage, Passport, ServingInfo

__all__ = ["attest"]


def attest(path: str, *, key: str | None = None, certificate: str | None = None, output: str | None = None,
           lineage: Lineage | None = None, report: RawReport | None = None, artifact: Artifact = "training",
           serving: ServingInfo | None = None, audit_options: Mapping[str, Any] | None = None,
           jobs: int | None = None) -> Passport:
    """Audit the checkpoint at ``path`` (unless ``report`` is the audit of these bytes, from the same pass) and
    write its passport to ``output`` (default: :func:`~ckptaudit.ondisk.passport.passport_path`).

    ``key``: a PEM private key (EC P-256/384) to sign with through model-signing (the ``[sign]`` extra); without
    one the passport is digest-only and says so. ``certificate``: the key's certificate chain (PEM), to sign with
    a certificate rather than a bare key. ``lineage``: which checkpoint this one descends from (the guards fill it).
    ``artifact``: ``training`` (a resumable checkpoint) or ``serving`` (an inference export; ``serving`` then holds
    its gate results and the training checkpoint's passport digest). ``audit_options``: the keyword options of
    :func:`ckptaudit.audit` (``master_dtype``, ``require``, ``ignore``...). Raises ``PassportError`` (a key that
    does not load, the extra missing) and ``FileNotFoundError``.
    """
    raise NotImplementedError("attest: being built on branch h38-passport")
