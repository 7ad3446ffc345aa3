"""Assertions for pytest and CI: fail with the findings as the message. See ``docs/api.md``.

    from ckptaudit.testing import assert_checkpoint_ok, assert_resumes_faithfully

    def test_my_exporter_writes_a_training_state(tmp_path):
        export(model, optimizer, tmp_path / "ckpt")
        assert_checkpoint_ok(tmp_path / "ckpt", require=["scheduler"])

    def test_my_exporter_resumes():                       # real processes, gloo on CPU
        assert_resumes_faithfully("mypkg.recipes:recipe", "mypkg.export:exporter", nproc=2)

Both raise a subclass of ``AssertionError`` (so pytest shows the message as the failure) that says which
failure it is and carries the :class:`ckptaudit.Report` (``exc.report``), and return the report when the check
passes::

    with pytest.raises(CheckpointDrift):                  # not ExporterFailed: it wrote, and it drifts
        assert_resumes_faithfully("mypkg.recipes:recipe", "mypkg.export:bad_exporter")

``CheckFailed`` (every failure) > ``AuditFailed`` (:func:`assert_checkpoint_ok`); ``ResumeFailed``
(:func:`assert_resumes_faithfully`) > ``CheckpointDrift``, ``IncompleteRestore``, ``ExporterFailed``,
``NoPower``, ``ReferenceNotReproducible``.

For a CI gate before a checkpoint is promoted, resumed from or served (``docs/passport.md``)::

    assert_passport_verifies("s3://bucket/run/step-900/", key="signer.pub")

raises :class:`PassportFailed` (an ``AssertionError``; ``exc.result`` is the
:class:`~ckptaudit.passport.VerifyResult`) unless its passport verifies.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal

from ckptaudit.api import Report, audit
from ckptaudit.findings import Severity

__all__ = ["AuditFailed", "CheckFailed", "CheckpointDrift", "ExporterFailed", "IncompleteRestore", "NoPower",
           "PassportFailed", "ReferenceNotReproducible", "ResumeFailed", "assert_checkpoint_ok",
           "assert_passport_verifies", "assert_resumes_faithfully"]

_RESUME_OPTIONS = ("nproc", "save_at", "steps", "margin", "min_rel", "loss_threshold", "timeout_s",
                   "export_timeout_s", "workdir")


class CheckFailed(AssertionError):
    """A ckptaudit assertion failed; ``report`` is the :class:`ckptaudit.Report` (every finding), the message its
    :meth:`~ckptaudit.Report.describe`."""

    def __init__(self, message: str, report: Report) -> None:
        super().__init__(message)
        self.report = report

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.report))


class AuditFailed(CheckFailed):
    """:func:`assert_checkpoint_ok`: the audit has findings at or above ``fail_on``."""


class ResumeFailed(CheckFailed):
    """:func:`assert_resumes_faithfully`: the resume test did not pass (the subclasses say why; this class
    itself when only other findings reach ``fail_on``, e.g. warnings with ``fail_on="warning"``)."""


class CheckpointDrift(ResumeFailed):
    """The exporter's checkpoint does not resume the uninterrupted run (verdict ``drift``: ``resume.drift``)."""


class IncompleteRestore(ResumeFailed):
    """The steps stay on the run, but a part of the state the steps use is not restored or differs (verdict
    ``incomplete``: ``resume.not-restored``, ``resume.restored-differs``)."""


class ExporterFailed(ResumeFailed):
    """The exporter, its loader or the recipe's steps on its checkpoint raised, crashed or hung (verdict
    ``failed``: ``resume.candidate-failed``)."""


class NoPower(ResumeFailed):
    """The positive control did not stand out from the reference's floor: the recipe is too noisy for the test
    to see a defect, so the exporter was not judged (``resume.no-power``)."""


class ReferenceNotReproducible(ResumeFailed):
    """The documented restore itself is not exact for this recipe, so the exporter was not judged
    (``resume.reference-not-reproducible``)."""


def assert_checkpoint_ok(path: str | os.PathLike[str], **options: Any) -> Report:
    """Audit ``path`` (options as :func:`ckptaudit.audit`: ``fail_on``, ``require``, ``master_dtype``, ...) and
    raise :class:`AuditFailed` (an ``AssertionError`` carrying the report) listing every finding at or above
    ``fail_on`` when there is one.

    A quick audit (``quick=True``) that passes is not a full verdict; that is said in the returned report's
    summary, and ``report.quick`` is true.
    """
    report = audit(path, **options)
    if not report.ok:
        raise AuditFailed(f"checkpoint audit failed (fail_on={report.fail_on.label}):\n{report.describe()}", report)
    return report


