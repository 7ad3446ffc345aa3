"""The passport file: written by ``attest``, read as untrusted input by ``verify``.

One JSON object (``schema/passport.schema.json``)::

    {"passport_version": 1, "signed": true,
     "model_signing": <sigstore bundle, or {"dsseEnvelope": ...} unsigned>,   # model-signing's statement
     "audit": <sigstore bundle, or {"dsseEnvelope": ...} unsigned>}           # ckptaudit's statement

Everything a verifier trusts is inside the two envelopes' payloads; ``signed`` only says which to expect, and
``verify --key`` refuses a passport whose envelopes carry no signature, whatever it says.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptaudit.formats.io.safejson import loads_limited
from ckptaudit.ondisk.passport import MAX_PASSPORT_BYTES, PASSPORT_VERSION, PREDICATE_TYPE
from ckptaudit.passport.model import (
    ARTIFACTS,
    LINEAGE_STATES,
    SIGNER_KINDS,
    VERDICTS,
    Ancestor,
    FileDigest,
    Lineage,
    Passport,
    PassportError,
    ServingInfo,
    TensorDigest,
)
from ckptaudit.passport.statements import MODEL_SIGNING_PREDICATE, STATEMENT_TYPE, open_envelope

__all__ = ["Parsed", "dump_passport", "parse_passport", "read_passport", "read_passport_bytes"]

_HEX = re.compile(r"^[0-9a-f]{64}$")
_DIGEST = re.compile(r"^(sha256|blake3):[0-9a-f]{64}$")


@dataclass(frozen=True, slots=True)
class Parsed:
    """A passport file taken apart, nothing verified: the raw statements and envelopes a verifier checks."""

    passport: Passport
    model_signing: Mapping[str, Any]
    """model-signing's bundle (or bare envelope) as it stands in the file."""
    audit: Mapping[str, Any]
    ms_statement: Mapping[str, Any]
    audit_statement: Mapping[str, Any]
    signatures: int
    """Signatures on each envelope (the fewer of the two)."""
    audit_files: frozenset[tuple[str, str]] = frozenset()
    """``(name, digest)`` of the files ckptaudit's statement lists (model-signing's must be the same)."""


