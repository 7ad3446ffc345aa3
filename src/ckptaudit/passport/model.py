"""The passport's data model: frozen records of what a passport says, of a checkpoint's lineage, and of a verification.

These are the nouns the rest of ckptaudit (the guards, ``latest``, the store's loader, the serving export) speaks;
the file format they are read from and written to is :mod:`ckptaudit.passport.document`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ckptaudit.findings import Finding

__all__ = [
    "ARTIFACTS",
    "LINEAGE_STATES",
    "SIGNER_KINDS",
    "VERDICTS",
    "Ancestor",
    "Artifact",
    "FileDigest",
    "Lineage",
    "LineageState",
    "Passport",
    "PassportError",
    "ServingInfo",
    "SignerKind",
    "TensorDigest",
    "Verdict",
    "VerifyResult",
]

Verdict = Literal["pass", "fail", "not-judged"]
VERDICTS: tuple[Verdict, ...] = ("pass", "fail", "not-judged")
Artifact = Literal["training", "serving"]
ARTIFACTS: tuple[Artifact, ...] = ("training", "serving")
SignerKind = Literal["key", "certificate", "sigstore"]
SIGNER_KINDS: tuple[SignerKind, ...] = ("key", "certificate", "sigstore")
LineageState = Literal["clean", "descends-from-damage"]
LINEAGE_STATES: tuple[LineageState, ...] = ("clean", "descends-from-damage")


class PassportError(ValueError):
    """A passport that cannot be read (malformed, too large, an unknown version) or written (a key that does not
    load, the ``[sign]`` extra missing). Its message is one line naming the file, what is wrong and the fix."""


@dataclass(frozen=True, slots=True)
class Ancestor:
    """A checkpoint another one descends from, as a lineage names it."""

    checkpoint: str
    """Its name relative to the run's root (``checkpoint-6``), or its URL."""
    root_digest: str
    """Its passport's root digest over its files, ``sha256:<hex>``."""
    verdict: Verdict
    passport_digest: str | None = None
    """``sha256:<hex>`` of its passport file's bytes, when it has one."""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"ancestor verdict must be one of {', '.join(VERDICTS)}, not {self.verdict!r}")

    def to_json(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "root_digest": self.root_digest, "verdict": self.verdict,
                "passport_digest": self.passport_digest}


@dataclass(frozen=True, slots=True)
class Lineage:
    """Where a checkpoint comes from: the checkpoint it descends from (the previous save of the run, or the one the
    run restored), and whether the training state it holds descends from a damaged one.

    ``state="descends-from-damage"`` names the ``damaged_ancestor``: the live training state was damaged there
    (the masters rounded in memory, not only in the saved file), and every later save descends from it until the
    run restores a passing checkpoint.
    """

    parent: Ancestor | None = None
    state: LineageState = "clean"
    damaged_ancestor: Ancestor | None = None

    def __post_init__(self) -> None:
        if self.state not in LINEAGE_STATES:
            raise ValueError(f"lineage state must be one of {', '.join(LINEAGE_STATES)}, not {self.state!r}")
        if (self.state == "descends-from-damage") != (self.damaged_ancestor is not None):
            raise ValueError("a lineage that descends from damage names its damaged_ancestor, and only then")

    def to_json(self) -> dict[str, Any]:
        return {"parent": None if self.parent is None else self.parent.to_json(), "state": self.state,
                "damaged_ancestor": None if self.damaged_ancestor is None else self.damaged_ancestor.to_json()}


@dataclass(frozen=True, slots=True)
class ServingInfo:
    """What a serving export's passport says beyond the audit: its quality gate, and the training checkpoint it
    came from."""

    gate: Mapping[str, Any] = field(default_factory=dict)
    """The gate's results as the export recorded them (JSON data)."""
    source: str | None = None
    """The training checkpoint it was exported from (a path or URL, as given)."""
    source_passport_digest: str | None = None
    """``sha256:<hex>`` of the training checkpoint's passport file, when it had one."""


@dataclass(frozen=True, slots=True)
class FileDigest:
    """One file of a checkpoint, as model-signing's file serialization digests it."""

    name: str
    """Relative to the checkpoint, ``/``-separated (the base name for a single-file checkpoint)."""
    digest: str
    """Hex digest of the file's bytes, of :attr:`Passport.algorithm`."""
    size: int | None = None
    """Bytes, when recorded (ckptaudit records it; model-signing does not)."""


