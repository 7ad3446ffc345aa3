"""The public Python API: :func:`audit`, :func:`compare` and the :class:`Report` they return.

Re-exported at the package top (``ckptaudit.audit``, ``ckptaudit.compare``, ``ckptaudit.Report``)::

    import ckptaudit

    report = ckptaudit.audit("out/checkpoint-500", quick=True)
    if not report.ok:
        print(report.describe())          # the summary and every finding at or above fail_on
    open("audit.json", "w").write(report.to_json())

Everything runs in the calling process and thread (no torch import: the readers are NumPy's); the integrations
(:mod:`ckptaudit.integrations`) and the test helpers (:mod:`ckptaudit.testing`) call these functions and nothing
else of the engine. Options are keywords, checked before any file is opened: an unknown name or a bad value
raises ``TypeError`` / ``ValueError`` naming the option, the value and the fix.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptaudit.findings import ComponentKind, Finding, RawReport, Severity
from ckptaudit.options import AUDIT_OPTIONS, COMPARE_OPTIONS, resolve, signature

if TYPE_CHECKING:
    from ckptaudit.auditing.judge import AuditOptions
    from ckptaudit.comparing import CompareOptions

__all__ = ["Report", "audit", "audit_options", "checked_path", "compare", "compare_options", "reachable"]


@dataclass(frozen=True, slots=True)
class Report:
    """What :func:`audit` and :func:`compare` return: the engine's report and the level it is judged at."""

    raw: RawReport
    """The full report (tensors, components, contract, command-specific sections), as every renderer takes it."""
    fail_on: Severity = Severity.ERROR
    """Findings at or above this severity make the report fail (``ok`` is false)."""

    @property
    def ok(self) -> bool:
        """No finding at or above ``fail_on``. For a quick audit, ``ok`` means no defect *seen*
        (see :attr:`quick`)."""
        return not self.raw.fails(self.fail_on)

    @property
    def quick(self) -> bool:
        """Whether this is a quick audit (first chunk of each tensor, no hashes): not a full verdict."""
        return self.raw.extra.get("mode") == "quick"

    @property
    def findings(self) -> tuple[Finding, ...]:
        """Every finding, the worst first."""
        return self.raw.findings

    @property
    def failing(self) -> tuple[Finding, ...]:
        """The findings at or above ``fail_on`` and not ignored: why ``ok`` is false."""
        return tuple(f for f in self.raw.findings if f.severity >= self.fail_on and not f.ignored)

    @property
    def summary(self) -> str:
        return self.raw.summary

    @property
    def path(self) -> str:
        return self.raw.path

    def __repr__(self) -> str:
        """One line: the verdict at ``fail_on``, the counts, the path (the whole report is :attr:`raw`)."""
        counts = {s: 0 for s in Severity}
        ignored = 0
        for f in self.raw.findings:
            if f.ignored:
                ignored += 1
            else:
                counts[f.severity] += 1
        return (f"Report(command={self.raw.command!r}, ok={self.ok}{', quick=True' if self.quick else ''}, "
                f"fail_on={self.fail_on.label!r}, errors={counts[Severity.ERROR]}, "
                f"warnings={counts[Severity.WARNING]}, infos={counts[Severity.INFO]}, ignored={ignored}, "
                f"tensors={len(self.raw.tensors)}, path={self.raw.path!r})")

    def describe(self, limit: int = 20) -> str:
        """The summary, then one line per failing finding (``code subject: message``), at most ``limit``."""
        lines = [f"{self.raw.path}: {self.raw.summary}"]
        failing = self.failing
        lines += [f"  {f.severity.label} {f.code} {f.subject}: {f.message}" for f in failing[:limit]]
        if len(failing) > limit:
            lines.append(f"  ... and {len(failing) - limit} more")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The JSON report as a dict (schema: ``ckptaudit/schema/report.schema.json``)."""
        from ckptaudit.report.json import to_dict

        return to_dict(self.raw)

    def to_json(self, indent: int | None = 2) -> str:
        """The JSON report (the same document as ``ckptaudit audit --format json``)."""
        import json  # not at start-up: the command line writes its JSON through ckptaudit.report

        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)


def reachable(path: str) -> bool:
    """Whether ``path`` may name a checkpoint: a local path (or ``file://`` URL) that exists, or a remote URL
    (whose existence its reader checks when it opens it)."""
    from ckptaudit.formats.remote import is_url, local_path

    return is_url(path) or os.path.exists(local_path(path))


def checked_path(func: str, name: str, value: Any) -> str:
    """``value`` as the path the engine reads: a local path, a ``file://`` URL or a remote URL (``s3://``,
    ``gs://``, ``https://``: checked when it is opened), exactly what the command line takes. Raises ``TypeError``
    for what is not a text path and ``FileNotFoundError`` for a local path that does not exist; the API, the
    command line and the guards share it, so they accept the same paths."""
    if not isinstance(value, str | os.PathLike):
        raise TypeError(f"{func}: {name} must be a path or URL (str or os.PathLike), not {type(value).__name__}")
    path = os.fspath(value)
    if not isinstance(path, str):
        raise TypeError(f"{func}: {name} must be a text path, not bytes ({path!r})")
    if not reachable(path):
        raise FileNotFoundError(f"{func}: {name} {path!r} does not exist; give the path of a checkpoint file or "
                                "directory, or its URL (s3://, gs://, https://)")
    return path


def audit(path: str | os.PathLike[str], **options: Any) -> Report:
    """Audit the checkpoint at ``path`` (a file or directory in any layout ``ckptaudit audit`` reads; a local path,
    a ``file://`` URL or a remote one, ``s3://``, ``gs://``, ``https://``, as on the command line).

    Options (keywords; names, types and defaults in :data:`ckptaudit.options.AUDIT_OPTIONS`, which the command
    line's flags are derived from too):

    - ``master_dtype``: ``"auto"`` (read the contract from the checkpoint), ``"float32"``, ``"bfloat16"``,
      ``"float16"``;
    - ``expect``: ``"training"`` (a resumable checkpoint) or ``"serving"`` (an inference artifact);
    - ``require``: components whose absence is an error besides model and optimizer
      (``["scheduler", "rng", "data-progress"]`` or ``"scheduler,rng"``);
    - ``master_dtype_from``: who declared ``master_dtype`` when it was not you, in words (the guards pass the
      running job's evidence); the report's contract then says ``live``;
    - ``master_dtypes``: each parameter's master dtype, one per parameter the optimizer steps, in the order of its
      param groups (the guards pass the live optimizer's when its parameters have several dtypes, with
      ``master_dtype_from``): each parameter is held to its own;
    - ``fail_on``: ``"error"`` (default), ``"warning"`` or ``"info"``: the level at which ``Report.ok`` is false;
    - ``ignore``: finding codes or families to acknowledge (``["security.not-loaded", "optimizer"]`` or
      ``"security.not-loaded,optimizer"``): kept in the report, marked ``ignored``, counted toward nothing;
    - ``quick``: the in-loop mode (first chunk of each tensor, no content hashes; see
      :attr:`ckptaudit.auditing.judge.AuditOptions.quick` for what it cannot see);
    - ``run_evidence``: ``True`` (default): where the checkpoint alone looks like 16-bit masters (bf16 parameters
      beside bf16 moments, nothing recording the masters), hold it to the float32 masters its run's other
      checkpoints beside it hold (``contract.run-mismatch``); ``False`` judges it alone;
    - ``jobs``: threads scanning tensors at once; ``None`` (default) is every core this process may use, as on
      the command line (the report is the same whatever the number);
    - ``chunk_bytes``: bytes read per chunk.

    Everything runs in the calling process, on ``jobs`` threads. Raises ``FileNotFoundError`` when a local
    ``path`` does not exist (``OSError`` naming the URL for a remote object that does not), ``TypeError`` / ``ValueError`` for a bad option. A checkpoint that cannot be read is a finding in
    the report, not an exception.
    """
    from ckptaudit.auditing.judge import run_audit

    opts = resolve("ckptaudit.audit", options, AUDIT_OPTIONS)
    where = checked_path("ckptaudit.audit", "path", path)
    return Report(run_audit(where, audit_options(opts)), Severity.parse(opts["fail_on"]))


def audit_options(opts: Mapping[str, Any]) -> AuditOptions:
    """The engine's :class:`~ckptaudit.auditing.judge.AuditOptions` for resolved options (:func:`ckptaudit.options.
    resolve` of :data:`~ckptaudit.options.AUDIT_OPTIONS`): the one translation the API, the guards, ``ckptaudit
    .testing`` and the command line share."""
    from ckptaudit.auditing.judge import AuditOptions
    from ckptaudit.auditing.scan import default_jobs

    require = opts["require"]
    if isinstance(require, str):
        require = [s for s in require.split(",") if s.strip()]
    return AuditOptions(master_dtype=opts["master_dtype"], expect=opts["expect"],
                        require=frozenset(ComponentKind(str(s).strip()) for s in require),
                        chunk_bytes=opts["chunk_bytes"], quick=opts["quick"],
                        jobs=opts["jobs"] or default_jobs(), master_dtype_from=opts["master_dtype_from"],
                        master_dtypes=tuple(opts["master_dtypes"]),
                        ignore=_ignored(opts["ignore"]), run_evidence=opts["run_evidence"])


def compare(reference: str | os.PathLike[str], candidate: str | os.PathLike[str], **options: Any) -> Report:
    """Compare ``candidate`` with ``reference`` tensor by tensor (is it the reference's training state?).

    Options (keywords; :data:`ckptaudit.options.COMPARE_OPTIONS`): ``fail_on`` and ``ignore`` (as for
    :func:`audit`), ``jobs`` (tensor pairs compared at once; ``None``, the default, is every core this process
    may use, at most 64; ``threads`` is its older name), ``chunk_bytes``, ``max_moment_checks`` (value
    comparisons per state name and shape when looking for the source of a mismatched optimizer moment).

    Raises ``FileNotFoundError`` when either path does not exist, ``TypeError`` / ``ValueError`` for a bad
    option.
    """
    from ckptaudit.comparing import run_compare

    opts = resolve("ckptaudit.compare", options, COMPARE_OPTIONS)
    settings = compare_options(opts)
    ref = checked_path("ckptaudit.compare", "reference", reference)
    cand = checked_path("ckptaudit.compare", "candidate", candidate)
    return Report(run_compare(ref, cand, settings), Severity.parse(opts["fail_on"]))


def compare_options(opts: Mapping[str, Any], *, verbose: bool = False) -> CompareOptions:
    """The engine's :class:`~ckptaudit.comparing.CompareOptions` for resolved options (:data:`~ckptaudit.options.
    COMPARE_OPTIONS`): the one translation the API and the command line share (``verbose``: the table lists
    identical pairs too, the command line's ``--verbose``; the JSON report is the same either way)."""
    from ckptaudit.auditing.scan import default_jobs
    from ckptaudit.comparing import CompareOptions

    if opts["jobs"] is not None and opts["threads"] is not None and opts["jobs"] != opts["threads"]:
        raise ValueError(f"ckptaudit.compare: jobs={opts['jobs']} and threads={opts['threads']} disagree; threads "
                         "is the older name of jobs: pass jobs alone")
    threads = opts["jobs"] or opts["threads"] or min(64, default_jobs())
    return CompareOptions(chunk_bytes=opts["chunk_bytes"], threads=threads, verbose=verbose,
                          max_moment_checks=opts["max_moment_checks"], ignore=_ignored(opts["ignore"]))


audit.__signature__ = signature((("path", "str | os.PathLike[str]"),), AUDIT_OPTIONS, Report)  # type: ignore[attr-defined]
compare.__signature__ = signature((("reference", "str | os.PathLike[str]"), ("candidate", "str | os.PathLike[str]")),  # type: ignore[attr-defined]
                                  COMPARE_OPTIONS, Report)


def _ignored(value: Any) -> tuple[str, ...]:
    from ckptaudit.catalogue import parse_ignore

    return parse_ignore(value)