def assert_resumes_faithfully(recipe: str, exporter: str, **options: Any) -> Report:
    """Run the differential resume test (:func:`ckptaudit.resume.run_resume_test`) of ``exporter`` on
    ``recipe`` (both ``module:attr``), in real processes, and raise a :class:`ResumeFailed` carrying the report
    when a finding reaches ``fail_on``: :class:`CheckpointDrift` when the exporter's checkpoint does not resume
    the uninterrupted trajectory, :class:`IncompleteRestore` when it leaves out state the steps use,
    :class:`ExporterFailed` when it could not be written, restored or stepped, :class:`NoPower` or
    :class:`ReferenceNotReproducible` when the recipe does not let the test judge it.

    Options: ``nproc``, ``save_at``, ``steps``, ``margin``, ``min_rel``, ``loss_threshold``, ``timeout_s``,
    ``export_timeout_s``, ``workdir`` (see :class:`ckptaudit.resume.ResumeConfig`), and ``fail_on`` (default
    ``"error"``).
    """
    from ckptaudit.extras import require_torch

    require_torch("ckptaudit.testing.assert_resumes_faithfully")
    from ckptaudit.options import FAIL_ON, resolve
    from ckptaudit.resume import ResumeConfig, run_resume_test

    fail_on = options.pop("fail_on", "error")
    resolve("assert_resumes_faithfully", {"fail_on": fail_on}, {"fail_on": FAIL_ON})
    unknown = sorted(set(options) - set(_RESUME_OPTIONS))
    if unknown:
        raise TypeError(f"assert_resumes_faithfully: unknown option(s) {', '.join(map(repr, unknown))}; the "
                        f"options are: {', '.join(_RESUME_OPTIONS)}, fail_on")
    for name in ("recipe", "exporter"):
        value = recipe if name == "recipe" else exporter
        if not isinstance(value, str) or ":" not in value:
            raise ValueError(f"assert_resumes_faithfully: {name}={value!r} is not valid; pass 'module:attr' (or "
                             "'path.py:attr'), e.g. 'ckptaudit.exporters:compute_copy'")
    raw = run_resume_test(ResumeConfig(recipe=recipe, exporters=(exporter,), **options))
    report = Report(raw, Severity.parse(fail_on))
    if not report.ok:
        raise _resume_failure(report)(f"resume test of {exporter} on {recipe} failed (fail_on={fail_on}):\n"
                                      f"{report.describe()}", report)
    return report


def _resume_failure(report: Report) -> type[ResumeFailed]:
    """The exception for a failed resume test of one exporter: by its verdict, or why it was not judged."""
    codes = {f.code for f in report.failing}
    if "resume.reference-not-reproducible" in codes:
        return ReferenceNotReproducible
    verdict = (report.raw.extra.get("resume", {}).get("candidates") or [{}])[0].get("verdict")
    by_verdict: dict[str, type[ResumeFailed]] = {"failed": ExporterFailed, "drift": CheckpointDrift,
                                                 "incomplete": IncompleteRestore}
    if verdict in by_verdict:
        return by_verdict[verdict]
    if "resume.no-power" in codes:
        return NoPower
    return ResumeFailed


class PassportFailed(AssertionError):
    """:func:`assert_passport_verifies`: the checkpoint does not verify against its passport (or has none, or its
    recorded verdict was no pass); ``result`` is the :class:`~ckptaudit.passport.VerifyResult`, the message its
    summary and findings."""

    def __init__(self, message: str, result: Any) -> None:
        super().__init__(message)
        self.result = result

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.result))


def assert_passport_verifies(path: str | os.PathLike[str], passport: str | os.PathLike[str] | None = None, *,
                             key: str | os.PathLike[str] | None = None,
                             expect: Literal["training", "serving"] = "training",
                             cert_chain: Sequence[str | os.PathLike[str]] = ()) -> Any:
    """Verify the checkpoint at ``path`` (a local path or an ``s3://`` / ``gs://`` URL) against its passport
    (``passport``; default: the one it carries) and return the :class:`~ckptaudit.passport.VerifyResult`; raise
    :class:`PassportFailed` unless every byte is the attested one, the signature verifies with ``key`` (the
    signer's PEM public key; with it a digest-only passport fails; a PEM file of CA certificates there is taken as
    ``cert_chain``, a Sigstore policy file the keyless signer trusted), or the signing certificate chains to ``cert_chain`` (PEM files of the CA certificates trusted:
    ``attest --cert``), and the recorded verdict is a pass for ``expect`` (``training`` or ``serving``). A passport
    that cannot be read fails too (the message says why)."""
    from ckptaudit.passport import PassportError, verify
    from ckptaudit.passport.render import verify_text
    from ckptaudit.passport.verifying import trust_from_file

    try:
        public, chain, keyless = trust_from_file(None if key is None else os.fspath(key))
        chain = (*chain, *(os.fspath(c) for c in cert_chain))
        result = verify(os.fspath(path), None if passport is None else os.fspath(passport),
                        key=public, expect=expect, cert_chain=chain, sigstore=keyless)
    except PassportError as exc:
        raise PassportFailed(f"{os.fspath(path)}: its passport cannot be used: {exc}", None) from None
    if not result.ok:
        raise PassportFailed(verify_text(result).rstrip(), result)
    return result
