"""The guard's lineage: which checkpoint each save descends from, and whether a failure damaged the training state
itself or only the saved file.

The guard runs beside the live job, so at each save it can look at the masters in memory as well as at the file:

- **the live check** (:func:`observe_live`; owning process, training thread, right after the library's save,
  called through :func:`~ckptaudit.integrations.live_contract.declare_live_contract`): for every float32 tensor the
  optimizer steps, whether ALL its values are bf16-representable (the low 16 bits of every value zero) or
  fp16-representable, with at least :data:`MIN_INFORMATIVE` informative values (as the audit counts them: an
  all-zero bias or a LayerNorm's ones is not "rounded"). It tests a bounded, strided sample of
  :data:`SAMPLE_PER_TENSOR` values of each tensor, gathered into one buffer (one device-to-host copy per save),
  and confirms every tensor whose sample looks rounded on all its values. So the answer is exact (a tensor is
  called rounded iff all its values are 16-bit-representable), and a healthy run pays only for the sample:
  ``bench/bench_live_check.py`` measures both (docs/integrations/index.md, "The lineage").
- **at the verdict** (worker): a checkpoint that fails while the live masters held only 16-bit values at its save
  point means the training state itself was damaged (the masters were rounded in memory): every later save of
  the run descends from the damage, even one that passes on its own (its fp32 masters kept training from the
  rounded values), until the run restores a checkpoint that passed (:meth:`Guard.restored
  <ckptaudit.integrations.guard.Guard.restored>`). One that fails while the live masters kept their bits failed
  in the save alone (an exporter that rounded what it wrote): later saves are not tainted.

What the live check cannot see: masters the optimizer does not hold as float32 tensors in its param groups or
DeepSpeed's flat partitions (a custom optimizer keeping its own copies elsewhere); with sharded masters, other ranks'
shards (it runs on the process that audits); damage other than 16-bit rounding (the audit still fails the file; the guard then says it could not tell and taints nothing); and damage
undone before the save point (rounded at step 5, then trained at full precision until the save at step 6: the
values at step 6 no longer look rounded); and, the other way round, masters rounded in memory for the save and put
back right after it look like a damaged state (the safe side: more checkpoints passed over, never fewer). A tensor the optimizer steps but that never changed since it was loaded
from 16-bit weights counts as rounded: the audit says the same of the file.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["MIN_INFORMATIVE", "SAMPLE_BLOCKS", "SAMPLE_PER_TENSOR", "SAMPLE_WIDTH", "Damage", "LiveState", "RunLineage", "SaveRecord",
           "observe_live"]

log = logging.getLogger("ckptaudit.guard")

SAMPLE_BLOCKS = 8
SAMPLE_WIDTH = 32
"""Values sampled from each master tensor at each save: :data:`SAMPLE_BLOCKS` runs of this many contiguous values,
spread evenly over the tensor; a tensor whose sample is all 16-bit-representable is then tested whole."""
SAMPLE_PER_TENSOR = SAMPLE_BLOCKS * SAMPLE_WIDTH
MIN_INFORMATIVE = 4
"""Informative values (needing at least five significant bits in the 16-bit format) a tensor needs before it is
called rounded: the audit's own threshold (:data:`ckptaudit.auditing.tensor_scan.MIN_INFORMATIVE`)."""

Damage = Literal["state", "file", "unknown"]
"""What a failing checkpoint's failure damaged: the live training ``state`` (its masters were rounded in memory),
only the saved ``file``, or ``unknown`` (the guard did not see the live masters at that save)."""


@dataclass(frozen=True, slots=True)
class LiveState:
    """What the live check saw at one save point."""

    step: int | None
    checked: int
    """Float32 master tensors tested."""
    rounded: tuple[str, ...]
    """The tensors whose values were ALL 16-bit-representable in memory (``"group 0 #3 (64, 32): bf16"``)."""
    confirmed: int
    """Tensors tested whole because their sample looked rounded."""
    seconds: float
    """Wall time of the check on the training thread."""

    @property
    def damaged(self) -> bool:
        return bool(self.rounded)

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "checked": self.checked, "rounded": list(self.rounded),
                "confirmed": self.confirmed, "seconds": round(self.seconds, 6)}


