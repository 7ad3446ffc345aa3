"""The metadata cost model of docs/scale.md: fitted on calibration saves, then checked on saves it was not fitted on.

    .venv/bin/python bench/bench_cost_model.py                        # calibration 3 saves, check 3 (~10 min here)
    .venv/bin/python bench/bench_cost_model.py --check 512x4 --rounds 3
    .venv/bin/python bench/bench_cost_model.py --calibrate 256x2,256x8,128x4 --check 512x4,1024x2,1024x8

Each save is ``bench/sim_dcp.py``'s (``RANKSxLAYERS`` of the 1024-wide Llama of bench/bench_dist_scale.py:
``--hidden 1024 --ffn 3584 --vocab 32768 --kv 256``; real ``Metadata`` pickled by torch). Rank 0's metadata cost
is one ``plan_scan`` of the save (the ``.metadata`` opcode walk and torch-free rebuild, each item's archive
checked, the layout): timed ``--rounds`` times, each in a fresh child process (the archive-layout memo of
:mod:`ckptaudit.formats.zip.memo` starts empty, as in an audit), CPU seconds (``time.process_time``: the cost;
wall seconds on a shared machine are mostly waiting for a core).

The model: ``cpu = a × items + b × files``: a cost per DCP item (its ``.metadata`` entries walked and rebuilt,
its archive matched against a learnt layout) and one per data file, i.e. per saving rank (presumably the file opened, its
rank's own non-tensor items, such as its RNG state, read and checked in full); fitted by least squares on the
calibration saves only, then each check save's measured range is set against the prediction. (The distinct
archive layouts, printed as ``layouts``, are a dozen whatever the save: items of a known layout are matched, not
re-read, so the layouts' cost is too small to fit.) Prints one JSON line per save and one for the fit, each
with the load average.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODEL = ["--hidden", "1024", "--ffn", "3584", "--vocab", "32768", "--kv", "256"]
_WALK = ("import json, sys, time\n"
         "import torch\n"
         "from ckptaudit.auditing.plan import plan_scan\n"
         "c = time.process_time()\n"
         "plan = plan_scan(sys.argv[1])\n"
         "cpu = time.process_time() - c\n"
         "print(json.dumps({'cpu_s': cpu, 'items': len(plan.items)}))\n"
         "plan.close()\n")


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def shape_of(path: str) -> dict[str, int]:
    """Items (storage entries) and distinct item lengths of the save at ``path``, from its vetted ``.metadata``."""
    from ckptaudit.formats.dcp.reader import check_metadata_safe

    md = check_metadata_safe(path)
    lengths = {info.length for info in md.storage_data.values()}
    files = {info.relative_path for info in md.storage_data.values()}
    return {"dcp_items": len(md.storage_data), "files": len(files), "layouts": len(lengths),
            "metadata_bytes": os.path.getsize(os.path.join(path, ".metadata"))}


def measure(spec: str, rounds: int, tmp: str) -> dict[str, Any]:
    """Write the save ``spec`` (``RANKSxLAYERS``), then time ``rounds`` walks of it."""
    import sim_dcp

    ranks, layers = (int(x) for x in spec.split("x"))
    path = os.path.join(tmp, spec)
    buf = io.StringIO()
    stdout, sys.stdout = sys.stdout, buf
    try:
        sim_dcp.main(["--out", path, "--ranks", str(ranks), "--layers", str(layers), *MODEL])
    finally:
        sys.stdout = stdout
    out: dict[str, Any] = {"save": spec, **shape_of(path), "walk_cpu_s": [], "load_average": []}
    for _ in range(rounds):
        got = subprocess.run([sys.executable, "-c", _WALK, path], capture_output=True, text=True, check=True)
        out["walk_cpu_s"].append(round(json.loads(got.stdout.strip().splitlines()[-1])["cpu_s"], 3))
        out["load_average"].append(_load())
    shutil.rmtree(path)
    return out


def fit(points: list[dict[str, Any]]) -> tuple[float, float]:
    """Least squares of ``cpu = a × items + b × files`` over every round of ``points`` (no intercept)."""
    sxx = sxy = syy = sxc = syc = 0.0
    for p in points:
        x, y = float(p["dcp_items"]), float(p["files"])
        for c in p["walk_cpu_s"]:
            sxx, sxy, syy, sxc, syc = sxx + x * x, sxy + x * y, syy + y * y, sxc + x * c, syc + y * c
    det = sxx * syy - sxy * sxy
    if abs(det) < 1e-9:
        raise SystemExit("the calibration saves do not separate items from files: give saves of other shapes")
    return (sxc * syy - syc * sxy) / det, (sxx * syc - sxy * sxc) / det


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibrate", default="256x2,256x8,128x4", help="saves the model is fitted on (RANKSxLAYERS)")
    ap.add_argument("--check", default="512x4,1024x2,1024x8", help="saves it is checked on")
    ap.add_argument("--rounds", type=int, default=2, help="walks per save, each in a fresh process")
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="bench-cost-model-")
    try:
        cal = []
        for spec in args.calibrate.split(","):
            cal.append(measure(spec, args.rounds, tmp))
            print(json.dumps({"role": "calibration", **cal[-1]}), flush=True)
        a, b = fit(cal)
        print(json.dumps({"fit": {"per_item_ms": round(a * 1e3, 4), "per_file_ms": round(b * 1e3, 3)},
                          "load_average": _load()}), flush=True)
        for spec in args.check.split(","):
            p = measure(spec, args.rounds, tmp)
            pred = a * p["dcp_items"] + b * p["files"]
            lo, hi = min(p["walk_cpu_s"]), max(p["walk_cpu_s"])
            print(json.dumps({"role": "check", **p, "predicted_cpu_s": round(pred, 2),
                              "error_pct": [round(100 * (pred - hi) / hi, 1), round(100 * (pred - lo) / lo, 1)]}),
                  flush=True)
        for p in cal:
            pred = a * p["dcp_items"] + b * p["files"]
            print(json.dumps({"role": "calibration residual", "save": p["save"], "predicted_cpu_s": round(pred, 2),
                              "measured_cpu_s": p["walk_cpu_s"]}), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
