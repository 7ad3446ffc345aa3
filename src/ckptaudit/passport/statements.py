"""The passport's two in-toto statements, their DSSE envelopes, and their signatures.

1. **model-signing's statement** (predicate type ``https://model_signing/signature/v1.0``): the files' digests
   and the serialization that made them, exactly as OpenSSF model-signing 1.1.1 writes it. When signed, it is
   signed by model-signing's own key signer (``model_signing._signing.sign_ec_key``), or its certificate signer
   when a signing certificate is given (:mod:`ckptaudit.passport.certificates`), and written as the sigstore
   bundle its verifier reads (``model_signing verify key|certificate ... --signature``).
2. **ckptaudit's statement** (predicate type :data:`~ckptaudit.ondisk.passport.PREDICATE_TYPE`): the audit, about the
   same subject (the root digest). Signed the same way (DSSE's pre-authentication encoding, ECDSA with the key's
   hash, the same sigstore bundle with the key's hint), but its payload is canonical JSON of our own rather than
   model-signing's protobuf rendering, which turns every integer into a float (a shape ``[4, 8]`` would come
   back ``[4.0, 8.0]``).

Unsigned (digest-only), a statement is kept as a DSSE envelope with no signature.
"""

from __future__ import annotations

import base64
import hashlib
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ckptaudit.extras import install_line
from ckptaudit.ondisk.passport import PREDICATE_TYPE
from ckptaudit.passport.model import FileDigest, PassportError

if TYPE_CHECKING:
    from ckptaudit.passport.certificates import Chain

__all__ = ["BUNDLE_MEDIA_TYPE", "MODEL_SIGNING_PREDICATE", "PAYLOAD_TYPE", "STATEMENT_TYPE", "Key", "audit_statement",
           "canonical", "envelope", "key_fingerprint", "load_private_key", "load_public_key", "model_signing_bundle",
           "model_signing_payload", "model_signing_statement", "open_envelope", "pae", "sign_statement", "verify_bundle",
           "verify_certificate_bundle"]

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
MODEL_SIGNING_PREDICATE = "https://model_signing/signature/v1.0"
BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
_CURVES = {"secp256r1": "sha256", "secp384r1": "sha384", "secp521r1": "sha512"}
"""The curves model-signing signs with, and the hash each signs with."""

Key = Any
"""A ``cryptography`` EC key (private or public)."""


def canonical(value: Any) -> bytes:
    """The one JSON rendering of ckptaudit's payloads: sorted keys, no spaces, UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def pae(payload: bytes, payload_type: str = PAYLOAD_TYPE) -> bytes:
    """DSSE v1's pre-authentication encoding: what is signed."""
    return b"DSSEv1 %d %s %d %s" % (len(payload_type), payload_type.encode(), len(payload), payload)


def model_signing_statement(name: str, files: Sequence[FileDigest], algorithm: str, ignore: Sequence[str],
                            root: str) -> dict[str, Any]:
    """model-signing's statement about ``files`` (its ``Payload``'s shape, key for key)."""
    from ckptaudit.passport.digests import sort_key

    resources = [{"name": f.name, "algorithm": algorithm, "digest": f.digest}
                 for f in sorted(files, key=lambda f: sort_key(f.name))]
    return {"_type": STATEMENT_TYPE,
            "subject": [{"name": name, "digest": {"sha256": root.removeprefix("sha256:")}}],
            "predicateType": MODEL_SIGNING_PREDICATE,
            "predicate": {"serialization": {"method": "files", "hash_type": algorithm, "allow_symlinks": False,
                                            "ignore_paths": list(ignore)},
                          "resources": resources}}


def audit_statement(name: str, root: str, predicate: Mapping[str, Any]) -> dict[str, Any]:
    """ckptaudit's statement: the audit (``predicate``) about the checkpoint whose root digest is ``root``."""
    return {"_type": STATEMENT_TYPE, "subject": [{"name": name, "digest": {"sha256": root.removeprefix("sha256:")}}],
            "predicateType": PREDICATE_TYPE, "predicate": dict(predicate)}


def envelope(payload: bytes, signatures: Sequence[bytes] = ()) -> dict[str, Any]:
    """A DSSE envelope as the sigstore bundle spells it (base64 payload and signatures)."""
    return {"payload": base64.b64encode(payload).decode(), "payloadType": PAYLOAD_TYPE,
            "signatures": [{"sig": base64.b64encode(s).decode(), "keyid": ""} for s in signatures]}


