"""What the live probe costs a training step: without the probe, attached but unarmed, and armed every step.

    .venv/bin/python bench/bench_probe.py --d-model 192 --layers 3 --steps 150   # 2 gloo ranks
    .venv/bin/python bench/bench_probe.py --nproc 1 --d-model 192 --layers 3 --steps 200

One run, FSDP2 + bf16 MixedPrecisionPolicy. The modes are interleaved step by step (their order rotating every
round) so that the noise of a shared machine hits all of them alike. Each step is timed on rank 0 between a
barrier and its end, in wall time and in the training thread's CPU time (steadier when other jobs share the
cores). The overhead of a mode is the median, over rounds, of its step time divided by the no-probe step of
the same round, minus one (paired, so slow phases of the machine cancel). ``no probe (A/A)`` repeats the
baseline: its figure is the noise floor the others must be read against. Also: one point-1 snapshot
(``record_masters``) and the peak RSS of rank 0 before and after the measured steps. Target: unarmed < 1%.
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import sys
import time
from typing import Any

from ckptaudit.launch import RankContext, launch

MODES = ("no probe", "no probe (A/A)", "attached, unarmed", "armed every step")
"""``no probe (A/A)`` runs exactly what ``no probe`` runs: its difference from it is the noise floor of the run."""


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_job(ctx: RankContext, cfg: dict[str, int], batch: int, steps: int, warmup: int) -> dict[str, Any] | None:
    """(all ranks) Train with the modes interleaved; rank 0 returns the timings."""
    import torch.distributed as dist

    from ckptaudit.probe import Probe
    from ckptaudit.recipes.tinygpt import GPTConfig, TinyGPTRecipe

    recipe = TinyGPTRecipe(cfg=GPTConfig(dropout=0.0, **cfg), batch_size=batch, total_steps=10 * steps)
    job = recipe.setup(ctx)
    n_params = sum(p.numel() for p in job.model.parameters())  # DTensor.numel() is the global count
    for _ in range(warmup):
        recipe.step(job)
    rss_before = _rss_mib()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    probe: Probe | None = None
    for i in range(steps):
        order = MODES[i % len(MODES) :] + MODES[: i % len(MODES)]
        for mode in order:
            probe = None
            if mode not in ("no probe", "no probe (A/A)"):
                probe = Probe(job.model)
                if mode == "armed every step":
                    probe.arm()
            gc.collect()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            recipe.step(job)
            times[mode].append(time.perf_counter() - t0)
            cpu[mode].append(time.thread_time() - c0)
            if probe is not None:
                probe.disarm()
    # Deterministic counterpart of the timings: the Python calls one step makes in each mode (rank 0's training
    # thread, sys.setprofile). Unarmed the probe adds no hook, so it must add no call at all.
    calls: dict[str, list[int]] = {m: [] for m in MODES}
    for _ in range(3):
        for mode in MODES:
            probe = None
            if mode not in ("no probe", "no probe (A/A)"):
                probe = Probe(job.model)
                if mode == "armed every step":
                    probe.arm()
            count = [0]

            def profile(frame: Any, event: str, arg: Any, count: list[int] = count) -> None:
                if event in ("call", "c_call"):
                    count[0] += 1

            dist.barrier()
            sys.setprofile(profile)
            recipe.step(job)
            sys.setprofile(None)
            calls[mode].append(count[0])
            if probe is not None:
                probe.disarm()
    snapshot = []
    probe = Probe(job.model)
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        probe.record_masters()
        snapshot.append(time.perf_counter() - t0)
    if ctx.rank != 0:
        return None
    return {"times": times, "cpu": cpu, "calls": calls, "snapshot": snapshot, "rss_before": rss_before, "rss_after": _rss_mib(),
            "params": n_params}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60, help="measured steps per mode")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    cfg = {"d_model": args.d_model, "n_layers": args.layers, "seq_len": args.seq_len, "vocab_size": args.vocab,
           "n_heads": 4}
    t0 = time.monotonic()
    res = launch(bench_job, args.nproc, (cfg, args.batch, args.steps, args.warmup), timeout_s=1800)[0]
    print(f"tiny GPT d_model={args.d_model} layers={args.layers} seq={args.seq_len} batch={args.batch} "
          f"({res['params'] / 1e6:.2f} M parameters), FSDP2 + bf16 MixedPrecisionPolicy, {args.nproc} gloo "
          f"ranks, {args.steps} steps per mode, interleaved ({time.monotonic() - t0:.0f} s)")
    print(f"{'mode':<20} {'wall median':>12} {'paired':>9} {'thread cpu':>12} {'paired':>9} {'python calls/step':>18}")
    for mode in MODES:
        cells = []
        for kind in ("times", "cpu"):
            ts, base = res[kind][mode], res[kind]["no probe"]
            paired = statistics.median(t / b - 1 for t, b in zip(ts, base, strict=True))
            cells.append(f"{statistics.median(ts) * 1e3:>9.1f} ms {paired * 100:>+8.2f}%")
        print(f"{mode:<20} {cells[0]} {cells[1]} {'/'.join(str(c) for c in res['calls'][mode]):>18}")
    print(f"record_masters (point 1, all parameters): median {statistics.median(res['snapshot']) * 1e3:.1f} ms")
    print(f"rank 0 peak RSS: {res['rss_before']:.0f} MiB after warm-up, {res['rss_after']:.0f} MiB at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
