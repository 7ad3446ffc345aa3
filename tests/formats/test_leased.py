"""Chunks hashed where they lie in the page cache, under a read lease (:mod:`ckptaudit.formats.io.leased`).

What users rely on: the mapped path gives the same hashes and precisions as positional reads (in every layout it
takes: one run of bytes, DCP row shards), it is really taken where it can be, and a file truncated by another
process while it is being read never kills the audit (a plain memory map would: ``SIGBUS``), nor is a writer kept
waiting for more than the chunks in flight. The lease scenarios run in a child process, so that a broken guard
fails the test (the child dies of ``SIGBUS``) instead of killing the test run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from ckptaudit.auditing import tensor_scan as records
from ckptaudit.auditing.plan import plan_scan
from ckptaudit.auditing.scan import scan_items
from ckptaudit.findings import Precision
from ckptaudit.formats.io.leased import MIN_MAPPED_BYTES, mapped_reads_enabled
from ckptaudit.launch import launch

pytestmark = pytest.mark.skipif(not mapped_reads_enabled(), reason="no file leases on this host")

CHILD_TIMEOUT = 120


def _weights() -> dict[str, Any]:
    """Three weights: genuine fp32, rounded to bf16, and one whose rows do not split evenly; 1-3 MiB each, so
    whole chunks go through the map."""
    import torch

    g = torch.Generator().manual_seed(7)
    return {"exact": torch.randn(1024, 512, generator=g) * 0.02,
            "rounded": (torch.randn(768, 512, generator=g) * 0.02).bfloat16().float(),
            "odd": torch.randn(1001, 300, generator=g)}


def _save_row_shards(ctx: Any, path: str) -> int:
    """(each of 2 ranks) Row shards (``Shard(0)``) of :func:`_weights`, saved by DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    model = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _weights().items()}
    dcp.save({"model": model}, checkpoint_id=path)
    return ctx.rank


