"""Checkpoints behind URLs: an ``s3://`` checkpoint on a real S3-compatible server (moto's server mode, started
here on 127.0.0.1 and a free port, stopped at the end) audits the same as its local copy, read with ranged reads.

DCP directories: a real 2-rank FSDP2 save (``fsdp_run``), a single-process save, a root holding DCP step
directories, damaged copies (a truncated data file, a hostile ``.metadata``, an escaping path, an item past its
file, an altered item) each give the local copy's report; a 64 MiB tensor audits in bounded memory."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import hostile_files as hf
import real_checkpoints as rc
from ckptaudit.cli import main
from local_s3 import local_s3
from real_checkpoints import hf_sharded_directory

pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory, scale_checkpoints: dict[str, Path],
       fsdp_run: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A local S3 server holding a torch.save file, a safetensors file, a strided torch.save file, a sharded HF
    directory, DCP directories (and damaged copies, see :func:`_dcp_variants`) and a DCP with one 64 MiB tensor;
    the environment points the S3 client at it."""
    with local_s3("ckpts") as s3:
        fs = s3.fs
        local = tmp_path_factory.mktemp("remote")
        strided = local / "strided.pt"
        g = torch.Generator().manual_seed(0)
        # Real torch.save of views: a transposed weight and a column slice keep their storage and strides.
        base = torch.randn(300, 200, generator=g)
        torch.save({"model": {"w_t": base.t(), "cols": base[:, 50:120], "b": torch.randn(7, generator=g)}}, strided)
        hf = hf_sharded_directory(local / "hf")
        files = {"ckpt.pt": scale_checkpoints["torch.save"], "model.safetensors": scale_checkpoints["safetensors"],
                 "strided.pt": strided}
        for name, path in files.items():
            fs.put(str(path), f"ckpts/{name}")
        fs.put(str(hf), "ckpts/hf", recursive=True)
        dirs = {"hf": hf, **_dcp_variants(local, scale_checkpoints["dcp"], Path(fsdp_run["dir"]) / "faithful")}
        for name, path in dirs.items():
            if name != "hf":
                fs.put(str(path), f"ckpts/{name}", recursive=True)
        yield {"files": {**files, **dirs}, "fs": fs}