def dump_passport(signed: bool, model_signing: Mapping[str, Any], audit: Mapping[str, Any]) -> bytes:
    """The passport file's bytes."""
    doc = {"passport_version": PASSPORT_VERSION, "signed": signed, "model_signing": dict(model_signing),
           "audit": dict(audit)}
    return (json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode()


def read_passport_bytes(file: str) -> bytes:
    """The bytes of a local passport file or a URL's, at most :data:`MAX_PASSPORT_BYTES`."""
    from ckptaudit.formats.io.safeio import LimitExceeded, read_limited
    from ckptaudit.formats.remote import is_url

    if is_url(file):
        from ckptaudit.formats.remote.staging import stage

        try:
            local, remote = stage(file)  # a .json object is staged whole (within the staging budget)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise PassportError(f"{file}: cannot read it ({exc})") from None
        try:
            return read_limited(local, MAX_PASSPORT_BYTES, "passport")
        except (OSError, LimitExceeded) as exc:
            raise PassportError(f"{file}: cannot read it as a passport ({exc})") from None
        finally:
            remote.close()
    try:
        return read_limited(file, MAX_PASSPORT_BYTES, "passport")
    except FileNotFoundError:
        raise
    except (OSError, LimitExceeded) as exc:  # not a regular file, over the limit
        raise PassportError(f"{file}: cannot read it as a passport ({exc})") from None


def read_passport(file: str) -> Passport:
    """Read a passport file (a local path or URL). Untrusted input: a file over :data:`MAX_PASSPORT_BYTES`, JSON
    beyond the readers' limits, an unknown version or a malformed field raises :class:`PassportError` with one line
    naming the file. Nothing in it is trusted until :func:`~ckptaudit.passport.verify` checked its signature."""
    return parse_passport(read_passport_bytes(file), file).passport


def _get(obj: Any, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise PassportError(f"{what}: no {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in (
            kind if isinstance(kind, tuple) else (kind,))):
        raise PassportError(f"{what}: {key!r} is a {type(value).__name__}")
    return value


def _statement(payload: bytes, predicate_type: str, what: str) -> dict[str, Any]:
    stmt = loads_limited(payload, what, unique_keys=True)
    if not isinstance(stmt, dict) or stmt.get("_type") != STATEMENT_TYPE:
        raise PassportError(f"{what}: not an in-toto statement ({STATEMENT_TYPE})")
    if stmt.get("predicateType") != predicate_type:
        raise PassportError(f"{what}: predicate type {str(stmt.get('predicateType'))[:80]!r}, expected "
                            f"{predicate_type}")
    subjects = _get(stmt, "subject", list, what)
    if len(subjects) != 1:
        raise PassportError(f"{what}: {len(subjects)} subjects, expected one")
    digest = _get(subjects[0], "digest", dict, what + " subject")
    if not isinstance(digest.get("sha256"), str) or not _HEX.match(digest["sha256"]):
        raise PassportError(f"{what}: the subject's sha256 digest is not 64 hex digits")
    _get(stmt, "predicate", dict, what)
    return stmt


def _ancestor(v: Any, what: str) -> Ancestor | None:
    if v is None:
        return None
    verdict = _get(v, "verdict", str, what)
    if verdict not in VERDICTS:
        raise PassportError(f"{what}: verdict {verdict[:40]!r} is not one of {', '.join(VERDICTS)}")
    pd = v.get("passport_digest")
    if pd is not None and not isinstance(pd, str):
        raise PassportError(f"{what}: passport_digest is a {type(pd).__name__}")
    return Ancestor(_get(v, "checkpoint", str, what), _get(v, "root_digest", str, what), verdict, pd)


def lineage_from_json(v: Any, what: str) -> Lineage:
    if v is None:
        return Lineage()
    state = _get(v, "state", str, what)
    if state not in LINEAGE_STATES:
        raise PassportError(f"{what}: state {state[:40]!r} is not one of {', '.join(LINEAGE_STATES)}")
    damaged = _ancestor(v.get("damaged_ancestor"), what + " damaged_ancestor")
    try:
        return Lineage(_ancestor(v.get("parent"), what + " parent"), state, damaged)  # type: ignore[arg-type]
    except ValueError as exc:
        raise PassportError(f"{what}: {exc}") from None


def parse_passport(raw: bytes, file: str) -> Parsed:
    """Take a passport file's bytes apart (see :func:`read_passport`)."""
    if len(raw) > MAX_PASSPORT_BYTES:
        raise PassportError(f"{file}: {len(raw)} bytes, more than a passport may hold ({MAX_PASSPORT_BYTES})")
    try:
        doc = loads_limited(raw, f"{file}", unique_keys=True)
    except ValueError as exc:
        raise PassportError(f"{file}: not a passport: {exc}") from None
    if not isinstance(doc, dict):
        raise PassportError(f"{file}: not a passport (a JSON {type(doc).__name__}, not an object)")
    version = doc.get("passport_version")
    if version != PASSPORT_VERSION:
        raise PassportError(f"{file}: passport_version {str(version)[:20]}; this ckptaudit reads version "
                            f"{PASSPORT_VERSION} (upgrade ckptaudit for a newer one)")
    try:
        return _parse(doc, raw, file)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, PassportError):
            raise
        raise PassportError(f"{file}: malformed passport ({type(exc).__name__}: {str(exc)[:200]})") from None


