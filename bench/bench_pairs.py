"""Before and after on a shared machine: the realistic audit of two source trees, alternated in fresh child
processes, with a 2-thread read of the same bytes in every round.

    git archive REV src | (mkdir -p scratch/before && tar -x -C scratch/before)   # REV: the code before the change
    .venv/bin/python bench/bench_pairs.py --before scratch/before/src --scale 0.5 --format torch.save --dir scratch
    .venv/bin/python bench/bench_pairs.py --before scratch/before/src --scale 0.5 --format safetensors --dir scratch

Writes the checkpoint of ``bench_realistic.py`` (same state, same format names) once into ``--dir`` and reuses it
(delete it to write it again). Each round runs ``bench_realistic.py --child read PATH 2`` (the 2-thread mapped
read) and ``--child audit PATH J`` once with ``--before``'s package and once with this checkout's, in alternating
order, so that both see the same machine: on a machine shared with other jobs, a before/after pair from one
run is worth more than two runs' best figures. Prints best and median of each, and the median over rounds of
the ratio of the audit's speed to the read's (each audit against the read of its own round), with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench_realistic import write  # this directory: the script's own (torch is imported by write alone)

HERE = os.path.dirname(os.path.abspath(__file__))
REALISTIC = os.path.join(HERE, "bench_realistic.py")
NAMES = {"torch.save": "ckpt.pt", "safetensors": "model.safetensors"}


def child(src: str, *argv: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    out = subprocess.run([sys.executable, REALISTIC, "--child", *argv], capture_output=True, text=True, env=env,
                         check=True, timeout=3600)
    result: dict[str, float] = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--before", required=True, help="the src directory of the package to compare against")
    ap.add_argument("--after", default=os.path.join(HERE, "..", "src"), help="default: this checkout's src")
    ap.add_argument("--format", choices=sorted(NAMES), default="torch.save")
    ap.add_argument("--scale", type=float, default=0.5)
    ap.add_argument("--jobs", default="2", help="audit threads (default 2)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--dir", required=True, help="where the checkpoint is written once and kept")
    args = ap.parse_args()
    path = os.path.join(args.dir, f"pairs-scale-{args.scale}", NAMES[args.format])
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write(args.format, path + ".part", args.scale)
        os.replace(path + ".part", path)
    trees = {"before": args.before, "after": args.after}
    runs: dict[str, list[float]] = {"read": [], "before": [], "after": []}
    loads = []
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        runs["read"].append(child(args.after, "read", path, "2")["seconds"])
        for which in ("before", "after") if r % 2 == 0 else ("after", "before"):
            runs[which].append(child(trees[which], "audit", path, args.jobs)["seconds"])
    size = os.path.getsize(path)
    print(f"{args.format} --scale {args.scale}: {size / 1e9:.2f} GB, audit -j {args.jobs}, {args.rounds} rounds, "
          f"load average {min(loads):.1f}-{max(loads):.1f}")
    for name, secs in runs.items():
        print(f"  {name:6s} best {min(secs):.3f} s ({size / min(secs) / 1e9:.1f} GB/s), "
              f"median {statistics.median(secs):.3f} s")
    for which in ("before", "after"):
        ratios = [read / audit for read, audit in zip(runs["read"], runs[which], strict=True)]
        print(f"  {which}: audit speed / read speed, median of rounds {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
