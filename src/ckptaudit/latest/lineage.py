"""``latest``'s lineage step: a candidate whose training state descends from damage is passed over.

The in-loop guard writes a passport beside each checkpoint that passed (:mod:`ckptaudit.integrations.guard`), and
its lineage says when an earlier save of the run failed while the live masters were rounded in memory: every later
save descends from that damage, even one that passes its own audit (its fp32 masters kept training from the rounded
values). This step reads the candidate's passport (:func:`ckptaudit.ondisk.passport.find_passport`) and rejects
such a candidate with ``guard.descends-from-damage``, naming the damaged ancestor; acknowledging the code
(``ignore``, the command line's ``--allow-damaged-lineage``) keeps the old choice. A candidate without a passport,
or whose passport cannot be read, is left to the other steps (``latest --require passport`` rejects it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptaudit.catalogue import finding, is_ignored
from ckptaudit.latest.candidates import Candidate

if TYPE_CHECKING:
    from ckptaudit.latest.steps import StepContext
    from ckptaudit.passport.model import Ancestor

__all__ = ["DAMAGED_LINEAGE", "damaged_ancestor", "damaged_lineage"]

DAMAGED_LINEAGE = "guard.descends-from-damage"


def damaged_ancestor(c: Candidate) -> Ancestor | None:
    """The damaged ancestor a local candidate's passport says it descends from, else ``None`` (no passport, one that
    cannot be read, a clean lineage, a remote candidate)."""
    from ckptaudit.ondisk.passport import find_passport
    from ckptaudit.passport import PassportError, read_passport

    if c.remote:
        return None
    found = find_passport(c.path)
    if found is None:
        return None
    try:
        lineage = read_passport(found).lineage
    except (OSError, PassportError):
        return None
    return lineage.damaged_ancestor if lineage.state == "descends-from-damage" else None


def damaged_lineage(c: Candidate, ctx: StepContext) -> None:
    """Reject a local candidate whose passport's lineage is ``descends-from-damage`` (before the audit: nothing in
    its bytes can clear it)."""
    bad = damaged_ancestor(c)
    if bad is None:
        return
    ctx.findings.append(finding(
        DAMAGED_LINEAGE, c.name,
        f"{c.name} is passed over: its training state descends from damage at {bad.checkpoint}, an earlier save of its "
        f"run that failed its audit (verdict {bad.verdict}) while the live masters were rounded in memory; every "
        f"later save carries it (the lineage in its passport). Resume from a checkpoint saved before "
        f"{bad.checkpoint}, or pass --allow-damaged-lineage to keep the old choice",
        damaged_ancestor=bad.checkpoint, ancestor_digest=bad.root_digest))
    if not is_ignored(DAMAGED_LINEAGE, ctx.ignore):
        ctx.stop = True  # nothing in its bytes can clear it: no audit
