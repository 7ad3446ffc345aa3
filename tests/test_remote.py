"""Checkpoints behind URLs: an ``s3://`` checkpoint on a real S3-compatible server (moto's server mode, started
here on 127.0.0.1 and a free port, stopped at the end) audits the same as its local copy, read with ranged reads."""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptaudit.cli import main
from real_checkpoints import hf_sharded_directory

moto_server = pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory, scale_checkpoints: dict[str, Path]) -> Iterator[dict[str, Any]]:
    """A local S3 server holding a torch.save file, a safetensors file, a strided torch.save file, a sharded HF
    directory and a DCP directory; the environment points the S3 client at it."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                            "AWS_ENDPOINT_URL")}
    try:
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                          AWS_DEFAULT_REGION="us-east-1",
                          AWS_ENDPOINT_URL=f"http://127.0.0.1:{server._server.server_port}")
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.mkdir("ckpts")
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
        fs.put(str(scale_checkpoints["dcp"]), "ckpts/dcp", recursive=True)
        yield {"files": {**files, "hf": hf}, "fs": fs}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def _audit(path: str) -> tuple[int, dict[str, Any], str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["audit", path, "--format", "json", "--no-progress"], stdout=out, stderr=err)
    return code, (json.loads(out.getvalue()) if out.getvalue() else {}), err.getvalue()


@pytest.mark.parametrize("name", ["ckpt.pt", "model.safetensors", "strided.pt", "hf"])
def test_s3_checkpoint_audits_the_same_as_its_local_copy(s3: dict[str, Any], name: str) -> None:
    code_remote, remote, err = _audit(f"s3://ckpts/{name}")
    code_local, local, _ = _audit(str(s3["files"][name]))
    assert code_remote == code_local, err
    assert remote["path"] == f"s3://ckpts/{name}"
    assert remote["tensors"] == local["tensors"]
    assert remote["findings"] == local["findings"]
    assert {k: v for k, v in remote.items() if k != "path"} == {k: v for k, v in local.items() if k != "path"}
    assert remote["tensors"] and all(t["hash"] for t in remote["tensors"])


def test_a_missing_object_and_a_dcp_prefix_are_clear_errors(s3: dict[str, Any]) -> None:
    code, _, err = _audit("s3://ckpts/no-such.pt")
    assert code == 2 and "s3://ckpts/no-such.pt" in err and "no such object" in err
    code, _, err = _audit("s3://ckpts/dcp")
    assert code == 2 and "DCP directory" in err and "not supported yet" in err, err


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
    from ckptaudit.formats.remote import is_url, local_path

    assert is_url("s3://b/k") and is_url("gs://b/k") and is_url("https://h/x.pt")
    assert not is_url("/tmp/x.pt") and not is_url("file:///tmp/x.pt") and not is_url("C://x")
    assert local_path("file:///tmp/x.pt") == "/tmp/x.pt" and local_path("/tmp/x.pt") == "/tmp/x.pt"
