"""Keyless signing: a passport signed through Sigstore (an OIDC identity, a short-lived Fulcio certificate, the
signature logged in Rekor), and verified against the identity and issuer a user trusts.

Signing (``attest --sigstore``): model-signing's statement goes through model-signing's own Sigstore signer
(``model_signing sign sigstore``), ckptaudit's statement through sigstore-python's signer with the same identity
token; both bundles are written in the passport, model-signing's also as the ``.sig`` its verifier reads. The token
is the one given (``--identity-token``) or an ambient one (GitHub Actions with ``id-token: write``, GCP, GitLab,
Buildkite, CircleCI: sigstore's own detection); ckptaudit never opens a browser, so a guard or a CI job cannot hang
on a login.

Verifying (``verify --sigstore-identity ID --sigstore-issuer URL``): each bundle goes through sigstore-python's
verifier (what model-signing's ``verify sigstore`` runs): the certificate must chain to Fulcio's root in the trusted
root, carry the identity and issuer given, and have been valid when the signature was logged (Rekor's inclusion
proof and signed timestamp, all inside the bundle: no request to the log); then the DSSE signature must verify. The
trusted root is refreshed from Sigstore's TUF repository, or, with ``offline``, the one sigstore-python holds
(embedded in the package or cached by an earlier refresh); ``trust_config`` names another (a private Sigstore).
Needs the ``[sign]`` extra (model-signing brings sigstore).
"""

from __future__ import annotations

import json
import logging
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptaudit.extras import install_line
from ckptaudit.passport.model import PassportError

__all__ = ["AMBIENT", "KeylessSigner", "SigstoreIdentity", "SigstoreSigning", "keyless_signer", "verify_keyless"]

AMBIENT = ("GitHub Actions with `permissions: id-token: write`, Google Cloud, GitLab CI, Buildkite, CircleCI")
"""Where sigstore finds an identity token without being given one."""
_AUDIENCE = "sigstore"
"""The OIDC audience (client id) Sigstore's public instance issues certificates for."""


@dataclass(frozen=True, slots=True)
class SigstoreSigning:
    """How ``attest`` signs keylessly."""

    identity_token: str | None = None
    """An OIDC identity token (a JWT for audience ``sigstore``); ``None``: an ambient one (:data:`AMBIENT`)."""
    trust_config: str | None = None
    """A Sigstore client trust configuration (JSON) for another instance than the public one."""


@dataclass(frozen=True, slots=True)
class SigstoreIdentity:
    """Who ``verify`` trusts to have signed keylessly."""

    identity: str
    """The certificate's identity (its SAN): an email, or a workflow's URI (``https://github.com/ORG/REPO/...``)."""
    issuer: str
    """The OIDC issuer that vouched for it (``https://token.actions.githubusercontent.com``, ...)."""
    offline: bool = False
    """Use the trusted root sigstore-python holds instead of refreshing it from Sigstore's TUF repository."""
    trust_config: str | None = None
    """A Sigstore client trust configuration (JSON) for another instance than the public one."""

    def __post_init__(self) -> None:
        if not self.identity or not self.issuer:
            raise PassportError("keyless verification needs both --sigstore-identity (who signed: an email or a "
                                "workflow URI) and --sigstore-issuer (the OIDC issuer's URL)")

    def describe(self) -> str:
        return f"{self.identity} ({self.issuer})"


def _sigstore() -> Any:
    try:
        import sigstore.dsse
        import sigstore.errors
        import sigstore.models
        import sigstore.oidc
        import sigstore.sign
        import sigstore.verify
    except ImportError:
        raise PassportError("keyless (Sigstore) signing and verifying needs the [sign] extra: "
                            f"{install_line('sign')}") from None
    return sigstore


def _errors() -> tuple[type[BaseException], ...]:
    """What Sigstore's clients raise for an unreachable service, a refused token, a bad trust configuration."""
    import requests
    import sigstore.errors
    from id import IdentityError

    return sigstore.errors.Error, IdentityError, requests.RequestException, OSError, ValueError


