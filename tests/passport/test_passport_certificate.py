"""Passports signed under a certificate and its chain (issue 38's "bring-your-own key pair and certificate"): a real
CA, intermediate and leaf made with ``cryptography``; ``attest --key --cert --cert-chain`` signs, ``verify
--cert-chain CA`` checks the chain before anything in the predicate (exit 0), a passport signed under another CA's
leaf is refused (exit 1, naming the certificate), and model-signing's own certificate verifier accepts the bundle.

Run: ``.venv/bin/python -m pytest -q tests/passport/test_passport_certificate.py``
"""

from __future__ import annotations

import datetime
import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.cli import main
from ckptaudit.ondisk.passport import PASSPORT_NAME, SIGNATURE_NAME
from ckptaudit.passport import PassportError, attest, verify

x509 = pytest.importorskip("cryptography.x509")
pytest.importorskip("model_signing")
pytest.importorskip("OpenSSL")


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def _pki(where: Path, name: str) -> dict[str, str]:
    """A root CA, an intermediate CA and a code-signing leaf under them (PEM files); returns their paths."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key: Any, issuer: str, issuer_key: Any, ca: bool) -> Any:
        usage = x509.KeyUsage(digital_signature=not ca, content_commitment=False, key_encipherment=False,
                              data_encipherment=False, key_agreement=False, key_cert_sign=ca, crl_sign=ca,
                              encipher_only=False, decipher_only=False)
        b = (x509.CertificateBuilder()
             .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=30))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
             .add_extension(usage, critical=True))
        if not ca:
            b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    root_key, mid_key, leaf_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    root = cert(f"{name} Root CA", root_key, f"{name} Root CA", root_key, True)
    mid = cert(f"{name} Intermediate", mid_key, f"{name} Root CA", root_key, True)
    leaf = cert(f"{name} trainer", leaf_key, f"{name} Intermediate", mid_key, False)
    where.mkdir(parents=True, exist_ok=True)
    paths = {k: str(where / f"{name}-{k}.pem") for k in ("root", "mid", "leaf", "key")}
    for k, c in (("root", root), ("mid", mid), ("leaf", leaf)):
        Path(paths[k]).write_bytes(c.public_bytes(ser.Encoding.PEM))
    Path(paths["key"]).write_bytes(leaf_key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8,
                                                          ser.NoEncryption()))
    return paths


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A small training checkpoint that passes its audit (model and an AdamW state)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    d = tmp_path / "step-2"
    d.mkdir()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, d / "model.pt")
    return d


def test_signed_under_a_certificate_verifies_by_its_chain_and_model_signing_agrees(ckpt: Path,
                                                                                  tmp_path: Path) -> None:
    ours, other = _pki(tmp_path / "pki", "acme"), _pki(tmp_path / "pki", "rival")
    code, out, err = _cli("attest", str(ckpt), "--key", ours["key"], "--cert", ours["leaf"],
                          "--cert-chain", ours["mid"])
    assert code == 0, out + err
    bundle = json.loads((ckpt / PASSPORT_NAME).read_text())["audit"]
    assert len(bundle["verificationMaterial"]["x509CertificateChain"]["certificates"]) == 2  # the leaf, its issuer

    code, out, err = _cli("verify", str(ckpt), "--cert-chain", ours["root"], "--format", "json")
    doc = json.loads(out)
    assert code == 0 and doc["signature"] == "verified", out + err
    assert "CN=acme trainer issued by CN=acme Intermediate" in doc["certificate"]
    assert "under its certificate CN=acme trainer" in doc["summary"]

    # The real model-signing verifier (``model_signing verify certificate``'s Python API) accepts the bundle.
    import model_signing.verifying

    model_signing.verifying.Config().use_certificate_verifier(certificate_chain=[ours["root"]]).verify(
        ckpt, ckpt / SIGNATURE_NAME)

    # Trusting another CA: the chain is refused before anything in the passport is read as true.
    code, out, err = _cli("verify", str(ckpt), "--cert-chain", other["root"])
    assert code == 1, out + err
    assert "does not chain to the certificates given (--cert-chain: CN=rival Root CA)" in out
    assert "CN=acme trainer issued by CN=acme Intermediate" in out
    with pytest.raises(Exception, match="unable to get local issuer certificate"):
        model_signing.verifying.Config().use_certificate_verifier(certificate_chain=[other["root"]]).verify(
            ckpt, ckpt / SIGNATURE_NAME)


def test_a_passport_signed_by_another_cas_leaf_is_refused(ckpt: Path, tmp_path: Path) -> None:
    ours, rival = _pki(tmp_path / "pki", "acme"), _pki(tmp_path / "pki", "rival")
    p = attest(str(ckpt), key=rival["key"], certificate=rival["leaf"], cert_chain=[rival["mid"]])
    assert p.signed
    result = verify(str(ckpt), cert_chain=[ours["root"]])
    assert not result.ok and result.signature == "failed" and result.exit_code == 1
    (f,) = result.findings
    assert f.code == "passport.signature" and "CN=rival trainer issued by CN=rival Intermediate" in f.message
    assert "signed under another CA" in f.message
    assert verify(str(ckpt), cert_chain=[rival["root"]]).ok  # its own CA accepts it


def test_a_changed_statement_under_a_good_chain_is_refused(ckpt: Path, tmp_path: Path) -> None:
    """The chain is good, the signature is not: the predicate was edited after signing."""
    import base64

    ours = _pki(tmp_path / "pki", "acme")
    attest(str(ckpt), key=ours["key"], certificate=ours["leaf"], cert_chain=[ours["mid"]])
    doc = json.loads((ckpt / PASSPORT_NAME).read_text())
    env = doc["audit"]["dsseEnvelope"]
    stmt = json.loads(base64.b64decode(env["payload"]))
    stmt["predicate"]["verdict"] = "pass" if stmt["predicate"]["verdict"] != "pass" else "fail"
    env["payload"] = base64.b64encode(json.dumps(stmt).encode()).decode()
    (ckpt / PASSPORT_NAME).write_text(json.dumps(doc))
    result = verify(str(ckpt), cert_chain=[ours["root"]])
    assert not result.ok and "the signature does not verify with its certificate CN=acme trainer" in result.summary


def test_a_key_signed_or_digest_only_passport_under_cert_chain_and_wrong_inputs(ckpt: Path, tmp_path: Path) -> None:
    ours, rival = _pki(tmp_path / "pki", "acme"), _pki(tmp_path / "pki", "rival")
    attest(str(ckpt))
    r = verify(str(ckpt), cert_chain=[ours["root"]])
    assert not r.ok and "digest-only passport (no signature)" in r.summary
    attest(str(ckpt), key=ours["key"])  # a bare key: no chain to check
    r = verify(str(ckpt), cert_chain=[ours["root"]])
    assert not r.ok and "carries no certificate chain" in r.summary
    with pytest.raises(PassportError, match="is not the one of the private key given"):
        attest(str(ckpt), key=ours["key"], certificate=rival["leaf"])
    with pytest.raises(PassportError, match="needs the private key"):
        attest(str(ckpt), certificate=ours["leaf"])
    with pytest.raises(PassportError, match="give one of --key"):
        verify(str(ckpt), key=ours["key"], cert_chain=[ours["root"]])
    code, _, err = _cli("verify", str(ckpt), "--cert-chain", str(tmp_path / "nope.pem"))
    assert code == 2 and "cannot load it as PEM certificate(s)" in err and "Traceback" not in err


def test_the_guard_signs_under_a_certificate(ckpt: Path, tmp_path: Path) -> None:
    from ckptaudit.integrations.guard import Guard

    ours = _pki(tmp_path / "pki", "acme")
    good = tmp_path / "run" / "checkpoint-2"
    shutil.copytree(ckpt, good)
    guard = Guard(background="thread", passport_key=ours["key"], passport_certificate=ours["leaf"],
                  passport_cert_chain=[ours["mid"]])
    guard.submit(str(good), step=2)
    assert guard.close(120)
    (v,) = guard.verdicts
    assert v.ok and v.passport is not None
    assert verify(str(good), cert_chain=[ours["root"]]).ok
    with pytest.raises(ValueError, match="passport_certificate"):
        Guard(passport_certificate=ours["leaf"])


def test_requiring_a_passport_under_a_ca_file_in_latest_the_store_loader_and_the_testing_assertion(
        ckpt: Path, tmp_path: Path) -> None:
    """``latest --require passport=CA.pem``, the store loader's ``require_passport=CA.pem`` and the testing
    assertion's ``key=CA.pem`` / ``cert_chain``: a CA file where a key goes means "signed under a certificate that
    chains to it"; a passport of another CA's leaf, or a digest-only one, is refused by each."""
    from ckptaudit.passport import passport_findings
    from ckptaudit.testing import PassportFailed, assert_passport_verifies

    ours, rival = _pki(tmp_path / "pki", "acme"), _pki(tmp_path / "pki", "rival")
    run = tmp_path / "run"
    good, bad = run / "step-2", run / "step-4"
    shutil.copytree(ckpt, good)
    shutil.copytree(ckpt, bad)
    attest(str(good), key=ours["key"], certificate=ours["leaf"], cert_chain=[ours["mid"]])
    attest(str(bad), key=rival["key"], certificate=rival["leaf"], cert_chain=[rival["mid"]])

    code, out, err = _cli("latest", str(run), "--require", f"passport={ours['root']}", "--format", "json",
                          "--no-progress", "--all")
    doc = json.loads(out)
    assert code == 0 and doc["latest"] == str(good), out + err
    [row] = [c for c in doc["candidates"] if c["name"] == "step-4"]
    assert row["resumable"] is False and any(f["code"] == "passport.signature" for f in row["findings"])

    # The store loader's require_passport=CA.pem runs this step on the checkpoint it resolved.
    assert passport_findings(str(good), "step-2", key=ours["root"]) == ()
    [refused] = passport_findings(str(bad), "step-4", key=ours["root"])
    assert refused.code == "passport.signature" and "CN=rival trainer" in refused.message

    assert assert_passport_verifies(good, key=ours["root"]).ok
    assert assert_passport_verifies(good, cert_chain=[ours["root"]]).ok
    with pytest.raises(PassportFailed):
        assert_passport_verifies(bad, cert_chain=[ours["root"]])
    attest(str(good))  # digest-only now
    with pytest.raises(PassportFailed):
        assert_passport_verifies(good, key=ours["root"])