@dataclass(frozen=True, slots=True)
class TensorDigest:
    """One logical tensor: a cryptographic digest of its values in row-major order as ``dtype`` little-endian bytes,
    whatever the files and shards they are stored in (so a DCP folder consolidated into one ``torch.save`` keeps
    every tensor's digest)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    digest: str
    """``<algorithm>:<hex>``."""


@dataclass(frozen=True, slots=True)
class Passport:
    """A checkpoint's passport, as read or written. Everything below ``signed`` comes from the signed statements:
    a verifier trusts it only once the signature verified (:func:`ckptaudit.passport.verify`)."""

    file: str | None
    """Where it was read from or written to (``None``: not written)."""
    digest: str
    """``sha256:<hex>`` of the passport file's bytes: what a descendant or a serving export names it by."""
    signed: bool
    """Signed by a key (``False``: digest-only, which proves nothing about who wrote it)."""
    signer: str | None
    """Who signed, when signed: the signing public key's fingerprint (``sha256:<hex>`` of its PEM form; under a
    certificate, the certificate's key), or the Sigstore identity (an email or a workflow URI)."""
    checkpoint: str
    """The checkpoint's name when it was attested (its base name)."""
    artifact: Artifact
    algorithm: str
    """The file digests' algorithm (model-signing's names: ``sha256``, ``blake2``)."""
    root_digest: str
    """``<algorithm>:<hex>``: model-signing's digest over the files (the in-toto subject of both statements)."""
    files: tuple[FileDigest, ...]
    tensors: tuple[TensorDigest, ...]
    """Empty when the audit that was attested recorded none."""
    verdict: Verdict
    findings: Mapping[str, int]
    """Finding code -> how many the audit reported (ignored ones left out)."""
    lineage: Lineage
    serving: ServingInfo | None = None
    tool: Mapping[str, Any] = field(default_factory=dict)
    """``{"name": "ckptaudit", "version": ...}``."""
    contract: Mapping[str, Any] = field(default_factory=dict)
    """The precision contract the audit held the checkpoint to: ``master_dtype``, ``source``, ``detail``."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """The audit's options (master dtype, expect, require, ignore, quick)."""
    summary: str = ""
    predicate: Mapping[str, Any] = field(default_factory=dict)
    """ckptaudit's predicate as it stands in the statement (JSON data), for what the fields above leave out."""
    signer_kind: SignerKind | None = None
    """How it was signed: ``key``, ``certificate`` (a key under a certificate of the user's CA), ``sigstore``
    (keyless); ``None``: digest-only (or written before the field existed)."""
    signer_issuer: str | None = None
    """The OIDC issuer that vouched for a Sigstore ``signer``."""


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """What ``ckptaudit verify`` found. ``ok`` only when the bytes are the attested ones, the signature (when a key
    was given) verified, and the recorded verdict passed for what the checkpoint is used as."""

    ok: bool
    path: str
    """The checkpoint verified (a local path or a URL)."""
    passport_file: str | None
    passport: Passport | None
    """``None`` when there was none, or it could not be read."""
    findings: tuple[Finding, ...]
    """``passport.*`` findings, each naming the file, tensor or field."""
    changed: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    changed_tensors: tuple[str, ...] = ()
    """Tensors whose digest differs, where the tensors could be compared."""
    same_tensors: bool | None = None
    """``True``: the files differ but every tensor's digest matches ("same tensors, other files"); ``None``: not
    compared (the files matched, or no tensor digests were recorded)."""
    signature: Literal["verified", "unsigned", "not-checked", "failed"] = "not-checked"
    summary: str = ""
    certificate: str | None = None
    """The signing certificate (subject, issuer, fingerprint) when the signature verified under a certificate chain
    the caller trusts (``verify --cert-chain``), or ``Sigstore identity ID (ISSUER)`` when it verified keylessly
    (``verify --sigstore-identity``)."""

    @property
    def exit_code(self) -> int:
        """0 verified; 1 a finding; 2 the passport could not be read (:func:`~ckptaudit.passport.verify` raises
        :class:`PassportError` for that, so a result's exit code is 0 or 1)."""
        return 0 if self.ok else 1
