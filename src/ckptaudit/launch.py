"""Run a function on several real ``torch.distributed`` processes and collect what each returns.

This is the one place where ckptaudit starts the ranks of a distributed job: every distributed part (the demo,
the resume experiment, the probe's CLI, the tests) calls :func:`launch`. (The guard's background audit is one
plain child process, started by :mod:`ckptaudit.integrations.guard`.)

Order of events:

1. (parent) makes a private temporary directory holding the ``FileStore`` file, one result file and one
   standard-error file per rank.
2. (all ranks, each a fresh ``spawn`` process) point their file descriptor 2 at their standard-error file (so
   whatever the rank's C and C++ code, glibc's heap checks and ``faulthandler`` write lands there, even when
   the rank dies by a signal), join the process group through the ``FileStore`` with a bounded ``timeout``
   (no free port is needed, so parallel launches cannot collide), run ``fn(ctx, *args)``, write the result
   (or the formatted exception) to their result file, and tear the group down.
3. (parent) waits for all ranks until ``timeout_s``, copying what each rank writes to its standard error onto
   its own, line by line behind a ``[rank N]`` tag; when the deadline passes it asks the ranks still alive for
   the Python stacks of all their threads (``SIGUSR1``, see :mod:`faulthandler`), then kills them, and reaps
   every child, so no process outlives the call. Failures of all ranks are reported once, in one
   :class:`DistributedError` tagged by rank, with the last lines each failed rank wrote to its standard error.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TORCH_PRELOAD", "DistributedError", "RankContext", "RankFailure", "fast", "launch"]


@dataclass(frozen=True)
class RankContext:
    """What a rank's function receives: its place in the job and a scratch directory shared by all ranks."""

    rank: int
    world_size: int
    backend: str
    shared_dir: str
    """A directory every rank can read and write (on the parent's machine); removed after the launch."""


@dataclass(frozen=True)
class RankFailure:
    """Why one rank did not return a result."""

    rank: int
    reason: str
    """``"exception"``, ``"exit"`` (the process died, e.g. by a signal) or ``"timeout"``."""
    detail: str
    stderr: str = ""
    """The last lines the rank wrote to its standard error (at most :data:`STDERR_TAIL_LINES`): for a rank
    that died by a signal, where glibc, torch or :mod:`faulthandler` said why."""
    first: bool = False
    """The likely cause: the failed rank the parent saw end first (of those seen in the same poll, one that died
    rather than raised: its peers' errors usually only say that it vanished)."""


STDERR_TAIL_LINES = 25
"""How many of a failed rank's last standard-error lines :class:`DistributedError` carries and prints."""


@dataclass
class DistributedError(Exception):
    """One or more ranks failed; ``failures`` holds one record per failed rank, in rank order."""

    failures: list[RankFailure] = field(default_factory=list)
    results: dict[int, Any] = field(default_factory=dict)
    """Results of the ranks that did finish, by rank."""

    def __str__(self) -> str:
        first = next((f.rank for f in self.failures if f.first), None)
        lines = [f"{len(self.failures)} rank(s) failed" + (f" (rank {first} first)" if first is not None and
                                                           len(self.failures) > 1 else "") + ":"]
        # The rank that ended first is listed first: the others usually only saw their peer vanish.
        for f in sorted(self.failures, key=lambda f: (not f.first, f.rank)):
            detail = f.detail.strip().splitlines()
            tail = detail[-1] if detail else ""
            lines.append(f"  rank {f.rank}: {f.reason}: {tail}")
            if f.stderr.strip():
                lines.append(f"    last lines of rank {f.rank}'s stderr:")
                lines.extend(f"    | {line}" for line in f.stderr.rstrip().splitlines())
        return "\n".join(lines)


