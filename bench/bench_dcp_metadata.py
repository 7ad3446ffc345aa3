"""Where a DCP ``.metadata``'s load goes, stage by stage: the opcode walk, the C unpickler's load, the rebuild.

    .venv/bin/python bench/bench_dcp_metadata.py scratch/scale-0.25/dcp-8 scratch/scale-0.25/dcp-1

(directories ``bench/bench_realistic.py --scale 0.25 --dir scratch --keep --formats dcp-1,dcp-8`` left; any DCP
directory will do.) For each ``.metadata``, in this one process, ``--rounds`` rounds of every stage, each figure
the best round's CPU time (``time.process_time``):

- ``opcodes (bare loop)``: a Python loop that only steps over the opcodes (their lengths, no checks): the floor of
  any walk written in Python;
- ``walk``: :func:`ckptaudit.formats.pickle.scan.scan`, the proof the fast load needs (globals, limits, *plain*);
- ``C load``: the C unpickler through the stand-ins (what :func:`~ckptaudit.formats.dcp.metadata.load_dcp_metadata`
  runs on a plain pickle), and ``rebuild``: its result rebuilt as frozen records;
- ``load (as the audit)``: ``load_dcp_metadata`` given the walk's result (C load + rebuild);
- ``restricted load``: the pure-Python restricted unpickler + tree check + rebuild (what a pickle that is not
  plain takes).

Prints a table per file: seconds, microseconds per opcode, and the share of walk + load.
"""

from __future__ import annotations

import argparse
import os
import pickletools
import time
from collections.abc import Callable
from typing import Any

from ckptaudit.formats.dcp import metadata as dm
from ckptaudit.formats.pickle.allowlist import DCP_METADATA_GLOBALS
from ckptaudit.formats.pickle.scan import opcode_limit, scan

_FIXED = [1] * 256
"""Each opcode's length where its argument has a fixed size."""
_PREFIX = [0] * 256
"""Bytes of the length prefix of an opcode whose argument is length-prefixed (-1: up to a newline)."""
for _op in pickletools.opcodes:
    _n = 0 if _op.arg is None else _op.arg.n
    if _n > 0:
        _FIXED[ord(_op.code)] = 1 + _n
    elif _n == pickletools.UP_TO_NEWLINE:
        _PREFIX[ord(_op.code)] = -1
    elif _n == pickletools.TAKEN_FROM_ARGUMENT1:
        _PREFIX[ord(_op.code)] = 1
    elif _n in (pickletools.TAKEN_FROM_ARGUMENT4, pickletools.TAKEN_FROM_ARGUMENT4U):
        _PREFIX[ord(_op.code)] = 4
    elif _n == pickletools.TAKEN_FROM_ARGUMENT8U:
        _PREFIX[ord(_op.code)] = 8


def bare_loop(buf: bytes) -> int:
    """Step over a pickle's opcodes (their lengths, nothing checked, nothing built): the loop any walk needs."""
    pos, n, end, fixed, prefix = 0, 0, len(buf), _FIXED, _PREFIX
    while pos < end:
        c = buf[pos]
        k = prefix[c]
        if not k:
            pos += fixed[c]
        elif k == 1:
            pos += 2 + buf[pos + 1]
        elif k > 0:
            pos += 1 + k + int.from_bytes(buf[pos + 1:pos + 1 + k], "little")
        else:
            pos = buf.index(b"\n", pos) + 1
            if c in (0x63, 0x69):  # GLOBAL, INST: two lines
                pos = buf.index(b"\n", pos) + 1
        n += 1
    return n


def best(fn: Callable[[], Any], rounds: int) -> float:
    out = float("inf")
    for _ in range(rounds):
        t = time.process_time()
        fn()
        out = min(out, time.process_time() - t)
    return out


def measure(path: str, rounds: int) -> None:
    with open(os.path.join(path, ".metadata"), "rb") as fh:
        data = fh.read()
    opcodes = sum(1 for _ in pickletools.genops(data))
    scanned = scan(data, DCP_METADATA_GLOBALS, max_opcodes=opcode_limit(len(data)))
    if not (scanned.plain and scanned.loadable):
        print(f"{path}: not a plain pickle; the load below is the restricted one")
    raw = dm._PlainLoader(data, dm._fast_table(len(data))).load()
    rows = {
        "opcodes (bare loop)": best(lambda: bare_loop(data), rounds),
        "walk": best(lambda: scan(data, DCP_METADATA_GLOBALS, max_opcodes=opcode_limit(len(data))), rounds),
        "C load": best(lambda: dm._PlainLoader(data, dm._fast_table(len(data))).load(), rounds),
        "rebuild": best(lambda: dm.rebuild(raw), rounds),
        "load (as the audit)": best(lambda: dm.load_dcp_metadata(data, scanned), rounds),
        "restricted load": best(lambda: dm.load_dcp_metadata(data, None), max(1, rounds // 3)),
    }
    total = rows["walk"] + rows["load (as the audit)"]
    print(f"\n{path}/.metadata: {len(data) / 1e6:.2f} MB, {opcodes} opcodes; load average {os.getloadavg()[0]:.1f}; "
          f"best of {rounds} rounds, CPU")
    print("| stage | seconds | us per opcode | share of walk + load |")
    print("|---|---|---|---|")
    for name, secs in rows.items():
        print(f"| {name} | {secs:.3f} | {secs / opcodes * 1e6:.3f} | {secs / total:.0%} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dcp", nargs="+", help="DCP directories")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    for path in args.dcp:
        measure(path, args.rounds)


if __name__ == "__main__":
    main()
