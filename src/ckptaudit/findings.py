"""The data model every part of ckptaudit produces and consumes: frozen dataclasses, no behaviour.

Data flows one way: files -> readers -> records -> checks -> findings -> report. This module imports nothing
of ckptaudit's own, so every other module may import it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = "1.3"
"""Version of the JSON report. Minor bumps add fields; a major bump renames or removes one."""

HASH_ALGORITHM = "xxh3-128"
"""The content hash of every tensor: xxh3-128 over its elements' little-endian bytes in row-major order."""


def printable(value: Any) -> Any:
    """``value`` as the report writes it: an integer too long for Python's int-to-string limit becomes the text
    ``"<integer of about N digits>"``, NaN and infinities the texts ``"NaN"``, ``"Infinity"``, ``"-Infinity"``
    (JSON has no numbers for them); anything else is returned as it is."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if value.bit_length() <= MAX_INT_BITS else _about(value)
    if isinstance(value, float) and not (value == value and abs(value) != float("inf")):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    return value


# --------------------------------------------------------------------------------------------------------------
# Untrusted values as text: the one formatter of keys and values from checkpoints
#
# A checkpoint's keys and values are data anyone may have written: a dict key that is a 5,001-digit int
# (``str()`` raises ``ValueError`` past Python's int-to-text limit, 4,300 digits), a tuple holding one, a string
# of a million characters. Every name, message, JSON document and page that shows such a value goes through
# :func:`safe_str` (or :func:`safe_repr`): it never raises, and with ``limit`` its text is bounded. Escaping the
# characters that change how text is laid out is the renderers' job (:func:`ckptaudit.report.text.clean`, which
# calls :func:`safe_str` first).

MAX_INT_BITS = 9_000
"""Ints up to this many bits (about 2,700 digits, under Python's 4,300-digit limit) are written out; larger ones
are described by their size and a digest (``<integer of about 5001 digits> (blake2b 3f...)``)."""


def _int_text(value: int) -> str:
    bits = value.bit_length()
    if bits <= MAX_INT_BITS:
        return int.__repr__(value)
    # Named by a digest of its bytes as well as its size: two such keys never share a name (one must not hide
    # the other where names key a table).
    import hashlib  # here, not at the top: OpenSSL's import is ~4 ms of every start-up, for a 5,000-digit key

    digest = hashlib.blake2b(value.to_bytes(bits // 8 + 1, "little", signed=True), digest_size=16).hexdigest()
    return f"{_about(value)} (blake2b {digest})"


def _about(value: int) -> str:
    return f"<integer of about {int(value.bit_length() * 0.30103) + 1} digits>"


def _bounded(text: str, limit: int | None) -> str:
    if limit is None or len(text) <= limit:
        return text
    keep = max(limit - 24, 8)
    return f"{text[:keep]}...(+{len(text) - keep:,} chars)"


def _fallback(value: Any) -> str:
    kind = type(value).__name__
    try:
        n = len(value)
    except Exception:  # noqa: BLE001 - any object: only its type is shown
        return f"<{kind}>"
    return f"<{kind} of {n} items>" if type(n) is int else f"<{kind}>"


def safe_str(value: Any, limit: int | None = None) -> str:
    """``str(value)`` that never raises: an int too large to write out is described by its size, any other
    value whose ``str()`` fails by its type; text longer than ``limit`` characters is cut (and says how much)."""
    kind = type(value)
    if kind is str:
        return _bounded(value, limit)
    if kind is int:
        return _bounded(_int_text(value), limit)
    if kind in (bool, type(None)):
        return str(value)
    if kind is float:
        return str(printable(value))  # NaN and the infinities as the JSON report writes them
    if kind in (tuple, list) and len(value) <= 64:
        inner = ", ".join(safe_repr(v, limit) for v in value)
        text = f"({inner},)" if kind is tuple and len(value) == 1 else f"({inner})" if kind is tuple else f"[{inner}]"
        return _bounded(text, limit)
    try:
        text = str(value)
    except Exception:  # noqa: BLE001 - ValueError (int digits), RecursionError, a type's own failure
        return _fallback(value)
    return _bounded(text, limit) if type(text) is str else _fallback(value)


def safe_repr(value: Any, limit: int | None = None) -> str:
    """``repr(value)`` that never raises, bounded as :func:`safe_str` bounds it (strings quoted)."""
    kind = type(value)
    if kind is str:
        return _bounded(repr(value), limit)
    if kind is int or kind in (tuple, list) or kind in (bool, float, type(None)):
        return safe_str(value, limit)
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - as in safe_str
        return _fallback(value)
    return _bounded(text, limit) if type(text) is str else _fallback(value)


text = safe_str
"""``str(value)`` that never fails (the name earlier versions used; see :func:`safe_str`)."""


_SEVERITY_RANKS = {"info": 0, "warning": 1, "error": 2}


class Severity(enum.StrEnum):
    """How bad a finding is: ``"info"`` < ``"warning"`` < ``"error"``.

    A string enum, so it is what the docs and the JSON call it: ``Severity.ERROR == "error"``, ``str()`` gives
    ``"error"``. Ordered by how bad, not alphabetically (``--fail-on warning`` means ``severity >= WARNING``);
    a severity also compares with a name (``finding.severity >= "warning"``). ``int()`` gives its rank (0, 1, 2).
    """

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"

    @property
    def label(self) -> str:
        """Its name, as the docs, the tables and the JSON write it (the same as ``str()``)."""
        return self.value

    @property
    def rank(self) -> int:
        """0 (info), 1 (warning), 2 (error)."""
        return _SEVERITY_RANKS[self.value]

    def __int__(self) -> int:
        return self.rank

    @classmethod
    def parse(cls, text: str) -> Severity:
        try:
            return cls(text.lower()) if isinstance(text, str) else cls(text)
        except ValueError:
            choices = ", ".join(s.label for s in cls)
            raise ValueError(f"unknown severity {text!r}; choose one of: {choices}") from None

    def _other(self, other: object) -> int | None:
        if not isinstance(other, str):  # a Severity is a str too
            return None
        if other not in _SEVERITY_RANKS:  # never the alphabetical order str would fall back to
            raise TypeError(f"cannot order {self!r} and {other!r}: compare a severity with a Severity or one of "
                            f"{', '.join(map(repr, _SEVERITY_RANKS))}")
        return _SEVERITY_RANKS[other]

    def __lt__(self, other: object) -> bool:
        rank = self._other(other)
        return NotImplemented if rank is None else self.rank < rank

    def __le__(self, other: object) -> bool:
        rank = self._other(other)
        return NotImplemented if rank is None else self.rank <= rank

    def __gt__(self, other: object) -> bool:
        rank = self._other(other)
        return NotImplemented if rank is None else self.rank > rank

    def __ge__(self, other: object) -> bool:
        rank = self._other(other)
        return NotImplemented if rank is None else self.rank >= rank


class ComponentKind(enum.StrEnum):
    """The parts a resumable training checkpoint is made of."""

    MODEL = "model"
    OPTIMIZER = "optimizer"
    SCHEDULER = "scheduler"
    RNG = "rng"
    DATA_PROGRESS = "data-progress"


class Precision(enum.StrEnum):
    """The effective precision of a tensor's values, whatever dtype stores them."""

    EXACT = "exact"
    """The values use the stored dtype's precision (some value needs bits a 16-bit format lacks)."""
    BF16 = "bf16"
    """Every value is bf16-representable, with enough informative values to rule out chance."""
    FP16 = "fp16"
    """Every value is fp16-representable, with enough informative values to rule out chance."""
    INCONCLUSIVE = "inconclusive"
    """Every value is 16-bit representable, but too few are informative (zeros, ones, integers) to tell."""
    NOT_FLOAT = "not-float"
    """Integer or boolean tensor: precision does not apply."""
    NATIVE_16 = "native-16"
    """Stored as a 16-bit (or narrower) float: the dtype is the precision."""
    UNREAD = "unread"
    """The data could not be read (see the findings)."""


@dataclass(frozen=True, slots=True)
class PrecisionStats:
    """The evidence behind a float tensor's effective precision."""

    bf16_representable: bool
    """Every value is exactly representable in bf16."""
    fp16_representable: bool
    """Every value is exactly representable in fp16 (in range, subnormals included)."""
    informative_bf16: int
    """Values that carry evidence for bf16 rounding: finite, not integers, and needing at least five
    significant bits in bf16 (values such as 0, 1, 0.5 or 3 say nothing about where a tensor came from).
    Counted only while every value so far was bf16-representable, and only up to 64."""
    informative_fp16: int
    """The same for fp16."""


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """One logical tensor of a checkpoint (all shards together)."""

    name: str
    """Dotted name inside the checkpoint, e.g. ``model/blocks.0.attn.qkv.weight``."""
    component: str
    """``model``, ``optimizer``, ``scheduler``, ``rng``, ``data-progress``, ``serving`` or ``other``."""
    role: str
    """``parameter``, ``buffer``, ``tied`` (a second name for another model tensor's bytes), or the optimizer
    state name (``exp_avg``, ``step``, ...); ``""`` if unknown."""
    param: str | None
    """The model parameter this tensor belongs to (itself, or the parameter an optimizer moment is attached to)."""
    file: str
    """The file holding the data, relative to the audited path (the first one for sharded tensors)."""
    dtype: str
    shape: tuple[int, ...]
    numel: int
    hash: str | None
    """:data:`HASH_ALGORITHM` hex digest; ``None`` when the data could not be read."""
    precision: Precision
    stats: PrecisionStats | None = None


@dataclass(frozen=True, slots=True)
class Component:
    """Where a checkpoint component was found, or that it was not."""

    kind: ComponentKind
    found: bool
    where: tuple[str, ...] = ()
    """Files or key prefixes holding it."""
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Contract:
    """The master-dtype contract the audit holds parameters to, and where it came from."""

    master_dtype: str
    """``float32``, ``bfloat16``, ``float16`` or ``unknown``."""
    source: str
    """Declared: ``flag`` (``--master-dtype``), ``live`` (the running job: a guard, the probe), ``manifest``
    (ckptaudit's writer); read from the training stack's own record: ``deepspeed-config`` (the saved
    ``ds_config``), ``megatron-args`` (Megatron-LM's saved ``args``), ``grad-scaler`` (a saved GradScaler state:
    fp16 mixed precision); inferred from the tensors: ``optimizer-state``, ``parameters``, or ``none``."""
    detail: str = ""
    where: str = ""
    """The file (and key) of the record that decided it; ``""`` when declared or inferred."""
    records: tuple[str, ...] = ()
    """Every precision record of the training stack the checkpoint holds, in words (``<where>: <what it says>``),
    whether it decided the contract or not (e.g. the Trainer's ``bf16=True``, which does not)."""

    @property
    def inferred(self) -> bool:
        """Read from the tensors' dtypes, with nothing declaring or recording it."""
        return self.source in ("optimizer-state", "parameters", "none")


@dataclass(frozen=True, slots=True)
class Finding:
    """One problem (or fact) found, like a lint message. ``code`` is stable; see the catalogue."""

    code: str
    severity: Severity
    subject: str
    """What the finding is about: a tensor name, a file, a component."""
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    ignored: bool = False
    """Acknowledged by ``--ignore`` (``ignore=``): kept in the report, but it counts toward no verdict, exit code
    or ``ok``."""


@dataclass(frozen=True, slots=True)
class RawReport:
    """The result of one command over one checkpoint (or a pair): what every renderer renders."""

    command: str
    path: str
    format: str
    findings: tuple[Finding, ...]
    contract: Contract | None = None
    components: tuple[Component, ...] = ()
    tensors: tuple[TensorRecord, ...] = ()
    summary: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    """Command-specific sections (``compare``'s pairs, ``latest``'s candidates, ...), already JSON-shaped."""

    def worst(self) -> Severity | None:
        """The worst severity among the findings that are not ignored."""
        return max((f.severity for f in self.findings if not f.ignored), default=None)

    def fails(self, level: Severity) -> bool:
        worst = self.worst()
        return worst is not None and worst >= level
