"""What the in-loop guard costs the training loop, with confidence intervals that say whether 1% is resolved.

    .venv/bin/python bench/bench_guard.py                                   # both scenarios, process worker
    .venv/bin/python bench/bench_guard.py --rounds 60 --scenario saturated  # more blocks: a narrower interval
    .venv/bin/python bench/bench_guard.py --write-docs docs/integrations/index.md README.md

A small real loop, one process: an MLP of ``--mib`` MiB of fp32 parameters, AdamW, and a checkpoint
(``torch.save`` of model + optimizer, as most loops write it) at the start of every segment of ``--steps``
steps. Segments with the guard call what an integration calls: ``Guard.submit`` after the save and
``Guard.should_stop`` at every step boundary; they end by waiting for their audit, timed, so every guarded
segment pays for its whole audit (an upper bound: a real loop never waits). Measured:

(a) the critical path: time on the training thread inside ``submit`` and ``should_stop``, summed, over the
    guarded segments' wall time (deterministic, resolves far below 1%);
(b) the wall-time overhead from ``--rounds`` blocks of four segments in ABBA / BAAB order (a linear drift of
    the machine cancels in each block), as the mean paired difference with a 95% Student-t interval, and the
    same for the training process's CPU time (all its threads; the worker process excluded). Only what the
    interval supports is said: "overhead < 1% (95% CI [a, b])" or "cannot resolve 1% with this noise";
(c) two scenarios: ``free-core`` (one torch thread, a core left for the worker: a GPU job, whose host cores are
    mostly idle) and ``saturated`` (torch threads = cores: the worker, at nice 19 and SCHED_IDLE, competes);
(d) memory: the worker process's peak RSS, and the training process's peak RSS in guarded segments over
    the unguarded ones (sampled every 10 ms);
(e) the first verdict's latency: a new guard (its worker starts when it is created, off the training thread),
    a save, and the time from the save's ``submit`` to its verdict, beside the same guard's later audits (the
    audit itself) and beside a save submitted the moment the guard is created (the worker's start-up then on
    the first verdict's path, as when the worker started at the first save);
(f) stop mode's wait at the save: a guard with ``on_failure="stop"`` (``max_unverified=1``), ``--wait-saves`` saves
    at the benchmark's cadence (a save every ``--steps`` steps) and at every step, nothing waiting at the end of
    a segment: how many saves waited in ``Guard.before_save`` for the verdict of the one before, and how long
    (``Guard.waits``), beside the time the steps between two saves took and the audit's.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from common import proc_status
from pairstats import Interval, abba_overheads, mean_ci, verdict

SCENARIOS = ("free-core", "saturated")
MARKERS = {"figures": ("<!-- bench_guard:figures:begin -->", "<!-- bench_guard:figures:end -->"),
           "sentence": ("<!-- bench_guard:sentence:begin -->", "<!-- bench_guard:sentence:end -->")}


class RssPeak:
    """Samples VmRSS every 10 ms while active (VmHWM never goes down, so it cannot compare segments)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, proc_status("VmRSS"))

    def __enter__(self) -> RssPeak:
        self.peak = proc_status("VmRSS")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _child(guard: Any) -> Any:
    """The guard's worker process (``subprocess.Popen``), or ``None`` (a thread worker, or not running)."""
    return getattr(getattr(guard, "_process", None), "child", None)


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of a process (or one of its threads) from /proc; 0.0 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def where_cpu(guard: Any) -> tuple[float, float]:
    """(CPU seconds of the worker process, of the guard's thread in the training process) so far."""
    child, thread = _child(guard), getattr(guard, "_thread", None)
    return (cpu_seconds(child.pid) if child is not None else 0.0,
            cpu_seconds(os.getpid(), thread.native_id) if thread is not None and thread.native_id else 0.0)


