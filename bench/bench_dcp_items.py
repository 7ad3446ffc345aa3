"""CPU per DCP item of the archive work of the open phase, against a plain read of the same bytes in the same run.

    .venv/bin/python bench/bench_dcp_items.py                          # writes a DCP checkpoint of 4000 small tensors
    .venv/bin/python bench/bench_dcp_items.py --dcp scratch/scale-0.1/dcp-1 scratch/scale-0.1/dcp-8

(the second form reads the checkpoints ``bench/bench_realistic.py --scale 0.1 --dir scratch --keep`` left.)
For each DCP directory, in one process, rounds alternate between: a plain read of the bytes the reader needs
of every item (each data file opened once; an item of up to 8 KiB whole, a longer one's first and last 4 KiB:
the floor, the reader's own ``pread`` calls and nothing else), every item read as ``read_dcp`` reads it
(:class:`ckptaudit.formats.zip.archive.TorchZipFiles`: each data file opened once, every archive checked, tensors
located), and :func:`ckptaudit.formats.zip.archive.read_torch_zip` once per item (opens the file per call). The
``.metadata`` parse is left out (``bench_realistic.py --open-only`` times the whole open). Each figure is the
best round's CPU time (``time.process_time``) per item, with the load average, and the ratio to the plain read.
Every item is read once before the rounds: the pickles of items of one shape are scanned and loaded once per
process, as in an audit.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))

from ckptaudit.formats.dcp.metadata import load_dcp_metadata  # noqa: E402
from ckptaudit.formats.zip.archive import TorchZipFiles, read_torch_zip  # noqa: E402


def write_dcp(path: str, tensors: int) -> None:
    """A single-process ``torch.distributed.checkpoint.save`` of ``tensors`` small tensors of a few shapes."""
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    shapes = [(64,), (64, 64), (256,), (128, 32)]
    sd = {f"layers.{i}.w": torch.randn(shapes[i % len(shapes)], generator=g) for i in range(tensors)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": a single-process save is what we want
        dcp.save(sd, checkpoint_id=path)


def measure(path: str, rounds: int) -> dict[str, float]:
    with open(os.path.join(path, ".metadata"), "rb") as fh:
        md = load_dcp_metadata(fh.read())
    items = [(os.path.join(path, s.relative_path), s.offset, s.length) for s in md.storage_data.values()]

    def plain() -> None:
        fds: dict[str, int] = {}
        try:
            for f, o, n in items:
                fd = fds.get(f)
                if fd is None:
                    fd = fds[f] = os.open(f, os.O_RDONLY)
                if n <= 8192:
                    os.pread(fd, n, o)
                else:
                    os.pread(fd, 4096, o)
                    os.pread(fd, 4096, o + n - 4096)
        finally:
            for fd in fds.values():
                os.close(fd)

    def files() -> None:
        with TorchZipFiles() as archives:
            for f, o, n in items:
                archives.read(f, o, n)

    def per_call() -> None:
        for f, o, n in items:
            read_torch_zip(f, o, n)

    ways: dict[str, Callable[[], None]] = {"plain pread": plain, "TorchZipFiles": files, "read_torch_zip": per_call}
    for run in ways.values():
        run()  # warm: page cache, memoised pickles and layouts
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(rounds):
        for name, run in ways.items():
            t = time.process_time()
            run()
            best[name] = min(best[name], time.process_time() - t)
    return {"items": len(items), **{k: v / len(items) * 1e6 for k, v in best.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dcp", nargs="*", default=[], help="DCP directories to read (default: write one)")
    ap.add_argument("--tensors", type=int, default=4000, help="tensors of the checkpoint written without --dcp")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckptaudit-items-") as tmp:
        paths = args.dcp
        if not paths:
            paths = [os.path.join(tmp, "dcp")]
            write_dcp(paths[0], args.tensors)
        print(f"load average {os.getloadavg()[0]:.1f} at the start; CPU per item, best of {args.rounds} rounds")
        for path in paths:
            r = measure(path, args.rounds)
            base = r["plain pread"]
            print(f"{path}: {r['items']:.0f} items: plain pread {base:.1f} us, "
                  f"TorchZipFiles {r['TorchZipFiles']:.1f} us ({r['TorchZipFiles'] / base:.1f}x), "
                  f"read_torch_zip per call {r['read_torch_zip']:.1f} us ({r['read_torch_zip'] / base:.1f}x)")
        print(f"load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
