"""Run the FSDP2 session fixture's launches (``conftest.fsdp_run``) many times on saturated cores, and keep what every
failing rank said: the harness behind the rank-abort investigation in ``docs/development.md``.

    .venv/bin/python tests/support/stress_launch.py --runs 50 --start-method forkserver --load 2 --out /tmp/stress

Each run is a fresh parent process (as a pytest session is) that makes the fixture's two 2-rank launches
(``fsdp_jobs.write_variants``, then ``fsdp_jobs.write_low_precision``; ``--order reversed`` swaps them) with the
fixture's options, while ``--load`` busy-loop processes keep the cores saturated. Core dumps are allowed
(``ulimit -c unlimited``; they land in ``OUT/cores`` when the kernel's ``core_pattern`` is a relative name) and
``--malloc-check`` runs the ranks under glibc's heap checks (``MALLOC_CHECK_=3``, ``MALLOC_PERTURB_``). A failure's
full ``DistributedError`` text (every failed rank's last stderr lines) goes to ``OUT/failures/run-N.txt``; the
summary line of each run and the totals go to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def one(out: str, start_method: str, order: str) -> int:
    """(fresh parent) The fixture's two launches; exit 0, or 1 with the error's text on stdout."""
    sys.path[:0] = [str(HERE), str(HERE.parents[1] / "src")]
    import fsdp_jobs
    from ckptaudit.launch import DistributedError, launch

    opts: dict[str, Any] = ({"start_method": "forkserver", "preload": ("torch", "torch.distributed.fsdp", "fsdp_jobs")}
                            if start_method == "forkserver" else {"start_method": "spawn"})
    jobs = [fsdp_jobs.write_variants, fsdp_jobs.write_low_precision]
    if order == "reversed":
        jobs.reverse()
    for job in jobs:
        t0 = time.monotonic()
        try:
            launch(job, 2, (out, 6), timeout_s=240, **opts)
        except DistributedError as exc:
            print(json.dumps({"job": job.__name__, "error": str(exc), "s": time.monotonic() - t0}))
            return 1
    return 0


def _busy() -> None:
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--start-method", choices=("forkserver", "spawn"), default="forkserver")
    ap.add_argument("--order", choices=("forward", "reversed", "alternate"), default="alternate")
    ap.add_argument("--load", type=int, default=2, help="busy-loop processes kept running meanwhile")
    ap.add_argument("--malloc-check", action="store_true", help="MALLOC_CHECK_=3 and a MALLOC_PERTURB_ byte")
    ap.add_argument("--out", required=True)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: a single run into this directory
    args = ap.parse_args(argv)
    if args.one:
        return one(args.one, args.start_method, args.order)

    out = Path(args.out)
    (out / "failures").mkdir(parents=True, exist_ok=True)
    (out / "cores").mkdir(exist_ok=True)
    import multiprocessing as mp

    busy = [mp.get_context("spawn").Process(target=_busy, daemon=True) for _ in range(args.load)]
    for p in busy:
        p.start()
    failed = 0
    try:
        for i in range(args.runs):
            order = args.order if args.order != "alternate" else ("forward", "reversed")[i % 2]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            if args.malloc_check:
                env.update(MALLOC_CHECK_="3", MALLOC_PERTURB_=str(1 + i % 254))
            work = out / f"run-{i}"
            work.mkdir(exist_ok=True)
            t0 = time.monotonic()
            proc = subprocess.run(
                [sys.executable, __file__, "--out", str(out), "--one", str(work), "--start-method", args.start_method,
                 "--order", order], env=env, cwd=out / "cores", capture_output=True, text=True, check=False,
                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY,) * 2))
            elapsed = time.monotonic() - t0
            if proc.returncode != 0:
                failed += 1
                (out / "failures" / f"run-{i}.txt").write_text(
                    f"returncode {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
            else:
                subprocess.run(["rm", "-rf", str(work)], check=False)
            print(json.dumps({"run": i, "start_method": args.start_method, "order": order, "rc": proc.returncode,
                              "s": round(elapsed, 1), "load": os.getloadavg()[0]}), flush=True)
    finally:
        for p in busy:
            p.kill()
            p.join()
    print(json.dumps({"runs": args.runs, "failed": failed, "start_method": args.start_method,
                      "malloc_check": args.malloc_check}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
