"""Checkpoints behind ``gs://`` URLs, for real: a Google Cloud Storage emulator (gcp-storage-emulator, a child process
on 127.0.0.1 and a free port, reaped at the end) read through gcsfs, as a user's ``gs://`` bucket is.

What the ``s3://`` tests hold, on ``gs://``: ``ckptaudit audit`` of a real ``torch.save`` file and a real DCP folder
gives its local copy's report, and ``ckptaudit.audit(url)`` the CLI's; ``ckptaudit latest gs://bucket/run/`` names
the newest good checkpoint of a run of ``.pt`` files and of DCP ``step-N/`` folders (each judged like its local
copy); a checkpoint attested here and copied to the bucket verifies there, and a byte flipped in the bucket fails
it, naming the file. A store that refuses a request is one line on stderr, exit 2 (gcsfs's logged traceback kept
out).

Run: ``.venv/bin/python -m pytest -q tests/formats/test_remote_gcs.py``
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import ckptaudit
import real_checkpoints as rc
from local_gcs import gcs_environment, gcs_server
from real_checkpoints import trained
from runs import SRC, cli

pytest.importorskip("gcsfs")
pytest.importorskip("gcp_storage_emulator")

BUCKET = "gcs-ckpts"


@pytest.fixture(scope="module")
def gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The emulator holding a torch.save file, a DCP folder (attested here first: it carries its passport), a run of
    three ``.pt`` checkpoints (the newest rounded to bf16) beside a note, a run of two DCP ``step-N/`` folders; this
    process pointed at it."""
    local = tmp_path_factory.mktemp("gcs")
    pt = rc.torch_save_checkpoint(local / "ckpt.pt")
    dcp = rc.dcp_checkpoint(local / "dcp")
    code, out, err = cli("attest", str(dcp))
    assert code == 0, out + err
    run = local / "run"
    run.mkdir()
    trained(run / "ckpt-0002.pt")
    trained(run / "ckpt-0004.pt")
    trained(run / "ckpt-0006.pt", rounded=True)
    for step in (2, 4):
        shutil.copytree(dcp, local / "steps" / f"step-{step}", ignore=shutil.ignore_patterns("ckptaudit.passport.*"))
    with gcs_server() as env, gcs_environment(env) as fs:
        fs.mkdir(BUCKET)
        fs.put(str(pt), f"{BUCKET}/ckpt.pt")
        fs.put(str(dcp), f"{BUCKET}/dcp", recursive=True)
        for p in sorted(run.iterdir()):
            fs.put(str(p), f"{BUCKET}/run/{p.name}")
        fs.pipe(f"{BUCKET}/run/notes.txt", b"loss 1.0\n")
        fs.put(str(local / "steps"), f"{BUCKET}/steps", recursive=True)
        yield {"local": local, "fs": fs, "env": env}


def _json(*argv: str) -> tuple[int, dict[str, Any], str]:
    code, out, err = cli(*argv, "--format", "json", "--no-progress")
    return code, (json.loads(out) if out else {}), err


@pytest.mark.parametrize("name", ["ckpt.pt", "dcp"])
def test_a_gs_checkpoint_audits_like_its_local_copy_and_the_api_gives_the_cli_report(gcs: dict[str, Any],
                                                                                    name: str) -> None:
    url = f"gs://{BUCKET}/{name}"
    code, remote, err = _json("audit", url)
    code_local, local, _ = _json("audit", str(gcs["local"] / name))
    assert code == code_local == 0, err
    assert remote["path"] == url and remote["tensors"] and all(t["hash"] for t in remote["tensors"])
    assert {k: v for k, v in remote.items() if k != "path"} == {k: v for k, v in local.items() if k != "path"}
    assert json.loads(ckptaudit.audit(url).to_json()) == remote


