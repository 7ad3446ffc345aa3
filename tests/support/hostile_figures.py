"""Time and peak memory of auditing each class of hostile input (the figures in docs/security.md).

    .venv/bin/python tests/support/hostile_figures.py                    # both rounds
    .venv/bin/python tests/support/hostile_figures.py --round 3          # issue 25's work bounds only
    .venv/bin/python tests/support/hostile_figures.py --round 3 --src /tmp/base/src   # the same inputs, other code
    .venv/bin/python tests/support/hostile_figures.py --round 4          # issue 36: column chunks, huge keys

Round 2 builds every hostile case of ``hostile_cases.py`` (the builders the tests use) in a temporary directory
and audits each in one child process (``audit_worker.py``: warmed up on real checkpoints, then
under ``RLIMIT_AS`` = its address space + 1.5 GiB), printing the finding, the seconds of the audit and the growth
of the child's peak resident set over its warmed-up baseline. A line per class, Markdown table rows.

Round 3 (issue 25: work that grew faster than the input) runs each case in a fresh child (killed after
``--limit`` seconds) and prints its seconds and peak resident set: ZeRO-2 layouts built from DeepSpeed's own
files (``hostile_deepspeed.py``; the DeepSpeed writer runs first, a minute or two), a DCP ``.metadata`` whose
entries share one chunk list (``vetted_dcp_reader``), and ``http://`` audits against the local servers of
``http_servers.py`` (requests made and body bytes the server could send). ``--src`` runs the children on
another source tree, e.g. the code before a change: ``git archive <commit> src | tar -x -C /tmp/base``.

Round 4 (issue 36) times, in the same fresh children, the audit of a ``[1, N]`` DCP tensor saved as N ``[1, 1]``
column chunks against ``torch.distributed.checkpoint.load`` of the same folder, and audits a ``torch.save`` file
whose keys are 5,001-digit ints.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import hostile_cases as hc
import real_checkpoints as rc
from audit_worker import AuditWorker

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round", choices=["2", "3", "4", "all"], default="all")
    parser.add_argument("--src", default=str(ROOT / "src"), help="the ckptaudit source tree the children run")
    parser.add_argument("--limit", type=float, default=600, help="seconds after which a round-3 child is killed")
    args = parser.parse_args(argv)
    if args.round in ("2", "all"):
        round2()
    if args.round in ("3", "all"):
        round3(args.src, args.limit)
    if args.round in ("4", "all"):
        round4(args.src, args.limit)
    return 0


def round2() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        bases = {"pt": rc.torch_save_checkpoint(d / "ckpt.pt"), "dcp": rc.dcp_checkpoint(d / "dcp"),
                 "st": rc.safetensors_file(d / "model.safetensors")}
        cases = {**{k: v[0] for k, v in hc.BOUNDED.items()}, **{k: v[0] for k, v in hc.JSON_CASES.items()}}
        worker = AuditWorker(headroom_mib=1536, timeout_s=120)
        worker.start([str(bases["pt"]), str(bases["dcp"]), str(bases["st"])])
        try:
            for attack in hc.ATTACKS:
                case_dir = d / f"attack-{attack}"
                ckpt = hc.payload_dcp(case_dir / "ckpt", str(case_dir / "ran"))
                if attack == "memo-mutated-MetadataIndex":
                    hc.memo_mutated_index(ckpt)
                else:
                    hc.shadow(ckpt, attack)
                _row(worker, f"DCP .metadata: {attack}", ckpt)
            for name, build in cases.items():
                case_dir = d / name
                case_dir.mkdir()
                _row(worker, name, build(bases, case_dir))
        finally:
            worker.close()


def _row(worker: AuditWorker, name: str, path: Path) -> None:
    size = sum(p.stat().st_size for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())
    start = time.perf_counter()
    answer = worker.audit(str(path))
    wall = time.perf_counter() - start
    found = [f"{c}" for c, _, _ in answer.get("findings", []) if c.startswith(("integrity", "security"))]
    grow = answer.get("maxrss_mib", 0) - worker.baseline_mib
    print(f"| {name} | {size / 2**20:.1f} MiB | {', '.join(sorted(set(found))) or answer.get('error', '?')[-80:]} "
          f"| {wall:.1f} s | +{max(grow, 0):.0f} MiB |", flush=True)


# --------------------------------------------------------------------------------------------------------------
# Round 3: each case in a fresh child on --src


_CHILD = """
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
what, path = sys.argv[2], sys.argv[3]
from ckptaudit.auditing.judge import run_audit
start = time.perf_counter()
out = {}
if what == "dcp-load":
    import warnings
    import torch
    import torch.distributed.checkpoint as dcp
    warnings.simplefilter("ignore")
    md = dcp.FileSystemReader(path).read_metadata()  # our own file
    state = {k: torch.zeros(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    out["tensors"] = len(state)
elif what == "dcp-reader":
    from ckptaudit.formats.torchload import vetted_dcp_reader
    md = vetted_dcp_reader(path).read_metadata()
    out["chunk objects"] = len({id(c) for item in md.state_dict_metadata.values() for c in getattr(item, "chunks", ())})
else:
    try:
        report = run_audit(path)
        out["codes"] = sorted({f.code for f in report.findings if f.code.startswith(("integrity", "deepspeed"))})
        out["tensors"] = len(report.tensors)
    except OSError as exc:
        out["error"] = str(exc)[:120]
out["seconds"] = time.perf_counter() - start
with open("/proc/self/status") as fh:  # VmHWM: this process's own peak (ru_maxrss keeps the parent's across exec)
    out["maxrss_mib"] = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) / 1024
print(json.dumps(out))
"""


def _run(src: str, what: str, path: str, limit: float) -> dict[str, object]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD, src, what, path], capture_output=True, text=True,
                              timeout=limit, env=env)
    except subprocess.TimeoutExpired:
        return {"killed": f"> {limit:.0f} s (killed)"}
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1][:160] if proc.stderr.strip() else proc.returncode}
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def _row3(name: str, size: int, answer: dict[str, object], extra: str = "") -> None:
    if "killed" in answer:
        print(f"| {name} | {size / 2**20:.1f} MiB | {answer['killed']} | - | {extra} |", flush=True)
        return
    codes: list[object] = answer.get("codes", []) or []  # type: ignore[assignment]
    what = answer.get("error") or ", ".join(map(str, codes)) or answer.get("chunk objects", "")
    print(f"| {name} | {size / 2**20:.1f} MiB | {answer.get('seconds', 0):.1f} s | "
          f"{answer.get('maxrss_mib', 0):.0f} MiB | {what} {extra}|", flush=True)


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())


def round3(src: str, limit: float) -> None:
    import hostile_deepspeed as hd
    import http_servers

    print("| input | size | time | peak RSS of the child | result |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        try:
            import lib_writers

            (d / "ds").mkdir()
            lib_writers.run_writer("deepspeed", str(d / "ds"), timeout_s=1800)
            zero2 = d / "ds" / "s2-bf16" / "global_step2"
            many = hd.many_ranks(zero2, d / "many" / "global_step2", ranks=256, params=51_200)
            _row3("ZeRO-2: 256 ranks x 51,200 one-element parameters", _size(many), _run(src, "audit", str(many), limit))
            empty = hd.empty_params(zero2, d / "empty" / "global_step2", count=1_000_000)
            _row3("ZeRO-2: 10^6 zero-size param_shapes entries (memoised)", _size(empty),
                  _run(src, "audit", str(empty), limit))
        except (ImportError, RuntimeError) as exc:
            print(f"| DeepSpeed cases | - | not run: {str(exc)[:100]} | - | - |")
        ckpt = hc.shared_chunks_dcp(d / "dcp", 3000)
        _row3("DCP .metadata: 3000 entries share one 3000-chunk list (vetted_dcp_reader)", _size(ckpt),
              _run(src, "dcp-reader", str(ckpt), limit))
        big = d / "ckpt.pt"
        _tensors_pt(big)
        for mode in ("honest", "lying-length", "trickle", "no-ranges"):
            with http_servers.ObjectServer(big.read_bytes(), mode, trickle_s=0.05) as srv:
                answer = _run(src, "audit", f"{srv.url}/ckpt.pt", limit)
                extra = f"({srv.requests} requests, {srv.sent / 2**20:.1f} MiB sent by the server) "
            _row3(f"http://, server {mode}", big.stat().st_size, answer, extra)


def round4(src: str, limit: float) -> None:
    import torch

    print("| input | size | time | peak RSS of the child | result |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for n in (5_000, 10_000):
            ckpt = hc.column_chunks_dcp(d / f"cols-{n}", n)
            _row3(f"DCP: [1, {n:,}] in {n:,} column chunks, audit", _size(ckpt), _run(src, "audit", str(ckpt), limit))
            _row3(f"DCP: [1, {n:,}] in {n:,} column chunks, dcp.load", _size(ckpt),
                  _run(src, "dcp-load", str(ckpt), limit))
        huge = d / "huge.pt"
        torch.save({"model": {10**5000: torch.randn(3), "w": torch.randn(2)}, 10**5000: torch.ones(2)}, huge)
        _row3("torch.save: keys of 5,001 digits", _size(huge), _run(src, "audit", str(huge), limit))


def _tensors_pt(path: Path) -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    torch.save({"model": {f"w{i}": torch.randn(1 << 16, generator=g) for i in range(16)}, "step": 3}, path)


if __name__ == "__main__":
    raise SystemExit(main())