def open_envelope(env: Any, what: str) -> tuple[bytes, list[bytes]]:
    """``(payload, signatures)`` of an untrusted DSSE envelope (the bare one of a digest-only passport, or the
    ``dsseEnvelope`` of a bundle); :class:`PassportError` naming ``what`` when it is malformed."""
    try:
        if not isinstance(env, dict) or env.get("payloadType") != PAYLOAD_TYPE:
            raise ValueError(f"payloadType is not {PAYLOAD_TYPE}")
        payload = base64.b64decode(env["payload"], validate=True)
        sigs = env.get("signatures", [])
        if not isinstance(sigs, list):
            raise ValueError("signatures is not a list")
        return payload, [base64.b64decode(s["sig"], validate=True) for s in sigs]
    except (KeyError, TypeError, ValueError) as exc:
        raise PassportError(f"{what}: not a DSSE envelope ({exc})") from None


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import serialization
    except ImportError:
        raise PassportError("signing and verifying a passport with a key needs the [sign] extra: "
                            f"{install_line('sign')}") from None
    return serialization


def load_private_key(path: str, password: bytes | None = None) -> Key:
    """An EC private key (PEM) of a curve model-signing signs with; :class:`PassportError` otherwise."""
    serialization = _crypto()
    try:
        with open(path, "rb") as fh:
            key = serialization.load_pem_private_key(fh.read(), password)
    except (OSError, ValueError, TypeError) as exc:
        raise PassportError(f"{path}: cannot load it as a PEM private key ({exc}); give an EC P-256/384/521 key, "
                            "e.g. openssl ecparam -name prime256v1 -genkey -noout -out key.pem") from None
    _check_curve(key, path)
    return key


def load_public_key(path: str) -> Key:
    """An EC public key (PEM); :class:`PassportError` otherwise."""
    serialization = _crypto()
    try:
        with open(path, "rb") as fh:
            key = serialization.load_pem_public_key(fh.read())
    except (OSError, ValueError, TypeError) as exc:
        raise PassportError(f"{path}: cannot load it as a PEM public key ({exc}); give the signer's EC public key "
                            "(openssl ec -in key.pem -pubout -out key.pub)") from None
    _check_curve(key, path)
    return key


def _check_curve(key: Key, path: str) -> None:
    curve = getattr(getattr(key, "curve", None), "name", None)
    if curve not in _CURVES:
        raise PassportError(f"{path}: a {curve or type(key).__name__} key; model-signing signs with EC keys on "
                            f"{', '.join(_CURVES)}")


def _public_pem(key: Key) -> bytes:
    serialization = _crypto()
    public = key.public_key() if hasattr(key, "private_bytes") else key
    pem: bytes = public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return pem


def key_fingerprint(key: Key) -> str:
    """model-signing's key hint: SHA-256 of the public key's PEM, ``sha256:<hex>``."""
    return "sha256:" + hashlib.sha256(_public_pem(key)).hexdigest()


def _hash(key: Key) -> Any:
    from cryptography.hazmat.primitives import hashes

    kinds: dict[str, Any] = {"sha256": hashes.SHA256, "sha384": hashes.SHA384, "sha512": hashes.SHA512}
    return kinds[_CURVES[key.curve.name]]()


def sign_statement(statement: Mapping[str, Any], key: Key, chain: Chain | None = None) -> dict[str, Any]:
    """A sigstore bundle (model-signing's key-signer layout, or its certificate-signer layout when ``chain`` is
    given: the signing certificate and its chain instead of the key's hint) of ``statement`` signed by ``key``."""
    from cryptography.hazmat.primitives.asymmetric import ec

    from ckptaudit.passport.certificates import certificate_material

    payload = canonical(statement)
    sig = key.sign(pae(payload), ec.ECDSA(_hash(key)))
    material = (certificate_material(chain) if chain is not None else
                {"publicKey": {"hint": key_fingerprint(key).removeprefix("sha256:")}, "tlogEntries": []})
    return {"mediaType": BUNDLE_MEDIA_TYPE, "verificationMaterial": material, "dsseEnvelope": envelope(payload, [sig])}


def verify_bundle(bundle: Any, key: Key, what: str) -> bytes:
    """The payload of a sigstore bundle whose DSSE signature verifies with ``key``; :class:`PassportError` (a
    ``passport.signature`` finding for the caller) when it does not, naming ``what``."""
    if not isinstance(bundle, dict) or bundle.get("mediaType") != BUNDLE_MEDIA_TYPE:
        raise PassportError(f"{what}: not a signed sigstore bundle (digest-only, or not {BUNDLE_MEDIA_TYPE})")
    material = bundle.get("verificationMaterial")
    public = material.get("publicKey") if isinstance(material, dict) else None
    hint = public.get("hint") if isinstance(public, dict) else None
    if hint and hint != key_fingerprint(key).removeprefix("sha256:"):
        raise PassportError(f"{what}: signed by another key (hint sha256:{str(hint)[:16]}..., the key given is "
                            f"{key_fingerprint(key)[:23]}...)")
    return _signed_payload(bundle, key, what, "the key given")