def _trust(sigstore: Any, path: str | None, offline: bool, doing: str) -> Any:
    """The client trust configuration: the file given, or the public instance's (refreshed unless ``offline``)."""
    models = sigstore.models
    if path is not None:
        try:
            return models.ClientTrustConfig.from_json(pathlib.Path(path).read_text())
        except _errors() as exc:
            raise PassportError(f"{path} (--sigstore-trust-config): not a Sigstore client trust configuration "
                                f"({_line(exc)})") from None
    # Offline is what was asked for: sigstore's warning that it will not refresh would be a second line.
    quiet = logging.getLogger("sigstore._internal.tuf")
    level = quiet.level
    if offline:
        quiet.setLevel(logging.ERROR)
    try:
        return models.ClientTrustConfig.production(offline=offline)
    except _errors() as exc:
        cause = _line(exc)
        hint = ("verify with --sigstore-offline to use the trusted root sigstore-python holds" if doing == "verify"
                else "sign with a key (--key) where Sigstore cannot be reached")
        raise PassportError(f"cannot reach Sigstore's TUF repository to refresh its trusted root ({cause}); "
                            f"run where it is reachable, or {hint}") from None
    finally:
        quiet.setLevel(level)


def _line(exc: BaseException) -> str:
    """``Kind: the first line of its message`` (pydantic's run on for lines), at most 300 characters."""
    first = (str(exc).strip().splitlines() or [""])[0]
    cause = exc.__cause__ or exc.__context__
    more = f" ({_line(cause)})" if cause is not None and cause is not exc else ""
    return " ".join(f"{type(exc).__name__}: {first}{more}".split())[:300]


def _identity_token(sigstore: Any, given: str | None) -> tuple[str, Any]:
    """The OIDC token to sign with (its text, and parsed: not verified, Fulcio does that): the one given, or an
    ambient one."""
    raw = given
    if raw is None:
        try:
            raw = sigstore.oidc.detect_credential(_AUDIENCE)
        except _errors() as exc:
            raise PassportError(f"keyless signing: the ambient credential could not be read ({_line(exc)})") from None
        if raw is None:
            raise PassportError("keyless signing (--sigstore) needs an OIDC identity token: give --identity-token "
                                f"TOKEN, or run where one is found without asking ({AMBIENT}); ckptaudit never "
                                "opens a browser to log in")
    raw = raw.strip()
    try:
        return raw, sigstore.oidc.IdentityToken(raw, _AUDIENCE)
    except _errors() as exc:
        raise PassportError(f"the identity token (--identity-token, $SIGSTORE_IDENTITY_TOKEN or ambient) is not one "
                            f"Sigstore accepts ({_line(exc)}); give an unexpired OIDC token issued for the audience "
                            f"{_AUDIENCE!r}") from None


class KeylessSigner:
    """(one attest) Signs the passport's two statements through Sigstore with one identity token. Made before the
    audit (:func:`keyless_signer`), so that a missing extra, token or service stops attest before any reading."""

    def __init__(self, sigstore: Any, raw: str, token: Any, trust: Any, config: str | None) -> None:
        self._sigstore = sigstore
        self._raw = raw
        self._token = token
        self._trust = trust
        self._config = config

    @property
    def identity(self) -> str:
        """The identity the certificates will carry (the token's)."""
        return str(self._token.identity)

    @property
    def issuer(self) -> str:
        """The issuer the certificates will name (the token's federated issuer)."""
        return str(self._token.federated_issuer)

    def sign_model_signing(self, payload: Any) -> str:
        """model-signing's ``payload`` (a ``model_signing._signing.signing.Payload``) signed by model-signing's
        Sigstore signer: the bundle's JSON text (what ``model_signing verify sigstore`` reads)."""
        from model_signing._signing import sign_sigstore

        try:
            signer = sign_sigstore.Signer(identity_token=self._raw, use_ambient_credentials=False,
                                          trust_config=None if self._config is None else pathlib.Path(self._config))
            text: str = signer.sign(payload).bundle.to_json()
        except _errors() as exc:
            raise _service_error(exc) from None
        return text

    def sign_statement(self, payload: bytes) -> dict[str, Any]:
        """A sigstore bundle of the in-toto statement ``payload`` (its exact bytes) signed keylessly."""
        sigstore = self._sigstore
        try:
            statement = sigstore.dsse.Statement(payload)
            context = sigstore.sign.SigningContext.from_trust_config(self._trust)
            with context.signer(self._token) as signer:
                bundle = signer.sign_dsse(statement)
        except _errors() as exc:
            raise _service_error(exc) from None
        out: dict[str, Any] = json.loads(bundle.to_json())
        return out


