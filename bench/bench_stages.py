"""Where the audit's time goes, stage by stage, on the realistic checkpoint (``bench_realistic.py``'s state).

    .venv/bin/python bench/bench_stages.py --scale 0.1 --dir /tmp/stages          # ~0.43 GB per format, a quick look
    .venv/bin/python bench/bench_stages.py --dir /tmp/stages --rounds 5            # full size (4.26 GB per format)
    .venv/bin/python bench/bench_stages.py --path CKPT                             # any checkpoint

Writes the checkpoint once per format into ``--dir`` and reuses it (delete it to write it again). Then, in this one
process (imports and first-call set-up done first), ``--rounds`` rounds of, in this order:

- ``read``: a 2-thread mapped read of the same bytes (``bench_realistic``'s baseline, fresh maps each round);
- ``plan``: :func:`ckptaudit.auditing.plan.plan_scan` (open, parse, interpret; no tensor data);
- ``map``: every large tensor's bytes through the leased map (:mod:`ckptaudit.formats.io.leased`: lease,
  ``MADV_POPULATE_READ``, ``MADV_DONTNEED``) in the scan's windows, on one thread, touching no byte: the page-table work;
- ``map + hash``: the same, each window hashed (xxh3-128): the per-byte work without the precision and the Python
  of the scan;
- ``scan -j 1`` / ``scan -j 2``: :func:`ckptaudit.auditing.scan.scan_items` on 1 and 2 threads (every tensor: hash,
  precision, small tensors included);
- ``judge``: :func:`ckptaudit.auditing.scan.assemble` and :func:`ckptaudit.auditing.judge.judge_scan`;
- ``audit -j 2``: the whole :func:`ckptaudit.auditing.judge.run_audit` on 2 threads.

Prints, per stage, the median wall time and CPU time (``time.process_time``, all threads) and CPU seconds per GB.
CPU time is steadier than wall time on a shared machine, but grows with cache and memory-bandwidth contention too:
compare figures of one run. On a loaded machine, ``chrt -f 10`` before the command gives this process the cores
as a quiet machine would (the figures in docs/performance.md say when they were taken so).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from bench_realistic import FILE_NAMES, child_read, size_of, write  # this directory: the realistic state

STAGES = ("read", "plan", "map", "map + hash", "scan -j 1", "scan -j 2", "judge", "audit -j 2")


def measure(path: str, rounds: int) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) seconds of each stage, per round."""
    import xxhash

    from ckptaudit.auditing.judge import AuditOptions, judge_scan, run_audit
    from ckptaudit.auditing.plan import plan_scan
    from ckptaudit.auditing.scan import assemble, scan_items
    from ckptaudit.auditing.tensor_scan import MAPPED_CHUNK_BYTES
    from ckptaudit.formats.io.leased import MIN_MAPPED_BYTES
    from ckptaudit.formats.io.tensors import TensorData

    run_audit(path, AuditOptions(jobs=2))  # imports, first-call set-up, the pages warm
    plan = plan_scan(path)
    indices = plan.scannable()
    spans = []
    for i in indices:
        data = plan.items[i][0].data
        assert isinstance(data, TensorData)
        for p in data.pieces:
            n = p.numel * data.dtype.itemsize
            if n >= MIN_MAPPED_BYTES and p.is_contiguous():
                spans.append((p.file, p.data_offset + p.storage_offset * data.dtype.itemsize, n))

    def mapped(visit: Callable[[memoryview], Any]) -> Callable[[], None]:
        def run() -> None:
            maps = plan.ckpt.maps
            for file, pos, n in spans:
                leased = maps.leased(file)
                assert leased is not None, "no leased maps here (CKPTAUDIT_MAPPED_READS=0, or no file leases)"
                while n:
                    k = min(MAPPED_CHUNK_BYTES, n)
                    view = leased.view(pos, k)
                    if view is not None:
                        try:
                            visit(view)
                        finally:
                            leased.done(view, pos)
                    pos, n = pos + k, n - k
        return run

    h = xxhash.xxh3_128()
    scanned: dict[int, Any] = {}

    def scan(jobs: int) -> Callable[[], None]:
        def run() -> None:
            scanned.update(scan_items(plan, indices, jobs=jobs))
        return run

    def judged() -> None:
        judge_scan(assemble(plan, scanned), AuditOptions())

    def planned() -> None:
        plan_scan(path).close()

    steps: dict[str, Callable[[], Any]] = {
        "read": lambda: child_read(path, 2), "plan": planned, "map": mapped(lambda v: None),
        "map + hash": mapped(h.update), "scan -j 1": scan(1), "scan -j 2": scan(2), "judge": judged,
        "audit -j 2": lambda: run_audit(path, AuditOptions(jobs=2))}
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in STAGES}
    for _ in range(rounds):
        for name in STAGES:
            w0, c0 = time.perf_counter(), time.process_time()
            steps[name]()
            out[name].append((time.perf_counter() - w0, time.process_time() - c0))
    plan.close()
    return out


def report(label: str, size: int, runs: dict[str, list[tuple[float, float]]]) -> None:
    print(f"\n{label}: {size / 1e9:.2f} GB, {len(runs['read'])} rounds, medians; load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    print("| stage | wall | CPU (all threads) | CPU s/GB |\n|---|---|---|---|")
    for name in STAGES:
        wall = statistics.median(w for w, _ in runs[name])
        cpu = statistics.median(c for _, c in runs[name])
        print(f"| {name} | {wall:.3f} s | {cpu:.3f} s | {cpu / size * 1e9:.3f} |")
    ratios = [r[0] / a[0] for r, a in zip(runs["read"], runs["audit -j 2"], strict=True)]
    print(f"audit -j 2 speed / read speed, median of rounds: {statistics.median(ratios):.2f}x "
          f"({min(ratios):.2f}-{max(ratios):.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="bytes relative to the full 4.26 GB (default 1)")
    ap.add_argument("--formats", default="torch.save,dcp-1", help="of bench_realistic.py (comma-separated)")
    ap.add_argument("--dir", help="where the checkpoints are written once and kept (needed without --path)")
    ap.add_argument("--path", help="measure this checkpoint instead")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.path:
        report(args.path, size_of(args.path), measure(args.path, args.rounds))
        return
    if not args.dir:
        ap.error("--dir is needed (where the checkpoints are kept), or --path")
    for fmt in args.formats.split(","):
        path = os.path.join(args.dir, f"stages-scale-{args.scale}", FILE_NAMES.get(fmt, fmt))
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            print(f"{fmt}: writing --scale {args.scale} to {path}", file=sys.stderr)
            write(fmt, path + ".part", args.scale)
            os.replace(path + ".part", path)
        report(f"{fmt} --scale {args.scale}", size_of(path), measure(path, args.rounds))


if __name__ == "__main__":
    main()
