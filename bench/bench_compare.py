"""``ckptaudit compare`` throughput and peak memory against a plain read of both checkpoints, in the same run.

    .venv/bin/python bench/bench_compare.py                  # 2 x 2 GiB: DCP reference, torch.save candidates
    .venv/bin/python bench/bench_compare.py --gib 4 --repeat 5 --ref-format torch --threads 1
    .venv/bin/python bench/bench_compare.py --realistic 1.0 --dir scratch --before scratch/before/src --repeat 5

Writes into a temporary directory on /tmp (deleted at the end) a reference checkpoint of many fp32 tensors
(16 MiB each; a ``torch.distributed.checkpoint`` directory by default, the common case) and candidates of the
same size as ``torch.save`` files:

- ``bf16-rounded``: every tensor rounded to bf16 (round-to-nearest-even) and stored as fp32 -- every pair's
  hashes differ, so every byte of both sides goes through the element-wise pass (the worst case);
- ``identical``: the same values -- the hashes decide, no element-wise pass.

Then, each in a fresh child process (so that peak memory is the measurement's own): a plain sequential read of
both checkpoints' files (1 MiB ``readinto``, what ``cat > /dev/null`` does) and ``ckptaudit.comparing.run_compare``.
Both read from the page cache (the files were just written), so the ratio compares CPU work, not the disk.
Prints throughput over the bytes of both checkpoints, the ratio, and the growth of peak RSS (``VmHWM``) and of
anonymous memory (``RssAnon``, sampled every 5 ms: mapped file pages are reclaimable, anonymous ones are not)
over the child's footprint before the timed call.

``--realistic SCALE`` measures issue 39's goal instead: the realistic training state of ``bench_realistic.py``
(4.26 GB at scale 1) as one-file DCP (the reference) and as ``torch.save`` (the candidate), identical values,
written once into ``--dir`` and kept. Each round: ``bench_realistic.py``'s 2-thread mapped read of each
checkpoint (their sum: reading both), then the compare on 2 threads of this checkout and, with ``--before SRC``
(``git archive REV src | tar -x -C scratch/before``), of that tree, in alternating order, each in a fresh child
process; the ratio is the median of the rounds' own (read both / compare), with the load average.
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
from typing import Any

from common import AnonPeak, proc_status

HERE = os.path.dirname(os.path.abspath(__file__))

TENSOR_MIB = 16





def _tensors(gib: float, rounded: bool) -> Any:
    import torch

    n = max(1, int(gib * 1024 / TENSOR_MIB))
    numel = TENSOR_MIB * 1024 * 256 if gib >= TENSOR_MIB / 1024 else int(gib * 2**30 / 4)
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        t = torch.randn(numel, generator=g).reshape(1024, -1) * 0.02
        yield f"layers.{i}.weight", (t.bfloat16().float() if rounded else t)


def write(path: str, gib: float, fmt: str, rounded: bool) -> None:
    import torch

    state = {"model": dict(_tensors(gib, rounded))}
    if fmt == "dcp":
        import warnings

        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():  # single process, no process group: intended
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, checkpoint_id=path)
    else:
        torch.save(state, path)


def _files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(path, f) for f in os.listdir(path))


def size(path: str) -> int:
    return sum(os.path.getsize(f) for f in _files(path))


def child_read(ref: str, cand: str) -> dict[str, Any]:
    base_rss, base_anon = proc_status("VmRSS"), proc_status("RssAnon")
    buf = bytearray(1 << 20)
    mv = memoryview(buf)
    total = 0
    with AnonPeak() as anon:
        t = time.perf_counter()
        for f in _files(ref) + _files(cand):
            with open(f, "rb", buffering=0) as fh:
                while n := fh.readinto(mv):
                    total += n
        secs = time.perf_counter() - t
    return {"seconds": secs, "bytes": total, "rss_growth": proc_status("VmHWM") - base_rss,
            "anon_growth": anon.peak - base_anon}


def child_compare(ref: str, cand: str, threads: int) -> dict[str, Any]:
    from ckptaudit.comparing import CompareOptions, run_compare

    # First-call imports (torch.distributed for DCP, NumPy tables) happen here, not in the timed run.
    warm = os.path.join(os.path.dirname(cand), "warm")
    os.makedirs(warm, exist_ok=True)
    warm_ref = os.path.join(warm, "ref" if os.path.isdir(ref) else "ref.pt")
    write(warm_ref, 1 / 1024, "dcp" if os.path.isdir(ref) else "torch", rounded=False)
    write(os.path.join(warm, "cand.pt"), 1 / 1024, "torch", rounded=True)
    run_compare(warm_ref, os.path.join(warm, "cand.pt"))
    shutil.rmtree(warm)
    base_rss, base_anon = proc_status("VmRSS"), proc_status("RssAnon")
    with AnonPeak() as anon:
        t = time.perf_counter()
        report = run_compare(ref, cand, CompareOptions(threads=threads))
        secs = time.perf_counter() - t
    return {"seconds": secs, "bytes": size(ref) + size(cand), "rss_growth": proc_status("VmHWM") - base_rss,
            "anon_growth": anon.peak - base_anon, "summary": report.summary,
            "counts": report.extra["pair_counts"]}


def run_child(kind: str, ref: str, cand: str, threads: int = 2, src: str | None = None) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)} if src else None
    out = subprocess.run([sys.executable, __file__, "--child", kind, ref, cand, "--threads", str(threads)],
                         check=True, capture_output=True, text=True, env=env)
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def realistic(scale: float, directory: str, before: str | None, rounds: int) -> None:
    """Issue 39's measurement (the module's doc): read both, then compare, per round, before and after alternated."""
    import statistics

    from bench_realistic import write as write_realistic  # this directory: the realistic state

    ref, cand = os.path.join(directory, f"compare-scale-{scale}", "dcp-1"), os.path.join(
        directory, f"compare-scale-{scale}", "ckpt.pt")
    for fmt, path in (("dcp-1", ref), ("torch.save", cand)):
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_realistic(fmt, path + ".part", scale)
            os.replace(path + ".part", path)

    def read(path: str) -> float:
        out = subprocess.run([sys.executable, os.path.join(HERE, "bench_realistic.py"), "--child", "read", path, "2"],
                             check=True, capture_output=True, text=True)
        seconds: float = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1])["seconds"]
        return seconds

    trees = {"after": os.path.join(HERE, "..", "src"), **({"before": before} if before else {})}
    runs: dict[str, list[float]] = {"read both": [], **{k: [] for k in trees}}
    read(ref), read(cand)  # not counted: the first read after a write pays for the fresh pages
    loads = []
    for r in range(rounds):
        loads.append(os.getloadavg()[0])
        runs["read both"].append(read(ref) + read(cand))
        for which in sorted(trees, reverse=r % 2 == 1):
            runs[which].append(run_child("compare", ref, cand, 2, trees[which])["seconds"])
    total = size(ref) + size(cand)
    print(f"compare, realistic --scale {scale}: one-file DCP against torch.save, identical values, "
          f"{total / 1e9:.2f} GB in all, 2 threads, {rounds} rounds, load average {min(loads):.1f}-{max(loads):.1f}")
    for name, secs in runs.items():
        print(f"  {name:9s} median {statistics.median(secs):.3f} s ({total / statistics.median(secs) / 1e9:.1f} GB/s)"
              f", best {min(secs):.3f} s")
    for which in trees:
        ratios = [rd / c for rd, c in zip(runs["read both"], runs[which], strict=True)]
        print(f"  {which}: compare speed / speed of reading both, median of rounds {statistics.median(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0, help="size of each checkpoint (default 2)")
    ap.add_argument("--ref-format", choices=["dcp", "torch"], default="dcp")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--scenario", choices=["bf16-rounded", "identical", "both"], default="both")
    ap.add_argument("--threads", type=int, choices=[1, 2], default=2,
                    help="compare's threads (2: hashing overlaps the comparison; 1: all inline)")
    ap.add_argument("--realistic", type=float, metavar="SCALE",
                    help="instead: the realistic state, one-file DCP against torch.save (the module's doc)")
    ap.add_argument("--dir", help="with --realistic: where its checkpoints are written once and kept")
    ap.add_argument("--before", metavar="SRC", help="with --realistic: also compare with this src tree, alternated")
    ap.add_argument("--child", nargs=3, metavar=("KIND", "REF", "CAND"))
    args = ap.parse_args()
    if args.child:
        kind, ref, cand = args.child
        print(json.dumps(child_read(ref, cand) if kind == "read" else child_compare(ref, cand, args.threads)))
        return
    if args.realistic is not None:
        if not args.dir:
            ap.error("--realistic needs --dir (its checkpoints are written once and kept there)")
        realistic(args.realistic, args.dir, args.before, args.repeat)
        return
    tmp = tempfile.mkdtemp(prefix="ckptaudit-bench-compare-", dir="/tmp")
    try:
        ref = os.path.join(tmp, "reference" if args.ref_format == "dcp" else "reference.pt")
        write(ref, args.gib, args.ref_format, rounded=False)
        scenarios = ["bf16-rounded", "identical"] if args.scenario == "both" else [args.scenario]
        for scenario in scenarios:
            cand = os.path.join(tmp, f"candidate-{scenario}.pt")
            write(cand, args.gib, "torch", rounded=scenario == "bf16-rounded")
            reads, compares = [], []
            for _ in range(args.repeat):
                reads.append(run_child("read", ref, cand))
                compares.append(run_child("compare", ref, cand, args.threads))
            read = min(reads, key=lambda r: r["seconds"])
            cmp_ = min(compares, key=lambda r: r["seconds"])
            total = cmp_["bytes"]
            gbps_read = total / read["seconds"] / 1e9
            gbps_cmp = total / cmp_["seconds"] / 1e9
            n = int(args.gib * 1024 / TENSOR_MIB)
            print(f"{scenario} candidate: reference {args.ref_format} {size(ref) / 2**30:.2f} GiB + candidate "
                  f"torch.save {size(cand) / 2**30:.2f} GiB, {n} tensors each, threads={args.threads}, "
                  f"best of {args.repeat}:")
            print(f"  plain read of both : {gbps_read:6.2f} GB/s  {read['seconds']:6.2f} s   peak RSS "
                  f"+{read['rss_growth'] / 2**20:7.1f} MiB   anonymous +{read['anon_growth'] / 2**20:7.1f} MiB")
            print(f"  compare            : {gbps_cmp:6.2f} GB/s  {cmp_['seconds']:6.2f} s   peak RSS "
                  f"+{cmp_['rss_growth'] / 2**20:7.1f} MiB   anonymous +{cmp_['anon_growth'] / 2**20:7.1f} MiB")
            print(f"  ratio compare/read : {gbps_cmp / gbps_read:.2f}x")
            print(f"  summary: {cmp_['summary']}")
            os.remove(cand)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