def child_hwm(guard: Any) -> int:
    """The worker process's peak RSS (VmHWM), 0 without one."""
    child = _child(guard)
    if child is None or child.poll() is not None:
        return 0
    with open(f"/proc/{child.pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


@dataclass
class Scenario:
    """What one scenario measured (the segments of the blocks; the warm-up is dropped)."""

    name: str
    threads: int
    blocks_wall: list[tuple[float, float, float, float]] = field(default_factory=list)
    blocks_cpu: list[tuple[float, float, float, float]] = field(default_factory=list)
    blocks_run: list[tuple[float, float, float, float]] = field(default_factory=list)
    """Wall time less the wait for the audit at the segment's end: the interference while training ran."""
    blocks_steps: list[tuple[float, float, float, float]] = field(default_factory=list)
    """The training steps alone (the save and the audit wait left out): the step time the issue asks about."""
    order: list[str] = field(default_factory=list)
    critical: float = 0.0
    critical_cpu: float = 0.0
    guarded_wall: float = 0.0
    submits: int = 0
    polls: int = 0
    waited: list[float] = field(default_factory=list)
    peaks: dict[str, int] = field(default_factory=lambda: {"A": 0, "B": 0})
    wall: Interval | None = None
    cpu: Interval | None = None
    run: Interval | None = None
    steps: Interval | None = None
    seconds: float = 0.0
    """Wall time of the measured blocks (for the hint: how long more rounds would take)."""


class Loop:
    """The real training loop and its segments (one process; only this thread trains)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from ckptaudit.integrations.guard import Guard

        self.torch, self.args = torch, args
        torch.manual_seed(0)
        width = 1024
        self.layers = max(1, args.mib * (1 << 20) // (4 * width * width))
        self.model = torch.nn.Sequential(*[m for _ in range(self.layers)
                                           for m in (torch.nn.Linear(width, width), torch.nn.GELU())])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(args.batch, width)
        self.nbytes = sum(p.numel() * 4 for p in self.model.parameters())
        self.work = tempfile.mkdtemp(prefix="bench-guard-")
        self.guard = Guard(on_failure="warn", background=args.background, quick=args.quick,
                           passport=args.passport == "on")
        self.saved = 0

    def segment(self, guarded: bool, sc: Scenario) -> tuple[float, float, float, float]:
        """(training thread) One segment: save, ``--steps`` steps, [wait for the audit]. Wall seconds, the same
        less the wait, this process's CPU seconds, and the wall seconds of the steps alone."""
        torch, guard, clock = self.torch, self.guard, time.perf_counter
        self.saved += 1
        path = os.path.join(self.work, f"step-{self.saved}.pt")
        critical = critical_cpu = waited = 0.0
        tcpu = time.thread_time
        with RssPeak() as rss:
            start, cpu0 = clock(), time.process_time()
            torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": self.saved},
                       path)
            if guarded:
                t0, c0 = clock(), tcpu()
                guard.before_save(self.saved)  # what an integration calls before the library writes (no bound:
                guard.submit(path, step=self.saved)  # warn mode); submit pins the files and queues the audit
                critical, critical_cpu = critical + clock() - t0, critical_cpu + tcpu() - c0
            steps0 = clock()
            for _ in range(self.args.steps):
                self.model(self.x).square().mean().backward()
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
                if guarded:
                    t0, c0 = clock(), tcpu()
                    guard.should_stop()
                    critical, critical_cpu = critical + clock() - t0, critical_cpu + tcpu() - c0
            steps = clock() - steps0
            if guarded:
                t0 = clock()
                guard.wait()
                waited = clock() - t0
                sc.waited.append(waited)
            wall, cpu = clock() - start, time.process_time() - cpu0
        if guarded:
            sc.critical += critical
            sc.critical_cpu += critical_cpu
            sc.guarded_wall += wall
            sc.submits += 1
            sc.polls += self.args.steps
        key = "B" if guarded else "A"
        sc.peaks[key] = max(sc.peaks[key], rss.peak)
        for n in os.listdir(self.work):  # keep the disk use flat (untimed)
            full = os.path.join(self.work, n)
            shutil.rmtree(full, ignore_errors=True) if os.path.isdir(full) else os.remove(full)
        return wall, wall - waited, cpu, steps

    def run(self, sc: Scenario, rounds: int, budget_s: float) -> None:
        """(training thread) Warm up, then ``rounds`` blocks, or fewer (3 at least) once ``budget_s`` is spent."""
        self.torch.set_num_threads(sc.threads)
        scratch = Scenario(sc.name, sc.threads)
        for guarded in (False, True):  # warm-up: allocator, page cache, the worker's start
            self.segment(guarded, scratch)
        start = time.perf_counter()
        for r in range(rounds):
            if r >= 3 and time.perf_counter() - start > budget_s:
                break
            kind = "ABBA" if r % 2 == 0 else "BAAB"
            walls, runs, cpus, stepss = [], [], [], []
            for k in kind:
                wall, run, cpu, steps = self.segment(k == "B", sc)
                walls.append(wall)
                runs.append(run)
                cpus.append(cpu)
                stepss.append(steps)
            sc.blocks_wall.append((walls[0], walls[1], walls[2], walls[3]))
            sc.blocks_run.append((runs[0], runs[1], runs[2], runs[3]))
            sc.blocks_cpu.append((cpus[0], cpus[1], cpus[2], cpus[3]))
            sc.blocks_steps.append((stepss[0], stepss[1], stepss[2], stepss[3]))
            sc.order.append(kind)
        sc.seconds = time.perf_counter() - start
        sc.wall = mean_ci(abba_overheads(sc.blocks_wall, sc.order))
        sc.cpu = mean_ci(abba_overheads(sc.blocks_cpu, sc.order))
        sc.run = mean_ci(abba_overheads(sc.blocks_run, sc.order))
        sc.steps = mean_ci(abba_overheads(sc.blocks_steps, sc.order))

    def first_verdict(self, rounds: int) -> dict[str, float]:
        """(training thread) Medians over ``rounds`` new guards: the worker's start-up (creation to ready), the
        first verdict after a save once it is up (the documented case: the guard is created before training),
        a later verdict of the same guard (the audit alone), and the first verdict of a save submitted the
        moment the guard is created."""
        from ckptaudit.integrations.guard import Guard

        torch, clock = self.torch, time.perf_counter
        path = os.path.join(self.work, "first.pt")
        torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": 0}, path)
        up: list[float] = []
        first: list[float] = []
        later: list[float] = []
        cold: list[float] = []
        for _ in range(rounds):
            t0 = clock()
            guard = Guard(on_failure="warn", background=self.args.background, quick=self.args.quick,
                          passport=self.args.passport == "on")
            guard.started()
            up.append(clock() - t0)
            for into in (first, later):
                t0 = clock()
                guard.submit(path)
                guard.wait()
                into.append(clock() - t0)
            guard.close()
            guard = Guard(on_failure="warn", background=self.args.background, quick=self.args.quick,
                          passport=self.args.passport == "on")
            t0 = clock()
            guard.submit(path)
            guard.wait()
            cold.append(clock() - t0)
            guard.close()
        for n in os.listdir(self.work):
            full = os.path.join(self.work, n)
            shutil.rmtree(full, ignore_errors=True) if os.path.isdir(full) else os.remove(full)
        return {k: statistics.median(v) for k, v in
                (("start", up), ("first", first), ("later", later), ("cold", cold))}

    def save_waits(self, saves: int, every: int) -> dict[str, float]:
        """(training thread) Stop mode's bound at work: a new guard (``on_failure="stop"``, ``max_unverified=1``),
        ``saves`` saves ``every`` steps apart, each preceded by ``before_save`` as the integrations do. How many
        waited, the median and largest wait (over the saves that waited), the median time of the steps between
        two saves and of an audit."""
        from ckptaudit.integrations.guard import Guard

        torch, clock = self.torch, time.perf_counter
        guard = Guard(on_failure="stop", background=self.args.background, quick=self.args.quick,
                      passport=self.args.passport == "on")
        guard.started()
        gaps: list[float] = []
        try:
            for i in range(1, saves + 1):
                guard.before_save(i)
                path = os.path.join(self.work, f"wait-{i}.pt")
                torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": i}, path)
                guard.submit(path, step=i)
                t0 = clock()
                for _ in range(every):
                    self.model(self.x).square().mean().backward()
                    self.opt.step()
                    self.opt.zero_grad(set_to_none=True)
                gaps.append(clock() - t0)
            guard.wait()
        finally:
            guard.close()
            for n in os.listdir(self.work):
                full = os.path.join(self.work, n)
                shutil.rmtree(full, ignore_errors=True) if os.path.isdir(full) else os.remove(full)
        waits = [w.seconds for w in guard.waits]
        return {"every": every, "saves": saves, "waited": len(waits),
                "median": statistics.median(waits) if waits else 0.0, "max": max(waits, default=0.0),
                "gap": statistics.median(gaps), "audit": statistics.median(v.seconds for v in guard.verdicts)}

    def close(self) -> None:
        self.guard.close()
        shutil.rmtree(self.work, ignore_errors=True)


