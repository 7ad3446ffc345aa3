"""What the checkpoint passport costs: ``attest`` against the plain audit and a standalone digest of the same files,
``verify`` against the standalone digest, and both against OpenSSF model-signing's own ``sign key`` / ``verify key``
of the same folder, all measured in the same run on the realistic checkpoint.

    .venv/bin/python bench/bench_passport.py --scale 0.1          # ~0.43 GB per format (development)
    .venv/bin/python bench/bench_passport.py                      # full size: 355 M params + AdamW, ~4.26 GB
    .venv/bin/python bench/bench_passport.py --formats dcp-8 --jobs 2
    git archive REV src | (mkdir -p scratch/before && tar -x -C scratch/before)    # REV: the code before a change
    .venv/bin/python bench/bench_passport.py --scale 0.25 --before scratch/before/src --steps audit,attest

The checkpoint is ``bench_realistic.py``'s (GPT-2 medium's 1168 tensors: fp32 parameters and one real AdamW step),
written one format at a time (``dcp-1``: a single-process DCP folder, one ``.distcp`` file; ``dcp-8``: an 8-rank
DCP save, eight files; ``torch.save``: one file). Measured in a fresh child process per format, right after the
write (so from the page cache where memory holds the files), in ``--repeat`` rounds of, each with ``--jobs``
threads (default: every core this process may use):

- ``audit``: :func:`ckptaudit.auditing.judge.run_audit` (no digest);
- ``digest sha256`` / ``digest blake3``: the files' digests alone (:func:`ckptaudit.passport.digests.digest_files`:
  one streaming read per file, files on threads): the standalone digest the targets compare with;
- ``attest``: :func:`ckptaudit.passport.attest` with a key, sha256 file digests (model-signing's default) and
  ``attest blake3`` (ckptaudit's default where blake3 is installed);
- ``verify`` / ``verify blake3``: :func:`ckptaudit.passport.verify` with the public key (signature, every file's
  digest, verdict) of the sha256 / blake3 passport;
- ``ms sign`` / ``ms verify``: model-signing 1.1.1's ``signing.Config().use_elliptic_key_signer(...).sign`` and
  ``verifying.Config().use_elliptic_key_verifier(...).verify`` of the same folder (sha256, its default), the
  library calls its ``sign key`` / ``verify key`` commands make.

Each figure is the best round's seconds; the ratios are the median of the rounds' own ratios (the host's drifting
speed mostly cancels out of them). A second table gives each step's CPU seconds (all its threads): on a loaded
machine the threads do not get the cores they would run on in parallel, and the wall-clock ratios drift towards
the CPU ones. The load average is printed before and after.

``--before SRC``: every round runs twice, in fresh processes, once with the package at ``SRC`` and once with this
checkout's, in alternating order, so that both see the same machine; each table then has a row per tree.
``--steps``: only these steps (the ratios need ``audit``, ``digest sha256`` and ``attest``; the others print ``-``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench_realistic import size_of, write

NAMES = {"torch.save": "ckpt.pt", "dcp-1": "step-1", "dcp-8": "step-8"}
STEPS = ("audit", "digest sha256", "digest blake3", "attest", "attest blake3", "verify", "verify blake3", "ms sign",
         "ms verify")


def _keys(where: str) -> tuple[str, str]:
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    private, public = os.path.join(where, "key.pem"), os.path.join(where, "key.pub")
    with open(private, "wb") as fh:
        fh.write(key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption()))
    with open(public, "wb") as fh:
        fh.write(key.public_key().public_bytes(ser.Encoding.PEM, ser.PublicFormat.SubjectPublicKeyInfo))
    return private, public


def child(path: str, work: str, repeat: int, jobs: int, names: list[str]) -> dict[str, Any]:
    """(fresh process) ``repeat`` rounds of the steps ``names``."""
    import pathlib

    import model_signing.signing
    import model_signing.verifying

    from ckptaudit.auditing.judge import AuditOptions, run_audit
    from ckptaudit.ondisk.passport import passport_path, signature_path
    from ckptaudit.passport import attest, verify
    from ckptaudit.passport.digests import digest_files, list_files

    private, public = _keys(work)
    ms_sig = os.path.join(work, "model.sig")
    is_dir = os.path.isdir(path)

    def clean() -> None:
        for f in (passport_path(path, is_dir=is_dir), signature_path(path, is_dir=is_dir)):
            if os.path.exists(f):
                os.remove(f)

    options = AuditOptions(jobs=jobs)
    run_audit(path, options)  # first-call imports and set-up, outside the timed rounds
    files = list_files(path)
    steps: dict[str, Any] = {
        "audit": lambda: run_audit(path, options),
        "digest sha256": lambda: digest_files(files, "sha256", jobs=jobs),
        "digest blake3": lambda: digest_files(files, "blake3", jobs=jobs),
        "attest": lambda: attest(path, key=private, jobs=jobs, algorithm="sha256"),
        "attest blake3": lambda: attest(path, key=private, jobs=jobs, algorithm="blake3"),
        "verify": lambda: verify(path, key=public, jobs=jobs),
        "verify blake3": lambda: verify(path, key=public, jobs=jobs),
        "ms sign": lambda: model_signing.signing.Config().use_elliptic_key_signer(private_key=private).sign(
            pathlib.Path(path), pathlib.Path(ms_sig)),
        "ms verify": lambda: model_signing.verifying.Config().use_elliptic_key_verifier(public_key=public).verify(
            pathlib.Path(path), pathlib.Path(ms_sig)),
    }
    rounds = []
    for _ in range(repeat):
        r: dict[str, float] = {}
        for name in names:
            if name in ("attest", "attest blake3", "ms sign"):
                clean()
            if name in ("verify", "verify blake3"):  # verify the passport of that digest (untimed)
                attest(path, key=private, jobs=jobs, algorithm="blake3" if "blake3" in name else "sha256")
            t0, c0 = time.perf_counter(), time.process_time()
            out = steps[name]()
            r[name] = time.perf_counter() - t0
            r[name + " cpu"] = time.process_time() - c0  # every thread of this process
            if name.startswith("verify"):
                assert out.ok, out.summary
            if name == "ms sign":
                clean()  # model-signing hashes every file in the folder: sign and verify it as it was written
        rounds.append(r)
    clean()
    return {"rounds": rounds}


def run(*argv: str, src: str | None = None) -> Any:
    env = dict(os.environ) if src is None else {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *argv], capture_output=True,
                         text=True, check=False, env=env)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-4000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _ratio(rs: list[dict[str, float]], f: Any) -> str:
    try:
        return f"{statistics.median(f(r) for r in rs):.2f}x"
    except KeyError:
        return "-"


def _best(rs: list[dict[str, float]], key: str) -> str:
    return f"{min(r[key] for r in rs):.2f} s" if key in rs[0] else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="bytes relative to the full 4.26 GB (default 1)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds per format (default 3)")
    ap.add_argument("--formats", default="dcp-1,dcp-8", help="of torch.save, dcp-1, dcp-8 (default dcp-1,dcp-8)")
    ap.add_argument("--jobs", type=int, default=0, help="threads (default: every core this process may use)")
    ap.add_argument("--dir", help="scratch directory (default: a new temporary one, removed)")
    ap.add_argument("--before", help="the src directory of a package to compare this checkout's with, round by round")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"of {', '.join(STEPS)} (default: all)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], int(args.child[2]), int(args.child[3]),
                               args.child[4].split(","))))
        return
    steps = [s for s in STEPS if s in args.steps.split(",")]
    jobs = args.jobs or len(os.sched_getaffinity(0))
    trees = {"before": args.before, "after": os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")}
    load_before = os.getloadavg()
    tmp = args.dir or tempfile.mkdtemp(prefix="ckptaudit-bench-passport-")
    rows = []
    try:
        for fmt in args.formats.split(","):
            path = os.path.join(tmp, NAMES[fmt])
            write(fmt, path, args.scale)
            work = tempfile.mkdtemp(dir=tmp)
            files = len(os.listdir(path)) if os.path.isdir(path) else 1
            if args.before is None:
                rows.append({"format": fmt, "bytes": size_of(path), "files": files,
                             "rounds": run(path, work, str(args.repeat), str(jobs), ",".join(steps))["rounds"]})
            else:  # alternating trees, one round per process
                got: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
                for r in range(args.repeat):
                    for tree in (("before", "after") if r % 2 == 0 else ("after", "before")):
                        got[tree] += run(path, work, "1", str(jobs), ",".join(steps), src=trees[tree])["rounds"]
                rows += [{"format": f"{fmt} ({tree})", "bytes": size_of(path), "files": files, "rounds": got[tree]}
                         for tree in ("before", "after")]
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            shutil.rmtree(work)
    finally:
        if not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)
    load_after = os.getloadavg()
    print(f"The passport on the realistic checkpoint (scale {args.scale}, {jobs} thread(s), best of {args.repeat} "
          f"rounds; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after)\n")
    print("| format | size (files) | " + " | ".join(steps) + " | attest / max(audit, digest) | "
          "attest blake3 / max(audit, digest blake3) | verify / digest | attest / ms sign | verify / ms verify |")
    print("|---|---|" + "---|" * len(steps) + "---|---|---|---|---|")
    for row in rows:
        rs = row["rounds"]
        cells = [_best(rs, s) for s in steps]
        ratios = [_ratio(rs, lambda r: r["attest"] / max(r["audit"], r["digest sha256"])),
                  _ratio(rs, lambda r: r["attest blake3"] / max(r["audit"], r["digest blake3"])),
                  _ratio(rs, lambda r: r["verify"] / r["digest sha256"]),
                  _ratio(rs, lambda r: r["attest"] / r["ms sign"]),
                  _ratio(rs, lambda r: r["verify"] / r["ms verify"])]
        print(f"| {row['format']} | {row['bytes'] / 1e9:.2f} GB ({row['files']}) | " + " | ".join(cells) + " | "
              + " | ".join(ratios) + " |")
    print("\nCPU seconds (every thread of the process; what a busy machine charges, whatever the cores):\n")
    print("| format | " + " | ".join(steps) + " | attest / (audit + digest) | attest / digest | verify / digest |")
    print("|---|" + "---|" * len(steps) + "---|---|---|")
    for row in rows:
        rs = row["rounds"]
        cells = [_best(rs, s + " cpu") for s in steps]
        ratios = [_ratio(rs, lambda r: r["attest cpu"] / (r["audit cpu"] + r["digest sha256 cpu"])),
                  _ratio(rs, lambda r: r["attest cpu"] / r["digest sha256 cpu"]),
                  _ratio(rs, lambda r: r["verify cpu"] / r["digest sha256 cpu"])]
        print(f"| {row['format']} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()
