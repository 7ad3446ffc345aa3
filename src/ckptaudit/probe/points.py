"""What the probe records at its three points: frozen, picklable records, one per parameter and rank.

- point 1, :class:`MasterShard`: the sharded parameter outside forward (the master the optimizer updates);
- point 2, :class:`ComputeShard`: the parameter as forward computes with it, while its module is unsharded;
- point 3, :class:`SavedShard`: the tensor the exporter saved for that parameter.

Every record carries the hash of the same :class:`~ckptaudit.probe.regions.Region` of the parameter (the
rank's shard), so records of one rank compare bit for bit. :class:`ProbeResult` gathers them from all ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptaudit.findings import Finding
from ckptaudit.probe.regions import Region

__all__ = ["ComputeShard", "MasterShard", "ParamInfo", "ProbeResult", "SavedShard"]


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """A trained parameter of the job, as every rank sees it."""

    fqn: str
    """Its name, without wrapper segments (``module.``, ``_fsdp_wrapped_module.``, ``_orig_mod.``)."""
    shape: tuple[int, ...]
    """The full (global) shape."""
    placement: str
    """How it is laid out over the ranks, e.g. ``fsdp2 Shard(dim=0) x2``, ``fsdp1 flat x2``, ``ddp replica x2``."""


@dataclass(frozen=True, slots=True)
class MasterShard:
    """Point 1: one rank's shard of a parameter outside forward."""

    rank: int
    dtype: str
    local_shape: tuple[int, ...]
    region: Region
    hash: str
    rounded: dict[str, str] = field(default_factory=dict)
    """Hashes of the shard rounded to a narrower float: ``bfloat16`` (stored as bf16) and ``bfloat16>float32``
    (rounded, then cast back to the master dtype); the same for ``float16``. Empty for 16-bit masters."""


@dataclass(frozen=True, slots=True)
class ComputeShard:
    """Point 2: a parameter's compute representation inside forward, seen from one rank."""

    rank: int
    dtype: str
    shape: tuple[int, ...]
    full_hash: str
    """Hash of the whole unsharded tensor."""
    hash: str
    """Hash of this rank's region of it (the region of its master shard), in the compute dtype."""
    upcast_hash: str | None
    """Hash of the same region cast to the master dtype (``None`` when the dtypes are the same)."""
    source: str
    """``unsharded`` (FSDP gathered it for this module's forward) or ``parameter`` (plain module / DDP)."""


@dataclass(frozen=True, slots=True)
class SavedShard:
    """Point 3: a parameter's saved tensor, cut to one rank's region."""

    rank: int
    key: str
    """Where it was found in the saved state (e.g. ``model.blocks.0.attn.qkv.weight``)."""
    dtype: str
    shape: tuple[int, ...]
    hash: str | None
    """``None`` when the data could not be read or does not have the parameter's shape (see ``note``)."""
    note: str = ""


@dataclass(frozen=True)
class ProbeResult:
    """Everything the probe saw, gathered on rank 0: what :func:`ckptaudit.probe.verdict.judge_probe` judges."""

    world_size: int
    wrapper: str
    """``fsdp2``, ``fsdp1``, ``ddp`` or ``plain``."""
    params: tuple[ParamInfo, ...]
    masters: dict[str, tuple[MasterShard, ...]]
    """Point 1, by parameter, one record per rank in rank order (empty when not recorded)."""
    compute: dict[str, tuple[ComputeShard, ...]]
    """Point 2, by parameter: the ranks that observed it in the armed forward."""
    saved: dict[str, tuple[SavedShard, ...]]
    """Point 3, by parameter: one record per rank that found it in the saved state."""
    armed: bool = False
    """Whether an armed forward ran (point 2 was requested)."""
    autocast: str | None = None
    """The autocast dtype when forward ran under ``torch.autocast`` (its casts happen inside ops, unseen)."""
    saved_source: str = ""
    """The path of the saved checkpoint, or ``<state dict>``."""
    saved_format: str = ""
    saved_findings: tuple[Finding, ...] = ()
    """Findings of the reader on the saved checkpoint (corrupt files, unsafe pickles, ...)."""
    meta: dict[str, object] = field(default_factory=dict)
    """Free-form facts about the run (recipe, exporter, step), shown in the report."""