def _dcp_variants(local: Path, single: Path, fsdp: Path) -> dict[str, Path]:
    """DCP directories written by torch.distributed.checkpoint (one process; 2 FSDP2 ranks), a root holding two
    of them as step directories next to a Hugging Face one, damaged copies, and one 64 MiB tensor."""
    import shutil
    import warnings

    import torch.distributed.checkpoint as dcp

    out = {"dcp": single, "fsdp-dcp": fsdp}
    tree = local / "tree"
    shutil.copytree(single, tree / "checkpoint" / "step-2")
    shutil.copytree(fsdp, tree / "checkpoint" / "step-6")
    shutil.copytree(hf_sharded_directory(local / "hf-for-tree"), tree / "checkpoint" / "checkpoint-4")
    out["run/checkpoint"] = tree / "checkpoint"

    def damaged(name: str, base: Path) -> tuple[Path, Any]:
        d = local / name
        shutil.copytree(base, d)
        out[name] = d
        return d, rc.read_dcp_metadata(d)

    d, _ = damaged("truncated", fsdp)
    data = d / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    d, md = damaged("hostile-metadata", single)
    md.version = hf.payload_object("os.system", str(local / "pwned"))
    (d / ".metadata").write_bytes(pickle.dumps(md))
    d, md = damaged("escape", single)
    next(iter(md.storage_data.values())).relative_path = "../outside.distcp"
    (d / ".metadata").write_bytes(pickle.dumps(md))
    d, md = damaged("past-end", single)
    next(iter(md.storage_data.values())).length = 1 << 40
    (d / ".metadata").write_bytes(pickle.dumps(md))
    d, md = damaged("altered-item", fsdp)
    info = min(md.storage_data.values(), key=lambda i: (i.relative_path, i.offset))
    raw = bytearray((d / info.relative_path).read_bytes())
    raw[info.offset + info.length - 40] ^= 0xFF  # inside the first item's end records
    raw[info.offset + 70] ^= 0xFF  # inside its pickle
    (d / info.relative_path).write_bytes(bytes(raw))
    # ckptaudit's own writer (DCP + manifest.json with every file's and item's hash), and a copy with one byte
    # of tensor data altered: only hashing the remote bytes against the manifest can see that one.
    from ckptaudit.launch import RankContext
    from ckptaudit.recipes.tinygpt import plain_recipe
    from ckptaudit.store import save_checkpoint

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        job = plain_recipe.setup(RankContext(rank=0, world_size=1, backend="gloo", shared_dir=""))
        plain_recipe.step(job)
        step = Path(save_checkpoint(job, local / "store").path)
    finally:
        torch.set_num_threads(threads)
    assert step.name == "step-000001", step
    out["store/step-000001"] = step
    d, md = damaged("store-altered", step)
    info = max(md.storage_data.values(), key=lambda i: i.length)
    raw = bytearray((d / info.relative_path).read_bytes())
    raw[info.offset + info.length // 2] ^= 0x01
    (d / info.relative_path).write_bytes(bytes(raw))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": a single-process save is what we want
        big = torch.randn(16 << 20, generator=torch.Generator().manual_seed(1))  # 64 MiB of fp32
        # With a non-tensor item whose pickle is larger than the first and last 4 KiB of its archive.
        dcp.save({"model": {"w": big}, "history": {"losses": [float(i) for i in range(4000)]}},
                 checkpoint_id=str(local / "big-dcp"))
        # The warm-up: one tensor above records.SMALL_TENSOR_BYTES, so it is scanned by the NumPy path too, and
        # one of 4 chunks, so the read-ahead path has run once (the client's buffers for it) before the peak.
        dcp.save({"model": {"w": torch.ones(1 << 17), "v": torch.ones(1 << 20)}},
                 checkpoint_id=str(local / "tiny-dcp"))
    out["big-dcp"], out["tiny-dcp"] = local / "big-dcp", local / "tiny-dcp"
    return out


_PEAK_CHILD = """
import json, sys
from ckptaudit.auditing.judge import run_audit

def status(key):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(key + ":"))

run_audit(sys.argv[1])
assert "numpy" in sys.modules, "the warm-up did not take the NumPy path: the peak would count NumPy's import"
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")  # reset the peak resident set (VmHWM) to the current one
before = status("VmRSS")
report = run_audit(sys.argv[2])
print(json.dumps({"before_kib": before, "peak_kib": status("VmHWM"), "codes": sorted({f.code for f in report.findings}),
                  "hashed": sum(t.hash is not None for t in report.tensors)}))
"""


def _audit(path: str) -> tuple[int, dict[str, Any], str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["audit", path, "--format", "json", "--no-progress"], stdout=out, stderr=err)
    return code, (json.loads(out.getvalue()) if out.getvalue() else {}), err.getvalue()


@pytest.mark.parametrize("name", ["ckpt.pt", "model.safetensors", "strided.pt", "hf", "dcp", "fsdp-dcp",
                                  "run/checkpoint", "store/step-000001"])
def test_s3_checkpoint_audits_the_same_as_its_local_copy(s3: dict[str, Any], name: str) -> None:
    code_remote, remote, err = _audit(f"s3://ckpts/{name}")
    code_local, local, _ = _audit(str(s3["files"][name]))
    assert code_remote == code_local, err
    assert remote["path"] == f"s3://ckpts/{name}"
    assert remote["tensors"] == local["tensors"]
    assert remote["findings"] == local["findings"]
    assert {k: v for k, v in remote.items() if k != "path"} == {k: v for k, v in local.items() if k != "path"}
    assert remote["tensors"] and all(t["hash"] for t in remote["tensors"])
    if name == "run/checkpoint":  # both DCP step directories are read, the Hugging Face one beside them is not (as locally)
        assert {t["name"].split("/")[0] for t in remote["tensors"]} >= {"step-2", "step-6"}, remote["tensors"][:3]


DAMAGED = {"truncated": "integrity.incomplete", "hostile-metadata": "security.unsafe-pickle",
           "escape": "integrity.path-escape", "past-end": "integrity.incomplete", "altered-item": "integrity.corrupt",
           "store-altered": "integrity.corrupt"}


@pytest.mark.parametrize("name", sorted(DAMAGED))
def test_a_damaged_s3_dcp_gives_the_findings_of_its_local_copy(s3: dict[str, Any], name: str) -> None:
    code_remote, remote, err = _audit(f"s3://ckpts/{name}")
    code_local, local, _ = _audit(str(s3["files"][name]))
    assert DAMAGED[name] in {f["code"] for f in local["findings"]}, local["findings"]
    assert code_remote == code_local == 1, err
    assert remote["findings"] == local["findings"]
    assert remote["tensors"] == local["tensors"]
    assert not os.path.exists(s3["files"]["hostile-metadata"].parent / "pwned")


def test_a_remote_dcp_is_audited_in_bounded_memory_with_its_data_never_staged(s3: dict[str, Any]) -> None:
    from ckptaudit.formats import open_checkpoint

    # In a child: peak resident set growth auditing one 64 MiB tensor over ranged reads, after a warm-up audit of
    # a tiny remote DCP (imports, the S3 client's session, the same code paths). The kernel's high-water mark is
    # reset after the warm-up (clear_refs 5), so a transient peak of the imports cannot hide the audit's.
    child = subprocess.run([sys.executable, "-c", _PEAK_CHILD, "s3://ckpts/tiny-dcp", "s3://ckpts/big-dcp"],
                           capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert child.returncode == 0, child.stderr[-3000:]
    answer = json.loads(child.stdout.strip().splitlines()[-1])
    assert answer["hashed"] >= 1 and "integrity.corrupt" not in answer["codes"], answer
    growth = (answer["peak_kib"] - answer["before_kib"]) / 1024
    # Measured ~26 MiB: READ_AHEAD (2) ranged reads of 4 MiB fetched together, the S3 client's buffers for them
    # (about three copies) and the chunk buffer; 32 MiB is half the tensor (holding it is 64 MiB).
    from ckptaudit.auditing.tensor_scan import REMOTE_PIECE_BYTES
    from ckptaudit.formats.remote.objects import READ_AHEAD

    bound = (3 * READ_AHEAD * REMOTE_PIECE_BYTES + (8 << 20)) / 2**20
    assert bound <= 32 and growth < bound, f"peak RSS grew {growth:.1f} MiB auditing a 64 MiB tensor"
    # The stand-in holds the items' metadata, not the tensor's bytes (sparse), and the report matches the local one.
    ckpt = open_checkpoint("s3://ckpts/big-dcp")
    try:
        standin = os.path.join(ckpt.maps.remote.root, "big-dcp", "__0_0.distcp")
        size = (s3["files"]["big-dcp"] / "__0_0.distcp").stat().st_size
        assert os.path.getsize(standin) == size and os.stat(standin).st_blocks * 512 < 1 << 20
    finally:
        ckpt.close()
    code_remote, remote, err = _audit("s3://ckpts/big-dcp")
    code_local, local, _ = _audit(str(s3["files"]["big-dcp"]))
    assert code_remote == code_local, err
    assert {k: v for k, v in remote.items() if k != "path"} == {k: v for k, v in local.items() if k != "path"}


def test_ranged_reads_are_coalesced_bounded_and_never_repeated(s3: dict[str, Any], tmp_path: Path) -> None:
    from ckptaudit.formats.remote.dcp import COALESCE_GAP, MAX_READ_BYTES, RangeStager
    from ckptaudit.formats.remote.objects import RemoteObject

    src = s3["files"]["big-dcp"] / "__0_0.distcp"
    size = src.stat().st_size
    local = tmp_path / "standin"
    with open(local, "wb") as fh:
        fh.truncate(size)
    taken: list[int] = []
    stager = RangeStager(RemoteObject(s3["fs"], "ckpts/big-dcp/__0_0.distcp", size), str(local), taken.append)
    assert COALESCE_GAP >= 1000
    stager.stage([(0, 100), (1100, 1200)])  # neighbours (1000 bytes apart): one read, the gap staged too
    assert stager.reads == 1 and stager.fetched == 1200
    stager.stage([(50, 150), (1150, 1200)])  # already staged: no read
    assert stager.reads == 1
    n = 2 * MAX_READ_BYTES + 5
    stager.stage([(1 << 20, (1 << 20) + n), (size - 10, size + 1000)])  # split into bounded reads; clipped
    assert stager.reads == 1 + 3 + 1 and stager.fetched == 1200 + n + 10 == sum(taken)
    want = src.read_bytes()
    got = local.read_bytes()
    for s, e in [(0, 1200), (1 << 20, (1 << 20) + n), (size - 10, size)]:
        assert got[s:e] == want[s:e]
    assert not any(got[1200 : 1 << 20])  # nothing else was fetched


def test_a_missing_object_is_a_clear_error(s3: dict[str, Any]) -> None:
    code, _, err = _audit("s3://ckpts/no-such.pt")
    assert code == 2 and "s3://ckpts/no-such.pt" in err and "no such object" in err


def test_tensor_data_is_read_with_ranged_reads_not_staged(s3: dict[str, Any]) -> None:
    from ckptaudit.formats import open_checkpoint

    ckpt = open_checkpoint("s3://ckpts/ckpt.pt")
    try:
        remote = ckpt.maps.remote
        assert remote is not None
        standin = os.path.join(remote.root, "ckpt.pt")
        st = os.stat(standin)
        size = s3["files"]["ckpt.pt"].stat().st_size
        assert st.st_size == size
        # Sparse: only the archive's metadata occupies disk, not the tensors' bytes.
        assert st.st_blocks * 512 < size / 4, (st.st_blocks * 512, size)
    finally:
        ckpt.close()
    assert not os.path.exists(remote.root)  # the stand-in goes with the checkpoint


def test_compare_reads_urls_too(s3: dict[str, Any]) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = main(["compare", str(s3["files"]["ckpt.pt"]), "s3://ckpts/ckpt.pt", "--format", "json", "--no-progress"],
                stdout=out, stderr=err)
    assert code == 0, err.getvalue()
    report = json.loads(out.getvalue())
    assert report["pairs"] and all(p["status"] == "identical" for p in report["pairs"]), report["summary"]


def test_url_forms() -> None:
    from ckptaudit.formats.remote.staging import is_url, local_path

    assert is_url("s3://b/k") and is_url("gs://b/k") and is_url("https://h/x.pt")
    assert not is_url("/tmp/x.pt") and not is_url("file:///tmp/x.pt") and not is_url("C://x")
    assert local_path("file:///tmp/x.pt") == "/tmp/x.pt" and local_path("/tmp/x.pt") == "/tmp/x.pt"


class _CountingFs:
    """Counts the storage library's reads of tensor data: calls, and requests (a ranged read is one; ``cat_ranges``
    makes one per range, concurrently), and the most requests in flight at once."""

    def __init__(self, fs: Any) -> None:
        import threading

        self.fs, self.calls, self.requests, self.in_flight, self.most = fs, 0, 0, 0, 0
        self._lock = threading.Lock()
        self._n = threading.local()

    def _enter(self, n: int) -> None:
        with self._lock:
            self.calls += 1
            self.requests += n
            self.in_flight += n
            self.most = max(self.most, self.in_flight)
        self._n.value = n

    def _leave(self) -> None:
        with self._lock:
            self.in_flight -= self._n.value

    def cat_file(self, *a: Any, **k: Any) -> Any:
        self._enter(1)
        try:
            return self.fs.cat_file(*a, **k)
        finally:
            self._leave()

    def cat_ranges(self, paths: list[str], *a: Any, **k: Any) -> Any:
        self._enter(len(paths))
        try:
            return self.fs.cat_ranges(paths, *a, **k)
        finally:
            self._leave()


@pytest.fixture(scope="module")
def many_small(s3: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A single-process DCP of 300 small tensors and one of 12 MiB (12 chunks), on the server as ``many-small``."""
    import warnings

    import torch.distributed.checkpoint as dcp

    d = tmp_path_factory.mktemp("many") / "many-small"
    g = torch.Generator().manual_seed(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": a single-process save is what we want
        dcp.save({"model": {f"l{i}.w": torch.randn(8 + i % 5, 16, generator=g) for i in range(300)},
                  "big": {"w": torch.randn(3 << 20, generator=g)}}, checkpoint_id=str(d))
    s3["fs"].put(str(d), "ckpts/many-small", recursive=True)
    s3fs.S3FileSystem.clear_instance_cache()  # the audits' client must not answer from an older listing
    return d


def _outcomes(path: str, jobs: int, counting: bool) -> tuple[dict[str, Any], _CountingFs | None]:
    from ckptaudit.auditing.plan import plan_scan
    from ckptaudit.auditing.scan import scan_items
    from ckptaudit.formats.remote.objects import RemoteObject

    plan = plan_scan(path)
    counter = None
    try:
        remote = plan.ckpt.maps.remote
        if counting:
            assert remote is not None
            first = next(iter(remote._files.values()))
            counter = _CountingFs(first.fs)
            remote._files = {k: RemoteObject(counter, r.path, r.size) for k, r in remote._files.items()}
        got = scan_items(plan, plan.scannable(), jobs=jobs)
        return {plan.items[i][0].name: (o.scan, o.error) for i, o in got.items()}, counter
    finally:
        plan.close()


@pytest.mark.parametrize("jobs", [1, 2])
def test_small_tensors_are_fetched_in_a_few_coalesced_reads_and_a_large_one_with_reads_in_flight(
        s3: dict[str, Any], many_small: Path, jobs: int) -> None:
    from ckptaudit.formats.remote.objects import READ_AHEAD

    local, _ = _outcomes(str(many_small), jobs, counting=False)
    remote, counter = _outcomes("s3://ckpts/many-small", jobs, counting=True)
    assert counter is not None
    assert remote == local  # every hash and precision verdict, read in the same order
    assert all(scan is not None and not err for scan, err in remote.values())
    # 300 small tensors: one request each before; coalesced, a few ranged reads per batch of 256. The 12 MiB
    # tensor: 3 ranged reads of 4 MiB, READ_AHEAD at a time.
    assert counter.requests <= 3 + 2 * 4, counter.requests
    assert counter.calls <= -(-3 // READ_AHEAD) + 2 * 2, counter.calls
    # Up to READ_AHEAD requests in flight per tensor streamed, never more than that per scanning thread.
    assert READ_AHEAD <= counter.most <= READ_AHEAD * jobs + 2, counter.most


def test_an_object_cut_short_under_the_read_ahead_is_unreadable_data_never_read(
        s3: dict[str, Any], many_small: Path, tmp_path: Path) -> None:
    """The read-ahead's concurrent reads are the pinned ones: an object cut short after staging is refused by the
    store (``IfMatch``), so the tensor is unread with why, never hashed from the shorter object."""
    from ckptaudit.auditing.plan import plan_scan
    from ckptaudit.auditing.scan import scan_items

    name = "__0_0.distcp"
    raw = (many_small / name).read_bytes()
    s3["fs"].put(str(many_small), "ckpts/many-cut", recursive=True)
    s3fs.S3FileSystem.clear_instance_cache()
    plan = plan_scan("s3://ckpts/many-cut")
    try:
        s3["fs"].pipe_file(f"ckpts/many-cut/{name}", raw[: len(raw) - (5 << 20)])  # cut while being audited
        big = next(i for i in plan.scannable() if plan.items[i][0].name.endswith("big/w"))
        got = scan_items(plan, [big])[big]
    finally:
        plan.close()
    assert got.scan is None and got.error is not None
    assert got.error.startswith(f"ckpts/many-cut/{name} changed since it was staged (the store refused the ETag "
                                "pinned then"), got.error


def test_item_ends_of_neighbouring_items_are_staged_in_a_few_reads_with_the_right_bytes(
        s3: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Staging a DCP of 60 items of 64-208 KiB in 3 data files (the shards of a many-rank save; the files staged
    at once): each item's archive ends are staged byte for byte, in a few ranged reads of at most MAX_READ_BYTES
    per file (one request per item before: the ends of neighbouring items are READ_THROUGH_GAP apart at most),
    never the tensor data between them; the audit equals the local copy's."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from ckptaudit.formats import open_checkpoint
    from ckptaudit.formats.remote import dcp as remote_dcp

    d = tmp_path / "mid-dcp"
    g = torch.Generator().manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": a single-process save is what we want
        dcp.save({"model": {f"l{i}.w": torch.randn(64 + 16 * (i % 10), 256, generator=g) for i in range(60)}},
                 storage_writer=FileSystemWriter(str(d), thread_count=3))
    s3["fs"].put(str(d), "ckpts/mid-dcp", recursive=True)
    s3fs.S3FileSystem.clear_instance_cache()
    counted: list[tuple[int, int]] = []
    real = remote_dcp.stage_dcp

    def counting(*a: Any, **k: Any) -> tuple[int, int]:
        counted.append(real(*a, **k))
        return counted[-1]

    monkeypatch.setattr(remote_dcp, "stage_dcp", counting)
    md = rc.read_dcp_metadata(d)
    items = [(i.relative_path, i.offset, i.length) for i in md.storage_data.values()]
    assert len(items) == 60 and all(64 << 10 <= n <= 256 << 10 for _, _, n in items)
    ckpt = open_checkpoint("s3://ckpts/mid-dcp")
    try:
        assert ckpt.maps.remote is not None
        root = os.path.join(ckpt.maps.remote.root, "mid-dcp")
        for rel, off, n in items:
            want = (d / rel).read_bytes()[off : off + n]
            got = Path(root, rel).read_bytes()[off : off + n]
            edge = remote_dcp.EDGE_BYTES
            assert got[:edge] == want[:edge] and got[-edge:] == want[-edge:], (rel, off)
            assert not any(got[edge + 1024 : n - edge - 1024]), (rel, off)  # the tensor data: never staged
    finally:
        ckpt.close()
    (reads, fetched), = counted
    sizes = [(d / f).stat().st_size for f in {rel for rel, _, _ in items}]
    data = sum(sizes)
    assert len(sizes) == 3, sizes
    # .metadata, then the items' ends: a read per MAX_READ_BYTES of each data file (and one for a piece left
    # over); 61 reads before (one per item and .metadata).
    assert reads <= 1 + sum(1 + -(-n // remote_dcp.MAX_READ_BYTES) for n in sizes), (reads, sizes)
    assert fetched <= data + (d / ".metadata").stat().st_size
    code_remote, remote, err = _audit("s3://ckpts/mid-dcp")
    code_local, local, _ = _audit(str(d))
    assert code_remote == code_local, err
    assert {k: v for k, v in remote.items() if k != "path"} == {k: v for k, v in local.items() if k != "path"}


def test_a_data_file_that_cannot_be_read_while_others_are_staged_at_once_stops_staging_with_its_error(
        s3: dict[str, Any], tmp_path: Path) -> None:
    """Data files are staged several at once: one whose object is gone (deleted after it was listed) makes staging
    fail with that file's read error, as when they were staged one after another, never a stand-in with its items'
    metadata missing."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from ckptaudit.formats.remote.dcp import FILES_IN_FLIGHT, stage_dcp
    from ckptaudit.formats.remote.errors import RemoteReadError
    from ckptaudit.formats.remote.objects import RemoteObject

    d = tmp_path / "gone-dcp"
    g = torch.Generator().manual_seed(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": a single-process save is what we want
        dcp.save({"model": {f"l{i}.w": torch.randn(64, 256, generator=g) for i in range(24)}},
                 storage_writer=FileSystemWriter(str(d), thread_count=4))
    s3["fs"].put(str(d), "ckpts/gone-dcp", recursive=True)
    names = sorted(p.name for p in d.iterdir())
    assert FILES_IN_FLIGHT > 1 and len([n for n in names if n.endswith(".distcp")]) == 4, names
    gone = [n for n in names if n.endswith(".distcp")][2]
    s3["fs"].rm(f"ckpts/gone-dcp/{gone}")
    files: dict[str, tuple[str, int, str]] = {}
    for name in names:
        local = tmp_path / "standin" / name
        local.parent.mkdir(exist_ok=True)
        size = (d / name).stat().st_size
        with open(local, "wb") as fh:
            fh.truncate(size)
        files[name] = (f"ckpts/gone-dcp/{name}", size, str(local))
    with pytest.raises(RemoteReadError, match=gone):
        stage_dcp(files, lambda path, size: RemoteObject(s3["fs"], path, size), lambda n: None)