def _masters(optimizer: Any) -> list[tuple[tuple[int, int] | str, Any]]:
    """(where, tensor) of every float32 tensor ``optimizer`` steps: its param groups' (plain torch, FSDP2's
    DTensors as their local shards, the wrappers that forward ``param_groups``, torchtitan's containers), else
    DeepSpeed's flat master partitions. ``where``: (group, index), or the partition's name."""
    import torch

    from ckptaudit.integrations.live_contract import FLAT_MASTERS, param_groups

    fp32 = torch.float32
    out: list[tuple[tuple[int, int] | str, Any]] = []
    for g, group in enumerate(param_groups(optimizer)):
        params = group.get("params", []) if isinstance(group, dict) else []
        for i, p in enumerate(params):
            if isinstance(p, torch.Tensor) and p.dtype == fp32:
                # A DTensor (FSDP2): this rank's shard. Its type, not hasattr: a Parameter's attribute lookup is slow.
                out.append(((g, i), p.to_local() if type(p).__name__ == "DTensor" else p))  # type: ignore[attr-defined]
    if out:
        return out
    for attr in FLAT_MASTERS:
        flat = getattr(optimizer, attr, None)
        if isinstance(flat, list | tuple) and flat:
            found: list[tuple[tuple[int, int] | str, Any]] = [
                (f"{attr}[{i}]", t) for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.dtype == fp32]
            if found:
                return found
    return out


def _label(where: tuple[int, int] | str, t: Any) -> str:
    return where if isinstance(where, str) else f"param group {where[0]} #{where[1]} {tuple(t.shape)}"


def _halves(t: Any) -> tuple[Any, Any] | None:
    """(low, high) 16-bit halves of every value of a float32 tensor, as int16 views (no copy when contiguous)."""
    import torch

    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return None
    words = flat.view(torch.int16)
    return (words[0::2], words[1::2]) if sys.byteorder == "little" else (words[1::2], words[0::2])


def _rounded_whole(t: Any) -> str | None:
    """``"bf16"`` / ``"fp16"`` when every value of ``t`` is representable there, with enough informative values."""
    import torch

    halves = _halves(t)
    if halves is None:
        return None
    low, high = halves
    if not bool(low.ne(0).any()) and int(high.bitwise_and(0xF).ne(0).sum()) >= MIN_INFORMATIVE:
        return "bf16"
    flat = t.detach().reshape(-1)
    half = flat.to(torch.float16)
    if bool(half.float().eq(flat).all()) and int(half.view(torch.int16).bitwise_and(0x7F).ne(0).sum()) >= MIN_INFORMATIVE:
        return "fp16"
    return None