@pytest.fixture(scope="module")
def row_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("leased") / "dcp"
    launch(_save_row_shards, 2, (str(path),), timeout_s=240, backend="gloo", env={"OMP_NUM_THREADS": "1"})
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``torch.save`` file of tensors of one run of bytes each, large enough for the map."""
    import torch

    g = torch.Generator().manual_seed(3)
    path = tmp_path_factory.mktemp("leased") / "ckpt.pt"
    x = torch.randn(3 << 18, generator=g)
    torch.save({"exact": torch.randn(3 << 18, generator=g),
                "rounded": torch.randn(3 << 18, generator=g).bfloat16().float(),
                "bf16": torch.randn(1 << 20, generator=g).bfloat16(),
                "ids": torch.arange(1 << 18),
                # Decided inside a window of the map: the first chunk rounded (to bf16, to fp16), the rest exact.
                "mixed_bf16": torch.cat([x[: 1 << 18].bfloat16().float(), x[1 << 18 :]]),
                "mixed_fp16": torch.cat([x[: 1 << 18].half().float(), x[1 << 18 :]])}, path)
    return path


def _scans(path: Path, jobs: int) -> tuple[dict[str, Any], int]:
    """Name -> scan of every tensor, and how many chunks were read through leased maps."""
    plan = plan_scan(str(path))
    try:
        out = scan_items(plan, plan.scannable(), jobs=jobs)
        mapped = plan.ckpt.maps.mapped_chunks()
        return {plan.items[i][0].name: o.scan for i, o in out.items()}, mapped
    finally:
        plan.close()


@pytest.mark.parametrize("fixture", ["saved", "row_shards"])
def test_mapped_chunks_hash_and_judge_as_positional_reads_do(fixture: str, request: pytest.FixtureRequest,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = request.getfixturevalue(fixture)
    mapped, n_mapped = _scans(path, jobs=2)
    assert n_mapped >= 3  # the map was really read from, not only offered
    monkeypatch.setenv("CKPTAUDIT_MAPPED_READS", "0")
    plain, n_plain = _scans(path, jobs=2)
    assert n_plain == 0
    monkeypatch.setattr(records, "row_major_runs", lambda data: None)  # iter_chunks' general path: the reference
    general, _ = _scans(path, jobs=1)
    assert mapped == plain == general
    assert {s.precision for s in mapped.values()} >= {Precision.EXACT, Precision.BF16}


def test_the_hash_is_of_the_tensor_bytes_in_row_major_order(row_shards: Path) -> None:
    scans, n_mapped = _scans(row_shards, jobs=2)
    assert n_mapped >= 3
    for name, t in _weights().items():
        assert scans[f"model/{name}"].hash == xxhash.xxh3_128(np.ascontiguousarray(t.numpy()).tobytes()).hexdigest()
    assert scans["model/rounded"].precision is Precision.BF16
    assert scans["model/exact"].precision is Precision.EXACT


def test_a_file_open_for_writing_is_read_with_positional_reads(saved: Path) -> None:
    mapped, _ = _scans(saved, jobs=1)
    with open(saved, "r+b"):  # no read lease while anyone may write: the kernel refuses it
        during, n = _scans(saved, jobs=1)
    assert n == 0
    assert during == mapped


def _child(script: str, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])  # -7: SIGBUS, the guard failed
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


_TRUNCATE_DURING_A_CHUNK = """
    import fcntl, json, os, subprocess, sys, time
    import xxhash
    from ckptaudit.formats.io.leased import LeasedFile

    path = sys.argv[1]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    lf = LeasedFile(fd)
    view = lf.view(0, size)
    assert view is not None
    writer = subprocess.Popen([sys.executable, "-c", "import os, sys; print('go', flush=True); "
                               "os.truncate(sys.argv[1], 0)", path], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "go"
    deadline, asked = time.monotonic() + 60, None
    while os.path.getsize(path) == size and time.monotonic() < deadline:
        # Until the writer has truncated (unguarded), or has waited on the lease for half a second.
        if asked is None and fcntl.fcntl(fd, 1025) == fcntl.F_UNLCK:  # F_GETLEASE: a break is pending
            asked = time.monotonic()
        if asked is not None and time.monotonic() > asked + 0.5:
            break
        time.sleep(0.005)
    waiting = writer.poll() is None
    size_during = os.path.getsize(path)
    joined = lf.view(0, size)  # a second chunk may not start while the writer waits (it would wait longer)
    digest = xxhash.xxh3_128(view).hexdigest()  # every page of the chunk, read after the writer asked
    lf.done(view, 0)
    writer.wait(timeout=60)
    after = lf.view(0, size)
    print(json.dumps({"waiting": waiting, "joined": joined is not None, "size_during": size_during, "size": size,
                      "digest": digest,
                      "after": after is None, "size_after": os.path.getsize(path)}))
"""


def test_a_truncation_waits_for_the_chunk_being_read(tmp_path: Path) -> None:
    data = np.random.default_rng(0).integers(0, 255, size=8 << 20, dtype=np.uint8).tobytes()
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    out = _child(_TRUNCATE_DURING_A_CHUNK, str(path))
    assert out["waiting"] and out["size_during"] == out["size"] == len(data)  # the writer waited on the lease
    assert not out["joined"]  # and no new chunk started meanwhile
    assert out["digest"] == xxhash.xxh3_128(data).hexdigest()  # and the chunk read whole, without SIGBUS
    assert out["after"] and out["size_after"] == 0  # then it truncated, and nothing more is read from the map


_REWRITER = """
import os, sys, time
path = sys.argv[1]
data = open(path, "rb").read()
end = time.monotonic() + float(sys.argv[2])
n = 0
with open(path, "r+b", buffering=0) as fh:  # open for writing throughout, as a writer rewriting in place is
    while time.monotonic() < end:
        fh.truncate(0)
        time.sleep(0.001)
        os.pwrite(fh.fileno(), data, 0)
        time.sleep(0.001)
        n += 1
print(n)
"""

_AUDIT_WHILE_REWRITTEN = """
    import json, subprocess, sys, time
    from ckptaudit.auditing.judge import AuditOptions, run_audit

    path, seconds, rewriter = sys.argv[1:4]
    writer = subprocess.Popen([sys.executable, "-c", rewriter, path, seconds], stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    codes = set()
    runs = 0
    while writer.poll() is None:
        report = run_audit(path, AuditOptions(jobs=2))
        codes |= {f.code for f in report.findings}
        runs += 1
    rewrites = int(writer.stdout.read())
    print(json.dumps({"runs": runs, "rewrites": rewrites, "codes": sorted(codes)}))
"""


def test_audits_survive_a_file_rewritten_in_place_under_them(tmp_path: Path) -> None:
    """A writer truncating and rewriting the file again and again while audits read it: every audit ends with
    a report (findings where it saw the file change), none dies. Unguarded maps die here (``SIGBUS``) within
    the first few runs."""
    import torch

    path = tmp_path / "rewritten.pt"
    torch.save({"w": torch.randn(8 << 20, generator=torch.Generator().manual_seed(5))}, path)  # 32 MiB
    out = _child(_AUDIT_WHILE_REWRITTEN, str(path), "6", _REWRITER)
    assert out["runs"] >= 3 and out["rewrites"] >= 3


_DESCRIPTOR_REPLACED = """
    import fcntl, json, os, subprocess, sys, time
    from ckptaudit.formats.io.leased import LeasedFile

    path = sys.argv[1]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    lf = LeasedFile(fd)
    view = lf.view(0, size)
    assert view is not None
    lf.done(view, 0)  # mapped, lease given back
    fresh = os.open(path, os.O_RDONLY)  # another open file description of the same file, under the same number
    os.dup2(fresh, fd)
    os.close(fresh)
    view = lf.view(0, size)  # the lease is taken on the new description
    assert view is not None
    # A writer opening the file breaks the lease: the break signal must be one this process survives.
    writer = subprocess.Popen([sys.executable, "-c", "import sys; open(sys.argv[1], 'r+b').close()", path])
    deadline = time.monotonic() + 60
    while fcntl.fcntl(fd, 1025) == fcntl.F_RDLCK and time.monotonic() < deadline:  # F_GETLEASE: break pending?
        time.sleep(0.005)
    time.sleep(0.2)  # the signal is sent as the break starts: give it time to arrive
    lf.done(view, 0)  # the lease is given back: the writer's open goes on
    assert writer.wait(timeout=60) == 0
    lf.close()
    print(json.dumps({"survived": True}))
"""


def test_a_lease_on_a_replaced_descriptor_breaks_with_the_signal_this_process_ignores(tmp_path: Path) -> None:
    """The break signal belongs to the open file description: were it set once per map, a descriptor number
    re-opened under the map would hold a lease whose break sends ``SIGIO`` (default action: terminate)."""
    path = tmp_path / "data.bin"
    path.write_bytes(b"x" * (4 * MIN_MAPPED_BYTES))
    assert _child(_DESCRIPTOR_REPLACED, str(path)) == {"survived": True}


def test_no_mapped_reads_where_this_process_handles_sigurg_or_they_are_switched_off() -> None:
    script = """
        import json, signal
        from ckptaudit.formats.io.leased import mapped_reads_enabled
        default = mapped_reads_enabled()
        signal.signal(signal.SIGURG, lambda *a: None)
        print(json.dumps({"default": default, "handled": mapped_reads_enabled()}))
    """
    assert _child(script) == {"default": True, "handled": False}
    assert _child(script, env={"CKPTAUDIT_MAPPED_READS": "0"}) == {"default": False, "handled": False}


def test_chunks_below_the_floor_are_not_mapped(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(b"x" * (2 * MIN_MAPPED_BYTES))
    from ckptaudit.formats.io.leased import LeasedFile

    fd = os.open(path, os.O_RDONLY)
    try:
        lf = LeasedFile(fd)
        assert lf.view(0, MIN_MAPPED_BYTES - 1) is None
        view = lf.view(0, MIN_MAPPED_BYTES)
        assert view is not None and bytes(view[:3]) == b"xxx"
        lf.done(view, 0)
        assert lf.view(MIN_MAPPED_BYTES + 1, MIN_MAPPED_BYTES) is None  # past the end: pread reports it
        lf.close()
    finally:
        os.close(fd)


_PEAK = """
import json, sys
from ckptaudit.auditing.judge import AuditOptions, run_audit

def status(key):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(key + ":"))

run_audit(sys.argv[1], AuditOptions(jobs=2))  # the warm-up: imports, and a first mapped file
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")  # reset the peak resident set (VmHWM) to the current one
before = status("VmRSS")
report = run_audit(sys.argv[2], AuditOptions(jobs=2))
print(json.dumps({"growth_mib": (status("VmHWM") - before) / 1024,
                  "hashed": sum(t.hash is not None for t in report.tensors)}))
"""


def test_mapped_pages_leave_the_resident_set_chunk_by_chunk(saved: Path, tmp_path: Path) -> None:
    """Resident memory while auditing 160 MiB through the map stays at a few chunks (each thread maps at most
    ``MAPPED_CHUNK_BYTES`` at a time), not the file: mapped pages count in the resident set until given back."""
    import torch

    big = tmp_path / "big.pt"
    g = torch.Generator().manual_seed(9)
    torch.save({f"w{i}": torch.randn(10 << 20, generator=g) for i in range(4)}, big)  # 4 x 40 MiB
    out = _child(_PEAK, str(saved), str(big))
    assert out["hashed"] == 4, out
    assert out["growth_mib"] < 3 * records.MAPPED_CHUNK_BYTES / 2**20 + 8, out  # 2 threads' chunks, and slack


def test_the_page_table_work_goes_through_libc_not_mmap_madvise(tmp_path: Path) -> None:
    """``mmap.madvise`` holds the GIL for its whole page-table walk (``MADV_POPULATE_READ`` / ``MADV_DONTNEED`` of a
    window cost about as much as hashing it), so two scanning threads took turns at it; where the map's address is
    known, ``leased.madvise`` calls libc's through ``ctypes``, which releases the GIL, with ``mmap.madvise``'s
    errors and clipping."""
    import errno
    import mmap

    from ckptaudit.formats.io.leased import madvise, map_address

    class Spy:
        """A map stand-in that counts the calls that reach ``mmap.madvise``."""

        def __init__(self, n: int) -> None:
            self.n, self.calls = n, 0

        def __len__(self) -> int:
            return self.n

        def madvise(self, *args: int) -> None:
            self.calls += 1

    path = tmp_path / "data.bin"
    path.write_bytes(b"x" * (4 * MIN_MAPPED_BYTES))
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        found = map_address(mm)  # NumPy is loaded here, as in every scan of a large tensor
        assert found is not None
        address, held = found
        spy = Spy(len(mm))
        madvise(spy, address, 0, len(mm) + 4096, 22)  # MADV_POPULATE_READ, past the end: cut at the end
        madvise(spy, address, 0, len(mm), mmap.MADV_DONTNEED)
        assert spy.calls == 0
        madvise(spy, None, 0, len(mm), mmap.MADV_DONTNEED)  # no address: mmap.madvise
        assert spy.calls == 1
        with pytest.raises(OSError) as bad:
            madvise(mm, address, 0, 4096, 12345)  # no such advice
        assert bad.value.errno == errno.EINVAL
        with pytest.raises(ValueError):
            madvise(mm, address, len(mm), 1, mmap.MADV_DONTNEED)
        del held, found  # the export of the map: it must go before the map closes
        mm.close()
