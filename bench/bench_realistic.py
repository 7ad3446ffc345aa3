"""The realistic benchmark: a GPT-2-medium-shaped training checkpoint, audited in every format, against a 2-thread
memory-mapped read of the same bytes measured in the same run.

    .venv/bin/python bench/bench_realistic.py --scale 0.1            # ~0.43 GB per format (development)
    .venv/bin/python bench/bench_realistic.py                        # full size: 355 M params + AdamW, ~4.26 GB
    .venv/bin/python bench/bench_realistic.py --write-docs docs/performance.md
    .venv/bin/python bench/bench_realistic.py --scale 0.1 --open-only --dir /tmp --keep --formats dcp-1,dcp-8
    .venv/bin/python bench/bench_realistic.py --dir /tmp --keep --formats torch.save,dcp-1 --ranks ''   # reuse files

The checkpoint: 24 layers, d=1024, vocab 50304 (GPT-2 medium's tensors, HF names, lm_head tied and not saved):
355 M fp32 parameters and the state of one real ``torch.optim.AdamW`` step (``step``, ``exp_avg``,
``exp_avg_sq``): 1168 tensors, 4.26 GB. ``--scale s`` multiplies the bytes by about ``s`` (d and vocab by
``sqrt(s)``) and keeps the tensor count. Written, measured and deleted one format at a time (so the page cache
holds one of them): ``torch.save``, a single-process DCP directory, an 8-rank DCP save (a real gloo job, each
rank saving its row shards as DTensors, one ``.distcp`` file per rank), safetensors (the model) and ``flat``: a
``torch.save`` of the same parameters and each moment concatenated into one fp32 tensor each (three tensors of
1.42 GB, as DeepSpeed's flat partitions hold them), where the scan's threads must share single tensors.

Measured, each in a fresh child process, right after the format was written (so from the page cache when the
machine's memory holds the files; a ``read`` far below memory speed says it did not), in ``--repeat`` rounds of
a read then the audits (throughput: the best round; audit / read: the median of the rounds' own ratios, which
the host's drifting CPU speed mostly cancels out of):

- ``read``: every 8-byte word xor-reduced by NumPy over read-only memory maps, the bytes split between 2
  threads: what reading the bytes costs at best;
- ``audit -j N``: :func:`ckptaudit.auditing.judge.run_audit` in-process (imports and first-call set-up excluded), with N
  threads, and its peak anonymous memory (``RssAnon`` sampled every 5 ms) over the child's baseline;
- ``open``: :func:`ckptaudit.auditing.plan.plan_scan` (open, parse metadata, interpret; no tensor data), per DCP item;
  ``--open-only`` measures only this, as the CPU time of a fresh process, best of ``--repeat``;
- CLI start-up: ``ckptaudit audit`` of a 4-element file (torch.save, safetensors, DCP) as a whole process
  (``/usr/bin/time``), bytecode compiled: wall, CPU and max RSS;
- distributed: ``torchrun --standalone --nproc-per-node R -m``-style ranks (1, 2, 4) auditing the 8-rank DCP
  save through :func:`ckptaudit.auditing.distributed.audit_distributed`, timed on rank 0 from the call (rendezvous
  included) to the report.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from common import AnonPeak, proc_status

HERE = os.path.dirname(os.path.abspath(__file__))
SECTION = "## The realistic benchmark"


# ---------------------------------------------------------------------------------------------------- the state


def shapes(scale: float) -> dict[str, tuple[int, ...]]:
    """GPT-2 medium's parameter shapes (HF names, Conv1D weights as (in, out)), scaled."""
    d = max(64, round(1024 * math.sqrt(scale) / 64) * 64)
    vocab = max(256, round(50304 * math.sqrt(scale)))
    out: dict[str, tuple[int, ...]] = {"transformer.wte.weight": (vocab, d), "transformer.wpe.weight": (d, d)}
    for i in range(24):
        p = f"transformer.h.{i}."
        out.update({p + "ln_1.weight": (d,), p + "ln_1.bias": (d,),
                    p + "attn.c_attn.weight": (d, 3 * d), p + "attn.c_attn.bias": (3 * d,),
                    p + "attn.c_proj.weight": (d, d), p + "attn.c_proj.bias": (d,),
                    p + "ln_2.weight": (d,), p + "ln_2.bias": (d,),
                    p + "mlp.c_fc.weight": (d, 4 * d), p + "mlp.c_fc.bias": (4 * d,),
                    p + "mlp.c_proj.weight": (4 * d, d), p + "mlp.c_proj.bias": (d,)})
    out.update({"transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)})
    return out


def training_state(scale: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """Model state dict and FQN-keyed optimizer state after one real AdamW step (random gradients)."""
    import torch

    g = torch.Generator().manual_seed(0)
    params = {}
    for name, shape in shapes(scale).items():
        t = torch.ones(shape) if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") else (
            torch.randn(shape, generator=g) * 0.02)
        params[name] = torch.nn.Parameter(t)
    opt = torch.optim.AdamW(params.values(), lr=1e-4)
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
    opt.step()
    for p in params.values():
        p.grad = None
    osd = opt.state_dict()
    names = list(params)
    optim = {"state": {names[i]: s for i, s in osd["state"].items()},
             "param_groups": [{**{k: v for k, v in grp.items() if k != "params"},
                               "params": [names[i] for i in grp["params"]]} for grp in osd["param_groups"]]}
    return {k: v.detach() for k, v in params.items()}, optim


FILE_NAMES = {"torch.save": "ckpt.pt", "safetensors": "model.safetensors", "flat": "flat.pt"}
"""Each format's file or directory name in the scratch directory (the DCP ones are named by the format)."""


def write(fmt: str, path: str, scale: float) -> None:
    import torch

    if fmt == "dcp-8":
        from ckptaudit.launch import launch

        launch(_rank_save, 8, (path, scale), timeout_s=3600, backend="gloo", env={"OMP_NUM_THREADS": "1"})
        return
    model, optim = training_state(scale)
    if fmt == "torch.save":
        torch.save({"model": model, "optimizer": optim, "step": 1}, path)
    elif fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(model, path, metadata={"format": "pt"})
    elif fmt == "flat":  # DeepSpeed-style flat partitions: the parameters, and each moment, as one fp32 buffer
        def flat(ts: Any) -> Any:
            return torch.cat([t.reshape(-1) for t in ts])

        names = list(model)
        torch.save({"fp32_flat": flat(model.values()),
                    **{k: flat(optim["state"][n][k] for n in names) for k in ("exp_avg", "exp_avg_sq")}}, path)
    elif fmt == "dcp-1":
        import warnings

        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no process group: a single-process save
            dcp.save({"model": model, "optim": optim, "step": torch.tensor(1)}, checkpoint_id=path)
    else:
        raise ValueError(fmt)


def _rank_save(ctx: Any, path: str, scale: float) -> int:
    """(each of 8 ranks) Its row shards of every parameter and moment as DTensors (Shard(0)), saved by DCP."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    r, w = ctx.rank, ctx.world_size

    def shard(shape: tuple[int, ...], seed: int, kind: str) -> DTensor:
        rows = -(-shape[0] // w)
        lo, hi = min(shape[0], r * rows), min(shape[0], (r + 1) * rows)
        g = torch.Generator().manual_seed(seed * 64 + r)
        local = torch.randn((hi - lo, *shape[1:]), generator=g)
        local = local.abs() * 1e-6 if kind == "exp_avg_sq" else local * (1e-3 if kind == "exp_avg" else 0.02)
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())

    model, state = {}, {}
    for i, (name, shape) in enumerate(shapes(scale).items()):
        model[name] = shard(shape, 3 * i, "param")
        state[name] = {"step": torch.tensor(1.0), "exp_avg": shard(shape, 3 * i + 1, "exp_avg"),
                       "exp_avg_sq": shard(shape, 3 * i + 2, "exp_avg_sq")}
    groups = [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
               "params": list(model)}]
    dcp.save({"model": model, "optim": {"state": state, "param_groups": groups}, "step": torch.tensor(1)},
             checkpoint_id=path)
    return r


def size_of(path: str) -> int:
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    return os.path.getsize(path)


# ---------------------------------------------------------------------------------------------- child measures


def child_read(path: str, threads: int) -> dict[str, Any]:
    """xor-reduce every 8-byte word of the files through read-only maps, bytes split evenly between threads."""
    import numpy as np

    files = [os.path.join(path, f) for f in sorted(os.listdir(path))] if os.path.isdir(path) else [path]
    maps = []
    for name in files:
        with open(name, "rb") as fh:
            if os.fstat(fh.fileno()).st_size:
                maps.append(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))
    total = sum(len(m) for m in maps)
    per = -(-total // threads)
    segments: list[list[tuple[mmap.mmap, int, int]]] = [[] for _ in range(threads)]
    pos = 0
    for m in maps:  # cut the concatenation of the files into `threads` equal runs
        start = 0
        while start < len(m):
            t = min(threads - 1, pos // per)
            take = min(len(m) - start, (t + 1) * per - pos)
            segments[t].append((m, start, take))
            start += take
            pos += take
    results = [0] * threads

    def work(t: int) -> None:
        acc = 0
        for m, start, n in segments[t]:
            words = n // 8
            window = 64 << 20
            for off in range(0, words, window // 8):
                k = min(window // 8, words - off)
                acc ^= int(np.bitwise_xor.reduce(np.frombuffer(m, np.uint64, k, start + off * 8)))
            tail = np.frombuffer(m, np.uint8, n - words * 8, start + words * 8)
            acc ^= int(np.bitwise_xor.reduce(tail)) if tail.size else 0
        results[t] = acc

    t0 = time.perf_counter()
    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    secs = time.perf_counter() - t0
    return {"seconds": secs, "bytes": total, "xor": results[0]}




def _warm_up(tmp: str) -> None:
    """First-call imports and set-up of every reader, outside the timed run."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from ckptaudit.auditing.judge import run_audit

    torch.save({"model": {"w": torch.ones(4)}}, os.path.join(tmp, "warm.pt"))
    save_file({"w": torch.ones(4)}, os.path.join(tmp, "warm.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.ones(4)}}, checkpoint_id=os.path.join(tmp, "warm-dcp"))
    for name in ("warm.pt", "warm.safetensors", "warm-dcp"):
        run_audit(os.path.join(tmp, name))


def child_audit(path: str, jobs: int) -> dict[str, Any]:
    """The open (plan) phase alone (:func:`child_open`), then the whole audit with ``jobs`` threads."""
    from ckptaudit.auditing.judge import AuditOptions, run_audit

    opened = child_open(path)
    base = proc_status("RssAnon")
    with AnonPeak() as mem:
        t0 = time.perf_counter()
        report = run_audit(path, AuditOptions(jobs=jobs))
        secs = time.perf_counter() - t0
    return {"seconds": secs, "open_seconds": opened["wall"], "open_cpu": opened["cpu"], "items": opened["items"],
            "tensors": len(report.tensors), "findings": len(report.findings), "anon_base": base, "anon_peak": mem.peak,
            "errors": [f.code for f in report.findings if f.severity.name == "ERROR"]}


def child_open(path: str) -> dict[str, Any]:
    """The open (plan) phase alone, as CPU time of this process (steadier than wall time on a shared machine)."""
    from ckptaudit.auditing.plan import plan_scan

    tmp = tempfile.mkdtemp(prefix="ckptaudit-warm-")
    try:
        _warm_up(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    t0, c0 = time.perf_counter(), time.process_time()
    plan = plan_scan(path)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    items = sum(len(ref.data.pieces) for ref, *_ in plan.items if hasattr(ref.data, "pieces"))
    plan.close()
    return {"cpu": cpu, "wall": wall, "items": items}


def child_dist(path: str) -> dict[str, Any] | None:
    """(each rank, under torchrun) The distributed audit, timed on rank 0."""
    import torch.distributed  # noqa: F401 - imported before the clock starts, as the readers' first calls are

    from ckptaudit.auditing.distributed import audit_distributed, torchrun_rank
    from ckptaudit.auditing.judge import AuditOptions
    from ckptaudit.auditing.scan import default_jobs

    place = torchrun_rank()
    assert place is not None
    tmp = tempfile.mkdtemp(prefix=f"ckptaudit-warm-{place.rank}-")
    try:
        _warm_up(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    t0 = time.perf_counter()
    report = audit_distributed(path, AuditOptions(jobs=max(1, default_jobs() // local)), rank=place.rank,
                               world_size=place.world_size)
    secs = time.perf_counter() - t0
    return None if report is None else {"seconds": secs, "tensors": len(report.tensors)}


def run_child(*argv: str, torchrun: int = 0) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *argv]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun}",
               "--monitor-interval=0.2", os.path.abspath(__file__), "--child", *argv]
    env = dict(os.environ)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, timeout=3600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def cli_startup(tmp: str, repeat: int) -> dict[str, dict[str, float]]:
    """``ckptaudit audit`` of a 4-element file as a whole process: median wall, CPU and max RSS of ``repeat`` runs.

    The package's bytecode is compiled first, as ``pip install`` leaves it (with ``PYTHONDONTWRITEBYTECODE`` set,
    an editable checkout would otherwise recompile every module on every run).
    """
    import compileall

    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    compileall.compile_dir(os.path.join(HERE, "..", "src", "ckptaudit"), quiet=1)
    small_pt = os.path.join(tmp, "small.pt")
    small_st = os.path.join(tmp, "small.safetensors")
    small_dcp = os.path.join(tmp, "small_dcp")
    torch.save({"w": torch.arange(4.0)}, small_pt)
    save_file({"w": torch.arange(4.0)}, small_st)
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=small_dcp)
    out = {}
    env = dict(os.environ)
    for label, argv in (("torch.save", ["audit", small_pt, "--no-progress"]),
                        ("safetensors", ["audit", small_st, "--no-progress"]),
                        ("DCP directory", ["audit", small_dcp, "--no-progress"]), ("--help", ["--help"])):
        walls, cpus, rss = [], [], []
        for i in range(repeat + 1):
            run = subprocess.run(["/usr/bin/time", "-f", "TIME %e %U %S %M", sys.executable, "-m", "ckptaudit", *argv],
                                 capture_output=True, text=True, env=env, check=False)
            m = re.search(r"TIME ([\d.]+) ([\d.]+) ([\d.]+) (\d+)", run.stderr)
            if m is None:
                raise RuntimeError(f"/usr/bin/time gave no figures: {run.stderr[-500:]}")
            if i:  # the first run warms the page cache of the interpreter and libraries
                walls.append(float(m.group(1)))
                cpus.append(float(m.group(2)) + float(m.group(3)))
                rss.append(int(m.group(4)) * 1024)
        out[label] = {"wall": statistics.median(walls), "cpu": statistics.median(cpus),
                      "rss": statistics.median(rss)}
    return out


# ---------------------------------------------------------------------------------------------------- the driver


def measure(fmt: str, path: str, repeat: int, jobs: list[int]) -> dict[str, Any]:
    """``repeat`` rounds, each a 2-thread read then an audit per thread count, one child process each.

    The throughput columns are the best of the rounds; the ratio (audit with the most threads / read) is the
    median of the rounds' own ratios: the read and the audit of a round run seconds apart, so the host's CPU
    speed, which drifts by up to 2x over minutes here, mostly cancels out of it (all reads first and all
    audits after, as before, let the drift land in the ratio). A first read, not counted, warms the pages the
    write left (uncounted, it made the first round's audit up to 2x faster than its read)."""
    size = size_of(path)
    run_child("read", path, "2")  # not counted: the first read after a write pays for the fresh pages
    reads: list[float] = []
    audits: dict[int, list[dict[str, Any]]] = {j: [] for j in jobs}
    ratios: list[float] = []
    for _ in range(repeat):
        reads.append(run_child("read", path, "2")["seconds"])
        for j in jobs:
            audits[j].append(run_child("audit", path, str(j)))
        ratios.append(reads[-1] / audits[jobs[-1]][-1]["seconds"])
    row: dict[str, Any] = {"format": fmt, "bytes": size, "read": min(reads), "ratio": statistics.median(ratios),
                           "ratios": ratios}
    for j in jobs:
        row[f"audit{j}"] = min(audits[j], key=lambda a: a["seconds"])
    return row


def render(rows: list[dict[str, Any]], jobs: list[int], startup: dict[str, dict[str, float]],
           dist: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    gb = 1e9
    lines = [SECTION + meta["title"], "",
             f"Measured {meta['when']} on this project's development machine ({meta['cores']} cores, "
             f"load average {meta['load']} at the start: shared with other jobs), `--scale {meta['scale']}` "
             f"({meta['tensors']} tensors), {meta['repeat']} rounds per format (a 2-thread read, then the audits; "
             "throughput: the best round; audit / read: the median of the rounds' own ratios, their range in "
             "brackets), " + ("the checkpoints written once and kept (`--keep`), each read once before its rounds"
                               if meta.get("kept") else "each format measured right after it was written (page cache "
                               "as the machine's memory left it)") + (f"; {meta['note']}" if meta.get("note") else "")
             + ":", "",
             "    .venv/bin/python bench/bench_realistic.py --scale " + str(meta["scale"]) +
             " --write-docs docs/performance.md", ""]
    head = "| format | size | 2-thread read | " + " | ".join(f"audit -j {j}" for j in jobs) + \
        f" | audit -j {jobs[-1]} / read | open (plan) | per item (CPU) | peak anon. memory |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        read_gbps = r["bytes"] / r["read"] / gb
        cells = [r["format"], f"{r['bytes'] / gb:.2f} GB", f"{read_gbps:.1f} GB/s"]
        for j in jobs:
            a = r[f"audit{j}"]
            cells.append(f"{r['bytes'] / a['seconds'] / gb:.1f} GB/s ({a['seconds']:.2f} s)")
        last = r[f"audit{jobs[-1]}"]
        ratio = r["ratio"]
        spread = f" ({min(r['ratios']):.2f}-{max(r['ratios']):.2f})"
        cells.append((f"**{ratio:.2f}x**" if ratio >= 0.5 else f"{ratio:.2f}x") + spread)
        cells.append(f"{last['open_seconds']:.3f} s")
        cells.append(f"{per_item_ms(r, jobs):.3f} ms x {last['items']}")
        cells.append(f"+{(last['anon_peak'] - last['anon_base']) / 2**20:.1f} MiB")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "CLI start-up, `ckptaudit audit` of a 4-element file as a whole process, bytecode compiled "
              "(median, `/usr/bin/time`; CPU is user + system):", "", "| file | wall | CPU | max RSS |",
              "|---|---|---|---|"]
    for label, s in startup.items():
        lines.append(f"| {label} | {s['wall']:.2f} s | {s.get('cpu', 0.0):.2f} s | {s['rss'] / 2**20:.0f} MiB |")
    if dist:
        lines += ["", "Distributed audit of the 8-rank DCP save (`torchrun --standalone --nproc-per-node R`, on "
                  "this one machine; rank 0's time from the call to the report, rendezvous included, imports and first-call "
                  "set-up excluded):", "",
                  "| ranks | time | throughput |", "|---|---|---|"]
        for d in dist:
            lines.append(f"| {d['ranks']} | {d['seconds']:.2f} s | {d['bytes'] / d['seconds'] / gb:.1f} GB/s |")
    return "\n".join(lines) + "\n"


def per_item_ms(row: dict[str, Any], jobs: list[int]) -> float:
    """The open (plan) phase's CPU time per item, best over the audits of ``row`` (it runs on one thread)."""
    best = min(row[f"audit{j}"].get("open_cpu", row[f"audit{j}"]["open_seconds"]) for j in jobs)
    return float(best) / max(1, row[f"audit{jobs[0]}"]["items"]) * 1e3


README_BEGIN, README_END = "<!-- bench_realistic:begin -->", "<!-- bench_realistic:end -->"


def render_readme(rows: list[dict[str, Any]], jobs: list[int], startup: dict[str, dict[str, float]],
                  dist: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The README's summary: the audit against reading the same bytes, per format, and the small-file CLI."""
    gb = 1e9
    j = jobs[-1]
    lines = [f"Measured {meta['when']} ({meta['cores']} cores, load average {meta['load']}), on a GPT-2-medium-shaped "
             f"checkpoint with AdamW state ({meta['tensors']} tensors, `--scale {meta['scale']}`), page cache warm; "
             "audit / read is the median of paired rounds (a read, then the audit); "
             "details and the other figures in [docs/performance.md](docs/performance.md):", "",
             f"| format | size | 2-thread read | audit -j {j} | audit / read | open, CPU per item | peak anon. memory |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        a = r[f"audit{j}"]
        read, audit = r["bytes"] / r["read"] / gb, r["bytes"] / a["seconds"] / gb
        lines.append(f"| {r['format']} | {r['bytes'] / gb:.2f} GB | {read:.1f} GB/s | {audit:.1f} GB/s | "
                     f"{r['ratio']:.2f}x | {per_item_ms(r, jobs):.3f} ms | "
                     f"+{(a['anon_peak'] - a['anon_base']) / 2**20:.1f} MiB |")
    lines += ["", "dcp-1: a one-process DCP save; dcp-8: an 8-rank save, one file per rank; flat: the same state as "
              "three 1.42 GB tensors (DeepSpeed's flat partitions)."]
    if startup:
        lines += ["", "Small-file CLI audit (whole process, median wall): " + ", ".join(
            f"{k} {v['wall']:.2f} s" for k, v in startup.items()) + "."]
    if dist:
        lines += ["", "Distributed audit of the 8-rank DCP save, ranks on this one machine: " + ", ".join(
            f"{d['ranks']} rank{'s' if d['ranks'] > 1 else ''} {d['bytes'] / d['seconds'] / gb:.1f} GB/s"
            for d in dist) + "."]
    return "\n".join(lines) + "\n"


def write_marked(doc: str, text: str) -> None:
    """Replace what lies between the README markers in ``doc``; refuse a file without them."""
    old = open(doc, encoding="utf-8").read()
    a, b = old.find(README_BEGIN), old.find(README_END)
    if a < 0 or b < a:
        raise SystemExit(f"{doc}: no {README_BEGIN} ... {README_END} markers; add them where the summary goes")
    with open(doc, "w", encoding="utf-8") as fh:
        fh.write(old[: a + len(README_BEGIN)] + "\n" + text + old[b:])


def write_docs(doc: str, text: str, heading: str) -> None:
    """Replace the section (from ``heading`` to the next ``## ``) in ``doc``, or append it."""
    old = open(doc, encoding="utf-8").read() if os.path.exists(doc) else "# Performance\n"
    start = old.find(heading + "\n")
    if start < 0:
        new = old.rstrip() + "\n\n" + text
    else:
        nxt = old.find("\n## ", start + len(heading))
        new = old[:start] + text + ("\n" + old[nxt + 1:] if nxt >= 0 else "")
    with open(doc, "w", encoding="utf-8") as fh:
        fh.write(new)


def open_only(args: argparse.Namespace) -> None:
    """``--open-only``: per format, the open (plan) phase's CPU time per item (per tensor for single files)."""
    kept = os.path.join(args.dir, f"scale-{args.scale}") if args.keep else None
    tmp = kept or tempfile.mkdtemp(prefix="ckptaudit-realistic-", dir=args.dir)
    os.makedirs(tmp, exist_ok=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the start, --scale {args.scale}, {args.repeat} rounds")
    try:
        for fmt in args.formats.split(","):
            path = os.path.join(tmp, FILE_NAMES.get(fmt, fmt))
            done = path + ".written"
            if not (kept and os.path.exists(done)):
                shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else None
                write(fmt, path, args.scale)
                open(done, "w").close()
            runs = [run_child("open", path) for _ in range(args.repeat)]
            best = min(runs, key=lambda r: r["cpu"])
            items = max(1, best["items"])
            print(f"{fmt}: open {best['cpu']:.3f} s CPU ({best['wall']:.3f} s wall) for {best['items']} items: "
                  f"{best['cpu'] / items * 1e3:.3f} ms CPU per item")
            if not kept:
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    finally:
        if not kept:
            shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="bytes relative to the full 4.26 GB (default 1)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds per format (a read, then the audits); best of this many "
                    "fresh processes with --open-only")
    ap.add_argument("--formats", default="torch.save,dcp-1,dcp-8,safetensors,flat")
    ap.add_argument("--jobs", default="1,2", help="thread counts to audit with (comma-separated)")
    ap.add_argument("--ranks", default="1,2,4", help="torchrun rank counts for the distributed audit ('' skips)")
    ap.add_argument("--write-docs", metavar="FILE.md", help="replace the benchmark's section in this file")
    ap.add_argument("--write-readme", metavar="FILE.md",
                    help="replace the summary between the bench_realistic markers in this file (README.md)")
    ap.add_argument("--dir", help="scratch directory (default: a new temporary one)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the checkpoints in --dir/scale-S/ and reuse them in later runs (needs --dir; a kept "
                    "file's pages may have left the page cache: the read column says)")
    ap.add_argument("--open-only", action="store_true",
                    help="measure only the open (plan) phase: CPU time per item, best of --repeat fresh processes")
    ap.add_argument("--note", default="", help="a sentence on how the run was made, written after the header's")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, path, *rest = args.child
        if kind == "read":
            print(json.dumps(child_read(path, int(rest[0]))))
        elif kind == "audit":
            print(json.dumps(child_audit(path, int(rest[0]))))
        elif kind == "open":
            print(json.dumps(child_open(path)))
        else:
            res = child_dist(path)
            if res is not None:
                print(json.dumps(res))
        return
    if args.keep and not args.dir:
        ap.error("--keep needs --dir (where the checkpoints are kept)")
    if args.open_only:
        open_only(args)
        return
    jobs = [int(j) for j in args.jobs.split(",")]
    ranks = [int(r) for r in args.ranks.split(",") if r]
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    kept = os.path.join(args.dir, f"scale-{args.scale}") if args.keep else None
    if kept:
        os.makedirs(kept, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="ckptaudit-realistic-", dir=args.dir)
    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cores": len(os.sched_getaffinity(0)),
            "load": f"{os.getloadavg()[0]:.1f}", "scale": args.scale, "repeat": args.repeat,
            "tensors": 4 * len(shapes(args.scale)) + 1,
            "title": "" if args.scale == 1 else f" at --scale {args.scale}", "note": args.note, "kept": args.keep}
    rows, dist = [], []
    try:
        for fmt in args.formats.split(","):
            path = os.path.join(kept or tmp, FILE_NAMES.get(fmt, fmt))
            if not (kept and os.path.exists(path + ".written")):
                t0 = time.perf_counter()
                write(fmt, path, args.scale)
                print(f"{fmt}: wrote {size_of(path) / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
                if kept:
                    open(path + ".written", "w").close()
            row = measure(fmt, path, args.repeat, jobs)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
            if fmt == "dcp-8":
                for r in ranks:
                    best = min((run_child("dist", path, torchrun=r) for _ in range(args.repeat)),
                               key=lambda d: d["seconds"])
                    dist.append({"ranks": r, "bytes": row["bytes"], **best})
                    print(json.dumps(dist[-1]), file=sys.stderr)
            if not kept:
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        startup = cli_startup(tmp, args.repeat)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = render(rows, jobs, startup, dist, meta)
    print(text)
    if args.write_docs:
        write_docs(args.write_docs, text, SECTION + meta["title"])
    if args.write_readme:
        write_marked(args.write_readme, render_readme(rows, jobs, startup, dist, meta))


if __name__ == "__main__":
    main()
