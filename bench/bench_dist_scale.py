"""A 1024-rank DCP save audited by 1, 2 and 4 local ranks: the metadata phase per rank, peak memory per rank, and
the report against a single-process audit, measured in the same run.

    .venv/bin/python bench/bench_dist_scale.py                          # 1024 ranks, 2 layers of a 1024-wide Llama
    .venv/bin/python bench/bench_dist_scale.py --auditors 1,2,4 --sim-args="--ranks 1024 --layers 8"
    .venv/bin/python bench/bench_dist_scale.py --ckpt /data/sim-1024    # a save written before by bench/sim_dcp.py

The checkpoint is ``bench/sim_dcp.py``'s (real torch ``Metadata`` pickled by torch, one sparse ``.distcp`` per
rank; ``--sim-args`` are its arguments). For each number of auditing ranks ``N`` (real processes, real gloo, the
same ``launch`` the tests use), two runs:

- ``walk``: each rank opens and interprets the checkpoint itself (``plan_scan``: the ``.metadata`` opcode walk,
  torch-free rebuild, layout): the metadata phase of every rank before ckptaudit vetted once (the plain baseline);
- ``audit``: ``audit_distributed`` (rank 0 vets and plans once and sends each rank its share); per rank, the
  metadata phase (rank 0: ``plan`` + ``send``; others: ``receive`` + ``check`` + ``decode``, where ``receive``
  includes waiting for rank 0's plan), the scan, the bytes of the share received, and peak resident memory
  over the rank's own before the audit began (``VmHWM``; torch imported, nothing of the checkpoint read).

CPU seconds (``time.process_time``) are the cost; wall seconds on a shared 2-core machine are mostly waiting for
the cores. The single-process audit (``python -m ckptaudit audit --format json``) runs in a child whose peak
memory is read from ``wait4``; every ``N``'s report must equal it (apart from nothing: the same bytes).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any

from ckptaudit.launch import RankContext, launch


def _hwm_mib() -> float:
    from common import proc_status

    return proc_status("VmHWM") / 2**20


def rank_job(ctx: RankContext, path: str, mode: str) -> dict[str, Any]:
    """(all ranks) ``mode`` ``walk``: this rank's own ``plan_scan``; ``audit``: ``audit_distributed`` with phase
    figures. Returns the figures (and rank 0's JSON report)."""
    from ckptaudit.auditing.distributed import audit_distributed
    from ckptaudit.auditing.judge import AuditOptions
    from ckptaudit.auditing.plan import plan_scan
    from ckptaudit.report import OutputFormat, render

    base = _hwm_mib()
    out: dict[str, Any] = {"rank": ctx.rank, "base_mib": round(base, 1)}
    if mode == "walk":
        w, c = time.perf_counter(), time.process_time()
        plan = plan_scan(path)
        out.update(meta_s=time.perf_counter() - w, meta_cpu_s=time.process_time() - c, items=len(plan.items))
        plan.close()
        out["peak_over_mib"] = round(_hwm_mib() - base, 1)
        return out
    stats: dict[str, float] = {}
    report = audit_distributed(path, AuditOptions(jobs=1), rank=ctx.rank, world_size=ctx.world_size,
                               timeout_s=3600, stats=stats)
    meta = ("plan", "send", "check") if ctx.rank == 0 else ("receive", "check", "decode")
    out.update(meta_s=sum(stats.get(f"{p}_s", 0.0) for p in meta),
               meta_cpu_s=sum(stats.get(f"{p}_cpu_s", 0.0) for p in meta),
               meta_peak_over_mib=round(max(stats.get(f"{p}_maxrss_mib", 0.0) for p in meta) - base, 1),
               peak_over_mib=round(_hwm_mib() - base, 1), stats=stats)
    if report is not None:
        buf = io.StringIO()
        render(report, OutputFormat.JSON, buf)
        out["report"] = json.loads(buf.getvalue())
    return out


def single(path: str) -> dict[str, Any]:
    """The single-process audit in a child: its JSON report, wall and CPU seconds, peak memory (MiB)."""
    w = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ckptaudit", "audit", path, "--format", "json", "--no-progress",
                             "--jobs", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    stdout, stderr = proc.stdout.read(), proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"single-process audit exited {proc.returncode}: {stderr.decode()[-2000:]}")
    return {"report": json.loads(stdout), "wall_s": time.perf_counter() - w,
            "cpu_s": usage.ru_utime + usage.ru_stime, "peak_mib": usage.ru_maxrss / 1024}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", help="a checkpoint bench/sim_dcp.py wrote (default: write one with --sim-args)")
    ap.add_argument("--sim-args", default="--ranks 1024 --layers 2 --hidden 1024 --ffn 3584 --vocab 32768 --kv 256",
                    help="bench/sim_dcp.py's arguments (default: %(default)s)")
    ap.add_argument("--auditors", default="1,2,4", help="numbers of auditing ranks (default: %(default)s)")
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args(argv)
    import sim_dcp

    tmp = None
    path = args.ckpt
    info: dict[str, Any] = {}
    if path is None:
        tmp = tempfile.mkdtemp(prefix="bench-dist-scale-")
        path = os.path.join(tmp, "sim")
        buf = io.StringIO()
        stdout, sys.stdout = sys.stdout, buf
        try:
            sim_dcp.main(["--out", path, *shlex.split(args.sim_args)])
        finally:
            sys.stdout = stdout
        info = json.loads(buf.getvalue())
        print(f"checkpoint: {info['ranks']} ranks, {info['tensors']} tensors in {info['items']} items, .metadata "
              f"{info['metadata_bytes'] / 1e6:.1f} MB, {info['logical_bytes'] / 1e9:.2f} GB of tensors "
              f"({info['disk_bytes'] / 1e6:.0f} MB on disk), written in {info['seconds']} s", flush=True)
    one = single(path)
    print(f"single process: {one['cpu_s']:.1f} s CPU, {one['wall_s']:.1f} s wall, peak {one['peak_mib']:.0f} MiB",
          flush=True)
    fast: dict[str, Any] = {"start_method": "forkserver",
                            "preload": ("torch", "torch.distributed", "ckptaudit.auditing.plan",
                                        "ckptaudit.auditing.distributed", "bench_dist_scale")}
    figures: dict[str, Any] = {"checkpoint": info, "single": {k: v for k, v in one.items() if k != "report"},
                               "runs": []}
    print(f"{'N':>2} {'mode':5} {'rank':>4} {'meta CPU s':>10} {'meta wall s':>11} {'scan CPU s':>10} "
          f"{'share KB':>9} {'peak+ MiB':>9}")
    for n in [int(x) for x in args.auditors.split(",")]:
        for mode in ("walk", "audit"):
            results = launch(rank_job, n, (path, mode), timeout_s=7200, pg_timeout_s=3600, **fast)
            for r in results:
                st = r.get("stats", {})
                shared = st.get("received_bytes", st.get("sent_bytes", 0.0)) if mode == "audit" else 0
                scan = st.get("scan_cpu_s", 0.0)
                print(f"{n:>2} {mode:5} {r['rank']:>4} {r['meta_cpu_s']:>10.2f} {r['meta_s']:>11.2f} {scan:>10.2f} "
                      f"{shared / 1e3:>9.0f} {r['peak_over_mib']:>9.1f}", flush=True)
            if mode == "audit":
                report = results[0].pop("report")
                same = report == one["report"]
                print(f"   N={n}: report {'identical to' if same else 'DIFFERS from'} the single-process audit",
                      flush=True)
                if not same:
                    return 1
            figures["runs"].append({"n": n, "mode": mode, "ranks": results})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=1)
    if tmp is not None:
        import shutil

        shutil.rmtree(tmp)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