def _signed_payload(bundle: dict[str, Any], key: Key, what: str, whose: str) -> bytes:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric import ec

    payload, sigs = open_envelope(bundle.get("dsseEnvelope"), what)
    if len(sigs) != 1:
        raise PassportError(f"{what}: {len(sigs)} signatures, expected one")
    try:
        key.verify(sigs[0], pae(payload), ec.ECDSA(_hash(key)))
    except InvalidSignature:
        raise PassportError(f"{what}: the signature does not verify with {whose} (the statement was "
                            "changed after signing, or another key signed it)") from None
    return payload


def verify_certificate_bundle(bundle: Any, trusted: Sequence[Any], what: str) -> tuple[bytes, Chain]:
    """The payload of a sigstore bundle signed under a certificate, and its chain: first the chain must lead to one
    of ``trusted`` (:func:`~ckptaudit.passport.certificates.verify_chain`), then the DSSE signature must verify
    with the signing certificate's key; :class:`PassportError` naming ``what`` otherwise."""
    from ckptaudit.passport.certificates import verify_chain

    if not isinstance(bundle, dict) or bundle.get("mediaType") != BUNDLE_MEDIA_TYPE:
        raise PassportError(f"{what}: not a signed sigstore bundle (digest-only, or not {BUNDLE_MEDIA_TYPE})")
    chain = verify_chain(bundle, trusted, what)
    public = chain.leaf.public_key()
    _check_curve(public, what)
    return _signed_payload(bundle, public, what, f"its {chain.describe()}"), chain


def model_signing_payload(statement: Mapping[str, Any]) -> Any:
    """model-signing's own ``Payload`` of ``statement``, checked to name the root digest ckptaudit computed (or its
    verifier would refuse the bundle). Needs the ``[sign]`` extra."""
    try:
        from model_signing import manifest as ms_manifest
        from model_signing._hashing import hashing as ms_hashing
        from model_signing._signing import signing
    except ImportError as exc:
        raise PassportError(f"signing a passport needs the [sign] extra (model-signing, pyOpenSSL): "
                            f"{install_line('sign')} ({exc})") from None
    pred = statement["predicate"]
    serialization = ms_manifest.SerializationType.from_args(dict(pred["serialization"]))
    items = [serialization.new_item(r["name"], ms_hashing.Digest(r["algorithm"], bytes.fromhex(r["digest"])))
             for r in pred["resources"]]
    manifest = ms_manifest.Manifest(statement["subject"][0]["name"], items, serialization)
    payload = signing.Payload(manifest)
    ours = statement["subject"][0]["digest"]["sha256"]
    theirs = dict(payload.statement.pb.subject[0].digest)["sha256"]
    if ours != theirs:  # our serialization and model-signing's must agree, or its verifier would refuse it
        raise PassportError(f"internal: model-signing computes root digest {theirs}, ckptaudit {ours}")
    return payload


def model_signing_bundle(statement: Mapping[str, Any], key_path: str, password: str | None = None,
                         certificate: str | None = None, chain: Sequence[str] = ()) -> str:
    """Sign model-signing's ``statement`` with model-signing's own key signer (or its certificate signer, given the
    signing ``certificate`` and the ``chain`` files); the bundle's JSON text (what ``model_signing verify key`` /
    ``verify certificate`` reads). Needs the ``[sign]`` extra."""
    payload = model_signing_payload(statement)
    from model_signing._signing import sign_certificate, sign_ec_key

    try:
        signer: sign_ec_key.Signer  # the certificate signer is one
        if certificate is not None:  # model-signing's certificate signer takes no password: loaded unencrypted
            signer = sign_certificate.Signer(pathlib.Path(key_path), pathlib.Path(certificate),
                                             [pathlib.Path(c) for c in chain])
        else:
            signer = sign_ec_key.Signer(pathlib.Path(key_path), password)
    except (ValueError, TypeError, OSError) as exc:
        raise PassportError(f"{key_path}: model-signing cannot sign with it ({exc})") from None
    text: str = signer.sign(payload).bundle.to_json()  # type: ignore[attr-defined]
    return text
