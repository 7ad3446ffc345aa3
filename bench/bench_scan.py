"""Audit throughput and peak memory against a plain read of the same bytes, measured in the same run.

    .venv/bin/python bench/bench_scan.py                # 2 GiB, torch.save, genuine fp32 and bf16-rounded
    .venv/bin/python bench/bench_scan.py --gib 4 --format safetensors --repeat 3

Writes a checkpoint of many fp32 tensors (16 MiB each) into a temporary directory, then, each in a fresh child
process (so peak RSS is the measurement's own): a plain sequential read of the files (1 MiB ``readinto``, what
``cat > /dev/null`` does) and ``ckptaudit.auditing.judge.run_audit`` of the checkpoint. Both read from the page cache (the
file was just written), so the ratio compares CPU work, not the disk. Prints throughput, the ratio, and peak
RSS growth over the child's start-up footprint.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from common import proc_status

TENSOR_MIB = 16



def write_checkpoint(path: str, gib: float, fmt: str, rounded: bool) -> int:
    import torch

    n = int(gib * 1024 / TENSOR_MIB)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(n):
        t = torch.randn(TENSOR_MIB * 1024 * 256, generator=g).reshape(1024, -1)
        if rounded:
            t = t.bfloat16().float()
        tensors[f"layers.{i}.weight"] = t
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, path)
    elif fmt == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": tensors}, checkpoint_id=path)
        return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    else:
        torch.save({"model": tensors}, path)
    return os.path.getsize(path)


def child_read(path: str) -> dict[str, float]:
    base = proc_status("VmRSS")
    buf = bytearray(1 << 20)
    mv = memoryview(buf)
    t = time.perf_counter()
    total = 0
    files = [os.path.join(path, f) for f in sorted(os.listdir(path))] if os.path.isdir(path) else [path]
    for name in files:
        with open(name, "rb", buffering=0) as fh:
            while True:
                n = fh.readinto(mv)
                if not n:
                    break
                total += n
    secs = time.perf_counter() - t
    return {"seconds": secs, "bytes": total, "peak_growth": proc_status("VmHWM") - base}


def child_audit(path: str) -> dict[str, float]:
    import torch
    import torch.distributed.checkpoint as dcp

    from ckptaudit.auditing.judge import run_audit

    warm = os.path.join(os.path.dirname(os.path.abspath(path)), "warm")
    torch.save({"model": {"w": torch.ones(4)}}, warm + ".pt")
    dcp.save({"model": {"w": torch.ones(4)}}, checkpoint_id=warm + "-dcp")
    for p in (warm + ".pt", warm + "-dcp"):  # first-call imports happen here, not in the timed run
        run_audit(p)
    base = proc_status("VmRSS")
    t = time.perf_counter()
    report = run_audit(path)
    secs = time.perf_counter() - t
    return {"seconds": secs, "peak_growth": proc_status("VmHWM") - base,
            "tensors": len(report.tensors), "findings": len(report.findings)}


def run_child(kind: str, path: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--child", kind, path], check=True, capture_output=True,
                         text=True)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--format", choices=["torch", "safetensors", "dcp"], default="torch")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--child", nargs=2, metavar=("KIND", "PATH"))
    args = ap.parse_args()
    if args.child:
        kind, path = args.child
        print(json.dumps(child_read(path) if kind == "read" else child_audit(path)))
        return
    tmp = tempfile.mkdtemp(prefix="ckptaudit-bench-")
    try:
        for rounded in (False, True):
            path = os.path.join(tmp, {"safetensors": "ckpt.safetensors", "dcp": "ckpt-dcp"}.get(args.format, "ckpt.pt"))
            size = write_checkpoint(path, args.gib, args.format, rounded)
            reads, audits = [], []
            for _ in range(args.repeat):
                reads.append(run_child("read", path))
                audits.append(run_child("audit", path))
            read = min(reads, key=lambda r: r["seconds"])
            aud = min(audits, key=lambda r: r["seconds"])
            label = "bf16-rounded fp32" if rounded else "genuine fp32"
            gbps_read = size / read["seconds"] / 1e9
            gbps_audit = size / aud["seconds"] / 1e9
            print(f"{args.format}, {size / 2**30:.2f} GiB, {int(aud['tensors'])} tensors, {label} "
                  f"({int(aud['findings'])} findings), best of {args.repeat}:")
            print(f"  plain read : {gbps_read:6.2f} GB/s   peak RSS growth {read['peak_growth'] / 2**20:7.1f} MiB")
            print(f"  audit      : {gbps_audit:6.2f} GB/s   peak RSS growth {aud['peak_growth'] / 2**20:7.1f} MiB")
            print(f"  ratio audit/read: {gbps_audit / gbps_read:.2f}x")
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
