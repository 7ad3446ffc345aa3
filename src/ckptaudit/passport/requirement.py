"""``latest --require passport``: the one step that keeps a candidate whose passport does not verify from being
chosen, and how the requirement rides in ``require`` beside the components.

``require`` takes ``passport`` (any passport that verifies: the bytes are the attested ones and its verdict a
pass) or ``passport=KEY`` (the signature must also verify: ``KEY`` is the signer's PEM public key, a PEM file of
the CA certificates the passport's signing certificate must chain to, or a Sigstore policy file naming the keyless
signer trusted; a digest-only passport is refused). :func:`split_require` takes it out before the components are judged.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ckptaudit.findings import Finding
from ckptaudit.passport.verifying import passport_findings

__all__ = ["PassportRequirement", "require_passport_step", "split_require"]


@dataclass(frozen=True, slots=True)
class PassportRequirement:
    key: str | None = None
    """The signer's PEM public key or the CA certificates' PEM file, or ``None``: any passport that verifies."""

    def findings(self, path: str, name: str) -> tuple[Finding, ...]:
        """The errors that keep the checkpoint at ``path`` from being chosen (empty: its passport verifies)."""
        return passport_findings(path, name, key=self.key)


def split_require(require: Iterable[Any]) -> tuple[frozenset[Any], PassportRequirement | None]:
    """``require`` without its ``passport`` / ``passport=KEY`` item, and that item as a requirement (or ``None``)."""
    rest: set[Any] = set()
    wanted: PassportRequirement | None = None
    for item in require:
        text = getattr(item, "value", item)
        if isinstance(text, str) and (text == "passport" or text.startswith("passport=")):
            wanted = PassportRequirement(text.partition("=")[2] or None)
        else:
            rest.add(item)
    return frozenset(rest), wanted


def require_passport_step(candidate: Any, ctx: Any) -> None:
    """A step of ``latest``'s validation (``step(candidate, ctx)``): with ``passport`` in ``ctx.require``, the
    candidate's passport must verify (one read of every byte); its findings join ``ctx.findings``."""
    _, wanted = split_require(ctx.require)
    if wanted is not None:
        ctx.findings.extend(wanted.findings(candidate.path, candidate.name))