def _child(
    rank: int,
    world_size: int,
    backend: str,
    store_path: str,
    shared_dir: str,
    result_path: str,
    stderr_path: str,
    pg_timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
) -> None:
    # The child process body. Runs in a fresh interpreter (spawn), so imports happen here.
    _capture_stderr(stderr_path)
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # init_process_group returns on a gloo rank once its own side of the mesh is connected; a rank whose job ends
    # at once could then exit while a slower peer is still connecting to it ("Gloo connectFullMesh failed ...
    # Connection closed by peer", seen under load). torch's store-based barrier at the end of init closes that.
    os.environ.setdefault("TORCH_DIST_INIT_BARRIER", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    outcome: tuple[str, Any]
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        ctx = RankContext(rank=rank, world_size=world_size, backend=backend, shared_dir=shared_dir)
        outcome = ("ok", fn(ctx, *args))
    except BaseException:  # noqa: BLE001 - report everything, including DCP's BaseException subclass
        outcome = ("error", traceback.format_exc())
    try:
        with open(result_path + ".tmp", "wb") as fh:
            pickle.dump(outcome, fh)
        os.replace(result_path + ".tmp", result_path)
    except Exception:  # noqa: BLE001 - an unpicklable result becomes a failure the parent reports
        with open(result_path + ".tmp", "wb") as fh:
            pickle.dump(("error", "result could not be pickled:\n" + traceback.format_exc()), fh)
        os.replace(result_path + ".tmp", result_path)
    if dist.is_initialized():
        # Do not barrier here: a failed rank must not wait for the others.
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001,S110 - teardown of a broken group is best effort
            pass
    # Skip interpreter teardown; gloo threads of a broken group can otherwise hang exit.
    os._exit(0 if outcome[0] == "ok" else 1)


def _capture_stderr(path: str) -> None:
    """(each rank, first thing) Send file descriptor 2 to ``path``, and make a fatal signal explain itself there.

    The descriptor itself is redirected, not ``sys.stderr``: glibc's heap checks ("free(): invalid pointer"),
    torch's C++ warnings and :mod:`faulthandler` write to descriptor 2 directly, and what the kernel has
    received survives the process dying by a signal (a pipe read by a thread of the dying rank would not).
    """
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    # glibc writes its fatal messages (heap corruption) to the terminal unless told to use stderr.
    os.environ.setdefault("LIBC_FATAL_STDERR_", "1")
    # SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL: the Python stack of every thread, then the default action.
    faulthandler.enable(all_threads=True)
    # The parent's deadline: the stacks of a rank that hangs, just before it is killed.
    faulthandler.register(signal.SIGUSR1, all_threads=True)


TORCH_PRELOAD = ("torch", "torch.distributed.fsdp", "torch.distributed.checkpoint", "ckptaudit.exporters",
                 "ckptaudit.recipes.tinygpt")
"""What the fork server imports once for ckptaudit's own jobs (see ``start_method`` of :func:`launch`)."""


def fast(*modules: str) -> dict[str, Any]:
    """``launch`` options for ranks forked from a server that imported torch (and ``modules``) once: each rank
    is still a fresh process that has run nothing, but starts in a fraction of a second instead of ~2 s of CPU."""
    return {"start_method": "forkserver", "preload": (*TORCH_PRELOAD, *modules)}


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 300.0,
    backend: str | None = None,
    pg_timeout_s: float | None = None,
    env: dict[str, str] | None = None,
    shared_dir: str | None = None,
    start_method: str = "spawn",
    preload: Sequence[str] = (),
) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` real processes; return the results in rank order.

    ``fn`` must be importable by name (a module-level function), as must ``args``. ``backend`` defaults to
    ``nccl`` when CUDA has enough devices, else ``gloo``. ``timeout_s`` bounds the whole launch;
    ``pg_timeout_s`` (default: ``timeout_s``) bounds each collective, so a rank whose peer died ends with
    an error instead of waiting forever. Raises :class:`DistributedError` when any rank fails.

    ``start_method``: ``spawn`` (every rank a fresh interpreter) or ``forkserver``: ranks are forked from one
    server process per parent that imported the modules in ``preload`` once (the first launch's list wins),
    so 8 ranks start in a fraction of a second instead of each importing torch (about 2 s of CPU apiece).
    The server only imports; it runs no torch operation and starts no thread pool, so forking it is safe.
    """
    import torch.multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', not {start_method!r}")
    if backend is None:
        backend = _default_backend(world_size)
    ctx: Any = mp.get_context(start_method)
    if start_method == "forkserver":
        _start_forkserver(ctx, preload)
    own_tmp = tempfile.mkdtemp(prefix="ckptaudit-launch-")
    try:
        store_path = os.path.join(own_tmp, "store")
        shared = shared_dir or os.path.join(own_tmp, "shared")
        os.makedirs(shared, exist_ok=True)
        result_paths = [os.path.join(own_tmp, f"result-{r}.pkl") for r in range(world_size)]
        stderr_paths = [os.path.join(own_tmp, f"stderr-{r}.log") for r in range(world_size)]
        procs = []
        for rank in range(world_size):
            p = ctx.Process(
                target=_child,
                args=(
                    rank,
                    world_size,
                    backend,
                    store_path,
                    shared,
                    result_paths[rank],
                    stderr_paths[rank],
                    float(pg_timeout_s if pg_timeout_s is not None else timeout_s),
                    fn,
                    tuple(args),
                    dict(env or {}),
                ),
                daemon=False,
            )
            p.start()
            procs.append(p)
        return _collect(procs, result_paths, _Echo(stderr_paths), timeout_s)
    finally:
        shutil.rmtree(own_tmp, ignore_errors=True)


def _start_forkserver(ctx: Any, preload: Sequence[str]) -> None:
    """Start the fork server (once per process) importing ``preload`` with this process's ``sys.path``.

    Python 3.11's fork server ignores the parent's ``sys.path`` when it imports ``preload``, so an installed
    copy of a package could shadow the one under test; it does inherit the environment, hence ``PYTHONPATH``.
    """
    from multiprocessing import forkserver

    if preload:
        ctx.set_forkserver_preload(list(preload))
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in sys.path if p)
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def _default_backend(world_size: int) -> str:
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
            return "nccl"
    except Exception:  # noqa: BLE001, S110 - no CUDA means gloo
        pass
    return "gloo"


class _Echo:
    """(parent) Copies what each rank writes to its standard-error file onto the parent's, a whole line at a time
    behind a ``[rank N]`` tag, and keeps each file's tail for the failure message."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self.offsets = [0] * len(paths)
        self.partial = [b""] * len(paths)

    def pump(self, *, final: bool = False) -> None:
        for rank, path in enumerate(self.paths):
            try:
                with open(path, "rb") as fh:
                    fh.seek(self.offsets[rank])
                    data = fh.read(1 << 20)
            except FileNotFoundError:
                continue
            self.offsets[rank] += len(data)
            data = self.partial[rank] + data
            cut = len(data) if final else data.rfind(b"\n") + 1
            self.partial[rank] = data[cut:]
            if cut:
                self._write(rank, data[:cut])

    @staticmethod
    def _write(rank: int, data: bytes) -> None:
        text = data.decode("utf-8", "replace")
        try:
            sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
            sys.stderr.flush()
        except (OSError, ValueError):  # the parent's stderr is closed or gone: the files still hold it all
            pass

    def tail(self, rank: int, lines: int = STDERR_TAIL_LINES) -> str:
        try:
            with open(self.paths[rank], "rb") as fh:
                fh.seek(max(0, os.fstat(fh.fileno()).st_size - 64 * 1024))
                data = fh.read()
        except FileNotFoundError:
            return ""
        kept = [line for line in data.decode("utf-8", "replace").splitlines() if line.strip()]
        return "\n".join(kept[-lines:])

    def size(self, rank: int) -> int:
        try:
            return os.stat(self.paths[rank]).st_size
        except FileNotFoundError:
            return 0


def _collect(procs: list[Any], result_paths: list[str], echo: _Echo, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    ended: dict[int, int] = {}  # rank -> the poll in which it was first seen ended
    killed: set[int] = set()
    try:
        # Ranks whose peer died end on their own through the process group's timeout; the deadline only
        # catches what that does not (a rank stuck outside collectives).
        polls = 0
        while time.monotonic() < deadline:
            polls += 1
            for rank, p in enumerate(procs):
                if rank not in ended and not p.is_alive():
                    ended[rank] = polls
            echo.pump()
            if len(ended) == len(procs):
                break
            time.sleep(0.05)
    finally:
        alive = [rank for rank, p in enumerate(procs) if p.is_alive()]
        killed.update(alive)  # past the deadline: a timeout, even if the stack request below ends it first
        if alive:
            _dump_stacks(procs, alive, echo)
        for rank in alive:
            try:
                os.kill(procs[rank].pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            p.join(timeout=10)
        echo.pump(final=True)
    results: dict[int, Any] = {}
    failures: list[RankFailure] = []
    for rank, (p, rp) in enumerate(zip(procs, result_paths, strict=True)):
        if os.path.exists(rp):
            with open(rp, "rb") as fh:
                status, value = pickle.load(fh)  # noqa: S301 - written by our own child process
            if status == "ok":
                results[rank] = value
            else:
                failures.append(RankFailure(rank, "exception", str(value), echo.tail(rank)))
        elif rank in killed:
            failures.append(RankFailure(rank, "timeout", f"no result within {timeout_s:.0f} s; killed",
                                        echo.tail(rank)))
        else:
            failures.append(RankFailure(rank, "exit", _exit_text(p.exitcode), echo.tail(rank)))
    if failures:
        first = min(failures, key=lambda f: (ended.get(f.rank, 1 << 62), f.reason != "exit", f.rank)).rank
        failures = [RankFailure(f.rank, f.reason, f.detail, f.stderr, f.rank == first) for f in failures]
        raise DistributedError(failures=failures, results=results)
    return [results[r] for r in range(len(procs))]


def _dump_stacks(procs: list[Any], alive: list[int], echo: _Echo) -> None:
    """(parent, at the deadline) Ask each rank still alive for its threads' Python stacks and wait (briefly) until
    they are written, so that a hang is reported with where it hung."""
    sizes = {rank: echo.size(rank) for rank in alive}
    for rank in alive:
        try:
            os.kill(procs[rank].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    until = time.monotonic() + 2.0
    while time.monotonic() < until and any(echo.size(r) == sizes[r] and procs[r].is_alive() for r in alive):
        time.sleep(0.05)
    time.sleep(0.1)  # the dump is written a frame at a time


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"process ended with exit code {code} (killed by {name})"
    return f"process ended with exit code {code}"