def observe_live(optimizer: Any, step: int | None = None, blocks: int = SAMPLE_BLOCKS,
                 width: int = SAMPLE_WIDTH) -> LiveState | None:
    """(owning process, training thread, at a save point) The live check: which float32 masters of ``optimizer``
    hold only 16-bit values now. ``None`` when it steps no float32 tensor (nothing to tell)."""
    import torch

    began = time.perf_counter()
    masters = [(where, t) for where, t in _masters(optimizer) if t.numel()]
    if not masters:
        return None
    with torch.no_grad():
        # The sample: ``blocks`` runs of ``width`` contiguous values spread evenly over each tensor (all of a small
        # one), gathered into one buffer, so the kernels below run once per save whatever the number of tensors;
        # contiguous runs cost a few cache lines each where single strided values would cost a miss each.
        runs, small, order = [], [], []
        for k, (_, t) in enumerate(masters):
            flat = t.detach().view(-1) if t.is_contiguous() else t.detach().reshape(-1)
            n = flat.numel()
            if n <= blocks * width:
                small.append(flat)
                order.append((k, n, False))
            else:
                runs.append(torch.as_strided(flat, (blocks, width), ((n - width) // (blocks - 1), 1)))
                order.append((k, blocks * width, True))
        parts = ([torch.cat(runs).view(-1)] if runs else []) + small
        val = torch.cat(parts) if len(parts) > 1 else parts[0]
        # Tensor index of each value: the large ones' runs first (in order), then the small ones.
        idx = [k for k, _, big in order if big] + [k for k, _, big in order if not big]
        sizes = [m for _, m, big in order if big] + [m for _, m, big in order if not big]
        ids = torch.repeat_interleave(torch.tensor(idx), torch.tensor(sizes)).to(val.device)
        words = val.view(torch.int16)
        low, high = (words[0::2], words[1::2]) if sys.byteorder == "little" else (words[1::2], words[0::2])
        half = val.to(torch.float16)
        # Per tensor: values with bits in the low half (not bf16), informative bf16 values, values fp16 cannot
        # hold, informative fp16 values; one copy to the host for all of them.
        flags = torch.stack([low.ne(0), high.bitwise_and(0xF).ne(0), half.float().ne(val),
                             half.view(torch.int16).bitwise_and(0x7F).ne(0)]).long()
        counts = torch.zeros((4, len(masters)), dtype=torch.int64, device=val.device).index_add_(1, ids, flags)
        rows = counts.cpu().tolist()
    rounded: list[str] = []
    confirmed = 0
    for k, (where, t) in enumerate(masters):
        bf16_like = rows[0][k] == 0 and rows[1][k] > 0
        fp16_like = rows[2][k] == 0 and rows[3][k] > 0
        if not (bf16_like or fp16_like):
            continue
        confirmed += 1
        with torch.no_grad():
            fmt = _rounded_whole(t)
        if fmt is not None:
            rounded.append(f"{_label(where, t)}: {fmt}")
    return LiveState(step, len(masters), tuple(rounded), confirmed, time.perf_counter() - began)


@dataclass(frozen=True, slots=True)
class SaveRecord:
    """One save of the run, as a later save's lineage names it."""

    checkpoint: str
    """Its name relative to the run's root (the folder of the guard's first save), or its path."""
    root_digest: str | None
    """Its passport's root digest over its files (``sha256:<hex>``), when the guard computed one."""
    verdict: str
    """``pass``, ``fail`` or ``not-judged``."""
    passport_digest: str | None = None
    step: int | None = None

    def ancestor(self) -> dict[str, Any]:
        """The lineage's JSON shape (``ckptaudit.passport.Ancestor``)."""
        return {"checkpoint": self.checkpoint, "root_digest": self.root_digest or "", "verdict": self.verdict,
                "passport_digest": self.passport_digest}


@dataclass(slots=True)
class RunLineage:
    """(guard's worker thread) The run's history as the guard saw it: the previous save, and the save whose failure
    damaged the live training state (until the run restores a checkpoint that passed)."""

    root: str | None = None
    parent: SaveRecord | None = None
    damaged: SaveRecord | None = None
    history: list[SaveRecord] = field(default_factory=list)

    def name(self, checkpoint: str) -> str:
        """``checkpoint`` relative to the run's root (the folder that holds the first save the guard saw)."""
        path = os.path.abspath(checkpoint)
        if self.root is None:
            self.root = os.path.dirname(path)
        rel = os.path.relpath(path, self.root)
        return path if rel.startswith("..") else rel

    def lineage(self) -> dict[str, Any]:
        """The next save's lineage (the passport's ``lineage`` field)."""
        return {"parent": None if self.parent is None else self.parent.ancestor(),
                "state": "clean" if self.damaged is None else "descends-from-damage",
                "damaged_ancestor": None if self.damaged is None else self.damaged.ancestor()}

    def record(self, saved: SaveRecord, damage: str | None) -> None:
        """A save's verdict: it becomes the next save's parent; a failure that damaged the live ``state`` becomes
        the damaged ancestor of every later save."""
        self.parent = saved
        self.history.append(saved)
        if damage == "state" and self.damaged is None:
            self.damaged = saved

    def restored(self, saved: SaveRecord, damaged: SaveRecord | None = None) -> None:
        """The run restored ``saved``: the next save descends from it (and from ``damaged``, when ``saved`` itself
        descends from damage)."""
        self.parent = saved
        self.damaged = damaged

    def last_passed(self) -> SaveRecord | None:
        """The newest save that passed and does not descend from the damage (what to restore)."""
        cut = self.history.index(self.damaged) if self.damaged in self.history else len(self.history)
        return next((r for r in reversed(self.history[:cut]) if r.verdict == "pass"), None)


def classify(live: LiveState | None) -> Damage:
    """What a failing save damaged, from the live check at its save point."""
    if live is None:
        return "unknown"
    return "state" if live.damaged else "file"


def failure_advice(damage: Damage, live: LiveState | None, good: SaveRecord | None) -> str:
    """The failure message's second half: which of the two failed, and which way to go."""
    if damage == "state":
        assert live is not None
        shown = "; ".join(live.rounded[:3]) + (f"; and {len(live.rounded) - 3} more" if len(live.rounded) > 3 else "")
        back = (f"restore {good.checkpoint}" + (f" (step {good.step})" if good.step is not None else "")
                + ", the last checkpoint that passed," if good is not None else
                "restore the last checkpoint saved before this run (none passed in it)")
        return (f"the TRAINING STATE itself is damaged: {len(live.rounded)} of the {live.checked} float32 masters "
                f"the optimizer steps held only 16-bit values in memory at this save ({shown}); every later save "
                f"descends from it. {back[0].upper()}{back[1:]} and fix the training code that rounds the masters")
    if damage == "file":
        assert live is not None
        return (f"only the SAVED FILE is damaged: the live masters kept their full precision at this save (all "
                f"{live.checked} float32 masters checked); later saves are not tainted. Fix the save (the exporter "
                "or state_dict hook that wrote it)")
    return ("the guard did not see the live masters at this save (no optimizer was given to it), so it cannot tell "
            "whether the training state or only the file is damaged")


def passport_signing(passport: bool, key: Any, certificate: Any, chain: Sequence[Any],
                     sigstore: bool = False) -> dict[str, Any]:
    """(training thread, at construction) The guard's signing options checked before training starts: ``key`` a PEM
    private key file; ``certificate`` (its signing certificate) and ``chain`` (its issuers' PEM files) need it;
    ``sigstore``: sign keylessly with the job's ambient OIDC identity (each passport asks for a fresh token; the
    ``[sign]`` extra). Raises ``ValueError`` naming the option and the fix."""
    paths = {"passport_key": key, "passport_certificate": certificate}
    for i, c in enumerate(chain):
        paths[f"passport_cert_chain[{i}]"] = c
    for name, value in paths.items():
        if value is not None and not (passport and os.path.isfile(value)):
            raise ValueError(f"ckptaudit guard: {name}={os.fspath(value)!r} is not valid; pass the path of a PEM "
                             f"{'private key' if name == 'passport_key' else 'certificate'} file (and passport=True) "
                             "to sign each passport, or None for digest-only passports")
    if key is None and (certificate is not None or chain):
        raise ValueError("ckptaudit guard: passport_certificate / passport_cert_chain sign with a key: pass "
                         "passport_key (the certificate's private key) too")
    if sigstore:
        if not passport or key is not None:
            raise ValueError("ckptaudit guard: passport_sigstore=True signs each passport keylessly: pass it with "
                             "passport=True and without passport_key (one way of signing)")
        from importlib.util import find_spec

        if find_spec("sigstore") is None or find_spec("model_signing") is None:
            from ckptaudit.extras import install_line

            raise ValueError("ckptaudit guard: passport_sigstore=True needs the [sign] extra (model-signing, "
                             f"sigstore): {install_line('sign')}")
    return {"key": None if key is None else os.fspath(key),
            "certificate": None if certificate is None else os.fspath(certificate),
            "cert_chain": [os.fspath(c) for c in chain], "sigstore": bool(sigstore)}


def passport_request(lineage: dict[str, Any], signing: dict[str, Any], folder: str | None,
                     checkpoint: str) -> dict[str, Any]:
    """(worker) What the audit worker needs to write a checkpoint's passport in the audit's pass: its lineage, the
    signing options (:func:`passport_signing`), and a draft path (in the pin's private folder, else beside the
    checkpoint: never inside it, where it would be one of the files it digests)."""
    where = (os.path.join(folder, "passport.json") if folder is not None
             else f"{os.path.normpath(checkpoint)}.passport-draft-{os.getpid()}.json")
    # Not fsynced: no more durable than the checkpoint and the report beside it (neither is fsynced), and an fsync
    # of a file written just after a save forces the save's own data out with it (ext4's ordered journal).
    return {"output": where, **signing, "lineage": lineage, "durable": False}


def passport_drafts(request: dict[str, Any] | None) -> tuple[str, ...]:
    """(worker) The draft files a passport request may leave behind (the passport and its signature)."""
    if request is None:
        return ()
    out = str(request["output"])
    return out, _draft_signature(out)


def drafted_passport(attested: dict[str, Any] | None, checkpoint: str) -> tuple[str, str] | None:
    """(worker, after a pass) The drafted passport and the path its signature would have, or ``None`` when no
    passport was drafted (none asked for; or it failed: logged)."""
    if not attested:
        return None
    if "error" in attested or not attested.get("file"):
        log.warning("ckptaudit guard: %s passed, but its passport could not be written (%s)", checkpoint,
                    attested.get("error", "no file"))
        return None
    draft = str(attested["file"])
    return draft, _draft_signature(draft)


def _draft_signature(draft: str) -> str:
    """Where ``attest`` writes the signature of a passport drafted at ``draft``."""
    return draft.removesuffix(".json") + ".sig"


def place_passport(attested: dict[str, Any] | None, checkpoint: str) -> str | None:
    """(worker, after a pass) Move the drafted passport (and its signature) to where the checkpoint's passport
    lives (:func:`ckptaudit.ondisk.passport.passport_path`: inside a directory, beside a file). Returns where, or
    ``None`` (no passport was written: logged)."""
    from ckptaudit.ondisk.passport import passport_path, signature_path

    drafted = drafted_passport(attested, checkpoint)
    if drafted is None:
        return None
    draft, sig = drafted
    dest = passport_path(checkpoint)
    try:
        if os.path.exists(sig):
            os.replace(sig, signature_path(checkpoint))
        os.replace(draft, dest)
    except OSError as exc:
        log.warning("ckptaudit guard: %s passed, but its passport could not be placed at %s (%s)", checkpoint, dest,
                    exc)
        return None
    return dest


def drop_stale_passport(checkpoint: str) -> None:
    """(training thread, at submit) Remove a passport left beside ``checkpoint`` by an earlier save of the same path
    (Lightning's ``last.ckpt`` is rewritten at every save): it attests other bytes. The new content gets its own
    once it passes."""
    from ckptaudit.ondisk.passport import passport_path, signature_path

    is_dir = os.path.isdir(checkpoint)  # once: both names follow from it
    for old in (passport_path(checkpoint, is_dir=is_dir), signature_path(checkpoint, is_dir=is_dir)):
        try:
            os.remove(old)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("ckptaudit guard: could not remove the stale passport %s (%s)", old, exc)


def restored_record(checkpoint: str, step: int | None) -> tuple[SaveRecord, SaveRecord | None]:
    """(training thread) A restored checkpoint as a lineage parent, from its passport when it has one (its digest,
    verdict, and the damaged ancestor it descends from, if any), else as *not judged*."""
    from ckptaudit.ondisk.passport import find_passport
    from ckptaudit.passport import PassportError, read_passport

    name = os.path.normpath(checkpoint)
    found = find_passport(checkpoint)
    if found is None:
        return SaveRecord(name, None, "not-judged", None, step), None
    try:
        paper = read_passport(found)
    except (OSError, PassportError) as exc:
        log.warning("ckptaudit guard: the passport of the restored %s could not be read (%s); its lineage is not "
                    "known", checkpoint, exc)
        return SaveRecord(name, None, "not-judged", None, step), None
    bad = paper.lineage.damaged_ancestor
    damaged = None if bad is None else SaveRecord(bad.checkpoint, bad.root_digest, bad.verdict, bad.passport_digest)
    return SaveRecord(name, paper.root_digest, paper.verdict, paper.digest, step), damaged
