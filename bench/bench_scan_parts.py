"""Where the scan's time goes: CPU seconds per GB of each part of :func:`ckptaudit.auditing.tensor_scan.scan_tensor`, on one thread.

    .venv/bin/python bench/bench_scan_parts.py                 # 1 GiB of genuine fp32, then of bf16-rounded fp32
    .venv/bin/python bench/bench_scan_parts.py --mib 512 --repeat 5
    .venv/bin/python bench/bench_scan_parts.py --threads 2         # each part on 1 thread, then on 2 at once

Writes a raw file of fp32 values (``randn * 0.02``, and the same rounded to bf16) to a temporary directory and
reads it back from the page cache in ``--chunk-kib`` chunks, timing each part alone with ``time.process_time``
(CPU time of this single-threaded process: wall time lies on a shared machine). The parts, each over every
chunk of the same bytes:

- ``mmap read``: xor-reduce of every 8-byte word through a read-only map (what ``bench_realistic``'s baseline
  does per thread);
- ``pread``: ``os.preadv`` into one reused buffer (the kernel's copy from the page cache, what the scan reads
  with);
- ``xxh3_128``: the hash alone, over one chunk already in cache, as the scan hashes a chunk just read;
- ``1st-chunk precision``: the fp32 precision statistics of a tensor's first chunk (``_Fp32State.update`` on a
  fresh state), over one chunk already in cache: what every tensor pays once (later chunks of a genuine fp32
  tensor skip it; a bf16-rounded one pays the OR-reduction on every chunk);
- ``pread + xxh3``: the two together, chunk by chunk (what the scan does to every chunk of a genuine fp32 tensor
  after its first where the file cannot be leased, and did everywhere before);
- ``leased map + xxh3``: each 8 MiB chunk hashed where it lies in the page cache, under a read lease
  (:mod:`ckptaudit.formats.io.leased`: what the scan does to those chunks where it can; Linux);
- ``scan_tensor``: the whole scan of the file as one tensor (read + hash + precision).

Prints CPU s/GB for each (best of ``--repeat``) and the load average at the start: on a loaded machine CPU time
still grows with cache and memory-bandwidth contention, so compare figures from the same run. ``--threads N``
also runs each part on N threads at once, each over its own 1/N of the file with its own buffer (as the audit's
scanning threads do), and prints, per part, the CPU s/GB of one thread and of N, and the wall-time speed-up of N
threads over one (N would be perfect): where the two differ, the threads compete for something (memory
bandwidth, the GIL) rather than for cores. ``--src DIR``
measures another copy of the package (an earlier commit's ``src``, e.g. from ``git worktree add``).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
# --src measures another source tree (the code before a change): put first, before the installed package.
_SRC = sys.argv[sys.argv.index("--src") + 1] if "--src" in sys.argv[:-1] else None
if _SRC:
    sys.path.insert(0, _SRC)

import numpy as np  # noqa: E402
import xxhash  # noqa: E402

from ckptaudit.auditing.tensor_scan import _Fp32State, scan_tensor  # noqa: E402
from ckptaudit.formats.io.tensors import DTYPES, FileMaps, Piece, TensorData  # noqa: E402

try:  # absent before the scan reused its buffers: this script also measures earlier commits' src
    from ckptaudit.formats.io.tensors import scratch_buffer
except ImportError:
    scratch_buffer = None
try:  # absent before chunks were hashed in the page cache under a lease
    from ckptaudit.auditing.tensor_scan import MAPPED_CHUNK_BYTES
    from ckptaudit.formats.io.leased import LeasedFile, mapped_reads_enabled
except ImportError:
    LeasedFile = None  # type: ignore[assignment,misc]


def write(path: str, mib: int, rounded: bool) -> int:
    rng = np.random.default_rng(0)
    n = mib * (1 << 20) // 4
    with open(path, "wb") as fh:
        step = 1 << 22
        for lo in range(0, n, step):
            x = (rng.standard_normal(min(step, n - lo), dtype=np.float32) * np.float32(0.02))
            if rounded:
                u = x.view(np.uint32)
                u += np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))  # round to nearest even
                u &= np.uint32(0xFFFF0000)
            fh.write(x.tobytes())
    return n * 4


def cpu(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def parts(path: str, lo: int, hi: int, chunk: int, mm: mmap.mmap, fd: int) -> dict[str, Callable[[], object]]:
    """The parts, each over the chunks of ``[lo, hi)`` of the file (one thread's share), with their own buffers."""
    buf = np.empty(chunk // 4, dtype=np.float32)
    raw = buf.data.cast("B")
    # One chunk already in L2 (the scan hashes and checks each chunk right after reading it into its buffer).
    held = np.frombuffer(mm, np.float32, chunk // 4, lo).copy()
    nchunks = (hi - lo) // chunk

    def mmap_read() -> None:
        for off in range(lo, hi, chunk):
            np.bitwise_xor.reduce(np.frombuffer(mm, np.uint64, chunk // 8, off))

    def pread() -> None:
        for off in range(lo, hi, chunk):
            os.preadv(fd, [raw], off)

    def hash_only() -> None:
        h = xxhash.xxh3_128()
        for _ in range(nchunks):
            h.update(held.data)

    def pread_hash() -> None:
        h = xxhash.xxh3_128()
        for off in range(lo, hi, chunk):
            os.preadv(fd, [raw], off)
            h.update(raw)

    def leased_hash() -> None:
        # What the scan does to the chunks of a tensor once its precision is decided: each 8 MiB chunk hashed
        # where it lies in the page cache, under the file's read lease (formats/io/leased.py).
        lf = LeasedFile(fd)
        step = MAPPED_CHUNK_BYTES
        h = xxhash.xxh3_128()
        for off in range(lo, hi, step):
            view = lf.view(off, min(step, hi - off))
            assert view is not None, "no lease on the benchmark's file"
            h.update(view)
            lf.done(view, off)
        lf.close()

    def stats_first() -> None:
        for _ in range(nchunks):
            _Fp32State().update(held)

    def scan() -> None:
        n = (hi - lo) // 4
        data = TensorData(DTYPES["float32"], (n,), (Piece(path, lo, 0, (n,), (1,), (0,)),))
        with FileMaps() as maps:
            if scratch_buffer is None:
                scan_tensor(data, maps, chunk)
            else:
                scan_tensor(data, maps, chunk, scratch_buffer(chunk))

    out: dict[str, Callable[[], object]] = {"mmap read": mmap_read, "pread": pread, "xxh3_128": hash_only,
                                            "pread + xxh3": pread_hash}
    if LeasedFile is not None and mapped_reads_enabled():
        out["leased map + xxh3"] = leased_hash
    out.update({"1st-chunk precision": stats_first, "scan_tensor": scan})
    return out


def on_threads(fns: list[Callable[[], object]]) -> tuple[float, float]:
    """Wall and CPU seconds (every thread of the process) of running ``fns`` at once, one thread each."""
    t0, c0 = time.perf_counter(), time.process_time()
    threads = [threading.Thread(target=fn) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, time.process_time() - c0


def measure(path: str, nbytes: int, chunk: int, repeat: int, label: str, threads: int) -> None:
    gb = nbytes / 1e9
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    whole = parts(path, 0, nbytes, chunk, mm, fd)
    per = nbytes // threads // chunk * chunk
    shares = [parts(path, t * per, (t + 1) * per, chunk, mm, fd) for t in range(threads)]
    try:
        for name, fn in whole.items():
            secs = cpu(fn, repeat)
            rate = f"{gb / secs:6.1f} GB/s" if secs else "   (too fast to time)"
            line = f"  {label:18s} {name:20s} {secs / gb:7.3f} s/GB  ({rate})"
            if threads > 1:
                # Alternating one thread over N shares and N threads at once, best of each: the same bytes.
                one = many = (float("inf"), float("inf"))
                fns = [s[name] for s in shares]
                for _ in range(repeat):
                    one = min(one, on_threads([lambda fns=fns: [fn() for fn in fns]]))  # type: ignore[misc]
                    many = min(many, on_threads(fns))
                line += (f"  | {threads * per / 1e9:.2f} GB: 1 thread {one[1] / (threads * per / 1e9):.3f}, "
                         f"{threads} threads {many[1] / (threads * per / 1e9):.3f} CPU s/GB, "
                         f"speed-up {one[0] / many[0]:.2f}x")
            print(line)
    finally:
        mm.close()
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--chunk-kib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="also run each part on this many threads at once (each over its share of the file)")
    ap.add_argument("--src", default=_SRC, help="the ckptaudit source tree to measure (default: this checkout's)")
    args = ap.parse_args()
    chunk = args.chunk_kib * 1024
    tmp = tempfile.mkdtemp(prefix="ckptaudit-parts-")
    print(f"{_SRC}: load average {os.getloadavg()[0]:.2f}; {args.mib} MiB, chunks of {args.chunk_kib} KiB, "
          f"best of {args.repeat}, CPU s/GB (one thread)"
          + (f"; then 1 thread against {args.threads} at once" if args.threads > 1 else ""))
    try:
        for rounded in (False, True):
            path = os.path.join(tmp, "x.bin")
            nbytes = write(path, args.mib, rounded)
            measure(path, nbytes, chunk, args.repeat, "bf16-rounded fp32" if rounded else "genuine fp32", args.threads)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
