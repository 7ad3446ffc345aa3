"""The distributed audit: one checkpoint scanned by every rank of a ``torchrun`` job, one report on rank 0.

    torchrun --nproc-per-node 4 -m ckptaudit audit /shared/ckpt/step-1000 --format json
    torchrun --nnodes 8 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m ckptaudit audit /shared/ckpt/step-1000 --output report.json

Order of events (every rank runs the same command on the same path, on a filesystem all ranks see):

1. (all ranks) join the process group (gloo over TCP, the ``env://`` rendezvous torchrun set up) with a
   bounded timeout;
2. (all ranks) open and interpret the checkpoint (:func:`ckptaudit.auditing.plan.plan_scan`): metadata only, no
   tensor data;
3. (all ranks) split the tensors into ``world_size`` shares of about equal bytes (:func:`partition`: the same
   deterministic split on every rank, largest tensors first), and scan their own share on ``jobs`` threads,
   one chunk per thread in memory;
4. (all ranks) gather every rank's outcomes (kilobytes: hashes and precision evidence, JSON-encoded, never
   pickled) to rank 0; a rank that failed sends its error instead, so no rank waits for one that died in step 2;
5. (rank 0) checks that every rank planned the same tensors, assembles the records in the checkpoint's order
   and runs the checks: the report equals the single-process one. Other ranks return ``None`` (print nothing).

The unit of work is a tensor: its hash is the xxh3-128 of its bytes streamed in order, which one rank computes,
so a rank's share is never smaller than the largest tensor (a 70B model's largest tensor is ~0.4% of it).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from ckptaudit.auditing.judge import AuditOptions, judge
from ckptaudit.auditing.plan import ScanPlan, plan_scan
from ckptaudit.auditing.scan import ScanOutcome, assemble, scan_items
from ckptaudit.auditing.tensor_scan import TensorScan
from ckptaudit.findings import Precision, PrecisionStats, Report

__all__ = ["DistributedAuditError", "audit_distributed", "partition", "torchrun_rank"]

DEFAULT_TIMEOUT_S = 1800.0
"""How long a rank waits for the others at the rendezvous and at the gather (the slowest rank's scan)."""


class DistributedAuditError(Exception):
    """One or more ranks could not take part; the message has one line per failed rank."""


@dataclass(frozen=True, slots=True)
class TorchrunRank:
    rank: int
    world_size: int


def torchrun_rank(env: Mapping[str, str] | None = None) -> TorchrunRank | None:
    """This process's place in a ``torchrun`` job (``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` set), or ``None``.

    Raises ``ValueError`` when the variables are set but do not make sense, naming the variable and its value.
    """
    env = os.environ if env is None else env
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    except ValueError:
        raise ValueError(f"RANK={env['RANK']!r} and WORLD_SIZE={env['WORLD_SIZE']!r} must be whole numbers "
                         "(set by torchrun; unset them to audit in one process)") from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is not within WORLD_SIZE={world} (set by torchrun; unset them to audit in "
                         "one process)")
    return TorchrunRank(rank, world)


def partition(sizes: Mapping[int, int], world_size: int) -> list[list[int]]:
    """Split items (index -> bytes) into ``world_size`` shares of about equal bytes.

    Largest first, each to the share with the fewest bytes so far (lowest rank on ties): deterministic, so every
    rank computes the same split, and within 4/3 of the best possible largest share. Each share is in index order.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    loads = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(sizes, key=lambda i: (-sizes[i], i)):
        r = min(range(world_size), key=lambda k: (loads[k], k))
        shares[r].append(index)
        loads[r] += max(1, sizes[index])  # empty tensors still cost an open and a read
    return [sorted(s) for s in shares]


def _fingerprint(plan: ScanPlan) -> str:
    h = xxhash.xxh3_64()
    for i, (ref, comp, role, _) in enumerate(plan.items):
        h.update(f"{i}\0{ref.name}\0{comp}\0{role}\0{plan.nbytes(i)}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _step_out(step: float | None) -> float | str | None:
    """A step value as strict JSON holds it: a saved ``step`` tensor may hold NaN or an infinity (``"nan"``...)."""
    return step if step is None or math.isfinite(step) else repr(step)


def _step_in(step: float | str | None) -> float | None:
    return float(step) if isinstance(step, str) else step


def _encode(outcomes: dict[int, ScanOutcome]) -> list[list[Any]]:
    rows: list[list[Any]] = []
    for i, o in sorted(outcomes.items()):
        if o.scan is None:
            rows.append([i, None, None, None, o.error, _step_out(o.step)])
            continue
        s = o.scan.stats
        stats = None if s is None else [s.bf16_representable, s.fp16_representable, s.informative_bf16,
                                        s.informative_fp16]
        rows.append([i, o.scan.hash, o.scan.precision.value, stats, o.error, _step_out(o.step)])
    return rows


def _decode(rows: list[list[Any]]) -> dict[int, ScanOutcome]:
    out: dict[int, ScanOutcome] = {}
    for i, digest, precision, stats, error, step in rows:
        if digest is None:
            out[int(i)] = ScanOutcome(None, error, _step_in(step))
            continue
        ps = None if stats is None else PrecisionStats(bool(stats[0]), bool(stats[1]), int(stats[2]), int(stats[3]))
        out[int(i)] = ScanOutcome(TensorScan(digest, Precision(precision), ps), error, _step_in(step))
    return out


def _gather_to_rank0(data: bytes, rank: int, world_size: int) -> list[dict[str, Any]] | None:
    """(all ranks) Send ``data`` (a JSON payload); rank 0 gets every rank's, in rank order; others ``None``."""
    import torch
    import torch.distributed as dist

    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, size)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if rank == 0:
        bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(world_size)]
        dist.gather(buf, bufs, dst=0)
        return [json.loads(bytes(b[: int(n.item())].numpy())) for b, n in zip(bufs, sizes, strict=True)]
    dist.gather(buf, None, dst=0)
    return None


