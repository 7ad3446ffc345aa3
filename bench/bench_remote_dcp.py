"""A DCP directory behind an ``s3://`` URL against its local copy, measured in the same run.

    .venv/bin/python bench/bench_remote_dcp.py              # 400 small tensors + one of 64 MiB
    .venv/bin/python bench/bench_remote_dcp.py --items 2000 --rounds 5
    .venv/bin/python bench/bench_remote_dcp.py --items 1000 --files 8 --files-in-flight 1   # files staged one by one

Saves a single-process DCP (``torch.distributed.checkpoint``) into a temporary directory, starts a local
S3-compatible server (moto's server mode, in a child process so its CPU is not counted here), uploads the
directory, and in this process: opens (stages) and audits the local copy and the URL, reporting CPU seconds
(``time.process_time``: the client's own work, steadier than wall time on a loaded machine), wall seconds, and
the staging's ranged reads and fetched bytes against the directory's size; then the audit of the URL against a
plain parallel download of every object under it (``fs.cat`` of all of them: concurrent GETs), alternating,
``--rounds`` times each: wall seconds and the ratio of the medians. ``--files N`` saves the small tensors in ``N``
data files (``FileSystemWriter(thread_count=N)``) instead of one, ``--files-in-flight`` sets how many of them
staging reads at once (``formats.remote.dcp.FILES_IN_FLIGHT``). The local server answers every
ranged read by copying the object, so the wall figures over the URL are the server's more than ours.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

_SERVER = ("import logging, time; logging.disable(logging.CRITICAL)\n"
           "from moto.server import ThreadedMotoServer\n"
           "s = ThreadedMotoServer(ip_address='127.0.0.1', port=0, verbose=False); s.start()\n"
           "print(s._server.server_port, flush=True); time.sleep(3600)\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=400, help="small tensors besides the 64 MiB one")
    ap.add_argument("--rounds", type=int, default=3, help="audits and plain downloads, alternating")
    ap.add_argument("--files", type=int, default=1, help="data files the save writes (default: %(default)s)")
    ap.add_argument("--files-in-flight", type=int, help="data files staged at once (default: ckptaudit's)")
    args = ap.parse_args()
    from ckptaudit.formats.remote import dcp as remote_dcp

    if args.files_in_flight is not None:
        remote_dcp.FILES_IN_FLIGHT = args.files_in_flight
    import torch
    import torch.distributed.checkpoint as dcp

    d = Path(tempfile.mkdtemp(prefix="bench-remote-dcp-"))
    g = torch.Generator().manual_seed(0)
    state = {"model": {f"l{i}.w": torch.randn(64 + i % 7, 96, generator=g) for i in range(args.items)},
             "big": {"w": torch.randn(16 << 20, generator=g)}, "step": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": a single-process save is what we want
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(d / "dcp"), thread_count=args.files))
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                          AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.mkdir("bench-remote")
        fs.put(str(d / "dcp"), "bench-remote/dcp", recursive=True)
        run(str(d / "dcp"), "s3://bench-remote/dcp", args.items, args.rounds)
    finally:
        server.kill()
        server.wait()


def run(local: str, url: str, items: int, rounds: int) -> None:
    from ckptaudit.auditing.judge import run_audit
    from ckptaudit.formats import open_checkpoint
    from ckptaudit.formats.remote import dcp as remote_dcp

    staged: dict[str, int] = {}
    real = remote_dcp.stage_dcp

    def counting(*a: Any, **k: Any) -> tuple[int, int]:
        staged["reads"], staged["bytes"] = out = real(*a, **k)
        return out

    remote_dcp.stage_dcp = counting  # type: ignore[assignment]
    run_audit(url)  # warm: imports, the S3 client's session
    for label, path in (("local", local), ("s3", url)):
        c0, w0 = time.process_time(), time.perf_counter()
        with open_checkpoint(path):
            pass
        c1, w1 = time.process_time(), time.perf_counter()
        report = run_audit(path)
        c2, w2 = time.process_time(), time.perf_counter()
        print(json.dumps({"path": label, "items": items + 2, "open_cpu_s": round(c1 - c0, 3),
                          "open_wall_s": round(w1 - w0, 3), "audit_cpu_s": round(c2 - c1, 3),
                          "audit_wall_s": round(w2 - w1, 3), "tensors": len(report.tensors),
                          "findings": sorted({f.code for f in report.findings})}))
    size = sum(p.stat().st_size for p in Path(local).iterdir())
    print(json.dumps({"staging_reads": staged["reads"], "staged_bytes": staged["bytes"], "directory_bytes": size,
                      "objects": len(list(Path(local).iterdir())), "files_in_flight": remote_dcp.FILES_IN_FLIGHT,
                      "load_average": [round(x, 2) for x in os.getloadavg()]}))
    against_download(url, rounds)


def against_download(url: str, rounds: int) -> None:
    """The audit of ``url`` against a plain parallel download of every object under it (the same bytes and more:
    the audit reads the metadata and the tensors, not the archives' other members), alternating, ``rounds``
    times each; medians and their ratio."""
    import statistics

    import fsspec

    from ckptaudit.auditing.plan import plan_scan
    from ckptaudit.auditing.scan import scan_items

    fs, root = fsspec.core.url_to_fs(url)
    paths = list(fs.find(root))
    times: dict[str, list[tuple[float, float]]] = {"download": [], "stage": [], "scan": []}
    got = 0
    for _ in range(rounds):
        fs.invalidate_cache()
        c0, w0 = time.process_time(), time.perf_counter()
        got = sum(len(b) for b in fs.cat(paths).values())  # s3fs: concurrent GETs, the client's own batching
        times["download"].append((time.perf_counter() - w0, time.process_time() - c0))
        c0, w0 = time.process_time(), time.perf_counter()
        plan = plan_scan(url)  # staging: .metadata, then each item's archive metadata
        times["stage"].append((time.perf_counter() - w0, time.process_time() - c0))
        c0, w0 = time.process_time(), time.perf_counter()
        try:
            scan_items(plan, plan.scannable())  # the tensors: coalesced small ones, large ones read ahead
        finally:
            plan.close()
        times["scan"].append((time.perf_counter() - w0, time.process_time() - c0))
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
    print(json.dumps({"download_bytes": got, "objects": len(paths), "rounds": rounds,
                      **{f"{k}_{u}_s": round(med[k][j], 3) for k in med for j, u in enumerate(("wall", "cpu"))},
                      "scan_over_download": round(med["scan"][0] / med["download"][0], 2),
                      "audit_over_download": round((med["stage"][0] + med["scan"][0]) / med["download"][0], 2),
                      "load_average": [round(x, 2) for x in os.getloadavg()]}))


if __name__ == "__main__":
    main()
