"""``ckptaudit verify``: one streaming pass over a copy, held to its passport.

In order: the passport is read as untrusted input; with a key, both statements' signatures are verified before
anything in them is trusted (a digest-only passport is refused); the two statements must name the same root
digest, which must be the one their file digests give; then every file of the copy is read once and digested
(a local path, or an ``s3://`` / ``gs://`` URL through the remote layer's pinned ranged reads), and the recorded
verdict is held to what the checkpoint is used as. Only when files differ is a second pass made, over the tensors
(their layout-independent digests), to name the tensors that changed, or to say "same tensors, other files".
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptaudit.catalogue import finding
from ckptaudit.findings import Finding, Severity
from ckptaudit.ondisk.passport import PASSPORT_NAME, is_url, passport_path
from ckptaudit.passport.digests import (
    READ_BYTES,
    digest_files,
    file_hasher,
    list_files,
    root_digest,
    tensor_digests,
)
from ckptaudit.passport.document import Parsed, parse_passport, read_passport_bytes
from ckptaudit.passport.keyless import KeylessVerifier, SigstoreIdentity
from ckptaudit.passport.model import Artifact, FileDigest, PassportError, VerifyResult
from ckptaudit.passport.statements import load_public_key, verify_bundle

__all__ = ["passport_findings", "trust_from_file", "trust_of", "verify"]

_KEYLESS = "Sigstore identity "
"""How :class:`~ckptaudit.passport.keyless.KeylessVerifier` describes the signer it verified."""


def _result(path: str, file: str | None, parsed: Parsed | None, findings: list[Finding], **kw: Any) -> VerifyResult:
    ok = not any(f.severity is Severity.ERROR for f in findings)
    name = os.path.basename(os.path.normpath(path)) or path
    if ok:
        head = f"{name}: verified against its passport"
        if parsed is not None:
            p = parsed.passport
            cert = kw.get("certificate") or ""
            head += (f" ({len(p.files)} file(s), {p.artifact} checkpoint, verdict {p.verdict}, "
                     + ((f"signed keylessly by {cert.removeprefix(_KEYLESS)}" if cert.startswith(_KEYLESS) else
                         f"signed by {p.signer}" + (f" under its {cert}" if cert else ""))
                        if kw.get("signature") == "verified" else "digest-only, not signed"
                        if not p.signed else "signature not checked: no --key") + ")")
    else:
        errors = [f for f in findings if f.severity is Severity.ERROR]
        head = f"{name}: does NOT verify against its passport: " + "; ".join(f.message for f in errors[:3])
        if len(errors) > 3:
            head += f" (+{len(errors) - 3} more)"
    return VerifyResult(ok=ok, path=path, passport_file=file, passport=None if parsed is None else parsed.passport,
                        findings=tuple(findings), summary=head, **kw)


def _check_signature(parsed: Parsed, key: str | None, file: str) -> tuple[list[Finding], str]:
    """Signatures first: with a key, nothing in the passport is trusted before both statements verify."""
    p = parsed.passport
    if key is None:
        if parsed.signatures == 0:
            return [finding("passport.unsigned", PASSPORT_NAME,
                            f"{file}: a digest-only passport (not signed); the bytes can be checked against it, but "
                            "anyone could have written it: give the signer's public key (--key) to know who "
                            "attested")], "unsigned"
        return [], "not-checked"
    public = load_public_key(key)
    if parsed.signatures == 0:
        return [finding("passport.signature", PASSPORT_NAME,
                        f"{file}: a digest-only passport (no signature) where --key {key} was given; nothing in it "
                        "can be trusted: attest the checkpoint again with the signer's private key (--key)",
                        key=key)], "failed"
    try:
        ms_payload = verify_bundle(parsed.model_signing, public, f"{file}: model-signing statement")
        au_payload = verify_bundle(parsed.audit, public, f"{file}: audit statement")
    except PassportError as exc:
        return [finding("passport.signature", PASSPORT_NAME, str(exc), key=key)], "failed"
    del ms_payload, au_payload  # the very payloads parse_passport read: the envelopes are the ones verified
    del p
    return [], "verified"


def _check_certificates(parsed: Parsed, file: str,
                        trusted: Sequence[Any]) -> tuple[list[Finding], str, str | None]:
    """Both statements signed under a certificate that chains to ``trusted``, the same one, before anything else
    (then the certificate's description is returned too)."""
    from ckptaudit.passport.statements import verify_certificate_bundle

    given = "--cert-chain " + ", ".join(c.subject.rfc4514_string() for c in trusted)
    if parsed.signatures == 0:
        return [finding("passport.signature", PASSPORT_NAME,
                        f"{file}: a digest-only passport (no signature) where {given} was given; nothing in it can be "
                        "trusted: attest the checkpoint again with --key and --cert", key=given)], "failed", None
    try:
        _, ms_chain = verify_certificate_bundle(parsed.model_signing, trusted, f"{file}: model-signing statement")
        _, au_chain = verify_certificate_bundle(parsed.audit, trusted, f"{file}: audit statement")
    except PassportError as exc:
        return [finding("passport.signature", PASSPORT_NAME, str(exc), key=given)], "failed", None
    if ms_chain.fingerprint != au_chain.fingerprint:
        return [finding("passport.signature", PASSPORT_NAME,
                        f"{file}: its two statements were signed under different certificates ({ms_chain.describe()}; "
                        f"{au_chain.describe()}): pieced together from two passports", key=given)], "failed", None
    return [], "verified", au_chain.describe()


def _check_keyless(parsed: Parsed, file: str, verifier: KeylessVerifier) -> tuple[list[Finding], str, str | None]:
    """Both statements signed keylessly by the identity trusted, before anything else (Sigstore's verifier: the
    certificate chains to Fulcio, names the identity and issuer, was valid when Rekor logged the signature)."""
    who = verifier.who
    given = f"--sigstore-identity {who.identity} --sigstore-issuer {who.issuer}"
    if parsed.signatures == 0:
        return [finding("passport.signature", PASSPORT_NAME,
                        f"{file}: a digest-only passport (no signature) where {given} was given; nothing in it can be "
                        "trusted: attest the checkpoint again with --sigstore", key=given)], "failed", None
    try:
        _, described = verifier.payload(parsed.model_signing, f"{file}: model-signing statement")
        verifier.payload(parsed.audit, f"{file}: audit statement")
    except PassportError as exc:
        return [finding("passport.signature", PASSPORT_NAME, str(exc), key=given)], "failed", None
    return [], "verified", described


def _consistency(parsed: Parsed, file: str) -> list[Finding]:
    """The two statements must be about the same bytes."""
    p = parsed.passport
    problems = []
    if parsed.audit_statement["subject"][0]["digest"] != parsed.ms_statement["subject"][0]["digest"]:
        problems.append("its two statements name different root digests")
    if root_digest(p.files) != p.root_digest:
        problems.append("its root digest is not the one its file digests give")
    if parsed.audit_files != {(f.name, f.digest) for f in p.files} or \
            p.predicate["files"]["root_digest"] != p.root_digest:
        problems.append("the audit statement's files are not model-signing's")
    return [finding("passport.signature", PASSPORT_NAME, f"{file}: not one passport: {'; '.join(problems)} "
                    "(edited by hand, or pieced together from two)")] if problems else []


def _digest_remote(files: Sequence[tuple[str, str, int]], remote: Any, algorithm: str, jobs: int) -> list[FileDigest]:
    def one(item: tuple[str, str, int]) -> FileDigest:
        name, local, size = item
        if local not in remote:
            return digest_files([item], algorithm)[0]
        h = file_hasher(algorithm, max(1, jobs // max(1, len(files))))
        n = 0
        for data in remote.read_ahead(local, 0, size, READ_BYTES):
            h.update(data)
            n += len(data)
        return FileDigest(name, h.hexdigest(), n)

    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(files)))) as pool:
        return list(pool.map(one, files))


