"""What ``ckptaudit attest`` and ``ckptaudit verify`` print: a few lines for a person, or JSON for a pipeline."""

from __future__ import annotations

import json
from typing import Any

from ckptaudit.findings import Severity
from ckptaudit.passport.model import Passport, VerifyResult
from ckptaudit.report.text import clean as safe_text

__all__ = ["attest_json", "attest_text", "dumps", "verify_json", "verify_text"]


def attest_json(p: Passport, path: str) -> dict[str, Any]:
    return {"command": "attest", "path": path, "passport": p.file, "passport_digest": p.digest, "signed": p.signed,
            "signer": p.signer, "artifact": p.artifact, "root_digest": p.root_digest, "algorithm": p.algorithm,
            "files": len(p.files), "tensors": len(p.tensors), "verdict": p.verdict, "summary": p.summary,
            "findings": dict(p.findings)}


def attest_text(p: Passport, path: str) -> str:
    how = f"signed by {p.signer}" if p.signed else "digest-only (NOT signed: give --key to sign it)"
    lines = [f"passport written: {safe_text(str(p.file))}",
             f"  checkpoint: {safe_text(path)} ({p.artifact}); verdict: {p.verdict}: {safe_text(p.summary)}",
             f"  {len(p.files)} file(s), {p.algorithm}, root digest {p.root_digest}; {len(p.tensors)} tensor digest(s)",
             f"  {how}; passport digest {p.digest}"]
    if p.verdict != "pass":
        lines.append("  the passport records this verdict: `ckptaudit verify` will refuse it (exit 1)")
    return "\n".join(lines) + "\n"


def verify_json(r: VerifyResult) -> dict[str, Any]:
    p = r.passport
    return {"command": "verify", "path": r.path, "ok": r.ok, "passport": r.passport_file,
            "passport_digest": None if p is None else p.digest, "signature": r.signature,
            "certificate": r.certificate,
            "artifact": None if p is None else p.artifact, "verdict": None if p is None else p.verdict,
            "root_digest": None if p is None else p.root_digest, "changed": list(r.changed),
            "missing": list(r.missing), "extra": list(r.extra), "changed_tensors": list(r.changed_tensors),
            "same_tensors": r.same_tensors, "summary": r.summary,
            "findings": [{"code": f.code, "severity": f.severity.name.lower(), "subject": f.subject, "message": f.message}
                         for f in r.findings]}


def verify_text(r: VerifyResult, verbose: bool = False) -> str:
    lines = [("VERIFIED  " if r.ok else "FAILED    ") + safe_text(r.summary)]
    for f in r.findings:
        if verbose or f.severity is not Severity.INFO or not r.ok:
            lines.append(f"  {f.severity.name.lower():<7} {f.code:<22} {safe_text(f.message)}")
    return "\n".join(lines) + "\n"


def dumps(value: dict[str, Any]) -> str:
    return json.dumps(value, indent=2, sort_keys=True) + "\n"