def a_segments(sc: Scenario) -> list[float]:
    return [t for block, kind in zip(sc.blocks_wall, sc.order, strict=True)
            for t, k in zip(block, kind, strict=True) if k == "A"]


def said(sc: Scenario, ci: Interval, target: float, n_scenarios: int) -> str:
    """The verdict on ``ci``; when not resolved, the rounds to run and the budget they need (this run's pace)."""
    per_block = sc.seconds / max(1, len(sc.order))
    return verdict(ci, target, hint="run with --rounds {n} and --budget-s of {n} x "
                   f"{per_block * n_scenarios:.1f} s")


def report(loop: Loop, scenarios: list[Scenario], meta: dict[str, Any], target: float) -> list[str]:
    args = loop.args
    out = [f"bench_guard: {loop.layers} x Linear(1024, 1024), {loop.nbytes / 2**20:.0f} MiB fp32 parameters; a "
           f"{3 * loop.nbytes / 2**20:.0f} MiB checkpoint (model + AdamW) per segment of {args.steps} steps; "
           f"{', '.join(str(len(sc.order)) for sc in scenarios)} ABBA blocks; worker: {args.background}, "
           f"{'quick' if args.quick else 'full'} audit, passport {args.passport}; {meta['cores']} cores; load average {meta['load0']} at "
           f"the start, {meta['load1']} at the end"]
    for sc in scenarios:
        assert sc.wall is not None and sc.cpu is not None and sc.run is not None and sc.steps is not None
        seg = statistics.median(a_segments(sc))
        out += [f"scenario {sc.name} (torch threads {sc.threads}):",
                f"  critical path on the training thread: {100 * sc.critical / sc.guarded_wall:.4f}% of wall time "
                f"({1e6 * sc.critical / sc.submits:.0f} us per save: submit + {args.steps} should_stop polls; "
                f"{1e6 * sc.critical_cpu / sc.submits:.0f} us of it on the CPU)",
                f"  step time (the steps alone, the save and the audit wait left out): "
                f"{said(sc, sc.steps, target, len(scenarios))}",
                f"  wall time, the wait for each audit counted (an upper bound): {said(sc, sc.wall, target, len(scenarios))}",
                f"  wall time, that wait left out: {said(sc, sc.run, target, len(scenarios))}",
                f"  training process CPU time: {said(sc, sc.cpu, target, len(scenarios))}",
                f"  segment without the guard: median {seg:.3f} s; waited for the audit at the segment's end: "
                f"median {1e3 * statistics.median(sc.waited):.1f} ms, max {1e3 * max(sc.waited):.1f} ms",
                f"  training process peak RSS: {(sc.peaks['B'] - sc.peaks['A']) / 2**20:+.1f} MiB with the guard "
                f"over without ({sc.peaks['A'] / 2**20:.0f} MiB)"]
    fv = meta["first_verdict"]
    out += [f"first verdict ({meta['first_rounds']} new guards, medians): {1e3 * fv['first']:.0f} ms from the save "
            f"to its verdict with the worker started at the guard's creation (a later audit of the same guard: "
            f"{1e3 * fv['later']:.0f} ms); the worker's start-up: {1e3 * fv['start']:.0f} ms, off the training "
            f"thread; a save submitted the moment the guard is created: {1e3 * fv['cold']:.0f} ms"]
    out += [f"stop mode, a save every {w['every']} step(s) ({1e3 * w['gap']:.0f} ms of steps between saves, audits "
            f"of {1e3 * w['audit']:.0f} ms): {w['waited']} of {w['saves']} saves waited at the save, median "
            f"{1e3 * w['median']:.0f} ms, at most {1e3 * w['max']:.0f} ms" for w in meta["save_waits"]]
    out += [f"where the CPU goes per audit (passport {args.passport}): the worker process "
            f"{1e3 * meta['worker_cpu']:.1f} ms (nice 19, SCHED_IDLE), the guard's thread in the training process "
            f"{1e3 * meta['thread_cpu']:.2f} ms (/proc, {1e3 / os.sysconf('SC_CLK_TCK'):.0f} ms ticks)"]
    out += [f"audits: {meta['audits']}, median {meta['audit_s'] * 1e3:.0f} ms each, {meta['failed']} not passed; "
            + (f"worker process peak RSS {meta['worker_rss'] / 2**20:.1f} MiB" if meta["worker_rss"]
               else "thread worker: no worker process (its memory is in the training process's RSS)")]
    return out


