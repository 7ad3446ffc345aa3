"""Signing a passport with a certificate and its chain, and verifying it against the certificates a user trusts.

The bring-your-own-PKI mode of OpenSSF model-signing 1.1.1 (``model_signing sign certificate`` /
``verify certificate``): the signer holds an EC private key and a signing certificate for it (issued by the user's
CA, possibly through intermediates); each statement is signed with the key exactly as in the key mode, and the
sigstore bundle carries the signing certificate and its chain (``verificationMaterial.x509CertificateChain``)
instead of a key hint. A verifier is given the certificates it trusts (the CA's); before anything in a statement is
trusted, the bundle's chain must lead from its signing certificate to one of them, the signing certificate must be
usable for signing (KeyUsage digitalSignature, or ExtendedKeyUsage codeSigning), and the signature must verify with
the certificate's key.

As model-signing's verifier does, the chain is checked at the signing certificate's ``notBefore`` time (the bundle
has no trusted timestamp): a certificate that expired since the passport was signed still verifies; a leaf issued
by another CA, or a chain that leads nowhere trusted, never does. Needs the ``[sign]`` extra (``cryptography``,
and ``pyOpenSSL`` for the chain check, as model-signing itself uses).
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ckptaudit.passport.model import PassportError

__all__ = ["Chain", "certificate_material", "load_certificates", "signer_chain", "verify_chain"]


@dataclass(frozen=True, slots=True)
class Chain:
    """A signing certificate and the certificates that link it to a CA, as the bundle carries them."""

    leaf: Any
    """The signing certificate (``cryptography.x509.Certificate``)."""
    intermediates: tuple[Any, ...]

    @property
    def fingerprint(self) -> str:
        """``sha256:<hex>`` of the signing certificate's DER."""
        return "sha256:" + hashlib.sha256(_der(self.leaf)).hexdigest()

    def describe(self) -> str:
        """``certificate CN=... issued by CN=... (sha256:0123456789abcdef...)``: for messages."""
        return (f"certificate {self.leaf.subject.rfc4514_string() or '(no subject)'} issued by "
                f"{self.leaf.issuer.rfc4514_string() or '(no issuer)'} ({self.fingerprint[:23]}...)")


def _x509() -> Any:
    try:
        from cryptography import x509
    except ImportError:
        from ckptaudit.extras import install_line

        raise PassportError("signing and verifying a passport with a certificate needs the [sign] extra: "
                            f"{install_line('sign')}") from None
    return x509


def _der(cert: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    der: bytes = cert.public_bytes(serialization.Encoding.DER)
    return der


def load_certificates(paths: Sequence[str], what: str) -> list[Any]:
    """Every PEM certificate in ``paths`` (a file may hold several: a chain); :class:`PassportError` naming the file
    and ``what`` it was given as when one holds none or does not parse."""
    x509 = _x509()
    out: list[Any] = []
    for path in paths:
        try:
            with open(path, "rb") as fh:
                certs = x509.load_pem_x509_certificates(fh.read())
        except (OSError, ValueError) as exc:
            raise PassportError(f"{path} ({what}): cannot load it as PEM certificate(s) ({exc}); give the "
                                "certificate file(s) your CA issued (-----BEGIN CERTIFICATE-----)") from None
        out.extend(certs)
    return out


def signer_chain(private_key: Any, certificate: str, chain: Sequence[str]) -> Chain:
    """The signing certificate at ``certificate`` (it must hold ``private_key``'s public key, as model-signing
    requires) and the chain files that link it to the CA; :class:`PassportError` otherwise."""
    leaf = load_certificates([certificate], "--cert")
    if len(leaf) != 1:
        raise PassportError(f"{certificate} (--cert): {len(leaf)} certificates; give the signing certificate alone "
                            "and its issuers with --cert-chain")
    if leaf[0].public_key() != private_key.public_key():
        raise PassportError(f"{certificate} (--cert): the certificate's public key is not the one of the private key "
                            "given (--key); give the certificate issued for that key")
    return Chain(leaf[0], tuple(load_certificates(chain, "--cert-chain")))


def certificate_material(chain: Chain) -> dict[str, Any]:
    """The bundle's ``verificationMaterial`` as model-signing's certificate signer writes it."""
    certs = [chain.leaf, *chain.intermediates]
    return {"x509CertificateChain": {"certificates": [{"rawBytes": base64.b64encode(_der(c)).decode()}
                                                      for c in certs]},
            "tlogEntries": []}


def _bundle_chain(bundle: Any, what: str) -> Chain:
    x509 = _x509()
    material = bundle.get("verificationMaterial") if isinstance(bundle, dict) else None
    chain = material.get("x509CertificateChain") if isinstance(material, dict) else None
    certs = chain.get("certificates") if isinstance(chain, dict) else None
    if not isinstance(certs, list) or not certs:
        if isinstance(material, dict) and isinstance(material.get("certificate"), dict):
            raise PassportError(f"{what}: signed keylessly through Sigstore (a Fulcio certificate, not your CA's): "
                                "verify it with --sigstore-identity ID --sigstore-issuer URL")
        raise PassportError(f"{what}: carries no certificate chain (signed with a bare key: verify it with --key "
                            "PUBLIC_KEY, or attest again with --cert)")
    try:
        parsed = [x509.load_der_x509_certificate(base64.b64decode(c["rawBytes"], validate=True)) for c in certs]
    except (KeyError, TypeError, ValueError) as exc:
        raise PassportError(f"{what}: its certificate chain does not parse ({exc})") from None
    return Chain(parsed[0], tuple(parsed[1:]))


def _can_sign(leaf: Any) -> bool:
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    try:
        if leaf.extensions.get_extension_for_class(x509.KeyUsage).value.digital_signature:
            return True
    except x509.ExtensionNotFound:
        pass
    try:
        return ExtendedKeyUsageOID.CODE_SIGNING in leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return False


def verify_chain(bundle: Any, trusted: Sequence[Any], what: str) -> Chain:
    """The bundle's certificate chain, once its signing certificate chains to one of ``trusted`` (checked at its
    ``notBefore``, as model-signing does) and may sign; :class:`PassportError` naming ``what`` and the certificate
    otherwise. The caller then verifies the signature with ``chain.leaf.public_key()``."""
    chain = _bundle_chain(bundle, what)
    try:
        from OpenSSL import crypto
    except ImportError:
        raise PassportError("verifying a passport's certificate chain needs pyOpenSSL (the [sign] extra): pip "
                            "install 'ckptaudit[sign]'") from None
    store = crypto.X509Store()
    for cert in trusted:
        store.add_cert(crypto.X509.from_cryptography(cert))
    store.set_time(chain.leaf.not_valid_before_utc)
    context = crypto.X509StoreContext(store, crypto.X509.from_cryptography(chain.leaf),
                                      [crypto.X509.from_cryptography(c) for c in chain.intermediates])
    try:
        context.verify_certificate()
    except crypto.X509StoreContextError as exc:
        raise PassportError(f"{what}: its {chain.describe()} does not chain to the certificates given (--cert-chain: "
                            f"{', '.join(c.subject.rfc4514_string() for c in trusted) or 'none'}): {exc}; it was "
                            "signed under another CA, or the chain is incomplete") from None
    if not _can_sign(chain.leaf):
        raise PassportError(f"{what}: its {chain.describe()} may not sign (neither KeyUsage digitalSignature nor "
                            "ExtendedKeyUsage codeSigning)")
    return chain
