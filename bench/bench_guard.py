"""What the in-loop guard costs the training loop: step time with and without it, in one run.

    .venv/bin/python bench/bench_guard.py                          # process worker (the default), full audit
    .venv/bin/python bench/bench_guard.py --background thread --quick

A small real loop, one process: an MLP of ``--mib`` MiB of fp32 parameters, AdamW, one torch thread (the
accelerator's role; the audit gets the other core, as the host CPU would beside a GPU), a checkpoint
(``torch.save`` of model + optimizer, as most loops write it) every ``--save-every`` steps. ``--rounds`` pairs
of segments of ``--steps`` steps, alternating without and with the guard (``Guard.submit`` after each save, the
audit in the background), in alternating order; each guarded segment then waits for its audits (untimed), so
every guarded segment pays for all its audits. Reported: median step time (the steps only, saves excluded, as
the guard adds nothing to a save), median segment wall time (steps + saves), the overhead of each, the audit
time per checkpoint, and memory: the peak RSS of this process above the unguarded peak (thread worker) or the
worker process's peak RSS (process worker).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import proc_status


class RssPeak:
    """Samples VmRSS every 5 ms while active (VmHWM never goes down, so it cannot compare segments)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, proc_status("VmRSS"))

    def __enter__(self) -> RssPeak:
        self.peak = proc_status("VmRSS")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def child_hwm(guard: Any) -> int:
    child = getattr(guard, "_child", None)
    if child is None or child.poll() is not None:
        return 0
    with open(f"/proc/{child.pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=32, help="MiB of fp32 parameters (checkpoint: 3x with AdamW)")
    p.add_argument("--steps", type=int, default=60, help="steps per segment")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5, help="pairs of segments (without, with the guard)")
    p.add_argument("--background", choices=["thread", "process"], default="process")
    p.add_argument("--quick", action="store_true", help="the quick audit (first chunk, no hashes)")
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args(argv)

    import torch

    from ckptaudit.integrations.guard import Guard

    torch.set_num_threads(1)
    torch.manual_seed(0)
    width = 1024
    layers = max(1, args.mib * (1 << 20) // (4 * width * width))
    model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.GELU())])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, width)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    work = tempfile.mkdtemp(prefix="bench-guard-")
    guard = Guard(on_failure="warn", background=args.background, quick=args.quick)
    step_times: dict[str, list[float]] = {"without": [], "with": []}
    seg_times: dict[str, list[float]] = {"without": [], "with": []}
    peaks: dict[str, list[int]] = {"without": [], "with": []}
    saved = 0

    def segment(guarded: bool) -> None:
        nonlocal saved
        steps: list[float] = []
        with RssPeak() as rss:
            seg_start = time.perf_counter()
            for s in range(1, args.steps + 1):
                t0 = time.perf_counter()
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                steps.append(time.perf_counter() - t0)
                if s % args.save_every == 0:
                    saved += 1
                    path = os.path.join(work, f"step-{saved}.pt")
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": saved}, path)
                    if guarded:
                        guard.submit(path, step=saved)
            seg = time.perf_counter() - seg_start
            if guarded:
                guard.wait()
        key = "with" if guarded else "without"
        step_times[key].append(statistics.median(steps))
        seg_times[key].append(seg)
        peaks[key].append(rss.peak)
        for n in os.listdir(work):  # keep the disk use flat
            os.remove(os.path.join(work, n))

    try:
        segment(False)  # warm-up: allocator, page cache, the guard's imports in the next one
        segment(True)
        for key in step_times:
            step_times[key].clear()
            seg_times[key].clear()
            peaks[key].clear()
        for r in range(args.rounds):
            for guarded in ((False, True) if r % 2 == 0 else (True, False)):
                segment(guarded)
        audits = [v.seconds for v in guard.verdicts[-args.rounds * (args.steps // args.save_every):]]
        child_peak = child_hwm(guard)
        failed = [v for v in guard.verdicts if v.ok is not True]
    finally:
        guard.close()
        shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in step_times.items()}
    seg = {k: statistics.median(v) for k, v in seg_times.items()}
    peak = {k: max(v) for k, v in peaks.items()}
    print(f"bench_guard: {layers} x Linear(1024, 1024), {nbytes / 2**20:.0f} MiB fp32 parameters; checkpoint "
          f"{3 * nbytes / 2**20:.0f} MiB (model + AdamW) every {args.save_every} steps; {args.rounds} rounds of "
          f"{args.steps} steps each way; worker: {args.background}, {'quick' if args.quick else 'full'} audit; "
          f"torch threads 1, cores {os.cpu_count()}")
    print(f"  median step time  without {med['without'] * 1e3:8.2f} ms   with {med['with'] * 1e3:8.2f} ms   "
          f"overhead {100 * (med['with'] / med['without'] - 1):+.2f}%")
    print(f"  median segment    without {seg['without']:8.3f} s    with {seg['with']:8.3f} s     "
          f"overhead {100 * (seg['with'] / seg['without'] - 1):+.2f}%  (steps + saves, audits in the background)")
    print(f"  audit per checkpoint: median {statistics.median(audits):.3f} s (max {max(audits):.3f} s), "
          f"{len(audits)} audits, {len(failed)} not passed")
    if args.background == "thread":
        print(f"  memory: peak RSS with the guard {(peak['with'] - peak['without']) / 2**20:+.1f} MiB over the "
              f"unguarded peak ({peak['without'] / 2**20:.0f} MiB)")
    else:
        print(f"  memory: worker process peak RSS {child_peak / 2**20:.1f} MiB; this process "
              f"{(peak['with'] - peak['without']) / 2**20:+.1f} MiB over the unguarded peak")
    return 0


if __name__ == "__main__":
    sys.exit(main())