def _parse(doc: dict[str, Any], raw: bytes, file: str) -> Parsed:
    signed = _get(doc, "signed", bool, file)
    ms = _get(doc, "model_signing", dict, file)
    au = _get(doc, "audit", dict, file)
    ms_payload, ms_sigs = open_envelope(ms.get("dsseEnvelope"), f"{file}: model_signing")
    au_payload, au_sigs = open_envelope(au.get("dsseEnvelope"), f"{file}: audit")
    ms_stmt = _statement(ms_payload, MODEL_SIGNING_PREDICATE, f"{file}: model-signing statement")
    au_stmt = _statement(au_payload, PREDICATE_TYPE, f"{file}: audit statement")
    what = f"{file}: model-signing statement"
    pred = ms_stmt["predicate"]
    ser = _get(pred, "serialization", dict, what)
    if ser.get("method") != "files":
        raise PassportError(f"{what}: serialization {str(ser.get('method'))[:40]!r}; ckptaudit writes and reads "
                            "'files'")
    algorithm = _get(ser, "hash_type", str, what)
    if algorithm not in ("sha256", "blake3"):
        raise PassportError(f"{what}: hash type {algorithm[:40]!r} is not sha256 or blake3")
    digests: dict[str, str] = {}
    for r in _get(pred, "resources", list, what):
        name = _get(r, "name", str, what)
        d = _get(r, "digest", str, what)
        if _get(r, "algorithm", str, what) != algorithm or not _HEX.match(d):
            raise PassportError(f"{what}: resource {name[:80]!r} has no {algorithm} digest of 64 hex digits")
        if name in digests or not name or name.startswith("/") or ".." in name.split("/"):
            raise PassportError(f"{what}: resource name {name[:80]!r} is repeated or leaves the checkpoint")
        digests[name] = d
    what = f"{file}: audit statement"
    p = au_stmt["predicate"]
    if p.get("passport_version") != PASSPORT_VERSION:
        raise PassportError(f"{what}: passport_version {str(p.get('passport_version'))[:20]}, expected "
                            f"{PASSPORT_VERSION}")
    files_part = _get(p, "files", dict, what)
    sizes: dict[str, int] = {}
    listed: set[tuple[str, str]] = set()
    for f in _get(files_part, "items", list, what):
        size = _get(f, "size", int, what)
        sizes[_get(f, "name", str, what)] = size
        listed.add((f["name"], _get(f, "digest", str, what)))
    if not isinstance(files_part.get("root_digest"), str):
        raise PassportError(f"{what}: files has no root_digest")
    tensors = []
    tpart = _get(p, "tensors", dict, what)
    for t in _get(tpart, "items", list, what):
        shape = _get(t, "shape", list, what)
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape):
            raise PassportError(f"{what}: tensor {str(t.get('name'))[:80]!r} has a shape that is not whole numbers")
        digest = _get(t, "digest", str, what)
        if not _DIGEST.match(digest):
            raise PassportError(f"{what}: tensor {str(t.get('name'))[:80]!r} digest is not <sha256|blake3>:<hex>")
        tensors.append(TensorDigest(_get(t, "name", str, what), _get(t, "dtype", str, what), tuple(shape), digest))
    verdict = _get(p, "verdict", str, what)
    if verdict not in VERDICTS:
        raise PassportError(f"{what}: verdict {verdict[:40]!r} is not one of {', '.join(VERDICTS)}")
    artifact = _get(p, "artifact", str, what)
    if artifact not in ARTIFACTS:
        raise PassportError(f"{what}: artifact {artifact[:40]!r} is not one of {', '.join(ARTIFACTS)}")
    counts = _get(p, "findings", dict, what)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in counts.values()):
        raise PassportError(f"{what}: findings counts are not whole numbers")
    serving = None
    if p.get("serving") is not None:
        s = _get(p, "serving", dict, what)
        gate = s.get("gate") if isinstance(s.get("gate"), dict) else {}
        src = s.get("source")
        spd = s.get("source_passport_digest")
        serving = ServingInfo(gate, src if isinstance(src, str) else None, spd if isinstance(spd, str) else None)
    root = "sha256:" + ms_stmt["subject"][0]["digest"]["sha256"]
    files = tuple(FileDigest(n, d, sizes.get(n)) for n, d in digests.items())
    signer = p.get("signer")
    kind = p.get("signer_kind")
    if kind is not None and kind not in SIGNER_KINDS:
        raise PassportError(f"{what}: signer_kind {str(kind)[:40]!r} is not one of {', '.join(SIGNER_KINDS)}")
    issuer = p.get("signer_issuer")
    passport = Passport(
        file=file, digest="sha256:" + hashlib.sha256(raw).hexdigest(), signed=signed,
        signer=signer if isinstance(signer, str) else None, checkpoint=str(p.get("checkpoint", ""))[:4096],
        artifact=artifact, algorithm=algorithm, root_digest=root, files=files, tensors=tuple(tensors),
        verdict=verdict, findings=dict(counts), lineage=lineage_from_json(p.get("lineage"), f"{what}: lineage"),
        serving=serving, tool=p.get("tool") if isinstance(p.get("tool"), dict) else {},
        contract=p.get("contract") if isinstance(p.get("contract"), dict) else {},
        options=p.get("options") if isinstance(p.get("options"), dict) else {},
        summary=str(p.get("summary", ""))[:4096], predicate=p, signer_kind=kind,
        signer_issuer=issuer if isinstance(issuer, str) else None)
    return Parsed(passport, ms, au, ms_stmt, au_stmt, min(len(ms_sigs), len(au_sigs)), frozenset(listed))