def verify(path: str, passport: str | None = None, *, key: str | None = None, expect: Artifact = "training",
           jobs: int | None = None, cert_chain: Sequence[str] = (),
           sigstore: SigstoreIdentity | None = None) -> VerifyResult:
    """Verify the checkpoint at ``path`` (a local path or an ``s3://`` / ``gs://`` URL) against its passport
    (``passport``: the passport file; default: the one the checkpoint carries, :func:`passport_path`).

    ``key``: the signer's PEM public key; with it an unsigned (digest-only) or hand-edited passport is refused.
    ``cert_chain``: PEM files of the certificates trusted (the CA's; model-signing's ``--certificate_chain``): the
    passport must be signed under a certificate that chains to one of them (``attest --cert``); not with ``key``.
    ``sigstore``: the identity and OIDC issuer trusted to have signed keylessly (``attest --sigstore``), checked by
    Sigstore's verifier (:mod:`~ckptaudit.passport.keyless`); not with ``key`` or ``cert_chain``.
    ``expect``: what the checkpoint is used as; the recorded verdict must be a pass for it. Raises
    :class:`~ckptaudit.passport.model.PassportError` when the passport itself cannot be read (malformed, too large,
    an unknown version: exit 2 on the command line), or the key does not load; ``FileNotFoundError`` when nothing
    is at ``path``."""
    from ckptaudit.auditing.scan import default_jobs

    if expect not in ("training", "serving"):
        raise PassportError(f"--expect must be training or serving, not {expect!r}")
    if sum((key is not None, bool(cert_chain), sigstore is not None)) > 1:
        raise PassportError("give one of --key (a passport signed with a bare key), --cert-chain (one signed under a "
                            "certificate) or --sigstore-identity/--sigstore-issuer (one signed keylessly)")
    # Sigstore's trusted root first (a refresh from its TUF repository unless offline): unreachable, one line.
    keyless = KeylessVerifier(sigstore) if sigstore is not None else None
    trusted = None
    if cert_chain:
        from ckptaudit.passport.certificates import load_certificates

        trusted = load_certificates(cert_chain, "--cert-chain")
    jobs = jobs or default_jobs()
    if not is_url(path) and not os.path.lexists(path):
        raise FileNotFoundError(2, "no such file or directory", path)
    remote: Any = None
    root = path
    if is_url(path):
        from ckptaudit.formats.remote.staging import stage

        try:
            root, remote = stage(path)
        except FileNotFoundError:
            raise
        except OSError as exc:  # the remote layer's errors: one line, naming the URL
            raise PassportError(str(exc)) from None
    try:
        files = list_files(root)
        is_dir = os.path.isdir(root)
        file = passport or passport_path(path, is_dir=is_dir)
        try:
            # Behind a URL the folder's passport was staged whole with it (a .json object): read it from there.
            raw = read_passport_bytes(os.path.join(root, PASSPORT_NAME) if passport is None and remote is not None
                                      and is_dir else file)
        except FileNotFoundError:
            return _result(path, None, None, [finding(
                "passport.missing", PASSPORT_NAME,
                f"{path}: no passport at {file}; `ckptaudit attest` writes one (a folder carries it inside, a file "
                "beside it), or give --passport FILE")])
        parsed = parse_passport(raw, file)
        if keyless is not None:
            findings, signature, certificate = _check_keyless(parsed, file, keyless)
        elif trusted is not None:
            findings, signature, certificate = _check_certificates(parsed, file, trusted)
        else:
            (findings, signature), certificate = _check_signature(parsed, key, file), None
        if signature == "failed":
            return _result(path, file, parsed, findings, signature=signature, certificate=certificate)
        findings += _consistency(parsed, file)
        if any(f.code == "passport.signature" for f in findings):
            return _result(path, file, parsed, findings, signature=signature, certificate=certificate)
        algorithm = parsed.passport.algorithm
        actual = (_digest_remote(files, remote, algorithm, jobs) if remote is not None
                  else digest_files(files, algorithm, jobs=jobs))
        return _compare(path, file, parsed, findings, signature, actual, expect, jobs, certificate)
    finally:
        if remote is not None:
            remote.close()


