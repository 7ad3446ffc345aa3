"""Assertions for pytest and CI: fail with the findings as the message. See ``docs/api.md``.

    from ckptaudit.testing import assert_checkpoint_ok, assert_resumes_faithfully

    def test_my_exporter_writes_a_training_state(tmp_path):
        export(model, optimizer, tmp_path / "ckpt")
        assert_checkpoint_ok(tmp_path / "ckpt", require=["scheduler"])

    def test_my_exporter_resumes():                       # real processes, gloo on CPU
        assert_resumes_faithfully("mypkg.recipes:recipe", "mypkg.export:exporter", nproc=2)

Both raise ``AssertionError`` (so pytest shows the message as the failure) and return the
:class:`ckptaudit.Report` when the check passes.
"""

from __future__ import annotations

import os
from typing import Any

from ckptaudit.api import Report, audit
from ckptaudit.model import Severity

__all__ = ["assert_checkpoint_ok", "assert_resumes_faithfully"]

_RESUME_OPTIONS = ("nproc", "save_at", "steps", "margin", "min_rel", "loss_threshold", "timeout_s", "workdir")


def assert_checkpoint_ok(path: str | os.PathLike[str], **options: Any) -> Report:
    """Audit ``path`` (options as :func:`ckptaudit.audit`: ``fail_on``, ``require``, ``master_dtype``, ...) and
    raise ``AssertionError`` listing every finding at or above ``fail_on`` when there is one.

    A quick audit (``quick=True``) that passes is not a full verdict; that is said in the returned report's
    summary, and ``report.quick`` is true.
    """
    report = audit(path, **options)
    if not report.ok:
        raise AssertionError(f"checkpoint audit failed (fail_on={report.fail_on.label}):\n{report.describe()}")
    return report


def assert_resumes_faithfully(recipe: str, exporter: str, **options: Any) -> Report:
    """Run the differential resume test (:func:`ckptaudit.resume.run_resume_test`) of ``exporter`` on
    ``recipe`` (both ``module:attr``), in real processes, and raise ``AssertionError`` with the findings when
    the exporter's checkpoint does not resume the uninterrupted trajectory (``resume.drift``), when the
    reference itself does not (the recipe is not deterministic), or when the candidate could not be written.

    Options: ``nproc``, ``save_at``, ``steps``, ``margin``, ``min_rel``, ``loss_threshold``, ``timeout_s``,
    ``workdir`` (see :class:`ckptaudit.resume.ResumeConfig`), and ``fail_on`` (default ``"error"``).
    """
    from ckptaudit.api import _resolve
    from ckptaudit.resume import ResumeConfig, run_resume_test

    fail_on = options.pop("fail_on", "error")
    _resolve("assert_resumes_faithfully", {"fail_on": fail_on}, {"fail_on": _fail_on_option()})
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
        raise AssertionError(f"resume test of {exporter} on {recipe} failed (fail_on={fail_on}):\n"
                             f"{report.describe()}")
    return report


def _fail_on_option() -> Any:
    from ckptaudit.api import AUDIT_OPTIONS

    return AUDIT_OPTIONS["fail_on"]
