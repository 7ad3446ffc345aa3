"""Checkpoints behind URLs, served by broken or hostile servers (issue 25): real local servers on 127.0.0.1
(``http_servers.ObjectServer``, a thread per connection; moto's S3 server), real sockets, no mocks.

Every request is bounded (a deadline, the reply capped to the range asked), the first that breaks stops the
others (the work is bounded by the requests counted at the server, not by a clock), an object replaced during
the audit is reported rather than read, and a configuration the storage library refuses is one line, exit 2."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.auditing.plan import plan_scan
from ckptaudit.auditing.scan import assemble, scan_items
from ckptaudit.cli import main
from http_servers import ObjectServer
from local_s3 import CREDENTIALS, local_s3
from runs import SRC

TENSORS = 4


@pytest.fixture(scope="module")
def big_pt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A torch.save file of 4 tensors of 256 KiB: its metadata reads are small, its tensor reads are not."""
    import torch

    path = tmp_path_factory.mktemp("http") / "ckpt.pt"
    g = torch.Generator().manual_seed(0)
    torch.save({"model": {f"w{i}": torch.randn(1 << 16, generator=g) for i in range(TENSORS)}, "step": 3}, path)
    return path


def _audit(url: str) -> tuple[int, dict[str, Any], str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["audit", url, "--format", "json", "--no-progress", "--jobs", "1"], stdout=out, stderr=err)
    return code, (json.loads(out.getvalue()) if out.getvalue() else {}), err.getvalue()


