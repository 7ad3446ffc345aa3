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

import difflib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptaudit.model import ComponentKind, Finding, Severity
from ckptaudit.model import Report as RawReport

__all__ = ["AUDIT_OPTIONS", "COMPARE_OPTIONS", "Report", "audit", "compare"]


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
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)


# ------------------------------------------------------------------------------------------------------------
# Options: one table per function; each entry checks a value and says what it should be.


@dataclass(frozen=True, slots=True)
class _Option:
    default: Any
    check: Callable[[Any], bool]
    expected: str
    """What a valid value is, for the error message."""


def _choice(*values: str) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, str) and v in values


def _components(v: Any) -> bool:
    if isinstance(v, str):
        v = [s for s in v.split(",") if s.strip()]
    try:
        return all(isinstance(s, str | ComponentKind) and ComponentKind(str(s).strip()) for s in v)
    except (TypeError, ValueError):
        return False


def _ignore(v: Any) -> bool:
    from ckptaudit.catalogue import parse_ignore

    if not isinstance(v, str) and not isinstance(v, list | tuple | set | frozenset):
        return False
    try:
        parse_ignore(v)
    except ValueError:
        return False
    return True


def _int_at_least(low: int, high: int | None = None) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low and (high is None or v <= high)


_FAIL_ON = _Option("error", _choice("error", "warning", "info"), "one of 'error', 'warning', 'info'")
_IGNORE = _Option((), _ignore, "finding codes or families from docs/catalogue.md (an iterable or a comma-separated "
                  "string, e.g. 'security.not-loaded,optimizer.index-keyed')")
AUDIT_OPTIONS: Mapping[str, _Option] = {
    "master_dtype": _Option("auto", _choice("auto", "float32", "bfloat16", "float16"),
                            "one of 'auto', 'float32', 'bfloat16', 'float16'"),
    "expect": _Option("training", _choice("training", "serving"), "'training' or 'serving'"),
    "require": _Option((), _components,
                       "component names: an iterable or a comma-separated string of "
                       + ", ".join(repr(k.value) for k in ComponentKind)),
    "master_dtype_from": _Option("", lambda v: isinstance(v, str), "a string: who declared master_dtype"),
    "fail_on": _FAIL_ON,
    "ignore": _IGNORE,
    "quick": _Option(False, lambda v: isinstance(v, bool), "True or False"),
    "chunk_bytes": _Option(1 << 20, _int_at_least(64), "an int >= 64 (bytes read per chunk)"),
}
"""``ckptaudit.audit``'s keyword options and their defaults (see :func:`audit`)."""

COMPARE_OPTIONS: Mapping[str, _Option] = {
    "fail_on": _FAIL_ON,
    "ignore": _IGNORE,
    "threads": _Option(2, _int_at_least(1, 64), "an int from 1 to 64"),
    "chunk_bytes": _Option(1 << 20, _int_at_least(64), "an int >= 64 (bytes read per chunk and side)"),
    "max_moment_checks": _Option(256, _int_at_least(0), "an int >= 0"),
}
"""``ckptaudit.compare``'s keyword options and their defaults (see :func:`compare`)."""