def pct(ci: Interval) -> str:
    return f"{100 * ci.mean:+.2f}% [{100 * ci.low:+.2f}%, {100 * ci.high:+.2f}%]"


def markdown(loop: Loop, scenarios: list[Scenario], meta: dict[str, Any], target: float,
             command: str) -> dict[str, str]:
    """The docs' figure section and README's sentence, from this run."""
    rows = ["| scenario | critical path: training thread wall (CPU) per save | step time | verdict "
            "| wall time (upper bound) | verdict | wall time, audit wait left out | training process CPU time "
            "| extra RSS, training process |",
            "|---|---|---|---|---|---|---|---|---|"]
    for sc in scenarios:
        assert sc.wall is not None and sc.cpu is not None and sc.run is not None and sc.steps is not None
        rows.append(f"| {sc.name} (torch threads {sc.threads}) | {100 * sc.critical / sc.guarded_wall:.3f}% of wall: "
                    f"{1e6 * sc.critical / sc.submits:.0f} us ({1e6 * sc.critical_cpu / sc.submits:.0f} us) | "
                    f"{pct(sc.steps)} | {verdict(sc.steps, target).split(' (')[0]} | "
                    f"{pct(sc.wall)} | {verdict(sc.wall, target).split(' (')[0]} | {pct(sc.run)} | {pct(sc.cpu)} "
                    f"| {(sc.peaks['B'] - sc.peaks['A']) / 2**20:+.1f} MiB |")
    figures = "\n".join([
        f"Measured {meta['when']} on a {meta['cores']}-core machine (load average {meta['load0']} at the start, "
        f"{meta['load1']} at the end; {meta['note']}) by", "", "```", command, "```", "",
        f"{loop.layers} x `Linear(1024, 1024)` ({loop.nbytes / 2**20:.0f} MiB of fp32 parameters), a "
        f"{3 * loop.nbytes / 2**20:.0f} MiB checkpoint of model + AdamW per segment of {loop.args.steps} steps, "
        f"{' and '.join(str(len(sc.order)) for sc in scenarios)} ABBA blocks, {loop.args.background} worker, "
        f"{'quick' if loop.args.quick else 'full'} audit, passport {loop.args.passport} (median {meta['audit_s'] * 1e3:.0f} ms per checkpoint); "
        + (f"the worker process's peak RSS: {meta['worker_rss'] / 2**20:.0f} MiB." if meta["worker_rss"] else
           "a thread worker (its memory is in the training process's RSS).") + " Overheads are means of the blocks' "
        "paired differences with their 95% intervals; the verdict is on the upper bound (each guarded segment "
        "waits, timed, for its audit):", "", *rows, "",
        f"First verdict ({meta['first_rounds']} new guards, medians): {1e3 * meta['first_verdict']['first']:.0f} ms "
        f"from the save to its verdict with the worker started when the guard was created (a later audit of the "
        f"same guard: {1e3 * meta['first_verdict']['later']:.0f} ms); the worker's start-up, "
        f"{1e3 * meta['first_verdict']['start']:.0f} ms, runs off the training thread before the first save; a "
        f"save submitted the moment the guard is created waits for it: "
        f"{1e3 * meta['first_verdict']['cold']:.0f} ms.", "",
        "Stop mode's wait at the save (`on_failure=\"stop\"`: `max_unverified=1`; "
        f"{meta['save_waits'][0]['saves']} saves each, the training thread waiting in `before_save` for the "
        "verdict of the save before): " + "; ".join(
            f"a save every {w['every']} step{'s' if w['every'] > 1 else ''} ({1e3 * w['gap']:.0f} ms of steps "
            f"between saves, audits of {1e3 * w['audit']:.0f} ms): {w['waited']} of {w['saves']} saves waited"
            + (f", {1e3 * w['median']:.0f} ms (median; at most {1e3 * w['max']:.0f} ms)" if w["waited"] else "")
            for w in meta["save_waits"]) + ".", ""])
    free = next((s for s in scenarios if s.name == "free-core"), scenarios[0])
    assert free.wall is not None and free.steps is not None
    sentence = (f"Its cost, measured by `{command}` on a {meta['cores']}-core machine (load average "
                f"{meta['load0']}), a checkpoint every {loop.args.steps} steps: "
                f"{1e6 * free.critical_cpu / free.submits:.0f} us of CPU per save on the training "
                f"thread ({100 * free.critical / free.guarded_wall:.2f}% of wall time); step time with a core free "
                f"for the audit (a GPU job's host): {verdict(free.steps, target).split(', mean')[0]})"
                + "".join(f", with every core busy training: {verdict(s.steps, target).split(', mean')[0]})"
                          for s in scenarios if s.name == "saturated")
                + (f"; the worker holds {meta['worker_rss'] / 2**20:.0f} MiB." if meta["worker_rss"] else "."))
    return {"figures": figures, "sentence": sentence}


