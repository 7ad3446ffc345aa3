"""Keyless (Sigstore) passports (issue 38's "keyless sigstore where the user has it"). This machine kind has no
network, so what is tested is everything that runs without the public Sigstore service, for real:

- a bundle the public-good instance made (model-signing's own test data, ``sigstore_public_good/``) verifies
  offline through ckptaudit's keyless verifier and model-signing's, is held to its identity and issuer, and is
  refused once changed; ckptaudit's file digests of the signed files are the ones it signed;
- ``verify --sigstore-identity`` runs a passport's statements through it in order, and refuses a passport signed
  with a key, or digest-only, in one finding;
- ``attest --sigstore`` with no token, a malformed token, the extra missing, or Sigstore unreachable (TUF, then
  Fulcio) stops in one line with exit 2 and writes nothing; the options parse;
- the predicate records how a passport was signed.

Keyless *signing* against the real service is wired (model-signing's Sigstore signer, sigstore-python's) but not
exercised here: it needs Fulcio, Rekor and an OIDC token.

Run: ``.venv/bin/python -m pytest -q tests/passport/test_passport_keyless.py``
"""

from __future__ import annotations

import base64
import copy
import io
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.cli import main
from ckptaudit.ondisk.passport import PASSPORT_NAME, SIGNATURE_NAME
from ckptaudit.passport import PassportError, attest, read_passport, verify
from ckptaudit.passport.digests import digest_files, list_files, root_digest
from ckptaudit.passport.keyless import KeylessVerifier, SigstoreIdentity

pytest.importorskip("sigstore")
pytest.importorskip("model_signing")

HERE = Path(__file__).parent / "sigstore_public_good"
SIGNED = HERE / "v1.1.0-sigstore"
BUNDLE = HERE / "model.sig"
SIGNER = SigstoreIdentity("stefanb@us.ibm.com", "https://sigstore.verify.ibm.com/oauth2", offline=True)
_AMBIENT = ("GITHUB_ACTIONS", "ACTIONS_ID_TOKEN_REQUEST_TOKEN", "ACTIONS_ID_TOKEN_REQUEST_URL",
            "GOOGLE_SERVICE_ACCOUNT_NAME", "BUILDKITE", "GITLAB_CI", "CIRCLECI", "SIGSTORE_IDENTITY_TOKEN")


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def _bundle() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(BUNDLE.read_text())
    return doc


@pytest.fixture(autouse=True)
def _sigstore_dirs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """sigstore-python's TUF metadata and caches (written even offline) under tmp_path, not the user's home."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ambient identity, and every HTTP(S) request sent to a closed port: the same on a machine with network as
    without."""
    for name in _AMBIENT:
        monkeypatch.delenv(name, raising=False)
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A small training checkpoint that passes its audit (model and an AdamW state)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8)).square().mean().backward()
    opt.step()
    d = tmp_path / "step-2"
    d.mkdir()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, d / "model.pt")
    return d


