"""The distributed audit: one checkpoint scanned by every rank of a ``torchrun`` job, one report on rank 0.

    torchrun --nproc-per-node 4 -m ckptaudit audit /shared/ckpt/step-1000 --format json
    torchrun --nnodes 8 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m ckptaudit audit /shared/ckpt/step-1000 --output report.json

Order of events (every rank runs the same command on the same path, on a filesystem all ranks see):

1. (all ranks) join the process group (gloo over TCP, the ``env://`` rendezvous torchrun set up) with a
   bounded timeout;
2. (rank 0) open and interpret the checkpoint (:func:`ckptaudit.auditing.plan.plan_scan`): metadata only, no tensor
   data, under the readers' hostile-input rules (a DCP ``.metadata`` walked and loaded once, for the whole job);
   split the tensors into ``world_size`` shares of about equal bytes (:func:`partition`, largest first);
3. (rank 0 -> each rank) send each rank its share as plain data (:mod:`ckptaudit.auditing.share`: JSON, never
   pickle; point to point, so a rank receives its share only, bytes linear in the pieces it will read): its
   tensors and where their pieces lie, and the files to check, with the size and, for metadata rank 0 parsed
   (``.metadata``), the xxh3-128 of the bytes parsed;
4. (all ranks) check their own view of those files: a rank that finds one changed (another size, other bytes or
   another version, or unreadable: a save still writing, or a rank that sees other files at this path) scans
   nothing; the others scan their share on ``jobs`` threads, one chunk per thread in memory, and every file
   their scan opens must be the version rank 0 read (a file replaced after the check leaves its tensors unread);
5. (all ranks) gather every rank's outcomes (kilobytes: hashes and precision evidence, JSON-encoded, never
   pickled) to rank 0; a rank that failed sends its error instead, so no rank waits for one that died;
6. (rank 0) assembles the records in the checkpoint's order and runs the checks, and where the checkpoint alone
   looks like 16-bit masters reads its siblings' headers for the run's evidence
   (:func:`ckptaudit.auditing.run_evidence.judge_audit`, the single-process audit's judgement): the report equals the
   single-process one. A file some rank found changed is an ``integrity.changed`` finding, and the tensors of
   that rank's share are left unread (nothing is judged from bytes nobody vetted). Other ranks return ``None``
   (print nothing).

Only rank 0 holds the whole plan (it judges every record); every other rank holds its share. The unit of work
is a tensor: its hash is the xxh3-128 of its bytes streamed in order, which one rank computes, so a rank's share
is never smaller than the largest tensor (a 70B model's largest tensor is ~0.4% of it). Costs at scale:
``docs/scale.md``.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptaudit.auditing.judge import AuditOptions
from ckptaudit.auditing.plan import ScanPlan, plan_scan
from ckptaudit.auditing.run_evidence import judge_audit
from ckptaudit.auditing.scan import ScanOutcome, assemble, scan_datas, scan_items
from ckptaudit.auditing.share import (
    checkpoint_root,
    decode_share,
    encode_error,
    encode_share,
    host_key,
    is_single_file,
    share_datas,
    share_ids,
    vetted_file_problems,
    vetted_files,
    view_problems,
)
from ckptaudit.auditing.tensor_scan import TensorScan
from ckptaudit.catalogue import finding
from ckptaudit.findings import Finding, Precision, PrecisionStats, RawReport
from ckptaudit.formats.io.tensors import FileMaps, TensorData
from ckptaudit.formats.remote import is_url, local_path

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

    Largest first, each to the share with the fewest bytes so far (lowest rank on ties): deterministic, and
    within 4/3 of the best possible largest share. Each share is in index order. ``O(n log world_size)``: a
    plan of 10^5 tensors over 1024 ranks splits in a fraction of a second.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    loads = [(0, r) for r in range(world_size)]  # a heap of (bytes so far, rank): its top is the least loaded
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(sizes, key=lambda i: (-sizes[i], i)):
        load, r = loads[0]
        shares[r].append(index)
        heapq.heapreplace(loads, (load + max(1, sizes[index]), r))  # empty tensors still cost an open and a read
    return [sorted(s) for s in shares]


def _step_out(step: float | None) -> float | str | None:
    """A step value as strict JSON holds it: a saved ``step`` tensor may hold NaN or an infinity (``"nan"``...)."""
    return step if step is None or math.isfinite(step) else repr(step)


def _step_in(step: float | str | None) -> float | None:
    return float(step) if isinstance(step, str) else step


def _encode(outcomes: dict[int, ScanOutcome], root: str) -> list[list[Any]]:
    """A rank's outcomes as JSON rows; a file found changed is named relative to the checkpoint's ``root``."""
    rows: list[list[Any]] = []
    for i, o in sorted(outcomes.items()):
        if o.scan is None:
            changed = os.path.relpath(o.changed, root) if o.changed else ""
            rows.append([i, None, None, None, o.error, _step_out(o.step), changed])
            continue
        s = o.scan.stats
        stats = None if s is None else [s.bf16_representable, s.fp16_representable, s.informative_bf16,
                                        s.informative_fp16]
        rows.append([i, o.scan.hash, o.scan.precision.value, stats, o.error, _step_out(o.step), ""])
    return rows


def _decode(rows: list[list[Any]]) -> dict[int, ScanOutcome]:
    out: dict[int, ScanOutcome] = {}
    for i, digest, precision, stats, error, step, changed in rows:
        if digest is None:
            out[int(i)] = ScanOutcome(None, error, _step_in(step), changed=str(changed))
            continue
        ps = None if stats is None else PrecisionStats(bool(stats[0]), bool(stats[1]), int(stats[2]), int(stats[3]))
        out[int(i)] = ScanOutcome(TensorScan(digest, Precision(precision), ps), error, _step_in(step))
    return out


def _payload_bytes(payload: dict[str, Any], rank: int) -> tuple[bytes, ValueError | None]:
    """(all ranks) ``payload`` as JSON bytes, encoded inside this rank's error handling: a value JSON cannot hold
    fails this rank's share with its reason (the error returned beside it), never the collective every other rank
    is waiting in."""
    try:
        return json.dumps(payload, allow_nan=False).encode(), None
    except (ValueError, TypeError) as exc:
        error = ValueError(f"the results cannot be sent as JSON ({type(exc).__name__}: {exc})")
        return json.dumps({"rank": rank, "error": f"ValueError: {error}"}).encode(), error


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


def _send_bytes(data: bytes, dst: int) -> None:
    """(rank 0) ``data`` to rank ``dst``: its length, then its bytes (point to point: each rank gets its own)."""
    import torch
    import torch.distributed as dist

    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=dst)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=dst)


def _recv_bytes(src: int) -> bytes:
    """(ranks other than 0) What :func:`_send_bytes` sent this rank."""
    import torch
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=src)
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    if buf.numel():
        dist.recv(buf, src=src)
    return bytes(buf.numpy())


class _Clock:
    """Wall and CPU seconds and peak memory at the end of each phase, into ``stats`` (benchmarks)."""

    def __init__(self, stats: dict[str, float] | None) -> None:
        self.stats = stats
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def mark(self, phase: str, **counts: float) -> None:
        if self.stats is None:
            return
        wall, cpu = time.perf_counter(), time.process_time()
        self.stats[f"{phase}_s"] = self.stats.get(f"{phase}_s", 0.0) + wall - self._wall
        self.stats[f"{phase}_cpu_s"] = self.stats.get(f"{phase}_cpu_s", 0.0) + cpu - self._cpu
        self.stats[f"{phase}_maxrss_mib"] = _maxrss_mib()
        self.stats.update(counts)
        self._wall, self._cpu = wall, cpu


def _maxrss_mib() -> float:
    try:
        import resource
    except ImportError:  # not on Windows
        return 0.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def audit_distributed(path: str, options: AuditOptions | None = None, *, rank: int, world_size: int,
                      timeout_s: float = DEFAULT_TIMEOUT_S, stats: dict[str, float] | None = None) -> RawReport | None:
    """(all ranks) Audit ``path`` with this rank's share of the tensors; the report on rank 0, ``None`` elsewhere.

    The process group is joined here through torchrun's ``env://`` rendezvous (gloo: the shares and records are
    plain CPU data, so CPU and TCP are enough even where NCCL is present) and torn down before returning; a
    caller that already joined one (``torch.distributed.is_initialized()``, ``rank`` and ``world_size`` its
    own) has it used and left as it was. Raises :class:`DistributedAuditError` on rank 0 when any rank failed
    (each failure tagged by rank), and ``FileNotFoundError`` there when rank 0 itself cannot see ``path``.
    ``stats``: a dict to fill with this rank's seconds (wall and CPU) and peak resident memory (MiB) at the end
    of each phase, and the size of its share (benchmarks: ``bench/bench_dist_scale.py``).
    """
    from datetime import timedelta

    import torch.distributed as dist

    options = options or AuditOptions()
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group(backend="gloo", init_method="env://", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    elif (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
        raise ValueError(f"rank={rank}, world_size={world_size} given, but the process group this process joined "
                         f"has rank {dist.get_rank()} of {dist.get_world_size()}")
    clock = _Clock(stats)
    plan: ScanPlan | None = None
    shares: list[list[int]] = []
    own_error: BaseException | None = None
    try:
        if rank == 0:
            plan, shares, own_error, payload = _lead(path, options, world_size, clock)
        else:
            payload = _follow(path, options, rank, clock)
        data, unsent = _payload_bytes(payload, rank)
        if rank == 0 and own_error is None:
            own_error = unsent
        gathered = _gather_to_rank0(data, rank, world_size)
        clock.mark("gather")
    except BaseException:
        if plan is not None:
            plan.close()
        raise
    finally:
        if own_group:
            dist.destroy_process_group()
    if gathered is None:  # not rank 0
        return None
    if own_error is not None:
        if plan is not None:
            plan.close()
        raise own_error
    assert plan is not None
    try:
        scanned = assemble(plan, _merge(plan, shares, gathered, path))
    except BaseException:
        plan.close()
        raise
    try:
        seen = {(f.code, f.subject) for f in scanned.findings}
        scanned.findings += [f for f in _changed_findings(gathered, shares) if (f.code, f.subject) not in seen]
        report = judge_audit(scanned, options, path)  # as in one process: the run's evidence read here, on rank 0
        clock.mark("judge")
        return report
    finally:
        scanned.close()


def _lead(path: str, options: AuditOptions, world_size: int,
          clock: _Clock) -> tuple[ScanPlan | None, list[list[int]], BaseException | None, dict[str, Any]]:
    """(rank 0) Plan the audit, send every other rank its share, check its own view, scan its own share."""
    plan: ScanPlan | None = None
    shares: list[list[int]] = []
    try:
        plan = plan_scan(path)
        shares = partition({i: plan.nbytes(i) for i in plan.scannable()}, world_size)
    except (OSError, ValueError) as exc:
        clock.mark("plan")
        for r in range(1, world_size):
            _send_bytes(encode_error(f"{type(exc).__name__}: {exc}"), r)
        return None, [], exc, {"rank": 0, "error": f"{type(exc).__name__}: {exc}"}
    clock.mark("plan", items=len(plan.items), scannable=sum(len(s) for s in shares))
    try:
        sent = 0
        for r in range(1, world_size):
            data = encode_share(plan, shares[r])
            _send_bytes(data, r)
            sent += len(data)
        mine = vetted_files(plan, shares[0])  # the files and the check every rank's share has, not encoded
        clock.mark("send", sent_bytes=sent, share_items=len(shares[0]),
                   share_pieces=sum(len(d.pieces) for d in _datas(plan, shares[0])))
        root = checkpoint_root(plan.ckpt.read_path, is_single_file(plan))
        problems = [] if is_url(path) else view_problems(root, mine)
        clock.mark("check")
        if problems:
            return plan, shares, None, {"rank": 0, "changed": problems}
        outcomes = scan_items(plan, shares[0], jobs=options.jobs, chunk_bytes=options.chunk_bytes)
        clock.mark("scan", share_bytes=sum(plan.nbytes(i) for i in shares[0]))
        return plan, shares, None, {"rank": 0, "outcomes": _encode(outcomes, root)}
    except BaseException:
        plan.close()
        raise


def _datas(plan: ScanPlan, indices: Sequence[int]) -> list[TensorData]:
    out = []
    for i in indices:
        data = plan.items[i][0].data
        assert isinstance(data, TensorData)
        out.append(data)
    return out


def _follow(path: str, options: AuditOptions, rank: int, clock: _Clock) -> dict[str, Any]:
    """(ranks other than 0) Receive this rank's share, check this rank's view of its files, scan it."""
    data = _recv_bytes(0)
    maps = FileMaps()
    try:
        share = decode_share(data)
        clock.mark("receive", received_bytes=len(data), share_items=len(share.items),
                   share_pieces=sum(len(row[4]) for row in share.items))
        del data
        if share.error:  # rank 0 raises it
            return {"rank": rank, "skipped": True}
        if is_url(path):
            from ckptaudit.formats.remote.staging import ShareReader

            # Every read of this rank (the view check's and the scan's) goes through the reader's pinned, bounded
            # ranged reads; the stand-in takes over its pins, released by maps.close().
            reader = ShareReader(path, single_file=share.single_file)
            try:
                view = reader.view([v.name for v in share.vetted],
                                   digest={v.name for v in share.vetted if v.digest is not None})
                problems = []
                for v in share.vetted:
                    seen = view[v.name]
                    problems += [(v.name, seen)] if isinstance(seen, str) else vetted_file_problems(v, *seen)
                if not problems:
                    root, maps.remote = reader.stand_in(share.data_files)
            finally:
                if maps.remote is None:
                    reader.close()
        else:
            root = checkpoint_root(os.path.abspath(local_path(path)), share.single_file)
            # Every open of this rank's scan must find the versions rank 0 read, as the view check does.
            maps.ids = share_ids(share, root)
            problems = view_problems(root, share.vetted, same_host=share.host == host_key())
        clock.mark("check")
        if problems:
            return {"rank": rank, "changed": problems}
        datas, steps = share_datas(share, root)
        del share
        clock.mark("decode")
        outcomes = scan_datas(datas, maps, step_items=steps, jobs=options.jobs, chunk_bytes=options.chunk_bytes)
        clock.mark("scan", share_bytes=sum(d.nbytes for d in datas.values()))
        return {"rank": rank, "outcomes": _encode(outcomes, root)}
    except (OSError, ValueError) as exc:
        return {"rank": rank, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        maps.close()


def _merge(plan: ScanPlan, shares: list[list[int]], gathered: list[dict[str, Any]],
           path: str) -> dict[int, ScanOutcome]:
    """(rank 0) Every rank's outcomes by tensor index; raises :class:`DistributedAuditError` for failed ranks."""
    failures = [f"rank {p['rank']}: {p['error']}" for p in gathered if "error" in p]
    if failures:
        raise DistributedAuditError(f"{len(failures)} rank(s) could not audit {path}:\n  " + "\n  ".join(failures))
    merged: dict[int, ScanOutcome] = {}
    for p in gathered:
        r = int(p["rank"])
        if "changed" in p:
            why = f"not read: rank {r} found the checkpoint changed since rank 0 vetted it (integrity.changed)"
            merged.update({i: ScanOutcome(None, why, reported=True) for i in shares[r]})
        else:
            merged.update(_decode(p["outcomes"]))
    missing = sorted(set(plan.scannable()) - set(merged))
    if missing:
        raise DistributedAuditError(f"{len(missing)} tensor(s) were scanned by no rank (first: "
                                    f"{plan.items[missing[0]][0].name}); please report this")
    return merged