def _compare(path: str, file: str, parsed: Parsed, findings: list[Finding], signature: str,
             actual: list[FileDigest], expect: Artifact, jobs: int, certificate: str | None = None) -> VerifyResult:
    p = parsed.passport
    want = {f.name: f.digest for f in p.files}
    have = {f.name: f.digest for f in actual}
    changed = sorted(n for n in want.keys() & have.keys() if want[n] != have[n])
    missing = sorted(want.keys() - have.keys())
    extra = sorted(have.keys() - want.keys())
    changed_tensors: list[str] = []
    same_tensors: bool | None = None
    by_file: dict[str, list[str]] = {}
    if (changed or missing or extra) and p.tensors:
        same_tensors, changed_tensors, by_file = _tensors(path, parsed, jobs)
    for n in changed:
        hit = by_file.get(n, [])
        more = f" (+{len(hit) - 5} more)" if len(hit) > 5 else ""
        findings.append(finding("passport.changed", n, f"{n}: its bytes differ from the attested ones"
                                + (f"; tensors changed: {', '.join(hit[:5])}{more}" if hit else ""),
                                attested=want[n], found=have[n], tensors=hit))
    for n in missing:
        findings.append(finding("passport.file-missing", n, f"{n}: attested by the passport, missing from the copy"))
    for n in extra:
        findings.append(finding("passport.file-extra", n, f"{n}: in the copy, not attested by the passport"))
    if same_tensors:
        findings.append(finding("passport.same-tensors", os.path.basename(os.path.normpath(path)) or path,
                                f"same tensors, other files: all {len(p.tensors)} tensors' digests match the "
                                "passport, but the files are not the attested ones (a consolidated or re-sharded "
                                "copy); the tensors are the audited ones, these files were not audited"))
    elif changed_tensors and not changed:
        findings.append(finding("passport.changed", changed_tensors[0],
                                f"tensors changed: {', '.join(changed_tensors[:5])}", tensors=changed_tensors))
    if p.artifact != expect:
        findings.append(finding("passport.verdict", PASSPORT_NAME,
                                f"attested as a {p.artifact} {'checkpoint' if p.artifact == 'training' else 'export'}"
                                f", used as {expect}: attest it as {expect} (--expect {p.artifact} if that is what "
                                "it is used as)", artifact=p.artifact, expect=expect))
    elif p.verdict != "pass":
        findings.append(finding("passport.verdict", PASSPORT_NAME,
                                f"its audit recorded verdict {p.verdict!r}, not a pass ({p.summary})",
                                verdict=p.verdict, findings=dict(p.findings)))
    if p.lineage.state == "descends-from-damage" and p.lineage.damaged_ancestor is not None:
        findings.append(finding("passport.lineage", PASSPORT_NAME,
                                f"descends from a damaged training state at {p.lineage.damaged_ancestor.checkpoint}"
                                " (never restored since): restore a checkpoint from before it and fix the training "
                                "code", damaged_ancestor=p.lineage.damaged_ancestor.to_json()))
    return _result(path, file, parsed, findings, changed=tuple(changed), missing=tuple(missing), extra=tuple(extra),
                   changed_tensors=tuple(changed_tensors), same_tensors=same_tensors, signature=signature,
                   certificate=certificate)


