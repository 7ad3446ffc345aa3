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
        try:
            str(value)
        except ValueError:  # past sys.get_int_max_str_digits()
            return f"<integer of about {int(value.bit_length() * 0.30103) + 1} digits>"
        return value
    if isinstance(value, float) and not (value == value and abs(value) != float("inf")):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    return value


def text(value: Any) -> str:
    """``str(value)`` that never fails on an integer past Python's int-to-string limit."""
    return str(printable(value))


class Severity(enum.IntEnum):
    """How bad a finding is. Ordered, so ``--fail-on warning`` means ``severity >= WARNING``."""

    INFO = 0
    WARNING = 1
    ERROR = 2

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Severity:
        try:
            return cls[text.upper()]
        except KeyError:
            choices = ", ".join(s.label for s in cls)
            raise ValueError(f"unknown severity {text!r}; choose one of: {choices}") from None


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
