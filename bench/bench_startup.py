"""``ckptaudit audit`` of a small file as a whole process, against ``python -c pass``, before and after in one run.

    git archive REV src | (mkdir -p scratch/before && tar -x -C scratch/before)   # REV: the code before the change
    chrt -f 10 .venv/bin/python bench/bench_startup.py --before scratch/before/src --runs 30
    .venv/bin/python bench/bench_startup.py --importtime 10                      # where the imports' time goes

Writes a tiny model with its AdamW state after one step (``torch.save``, ~8 KB) into a temporary directory, compiles
each tree's bytecode (a user's installed package has it), then runs ``--runs`` rounds, each of ``python -c pass``
(the machine's own start-up: its load shows there) and ``python -m ckptaudit audit FILE`` with this checkout's
``src`` and, given ``--before``, that tree's, output to ``/dev/null``. Prints the median and best wall time and the
median CPU time (user + system) of each, with the load average. ``--importtime N``: also ``N`` runs of each tree
under ``python -X importtime``, and per module the minimum of its own import time over them: their sum, and the
modules that differ most between the trees.
"""

from __future__ import annotations

import argparse
import compileall
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def write_small(path: str) -> None:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)


def run_once(argv: list[str], src: str | None) -> tuple[float, float]:
    """(wall, CPU) seconds of one child process."""
    env = {**os.environ, **({"PYTHONPATH": src} if src else {})}
    t = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    _, _, usage = os.wait4(p.pid, 0)
    return time.perf_counter() - t, usage.ru_utime + usage.ru_stime


def import_minimums(path: str, src: str, runs: int) -> dict[str, int]:
    """Per module, the minimum of its own import time (microseconds) over ``runs`` runs."""
    best: dict[str, int] = {}
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-X", "importtime", "-m", "ckptaudit", "audit", path],
                             capture_output=True, text=True, env={**os.environ, "PYTHONPATH": src}, check=False)
        for line in out.stderr.splitlines():
            m = re.match(r"import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)", line)
            if m:
                best[m.group(2)] = min(best.get(m.group(2), 1 << 60), int(m.group(1)))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--before", metavar="SRC", help="also time this src tree, alternated with this checkout's")
    ap.add_argument("--runs", type=int, default=30, help="rounds (default 30)")
    ap.add_argument("--importtime", type=int, default=0, metavar="N", help="also N runs under -X importtime")
    args = ap.parse_args()
    trees = {"after": os.path.abspath(os.path.join(HERE, "..", "src")),
             **({"before": os.path.abspath(args.before)} if args.before else {})}
    for src in trees.values():
        compileall.compile_dir(src, quiet=1)
    with tempfile.TemporaryDirectory(prefix="ckptaudit-bench-startup-") as tmp:
        path = os.path.join(tmp, "small.pt")
        write_small(path)
        commands = {"python -c pass": ([sys.executable, "-c", "pass"], None),
                    **{k: ([sys.executable, "-m", "ckptaudit", "audit", path], src) for k, src in trees.items()}}
        for argv, src in commands.values():  # not counted: the first runs warm the files' pages
            run_once(argv, src)
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in commands}
        load = os.getloadavg()[0]
        for _ in range(args.runs):
            for name, (argv, src) in commands.items():
                times[name].append(run_once(argv, src))
        print(f"ckptaudit audit of a {os.path.getsize(path)}-byte torch.save file as a whole process, {args.runs} "
              f"rounds, load average {load:.1f} -> {os.getloadavg()[0]:.1f}")
        for name, t in times.items():
            wall, cpu = [w for w, _ in t], [c for _, c in t]
            print(f"  {name:15s} wall median {statistics.median(wall) * 1000:6.1f} ms (best {min(wall) * 1000:6.1f}), "
                  f"CPU median {statistics.median(cpu) * 1000:6.1f} ms")
        if args.importtime:
            mins = {k: import_minimums(path, src, args.importtime) for k, src in trees.items()}
            for k, m in mins.items():
                ours = sum(v for name, v in m.items() if name.startswith("ckptaudit"))
                print(f"  {k}: {len(m)} modules imported, their minimum times sum to {sum(m.values()) / 1000:.1f} ms "
                      f"(ckptaudit's own {ours / 1000:.1f} ms)")
            if "before" in mins:
                a, b = mins["after"], mins["before"]
                diff = sorted((a.get(n, 0) - b.get(n, 0), n) for n in set(a) | set(b))
                print("  most gained:", ", ".join(f"{n} {d / 1000:+.2f} ms" for d, n in diff[:10]))
                print("  most lost:  ", ", ".join(f"{n} {d / 1000:+.2f} ms" for d, n in diff[-5:]))


if __name__ == "__main__":
    main()
