"""The options of the audit and the compare, in one table: name, type, default, valid values and help.

Everything that takes these options derives from here, so they cannot drift: the keyword parameters of
:func:`ckptaudit.audit` / :func:`ckptaudit.compare` (their checks, their error messages and the signature ``help()``
shows), the command line's flags (``ckptaudit audit --master-dtype``: name, choices, default, help), the guards'
validation before training starts (:class:`ckptaudit.integrations.guard.Guard`) and :mod:`ckptaudit.testing`. The typed
stub ``ckptaudit/__init__.pyi`` spells the same parameters for type checkers; ``tests/test_options.py`` holds it to
this table.

Pure and cheap: no torch, no NumPy, nothing of ckptaudit's until a value is checked (``ckptaudit --help`` imports
it).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["AUDIT_OPTIONS", "COMPARE_OPTIONS", "MASTER_DTYPES", "Option", "resolve", "signature"]

MASTER_DTYPES = ("auto", "float32", "bfloat16", "float16")
FAIL_LEVELS = ("error", "warning", "info")


@dataclass(frozen=True, slots=True)
class Option:
    """One keyword option."""

    name: str
    """The keyword (``master_dtype``); the command line's flag is ``--`` + the name with dashes (``--master-dtype``)."""
    default: Any
    annotation: str
    """Its type, as a type checker reads it (``Literal['training', 'serving']``): the signature ``help()`` shows."""
    check: Callable[[Any], bool]
    expected: str | Callable[[], str]
    """What a valid value is, for the error message (``one of 'error', 'warning', 'info'``); a function when the text
    needs a module that ``--help`` should not import."""
    help: str
    """One line for ``--help`` and the docs."""
    choices: tuple[str, ...] = ()
    cli: bool = True
    """Whether the command line has it (``master_dtype_from`` and ``chunk_bytes`` are the API's and the guards')."""

    @property
    def flag(self) -> str:
        """``--master-dtype``; a switch on by default is turned off by ``--no-<name>`` (``--no-run-evidence``)."""
        off = self.annotation == "bool" and self.default is True
        return "--" + ("no-" if off else "") + self.name.replace("_", "-")


def _choice(values: tuple[str, ...]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, str) and v in values


def _literal(values: tuple[str, ...]) -> str:
    return "Literal[" + ", ".join(repr(v) for v in values) + "]"


def _components(v: Any) -> bool:
    from ckptaudit.findings import ComponentKind

    if isinstance(v, str):
        v = [s for s in v.split(",") if s.strip()]
    try:
        return all(isinstance(s, str | ComponentKind) and ComponentKind(str(s).strip()) for s in v)
    except (TypeError, ValueError):
        return False


def _ignore(v: Any) -> bool:
    from ckptaudit.catalogue import parse_ignore

    if not isinstance(v, str | list | tuple | set | frozenset):
        return False
    try:
        parse_ignore(v)
    except ValueError:
        return False
    return True


def _component_names() -> str:
    from ckptaudit.findings import ComponentKind

    return "component names: an iterable or a comma-separated string of " + ", ".join(
        repr(k.value) for k in ComponentKind)


def _dtypes(v: Any) -> bool:
    return isinstance(v, list | tuple) and all(isinstance(d, str) and d in MASTER_DTYPES[1:] for d in v)


def _int_at_least(low: int, high: int | None = None) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low and (high is None or v <= high)


def _jobs(high: int | None = None) -> Callable[[Any], bool]:
    at_least_one = _int_at_least(1, high)
    return lambda v: v is None or at_least_one(v)


FAIL_ON = Option("fail_on", "error", _literal(FAIL_LEVELS), _choice(FAIL_LEVELS),
                 "one of 'error', 'warning', 'info'",
                 "the severity at which the verdict fails (Report.ok false, exit code 1)", FAIL_LEVELS)
IGNORE = Option("ignore", (), "str | Iterable[str]", _ignore,
                "finding codes or families from docs/catalogue.md (an iterable or a comma-separated string, e.g. "
                "'security.not-loaded,optimizer.index-keyed')",
                "acknowledge findings by code (security.not-loaded) or family (optimizer): they stay in the report, "
                "marked ignored, and count toward no verdict or exit code")
CHUNK_BYTES = Option("chunk_bytes", 1 << 20, "int", _int_at_least(64), "an int >= 64 (bytes read per chunk)",
                     "bytes read per chunk", cli=False)

