"""``ckptaudit attest``: audit a checkpoint and write its passport.

Three readers of the same bytes run at once: the files' digests (each file read once, in order), the audit's scan
(each tensor's xxh3 hash and precision) and the tensors' cryptographic digests (each tensor hashed where it lies
in the page cache, through the scan's own lease-guarded maps), so the files are read from storage once and the
cores stay busy. The audit's own scan keeps its xxh3 hash and its cost. ``bench/bench_passport.py`` measures what
that costs.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ckptaudit.findings import RawReport, Severity
from ckptaudit.ondisk.passport import PASSPORT_VERSION, is_url, passport_path, signature_path
from ckptaudit.passport.certificates import signer_chain
from ckptaudit.passport.digests import (
    FILE_ALGORITHMS,
    digest_files,
    ignore_paths,
    list_files,
    root_digest,
    tensor_algorithm,
    tensor_digests,
)
from ckptaudit.passport.document import dump_passport, parse_passport
from ckptaudit.passport.model import Artifact, Lineage, Passport, PassportError, ServingInfo, TensorDigest
from ckptaudit.passport.statements import (
    audit_statement,
    canonical,
    envelope,
    key_fingerprint,
    load_private_key,
    model_signing_bundle,
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


def _audit(path: str, options: AuditOptions) -> tuple[RawReport, list[TensorDigest], dict[str, str]]:
    """The audit (plan, scan, judge: :func:`~ckptaudit.auditing.scan.scan_checkpoint`'s steps) with the tensors'
    digests computed beside the scan, on threads of their own, from the same open files."""
    from ckptaudit.auditing.judge import judge_scan
    from ckptaudit.auditing.plan import plan_scan
    from ckptaudit.auditing.scan import assemble, scan_items

    plan = plan_scan(path)
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptaudit-tensor-digests") as bg:
            refs = [item[0] for item in plan.items]
            pending = bg.submit(tensor_digests, refs, plan.ckpt.maps, jobs=options.jobs)
            try:
                outcomes = scan_items(plan, plan.scannable(), jobs=options.jobs, chunk_bytes=options.chunk_bytes,
                                      quick=options.quick)
            finally:
                tensors, errors = pending.result()
    except BaseException:
        plan.close()
        raise
    scanned = assemble(plan, outcomes)
    try:
        return judge_scan(scanned, options), tensors, errors
    finally:
        scanned.close()


def _stat_all(files: list[tuple[str, str, int]]) -> list[tuple[str, int, int]]:
    out = []
    for name, full, _ in files:
        st = os.stat(full)
        out.append((name, st.st_size, st.st_mtime_ns))
    return out


def _predicate(name: str, report: RawReport, options: dict[str, Any], artifact: Artifact, files: list[Any],
               algorithm: str, root: str, tensors: list[TensorDigest], lineage: Lineage,
               serving: ServingInfo | None, signer: str | None) -> dict[str, Any]:
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
    }


def attest(path: str, *, key: str | None = None, key_password: str | None = None, output: str | None = None,
           lineage: Lineage | None = None, report: RawReport | None = None, artifact: Artifact = "training",
           serving: ServingInfo | None = None, options: AuditOptions | None = None, jobs: int | None = None,
           algorithm: str | None = None, certificate: str | None = None,
           cert_chain: Sequence[str] = (), durable: bool = True) -> Passport:
    """Audit the checkpoint at ``path`` (unless ``report`` is the audit of these bytes, from the same pass) and
    write its passport to ``output`` (default: :func:`~ckptaudit.ondisk.passport.passport_path`; a signed one also
    writes model-signing's bundle at :func:`~ckptaudit.ondisk.passport.signature_path`).

    ``key``: a PEM private key (EC P-256/384/521) to sign with (the ``[sign]`` extra: model-signing signs its
    statement); without one the passport is digest-only and says so. ``certificate``: the signing certificate
    (PEM) issued for ``key``, with ``cert_chain`` the files of its issuers: the bundles then carry the chain
    (model-signing's certificate mode) and a verifier checks it against the CA it trusts. ``durable=False``: no
    fsync of the passport (still written whole or not at all): the guard's, as durable as the checkpoint and the
    report beside it, which the library and the guard do not fsync either. ``lineage``: which checkpoint this one
    descends from (the guards fill it). ``artifact``: ``training`` (a resumable checkpoint) or ``serving`` (an
    inference export; ``serving`` then holds its gate results and the training checkpoint's passport digest).
    ``options``: the audit's :class:`~ckptaudit.auditing.judge.AuditOptions` (its ``expect`` is set from
    ``artifact``). ``algorithm``: the file digests' (``sha256``, model-signing's default, or ``blake3``; ``None``:
    ``blake3`` where it is installed, else ``sha256``). A
    ``report`` given carries no tensor digests: the passport then records none. Raises :class:`PassportError` (a key
    that does not load, the extra missing, a file that changed while attested) and ``FileNotFoundError``.
    """
    from dataclasses import replace

    from ckptaudit.auditing.judge import AuditOptions
    from ckptaudit.auditing.scan import default_jobs

    if is_url(path):
        raise PassportError(f"{path}: attest reads a local checkpoint (a passport is written beside the bytes it "
                            "audits); attest before copying, and `ckptaudit verify` the copy")
    algorithm = algorithm or tensor_algorithm()
    if algorithm not in FILE_ALGORITHMS:
        raise PassportError(f"--digest {algorithm!r}: model-signing verifies {', '.join(FILE_ALGORITHMS)}")
    if artifact not in ("training", "serving"):
        raise PassportError(f"artifact must be training or serving, not {artifact!r}")
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
    files = list_files(path)
    before = _stat_all(files)
    tensors: list[TensorDigest] = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptaudit-attest") as bg:
        # The files' digests run beside the audit's scan: both read the same bytes, from storage once.
        pending = bg.submit(digest_files, files, algorithm, jobs=jobs)
        try:
            if report is None:
                report, tensors, _ = _audit(path, options)
        finally:
            digests = pending.result()
    if _stat_all(list_files(path)) != before:
        raise PassportError(f"{path}: its files changed while it was attested (a save still writing?); attest it "
                            "once the save has finished")
    name = os.path.basename(os.path.normpath(path))
    root = root_digest(digests)
    ms_stmt = model_signing_statement(name, digests, algorithm, ignore_paths(is_dir), root)
    opts = {"master_dtype": options.master_dtype, "expect": options.expect,
            "require": sorted(k.value for k in options.require), "ignore": list(options.ignore),
            "quick": options.quick}
    signer = key_fingerprint(private) if private is not None else None
    au_stmt = audit_statement(name, root, _predicate(name, report, opts, artifact, digests, algorithm, root, tensors,
                                                     lineage or Lineage(), serving, signer))
    out = output or passport_path(path, is_dir=is_dir)
    if private is not None:
        assert key is not None
        ms_text = model_signing_bundle(ms_stmt, key, key_password, certificate, cert_chain)
        import json

        ms_part: dict[str, Any] = json.loads(ms_text)
        au_part = sign_statement(au_stmt, private, chain)
        sig = signature_path(path, is_dir=is_dir) if output is None else out.removesuffix(".json") + ".sig"
        _write(sig, ms_text.encode(), durable)
    else:
        ms_part = {"dsseEnvelope": envelope(canonical(ms_stmt))}
        au_part = {"dsseEnvelope": envelope(canonical(au_stmt))}
        stale = signature_path(path, is_dir=is_dir) if output is None else out.removesuffix(".json") + ".sig"
        if os.path.isfile(stale) and not os.path.islink(stale):
            os.remove(stale)  # an earlier signed passport's bundle: it signs another statement than this one
    raw = dump_passport(private is not None, ms_part, au_part)
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