@pytest.fixture
def short_timeout(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setenv("CKPTAUDIT_REMOTE_TIMEOUT", "1")
    return 1.0


def test_an_honest_server_audits_as_the_local_copy(big_pt: Path) -> None:
    with ObjectServer(big_pt.read_bytes()) as srv:
        code, remote, err = _audit(f"{srv.url}/ckpt.pt")
    code_local, local, _ = _audit(str(big_pt))
    assert code == code_local, err
    assert {k: v for k, v in remote.items() if k != "path"} == {k: v for k, v in local.items() if k != "path"}
    assert len(remote["tensors"]) == TENSORS and all(t["hash"] for t in remote["tensors"])
    assert srv.sent <= 1.01 * big_pt.stat().st_size  # nothing fetched twice or beyond the object


@pytest.mark.parametrize("mode", ["lying-length", "trickle", "no-ranges"])
def test_a_misbehaving_server_costs_one_deadline_not_one_per_request(
        mode: str, big_pt: Path, short_timeout: float) -> None:
    """The server answers the small metadata reads honestly and misbehaves on the tensor reads: the first one
    fails on its deadline or its protocol, and no further tensor read is even requested (each would have cost
    aiohttp's 300 s, or 150 MB of an ignored range)."""
    with ObjectServer(big_pt.read_bytes(), mode, trickle_s=0.02) as srv:
        code, report, err = _audit(f"{srv.url}/ckpt.pt")
        big, sent = srv.big_requests, srv.sent
    assert code == 1, err
    unread = [f for f in report["findings"] if f["code"] == "integrity.corrupt"]
    assert len(unread) == TENSORS and all("cannot read its data" in f["message"] for f in unread), unread
    assert big == 1, f"{big} tensor reads requested after the first failed"
    why = {"lying-length": "did not arrive", "trickle": "did not arrive", "no-ranges": "ignores Range"}[mode]
    assert why in unread[0]["message"], unread[0]["message"]
    assert all("no more requests are made" in f["message"] for f in unread[1:])
    # Replies capped to what was asked: a few socket buffers at most, never the 150 MB a reply offered.
    assert sent < 8 << 20, sent


def test_a_server_that_ignores_ranges_from_the_start_stops_staging_in_one_line(
        big_pt: Path, short_timeout: float) -> None:
    with ObjectServer(big_pt.read_bytes(), "no-ranges", honest_below=0) as srv:
        code, _, err = _audit(f"{srv.url}/ckpt.pt")
        requests, sent = srv.requests, srv.sent
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("ckptaudit audit: error: ") and "ignores Range" in err, err
    assert requests <= 4 and sent < 8 << 20, (requests, sent)


@pytest.mark.parametrize("mode", ["honest", "ignores-if-match"])
def test_an_http_object_replaced_during_the_audit_is_reported_not_read(mode: str, big_pt: Path) -> None:
    """Staged, then replaced by bytes of the same length (one tensor's values changed): every later read carries
    the ETag read at staging; the server refuses it (412), or its reply's ETag says it changed."""
    data = big_pt.read_bytes()
    with ObjectServer(data, mode) as srv:
        plan = plan_scan(f"{srv.url}/ckpt.pt")
        try:
            altered = bytearray(data)
            altered[len(data) // 2] ^= 0xFF  # inside a tensor's data
            srv.replace(bytes(altered))
            scanned = assemble(plan, scan_items(plan, plan.scannable()))
        except BaseException:
            plan.close()
            raise
        scanned.close()
    changed = [f for f in scanned.findings if f.code == "integrity.corrupt"]
    assert changed and all("changed since it was staged" in f.message for f in changed), \
        [(f.code, f.message) for f in scanned.findings]


# ---------------------------------------------------------------------------------------------------------------
# S3 (moto's server): the pinned ETag, and configuration errors in one line


@pytest.fixture(scope="module")
def s3(big_pt: Path) -> Iterator[dict[str, Any]]:
    with local_s3("hostile") as s3:
        s3.fs.put(str(big_pt), "hostile/ckpt.pt")
        yield {"fs": s3.fs, "endpoint": s3.endpoint, "env": dict(CREDENTIALS)}


def test_an_s3_object_replaced_during_the_audit_is_reported_not_read(s3: dict[str, Any], big_pt: Path) -> None:
    """Staged, replaced by bytes of the same length, then staged again by a second audit in the same process
    (fsspec shares one S3 client): the first audit's reads are refused (its ETag is no longer the object's), the
    second reads the new object as it staged it."""
    data = big_pt.read_bytes()
    plan = plan_scan("s3://hostile/ckpt.pt")
    second = None
    try:
        altered = bytearray(data)
        altered[len(data) // 2] ^= 0xFF
        s3["fs"].pipe("hostile/ckpt.pt", bytes(altered))
        second = plan_scan("s3://hostile/ckpt.pt")
        scanned = assemble(plan, scan_items(plan, plan.scannable()))
        again = assemble(second, scan_items(second, second.scannable()))
    except BaseException:
        plan.close()
        if second is not None:
            second.close()
        raise
    finally:
        s3["fs"].pipe("hostile/ckpt.pt", data)
    scanned.close()
    again.close()
    changed = [f for f in scanned.findings if f.code == "integrity.corrupt"]
    assert changed and all("changed since it was staged" in f.message for f in changed), \
        [(f.code, f.message) for f in scanned.findings]
    assert not [f for f in again.findings if f.code.startswith("integrity")]
    assert [r.hash for r in again.records] != [r.hash for r in scanned.records]
    _, report, err = _audit("s3://hostile/ckpt.pt")  # restored: audits clean of integrity findings again
    assert not [f for f in report["findings"] if f["code"].startswith("integrity")], err


def test_an_s3_object_replaced_after_its_only_staging_is_refused_by_the_store(s3: dict[str, Any],
                                                                             big_pt: Path) -> None:
    """No second staging to notice the new ETag: every GetObject carries the staged ETag as IfMatch, so the store
    itself refuses to serve the replacement (412) and its tensors are integrity.corrupt, never the new bytes."""
    data = big_pt.read_bytes()
    plan = plan_scan("s3://hostile/ckpt.pt")
    try:
        altered = bytearray(data)
        altered[len(data) // 2] ^= 0xFF
        s3["fs"].pipe("hostile/ckpt.pt", bytes(altered))
        scanned = assemble(plan, scan_items(plan, plan.scannable()))
    finally:
        s3["fs"].pipe("hostile/ckpt.pt", data)
        plan.close()
    changed = [f for f in scanned.findings if f.code == "integrity.corrupt"]
    assert len(changed) == TENSORS and all("changed since it was staged" in f.message for f in changed), \
        [(f.code, f.message) for f in scanned.findings]
    assert len([r for r in scanned.records if r.hash is None]) == TENSORS, scanned.records  # nothing hashed


@pytest.mark.parametrize("setting", ["FSSPEC_S3_ENDPOINT_URL", "no-credentials", "CKPTAUDIT_REMOTE_TIMEOUT"])
def test_a_remote_configuration_error_is_one_line_and_exit_2(s3: dict[str, Any], setting: str,
                                                             tmp_path: Path) -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FSSPEC_"))}, **s3["env"],
           "AWS_ENDPOINT_URL": s3["endpoint"], "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}
    if setting == "FSSPEC_S3_ENDPOINT_URL":  # an endpoint botocore refuses (s3fs 0.4 refused the option itself)
        env.pop("AWS_ENDPOINT_URL")
        env["FSSPEC_S3_ENDPOINT_URL"] = "not a url"
    elif setting == "no-credentials":
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            env.pop(k)
        env.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"),
                   AWS_EC2_METADATA_DISABLED="true")
    else:
        env["CKPTAUDIT_REMOTE_TIMEOUT"] = "soon"
    proc = subprocess.run([sys.executable, "-m", "ckptaudit", "audit", "s3://hostile/ckpt.pt", "--no-progress"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("ckptaudit")]  # (and s3fs's warnings)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("ckptaudit audit: error: "), lines
    assert {"FSSPEC_S3_ENDPOINT_URL": "endpoint", "no-credentials": "s3://hostile/ckpt.pt",
            "CKPTAUDIT_REMOTE_TIMEOUT": "CKPTAUDIT_REMOTE_TIMEOUT='soon'"}[setting] in lines[0], lines[0]


def test_fsspec_s3_options_reach_the_store(s3: dict[str, Any], tmp_path: Path) -> None:
    """fsspec's ``FSSPEC_S3_*`` configuration is what the docs name for s3fs's options: the ``[remote]`` extra's s3fs
    takes ``endpoint_url`` (0.4.2, which an unbounded install resolved to, refused it and fsspec warned it was very
    old at every use), and the audit is the one ``AWS_ENDPOINT_URL`` gives."""
    base = {**{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FSSPEC_"))}, **s3["env"],
            "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}
    runs = []
    for setting in ({"AWS_ENDPOINT_URL": s3["endpoint"]}, {"FSSPEC_S3_ENDPOINT_URL": s3["endpoint"]}):
        proc = subprocess.run([sys.executable, "-m", "ckptaudit", "audit", "s3://hostile/ckpt.pt", "--no-progress",
                               "--format", "json"], capture_output=True, text=True, timeout=120,
                              env={**base, **setting}, cwd=tmp_path)
        assert proc.returncode in (0, 1) and proc.stdout, proc.stderr[-3000:]
        assert "very old" not in proc.stderr, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout))
    assert runs[0] == runs[1] and runs[0]["tensors"]
