"""The checkpoint passport: a verdict bound to a checkpoint's bytes, that travels with every copy.

``attest`` audits a checkpoint and writes its passport: the checkpoint's file digests in the serialization the
OpenSSF model-signing tool signs and verifies (an in-toto statement naming one root digest over the files), and
ckptaudit's own in-toto statement about the same root digest, whose predicate is the audit (tool, options, the
precision contract, the verdict, the findings' counts, every tensor's layout-independent digest, what the artifact
is, and its lineage). Both are signed with the user's key through ``model-signing`` (the ``[sign]`` extra), or left
digest-only when no key is given, and then the passport says so.

``verify`` reads a copy (a local path or an ``s3://`` / ``gs://`` URL) once, checks every digest, the signature
before anything in the predicate is trusted, and the recorded verdict. See ``docs/passport.md``.

Where a passport lives and which files it leaves out: :mod:`ckptaudit.ondisk.passport`.
"""

from __future__ import annotations

from ckptaudit.ondisk.passport import find_passport, passport_path, signature_path
from ckptaudit.passport.attesting import attest
from ckptaudit.passport.document import read_passport
from ckptaudit.passport.keyless import SigstoreIdentity, SigstoreSigning
from ckptaudit.passport.model import (
    Ancestor,
    FileDigest,
    Lineage,
    Passport,
    PassportError,
    ServingInfo,
    TensorDigest,
    VerifyResult,
)
from ckptaudit.passport.verifying import passport_findings, verify

__all__ = [
    "Ancestor",
    "FileDigest",
    "Lineage",
    "Passport",
    "PassportError",
    "ServingInfo",
    "SigstoreIdentity",
    "SigstoreSigning",
    "TensorDigest",
    "VerifyResult",
    "attest",
    "find_passport",
    "passport_findings",
    "passport_path",
    "read_passport",
    "signature_path",
    "verify",
]