def _tensors(path: str, parsed: Parsed, jobs: int) -> tuple[bool, list[str], dict[str, list[str]]]:
    """The second pass, only when files differ: the copy's tensors' digests against the passport's. Whether they
    are all the same, the changed ones, and the changed ones by the file holding them (the first, when sharded)."""
    from ckptaudit.auditing.plan import plan_scan

    p = parsed.passport
    algorithm = p.tensors[0].digest.split(":", 1)[0]
    try:
        plan = plan_scan(path)
    except (OSError, ValueError):
        return False, [], {}
    try:
        refs = [item[0] for item in plan.items]
        got, _ = tensor_digests(refs, plan.ckpt.maps, jobs=jobs, algorithm=algorithm)
        root = plan.ckpt.path
        files: dict[str, set[str]] = {}
        for r in refs:  # every file holding a piece of the tensor (a sharded one spans several)
            held = {getattr(pc, "file", "") for pc in getattr(r.data, "pieces", ())} or {r.file}
            files[r.name] = {(os.path.relpath(f, root) if os.path.isabs(f) else f).replace(os.sep, "/")
                             for f in held if f}
    finally:
        plan.close()
    # Matched by value, not by name: another layout names the same tensors otherwise (a DCP folder's
    # "model/w" is a consolidated file's "model.w").
    have = Counter((t.dtype, t.shape, t.digest) for t in got)
    same = have == Counter((t.dtype, t.shape, t.digest) for t in p.tensors)
    changed = [t.name for t in p.tensors if (t.dtype, t.shape, t.digest) not in have]
    single = [f.name for f in p.files] == ["."]
    by_file: dict[str, list[str]] = {}
    for n in changed:
        for f in ["."] if single else sorted(files.get(n, ())):
            by_file.setdefault(f, []).append(n)
    return same, changed, by_file


