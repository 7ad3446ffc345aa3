"""What ``ckptaudit latest`` costs at each ``--verify`` level on the realistic checkpoint, against a plain read of
the same bytes measured in the same run.

    .venv/bin/python bench/bench_latest.py --scale 0.1          # ~0.43 GB per format (development)
    .venv/bin/python bench/bench_latest.py                      # full size: 355 M params + AdamW, ~4.26 GB

The checkpoint is ``bench_realistic.py``'s (GPT-2 medium's 1168 tensors: fp32 parameters and one real AdamW step),
written as the only candidate under a run directory, once as ``torch.save`` (``step=1.ckpt``, a Lightning-named
file) and once as a single-process DCP directory (``step-1/``), one format at a time. Measured in a fresh child
process per format, right after the write (so from the page cache where memory holds the files), in ``--repeat``
rounds of: ``read`` (every byte xor-reduced through read-only maps by 2 threads: what reading the bytes costs at
best), then :func:`ckptaudit.latest.find_latest` with ``verify`` ``sizes``, ``hashes`` (integrity only;
without a ckptaudit manifest there are no hashes to verify, so no tensor byte is read), ``quick`` (the default: a
quick audit, the first 64 KiB of every tensor) and ``full`` (the whole audit). Each level's figure is the median
of the rounds' ratios to that round's read (the host's drifting speed mostly cancels out of it), with the best
round's seconds beside it. Then a copy of the checkpoint with every parameter rounded to bf16 values is checked
on defaults: it must be rejected (``latest`` names no candidate).
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

from bench_realistic import child_read, size_of, write

LEVELS = ("sizes", "hashes", "quick", "full")
NAMES = {"torch.save": "step=1.ckpt", "dcp-1": "step-1"}


def child(root: str, candidate: str, repeat: int) -> dict[str, Any]:
    """(fresh process) ``repeat`` rounds of the read and every level; the rounded copy on defaults."""
    from ckptaudit.latest import find_latest

    find_latest(root, verify="quick")  # first-call imports and set-up, outside the timed rounds
    rounds = []
    for _ in range(repeat):
        r = {"read": child_read(candidate, 2)["seconds"]}
        for level in LEVELS:
            t0 = time.perf_counter()
            result = find_latest(root, verify=level)
            r[level] = time.perf_counter() - t0
            assert result.latest is not None, (level, [c.reason for c in result.checked])
        rounds.append(r)
    return {"rounds": rounds}


def rounded_rejected(root: str) -> bool:
    from ckptaudit.latest import find_latest

    return find_latest(root).latest is None


def round_copy(fmt: str, src: str, dst: str) -> None:
    """A copy of the checkpoint whose parameters are rounded to bf16 values (the exporter bug), written by torch."""
    import warnings

    import torch

    if fmt == "torch.save":
        state = torch.load(src, weights_only=True)
        state["model"] = {k: v.bfloat16().float() for k, v in state["model"].items()}
        torch.save(state, dst)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = dst + ".flat.pt"
    dcp_to_torch_save(src, flat)
    state = torch.load(flat, weights_only=False)  # written just above by torch from our own benchmark files
    os.remove(flat)
    state["model"] = {k: v.bfloat16().float() for k, v in state["model"].items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=dst)


def run(*argv: str) -> Any:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *argv], capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-4000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="bytes relative to the full 4.26 GB (default 1)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds per format (default 3)")
    ap.add_argument("--formats", default="torch.save,dcp-1")
    ap.add_argument("--dir", help="scratch directory (default: a new temporary one, removed)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        what, *rest = args.child
        if what == "measure":
            print(json.dumps(child(rest[0], rest[1], int(rest[2]))))
        elif what == "rounded":
            print(json.dumps({"rejected": rounded_rejected(rest[0])}))
        return
    tmp = args.dir or tempfile.mkdtemp(prefix="ckptaudit-bench-latest-")
    rows = []
    try:
        for fmt in args.formats.split(","):
            root = os.path.join(tmp, f"run-{fmt}")
            os.makedirs(root, exist_ok=True)
            path = os.path.join(root, NAMES[fmt])
            write(fmt, path, args.scale)
            measured = run("measure", root, path, str(args.repeat))["rounds"]
            bad_root = os.path.join(tmp, f"rounded-{fmt}")
            os.makedirs(bad_root, exist_ok=True)
            round_copy(fmt, path, os.path.join(bad_root, NAMES[fmt]))
            rejected = run("rounded", bad_root)["rejected"]
            rows.append({"format": fmt, "bytes": size_of(path), "rounds": measured, "rounded_rejected": rejected})
            shutil.rmtree(root)
            shutil.rmtree(bad_root)
    finally:
        if not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"ckptaudit latest on the realistic checkpoint (scale {args.scale}, best of {args.repeat} rounds; "
          "x read: median of the rounds' ratios to a 2-thread read of the same bytes)\n")
    print("| format | size | read | " + " | ".join(f"--verify {lv}" for lv in LEVELS) + " | rounded copy rejected |")
    print("|---|---|---|" + "---|" * len(LEVELS) + "---|")
    for row in rows:
        rs = row["rounds"]
        read = min(r["read"] for r in rs)
        cells = [f"{min(r[lv] for r in rs):.2f} s ({statistics.median(r[lv] / r['read'] for r in rs):.2f}x read)"
                 for lv in LEVELS]
        print(f"| {row['format']} | {row['bytes'] / 1e9:.2f} GB | {read:.2f} s | " + " | ".join(cells)
              + f" | {'yes' if row['rounded_rejected'] else 'NO'} |")


if __name__ == "__main__":
    main()