def _changed_findings(gathered: list[dict[str, Any]], shares: list[list[int]]) -> list[Finding]:
    """(rank 0) One ``integrity.changed`` per file some rank saw otherwise than rank 0 vetted it."""
    seen: dict[str, list[tuple[int, str]]] = {}
    for p in gathered:
        for name, what in p.get("changed", ()):
            seen.setdefault(name, []).append((int(p["rank"]), what))
    out = []
    for name, views in seen.items():
        ranks = sorted({r for r, _ in views})
        r, what = views[0]
        unread = sum(len(shares[k]) for k in ranks)
        also = f" (as on rank(s) {', '.join(str(k) for k in ranks[1:])})" if len(ranks) > 1 else ""
        out.append(finding(
            "integrity.changed", name,
            f"{name} changed while the checkpoint was audited: on rank {r} it {what}{also}. The {unread} tensor(s) "
            f"{'those ranks' if len(ranks) > 1 else 'that rank'} were to scan were not read, so nothing is judged "
            "from them; audit again once the checkpoint is complete (every rank must see the same files at this "
            "path: a shared filesystem)", file=name, ranks=ranks, unread=unread))
    return out


def shares_of(sizes: Sequence[int], world_size: int) -> list[int]:
    """Bytes per rank that :func:`partition` gives for items of ``sizes`` (for the benchmark and the docs)."""
    shares = partition(dict(enumerate(sizes)), world_size)
    return [sum(sizes[i] for i in s) for s in shares]
