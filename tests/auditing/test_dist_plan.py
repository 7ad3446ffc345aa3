"""The distributed audit vets once and shares the plan: rank 0 walks and loads ``.metadata``, every other rank is
sent its share (plain JSON, linear in its pieces) and checks its own view of the vetted files.

On real 2-rank FSDP2 DCP saves (``fsdp_run``), real gloo ranks (``launch``, a timeout on the group and the
launch): the report equals the single-process one while only rank 0 walks ``.metadata``; a rank that sees other
``.metadata`` bytes makes an ``integrity.changed`` finding and leaves its share unread; an ``s3://`` checkpoint
audits the same on 2 ranks as in one process.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.auditing.distributed import partition
from ckptaudit.auditing.plan import plan_scan
from ckptaudit.auditing.scan import scan_datas, scan_items
from ckptaudit.auditing.share import (
    VettedFile,
    checkpoint_root,
    decode_share,
    encode_share,
    share_datas,
    vetted_file_problems,
    vetted_files,
    view_problems,
)
from ckptaudit.cli import main
from ckptaudit.formats.io.tensors import TensorData
from ckptaudit.launch import launch
from local_s3 import local_s3

FAST: dict[str, Any] = {"start_method": "forkserver", "preload": ("torch", "torch.distributed", "dist_plan_jobs")}


def _single(path: str) -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["audit", path, "--format", "json", "--no-progress", "--jobs", "1"], stdout=out, stderr=err)
    assert code in (0, 1), err.getvalue()
    report: dict[str, Any] = json.loads(out.getvalue())
    return report


def _audit(paths: list[str], env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    import dist_plan_jobs

    return launch(dist_plan_jobs.audit_rank, len(paths), (paths, 1), timeout_s=240, pg_timeout_s=120, env=env,
                  **FAST)


@pytest.fixture(scope="module")
def fsdp_dcp(fsdp_run: dict[str, Any]) -> Path:
    return Path(fsdp_run["dir"]) / "faithful"


def test_a_share_decodes_to_the_plans_tensors_and_names_only_its_own(fsdp_dcp: Path) -> None:
    plan = plan_scan(str(fsdp_dcp))
    try:
        scannable = plan.scannable()
        shares = partition({i: plan.nbytes(i) for i in scannable}, 3)
        pieces = {i: len(d.pieces) for i in scannable if isinstance(d := plan.items[i][0].data, TensorData)}
        assert max(pieces.values()) == 2  # FSDP2 over 2 ranks: tensors in two pieces, one per data file
        whole = len(encode_share(plan, scannable))
        for share in shares:
            data = encode_share(plan, share)
            raw = decode_share(data)
            assert raw.indices == share  # its own tensors, nothing of the others'
            assert vetted_files(plan, share) == raw.vetted  # what rank 0 checks of its own share, not encoded
            datas, steps = share_datas(raw, checkpoint_root(str(fsdp_dcp), raw.single_file))
            assert datas == {i: plan.items[i][0].data for i in share}
            assert steps == plan.step_items & set(share)
            # Linear in the pieces it reads: the fixed part (the vetted files) plus a bounded cost per piece.
            fixed = len(encode_share(plan, []))
            assert len(data) - fixed <= 160 * sum(pieces[i] for i in share)
            assert len(data) < whole
            names = {v.name for v in raw.vetted}
            assert ".metadata" in names and {v.digest is not None for v in raw.vetted if v.name == ".metadata"} == {True}
            assert set(raw.data_files) == {os.path.basename(p.file) for d in datas.values() for p in d.pieces}
            # What the rank scans from its share is what one process scans from the plan.
            assert scan_datas(datas, plan.ckpt.maps, step_items=steps) == scan_items(plan, share)
        assert sorted(i for s in shares for i in s) == scannable
    finally:
        plan.close()


def test_view_problems_name_a_changed_missing_or_resized_file(fsdp_dcp: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ckpt"
    shutil.copytree(fsdp_dcp, copy)
    plan = plan_scan(str(copy))
    try:
        raw = decode_share(encode_share(plan, plan.scannable()))
    finally:
        plan.close()
    assert view_problems(str(copy), raw.vetted) == []
    meta = copy / ".metadata"
    data = bytearray(meta.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size, other bytes
    meta.write_bytes(bytes(data))
    shard = copy / "__1_0.distcp"
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size - 1)
    (copy / "__0_0.distcp").unlink()
    problems = dict(view_problems(str(copy), raw.vetted))
    assert set(problems) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert problems[".metadata"].startswith("holds other bytes than rank 0 read (xxh3-128 ")
    assert problems["__1_0.distcp"] == (f"has {shard.stat().st_size} bytes where rank 0 read "
                                        f"{shard.stat().st_size + 1}")
    assert problems["__0_0.distcp"].startswith("cannot be read (")
    assert view_problems(str(copy), [VettedFile(".metadata", len(data))]) == []  # size only, when no digest


def test_three_ranks_report_what_one_process_reports_and_only_rank_0_walks_the_metadata(fsdp_dcp: Path) -> None:
    expected = _single(str(fsdp_dcp))
    results = _audit([str(fsdp_dcp)] * 3)
    assert results[0]["report"] == expected
    assert [r["calls"] for r in results] == [{"walk": 1, "load": 1}, {"walk": 0, "load": 0}, {"walk": 0, "load": 0}]
    assert "plan_s" in results[0]["stats"] and all("plan_s" not in r["stats"] for r in results[1:])
    for r in results[1:]:  # each rank was sent its own share, not the plan
        assert 0 < r["stats"]["received_bytes"] < results[0]["stats"]["sent_bytes"]
        assert r["stats"]["share_items"] >= 1


def test_a_rank_that_sees_other_metadata_bytes_reports_it_and_reads_nothing(fsdp_dcp: Path, tmp_path: Path) -> None:
    """Rank 1 is given a copy whose ``.metadata`` differs by one bit (what a save overwriting the checkpoint
    mid-audit looks like to it): the report says so, and leaves its share unread rather than judging it."""
    copy = tmp_path / "faithful"
    shutil.copytree(fsdp_dcp, copy)
    meta = copy / ".metadata"
    data = bytearray(meta.read_bytes())
    data[-8] ^= 0x01
    meta.write_bytes(bytes(data))
    expected = _single(str(fsdp_dcp))
    results = _audit([str(fsdp_dcp), str(copy)])
    report = results[0]["report"]
    changed = {f["subject"]: f for f in report["findings"] if f["code"] == "integrity.changed"}
    # The copy's data files are other files (other inodes) than rank 0 read: each is another version.
    assert set(changed) == {".metadata", "__0_0.distcp", "__1_0.distcp"}, report["findings"]
    assert all(f["severity"] == "error" and f["evidence"]["ranks"] == [1] for f in changed.values())
    assert "on rank 1 it holds other bytes than rank 0 read" in changed[".metadata"]["message"]
    assert "on rank 1 it is another version than rank 0 read (another file: device " in \
        changed["__0_0.distcp"]["message"]
    unread = [t for t in report["tensors"] if t["precision"] == "unread"]
    assert len(unread) == results[1]["stats"]["share_items"] == changed[".metadata"]["evidence"]["unread"] > 0
    # The rest is rank 0's own reading, as one process reads it; no finding but the one says "cannot read".
    read = {t["name"]: t for t in report["tensors"] if t["precision"] != "unread"}
    assert read and all(t == read[t["name"]] for t in expected["tensors"] if t["name"] in read)
    corrupt = [[f["subject"], f["message"]] for f in report["findings"] if f["code"] == "integrity.corrupt"]
    assert corrupt == [[f["subject"], f["message"]] for f in expected["findings"] if f["code"] == "integrity.corrupt"]


@pytest.fixture(scope="module")
def s3_dcp(fsdp_dcp: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """The FSDP2 save on a local S3 server (moto's server mode on 127.0.0.1), and the environment to reach it."""
    with local_s3("plans") as s3:
        s3.fs.put(str(fsdp_dcp), "plans/fsdp", recursive=True)
        yield "s3://plans/fsdp", s3.env


def test_two_ranks_audit_a_url_as_one_process_does(s3_dcp: tuple[str, dict[str, str]]) -> None:
    url, env = s3_dcp
    expected = _single(url)
    results = _audit([url, url], env=env)
    assert results[0]["report"] == expected
    assert results[1]["calls"] == {"walk": 0, "load": 0}
    assert results[1]["stats"]["share_items"] >= 1


def test_a_ranks_share_behind_a_url_reads_the_objects_rank_0_pinned(s3_dcp: tuple[str, dict[str, str]],
                                                                    fsdp_dcp: Path) -> None:
    """Rank 0's share carries the ETag it pinned each data file to; another rank's reads (its view check and its
    tensors' bytes) go through the same pinned, bounded reads as rank 0's: an object replaced by bytes of the same
    length before that rank lists it is ``integrity.changed`` (another object than rank 0 read), and one replaced
    after it is refused by the store (``IfMatch``), never read as the vetted object."""
    import s3fs

    from ckptaudit.formats.remote.errors import ObjectChanged
    from ckptaudit.formats.remote.staging import ShareReader

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.put(str(fsdp_dcp), "plans/pinned", recursive=True)  # its own objects: the module's others stay as saved
    s3fs.S3FileSystem.clear_instance_cache()  # the cached instance's listing of the bucket predates the put
    url = "s3://plans/pinned"
    plan = plan_scan(url)
    try:
        raw = decode_share(encode_share(plan, plan.scannable()))
    finally:
        plan.close()
    data_names = sorted(raw.data_files)
    assert data_names and all(v.etag for v in raw.vetted if v.name in raw.data_files)

    def problems() -> list[tuple[str, str]]:
        reader = ShareReader(url, single_file=raw.single_file)
        try:
            view = reader.view([v.name for v in raw.vetted], digest={v.name for v in raw.vetted if v.digest})
        finally:
            reader.close()
        out: list[tuple[str, str]] = []
        for v in raw.vetted:
            seen = view[v.name]
            out += [(v.name, seen)] if isinstance(seen, str) else vetted_file_problems(v, *seen)
        return out

    assert problems() == []
    reader = ShareReader(url, single_file=raw.single_file)
    reader.view([v.name for v in raw.vetted], digest=set())
    root, remote = reader.stand_in(raw.data_files)
    try:
        name = data_names[0]
        body = bytearray(fs.cat_file(f"plans/pinned/{name}"))
        body[len(body) // 2] ^= 0x01  # same size, other bytes
        fs.pipe_file(f"plans/pinned/{name}", bytes(body))
        buf = memoryview(bytearray(4096))
        with pytest.raises(ObjectChanged, match="changed since it was staged"):
            remote.read_into(os.path.join(root, name), buf, len(body) // 2 - 100)
    finally:
        remote.close()
    assert [n for n, what in problems() if what.startswith("is another object than rank 0 read (ETag ")] == [name]