def audit_distributed(path: str, options: AuditOptions | None = None, *, rank: int, world_size: int,
                      timeout_s: float = DEFAULT_TIMEOUT_S) -> Report | None:
    """(all ranks) Audit ``path`` with this rank's share of the tensors; the report on rank 0, ``None`` elsewhere.

    The process group is joined here through torchrun's ``env://`` rendezvous (gloo: the records are
    kilobytes, so CPU and TCP are enough even where NCCL is present) and torn down before returning.
    Raises :class:`DistributedAuditError` on rank 0 when any rank failed (each failure tagged by rank), and
    ``FileNotFoundError`` there when rank 0 itself cannot see ``path``.
    """
    from datetime import timedelta

    import torch.distributed as dist

    options = options or AuditOptions()
    dist.init_process_group(backend="gloo", init_method="env://", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    plan: ScanPlan | None = None
    try:
        own_error: BaseException | None = None
        payload: dict[str, Any]
        try:
            plan = plan_scan(path)
            scannable = plan.scannable()
            shares = partition({i: plan.nbytes(i) for i in scannable}, world_size)
            outcomes = scan_items(plan, shares[rank], jobs=options.jobs, chunk_bytes=options.chunk_bytes)
            payload = {"rank": rank, "fingerprint": _fingerprint(plan), "outcomes": _encode(outcomes)}
            # Encoded here, inside this rank's error handling: a value JSON cannot hold fails this rank's
            # share with its reason, never the collective every other rank is waiting in.
            data = json.dumps(payload, allow_nan=False).encode()
        except (OSError, ValueError) as exc:
            own_error = exc
            data = json.dumps({"rank": rank, "error": f"{type(exc).__name__}: {exc}"}).encode()
        gathered = _gather_to_rank0(data, rank, world_size)
    finally:
        dist.destroy_process_group()
    if gathered is None:  # not rank 0
        if plan is not None:
            plan.close()
        return None
    if own_error is not None:
        raise own_error
    assert plan is not None
    try:
        failures = [f"rank {p['rank']}: {p['error']}" for p in gathered if "error" in p]
        mine = _fingerprint(plan)
        failures += [f"rank {p['rank']}: read a different checkpoint at {path} than rank 0 (other tensors, "
                     "roles or sizes); every rank must see the same files (a shared filesystem)"
                     for p in gathered if "error" not in p and p["fingerprint"] != mine]
        if failures:
            raise DistributedAuditError(f"{len(failures)} rank(s) could not audit {path}:\n  " + "\n  ".join(failures))
        merged: dict[int, ScanOutcome] = {}
        for p in gathered:
            merged.update(_decode(p["outcomes"]))
        missing = sorted(set(plan.scannable()) - set(merged))
        if missing:
            raise DistributedAuditError(f"{len(missing)} tensor(s) were scanned by no rank (first: "
                                        f"{plan.items[missing[0]][0].name}); please report this")
    except BaseException:
        plan.close()
        raise
    scanned = assemble(plan, merged)
    try:
        return judge(scanned, options)
    finally:
        scanned.close()


def shares_of(sizes: Sequence[int], world_size: int) -> list[int]:
    """Bytes per rank that :func:`partition` gives for items of ``sizes`` (for the benchmark and the docs)."""
    shares = partition(dict(enumerate(sizes)), world_size)
    return [sum(sizes[i] for i in s) for s in shares]
