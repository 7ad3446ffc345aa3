"""What the resumable-checkpoint protocol costs over a plain ``torch.distributed.checkpoint`` save, same run.

    .venv/bin/python bench/bench_store.py               # 512 MiB of parameters (+ AdamW moments: 1.5 GiB saved)
    .venv/bin/python bench/bench_store.py --mib 128 --repeat 5

One process (DCP's single-process mode). A model of ``--mib`` MiB of fp32 parameters in 16 MiB layers, AdamW
stepped once so its two moments exist. Each repeat, alternating: a plain ``dcp.save`` of ``get_state_dict`` (with
DCP's default ``sync_files=True``) into a fresh directory, and :func:`ckptaudit.store.save_checkpoint` (the same
DCP save, plus hashing every tensor in memory, re-reading and hashing every file, the manifest, the fsyncs and the
rename), in alternating order, each after an ``os.sync()``. Then ``ckptaudit latest`` validation (manifest hashes) and the two loads. Prints medians, throughput
over the bytes written, and the ratios, in wall time (disk-bound, noisy on a shared disk) and in CPU time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

LAYER_MIB = 16


def build(mib: int) -> Any:
    import torch

    from ckptaudit.recipes import Job

    n = max(1, mib // LAYER_MIB)
    side = int((LAYER_MIB * 2**20 / 4) ** 0.5)
    model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(n)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, side)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return Job(model=model, optimizer=opt, step=1)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512, help="MiB of fp32 parameters (the save is ~3x: AdamW)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args(argv)

    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ckptaudit.latest import find_latest
    from ckptaudit.store import load_checkpoint, save_checkpoint

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(1)
    job = build(args.mib)
    base = tempfile.mkdtemp(prefix="bench-store-", dir=args.dir)
    plain_t: list[float] = []
    store_t: list[float] = []
    plain_cpu: list[float] = []
    store_cpu: list[float] = []
    latest_t: list[float] = []
    nbytes = 0
    try:
        for i in range(args.repeat):
            plain = os.path.join(base, f"plain-{i}")
            root = os.path.join(base, f"store-{i}")

            def plain_save(path: str = plain) -> None:
                msd, osd = get_state_dict(job.model, job.optimizer)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=True)

            def store_save(path: str = root) -> None:
                save_checkpoint(job, path)

            # Alternate which goes first, and start each from flushed dirty pages: the write-back of one save
            # must not be billed to the next.
            order = [(plain_save, plain_t, plain_cpu), (store_save, store_t, store_cpu)]
            for fn, times, cpu in order if i % 2 == 0 else order[::-1]:
                os.sync()
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            nbytes = dir_bytes(plain)
            t0 = time.perf_counter()
            assert find_latest(root).latest is not None
            latest_t.append(time.perf_counter() - t0)
            if i < args.repeat - 1:
                shutil.rmtree(plain)
                shutil.rmtree(root)
        t0 = time.perf_counter()
        msd, osd = get_state_dict(job.model, job.optimizer)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=plain, no_dist=True)
        plain_load = time.perf_counter() - t0
        t0 = time.perf_counter()
        load_checkpoint(job, root)
        store_load = time.perf_counter() - t0
    finally:
        shutil.rmtree(base, ignore_errors=True)
    p, s, la = statistics.median(plain_t), statistics.median(store_t), statistics.median(latest_t)
    pc, sc = statistics.median(plain_cpu), statistics.median(store_cpu)
    gb = nbytes / 1e9
    print(f"checkpoint: {nbytes / 2**30:.2f} GiB ({args.mib} MiB of fp32 parameters + AdamW moments), "
          f"median of {args.repeat}")
    print(f"plain dcp.save           {p:7.2f} s  {gb / p:6.2f} GB/s   CPU {pc:6.2f} s")
    print(f"save_checkpoint          {s:7.2f} s  {gb / s:6.2f} GB/s   CPU {sc:6.2f} s   ratio {s / p:.2f}x plain "
          f"(CPU {sc / pc:.2f}x)")
    print(f"ckptaudit latest (hash)  {la:7.2f} s  {gb / la:6.2f} GB/s")
    print(f"plain dcp.load           {plain_load:7.2f} s")
    print(f"load_checkpoint          {store_load:7.2f} s   ratio {store_load / plain_load:.2f}x plain "
          "(includes verifying every hash)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