def write_docs(paths: list[str], parts: dict[str, str]) -> None:
    """Replace the text between each pair of markers (:data:`MARKERS`) found in each file; a file with none is
    an error (exit 2), so a moved section is never silently left stale."""
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        found = 0
        for name, (begin, end) in MARKERS.items():
            i, j = text.find(begin), text.find(end)
            if i < 0 or j < i:
                continue
            text = text[:i + len(begin)] + "\n" + parts[name] + "\n" + text[j:]
            found += 1
        if not found:
            print(f"bench_guard: {path} has no {' / '.join(b for b, _ in MARKERS.values())} markers; add a "
                  "pair where the figures belong", file=sys.stderr)
            raise SystemExit(2)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        print(f"bench_guard: wrote the figures into {path}")


def shown_args(argv: list[str] | None) -> list[str]:
    """The command line as the docs show it: without ``--write-docs`` and its files."""
    out, skipping = [], False
    for a in argv if argv is not None else sys.argv[1:]:
        if a == "--write-docs" or a.startswith("--write-docs="):
            skipping = a == "--write-docs"
            continue
        if skipping and not a.startswith("--"):
            continue
        skipping = False
        out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=16, help="MiB of fp32 parameters (checkpoint: 3x with AdamW)")
    p.add_argument("--steps", type=int, default=6, help="steps per segment (one save per segment)")
    p.add_argument("--rounds", type=int, default=100, help="ABBA blocks (four segments each) per scenario, at most")
    p.add_argument("--budget-s", type=float, default=210.0,
                   help="seconds of measured blocks, all scenarios together (3 blocks each at least)")
    p.add_argument("--scenario", choices=[*SCENARIOS, "both"], default="both")
    p.add_argument("--background", choices=["thread", "process"], default="process")
    p.add_argument("--quick", action="store_true", help="the quick audit (first chunk, no hashes)")
    p.add_argument("--passport", choices=["on", "off"], default="on",
                   help="the guard writes a passport beside each passing checkpoint (its default) or not")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--target", type=float, default=1.0, help="the overhead to resolve, in percent")
    p.add_argument("--write-docs", nargs="+", metavar="FILE.md",
                   help="rewrite the figures between the bench_guard markers in these files")
    p.add_argument("--first-rounds", type=int, default=5, help="new guards timed for the first verdict")
    p.add_argument("--wait-saves", type=int, default=10, help="saves per cadence for stop mode's wait at the save")
    p.add_argument("--note", default="shared with other jobs",
                   help="what the docs say about the machine's state")
    args = p.parse_args(argv)
    if args.rounds < 2 or args.steps < 1:
        p.error(f"--rounds needs at least 2 blocks (got {args.rounds}) and --steps at least 1 (got {args.steps})")
    names = SCENARIOS if args.scenario == "both" else (args.scenario,)
    scenarios = [Scenario(n, 1 if n == "free-core" else cores()) for n in names]
    meta: dict[str, Any] = {"cores": cores(), "load0": load(), "when": time.strftime("%Y-%m-%d"),
                            "note": args.note, "machine": platform.machine()}
    loop = Loop(args)
    try:
        meta["first_rounds"] = args.first_rounds
        meta["first_verdict"] = loop.first_verdict(args.first_rounds)
        meta["save_waits"] = [loop.save_waits(args.wait_saves, every) for every in sorted({args.steps, 1},
                                                                                            reverse=True)]
        cpu0, audits0 = where_cpu(loop.guard), len(loop.guard.verdicts)
        for sc in scenarios:
            loop.run(sc, args.rounds, args.budget_s / len(scenarios))
        verdicts = loop.guard.verdicts
        cpu1, n = where_cpu(loop.guard), max(1, len(verdicts) - audits0)
        meta["worker_cpu"], meta["thread_cpu"] = (cpu1[0] - cpu0[0]) / n, (cpu1[1] - cpu0[1]) / n
        meta["audits"] = len(verdicts)
        meta["audit_s"] = statistics.median(v.seconds for v in verdicts)
        meta["failed"] = sum(v.ok is not True for v in verdicts)
        meta["worker_rss"] = child_hwm(loop.guard)
    finally:
        loop.close()
    meta["load1"] = load()
    target = args.target / 100
    print("\n".join(report(loop, scenarios, meta, target)))
    if args.write_docs:
        command = " ".join([".venv/bin/python bench/bench_guard.py", *(shlex.quote(a) for a in shown_args(argv))])
        write_docs(args.write_docs, markdown(loop, scenarios, meta, target, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