def trust_of(key: str | None) -> tuple[str | None, tuple[str, ...]]:
    """What a trust file given as ``KEY`` (``latest --require passport=KEY``, the store loader's
    ``require_passport=KEY``, the testing assertion's ``key``) is: a PEM public key -> ``(key, ())``; a PEM file of
    certificates (a CA or a bundle of them) -> ``(None, (key,))``, the chain the passport's certificate must chain
    to. A file that cannot be read is left as a key (:func:`verify` then names it). A Sigstore policy file:
    :func:`trust_from_file`."""
    public, chain, _ = trust_from_file(key)
    return public, chain


def trust_from_file(key: str | None) -> tuple[str | None, tuple[str, ...], SigstoreIdentity | None]:
    """:func:`trust_of`, and a third kind: a JSON file ``{"sigstore": {"identity": ID, "issuer": URL,
    "offline": false}}`` -> ``(None, (), SigstoreIdentity)``, the keyless signer trusted (``attest --sigstore``).
    :class:`PassportError` for a JSON file that is not such a policy."""
    if key is None:
        return None, (), None
    try:
        with open(key, "rb") as fh:
            head = fh.read(1 << 20)
    except OSError:
        return key, (), None
    if head.lstrip().startswith(b"{"):
        return None, (), _sigstore_policy(head, key)
    return (None, (key,), None) if b"-----BEGIN CERTIFICATE-----" in head else (key, (), None)


def _sigstore_policy(raw: bytes, file: str) -> SigstoreIdentity:
    from ckptaudit.formats.io.safejson import loads_limited

    try:
        doc = loads_limited(raw, file, unique_keys=True)
    except ValueError as exc:
        raise PassportError(f"{file}: not a Sigstore policy ({exc})") from None
    policy = doc.get("sigstore") if isinstance(doc, dict) else None
    if not isinstance(policy, dict) or not all(isinstance(policy.get(k), str) for k in ("identity", "issuer")) \
            or not isinstance(policy.get("offline", False), bool):
        raise PassportError(f'{file}: a JSON trust file is a Sigstore policy: {{"sigstore": {{"identity": ID, '
                            '"issuer": URL, "offline": false}}}} (the identity and OIDC issuer trusted to sign)')
    return SigstoreIdentity(policy["identity"], policy["issuer"], policy.get("offline", False))


def passport_findings(path: str, name: str, *, key: str | None = None,
                      expect: Artifact = "training") -> tuple[Finding, ...]:
    """``latest --require passport``'s and the store loader's step: the findings that keep the checkpoint at
    ``path`` (named ``name`` in messages) from being chosen: no passport, one that cannot be read or does not
    verify, or one whose verdict was no pass. Empty when its passport verifies (one read of every byte). ``key``:
    the signer's PEM public key, or a PEM file of the CA certificates its signing certificate must chain to
    (:func:`trust_of`), or a Sigstore policy file (:func:`trust_from_file`)."""
    try:
        public, chain, keyless = trust_from_file(key)
        result = verify(path, key=public, expect=expect, cert_chain=chain, sigstore=keyless)
    except PassportError as exc:
        return (finding("passport.malformed", name, f"{name}: its passport cannot be used: {exc}"),)
    except OSError as exc:
        return (finding("passport.missing", name, f"{name}: cannot be verified ({exc})"),)
    return tuple(f for f in result.findings if f.severity is Severity.ERROR)