def test_the_command_line_reaches_gs_through_the_environment_alone(gcs: dict[str, Any], tmp_path: Path) -> None:
    """``python -m ckptaudit audit gs://...`` in a fresh process configured only as a user would (the emulator's
    variable and fsspec's ``FSSPEC_GS_TOKEN``): the in-process report."""
    env = {**os.environ, **gcs["env"], "PYTHONPATH": str(SRC)}
    proc = subprocess.run([sys.executable, "-m", "ckptaudit", "audit", f"gs://{BUCKET}/dcp", "--format", "json",
                           "--no-progress"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == _json("audit", f"gs://{BUCKET}/dcp")[1]


def test_latest_on_a_gs_root_names_the_newest_good_checkpoint(gcs: dict[str, Any]) -> None:
    code, doc, err = _json("latest", f"gs://{BUCKET}/run/")
    assert code == 0 and doc["latest"] == f"gs://{BUCKET}/run/ckpt-0004.pt", err
    assert doc["skipped"] == [{"name": "notes.txt", "reason": "not a checkpoint file (.txt)"}]
    rows = {c["name"]: c for c in doc["candidates"]}
    assert {f["code"] for f in rows["ckpt-0006.pt"]["findings"] if f["severity"] == "error"} == {
        "precision.bf16-rounded"}
    _, here, _ = _json("latest", str(gcs["local"] / "run"))
    for c in here["candidates"]:
        assert [f["code"] for f in rows[c["name"]]["findings"]] == [f["code"] for f in c["findings"]], c["name"]


def test_latest_on_a_gs_root_of_dcp_step_folders_judges_them_like_their_local_copies(gcs: dict[str, Any]) -> None:
    code, doc, err = _json("latest", f"gs://{BUCKET}/steps", "--all")
    _, here, _ = _json("latest", str(gcs["local"] / "steps"), "--all")
    assert code == 0 and doc["latest"] == f"gs://{BUCKET}/steps/step-4" and doc["skipped"] == [], err

    def rows(d: dict[str, Any]) -> list[tuple[str, str, list[str]]]:
        return [(c["name"], c["layout"], [f["code"] for f in c["findings"]]) for c in d["candidates"]]

    assert rows(doc) == rows(here) and [r[0] for r in rows(doc)] == ["step-4", "step-2"]


def test_a_gs_copy_verifies_against_its_passport_and_a_flipped_byte_names_the_file(gcs: dict[str, Any]) -> None:
    fs, local = gcs["fs"], gcs["local"] / "dcp"
    copy = f"{BUCKET}/verify-copy"
    fs.put(str(local), copy, recursive=True)  # gcloud storage cp -r carries the passport inside
    code, out, err = cli("verify", f"gs://{copy}/")
    assert code == 0 and out.startswith("VERIFIED"), out + err
    data = max((n for n in os.listdir(local) if n.endswith(".distcp")), key=lambda n: (local / n).stat().st_size)
    flipped = bytearray((local / data).read_bytes())
    flipped[len(flipped) // 2] ^= 1
    fs.pipe(f"{copy}/{data}", bytes(flipped))
    code, out, err = cli("verify", f"gs://{copy}/")
    assert code == 1 and f"{data}: its bytes differ" in out, out + err


def test_a_missing_gs_object_is_a_clear_error(gcs: dict[str, Any]) -> None:
    code, _, err = _json("audit", f"gs://{BUCKET}/no-such.pt")
    assert code == 2 and f"gs://{BUCKET}/no-such.pt" in err and "no such object" in err, err


class _Refusing(BaseHTTPRequestHandler):
    """A GCS endpoint that refuses every request with a 400 (gcsfs does not retry it, and logs it with its traceback)."""

    def do_GET(self) -> None:
        body = json.dumps({"error": {"code": 400, "message": "the store refuses this request"}}).encode()
        self.send_response(400)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_store_that_refuses_is_one_line_on_stderr_and_exit_2(tmp_path: Path) -> None:
    """A fresh ``ckptaudit`` process (no logging configured, as a user runs it): gcsfs's logged traceback stays out
    of stderr; the one line names the URL and the store's words."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        env = {**os.environ, "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{server.server_address[1]}",
               "FSSPEC_GS_TOKEN": "anon", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "PYTHONPATH": str(SRC)}
        proc = subprocess.run([sys.executable, "-m", "ckptaudit", "audit", "gs://refused/ckpt.pt", "--no-progress"],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1 and "gs://refused/ckpt.pt" in proc.stderr, proc.stderr[-3000:]
    assert "the store refuses this request" in proc.stderr and "Traceback" not in proc.stderr


def test_a_stalled_gs_read_is_bounded_by_the_remote_timeout(gcs: dict[str, Any], tmp_path: Path) -> None:
    """A store that never answers one ranged read: gcsfs alone waits for ever (aiohttp without a timeout); with
    ``$CKPTAUDIT_REMOTE_TIMEOUT`` applied the read gives up after a second, gcsfs retries it, and the audit ends with
    its local copy's report (a fresh process, as a user runs it)."""
    from local_gcs import StallingProxy

    with StallingProxy(gcs["env"]["STORAGE_EMULATOR_HOST"]) as proxy:
        env = {**os.environ, **gcs["env"], "STORAGE_EMULATOR_HOST": proxy.url, "CKPTAUDIT_REMOTE_TIMEOUT": "1",
               "PYTHONPATH": str(SRC)}
        try:
            proc = subprocess.run([sys.executable, "-m", "ckptaudit", "audit", f"gs://{BUCKET}/ckpt.pt", "--format",
                                   "json", "--no-progress"], env=env, cwd=tmp_path, capture_output=True, text=True,
                                  timeout=60, check=False)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"the audit waited on the stalled read past 60 s:\n{str(exc.stderr)[-3000:]}")
    assert proxy.stalled
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, local, _ = _json("audit", str(gcs["local"] / "ckpt.pt"))
    remote = json.loads(proc.stdout)
    assert {k: v for k, v in remote.items() if k != "path"} == {k: v for k, v in local.items() if k != "path"}


def _replaceable(fs: Any, name: str, tmp_path: Path) -> bytes:
    """A torch.save file of 4 tensors of 256 KiB put at ``BUCKET/name`` (each test its own object); its bytes."""
    import torch

    g = torch.Generator().manual_seed(0)
    torch.save({"model": {f"w{i}": torch.randn(1 << 16, generator=g) for i in range(4)}, "step": 3},
               tmp_path / "ckpt.pt")
    data = (tmp_path / "ckpt.pt").read_bytes()
    fs.pipe(f"{BUCKET}/{name}", data)
    return data


def _altered(data: bytes) -> bytes:
    altered = bytearray(data)
    altered[len(data) // 2] ^= 0xFF  # inside a tensor's data, same length
    return bytes(altered)


def _scan(plan: Any) -> Any:
    from ckptaudit.auditing.scan import assemble, scan_items

    try:
        return assemble(plan, scan_items(plan, plan.scannable()))
    finally:
        plan.close()


def test_a_gs_object_replaced_after_its_only_staging_is_refused_by_its_generation(gcs: dict[str, Any],
                                                                                tmp_path: Path) -> None:
    """Every read asks for the generation listed at staging; once the object is replaced, Cloud Storage answers 404
    for that generation (the emulator does not: a proxy in front of it answers as the store does), and its tensors
    are ``integrity.corrupt`` "changed since it was staged", never the new bytes."""
    from gcsfs import GCSFileSystem

    from ckptaudit.auditing.plan import plan_scan
    from local_gcs import GenerationProxy

    # gcsfs reads STORAGE_EMULATOR_HOST at each request: the writer is bound to the emulator itself
    fs = GCSFileSystem(token="anon", endpoint_url=gcs["env"]["STORAGE_EMULATOR_HOST"], skip_instance_cache=True)
    data = _replaceable(fs, "replaced-once.pt", tmp_path)
    listed = str(fs.info(f"{BUCKET}/replaced-once.pt")["generation"])
    with GenerationProxy(gcs["env"]["STORAGE_EMULATOR_HOST"]) as proxy, \
            gcs_environment({**gcs["env"], "STORAGE_EMULATOR_HOST": proxy.url}):
        plan = plan_scan(f"gs://{BUCKET}/replaced-once.pt")
        staged = len(proxy.asked)
        fs.pipe(f"{BUCKET}/replaced-once.pt", _altered(data))
        assert str(fs.info(f"{BUCKET}/replaced-once.pt", refresh=True)["generation"]) != listed
        scanned = _scan(plan)
    assert staged and len(proxy.asked) > staged  # staging and tensor reads both went through the proxy
    assert proxy.asked == [(f"{BUCKET}/replaced-once.pt".partition("/")[2], listed)] * len(proxy.asked)
    changed = [f for f in scanned.findings if f.code == "integrity.corrupt"]
    assert len(changed) == 4 and all("replaced-once.pt changed since it was staged (generation " + listed in f.message
                                     for f in changed), [(f.code, f.message) for f in scanned.findings]
    assert [r.hash for r in scanned.records] == [None] * 4  # nothing of the new bytes hashed


def test_a_gs_object_replaced_then_staged_again_fails_the_first_audit_and_not_the_second(gcs: dict[str, Any],
                                                                                        tmp_path: Path) -> None:
    """Staged, replaced by bytes of the same length, staged again by a second audit in the same process (on the
    emulator itself, which serves any generation asked): the first audit's reads are refused before they are sent
    (its generation is no longer the one listed), the second reads the new object as it staged it."""
    from ckptaudit.auditing.plan import plan_scan

    fs = gcs["fs"]
    data = _replaceable(fs, "replaced-twice.pt", tmp_path)
    url = f"gs://{BUCKET}/replaced-twice.pt"
    first = plan_scan(url)
    try:
        fs.pipe(f"{BUCKET}/replaced-twice.pt", _altered(data))
        second = plan_scan(url)
    except BaseException:
        first.close()
        raise
    scanned, again = _scan(first), _scan(second)
    changed = [f for f in scanned.findings if f.code == "integrity.corrupt"]
    assert changed and all("changed since it was staged (generation " in f.message and "when staged again since"
                           in f.message for f in changed), [(f.code, f.message) for f in scanned.findings]
    assert not [f for f in again.findings if f.code.startswith("integrity")]
    assert None not in [r.hash for r in again.records]
    assert [r.hash for r in again.records] != [r.hash for r in scanned.records]


def test_the_guards_pinned_copy_of_a_gs_object_is_its_listed_generation_or_refused(gcs: dict[str, Any],
                                                                                  tmp_path: Path) -> None:
    """The guard's pin of a ``gs://`` checkpoint (:mod:`ckptaudit.formats.remote.snapshot`): the snapshot records the
    generation, the copy asks for it (the bytes saved); replaced after the snapshot, the copy is refused."""
    from gcsfs import GCSFileSystem

    from ckptaudit.formats.remote.errors import ObjectChanged
    from ckptaudit.formats.remote.snapshot import copy_pinned, snapshot
    from local_gcs import GenerationProxy

    fs = GCSFileSystem(token="anon", endpoint_url=gcs["env"]["STORAGE_EMULATOR_HOST"], skip_instance_cache=True)
    data = _replaceable(fs, "guarded.pt", tmp_path)
    with GenerationProxy(gcs["env"]["STORAGE_EMULATOR_HOST"]) as proxy, \
            gcs_environment({**gcs["env"], "STORAGE_EMULATOR_HOST": proxy.url}):
        was = snapshot(f"gs://{BUCKET}/guarded.pt")
        [listed] = [o.version for o in was.objects]
        (tmp_path / "first").mkdir()
        (tmp_path / "second").mkdir()
        copy = copy_pinned(was, str(tmp_path / "first"))
        fs.pipe(f"{BUCKET}/guarded.pt", _altered(data))
        with pytest.raises(ObjectChanged, match=f"generation {listed}"):
            copy_pinned(was, str(tmp_path / "second"))
    assert Path(copy).read_bytes() == data
    assert listed and {g for _, g in proxy.asked} == {listed}


def test_another_ranks_share_of_a_gs_checkpoint_reads_the_generation_it_listed(gcs: dict[str, Any],
                                                                               tmp_path: Path) -> None:
    """A distributed audit's other rank (:class:`~ckptaudit.formats.remote.staging.ShareReader`) behind ``gs://``:
    rank 0's share carries each data file's ETag, this rank's reads ask for the generation it listed; an object
    replaced after it listed is refused (the store's 404 for that generation), and its view then names the object
    as another than rank 0 read."""
    from gcsfs import GCSFileSystem

    from ckptaudit.auditing.plan import plan_scan
    from ckptaudit.auditing.share import decode_share, encode_share, vetted_file_problems
    from ckptaudit.formats.remote.errors import ObjectChanged
    from ckptaudit.formats.remote.staging import ShareReader
    from local_gcs import GenerationProxy

    fs = GCSFileSystem(token="anon", endpoint_url=gcs["env"]["STORAGE_EMULATOR_HOST"], skip_instance_cache=True)
    fs.put(str(gcs["local"] / "dcp"), f"{BUCKET}/shared", recursive=True)
    url = f"gs://{BUCKET}/shared"
    with GenerationProxy(gcs["env"]["STORAGE_EMULATOR_HOST"]) as proxy, \
            gcs_environment({**gcs["env"], "STORAGE_EMULATOR_HOST": proxy.url}):
        plan = plan_scan(url)
        try:
            raw = decode_share(encode_share(plan, plan.scannable()))
        finally:
            plan.close()
        assert raw.data_files and all(v.etag for v in raw.vetted if v.name in raw.data_files)

        def problems() -> list[tuple[str, str]]:
            reader = ShareReader(url, single_file=raw.single_file)
            try:
                view = reader.view([v.name for v in raw.vetted], digest={v.name for v in raw.vetted if v.digest})
            finally:
                reader.close()
            return [p for v in raw.vetted for p in ([(v.name, view[v.name])] if isinstance(view[v.name], str) else
                                                     vetted_file_problems(v, *view[v.name]))]

        assert problems() == []
        reader = ShareReader(url, single_file=raw.single_file)
        reader.view([v.name for v in raw.vetted], digest=set())
        root, remote = reader.stand_in(raw.data_files)
        name = sorted(raw.data_files)[0]
        try:
            body = bytearray(fs.cat_file(f"{BUCKET}/shared/{name}"))
            body[len(body) // 2] ^= 0x01  # same size, other bytes
            fs.pipe_file(f"{BUCKET}/shared/{name}", bytes(body))
            with pytest.raises(ObjectChanged, match="changed since it was staged \\(generation "):
                remote.read_into(os.path.join(root, name), memoryview(bytearray(4096)), len(body) // 2 - 100)
        finally:
            remote.close()
        assert [n for n, what in problems() if what.startswith("is another object than rank 0 read (ETag ")] == [name]
