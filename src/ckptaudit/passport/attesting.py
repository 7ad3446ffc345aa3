"""``ckptaudit attest``: audit a checkpoint and write its passport.

The digests come from the audit's own pass (:func:`~ckptaudit.passport.digests.audit_digests`): the scan hashes
each chunk of a tensor with its xxh3, its precision test and the tensor's cryptographic digest while the chunk is in
cache, and the files' digests (each file read once, in order: SHA-256 is sequential) run beside it on cores of their
own, so every byte is read from storage once and the tensor bytes from memory once. ``bench/bench_passport.py``
measures what that costs.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ckptaudit.findings import RawReport, Severity
from ckptaudit.ondisk.passport import PASSPORT_VERSION, is_url, passport_path, signature_path
from ckptaudit.passport.certificates import signer_chain
from ckptaudit.passport.digests import (
    FILE_ALGORITHMS,
    AuditDigests,
    audit_digests,
    ignore_paths,
    list_files,
    root_digest,
    stat_files,
    tensor_algorithm,
    tensor_digests,
)
from ckptaudit.passport.document import dump_passport, parse_passport
from ckptaudit.passport.keyless import SigstoreSigning, keyless_signer
from ckptaudit.passport.model import Artifact, Lineage, Passport, PassportError, ServingInfo, TensorDigest
from ckptaudit.passport.statements import (
    audit_statement,
    canonical,
    envelope,
    key_fingerprint,
    load_private_key,
    model_signing_bundle,
    model_signing_payload,
    model_signing_statement,
    sign_statement,
)
from ckptaudit.version import __version__

if TYPE_CHECKING:
    from ckptaudit.auditing.judge import AuditOptions

__all__ = ["attest", "verdict_of"]


def verdict_of(report: RawReport) -> str:
    """``pass`` (no error counted), ``fail``, or ``not-judged`` (a quick audit, or nothing a checkpoint)."""
    if report.extra.get("mode") == "quick":
        return "not-judged"
    if any(f.severity is Severity.ERROR and not f.ignored for f in report.findings):
        return "fail"
    if not report.tensors:
        return "not-judged"
    return "pass"


def _tensors_of_quick(path: str, jobs: int) -> list[TensorDigest]:
    """A quick audit reads each tensor's first chunk only: the tensors' digests then take a pass of their own."""
    from ckptaudit.auditing.plan import plan_scan

    plan = plan_scan(path)
    try:
        return tensor_digests([item[0] for item in plan.items], plan.ckpt.maps, jobs=jobs)[0]
    finally:
        plan.close()


def _predicate(name: str, report: RawReport, options: dict[str, Any], artifact: Artifact, files: list[Any],
               algorithm: str, root: str, tensors: list[TensorDigest], lineage: Lineage,
               serving: ServingInfo | None, signer: str | None, signer_kind: str | None,
               signer_issuer: str | None) -> dict[str, Any]:
    c = report.contract
    algo = tensors[0].digest.split(":", 1)[0] if tensors else None
    return {
        "passport_version": PASSPORT_VERSION,
        "tool": {"name": "ckptaudit", "version": __version__},
        "checkpoint": name,
        "artifact": artifact,
        "options": options,
        "contract": None if c is None else {"master_dtype": c.master_dtype, "source": c.source, "detail": c.detail,
                                            "where": c.where},
        "verdict": verdict_of(report),
        "summary": report.summary,
        "format": report.format,
        "findings": dict(sorted(Counter(f.code for f in report.findings if not f.ignored).items())),
        "files": {"algorithm": algorithm, "root_digest": root,
                  "items": [{"name": f.name, "digest": f.digest, "size": f.size} for f in files]},
        "tensors": {"algorithm": algo, "items": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                                                  "digest": t.digest} for t in tensors]},
        "serving": None if serving is None else {"gate": dict(serving.gate), "source": serving.source,
                                                  "source_passport_digest": serving.source_passport_digest},
        "lineage": lineage.to_json(),
        "signer": signer,
        "signer_kind": signer_kind,
        "signer_issuer": signer_issuer,
    }


def attest(path: str, *, key: str | None = None, key_password: str | None = None, output: str | None = None,
           lineage: Lineage | None = None, report: RawReport | None = None, artifact: Artifact = "training",
           serving: ServingInfo | None = None, options: AuditOptions | None = None, jobs: int | None = None,
           algorithm: str | None = None, digests: AuditDigests | None = None, certificate: str | None = None,
           cert_chain: Sequence[str] = (), durable: bool = True, sigstore: SigstoreSigning | None = None) -> Passport:
    """Audit the checkpoint at ``path`` (unless ``report`` is the audit of these bytes, from the same pass) and
    write its passport to ``output`` (default: :func:`~ckptaudit.ondisk.passport.passport_path`; a signed one also
    writes model-signing's bundle at :func:`~ckptaudit.ondisk.passport.signature_path`).

    ``key``: a PEM private key (EC P-256/384/521) to sign with (the ``[sign]`` extra: model-signing signs its
    statement); without one the passport is digest-only and says so. ``certificate``: the signing certificate
    (PEM) issued for ``key``, with ``cert_chain`` the files of its issuers: the bundles then carry the chain
    (model-signing's certificate mode) and a verifier checks it against the CA it trusts. ``durable=False``: no
    fsync of the passport (still written whole or not at all): the guard's, as durable as the checkpoint and the
    report beside it, which the library and the guard do not fsync either. ``lineage``: which checkpoint this one
    descends from (the guards fill it). ``sigstore``: sign keylessly through Sigstore instead of with a key
    (:mod:`ckptaudit.passport.keyless`: an identity token given or ambient, the certificate from Fulcio, the
    signatures logged in Rekor); its extra, token and service are checked before the audit. ``artifact``: ``training`` (a resumable checkpoint) or ``serving`` (an
    inference export; ``serving`` then holds its gate results and the training checkpoint's passport digest).
    ``options``: the audit's :class:`~ckptaudit.auditing.judge.AuditOptions` (its ``expect`` is set from
    ``artifact``). ``algorithm``: the file digests' (``sha256``, model-signing's default, or ``blake3``; ``None``:
    ``blake3`` where it is installed, else ``sha256``). ``digests``: with ``report``, the
    :func:`~ckptaudit.passport.digests.audit_digests` that audit filled (its ``scan`` given to ``run_audit``): the
    passport's digests from that pass, nothing read again (the algorithm is theirs). A ``report`` without them
    costs a read of every file for their digests and records no tensor digests. Raises :class:`PassportError` (a
    key that does not load, the extra missing, a file that changed while attested) and ``FileNotFoundError``.
    """
    from dataclasses import replace

    from ckptaudit.auditing.judge import AuditOptions, run_audit
    from ckptaudit.auditing.scan import default_jobs

    if is_url(path):
        raise PassportError(f"{path}: attest reads a local checkpoint (a passport is written beside the bytes it "
                            "audits); attest before copying, and `ckptaudit verify` the copy")
    if digests is not None:
        if report is None:
            raise PassportError("attest(digests=...) takes the report of the audit that filled them (report=...)")
        if os.path.normpath(digests.path) != os.path.normpath(path):
            raise PassportError(f"{path}: the digests given are of {digests.path}")
        algorithm = digests.algorithm
    algorithm = algorithm or tensor_algorithm()
    if algorithm not in FILE_ALGORITHMS:
        raise PassportError(f"--digest {algorithm!r}: model-signing verifies {', '.join(FILE_ALGORITHMS)}")
    if artifact not in ("training", "serving"):
        raise PassportError(f"artifact must be training or serving, not {artifact!r}")
    if sigstore is not None and (key is not None or certificate is not None or cert_chain):
        raise PassportError("sign with a key (--key, --cert) or keylessly through Sigstore (--sigstore), not both")
    keyless = keyless_signer(sigstore) if sigstore is not None else None
    private = load_private_key(key, key_password.encode() if key_password else None) if key else None
    chain = None
    if certificate is not None or cert_chain:
        if private is None or certificate is None:
            raise PassportError("signing with a certificate needs the private key (--key) and its certificate (--cert); "
                                "--cert-chain adds the certificates that link it to the CA")
        chain = signer_chain(private, certificate, cert_chain)
    if not os.path.lexists(path):
        raise FileNotFoundError(2, "no such file or directory", path)
    is_dir = os.path.isdir(path)
    jobs = jobs or (options.jobs if options is not None else default_jobs())
    options = replace(options or AuditOptions(), expect=artifact, jobs=jobs)
    tensors: list[TensorDigest] = []
    if digests is None:
        digests = audit_digests(path, algorithm, jobs=jobs)
        if report is None:
            report = run_audit(path, options, digests=digests.scan)
            tensors = (_tensors_of_quick(path, jobs) if options.quick else digests.tensor_digests())
        else:  # an audit made without asking for the digests: the files are read again, for theirs alone
            digests.scan.start()
            digests.scan.finish()
    else:
        assert report is not None  # checked above: digests come with the report of their audit
        tensors = digests.tensor_digests()
    files = digests.file_digests()
    if tuple(stat_files(list_files(path))) != digests.before:
        raise PassportError(f"{path}: its files changed while it was attested (a save still writing?); attest it "
                            "once the save has finished")
    name = os.path.basename(os.path.normpath(path))
    root = root_digest(files)
    ms_stmt = model_signing_statement(name, files, algorithm, ignore_paths(is_dir), root)
    opts = {"master_dtype": options.master_dtype, "expect": options.expect,
            "require": sorted(k.value for k in options.require), "ignore": list(options.ignore),
            "quick": options.quick}
    signer, kind, issuer = ((keyless.identity, "sigstore", keyless.issuer) if keyless is not None else
                            (key_fingerprint(private), "key" if chain is None else "certificate", None)
                            if private is not None else (None, None, None))
    au_stmt = audit_statement(name, root, _predicate(name, report, opts, artifact, files, algorithm, root, tensors,
                                                     lineage or Lineage(), serving, signer, kind, issuer))
    out = output or passport_path(path, is_dir=is_dir)
    sig = signature_path(path, is_dir=is_dir) if output is None else out.removesuffix(".json") + ".sig"
    ms_part: dict[str, Any]
    if keyless is not None:
        ms_text = keyless.sign_model_signing(model_signing_payload(ms_stmt))
        ms_part = json.loads(ms_text)
        au_part = keyless.sign_statement(canonical(au_stmt))
        _write(sig, ms_text.encode(), durable)
    elif private is not None:
        assert key is not None
        ms_text = model_signing_bundle(ms_stmt, key, key_password, certificate, cert_chain)
        ms_part = json.loads(ms_text)
        au_part = sign_statement(au_stmt, private, chain)
        _write(sig, ms_text.encode(), durable)
    else:
        ms_part = {"dsseEnvelope": envelope(canonical(ms_stmt))}
        au_part = {"dsseEnvelope": envelope(canonical(au_stmt))}
        if os.path.isfile(sig) and not os.path.islink(sig):
            os.remove(sig)  # an earlier signed passport's bundle: it signs another statement than this one
    raw = dump_passport(private is not None or keyless is not None, ms_part, au_part)
    _write(out, raw, durable)
    return parse_passport(raw, out).passport


def _write(path: str, data: bytes, durable: bool = True) -> None:
    """Write ``path`` whole or not at all (a reader never sees half a passport); ``durable``: fsync it first."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(data)
        if durable:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(tmp, path)
