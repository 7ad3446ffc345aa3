"""Audit of checkpoints of very many small tensors, against the library's own load of the same checkpoint, in
the same run.

    .venv/bin/python bench/bench_many_tensors.py                             # 200k tensors, 3 rounds
    .venv/bin/python bench/bench_many_tensors.py --tensors 20000 --repeat 5
    .venv/bin/python bench/bench_many_tensors.py --dir /tmp/many --keep      # write once, reuse in later runs

A mixture-of-experts model's full training state holds 10^5 tensors and more (one per expert weight and
optimizer moment); at that count the per-tensor work (pickle opcodes, DCP items, records, the report) costs more
than the bytes, which ``bench_realistic.py`` (1168 tensors) does not show. This writes a ``torch.save`` file and
a one-process ``torch.distributed.checkpoint`` save of ``--tensors`` tensors of 4-64 fp32 values, named like
per-expert weights, and then, each round in fresh child processes, one after the other:

- the baseline: ``torch.load(weights_only=True)`` of the ``torch.save`` file, ``torch.distributed.checkpoint.load``
  of the DCP save into a state dict of the right shapes (made before the clock starts);
- ``ckptaudit.audit`` of the same checkpoint (every tensor hashed and judged), after a warm-up audit of a small
  file in the same child (imports and first-call set-up excluded, as from the baseline's);
- ``ckptaudit audit --format json`` as a whole process (start-up and writing the report included).

Prints the median of the rounds: seconds, microseconds per tensor, the ratio load / audit (above 1: the audit
takes less time than loading the checkpoint), and each child's peak RSS.
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
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def state(tensors: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    sizes = (4, 16, 64)
    return {f"layers.{i // 192}.experts.{i // 3 % 64}.w{i % 3}": torch.randn(sizes[i % 3], generator=g)
            for i in range(tensors)}


def write(kind: str, path: str, tensors: int) -> None:
    import torch

    if kind == "torch.save":
        torch.save({"model": state(tensors)}, path)
        return
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": a one-process save is what we want
        dcp.save({"model": state(tensors)}, checkpoint_id=path)


def child_load(kind: str, path: str) -> dict[str, Any]:
    import torch

    if kind == "torch.save":
        t = time.perf_counter()
        torch.load(path, weights_only=True)
        return {"seconds": time.perf_counter() - t}
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reader = dcp.FileSystemReader(path)
        md = reader.read_metadata()  # (outside the clock: only to make the destination)
        target = {"model": {k.split(".", 1)[1]: torch.empty(tuple(m.size))  # type: ignore[union-attr]
                            for k, m in md.state_dict_metadata.items()}}
        t = time.perf_counter()
        dcp.load(target, checkpoint_id=path)
    return {"seconds": time.perf_counter() - t}


def child_audit(kind: str, path: str) -> dict[str, Any]:
    from ckptaudit.auditing.judge import run_audit

    warm = tempfile.mkdtemp(prefix="ckptaudit-bench-warm-")
    try:
        small = os.path.join(warm, "small.pt" if kind == "torch.save" else "small")
        write(kind, small, 30)
        run_audit(small)
    finally:
        shutil.rmtree(warm, ignore_errors=True)
    t = time.perf_counter()
    report = run_audit(path)
    secs = time.perf_counter() - t
    bad = [f.code for f in report.findings if f.code.startswith(("integrity", "security"))]
    return {"seconds": secs, "tensors": len(report.tensors), "refused": bad}


def run_child(*argv: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--child", *argv], check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return result


def cli(path: str) -> dict[str, Any]:
    """``ckptaudit audit --format json`` as a whole process: wall time and peak RSS."""
    env = dict(os.environ)
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ckptaudit", "audit", path, "--format", "json"], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    secs = time.perf_counter() - t
    if proc.returncode not in (0, 1):
        raise SystemExit(f"ckptaudit audit {path}: exit code {proc.returncode}")
    return {"seconds": secs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--formats", default="torch.save,dcp")
    ap.add_argument("--dir", help="scratch directory (default: a new temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints in --dir and reuse them")
    ap.add_argument("--child", nargs=3, metavar=("WHAT", "KIND", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        what, kind, path = args.child
        result = child_load(kind, path) if what == "load" else child_audit(kind, path)
        result["maxrss_mib"] = _maxrss_mib()
        print(json.dumps(result))
        return 0
    if args.keep and not args.dir:
        ap.error("--keep needs --dir")
    root = args.dir or tempfile.mkdtemp(prefix="ckptaudit-bench-many-", dir="/tmp")
    os.makedirs(root, exist_ok=True)
    try:
        print(f"{args.tensors} tensors of 4-64 fp32 values, median of {args.repeat} rounds, load average "
              f"{os.getloadavg()[0]:.1f} at the start")
        print("| checkpoint | load (library) | ckptaudit.audit | per tensor | load / audit | CLI, --format json |")
        print("|---|---|---|---|---|---|")
        for kind in args.formats.split(","):
            path = os.path.join(root, f"{kind}-{args.tensors}" + (".pt" if kind == "torch.save" else ""))
            done = path + ".written"
            if not os.path.exists(done):
                write(kind, path, args.tensors)
                open(done, "w").close()
            loads, audits, clis = [], [], []
            for _ in range(args.repeat):
                loads.append(run_child("load", kind, path))
                audits.append(run_child("audit", kind, path))
                clis.append(cli(path))
            if audits[0]["refused"] or audits[0]["tensors"] != args.tensors:
                print(f"| {kind} | refused: {audits[0]['refused']} ({audits[0]['tensors']} tensors read) | | | | |")
                continue
            load_s = statistics.median(r["seconds"] for r in loads)
            audit_s = statistics.median(r["seconds"] for r in audits)
            cli_s = statistics.median(r["seconds"] for r in clis)
            print(f"| {kind} | {load_s:.1f} s, {max(r['maxrss_mib'] for r in loads):.0f} MiB | {audit_s:.1f} s, "
                  f"{max(r['maxrss_mib'] for r in audits):.0f} MiB | {audit_s / args.tensors * 1e6:.0f} us | "
                  f"{load_s / audit_s:.2f}x | {cli_s:.1f} s |")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


def _maxrss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    sys.exit(main())
