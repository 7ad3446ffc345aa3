"""Time and peak memory of auditing each class of hostile input (the figures in docs/security.md).

    .venv/bin/python bench/hostile_figures.py

Builds every hostile file of ``tests/test_hostile2.py`` (the builders the tests use) in a temporary directory
and audits each in one child process (``tests/audit_worker.py``: warmed up on real checkpoints, then under
``RLIMIT_AS`` = its address space + 1.5 GiB), printing the finding, the seconds of the audit and the growth of
the child's peak resident set over its warmed-up baseline. A line per class, Markdown table rows.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import real_checkpoints as rc
import test_hostile2 as t2
from audit_worker import AuditWorker


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        bases = {"pt": rc.torch_save_checkpoint(d / "ckpt.pt"), "dcp": rc.dcp_checkpoint(d / "dcp"),
                 "st": rc.safetensors_file(d / "model.safetensors")}
        cases = {**{k: v[0] for k, v in t2.BOUNDED.items()}, **{k: v[0] for k, v in t2.JSON_CASES.items()}}
        worker = AuditWorker(headroom_mib=1536, timeout_s=120)
        worker.start([str(bases["pt"]), str(bases["dcp"]), str(bases["st"])])
        try:
            for attack in t2.ATTACKS:
                case_dir = d / f"attack-{attack}"
                ckpt = t2._payload_dcp(case_dir / "ckpt", str(case_dir / "ran"))
                if attack == "memo-mutated-MetadataIndex":
                    t2._memo_mutated_index(ckpt)
                else:
                    t2._shadow(ckpt, attack)
                _row(worker, f"DCP .metadata: {attack}", ckpt)
            for name, build in cases.items():
                case_dir = d / name
                case_dir.mkdir()
                _row(worker, name, build(bases, case_dir))
        finally:
            worker.close()
    return 0


def _row(worker: AuditWorker, name: str, path: Path) -> None:
    size = sum(p.stat().st_size for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())
    start = time.perf_counter()
    answer = worker.audit(str(path))
    wall = time.perf_counter() - start
    found = [f"{c}" for c, _, _ in answer.get("findings", []) if c.startswith(("integrity", "security"))]
    grow = answer.get("maxrss_mib", 0) - worker.baseline_mib
    print(f"| {name} | {size / 2**20:.1f} MiB | {', '.join(sorted(set(found))) or answer.get('error', '?')[-80:]} "
          f"| {wall:.1f} s | +{max(grow, 0):.0f} MiB |", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