def _token(**claims: Any) -> str:
    """An unsigned OIDC token of the shape Sigstore takes (sigstore-python reads it; only Fulcio would check it)."""
    def part(d: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()

    now = int(time.time())
    body = {"iss": "https://oauth2.sigstore.dev/auth", "sub": "trainer", "email": "trainer@example.com",
            "aud": "sigstore", "iat": now, "exp": now + 600, **claims}
    return f"{part({'alg': 'RS256', 'typ': 'JWT'})}.{part(body)}.c2lnbmF0dXJl"


def _embedded_trust_config(where: Path) -> str:
    """The public instance's client trust configuration from the copy sigstore-python ships (no TUF refresh)."""
    from importlib.resources import files

    store = files("sigstore") / "_store" / "https%3A%2F%2Ftuf-repo-cdn.sigstore.dev"
    doc = {"mediaType": "application/vnd.dev.sigstore.clienttrustconfig.v0.1+json",
           "trustedRoot": json.loads((store / "trusted_root.json").read_text()),
           "signingConfig": json.loads((store / "signing_config.v0.2.json").read_text())}
    path = where / "trust_config.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_a_public_good_bundle_verifies_offline_and_is_held_to_its_identity(tmp_path: Path) -> None:
    verifier = KeylessVerifier(SIGNER)
    payload, who = verifier.payload(_bundle(), "model.sig")
    assert who == "Sigstore identity stefanb@us.ibm.com (https://sigstore.verify.ibm.com/oauth2)"
    # What it signed is model-signing's statement of these two files, in the serialization ckptaudit writes.
    stmt = json.loads(payload)
    files = digest_files(list_files(str(SIGNED)), "sha256")
    assert {(r["name"], r["digest"]) for r in stmt["predicate"]["resources"]} == {(f.name, f.digest) for f in files}
    assert root_digest(files) == "sha256:" + stmt["subject"][0]["digest"]["sha256"]

    for other, says in ((SigstoreIdentity("mallory@example.com", SIGNER.issuer, offline=True),
                         "Certificate's SANs do not match mallory@example.com"),
                        (SigstoreIdentity(SIGNER.identity, "https://accounts.google.com", offline=True),
                         "OIDCIssuer does not match")):
        with pytest.raises(PassportError, match=says) as info:
            KeylessVerifier(other).payload(_bundle(), "model.sig")
        assert "\n" not in str(info.value)
    changed = _bundle()
    changed["dsseEnvelope"]["payload"] = base64.b64encode(payload.replace(b"signme-2", b"signme-3")).decode()
    with pytest.raises(PassportError, match="DSSE: invalid signature"):
        verifier.payload(changed, "model.sig")

    # model-signing's own Sigstore verifier agrees, offline, given the trusted root sigstore-python ships.
    import model_signing.hashing
    import model_signing.verifying

    model = tmp_path / "model"
    shutil.copytree(SIGNED, model)
    config = model_signing.verifying.Config().use_sigstore_verifier(
        identity=SIGNER.identity, oidc_issuer=SIGNER.issuer, trust_config=Path(_embedded_trust_config(tmp_path)))
    config.verify(model, BUNDLE)
    (model / "signme-1").write_bytes(b"signme-X")
    with pytest.raises(ValueError, match="signme-1"):
        config.verify(model, BUNDLE)


def _passport_around(folder: Path, audit_bundle: dict[str, Any]) -> None:
    """A passport whose model-signing half is the public-good bundle and whose audit half is ``audit_bundle``."""
    doc = {"passport_version": 1, "signed": True, "model_signing": _bundle(), "audit": audit_bundle}
    (folder / PASSPORT_NAME).write_text(json.dumps(doc))


def _audit_statement(stmt: dict[str, Any]) -> bytes:
    from ckptaudit.ondisk.passport import PREDICATE_TYPE
    from ckptaudit.passport.statements import canonical

    files = [{"name": r["name"], "digest": r["digest"], "size": 8} for r in stmt["predicate"]["resources"]]
    predicate = {"passport_version": 1, "tool": {"name": "ckptaudit", "version": "0"}, "checkpoint": "m",
                 "artifact": "training", "options": {}, "contract": None, "verdict": "pass", "summary": "",
                 "format": "x", "findings": {}, "files": {"algorithm": "sha256", "items": files,
                                                          "root_digest": "sha256:" + stmt["subject"][0]["digest"]["sha256"]},
                 "tensors": {"algorithm": None, "items": []}, "serving": None, "lineage": None,
                 "signer": SIGNER.identity, "signer_kind": "sigstore", "signer_issuer": SIGNER.issuer}
    return canonical({**stmt, "predicateType": PREDICATE_TYPE, "predicate": predicate})


def test_verify_runs_both_statements_through_sigstore_in_order(tmp_path: Path) -> None:
    """The model-signing statement, signed by the public instance, passes; ckptaudit's statement (here not signed by
    that identity: the real service cannot be reached to sign one) is then refused, by name, before anything in it
    is trusted."""
    folder = tmp_path / "v1.1.0-sigstore"
    shutil.copytree(SIGNED, folder)
    stmt = json.loads(base64.b64decode(_bundle()["dsseEnvelope"]["payload"]))
    forged = copy.deepcopy(_bundle())  # the identity's certificate and signature, around another payload
    forged["dsseEnvelope"]["payload"] = base64.b64encode(_audit_statement(stmt)).decode()
    _passport_around(folder, forged)
    assert read_passport(str(folder / PASSPORT_NAME)).signer_kind == "sigstore"

    args = ("--sigstore-identity", SIGNER.identity, "--sigstore-issuer", SIGNER.issuer, "--sigstore-offline")
    code, out, err = _cli("verify", str(folder), *args)
    assert code == 1 and err == "", out + err
    assert "audit statement: Sigstore verification failed" in out and "DSSE: invalid signature" in out
    assert "model-signing statement" not in out  # the first statement verified

    code, out, _ = _cli("verify", str(folder), "--sigstore-identity", "mallory@example.com",
                        "--sigstore-issuer", SIGNER.issuer, "--sigstore-offline")
    assert code == 1 and "model-signing statement: Sigstore verification failed for mallory@example.com" in out

    # Held to a CA of one's own instead, it is named for what it is.
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    leaf = x509.load_der_x509_certificate(base64.b64decode(_bundle()["verificationMaterial"]["certificate"]["rawBytes"]))
    ca = tmp_path / "ca.pem"
    ca.write_bytes(leaf.public_bytes(Encoding.PEM))
    code, out, _ = _cli("verify", str(folder), "--cert-chain", str(ca))
    assert code == 1 and "signed keylessly through Sigstore" in out and "--sigstore-identity ID" in out


def test_a_key_signed_or_digest_only_passport_is_refused_by_the_sigstore_verifier(ckpt: Path, tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    private = tmp_path / "key.pem"
    private.write_bytes(key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption()))
    args = ("--sigstore-identity", SIGNER.identity, "--sigstore-issuer", SIGNER.issuer, "--sigstore-offline")

    p = attest(str(ckpt), key=str(private))
    assert p.signer_kind == "key" and p.signer is not None and p.signer.startswith("sha256:")
    code, out, err = _cli("verify", str(ckpt), *args)
    head = out.splitlines()[0]  # the verdict's line, then the finding's
    assert code == 1 and err == "" and head.startswith("FAILED"), out + err
    assert "model-signing statement: not a Sigstore keyless bundle" in head and "--key or --cert-chain" in head
    result = verify(str(ckpt), sigstore=SIGNER)
    assert result.signature == "failed" and [f.code for f in result.findings] == ["passport.signature"]

    p = attest(str(ckpt))
    assert p.signer_kind is None and p.signer is None and not p.signed
    code, out, _ = _cli("verify", str(ckpt), *args)
    assert code == 1 and "a digest-only passport (no signature)" in out and "attest the checkpoint again with " \
        "--sigstore" in out


def test_attest_sigstore_without_a_token_service_or_extra_stops_in_one_line(ckpt: Path, tmp_path: Path,
                                                                         offline: None,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def one_line(*argv: str) -> str:
        code, out, err = _cli(*argv)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (argv, out, err)
        assert "Traceback" not in err and not (ckpt / PASSPORT_NAME).exists() and not (ckpt / SIGNATURE_NAME).exists()
        return err

    err = one_line("attest", str(ckpt), "--sigstore")
    assert "needs an OIDC identity token: give --identity-token TOKEN" in err and "never opens a browser" in err
    err = one_line("attest", str(ckpt), "--sigstore", "--identity-token", "not-a-jwt")
    assert "is not one Sigstore accepts" in err and "audience 'sigstore'" in err
    err = one_line("attest", str(ckpt), "--sigstore", "--identity-token", _token(exp=int(time.time()) - 3600))
    assert "is not one Sigstore accepts" in err
    # A well-formed token: the service is what cannot be reached, first Sigstore's TUF repository...
    err = one_line("attest", str(ckpt), "--sigstore", "--identity-token", _token())
    assert "cannot reach Sigstore's TUF repository" in err and "sign with a key (--key)" in err
    # ... then, with the trust configuration at hand, Fulcio: after the audit, and still nothing written.
    monkeypatch.setenv("SIGSTORE_IDENTITY_TOKEN", _token())
    err = one_line("attest", str(ckpt), "--sigstore", "--sigstore-trust-config", _embedded_trust_config(tmp_path))
    assert "keyless signing through Sigstore failed" in err and "Fulcio" in err
    err = one_line("verify", str(ckpt), "--sigstore-identity", "a@example.com", "--sigstore-issuer", "https://x")
    assert "cannot reach Sigstore's TUF repository" in err and "--sigstore-offline" in err

    monkeypatch.setitem(sys.modules, "sigstore.sign", None)  # "import sigstore.sign" raises ImportError
    from ckptaudit.extras import install_line

    for argv in (("attest", str(ckpt), "--sigstore"),
                 ("verify", str(ckpt), "--sigstore-identity", "a@example.com", "--sigstore-issuer", "https://x")):
        err = one_line(*argv)
        assert "needs the [sign] extra" in err and install_line("sign") in err


def test_the_keyless_options_parse(ckpt: Path, tmp_path: Path) -> None:
    key = tmp_path / "key.pem"
    key.write_text("x")
    for argv, says in ((("attest", str(ckpt), "--identity-token", "t"), "add --sigstore"),
                       (("attest", str(ckpt), "--sigstore-trust-config", "f"), "add --sigstore"),
                       (("attest", str(ckpt), "--sigstore", "--key", str(key)), "not both"),
                       (("verify", str(ckpt), "--sigstore-identity", "a@example.com"), "needs both"),
                       (("verify", str(ckpt), "--sigstore-issuer", "https://x"), "needs both"),
                       (("verify", str(ckpt), "--sigstore-offline"), "give --sigstore-identity ID"),
                       (("verify", str(ckpt), "--key", str(key), "--sigstore-identity", "a", "--sigstore-issuer",
                         "https://x"), "give one of --key")):
        code, out, err = _cli(*argv)
        assert code == 2 and out == "" and says in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert not (ckpt / PASSPORT_NAME).exists()


def test_the_guard_signs_keylessly_with_the_jobs_ambient_identity_or_says_why_not(
        ckpt: Path, tmp_path: Path, offline: None, caplog: pytest.LogCaptureFixture) -> None:
    """``Guard(passport_sigstore=True)``: each passport asks for the job's ambient identity; where there is none the
    checkpoint's verdict stands (it passed), no passport is placed, and the log says why in one line."""
    from ckptaudit.integrations.guard import Guard

    good = tmp_path / "run" / "checkpoint-2"
    shutil.copytree(ckpt, good)
    guard = Guard(background="thread", passport_sigstore=True)
    assert guard.signing["sigstore"] is True
    guard.submit(str(good), step=2)
    with caplog.at_level("WARNING", logger="ckptaudit"):
        assert guard.close(120)
    (v,) = guard.verdicts
    assert v.ok and v.passport is None and not (good / PASSPORT_NAME).exists()
    (said,) = [r.getMessage() for r in caplog.records if "passport could not be written" in r.getMessage()]
    assert "needs an OIDC identity token" in said and "\n" not in said
    with pytest.raises(ValueError, match="passport_sigstore=True signs each passport keylessly"):
        Guard(passport_sigstore=True, passport=False)


def test_a_sigstore_policy_file_where_a_key_goes_in_latest_the_store_loader_and_the_testing_assertion(
        ckpt: Path, tmp_path: Path) -> None:
    """``latest --require passport=POLICY.json``, ``require_passport=POLICY.json`` (the store loader's step) and
    ``assert_passport_verifies(key=POLICY.json)``: a JSON trust file names the keyless signer trusted. The
    public-good statement passes it and the unsigned audit statement beside it does not; a key-signed passport is
    refused as not keyless; a JSON file that is no policy is one line."""
    from ckptaudit.passport import passport_findings
    from ckptaudit.testing import PassportFailed, assert_passport_verifies

    policy = tmp_path / "trust.json"
    policy.write_text(json.dumps({"sigstore": {"identity": SIGNER.identity, "issuer": SIGNER.issuer,
                                               "offline": True}}))
    run = tmp_path / "run"
    keyed, keyless = run / "step-2", run / "step-4"
    shutil.copytree(ckpt, keyed)
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric import ec

    key = tmp_path / "key.pem"
    key.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption()))
    attest(str(keyed), key=str(key))
    shutil.copytree(SIGNED, keyless)
    stmt = json.loads(base64.b64decode(_bundle()["dsseEnvelope"]["payload"]))
    forged = copy.deepcopy(_bundle())
    forged["dsseEnvelope"]["payload"] = base64.b64encode(_audit_statement(stmt)).decode()
    _passport_around(keyless, forged)

    code, out, err = _cli("latest", str(run), "--require", f"passport={policy}", "--format", "json",
                          "--no-progress", "--all")
    doc = json.loads(out)
    assert doc["latest"] is None and code == 1, out + err
    rows = {c["name"]: " ".join(f["message"] for f in c["findings"]) for c in doc["candidates"]}
    assert "model-signing statement: not a Sigstore keyless bundle" in rows["step-2"]
    assert "audit statement: Sigstore verification failed" in rows["step-4"]

    [refused] = passport_findings(str(keyless), "step-4", key=str(policy))
    assert refused.code == "passport.signature" and "DSSE: invalid signature" in refused.message
    with pytest.raises(PassportFailed, match="not a Sigstore keyless bundle"):
        assert_passport_verifies(keyed, key=policy)

    policy.write_text(json.dumps({"sigstore": {"identity": SIGNER.identity}}))
    [bad] = passport_findings(str(keyed), "step-2", key=str(policy))
    assert bad.code == "passport.malformed" and "a JSON trust file is a Sigstore policy" in bad.message