AUDIT_OPTIONS: Mapping[str, Option] = {o.name: o for o in (
    Option("master_dtype", "auto", _literal(MASTER_DTYPES), _choice(MASTER_DTYPES),
           "one of 'auto', 'float32', 'bfloat16', 'float16'",
           "the master dtype parameters are held to (auto: read it from the checkpoint)", MASTER_DTYPES),
    Option("expect", "training", _literal(("training", "serving")), _choice(("training", "serving")),
           "'training' or 'serving'", "what the checkpoint is meant to be", ("training", "serving")),
    Option("require", (), "str | Iterable[str]", _components, _component_names,
           "comma-separated components whose absence is an error: scheduler,rng,data-progress"),
    Option("master_dtype_from", "", "str", lambda v: isinstance(v, str), "a string: who declared master_dtype",
           "who declared master_dtype when it was not you, in words (the guards pass the live run's evidence)",
           cli=False),
    Option("master_dtypes", (), "Iterable[str]", _dtypes, "an iterable of 'float32', 'bfloat16', 'float16': one per "
           "parameter the optimizer steps, in the order of its param groups",
           "each parameter's master dtype, in the order of the optimizer's param groups (the guards pass the live "
           "optimizer's when its parameters have several dtypes)", cli=False),
    FAIL_ON,
    IGNORE,
    Option("quick", False, "bool", lambda v: isinstance(v, bool), "True or False",
           "the in-loop mode: each tensor's precision from its first chunk, no content hashes (not a full verdict)"),
    Option("run_evidence", True, "bool", lambda v: isinstance(v, bool), "True or False",
           "where the checkpoint alone looks like 16-bit masters, hold it to the float32 masters its run's other "
           "checkpoints beside it hold (contract.run-mismatch); the command line's --no-run-evidence judges it "
           "alone"),
    Option("jobs", None, "int | None", _jobs(), "an int >= 1, or None (every core this process may use)",
           "threads scanning tensors at once (default: every core this process may use); the report is the same "
           "whatever N"),
    CHUNK_BYTES,
)}
"""``ckptaudit.audit``'s keyword options and ``ckptaudit audit``'s flags."""

COMPARE_OPTIONS: Mapping[str, Option] = {o.name: o for o in (
    FAIL_ON,
    IGNORE,
    Option("jobs", None, "int | None", _jobs(64), "an int from 1 to 64, or None (every core this process may "
           "use, at most 64)", "tensor pairs compared at once (default: every core this process may use, at most 64); "
           "the report is the same whatever N"),
    Option("threads", None, "int | None", _jobs(64), "an int from 1 to 64, or None",
           "the older name of jobs", cli=False),
    Option("chunk_bytes", 1 << 20, "int", _int_at_least(64), "an int >= 64 (bytes read per chunk and side)",
           "bytes read per chunk and side", cli=False),
    Option("max_moment_checks", 256, "int", _int_at_least(0), "an int >= 0",
           "value comparisons per state name and shape when looking for the source of a mismatched optimizer "
           "moment", cli=False),
)}
"""``ckptaudit.compare``'s keyword options and ``ckptaudit compare``'s flags."""


def resolve(func: str, given: Mapping[str, Any], table: Mapping[str, Option]) -> dict[str, Any]:
    """Every option of ``table``: its default, or the value in ``given`` once checked. Raises ``TypeError`` for an
    unknown name (naming the closest one) and ``ValueError`` for a bad value (naming what a valid one is); ``func``
    (``ckptaudit.audit``, ``ckptaudit guard``) starts the message."""
    out = {name: opt.default for name, opt in table.items()}
    for name, value in given.items():
        opt = table.get(name)
        if opt is None:
            import difflib  # here: only a misspelt name needs it, not every start-up

            close = difflib.get_close_matches(name, list(table), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise TypeError(f"{func}: unknown option {name!r}; {hint}the options are: {', '.join(table)}")
        if not opt.check(value):
            expected = opt.expected() if callable(opt.expected) else opt.expected
            raise ValueError(f"{func}: option {name}={value!r} is not valid; pass {expected}")
        out[name] = value
    return out


def signature(positional: Iterable[tuple[str, str]], table: Mapping[str, Option], returns: Any) -> inspect.Signature:
    """The signature of a function taking ``positional`` (name, annotation) parameters and then the options of
    ``table`` as keywords: what ``help()`` and ``inspect.signature`` show for ``**options``."""
    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=_type(a)) for n, a in positional]
    params += [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default, annotation=_type(o.annotation))
               for o in table.values()]
    return inspect.Signature(params, return_annotation=returns)


@functools.cache  # the API's two signatures are made at import: each annotation text compiled once
def _type(text: str) -> Any:
    # Our own annotations (the table's constants), so that help() shows types rather than quoted strings.
    return eval(text, {"Literal": Literal, "Iterable": Iterable, "os": os})  # noqa: S307
