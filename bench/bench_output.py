"""What writing the report costs, against the audit itself, in the same run: the table, the ``--verbose`` table
(every tensor, every finding), JSON and HTML, for checkpoints of 10k, 100k and 200k tensors.

    .venv/bin/python bench/bench_output.py                                   # 10k, 100k, 200k tensors, 3 rounds
    .venv/bin/python bench/bench_output.py --tensors 10000,100000 --repeat 5
    .venv/bin/python bench/bench_output.py --dir /tmp/out-bench --keep       # write once, reuse in later runs

Each checkpoint is a ``torch.save`` file of tensors of 16-64 fp32 values named like per-expert weights (as in
``bench_many_tensors.py``), in two kinds: ``clean`` (random values: the report's bulk is the tensor list) and
``rounded`` (every tensor rounded to bf16 and stored as fp32: one ``precision.bf16-rounded`` finding per tensor, so
``--verbose`` also lists that many findings, each message wrapped over lines). Each round, in fresh child
processes:

- in one child: ``ckptaudit.auditing.judge.run_audit`` of the checkpoint (after a warm-up audit of a small file), then each
  renderer (table, verbose table, JSON, HTML) writing that report to a file, each timed; the ratio is the
  renderer's time over the audit's;
- the whole command, start-up included, stdout to a file: ``ckptaudit audit CKPT`` (the plain table), with
  ``--verbose``, ``--format json`` and ``--format html``; the ratio is each over the plain command's time. The
  target: ``audit --verbose`` within 2x the plain audit at 100k tensors.

Prints the median of the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

RENDERS = ("table", "verbose", "json", "html")


def write(path: str, tensors: int, rounded: bool) -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    sizes = (16, 32, 64)
    state = {}
    for i in range(tensors):
        t = torch.randn(sizes[i % 3], generator=g)
        state[f"layers.{i // 192}.experts.{i // 3 % 64}.w{i % 3}"] = t.to(torch.bfloat16).float() if rounded else t
    torch.save({"model": state}, path)


def child(path: str, out_dir: str) -> dict[str, Any]:
    """The audit, then each renderer on its report, timed in this process."""
    from ckptaudit.auditing.judge import run_audit
    from ckptaudit.report import OutputFormat, render

    warm = os.path.join(out_dir, "warm.pt")
    write(warm, 30, rounded=True)
    for fmt in OutputFormat:
        with open(os.devnull, "w") as fh:
            render(run_audit(warm), fmt, fh, verbose=True)
    t = time.perf_counter()
    report = run_audit(path)
    result: dict[str, Any] = {"audit": time.perf_counter() - t, "tensors": len(report.tensors),
                              "findings": len(report.findings)}
    for name in RENDERS:
        fmt = OutputFormat.TABLE if name == "verbose" else OutputFormat(name)
        target = os.path.join(out_dir, f"report.{name}")
        t = time.perf_counter()
        with open(target, "w", encoding="utf-8") as fh:
            render(report, fmt, fh, verbose=name == "verbose")
        result[name] = time.perf_counter() - t
        result[f"{name}_mib"] = os.path.getsize(target) / 2**20
    return result


def run_child(path: str, out_dir: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--child", path, out_dir], check=True, capture_output=True,
                         text=True)
    result: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return result


CLI = {"table": [], "verbose": ["--verbose"], "json": ["--format", "json"], "html": ["--format", "html"]}


def cli(path: str, flags: list[str], out_dir: str) -> float:
    """``ckptaudit audit PATH FLAGS`` as a whole process, its report written to a file: wall seconds."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    with open(os.path.join(out_dir, "cli.out"), "w") as out:
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "ckptaudit", "audit", path, *flags], env=env, stdout=out,
                              stderr=subprocess.PIPE, text=True, check=False)
        secs = time.perf_counter() - t
    if proc.returncode not in (0, 1):
        raise SystemExit(f"ckptaudit audit {path} {' '.join(flags)}: exit code {proc.returncode}\n{proc.stderr}")
    return secs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", default="10000,100000,200000", help="comma-separated tensor counts")
    ap.add_argument("--kinds", default="clean,rounded", help="clean and/or rounded")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", help="scratch directory (default: a new temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints in --dir and reuse them")
    ap.add_argument("--child", nargs=2, metavar=("PATH", "OUT_DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    if args.keep and not args.dir:
        ap.error("--keep needs --dir")
    root = args.dir or tempfile.mkdtemp(prefix="ckptaudit-bench-output-", dir="/tmp")
    os.makedirs(root, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="ckptaudit-bench-output-reports-", dir="/tmp")
    try:
        print(f"median of {args.repeat} rounds, load average {os.getloadavg()[0]:.1f} at the start, "
              f"{os.cpu_count()} cores")
        print()
        print("In process: the audit, then each renderer writing its report to a file (ratio: renderer / audit).")
        print()
        print("| tensors | kind | findings | audit | table | --verbose table | JSON | HTML |")
        print("|---|---|---|---|---|---|---|---|")
        whole: list[str] = []
        for count in (int(n) for n in args.tensors.split(",")):
            for kind in args.kinds.split(","):
                path = os.path.join(root, f"{kind}-{count}.pt")
                if not os.path.exists(path + ".written"):
                    write(path, count, rounded=kind == "rounded")
                    open(path + ".written", "w").close()
                rounds = []
                clis: dict[str, list[float]] = {name: [] for name in CLI}
                for _ in range(args.repeat):
                    rounds.append(run_child(path, scratch))
                    for name, flags in CLI.items():
                        clis[name].append(cli(path, flags, scratch))
                med = {k: statistics.median(r[k] for r in rounds) for k in ("audit", *RENDERS)}
                size = {k: rounds[0][f"{k}_mib"] for k in RENDERS}
                cells = [f"{med[k]:.2f} s ({med[k] / med['audit']:.2f}x, {size[k]:.1f} MiB)" for k in RENDERS]
                print(f"| {count:,} | {kind} | {rounds[0]['findings']:,} | {med['audit']:.2f} s | "
                      + " | ".join(cells) + " |", flush=True)
                c = {k: statistics.median(v) for k, v in clis.items()}
                whole.append(f"| {count:,} | {kind} | {c['table']:.2f} s | {c['verbose']:.2f} s "
                             f"(**{c['verbose'] / c['table']:.2f}x**) | {c['json']:.2f} s "
                             f"({c['json'] / c['table']:.2f}x) | {c['html']:.2f} s ({c['html'] / c['table']:.2f}x) |")
        print()
        print("The whole command, start-up included, report written to a file (ratio: over the plain `audit`).")
        print()
        print("| tensors | kind | `audit` | `audit --verbose` | `--format json` | `--format html` |")
        print("|---|---|---|---|---|---|")
        print("\n".join(whole))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