def _service_error(exc: BaseException) -> PassportError:
    return PassportError(f"keyless signing through Sigstore failed ({_line(exc)}): Fulcio (the certificate) and "
                         "Rekor (the log) must be reachable and accept the identity token; sign with a key (--key) "
                         "where they are not")


def keyless_signer(how: SigstoreSigning) -> KeylessSigner:
    """The signer for one attest: the extra, the identity token and Sigstore's trust configuration checked first;
    :class:`PassportError` (one line naming what is missing and the fix) otherwise."""
    sigstore = _sigstore()
    try:
        import model_signing._signing.sign_sigstore  # noqa: F401 - the extra's other half, checked up front
    except ImportError as exc:
        raise PassportError(f"keyless signing needs the [sign] extra (model-signing): {install_line('sign')} "
                            f"({exc})") from None
    raw, token = _identity_token(sigstore, how.identity_token)
    return KeylessSigner(sigstore, raw, token, _trust(sigstore, how.trust_config, False, "sign"), how.trust_config)


class KeylessVerifier:
    """(one verify) sigstore-python's verifier over the trusted root, with the identity policy given."""

    def __init__(self, who: SigstoreIdentity) -> None:
        sigstore = _sigstore()
        self.who = who
        trust = _trust(sigstore, who.trust_config, who.offline, "verify")
        self._sigstore = sigstore
        self._verifier = sigstore.verify.Verifier(trusted_root=trust.trusted_root)
        self._policy = sigstore.verify.policy.Identity(identity=who.identity, issuer=who.issuer)

    def payload(self, bundle: Mapping[str, Any], what: str) -> tuple[bytes, str]:
        """The DSSE payload of ``bundle`` once it verifies for the identity trusted, and its certificate described;
        :class:`PassportError` naming ``what`` otherwise (a ``passport.signature`` finding for the caller)."""
        from ckptaudit.passport.statements import open_envelope

        sigstore = self._sigstore
        try:
            parsed = sigstore.models.Bundle.from_json(json.dumps(dict(bundle)))
        except _errors() as exc:
            raise PassportError(f"{what}: not a Sigstore keyless bundle ({_line(exc)}): signed with a key or a "
                                "certificate of your own, or not signed; verify it with --key or --cert-chain") from None
        try:
            kind, payload = self._verifier.verify_dsse(parsed, self._policy)
        except _errors() as exc:
            raise PassportError(f"{what}: Sigstore verification failed for {self.who.describe()} ({_line(exc)}); "
                                f"it was signed by another identity, or changed after signing") from None
        if payload != open_envelope(bundle.get("dsseEnvelope"), what)[0]:
            raise PassportError(f"{what}: the payload Sigstore verified is not the envelope's")
        del kind  # verify_dsse accepts only the in-toto payload type
        return payload, f"Sigstore identity {self.who.describe()}"


def verify_keyless(bundle: Mapping[str, Any], who: SigstoreIdentity, what: str) -> bytes:
    """The payload of one keyless ``bundle`` that verifies for ``who`` (see :class:`KeylessVerifier`)."""
    return KeylessVerifier(who).payload(bundle, what)[0]