def _resolve(func: str, given: Mapping[str, Any], table: Mapping[str, _Option]) -> dict[str, Any]:
    out = {name: opt.default for name, opt in table.items()}
    for name, value in given.items():
        opt = table.get(name)
        if opt is None:
            close = difflib.get_close_matches(name, list(table), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise TypeError(f"{func}: unknown option {name!r}; {hint}the options are: {', '.join(table)}")
        if not opt.check(value):
            raise ValueError(f"{func}: option {name}={value!r} is not valid; pass {opt.expected}")
        out[name] = value
    return out


def _path(func: str, name: str, value: Any) -> str:
    if not isinstance(value, str | os.PathLike):
        raise TypeError(f"{func}: {name} must be a path (str or os.PathLike), not {type(value).__name__}")
    path = os.fspath(value)
    if not isinstance(path, str):
        raise TypeError(f"{func}: {name} must be a text path, not bytes ({path!r})")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{func}: {name} {path!r} does not exist")
    return path


def audit(path: str | os.PathLike[str], **options: Any) -> Report:
    """Audit the checkpoint at ``path`` (a file or directory in any layout ``ckptaudit audit`` reads).

    Options (keywords; defaults in :data:`AUDIT_OPTIONS`):

    - ``master_dtype``: ``"auto"`` (read the contract from the checkpoint), ``"float32"``, ``"bfloat16"``,
      ``"float16"``;
    - ``expect``: ``"training"`` (a resumable checkpoint) or ``"serving"`` (an inference artifact);
    - ``require``: components whose absence is an error besides model and optimizer
      (``["scheduler", "rng", "data-progress"]`` or ``"scheduler,rng"``);
    - ``master_dtype_from``: who declared ``master_dtype`` when it was not you, in words (the guards pass the
      running job's evidence); the report's contract then says ``live``;
    - ``fail_on``: ``"error"`` (default), ``"warning"`` or ``"info"``: the level at which ``Report.ok`` is false;
    - ``ignore``: finding codes or families to acknowledge (``["security.not-loaded", "optimizer"]`` or
      ``"security.not-loaded,optimizer"``): kept in the report, marked ``ignored``, counted toward nothing;
    - ``quick``: the in-loop mode (first chunk of each tensor, no content hashes; see
      :attr:`ckptaudit.audit.AuditOptions.quick` for what it cannot see);
    - ``chunk_bytes``: bytes read per chunk.

    Raises ``FileNotFoundError`` when ``path`` does not exist, ``TypeError`` / ``ValueError`` for a bad option.
    A checkpoint that cannot be read is a finding in the report, not an exception.
    """
    from ckptaudit.audit import AuditOptions
    from ckptaudit.audit import audit as run_audit

    opts = _resolve("ckptaudit.audit", options, AUDIT_OPTIONS)
    where = _path("ckptaudit.audit", "path", path)
    require = opts["require"]
    if isinstance(require, str):
        require = [s for s in require.split(",") if s.strip()]
    raw = run_audit(where, AuditOptions(master_dtype=opts["master_dtype"], expect=opts["expect"],
                                        require=frozenset(ComponentKind(str(s).strip()) for s in require),
                                        chunk_bytes=opts["chunk_bytes"], quick=opts["quick"],
                                        master_dtype_from=opts["master_dtype_from"],
                                        ignore=_ignored(opts["ignore"])))
    return Report(raw, Severity.parse(opts["fail_on"]))


def compare(reference: str | os.PathLike[str], candidate: str | os.PathLike[str], **options: Any) -> Report:
    """Compare ``candidate`` with ``reference`` tensor by tensor (is it the reference's training state?).

    Options (keywords; defaults in :data:`COMPARE_OPTIONS`): ``fail_on`` and ``ignore`` (as for :func:`audit`),
    ``threads``
    (tensor pairs compared at once), ``chunk_bytes``, ``max_moment_checks`` (value comparisons per state name
    and shape when looking for the source of a mismatched optimizer moment).

    Raises ``FileNotFoundError`` when either path does not exist, ``TypeError`` / ``ValueError`` for a bad
    option.
    """
    from ckptaudit.compare import CompareOptions
    from ckptaudit.compare import compare as run_compare

    opts = _resolve("ckptaudit.compare", options, COMPARE_OPTIONS)
    ref = _path("ckptaudit.compare", "reference", reference)
    cand = _path("ckptaudit.compare", "candidate", candidate)
    raw = run_compare(ref, cand, CompareOptions(chunk_bytes=opts["chunk_bytes"], threads=opts["threads"],
                                                max_moment_checks=opts["max_moment_checks"],
                                                ignore=_ignored(opts["ignore"])))
    return Report(raw, Severity.parse(opts["fail_on"]))


def _ignored(value: Any) -> tuple[str, ...]:
    from ckptaudit.catalogue import parse_ignore

    return parse_ignore(value)
